//! Capture and restore with the real guest (the product's kernel, initramfs with the
//! agent as /init, and a root disk built from the base image): one cold boot shared by
//! every assertion. Skipped (with a message) when the assets or QEMU are missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::*;
use crate::agent::{AgentClient, ExecRequest};
use crate::config::AccelMode;

const ASSETS: &str = "/var/lib/agentenv/assets";

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn have_assets() -> bool {
    let ok = Path::new(ASSETS).join("initramfs.img").is_file()
        && guest_kernel(Path::new(ASSETS)).is_file()
        && Path::new(ASSETS).join("base-image").is_dir()
        && Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_ok();
    // A missing part fails the test with the reason: a skipped test would pass unseen.
    assert!(
        ok,
        "no QEMU or no assets in {ASSETS} (run scripts/setup.sh)"
    );
    ok
}

fn restore_spec(run_dir: PathBuf, disk: PathBuf) -> RestoreSpec {
    RestoreSpec {
        host: HostPlumbing::local(run_dir, detect_accel(AccelMode::Auto).unwrap()),
        disk,
    }
}

fn agent(vm: &Vm) -> AgentClient {
    AgentClient::connect(vm.agent_socket(), Instant::now() + Duration::from_secs(90))
        .unwrap_or_else(|e| panic!("agent: {e}; console:\n{}", vm.console_tail(30)))
}

/// Runs `script` with the guest's /bin/sh; returns stdout, asserting exit 0.
fn sh(agent: &AgentClient, script: &str) -> String {
    let r = agent
        .exec(&ExecRequest {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("PATH".into(), "/usr/sbin:/usr/bin:/sbin:/bin".into())],
            cwd: "/".into(),
            timeout_ms: 20_000,
            max_output_bytes: 1 << 20,
        })
        .unwrap();
    assert_eq!(r.exit_code, 0, "{script}: {}", r.stderr);
    r.stdout.trim().to_string()
}

fn host_unix_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Restores `record` with a fresh clone disk in `dir`, runs it and connects the agent.
fn clone_from(record: &CaptureRecord, dir: &Path) -> (Vm, AgentClient, RestoreStats) {
    std::fs::create_dir_all(dir).unwrap();
    let disk = create_clone_disk(&record.disk_layers, dir).unwrap();
    let (mut vm, stats) = Vm::restore(record, restore_spec(dir.join("run"), disk)).unwrap();
    assert_eq!(vm.qmp().query_status().unwrap(), "paused");
    vm.resume_vcpus().unwrap();
    let agent = agent(&vm);
    sync_guest_clock(&agent).unwrap();
    (vm, agent, stats)
}

/// A scratch root `<tmp>/<prefix>-<pid>` (removed on drop), and the spec of a guest that
/// boots from a new overlay of the base image in `root/<dir>` (run dir `root/<dir>/run`).
fn fresh_guest(prefix: &str, dir: &str) -> (Scratch, PathBuf, VmSpec) {
    let root = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let scratch = Scratch(root.clone());
    let images = crate::image::ImageStore::new(root.join("images"));
    let image = images
        .prepare_rootfs(&format!("oci:{ASSETS}/base-image"), 1024)
        .unwrap();
    let guest = root.join(dir);
    std::fs::create_dir_all(&guest).unwrap();
    create_overlay(&image.base_disk, &guest.join("disk.qcow2"), 1024).unwrap();
    let assets = Path::new(ASSETS);
    let spec = VmSpec {
        host: HostPlumbing::local(guest.join("run"), detect_accel(AccelMode::Auto).unwrap()),
        machine: MachineConfig {
            kernel: guest_kernel(assets),
            initramfs: assets.join("initramfs.img"),
            cpu_count: 1,
            memory_mb: 256,
        },
        kernel_args: vec!["agentenv.port=49983".into()],
        disk: guest.join("disk.qcow2"),
    };
    (scratch, root, spec)
}

#[test]
fn pause_resume_snapshot_clone_with_the_real_guest() {
    if !have_assets() {
        return;
    }
    let (_scratch, root, spec) = fresh_guest("aenv-capture", "sandbox");
    let sandbox = root.join("sandbox");
    let boot = Instant::now();
    let mut vm = Vm::spawn(spec).unwrap();
    let a = agent(&vm);
    eprintln!("boot_to_agent_ms={}", boot.elapsed().as_millis());

    // State worth keeping: a background process, a file in RAM, a file on disk.
    let sleeper = sh(&a, "sleep 1000 >/dev/null 2>&1 & echo $!");
    sh(
        &a,
        "echo in-ram > /dev/shm/ram.txt && echo on-disk > /disk.txt",
    );

    // Snapshot in place: the VM runs on, on a new top layer.
    let snap_dir = root.join("snap");
    let (snap, stats) = vm.capture(&snap_dir, DiskCapture::Freeze).unwrap();
    vm.resume_vcpus().unwrap();
    eprintln!("snapshot_in_place {stats:?}");
    assert!(snap.disk_frozen);
    assert_eq!(snap.state_file, snap_dir.join("state.bin"));
    assert!(snap.disk_layers.iter().all(|l| l.starts_with(&snap_dir)));
    assert_eq!(vm.disk(), sandbox.join("disk-1.qcow2"));
    assert_eq!(vm.qmp().query_status().unwrap(), "running");
    // The original writes on after the snapshot.
    sh(&a, "echo later > /after.txt && sync");
    assert_eq!(sh(&a, "cat /after.txt"), "later");

    // A second snapshot stacks one more layer.
    let (snap2, _) = vm
        .capture(&root.join("snap2"), DiskCapture::Freeze)
        .unwrap();
    vm.resume_vcpus().unwrap();
    assert_eq!(snap2.disk_layers.len(), 2);
    assert_eq!(vm.disk_chain_depth().unwrap(), 3);

    // Pause: capture + quit. The restore comes after a gap of at least 10 s.
    let pause_dir = root.join("paused");
    let (paused, pause_stats) = vm.pause(&pause_dir).unwrap();
    let paused_at = Instant::now();
    eprintln!("pause {pause_stats:?}");
    assert!(vm.try_wait().is_some(), "QEMU still runs after pause");
    assert!(!paused.disk_frozen);
    assert_eq!(paused.disk, sandbox.join("disk-2.qcow2"));
    drop(a);
    drop(vm);

    // Deleting the snapshot's source layers must not matter to clones: drop the
    // sandbox's links to the frozen layers first (the paused record keeps its own chain,
    // so only remove the snapshot-2 extra link).
    std::fs::remove_dir_all(root.join("snap2")).unwrap();

    // Two clones from the first snapshot: the disk as of the capture, independent disks.
    let (mut c1, a1, r1) = clone_from(&snap, &root.join("clone1"));
    let (mut c2, a2, r2) = clone_from(&snap, &root.join("clone2"));
    eprintln!("clone1 {r1:?} clone2 {r2:?}");
    for c in [&a1, &a2] {
        assert_eq!(sh(c, "cat /disk.txt"), "on-disk");
        assert_eq!(sh(c, "cat /dev/shm/ram.txt"), "in-ram");
        assert_eq!(sh(c, "test -e /after.txt && echo yes || echo no"), "no");
        assert_eq!(sh(c, &format!("kill -0 {sleeper} && echo alive")), "alive");
    }
    sh(&a1, "echo one > /clone.txt && sync");
    sh(&a2, "echo two > /clone.txt && sync");
    assert_eq!(sh(&a1, "cat /clone.txt"), "one");
    assert_eq!(sh(&a2, "cat /clone.txt"), "two");

    // Clones of a clone work too, and the snapshot can go away under running clones.
    std::fs::remove_dir_all(&snap_dir).unwrap();
    let (grand, gstats) = c1
        .capture(&root.join("snap-c1"), DiskCapture::Freeze)
        .unwrap();
    c1.resume_vcpus().unwrap();
    eprintln!("snapshot_of_clone {gstats:?}");
    let (g, ag, _) = clone_from(&grand, &root.join("grandclone"));
    assert_eq!(sh(&ag, "cat /clone.txt"), "one");
    drop(ag);
    g.kill();

    // Kill during a capture: no state.bin is left claiming to be complete.
    drop(a2);
    c2.qmp().migrate_set_parameters(2 << 20).unwrap();
    c2.qmp()
        .migrate_set_capabilities(capture::MIGRATION_CAPS)
        .unwrap();
    c2.migration_tuned = true;
    let victim = c2.pid();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        Command::new("kill")
            .args(["-9", &victim.to_string()])
            .status()
            .unwrap();
    });
    let killed_dir = root.join("killed");
    let e = c2.capture(&killed_dir, DiskCapture::InPlace).unwrap_err();
    killer.join().unwrap();
    eprintln!("capture of a killed VM: {e}");
    assert!(!killed_dir.join("state.bin").exists());
    drop(c2);

    // Resume the paused VM after >= 10 s: same process, files, clock fixed by set_time.
    drop(a1);
    c1.kill();
    let gap = Duration::from_secs(10).saturating_sub(paused_at.elapsed());
    std::thread::sleep(gap);
    let (mut vm, rstats) = Vm::restore(
        &paused,
        restore_spec(sandbox.join("run"), paused.disk.clone()),
    )
    .unwrap();
    let run = Instant::now();
    vm.resume_vcpus().unwrap();
    eprintln!(
        "resume {rstats:?} cont_ms={}",
        run.elapsed().as_micros() as f64 / 1000.0
    );
    let a = agent(&vm);
    let stale = host_unix_secs() - sh(&a, "date +%s").parse::<i64>().unwrap();
    sync_guest_clock(&a).unwrap();
    let skew = host_unix_secs() - sh(&a, "date +%s").parse::<i64>().unwrap();
    eprintln!("clock behind before set_time={stale}s after={skew}s");
    assert!(
        stale >= 8,
        "the guest clock should have stood still ({stale}s)"
    );
    assert!(skew.abs() <= 2, "guest clock off by {skew}s after set_time");
    assert_eq!(sh(&a, &format!("kill -0 {sleeper} && echo alive")), "alive");
    assert_eq!(sh(&a, "cat /dev/shm/ram.txt"), "in-ram");
    assert_eq!(sh(&a, "cat /disk.txt"), "on-disk");
    assert_eq!(sh(&a, "cat /after.txt"), "later");

    // The chain of the resumed sandbox can be merged while it runs.
    let depth = vm.disk_chain_depth().unwrap();
    vm.flatten_disk(Duration::from_secs(60)).unwrap();
    assert_eq!(vm.disk_chain_depth().unwrap(), 1);
    eprintln!("flattened chain of {depth} layers");
    assert_eq!(sh(&a, "cat /after.txt /disk.txt"), "later\non-disk");
    drop(a);
    vm.kill();
}

/// Dirty-only pause and resume of a template clone: the pause writes the device state
/// and the pages changed since the template only; the resume maps the template's RAM
/// file again (even after the template itself was deleted) and the guest sees exactly
/// its data and processes, twice over.
#[test]
fn dirty_pause_resume_of_a_template_clone() {
    if !have_assets() {
        return;
    }
    // The template: booted with its RAM in a shared file, 4 MiB of non-zero data in
    // tmpfs, captured (no RAM in the state file) and quit.
    let (_scratch, root, spec) = fresh_guest("aenv-dirty", "template");
    let template = root.join("template");
    let memory = MemoryFile {
        path: template.join("memory.ram"),
        shared: true,
    };
    let mut vm = Vm::spawn_with_memory_file(spec, &memory).unwrap();
    let a = agent(&vm);
    sh(&a, "yes template-page | head -c 4194304 > /dev/shm/zeroed");
    drop(a);
    let capture_dir = template.join("capture");
    let (tmpl, _) = vm.capture(&capture_dir, DiskCapture::Freeze).unwrap();
    vm.quit().unwrap();
    drop(vm);
    assert!(tmpl.memory_file.is_some() && tmpl.dirty.is_none());

    // A clone: it pauses dirty-only. Idle first.
    let clone = root.join("clone");
    let (mut vm, a, _) = clone_from(&tmpl, &clone);
    let run = clone.join("run");
    let sleeper = sh(&a, "sleep 1000 >/dev/null 2>&1 & echo $!");
    drop(a);
    std::thread::sleep(Duration::from_secs(1));
    let paused_dir = clone.join("paused");
    let (idle, stats) = vm.pause(&paused_dir).unwrap();
    eprintln!("idle dirty pause {stats:?} pages={:?}", idle.dirty);
    assert!(vm.try_wait().is_some(), "QEMU still runs after pause");
    drop(vm);
    let dirty = idle
        .dirty
        .clone()
        .expect("a template clone pauses dirty-only");
    assert_eq!(idle.format, dirty::DIRTY_FORMAT);
    assert_eq!(
        idle.memory_file.as_deref(),
        Some(&*run.join("template-memory.ram"))
    );
    assert_eq!(dirty.base_state, run.join("template-state.bin"));
    assert!(
        idle.state_bytes < 24 << 20,
        "an idle clone wrote {} bytes",
        idle.state_bytes
    );

    // The template goes away: the paused clone keeps its links.
    std::fs::remove_dir_all(&template).unwrap();

    // Resume, then dirty 16 MiB, zero a page range the template had data in, pause.
    let (mut vm, _) = Vm::restore(&idle, restore_spec(run.clone(), idle.disk.clone())).unwrap();
    vm.resume_vcpus().unwrap();
    let a = agent(&vm);
    assert_eq!(sh(&a, &format!("kill -0 {sleeper} && echo alive")), "alive");
    assert_eq!(
        sh(&a, "head -c 4194304 /dev/shm/zeroed | md5sum"),
        sh(&a, "yes template-page | head -c 4194304 | md5sum")
    );
    let pattern = sh(
        &a,
        "head -c 16777216 /dev/urandom > /dev/shm/pattern && md5sum < /dev/shm/pattern",
    );
    sh(
        &a,
        "dd if=/dev/zero of=/dev/shm/zeroed bs=1M count=4 conv=notrunc 2>/dev/null",
    );
    let zeros = sh(&a, "head -c 4194304 /dev/zero | md5sum");
    drop(a);
    let (busy, stats) = vm.pause(&paused_dir).unwrap();
    eprintln!("dirty pause after 16 MiB {stats:?}");
    drop(vm);
    let pages = busy.dirty.as_ref().unwrap().pages;
    assert!(
        pages * dirty::PAGE_SIZE >= 16 << 20,
        "only {pages} pages saved after 16 MiB written"
    );

    // Resume twice: the data, the zeroed pages and the process are there each time, and
    // the written-back pages count as changed again (no chain of captures).
    // A third round loses the template's files while it runs: that pause falls back to
    // the full state (every page in state.bin), which resumes as well.
    let mut record = busy;
    for round in 0..3 {
        let (mut vm, rstats) =
            Vm::restore(&record, restore_spec(run.clone(), record.disk.clone())).unwrap();
        eprintln!("resume {round} {rstats:?}");
        assert_eq!(vm.qmp().query_status().unwrap(), "paused");
        vm.resume_vcpus().unwrap();
        let a = agent(&vm);
        assert_eq!(sh(&a, "md5sum < /dev/shm/pattern"), pattern);
        assert_eq!(sh(&a, "md5sum < /dev/shm/zeroed"), zeros);
        assert_eq!(sh(&a, &format!("kill -0 {sleeper} && echo alive")), "alive");
        drop(a);
        if round == 2 {
            for link in ["template-memory.ram", "template-state.bin"] {
                std::fs::remove_file(run.join(link)).unwrap();
            }
        }
        let (next, _) = vm.pause(&paused_dir).unwrap();
        drop(vm);
        if round == 2 {
            assert!(
                next.dirty.is_none() && next.memory_file.is_none(),
                "{next:?}"
            );
            assert_eq!(next.format, capture::CAPTURE_FORMAT);
            assert!(next.state_bytes >= 20 << 20, "the full state holds the RAM");
            assert!(!paused_dir.join(dirty::PAGES_FILE).exists());
        } else {
            let next_pages = next.dirty.as_ref().unwrap().pages;
            assert!(
                next_pages >= pages,
                "round {round}: {next_pages} pages saved, {pages} before"
            );
        }
        record = next;
    }
    let (mut vm, _) = Vm::restore(&record, restore_spec(run.clone(), record.disk.clone())).unwrap();
    vm.resume_vcpus().unwrap();
    let a = agent(&vm);
    assert_eq!(sh(&a, "md5sum < /dev/shm/pattern"), pattern);
    assert_eq!(sh(&a, "md5sum < /dev/shm/zeroed"), zeros);
    drop(a);
    vm.kill();
}
