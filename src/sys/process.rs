//! Child-process set-up that needs raw calls between `fork` and `exec`, and a kill-and-reap
//! helper that never leaves a zombie behind.

use std::io;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus};

use super::jail::{Credentials, Jail};

/// What a child gets between `fork` and `exec`, in this order: the network namespace, its
/// inherited fds, the jail (mount namespace), the dropped capabilities, the unprivileged
/// account, and the parent-death signal (after the account switch, which would clear it).
#[derive(Debug, Default)]
pub struct ChildSetup {
    /// An open `/proc/.../ns/net` or bind-mounted namespace file to enter.
    pub netns: Option<RawFd>,
    /// Sent to the child (e.g. `libc::SIGKILL`) when the thread that spawned it exits, so a
    /// child never outlives its supervisor thread.
    pub parent_death_signal: Option<i32>,
    /// Each `(source, number)`: `source` is open in the child as `number` (without
    /// `O_CLOEXEC`). Every other fd of this process is `O_CLOEXEC` and does not reach it.
    pub fds: Vec<(RawFd, RawFd)>,
    /// A private mount namespace holding only what the child needs.
    pub jail: Option<Jail>,
    /// The account the child runs as (no supplementary groups, no capabilities,
    /// `PR_SET_NO_NEW_PRIVS`).
    pub credentials: Option<Credentials>,
    /// Capabilities (`CAP_*` numbers) a child that stays root loses for good: out of its
    /// effective, permitted and inheritable sets and its bounding set, so not even exec
    /// gives them back.
    pub dropped_capabilities: &'static [u32],
    /// No transparent huge pages for the child (`PR_SET_THP_DISABLE`, kept across exec),
    /// whatever it asks with `madvise`.
    pub no_huge_pages: bool,
}

/// `CAP_MKNOD` (linux/capability.h): making device nodes.
pub const CAP_MKNOD: u32 = 27;

/// Most fds a child can inherit through [`ChildSetup::fds`].
pub const MAX_INHERITED_FDS: usize = 128;

/// Prepares `cmd` so that the child is set up as `setup` says before exec.
///
/// The caller keeps the netns fd and every source fd open until `spawn` has returned.
pub fn configure_child(cmd: &mut Command, setup: ChildSetup) {
    let parent = std::process::id() as libc::pid_t;
    let ChildSetup {
        netns,
        parent_death_signal,
        fds,
        jail,
        credentials,
        dropped_capabilities,
        no_huge_pages,
    } = setup;
    // Sources are first moved above every target, so that no dup2 overwrites a source
    // that is still to be moved.
    let above = fds.iter().map(|&(_, n)| n).max().unwrap_or(2) + 1;
    let hook = move || -> io::Result<()> {
        // First, while `netns` cannot have been overwritten by a dup2 below.
        if let Some(fd) = netns {
            // SAFETY: setns only reads its integer arguments; an invalid fd yields EBADF,
            // which is reported as the spawn error.
            if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let mut moved = [0 as RawFd; MAX_INHERITED_FDS];
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
        if let Some(jail) = &jail {
            jail.enter()?;
        }
        if !dropped_capabilities.is_empty() {
            drop_capabilities(dropped_capabilities)?;
        }
        // SAFETY: prctl(PR_SET_THP_DISABLE) takes integers by value and touches no memory;
        // it is async-signal-safe, as required between fork and exec.
        if no_huge_pages && unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
        if let Some(credentials) = &credentials {
            credentials.assume()?;
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
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec and calls only async-signal-safe
    // functions (fcntl, dup2, setns, mount, mkdir, pivot_root, capget/capset, set*id, prctl, getppid,
    // errno reads) on data prepared before the fork; it allocates only on its error paths,
    // which std tolerates for `pre_exec` errors.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// `struct __user_cap_header_struct` and `__user_cap_data_struct` (linux/capability.h).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two `CapData`, capabilities 0-31 and 32-63.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// Runs in the forked child: removes `caps` from this process's three sets (capset) and
/// from its bounding set. Only system calls on stack data.
fn drop_capabilities(caps: &[u32]) -> io::Result<()> {
    let mut header = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capget writes the two `CapData` that version 3 defines into `data`, which
    // is exactly that large; `header` is valid for the call.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    for &cap in caps {
        let (word, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
        let Some(d) = data.get_mut(word) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        d.effective &= !bit;
        d.permitted &= !bit;
        d.inheritable &= !bit;
    }
    // SAFETY: as for capget; capset only reads `header` and `data`.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    for &cap in caps {
        // SAFETY: prctl(PR_CAPBSET_DROP) takes integers by value and touches no memory.
        // Allowed while CAP_SETPCAP is still held (it is not among what callers drop).
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Raises the soft limit on open files to the hard one (at most `cap`): each sandbox holds
/// a few descriptors in the server (QMP, agent, console, netns), and a shell's usual soft
/// limit of 1024 would stop a host at ~120 sandboxes. Returns the (old, new) soft limit.
pub fn raise_open_files_limit(cap: u64) -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let old = lim.rlim_cur;
    let new = lim.rlim_max.min(cap).max(old);
    if new != old {
        lim.rlim_cur = new;
        // SAFETY: setrlimit reads the struct we own; a soft limit up to the hard one is
        // always allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((old, new))
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

/// How the kernel schedules a thread: the normal class at a nice value, or the
/// round-robin real-time class at a priority (1..=99), which runs before every thread of
/// the normal class (the kernel's real-time throttling still leaves those 5 %).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    Nice(i32),
    Realtime(i32),
}

/// Sets the priority of every thread of `pid` (a child of this server) but those whose
/// name starts with `except`: Linux keeps one per thread, so setting it on the pid alone
/// would leave QEMU's other threads as they were. Threads that end meanwhile are skipped.
pub fn set_process_priority(pid: u32, priority: Priority, except: Option<&str>) -> io::Result<()> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))?;
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if let Some(prefix) = except {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.starts_with(prefix) {
                continue;
            }
        }
        match set_task_priority(tid, priority) {
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            other => other?,
        }
    }
    Ok(())
}

/// Sets the priority of the calling thread alone and returns the one it had.
pub fn set_thread_priority(priority: Priority) -> io::Result<Priority> {
    // SAFETY: gettid has no effects and cannot fail.
    let tid = unsafe { libc::gettid() };
    let old = task_priority(tid)?;
    set_task_priority(tid, priority)?;
    Ok(old)
}

fn task_priority(tid: libc::pid_t) -> io::Result<Priority> {
    // SAFETY: sched_getscheduler has no memory effects.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    if policy < 0 {
        return Err(io::Error::last_os_error());
    }
    if policy == libc::SCHED_RR || policy == libc::SCHED_FIFO {
        let mut param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_getparam writes one sched_param into the struct we own.
        if unsafe { libc::sched_getparam(tid, &mut param) } < 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok(Priority::Realtime(param.sched_priority));
    }
    // SAFETY: getpriority has no memory effects; -1 is a valid nice value, so errno is
    // cleared first to tell it from an error.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
        if nice == -1 && *libc::__errno_location() != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Priority::Nice(nice))
    }
}

fn set_task_priority(tid: libc::pid_t, priority: Priority) -> io::Result<()> {
    let (policy, level) = match priority {
        Priority::Nice(_) => (libc::SCHED_OTHER, 0),
        Priority::Realtime(level) => (libc::SCHED_RR, level),
    };
    let param = libc::sched_param {
        sched_priority: level,
    };
    // SAFETY: sched_setscheduler reads one sched_param we own; `tid` names a thread of
    // this process or of our child.
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } < 0 {
        return Err(io::Error::last_os_error());
    }
    if let Priority::Nice(nice) = priority {
        // SAFETY: setpriority has no memory effects.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Stdio;

    #[test]
    fn a_thread_priority_is_set_and_given_back() {
        let old = std::thread::spawn(|| {
            let old = set_thread_priority(Priority::Nice(5)).unwrap();
            assert_eq!(
                set_thread_priority(Priority::Realtime(1)).unwrap(),
                Priority::Nice(5)
            );
            assert_eq!(set_thread_priority(old).unwrap(), Priority::Realtime(1));
            old
        })
        .join()
        .unwrap();
        // The spawning thread is untouched.
        assert_eq!(set_thread_priority(old).unwrap(), old);
    }

    #[test]
    fn the_open_files_limit_rises_to_the_hard_limit_within_the_cap() {
        let limits = || {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes one rlimit into the struct we own.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
            (lim.rlim_cur, lim.rlim_max)
        };
        let (_, max) = limits();
        // A cap below the current soft limit never lowers it.
        let (old, new) = raise_open_files_limit(0).unwrap();
        assert_eq!(old, new);
        let (_, new) = raise_open_files_limit(u64::MAX).unwrap();
        assert_eq!(new, max);
        assert_eq!(limits(), (max, max));
    }

    #[test]
    fn every_thread_of_a_child_gets_the_priority() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        // Fields 18 and 19 are the priority and the nice value, 41 the policy; the comm
        // field (2) holds no space here.
        let stat = |field: usize| -> i32 {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
            stat.split(' ').nth(field - 1).unwrap().parse().unwrap()
        };
        // Until its exec the child bears this thread's name.
        let comm = format!("/proc/{}/comm", child.id());
        for _ in 0..200 {
            if std::fs::read_to_string(&comm).unwrap_or_default() == "sleep\n" {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        set_process_priority(child.id(), Priority::Realtime(1), Some("sleep")).unwrap();
        assert_eq!(
            stat(41),
            libc::SCHED_OTHER,
            "the named thread is left alone"
        );
        set_process_priority(child.id(), Priority::Realtime(1), None).unwrap();
        assert_eq!(stat(41), libc::SCHED_RR);
        set_process_priority(child.id(), Priority::Nice(7), None).unwrap();
        assert_eq!((stat(41), stat(19)), (libc::SCHED_OTHER, 7));
        kill_and_reap(&mut child).unwrap();
    }

    #[test]
    fn kill_and_reap_leaves_no_process() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30").stdin(Stdio::null());
        configure_child(
            &mut cmd,
            ChildSetup {
                parent_death_signal: Some(libc::SIGKILL),
                ..ChildSetup::default()
            },
        );
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
            configure_child(
                &mut cmd,
                ChildSetup {
                    parent_death_signal: Some(libc::SIGKILL),
                    ..ChildSetup::default()
                },
            );
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
            ChildSetup {
                fds: vec![(writer2.as_raw_fd(), 4), (writer.as_raw_fd(), 3)],
                ..ChildSetup::default()
            },
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

    /// `no_huge_pages` holds across exec; without it a child may have them.
    #[test]
    fn huge_pages_are_off_after_exec_when_asked() {
        let thp = |no_huge_pages: bool| {
            let mut cmd = Command::new("grep");
            cmd.args(["^THP_enabled:", "/proc/self/status"]);
            configure_child(
                &mut cmd,
                ChildSetup {
                    no_huge_pages,
                    ..ChildSetup::default()
                },
            );
            let out = cmd.output().unwrap();
            assert!(
                out.status.success(),
                "no THP_enabled line in /proc/self/status"
            );
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .nth(1)
                .map(str::to_owned)
        };
        assert_eq!(thp(true).as_deref(), Some("0"));
        assert_eq!(thp(false).as_deref(), Some("1"));
    }

    /// A child that stays root loses CAP_MKNOD for good: `mknod` of a device fails with
    /// EPERM and /proc says the capability is in none of its sets (not even after exec).
    #[test]
    fn dropped_capability_is_gone_after_exec() {
        assert!(
            super::super::fs::is_root(),
            "needs root: run the suite with sudo"
        );
        let dir = std::env::temp_dir().join(format!("aenv-caps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; mknod \"$1\" c 1 3")
            .arg("sh")
            .arg(dir.join("null"));
        configure_child(
            &mut cmd,
            ChildSetup {
                dropped_capabilities: &[CAP_MKNOD],
                ..ChildSetup::default()
            },
        );
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for line in text.lines() {
            let mask = u64::from_str_radix(line.split_whitespace().nth(1).unwrap(), 16).unwrap();
            assert_eq!(mask & (1 << CAP_MKNOD), 0, "{line}");
        }
        assert_eq!(text.lines().count(), 5, "{text}");
        assert!(!out.status.success(), "mknod worked without CAP_MKNOD");
        assert!(!dir.join("null").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_netns_fd_fails_the_spawn() {
        let mut cmd = Command::new("true");
        configure_child(
            &mut cmd,
            ChildSetup {
                netns: Some(987_654),
                ..ChildSetup::default()
            },
        );
        let e = cmd.spawn().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    }

    /// Runs `script` with `sh` in a jail holding /usr (and the /lib, /bin links) as
    /// agentenv-vm; returns its stdout.
    fn run_jailed(root: &std::path::Path, script: &str) -> (String, std::time::Duration) {
        use super::super::jail::{Access, Credentials, Jail};
        let mut jail = Jail::new(root).unwrap();
        for path in ["/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache"] {
            jail.bind_if_present(std::path::Path::new(path), Access::ReadOnly)
                .unwrap();
        }
        jail.bind(std::path::Path::new("/dev/null"), Access::Device)
            .unwrap();
        let credentials = Credentials::lookup("agentenv-vm").unwrap();
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", script]).env_clear().stdin(Stdio::null());
        configure_child(
            &mut cmd,
            ChildSetup {
                parent_death_signal: Some(libc::SIGKILL),
                jail: Some(jail),
                credentials: Some(credentials),
                ..ChildSetup::default()
            },
        );
        let t = std::time::Instant::now();
        let out = cmd.output().unwrap();
        let took = t.elapsed();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (String::from_utf8(out.stdout).unwrap(), took)
    }

    #[test]
    fn jailed_child_is_unprivileged_and_sees_only_its_binds() {
        assert!(
            super::super::fs::is_root(),
            "needs root (mount namespaces, setuid): run the suite with sudo"
        );
        // As in the server, whose umask must not leak into the jail's directories.
        let umask = super::super::fs::set_umask(0o077);
        let root = std::env::temp_dir().join(format!("aenv-jail-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("host-file"), b"x").unwrap();
        super::super::fs::set_umask(umask);
        let (out, _) = run_jailed(
            &root,
            "id -u; id -G; ls -a /; grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status \
             2>/dev/null || echo noproc; cat /host-file 2>/dev/null || echo nofile; \
             touch /usr/x 2>/dev/null || echo readonly; echo ok > /dev/null && echo dev",
        );
        let uid = super::super::jail::Credentials::lookup("agentenv-vm")
            .unwrap()
            .uid;
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], uid.to_string(), "{out}");
        assert_eq!(lines[1].split(' ').count(), 1, "only its own group: {out}");
        assert!(out.contains("noproc\nnofile\nreadonly\ndev"), "{out}");
        let listed: Vec<&str> = lines[2..]
            .iter()
            .take_while(|l| **l != "noproc")
            .copied()
            .collect();
        assert!(listed.contains(&"usr") && listed.contains(&"dev"), "{out}");
        assert!(
            !listed.contains(&"var") && !listed.contains(&"host-file"),
            "{out}"
        );
        // The host never sees the jail's mounts.
        assert!(root.join("host-file").exists());
        assert!(!std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(root.to_str().unwrap()));

        // What the confinement costs per spawn: jailed `true` against a plain one,
        // interleaved, medians (the host may be busy).
        let (mut jailed, mut plain) = (Vec::new(), Vec::new());
        for _ in 0..30 {
            jailed.push(run_jailed(&root, "true").1);
            let t = std::time::Instant::now();
            assert!(Command::new("/bin/sh")
                .args(["-c", "true"])
                .status()
                .unwrap()
                .success());
            plain.push(t.elapsed());
        }
        jailed.sort();
        plain.sort();
        eprintln!(
            "jail cost: median {:.2} ms per jailed spawn, {:.2} ms plain",
            jailed[15].as_secs_f64() * 1000.0,
            plain[15].as_secs_f64() * 1000.0
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
