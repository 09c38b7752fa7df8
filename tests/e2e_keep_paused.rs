//! End-to-end: kept paused VMs against the real server, QEMU and an extension. A pause of
//! a template's clone keeps its QEMU (stopped, its capture whole on disk, its stop hook
//! sent); the resume runs in that same process after start-resume, with the guest's
//! files and processes as they were; a VM beyond `keep_paused_vms` is let go and its
//! sandbox resumes from disk into a new QEMU; a delete while kept and a server stop leave
//! no QEMU, namespace, link or file. One template build is the only cold boot.
//!
//! Fixture: one server (`keep_paused_vms = 1`) and its recording extension shared by every
//! test (see [`shared`]), with the template `kp` they clone. With one VM kept at most, a
//! pause of one test would let go of another's kept VM: the tests take turns
//! ([`TURNS`]), and each leaves no VM kept. The server stop at the end (the fixture's)
//! pauses the sandbox left running for good and must leave nothing.

mod common;

use common::extension::Extension;
use common::shared::{lock, Hold, Shared};
use common::*;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

const KEPT: &str = "agentenv_kept_paused_vms ";
const RESUMED_KEPT: &str = "agentenv_kept_paused_resumes_total{kept=\"true\"}";
const RESUMED_COLD: &str = "agentenv_kept_paused_resumes_total{kept=\"false\"}";

/// The server every test shares.
static SHARED: Shared<Fixture> = Shared::new();

/// One test at a time on the shared server: `keep_paused_vms = 1` is the server's, and
/// the kept-VM gauge and resume counters are read as absolute values.
static TURNS: Mutex<()> = Mutex::new(());

struct Fixture {
    server: Server,
    ext: Extension,
}

impl common::shared::Fixture for Fixture {
    fn start() -> Fixture {
        let ext = Extension::start();
        let server = Server::start(&format!(
            "{}\n[templates]\nstandby_per_template = 0\n\n[sandbox]\nkeep_paused_vms = 1\n",
            ext.config()
        ));
        build_template(&server, "kp");
        Fixture { server, ext }
    }

    /// A server stop pauses what runs for good: nothing is kept past it, and every
    /// instance a start hook opened was stopped. After a failure the state is kept.
    fn stop(mut self, failed: bool) {
        let (s, ext) = (&mut self.server, &self.ext);
        s.stop();
        if failed || std::thread::panicking() {
            eprintln!("shared server kept in {}", s.state_dir.display());
            std::mem::forget(self.server);
            return;
        }
        assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
        assert!(netns_files().is_empty(), "{:?}", netns_files());
        assert!(aenv_links().is_empty(), "{:?}", aenv_links());
        for r in ext.requests_for("start-resume") {
            assert!(
                ext.requests_for("stop")
                    .iter()
                    .any(|st| st.instance_id() == r.instance_id()),
                "no stop for {}",
                r.sandbox_id()
            );
        }
    }
}

/// A hold on the shared server (started by the first test that asks), and the turn on it
/// (taken after the hold, so the server outlives the turns of the tests waiting).
fn shared_turn() -> Turn {
    let hold = SHARED.hold();
    let turn = lock(&TURNS);
    Turn { _turn: turn, hold }
}

/// A test's turn on the shared server. Fields drop in order: the turn goes before the
/// hold.
struct Turn {
    _turn: MutexGuard<'static, ()>,
    hold: Hold<Fixture>,
}

impl std::ops::Deref for Turn {
    type Target = Fixture;
    fn deref(&self) -> &Fixture {
        &self.hold
    }
}

fn pause(s: &Server, id: &str) {
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204, "{v}\n{}", s.log());
}

fn resume(s: &Server, id: &str) {
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/resume"), None);
    assert_eq!(code, 201, "{v}\n{}", s.log());
}

fn one_qemu(id: &str) -> u32 {
    let pids = qemu_processes_with(id);
    assert_eq!(pids.len(), 1, "one QEMU of {id}: {pids:?}");
    pids[0]
}

fn stops_of(ext: &Extension, id: &str) -> usize {
    ext.requests_for("stop")
        .iter()
        .filter(|r| r.sandbox_id() == id)
        .count()
}

/// (name, scheduling policy, nice) of every thread of `pid` (/proc/<pid>/task/*/stat:
/// fields 19 and 41 after the parenthesised name).
fn scheduling_of(pid: u32) -> Vec<(String, i64, i64)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("QEMU's threads");
    tasks
        .flatten()
        .filter_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            // `rest` starts at field 3.
            let field = |n: usize| rest[n - 3].parse::<i64>().ok();
            Some((comm.trim().to_string(), field(41)?, field(19)?))
        })
        .collect()
}

/// Deletes sandbox `id`, asserting 204.
fn delete(s: &Server, id: &str) {
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
}

/// Starts a `sleep` in the background after writing /root/mark; a script that prints the
/// mark and `running` while that sleep is alive.
fn mark_and_sleeper(s: &Server, id: &str) -> String {
    let sleeper = sh(
        s,
        id,
        "echo kept > /root/mark; sleep 1000 >/dev/null 2>&1 & echo $!",
    );
    format!("cat /root/mark; kill -0 {} && echo running", sleeper.trim())
}

#[test]
fn a_pause_keeps_the_clones_qemu_back_in_the_normal_class_with_its_capture_and_stop_hook() {
    let t = shared_turn();
    let (s, ext) = (&t.server, &t.ext);
    let id = s.create_from("kp", 120);
    let pid = one_qemu(&id);
    huge_pages_follow_the_accelerator(s, pid);

    // The pause: its capture is written and its stop hook sent, and the QEMU stays. Its
    // frozen window ran in the real-time class ([vm] pause_realtime), and the kept QEMU
    // is back in the normal class, every thread, before any guest code runs again.
    pause(s, &id);
    assert_eq!(qemu_processes_with(&id), [pid], "the paused VM is kept");
    let log = s.log();
    assert!(
        log.contains(&format!("sandboxId={id} op=pause frozenMs"))
            && log.contains("priority=realtime")
            && !log.contains("step=priority"),
        "{log}"
    );
    let threads = scheduling_of(pid);
    assert!(
        threads.iter().any(|(comm, ..)| comm.starts_with("CPU 0/")),
        "named vCPU threads: {threads:?}"
    );
    assert!(
        threads
            .iter()
            .all(|(_, policy, nice)| (*policy, *nice) == (0, 0)),
        "every thread back to SCHED_OTHER, nice 0: {threads:?}"
    );
    assert_eq!(metric(s, KEPT), 1);
    assert!(
        s.state_dir
            .join("sandboxes")
            .join(&id)
            .join("paused/state.bin")
            .exists(),
        "the capture is written"
    );
    assert!(
        wait_until(Duration::from_secs(10), || stops_of(ext, &id) == 1),
        "the pause sent its stop hook"
    );
    // No VM stays kept for the next test.
    delete(s, &id);
}

#[test]
fn a_kept_vm_resumes_in_the_same_qemu_as_it_was_with_the_guest_clock_set() {
    let t = shared_turn();
    let (s, ext) = (&t.server, &t.ext);
    let id = s.create_from("kp", 120);
    let pid = one_qemu(&id);
    let alive = mark_and_sleeper(s, &id);
    pause(s, &id);

    // The resume: start-resume, then the same process runs on, as it was.
    let resumes_before = ext.requests_for("start-resume").len();
    resume(s, &id);
    assert_eq!(ext.requests_for("start-resume").len(), resumes_before + 1);
    assert_eq!(qemu_processes_with(&id), [pid], "resumed in the kept VM");
    assert_eq!(metric(s, RESUMED_KEPT), 1);
    assert_eq!(metric(s, KEPT), 0);
    assert_eq!(sh(s, &id, &alive), "kept\nrunning\n");
    // The guest's clock was set on the resume: it is within a few seconds of the host's.
    let guest: i64 = sh(s, &id, "date +%s").trim().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!((guest - now).abs() <= 5, "guest clock {guest}, host {now}");
    delete(s, &id);
}

/// Leaves its first sandbox running: the fixture's server stop pauses it for good.
#[test]
fn beyond_keep_paused_vms_the_oldest_kept_vm_is_let_go_and_its_sandbox_resumes_from_disk() {
    let t = shared_turn();
    let s = &t.server;
    let id = s.create_from("kp", 120);
    let pid = one_qemu(&id);
    let alive = mark_and_sleeper(s, &id);

    // Two paused, one kept: the older VM is let go, its sandbox resumes from disk.
    pause(s, &id);
    let other = s.create_from("kp", 120);
    sh(s, &other, "echo other > /root/mark");
    pause(s, &other);
    assert!(
        wait_until(Duration::from_secs(10), || qemu_processes_with(&id)
            .is_empty()),
        "the oldest kept VM is let go"
    );
    assert_eq!(metric(s, KEPT), 1);
    one_qemu(&other);
    resume(s, &id);
    assert_ne!(one_qemu(&id), pid, "restored into a new QEMU");
    assert_eq!(metric(s, RESUMED_COLD), 1);
    assert_eq!(sh(s, &id, &alive), "kept\nrunning\n");
    // No VM stays kept for the next test.
    delete(s, &other);
}

#[test]
fn a_delete_of_a_paused_sandbox_whose_vm_is_kept_takes_the_vm_and_everything_else() {
    let t = shared_turn();
    let s = &t.server;
    let id = s.create_from("kp", 120);
    let pid = one_qemu(&id);
    pause(s, &id);
    assert_eq!(qemu_processes_with(&id), [pid]);
    assert_eq!(metric(s, KEPT), 1);
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    assert!(qemu_processes_with(&id).is_empty());
    assert!(!s.state_dir.join("sandboxes").join(&id).exists());
    assert_eq!(metric(s, KEPT), 0);
}

/// Under TCG the QEMU runs without transparent huge pages (its translation buffer would
/// be held in 2 MiB steps) and holds none; under KVM it may have them.
fn huge_pages_follow_the_accelerator(s: &Server, pid: u32) {
    let log = s.log();
    let spawn = log
        .lines()
        .find(|l| l.contains("op=spawn") && l.contains(&format!("pid={pid} ")))
        .unwrap_or_else(|| panic!("no spawn line for QEMU {pid}:\n{log}"));
    let tcg = spawn.contains("accel=tcg");
    let field = |file: &str, key: &str| -> String {
        let text = std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or_else(|| panic!("no {key} in /proc/{pid}/{file}"))
            .trim()
            .to_string()
    };
    let enabled = field("status", "THP_enabled:");
    assert_eq!(enabled, if tcg { "0" } else { "1" }, "{spawn}");
    if tcg {
        assert_eq!(field("smaps_rollup", "AnonHugePages:"), "0 kB", "{spawn}");
    }
}
