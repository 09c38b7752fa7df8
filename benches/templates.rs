//! Template build benchmark (not a timed test): the Debian 12 test image
//! (scripts/build-debian-image.sh) built as an E2B template through the v2 build API the
//! SDKs speak, cold (`force`: every step runs in a fresh build VM) and with every step
//! cached (the build VM boots on the last step's disk and only runs the start and ready
//! commands), next to a floor measured in the same run: one sandbox cold-booted from the
//! same image through the API, the same commands run in it by hand (`/commands`), the
//! same server started, and a snapshot of it taken.
//!
//! Needs root and the assets of scripts/setup.sh; run it through `scripts/bench`, which
//! holds the host lock. `AENV_BENCH_RUNS` sets the runs per row (default 15). Prints a
//! markdown table (p50, p90, ratio to the floor) for docs/performance.md.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use bench::{load_average, median, ms_since, p90};
use common::Server;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The steps' scripts (no network: the image's own python3 and coreutils).
const PREPARE: &str = "python3 -c 'import json; print(json.dumps({\"x\": 1}))' > /tmp/x.json";
const STAMP: &str = "echo \"$GREETING\" > stamp && cat /proc/sys/kernel/random/uuid > id";
const AS_USER: &str =
    "mkdir -p \"$HOME/work\" && python3 -c 'print(6 * 7)' > \"$HOME/work/answer\"";
const START: &str = "cd /tmp && exec python3 -m http.server 8080";
/// The python SDK's `wait_for_port(8080)`.
const READY: &str = "[ -n \"$(ss -Htuln sport = :8080)\" ]";

fn steps() -> Value {
    json!([
        {"type": "ENV", "args": ["GREETING", "hi"]},
        {"type": "RUN", "args": [PREPARE]},
        {"type": "USER", "args": ["root"]},
        {"type": "WORKDIR", "args": ["/srv/app"]},
        {"type": "RUN", "args": [STAMP]},
        {"type": "USER", "args": ["user"]},
        {"type": "RUN", "args": [AS_USER]},
    ])
}

/// One v2 build of `image` as template `name`; its time to `ready`.
fn build(server: &Server, image: &str, name: &str, force: bool) -> f64 {
    let t = Instant::now();
    let v = server.call_expect("POST", "/v3/templates", Some(json!({"name": name})), 202);
    let (tid, bid) = (
        v["templateID"].as_str().unwrap(),
        v["buildID"].as_str().unwrap(),
    );
    let body = json!({"fromImage": image, "steps": steps(), "startCmd": START,
        "readyCmd": READY, "force": force});
    server.call_expect(
        "POST",
        &format!("/v2/templates/{tid}/builds/{bid}"),
        Some(body),
        202,
    );
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let path = format!("/templates/{tid}/builds/{bid}/status?logsOffset=100000");
        let st = server.call_expect("GET", &path, None, 200);
        match st["status"].as_str() {
            Some("ready") => return ms_since(t),
            Some("error") => panic!("the build failed: {st}"),
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            server.failure("did not finish the build")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The floor: a cold sandbox of `image`, the steps by hand, the server, a snapshot.
fn floor(server: &Server, image: &str, name: &str) -> f64 {
    let t = Instant::now();
    let id = server.create_cold(image);
    server.command(&id, &format!("cd / && {PREPARE}"));
    server.command(
        &id,
        &format!("mkdir -p /srv/app && cd /srv/app && GREETING=hi sh -c '{STAMP}'"),
    );
    server.command(
        &id,
        &format!("su - user -c '{}'", AS_USER.replace('\'', "'\\''")),
    );
    server.command(
        &id,
        &format!(
            "(setsid sh -c '{START}' >/dev/null 2>&1 </dev/null &); \
             for i in $(seq 300); do {READY} && exit 0; sleep 0.1; done; exit 1"
        ),
    );
    server.snapshot(&id, name);
    let took = ms_since(t);
    server.delete(&id);
    server.delete_template(name);
    took
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs = bench::runs(15);
    let image = common::debian_image();
    let work = PathBuf::from(format!("/tmp/aenv-tb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let server = bench::start_server(&work, None, "");
    println!(
        "# agentenv template build benchmark ({runs} runs, Debian 12, TCG unless KVM is usable)\n"
    );
    let mut load = vec![load_average()];
    let (mut cold, mut cached, mut by_hand) = (Vec::new(), Vec::new(), Vec::new());
    // The image is pulled and unpacked once, outside the rows.
    build(&server, &image, "bench-debian", true);
    for run in 0..runs {
        // Alternate which goes first, so both see the same load.
        if run % 2 == 0 {
            by_hand.push(floor(&server, &image, &format!("bench-floor-{run}")));
        }
        cold.push(build(&server, &image, "bench-debian", true));
        cached.push(build(&server, &image, "bench-debian", false));
        if run % 2 == 1 {
            by_hand.push(floor(&server, &image, &format!("bench-floor-{run}")));
        }
        load.push(load_average());
    }
    let row = |what: &str, v: &[f64]| {
        println!(
            "| {what} | {:.2} s | {:.2} s | {:.2}× |",
            median(v) / 1000.0,
            p90(v) / 1000.0,
            median(v) / median(&by_hand)
        );
    };
    println!("| Row | p50 | p90 | ÷ floor p50 |\n|---|---|---|---|");
    row("template build, cold (7 steps + start/ready, force)", &cold);
    row("template build, every step cached", &cached);
    row(
        "floor: cold sandbox, same commands by hand, snapshot",
        &by_hand,
    );
    let min = load.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = load.iter().cloned().fold(0.0, f64::max);
    println!("\nload average (1 min) during the rows: {min:.2}–{max:.2}");
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
}
