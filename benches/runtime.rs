//! Runtime benchmark (not a timed test): cold start vs the raw QEMU floor measured side by
//! side, network slot create/destroy without the pool, and `GET /sandboxes/{id}`
//! throughput. Needs root and the assets of scripts/setup.sh; run it through
//! `scripts/bench`, which holds the host lock so no other agentenv owns the slots.
//!
//! Prints a markdown table (medians and p90) for docs/performance.md.

use agentenv::agent::AgentClient;
use agentenv::config::Config;
use agentenv::image::ImageStore;
use agentenv::net::SlotManager;
use agentenv::vm::{self, Accel};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const RUNS: usize = 7;
const SLOT_RUNS: usize = 25;
const API_KEY: &str = "bench-key-0123456789abcdefghijklmnopqrstuvwxyz";

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let assets = PathBuf::from(
        std::env::var("AENV_ASSETS_DIR").unwrap_or_else(|_| "/var/lib/agentenv/assets".into()),
    );
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

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s
}

fn median(v: &[f64]) -> f64 {
    sorted(v)[v.len() / 2]
}

fn p90(v: &[f64]) -> f64 {
    let s = sorted(v);
    s[((s.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
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
        create.push(ms(t.elapsed()));
        let path = slot.netns_path().to_path_buf();
        let t = Instant::now();
        slots.release(slot);
        while path.exists() {
            std::thread::sleep(Duration::from_micros(200));
        }
        destroy.push(ms(t.elapsed()));
    }
    slots.shutdown();
    (create, destroy)
}

/// The raw floor and agentenv's cold start, interleaved run by run so both see the same
/// machine load; then API throughput against one running sandbox.
fn boot_times(assets: &Path, work: &Path) -> (Vec<f64>, Vec<f64>, (Vec<f64>, f64)) {
    let images = ImageStore::new(work.join("images"));
    let image = format!("oci:{}", assets.join("base-image").display());
    let base = images.prepare_rootfs(&image, 1024).unwrap().base_disk;
    let accel = vm::detect_accel(agentenv::config::AccelMode::Auto).unwrap();
    let server = BenchServer::start(assets, work);
    // Warm the server's image cache and page cache once.
    let id = server.create(&image);
    server.delete(&id);
    let (mut floor, mut cold) = (Vec::new(), Vec::new());
    for i in 0..RUNS {
        floor.push(raw_floor(assets, &base, work, accel, i));
        let t = Instant::now();
        let id = server.create(&image);
        cold.push(ms(t.elapsed()));
        server.delete(&id);
    }
    let id = server.create(&image);
    let api = server.get_throughput(&id, 4, Duration::from_secs(3));
    server.delete(&id);
    (floor, cold, api)
}

/// QEMU started by hand with the same kernel, initramfs, machine and guest devices as
/// agentenv uses (a user-mode NIC instead of a network slot), timed from spawn to the guest agent's first answer.
fn raw_floor(assets: &Path, base: &Path, work: &Path, accel: Accel, i: usize) -> f64 {
    let dir = work.join(format!("floor-{i}"));
    std::fs::create_dir_all(&dir).unwrap();
    let disk = dir.join("disk.qcow2");
    vm::create_overlay(base, &disk, 1024).unwrap();
    let agent = dir.join("agent.sock");
    let mut machine = "microvm,acpi=on,auto-kernel-cmdline=off".to_string();
    let mut append = "console=ttyS0 reboot=t panic=-1".to_string();
    let (accel_arg, cpu) = match accel {
        Accel::Kvm => ("kvm", "host"),
        Accel::Tcg { tsc_khz } => {
            machine.push_str(",pit=on,pic=off");
            append.push_str(&format!(" tsc_early_khz={tsc_khz} tsc=reliable"));
            ("tcg,tb-size=32", "max")
        }
    };
    append.push_str(" agentenv.port=49983");
    let t = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args([
            "-M", &machine, "-accel", accel_arg, "-cpu", cpu, "-smp", "1", "-m", "256M",
        ])
        .arg("-kernel")
        .arg(vm::guest_kernel(assets))
        .arg("-initrd")
        .arg(assets.join("initramfs.img"))
        .args(["-append", &append])
        .args([
            "-serial",
            &format!("file:{}", dir.join("console.log").display()),
        ])
        .args([
            "-drive",
            &format!("id=root,file={},format=qcow2,if=none", disk.display()),
            "-device",
            "virtio-blk-device,drive=root",
            // A NIC like the product's (user-mode here: the floor has no network slot),
            // so the guest's network setup costs the same.
            "-netdev",
            "user,id=net0",
            "-device",
            "virtio-net-device,netdev=net0,mac=06:00:a9:fe:00:15",
            "-chardev",
            &format!(
                "socket,id=agent,path={},server=on,wait=off",
                agent.display()
            ),
            "-device",
            "virtio-serial-device",
            "-device",
            "virtserialport,chardev=agent,name=agentenv",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let client = AgentClient::connect(&agent, Instant::now() + Duration::from_secs(60));
    let elapsed = ms(t.elapsed());
    let _ = child.kill();
    let _ = child.wait();
    client.expect("raw floor VM never answered");
    let _ = std::fs::remove_dir_all(&dir);
    elapsed
}

/// The real server binary on loopback.
struct BenchServer {
    child: std::process::Child,
    base: String,
}

impl BenchServer {
    fn start(assets: &Path, work: &Path) -> BenchServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = work.join("config.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nstate_dir = \"{}\"\napi_key = \"{API_KEY}\"\n\
                 [vm]\nassets_dir = \"{}\"\ndefault_memory_mb = 256\ndefault_cpu_count = 1\ndefault_disk_size_mb = 1024\n\
                 [network]\npool_min = 2\n",
                work.join("state").display(),
                assets.display()
            ),
        )
        .unwrap();
        let binary = std::env::var("AENV_BENCH_BINARY").unwrap_or_else(|_| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/agentenv").into()
        });
        let child = Command::new(binary)
            .args(["serve", "--config"])
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let server = BenchServer {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while ureq::get(&format!("{}/health", server.base))
            .call()
            .is_err()
        {
            assert!(Instant::now() < deadline, "server did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        // Let the pool fill so slot creation is not on the measured path.
        std::thread::sleep(Duration::from_millis(500));
        server
    }

    fn create(&self, image: &str) -> String {
        let v: serde_json::Value = ureq::post(&format!("{}/sandboxes-cold", self.base))
            .set("X-API-Key", API_KEY)
            .send_json(serde_json::json!({"image": image, "timeout": 600}))
            .unwrap()
            .into_json()
            .unwrap();
        v["sandboxID"].as_str().unwrap().to_string()
    }

    fn delete(&self, id: &str) {
        ureq::delete(&format!("{}/sandboxes/{id}", self.base))
            .set("X-API-Key", API_KEY)
            .call()
            .unwrap();
    }

    /// Per-request latencies and requests per second over `duration` (bounded).
    fn get_throughput(&self, id: &str, threads: usize, duration: Duration) -> (Vec<f64>, f64) {
        let url = format!("{}/sandboxes/{id}", self.base);
        let start = Instant::now();
        let lat: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let url = url.clone();
                    s.spawn(move || {
                        let agent = ureq::AgentBuilder::new().build();
                        let mut lat = Vec::new();
                        while start.elapsed() < duration && lat.len() < 200_000 {
                            let t = Instant::now();
                            agent.get(&url).set("X-API-Key", API_KEY).call().unwrap();
                            lat.push(ms(t.elapsed()));
                        }
                        lat
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let rate = lat.len() as f64 / start.elapsed().as_secs_f64();
        (lat, rate)
    }
}

impl Drop for BenchServer {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}
