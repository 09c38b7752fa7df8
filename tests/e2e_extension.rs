//! End-to-end tests of the custom-extension contract (custom-extension.md, "CE") through
//! the real server binary, real VMs and real network namespaces, against a real recording
//! extension (`common::extension`).
//!
//! Cold boots are expensive under TCG, so five boots serve every assertion: the start-fresh
//! failure matrix fails before any VM boots, and the patch-params matrix shares one
//! sandbox. Only one agentenv server may run on a host at a time, so the tests take a
//! process-wide lock and their servers run one after the other.

mod common;

use common::extension::{Behavior, Extension, Recorded};
use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "e2e-token.0123456789";
/// `timeout_ms` of the main server: long enough for a stop delayed by [`SLOW_STOP_MS`].
const TIMEOUT_MS: u64 = 4000;
const SLOW_STOP_MS: u64 = 3000;
const VERSION: &str = env!("CARGO_PKG_VERSION");
const NETNS_PREFIX: &str = "/var/run/netns/agentenv-ns-";

fn extension_toml(url: &str, timeout_ms: u64, token: Option<&str>) -> String {
    let mut t = format!("[custom_extension]\nurl = \"{url}\"\ntimeout_ms = {timeout_ms}\n");
    if let Some(token) = token {
        t.push_str(&format!("auth_token = \"{token}\"\n"));
    }
    t
}

fn hook_failed(hook: &str, cause: &str) -> String {
    format!("custom extension hook {hook} failed: {cause}")
}

fn message(v: &Value) -> &str {
    v["message"].as_str().unwrap_or("")
}

// ---------------------------------------------------------------------------------------
// Test 1: an extension that refuses connections.
// ---------------------------------------------------------------------------------------

/// custom-extension.md §7.1, §7.3: a refused connection fails start-fresh with 502; the stop for the same
/// pair is still attempted before the answer, and nothing remains.
#[test]
fn refused_extension_fails_create_and_leaves_nothing() {
    let _serial = serial();
    let closed = free_port();
    let mut server = Server::start(&extension_toml(
        &format!("http://127.0.0.1:{closed}"),
        2000,
        None,
    ));
    let (code, v) = server.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "customExtensionParams": {"a": 1}})),
    );
    assert_eq!(code, 502, "{v}");
    let prefix = hook_failed("start-fresh", "connection failed: ");
    assert!(message(&v).starts_with(&prefix), "{v}");
    assert!(message(&v).to_ascii_lowercase().contains("refused"), "{v}");
    // The pair of the failed start, from its WARN line, got its stop attempt before the
    // answer.
    let log = server.log();
    let line = log
        .lines()
        .find(|l| l.contains("hook failed hook=start-fresh"))
        .unwrap_or_else(|| panic!("start-fresh failure not logged:\n{log}"));
    let sid = field(line, "sandboxId");
    let iid = field(line, "sandboxInstanceId");
    let stop_line = format!("stop hook failed sandboxId={sid} sandboxInstanceId={iid} attempt=1/4");
    assert!(
        log.lines()
            .any(|l| l.contains(&stop_line) && l.contains("stopReason=start-failed")),
        "no stop attempt for the failed start ({stop_line}):\n{log}"
    );
    assert_eq!(
        metric(
            &server,
            r#"agentenv_hook_requests_total{hook="start-fresh",result="failure"}"#
        ),
        1
    );
    assert!(
        metric(
            &server,
            r#"agentenv_hook_requests_total{hook="stop",result="failure"}"#
        ) >= 1
    );
    assert_eq!(
        metric(
            &server,
            r#"agentenv_hook_requests_total{hook="stop",result="success"}"#
        ),
        0
    );
    let (code, _) = server.call("GET", &format!("/sandboxes/{sid}"), None);
    assert_eq!(code, 404);
    assert_nothing_left(&server);
    server.stop();
}

/// A start that admission refuses (`[admission] max_memory_mb`) answers 429 before the
/// extension hears of it: no start-fresh, so no stop either, and nothing is left.
#[test]
fn a_start_admission_refuses_never_reaches_the_extension() {
    let _serial = serial();
    let ext = Extension::start();
    let mut config = extension_toml(&ext.url(), 5000, None);
    config.push_str("[admission]\nmax_memory_mb = 200\n");
    let mut server = Server::start(&config);
    let (code, v) = server.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "memoryMB": 256, "customExtensionParams": {"a": 1}})),
    );
    assert_eq!(code, 429, "{v}");
    assert!(message(&v).contains("memory"), "{v}");
    assert!(ext.requests().is_empty(), "{:?}", ext.requests());
    assert_nothing_left(&server);
    server.stop();
}

/// `key=value` from a log line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    let start = line
        .find(&format!(" {key}="))
        .unwrap_or_else(|| panic!("no {key}= in {line}"))
        + key.len()
        + 2;
    line[start..].split_whitespace().next().unwrap()
}

// ---------------------------------------------------------------------------------------
// Test 2: the main contract with a recording extension.
// ---------------------------------------------------------------------------------------

/// Payloads, headers, extraBootArgs, the start-fresh and patch-params failure matrices,
/// delete, ordering across sandboxes, expiry, metrics and crash recovery.
#[test]
fn extension_contract_through_the_server() {
    let _serial = serial();
    let began = Instant::now();
    let ext = Extension::start();
    let seen = watch_namespaces(&ext);
    let mut server = Server::start(&extension_toml(
        &format!("{}/prefix/", ext.url()),
        TIMEOUT_MS,
        Some(TOKEN),
    ));
    let (failed, too_long) = start_fresh_failures(&server, &ext, &seen);
    assert_nothing_left(&server);
    let counts = HookCounts::of(&server);
    assert_eq!(counts.get("start-fresh", "failure"), failed);
    assert_eq!(counts.get("start-fresh", "success"), 0);
    assert_eq!(counts.get("stop", "success"), failed);
    assert_eq!(counts.get("stop", "failure"), 0);
    assert_eq!(metric(&server, "agentenv_hook_open_instances"), 0);

    let (s1, s3) = boot_two(&server, &ext, &seen);
    // custom-extension.md §11.2 step 4 counts the guest's complete command line.
    let v = server.exec(&s3.id, "cat", &["/proc/cmdline"]);
    let base = v["stdout"].as_str().unwrap().trim_end_matches('\n').len();
    assert_eq!(
        too_long,
        base + 1 + 2100,
        "reported length vs /proc/cmdline"
    );
    let (patched_ok, patched_failed) = patch_params(&server, &ext, &s1);
    let b = delete_with_slow_stop_and_concurrent_create(&server, &ext, &seen, &s1);
    expiry_kills(&server, &ext, &seen, &b);

    let counts = HookCounts::of(&server);
    assert_eq!(counts.get("start-fresh", "success"), 3, "{counts:?}");
    assert_eq!(counts.get("start-fresh", "failure"), failed, "{counts:?}");
    assert_eq!(counts.get("stop", "success"), failed + 2, "{counts:?}");
    assert_eq!(counts.get("stop", "failure"), 0, "{counts:?}");
    assert_eq!(
        counts.get("patch-params", "success"),
        patched_ok + 1,
        "{counts:?}: the PATCH during the DELETE included"
    );
    assert_eq!(
        counts.get("patch-params", "failure"),
        patched_failed,
        "{counts:?}"
    );
    assert_eq!(counts.get("start-resume", "success"), 0, "{counts:?}");
    assert_eq!(metric(&server, "agentenv_hook_stop_retries_total"), 0);
    assert_eq!(metric(&server, "agentenv_hook_stop_undelivered_total"), 0);
    assert_eq!(
        metric(&server, "agentenv_hook_open_instances"),
        1,
        "s3 is open"
    );

    crash_then_recovery_stop(&mut server, &ext, &seen, &s3);

    // Every attempt had its own request id (custom-extension.md §2.2).
    let all = ext.requests();
    let ids: HashSet<&str> = all
        .iter()
        .filter_map(|r| r.header("x-request-id"))
        .collect();
    assert_eq!(ids.len(), all.len(), "X-Request-Id reused");
    // No hook has any key other than its contract's.
    for r in &all {
        let keys: Vec<&String> = r.body.as_object().unwrap().keys().collect();
        let expected = match r.hook.as_str() {
            "start-fresh" | "start-resume" => 5,
            _ => 2,
        };
        assert_eq!(keys.len(), expected, "{} body {}", r.hook, r.body);
    }
    shutdown_stops(&mut server, &ext, &seen);
    // Each slot was released only after its stop had removed the extension's marker, so
    // none was found not clean (network.md §4.2, custom-extension.md §3.4).
    let log = server.log();
    assert!(log.contains("op=release outcome=pooled"), "{log}");
    assert!(
        !log.contains("reason=\"not clean"),
        "a slot was released while the extension still held it:\n{}",
        log.lines()
            .filter(|l| l.contains("not clean"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "extension_contract_through_the_server: {:?}",
        began.elapsed()
    );
}

/// How long the observer holds each stop before checking its namespace again.
const STOP_HOLD: Duration = Duration::from_millis(300);

/// The link the observer adds inside a start hook's namespace (a veth pair, both ends
/// inside) and removes on its stop, as a real extension would (custom-extension.md §12).
const MARKER_LINK: &str = "xt0";

/// What the observer saw for each request (by `seq`): for a start hook, whether its
/// namespace existed and was configured (tap and veth inside) when the hook arrived; for a
/// stop, whether that namespace still existed, with the extension's marker link in it,
/// both on arrival and [`STOP_HOLD`] later, just before the answer.
type Seen = Arc<Mutex<HashMap<usize, bool>>>;

/// Makes the extension act like a real one: on a start hook it checks the namespace and
/// adds [`MARKER_LINK`] to it; on stop it checks that the namespace is still the
/// instance's (marker present) for the whole attempt, then removes the marker. A slot
/// released before its stop's first attempt has ended is caught either way: it is torn
/// down (namespace gone), or it is found not clean because of the marker and destroyed
/// (network.md §4.2, §4.4).
fn watch_namespaces(ext: &Extension) -> Seen {
    let seen: Seen = Arc::default();
    let paths: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let s = seen.clone();
    ext.observe(move |r: &Recorded| {
        let ok = match r.hook.as_str() {
            "start-fresh" | "start-resume" => {
                let p = r.body["networkNamespacePath"]
                    .as_str()
                    .unwrap_or("")
                    .to_string();
                paths
                    .lock()
                    .unwrap()
                    .insert(r.instance_id().to_string(), p.clone());
                let ok = netns_configured(&p);
                if ok {
                    ns_ip(
                        &p,
                        &[
                            "link",
                            "add",
                            MARKER_LINK,
                            "type",
                            "veth",
                            "peer",
                            "name",
                            "xt1",
                        ],
                    );
                }
                ok
            }
            "stop" => {
                let Some(p) = paths.lock().unwrap().get(r.instance_id()).cloned() else {
                    s.lock().unwrap().insert(r.seq, false);
                    return;
                };
                let marked = || netns_configured(&p) && ns_links(&p).contains(MARKER_LINK);
                let mut ok = marked();
                std::thread::sleep(STOP_HOLD);
                ok = ok && marked();
                ns_ip(&p, &["link", "del", MARKER_LINK]);
                ok
            }
            _ => return,
        };
        s.lock().unwrap().insert(r.seq, ok);
    });
    seen
}

fn ns_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap()
}

fn ns_ip(path: &str, args: &[&str]) {
    let mut all = vec!["-n", ns_name(path)];
    all.extend_from_slice(args);
    let _ = std::process::Command::new("ip").args(&all).output();
}

fn ns_links(path: &str) -> String {
    host("ip", &["-n", ns_name(path), "-o", "link"])
}

/// The namespace exists and the slot's tap and veth end are inside it.
fn netns_configured(path: &str) -> bool {
    !path.is_empty()
        && Path::new(path).exists()
        && ns_links(path).contains("tap0")
        && ns_links(path).contains("veth0")
}

/// What the observer found for `r`, once it has finished with it.
fn seen_ok(seen: &Seen, r: &Recorded) -> bool {
    let done = || seen.lock().unwrap().get(&r.seq).copied();
    wait_until(Duration::from_secs(5), || done().is_some());
    done().unwrap_or(false)
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_digit() || ('a'..='f').contains(&c),
        })
}

fn is_uuid_v7(s: &str) -> bool {
    is_uuid(s) && s.as_bytes()[14] == b'7' && b"89ab".contains(&s.as_bytes()[19])
}

/// custom-extension.md §2.1, §2.2: method, path (with the configured prefix), headers.
fn check_request(r: &Recorded, token: Option<&str>, attempt: u32, prefix: &str) {
    assert_eq!(r.method, "POST", "{r:?}");
    assert_eq!(r.path, format!("{prefix}/sandbox-hook/{}", r.hook), "{r:?}");
    assert_eq!(r.header("x-agentenv-hook"), Some(r.hook.as_str()), "{r:?}");
    let ua = format!("agentenv/{VERSION}");
    assert_eq!(r.header("user-agent"), Some(ua.as_str()), "{r:?}");
    assert_eq!(r.header("content-type"), Some("application/json"), "{r:?}");
    let rid = r.header("x-request-id").unwrap_or("");
    assert!(is_uuid(rid), "X-Request-Id {rid:?}");
    let attempt = attempt.to_string();
    assert_eq!(
        r.header("x-agentenv-attempt"),
        Some(attempt.as_str()),
        "{r:?}"
    );
    match token {
        Some(t) => {
            let bearer = format!("Bearer {t}");
            assert_eq!(r.header("authorization"), Some(bearer.as_str()), "{r:?}");
            assert_eq!(r.header_count("authorization"), 1);
        }
        None => assert_eq!(r.header_count("authorization"), 0, "{r:?}"),
    }
    if r.hook == "stop" {
        assert!(r.header("x-agentenv-stop-reason").is_some(), "{r:?}");
    } else {
        assert_eq!(r.header_count("x-agentenv-stop-reason"), 0, "{r:?}");
    }
}

/// The stops for an instance.
fn stops_for(ext: &Extension, instance: &str) -> Vec<Recorded> {
    ext.requests_for("stop")
        .into_iter()
        .filter(|r| r.instance_id() == instance)
        .collect()
}

/// custom-extension.md §3.4: a stop names exactly the start's pair and the reason.
fn check_stop(stop: &Recorded, start: &Recorded, reason: &str, token: Option<&str>) {
    check_request(stop, token, 1, "/prefix");
    assert_eq!(
        stop.body,
        json!({"sandboxId": start.sandbox_id(), "sandboxInstanceId": start.instance_id()}),
    );
    assert_eq!(
        stop.header("x-agentenv-stop-reason"),
        Some(reason),
        "{stop:?}"
    );
}

/// custom-extension.md §7.4, §7.5, §7.3: each start-fresh failure gives 502 with the exact message, the stop
/// for the same pair arrived before the answer while the namespace existed, and nothing
/// remains. Returns how many creates failed, and the command line length reported for
/// 2100 bytes of arguments.
fn start_fresh_failures(s: &Server, ext: &Extension, seen: &Seen) -> (u64, usize) {
    let long_args = "a".repeat(2100);
    let cases: Vec<(&str, Behavior, String)> = vec![
        (
            "500",
            Behavior::status(500),
            hook_failed("start-fresh", "HTTP 500"),
        ),
        (
            "404",
            Behavior::body(404, "{}"),
            hook_failed("start-fresh", "HTTP 404"),
        ),
        (
            "302",
            Behavior::Redirect(302),
            hook_failed("start-fresh", "redirect (HTTP 302) not followed"),
        ),
        (
            "non-json",
            Behavior::body(200, "<html>ok</html>"),
            hook_failed("start-fresh", "response is not a JSON object"),
        ),
        (
            "array",
            Behavior::body(200, "[1]"),
            hook_failed("start-fresh", "response is not a JSON object"),
        ),
        (
            "wrong-type",
            Behavior::json(200, json!({"extraBootArgs": 5})),
            hook_failed("start-fresh", "extraBootArgs must be a string or null"),
        ),
        (
            "control-char",
            Behavior::json(200, json!({"extraBootArgs": "quiet\u{1}x"})),
            hook_failed(
                "start-fresh",
                "extraBootArgs rejected: invalid character at byte 5",
            ),
        ),
        (
            "newline-inside",
            Behavior::json(200, json!({"extraBootArgs": " a=1\nb=2 "})),
            hook_failed(
                "start-fresh",
                "extraBootArgs rejected: invalid character at byte 3",
            ),
        ),
        (
            "too-long",
            Behavior::json(200, json!({"extraBootArgs": long_args})),
            hook_failed(
                "start-fresh",
                "extraBootArgs rejected: command line would be ",
            ),
        ),
        (
            "oversized-announced",
            Behavior::Oversized { announced: true },
            hook_failed("start-fresh", "response body exceeds 1 MiB"),
        ),
        (
            "oversized-chunked",
            Behavior::Oversized { announced: false },
            hook_failed("start-fresh", "response body exceeds 1 MiB"),
        ),
        (
            "closed",
            Behavior::Close,
            hook_failed("start-fresh", "connection failed: "),
        ),
        (
            "timeout",
            Behavior::delay(TIMEOUT_MS + 1500, Behavior::Default),
            hook_failed("start-fresh", &format!("timed out after {TIMEOUT_MS} ms")),
        ),
    ];
    let mut failed = 0;
    let mut too_long = 0;
    for (name, behavior, expected) in cases {
        let starts_before = ext.requests_for("start-fresh").len();
        ext.script("start-fresh", vec![behavior]);
        let params = json!({"case": name, "nested": {"list": [1, 2]}});
        let t0 = Instant::now();
        let (code, v) = s.call(
            "POST",
            "/sandboxes-cold",
            Some(json!({"image": base_image(), "customExtensionParams": params})),
        );
        let answered = Instant::now();
        failed += 1;
        assert_eq!(code, 502, "{name}: {v}");
        let msg = message(&v);
        match name {
            "too-long" => {
                assert!(msg.starts_with(&expected), "{name}: {msg}");
                assert!(msg.ends_with(" bytes, limit 2047"), "{name}: {msg}");
                too_long = msg[expected.len()..msg.len() - " bytes, limit 2047".len()]
                    .parse()
                    .unwrap();
            }
            "closed" => assert!(msg.starts_with(&expected), "{name}: {msg}"),
            _ => assert_eq!(msg, expected, "{name}"),
        }
        let starts = ext.requests_for("start-fresh");
        assert_eq!(starts.len(), starts_before + 1, "{name}: one start-fresh");
        let start = starts.last().unwrap();
        check_request(start, Some(TOKEN), 1, "/prefix");
        assert_eq!(start.body["customExtensionParams"], params, "{name}");
        assert!(is_uuid_v7(start.instance_id()), "{name}: {}", start.body);
        // Read right after the answer: the stop must already be there.
        let stops = stops_for(ext, start.instance_id());
        assert_eq!(
            stops.len(),
            1,
            "{name}: the stop for the failed start arrives before the answer"
        );
        check_stop(&stops[0], start, "start-failed", Some(TOKEN));
        assert!(stops[0].at < answered, "{name}");
        assert!(stops[0].at >= start.at, "{name}");
        assert!(
            seen_ok(seen, &stops[0]),
            "{name}: the namespace was gone during the stop's first attempt"
        );
        if name == "timeout" {
            // The image is cached by the earlier cases: the call is the hook's timeout,
            // the stop (held STOP_HOLD by the observer) and little else.
            let took = answered - t0;
            assert!(
                took <= Duration::from_millis(TIMEOUT_MS + 1000) + STOP_HOLD,
                "timeout: the create took {took:?}"
            );
            let waited = answered - start.at;
            assert!(
                waited >= Duration::from_millis(TIMEOUT_MS - 100)
                    && waited <= Duration::from_millis(TIMEOUT_MS + 1000),
                "timeout: answered {waited:?} after the hook arrived"
            );
        }
        let (code, _) = s.call("GET", &format!("/sandboxes/{}", start.sandbox_id()), None);
        assert_eq!(code, 404, "{name}");
        assert_nothing_left(s);
    }
    (failed, too_long)
}

/// No sandbox, VM, run dir or namespace of a failed or deleted sandbox remains.
fn assert_nothing_left(s: &Server) {
    let (_, list) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(list, json!([]));
    assert!(
        files_under(&s.state_dir.join("sandboxes")).is_empty(),
        "{:?}",
        files_under(&s.state_dir.join("sandboxes"))
    );
    assert!(
        wait_until(Duration::from_secs(10), || qemu_processes_with(
            &s.state_dir.display().to_string()
        )
        .is_empty()),
        "qemu left for {}",
        s.state_dir.display()
    );
    assert!(
        wait_until(Duration::from_secs(10), || {
            metric(s, r#"agentenv_network_slots{state="in_use"}"#) == 0
                && netns_files().len() as u64
                    == metric(s, r#"agentenv_network_slots{state="pooled"}"#)
        }),
        "namespaces {:?} are not just the pooled ones:\n{}",
        netns_files(),
        metrics_text(s)
    );
}

/// A running sandbox and its start-fresh.
struct Booted {
    id: String,
    start: Recorded,
}

/// custom-extension.md §3.1, §11: S1 with params gets extraBootArgs on its kernel command line; S3 with
/// `null` params gets `{}`. The two boot concurrently.
fn boot_two(s: &Server, ext: &Extension, seen: &Seen) -> (Booted, Booted) {
    let params = json!({"vpn": {"peers": ["10.8.0.2"]}, "n": 1, "s": "x"});
    ext.script(
        "start-fresh",
        vec![Behavior::json(
            200,
            json!({"extraBootArgs": "  agentenv.test=1 quiet ", "ignored": [1]}),
        )],
    );
    let starts_before = ext.requests_for("start-fresh").len();
    let (v1, v3) = std::thread::scope(|sc| {
        let p = params.clone();
        let a = sc.spawn(move || {
            s.create(json!({
                "image": base_image(), "timeout": 600, "autoPause": false,
                "customExtensionParams": p,
            }))
        });
        // S1's start-fresh takes the scripted answer; S3 starts after it arrived.
        let got = ext.wait_for("start-fresh", starts_before + 1, Duration::from_secs(60));
        assert_eq!(got.len(), starts_before + 1);
        let b = sc.spawn(move || {
            s.create(json!({"image": base_image(), "timeout": 600, "customExtensionParams": null}))
        });
        (a.join().unwrap(), b.join().unwrap())
    });
    let s1 = v1["sandboxID"].as_str().unwrap().to_string();
    let s3 = v3["sandboxID"].as_str().unwrap().to_string();
    let starts = ext.requests_for("start-fresh");
    assert_eq!(starts.len(), starts_before + 2);
    let find = |id: &str| {
        let found: Vec<_> = starts.iter().filter(|r| r.sandbox_id() == id).collect();
        assert_eq!(found.len(), 1, "one start-fresh for {id}");
        found[0].clone()
    };
    let (start1, start3) = (find(&s1), find(&s3));
    assert_eq!(
        start1.seq, starts[starts_before].seq,
        "S1's hook came first"
    );
    for (id, start, expected) in [(&s1, &start1, &params), (&s3, &start3, &json!({}))] {
        check_request(start, Some(TOKEN), 1, "/prefix");
        let detail = get(s, id);
        assert_eq!(
            start.body,
            json!({
                "sandboxId": id,
                "sandboxInstanceId": start.instance_id(),
                "networkNamespacePath": start.body["networkNamespacePath"],
                "hostInteractionIp": detail["hostInteractionIp"],
                "customExtensionParams": expected,
            })
        );
        assert!(is_uuid_v7(start.instance_id()), "{}", start.body);
        assert_ne!(start.instance_id(), id.as_str());
        let path = start.body["networkNamespacePath"].as_str().unwrap();
        assert!(path.starts_with(NETNS_PREFIX), "{path}");
        assert!(
            seen_ok(seen, start),
            "the namespace {path} did not exist (configured) when start-fresh arrived"
        );
        let (code, p) = s.call(
            "GET",
            &format!("/sandboxes/{id}/custom-extension-params"),
            None,
        );
        assert_eq!((code, &p), (200, expected));
    }
    assert_ne!(start1.instance_id(), start3.instance_id());
    assert_ne!(
        start1.body["networkNamespacePath"],
        start3.body["networkNamespacePath"]
    );
    // custom-extension.md §11.3: one space, then the trimmed arguments, at the very end.
    let v = s.exec(&s1, "cat", &["/proc/cmdline"]);
    let cmdline = v["stdout"].as_str().unwrap().trim_end_matches('\n');
    assert!(cmdline.ends_with(" agentenv.test=1 quiet"), "{cmdline:?}");
    assert!(!cmdline.ends_with("  agentenv.test=1 quiet"), "{cmdline:?}");
    let v = s.exec(&s3, "cat", &["/proc/cmdline"]);
    let cmdline = v["stdout"].as_str().unwrap();
    assert!(!cmdline.contains("agentenv.test"), "{cmdline:?}");
    assert!(stops_for(ext, start1.instance_id()).is_empty());
    assert!(stops_for(ext, start3.instance_id()).is_empty());
    (
        Booted {
            id: s1,
            start: start1,
        },
        Booted {
            id: s3,
            start: start3,
        },
    )
}

fn get(s: &Server, id: &str) -> Value {
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{v}");
    v
}

fn params_of(s: &Server, id: &str) -> Value {
    let (code, v) = s.call(
        "GET",
        &format!("/sandboxes/{id}/custom-extension-params"),
        None,
    );
    assert_eq!(code, 200, "{v}");
    v
}

/// custom-extension.md §3.3, §10.11, §7.4: patch-params payload, result, failure matrix, rejections, and
/// clearing. Returns (successful, failed) hook attempts.
fn patch_params(s: &Server, ext: &Extension, sb: &Booted) -> (u64, u64) {
    let id = &sb.id;
    let path = format!("/sandboxes/{id}/custom-extension-params");
    let (mut ok, mut failed) = (0, 0);

    // The extension's answer, not a merge done by agentenv, becomes the new full params.
    let patch = json!({"vpn": {"peers": ["10.8.0.3", "10.8.0.4"]}, "extra": true, "s": null});
    let expected = json!({"vpn": {"peers": ["10.8.0.3", "10.8.0.4"]}, "n": 1, "by": "ext"});
    ext.script(
        "patch-params",
        vec![Behavior::json(
            200,
            json!({"customExtensionParams": expected, "note": "unknown keys are ignored"}),
        )],
    );
    let (code, v) = s.call("PATCH", &path, Some(patch.clone()));
    ok += 1;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v, expected, "the extension's params are the new params");
    assert_eq!(params_of(s, id), expected);
    let hooks = ext.requests_for("patch-params");
    assert_eq!(hooks.len(), 1);
    check_request(&hooks[0], Some(TOKEN), 1, "/prefix");
    assert_eq!(hooks[0].body, json!({"sandboxId": id, "patch": patch}));

    let cases: Vec<(&str, Behavior, String)> = vec![
        (
            "closed",
            Behavior::Close,
            hook_failed("patch-params", "connection failed: "),
        ),
        (
            "500",
            Behavior::status(500),
            hook_failed("patch-params", "HTTP 500"),
        ),
        (
            "302",
            Behavior::Redirect(302),
            hook_failed("patch-params", "redirect (HTTP 302) not followed"),
        ),
        (
            "204",
            Behavior::status(204),
            hook_failed("patch-params", "response is not a JSON object"),
        ),
        (
            "200-empty",
            Behavior::body(200, ""),
            hook_failed("patch-params", "response is not a JSON object"),
        ),
        (
            "non-json",
            Behavior::body(200, "ok"),
            hook_failed("patch-params", "response is not a JSON object"),
        ),
        (
            "non-object",
            Behavior::body(200, r#"[{"customExtensionParams":{}}]"#),
            hook_failed("patch-params", "response is not a JSON object"),
        ),
        (
            "params-5",
            Behavior::json(200, json!({"customExtensionParams": 5})),
            hook_failed(
                "patch-params",
                "customExtensionParams must be an object or null",
            ),
        ),
        (
            "params-string",
            Behavior::json(200, json!({"customExtensionParams": "{}"})),
            hook_failed(
                "patch-params",
                "customExtensionParams must be an object or null",
            ),
        ),
        (
            "oversized",
            Behavior::Oversized { announced: true },
            hook_failed("patch-params", "response body exceeds 1 MiB"),
        ),
        (
            "timeout",
            Behavior::delay(TIMEOUT_MS + 1500, Behavior::Default),
            hook_failed("patch-params", &format!("timed out after {TIMEOUT_MS} ms")),
        ),
    ];
    for (name, behavior, want) in cases {
        let before = ext.requests_for("patch-params").len();
        ext.script("patch-params", vec![behavior]);
        let t0 = Instant::now();
        let ((code, v), took) = std::thread::scope(|sc| {
            let patching = sc.spawn(|| {
                let r = s.call("PATCH", &path, Some(json!({"case": name})));
                (r, t0.elapsed())
            });
            if name == "timeout" {
                // custom-extension.md §10.11: a hanging hook holds no lock that blocks GETs of this sandbox.
                let got = ext.wait_for("patch-params", before + 1, Duration::from_secs(10));
                assert_eq!(got.len(), before + 1);
                let t1 = Instant::now();
                assert_eq!(get(s, id)["state"], "running");
                assert_eq!(params_of(s, id), expected);
                assert!(
                    t1.elapsed() < Duration::from_secs(1),
                    "GETs waited {:?} for a hanging patch-params",
                    t1.elapsed()
                );
                assert!(
                    !patching.is_finished(),
                    "the PATCH did not wait for its hook"
                );
            }
            patching.join().unwrap()
        });
        failed += 1;
        assert_eq!(code, 502, "{name}: {v}");
        if name == "closed" {
            assert!(message(&v).starts_with(&want), "{name}: {v}");
        } else {
            assert_eq!(message(&v), want, "{name}");
        }
        let hooks = ext.requests_for("patch-params");
        assert_eq!(
            hooks.len(),
            before + 1,
            "{name}: one attempt, never retried"
        );
        assert_eq!(
            hooks[before].body,
            json!({"sandboxId": id, "patch": {"case": name}})
        );
        assert_eq!(params_of(s, id), expected, "{name}: params unchanged");
        if name == "timeout" {
            assert!(
                took <= Duration::from_millis(TIMEOUT_MS + 1000),
                "timeout: PATCH took {took:?}"
            );
        }
    }

    // Rejected before any hook: unknown sandbox, non-object bodies (custom-extension.md §10.11 steps 1-2).
    let before = ext.requests_for("patch-params").len();
    let unknown = "01936f1e-8a2b-7c3d-9e4f-0a1b2c3d4e5f";
    let (code, _) = s.call(
        "PATCH",
        &format!("/sandboxes/{unknown}/custom-extension-params"),
        Some(json!({"a": 1})),
    );
    assert_eq!(code, 404);
    let (code, _) = s.call(
        "PATCH",
        "/sandboxes/not-a-uuid/custom-extension-params",
        Some(json!({"a": 1})),
    );
    assert_eq!(code, 404);
    for body in [json!([1]), json!("x"), json!(5), json!(null)] {
        let (code, v) = s.call("PATCH", &path, Some(body.clone()));
        assert_eq!(code, 422, "{body}: {v}");
    }
    assert_eq!(ext.requests_for("patch-params").len(), before, "no hook");
    assert_eq!(params_of(s, id), expected);

    // custom-extension.md §3.3 rules 2, 3, 5: an object replaces, `{}`/absent and null clear.
    let steps = [
        (
            json!({"customExtensionParams": {"z": [1, {"y": null}]}, "unknown": 2}),
            json!({"z": [1, {"y": null}]}),
        ),
        (json!({}), json!({})),
        (json!({"customExtensionParams": {"z": 2}}), json!({"z": 2})),
        (json!({"customExtensionParams": null, "x": 1}), json!({})),
        (json!({"customExtensionParams": {}}), json!({})),
    ];
    for (answer, want) in steps {
        ext.script("patch-params", vec![Behavior::json(200, answer.clone())]);
        let (code, v) = s.call("PATCH", &path, Some(json!({"any": "thing"})));
        ok += 1;
        assert_eq!((code, &v), (200, &want), "answer {answer}");
        assert_eq!(params_of(s, id), want, "answer {answer}");
    }
    assert_eq!(get(s, id)["state"], "running");
    (ok, failed)
}

/// custom-extension.md §6.4, §5.6, §6.3, §2.9: a DELETE of S1 during an in-flight (slow) PATCH waits for
/// it, so the stop follows the patch-params answer; DELETE then waits for its (slow) stop,
/// which runs while the namespace exists; meanwhile a create of B is not held up: B's
/// start-fresh arrives while S1's stop is still pending. Returns B.
fn delete_with_slow_stop_and_concurrent_create(
    s: &Server,
    ext: &Extension,
    seen: &Seen,
    a: &Booted,
) -> Booted {
    ext.script(
        "stop",
        vec![Behavior::delay(SLOW_STOP_MS, Behavior::Default)],
    );
    let stops_before = ext.requests_for("stop").len();
    let starts_before = ext.requests_for("start-fresh").len();
    let patches_before = ext.requests_for("patch-params").len();
    let late = json!({"late": true});
    ext.script(
        "patch-params",
        vec![Behavior::delay(
            1500,
            Behavior::json(200, json!({"customExtensionParams": late})),
        )],
    );
    let (deleted, b, patched) = std::thread::scope(|sc| {
        let patch = sc.spawn(|| {
            let path = format!("/sandboxes/{}/custom-extension-params", a.id);
            s.call("PATCH", &path, Some(json!({"late": true})))
        });
        let got = ext.wait_for("patch-params", patches_before + 1, Duration::from_secs(10));
        assert_eq!(
            got.len(),
            patches_before + 1,
            "the PATCH's hook did not arrive"
        );
        let del = sc.spawn(|| {
            let (code, v) = s.call("DELETE", &format!("/sandboxes/{}", a.id), None);
            (code, v, Instant::now())
        });
        let got = ext.wait_for("stop", stops_before + 1, Duration::from_secs(30));
        assert_eq!(got.len(), stops_before + 1, "A's stop did not arrive");
        // A is gone from the API at once, and reads are not held up by its stop.
        let t0 = Instant::now();
        let (code, _) = s.call("GET", &format!("/sandboxes/{}", a.id), None);
        assert_eq!(code, 404);
        let (_, list) = s.call("GET", "/v2/sandboxes", None);
        assert!(!list.to_string().contains(&a.id), "{list}");
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        let b = s.create(json!({"image": base_image(), "timeout": 600, "autoPause": false}));
        (del.join().unwrap(), b, patch.join().unwrap())
    });
    assert_eq!(patched, (200, late), "the in-flight PATCH completes");
    let (code, v, delete_returned) = deleted;
    assert_eq!(code, 204, "{v}");
    let stops = stops_for(ext, a.start.instance_id());
    assert_eq!(stops.len(), 1, "one stop for S1");
    let stop = &stops[0];
    let patch_hook = &ext.requests_for("patch-params")[patches_before];
    assert!(
        stop.at >= patch_hook.at + Duration::from_millis(1500),
        "the stop came {:?} after a patch-params that was still being answered",
        stop.at - patch_hook.at
    );
    check_stop(stop, &a.start, "delete", Some(TOKEN));
    assert!(
        seen_ok(seen, stop),
        "S1's namespace was gone, or no longer the instance's, during its stop"
    );
    assert!(
        delete_returned >= stop.at + Duration::from_millis(SLOW_STOP_MS - 100),
        "DELETE answered {:?} after the stop arrived, before it was delivered",
        delete_returned - stop.at
    );
    let (code, _) = s.call("GET", &format!("/sandboxes/{}", a.id), None);
    assert_eq!(code, 404);
    assert!(qemu_processes_with(&a.id).is_empty());
    assert!(!s.state_dir.join("sandboxes").join(&a.id).exists());

    let b_id = b["sandboxID"].as_str().unwrap().to_string();
    let starts = ext.requests_for("start-fresh");
    assert_eq!(starts.len(), starts_before + 1);
    let b_start = starts.last().unwrap().clone();
    assert_eq!(b_start.sandbox_id(), b_id);
    assert_eq!(b_start.body["customExtensionParams"], json!({}));
    assert!(
        b_start.at < delete_returned && b_start.at > stop.at,
        "B's start-fresh arrived {:?} after A's stop began; A's DELETE took {:?} from then: \
         a slow stop of one sandbox held up another's create",
        b_start.at.saturating_duration_since(stop.at),
        delete_returned - stop.at
    );
    Booted {
        id: b_id,
        start: b_start,
    }
}

/// custom-extension.md §5.10: expiry with `autoPause: false` sends stop with reason timeout-kill.
fn expiry_kills(s: &Server, ext: &Extension, seen: &Seen, b: &Booted) {
    let (code, _) = s.call(
        "POST",
        &format!("/sandboxes/{}/timeout", b.id),
        Some(json!({"timeout": 0})),
    );
    assert_eq!(code, 204);
    assert!(
        wait_until(Duration::from_secs(20), || !stops_for(
            ext,
            b.start.instance_id()
        )
        .is_empty()),
        "no stop after expiry"
    );
    let stops = stops_for(ext, b.start.instance_id());
    assert_eq!(stops.len(), 1);
    check_stop(&stops[0], &b.start, "timeout-kill", Some(TOKEN));
    assert!(seen_ok(seen, &stops[0]));
    assert!(wait_until(Duration::from_secs(10), || s
        .call("GET", &format!("/sandboxes/{}", b.id), None)
        .0
        == 404));
    assert!(wait_until(Duration::from_secs(10), || qemu_processes_with(
        &b.id
    )
    .is_empty()));
}

/// custom-extension.md §9.3: after SIGKILL, the next start sends stop (reason recovery) for the open
/// instance while its namespace still exists, removes the sandbox, then reclaims the slot.
/// The restart sets `AENV_CUSTOM_EXTENSION_AUTH_TOKEN` empty: no token is sent (custom-extension.md §1.3).
fn crash_then_recovery_stop(server: &mut Server, ext: &Extension, seen: &Seen, sb: &Booted) {
    assert_eq!(qemu_processes_with(&sb.id).len(), 1);
    server.crash();
    assert!(
        wait_until(Duration::from_secs(10), || qemu_processes_with(&sb.id)
            .is_empty()),
        "qemu outlived the crashed server"
    );
    assert!(stops_for(ext, sb.start.instance_id()).is_empty());
    let before = ext.requests().len();
    server.spawn_with_env(&[("AENV_CUSTOM_EXTENSION_AUTH_TOKEN", "")]);
    assert!(
        wait_until(Duration::from_secs(30), || !stops_for(
            ext,
            sb.start.instance_id()
        )
        .is_empty()),
        "no recovery stop for {} / {}:\n{}",
        sb.id,
        sb.start.instance_id(),
        server.log()
    );
    let stops = stops_for(ext, sb.start.instance_id());
    let stop = &stops[0];
    check_request(stop, None, 1, "/prefix");
    assert_eq!(
        stop.body,
        json!({"sandboxId": sb.id, "sandboxInstanceId": sb.start.instance_id()})
    );
    assert_eq!(stop.header("x-agentenv-stop-reason"), Some("recovery"));
    assert!(
        seen_ok(seen, stop),
        "the recovery stop came after the kept slot's namespace was gone"
    );
    assert!(wait_until(Duration::from_secs(10), || server
        .call("GET", &format!("/sandboxes/{}", sb.id), None)
        .0
        == 404));
    assert_nothing_left(server);
    assert!(
        wait_until(Duration::from_secs(10), || metric(
            server,
            "agentenv_hook_open_instances"
        ) == 0),
        "the recovered entry is still open"
    );
    let counts = HookCounts::of(server);
    assert_eq!(counts.get("stop", "success"), 1, "{counts:?}");
    assert_eq!(counts.total(), 1, "{counts:?}");
    // Only that one stop since the restart.
    let since: Vec<_> = ext.requests().into_iter().skip(before).collect();
    assert_eq!(since.len(), 1, "{since:?}");
}

/// custom-extension.md §9.1: a graceful shutdown sends stop (reason shutdown) for a running sandbox before
/// the process exits, and leaves no namespace. The server runs with the token overridden
/// empty by the environment, so no Authorization header is sent (custom-extension.md §1.3).
fn shutdown_stops(server: &mut Server, ext: &Extension, seen: &Seen) {
    let before = ext.requests().len();
    let v = server.create(json!({"image": base_image(), "timeout": 600}));
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let since: Vec<_> = ext.requests().into_iter().skip(before).collect();
    assert_eq!(since.len(), 1, "{since:?}");
    let start = since[0].clone();
    assert_eq!(start.hook, "start-fresh");
    assert_eq!(start.sandbox_id(), id);
    check_request(&start, None, 1, "/prefix");
    server.stop();
    let since: Vec<_> = ext.requests().into_iter().skip(before + 1).collect();
    assert_eq!(since.len(), 1, "one stop at shutdown: {since:?}");
    let stop = &since[0];
    check_request(stop, None, 1, "/prefix");
    assert_eq!(
        stop.body,
        json!({"sandboxId": id, "sandboxInstanceId": start.instance_id()})
    );
    assert_eq!(stop.header("x-agentenv-stop-reason"), Some("shutdown"));
    assert!(
        seen_ok(seen, stop),
        "namespace gone before the shutdown stop"
    );
    assert!(qemu_processes_with(&server.state_dir.display().to_string()).is_empty());
    assert!(
        netns_files().is_empty(),
        "netns left after shutdown: {:?}",
        netns_files()
    );
}

// ---------------------------------------------------------------------------------------
// Test 3: extension disabled at restart, and disabled mode.
// ---------------------------------------------------------------------------------------

/// custom-extension.md §9.6, §1.7, §10.2, §10.11: a restart with the extension disabled drops the open
/// journal entries with a WARN each and sends nothing; then no hook is ever sent, non-empty
/// params are refused with 400, and PATCH is 400.
#[test]
fn disabled_extension_sends_nothing() {
    let _serial = serial();
    let ext = Extension::start();
    // No token configured: no Authorization header.
    let mut server = Server::start(&extension_toml(&ext.url(), 5000, None));
    let v = server.create(json!({"image": base_image(), "timeout": 600}));
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let starts = ext.requests_for("start-fresh");
    assert_eq!(starts.len(), 1);
    check_request(&starts[0], None, 1, "");
    let instance = starts[0].instance_id().to_string();
    server.crash();
    assert!(wait_until(Duration::from_secs(10), || qemu_processes_with(
        &id
    )
    .is_empty()));
    let before = ext.requests().len();

    server.spawn_with_env(&[("AENV_CUSTOM_EXTENSION_URL", "")]);
    let log = server.log();
    let dropped = log.lines().find(|l| {
        l.contains("dropping open hook journal entry")
            && l.contains(&format!("sandboxId={id}"))
            && l.contains(&format!("sandboxInstanceId={instance}"))
    });
    let dropped = dropped.unwrap_or_else(|| panic!("no WARN for the dropped entry:\n{log}"));
    assert!(dropped.contains("WARN"), "{dropped}");
    let (code, _) = server.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404);
    assert_nothing_left(&server);
    assert_eq!(metric(&server, "agentenv_hook_open_instances"), 0);

    // Disabled mode.
    let (code, v) = server.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "customExtensionParams": {"a": 1}})),
    );
    assert_eq!(code, 400, "{v}");
    assert!(message(&v).contains("customExtensionParams"), "{v}");
    assert!(message(&v).contains("[custom_extension].url"), "{v}");
    let (code, v) = server.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "customExtensionParams": 5})),
    );
    assert_eq!(code, 422, "{v}");
    let v =
        server.create(json!({"image": base_image(), "timeout": 600, "customExtensionParams": {}}));
    let id = v["sandboxID"].as_str().unwrap().to_string();
    let path = format!("/sandboxes/{id}/custom-extension-params");
    let (code, v) = server.call("PATCH", &path, Some(json!({"a": 1})));
    assert_eq!(code, 400, "{v}");
    let (code, v) = server.call("GET", &path, None);
    assert_eq!((code, v), (200, json!({})));
    let (code, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204);
    assert_nothing_left(&server);
    let counts = HookCounts::of(&server);
    assert_eq!(counts.total(), 0, "{counts:?}");
    server.stop();
    assert_eq!(
        ext.requests().len(),
        before,
        "hooks sent while disabled: {:?}",
        ext.requests().into_iter().skip(before).collect::<Vec<_>>()
    );
}

// ---------------------------------------------------------------------------------------
// Metrics.
// ---------------------------------------------------------------------------------------

fn metrics_text(s: &Server) -> String {
    ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap()
}

/// The value of one series (name with labels); the series must be present.
fn metric(s: &Server, series: &str) -> u64 {
    let text = metrics_text(s);
    let line = text
        .lines()
        .find(|l| l.strip_prefix(series).is_some_and(|r| r.starts_with(' ')))
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// `agentenv_hook_requests_total` by (hook, result).
#[derive(Debug)]
struct HookCounts(HashMap<(String, String), u64>);

impl HookCounts {
    fn of(s: &Server) -> HookCounts {
        let text = metrics_text(s);
        let mut m = HashMap::new();
        for hook in ["start-fresh", "start-resume", "patch-params", "stop"] {
            for result in ["success", "failure"] {
                let series =
                    format!("agentenv_hook_requests_total{{hook=\"{hook}\",result=\"{result}\"}} ");
                let line = text
                    .lines()
                    .find(|l| l.starts_with(&series))
                    .unwrap_or_else(|| panic!("no {series} in:\n{text}"));
                let n = line[series.len()..].trim().parse().unwrap();
                m.insert((hook.to_string(), result.to_string()), n);
            }
        }
        HookCounts(m)
    }

    fn get(&self, hook: &str, result: &str) -> u64 {
        self.0[&(hook.to_string(), result.to_string())]
    }

    fn total(&self) -> u64 {
        self.0.values().sum()
    }
}
