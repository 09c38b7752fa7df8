//! Builds a raw ext4 image from an unpacked staging tree with `mkfs.ext4 -d`, after
//! checking that the tree fits the requested size.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::unpack::Fixup;
use super::ImageError;
use crate::sys::files::NodeKind;

const BLOCK: u64 = 4096;
const INODE_SIZE: u64 = 256;
const MIB: u64 = 1 << 20;

/// What a staging tree needs on ext4.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeUsage {
    pub data_blocks: u64,
    pub inodes: u64,
}

/// Walks `root` without following symlinks, counting each inode once.
pub fn measure(root: &Path) -> Result<TreeUsage, ImageError> {
    let mut usage = TreeUsage::default();
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let md = fs::symlink_metadata(&path)
            .map_err(|e| ImageError::Io(format!("lstat {}: {e}", path.display())))?;
        if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
            continue;
        }
        usage.inodes += 1;
        let ft = md.file_type();
        if ft.is_dir() {
            let mut entries = 0u64;
            for entry in fs::read_dir(&path)
                .map_err(|e| ImageError::Io(format!("readdir {}: {e}", path.display())))?
            {
                let entry = entry
                    .map_err(|e| ImageError::Io(format!("readdir {}: {e}", path.display())))?;
                entries += 1 + entry.file_name().len() as u64 / 8;
                stack.push(entry.path());
            }
            // ~16 bytes per entry plus the name, at least one block.
            usage.data_blocks += 1 + entries * 16 / BLOCK;
        } else if ft.is_file() {
            // Extent tree blocks for very large files are in the slack below.
            usage.data_blocks += md.len().div_ceil(BLOCK);
        } else if ft.is_symlink() && md.len() >= 60 {
            usage.data_blocks += 1;
        }
    }
    Ok(usage)
}

/// The journal mke2fs 1.47 creates for a file system of `blocks` 4 KiB blocks.
fn journal_blocks(blocks: u64) -> u64 {
    match blocks {
        b if b < 2048 => 0,
        b if b < 32768 => 1024,
        b if b < 256 * 1024 => 4096,
        b if b < 512 * 1024 => 8192,
        b if b < 4096 * 1024 => 16384,
        b if b < 8192 * 1024 => 32768,
        b if b < 16384 * 1024 => 65536,
        b if b < 32768 * 1024 => 131072,
        _ => 262144,
    }
}

/// How many inodes an ext4 of `size_mb` made by [`build`]'s mkfs flags has.
pub fn inode_capacity(size_mb: u64) -> u64 {
    // mke2fs.conf: "small" (< 512 MiB) has inode_ratio 4096, default 16384.
    let inode_ratio = if size_mb < 512 { 4096 } else { 16384 };
    size_mb * MIB / inode_ratio
}

/// Whether `usage` fits an ext4 of `size_mb` made by [`build`]'s mkfs flags, with margin.
pub fn fits(usage: TreeUsage, size_mb: u64) -> bool {
    let bytes = size_mb * MIB;
    let blocks = bytes / BLOCK;
    let inode_count = inode_capacity(size_mb);
    let inode_table_blocks = inode_count * INODE_SIZE / BLOCK;
    // Bitmaps, group descriptors, reserved GDT blocks, superblock backups: ~1%, plus 64
    // blocks of fixed cost.
    let metadata = inode_table_blocks + journal_blocks(blocks) + blocks / 100 + 64;
    let available = blocks.saturating_sub(metadata);
    // 5% slack for extent blocks and directory growth.
    let needed = usage.data_blocks + usage.data_blocks / 20 + 16;
    needed <= available && usage.inodes + 16 <= inode_count
}

/// The smallest multiple of 1024 MiB that `usage` fits.
pub fn needed_mb(usage: TreeUsage) -> u32 {
    let mut gib: u64 = 1;
    while !fits(usage, gib * 1024) && gib < 4 * 1024 * 1024 {
        gib += 1;
    }
    u32::try_from(gib * 1024).unwrap_or(u32::MAX)
}

/// Finds mkfs.ext4 even when the server's PATH lacks the sbin directories.
fn mkfs_binary() -> PathBuf {
    let from_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("mkfs.ext4"))
            .find(|p| p.is_file())
    });
    from_path
        .or_else(|| {
            ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"]
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("mkfs.ext4"))
}

/// Runs mkfs.ext4 to turn `staging` into the raw image `out` of `size_mb`.
pub fn build(staging: &Path, out: &Path, size_mb: u32, usage: TreeUsage) -> Result<(), ImageError> {
    let binary = mkfs_binary();
    let output = Command::new(&binary)
        .args([
            "-q",
            "-F",
            "-b",
            "4096",
            "-I",
            "256",
            "-E",
            "lazy_journal_init=1",
            "-d",
        ])
        .arg(staging)
        .arg(out)
        .arg(format!("{size_mb}M"))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            ImageError::Io(format!(
                "cannot run {}: {e}; install e2fsprogs",
                binary.display()
            ))
        })?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let text = format!("{} {}", stderr.trim(), stdout.trim());
    let lower = text.to_lowercase();
    if lower.contains("no space")
        || lower.contains("could not allocate")
        || lower.contains("no free space")
    {
        // The estimate was too optimistic; ask for at least the next GiB step.
        let next = (size_mb / 1024 + 1) * 1024;
        return Err(ImageError::TooSmall {
            needed_mb: needed_mb(usage).max(next),
        });
    }
    Err(ImageError::Io(format!(
        "{} failed ({}): {}",
        binary.display(),
        output.status,
        text.trim()
    )))
}

/// Writes what the host tree left out (setuid/setgid modes, file capabilities, device
/// nodes) into the built image `image` with `debugfs -w`. `scratch` is a private
/// directory for the command file and capability values.
pub fn apply_fixups(image: &Path, fixups: &[Fixup], scratch: &Path) -> Result<(), ImageError> {
    if fixups.is_empty() {
        return Ok(());
    }
    let io = |p: &Path, e: std::io::Error| ImageError::Io(format!("{}: {e}", p.display()));
    crate::store::ensure_private_dir(scratch).map_err(|e| ImageError::Io(e.to_string()))?;
    let mut script = String::new();
    for (i, f) in fixups.iter().enumerate() {
        // Paths were checked to be printable ASCII without quotes or backslashes.
        let path = &f.path;
        let type_bits = match f.device {
            Some((NodeKind::Char, major, minor)) => {
                let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
                let dir = if dir.is_empty() { "/" } else { dir };
                script.push_str(&format!(
                    "rm \"{path}\"\ncd \"{dir}\"\nmknod \"{name}\" c {major} {minor}\ncd /\n"
                ));
                0o020000
            }
            Some((NodeKind::Block, major, minor)) => {
                let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
                let dir = if dir.is_empty() { "/" } else { dir };
                script.push_str(&format!(
                    "rm \"{path}\"\ncd \"{dir}\"\nmknod \"{name}\" b {major} {minor}\ncd /\n"
                ));
                0o060000
            }
            Some((NodeKind::Fifo, _, _)) | None => 0o100000,
        };
        script.push_str(&format!(
            "sif \"{path}\" mode 0{:o}\nsif \"{path}\" uid {}\nsif \"{path}\" gid {}\n\
             sif \"{path}\" mtime @{}\n",
            type_bits | (f.mode & 0o7777),
            f.uid,
            f.gid,
            f.mtime
        ));
        if let Some(value) = &f.capability {
            let value_file = scratch.join(format!("cap-{i}"));
            fs::write(&value_file, value).map_err(|e| io(&value_file, e))?;
            script.push_str(&format!(
                "ea_set -f \"{}\" \"{path}\" security.capability\n",
                value_file.display()
            ));
        }
    }
    let script_file = scratch.join("fixups.debugfs");
    fs::write(&script_file, script).map_err(|e| io(&script_file, e))?;
    let binary = crate::util::find_in_path(Path::new("debugfs"))
        .or_else(|| {
            ["/usr/sbin/debugfs", "/sbin/debugfs"]
                .iter()
                .map(PathBuf::from)
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("debugfs"));
    let output = Command::new(&binary)
        .arg("-w")
        .arg("-f")
        .arg(&script_file)
        .arg(image)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            ImageError::Io(format!(
                "cannot run {}: {e}; install e2fsprogs",
                binary.display()
            ))
        })?;
    // debugfs exits 0 whatever its commands did; errors are the stderr lines besides its
    // version banner.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("debugfs "))
        .collect();
    if !output.status.success() || !errors.is_empty() {
        return Err(ImageError::Io(format!(
            "{} could not set setuid bits or device nodes in the image ({}): {}",
            binary.display(),
            output.status,
            errors.join("; ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_and_needed_sizes() {
        let small = TreeUsage {
            data_blocks: 2_000,
            inodes: 500,
        };
        assert!(fits(small, 64));
        assert_eq!(needed_mb(small), 1024);
        let big = TreeUsage {
            data_blocks: 300_000, // ~1.2 GiB
            inodes: 50_000,
        };
        assert!(!fits(big, 1024));
        assert_eq!(needed_mb(big), 2048);
        let many_inodes = TreeUsage {
            data_blocks: 10,
            inodes: 100_000,
        };
        assert!(!fits(many_inodes, 1024));
        assert_eq!(needed_mb(many_inodes), 2048);
    }
}
