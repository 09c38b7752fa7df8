//! VM lifecycle timings with the real guest, each next to the raw QEMU floor measured in
//! the same run (the same QMP steps by hand, without agentenv's extras: no fsync, no
//! disk freeze, no capability setup).
//!
//! `cargo bench --bench vm_lifecycle` (needs QEMU and /var/lib/agentenv/assets; about a
//! minute). `AENV_BENCH_RUNS` sets the runs per row (default 10).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv::agent::AgentClient;
use agentenv::config::AccelMode;
use agentenv::vm::{
    self, create_clone_disk, create_overlay, detect_accel, guest_kernel, CaptureRecord,
    DiskCapture, HostPlumbing, MachineConfig, MemoryFile, RestoreSpec, Vm, VmSpec,
};

const ASSETS: &str = "/var/lib/agentenv/assets";
const MEMORY_MB: u32 = 256;

fn spec(root: &Path, run: &str, disk: PathBuf) -> VmSpec {
    let assets = Path::new(ASSETS);
    VmSpec {
        host: HostPlumbing::local(root.join(run), detect_accel(AccelMode::Auto).unwrap()),
        machine: MachineConfig {
            kernel: guest_kernel(assets),
            initramfs: assets.join("initramfs.img"),
            cpu_count: 1,
            memory_mb: MEMORY_MB,
        },
        kernel_args: vec!["agentenv.port=49983".into()],
        disk,
    }
}

fn restore_spec(run_dir: PathBuf, disk: PathBuf) -> RestoreSpec {
    RestoreSpec {
        host: HostPlumbing::local(run_dir, detect_accel(AccelMode::Auto).unwrap()),
        disk,
    }
}

fn ready(vm: &Vm) {
    let agent = AgentClient::connect(vm.agent_socket(), Instant::now() + Duration::from_secs(90))
        .unwrap_or_else(|e| panic!("agent: {e}\n{}", vm.console_tail(20)));
    vm::sync_guest_clock(&agent).unwrap();
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Raw floor of a save: stop, bandwidth, migrate to a file, wait. Leaves the VM stopped.
fn raw_save(vm: &mut Vm, path: &Path) -> f64 {
    let t = Instant::now();
    let q = vm.qmp();
    q.stop().unwrap();
    q.migrate_set_capabilities(&[("x-ignore-shared", false)])
        .unwrap();
    q.migrate_set_parameters(64 << 30).unwrap();
    q.migrate_to_file(path).unwrap();
    q.wait_migration(Duration::from_secs(60)).unwrap();
    let took = ms_since(t);
    q.migrate_set_capabilities(&[("x-ignore-shared", true)])
        .unwrap();
    took
}

/// Raw floor of a restore: QEMU with `-incoming file:` until paused, then cont.
fn raw_restore(spec: VmSpec, state: &Path) -> (Vm, f64) {
    let t = Instant::now();
    let mut vm = Vm::spawn_incoming(spec, state).unwrap();
    vm.qmp()
        .wait_status("paused", Duration::from_secs(60))
        .unwrap();
    vm.qmp().cont().unwrap();
    (vm, ms_since(t))
}

struct Row {
    name: &'static str,
    ours: Vec<f64>,
    floor: Vec<f64>,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if !Path::new(ASSETS).join("initramfs.img").is_file() {
        eprintln!("skipping: no assets in {ASSETS}");
        return;
    }
    let runs: usize = std::env::var("AENV_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let root = std::env::temp_dir().join(format!("aenv-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let images = agentenv::image::ImageStore::new(root.join("images"));
    let image = images
        .prepare_rootfs(&format!("oci:{ASSETS}/base-image"), 1024)
        .unwrap();
    let mut rows = Vec::new();

    // Sandbox A: snapshots in place, then pause/resume cycles.
    let sb = root.join("sb");
    std::fs::create_dir_all(&sb).unwrap();
    create_overlay(&image.base_disk, &sb.join("disk.qcow2"), 1024).unwrap();
    let mut vm = Vm::spawn(spec(&root, "sb/run", sb.join("disk.qcow2"))).unwrap();
    ready(&vm);

    let mut snap = Row {
        name: "snapshot in place (capture+freeze+cont)",
        ours: vec![],
        floor: vec![],
    };
    let mut template: Option<CaptureRecord> = None;
    for i in 0..runs {
        let t = Instant::now();
        let (rec, _) = vm
            .capture(&root.join(format!("snap{i}")), DiskCapture::Freeze)
            .unwrap();
        vm.resume_vcpus().unwrap();
        snap.ours.push(ms_since(t));
        if i == 0 {
            template = Some(rec);
        } else {
            std::fs::remove_dir_all(root.join(format!("snap{i}"))).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let hand = root.join("hand-snap.bin");
        let t = Instant::now();
        raw_save(&mut vm, &hand);
        vm.qmp().cont().unwrap();
        snap.floor.push(ms_since(t));
        std::fs::remove_file(&hand).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    vm.flatten_disk(Duration::from_secs(120)).unwrap();
    rows.push(snap);

    // Bandwidth lever: QEMU's default cap.
    let mut bw = Row {
        name: "save at default 128 MiB/s cap (lever off)",
        ours: vec![],
        floor: vec![],
    };
    for _ in 0..3.min(runs) {
        let hand = root.join("hand-bw.bin");
        let t = Instant::now();
        let q = vm.qmp();
        q.stop().unwrap();
        q.migrate_set_parameters(128 << 20).unwrap();
        q.migrate_to_file(&hand).unwrap();
        q.wait_migration(Duration::from_secs(60)).unwrap();
        bw.ours.push(ms_since(t));
        q.cont().unwrap();
        std::fs::remove_file(&hand).unwrap();
        let t = Instant::now();
        raw_save(&mut vm, &hand);
        bw.floor.push(ms_since(t));
        vm.qmp().cont().unwrap();
        std::fs::remove_file(&hand).unwrap();
    }
    rows.push(bw);

    let mut pause = Row {
        name: "pause (capture+fsync+quit)",
        ours: vec![],
        floor: vec![],
    };
    let mut resume = Row {
        name: "resume to running (restore+cont)",
        ours: vec![],
        floor: vec![],
    };
    for i in 0..runs {
        let dir = root.join(format!("paused{}", i % 2));
        let t = Instant::now();
        let (rec, _) = vm.pause(&dir).unwrap();
        pause.ours.push(ms_since(t));
        drop(vm);
        let t = Instant::now();
        let (mut restored, _) =
            Vm::restore(&rec, restore_spec(root.join("sb/run"), rec.disk.clone())).unwrap();
        restored.resume_vcpus().unwrap();
        resume.ours.push(ms_since(t));
        vm = restored;
        std::thread::sleep(Duration::from_millis(150));

        // The floor: the same by hand, on the same VM.
        let hand = root.join("hand-pause.bin");
        let t = Instant::now();
        raw_save(&mut vm, &hand);
        vm.qmp().quit().unwrap();
        vm.wait_timeout(Duration::from_secs(10)).unwrap();
        pause.floor.push(ms_since(t));
        let disk = vm.disk().to_path_buf();
        drop(vm);
        let (mut raw, took) = raw_restore(spec(&root, "sb/run", disk.clone()), &hand);
        resume.floor.push(took);
        std::thread::sleep(Duration::from_millis(150));
        // Back to a VM restored our way (so the next capture sees it as ours).
        let (rec, _) = raw.pause(&dir).unwrap();
        drop(raw);
        let (mut back, _) =
            Vm::restore(&rec, restore_spec(root.join("sb/run"), rec.disk.clone())).unwrap();
        back.resume_vcpus().unwrap();
        vm = back;
        std::fs::remove_file(&hand).unwrap();
        std::thread::sleep(Duration::from_millis(150));
    }
    ready(&vm);
    rows.push(pause);
    rows.push(resume);

    // Clones from a template whose RAM is in the state file, and the floor: the same
    // state restored by hand (a hand-saved copy, without x-ignore-shared).
    let template = template.unwrap();
    let hand_template = root.join("hand-template.bin");
    raw_save(&mut vm, &hand_template);
    vm.qmp().cont().unwrap();
    let mut clone = Row {
        name: "clone from template (disk+restore+cont)",
        ours: vec![],
        floor: vec![],
    };
    let mut standby = Row {
        name: "clone from pre-spawned standby (load+cont)",
        ours: vec![],
        floor: vec![],
    };
    for i in 0..runs {
        let dir = root.join(format!("clone{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Instant::now();
        let disk = create_clone_disk(&template.disk_layers, &dir).unwrap();
        let disk_ms = ms_since(t);
        let (mut c, st) = Vm::restore(&template, restore_spec(dir.join("run"), disk)).unwrap();
        c.resume_vcpus().unwrap();
        clone.ours.push(ms_since(t));
        if i < 3 {
            eprintln!("clone: disk {disk_ms:.1} ms, {st:?}");
        }
        c.kill();

        let fdir = root.join(format!("floor{i}"));
        std::fs::create_dir_all(&fdir).unwrap();
        let disk = create_clone_disk(&template.disk_layers, &fdir).unwrap();
        let (f, took) = raw_restore(spec(&fdir, "run", disk), &hand_template);
        clone.floor.push(took);
        f.kill();

        let sdir = root.join(format!("standby{i}"));
        std::fs::create_dir_all(&sdir).unwrap();
        let disk = create_clone_disk(&template.disk_layers, &sdir).unwrap();
        let mut s = Vm::spawn_standby(&template, restore_spec(sdir.join("run"), disk)).unwrap();
        let t = Instant::now();
        s.load_incoming(&template).unwrap();
        s.resume_vcpus().unwrap();
        standby.ours.push(ms_since(t));
        standby.floor.push(*clone.floor.last().unwrap());
        s.kill();
        for d in [dir, fdir, sdir] {
            std::fs::remove_dir_all(d).unwrap();
        }
    }
    let pid = vm.pid();
    vm.kill();
    eprintln!("sandbox A (qemu {pid}) done");
    rows.push(clone);
    rows.push(standby);

    // Lever: a template built with its RAM in a shared file; clones map it privately.
    let tb = root.join("tbuild");
    std::fs::create_dir_all(&tb).unwrap();
    create_overlay(&image.base_disk, &tb.join("disk.qcow2"), 1024).unwrap();
    let tdir = root.join("template-memfile");
    std::fs::create_dir_all(&tdir).unwrap();
    let memory = MemoryFile {
        path: tdir.join("ram.bin"),
        shared: true,
    };
    let mut builder =
        Vm::spawn_with_memory_file(spec(&root, "tbuild/run", tb.join("disk.qcow2")), &memory)
            .unwrap();
    ready(&builder);
    let t = Instant::now();
    let (mt, stats) = builder.capture(&tdir, DiskCapture::Freeze).unwrap();
    let capture_ms = ms_since(t);
    builder.quit().unwrap();
    drop(builder);
    eprintln!(
        "memory-file template capture {capture_ms:.1} ms (state {} bytes, {stats:?})",
        mt.state_bytes
    );
    let mut memclone = Row {
        name: "clone from RAM-file template (disk+restore+cont)",
        ours: vec![],
        floor: vec![],
    };
    let mut first = None;
    for i in 0..runs {
        let dir = root.join(format!("mclone{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let t = Instant::now();
        let disk = create_clone_disk(&mt.disk_layers, &dir).unwrap();
        let disk_ms = ms_since(t);
        let (mut c, st) = Vm::restore(&mt, restore_spec(dir.join("run"), disk)).unwrap();
        c.resume_vcpus().unwrap();
        memclone.ours.push(ms_since(t));
        if i < 3 {
            eprintln!("ram-file clone: disk {disk_ms:.1} ms, {st:?}");
        }
        if i == 0 {
            ready(&c);
            first = Some(c);
        } else {
            c.kill();
        }
    }
    memclone.floor = rows[rows.len() - 2].floor.clone();
    if let Some(c) = first {
        c.kill();
    }
    rows.push(memclone);

    println!();
    println!(
        "{:<50} {:>9} {:>9} {:>11} {:>11} {:>7}",
        "operation (256 MiB idle guest, TCG)",
        "ours p50",
        "ours p90",
        "floor p50",
        "floor p90",
        "ratio"
    );
    for r in &rows {
        let (o50, f50) = (pct(&r.ours, 0.5), pct(&r.floor, 0.5));
        println!(
            "{:<50} {:>9.1} {:>9.1} {:>11.1} {:>11.1} {:>7.2}",
            r.name,
            o50,
            pct(&r.ours, 0.9),
            f50,
            pct(&r.floor, 0.9),
            o50 / f50
        );
    }
    println!("(ms; runs per row: {runs}; floors are the same QMP steps by hand)");
    let _ = std::fs::remove_dir_all(&root);
}
