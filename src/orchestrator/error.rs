//! The orchestrator's error: what went wrong, classified once so the API can pick a status.
//! Module errors nest through `From`; [`OrchError::status`] is the one place that knows
//! which HTTP status each variant is.

use crate::agent::AgentError;
use crate::hooks::HookError;
use crate::net::NetError;
use crate::store::StoreError;
use crate::vm::{VmError, VmExit};
use std::fmt;
use std::io;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum OrchError {
    /// Unknown or deleting sandbox (404).
    NotFound(String),
    /// A request that breaks a rule (400).
    BadRequest(String),
    /// Wrong state for the operation (409).
    Conflict(String),
    /// Per-sandbox limit reached (429).
    TooMany(String),
    /// An upstream (guest agent, registry, extension) failed (502).
    Upstream(String),
    /// Capacity or shutdown (503).
    Unavailable(String),
    /// A broken invariant no module error describes (500).
    Internal(String),
    /// The state dir's filesystem is full or below its reserve (507).
    InsufficientStorage(String),
    /// A VM operation failed (500); `during` says which one.
    Vm {
        during: &'static str,
        source: Arc<VmError>,
    },
    /// A host call (a thread, a namespace file) failed (500); `during` says what could
    /// not be done and starts the message.
    Host {
        during: &'static str,
        source: Arc<io::Error>,
    },
    /// The network layer failed (500; no free slot is [`OrchError::Unavailable`]);
    /// `during` says which step.
    Net {
        during: &'static str,
        source: Arc<NetError>,
    },
    /// The VM started but its guest agent never answered; the VM was torn down (500).
    GuestNotReady(NotReady),
    /// The sandbox is paused (resumable from memory), but its record could not be saved,
    /// so a restart would not find it paused (500).
    PausedUnrecorded { id: String, source: Box<OrchError> },
    /// An operation failed and left the VM unable to run on: the sandbox was removed and
    /// its disk quarantined (500).
    RemovedAfter { id: String, source: Box<OrchError> },
    /// A durable record or directory in the state dir could not be written (500).
    Store(Arc<StoreError>),
    /// The custom extension: disabled 400, a failed hook 502, its journal 500.
    Hook(HookError),
    /// A build's files upload: too large 413, refused 400, the server's disk 500.
    Upload(super::UploadError),
    /// The sandbox's supervisor thread ended (its VM died or was torn down) before it
    /// answered (500); `during` says what was asked.
    VmGone { during: &'static str },
    /// A sandbox entry lacks a part its state promises (a running one without a VM, a
    /// paused one without its state) (500).
    Lacks { id: String, what: &'static str },
    /// An image could not be prepared: the registry failed 502, a bad reference 400, the
    /// host 500.
    Image(Arc<crate::image::ImageError>),
    /// A volume operation (its own status: 400, 404, 409, 503, 507 or 500).
    Volume(Arc<crate::volume::VolumeError>),
    /// A standby's warm-up failed (500; only the standby worker sees it).
    WarmUp(Arc<super::warmup::WarmUpError>),
    /// A state change the state machine does not allow (409).
    InvalidTransition {
        from: super::SandboxState,
        to: super::SandboxState,
    },
}

/// Why a guest agent did not become ready after its VM started.
#[derive(Debug, Clone)]
pub enum NotReady {
    /// The VM process ended during boot.
    Exited(VmExit),
    /// No answer within `secs`.
    Silent { secs: u64, source: Arc<AgentError> },
    /// QEMU paused the booting guest because a disk write found the state dir full (507).
    DiskFull { message: String },
}

impl fmt::Display for NotReady {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotReady::Exited(status) => write!(f, "the VM exited during boot ({status})"),
            NotReady::Silent { secs, source } => write!(f, "no answer within {secs}s: {source}"),
            NotReady::DiskFull { message } => write!(f, "{message}"),
        }
    }
}

impl OrchError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            OrchError::NotFound(_) => 404,
            OrchError::BadRequest(_) => 400,
            OrchError::Conflict(_) | OrchError::InvalidTransition { .. } => 409,
            OrchError::TooMany(_) => 429,
            OrchError::GuestNotReady(NotReady::DiskFull { .. }) => 507,
            OrchError::Upstream(_) => 502,
            OrchError::Unavailable(_) => 503,
            OrchError::Internal(_)
            | OrchError::Vm { .. }
            | OrchError::Host { .. }
            | OrchError::Net { .. }
            | OrchError::GuestNotReady(_)
            | OrchError::PausedUnrecorded { .. }
            | OrchError::RemovedAfter { .. }
            | OrchError::VmGone { .. }
            | OrchError::Lacks { .. }
            | OrchError::WarmUp(_)
            | OrchError::Store(_) => 500,
            OrchError::Image(e) if e.is_upstream() => 502,
            OrchError::Image(e) if e.is_client_error() => 400,
            OrchError::Image(_) => 500,
            OrchError::Volume(e) => e.status(),
            OrchError::InsufficientStorage(_) => 507,
            OrchError::Hook(HookError::Disabled) => 400,
            OrchError::Hook(HookError::Failed { .. }) => 502,
            OrchError::Hook(HookError::Journal(_)) => 500,
            OrchError::Upload(super::UploadError::TooLarge(_)) => 413,
            OrchError::Upload(super::UploadError::Refused(_)) => 400,
            OrchError::Upload(super::UploadError::Io(_)) => 500,
        }
    }

    /// What the API answers with: the operator-facing message.
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// A VM operation's failure.
    pub fn vm(during: &'static str, source: VmError) -> OrchError {
        OrchError::Vm {
            during,
            source: Arc::new(source),
        }
    }

    /// A host call's failure.
    pub fn host(during: &'static str, source: io::Error) -> OrchError {
        OrchError::Host {
            during,
            source: Arc::new(source),
        }
    }

    /// A network failure: no free slot is capacity (503), anything else [`OrchError::Net`].
    pub fn net(during: &'static str, source: NetError) -> OrchError {
        match source {
            NetError::NoFreeSlot { .. } => OrchError::Unavailable(source.to_string()),
            other => OrchError::Net {
                during,
                source: Arc::new(other),
            },
        }
    }

    pub fn sandbox_not_found(id: &str) -> OrchError {
        OrchError::NotFound(format!("sandbox {id} not found"))
    }

    /// The sandbox's supervisor thread ended (its VM died or was torn down) before it
    /// answered.
    pub fn vm_gone(during: &'static str) -> OrchError {
        OrchError::VmGone { during }
    }
}

impl fmt::Display for OrchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OrchError::NotFound(m)
            | OrchError::BadRequest(m)
            | OrchError::Conflict(m)
            | OrchError::TooMany(m)
            | OrchError::Upstream(m)
            | OrchError::Unavailable(m)
            | OrchError::Internal(m)
            | OrchError::InsufficientStorage(m) => f.write_str(m),
            OrchError::Vm { during, source } => write!(f, "{during}: {source}"),
            OrchError::Host { during, source } => write!(f, "{during}: {source}"),
            OrchError::Net { during, source } => write!(f, "{during}: {source}"),
            OrchError::GuestNotReady(why) => write!(
                f,
                "guest agent did not become ready: {why}; the console log's last lines are in \
                 the server log"
            ),
            OrchError::PausedUnrecorded { id, source } => write!(
                f,
                "sandbox {id} is paused, but its record could not be saved ({source}); it can \
                 be resumed, but a server restart would not bring it back as paused"
            ),
            OrchError::RemovedAfter { id, source } => write!(
                f,
                "{source}; the VM could not run on and sandbox {id} was removed; its disk is \
                 kept for the operator (see the server log)"
            ),
            OrchError::VmGone { during } => write!(
                f,
                "{during}: the sandbox's VM is gone (it died or was deleted meanwhile; the \
                 server log says why)"
            ),
            OrchError::Lacks { id, what } => write!(
                f,
                "sandbox {id} has no {what}; this is a server bug: report it with the server log"
            ),
            OrchError::Image(e) => write!(f, "{e}"),
            OrchError::Volume(e) => write!(f, "{e}"),
            OrchError::WarmUp(e) => write!(f, "{e}"),
            OrchError::Store(e) => write!(f, "{e}"),
            OrchError::Hook(e) => write!(f, "{e}"),
            OrchError::Upload(e) => write!(f, "{e}"),
            OrchError::InvalidTransition { from, to } => write!(
                f,
                "a {} sandbox cannot become {}; retry once its current operation ended",
                from.name(),
                to.name()
            ),
        }
    }
}

impl std::error::Error for OrchError {}

/// Two errors are the same answer when status and message agree (a nested module
/// error's source has no equality of its own).
impl PartialEq for OrchError {
    fn eq(&self, other: &OrchError) -> bool {
        self.status() == other.status() && self.message() == other.message()
    }
}

impl From<StoreError> for OrchError {
    fn from(e: StoreError) -> OrchError {
        OrchError::Store(Arc::new(e))
    }
}

impl From<super::UploadError> for OrchError {
    fn from(e: super::UploadError) -> OrchError {
        OrchError::Upload(e)
    }
}

impl From<HookError> for OrchError {
    fn from(e: HookError) -> OrchError {
        OrchError::Hook(e)
    }
}

impl From<crate::image::ImageError> for OrchError {
    fn from(e: crate::image::ImageError) -> OrchError {
        OrchError::Image(Arc::new(e))
    }
}

impl From<super::warmup::WarmUpError> for OrchError {
    fn from(e: super::warmup::WarmUpError) -> OrchError {
        OrchError::WarmUp(Arc::new(e))
    }
}

impl From<crate::volume::VolumeError> for OrchError {
    fn from(e: crate::volume::VolumeError) -> OrchError {
        OrchError::Volume(Arc::new(e))
    }
}

/// The one `?` on a network call is taking a slot; other steps name themselves with
/// [`OrchError::net`].
impl From<NetError> for OrchError {
    fn from(e: NetError) -> OrchError {
        OrchError::net("taking a network slot", e)
    }
}

impl From<AgentError> for OrchError {
    fn from(e: AgentError) -> OrchError {
        use crate::agent::AgentError as A;
        match e {
            A::NotFound(m) => OrchError::NotFound(m),
            A::InvalidPath(m) => OrchError::BadRequest(m),
            other => OrchError::Upstream(format!("guest agent: {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_module_errors_keep_their_status_and_message() {
        let hook = HookError::Journal("disk full".into());
        let e = OrchError::from(hook.clone());
        assert_eq!((e.status(), e.message()), (500, hook.to_string()));
        assert_eq!(OrchError::from(HookError::Disabled).status(), 400);
        let vm = OrchError::vm("pause failed", VmError::InvalidSpec("no disk".into()));
        assert_eq!(vm.status(), 500);
        assert_eq!(vm.message(), "pause failed: invalid VM spec: no disk");
    }

    #[test]
    fn typed_failures_answer_500_with_what_an_operator_needs() {
        let io = || io::Error::from_raw_os_error(libc::EAGAIN);
        let host = OrchError::host("cannot start supervisor thread", io());
        assert_eq!(host.status(), 500);
        assert!(host
            .message()
            .starts_with("cannot start supervisor thread: Resource temporarily unavailable"));
        let net = OrchError::net("applying the slot's outbound rules", NetError::ShuttingDown);
        assert_eq!(net.status(), 500);
        assert_eq!(
            net.message(),
            "applying the slot's outbound rules: the network slot manager is shutting down"
        );
        let full = OrchError::from(NetError::NoFreeSlot { max_slots: 2 });
        assert_eq!(full.status(), 503);
        assert_eq!(full.message(), "no free network slot (max_slots=2)");
        let exited = OrchError::GuestNotReady(NotReady::Exited(VmExit::Code(1)));
        assert_eq!(exited.status(), 500);
        assert_eq!(
            exited.message(),
            "guest agent did not become ready: the VM exited during boot (exited with status \
             1); the console log's last lines are in the server log"
        );
        let silent = OrchError::GuestNotReady(NotReady::Silent {
            secs: 30,
            source: Arc::new(AgentError::Unreachable("refused".into())),
        });
        assert!(silent
            .message()
            .starts_with("guest agent did not become ready: no answer within 30s: "));
        let disk_full = OrchError::GuestNotReady(NotReady::DiskFull {
            message: "the state dir is full".into(),
        });
        assert_eq!(disk_full.status(), 507);
        let store = || Box::new(OrchError::Internal("disk gone".into()));
        let paused = OrchError::PausedUnrecorded {
            id: "sb".into(),
            source: store(),
        };
        assert_eq!(paused.status(), 500);
        assert_eq!(
            paused.message(),
            "sandbox sb is paused, but its record could not be saved (disk gone); it can be \
             resumed, but a server restart would not bring it back as paused"
        );
        let removed = OrchError::RemovedAfter {
            id: "sb".into(),
            source: Box::new(OrchError::Conflict("x".into())),
        };
        assert_eq!(
            removed.status(),
            500,
            "whatever the cause, the sandbox is gone"
        );
        assert_eq!(
            removed.message(),
            "x; the VM could not run on and sandbox sb was removed; its disk is kept for the \
             operator (see the server log)"
        );
    }
}
