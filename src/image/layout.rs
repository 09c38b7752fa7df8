//! Reading images: blob sources (a local OCI layout; registries are in `registry.rs`), descriptor
//! resolution from index to manifest to config, and digest verification of every blob.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::ImageError;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const DOCKER_FOREIGN_GZIP: &str = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip";
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Manifests, indexes and configs larger than this are refused rather than read into memory.
const MAX_JSON_BLOB: u64 = 8 << 20;
/// Nested indexes deeper than this are refused.
const MAX_INDEX_DEPTH: usize = 4;

/// Lowercase hex of a byte string.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `sha256:<hex>` of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(data)))
}

/// The hex part of a `sha256:` digest, checked so it can be used as a file name.
pub fn digest_hex(digest: &str) -> Result<&str, ImageError> {
    match digest.split_once(':') {
        Some(("sha256", h))
            if h.len() == 64 && h.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')) =>
        {
            Ok(h)
        }
        _ => Err(ImageError::BadImage(format!(
            "unsupported or malformed digest {digest:?} (only sha256 is supported)"
        ))),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

/// An OCI content descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl Descriptor {
    pub fn ref_name(&self) -> Option<&str> {
        self.annotations.get(REF_NAME).map(String::as_str)
    }

    fn is_linux_amd64(&self) -> bool {
        self.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    }

    fn platform_name(&self) -> String {
        match &self.platform {
            Some(p) => format!("{}/{}", p.os, p.architecture),
            None => "unknown platform".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub manifests: Vec<Descriptor>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// The parts of an image config agentenv uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub config: RuntimeConfig,
    pub rootfs: RootFs,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RuntimeConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type")]
    pub kind: String,
    pub diff_ids: Vec<String>,
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
}

/// Maps a layer media type to its compression; unknown or unsupported types are errors.
pub fn layer_compression(media_type: &str) -> Result<Compression, ImageError> {
    match media_type {
        OCI_LAYER_TAR | "application/vnd.oci.image.layer.nondistributable.v1.tar" => {
            Ok(Compression::None)
        }
        OCI_LAYER_GZIP
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | DOCKER_LAYER_GZIP
        | DOCKER_FOREIGN_GZIP => Ok(Compression::Gzip),
        OCI_LAYER_ZSTD | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => {
            Err(ImageError::Unsupported(
                "zstd-compressed layers are not supported yet; convert the image with \
                 `skopeo copy --dest-compress-format gzip`"
                    .into(),
            ))
        }
        other => Err(ImageError::BadImage(format!(
            "unknown layer media type {other:?}"
        ))),
    }
}

/// Where blobs come from. The resolver and unpacker only see this trait, so a registry
/// source can be added beside the local layout without touching them.
pub trait BlobSource: Send + Sync {
    /// The descriptor the reference names: a manifest or an index, not yet platform-resolved.
    fn root_descriptor(&self) -> Result<Descriptor, ImageError>;
    /// Opens the blob `desc` names. The reader is not verified; callers wrap it in a
    /// [`VerifyingReader`].
    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send>, ImageError>;
    /// Makes the layers local before they are applied (a registry downloads them in
    /// parallel into the cache), adding their bytes to `progress`. Local sources have
    /// nothing to do.
    fn prefetch(
        &self,
        _layers: &[Descriptor],
        _progress: &super::Progress,
    ) -> Result<(), ImageError> {
        Ok(())
    }
}

/// A local OCI image layout directory (as skopeo and umoci write them).
pub struct LayoutSource {
    root: PathBuf,
    tag: Option<String>,
}

impl LayoutSource {
    pub fn new(root: PathBuf, tag: Option<String>) -> LayoutSource {
        LayoutSource { root, tag }
    }

    fn read_index(&self) -> Result<Index, ImageError> {
        let marker = self.root.join("oci-layout");
        if !self.root.is_dir() {
            return Err(ImageError::NotFound(format!(
                "OCI layout directory {} does not exist",
                self.root.display()
            )));
        }
        if !marker.is_file() {
            return Err(ImageError::BadImage(format!(
                "{} is not an OCI image layout (no oci-layout file)",
                self.root.display()
            )));
        }
        let path = self.root.join("index.json");
        let bytes = read_limited(&path, MAX_JSON_BLOB)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            ImageError::BadImage(format!("{} is not a valid OCI index: {e}", path.display()))
        })
    }
}

impl BlobSource for LayoutSource {
    fn root_descriptor(&self) -> Result<Descriptor, ImageError> {
        let index = self.read_index()?;
        let candidates: Vec<&Descriptor> = match &self.tag {
            Some(tag) => index
                .manifests
                .iter()
                .filter(|d| d.ref_name() == Some(tag.as_str()))
                .collect(),
            None => index.manifests.iter().collect(),
        };
        let tags = || {
            let t: Vec<&str> = index
                .manifests
                .iter()
                .filter_map(|d| d.ref_name())
                .collect();
            if t.is_empty() {
                "none".to_string()
            } else {
                t.join(", ")
            }
        };
        match candidates.as_slice() {
            [] => Err(match &self.tag {
                Some(tag) => ImageError::NotFound(format!(
                    "tag {tag:?} not found in {}/index.json (tags: {})",
                    self.root.display(),
                    tags()
                )),
                None => ImageError::BadImage(format!(
                    "{}/index.json lists no manifests",
                    self.root.display()
                )),
            }),
            [one] => Ok((*one).clone()),
            many => {
                // Several entries for one name: a platform list written straight into
                // index.json. Pick linux/amd64 like an index would.
                let amd64: Vec<&&Descriptor> = many.iter().filter(|d| d.is_linux_amd64()).collect();
                match amd64.as_slice() {
                    [one] => Ok((**one).clone()),
                    _ => Err(ImageError::InvalidReference(format!(
                        "{}/index.json lists {} images and no single linux/amd64 one; \
                         name one with oci:{}:<tag> (tags: {})",
                        self.root.display(),
                        many.len(),
                        self.root.display(),
                        tags()
                    ))),
                }
            }
        }
    }

    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send>, ImageError> {
        let hex = digest_hex(&desc.digest)?;
        let path = self.root.join("blobs").join("sha256").join(hex);
        match File::open(&path) {
            Ok(f) => Ok(Box::new(f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ImageError::BadImage(format!(
                "blob {} is missing from the layout ({})",
                desc.digest,
                path.display()
            ))),
            Err(e) => Err(ImageError::Io(format!(
                "cannot open {}: {e}",
                path.display()
            ))),
        }
    }
}

fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, ImageError> {
    let f = File::open(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => ImageError::BadImage(format!("{} is missing", path.display())),
        _ => ImageError::Io(format!("cannot open {}: {e}", path.display())),
    })?;
    let mut buf = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| ImageError::Io(format!("cannot read {}: {e}", path.display())))?;
    if buf.len() as u64 > limit {
        return Err(ImageError::BadImage(format!(
            "{} is larger than {limit} bytes",
            path.display()
        )));
    }
    Ok(buf)
}

/// Hashes everything read through it; [`VerifyingReader::finish`] drains the rest and
/// compares digest and size with what was expected.
pub struct VerifyingReader<R> {
    inner: R,
    hasher: Sha256,
    read: u64,
    expected_digest: String,
    expected_size: Option<u64>,
    what: String,
}

impl<R: Read> VerifyingReader<R> {
    pub fn new(
        inner: R,
        expected_digest: &str,
        expected_size: Option<u64>,
        what: String,
    ) -> VerifyingReader<R> {
        VerifyingReader {
            inner,
            hasher: Sha256::new(),
            read: 0,
            expected_digest: expected_digest.to_string(),
            expected_size,
            what,
        }
    }

    /// The inner reader, without reading the rest or checking anything (the stream was
    /// refused already).
    pub fn into_inner_unchecked(self) -> R {
        self.inner
    }

    /// Like [`VerifyingReader::finish`], but refuses a stream with more than `limit` bytes
    /// left (data after a layer's tar archive ends, where a decompression bomb could
    /// hide).
    pub fn finish_within(mut self, limit: u64) -> Result<R, ImageError> {
        let left = io::copy(&mut (&mut self).take(limit + 1), &mut io::sink())
            .map_err(|e| ImageError::BadImage(format!("{} is corrupt: {e}", self.what)))?;
        if left > limit {
            return Err(ImageError::BadImage(format!(
                "{} has more than {limit} bytes after the end of its tar archive",
                self.what
            )));
        }
        self.finish()
    }

    /// Reads to EOF, then checks digest and size. Returns the inner reader.
    pub fn finish(mut self) -> Result<R, ImageError> {
        io::copy(&mut self, &mut io::sink()).map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData
            | io::ErrorKind::InvalidInput
            | io::ErrorKind::UnexpectedEof => {
                ImageError::BadImage(format!("{} is corrupt: {e}", self.what))
            }
            _ => ImageError::Io(format!("reading {}: {e}", self.what)),
        })?;
        if let Some(size) = self.expected_size {
            if size != self.read {
                return Err(ImageError::BadImage(format!(
                    "{} is {} bytes, its descriptor says {size}",
                    self.what, self.read
                )));
            }
        }
        let actual = format!("sha256:{}", hex(&self.hasher.finalize()));
        if actual != self.expected_digest {
            return Err(ImageError::BadImage(format!(
                "{} has digest {actual}, expected {}",
                self.what, self.expected_digest
            )));
        }
        Ok(self.inner)
    }
}

impl<R: Read> Read for VerifyingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        if let Some(size) = self.expected_size {
            if self.read > size {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} is longer than its descriptor's {size} bytes", self.what),
                ));
            }
        }
        Ok(n)
    }
}

/// Reads a small JSON blob fully and verifies it against its descriptor.
pub fn fetch_json_blob(source: &dyn BlobSource, desc: &Descriptor) -> Result<Vec<u8>, ImageError> {
    digest_hex(&desc.digest)?;
    if desc.size > MAX_JSON_BLOB {
        return Err(ImageError::BadImage(format!(
            "{} {} is {} bytes, more than the {MAX_JSON_BLOB} allowed",
            desc.media_type, desc.digest, desc.size
        )));
    }
    let what = format!("blob {}", desc.digest);
    let mut reader =
        VerifyingReader::new(source.open_blob(desc)?, &desc.digest, Some(desc.size), what);
    let mut buf = Vec::with_capacity(desc.size as usize);
    reader.read_to_end(&mut buf).map_err(|e| match e.kind() {
        io::ErrorKind::InvalidData => ImageError::BadImage(e.to_string()),
        _ => ImageError::Io(format!("reading blob {}: {e}", desc.digest)),
    })?;
    reader.finish()?;
    Ok(buf)
}

/// An image resolved down to one platform manifest and its config, all verified.
#[derive(Debug, Clone)]
pub struct ResolvedImage {
    pub manifest_digest: String,
    pub manifest: Manifest,
    pub config: ImageConfig,
}

/// Walks from the source's root descriptor through (possibly nested) indexes to the
/// linux/amd64 manifest, then reads and checks its config.
pub fn resolve(source: &dyn BlobSource) -> Result<ResolvedImage, ImageError> {
    let mut desc = source.root_descriptor()?;
    for _ in 0..=MAX_INDEX_DEPTH {
        match desc.media_type.as_str() {
            OCI_INDEX | DOCKER_LIST => {
                let bytes = fetch_json_blob(source, &desc)?;
                let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
                    ImageError::BadImage(format!("index {} is not valid: {e}", desc.digest))
                })?;
                desc = select_platform(&index, &desc.digest)?;
            }
            OCI_MANIFEST | DOCKER_MANIFEST => return read_manifest(source, &desc),
            other => {
                return Err(ImageError::BadImage(format!(
                    "unknown manifest media type {other:?} for {}",
                    desc.digest
                )))
            }
        }
    }
    Err(ImageError::BadImage(format!(
        "indexes nested deeper than {MAX_INDEX_DEPTH} levels"
    )))
}

fn select_platform(index: &Index, index_digest: &str) -> Result<Descriptor, ImageError> {
    if let Some(d) = index.manifests.iter().find(|d| d.is_linux_amd64()) {
        return Ok(d.clone());
    }
    match index.manifests.as_slice() {
        [only] if only.platform.is_none() => Ok(only.clone()),
        manifests => {
            let have: Vec<String> = manifests.iter().map(Descriptor::platform_name).collect();
            Err(ImageError::Unsupported(format!(
                "index {index_digest} has no linux/amd64 image (it has: {})",
                if have.is_empty() {
                    "nothing".to_string()
                } else {
                    have.join(", ")
                }
            )))
        }
    }
}

fn read_manifest(source: &dyn BlobSource, desc: &Descriptor) -> Result<ResolvedImage, ImageError> {
    let bytes = fetch_json_blob(source, desc)?;
    let manifest: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| ImageError::BadImage(format!("manifest {} is not valid: {e}", desc.digest)))?;
    if let Some(mt) = &manifest.media_type {
        if mt != &desc.media_type {
            return Err(ImageError::BadImage(format!(
                "manifest {} says media type {mt:?}, its descriptor says {:?}",
                desc.digest, desc.media_type
            )));
        }
    }
    match manifest.config.media_type.as_str() {
        OCI_CONFIG | DOCKER_CONFIG => {}
        other => {
            return Err(ImageError::BadImage(format!(
                "unknown config media type {other:?} in manifest {}",
                desc.digest
            )))
        }
    }
    for layer in &manifest.layers {
        layer_compression(&layer.media_type)?;
        digest_hex(&layer.digest)?;
    }
    let config_bytes = fetch_json_blob(source, &manifest.config)?;
    let config: ImageConfig = serde_json::from_slice(&config_bytes).map_err(|e| {
        ImageError::BadImage(format!(
            "image config {} is not valid: {e}",
            manifest.config.digest
        ))
    })?;
    if !config.os.is_empty() && config.os != "linux" {
        return Err(ImageError::Unsupported(format!(
            "image {} is for {}/{}, only linux/amd64 images boot",
            desc.digest, config.os, config.architecture
        )));
    }
    if !config.architecture.is_empty() && config.architecture != "amd64" {
        return Err(ImageError::Unsupported(format!(
            "image {} is for {}/{}, only linux/amd64 images boot",
            desc.digest, config.os, config.architecture
        )));
    }
    if config.rootfs.diff_ids.len() != manifest.layers.len() {
        return Err(ImageError::BadImage(format!(
            "image config {} lists {} diff_ids for {} layers",
            manifest.config.digest,
            config.rootfs.diff_ids.len(),
            manifest.layers.len()
        )));
    }
    for id in &config.rootfs.diff_ids {
        digest_hex(id)?;
    }
    Ok(ResolvedImage {
        manifest_digest: desc.digest.clone(),
        manifest,
        config,
    })
}
