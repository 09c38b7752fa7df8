//! End-to-end, issue 19 items 3 and 5 with the real python SDK against real VMs of the
//! Debian 12 test image: public ports by both addressings, `allowPublicTraffic: false`
//! with the traffic token, `maskRequestHost`, a WebSocket echo through the proxy's
//! tunnel and its idle limit (tests/sdk/ports.py, guest side tests/sdk/ports_guest.py);
//! signed file URLs fetched with no header, then tampered and expired, logging nothing
//! secret (tests/sdk/signed_urls.py); the code interpreter SDK (`e2b-code-interpreter`)
//! running code and managing contexts on the template's port 49999
//! (tests/sdk/code_interpreter.py, guest side tests/sdk/code_interpreter_guest.py).
//! One server and one template build (one cold boot) serve every script.

mod common;

use common::sdk::{run_sdk_with, sdk_tools};
use common::*;
use serde_json::json;
use std::time::Duration;

/// Builds template `name` from the Debian test image (python3 in the guest).
fn build_debian_template(s: &Server, name: &str) {
    let image = debian_image();
    // The template's start command starts tests/sdk/ports_guest.py and
    // tests/sdk/code_interpreter_guest.py in the background and waits until they listen:
    // every sandbox of the template starts with the servers running (python under TCG
    // takes ~20 s to start them in each sandbox otherwise).
    let program = |name: &str| {
        let file = format!("{}/tests/sdk/{name}", env!("CARGO_MANIFEST_DIR"));
        base64_of(&std::fs::read(file).unwrap())
    };
    let start = format!(
        "echo {} | base64 -d > /opt/ports_guest.py && \
         echo {} | base64 -d > /opt/code_interpreter_guest.py && \
         (setsid python3 /opt/ports_guest.py </dev/null >/dev/null 2>&1 &) && \
         (setsid python3 /opt/code_interpreter_guest.py </dev/null >/dev/null 2>&1 &) && \
         until [ -e /tmp/ports-ready ] && [ -e /tmp/code-interpreter-ready ]; do sleep 0.2; done",
        program("ports_guest.py"),
        program("code_interpreter_guest.py")
    );
    let body = json!({"name": name, "image": image, "memoryMB": 512, "cpuCount": 1,
                      "diskSizeMB": 2048, "startCmd": start});
    let (code, t) = s.call("POST", "/templates", Some(body));
    assert_eq!(code, 202, "{t}");
    let ready = wait_until(Duration::from_secs(300), || {
        s.call("GET", &format!("/templates/{name}"), None).1["buildStatus"] == "ready"
    });
    assert!(ready, "template {name} not ready:\n{}", s.log());
}

fn base64_of(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}

#[test]
fn public_ports_and_tunnels_with_the_sdk() {
    let (python, _) = sdk_tools();
    let s = Server::start("[api]\ntunnel_idle_secs = 3\n");
    let started = std::time::Instant::now();
    build_debian_template(&s, "debian");
    println!("template build {:.1}s", started.elapsed().as_secs_f64());
    let started = std::time::Instant::now();
    let template = [("AENV_SDK_TEMPLATE", "debian")];
    let calls = run_sdk_with(&s, &python, "ports.py", None, &template);
    println!(
        "{}\nports.py {:.1}s",
        calls.join("\n"),
        started.elapsed().as_secs_f64()
    );
    let checks = calls.iter().filter(|l| l.contains(": ok ")).count();
    assert!(checks >= 40, "every check ran: {calls:?}");
    let started = std::time::Instant::now();
    let signed = run_sdk_with(&s, &python, "signed_urls.py", None, &template);
    println!(
        "{}\nsigned_urls.py {:.1}s",
        signed.join("\n"),
        started.elapsed().as_secs_f64()
    );
    assert!(signed.iter().filter(|l| l.contains(": ok ")).count() >= 17);
    let log = s.log();
    let out = std::fs::read_to_string(s.state_dir.parent().unwrap().join("signed_urls.py.out"));
    let secrets: Vec<String> = out
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("secret "))
        .map(str::to_string)
        .collect();
    assert_eq!(secrets.len(), 4, "the script printed its URLs' signatures");
    for secret in &secrets {
        assert!(
            !log.contains(secret.as_str()),
            "the server log shows a signature"
        );
    }
    assert!(
        log.contains("op=tunnel") && log.contains("end=Idle"),
        "the tunnels are logged, the quiet one as idle:\n{}",
        common::sdk::tail(&log, 40)
    );
    // The code interpreter SDK's /execute and /contexts on the same template.
    let started = std::time::Instant::now();
    let interpreter = run_sdk_with(&s, &python, "code_interpreter.py", None, &template);
    println!(
        "{}\ncode_interpreter.py {:.1}s",
        interpreter.join("\n"),
        started.elapsed().as_secs_f64()
    );
    assert!(interpreter.iter().filter(|l| l.contains(": ok ")).count() >= 17);
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(left, json!([]), "the scripts kill what they create");
}
