//! Raw calls the in-guest agent needs: mounts, module loading, interface setup through
//! ioctls, the clock, process groups, waiting and polling.
//!
//! Used by `crate::guest` only; nothing here is called on the host server.

use std::ffi::CString;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
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

/// Sets the process umask; returns the previous one.
pub fn set_umask(mask: u32) -> u32 {
    // SAFETY: umask cannot fail and touches no memory.
    unsafe { libc::umask(mask as libc::mode_t) as u32 }
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
