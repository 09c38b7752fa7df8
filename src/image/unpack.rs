//! Applies layer tarballs onto a staging directory the way overlayfs would stack them:
//! whiteouts, opaque directories, hardlinks, device nodes, ownership, modes, times and
//! xattrs, with every path resolved inside the root (symlinks are never followed out).

use std::collections::{BTreeMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::ImageError;
use crate::sys::files::{self, NodeKind};

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_WHITEOUT: &[u8] = b".wh..wh..opq";
/// Like the kernel's limit on symlinks followed during one lookup.
const MAX_SYMLINKS: usize = 40;

/// State that outlives one layer: directory times are set once every layer is applied,
/// because adding entries to a directory changes its mtime.
#[derive(Default)]
pub struct Unpacker {
    root: PathBuf,
    dir_times: BTreeMap<PathBuf, (i64, i64)>,
}

/// What one layer created, so an opaque marker removes only what lower layers left.
struct LayerState {
    touched: HashSet<PathBuf>,
}

impl Unpacker {
    /// Unpacks into `root`, which must exist.
    pub fn new(root: &Path) -> Unpacker {
        Unpacker {
            root: root.to_path_buf(),
            dir_times: BTreeMap::new(),
        }
    }

    /// Applies one uncompressed layer tarball. `what` names the layer in errors.
    pub fn apply_layer<R: Read>(&mut self, reader: R, what: &str) -> Result<(), ImageError> {
        let mut archive = tar::Archive::new(reader);
        let mut state = LayerState {
            touched: HashSet::new(),
        };
        let entries = archive
            .entries()
            .map_err(|e| ImageError::BadImage(format!("{what}: not a tar archive: {e}")))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| read_error(what, e))?;
            self.apply_entry(&mut entry, &mut state)
                .map_err(|e| e.in_context(what))?;
        }
        Ok(())
    }

    /// Sets the directory times recorded by every layer. Call once, after the last layer.
    pub fn finish(self) -> Result<(), ImageError> {
        // Deepest first, so setting a child's time does not disturb its parent's.
        for (path, (secs, nsec)) in self.dir_times.iter().rev() {
            match files::set_times_nofollow(path, *secs, *nsec) {
                Ok(()) => {}
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                Err(e) => return Err(ImageError::Io(e.to_string())),
            }
        }
        Ok(())
    }

    fn apply_entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        state: &mut LayerState,
    ) -> Result<(), ImageError> {
        let raw_path = entry.path_bytes().into_owned();
        let display = String::from_utf8_lossy(&raw_path).into_owned();
        let components = split_path(&raw_path)
            .ok_or_else(|| ImageError::BadImage(format!("entry {display:?} escapes the root")))?;
        let kind = entry.header().entry_type();
        if matches!(kind, tar::EntryType::XGlobalHeader) {
            return Ok(());
        }
        let Some((name, parents)) = components.split_last() else {
            // The layer's own "./": metadata for the root directory.
            if kind.is_dir() {
                let meta = EntryMeta::read(entry)?;
                let root = self.root.clone();
                self.apply_meta(&root, &meta, true)?;
                return Ok(());
            }
            return Err(ImageError::BadImage(format!(
                "entry {display:?} would replace the root directory"
            )));
        };

        let name_bytes = name.as_bytes();
        if name_bytes.starts_with(WHITEOUT_PREFIX) {
            let Some(parent) = self.resolve(parents, false, &display)? else {
                return Ok(());
            };
            if name_bytes == OPAQUE_WHITEOUT {
                remove_untouched_children(&parent, &state.touched)?;
            } else if !name_bytes.starts_with(b".wh..wh.") {
                let target = parent.join(OsStr::from_bytes(&name_bytes[WHITEOUT_PREFIX.len()..]));
                remove_any(&target)?;
            }
            return Ok(());
        }

        let parent = self
            .resolve(parents, true, &display)?
            .expect("resolve creates missing parents");
        let dest = parent.join(name);
        let meta = EntryMeta::read(entry)?;
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                match fs::symlink_metadata(&dest) {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => {
                        remove_any(&dest)?;
                        mkdir(&dest)?;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => mkdir(&dest)?,
                    Err(e) => return Err(io_err("lstat", &dest, e)),
                }
                self.apply_meta(&dest, &meta, true)?;
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                remove_any(&dest)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&dest)
                    .map_err(|e| io_err("create", &dest, e))?;
                io::copy(entry, &mut file).map_err(|e| read_error(&display, e))?;
                drop(file);
                self.apply_meta(&dest, &meta, false)?;
            }
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        ImageError::BadImage(format!("symlink {display:?} has no target"))
                    })?
                    .into_owned();
                if target.is_empty() {
                    return Err(ImageError::BadImage(format!(
                        "symlink {display:?} has an empty target"
                    )));
                }
                remove_any(&dest)?;
                std::os::unix::fs::symlink(OsStr::from_bytes(&target), &dest)
                    .map_err(|e| io_err("symlink", &dest, e))?;
                self.apply_meta(&dest, &meta, false)?;
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        ImageError::BadImage(format!("hardlink {display:?} has no target"))
                    })?
                    .into_owned();
                let shown = String::from_utf8_lossy(&target).into_owned();
                let escape = || {
                    ImageError::BadImage(format!(
                        "hardlink {display:?} → {shown:?} points outside the root"
                    ))
                };
                let tcomps = split_path(&target).ok_or_else(escape)?;
                let (tname, tparents) = tcomps.split_last().ok_or_else(escape)?;
                let tparent = self.resolve(tparents, false, &shown)?.ok_or_else(|| {
                    ImageError::BadImage(format!(
                        "hardlink {display:?} → {shown:?}: the target does not exist"
                    ))
                })?;
                let source = tparent.join(tname);
                match fs::symlink_metadata(&source) {
                    Ok(m) if m.is_dir() => {
                        return Err(ImageError::BadImage(format!(
                            "hardlink {display:?} → {shown:?}: the target is a directory"
                        )))
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        return Err(ImageError::BadImage(format!(
                            "hardlink {display:?} → {shown:?}: the target does not exist"
                        )))
                    }
                    Err(e) => return Err(io_err("lstat", &source, e)),
                }
                if source != dest {
                    remove_any(&dest)?;
                    // linkat without AT_SYMLINK_FOLLOW: a symlink target is linked itself.
                    fs::hard_link(&source, &dest).map_err(|e| io_err("link", &dest, e))?;
                }
            }
            T::Char | T::Block | T::Fifo => {
                let node = match kind {
                    T::Char => NodeKind::Char,
                    T::Block => NodeKind::Block,
                    _ => NodeKind::Fifo,
                };
                let header = entry.header();
                let major = header.device_major().ok().flatten().unwrap_or(0);
                let minor = header.device_minor().ok().flatten().unwrap_or(0);
                remove_any(&dest)?;
                files::mknod(&dest, node, 0o600, major, minor)
                    .map_err(|e| ImageError::Io(e.to_string()))?;
                self.apply_meta(&dest, &meta, false)?;
            }
            other => {
                return Err(ImageError::BadImage(format!(
                    "entry {display:?} has unsupported tar type {other:?}"
                )))
            }
        }
        state.touched.insert(dest);
        Ok(())
    }

    /// Resolves `components` (directories) inside the root, following symlinks the way
    /// the guest would see them: absolute targets restart at the root, and climbing above
    /// the root is refused. With `create`, missing directories are made (0755, root);
    /// without, a missing one yields `None`.
    fn resolve(
        &self,
        components: &[OsString],
        create: bool,
        display: &str,
    ) -> Result<Option<PathBuf>, ImageError> {
        let escape = || ImageError::BadImage(format!("entry {display:?} escapes the root"));
        let mut resolved: Vec<OsString> = Vec::new();
        let mut pending: Vec<OsString> = components.iter().rev().cloned().collect();
        let mut followed = 0;
        while let Some(c) = pending.pop() {
            if c == ".." {
                resolved.pop().ok_or_else(escape)?;
                continue;
            }
            if c.is_empty() || c == "." {
                continue;
            }
            let mut candidate = self.root.clone();
            candidate.extend(&resolved);
            candidate.push(&c);
            match fs::symlink_metadata(&candidate) {
                Ok(m) if m.is_dir() => resolved.push(c),
                Ok(m) if m.file_type().is_symlink() => {
                    followed += 1;
                    if followed > MAX_SYMLINKS {
                        return Err(ImageError::BadImage(format!(
                            "entry {display:?}: too many levels of symlinks"
                        )));
                    }
                    let target =
                        fs::read_link(&candidate).map_err(|e| io_err("readlink", &candidate, e))?;
                    let bytes = target.as_os_str().as_bytes();
                    if bytes.starts_with(b"/") {
                        resolved.clear();
                    }
                    for part in bytes.split(|b| *b == b'/').rev() {
                        pending.push(OsStr::from_bytes(part).to_os_string());
                    }
                }
                Ok(_) => {
                    if !create {
                        return Ok(None);
                    }
                    return Err(ImageError::BadImage(format!(
                        "entry {display:?}: {} is not a directory",
                        candidate
                            .strip_prefix(&self.root)
                            .unwrap_or(&candidate)
                            .display()
                    )));
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if !create {
                        return Ok(None);
                    }
                    mkdir(&candidate)?;
                    resolved.push(c);
                }
                Err(e) => return Err(io_err("lstat", &candidate, e)),
            }
        }
        let mut path = self.root.clone();
        path.extend(&resolved);
        Ok(Some(path))
    }

    fn apply_meta(
        &mut self,
        path: &Path,
        meta: &EntryMeta,
        is_dir: bool,
    ) -> Result<(), ImageError> {
        let sys = |e: crate::sys::SysError| ImageError::Io(e.to_string());
        files::lchown(path, meta.uid, meta.gid).map_err(sys)?;
        if !meta.is_symlink {
            // After chown, which clears setuid/setgid.
            fs::set_permissions(path, fs::Permissions::from_mode(meta.mode))
                .map_err(|e| io_err("chmod", path, e))?;
        }
        for (name, value) in &meta.xattrs {
            match files::lsetxattr(path, name, value) {
                Ok(()) => {}
                // The staging file system may not take every namespace; mkfs copies what
                // is there, and images rarely depend on xattrs.
                Err(e) if matches!(e.errno(), Some(libc::ENOTSUP) | Some(libc::EPERM)) => {
                    log::warn!(
                        "op=unpack xattr={name} path={} skipped: {e}",
                        path.display()
                    );
                }
                Err(e) => return Err(sys(e)),
            }
        }
        if is_dir {
            self.dir_times.insert(path.to_path_buf(), meta.mtime);
        } else {
            files::set_times_nofollow(path, meta.mtime.0, meta.mtime.1).map_err(sys)?;
        }
        Ok(())
    }
}

/// Ownership, mode, time and xattrs of one entry, with PAX overrides applied.
struct EntryMeta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: (i64, i64),
    is_symlink: bool,
    xattrs: Vec<(String, Vec<u8>)>,
}

impl EntryMeta {
    fn read<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<EntryMeta, ImageError> {
        let header = entry.header();
        let bad = |field: &str, e: io::Error| {
            ImageError::BadImage(format!("tar header has an invalid {field}: {e}"))
        };
        let mut meta = EntryMeta {
            uid: header.uid().map_err(|e| bad("uid", e))? as u32,
            gid: header.gid().map_err(|e| bad("gid", e))? as u32,
            mode: header.mode().map_err(|e| bad("mode", e))? & 0o7777,
            mtime: (header.mtime().map_err(|e| bad("mtime", e))? as i64, 0),
            is_symlink: header.entry_type().is_symlink(),
            xattrs: Vec::new(),
        };
        if let Some(pax) = entry.pax_extensions().map_err(|e| bad("pax header", e))? {
            for ext in pax.flatten() {
                let Ok(key) = ext.key() else { continue };
                let value = ext.value_bytes();
                let text = std::str::from_utf8(value).unwrap_or("");
                match key {
                    "uid" => {
                        meta.uid = text
                            .parse()
                            .map_err(|_| bad("pax uid", io::ErrorKind::InvalidData.into()))?
                    }
                    "gid" => {
                        meta.gid = text
                            .parse()
                            .map_err(|_| bad("pax gid", io::ErrorKind::InvalidData.into()))?
                    }
                    "mtime" => {
                        if let Some(t) = parse_pax_time(text) {
                            meta.mtime = t;
                        }
                    }
                    _ => {
                        if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                            // overlayfs bookkeeping from the build host means nothing here.
                            if !name.starts_with("trusted.overlay.") {
                                meta.xattrs.push((name.to_string(), value.to_vec()));
                            }
                        }
                    }
                }
            }
        }
        Ok(meta)
    }
}

fn parse_pax_time(text: &str) -> Option<(i64, i64)> {
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let secs: i64 = secs.parse().ok()?;
    let mut nsec = 0i64;
    for (i, d) in frac.bytes().take(9).enumerate() {
        if !d.is_ascii_digit() {
            return None;
        }
        nsec += i64::from(d - b'0') * 10i64.pow(8 - i as u32);
    }
    Some((secs, if secs < 0 { 0 } else { nsec }))
}

/// Splits a tar path into normal components; `None` if it climbs with `..`.
/// Leading `/` and `./` are dropped, like every container runtime does.
fn split_path(raw: &[u8]) -> Option<Vec<OsString>> {
    let mut out = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return None,
            p => out.push(OsStr::from_bytes(p).to_os_string()),
        }
    }
    Some(out)
}

fn mkdir(path: &Path) -> Result<(), ImageError> {
    fs::create_dir(path).map_err(|e| io_err("mkdir", path, e))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| io_err("chmod", path, e))
}

/// Removes whatever is at `path` (a directory recursively), never following a symlink.
fn remove_any(path: &Path) -> Result<(), ImageError> {
    let result = match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => Err(e),
    };
    result.map_err(|e| io_err("remove", path, e))
}

/// Opaque directory: everything below `dir` that this layer did not itself create goes.
fn remove_untouched_children(dir: &Path, touched: &HashSet<PathBuf>) -> Result<(), ImageError> {
    let entries = fs::read_dir(dir).map_err(|e| io_err("readdir", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_err("readdir", dir, e))?;
        let path = entry.path();
        if !touched.contains(&path) {
            remove_any(&path)?;
        } else if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            remove_untouched_children(&path, touched)?;
        }
    }
    Ok(())
}

fn io_err(op: &str, path: &Path, e: io::Error) -> ImageError {
    ImageError::Io(format!("{op} {}: {e}", path.display()))
}

fn read_error(what: &str, e: io::Error) -> ImageError {
    match e.kind() {
        io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof | io::ErrorKind::Other => {
            ImageError::BadImage(format!("{what}: corrupt layer data: {e}"))
        }
        _ => ImageError::Io(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::testutil::TempDir;
    use crate::image::LayerBuilder;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn is_root() -> bool {
        files::effective_uid() == 0
    }

    /// Applies `layers` to `<tmp>/root`; returns the temp dir and the result.
    fn apply(name: &str, layers: Vec<LayerBuilder>) -> (TempDir, PathBuf, Result<(), ImageError>) {
        let t = TempDir::new(name);
        let root = t.path().join("root");
        fs::create_dir(&root).unwrap();
        let mut u = Unpacker::new(&root);
        let mut result = Ok(());
        for (i, layer) in layers.into_iter().enumerate() {
            let tar = layer.finish();
            result = u.apply_layer(tar.as_slice(), &format!("layer {i}"));
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() {
            result = u.finish();
        }
        (t, root, result)
    }

    fn raw_header(kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h
    }

    #[test]
    fn whiteout_removes_a_lower_file() {
        if !is_root() {
            return;
        }
        let mut l1 = LayerBuilder::new();
        l1.dir("etc", 0o755)
            .file("etc/a", 0o644, b"a")
            .file("etc/b", 0o644, b"b");
        l1.dir("etc/sub", 0o755).file("etc/sub/c", 0o644, b"c");
        let mut l2 = LayerBuilder::new();
        l2.whiteout("etc/a")
            .whiteout("etc/sub")
            .whiteout("etc/never-existed");
        let (_t, root, r) = apply("whiteout", vec![l1, l2]);
        r.unwrap();
        assert!(!root.join("etc/a").exists());
        assert!(!root.join("etc/sub").exists());
        assert!(!root.join("etc/.wh.a").exists());
        assert_eq!(fs::read(root.join("etc/b")).unwrap(), b"b");
    }

    #[test]
    fn opaque_dir_hides_lower_contents_but_keeps_this_layers() {
        if !is_root() {
            return;
        }
        let mut l1 = LayerBuilder::new();
        l1.dir("d", 0o755)
            .file("d/old", 0o644, b"old")
            .dir("d/sub", 0o755)
            .file("d/sub/deep", 0o644, b"deep")
            .file("other", 0o644, b"other");
        let mut l2 = LayerBuilder::new();
        // An entry before the marker (some tools order it so) must survive.
        l2.dir("d", 0o755)
            .file("d/early", 0o644, b"early")
            .opaque("d")
            .file("d/new", 0o644, b"new");
        let (_t, root, r) = apply("opaque", vec![l1, l2]);
        r.unwrap();
        let mut names: Vec<String> = fs::read_dir(root.join("d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, vec!["early", "new"]);
        assert!(root.join("other").exists());
    }

    #[test]
    fn dotdot_escape_is_refused() {
        if !is_root() {
            return;
        }
        let mut l = LayerBuilder::new();
        l.raw(raw_header(tar::EntryType::Regular), "a/../../escaped", b"x");
        let (t, _root, r) = apply("dotdot", vec![l]);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("escapes")),
            "{r:?}"
        );
        assert!(!t.path().join("escaped").exists());
        let mut l = LayerBuilder::new();
        l.hardlink("innocent", "../../etc/passwd");
        let (_t, root, r) = apply("dotdot-link", vec![l]);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("outside")),
            "{r:?}"
        );
        assert!(!root.join("innocent").exists());
    }

    #[test]
    fn absolute_symlink_is_never_followed_out_of_the_root() {
        if !is_root() {
            return;
        }
        let outside = TempDir::new("outside");
        let target = outside.path().display().to_string();
        let mut l1 = LayerBuilder::new();
        l1.dir("sub", 0o755).symlink("sub/evil", &target);
        let mut l2 = LayerBuilder::new();
        l2.file("sub/evil/pwned", 0o644, b"pwned");
        // A symlink at the final component is replaced, not written through.
        let mut l3 = LayerBuilder::new();
        l3.symlink("passwd", &format!("{target}/victim"))
            .file("passwd", 0o644, b"image's own");
        fs::write(outside.path().join("victim"), b"host").unwrap();
        let (_t, root, r) = apply("abs-symlink", vec![l1, l2, l3]);
        r.unwrap();
        assert!(
            !outside.path().join("pwned").exists(),
            "wrote outside the root"
        );
        assert_eq!(fs::read(outside.path().join("victim")).unwrap(), b"host");
        // Resolved the way the guest sees it: relative to the image root.
        let inside = root.join(target.trim_start_matches('/')).join("pwned");
        assert_eq!(fs::read(inside).unwrap(), b"pwned");
        assert!(fs::symlink_metadata(root.join("sub/evil"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(fs::read(root.join("passwd")).unwrap(), b"image's own");
    }

    #[test]
    fn symlinked_parent_pointing_outside_is_refused() {
        if !is_root() {
            return;
        }
        let mut l = LayerBuilder::new();
        l.dir("a", 0o755)
            .symlink("a/up", "../..")
            .file("a/up/pwned", 0o644, b"x");
        let (t, _root, r) = apply("parent-escape", vec![l]);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("escapes")),
            "{r:?}"
        );
        assert!(!t.path().join("pwned").exists());
        // An absolute target that climbs is refused as well.
        let mut l = LayerBuilder::new();
        l.symlink("up", "/../..").file("up/pwned", 0o644, b"x");
        let (_t, _root, r) = apply("parent-escape-abs", vec![l]);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("escapes")),
            "{r:?}"
        );
        // A relative symlink that stays inside is followed.
        let mut l = LayerBuilder::new();
        l.dir("usr/bin", 0o755)
            .symlink("bin", "usr/bin")
            .file("bin/tool", 0o755, b"t");
        let (_t, root, r) = apply("parent-inside", vec![l]);
        r.unwrap();
        assert_eq!(fs::read(root.join("usr/bin/tool")).unwrap(), b"t");
    }

    #[test]
    fn hardlink_replaces_an_existing_file_and_shares_the_inode() {
        if !is_root() {
            return;
        }
        let mut l1 = LayerBuilder::new();
        l1.file("x", 0o644, b"old x")
            .file("y", 0o644, b"y contents");
        let mut l2 = LayerBuilder::new();
        l2.hardlink("x", "y");
        let (_t, root, r) = apply("hardlink", vec![l1, l2]);
        r.unwrap();
        let (x, y) = (
            fs::metadata(root.join("x")).unwrap(),
            fs::metadata(root.join("y")).unwrap(),
        );
        assert_eq!(x.ino(), y.ino());
        assert_eq!(x.nlink(), 2);
        assert_eq!(fs::read(root.join("x")).unwrap(), b"y contents");
    }

    #[test]
    fn device_nodes_are_real() {
        if !is_root() {
            return;
        }
        let mut l = LayerBuilder::new();
        l.dir("dev", 0o755).char_device("dev/null", 0o666, 1, 3);
        let mut h = raw_header(tar::EntryType::Fifo);
        h.set_mode(0o600);
        l.raw(h, "dev/fifo", &[]);
        let (_t, root, r) = apply("devices", vec![l]);
        r.unwrap();
        let md = fs::symlink_metadata(root.join("dev/null")).unwrap();
        assert!(md.file_type().is_char_device());
        assert_eq!(md.rdev(), libc::makedev(1, 3));
        assert_eq!(md.mode() & 0o7777, 0o666);
        assert!(fs::symlink_metadata(root.join("dev/fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
    }

    #[test]
    fn file_and_directory_replace_each_other() {
        if !is_root() {
            return;
        }
        let mut l1 = LayerBuilder::new();
        l1.dir("p", 0o755)
            .file("p/child", 0o644, b"c")
            .file("q", 0o644, b"q");
        let mut l2 = LayerBuilder::new();
        l2.file("p", 0o644, b"now a file")
            .dir("q", 0o750)
            .file("q/inner", 0o644, b"i");
        let (_t, root, r) = apply("dir-file", vec![l1, l2]);
        r.unwrap();
        assert_eq!(fs::read(root.join("p")).unwrap(), b"now a file");
        let q = fs::symlink_metadata(root.join("q")).unwrap();
        assert!(q.is_dir());
        assert_eq!(q.mode() & 0o7777, 0o750);
        assert_eq!(fs::read(root.join("q/inner")).unwrap(), b"i");
    }

    #[test]
    fn ownership_setuid_and_mtime_are_kept() {
        if !is_root() {
            return;
        }
        let mut l = LayerBuilder::new();
        l.dir("bin", 0o755)
            .file_owned("bin/su", 0o4755, 1000, 2000, b"su")
            .symlink("bin/link", "su");
        let (_t, root, r) = apply("owner", vec![l]);
        r.unwrap();
        let md = fs::symlink_metadata(root.join("bin/su")).unwrap();
        assert_eq!((md.uid(), md.gid()), (1000, 2000));
        assert_eq!(md.mode() & 0o7777, 0o4755);
        assert_eq!(md.mtime() as u64, crate::image::writer::FIXED_MTIME);
        let dir = fs::symlink_metadata(root.join("bin")).unwrap();
        assert_eq!(dir.mtime() as u64, crate::image::writer::FIXED_MTIME);
    }

    #[test]
    fn pax_times_parse() {
        assert_eq!(parse_pax_time("12.5"), Some((12, 500_000_000)));
        assert_eq!(parse_pax_time("7"), Some((7, 0)));
        assert_eq!(parse_pax_time("x"), None);
        assert_eq!(
            split_path(b"./a//b/./c/"),
            Some(vec!["a".into(), "b".into(), "c".into()])
        );
        assert_eq!(split_path(b"a/../b"), None);
    }
}
