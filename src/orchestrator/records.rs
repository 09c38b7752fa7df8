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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct SandboxRecord {
    pub info: SandboxInfo,
    /// The committed capture of a paused sandbox.
    pub paused: Option<CaptureRecord>,
}

pub(crate) fn save(dir: &Path, record: &SandboxRecord) -> Result<(), OrchError> {
    let bytes = serde_json::to_vec_pretty(record)
        .map_err(|e| OrchError::Internal(format!("cannot encode sandbox record: {e}")))?;
    crate::store::write_atomic(&dir.join(RECORD_FILE), &bytes, 0o600)
        .map_err(|e| OrchError::Internal(e.to_string()))
}

/// What startup found in the sandboxes directory.
pub(crate) struct Loaded {
    /// Paused sandboxes with a complete capture.
    pub paused: Vec<(PathBuf, SandboxRecord)>,
    /// Directories of sandboxes that cannot come back (running at the stop, or broken).
    pub stale: Vec<PathBuf>,
}

pub(crate) fn load_all(sandboxes_dir: &Path) -> Loaded {
    let mut loaded = Loaded {
        paused: Vec::new(),
        stale: Vec::new(),
    };
    let Ok(entries) = std::fs::read_dir(sandboxes_dir) else {
        return loaded;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        match read(&dir) {
            Ok(record) if paused_and_complete(&record) => loaded.paused.push((dir, record)),
            Ok(record) => {
                log::error!(
                    "sandboxId={} op=recover result=lost reason=\"it was {} when the server stopped; its memory is gone\"",
                    record.info.id,
                    record.info.state.name()
                );
                loaded.stale.push(dir);
            }
            Err(e) => {
                log::warn!(
                    "op=recover dir={} result=removed reason=\"{e}\"",
                    dir.display()
                );
                loaded.stale.push(dir);
            }
        }
    }
    loaded
}

fn read(dir: &Path) -> Result<SandboxRecord, String> {
    let text = std::fs::read(dir.join(RECORD_FILE)).map_err(|e| format!("no record: {e}"))?;
    serde_json::from_slice(&text).map_err(|e| format!("unreadable record: {e}"))
}

fn paused_and_complete(record: &SandboxRecord) -> bool {
    record.info.state == SandboxState::Paused
        && record
            .paused
            .as_ref()
            .is_some_and(|c| c.state_file.is_file() && c.disk.is_file())
}
