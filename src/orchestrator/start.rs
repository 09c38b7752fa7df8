//! The one start sequence of a sandbox VM, shared by cold creates, template builds,
//! resumes and sandboxes created from a snapshot or forked (custom-extension.md §5.2,
//! §5.3, §5.5, §5.8, §5.9):
//!
//! 1. admission: the VM's memory and vCPUs are reserved, or the start is refused (429)
//!    before anything else is made and before the extension hears of it; a claimed warm
//!    standby brings its share, and the host's headroom is checked again for it (refused:
//!    the standby is discarded);
//! 2. a network slot, with the sandbox's outbound choice applied (network.md §5.4);
//! 3. the start hook (start-fresh, whose `extraBootArgs` go last on the kernel command
//!    line, or start-resume), journaled first by the hook client; a restore's VM is
//!    prepared meanwhile (QEMU started, state loaded, vCPUs stopped), so the hook and the
//!    QEMU start overlap, and the vCPUs run only after the hook succeeded (a warm
//!    standby's carrier goes up after that and the clock set: no guest traffic before);
//! 4. rollback when the hook failed (custom-extension.md §7.3): stop for the attempt,
//!    then the slot, then the reservation;
//! 5. the supervisor thread, which from then on owns VM, slot, instance and reservation
//!    and undoes all of them on its own failures.
//!
//! Disk preparation (before) and registration (after) are the callers'.

use super::admission::{Admission, Reservation};
use super::sandbox::RuntimeHandle;
use super::settings::Resources;
use super::sides::{Extension, Machines, Network};
use super::standby::{Prepared, StandbyPool, WarmVm};
use super::state_disk::StateDisk;
use super::supervisor::{
    self, HookOutcome, Launch, Placed, RunDir, StartPlan, ThreadSpawner, Watch,
};
use super::OrchError;
use crate::config::{Config, VmConfig};
use crate::hooks::{Instance, StartContext, StopReason};
use crate::net::Slot;
use crate::vm::{self, Accel, CaptureRecord, HostPlumbing};
use serde_json::Value;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;

/// What starting a VM needs: the three host sides, admission, and the VM settings.
pub(crate) struct Launcher {
    pub net: Arc<dyn Network>,
    pub hooks: Arc<dyn Extension>,
    pub machines: Arc<dyn Machines>,
    pub admission: Arc<Admission>,
    pub vm: VmConfig,
    pub accel: Accel,
    /// What agentenv adds to every guest's kernel command line (agent port, DNS).
    pub kernel_args: Vec<String>,
    /// `[network] outbound`: whether any guest may reach out.
    pub outbound: bool,
    /// Starts supervisor threads (a seam: tests make it fail).
    pub spawn: ThreadSpawner,
    /// QEMU processes started ahead of creates from built templates.
    pub standby: StandbyPool,
    /// VM processes that ended on their own (`agentenv_vm_deaths_total`).
    pub deaths: Arc<super::metrics::VmDeaths>,
    /// What a standby's warm-up needs (its guest's envd port, the agent's patience).
    pub warm_up: super::warmup::WarmUp,
    /// `<state_dir>/volumes`, where the volumes a guest mounts are.
    pub volumes_dir: PathBuf,
    /// The state dir's filesystem: what a guest paused on it being full waits for.
    pub disk: Arc<StateDisk>,
    /// Paused sandboxes' stopped VMs, kept for their resume.
    pub kept: Arc<super::kept::KeptPool>,
}

impl Launcher {
    /// How a VM of this server is wired to the host: in `run_dir`, inside the slot's
    /// `netns`, on the slot's tap.
    pub fn plumbing(&self, run_dir: &std::path::Path, netns: std::fs::File) -> HostPlumbing {
        HostPlumbing {
            run_dir: run_dir.to_path_buf(),
            netns: Some(netns),
            tap: Some(crate::net::TAP_NAME.to_string()),
            accel: self.accel,
            qemu_binary: self.vm.qemu_binary.clone(),
        }
    }

    pub fn new(
        config: &Config,
        net: Arc<dyn Network>,
        hooks: Arc<dyn Extension>,
        machines: Arc<dyn Machines>,
        admission: Arc<Admission>,
        accel: Accel,
    ) -> Launcher {
        let deaths = Arc::new(super::metrics::VmDeaths::default());
        let mut kernel_args = vec![format!("agentenv.port={}", config.agent.port)];
        if config.network.outbound {
            if let Some(dns) = crate::net::guest_dns(&config.network) {
                kernel_args.push(format!("agentenv.dns={dns}"));
            }
        }
        let kept = Arc::new(super::kept::KeptPool::new(
            super::kept::KeptLimits::from_config(&config.sandbox),
            net.clone(),
        ));
        Launcher {
            kept,
            net,
            hooks,
            machines,
            admission,
            vm: config.vm.clone(),
            accel,
            kernel_args,
            outbound: config.network.outbound,
            spawn: supervisor::spawn_thread,
            standby: StandbyPool::new(
                super::standby::PoolSizing {
                    per_template: config.templates.standby_per_template as usize,
                    memory_kib: config.templates.standby_memory_mb << 10,
                    idle: std::time::Duration::from_secs(config.templates.standby_idle_secs),
                },
                deaths.clone(),
            ),
            deaths,
            warm_up: super::warmup::WarmUp {
                envd_port: config.agent.port,
                ready_timeout: std::time::Duration::from_secs(config.vm.ready_timeout_secs),
            },
            volumes_dir: crate::store::layout::StateLayout::new(&config.server.state_dir).volumes(),
            disk: Arc::new(StateDisk::new(
                config.server.state_dir.clone(),
                config.server.disk_reserve_mb,
                super::state_disk::statvfs_probe,
            )),
        }
    }
}

/// How the new VM comes to life.
pub(crate) enum StartKind {
    /// A fresh boot (start-fresh); with `memory_file` the guest's RAM is that file; the
    /// disk is `disk` (a top layer in the run dir), else the run dir's `disk.qcow2`.
    Fresh {
        memory_file: Option<PathBuf>,
        disk: Option<PathBuf>,
    },
    /// A restore of `record` onto the writable top layer `disk` (start-resume); with
    /// `standby`, into a claimed standby's QEMU, slot and admission share.
    Restore {
        record: Box<CaptureRecord>,
        disk: PathBuf,
        standby: Option<Box<Prepared>>,
    },
}

/// One VM start. The disk is prepared in `run_dir` already.
pub(crate) struct StartRequest {
    pub id: String,
    pub run_dir: RunDir,
    pub kind: StartKind,
    pub resources: Resources,
    pub internet_access: bool,
    /// The sandbox's own `allowOut` / `denyOut` (network.md §5.6).
    pub egress: crate::net::EgressRules,
    /// The params the start hook carries.
    pub params: Value,
    /// The stop reason owed to an instance whose start failed.
    pub failed_reason: StopReason,
    /// Told on the supervisor thread what happens to the VM while it runs.
    pub watch: Box<dyn Watch>,
    /// The volumes its guest mounts: its slot's NFS server exports them.
    pub volumes: Vec<super::settings::VolumeMount>,
}

/// A started VM: the channel to its supervisor, its agent, and its slot's facts.
pub(crate) struct Started {
    pub runtime: RuntimeHandle,
    pub host_ip: Ipv4Addr,
    pub netns_path: PathBuf,
}

fn start_context(id: &str, slot: &Slot, params: &Value) -> StartContext {
    StartContext {
        sandbox_id: id.to_string(),
        netns_path: slot.netns_path().to_path_buf(),
        host_ip: slot.host_ip(),
        slot_index: slot.index(),
        params: params.clone(),
    }
}

/// Reserves a VM's memory and vCPUs. When admission is full, standbys give their shares
/// back first, then kept paused VMs: neither ever makes a start fail.
fn reserve(launcher: &Launcher, resources: Resources) -> Result<Reservation, OrchError> {
    loop {
        match launcher
            .admission
            .reserve(resources.memory_mb, resources.cpu_count)
        {
            Ok(r) => return Ok(r),
            Err(e) if !evict_one(launcher) => return Err(e),
            Err(_) => {}
        }
    }
}

/// Gives back what one standby, else one kept paused VM, holds. False: nothing to give.
fn evict_one(launcher: &Launcher) -> bool {
    launcher.standby.evict_one(&*launcher.net) || launcher.kept.evict_one()
}

/// A network slot; when none is left, kept paused VMs give theirs back first.
fn acquire_slot(launcher: &Launcher) -> Result<Slot, OrchError> {
    loop {
        match launcher.net.acquire() {
            Ok(slot) => return Ok(slot),
            Err(e) if !launcher.kept.evict_one() => return Err(e.into()),
            Err(_) => {}
        }
    }
}

/// The sandbox's outbound choice and policy, on its slot (network.md §5.4, §5.6); a
/// `reused` slot (a kept paused VM's) gets the policy replaced, whatever it is now.
fn apply_egress(
    launcher: &Launcher,
    slot: &mut Slot,
    (internet_access, reused): (bool, bool),
    egress: &crate::net::EgressRules,
) -> Result<(), crate::net::NetError> {
    if launcher.outbound && !internet_access {
        slot.deny_outbound()?;
    }
    if reused || *egress != crate::net::EgressRules::default() {
        slot.set_egress(egress)?;
    }
    Ok(())
}

/// Runs the start sequence (see the module doc). On every error nothing it made is left:
/// no reservation, no slot, no open instance; the run dir goes when it was armed.
pub(crate) fn start(launcher: &Arc<Launcher>, req: StartRequest) -> Result<Started, OrchError> {
    let StartRequest {
        id,
        run_dir,
        mut kind,
        resources,
        internet_access,
        egress,
        params,
        failed_reason,
        watch,
        volumes,
    } = req;
    let exports = super::volumes::exports(&launcher.volumes_dir, &volumes);
    let standby = match &mut kind {
        StartKind::Restore { standby, .. } => standby.take(),
        StartKind::Fresh { .. } => None,
    };
    let reused = standby.as_ref().is_some_and(|p| p.warm.agent.is_none());
    let (reservation, mut slot, prepared) = take_resources(launcher, standby, resources)?;
    if let Err(e) = apply_egress(launcher, &mut slot, (internet_access, reused), &egress) {
        if let Some(warm) = prepared {
            warm.vm.kill();
        }
        launcher.net.release(slot);
        return Err(OrchError::net("applying the slot's outbound rules", e));
    }
    let context = start_context(&id, &slot, &params);
    let placed = Placed {
        id,
        run_dir,
        slot,
        resources,
        reservation,
        watch,
        exports,
    };
    match kind {
        StartKind::Fresh { memory_file, disk } => start_fresh(
            launcher,
            placed,
            &context,
            (memory_file, disk),
            failed_reason,
        ),
        StartKind::Restore { record, disk, .. } => start_restore(
            launcher,
            placed,
            &context,
            (record, disk, prepared),
            failed_reason,
        ),
    }
}

impl Placed {
    fn plan(self, instance: Instance, launch: Launch) -> StartPlan {
        StartPlan {
            placed: self,
            instance,
            launch,
        }
    }

    /// Where the slot's guest is reached, for the answer.
    fn addresses(&self) -> (Ipv4Addr, PathBuf) {
        (self.slot.host_ip(), self.slot.netns_path().to_path_buf())
    }
}

/// A start's share of the host, its slot, and a claimed standby's warm VM.
type Held = (Reservation, Slot, Option<WarmVm>);

/// A claimed standby's share, slot and prepared VM, or a new reservation and slot.
fn take_resources(
    launcher: &Launcher,
    standby: Option<Box<Prepared>>,
    resources: Resources,
) -> Result<Held, OrchError> {
    let Some(p) = standby else {
        let reservation = reserve(launcher, resources)?;
        return Ok((reservation, acquire_slot(launcher)?, None));
    };
    let Prepared {
        warm,
        slot,
        reservation,
    } = *p;
    // The sandbox will grow past what its standby touched: the host must have room now.
    if let Err(e) = launcher.admission.admit_claim(&reservation) {
        warm.vm.kill();
        launcher.net.release(slot);
        return Err(e);
    }
    Ok((reservation, slot, Some(warm)))
}

/// A fresh boot: start-fresh, then the supervisor boots the VM with the hook's kernel
/// arguments; a failed hook gets its stop before the answer (custom-extension.md §7.3).
fn start_fresh(
    launcher: &Arc<Launcher>,
    placed: Placed,
    context: &StartContext,
    (memory_file, disk): (Option<PathBuf>, Option<PathBuf>),
    failed_reason: StopReason,
) -> Result<Started, OrchError> {
    let mut kernel_args = launcher.kernel_args.clone();
    let base_cmdline = match vm::kernel_cmdline(launcher.accel, &kernel_args) {
        Ok(c) => c,
        Err(e) => {
            launcher.net.release(placed.slot);
            return Err(OrchError::vm("building the kernel command line", e));
        }
    };
    let (instance, hook) = launcher.hooks.start_fresh(context, base_cmdline.len());
    let extra = match hook {
        Ok(extra) => extra,
        Err(e) => {
            // Rollback before the answer (custom-extension.md §7.3): stop for the
            // attempt, then the slot; the reservation goes on return.
            launcher.hooks.stop(instance, failed_reason);
            launcher.net.release(placed.slot);
            return Err(e.into());
        }
    };
    kernel_args.extend(extra);
    let launch = Launch::Cold {
        kernel_args,
        memory_file,
        disk,
    };
    let (host_ip, netns_path) = placed.addresses();
    let (ops, agent) = supervisor::start(launcher, placed.plan(instance, launch))?;
    Ok(Started {
        runtime: RuntimeHandle::new(ops, agent),
        host_ip,
        netns_path,
    })
}

/// What a restore brings: the capture, the writable top layer, a claimed standby's VM.
type RestoreParts = (Box<CaptureRecord>, PathBuf, Option<WarmVm>);

/// A restore: the VM is prepared while start-resume runs; the supervisor takes the
/// hook's outcome and undoes everything itself when it failed.
fn start_restore(
    launcher: &Arc<Launcher>,
    placed: Placed,
    context: &StartContext,
    (record, disk, prepared): RestoreParts,
    failed_reason: StopReason,
) -> Result<Started, OrchError> {
    let (hook_tx, hook_rx) = crossbeam_channel::bounded(1);
    let launch = Launch::Restore {
        record,
        disk,
        hook: hook_rx,
        failed_reason,
        prepared,
    };
    let instance = Instance {
        sandbox_id: context.sandbox_id.clone(),
        instance_id: None,
    };
    let (host_ip, netns_path) = placed.addresses();
    let launching = supervisor::begin(launcher, placed.plan(instance, launch))?;
    let (instance, result) = launcher.hooks.start_resume(context);
    if let Err(unsent) = hook_tx.send(HookOutcome { instance, result }) {
        // The supervisor is gone (its launch reply says why); the instance is
        // still owed its stop.
        launcher.hooks.stop(unsent.0.instance, failed_reason);
    }
    let (ops, agent) = launching.wait()?;
    Ok(Started {
        runtime: RuntimeHandle::new(ops, agent),
        host_ip,
        netns_path,
    })
}
