//! File-system calls that `std` does not offer: device nodes, ownership and times of
//! symlinks themselves, extended attributes. Used by image layer application.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::{check, SysError, SysResult};

/// The kind of special file [`mknod`] creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    Char,
    Block,
    Fifo,
}

fn c_path(op: &str, path: &Path) -> SysResult<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        SysError::from_io(
            format!("{op} {}", path.display()),
            io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"),
        )
    })
}

/// Creates a character device, block device or FIFO at `path` with permission bits `mode`
/// (the umask still applies; callers set the final mode with chmod afterwards).
pub fn mknod(path: &Path, kind: NodeKind, mode: u32, major: u32, minor: u32) -> SysResult<()> {
    let c = c_path("mknod", path)?;
    let type_bits = match kind {
        NodeKind::Char => libc::S_IFCHR,
        NodeKind::Block => libc::S_IFBLK,
        NodeKind::Fifo => libc::S_IFIFO,
    };
    let dev = libc::makedev(major, minor);
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; mknod reads
    // only that string and the integer arguments.
    let ret = unsafe { libc::mknod(c.as_ptr(), type_bits | (mode & 0o7777), dev) };
    check(ret, || format!("mknod {}", path.display())).map(drop)
}

/// Changes the owner of `path` without following a symlink at its last component.
pub fn lchown(path: &Path, uid: u32, gid: u32) -> SysResult<()> {
    let c = c_path("lchown", path)?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let ret = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
    check(ret, || format!("lchown {}", path.display())).map(drop)
}

/// Sets access and modification time (seconds, nanoseconds) of `path` without following a
/// symlink at its last component.
pub fn set_times_nofollow(path: &Path, mtime_secs: i64, mtime_nsec: i64) -> SysResult<()> {
    let c = c_path("utimensat", path)?;
    let ts = libc::timespec {
        tv_sec: mtime_secs as libc::time_t,
        tv_nsec: mtime_nsec as libc::c_long,
    };
    let times = [ts, ts];
    // SAFETY: `c` is a valid NUL-terminated string and `times` is an array of exactly the
    // two timespecs utimensat reads; both outlive the call.
    let ret = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            times.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(ret, || format!("utimensat {}", path.display())).map(drop)
}

/// Sets the extended attribute `name` on `path` itself (not a symlink's target).
pub fn lsetxattr(path: &Path, name: &str, value: &[u8]) -> SysResult<()> {
    let c = c_path("lsetxattr", path)?;
    let n = CString::new(name).map_err(|_| {
        SysError::from_io(
            format!("lsetxattr {} {name}", path.display()),
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "xattr name contains a NUL byte",
            ),
        )
    })?;
    // SAFETY: `c` and `n` are valid NUL-terminated strings and `value` is a live slice whose
    // pointer and length are passed together; the kernel only reads them.
    let ret = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(ret, || format!("lsetxattr {} {name}", path.display())).map(drop)
}

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn scratch(name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("aenv-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    #[test]
    fn mknod_makes_a_real_char_device_and_fifo() {
        if effective_uid() != 0 {
            return;
        }
        let d = scratch("mknod");
        let dev = d.join("null");
        mknod(&dev, NodeKind::Char, 0o666, 1, 3).unwrap();
        let md = std::fs::symlink_metadata(&dev).unwrap();
        assert!(md.file_type().is_char_device());
        assert_eq!(md.rdev(), libc::makedev(1, 3));
        let fifo = d.join("fifo");
        mknod(&fifo, NodeKind::Fifo, 0o600, 0, 0).unwrap();
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn lchown_and_times_apply_to_the_symlink_itself() {
        if effective_uid() != 0 {
            return;
        }
        let d = scratch("lchown");
        let target = d.join("target");
        std::fs::write(&target, b"x").unwrap();
        let link = d.join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        lchown(&link, 1234, 4321).unwrap();
        set_times_nofollow(&link, 1_000_000, 0).unwrap();
        let lmd = std::fs::symlink_metadata(&link).unwrap();
        assert_eq!((lmd.uid(), lmd.gid(), lmd.mtime()), (1234, 4321, 1_000_000));
        let tmd = std::fs::metadata(&target).unwrap();
        assert_eq!(tmd.uid(), 0);
        assert_ne!(tmd.mtime(), 1_000_000);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
