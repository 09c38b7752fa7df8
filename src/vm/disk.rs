//! Root disks: a qcow2 overlay per sandbox over a shared raw base image, so the guest's
//! writes never touch the base.
//!
//! # Disk chains across snapshots
//!
//! A sandbox's disk is a chain: the raw base image (image store, shared, immutable,
//! referenced by absolute path) ← one or more qcow2 layers inside the sandbox's own
//! directory, each naming its backing layer by a *relative* file name (resolved by QEMU
//! against the layer's directory). Only the top layer is ever written.
//!
//! Freezing the disk for a snapshot ([`super::Vm::capture`] with
//! [`super::DiskCapture::Freeze`]) creates a new empty top layer next to the current one and
//! switches the running VM onto it (`blockdev-snapshot-sync`, mode `existing`); the old top
//! becomes immutable. The snapshot's directory then gets **hard links** of every qcow2
//! layer of the chain, under the same names: since backing names are relative, the
//! links form a complete chain on their own. A clone hard-links the snapshot's layers into
//! its own directory and adds its own top layer ([`create_clone_disk`]). So every
//! directory holds the whole chain it needs, and deleting a sandbox, snapshot or template
//! only drops link counts: nobody's chain breaks (the kernel frees a layer with its last
//! link). Hard links need one filesystem; across filesystems the layers are copied.
//!
//! Each freeze adds one layer to the sandbox's chain; [`MAX_CHAIN_LAYERS`] bounds it: at
//! that depth the capture merges the chain into the new top instead (see
//! [`super::Vm::capture`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::VmError;

/// Deepest qcow2 chain a sandbox keeps before a capture flattens it.
pub const MAX_CHAIN_LAYERS: usize = 16;

const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";
/// Backing-file names longer than this are not valid qcow2 (QEMU's limit is 1023).
const MAX_BACKING_NAME: u32 = 1023;

/// Creates `overlay` (qcow2, `size_mb` MiB virtual size) backed by the raw image `base`.
/// `base` is recorded as given: absolute, or relative to the overlay's directory (QEMU
/// resolves it so), which keeps working when the whole state dir moves.
pub fn create_overlay(base: &Path, overlay: &Path, size_mb: u32) -> Result<(), VmError> {
    let resolved = overlay.parent().unwrap_or(Path::new(".")).join(base);
    if !resolved.is_file() {
        return Err(VmError::MissingAsset {
            what: "base disk image",
            path: base.to_path_buf(),
        });
    }
    let size = format!("{size_mb}M");
    qemu_img(&[
        "create".as_ref(),
        "-q".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
        "-F".as_ref(),
        "raw".as_ref(),
        "-b".as_ref(),
        base.as_os_str(),
        overlay.as_os_str(),
        size.as_ref(),
    ])?;
    log::debug!(
        "vm op=create_overlay base={} overlay={} sizeMb={size_mb}",
        base.display(),
        overlay.display()
    );
    Ok(())
}

/// What the header of a qcow2 file says about its chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Qcow2Header {
    pub virtual_size: u64,
    /// The backing file as recorded (relative names are relative to the file's directory).
    pub backing: Option<String>,
}

/// Reads the qcow2 header of `path`; `Ok(None)` when the file is not qcow2 (a raw base).
pub fn read_qcow2_header(path: &Path) -> Result<Option<Qcow2Header>, VmError> {
    let io = |e| VmError::io(format!("cannot read disk image {}", path.display()), e);
    let mut f = File::open(path).map_err(io)?;
    let mut h = [0u8; 32];
    match f.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io(e)),
    }
    if &h[0..4] != QCOW2_MAGIC {
        return Ok(None);
    }
    let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
    let backing_offset = be64(&h[8..16]);
    let backing_len = u32::from_be_bytes(h[16..20].try_into().expect("4 bytes"));
    let virtual_size = be64(&h[24..32]);
    let backing = if backing_offset == 0 || backing_len == 0 {
        None
    } else {
        if backing_len > MAX_BACKING_NAME {
            return Err(VmError::InvalidSpec(format!(
                "{}: qcow2 backing file name of {backing_len} bytes",
                path.display()
            )));
        }
        let mut name = vec![0u8; backing_len as usize];
        f.seek(SeekFrom::Start(backing_offset)).map_err(io)?;
        f.read_exact(&mut name).map_err(io)?;
        Some(String::from_utf8(name).map_err(|_| {
            VmError::InvalidSpec(format!(
                "{}: backing file name is not UTF-8",
                path.display()
            ))
        })?)
    };
    Ok(Some(Qcow2Header {
        virtual_size,
        backing,
    }))
}

/// A disk chain as found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskChain {
    /// The qcow2 layers that live in the top's directory and are reached through relative
    /// backing names, bottom first; the last is the top. These are what a snapshot links.
    pub layers: Vec<PathBuf>,
    /// What the bottom layer's backing name points to by absolute path (the raw base image
    /// in the image store), if anything.
    pub base: Option<PathBuf>,
    pub virtual_size: u64,
}

/// Follows the backing names from `top` down.
pub fn disk_chain(top: &Path) -> Result<DiskChain, VmError> {
    let dir = top.parent().unwrap_or(Path::new("."));
    let Some(header) = read_qcow2_header(top)? else {
        return Err(VmError::InvalidSpec(format!(
            "{} is not a qcow2 image",
            top.display()
        )));
    };
    let virtual_size = header.virtual_size;
    let mut layers = vec![top.to_path_buf()];
    let mut backing = header.backing;
    let mut base = None;
    while let Some(name) = backing.take() {
        let name = PathBuf::from(name);
        if name.is_absolute() {
            base = Some(name);
            break;
        }
        // A relative path with directories reaches the raw base image in the image store.
        if name.components().count() > 1 {
            base = Some(dir.join(&name));
            break;
        }
        if name.components().count() != 1 {
            return Err(VmError::InvalidSpec(format!(
                "{}: backing name {} must be a plain file name or an absolute path",
                layers.last().expect("non-empty").display(),
                name.display()
            )));
        }
        let path = dir.join(&name);
        if layers.contains(&path) || layers.len() > 4 * MAX_CHAIN_LAYERS {
            return Err(VmError::InvalidSpec(format!(
                "{}: the backing chain loops or is too deep",
                top.display()
            )));
        }
        match read_qcow2_header(&path)? {
            Some(h) => {
                backing = h.backing;
                layers.push(path);
            }
            None => {
                base = Some(path);
                break;
            }
        }
    }
    layers.reverse();
    Ok(DiskChain {
        layers,
        base,
        virtual_size,
    })
}

/// A disk chain opened by the server for a QEMU that may not open its files by path:
/// QEMU gets the descriptors (see [`super::qemu`]) and never follows a backing name.
#[derive(Debug)]
pub(crate) struct OpenChain {
    /// The raw base image, read-only.
    pub base: Option<File>,
    /// The qcow2 layers, bottom first: read-only, except the top (last), read-write.
    pub layers: Vec<File>,
    /// A second, read-only descriptor of the top: QEMU reopens a layer read-only once a
    /// snapshot puts a new layer above it.
    pub top_read_only: File,
}

/// Opens every file of the chain under `top` (see [`disk_chain`]).
pub(crate) fn open_chain(top: &Path) -> Result<OpenChain, VmError> {
    let chain = disk_chain(top)?;
    let open = |path: &Path, write: bool| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(path)
            .map_err(|e| VmError::io(format!("cannot open disk image {}", path.display()), e))
    };
    let base = chain.base.as_deref().map(|b| open(b, false)).transpose()?;
    let last = chain.layers.len() - 1;
    let layers = chain
        .layers
        .iter()
        .enumerate()
        .map(|(i, layer)| open(layer, i == last))
        .collect::<Result<Vec<File>, VmError>>()?;
    Ok(OpenChain {
        base,
        layers,
        top_read_only: open(top, false)?,
    })
}

/// Runs qemu-img with `args`.
fn qemu_img(args: &[&std::ffi::OsStr]) -> Result<(), VmError> {
    let output = Command::new("qemu-img")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                VmError::BinaryNotFound {
                    binary: "qemu-img".into(),
                }
            } else {
                VmError::Spawn {
                    binary: "qemu-img".into(),
                    source: e,
                }
            }
        })?;
    if !output.status.success() {
        return Err(VmError::QemuImg {
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(())
}

/// Creates the empty qcow2 layer `path` over the qcow2 `backing_name` (a file name in the
/// same directory, recorded as given). The backing file is not opened (`-u`): it may be
/// in use by a running QEMU.
pub fn create_layer(path: &Path, backing_name: &str, virtual_size: u64) -> Result<(), VmError> {
    if backing_name.contains('/') {
        return Err(VmError::InvalidSpec(format!(
            "backing layer {backing_name:?} must be a file name in the same directory"
        )));
    }
    qemu_img(&[
        "create".as_ref(),
        "-q".as_ref(),
        "-u".as_ref(),
        "-f".as_ref(),
        "qcow2".as_ref(),
        "-F".as_ref(),
        "qcow2".as_ref(),
        "-b".as_ref(),
        backing_name.as_ref(),
        path.as_os_str(),
        virtual_size.to_string().as_ref(),
    ])
}

/// A file name for a new top layer in `dir` that is not in use there: `disk-N.qcow2`.
pub fn next_layer_path(dir: &Path, chain: &DiskChain) -> PathBuf {
    (chain.layers.len()..)
        .map(|n| dir.join(format!("disk-{n}.qcow2")))
        .find(|p| !chain.layers.contains(p) && !p.exists())
        .expect("an unused name exists")
}

/// Hard-links each of `layers` into `dir` under its own file name (copying when `dir` is
/// on another filesystem). Returns the new paths, in order.
pub fn link_layers(layers: &[PathBuf], dir: &Path) -> Result<Vec<PathBuf>, VmError> {
    let mut linked = Vec::with_capacity(layers.len());
    for layer in layers {
        let name = layer.file_name().ok_or_else(|| {
            VmError::InvalidSpec(format!("disk layer {} has no file name", layer.display()))
        })?;
        let dest = dir.join(name);
        match std::fs::hard_link(layer, &dest) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if !same_file(layer, &dest)? {
                    return Err(VmError::io(
                        format!("cannot link disk layer into {}", dir.display()),
                        e,
                    ));
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                std::fs::copy(layer, &dest).map_err(|e| {
                    VmError::io(
                        format!("cannot copy {} to {}", layer.display(), dest.display()),
                        e,
                    )
                })?;
            }
            Err(e) => {
                return Err(VmError::io(
                    format!("cannot link {} to {}", layer.display(), dest.display()),
                    e,
                ))
            }
        }
        linked.push(dest);
    }
    Ok(linked)
}

fn same_file(a: &Path, b: &Path) -> Result<bool, VmError> {
    use std::os::unix::fs::MetadataExt;
    let meta = |p: &Path| {
        std::fs::metadata(p).map_err(|e| VmError::io(format!("cannot stat {}", p.display()), e))
    };
    let (a, b) = (meta(a)?, meta(b)?);
    Ok(a.dev() == b.dev() && a.ino() == b.ino())
}

/// Prepares a writable root disk in `dir` for a VM restored from a capture whose frozen
/// disk chain is `layers` (bottom first, as in [`super::CaptureRecord::disk_layers`]):
/// links the layers into `dir`, then adds an empty top layer. Returns the top's path,
/// the `disk` to restore with. The clone's chain then lives entirely in `dir`.
pub fn create_clone_disk(layers: &[PathBuf], dir: &Path) -> Result<PathBuf, VmError> {
    let top = layers
        .last()
        .ok_or_else(|| VmError::InvalidSpec("the capture has no disk layers".into()))?;
    let header = read_qcow2_header(top)?
        .ok_or_else(|| VmError::InvalidSpec(format!("{} is not a qcow2 image", top.display())))?;
    let linked = link_layers(layers, dir)?;
    let chain = DiskChain {
        layers: linked,
        base: None,
        virtual_size: header.virtual_size,
    };
    let path = next_layer_path(dir, &chain);
    let backing = top
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| VmError::InvalidSpec(format!("{} is not UTF-8", top.display())))?;
    create_layer(&path, backing, header.virtual_size)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_over_raw_base() {
        assert!(
            Command::new("qemu-img").arg("--version").output().is_ok(),
            "qemu-img not installed (run scripts/setup.sh)"
        );
        let dir = std::env::temp_dir().join(format!("agentenv-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("base.raw");
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let overlay = dir.join("overlay.qcow2");
        create_overlay(&base, &overlay, 64).unwrap();
        let info = Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(&overlay)
            .output()
            .unwrap();
        let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        assert_eq!(info["format"], "qcow2");
        assert_eq!(info["virtual-size"], 64 << 20);
        assert_eq!(info["backing-filename-format"], "raw");

        let chain = disk_chain(&overlay).unwrap();
        assert_eq!(chain.layers, std::slice::from_ref(&overlay));
        assert_eq!(chain.base, Some(base.clone()));
        assert_eq!(chain.virtual_size, 64 << 20);

        // Two layers on top with relative names, then a clone in another directory.
        let l1 = next_layer_path(&dir, &chain);
        assert_eq!(l1, dir.join("disk-1.qcow2"));
        create_layer(&l1, "overlay.qcow2", chain.virtual_size).unwrap();
        let chain = disk_chain(&l1).unwrap();
        assert_eq!(chain.layers, [overlay.clone(), l1.clone()]);
        assert_eq!(chain.base, Some(base.clone()));
        let clone_dir = dir.join("clone");
        std::fs::create_dir(&clone_dir).unwrap();
        let top = create_clone_disk(&chain.layers, &clone_dir).unwrap();
        assert_eq!(top, clone_dir.join("disk-2.qcow2"));
        let clone_chain = disk_chain(&top).unwrap();
        assert_eq!(
            clone_chain.layers,
            [
                clone_dir.join("overlay.qcow2"),
                clone_dir.join("disk-1.qcow2"),
                top.clone()
            ]
        );
        assert!(same_file(&overlay, &clone_dir.join("overlay.qcow2")).unwrap());
        // qemu-img agrees on the chain.
        let out = Command::new("qemu-img")
            .args(["info", "--backing-chain", "--output=json"])
            .arg(&top)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let infos: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(infos.as_array().unwrap().len(), 4);
        // Linking again is idempotent.
        link_layers(&chain.layers, &clone_dir).unwrap();

        let e = create_overlay(&dir.join("nope"), &overlay, 64).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
