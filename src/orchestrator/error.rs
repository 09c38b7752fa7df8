//! The orchestrator's error: what went wrong, classified so the API can pick a status.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Anything else (500).
    Internal(String),
    /// A capability not built yet (501).
    NotImplemented(String),
    /// The state dir's filesystem is full or below its reserve (507).
    InsufficientStorage(String),
}

impl OrchError {
    pub fn message(&self) -> &str {
        match self {
            OrchError::NotFound(m)
            | OrchError::BadRequest(m)
            | OrchError::Conflict(m)
            | OrchError::TooMany(m)
            | OrchError::Upstream(m)
            | OrchError::Unavailable(m)
            | OrchError::Internal(m)
            | OrchError::NotImplemented(m)
            | OrchError::InsufficientStorage(m) => m,
        }
    }

    pub fn sandbox_not_found(id: &str) -> OrchError {
        OrchError::NotFound(format!("sandbox {id} not found"))
    }
}

impl fmt::Display for OrchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for OrchError {}

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
