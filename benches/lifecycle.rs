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
//! holds the host lock. `AENV_BENCH_RUNS` sets the runs per row (default 15). Prints a
//! markdown table (p50, p90, ratios) for docs/performance.md.

#[path = "common/mod.rs"]
mod bench;
#[path = "../tests/common/mod.rs"]
mod common;

use agentenv::config::AccelMode;
use agentenv::image::ImageStore;
use agentenv::vm;
use bench::{
    field, load_average, log_medians, median, ms_since, p90, Floor, FloorTemplate, FloorVm,
    DISK_MB, MEMORY_MB, SETTLE, STEP_TIMEOUT,
};
use common::extension::Extension;
use common::Server;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;
fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let started = Instant::now();
    let runs = bench::runs(15);
    let assets = bench::assets_dir();
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

    // Phase 1: the server without an extension: create from a built template, with the
    // standby pool (the default) and without it.
    let creates = CreateBench {
        image: &image,
        floor: &floor,
        template: &ramfile,
        runs,
    };
    let (create_plain, first_plain) = creates.run(
        [
            "create from a built template `POST /sandboxes` → 201, no extension (a warm standby)",
            "create → first command answer, no extension (a warm standby)",
        ],
        &work.join("s1"),
        "",
        &mut load,
    );
    let (create_no_pool, first_no_pool) = creates.run(
        [
            "the same with no standby (a miss: `standby_per_template = 0`)",
            "create → first command answer, no extension (a miss)",
        ],
        &work.join("s1b"),
        "[templates]\nstandby_per_template = 0\n",
        &mut load,
    );

    // Phase 2: the server with a local extension (start-resume on every create and
    // resume): the path users take, on one template-derived sandbox per run.
    let extension = Extension::start();
    let server = bench::start_server(&work.join("s2"), Some(&extension), "");
    let built = server.build_template(&image, "bench-built-2");
    let mut rows = UserPath::rows();
    let mut state_bytes = (Vec::new(), Vec::new());
    let (mut create_hook, mut resume_hook) = (Vec::new(), Vec::new());
    let resumes_before = extension.count("start-resume");
    for i in 0..runs {
        let mut product = None;
        let mut floor_run = None;
        alternate(
            i % 2 == 0,
            || {
                let (path, bytes, hooks) = product_user_path(&server, &built, &extension);
                state_bytes.0.push(bytes);
                create_hook.extend(hooks.0);
                resume_hook.extend(hooks.1);
                product = Some(path);
                0.0
            },
            || {
                let (path, bytes) =
                    floor_user_path(&floor, &ramfile, &work.join(format!("f2-{i}")));
                state_bytes.1.push(bytes);
                floor_run = Some(path);
                0.0
            },
        );
        UserPath::push(&mut rows, &product.unwrap(), &floor_run.unwrap());
        load.push(load_average());
        eprintln!("phase 2: run {}/{runs} done", i + 1);
    }
    let start_resumes = extension.count("start-resume") - resumes_before;
    let burst = burst(&server, &built);
    load.push(load_average());

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
    let log = server.log();
    drop(server);
    drop(extension);
    let _ = std::fs::remove_dir_all(&work);

    println!("| operation | agentenv p50 | agentenv p90 | raw floor p50 | raw floor p90 | ratio (p50) | goal |");
    println!("|---|---|---|---|---|---|---|");
    let mut all = vec![&create_plain, &create_no_pool, &first_plain, &first_no_pool];
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
        "Floors: QEMU by hand (explicit argv like the product's, an unconnected NIC) over QMP, \
         the guest agent over its virtio-serial socket. create = fresh overlay + spawn with \
         `-incoming defer` + migrate-incoming + cont + the agent's first answer (built \
         template: RAM mapped copy-on-write from the floor template's RAM file); first \
         command = `true` through the agent; pause (template clone) = stop + \
         `xen-save-devices-state` + the pages changed since the template (pagemap, \
         process_vm_readv) to a file + quit (exited); resume = spawn over the template's RAM \
         file with `-S` + those pages written back + migrate-incoming of the device state \
         (behind the template's ROM blocks) + cont + the agent's first answer; snapshot = stop + migrate to file + cont."
    );
    println!("{burst}");
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

/// Phase 1: creates from a built template (then deleted) on a server without an
/// extension, alternating with the floor's clone of its RAM-file template.
struct CreateBench<'a> {
    image: &'a str,
    floor: &'a Floor,
    template: &'a FloorTemplate,
    runs: usize,
}

impl CreateBench<'_> {
    /// Two rows (create → 201, create → first command); `config` is appended to the
    /// server's config file. With the pool on, each create waits for a warm standby.
    fn run(
        &self,
        [name, first_name]: [&'static str; 2],
        work: &Path,
        config: &str,
        load: &mut Vec<f64>,
    ) -> (Row, Row) {
        let mut row = Row::new(name, Some(40.0));
        let mut first = Row::new(first_name, Some(60.0));
        let pooled = !config.contains("standby_per_template = 0");
        let server = bench::start_server(work, None, config);
        let built = server.build_template(self.image, "bench-built-1");
        for i in 0..self.runs {
            std::thread::sleep(SETTLE);
            if pooled {
                server.wait_standby();
            }
            let mut firsts = (0.0, 0.0);
            let (p, f) = alternate(
                i % 2 == 0,
                || {
                    let t = Instant::now();
                    let (clone, took) = server.create_from_template(&built);
                    server.command(&clone, "true");
                    firsts.0 = ms_since(t);
                    server.delete(&clone);
                    took
                },
                || {
                    let dir = work.join(format!("f1-{i}"));
                    let t = Instant::now();
                    let (vm, took) = self.floor.clone_template(self.template, &dir);
                    vm.exec("true");
                    firsts.1 = ms_since(t);
                    drop(vm);
                    std::fs::remove_dir_all(&dir).unwrap();
                    took
                },
            );
            row.push(p, f);
            first.push(firsts.0, firsts.1);
            load.push(load_average());
            eprintln!("phase 1 ({name}): run {}/{} done", i + 1, self.runs);
        }
        server.delete_template(&built);
        assert_eq!(server.count_snapshots(), 0, "phase 1 left snapshots");
        let log = server.log();
        let from_standby = log.matches("standby=true").count();
        eprintln!(
            "phase 1 ({name}): {from_standby} of {} creates took a standby",
            self.runs
        );
        (row, first)
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

/// Where the server says its time went (its info log, `key=value` fields): medians.
fn print_breakdown(log: &str) {
    let entries: [(&str, &str, &[&str]); 9] = [
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
        (
            "create from a standby, state load into the waiting QEMU",
            "vm op=load_state",
            &["loadMs"],
        ),
        (
            "restore, the prepared VM waits for start-resume",
            "op=launch hookWaitMs",
            &["hookWaitMs"],
        ),
        (
            "VM launch: prepared (spawn or load) / `cont` → agent answered and clock set",
            "op=launch result=ready",
            &["prepareMs", "agentMs"],
        ),
    ];
    println!("Server-side (from its info log), medians:\n");
    println!("| step | fields | n |");
    println!("|---|---|---|");
    for (name, marker, keys) in entries {
        let (fields, n) = log_medians(log, marker, keys);
        println!("| {name} | {fields} | {n} |");
    }
    println!(
        "| creates from a built template that took a standby | {} of {} | |",
        log.matches("standby=true").count(),
        log.matches("op=create_from_capture result=ok").count()
    );
    let (parts, n) = log_medians(
        log,
        "vm op=capture",
        &["stopMs", "diskMs", "migrateMs", "syncMs", "totalMs"],
    );
    println!("| capture (pause and snapshot), VM steps | {parts} | {n} |");
}

/// The path users take on a new sandbox from `template`: create, first and next
/// command, pause idle, resume and first command, dirty 32 MiB, pause, delete. Also
/// the state bytes of the dirty pause (from the server's log) and when start-resume
/// reached the extension (create, resume).
fn product_user_path(
    server: &Server,
    template: &str,
    extension: &Extension,
) -> (UserPath, f64, (Option<f64>, Option<f64>)) {
    let mut p = UserPath::default();
    server.wait_standby();
    let t = Instant::now();
    let (id, create) = server.create_from_template(template);
    let create_hook = bench::ms_after(extension.last_at("start-resume"), t);
    p.create = create;
    p.first_command = server.command(&id, "true");
    p.create_to_first = ms_since(t);
    p.next_command = server.command(&id, "true");
    std::thread::sleep(SETTLE);
    p.pause_idle = server.pause(&id);
    let t = Instant::now();
    p.resume = server.resume(&id);
    let resume_hook = bench::ms_after(extension.last_at("start-resume"), t);
    server.command(&id, "true");
    p.resume_to_first = ms_since(t);
    server.command(&id, bench::DIRTY_32M);
    p.pause_dirty = server.pause(&id);
    let log = server.log();
    let bytes = log
        .lines()
        .rev()
        .find(|l| l.contains("op=pause frozenMs"))
        .and_then(|l| field(l, "stateBytes"))
        .unwrap_or(f64::NAN);
    server.delete(&id);
    (p, bytes, (create_hook, resume_hook))
}

/// The path users take, on one clone of `template` in `dir` (removed at the end): the
/// floor of [`product_user_path`]. Pause and resume do by hand what the product's
/// dirty-only pause does (device state + the pages changed since the template; resume =
/// those pages, then the device state), without fsync. Also returns the
/// bytes the dirty pause wrote.
fn floor_user_path(floor: &Floor, template: &FloorTemplate, dir: &Path) -> (UserPath, f64) {
    let mut p = UserPath::default();
    let t = Instant::now();
    let (mut vm, create) = floor.clone_template(template, dir);
    p.create = create;
    p.first_command = vm.exec("true");
    p.create_to_first = ms_since(t);
    p.next_command = vm.exec("true");
    std::thread::sleep(SETTLE);
    let (devices, pages) = (dir.join("devices.bin"), dir.join("memory.pages"));
    p.pause_idle = floor_pause_dirty(&mut vm, template, &devices, &pages);
    let disk = dir.join("disk.qcow2");
    let t = Instant::now();
    let mut vm = floor_resume_dirty(floor, dir, &disk, template, &devices, &pages);
    p.resume = ms_since(t);
    vm.exec("true");
    p.resume_to_first = ms_since(t);
    vm.exec(bench::DIRTY_32M);
    p.pause_dirty = floor_pause_dirty(&mut vm, template, &devices, &pages);
    let bytes = [&devices, &pages]
        .iter()
        .map(|f| std::fs::metadata(f).unwrap().len() as f64)
        .sum();
    drop(vm);
    std::fs::remove_dir_all(dir).unwrap();
    (p, bytes)
}

/// Dirty-only pause by hand: stop, device state, the clone's private pages, quit; the
/// device state is put behind the template's ROM blocks while QEMU exits.
fn floor_pause_dirty(
    vm: &mut FloorVm,
    template: &FloorTemplate,
    devices: &Path,
    pages: &Path,
) -> f64 {
    let memory = template.memory.as_deref().expect("a RAM-file template");
    vm.client = None;
    let t = Instant::now();
    vm.qmp.stop().unwrap();
    let file = std::fs::File::create(devices).unwrap();
    let fdset = vm.qmp.add_fd(file.as_fd(), "devices").unwrap();
    let args = serde_json::json!({ "filename": format!("/dev/fdset/{fdset}"), "live": false });
    vm.qmp
        .execute("xen-save-devices-state", Some(args))
        .unwrap();
    vm.qmp.remove_fd(fdset).unwrap();
    vm::dirty::save_pages(vm.child.id(), memory, u64::from(MEMORY_MB) << 20, pages).unwrap();
    vm.qmp.quit().unwrap();
    let stitched = vm::dirty::stitch_state(
        &std::fs::read(&template.state).unwrap(),
        &std::fs::read(devices).unwrap(),
    )
    .unwrap();
    std::fs::write(devices, stitched).unwrap();
    vm.child.wait().unwrap();
    ms_since(t)
}

/// Dirty-only resume by hand (QEMU waits with `-S`), to the agent's first answer.
fn floor_resume_dirty(
    floor: &Floor,
    dir: &Path,
    disk: &Path,
    template: &FloorTemplate,
    devices: &Path,
    pages: &Path,
) -> FloorVm {
    let memory = template.memory.as_deref().expect("a RAM-file template");
    let mut vm = floor.spawn(dir, disk, true, Some((memory, false)));
    vm::dirty::write_back_pages(vm.child.id(), memory, u64::from(MEMORY_MB) << 20, pages).unwrap();
    vm.qmp.migrate_incoming_file(devices).unwrap();
    vm.qmp.wait_status("paused", STEP_TIMEOUT).unwrap();
    vm.qmp.cont().unwrap();
    vm.client = Some(
        agentenv::agent::AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT)
            .expect("the floor VM's agent did not answer after a dirty resume"),
    );
    vm
}

/// A burst: 8 clients at once, each creating 4 sandboxes from `template` and running a
/// first command in each; all 32 are deleted after. A markdown row: how many were
/// answered and refused, and create → first command answer p50 / p90.
fn burst(server: &Server, template: &str) -> String {
    const CLIENTS: usize = 8;
    const EACH: usize = 4;
    let results: Vec<Result<(String, f64), String>> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                scope.spawn(|| {
                    (0..EACH)
                        .map(|_| {
                            let t = Instant::now();
                            let body = serde_json::json!({"templateID": template, "timeout": 600});
                            let v = server.try_call("POST", "/sandboxes", Some(body), 201)?;
                            let id = v["sandboxID"].as_str().unwrap_or_default().to_string();
                            server.command(&id, "true");
                            Ok((id, ms_since(t)))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    });
    let mut times = Vec::new();
    let mut refused = 0;
    for r in &results {
        match r {
            Ok((id, took)) => {
                server.delete(id);
                times.push(*took);
            }
            Err(e) => {
                eprintln!("burst: {e}");
                refused += 1;
            }
        }
    }
    format!(
        "| a burst of {} creates + first command from {CLIENTS} clients, extension on | answered {} of {}, refused {refused} | create → first answer p50 {:.1} ms, p90 {:.1} ms |",
        CLIENTS * EACH,
        times.len(),
        results.len(),
        median(&times),
        p90(&times)
    )
}
