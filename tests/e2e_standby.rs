//! End-to-end: the standby pool against the real server and QEMU. A create from a
//! template built with `POST /templates` takes a QEMU started in advance (the standby's
//! process becomes the sandbox's), the pool refills, a standby that dies is replaced, and
//! after server stop and template delete no QEMU, namespace, link or file is left.
//! One template build is the only cold boot.

mod common;

use common::cluster::envd_sh;
use common::extension::{Behavior, Extension};
use common::*;
use serde_json::json;
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

#[test]
fn creates_from_a_built_template_use_standbys_and_nothing_is_left() {
    let _serial = serial();
    let ext = Extension::start();
    // One standby per template at most: this test follows one QEMU at a time.
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n\n[templates]\nstandby_per_template = 1\n",
        ext.url()
    ));
    build_template(&s, "st");
    // The build's end starts the template's standby: a warmed-up QEMU whose guest printed
    // nothing on its console.
    wait_ready(&s, 1);
    let first = standby_pid(&s, &[]);
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

    // The extension hears nothing of a standby.
    assert!(ext.requests_for("start-resume").is_empty());

    // A create whose start-resume fails undoes its standby like any failed create, and
    // the pool makes another.
    ext.script("start-resume", vec![Behavior::status(500)]);
    let (code, v) = s.call(
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "st", "timeout": 120})),
    );
    assert_eq!(code, 502, "{v}");
    let failed = ext.requests_for("start-resume")[0].sandbox_id().to_string();
    assert!(
        wait_until(Duration::from_secs(10), || ext
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
    wait_ready(&s, 1);
    let waiting = standby_pid(&s, &[]);

    // A create takes it: the sandbox runs in the QEMU that was waiting.
    let id = s.create_from("st", 120);
    assert_eq!(metric(&s, HITS), 2);
    assert_eq!(qemu_processes_with(&id), [waiting]);
    assert!(s.log().contains(&format!(
        "sandboxId={id} op=create_from_capture result=ok templateID="
    )));
    assert!(s.log().contains("standby=true"), "{}", s.log());
    assert_eq!(
        sh(&s, &id, "echo $FROM_TEMPLATE; cat /proc/uptime >/dev/null"),
        "yes\n"
    );
    // The pool refills; a standby that dies is replaced, never handed out.
    wait_ready(&s, 1);
    let next = standby_pid(&s, &[&id]);
    assert_ne!(next, waiting);
    host("kill", &["-9", &next.to_string()]);
    assert!(
        wait_until(Duration::from_secs(30), || {
            metric(&s, READY) == 1 && {
                let pids =
                    qemu_processes_with(&s.state_dir.join("sandboxes").display().to_string());
                pids.len() == 2 && !pids.contains(&next)
            }
        }),
        "the dead standby was not replaced:\n{}",
        s.log()
    );
    assert!(s.log().contains("op=standby result=exited"));
    let second = s.create_from("st", 120);
    assert_eq!(metric(&s, HITS), 3);
    assert_eq!(sh(&s, &second, "echo ok"), "ok\n");
    for sb in [&id, &second] {
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{sb}"), None).0, 204);
    }

    // Shutdown discards the waiting standby.
    wait_ready(&s, 1);
    s.stop();
    nothing_left(&s);

    // After a restart the template's first create takes the usual path and starts the
    // pool; deleting the template discards its standby.
    s.spawn();
    let third = s.create_from("st", 120);
    assert_eq!(metric(&s, MISSES), 1);
    assert_eq!(sh(&s, &third, "echo ok"), "ok\n");
    wait_ready(&s, 1);
    assert_eq!(s.call("DELETE", "/templates/st", None).0, 204);
    assert_eq!(metric(&s, READY), 0);
    assert!(
        wait_until(Duration::from_secs(10), || qemu_processes_with(
            &s.state_dir.join("sandboxes").display().to_string()
        )
        .len()
            == 1),
        "only the sandbox's QEMU is left"
    );
    assert_eq!(sh(&s, &third, "echo still"), "still\n");
    assert_eq!(
        s.call("DELETE", &format!("/sandboxes/{third}"), None).0,
        204
    );
    s.stop();
    nothing_left(&s);
    // Every start-resume the extension saw was a create's, and every instance was stopped.
    let resumes = ext.requests_for("start-resume");
    assert_eq!(
        resumes.len(),
        4,
        "the failed create and three created sandboxes"
    );
    for r in &resumes {
        assert!(
            ext.requests_for("stop")
                .iter()
                .any(|st| st.instance_id() == r.instance_id()),
            "no stop for {}",
            r.sandbox_id()
        );
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

#[test]
fn a_warm_standby_sends_nothing_leaves_nothing_and_the_pool_follows_demand() {
    let _serial = serial();
    let ext = Extension::start();
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n\n[templates]\nstandby_idle_secs = 3\n",
        ext.url()
    ));
    build_template(&s, "wt");
    wait_ready(&s, 1);
    // Standbys off for the template, so that the captures run before the next warms up.
    set_standbys(&s, "wt", 0);
    wait_ready(&s, 0);
    let dir = scratch_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let captures: Vec<Capture> = netns_files()
        .iter()
        .flat_map(|ns| ["tap0", "veth0"].map(|i| Capture::start(ns, i, &dir)))
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    set_standbys(&s, "wt", 4);
    wait_ready(&s, 1);
    let pid = standby_pid(&s, &[]);
    let ns = host("ip", &["netns", "identify", &pid.to_string()])
        .trim()
        .to_string();
    assert!(
        captures.iter().any(|c| c.ns == ns),
        "the standby's namespace {ns} was not captured"
    );
    assert!(s.log().contains("op=standby result=ready"));
    std::thread::sleep(Duration::from_secs(1));

    // The claim: start-resume, clock, carrier up. The guest saw its carrier go down and up.
    let claimed_at = unix_now();
    let (code, v) = s.call(
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "wt", "timeout": 120})),
    );
    assert_eq!(code, 201, "{v}");
    let warm = id_of(&v);
    let token = v["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(
        qemu_processes_with(&warm),
        [pid],
        "the standby became the sandbox"
    );
    let (out, exit) = envd_sh(
        &s,
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

    // Nothing crossed the tap or the slot's veth before the claim; the envd call after it
    // did (the capture sees what it should).
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

    // The pool follows demand: the claim took the last standby, so the target grew; idle,
    // it shrinks back to one.
    assert!(metric(&s, TARGET) >= 2);
    wait_ready(&s, 2);
    assert!(
        wait_until(Duration::from_secs(20), || metric(&s, TARGET) == 1
            && metric(&s, READY) == 1),
        "the pool did not shrink:\n{}",
        s.log()
    );
    assert!(s.log().contains("reason=idle"));
    assert!(metric(&s, "agentenv_standby_memory_bytes") > 0);
    // What each warm-up took and what its standby held (docs/performance.md).
    for line in s
        .log()
        .lines()
        .filter(|l| l.contains("op=standby result=ready"))
    {
        eprintln!("{line}");
    }

    // The warm-up left nothing: the same processes, environment and files as a sandbox
    // restored without one (a miss).
    let warm_view = guest_view(&s, &warm);
    assert!(!warm_view.contains("agentenv-warmup"), "{warm_view}");
    set_standbys(&s, "wt", 0);
    wait_ready(&s, 0);
    let cold = s.create_from("wt", 120);
    assert_eq!(guest_view(&s, &cold), warm_view);
    assert_eq!(
        ext.requests_for("start-resume").len(),
        2,
        "start-resume only for the two creates"
    );
    for id in [&warm, &cold] {
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }
    s.stop();
    nothing_left(&s);
}
