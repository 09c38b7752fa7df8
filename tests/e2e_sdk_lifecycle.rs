//! End-to-end, issue 20 with the real E2B SDKs against real VMs: E2B's defaults on E2B's
//! route, list filters and `Idempotency-Key` (tests/sdk/e2b_defaults.py), auto-resume
//! (python and JS), filesystem-only pause, metrics history and envd 0.6 file metadata.
//! One server and one template build (one cold boot) serve every script.

mod common;

use common::extension::Extension;
use common::sdk::{run_sdk, sdk_tools};
use common::*;
use serde_json::json;

#[test]
fn e2b_lifecycle_with_the_sdks() {
    let (python, js_module) = sdk_tools();
    // A real extension, to see that every wake is one start-resume (and each pause a stop).
    let ext = Extension::start();
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 5000\n",
        ext.url()
    ));
    build_template(&s, "base");
    let mut calls = Vec::new();
    let mut timings = Vec::new();
    let python_scripts = [
        "e2b_defaults.py",
        "auto_resume.py",
        "fs_pause.py",
        "file_metadata.py",
    ];
    for script in python_scripts {
        let started = std::time::Instant::now();
        calls.extend(run_sdk(&s, &python, script, None));
        timings.push(format!("{script} {:.1}s", started.elapsed().as_secs_f64()));
    }
    let started = std::time::Instant::now();
    calls.extend(run_sdk(&s, "node", "auto_resume.mjs", Some(&js_module)));
    timings.push(format!(
        "auto_resume.mjs {:.1}s",
        started.elapsed().as_secs_f64()
    ));
    println!("{}\n{}", calls.join("\n"), timings.join("\n"));
    for line in calls.iter().filter_map(|l| l.split_once(": ok woke ")) {
        let (id, wakes) = line.1.split_once(' ').unwrap();
        one_start_resume_per_wake(&ext, id, wakes.parse().unwrap());
    }
    // A cold resume is a resume to the extension: stop, then start-resume.
    for line in calls.iter().filter_map(|l| l.split_once(": ok cold ")) {
        let (id, resumes) = line.1.split_once(' ').unwrap();
        one_start_resume_per_wake(&ext, id, resumes.parse().unwrap());
    }
    let left = calls
        .iter()
        .find_map(|l| l.split_once("fs_pause.py: ok left "))
        .map(|(_, id)| id.to_string())
        .expect("fs_pause.py leaves its timeout-paused sandbox");
    filesystem_pause_survives_a_restart(&mut s, &ext, &left);
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(left, json!([]), "the scripts kill what they create");
}

/// The sandbox `id` that fs_pause.py left paused filesystem-only by its timeout: its
/// directory holds its disk and no memory; a restarted server brings it back paused
/// (`pauseMode` kept) and connect cold-boots it with its file, without its process.
fn filesystem_pause_survives_a_restart(s: &mut Server, ext: &Extension, id: &str) {
    let dir = s.state_dir.join("sandboxes").join(id);
    let files = files_under(&dir);
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with(".qcow2")),
        "its disk is kept: {names:?}"
    );
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("state.bin") || n.contains("pages")),
        "no state file or guest memory was written: {names:?}"
    );
    assert!(!dir.join("paused").exists(), "{names:?}");
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("record.json")).unwrap()).unwrap();
    assert_eq!(record["paused"]["filesystemOnly"], true, "{record}");
    assert_eq!(record["info"]["pauseMode"], "filesystem", "{record}");

    s.stop();
    s.spawn();
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{v}");
    assert_eq!(
        (v["state"].as_str(), v["pauseMode"].as_str()),
        (Some("paused"), Some("filesystem")),
        "{v}"
    );
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(
        sh(s, id, "cat /home/user/timeout.txt"),
        "kept across a timeout pause\n"
    );
    // By /proc: the guest has no pgrep.
    let sleeping = "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] \
                    && echo alive && exit 0; done; echo gone";
    assert_eq!(sh(s, id, sleeping), "gone\n", "the process is gone");
    one_start_resume_per_wake(ext, id, 1);
    let (code, _) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204);
}

/// Each wake was one resume as the extension sees any: stop (the pause), then
/// start-resume, `wakes` times; concurrent wakers shared theirs.
fn one_start_resume_per_wake(ext: &Extension, id: &str, wakes: usize) {
    let hooks: Vec<String> = ext
        .requests()
        .into_iter()
        .filter(|r| r.sandbox_id() == id)
        .map(|r| r.hook)
        .collect();
    let resumes = hooks.iter().filter(|h| *h == "start-resume").count();
    assert_eq!(resumes, wakes + 1, "sandbox {id}: one start-resume for the create from the template and one per wake: {hooks:?}");
    let mut pauses = hooks.iter().skip_while(|h| *h != "stop");
    for _ in 0..wakes {
        assert_eq!(pauses.next().map(String::as_str), Some("stop"), "{hooks:?}");
        assert_eq!(
            pauses.next().map(String::as_str),
            Some("start-resume"),
            "{hooks:?}"
        );
    }
}
