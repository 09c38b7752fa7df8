//! End-to-end: the standby pool against the real server and QEMU. A create from a
//! template built with `POST /templates` takes a QEMU started in advance (the standby's
//! process becomes the sandbox's), the pool refills, a standby that dies is replaced, and
//! after server stop and template delete no QEMU, namespace, link or file is left.
//! One template build is the only cold boot.

mod common;

use common::cluster::envd_sh;
use common::extension::{Behavior, Extension};
use common::shared::{lock, Shared};
use common::*;
use serde_json::json;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

const READY: &str = "agentenv_standby_vms{state=\"ready\"}";
const HITS: &str = "agentenv_standby_claims_total{result=\"hit\"}";
const MISSES: &str = "agentenv_standby_claims_total{result=\"miss\"}";

/// The one QEMU under the sandboxes directory that is no sandbox in `except`: the
/// standby.
fn standby_pid(s: &Server, except: &[&str]) -> u32 {
    let dir = s.state_dir.join("sandboxes");
    let mut pids = qemu_processes_with(&dir.display().to_string());
    for id in except {
        let theirs = qemu_processes_with(id);
        pids.retain(|p| !theirs.contains(p));
    }
    assert_eq!(pids.len(), 1, "one standby QEMU: {pids:?}");
    pids[0]
}

fn wait_ready(s: &Server, n: u64) {
    assert!(
        wait_until(Duration::from_secs(30), || metric(s, READY) == n),
        "{n} standby never ready:\n{}",
        s.log()
    );
}

fn nothing_left(s: &Server) {
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
}

/// One server runs at a time (its slots, links and QEMUs are the namespace's, and every
/// test asserts exact pool metrics), so the tests take turns on it: [`Host::turn`] starts
/// the server a test's [`Kind`] needs, building its template, and stops the other one.
static HOST: Shared<Host> = Shared::new();

struct Host {
    group: Mutex<Option<Group>>,
    /// Turns go in the order the tests asked (the harness starts them in name order, so
    /// each module's tests run together and the server switches once).
    tickets: Mutex<Tickets>,
    next_turn: Condvar,
}

#[derive(Default)]
struct Tickets {
    next: u64,
    serving: u64,
}

/// Which server a test runs on.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    /// One standby per template at most, template `st`: a test follows one QEMU at a time.
    One,
    /// Standbys idle for 3 s are discarded, template `wt`: the pool follows demand.
    Idle,
}

impl Kind {
    fn template(self) -> &'static str {
        match self {
            Kind::One => "st",
            Kind::Idle => "wt",
        }
    }

    fn config(self) -> &'static str {
        match self {
            Kind::One => "standby_per_template = 1",
            Kind::Idle => "standby_idle_secs = 3",
        }
    }
}

/// A server with its extension and template; it counts the creates the tests sent.
struct Group {
    kind: Kind,
    ext: Extension,
    s: Server,
    creates: AtomicUsize,
    built: bool,
    failed: bool,
}

impl Group {
    fn start(kind: Kind) -> Group {
        let ext = Extension::start();
        let s = Server::start(&format!(
            "{}\n[templates]\n{}\n",
            ext.config(),
            kind.config()
        ));
        Group {
            kind,
            ext,
            s,
            creates: AtomicUsize::new(0),
            built: false,
            failed: false,
        }
    }

    /// Builds the template (the only cold boot); its end starts the template's standby.
    fn build(&mut self) {
        build_template(&self.s, self.kind.template());
        wait_ready(&self.s, 1);
        self.built = true;
    }

    /// `POST /sandboxes` from the template, whatever it answers.
    fn claim(&self) -> (u16, serde_json::Value) {
        self.creates.fetch_add(1, Ordering::SeqCst);
        let body = json!({"templateID": self.kind.template(), "timeout": 120});
        self.s.call("POST", "/sandboxes", Some(body))
    }

    /// A sandbox from the template (201).
    fn create(&self) -> String {
        self.creates.fetch_add(1, Ordering::SeqCst);
        self.s.create_from(self.kind.template(), 120)
    }

    /// Stops the server: nothing of it is left, every start-resume the extension saw was
    /// a create's, and every instance was stopped. A failed run keeps its state.
    fn stop(mut self) {
        self.s.stop();
        if self.failed || std::thread::panicking() {
            eprintln!("server kept in {}", self.s.state_dir.display());
            std::mem::forget(self.s);
            return;
        }
        nothing_left(&self.s);
        let resumes = self.ext.requests_for("start-resume");
        assert_eq!(
            resumes.len(),
            self.creates.load(Ordering::SeqCst),
            "a start-resume for each create (the failed one too), none for a standby"
        );
        for r in &resumes {
            assert!(
                self.ext
                    .requests_for("stop")
                    .iter()
                    .any(|st| st.instance_id() == r.instance_id()),
                "no stop for {}",
                r.sandbox_id()
            );
        }
    }
}

impl common::shared::Fixture for Host {
    fn start() -> Host {
        Host {
            group: Mutex::new(None),
            tickets: Mutex::new(Tickets::default()),
            next_turn: Condvar::new(),
        }
    }

    fn stop(self, failed: bool) {
        let group = self
            .group
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(mut group) = group {
            group.failed |= failed;
            group.stop();
        }
    }
}

impl Host {
    /// The server of `kind` to this test alone, with its template built.
    fn turn(&self, kind: Kind) -> Turn<'_> {
        let ticket = {
            let mut t = lock(&self.tickets);
            t.next += 1;
            t.next - 1
        };
        let mut t = lock(&self.tickets);
        while t.serving != ticket {
            t = self
                .next_turn
                .wait(t)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(t);
        let ticket = Ticket(self);
        let mut slot = lock(&self.group);
        if slot.as_ref().is_some_and(|g| g.kind != kind) {
            slot.take().unwrap().stop();
        }
        let group = slot.get_or_insert_with(|| Group::start(kind));
        if !group.built {
            group.build();
        }
        Turn {
            slot,
            _ticket: ticket,
        }
    }
}

/// A test's turn on a server; a test that fails marks the server's state to be kept.
struct Turn<'a> {
    slot: MutexGuard<'a, Option<Group>>,
    _ticket: Ticket<'a>,
}

/// The turn being served: the next one's when dropped (after the server's lock).
struct Ticket<'a>(&'a Host);

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        lock(&self.0.tickets).serving += 1;
        self.0.next_turn.notify_all();
    }
}

impl Deref for Turn<'_> {
    type Target = Group;
    fn deref(&self) -> &Group {
        self.slot.as_ref().expect("a server")
    }
}

impl DerefMut for Turn<'_> {
    fn deref_mut(&mut self) -> &mut Group {
        self.slot.as_mut().expect("a server")
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(g) = self.slot.as_mut() {
                g.failed = true;
            }
        }
    }
}

/// Creates from a template built with `POST /templates`, one standby at a time.
mod one_standby_per_template {
    use super::*;

    /// The build's end starts the template's standby: a warmed-up QEMU whose guest
    /// printed nothing on its console, and of which the extension hears nothing.
    #[test]
    fn a_standby_is_a_silent_warm_qemu_the_extension_never_hears_of() {
        let held = HOST.hold();
        let g = held.turn(Kind::One);
        let s = &g.s;
        wait_ready(s, 1);
        standby_pid(s, &[]);
        let console: Vec<_> = files_under(&s.state_dir.join("sandboxes"))
            .into_iter()
            .filter(|p| p.ends_with("console.log"))
            .collect();
        assert!(
            console
                .iter()
                .all(|p| std::fs::metadata(p).unwrap().len() == 0),
            "a standby's guest printed something: {console:?}"
        );
        // A start-resume for each create the tests sent (none before the first), none for
        // the standby.
        assert_eq!(
            g.ext.requests_for("start-resume").len(),
            g.creates.load(Ordering::SeqCst)
        );
    }

    /// A create whose start-resume fails undoes its standby like any failed create, and
    /// the pool makes another.
    #[test]
    fn a_create_whose_start_resume_fails_undoes_its_standby_and_the_pool_makes_another() {
        let held = HOST.hold();
        let g = held.turn(Kind::One);
        let s = &g.s;
        wait_ready(s, 1);
        let first = standby_pid(s, &[]);
        let hits = metric(s, HITS);
        let resumes = g.ext.requests_for("start-resume").len();
        g.ext.script("start-resume", vec![Behavior::status(500)]);
        let (code, v) = g.claim();
        assert_eq!(code, 502, "{v}");
        assert_eq!(
            metric(s, HITS),
            hits + 1,
            "the failed create took the standby"
        );
        let failed = g.ext.requests_for("start-resume")[resumes]
            .sandbox_id()
            .to_string();
        assert!(
            wait_until(Duration::from_secs(10), || g
                .ext
                .requests_for("stop")
                .iter()
                .any(|r| r.sandbox_id() == failed
                    && r.header("X-Agentenv-Stop-Reason") == Some("start-failed"))),
            "no stop for the failed start"
        );
        assert!(qemu_processes_with(&failed).is_empty());
        let dir = s.state_dir.join("sandboxes").display().to_string();
        assert!(
            !qemu_processes_with(&dir).contains(&first),
            "the claimed standby is gone"
        );
        assert!(!s.state_dir.join("sandboxes").join(&failed).exists());
        assert_eq!(s.call("GET", &format!("/sandboxes/{failed}"), None).0, 404);
        wait_ready(s, 1);
        standby_pid(s, &[]);
    }

    /// A create takes the waiting standby: the sandbox runs in its QEMU; the pool refills.
    #[test]
    fn a_create_runs_in_the_waiting_standbys_qemu_and_the_pool_refills() {
        let held = HOST.hold();
        let g = held.turn(Kind::One);
        let s = &g.s;
        wait_ready(s, 1);
        let waiting = standby_pid(s, &[]);
        let hits = metric(s, HITS);
        let id = g.create();
        assert_eq!(metric(s, HITS), hits + 1);
        assert_eq!(qemu_processes_with(&id), [waiting]);
        assert!(s.log().contains(&format!(
            "sandboxId={id} op=create_from_capture result=ok templateID="
        )));
        assert!(s.log().contains("standby=true"), "{}", s.log());
        assert_eq!(
            sh(s, &id, "echo $FROM_TEMPLATE; cat /proc/uptime >/dev/null"),
            "yes\n"
        );
        wait_ready(s, 1);
        let next = standby_pid(s, &[&id]);
        assert_ne!(next, waiting);
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }

    /// A standby that dies is replaced, never handed out.
    #[test]
    fn a_standby_that_dies_is_replaced_and_never_handed_out() {
        let held = HOST.hold();
        let g = held.turn(Kind::One);
        let s = &g.s;
        wait_ready(s, 1);
        let dead = standby_pid(s, &[]);
        host("kill", &["-9", &dead.to_string()]);
        assert!(
            wait_until(Duration::from_secs(30), || {
                metric(s, READY) == 1 && {
                    let pids =
                        qemu_processes_with(&s.state_dir.join("sandboxes").display().to_string());
                    pids.len() == 1 && !pids.contains(&dead)
                }
            }),
            "the dead standby was not replaced:\n{}",
            s.log()
        );
        assert!(s.log().contains("op=standby result=exited"));
        let hits = metric(s, HITS);
        let second = g.create();
        assert_eq!(metric(s, HITS), hits + 1);
        assert_eq!(sh(s, &second, "echo ok"), "ok\n");
        assert_eq!(
            s.call("DELETE", &format!("/sandboxes/{second}"), None).0,
            204
        );
    }

    /// Shutdown discards the waiting standby. After a restart the template's first create
    /// takes the usual path and starts the pool; deleting the template discards its
    /// standby (a later test's turn builds it again).
    #[test]
    fn the_first_create_after_a_restart_misses_and_a_template_delete_discards_its_standby() {
        let held = HOST.hold();
        let mut g = held.turn(Kind::One);
        wait_ready(&g.s, 1);
        g.s.stop();
        nothing_left(&g.s);
        g.s.spawn();
        let third = g.create();
        let s = &g.s;
        assert_eq!(metric(s, MISSES), 1);
        assert_eq!(sh(s, &third, "echo ok"), "ok\n");
        wait_ready(s, 1);
        assert_eq!(s.call("DELETE", "/templates/st", None).0, 204);
        assert_eq!(metric(s, READY), 0);
        assert!(
            wait_until(Duration::from_secs(10), || qemu_processes_with(
                &s.state_dir.join("sandboxes").display().to_string()
            )
            .len()
                == 1),
            "only the sandbox's QEMU is left"
        );
        assert_eq!(sh(s, &third, "echo still"), "still\n");
        assert_eq!(
            s.call("DELETE", &format!("/sandboxes/{third}"), None).0,
            204
        );
        g.built = false;
    }
}

/// `tcpdump` on `iface` in the network namespace `ns`, writing to a file.
struct Capture {
    ns: String,
    iface: &'static str,
    file: std::path::PathBuf,
    child: std::process::Child,
}

impl Capture {
    fn start(ns: &str, iface: &'static str, dir: &std::path::Path) -> Capture {
        let file = dir.join(format!("{ns}-{iface}.pcap"));
        let child = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "tcpdump",
                "--immediate-mode",
                "-i",
                iface,
                "-n",
                "-U",
                "-w",
            ])
            .arg(&file)
            .stderr(std::fs::File::create(dir.join(format!("{ns}-{iface}.err"))).unwrap())
            .spawn()
            .expect("tcpdump (scripts/setup.sh installs it)");
        Capture {
            ns: ns.to_string(),
            iface,
            file,
            child,
        }
    }

    /// tcpdump said it started: it listens, or (a slot without a tap) why it cannot (its
    /// stderr, next to the capture file).
    fn started(&self) -> bool {
        let err = self.file.with_extension("err");
        std::fs::metadata(err).is_ok_and(|m| m.len() > 0)
    }

    /// Stops the capture; the epoch seconds of every packet it saw.
    fn stop(mut self) -> Vec<f64> {
        host("kill", &["-INT", &self.child.id().to_string()]);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        assert!(
            wait_exit(&mut self.child, deadline).is_some(),
            "tcpdump did not stop"
        );
        let out = std::process::Command::new("tcpdump")
            .args(["-r"])
            .arg(&self.file)
            .args(["-tt", "-n"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(' ').next()?.parse().ok())
            .collect()
    }
}

impl Drop for Capture {
    /// A test that failed before [`Capture::stop`] leaves no tcpdump running.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn set_standbys(s: &Server, template: &str, n: u32) -> serde_json::Value {
    let (code, v) = s.call(
        "PATCH",
        &format!("/templates/{template}"),
        Some(json!({ "standbys": n })),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["standbys"]["max"], n, "{v}");
    v
}

/// What a guest shows of its processes (kernel threads, whose command line is empty, come
/// and go), environment and scratch space: a warm standby's sandbox must show the same as
/// one restored without a warm-up.
fn guest_view(s: &Server, id: &str) -> String {
    sh(
        s,
        id,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline; echo; done | grep . | sort; \
         env | sort; ls -a /tmp /root; id",
    )
}

const TARGET: &str = "agentenv_standby_vms{state=\"target\"}";

/// A pool whose standbys are discarded after 3 s idle, on template `wt`.
mod warm_standbys {
    use super::*;

    /// A warm standby sends nothing until its claim: start-resume, clock, carrier up (the
    /// guest saw its carrier go down and up); the envd call after the claim crosses its tap.
    #[test]
    fn a_warm_standby_sends_nothing_before_its_claim_and_the_claim_brings_its_carrier_up() {
        let held = HOST.hold();
        let g = held.turn(Kind::Idle);
        let s = &g.s;
        // Standbys off for the template, so that the captures run before the next warms up.
        set_standbys(s, "wt", 0);
        wait_ready(s, 0);
        let dir = scratch_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let captures: Vec<Capture> = netns_files()
            .iter()
            .flat_map(|ns| ["tap0", "veth0"].map(|i| Capture::start(ns, i, &dir)))
            .collect();
        assert!(
            wait_until(Duration::from_secs(10), || captures
                .iter()
                .all(Capture::started)),
            "tcpdump did not start"
        );
        set_standbys(s, "wt", 4);
        wait_ready(s, 1);
        let pid = standby_pid(s, &[]);
        let ns = host("ip", &["netns", "identify", &pid.to_string()])
            .trim()
            .to_string();
        assert!(
            captures.iter().any(|c| c.ns == ns),
            "the standby's namespace {ns} was not captured"
        );
        assert!(s.log().contains("op=standby result=ready"));
        // Not a wait for an event: the window in which a ready standby could send.
        std::thread::sleep(Duration::from_secs(1));

        let claimed_at = unix_now();
        let (code, v) = g.claim();
        assert_eq!(code, 201, "{v}");
        let warm = id_of(&v);
        let token = v["envdAccessToken"].as_str().unwrap().to_string();
        assert_eq!(
            qemu_processes_with(&warm),
            [pid],
            "the standby became the sandbox"
        );
        let (out, exit) = envd_sh(
            s,
            &warm,
            &token,
            "cat /sys/class/net/eth0/carrier /sys/class/net/eth0/carrier_down_count",
        );
        assert_eq!(exit, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "1", "carrier up after the claim: {out}");
        assert!(
            lines[1].parse::<u32>().unwrap() >= 1,
            "carrier was down: {out}"
        );

        // Nothing crossed the tap or the slot's veth before the claim; the envd call after
        // it did (the capture sees what it should).
        for c in captures {
            let (theirs, iface) = (c.ns.clone(), c.iface);
            let packets = c.stop();
            if theirs != ns {
                continue;
            }
            let before: Vec<_> = packets.iter().filter(|t| **t < claimed_at).collect();
            assert!(
                before.is_empty(),
                "{iface} in {ns} before the claim: {before:?}"
            );
            if iface == "tap0" {
                let err = std::fs::read_to_string(dir.join(format!("{ns}-{iface}.err")));
                assert!(
                    !packets.is_empty(),
                    "the envd call crossed {iface}: {err:?}"
                );
            }
        }
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{warm}"), None).0, 204);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The pool follows demand: a claim that takes the last standby grows the target;
    /// idle, it shrinks back to one.
    #[test]
    fn the_pool_grows_when_a_claim_takes_its_last_standby_and_shrinks_back_when_idle() {
        let held = HOST.hold();
        let g = held.turn(Kind::Idle);
        let s = &g.s;
        set_standbys(s, "wt", 4);
        assert!(
            wait_until(Duration::from_secs(30), || metric(s, TARGET) == 1
                && metric(s, READY) == 1),
            "the pool does not hold its one standby:\n{}",
            s.log()
        );
        let (code, v) = g.claim();
        assert_eq!(code, 201, "{v}");
        assert!(metric(s, TARGET) >= 2);
        wait_ready(s, 2);
        assert!(
            wait_until(Duration::from_secs(20), || metric(s, TARGET) == 1
                && metric(s, READY) == 1),
            "the pool did not shrink:\n{}",
            s.log()
        );
        assert!(s.log().contains("reason=idle"));
        assert!(metric(s, "agentenv_standby_memory_bytes") > 0);
        // What each warm-up took and what its standby held (docs/performance.md).
        for line in s
            .log()
            .lines()
            .filter(|l| l.contains("op=standby result=ready"))
        {
            eprintln!("{line}");
        }
        let id = id_of(&v);
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }

    /// The warm-up leaves nothing: a warm standby's sandbox shows the same processes,
    /// environment and files as a sandbox restored without one (a miss).
    #[test]
    fn a_warm_standbys_sandbox_shows_what_a_sandbox_restored_without_one_shows() {
        let held = HOST.hold();
        let g = held.turn(Kind::Idle);
        let s = &g.s;
        set_standbys(s, "wt", 1);
        wait_ready(s, 1);
        let (hits, misses) = (metric(s, HITS), metric(s, MISSES));
        let resumes = g.ext.requests_for("start-resume").len();
        let warm = g.create();
        assert_eq!(metric(s, HITS), hits + 1, "a standby's sandbox");
        let warm_view = guest_view(s, &warm);
        assert!(!warm_view.contains("agentenv-warmup"), "{warm_view}");
        set_standbys(s, "wt", 0);
        wait_ready(s, 0);
        let cold = g.create();
        assert_eq!(metric(s, MISSES), misses + 1, "restored without a standby");
        assert_eq!(guest_view(s, &cold), warm_view);
        assert_eq!(
            g.ext.requests_for("start-resume").len(),
            resumes + 2,
            "start-resume only for the two creates"
        );
        for id in [&warm, &cold] {
            assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
        }
    }
}
