//! Root disks: a qcow2 overlay per sandbox over a shared raw base image, so the guest's
//! writes never touch the base.

use std::path::Path;
use std::process::{Command, Stdio};

use super::VmError;

/// Creates `overlay` (qcow2, `size_mb` MiB virtual size) backed by the raw image `base`.
/// `base` is recorded as given: pass an absolute path so the overlay opens from anywhere.
pub fn create_overlay(base: &Path, overlay: &Path, size_mb: u32) -> Result<(), VmError> {
    if !base.is_file() {
        return Err(VmError::MissingAsset {
            what: "base disk image",
            path: base.to_path_buf(),
        });
    }
    let output = Command::new("qemu-img")
        .arg("create")
        .arg("-q")
        .args(["-f", "qcow2", "-F", "raw", "-b"])
        .arg(base)
        .arg(overlay)
        .arg(format!("{size_mb}M"))
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
    log::debug!(
        "vm op=create_overlay base={} overlay={} sizeMb={size_mb}",
        base.display(),
        overlay.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_over_raw_base() {
        if Command::new("qemu-img").arg("--version").output().is_err() {
            eprintln!("skipping: qemu-img not installed");
            return;
        }
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

        let e = create_overlay(&dir.join("nope"), &overlay, 64).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
