//! Forwarding cost across nodes (issue 22; not a timed test): three real nodes behind
//! HAProxy (tests/common/cluster.rs), a sandbox owned by n1, and the same requests sent
//! side by side, interleaved run by run:
//!
//! - **direct**: to the owner, n1 (the floor: the same work with no forwarding);
//! - **forwarded**: to n2, which relays to n1 (api/forward.rs);
//! - **haproxy**: through the load balancer (round-robin: one in three lands on the owner).
//!
//! Rows: a command round trip (`true` through envd's `process.Process/Start`, as the SDKs
//! run commands), a control-plane read (`GET /sandboxes/{id}`), and create → first
//! command answer (the create made where the row says, the command sent the same way).
//! `AENV_BENCH_RUNS` (default 31) sets the runs per row, the creates get half.
//!
//! Needs root, QEMU, HAProxy and the assets of scripts/setup.sh; run it under the host
//! lock: `flock /run/agentenv-host.lock cargo bench --bench cluster`.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use bench::{load_average, median, ms_since, p90};
use common::cluster::{envd_sh, Cluster};
use common::{base_image, id_of, Server};
use serde_json::json;
use std::time::Instant;

/// The three ways a request reaches the owner.
const PATHS: [&str; 3] = ["direct", "forwarded", "haproxy"];

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs = bench::runs(31).max(3);
    let load_before = load_average();
    let cluster = Cluster::start();
    let via = |path: &str| -> &Server {
        match path {
            "direct" => cluster.node("n1"),
            "forwarded" => cluster.node("n2"),
            _ => &cluster.lb,
        }
    };
    let v = cluster
        .node("n1")
        .create(json!({"image": base_image(), "timeout": 600}));
    let (id, token) = (
        id_of(&v),
        v["envdAccessToken"].as_str().unwrap().to_string(),
    );
    // Warm every path once (connections, the guest's first process).
    for path in PATHS {
        assert_eq!(envd_sh(via(path), &id, &token, "true").1, 0);
    }

    let mut command = Samples::default();
    let mut read = Samples::default();
    for _ in 0..runs {
        for (i, path) in PATHS.iter().enumerate() {
            let t = Instant::now();
            assert_eq!(envd_sh(via(path), &id, &token, "true").1, 0, "{path}");
            command.0[i].push(ms_since(t));
            let t = Instant::now();
            let (code, got) = via(path).call("GET", &format!("/sandboxes/{id}"), None);
            assert_eq!(code, 200, "{path}: {got}");
            read.0[i].push(ms_since(t));
        }
    }

    let mut first = Samples::default();
    for _ in 0..runs.div_ceil(2) {
        for (i, path) in PATHS.iter().enumerate() {
            // The create where the row says (forwarded: on the owner, which the command
            // then reaches through n2).
            let maker = if *path == "haproxy" {
                &cluster.lb
            } else {
                cluster.node("n1")
            };
            let t = Instant::now();
            let v = maker.create(json!({"image": base_image(), "timeout": 120}));
            let (new_id, new_token) = (id_of(&v), v["envdAccessToken"].as_str().unwrap());
            assert_eq!(
                envd_sh(via(path), &new_id, new_token, "true").1,
                0,
                "{path}"
            );
            first.0[i].push(ms_since(t));
            let (code, got) = via(path).call("DELETE", &format!("/sandboxes/{new_id}"), None);
            assert_eq!(code, 204, "{path}: {got}");
        }
    }
    let (code, got) = cluster
        .node("n1")
        .call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "{got}");
    drop(cluster);

    println!(
        "\n### Forwarding across nodes ({runs} runs per row, creates {}; load {load_before:.1} \
         before, {:.1} after)\n",
        runs.div_ceil(2),
        load_average()
    );
    println!("| row | direct p50 / p90 | forwarded p50 / p90 (added p50) | haproxy p50 / p90 (added p50) |");
    println!("|---|---|---|---|");
    command.row("command round trip (`true`, envd Start)");
    read.row("`GET /sandboxes/{id}`");
    first.row("create → first command answer");
}

/// One row's milliseconds per path, in [`PATHS`] order.
#[derive(Default)]
struct Samples([Vec<f64>; 3]);

impl Samples {
    fn row(&self, name: &str) {
        let floor = median(&self.0[0]);
        let cell = |v: &[f64]| format!("{:.2} / {:.2}", median(v), p90(v));
        let added = |v: &[f64]| format!("{:+.2} ms", median(v) - floor);
        println!(
            "| {name} | {} | {} ({}) | {} ({}) |",
            cell(&self.0[0]),
            cell(&self.0[1]),
            added(&self.0[1]),
            cell(&self.0[2]),
            added(&self.0[2]),
        );
    }
}
