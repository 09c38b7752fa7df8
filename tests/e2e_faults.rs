//! End-to-end host faults against the real server, real VMs and a real recording
//! extension (issue 24): a sandbox whose QEMU is SIGKILLed is stopped with reason
//! `failure`, answers 404 naming the death and the quarantine, and its files are kept
//! there with a disk whose backing chain resolves; the other sandbox runs on.

mod common;

use common::extension::Extension;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn metric(s: &Server, line_start: &str) -> Option<f64> {
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Directories in `<state>/quarantine`.
fn quarantined(s: &Server) -> Vec<PathBuf> {
    std::fs::read_dir(s.state_dir.join("quarantine"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_vm_that_dies_is_stopped_and_quarantined() {
    let ext = Extension::start();
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n",
        ext.url()
    ));
    let victim = id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
    let other = id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
    sh(&s, &victim, "echo kept > /root/proof; sync");
    let pids = qemu_processes_with(&victim);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let killed = Instant::now();
    host("kill", &["-KILL", &pids[0].to_string()]);

    let stops = ext.wait_for("stop", 1, Duration::from_secs(10));
    let stopped_after = killed.elapsed();
    assert_eq!(stops[0].sandbox_id(), victim);
    assert_eq!(stops[0].header("X-Agentenv-Stop-Reason"), Some("failure"));
    assert!(
        stopped_after < Duration::from_secs(5),
        "the stop came {stopped_after:?} after the kill"
    );
    let (code, v) = s.call("GET", &format!("/sandboxes/{victim}"), None);
    assert_eq!(code, 404, "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("died on its own"), "{msg}");
    assert!(msg.contains("SIGKILL"), "{msg}");
    assert!(msg.contains("quarantine"), "{msg}");
    let (code, v) = s.call("POST", &format!("/sandboxes/{victim}/pause"), None);
    assert_eq!(code, 404, "{v}");
    assert!(v["message"].as_str().unwrap().contains("died"), "{v}");

    // The run dir is in quarantine, with a reason and a disk whose chain resolves.
    assert!(wait_until(Duration::from_secs(5), || quarantined(&s).len() == 1));
    let kept = quarantined(&s).remove(0);
    assert!(
        msg.contains(&kept.display().to_string()),
        "{msg} vs {kept:?}"
    );
    let why = std::fs::read_to_string(kept.with_extension("reason")).unwrap();
    assert!(why.contains("killed by signal 9 (SIGKILL)"), "{why}");
    for f in ["record.json", "console.log", "disk.qcow2"] {
        assert!(kept.join(f).is_file(), "{f} kept in {kept:?}");
    }
    assert_backing_chain_resolves(&kept.join("disk.qcow2"));
    assert!(!s.state_dir.join("sandboxes").join(&victim).exists());
    assert!(s
        .log()
        .contains(&format!("sandboxId={victim} op=watch result=vm_died")));
    assert_eq!(
        metric(
            &s,
            "agentenv_vm_deaths_total{kind=\"sandbox\",cause=\"SIGKILL\"}"
        ),
        Some(1.0)
    );

    // The other sandbox is untouched.
    assert_eq!(sh(&s, &other, "echo alive"), "alive\n");
    let (_, list) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(
        s.call("DELETE", &format!("/sandboxes/{other}"), None).0,
        204
    );
    s.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    let stops = ext.requests_for("stop");
    assert_eq!(stops.len(), 2, "one stop per start");
}

/// `qemu-img info --backing-chain` opens every layer of `disk`'s chain.
fn assert_backing_chain_resolves(disk: &Path) {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain", "--output=json"])
        .arg(disk)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chain: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let chain = chain.as_array().unwrap();
    assert!(chain.len() >= 2, "an overlay over its base: {chain:?}");
}
