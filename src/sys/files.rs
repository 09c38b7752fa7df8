//! File-system calls that `std` does not offer, all relative to an open directory
//! ([`DirFd`]): device nodes, ownership and times of symlinks themselves, extended
//! attributes, removal without following symlinks. Used by image layer application.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::{check, SysError, SysResult};

/// The kind of special file [`DirFd::mknod`] creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    Char,
    Block,
    Fifo,
}

fn c_name(op: &str, name: &OsStr) -> SysResult<CString> {
    CString::new(name.as_bytes()).map_err(|_| {
        SysError::from_io(
            format!("{op} {}", name.to_string_lossy()),
            io::Error::new(io::ErrorKind::InvalidInput, "name contains a NUL byte"),
        )
    })
}

/// What [`DirFd::stat`] says about an entry (never a symlink's target).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub kind: FileKind,
    pub ino: u64,
    pub nlink: u64,
    /// 512-byte blocks allocated.
    pub blocks: u64,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Access, modification and status-change times: seconds and nanoseconds since the
    /// epoch.
    pub atime: (i64, i64),
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    Dir,
    Symlink,
    Regular,
    CharDevice,
    BlockDevice,
    Fifo,
    Socket,
}

impl FileKind {
    /// What the entry is, for a message (`a character device`).
    pub fn describe(self) -> &'static str {
        match self {
            FileKind::Dir => "a directory",
            FileKind::Symlink => "a symlink",
            FileKind::Regular => "a regular file",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Fifo => "a FIFO",
            FileKind::Socket => "a socket",
        }
    }

    /// A device node, FIFO or socket: opening one may block, reach a device or fail.
    pub fn is_special(self) -> bool {
        !matches!(self, FileKind::Dir | FileKind::Symlink | FileKind::Regular)
    }

    fn of_mode(mode: libc::mode_t) -> FileKind {
        match mode & libc::S_IFMT {
            libc::S_IFDIR => FileKind::Dir,
            libc::S_IFLNK => FileKind::Symlink,
            libc::S_IFREG => FileKind::Regular,
            libc::S_IFCHR => FileKind::CharDevice,
            libc::S_IFBLK => FileKind::BlockDevice,
            libc::S_IFIFO => FileKind::Fifo,
            // S_IFSOCK, the one format left.
            _ => FileKind::Socket,
        }
    }

    /// The kind of the open `file` (`fstat`).
    pub fn of_file(file: &File) -> io::Result<FileKind> {
        use std::os::unix::fs::MetadataExt;
        Ok(FileKind::of_mode(file.metadata()?.mode() as libc::mode_t))
    }
}

/// An open directory, the anchor of `*at` calls: every operation names one entry *in*
/// it (a single path component), never follows a symlink at that entry, and so can
/// neither leave the directory nor be redirected by a symlink swapped in along a path.
#[derive(Debug)]
pub struct DirFd {
    fd: OwnedFd,
}

impl DirFd {
    /// Opens the directory `path` (trusted: the caller's own, e.g. an image root).
    pub fn open(path: &Path) -> SysResult<DirFd> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
            SysError::from_errno(
                format!("open {}: NUL in path", path.display()),
                libc::EINVAL,
            )
        })?;
        // SAFETY: `c` is a valid C string that outlives the call.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        check(fd, || format!("open directory {}", path.display()))?;
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DirFd { fd })
    }

    /// Opens the subdirectory `name`; fails (`ENOTDIR`, or `ELOOP`) if it is a symlink or
    /// not a directory.
    pub fn open_dir(&self, name: &OsStr) -> SysResult<DirFd> {
        let c = c_name("openat", name)?;
        // SAFETY: `c` is a valid C string that outlives the call; the dir fd is open.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        check(fd, || format!("openat {}", name.to_string_lossy()))?;
        // SAFETY: `fd` was just opened and is owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DirFd { fd })
    }

    /// The entry `name` itself; `None` if there is none.
    pub fn stat(&self, name: &OsStr) -> SysResult<Option<Stat>> {
        let c = c_name("fstatat", name)?;
        // SAFETY: an all-zero `stat` is a valid value; fstatat fills it.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `c` and `st` are valid for the call; the dir fd is open.
        let ret = unsafe {
            libc::fstatat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if ret < 0 {
            let e = SysError::last(format!("fstatat {}", name.to_string_lossy()));
            return match e.errno() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(e),
            };
        }
        let kind = FileKind::of_mode(st.st_mode);
        Ok(Some(Stat {
            kind,
            ino: st.st_ino,
            nlink: st.st_nlink,
            blocks: st.st_blocks as u64,
            size: st.st_size as u64,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            atime: (st.st_atime, st.st_atime_nsec),
            mtime: (st.st_mtime, st.st_mtime_nsec),
            ctime: (st.st_ctime, st.st_ctime_nsec),
        }))
    }

    /// Opens the entry `name` itself for reading (a directory too), never through a
    /// symlink (`ELOOP`), without blocking on a FIFO or taking a terminal; metadata calls
    /// on the returned file (`fchmod`, `fchown`) then act on exactly that inode.
    pub fn open_entry(&self, name: &OsStr) -> SysResult<File> {
        self.open_with(
            name,
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        )
    }

    /// Opens the regular file `name` for writing, created with `mode` (less the umask)
    /// when missing, truncated when present; never through a symlink (`ELOOP`), and
    /// without blocking on a FIFO (`ENXIO` without a reader) or taking a terminal: the
    /// caller checks the opened file's kind before writing.
    pub fn open_truncate(&self, name: &OsStr, mode: u32) -> SysResult<File> {
        self.open_with(
            name,
            libc::O_WRONLY
                | libc::O_CREAT
                | libc::O_TRUNC
                | libc::O_NONBLOCK
                | libc::O_NOCTTY
                | libc::O_NOFOLLOW
                | libc::O_CLOEXEC,
            mode,
        )
    }

    fn open_with(&self, name: &OsStr, flags: libc::c_int, mode: u32) -> SysResult<File> {
        let c = c_name("openat", name)?;
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let fd =
            unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags, mode as libc::c_uint) };
        check(fd, || format!("openat {}", name.to_string_lossy()))?;
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// The names in this directory (without `.` and `..`).
    pub fn entries(&self) -> SysResult<Vec<OsString>> {
        let op = || "readdir".to_string();
        // SAFETY: dup of an open fd; the copy is handed to fdopendir, which owns it.
        let dup = unsafe { libc::fcntl(self.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        check(dup, op)?;
        // SAFETY: `dup` is an open directory fd that the DIR stream takes over.
        let dir = unsafe { libc::fdopendir(dup) };
        if dir.is_null() {
            let e = SysError::last(op());
            // SAFETY: fdopendir failed, so `dup` is still ours to close.
            unsafe { libc::close(dup) };
            return Err(e);
        }
        // The stream starts where the fd's offset is: rewind (the fd may have been read).
        // SAFETY: `dir` is a valid stream until closedir below.
        unsafe { libc::rewinddir(dir) };
        let mut names = Vec::new();
        let result = loop {
            // readdir signals errors only through errno.
            // SAFETY: __errno_location returns this thread's errno slot.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `dir` is a valid stream.
            let entry = unsafe { libc::readdir(dir) };
            if entry.is_null() {
                // SAFETY: as above.
                let errno = unsafe { *libc::__errno_location() };
                break if errno == 0 {
                    Ok(())
                } else {
                    Err(SysError::from_errno(op(), errno))
                };
            }
            // SAFETY: `d_name` of a returned entry is a NUL-terminated string valid until
            // the next readdir; it is copied at once.
            let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) };
            let bytes = name.to_bytes();
            if bytes != b"." && bytes != b".." {
                names.push(OsStr::from_bytes(bytes).to_os_string());
            }
        };
        // SAFETY: `dir` is valid and closed once.
        unsafe { libc::closedir(dir) };
        result.map(|()| names)
    }

    /// Creates the directory `name` with `mode` (less the umask).
    pub fn mkdir(&self, name: &OsStr, mode: u32) -> SysResult<()> {
        let c = c_name("mkdirat", name)?;
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let ret = unsafe { libc::mkdirat(self.fd.as_raw_fd(), c.as_ptr(), mode as libc::mode_t) };
        check(ret, || format!("mkdirat {}", name.to_string_lossy())).map(drop)
    }

    /// Removes the entry `name`: an empty directory with `dir`, anything else without.
    pub fn remove(&self, name: &OsStr, dir: bool) -> SysResult<()> {
        let c = c_name("unlinkat", name)?;
        let flags = if dir { libc::AT_REMOVEDIR } else { 0 };
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let ret = unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), flags) };
        check(ret, || format!("unlinkat {}", name.to_string_lossy())).map(drop)
    }

    /// Creates the symlink `name` pointing at `target` (stored as given, never resolved
    /// here).
    pub fn symlink(&self, name: &OsStr, target: &OsStr) -> SysResult<()> {
        let c = c_name("symlinkat", name)?;
        let t = c_name("symlinkat", target)?;
        // SAFETY: both strings are valid for the call; the dir fd is open.
        let ret = unsafe { libc::symlinkat(t.as_ptr(), self.fd.as_raw_fd(), c.as_ptr()) };
        check(ret, || format!("symlinkat {}", name.to_string_lossy())).map(drop)
    }

    /// The target of the symlink `name`.
    pub fn read_link(&self, name: &OsStr) -> SysResult<OsString> {
        let c = c_name("readlinkat", name)?;
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: `buf` is writable for its length; `c` is valid; the dir fd is open.
        let n = unsafe {
            libc::readlinkat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(SysError::last(format!(
                "readlinkat {}",
                name.to_string_lossy()
            )));
        }
        buf.truncate(n as usize);
        Ok(OsString::from_vec(buf))
    }

    /// Hard-links `from`'s entry `from_name` (itself, even a symlink) as `name` here.
    pub fn hard_link(&self, name: &OsStr, from: &DirFd, from_name: &OsStr) -> SysResult<()> {
        let c = c_name("linkat", name)?;
        let f = c_name("linkat", from_name)?;
        // SAFETY: both strings are valid for the call; both dir fds are open. Flags 0:
        // a symlink is linked itself, not followed.
        let ret = unsafe {
            libc::linkat(
                from.fd.as_raw_fd(),
                f.as_ptr(),
                self.fd.as_raw_fd(),
                c.as_ptr(),
                0,
            )
        };
        check(ret, || format!("linkat {}", name.to_string_lossy())).map(drop)
    }

    /// Creates a character device, block device or FIFO `name` with permission bits
    /// `mode` (less the umask).
    pub fn mknod(
        &self,
        name: &OsStr,
        kind: NodeKind,
        mode: u32,
        major: u32,
        minor: u32,
    ) -> SysResult<()> {
        let c = c_name("mknodat", name)?;
        let type_bits = match kind {
            NodeKind::Char => libc::S_IFCHR,
            NodeKind::Block => libc::S_IFBLK,
            NodeKind::Fifo => libc::S_IFIFO,
        };
        let dev = libc::makedev(major, minor);
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let ret = unsafe {
            libc::mknodat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                type_bits | (mode & 0o7777),
                dev,
            )
        };
        check(ret, || format!("mknodat {}", name.to_string_lossy())).map(drop)
    }

    /// Creates the new, empty regular file `name` (never through an existing entry).
    pub fn create_file(&self, name: &OsStr, mode: u32) -> SysResult<File> {
        let c = c_name("openat", name)?;
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let fd = unsafe {
            libc::openat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                mode as libc::c_uint,
            )
        };
        check(fd, || format!("create {}", name.to_string_lossy()))?;
        // SAFETY: `fd` was just opened and is owned by nothing else.
        Ok(unsafe { File::from_raw_fd(fd) })
    }

    /// Changes the owner of the entry `name` itself (`.`: this directory).
    pub fn chown(&self, name: &OsStr, uid: u32, gid: u32) -> SysResult<()> {
        let c = c_name("fchownat", name)?;
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let ret = unsafe {
            libc::fchownat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                uid,
                gid,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        check(ret, || format!("fchownat {}", name.to_string_lossy())).map(drop)
    }

    /// Sets the permission bits of the entry `name`, which must not be a symlink (Linux
    /// cannot chmod a link itself); one is refused.
    pub fn chmod(&self, name: &OsStr, mode: u32) -> SysResult<()> {
        if self
            .stat(name)?
            .is_some_and(|s| s.kind == FileKind::Symlink)
        {
            return Err(SysError::from_errno(
                format!("chmod {}: a symlink", name.to_string_lossy()),
                libc::ELOOP,
            ));
        }
        let c = c_name("fchmodat", name)?;
        // SAFETY: `c` is valid for the call; the dir fd is open.
        let ret =
            unsafe { libc::fchmodat(self.fd.as_raw_fd(), c.as_ptr(), mode as libc::mode_t, 0) };
        check(ret, || format!("fchmodat {}", name.to_string_lossy())).map(drop)
    }

    /// Sets access and modification time of the entry `name` itself.
    pub fn set_times(&self, name: &OsStr, secs: i64, nsec: i64) -> SysResult<()> {
        let c = c_name("utimensat", name)?;
        let ts = libc::timespec {
            tv_sec: secs as libc::time_t,
            tv_nsec: nsec as libc::c_long,
        };
        let times = [ts, ts];
        // SAFETY: `c` is valid and `times` is the array of two timespecs utimensat reads;
        // the dir fd is open.
        let ret = unsafe {
            libc::utimensat(
                self.fd.as_raw_fd(),
                c.as_ptr(),
                times.as_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        check(ret, || format!("utimensat {}", name.to_string_lossy())).map(drop)
    }

    /// The path of the entry `name` through this descriptor (`/proc/self/fd/N/name`), for
    /// calls that only take paths: the lookup starts at this very directory, wherever it
    /// is now, and only `name` is resolved below it.
    pub fn entry_path(&self, name: &OsStr) -> PathBuf {
        Path::new(&format!("/proc/self/fd/{}", self.fd.as_raw_fd())).join(name)
    }

    /// Sets the extended attribute `xattr` on the entry `name` itself.
    pub fn set_xattr(&self, name: &OsStr, xattr: &str, value: &[u8]) -> SysResult<()> {
        let path = self.entry_path(name);
        let c = c_name("lsetxattr", path.as_os_str())?;
        let n = c_name("lsetxattr", OsStr::new(xattr))?;
        // SAFETY: `c` and `n` are valid C strings and `value` a live slice passed with its
        // length; the kernel only reads them.
        let ret = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                n.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        check(ret, || {
            format!("lsetxattr {} {xattr}", name.to_string_lossy())
        })
        .map(drop)
    }
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
        assert_eq!(effective_uid(), 0, "needs root: run the suite with sudo");
        let d = scratch("mknod");
        let dir = DirFd::open(&d).unwrap();
        dir.mknod(OsStr::new("null"), NodeKind::Char, 0o666, 1, 3)
            .unwrap();
        let md = std::fs::symlink_metadata(d.join("null")).unwrap();
        assert!(md.file_type().is_char_device());
        assert_eq!(md.rdev(), libc::makedev(1, 3));
        dir.mknod(OsStr::new("fifo"), NodeKind::Fifo, 0o600, 0, 0)
            .unwrap();
        assert!(std::fs::symlink_metadata(d.join("fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn operations_apply_to_the_entry_itself_never_through_a_symlink() {
        assert_eq!(effective_uid(), 0, "needs root: run the suite with sudo");
        let d = scratch("at");
        let outside = scratch("at-outside");
        std::fs::write(outside.join("victim"), b"x").unwrap();
        let dir = DirFd::open(&d).unwrap();
        let link = OsStr::new("link");
        dir.symlink(link, outside.as_os_str()).unwrap();
        dir.chown(link, 1234, 4321).unwrap();
        dir.set_times(link, 1_000_000, 0).unwrap();
        let lmd = std::fs::symlink_metadata(d.join("link")).unwrap();
        assert_eq!((lmd.uid(), lmd.gid(), lmd.mtime()), (1234, 4321, 1_000_000));
        let tmd = std::fs::metadata(&outside).unwrap();
        assert_eq!(tmd.uid(), 0);
        assert_ne!(tmd.mtime(), 1_000_000);
        assert_eq!(dir.read_link(link).unwrap(), outside.as_os_str());
        assert_eq!(dir.stat(link).unwrap().unwrap().kind, FileKind::Symlink);
        // Never entered, chmodded or created through.
        let e = dir.open_dir(link).unwrap_err();
        assert!(
            matches!(e.errno(), Some(libc::ELOOP) | Some(libc::ENOTDIR)),
            "{e}"
        );
        assert!(dir.chmod(link, 0o777).is_err());
        assert!(dir.create_file(link, 0o600).is_err());
        dir.remove(link, false).unwrap();
        assert!(outside.join("victim").exists());
        dir.mkdir(OsStr::new("sub"), 0o755).unwrap();
        let sub = dir.open_dir(OsStr::new("sub")).unwrap();
        drop(sub.create_file(OsStr::new("f"), 0o600).unwrap());
        assert_eq!(sub.entries().unwrap(), [OsString::from("f")]);
        assert!(dir.stat(OsStr::new("missing")).unwrap().is_none());
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }
}
