//! What every guest gets at boot, before envd serves and before a build's first step, so
//! that any image (the built-in busybox one, Debian, Ubuntu, python:3.12, ...) works as
//! E2B's templates do:
//! - the account `user` (uid 1000, or the first free uid above it; home `/home/user`
//!   seeded from `/etc/skel`; passwordless sudo through `/etc/sudoers.d`) when the image
//!   lacks it: `/etc/passwd`, `/etc/group`, and `/etc/shadow`/`/etc/gshadow` where the
//!   image has them;
//! - the hostname in `/etc/hosts` and `/etc/hostname`, so that `sudo` (which resolves
//!   its own host name) answers at once instead of after a DNS timeout;
//! - a world-writable sticky `/tmp`.
//!
//! Each part is idempotent (a template's sandboxes resume from the build VM, which did it
//! once; a restarted VM finds everything in place) and runs in the guest, as PID 1, on
//! the guest's own files: nothing of the image is touched on the host. Paths are taken
//! under `root` so the unit tests run on a scratch tree.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// E2B's default account.
pub const USER: &str = "user";
/// Its uid (and gid) when free.
const USER_ID: u32 = 1000;
/// The sudoers rule file (a name sudo reads: no `.` and no trailing `~`).
const SUDOERS_FILE: &str = "etc/sudoers.d/agentenv-user";
/// Largest account file read (passwd, group) and skeleton file copied.
const MAX_FILE: u64 = 4 << 20;
/// Most `/etc/skel` entries copied into a new home.
const MAX_SKEL_ENTRIES: usize = 64;

/// Runs every part under `root` (`/` in the guest); returns what failed, one line each.
pub fn provision(root: &Path, hostname: &str) -> Vec<String> {
    let parts: [(&str, &dyn Fn() -> io::Result<()>); 3] = [
        ("the account user", &|| ensure_user(root)),
        ("/etc/hosts and /etc/hostname", &|| {
            ensure_hosts(root, hostname)
        }),
        ("/tmp", &|| ensure_tmp(root)),
    ];
    parts
        .into_iter()
        .filter_map(|(what, run)| run().err().map(|e| format!("setting up {what}: {e}")))
        .collect()
}

fn read_small(path: &Path) -> io::Result<String> {
    match fs::metadata(path) {
        Ok(m) if m.len() > MAX_FILE => Err(io::Error::other(format!(
            "{} is larger than {MAX_FILE} bytes",
            path.display()
        ))),
        Ok(_) => fs::read_to_string(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(e),
    }
}

/// Appends `line` to `path` (created with `mode` when missing), on a line of its own.
fn append_line(path: &Path, existing: &str, line: &str, mode: u32) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(mode)
        .open(path)?;
    let sep = if existing.is_empty() || existing.ends_with('\n') {
        ""
    } else {
        "\n"
    };
    f.write_all(format!("{sep}{line}\n").as_bytes())
}

/// Ids in the third field of a passwd or group file.
fn ids(text: &str) -> Vec<u32> {
    text.lines()
        .filter_map(|l| l.split(':').nth(2)?.parse().ok())
        .collect()
}

fn named<'a>(text: &'a str, name: &str) -> Option<Vec<&'a str>> {
    text.lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.first() == Some(&name))
}

/// `want` when no id in `taken` has it, else the first free one above it.
fn free_id(taken: &[u32], want: u32) -> u32 {
    (want..u32::MAX - 1)
        .find(|id| !taken.contains(id))
        .unwrap_or(want)
}

fn ensure_user(root: &Path) -> io::Result<()> {
    let etc = root.join("etc");
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&etc)?;
    let passwd = read_small(&etc.join("passwd"))?;
    let (uid, gid, home) = match named(&passwd, USER) {
        Some(f) if f.len() >= 7 => (
            f[2].parse().unwrap_or(USER_ID),
            f[3].parse().unwrap_or(USER_ID),
            f[5].to_string(),
        ),
        _ => add_account(root, &passwd)?,
    };
    if home.starts_with('/') && home != "/" {
        ensure_home(root, home.trim_start_matches('/'), uid, gid)?;
    }
    ensure_sudo(root)
}

/// Adds `user` to the account files; its uid, gid and home.
fn add_account(root: &Path, passwd: &str) -> io::Result<(u32, u32, String)> {
    let etc = root.join("etc");
    let group = read_small(&etc.join("group"))?;
    let uid = free_id(&ids(passwd), USER_ID);
    let gid = match named(&group, USER).and_then(|f| f.get(2)?.parse().ok()) {
        Some(gid) => gid,
        None => {
            let gid = free_id(&ids(&group), uid);
            append_line(
                &etc.join("group"),
                &group,
                &format!("{USER}:x:{gid}:"),
                0o644,
            )?;
            let gshadow = etc.join("gshadow");
            if gshadow.exists() {
                let text = read_small(&gshadow)?;
                append_line(&gshadow, &text, &format!("{USER}:!::"), 0o640)?;
            }
            gid
        }
    };
    let shell = if root.join("bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    };
    let home = format!("/home/{USER}");
    let line = format!("{USER}:x:{uid}:{gid}:{USER}:{home}:{shell}");
    append_line(&etc.join("passwd"), passwd, &line, 0o644)?;
    let shadow = etc.join("shadow");
    if shadow.exists() {
        // Locked password, no aging (a zero "last change" would force a change first).
        let text = read_small(&shadow)?;
        append_line(&shadow, &text, &format!("{USER}:!:::::::"), 0o640)?;
    }
    Ok((uid, gid, home))
}

/// Creates the home `rel` (under `root`) owned by the account, seeded from `/etc/skel`.
fn ensure_home(root: &Path, rel: &str, uid: u32, gid: u32) -> io::Result<()> {
    let home = root.join(rel);
    if home.exists() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&home)?;
    let skel = root.join("etc/skel");
    if let Ok(entries) = fs::read_dir(&skel) {
        for entry in entries.flatten().take(MAX_SKEL_ENTRIES) {
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() || meta.len() > MAX_FILE {
                continue;
            }
            let to = home.join(entry.file_name());
            fs::copy(entry.path(), &to)?;
            std::os::unix::fs::lchown(&to, Some(uid), Some(gid))?;
        }
    }
    std::os::unix::fs::lchown(&home, Some(uid), Some(gid))
}

/// Passwordless sudo for `user`, where the image has sudo.
fn ensure_sudo(root: &Path) -> io::Result<()> {
    let has_sudo = root.join("etc/sudoers").exists() || root.join("etc/sudoers.d").is_dir();
    let rule = root.join(SUDOERS_FILE);
    if !has_sudo || rule.exists() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o750)
        .create(root.join("etc/sudoers.d"))?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o440)
        .open(&rule)?;
    f.write_all(format!("{USER} ALL=(ALL:ALL) NOPASSWD: ALL\n").as_bytes())?;
    // The umask may have narrowed the mode; sudo wants exactly 0440.
    f.set_permissions(fs::Permissions::from_mode(0o440))
}

fn names_host(line: &str, name: &str) -> bool {
    let line = line.split('#').next().unwrap_or_default();
    line.split_whitespace().skip(1).any(|n| n == name)
}

fn ensure_hosts(root: &Path, hostname: &str) -> io::Result<()> {
    let path = root.join("etc/hosts");
    let hosts = read_small(&path)?;
    let mut added = String::new();
    if !hosts.lines().any(|l| names_host(l, "localhost")) {
        added.push_str("127.0.0.1\tlocalhost\n::1\tlocalhost\n");
    }
    if !hosts.lines().any(|l| names_host(l, hostname)) {
        added.push_str(&format!("127.0.1.1\t{hostname}\n"));
    }
    if !added.is_empty() {
        append_line(&path, &hosts, added.trim_end(), 0o644)?;
    }
    let hostname_file = root.join("etc/hostname");
    if read_small(&hostname_file)?.trim() != hostname {
        // A symlink (systemd images) is replaced, not followed.
        let _ = fs::remove_file(&hostname_file);
        fs::write(&hostname_file, format!("{hostname}\n"))?;
    }
    Ok(())
}

fn ensure_tmp(root: &Path) -> io::Result<()> {
    let tmp = root.join("tmp");
    match fs::symlink_metadata(&tmp) {
        Ok(m) if m.is_dir() => {
            if m.permissions().mode() & 0o7777 != 0o1777 {
                fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777))?;
            }
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(_) => {
            fs::create_dir(&tmp)?;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("provision-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("etc/skel")).unwrap();
        dir
    }

    #[test]
    fn a_debian_like_image_gets_user_sudo_and_hosts() {
        let root = scratch("debian");
        let etc = root.join("etc");
        fs::write(
            etc.join("passwd"),
            "root:x:0:0:root:/root:/bin/bash\nlp:x:1000:7::/:/bin/sh",
        )
        .unwrap();
        fs::write(etc.join("group"), "root:x:0:\nsudo:x:27:\n").unwrap();
        fs::write(etc.join("shadow"), "root:*:19000:0:99999:7:::\n").unwrap();
        fs::write(etc.join("sudoers"), "@includedir /etc/sudoers.d\n").unwrap();
        fs::write(etc.join("skel/.profile"), "# profile\n").unwrap();
        fs::write(etc.join("hosts"), "127.0.0.1 localhost\n").unwrap();
        assert!(provision(&root, "agentenv").is_empty());
        let passwd = fs::read_to_string(etc.join("passwd")).unwrap();
        // uid 1000 is taken: the next free one; the last line gained its newline.
        assert!(
            passwd.ends_with("/bin/sh\nuser:x:1001:1001:user:/home/user:/bin/sh\n"),
            "{passwd}"
        );
        assert!(fs::read_to_string(etc.join("group"))
            .unwrap()
            .ends_with("user:x:1001:\n"));
        assert!(fs::read_to_string(etc.join("shadow"))
            .unwrap()
            .ends_with("user:!:::::::\n"));
        let rule = root.join(SUDOERS_FILE);
        assert_eq!(
            fs::read_to_string(&rule).unwrap(),
            "user ALL=(ALL:ALL) NOPASSWD: ALL\n"
        );
        assert_eq!(fs::metadata(&rule).unwrap().mode() & 0o777, 0o440);
        let home = fs::metadata(root.join("home/user")).unwrap();
        assert_eq!((home.uid(), home.gid()), (1001, 1001));
        assert_eq!(
            fs::metadata(root.join("home/user/.profile")).unwrap().uid(),
            1001
        );
        let hosts = fs::read_to_string(etc.join("hosts")).unwrap();
        assert_eq!(hosts, "127.0.0.1 localhost\n127.0.1.1\tagentenv\n");
        assert_eq!(
            fs::read_to_string(etc.join("hostname")).unwrap(),
            "agentenv\n"
        );
        assert_eq!(
            fs::metadata(root.join("tmp")).unwrap().mode() & 0o7777,
            0o1777
        );
        // Again: nothing changes.
        assert!(provision(&root, "agentenv").is_empty());
        assert_eq!(fs::read_to_string(etc.join("passwd")).unwrap(), passwd);
        assert_eq!(fs::read_to_string(etc.join("hosts")).unwrap(), hosts);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_image_with_user_and_no_sudo_is_left_as_it_is() {
        let root = scratch("busybox");
        let etc = root.join("etc");
        let passwd = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n";
        fs::write(etc.join("passwd"), passwd).unwrap();
        fs::write(etc.join("group"), "root:x:0:\nuser:x:1000:\n").unwrap();
        assert!(provision(&root, "box").is_empty());
        assert_eq!(fs::read_to_string(etc.join("passwd")).unwrap(), passwd);
        assert!(!root.join(SUDOERS_FILE).exists());
        assert!(root.join("home/user").is_dir());
        let hosts = fs::read_to_string(etc.join("hosts")).unwrap();
        assert_eq!(
            hosts,
            "127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\tbox\n"
        );
        fs::remove_dir_all(&root).unwrap();
    }
}
