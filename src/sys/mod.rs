//! The only place with `unsafe` and raw libc calls.
//!
//! Every libc call returns through [`SysError`], which carries the failed operation's name
//! and the OS error, so callers can say what went wrong without touching errno.

use std::fmt;
use std::io;

pub mod files;
pub mod fs;
pub mod guest;
pub mod jail;
pub mod netlink;
pub mod netns;
pub mod process;
pub mod procmem;
pub mod signals;
pub mod tun;

/// A failed system call: which operation, and the OS error it returned.
#[derive(Debug)]
pub struct SysError {
    pub op: String,
    pub source: io::Error,
}

impl SysError {
    /// Captures errno right after a failed call.
    pub fn last(op: impl Into<String>) -> SysError {
        SysError {
            op: op.into(),
            source: io::Error::last_os_error(),
        }
    }

    /// Wraps an explicit errno value (as returned by netlink acks, for example).
    pub fn from_errno(op: impl Into<String>, errno: i32) -> SysError {
        SysError {
            op: op.into(),
            source: io::Error::from_raw_os_error(errno),
        }
    }

    pub fn from_io(op: impl Into<String>, source: io::Error) -> SysError {
        SysError {
            op: op.into(),
            source,
        }
    }

    /// The raw errno, when there is one.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

impl fmt::Display for SysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.op, self.source)
    }
}

impl std::error::Error for SysError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

pub type SysResult<T> = Result<T, SysError>;

/// Turns a `-1`-on-error return value into a `SysResult`.
pub(crate) fn check(ret: libc::c_int, op: impl FnOnce() -> String) -> SysResult<libc::c_int> {
    if ret < 0 {
        Err(SysError::last(op()))
    } else {
        Ok(ret)
    }
}
