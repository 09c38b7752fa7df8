//! End-to-end: the standby pool against the real server and QEMU. A create from a
//! template built with `POST /templates` takes a QEMU started in advance (the standby's
//! process becomes the sandbox's), the pool refills, a standby that dies is replaced, and
//! after server stop and template delete no QEMU, namespace, link or file is left.
//! One template build is the only cold boot.

mod common;

use common::extension::{Behavior, Extension};
use common::*;
use serde_json::json;
use std::time::Duration;

/// A sample of `GET /metrics` (`name{labels}` as written there), 0 when absent.
fn metric(s: &Server, sample: &str) -> u64 {
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
        .unwrap_or(0)
}

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
    let ext = Extension::start();
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n",
        ext.url()
    ));
    build_template(&s, "st");
    // The build's end starts the template's standby: a QEMU waiting for its state, whose
    // guest has not run (its console is empty).
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
