//! What the orchestrator knows about one sandbox, and the explicit state machine.

use super::settings::SandboxSettings;
use super::OrchError;
use crate::agent::AgentClient;
use crossbeam_channel::Sender;
use parking_lot::{Condvar, Mutex};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

/// Internal lifecycle states (api.md §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Creating,
    Running,
    Pausing,
    Paused,
    Resuming,
    Snapshotting,
    Forking,
    Deleting,
}

impl SandboxState {
    /// The one place that decides which moves are legal; checked in every build (a
    /// refused move is a race or a bug, answered as 409, never applied).
    pub fn valid_transition(self, next: SandboxState) -> Result<(), OrchError> {
        if self == next || self.can_become(next) {
            Ok(())
        } else {
            Err(OrchError::InvalidTransition {
                from: self,
                to: next,
            })
        }
    }

    fn can_become(self, next: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, next),
            (Creating, Running)
                | (Creating, Deleting)
                | (Running, Pausing)
                | (Running, Snapshotting)
                | (Running, Forking)
                | (Running, Deleting)
                | (Pausing, Paused)
                | (Pausing, Running)
                | (Pausing, Deleting)
                | (Paused, Resuming)
                | (Paused, Deleting)
                | (Resuming, Running)
                | (Resuming, Paused)
                | (Resuming, Deleting)
                | (Snapshotting, Running)
                | (Snapshotting, Deleting)
                | (Forking, Running)
                | (Forking, Deleting)
        )
    }

    /// The API `state`, or `None` while invisible.
    pub fn api_state(self) -> Option<&'static str> {
        use SandboxState::*;
        match self {
            Running | Pausing | Snapshotting | Forking => Some("running"),
            Paused | Resuming => Some("paused"),
            Creating | Deleting => None,
        }
    }

    pub fn name(self) -> &'static str {
        use SandboxState::*;
        match self {
            Creating => "creating",
            Running => "running",
            Pausing => "pausing",
            Paused => "paused",
            Resuming => "resuming",
            Snapshotting => "snapshotting",
            Forking => "forking",
            Deleting => "deleting",
        }
    }
}

/// Calls whose handling depends on the sandbox's state (api.md §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Pause,
    Resume,
    Connect,
    Delete,
    Snapshot,
    Fork,
    PatchParams,
    Timeout,
    Commands,
    /// `PUT …/network`.
    Network,
}

/// What to do with a call in a state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Carry out the operation.
    Proceed,
    /// Nothing to do; answer success (e.g. pause of a paused sandbox).
    AlreadyDone,
    /// Wait (bounded) for the current transition to end, then decide again.
    Wait,
    /// 409.
    Conflict,
    /// 404.
    NotFound,
}

/// api.md §2.3, as one exhaustive table.
pub fn decide(call: Call, state: SandboxState) -> Decision {
    use Call::*;
    use Decision::*;
    use SandboxState as S;
    match (call, state) {
        (_, S::Creating | S::Deleting) => NotFound,
        (Pause, S::Running) => Proceed,
        (Pause, S::Paused) => AlreadyDone,
        (Pause, S::Pausing) => Wait,
        (Pause, S::Resuming | S::Snapshotting | S::Forking) => Conflict,
        (Resume, S::Running) => AlreadyDone,
        (Resume, S::Paused) => Proceed,
        (Resume, S::Resuming) => Wait,
        (Resume, S::Pausing | S::Snapshotting | S::Forking) => Conflict,
        (Connect, S::Running | S::Snapshotting | S::Forking) => AlreadyDone,
        (Connect, S::Paused) => Proceed,
        (Connect, S::Pausing | S::Resuming) => Wait,
        (Delete, S::Running | S::Paused) => Proceed,
        (Delete, S::Pausing | S::Resuming | S::Snapshotting | S::Forking) => Wait,
        (Snapshot | Fork | PatchParams, S::Running) => Proceed,
        (Snapshot | Fork | PatchParams, _) => Conflict,
        (Timeout, S::Running | S::Snapshotting | S::Forking) => Proceed,
        (Timeout, _) => Conflict,
        (Commands, S::Running) => Proceed,
        (Commands, S::Snapshotting | S::Forking) => Wait,
        (Commands, _) => Conflict,
        (Network, S::Running | S::Paused) => Proceed,
        (Network, S::Pausing | S::Resuming | S::Snapshotting | S::Forking) => Wait,
    }
}

/// The user-visible description of a sandbox.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxInfo {
    pub id: String,
    #[serde(flatten)]
    pub settings: SandboxSettings,
    pub started_at: SystemTime,
    pub end_at: SystemTime,
    /// Changed only by [`SandboxInfo::transition`].
    state: SandboxState,
    pub host_ip: Ipv4Addr,
    pub netns_path: PathBuf,
    /// The secret an envd request must carry in `X-Access-Token` (E2B's
    /// `envdAccessToken`). Records written before it existed have none; then only the
    /// API key opens the sandbox's envd.
    #[serde(default)]
    pub envd_access_token: String,
    /// The secret that opens the sandbox's other ports when they are not public
    /// (`e2b-traffic-access-token`, E2B's `trafficAccessToken`).
    #[serde(default)]
    pub traffic_access_token: String,
    /// Set when the sandbox's guest broke the agent protocol: its agent channel was
    /// closed, commands and file transfers fail until the sandbox is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_protocol_violation: Option<String>,
    /// Set while QEMU keeps the VM paused because a write to its disk found the state
    /// dir full (operations.md §10.3): its calls answer 507 with the message. Not stored:
    /// only a running VM can be paused so.
    #[serde(skip)]
    pub paused_on_io_error: Option<IoErrorPause>,
    /// What the committed pause of a paused sandbox kept (`pauseMode` in GET); `None`
    /// while it runs or is still pausing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<super::settings::PauseMode>,
}

/// A running sandbox's VM paused by QEMU on a full state disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoErrorPause {
    pub since: SystemTime,
    /// What its commands, files and envd answer with (507).
    pub message: String,
}

impl SandboxInfo {
    pub fn state(&self) -> SandboxState {
        self.state
    }

    /// Moves to `next` if [`SandboxState::valid_transition`] allows it.
    pub fn transition(&mut self, next: SandboxState) -> Result<(), OrchError> {
        self.state.valid_transition(next)?;
        self.state = next;
        Ok(())
    }

    /// A description in any state, for unit tests that start from it.
    #[cfg(test)]
    pub(crate) fn in_state(mut self, state: SandboxState) -> SandboxInfo {
        self.state = state;
        self
    }

    /// The description of a sandbox that just became ready; its TTL starts now.
    pub fn new(
        id: String,
        settings: SandboxSettings,
        host_ip: Ipv4Addr,
        netns_path: PathBuf,
    ) -> SandboxInfo {
        let now = SystemTime::now();
        SandboxInfo {
            id,
            end_at: now + std::time::Duration::from_secs(settings.timeout_secs),
            settings,
            started_at: now,
            state: SandboxState::Running,
            host_ip,
            netns_path,
            envd_access_token: crate::util::new_secret(),
            traffic_access_token: crate::util::new_secret(),
            guest_protocol_violation: None,
            paused_on_io_error: None,
            pause_mode: None,
        }
    }
}

/// A lifecycle operation, sent to the sandbox's supervisor thread.
pub enum Op {
    /// Tear down: VM killed, stop hook, slot released, files removed.
    Delete {
        reason: crate::hooks::StopReason,
        reply: Sender<()>,
    },
    /// Capture in place into `dir` (or, filesystem-only, sync the guest and keep its disk),
    /// commit, quit, stop hook, release the slot.
    Pause {
        reason: crate::hooks::StopReason,
        request: super::settings::PauseRequest,
        dir: std::path::PathBuf,
        commit: super::supervisor::PauseCommit,
        reply: Sender<super::supervisor::PauseOutcome>,
    },
    /// Capture in place into `dir` with the disk frozen, then run on — or, without
    /// `run_on`, stay stopped until the Delete that follows (a template build, whose RAM
    /// file is the captured RAM and must not change again).
    Snapshot {
        dir: std::path::PathBuf,
        run_on: bool,
        reply: Sender<Result<crate::vm::CaptureRecord, super::supervisor::PauseOutcome>>,
    },
    /// Replace the slot's egress chain (`PUT …/network`); the VM runs on untouched.
    SetEgress {
        rules: crate::net::EgressRules,
        reply: Sender<Result<(), super::OrchError>>,
    },
    /// The slot's egress counters (network.md §5.8), for the metrics sampler; `None`
    /// without a slot or when they cannot be read.
    EgressCounts {
        reply: Sender<Option<crate::net::EgressCounts>>,
    },
    /// Freeze the disk into `dir` (a build step's cached result); the VM runs on.
    FreezeDisk {
        dir: std::path::PathBuf,
        reply: Sender<Result<Vec<std::path::PathBuf>, String>>,
    },
}

/// The live part of a running sandbox: the channel to its supervisor and the guest agent
/// client that commands and file transfers use directly.
#[derive(Clone)]
pub struct RuntimeHandle {
    pub ops: Sender<Op>,
    pub agent: Arc<AgentClient>,
    /// Unique per VM process of this server: a resumed or cloned sandbox runs a new
    /// instance, whose guest has not seen `/init` yet.
    pub instance: u64,
}

impl RuntimeHandle {
    pub fn new(ops: Sender<Op>, agent: Arc<AgentClient>) -> RuntimeHandle {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        RuntimeHandle {
            ops,
            agent,
            instance: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Has the supervisor tear the VM down (VM killed, stop hook with `reason`, slot
    /// released, files removed) and waits until it has. A supervisor that already exited
    /// on its own (the VM died) has done all of it: its channel is closed and this
    /// returns at once.
    pub fn delete(&self, reason: crate::hooks::StopReason) {
        let (reply, done) = crossbeam_channel::bounded(1);
        if self.ops.send(Op::Delete { reason, reply }).is_ok() {
            let _ = done.recv();
        }
    }
}

/// One registered sandbox.
pub struct SandboxEntry {
    /// Read with [`SandboxEntry::info`]/[`SandboxEntry::read`], changed with
    /// [`SandboxEntry::update`] and [`SandboxEntry::set_state`].
    info: Mutex<SandboxInfo>,
    /// Held for the whole of a lifecycle operation (api.md §2.2): operations on one
    /// sandbox are serialised, other sandboxes and reads never wait for it.
    lifecycle: Mutex<()>,
    /// Present while a VM runs.
    runtime: Mutex<Option<RuntimeHandle>>,
    /// The committed capture while paused.
    paused: Mutex<Option<crate::vm::CaptureRecord>>,
    running_commands: AtomicU32,
    /// Whether an auto-resume runs ([`super::wake`]); its failure, for the requests that
    /// wait on it.
    waking: AtomicBool,
    wake_error: Mutex<Option<super::OrchError>>,
    /// The VM instance ([`RuntimeHandle::instance`], never 0) whose guest got `/init`;
    /// 0 while none has.
    guest_init: AtomicU64,
    /// patch-params calls in flight; pause, delete and snapshot wait for them (custom-extension.md §6.4).
    patches: Mutex<u32>,
    patches_done: Condvar,
    /// What the guest saw of its CPU, memory and disk, sampled while it ran.
    pub metrics: super::guest_metrics::MetricsRing,
    /// What happened to it and what its guest wrote on its console.
    pub log: super::sandbox_log::SandboxLog,
}

impl SandboxEntry {
    pub fn new(info: SandboxInfo, runtime: Option<RuntimeHandle>) -> SandboxEntry {
        SandboxEntry {
            info: Mutex::new(info),
            lifecycle: Mutex::new(()),
            runtime: Mutex::new(runtime),
            paused: Mutex::new(None),
            running_commands: AtomicU32::new(0),
            waking: AtomicBool::new(false),
            wake_error: Mutex::new(None),
            guest_init: AtomicU64::new(0),
            patches: Mutex::new(0),
            patches_done: Condvar::new(),
            metrics: Default::default(),
            log: Default::default(),
        }
    }

    /// Where the guest agent listens while the sandbox runs; `None` otherwise (also while
    /// its VM is paused on an I/O error: it cannot answer).
    pub fn guest_agent_addr(&self, agent_port: u16) -> Option<std::net::SocketAddr> {
        let info = self.info.lock();
        let running = info.state == SandboxState::Running
            && info.paused_on_io_error.is_none()
            && self.runtime.lock().is_some();
        running.then(|| std::net::SocketAddr::from((info.host_ip, agent_port)))
    }

    /// The lock held for the whole of a lifecycle operation ([`super::lifecycle::admit`]).
    pub fn lifecycle(&self) -> &Mutex<()> {
        &self.lifecycle
    }

    /// The running VM's handle; `None` while no VM runs.
    pub fn runtime(&self) -> Option<RuntimeHandle> {
        self.runtime.lock().clone()
    }

    /// Whether a VM runs.
    pub fn has_runtime(&self) -> bool {
        self.runtime.lock().is_some()
    }

    /// Takes the VM's handle away (a delete, a VM that died): no call reaches it after.
    pub fn take_runtime(&self) -> Option<RuntimeHandle> {
        self.runtime.lock().take()
    }

    /// A resume or boot succeeded: `runtime` runs it and no capture is held any more.
    pub fn set_running_vm(&self, runtime: RuntimeHandle) {
        *self.runtime.lock() = Some(runtime);
        *self.paused.lock() = None;
    }

    /// A pause ended its VM: `capture` is what it kept (`None` when unreadable).
    pub fn set_paused_capture(&self, capture: Option<crate::vm::CaptureRecord>) {
        *self.runtime.lock() = None;
        *self.paused.lock() = capture;
    }

    /// The capture a paused sandbox holds.
    pub fn paused_capture(&self) -> Option<crate::vm::CaptureRecord> {
        self.paused.lock().clone()
    }

    /// Counts one more running command; `false` (and nothing counted) at `limit`.
    pub fn begin_command(&self, limit: u32) -> bool {
        let previous = self.running_commands.fetch_add(1, Ordering::SeqCst);
        if previous >= limit {
            self.running_commands.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    pub fn end_command(&self) {
        self.running_commands.fetch_sub(1, Ordering::SeqCst);
    }

    /// Marks an auto-resume as started; `false` when one runs already (the caller
    /// waits for it). A new wake forgets the previous one's failure.
    pub fn begin_wake(&self) -> bool {
        if self.waking.swap(true, Ordering::AcqRel) {
            return false;
        }
        *self.wake_error.lock() = None;
        true
    }

    /// The auto-resume ended, with its failure if it failed.
    pub fn end_wake(&self, error: Option<super::OrchError>) {
        *self.wake_error.lock() = error;
        self.waking.store(false, Ordering::Release);
    }

    /// The last auto-resume's failure.
    pub fn wake_error(&self) -> Option<super::OrchError> {
        self.wake_error.lock().clone()
    }

    /// Whether the guest of VM `instance` got its `/init` ([`super::envd::init_guest`]).
    pub fn guest_initialized(&self, instance: u64) -> bool {
        self.guest_init.load(Ordering::Acquire) == instance
    }

    /// Records that the guest of VM `instance` got its `/init`.
    pub fn set_guest_initialized(&self, instance: u64) {
        self.guest_init.store(instance, Ordering::Release);
    }

    /// Counts a PATCH in flight if the sandbox is running; `false` otherwise (409).
    pub fn begin_patch(&self) -> bool {
        let info = self.info.lock();
        if info.state != SandboxState::Running {
            return false;
        }
        *self.patches.lock() += 1;
        true
    }

    pub fn end_patch(&self) {
        let mut n = self.patches.lock();
        *n -= 1;
        if *n == 0 {
            self.patches_done.notify_all();
        }
    }

    /// Waits until no PATCH is in flight. Called after the state left `running`, so no
    /// new one can begin; each is bounded by the hook timeout.
    pub fn wait_patches(&self) {
        let mut n = self.patches.lock();
        while *n > 0 {
            self.patches_done.wait(&mut n);
        }
    }

    /// Whether the committed pause kept the disk only (a resume cold-boots).
    pub fn paused_filesystem_only(&self) -> bool {
        self.paused
            .lock()
            .as_ref()
            .is_some_and(|c| c.filesystem_only)
    }

    pub fn state(&self) -> SandboxState {
        self.info.lock().state
    }

    /// Moves to `next` if the state machine allows it; the caller holds the lifecycle
    /// lock.
    pub fn set_state(&self, next: SandboxState) -> Result<(), OrchError> {
        self.info.lock().transition(next)
    }

    /// A copy of the description.
    pub fn info(&self) -> SandboxInfo {
        self.info.lock().clone()
    }

    pub fn id(&self) -> String {
        self.info.lock().id.clone()
    }

    /// `f` of the description, under its lock (no hook call or VM operation inside).
    pub fn read<R>(&self, f: impl FnOnce(&SandboxInfo) -> R) -> R {
        f(&self.info.lock())
    }

    /// Changes the description under its lock; its state moves only by
    /// [`SandboxInfo::transition`].
    pub fn update<R>(&self, f: impl FnOnce(&mut SandboxInfo) -> R) -> R {
        f(&mut self.info.lock())
    }
}
