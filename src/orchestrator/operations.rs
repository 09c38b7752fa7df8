//! The lifecycle operations that create or move a VM: cold create, pause, resume,
//! snapshot, create from a snapshot, fork. Each runs on the calling (API or expiry)
//! thread while holding the sandbox's lifecycle lock; the VM work itself happens on the
//! sandbox's supervisor thread. Hook order follows custom-extension.md §5.

use super::lifecycle::{admit, Admitted};
use super::records::{self, SandboxRecord, PAUSED_DIR};
use super::sandbox::{Call, Op, RuntimeHandle, SandboxEntry, SandboxInfo, SandboxState};
use super::snapshots::SnapshotRecord;
use super::supervisor::{self, Launch, PauseOutcome, RunDir, StartPlan};
use super::{ColdStart, Connected, OrchError, Shared};
use crate::hooks::{HookError, StartContext, StopReason};
use crate::net::Slot;
use crate::vm::{self, CaptureRecord};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// A failed start or patch hook: 502 with the custom-extension.md §7.5 message; a disabled extension: 400.
pub(crate) fn hook_error(e: HookError) -> OrchError {
    match e {
        HookError::Disabled => OrchError::BadRequest(e.to_string()),
        HookError::Failed { .. } => OrchError::Upstream(e.to_string()),
        HookError::Journal(_) => OrchError::Internal(e.to_string()),
    }
}

/// A slot for a sandbox, with its outbound choice applied (network.md §5.4).
fn acquire_slot(shared: &Shared, internet_access: bool) -> Result<Slot, OrchError> {
    let mut slot = shared.slots.acquire()?;
    if shared.config.network.outbound && !internet_access {
        slot.deny_outbound()?;
    }
    Ok(slot)
}

pub(crate) fn start_context(id: &str, slot: &Slot, params: &Value) -> StartContext {
    StartContext {
        sandbox_id: id.to_string(),
        netns_path: slot.netns_path().to_path_buf(),
        host_ip: slot.host_ip(),
        slot_index: slot.index(),
        params: params.clone(),
    }
}

/// Kernel arguments agentenv adds after the VM module's own.
pub(crate) fn guest_kernel_args(shared: &Shared) -> Vec<String> {
    let mut args = vec![format!("agentenv.port={}", shared.config.agent.port)];
    if shared.config.network.outbound {
        if let Some(dns) = crate::net::guest_dns(&shared.config.network) {
            args.push(format!("agentenv.dns={dns}"));
        }
    }
    args
}

pub(crate) fn save_running(dir: &std::path::Path, info: &SandboxInfo) -> Result<(), OrchError> {
    records::save(
        dir,
        &SandboxRecord {
            info: info.clone(),
            paused: None,
        },
    )
}

/// A VM booted fresh in a slot: its supervisor channel, agent and slot facts.
pub(crate) struct Booted {
    pub runtime: RuntimeHandle,
    pub host_ip: std::net::Ipv4Addr,
    pub netns_path: PathBuf,
}

/// The fresh-boot steps shared by cold creates and template builds (custom-extension.md §5.2 steps 3–6,
/// §5.9): overlay on the image's base, slot, journal + start-fresh (its `extraBootArgs`
/// last on the command line), VM, agent. A failed hook is stopped with `failed_reason`.
pub(crate) fn boot_fresh(
    shared: &Arc<Shared>,
    id: &str,
    run_dir: RunDir,
    image: &crate::image::PreparedImage,
    spec: &SandboxSpec,
    failed_reason: StopReason,
    memory_file: Option<PathBuf>,
) -> Result<Booted, OrchError> {
    // Named relative to the sandbox's directory, so a moved state dir keeps its chains.
    let base = crate::util::relative_path(run_dir.path(), &image.base_disk)
        .unwrap_or_else(|| image.base_disk.clone());
    vm::create_overlay(&base, &run_dir.path().join("disk.qcow2"), spec.disk_size_mb)
        .map_err(|e| OrchError::Internal(e.to_string()))?;
    let slot = acquire_slot(shared, spec.internet_access)?;
    let (host_ip, netns_path) = (slot.host_ip(), slot.netns_path().to_path_buf());
    let mut kernel_args = guest_kernel_args(shared);
    let base_cmdline = vm::kernel_cmdline(shared.accel, &kernel_args)
        .map_err(|e| OrchError::Internal(e.to_string()))?;
    let context = start_context(id, &slot, &spec.params);
    let (instance, hook) = shared.hooks.start_fresh(&context, base_cmdline.len());
    match hook {
        Ok(Some(extra)) => kernel_args.push(extra),
        Ok(None) => {}
        Err(e) => {
            // Rollback before the answer (custom-extension.md §7.3): stop for the attempt, then the slot.
            shared.hooks.stop(instance, failed_reason);
            shared.slots.release(slot);
            return Err(hook_error(e));
        }
    }
    let (ops, agent) = supervisor::start(
        shared,
        StartPlan {
            id: id.to_string(),
            run_dir,
            slot,
            instance,
            launch: Launch::Cold {
                kernel_args,
                memory_file,
            },
            cpu_count: spec.cpu_count,
            memory_mb: spec.memory_mb,
        },
    )?;
    Ok(Booted {
        runtime: RuntimeHandle::new(ops, agent),
        host_ip,
        netns_path,
    })
}

/// `POST /sandboxes-cold` (custom-extension.md §5.2): image → disk → slot → journal + start-fresh → VM →
/// agent ready → record → visible.
pub(crate) fn create_cold(shared: &Arc<Shared>, req: ColdStart) -> Result<SandboxInfo, OrchError> {
    let started = Instant::now();
    let image = shared.images.prepare_rootfs(&req.image, req.disk_size_mb)?;
    let image_ms = started.elapsed().as_millis();
    let id = crate::util::new_id();
    let run_dir = RunDir::create(shared.sandboxes_dir().join(&id))?;
    let dir = run_dir.path().to_path_buf();
    let spec = SandboxSpec {
        template_id: image.reference.clone(),
        alias: None,
        timeout_secs: req.timeout_secs,
        auto_pause: req.auto_pause,
        metadata: req.metadata,
        env_vars: req.env_vars,
        image_env: image.env.clone(),
        params: req.custom_extension_params,
        internet_access: shared.config.network.outbound && req.allow_internet_access != Some(false),
        cpu_count: req.cpu_count,
        memory_mb: req.memory_mb,
        disk_size_mb: req.disk_size_mb,
    };
    let booted = boot_fresh(
        shared,
        &id,
        run_dir,
        &image,
        &spec,
        StopReason::StartFailed,
        None,
    )?;
    let info = spec.into_info(id.clone(), booted.host_ip, booted.netns_path);
    register_running(shared, &dir, info.clone(), booted.runtime)?;
    log::info!(
        "sandboxId={id} op=create_cold result=ok image={} hostIp={} imageMs={image_ms} totalMs={}",
        image.reference,
        info.host_ip,
        started.elapsed().as_millis()
    );
    Ok(info)
}

/// Stores the record, then makes the sandbox visible. If the record cannot be written the
/// new sandbox is torn down again: nothing un-recorded is ever visible.
fn register_running(
    shared: &Shared,
    dir: &std::path::Path,
    info: SandboxInfo,
    runtime: RuntimeHandle,
) -> Result<(), OrchError> {
    if let Err(e) = save_running(dir, &info) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if runtime
            .ops
            .send(Op::Delete {
                reason: StopReason::StartFailed,
                reply: tx,
            })
            .is_ok()
        {
            let _ = rx.recv();
        }
        return Err(e);
    }
    let id = info.id.clone();
    let entry = Arc::new(SandboxEntry::new(info, Some(runtime)));
    shared.sandboxes.write().insert(id, entry);
    Ok(())
}

/// Pause (custom-extension.md §5.4): API call, auto-pause on timeout, graceful shutdown. Idempotent.
pub(crate) fn pause(shared: &Shared, id: &str, reason: StopReason) -> Result<(), OrchError> {
    let entry = shared.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Pause)? else {
        return Ok(());
    };
    let started = Instant::now();
    entry.set_state(SandboxState::Pausing);
    entry.wait_patches();
    let Some(runtime) = entry.runtime.lock().clone() else {
        entry.set_state(SandboxState::Running);
        return Err(OrchError::Internal(format!("sandbox {id} has no VM")));
    };
    let sandbox_dir = shared.sandboxes_dir().join(id);
    let mut paused_info = entry.info.lock().clone();
    paused_info.state = SandboxState::Paused;
    let record_dir = sandbox_dir.clone();
    let commit: supervisor::PauseCommit = Box::new(move |capture: &CaptureRecord| {
        records::save(
            &record_dir,
            &SandboxRecord {
                info: paused_info.clone(),
                paused: Some(capture.clone()),
            },
        )
    });
    let (tx, rx) = crossbeam_channel::bounded(1);
    let sent = runtime.ops.send(Op::Pause {
        reason,
        dir: sandbox_dir.join(PAUSED_DIR),
        commit,
        reply: tx,
    });
    let outcome = match sent {
        Ok(()) => rx.recv().unwrap_or_else(|_| {
            PauseOutcome::Gone(OrchError::Internal("the sandbox's VM is gone".into()))
        }),
        Err(_) => PauseOutcome::Gone(OrchError::Internal("the sandbox's VM is gone".into())),
    };
    match outcome {
        PauseOutcome::Paused => {
            let capture = records_capture(&sandbox_dir);
            *entry.runtime.lock() = None;
            *entry.paused.lock() = capture;
            entry.set_state(SandboxState::Paused);
            log::info!(
                "sandboxId={id} op=pause result=ok reason={reason} ms={}",
                started.elapsed().as_millis()
            );
            Ok(())
        }
        PauseOutcome::Uncommitted(capture, e) => {
            // Never thrown away: resumable from memory now; a restart finds the capture
            // under a record that still says running and quarantines it.
            *entry.runtime.lock() = None;
            *entry.paused.lock() = Some(*capture);
            entry.set_state(SandboxState::Paused);
            log::error!(
                "sandboxId={id} op=pause result=paused_uncommitted reason={reason} error=\"{e}\""
            );
            Err(OrchError::Internal(format!(
                "sandbox {id} is paused, but its record could not be saved ({e}); it can be \
                 resumed, but a server restart would not bring it back as paused"
            )))
        }
        PauseOutcome::RanOn(e) => {
            entry.set_state(SandboxState::Running);
            Err(e)
        }
        PauseOutcome::Gone(e) => {
            shared.unregister(id);
            entry.set_state(SandboxState::Deleting);
            let _ = std::fs::remove_dir_all(&sandbox_dir);
            log::error!("sandboxId={id} op=pause result=removed error=\"{e}\"");
            Err(e)
        }
    }
}

/// The capture a just-committed record holds.
fn records_capture(dir: &std::path::Path) -> Option<CaptureRecord> {
    records::read(dir).ok()?.paused
}

/// Resume or connect (custom-extension.md §5.5). A running sandbox only gets its expiry changed.
pub(crate) fn resume(
    shared: &Arc<Shared>,
    id: &str,
    secs: u64,
    is_connect: bool,
) -> Result<Connected, OrchError> {
    let entry = shared.entry(id)?;
    let call = if is_connect {
        Call::Connect
    } else {
        Call::Resume
    };
    let _guard = match admit(&entry, id, call)? {
        Admitted::AlreadyDone(_) => {
            super::extend_expiry(&entry, secs, !is_connect);
            let info = entry.info.lock().clone();
            return Ok(Connected {
                info,
                resumed: false,
            });
        }
        Admitted::Proceed(guard) => guard,
    };
    let started = Instant::now();
    entry.set_state(SandboxState::Resuming);
    let result = restore_paused(shared, &entry, id);
    match result {
        Ok((runtime, slot_facts)) => {
            let info = {
                let mut info = entry.info.lock();
                info.state = SandboxState::Running;
                info.host_ip = slot_facts.0;
                info.netns_path = slot_facts.1;
                info.end_at = SystemTime::now() + Duration::from_secs(secs);
                info.clone()
            };
            let dir = shared.sandboxes_dir().join(id);
            *entry.runtime.lock() = Some(runtime);
            *entry.paused.lock() = None;
            // The paused capture goes only once the running record replaced it: until
            // then it is what a restart finds (a consistent capture, since the guest now
            // writes to a new top layer).
            match save_running(&dir, &info) {
                Ok(()) => {
                    let _ = std::fs::remove_dir_all(dir.join(PAUSED_DIR));
                }
                Err(e) => {
                    log::error!("sandboxId={id} op=resume record_error=\"{e}\" result=capture_kept")
                }
            }
            log::info!(
                "sandboxId={id} op=resume result=ok ms={}",
                started.elapsed().as_millis()
            );
            Ok(Connected {
                info,
                resumed: true,
            })
        }
        Err(e) => {
            entry.set_state(SandboxState::Paused);
            Err(e)
        }
    }
}

type SlotFacts = (std::net::Ipv4Addr, PathBuf);

/// Slot → start-resume → restore onto a new top layer → agent. On failure the paused
/// sandbox is unchanged: the new layer is removed, its files are kept.
fn restore_paused(
    shared: &Arc<Shared>,
    entry: &SandboxEntry,
    id: &str,
) -> Result<(RuntimeHandle, SlotFacts), OrchError> {
    let capture = entry
        .paused
        .lock()
        .clone()
        .ok_or_else(|| OrchError::Internal(format!("sandbox {id} has no paused state")))?;
    let (params, internet_access, cpu, mem) = {
        let info = entry.info.lock();
        (
            info.custom_extension_params.clone(),
            info.internet_access,
            info.cpu_count,
            info.memory_mb,
        )
    };
    let dir = shared.sandboxes_dir().join(id);
    // Guest writes after the restore go to a new top layer, so a failed resume leaves the
    // paused disk exactly as captured.
    let internal = |e: &dyn std::fmt::Display| OrchError::Internal(e.to_string());
    let chain = vm::disk_chain(&capture.disk).map_err(|e| internal(&e))?;
    let top = vm::next_layer_path(&dir, &chain);
    let backing = capture
        .disk
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    vm::create_layer(&top, &backing, capture.disk_virtual_bytes).map_err(|e| internal(&e))?;
    let remove_top = || {
        let _ = std::fs::remove_file(&top);
    };
    let slot = match acquire_slot(shared, internet_access) {
        Ok(s) => s,
        Err(e) => {
            remove_top();
            return Err(e);
        }
    };
    let facts = (slot.host_ip(), slot.netns_path().to_path_buf());
    let (instance, hook) = shared
        .hooks
        .start_resume(&start_context(id, &slot, &params));
    if let Err(e) = hook {
        shared.hooks.stop(instance, StopReason::StartFailed);
        shared.slots.release(slot);
        remove_top();
        return Err(hook_error(e));
    }
    let started = supervisor::start(
        shared,
        StartPlan {
            id: id.to_string(),
            run_dir: RunDir::existing(dir),
            slot,
            instance,
            launch: Launch::Restore {
                record: Box::new(capture),
                disk: top.clone(),
            },
            cpu_count: cpu,
            memory_mb: mem,
        },
    );
    match started {
        Ok((ops, agent)) => Ok((RuntimeHandle::new(ops, agent), facts)),
        Err(e) => {
            remove_top();
            Err(e)
        }
    }
}

/// `POST …/snapshots` (custom-extension.md §5.7): capture in place, no hooks, same instance.
pub(crate) fn snapshot(
    shared: &Shared,
    id: &str,
    name: Option<String>,
) -> Result<SnapshotRecord, OrchError> {
    let entry = shared.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Snapshot)? else {
        return Err(OrchError::Conflict(format!("sandbox {id} is not running")));
    };
    let snapshot_id = crate::util::new_id();
    let _name_claim = shared.snapshots.claim_name(name.as_deref(), &snapshot_id)?;
    entry.set_state(SandboxState::Snapshotting);
    entry.wait_patches();
    let result = capture_running(shared, &entry, id, &snapshot_id);
    let result = result.and_then(|capture| {
        let info = entry.info.lock().clone();
        let record = SnapshotRecord::new(snapshot_id.clone(), name.clone(), &info, capture);
        shared.snapshots.insert(record.clone())?;
        Ok(record)
    });
    if entry.state() == SandboxState::Snapshotting {
        entry.set_state(SandboxState::Running);
    }
    result
}

/// Captures a running sandbox into `<state>/snapshots/<snapshot_id>` with the disk frozen;
/// it runs on. If the VM cannot run on, the sandbox is removed (custom-extension.md §5.4's rule).
fn capture_running(
    shared: &Shared,
    entry: &SandboxEntry,
    id: &str,
    snapshot_id: &str,
) -> Result<CaptureRecord, OrchError> {
    let runtime = entry
        .runtime
        .lock()
        .clone()
        .ok_or_else(|| OrchError::Internal(format!("sandbox {id} has no VM")))?;
    let dir = shared.snapshots.dir(snapshot_id);
    let (tx, rx) = crossbeam_channel::bounded(1);
    runtime
        .ops
        .send(Op::Snapshot {
            dir: dir.clone(),
            run_on: true,
            reply: tx,
        })
        .map_err(|_| OrchError::Internal("the sandbox's VM is gone".into()))?;
    match rx.recv() {
        Ok(Ok(capture)) => Ok(capture),
        Ok(Err(PauseOutcome::RanOn(e))) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
        Ok(Err(PauseOutcome::Gone(e))) => {
            shared.unregister(id);
            entry.set_state(SandboxState::Deleting);
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_dir_all(shared.sandboxes_dir().join(id));
            log::error!("sandboxId={id} op=snapshot result=removed error=\"{e}\"");
            Err(e)
        }
        Ok(Err(PauseOutcome::Paused | PauseOutcome::Uncommitted(..))) | Err(_) => {
            Err(OrchError::Internal("the sandbox's VM is gone".into()))
        }
    }
}

/// What a new sandbox is made with (cold create, create from a snapshot, fork child).
pub(crate) struct SandboxSpec {
    pub template_id: String,
    pub alias: Option<String>,
    pub timeout_secs: u64,
    pub auto_pause: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub image_env: Vec<(String, String)>,
    pub params: Value,
    pub internet_access: bool,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
}

impl SandboxSpec {
    /// The description of a sandbox that just became ready; its TTL starts now.
    pub fn into_info(
        self,
        id: String,
        host_ip: std::net::Ipv4Addr,
        netns_path: PathBuf,
    ) -> SandboxInfo {
        let now = SystemTime::now();
        SandboxInfo {
            id,
            template_id: self.template_id,
            alias: self.alias,
            started_at: now,
            end_at: now + Duration::from_secs(self.timeout_secs),
            cpu_count: self.cpu_count,
            memory_mb: self.memory_mb,
            disk_size_mb: self.disk_size_mb,
            metadata: self.metadata,
            env_vars: self.env_vars,
            image_env: self.image_env,
            auto_pause: self.auto_pause,
            internet_access: self.internet_access,
            timeout_secs: self.timeout_secs,
            custom_extension_params: self.params,
            state: SandboxState::Running,
            host_ip,
            netns_path,
            envd_access_token: crate::util::new_secret(),
        }
    }
}

/// A new sandbox from a capture (custom-extension.md §5.3, §5.8): its own disk over the capture's frozen
/// layers, a slot, start-resume, restore, agent, record. Never a cold boot.
pub(crate) fn clone_from_capture(
    shared: &Arc<Shared>,
    capture: &CaptureRecord,
    spec: SandboxSpec,
) -> Result<SandboxInfo, OrchError> {
    let started = Instant::now();
    let id = crate::util::new_id();
    let run_dir = RunDir::create(shared.sandboxes_dir().join(&id))?;
    let top = vm::create_clone_disk(&capture.disk_layers, run_dir.path())
        .map_err(|e| OrchError::Internal(e.to_string()))?;
    let slot = acquire_slot(shared, spec.internet_access)?;
    let (host_ip, netns_path) = (slot.host_ip(), slot.netns_path().to_path_buf());
    let (instance, hook) = shared
        .hooks
        .start_resume(&start_context(&id, &slot, &spec.params));
    if let Err(e) = hook {
        shared.hooks.stop(instance, StopReason::StartFailed);
        shared.slots.release(slot);
        return Err(hook_error(e));
    }
    let dir = run_dir.path().to_path_buf();
    let (ops, agent) = supervisor::start(
        shared,
        StartPlan {
            id: id.clone(),
            run_dir,
            slot,
            instance,
            launch: Launch::Restore {
                record: Box::new(capture.clone()),
                disk: top,
            },
            cpu_count: spec.cpu_count,
            memory_mb: spec.memory_mb,
        },
    )?;
    let info = spec.into_info(id.clone(), host_ip, netns_path);
    register_running(shared, &dir, info.clone(), RuntimeHandle::new(ops, agent))?;
    log::info!(
        "sandboxId={id} op=create_from_capture result=ok templateID={} ms={}",
        info.template_id,
        started.elapsed().as_millis()
    );
    Ok(info)
}

/// `POST …/fork` (custom-extension.md §5.8): one in-place checkpoint of the parent, then `count` children
/// restored from it, each with its own id, slot, disk and start-resume. The parent keeps
/// running with its instance.
pub(crate) fn fork(
    shared: &Arc<Shared>,
    id: &str,
    count: u32,
    timeout_secs: Option<u64>,
) -> Result<Vec<Result<SandboxInfo, OrchError>>, OrchError> {
    let entry = shared.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Fork)? else {
        return Err(OrchError::Conflict(format!("sandbox {id} is not running")));
    };
    entry.set_state(SandboxState::Forking);
    entry.wait_patches();
    let checkpoint_id = format!("fork-{}", crate::util::new_id());
    let captured = capture_running(shared, &entry, id, &checkpoint_id);
    if entry.state() == SandboxState::Forking {
        entry.set_state(SandboxState::Running);
    }
    let capture = captured?;
    let parent = entry.info.lock().clone();
    let children = (0..count)
        .map(|_| {
            clone_from_capture(
                shared,
                &capture,
                SandboxSpec {
                    template_id: parent.template_id.clone(),
                    alias: parent.alias.clone(),
                    timeout_secs: timeout_secs.unwrap_or(parent.timeout_secs),
                    auto_pause: parent.auto_pause,
                    metadata: parent.metadata.clone(),
                    env_vars: parent.env_vars.clone(),
                    image_env: parent.image_env.clone(),
                    params: parent.custom_extension_params.clone(),
                    internet_access: parent.internet_access,
                    cpu_count: parent.cpu_count,
                    memory_mb: parent.memory_mb,
                    disk_size_mb: parent.disk_size_mb,
                },
            )
        })
        .collect();
    // The children hold their own links to the frozen layers; the checkpoint can go.
    let _ = std::fs::remove_dir_all(shared.snapshots.dir(&checkpoint_id));
    Ok(children)
}
