//! E2B volumes end to end (issue 20 item 4; api.md §4.27–4.28, operations.md "Volumes"):
//! the python SDK against the real server: the volume API, the content API with its
//! refusals (bad and taken names, `..`, a symlink out of the volume, a wrong token), the
//! quota (507, the host's file never grows past it), a server restart (the volume is
//! unmounted at shutdown and mounted again, its files intact) and deletion, with nothing
//! left on the host (mounts, loop devices, directories); then one volume mounted in two
//! sandboxes at once (tests/sdk/volume_mounts.py: each sees the other's writes, quota as
//! ENOSPC in the guest, 409 on delete while mounted, a guest's mknod refused and its FIFO
//! refused by the content API, a snapshot holding the volume (409 naming it) and a sandbox
//! from it and a fork of that one with the volume mounted, pause and resume, bad mount paths),
//! with no NFS server left once they are gone; and the JS SDK's create, content calls and
//! `volumeMounts` (tests/sdk/volumes.mjs); then tests/sdk/volume_lifecycle.py: a
//! filesystem-only pause and resume of a sandbox whose image has no `mount` program (the
//! agent mounts with mount(2)) and a running sandbox's mount across a graceful restart.
//!
//! Needs root (loop mounts). Run under the host lock:
//! `flock /run/agentenv-host.lock cargo test --release --test e2e_volumes`.

mod common;

use common::sdk::{finish, run_sdk, sdk_command, sdk_tools};
use common::{build_template, host, Server};
use std::path::{Path, PathBuf};

/// Runs `tests/sdk/volumes.py <args>` against `s`; its `ok` lines.
fn volumes_py(s: &Server, python: &str, args: &[&str]) -> Vec<String> {
    sdk_script(s, python, "volumes.py", args)
}

fn sdk_script(s: &Server, python: &str, name: &str, args: &[&str]) -> Vec<String> {
    let script = format!("{}/tests/sdk/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = sdk_command(s, python, &script);
    cmd.args(args);
    finish(s, &script, cmd)
}

/// The id an `ok <what> <id>` line names.
fn id_from(lines: &[String], what: &str) -> String {
    let prefix = format!("ok {what} ");
    lines
        .iter()
        .find_map(|l| {
            l.split_once(": ")
                .and_then(|(_, l)| l.strip_prefix(&prefix))
        })
        .unwrap_or_else(|| panic!("no `{prefix}<id>` line in {lines:?}"))
        .to_string()
}

/// The mounts under `dir` (from /proc/self/mounts).
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(1).is_some_and(|m| m.starts_with(&dir)))
        .map(str::to_string)
        .collect()
}

/// Loop devices backed by a file under `dir`.
fn loops_under(dir: &Path) -> Vec<String> {
    let dir = dir.display().to_string();
    host("losetup", &["-a"])
        .lines()
        .filter(|l| l.contains(&dir))
        .map(str::to_string)
        .collect()
}

/// No mount and no loop device of a volume under `volumes` is left on the host.
fn assert_nothing_mounted(volumes: &Path) {
    assert!(
        mounts_under(volumes).is_empty(),
        "{:?}",
        mounts_under(volumes)
    );
    assert!(
        loops_under(volumes).is_empty(),
        "{:?}",
        loops_under(volumes)
    );
}

fn volume_dir(s: &Server, id: &str) -> PathBuf {
    s.state_dir.join("volumes").join(id)
}

/// A symlink planted in the volume (as a guest could) never leads the host out of it.
fn symlinks_stay_inside(s: &Server, id: &str) {
    let mnt = volume_dir(s, id).join("mnt");
    std::os::unix::fs::symlink("/etc", mnt.join("etc-link")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", mnt.join("host-file")).unwrap();
    for path in ["/etc-link/hostname", "/host-file"] {
        let (status, v) = s.call(
            "GET",
            &format!("/volumecontent/{id}/file?path={path}"),
            None,
        );
        assert_eq!(status, 400, "{path}: {v}");
        assert!(v["message"].as_str().unwrap().starts_with("path: "), "{v}");
    }
    let (status, v) = s.call(
        "PATCH",
        &format!("/volumecontent/{id}/path?path=/host-file"),
        Some(serde_json::json!({"mode": 511})),
    );
    assert_eq!(status, 400, "{v}");
    let (status, v) = s.call(
        "GET",
        &format!("/volumecontent/{id}/path?path=/host-file"),
        None,
    );
    assert_eq!((status, v["type"].as_str()), (200, Some("symlink")), "{v}");
    assert_eq!(v["target"], "/etc/hostname");
    let (status, _) = s.call(
        "DELETE",
        &format!("/volumecontent/{id}/path?path=/etc-link"),
        None,
    );
    assert_eq!(status, 204);
    assert!(
        Path::new("/etc/hostname").exists(),
        "a remove followed the symlink"
    );
    std::fs::remove_file(mnt.join("host-file")).unwrap();
}

/// One test, two servers in turn (servers cannot run side by side: each owns the host's
/// network slots).
#[test]
fn volumes_end_to_end() {
    let (python, js_module) = sdk_tools();
    content_quota_restart_and_delete(&python);
    mounted_in_two_sandboxes(&python, &js_module);
    across_pause_and_restart(&python);
}

/// tests/sdk/volume_lifecycle.py: a filesystem-only pause and resume of a sandbox whose
/// image has no `mount` (the agent mounts the volume again itself), then a running sandbox
/// across a graceful restart (paused by the stop, resumed after it with its mount).
fn across_pause_and_restart(python: &str) {
    let mut s = Server::start("");
    build_template(&s, "base");
    let lines = sdk_script(&s, python, "volume_lifecycle.py", &["before-restart"]);
    let (vol, sbx) = (id_from(&lines, "id-volume"), id_from(&lines, "id-sandbox"));
    assert_eq!(nfs_servers(&s).len(), 1, "{:?}", nfs_servers(&s));
    s.stop();
    assert!(nfs_servers(&s).is_empty(), "{:?}", nfs_servers(&s));
    assert_nothing_mounted(&s.state_dir.join("volumes"));
    s.spawn();
    sdk_script(
        &s,
        python,
        "volume_lifecycle.py",
        &["after-restart", &vol, &sbx],
    );
    assert!(nfs_servers(&s).is_empty(), "{:?}", nfs_servers(&s));
    assert!(!volume_dir(&s, &vol).exists());
    s.stop();
}

fn content_quota_restart_and_delete(python: &str) {
    let mut s = Server::start("");
    let lines = volumes_py(&s, python, &["content"]);
    let (vol, small, tiny) = (
        id_from(&lines, "id-volume"),
        id_from(&lines, "id-small"),
        id_from(&lines, "id-tiny"),
    );
    symlinks_stay_inside(&s, &vol);

    // The quota lives in the image: the host file is 16 MiB, whatever was sent.
    let image = volume_dir(&s, &tiny).join("volume.ext4");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 16 << 20);
    let volumes = s.state_dir.join("volumes");
    assert_eq!(
        mounts_under(&volumes).len(),
        3,
        "{:?}",
        mounts_under(&volumes)
    );
    for line in mounts_under(&volumes) {
        for flag in ["nosuid", "nodev", "noexec"] {
            assert!(line.contains(flag), "{line} lacks {flag}");
        }
    }

    // A graceful stop unmounts every volume; a start mounts them again.
    s.stop();
    assert_nothing_mounted(&volumes);
    s.spawn();
    assert_eq!(mounts_under(&volumes).len(), 3);
    volumes_py(&s, python, &["after-restart", &vol]);

    for id in [&vol, &small, &tiny] {
        volumes_py(&s, python, &["delete", id]);
        assert!(
            !volume_dir(&s, id).exists(),
            "volume {id}'s directory is left"
        );
    }
    assert_nothing_mounted(&volumes);
    s.stop();
}

/// ganesha processes serving volumes of this server's state dir.
fn nfs_servers(s: &Server) -> Vec<String> {
    let needle = s.state_dir.display().to_string();
    host("ps", &["-eo", "pid,args"])
        .lines()
        .filter(|l| l.contains("ganesha.nfsd") && l.contains(&needle))
        .map(str::to_string)
        .collect()
}

/// Two sandboxes (restores of one template) share a volume over their slots' NFS servers;
/// the SDK script checks what each guest sees; here: one NFS server per running sandbox
/// with volumes, none left once they are gone, and the volume's files outlive them.
fn mounted_in_two_sandboxes(python: &str, js_module: &str) {
    let s = Server::start("");
    build_template(&s, "base");
    let lines = sdk_script(&s, python, "volume_mounts.py", &[]);
    let vol = id_from(&lines, "id-volume");
    run_sdk(&s, "node", "volumes.mjs", Some(js_module));
    assert!(nfs_servers(&s).is_empty(), "{:?}", nfs_servers(&s));
    let data = volume_dir(&s, &vol).join("mnt");
    assert_eq!(
        std::fs::read_to_string(data.join("one.txt")).unwrap(),
        "from-one\n"
    );
    let (status, v) = s.call("DELETE", &format!("/volumes/{vol}"), None);
    assert_eq!(status, 204, "{v}");
    let volumes = s.state_dir.join("volumes");
    assert_nothing_mounted(&volumes);
}
