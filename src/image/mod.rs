//! Images: reference parsing, registry pulls, blob reading with digest checks, layer
//! unpacking and the ext4 root disk cache.
//!
//! `prepare_rootfs` resolves a reference (a local OCI layout or a registry image) to one
//! linux/amd64 manifest, and either finds `<cache>/<manifest hex>-<size>M.ext4` or builds
//! it: registry layers are downloaded into the blob cache (see `cache.rs`), layers are
//! verified and applied to a staging directory, which `mkfs.ext4 -d` turns into a temp
//! image that is renamed into place. Everything temporary lives under `<cache>/tmp` and is
//! removed on every path.

pub mod cache;
pub mod layout;
mod progress;
pub mod reference;
pub mod registry;
pub mod rootfs;
pub mod unpack;
pub mod writer;

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cache::{BlobCache, KeyedLocks};
pub use cache::{CacheEntry, EntryKind};
use layout::{BlobSource, Compression, LayoutSource, ResolvedImage, VerifyingReader};
pub use progress::{ImagePhase, Progress};
pub use reference::{Reference, RegistryReference};
use registry::RegistryClient;
pub use registry::{ImageOptions, RegistrySource};
pub use writer::{build_busybox_layout, ImageSpec, LayerBlob, LayerBuilder, LayoutWriter};

/// Why an image could not be prepared. Messages name the reference and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageError {
    /// The reference string is malformed or ambiguous.
    InvalidReference(String),
    /// The layout, repository, tag or image does not exist.
    NotFound(String),
    /// The registry refused access (no or wrong credentials).
    Denied(String),
    /// The registry (or its token server) is unreachable, timed out or failed (5xx).
    Upstream(String),
    /// The image is corrupt or hostile: digest mismatch, missing blob, escaping path,
    /// unknown media type.
    BadImage(String),
    /// The unpacked image does not fit the requested disk size.
    TooSmall { needed_mb: u32 },
    /// Valid, but not something agentenv can use (yet).
    Unsupported(String),
    /// A host-side failure (disk full, mkfs missing, permissions).
    Io(String),
}

impl ImageError {
    /// Whether the caller is at fault (HTTP 400) rather than the host (500) or the
    /// registry (502).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, ImageError::Io(_) | ImageError::Upstream(_))
    }

    /// Whether a registry failed (HTTP 502).
    pub fn is_upstream(&self) -> bool {
        matches!(self, ImageError::Upstream(_))
    }

    /// Prefixes the message with `context` (a reference or layer name).
    pub fn in_context(self, context: &str) -> ImageError {
        match self {
            ImageError::InvalidReference(m) => {
                ImageError::InvalidReference(format!("{context}: {m}"))
            }
            ImageError::NotFound(m) => ImageError::NotFound(format!("{context}: {m}")),
            ImageError::Denied(m) => ImageError::Denied(format!("{context}: {m}")),
            ImageError::Upstream(m) => ImageError::Upstream(format!("{context}: {m}")),
            ImageError::BadImage(m) => ImageError::BadImage(format!("{context}: {m}")),
            ImageError::Unsupported(m) => ImageError::Unsupported(format!("{context}: {m}")),
            ImageError::Io(m) => ImageError::Io(format!("{context}: {m}")),
            too_small @ ImageError::TooSmall { .. } => too_small,
        }
    }
}

impl fmt::Display for ImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageError::InvalidReference(m) => write!(f, "invalid image reference {m}"),
            ImageError::NotFound(m) => write!(f, "image not found: {m}"),
            ImageError::Denied(m) => write!(f, "image access denied: {m}"),
            ImageError::Upstream(m) => write!(f, "image registry failed: {m}"),
            ImageError::BadImage(m) => write!(f, "bad image: {m}"),
            ImageError::TooSmall { needed_mb } => write!(
                f,
                "the image does not fit the requested disk size; ask for at least {needed_mb} MiB"
            ),
            ImageError::Unsupported(m) => write!(f, "unsupported image: {m}"),
            ImageError::Io(m) => write!(f, "image preparation failed: {m}"),
        }
    }
}

impl std::error::Error for ImageError {}

/// Where the time of one `prepare_rootfs` went, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimings {
    /// Manifest and config: from the registry (or cache), verified.
    pub resolve_ms: u64,
    /// Layer downloads into the blob cache (0 for local layouts and cache hits).
    pub download_ms: u64,
    /// Decompressing, verifying and applying the layers.
    pub unpack_ms: u64,
    /// `mkfs.ext4 -d`, fsync and rename.
    pub mkfs_ms: u64,
    pub total_ms: u64,
    /// Whether the base disk was already cached.
    pub cache_hit: bool,
}

/// A ready base disk and the config a sandbox needs from the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedImage {
    /// Normalised reference, e.g. `oci:/abs/path:tag`.
    pub reference: String,
    /// `sha256:…` of the platform manifest the disk was built from.
    pub manifest_digest: String,
    /// Raw ext4 image; shared and never written by VMs (they get qcow2 overlays).
    pub base_disk: PathBuf,
    pub env: Vec<(String, String)>,
    pub working_dir: Option<String>,
    pub cmd: Option<Vec<String>>,
    pub entrypoint: Option<Vec<String>>,
}

/// The image cache under `<state_dir>/images`: pulled blobs and built ext4 base disks.
pub struct ImageStore {
    cache_dir: PathBuf,
    cache: Arc<BlobCache>,
    client: Arc<RegistryClient>,
    cache_max_bytes: u64,
    /// One lock per base disk, so concurrent callers build each disk once. Other images
    /// and other callers never wait for a build.
    building: KeyedLocks,
    builds: AtomicU64,
    last_timings: parking_lot::Mutex<PhaseTimings>,
}

impl ImageStore {
    /// A store caching under `cache_dir` with default options (anonymous pulls, no cap).
    pub fn new(cache_dir: PathBuf) -> ImageStore {
        ImageStore::with_options(cache_dir, ImageOptions::default())
    }

    /// A store caching under `cache_dir`. Leftovers of pulls and builds interrupted by a
    /// crash (`<cache_dir>/tmp`) are removed: one server owns a state dir.
    pub fn with_options(cache_dir: PathBuf, options: ImageOptions) -> ImageStore {
        let tmp = cache_dir.join("tmp");
        if tmp.exists() {
            if let Err(e) = fs::remove_dir_all(&tmp) {
                log::warn!("op=image-cache-cleanup path={} error={e}", tmp.display());
            }
        }
        ImageStore {
            cache: Arc::new(BlobCache::new(cache_dir.clone())),
            cache_max_bytes: options.cache_max_mb.saturating_mul(1 << 20),
            client: Arc::new(RegistryClient::new(options)),
            cache_dir,
            building: KeyedLocks::default(),
            builds: AtomicU64::new(0),
            last_timings: parking_lot::Mutex::new(PhaseTimings::default()),
        }
    }

    /// The phases of the most recent `prepare_rootfs` that succeeded (for benchmarks).
    pub fn last_timings(&self) -> PhaseTimings {
        *self.last_timings.lock()
    }

    /// What the cache holds, most recently used first.
    pub fn list_cache(&self) -> Result<Vec<CacheEntry>, ImageError> {
        self.cache.list()
    }

    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// How many disks this store has built (not found cached) since it was created.
    pub fn builds(&self) -> u64 {
        self.builds.load(Ordering::Relaxed)
    }

    /// Resolves, verifies, unpacks and builds (or finds cached) the ext4 base for
    /// `reference` at `disk_size_mb`.
    pub fn prepare_rootfs(
        &self,
        reference: &str,
        disk_size_mb: u32,
    ) -> Result<PreparedImage, ImageError> {
        self.prepare_rootfs_with(reference, disk_size_mb, &Progress::default())
    }

    /// [`ImageStore::prepare_rootfs`], reporting its phases and layer bytes to `progress`.
    pub fn prepare_rootfs_with(
        &self,
        reference: &str,
        disk_size_mb: u32,
        progress: &Progress,
    ) -> Result<PreparedImage, ImageError> {
        let parsed = Reference::parse(reference)?;
        let normalised = parsed.to_string();
        self.prepare_parsed(&parsed, disk_size_mb, progress)
            .map_err(|e| e.in_context(&normalised))
    }

    fn prepare_parsed(
        &self,
        parsed: &Reference,
        disk_size_mb: u32,
        progress: &Progress,
    ) -> Result<PreparedImage, ImageError> {
        if disk_size_mb == 0 {
            return Err(ImageError::InvalidReference(
                "disk size must be positive".into(),
            ));
        }
        let started = Instant::now();
        let source = self.source_for(parsed)?;
        let image = layout::resolve(source.as_ref())?;
        progress.set_total(
            image
                .manifest
                .layers
                .iter()
                .fold(0u64, |sum, l| sum.saturating_add(l.size)),
        );
        let mut timings = PhaseTimings {
            resolve_ms: elapsed_ms(started),
            cache_hit: true,
            ..PhaseTimings::default()
        };
        let hex = layout::digest_hex(&image.manifest_digest)?.to_string();
        let key = format!("{hex}-{disk_size_mb}M");
        let base_disk = self.base_disk_path(&key);

        let built = self.building.with(&key, || {
            if base_disk.is_file() {
                cache::touch(&base_disk);
                return Ok(false);
            }
            self.build(
                source.as_ref(),
                &image,
                &key,
                disk_size_mb,
                &mut timings,
                progress,
            )?;
            self.builds.fetch_add(1, Ordering::Relaxed);
            timings.cache_hit = false;
            log::info!(
                "op=image-build reference={parsed} digest={} sizeMb={disk_size_mb} ms={} \
                 resolveMs={} downloadMs={} unpackMs={} mkfsMs={}",
                image.manifest_digest,
                started.elapsed().as_millis(),
                timings.resolve_ms,
                timings.download_ms,
                timings.unpack_ms,
                timings.mkfs_ms,
            );
            Ok::<bool, ImageError>(true)
        })?;
        timings.total_ms = elapsed_ms(started);
        *self.last_timings.lock() = timings;
        // Built or found cached: nothing is left to pull.
        progress.all_done();
        progress.set_phase(ImagePhase::Done);
        if built && self.cache_max_bytes > 0 {
            let busy = |p: &Path| {
                p == base_disk
                    || p.file_name()
                        .and_then(|n| n.to_str())
                        .and_then(|n| n.strip_suffix(".ext4"))
                        .is_some_and(|k| self.building.busy(k))
            };
            if let Err(e) = self.cache.evict(self.cache_max_bytes, &busy) {
                log::warn!("op=image-cache-evict error={e}");
            }
        }

        let cfg = &image.config.config;
        let env = cfg
            .env
            .iter()
            .flatten()
            .map(|kv| match kv.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (kv.clone(), String::new()),
            })
            .collect();
        Ok(PreparedImage {
            reference: parsed.to_string(),
            manifest_digest: image.manifest_digest.clone(),
            base_disk,
            env,
            working_dir: cfg.working_dir.clone().filter(|w| !w.is_empty()),
            cmd: cfg.cmd.clone(),
            entrypoint: cfg.entrypoint.clone(),
        })
    }

    /// `<cache>/<manifest hex>-<size>M.ext4` for the key `<manifest hex>-<size>M`.
    fn base_disk_path(&self, key: &str) -> PathBuf {
        self.cache_dir.join(format!("{key}.ext4"))
    }

    /// Builds the base disk of `key` ([`ImageStore::base_disk_path`]).
    fn build(
        &self,
        source: &dyn BlobSource,
        image: &ResolvedImage,
        key: &str,
        disk_size_mb: u32,
        timings: &mut PhaseTimings,
        progress: &Progress,
    ) -> Result<(), ImageError> {
        let base_disk = &self.base_disk_path(key);
        let tmp_root = self.cache_dir.join("tmp");
        crate::store::ensure_private_dir(&tmp_root).map_err(|e| ImageError::Io(e.to_string()))?;
        // Compressed layers larger than the disk cannot fit it unpacked: refuse before
        // downloading anything.
        let (_, compressed) = progress.bytes();
        if compressed > u64::from(disk_size_mb) << 20 {
            return Err(ImageError::TooSmall {
                needed_mb: rootfs::needed_mb(rootfs::TreeUsage {
                    data_blocks: compressed.div_ceil(4096),
                    inodes: 0,
                }),
            });
        }
        let started = Instant::now();
        source.prefetch(&image.manifest.layers, progress)?;
        progress.all_done();
        progress.set_phase(ImagePhase::Unpacking);
        timings.download_ms = elapsed_ms(started);
        let started = Instant::now();
        let unique = cache::temp_name(key);
        let staging = TempPath::dir(tmp_root.join(format!("{unique}.staging")))?;
        let mut unpacker =
            unpack::Unpacker::new(staging.path(), unpack::Budget::for_disk(disk_size_mb))?;
        for (layer, diff_id) in image
            .manifest
            .layers
            .iter()
            .zip(&image.config.rootfs.diff_ids)
        {
            apply_verified_layer(&mut unpacker, source, layer, diff_id)?;
        }
        let fixups = unpacker.finish()?;
        timings.unpack_ms = elapsed_ms(started);
        let started = Instant::now();
        progress.set_phase(ImagePhase::BuildingDisk);

        let usage = rootfs::measure(staging.path())?;
        if !rootfs::fits(usage, u64::from(disk_size_mb)) {
            return Err(ImageError::TooSmall {
                needed_mb: rootfs::needed_mb(usage),
            });
        }
        let image_tmp = TempPath::file(tmp_root.join(format!("{unique}.ext4")));
        rootfs::build(staging.path(), image_tmp.path(), disk_size_mb, usage)?;
        let scratch = TempPath::file(tmp_root.join(format!("{unique}.fixups")));
        rootfs::apply_fixups(image_tmp.path(), &fixups, scratch.path())?;
        drop(scratch);
        fs::File::open(image_tmp.path())
            .and_then(|f| f.sync_all())
            .map_err(|e| ImageError::Io(format!("fsync {}: {e}", image_tmp.path().display())))?;
        fs::rename(image_tmp.path(), base_disk).map_err(|e| {
            ImageError::Io(format!(
                "cannot move the built disk to {}: {e}",
                base_disk.display()
            ))
        })?;
        image_tmp.disarm();
        timings.mkfs_ms = elapsed_ms(started);
        Ok(())
    }
}

/// Unpacks one layer blob of `source` into `unpacker`, checking the blob against its
/// descriptor's digest and size and the uncompressed tar against its diff ID.
fn apply_verified_layer(
    unpacker: &mut unpack::Unpacker,
    source: &dyn BlobSource,
    layer: &layout::Descriptor,
    diff_id: &str,
) -> Result<(), ImageError> {
    let what = format!("layer {}", layer.digest);
    let blob = VerifyingReader::new(
        source.open_blob(layer)?,
        &layer.digest,
        Some(layer.size),
        what.clone(),
    );
    let uncompressed = format!("{what} (uncompressed)");
    // A tampered blob is reported as such, not as the tar error it caused. After a
    // refused layer only the compressed blob (bounded by its descriptor's size) is
    // read to its end, never the rest of a decompression bomb.
    match layout::layer_compression(&layer.media_type)? {
        Compression::None => {
            let mut tar = VerifyingReader::new(blob, diff_id, None, uncompressed);
            let applied = unpacker.apply_layer(&mut tar, &what);
            let verified = match &applied {
                Ok(()) => tar.finish().and_then(VerifyingReader::finish),
                Err(_) => tar.into_inner_unchecked().finish(),
            };
            prefer_digest_error(applied, verified.map(drop))?;
        }
        Compression::Gzip => {
            let gz = flate2::read::MultiGzDecoder::new(blob);
            let mut tar = VerifyingReader::new(gz, diff_id, None, uncompressed);
            let applied = unpacker.apply_layer(&mut tar, &what);
            let verified = match &applied {
                Ok(()) => tar
                    .finish_within(TRAILING_LIMIT)
                    .and_then(|gz| gz.into_inner().finish()),
                Err(_) => tar.into_inner_unchecked().into_inner().finish(),
            };
            prefer_digest_error(applied, verified.map(drop))?;
        }
    }
    Ok(())
}

/// Bytes a decompressed layer may hold after its tar archive ends (tar pads to 10 KiB
/// records; writers add at most a little more).
const TRAILING_LIMIT: u64 = 1 << 20;

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A tampered blob usually also breaks the tar or gzip stream; report the digest.
fn prefer_digest_error(
    applied: Result<(), ImageError>,
    verified: Result<(), ImageError>,
) -> Result<(), ImageError> {
    match (applied, verified) {
        (_, Err(e @ ImageError::BadImage(_))) => Err(e),
        (Err(e), _) => Err(e),
        (Ok(()), verified) => verified,
    }
}

impl ImageStore {
    fn source_for(&self, reference: &Reference) -> Result<Box<dyn BlobSource>, ImageError> {
        match reference {
            Reference::Layout { path, tag } => {
                Ok(Box::new(LayoutSource::new(path.clone(), tag.clone())))
            }
            Reference::Registry(r) => Ok(Box::new(RegistrySource::new(
                self.client.clone(),
                self.cache.clone(),
                r.clone(),
            ))),
        }
    }
}

/// A temporary file or directory removed on drop unless disarmed.
pub(crate) struct TempPath {
    path: PathBuf,
    armed: bool,
}

impl TempPath {
    fn dir(path: PathBuf) -> Result<TempPath, ImageError> {
        use std::os::unix::fs::DirBuilderExt;
        let guard = TempPath { path, armed: true };
        // Private: the tree holds an untrusted image's files.
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&guard.path)
            .map_err(|e| ImageError::Io(format!("cannot create {}: {e}", guard.path.display())))?;
        Ok(guard)
    }

    pub(crate) fn file(path: PathBuf) -> TempPath {
        TempPath { path, armed: true }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let result = match fs::symlink_metadata(&self.path) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&self.path),
            Ok(_) => fs::remove_file(&self.path),
            Err(_) => Ok(()),
        };
        if let Err(e) = result {
            log::warn!("op=image-cleanup path={} error={e}", self.path.display());
        }
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};

    static SEQ: AtomicU64 = AtomicU64::new(0);

    /// A scratch directory removed on drop.
    pub struct TempDir(PathBuf);

    impl TempDir {
        pub fn new(name: &str) -> TempDir {
            let p = std::env::temp_dir().join(format!(
                "aenv-image-{}-{}-{name}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TempDir(p)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::layout::{Descriptor, Platform};
    use super::testutil::TempDir;
    use super::*;
    use std::process::Command;

    fn debugfs(img: &Path, request: &str) -> String {
        let out = Command::new("debugfs")
            .arg("-R")
            .arg(request)
            .arg(img)
            .output()
            .expect("debugfs (e2fsprogs) is installed");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn is_root() -> bool {
        crate::sys::files::effective_uid() == 0
    }

    /// Root-only tests fail with a reason instead of passing without running.
    fn require_root() {
        assert!(
            is_root(),
            "needs root (chown, device nodes, mounts): run the suite with sudo"
        );
    }

    fn write_image(layout: &Path, tag: &str, layers: Vec<LayerBlob>) -> Descriptor {
        let mut w = LayoutWriter::create(layout).unwrap();
        let spec = ImageSpec {
            env: vec!["PATH=/bin".into(), "GREETING=a=b".into()],
            working_dir: Some("/srv".into()),
            cmd: Some(vec!["/bin/sh".into()]),
            ..ImageSpec::default()
        };
        let desc = w.add_image(&spec, &layers).unwrap();
        w.tag(desc.clone(), Some(tag));
        w.finish().unwrap();
        desc
    }

    fn two_layer_image(layout: &Path) -> Descriptor {
        let mut l1 = LayerBuilder::new();
        l1.dir("etc", 0o755)
            .file("etc/gone", 0o644, b"lower")
            .file("etc/kept", 0o644, b"kept")
            .dir("srv", 0o755);
        let mut l2 = LayerBuilder::new();
        l2.whiteout("etc/gone").file("etc/new", 0o600, b"upper");
        write_image(
            layout,
            "v1",
            vec![LayerBlob::gzip(l1.finish()), LayerBlob::plain(l2.finish())],
        )
    }

    /// What the cache holds: built disks and leftover temp files.
    fn cache_contents(store: &ImageStore) -> Vec<String> {
        let mut out = Vec::new();
        for dir in [
            store.cache_dir().to_path_buf(),
            store.cache_dir().join("tmp"),
        ] {
            if let Ok(rd) = fs::read_dir(&dir) {
                for e in rd.flatten() {
                    if e.file_name() != "tmp" {
                        out.push(e.path().display().to_string());
                    }
                }
            }
        }
        out
    }

    #[test]
    fn two_layer_image_builds_an_ext4_with_the_whiteout_applied_and_is_cached() {
        require_root();
        let t = TempDir::new("two-layer");
        let layout_dir = t.path().join("layout");
        let manifest = two_layer_image(&layout_dir);
        let store = ImageStore::new(t.path().join("cache"));
        let reference = format!("oci:{}:v1", layout_dir.display());
        let img = store.prepare_rootfs(&reference, 64).unwrap();
        assert_eq!(img.reference, reference);
        assert_eq!(img.manifest_digest, manifest.digest);
        assert_eq!(
            img.env,
            vec![
                ("PATH".to_string(), "/bin".to_string()),
                ("GREETING".to_string(), "a=b".to_string())
            ]
        );
        assert_eq!(img.working_dir.as_deref(), Some("/srv"));
        let listing = debugfs(&img.base_disk, "ls -l /etc");
        assert!(listing.contains("kept"), "{listing}");
        assert!(listing.contains("new"), "{listing}");
        assert!(!listing.contains("gone"), "{listing}");
        assert_eq!(debugfs(&img.base_disk, "cat /etc/new"), "upper");
        let stat = debugfs(&img.base_disk, "stat /etc/new");
        assert!(stat.contains("Mode:  0600"), "{stat}");

        let again = store.prepare_rootfs(&reference, 64).unwrap();
        assert_eq!(again, img);
        assert_eq!(store.builds(), 1);
        assert_eq!(
            cache_contents(&store),
            vec![img.base_disk.display().to_string()]
        );
        // Untagged works too: the layout holds one image.
        let untagged = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 64)
            .unwrap();
        assert_eq!(untagged.base_disk, img.base_disk);
    }

    #[test]
    fn setuid_files_capabilities_and_devices_are_in_the_image_with_nothing_privileged_on_the_host()
    {
        require_root();
        let t = TempDir::new("fixups");
        let layout_dir = t.path().join("layout");
        let mut l1 = LayerBuilder::new();
        l1.dir("bin", 0o755)
            .file_owned("bin/su", 0o4755, 0, 0, b"su")
            .dir("dev", 0o755)
            .char_device("dev/null", 0o666, 1, 3)
            .block_device("dev/vdz", 0o660, 254, 7);
        // Layer 2: bin/ping with a file capability (a PAX xattr record).
        let l2_tar = {
            let mut b = tar::Builder::new(Vec::new());
            let (key, value) = ("SCHILY.xattr.security.capability", b"\x01\x00\x00\x02");
            // "<len> <key>=<value>\n", the length counting itself.
            let body = key.len() + value.len() + 3;
            let mut len = body + 1;
            while len.to_string().len() + body != len {
                len = len.to_string().len() + body;
            }
            let mut record = format!("{len} {key}=").into_bytes();
            record.extend_from_slice(value);
            record.push(b'\n');
            let mut x = tar::Header::new_ustar();
            x.set_entry_type(tar::EntryType::XHeader);
            x.set_mode(0o644);
            x.set_uid(0);
            x.set_gid(0);
            x.set_mtime(0);
            x.set_size(record.len() as u64);
            b.append_data(&mut x, "PaxHeaders/ping", record.as_slice())
                .unwrap();
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            h.set_size(4);
            b.append_data(&mut h, "bin/ping", &b"ping"[..]).unwrap();
            b.into_inner().unwrap()
        };
        write_image(
            &layout_dir,
            "latest",
            vec![LayerBlob::plain(l1.finish()), LayerBlob::plain(l2_tar)],
        );
        let store = ImageStore::new(t.path().join("cache"));
        let img = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 64)
            .unwrap();
        let su = debugfs(&img.base_disk, "stat /bin/su");
        assert!(su.contains("Mode:  04755"), "{su}");
        let null = debugfs(&img.base_disk, "stat /dev/null");
        assert!(
            null.contains("Type: character special") && null.contains("Mode:  0666"),
            "{null}"
        );
        let vdz = debugfs(&img.base_disk, "stat /dev/vdz");
        assert!(
            vdz.contains("Type: block special") && vdz.contains("Mode:  0660"),
            "{vdz}"
        );
        let caps = debugfs(&img.base_disk, "ea_list /bin/ping");
        assert!(caps.contains("security.capability"), "{caps}");
        let fsck = Command::new("e2fsck")
            .args(["-fn"])
            .arg(&img.base_disk)
            .output()
            .unwrap();
        assert!(
            fsck.status.success(),
            "{}",
            String::from_utf8_lossy(&fsck.stdout)
        );
        // Nothing but the finished disk is left, and it is the only file.
        assert_eq!(
            cache_contents(&store),
            vec![img.base_disk.display().to_string()]
        );
    }

    #[test]
    fn concurrent_callers_build_once() {
        require_root();
        let t = TempDir::new("concurrent");
        let layout_dir = t.path().join("layout");
        two_layer_image(&layout_dir);
        let store = Arc::new(ImageStore::new(t.path().join("cache")));
        let reference = format!("oci:{}:v1", layout_dir.display());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                let reference = reference.clone();
                std::thread::spawn(move || store.prepare_rootfs(&reference, 32).unwrap())
            })
            .collect();
        let disks: Vec<PathBuf> = handles
            .into_iter()
            .map(|h| h.join().unwrap().base_disk)
            .collect();
        assert!(disks.iter().all(|d| d == &disks[0]));
        assert_eq!(store.builds(), 1);
    }

    #[test]
    fn tampered_blob_is_refused_and_nothing_is_cached() {
        require_root();
        let t = TempDir::new("tamper");
        let layout_dir = t.path().join("layout");
        let mut l1 = LayerBuilder::new();
        l1.file("data", 0o644, b"original contents");
        let mut w = LayoutWriter::create(&layout_dir).unwrap();
        let desc = w
            .add_image(&ImageSpec::default(), &[LayerBlob::plain(l1.finish())])
            .unwrap();
        w.tag(desc.clone(), Some("latest"));
        let manifest: layout::Manifest =
            serde_json::from_slice(&fs::read(w.blob_path(&desc.digest)).unwrap()).unwrap();
        let blob = w.blob_path(&manifest.layers[0].digest);
        w.finish().unwrap();
        // Same length, different bytes: only the digest can tell.
        let mut bytes = fs::read(&blob).unwrap();
        let pos = bytes.windows(8).position(|w| w == b"original").unwrap();
        bytes[pos..pos + 8].copy_from_slice(b"tampered");
        fs::write(&blob, bytes).unwrap();

        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 32)
            .unwrap_err();
        assert!(matches!(err, ImageError::BadImage(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&manifest.layers[0].digest) && msg.contains("digest"),
            "{msg}"
        );
        assert!(msg.contains(&layout_dir.display().to_string()), "{msg}");
        assert!(err.is_client_error());
        assert!(
            cache_contents(&store).is_empty(),
            "{:?}",
            cache_contents(&store)
        );
    }

    #[test]
    fn tampered_manifest_is_refused() {
        let t = TempDir::new("tamper-manifest");
        let layout_dir = t.path().join("layout");
        let desc = write_image(&layout_dir, "latest", vec![]);
        let path = layout_dir.join("blobs/sha256").join(&desc.digest[7..]);
        let text = fs::read_to_string(&path)
            .unwrap()
            .replace("\"schemaVersion\":2", "\"schemaVersion\":3");
        fs::write(&path, text).unwrap();
        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 32)
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::BadImage(m) if m.contains("expected")),
            "{err}"
        );
    }

    #[test]
    fn missing_blob_is_a_bad_image() {
        let t = TempDir::new("missing");
        let layout_dir = t.path().join("layout");
        let mut l1 = LayerBuilder::new();
        l1.file("x", 0o644, b"x");
        let desc = write_image(&layout_dir, "latest", vec![LayerBlob::gzip(l1.finish())]);
        let manifest: layout::Manifest = serde_json::from_slice(
            &fs::read(layout_dir.join("blobs/sha256").join(&desc.digest[7..])).unwrap(),
        )
        .unwrap();
        fs::remove_file(
            layout_dir
                .join("blobs/sha256")
                .join(&manifest.layers[0].digest[7..]),
        )
        .unwrap();
        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}:latest", layout_dir.display()), 32)
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::BadImage(m) if m.contains("missing")),
            "{err}"
        );
        assert!(cache_contents(&store).is_empty());
    }

    #[test]
    fn unknown_layer_media_type_is_refused() {
        let t = TempDir::new("mediatype");
        let layout_dir = t.path().join("layout");
        let mut l1 = LayerBuilder::new();
        l1.file("x", 0o644, b"x");
        let layer = LayerBlob {
            tar: l1.finish(),
            compression: Compression::None,
            media_type: Some("application/vnd.example.layer.v1.tar+lz4".into()),
        };
        write_image(&layout_dir, "latest", vec![layer]);
        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 32)
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::BadImage(m) if m.contains("unknown layer media type")),
            "{err}"
        );
    }

    #[test]
    fn tags_select_images_and_ambiguity_is_an_error() {
        let t = TempDir::new("tags");
        let layout_dir = t.path().join("layout");
        let mut w = LayoutWriter::create(&layout_dir).unwrap();
        let mut descs = Vec::new();
        for (tag, dir) in [("one", "/one"), ("two", "/two")] {
            let spec = ImageSpec {
                working_dir: Some(dir.into()),
                ..ImageSpec::default()
            };
            let d = w.add_image(&spec, &[]).unwrap();
            w.tag(d.clone(), Some(tag));
            descs.push(d);
        }
        w.finish().unwrap();
        let source =
            |tag: Option<&str>| LayoutSource::new(layout_dir.clone(), tag.map(String::from));
        let two = layout::resolve(&source(Some("two"))).unwrap();
        assert_eq!(two.manifest_digest, descs[1].digest);
        assert_eq!(two.config.config.working_dir.as_deref(), Some("/two"));
        let one = layout::resolve(&source(Some("one"))).unwrap();
        assert_eq!(one.manifest_digest, descs[0].digest);

        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}:three", layout_dir.display()), 32)
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::NotFound(m) if m.contains("\"three\"") && m.contains("one, two")),
            "{err}"
        );
        // Both images are linux/amd64, so without a tag the choice is ambiguous.
        let err = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 32)
            .unwrap_err();
        assert!(
            matches!(&err, ImageError::InvalidReference(m) if m.contains("<tag>")),
            "{err}"
        );
    }

    #[test]
    fn index_selects_linux_amd64_even_when_not_first() {
        let t = TempDir::new("index");
        let layout_dir = t.path().join("layout");
        let mut w = LayoutWriter::create(&layout_dir).unwrap();
        let arm = w
            .add_image(
                &ImageSpec {
                    platform: Some(Platform {
                        architecture: "arm64".into(),
                        os: "linux".into(),
                        variant: Some("v8".into()),
                    }),
                    ..ImageSpec::default()
                },
                &[],
            )
            .unwrap();
        let amd = w
            .add_image(
                &ImageSpec {
                    working_dir: Some("/amd".into()),
                    ..ImageSpec::default()
                },
                &[],
            )
            .unwrap();
        let index = w.add_index(vec![arm.clone(), amd.clone()]).unwrap();
        // Nested: index.json → index blob → manifests.
        w.tag(index, Some("multi"));
        let only_arm = w.add_index(vec![arm]).unwrap();
        w.tag(only_arm, Some("arm"));
        w.finish().unwrap();
        let r =
            layout::resolve(&LayoutSource::new(layout_dir.clone(), Some("multi".into()))).unwrap();
        assert_eq!(r.manifest_digest, amd.digest);
        let err = layout::resolve(&LayoutSource::new(layout_dir, Some("arm".into()))).unwrap_err();
        assert!(
            matches!(&err, ImageError::Unsupported(m) if m.contains("linux/arm64")),
            "{err}"
        );
    }

    #[test]
    fn too_small_names_the_size_needed_and_caches_nothing() {
        require_root();
        let t = TempDir::new("small");
        let layout_dir = t.path().join("layout");
        // Incompressible-ish data: mkfs stores zero blocks sparsely.
        let mut data = vec![0u8; 12 << 20];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for chunk in data.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        let mut l1 = LayerBuilder::new();
        l1.file("big", 0o644, &data);
        write_image(&layout_dir, "latest", vec![LayerBlob::plain(l1.finish())]);
        let store = ImageStore::new(t.path().join("cache"));
        let err = store
            .prepare_rootfs(&format!("oci:{}", layout_dir.display()), 8)
            .unwrap_err();
        assert_eq!(err, ImageError::TooSmall { needed_mb: 1024 });
        assert!(err.to_string().contains("1024 MiB"));
        assert!(cache_contents(&store).is_empty());
    }

    #[test]
    fn unreachable_registries_are_upstream_errors_naming_the_reference() {
        let t = TempDir::new("registry");
        let store = ImageStore::new(t.path().join("cache"));
        // Nothing listens on port 1.
        let err = store
            .prepare_rootfs("127.0.0.1:1/team/app", 1024)
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ImageError::Upstream(_)), "{msg}");
        assert!(err.is_upstream() && !err.is_client_error());
        assert!(msg.contains("127.0.0.1:1/team/app:latest"), "{msg}");
        let err = store.prepare_rootfs("oci:relative", 1024).unwrap_err();
        assert!(matches!(err, ImageError::InvalidReference(_)));
        let err = store
            .prepare_rootfs(&format!("oci:{}/nope", t.path().display()), 1024)
            .unwrap_err();
        assert!(matches!(err, ImageError::NotFound(_)), "{err}");
        assert!(!ImageError::Io("disk full".into()).is_client_error());
    }

    #[test]
    fn busybox_base_image_builds_and_boots_a_shell_tree() {
        let busybox = Path::new("/bin/busybox");
        require_root();
        assert!(
            busybox.is_file(),
            "needs /bin/busybox: run scripts/setup.sh"
        );
        let t = TempDir::new("busybox");
        let layout_dir = t.path().join("base");
        let started = Instant::now();
        build_busybox_layout(busybox, None, &layout_dir).unwrap();
        let layout_ms = started.elapsed().as_millis();
        // Reproducible: a rebuild gives the same manifest, so the disk cache stays valid.
        let index1 = fs::read(layout_dir.join("index.json")).unwrap();
        build_busybox_layout(busybox, None, &layout_dir).unwrap();
        assert_eq!(fs::read(layout_dir.join("index.json")).unwrap(), index1);

        let store = ImageStore::new(t.path().join("cache"));
        let reference = format!("oci:{}:latest", layout_dir.display());
        let started = Instant::now();
        let img = store.prepare_rootfs(&reference, 1024).unwrap();
        let first_ms = started.elapsed().as_millis();
        let started = Instant::now();
        store.prepare_rootfs(&reference, 1024).unwrap();
        let cached_ms = started.elapsed().as_millis();
        eprintln!(
            "busybox layout {layout_ms} ms, first prepare {first_ms} ms, cached {cached_ms} ms"
        );

        assert_eq!(
            img.env,
            vec![("PATH".to_string(), writer::DEFAULT_PATH.to_string())]
        );
        let sh = debugfs(&img.base_disk, "stat /bin/sh");
        assert!(sh.contains("Type: symlink"), "{sh}");
        assert!(sh.contains("Fast link dest: \"busybox\""), "{sh}");
        let tmp = debugfs(&img.base_disk, "stat /tmp");
        assert!(tmp.contains("Mode:  01777"), "{tmp}");
        let bb = debugfs(&img.base_disk, "stat /bin/busybox");
        assert!(
            bb.contains("Mode:  0755") && bb.contains("User:     0"),
            "{bb}"
        );
        let root = debugfs(&img.base_disk, "ls /");
        for dir in ["bin", "etc", "tmp", "root", "dev", "proc", "sys", "run"] {
            assert!(root.contains(dir), "{dir} missing: {root}");
        }
        assert!(debugfs(&img.base_disk, "cat /etc/passwd").starts_with("root:x:0:0:"));
    }
}
