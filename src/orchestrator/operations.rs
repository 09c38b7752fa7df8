//! The lifecycle operations that create or move a VM: cold create, pause, resume,
//! snapshot, create from a snapshot, fork. Each runs on the calling (API or expiry)
//! thread while holding the sandbox's lifecycle lock; the VM work itself happens on the
//! sandbox's supervisor thread. Hook order follows custom-extension.md §5.

use super::lifecycle::{admit, Admitted};
use super::records::{self, SandboxRecord, PAUSED_DIR};
use super::registry::Registry;
use super::sandbox::{Call, Op, RuntimeHandle, SandboxEntry, SandboxInfo, SandboxState};
use super::settings::{PauseMode, PauseRequest, SandboxSettings};
use super::snapshots::{SnapshotRecord, Snapshots};
use super::standby::Claimed;
use super::start::{self, Launcher, StartKind, StartRequest, Started};
use super::supervisor::{self, PauseOutcome, RunDir, Watch};
use super::{ColdStart, ConnectKind, Connected, ExpiryChange, OrchError};
use crate::hooks::StopReason;
use crate::image::ImageStore;
use crate::vm::{self, CaptureRecord};
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

pub(crate) fn save_running(dir: &std::path::Path, info: &SandboxInfo) -> Result<(), OrchError> {
    records::save(
        dir,
        &SandboxRecord {
            info: info.clone(),
            paused: None,
        },
    )
}

/// The watch of a registered sandbox's VM: a VM that died is forgotten (404 from then
/// on), a guest that broke the agent protocol is marked (`guestProtocolViolation`), and
/// so is one paused on a full state disk (`pausedOnIoError`).
pub(crate) struct Registered {
    registry: Weak<Registry>,
    id: String,
}

impl Registered {
    pub fn watch(registry: &Arc<Registry>, id: &str) -> Box<dyn Watch> {
        Box::new(Registered {
            registry: Arc::downgrade(registry),
            id: id.to_string(),
        })
    }
}

impl Watch for Registered {
    fn kind(&self) -> &'static str {
        "sandbox"
    }

    /// 404 from now on, with a message naming the death and where the files go.
    fn vm_died(&self, exit: &vm::VmExit, run_dir: &std::path::Path) -> Option<PathBuf> {
        let registry = self.registry.upgrade()?;
        let dest = crate::store::quarantine_dest(records::state_dir_of(run_dir), run_dir);
        let at = crate::util::rfc3339(SystemTime::now());
        registry.forget_dead(
            &self.id,
            &format!(
                "sandbox {} is gone: its VM died on its own ({exit}) at {at}; its files (disk, \
                 record, console log) are kept in {} (see {})",
                self.id,
                dest.display(),
                dest.with_extension("reason").display()
            ),
        );
        Some(dest)
    }

    fn guest_violated(&self, reason: &str) {
        let Some(entry) = self.registry.upgrade().and_then(|r| r.entry(&self.id).ok()) else {
            return;
        };
        entry.update(|i| i.guest_protocol_violation = Some(reason.to_string()));
    }

    fn io_error_paused(&self, pause: Option<&super::sandbox::IoErrorPause>) {
        let Some(entry) = self.registry.upgrade().and_then(|r| r.entry(&self.id).ok()) else {
            return;
        };
        entry.update(|i| i.paused_on_io_error = pause.cloned());
    }
}

/// The fresh-boot steps shared by cold creates and template builds (custom-extension.md
/// §5.2 steps 3–6, §5.9): an overlay on the image's base in the request's run dir, then
/// the start sequence (`req.kind` is [`StartKind::Fresh`]).
pub(crate) fn boot_fresh(
    launcher: &Arc<Launcher>,
    image: &crate::image::PreparedImage,
    req: StartRequest,
) -> Result<Started, OrchError> {
    // Named relative to the sandbox's directory, so a moved state dir keeps its chains.
    let base = crate::util::relative_path(req.run_dir.path(), &image.base_disk)
        .unwrap_or_else(|| image.base_disk.clone());
    vm::create_overlay(
        &base,
        &req.run_dir.path().join("disk.qcow2"),
        req.resources.disk_size_mb,
    )
    .map_err(|e| OrchError::vm("creating the sandbox's disk", e))?;
    start::start(launcher, req)
}

/// `POST /sandboxes-cold` (custom-extension.md §5.2): image → disk → the start sequence →
/// agent ready → record → visible.
pub(crate) fn create_cold(
    images: &ImageStore,
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    req: ColdStart,
) -> Result<SandboxInfo, OrchError> {
    let started = Instant::now();
    let image = images.prepare_rootfs(&req.image, req.resources.disk_size_mb)?;
    let image_ms = started.elapsed().as_millis();
    let id = crate::cluster::id::new_sandbox_id();
    let run_dir = RunDir::create(registry.dir(&id))?;
    let dir = run_dir.path().to_path_buf();
    let settings = SandboxSettings {
        template_id: image.reference.clone(),
        alias: None,
        resources: req.resources,
        timeout_secs: req.request.timeout_secs,
        auto_pause: req.request.auto_pause,
        auto_pause_memory: req.request.auto_pause_memory,
        auto_resume: req.request.auto_resume,
        internet_access: req.request.internet_access(launcher.outbound),
        ingress: req.request.ingress,
        network: req.request.network.clone(),
        metadata: req.request.metadata,
        env_vars: req.request.env_vars,
        image_env: image.env.clone(),
        custom_extension_params: req.params,
        volume_mounts: req.request.volume_mounts,
    };
    let booted = boot_fresh(
        launcher,
        &image,
        StartRequest {
            id: id.clone(),
            run_dir,
            kind: StartKind::Fresh {
                memory_file: None,
                disk: None,
            },
            resources: settings.resources,
            internet_access: settings.internet_access,
            egress: settings.network.rules(),
            params: settings.custom_extension_params.clone(),
            failed_reason: StopReason::StartFailed,
            watch: Registered::watch(registry, &id),
            volumes: settings.volume_mounts.clone(),
        },
    )?;
    let info = SandboxInfo::new(id.clone(), settings, booted.host_ip, booted.netns_path);
    register_running(registry, &dir, info.clone(), booted.runtime)?;
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
pub(crate) fn register_running(
    registry: &Registry,
    dir: &std::path::Path,
    info: SandboxInfo,
    runtime: RuntimeHandle,
) -> Result<(), OrchError> {
    if let Err(e) = save_running(dir, &info) {
        runtime.delete(StopReason::StartFailed);
        return Err(e);
    }
    registry.insert(Arc::new(SandboxEntry::new(info, Some(runtime))));
    Ok(())
}

/// Pause (custom-extension.md §5.4): API call, auto-pause on timeout, graceful shutdown. Idempotent.
/// `request` says what it keeps (memory and disk, or the disk only: docs/e2b.md
/// "Filesystem-only pause").
pub(crate) fn pause(
    registry: &Registry,
    id: &str,
    reason: StopReason,
    request: PauseRequest,
) -> Result<(), OrchError> {
    let entry = registry.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Pause)? else {
        return Ok(());
    };
    let started = Instant::now();
    entry.set_state(SandboxState::Pausing)?;
    entry.wait_patches();
    let Some(runtime) = entry.runtime() else {
        entry.set_state(SandboxState::Running)?;
        return Err(OrchError::Lacks {
            id: id.to_string(),
            what: "VM",
        });
    };
    let sandbox_dir = registry.dir(id);
    let mut paused_info = entry.info();
    paused_info.transition(SandboxState::Paused)?;
    paused_info.pause_mode = Some(request.mode);
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
        request,
        dir: sandbox_dir.join(PAUSED_DIR),
        commit,
        reply: tx,
    });
    let outcome = match sent {
        Ok(()) => rx
            .recv()
            .unwrap_or_else(|_| PauseOutcome::Gone(OrchError::vm_gone("pausing"))),
        Err(_) => PauseOutcome::Gone(OrchError::vm_gone("pausing")),
    };
    match outcome {
        PauseOutcome::Paused => {
            let capture = records_capture(&sandbox_dir);
            entry.set_paused_capture(capture);
            entry.update(|i| i.pause_mode = Some(request.mode));
            entry.set_state(SandboxState::Paused)?;
            log::info!(
                "sandboxId={id} op=pause result=ok reason={reason} mode={} ms={}",
                request.mode.name(),
                started.elapsed().as_millis()
            );
            Ok(())
        }
        PauseOutcome::Uncommitted(capture, e) => {
            // Never thrown away: resumable from memory now; a restart finds the capture
            // under a record that still says running and quarantines it.
            entry.set_paused_capture(Some(*capture));
            entry.update(|i| i.pause_mode = Some(request.mode));
            entry.set_state(SandboxState::Paused)?;
            log::error!(
                "sandboxId={id} op=pause result=paused_uncommitted reason={reason} error=\"{e}\""
            );
            Err(OrchError::PausedUnrecorded {
                id: id.to_string(),
                source: Box::new(e),
            })
        }
        PauseOutcome::RanOn(e) => {
            entry.set_state(SandboxState::Running)?;
            Err(e)
        }
        PauseOutcome::Gone(e) => {
            let why = format!("sandbox {id} is gone: its VM died during a pause ({e})");
            registry.unregister_gone(id, &why);
            entry.set_state(SandboxState::Deleting)?;
            let _ = std::fs::remove_dir_all(&sandbox_dir);
            log::error!("sandboxId={id} op=pause result=removed error=\"{e}\"");
            Err(e)
        }
        PauseOutcome::Stopped(e) => Err(remove_stopped(registry, &entry, id, "pause", e)),
    }
}

/// custom-extension.md §5.4: a sandbox whose VM a failed capture left unable to run on
/// (stopped, stop hook sent, slot released by its supervisor) is removed from the API.
/// Its files are not deleted (they could not be saved, which is no reason to lose them):
/// its directory, with the guest's disk and whatever the capture wrote, moves to
/// `<state_dir>/quarantine/` with a log line saying why and where. Returns the error the
/// call answers with.
fn remove_stopped(
    registry: &Registry,
    entry: &SandboxEntry,
    id: &str,
    op: &str,
    e: OrchError,
) -> OrchError {
    let dir = registry.dir(id);
    let kept_in = crate::store::quarantine_dest(records::state_dir_of(&dir), &dir);
    registry.unregister_gone(
        id,
        &format!(
            "sandbox {id} is gone: its VM stopped during a {op} (it died, or could not run on \
             after the capture: {e}); its files are kept in {}",
            kept_in.display()
        ),
    );
    if let Err(t) = entry.set_state(SandboxState::Deleting) {
        log::error!("sandboxId={id} op={op} error=\"{t}\"");
    }
    let why = format!("{op} failed and the VM could not run on: {e}");
    let kept = crate::store::quarantine_to(&dir, &kept_in, &why);
    let kept = kept.as_deref().unwrap_or(&dir).display();
    log::error!("sandboxId={id} op={op} result=stopped kept={kept} error=\"{e}\"");
    OrchError::RemovedAfter {
        id: id.to_string(),
        source: Box::new(e),
    }
}

/// The capture a just-committed record holds.
fn records_capture(dir: &std::path::Path) -> Option<CaptureRecord> {
    records::read(dir).ok()?.paused
}

/// Resume or connect (custom-extension.md §5.5). A running sandbox only gets its expiry changed.
/// `from` [`PauseMode::Filesystem`] cold-boots a fully paused sandbox from its disk,
/// leaving its memory unused (E2B's `memory: false`); a filesystem-only pause always boots.
pub(crate) fn resume(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    id: &str,
    secs: u64,
    kind: ConnectKind,
    from: PauseMode,
) -> Result<Connected, OrchError> {
    let entry = registry.entry(id)?;
    let (call, expiry) = match kind {
        ConnectKind::Connect => (Call::Connect, ExpiryChange::AtLeast),
        ConnectKind::Resume => (Call::Resume, ExpiryChange::Set),
    };
    let _guard = match admit(&entry, id, call)? {
        Admitted::AlreadyDone(_) => {
            super::extend_expiry(&entry, secs, expiry);
            let info = entry.info();
            return Ok(Connected {
                info,
                resumed: false,
            });
        }
        Admitted::Proceed(guard) => guard,
    };
    let started = Instant::now();
    entry.set_state(SandboxState::Resuming)?;
    let result = restore_paused(registry, launcher, &entry, id, from);
    match result {
        Ok((runtime, slot_facts)) => {
            let moved = entry.update(|info| {
                info.transition(SandboxState::Running)?;
                info.pause_mode = None;
                info.host_ip = slot_facts.0;
                info.netns_path = slot_facts.1;
                info.end_at = SystemTime::now() + Duration::from_secs(secs);
                Ok::<_, OrchError>(info.clone())
            });
            let info = match moved {
                Ok(info) => info,
                Err(e) => {
                    // Still paused: the capture is untouched, the new VM goes.
                    runtime.delete(StopReason::StartFailed);
                    entry.set_state(SandboxState::Paused)?;
                    return Err(e);
                }
            };
            let dir = registry.dir(id);
            entry.set_running_vm(runtime);
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
            entry.set_state(SandboxState::Paused)?;
            Err(e)
        }
    }
}

type SlotFacts = (std::net::Ipv4Addr, PathBuf);

/// A new top layer → the start sequence with start-resume → restore onto it → agent. On
/// failure the paused sandbox is unchanged: the new layer is removed, its files are kept.
fn restore_paused(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    entry: &SandboxEntry,
    id: &str,
    from: PauseMode,
) -> Result<(RuntimeHandle, SlotFacts), OrchError> {
    let mut capture = entry.paused_capture().ok_or_else(|| OrchError::Lacks {
        id: id.to_string(),
        what: "paused state",
    })?;
    if from == PauseMode::Filesystem {
        // Its disk only: the saved memory is left as it is (removed with the capture
        // once the sandbox runs).
        capture.filesystem_only = true;
    }
    let (params, internet_access, egress, resources, volumes) = {
        let info = entry.info();
        (
            info.settings.custom_extension_params.clone(),
            info.settings.internet_access,
            info.settings.network.rules(),
            info.settings.resources,
            info.settings.volume_mounts.clone(),
        )
    };
    // A guest booted from its disk has no volume mounted yet (a restored one keeps its).
    let remount = if capture.filesystem_only {
        volumes.clone()
    } else {
        Vec::new()
    };
    let settings = ResumeSettings {
        params,
        internet_access,
        egress,
        resources,
        volumes,
        remount,
    };
    let kept = !capture.filesystem_only;
    if !kept {
        // Booted from its disk: a kept VM is not used.
        launcher.kept.discard(id, "boots_from_disk");
    }
    let first = start_on_new_layer(registry, launcher, id, &capture, &settings, kept);
    match first {
        // A kept VM that could not run on: the capture is whole, restore it.
        Err((e, true)) if !matches!(e, OrchError::Hook(_)) => {
            log::warn!("sandboxId={id} op=resume kept=true error=\"{e}\" retry=restore");
            start_on_new_layer(registry, launcher, id, &capture, &settings, false)
                .map_err(|(e, _)| e)
        }
        other => other.map_err(|(e, _)| e),
    }
}

/// What a resume starts with, from the paused sandbox's settings.
struct ResumeSettings {
    params: serde_json::Value,
    internet_access: bool,
    egress: crate::net::EgressRules,
    resources: super::settings::Resources,
    volumes: Vec<super::settings::VolumeMount>,
    /// The volumes to mount once the guest answers (a booted guest has none mounted).
    remount: Vec<super::settings::VolumeMount>,
}

/// A new top layer, then the start sequence onto it: into the sandbox's kept VM when
/// `use_kept` and it has one, else a restore into a new QEMU. On failure the paused
/// sandbox is unchanged (the new layer is removed, its files are kept); the error says
/// whether a kept VM was used.
fn start_on_new_layer(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    id: &str,
    capture: &CaptureRecord,
    settings: &ResumeSettings,
    use_kept: bool,
) -> Result<(RuntimeHandle, SlotFacts), (OrchError, bool)> {
    let dir = registry.dir(id);
    // Guest writes after the restore go to a new top layer, so a failed resume leaves the
    // paused disk exactly as captured.
    let top = new_top_layer(&dir, capture).map_err(|e| (e, false))?;
    let kept = if use_kept {
        take_kept(launcher, id, &top)
    } else {
        None
    };
    let used_kept = kept.is_some();
    let started = start::start(
        launcher,
        StartRequest {
            id: id.to_string(),
            run_dir: RunDir::existing(dir),
            kind: StartKind::Restore {
                record: Box::new(capture.clone()),
                disk: top.clone(),
                standby: kept,
            },
            resources: settings.resources,
            internet_access: settings.internet_access,
            egress: settings.egress.clone(),
            params: settings.params.clone(),
            failed_reason: StopReason::StartFailed,
            watch: Registered::watch(registry, id),
            volumes: settings.volumes.clone(),
        },
    );
    let mounted = started.and_then(|s| {
        match super::volumes::mount_volumes(&s.runtime.agent, &settings.remount) {
            Ok(()) => Ok(s),
            Err(e) => {
                // The resume fails as a whole: the VM goes, the sandbox stays paused.
                s.runtime.delete(StopReason::StartFailed);
                Err(e)
            }
        }
    });
    match mounted {
        Ok(s) => Ok((s.runtime, (s.host_ip, s.netns_path))),
        Err(e) => {
            let _ = std::fs::remove_file(&top);
            Err((e, used_kept))
        }
    }
}

/// An empty layer over the paused disk, for the resumed guest's writes.
fn new_top_layer(dir: &std::path::Path, capture: &CaptureRecord) -> Result<PathBuf, OrchError> {
    let chain = vm::disk_chain(&capture.disk)
        .map_err(|e| OrchError::vm("reading the paused disk's chain", e))?;
    let top = vm::next_layer_path(dir, &chain);
    let backing = capture
        .disk
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    vm::create_layer(&top, &backing, capture.disk_virtual_bytes)
        .map_err(|e| OrchError::vm("adding the resumed disk's layer", e))?;
    Ok(top)
}

/// The paused sandbox's kept VM ([`super::kept`]), moved onto the resume's layer `top`
/// (its vCPUs still stopped), as a prepared VM for the start sequence.
fn take_kept(
    launcher: &Launcher,
    id: &str,
    top: &std::path::Path,
) -> Option<Box<super::standby::Prepared>> {
    let mut kept = launcher.kept.take(id)?;
    if let Err(e) = kept.vm.move_onto_layer(top) {
        launcher
            .kept
            .let_go(id, kept, &format!("cannot move onto the new layer: {e}"));
        return None;
    }
    log::info!("sandboxId={id} op=resume kept=true");
    Some(Box::new(super::standby::Prepared {
        warm: super::standby::WarmVm {
            vm: kept.vm,
            agent: None,
            parent: kept.parent,
        },
        slot: kept.slot,
        reservation: kept.reservation,
    }))
}

/// `POST …/snapshots` (custom-extension.md §5.7): capture in place, no hooks, same instance.
pub(crate) fn snapshot(
    registry: &Registry,
    snapshots: &Snapshots,
    id: &str,
    name: Option<String>,
) -> Result<SnapshotRecord, OrchError> {
    let entry = registry.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Snapshot)? else {
        return Err(OrchError::Conflict(format!("sandbox {id} is not running")));
    };
    let snapshot_id = crate::util::new_id();
    let _name_claim = snapshots.claim_name(name.as_deref(), &snapshot_id)?;
    entry.set_state(SandboxState::Snapshotting)?;
    entry.wait_patches();
    let result = capture_running(registry, snapshots, &entry, id, &snapshot_id);
    let result = result.and_then(|capture| {
        let info = entry.info();
        let record = SnapshotRecord::new(snapshot_id.clone(), name.clone(), &info, capture);
        snapshots.insert(record.clone())?;
        Ok(record)
    });
    if entry.state() == SandboxState::Snapshotting {
        entry.set_state(SandboxState::Running)?;
    }
    result
}

/// Captures a running sandbox into `<state>/snapshots/<snapshot_id>` with the disk frozen;
/// it runs on. If the VM cannot run on, the sandbox is removed (custom-extension.md §5.4's rule).
fn capture_running(
    registry: &Registry,
    snapshots: &Snapshots,
    entry: &SandboxEntry,
    id: &str,
    snapshot_id: &str,
) -> Result<CaptureRecord, OrchError> {
    let runtime = entry.runtime().ok_or_else(|| OrchError::Lacks {
        id: id.to_string(),
        what: "VM",
    })?;
    let dir = snapshots.dir(snapshot_id);
    let (tx, rx) = crossbeam_channel::bounded(1);
    runtime
        .ops
        .send(Op::Snapshot {
            dir: dir.clone(),
            run_on: true,
            reply: tx,
        })
        .map_err(|_| OrchError::vm_gone("taking a snapshot"))?;
    match rx.recv() {
        Ok(Ok(capture)) => Ok(capture),
        Ok(Err(PauseOutcome::RanOn(e))) => {
            let _ = std::fs::remove_dir_all(&dir);
            Err(e)
        }
        Ok(Err(PauseOutcome::Stopped(e))) => {
            // A complete capture is kept too (it has no snapshot record).
            if dir.join(vm::capture::STATE_FILE).is_file() {
                let why = format!("the snapshot of sandbox {id} whose VM could not run on: {e}");
                crate::store::quarantine(records::state_dir_of(&dir), &dir, &why);
            }
            let _ = std::fs::remove_dir_all(&dir);
            Err(remove_stopped(registry, entry, id, "snapshot", e))
        }
        Ok(Err(PauseOutcome::Gone(_) | PauseOutcome::Paused | PauseOutcome::Uncommitted(..)))
        | Err(_) => Err(OrchError::vm_gone("taking a snapshot")),
    }
}

/// A new sandbox from a capture (custom-extension.md §5.3, §5.8): its own disk over the
/// capture's frozen layers, the start sequence with start-resume, restore, agent, record.
/// Never a cold boot. With a claimed `standby` (of this capture's template), its id, run
/// dir, disk, slot and waiting QEMU are the new sandbox's.
pub(crate) fn clone_from_capture(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    capture: &CaptureRecord,
    settings: SandboxSettings,
    standby: Option<Claimed>,
) -> Result<SandboxInfo, OrchError> {
    let started = Instant::now();
    let from_standby = standby.is_some();
    let (id, run_dir, top, prepared) = match standby {
        Some(c) => (c.id, c.run_dir, c.disk, Some(Box::new(c.prepared))),
        None => {
            let id = crate::cluster::id::new_sandbox_id();
            let run_dir = RunDir::create(registry.dir(&id))?;
            let top = vm::create_clone_disk(&capture.disk_layers, run_dir.path())
                .map_err(|e| OrchError::vm("cloning the snapshot's disk", e))?;
            (id, run_dir, top, None)
        }
    };
    let dir = run_dir.path().to_path_buf();
    let booted = start::start(
        launcher,
        StartRequest {
            id: id.clone(),
            run_dir,
            kind: StartKind::Restore {
                record: Box::new(capture.clone()),
                disk: top,
                standby: prepared,
            },
            resources: settings.resources,
            internet_access: settings.internet_access,
            egress: settings.network.rules(),
            params: settings.custom_extension_params.clone(),
            failed_reason: StopReason::StartFailed,
            watch: Registered::watch(registry, &id),
            volumes: settings.volume_mounts.clone(),
        },
    )?;
    let start_ms = started.elapsed().as_millis();
    let info = SandboxInfo::new(id.clone(), settings, booted.host_ip, booted.netns_path);
    register_running(registry, &dir, info.clone(), booted.runtime)?;
    log::info!(
        "sandboxId={id} op=create_from_capture result=ok templateID={} standby={from_standby} startMs={start_ms} ms={}",
        info.settings.template_id,
        started.elapsed().as_millis()
    );
    Ok(info)
}

/// `POST …/fork` (custom-extension.md §5.8): one in-place checkpoint of the parent, then `count` children
/// restored from it, each with its own id, slot, disk and start-resume. The parent keeps
/// running with its instance.
pub(crate) fn fork(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    snapshots: &Snapshots,
    id: &str,
    count: u32,
    timeout_secs: Option<u64>,
) -> Result<Vec<Result<SandboxInfo, OrchError>>, OrchError> {
    let entry = registry.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Fork)? else {
        return Err(OrchError::Conflict(format!("sandbox {id} is not running")));
    };
    entry.set_state(SandboxState::Forking)?;
    entry.wait_patches();
    let checkpoint_id = format!("fork-{}", crate::util::new_id());
    let captured = capture_running(registry, snapshots, &entry, id, &checkpoint_id);
    if entry.state() == SandboxState::Forking {
        entry.set_state(SandboxState::Running)?;
    }
    let capture = captured?;
    let parent = entry.read(|i| i.settings.clone());
    let children = (0..count)
        .map(|_| {
            let settings = SandboxSettings {
                timeout_secs: timeout_secs.unwrap_or(parent.timeout_secs),
                ..parent.clone()
            };
            clone_from_capture(registry, launcher, &capture, settings, None)
        })
        .collect();
    // The children hold their own links to the frozen layers; the checkpoint can go.
    let _ = std::fs::remove_dir_all(snapshots.dir(&checkpoint_id));
    Ok(children)
}
