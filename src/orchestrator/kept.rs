//! Kept paused VMs: a dirty-only pause of a template's clone writes its whole capture as
//! always, but leaves QEMU running with its vCPUs stopped, its NIC's carrier down and its
//! slot held, so a resume of that sandbox runs in the same process: no QEMU start, no
//! state load and, under TCG, none of the first translation of the guest's code that a
//! new process pays for on its first command.
//!
//! A kept VM is the paused sandbox's, never another's. Its pause is complete (record
//! committed, stop hook sent, its instance closed) before it is kept; its resume takes
//! the one start sequence with start-resume ([`super::start`]), onto a new top layer like
//! any resume, and only a success runs its vCPUs, sets its clock and puts its carrier
//! up. Whatever goes wrong with a kept VM, the capture on disk is the paused sandbox, and
//! the resume restores it into a new QEMU.
//!
//! Bounds (`[sandbox] keep_paused_*`): a count, the memory (PSS) they hold together and
//! an age; the oldest goes first. A start that admission or the slots refuse takes one
//! back first ([`KeptPool::evict_one`]), a delete of the paused sandbox and the server's
//! shutdown discard them (VM killed, slot released, admission share given back).
//!
//! Threads: QEMU dies with the thread that started it (`PR_SET_PDEATHSIG`). The
//! supervisor thread that started a VM which is then kept waits, holding nothing, until
//! the VM is gone ([`ParentGuard`]); later supervisors of the same VM pass the guard on.

use super::admission::Reservation;
use super::sides::{Machine, Network};
use crate::net::Slot;
use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Held with a VM whose parent thread waits for it: dropping it (after the VM was
/// killed) lets that thread end.
pub(crate) struct ParentGuard(#[allow(dead_code)] Sender<()>);

/// A guard, and what the parent thread waits on ([`wait_for_child`]).
pub(crate) fn parent_guard() -> (ParentGuard, Receiver<()>) {
    let (tx, rx) = crossbeam_channel::bounded(0);
    (ParentGuard(tx), rx)
}

/// Blocks the calling thread until every guard of `rx` is dropped.
pub(crate) fn wait_for_child(rx: Receiver<()>) {
    while rx.recv().is_ok() {}
}

/// A paused sandbox's stopped VM and what it holds. Fields drop in order: the VM goes
/// before its parent thread may end.
pub(crate) struct KeptVm {
    pub vm: Box<dyn Machine>,
    pub slot: Slot,
    pub reservation: Reservation,
    pub parent: Option<ParentGuard>,
}

/// `[sandbox] keep_paused_vms`, `keep_paused_memory_mb`, `keep_paused_secs`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeptLimits {
    pub max_vms: usize,
    pub memory_kib: u64,
    pub max_age: Duration,
}

impl KeptLimits {
    pub fn from_config(c: &crate::config::SandboxConfig) -> KeptLimits {
        KeptLimits {
            max_vms: c.keep_paused_vms as usize,
            memory_kib: c.keep_paused_memory_mb << 10,
            max_age: Duration::from_secs(c.keep_paused_secs),
        }
    }
}

struct Entry {
    kept: KeptVm,
    since: Instant,
    held_kib: u64,
}

/// The kept VMs by sandbox id.
pub(crate) struct KeptPool {
    limits: KeptLimits,
    net: Arc<dyn Network>,
    vms: Mutex<HashMap<String, Entry>>,
    /// Set by [`KeptPool::drain`]: nothing is kept any more.
    closed: AtomicBool,
    resumed_kept: AtomicU64,
    resumed_cold: AtomicU64,
}

impl KeptPool {
    pub fn new(limits: KeptLimits, net: Arc<dyn Network>) -> KeptPool {
        KeptPool {
            limits,
            net,
            vms: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            resumed_kept: AtomicU64::new(0),
            resumed_cold: AtomicU64::new(0),
        }
    }

    /// Whether a pause should try to keep its VM.
    pub fn enabled(&self) -> bool {
        self.limits.max_vms > 0 && !self.closed.load(Ordering::SeqCst)
    }

    /// Keeps sandbox `id`'s stopped VM, which holds `held_kib`; the oldest go while the
    /// bounds are exceeded (this one too, when it alone exceeds the memory).
    pub fn park(&self, id: &str, kept: KeptVm, held_kib: u64) {
        if !self.enabled() {
            self.discard_vm(id, kept, "closed");
            return;
        }
        let entry = Entry {
            kept,
            since: Instant::now(),
            held_kib,
        };
        let evicted = {
            let mut vms = self.vms.lock();
            let old = vms.insert(id.to_string(), entry);
            let mut out: Vec<(String, KeptVm)> =
                old.map(|e| (id.to_string(), e.kept)).into_iter().collect();
            while vms.len() > self.limits.max_vms
                || vms.values().map(|e| e.held_kib).sum::<u64>() > self.limits.memory_kib
            {
                let Some(oldest) = oldest(&vms) else { break };
                let e = vms.remove(&oldest).expect("present");
                out.push((oldest, e.kept));
            }
            out
        };
        for (victim, kept) in evicted {
            self.discard_vm(&victim, kept, "over_budget");
        }
        log::info!("sandboxId={id} op=keep_paused result=kept heldKib={held_kib}");
    }

    /// Takes sandbox `id`'s kept VM for its resume; a VM that died meanwhile is discarded.
    /// Counts the resume as kept or cold.
    pub fn take(&self, id: &str) -> Option<KeptVm> {
        let taken = self.vms.lock().remove(id).map(|e| e.kept);
        let alive = match taken {
            Some(mut kept) => match kept.vm.exited() {
                None => Some(kept),
                Some(exit) => {
                    self.discard_vm(id, kept, &format!("died ({exit})"));
                    None
                }
            },
            None => None,
        };
        let counter = match alive {
            Some(_) => &self.resumed_kept,
            None => &self.resumed_cold,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        alive
    }

    /// Let go of sandbox `id`'s kept VM, if it has one.
    pub fn discard(&self, id: &str, why: &str) {
        let taken = self.vms.lock().remove(id);
        if let Some(e) = taken {
            self.discard_vm(id, e.kept, why);
        }
    }

    /// Let go of the oldest kept VM, for a start that found no room. False: none kept.
    pub fn evict_one(&self) -> bool {
        let taken = {
            let mut vms = self.vms.lock();
            oldest(&vms).and_then(|id| vms.remove(&id).map(|e| (id, e.kept)))
        };
        match taken {
            Some((id, kept)) => {
                self.discard_vm(&id, kept, "room_for_a_start");
                true
            }
            None => false,
        }
    }

    /// Let go of the VMs kept longer than `keep_paused_secs`.
    pub fn sweep(&self) {
        let expired: Vec<(String, KeptVm)> = {
            let mut vms = self.vms.lock();
            let old: Vec<String> = vms
                .iter()
                .filter(|(_, e)| e.since.elapsed() >= self.limits.max_age)
                .map(|(id, _)| id.clone())
                .collect();
            old.into_iter()
                .filter_map(|id| vms.remove(&id).map(|e| (id, e.kept)))
                .collect()
        };
        for (id, kept) in expired {
            self.discard_vm(&id, kept, "expired");
        }
    }

    /// Server shutdown: every kept VM goes, and none is kept from now on.
    pub fn drain(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let all: Vec<(String, Entry)> = self.vms.lock().drain().collect();
        for (id, e) in all {
            self.discard_vm(&id, e.kept, "shutdown");
        }
    }

    /// How many VMs are kept, and the memory they hold (KiB).
    pub fn held(&self) -> (usize, u64) {
        let vms = self.vms.lock();
        (vms.len(), vms.values().map(|e| e.held_kib).sum())
    }

    /// A VM taken out of the pool that is not used after all.
    pub fn let_go(&self, id: &str, kept: KeptVm, why: &str) {
        self.discard_vm(id, kept, why);
    }

    /// VM killed, slot released, share given back, parent thread let go.
    fn discard_vm(&self, id: &str, kept: KeptVm, why: &str) {
        let KeptVm {
            vm,
            slot,
            reservation,
            parent,
        } = kept;
        vm.kill();
        self.net.release(slot);
        drop(reservation);
        drop(parent);
        log::info!("sandboxId={id} op=keep_paused result=discarded reason={why}");
    }

    /// `agentenv_kept_paused_vms`, `agentenv_kept_paused_memory_bytes` and
    /// `agentenv_kept_paused_resumes_total{kept}`.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let (count, kib) = self.held();
        super::metrics::render_gauge(
            out,
            "agentenv_kept_paused_vms",
            "Paused sandboxes whose stopped QEMU is kept for their resume.",
            count,
        );
        super::metrics::render_gauge(
            out,
            "agentenv_kept_paused_memory_bytes",
            "Memory the kept paused VMs hold (their QEMUs' PSS when kept).",
            kib << 10,
        );
        out.push_str(
            "# HELP agentenv_kept_paused_resumes_total Resumes of fully paused sandboxes, by whether their VM was kept.\n\
             # TYPE agentenv_kept_paused_resumes_total counter\n",
        );
        for (kept, n) in [("true", &self.resumed_kept), ("false", &self.resumed_cold)] {
            let _ = writeln!(
                out,
                "agentenv_kept_paused_resumes_total{{kept=\"{kept}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

fn oldest(vms: &HashMap<String, Entry>) -> Option<String> {
    vms.iter()
        .min_by_key(|(_, e)| e.since)
        .map(|(id, _)| id.clone())
}
