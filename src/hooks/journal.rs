//! The open-instance journal (custom-extension.md §4.3, §9): one durable file per instance whose start was
//! attempted and whose stop has not been delivered or given up yet.
//!
//! `<dir>/<sandboxInstanceId>.json` is written with `store::write_atomic` (temp file,
//! fsync, rename, fsync of the directory) before the start hook is sent, and unlinked (and
//! the directory fsync'd) when the instance is closed. A crash between delivery and the
//! unlink only causes a duplicate stop, which extensions must accept (custom-extension.md §4.7).

use super::error::HookError;
use crate::store;
use log::warn;
use serde::{Deserialize, Serialize};
use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// One open instance, with what recovery needs (custom-extension.md §9.3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JournalEntry {
    pub sandbox_id: String,
    pub sandbox_instance_id: String,
    pub network_namespace_path: PathBuf,
    pub host_interaction_ip: Ipv4Addr,
    pub slot_index: u32,
    /// Milliseconds since the Unix epoch when the entry was written; orders recovery
    /// stops of one sandbox.
    pub started_at_ms: u64,
}

/// The journal directory.
pub struct HookJournal {
    dir: PathBuf,
}

impl HookJournal {
    /// Creates the directory (mode 0700) if needed and loads the open entries, oldest
    /// first. Leftover temp files are removed; unreadable entries (a torn write cannot
    /// happen with `write_atomic`, so this is outside damage) are moved to the state dir's
    /// quarantine (the journal's parent) with the reason, never deleted.
    pub fn open(dir: &Path) -> Result<(HookJournal, Vec<JournalEntry>), HookError> {
        let journal_err = |what: &str, e: &dyn std::fmt::Display| {
            HookError::Journal(format!("cannot {what} {}: {e}", dir.display()))
        };
        store::ensure_private_dir(dir).map_err(|e| journal_err("create", &e))?;
        let mut entries = Vec::new();
        for dent in fs::read_dir(dir).map_err(|e| journal_err("read", &e))? {
            let dent = dent.map_err(|e| journal_err("read", &e))?;
            let path = dent.path();
            let name = dent.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.contains(".tmp-") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<JournalEntry>(&b).map_err(|e| e.to_string()))
                .and_then(|e| {
                    if e.sandbox_instance_id == stem {
                        Ok(e)
                    } else {
                        Err("file name does not match sandboxInstanceId".into())
                    }
                });
            match parsed {
                Ok(e) => entries.push(e),
                Err(why) => {
                    let state_dir = dir.parent().unwrap_or(dir);
                    let why = format!("unreadable hook journal entry: {why}");
                    if store::quarantine(state_dir, &path, &why).is_none() {
                        warn!("hook journal entry left in place path={}", path.display());
                    }
                }
            }
        }
        entries.sort_by(|a, b| {
            (a.started_at_ms, &a.sandbox_instance_id)
                .cmp(&(b.started_at_ms, &b.sandbox_instance_id))
        });
        Ok((
            HookJournal {
                dir: dir.to_path_buf(),
            },
            entries,
        ))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, instance_id: &str) -> PathBuf {
        self.dir.join(format!("{instance_id}.json"))
    }

    /// Writes `entry` durably. Returns only once it is on disk.
    pub fn record(&self, entry: &JournalEntry) -> Result<(), HookError> {
        let bytes = serde_json::to_vec_pretty(entry).expect("journal entry serializes");
        store::write_atomic(&self.path(&entry.sandbox_instance_id), &bytes, 0o600)
            .map_err(|e| HookError::Journal(e.to_string()))
    }

    /// Removes the entry of `instance_id`; a missing entry is not an error.
    pub fn close(&self, instance_id: &str) -> Result<(), HookError> {
        let path = self.path(instance_id);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => {
                return Err(HookError::Journal(format!(
                    "cannot remove {}: {e}",
                    path.display()
                )))
            }
        }
        crate::sys::fs::fsync_dir(&self.dir).map_err(|e| HookError::Journal(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u64) -> JournalEntry {
        JournalEntry {
            sandbox_id: crate::util::new_id(),
            sandbox_instance_id: crate::util::new_id(),
            network_namespace_path: PathBuf::from(format!("/run/netns/agentenv-ns-{i}")),
            host_interaction_ip: Ipv4Addr::new(198, 18, 0, i as u8),
            slot_index: i as u32,
            started_at_ms: 1000 - i,
        }
    }

    #[test]
    fn record_load_close_round_trip() {
        let state = std::env::temp_dir().join(format!("aenv-journal-{}", crate::util::new_id()));
        let dir = state.join("journal");
        let (j, loaded) = HookJournal::open(&dir).unwrap();
        assert!(loaded.is_empty());
        let (a, b) = (entry(1), entry(2));
        j.record(&a).unwrap();
        j.record(&b).unwrap();
        fs::write(dir.join(".x.json.tmp-1"), b"partial").unwrap();
        fs::write(dir.join("bogus.json"), b"{").unwrap();
        let (_, loaded) = HookJournal::open(&dir).unwrap();
        // Oldest first.
        assert_eq!(loaded, vec![b.clone(), a.clone()]);
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|d| d.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "temp and bogus files gone: {names:?}");
        let kept: Vec<_> = fs::read_dir(state.join("quarantine"))
            .unwrap()
            .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(kept.len(), 2, "the bogus entry and its reason: {kept:?}");
        assert!(kept.iter().any(|n| n.starts_with("journal-bogus.json-")));
        j.close(&a.sandbox_instance_id).unwrap();
        j.close(&a.sandbox_instance_id).unwrap();
        let (_, loaded) = HookJournal::open(&dir).unwrap();
        assert_eq!(loaded, vec![b]);
        fs::remove_dir_all(&state).unwrap();
    }
}
