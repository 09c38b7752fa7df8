//! How a QEMU process ended, as the server reports it: in log lines, in a quarantined
//! sandbox's `.reason` file, in the 404 of a sandbox whose VM died and as the `cause`
//! label of `agentenv_vm_deaths_total`.

use std::fmt;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

/// The end of a VM process: killed by a signal, or exited with a code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VmExit {
    Signal(i32),
    Code(i32),
}

impl VmExit {
    /// A short, bounded label for metrics: `SIGKILL`, `signal_40`, `exit_1`.
    pub fn cause(&self) -> String {
        match *self {
            VmExit::Signal(n) => match signal_name(n) {
                Some(name) => name.to_string(),
                None => format!("signal_{n}"),
            },
            VmExit::Code(c) => format!("exit_{c}"),
        }
    }
}

impl From<ExitStatus> for VmExit {
    fn from(status: ExitStatus) -> VmExit {
        match (status.signal(), status.code()) {
            (Some(n), _) => VmExit::Signal(n),
            (None, Some(c)) => VmExit::Code(c),
            (None, None) => VmExit::Code(-1),
        }
    }
}

impl fmt::Display for VmExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            VmExit::Signal(n) => match signal_name(n) {
                Some(name) => write!(f, "killed by signal {n} ({name})"),
                None => write!(f, "killed by signal {n}"),
            },
            VmExit::Code(c) => write!(f, "exited with status {c}"),
        }
    }
}

fn signal_name(n: i32) -> Option<&'static str> {
    Some(match n {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_signals_and_codes() {
        assert_eq!(
            VmExit::Signal(9).to_string(),
            "killed by signal 9 (SIGKILL)"
        );
        assert_eq!(VmExit::Signal(9).cause(), "SIGKILL");
        assert_eq!(VmExit::Signal(40).cause(), "signal_40");
        assert_eq!(VmExit::Code(1).to_string(), "exited with status 1");
        assert_eq!(VmExit::Code(1).cause(), "exit_1");
        assert_eq!(
            VmExit::from(ExitStatus::from_raw(libc::SIGSEGV)),
            VmExit::Signal(libc::SIGSEGV)
        );
        assert_eq!(VmExit::from(ExitStatus::from_raw(3 << 8)), VmExit::Code(3));
    }
}
