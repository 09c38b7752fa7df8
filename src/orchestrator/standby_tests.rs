//! The standby pool against fake host sides: claim, refill, drain, dead standbys, and
//! every failure of a claimed start rolled back. No root, QEMU or extension needed.

use super::admission::{Admission, Headroom, Limits};
use super::failure_tests::{eventually, Rig};
use super::fakes::sides::FakeHostFacts;
use super::fakes::sides::Script;
use super::operations;
use super::standby::StandbyPool;
use super::{delete, shutdown_all, OrchError};
use crate::hooks::{HookError, StopReason};
use crate::vm::{CaptureRecord, VmError};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

const TEMPLATE: &str = "tpl-1";

/// A disk file instead of a qcow2 overlay.
fn fake_clone_disk(_: &CaptureRecord, dir: &Path) -> Result<PathBuf, VmError> {
    let disk = dir.join("disk-1.qcow2");
    std::fs::write(&disk, b"disk").map_err(|e| VmError::io("fake disk", e))?;
    Ok(disk)
}

/// A template whose RAM is a file (built with POST /templates).
fn template() -> CaptureRecord {
    let mut record = super::fakes::capture();
    record.memory_file = Some("/nowhere/memory.ram".into());
    record
}

/// A rig whose pool keeps one standby per template, its worker running.
/// At most `per_template` standbys per template, a roomy budget, no idle shrinking.
fn sizing(per_template: usize) -> super::standby::PoolSizing {
    super::standby::PoolSizing {
        per_template,
        memory_kib: 1 << 30,
        idle: Duration::from_secs(3600),
    }
}

fn pooled(limits: Limits) -> Rig {
    let rig = Rig::build(limits, |l| {
        l.standby = StandbyPool::new(sizing(1), l.deaths.clone());
        l.standby.clone_disk = fake_clone_disk;
    });
    StandbyPool::start(&rig.launcher, rig.state_dir.join("sandboxes"));
    rig
}

fn roomy() -> Limits {
    Limits {
        memory_mb: Some(4096),
        vcpus: Some(16),
    }
}

impl Rig {
    fn want(&self) {
        let resources = super::fakes::settings().resources;
        self.launcher
            .standby
            .want(TEMPLATE, &template(), resources, None);
    }

    fn wait_ready(&self, n: usize) {
        eventually(&format!("{n} standby ready"), || {
            self.launcher.standby.ready() == n
        });
    }

    /// A create from the template, claiming a standby.
    fn create_from_standby(&self) -> (String, Result<super::SandboxInfo, OrchError>) {
        let claimed = self
            .launcher
            .standby
            .claim(TEMPLATE, &*self.net)
            .expect("a standby is ready");
        let id = claimed.id.clone();
        let created = operations::clone_from_capture(
            &self.registry,
            &self.launcher,
            &template(),
            super::fakes::settings(),
            Some(claimed),
        );
        (id, created)
    }

    fn sandbox_dirs(&self) -> usize {
        std::fs::read_dir(self.state_dir.join("sandboxes")).map_or(0, |d| d.count())
    }
}

#[test]
fn a_create_claims_a_waiting_standby_and_the_pool_refills() {
    let rig = pooled(roomy());
    rig.want();
    rig.wait_ready(1);
    // A standby holds its sandbox's share and slot, and the extension knows nothing of it.
    assert_eq!(rig.admission.in_use(), (128, 1));
    assert_eq!(rig.net.slots.stats().in_use, 1);
    assert!(rig.hooks.calls().is_empty());
    let (id, created) = rig.create_from_standby();
    let info = created.unwrap();
    assert_eq!(info.id, id, "the sandbox has the standby's id");
    assert_eq!(rig.hooks.calls(), [format!("start-resume {id}")]);
    assert!(rig.registry.dir(&id).join("record.json").is_file());
    rig.wait_ready(1);
    assert_eq!(rig.vms.standbys.load(Ordering::SeqCst), 2, "refilled");
    assert_eq!(
        rig.vms.boots.load(Ordering::SeqCst),
        2,
        "the create started no VM of its own"
    );
    assert_eq!(rig.admission.in_use(), (256, 2));
    delete(&rig.registry, &id, StopReason::Delete).unwrap();
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    assert_eq!(rig.launcher.standby.ready(), 0);
    assert_eq!(rig.sandbox_dirs(), 0, "no run dir left");
    rig.assert_nothing_held();
}

#[test]
fn a_standby_whose_vm_died_is_never_handed_out_and_is_replaced() {
    let rig = pooled(roomy());
    rig.want();
    rig.wait_ready(1);
    rig.vms.died.store(true, Ordering::SeqCst);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    rig.vms.died.store(false, Ordering::SeqCst);
    rig.wait_ready(1);
    assert!(rig.vms.standbys.load(Ordering::SeqCst) >= 2, "replaced");
    assert_eq!(rig.vms.alive.load(Ordering::SeqCst), 1);
    assert_eq!(
        rig.net.slots.stats().in_use,
        1,
        "the dead one's slot is back"
    );
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    assert_eq!(rig.sandbox_dirs(), 0);
    assert!(rig.hooks.calls().is_empty(), "no hook for a standby");
    rig.assert_nothing_held();
}

#[test]
fn a_failed_start_resume_on_a_standby_rolls_it_all_back() {
    let rig = pooled(roomy());
    rig.want();
    rig.wait_ready(1);
    rig.hooks.fail_start.store(true, Ordering::SeqCst);
    let (id, created) = rig.create_from_standby();
    assert!(
        matches!(created, Err(OrchError::Hook(HookError::Failed { .. }))),
        "{created:?}"
    );
    assert_eq!(
        rig.hooks.calls(),
        [
            format!("start-resume {id}"),
            format!("stop {id} start-failed")
        ]
    );
    assert!(!rig.registry.dir(&id).exists(), "its run dir is removed");
    assert!(rig.registry.entry(&id).is_err());
    rig.wait_ready(1);
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    assert_eq!(rig.sandbox_dirs(), 0);
    rig.assert_nothing_held();
}

#[test]
fn a_standby_whose_warm_up_fails_is_rolled_back_and_never_handed_out() {
    let rig = pooled(roomy());
    rig.script(Script {
        fail_load: true,
        ..Script::default()
    });
    rig.want();
    // The worker made one and undid it: no VM, slot, share or run dir stays.
    eventually("a standby attempted", || {
        rig.vms.standbys.load(Ordering::SeqCst) >= 1
    });
    eventually("the failed standby undone", || {
        rig.vms.alive.load(Ordering::SeqCst) == 0 && rig.sandbox_dirs() == 0
    });
    assert_eq!(rig.launcher.standby.ready(), 0);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    assert!(rig.hooks.calls().is_empty(), "the extension heard nothing");
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    rig.assert_nothing_held();
}

#[test]
fn a_start_admission_would_refuse_takes_the_share_of_a_standby() {
    // Room for one VM, which the standby holds.
    let rig = pooled(Limits {
        memory_mb: Some(128),
        vcpus: Some(16),
    });
    rig.want();
    rig.wait_ready(1);
    rig.running("sb-1");
    assert_eq!(rig.launcher.standby.ready(), 0, "the standby gave way");
    assert_eq!(rig.admission.in_use(), (128, 1));
    // Full again: the pool waits, and a create from the template takes the usual path.
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    delete(&rig.registry, "sb-1", StopReason::Delete).unwrap();
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    assert_eq!(rig.sandbox_dirs(), 0);
    rig.assert_nothing_held();
}

#[test]
fn a_claim_when_the_host_lacks_headroom_is_refused_and_discards_the_standby() {
    let host = FakeHostFacts::new(1024 + 500);
    let room = Headroom {
        reserve_mb: 1024,
        startup_mb: 64,
        max_pressure_pct: 0.0,
    };
    let admission = Admission::with_host(roomy(), room, host.clone());
    let rig = Rig::build_on(admission, |l| {
        l.standby = StandbyPool::new(sizing(1), l.deaths.clone());
        l.standby.clone_disk = fake_clone_disk;
    });
    StandbyPool::start(&rig.launcher, rig.state_dir.join("sandboxes"));
    rig.want();
    rig.wait_ready(1);
    // The host filled up after the standby was made: its claim must not start the guest.
    host.available.store(1024 + 10, Ordering::SeqCst);
    let (id, created) = rig.create_from_standby();
    let e = created.unwrap_err();
    assert!(
        matches!(&e, OrchError::TooMany(m) if m.contains("MemAvailable")),
        "{e:?}"
    );
    assert_eq!(e.status(), 429);
    assert!(
        rig.hooks.calls().is_empty(),
        "the extension never heard of it"
    );
    assert!(!rig.registry.dir(&id).exists(), "no run dir left");
    assert!(rig.registry.entry(&id).is_err());
    // Refills are refused too while the host lacks room.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(rig.launcher.standby.ready(), 0);
    assert_eq!(
        rig.admission.in_use(),
        (0, 0),
        "the standby's share is back"
    );
    host.available.store(1024 + 500, Ordering::SeqCst);
    rig.wait_ready(1);
    let (id, created) = rig.create_from_standby();
    assert_eq!(created.unwrap().id, id);
    delete(&rig.registry, &id, StopReason::Delete).unwrap();
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    assert_eq!(rig.sandbox_dirs(), 0);
    rig.assert_nothing_held();
}

#[test]
fn shutdown_discards_every_standby_and_makes_no_more() {
    let rig = pooled(roomy());
    rig.want();
    rig.wait_ready(1);
    let entry = rig.running("sb-1");
    shutdown_all(&rig.registry, &rig.launcher);
    assert_eq!(entry.state(), super::SandboxState::Paused);
    assert_eq!(rig.launcher.standby.ready(), 0);
    rig.want();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(rig.launcher.standby.ready(), 0, "none after the drain");
    assert_eq!(rig.vms.standbys.load(Ordering::SeqCst), 1);
    // Only the paused sandbox's directory is left.
    assert_eq!(rig.sandbox_dirs(), 1);
    rig.assert_nothing_held();
}

#[test]
fn templates_without_a_ram_file_and_a_pool_of_zero_get_no_standbys() {
    let rig = Rig::build(roomy(), |l| {
        l.standby = StandbyPool::new(sizing(0), l.deaths.clone());
        l.standby.clone_disk = fake_clone_disk;
    });
    StandbyPool::start(&rig.launcher, rig.state_dir.join("sandboxes"));
    rig.want();
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    let rig = pooled(roomy());
    let resources = super::fakes::settings().resources;
    let snapshot = super::fakes::capture();
    rig.launcher
        .standby
        .want("snap", &snapshot, resources, None);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(rig.vms.standbys.load(Ordering::SeqCst), 0);
    assert!(rig.launcher.standby.claim("snap", &*rig.net).is_none());
}

/// A pool of at most `cap` per template within `memory_kib`, shrinking after `idle`.
fn demand_rig(cap: usize, memory_kib: u64, idle: Duration) -> Rig {
    let rig = Rig::build(roomy(), |l| {
        let sizing = super::standby::PoolSizing {
            per_template: cap,
            memory_kib,
            idle,
        };
        l.standby = StandbyPool::new(sizing, l.deaths.clone());
        l.standby.clone_disk = fake_clone_disk;
    });
    StandbyPool::start(&rig.launcher, rig.state_dir.join("sandboxes"));
    rig
}

/// Claims a standby and deletes the sandbox it became.
fn claim_and_delete(rig: &Rig) {
    let (id, created) = rig.create_from_standby();
    created.unwrap();
    delete(&rig.registry, &id, StopReason::Delete).unwrap();
}

/// Warm-ups that take 200 ms, so that a claim right after another finds none.
fn slow_warm_ups(rig: &Rig) {
    rig.script(Script {
        warm_up_ms: 200,
        ..Script::default()
    });
}

#[test]
fn the_pool_grows_when_creates_drain_it_and_shrinks_when_idle() {
    let rig = demand_rig(3, 1 << 30, Duration::from_secs(2));
    slow_warm_ups(&rig);
    rig.want();
    rig.wait_ready(1);
    assert_eq!(rig.launcher.standby.of(TEMPLATE), (1, 1));
    // A create that takes the last standby, and one that finds none (a miss): one more
    // each, up to the cap.
    claim_and_delete(&rig);
    assert_eq!(rig.launcher.standby.of(TEMPLATE).1, 2);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    assert_eq!(rig.launcher.standby.of(TEMPLATE).1, 3);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    assert_eq!(rig.launcher.standby.of(TEMPLATE).1, 3, "capped");
    rig.wait_ready(3);
    // Idle: one less per idle period, down to one; the extra standbys are discarded.
    eventually("the pool shrank to one", || {
        rig.launcher.standby.of(TEMPLATE) == (1, 1)
    });
    // A discarded standby leaves the pool's count before its VM is killed.
    eventually("the others are gone", || {
        rig.vms.alive.load(Ordering::SeqCst) == 1 && rig.sandbox_dirs() == 1
    });
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    rig.assert_nothing_held();
}

#[test]
fn a_template_cap_of_zero_discards_its_standbys_and_makes_none() {
    let rig = demand_rig(4, 1 << 30, Duration::from_secs(3600));
    rig.want();
    rig.wait_ready(1);
    rig.launcher.standby.set_cap(TEMPLATE, Some(0));
    rig.wait_ready(0);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rig.launcher.standby.ready(), 0, "none made again");
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    rig.assert_nothing_held();
}

#[test]
fn refills_stop_at_the_memory_budget() {
    // The fake VMs hold 40 MiB each: a 100 MiB budget holds two.
    let rig = demand_rig(4, 100 << 10, Duration::from_secs(3600));
    slow_warm_ups(&rig);
    rig.want();
    rig.wait_ready(1);
    claim_and_delete(&rig);
    assert!(rig.launcher.standby.claim(TEMPLATE, &*rig.net).is_none());
    // The target is 3 now, but a third would pass the budget.
    rig.wait_ready(2);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(rig.launcher.standby.of(TEMPLATE), (2, 3));
    rig.launcher.standby.forget(TEMPLATE, &*rig.net);
    rig.assert_nothing_held();
}
