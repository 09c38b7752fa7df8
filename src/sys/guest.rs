//! Raw calls the in-guest agent needs: mounts, module loading, interface setup through
//! ioctls, the clock, process groups, waiting and polling.
//!
//! Used by `crate::guest` only; nothing here is called on the host server.

use std::ffi::CString;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use super::{check, SysError, SysResult};

fn cstring(op: &str, path: &Path) -> SysResult<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        SysError::from_io(
            format!("{op} {}", path.display()),
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"),
        )
    })
}

/// `mount(2)`. `source` and `fstype` may be empty (passed as NULL for `fstype`).
pub fn mount(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> SysResult<()> {
    let op = || format!("mount {source} on {} ({fstype})", target.display());
    let c_source = CString::new(source).map_err(|_| SysError::from_errno(op(), libc::EINVAL))?;
    let c_target = cstring("mount", target)?;
    let c_fstype = CString::new(fstype).map_err(|_| SysError::from_errno(op(), libc::EINVAL))?;
    let c_data = CString::new(data).map_err(|_| SysError::from_errno(op(), libc::EINVAL))?;
    let fstype_ptr = if fstype.is_empty() {
        std::ptr::null()
    } else {
        c_fstype.as_ptr()
    };
    let data_ptr = if data.is_empty() {
        std::ptr::null()
    } else {
        c_data.as_ptr().cast::<libc::c_void>()
    };
    // SAFETY: all pointers are either NULL or point to NUL-terminated strings that outlive
    // the call.
    let ret = unsafe {
        libc::mount(
            c_source.as_ptr(),
            c_target.as_ptr(),
            fstype_ptr,
            flags,
            data_ptr,
        )
    };
    check(ret, op).map(drop)
}

/// The file system type of `path` (`statfs(2)`'s `f_type`, e.g. `NFS_SUPER_MAGIC`).
pub fn filesystem_type(path: &Path) -> SysResult<i64> {
    let c_path = cstring("statfs", path)?;
    // SAFETY: an all-zero `statfs` is a valid value; statfs fills it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a valid C string and `st` is writable for the call.
    let ret = unsafe { libc::statfs(c_path.as_ptr(), &mut st) };
    check(ret, || format!("statfs {}", path.display()))?;
    Ok(st.f_type as i64)
}

/// `umount2(2)` with the given flags (e.g. `MNT_DETACH`).
pub fn umount(target: &Path, flags: libc::c_int) -> SysResult<()> {
    let c_target = cstring("umount", target)?;
    // SAFETY: c_target is a valid NUL-terminated string.
    let ret = unsafe { libc::umount2(c_target.as_ptr(), flags) };
    check(ret, || format!("umount {}", target.display())).map(drop)
}

/// Loads a kernel module from a file with `finit_module(2)`. Already loaded is success.
pub fn load_module(path: &Path) -> SysResult<()> {
    let file =
        File::open(path).map_err(|e| SysError::from_io(format!("open {}", path.display()), e))?;
    let params = c"";
    // SAFETY: the fd is open for the duration of the call and params is a valid C string.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if ret < 0 {
        let err = SysError::last(format!("finit_module {}", path.display()));
        if err.errno() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(err);
    }
    Ok(())
}

/// `chroot(2)` into the current directory's mount after an `MS_MOVE` onto `/`.
pub fn chroot(path: &Path) -> SysResult<()> {
    std::os::unix::fs::chroot(path)
        .map_err(|e| SysError::from_io(format!("chroot {}", path.display()), e))
}

/// `sethostname(2)`.
pub fn set_hostname(name: &str) -> SysResult<()> {
    // SAFETY: the pointer and length describe the bytes of `name`.
    let ret = unsafe { libc::sethostname(name.as_ptr().cast::<libc::c_char>(), name.len()) };
    check(ret, || format!("sethostname {name}")).map(drop)
}

/// Sets `CLOCK_REALTIME` to the given Unix time in nanoseconds.
pub fn set_realtime(unix_nanos: u128) -> SysResult<()> {
    let ts = libc::timespec {
        tv_sec: (unix_nanos / 1_000_000_000) as libc::time_t,
        tv_nsec: (unix_nanos % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: ts is a valid timespec on the stack.
    let ret = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) };
    check(ret, || "clock_settime CLOCK_REALTIME".to_string()).map(drop)
}

/// Writes every filesystem's dirty data to its disk (`sync(2)`, which cannot fail).
pub fn sync_filesystems() {
    // SAFETY: sync takes no arguments and touches no memory of ours.
    unsafe { libc::sync() }
}

/// Largest list of xattr names (or value) read from one file; the kernel's own limit.
const XATTR_MAX: usize = 64 * 1024;

/// Sets the extended attribute `name` of the open `file` to `value` (`fsetxattr(2)`).
pub fn set_xattr(file: &File, name: &str, value: &[u8]) -> SysResult<()> {
    let op = || format!("fsetxattr {name}");
    let c = CString::new(name).map_err(|_| SysError::from_errno(op(), libc::EINVAL))?;
    // SAFETY: the fd is open for the call, `c` a valid C string, and `value` a live slice
    // passed with its length; the kernel only reads them.
    let ret = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            c.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(ret, op).map(drop)
}

/// The extended attributes of `path` itself (a final symlink is not followed) whose names
/// start with `prefix`, with their values (`llistxattr(2)`, `lgetxattr(2)`). A file
/// system without xattrs has none.
pub fn xattrs_with_prefix(path: &Path, prefix: &str) -> SysResult<Vec<(String, Vec<u8>)>> {
    let c = cstring("llistxattr", path)?;
    let mut names = vec![0u8; XATTR_MAX];
    // SAFETY: `c` is a valid C string; the buffer is live and its length passed.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        let e = SysError::last(format!("llistxattr {}", path.display()));
        return match e.errno() {
            Some(libc::ENOTSUP) => Ok(Vec::new()),
            _ => Err(e),
        };
    }
    names.truncate(n as usize);
    let mut out = Vec::new();
    for name in names
        .split(|b| *b == 0)
        .filter(|n| n.starts_with(prefix.as_bytes()))
    {
        let Ok(name_c) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; XATTR_MAX];
        // SAFETY: both C strings are valid; the buffer is live and its length passed.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                name_c.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len < 0 {
            // Removed since the list was read.
            continue;
        }
        value.truncate(len as usize);
        out.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    Ok(out)
}

/// Sets the process umask; returns the previous one.
pub fn set_umask(mask: u32) -> u32 {
    // SAFETY: umask cannot fail and touches no memory.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

/// Total and available bytes of the filesystem holding `path` (`statvfs(3)`).
pub fn filesystem_space(path: &Path) -> SysResult<(u64, u64)> {
    let c = cstring("statvfs", path)?;
    // SAFETY: statvfs is plain old data; all-zero bytes are a valid value of it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid, writable statvfs.
    let ret = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    check(ret, || format!("statvfs {}", path.display()))?;
    let unit = st.f_frsize as u64;
    Ok((st.f_blocks as u64 * unit, st.f_bavail as u64 * unit))
}

/// Whether the process runs with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() == 0 }
}

/// Powers the machine off (PID 1 only). Returns only on failure.
pub fn power_off() -> SysError {
    // SAFETY: sync and reboot take no pointers.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    SysError::last("reboot(RB_POWER_OFF)")
}

/// Sends `signal` to every process in process group `pgid`.
pub fn kill_group(pgid: i32, signal: libc::c_int) -> SysResult<()> {
    // SAFETY: kill takes no pointers.
    let ret = unsafe { libc::kill(-pgid, signal) };
    check(ret, || format!("kill -{signal} group {pgid}")).map(drop)
}

/// How a waited-for child ended, decoded from the `waitpid` status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Exited(i32),
    Signaled(i32),
}

fn decode_status(status: libc::c_int) -> Option<ExitStatus> {
    if libc::WIFEXITED(status) {
        Some(ExitStatus::Exited(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitStatus::Signaled(libc::WTERMSIG(status)))
    } else {
        None
    }
}

/// Blocking `waitpid(pid, 0)`; `pid == -1` waits for any child. Returns the pid that
/// ended and its status. Retries on EINTR.
pub fn wait_child(pid: i32) -> SysResult<(i32, ExitStatus)> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: status is a valid out-pointer for the duration of the call.
        let ret = unsafe { libc::waitpid(pid, &mut status, 0) };
        if ret < 0 {
            let err = SysError::last(format!("waitpid {pid}"));
            if err.errno() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        if let Some(decoded) = decode_status(status) {
            return Ok((ret, decoded));
        }
    }
}

/// Sets `O_NONBLOCK` on an open file description.
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> SysResult<()> {
    // SAFETY: fcntl(F_GETFL) takes no pointer; the fd is open for the call.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    let flags = check(flags, || "fcntl F_GETFL".to_string())?;
    // SAFETY: fcntl(F_SETFL) takes the flags by value; the fd is open for the call.
    let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) };
    check(ret, || "fcntl F_SETFL O_NONBLOCK".to_string()).map(drop)
}

/// `struct f_owner_ex` and its constants (Linux UAPI `asm-generic/fcntl.h`; not in the
/// libc crate for every target).
#[repr(C)]
struct FOwnerEx {
    kind: libc::c_int,
    pid: libc::pid_t,
}
const F_SETOWN_EX: libc::c_int = 15;
const F_OWNER_TID: libc::c_int = 0;

/// Waits, without polling, for the host end of a virtio-serial port to connect.
///
/// While no host is connected the port's driver answers `read` with EOF and `poll` with
/// `POLLHUP` at once, so neither can wait; but with `O_ASYNC` it sends `SIGIO` to the
/// file's owner when the host connects (and when data arrives). [`HostConnectWait::arm`]
/// blocks `SIGIO` in the calling thread and makes that thread the owner, so the signal
/// stays pending until [`HostConnectWait::wait`] takes it with `sigtimedwait`: a connect
/// between the check and the wait is not lost. Other threads never receive it.
pub struct HostConnectWait {
    set: libc::sigset_t,
}

impl HostConnectWait {
    /// Arms `fd` (the port) for the calling thread, which must be the one that waits.
    pub fn arm(fd: BorrowedFd<'_>) -> SysResult<HostConnectWait> {
        // SAFETY: sigset_t is plain old data; sigemptyset initialises it before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: set is a valid sigset_t; SIGIO is a valid signal number.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGIO);
        }
        // SAFETY: set is initialised; the old mask is not wanted (null is allowed).
        let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        if ret != 0 {
            return Err(SysError::from_errno("pthread_sigmask SIG_BLOCK SIGIO", ret));
        }
        let owner = FOwnerEx {
            kind: F_OWNER_TID,
            // SAFETY: gettid has no preconditions.
            pid: unsafe { libc::gettid() },
        };
        // SAFETY: owner is a valid f_owner_ex for the duration of the call; fd is open.
        let ret = unsafe { libc::fcntl(fd.as_raw_fd(), F_SETOWN_EX, &owner) };
        check(ret, || "fcntl F_SETOWN_EX".to_string())?;
        // SAFETY: fcntl(F_GETFL) takes no pointer; the fd is open for the call.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        let flags = check(flags, || "fcntl F_GETFL".to_string())?;
        // SAFETY: fcntl(F_SETFL) takes the flags by value; the fd is open for the call.
        let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_ASYNC) };
        check(ret, || "fcntl F_SETFL O_ASYNC".to_string())?;
        Ok(HostConnectWait { set })
    }

    /// Returns true once a host is connected to `fd`, false when `limit` passed first.
    /// Call on the thread that armed it.
    pub fn wait(&self, fd: BorrowedFd<'_>, limit: Duration) -> SysResult<bool> {
        let end = std::time::Instant::now() + limit;
        loop {
            let mut pfd = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: pfd is one valid pollfd; a zero timeout does not block.
            let ret = unsafe { libc::poll(&mut pfd, 1, 0) };
            if ret < 0 {
                let err = SysError::last("poll");
                if err.errno() != Some(libc::EINTR) {
                    return Err(err);
                }
            } else if pfd.revents & libc::POLLHUP == 0 {
                return Ok(true);
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            let timeout = libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            };
            // SAFETY: set and timeout are valid for the call; the siginfo is not wanted.
            let ret = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &timeout) };
            if ret < 0 {
                let err = SysError::last("sigtimedwait SIGIO");
                if !matches!(err.errno(), Some(libc::EAGAIN) | Some(libc::EINTR)) {
                    return Err(err);
                }
            }
        }
    }
}

/// Waits up to `timeout` until a write to `fd` will not block; false on timeout.
pub fn poll_writable(fd: BorrowedFd<'_>, timeout: Duration) -> SysResult<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    let timeout_ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: pfd is one valid pollfd.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if ret < 0 {
        let err = SysError::last("poll");
        if err.errno() == Some(libc::EINTR) {
            return Ok(false);
        }
        return Err(err);
    }
    Ok(pfd.revents != 0)
}

/// Polls `fds` for readability (or hang-up) for at most `timeout` (`None` blocks).
/// Returns one flag per fd: true when a read will not block.
pub fn poll_readable(fds: &[BorrowedFd<'_>], timeout: Option<Duration>) -> SysResult<Vec<bool>> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let timeout_ms = match timeout {
        None => -1,
        Some(d) => d.as_millis().min(i32::MAX as u128) as libc::c_int,
    };
    // SAFETY: pfds is a valid array of pollfd of the given length.
    let ret = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    if ret < 0 {
        let err = SysError::last("poll");
        if err.errno() == Some(libc::EINTR) {
            return Ok(vec![false; fds.len()]);
        }
        return Err(err);
    }
    Ok(pfds.iter().map(|p| p.revents != 0).collect())
}

/// Which child has ended, without reaping it (`waitid(P_ALL, WEXITED | WNOWAIT)`), so
/// the caller can take a lock before the status is consumed. Retries on EINTR.
pub fn peek_ended_child() -> SysResult<i32> {
    loop {
        // SAFETY: siginfo_t is plain old data; all-zero is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: info is a valid out-pointer for the duration of the call.
        let ret = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if ret < 0 {
            let err = SysError::last("waitid P_ALL");
            if err.errno() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        // SAFETY: waitid with WEXITED filled in a SIGCHLD siginfo, whose si_pid is set.
        return Ok(unsafe { info.si_pid() });
    }
}

/// Non-blocking `waitpid(pid, WNOHANG)`: the status when `pid` has ended (and is now
/// reaped), `None` while it runs.
pub fn try_reap(pid: i32) -> SysResult<Option<ExitStatus>> {
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: status is a valid out-pointer for the duration of the call.
        let ret = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if ret < 0 {
            let err = SysError::last(format!("waitpid {pid}"));
            if err.errno() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        if ret == 0 {
            return Ok(None);
        }
        return Ok(decode_status(status));
    }
}

/// Sends `signal` to one process.
pub fn signal_pid(pid: i32, signal: libc::c_int) -> SysResult<()> {
    // SAFETY: kill takes no pointers.
    let ret = unsafe { libc::kill(pid, signal) };
    check(ret, || format!("kill -{signal} {pid}")).map(drop)
}

/// A new pseudo-terminal pair of the given size; both ends are close-on-exec and the
/// slave is not made anyone's controlling terminal yet.
pub fn open_pty(rows: u16, cols: u16) -> SysResult<(OwnedFd, OwnedFd)> {
    // SAFETY: posix_openpt takes flags by value.
    let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    let fd = check(fd, || "posix_openpt".to_string())?;
    // SAFETY: fd was just returned by posix_openpt and is owned by nobody else.
    let master = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: master is an open pty master for both calls.
    check(unsafe { libc::grantpt(master.as_raw_fd()) }, || {
        "grantpt".to_string()
    })?;
    // SAFETY: as above.
    check(unsafe { libc::unlockpt(master.as_raw_fd()) }, || {
        "unlockpt".to_string()
    })?;
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: name is a writable buffer of the length passed.
    let ret = unsafe { libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len()) };
    if ret != 0 {
        return Err(SysError::from_errno("ptsname_r", ret));
    }
    // SAFETY: ptsname_r wrote a NUL-terminated path into name.
    let slave = unsafe {
        libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    let slave = check(slave, || "open pty slave".to_string())?;
    // SAFETY: slave was just returned by open and is owned by nobody else.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    set_window_size(master.as_fd(), rows, cols)?;
    Ok((master, slave))
}

/// Sets a terminal's window size (`TIOCSWINSZ`); the foreground job gets SIGWINCH.
pub fn set_window_size(fd: BorrowedFd<'_>, rows: u16, cols: u16) -> SysResult<()> {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: size is a valid winsize that the kernel only reads.
    let ret = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    check(ret, || "ioctl TIOCSWINSZ".to_string()).map(drop)
}

/// Makes the child of `cmd` a session leader whose controlling terminal is its stdin
/// (the pty slave), as a login shell on a terminal expects.
pub fn controlling_terminal_on_spawn(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let hook = || -> std::io::Result<()> {
        // SAFETY: setsid takes no arguments and is async-signal-safe.
        if unsafe { libc::setsid() } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: ioctl(TIOCSCTTY) on fd 0 takes an integer argument; async-signal-safe.
        if unsafe { libc::ioctl(0, libc::TIOCSCTTY, 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child after std has set up stdio and calls only
    // async-signal-safe functions (setsid, ioctl, errno reads).
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Makes the child of `cmd` run as `uid`/`gid` with the supplementary `groups` (std's
/// `Command::uid` drops every supplementary group, so membership of `sudo`, `docker` or
/// the user's own extra groups would be lost): setgroups, setgid, setuid in the forked
/// child, before any hook registered after this one.
pub fn switch_user_on_spawn(cmd: &mut std::process::Command, uid: u32, gid: u32, groups: Vec<u32>) {
    use std::os::unix::process::CommandExt;
    let hook = move || -> std::io::Result<()> {
        let fail = |ret: libc::c_long| {
            if ret < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        // SAFETY: the pointer and length describe `groups`, owned by the closure; a raw
        // syscall in the single-threaded child, async-signal-safe.
        fail(unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) })?;
        // SAFETY: plain ids; raw syscalls, async-signal-safe.
        fail(unsafe { libc::syscall(libc::SYS_setgid, gid) })?;
        // SAFETY: as above; after setgid, which needs the privilege setuid gives up.
        fail(unsafe { libc::syscall(libc::SYS_setuid, uid) })
    };
    // SAFETY: the hook runs in the forked child and makes only raw syscalls (no
    // allocation, no locks).
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// One inotify event: the watch it belongs to, its mask and the entry name (empty for
/// events on the watched directory itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InotifyEvent {
    pub wd: i32,
    pub mask: u32,
    pub name: String,
}

/// An inotify instance (non-blocking, close-on-exec); poll its fd for readability.
pub struct Inotify {
    fd: OwnedFd,
}

impl Inotify {
    pub fn new() -> SysResult<Inotify> {
        // SAFETY: inotify_init1 takes flags by value.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        let fd = check(fd, || "inotify_init1".to_string())?;
        // SAFETY: fd was just returned by inotify_init1 and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Inotify { fd })
    }

    /// Watches `path` for `mask`; returns the watch descriptor.
    pub fn add_watch(&self, path: &Path, mask: u32) -> SysResult<i32> {
        let c_path = cstring("inotify_add_watch", path)?;
        // SAFETY: the fd is open and c_path is a valid NUL-terminated string.
        let ret = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c_path.as_ptr(), mask) };
        check(ret, || format!("inotify_add_watch {}", path.display()))
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Reads the events that are ready (none when nothing is pending).
    pub fn read_events(&self) -> SysResult<Vec<InotifyEvent>> {
        let mut buf = vec![0u8; 64 * 1024];
        // SAFETY: buf is a writable buffer of the length passed.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast::<libc::c_void>(),
                buf.len(),
            )
        };
        if n < 0 {
            let err = SysError::last("read inotify");
            return match err.errno() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(Vec::new()),
                _ => Err(err),
            };
        }
        Ok(parse_inotify(&buf[..n as usize]))
    }
}

/// Decodes a buffer of `struct inotify_event` records.
fn parse_inotify(mut buf: &[u8]) -> Vec<InotifyEvent> {
    const HEADER: usize = 16; // wd, mask, cookie, len: four 32-bit fields
    let mut events = Vec::new();
    while buf.len() >= HEADER {
        let field = |i: usize| u32::from_ne_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let (wd, mask, len) = (field(0) as i32, field(4), field(12) as usize);
        let Some(name) = buf.get(HEADER..HEADER + len) else {
            break;
        };
        let name = name.split(|&b| b == 0).next().unwrap_or_default();
        events.push(InotifyEvent {
            wd,
            mask,
            name: String::from_utf8_lossy(name).into_owned(),
        });
        buf = &buf[HEADER + len..];
    }
    events
}

fn inet_socket() -> SysResult<OwnedFd> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    let fd = check(fd, || "socket AF_INET".to_string())?;
    // SAFETY: fd was just returned by socket() and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn sockaddr_in(addr: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is plain
    // old data, so any bit pattern is valid.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq_for(name: &str) -> SysResult<libc::ifreq> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(SysError::from_errno(
            format!("interface name {name:?}"),
            libc::EINVAL,
        ));
    }
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn ifreq_ioctl(
    sock: &OwnedFd,
    request: libc::c_ulong,
    req: &mut libc::ifreq,
    op: impl FnOnce() -> String,
) -> SysResult<()> {
    // SAFETY: req is a valid, initialized ifreq the kernel reads/writes for this request.
    let ret = unsafe { libc::ioctl(sock.as_raw_fd(), request as _, req as *mut libc::ifreq) };
    check(ret, op).map(drop)
}

/// Brings interface `name` up (`IFF_UP`), keeping its other flags.
pub fn link_up(name: &str) -> SysResult<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
    ifreq_ioctl(&sock, libc::SIOCGIFFLAGS, &mut req, || {
        format!("SIOCGIFFLAGS {name}")
    })?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    ifreq_ioctl(&sock, libc::SIOCSIFFLAGS, &mut req, || {
        format!("SIOCSIFFLAGS up {name}")
    })
}

/// Sets the IPv4 address and netmask of interface `name`.
pub fn set_ipv4(name: &str, addr: Ipv4Addr, netmask: Ipv4Addr) -> SysResult<()> {
    let sock = inet_socket()?;
    let mut req = ifreq_for(name)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(addr);
    ifreq_ioctl(&sock, libc::SIOCSIFADDR, &mut req, || {
        format!("SIOCSIFADDR {name} {addr}")
    })?;
    let mut req = ifreq_for(name)?;
    req.ifr_ifru.ifru_netmask = sockaddr_in(netmask);
    ifreq_ioctl(&sock, libc::SIOCSIFNETMASK, &mut req, || {
        format!("SIOCSIFNETMASK {name} {netmask}")
    })
}

/// Adds the IPv4 default route through `gateway`.
pub fn add_default_route(gateway: Ipv4Addr) -> SysResult<()> {
    let sock = inet_socket()?;
    // SAFETY: rtentry is plain old data; all-zero is a valid value.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_genmask = sockaddr_in(Ipv4Addr::UNSPECIFIED);
    rt.rt_gateway = sockaddr_in(gateway);
    rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
    // SAFETY: rt is a valid rtentry; rt_dev is NULL so the kernel picks the device.
    let ret = unsafe {
        libc::ioctl(
            sock.as_raw_fd(),
            libc::SIOCADDRT as _,
            &mut rt as *mut libc::rtentry,
        )
    };
    let res = check(ret, || format!("SIOCADDRT default via {gateway}")).map(drop);
    match res {
        Err(e) if e.errno() == Some(libc::EEXIST) => Ok(()),
        other => other,
    }
}

/// The calling thread acting on files as another account: its filesystem uid and gid
/// (`setfsuid(2)`, `setfsgid(2)`) and supplementary groups, so the kernel checks every
/// open, create and rename against that account's permissions (a nonzero fsuid drops
/// the thread's CAP_DAC_OVERRIDE and friends) and new files belong to it. Per thread:
/// the raw `setgroups` syscall, as glibc's wrapper would change every thread of the
/// process. Dropping the guard gives the thread back root's identity.
pub struct FsIdentity {
    groups: Vec<libc::gid_t>,
}

fn thread_setgroups(groups: &[libc::gid_t]) -> SysResult<()> {
    // SAFETY: the pointer and length describe `groups`, which outlives the call; the raw
    // syscall changes only the calling thread's credentials.
    let ret = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    check(ret as libc::c_int, || "setgroups".to_string()).map(drop)
}

impl FsIdentity {
    /// Takes on `uid`, `gid` and `groups` for file access on this thread (needs root).
    pub fn assume(uid: u32, gid: u32, groups: &[u32]) -> SysResult<FsIdentity> {
        // SAFETY: getgroups with size 0 only counts the groups.
        let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
        let mut saved = vec![0; usize::try_from(check(n, || "getgroups".into())?).unwrap_or(0)];
        // SAFETY: `saved` has room for `n` gids.
        let n = unsafe { libc::getgroups(n, saved.as_mut_ptr()) };
        saved.truncate(usize::try_from(check(n, || "getgroups".into())?).unwrap_or(0));
        thread_setgroups(groups)?;
        let guard = FsIdentity { groups: saved };
        // SAFETY: setfsgid/setfsuid take plain ids and report the previous id; calling
        // them again with the same id reads back the current one.
        let (now_gid, now_uid) = unsafe {
            libc::setfsgid(gid);
            let g = libc::setfsgid(gid);
            libc::setfsuid(uid);
            (g, libc::setfsuid(uid))
        };
        if now_gid as u32 != gid || now_uid as u32 != uid {
            return Err(SysError::from_errno(
                format!("setfsuid {uid} / setfsgid {gid}"),
                libc::EPERM,
            ));
        }
        Ok(guard)
    }
}

impl Drop for FsIdentity {
    fn drop(&mut self) {
        // SAFETY: as in `assume`; 0 is root, which this thread was before.
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
        if let Err(e) = thread_setgroups(&self.groups) {
            log::error!("restoring the envd thread's groups failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::zombie_processes)] // reaped by wait_child, which clippy cannot see
    fn wait_child_reports_exit_code_and_signal() {
        use std::os::unix::process::CommandExt;
        let child = std::process::Command::new("/bin/false").spawn().unwrap();
        let (pid, status) = wait_child(child.id() as i32).unwrap();
        assert_eq!(pid, child.id() as i32);
        assert_eq!(status, ExitStatus::Exited(1));

        let child = std::process::Command::new("/bin/sleep")
            .arg("10")
            .process_group(0)
            .spawn()
            .unwrap();
        kill_group(child.id() as i32, libc::SIGKILL).unwrap();
        let (_, status) = wait_child(child.id() as i32).unwrap();
        assert_eq!(status, ExitStatus::Signaled(libc::SIGKILL));
    }

    #[test]
    fn inotify_records_decode_and_report_changes() {
        let mut buf = Vec::new();
        for (wd, mask, name) in [
            (1i32, libc::IN_CREATE, &b"a.txt\0\0\0"[..]),
            (2, libc::IN_DELETE_SELF, b""),
        ] {
            buf.extend_from_slice(&wd.to_ne_bytes());
            buf.extend_from_slice(&mask.to_ne_bytes());
            buf.extend_from_slice(&0u32.to_ne_bytes());
            buf.extend_from_slice(&(name.len() as u32).to_ne_bytes());
            buf.extend_from_slice(name);
        }
        let events = parse_inotify(&buf);
        assert_eq!(events.len(), 2);
        assert_eq!((events[0].wd, events[0].name.as_str()), (1, "a.txt"));
        assert_eq!(
            (events[1].mask, events[1].name.as_str()),
            (libc::IN_DELETE_SELF, "")
        );

        let dir = std::env::temp_dir().join(format!("inotify-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ino = Inotify::new().unwrap();
        let wd = ino.add_watch(&dir, libc::IN_CREATE).unwrap();
        assert!(ino.read_events().unwrap().is_empty());
        std::fs::write(dir.join("f"), "x").unwrap();
        let ready = poll_readable(&[ino.as_fd()], Some(Duration::from_secs(5))).unwrap();
        assert_eq!(ready, vec![true]);
        let events = ino.read_events().unwrap();
        assert_eq!(
            events[0],
            InotifyEvent {
                wd,
                mask: libc::IN_CREATE,
                name: "f".into()
            }
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pty_pairs_carry_bytes_and_sizes() {
        use std::io::{Read, Write};
        let (master, slave) = open_pty(30, 100).unwrap();
        let mut m = File::from(master);
        let mut s = File::from(slave);
        s.write_all(b"hi").unwrap();
        let mut buf = [0u8; 2];
        m.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"hi");
        set_window_size(m.as_fd(), 40, 120).unwrap();
    }

    #[test]
    fn poll_reports_readable_pipe() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (r, mut w) = std::io::pipe().unwrap();
        let ready = poll_readable(&[r.as_fd()], Some(Duration::from_millis(1))).unwrap();
        assert_eq!(ready, vec![false]);
        w.write_all(b"x").unwrap();
        let ready = poll_readable(&[r.as_fd()], Some(Duration::from_millis(100))).unwrap();
        assert_eq!(ready, vec![true]);
    }
}
