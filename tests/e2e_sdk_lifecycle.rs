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
    let s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 5000\n",
        ext.url()
    ));
    build_template(&s, "base");
    let mut calls = Vec::new();
    let mut timings = Vec::new();
    let python_scripts = ["e2b_defaults.py", "auto_resume.py"];
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
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(left, json!([]), "the scripts kill what they create");
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
