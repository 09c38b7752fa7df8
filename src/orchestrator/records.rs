//! Durable sandbox records: `<state_dir>/sandboxes/<id>/record.json`, written atomically
//! (temp file, fsync, rename, fsync dir) on create, PATCH, pause and resume. After a
//! restart, paused sandboxes come back from their records; sandboxes that were running
//! when the server stopped are gone (their memory died with the VM) and are cleaned up.

use super::sandbox::{SandboxInfo, SandboxState};
use super::OrchError;
use crate::vm::CaptureRecord;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub(crate) const RECORD_FILE: &str = "record.json";
/// Where a paused sandbox's capture lives inside its directory.
pub(crate) const PAUSED_DIR: &str = "paused";
/// The on-disk format of sandbox and snapshot records. 1: absolute paths, no `schema`
/// field (read as written). 2: paths inside the state dir stored relative to it.
pub(crate) const RECORD_SCHEMA: u32 = 2;

#[derive(Debug, Clone)]
pub(crate) struct SandboxRecord {
    pub info: SandboxInfo,
    /// The committed capture of a paused sandbox (absolute paths in memory).
    pub paused: Option<CaptureRecord>,
}

/// A sandbox record as stored.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct StoredRecord {
    /// Absent in records written before schema versions (version 1).
    #[serde(default = "schema_v1")]
    schema: u32,
    info: SandboxInfo,
    paused: Option<CaptureRecord>,
}

pub(crate) fn schema_v1() -> u32 {
    1
}

/// The state dir of a sandbox or snapshot directory (`<state_dir>/<kind>/<id>`).
pub(crate) fn state_dir_of(dir: &Path) -> &Path {
    dir.parent()
        .and_then(Path::parent)
        .unwrap_or(Path::new("/"))
}

/// The capture with every path under `state_dir` made relative to it, so the state dir
/// can move.
pub(crate) fn relative_capture(capture: &CaptureRecord, state_dir: &Path) -> CaptureRecord {
    capture.map_paths(|p| p.strip_prefix(state_dir).unwrap_or(p).to_path_buf())
}

/// The capture with relative paths resolved against `state_dir` (absolute ones, from
/// schema 1 records, are kept).
pub(crate) fn absolute_capture(capture: &CaptureRecord, state_dir: &Path) -> CaptureRecord {
    capture.map_paths(|p| {
        if p.is_relative() && !p.as_os_str().is_empty() {
            state_dir.join(p)
        } else {
            p.to_path_buf()
        }
    })
}

pub(crate) fn save(dir: &Path, record: &SandboxRecord) -> Result<(), OrchError> {
    let state_dir = state_dir_of(dir);
    let stored = StoredRecord {
        schema: RECORD_SCHEMA,
        info: record.info.clone(),
        paused: record
            .paused
            .as_ref()
            .map(|c| relative_capture(c, state_dir)),
    };
    Ok(crate::store::write_json(&dir.join(RECORD_FILE), &stored)?)
}

/// What startup found in the sandboxes directory.
pub(crate) struct Loaded {
    /// Paused sandboxes with a complete capture.
    pub paused: Vec<(PathBuf, SandboxRecord)>,
    /// Directories of sandboxes that cannot come back: running when the server stopped
    /// (their memory is gone), or never committed (no record: a create interrupted
    /// before its record was written).
    pub stale: Vec<PathBuf>,
}

/// Reads every sandbox record. Unreadable records, records of a newer schema and paused
/// records whose capture files are missing are moved to `<state_dir>/quarantine/`, never
/// removed.
pub(crate) fn load_all(sandboxes_dir: &Path) -> Loaded {
    let mut loaded = Loaded {
        paused: Vec::new(),
        stale: Vec::new(),
    };
    let Ok(entries) = std::fs::read_dir(sandboxes_dir) else {
        return loaded;
    };
    let state_dir = sandboxes_dir.parent().unwrap_or(Path::new("/"));
    for entry in entries.flatten() {
        let dir = entry.path();
        if !dir.join(RECORD_FILE).exists() && dir.is_dir() {
            log::warn!(
                "op=recover dir={} result=removed reason=\"no record: its create never finished\"",
                dir.display()
            );
            loaded.stale.push(dir);
            continue;
        }
        let why = match read(&dir) {
            Ok(record)
                if record.info.state() != SandboxState::Paused
                    && dir
                        .join(PAUSED_DIR)
                        .join(crate::vm::capture::STATE_FILE)
                        .is_file() =>
            {
                format!(
                    "it was {} in its record, but holds a capture whose pause was never \
                     committed",
                    record.info.state().name()
                )
            }
            Ok(record) if record.info.state() != SandboxState::Paused => {
                log::error!(
                    "sandboxId={} op=recover result=lost reason=\"it was {} when the server stopped; its memory is gone\"",
                    record.info.id,
                    record.info.state().name()
                );
                loaded.stale.push(dir);
                continue;
            }
            Ok(record) => match missing_files(&record) {
                None => {
                    loaded.paused.push((dir, record));
                    continue;
                }
                Some(missing) => format!("its capture file {} is missing", missing.display()),
            },
            Err(e) => e,
        };
        crate::store::quarantine(state_dir, &dir, &why);
    }
    loaded
}

/// The record in `dir`, paths made absolute.
pub(crate) fn read(dir: &Path) -> Result<SandboxRecord, String> {
    let text = std::fs::read(dir.join(RECORD_FILE)).map_err(|e| format!("no record: {e}"))?;
    let stored: StoredRecord =
        serde_json::from_slice(&text).map_err(|e| format!("unreadable record: {e}"))?;
    if stored.schema > RECORD_SCHEMA {
        return Err(format!(
            "record schema {} is newer than this agentenv's {RECORD_SCHEMA}",
            stored.schema
        ));
    }
    let state_dir = state_dir_of(dir);
    Ok(SandboxRecord {
        info: stored.info,
        paused: stored.paused.map(|c| absolute_capture(&c, state_dir)),
    })
}

/// The first capture file a paused record needs that is not there.
fn missing_files(record: &SandboxRecord) -> Option<PathBuf> {
    let Some(c) = &record.paused else {
        return Some(PathBuf::from(PAUSED_DIR));
    };
    c.capture_files()
        .into_iter()
        .map(|(_, path)| path)
        .chain([c.disk.as_path()])
        .find(|p| !p.is_file())
        .map(Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_are_stored_relative_and_read_back_absolute_after_a_move() {
        let capture = CaptureRecord {
            format: 1,
            captured_at_unix_ms: 0,
            machine: crate::vm::MachineConfig {
                kernel: "/opt/assets/vmlinuz".into(),
                initramfs: "/srv/state/assets/initramfs.img".into(),
                cpu_count: 1,
                memory_mb: 128,
            },
            kernel_cmdline: String::new(),
            accel: "tcg".into(),
            nic: true,
            state_file: "/srv/state/sandboxes/x/paused/state.bin".into(),
            state_bytes: 0,
            memory_file: None,
            disk: "/srv/state/sandboxes/x/disk.qcow2".into(),
            disk_layers: vec!["/srv/state/sandboxes/x/disk.qcow2".into()],
            disk_base: Some("/srv/state/images/a.ext4".into()),
            disk_virtual_bytes: 0,
            disk_allocated_bytes: 0,
            disk_frozen: false,
            dirty: None,
            filesystem_only: false,
        };
        let rel = relative_capture(&capture, Path::new("/srv/state"));
        assert_eq!(rel.machine.kernel, Path::new("/opt/assets/vmlinuz"));
        assert_eq!(rel.state_file, Path::new("sandboxes/x/paused/state.bin"));
        assert_eq!(rel.disk_base.as_deref(), Some(Path::new("images/a.ext4")));
        let moved = absolute_capture(&rel, Path::new("/new/place"));
        assert_eq!(
            moved.state_file,
            Path::new("/new/place/sandboxes/x/paused/state.bin")
        );
        assert_eq!(
            moved.disk_layers[0],
            Path::new("/new/place/sandboxes/x/disk.qcow2")
        );
        assert_eq!(moved.machine.kernel, Path::new("/opt/assets/vmlinuz"));
        // Schema 1 (absolute) records read as written.
        assert_eq!(absolute_capture(&capture, Path::new("/new/place")), capture);
    }
}
