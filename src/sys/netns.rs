//! Network namespaces bound to files, iproute2 style (`<dir>/<name>`, a bind mount of
//! `/proc/thread-self/ns/net`).
//!
//! Only short-lived dedicated threads ever change their namespace; the long-lived server
//! threads stay in the root namespace.

use super::{check, SysError, SysResult};
use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

fn cpath(path: &Path) -> SysResult<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        SysError::from_errno(
            format!("path {} contains a NUL byte", path.display()),
            libc::EINVAL,
        )
    })
}

fn mount(src: &Path, dst: &Path, flags: libc::c_ulong) -> SysResult<()> {
    let s = cpath(src)?;
    let d = cpath(dst)?;
    let none = c"none";
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call;
    // a NULL data argument is allowed.
    let ret = unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            none.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    check(ret, || {
        format!("mount {} on {}", src.display(), dst.display())
    })
    .map(|_| ())
}

/// Makes sure `dir` exists and is a shared mount point (bound onto itself if needed), as
/// `ip netns add` does, so namespace files are visible in other mount namespaces too.
pub fn ensure_shared_dir(dir: &Path) -> SysResult<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| SysError::from_io(format!("create {}", dir.display()), e))?;
    let shared = libc::MS_SHARED | libc::MS_REC;
    match mount(Path::new("none"), dir, shared) {
        Ok(()) => Ok(()),
        Err(e) if e.errno() == Some(libc::EINVAL) => {
            mount(dir, dir, libc::MS_BIND | libc::MS_REC)?;
            mount(Path::new("none"), dir, shared)
        }
        Err(e) => Err(e),
    }
}

/// Creates the (empty, mode 0444) namespace file; fails if it already exists.
pub fn create_ns_file(path: &Path) -> SysResult<()> {
    let c = cpath(path)?;
    // SAFETY: `c` is a valid NUL-terminated path; the returned fd is checked and closed.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o444 as libc::c_uint,
        )
    };
    check(fd, || format!("create {}", path.display()))?;
    // SAFETY: `fd` was just returned by open and is owned by nobody else.
    unsafe { libc::close(fd) };
    Ok(())
}

/// Removes the namespace file. Returns `false` when it did not exist.
pub fn remove_ns_file(path: &Path) -> SysResult<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(SysError::from_io(format!("unlink {}", path.display()), e)),
    }
}

/// Lazily unmounts the namespace file. Returns `false` when nothing was mounted there.
pub fn unmount_ns_file(path: &Path) -> SysResult<bool> {
    let c = cpath(path)?;
    // SAFETY: `c` is a valid NUL-terminated path.
    let ret = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    match check(ret, || format!("unmount {}", path.display())) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.errno(), Some(libc::EINVAL) | Some(libc::ENOENT)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Moves the calling thread into the network namespace `ns`.
pub fn enter(ns: BorrowedFd) -> SysResult<()> {
    // SAFETY: setns on a valid descriptor; affects only the calling thread.
    let ret = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    check(ret, || "setns(CLONE_NEWNET)".to_string()).map(|_| ())
}

/// Runs `f` on a fresh thread inside a **new** network namespace that is first bound onto
/// `path` (which must exist, see [`create_ns_file`]). If `f` fails, the bind mount is
/// undone before returning, so on error nothing is left mounted.
pub fn with_new_netns<R: Send>(
    path: &Path,
    f: impl FnOnce() -> SysResult<R> + Send,
) -> SysResult<R> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare only changes the calling thread, which is dedicated to this
            // namespace and exits when done.
            let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            check(ret, || "unshare(CLONE_NEWNET)".to_string())?;
            mount(Path::new("/proc/thread-self/ns/net"), path, libc::MS_BIND)?;
            f().inspect_err(|_| {
                let _ = unmount_ns_file(path);
            })
        })
        .join()
        .unwrap_or_else(|_| Err(SysError::from_errno("netns thread panicked", libc::EIO)))
    })
}

/// Runs `f` on a fresh thread inside the existing namespace `ns`.
pub fn with_netns<R: Send>(ns: &File, f: impl FnOnce() -> SysResult<R> + Send) -> SysResult<R> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter(ns.as_fd())?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(SysError::from_errno("netns thread panicked", libc::EIO)))
    })
}

/// Opens a namespace file (O_CLOEXEC, as every std `File`).
pub fn open(path: &Path) -> SysResult<File> {
    File::open(path).map_err(|e| SysError::from_io(format!("open {}", path.display()), e))
}

/// Arranges for `cmd`, when spawned, to enter the network namespace `netns` between fork
/// and exec. `netns` must stay open until `cmd.spawn()` has returned.
pub fn spawn_in_netns(cmd: &mut Command, netns: &File) {
    let fd = netns.as_raw_fd();
    // SAFETY: the closure only calls setns(2), which is async-signal-safe, on a descriptor
    // the caller keeps open until spawn returns; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Identity (device, inode) of a namespace, from its file or a `/proc/<pid>/ns/net` link.
pub fn ns_id(path: &Path) -> SysResult<(u64, u64)> {
    let m = std::fs::metadata(path)
        .map_err(|e| SysError::from_io(format!("stat {}", path.display()), e))?;
    Ok((m.dev(), m.ino()))
}

/// Processes (and threads) whose network namespace is `id`.
pub fn pids_in_netns(id: (u64, u64)) -> Vec<u32> {
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let tasks = format!("/proc/{pid}/task");
        let Ok(tdir) = std::fs::read_dir(&tasks) else {
            continue;
        };
        for t in tdir.flatten() {
            let p = t.path().join("ns/net");
            if ns_id(&p).ok() == Some(id) {
                pids.push(pid);
                break;
            }
        }
    }
    pids
}

/// Writes a sysctl under `/proc/sys/` (in the calling thread's network namespace for
/// `net.*` keys). A missing key (IPv6 compiled out, for example) is reported as ENOENT.
pub fn write_sysctl(key: &str, value: &str) -> SysResult<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| SysError::from_io(format!("write {path}"), e))
}
