//! The orchestrator's view of the host, one trait per side: network slots
//! ([`Network`]), the custom extension ([`Extension`]), the VMs ([`Machines`]) and the
//! host's memory ([`HostFacts`]). The
//! server hands in the real ones ([`SlotManager`], [`HookClient`], QEMU through
//! [`QemuMachines`]); unit tests hand in fakes, so every failure path of the lifecycle runs
//! in `cargo test --lib` without root (youki's fakeable `Syscall` is the model).

use super::warmup::{WarmUp, WarmUpError};
use crate::agent::{AgentClient, AgentError};
use crate::hooks::{HookClient, HookError, Instance, StartContext, StopReason};
use crate::net::{NetError, Slot, SlotManager, SlotStats};
use crate::vm::{
    self, CaptureRecord, CaptureStats, DiskCapture, MemoryFile, Priority, Vm, VmError, VmExit,
    VmSpec,
};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// Network slots: one per running VM.
pub(crate) trait Network: Send + Sync {
    /// A ready slot (from the pool or built now).
    fn acquire(&self) -> Result<Slot, NetError>;
    /// Gives a slot back once its VM is gone.
    fn release(&self, slot: Slot);
    fn stats(&self) -> SlotStats;
    fn shutdown(&self);
}

impl Network for SlotManager {
    fn acquire(&self) -> Result<Slot, NetError> {
        SlotManager::acquire(self)
    }
    fn release(&self, slot: Slot) {
        SlotManager::release(self, slot)
    }
    fn stats(&self) -> SlotStats {
        SlotManager::stats(self)
    }
    fn shutdown(&self) {
        SlotManager::shutdown(self)
    }
}

/// The custom extension's hooks (custom-extension.md). Every instance a start hook
/// returns is owed exactly one [`Extension::stop`].
pub(crate) trait Extension: Send + Sync {
    fn enabled(&self) -> bool;
    fn start_fresh(
        &self,
        s: &StartContext,
        base_cmdline_len: usize,
    ) -> (Instance, Result<Option<String>, HookError>);
    fn start_resume(&self, s: &StartContext) -> (Instance, Result<(), HookError>);
    fn patch_params(&self, sandbox_id: &str, patch: &Value) -> Result<Value, HookError>;
    fn stop(&self, instance: Instance, reason: StopReason);
    fn shutdown(&self);
    fn render_metrics(&self, out: &mut String);
}

impl Extension for HookClient {
    fn enabled(&self) -> bool {
        HookClient::enabled(self)
    }
    fn start_fresh(
        &self,
        s: &StartContext,
        base_cmdline_len: usize,
    ) -> (Instance, Result<Option<String>, HookError>) {
        HookClient::start_fresh(self, s, base_cmdline_len)
    }
    fn start_resume(&self, s: &StartContext) -> (Instance, Result<(), HookError>) {
        HookClient::start_resume(self, s)
    }
    fn patch_params(&self, sandbox_id: &str, patch: &Value) -> Result<Value, HookError> {
        HookClient::patch_params(self, sandbox_id, patch)
    }
    fn stop(&self, instance: Instance, reason: StopReason) {
        HookClient::stop(self, instance, reason)
    }
    fn shutdown(&self) {
        HookClient::shutdown(self)
    }
    fn render_metrics(&self, out: &mut String) {
        HookClient::render_metrics(self, out)
    }
}

/// Starts VMs. Called on the sandbox's supervisor thread, which then owns the machine.
pub(crate) trait Machines: Send + Sync {
    /// A fresh boot; with `memory` the guest's RAM is that file.
    fn boot(&self, spec: VmSpec, memory: Option<MemoryFile>) -> Result<Box<dyn Machine>, VmError>;
    /// A restore of `record`: state loaded, vCPUs not run yet
    /// ([`Machine::resume_vcpus`] starts them). A filesystem-only `record` cold-boots
    /// from its disk instead, its vCPUs held the same way.
    fn restore(
        &self,
        record: &CaptureRecord,
        spec: vm::RestoreSpec,
    ) -> Result<Box<dyn Machine>, VmError>;
    /// A QEMU process shaped for `record` that waits for its state (a standby):
    /// [`Machine::warm_up`] loads its state and warms it up later.
    fn standby(
        &self,
        record: &CaptureRecord,
        spec: vm::RestoreSpec,
    ) -> Result<Box<dyn Machine>, VmError>;
}

/// One running VM, owned by its supervisor thread.
pub(crate) trait Machine: Send {
    /// Connects to the guest agent, waiting until it answers or `deadline`.
    fn connect_agent(&mut self, deadline: Instant) -> Result<AgentClient, AgentError>;
    /// The last lines of the guest console, for log lines about a failed VM.
    fn console_tail(&self, lines: usize) -> String;
    /// How the VM process ended, if it has.
    fn exited(&mut self) -> Option<VmExit>;
    /// [`Machine::exited`], waiting up to `grace` for a process that may be exiting.
    fn exited_within(&mut self, grace: Duration) -> Option<VmExit> {
        let _ = grace;
        self.exited()
    }
    /// Kills the VM process and reaps it.
    fn kill(self: Box<Self>);
    /// Captures the VM into `dir` and makes it quit (custom-extension.md §5.4).
    fn pause(&mut self, dir: &Path) -> Result<(CaptureRecord, CaptureStats), VmError>;
    /// [`Machine::pause`], but a pause that can leave the VM stopped in place does
    /// (true: it can run on, [`super::kept`]); the capture is whole either way.
    fn pause_keeping(
        &mut self,
        dir: &Path,
    ) -> Result<(CaptureRecord, CaptureStats, bool), VmError> {
        self.pause(dir)
            .map(|(record, stats)| (record, stats, false))
    }
    /// On a kept VM: its writes go to the new empty layer `next` over its disk.
    fn move_onto_layer(&mut self, next: &Path) -> Result<(), VmError>;
    /// Stops the VM and makes it quit, keeping only its disk (a filesystem-only pause;
    /// the guest synced its filesystems before).
    fn pause_to_disk(&mut self) -> Result<CaptureRecord, VmError>;
    /// Captures the VM into `dir` in place; its vCPUs stay stopped.
    fn capture(
        &mut self,
        dir: &Path,
        disk: DiskCapture,
    ) -> Result<(CaptureRecord, CaptureStats), VmError>;
    fn resume_vcpus(&mut self) -> Result<(), VmError>;
    /// Whether QEMU stopped the guest because a write to its disk found the host's
    /// filesystem full ([`Machine::resume_vcpus`] retries the write).
    fn paused_on_io_error(&mut self) -> Result<bool, VmError>;
    /// On a [`Machines::standby`] VM: loads `record`'s state; the vCPUs stay stopped.
    fn load_state(&mut self, record: &CaptureRecord) -> Result<(), VmError>;
    /// On a [`Machines::standby`] VM: loads `record`'s state and warms the guest up with
    /// its carrier down ([`super::warmup`]); the vCPUs are stopped after, the agent
    /// connection is kept for the claim.
    fn warm_up(
        &mut self,
        record: &CaptureRecord,
        w: WarmUp,
        scratch: &str,
    ) -> Result<AgentClient, WarmUpError>;
    fn stop_vcpus(&mut self) -> Result<(), VmError>;
    /// Puts the NIC's carrier up or down.
    fn set_carrier(&mut self, up: bool) -> Result<(), VmError>;
    /// The scheduling priority of every thread of the VM process.
    fn set_priority(&mut self, priority: Priority) -> Result<(), VmError>;
    /// What the VM process holds of the host's memory (PSS, KiB), if known.
    fn memory_kib(&mut self) -> Option<u64> {
        None
    }
    /// The guest of a cold boot has booted: drop what only its boot needed.
    fn boot_finished(&mut self) -> Result<(), VmError> {
        Ok(())
    }
    fn disk_chain_depth(&mut self) -> Result<usize, VmError>;
    fn flatten_disk(&mut self, timeout: Duration) -> Result<(), VmError>;
    /// Freezes the disk into `dir` (hard links of its layers); the guest runs on.
    fn freeze_disk(&mut self, dir: &Path) -> Result<Vec<std::path::PathBuf>, VmError>;
}

/// The real VMs: QEMU processes.
pub(crate) struct QemuMachines;

impl Machines for QemuMachines {
    fn boot(&self, spec: VmSpec, memory: Option<MemoryFile>) -> Result<Box<dyn Machine>, VmError> {
        let vm = match memory {
            Some(memory) => Vm::spawn_with_memory_file(spec, &memory)?,
            None => Vm::spawn(spec)?,
        };
        Ok(Box::new(vm))
    }

    fn restore(
        &self,
        record: &CaptureRecord,
        spec: vm::RestoreSpec,
    ) -> Result<Box<dyn Machine>, VmError> {
        if record.filesystem_only {
            return Ok(Box::new(Vm::boot_from_disk(record, spec)?));
        }
        let (vm, _) = Vm::restore(record, spec)?;
        Ok(Box::new(vm))
    }

    fn standby(
        &self,
        record: &CaptureRecord,
        spec: vm::RestoreSpec,
    ) -> Result<Box<dyn Machine>, VmError> {
        Ok(Box::new(Vm::spawn_standby(record, spec)?))
    }
}

impl Machine for Vm {
    fn connect_agent(&mut self, deadline: Instant) -> Result<AgentClient, AgentError> {
        let socket = self.agent_socket().to_path_buf();
        // A guest QEMU paused on a write the full state disk refused cannot answer: the
        // wait ends at once (the caller asks `paused_on_io_error` for its answer).
        AgentClient::connect_unless(&socket, deadline, || {
            matches!(self.paused_on_io_error(), Ok(true))
                .then(|| "its VM is paused on a disk I/O error".to_string())
        })
    }
    fn console_tail(&self, lines: usize) -> String {
        Vm::console_tail(self, lines)
    }
    fn exited(&mut self) -> Option<VmExit> {
        self.try_wait().map(VmExit::from)
    }
    fn exited_within(&mut self, grace: Duration) -> Option<VmExit> {
        self.wait_timeout(grace).map(VmExit::from)
    }
    fn kill(self: Box<Self>) {
        Vm::kill(*self)
    }
    fn pause(&mut self, dir: &Path) -> Result<(CaptureRecord, CaptureStats), VmError> {
        Vm::pause(self, dir)
    }
    fn pause_keeping(
        &mut self,
        dir: &Path,
    ) -> Result<(CaptureRecord, CaptureStats, bool), VmError> {
        Vm::pause_keeping(self, dir)
    }
    fn move_onto_layer(&mut self, next: &Path) -> Result<(), VmError> {
        Vm::move_onto_layer(self, next)
    }
    fn pause_to_disk(&mut self) -> Result<CaptureRecord, VmError> {
        Vm::pause_to_disk(self)
    }
    fn capture(
        &mut self,
        dir: &Path,
        disk: DiskCapture,
    ) -> Result<(CaptureRecord, CaptureStats), VmError> {
        Vm::capture(self, dir, disk)
    }
    fn resume_vcpus(&mut self) -> Result<(), VmError> {
        Vm::resume_vcpus(self)
    }
    fn paused_on_io_error(&mut self) -> Result<bool, VmError> {
        Vm::paused_on_io_error(self)
    }
    fn load_state(&mut self, record: &CaptureRecord) -> Result<(), VmError> {
        let load_ms = Vm::load_incoming(self, record)?;
        log::info!("vm op=load_state pid={} loadMs={load_ms}", self.pid());
        Ok(())
    }
    fn warm_up(
        &mut self,
        record: &CaptureRecord,
        w: WarmUp,
        scratch: &str,
    ) -> Result<AgentClient, WarmUpError> {
        super::warmup::warm(self, record, w, scratch)
    }
    fn stop_vcpus(&mut self) -> Result<(), VmError> {
        Vm::stop_vcpus(self)
    }
    fn set_carrier(&mut self, up: bool) -> Result<(), VmError> {
        Vm::set_carrier(self, up)
    }
    fn set_priority(&mut self, priority: Priority) -> Result<(), VmError> {
        Vm::set_priority(self, priority)
    }
    fn memory_kib(&mut self) -> Option<u64> {
        crate::sys::procmem::pss_kib(self.pid())
    }
    fn boot_finished(&mut self) -> Result<(), VmError> {
        Vm::boot_finished(self)
    }
    fn freeze_disk(&mut self, dir: &Path) -> Result<Vec<std::path::PathBuf>, VmError> {
        Vm::freeze_disk(self, dir)
    }
    fn disk_chain_depth(&mut self) -> Result<usize, VmError> {
        Vm::disk_chain_depth(self)
    }
    fn flatten_disk(&mut self, timeout: Duration) -> Result<(), VmError> {
        Vm::flatten_disk(self, timeout)
    }
}

/// The host as admission and the limits a sandbox may ask for see it
/// ([`super::admission`]); faked in unit tests.
pub(crate) trait HostFacts: Send + Sync {
    fn online_cpus(&self) -> u32;
    fn total_memory_mb(&self) -> u64;
    /// What can be allocated without swapping (MiB); `None` when unknown.
    fn available_mb(&self) -> Option<u64>;
    /// The share (%) of the last 10 s some task stalled on memory; `None` without PSI.
    fn pressure_pct(&self) -> Option<f64>;
}

/// The real host: its online CPUs, `/proc/meminfo` and `/proc/pressure/memory`.
pub(crate) struct ProcHost;

impl HostFacts for ProcHost {
    fn online_cpus(&self) -> u32 {
        crate::sys::fs::online_cpus()
    }
    fn total_memory_mb(&self) -> u64 {
        crate::sys::fs::total_memory_mb()
    }
    fn available_mb(&self) -> Option<u64> {
        crate::sys::fs::available_memory_mb()
    }
    fn pressure_pct(&self) -> Option<f64> {
        crate::sys::fs::memory_pressure_pct()
    }
}
