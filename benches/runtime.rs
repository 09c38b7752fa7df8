//! Runtime benchmark (not a timed test): cold start vs the raw QEMU floor measured side by
//! side, network slot create/destroy without the pool, and `GET /sandboxes/{id}`
//! throughput. Needs root and the assets of scripts/setup.sh; run it through
//! `scripts/bench`, which holds the host lock so no other agentenv owns the slots.
//!
//! Prints a markdown table (medians and p90) for docs/performance.md.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use agentenv::agent::AgentClient;
use agentenv::config::Config;
use agentenv::image::ImageStore;
use agentenv::net::SlotManager;
use agentenv::vm;
use bench::{median, ms_since, p90, Floor, DISK_MB, STEP_TIMEOUT};
use std::path::Path;
use std::time::{Duration, Instant};

const RUNS: usize = 7;
const SLOT_RUNS: usize = 25;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let assets = bench::assets_dir();
    let work = std::env::temp_dir().join(format!("aenv-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    println!("# agentenv runtime benchmark ({RUNS} runs, TCG unless KVM is usable)\n");

    let (create, destroy) = slot_times();
    let (floor, cold, api) = boot_times(&assets, &work);
    let _ = std::fs::remove_dir_all(&work);

    println!("| measure | p50 | p90 | ratio (p50) |");
    println!("|---|---|---|---|");
    row(
        "raw floor: QEMU by hand → agent's first answer",
        &floor,
        None,
    );
    row(
        "cold start `POST /sandboxes-cold` (base image, cached)",
        &cold,
        Some(median(&cold) / median(&floor)),
    );
    row("slot create, no pool", &create, None);
    row("slot destroy (release → netns file gone)", &destroy, None);
    println!(
        "| `GET /sandboxes/{{id}}` latency, 4 client threads | {:.2} ms | {:.2} ms | {:.0} req/s |",
        median(&api.0),
        p90(&api.0),
        api.1
    );
}

fn row(name: &str, v: &[f64], ratio: Option<f64>) {
    let ratio = ratio.map(|r| format!("{r:.2}×")).unwrap_or_default();
    println!(
        "| {name} | {:.1} ms | {:.1} ms | {ratio} |",
        median(v),
        p90(v)
    );
}

/// Slot creation with an empty pool, and destruction, through the real slot manager.
fn slot_times() -> (Vec<f64>, Vec<f64>) {
    let mut config = Config::from_sources(None, &[]).unwrap();
    config.network.pool_min = 0;
    config.network.pool_max = 0;
    let slots = SlotManager::start(&config.network, &[]).unwrap();
    let (mut create, mut destroy) = (Vec::new(), Vec::new());
    for _ in 0..SLOT_RUNS {
        let t = Instant::now();
        let slot = slots.acquire().unwrap();
        create.push(ms_since(t));
        let path = slot.netns_path().to_path_buf();
        let t = Instant::now();
        slots.release(slot);
        while path.exists() {
            std::thread::sleep(Duration::from_micros(200));
        }
        destroy.push(ms_since(t));
    }
    slots.shutdown();
    (create, destroy)
}

/// The raw floor and agentenv's cold start, interleaved run by run so both see the same
/// machine load; then API throughput against one running sandbox.
fn boot_times(assets: &Path, work: &Path) -> (Vec<f64>, Vec<f64>, (Vec<f64>, f64)) {
    let images = ImageStore::new(work.join("images"));
    let image = format!("oci:{}", assets.join("base-image").display());
    let base = images.prepare_rootfs(&image, DISK_MB).unwrap().base_disk;
    let floor = Floor::new(assets);
    let server = bench::start_server(&work.join("server"), None, "");
    // Warm the server's image cache and page cache once.
    let id = server.create_cold(&image);
    server.delete(&id);
    let (mut floor_ms, mut cold) = (Vec::new(), Vec::new());
    for i in 0..RUNS {
        floor_ms.push(raw_floor(&floor, &base, &work.join(format!("floor-{i}"))));
        let t = Instant::now();
        let id = server.create_cold(&image);
        cold.push(ms_since(t));
        server.delete(&id);
    }
    let id = server.create_cold(&image);
    let api = server.get_throughput(&id, 4, Duration::from_secs(3));
    server.delete(&id);
    (floor_ms, cold, api)
}

/// QEMU started by hand with the product's argv shape (an unconnected NIC instead of a
/// network slot) on a fresh overlay, timed from spawn to the guest agent's first answer.
fn raw_floor(floor: &Floor, base: &Path, dir: &Path) -> f64 {
    std::fs::create_dir_all(dir).unwrap();
    let disk = dir.join("disk.qcow2");
    vm::create_overlay(base, &disk, DISK_MB).unwrap();
    let t = Instant::now();
    let vm = floor.spawn(dir, &disk, false, None);
    let client = AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT);
    let elapsed = ms_since(t);
    drop(vm);
    client.expect("raw floor VM never answered");
    let _ = std::fs::remove_dir_all(dir);
    elapsed
}
