//! One supervisor thread per running sandbox: it spawns the sandbox's QEMU process (so
//! that PR_SET_PDEATHSIG ties the VM to this thread), owns it and the network slot,
//! handles lifecycle [`Op`]s in order, and tears everything down on delete, pause or when
//! the VM dies.

use super::admission::Reservation;
use super::sandbox::{IoErrorPause, Op};
use super::settings::{PauseMode, PauseRequest};
use super::sides::Machine;
use super::start::Launcher;
use super::{NotReady, OrchError};
use crate::agent::AgentClient;
use crate::hooks::{HookError, Instance, StopReason};
use crate::net::Slot;
use crate::vm::{
    self, CaptureRecord, DiskCapture, MachineConfig, MemoryFile, Priority, RestoreSpec, VmSpec,
};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a failed `Op::SetEgress` says it was doing.
pub(crate) const EGRESS_STEP: &str = "applying the egress policy";
/// How often an idle supervisor checks that its VM is still alive.
const VM_WATCH_INTERVAL: Duration = Duration::from_millis(500);
/// How long the delete of a build VM waits for a process that may be exiting.
const BUILD_DEATH_GRACE: Duration = Duration::from_millis(300);
/// How long a supervisor may take to launch before its creator gives up on it.
const LAUNCH_REPLY_SLACK: Duration = Duration::from_secs(60);
/// How long the guest may take to write its dirty pages before a filesystem-only pause.
const PAUSE_SYNC_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the agent may take to answer before a pause with `requireHealthyGuest`.
const PAUSE_PING_TIMEOUT: Duration = Duration::from_secs(5);

/// A per-sandbox directory (disk layers, sockets, console log, record). Removed on drop
/// while armed: a failed create leaves nothing behind, a failed resume keeps the paused
/// sandbox's files.
pub(crate) struct RunDir {
    path: PathBuf,
    remove_on_drop: bool,
}

impl RunDir {
    /// A new directory, removed on drop until [`RunDir::keep`].
    pub fn create(path: PathBuf) -> Result<RunDir, OrchError> {
        crate::store::ensure_private_dir(&path)?;
        Ok(RunDir {
            path,
            remove_on_drop: true,
        })
    }

    /// An existing directory (a paused sandbox's), not removed on drop until armed.
    pub fn existing(path: PathBuf) -> RunDir {
        RunDir {
            path,
            remove_on_drop: false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn keep(&mut self) {
        self.remove_on_drop = false;
    }

    pub fn arm(&mut self) {
        self.remove_on_drop = true;
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !self.remove_on_drop {
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("op=cleanup path={} error={e}", self.path.display());
            }
        }
    }
}

/// How a sandbox's VM comes to life.
pub(crate) enum Launch {
    /// A fresh boot with these extra kernel arguments. With `memory_file`, the guest's RAM
    /// is that file, mapped shared: a template build, whose capture then holds no RAM and
    /// whose clones map the file copy-on-write.
    Cold {
        kernel_args: Vec<String>,
        memory_file: Option<PathBuf>,
        /// The top layer to boot on; `None` is the run dir's `disk.qcow2`.
        disk: Option<PathBuf>,
    },
    /// A restore of `record` onto the writable top layer `disk`. The start-resume hook
    /// runs while the VM is prepared (QEMU started, state loaded, vCPUs stopped: the guest
    /// does not execute, custom-extension.md §3.2); its outcome arrives on `hook`, and
    /// only a success lets the vCPUs run. A failed hook's instance is stopped with
    /// `failed_reason`.
    Restore {
        record: Box<CaptureRecord>,
        disk: PathBuf,
        hook: Receiver<HookOutcome>,
        failed_reason: StopReason,
        /// A claimed standby's warm VM on `disk` in the slot (see [`super::standby`]):
        /// its state is loaded already, its vCPUs are stopped and its carrier is down.
        prepared: Option<super::standby::WarmVm>,
    },
}

/// The start-resume hook's outcome, for a supervisor that prepared its VM meanwhile.
pub(crate) struct HookOutcome {
    pub instance: Instance,
    pub result: Result<(), HookError>,
}

/// Everything a supervisor needs to start a sandbox's VM. The start hook was sent already
/// (`instance`), or for a restore is on its way (`instance` has no id until
/// [`HookOutcome`] brings it); every failure path owes it a stop.
pub(crate) struct StartPlan {
    pub placed: Placed,
    pub instance: Instance,
    pub launch: Launch,
}

/// What a start holds once it has its share of the host and its slot.
pub(crate) struct Placed {
    pub id: String,
    pub run_dir: RunDir,
    pub slot: Slot,
    pub resources: super::settings::Resources,
    /// The VM's memory and vCPUs, held by its supervisor thread for the VM's life.
    pub reservation: Reservation,
    /// Told what happens to the VM while it runs.
    pub watch: Box<dyn Watch>,
    /// The volumes the slot's NFS server exports to the guest (none: no server).
    pub exports: Vec<crate::volume::nfs::Export>,
}

/// What a supervisor reports about its running VM (for a registered sandbox: forget it,
/// mark it).
pub(crate) trait Watch: Send {
    /// What the VM is, for `agentenv_vm_deaths_total{kind}`.
    fn kind(&self) -> &'static str;
    /// The VM died on its own, before the supervisor tears down the rest (stop hook with
    /// reason `failure`, slot). Returns where the run dir is to be kept (quarantined); with
    /// `None` it is removed.
    fn vm_died(&self, exit: &vm::VmExit, run_dir: &Path) -> Option<PathBuf>;
    /// The guest broke the agent protocol: its agent channel is closed.
    fn guest_violated(&self, reason: &str);
    /// QEMU paused the VM on a full state disk (`Some`), or it runs again or is gone.
    fn io_error_paused(&self, pause: Option<&IoErrorPause>);
    /// How long a delete waits for a VM that may be exiting, to tell a death from a kill.
    fn death_grace(&self) -> Duration {
        Duration::ZERO
    }
    /// Whether a pause on a full state disk ends what the VM was doing (its agent channel is
    /// closed, so the call waiting on the guest fails at once rather than at its timeout).
    fn stops_on_io_pause(&self) -> bool {
        false
    }
}

/// The watch of a VM nobody else knows of.
pub(crate) struct Unwatched;

/// The watch of a template build's VM: its death, or QEMU pausing it on a full state
/// disk, stops the build's steps (`stop`, the flag their waits watch) and is kept for the
/// build's failure ([`BuildWatch::named`]); its run dir goes.
#[derive(Clone)]
pub(crate) struct BuildWatch {
    death: Arc<parking_lot::Mutex<Option<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl BuildWatch {
    pub fn new(stop: Arc<std::sync::atomic::AtomicBool>) -> BuildWatch {
        BuildWatch {
            death: Default::default(),
            stop,
        }
    }

    /// `error`, or what ended the VM when it died on its own or was paused on a full disk
    /// (what the build then saw is its effect; the full disk's message says "No space left
    /// on device", so the build's failure becomes a 507). Call it after the build VM's
    /// teardown (`RuntimeHandle::delete`).
    pub fn named(&self, error: OrchError) -> OrchError {
        match self.death.lock().as_ref() {
            Some(death) => OrchError::Internal(format!(
                "{death}; the build stopped and nothing of it was kept"
            )),
            None => error,
        }
    }

    fn ended(&self, why: String) {
        self.death.lock().get_or_insert(why);
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Watch for BuildWatch {
    fn kind(&self) -> &'static str {
        "build"
    }
    fn vm_died(&self, exit: &vm::VmExit, _: &Path) -> Option<PathBuf> {
        self.ended(format!("the build VM died on its own ({exit})"));
        None
    }
    fn guest_violated(&self, _: &str) {}
    /// A build cannot wait for space: it fails at once (507), not at its step's timeout.
    fn io_error_paused(&self, pause: Option<&IoErrorPause>) {
        if pause.is_some() {
            self.ended(
                "QEMU paused the build VM: a write to its disk failed (No space left on \
                 device)"
                    .into(),
            );
        }
    }
    fn stops_on_io_pause(&self) -> bool {
        true
    }
    /// A build's step fails the moment its VM's agent channel closes, which comes before
    /// the dead process can be reaped; the delete that follows waits for it briefly (once
    /// per build).
    fn death_grace(&self) -> Duration {
        BUILD_DEATH_GRACE
    }
}

impl Watch for Unwatched {
    fn kind(&self) -> &'static str {
        "build"
    }
    fn vm_died(&self, _: &vm::VmExit, _: &Path) -> Option<PathBuf> {
        None
    }
    fn guest_violated(&self, _: &str) {}
    fn io_error_paused(&self, _: Option<&IoErrorPause>) {}
}

/// The outcome of an in-place pause.
pub(crate) enum PauseOutcome {
    /// Captured, committed, stopped, slot released: the supervisor has exited.
    Paused,
    /// The capture failed but the VM runs on in place.
    RanOn(OrchError),
    /// The VM could not run on: it was torn down (stop hook, slot released, files
    /// removed). The sandbox must be removed.
    Gone(OrchError),
    /// The capture failed and the VM could not run on: it was stopped (stop hook with
    /// reason `failure`, slot released), but its run dir (disk, whatever the capture
    /// wrote) is kept: nothing stored is deleted because it could not be saved. The
    /// sandbox must be removed and its run dir quarantined.
    Stopped(OrchError),
    /// Captured and stopped, but the record could not be committed (retried): the
    /// capture is kept in place and the sandbox can be resumed from it.
    Uncommitted(Box<CaptureRecord>, OrchError),
}

/// Commits a pause durably (the paused record) before the stop hook is sent. Called again
/// when it fails.
pub(crate) type PauseCommit = Box<dyn Fn(&CaptureRecord) -> Result<(), OrchError> + Send>;

/// Waits before each new attempt at a failed pause commit.
const COMMIT_RETRY_DELAYS: [Duration; 3] = [
    Duration::from_millis(100),
    Duration::from_millis(500),
    Duration::from_millis(2000),
];

/// Starts a named thread running the closure (a seam: tests make it fail).
pub(crate) type ThreadSpawner = fn(String, Box<dyn FnOnce() + Send>) -> std::io::Result<()>;

pub(crate) fn spawn_thread(name: String, body: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
    std::thread::Builder::new().name(name).spawn(body).map(drop)
}

/// What a start that never reached its supervisor owes (custom-extension.md §7.3): the stop hook for the
/// instance its start hook opened, and the slot.
pub(crate) trait StartDebts {
    fn stop(&self, instance: Instance, reason: StopReason);
    fn release(&self, slot: Slot);
}

impl StartDebts for Launcher {
    fn stop(&self, instance: Instance, reason: StopReason) {
        self.hooks.stop(instance, reason);
    }

    fn release(&self, slot: Slot) {
        self.net.release(slot);
    }
}

/// Runs `body(plan)` on a new thread named after the sandbox. The plan waits in a hand-off
/// cell until the thread takes it, so when the thread cannot start it is still here: its
/// stop is sent and its slot released through `debts`, and its run dir goes with it.
fn spawn_supervisor(
    plan: StartPlan,
    spawn: ThreadSpawner,
    debts: &dyn StartDebts,
    body: impl FnOnce(StartPlan) + Send + 'static,
) -> Result<(), OrchError> {
    let name = format!(
        "sbx-{}",
        &plan.placed.id[plan.placed.id.len().saturating_sub(8)..]
    );
    let handoff = Arc::new(parking_lot::Mutex::new(Some(plan)));
    let theirs = handoff.clone();
    let spawned = spawn(
        name,
        Box::new(move || {
            if let Some(plan) = theirs.lock().take() {
                body(plan);
            }
        }),
    );
    match spawned {
        Ok(()) => Ok(()),
        Err(e) => {
            if let Some(plan) = handoff.lock().take() {
                log::warn!(
                    "sandboxId={} op=launch error=\"cannot start supervisor thread: {e}\"",
                    plan.placed.id
                );
                // A prepared VM (a standby's) dies before its slot goes.
                drop(plan.launch);
                debts.stop(plan.instance, StopReason::StartFailed);
                debts.release(plan.placed.slot);
            }
            Err(OrchError::host("cannot start supervisor thread", e))
        }
    }
}

/// Starts the supervisor thread and waits until the guest agent answers. Returns the
/// channel to the supervisor and the agent client.
pub(crate) fn start(
    launcher: &Arc<Launcher>,
    plan: StartPlan,
) -> Result<(Sender<Op>, Arc<AgentClient>), OrchError> {
    begin(launcher, plan)?.wait()
}

/// A supervisor thread launching its VM.
pub(crate) struct Launching {
    ops: Sender<Op>,
    reply: Receiver<Result<Arc<AgentClient>, OrchError>>,
    wait: Duration,
}

impl Launching {
    /// Waits until the guest agent answers (or the launch failed and was undone).
    pub(crate) fn wait(self) -> Result<(Sender<Op>, Arc<AgentClient>), OrchError> {
        let agent = self
            .reply
            .recv_timeout(self.wait)
            .map_err(|_| OrchError::vm_gone("starting the VM"))??;
        Ok((self.ops, agent))
    }
}

/// Starts the supervisor thread, which launches the VM; [`Launching::wait`] for it.
pub(crate) fn begin(launcher: &Arc<Launcher>, plan: StartPlan) -> Result<Launching, OrchError> {
    let (launch_tx, launch_rx) = crossbeam_channel::bounded(1);
    let (ops_tx, ops_rx) = crossbeam_channel::unbounded();
    let thread_launcher = launcher.clone();
    spawn_supervisor(plan, launcher.spawn, &**launcher, move |plan| {
        supervise(thread_launcher, plan, launch_tx, ops_rx)
    })?;
    Ok(Launching {
        ops: ops_tx,
        reply: launch_rx,
        wait: Duration::from_secs(launcher.vm.ready_timeout_secs) + LAUNCH_REPLY_SLACK,
    })
}

/// The running resources a supervisor owns, and the instance the extension knows.
struct Runtime {
    vm: Box<dyn Machine>,
    slot: Option<Slot>,
    instance: Option<Instance>,
    run_dir: RunDir,
    /// Given back when the runtime ends, whatever ended the VM.
    _reservation: Reservation,
    watch: Box<dyn Watch>,
    /// The guest agent's client, watched for protocol violations.
    agent: Option<Arc<AgentClient>>,
    /// The NFS server of the guest's volumes, in the slot's namespace.
    nfs: Option<crate::volume::nfs::NfsServer>,
    /// Set while QEMU keeps the VM paused on a full state disk ([`watch_disk`]).
    io_paused: bool,
    /// The thread the VM's process dies with. Last: dropped after the VM.
    parent: Parent,
}

/// Which thread a VM's process dies with (`PR_SET_PDEATHSIG`).
enum Parent {
    /// This supervisor thread started it.
    Here,
    /// Another thread: a kept VM's first supervisor, waiting on the guard, or the
    /// standby pool's worker (no guard: it lives as long as the server).
    Elsewhere(Option<super::kept::ParentGuard>),
}

impl Runtime {
    /// The VM is no longer paused on a full state disk (it runs, or is gone).
    fn io_continued(&mut self, launcher: &Launcher) {
        if std::mem::take(&mut self.io_paused) {
            launcher.disk.guest_continued();
            self.watch.io_error_paused(None);
        }
    }

    /// custom-extension.md §7.3 and §5.6 order: the VM process ends, the stop hook's first attempt runs
    /// while the namespace still exists, then the slot is released and (when armed) the
    /// files are removed.
    fn teardown(mut self, launcher: &Launcher, reason: StopReason) {
        self.io_continued(launcher);
        self.vm.kill();
        // Killed and reaped before its namespace is released.
        drop(self.nfs.take());
        if let Some(instance) = self.instance.take() {
            launcher.hooks.stop(instance, reason);
        }
        if let Some(slot) = self.slot.take() {
            launcher.net.release(slot);
        }
    }
}

fn supervise(
    launcher: Arc<Launcher>,
    plan: StartPlan,
    launch_reply: Sender<Result<Arc<AgentClient>, OrchError>>,
    ops: Receiver<Op>,
) {
    let id = plan.placed.id.clone();
    match launch(&launcher, plan) {
        Ok((runtime, agent)) => {
            if launch_reply.send(Ok(agent)).is_err() {
                runtime.teardown(&launcher, StopReason::StartFailed);
                return;
            }
            if let Some(child) = run(&launcher, &id, runtime, ops) {
                // Its VM was kept paused: it dies with this thread.
                super::kept::wait_for_child(child);
            }
        }
        Err(e) => {
            let _ = launch_reply.send(Err(e));
        }
    }
}

/// Boots or restores the VM in the slot and waits for the guest agent. Every failure path
/// tears down what was made: VM killed and reaped, stop hook for the instance, slot
/// released, run dir removed when armed.
fn launch(launcher: &Launcher, plan: StartPlan) -> Result<(Runtime, Arc<AgentClient>), OrchError> {
    let StartPlan {
        placed:
            Placed {
                id,
                run_dir,
                slot,
                resources,
                reservation,
                watch,
                exports,
            },
        mut instance,
        launch,
    } = plan;
    let launched = Instant::now();
    let fail = |slot: Slot, instance: Instance, e: OrchError| {
        launcher.hooks.stop(instance, StopReason::StartFailed);
        launcher.net.release(slot);
        e
    };
    let hook = HookWait::of(&launch);
    let netns = match slot.open_netns() {
        Ok(f) => f,
        Err(e) => {
            let _ = hook.take(&mut instance);
            let e = OrchError::host("cannot open the slot's network namespace", e);
            return Err(fail(slot, instance, e));
        }
    };
    let nfs = match serve_volumes(run_dir.path(), &netns, &exports) {
        Ok(nfs) => nfs,
        Err(e) => {
            let _ = hook.take(&mut instance);
            return Err(fail(slot, instance, e.into()));
        }
    };
    let restored = matches!(launch, Launch::Restore { .. });
    // A filesystem-only capture boots its kernel like a cold start (held like a restore).
    let booted = match &launch {
        Launch::Cold { .. } => true,
        Launch::Restore { record, .. } => record.filesystem_only,
    };
    let spawned = spawn_vm(launcher, launch, run_dir.path(), netns, resources);
    let prepared = Instant::now();
    let hooked = hook.take(&mut instance);
    if hook.receiver.is_some() {
        log::info!(
            "sandboxId={id} op=launch hookWaitMs={} hook={}",
            prepared.elapsed().as_millis(),
            if hooked.is_ok() { "ok" } else { "failed" }
        );
    }
    if let Err(e) = hooked {
        // Rollback before the answer (custom-extension.md §7.3): the VM never ran; stop
        // for the attempt, then the slot; the reservation goes on return.
        if let Ok((vm, ..)) = spawned {
            vm.kill();
        }
        drop(nfs);
        launcher.hooks.stop(instance, hook.failed_reason);
        launcher.net.release(slot);
        return Err(e.into());
    }
    let (mut vm, warm_agent, parent) = match spawned {
        Ok(spawned) => spawned,
        Err(e) => {
            drop(nfs);
            return Err(fail(slot, instance, OrchError::vm("starting QEMU", e)));
        }
    };
    if restored {
        if let Err(e) = vm.resume_vcpus() {
            vm.kill();
            drop(nfs);
            let e = OrchError::vm("starting the restored vCPUs", e);
            return Err(fail(slot, instance, e));
        }
    }
    let runtime = Runtime {
        vm,
        slot: Some(slot),
        instance: Some(instance),
        run_dir,
        _reservation: reservation,
        watch,
        agent: None,
        nfs,
        io_paused: false,
        parent,
    };
    let times = (launched, prepared, Instant::now());
    let how = Readiness {
        restored,
        booted,
        carrier_down: !matches!(runtime.parent, Parent::Here),
        warm_agent,
    };
    wait_ready(launcher, &id, runtime, how, times)
}

/// The guest's volumes are served before it runs, so a restored guest's NFS mounts
/// reconnect at once. No volumes: no server.
fn serve_volumes(
    run_dir: &Path,
    netns: &std::fs::File,
    exports: &[crate::volume::nfs::Export],
) -> Result<Option<crate::volume::nfs::NfsServer>, crate::volume::VolumeError> {
    if exports.is_empty() {
        return Ok(None);
    }
    crate::volume::nfs::NfsServer::start(&run_dir.join("nfs"), netns, exports).map(Some)
}

/// A restore's start-resume outcome, which must be taken on every path (the instance it
/// brings is owed a stop).
struct HookWait {
    receiver: Option<Receiver<HookOutcome>>,
    failed_reason: StopReason,
}

impl HookWait {
    fn of(launch: &Launch) -> HookWait {
        match launch {
            Launch::Restore {
                hook,
                failed_reason,
                ..
            } => HookWait {
                receiver: Some(hook.clone()),
                failed_reason: *failed_reason,
            },
            Launch::Cold { .. } => HookWait {
                receiver: None,
                failed_reason: StopReason::StartFailed,
            },
        }
    }

    /// Waits for the hook's outcome and takes the instance it opened.
    fn take(&self, instance: &mut Instance) -> Result<(), HookError> {
        let Some(hook) = &self.receiver else {
            return Ok(());
        };
        match hook.recv() {
            Ok(outcome) => {
                *instance = outcome.instance;
                outcome.result
            }
            Err(_) => Err(HookError::Failed {
                hook: crate::hooks::Hook::StartResume,
                cause: crate::hooks::Cause::Connection("the start was abandoned".into()),
            }),
        }
    }
}

/// A VM, its agent connection when it comes with one, and its parent thread.
type Spawned = (Box<dyn Machine>, Option<AgentClient>, Parent);

/// Boots the VM or restores it into a new QEMU; a claimed standby's warm VM comes with
/// its agent connection, a kept paused VM with its parent's guard.
fn spawn_vm(
    launcher: &Launcher,
    launch: Launch,
    run_dir: &Path,
    netns: std::fs::File,
    resources: super::settings::Resources,
) -> Result<Spawned, vm::VmError> {
    match launch {
        Launch::Cold {
            kernel_args,
            memory_file,
            disk,
        } => {
            let assets = &launcher.vm.assets_dir;
            let spec = VmSpec {
                machine: MachineConfig {
                    kernel: vm::guest_kernel(assets),
                    initramfs: assets.join("initramfs.img"),
                    cpu_count: resources.cpu_count,
                    memory_mb: resources.memory_mb,
                },
                kernel_args,
                disk: disk.unwrap_or_else(|| run_dir.join("disk.qcow2")),
                host: launcher.plumbing(run_dir, netns),
            };
            let memory = memory_file.map(|path| MemoryFile { path, shared: true });
            launcher.machines.boot(spec, memory)
        }
        Launch::Restore {
            prepared: Some(warm),
            ..
        } => return Ok((warm.vm, warm.agent, Parent::Elsewhere(warm.parent))),
        Launch::Restore { record, disk, .. } => {
            let spec = RestoreSpec {
                disk,
                host: launcher.plumbing(run_dir, netns),
            };
            launcher.machines.restore(&record, spec)
        }
    }
    .map(|vm| (vm, None, Parent::Here))
}

/// How a started VM becomes ready.
struct Readiness {
    restored: bool,
    /// Its kernel booted (a cold start, or a filesystem-only capture).
    booted: bool,
    /// A prepared VM (a standby's, a kept one): its carrier goes up once the clock is set.
    carrier_down: bool,
    /// A warm standby's agent connection.
    warm_agent: Option<AgentClient>,
}

/// Waits until the guest agent answers (and sets a restored guest's clock; a warm
/// standby's carrier goes up after that); on failure tears the runtime down and says
/// whether the VM exited or stayed silent.
fn wait_ready(
    launcher: &Launcher,
    id: &str,
    mut runtime: Runtime,
    how: Readiness,
    (launched, prepared, running): (Instant, Instant, Instant),
) -> Result<(Runtime, Arc<AgentClient>), OrchError> {
    let Readiness {
        restored,
        booted,
        carrier_down,
        warm_agent,
    } = how;
    let timeout = Duration::from_secs(launcher.vm.ready_timeout_secs);
    let mut clock = Duration::ZERO;
    let ready = match warm_agent {
        Some(agent) => Ok(agent),
        None => runtime.vm.connect_agent(Instant::now() + timeout),
    };
    let ready = ready.and_then(|agent| {
        agent.set_label(id);
        // A restored guest's clock stopped while it was saved (issue: guest clock).
        if restored && !booted {
            let t = Instant::now();
            vm::sync_guest_clock(&agent)?;
            clock = t.elapsed();
        }
        Ok(agent)
    });
    let agent = match ready {
        Ok(agent) => agent,
        Err(e) => {
            let tail = runtime.vm.console_tail(20);
            let why = match runtime.vm.exited() {
                Some(status) => NotReady::Exited(status),
                None if matches!(runtime.vm.paused_on_io_error(), Ok(true)) => NotReady::DiskFull {
                    message: launcher.disk.guest_booting_on_full_disk(),
                },
                None => NotReady::Silent {
                    secs: timeout.as_secs(),
                    source: Arc::new(e),
                },
            };
            log::error!(
                "sandboxId={id} op=launch result=error error=\"{why}\" console_tail=\n{tail}"
            );
            runtime.teardown(launcher, StopReason::StartFailed);
            return Err(OrchError::GuestNotReady(why));
        }
    };
    // No guest traffic before start-resume succeeded and the clock is right.
    if carrier_down {
        if let Err(e) = runtime.vm.set_carrier(true) {
            log::error!("sandboxId={id} op=launch step=carrier_up error=\"{e}\"");
            runtime.teardown(launcher, StopReason::StartFailed);
            return Err(OrchError::vm("putting the guest NIC's carrier up", e));
        }
    }
    if booted {
        // Only costs idle CPU when it fails: the start goes on.
        if let Err(e) = runtime.vm.boot_finished() {
            log::warn!("sandboxId={id} op=launch step=boot_finished error=\"{e}\"");
        }
    }
    log::info!(
        "sandboxId={id} op=launch result=ready prepareMs={} agentMs={} clockMs={} totalMs={}",
        (prepared - launched).as_millis(),
        running.elapsed().as_millis(),
        clock.as_millis(),
        launched.elapsed().as_millis()
    );
    let agent = Arc::new(agent);
    runtime.agent = Some(agent.clone());
    Ok((runtime, agent))
}

/// The supervisor's loop: lifecycle operations in order, and a watch on the VM. Returns
/// what to wait on when the VM this thread started was kept paused.
fn run(
    launcher: &Launcher,
    id: &str,
    mut runtime: Runtime,
    ops: Receiver<Op>,
) -> Option<Receiver<()>> {
    loop {
        match ops.recv_timeout(VM_WATCH_INTERVAL) {
            Ok(Op::Delete { reason, reply }) => {
                // A VM found dead here died on its own before the delete reached it.
                let grace = runtime.watch.death_grace();
                match runtime.vm.exited_within(grace) {
                    Some(exit) => vm_died(launcher, id, runtime, exit),
                    None => {
                        runtime.run_dir.arm();
                        runtime.teardown(launcher, reason);
                    }
                }
                let _ = reply.send(());
                return None;
            }
            Ok(Op::Pause {
                reason,
                request,
                dir,
                commit,
                reply,
            }) => match pause(launcher, id, runtime, (reason, request), &dir, commit) {
                (AfterPause::RunsOn(rt), outcome) => {
                    runtime = *rt;
                    let _ = reply.send(outcome);
                }
                (AfterPause::Ended(child), outcome) => {
                    let _ = reply.send(outcome);
                    return child;
                }
            },
            Ok(Op::Snapshot { dir, run_on, reply }) => {
                match snapshot(id, &mut runtime, &dir, run_on) {
                    Ok(record) => {
                        let _ = reply.send(Ok(record));
                    }
                    Err(PauseOutcome::RanOn(e)) => {
                        let _ = reply.send(Err(PauseOutcome::RanOn(e)));
                    }
                    Err(PauseOutcome::Stopped(e)) => {
                        runtime.run_dir.keep();
                        runtime.teardown(launcher, StopReason::Failure);
                        let _ = reply.send(Err(PauseOutcome::Stopped(e)));
                        return None;
                    }
                    Err(gone) => {
                        runtime.run_dir.arm();
                        runtime.teardown(launcher, StopReason::Failure);
                        let _ = reply.send(Err(gone));
                        return None;
                    }
                }
            }
            Ok(Op::SetEgress { rules, reply }) => {
                let applied = match runtime.slot.as_mut() {
                    Some(slot) => slot
                        .set_egress(&rules)
                        .map_err(|e| OrchError::net(EGRESS_STEP, e)),
                    None => Err(OrchError::Lacks {
                        id: id.to_string(),
                        what: "network slot",
                    }),
                };
                let _ = reply.send(applied);
            }
            Ok(Op::EgressCounts { reply }) => {
                let counts = runtime.slot.as_ref().and_then(|s| s.egress_counts().ok());
                let _ = reply.send(counts);
            }
            Ok(Op::FreezeDisk { dir, reply }) => {
                let frozen = match runtime.vm.disk_chain_depth() {
                    Ok(d) if d + 2 >= vm::MAX_CHAIN_LAYERS => {
                        Err(format!("the disk chain is {d} layers deep"))
                    }
                    _ => runtime.vm.freeze_disk(&dir).map_err(|e| e.to_string()),
                };
                let _ = reply.send(frozen);
            }
            Err(RecvTimeoutError::Timeout) => {
                watch_agent(id, &mut runtime);
                if let Some(exit) = runtime.vm.exited() {
                    vm_died(launcher, id, runtime, exit);
                    return None;
                }
                watch_disk(launcher, id, &mut runtime);
            }
            Err(RecvTimeoutError::Disconnected) => {
                runtime.run_dir.arm();
                runtime.teardown(launcher, StopReason::Failure);
                return None;
            }
        }
    }
}

/// A VM that ended without being asked to (OOM killer, a QEMU bug, an operator's kill):
/// counted, logged, its sandbox forgotten by its watch (404 naming the death), then the
/// stop hook (reason `failure`) and the slot; the run dir (disk, record, console log)
/// goes to quarantine with a `.reason` naming the exit, or is removed when the watch
/// keeps nothing (a build's).
fn vm_died(launcher: &Launcher, id: &str, mut runtime: Runtime, exit: vm::VmExit) {
    let kind = runtime.watch.kind();
    launcher.deaths.record(kind, &exit);
    let dir = runtime.run_dir.path().to_path_buf();
    log::error!(
        "sandboxId={id} op=watch result=vm_died kind={kind} cause={} status=\"{exit}\" console_tail=\n{}",
        exit.cause(),
        runtime.vm.console_tail(20)
    );
    let watch = std::mem::replace(&mut runtime.watch, Box::new(Unwatched));
    let keep = watch.vm_died(&exit, &dir);
    match &keep {
        Some(_) => runtime.run_dir.keep(),
        None => runtime.run_dir.arm(),
    }
    runtime.teardown(launcher, StopReason::Failure);
    if let Some(dest) = keep {
        let why = format!("the VM of sandbox {id} died on its own ({exit})");
        crate::store::quarantine_to(&dir, &dest, &why);
    }
}

/// A guest whose disk write found the state dir full is paused by QEMU (status `io-error`,
/// the write kept): it is marked (its calls answer 507, operations.md §10.3) until
/// [`state_disk::GUEST_CONTINUE_FREE`] bytes are free, then continued (`cont` retries the
/// write; one that finds no room again pauses it again, still marked). The mark goes once
/// the VM is seen running.
///
/// [`state_disk::GUEST_CONTINUE_FREE`]: super::state_disk::GUEST_CONTINUE_FREE
fn watch_disk(launcher: &Launcher, id: &str, runtime: &mut Runtime) {
    if runtime.io_paused && !launcher.disk.room_for_guest() {
        return;
    }
    let stopped = match runtime.vm.paused_on_io_error() {
        Ok(stopped) => stopped,
        Err(e) => {
            log::warn!("sandboxId={id} op=watch step=query_status error=\"{e}\"");
            return;
        }
    };
    match (stopped, runtime.io_paused) {
        (true, false) => {
            let pause = launcher.disk.guest_paused(id);
            log::error!(
                "sandboxId={id} op=watch result=paused_on_io_error reason=\"{}\"",
                pause.message
            );
            runtime.watch.io_error_paused(Some(&pause));
            runtime.io_paused = true;
            if runtime.watch.stops_on_io_pause() {
                if let Some(agent) = runtime.agent.take() {
                    agent.close();
                }
            }
        }
        (true, true) => match runtime.vm.resume_vcpus() {
            Ok(()) => log::info!("sandboxId={id} op=watch result=continued_after_io_error"),
            Err(e) => log::warn!("sandboxId={id} op=watch step=cont error=\"{e}\""),
        },
        (false, true) => {
            log::info!("sandboxId={id} op=watch result=running_after_io_error");
            runtime.io_continued(launcher);
        }
        (false, false) => {}
    }
}

/// Reports a guest that broke the agent protocol, once: a log line naming the sandbox and
/// the violation, and the watch marks the sandbox. The VM runs on; its agent channel is
/// closed, so commands and file transfers fail until the sandbox is deleted.
fn watch_agent(id: &str, runtime: &mut Runtime) {
    let Some(violation) = runtime.agent.as_ref().and_then(|a| a.protocol_violation()) else {
        return;
    };
    runtime.agent = None;
    log::error!("sandboxId={id} op=watch result=guest_protocol_violation reason=\"{violation}\"");
    runtime.watch.guest_violated(&violation);
}

/// What is left of a supervisor's runtime after a pause.
enum AfterPause {
    /// The VM runs on.
    RunsOn(Box<Runtime>),
    /// The runtime ended; with what to wait on when this thread's VM was kept.
    Ended(Option<Receiver<()>>),
}

/// custom-extension.md §5.4 steps 3–6: capture in place and quit (or keep the VM,
/// [`super::kept`]), commit the paused record, stop hook, slot released (or kept).
fn pause(
    launcher: &Launcher,
    id: &str,
    mut runtime: Runtime,
    (reason, request): (StopReason, PauseRequest),
    dir: &Path,
    commit: PauseCommit,
) -> (AfterPause, PauseOutcome) {
    if let Err(e) = ready_for_pause(&runtime, request) {
        return (
            AfterPause::RunsOn(Box::new(runtime)),
            PauseOutcome::RanOn(OrchError::Unavailable(format!(
                "sandbox {id} was not paused and runs on: its guest agent did not answer ({e}); \
                 {}",
                match request.mode {
                    PauseMode::Filesystem => {
                        "a filesystem-only pause needs it to write the guest's files to its disk"
                    }
                    PauseMode::Full => "requireHealthyGuest asked for an answering agent",
                }
            ))),
        );
    }
    let boost = PauseBoost::raise(&mut *runtime.vm, id, launcher.vm.pause_realtime);
    // Volumes' NFS server is not kept: its guest's mounts would wait on a dead server.
    let may_keep = launcher.kept.enabled() && runtime.nfs.is_none();
    let captured = match request.mode {
        PauseMode::Full if may_keep => runtime.vm.pause_keeping(dir),
        PauseMode::Full => runtime.vm.pause(dir).map(|(r, s)| (r, s, false)),
        PauseMode::Filesystem => runtime
            .vm
            .pause_to_disk()
            .map(|record| (record, vm::CaptureStats::default(), false)),
    };
    match captured {
        Ok((record, stats, kept)) => {
            log::info!(
                "sandboxId={id} op=pause frozenMs={} totalMs={} stateBytes={} kept={kept} \
                 priority={}",
                stats.frozen_ms,
                stats.total_ms,
                stats.state_bytes,
                boost.vm_label()
            );
            let mut committed = commit(&record);
            for delay in COMMIT_RETRY_DELAYS {
                let Err(e) = &committed else { break };
                log::warn!(
                    "sandboxId={id} op=pause_commit error=\"{e}\" retry_in_ms={}",
                    delay.as_millis()
                );
                std::thread::sleep(delay);
                committed = commit(&record);
            }
            boost.lower(kept.then_some(&mut *runtime.vm));
            // The capture is complete either way: the run dir is kept.
            runtime.run_dir.keep();
            match committed {
                Ok(()) if kept => {
                    let child = keep_paused(launcher, id, runtime, reason);
                    (AfterPause::Ended(child), PauseOutcome::Paused)
                }
                Ok(()) => {
                    runtime.teardown(launcher, reason);
                    (AfterPause::Ended(None), PauseOutcome::Paused)
                }
                Err(e) => {
                    runtime.teardown(launcher, reason);
                    let outcome = PauseOutcome::Uncommitted(Box::new(record), e);
                    (AfterPause::Ended(None), outcome)
                }
            }
        }
        Err(e) => {
            boost.lower(Some(&mut *runtime.vm));
            let e = OrchError::vm("pause failed", e);
            if runtime.vm.exited().is_none() && runtime.vm.resume_vcpus().is_ok() {
                let _ = std::fs::remove_dir_all(dir);
                (
                    AfterPause::RunsOn(Box::new(runtime)),
                    PauseOutcome::RanOn(e),
                )
            } else {
                // The guest's disk is all that is left of it: kept, with the rest of the
                // run dir, for the caller to quarantine.
                runtime.run_dir.keep();
                runtime.teardown(launcher, StopReason::Failure);
                (AfterPause::Ended(None), PauseOutcome::Stopped(e))
            }
        }
    }
}

/// A committed pause whose VM stayed stopped in place: the pause ends as any other for
/// the guest and the extension (agent channel closed, stop hook), but the VM, with its
/// carrier down, and its slot and share go to the kept pool instead of away. Returns what
/// this thread must wait on when it is the VM's parent.
fn keep_paused(
    launcher: &Launcher,
    id: &str,
    mut runtime: Runtime,
    reason: StopReason,
) -> Option<Receiver<()>> {
    runtime.io_continued(launcher);
    if let Some(agent) = runtime.agent.take() {
        agent.close();
    }
    if let Err(e) = runtime.vm.set_carrier(false) {
        log::warn!("sandboxId={id} op=keep_paused step=carrier_down error=\"{e}\"");
        runtime.teardown(launcher, reason);
        return None;
    }
    let held_kib = runtime.vm.memory_kib().unwrap_or(0);
    if let Some(instance) = runtime.instance.take() {
        launcher.hooks.stop(instance, reason);
    }
    let Some(slot) = runtime.slot.take() else {
        runtime.teardown(launcher, reason);
        return None;
    };
    let Runtime {
        vm,
        _reservation: reservation,
        parent,
        ..
    } = runtime;
    let (guard, child) = match parent {
        Parent::Here => {
            let (guard, child) = super::kept::parent_guard();
            (Some(guard), Some(child))
        }
        Parent::Elsewhere(guard) => (guard, None),
    };
    let kept = super::kept::KeptVm {
        vm,
        slot,
        reservation,
        parent: guard,
    };
    launcher.kept.park(id, kept, held_kib);
    child
}

/// The priority of a pausing VM and of its supervisor thread while the guest is frozen
/// (`[vm] pause_realtime`), and the one used where the kernel refuses the real-time class.
const PAUSE_REALTIME: Priority = Priority::Realtime(1);
const PAUSE_NICE: Priority = Priority::Nice(-10);

/// A pause's frozen window runs ahead of the host's other guests: on a host full of idle
/// guests every QMP round trip and page copy would otherwise wait behind hundreds of
/// runnable threads (the pause after 32 MiB dirtied went from 84 ms quiet to 418 ms with
/// 500 guests, 318 ms at nice -10). The guest's vCPUs are stopped meanwhile, so no guest
/// code runs in the real-time class; the window is bounded by the capture's timeouts.
struct PauseBoost {
    /// The supervisor thread's priority before the pause, to go back to.
    thread: Option<Priority>,
    /// What the VM's threads got.
    vm: Priority,
}

impl PauseBoost {
    fn raise(vm: &mut dyn Machine, id: &str, realtime: bool) -> PauseBoost {
        let wanted = if realtime { PAUSE_REALTIME } else { PAUSE_NICE };
        let refused = |what: &str, e: &dyn std::fmt::Display| {
            log::warn!(
                "sandboxId={id} op=pause step=priority of={what} wanted={wanted:?} error=\"{e}\""
            );
        };
        // A refused change leaves the priority as it was: the fallback starts from there.
        let thread = crate::sys::process::set_thread_priority(wanted)
            .or_else(|e| {
                refused("thread", &e);
                crate::sys::process::set_thread_priority(PAUSE_NICE)
            })
            .ok();
        let got = vm.set_priority(wanted).map(|()| wanted).or_else(|e| {
            refused("vm", &e);
            vm.set_priority(PAUSE_NICE).map(|()| PAUSE_NICE)
        });
        let vm = got.unwrap_or_else(|e| {
            refused("vm", &e);
            Priority::Nice(0)
        });
        PauseBoost { thread, vm }
    }

    /// What the VM's own threads ran at, for the log.
    fn vm_label(&self) -> &'static str {
        match self.vm {
            Priority::Realtime(_) => "realtime",
            Priority::Nice(0) => "normal",
            Priority::Nice(_) => "nice",
        }
    }

    /// Back to normal; `vm` is the VM when it runs on.
    fn lower(self, vm: Option<&mut dyn Machine>) {
        if let Some(vm) = vm {
            let _ = vm.set_priority(Priority::Nice(0));
        }
        if let Some(old) = self.thread {
            let _ = crate::sys::process::set_thread_priority(old);
        }
    }
}

/// The guest agent's answer a pause needs first: a ping, or for a filesystem-only pause
/// the guest's `sync` (its page cache dies with its memory).
fn ready_for_pause(runtime: &Runtime, request: PauseRequest) -> Result<(), String> {
    if !request.needs_agent() {
        return Ok(());
    }
    let Some(agent) = &runtime.agent else {
        return Err("the sandbox has no agent connection".into());
    };
    let answered = match request.mode {
        PauseMode::Filesystem => agent.sync(PAUSE_SYNC_TIMEOUT),
        PauseMode::Full => agent.ping(PAUSE_PING_TIMEOUT),
    };
    answered.map_err(|e| e.to_string())
}

/// custom-extension.md §5.7: capture in place with the disk frozen, then run on. The sandbox's disk chain
/// grows by one layer per capture; it is flattened when it gets deep.
fn snapshot(
    id: &str,
    runtime: &mut Runtime,
    dir: &Path,
    run_on: bool,
) -> Result<CaptureRecord, PauseOutcome> {
    let captured = runtime.vm.capture(dir, DiskCapture::Freeze);
    if !run_on {
        return captured
            .map(|(record, _)| record)
            .map_err(|e| PauseOutcome::Gone(OrchError::vm("capture failed", e)));
    }
    let resumed = runtime.vm.resume_vcpus();
    match (captured, resumed) {
        (Ok((record, stats)), Ok(())) => {
            log::info!(
                "sandboxId={id} op=snapshot frozenMs={} totalMs={}",
                stats.frozen_ms,
                stats.total_ms
            );
            if runtime
                .vm
                .disk_chain_depth()
                .is_ok_and(|d| d > vm::MAX_CHAIN_LAYERS)
            {
                if let Err(e) = runtime.vm.flatten_disk(Duration::from_secs(120)) {
                    log::warn!("sandboxId={id} op=flatten_disk error=\"{e}\"");
                }
            }
            Ok(record)
        }
        (Err(e), Ok(())) => {
            let _ = std::fs::remove_dir_all(dir);
            Err(PauseOutcome::RanOn(OrchError::vm("snapshot failed", e)))
        }
        (_, Err(e)) => Err(PauseOutcome::Stopped(OrchError::vm(
            "the VM could not run on after a capture",
            e,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::FakeHost;
    use crate::net::SlotManager;
    use parking_lot::Mutex;

    #[derive(Default)]
    struct RecordedDebts {
        stops: Mutex<Vec<(Option<String>, StopReason)>>,
        released: Mutex<Vec<u32>>,
    }

    impl StartDebts for RecordedDebts {
        fn stop(&self, instance: Instance, reason: StopReason) {
            self.stops.lock().push((instance.instance_id, reason));
        }
        fn release(&self, slot: Slot) {
            self.released.lock().push(slot.index());
        }
    }

    #[test]
    fn a_supervisor_that_cannot_start_still_sends_the_stop_hook() {
        let mut net = crate::config::Config::from_sources(None, &[])
            .unwrap()
            .network;
        net.netns_dir = PathBuf::from("/run/test-netns");
        let slots = SlotManager::start_with(Arc::new(FakeHost::default()), &net, &[]).unwrap();
        let dir = std::env::temp_dir().join(format!("aenv-sup-{}", crate::util::new_id()));
        let admission = super::super::admission::Admission::new(super::super::admission::Limits {
            memory_mb: Some(1024),
            vcpus: Some(4),
        });
        let placed = Placed {
            id: "sandbox-1".into(),
            run_dir: RunDir::create(dir.clone()).unwrap(),
            slot: slots.acquire().unwrap(),
            resources: crate::orchestrator::fakes::settings().resources,
            reservation: admission.reserve(128, 1).unwrap(),
            watch: Box::new(Unwatched),
            exports: Vec::new(),
        };
        let plan = StartPlan {
            placed,
            instance: Instance {
                sandbox_id: "sandbox-1".into(),
                instance_id: Some("instance-1".into()),
            },
            launch: Launch::Cold {
                kernel_args: vec![],
                memory_file: None,
                disk: None,
            },
        };
        let debts = RecordedDebts::default();
        let no_threads: ThreadSpawner = |_, _| Err(std::io::Error::other("no threads"));
        let e = spawn_supervisor(plan, no_threads, &debts, |_| panic!("never runs")).unwrap_err();
        assert!(
            e.to_string().contains("cannot start supervisor thread"),
            "{e}"
        );
        assert_eq!(
            *debts.stops.lock(),
            [(Some("instance-1".to_string()), StopReason::StartFailed)]
        );
        assert_eq!(debts.released.lock().len(), 1);
        assert!(!dir.exists(), "the run dir is removed");
        assert_eq!(admission.in_use(), (0, 0), "the reservation is given back");
        slots.shutdown();
    }
}
