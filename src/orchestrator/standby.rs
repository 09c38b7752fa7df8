//! The standby pool: warm VMs of templates built with `POST /templates`, made ahead of
//! `POST /sandboxes`, so that a create skips QEMU's start and the state load, and its
//! first command skips QEMU's first translation of the code it runs.
//!
//! A standby is a sandbox-to-be: an id chosen in advance (its run dir is
//! `<state_dir>/sandboxes/<id>`, so nothing is renamed when it is claimed), a disk overlay
//! over the template's frozen layers, a network slot, the template's admission share
//! ([`Reservation`]) and QEMU started with `-incoming defer` in that slot, mapping the
//! template's RAM file; then warmed up with its NIC's carrier down ([`super::warmup`]) and
//! left with its vCPUs stopped and its agent connected. No frame leaves or reaches its
//! guest until the claiming create's start-resume succeeded: the claim goes through the
//! one start sequence ([`super::start`]), which runs the vCPUs, sets the clock and puts
//! the carrier up only after the hook (custom-extension.md §3.2).
//!
//! Threads: one worker thread per pool makes standbys (one at a time), replaces dead
//! ones and discards those of deleted templates. It is the parent thread of every
//! standby QEMU (their `PR_SET_PDEATHSIG` is tied to it), so it lives as long as the
//! pool, which lives as long as the server's [`Launcher`]. A claim takes a standby out of
//! the pool on the API thread; from then on the sandbox's supervisor thread owns it like
//! any VM it started.
//!
//! Sizing follows demand ([`PoolSizing`]): for each built template that was built or
//! created from since the server started, a target of 1, one more each time a create
//! finds none left, up to `standby_per_template` (or the template's own cap), one less per
//! idle period; refills stop at the memory budget (0 disables the pool). A standby holds
//! the admission share of the sandbox it will become, so a claim never overcommits; a
//! start that admission refuses takes the share back from a standby first
//! ([`StandbyPool::evict_one`]), so the pool never makes a start fail, and refills pause
//! for [`REFILL_PAUSE_AFTER_EVICTION`].
//!
//! Nothing leaks: a standby that fails to start is undone on the spot; a dead one is
//! found within [`WATCH_INTERVAL`] and replaced, and never handed out (a claim checks its
//! process first); a template delete and server shutdown discard every standby of it
//! (VM killed, slot released, run dir removed, share given back) and wait for the worker
//! to finish the one it may be making. Run dirs of standbys a crashed server left behind
//! have no record and are removed at the next start like any unfinished create.

use super::admission::Reservation;
use super::metrics::VmDeaths;
use super::settings::Resources;
use super::sides::{Machine, Network};
use super::start::Launcher;
use super::supervisor::RunDir;
use super::OrchError;
use crate::agent::AgentClient;
use crate::net::Slot;
use crate::vm::{CaptureRecord, RestoreSpec, VmError, VmExit};
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How often the worker checks that its standbys still run.
pub(crate) const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// No refills for this long after a start took a standby's admission share.
pub(crate) const REFILL_PAUSE_AFTER_EVICTION: Duration = Duration::from_secs(10);
/// Wait before retrying a template whose standby could not be admitted.
const RETRY_WHEN_FULL: Duration = Duration::from_secs(2);
/// Wait before retrying a template whose standby failed to start.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(30);
/// Longest wait for the worker to finish the standby it is making.
const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes a clone's disk in a run dir: the top layer over the capture's frozen layers
/// (a seam: unit tests write a file instead).
pub(crate) type CloneDisk = fn(&CaptureRecord, &Path) -> Result<PathBuf, VmError>;

fn clone_disk(record: &CaptureRecord, dir: &Path) -> Result<PathBuf, VmError> {
    crate::vm::create_clone_disk(&record.disk_layers, dir)
}

/// A VM ready to run whose vCPUs are stopped and whose carrier is down: a warmed-up
/// standby with its open agent connection, or a kept paused VM ([`super::kept`]), whose
/// agent is connected anew and whose parent thread waits for it (`parent`). Fields drop
/// in order: the VM goes before its parent thread may end.
pub(crate) struct WarmVm {
    pub vm: Box<dyn Machine>,
    pub agent: Option<AgentClient>,
    pub parent: Option<super::kept::ParentGuard>,
}

/// What a claimed standby brings into the start sequence: the warm VM, the slot it runs
/// in, and the admission share it held.
pub(crate) struct Prepared {
    pub warm: WarmVm,
    pub slot: Slot,
    pub reservation: Reservation,
}

/// A standby taken for a create: the new sandbox's id, run dir and disk.
pub(crate) struct Claimed {
    pub id: String,
    pub run_dir: RunDir,
    pub disk: PathBuf,
    pub prepared: Prepared,
}

/// One waiting standby.
struct Standby {
    template: String,
    claimed: Claimed,
    /// Its QEMU's PSS once warm (KiB): what it holds of the pool's memory budget.
    held_kib: u64,
}

impl Standby {
    /// VM killed, then the slot released; the run dir and the share go with it.
    fn discard(self, net: &dyn Network, why: &str) {
        let Claimed {
            id,
            run_dir,
            prepared,
            ..
        } = self.claimed;
        prepared.warm.vm.kill();
        net.release(prepared.slot);
        drop(run_dir);
        log::info!(
            "sandboxId={id} op=standby result=discarded templateId={} reason={why}",
            self.template
        );
    }
}

/// How big the pool may grow (`[templates]`, docs/configuration.md).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolSizing {
    /// Most standbys of one template (`standby_per_template`; a template's own setting
    /// overrides it); 0 turns the pool off.
    pub per_template: usize,
    /// Memory all standbys together may hold (`standby_memory_mb`, their QEMUs' PSS).
    pub memory_kib: u64,
    /// A template's target shrinks by one per this long without a create from it
    /// (`standby_idle_secs`).
    pub idle: Duration,
}

/// What a standby of a template not measured yet is expected to hold.
const FIRST_ESTIMATE_KIB: u64 = 64 << 10;

/// A template the pool keeps standbys for.
struct Wanted {
    record: CaptureRecord,
    resources: Resources,
    /// No new standby before this (admission full, or the last one failed).
    retry_at: Option<Instant>,
    /// Most standbys it may have.
    cap: usize,
    /// Standbys it should have now: 1 at first, one more each time a create finds none
    /// left, one less per idle period; within `0..=cap`.
    target: usize,
    /// The last create from it, or the last shrink.
    last_use: Instant,
    /// What its last standby held once warm (KiB).
    estimate_kib: u64,
}

impl Wanted {
    /// A new cap: the target stays within it, and is at least 1 unless the cap is 0.
    fn set_cap(&mut self, cap: usize) {
        self.cap = cap;
        self.target = self.target.min(cap).max(cap.min(1));
    }
}

#[derive(Default)]
struct PoolState {
    ready: Vec<Standby>,
    wanted: HashMap<String, Wanted>,
    /// Drained for shutdown: nothing is made or handed out any more.
    closed: bool,
    refill_after: Option<Instant>,
}

impl PoolState {
    fn count(&self, template: &str) -> usize {
        self.ready.iter().filter(|s| s.template == template).count()
    }

    fn held_kib(&self) -> u64 {
        self.ready.iter().map(|s| s.held_kib).sum()
    }

    /// A template below its target that may get a standby now, within the memory budget.
    fn deficit(&self, budget_kib: u64, now: Instant) -> Option<(String, CaptureRecord)> {
        if self.closed || self.refill_after.is_some_and(|t| now < t) {
            return None;
        }
        let held = self.held_kib();
        self.wanted
            .iter()
            .find(|(t, w)| {
                self.count(t) < w.target
                    && w.retry_at.is_none_or(|at| now >= at)
                    && held + w.estimate_kib <= budget_kib
            })
            .map(|(t, w)| (t.clone(), w.record.clone()))
    }

    /// A create from `template` came: one more standby when it found none left.
    fn used(&mut self, template: &str, now: Instant) {
        let left = self.count(template);
        if let Some(w) = self.wanted.get_mut(template) {
            w.last_use = now;
            if left == 0 {
                w.target = (w.target + 1).min(w.cap);
            }
        }
    }

    /// Targets of templates idle for `idle` drop by one (not below one); standbys above
    /// their target are taken out, newest first.
    fn shrink(&mut self, idle: Duration, now: Instant) -> Vec<Standby> {
        for w in self.wanted.values_mut() {
            if w.target > 1 && now.duration_since(w.last_use) >= idle {
                w.target -= 1;
                w.last_use = now;
            }
        }
        let mut taken = Vec::new();
        let targets: Vec<(String, usize)> = self
            .wanted
            .iter()
            .map(|(t, w)| (t.clone(), w.target))
            .collect();
        for (template, target) in targets {
            while self.count(&template) > target {
                let Some(i) = self.ready.iter().rposition(|s| s.template == template) else {
                    break;
                };
                taken.push(self.ready.remove(i));
            }
        }
        taken
    }
}

enum Event {
    /// Look for deficits now.
    Refill,
    /// Answered once the worker is between standbys.
    Sync(Sender<()>),
}

/// The pool (see the module doc). Lives in the [`Launcher`].
pub(crate) struct StandbyPool {
    sizing: PoolSizing,
    state: Mutex<PoolState>,
    worker: Mutex<Option<Sender<Event>>>,
    hits: AtomicU64,
    misses: AtomicU64,
    /// Standbys whose QEMU died count here (kind `standby`).
    deaths: Arc<VmDeaths>,
    pub clone_disk: CloneDisk,
}

impl StandbyPool {
    pub fn new(sizing: PoolSizing, deaths: Arc<VmDeaths>) -> StandbyPool {
        StandbyPool {
            deaths,
            sizing,
            state: Mutex::new(PoolState::default()),
            worker: Mutex::new(None),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            clone_disk,
        }
    }

    /// Starts the worker thread that makes standbys under `sandboxes_dir`. A pool of size
    /// 0 starts nothing.
    pub fn start(launcher: &Arc<Launcher>, sandboxes_dir: PathBuf) {
        let pool = &launcher.standby;
        if pool.sizing.per_template == 0 {
            return;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let weak = Arc::downgrade(launcher);
        let spawned = std::thread::Builder::new()
            .name("standby".into())
            .spawn(move || work(weak, &sandboxes_dir, rx));
        match spawned {
            Ok(_) => *pool.worker.lock() = Some(tx),
            Err(e) => log::warn!("op=standby error=\"cannot start the standby thread: {e}\""),
        }
    }

    fn notify(&self, event: Event) -> bool {
        self.worker
            .lock()
            .as_ref()
            .is_some_and(|w| w.send(event).is_ok())
    }

    /// Keeps standbys for the built template `template` from now on (idempotent), at
    /// most `cap` of them (`None`: `standby_per_template`). Templates whose RAM is in
    /// their state file are not pooled: loading it is most of their restore.
    pub fn want(
        &self,
        template: &str,
        record: &CaptureRecord,
        resources: Resources,
        cap: Option<u32>,
    ) {
        if self.sizing.per_template == 0 || record.memory_file.is_none() {
            return;
        }
        let cap = cap.map_or(self.sizing.per_template, |c| c as usize);
        {
            let mut state = self.state.lock();
            if state.closed {
                return;
            }
            if let Some(w) = state.wanted.get_mut(template) {
                w.set_cap(cap);
                return;
            }
            state.wanted.insert(
                template.to_string(),
                Wanted {
                    record: record.clone(),
                    resources,
                    retry_at: None,
                    cap,
                    target: cap.min(1),
                    last_use: Instant::now(),
                    estimate_kib: FIRST_ESTIMATE_KIB,
                },
            );
        }
        self.notify(Event::Refill);
    }

    /// The most standbys `template` may have from now on (`None`: the server's
    /// default); ones above it are discarded by the worker.
    pub fn set_cap(&self, template: &str, cap: Option<u32>) {
        let cap = cap.map_or(self.sizing.per_template, |c| c as usize);
        if let Some(w) = self.state.lock().wanted.get_mut(template) {
            w.set_cap(cap);
        }
        self.notify(Event::Refill);
    }

    /// A running standby of `template`, taken out of the pool; `None` when it has none.
    /// A standby whose QEMU has exited is discarded, never handed out.
    pub fn claim(&self, template: &str, net: &dyn Network) -> Option<Claimed> {
        loop {
            let taken = {
                let mut state = self.state.lock();
                if state.closed || !state.wanted.contains_key(template) {
                    return None;
                }
                let at = state.ready.iter().position(|s| s.template == template);
                let taken = at.map(|i| state.ready.swap_remove(i));
                state.used(template, Instant::now());
                taken
            };
            let Some(mut standby) = taken else {
                self.misses.fetch_add(1, Ordering::Relaxed);
                self.notify(Event::Refill);
                return None;
            };
            if let Some(status) = standby.claimed.prepared.warm.vm.exited() {
                self.deaths.record("standby", &status);
                standby.discard(net, &format!("\"exited: {status}\""));
                continue;
            }
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.notify(Event::Refill);
            return Some(standby.claimed);
        }
    }

    /// Discards one standby (of any template) so that a start can take its admission
    /// share; false when there is none. Refills pause for a while.
    pub fn evict_one(&self, net: &dyn Network) -> bool {
        let taken = {
            let mut state = self.state.lock();
            let taken = state.ready.pop();
            if taken.is_some() {
                state.refill_after = Some(Instant::now() + REFILL_PAUSE_AFTER_EVICTION);
            }
            taken
        };
        match taken {
            Some(standby) => {
                standby.discard(net, "admission");
                true
            }
            None => false,
        }
    }

    /// No more standbys for `template` (deleted): its standbys are discarded, and one
    /// being made is discarded before this returns.
    pub fn forget(&self, template: &str, net: &dyn Network) {
        let taken = {
            let mut state = self.state.lock();
            if state.wanted.remove(template).is_none() {
                return;
            }
            take_where(&mut state.ready, |s| s.template == template)
        };
        for standby in taken {
            standby.discard(net, "template_deleted");
        }
        self.sync();
    }

    /// Shutdown: every standby discarded, none made any more.
    pub fn drain(&self, net: &dyn Network) {
        let taken = {
            let mut state = self.state.lock();
            state.closed = true;
            state.wanted.clear();
            std::mem::take(&mut state.ready)
        };
        for standby in taken {
            standby.discard(net, "shutdown");
        }
        self.sync();
    }

    /// Waits (bounded) until the worker is between standbys: one it was making is
    /// discarded or kept by then.
    fn sync(&self) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self.notify(Event::Sync(tx)) && rx.recv_timeout(SYNC_TIMEOUT).is_err() {
            log::warn!("op=standby error=\"the standby thread did not answer\"");
        }
    }

    /// Standbys waiting now.
    /// What the pool means to a create from `template` now: whether a standby of it
    /// waits, and the shares all standbys hold (cluster placement asks).
    pub fn standing(&self, template: &str) -> super::admission::Standbys {
        let state = self.state.lock();
        let held = state.ready.iter().fold((0, 0), |(m, v), s| {
            let (sm, sv) = s.claimed.prepared.reservation.share();
            (m + sm, v + sv)
        });
        super::admission::Standbys {
            claims: state.count(template) > 0,
            held,
        }
    }

    #[cfg(test)]
    pub fn ready(&self) -> usize {
        self.state.lock().ready.len()
    }

    /// The standbys of `template` waiting now, and how many it should have.
    pub fn of(&self, template: &str) -> (usize, usize) {
        let state = self.state.lock();
        let target = state.wanted.get(template).map_or(0, |w| w.target);
        (state.count(template), target)
    }

    /// `agentenv_standby_vms`, `agentenv_standby_memory_bytes` and
    /// `agentenv_standby_claims_total`.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let (ready, wanted, held_kib) = {
            let state = self.state.lock();
            let wanted: usize = state.wanted.values().map(|w| w.target).sum();
            (state.ready.len(), wanted, state.held_kib())
        };
        super::metrics::render_state_gauge(
            out,
            "agentenv_standby_vms",
            "Warm standbys waiting for a create from a template (ready), and how many the pool aims for now (target).",
            &[("ready", ready), ("target", wanted)],
        );
        out.push_str(
            "# HELP agentenv_standby_memory_bytes Memory the waiting standbys hold (their QEMUs' PSS).
# TYPE agentenv_standby_memory_bytes gauge
",
        );
        let _ = writeln!(out, "agentenv_standby_memory_bytes {}", held_kib << 10);
        out.push_str(
            "# HELP agentenv_standby_claims_total Creates from a pooled template, by whether a standby was ready.\n",
        );
        out.push_str("# TYPE agentenv_standby_claims_total counter\n");
        for (result, n) in [("hit", &self.hits), ("miss", &self.misses)] {
            let _ = writeln!(
                out,
                "agentenv_standby_claims_total{{result=\"{result}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }

    /// Standbys whose QEMU exited, taken out of the pool.
    fn take_dead(&self) -> Vec<(Standby, VmExit)> {
        let mut state = self.state.lock();
        let mut dead = Vec::new();
        let mut i = 0;
        while i < state.ready.len() {
            match state.ready[i].claimed.prepared.warm.vm.exited() {
                Some(status) => dead.push((state.ready.swap_remove(i), status)),
                None => i += 1,
            }
        }
        dead
    }

    /// Keeps `standby` unless its template went meanwhile.
    fn keep(&self, standby: Standby, net: &dyn Network) {
        let rejected = {
            let mut state = self.state.lock();
            let closed = state.closed;
            match state.wanted.get_mut(&standby.template) {
                Some(w) if !closed => {
                    if standby.held_kib > 0 {
                        w.estimate_kib = standby.held_kib;
                    }
                    state.ready.push(standby);
                    None
                }
                _ => Some(standby),
            }
        };
        if let Some(standby) = rejected {
            standby.discard(net, "template_deleted");
        }
    }

    fn retry_later(&self, template: &str, after: Duration) {
        if let Some(w) = self.state.lock().wanted.get_mut(template) {
            w.retry_at = Some(Instant::now() + after);
        }
    }
}

fn take_where(v: &mut Vec<Standby>, f: impl Fn(&Standby) -> bool) -> Vec<Standby> {
    let (taken, kept) = std::mem::take(v).into_iter().partition(f);
    *v = kept;
    taken
}

/// The worker: makes one standby at a time while templates lack one, checks every
/// [`WATCH_INTERVAL`] that the waiting ones run. Ends when the pool is gone.
fn work(launcher: Weak<Launcher>, sandboxes_dir: &Path, events: Receiver<Event>) {
    let mut busy = false;
    loop {
        let wait = if busy { Duration::ZERO } else { WATCH_INTERVAL };
        let event = events.recv_timeout(wait);
        if matches!(event, Err(RecvTimeoutError::Disconnected)) {
            return;
        }
        let Some(launcher) = launcher.upgrade() else {
            return;
        };
        let pool = &launcher.standby;
        if let Ok(Event::Sync(reply)) = event {
            let _ = reply.send(());
        }
        for (standby, status) in pool.take_dead() {
            pool.deaths.record("standby", &status);
            log::warn!(
                "sandboxId={} op=standby result=exited status=\"{status}\"",
                standby.claimed.id
            );
            standby.discard(&*launcher.net, "exited");
        }
        let excess = pool.state.lock().shrink(pool.sizing.idle, Instant::now());
        for standby in excess {
            standby.discard(&*launcher.net, "idle");
        }
        let deficit = pool
            .state
            .lock()
            .deficit(pool.sizing.memory_kib, Instant::now());
        let Some((template, record)) = deficit else {
            busy = false;
            continue;
        };
        busy = true;
        let resources = match pool.state.lock().wanted.get(&template) {
            Some(w) => w.resources,
            None => continue,
        };
        let started = Instant::now();
        match make(&launcher, sandboxes_dir, &record, resources) {
            Ok(mut claimed) => {
                let held_kib = claimed.prepared.warm.vm.memory_kib().unwrap_or(0);
                log::info!(
                    "sandboxId={} op=standby result=ready templateId={template} ms={} pssKib={held_kib}",
                    claimed.id,
                    started.elapsed().as_millis()
                );
                let standby = Standby {
                    template,
                    claimed,
                    held_kib,
                };
                pool.keep(standby, &*launcher.net);
            }
            Err(OrchError::TooMany(why)) => {
                log::debug!("op=standby templateId={template} result=deferred reason=\"{why}\"");
                pool.retry_later(&template, RETRY_WHEN_FULL);
            }
            Err(e) => {
                log::warn!("op=standby templateId={template} result=error error=\"{e}\"");
                pool.retry_later(&template, RETRY_AFTER_FAILURE);
            }
        }
    }
}

/// One standby of the template `record`: admission share, run dir, disk, slot, QEMU
/// waiting for its state. On error everything made is undone.
fn make(
    launcher: &Launcher,
    sandboxes_dir: &Path,
    record: &CaptureRecord,
    resources: Resources,
) -> Result<Claimed, OrchError> {
    let reservation = launcher
        .admission
        .reserve(resources.memory_mb, resources.cpu_count)?;
    let id = crate::cluster::id::new_sandbox_id();
    let run_dir = RunDir::create(sandboxes_dir.join(&id))?;
    let disk = (launcher.standby.clone_disk)(record, run_dir.path())
        .map_err(|e| OrchError::vm("cloning the template's disk", e))?;
    let slot = launcher.net.acquire()?;
    let spec = slot.open_netns().map(|netns| RestoreSpec {
        disk: disk.clone(),
        host: launcher.plumbing(run_dir.path(), netns),
    });
    let vm = match spec {
        Ok(spec) => launcher
            .machines
            .standby(record, spec)
            .map_err(|e| OrchError::vm("starting a standby", e)),
        Err(e) => Err(OrchError::host(
            "cannot open the slot's network namespace",
            e,
        )),
    };
    let scratch = super::warmup::scratch_path(&id);
    let warm = vm.and_then(
        |mut vm| match vm.warm_up(record, launcher.warm_up, &scratch) {
            Ok(agent) => Ok(WarmVm {
                vm,
                agent: Some(agent),
                parent: None,
            }),
            Err(e) => {
                log::warn!(
                    "sandboxId={id} op=standby result=error console_tail=\n{}",
                    vm.console_tail(10)
                );
                vm.kill();
                Err(e.into())
            }
        },
    );
    match warm {
        Ok(warm) => Ok(Claimed {
            id,
            run_dir,
            disk,
            prepared: Prepared {
                warm,
                slot,
                reservation,
            },
        }),
        Err(e) => {
            launcher.net.release(slot);
            Err(e)
        }
    }
}
