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
///   exits, so a child never outlives its supervisor thread;
/// - has each `(source, number)` of `fds` open as `number` (without `O_CLOEXEC`): the fds
///   it inherits. Every other fd of this process is `O_CLOEXEC` and does not reach it.
///
/// The caller keeps `netns` and every source fd open until `spawn` has returned.
pub fn configure_child(
    cmd: &mut Command,
    netns: Option<RawFd>,
    parent_death_signal: Option<i32>,
    fds: &[(RawFd, RawFd)],
) {
    let parent = std::process::id() as libc::pid_t;
    let fds: Vec<(RawFd, RawFd)> = fds.to_vec();
    // Sources are first moved above every target, so that no dup2 overwrites a source
    // that is still to be moved.
    let above = fds.iter().map(|&(_, n)| n).max().unwrap_or(2) + 1;
    let hook = move || -> io::Result<()> {
        let mut moved = [0 as RawFd; 16];
        if fds.len() > moved.len() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        for (i, &(source, _)) in fds.iter().enumerate() {
            // SAFETY: fcntl(F_DUPFD_CLOEXEC) only reads its integer arguments; a bad fd
            // yields EBADF, reported as the spawn error.
            let fd = unsafe { libc::fcntl(source, libc::F_DUPFD_CLOEXEC, above) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            moved[i] = fd;
        }
        for (i, &(_, number)) in fds.iter().enumerate() {
            // SAFETY: dup2 only reads its integer arguments; the new fd has no CLOEXEC.
            if unsafe { libc::dup2(moved[i], number) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
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
    // functions (fcntl, dup2, prctl, getppid, setns, errno reads); it allocates only on its
    // error paths, which std tolerates for `pre_exec` errors.
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
        configure_child(&mut cmd, None, Some(libc::SIGKILL), &[]);
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
            configure_child(&mut cmd, None, Some(libc::SIGKILL), &[]);
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
    fn passed_fds_arrive_at_their_numbers() {
        let (reader, writer) = std::io::pipe().unwrap();
        let (reader2, writer2) = std::io::pipe().unwrap();
        use std::os::fd::AsRawFd;
        let mut cmd = Command::new("sh");
        // Writes into fd 3 and fd 4 (swapped on purpose against their source numbers).
        cmd.args(["-c", "echo three >&3; echo four >&4"]);
        configure_child(
            &mut cmd,
            None,
            None,
            &[(writer2.as_raw_fd(), 4), (writer.as_raw_fd(), 3)],
        );
        let status = cmd.status().unwrap();
        drop((writer, writer2));
        assert!(status.success());
        let mut out = String::new();
        std::io::Read::read_to_string(&mut &reader, &mut out).unwrap();
        assert_eq!(out, "three\n");
        out.clear();
        std::io::Read::read_to_string(&mut &reader2, &mut out).unwrap();
        assert_eq!(out, "four\n");
    }

    #[test]
    fn bad_netns_fd_fails_the_spawn() {
        let mut cmd = Command::new("true");
        configure_child(&mut cmd, Some(987_654), None, &[]);
        let e = cmd.spawn().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }
}
