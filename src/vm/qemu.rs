//! The QEMU process: its command line, and a [`Vm`] that owns the process and its QMP
//! session.
//!
//! QEMU runs in the foreground as a child of the sandbox's supervisor thread, inside the
//! slot's network namespace, with a seccomp sandbox, and dies with that thread
//! (`PR_SET_PDEATHSIG`). No shell is involved anywhere: the argv is built here.
//!
//! A VM's files live in its run dir under the state dir, except its unix sockets: those
//! go to a short private dir under [`SOCKET_ROOT`], so that no state dir is too long for
//! `sun_path` (107 bytes).
//!
//! # Confinement
//!
//! QEMU runs as a uid of its own from the subordinate range of the unprivileged account
//! [`VM_USER`] (see `uids`), with that account's group (no supplementary groups, no
//! capabilities, `PR_SET_NO_NEW_PRIVS`), with an empty environment, in a mount namespace
//! of its own whose root holds only `/usr` (binary, libraries, firmware), the guest kernel
//! and initramfs, a few device nodes and, for a VM with file-backed RAM, that one file
//! (see [`crate::sys::jail`]). The state dir is not in it. Everything else reaches QEMU as
//! a descriptor the server opened: the serial console pipe, the QMP and agent sockets
//! (bound by the server, passed listening), the tap, every file of the disk chain (each
//! layer an explicit `-blockdev` node over `/dev/fdset/N`, so QEMU never opens a backing
//! file by name), state files to restore from and to save to (QMP `add-fd`), and new disk
//! layers (QMP `add-fd` + `blockdev-add`).

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::accel::Accel;
use super::console::tail_lines;
use super::disk::{self, OpenChain};
use super::machine::{HostPlumbing, MachineConfig};
use super::qmp::{self, Qmp};
use super::VmError;
use crate::sys::jail::{Access, Credentials, Jail};
use crate::sys::process::{configure_child, kill_and_reap, ChildSetup};

/// The guest NIC's MAC address (every guest has the same one: each lives in its own netns).
pub const GUEST_MAC: &str = "06:00:a9:fe:00:15";
/// The id of the guest NIC's tap backend (QMP `set_link` names it).
pub(crate) const NETDEV_ID: &str = "net0";
/// The tap device's name inside a slot's network namespace.
pub const GUEST_TAP: &str = "tap0";
/// The virtio-serial port the in-guest agent opens (`/dev/virtio-ports/agentenv`).
pub const AGENT_PORT_NAME: &str = "agentenv";

/// What the guest's disk device does when a write or read on the host fails. A write
/// that fails because the host's filesystem (the state dir, which holds the writable
/// top layer) is full stops the VM (QEMU status `io-error`) with the request kept, so it
/// is retried on `cont` rather than failed inside the guest: the supervisor notices and
/// continues the VM once space is back (operations.md §10.3). Any other host error is
/// the guest's, as a real disk's would be: a stop on it would not end by freeing space.
const DISK_ERROR_POLICY: &str = "werror=enospc,rerror=report";

/// Kernel arguments every guest gets, before the spec's own. Boot messages stay on (no
/// `quiet`): they are what an operator reads when a guest never becomes ready.
///
/// The last two keep an idle guest from waking for nothing (each wake-up is a host-side
/// timer, a vCPU thread wake and, under TCG, guest code run by the emulator): `kcompactd`
/// otherwise checks every 500 ms whether to compact memory for huge pages ahead of need,
/// and the soft-lockup watchdog's timer fires every 4 s. Neither matters in a small
/// microVM; an idle guest then wakes a few times a second instead of about ten.
const BASE_KERNEL_ARGS: &[&str] = &[
    "console=ttyS0",
    "reboot=t",
    "panic=-1",
    "nowatchdog",
    "sysctl.vm.compaction_proactiveness=0",
];
/// x86 COMMAND_LINE_SIZE, including the terminating NUL.
const MAX_CMDLINE: usize = 2048;
/// `sun_path` is 108 bytes including the NUL.
const MAX_SOCKET_PATH: usize = 107;
/// Parent of every VM's socket dir (`<pid>.<n>`, one per QEMU process, mode 0700).
pub const SOCKET_ROOT: &str = "/run/agentenv/s";
/// The fd QEMU inherits for its serial console: a pipe into [`super::console`]'s writer.
const CONSOLE_FD: i32 = 3;
/// How long QEMU may take to greet on its QMP socket.
const QMP_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The unprivileged account every QEMU runs as (created by scripts/setup.sh).
pub const VM_USER: &str = "agentenv-vm";
/// Host paths bound read-only into every QEMU's mount namespace when present: the binary,
/// its libraries and firmware (links such as `/lib -> usr/lib` are recreated as links).
const JAIL_SYSTEM_PATHS: &[&str] = &["/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache"];
/// Where the guest kernel, initramfs and RAM file appear in QEMU's mount namespace.
const JAIL_VM_DIR: &str = "/vm";
/// Device nodes QEMU may open.
const JAIL_DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];
/// The root disk's top node name prefix: nodes are `layer0`, `layer1`, ... in the order
/// they were added; the raw base image is [`BASE_NODE`].
const LAYER_NODE_PREFIX: &str = "layer";
pub(crate) const BASE_NODE: &str = "base";

/// Everything needed to start one guest.
#[derive(Debug)]
pub struct VmSpec {
    pub machine: MachineConfig,
    /// Appended after the base arguments, in order; they appear verbatim in the guest's
    /// `/proc/cmdline`, so later ones win.
    pub kernel_args: Vec<String>,
    /// The root disk, a qcow2 overlay (see [`super::create_overlay`]).
    pub disk: PathBuf,
    pub host: HostPlumbing,
}

/// The files of a VM inside its run dir.
#[derive(Debug, Clone)]
struct RunPaths {
    console_log: PathBuf,
    qemu_log: PathBuf,
    qmp_socket: PathBuf,
    agent_socket: PathBuf,
}

impl RunPaths {
    fn new(run_dir: &Path, socket_dir: &Path) -> RunPaths {
        RunPaths {
            console_log: run_dir.join("console.log"),
            qemu_log: run_dir.join("qemu.log"),
            qmp_socket: socket_dir.join("qmp.sock"),
            agent_socket: socket_dir.join("agent.sock"),
        }
    }
}

/// One QEMU process's private socket dir, `<SOCKET_ROOT>/<server pid>.<n>` (mode 0700),
/// removed on drop.
#[derive(Debug)]
struct SocketDir {
    path: PathBuf,
}

impl SocketDir {
    fn create() -> Result<SocketDir, VmError> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let root = Path::new(SOCKET_ROOT);
        std::fs::create_dir_all(root)
            .map_err(|e| VmError::io(format!("cannot create {SOCKET_ROOT}"), e))?;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = root.join(format!("{}.{n}", std::process::id()));
        // A leftover of an earlier process that had the same pid.
        remove_dir_if_present(&path)?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| VmError::io(format!("cannot create socket dir {}", path.display()), e))?;
        Ok(SocketDir { path })
    }
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        if let Err(e) = remove_dir_if_present(&self.path) {
            log::warn!("vm op=remove_socket_dir error=\"{e}\"");
        }
    }
}

fn remove_dir_if_present(path: &Path) -> Result<(), VmError> {
    match std::fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(VmError::io(format!("cannot remove {}", path.display()), e)),
    }
}

/// Removes the socket dirs of processes that no longer run (a crashed server's). Those of
/// live processes stay: they may be another program's VMs (a test run).
pub fn remove_stale_socket_dirs() {
    let Ok(entries) = std::fs::read_dir(SOCKET_ROOT) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name.split('.').next().unwrap_or("");
        if pid.parse::<u32>().is_ok() && Path::new("/proc").join(pid).exists() {
            continue;
        }
        match remove_dir_if_present(&entry.path()) {
            Ok(()) => log::info!("vm op=remove_stale_socket_dir dir={name}"),
            Err(e) => log::warn!("vm op=remove_stale_socket_dir error=\"{e}\""),
        }
    }
}

/// The kernel to boot from an assets dir: the PVH `vmlinux` when present (boots faster),
/// else the bzImage `vmlinuz`.
pub fn guest_kernel(assets_dir: &Path) -> PathBuf {
    let vmlinux = assets_dir.join("vmlinux");
    if vmlinux.is_file() {
        vmlinux
    } else {
        assets_dir.join("vmlinuz")
    }
}

/// The guest kernel command line: base arguments, the TCG clock hints, then the spec's.
///
/// Under TCG the kernel's clocksource watchdog compares the TSC with jiffies (there is no
/// other clocksource on microvm), sees the emulated timer interrupts lag, marks the TSC
/// unstable and falls back to jiffies: no high-resolution timers, so an idle guest keeps
/// its 250 Hz tick and every sleep rounds to 4 ms. QEMU's TCG TSC follows the host clock,
/// so it is trusted (`tsc=reliable`), and the idle guest stops ticking.
pub fn kernel_cmdline(accel: Accel, extra: &[String]) -> Result<String, VmError> {
    let mut args: Vec<String> = BASE_KERNEL_ARGS.iter().map(|s| s.to_string()).collect();
    if let Accel::Tcg { tsc_khz } = accel {
        args.push(format!("tsc_early_khz={tsc_khz}"));
        args.push("tsc=reliable".into());
    }
    for a in extra {
        if a.is_empty() || a.chars().any(|c| c.is_control()) {
            return Err(VmError::InvalidSpec(format!(
                "kernel argument {a:?} is empty or holds control characters"
            )));
        }
        args.push(a.clone());
    }
    let cmdline = args.join(" ");
    if cmdline.len() >= MAX_CMDLINE {
        return Err(VmError::InvalidSpec(format!(
            "kernel command line is {} bytes; the limit is {}",
            cmdline.len(),
            MAX_CMDLINE - 1
        )));
    }
    Ok(cmdline)
}

/// The port writes that stop channel 0 of the PIT: its mode (channel 0, low then high
/// byte, mode 0: one shot), then a count of 0 in two bytes.
const PIT_STOP: [(u16, u8); 3] = [(0x43, 0x30), (0x40, 0), (0x40, 0)];

/// Stops the PIT's channel 0 of a guest that has booted (TCG, whose machine has `pit=on`;
/// nothing under KVM).
///
/// The guest kernel needs the PIT while it boots; afterwards it runs on the TSC-deadline
/// LAPIC timer and never touches the PIT again. The guest kernel (6.1) leaves channel 0 as
/// reset left it (mode 3, an 18.2 Hz square wave), so QEMU went on toggling its masked
/// interrupt line: a main-loop timer firing 36 times a second in every idle guest, most of
/// an idle QEMU's CPU. These are the port writes newer kernels make themselves at boot
/// (`clockevent_i8253_disable`), sent through the monitor from the host so that they hold
/// whatever the guest runs; a capture taken afterwards keeps the PIT stopped for every
/// VM restored from it.
pub fn stop_boot_timer(qmp: &mut Qmp, accel: Accel) -> Result<(), VmError> {
    if accel == Accel::Kvm {
        return Ok(());
    }
    for (port, value) in PIT_STOP {
        let command = format!("o /b {port:#x} {value:#x}");
        let answer = qmp.execute(
            "human-monitor-command",
            Some(json!({ "command-line": command })),
        )?;
        // The monitor answers a failed command with its message as text.
        if let Some(message) = answer.as_str().filter(|m| !m.trim().is_empty()) {
            return Err(VmError::Qmp {
                command,
                message: message.trim().to_string(),
            });
        }
    }
    Ok(())
}

/// A path as the value of a QEMU `key=value,...` option: UTF-8, commas doubled.
fn opt_path(path: &Path) -> Result<String, VmError> {
    path.to_str()
        .map(|s| s.replace(',', ",,"))
        .ok_or_else(|| VmError::InvalidSpec(format!("path {} is not UTF-8", path.display())))
}

/// Where a new QEMU process takes its initial state from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Incoming<'a> {
    /// A cold boot.
    None,
    /// `-incoming file:PATH`: restore the saved state at start.
    File(&'a Path),
    /// `-incoming defer`: wait for QMP `migrate-incoming` (a pre-spawned standby).
    Defer,
    /// A cold boot with the vCPUs held (`-S`) until `cont`: the boot of a
    /// filesystem-only capture, whose guest may not run before its start hook succeeded.
    Held,
}

/// What a launch needs beyond a [`VmSpec`]: the exact kernel command line, the RAM backing
/// and the incoming state.
#[derive(Debug, Clone)]
pub(crate) struct Launch<'a> {
    /// The `-append` string; `None`: built from the spec (a cold boot). A restore passes
    /// the one the captured VM booted with, byte for byte.
    pub cmdline: Option<&'a str>,
    /// Guest RAM in a host file instead of anonymous memory.
    pub memory: Option<&'a MemoryFile>,
    pub incoming: Incoming<'a>,
}

impl Launch<'_> {
    pub(crate) fn cold() -> Launch<'static> {
        Launch {
            cmdline: None,
            memory: None,
            incoming: Incoming::None,
        }
    }
}

/// Guest RAM backed by a host file (`memory-backend-file`).
///
/// `shared: true` maps it `MAP_SHARED`: the file *is* the guest's RAM, so a capture with
/// `x-ignore-shared` writes no RAM at all into the state file (the file holds it). Use it
/// for a VM that quits right after its capture (a template build). `shared: false` maps it
/// privately (copy-on-write): how clones map a template's RAM file, all sharing the page
/// cache and never writing to the file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemoryFile {
    pub path: PathBuf,
    pub shared: bool,
}

/// One node of the root disk's block graph.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DiskNode {
    name: String,
    /// Descriptor numbers in QEMU; the first one also names the fd set.
    fds: Vec<RawFd>,
    qcow2: bool,
    writable: bool,
    /// The node under this one (its backing image), if any.
    backing: Option<String>,
}

/// A qcow2 node over the file behind fd set `fdset`, as `-blockdev` / `blockdev-add` JSON.
/// `backing`: the node under it, `Value::Null` for "none, and do not open the backing
/// file the image names", or absent (an image without a backing file).
pub(super) fn qcow2_node(name: &str, fdset: u64, writable: bool, backing: Option<Value>) -> Value {
    let mut file = json!({
        "driver": "file",
        "filename": format!("/dev/fdset/{fdset}"),
        "read-only": !writable,
    });
    let mut node = json!({ "driver": "qcow2", "node-name": name, "read-only": !writable });
    if writable {
        file["discard"] = "unmap".into();
        node["discard"] = "unmap".into();
    }
    node["file"] = file;
    if let Some(backing) = backing {
        node["backing"] = backing;
    }
    node
}

impl DiskNode {
    fn blockdev(&self) -> Value {
        let fdset = self.fds[0] as u64;
        if !self.qcow2 {
            return json!({
                "driver": "file",
                "node-name": self.name,
                "filename": format!("/dev/fdset/{fdset}"),
                "read-only": true,
            });
        }
        qcow2_node(
            &self.name,
            fdset,
            self.writable,
            self.backing.clone().map(Value::String),
        )
    }
}

/// The descriptors a QEMU process inherits, by the numbers its command line uses.
#[derive(Debug, Clone, Default)]
struct Inherited {
    qmp: RawFd,
    agent: RawFd,
    tap: Option<RawFd>,
    /// The root disk's nodes, bottom first; the last is the one the guest's device uses.
    disk: Vec<DiskNode>,
    /// The state file of an `-incoming` restore.
    incoming: Option<RawFd>,
}

/// The full QEMU argv (without the binary).
fn build_argv(
    spec: &VmSpec,
    fds: &Inherited,
    launch: &Launch<'_>,
) -> Result<Vec<OsString>, VmError> {
    if spec.machine.cpu_count == 0 || spec.machine.memory_mb == 0 {
        return Err(VmError::InvalidSpec(
            "cpu_count and memory_mb must be at least 1".into(),
        ));
    }
    let mut argv: Vec<OsString> = Vec::with_capacity(48);
    push_machine_args(&mut argv, spec)?;
    push_boot_args(&mut argv, spec, launch)?;
    push_device_args(&mut argv, spec, fds)?;
    push_incoming_args(&mut argv, fds, launch.incoming)?;
    Ok(argv)
}

/// Appends `items` to `argv`.
fn push(argv: &mut Vec<OsString>, items: &[&str]) {
    argv.extend(items.iter().map(OsString::from));
}

/// The machine: its name, type and accelerator, CPUs, RAM size and QEMU's own seccomp.
fn push_machine_args(argv: &mut Vec<OsString>, spec: &VmSpec) -> Result<(), VmError> {
    // RAM is always an explicit backend named "ram", so that every VM's RAM block has the
    // same name whether it is anonymous or a file, and any state file restores into either.
    let mut machine = String::from("microvm,acpi=on,auto-kernel-cmdline=off,memory-backend=ram");
    let (accel, cpu) = match spec.host.accel {
        Accel::Kvm => ("kvm", "host"),
        Accel::Tcg { .. } => {
            // Without the PIT the guest randomly dies with a divide error at boot.
            machine.push_str(",pit=on,pic=off");
            ("tcg,tb-size=32", "max")
        }
    };
    push(
        argv,
        &["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"],
    );
    // QEMU opens no path of the state dir any more; the run dir as the guest's name still
    // tells an operator (and `ps`) whose VM a process is. Named threads ("CPU 0/TCG")
    // let a pause raise QEMU's own threads without its vCPUs (`Vm::set_priority`).
    push(
        argv,
        &[
            "-name",
            &format!("guest={},debug-threads=on", opt_path(&spec.host.run_dir)?),
        ],
    );
    push(argv, &["-M", &machine, "-accel", accel, "-cpu", cpu]);
    push(argv, &["-smp", &spec.machine.cpu_count.to_string()]);
    push(argv, &["-m", &format!("{}M", spec.machine.memory_mb)]);
    push(
        argv,
        &[
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
        ],
    );
    Ok(())
}

/// What the guest boots: kernel, initramfs, command line and the RAM backend.
fn push_boot_args(
    argv: &mut Vec<OsString>,
    spec: &VmSpec,
    launch: &Launch<'_>,
) -> Result<(), VmError> {
    argv.push("-kernel".into());
    argv.push(spec.machine.kernel.clone().into_os_string());
    argv.push("-initrd".into());
    argv.push(spec.machine.initramfs.clone().into_os_string());
    argv.push("-append".into());
    argv.push(match launch.cmdline {
        Some(cmdline) => cmdline.into(),
        None => kernel_cmdline(spec.host.accel, &spec.kernel_args)?.into(),
    });
    argv.push("-object".into());
    argv.push(match launch.memory {
        // A private mapping opens the file read-only (`readonly=on,rom=off`): clones
        // never write a template's RAM file, and may not.
        Some(memory) => format!(
            "memory-backend-file,id=ram,size={}M,mem-path={},{}",
            spec.machine.memory_mb,
            opt_path(&memory.path)?,
            if memory.shared {
                "share=on"
            } else {
                "share=off,readonly=on,rom=off"
            }
        )
        .into(),
        None => format!("memory-backend-ram,id=ram,size={}M", spec.machine.memory_mb).into(),
    });
    Ok(())
}

/// The devices, each over an inherited descriptor: console, root disk chain, network,
/// agent port and the QMP monitor.
fn push_device_args(
    argv: &mut Vec<OsString>,
    spec: &VmSpec,
    fds: &Inherited,
) -> Result<(), VmError> {
    push(
        argv,
        &[
            "-add-fd",
            &format!("fd={CONSOLE_FD},set={CONSOLE_FD},opaque=console"),
            "-chardev",
            &format!("file,id=console,path=/dev/fdset/{CONSOLE_FD},append=on"),
            "-serial",
            "chardev:console",
        ],
    );
    push_disk_args(argv, &fds.disk)?;
    if let Some(tap) = &spec.host.tap {
        if tap.is_empty() || tap.contains(',') || tap.len() > 15 {
            return Err(VmError::InvalidSpec(format!("bad tap device name {tap:?}")));
        }
        let fd = fds
            .tap
            .ok_or_else(|| VmError::InvalidSpec(format!("tap {tap} was not opened")))?;
        push(
            argv,
            &[
                "-netdev",
                &format!("tap,id={NETDEV_ID},fd={fd}"),
                "-device",
                &format!("virtio-net-device,netdev={NETDEV_ID},mac={GUEST_MAC}"),
            ],
        );
    }
    push(
        argv,
        &[
            "-chardev",
            &format!("socket,id=agent,fd={},server=on,wait=off", fds.agent),
            "-device",
            "virtio-serial-device",
            "-device",
            &format!("virtserialport,chardev=agent,name={AGENT_PORT_NAME}"),
        ],
    );
    push(
        argv,
        &[
            "-chardev",
            &format!("socket,id=qmp,fd={},server=on,wait=off", fds.qmp),
            "-mon",
            "chardev=qmp,mode=control",
        ],
    );
    Ok(())
}

/// The root disk: each node's descriptors as an fd set and its blockdev, bottom first,
/// and the guest's device on the top one.
fn push_disk_args(argv: &mut Vec<OsString>, disk: &[DiskNode]) -> Result<(), VmError> {
    let top = disk
        .last()
        .ok_or_else(|| VmError::InvalidSpec("the root disk has no layers".into()))?;
    for node in disk {
        for fd in &node.fds {
            push(
                argv,
                &[
                    "-add-fd",
                    &format!("fd={fd},set={},opaque={}", node.fds[0], node.name),
                ],
            );
        }
        push(argv, &["-blockdev", &node.blockdev().to_string()]);
    }
    push(
        argv,
        &[
            "-device",
            &format!("virtio-blk-device,drive={},{DISK_ERROR_POLICY}", top.name),
        ],
    );
    Ok(())
}

/// Where the VM's state comes from and whether its vCPUs wait for `cont`.
fn push_incoming_args(
    argv: &mut Vec<OsString>,
    fds: &Inherited,
    incoming: Incoming<'_>,
) -> Result<(), VmError> {
    match incoming {
        Incoming::None => {}
        Incoming::File(_) => {
            let fd = fds
                .incoming
                .ok_or_else(|| VmError::InvalidSpec("the state file was not opened".into()))?;
            push(
                argv,
                &["-add-fd", &format!("fd={fd},set={fd},opaque=incoming")],
            );
            push(argv, &["-incoming", &format!("file:/dev/fdset/{fd}")]);
        }
        // -S: a state whose global state says "running" (a dirty-only pause's, see
        // super::dirty) still waits `paused` after the load; others say `paused` anyway.
        Incoming::Defer => push(argv, &["-incoming", "defer", "-S"]),
        Incoming::Held => push(argv, &["-S"]),
    }
    Ok(())
}

/// Finds `binary` as `execvp` would: as given when it holds a `/`, else in PATH.
fn resolve_binary(binary: &Path) -> Result<PathBuf, VmError> {
    crate::util::find_in_path(binary).ok_or_else(|| VmError::BinaryNotFound {
        binary: binary.to_path_buf(),
    })
}

/// The log line of a QEMU that answers on QMP, `started` being when it was spawned.
fn log_spawn(
    pid: u32,
    uid: Option<&super::uids::UidLease>,
    spec: &VmSpec,
    kernel: &Path,
    incoming: Incoming<'_>,
    started: Instant,
) {
    log::info!(
        "vm op=spawn pid={pid} user={VM_USER} uid={} accel={} cpus={} memoryMb={} \
         kernel={} runDir={} incoming={} qmpMs={}",
        uid.map(|l| l.uid.to_string())
            .unwrap_or_else(|| VM_USER.into()),
        spec.host.accel.name(),
        spec.machine.cpu_count,
        spec.machine.memory_mb,
        kernel.display(),
        spec.host.run_dir.display(),
        !matches!(incoming, Incoming::None | Incoming::Held),
        started.elapsed().as_millis()
    );
}

/// Refuses a spec whose boot files are missing (before anything is created for it) and
/// creates its run dir.
fn check_assets(spec: &VmSpec) -> Result<(), VmError> {
    for (what, path) in [
        ("guest kernel", &spec.machine.kernel),
        ("initramfs", &spec.machine.initramfs),
        ("root disk", &spec.disk),
    ] {
        if !path.is_file() {
            return Err(VmError::MissingAsset {
                what,
                path: path.clone(),
            });
        }
    }
    std::fs::create_dir_all(&spec.host.run_dir).map_err(|e| {
        VmError::io(
            format!("cannot create VM run dir {}", spec.host.run_dir.display()),
            e,
        )
    })
}

/// Who QEMU runs as: [`VM_USER`]'s credentials (plus /dev/kvm's group under KVM) on a uid
/// of its own (see `uids`), whose lease is given back once the process is reaped.
fn qemu_credentials(accel: Accel) -> Result<(Credentials, Option<super::uids::UidLease>), VmError> {
    let mut credentials = Credentials::lookup(VM_USER)
        .map_err(|e| VmError::io(format!("cannot run QEMU as {VM_USER}"), e.source))?;
    if accel == Accel::Kvm {
        // /dev/kvm's group (usually "kvm") is the one supplementary group QEMU keeps.
        use std::os::unix::fs::MetadataExt;
        let kvm =
            std::fs::metadata("/dev/kvm").map_err(|e| VmError::io("cannot stat /dev/kvm", e))?;
        credentials.extra_group = Some(kvm.gid());
    }
    let uid = super::uids::lease(VM_USER, credentials.uid);
    if let Some(lease) = &uid {
        credentials.uid = lease.uid;
    }
    Ok((credentials, uid))
}

/// Refuses socket paths a `sockaddr_un` cannot hold.
fn check_socket_paths(paths: &RunPaths) -> Result<(), VmError> {
    for socket in [&paths.qmp_socket, &paths.agent_socket] {
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(VmError::InvalidSpec(format!(
                "socket path {} is longer than {MAX_SOCKET_PATH} bytes",
                socket.display()
            )));
        }
    }
    Ok(())
}

/// Points `spec`'s kernel and initramfs at their fixed paths under [`JAIL_VM_DIR`] in
/// QEMU's namespace; returns the host files to bind there (at their real, absolute,
/// symlink-free paths) and the kernel and initramfs paths as given, for the VM's facts.
fn move_boot_files_into_jail(
    spec: &mut VmSpec,
    memory: Option<&MemoryFile>,
) -> Result<(HostFiles, PathBuf, PathBuf), VmError> {
    let real = |path: &Path| {
        std::fs::canonicalize(path)
            .map_err(|e| VmError::io(format!("cannot resolve {}", path.display()), e))
    };
    let (kernel, initramfs) = (spec.machine.kernel.clone(), spec.machine.initramfs.clone());
    let host = HostFiles {
        kernel: real(&kernel)?,
        initramfs: real(&initramfs)?,
        memory: memory.map(|m| m.path.clone()),
    };
    spec.machine.kernel = Path::new(JAIL_VM_DIR).join("kernel");
    spec.machine.initramfs = Path::new(JAIL_VM_DIR).join("initramfs");
    Ok((host, kernel, initramfs))
}

/// Opens what QEMU gets as descriptors (its QMP and agent listeners, the tap, the disk
/// chain, an incoming state file) into `passed`; returns their numbers and how many disk
/// layer nodes that made.
fn open_inherited(
    spec: &VmSpec,
    paths: &RunPaths,
    incoming: Incoming<'_>,
    passed: &mut PassedFds,
) -> Result<(Inherited, usize), VmError> {
    let mut fds = Inherited::default();
    let bind = |path: &Path| {
        UnixListener::bind(path)
            .map_err(|e| VmError::io(format!("cannot bind {}", path.display()), e))
    };
    fds.qmp = passed.pass(bind(&paths.qmp_socket)?);
    fds.agent = passed.pass(bind(&paths.agent_socket)?);
    if let Some(tap) = &spec.host.tap {
        let open = || crate::sys::tun::open_tap(tap);
        let file = match &spec.host.netns {
            Some(ns) => crate::sys::netns::with_netns(ns, open),
            None => open(),
        }
        .map_err(|e| VmError::io(format!("cannot open tap {tap}"), e.source))?;
        fds.tap = Some(passed.pass(file));
    }
    let (nodes, node_count) = pass_disk(disk::open_chain(&spec.disk)?, passed);
    fds.disk = nodes;
    if let Incoming::File(state) = incoming {
        let file = File::open(state)
            .map_err(|e| VmError::io(format!("cannot open {}", state.display()), e))?;
        fds.incoming = Some(passed.pass(file));
    }
    Ok((fds, node_count))
}

/// Starts QEMU (`binary` `argv`) as `setup` says, with an empty environment (the server's
/// API key and extension token are not QEMU's), output to its log, the console on a pipe
/// whose read end is returned, and the `passed` descriptors (closed here once it runs).
fn spawn_jailed(
    binary: &Path,
    argv: &[OsString],
    paths: &RunPaths,
    mut passed: PassedFds,
    mut setup: ChildSetup,
) -> Result<(Child, std::io::PipeReader), VmError> {
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&paths.qemu_log)
        .map_err(|e| VmError::io(format!("cannot open {}", paths.qemu_log.display()), e))?;
    let log_err = log
        .try_clone()
        .map_err(|e| VmError::io("cannot duplicate the qemu log fd", e))?;
    let (console_out, console_in) =
        std::io::pipe().map_err(|e| VmError::io("cannot create the console pipe", e))?;
    passed.fds.push((console_in.into(), CONSOLE_FD));
    let mut cmd = Command::new(binary);
    cmd.args(argv)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    setup.fds = passed.numbers();
    configure_child(&mut cmd, setup);
    let child = cmd.spawn().map_err(|source| VmError::Spawn {
        binary: binary.to_path_buf(),
        source,
    })?;
    // The child has entered the namespaces (or failed to) and holds its own copies;
    // with the listeners closed here, a QEMU that dies makes the QMP connect fail.
    drop(passed);
    Ok((child, console_out))
}

/// Descriptors the server hands a QEMU process, numbered from 4 up (3 is the console).
struct PassedFds {
    fds: Vec<(OwnedFd, RawFd)>,
}

impl PassedFds {
    fn new() -> PassedFds {
        PassedFds { fds: Vec::new() }
    }

    /// Hands over `fd`; returns its number in QEMU.
    fn pass(&mut self, fd: impl Into<OwnedFd>) -> RawFd {
        let number = CONSOLE_FD + 1 + self.fds.len() as RawFd;
        self.fds.push((fd.into(), number));
        number
    }

    fn numbers(&self) -> Vec<(RawFd, RawFd)> {
        self.fds.iter().map(|(f, n)| (f.as_raw_fd(), *n)).collect()
    }
}

/// The root disk's block graph over the descriptors of `chain`, bottom first; and how
/// many layer nodes that made.
fn pass_disk(chain: OpenChain, passed: &mut PassedFds) -> (Vec<DiskNode>, usize) {
    let mut nodes = Vec::with_capacity(chain.layers.len() + 1);
    if let Some(base) = chain.base {
        nodes.push(DiskNode {
            name: BASE_NODE.into(),
            fds: vec![passed.pass(base)],
            qcow2: false,
            writable: false,
            backing: None,
        });
    }
    let count = chain.layers.len();
    let mut top_read_only = Some(chain.top_read_only);
    for (i, layer) in chain.layers.into_iter().enumerate() {
        let mut fds = vec![passed.pass(layer)];
        let top = i + 1 == count;
        if top {
            fds.extend(top_read_only.take().map(|f| passed.pass(f)));
        }
        let backing = nodes.last().map(|n: &DiskNode| n.name.clone());
        nodes.push(DiskNode {
            name: format!("{LAYER_NODE_PREFIX}{i}"),
            fds,
            qcow2: true,
            writable: top,
            backing,
        });
    }
    (nodes, count)
}

/// Makes the RAM file `memory` usable by QEMU as [`VM_USER`] and returns its real path:
/// owned by root, group [`VM_USER`]'s, 0660 while a VM maps it shared (created and sized
/// here for a template build), 0640 to be mapped privately (clones read it only). Only
/// QEMUs whose mount namespace holds the file can reach it.
fn prepare_memory_file(
    memory: &MemoryFile,
    memory_mb: u32,
    credentials: &Credentials,
) -> Result<PathBuf, VmError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let path = &memory.path;
    let io = |e| VmError::io(format!("cannot prepare RAM file {}", path.display()), e);
    let file = if memory.shared {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o660)
            .open(path)
            .map_err(io)?;
        let size = u64::from(memory_mb) << 20;
        if file.metadata().map_err(io)?.len() < size {
            file.set_len(size).map_err(io)?;
        }
        file
    } else {
        File::open(path).map_err(io)?
    };
    std::os::unix::fs::fchown(&file, None, Some(credentials.gid)).map_err(io)?;
    let mode = if memory.shared { 0o660 } else { 0o640 };
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(io)?;
    std::fs::canonicalize(path).map_err(io)
}

/// The host files a QEMU maps by path, bound into its namespace under [`JAIL_VM_DIR`].
struct HostFiles {
    kernel: PathBuf,
    initramfs: PathBuf,
    memory: Option<PathBuf>,
}

/// QEMU's mount namespace (see the module docs), rooted on `root` (the VM's socket dir:
/// the host keeps its sockets, QEMU sees an empty tmpfs there).
fn plan_jail(
    root: &Path,
    binary: &Path,
    accel: Accel,
    host: &HostFiles,
    memory: Option<&MemoryFile>,
) -> Result<Jail, VmError> {
    let err = |e: crate::sys::SysError| VmError::io("cannot plan QEMU's mount namespace", e.source);
    let mut jail = Jail::new(root).map_err(err)?;
    for path in JAIL_SYSTEM_PATHS {
        jail.bind_if_present(Path::new(path), Access::ReadOnly)
            .map_err(err)?;
    }
    let binary = std::fs::canonicalize(binary)
        .map_err(|e| VmError::io(format!("cannot resolve {}", binary.display()), e))?;
    if !binary.starts_with("/usr") {
        jail.bind(&binary, Access::ReadOnly).map_err(err)?;
    }
    for path in JAIL_DEVICES {
        jail.bind_if_present(Path::new(path), Access::Device)
            .map_err(err)?;
    }
    if accel == Accel::Kvm {
        jail.bind(Path::new("/dev/kvm"), Access::Device)
            .map_err(err)?;
    }
    let vm = Path::new(JAIL_VM_DIR);
    jail.bind_as(&host.kernel, &vm.join("kernel"), Access::ReadOnly)
        .map_err(err)?;
    jail.bind_as(&host.initramfs, &vm.join("initramfs"), Access::ReadOnly)
        .map_err(err)?;
    if let (Some(path), Some(memory)) = (&host.memory, memory) {
        let access = if memory.shared {
            Access::ReadWrite
        } else {
            Access::ReadOnly
        };
        jail.bind_as(path, &vm.join("memory"), access)
            .map_err(err)?;
    }
    Ok(jail)
}

/// Kills and reaps a child unless disarmed: an early `?` in [`Vm::start`] never leaves a
/// QEMU behind.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            if let Err(e) = kill_and_reap(child) {
                log::warn!("vm op=kill pid={} error={e}", child.id());
            }
        }
    }
}

/// What a VM was started with: what a capture records so that a restore reproduces it.
#[derive(Debug, Clone)]
pub(crate) struct VmFacts {
    /// With the host's paths of the boot files (QEMU sees them inside its jail).
    pub machine: MachineConfig,
    /// The exact `-append` string.
    pub kernel_cmdline: String,
    /// The disk QEMU writes to now (the top of its qcow2 chain); a disk freeze moves it.
    pub disk: PathBuf,
    /// Its block node name in QEMU.
    pub disk_node: String,
    /// The node under it (its backing), if any.
    pub disk_backing: Option<String>,
    /// How many layer nodes were added so far (names the next one).
    pub disk_nodes_added: usize,
    pub tap: Option<String>,
    pub memory: Option<MemoryFile>,
    /// The VM's run dir.
    pub run_dir: PathBuf,
    /// The template state this VM was restored from, when its RAM is that template's
    /// file mapped privately: what a dirty-only pause saves against (see
    /// [`super::dirty`]).
    pub base_state: Option<PathBuf>,
}

/// A running QEMU process and its QMP session. Dropping it kills and reaps the process.
pub struct Vm {
    child: Child,
    /// Set once the process has been reaped.
    exit: Option<ExitStatus>,
    qmp: Qmp,
    paths: RunPaths,
    /// Removed after the process is reaped ([`Vm`]'s own drop runs first).
    _sockets: SocketDir,
    /// The console writer thread; it ends once the process is gone.
    console: Option<std::thread::JoinHandle<()>>,
    accel: Accel,
    pub(crate) facts: VmFacts,
    /// Migration parameters have been set for fast saves.
    pub(crate) migration_tuned: bool,
    /// QEMU's own uid; given back after the process is reaped ([`Vm`]'s drop runs first).
    _uid: Option<super::uids::UidLease>,
}

impl Vm {
    /// Starts QEMU for `spec` and returns once QMP is connected (bounded wait). The guest
    /// is booting by then, not ready. On any failure the process is killed and reaped.
    ///
    /// Call this on the thread that supervises the VM: QEMU gets SIGKILL when that thread
    /// exits.
    pub fn spawn(spec: VmSpec) -> Result<Vm, VmError> {
        Vm::start(spec, Launch::cold())
    }

    /// Like [`Vm::spawn`], with the guest's RAM in `memory` (see [`MemoryFile`]). A
    /// template build boots this way with `shared: true`, so that its capture writes no
    /// RAM and clones map the file copy-on-write.
    pub fn spawn_with_memory_file(spec: VmSpec, memory: &MemoryFile) -> Result<Vm, VmError> {
        Vm::start(
            spec,
            Launch {
                memory: Some(memory),
                ..Launch::cold()
            },
        )
    }

    /// Like [`Vm::spawn`], but restores the state saved in `state_file` (QMP
    /// `migrate` to `file:`). The VM waits in "inmigrate" then "paused": wait for
    /// `paused`, then `cont`. `spec` must match the saved VM's devices. Prefer
    /// [`Vm::restore`], which takes everything from a [`super::CaptureRecord`].
    pub fn spawn_incoming(spec: VmSpec, state_file: &Path) -> Result<Vm, VmError> {
        if !state_file.is_file() {
            return Err(VmError::MissingAsset {
                what: "saved VM state",
                path: state_file.to_path_buf(),
            });
        }
        Vm::start(
            spec,
            Launch {
                incoming: Incoming::File(state_file),
                ..Launch::cold()
            },
        )
    }

    pub(crate) fn start(mut spec: VmSpec, launch: Launch<'_>) -> Result<Vm, VmError> {
        let binary = resolve_binary(&spec.host.qemu_binary)?;
        check_assets(&spec)?;
        let (credentials, uid) = qemu_credentials(spec.host.accel)?;
        let sockets = SocketDir::create()?;
        let paths = RunPaths::new(&spec.host.run_dir, &sockets.path);
        check_socket_paths(&paths)?;
        let cmdline = match launch.cmdline {
            Some(c) => c.to_owned(),
            None => kernel_cmdline(spec.host.accel, &spec.kernel_args)?,
        };
        let memory = match launch.memory {
            Some(m) => Some(MemoryFile {
                path: prepare_memory_file(m, spec.machine.memory_mb, &credentials)?,
                shared: m.shared,
            }),
            None => None,
        };
        let (host, kernel, initramfs) = move_boot_files_into_jail(&mut spec, memory.as_ref())?;
        let jailed_memory = memory.as_ref().map(|m| MemoryFile {
            path: Path::new(JAIL_VM_DIR).join("memory"),
            shared: m.shared,
        });
        let launch = Launch {
            cmdline: Some(&cmdline),
            memory: jailed_memory.as_ref(),
            ..launch
        };

        let mut passed = PassedFds::new();
        let (fds, node_count) = open_inherited(&spec, &paths, launch.incoming, &mut passed)?;
        let argv = build_argv(&spec, &fds, &launch)?;
        let jail = plan_jail(
            &sockets.path,
            &binary,
            spec.host.accel,
            &host,
            memory.as_ref(),
        )?;
        let started = Instant::now();
        let (child, console_out) = spawn_jailed(
            &binary,
            &argv,
            &paths,
            passed,
            ChildSetup {
                netns: spec.host.netns.as_ref().map(|f| f.as_raw_fd()),
                parent_death_signal: Some(libc::SIGKILL),
                fds: Vec::new(),
                jail: Some(jail),
                credentials: Some(credentials),
                dropped_capabilities: &[],
                // QEMU asks for huge pages for TCG's translation buffer: each guest then
                // holds its translations in 2 MiB steps (an idle guest's 5 MiB of code
                // held 10 MiB). Under KVM there is no such buffer, and huge pages may back
                // an anonymous guest RAM.
                no_huge_pages: matches!(spec.host.accel, Accel::Tcg { .. }),
            },
        )?;
        let pid = child.id();
        let mut guard = ChildGuard(Some(child));
        let console = super::console::spawn_writer(
            console_out,
            paths.console_log.clone(),
            super::console::CONSOLE_FILE_MAX,
        )
        .map_err(|e| VmError::io("cannot start the console writer thread", e))?;
        let qmp = connect_qmp(guard.0.as_mut().expect("set above"), &paths)?;
        let child = guard.0.take().expect("set above");
        log_spawn(pid, uid.as_ref(), &spec, &kernel, launch.incoming, started);
        let top = fds.disk.last().expect("a chain has a top");
        let facts = VmFacts {
            machine: MachineConfig {
                kernel,
                initramfs,
                ..spec.machine
            },
            kernel_cmdline: cmdline,
            disk: spec.disk,
            disk_node: top.name.clone(),
            disk_backing: top.backing.clone(),
            disk_nodes_added: node_count,
            tap: spec.host.tap,
            memory,
            run_dir: spec.host.run_dir,
            base_state: None,
        };
        Ok(Vm {
            child,
            exit: None,
            qmp,
            paths,
            _sockets: sockets,
            console: Some(console),
            accel: spec.host.accel,
            facts,
            migration_tuned: false,
            _uid: uid,
        })
    }

    /// Switches the guest's disk onto `next`, a new empty qcow2 layer whose backing name
    /// is the current top's file name (see [`disk::create_layer`]): the server opens it
    /// and hands QEMU the descriptors (`add-fd`, `blockdev-add`, `blockdev-snapshot`).
    /// From then on the previous top is never written again.
    pub(crate) fn switch_disk(&mut self, next: &Path) -> Result<(), VmError> {
        let open = |write: bool| {
            OpenOptions::new()
                .read(true)
                .write(write)
                .open(next)
                .map_err(|e| VmError::io(format!("cannot open {}", next.display()), e))
        };
        let (rw, ro) = (open(true)?, open(false)?);
        let name = format!("{LAYER_NODE_PREFIX}{}", self.facts.disk_nodes_added);
        let fdset = self.qmp.add_fd(rw.as_fd(), &name)?;
        self.qmp.add_fd_to(fdset, ro.as_fd(), &name)?;
        let node = qcow2_node(&name, fdset, true, Some(Value::Null));
        self.qmp.execute("blockdev-add", Some(node))?;
        self.facts.disk_nodes_added += 1;
        self.qmp.blockdev_snapshot(&self.facts.disk_node, &name)?;
        self.facts.disk = next.to_path_buf();
        self.facts.disk_backing = Some(std::mem::replace(&mut self.facts.disk_node, name));
        Ok(())
    }

    /// The block node name of the disk QEMU writes to now.
    pub(crate) fn disk_node(&self) -> &str {
        &self.facts.disk_node
    }

    /// The host end of the guest agent's virtio-serial port (a unix socket).
    pub fn agent_socket(&self) -> &Path {
        &self.paths.agent_socket
    }

    /// The guest's serial console output.
    pub fn console_log(&self) -> &Path {
        &self.paths.console_log
    }

    /// QEMU's own stdout/stderr.
    pub fn qemu_log(&self) -> &Path {
        &self.paths.qemu_log
    }

    /// The last `lines` lines of the console log.
    pub fn console_tail(&self, lines: usize) -> String {
        tail_lines(&self.paths.console_log, lines)
    }

    pub fn qmp(&mut self) -> &mut Qmp {
        &mut self.qmp
    }

    /// Whether QEMU stopped the guest on a disk error ([`DISK_ERROR_POLICY`]: the host's
    /// filesystem was full); `cont` retries the write that failed.
    pub fn paused_on_io_error(&mut self) -> Result<bool, VmError> {
        Ok(self.qmp.query_status()? == "io-error")
    }

    /// The guest has booted (its agent answered): stops what only the boot needed
    /// ([`stop_boot_timer`]).
    pub fn boot_finished(&mut self) -> Result<(), VmError> {
        stop_boot_timer(&mut self.qmp, self.accel)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// SIGKILL and reap. Also done on drop.
    pub fn kill(mut self) {
        self.reap();
    }

    /// The exit status once QEMU has exited (and is then reaped); `None` while it runs.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.exit.is_none() {
            match self.child.try_wait() {
                Ok(status) => self.exit = status,
                Err(e) => log::warn!("vm op=try_wait pid={} error={e}", self.child.id()),
            }
        }
        self.exit
    }

    /// Waits up to `timeout` for QEMU to exit by itself (after `quit`, or a guest power
    /// off); `None` if it still runs.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let mut interval = Duration::from_millis(1);
        loop {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(interval);
            interval = (interval * 2).min(Duration::from_millis(20));
        }
    }

    fn reap(&mut self) {
        if self.exit.is_none() {
            match kill_and_reap(&mut self.child) {
                Ok(status) => {
                    log::debug!("vm op=kill pid={} status={status}", self.child.id());
                    self.exit = Some(status);
                }
                Err(e) => log::warn!("vm op=kill pid={} error={e}", self.child.id()),
            }
        }
        // With QEMU gone the pipe ends, and the console log is complete.
        if self.exit.is_some() {
            if let Some(console) = self.console.take() {
                let _ = console.join();
            }
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.reap();
    }
}

/// Waits for QEMU to open its QMP socket, then negotiates. Fails fast if QEMU exits.
fn connect_qmp(child: &mut Child, paths: &RunPaths) -> Result<Qmp, VmError> {
    let deadline = Instant::now() + QMP_CONNECT_TIMEOUT;
    let mut interval = Duration::from_millis(1);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(VmError::QemuExited {
                status,
                log_tail: tail_lines(&paths.qemu_log, 20),
            });
        }
        match std::os::unix::net::UnixStream::connect(&paths.qmp_socket) {
            Ok(stream) => {
                return Qmp::handshake(stream, qmp::DEFAULT_TIMEOUT).map_err(|e| {
                    // QEMU opens its sockets before loading the kernel: a handshake cut short
                    // usually means it exited, and its output says why.
                    let exited = Instant::now() + Duration::from_secs(1);
                    while Instant::now() < exited {
                        if let Ok(Some(status)) = child.try_wait() {
                            return VmError::QemuExited {
                                status,
                                log_tail: tail_lines(&paths.qemu_log, 20),
                            };
                        }
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    e
                });
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) => {}
            Err(source) => {
                return Err(VmError::QmpIo {
                    command: format!("connect {}", paths.qmp_socket.display()),
                    source,
                })
            }
        }
        if Instant::now() >= deadline {
            return Err(VmError::Timeout {
                what: format!("QEMU to open {}", paths.qmp_socket.display()),
                after_ms: QMP_CONNECT_TIMEOUT.as_millis() as u64,
            });
        }
        std::thread::sleep(interval);
        interval = (interval * 2).min(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(accel: Accel) -> VmSpec {
        VmSpec {
            host: HostPlumbing {
                run_dir: "/run/agentenv/sb1".into(),
                netns: None,
                tap: Some(GUEST_TAP.into()),
                accel,
                qemu_binary: "qemu-system-x86_64".into(),
            },
            machine: MachineConfig {
                kernel: "/assets/vmlinux".into(),
                initramfs: "/assets/initramfs.img".into(),
                cpu_count: 2,
                memory_mb: 512,
            },
            kernel_args: vec!["agentenv.port=49983".into(), "init=/init".into()],
            disk: "/disks/a,b.qcow2".into(),
        }
    }

    /// A chain of a raw base and two layers, numbered as [`pass_disk`] would.
    fn fds() -> Inherited {
        let node = |name: &str, fds: Vec<RawFd>, qcow2, writable, backing: Option<&str>| DiskNode {
            name: name.into(),
            fds,
            qcow2,
            writable,
            backing: backing.map(str::to_owned),
        };
        Inherited {
            qmp: 4,
            agent: 5,
            tap: Some(6),
            disk: vec![
                node("base", vec![7], false, false, None),
                node("layer0", vec![8], true, false, Some("base")),
                node("layer1", vec![9, 10], true, true, Some("layer0")),
            ],
            incoming: Some(11),
        }
    }

    fn launch(incoming: Option<&Path>) -> Launch<'_> {
        Launch {
            incoming: incoming.map_or(Incoming::None, Incoming::File),
            ..Launch::cold()
        }
    }

    fn argv(spec: &VmSpec, incoming: Option<&Path>) -> Vec<String> {
        build_argv(spec, &fds(), &launch(incoming))
            .unwrap()
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    /// The value following `flag` (the first occurrence).
    fn value<'a>(argv: &'a [String], flag: &str) -> &'a str {
        let i = argv.iter().position(|a| a == flag).expect(flag);
        &argv[i + 1]
    }

    fn values<'a>(argv: &'a [String], flag: &str) -> Vec<&'a str> {
        argv.windows(2)
            .filter(|w| w[0] == flag)
            .map(|w| w[1].as_str())
            .collect()
    }

    #[test]
    fn tcg_flags() {
        let a = argv(&spec(Accel::Tcg { tsc_khz: 2_596_144 }), None);
        assert_eq!(
            value(&a, "-M"),
            "microvm,acpi=on,auto-kernel-cmdline=off,memory-backend=ram,pit=on,pic=off"
        );
        assert_eq!(value(&a, "-accel"), "tcg,tb-size=32");
        assert_eq!(value(&a, "-cpu"), "max");
        assert_eq!(
            value(&a, "-append"),
            "console=ttyS0 reboot=t panic=-1 nowatchdog sysctl.vm.compaction_proactiveness=0 tsc_early_khz=2596144 tsc=reliable agentenv.port=49983 init=/init"
        );
    }

    #[test]
    fn kvm_flags() {
        let a = argv(&spec(Accel::Kvm), None);
        assert_eq!(
            value(&a, "-M"),
            "microvm,acpi=on,auto-kernel-cmdline=off,memory-backend=ram"
        );
        assert_eq!(value(&a, "-accel"), "kvm");
        assert_eq!(value(&a, "-cpu"), "host");
        assert_eq!(
            value(&a, "-append"),
            "console=ttyS0 reboot=t panic=-1 nowatchdog sysctl.vm.compaction_proactiveness=0 agentenv.port=49983 init=/init"
        );
        assert!(!a
            .iter()
            .any(|x| x.contains("tsc_early_khz") || x.contains("pit=")));
    }

    #[test]
    fn devices_and_sockets() {
        let a = argv(&spec(Accel::Kvm), None);
        for flag in ["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"] {
            assert!(a.iter().any(|x| x == flag), "{flag}");
        }
        assert_eq!(
            value(&a, "-name"),
            "guest=/run/agentenv/sb1,debug-threads=on"
        );
        assert_eq!(value(&a, "-smp"), "2");
        assert_eq!(value(&a, "-m"), "512M");
        assert_eq!(value(&a, "-object"), "memory-backend-ram,id=ram,size=512M");
        assert_eq!(value(&a, "-kernel"), "/assets/vmlinux");
        assert_eq!(value(&a, "-initrd"), "/assets/initramfs.img");
        assert_eq!(
            value(&a, "-sandbox"),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
        );
        assert_eq!(
            values(&a, "-blockdev"),
            [
                r#"{"driver":"file","filename":"/dev/fdset/7","node-name":"base","read-only":true}"#,
                r#"{"backing":"base","driver":"qcow2","file":{"driver":"file","filename":"/dev/fdset/8","read-only":true},"node-name":"layer0","read-only":true}"#,
                r#"{"backing":"layer0","discard":"unmap","driver":"qcow2","file":{"discard":"unmap","driver":"file","filename":"/dev/fdset/9","read-only":false},"node-name":"layer1","read-only":false}"#,
            ]
        );
        assert_eq!(
            values(&a, "-add-fd"),
            [
                "fd=3,set=3,opaque=console",
                "fd=7,set=7,opaque=base",
                "fd=8,set=8,opaque=layer0",
                "fd=9,set=9,opaque=layer1",
                "fd=10,set=9,opaque=layer1",
            ]
        );
        assert_eq!(value(&a, "-netdev"), "tap,id=net0,fd=6");
        assert_eq!(
            values(&a, "-device"),
            [
                "virtio-blk-device,drive=layer1,werror=enospc,rerror=report",
                "virtio-net-device,netdev=net0,mac=06:00:a9:fe:00:15",
                "virtio-serial-device",
                "virtserialport,chardev=agent,name=agentenv",
            ]
        );
        assert_eq!(
            values(&a, "-chardev"),
            [
                "file,id=console,path=/dev/fdset/3,append=on",
                "socket,id=agent,fd=5,server=on,wait=off",
                "socket,id=qmp,fd=4,server=on,wait=off",
            ]
        );
        assert_eq!(value(&a, "-serial"), "chardev:console");
        assert_eq!(value(&a, "-mon"), "chardev=qmp,mode=control");
        assert!(!a.iter().any(|x| x == "-incoming"));
    }

    #[test]
    fn no_nic_and_incoming() {
        let mut s = spec(Accel::Kvm);
        s.host.tap = None;
        let a = argv(&s, Some(Path::new("/state/mem.bin")));
        assert!(!a.iter().any(|x| x == "-netdev" || x.contains("virtio-net")));
        assert_eq!(value(&a, "-incoming"), "file:/dev/fdset/11");
        assert!(a.iter().any(|x| x == "fd=11,set=11,opaque=incoming"));
    }

    #[test]
    fn a_held_boot_starts_with_its_vcpus_stopped_and_no_state() {
        let held = Launch {
            cmdline: Some("console=ttyS0 recorded"),
            incoming: Incoming::Held,
            ..Launch::cold()
        };
        let a: Vec<String> = build_argv(&spec(Accel::Kvm), &fds(), &held)
            .unwrap()
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert!(a.iter().any(|x| x == "-S"), "{a:?}");
        assert!(!a.iter().any(|x| x == "-incoming"), "{a:?}");
        assert_eq!(value(&a, "-append"), "console=ttyS0 recorded");
    }

    #[test]
    fn bad_specs_are_refused() {
        let paths = fds();
        let mut s = spec(Accel::Kvm);
        s.kernel_args.push("bad\narg".into());
        assert!(build_argv(&s, &paths, &launch(None)).is_err());
        let mut s = spec(Accel::Kvm);
        s.kernel_args.push("x".repeat(MAX_CMDLINE));
        let e = build_argv(&s, &paths, &launch(None)).unwrap_err();
        assert!(e.to_string().contains("kernel command line"), "{e}");
        let mut s = spec(Accel::Kvm);
        s.host.tap = Some("tap0,script=/bin/evil".into());
        assert!(build_argv(&s, &paths, &launch(None)).is_err());
        let mut s = spec(Accel::Kvm);
        s.machine.cpu_count = 0;
        assert!(build_argv(&s, &paths, &launch(None)).is_err());
    }

    #[test]
    fn missing_binary_is_actionable() {
        let e = resolve_binary(Path::new("no-such-qemu-binary")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "no-such-qemu-binary not found: run scripts/setup.sh (or set vm.qemu_binary)"
        );
        assert!(resolve_binary(Path::new("/nonexistent/qemu")).is_err());
        assert!(resolve_binary(Path::new("sh")).is_ok());
    }

    #[test]
    fn prefers_vmlinux() {
        let dir = std::env::temp_dir().join(format!("agentenv-kern-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(guest_kernel(&dir), dir.join("vmlinuz"));
        std::fs::write(dir.join("vmlinux"), b"").unwrap();
        assert_eq!(guest_kernel(&dir), dir.join("vmlinux"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
