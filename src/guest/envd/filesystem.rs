//! `filesystem.Filesystem`: Stat, MakeDir, Move, ListDir, Remove (the watch calls are in
//! [`super::watch`]). Entries are described as envd's `EntryInfo`, with the file's
//! `user.e2b.*` attributes as `metadata` ([`super::metadata`]).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{json, Value};

use super::users::{OwnerNames, User};
use super::{Call, Envd};
use crate::protocol::connect::{self, de_u32, Code, RpcError};
use crate::sys::guest::FsIdentity;
use crate::util::rfc3339;

/// Entries one `ListDir` answers at most.
pub const MAX_LIST_ENTRIES: usize = 100_000;

#[derive(Debug, Default, Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
}

#[derive(Debug, Default, Deserialize)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
struct ListDirRequest {
    #[serde(default)]
    path: String,
    #[serde(default, deserialize_with = "de_u32")]
    depth: Option<u32>,
}

/// Go's `FileMode.String()`, which envd sends as `permissions` (e.g. `drwxr-xr-x`).
pub fn mode_string(mode: u32) -> String {
    let mut s = String::new();
    let fmt = mode & libc::S_IFMT;
    for (set, c) in [
        (fmt == libc::S_IFDIR, 'd'),
        (fmt == libc::S_IFLNK, 'L'),
        (fmt == libc::S_IFBLK || fmt == libc::S_IFCHR, 'D'),
        (fmt == libc::S_IFIFO, 'p'),
        (fmt == libc::S_IFSOCK, 'S'),
        (mode & libc::S_ISUID != 0, 'u'),
        (mode & libc::S_ISGID != 0, 'g'),
        (fmt == libc::S_IFCHR, 'c'),
        (mode & libc::S_ISVTX != 0, 't'),
    ] {
        if set {
            s.push(c);
        }
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

fn file_type(meta: &std::fs::Metadata) -> &'static str {
    let ft = meta.file_type();
    if ft.is_dir() {
        "FILE_TYPE_DIRECTORY"
    } else if ft.is_file() {
        "FILE_TYPE_FILE"
    } else if ft.is_symlink() {
        "FILE_TYPE_SYMLINK"
    } else {
        "FILE_TYPE_UNSPECIFIED"
    }
}

/// `what path: e`, as permission_denied when the account may not, else internal.
fn io_error(what: &str, path: &Path, e: &io::Error) -> RpcError {
    let message = format!("{what} {}: {e}", path.display());
    match e.kind() {
        io::ErrorKind::PermissionDenied => RpcError::new(Code::PermissionDenied, message),
        _ => RpcError::internal(message),
    }
}

fn stat_error(path: &Path, e: &io::Error) -> RpcError {
    match e.kind() {
        io::ErrorKind::NotFound => {
            RpcError::not_found(format!("file not found: {}", path.display()))
        }
        _ => io_error("error getting file info of", path, e),
    }
}

/// envd's `EntryInfo` of `path` (not following a final symlink; a symlink reports its
/// target's type and permission bits, `isSymlink`, and the resolved target as
/// `symlinkTarget`, as envd ≥ 0.6 does).
pub fn entry_info(path: &Path, names: &OwnerNames) -> Result<Value, RpcError> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| stat_error(path, &e))?;
    let name = path
        .file_name()
        .map_or_else(|| path.to_string_lossy(), |n| n.to_string_lossy())
        .into_owned();
    let mut kind = file_type(&meta);
    let mut perm = meta.mode() & 0o777;
    let mut target = None;
    if meta.file_type().is_symlink() {
        let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        match std::fs::metadata(path) {
            Ok(t) => {
                kind = file_type(&t);
                perm = t.mode() & 0o777;
            }
            Err(_) => {
                kind = "FILE_TYPE_UNSPECIFIED";
                perm = 0;
            }
        }
        target = Some(resolved.to_string_lossy().into_owned());
    }
    let mut v = json!({
        "name": name,
        "type": kind,
        "path": path.to_string_lossy(),
        "size": meta.len().to_string(),
        "mode": perm,
        "permissions": mode_string(meta.mode()),
        "owner": names.user(meta.uid()),
        "group": names.group(meta.gid()),
    });
    if let Ok(modified) = meta.modified() {
        v["modifiedTime"] = json!(rfc3339(modified));
    }
    if let Some(t) = target {
        v["symlinkTarget"] = json!(t);
        v["isSymlink"] = json!(true);
    } else if let Some(metadata) = super::metadata::read(path) {
        v["metadata"] = json!(metadata);
    }
    Ok(v)
}

/// Creates the missing directories of `dir` (mode 0755), owned by the account the thread
/// acts as ([`Envd::act_as`]).
pub fn ensure_dirs(dir: &Path) -> Result<(), RpcError> {
    let mut at = PathBuf::from("/");
    for part in dir.components().skip(1) {
        at.push(part);
        match std::fs::metadata(&at) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => {
                return Err(RpcError::invalid(format!(
                    "path is a file, not a directory: {}",
                    at.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(stat_error(&at, &e)),
        }
        match std::fs::DirBuilder::new().mode(0o755).create(&at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io_error("error creating directory", &at, &e)),
        }
    }
    Ok(())
}

/// The call's account, acting on files with its permissions while the guard lives, and
/// `path` resolved for it.
fn resolved(
    envd: &Envd,
    call: &Call,
    path: &str,
) -> Result<(User, Option<FsIdentity>, PathBuf), RpcError> {
    let user = envd.user(call)?;
    let acting = envd.act_as(&user)?;
    let path = envd.resolve(path, &user)?;
    Ok((user, acting, path))
}

/// `Stat`.
pub fn stat(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: PathRequest = connect::parse(msg)?;
    let (_, _acting, path) = resolved(envd, call, &req.path)?;
    Ok(json!({"entry": entry_info(&path, &envd.accounts.names())?}))
}

/// `MakeDir`: creates the directory and its parents; `already_exists` when it exists.
pub fn make_dir(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: PathRequest = connect::parse(msg)?;
    let (_, _acting, path) = resolved(envd, call, &req.path)?;
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => {
            return Err(RpcError::new(
                Code::AlreadyExists,
                format!("directory already exists: {}", path.display()),
            ))
        }
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path already exists but it is not a directory: {}",
                path.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(stat_error(&path, &e)),
    }
    ensure_dirs(&path)?;
    Ok(json!({"entry": entry_info(&path, &envd.accounts.names())?}))
}

/// `Move`: renames, creating the destination's parents.
pub fn move_entry(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: MoveRequest = connect::parse(msg)?;
    let (user, _acting, source) = resolved(envd, call, &req.source)?;
    let destination = envd.resolve(&req.destination, &user)?;
    if let Some(parent) = destination.parent() {
        ensure_dirs(parent)?;
    }
    std::fs::rename(&source, &destination).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => {
            RpcError::not_found(format!("source file not found: {}", source.display()))
        }
        _ => io_error(
            &format!("error renaming {} to", source.display()),
            &destination,
            &e,
        ),
    })?;
    Ok(json!({"entry": entry_info(&destination, &envd.accounts.names())?}))
}

/// `Remove`: a file, a symlink or a whole directory tree; a missing path is fine.
pub fn remove(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: PathRequest = connect::parse(msg)?;
    let (_, _acting, path) = resolved(envd, call, &req.path)?;
    let result = match std::fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
        Ok(_) => std::fs::remove_file(&path),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => Ok(json!({})),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(json!({})),
        Err(e) => Err(io_error("error removing file or directory", &path, &e)),
    }
}

/// `ListDir`: entries down to `depth` levels (default 1), sorted by path; the paths keep
/// the requested directory's spelling even when it is a symlink.
pub fn list_dir(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: ListDirRequest = connect::parse(msg)?;
    let depth = req.depth.filter(|&d| d > 0).unwrap_or(1);
    let (_, _acting, requested) = resolved(envd, call, &req.path)?;
    let real = std::fs::canonicalize(&requested).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => {
            RpcError::not_found(format!("path not found: {}", requested.display()))
        }
        _ => io_error("error resolving", &requested, &e),
    })?;
    if !real.is_dir() {
        return Err(RpcError::invalid(format!(
            "path is not a directory: {}",
            requested.display()
        )));
    }
    let names = envd.accounts.names();
    let mut entries = Vec::new();
    walk(&real, &requested, depth, &names, &mut entries)?;
    Ok(json!({"entries": entries}))
}

fn walk(
    dir: &Path,
    shown: &Path,
    depth: u32,
    names: &OwnerNames,
    out: &mut Vec<Value>,
) -> Result<(), RpcError> {
    let read = std::fs::read_dir(dir).map_err(|e| io_error("error reading directory", dir, &e))?;
    let mut children: Vec<_> = read.filter_map(Result::ok).map(|e| e.file_name()).collect();
    children.sort();
    for name in children {
        let path = dir.join(&name);
        let mut info = match entry_info(&path, names) {
            Ok(i) => i,
            Err(e) if e.code == Code::NotFound => continue,
            Err(e) => return Err(e),
        };
        if out.len() >= MAX_LIST_ENTRIES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("more than {MAX_LIST_ENTRIES} entries; list with a smaller depth"),
            ));
        }
        let shown_path = shown.join(&name);
        info["path"] = json!(shown_path.to_string_lossy());
        out.push(info);
        let is_real_dir = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
        if depth > 1 && is_real_dir {
            walk(&path, &shown_path, depth - 1, names, out)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_strings_match_go() {
        assert_eq!(mode_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(mode_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(
            mode_string(libc::S_IFDIR | libc::S_ISVTX | 0o777),
            "dtrwxrwxrwx"
        );
        assert_eq!(mode_string(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(mode_string(libc::S_IFCHR | 0o666), "Dcrw-rw-rw-");
        assert_eq!(
            mode_string(libc::S_IFREG | libc::S_ISUID | 0o755),
            "urwxr-xr-x"
        );
    }
}
