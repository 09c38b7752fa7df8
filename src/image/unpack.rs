//! Applies layer tarballs onto a staging directory the way overlayfs would stack them:
//! whiteouts, opaque directories, hardlinks, ownership, modes, times and xattrs, with
//! every path resolved inside the root (symlinks are never followed out) and every
//! removal confined to it.
//!
//! The staging tree is a host directory, so nothing in it may hand a local user power:
//! setuid/setgid bits and file capabilities are left off the host files, and device nodes
//! are empty placeholder files. What the guest must still see is returned as [`Fixup`]s,
//! which `rootfs::apply_fixups` writes into the finished ext4 image. A [`Budget`] from
//! the disk size bounds the bytes and inodes a layer may create while it is applied, and
//! GNU sparse entries stay sparse (holes are seeked over, never written).

use std::collections::{BTreeMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::io::{self, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::ImageError;
use crate::sys::files::{DirFd, FileKind, NodeKind};

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_WHITEOUT: &[u8] = b".wh..wh..opq";
/// Like the kernel's limit on symlinks followed during one lookup.
const MAX_SYMLINKS: usize = 40;
/// ext4's largest file with 4 KiB blocks.
const MAX_FILE_BYTES: u64 = 16 << 40;
const BLOCK: u64 = 4096;
/// The xattr that gives a file capabilities when executed.
const CAPABILITY_XATTR: &str = "security.capability";

/// How much an image may create: the disk it becomes can hold no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub inodes: u64,
    /// The disk size the budget comes from, for messages.
    pub disk_mb: u32,
}

impl Budget {
    /// The bytes and inodes of an ext4 of `disk_mb` MiB made by `rootfs::build`.
    pub fn for_disk(disk_mb: u32) -> Budget {
        Budget {
            bytes: u64::from(disk_mb) << 20,
            inodes: super::rootfs::inode_capacity(u64::from(disk_mb)),
            disk_mb,
        }
    }
}

/// Metadata the host tree does not carry and the built ext4 must get: setuid/setgid
/// modes, file capabilities and device nodes (a placeholder file on the host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fixup {
    /// Absolute path inside the image.
    pub path: String,
    /// A device node to create in place of the placeholder.
    pub device: Option<(NodeKind, u32, u32)>,
    /// Permission bits, setuid/setgid included.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    /// The `security.capability` value.
    pub capability: Option<Vec<u8>>,
}

/// A host file whose real metadata is kept aside: its inode, so a replaced path is never
/// fixed up, and what the guest must see.
#[derive(Debug, Clone)]
struct Special {
    ino: u64,
    fixup: Fixup,
}

/// A directory of the tree being built, held open, and where it is (for bookkeeping and
/// messages; never used to reach it).
struct Dir {
    fd: DirFd,
    path: PathBuf,
}

impl Dir {
    /// The entry `name` in it, as a bookkeeping path.
    fn child(&self, name: &OsStr) -> PathBuf {
        self.path.join(name)
    }
}

/// State that outlives one layer: directory times are set once every layer is applied,
/// because adding entries to a directory changes its mtime.
///
/// Every file operation is relative to a directory descriptor reached from the root's
/// one component at a time with `O_NOFOLLOW` (see [`DirFd`]): no path string is ever
/// resolved by the kernel from the root down, so a symlink in the tree (put there by a
/// layer, or swapped in by anyone while the unpacker runs) is never followed out of it.
pub struct Unpacker {
    root: PathBuf,
    root_fd: DirFd,
    dir_times: BTreeMap<PathBuf, (i64, i64)>,
    budget: Budget,
    used_bytes: u64,
    used_inodes: u64,
    /// Host path → what the guest sees there instead.
    specials: BTreeMap<PathBuf, Special>,
}

/// What one layer created, so an opaque marker removes only what lower layers left.
struct LayerState {
    touched: HashSet<PathBuf>,
}

fn sys_err(e: crate::sys::SysError) -> ImageError {
    ImageError::Io(e.to_string())
}

impl Unpacker {
    /// Unpacks into `root`, which must exist, within `budget`.
    pub fn new(root: &Path, budget: Budget) -> Result<Unpacker, ImageError> {
        Ok(Unpacker {
            root: root.to_path_buf(),
            root_fd: DirFd::open(root).map_err(sys_err)?,
            dir_times: BTreeMap::new(),
            budget,
            used_bytes: 0,
            used_inodes: 0,
            specials: BTreeMap::new(),
        })
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

    /// Sets the directory times recorded by every layer and returns what the ext4 must
    /// get on top of the tree. Call once, after the last layer.
    pub fn finish(self) -> Result<Vec<Fixup>, ImageError> {
        // Deepest first, so setting a child's time does not disturb its parent's.
        for (path, (secs, nsec)) in self.dir_times.iter().rev() {
            // A directory a later layer replaced, or moved under a symlink, is skipped.
            if let Some((dir, name)) = self.find(path)? {
                dir.set_times(&name, *secs, *nsec).map_err(sys_err)?;
            }
        }
        let mut fixups = Vec::new();
        for (path, special) in &self.specials {
            // Removals drop their entries; the inode check is a second guard.
            let Some((dir, name)) = self.find(path)? else {
                continue;
            };
            let stat = dir.stat(&name).map_err(sys_err)?;
            if stat.is_some_and(|st| st.ino == special.ino && st.kind == FileKind::Regular) {
                fixups.push(special.fixup.clone());
            }
        }
        Ok(fixups)
    }

    /// The directory holding the existing entry at bookkeeping path `path` and its name
    /// (`.` for the root), reached without following any symlink; `None` when something
    /// along the way is missing or no longer a directory.
    fn find(&self, path: &Path) -> Result<Option<(DirFd, OsString)>, ImageError> {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        let parts: Vec<&OsStr> = rel.iter().collect();
        let Some((name, parents)) = parts.split_last() else {
            let root = DirFd::open(&self.root).map_err(sys_err)?;
            return Ok(Some((root, OsString::from("."))));
        };
        let mut dir: Option<DirFd> = None;
        for part in parents {
            let at = dir.as_ref().unwrap_or(&self.root_fd);
            match at.open_dir(part) {
                Ok(next) => dir = Some(next),
                Err(e)
                    if matches!(
                        e.errno(),
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(sys_err(e)),
            }
        }
        let dir = match dir {
            Some(d) => d,
            None => DirFd::open(&self.root).map_err(sys_err)?,
        };
        Ok(Some((dir, name.to_os_string())))
    }

    /// Counts what an entry creates against the budget.
    fn charge(&mut self, display: &str, bytes: u64, inodes: u64) -> Result<(), ImageError> {
        let bytes = self.used_bytes.saturating_add(bytes);
        let inodes = self.used_inodes.saturating_add(inodes);
        if bytes > self.budget.bytes || inodes > self.budget.inodes {
            return Err(ImageError::BadImage(format!(
                "entry {display:?} takes the unpacked image past the requested disk of {} MiB \
                 ({} bytes and {} files at most); ask for a larger diskSizeMB if the image is \
                 genuine",
                self.budget.disk_mb, self.budget.bytes, self.budget.inodes
            )));
        }
        self.used_bytes = bytes;
        self.used_inodes = inodes;
        Ok(())
    }

    /// Applies one tar entry of a layer: checks its path and resolves its parents, has the
    /// piece for its kind make it, and records it as touched by this layer.
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
            return self.apply_root_entry(entry, &display);
        };
        let name = name.as_os_str();

        let name_bytes = name.as_bytes();
        if name_bytes.starts_with(WHITEOUT_PREFIX) {
            return self.apply_whiteout(parents, name_bytes, &display, state);
        }

        let parent = self
            .resolve(parents, true, &display)?
            .expect("resolve creates missing parents");
        let dest = parent.child(name);
        let meta = EntryMeta::read(entry)?;
        use tar::EntryType as T;
        match kind {
            T::Directory => self.make_dir(&parent, name, &meta, &display)?,
            T::Regular | T::Continuous | T::GNUSparse => {
                self.make_file(entry, &parent, name, &meta, &display)?
            }
            T::Symlink => self.make_symlink(entry, &parent, name, &meta, &display)?,
            T::Link => self.make_hardlink(entry, &parent, name, &dest, &display)?,
            T::Char | T::Block => self.make_device(entry, &parent, name, &meta, &display)?,
            T::Fifo => {
                self.remove_any(&parent, name, &display)?;
                self.charge(&display, 0, 1)?;
                parent
                    .fd
                    .mknod(name, NodeKind::Fifo, 0o600, 0, 0)
                    .map_err(sys_err)?;
                self.apply_meta(&parent, name, &meta, false, &display)?;
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

    /// The layer's own "./": metadata for the root directory; anything but a directory
    /// there would replace the root and is refused.
    fn apply_root_entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        display: &str,
    ) -> Result<(), ImageError> {
        if !entry.header().entry_type().is_dir() {
            return Err(ImageError::BadImage(format!(
                "entry {display:?} would replace the root directory"
            )));
        }
        let meta = EntryMeta::read(entry)?;
        let root = Dir {
            fd: DirFd::open(&self.root).map_err(sys_err)?,
            path: self.root.clone(),
        };
        self.apply_meta(&root, OsStr::new("."), &meta, true, display)
    }

    /// A directory entry: an existing directory stays (with lower layers' contents) and
    /// takes the entry's metadata; anything else there is replaced.
    fn make_dir(
        &mut self,
        parent: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        display: &str,
    ) -> Result<(), ImageError> {
        match parent.fd.stat(name).map_err(sys_err)? {
            Some(st) if st.kind == FileKind::Dir => {}
            Some(_) => {
                self.remove_any(parent, name, display)?;
                self.charge(display, BLOCK, 1)?;
                mkdir(&parent.fd, name)?;
            }
            None => {
                self.charge(display, BLOCK, 1)?;
                mkdir(&parent.fd, name)?;
            }
        }
        self.apply_meta(parent, name, meta, true, display)
    }

    /// A regular (or contiguous, or GNU sparse) file: charged by what the layer stores of
    /// it and written by tar's own unpack.
    fn make_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        parent: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        display: &str,
    ) -> Result<(), ImageError> {
        let logical = entry.size();
        if logical > MAX_FILE_BYTES {
            return Err(ImageError::BadImage(format!(
                "entry {display:?} claims {logical} bytes, more than ext4 can hold"
            )));
        }
        // What is stored in the layer: for a sparse entry only its data, not its holes.
        let stored = match entry.header().entry_type() {
            tar::EntryType::GNUSparse => entry
                .header()
                .entry_size()
                .map_err(|e| read_error(display, e))?,
            _ => logical,
        };
        self.remove_any(parent, name, display)?;
        self.charge(display, stored.div_ceil(BLOCK) * BLOCK, 1)?;
        // tar's own unpack writes data runs and seeks over holes. It creates the file with
        // O_EXCL (never through a symlink) at a path that starts at the parent's
        // descriptor, after the removal above.
        entry
            .unpack(parent.fd.entry_path(name))
            .map_err(|e| read_error(display, e))?;
        self.apply_meta(parent, name, meta, false, display)
    }

    /// A symlink, with its target as stored (never followed here); an empty target is
    /// refused.
    fn make_symlink<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        parent: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        display: &str,
    ) -> Result<(), ImageError> {
        let target = entry
            .link_name_bytes()
            .ok_or_else(|| ImageError::BadImage(format!("symlink {display:?} has no target")))?
            .into_owned();
        if target.is_empty() {
            return Err(ImageError::BadImage(format!(
                "symlink {display:?} has an empty target"
            )));
        }
        self.remove_any(parent, name, display)?;
        let blocks = if target.len() >= 60 { BLOCK } else { 0 };
        self.charge(display, blocks, 1)?;
        parent
            .fd
            .symlink(name, OsStr::from_bytes(&target))
            .map_err(sys_err)?;
        self.apply_meta(parent, name, meta, false, display)
    }

    /// A hard link `dest` to an existing non-directory inside the root (a link to itself
    /// changes nothing); a link to a device node is refused, one to another kept special
    /// file is kept special too.
    fn make_hardlink<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        parent: &Dir,
        name: &OsStr,
        dest: &Path,
        display: &str,
    ) -> Result<(), ImageError> {
        let target = entry
            .link_name_bytes()
            .ok_or_else(|| ImageError::BadImage(format!("hardlink {display:?} has no target")))?
            .into_owned();
        let shown = String::from_utf8_lossy(&target).into_owned();
        let refuse =
            |why: &str| ImageError::BadImage(format!("hardlink {display:?} → {shown:?}{why}"));
        let tcomps = split_path(&target).ok_or_else(|| refuse(" points outside the root"))?;
        let (tname, tparents) = tcomps
            .split_last()
            .ok_or_else(|| refuse(" points outside the root"))?;
        let tparent = self
            .resolve(tparents, false, &shown)?
            .ok_or_else(|| refuse(": the target does not exist"))?;
        let source = tparent.child(tname);
        match tparent.fd.stat(tname).map_err(sys_err)? {
            Some(st) if st.kind == FileKind::Dir => {
                return Err(refuse(": the target is a directory"))
            }
            Some(_) => {}
            None => return Err(refuse(": the target does not exist")),
        }
        if source == dest {
            return Ok(());
        }
        let special = self.specials.get(&source).cloned();
        if special.as_ref().is_some_and(|s| s.fixup.device.is_some()) {
            return Err(refuse(": links to device nodes are not supported"));
        }
        self.remove_any(parent, name, display)?;
        self.charge(display, 0, 0)?;
        // linkat without AT_SYMLINK_FOLLOW: a symlink target is linked itself.
        parent
            .fd
            .hard_link(name, &tparent.fd, tname)
            .map_err(sys_err)?;
        if let Some(mut special) = special {
            special.fixup.path = self.image_path(dest, display)?;
            self.specials.insert(dest.to_path_buf(), special);
        }
        Ok(())
    }

    /// A character or block device: never a real device on the host, but an empty file
    /// that the ext4 fixup replaces with the node.
    fn make_device<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        parent: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        display: &str,
    ) -> Result<(), ImageError> {
        let header = entry.header();
        let node = if header.entry_type() == tar::EntryType::Char {
            NodeKind::Char
        } else {
            NodeKind::Block
        };
        let major = header.device_major().ok().flatten().unwrap_or(0);
        let minor = header.device_minor().ok().flatten().unwrap_or(0);
        self.remove_any(parent, name, display)?;
        self.charge(display, 0, 1)?;
        drop(parent.fd.create_file(name, 0o600).map_err(sys_err)?);
        self.keep_special(parent, name, meta, Some((node, major, minor)), display)?;
        self.apply_meta(parent, name, meta, false, display)
    }

    /// `dir/.wh.name` removes `name` from lower layers; `.wh..wh..opq` empties `dir` of
    /// what lower layers put there. A whiteout naming nothing, `.` or `..` is refused.
    fn apply_whiteout(
        &mut self,
        parents: &[OsString],
        name: &[u8],
        display: &str,
        state: &LayerState,
    ) -> Result<(), ImageError> {
        let hidden = &name[WHITEOUT_PREFIX.len()..];
        let opaque = name == OPAQUE_WHITEOUT;
        // Other `.wh..wh.` names are aufs bookkeeping (hardlink dirs): nothing to do.
        if !opaque && name.starts_with(b".wh..wh.") {
            return Ok(());
        }
        if !opaque && matches!(hidden, b"" | b"." | b"..") {
            return Err(ImageError::BadImage(format!(
                "whiteout {display:?} does not name a file"
            )));
        }
        let Some(parent) = self.resolve(parents, false, display)? else {
            return Ok(());
        };
        if opaque {
            self.remove_untouched_children(&parent, &state.touched, display)
        } else {
            self.remove_any(&parent, OsStr::from_bytes(hidden), display)
        }
    }

    /// Records that the host file `name` in `dir` lacks what the guest must see (setuid
    /// bits, capabilities, a device node).
    fn keep_special(
        &mut self,
        dir: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        device: Option<(NodeKind, u32, u32)>,
        display: &str,
    ) -> Result<(), ImageError> {
        let path = dir.child(name);
        let ino = dir
            .fd
            .stat(name)
            .map_err(sys_err)?
            .ok_or_else(|| ImageError::Io(format!("{} vanished", path.display())))?
            .ino;
        let fixup = Fixup {
            path: self.image_path(&path, display)?,
            device,
            mode: meta.mode,
            uid: meta.uid,
            gid: meta.gid,
            mtime: meta.mtime.0,
            capability: meta.capability.clone(),
        };
        self.specials.insert(path, Special { ino, fixup });
        Ok(())
    }

    /// The image path of a host path under the root, as the ext4 fixups spell it. Names
    /// they cannot express safely (quotes, control bytes, non-ASCII) are refused: such
    /// files are never setuid or devices in a genuine image.
    fn image_path(&self, path: &Path, display: &str) -> Result<String, ImageError> {
        let rel = path.strip_prefix(&self.root).unwrap_or(path);
        let bytes = rel.as_os_str().as_bytes();
        if bytes
            .iter()
            .any(|b| !(0x20..0x7f).contains(b) || *b == b'"' || *b == b'\\')
        {
            return Err(ImageError::BadImage(format!(
                "entry {display:?} is a setuid file, capability file or device node whose \
                 name has quotes, control or non-ASCII bytes"
            )));
        }
        Ok(format!("/{}", String::from_utf8_lossy(bytes)))
    }

    /// Resolves `components` (directories) inside the root, following symlinks the way
    /// the guest would see them: absolute targets restart at the root, and climbing above
    /// the root is refused. Each step opens one directory relative to the previous one
    /// with `O_NOFOLLOW`; a symlink is read and its target walked the same way, never
    /// handed to the kernel. With `create`, missing directories are made (0755, root);
    /// without, a missing one yields `None`.
    fn resolve(
        &mut self,
        components: &[OsString],
        create: bool,
        display: &str,
    ) -> Result<Option<Dir>, ImageError> {
        let escape = || ImageError::BadImage(format!("entry {display:?} escapes the root"));
        // The directories walked so far below the root, and their names.
        let mut walked: Vec<(OsString, DirFd)> = Vec::new();
        let mut pending: Vec<OsString> = components.iter().rev().cloned().collect();
        let mut followed = 0;
        while let Some(c) = pending.pop() {
            if c == ".." {
                walked.pop().ok_or_else(escape)?;
                continue;
            }
            if c.is_empty() || c == "." {
                continue;
            }
            let at = walked.last().map_or(&self.root_fd, |(_, d)| d);
            let shown = || {
                let mut p: PathBuf = walked.iter().map(|(n, _)| n.as_os_str()).collect();
                p.push(&c);
                p
            };
            match at.stat(&c).map_err(sys_err)? {
                Some(st) if st.kind == FileKind::Dir => {
                    let dir = at.open_dir(&c).map_err(|e| {
                        ImageError::BadImage(format!(
                            "entry {display:?}: {} changed while it was unpacked ({e})",
                            shown().display()
                        ))
                    })?;
                    walked.push((c, dir));
                }
                Some(st) if st.kind == FileKind::Symlink => {
                    followed += 1;
                    if followed > MAX_SYMLINKS {
                        return Err(ImageError::BadImage(format!(
                            "entry {display:?}: too many levels of symlinks"
                        )));
                    }
                    let target = at.read_link(&c).map_err(sys_err)?;
                    let bytes = target.as_bytes();
                    if bytes.starts_with(b"/") {
                        walked.clear();
                    }
                    for part in bytes.split(|b| *b == b'/').rev() {
                        pending.push(OsStr::from_bytes(part).to_os_string());
                    }
                }
                Some(_) => {
                    if !create {
                        return Ok(None);
                    }
                    return Err(ImageError::BadImage(format!(
                        "entry {display:?}: {} is not a directory",
                        shown().display()
                    )));
                }
                None => {
                    if !create {
                        return Ok(None);
                    }
                    self.charge(display, BLOCK, 1)?;
                    let at = walked.last().map_or(&self.root_fd, |(_, d)| d);
                    mkdir(at, &c)?;
                    let dir = at.open_dir(&c).map_err(sys_err)?;
                    walked.push((c, dir));
                }
            }
        }
        let mut path = self.root.clone();
        path.extend(walked.iter().map(|(n, _)| n));
        let fd = match walked.pop() {
            Some((_, d)) => d,
            None => DirFd::open(&self.root).map_err(sys_err)?,
        };
        Ok(Some(Dir { fd, path }))
    }

    fn apply_meta(
        &mut self,
        dir: &Dir,
        name: &OsStr,
        meta: &EntryMeta,
        is_dir: bool,
        display: &str,
    ) -> Result<(), ImageError> {
        dir.fd.chown(name, meta.uid, meta.gid).map_err(sys_err)?;
        let path = if name == "." {
            dir.path.clone()
        } else {
            dir.child(name)
        };
        if !meta.is_symlink {
            // setuid/setgid on a host file would let a local user gain the owner's rights;
            // the guest gets them from the ext4 fixup. On directories they only steer
            // group inheritance.
            let privileged = !is_dir && (meta.mode & 0o6000 != 0 || meta.capability.is_some());
            let host_mode = if is_dir {
                meta.mode
            } else {
                meta.mode & !0o6000
            };
            if privileged && !self.specials.contains_key(&path) {
                self.keep_special(dir, name, meta, None, display)?;
            }
            // After chown, which clears setuid/setgid.
            dir.fd.chmod(name, host_mode).map_err(sys_err)?;
        }
        for (xattr, value) in &meta.xattrs {
            match dir.fd.set_xattr(name, xattr, value) {
                Ok(()) => {}
                // The staging file system may not take every namespace; mkfs copies what
                // is there, and images rarely depend on xattrs.
                Err(e) if matches!(e.errno(), Some(libc::ENOTSUP) | Some(libc::EPERM)) => {
                    log::warn!(
                        "op=unpack xattr={xattr} path={} skipped: {e}",
                        path.display()
                    );
                }
                Err(e) => return Err(sys_err(e)),
            }
        }
        if is_dir {
            self.dir_times.insert(path, meta.mtime);
        } else {
            dir.fd
                .set_times(name, meta.mtime.0, meta.mtime.1)
                .map_err(sys_err)?;
        }
        Ok(())
    }

    /// Removes whatever is at `name` in `dir` (a directory recursively), never following
    /// a symlink: every step is relative to an open directory. What it held is given back
    /// to the budget, and setuid/device records under it are dropped.
    fn remove_any(&mut self, dir: &Dir, name: &OsStr, display: &str) -> Result<(), ImageError> {
        if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
            return Err(ImageError::BadImage(format!(
                "entry {display:?}: refusing to remove {:?}, not an entry of the image",
                name
            )));
        }
        let path = dir.child(name);
        let Some(st) = dir.fd.stat(name).map_err(sys_err)? else {
            return Ok(());
        };
        if st.kind == FileKind::Dir {
            let child = Dir {
                fd: dir.fd.open_dir(name).map_err(sys_err)?,
                path: path.clone(),
            };
            for entry in child.fd.entries().map_err(sys_err)? {
                self.remove_any(&child, &entry, display)?;
            }
            dir.fd.remove(name, true).map_err(sys_err)?;
            self.refund(BLOCK, 1);
            self.dir_times.remove(&path);
        } else {
            dir.fd.remove(name, false).map_err(sys_err)?;
            if st.nlink <= 1 {
                let bytes = (st.blocks * 512).min(st.size.div_ceil(BLOCK) * BLOCK);
                self.refund(bytes, 1);
            }
        }
        self.specials.remove(&path);
        Ok(())
    }

    fn refund(&mut self, bytes: u64, inodes: u64) {
        self.used_bytes = self.used_bytes.saturating_sub(bytes);
        self.used_inodes = self.used_inodes.saturating_sub(inodes);
    }

    /// Opaque directory: everything below `dir` that this layer did not itself create
    /// goes.
    fn remove_untouched_children(
        &mut self,
        dir: &Dir,
        touched: &HashSet<PathBuf>,
        display: &str,
    ) -> Result<(), ImageError> {
        for name in dir.fd.entries().map_err(sys_err)? {
            let path = dir.child(&name);
            if !touched.contains(&path) {
                self.remove_any(dir, &name, display)?;
            } else if dir
                .fd
                .stat(&name)
                .map_err(sys_err)?
                .is_some_and(|st| st.kind == FileKind::Dir)
            {
                let child = Dir {
                    fd: dir.fd.open_dir(&name).map_err(sys_err)?,
                    path,
                };
                self.remove_untouched_children(&child, touched, display)?;
            }
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
    /// `security.capability`, kept off the host file.
    capability: Option<Vec<u8>>,
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
            capability: None,
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
                            if name == CAPABILITY_XATTR {
                                meta.capability = Some(value.to_vec());
                            } else if !name.starts_with("trusted.overlay.") {
                                // overlayfs bookkeeping from the build host means nothing
                                // here.
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

/// Creates the directory `name` in `dir`, mode 0755 whatever the umask.
fn mkdir(dir: &DirFd, name: &OsStr) -> Result<(), ImageError> {
    dir.mkdir(name, 0o755).map_err(sys_err)?;
    dir.chmod(name, 0o755).map_err(sys_err)
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
    use crate::sys::files;
    use std::fs;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};

    fn is_root() -> bool {
        files::effective_uid() == 0
    }

    /// Root-only tests fail with a reason instead of passing without running.
    fn require_root() {
        assert!(
            is_root(),
            "needs root (chown, device nodes, mounts): run the suite with sudo"
        );
    }

    /// Applies `layers` to `<tmp>/root`; returns the temp dir and the result.
    fn apply(name: &str, layers: Vec<LayerBuilder>) -> (TempDir, PathBuf, Result<(), ImageError>) {
        let (t, root, result) = apply_within(name, layers, Budget::for_disk(1024));
        (t, root, result.map(drop))
    }

    /// [`apply`] with a budget, returning the fixups.
    fn apply_within(
        name: &str,
        layers: Vec<LayerBuilder>,
        budget: Budget,
    ) -> (TempDir, PathBuf, Result<Vec<Fixup>, ImageError>) {
        let t = TempDir::new(name);
        let root = t.path().join("root");
        fs::create_dir(&root).unwrap();
        let mut u = Unpacker::new(&root, budget).unwrap();
        let mut result = Ok(());
        for (i, layer) in layers.into_iter().enumerate() {
            let tar = layer.finish();
            result = u.apply_layer(tar.as_slice(), &format!("layer {i}"));
            if result.is_err() {
                break;
            }
        }
        let result = result.and_then(|()| u.finish());
        (t, root, result)
    }

    /// Every setuid/setgid file or device node under `dir` (the host must have none).
    fn privileged_files(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                let md = fs::symlink_metadata(e.path()).unwrap();
                let ft = md.file_type();
                if ft.is_dir() {
                    stack.push(e.path());
                } else if ft.is_char_device()
                    || ft.is_block_device()
                    || (ft.is_file() && md.mode() & 0o6000 != 0)
                {
                    out.push(e.path());
                }
            }
        }
        out
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
        require_root();
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
        require_root();
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
        require_root();
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
        require_root();
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
        require_root();
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
        require_root();
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
    fn device_nodes_and_setuid_bits_stay_off_the_host_and_become_fixups() {
        require_root();
        let mut l = LayerBuilder::new();
        l.dir("dev", 0o755)
            .char_device("dev/null", 0o666, 1, 3)
            .dir("bin", 0o755)
            .file_owned("bin/su", 0o4755, 0, 0, b"su")
            .file_owned("bin/wall", 0o2755, 0, 5, b"wall")
            .hardlink("bin/su2", "bin/su");
        let mut h = raw_header(tar::EntryType::Block);
        h.set_mode(0o660);
        h.set_device_major(8).unwrap();
        h.set_device_minor(1).unwrap();
        l.raw(h, "dev/sda1", &[]);
        let mut h = raw_header(tar::EntryType::Fifo);
        h.set_mode(0o600);
        l.raw(h, "dev/fifo", &[]);
        // A later layer replaces one device: it must not be fixed up any more.
        let mut l2 = LayerBuilder::new();
        l2.file("dev/sda1", 0o644, b"now a file");
        let (_t, root, r) = apply_within("devices", vec![l, l2], Budget::for_disk(64));
        let mut fixups = r.unwrap();
        fixups.sort_by(|a, b| a.path.cmp(&b.path));
        assert!(
            privileged_files(&root).is_empty(),
            "{:?}",
            privileged_files(&root)
        );
        let null = fs::symlink_metadata(root.join("dev/null")).unwrap();
        assert!(
            null.is_file() && null.len() == 0,
            "placeholder is a plain empty file"
        );
        assert_eq!(null.mode() & 0o7777, 0o666);
        assert_eq!(
            fs::symlink_metadata(root.join("bin/su")).unwrap().mode() & 0o7777,
            0o755
        );
        assert!(fs::symlink_metadata(root.join("dev/fifo"))
            .unwrap()
            .file_type()
            .is_fifo());
        let paths: Vec<&str> = fixups.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, vec!["/bin/su", "/bin/su2", "/bin/wall", "/dev/null"]);
        assert_eq!(fixups[0].mode, 0o4755);
        assert_eq!(fixups[0].device, None);
        assert_eq!((fixups[2].mode, fixups[2].gid), (0o2755, 5));
        assert_eq!(fixups[3].device, Some((NodeKind::Char, 1, 3)));
        assert_eq!(fixups[3].mode, 0o666);
    }

    #[test]
    fn whiteouts_naming_dot_or_dotdot_are_refused_and_touch_nothing() {
        require_root();
        for name in [".wh...", ".wh..", ".wh."] {
            let t = TempDir::new("wh-dots");
            // A sibling staging tree that `<root>/..` would have reached.
            let sibling = t.path().join("other-build");
            fs::create_dir(&sibling).unwrap();
            fs::write(sibling.join("keep"), b"x").unwrap();
            let root = t.path().join("root");
            fs::create_dir(&root).unwrap();
            fs::write(root.join("kept"), b"k").unwrap();
            let mut l = LayerBuilder::new();
            l.raw(raw_header(tar::EntryType::Regular), name, &[]);
            let mut u = Unpacker::new(&root, Budget::for_disk(64)).unwrap();
            let r = u.apply_layer(l.finish().as_slice(), "layer 0");
            assert!(
                matches!(&r, Err(ImageError::BadImage(m)) if m.contains(name) && m.contains("whiteout")),
                "{name}: {r:?}"
            );
            assert!(
                sibling.join("keep").exists(),
                "{name} removed outside the root"
            );
            assert!(
                root.join("kept").exists(),
                "{name} removed the root's contents"
            );
        }
        // A whiteout under a symlink that climbs out is refused; one under an absolute
        // symlink removes the file inside the image, not on the host.
        let outside = TempDir::new("wh-outside");
        fs::write(outside.path().join("victim"), b"host").unwrap();
        let mut l1 = LayerBuilder::new();
        l1.symlink("up", "../../../../../../..")
            .symlink("abs", &outside.path().display().to_string());
        let mut l2 = LayerBuilder::new();
        l2.whiteout("up/victim");
        let (_t, _root, r) = apply("wh-escape", vec![l1, l2]);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("escapes")),
            "{r:?}"
        );
        let mut l1 = LayerBuilder::new();
        l1.symlink("abs", &outside.path().display().to_string());
        let mut l2 = LayerBuilder::new();
        l2.whiteout("abs/victim");
        let (_t, _root, r) = apply("wh-abs", vec![l1, l2]);
        r.unwrap();
        assert_eq!(fs::read(outside.path().join("victim")).unwrap(), b"host");
    }

    #[test]
    fn budget_stops_a_layer_that_expands_past_the_disk() {
        require_root();
        // 2 MiB of zeros compress to almost nothing but are 2 MiB unpacked.
        let mut l = LayerBuilder::new();
        l.file("small", 0o644, b"ok")
            .file("big", 0o644, &vec![0u8; 2 << 20]);
        let budget = Budget {
            bytes: 1 << 20,
            inodes: 1000,
            disk_mb: 1,
        };
        let (_t, root, r) = apply_within("budget-bytes", vec![l], budget);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("\"big\"") && m.contains("1 MiB")),
            "{r:?}"
        );
        assert!(!root.join("big").exists());
        // Too many files.
        let mut l = LayerBuilder::new();
        for i in 0..50 {
            l.file(&format!("f{i}"), 0o644, b"");
        }
        let budget = Budget {
            bytes: 1 << 30,
            inodes: 20,
            disk_mb: 1024,
        };
        let (_t, _root, r) = apply_within("budget-inodes", vec![l], budget);
        assert!(
            matches!(&r, Err(ImageError::BadImage(m)) if m.contains("\"f19\"") || m.contains("\"f20\"")),
            "{r:?}"
        );
        // Removed files give their room back: a layer may replace a big file.
        let mut l1 = LayerBuilder::new();
        l1.file("big", 0o644, &vec![1u8; 600 << 10]);
        let mut l2 = LayerBuilder::new();
        l2.whiteout("big")
            .file("big2", 0o644, &vec![1u8; 600 << 10]);
        let budget = Budget {
            bytes: 1 << 20,
            inodes: 100,
            disk_mb: 1,
        };
        let (_t, _root, r) = apply_within("budget-refund", vec![l1, l2], budget);
        r.unwrap();
    }

    #[test]
    fn gnu_sparse_files_stay_sparse() {
        require_root();
        let real_size: u64 = 64 << 30;
        let mut l = LayerBuilder::new();
        l.sparse(
            "holes",
            real_size,
            &[(0, b"head"), (real_size - 4, b"tail")],
        );
        let (_t, root, r) = apply_within("sparse", vec![l], Budget::for_disk(64));
        r.unwrap();
        let md = fs::metadata(root.join("holes")).unwrap();
        assert_eq!(md.len(), real_size);
        assert!(
            md.blocks() * 512 <= 64 << 10,
            "{} blocks allocated",
            md.blocks()
        );
        let mut f = fs::File::open(root.join("holes")).unwrap();
        let mut head = [0u8; 4];
        f.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"head");
    }

    #[test]
    fn file_and_directory_replace_each_other() {
        require_root();
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
    fn ownership_and_mtime_are_kept_and_setuid_is_a_fixup() {
        require_root();
        let mut l = LayerBuilder::new();
        l.dir("bin", 0o755)
            .file_owned("bin/su", 0o4755, 1000, 2000, b"su")
            .symlink("bin/link", "su");
        let (_t, root, r) = apply_within("owner", vec![l], Budget::for_disk(64));
        let fixups = r.unwrap();
        let md = fs::symlink_metadata(root.join("bin/su")).unwrap();
        assert_eq!((md.uid(), md.gid()), (1000, 2000));
        // setuid only in the ext4 (see the fixup), never on the host.
        assert_eq!(md.mode() & 0o7777, 0o755);
        assert_eq!(fixups.len(), 1);
        assert_eq!(
            (fixups[0].mode, fixups[0].uid, fixups[0].gid),
            (0o4755, 1000, 2000)
        );
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

    #[test]
    fn a_symlink_swapped_into_the_tree_is_never_followed_out_of_it() {
        assert!(is_root(), "needs root (chown): run the suite with sudo");
        let t = TempDir::new("swap");
        let outside = t.path().join("outside");
        fs::create_dir_all(outside.join("sub")).unwrap();
        fs::write(outside.join("victim"), b"host").unwrap();
        let sub_mtime = || fs::metadata(outside.join("sub")).unwrap().mtime();
        let before = sub_mtime();
        let root = t.path().join("root");
        fs::create_dir(&root).unwrap();
        let mut u = Unpacker::new(&root, Budget::for_disk(64)).unwrap();
        let mut l1 = LayerBuilder::new();
        l1.dir("d", 0o755)
            .dir("d/sub", 0o755)
            .file("d/victim", 0o644, b"image");
        u.apply_layer(l1.finish().as_slice(), "layer 0").unwrap();
        // Someone swaps `d` for a symlink to a host directory while the unpacker runs.
        fs::remove_dir_all(root.join("d")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("d")).unwrap();
        let mut l2 = LayerBuilder::new();
        l2.file("d/new", 0o644, b"x").whiteout("d/victim");
        u.apply_layer(l2.finish().as_slice(), "layer 1").unwrap();
        u.finish().unwrap();
        // The host directory is untouched: no file written or removed, no time set on
        // the directory `d/sub` once was.
        assert_eq!(fs::read(outside.join("victim")).unwrap(), b"host");
        assert!(!outside.join("new").exists());
        assert_eq!(sub_mtime(), before);
        // The absolute link resolved inside the image, where the guest finds the file.
        let inner = root.join(outside.strip_prefix("/").unwrap());
        assert_eq!(fs::read(inner.join("new")).unwrap(), b"x");

        // A swapped-in link that climbs out is a bad image naming the entry.
        fs::remove_file(root.join("d")).unwrap();
        std::os::unix::fs::symlink("../../../../../../../../..", root.join("d")).unwrap();
        let mut u = Unpacker::new(&root, Budget::for_disk(64)).unwrap();
        let mut l3 = LayerBuilder::new();
        l3.file("d/escaped", 0o644, b"x").whiteout("d/victim");
        let r = u.apply_layer(l3.finish().as_slice(), "layer 2");
        assert!(
            matches!(&r, Err(ImageError::BadImage(m))
                if m.contains("layer 2") && m.contains("\"d/escaped\" escapes the root")),
            "{r:?}"
        );
        assert_eq!(fs::read(outside.join("victim")).unwrap(), b"host");
        assert!(!t.path().join("escaped").exists());
    }
}
