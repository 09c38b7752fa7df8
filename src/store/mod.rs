//! Durable files: every record is written atomically (temp file, fsync, rename, fsync of
//! the directory), so a crash leaves either the old or the new content, never a mix.

pub mod layout;

use crate::sys;
use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug)]
pub enum StoreError {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Sys(sys::SysError),
    /// A record could not be encoded as JSON (a bug, not the host's fault).
    Encode {
        path: PathBuf,
        source: serde_json::Error,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Io { path, source } => write!(
                f,
                "cannot write {}: {source}; check that the state dir is writable and not full",
                path.display()
            ),
            StoreError::Sys(e) => write!(f, "{e}"),
            StoreError::Encode { path, source } => {
                write!(f, "cannot encode the record {}: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for StoreError {}

/// Replaces `path` with `bytes` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = temp_path(path);
    let io = |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let result = (|| {
        let mut f = File::options()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(io(e));
    }
    sys::fs::fsync_dir(dir).map_err(StoreError::Sys)
}

/// Writes `value` as pretty JSON to `path` ([`write_atomic`], mode 0600).
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| StoreError::Encode {
        path: path.to_path_buf(),
        source,
    })?;
    write_atomic(path, &bytes, 0o600)
}

/// The temp name used next to `path` while it is being written.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", crate::util::new_id()))
}

/// Creates `dir` and its parents with mode 0700 when missing.
pub fn ensure_private_dir(dir: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| StoreError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

/// Moves `path` (a record's directory or file that could not be used) to
/// `<state_dir>/quarantine/` with a log line saying `why`, and a `<name>.reason` file next
/// to it. Nothing is deleted: an operator can inspect it, move it back, or remove it.
/// Returns where it went; `None` when even the move failed (it is then left in place).
pub fn quarantine(state_dir: &Path, path: &Path, why: &str) -> Option<PathBuf> {
    quarantine_to(path, &quarantine_dest(state_dir, path), why)
}

/// Where [`quarantine`] would move `path`: `<state_dir>/quarantine/<kind>-<name>-<new id>`
/// (`kind` is the parent directory's name, e.g. `sandboxes`). Its reason file is the same
/// path with the extension `reason`.
pub fn quarantine_dest(state_dir: &Path, path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let kind = path
        .parent()
        .and_then(Path::file_name)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    layout::StateLayout::new(state_dir)
        .quarantine()
        .join(format!("{kind}-{name}-{}", crate::util::new_id()))
}

/// [`quarantine`] to a destination chosen beforehand with [`quarantine_dest`].
pub fn quarantine_to(path: &Path, dest: &Path, why: &str) -> Option<PathBuf> {
    // The reason goes first, so whoever sees the quarantined entry also finds its reason.
    let reason = dest.with_extension("reason");
    let moved = dest
        .parent()
        .ok_or_else(|| "no quarantine directory".to_string())
        .and_then(|dir| ensure_private_dir(dir).map_err(|e| e.to_string()))
        .map(|()| {
            // Best effort: a full disk must not keep the entry from moving.
            let text = format!("{}: {why}\n", path.display());
            if let Err(e) = write_atomic(&reason, text.as_bytes(), 0o600) {
                log::warn!(
                    "op=recover path={} reason_file_error=\"{e}\"",
                    reason.display()
                );
            }
        })
        .and_then(|()| fs::rename(path, dest).map_err(|e| e.to_string()));
    match moved {
        Ok(()) => {
            log::error!(
                "op=recover path={} result=quarantined to={} reason=\"{why}\"",
                path.display(),
                dest.display()
            );
            Some(dest.to_path_buf())
        }
        Err(e) => {
            let _ = fs::remove_file(&reason);
            log::error!(
                "op=recover path={} result=kept reason=\"{why}\" quarantine_error=\"{e}\"",
                path.display()
            );
            None
        }
    }
}

/// Makes `root` and every directory under it 0700 and takes group and other bits off
/// every file (symlinks are neither followed nor changed), so an older or hand-made state
/// dir is as private as a new one. Files under `keep_files_under` (the VM assets, which
/// hold no guest data) keep their modes; their directories are still made private.
/// Returns how many modes changed.
pub fn tighten_tree(root: &Path, keep_files_under: Option<&Path>) -> Result<u64, StoreError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |path: &Path, source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut changed = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let md = fs::symlink_metadata(&path).map_err(|e| io(&path, e))?;
        let mode = md.permissions().mode() & 0o7777;
        let wanted = if md.is_dir() {
            for entry in fs::read_dir(&path).map_err(|e| io(&path, e))? {
                stack.push(entry.map_err(|e| io(&path, e))?.path());
            }
            0o700
        } else if md.file_type().is_symlink()
            || keep_files_under.is_some_and(|k| path.starts_with(k))
        {
            continue;
        } else {
            mode & !0o077
        };
        if mode != wanted {
            fs::set_permissions(&path, fs::Permissions::from_mode(wanted))
                .map_err(|e| io(&path, e))?;
            changed += 1;
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_and_leaves_no_temp() {
        let dir = std::env::temp_dir().join(format!("aenv-store-{}", crate::util::new_id()));
        ensure_private_dir(&dir).unwrap();
        let p = dir.join("rec.json");
        write_atomic(&p, b"one", 0o600).unwrap();
        write_atomic(&p, b"two", 0o600).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tighten_tree_makes_dirs_0700_and_files_private_but_keeps_assets() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("aenv-tighten-{}", crate::util::new_id()));
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        let set = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
        fs::create_dir_all(dir.join("a/b")).unwrap();
        fs::create_dir_all(dir.join("assets")).unwrap();
        fs::write(dir.join("a/b/disk"), b"x").unwrap();
        fs::write(dir.join("assets/vmlinux"), b"k").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("a/link")).unwrap();
        for (p, m) in [("", 0o755), ("a", 0o777), ("a/b", 0o750), ("assets", 0o755)] {
            set(&dir.join(p), m);
        }
        set(&dir.join("a/b/disk"), 0o644);
        set(&dir.join("assets/vmlinux"), 0o644);
        let changed = tighten_tree(&dir, Some(&dir.join("assets"))).unwrap();
        assert_eq!(changed, 5);
        for p in ["", "a", "a/b", "assets"] {
            assert_eq!(mode(&dir.join(p)), 0o700, "{p}");
        }
        assert_eq!(mode(&dir.join("a/b/disk")), 0o600);
        assert_eq!(mode(&dir.join("assets/vmlinux")), 0o644);
        assert_eq!(
            mode(Path::new("/etc/passwd")),
            0o644,
            "a symlink is never followed"
        );
        assert_eq!(tighten_tree(&dir, None).unwrap(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
