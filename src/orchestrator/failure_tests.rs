//! The orchestrator's failure paths against fake host sides ([`super::fakes`]): every
//! step of the start sequence failing leaves nothing held, and the failure-path bugs of
//! issue 9 stay fixed. No root, QEMU or extension needed.

use super::admission::{Admission, Limits};
use super::expiry;
use super::fakes::sides::{FakeHooks, FakeMachines, FakeNet, Script};
use super::operations::{self, Registered};
use super::registry::Registry;
use super::sandbox::{SandboxEntry, SandboxInfo, SandboxState};
use super::settings::{PauseMode, PauseRequest};
use super::start::{self, Launcher, StartKind, StartRequest};
use super::supervisor::{RunDir, ThreadSpawner};
use super::{delete, shutdown_all, OrchError};
use crate::hooks::{HookError, StopReason};
use crate::vm::Accel;
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

const SLOTS: u32 = 8;

/// A registry and a launcher over fake sides, in a private temp state dir.
pub(super) struct Rig {
    pub(super) state_dir: PathBuf,
    pub(super) registry: Arc<Registry>,
    pub(super) launcher: Arc<Launcher>,
    pub(super) net: Arc<FakeNet>,
    pub(super) hooks: Arc<FakeHooks>,
    pub(super) vms: Arc<FakeMachines>,
    pub(super) admission: Arc<Admission>,
}

impl Rig {
    pub(super) fn new() -> Rig {
        Rig::with(Limits {
            memory_mb: Some(4096),
            vcpus: Some(16),
        })
    }

    pub(super) fn with(limits: Limits) -> Rig {
        Rig::build(limits, |_| {})
    }

    pub(super) fn build(limits: Limits, adjust: impl FnOnce(&mut Launcher)) -> Rig {
        Rig::build_on(Admission::new(limits), adjust)
    }

    /// A rig whose launcher admits with `admission` (e.g. one over a fake host).
    pub(super) fn build_on(admission: Arc<Admission>, adjust: impl FnOnce(&mut Launcher)) -> Rig {
        let state_dir = std::env::temp_dir().join(format!("aenv-orch-{}", crate::util::new_id()));
        let netns_dir = state_dir.join("netns");
        std::fs::create_dir_all(&netns_dir).unwrap();
        // The fake host makes no namespaces; the supervisor opens these files instead.
        for n in 1..=SLOTS {
            std::fs::write(netns_dir.join(format!("agentenv-ns-{n}")), b"").unwrap();
        }
        let mut config = crate::config::Config::from_sources(None, &[]).unwrap();
        config.network.netns_dir = netns_dir;
        config.network.max_slots = SLOTS;
        config.network.pool_min = 0;
        config.network.outbound = true;
        config.vm.ready_timeout_secs = 5;
        let net = FakeNet::new(&config.network);
        let hooks = Arc::new(FakeHooks::default());
        let vms = Arc::new(FakeMachines::default());
        let mut launcher = Launcher::new(
            &config,
            net.clone(),
            hooks.clone(),
            vms.clone(),
            admission.clone(),
            Accel::Tcg { tsc_khz: 1_000_000 },
        );
        adjust(&mut launcher);
        let registry = Arc::new(
            Registry::new(state_dir.join("sandboxes"), Default::default())
                .with_kept(launcher.kept.clone()),
        );
        Rig {
            state_dir,
            registry,
            launcher: Arc::new(launcher),
            net,
            hooks,
            vms,
            admission,
        }
    }

    pub(super) fn script(&self, script: Script) {
        *self.vms.script.lock() = script;
    }

    /// A fresh start of sandbox `id` in a new run dir with its disk.
    pub(super) fn request(&self, id: &str, internet_access: bool) -> StartRequest {
        let settings = super::fakes::settings();
        let run_dir = RunDir::create(self.registry.dir(id)).unwrap();
        std::fs::write(run_dir.path().join("disk.qcow2"), b"disk").unwrap();
        StartRequest {
            id: id.to_string(),
            run_dir,
            kind: StartKind::Fresh {
                memory_file: None,
                disk: None,
            },
            resources: settings.resources,
            internet_access,
            egress: Default::default(),
            params: settings.custom_extension_params,
            failed_reason: StopReason::StartFailed,
            watch: Registered::watch(&self.registry, id),
            volumes: Vec::new(),
        }
    }

    /// Starts and registers a running sandbox, as a create does.
    pub(super) fn running(&self, id: &str) -> Arc<SandboxEntry> {
        let started = start::start(&self.launcher, self.request(id, true)).unwrap();
        let info = SandboxInfo::new(
            id.to_string(),
            super::fakes::settings(),
            started.host_ip,
            started.netns_path,
        );
        operations::register_running(
            &self.registry,
            &self.registry.dir(id),
            info,
            started.runtime,
        )
        .unwrap();
        self.registry.entry(id).unwrap()
    }

    /// Runs a start that must fail: afterwards the extension has seen exactly `hooks`,
    /// the run dir is gone and nothing is held. Returns the error.
    pub(super) fn failed_start(&self, req: StartRequest, hooks: &[&str]) -> OrchError {
        let dir = req.run_dir.path().to_path_buf();
        let e = start::start(&self.launcher, req)
            .err()
            .expect("the start fails");
        assert_eq!(self.hooks.calls(), hooks);
        assert!(!dir.exists(), "the run dir is removed");
        self.assert_nothing_held();
        e
    }

    /// Asserts that no reservation, slot, open instance or VM is left.
    pub(super) fn assert_nothing_held(&self) {
        assert_eq!(self.admission.in_use(), (0, 0), "reservations given back");
        assert_eq!(self.net.slots.stats().in_use, 0, "slots given back");
        assert_eq!(
            self.net.acquired.load(Ordering::SeqCst),
            self.net.released.load(Ordering::SeqCst),
            "every slot released, none only dropped"
        );
        assert_eq!(self.hooks.open_instances(), 0, "every instance stopped");
        // A supervisor drops its VM as it ends, just after it answered.
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.vms.alive.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(self.vms.alive.load(Ordering::SeqCst), 0, "no VM left");
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.net.slots.shutdown();
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

/// Waits (bounded) until `f` holds.
pub(super) fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What the extension sees of a start that failed after its start hook.
const STOPPED: [&str; 2] = ["start-fresh sb-1", "stop sb-1 start-failed"];

#[test]
fn a_start_that_admission_refuses_never_reaches_the_extension() {
    let rig = Rig::with(Limits {
        memory_mb: Some(64),
        vcpus: Some(16),
    });
    let e = rig.failed_start(rig.request("sb-1", true), &[]);
    assert!(
        matches!(&e, OrchError::TooMany(m) if m.contains("memory")),
        "{e:?}"
    );
    assert_eq!(rig.net.acquired.load(Ordering::SeqCst), 0, "no slot taken");
}

#[test]
fn no_free_slot_gives_the_reservation_back() {
    let rig = Rig::new();
    rig.net.fail_acquire.store(true, Ordering::SeqCst);
    let e = rig.failed_start(rig.request("sb-1", true), &[]);
    assert!(matches!(e, OrchError::Unavailable(_)), "{e:?}");
}

#[test]
fn a_slot_whose_outbound_rule_fails_is_released_before_any_hook() {
    let rig = Rig::new();
    *rig.net.host.fail_at.lock() = Some("load_slot_ruleset");
    let e = rig.failed_start(rig.request("sb-1", false), &[]);
    assert!(matches!(e, OrchError::Net { .. }), "{e:?}");
    assert_eq!(e.status(), 500);
}

#[test]
fn a_failed_start_hook_is_stopped_with_the_callers_reason_and_rolled_back() {
    let rig = Rig::new();
    rig.hooks.fail_start.store(true, Ordering::SeqCst);
    let mut req = rig.request("sb-1", true);
    req.failed_reason = StopReason::TemplateBuild;
    let e = rig.failed_start(req, &["start-fresh sb-1", "stop sb-1 template-build"]);
    assert!(
        matches!(e, OrchError::Hook(HookError::Failed { .. })),
        "{e:?}"
    );
    assert_eq!(rig.vms.boots.load(Ordering::SeqCst), 0, "no VM started");
}

#[test]
fn a_supervisor_thread_that_cannot_spawn_sends_the_stop_hook_and_releases_everything() {
    let no_threads: ThreadSpawner = |_, _| Err(std::io::Error::other("no threads"));
    let limits = Limits {
        memory_mb: Some(4096),
        vcpus: Some(16),
    };
    let rig = Rig::build(limits, |l| l.spawn = no_threads);
    let e = rig.failed_start(rig.request("sb-1", true), &STOPPED);
    assert!(
        e.to_string().contains("cannot start supervisor thread"),
        "{e}"
    );
}

#[test]
fn a_vm_that_cannot_start_is_rolled_back() {
    let rig = Rig::new();
    rig.script(Script {
        fail_boot: true,
        ..Script::default()
    });
    let e = rig.failed_start(rig.request("sb-1", true), &STOPPED);
    assert!(e.to_string().contains("does not boot"), "{e}");
}

#[test]
fn a_guest_whose_agent_never_answers_is_killed_and_rolled_back() {
    let rig = Rig::new();
    rig.script(Script {
        silent_agent: true,
        ..Script::default()
    });
    let e = rig.failed_start(rig.request("sb-1", true), &STOPPED);
    assert!(e.to_string().contains("did not become ready"), "{e}");
    assert!(
        matches!(e, OrchError::GuestNotReady(super::NotReady::Silent { .. })),
        "{e:?}"
    );
    assert_eq!(e.status(), 500);
    assert_eq!(rig.vms.boots.load(Ordering::SeqCst), 1);
}

/// A restore (resume, clone, fork child) of sandbox `id`: the VM is prepared while
/// start-resume runs.
fn restore_request(rig: &Rig, id: &str) -> StartRequest {
    let mut req = rig.request(id, true);
    req.kind = StartKind::Restore {
        record: Box::new(super::fakes::capture()),
        disk: req.run_dir.path().join("disk.qcow2"),
        standby: None,
    };
    req
}

#[test]
fn a_failed_start_resume_kills_the_prepared_vm_and_rolls_back() {
    let rig = Rig::new();
    rig.hooks.fail_start.store(true, Ordering::SeqCst);
    let e = rig.failed_start(
        restore_request(&rig, "sb-1"),
        &["start-resume sb-1", "stop sb-1 start-failed"],
    );
    assert!(
        matches!(e, OrchError::Hook(HookError::Failed { .. })),
        "{e:?}"
    );
    assert_eq!(
        rig.vms.boots.load(Ordering::SeqCst),
        1,
        "prepared meanwhile"
    );
}

#[test]
fn a_restore_whose_vm_cannot_start_still_stops_its_instance() {
    let rig = Rig::new();
    rig.script(Script {
        fail_boot: true,
        ..Script::default()
    });
    let e = rig.failed_start(
        restore_request(&rig, "sb-1"),
        &["start-resume sb-1", "stop sb-1 start-failed"],
    );
    assert!(e.to_string().contains("does not boot"), "{e}");
}

#[test]
fn a_restored_sandbox_runs_and_is_deleted_cleanly() {
    let rig = Rig::new();
    let started = start::start(&rig.launcher, restore_request(&rig, "sb-1")).unwrap();
    started.runtime.agent.ping(Duration::from_secs(5)).unwrap();
    started.runtime.delete(StopReason::Delete);
    assert_eq!(rig.hooks.calls(), ["start-resume sb-1", "stop sb-1 delete"]);
    rig.assert_nothing_held();
}

#[test]
fn only_cold_boots_are_told_their_boot_is_over_and_a_failure_there_is_no_failed_start() {
    let rig = Rig::new();
    rig.running("sb-1");
    assert_eq!(rig.vms.boots_finished.load(Ordering::SeqCst), 1);
    // A restored guest booted long ago: its capture holds what the boot left.
    let started = start::start(&rig.launcher, restore_request(&rig, "sb-2")).unwrap();
    assert_eq!(rig.vms.boots_finished.load(Ordering::SeqCst), 1);
    started.runtime.delete(StopReason::Delete);
    rig.script(Script {
        fail_boot_finished: true,
        ..Script::default()
    });
    let entry = rig.running("sb-3");
    assert_eq!(rig.vms.boots_finished.load(Ordering::SeqCst), 2);
    assert_eq!(entry.state(), SandboxState::Running);
    for id in ["sb-1", "sb-3"] {
        delete(&rig.registry, id, StopReason::Delete).unwrap();
    }
    rig.assert_nothing_held();
}

#[test]
fn a_started_sandbox_gives_everything_back_on_delete() {
    let rig = Rig::new();
    rig.running("sb-1");
    assert_eq!(rig.admission.in_use(), (128, 1));
    assert_eq!(rig.net.slots.stats().in_use, 1);
    delete(&rig.registry, "sb-1", StopReason::Delete).unwrap();
    assert_eq!(rig.hooks.calls(), ["start-fresh sb-1", "stop sb-1 delete"]);
    assert!(!rig.registry.dir("sb-1").exists());
    rig.assert_nothing_held();
}

#[test]
fn a_pause_whose_commit_fails_keeps_the_capture_and_stays_resumable() {
    let rig = Rig::new();
    let entry = rig.running("sb-1");
    let dir = rig.registry.dir("sb-1");
    // The record cannot be replaced: its path is a directory.
    std::fs::remove_file(dir.join("record.json")).unwrap();
    std::fs::create_dir(dir.join("record.json")).unwrap();
    let e = operations::pause(&rig.registry, "sb-1", StopReason::Pause, PauseRequest::FULL)
        .unwrap_err();
    assert!(e.to_string().contains("could not be saved"), "{e}");
    assert_eq!(entry.state(), SandboxState::Paused);
    let capture = entry.paused_capture().expect("the capture is kept");
    assert!(
        capture.state_file.is_file(),
        "{}",
        capture.state_file.display()
    );
    assert!(dir.join("disk.qcow2").is_file(), "the disk is kept");
    assert_eq!(rig.hooks.calls(), ["start-fresh sb-1", "stop sb-1 pause"]);
    rig.assert_nothing_held();
}

#[test]
fn a_filesystem_only_pause_keeps_the_disk_and_no_memory_and_says_so_in_its_record() {
    let rig = Rig::new();
    let entry = rig.running("sb-1");
    let request = PauseRequest {
        mode: PauseMode::Filesystem,
        require_healthy_guest: false,
    };
    operations::pause(&rig.registry, "sb-1", StopReason::Pause, request).unwrap();
    assert_eq!(entry.state(), SandboxState::Paused);
    assert!(entry.paused_filesystem_only());
    assert_eq!(entry.read(|i| i.pause_mode), Some(PauseMode::Filesystem));
    let dir = rig.registry.dir("sb-1");
    let record = super::records::read(&dir).unwrap();
    let capture = record.paused.expect("a committed capture");
    assert!(capture.filesystem_only && capture.capture_files().is_empty());
    assert_eq!(record.info.pause_mode, Some(PauseMode::Filesystem));
    assert!(!dir.join("paused").exists(), "no state file, no RAM");
    assert_eq!(rig.hooks.calls(), ["start-fresh sb-1", "stop sb-1 pause"]);
    rig.assert_nothing_held();
}

#[test]
fn a_filesystem_only_pause_with_a_silent_agent_is_refused_and_the_sandbox_runs_on() {
    let rig = Rig::new();
    rig.script(Script {
        fail_sync: true,
        ..Script::default()
    });
    let entry = rig.running("sb-1");
    let request = PauseRequest {
        mode: PauseMode::Filesystem,
        require_healthy_guest: false,
    };
    let e = operations::pause(&rig.registry, "sb-1", StopReason::Pause, request).unwrap_err();
    assert!(matches!(e, OrchError::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("runs on"), "{e}");
    assert_eq!(entry.state(), SandboxState::Running);
    assert_eq!(rig.hooks.calls(), ["start-fresh sb-1"]);
    delete(&rig.registry, "sb-1", StopReason::Delete).unwrap();
    rig.assert_nothing_held();
}

#[test]
fn a_pause_that_leaves_the_vm_unable_to_run_on_keeps_its_disk_in_quarantine() {
    let rig = Rig::new();
    rig.script(Script {
        stuck_pause: true,
        ..Script::default()
    });
    let entry = rig.running("sb-1");
    let e = operations::pause(&rig.registry, "sb-1", StopReason::Pause, PauseRequest::FULL)
        .unwrap_err();
    assert!(e.to_string().contains("pause failed"), "{e}");
    // Removed from the API; later calls are told why, and where its files are.
    let gone = rig
        .registry
        .entry("sb-1")
        .err()
        .expect("removed from the API");
    assert!(matches!(gone, OrchError::NotFound(_)), "{gone}");
    let gone = gone.to_string();
    assert!(
        gone.starts_with("sandbox sb-1 is gone: its VM stopped during a pause (it died, or"),
        "{gone}"
    );
    assert_eq!(entry.state(), SandboxState::Deleting);
    assert!(!rig.registry.dir("sb-1").exists());
    let quarantine = rig.state_dir.join("quarantine");
    let kept: Vec<PathBuf> = std::fs::read_dir(&quarantine)
        .expect("a quarantine dir")
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(std::fs::read(kept[0].join("disk.qcow2")).unwrap(), b"disk");
    assert!(kept[0].join("record.json").is_file());
    let why = std::fs::read_to_string(kept[0].with_extension("reason")).unwrap();
    assert!(why.contains("pause failed"), "{why}");
    assert!(
        gone.ends_with(&format!("its files are kept in {}", kept[0].display())),
        "{gone}"
    );
    assert_eq!(rig.hooks.calls(), ["start-fresh sb-1", "stop sb-1 failure"]);
    rig.assert_nothing_held();
}

#[test]
fn a_vm_that_dies_is_stopped_counted_and_its_files_quarantined() {
    let rig = Rig::new();
    let _other = rig.running("sb-2");
    let entry = rig.running("sb-1");
    let paused_dir = rig.registry.dir("sb-1");
    rig.vms.died.store(true, Ordering::SeqCst);
    // Quarantine writes an entry's `.reason`, then moves the entry: the moved directory
    // is the last event of each, so that is what is waited for.
    let moved = |dir: &std::path::Path| {
        std::fs::read_dir(dir).map_or(0, |d| {
            d.filter(|e| e.as_ref().unwrap().path().is_dir()).count()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while moved(&rig.state_dir.join("quarantine")) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    rig.vms.died.store(false, Ordering::SeqCst);
    let mut calls = rig.hooks.calls();
    calls.sort();
    assert_eq!(
        calls,
        [
            "start-fresh sb-1",
            "start-fresh sb-2",
            "stop sb-1 failure",
            "stop sb-2 failure"
        ]
    );
    assert_eq!(entry.state(), SandboxState::Deleting);
    let Err(e) = rig.registry.entry("sb-1") else {
        panic!("still registered")
    };
    let msg = e.to_string();
    assert!(matches!(e, OrchError::NotFound(_)), "{e:?}");
    assert!(
        msg.contains("VM died on its own (killed by signal 9 (SIGKILL))"),
        "{msg}"
    );
    assert!(
        msg.contains(&rig.state_dir.join("quarantine").display().to_string()),
        "{msg}"
    );
    assert!(!paused_dir.exists(), "moved, not left in place");
    let kept: Vec<PathBuf> = std::fs::read_dir(rig.state_dir.join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    for dir in &kept {
        assert_eq!(std::fs::read(dir.join("disk.qcow2")).unwrap(), b"disk");
        assert!(dir.join("record.json").is_file());
        let why = std::fs::read_to_string(dir.with_extension("reason")).unwrap();
        assert!(
            why.contains("died on its own (killed by signal 9 (SIGKILL))"),
            "{why}"
        );
    }
    let mut metrics = String::new();
    rig.launcher.deaths.render(&mut metrics);
    assert!(
        metrics.contains("agentenv_vm_deaths_total{kind=\"sandbox\",cause=\"SIGKILL\"} 2"),
        "{metrics}"
    );
    rig.assert_nothing_held();
}

#[test]
fn shutdown_never_deletes_a_sandbox_whose_pause_failed() {
    let rig = Rig::new();
    rig.script(Script {
        fail_pause: true,
        ..Script::default()
    });
    let entry = rig.running("sb-1");
    shutdown_all(&rig.registry, &rig.launcher);
    assert!(rig.registry.entry("sb-1").is_ok(), "still registered");
    assert_eq!(entry.state(), SandboxState::Running);
    assert!(rig.registry.dir("sb-1").join("record.json").is_file());
    assert!(rig.registry.dir("sb-1").join("disk.qcow2").is_file());
    assert_eq!(
        rig.hooks.calls(),
        ["start-fresh sb-1"],
        "no stop, no delete"
    );
    assert_eq!(rig.vms.pauses.load(Ordering::SeqCst), 1);
}

#[test]
fn a_pause_that_keeps_failing_is_retried_with_backoff_not_every_check() {
    let rig = Rig::new();
    rig.script(Script {
        fail_pause: true,
        ..Script::default()
    });
    let entry = rig.running("sb-1");
    entry.update(|i| i.end_at = SystemTime::now());
    let backoff = Arc::new(Mutex::new(expiry::Backoff::default()));
    let t0 = SystemTime::now();
    // One check a second for four seconds, as the expiry thread makes them.
    for s in 0..4 {
        for t in expiry::tick(&rig.registry, &backoff, t0 + Duration::from_secs(s)) {
            t.join().unwrap();
        }
    }
    assert_eq!(
        rig.vms.pauses.load(Ordering::SeqCst),
        1,
        "one attempt, then backoff"
    );
    for t in expiry::tick(&rig.registry, &backoff, t0 + Duration::from_secs(7)) {
        t.join().unwrap();
    }
    assert_eq!(
        rig.vms.pauses.load(Ordering::SeqCst),
        2,
        "retried after the backoff"
    );
    assert_eq!(entry.state(), SandboxState::Running, "the VM ran on");
}

#[test]
fn a_guest_that_breaks_the_agent_protocol_gets_its_sandbox_marked_and_others_run_on() {
    let rig = Rig::new();
    rig.script(Script {
        hostile_agent: true,
        ..Script::default()
    });
    let bad = rig.running("sb-bad");
    rig.script(Script::default());
    let good = rig.running("sb-good");
    eventually("the sandbox is marked", || {
        bad.read(|i| i.guest_protocol_violation.is_some())
    });
    let mark = bad.read(|i| i.guest_protocol_violation.clone()).unwrap();
    assert!(mark.contains("broke the agent protocol"), "{mark}");
    // The sandbox itself stays (running, deletable); its agent channel is closed.
    assert_eq!(bad.state(), SandboxState::Running);
    let agent = bad.runtime().unwrap().agent;
    assert!(agent.ping(Duration::from_secs(1)).is_err());
    // The other sandbox is untouched.
    let other = good.runtime().unwrap().agent;
    other.ping(Duration::from_secs(5)).unwrap();
    assert!(good.read(|i| i.guest_protocol_violation.is_none()));
    delete(&rig.registry, "sb-bad", StopReason::Delete).unwrap();
    delete(&rig.registry, "sb-good", StopReason::Delete).unwrap();
    rig.assert_nothing_held();
}

#[test]
fn kept_paused_vms_are_bounded_and_let_go_on_delete_and_shutdown() {
    use super::kept::{KeptLimits, KeptPool};
    let limits = Limits {
        memory_mb: Some(4096),
        vcpus: Some(16),
    };
    let rig = Rig::build(limits, |l| {
        let one = KeptLimits {
            max_vms: 1,
            memory_kib: 1 << 30,
            max_age: Duration::from_secs(600),
        };
        l.kept = Arc::new(KeptPool::new(one, l.net.clone()));
    });
    rig.script(Script {
        keep_paused: true,
        ..Script::default()
    });
    let alive = || rig.vms.alive.load(Ordering::SeqCst);
    let slots =
        || rig.net.acquired.load(Ordering::SeqCst) - rig.net.released.load(Ordering::SeqCst);
    rig.running("sb-1");
    rig.running("sb-2");
    operations::pause(&rig.registry, "sb-1", StopReason::Pause, PauseRequest::FULL).unwrap();
    // Paused as ever (stop hook sent, record written), but the VM and its slot stay.
    assert_eq!(alive(), 2);
    assert_eq!(slots(), 2);
    assert_eq!(rig.launcher.kept.held().0, 1);
    assert!(rig
        .hooks
        .calls()
        .iter()
        .any(|c| c.starts_with("stop sb-1 ")));
    assert_eq!(
        rig.registry.entry("sb-1").unwrap().state(),
        SandboxState::Paused
    );
    // One kept at most: the older goes when the next is kept.
    operations::pause(&rig.registry, "sb-2", StopReason::Pause, PauseRequest::FULL).unwrap();
    eventually("the older kept VM to go", || alive() == 1);
    assert_eq!(slots(), 1);
    assert_eq!(rig.launcher.kept.held().0, 1);
    assert_eq!(rig.admission.in_use().0, 128, "the kept VM holds its share");
    // A delete of the paused sandbox takes its kept VM, slot and share.
    delete(&rig.registry, "sb-2", StopReason::Delete).unwrap();
    assert_eq!(alive(), 0);
    assert_eq!(slots(), 0);
    assert_eq!(rig.launcher.kept.held().0, 0);
    assert_eq!(rig.admission.in_use(), (0, 0));
    // The shutdown lets every kept VM go, and its own pauses keep none.
    rig.running("sb-3");
    rig.running("sb-4");
    operations::pause(&rig.registry, "sb-3", StopReason::Pause, PauseRequest::FULL).unwrap();
    assert_eq!(alive(), 2);
    shutdown_all(&rig.registry, &rig.launcher);
    assert_eq!(alive(), 0);
    assert_eq!(slots(), 0);
    assert_eq!(rig.launcher.kept.held().0, 0);
}
