//! The QEMU side of a sandbox: one `qemu-system-x86_64 -M microvm` process per sandbox,
//! run in the foreground by its supervisor thread, inside the slot's network namespace,
//! and driven through QMP.
//!
//! - [`accel`]: KVM or TCG, detected once per host.
//! - [`qemu`]: the argv and the process ([`Vm`]).
//! - [`qmp`]: the QMP client (stop, cont, status, migrate to a file, quit).
//! - [`disk`]: qcow2 overlays over a raw base image, disk chains, clone disks.
//! - [`capture`]: capture (pause, snapshot) and restore (resume, clone), with the record
//!   the orchestrator stores.
//! - [`dirty`]: dirty-only pause and resume of template clones (only the pages changed
//!   since the template are written and read back).
//! - [`console`]: the tail of a guest's console log, for error reports.
//! - [`exit`]: how a QEMU process ended ([`VmExit`]).
//! - `uids`: a uid of its own for each QEMU process.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;

pub mod accel;
pub mod capture;
pub mod console;
pub mod dirty;
pub mod disk;
pub mod exit;
pub mod machine;
pub mod qemu;
pub mod qmp;
mod uids;

#[cfg(test)]
mod boot_tests;
#[cfg(test)]
mod capture_tests;

/// How a VM process is scheduled (a pause's frozen window, a standby's warm-up).
pub use crate::sys::process::Priority;

/// The result of a scoped helper thread of a VM operation; its panic is an error of the
/// operation (`what` names the thread's job).
fn joined<T>(
    handle: std::thread::ScopedJoinHandle<'_, Result<T, VmError>>,
    what: &str,
) -> Result<T, VmError> {
    handle.join().unwrap_or_else(|_| {
        Err(VmError::io(
            format!("the {what} thread of a VM operation failed"),
            io::Error::other("it panicked"),
        ))
    })
}
pub use accel::{detect_accel, Accel};
pub use capture::{
    sync_guest_clock, CaptureRecord, CaptureStats, DiskCapture, RestoreSpec, RestoreStats,
};
pub use console::tail_lines;
pub use disk::{
    create_clone_disk, create_layer, create_overlay, disk_chain, next_layer_path, MAX_CHAIN_LAYERS,
};
pub use exit::VmExit;
pub use machine::{HostPlumbing, MachineConfig};
pub use qemu::{guest_kernel, kernel_cmdline, stop_boot_timer, MemoryFile, Vm, VmSpec, GUEST_MAC};
pub use qmp::Qmp;

/// Everything that can go wrong starting or driving a VM.
#[derive(Debug)]
pub enum VmError {
    /// The QEMU (or qemu-img) binary is not installed or not in PATH.
    BinaryNotFound { binary: PathBuf },
    /// A boot asset (kernel, initramfs, disk) is missing.
    MissingAsset { what: &'static str, path: PathBuf },
    /// KVM was requested but cannot be used on this host.
    KvmUnavailable { reason: String },
    /// The spec cannot be turned into a QEMU command line.
    InvalidSpec(String),
    /// A host file operation failed.
    Io { op: String, source: io::Error },
    /// Starting the QEMU process failed.
    Spawn { binary: PathBuf, source: io::Error },
    /// QEMU exited before it was ready (or while a command ran).
    QemuExited {
        status: ExitStatus,
        log_tail: String,
    },
    /// Something did not happen in time.
    Timeout { what: String, after_ms: u64 },
    /// The QMP socket failed or closed.
    QmpIo { command: String, source: io::Error },
    /// QEMU answered a QMP command with an error, or with something unexpected.
    Qmp { command: String, message: String },
    /// A migration (save to file) ended in a state other than `completed`.
    Migration { status: String, message: String },
    /// `qemu-img` failed.
    QemuImg { status: ExitStatus, stderr: String },
}

impl fmt::Display for VmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VmError::BinaryNotFound { binary } => write!(
                f,
                "{} not found: run scripts/setup.sh (or set vm.qemu_binary)",
                binary.display()
            ),
            VmError::MissingAsset { what, path } => write!(
                f,
                "{what} {} does not exist: run scripts/setup.sh (or check vm.assets_dir)",
                path.display()
            ),
            VmError::KvmUnavailable { reason } => write!(
                f,
                "vm.accel = \"kvm\" but KVM is unusable: {reason}; set vm.accel = \"auto\" or \"tcg\""
            ),
            VmError::InvalidSpec(m) => write!(f, "invalid VM spec: {m}"),
            VmError::Io { op, source } => write!(f, "{op}: {source}"),
            VmError::Spawn { binary, source } => {
                write!(f, "cannot start {}: {source}", binary.display())
            }
            VmError::QemuExited { status, log_tail } => {
                write!(f, "qemu exited early ({status})")?;
                if !log_tail.is_empty() {
                    write!(f, "; its output ends with:\n{log_tail}")?;
                }
                Ok(())
            }
            VmError::Timeout { what, after_ms } => {
                write!(f, "timed out after {after_ms} ms waiting for {what}")
            }
            VmError::QmpIo { command, source } => {
                write!(f, "QMP connection failed during {command}: {source}")
            }
            VmError::Qmp { command, message } => write!(f, "QMP {command} failed: {message}"),
            VmError::Migration { status, message } => {
                write!(f, "saving the VM state failed (migration {status}): {message}")
            }
            VmError::QemuImg { status, stderr } => {
                write!(f, "qemu-img failed ({status}): {}", stderr.trim())
            }
        }
    }
}

impl std::error::Error for VmError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            VmError::Io { source, .. }
            | VmError::Spawn { source, .. }
            | VmError::QmpIo { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl VmError {
    pub(crate) fn io(op: impl Into<String>, source: io::Error) -> VmError {
        VmError::Io {
            op: op.into(),
            source,
        }
    }
}
