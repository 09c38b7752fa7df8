//! A volume's disk: a sparse ext4 image of the volume's size, loop-mounted `nosuid,nodev`
//! on the host. The image's size is the quota: a full volume answers `ENOSPC` to whoever
//! writes (a guest over NFS, the content API) and never fills the state dir beyond it.

use super::VolumeError;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

/// Makes the sparse image `image` of `size_mb` MiB holding an empty ext4 (its root
/// is made writable for the guest's users once mounted).
pub fn make_image(image: &Path, size_mb: u64) -> Result<(), VolumeError> {
    let file = File::options()
        .write(true)
        .create_new(true)
        .open(image)
        .map_err(|e| VolumeError::io(image.display(), e))?;
    file.set_len(size_mb * 1024 * 1024)
        .map_err(|e| VolumeError::io(image.display(), e))?;
    drop(file);
    // -m 0: no blocks reserved for root (the quota is all the guest's); lazy init keeps
    // a large volume's create fast and its image sparse.
    run(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-E"])
            .arg("root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1")
            .arg(image),
        "mkfs.ext4",
    )
}

/// Mounts `image` on `dir` through a loop device (freed when unmounted), without setuid,
/// device nodes or execution on the host.
pub fn mount(image: &Path, dir: &Path) -> Result<(), VolumeError> {
    run(
        Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noexec,noatime"])
            .arg(image)
            .arg(dir),
        "mount",
    )
}

/// Unmounts `dir` (its loop device goes with it).
pub fn unmount(dir: &Path) -> Result<(), VolumeError> {
    run(Command::new("umount").arg(dir), "umount")
}

/// Whether `dir` is a mount point (on another device than its parent).
pub fn is_mounted(dir: &Path) -> bool {
    let dev = |p: &Path| std::fs::symlink_metadata(p).map(|m| m.dev()).ok();
    match (dev(dir), dir.parent().and_then(dev)) {
        (Some(a), Some(b)) => a != b,
        _ => false,
    }
}

fn run(cmd: &mut Command, what: &'static str) -> Result<(), VolumeError> {
    let out = cmd
        .output()
        .map_err(|e| VolumeError::Disk(format!("cannot run {what}: {e}; install it")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(VolumeError::Disk(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}
