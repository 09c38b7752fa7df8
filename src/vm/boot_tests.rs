//! Real boots: QEMU with a Debian cloud kernel and a busybox initramfs built here.
//! Skipped (with a message) when QEMU, busybox, cpio or a kernel is missing. The kernel is
//! `$AGENTENV_TEST_KERNEL`, else `/var/lib/agentenv/assets/{vmlinux,vmlinuz}`, else the
//! first `/tmp/k/x/boot/vmlinuz-*`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::*;
use crate::config::AccelMode;

const MARKER: &str = "AGENTENV-TEST-BOOTED";

fn find_kernel() -> Option<PathBuf> {
    if let Some(k) = std::env::var_os("AGENTENV_TEST_KERNEL") {
        return Some(PathBuf::from(k));
    }
    let assets = guest_kernel(Path::new("/var/lib/agentenv/assets"));
    if assets.is_file() {
        return Some(assets);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/tmp/k/x/boot")
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz-"))
        })
        .collect();
    found.sort();
    found.pop()
}

fn have(binary: &str) -> bool {
    Command::new(binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// A scratch dir with a raw base disk, its overlay and a busybox initramfs whose /init
/// prints [`MARKER`] and the kernel command line, then ticks once a second.
struct Fixture {
    dir: PathBuf,
    kernel: PathBuf,
    initramfs: PathBuf,
    disk: PathBuf,
}

impl Fixture {
    fn new(name: &str) -> Option<Fixture> {
        let Some(kernel) = find_kernel().filter(|k| k.is_file()) else {
            panic!("no guest kernel (run scripts/setup.sh or set AGENTENV_TEST_KERNEL)");
        };
        for binary in ["qemu-system-x86_64", "qemu-img", "cpio"] {
            if !have(binary) {
                panic!("{binary} not installed (run scripts/setup.sh)");
            }
        }
        if !Path::new("/bin/busybox").is_file() {
            panic!("/bin/busybox (busybox-static) not installed (run scripts/setup.sh)");
        }
        let dir = std::env::temp_dir().join(format!("aenv-vm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = dir.join("initramfs");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::create_dir_all(root.join("proc")).unwrap();
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
        let init = format!(
            "#!/bin/busybox sh\n\
             /bin/busybox mount -t proc proc /proc\n\
             echo {MARKER}\n\
             echo \"cmdline=[$(/bin/busybox cat /proc/cmdline)]\"\n\
             i=0\n\
             while true; do i=$((i+1)); echo tick-$i; /bin/busybox sleep 1; done\n"
        );
        std::fs::write(root.join("init"), init).unwrap();
        std::fs::set_permissions(
            root.join("init"),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let initramfs = dir.join("initramfs.cpio");
        let mut cpio = Command::new("cpio")
            .args(["-o", "-H", "newc", "-R", "0:0", "--quiet"])
            .current_dir(&root)
            .stdin(Stdio::piped())
            .stdout(std::fs::File::create(&initramfs).unwrap())
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut stdin = cpio.stdin.take().unwrap();
            stdin.write_all(b"bin\nbin/busybox\nproc\ninit\n").unwrap();
        }
        assert!(cpio.wait().unwrap().success());
        let base = dir.join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let disk = dir.join("disk.qcow2");
        create_overlay(&base, &disk, 16).unwrap();
        Some(Fixture {
            dir,
            kernel,
            initramfs,
            disk,
        })
    }

    fn spec(&self, run: &str) -> VmSpec {
        VmSpec {
            host: HostPlumbing::local(self.dir.join(run), detect_accel(AccelMode::Auto).unwrap()),
            machine: MachineConfig {
                kernel: self.kernel.clone(),
                initramfs: self.initramfs.clone(),
                cpu_count: 1,
                memory_mb: 256,
            },
            kernel_args: vec!["agentenv.test=1".into(), "last=arg".into()],
            disk: self.disk.clone(),
        }
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls the console until it contains `needle`.
fn wait_console(vm: &Vm, needle: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let text = std::fs::read_to_string(vm.console_log()).unwrap_or_default();
        if text.contains(needle) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{needle:?} never appeared; console ends with:\n{}",
            vm.console_tail(30)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_status(vm: &mut Vm, want: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let status = vm.qmp().query_status().unwrap();
        if status == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "status stayed {status}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How often ISA IRQ 0 (the PIT's channel 0) was raised, from the monitor's `info irq`.
fn isa_irq0_count(vm: &mut Vm) -> u64 {
    let text = vm
        .qmp()
        .execute(
            "human-monitor-command",
            Some(serde_json::json!({ "command-line": "info irq" })),
        )
        .unwrap();
    let text = text.as_str().unwrap_or_default();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("0:"))
        .map_or(0, |n| n.trim().parse().unwrap())
}

fn gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

/// Boot, QMP control, save to a file, restore, kill: one cold boot in all.
#[test]
fn boot_save_restore_kill() {
    let Some(fx) = Fixture::new("boot") else {
        return;
    };
    let spec = fx.spec("run");
    let accel = spec.host.accel;
    let started = Instant::now();
    let mut vm = Vm::spawn(spec).unwrap();
    let qmp_ms = started.elapsed().as_millis();
    assert_eq!(vm.qmp().query_status().unwrap(), "running");
    wait_console(&vm, MARKER, Duration::from_secs(60));
    let boot_ms = started.elapsed().as_millis();
    // The command line is printed after the marker, then the first tick.
    let console = wait_console(&vm, "tick-1", Duration::from_secs(10));
    eprintln!(
        "kernel={} accel={accel:?} qmp_connected_ms={qmp_ms} marker_ms={boot_ms}",
        fx.kernel.display()
    );
    let tsc = match accel {
        Accel::Tcg { tsc_khz } => format!(" tsc_early_khz={tsc_khz} tsc=reliable"),
        Accel::Kvm => String::new(),
    };
    let want = format!(
        "cmdline=[console=ttyS0 reboot=t panic=-1 nowatchdog \
         sysctl.vm.compaction_proactiveness=0{tsc} agentenv.test=1 last=arg]"
    );
    assert!(console.contains(&want), "{want} not in console:\n{console}");
    assert!(vm.console_tail(3).contains(MARKER) || vm.console_tail(3).contains("tick-"));

    // Under TCG the PIT's channel 0 toggles ISA IRQ 0 until the boot is declared over,
    // and never after, in this process or in one restored from its state.
    let pit_running = |vm: &mut Vm| {
        let before = isa_irq0_count(vm);
        std::thread::sleep(Duration::from_millis(300));
        isa_irq0_count(vm) != before
    };
    let tcg = matches!(accel, Accel::Tcg { .. });
    if tcg {
        assert!(pit_running(&mut vm), "the PIT should tick during the boot");
    }
    vm.boot_finished().unwrap();
    // The one-shot the stop sequence loads ends 55 ms later.
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !pit_running(&mut vm),
        "the PIT still ticks after boot_finished"
    );

    vm.qmp().stop().unwrap();
    assert_eq!(vm.qmp().query_status().unwrap(), "paused");
    vm.qmp().cont().unwrap();
    assert_eq!(vm.qmp().query_status().unwrap(), "running");

    // Save the state to a file, then quit.
    let state = fx.dir.join("state.bin");
    let save = Instant::now();
    vm.qmp().stop().unwrap();
    vm.qmp().migrate_set_parameters(8 << 30).unwrap();
    vm.qmp().migrate_to_file(&state).unwrap();
    vm.qmp().wait_migration(Duration::from_secs(30)).unwrap();
    let save_ms = save.elapsed().as_millis();
    vm.qmp().quit().unwrap();
    let status = vm.wait_timeout(Duration::from_secs(10));
    assert!(status.is_some(), "qemu did not exit after quit");
    let pid = vm.pid();
    drop(vm);
    assert!(gone(pid));

    // Restore into a fresh process: it waits paused until cont, then keeps ticking.
    let restore = Instant::now();
    let mut vm = Vm::spawn_incoming(fx.spec("run"), &state).unwrap();
    wait_status(&mut vm, "paused", Duration::from_secs(30));
    vm.qmp().cont().unwrap();
    let restore_ms = restore.elapsed().as_millis();
    eprintln!("save_ms={save_ms} restore_ms={restore_ms}");
    assert_eq!(vm.qmp().query_status().unwrap(), "running");
    let ticks = std::fs::read_to_string(vm.console_log())
        .unwrap()
        .matches("tick-")
        .count();
    wait_console(&vm, &format!("tick-{}", ticks + 1), Duration::from_secs(20));
    assert!(!pit_running(&mut vm), "the restored VM's PIT ticks again");

    let pid = vm.pid();
    assert!(!gone(pid));
    vm.kill();
    assert!(gone(pid), "qemu {pid} still exists after kill");
}

#[test]
fn early_exit_reports_qemu_output() {
    let Some(fx) = Fixture::new("bad") else {
        return;
    };
    let mut spec = fx.spec("run");
    // Not a kernel: QEMU refuses it before the guest starts.
    spec.machine.kernel = fx.disk.clone();
    let e = Vm::spawn(spec).err().expect("spawn must fail");
    assert!(
        matches!(e, VmError::QemuExited { .. } | VmError::QmpIo { .. }),
        "{e}"
    );
    eprintln!("{e}");
    let mut spec = fx.spec("run2");
    spec.machine.initramfs = fx.dir.join("missing.cpio");
    let e = Vm::spawn(spec).err().expect("spawn must fail");
    assert!(e.to_string().contains("run scripts/setup.sh"), "{e}");
}

/// A named network namespace with a tap device, removed on drop.
struct TestNetns(String);

impl TestNetns {
    fn new() -> Option<TestNetns> {
        let name = format!("aenv-vmtest-{}", std::process::id());
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !ip(&["netns", "add", &name]) {
            panic!("cannot create a network namespace (needs root and ip(8))");
        }
        let ns = TestNetns(name);
        assert!(ip(&["-n", &ns.0, "tuntap", "add", "tap0", "mode", "tap"]));
        Some(ns)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// QEMU enters the given namespace and opens the tap there (the guest is not booted).
#[test]
fn tap_nic_inside_a_netns() {
    let Some(fx) = Fixture::new("netns") else {
        return;
    };
    let Some(ns) = TestNetns::new() else {
        return;
    };
    let mut spec = fx.spec("run");
    spec.host.netns = Some(std::fs::File::open(format!("/var/run/netns/{}", ns.0)).unwrap());
    spec.host.tap = Some("tap0".into());
    let mut vm = Vm::spawn(spec).unwrap();
    vm.qmp().stop().unwrap();
    let our_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let qemu_ns = std::fs::read_link(format!("/proc/{}/ns/net", vm.pid())).unwrap();
    assert_ne!(our_ns, qemu_ns);
    // The tun driver names the attached device in the fd's fdinfo ("iff:\ttap0").
    let fds = std::fs::read_dir(format!("/proc/{}/fdinfo", vm.pid())).unwrap();
    let attached = fds
        .filter_map(|e| std::fs::read_to_string(e.unwrap().path()).ok())
        .any(|info| {
            info.lines()
                .any(|l| l.starts_with("iff:") && l.ends_with("tap0"))
        });
    assert!(attached, "qemu holds no fd for tap0");
    let pid = vm.pid();
    vm.kill();
    assert!(gone(pid));
}
