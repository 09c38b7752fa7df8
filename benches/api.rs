//! `/health` latency under hostile load (not a test; issue "the API server survives
//! hostile and careless clients"): (a) idle, (b) while one sandbox has 16 commands sleeping
//! and 16 uploads stalled mid-body, (c) while 200 slowloris connections trickle their
//! headers. Each sample is a new connection: connect, `GET /health`, the answer's head.
//! Goal: p99 under 50 ms in (b) and (c). Prints a markdown table.
//!
//! Needs root and the assets of scripts/setup.sh; run it through `scripts/bench`, which
//! holds the host lock. One template build (one cold boot) and one restore.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use bench::{median, sorted};
use common::API_KEY;
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SAMPLES: usize = 500;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let assets = bench::assets_dir();
    let work = PathBuf::from(format!("/tmp/aenv-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let server = bench::start_server(&work, None, "");
    let addr = server.base.trim_start_matches("http://").to_string();
    println!(
        "# agentenv API latency benchmark ({SAMPLES} × GET /health per row, new connection each)\n"
    );
    let mut rows = Vec::new();

    rows.push(("(a) idle", health_latencies(&addr)));

    // (b) one sandbox: 16 commands sleeping, 16 uploads stalled mid-body.
    let image = format!("oci:{}", assets.join("base-image").display());
    server.build_template(&image, "bench-api");
    let v = server.call_expect(
        "POST",
        "/sandboxes",
        Some(json!({"templateID": "bench-api", "timeout": 600})),
        201,
    );
    let id = v["sandboxID"].as_str().unwrap().to_string();
    for _ in 0..16 {
        let url = format!("{}/sandboxes/{id}/commands", server.base);
        // Detached: the sandbox's deletion ends them.
        std::thread::spawn(move || {
            let _ = ureq::post(&url)
                .set("X-API-Key", API_KEY)
                .send_json(json!({"cmd": "sleep", "args": ["120"], "timeoutMs": 600000}));
        });
    }
    let stalled = common::stalled_uploads(&server, &id, 16);
    std::thread::sleep(Duration::from_secs(2));
    rows.push((
        "(b) 16 sleeping commands + 16 stalled uploads",
        health_latencies(&addr),
    ));
    drop(stalled);
    server.delete(&id);

    // (c) 200 slowloris connections, one header byte each every 500 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let mut slow: Vec<TcpStream> = (0..200)
        .map(|_| {
            let mut c = TcpStream::connect(&addr).unwrap();
            c.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").unwrap();
            c
        })
        .collect();
    let trickle = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for c in slow.iter_mut() {
                    let _ = c.write_all(b"a");
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    rows.push(("(c) 200 slowloris connections", health_latencies(&addr)));
    stop.store(true, Ordering::Relaxed);
    trickle.join().unwrap();

    println!("| /health under | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|");
    for (name, samples) in &rows {
        let s = sorted(samples);
        let p99 = s[(s.len() * 99 / 100).min(s.len() - 1)];
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            median(samples),
            p99,
            s[s.len() - 1]
        );
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&work);
}

/// [`SAMPLES`] sequential `GET /health`, each on a new connection; milliseconds each.
fn health_latencies(addr: &str) -> Vec<f64> {
    (0..SAMPLES)
        .map(|_| {
            let started = Instant::now();
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let mut head = [0u8; 12];
            c.read_exact(&mut head).unwrap();
            assert_eq!(&head[9..12], b"204", "GET /health");
            started.elapsed().as_secs_f64() * 1000.0
        })
        .collect()
}
