//! Long operations never starve the API (issue "the API server survives hostile and
//! careless clients", point 3): one sandbox with 16 commands sleeping and 16 uploads
//! stalled mid-body, while `/health`, the GET routes and another sandbox's commands and
//! files answer within 1 s. One template build (one cold boot), two restores.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// How long each of the busy sandbox's commands sleeps: past every check below.
const SLEEP_SECS: u64 = 20;

#[test]
fn one_sandbox_cannot_starve_the_api_or_another_sandbox() {
    // Stalled uploads stay stalled for the whole test (the default body timeout is 30 s).
    let s = Server::builder()
        .server_keys("body_timeout_secs = 120")
        .start();
    build_template(&s, "starve");
    let busy = s.create_from("starve", 600);
    let other = s.create_from("starve", 600);

    // 16 commands (the guest's max_concurrent_commands) sleep in `busy`.
    let sleepers: Vec<_> = (0..16)
        .map(|_| {
            let url = format!("{}/sandboxes/{busy}/commands", s.base);
            std::thread::spawn(move || {
                ureq::post(&url)
                    .set("X-API-Key", API_KEY)
                    .timeout(Duration::from_secs(SLEEP_SECS + 60))
                    .send_json(json!({"cmd": "sleep", "args": [SLEEP_SECS.to_string()]}))
                    .map(|r| r.into_json::<Value>().unwrap())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    // 16 uploads to `busy` send their head and 1000 bytes of an 8 MiB body, then stall.
    let stalled = stalled_uploads(&s, &busy, 16);
    std::thread::sleep(Duration::from_secs(2));
    let started = Instant::now();

    // The API and the other sandbox answer promptly.
    for path in [
        "/health".to_string(),
        "/metrics".to_string(),
        "/openapi.json".to_string(),
        "/sandboxes".to_string(),
        "/v2/sandboxes".to_string(),
        "/templates".to_string(),
        "/snapshots".to_string(),
        format!("/sandboxes/{busy}"),
        format!("/sandboxes/{other}"),
        format!("/sandboxes/{busy}/logs?lines=5"),
    ] {
        let code = within_1s(&format!("GET {path}"), || s.call("GET", &path, None).0);
        assert!(code == 200 || code == 204, "GET {path}: {code}");
    }
    let v = within_1s("a command in the other sandbox", || {
        s.exec(&other, "echo", &["unstarved"])
    });
    assert_eq!(v["stdout"], "unstarved\n", "{v}");
    within_1s("an upload to the other sandbox", || {
        let r = ureq::put(&format!("{}/sandboxes/{other}/files?path=/tmp/f", s.base))
            .set("X-API-Key", API_KEY)
            .send_bytes(b"bytes");
        assert_eq!(r.unwrap().status(), 204);
    });
    let (code, body) = within_1s("a download from the other sandbox", || {
        s.call(
            "GET",
            &format!("/sandboxes/{other}/files?path=/tmp/f"),
            None,
        )
    });
    assert_eq!((code, body), (200, Value::String("bytes".into())));
    // `busy` holds 32 requests on the I/O lane (max_inflight_per_sandbox): a 33rd is 429
    // at once, it never queues behind them.
    let (code, v) = within_1s("a 33rd I/O request to the busy sandbox", || {
        s.call(
            "POST",
            &format!("/sandboxes/{busy}/commands"),
            Some(json!({"cmd": "true"})),
        )
    });
    assert_eq!(code, 429, "{v}");
    assert!(
        started.elapsed() < Duration::from_secs(SLEEP_SECS - 5),
        "the checks ran while the commands slept"
    );

    // The stalled uploads end when their clients go; the sleepers all finish.
    drop(stalled);
    for sleeper in sleepers {
        let v = sleeper.join().unwrap().expect("sleeping command");
        assert_eq!(v["exitCode"], 0, "{v}");
        assert_eq!(v["timedOut"], false, "{v}");
    }
    let v = s.exec(&busy, "true", &[]);
    assert_eq!(v["exitCode"], 0, "{v}");
}

/// Runs `f`, asserting it took less than 1 s.
fn within_1s<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "{what} took {took:?}");
    out
}
