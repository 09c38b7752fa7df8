//! E2B volumes (api.md §4.27, docs/operations.md "Volumes"): named, size-bounded file
//! trees that outlive sandboxes. Each lives in `<state_dir>/volumes/<id>/`: `volume.json`
//! (its record, written last on create), `volume.ext4` (the sparse ext4 image whose size is
//! the quota) and `mnt/`, where the image is loop-mounted `nosuid,nodev,noexec` while the
//! server runs. The content API ([`content`]) works on that tree; sandboxes mount it over
//! NFS from their slot's namespace.
//!
//! Threads: API workers call the store; a volume's content calls share its gate, a delete
//! takes it exclusively, so no content call runs on a volume being unmounted. A create,
//! fork or snapshot that will mount a volume holds a [`VolumeClaim`] until its sandbox (or
//! snapshot) is registered; a delete first closes the volume to new claims, then checks
//! that there are none and that no record names it ([`VolumeStore::delete`]), so a delete
//! racing a create never leaves a sandbox on a deleted volume.

pub mod content;
mod disk;
pub mod nfs;

use crate::sys::SysError;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

const RECORD_FILE: &str = "volume.json";
const IMAGE_FILE: &str = "volume.ext4";
const MOUNT_DIR: &str = "mnt";
/// The stored format of `volume.json`.
const SCHEMA: u32 = 1;

#[derive(Debug)]
pub enum VolumeError {
    /// A path the content API refuses (400), naming the field.
    BadPath(String),
    /// No such entry in the volume (404).
    PathNotFound(String),
    /// Something is there already (409).
    Exists(String),
    /// The volume's quota is used up (507).
    NoSpace,
    /// A listing over its bound (400).
    TooMany(usize),
    /// Making, mounting or unmounting the image failed (500).
    Disk(String),
    /// The volume is not mounted on the host (503).
    Unmounted(String),
    /// nfs-ganesha, which serves volumes to guests, is missing or unusable (503).
    NoNfsServer(String),
    /// A delete of a volume that sandboxes or snapshots use, or a claim of one being
    /// deleted (409).
    InUse(String),
    Io {
        what: String,
        source: std::io::Error,
    },
    Sys(SysError),
}

impl VolumeError {
    pub fn bad_path(why: impl fmt::Display) -> VolumeError {
        VolumeError::BadPath(format!("path: {why}"))
    }

    fn io(what: impl fmt::Display, source: std::io::Error) -> VolumeError {
        VolumeError::Io {
            what: what.to_string(),
            source,
        }
    }

    fn errno(&self) -> Option<i32> {
        match self {
            VolumeError::Io { source, .. } => source.raw_os_error(),
            VolumeError::Sys(e) => e.errno(),
            _ => None,
        }
    }

    /// Whether the caller asked for something wrong (a 4xx), not the server failed.
    pub fn status(&self) -> u16 {
        match self {
            VolumeError::BadPath(_) | VolumeError::TooMany(_) => 400,
            VolumeError::PathNotFound(_) => 404,
            VolumeError::Exists(_) | VolumeError::InUse(_) => 409,
            VolumeError::NoSpace => 507,
            VolumeError::Unmounted(_) | VolumeError::NoNfsServer(_) => 503,
            VolumeError::Disk(_) | VolumeError::Io { .. } | VolumeError::Sys(_) => 500,
        }
    }
}

impl From<SysError> for VolumeError {
    fn from(e: SysError) -> VolumeError {
        VolumeError::Sys(e)
    }
}

impl fmt::Display for VolumeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VolumeError::BadPath(m)
            | VolumeError::Disk(m)
            | VolumeError::InUse(m)
            | VolumeError::NoNfsServer(m) => {
                f.write_str(m)
            }
            VolumeError::PathNotFound(p) => write!(f, "path {p} not found in the volume"),
            VolumeError::Exists(p) => write!(f, "path {p} exists already"),
            VolumeError::NoSpace => f.write_str(
                "the volume is full (its size is its quota); remove files or use a larger volume",
            ),
            VolumeError::TooMany(n) => write!(
                f,
                "depth: the listing has more than {n} entries; list a subdirectory or a smaller depth"
            ),
            VolumeError::Unmounted(m) => write!(f, "the volume is not mounted on the host: {m}"),
            VolumeError::Io { what, source } => write!(f, "{what}: {source}"),
            VolumeError::Sys(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for VolumeError {}

/// What `volume.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    pub id: String,
    pub name: String,
    /// The content API's bearer token.
    pub token: String,
    pub size_mb: u64,
    pub created_at: SystemTime,
    pub schema: u32,
}

/// One volume: its record, the gate its content calls pass and its claims.
pub struct Volume {
    pub record: VolumeRecord,
    mount: PathBuf,
    gate: RwLock<bool>,
    claims: Mutex<Claims>,
}

/// Who is about to mount a volume, and whether a delete has closed it.
#[derive(Debug, Default)]
struct Claims {
    held: usize,
    /// Set by a delete before it checks for users; cleared when that delete is refused,
    /// kept once the volume is gone.
    closed: bool,
}

/// A create's hold on a volume it will mount, until its sandbox is registered: the
/// volume cannot be deleted meanwhile. Released on drop.
pub struct VolumeClaim {
    volume: Arc<Volume>,
}

impl Drop for VolumeClaim {
    fn drop(&mut self) {
        self.volume.claims.lock().held -= 1;
    }
}

impl VolumeClaim {
    pub fn volume(&self) -> &Volume {
        &self.volume
    }
}

/// A content call's hold on a mounted volume.
pub struct Mounted<'a> {
    _gate: RwLockReadGuard<'a, bool>,
    root: &'a Path,
}

impl Mounted<'_> {
    pub fn tree(&self) -> content::Tree<'_> {
        content::Tree::new(self.root)
    }
}

impl Volume {
    /// The mounted tree, held until the returned guard drops.
    pub fn mounted(&self) -> Result<Mounted<'_>, VolumeError> {
        let gate = self.gate.read();
        if !*gate {
            return Err(VolumeError::Unmounted(format!(
                "{} could not be mounted at startup; see the server log",
                self.mount.display()
            )));
        }
        Ok(Mounted {
            _gate: gate,
            root: &self.mount,
        })
    }

    /// Where the volume's tree is mounted on the host.
    pub fn mount_dir(&self) -> &Path {
        &self.mount
    }

    /// Holds the volume for a sandbox about to mount it; [`VolumeError::InUse`] while a
    /// delete has it (or it is gone).
    pub fn claim(self: &Arc<Volume>) -> Result<VolumeClaim, VolumeError> {
        let mut claims = self.claims.lock();
        if claims.closed {
            return Err(VolumeError::InUse(format!(
                "volume {} ({}) is being deleted",
                self.record.name, self.record.id
            )));
        }
        claims.held += 1;
        Ok(VolumeClaim {
            volume: Arc::clone(self),
        })
    }

    /// Closes the volume to new claims for a delete: refused while claims are held (it
    /// stays open) or another delete has it.
    fn close(&self) -> Result<(), VolumeError> {
        let mut claims = self.claims.lock();
        let id = &self.record.id;
        if claims.closed {
            return Err(VolumeError::InUse(format!(
                "volume {id} is being deleted already"
            )));
        }
        if claims.held > 0 {
            return Err(VolumeError::InUse(format!(
                "volume {id} is being mounted by {} sandbox operation(s) in progress (create, fork or snapshot); delete it once they are done and their sandboxes and snapshots are gone",
                claims.held
            )));
        }
        claims.closed = true;
        Ok(())
    }

    fn reopen(&self) {
        self.claims.lock().closed = false;
    }

    fn new(record: VolumeRecord, mount: PathBuf, mounted: bool) -> Volume {
        Volume {
            record,
            mount,
            gate: RwLock::new(mounted),
            claims: Mutex::new(Claims::default()),
        }
    }
}

/// Where volume `id`'s tree is mounted on the host, under `dir` (`<state_dir>/volumes`).
pub fn mount_dir(dir: &Path, id: &str) -> PathBuf {
    dir.join(id).join(MOUNT_DIR)
}

/// Every volume, by id, with their names.
pub struct VolumeStore {
    dir: PathBuf,
    by_id: RwLock<BTreeMap<String, Arc<Volume>>>,
    /// Names of volumes and of creates in progress.
    names: Mutex<HashSet<String>>,
    /// Why guests cannot mount volumes on this host (nfs-ganesha missing), found at load.
    nfs_unusable: Option<String>,
}

impl VolumeStore {
    /// Loads and mounts every volume under `dir` (`<state_dir>/volumes`). A directory
    /// without a record is an interrupted create and goes; an unreadable record is moved
    /// to `<state_dir>/quarantine/`; a volume whose image does not mount stays listed
    /// (its content calls answer 503) and is logged.
    pub fn load(dir: PathBuf) -> VolumeStore {
        let state_dir = dir.parent().unwrap_or(Path::new("/")).to_path_buf();
        let mut by_id = BTreeMap::new();
        let mut names = HashSet::new();
        for path in std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
        {
            match read_record(&path) {
                Ok(None) => remove_leftover(&path),
                Ok(Some(record)) => {
                    let volume = attach(&path, record);
                    names.insert(volume.record.name.clone());
                    by_id.insert(volume.record.id.clone(), Arc::new(volume));
                }
                Err(why) => {
                    let mount = path.join(MOUNT_DIR);
                    if disk::is_mounted(&mount) {
                        let _ = disk::unmount(&mount);
                    }
                    crate::store::quarantine(&state_dir, &path, &why);
                }
            }
        }
        let nfs_unusable = match nfs::check_installed() {
            Ok(release) => {
                log::info!("op=preflight component=nfs-ganesha release={release}");
                None
            }
            Err(why) => {
                log::warn!(
                    "op=preflight component=nfs-ganesha result=unusable volumes={} reason=\"{why}\"",
                    by_id.len()
                );
                Some(why)
            }
        };
        VolumeStore {
            dir,
            by_id: RwLock::new(by_id),
            names: Mutex::new(names),
            nfs_unusable,
        }
    }

    /// [`VolumeError::NoNfsServer`] when guests cannot mount volumes on this host.
    pub fn require_nfs(&self) -> Result<(), VolumeError> {
        match &self.nfs_unusable {
            None => Ok(()),
            Some(why) => Err(VolumeError::NoNfsServer(why.clone())),
        }
    }

    /// Makes volume `name` of `size_mb` MiB: its image, its mount, then its record. Any
    /// failure undoes what was made. A taken name is [`VolumeError::Exists`].
    pub fn create(&self, name: &str, size_mb: u64) -> Result<VolumeRecord, VolumeError> {
        if !self.names.lock().insert(name.to_string()) {
            return Err(VolumeError::Exists(format!("name {name}")));
        }
        let id = crate::util::new_id();
        let path = self.dir.join(&id);
        let record = VolumeRecord {
            id: id.clone(),
            name: name.to_string(),
            token: crate::util::new_secret(),
            size_mb,
            created_at: SystemTime::now(),
            schema: SCHEMA,
        };
        match make(&path, &record) {
            Ok(mount) => {
                let volume = Volume::new(record.clone(), mount, true);
                self.by_id.write().insert(id, Arc::new(volume));
                Ok(record)
            }
            Err(e) => {
                remove_leftover(&path);
                self.names.lock().remove(name);
                Err(e)
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Volume>> {
        self.by_id.read().get(id).cloned()
    }

    pub fn by_name(&self, name: &str) -> Option<Arc<Volume>> {
        let volumes = self.by_id.read();
        volumes.values().find(|v| v.record.name == name).cloned()
    }

    pub fn list(&self) -> Vec<VolumeRecord> {
        let volumes = self.by_id.read();
        volumes.values().map(|v| v.record.clone()).collect()
    }

    /// Unmounts and removes volume `id`, after its content calls in flight have ended;
    /// `false` when there is none. First the volume is closed to new claims; then, with
    /// none held, `users` says who else mounts it (the records naming it: sandboxes,
    /// snapshots): a message there refuses the delete ([`VolumeError::InUse`]) and opens
    /// the volume again.
    pub fn delete(
        &self,
        id: &str,
        users: impl FnOnce(&VolumeRecord) -> Option<String>,
    ) -> Result<bool, VolumeError> {
        let Some(volume) = self.get(id) else {
            return Ok(false);
        };
        volume.close()?;
        if let Some(why) = users(&volume.record) {
            volume.reopen();
            return Err(VolumeError::InUse(why));
        }
        if let Err(e) = self.remove(&volume) {
            volume.reopen();
            return Err(e);
        }
        Ok(true)
    }

    fn remove(&self, volume: &Volume) -> Result<(), VolumeError> {
        let id = &volume.record.id;
        let mut mounted = volume.gate.write();
        if *mounted {
            disk::unmount(&volume.mount)?;
            *mounted = false;
        }
        let path = self.dir.join(id);
        // The record goes first: a crash mid-removal leaves a leftover, never a volume.
        std::fs::remove_file(path.join(RECORD_FILE))
            .map_err(|e| VolumeError::io(path.join(RECORD_FILE).display(), e))?;
        remove_leftover(&path);
        self.by_id.write().remove(id);
        self.names.lock().remove(&volume.record.name);
        Ok(())
    }

    /// Unmounts every volume (graceful shutdown), so their images are clean on disk.
    pub fn unmount_all(&self) {
        for volume in self.by_id.read().values() {
            let mut mounted = volume.gate.write();
            if *mounted {
                match disk::unmount(&volume.mount) {
                    Ok(()) => *mounted = false,
                    Err(e) => log::warn!("op=shutdown volumeId={} error=\"{e}\"", volume.record.id),
                }
            }
        }
    }
}

/// Makes the image, mounts it and writes the record (last); returns the mount dir.
fn make(path: &Path, record: &VolumeRecord) -> Result<PathBuf, VolumeError> {
    use std::os::unix::fs::PermissionsExt;
    let mount = path.join(MOUNT_DIR);
    crate::store::ensure_private_dir(&mount).map_err(|e| VolumeError::Disk(e.to_string()))?;
    disk::make_image(&path.join(IMAGE_FILE), record.size_mb)?;
    disk::mount(&path.join(IMAGE_FILE), &mount)?;
    // The volume's root as the guest sees it: writable by its users. The host side stays
    // private: `<id>/` is 0700.
    std::fs::set_permissions(&mount, std::fs::Permissions::from_mode(0o777))
        .map_err(|e| VolumeError::io(mount.display(), e))?;
    let lost = mount.join("lost+found");
    if lost.is_dir() {
        let _ = std::fs::remove_dir(lost);
    }
    let bytes = serde_json::to_vec_pretty(record).expect("a volume record encodes");
    crate::store::write_atomic(&path.join(RECORD_FILE), &bytes, 0o600)
        .map_err(|e| VolumeError::Disk(e.to_string()))?;
    Ok(mount)
}

/// The record in `path`; `None` when there is none (an interrupted create).
fn read_record(path: &Path) -> Result<Option<VolumeRecord>, String> {
    let file = path.join(RECORD_FILE);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", file.display())),
    };
    let record: VolumeRecord = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{} is not a volume record: {e}", file.display()))?;
    if record.schema > SCHEMA {
        return Err(format!(
            "{} has schema {} (this server reads {SCHEMA}): written by a newer agentenv",
            file.display(),
            record.schema
        ));
    }
    let expected = path.file_name().map(|n| n.to_string_lossy().into_owned());
    if expected.as_deref() != Some(record.id.as_str()) {
        return Err(format!("{} names volume {}", file.display(), record.id));
    }
    Ok(Some(record))
}

/// The loaded volume, mounted unless that fails (logged).
fn attach(path: &Path, record: VolumeRecord) -> Volume {
    let mount = path.join(MOUNT_DIR);
    let mounted = disk::is_mounted(&mount)
        || match disk::mount(&path.join(IMAGE_FILE), &mount) {
            Ok(()) => true,
            Err(e) => {
                log::error!(
                    "op=recover volumeId={} result=unmounted error=\"{e}\"",
                    record.id
                );
                false
            }
        };
    log::info!(
        "op=recover volumeId={} name={} mounted={mounted}",
        record.id,
        record.name
    );
    Volume::new(record, mount, mounted)
}

/// Removes what an interrupted create or a delete left in `path` (unmounting first).
fn remove_leftover(path: &Path) {
    let mount = path.join(MOUNT_DIR);
    if disk::is_mounted(&mount) {
        if let Err(e) = disk::unmount(&mount) {
            log::warn!(
                "op=recover path={} result=kept error=\"{e}\"",
                path.display()
            );
            return;
        }
    }
    if let Err(e) = std::fs::remove_dir_all(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            log::warn!("op=recover path={} error={e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn volume() -> Arc<Volume> {
        let record = VolumeRecord {
            id: "vol-1".into(),
            name: "work".into(),
            token: "t".into(),
            size_mb: 16,
            created_at: SystemTime::now(),
            schema: SCHEMA,
        };
        Arc::new(Volume::new(record, PathBuf::from("/nonexistent"), false))
    }

    #[test]
    fn a_delete_closes_the_volume_to_claims_and_a_claim_refuses_the_delete() {
        let v = volume();
        let claim = v.claim().unwrap();
        assert!(matches!(v.close(), Err(VolumeError::InUse(m)) if m.contains("in progress")));
        drop(claim);
        v.close().unwrap();
        assert!(matches!(v.claim(), Err(VolumeError::InUse(m)) if m.contains("being deleted")));
        assert!(matches!(v.close(), Err(VolumeError::InUse(m)) if m.contains("already")));
        v.reopen();
        drop(v.claim().unwrap());
    }

    /// Creates (claim, then register while holding the claim) race deletes (close, then
    /// look for registered users, then delete): whatever the interleaving, no create
    /// succeeds on a volume a delete removed, and a delete that went ahead saw no user.
    #[test]
    fn a_delete_racing_creates_never_leaves_a_sandbox_on_a_deleted_volume() {
        for _ in 0..200 {
            let v = volume();
            let registered = Arc::new(Mutex::new(Vec::<usize>::new()));
            let deleted = Arc::new(AtomicBool::new(false));
            let start = Arc::new(std::sync::Barrier::new(5));
            let mut threads = Vec::new();
            for n in 0..4 {
                let (v, registered, deleted, start) = (
                    v.clone(),
                    registered.clone(),
                    deleted.clone(),
                    start.clone(),
                );
                threads.push(std::thread::spawn(move || {
                    start.wait();
                    if let Ok(claim) = v.claim() {
                        assert!(!deleted.load(Ordering::SeqCst), "claimed a deleted volume");
                        registered.lock().push(n);
                        drop(claim);
                    }
                }));
            }
            start.wait();
            let outcome = match v.close() {
                Err(_) => false,
                Ok(()) if !registered.lock().is_empty() => {
                    v.reopen();
                    false
                }
                Ok(()) => {
                    deleted.store(true, Ordering::SeqCst);
                    true
                }
            };
            for t in threads {
                t.join().unwrap();
            }
            if outcome {
                assert!(
                    registered.lock().is_empty(),
                    "a sandbox mounts the deleted volume"
                );
            }
        }
    }
}
