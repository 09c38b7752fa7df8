//! Writing OCI image layouts: the built-in busybox base image, and fixtures for tests.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use flate2::write::GzEncoder;
use sha2::{Digest as _, Sha256};

use super::layout::{
    self, Compression, Descriptor, ImageConfig, Index, Manifest, Platform, RootFs, RuntimeConfig,
};
use super::ImageError;

/// Fixed timestamp for generated entries, so the same inputs give the same digests (and
/// the rootfs cache, keyed by manifest digest, survives rebuilding the layout).
pub const FIXED_MTIME: u64 = 1_700_000_000;

/// Builds a layer tarball in memory. Entries are owned by root and stamped
/// [`FIXED_MTIME`] unless set otherwise.
pub struct LayerBuilder {
    builder: tar::Builder<Vec<u8>>,
}

impl Default for LayerBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl LayerBuilder {
    pub fn new() -> LayerBuilder {
        LayerBuilder {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn header(kind: tar::EntryType, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(FIXED_MTIME);
        h.set_size(0);
        h
    }

    fn append(&mut self, mut h: tar::Header, path: &str, data: &[u8]) -> &mut Self {
        h.set_size(data.len() as u64);
        self.builder
            .append_data(&mut h, path, data)
            .expect("writing a tar entry to memory cannot fail");
        self
    }

    /// Appends an entry with a raw header: the escape hatch for odd or hostile entries
    /// (the path is written verbatim, `..` and absolute paths included).
    pub fn raw(&mut self, mut h: tar::Header, path: &str, data: &[u8]) -> &mut Self {
        h.set_size(data.len() as u64);
        let name = path.as_bytes();
        {
            let gnu = h.as_gnu_mut().expect("raw entries need a GNU header");
            gnu.name = [0; 100];
            gnu.name[..name.len()].copy_from_slice(name);
        }
        h.set_cksum();
        self.builder
            .append(&h, data)
            .expect("writing a tar entry to memory cannot fail");
        self
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> &mut Self {
        self.append(Self::header(tar::EntryType::Directory, mode), path, &[])
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> &mut Self {
        self.append(Self::header(tar::EntryType::Regular, mode), path, data)
    }

    /// A directory with a chosen owner.
    pub fn dir_owned(&mut self, path: &str, mode: u32, uid: u64, gid: u64) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Directory, mode);
        h.set_uid(uid);
        h.set_gid(gid);
        self.append(h, path, &[])
    }

    /// A regular file with a chosen owner.
    pub fn file_owned(
        &mut self,
        path: &str,
        mode: u32,
        uid: u64,
        gid: u64,
        data: &[u8],
    ) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Regular, mode);
        h.set_uid(uid);
        h.set_gid(gid);
        self.append(h, path, data)
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777);
        self.builder
            .append_link(&mut h, path, target)
            .expect("writing a tar entry to memory cannot fail");
        self
    }

    pub fn hardlink(&mut self, path: &str, target: &str) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Link, 0o644);
        self.builder
            .append_link(&mut h, path, target)
            .expect("writing a tar entry to memory cannot fail");
        self
    }

    pub fn char_device(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Char, mode);
        h.set_device_major(major)
            .expect("GNU headers carry device numbers");
        h.set_device_minor(minor)
            .expect("GNU headers carry device numbers");
        self.append(h, path, &[])
    }

    pub fn block_device(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> &mut Self {
        let mut h = Self::header(tar::EntryType::Block, mode);
        h.set_device_major(major)
            .expect("GNU headers carry device numbers");
        h.set_device_minor(minor)
            .expect("GNU headers carry device numbers");
        self.append(h, path, &[])
    }

    /// A GNU sparse file of `real_size` bytes holding `chunks` (offset, data) and holes
    /// elsewhere: at most 4 chunks, in order, the last one ending at `real_size`. Every
    /// chunk but the last is padded with zeros to 512 bytes, as the format requires.
    pub fn sparse(&mut self, path: &str, real_size: u64, chunks: &[(u64, &[u8])]) -> &mut Self {
        assert!(chunks.len() <= 4, "GNU headers hold 4 sparse chunks");
        let mut h = Self::header(tar::EntryType::GNUSparse, 0o644);
        let mut data = Vec::new();
        {
            let gnu = h.as_gnu_mut().expect("a GNU header");
            for (i, (offset, bytes)) in chunks.iter().enumerate() {
                let mut chunk = bytes.to_vec();
                if i + 1 < chunks.len() {
                    chunk.resize(bytes.len().div_ceil(512) * 512, 0);
                }
                gnu.sparse[i].set_offset(*offset);
                gnu.sparse[i].set_length(chunk.len() as u64);
                data.extend_from_slice(&chunk);
            }
            gnu.set_real_size(real_size);
        }
        h.set_size(data.len() as u64);
        self.builder
            .append_data(&mut h, path, data.as_slice())
            .expect("writing a tar entry to memory cannot fail");
        self
    }

    /// Deletes `path` from lower layers (`dir/.wh.name`).
    pub fn whiteout(&mut self, path: &str) -> &mut Self {
        let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
        let wh = if dir.is_empty() {
            format!(".wh.{name}")
        } else {
            format!("{dir}/.wh.{name}")
        };
        self.append(Self::header(tar::EntryType::Regular, 0o644), &wh, &[])
    }

    /// Hides everything lower layers put in `dir`.
    pub fn opaque(&mut self, dir: &str) -> &mut Self {
        let p = format!("{}/.wh..wh..opq", dir.trim_end_matches('/'));
        self.append(Self::header(tar::EntryType::Regular, 0o644), &p, &[])
    }

    pub fn finish(self) -> Vec<u8> {
        self.builder
            .into_inner()
            .expect("writing a tar archive to memory cannot fail")
    }
}

/// One layer for [`LayoutWriter::add_image`].
pub struct LayerBlob {
    pub tar: Vec<u8>,
    pub compression: Compression,
    /// Overrides the media type written into the manifest (tests use it for odd types).
    pub media_type: Option<String>,
}

impl LayerBlob {
    pub fn gzip(tar: Vec<u8>) -> LayerBlob {
        LayerBlob {
            tar,
            compression: Compression::Gzip,
            media_type: None,
        }
    }

    pub fn plain(tar: Vec<u8>) -> LayerBlob {
        LayerBlob {
            tar,
            compression: Compression::None,
            media_type: None,
        }
    }
}

/// The config an image is written with.
#[derive(Debug, Clone, Default)]
pub struct ImageSpec {
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub cmd: Option<Vec<String>>,
    pub entrypoint: Option<Vec<String>>,
    /// Defaults to linux/amd64.
    pub platform: Option<Platform>,
}

/// Writes a valid OCI image layout: `oci-layout`, `blobs/sha256/*` and, on
/// [`LayoutWriter::finish`], `index.json` (written last, atomically).
pub struct LayoutWriter {
    root: PathBuf,
    entries: Vec<Descriptor>,
}

impl LayoutWriter {
    /// Creates (or reuses) the layout directory at `root`.
    pub fn create(root: &Path) -> Result<LayoutWriter, ImageError> {
        let io = |e: std::io::Error| {
            ImageError::Io(format!("cannot write layout {}: {e}", root.display()))
        };
        fs::create_dir_all(root.join("blobs").join("sha256")).map_err(io)?;
        write_atomic(
            &root.join("oci-layout"),
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )?;
        Ok(LayoutWriter {
            root: root.to_path_buf(),
            entries: Vec::new(),
        })
    }

    /// The path of a blob in this layout.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.root.join("blobs").join("sha256").join(hex)
    }

    /// Stores `bytes` as a blob and returns its descriptor.
    pub fn add_blob(&self, media_type: &str, bytes: &[u8]) -> Result<Descriptor, ImageError> {
        let digest = layout::sha256_digest(bytes);
        let path = self.blob_path(&digest);
        if !path.exists() {
            write_atomic(&path, bytes)?;
        }
        Ok(Descriptor {
            media_type: media_type.to_string(),
            digest,
            size: bytes.len() as u64,
            platform: None,
            annotations: BTreeMap::new(),
        })
    }

    /// Writes layers, config and manifest; returns the manifest's descriptor (with the
    /// image's platform), not yet listed in index.json.
    pub fn add_image(
        &self,
        spec: &ImageSpec,
        layers: &[LayerBlob],
    ) -> Result<Descriptor, ImageError> {
        let mut layer_descs = Vec::new();
        let mut diff_ids = Vec::new();
        for layer in layers {
            diff_ids.push(format!(
                "sha256:{}",
                layout::hex(&Sha256::digest(&layer.tar))
            ));
            let (bytes, default_type) = match layer.compression {
                Compression::None => (layer.tar.clone(), layout::OCI_LAYER_TAR),
                Compression::Gzip => {
                    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::default());
                    enc.write_all(&layer.tar)
                        .and_then(|_| enc.finish())
                        .map(|b| (b, layout::OCI_LAYER_GZIP))
                        .map_err(|e| ImageError::Io(format!("gzip: {e}")))?
                }
            };
            let mt = layer.media_type.as_deref().unwrap_or(default_type);
            layer_descs.push(self.add_blob(mt, &bytes)?);
        }
        let platform = spec.platform.clone().unwrap_or(Platform {
            architecture: "amd64".into(),
            os: "linux".into(),
            variant: None,
        });
        let config = ImageConfig {
            architecture: platform.architecture.clone(),
            os: platform.os.clone(),
            config: RuntimeConfig {
                env: Some(spec.env.clone()),
                working_dir: spec.working_dir.clone(),
                cmd: spec.cmd.clone(),
                entrypoint: spec.entrypoint.clone(),
                user: None,
            },
            rootfs: RootFs {
                kind: "layers".into(),
                diff_ids,
            },
        };
        let config_bytes = to_json(&config)?;
        let config_desc = self.add_blob(layout::OCI_CONFIG, &config_bytes)?;
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(layout::OCI_MANIFEST.into()),
            config: config_desc,
            layers: layer_descs,
        };
        let mut desc = self.add_blob(layout::OCI_MANIFEST, &to_json(&manifest)?)?;
        desc.platform = Some(platform);
        Ok(desc)
    }

    /// Writes an index blob listing `manifests` (a multi-platform image).
    pub fn add_index(&self, manifests: Vec<Descriptor>) -> Result<Descriptor, ImageError> {
        let index = Index {
            schema_version: 2,
            media_type: Some(layout::OCI_INDEX.into()),
            manifests,
        };
        self.add_blob(layout::OCI_INDEX, &to_json(&index)?)
    }

    /// Lists `desc` in index.json, tagged `tag` when given.
    pub fn tag(&mut self, mut desc: Descriptor, tag: Option<&str>) {
        if let Some(tag) = tag {
            self.entries.retain(|d| d.ref_name() != Some(tag));
            desc.annotations
                .insert(layout::REF_NAME.to_string(), tag.to_string());
        }
        self.entries.push(desc);
    }

    /// Writes index.json.
    pub fn finish(self) -> Result<(), ImageError> {
        let index = Index {
            schema_version: 2,
            media_type: Some(layout::OCI_INDEX.into()),
            manifests: self.entries,
        };
        write_atomic(&self.root.join("index.json"), &to_json(&index)?)
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, ImageError> {
    serde_json::to_vec(v).map_err(|e| ImageError::Io(format!("cannot encode JSON: {e}")))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ImageError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let result = fs::write(&tmp, bytes).and_then(|_| fs::rename(&tmp, path));
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        ImageError::Io(format!("cannot write {}: {e}", path.display()))
    })
}

/// Debian's (libc-bin) C.UTF-8 locale files, copied into the built-in base image.
const HOST_C_UTF8_LOCALE: &str = "/usr/lib/locale/C.utf8";

/// Adds the directories and regular files under `host` to `layer` at `at`.
fn add_host_tree(layer: &mut LayerBuilder, host: &Path, at: &str) -> Result<(), ImageError> {
    let io = |e: std::io::Error| ImageError::Io(format!("cannot read {}: {e}", host.display()));
    layer.dir(at, 0o755);
    let mut entries: Vec<_> = fs::read_dir(host).map_err(io)?.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = format!("{at}/{}", entry.file_name().to_string_lossy());
        let kind = entry.file_type().map_err(io)?;
        if kind.is_dir() {
            add_host_tree(layer, &entry.path(), &name)?;
        } else if kind.is_file() {
            layer.file(&name, 0o644, &fs::read(entry.path()).map_err(io)?);
        }
    }
    Ok(())
}

/// The PATH every agentenv base image sets.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Writes the built-in base image to the OCI layout `out` (tag `latest`) from a static
/// busybox binary: /bin/busybox with a symlink per applet, /etc/passwd and /etc/group,
/// and the usual empty directories. With `bash` (a static bash, Debian's `bash-static`)
/// it is /bin/bash, which the E2B SDKs run every command with. The image has E2B's
/// default account `user` (uid 1000, home /home/user) besides root, a minimal
/// /etc/profile, and the build host's C.UTF-8 locale when it has one.
pub fn build_busybox_layout(
    busybox: &Path,
    bash: Option<&Path>,
    out: &Path,
) -> Result<(), ImageError> {
    let binary = fs::read(busybox).map_err(|e| {
        ImageError::NotFound(format!(
            "cannot read busybox at {}: {e}; install busybox-static",
            busybox.display()
        ))
    })?;
    let applets = busybox_applets(busybox)?;

    let mut layer = LayerBuilder::new();
    add_base_dirs(&mut layer);
    layer.file("bin/busybox", 0o755, &binary);
    let shell = match bash {
        Some(path) => {
            let bash_binary = fs::read(path).map_err(|e| {
                ImageError::NotFound(format!(
                    "cannot read bash at {}: {e}; install bash-static",
                    path.display()
                ))
            })?;
            layer.file("bin/bash", 0o755, &bash_binary);
            "/bin/bash"
        }
        None => "/bin/sh",
    };
    for applet in applets.iter().filter(|a| bash.is_none() || *a != "bash") {
        layer.symlink(&format!("bin/{applet}"), "busybox");
    }
    // glibc's C.UTF-8 locale (the E2B PTY sets LC_ALL=C.UTF-8; without it bash warns).
    let locale = Path::new(HOST_C_UTF8_LOCALE);
    if locale.is_dir() {
        layer.dir("usr/lib", 0o755).dir("usr/lib/locale", 0o755);
        add_host_tree(&mut layer, locale, "usr/lib/locale/C.utf8")?;
    }
    add_etc_files(&mut layer, shell);

    let spec = ImageSpec {
        env: vec![format!("PATH={DEFAULT_PATH}")],
        working_dir: Some("/".into()),
        cmd: Some(vec!["/bin/sh".into()]),
        entrypoint: None,
        platform: None,
    };
    let mut writer = LayoutWriter::create(out)?;
    let manifest = writer.add_image(&spec, &[LayerBlob::gzip(layer.finish())])?;
    writer.tag(manifest, Some("latest"));
    writer.finish()
}

/// The applets `busybox --list` names, sorted and without duplicates; anything that is
/// not a plain name is dropped, and a busybox without `sh` is refused.
fn busybox_applets(busybox: &Path) -> Result<Vec<String>, ImageError> {
    let listing = Command::new(busybox)
        .arg("--list")
        .output()
        .map_err(|e| ImageError::Io(format!("cannot run {} --list: {e}", busybox.display())))?;
    if !listing.status.success() {
        return Err(ImageError::BadImage(format!(
            "{} --list failed ({})",
            busybox.display(),
            listing.status
        )));
    }
    let mut applets: Vec<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && !a.contains('/') && *a != "busybox" && *a != "." && *a != "..")
        .map(String::from)
        .collect();
    if !applets.iter().any(|a| a == "sh") {
        return Err(ImageError::BadImage(format!(
            "{} has no sh applet",
            busybox.display()
        )));
    }
    applets.sort();
    applets.dedup();
    Ok(applets)
}

/// The usual top-level directories, the sticky temp dirs and the home of E2B's `user`.
fn add_base_dirs(layer: &mut LayerBuilder) {
    for dir in [
        "bin",
        "dev",
        "etc",
        "home",
        "proc",
        "run",
        "sbin",
        "sys",
        "usr",
        "usr/bin",
        "usr/sbin",
        "usr/local",
        "usr/local/bin",
        "usr/local/sbin",
        "var",
        "var/log",
    ] {
        layer.dir(dir, 0o755);
    }
    layer.dir("root", 0o700);
    layer.dir("tmp", 0o1777);
    layer.dir("var/tmp", 0o1777);
    layer.dir_owned("home/user", 0o755, 1000, 1000);
}

/// /etc: a minimal profile, the accounts (root and `user` with `shell`, nobody), their
/// groups, the hostname and hosts.
fn add_etc_files(layer: &mut LayerBuilder, shell: &str) {
    layer.file(
        "etc/profile",
        0o644,
        b"export PATH=\"${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}\"\n\
          PS1='\\u@\\h:\\w\\$ '\n",
    );
    let passwd = format!(
        "root:x:0:0:root:/root:{shell}\nuser:x:1000:1000:user:/home/user:{shell}\n\
         nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    );
    layer.file("etc/passwd", 0o644, passwd.as_bytes());
    layer.file(
        "etc/group",
        0o644,
        b"root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
    );
    layer.file("etc/hostname", 0o644, b"agentenv\n");
    layer.file(
        "etc/hosts",
        0o644,
        b"127.0.0.1\tlocalhost\n::1\tlocalhost\n",
    );
}
