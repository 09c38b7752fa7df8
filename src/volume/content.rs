//! The volume content API's file operations (api.md §4.28), on a volume's mounted tree.
//!
//! Every path is walked one component at a time from the volume's root with `*at` calls
//! ([`DirFd`]): `..` is refused before any lookup, no symlink is ever followed (an
//! intermediate one is a 400, a final one is reported as itself), and metadata changes
//! act on a descriptor opened with `O_NOFOLLOW`, so a guest that swaps a name for a
//! symlink mid-call cannot redirect the host outside the volume.

use super::VolumeError;
use crate::sys::files::{DirFd, FileKind, Stat};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Most entries one listing returns (bounds the work of a deep `depth`).
pub const MAX_LISTED: usize = 10_000;
/// Deepest listing.
pub const MAX_DEPTH: u32 = 32;
/// Mode bits a caller may set: no setuid or setgid, whatever the request says.
const MODE_MASK: u32 = 0o1777;

/// The kind of an entry, as E2B names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Directory,
    File,
    Symlink,
    Unknown,
}

impl EntryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Directory => "directory",
            EntryKind::File => "file",
            EntryKind::Symlink => "symlink",
            EntryKind::Unknown => "unknown",
        }
    }
}

/// One entry of a volume, as `VolumeEntryStat` describes it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub kind: EntryKind,
    /// Absolute within the volume (`/a/b`).
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub target: Option<String>,
}

/// Owner and permissions asked for by a call; `None` keeps what is there.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meta {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

/// A path inside a volume, checked: its components, none `.`, `..` or empty.
pub struct VolumePath {
    parts: Vec<OsString>,
}

impl VolumePath {
    /// `raw` as the caller gave it (`/a/b`, `a/b`; `/` or `""` is the root).
    pub fn parse(raw: &str) -> Result<VolumePath, VolumeError> {
        if raw.contains('\0') {
            return Err(VolumeError::bad_path("contains a NUL byte"));
        }
        let mut parts = Vec::new();
        for part in raw.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    return Err(VolumeError::bad_path(
                        "`..` is not allowed: paths stay inside the volume",
                    ))
                }
                p if p.len() > 255 => {
                    return Err(VolumeError::bad_path(
                        "a component is longer than 255 bytes",
                    ))
                }
                p => parts.push(OsString::from(p)),
            }
        }
        if raw.len() > 4096 {
            return Err(VolumeError::bad_path("longer than 4096 bytes"));
        }
        Ok(VolumePath { parts })
    }

    fn display(&self) -> String {
        let mut s = String::new();
        for p in &self.parts {
            s.push('/');
            s.push_str(&p.to_string_lossy());
        }
        if s.is_empty() {
            s.push('/');
        }
        s
    }

    #[cfg(test)]
    fn is_root(&self) -> bool {
        self.parts.is_empty()
    }

    /// The last component and the path of its directory.
    fn split_last(&self) -> Option<(&OsStr, VolumePath)> {
        let (last, dir) = self.parts.split_last()?;
        Some((
            last.as_os_str(),
            VolumePath {
                parts: dir.to_vec(),
            },
        ))
    }

    fn child(&self, name: &OsStr) -> VolumePath {
        let mut parts = self.parts.clone();
        parts.push(name.to_os_string());
        VolumePath { parts }
    }
}

/// A volume's mounted tree.
pub struct Tree<'a> {
    root: &'a Path,
}

impl<'a> Tree<'a> {
    pub fn new(root: &'a Path) -> Tree<'a> {
        Tree { root }
    }

    /// Opens the directory `dir`; with `create`, makes the missing ones (mode 0755).
    fn open_dir(&self, dir: &VolumePath, create: bool) -> Result<DirFd, VolumeError> {
        let mut fd = DirFd::open(self.root).map_err(VolumeError::Sys)?;
        let mut walked = VolumePath { parts: Vec::new() };
        for part in &dir.parts {
            walked = walked.child(part);
            if create && fd.stat(part).map_err(VolumeError::Sys)?.is_none() {
                match fd.mkdir(part, 0o755) {
                    Err(e) if e.errno() != Some(libc::EEXIST) => return Err(VolumeError::Sys(e)),
                    _ => {}
                }
            }
            fd = match fd.open_dir(part) {
                Ok(next) => next,
                Err(e) => return Err(walk_error(&fd, part, &walked, e)),
            };
        }
        Ok(fd)
    }

    /// What `path` is (a symlink itself, never its target).
    pub fn stat(&self, path: &VolumePath) -> Result<Entry, VolumeError> {
        match path.split_last() {
            None => {
                let fd = DirFd::open(self.root).map_err(VolumeError::Sys)?;
                let st = fd.stat(OsStr::new(".")).map_err(VolumeError::Sys)?;
                let st = st.ok_or_else(|| VolumeError::PathNotFound("/".into()))?;
                Ok(entry(&fd, OsStr::new(""), path, &st))
            }
            Some((name, dir)) => {
                let fd = self.open_dir(&dir, false)?;
                let st = fd.stat(name).map_err(VolumeError::Sys)?;
                let st = st.ok_or_else(|| VolumeError::PathNotFound(path.display()))?;
                Ok(entry(&fd, name, path, &st))
            }
        }
    }

    /// The entries under the directory `path`, `depth` levels deep (1: its children).
    pub fn list(&self, path: &VolumePath, depth: u32) -> Result<Vec<Entry>, VolumeError> {
        let fd = self.open_dir(path, false)?;
        let mut out = Vec::new();
        self.list_into(&fd, path, depth.clamp(1, MAX_DEPTH), &mut out)?;
        Ok(out)
    }

    fn list_into(
        &self,
        fd: &DirFd,
        path: &VolumePath,
        depth: u32,
        out: &mut Vec<Entry>,
    ) -> Result<(), VolumeError> {
        let mut names = fd.entries().map_err(VolumeError::Sys)?;
        names.sort();
        for name in names {
            if out.len() >= MAX_LISTED {
                return Err(VolumeError::TooMany(MAX_LISTED));
            }
            // Gone since readdir: skip it.
            let Some(st) = fd.stat(&name).map_err(VolumeError::Sys)? else {
                continue;
            };
            let child = path.child(&name);
            out.push(entry(fd, &name, &child, &st));
            if depth > 1 && st.kind == FileKind::Dir {
                if let Ok(sub) = fd.open_dir(&name) {
                    self.list_into(&sub, &child, depth - 1, out)?;
                }
            }
        }
        Ok(())
    }

    /// Makes the directory `path`; with `parents`, its missing parents too. An existing
    /// entry there is a conflict.
    pub fn make_dir(
        &self,
        path: &VolumePath,
        meta: Meta,
        parents: bool,
    ) -> Result<Entry, VolumeError> {
        let (name, dir) = path
            .split_last()
            .ok_or_else(|| VolumeError::bad_path("/ is the volume's root and exists"))?;
        let fd = self.open_dir(&dir, parents)?;
        match fd.mkdir(name, 0o755) {
            Err(e) if e.errno() == Some(libc::EEXIST) => {
                return Err(VolumeError::Exists(path.display()))
            }
            other => other.map_err(|e| no_space(e.into()))?,
        }
        let file = fd.open_entry(name).map_err(VolumeError::Sys)?;
        apply(&file, meta, None)?;
        self.stat(path)
    }

    /// Opens the regular file `path` for reading, and its size.
    pub fn read(&self, path: &VolumePath) -> Result<(File, u64), VolumeError> {
        let (name, dir) = path
            .split_last()
            .ok_or_else(|| VolumeError::bad_path("/ is a directory"))?;
        let fd = self.open_dir(&dir, false)?;
        let file = self.open_final(&fd, name, path)?;
        let m = file
            .metadata()
            .map_err(|e| VolumeError::io(path.display(), e))?;
        if !m.is_file() {
            let kind = FileKind::of_file(&file).map_err(|e| VolumeError::io(path.display(), e))?;
            return Err(not_a_file(path, kind));
        }
        Ok((file, m.len()))
    }

    /// Writes `body` to the file `path` (created, or truncated when present); with
    /// `parents`, its missing directories are made. A full volume is
    /// [`VolumeError::NoSpace`]; what was written of the file then stays.
    pub fn write(
        &self,
        path: &VolumePath,
        body: &mut dyn Read,
        meta: Meta,
        parents: bool,
    ) -> Result<Entry, VolumeError> {
        let (name, dir) = path
            .split_last()
            .ok_or_else(|| VolumeError::bad_path("/ is a directory"))?;
        let fd = self.open_dir(&dir, parents)?;
        refuse_special(&fd, name, path)?;
        let mut file = match fd.open_truncate(name, 0o644) {
            Ok(f) => f,
            Err(e) => return Err(final_error(&fd, name, path, e)),
        };
        // Swapped in since the check (a FIFO with a reader opens): nothing is written.
        match FileKind::of_file(&file).map_err(|e| VolumeError::io(path.display(), e))? {
            FileKind::Regular => {}
            kind => return Err(not_a_file(path, kind)),
        }
        std::io::copy(body, &mut file)
            .and_then(|_| file.flush())
            .map_err(|e| no_space(VolumeError::io(path.display(), e)))?;
        apply(&file, meta, Some(0o644))?;
        self.stat(path)
    }

    /// Changes owner and permissions of `path` (not a symlink).
    pub fn set_meta(&self, path: &VolumePath, meta: Meta) -> Result<Entry, VolumeError> {
        if let Some((name, dir)) = path.split_last() {
            let fd = self.open_dir(&dir, false)?;
            let file = self.open_final(&fd, name, path)?;
            apply(&file, meta, None)?;
        } else {
            let file = File::open(self.root).map_err(|e| VolumeError::io("/", e))?;
            apply(&file, meta, None)?;
        }
        self.stat(path)
    }

    /// Removes `path` and, for a directory, everything under it (symlinks themselves).
    pub fn remove(&self, path: &VolumePath) -> Result<(), VolumeError> {
        let (name, dir) = path
            .split_last()
            .ok_or_else(|| VolumeError::bad_path("/ is the volume's root; remove its entries"))?;
        let fd = self.open_dir(&dir, false)?;
        let st = fd.stat(name).map_err(VolumeError::Sys)?;
        let st = st.ok_or_else(|| VolumeError::PathNotFound(path.display()))?;
        remove_entry(&fd, name, st.kind == FileKind::Dir, 0)
    }

    /// Opens `path`'s last component `name`, a regular file or a directory: a device
    /// node, FIFO or socket is refused before any open (and the host's mount is `nodev`,
    /// so a device swapped in meanwhile does not open either).
    fn open_final(&self, fd: &DirFd, name: &OsStr, path: &VolumePath) -> Result<File, VolumeError> {
        refuse_special(fd, name, path)?;
        let file = fd
            .open_entry(name)
            .map_err(|e| final_error(fd, name, path, e))?;
        match FileKind::of_file(&file).map_err(|e| VolumeError::io(path.display(), e))? {
            kind if kind.is_special() => Err(not_a_file(path, kind)),
            _ => Ok(file),
        }
    }
}

/// 400 when the entry `name` (at `path`) is a device node, FIFO or socket: the content API
/// lists, stats and removes those but never opens or changes one.
fn refuse_special(fd: &DirFd, name: &OsStr, path: &VolumePath) -> Result<(), VolumeError> {
    match fd.stat(name).map_err(VolumeError::Sys)? {
        Some(st) if st.kind.is_special() => Err(not_a_file(path, st.kind)),
        _ => Ok(()),
    }
}

fn not_a_file(path: &VolumePath, kind: FileKind) -> VolumeError {
    let what = match kind {
        FileKind::Dir => " (use the dir calls)",
        FileKind::Regular | FileKind::Symlink => "",
        _ => "; the content API opens only regular files and directories (list, stat and remove work on it)",
    };
    VolumeError::bad_path(format!("{} is {}{what}", path.display(), kind.describe()))
}

fn remove_entry(fd: &DirFd, name: &OsStr, dir: bool, level: u32) -> Result<(), VolumeError> {
    if dir {
        if level > 256 {
            return Err(VolumeError::bad_path("nested deeper than 256 directories"));
        }
        let sub = fd.open_dir(name).map_err(VolumeError::Sys)?;
        for child in sub.entries().map_err(VolumeError::Sys)? {
            if let Some(st) = sub.stat(&child).map_err(VolumeError::Sys)? {
                remove_entry(&sub, &child, st.kind == FileKind::Dir, level + 1)?;
            }
        }
    }
    match fd.remove(name, dir) {
        Err(e) if e.errno() != Some(libc::ENOENT) => Err(VolumeError::Sys(e)),
        _ => Ok(()),
    }
}

/// Sets what `meta` asks for on the open `file`; `default_mode` when it gives none (a
/// new file's mode must not depend on the server's umask).
fn apply(file: &File, meta: Meta, default_mode: Option<u32>) -> Result<(), VolumeError> {
    if meta.uid.is_some() || meta.gid.is_some() {
        std::os::unix::fs::fchown(file, meta.uid, meta.gid)
            .map_err(|e| VolumeError::io("fchown", e))?;
    }
    if let Some(mode) = meta.mode.or(default_mode) {
        file.set_permissions(std::fs::Permissions::from_mode(mode & MODE_MASK))
            .map_err(|e| VolumeError::io("fchmod", e))?;
    }
    Ok(())
}

/// The error for a failed `openat` of a path's last component.
fn final_error(
    fd: &DirFd,
    name: &OsStr,
    path: &VolumePath,
    e: crate::sys::SysError,
) -> VolumeError {
    match e.errno() {
        Some(libc::ENOENT) => VolumeError::PathNotFound(path.display()),
        Some(libc::ELOOP) => VolumeError::bad_path(format!(
            "{} is a symlink; the content API does not follow symlinks",
            path.display()
        )),
        Some(libc::EISDIR) => VolumeError::bad_path(format!("{} is a directory", path.display())),
        _ => match fd.stat(name) {
            Ok(Some(st)) if st.kind == FileKind::Symlink => final_error(
                fd,
                name,
                path,
                crate::sys::SysError::from_errno("openat", libc::ELOOP),
            ),
            // A device on the `nodev` mount (EACCES), a FIFO without reader (ENXIO), a
            // socket: what it is, not a server fault.
            Ok(Some(st)) if st.kind.is_special() => not_a_file(path, st.kind),
            _ => no_space(VolumeError::Sys(e)),
        },
    }
}

/// The error for a directory along a path that could not be opened.
fn walk_error(
    fd: &DirFd,
    part: &OsStr,
    walked: &VolumePath,
    e: crate::sys::SysError,
) -> VolumeError {
    match (e.errno(), fd.stat(part)) {
        (Some(libc::ENOENT), _) => VolumeError::PathNotFound(walked.display()),
        (_, Ok(Some(st))) if st.kind == FileKind::Symlink => VolumeError::bad_path(format!(
            "{} is a symlink; the content API does not follow symlinks",
            walked.display()
        )),
        (Some(libc::ENOTDIR), _) => {
            VolumeError::bad_path(format!("{} is not a directory", walked.display()))
        }
        _ => VolumeError::Sys(e),
    }
}

/// ENOSPC and EDQUOT are the volume's quota, not a server fault.
fn no_space(e: VolumeError) -> VolumeError {
    match e.errno() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => VolumeError::NoSpace,
        _ => e,
    }
}

fn entry(fd: &DirFd, name: &OsStr, path: &VolumePath, st: &Stat) -> Entry {
    let kind = match st.kind {
        FileKind::Dir => EntryKind::Directory,
        FileKind::Regular => EntryKind::File,
        FileKind::Symlink => EntryKind::Symlink,
        // E2B's types stop here: devices, FIFOs and sockets are listed as `unknown`.
        _ => EntryKind::Unknown,
    };
    let target = (kind == EntryKind::Symlink)
        .then(|| fd.read_link(name).ok())
        .flatten()
        .map(|t| String::from_utf8_lossy(t.as_bytes()).into_owned());
    Entry {
        name: name.to_string_lossy().into_owned(),
        kind,
        path: path.display(),
        size: st.size,
        mode: st.mode,
        uid: st.uid,
        gid: st.gid,
        atime: time(st.atime),
        mtime: time(st.mtime),
        ctime: time(st.ctime),
        target,
    }
}

fn time((secs, nsec): (i64, i64)) -> SystemTime {
    let secs = u64::try_from(secs).unwrap_or(0);
    UNIX_EPOCH + Duration::new(secs, u32::try_from(nsec).unwrap_or(0).min(999_999_999))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("aenv-volume-{name}-{}", crate::util::new_id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn paths_refuse_dot_dot_and_nul() {
        for bad in ["/a/../b", "..", "/x/..", "a\0b"] {
            assert!(
                matches!(VolumePath::parse(bad), Err(VolumeError::BadPath(_))),
                "{bad}"
            );
        }
        assert_eq!(VolumePath::parse("a//./b/").unwrap().display(), "/a/b");
        assert!(VolumePath::parse("/").unwrap().is_root());
    }

    #[test]
    fn symlinks_are_never_followed() {
        let root = scratch("symlink");
        let outside = scratch("outside");
        std::fs::write(outside.join("secret"), b"host").unwrap();
        std::os::unix::fs::symlink(&outside, root.join("out")).unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), root.join("link")).unwrap();
        let tree = Tree::new(&root);
        let p = |s| VolumePath::parse(s).unwrap();
        assert!(matches!(
            tree.read(&p("/out/secret")),
            Err(VolumeError::BadPath(_))
        ));
        assert!(matches!(
            tree.read(&p("/link")),
            Err(VolumeError::BadPath(_))
        ));
        let mut body: &[u8] = b"x";
        let w = tree.write(&p("/link"), &mut body, Meta::default(), false);
        assert!(matches!(w, Err(VolumeError::BadPath(_))), "{w:?}");
        let m = tree.set_meta(
            &p("/link"),
            Meta {
                mode: Some(0o777),
                ..Meta::default()
            },
        );
        assert!(matches!(m, Err(VolumeError::BadPath(_))));
        assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"host");
        let st = tree.stat(&p("/link")).unwrap();
        assert_eq!(st.kind, EntryKind::Symlink);
        assert_eq!(
            st.target.as_deref(),
            Some(outside.join("secret").to_str().unwrap())
        );
        tree.remove(&p("/out")).unwrap();
        assert!(outside.join("secret").exists(), "remove followed a symlink");
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_dir_all(&outside);
    }

    /// A device node, FIFO or socket (a guest can make the last two over NFS) is listed
    /// and removable but never opened: every other call is a 400 naming it, none blocks.
    #[test]
    fn special_entries_are_refused_without_being_opened() {
        use crate::sys::files::NodeKind;
        assert_eq!(
            crate::sys::files::effective_uid(),
            0,
            "needs root (mknod): run the suite with sudo"
        );
        let root = scratch("special");
        let dir = DirFd::open(&root).unwrap();
        dir.mknod(OsStr::new("null"), NodeKind::Char, 0o666, 1, 3)
            .unwrap();
        dir.mknod(OsStr::new("fifo"), NodeKind::Fifo, 0o666, 0, 0)
            .unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
        // A FIFO with a reader: an open for writing would succeed; it must not be used.
        let _reader = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(root.join("fifo"))
            .unwrap();
        let tree = Tree::new(&root);
        let p = |s| VolumePath::parse(s).unwrap();
        let kinds: Vec<(String, EntryKind)> = tree
            .list(&p("/"), 1)
            .unwrap()
            .into_iter()
            .map(|e| (e.path, e.kind))
            .collect();
        assert_eq!(
            kinds,
            [
                ("/fifo".to_string(), EntryKind::Unknown),
                ("/null".to_string(), EntryKind::Unknown),
                ("/sock".to_string(), EntryKind::Unknown)
            ]
        );
        for (name, kind) in [
            ("/null", "a character device"),
            ("/fifo", "a FIFO"),
            ("/sock", "a socket"),
        ] {
            let refused = |r: Result<(), VolumeError>, call: &str| match r {
                Err(VolumeError::BadPath(m)) => {
                    assert!(m.contains(name) && m.contains(kind), "{call} {name}: {m}")
                }
                other => panic!("{call} {name}: {other:?}"),
            };
            refused(tree.read(&p(name)).map(drop), "read");
            let mut body: &[u8] = b"x";
            refused(
                tree.write(&p(name), &mut body, Meta::default(), false)
                    .map(drop),
                "write",
            );
            let chmod = Meta {
                mode: Some(0o600),
                ..Meta::default()
            };
            refused(tree.set_meta(&p(name), chmod).map(drop), "set_meta");
            assert_eq!(tree.stat(&p(name)).unwrap().kind, EntryKind::Unknown);
        }
        assert_eq!(std::fs::metadata(root.join("fifo")).unwrap().len(), 0);
        for name in ["/null", "/fifo", "/sock"] {
            tree.remove(&p(name)).unwrap();
        }
        assert!(tree.list(&p("/"), 1).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn write_list_and_remove_a_tree() {
        let root = scratch("tree");
        let tree = Tree::new(&root);
        let p = |s| VolumePath::parse(s).unwrap();
        let mut body: &[u8] = b"hello";
        let meta = Meta {
            mode: Some(0o4755),
            ..Meta::default()
        };
        let e = tree.write(&p("/a/b/f.txt"), &mut body, meta, true).unwrap();
        assert_eq!(
            (e.kind, e.size, e.mode),
            (EntryKind::File, 5, 0o755),
            "setuid is dropped"
        );
        assert!(matches!(
            tree.make_dir(&p("/a"), Meta::default(), false),
            Err(VolumeError::Exists(_))
        ));
        let mut body: &[u8] = b"x";
        let missing = tree.write(&p("/none/f"), &mut body, Meta::default(), false);
        assert!(matches!(missing, Err(VolumeError::PathNotFound(_))));
        let names: Vec<String> = tree
            .list(&p("/"), 3)
            .unwrap()
            .into_iter()
            .map(|e| e.path)
            .collect();
        assert_eq!(names, ["/a", "/a/b", "/a/b/f.txt"]);
        assert_eq!(tree.list(&p("/a"), 1).unwrap().len(), 1);
        tree.remove(&p("/a")).unwrap();
        assert!(tree.list(&p("/"), 1).unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }
}
