//! End-to-end API rules against the real server binary: authentication, errors, body
//! rules and image errors. No VM is booted here.

mod common;

use common::*;
use serde_json::json;

#[test]
fn api_rules_without_vms() {
    let server = Server::start("");
    health_and_auth(&server);
    routing_errors(&server);
    body_rules(&server);
    bad_images_leave_nothing(&server);
    metrics(&server);
    openapi_document(&server);
}

/// `GET /openapi.json` needs no key and serves docs/openapi.json as built in.
fn openapi_document(s: &Server) {
    let answer = ureq::get(&format!("{}/openapi.json", s.base))
        .call()
        .expect("GET /openapi.json without a key");
    assert_eq!(answer.header("Content-Type"), Some("application/json"));
    let served: serde_json::Value = answer.into_json().unwrap();
    let file =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json")).unwrap();
    assert_eq!(
        served,
        serde_json::from_str::<serde_json::Value>(&file).unwrap()
    );
    assert_eq!(served["openapi"], "3.1.0");
}

fn health_and_auth(s: &Server) {
    let (code, _) = s.raw("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_eq!(code, 204, "health needs no key");
    let (code, body) = s.raw("GET /sandboxes HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_eq!(code, 401);
    assert!(
        body.contains(r#"{"code":401,"message":"missing or invalid X-API-Key header"}"#),
        "{body}"
    );
    assert!(
        body.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{body}"
    );
    let wrong = format!(
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {}x\r\nConnection: close\r\n\r\n",
        &API_KEY[..API_KEY.len() - 1]
    );
    assert_eq!(s.raw(&wrong).0, 401);
    let twice = format!(
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nX-API-Key: {API_KEY}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(s.raw(&twice).0, 401, "two X-API-Key headers");
    let bearer = format!("GET /sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n\r\n");
    assert_eq!(s.raw(&bearer).0, 401);
    let ok = format!(
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(s.raw(&ok).0, 200);
    // Authentication runs before routing.
    assert_eq!(
        s.raw("GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .0,
        401
    );
    let (code, _) = s.call("GET", "/nope", None);
    assert_eq!(code, 404);
}

fn routing_errors(s: &Server) {
    let id = "01900000-0000-7000-8000-000000000000";
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404, "{v}");
    assert_eq!(v["code"], 404);
    let (code, _) = s.call("GET", "/sandboxes/not-a-uuid", None);
    assert_eq!(code, 404);
    let (code, _) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404);
    let req = format!("PUT /sandboxes/{id} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let (code, raw) = s.raw(&req);
    assert_eq!(code, 405);
    assert!(raw.contains("Allow: GET, DELETE"), "{raw}");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/timeout"),
        Some(json!({"timeout": 5})),
    );
    assert_eq!(code, 404, "{v}");
    let (code, v) = s.call("GET", "/v2/sandboxes?state=running", None);
    assert_eq!((code, v), (200, json!([])));
    let (code, _) = s.call("GET", "/v2/sandboxes?state=bogus", None);
    assert_eq!(code, 400);
    let (code, _) = s.call("GET", "/v2/sandboxes?limit=0", None);
    assert_eq!(code, 400);
    let (code, _) = s.call("GET", "/v2/sandboxes?nextToken=zz", None);
    assert_eq!(code, 400);
    let (code, v) = s.call("POST", "/sandboxes", Some(json!({"templateID": "nope"})));
    assert_eq!(code, 400);
    assert_eq!(v["message"], "template nope not found");
}

fn body_rules(s: &Server) {
    let post = |body: &str, ct: &str| {
        let req = format!(
            "POST /sandboxes-cold HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.raw(&req)
    };
    assert_eq!(post("{}", "text/plain").0, 415);
    assert_eq!(post("{", "application/json").0, 400);
    assert_eq!(post("[1]", "application/json").0, 422);
    assert_eq!(post("{}", "application/json").0, 422, "image is required");
    assert_eq!(post(r#"{"image": 5}"#, "application/json").0, 422);
    // Nesting past 32 levels is refused before parsing, with a message that says so.
    let deep = format!(
        r#"{{"image": "x", "metadata": {}{}}}"#,
        "[".repeat(40),
        "]".repeat(40)
    );
    let (code, answer) = post(&deep, "application/json");
    assert_eq!(code, 400, "{answer}");
    assert!(answer.contains("deeper than 32 levels"), "{answer}");
    let (code, answer) = post(&"{\"a\":".repeat(50_000), "application/json");
    assert_eq!(code, 400, "{answer}");
    // Announced only: the server answers 413 from Content-Length and closes, and a client
    // still writing a body it will not read could lose that answer to a TCP reset.
    let too_big = format!(
        "POST /sandboxes-cold HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 1100000\r\nConnection: close\r\n\r\n"
    );
    assert_eq!(s.raw(&too_big).0, 413);
    let image = base_image();
    let cases = [
        (json!({"image": image, "cpuCount": 0}), 400),
        (json!({"image": image, "memoryMB": 64}), 400),
        (json!({"image": image, "diskSizeMB": 1500}), 400),
        (json!({"image": image, "timeout": -1}), 400),
        (json!({"image": image, "timeout": "5"}), 422),
        (json!({"image": image, "envVars": {"1BAD": "x"}}), 400),
        (json!({"image": image, "metadata": {"k": 1}}), 422),
        (json!({"image": image, "extraBootArgs": "quiet"}), 400),
        (
            json!({"image": image, "network": {"allowOut": ["1.1.1.999"]}}),
            400,
        ),
        (json!({"image": image, "network": {"rules": []}}), 400),
        (
            json!({"image": image, "customExtensionParams": {"vpn": "x"}}),
            400,
        ),
        (json!({"image": image, "customExtensionParams": [1]}), 422),
    ];
    for (body, want) in cases {
        let (code, v) = s.call("POST", "/sandboxes-cold", Some(body.clone()));
        assert_eq!(code, want, "{body} -> {v}");
        assert_eq!(v["code"], want);
    }
    let (_, v) = s.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": image, "customExtensionParams": {"vpn": "x"}})),
    );
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("customExtensionParams") && msg.contains("[custom_extension].url"),
        "{msg}"
    );
}

fn bad_images_leave_nothing(s: &Server) {
    let before_ns = netns_files().len();
    // A loopback port where no registry listens: unreachable → 502, with no traffic
    // leaving the machine.
    let unreachable = format!("127.0.0.1:{}/nothing:latest", free_port());
    for (image, want) in [
        ("oci:/nonexistent/layout", 400),
        ("oci:relative/path", 400),
        ("Not A Reference", 400),
        (unreachable.as_str(), 502),
    ] {
        let (code, v) = s.call("POST", "/sandboxes-cold", Some(json!({"image": image})));
        assert_eq!(code, want, "{image} -> {v}");
        assert!(v["message"].as_str().unwrap().len() > 10, "{v}");
    }
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    assert!(netns_files().len() <= before_ns.max(1));
}

fn metrics(s: &Server) {
    let resp = ureq::get(&format!("{}/metrics", s.base)).call().unwrap();
    assert_eq!(
        resp.header("Content-Type"),
        Some("text/plain; version=0.0.4")
    );
    let text = resp.into_string().unwrap();
    assert!(
        text.contains("agentenv_sandboxes{state=\"running\"} 0"),
        "{text}"
    );
    assert!(
        text.contains("agentenv_network_slots{state=\"pooled\"}"),
        "{text}"
    );
    assert!(
        text.contains("agentenv_sandbox_operations_total{op=\"create_cold\",result=\"error\"}"),
        "{text}"
    );
}
