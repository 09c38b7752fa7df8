//! Snapshots: captures of running sandboxes that new sandboxes start from (api.md §4.14,
//! §4.2). Each lives in `<state_dir>/snapshots/<id>/`: its state file, hard links to its
//! frozen disk layers and `record.json`. Deleting one never breaks sandboxes created from
//! it: they hold their own links to the layers.

use super::sandbox::SandboxInfo;
use super::settings::SandboxSettings;
use super::OrchError;
use crate::util::is_uuid;
use crate::vm::CaptureRecord;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

const RECORD_FILE: &str = "record.json";

/// What a snapshot stores (api.md §4.14: params, env, metadata, resources): the source
/// sandbox's settings and its capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRecord {
    pub id: String,
    pub name: Option<String>,
    pub sandbox_id: String,
    pub created_at: SystemTime,
    /// The source sandbox's settings; `templateId` is its template (image reference or
    /// template), which schema 2 records stored as `sourceTemplateId`.
    #[serde(flatten)]
    pub settings: SandboxSettings,
    pub capture: CaptureRecord,
    #[serde(default)]
    pub last_spawned_at: Option<SystemTime>,
    #[serde(default)]
    pub spawn_count: u64,
    /// Present for templates built from an image (`POST /templates`).
    #[serde(default)]
    pub template: Option<TemplateSource>,
    /// The stored format ([`super::records::RECORD_SCHEMA`]); absent (1) in older records.
    #[serde(default = "super::records::schema_v1")]
    pub schema: u32,
}

/// What a template was built from.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSource {
    pub image: String,
    pub start_cmd: Option<String>,
    /// Most warm standbys of this template (`PATCH /templates/{id}`); `None`: the
    /// server's `standby_per_template`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standbys: Option<u32>,
}

impl SnapshotRecord {
    pub fn new(
        id: String,
        name: Option<String>,
        info: &SandboxInfo,
        capture: CaptureRecord,
    ) -> SnapshotRecord {
        SnapshotRecord {
            id,
            name,
            sandbox_id: info.id.clone(),
            created_at: SystemTime::now(),
            settings: info.settings.clone(),
            capture,
            last_spawned_at: None,
            spawn_count: 0,
            template: None,
            schema: super::records::RECORD_SCHEMA,
        }
    }
}

/// The snapshot registry, with names claimed before a capture so two captures never
/// take one name.
pub(crate) struct Snapshots {
    dir: PathBuf,
    by_id: RwLock<BTreeMap<String, SnapshotRecord>>,
    /// name → id, including names claimed by captures in progress.
    names: Mutex<HashMap<String, String>>,
}

/// A claimed name, released on drop unless its snapshot was inserted.
pub(crate) struct NameClaim<'a> {
    snapshots: &'a Snapshots,
    name: Option<String>,
    id: String,
}

impl Drop for NameClaim<'_> {
    fn drop(&mut self) {
        if let Some(name) = &self.name {
            if !self.snapshots.by_id.read().contains_key(&self.id) {
                self.snapshots.names.lock().remove(name);
            }
        }
    }
}

/// api.md §1.5: `[A-Za-z0-9_-]{1,128}`, not shaped like a UUID.
pub fn valid_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && !is_uuid(name)
}

impl Snapshots {
    /// Loads every complete snapshot under `dir`. Leftovers of interrupted captures (no
    /// record: it is written last) are removed; unreadable records, records of a newer
    /// schema and records whose state file is missing are moved to
    /// `<state_dir>/quarantine/`, never removed.
    pub fn load(dir: PathBuf) -> Snapshots {
        let mut by_id = BTreeMap::new();
        let mut names = HashMap::new();
        let state_dir = dir.parent().unwrap_or(Path::new("/")).to_path_buf();
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if !path.join(RECORD_FILE).exists() {
                    log::info!(
                        "op=recover snapshot_dir={} result=removed reason=\"no record: an interrupted capture\"",
                        path.display()
                    );
                    remove_dir(&path);
                    continue;
                }
                match read_record(&path, &state_dir) {
                    Ok(r) => {
                        if let Some(n) = &r.name {
                            names.insert(n.clone(), r.id.clone());
                        }
                        by_id.insert(r.id.clone(), r);
                    }
                    Err(why) => {
                        crate::store::quarantine(&state_dir, &path, &why);
                    }
                }
            }
        }
        Snapshots {
            dir,
            by_id: RwLock::new(by_id),
            names: Mutex::new(names),
        }
    }

    pub fn dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Claims `name` for snapshot `id`: 409 when a snapshot or template has it.
    pub fn claim_name(&self, name: Option<&str>, id: &str) -> Result<NameClaim<'_>, OrchError> {
        if let Some(n) = name {
            if !valid_name(n) {
                return Err(OrchError::BadRequest(format!(
                    "name {n:?} must match [A-Za-z0-9_-]{{1,128}} and must not look like a UUID"
                )));
            }
            let mut names = self.names.lock();
            if names.contains_key(n) {
                return Err(OrchError::Conflict(format!("name {n} is already used")));
            }
            names.insert(n.to_string(), id.to_string());
        }
        Ok(NameClaim {
            snapshots: self,
            name: name.map(str::to_string),
            id: id.to_string(),
        })
    }

    /// Reserves `name` for a template build until [`Snapshots::release_name`] or until
    /// the template is inserted under it.
    pub fn reserve_name(&self, name: &str, id: &str) -> Result<(), OrchError> {
        self.claim_name(Some(name), id).map(std::mem::forget)
    }

    pub fn release_name(&self, name: &str) {
        self.names.lock().remove(name);
    }

    /// Stores the record durably, then makes the snapshot visible.
    pub fn insert(&self, record: SnapshotRecord) -> Result<(), OrchError> {
        self.save(&record)?;
        self.by_id.write().insert(record.id.clone(), record);
        Ok(())
    }

    fn save(&self, record: &SnapshotRecord) -> Result<(), OrchError> {
        let state_dir = self.dir.parent().unwrap_or(Path::new("/"));
        let stored = SnapshotRecord {
            schema: super::records::RECORD_SCHEMA,
            capture: super::records::relative_capture(&record.capture, state_dir),
            ..record.clone()
        };
        Ok(crate::store::write_json(
            &self.dir(&record.id).join(RECORD_FILE),
            &stored,
        )?)
    }

    /// By id when it has the form of a UUID, else by name (api.md §1.5).
    pub fn lookup(&self, id_or_name: &str) -> Option<SnapshotRecord> {
        let id = if is_uuid(id_or_name) {
            id_or_name.to_string()
        } else {
            self.names.lock().get(id_or_name)?.clone()
        };
        self.by_id.read().get(&id).cloned()
    }

    pub fn list(&self) -> Vec<SnapshotRecord> {
        self.by_id.read().values().cloned().collect()
    }

    /// Sets the most standbys of the template `id` (a record with a template source).
    pub fn set_standbys(&self, id: &str, standbys: u32) -> Result<(), OrchError> {
        let updated = {
            let mut map = self.by_id.write();
            let record = map.get_mut(id).filter(|r| r.template.is_some());
            record.map(|r| {
                if let Some(t) = r.template.as_mut() {
                    t.standbys = Some(standbys);
                }
                r.clone()
            })
        };
        match updated {
            Some(r) => self.save(&r),
            None => Err(OrchError::NotFound(format!("template {id} not found"))),
        }
    }

    /// Notes a sandbox created from the snapshot.
    pub fn note_spawn(&self, id: &str) {
        let updated = {
            let mut map = self.by_id.write();
            map.get_mut(id).map(|r| {
                r.spawn_count += 1;
                r.last_spawned_at = Some(SystemTime::now());
                r.clone()
            })
        };
        if let Some(r) = updated {
            if let Err(e) = self.save(&r) {
                log::warn!("snapshotId={id} op=note_spawn error=\"{e}\"");
            }
        }
    }

    /// Deletes a snapshot; `false` when unknown.
    pub fn delete(&self, id_or_name: &str) -> bool {
        let Some(record) = self.lookup(id_or_name) else {
            return false;
        };
        self.by_id.write().remove(&record.id);
        if let Some(n) = &record.name {
            self.names.lock().remove(n);
        }
        remove_dir(&self.dir(&record.id));
        true
    }
}

/// A snapshot's record with its paths made absolute, or why it cannot be used.
fn read_record(dir: &Path, state_dir: &Path) -> Result<SnapshotRecord, String> {
    let text = std::fs::read(dir.join(RECORD_FILE)).map_err(|e| format!("no record: {e}"))?;
    let mut r: SnapshotRecord =
        serde_json::from_slice(&text).map_err(|e| format!("unreadable record: {e}"))?;
    if r.schema > super::records::RECORD_SCHEMA {
        return Err(format!(
            "record schema {} is newer than this agentenv's {}",
            r.schema,
            super::records::RECORD_SCHEMA
        ));
    }
    r.capture = super::records::absolute_capture(&r.capture, state_dir);
    if !r.capture.state_file.is_file() {
        return Err(format!(
            "its state file {} is missing",
            r.capture.state_file.display()
        ));
    }
    Ok(r)
}

fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log::warn!("op=cleanup path={} error={e}", dir.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("my-snap_1"));
        assert!(!valid_name(""));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"x".repeat(129)));
        assert!(!valid_name("01936f1e-8a2b-7c3d-9e4f-0a1b2c3d4e5f"));
    }

    #[test]
    fn a_schema_2_record_loads_with_its_old_field_names() {
        let old = serde_json::json!({
            "id": "s1", "name": "n", "sandboxId": "sb", "createdAt": {"secs_since_epoch": 1, "nanos_since_epoch": 0},
            "sourceTemplateId": "docker.io/library/alpine:3", "cpuCount": 2, "memoryMb": 512,
            "diskSizeMb": 2048, "metadata": {"k": "v"}, "envVars": {}, "imageEnv": [],
            "params": {"p": 1}, "autoPause": false, "internetAccess": true, "timeoutSecs": 30,
            "capture": serde_json::to_value(crate::orchestrator::fakes::capture()).unwrap(),
            "schema": 2
        });
        let r: SnapshotRecord = serde_json::from_value(old).unwrap();
        assert_eq!(r.settings.template_id, "docker.io/library/alpine:3");
        assert_eq!(r.settings.resources.cpu_count, 2);
        assert_eq!(r.settings.resources.disk_size_mb, 2048);
        assert_eq!(
            r.settings.custom_extension_params,
            serde_json::json!({"p": 1})
        );
        assert!(!r.settings.auto_pause);
        let again: SnapshotRecord =
            serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(again.settings.metadata["k"], "v");
        assert_eq!(again.settings.resources, r.settings.resources);
    }

    #[test]
    fn claims_conflict_and_release() {
        let dir = std::env::temp_dir().join(format!("aenv-snaps-{}", crate::util::new_id()));
        let s = Snapshots::load(dir.clone());
        {
            let _c = s.claim_name(Some("n1"), "a").unwrap();
            assert!(matches!(
                s.claim_name(Some("n1"), "b"),
                Err(OrchError::Conflict(_))
            ));
        }
        // Released: the capture never inserted its snapshot.
        assert!(s.claim_name(Some("n1"), "c").is_ok());
        assert!(matches!(
            s.claim_name(Some("bad name"), "d"),
            Err(OrchError::BadRequest(_))
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
