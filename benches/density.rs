//! Density and throughput benchmark (not a timed test) against the real server binary:
//!
//! - density: N sandboxes created from one built template, left idle; per guest, the
//!   QEMU process's PSS and its CPU over a window (utime + stime from /proc), next to N
//!   QEMU processes restored by hand from a floor template with a RAM file (the raw
//!   floor: same machine, RAM mapped copy-on-write, the agent connected);
//! - throughput: C concurrent clients each creating a sandbox from the template, running
//!   `true` in it and deleting it, for a fixed time: completed create + first command per
//!   second, and the same with one client;
//! - leaks: after the server stops, no QEMU process, network namespace, link or sandbox
//!   file of the run is left.
//!
//! Needs root and the assets of scripts/setup.sh; run it through `scripts/bench`, which
//! holds the host lock. `AENV_BENCH_GUESTS` (default 20), `AENV_BENCH_IDLE_SECS` (30),
//! `AENV_BENCH_CLIENTS` (8) and `AENV_BENCH_THROUGHPUT_SECS` (20) size the runs.

#[path = "common/mod.rs"]
mod common;

use agentenv::image::ImageStore;
use common::{load_average, median, BenchServer, Floor, FloorVm, DISK_MB};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        .max(1)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let started = Instant::now();
    let guests = env_or("AENV_BENCH_GUESTS", 20);
    let idle_secs = env_or("AENV_BENCH_IDLE_SECS", 30) as u64;
    let clients = env_or("AENV_BENCH_CLIENTS", 8);
    let throughput_secs = env_or("AENV_BENCH_THROUGHPUT_SECS", 20) as u64;
    let assets = PathBuf::from(
        std::env::var("AENV_ASSETS_DIR").unwrap_or_else(|_| "/var/lib/agentenv/assets".into()),
    );
    let work = PathBuf::from(format!("/tmp/aenv-dn-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let host_before = HostObjects::now(&work);
    println!(
        "# agentenv density and throughput benchmark ({guests} guests idle {idle_secs} s, \
         {clients} clients for {throughput_secs} s)\n"
    );
    let mut load = vec![load_average()];

    // The floor: N VMs restored by hand from a floor template whose RAM is a file.
    let images = ImageStore::new(work.join("images"));
    let image = format!("oci:{}", assets.join("base-image").display());
    let base = images.prepare_rootfs(&image, DISK_MB).unwrap().base_disk;
    let floor = Floor::new(&assets);
    let template = floor.make_template(&base, &work.join("ft"), true);
    let floor_vms: Vec<FloorVm> = (0..guests)
        .map(|i| {
            floor
                .clone_template(&template, &work.join(format!("f{i}")))
                .0
        })
        .collect();
    let floor_pids: Vec<u32> = floor_vms.iter().map(|v| v.child.id()).collect();
    std::thread::sleep(Duration::from_secs(5));
    let floor_idle = IdleSample::measure(&floor_pids, idle_secs);
    drop(floor_vms);
    load.push(load_average());

    // Admission would stop at 4 vCPUs per host core; the density run asks for more.
    let server = BenchServer::start_with(
        &assets,
        &work.join("s"),
        None,
        &format!("[admission]\nmax_vcpus = {}\n", guests + clients + 8),
    );
    let template = server.build_template(&image, "bench-density");

    // Density.
    let mem_before = mem_available_kb();
    let ids: Vec<String> = (0..guests)
        .map(|_| server.create_from_template(&template).0)
        .collect();
    let pids: Vec<u32> = ids
        .iter()
        .map(|id| qemu_pid_of(id).expect("a running sandbox has a QEMU process"))
        .collect();
    std::thread::sleep(Duration::from_secs(5));
    let ours_idle = IdleSample::measure(&pids, idle_secs);
    let mem_used_kb = mem_before.saturating_sub(mem_available_kb());
    load.push(load_average());
    for id in &ids {
        server.delete(id);
    }

    // Throughput: one client, then C clients.
    let single = throughput(&server, &template, 1, throughput_secs);
    load.push(load_average());
    let concurrent = throughput(&server, &template, clients, throughput_secs);
    load.push(load_average());

    server.delete_template(&template);
    let leftover_snapshots = server.count_snapshots();
    let log = std::fs::read_to_string(&server.log).unwrap_or_default();
    drop(server);
    let state_left = sandbox_files_left(&work.join("s/state"));
    let host_after = HostObjects::now(&work);

    println!("| measure (per guest, {guests} idle guests) | agentenv | raw floor | ratio | goal |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, ours: f64, floor: f64, unit: &str, goal: &str| {
        println!(
            "| {name} | {ours:.2} {unit} | {floor:.2} {unit} | {:.2}× | {goal} |",
            ours / floor
        );
    };
    let pss_goal = if ours_idle.pss_mib <= 30.0 {
        "met"
    } else {
        "not met"
    };
    let cpu_goal = if ours_idle.cpu_percent <= 0.35 {
        "met"
    } else {
        "not met"
    };
    row(
        "QEMU PSS",
        ours_idle.pss_mib,
        floor_idle.pss_mib,
        "MiB",
        &format!("≤ 30 MiB: {pss_goal}"),
    );
    row(
        "QEMU CPU while idle (% of one core)",
        ours_idle.cpu_percent,
        floor_idle.cpu_percent,
        "%",
        &format!("≤ 0.35 %: {cpu_goal}"),
    );
    row(
        "QEMU wake-ups while idle (threads scheduled in, per second)",
        ours_idle.wakeups,
        floor_idle.wakeups,
        "/s",
        "",
    );
    println!(
        "| host MemAvailable drop per guest | {:.1} MiB | | | |",
        mem_used_kb as f64 / 1024.0 / guests as f64
    );
    println!();
    println!(
        "| throughput: create from template + first command (`true`) + delete | per second \
         | create → first answer p50 | CPU-s per round: server + QEMU | CPU-s per round: host \
         | host CPUs busy | errors |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (n, t) in [(1, &single), (clients, &concurrent)] {
        println!(
            "| {n} client(s), {throughput_secs} s | {:.2}/s | {:.0} ms | {:.3} | {:.3} | {:.0} % | {} |",
            t.per_second,
            median(&t.latencies),
            t.server_cpu,
            t.host_cpu,
            t.host_busy,
            t.errors
        );
    }
    println!();
    let leaks = host_before.leaks(&host_after);
    println!(
        "Leaks after the server stopped: {}; sandbox files left under the state dir: {}; \
         snapshots left: {leftover_snapshots}. 1-min load average during the run: \
         {:.2}–{:.2}; wall time {:.0} s.",
        if leaks.is_empty() {
            "none".to_string()
        } else {
            leaks.join(", ")
        },
        state_left,
        load.iter().cloned().fold(f64::INFINITY, f64::min),
        load.iter().cloned().fold(0.0, f64::max),
        started.elapsed().as_secs_f64()
    );
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    if !errors.is_empty() {
        println!("\nServer errors ({}):\n{}", errors.len(), errors.join("\n"));
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// PSS, CPU and wake-ups of a set of processes over an idle window, per process.
struct IdleSample {
    pss_mib: f64,
    cpu_percent: f64,
    /// Times any thread of the process was scheduled in, per second: unlike the CPU
    /// share, this does not grow when other work on the host slows the guests down.
    wakeups: f64,
}

impl IdleSample {
    fn measure(pids: &[u32], secs: u64) -> IdleSample {
        let sum = |pids: &[u32]| -> (u64, u64) {
            pids.iter()
                .map(|&p| sched_totals(p))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        };
        let before = sum(pids);
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs(secs));
        let after = sum(pids);
        let wall = t.elapsed().as_secs_f64();
        let n = pids.len() as f64;
        let pss_kb: u64 = pids.iter().map(|&p| pss_kb(p)).sum();
        IdleSample {
            pss_mib: pss_kb as f64 / 1024.0 / n,
            cpu_percent: (after.0 - before.0) as f64 / 1e9 / wall * 100.0 / n,
            wakeups: (after.1 - before.1) as f64 / wall / n,
        }
    }
}

/// Nanoseconds on a CPU and times scheduled in, summed over the threads of `pid`
/// (`/proc/<pid>/task/*/schedstat`; 0 once it is gone).
fn sched_totals(pid: u32) -> (u64, u64) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0);
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .map(|s| {
            let mut f = s.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
            let ns = f.next().unwrap_or(0);
            let slices = f.nth(1).unwrap_or(0);
            (ns, slices)
        })
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

fn pss_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn mem_available_kb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Processes whose command line contains `needle`.
fn pids_with(needle: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

/// The QEMU process of a sandbox (its run dir, in QEMU's argv, holds the id).
fn qemu_pid_of(id: &str) -> Option<u32> {
    pids_with(id).into_iter().find(|pid| {
        std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|e| e.to_string_lossy().contains("qemu-system"))
            .unwrap_or(false)
    })
}

/// Files of sandboxes left in the server's state dir (run dirs, paused state, disks).
fn sandbox_files_left(state: &Path) -> usize {
    let mut count = 0;
    let mut stack = vec![state.join("sandboxes")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(e.path());
            } else {
                count += 1;
            }
        }
    }
    count
}

/// What a run could leak on the host.
struct HostObjects {
    netns: Vec<String>,
    links: Vec<String>,
    qemus: Vec<u32>,
}

impl HostObjects {
    fn now(work: &Path) -> HostObjects {
        let names = |dir: &str| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(dir)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            v.sort();
            v
        };
        HostObjects {
            netns: names("/var/run/netns"),
            links: names("/sys/class/net"),
            qemus: pids_with(&work.to_string_lossy()),
        }
    }

    fn leaks(&self, after: &HostObjects) -> Vec<String> {
        let new = |a: &[String], b: &[String]| -> Vec<String> {
            b.iter().filter(|x| !a.contains(x)).cloned().collect()
        };
        let mut out = Vec::new();
        let netns = new(&self.netns, &after.netns);
        if !netns.is_empty() {
            out.push(format!("network namespaces {netns:?}"));
        }
        let links = new(&self.links, &after.links);
        if !links.is_empty() {
            out.push(format!("links {links:?}"));
        }
        let qemus: Vec<u32> = after
            .qemus
            .iter()
            .filter(|p| !self.qemus.contains(p))
            .copied()
            .collect();
        if !qemus.is_empty() {
            out.push(format!("processes {qemus:?}"));
        }
        out
    }
}

struct Throughput {
    per_second: f64,
    latencies: Vec<f64>,
    errors: usize,
    /// CPU-seconds per completed round: the server and the QEMU processes it reaped.
    server_cpu: f64,
    /// CPU-seconds per completed round on the whole host (kernel threads included, and
    /// whatever else runs on it).
    host_cpu: f64,
    /// How busy the host's CPUs were over the window, in % of all of them.
    host_busy: f64,
}

/// CPU-seconds of `pid` and of its children it has reaped (utime, stime, cutime, cstime).
fn process_tree_cpu(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces, in parentheses).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let ticks: u64 = rest
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|v| v.parse::<u64>().ok())
        .sum();
    // Linux's USER_HZ is 100.
    ticks as f64 / 100.0
}

/// (busy, total) CPU-seconds of the host since boot, from /proc/stat.
fn host_cpu() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    // idle and iowait are the 4th and 5th.
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    ((total - idle) as f64 / 100.0, total as f64 / 100.0)
}

/// `clients` threads each creating a sandbox from `template`, running `true` and deleting
/// it, until `secs` have passed; completed rounds per second over the whole window
/// (the deletes included).
fn throughput(server: &BenchServer, template: &str, clients: usize, secs: u64) -> Throughput {
    let stop = AtomicBool::new(false);
    let errors = AtomicUsize::new(0);
    let latencies = parking_lot::Mutex::new(Vec::new());
    let (server_before, host_before) = (process_tree_cpu(server.pid()), host_cpu());
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let started = Instant::now();
                    match server.try_create_and_run(template) {
                        Ok(id) => {
                            latencies
                                .lock()
                                .push(started.elapsed().as_secs_f64() * 1000.0);
                            server.delete(&id);
                        }
                        Err(e) => {
                            eprintln!("throughput round failed: {e}");
                            errors.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_secs(secs));
        stop.store(true, Ordering::SeqCst);
    });
    let wall = t.elapsed().as_secs_f64();
    let (server_after, host_after) = (process_tree_cpu(server.pid()), host_cpu());
    let latencies = latencies.into_inner();
    let rounds = latencies.len().max(1) as f64;
    Throughput {
        per_second: latencies.len() as f64 / wall,
        errors: errors.into_inner(),
        server_cpu: (server_after - server_before) / rounds,
        host_cpu: (host_after.0 - host_before.0) / rounds,
        host_busy: (host_after.0 - host_before.0) / (host_after.1 - host_before.1).max(0.01)
            * 100.0,
        latencies,
    }
}
