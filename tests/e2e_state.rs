//! Untrusted images and stored state against the real server: hostile images built here
//! (local OCI layouts and the local docker-registry) get a 400 naming the offending entry
//! and touch nothing outside their staging root; setuid files and device nodes reach the
//! guest but never the host; the state dir is private; a failed pause commit keeps the
//! capture; a record corrupted between two runs is quarantined, not deleted; a moved
//! state dir keeps its paused sandboxes; a pause that finds QEMU hung keeps the disk in
//! quarantine.
//!
//! Fixture: one server shared by the tests that neither restart it nor change its config
//! (see [`shared`]), and on it one snapshot of a sandbox cold-booted from the base image
//! plus a layer with a setuid file and a device node, which those tests restore their
//! sandboxes from. The tests that restart a server (a corrupted record, a moved state
//! dir) and the hostile images own a server each: they take [`Shared::alone`], so they
//! run alone (named to sort first: the shared server then starts once, after them).

mod common;

use agentenv::image::{ImageSpec, LayerBlob, LayerBuilder, LayoutWriter};
use common::registry::{Auth, TestLayer, TestRegistry};
use common::shared::{assert_server_left_nothing, DefaultServer, Hold, Shared};
use common::*;
use serde_json::{json, Value};
use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The server the tests that do not restart one share.
static SHARED: Shared<DefaultServer> = Shared::new();

/// What the tests use of the shared server.
trait Fixture {
    /// A running sandbox (timeout 600 s) restored from a snapshot of a sandbox
    /// cold-booted from [`base_plus_privileged_layer`].
    fn restored_sandbox(&self) -> String;
}

impl Fixture for DefaultServer {
    fn restored_sandbox(&self) -> String {
        let boot = |s: &Server| {
            let image = base_plus_privileged_layer(&s.state_dir.parent().unwrap().join("img"));
            id_of(&s.create(json!({"image": image, "timeout": 600})))
        };
        self.origin.restore(&self.server, boot, json!({}))
    }
}

/// A hold on the shared server (started by the first test that asks).
fn shared() -> Hold<DefaultServer> {
    SHARED.hold()
}

fn require_registry() {
    assert!(
        Path::new("/usr/bin/docker-registry").is_file(),
        "docker-registry is not installed: run scripts/setup.sh"
    );
}

fn write_layout(dir: &Path, layers: Vec<LayerBlob>) -> String {
    let mut w = LayoutWriter::create(dir).unwrap();
    let desc = w.add_image(&ImageSpec::default(), &layers).unwrap();
    w.tag(desc, Some("latest"));
    w.finish().unwrap();
    format!("oci:{}:latest", dir.display())
}

/// Pushes a one-layer OCI image whose layer is the gzip blob `gz` (uncompressed digest
/// `diff_id`); returns the manifest digest.
fn push_gzip_image(reg: &TestRegistry, repo: &str, gz: &[u8], diff_id: &str) -> String {
    let layer = reg.push_blob(repo, gz);
    let config = json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    })
    .to_string();
    let config_digest = reg.push_blob(repo, config.as_bytes());
    let manifest = json!({
        "schemaVersion": 2, "mediaType": common::registry::OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer, "size": gz.len()}],
    })
    .to_string()
    .into_bytes();
    let digest = common::registry::sha256(&manifest);
    reg.push_manifest(repo, &digest, common::registry::OCI_MANIFEST, &manifest);
    digest
}

/// Writes to a gzip encoder and hashes what it was given (the layer's diff id).
struct HashingGz {
    gz: flate2::write::GzEncoder<Vec<u8>>,
    hash: sha2::Sha256,
}

impl HashingGz {
    fn write_all(&mut self, bytes: &[u8]) {
        use sha2::Digest;
        self.hash.update(bytes);
        self.gz.write_all(bytes).unwrap();
    }
}

/// A gzip layer with one regular file of `size` zero bytes, streamed (never in memory),
/// and its diff id.
fn zeros_layer_gzip(name: &str, size: u64) -> (Vec<u8>, String) {
    use sha2::Digest;
    let mut gz = HashingGz {
        gz: flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()),
        hash: sha2::Sha256::new(),
    };
    let mut h = tar::Header::new_gnu();
    h.set_path(name).unwrap();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(size);
    h.set_cksum();
    gz.write_all(h.as_bytes());
    let chunk = vec![0u8; 1 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        gz.write_all(&chunk[..n]);
        left -= n as u64;
    }
    let pad = (512 - size % 512) % 512;
    gz.write_all(&vec![0u8; pad as usize + 1024]);
    let diff_id = format!(
        "sha256:{}",
        gz.hash
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    (gz.gz.finish().unwrap(), diff_id)
}

fn gunzip(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// `.wh...` (climbs to the staging dir's parent), and a whiteout under a symlink that
/// climbs out.
fn dotdot_whiteout() -> Vec<u8> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    let mut l = LayerBuilder::new();
    l.file("ok", 0o644, b"ok").raw(h, "etc/.wh...", &[]);
    l.finish()
}

fn symlink_escape_whiteout() -> (Vec<u8>, Vec<u8>) {
    let mut l1 = LayerBuilder::new();
    l1.symlink("up", "../../../../../../../..");
    let mut l2 = LayerBuilder::new();
    l2.whiteout("up/victim");
    (l1.finish(), l2.finish())
}

fn many_files(count: usize) -> Vec<u8> {
    let mut l = LayerBuilder::new();
    for i in 0..count {
        l.file(&format!("f{i}"), 0o644, b"");
    }
    l.finish()
}

/// Setuid/setgid files and device nodes anywhere under `dir` (the host must have none).
fn privileged_files(dir: &Path) -> Vec<PathBuf> {
    files_under(dir)
        .into_iter()
        .filter(|p| {
            let Ok(md) = fs::symlink_metadata(p) else {
                return false;
            };
            let ft = md.file_type();
            ft.is_char_device() || ft.is_block_device() || (ft.is_file() && md.mode() & 0o6000 != 0)
        })
        .collect()
}

/// Directories not 0700 and files readable or writable by group or others. Entries that
/// vanish while it looks (a test beside it on the shared server deletes a sandbox) are
/// skipped; any other error fails.
fn public_modes(dir: &Path) -> Vec<String> {
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let (md, entries) =
            match fs::symlink_metadata(&d).and_then(|md| Ok((md, fs::read_dir(&d)?))) {
                Ok(both) => both,
                Err(e) if gone(&e) && d != dir => continue,
                Err(e) => panic!("{}: {e}", d.display()),
            };
        if md.permissions().mode() & 0o7777 != 0o700 {
            out.push(format!("{} {:o}", d.display(), md.mode() & 0o7777));
        }
        for e in entries.flatten() {
            let md = match fs::symlink_metadata(e.path()) {
                Ok(md) => md,
                Err(err) if gone(&err) => continue,
                Err(err) => panic!("{}: {err}", e.path().display()),
            };
            if md.is_dir() {
                stack.push(e.path());
            } else if !md.file_type().is_symlink()
                && !md.file_type().is_socket()
                && md.mode() & 0o077 != 0
            {
                out.push(format!("{} {:o}", e.path().display(), md.mode() & 0o7777));
            }
        }
    }
    out
}

fn expect_bad_image(s: &Server, image: &str, needles: &[&str]) {
    let (code, v) = s.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": image, "diskSizeMB": 1024})),
    );
    let msg = v["message"].as_str().unwrap_or_default().to_string();
    assert_eq!(code, 400, "{image}: {v}");
    for n in needles {
        assert!(msg.contains(n), "{image}: {msg:?} does not name {n:?}");
    }
}

#[test]
fn hostile_images_get_a_400_naming_the_entry_and_touch_nothing_outside_their_root() {
    require_registry();
    let _alone = SHARED.alone();
    let s = Server::start("");
    let scratch = s.state_dir.parent().unwrap().join("images-src");
    fs::create_dir_all(&scratch).unwrap();
    // Another build's staging tree, which `.wh...` reached before.
    let other_build = s.state_dir.join("images/tmp/other.staging");
    fs::create_dir_all(&other_build).unwrap();
    fs::write(other_build.join("keep"), b"x").unwrap();
    let outside = scratch.join("victim");
    fs::write(&outside, b"host").unwrap();

    let (esc1, esc2) = symlink_escape_whiteout();
    let layouts = [
        (
            "dotdot",
            vec![LayerBlob::plain(dotdot_whiteout())],
            vec![".wh...", "whiteout"],
        ),
        (
            "escape",
            vec![
                LayerBlob::plain(esc1.clone()),
                LayerBlob::plain(esc2.clone()),
            ],
            vec!["up/.wh.victim", "escapes"],
        ),
        (
            "inodes",
            vec![LayerBlob::gzip(many_files(70_000))],
            vec!["entry \"f", "files at most", "diskSizeMB"],
        ),
    ];
    for (name, layers, needles) in layouts {
        let image = write_layout(&scratch.join(name), layers);
        expect_bad_image(&s, &image, &needles);
    }
    // 1.25 GiB of zeros in a ~1 MiB layer: refused at its header, before any byte lands.
    let (zeros, zeros_diff_id) = zeros_layer_gzip("big", 1280 << 20);

    let reg = TestRegistry::start(Auth::Anonymous);
    let pushed = reg.push_image(
        "hostile/dotdot",
        "amd64",
        "/",
        &[TestLayer {
            tar: dotdot_whiteout(),
            gzip: true,
        }],
        false,
    );
    expect_bad_image(
        &s,
        &format!("{}/hostile/dotdot@{}", reg.addr, pushed.digest),
        &[".wh...", "whiteout"],
    );
    let pushed = reg.push_image(
        "hostile/escape",
        "amd64",
        "/",
        &[
            TestLayer {
                tar: esc1,
                gzip: false,
            },
            TestLayer {
                tar: esc2,
                gzip: true,
            },
        ],
        false,
    );
    expect_bad_image(
        &s,
        &format!("{}/hostile/escape@{}", reg.addr, pushed.digest),
        &["up/.wh.victim", "escapes"],
    );
    // The zeros layer, pushed as its gzip blob.
    let pushed = push_gzip_image(&reg, "hostile/zeros", &zeros, &zeros_diff_id);
    expect_bad_image(
        &s,
        &format!("{}/hostile/zeros@{pushed}", reg.addr),
        &["entry \"big\"", "1024 MiB", "diskSizeMB"],
    );

    assert!(
        other_build.join("keep").exists(),
        "a build reached outside its root"
    );
    assert_eq!(fs::read(&outside).unwrap(), b"host");
    assert!(privileged_files(&s.state_dir).is_empty());
    let staging: Vec<_> = fs::read_dir(s.state_dir.join("images/tmp"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n != "other.staging")
        .collect();
    assert!(staging.is_empty(), "left behind: {staging:?}");
}

/// The built-in base image's layer plus one with a setuid file and a device node.
fn base_plus_privileged_layer(dir: &Path) -> String {
    let base = assets_dir().join("base-image");
    let blob = |digest: &str| {
        fs::read(
            base.join("blobs/sha256")
                .join(digest.trim_start_matches("sha256:")),
        )
        .unwrap()
    };
    let index: Value = serde_json::from_slice(&fs::read(base.join("index.json")).unwrap()).unwrap();
    let manifest: Value =
        serde_json::from_slice(&blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap();
    let mut layers = Vec::new();
    for l in manifest["layers"].as_array().unwrap() {
        let bytes = blob(l["digest"].as_str().unwrap());
        let gz = l["mediaType"].as_str().unwrap().ends_with("gzip");
        layers.push(LayerBlob::plain(if gz { gunzip(&bytes) } else { bytes }));
    }
    let mut extra = LayerBuilder::new();
    extra
        .dir("opt", 0o755)
        .file_owned("opt/suidtest", 0o4755, 0, 0, b"#!/bin/sh\necho hi\n")
        .dir("opt/dev", 0o755)
        .char_device("opt/dev/testnull", 0o666, 1, 3);
    layers.push(LayerBlob::plain(extra.finish()));
    write_layout(dir, layers)
}

fn delete(s: &Server, id: &str) {
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
}

#[test]
fn the_guest_sees_setuid_files_and_device_nodes_that_the_host_never_holds() {
    let f = shared();
    let s = &f.server;
    let a = f.restored_sandbox();

    // The guest sees the image faithfully; the host holds nothing privileged.
    let seen = sh(s, &a, "stat -c '%a %F' /opt/suidtest /opt/dev/testnull");
    assert_eq!(
        seen, "4755 regular file\n666 character special file\n",
        "{seen}"
    );
    assert!(
        privileged_files(&s.state_dir).is_empty(),
        "{:?}",
        privileged_files(&s.state_dir)
    );
    delete(s, &a);
}

#[test]
fn the_capture_of_a_pause_whose_record_cannot_be_committed_is_kept_and_resumes() {
    let f = shared();
    let s = &f.server;
    let a = f.restored_sandbox();
    sh(s, &a, "echo mem-a > /dev/shm/m; echo disk-a > /root/d");

    // A pause whose record cannot be committed (record.json is a directory, so the
    // atomic rename fails) keeps the capture: the sandbox is paused and resumes. The
    // directory is private, as the server's files are (another test checks the modes).
    let record = s.state_dir.join("sandboxes").join(&a).join("record.json");
    fs::remove_file(&record).unwrap();
    std::os::unix::fs::DirBuilderExt::mode(&mut fs::DirBuilder::new(), 0o700)
        .create(&record)
        .unwrap();
    let (code, v) = s.call("POST", &format!("/sandboxes/{a}/pause"), None);
    assert_eq!(code, 500, "{v}");
    assert!(v["message"].as_str().unwrap().contains("paused"), "{v}");
    assert_eq!(
        s.call("GET", &format!("/sandboxes/{a}"), None).1["state"],
        "paused"
    );
    fs::remove_dir(&record).unwrap();
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{a}/resume"),
        Some(json!({"timeout": 600})),
    );
    assert_eq!(code, 201, "{v}");
    assert_eq!(sh(s, &a, "cat /dev/shm/m /root/d"), "mem-a\ndisk-a\n");
    delete(s, &a);
}

#[test]
fn the_state_dir_with_paused_sandboxes_is_private_and_holds_nothing_privileged() {
    let f = shared();
    let s = &f.server;
    let (a, b) = (f.restored_sandbox(), f.restored_sandbox());
    sh(s, &a, "echo mem-a > /dev/shm/m; echo disk-a > /root/d");

    // Both paused; everything under the state dir is private.
    for id in [&a, &b] {
        let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
        assert_eq!(code, 204, "{v}");
    }
    let public = public_modes(&s.state_dir);
    assert!(public.is_empty(), "not private: {public:?}");
    assert!(privileged_files(&s.state_dir).is_empty());
    delete(s, &a);
    delete(s, &b);
}

/// A server of its own (it restarts it), with sandbox `a` cold-booted from the base image
/// holding `mem-a` in /dev/shm/m and `disk-a` in /root/d.
fn own_server_with_a_marked_sandbox() -> (Server, String) {
    let s = Server::start("");
    let a = id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
    sh(&s, &a, "echo mem-a > /dev/shm/m; echo disk-a > /root/d");
    (s, a)
}

#[test]
fn a_record_corrupted_between_two_runs_is_quarantined_not_deleted() {
    let _alone = SHARED.alone();
    let (mut s, a) = own_server_with_a_marked_sandbox();
    // A second sandbox, restored from a snapshot of the first (no cold boot).
    let (code, snap) = s.call("POST", &format!("/sandboxes/{a}/snapshots"), None);
    assert_eq!(code, 201, "{snap}");
    let (code, b) = s.call(
        "POST",
        "/sandboxes",
        Some(json!({"templateID": snap["snapshotID"], "timeout": 600})),
    );
    assert_eq!(code, 201, "{b}");
    let b = id_of(&b);
    for id in [&a, &b] {
        let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
        assert_eq!(code, 204, "{v}");
    }

    // A record corrupted between two runs is quarantined, never deleted; the other
    // sandbox is still there.
    s.stop();
    let b_dir = s.state_dir.join("sandboxes").join(&b);
    fs::write(b_dir.join("record.json"), b"{\"info\": garbage").unwrap();
    s.spawn();
    assert_eq!(s.call("GET", &format!("/sandboxes/{b}"), None).0, 404);
    assert_eq!(
        s.call("GET", &format!("/sandboxes/{a}"), None).1["state"],
        "paused"
    );
    assert!(!b_dir.exists());
    let quarantined: Vec<PathBuf> = fs::read_dir(s.state_dir.join("quarantine"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert_eq!(
        fs::read(quarantined[0].join("record.json")).unwrap(),
        b"{\"info\": garbage"
    );
    assert!(quarantined[0].join("paused/state.bin").is_file());
    assert!(
        s.log().contains("result=quarantined"),
        "no log line says why"
    );
    delete(&s, &a);
    s.stop();
    assert_server_left_nothing(&s);
}

#[test]
fn a_moved_state_dir_keeps_its_paused_sandboxes() {
    let _alone = SHARED.alone();
    let (mut s, a) = own_server_with_a_marked_sandbox();
    let (code, v) = s.call("POST", &format!("/sandboxes/{a}/pause"), None);
    assert_eq!(code, 204, "{v}");

    // The whole state dir moves: the paused sandbox still resumes with its memory.
    s.stop();
    let moved = s.state_dir.parent().unwrap().join("moved-state");
    fs::rename(&s.state_dir, &moved).unwrap();
    let config = fs::read_to_string(&s.config_path).unwrap().replace(
        &format!("state_dir = \"{}\"", s.state_dir.display()),
        &format!("state_dir = \"{}\"", moved.display()),
    );
    fs::write(&s.config_path, config).unwrap();
    s.state_dir = moved;
    s.spawn();
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{a}/resume"),
        Some(json!({"timeout": 600})),
    );
    assert_eq!(code, 201, "{v}\n{}", s.log());
    assert_eq!(sh(&s, &a, "cat /dev/shm/m /root/d"), "mem-a\ndisk-a\n");
    delete(&s, &a);
    s.stop();
    assert_server_left_nothing(&s);
}

#[test]
fn the_disk_of_a_sandbox_whose_qemu_hangs_at_a_pause_is_kept_in_quarantine() {
    let f = shared();
    let s = &f.server;
    let a = f.restored_sandbox();

    // A pause that finds QEMU hung (stopped here, so it never answers) cannot capture,
    // and the VM cannot run on: the sandbox is removed (500, then 404) and its VM ends,
    // but its disk is kept in quarantine with the reason, never deleted.
    let pids = qemu_processes_with(&format!("sandboxes/{a}"));
    assert_eq!(pids.len(), 1, "{pids:?}");
    stop_process(pids[0]);
    let (code, v) = s.call("POST", &format!("/sandboxes/{a}/pause"), None);
    assert_eq!(code, 500, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("disk is kept"),
        "{v}"
    );
    assert_eq!(s.call("GET", &format!("/sandboxes/{a}"), None).0, 404);
    assert!(
        wait_until(Duration::from_secs(10), || !Path::new(&format!(
            "/proc/{}/cmdline",
            pids[0]
        ))
        .exists()),
        "QEMU {} is still there",
        pids[0]
    );
    assert!(!s.state_dir.join("sandboxes").join(&a).exists());
    let kept: Vec<PathBuf> = fs::read_dir(s.state_dir.join("quarantine"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.to_string_lossy().contains(&format!("/sandboxes-{a}-")))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let disks: Vec<PathBuf> = fs::read_dir(&kept[0])
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .collect();
    assert!(!disks.is_empty(), "no disk kept in {}", kept[0].display());
    for disk in &disks {
        // Its backing chain still resolves from the quarantine.
        let info = std::process::Command::new("qemu-img")
            .args(["info", "-U", "--backing-chain"])
            .arg(disk)
            .output()
            .unwrap();
        assert!(info.status.success(), "{}: {info:?}", disk.display());
    }
    let why = fs::read_to_string(kept[0].with_extension("reason")).unwrap();
    assert!(why.contains("pause failed"), "{why}");
    assert!(
        s.log()
            .contains(&format!("sandboxId={a} op=pause result=stopped kept=")),
        "no log line says where the disk went"
    );
}
