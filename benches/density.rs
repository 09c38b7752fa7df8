//! Density and throughput benchmark (not a timed test) against the real server binary:
//!
//! - density: N sandboxes created from one built template on the server's default config
//!   (or as many as admission lets in), left idle; per guest, the QEMU process's PSS and
//!   its CPU over a window (utime + stime from /proc), the host's swap-outs and OOM kills,
//!   and a pause after 32 MiB dirtied while the N are held; next to N
//!   QEMU processes restored by hand from a floor template with a RAM file (the raw
//!   floor: same machine, RAM mapped copy-on-write, the agent connected);
//! - throughput: C concurrent clients each creating a sandbox from the template, running
//!   `true` in it and deleting it, for a fixed time: completed create + first command per
//!   second, and the same with one client;
//! - leaks: after the server stops, no QEMU process, network namespace, link or sandbox
//!   file of the run is left.
//!
//! Needs root and the assets of scripts/setup.sh; run it through `scripts/bench`, which
//! holds the host lock. `AENV_BENCH_GUESTS` (default 500), `AENV_BENCH_IDLE_SECS` (30),
//! `AENV_BENCH_CLIENTS` (8) and `AENV_BENCH_THROUGHPUT_SECS` (20) size the runs;
//! `AENV_BENCH_CONFIG` adds config sections to the server's defaults (say
//! `[metrics]\nsandbox_interval_secs = 0`) to measure what one setting costs.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use agentenv::image::ImageStore;
use bench::{env_or, load_average, median, Floor, FloorVm, DISK_MB};
use common::Server;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let started = Instant::now();
    let guests = env_or("AENV_BENCH_GUESTS", 500);
    let idle_secs = env_or("AENV_BENCH_IDLE_SECS", 30) as u64;
    let clients = env_or("AENV_BENCH_CLIENTS", 8);
    let throughput_secs = env_or("AENV_BENCH_THROUGHPUT_SECS", 20) as u64;
    let assets = bench::assets_dir();
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
    let floor_maps = top_mappings(floor_pids[floor_pids.len() / 2], 6);
    drop(floor_vms);
    load.push(load_average());

    // The server on its default config: admission by headroom, no vCPU cap, the pool on.
    // `AENV_BENCH_CONFIG`: whole config sections added to the defaults, for experiments.
    let extra = std::env::var("AENV_BENCH_CONFIG").unwrap_or_default();
    let mut server = bench::start_server(&work.join("s"), None, &extra);
    let template = server.build_template(&image, "bench-density");

    // Density: hold N idle guests (or as many as admission lets in), then pause one more
    // sandbox after it dirtied 32 MiB, with the N still held.
    let vm_before = VmStat::now();
    let mem_before = mem_available_kb();
    let held = Held::create(&server, &template, guests);
    let pids: Vec<u32> = held
        .ids
        .iter()
        .map(|id| qemu_pid_of(id).expect("a running sandbox has a QEMU process"))
        .collect();
    std::thread::sleep(Duration::from_secs(5));
    let ours_idle = IdleSample::measure(&pids, idle_secs);
    let (hits, misses) = held.split_by_standby(&server, &pids);
    let ours_maps = top_mappings(pids[pids.len() / 2], 6);
    let mem_used_kb = mem_before.saturating_sub(mem_available_kb());
    load.push(load_average());
    let pause_load = load_average();
    let pauses = pause_under_load(&server, &template, bench::runs(15));
    load.push(load_average());
    for id in &held.ids {
        server.delete(id);
    }
    let vm_after = VmStat::now();

    // Throughput: one client, then C clients.
    let single = throughput(&server, &template, 1, throughput_secs);
    load.push(load_average());
    let concurrent = throughput(&server, &template, clients, throughput_secs);
    load.push(load_average());

    server.delete_template(&template);
    let leftover_snapshots = server.count_snapshots();
    let log = server.log();
    server.stop();
    let state_left = sandbox_files_left(&server.state_dir);
    drop(server);
    let host_after = HostObjects::now(&work);

    let held_n = held.ids.len();
    println!(
        "Held {held_n} of {guests} idle guests ({} from a warm standby, {} cold restores){}; \
         creating them took {:.0} s.\n",
        hits.count,
        misses.count,
        held.refused
            .as_ref()
            .map_or(String::new(), |r| format!("; then refused: {r}")),
        held.secs
    );
    println!("| measure (per guest, {held_n} idle guests) | agentenv | raw floor | ratio | goal |");
    println!("|---|---|---|---|---|");
    let row = |name: &str, ours: f64, floor: f64, unit: &str, goal: &str| {
        println!(
            "| {name} | {ours:.2} {unit} | {floor:.2} {unit} | {:.2}× | {goal} |",
            ours / floor
        );
    };
    let met = |ok: bool| if ok { "met" } else { "not met" };
    row(
        "QEMU PSS",
        ours_idle.pss_mib,
        floor_idle.pss_mib,
        "MiB",
        &format!("≤ 30 MiB: {}", met(ours_idle.pss_mib <= 30.0)),
    );
    for (name, part) in [("warm standby", &hits), ("cold restore", &misses)] {
        if part.count > 0 {
            println!(
                "| QEMU PSS, the {} guests from a {name} | {:.2} MiB | | | |",
                part.count, part.pss_mib
            );
        }
    }
    row(
        "QEMU CPU while idle (% of one core)",
        ours_idle.cpu_percent,
        floor_idle.cpu_percent,
        "%",
        &format!("≤ 0.35 %: {}", met(ours_idle.cpu_percent <= 0.35)),
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
        mem_used_kb as f64 / 1024.0 / held_n.max(1) as f64
    );
    println!(
        "| host swapped out / OOM kills during the run | {} pages / {} | | | none: {} |",
        vm_after.pswpout - vm_before.pswpout,
        vm_after.oom_kill - vm_before.oom_kill,
        met(vm_after.pswpout == vm_before.pswpout && vm_after.oom_kill == vm_before.oom_kill)
    );
    println!(
        "| pause after 32 MiB dirtied, {held_n} guests idle (load {pause_load:.2}), p50 / p90 | \
         {:.1} / {:.1} ms | | | p50 ≤ 100 ms: {} |",
        median(&pauses),
        bench::p90(&pauses),
        met(median(&pauses) <= 100.0)
    );
    let (steps, n) = bench::log_medians(
        &log,
        "dirty=true",
        &[
            "stopMs",
            "migrateMs",
            "scanMs",
            "copyMs",
            "syncMs",
            "frozenMs",
            "totalMs",
        ],
    );
    let (pause_ms, _) = bench::log_medians(&log, "op=pause result=ok", &["ms"]);
    println!("| that pause's steps in the server's log (medians of {n}) | {steps}; whole pause {pause_ms} | | | |");
    println!();
    println!("Where a guest's PSS is (MiB; one guest each, its largest mappings):\n");
    println!("- agentenv: {ours_maps}\n- raw floor: {floor_maps}\n");
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

/// The idle guests a run holds.
struct Held {
    ids: Vec<String>,
    /// The refusal that ended the creates early, if one did.
    refused: Option<String>,
    secs: f64,
}

/// PSS per guest of one part of the held guests.
struct Part {
    count: usize,
    pss_mib: f64,
}

impl Held {
    /// Creates up to `n` sandboxes from `template`, one after another, until one is refused.
    fn create(server: &Server, template: &str, n: usize) -> Held {
        let t = Instant::now();
        let mut held = Held {
            ids: Vec::new(),
            refused: None,
            secs: 0.0,
        };
        for _ in 0..n {
            let body = serde_json::json!({"templateID": template, "timeout": 3600});
            match server.try_call("POST", "/sandboxes", Some(body), 201) {
                Ok(v) => held.ids.push(v["sandboxID"].as_str().unwrap().to_string()),
                Err(e) => {
                    held.refused = Some(e);
                    break;
                }
            }
        }
        held.secs = t.elapsed().as_secs_f64();
        held
    }

    /// The guests claimed from a warm standby and the others (from the server's log),
    /// with the PSS of each part (`pids` in the order of `ids`).
    fn split_by_standby(&self, server: &Server, pids: &[u32]) -> (Part, Part) {
        let log = server.log();
        let warm: std::collections::HashSet<&str> = log
            .lines()
            .filter(|l| {
                l.contains("op=create_from_capture result=ok") && l.contains("standby=true")
            })
            .filter_map(|l| l.split("sandboxId=").nth(1)?.split_whitespace().next())
            .collect();
        let part = |want: bool| {
            let kbs: Vec<u64> = self
                .ids
                .iter()
                .zip(pids)
                .filter(|(id, _)| warm.contains(id.as_str()) == want)
                .map(|(_, &p)| pss_kb(p))
                .collect();
            Part {
                count: kbs.len(),
                pss_mib: kbs.iter().sum::<u64>() as f64 / 1024.0 / kbs.len().max(1) as f64,
            }
        };
        (part(true), part(false))
    }
}

/// `runs` times: a new sandbox from `template` dirties 32 MiB of RAM and is paused (the
/// time of the pause), then deleted.
fn pause_under_load(server: &Server, template: &str, runs: usize) -> Vec<f64> {
    (0..runs)
        .map(|_| {
            let (id, _) = server.create_from_template(template);
            server.command(&id, bench::DIRTY_32M);
            std::thread::sleep(Duration::from_millis(500));
            let took = server.pause(&id);
            server.delete(&id);
            took
        })
        .collect()
}

/// The host's swap-outs and OOM kills so far (/proc/vmstat).
struct VmStat {
    pswpout: u64,
    oom_kill: u64,
}

impl VmStat {
    fn now() -> VmStat {
        let text = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
                .unwrap_or(0)
        };
        VmStat {
            pswpout: get("pswpout"),
            oom_kill: get("oom_kill"),
        }
    }
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

/// The mappings of `pid` holding the most PSS: "name (size MiB): PSS MiB", at most `n`.
fn top_mappings(pid: u32, n: usize) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut maps: Vec<(String, u64, u64)> = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            let (a, b) = first.split_once('-').unwrap_or(("0", "0"));
            let size =
                u64::from_str_radix(b, 16).unwrap_or(0) - u64::from_str_radix(a, 16).unwrap_or(0);
            let name = f.nth(4).map_or("[anon]".to_string(), |p| {
                p.rsplit('/').next().unwrap_or(p).to_string()
            });
            maps.push((name, size, 0));
        } else if let (Some("Pss:"), Some(kb), Some(last)) =
            (Some(first), f.next(), maps.last_mut())
        {
            last.2 = kb.parse().unwrap_or(0);
        }
    }
    maps.sort_by_key(|m| std::cmp::Reverse(m.2));
    maps.iter()
        .take(n)
        .map(|(name, size, pss)| {
            format!("{name} ({} MiB): {:.1}", size >> 20, *pss as f64 / 1024.0)
        })
        .collect::<Vec<_>>()
        .join("; ")
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
fn throughput(server: &Server, template: &str, clients: usize, secs: u64) -> Throughput {
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
