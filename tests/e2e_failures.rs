//! End-to-end failure paths against the real server: a guest that never becomes ready is
//! killed and reported with nothing left behind, and a server killed with SIGKILL is
//! cleaned up by the next start; a `base` whose build failed is built again. The tests
//! take turns (`serial`): each checks what its servers leave on the host.

mod common;

use common::extension::{Behavior, Extension};
use common::*;
use serde_json::json;
use std::time::Duration;

#[test]
fn failures_leave_nothing() {
    let _serial = serial();
    guest_never_ready();
    crash_then_restart_reclaims();
    crash_during_pause();
}

/// Pooled slots the server reports, to tell them from leaks.
fn pooled_slots(s: &Server) -> usize {
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("agentenv_network_slots{state=\"pooled\"}"))
        .unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

fn guest_never_ready() {
    // Assets whose initramfs is garbage: the kernel finds no init and the guest agent
    // never answers.
    let assets = std::env::temp_dir().join(format!("aenv-bad-assets-{}", std::process::id()));
    std::fs::create_dir_all(&assets).unwrap();
    let kernel = agentenv::vm::guest_kernel(&assets_dir());
    let _ = std::fs::remove_file(assets.join("vmlinuz"));
    std::os::unix::fs::symlink(&kernel, assets.join("vmlinuz")).unwrap();
    std::fs::write(assets.join("initramfs.img"), vec![0x5au8; 4096]).unwrap();
    let mut server = Server::builder()
        .vm("ready_timeout_secs", 5)
        .vm("assets_dir", format!("{:?}", assets.display().to_string()))
        .start();
    let (code, v) = server.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image()})),
    );
    assert_eq!(code, 500, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("guest agent did not become ready"),
        "{v}"
    );
    let log = server.log();
    assert!(log.contains("op=launch result=error"), "{log}");
    assert!(log.contains("console_tail"), "console tail logged: {log}");
    assert!(files_under(&server.state_dir.join("sandboxes")).is_empty());
    assert!(qemu_processes_with(&server.state_dir.display().to_string()).is_empty());
    let (_, list) = server.call("GET", "/v2/sandboxes", None);
    assert_eq!(list, json!([]));
    // Only pooled slots remain (the failed one was destroyed or went back to the pool).
    assert!(wait_until(Duration::from_secs(5), || netns_files().len()
        == pooled_slots(&server)));
    server.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    let _ = std::fs::remove_dir_all(&assets);
}

fn crash_then_restart_reclaims() {
    let mut server = Server::start("");
    let sb = server.create(json!({"image": base_image(), "timeout": 600}));
    let id = sb["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(qemu_processes_with(&id).len(), 1);
    server.crash();
    // QEMU dies with its supervisor thread (PR_SET_PDEATHSIG).
    assert!(
        wait_until(Duration::from_secs(10), || qemu_processes_with(&id)
            .is_empty()),
        "qemu outlived the crashed server"
    );
    assert!(
        !netns_files().is_empty(),
        "a crash leaves the slots for the next start"
    );
    server.spawn();
    let (code, _) = server.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404);
    assert!(!server.state_dir.join("sandboxes").join(&id).exists());
    assert!(wait_until(Duration::from_secs(5), || netns_files().len()
        == pooled_slots(&server)));
    let log = server.log();
    assert!(
        log.contains(&format!("sandboxId={id} op=recover result=lost")),
        "{log}"
    );
    server.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
}

/// kill -9 while a pause is in flight: after the restart the sandbox is either paused and
/// resumable, or gone; nothing leaks either way.
fn crash_during_pause() {
    let mut server = Server::start("");
    let sb = server.create(json!({"image": base_image(), "timeout": 600}));
    let id = sb["sandboxID"].as_str().unwrap().to_string();
    let url = format!("{}/sandboxes/{id}/pause", server.base);
    let pause = std::thread::spawn(move || {
        let _ = ureq::post(&url)
            .set("X-API-Key", API_KEY)
            .timeout(Duration::from_secs(30))
            .call();
    });
    std::thread::sleep(Duration::from_millis(60));
    server.crash();
    pause.join().unwrap();
    assert!(wait_until(Duration::from_secs(10), || qemu_processes_with(
        &id
    )
    .is_empty()));
    server.spawn();
    let (code, v) = server.call("GET", &format!("/sandboxes/{id}"), None);
    match code {
        404 => assert!(!server.state_dir.join("sandboxes").join(&id).exists()),
        200 => {
            assert_eq!(v["state"], "paused", "{v}");
            let (code, r) = server.call("POST", &format!("/sandboxes/{id}/resume"), None);
            assert_eq!(code, 201, "{r}");
            let out = server.exec(&id, "echo", &["back"]);
            assert_eq!(out["stdout"], "back\n");
            assert_eq!(
                server.call("DELETE", &format!("/sandboxes/{id}"), None).0,
                204
            );
        }
        other => panic!("unexpected {other}: {v}"),
    }
    server.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&server.state_dir.display().to_string()).is_empty());
    assert!(files_under(&server.state_dir.join("sandboxes")).is_empty());
}

/// `base` (built at startup, its build VM announced to the extension like any sandbox)
/// whose build failed because the extension answered 500: built again after the backoff,
/// counted and logged; then a create from it works, and nothing is left.
#[test]
fn a_failed_base_build_is_retried_until_base_is_ready() {
    let _serial = serial();
    let ext = Extension::start();
    ext.script("start-fresh", vec![Behavior::status(500)]);
    let mut server = Server::builder()
        .section(&ext.config())
        .env("AENV_TEMPLATES_BUILD_BASE", "true")
        .start();
    let status = |s: &Server| s.call("GET", "/templates/base", None).1["buildStatus"].clone();
    // The first build fails on the 500: the keeper logs it and when it builds again.
    assert!(
        wait_until(Duration::from_secs(120), || server.log().contains(
            "op=template_build name=base result=error failures=1 retry_in_s=5"
        )),
        "no failed base build logged:\n{}",
        server.log()
    );
    assert!(
        wait_until(Duration::from_secs(240), || status(&server) == "ready"),
        "base never became ready: {}\n{}",
        status(&server),
        server.log()
    );
    assert_eq!(metric(&server, "agentenv_base_template_retries_total"), 1);
    assert!(server
        .log()
        .contains("op=template_build name=base result=retry retries=1"));
    // Two build VMs announced: the refused one and the one that built.
    let fresh = ext.requests_for("start-fresh");
    assert_eq!(fresh.len(), 2, "{fresh:?}");
    assert_eq!(ext.answer_of(&fresh[0]), Some(500));
    assert_eq!(ext.answer_of(&fresh[1]), Some(200));
    // One template named base: the failed build is forgotten, not listed beside it.
    let (_, list) = server.call("GET", "/templates", None);
    let named_base = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["name"] == "base"
                || t["aliases"]
                    .as_array()
                    .is_some_and(|a| a.contains(&json!("base")))
        })
        .count();
    assert_eq!(named_base, 1, "{list}");
    // What `Sandbox.create()` without a template asks for now works.
    let id = server.create_from("base", 600);
    assert_eq!(
        server.call("DELETE", &format!("/sandboxes/{id}"), None).0,
        204
    );
    server.stop();
    common::shared::assert_server_left_nothing(&server);
}
