//! End-to-end: the E2B control-plane routes and the envd proxy, first over plain HTTP, then
//! driven by the real E2B SDKs (python `e2b`, JS `e2b`, installed by scripts/setup.sh).
//! One template build (one cold boot) serves every sandbox here; each sandbox is a
//! restore from it.

mod common;

use common::sdk::{run_sdk, sdk_tools};
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// A request to a sandbox's envd through the API port, with the given extra headers.
fn envd(s: &Server, method: &str, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req =
        ureq::request(method, &format!("{}{}", s.base, path)).timeout(Duration::from_secs(60));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    match req.call() {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

/// One server and one template for everything (servers cannot run side by side).
#[test]
fn e2b_sdks_end_to_end() {
    let (python, js_module) = sdk_tools();
    // Guests sampled every second, so get_metrics has a history within the test.
    let s = Server::start("[metrics]\nsandbox_interval_secs = 1\n");
    build_template(&s, "base");
    control_plane_and_envd_routing(&s);
    let mut calls = Vec::new();
    for script in [
        "lifecycle.py",
        "commands.py",
        "files.py",
        "pty_watch.py",
        "latency.py",
    ] {
        calls.extend(run_sdk(&s, &python, script, None));
    }
    calls.extend(run_sdk(&s, "node", "basic.mjs", Some(&js_module)));
    // Every call the scripts tried, for the log of a passing run.
    println!("{}", calls.join("\n"));
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(left, json!([]), "the scripts kill what they create");
}

/// The control-plane routes the SDKs call, and the envd proxy's routing and credentials,
/// checked with plain HTTP against the guest's `/health`.
fn control_plane_and_envd_routing(s: &Server) {
    let missing = "0190f3c4-1c2d-7e3f-8a4b-5c6d7e8f9a0b";

    // Connect: 404 for an unknown sandbox before any body check.
    let (code, _) = s.raw(&format!(
        "POST /v2/sandboxes/{missing}/connect HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{{{{{{"
    ));
    assert_eq!(code, 404);

    // Create as the SDKs do: POST /v2/sandboxes, body sent chunked (the JS SDK does).
    let body = json!({"templateID": "base", "timeout": 600, "metadata": {"suite": "sdk"},
                      "envVars": {"FROM_CREATE": "1"}, "secure": true, "autoPause": false,
                      "allow_internet_access": false})
    .to_string();
    let chunked = format!("{:x}\r\n{body}\r\n0\r\n\r\n", body.len());
    let (code, text) = s.raw(&format!(
        "POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\n\
         Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunked}"
    ));
    assert_eq!(code, 201, "{text}\n{}", s.log());
    let created: Value = serde_json::from_str(text.split_once("\r\n\r\n").unwrap().1).unwrap();
    let id = created["sandboxID"].as_str().unwrap().to_string();
    let token = created["envdAccessToken"].as_str().unwrap().to_string();
    assert_eq!(token.len(), 64, "{created}");
    assert_eq!(created["envdVersion"], "0.6.4");

    // get_info carries the token; the list does not.
    let (code, detail) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200);
    assert_eq!(detail["envdAccessToken"], token.as_str());
    assert_eq!(detail["metadata"]["suite"], "sdk");
    let (_, list) = s.call(
        "GET",
        "/v2/sandboxes?state=running&metadata=suite%3Dsdk",
        None,
    );
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert!(list[0].get("envdAccessToken").is_none());

    // envd through the API port: by header, and by Host.
    let by_header = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", token.as_str()),
    ];
    let (code, text) = envd(s, "GET", "/health", &by_header);
    assert_eq!(code, 200, "the guest's own /health answers: {text}");
    let host = format!("49983-{id}.sandbox.test");
    let (code, _) = envd(
        s,
        "GET",
        "/health",
        &[("Host", &host), ("X-Access-Token", &token)],
    );
    assert_eq!(code, 200);
    let (code, _) = envd(
        s,
        "GET",
        "/health",
        &[("E2b-Sandbox-Id", &id), ("X-API-Key", API_KEY)],
    );
    assert_eq!(code, 200, "the API key opens every sandbox");

    // Without the right credential: 401, whether or not the sandbox exists.
    for headers in [
        vec![("E2b-Sandbox-Id", id.as_str())],
        vec![("E2b-Sandbox-Id", id.as_str()), ("X-Access-Token", "wrong")],
        vec![("E2b-Sandbox-Id", missing), ("X-Access-Token", "wrong")],
        vec![
            ("E2b-Sandbox-Id", missing),
            ("X-Access-Token", token.as_str()),
        ],
        vec![("Host", host.as_str())],
    ] {
        let (code, text) = envd(s, "GET", "/health", &headers);
        assert_eq!(code, 401, "{headers:?}: {text}");
        assert!(!text.contains(&id) && !text.contains(missing), "{text}");
    }
    // An unknown sandbox with the API key: not running.
    let (code, text) = envd(
        s,
        "GET",
        "/health",
        &[("E2b-Sandbox-Id", missing), ("X-API-Key", API_KEY)],
    );
    assert_eq!(code, 502);
    assert!(text.contains("was not found"), "{text}");
    // The server's own /health is unaffected.
    assert_eq!(envd(s, "GET", "/health", &[]).0, 204);

    // Connect with {} on a running sandbox: 200, default timeout, same token.
    let (code, v) = s.call(
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(json!({})),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["envdAccessToken"], token.as_str());

    // Metrics of several sandboxes: the newest sample of each known one.
    let (code, m) = s.call(
        "GET",
        &format!("/sandboxes/metrics?sandbox_ids={id},{missing}"),
        None,
    );
    assert_eq!(code, 200, "{m}");
    let known = m["sandboxes"].as_object().unwrap();
    assert_eq!(known.keys().collect::<Vec<_>>(), vec![&id], "{m}");
    assert!(known[&id]["memTotal"].as_u64().unwrap() > 0, "{m}");
    for bad in ["", "sandbox_ids=", "sandbox_ids=x", "sandbox_ids=a,b&x"] {
        let (code, v) = s.call("GET", &format!("/sandboxes/metrics?{bad}"), None);
        assert_eq!(code, 400, "{bad}: {v}");
    }
    let (code, v) = s.call(
        "GET",
        &format!("/sandboxes/{id}/metrics?start=9&end=3"),
        None,
    );
    assert_eq!(code, 400, "start > end: {v}");

    // Paused: "was not found" for the token holder, 401 for others; connect resumes it
    // with the same token.
    assert_eq!(
        s.call("POST", &format!("/sandboxes/{id}/pause"), None).0,
        204
    );
    let (code, text) = envd(s, "GET", "/health", &by_header);
    assert_eq!(code, 502, "{text}");
    assert!(text.contains("was not found"), "{text}");
    let (_, list) = s.call("GET", "/v2/sandboxes?state=paused", None);
    assert_eq!(list[0]["sandboxID"], id.as_str(), "{list}");
    let (code, v) = s.call(
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(json!({"timeout": 120})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(v["envdAccessToken"], token.as_str());
    let (code, _) = envd(s, "GET", "/health", &by_header);
    assert_eq!(code, 200, "the resumed guest answers again");
    sandbox_logs(s, &id);

    // Killed: "was not found" for the token holder (the SDK's is_running() is false).
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    let (code, text) = envd(s, "GET", "/health", &by_header);
    assert_eq!(code, 502);
    assert!(text.contains("was not found"), "{text}");
    let (code, _) = envd(
        s,
        "GET",
        "/health",
        &[("E2b-Sandbox-Id", &id), ("X-Access-Token", "wrong")],
    );
    assert_eq!(code, 401);
    let (code, _) = s.call(
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        Some(json!({})),
    );
    assert_eq!(code, 404);
}

/// `GET /v2/sandboxes/{id}/logs`: what happened to the sandbox, and what its guest wrote
/// on its console, in E2B's schema, with its filters.
fn sandbox_logs(s: &Server, id: &str) {
    sh(s, id, "echo console-marker-42 > /dev/console");
    let (code, v) = s.call("GET", &format!("/v2/sandboxes/{id}/logs"), None);
    assert_eq!(code, 200, "{v}");
    let logs = v["logs"].as_array().unwrap();
    let ops: Vec<&str> = logs
        .iter()
        .filter(|e| e["fields"]["source"] == "agentenv")
        .map(|e| e["fields"]["operation"].as_str().unwrap())
        .collect();
    assert_eq!(ops, ["create", "pause", "resume"], "{v}");
    assert!(
        logs.iter().all(|e| e["level"] == "info"
            && e["timestamp"].as_str().unwrap().ends_with('Z')
            && e["message"].is_string()),
        "{v}"
    );
    // The guest's write returns before its serial port has sent the line to QEMU's
    // console file: wait (bounded) for the line to be there.
    let search = format!("/v2/sandboxes/{id}/logs?search=console-marker-42");
    let mut found = Value::Null;
    wait_until(Duration::from_secs(10), || {
        found = s.call("GET", &search, None).1;
        found["logs"].as_array().is_some_and(|l| !l.is_empty())
    });
    let found = found["logs"].as_array().unwrap();
    assert_eq!(found.len(), 1, "the guest's console line: {found:?}");
    assert_eq!(found[0]["fields"]["source"], "console");
    let (_, last) = s.call(
        "GET",
        &format!("/v2/sandboxes/{id}/logs?direction=backward&limit=1&search=resumed"),
        None,
    );
    assert_eq!(last["logs"][0]["message"], "resumed", "{last}");
    let (_, none) = s.call("GET", &format!("/v2/sandboxes/{id}/logs?level=warn"), None);
    assert_eq!(none["logs"], json!([]), "nothing failed: {none}");
    for bad in [
        "limit=0",
        "limit=1001",
        "direction=up",
        "level=loud",
        "cursor=x",
    ] {
        let (code, v) = s.call("GET", &format!("/v2/sandboxes/{id}/logs?{bad}"), None);
        assert_eq!(code, 400, "{bad}: {v}");
    }
}
