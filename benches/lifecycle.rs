//! Lifecycle benchmark through the API (not a timed test): pause, resume, snapshot and
//! create from a template against the real server binary, client-side, each next to a
//! raw floor measured in the same run.
//!
//! The floor is QEMU started by hand with an explicit argv like the product's (same
//! machine, memory backend, devices, seccomp sandbox and kernel command line; a user-mode
//! NIC instead of a network slot), driven by hand over QMP with `agentenv::vm::Qmp` (the
//! plain QMP client, none of agentenv's capture code): no fsync, no disk freeze, no hooks,
//! no records, no clock sync. Product and floor alternate run by run (and which goes first
//! alternates too) so both see the same load. A local extension answering 200 `{}` to
//! every hook is configured, so resume and create from a template include start-resume.
//!
//! Needs root and the assets of scripts/setup.sh; run it through `scripts/bench`, which
//! holds the host lock. `AENV_BENCH_RUNS` sets the runs per row (default 20). Prints a
//! markdown table (p50, p90, ratios) for docs/performance.md.

use agentenv::agent::{AgentClient, ExecRequest};
use agentenv::config::AccelMode;
use agentenv::image::ImageStore;
use agentenv::vm::{self, Accel, Qmp, GUEST_MAC};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const API_KEY: &str = "bench-key-0123456789abcdefghijklmnopqrstuvwxyz";
const MEMORY_MB: u32 = 256;
const DISK_MB: u32 = 1024;
/// Wait between operations so the guest is idle when the next one starts.
const SETTLE: Duration = Duration::from_millis(250);
/// The migration bandwidth cap the product uses for captures (QEMU's default of
/// 128 MiB/s is several times slower than writing the file).
const CAPTURE_BANDWIDTH: u64 = 64 << 30;
/// What the product sets on every capture and restore.
const MIGRATION_CAPS: &[(&str, bool)] = &[("x-ignore-shared", true)];
/// Upper bound for any single step of the floor (boot, save, load).
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let started = Instant::now();
    let runs: usize = std::env::var("AENV_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
        .max(1);
    let assets = PathBuf::from(
        std::env::var("AENV_ASSETS_DIR").unwrap_or_else(|_| "/var/lib/agentenv/assets".into()),
    );
    // Short: QEMU's socket paths under it must fit in sun_path.
    let work = PathBuf::from(format!("/tmp/aenv-lc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    println!("# agentenv lifecycle benchmark ({runs} runs, TCG unless KVM is usable)\n");

    let images = ImageStore::new(work.join("images"));
    let image = format!("oci:{}", assets.join("base-image").display());
    let base = images.prepare_rootfs(&image, DISK_MB).unwrap().base_disk;
    let accel = vm::detect_accel(AccelMode::Auto).unwrap();
    let mut load = vec![load_average()];

    // Floor: cold-booted QEMU saved idle, twice: once with anonymous RAM (the state file
    // holds the RAM: the floor of a snapshot used as a template), once with its RAM in a
    // shared file (the floor of a built template: clones map it copy-on-write).
    let floor = Floor {
        assets: assets.clone(),
        accel,
        cmdline: vm::kernel_cmdline(accel, &["agentenv.port=49983".into()]).unwrap(),
    };
    let plain = floor.make_template(&base, &work.join("ft"), false);
    let ramfile = floor.make_template(&base, &work.join("fr"), true);

    // Phase 1: the server without an extension: create from a built template.
    let mut create_plain = Row::new(
        "create from a built template `POST /sandboxes` → 201, no extension",
        Some(40.0),
    );
    {
        let server = BenchServer::start(&assets, &work.join("s1"), None);
        let built = server.build_template(&image, "bench-built-1");
        for i in 0..runs {
            std::thread::sleep(SETTLE);
            let (p, f) = alternate(
                i % 2 == 0,
                || {
                    let (clone, took) = server.create_from_template(&built);
                    server.delete(&clone);
                    took
                },
                || {
                    let dir = work.join(format!("f1-{i}"));
                    let (vm, took) = floor.clone_template(&ramfile, &dir);
                    drop(vm);
                    std::fs::remove_dir_all(&dir).unwrap();
                    took
                },
            );
            create_plain.push(p, f);
            load.push(load_average());
            eprintln!("phase 1: run {}/{runs} done", i + 1);
        }
        server.delete_template(&built);
        assert_eq!(server.count_snapshots(), 0, "phase 1 left snapshots");
    }

    // Phase 2: the server with a local extension (start-resume on every create and
    // resume): the path users take, on one template-derived sandbox per run.
    let extension = HookExtension::start();
    let server = BenchServer::start(&assets, &work.join("s2"), Some(&extension.url));
    let built = server.build_template(&image, "bench-built-2");
    let mut rows = UserPath::rows();
    let mut state_bytes = (Vec::new(), Vec::new());
    let (mut create_hook, mut resume_hook) = (Vec::new(), Vec::new());
    let resumes_before = extension.start_resumes();
    for i in 0..runs {
        let mut product = None;
        let mut floor_run = None;
        alternate(
            i % 2 == 0,
            || {
                let (path, bytes, hooks) = server.user_path(&built, &extension);
                state_bytes.0.push(bytes);
                create_hook.extend(hooks.0);
                resume_hook.extend(hooks.1);
                product = Some(path);
                0.0
            },
            || {
                let (path, bytes) = floor.user_path(&ramfile, &work.join(format!("f2-{i}")));
                state_bytes.1.push(bytes);
                floor_run = Some(path);
                0.0
            },
        );
        UserPath::push(&mut rows, &product.unwrap(), &floor_run.unwrap());
        load.push(load_average());
        eprintln!("phase 2: run {}/{runs} done", i + 1);
    }
    let start_resumes = extension.start_resumes() - resumes_before;

    // Phase 3 (same server): snapshot of a running cold-booted sandbox, and create from
    // that snapshot used as a template (its RAM is in the state file).
    let id = server.create_cold(&image);
    let mut snapshot = Row::new(
        "snapshot `POST /sandboxes/{id}/snapshots` → 201",
        Some(150.0),
    );
    let mut create_snap = Row::new(
        "create from a snapshot used as template `POST /sandboxes` → 201",
        Some(150.0),
    );
    let fdir = work.join("f3");
    let (mut fvm, _) = floor.clone_template(&plain, &fdir);
    let snap_state = fdir.join("snap.bin");
    std::thread::sleep(SETTLE);
    let template = format!("bench-template-{}", std::process::id());
    server.snapshot(&id, &template);
    for i in 0..runs {
        std::thread::sleep(SETTLE);
        let name = format!("bench-snap-{}-{i}", std::process::id());
        let (p, f) = alternate(
            i % 2 == 0,
            || {
                let took = server.snapshot(&id, &name);
                server.delete_template(&name);
                took
            },
            || {
                let took = fvm.snapshot(&snap_state);
                std::fs::remove_file(&snap_state).unwrap();
                took
            },
        );
        snapshot.push(p, f);
        std::thread::sleep(SETTLE);
        let (p, f) = alternate(
            i % 2 == 0,
            || {
                let (clone, took) = server.create_from_template(&template);
                server.delete(&clone);
                took
            },
            || {
                let dir = work.join(format!("f3-{i}"));
                let (vm, took) = floor.clone_template(&plain, &dir);
                drop(vm);
                std::fs::remove_dir_all(&dir).unwrap();
                took
            },
        );
        create_snap.push(p, f);
        load.push(load_average());
        eprintln!("phase 3: run {}/{runs} done", i + 1);
    }
    drop(fvm);
    server.delete(&id);
    server.delete_template(&template);
    server.delete_template(&built);
    let leftover = server.count_snapshots();
    let log = std::fs::read_to_string(server.log.clone()).unwrap_or_default();
    drop(server);
    drop(extension);
    let _ = std::fs::remove_dir_all(&work);

    println!("| operation | agentenv p50 | agentenv p90 | raw floor p50 | raw floor p90 | ratio (p50) | goal |");
    println!("|---|---|---|---|---|---|---|");
    let mut all = vec![&create_plain];
    all.extend(rows.iter());
    all.extend([&snapshot, &create_snap]);
    for row in all {
        row.print();
        eprintln!("{}: agentenv {:.0?}", row.name, row.ours);
        eprintln!("{}: floor {:.0?}", row.name, row.floor);
    }
    println!(
        "| state written by the pause after 32 MiB dirtied (MB) | {:.1} | {:.1} | {:.1} | {:.1} | | |",
        median(&state_bytes.0) / 1e6,
        p90(&state_bytes.0) / 1e6,
        median(&state_bytes.1) / 1e6,
        p90(&state_bytes.1) / 1e6,
    );
    println!();
    println!(
        "Floors: QEMU by hand (explicit argv like the product's, user-mode NIC) over QMP, \
         the guest agent over its virtio-serial socket. create = fresh overlay + spawn with \
         `-incoming defer` + migrate-incoming + cont + the agent's first answer (built \
         template: RAM mapped copy-on-write from the floor template's RAM file); first \
         command = `true` through the agent; pause = stop + migrate to file + quit (exited); \
         resume = as create, from the paused state; snapshot = stop + migrate to file + cont."
    );
    println!(
        "start-resume hooks answered by the local extension: {start_resumes} (expected {}); \
         snapshots left after cleanup: {leftover}; 1-min load average during the run: \
         {:.2}–{:.2}; wall time {:.0} s.",
        2 * runs,
        load.iter().cloned().fold(f64::INFINITY, f64::min),
        load.iter().cloned().fold(0.0, f64::max),
        started.elapsed().as_secs_f64()
    );
    println!();
    print_breakdown(&log);
    println!(
        "| create, start-resume reaches the extension (client clock) | ms {:.0} | {} |",
        median(&create_hook),
        create_hook.len()
    );
    println!(
        "| resume, start-resume reaches the extension (client clock) | ms {:.0} | {} |",
        median(&resume_hook),
        resume_hook.len()
    );
}

/// The steps of the path users take, timed, for one sandbox (product) or VM (floor).
#[derive(Default)]
struct UserPath {
    create: f64,
    first_command: f64,
    next_command: f64,
    create_to_first: f64,
    pause_idle: f64,
    resume: f64,
    resume_to_first: f64,
    pause_dirty: f64,
}

impl UserPath {
    fn rows() -> Vec<Row> {
        vec![
            Row::new(
                "create from a built template → 201, local extension",
                Some(45.0),
            ),
            Row::new("first command (`true`) after that create", Some(15.0)),
            Row::new("the next command (`true`)", None),
            Row::new(
                "**create → first command answer**, extension on",
                Some(60.0),
            ),
            Row::new(
                "pause `POST /sandboxes/{id}/pause`, idle template-derived sandbox",
                Some(50.0),
            ),
            Row::new("resume → 201, template-derived sandbox", None),
            Row::new(
                "**resume → first command answer**, extension on",
                Some(100.0),
            ),
            Row::new("pause after the guest dirtied 32 MiB", Some(100.0)),
        ]
    }

    fn push(rows: &mut [Row], ours: &UserPath, floor: &UserPath) {
        let pick = |p: &UserPath| {
            [
                p.create,
                p.first_command,
                p.next_command,
                p.create_to_first,
                p.pause_idle,
                p.resume,
                p.resume_to_first,
                p.pause_dirty,
            ]
        };
        for ((row, o), f) in rows.iter_mut().zip(pick(ours)).zip(pick(floor)) {
            row.push(o, f);
        }
    }
}

/// Writes 32 MiB of non-zero data into guest RAM (tmpfs); rewritten on every run.
const DIRTY_32M: &str = "head -c 1048576 /dev/urandom > /dev/shm/seed && \
     for i in $(seq 32); do cat /dev/shm/seed; done > /dev/shm/dirty && rm /dev/shm/seed";

/// One operation: the product's and the floor's times, and the goal.
struct Row {
    name: &'static str,
    goal_ms: Option<f64>,
    ours: Vec<f64>,
    floor: Vec<f64>,
}

impl Row {
    fn new(name: &'static str, goal_ms: Option<f64>) -> Row {
        Row {
            name,
            goal_ms,
            ours: Vec::new(),
            floor: Vec::new(),
        }
    }

    fn push(&mut self, ours: f64, floor: f64) {
        self.ours.push(ours);
        self.floor.push(floor);
    }

    fn print(&self) {
        let (ours, floor) = (median(&self.ours), median(&self.floor));
        let goal = match self.goal_ms {
            Some(goal) if ours <= goal => format!("≤ {goal:.0} ms: met"),
            Some(goal) => format!("≤ {goal:.0} ms: not met"),
            None => String::new(),
        };
        println!(
            "| {} | {ours:.1} ms | {:.1} ms | {floor:.1} ms | {:.1} ms | {:.2}× | {goal} |",
            self.name,
            p90(&self.ours),
            p90(&self.floor),
            ours / floor,
        );
    }
}

/// Runs the product's and the floor's measurement, in the given order.
fn alternate(
    product_first: bool,
    product: impl FnOnce() -> f64,
    floor: impl FnOnce() -> f64,
) -> (f64, f64) {
    if product_first {
        let p = product();
        (p, floor())
    } else {
        let f = floor();
        (product(), f)
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    sorted(v)[v.len() / 2]
}

fn p90(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let s = sorted(v);
    s[((s.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)]
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Where the server says its time went (its info log, `key=value` fields): medians.
fn print_breakdown(log: &str) {
    let entries: [(&str, &str, &[&str]); 6] = [
        ("pause, whole operation", "op=pause result=ok", &["ms"]),
        (
            "pause, VM capture+quit",
            "op=pause frozenMs",
            &["frozenMs", "totalMs"],
        ),
        ("resume, whole operation", "op=resume result=ok", &["ms"]),
        (
            "snapshot, VM capture",
            "op=snapshot frozenMs",
            &["frozenMs", "totalMs"],
        ),
        (
            "create from template, whole operation",
            "op=create_from_capture result=ok",
            &["ms"],
        ),
        (
            "restore (resume and create), QEMU spawn / state load",
            "vm op=restore",
            &["spawnMs", "loadMs"],
        ),
    ];
    println!("Server-side (from its info log), medians:\n");
    println!("| step | fields | n |");
    println!("|---|---|---|");
    for (name, marker, keys) in entries {
        let lines: Vec<&str> = log.lines().filter(|l| l.contains(marker)).collect();
        let fields: Vec<String> = keys
            .iter()
            .map(|key| {
                let values: Vec<f64> = lines.iter().filter_map(|l| field(l, key)).collect();
                format!("{key} {:.0}", median(&values))
            })
            .collect();
        println!("| {name} | {} | {} |", fields.join(", "), lines.len());
    }
    let captures: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("vm op=capture"))
        .collect();
    let parts: Vec<String> = ["stopMs", "diskMs", "migrateMs", "syncMs", "totalMs"]
        .iter()
        .map(|key| {
            let values: Vec<f64> = captures.iter().filter_map(|l| field(l, key)).collect();
            format!("{key} {:.0}", median(&values))
        })
        .collect();
    println!(
        "| capture (pause and snapshot), VM steps | {} | {} |",
        parts.join(", "),
        captures.len()
    );
}

fn field(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// The raw floor: QEMU by hand.
struct Floor {
    assets: PathBuf,
    accel: Accel,
    cmdline: String,
}

/// One hand-started QEMU; killed on drop.
struct FloorVm {
    child: Child,
    qmp: Qmp,
    agent: PathBuf,
    client: Option<AgentClient>,
}

/// A floor template: the idle VM's state, its (now immutable) disk, and its RAM file when
/// it ran with one.
struct FloorTemplate {
    state: PathBuf,
    disk: PathBuf,
    memory: Option<PathBuf>,
}

impl Floor {
    /// Spawns QEMU in `run` on `disk` with the product's argv shape, and connects QMP.
    /// `memory`: the RAM file and whether it is mapped shared (else anonymous RAM).
    fn spawn(
        &self,
        run: &Path,
        disk: &Path,
        incoming: bool,
        memory: Option<(&Path, bool)>,
    ) -> FloorVm {
        std::fs::create_dir_all(run).unwrap();
        let (qmp_sock, agent) = (run.join("qmp.sock"), run.join("agent.sock"));
        for socket in [&qmp_sock, &agent] {
            let _ = std::fs::remove_file(socket);
        }
        let mut machine =
            String::from("microvm,acpi=on,auto-kernel-cmdline=off,memory-backend=ram");
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm", "host"),
            Accel::Tcg { .. } => {
                machine.push_str(",pit=on,pic=off");
                ("tcg,tb-size=32", "max")
            }
        };
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
            .args(["-M", &machine, "-accel", accel, "-cpu", cpu])
            .args(["-smp", "1", "-m", &format!("{MEMORY_MB}M")])
            .args([
                "-sandbox",
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            ])
            .arg("-kernel")
            .arg(vm::guest_kernel(&self.assets))
            .arg("-initrd")
            .arg(self.assets.join("initramfs.img"))
            .args(["-append", &self.cmdline])
            .args([
                "-object",
                &match memory {
                    Some((path, shared)) => format!(
                        "memory-backend-file,id=ram,size={MEMORY_MB}M,mem-path={},share={}",
                        path.display(),
                        if shared { "on" } else { "off" }
                    ),
                    None => format!("memory-backend-ram,id=ram,size={MEMORY_MB}M"),
                },
                "-chardev",
                &format!(
                    "file,id=console,path={},append=on",
                    run.join("console.log").display()
                ),
                "-serial",
                "chardev:console",
                "-drive",
                &format!(
                    "id=root,file={},format=qcow2,if=none,discard=unmap",
                    disk.display()
                ),
                "-device",
                "virtio-blk-device,drive=root",
                "-netdev",
                "user,id=net0",
                "-device",
                &format!("virtio-net-device,netdev=net0,mac={GUEST_MAC}"),
                "-chardev",
                &format!(
                    "socket,id=agent,path={},server=on,wait=off",
                    agent.display()
                ),
                "-device",
                "virtio-serial-device",
                "-device",
                "virtserialport,chardev=agent,name=agentenv",
                "-chardev",
                &format!(
                    "socket,id=qmp,path={},server=on,wait=off",
                    qmp_sock.display()
                ),
                "-mon",
                "chardev=qmp,mode=control",
            ]);
        if incoming {
            cmd.args(["-incoming", "defer"]);
        }
        let log = std::fs::File::create(run.join("qemu.log")).unwrap();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "floor QEMU exited ({status}): {}",
                    std::fs::read_to_string(run.join("qemu.log")).unwrap_or_default()
                );
            }
            match std::os::unix::net::UnixStream::connect(&qmp_sock) {
                Ok(s) => break s,
                Err(e) => assert!(Instant::now() < deadline, "floor QMP socket: {e}"),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut qmp = Qmp::handshake(stream, Duration::from_secs(10)).unwrap();
        qmp.migrate_set_capabilities(MIGRATION_CAPS).unwrap();
        FloorVm {
            child,
            qmp,
            agent,
            client: None,
        }
    }

    /// Boots a VM cold (its RAM in a shared file with `ram_file`), lets it go idle and
    /// saves it: the floor's template.
    fn make_template(&self, base: &Path, dir: &Path, ram_file: bool) -> FloorTemplate {
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk.qcow2");
        vm::create_overlay(base, &disk, DISK_MB).unwrap();
        let memory = ram_file.then(|| dir.join("memory.ram"));
        let mut vm = self.spawn(dir, &disk, false, memory.as_deref().map(|m| (m, true)));
        AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT)
            .expect("the floor template VM never answered");
        std::thread::sleep(SETTLE);
        let state = dir.join("state.bin");
        vm.pause(&state);
        FloorTemplate {
            state,
            disk,
            memory,
        }
    }

    /// A clone of `template` in `dir`: a fresh overlay, then a restore (RAM mapped
    /// copy-on-write from the template's RAM file, if it has one), timed from the overlay
    /// to the agent's first answer.
    fn clone_template(&self, template: &FloorTemplate, dir: &Path) -> (FloorVm, f64) {
        let t = Instant::now();
        let (disk, _) = self.clone_disk(&template.disk, dir);
        let memory = template.memory.as_deref().map(|m| (m, false));
        let (vm, _) = self.restore(dir, &disk, &template.state, memory);
        (vm, ms_since(t))
    }

    /// The path users take, on one clone of `template` in `dir` (removed at the end): the
    /// floor of [`BenchServer::user_path`]. Also returns the bytes the dirty pause wrote.
    fn user_path(&self, template: &FloorTemplate, dir: &Path) -> (UserPath, f64) {
        let mut p = UserPath::default();
        let t = Instant::now();
        let (mut vm, create) = self.clone_template(template, dir);
        p.create = create;
        p.first_command = vm.exec("true");
        p.create_to_first = ms_since(t);
        p.next_command = vm.exec("true");
        std::thread::sleep(SETTLE);
        let paused = dir.join("paused.bin");
        p.pause_idle = vm.pause(&paused);
        let disk = dir.join("disk.qcow2");
        let t = Instant::now();
        let (mut vm, resume) = self.restore(dir, &disk, &paused, None);
        p.resume = resume;
        vm.exec("true");
        p.resume_to_first = ms_since(t);
        vm.exec(DIRTY_32M);
        p.pause_dirty = vm.pause(&paused);
        let bytes = std::fs::metadata(&paused).unwrap().len() as f64;
        drop(vm);
        std::fs::remove_dir_all(dir).unwrap();
        (p, bytes)
    }

    /// A new writable overlay over the (immutable) floor template disk, and its time.
    fn clone_disk(&self, template_disk: &Path, dir: &Path) -> (PathBuf, f64) {
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk.qcow2");
        let t = Instant::now();
        let status = Command::new("qemu-img")
            .args(["create", "-q", "-u", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(template_disk)
            .arg(&disk)
            .arg(format!("{DISK_MB}M"))
            .status()
            .unwrap();
        assert!(status.success(), "qemu-img create failed");
        (disk, ms_since(t))
    }

    /// Restore by hand, timed from spawn to the agent's first answer.
    fn restore(
        &self,
        run: &Path,
        disk: &Path,
        state: &Path,
        memory: Option<(&Path, bool)>,
    ) -> (FloorVm, f64) {
        let t = Instant::now();
        let mut vm = self.spawn(run, disk, true, memory);
        vm.qmp.migrate_incoming_file(state).unwrap();
        vm.qmp.wait_status("paused", STEP_TIMEOUT).unwrap();
        vm.qmp.cont().unwrap();
        vm.client = Some(
            AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT)
                .expect("the floor VM's agent did not answer after a restore"),
        );
        (vm, ms_since(t))
    }
}

impl FloorVm {
    /// Runs `script` with `sh -c` (or `true` as is) through the agent; its time.
    fn exec(&self, script: &str) -> f64 {
        let (cmd, args) = if script == "true" {
            ("true", vec![])
        } else {
            ("sh", vec!["-c".to_string(), script.to_string()])
        };
        let t = Instant::now();
        let result = self
            .client
            .as_ref()
            .expect("the floor VM was restored")
            .exec(&ExecRequest {
                cmd: cmd.into(),
                args,
                env: Vec::new(),
                cwd: "/".into(),
                timeout_ms: 60_000,
                max_output_bytes: 1 << 16,
            })
            .unwrap();
        assert_eq!(result.exit_code, 0, "floor command {script:?}: {result:?}");
        ms_since(t)
    }

    /// stop + migrate to `state` until completed; the VM is left stopped.
    fn save(&mut self, state: &Path) {
        self.qmp.stop().unwrap();
        self.qmp.migrate_set_parameters(CAPTURE_BANDWIDTH).unwrap();
        self.qmp.migrate_to_file(state).unwrap();
        self.qmp.wait_migration(STEP_TIMEOUT).unwrap();
    }

    /// Save, then quit and wait for QEMU to exit.
    fn pause(&mut self, state: &Path) -> f64 {
        self.client = None;
        let t = Instant::now();
        self.save(state);
        self.qmp.quit().unwrap();
        self.child.wait().unwrap();
        ms_since(t)
    }

    /// Save, then let the VM run on.
    fn snapshot(&mut self, state: &Path) -> f64 {
        let t = Instant::now();
        self.save(state);
        self.qmp.cont().unwrap();
        ms_since(t)
    }
}

impl Drop for FloorVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A local custom extension: 200 `{}` to every hook; counts start-resume.
struct HookExtension {
    url: String,
    server: Arc<tiny_http::Server>,
    start_resume: Arc<AtomicUsize>,
    last_start_resume: Arc<Mutex<Option<Instant>>>,
    thread: Option<JoinHandle<()>>,
}

impl HookExtension {
    fn start() -> HookExtension {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = server.server_addr().to_ip().unwrap().port();
        let start_resume = Arc::new(AtomicUsize::new(0));
        let last_start_resume = Arc::new(Mutex::new(None));
        let thread = {
            let (server, start_resume, last) = (
                server.clone(),
                start_resume.clone(),
                last_start_resume.clone(),
            );
            std::thread::spawn(move || {
                for request in server.incoming_requests() {
                    let response = if request.url().contains("/sandbox-hook/") {
                        if request.url().ends_with("/sandbox-hook/start-resume") {
                            *last.lock() = Some(Instant::now());
                            start_resume.fetch_add(1, Ordering::SeqCst);
                        }
                        tiny_http::Response::from_string("{}")
                            .with_status_code(200)
                            .with_header(
                                tiny_http::Header::from_bytes("Content-Type", "application/json")
                                    .unwrap(),
                            )
                    } else {
                        tiny_http::Response::from_string("").with_status_code(404)
                    };
                    let _ = request.respond(response);
                }
            })
        };
        HookExtension {
            url: format!("http://127.0.0.1:{port}"),
            server,
            start_resume,
            last_start_resume,
            thread: Some(thread),
        }
    }

    fn start_resumes(&self) -> usize {
        self.start_resume.load(Ordering::SeqCst)
    }

    /// Milliseconds from `t` to the last start-resume's arrival, if one arrived since.
    fn since_start_resume(&self, t: Instant) -> Option<f64> {
        let at = (*self.last_start_resume.lock())?;
        (at >= t).then(|| (at - t).as_secs_f64() * 1000.0)
    }
}

impl Drop for HookExtension {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The real server binary on loopback; its log (info level) goes to `log`.
struct BenchServer {
    child: Child,
    base: String,
    agent: ureq::Agent,
    log: PathBuf,
}

impl BenchServer {
    fn start(assets: &Path, work: &Path, extension_url: Option<&str>) -> BenchServer {
        std::fs::create_dir_all(work).unwrap();
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
                 [vm]\nassets_dir = \"{}\"\ndefault_memory_mb = {MEMORY_MB}\ndefault_cpu_count = 1\n\
                 default_disk_size_mb = {DISK_MB}\n\
                 [network]\npool_min = 2\n{}",
                work.join("state").display(),
                assets.display(),
                extension_url
                    .map(|url| format!("[custom_extension]\nurl = \"{url}\"\n"))
                    .unwrap_or_default(),
            ),
        )
        .unwrap();
        let binary = std::env::var("AENV_BENCH_BINARY").unwrap_or_else(|_| {
            concat!(env!("CARGO_MANIFEST_DIR"), "/target/release/agentenv").into()
        });
        let log = work.join("server.log");
        let child = Command::new(binary)
            .args(["serve", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info")
            .env_remove("AENV_CUSTOM_EXTENSION_URL")
            .env_remove("AENV_CUSTOM_EXTENSION_AUTH_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let server = BenchServer {
            child,
            base: format!("http://127.0.0.1:{port}"),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(180))
                .build(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while ureq::get(&format!("{}/health", server.base))
            .call()
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "{}",
                server.failure("did not start")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // Let the pool fill so slot creation is not on the measured path.
        std::thread::sleep(Duration::from_millis(500));
        server
    }

    /// The last lines of the server's log, for a panic message.
    fn failure(&self, what: &str) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("the server {what}; its log ends with:\n{tail}")
    }

    /// One API call that must answer `want`; the JSON body (Null when empty).
    fn call(&self, method: &str, path: &str, body: Option<Value>, want: u16) -> Value {
        let request = self
            .agent
            .request(method, &format!("{}{path}", self.base))
            .set("X-API-Key", API_KEY);
        let result = match body {
            Some(body) => request.send_json(body),
            None => request.call(),
        };
        let (status, text) = match result {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{}", self.failure(&format!("{method} {path}: {e}"))),
        };
        assert!(
            status == want,
            "{}",
            self.failure(&format!(
                "answered {method} {path} with {status} (wanted {want}): {text}"
            ))
        );
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    /// Builds a template from `image` with `POST /templates` and waits until it is ready.
    fn build_template(&self, image: &str, name: &str) -> String {
        self.call(
            "POST",
            "/templates",
            Some(json!({"name": name, "image": image, "cpuCount": 1, "memoryMB": MEMORY_MB, "diskSizeMB": DISK_MB})),
            202,
        );
        let deadline = Instant::now() + Duration::from_secs(180);
        while self.call("GET", &format!("/templates/{name}"), None, 200)["buildStatus"] != "ready" {
            assert!(Instant::now() < deadline, "template build did not finish");
            std::thread::sleep(Duration::from_millis(200));
        }
        name.to_string()
    }

    /// Runs `script` (`true` as is, anything else with `sh -c`) in the sandbox; its time.
    fn command(&self, id: &str, script: &str) -> f64 {
        let body = if script == "true" {
            json!({"cmd": "true"})
        } else {
            json!({"cmd": "sh", "args": ["-c", script]})
        };
        let t = Instant::now();
        let v = self.call(
            "POST",
            &format!("/sandboxes/{id}/commands"),
            Some(body),
            200,
        );
        assert_eq!(v["exitCode"], 0, "command {script:?}: {v}");
        ms_since(t)
    }

    /// The path users take on a new sandbox from `template`: create, first and next
    /// command, pause idle, resume and first command, dirty 32 MiB, pause, delete. Also
    /// the state bytes of the dirty pause (from the server's log) and when start-resume
    /// reached the extension (create, resume).
    fn user_path(
        &self,
        template: &str,
        extension: &HookExtension,
    ) -> (UserPath, f64, (Option<f64>, Option<f64>)) {
        let mut p = UserPath::default();
        let t = Instant::now();
        let (id, create) = self.create_from_template(template);
        let create_hook = extension.since_start_resume(t);
        p.create = create;
        p.first_command = self.command(&id, "true");
        p.create_to_first = ms_since(t);
        p.next_command = self.command(&id, "true");
        std::thread::sleep(SETTLE);
        p.pause_idle = self.pause(&id);
        let t = Instant::now();
        p.resume = self.resume(&id);
        let resume_hook = extension.since_start_resume(t);
        self.command(&id, "true");
        p.resume_to_first = ms_since(t);
        self.command(&id, DIRTY_32M);
        p.pause_dirty = self.pause(&id);
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let bytes = log
            .lines()
            .rev()
            .find(|l| l.contains("op=pause frozenMs"))
            .and_then(|l| field(l, "stateBytes"))
            .unwrap_or(f64::NAN);
        self.delete(&id);
        (p, bytes, (create_hook, resume_hook))
    }

    fn create_cold(&self, image: &str) -> String {
        let v = self.call(
            "POST",
            "/sandboxes-cold",
            Some(json!({"image": image, "timeout": 600})),
            201,
        );
        v["sandboxID"].as_str().unwrap().to_string()
    }

    fn pause(&self, id: &str) -> f64 {
        let t = Instant::now();
        self.call("POST", &format!("/sandboxes/{id}/pause"), None, 204);
        ms_since(t)
    }

    fn resume(&self, id: &str) -> f64 {
        let t = Instant::now();
        self.call(
            "POST",
            &format!("/sandboxes/{id}/resume"),
            Some(json!({"timeout": 600})),
            201,
        );
        ms_since(t)
    }

    fn snapshot(&self, id: &str, name: &str) -> f64 {
        let t = Instant::now();
        self.call(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({ "name": name })),
            201,
        );
        ms_since(t)
    }

    /// The new sandbox's id and the time to its 201.
    fn create_from_template(&self, template: &str) -> (String, f64) {
        let t = Instant::now();
        let v = self.call(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": template, "timeout": 600})),
            201,
        );
        let took = ms_since(t);
        (v["sandboxID"].as_str().unwrap().to_string(), took)
    }

    fn delete(&self, id: &str) {
        self.call("DELETE", &format!("/sandboxes/{id}"), None, 204);
    }

    fn delete_template(&self, name: &str) {
        self.call("DELETE", &format!("/templates/{name}"), None, 204);
    }

    fn count_snapshots(&self) -> usize {
        let v = self.call("GET", "/snapshots", None, 200);
        v.as_array().map_or(0, Vec::len)
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
