//! Capturing a running VM (RAM + devices + disk, at one instant) and restoring captures
//! into new QEMU processes: the VM-level half of pause, resume, snapshots, templates and
//! fork.
//!
//! - Pause: [`Vm::capture`] with [`DiskCapture::InPlace`], then [`Vm::quit`] (or both at
//!   once: [`Vm::pause`]). The record points at the sandbox's own disk, consistent once
//!   QEMU has exited.
//! - Snapshot / fork parent / template: [`Vm::capture`] with [`DiskCapture::Freeze`]; the
//!   VM is left stopped on a fresh top layer; [`Vm::resume_vcpus`] lets it run on (or quit
//!   it, for a template build).
//! - Resume / clone: [`create_clone_disk`](super::create_clone_disk) (clones only), then
//!   [`Vm::restore`] (or [`Vm::spawn_standby`] + [`Vm::load_incoming`]) → the VM is
//!   `paused` with the state loaded and vCPUs not run yet (the caller's start-resume hook
//!   goes here), then [`Vm::resume_vcpus`], then [`sync_guest_clock`] once the agent
//!   answers.
//!
//! State files are written as `state.bin.partial` and renamed to `state.bin` only once
//! QEMU reported `completed` and the data was fsync'd: a crash or kill mid-capture never
//! leaves a `state.bin` that is not whole.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::dirty::{DirtyMemory, DIRTY_FORMAT};
use super::disk::{self, disk_chain, DiskChain, MAX_CHAIN_LAYERS};
use super::machine::{HostPlumbing, MachineConfig};
use super::qemu::{Incoming, Launch, MemoryFile, Vm, VmSpec};
use super::{Priority, VmError};
use crate::agent::{AgentClient, AgentError};

/// The state file's name inside a capture directory.
pub const STATE_FILE: &str = "state.bin";
const PARTIAL_SUFFIX: &str = ".partial";
/// Current [`CaptureRecord::format`].
pub const CAPTURE_FORMAT: u32 = 1;
/// Migration bandwidth cap during a capture: effectively none (QEMU's default is
/// 128 MiB/s, several times slower than writing the file).
pub(crate) const CAPTURE_BANDWIDTH: u64 = 64 << 30;
/// Every capture and restore migrates with `x-ignore-shared`: RAM mapped shared from a
/// file is left out of the state file (the file holds it), anonymous or privately mapped
/// RAM is saved as usual, and since both ends always agree on the stream format, any state
/// file restores into any VM of the same shape. (QEMU 10 cannot set it with `-global`,
/// hence `-incoming defer` on every restore.)
pub(crate) const MIGRATION_CAPS: &[(&str, bool)] = &[("x-ignore-shared", true)];
/// How long saving the state may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// How long loading the state may take.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long QEMU may take to exit after `quit`.
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);

/// What happens to the disk in a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskCapture {
    /// The VM is about to quit (pause): the record references its disk chain where it is.
    /// Only valid for resuming this same sandbox, and only once QEMU has exited.
    InPlace,
    /// Freeze the disk at the capture instant: switch the VM onto a new empty top layer
    /// and hard-link the now immutable chain into the capture directory (snapshots,
    /// templates, fork). The VM may run on afterwards.
    Freeze,
}

/// Everything needed to restore a capture, and what it costs on disk. This is what the
/// orchestrator stores (serialised as JSON) with a paused sandbox, snapshot or template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CaptureRecord {
    /// [`CAPTURE_FORMAT`] when written.
    pub format: u32,
    pub captured_at_unix_ms: u64,
    /// Stored flat (`kernel`, `initramfs`, `cpuCount`, `memoryMb`), as before it had a
    /// type of its own.
    #[serde(flatten)]
    pub machine: MachineConfig,
    /// The exact kernel command line the VM booted with; a restore must pass the same.
    pub kernel_cmdline: String,
    /// "kvm" or "tcg": a state file restores only under the accelerator that saved it.
    pub accel: String,
    /// Whether the VM had a NIC (the device set must match on restore).
    pub nic: bool,
    /// The device state (and RAM, unless `memory_file` holds it).
    pub state_file: PathBuf,
    pub state_bytes: u64,
    /// The guest RAM, when the VM ran with its RAM mapped shared from a file: clones map
    /// it copy-on-write. `None`: the RAM is in `state_file`.
    pub memory_file: Option<PathBuf>,
    /// The top of the captured disk chain (immutable for `Freeze`; the sandbox's live disk
    /// for `InPlace`).
    pub disk: PathBuf,
    /// The chain's qcow2 layers, bottom first, `disk` last. For `Freeze` they are hard
    /// links inside the capture directory.
    pub disk_layers: Vec<PathBuf>,
    /// The raw base image under the bottom layer (shared, immutable, in the image store).
    pub disk_base: Option<PathBuf>,
    pub disk_virtual_bytes: u64,
    /// Bytes allocated on the host by the layers (shared with the source through links).
    pub disk_allocated_bytes: u64,
    /// Whether the disk was frozen (`Freeze`) or left in place (`InPlace`).
    pub disk_frozen: bool,
    /// A dirty-only pause (format [`DIRTY_FORMAT`], see [`super::dirty`]): `state_file`
    /// holds the device state only, the RAM is `memory_file` (the template's) with these
    /// pages over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty: Option<DirtyMemory>,
    /// A filesystem-only pause: the disk chain and the boot facts, no state file and no
    /// memory; its resume cold-boots from the disk.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub filesystem_only: bool,
}

impl CaptureRecord {
    /// The record with every file path passed through `f` (the orchestrator stores paths
    /// relative to its state dir).
    pub fn map_paths(&self, f: impl Fn(&Path) -> PathBuf) -> CaptureRecord {
        CaptureRecord {
            machine: MachineConfig {
                kernel: f(&self.machine.kernel),
                initramfs: f(&self.machine.initramfs),
                ..self.machine.clone()
            },
            state_file: f(&self.state_file),
            memory_file: self.memory_file.as_deref().map(&f),
            disk: f(&self.disk),
            disk_layers: self.disk_layers.iter().map(|p| f(p)).collect(),
            disk_base: self.disk_base.as_deref().map(&f),
            dirty: self.dirty.as_ref().map(|d| DirtyMemory {
                base_state: f(&d.base_state),
                pages_file: f(&d.pages_file),
                ..d.clone()
            }),
            ..self.clone()
        }
    }

    /// The files holding the captured RAM and device state (not the disk, the kernel or
    /// the initramfs), with what each is.
    pub fn capture_files(&self) -> Vec<(&'static str, &Path)> {
        if self.filesystem_only {
            return Vec::new();
        }
        let mut files = vec![("saved VM state", self.state_file.as_path())];
        if let Some(memory) = &self.memory_file {
            files.push(("captured guest RAM", memory));
        }
        if let Some(dirty) = &self.dirty {
            files.push(("template state", &dirty.base_state));
            files.push(("changed guest pages", &dirty.pages_file));
        }
        files
    }
}

/// Where the time of a capture went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CaptureStats {
    /// Creating the next top layer (before the VM is stopped).
    pub prepare_ms: u64,
    /// `stop` until the disk switch is done.
    pub stop_ms: u64,
    pub disk_switch_ms: u64,
    /// `migrate` until `completed`.
    pub migrate_ms: u64,
    /// fsync of the state file (and RAM file), rename, directory fsync, disk links.
    pub sync_ms: u64,
    /// `stop` to the end: how long the guest was frozen by the capture.
    pub frozen_ms: u64,
    pub total_ms: u64,
    pub state_bytes: u64,
}

/// Where the time of a restore went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreStats {
    /// Until QMP answered.
    pub spawn_ms: u64,
    /// Until the state was loaded (`paused`).
    pub load_ms: u64,
    pub total_ms: u64,
}

/// Where and how a capture is restored. Everything else comes from the
/// [`CaptureRecord`].
#[derive(Debug)]
pub struct RestoreSpec {
    /// The writable top layer: [`super::create_clone_disk`] for a clone, the record's
    /// `disk` to resume a paused sandbox.
    pub disk: PathBuf,
    /// Its `tap` is required (and only allowed) when the record has a NIC, and `netns`
    /// must hold it.
    pub host: HostPlumbing,
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn fsync_path(path: &Path) -> Result<(), VmError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| VmError::io(format!("cannot fsync {}", path.display()), e))
}

fn fsync_dir(dir: &Path) -> Result<(), VmError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| VmError::io(format!("cannot fsync directory {}", dir.display()), e))
}

fn allocated_bytes(paths: &[PathBuf]) -> u64 {
    use std::os::unix::fs::MetadataExt;
    paths
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

impl Vm {
    /// The disk QEMU writes to now (moves with each [`DiskCapture::Freeze`]).
    pub fn disk(&self) -> &Path {
        &self.facts.disk
    }

    /// The kernel command line the VM booted with.
    pub fn kernel_cmdline(&self) -> &str {
        &self.facts.kernel_cmdline
    }

    /// Captures the VM into `dir` (created if missing): stops the vCPUs, handles the disk
    /// as `disk` says, saves the device state and RAM to `dir/state.bin`, fsyncs it. The VM
    /// stays stopped: follow with [`Vm::resume_vcpus`] (it runs on) or [`Vm::quit`].
    ///
    /// On error the VM is stopped too (or gone, if QEMU died); no `state.bin` is left in
    /// `dir`. A VM whose RAM is a shared file must quit after a capture: its RAM file is
    /// the captured RAM.
    pub fn capture(
        &mut self,
        dir: &Path,
        disk: DiskCapture,
    ) -> Result<(CaptureRecord, CaptureStats), VmError> {
        self.capture_then(dir, disk, false)
    }

    /// [`Vm::capture`]; with `quit`, QEMU is told to exit as soon as the state is written,
    /// and exits while the state file is fsync'd.
    fn capture_then(
        &mut self,
        dir: &Path,
        disk: DiskCapture,
        quit: bool,
    ) -> Result<(CaptureRecord, CaptureStats), VmError> {
        let started = Instant::now();
        let mut stats = CaptureStats::default();
        let (state, partial) = prepare_capture_dir(dir)?;
        let chain = disk_chain(&self.facts.disk)?;
        let next_top = self.next_top_layer(disk, &chain)?;
        stats.prepare_ms = ms(started.elapsed());

        let stopped = Instant::now();
        let result = self.capture_stopped(&state, &partial, next_top.as_deref(), quit, &mut stats);
        if let Err(e) = result {
            self.undo_failed_capture(&partial, next_top.as_deref());
            log::warn!(
                "vm op=capture pid={} result=error dir={} error={e}",
                self.pid(),
                dir.display()
            );
            return Err(e);
        }

        let sync = Instant::now();
        let disk_layers = self.make_capture_durable(dir, disk, &chain)?;
        stats.sync_ms += ms(sync.elapsed());
        stats.frozen_ms = ms(stopped.elapsed());
        stats.total_ms = ms(started.elapsed());

        let record = self.record(
            state,
            stats.state_bytes,
            &chain,
            disk_layers,
            disk == DiskCapture::Freeze,
        );
        log::info!(
            "vm op=capture pid={} result=ok dir={} disk={disk:?} stateBytes={} stopMs={} \
             diskMs={} migrateMs={} syncMs={} frozenMs={} totalMs={}",
            self.pid(),
            dir.display(),
            stats.state_bytes,
            stats.stop_ms,
            stats.disk_switch_ms,
            stats.migrate_ms,
            stats.sync_ms,
            stats.frozen_ms,
            stats.total_ms
        );
        Ok((record, stats))
    }

    /// For [`DiskCapture::Freeze`], the next top layer over the current one, made while
    /// the guest still runs: qemu-img does not open the (in use) backing file.
    fn next_top_layer(
        &self,
        disk: DiskCapture,
        chain: &DiskChain,
    ) -> Result<Option<PathBuf>, VmError> {
        match disk {
            DiskCapture::InPlace => Ok(None),
            DiskCapture::Freeze => {
                let sandbox_dir = self.facts.disk.parent().unwrap_or(Path::new("."));
                let next = disk::next_layer_path(sandbox_dir, chain);
                let backing = self
                    .facts
                    .disk
                    .file_name()
                    .and_then(|n| n.to_str())
                    .ok_or_else(|| {
                        VmError::InvalidSpec(format!(
                            "disk {} is not UTF-8",
                            self.facts.disk.display()
                        ))
                    })?;
                disk::create_layer(&next, backing, chain.virtual_size)?;
                Ok(Some(next))
            }
        }
    }

    /// After a failed capture: the partial state file goes, and so does the new top layer
    /// unless the guest already writes to it.
    fn undo_failed_capture(&self, partial: &Path, next_top: Option<&Path>) {
        let _ = std::fs::remove_file(partial);
        if let Some(next) = next_top {
            if self.facts.disk != *next {
                let _ = std::fs::remove_file(next);
            }
        }
    }

    /// Makes a written capture durable: links the frozen disk layers into `dir` (or keeps
    /// the chain's own for an in-place capture), fsyncs `dir` and a shared RAM file.
    /// Returns the capture's disk layers.
    fn make_capture_durable(
        &self,
        dir: &Path,
        disk: DiskCapture,
        chain: &DiskChain,
    ) -> Result<Vec<PathBuf>, VmError> {
        let disk_layers = match disk {
            DiskCapture::InPlace => chain.layers.clone(),
            DiskCapture::Freeze => disk::link_layers(&chain.layers, dir)?,
        };
        fsync_dir(dir)?;
        if let Some(memory) = self.facts.memory.as_ref().filter(|m| m.shared) {
            fsync_path(&memory.path)?;
        }
        Ok(disk_layers)
    }

    /// The record of a capture made now into `state`, with `disk_layers` (the chain's own,
    /// or their links) over `chain`'s base.
    pub(crate) fn record(
        &self,
        state: PathBuf,
        state_bytes: u64,
        chain: &DiskChain,
        disk_layers: Vec<PathBuf>,
        disk_frozen: bool,
    ) -> CaptureRecord {
        CaptureRecord {
            format: CAPTURE_FORMAT,
            captured_at_unix_ms: unix_ms_now(),
            machine: self.facts.machine.clone(),
            kernel_cmdline: self.facts.kernel_cmdline.clone(),
            accel: self.accel().name().into(),
            nic: self.facts.tap.is_some(),
            state_file: state,
            state_bytes,
            memory_file: self
                .facts
                .memory
                .as_ref()
                .filter(|m| m.shared)
                .map(|m| m.path.clone()),
            disk: disk_layers.last().cloned().expect("a chain has a top"),
            disk_allocated_bytes: allocated_bytes(&disk_layers),
            disk_layers,
            disk_base: chain.base.clone(),
            disk_virtual_bytes: chain.virtual_size,
            disk_frozen,
            dirty: None,
            filesystem_only: false,
        }
    }

    /// The part of a capture with the vCPUs stopped, up to the renamed state file.
    fn capture_stopped(
        &mut self,
        state: &Path,
        partial: &Path,
        next_top: Option<&Path>,
        quit: bool,
        stats: &mut CaptureStats,
    ) -> Result<(), VmError> {
        let t = Instant::now();
        self.qmp().stop()?;
        stats.stop_ms = ms(t.elapsed());
        if let Some(next) = next_top {
            let t = Instant::now();
            self.freeze_onto(next, "capture")?;
            stats.disk_switch_ms = ms(t.elapsed());
        }
        let t = Instant::now();
        if !self.migration_tuned {
            self.qmp().migrate_set_parameters(CAPTURE_BANDWIDTH)?;
            self.qmp().migrate_set_capabilities(MIGRATION_CAPS)?;
            self.migration_tuned = true;
        }
        self.qmp().migrate_to_file(partial)?;
        self.qmp().wait_migration(MIGRATION_TIMEOUT)?;
        stats.migrate_ms = ms(t.elapsed());

        let t = Instant::now();
        let file = File::open(partial)
            .map_err(|e| VmError::io(format!("cannot open {}", partial.display()), e))?;
        // The fsync (tens of ms for a 256 MiB guest) overlaps QEMU's exit on a pause.
        self.sync_while_quitting(quit, &file, partial)?;
        stats.state_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        drop(file);
        std::fs::rename(partial, state).map_err(|e| {
            VmError::io(
                format!("cannot rename {} to {}", partial.display(), state.display()),
                e,
            )
        })?;
        stats.sync_ms = ms(t.elapsed());
        Ok(())
    }

    /// Freezes the disk without capturing any state (a build step's result): the vCPUs
    /// stop for the switch onto a new empty top layer, the old top becomes read-only, and
    /// every qcow2 layer of the chain is hard-linked into `dir`; then the guest runs on.
    /// The caller has the guest `sync` first. Returns the linked layers, bottom first.
    pub fn freeze_disk(&mut self, dir: &Path) -> Result<Vec<PathBuf>, VmError> {
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| VmError::io(format!("cannot create {}", dir.display()), e))?;
        }
        let chain = disk_chain(&self.facts.disk)?;
        let sandbox_dir = self.facts.disk.parent().unwrap_or(Path::new("."));
        let next = disk::next_layer_path(sandbox_dir, &chain);
        let backing = self
            .facts
            .disk
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                VmError::InvalidSpec(format!("disk {} is not UTF-8", self.facts.disk.display()))
            })?
            .to_string();
        disk::create_layer(&next, &backing, chain.virtual_size)?;
        self.qmp().stop()?;
        let switched = self.freeze_onto(&next, "freeze_disk");
        if switched.is_err() {
            let _ = std::fs::remove_file(&next);
        }
        let resumed = self.qmp().cont();
        switched?;
        resumed?;
        let linked = disk::link_layers(&chain.layers, dir)?;
        fsync_dir(dir)?;
        Ok(linked)
    }

    /// Lets the vCPUs run (after a capture, or after a restore is prepared).
    pub fn resume_vcpus(&mut self) -> Result<(), VmError> {
        self.qmp().cont()
    }

    /// Stops the guest's vCPUs (QEMU keeps running; its translated code stays cached).
    pub fn stop_vcpus(&mut self) -> Result<(), VmError> {
        self.qmp().stop()
    }

    /// Sets the priority of QEMU's threads: a standby warms up below live VMs (every
    /// thread), a pause's frozen window runs ahead of them (all but the vCPU threads).
    pub fn set_priority(&mut self, priority: Priority) -> Result<(), VmError> {
        // Guest code never runs in the real-time class: the vCPU threads keep theirs.
        let except = matches!(priority, Priority::Realtime(_)).then_some("CPU ");
        crate::sys::process::set_process_priority(self.pid(), priority, except).map_err(|source| {
            VmError::Io {
                op: format!("setting the priority ({priority:?}) of QEMU {}", self.pid()),
                source,
            }
        })
    }

    /// Puts the NIC's carrier up or down (a VM without a NIC has nothing to change).
    pub fn set_carrier(&mut self, up: bool) -> Result<(), VmError> {
        if self.facts.tap.is_none() {
            return Ok(());
        }
        self.qmp().set_link(super::qemu::NETDEV_ID, up)
    }

    /// fsyncs `file` (at `path`, for the error) while QEMU quits, when `quit`: a capture's
    /// files are complete before, and QEMU's memory is no longer needed.
    pub(crate) fn sync_while_quitting(
        &mut self,
        quit: bool,
        file: &File,
        path: &Path,
    ) -> Result<(), VmError> {
        std::thread::scope(|s| {
            let sync = s.spawn(|| {
                file.sync_all()
                    .map_err(|e| VmError::io(format!("cannot fsync {}", path.display()), e))
            });
            let quitted = if quit { self.quit() } else { Ok(()) };
            let synced = super::joined(sync, "fsync");
            quitted.and(synced)
        })
    }

    /// Asks QEMU to exit and waits for it (the disk is flushed and closed then).
    pub fn quit(&mut self) -> Result<(), VmError> {
        if self.try_wait().is_none() {
            self.qmp().quit()?;
        }
        match self.wait_timeout(QUIT_TIMEOUT) {
            Some(_) => Ok(()),
            None => Err(VmError::Timeout {
                what: format!("QEMU {} to exit after quit", self.pid()),
                after_ms: ms(QUIT_TIMEOUT),
            }),
        }
    }

    /// Pause: capture into `dir` with the disk in place, then quit (QEMU exits while the
    /// state file is fsync'd). On an error before the state was written the VM is left
    /// stopped (QEMU running): the caller may resume it or kill it.
    ///
    /// A VM whose RAM is a template's file mapped copy-on-write saves only the device state
    /// and the pages changed since the template ([`super::dirty`]).
    pub fn pause(&mut self, dir: &Path) -> Result<(CaptureRecord, CaptureStats), VmError> {
        self.pause_then(dir, true)
            .map(|(record, stats, _)| (record, stats))
    }

    /// [`Vm::pause`], but a dirty-only pause leaves QEMU running with its vCPUs stopped
    /// (its disk active and flushed, its RAM and translated code in place), so the same
    /// process can run on later ([`Vm::move_onto_layer`], [`Vm::resume_vcpus`]); the
    /// capture is whole either way. Returns whether QEMU was kept; a full capture always
    /// quits (its migration leaves the disk inactive).
    pub fn pause_keeping(
        &mut self,
        dir: &Path,
    ) -> Result<(CaptureRecord, CaptureStats, bool), VmError> {
        self.pause_then(dir, false)
    }

    fn pause_then(
        &mut self,
        dir: &Path,
        quit: bool,
    ) -> Result<(CaptureRecord, CaptureStats, bool), VmError> {
        if self.can_pause_dirty() {
            match self.link_base() {
                Ok(base) => {
                    return self
                        .pause_dirty(dir, base, quit)
                        .map(|(record, stats)| (record, stats, !quit))
                }
                Err(e) => log::warn!(
                    "vm op=pause pid={} dirty=false reason=\"cannot link the template's files: {e}\"",
                    self.pid()
                ),
            }
        }
        let started = Instant::now();
        let (record, mut stats) = self.capture_then(dir, DiskCapture::InPlace, true)?;
        stats.total_ms = ms(started.elapsed());
        Ok((record, stats, false))
    }

    /// On a VM kept by [`Vm::pause_keeping`] (vCPUs stopped): its writes go to `next`, a
    /// new empty layer over its disk, which is left as the pause captured it.
    pub fn move_onto_layer(&mut self, next: &Path) -> Result<(), VmError> {
        self.freeze_onto(next, "move_onto_layer")
    }

    /// With the vCPUs stopped: the guest's writes go to the new empty layer `next`, and
    /// QEMU loses write access to the layer under it (logged for `op` when it cannot).
    fn freeze_onto(&mut self, next: &Path, op: &str) -> Result<(), VmError> {
        let frozen = self.disk_node().to_string();
        let under = self.facts.disk_backing.clone();
        self.switch_disk(next)?;
        if let Err(e) = self.revoke_frozen_writes(&frozen, under) {
            log::warn!(
                "vm op={op} pid={} node={frozen} revoke_writes_error={e}",
                self.pid()
            );
        }
        Ok(())
    }

    /// A filesystem-only pause: the vCPUs stop, QEMU quits (flushing and closing the disk),
    /// and the record names the disk chain where it is, with no state file and no RAM.
    /// The guest's own writes must have been synced first (the agent's `sync`): what its
    /// page cache held is lost with its memory. On an error before QEMU quit the VM is left
    /// stopped: the caller may resume it or kill it.
    pub fn pause_to_disk(&mut self) -> Result<CaptureRecord, VmError> {
        let started = Instant::now();
        let chain = disk_chain(&self.facts.disk)?;
        self.qmp().stop()?;
        self.quit()?;
        let mut record = self.record(PathBuf::new(), 0, &chain, chain.layers.clone(), false);
        record.filesystem_only = true;
        log::info!(
            "vm op=pause_to_disk pid={} disk={} ms={}",
            self.pid(),
            record.disk.display(),
            ms(started.elapsed())
        );
        Ok(record)
    }

    /// Cold-boots the disk of a filesystem-only `record` onto `spec.disk` (a new top
    /// layer over it) with the kernel, initramfs and command line it first booted with;
    /// the vCPUs are held until [`Vm::resume_vcpus`], as after a restore.
    pub fn boot_from_disk(record: &CaptureRecord, spec: RestoreSpec) -> Result<Vm, VmError> {
        if !record.filesystem_only {
            return Err(VmError::InvalidSpec(
                "only a filesystem-only capture boots from its disk".into(),
            ));
        }
        check_restorable(record, &spec)?;
        let launch = Launch {
            cmdline: Some(&record.kernel_cmdline),
            memory: None,
            incoming: Incoming::Held,
        };
        Vm::start(vm_spec(record, spec), launch)
    }

    /// Restores `record` into a new QEMU process and returns once the state is loaded: the
    /// VM is `paused`, its vCPUs have not run. Call [`Vm::resume_vcpus`] to start it.
    /// Call on the thread that will supervise the VM (see [`Vm::spawn`]).
    pub fn restore(
        record: &CaptureRecord,
        spec: RestoreSpec,
    ) -> Result<(Vm, RestoreStats), VmError> {
        let started = Instant::now();
        check_restorable(record, &spec)?;
        let memory = restore_memory(record);
        let launch = Launch {
            cmdline: Some(&record.kernel_cmdline),
            memory: memory.as_ref(),
            incoming: Incoming::Defer,
        };
        let mut vm = Vm::start(vm_spec(record, spec), launch)?;
        let spawn_ms = ms(started.elapsed());
        vm.load_incoming(record)?;
        let stats = RestoreStats {
            spawn_ms,
            load_ms: ms(started.elapsed()) - spawn_ms,
            total_ms: ms(started.elapsed()),
        };
        log::info!(
            "vm op=restore pid={} state={} disk={} spawnMs={} loadMs={}",
            vm.pid(),
            record.state_file.display(),
            vm.disk().display(),
            stats.spawn_ms,
            stats.load_ms
        );
        Ok((vm, stats))
    }

    /// Starts QEMU shaped for `record` but waiting for its state (`-incoming defer`): the
    /// expensive part of a restore (process start, kernel and initramfs load, device
    /// setup) done ahead of time. QEMU opens the tap at start, so `spec.netns` must be the
    /// namespace the clone will live in. Follow with [`Vm::load_incoming`].
    pub fn spawn_standby(record: &CaptureRecord, spec: RestoreSpec) -> Result<Vm, VmError> {
        check_restorable(record, &spec)?;
        let memory = restore_memory(record);
        let launch = Launch {
            cmdline: Some(&record.kernel_cmdline),
            memory: memory.as_ref(),
            incoming: Incoming::Defer,
        };
        Vm::start(vm_spec(record, spec), launch)
    }

    /// On a [`Vm::spawn_standby`] VM: loads `record`'s state and returns once it is
    /// `paused` (vCPUs not run yet).
    pub fn load_incoming(&mut self, record: &CaptureRecord) -> Result<u64, VmError> {
        let started = Instant::now();
        if let Some(dirty) = &record.dirty {
            self.load_dirty(record, dirty)?;
            return Ok(ms(started.elapsed()));
        }
        self.qmp().migrate_set_capabilities(MIGRATION_CAPS)?;
        self.qmp().migrate_incoming_file(&record.state_file)?;
        self.qmp().wait_status("paused", RESTORE_TIMEOUT)?;
        // A clone of a template: its pause may save only what changed since this state.
        if record.memory_file.is_some() {
            self.facts.base_state = Some(record.state_file.clone());
        }
        Ok(ms(started.elapsed()))
    }

    /// Merges the disk chain into the top layer (QEMU `block-stream` down to the raw base,
    /// while the guest runs) and waits for it, then deletes the sandbox's now unused layer
    /// files (snapshots keep their own links). Bounds the chain a sandbox accumulates over
    /// many snapshots: call it when [`Vm::disk_chain_depth`] exceeds
    /// [`MAX_CHAIN_LAYERS`].
    pub fn flatten_disk(&mut self, timeout: Duration) -> Result<(), VmError> {
        let chain = disk_chain(&self.facts.disk)?;
        if chain.layers.len() <= 1 {
            return Ok(());
        }
        let mut args = serde_json::json!({ "job-id": "flatten", "device": self.disk_node() });
        if chain.base.is_some() {
            // QEMU knows the base only as a descriptor: the top keeps the bottom layer's
            // backing name, not "/dev/fdset/N".
            let bottom = disk::read_qcow2_header(&chain.layers[0])?;
            args["base-node"] = super::qemu::BASE_NODE.into();
            args["backing-file"] = bottom.and_then(|h| h.backing).unwrap_or_default().into();
        }
        self.qmp().execute("block-stream", Some(args))?;
        let started = Instant::now();
        loop {
            let jobs = self.qmp().execute("query-block-jobs", None)?;
            let running = jobs
                .as_array()
                .is_some_and(|jobs| jobs.iter().any(|j| j["device"] == "flatten"));
            if !running {
                break;
            }
            if started.elapsed() >= timeout {
                return Err(VmError::Timeout {
                    what: "the disk chain to be merged".into(),
                    after_ms: ms(timeout),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let after = disk_chain(&self.facts.disk)?;
        if after.layers.len() != 1 {
            return Err(VmError::Qmp {
                command: "block-stream".into(),
                message: format!(
                    "the chain still has {} layers after the merge",
                    after.layers.len()
                ),
            });
        }
        // The top now sits on the base (or on nothing).
        self.facts.disk_backing = chain.base.is_some().then(|| super::qemu::BASE_NODE.into());
        for old in chain.layers.iter().filter(|l| **l != self.facts.disk) {
            if let Err(e) = std::fs::remove_file(old) {
                log::warn!("vm op=flatten_disk path={} error={e}", old.display());
            }
        }
        Ok(())
    }

    /// How many qcow2 layers the VM's disk chain has.
    pub fn disk_chain_depth(&self) -> Result<usize, VmError> {
        Ok(disk_chain(&self.facts.disk)?.layers.len())
    }

    /// Takes write access to the layer node `frozen` (whose backing is `under`) from
    /// QEMU, after a disk switch put a new top over it: a QEMU taken over later could
    /// otherwise write the frozen layer, which snapshots, templates and clones share.
    ///
    /// `blockdev-snapshot` makes the frozen qcow2 node read-only but leaves its file node
    /// read-write (its read-only option was given explicitly), on the read-write
    /// descriptor it was opened with, and records that descriptor's mode as read-only
    /// (QEMU 10.0), so a plain reopen read-only keeps it. The file node is therefore
    /// reopened read-write (QEMU takes a fresh read-write descriptor from the node's fd
    /// set), then read-only (a read-only one; the read-write one is closed), both with
    /// `blockdev-reopen`; then the read-write descriptor leaves the set (`remove-fd`).
    /// QEMU numbers its descriptors itself: their modes are read from
    /// `/proc/<pid>/fdinfo`. Returns how many set descriptors were closed.
    fn revoke_frozen_writes(
        &mut self,
        frozen: &str,
        under: Option<String>,
    ) -> Result<usize, VmError> {
        let pid = self.pid();
        let sets = self.qmp().query_fdsets()?;
        let set = sets
            .iter()
            .find(|s| s.fds.iter().any(|f| f.opaque == frozen))
            .ok_or_else(|| VmError::Qmp {
                command: "query-fdsets".into(),
                message: format!("no fd set for node {frozen}"),
            })?;
        let mut writable = Vec::new();
        for fd in &set.fds {
            if descriptor_writable(pid, fd.fd)? {
                writable.push(fd.fd);
            }
        }
        if writable.len() == set.fds.len() {
            return Err(VmError::InvalidSpec(format!(
                "fd set {} of node {frozen} has no read-only descriptor",
                set.id
            )));
        }
        let backing = under.map_or(serde_json::Value::Null, serde_json::Value::String);
        for file_writable in [true, false] {
            let mut node = super::qemu::qcow2_node(frozen, set.id, false, Some(backing.clone()));
            node["file"]["read-only"] = (!file_writable).into();
            self.qmp().execute(
                "blockdev-reopen",
                Some(serde_json::json!({ "options": [node] })),
            )?;
        }
        for fd in &writable {
            self.qmp().remove_fd_from(set.id, *fd)?;
        }
        Ok(writable.len())
    }
}

/// Creates the capture dir `dir` (private: it will hold the guest's RAM and device state)
/// and removes what an earlier capture left there; returns the paths of the state file
/// and of its partial copy.
fn prepare_capture_dir(dir: &Path) -> Result<(PathBuf, PathBuf), VmError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| VmError::io(format!("cannot create capture dir {}", dir.display()), e))?;
    let state = dir.join(STATE_FILE);
    let partial = dir.join(format!("{STATE_FILE}{PARTIAL_SUFFIX}"));
    // A dirty-only capture's pages file too: this capture does not use it.
    let pages = dir.join(super::dirty::PAGES_FILE);
    for stale in [&state, &partial, &pages] {
        match std::fs::remove_file(stale) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(VmError::io(
                    format!("cannot remove old {}", stale.display()),
                    e,
                ))
            }
        }
    }
    Ok((state, partial))
}

/// Whether descriptor `fd` of process `pid` was opened for writing (its `fdinfo` flags).
fn descriptor_writable(pid: u32, fd: u64) -> Result<bool, VmError> {
    let path = format!("/proc/{pid}/fdinfo/{fd}");
    let info = std::fs::read_to_string(&path)
        .map_err(|e| VmError::io(format!("cannot read {path}"), e))?;
    fdinfo_writable(&info).ok_or_else(|| VmError::InvalidSpec(format!("no flags in {path}")))
}

/// The access mode in an `fdinfo` text (`flags:` is octal): whether it allows writes.
fn fdinfo_writable(info: &str) -> Option<bool> {
    let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
    let flags = i32::from_str_radix(flags.trim(), 8).ok()?;
    Some(flags & libc::O_ACCMODE != libc::O_RDONLY)
}

/// Whether a sandbox's chain should be merged ([`Vm::flatten_disk`]) after a capture.
pub fn chain_too_deep(chain: &DiskChain) -> bool {
    chain.layers.len() > MAX_CHAIN_LAYERS
}

fn check_restorable(record: &CaptureRecord, spec: &RestoreSpec) -> Result<(), VmError> {
    let dirty_ok = record.dirty.is_some() && record.memory_file.is_some();
    match record.format {
        CAPTURE_FORMAT if record.dirty.is_none() => {}
        DIRTY_FORMAT if dirty_ok => {}
        format => {
            return Err(VmError::InvalidSpec(format!(
                "capture format {format} is not supported here (this build reads \
                 {CAPTURE_FORMAT}, and {DIRTY_FORMAT} with a template's RAM file and pages)"
            )))
        }
    }
    if record.accel != spec.host.accel.name() {
        return Err(VmError::InvalidSpec(format!(
            "the capture was made under {} and cannot be restored under {}",
            record.accel,
            spec.host.accel.name()
        )));
    }
    if record.nic != spec.host.tap.is_some() {
        return Err(VmError::InvalidSpec(format!(
            "the captured VM {} a NIC; the restore must match (tap)",
            if record.nic { "had" } else { "had no" }
        )));
    }
    let mut files = record.capture_files();
    files.push(("guest kernel", &record.machine.kernel));
    files.push(("initramfs", &record.machine.initramfs));
    for (what, path) in files {
        if !path.is_file() {
            return Err(VmError::MissingAsset {
                what,
                path: path.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// Restored VMs map a captured RAM file privately: clones share its page cache and never
/// write to it.
fn restore_memory(record: &CaptureRecord) -> Option<MemoryFile> {
    record.memory_file.as_ref().map(|path| MemoryFile {
        path: path.clone(),
        shared: false,
    })
}

fn vm_spec(record: &CaptureRecord, spec: RestoreSpec) -> VmSpec {
    VmSpec {
        machine: record.machine.clone(),
        kernel_args: Vec::new(),
        disk: spec.disk,
        host: spec.host,
    }
}

/// After a restore: sets the guest's wall clock to the host's (it stood still while the
/// VM was saved). Call once the vCPUs run and the agent answers.
pub fn sync_guest_clock(agent: &AgentClient) -> Result<(), AgentError> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_err(|_| AgentError::Protocol("host clock is before 1970".into()))?;
    agent.set_time(now.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_flags_give_the_access_mode() {
        let info = |flags: &str| format!("pos:\t0\nflags:\t{flags}\nmnt_id:\t21\nino:\t5\n");
        assert_eq!(fdinfo_writable(&info("0100000")), Some(false));
        assert_eq!(fdinfo_writable(&info("02100002")), Some(true));
        assert_eq!(fdinfo_writable(&info("0100001")), Some(true));
        assert_eq!(fdinfo_writable("pos:\t0\n"), None);
        // Our own descriptors, as the kernel reports them.
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        assert!(!descriptor_writable(std::process::id(), fd as u64).unwrap());
        let file = tempfile_rw();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        assert!(descriptor_writable(std::process::id(), fd as u64).unwrap());
    }

    fn tempfile_rw() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("aenv-fdinfo-{}", crate::util::new_id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }

    #[test]
    fn record_round_trips_as_json() {
        let record = CaptureRecord {
            format: CAPTURE_FORMAT,
            captured_at_unix_ms: 1,
            machine: MachineConfig {
                kernel: "/a/vmlinux".into(),
                initramfs: "/a/initramfs.img".into(),
                cpu_count: 1,
                memory_mb: 256,
            },
            kernel_cmdline: "console=ttyS0 x=1".into(),
            accel: "tcg".into(),
            nic: true,
            state_file: "/s/state.bin".into(),
            state_bytes: 10,
            memory_file: None,
            disk: "/s/disk-1.qcow2".into(),
            disk_layers: vec!["/s/disk.qcow2".into(), "/s/disk-1.qcow2".into()],
            disk_base: Some("/img/base.ext4".into()),
            disk_virtual_bytes: 1 << 30,
            disk_allocated_bytes: 4096,
            disk_frozen: true,
            dirty: None,
            filesystem_only: false,
        };
        let json = serde_json::to_string(&record).unwrap();
        assert!(
            json.contains("\"kernelCmdline\":\"console=ttyS0 x=1\""),
            "{json}"
        );
        // The machine is stored flat, as records written before it had a type.
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["cpuCount"], 1, "{json}");
        assert_eq!(value["memoryMb"], 256, "{json}");
        assert_eq!(value["kernel"], "/a/vmlinux", "{json}");
        assert!(value.get("machine").is_none(), "{json}");
        let back: CaptureRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, record);

        // Format 2 needs its pages and the template's RAM file, format 1 must not have
        // pages: anything else is refused before any file is looked at.
        let spec = RestoreSpec {
            host: HostPlumbing {
                run_dir: "/r".into(),
                netns: None,
                tap: Some("tap0".into()),
                accel: crate::vm::Accel::Tcg { tsc_khz: 1 },
                qemu_binary: "qemu-system-x86_64".into(),
            },
            disk: "/s/disk-1.qcow2".into(),
        };
        let dirty = DirtyMemory {
            base_state: "/s/template-state.bin".into(),
            pages_file: "/s/paused/memory.pages".into(),
            pages: 1,
        };
        for (format, dirty, memory) in [
            (DIRTY_FORMAT, None, Some("/s/memory.ram")),
            (DIRTY_FORMAT, Some(dirty.clone()), None),
            (CAPTURE_FORMAT, Some(dirty), Some("/s/memory.ram")),
            (3, None, None),
        ] {
            let bad = CaptureRecord {
                format,
                dirty,
                memory_file: memory.map(PathBuf::from),
                ..record.clone()
            };
            let e = check_restorable(&bad, &spec).unwrap_err();
            assert!(e.to_string().contains("capture format"), "{e}");
        }
    }
}
