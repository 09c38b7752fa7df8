//! Child-process set-up that needs raw calls between `fork` and `exec`, and a kill-and-reap
//! helper that never leaves a zombie behind.

use std::io;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};

/// Prepares `cmd` so that the child, after fork and before exec:
/// - enters the network namespace `netns` (an open `/proc/.../ns/net` or bind-mounted
///   namespace file) when given;
/// - gets `parent_death_signal` (e.g. `libc::SIGKILL`) when the thread that spawned it
///   exits, so a child never outlives its supervisor thread.
///
/// The caller keeps `netns` open until `spawn` has returned.
pub fn configure_child(cmd: &mut Command, netns: Option<RawFd>, parent_death_signal: Option<i32>) {
    let parent = std::process::id() as libc::pid_t;
    let hook = move || -> io::Result<()> {
        if let Some(signal) = parent_death_signal {
            // SAFETY: prctl(PR_SET_PDEATHSIG) takes a signal number by value and touches no
            // memory; it is async-signal-safe, as required between fork and exec.
            if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0) } < 0
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died before the prctl took effect; the signal would then
            // never come.
            // SAFETY: getppid has no preconditions and cannot fail.
            if unsafe { libc::getppid() } != parent {
                return Err(io::Error::other("parent exited during spawn"));
            }
        }
        if let Some(fd) = netns {
            // SAFETY: setns only reads its integer arguments; an invalid fd yields EBADF,
            // which is reported as the spawn error.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec and calls only async-signal-safe
    // functions (prctl, getppid, setns, errno reads); it allocates only on its error paths,
    // which std tolerates for `pre_exec` errors.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Sends SIGKILL to `child` (unless it already exited) and waits for it, so neither the
/// process nor a zombie remains. Returns its exit status.
pub fn kill_and_reap(child: &mut Child) -> io::Result<ExitStatus> {
    if let Some(status) = child.try_wait()? {
        return Ok(status);
    }
    match child.kill() {
        Ok(()) => {}
        // Exited between try_wait and kill: wait still reaps it.
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => {}
        Err(e) => return Err(e),
    }
    child.wait()
}

/// Sends SIGKILL to `pid` (a process this server did not spawn, e.g. a leftover of a
/// crashed run). A process that is already gone is not an error.
pub fn kill_pid(pid: u32) -> io::Result<()> {
    let pid =
        libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: kill has no memory effects; the pid was read from /proc just before.
    let ret = unsafe { libc::kill(pid, libc::SIGKILL) };
    if ret < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ESRCH) {
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn kill_and_reap_leaves_no_process() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30").stdin(Stdio::null());
        configure_child(&mut cmd, None, Some(libc::SIGKILL));
        let mut child = cmd.spawn().unwrap();
        let pid = child.id();
        let status = kill_and_reap(&mut child).unwrap();
        assert!(!status.success());
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        // A second call on a reaped child is harmless.
        kill_and_reap(&mut child).unwrap();
    }

    #[test]
    fn child_dies_with_its_spawning_thread() {
        let mut child = std::thread::spawn(|| {
            let mut cmd = Command::new("sleep");
            cmd.arg("30").stdin(Stdio::null());
            configure_child(&mut cmd, None, Some(libc::SIGKILL));
            // Handed back unreaped: the thread exits and the kernel kills the child.
            cmd.spawn().unwrap()
        })
        .join()
        .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(std::time::Instant::now() < deadline, "child survived");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn bad_netns_fd_fails_the_spawn() {
        let mut cmd = Command::new("true");
        configure_child(&mut cmd, Some(987_654), None);
        let e = cmd.spawn().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
