//! One supervisor thread per sandbox: it spawns the sandbox's QEMU process (so that
//! PR_SET_PDEATHSIG ties the VM to this thread), owns it and the network slot, handles
//! lifecycle [`Op`]s in order, and tears everything down on delete or when the VM dies.

use super::sandbox::{Op, RuntimeHandle, SandboxEntry, SandboxInfo, SandboxState};
use super::{ColdStart, OrchError, Shared};
use crate::agent::AgentClient;
use crate::hooks::{HookError, Instance, StartContext, StopReason};
use crate::net::Slot;
use crate::vm::{self, Vm, VmSpec};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// How often an idle supervisor checks that its VM is still alive.
const VM_WATCH_INTERVAL: Duration = Duration::from_millis(500);

/// A per-sandbox directory (disk overlay, sockets, console log) removed on drop unless
/// kept: a failed create leaves nothing behind.
pub(crate) struct RunDir {
    path: PathBuf,
}

impl RunDir {
    fn create(path: PathBuf) -> Result<RunDir, OrchError> {
        crate::store::ensure_private_dir(&path).map_err(|e| OrchError::Internal(e.to_string()))?;
        Ok(RunDir { path })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("op=cleanup path={} error={e}", self.path.display());
            }
        }
    }
}

/// What a supervisor needs to boot its sandbox.
struct BootPlan {
    id: String,
    run_dir: RunDir,
    slot: Slot,
    instance: Instance,
    kernel_args: Vec<String>,
    cpu_count: u32,
    memory_mb: u32,
}

/// The running resources a supervisor owns, and the instance the extension knows.
struct Runtime {
    vm: Vm,
    slot: Option<Slot>,
    instance: Option<Instance>,
    _run_dir: RunDir,
}

impl Runtime {
    /// CE §7.3 and §5.6 order: the VM process ends, the stop hook's first attempt runs
    /// while the namespace still exists, then the slot is released and the files removed.
    fn teardown(mut self, shared: &Shared, reason: StopReason) {
        self.vm.kill();
        if let Some(instance) = self.instance.take() {
            shared.hooks.stop(instance, reason);
        }
        if let Some(slot) = self.slot.take() {
            shared.slots.release(slot);
        }
    }
}

pub(crate) fn create_cold(shared: &Arc<Shared>, req: ColdStart) -> Result<SandboxInfo, OrchError> {
    let started = Instant::now();
    let image = shared.images.prepare_rootfs(&req.image, req.disk_size_mb)?;
    let image_ms = started.elapsed().as_millis();
    let id = crate::util::new_id();
    let run_dir = RunDir::create(shared.sandboxes_dir().join(&id))?;
    vm::create_overlay(
        &image.base_disk,
        &run_dir.path().join("disk.qcow2"),
        req.disk_size_mb,
    )
    .map_err(|e| OrchError::Internal(e.to_string()))?;
    let internet_access =
        shared.config.network.outbound && req.allow_internet_access != Some(false);
    let mut slot = shared.slots.acquire()?;
    if shared.config.network.outbound && !internet_access {
        slot.deny_outbound()?;
    }
    let host_ip = slot.host_ip();
    let netns_path = slot.netns_path().to_path_buf();

    // CE §5.2 step 4: journal + start-fresh once the slot is ready, before the VM starts.
    let mut kernel_args = guest_kernel_args(shared);
    let base_cmdline = vm::kernel_cmdline(shared.accel, &kernel_args)
        .map_err(|e| OrchError::Internal(e.to_string()))?;
    let context = StartContext {
        sandbox_id: id.clone(),
        netns_path: netns_path.clone(),
        host_ip,
        slot_index: slot.index(),
        params: req.custom_extension_params.clone(),
    };
    let (instance, started_hook) = shared.hooks.start_fresh(&context, base_cmdline.len());
    match started_hook {
        Ok(Some(extra)) => kernel_args.push(extra),
        Ok(None) => {}
        Err(e) => {
            // Rollback before the answer (CE §7.3): stop for the attempt, then the slot.
            shared.hooks.stop(instance, StopReason::StartFailed);
            shared.slots.release(slot);
            return Err(hook_error(e));
        }
    }
    let plan = BootPlan {
        id: id.clone(),
        run_dir,
        slot,
        instance,
        kernel_args,
        cpu_count: req.cpu_count,
        memory_mb: req.memory_mb,
    };

    let (boot_tx, boot_rx) = crossbeam_channel::bounded(1);
    let (ops_tx, ops_rx) = crossbeam_channel::unbounded();
    let thread_shared = shared.clone();
    std::thread::Builder::new()
        .name(format!("sbx-{}", &id[id.len() - 8..]))
        .spawn(move || supervise(thread_shared, plan, boot_tx, ops_rx))
        .map_err(|e| OrchError::Internal(format!("cannot start supervisor thread: {e}")))?;

    let agent = boot_rx
        .recv()
        .map_err(|_| OrchError::Internal("sandbox supervisor exited during boot".into()))??;

    let now = SystemTime::now();
    let info = SandboxInfo {
        id: id.clone(),
        template_id: image.reference.clone(),
        alias: None,
        started_at: now,
        end_at: now + Duration::from_secs(req.timeout_secs),
        cpu_count: req.cpu_count,
        memory_mb: req.memory_mb,
        disk_size_mb: req.disk_size_mb,
        metadata: req.metadata,
        env_vars: req.env_vars,
        image_env: image.env.clone(),
        auto_pause: req.auto_pause,
        internet_access,
        timeout_secs: req.timeout_secs,
        custom_extension_params: req.custom_extension_params,
        state: SandboxState::Running,
        host_ip,
        netns_path,
    };
    let entry = Arc::new(SandboxEntry::new(
        info.clone(),
        Some(RuntimeHandle { ops: ops_tx, agent }),
    ));
    shared.sandboxes.write().insert(id.clone(), entry);
    log::info!(
        "sandboxId={id} op=create_cold result=ok image={} hostIp={host_ip} imageMs={image_ms} totalMs={}",
        image.reference,
        started.elapsed().as_millis()
    );
    Ok(info)
}

/// A failed start or patch hook: 502 with the CE §7.5 message; a disabled extension: 400.
pub(crate) fn hook_error(e: HookError) -> OrchError {
    match e {
        HookError::Disabled => OrchError::BadRequest(e.to_string()),
        HookError::Failed { .. } => OrchError::Upstream(e.to_string()),
        HookError::Journal(_) => OrchError::Internal(e.to_string()),
    }
}

fn supervise(
    shared: Arc<Shared>,
    plan: BootPlan,
    boot_reply: Sender<Result<Arc<AgentClient>, OrchError>>,
    ops: Receiver<Op>,
) {
    let id = plan.id.clone();
    let runtime = match boot(&shared, plan) {
        Ok((runtime, agent)) => {
            if boot_reply.send(Ok(agent)).is_err() {
                runtime.teardown(&shared, StopReason::StartFailed);
                return;
            }
            runtime
        }
        Err(e) => {
            let _ = boot_reply.send(Err(e));
            return;
        }
    };
    run(&shared, &id, runtime, ops);
}

/// Boots the VM in the slot and waits for the guest agent. Every failure path tears down
/// what was made so far: VM killed and reaped, stop hook for the instance, slot released,
/// run dir removed.
fn boot(shared: &Shared, plan: BootPlan) -> Result<(Runtime, Arc<AgentClient>), OrchError> {
    let BootPlan {
        id,
        run_dir,
        slot,
        instance,
        kernel_args,
        cpu_count,
        memory_mb,
    } = plan;
    let fail = |slot: Slot, instance: Instance, e: &dyn std::fmt::Display| {
        shared.hooks.stop(instance, StopReason::StartFailed);
        shared.slots.release(slot);
        OrchError::Internal(e.to_string())
    };
    let netns = match slot.open_netns() {
        Ok(f) => f,
        Err(e) => return Err(fail(slot, instance, &e)),
    };
    let assets = &shared.config.vm.assets_dir;
    let spec = VmSpec {
        run_dir: run_dir.path().to_path_buf(),
        kernel: vm::guest_kernel(assets),
        initramfs: assets.join("initramfs.img"),
        kernel_args,
        cpu_count,
        memory_mb,
        disk: run_dir.path().join("disk.qcow2"),
        netns: Some(netns),
        tap: Some(crate::net::TAP_NAME.into()),
        accel: shared.accel,
        qemu_binary: shared.config.vm.qemu_binary.clone(),
    };
    let vm = match Vm::spawn(spec) {
        Ok(vm) => vm,
        Err(e) => return Err(fail(slot, instance, &e)),
    };
    let mut runtime = Runtime {
        vm,
        slot: Some(slot),
        instance: Some(instance),
        _run_dir: run_dir,
    };
    let timeout = Duration::from_secs(shared.config.vm.ready_timeout_secs);
    match AgentClient::connect(runtime.vm.agent_socket(), Instant::now() + timeout) {
        Ok(agent) => Ok((runtime, Arc::new(agent))),
        Err(e) => {
            let tail = runtime.vm.console_tail(20);
            let cause = match runtime.vm.try_wait() {
                Some(status) => format!("the VM exited during boot ({status})"),
                None => format!("no answer within {}s: {e}", timeout.as_secs()),
            };
            log::error!("sandboxId={id} op=boot result=error error=\"{e}\" console_tail=\n{tail}");
            runtime.teardown(shared, StopReason::StartFailed);
            Err(OrchError::Internal(format!(
                "guest agent did not become ready: {cause}; the console log's last lines are in the server log"
            )))
        }
    }
}

/// Kernel arguments agentenv adds after the VM module's own.
fn guest_kernel_args(shared: &Shared) -> Vec<String> {
    let mut args = vec![format!("agentenv.port={}", shared.config.agent.port)];
    if shared.config.network.outbound {
        if let Some(dns) = crate::net::guest_dns(&shared.config.network) {
            args.push(format!("agentenv.dns={dns}"));
        }
    }
    args
}

/// The supervisor's loop: lifecycle operations in order, and a watch on the VM.
fn run(shared: &Shared, id: &str, mut runtime: Runtime, ops: Receiver<Op>) {
    loop {
        match ops.recv_timeout(VM_WATCH_INTERVAL) {
            Ok(Op::Delete { reason, reply }) => {
                runtime.teardown(shared, reason);
                let _ = reply.send(());
                return;
            }
            Err(RecvTimeoutError::Timeout) => {
                if let Some(status) = runtime.vm.try_wait() {
                    log::error!(
                        "sandboxId={id} op=watch result=vm_exited status={status} console_tail=\n{}",
                        runtime.vm.console_tail(20)
                    );
                    if let Ok(entry) = shared.entry(id) {
                        entry.runtime.lock().take();
                    }
                    shared.unregister(id);
                    runtime.teardown(shared, StopReason::Failure);
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                runtime.teardown(shared, StopReason::Failure);
                return;
            }
        }
    }
}
