//! File-level host calls: exclusive lock files, directory fsync, kernel randomness.

use super::{check, SysError, SysResult};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// An exclusive `flock` held for as long as the value lives.
pub struct LockFile {
    file: File,
}

impl LockFile {
    /// Replaces the lock file's contents with `text` (e.g. the holder's pid, for the
    /// message a second process prints).
    pub fn set_contents(&self, text: &str) -> SysResult<()> {
        use std::io::Write;
        let mut f = &self.file;
        f.set_len(0)
            .and_then(|()| f.write_all(text.as_bytes()))
            .map_err(|e| SysError::from_io("write lock file", e))
    }
}

/// Takes `flock(LOCK_EX|LOCK_NB)` on `path`, creating it. `Ok(None)` when another process
/// holds it.
pub fn try_lock_exclusive(path: &Path) -> SysResult<Option<LockFile>> {
    lock(path, libc::LOCK_EX | libc::LOCK_NB)
}

fn lock(path: &Path, operation: libc::c_int) -> SysResult<Option<LockFile>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SysError::from_io(format!("open {}", path.display()), e))?;
    // SAFETY: flock on a valid, owned file descriptor; no memory is passed.
    let ret = unsafe { libc::flock(file.as_raw_fd(), operation) };
    if ret < 0 {
        let err = SysError::last(format!("flock {}", path.display()));
        if err.errno() == Some(libc::EWOULDBLOCK) {
            return Ok(None);
        }
        return Err(err);
    }
    Ok(Some(LockFile { file }))
}

/// fsyncs a directory so that a rename or unlink inside it is durable.
pub fn fsync_dir(dir: &Path) -> SysResult<()> {
    let f = File::open(dir).map_err(|e| SysError::from_io(format!("open {}", dir.display()), e))?;
    f.sync_all()
        .map_err(|e| SysError::from_io(format!("fsync {}", dir.display()), e))
}

/// Starts writing back `len` bytes of `file` from `offset` without waiting for them
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): a later fsync then waits for less. Not a
/// durability guarantee by itself.
pub fn start_writeback(file: &File, offset: u64, len: u64) -> SysResult<()> {
    // SAFETY: sync_file_range on a valid, owned file descriptor; no memory is passed.
    let ret = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
    check(ret, || "sync_file_range".into()).map(drop)
}

/// Fills `buf` from the kernel's CSPRNG.
pub fn random_bytes(buf: &mut [u8]) -> SysResult<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length describe the writable tail of `buf`.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = SysError::last("getrandom");
            if err.errno() == Some(libc::EINTR) {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(())
}

/// Whether the process runs with effective uid 0.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Number of online CPUs.
pub fn online_cpus() -> u32 {
    // SAFETY: sysconf with a valid name has no memory effects.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    check(n as libc::c_int, || "sysconf".into())
        .map(|n| n.max(1) as u32)
        .unwrap_or(1)
}

/// The host's name (`/proc/sys/kernel/hostname`), `localhost` when unreadable.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Physical memory in MiB.
pub fn total_memory_mb() -> u64 {
    // SAFETY: sysconf with valid names has no memory effects.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return 0;
    }
    (pages as u64 * size as u64) >> 20
}

/// `MemAvailable` of `/proc/meminfo` in MiB: what the kernel estimates can be allocated
/// without swapping; `None` when unreadable.
pub fn available_memory_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib >> 10)
}

/// The share (%) of the last 10 s in which some task stalled on memory
/// (`/proc/pressure/memory`, "some avg10"); `None` without PSI.
pub fn memory_pressure_pct() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/pressure/memory").ok()?;
    parse_pressure_some_avg10(&text)
}

fn parse_pressure_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    let field = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("avg10="))?;
    field.parse::<f64>().ok().filter(|p| p.is_finite())
}

/// Sets the process's file mode creation mask (for every thread and child) and returns
/// the previous one.
pub fn set_umask(mask: u32) -> u32 {
    // SAFETY: umask only swaps an integer in the process's fs state; it cannot fail.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
}

/// Writes all of `data` to the unix stream `socket`, with `fd` attached (`SCM_RIGHTS`) to
/// the first byte: how a QMP `add-fd`/`getfd` command receives its descriptor.
pub fn send_with_fd(
    socket: &std::os::unix::net::UnixStream,
    data: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> SysResult<()> {
    use std::io::Write;
    let raw = fd.as_raw_fd();
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    // u64 elements keep the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths); fields set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at a control buffer of CMSG_SPACE(sizeof(int)) bytes, so the
    // first header and its int-sized payload lie inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
    }
    // SAFETY: `msg` and the buffers it points to are valid for the call; `socket` is open.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(SysError::last("sendmsg(SCM_RIGHTS)"));
    }
    let rest = &data[sent as usize..];
    if !rest.is_empty() {
        (&*socket)
            .write_all(rest)
            .map_err(|e| SysError::from_io("write to unix socket", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_pressure_are_parsed() {
        let meminfo = "MemTotal:  24000000 kB\nMemFree:  100 kB\nMemAvailable:   2097152 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(2048));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        let psi =
            "some avg10=12.50 avg60=1.00 avg300=0.00 total=5\nfull avg10=3.00 avg60=0 total=1\n";
        assert_eq!(parse_pressure_some_avg10(psi), Some(12.5));
        assert_eq!(parse_pressure_some_avg10("full avg10=1.0\n"), None);
        assert!(
            available_memory_mb().unwrap() > 0,
            "this host has /proc/meminfo"
        );
    }
}
