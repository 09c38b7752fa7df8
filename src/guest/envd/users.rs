//! Users and paths: which account a call runs as, and how its paths resolve.
//!
//! The SDK picks a user with `Authorization: Basic base64("<name>:")` (no password). The
//! account comes from the image's `/etc/passwd` (read on each call; images are static
//! binaries' business, no NSS). Rules, in order:
//! - a name in `/etc/passwd` is that account;
//! - `user`, E2B's default account, falls back to `root` where it does not exist (in a VM
//!   it always does: the agent adds it at boot, `guest::provision`; the agent serving envd
//!   on a host for tests may find none);
//! - any other unknown name is `unauthenticated`, as envd answers.
//!
//! Relative paths and an empty working directory resolve against the account's home;
//! `~` and `~/x` expand to it.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

use base64::Engine;

use crate::protocol::connect::{Code, RpcError};

/// E2B's default account name.
pub const DEFAULT_USER: &str = "user";

/// One account from `/etc/passwd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

impl User {
    fn root() -> User {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: PathBuf::from("/root"),
        }
    }
}

/// The account database of the filesystem the agent serves (the guest's `/etc`).
#[derive(Debug, Clone)]
pub struct Accounts {
    pub passwd: PathBuf,
    pub group: PathBuf,
}

impl Default for Accounts {
    fn default() -> Accounts {
        Accounts {
            passwd: PathBuf::from("/etc/passwd"),
            group: PathBuf::from("/etc/group"),
        }
    }
}

fn parse_passwd_line(line: &str) -> Option<User> {
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 7 || f[0].is_empty() {
        return None;
    }
    Some(User {
        name: f[0].to_string(),
        uid: f[2].parse().ok()?,
        gid: f[3].parse().ok()?,
        home: PathBuf::from(if f[5].is_empty() { "/" } else { f[5] }),
    })
}

impl Accounts {
    fn passwd_users(&self) -> Vec<User> {
        std::fs::read_to_string(&self.passwd)
            .unwrap_or_default()
            .lines()
            .filter_map(parse_passwd_line)
            .collect()
    }

    /// The account `name` (see the module rules).
    pub fn lookup(&self, name: &str) -> Result<User, RpcError> {
        let users = self.passwd_users();
        if let Some(u) = users.iter().find(|u| u.name == name) {
            return Ok(u.clone());
        }
        match name {
            DEFAULT_USER | "root" => Ok(users
                .into_iter()
                .find(|u| u.uid == 0)
                .unwrap_or_else(User::root)),
            _ => Err(RpcError::new(
                Code::Unauthenticated,
                format!(
                    "invalid username: '{name}' (no such account in the sandbox's /etc/passwd)"
                ),
            )),
        }
    }

    /// The supplementary groups of `user`: those of `/etc/group` that list its name.
    pub fn groups_of(&self, user: &User) -> Vec<u32> {
        let mut groups: Vec<u32> = std::fs::read_to_string(&self.group)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                let members = f.get(3)?;
                members
                    .split(',')
                    .any(|m| m.trim() == user.name)
                    .then(|| f.get(2)?.parse().ok())?
            })
            .collect();
        groups.push(user.gid);
        groups.sort_unstable();
        groups.dedup();
        groups
    }

    /// uid → name and gid → name, for listing owners.
    pub fn names(&self) -> OwnerNames {
        let users = self
            .passwd_users()
            .into_iter()
            .map(|u| (u.uid, u.name))
            .collect();
        let groups = std::fs::read_to_string(&self.group)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(':').collect();
                Some((f.get(2)?.parse().ok()?, f.first()?.to_string()))
            })
            .collect();
        OwnerNames { users, groups }
    }
}

/// Owner and group names of files.
#[derive(Debug, Default)]
pub struct OwnerNames {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl OwnerNames {
    pub fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    pub fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

/// The user name of an `Authorization: Basic base64("name:")` header, if there is one.
pub fn basic_auth_user(header: Option<&str>) -> Result<Option<String>, RpcError> {
    let Some(value) = header else {
        return Ok(None);
    };
    let Some(encoded) = value.trim().strip_prefix("Basic ") else {
        return Ok(None);
    };
    let bad = || {
        RpcError::new(
            Code::Unauthenticated,
            "malformed Basic authorization header",
        )
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(decoded).map_err(|_| bad())?;
    let name = text.split(':').next().unwrap_or_default();
    Ok((!name.is_empty()).then(|| name.to_string()))
}

/// Removes `.` and resolves `..` lexically, as Go's `filepath.Clean` does.
pub fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Resolves a path from a request: empty → `default_dir` or the home, `~` → the home,
/// relative → under the home. The result is absolute and clean.
pub fn resolve(path: &str, user: &User, default_dir: Option<&str>) -> Result<PathBuf, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::invalid("path contains a NUL byte"));
    }
    let path = match (path, default_dir) {
        ("", Some(d)) => d,
        (p, _) => p,
    };
    let expanded = if path == "~" {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix("~/") {
        user.home.join(rest)
    } else if path.starts_with('~') {
        return Err(RpcError::invalid(format!(
            "cannot expand {path:?}: only the caller's own home (~) is supported"
        )));
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    Ok(clean(&expanded))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accounts(dir: &Path, passwd: &str) -> Accounts {
        std::fs::write(dir.join("passwd"), passwd).unwrap();
        std::fs::write(
            dir.join("group"),
            "root:x:0:\nuser:x:1000:\nsudo:x:27:bob,user\nusers:x:100:bob\n",
        )
        .unwrap();
        Accounts {
            passwd: dir.join("passwd"),
            group: dir.join("group"),
        }
    }

    #[test]
    fn user_falls_back_to_root_and_unknown_names_are_refused() {
        let dir = std::env::temp_dir().join(format!("envd-users-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let only_root = accounts(&dir, "root:x:0:0:root:/root:/bin/sh\n");
        assert_eq!(only_root.lookup("user").unwrap().uid, 0);
        assert_eq!(
            only_root.lookup("nobody2").unwrap_err().code,
            Code::Unauthenticated
        );
        let with_user = accounts(
            &dir,
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n",
        );
        let u = with_user.lookup("user").unwrap();
        assert_eq!(
            (u.uid, u.gid, u.home.as_path()),
            (1000, 1000, Path::new("/home/user"))
        );
        assert_eq!(with_user.groups_of(&u), vec![27, 1000]);
        let names = with_user.names();
        assert_eq!(
            (names.user(1000), names.group(0), names.user(7)),
            ("user".into(), "root".into(), "7".into())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn basic_auth_names_the_user() {
        let h = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode("root:")
        );
        assert_eq!(basic_auth_user(Some(&h)).unwrap().as_deref(), Some("root"));
        assert_eq!(basic_auth_user(None).unwrap(), None);
        assert_eq!(basic_auth_user(Some("Bearer x")).unwrap(), None);
        assert!(basic_auth_user(Some("Basic !!")).is_err());
    }

    #[test]
    fn paths_resolve_against_home() {
        let u = User {
            name: "user".into(),
            uid: 1000,
            gid: 1000,
            home: PathBuf::from("/home/user"),
        };
        let r = |p: &str, d: Option<&str>| resolve(p, &u, d).unwrap();
        assert_eq!(r("", None), Path::new("/home/user"));
        assert_eq!(r("", Some("/work")), Path::new("/work"));
        assert_eq!(r("a/../b.txt", None), Path::new("/home/user/b.txt"));
        assert_eq!(r("~/x", None), Path::new("/home/user/x"));
        assert_eq!(r("/../etc/./passwd", None), Path::new("/etc/passwd"));
        assert!(resolve("~bob/x", &u, None).is_err());
    }
}
