//! The state dir's filesystem as the operations see it (operations.md §10.2): the
//! `[server] disk_reserve_mb` check that refuses creates, resumes, snapshots and builds up
//! front (507), and the classification that turns a write that failed because the disk is
//! full into a 507 naming the state dir and the bytes needed. Runs on the calling API
//! thread, before and after the operation; it holds no lock. Supervisors use it too, for
//! a guest that QEMU paused because its disk write found the state dir full
//! (operations.md §10.3): the message its calls answer with, whether there is room to
//! continue it, and the counts `/metrics` shows.

use super::error::OrchError;
use super::sandbox::IoErrorPause;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What an operation is about to write on the state dir, for the reserve and the 507.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DiskUse {
    /// A cold create, a create from a snapshot, a fork: a disk overlay, records, a
    /// journal entry, the console log.
    Create,
    /// A resume: the overlay grows again, records, a journal entry.
    Resume,
    /// A snapshot: the guest's memory and a frozen disk layer.
    Snapshot { memory_mb: u32 },
    /// A template build: an image unpack, a build VM, its capture.
    Build,
    /// A pause: the guest's memory (at most its size), the record.
    Pause { memory_mb: u32 },
    /// A record or journal write of an operation that only changes settings.
    Record,
}

/// The least an operation that writes a disk overlay or an image is taken to need.
const MIN_NEED: u64 = 64 << 20;

/// Free bytes a guest paused on a full state disk waits for before it is continued: a
/// write that found no room then lands, and the next one that finds none pauses it again.
pub(crate) const GUEST_CONTINUE_FREE: u64 = MIN_NEED;

impl DiskUse {
    /// Refused up front when free space is below the reserve; pauses (which free memory
    /// and keep a guest's state) and record writes go on.
    fn keeps_reserve(self) -> bool {
        matches!(
            self,
            DiskUse::Create | DiskUse::Resume | DiskUse::Snapshot { .. } | DiskUse::Build
        )
    }

    /// About how many bytes the operation writes on the state dir at most.
    pub fn needs(self) -> u64 {
        match self {
            DiskUse::Create | DiskUse::Resume | DiskUse::Build => MIN_NEED,
            DiskUse::Snapshot { memory_mb } | DiskUse::Pause { memory_mb } => {
                (u64::from(memory_mb) << 20).max(MIN_NEED)
            }
            DiskUse::Record => 1 << 20,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DiskUse::Create => "create",
            DiskUse::Resume => "resume",
            DiskUse::Snapshot { .. } => "snapshot",
            DiskUse::Build => "template build",
            DiskUse::Pause { .. } => "pause",
            DiskUse::Record => "record write",
        }
    }
}

/// Reads (total, free) bytes of the filesystem holding a path.
pub(crate) type SpaceProbe = fn(&Path) -> Option<(u64, u64)>;

/// The real probe: `statvfs(3)` (free = what an unprivileged writer may still use).
pub(crate) fn statvfs_probe(path: &Path) -> Option<(u64, u64)> {
    crate::sys::guest::filesystem_space(path).ok()
}

/// The state dir's filesystem and its reserve.
pub(crate) struct StateDisk {
    dir: PathBuf,
    reserve: u64,
    probe: SpaceProbe,
    /// Guests paused on a full state disk: ever, and now.
    io_pauses: AtomicU64,
    io_paused: AtomicU64,
}

impl StateDisk {
    pub fn new(dir: PathBuf, reserve_mb: u64, probe: SpaceProbe) -> StateDisk {
        StateDisk {
            dir,
            reserve: reserve_mb << 20,
            probe,
            io_pauses: AtomicU64::new(0),
            io_paused: AtomicU64::new(0),
        }
    }

    /// Whether a guest paused on a full state disk may continue: [`GUEST_CONTINUE_FREE`]
    /// bytes are free (or the state dir cannot be measured: QEMU pauses it again if not).
    pub fn room_for_guest(&self) -> bool {
        self.space()
            .is_none_or(|(_, free)| free >= GUEST_CONTINUE_FREE)
    }

    /// What a start answers when QEMU paused its booting guest on a write the full state
    /// disk refused (the VM is torn down, nothing of the start is kept).
    pub fn guest_booting_on_full_disk(&self) -> String {
        let free = self
            .space()
            .map_or("an unknown number of".into(), |(_, f)| f.to_string());
        format!(
            "the guest paused on an I/O error while it booted: a write to its disk found the \
             state dir {} full ({free} bytes free now); nothing was started, free space there \
             (delete sandboxes, snapshots or other files) and retry",
            self.dir.display()
        )
    }

    /// Counts guest `id` as paused on a full state disk; what its calls answer with.
    pub fn guest_paused(&self, id: &str) -> IoErrorPause {
        self.io_pauses.fetch_add(1, Ordering::Relaxed);
        self.io_paused.fetch_add(1, Ordering::Relaxed);
        let since = std::time::SystemTime::now();
        let free = self
            .space()
            .map_or("an unknown number of".into(), |(_, f)| f.to_string());
        IoErrorPause {
            since,
            message: format!(
                "sandbox {id} is paused on an I/O error since {}: a write to its disk found the \
                 state dir {} full ({free} bytes free); it continues by itself once {} bytes \
                 are free there, so free space there (delete sandboxes, snapshots or other \
                 files); until then its commands, files and envd answer 507",
                crate::util::rfc3339(since),
                self.dir.display(),
                GUEST_CONTINUE_FREE
            ),
        }
    }

    /// A guest paused on a full state disk runs again, or is gone.
    pub fn guest_continued(&self) {
        self.io_paused.fetch_sub(1, Ordering::Relaxed);
    }

    /// (total, free) bytes now; `None` when the state dir cannot be measured.
    pub fn space(&self) -> Option<(u64, u64)> {
        (self.probe)(&self.dir)
    }

    /// 507 when `op` keeps the reserve and free space is below it.
    pub fn check(&self, op: DiskUse) -> Result<(), OrchError> {
        if !op.keeps_reserve() || self.reserve == 0 {
            return Ok(());
        }
        let Some((_, free)) = self.space() else {
            return Ok(());
        };
        if free >= self.reserve {
            return Ok(());
        }
        Err(OrchError::InsufficientStorage(format!(
            "not enough free space for a {}: the state dir {} has {free} bytes free, below the \
             reserve of {} bytes ([server] disk_reserve_mb); it needs {} more bytes free; free \
             space there (delete sandboxes or snapshots) and retry",
            op.name(),
            self.dir.display(),
            self.reserve,
            self.reserve - free
        )))
    }

    /// `agentenv_state_disk_bytes{state}`: the state dir's filesystem size, its free space
    /// and the reserve (api.md §4.19).
    pub fn render_metrics(&self, out: &mut String) {
        let (total, free) = self.space().unwrap_or((0, 0));
        super::metrics::render_state_gauge(
            out,
            "agentenv_state_disk_bytes",
            "The state dir's filesystem: its size, free space and the disk_reserve_mb reserve.",
            &[("total", total), ("free", free), ("reserve", self.reserve)],
        );
        let pauses = self.io_pauses.load(Ordering::Relaxed);
        let paused = self.io_paused.load(Ordering::Relaxed);
        out.push_str(
            "# HELP agentenv_vm_io_error_pauses_total Guests QEMU paused because a disk write found the state dir full.\n\
             # TYPE agentenv_vm_io_error_pauses_total counter\n",
        );
        out.push_str(&format!("agentenv_vm_io_error_pauses_total {pauses}\n"));
        out.push_str(
            "# HELP agentenv_vms_paused_on_io_error Guests paused on a full state disk now, waiting for space.\n\
             # TYPE agentenv_vms_paused_on_io_error gauge\n",
        );
        out.push_str(&format!("agentenv_vms_paused_on_io_error {paused}\n"));
    }

    /// `result`, with a failure caused by a full state disk turned into a 507: one whose
    /// message says so (ENOSPC, EDQUOT), or a 500/502 while less than `op` needs is free
    /// (QEMU reports a full disk as an I/O error).
    pub fn classify<T>(&self, op: DiskUse, result: Result<T, OrchError>) -> Result<T, OrchError> {
        result.map_err(|e| self.classify_error(op, e))
    }

    /// [`StateDisk::classify`] of a failure.
    pub fn classify_error(&self, op: DiskUse, e: OrchError) -> OrchError {
        let says_full = says_disk_full(&e.message());
        let is_5xx = matches!(e.status(), 500 | 502 | 503);
        if !is_5xx {
            return e;
        }
        let free = self.space().map(|(_, free)| free);
        let short = matches!(e.status(), 500 | 502) && free.is_some_and(|f| f < op.needs());
        if !says_full && !short {
            return e;
        }
        let free = free.map_or("an unknown number of".to_string(), |f| f.to_string());
        OrchError::InsufficientStorage(format!(
            "the state dir {} is full: the {} needed about {} bytes and {free} bytes are \
             free; nothing was changed, free space there and retry ({})",
            self.dir.display(),
            op.name(),
            op.needs(),
            e.message()
        ))
    }
}

/// Whether an error text names a full disk or quota.
pub(crate) fn says_disk_full(message: &str) -> bool {
    message.contains("No space left on device") || message.contains("Disk quota exceeded")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(reserve_mb: u64, probe: SpaceProbe) -> StateDisk {
        StateDisk::new(PathBuf::from("/state"), reserve_mb, probe)
    }

    #[test]
    fn below_the_reserve_only_writers_of_new_state_are_refused() {
        let d = disk(100, |_| Some((1 << 30, 50 << 20)));
        for op in [DiskUse::Create, DiskUse::Resume, DiskUse::Build] {
            let e = d.check(op).unwrap_err();
            let m = e.message();
            assert!(matches!(e, OrchError::InsufficientStorage(_)), "{e:?}");
            assert!(
                m.contains("/state") && m.contains("52428800 more bytes"),
                "{m}"
            );
        }
        assert!(d.check(DiskUse::Snapshot { memory_mb: 256 }).is_err());
        assert!(d.check(DiskUse::Pause { memory_mb: 256 }).is_ok());
        assert!(d.check(DiskUse::Record).is_ok());
        assert!(disk(0, |_| Some((1, 0))).check(DiskUse::Create).is_ok());
        assert!(disk(40, |_| Some((1 << 30, 50 << 20)))
            .check(DiskUse::Create)
            .is_ok());
    }

    #[test]
    fn a_guest_paused_on_a_full_disk_is_counted_until_it_continues() {
        let full = disk(0, |_| Some((1 << 30, 4096)));
        assert!(!full.room_for_guest());
        assert!(disk(0, |_| Some((1 << 30, GUEST_CONTINUE_FREE))).room_for_guest());
        let pause = full.guest_paused("sbx");
        let m = &pause.message;
        assert!(
            m.contains("sandbox sbx") && m.contains("/state") && m.contains("4096 bytes free"),
            "{m}"
        );
        assert!(m.contains(&GUEST_CONTINUE_FREE.to_string()), "{m}");
        let mut out = String::new();
        full.render_metrics(&mut out);
        assert!(
            out.contains("agentenv_vm_io_error_pauses_total 1\n"),
            "{out}"
        );
        assert!(out.contains("agentenv_vms_paused_on_io_error 1\n"), "{out}");
        full.guest_continued();
        let mut out = String::new();
        full.render_metrics(&mut out);
        assert!(
            out.contains("agentenv_vm_io_error_pauses_total 1\n"),
            "{out}"
        );
        assert!(out.contains("agentenv_vms_paused_on_io_error 0\n"), "{out}");
    }

    #[test]
    fn a_failure_on_a_full_disk_becomes_507() {
        let full = disk(0, |_| Some((1 << 30, 4096)));
        let op = DiskUse::Pause { memory_mb: 256 };
        let e = full
            .classify::<()>(op, Err(OrchError::Internal("ram_save_setup failed".into())))
            .unwrap_err();
        assert!(matches!(e, OrchError::InsufficientStorage(_)), "{e:?}");
        let m = e.message();
        assert!(m.contains("/state") && m.contains("268435456 bytes"), "{m}");
        assert!(m.contains("ram_save_setup failed"), "{m}");
        // Errors of the caller, and an out-of-slots 503, stay what they are.
        let e = full
            .classify::<()>(op, Err(OrchError::Conflict("paused".into())))
            .unwrap_err();
        assert!(matches!(e, OrchError::Conflict(_)));
        let e = full
            .classify::<()>(op, Err(OrchError::Unavailable("no free slot".into())))
            .unwrap_err();
        assert!(matches!(e, OrchError::Unavailable(_)));
        // With room to spare only a message naming ENOSPC counts.
        let roomy = disk(0, |_| Some((1 << 40, 1 << 39)));
        let e = roomy
            .classify::<()>(op, Err(OrchError::Internal("qemu crashed".into())))
            .unwrap_err();
        assert!(matches!(e, OrchError::Internal(_)));
        let e = roomy
            .classify::<()>(
                DiskUse::Record,
                Err(OrchError::Internal(
                    "hook journal: cannot write x: No space left on device (os error 28)".into(),
                )),
            )
            .unwrap_err();
        assert!(matches!(e, OrchError::InsufficientStorage(_)), "{e:?}");
    }
}
