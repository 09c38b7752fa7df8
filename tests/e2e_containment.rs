//! End-to-end containment against the real server: one host has one network owner (a
//! second server refuses to start and the first one's sandbox keeps working).
//! One server and few cold boots serve every assertion, to keep TCG boots few.

mod common;

use common::*;
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn hostile_hosts_and_guests_are_contained() {
    let server = Server::start("");
    let sandbox = server.create(json!({"image": base_image(), "timeout": 600}));
    let id = sandbox["sandboxID"].as_str().unwrap().to_string();
    second_server_is_refused(&server, &id);
}

/// A second server on the host, with its own state dir, exits non-zero with a message
/// naming the host lock, and leaves the first one's network and sandbox alone.
fn second_server_is_refused(first: &Server, id: &str) {
    let netns_before = netns_files();
    assert!(!netns_before.is_empty());
    let second = Server::configure(&scratch_dir(), &[], "");
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentenv"))
        .args(["serve", "--config"])
        .arg(&second.config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a second server kept running next to the first");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("another agentenv server runs on this host")
            && stderr.contains("/run/agentenv/server.lock"),
        "{stderr}"
    );
    assert!(
        !second.state_dir.exists(),
        "the refused server wrote its state dir"
    );
    let _ = std::fs::remove_dir_all(second.state_dir.parent().unwrap());
    assert_eq!(netns_files(), netns_before);
    let v = first.exec(id, "echo", &["still", "here"]);
    assert_eq!(v["stdout"], "still here\n", "{v}");
}
