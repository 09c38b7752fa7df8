//! One VM, described once: what the guest is ([`MachineConfig`], the same for its first
//! boot, every capture and every restore, stored in each [`super::CaptureRecord`]) and how
//! one QEMU process of it is wired to this host ([`HostPlumbing`], never stored: a
//! restore gets plumbing of its own).

use super::Accel;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::path::PathBuf;

/// What the guest is: its boot files and its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineConfig {
    /// Guest kernel: a bzImage or a PVH `vmlinux` (see [`super::guest_kernel`]).
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub cpu_count: u32,
    pub memory_mb: u32,
}

/// Where one QEMU process of a VM runs on this host.
#[derive(Debug)]
pub struct HostPlumbing {
    /// Per-VM directory: console.log, qemu.log. Created if missing. (The sockets live in
    /// a socket dir of their own.)
    pub run_dir: PathBuf,
    /// The slot's network namespace; QEMU enters it before exec. `None`: the host's.
    pub netns: Option<File>,
    /// Tap device (inside `netns`) backing the guest NIC, normally
    /// [`super::qemu::GUEST_TAP`]. `None`: the guest has no NIC.
    pub tap: Option<String>,
    pub accel: Accel,
    /// Absolute, or looked up in PATH.
    pub qemu_binary: PathBuf,
}

impl HostPlumbing {
    /// A VM without a NIC in the server's own network namespace, with `qemu-system-x86_64`
    /// from PATH (tests and benches of the VM layer).
    pub fn local(run_dir: PathBuf, accel: Accel) -> HostPlumbing {
        HostPlumbing {
            run_dir,
            netns: None,
            tap: None,
            accel,
            qemu_binary: "qemu-system-x86_64".into(),
        }
    }
}
