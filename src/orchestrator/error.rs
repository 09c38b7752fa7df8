//! The orchestrator's error: what went wrong, classified once so the API can pick a status.
//! Module errors nest through `From`; [`OrchError::status`] is the one place that knows
//! which HTTP status each variant is.

use crate::hooks::HookError;
use crate::store::StoreError;
use crate::vm::VmError;
use std::fmt;
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
    /// A durable record or directory in the state dir could not be written (500).
    Store(Arc<StoreError>),
    /// The custom extension: disabled 400, a failed hook 502, its journal 500.
    Hook(HookError),
    /// A build's files upload: too large 413, refused 400, the server's disk 500.
    Upload(super::UploadError),
    /// A state change the state machine does not allow (409).
    InvalidTransition {
        from: super::SandboxState,
        to: super::SandboxState,
    },
}

impl OrchError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            OrchError::NotFound(_) => 404,
            OrchError::BadRequest(_) => 400,
            OrchError::Conflict(_) | OrchError::InvalidTransition { .. } => 409,
            OrchError::TooMany(_) => 429,
            OrchError::Upstream(_) => 502,
            OrchError::Unavailable(_) => 503,
            OrchError::Internal(_) | OrchError::Vm { .. } | OrchError::Store(_) => 500,
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

    pub fn sandbox_not_found(id: &str) -> OrchError {
        OrchError::NotFound(format!("sandbox {id} not found"))
    }

    /// The sandbox's supervisor thread ended (its VM died or was torn down) before it
    /// answered.
    pub fn vm_gone() -> OrchError {
        OrchError::Internal("the sandbox's VM is gone".into())
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
        if e.is_upstream() {
            OrchError::Upstream(e.to_string())
        } else if e.is_client_error() {
            OrchError::BadRequest(e.to_string())
        } else {
            OrchError::Internal(e.to_string())
        }
    }
}

impl From<crate::volume::VolumeError> for OrchError {
    fn from(e: crate::volume::VolumeError) -> OrchError {
        let m = e.to_string();
        match e.status() {
            400 => OrchError::BadRequest(m),
            404 => OrchError::NotFound(m),
            409 => OrchError::Conflict(m),
            503 => OrchError::Unavailable(m),
            507 => OrchError::InsufficientStorage(m),
            _ => OrchError::Internal(m),
        }
    }
}

impl From<crate::net::NetError> for OrchError {
    fn from(e: crate::net::NetError) -> OrchError {
        match e {
            crate::net::NetError::NoFreeSlot { .. } => OrchError::Unavailable(e.to_string()),
            other => OrchError::Internal(other.to_string()),
        }
    }
}

impl From<crate::agent::AgentError> for OrchError {
    fn from(e: crate::agent::AgentError) -> OrchError {
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
}
