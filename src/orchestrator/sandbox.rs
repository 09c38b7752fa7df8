//! What the orchestrator knows about one sandbox, and the explicit state machine.

use crate::agent::AgentClient;
use crossbeam_channel::Sender;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::SystemTime;

/// Internal lifecycle states (api.md §2.1). Pausing, resuming, snapshotting and forking
/// arrive with the pause/snapshot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Creating,
    Running,
    Deleting,
}

impl SandboxState {
    /// The one place that decides which moves are legal.
    pub fn can_become(self, next: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, next),
            (Creating, Running) | (Creating, Deleting) | (Running, Deleting)
        )
    }

    /// The API `state`, or `None` while invisible.
    pub fn api_state(self) -> Option<&'static str> {
        match self {
            SandboxState::Running => Some("running"),
            SandboxState::Creating | SandboxState::Deleting => None,
        }
    }
}

/// The user-visible description of a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxInfo {
    pub id: String,
    /// Normalised image reference for cold starts.
    pub template_id: String,
    pub alias: Option<String>,
    pub started_at: SystemTime,
    pub end_at: SystemTime,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// The image's own environment, lowest precedence for commands.
    pub image_env: Vec<(String, String)>,
    pub auto_pause: bool,
    /// Whether the guest may open outbound connections (kept across pause and resume).
    pub internet_access: bool,
    pub timeout_secs: u64,
    pub custom_extension_params: serde_json::Value,
    pub state: SandboxState,
    pub host_ip: Ipv4Addr,
    pub netns_path: PathBuf,
}

/// A lifecycle operation, sent to the sandbox's supervisor thread.
pub enum Op {
    Delete { reply: Sender<()> },
}

/// One registered sandbox: its description, the channel to its supervisor, and the guest
/// agent client that commands and file transfers use directly.
pub struct SandboxEntry {
    pub info: Mutex<SandboxInfo>,
    pub ops: Sender<Op>,
    pub agent: Arc<AgentClient>,
    pub running_commands: AtomicU32,
}
