//! The content-addressed image cache under `<state_dir>/images`.
//!
//! ```text
//! blobs/sha256/<hex>        manifests, configs and layers pulled from registries
//! <hex>-<size>M.ext4        base disks, by platform manifest digest and disk size
//! tmp/                      downloads and builds in progress (removed at startup)
//! ```
//!
//! A download goes to `tmp/`, is verified against its digest and size, fsynced and only
//! then renamed into `blobs/`, so a partial or corrupt download never becomes an entry.
//! The file's mtime is its last use: a cache hit touches it, and eviction under the size
//! cap removes the least recently used entries that nothing uses.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use sha2::{Digest as _, Sha256};

use super::layout::{digest_hex, hex};
use super::ImageError;

/// Entries used this recently are never evicted: a cache hit hands a base disk to a
/// caller that is about to create an overlay on it.
const EVICTION_GRACE: Duration = Duration::from_secs(60);
/// How often a download in progress logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);
/// How deep eviction looks under the state dir for qcow2 overlays using a base disk.
const OVERLAY_SCAN_DEPTH: usize = 6;

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// A unique path under `<cache>/tmp` for `name`.
pub(crate) fn temp_name(name: &str) -> String {
    format!(
        "{name}.{}.{}",
        std::process::id(),
        TEMP_SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// One mutex per key, created on demand and dropped when unused, so callers working on
/// different keys never wait for each other.
#[derive(Default)]
pub(crate) struct KeyedLocks {
    map: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl KeyedLocks {
    /// Runs `f` while holding the lock for `key`.
    pub(crate) fn with<T>(&self, key: &str, f: impl FnOnce() -> T) -> T {
        let lock = self.map.lock().entry(key.to_string()).or_default().clone();
        let result = {
            let _guard = lock.lock();
            f()
        };
        let mut map = self.map.lock();
        // Ours and the map's: nobody else waits for it.
        if Arc::strong_count(&lock) == 2 {
            map.remove(key);
        }
        result
    }

    /// Whether someone holds or waits for `key`.
    pub(crate) fn busy(&self, key: &str) -> bool {
        self.map.lock().contains_key(key)
    }
}

/// What a cache entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Blob,
    BaseDisk,
}

/// One cache entry, for listing and eviction.
#[derive(Debug, Clone)]
pub struct CacheEntry {
    pub kind: EntryKind,
    /// `sha256:…` of the blob, or of the manifest a base disk was built from.
    pub digest: String,
    /// Disk size of a base disk.
    pub size_mb: Option<u32>,
    /// Bytes allocated on the host (base disks are sparse).
    pub bytes: u64,
    pub last_used: SystemTime,
    /// Referenced by a sandbox overlay (base disks), or pinned by a pull or build.
    pub in_use: bool,
    pub path: PathBuf,
}

/// The cache directory with its per-digest download locks and pins.
pub struct BlobCache {
    root: PathBuf,
    downloads: KeyedLocks,
    /// Paths a pull or build in progress relies on, with a count each.
    pins: Mutex<HashMap<PathBuf, usize>>,
}

/// Keeps a cache path from being evicted while alive.
pub struct Pin {
    cache: Arc<BlobCache>,
    path: PathBuf,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut pins = self.cache.pins.lock();
        if let Some(n) = pins.get_mut(&self.path) {
            *n -= 1;
            if *n == 0 {
                pins.remove(&self.path);
            }
        }
    }
}

impl BlobCache {
    pub fn new(root: PathBuf) -> BlobCache {
        BlobCache {
            root,
            downloads: KeyedLocks::default(),
            pins: Mutex::new(HashMap::new()),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }

    pub fn blob_path(&self, digest: &str) -> Result<PathBuf, ImageError> {
        Ok(self.root.join("blobs/sha256").join(digest_hex(digest)?))
    }

    /// Pins `path` until the returned guard is dropped.
    pub fn pin(self: &Arc<Self>, path: &Path) -> Pin {
        *self.pins.lock().entry(path.to_path_buf()).or_default() += 1;
        Pin {
            cache: self.clone(),
            path: path.to_path_buf(),
        }
    }

    /// The cached blob `digest` if present (touched as used).
    pub fn cached(&self, digest: &str) -> Result<Option<PathBuf>, ImageError> {
        let path = self.blob_path(digest)?;
        if path.is_file() {
            touch(&path);
            return Ok(Some(path));
        }
        Ok(None)
    }

    /// The cached blob `digest`, fetched with `open` first if absent. Concurrent callers
    /// for one digest download it once. The download is checked against `digest` and
    /// `size` (when known) before it becomes an entry.
    pub fn get_or_fetch(
        &self,
        digest: &str,
        size: Option<u64>,
        what: &str,
        open: impl FnOnce() -> Result<Box<dyn Read + Send>, ImageError>,
    ) -> Result<PathBuf, ImageError> {
        let path = self.blob_path(digest)?;
        self.downloads.with(digest, || {
            if path.is_file() {
                touch(&path);
                return Ok(path.clone());
            }
            let reader = open()?;
            self.store(&path, digest, size, what, reader)?;
            Ok(path.clone())
        })
    }

    /// Stores `bytes`, already verified to have `digest`, unless present.
    pub fn put(&self, digest: &str, bytes: &[u8]) -> Result<PathBuf, ImageError> {
        let path = self.blob_path(digest)?;
        self.downloads.with(digest, || {
            if !path.is_file() {
                self.store(
                    &path,
                    digest,
                    Some(bytes.len() as u64),
                    digest,
                    Box::new(bytes),
                )?;
            }
            Ok(path.clone())
        })
    }

    fn store(
        &self,
        dest: &Path,
        digest: &str,
        size: Option<u64>,
        what: &str,
        mut reader: Box<dyn Read + Send + '_>,
    ) -> Result<(), ImageError> {
        let io_err = |p: &Path, e: io::Error| ImageError::Io(format!("{}: {e}", p.display()));
        let tmp_dir = self.tmp_dir();
        let parent = dest.parent().unwrap_or(&self.root);
        for dir in [&tmp_dir, parent] {
            crate::store::ensure_private_dir(dir).map_err(|e| ImageError::Io(e.to_string()))?;
        }
        let tmp = super::TempPath::file(tmp_dir.join(temp_name(digest_hex(digest)?)));
        let mut file = {
            use std::os::unix::fs::OpenOptionsExt;
            File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(tmp.path())
                .map_err(|e| io_err(tmp.path(), e))?
        };

        let started = Instant::now();
        let mut last_log = started;
        let mut hasher = Sha256::new();
        let mut done: u64 = 0;
        let mut buf = vec![0u8; 256 << 10];
        let total = size.map_or_else(|| "?".to_string(), |s| s.to_string());
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(ImageError::Upstream(format!(
                        "downloading {what} failed after {done} bytes: {e}"
                    )))
                }
            };
            done += n as u64;
            if size.is_some_and(|s| done > s) {
                return Err(ImageError::BadImage(format!(
                    "{what} is longer than its descriptor's {total} bytes"
                )));
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n])
                .map_err(|e| io_err(tmp.path(), e))?;
            if last_log.elapsed() >= PROGRESS_EVERY {
                last_log = Instant::now();
                log::info!("op=image-pull {what} bytes={done} total={total}");
            }
        }
        if let Some(s) = size {
            if s != done {
                return Err(ImageError::BadImage(format!(
                    "{what} is {done} bytes, its descriptor says {s}"
                )));
            }
        }
        let actual = format!("sha256:{}", hex(&hasher.finalize()));
        if actual != digest {
            return Err(ImageError::BadImage(format!(
                "{what} has digest {actual}, expected {digest}"
            )));
        }
        file.sync_all().map_err(|e| io_err(tmp.path(), e))?;
        drop(file);
        fs::rename(tmp.path(), dest).map_err(|e| io_err(dest, e))?;
        tmp.disarm();
        let ms = started.elapsed().as_millis();
        if done >= 1 << 20 {
            log::info!("op=image-pull {what} bytes={done} total={total} ms={ms} done=true");
        }
        Ok(())
    }

    /// Every entry, most recently used first.
    pub fn list(&self) -> Result<Vec<CacheEntry>, ImageError> {
        let mut entries = Vec::new();
        let overlays = overlay_backing_files(&self.root);
        let pins = self.pins.lock().clone();
        let mut push = |kind: EntryKind, digest: String, size_mb: Option<u32>, path: PathBuf| {
            let Ok(md) = fs::symlink_metadata(&path) else {
                return;
            };
            if !md.is_file() {
                return;
            }
            let in_use = pins.contains_key(&path)
                || (kind == EntryKind::BaseDisk && overlays.iter().any(|o| same_file(o, &path)));
            entries.push(CacheEntry {
                kind,
                digest,
                size_mb,
                bytes: md.blocks() * 512,
                last_used: md.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                in_use,
                path,
            });
        };
        if let Ok(rd) = fs::read_dir(self.root.join("blobs/sha256")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let digest = format!("sha256:{name}");
                if digest_hex(&digest).is_ok() {
                    push(EntryKind::Blob, digest, None, e.path());
                }
            }
        }
        if let Ok(rd) = fs::read_dir(&self.root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some((digest, size_mb)) = parse_disk_name(&name) {
                    push(EntryKind::BaseDisk, digest, Some(size_mb), e.path());
                }
            }
        }
        entries.sort_by_key(|e| std::cmp::Reverse(e.last_used));
        Ok(entries)
    }

    /// Removes least recently used entries not in use until the cache holds at most
    /// `cap_bytes`. `busy` says whether a base disk is being built or handed out.
    pub fn evict(&self, cap_bytes: u64, busy: &dyn Fn(&Path) -> bool) -> Result<(), ImageError> {
        let entries = self.list()?;
        let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
        if total <= cap_bytes {
            return Ok(());
        }
        let now = SystemTime::now();
        for entry in entries.iter().rev() {
            if total <= cap_bytes {
                break;
            }
            let recent = now
                .duration_since(entry.last_used)
                .map_or(true, |age| age < EVICTION_GRACE);
            if entry.in_use || recent || busy(&entry.path) {
                continue;
            }
            let removed = match entry.kind {
                EntryKind::Blob => self.downloads.with(&entry.digest, || {
                    !self.pins.lock().contains_key(&entry.path)
                        && fs::remove_file(&entry.path).is_ok()
                }),
                EntryKind::BaseDisk => fs::remove_file(&entry.path).is_ok(),
            };
            if removed {
                total = total.saturating_sub(entry.bytes);
                log::info!(
                    "op=image-cache-evict kind={:?} digest={} bytes={}",
                    entry.kind,
                    entry.digest,
                    entry.bytes
                );
            }
        }
        if total > cap_bytes {
            log::warn!(
                "op=image-cache-evict cacheBytes={total} capBytes={cap_bytes} \
                 note=\"the rest is in use or recently used\""
            );
        }
        Ok(())
    }
}

/// `<hex>-<size>M.ext4` → (`sha256:<hex>`, size).
pub fn parse_disk_name(name: &str) -> Option<(String, u32)> {
    let stem = name.strip_suffix("M.ext4")?;
    let (hex, size) = stem.split_once('-')?;
    let digest = format!("sha256:{hex}");
    digest_hex(&digest).ok()?;
    Some((digest, size.parse().ok()?))
}

/// Marks `path` as just used.
pub fn touch(path: &Path) {
    if let Ok(f) = File::options().append(true).open(path) {
        let _ = f.set_modified(SystemTime::now());
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => a == b,
    }
}

/// The backing files of the qcow2 images under the state dir (the cache dir's parent),
/// outside the cache itself: sandbox overlays and snapshot disks.
fn overlay_backing_files(cache_root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Some(state_dir) = cache_root.parent() else {
        return out;
    };
    let mut stack = vec![(state_dir.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(rd) = fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let path = e.path();
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() && depth < OVERLAY_SCAN_DEPTH && path != cache_root {
                stack.push((path, depth + 1));
            } else if ft.is_file() {
                if let Some(backing) = qcow2_backing_file(&path) {
                    out.push(backing);
                }
            }
        }
    }
    out
}

/// The backing file named in a qcow2 header, resolved against the image's directory.
pub fn qcow2_backing_file(path: &Path) -> Option<PathBuf> {
    let mut f = File::open(path).ok()?;
    let mut header = [0u8; 20];
    f.read_exact(&mut header).ok()?;
    if &header[..4] != b"QFI\xfb" {
        return None;
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().ok()?);
    let len = u32::from_be_bytes(header[16..20].try_into().ok()?);
    if offset == 0 || len == 0 || len > 4096 {
        return None;
    }
    let mut name = vec![0u8; len as usize];
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(offset)).ok()?;
    f.read_exact(&mut name).ok()?;
    let name = PathBuf::from(String::from_utf8(name).ok()?);
    Some(if name.is_absolute() {
        name
    } else {
        path.parent()?.join(name)
    })
}

#[cfg(test)]
mod tests {
    use super::super::layout::sha256_digest;
    use super::super::testutil::TempDir;
    use super::*;

    #[test]
    fn a_corrupt_or_short_download_never_becomes_an_entry() {
        let t = TempDir::new("cache-verify");
        let cache = BlobCache::new(t.path().to_path_buf());
        let data = b"hello blob".to_vec();
        let digest = sha256_digest(&data);
        let bad = b"hellO blob".to_vec();
        let err = cache
            .get_or_fetch(&digest, Some(10), "blob x", || {
                Ok(Box::new(io::Cursor::new(bad)))
            })
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::BadImage(m) if m.contains("digest")),
            "{err}"
        );
        let err = cache
            .get_or_fetch(&digest, Some(11), "blob x", || {
                Ok(Box::new(io::Cursor::new(data.clone())))
            })
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::BadImage(m) if m.contains("descriptor")),
            "{err}"
        );
        assert!(cache.list().unwrap().is_empty());
        assert_eq!(fs::read_dir(cache.tmp_dir()).unwrap().count(), 0);

        let path = cache
            .get_or_fetch(&digest, Some(10), "blob x", || {
                Ok(Box::new(io::Cursor::new(data.clone())))
            })
            .unwrap();
        assert_eq!(fs::read(&path).unwrap(), data);
        // Cached: the fetcher is not called again.
        let again = cache
            .get_or_fetch(&digest, Some(10), "blob x", || panic!("fetched twice"))
            .unwrap();
        assert_eq!(again, path);
        let listed = cache.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].digest, digest);
        assert_eq!(listed[0].kind, EntryKind::Blob);
    }

    #[test]
    fn eviction_removes_least_recently_used_entries_not_in_use() {
        let t = TempDir::new("cache-evict");
        let root = t.path().join("images");
        let cache = Arc::new(BlobCache::new(root.clone()));
        let old = SystemTime::now() - Duration::from_secs(3600);
        let mut paths = Vec::new();
        for (i, age) in [100u64, 200, 300].iter().enumerate() {
            let data = vec![i as u8 + 1; 64 << 10];
            let p = cache.put(&sha256_digest(&data), &data).unwrap();
            File::options()
                .append(true)
                .open(&p)
                .unwrap()
                .set_modified(old + Duration::from_secs(*age))
                .unwrap();
            paths.push(p);
        }
        // A base disk referenced by a qcow2 overlay elsewhere in the state dir.
        let disk = root.join(format!("{}-64M.ext4", "a".repeat(64)));
        fs::write(&disk, vec![1u8; 64 << 10]).unwrap();
        File::options()
            .append(true)
            .open(&disk)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let overlay_dir = t.path().join("sandboxes/x");
        fs::create_dir_all(&overlay_dir).unwrap();
        let name = disk.display().to_string();
        let mut header = vec![0u8; 512];
        header[..4].copy_from_slice(b"QFI\xfb");
        header[8..16].copy_from_slice(&(104u64).to_be_bytes());
        header[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
        header[104..104 + name.len()].copy_from_slice(name.as_bytes());
        fs::write(overlay_dir.join("disk.qcow2"), header).unwrap();
        assert_eq!(
            qcow2_backing_file(&overlay_dir.join("disk.qcow2")).unwrap(),
            disk
        );

        let _pin = cache.pin(&paths[0]);
        // Room for three 64 KiB entries: the pinned oldest blob and the disk in use stay,
        // the next oldest blob goes.
        cache.evict(3 * (64 << 10) + 8192, &|_| false).unwrap();
        assert!(paths[0].exists() && disk.exists());
        assert!(!paths[1].exists());
        assert!(paths[2].exists());
        let entries = cache.list().unwrap();
        assert!(entries
            .iter()
            .any(|e| e.kind == EntryKind::BaseDisk && e.in_use));
        assert_eq!(
            parse_disk_name(&format!("{}-2048M.ext4", "b".repeat(64)))
                .unwrap()
                .1,
            2048
        );
    }
}
