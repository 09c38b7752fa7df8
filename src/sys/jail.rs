//! A child process's view of the file system, cut down to what it needs, and the
//! unprivileged account it runs as.
//!
//! A [`Jail`] is planned in the parent (paths checked, C strings built) and entered in the
//! forked child between `fork` and `exec` ([`Jail::enter`], only system calls, no
//! allocation): a new mount namespace whose root is an empty tmpfs holding bind mounts of
//! the listed host paths at the same paths, read-only unless asked otherwise, the tmpfs
//! itself remounted read-only, then `pivot_root` into it with the old root detached.
//! Everything mounted lives only in the child's namespace and goes away with the child.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use super::{SysError, SysResult};

/// How a bind-mounted path may be used inside the jail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read-only, no setuid, no device nodes.
    ReadOnly,
    /// Writable, no setuid, no device nodes.
    ReadWrite,
    /// A device node (e.g. `/dev/null`, `/dev/kvm`): usable, no setuid, no exec.
    Device,
}

#[derive(Debug)]
enum Step {
    Dir(CString),
    File(CString),
    Symlink {
        target: CString,
        link: CString,
    },
    Bind {
        source: CString,
        target: CString,
        flags: libc::c_ulong,
    },
}

/// A planned mount namespace (see the module docs).
#[derive(Debug)]
pub struct Jail {
    root: CString,
    tmpfs_options: CString,
    steps: Vec<Step>,
    /// Directories already planned under the root (relative to it).
    dirs: BTreeSet<PathBuf>,
}

fn cstring(path: &Path) -> SysResult<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        SysError::from_errno(format!("path {} holds a NUL", path.display()), libc::EINVAL)
    })
}

/// `path` as a list of plain components; refuses relative paths and `..`.
fn plain_components(path: &Path) -> SysResult<Vec<&std::ffi::OsStr>> {
    let mut parts = Vec::new();
    for (i, c) in path.components().enumerate() {
        match c {
            Component::RootDir if i == 0 => {}
            Component::Normal(name) => parts.push(name),
            Component::CurDir => {}
            _ => {
                return Err(SysError::from_errno(
                    format!("jail path {} must be absolute without ..", path.display()),
                    libc::EINVAL,
                ))
            }
        }
    }
    if path.components().next() != Some(Component::RootDir) {
        return Err(SysError::from_errno(
            format!("jail path {} must be absolute", path.display()),
            libc::EINVAL,
        ));
    }
    Ok(parts)
}

impl Jail {
    /// A jail rooted at `root`: an existing, empty directory of the host that the child
    /// mounts its tmpfs on (the host never sees that mount).
    pub fn new(root: &Path) -> SysResult<Jail> {
        plain_components(root)?;
        Ok(Jail {
            root: cstring(root)?,
            tmpfs_options: CString::new("mode=0755,size=256k,nr_inodes=1024").expect("no NUL"),
            steps: Vec::new(),
            dirs: BTreeSet::new(),
        })
    }

    fn inside(&self, rel: &Path) -> PathBuf {
        Path::new(std::ffi::OsStr::from_bytes(self.root.as_bytes())).join(rel)
    }

    /// Plans the directories leading to `rel` (relative to the root), once each.
    fn plan_dirs(&mut self, rel: &Path) -> SysResult<()> {
        let mut at = PathBuf::new();
        for part in rel.components() {
            at.push(part);
            if self.dirs.insert(at.clone()) {
                let dir = cstring(&self.inside(&at))?;
                self.steps.push(Step::Dir(dir));
            }
        }
        Ok(())
    }

    /// Makes the host path `path` (absolute, no `..`) visible at the same path inside the
    /// jail: a directory or file is bind-mounted (with `access`), a symbolic link is
    /// recreated as the same link (bind what it points to separately). Missing paths are an
    /// error.
    pub fn bind(&mut self, path: &Path, access: Access) -> SysResult<()> {
        self.bind_as(path, path, access)
    }

    /// Like [`Jail::bind`], but at the path `target` inside the jail.
    pub fn bind_as(&mut self, path: &Path, target: &Path, access: Access) -> SysResult<()> {
        plain_components(path)?;
        let parts = plain_components(target)?;
        let Some((_, parents)) = parts.split_last() else {
            return Err(SysError::from_errno(
                "cannot bind / into a jail",
                libc::EINVAL,
            ));
        };
        let rel: PathBuf = parts.iter().collect();
        let parent_rel: PathBuf = parents.iter().collect();
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| SysError::from_io(format!("jail: stat {}", path.display()), e))?;
        self.plan_dirs(&parent_rel)?;
        let target = cstring(&self.inside(&rel))?;
        if meta.file_type().is_symlink() {
            let link = std::fs::read_link(path)
                .map_err(|e| SysError::from_io(format!("jail: readlink {}", path.display()), e))?;
            self.steps.push(Step::Symlink {
                target: cstring(&link)?,
                link: target,
            });
            return Ok(());
        }
        if meta.is_dir() {
            if !self.dirs.insert(rel.clone()) {
                return Err(SysError::from_errno(
                    format!(
                        "jail: {} is bound twice or under another bind",
                        path.display()
                    ),
                    libc::EEXIST,
                ));
            }
            self.steps.push(Step::Dir(target.clone()));
        } else {
            self.steps.push(Step::File(target.clone()));
        }
        let flags = match access {
            Access::ReadOnly => libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            Access::ReadWrite => libc::MS_NOSUID | libc::MS_NODEV,
            Access::Device => libc::MS_NOSUID | libc::MS_NOEXEC,
        };
        self.steps.push(Step::Bind {
            source: cstring(path)?,
            target,
            flags,
        });
        Ok(())
    }

    /// Binds `path` when it exists (e.g. `/lib64`, `/dev/kvm`); `Ok(false)` when it does not.
    pub fn bind_if_present(&mut self, path: &Path, access: Access) -> SysResult<bool> {
        if std::fs::symlink_metadata(path).is_err() {
            return Ok(false);
        }
        self.bind(path, access).map(|()| true)
    }

    /// Runs in the forked child: builds the namespace and pivots into it. Only system calls
    /// on data prepared by the parent; no allocation on the success path.
    pub(crate) fn enter(&self) -> io::Result<()> {
        // The server's umask (077) would make the jail's directories unreadable to the
        // account QEMU runs as; QEMU gets it back.
        let umask = super::fs::set_umask(0o022);
        let entered = self.build_and_pivot();
        super::fs::set_umask(umask);
        entered
    }

    fn build_and_pivot(&self) -> io::Result<()> {
        self.mount_root()?;
        for step in &self.steps {
            step.apply()?;
        }
        self.pivot()
    }

    /// A private mount namespace with an empty tmpfs at the jail's root.
    fn mount_root(&self) -> io::Result<()> {
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: (this and every block below, and in [`Step::apply`]) the calls take C
        // strings prepared by the parent, which outlive the call (they belong to `self`),
        // or null pointers where the kernel accepts them; they only change this
        // (single-threaded, forked) process's mounts, working directory and root.
        unsafe {
            ok(libc::unshare(libc::CLONE_NEWNS))?;
            // Nothing mounted from here on propagates back to the host's namespace.
            ok(libc::mount(
                null,
                c"/".as_ptr(),
                null,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            ok(libc::mount(
                c"tmpfs".as_ptr(),
                self.root.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                self.tmpfs_options.as_ptr().cast(),
            ))
        }
    }

    /// Makes the filled root read-only and the process's `/`.
    fn pivot(&self) -> io::Result<()> {
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: see [`Jail::mount_root`]. `pivot_root(".", ".")` stacks the old root on
        // the new one; detaching it leaves only the jail (pivot_root(2), NOTES).
        unsafe {
            ok(libc::mount(
                null,
                self.root.as_ptr(),
                null,
                libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_RDONLY
                    | libc::MS_NOSUID
                    | libc::MS_NODEV
                    | libc::MS_NOEXEC,
                std::ptr::null(),
            ))?;
            ok(libc::chdir(self.root.as_ptr()))?;
            ok(libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) as libc::c_int)?;
            ok(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            ok(libc::chdir(c"/".as_ptr()))
        }
    }
}

impl Step {
    /// Makes one entry of the jail (in the forked child: no allocation).
    fn apply(&self) -> io::Result<()> {
        let null = std::ptr::null::<libc::c_char>();
        match self {
            Step::Dir(dir) => {
                // SAFETY: see [`Jail::mount_root`].
                let ret = unsafe { libc::mkdir(dir.as_ptr(), 0o755) };
                if ret < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            }
            Step::File(file) => {
                // SAFETY: see [`Jail::mount_root`]; the new fd is closed right away.
                let fd = unsafe {
                    libc::open(
                        file.as_ptr(),
                        libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                        0o644,
                    )
                };
                ok(fd)?;
                // SAFETY: `fd` was just opened by this process.
                unsafe { libc::close(fd) };
                Ok(())
            }
            Step::Symlink { target, link } => {
                // SAFETY: see [`Jail::mount_root`].
                ok(unsafe { libc::symlink(target.as_ptr(), link.as_ptr()) })
            }
            Step::Bind {
                source,
                target,
                flags,
            } => {
                // SAFETY: see [`Jail::mount_root`].
                ok(unsafe {
                    libc::mount(
                        source.as_ptr(),
                        target.as_ptr(),
                        null,
                        libc::MS_BIND | libc::MS_REC,
                        std::ptr::null(),
                    )
                })?;
                // SAFETY: see [`Jail::mount_root`].
                ok(unsafe {
                    libc::mount(
                        null,
                        target.as_ptr(),
                        null,
                        libc::MS_BIND | libc::MS_REMOUNT | flags,
                        std::ptr::null(),
                    )
                })
            }
        }
    }
}

/// A libc return value as a result (the error is `errno`).
fn ok(ret: libc::c_int) -> io::Result<()> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// An unprivileged account a child switches to before exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// The one supplementary group kept (e.g. `/dev/kvm`'s); none by default.
    pub extra_group: Option<u32>,
}

impl Credentials {
    /// Looks up the account `name` (its uid and primary gid) in the user database.
    pub fn lookup(name: &str) -> SysResult<Credentials> {
        let cname = CString::new(name)
            .map_err(|_| SysError::from_errno(format!("user name {name:?}"), libc::EINVAL))?;
        let mut buf = vec![0 as libc::c_char; 16 * 1024];
        // SAFETY: an all-zero `passwd` is a valid value (null pointers, zero ids); it is
        // only read after getpwnam_r filled it.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the call; `buf` is large enough for one entry
        // (ERANGE otherwise, reported below).
        let ret = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        if ret != 0 {
            return Err(SysError::from_errno(format!("getpwnam {name}"), ret));
        }
        if result.is_null() {
            return Err(SysError::from_errno(
                format!("user {name} does not exist; run scripts/setup.sh to create it"),
                libc::ENOENT,
            ));
        }
        if pwd.pw_uid == 0 || pwd.pw_gid == 0 {
            return Err(SysError::from_errno(
                format!("user {name} is root or in group root; it must be unprivileged"),
                libc::EPERM,
            ));
        }
        Ok(Credentials {
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
            extra_group: None,
        })
    }

    /// Runs in the forked child: no supplementary groups (but `extra_group`), `gid`, `uid`
    /// (which drops every capability), and no new privileges through exec.
    pub(crate) fn assume(&self) -> io::Result<()> {
        let groups: [libc::gid_t; 1] = [self.extra_group.unwrap_or(0)];
        let count = usize::from(self.extra_group.is_some());
        // SAFETY: these calls take integers by value, setgroups a list of `count` (0 or 1)
        // valid entries; they change only this single-threaded child's credentials.
        unsafe {
            if libc::setgroups(count, groups.as_ptr()) < 0
                || libc::setgid(self.gid) < 0
                || libc::setuid(self.uid) < 0
                || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) < 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_dirs_once_and_refuses_bad_paths() {
        let mut jail = Jail::new(Path::new("/run/x")).unwrap();
        jail.bind(Path::new("/usr"), Access::ReadOnly).unwrap();
        jail.bind(Path::new("/dev/null"), Access::Device).unwrap();
        jail.bind(Path::new("/dev/zero"), Access::Device).unwrap();
        let dirs: Vec<_> = jail
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::Dir(d) => Some(d.to_str().unwrap().to_owned()),
                _ => None,
            })
            .collect();
        assert_eq!(dirs, ["/run/x/usr", "/run/x/dev"]);
        assert!(jail.bind(Path::new("/usr"), Access::ReadOnly).is_err());
        assert!(jail.bind(Path::new("relative"), Access::ReadOnly).is_err());
        assert!(jail
            .bind(Path::new("/usr/../etc"), Access::ReadOnly)
            .is_err());
        assert!(jail
            .bind(Path::new("/no/such/path"), Access::ReadOnly)
            .is_err());
        assert!(!jail
            .bind_if_present(Path::new("/no/such/path"), Access::ReadOnly)
            .unwrap());
        assert!(Jail::new(Path::new("rel")).is_err());
    }

    #[test]
    fn root_account_is_refused() {
        assert!(Credentials::lookup("root").is_err());
        let e = Credentials::lookup("no-such-user-agentenv").unwrap_err();
        assert!(e.to_string().contains("setup.sh"), "{e}");
    }
}
