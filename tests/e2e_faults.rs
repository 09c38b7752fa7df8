//! End-to-end host faults against the real server, real VMs and a real recording
//! extension (issue 24): a sandbox whose QEMU is SIGKILLed is stopped with reason
//! `failure`, answers 404 naming the death and the quarantine, and its files are kept
//! there with a disk whose backing chain resolves; the other sandbox runs on.

mod common;

use common::extension::Extension;
use common::loopfs::LoopFs;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Directories in `<state>/quarantine`.
fn quarantined(s: &Server) -> Vec<PathBuf> {
    std::fs::read_dir(s.state_dir.join("quarantine"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_vm_that_dies_is_stopped_and_quarantined() {
    let _serial = serial();
    let ext = Extension::start();
    let mut s = Server::start(&ext.config());
    let victim = id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
    let other = id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
    sh(&s, &victim, "echo kept > /root/proof; sync");
    let pids = qemu_processes_with(&victim);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let killed = Instant::now();
    host("kill", &["-KILL", &pids[0].to_string()]);

    let stops = ext.wait_for("stop", 1, Duration::from_secs(10));
    let stopped_after = killed.elapsed();
    assert_eq!(stops[0].sandbox_id(), victim);
    assert_eq!(stops[0].header("X-Agentenv-Stop-Reason"), Some("failure"));
    assert!(
        stopped_after < Duration::from_secs(5),
        "the stop came {stopped_after:?} after the kill"
    );
    let (code, v) = s.call("GET", &format!("/sandboxes/{victim}"), None);
    assert_eq!(code, 404, "{v}");
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("died on its own"), "{msg}");
    assert!(msg.contains("SIGKILL"), "{msg}");
    assert!(msg.contains("quarantine"), "{msg}");
    let (code, v) = s.call("POST", &format!("/sandboxes/{victim}/pause"), None);
    assert_eq!(code, 404, "{v}");
    assert!(v["message"].as_str().unwrap().contains("died"), "{v}");

    // The run dir is in quarantine, with a reason and a disk whose chain resolves.
    assert!(wait_until(Duration::from_secs(5), || quarantined(&s).len() == 1));
    let kept = quarantined(&s).remove(0);
    assert!(
        msg.contains(&kept.display().to_string()),
        "{msg} vs {kept:?}"
    );
    let why = std::fs::read_to_string(kept.with_extension("reason")).unwrap();
    assert!(why.contains("killed by signal 9 (SIGKILL)"), "{why}");
    for f in ["record.json", "console.log", "disk.qcow2"] {
        assert!(kept.join(f).is_file(), "{f} kept in {kept:?}");
    }
    assert_backing_chain_resolves(&kept.join("disk.qcow2"));
    assert!(!s.state_dir.join("sandboxes").join(&victim).exists());
    assert!(s
        .log()
        .contains(&format!("sandboxId={victim} op=watch result=vm_died")));
    assert_eq!(
        metric_sample(
            &s,
            "agentenv_vm_deaths_total{kind=\"sandbox\",cause=\"SIGKILL\"}"
        ),
        Some(1.0)
    );

    // The other sandbox is untouched.
    assert_eq!(sh(&s, &other, "echo alive"), "alive\n");
    let (_, list) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(
        s.call("DELETE", &format!("/sandboxes/{other}"), None).0,
        204
    );
    s.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    let stops = ext.requests_for("stop");
    assert_eq!(stops.len(), 2, "one stop per start");
}

/// `qemu-img info --backing-chain` opens every layer of `disk`'s chain.
fn assert_backing_chain_resolves(disk: &Path) {
    let out = std::process::Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain", "--output=json"])
        .arg(disk)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chain: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let chain = chain.as_array().unwrap();
    assert!(chain.len() >= 2, "an overlay over its base: {chain:?}");
}

/// Writes `body` to `path` in sandbox `id` through `PUT /files`; the status.
fn put_file(s: &Server, id: &str, path: &str, body: &[u8]) -> u16 {
    let url = format!("{}/sandboxes/{id}/files?path={path}", s.base);
    match ureq::put(&url)
        .set("X-API-Key", API_KEY)
        .set("Content-Type", "application/octet-stream")
        .timeout(Duration::from_secs(60))
        .send_bytes(body)
    {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("PUT {url}: {e}"),
    }
}

/// Asserts a 507 whose message names the state dir and a byte count.
fn assert_507(s: &Server, (code, v): (u16, serde_json::Value), what: &str) {
    assert_eq!(code, 507, "{what}: {v}\n{}", s.log());
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains(&s.state_dir.display().to_string()) && msg.contains(" bytes"),
        "{what}: {msg}"
    );
}

/// Files a failed write may leave behind: atomic-write temps and capture directories of
/// sandboxes that are running.
fn partial_files(s: &Server, running: &[&str]) -> Vec<PathBuf> {
    let mut left: Vec<PathBuf> = files_under(&s.state_dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".tmp-"))
        .collect();
    for id in running {
        let paused = s.state_dir.join("sandboxes").join(id).join("paused");
        if paused.exists() {
            left.push(paused);
        }
    }
    left
}

const RESERVE_MB: u64 = 250;

/// A running server whose state dir is a fresh 1.5 GiB loop-mounted ext4 filesystem with
/// `disk_reserve_mb = reserve_mb`, and its extension. Drop the server before the
/// filesystem.
fn on_small_disk(reserve_mb: u64) -> (Extension, LoopFs, Server) {
    on_small_disk_with(reserve_mb, "")
}

/// [`on_small_disk`] with more config (TOML tables).
fn on_small_disk_with(reserve_mb: u64, extra_toml: &str) -> (Extension, LoopFs, Server) {
    let ext = Extension::start();
    let scratch = scratch_dir();
    let fs = LoopFs::new(&scratch.join("state"), 1536);
    let s = Server::builder()
        .dir(&scratch)
        .server_keys(&format!("disk_reserve_mb = {reserve_mb}"))
        .section(&format!("{}{extra_toml}", ext.config()))
        .start();
    (ext, fs, s)
}

/// `agentenv_state_disk_bytes{state="free"}`.
fn free_metric(s: &Server) -> f64 {
    metric_sample(s, "agentenv_state_disk_bytes{state=\"free\"}").unwrap()
}

/// A cold create from the base image (timeout 900 s), answered as it is.
fn cold(s: &Server) -> (u16, serde_json::Value) {
    s.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "timeout": 900})),
    )
}

/// The body of a template build from the base image.
fn full_disk_template() -> serde_json::Value {
    json!({"name": "full-disk", "image": base_image(), "memoryMB": 256,
        "cpuCount": 1, "diskSizeMB": 1024})
}

/// "<id> <state>" of every running or paused sandbox, sorted.
fn listed(s: &Server) -> Vec<String> {
    let (_, list) = s.call("GET", "/v2/sandboxes?state=running,paused", None);
    let mut ids: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| format!("{} {}", v["sandboxID"].as_str().unwrap(), v["state"]))
        .collect();
    ids.sort();
    ids
}

/// After the disk was full and space came back: a restart loads the record of every
/// sandbox in `ids` (none is quarantined), they delete, and the server stops leaving no
/// VM, sandbox file or namespace, with one stop hook per start.
fn a_restart_loads_every_record_and_leaves_nothing(ext: &Extension, s: &mut Server, ids: &[&str]) {
    s.stop();
    s.spawn();
    let after = listed(s);
    assert_eq!(after.len(), ids.len(), "{after:?}\n{}", s.log());
    for id in ids {
        assert!(
            after.iter().any(|l| l.starts_with(&format!("{id} "))),
            "{id} not loaded: {after:?}"
        );
        let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(code, 204, "{v}");
    }
    assert!(
        !s.log().contains("result=quarantined"),
        "no record was unreadable"
    );
    s.stop();
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    let starts = ext.requests_for("start-fresh").len() + ext.requests_for("start-resume").len();
    assert_eq!(ext.requests_for("stop").len(), starts, "one stop per start");
}

#[test]
fn below_the_disk_reserve_new_state_answers_507_until_space_returns() {
    let _serial = serial();
    let (ext, fs, mut s) = on_small_disk(RESERVE_MB);
    let a = id_of(&s.create(json!({"image": base_image(), "timeout": 900})));
    assert_eq!(put_file(&s, &a, "/root/before", b"kept"), 204);
    let (code, snap) = s.call("POST", &format!("/sandboxes/{a}/snapshots"), None);
    assert_eq!(code, 201, "{snap}");
    let snap = snap["snapshotID"].as_str().unwrap().to_string();
    assert_eq!(
        metric_sample(&s, "agentenv_state_disk_bytes{state=\"reserve\"}"),
        Some((RESERVE_MB << 20) as f64)
    );

    // Below the reserve: new state is refused up front, pauses, deletes, reads go on.
    let filler = fs.fill_to((RESERVE_MB - 100) << 20, 1);
    assert!(free_metric(&s) < (RESERVE_MB << 20) as f64);
    assert_507(&s, cold(&s), "cold create below the reserve");
    let from_snap = json!({"templateID": snap, "timeout": 600});
    assert_507(
        &s,
        s.call("POST", "/sandboxes", Some(from_snap.clone())),
        "create",
    );
    assert_507(
        &s,
        s.call("POST", &format!("/sandboxes/{a}/snapshots"), None),
        "snapshot",
    );
    assert_507(
        &s,
        s.call("POST", "/templates", Some(full_disk_template())),
        "build",
    );
    assert_eq!(put_file(&s, &a, "/root/below-reserve", b"small"), 204);
    let (code, v) = s.call("POST", &format!("/sandboxes/{a}/pause"), None);
    assert_eq!(code, 204, "a pause goes on below the reserve: {v}");
    assert_507(
        &s,
        s.call("POST", &format!("/sandboxes/{a}/resume"), None),
        "resume",
    );
    assert_eq!(
        s.call("GET", &format!("/sandboxes/{a}"), None).1["state"],
        "paused"
    );
    assert!(s.log().contains("reserve"), "the refusals are logged");

    // Space comes back: the same operations succeed with no restart.
    std::fs::remove_file(&filler).unwrap();
    assert!(free_metric(&s) > (RESERVE_MB << 20) as f64);
    let (code, v) = s.call("POST", &format!("/sandboxes/{a}/resume"), None);
    assert_eq!(code, 201, "{v}");
    assert_eq!(sh(&s, &a, "cat /root/before; echo"), "kept\n");
    let (code, v) = s.call("POST", "/sandboxes", Some(from_snap));
    assert_eq!(code, 201, "{v}");
    let d = id_of(&v);
    build_template(&s, "after-full");

    a_restart_loads_every_record_and_leaves_nothing(&ext, &mut s, &[&a, &d]);
    drop(s);
    drop(fs);
}

#[test]
fn a_pause_on_a_full_disk_answers_507_leaving_the_sandbox_running_and_every_record_as_it_was() {
    let _serial = serial();
    let (ext, fs, mut s) = on_small_disk(RESERVE_MB);
    let b = id_of(&s.create(json!({"image": base_image(), "timeout": 900})));
    let filler = fs.fill_to((RESERVE_MB - 100) << 20, 1);
    assert!(free_metric(&s) < (RESERVE_MB << 20) as f64);
    assert_eq!(put_file(&s, &b, "/root/below-reserve", b"small"), 204);
    let records_before = records(&s);

    // Nearly full, then full: a pause that cannot be written (its capture runs out of
    // room part way, or cannot even start) leaves the sandbox running as it was, and the
    // partial capture is removed.
    let pause_runs_on = |room: &str| {
        let (code, v) = s.call("POST", &format!("/sandboxes/{b}/pause"), None);
        assert!(
            v["message"].as_str().unwrap_or("").contains("is full"),
            "{room}: {v}"
        );
        assert_507(&s, (code, v), &format!("pause on a {room} disk"));
        assert_eq!(
            s.call("GET", &format!("/sandboxes/{b}"), None).1["state"],
            "running"
        );
        assert_eq!(sh(&s, &b, "cat /root/below-reserve; echo"), "small\n");
        assert!(
            partial_files(&s, &[&b]).is_empty(),
            "{:?}",
            partial_files(&s, &[&b])
        );
    };
    let nearly = fs.fill_to(2 << 20, 2);
    pause_runs_on("nearly full");
    let full = fs.fill_to(0, 3);
    pause_runs_on("full");
    assert_507(&s, cold(&s), "cold create on a full disk");
    assert_507(
        &s,
        s.call("POST", &format!("/sandboxes/{b}/snapshots"), None),
        "snapshot",
    );
    assert_507(
        &s,
        s.call("POST", "/templates", Some(full_disk_template())),
        "build",
    );
    assert_eq!(
        records(&s),
        records_before,
        "every record is the last good one"
    );
    assert_eq!(
        s.call("GET", "/health", None).0,
        204,
        "the server keeps serving"
    );

    // Space comes back: the same operations succeed with no restart.
    for f in [&full, &nearly, &filler] {
        std::fs::remove_file(f).unwrap();
    }
    assert!(free_metric(&s) > (RESERVE_MB << 20) as f64);
    let (code, c) = cold(&s);
    assert_eq!(code, 201, "create failed: {c}\n{}", s.log());
    let c = id_of(&c);
    let (code, v) = s.call("POST", &format!("/sandboxes/{b}/snapshots"), None);
    assert_eq!(code, 201, "{v}");
    assert_eq!(put_file(&s, &b, "/root/after", b"room"), 204);
    let (code, v) = s.call("POST", &format!("/sandboxes/{b}/pause"), None);
    assert_eq!(code, 204, "{v}");

    a_restart_loads_every_record_and_leaves_nothing(&ext, &mut s, &[&b, &c]);
    drop(s);
    drop(fs);
}

/// Every record file under the state dir with its bytes.
fn records(s: &Server) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<_> = files_under(&s.state_dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// What the guest writes: a 1 MiB block of `yes` lines, repeated, so the host knows the
/// file's digest.
const PATTERN_LINE: &str = "agentenv-io-error-pause";

/// The MD5 of `mb` repetitions of the 1 MiB block.
fn pattern_digest(mb: u32) -> String {
    let block: Vec<u8> = format!("{PATTERN_LINE}\n")
        .bytes()
        .cycle()
        .take(1 << 20)
        .collect();
    let mut child = Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for _ in 0..mb {
        std::io::Write::write_all(&mut stdin, &block).unwrap();
    }
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Starts, detached in the guest, a write of `mb` MiB of the pattern to `path` that
/// bypasses the guest's page cache (each block reaches the host at once), then a marker.
fn start_guest_write(s: &Server, id: &str, path: &str, mb: u32) {
    let script = format!(
        "yes {PATTERN_LINE} | head -c 1048576 > /root/block && \
         (setsid sh -c 'for i in $(seq {mb}); do cat /root/block; done | dd of={path} bs=1M \
         iflag=fullblock oflag=direct conv=fsync && echo ok > {path}.done' \
         </dev/null >/dev/null 2>&1 &)"
    );
    sh(s, id, &script);
}

/// GET /sandboxes/{id}'s `pausedOnIoError`, if any.
fn io_error_pause(s: &Server, id: &str) -> Option<serde_json::Value> {
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{v}");
    v.get("pausedOnIoError").cloned()
}

/// An envd request through the API port's port routing; its status.
fn envd_health(s: &Server, id: &str) -> u16 {
    let called = ureq::get(&format!("{}/health", s.base))
        .set("E2b-Sandbox-Id", id)
        .set("E2b-Sandbox-Port", "49983")
        .set("X-API-Key", API_KEY)
        .timeout(Duration::from_secs(30))
        .call();
    match called {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(code, _)) => code,
        Err(e) => panic!("envd /health of {id}: {e}"),
    }
}

const GUEST_WRITE_MB: u32 = 64;

/// A server on a small disk (`disk_reserve_mb = 64`) with one running sandbox, whose
/// guest starts a 64 MiB write to `/root/big` (bypassing its page cache) once the host
/// has 16 MiB free: QEMU pauses it. Returns once the sandbox reports `pausedOnIoError`,
/// with the filler to remove to give the space back. Drop the server before the
/// filesystem.
fn paused_on_a_full_disk() -> (Extension, LoopFs, Server, String, PathBuf) {
    let (ext, fs, s) = on_small_disk(64);
    let id = id_of(&s.create(json!({"image": base_image(), "timeout": 900})));
    assert!(io_error_pause(&s, &id).is_none());
    assert_eq!(envd_health(&s, &id), 200, "envd answers before");

    // The host has 16 MiB free, the guest writes 64 MiB: QEMU pauses it.
    let filler = fs.fill_about(16 << 20, 1);
    start_guest_write(&s, &id, "/root/big", GUEST_WRITE_MB);
    assert!(
        wait_until(Duration::from_secs(120), || io_error_pause(&s, &id)
            .is_some()),
        "the sandbox is reported paused on an I/O error\n{}",
        s.log()
    );
    (ext, fs, s, id, filler)
}

/// Stops the server of [`paused_on_a_full_disk`]: no VM, sandbox file or namespace is
/// left, and its one start had one stop.
fn stop_leaving_nothing(ext: &Extension, s: &mut Server) {
    s.stop();
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    let starts = ext.requests_for("start-fresh").len();
    assert_eq!(starts, 1);
    assert_eq!(ext.requests_for("stop").len(), 1, "one stop per start");
}

#[test]
fn a_guest_paused_on_a_full_host_disk_is_reported_and_its_calls_answer_507() {
    let _serial = serial();
    let (ext, fs, mut s, id, filler) = paused_on_a_full_disk();
    let pause = io_error_pause(&s, &id).unwrap();
    let msg = pause["message"].as_str().unwrap();
    assert!(msg.contains(&s.state_dir.display().to_string()), "{msg}");
    assert!(pause["since"].as_str().is_some(), "{pause}");
    let (_, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(v["state"], "running", "{v}");
    assert_eq!(
        metric_sample(&s, "agentenv_vms_paused_on_io_error "),
        Some(1.0)
    );
    assert_eq!(
        metric_sample(&s, "agentenv_vm_io_error_pauses_total "),
        Some(1.0)
    );
    assert!(s.log().contains(&format!(
        "sandboxId={id} op=watch result=paused_on_io_error"
    )));

    // Its calls answer 507 at once (the agent is never asked: it cannot answer).
    let command = s.call(
        "POST",
        &format!("/sandboxes/{id}/commands"),
        Some(json!({"cmd": "echo", "args": ["x"]})),
    );
    assert_507(&s, command, "a command of a paused guest");
    assert_eq!(put_file(&s, &id, "/root/while-paused", b"x"), 507);
    let (code, v) = s.call(
        "GET",
        &format!("/sandboxes/{id}/files?path=/etc/hostname"),
        None,
    );
    assert_eq!(code, 507, "{v}");
    assert_eq!(envd_health(&s, &id), 507, "envd through the proxy");
    // A pause cannot be written on a full disk either: it runs on, still paused so.
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(code, 507, "{v}");
    assert!(
        wait_until(Duration::from_secs(10), || io_error_pause(&s, &id)
            .is_some()),
        "still paused on the I/O error"
    );

    let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "{v}");
    std::fs::remove_file(&filler).unwrap();
    stop_leaving_nothing(&ext, &mut s);
    drop(s);
    drop(fs);
}

#[test]
fn a_guest_paused_on_a_full_disk_completes_its_write_intact_once_space_returns() {
    let _serial = serial();
    let (ext, fs, mut s, id, filler) = paused_on_a_full_disk();

    // Space returns: the guest's write completes by itself and the file is intact.
    std::fs::remove_file(&filler).unwrap();
    assert!(
        wait_until(Duration::from_secs(120), || io_error_pause(&s, &id)
            .is_none()),
        "continued once space is back\n{}",
        s.log()
    );
    assert_eq!(
        metric_sample(&s, "agentenv_vms_paused_on_io_error "),
        Some(0.0)
    );
    let done = || {
        let v = s.exec(&id, "cat", &["/root/big.done"]);
        v["exitCode"] == 0
    };
    assert!(
        wait_until(Duration::from_secs(120), done),
        "the guest's write completed"
    );
    let digest = sh(
        &s,
        &id,
        "echo 3 > /proc/sys/vm/drop_caches; md5sum /root/big",
    );
    let want = pattern_digest(GUEST_WRITE_MB);
    assert!(digest.starts_with(&want), "{digest} vs {want}");
    assert_eq!(envd_health(&s, &id), 200, "envd answers again");

    // Paused on an I/O error again, a delete still ends it and leaves nothing.
    let filler = fs.fill_about(16 << 20, 2);
    start_guest_write(&s, &id, "/root/big2", GUEST_WRITE_MB);
    assert!(
        wait_until(Duration::from_secs(120), || io_error_pause(&s, &id)
            .is_some()),
        "paused again\n{}",
        s.log()
    );
    assert_eq!(
        metric_sample(&s, "agentenv_vm_io_error_pauses_total "),
        Some(2.0)
    );
    let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "{v}");
    assert_eq!(
        metric_sample(&s, "agentenv_vms_paused_on_io_error "),
        Some(0.0)
    );
    std::fs::remove_file(&filler).unwrap();
    stop_leaving_nothing(&ext, &mut s);
    drop(s);
    drop(fs);
}

#[test]
fn a_template_build_whose_vm_dies_fails_naming_the_death() {
    let _serial = serial();
    let ext = Extension::start();
    let mut s = Server::start(&ext.config());
    let template = json!({"name": "dies", "image": base_image(), "memoryMB": 256,
        "cpuCount": 1, "diskSizeMB": 1024, "startCmd": "sleep 600"});
    let (code, v) = s.call("POST", "/templates", Some(template));
    assert_eq!(code, 202, "{v}");
    // The build VM runs its start command: kill it.
    let builds = s.state_dir.join("template-builds").display().to_string();
    assert!(
        wait_until(Duration::from_secs(180), || s
            .log()
            .contains("op=launch result=ready")),
        "the build VM booted\n{}",
        s.log()
    );
    let pids = qemu_processes_with(&builds);
    assert_eq!(pids.len(), 1, "{pids:?}");
    host("kill", &["-KILL", &pids[0].to_string()]);

    let failed = || s.call("GET", "/templates/dies", None).1["buildStatus"] == "error";
    assert!(
        wait_until(Duration::from_secs(60), failed),
        "the build failed\n{}",
        s.log()
    );
    let (_, t) = s.call("GET", "/templates/dies", None);
    let reason = t["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("the build VM died on its own") && reason.contains("SIGKILL"),
        "{t}"
    );
    assert_eq!(
        metric_sample(
            &s,
            "agentenv_vm_deaths_total{kind=\"build\",cause=\"SIGKILL\"}"
        ),
        Some(1.0)
    );
    assert!(s.log().contains("result=vm_died kind=build"));
    // Nothing of it is left: no VM, run dir, template files; one stop for its start.
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("template-builds")).is_empty());
    let id = t["templateID"].as_str().unwrap();
    assert!(!s.state_dir.join("snapshots").join(id).exists());
    let stops = ext.requests_for("stop");
    assert_eq!(ext.requests_for("start-fresh").len(), 1);
    assert_eq!(stops.len(), 1, "one stop per start");
    assert_eq!(stops[0].header("X-Agentenv-Stop-Reason"), Some("failure"));
    // The name is free again and the server builds on.
    assert_eq!(s.call("DELETE", "/templates/dies", None).0, 204);
    s.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
}

#[test]
fn a_build_whose_vm_is_paused_on_a_full_disk_fails_at_once_with_507() {
    let _serial = serial();
    // The start command may run for an hour: the build must not wait for that.
    let (ext, fs, mut s) = on_small_disk_with(64, "[templates]\nstart_cmd_timeout_secs = 3600\n");
    // Above the reserve (the build is accepted), but its start command writes more than is
    // free, bypassing the guest's page cache: QEMU pauses the build VM on the full disk.
    let filler = fs.fill_about(160 << 20, 1);
    let write = format!(
        "yes {PATTERN_LINE} | head -c 402653184 | dd of=/root/big bs=1M iflag=fullblock \
         oflag=direct"
    );
    let template = json!({"name": "fills", "image": base_image(), "memoryMB": 256,
        "cpuCount": 1, "diskSizeMB": 1024, "startCmd": write});
    let (code, v) = s.call("POST", "/templates", Some(template));
    assert_eq!(code, 202, "{v}");
    let failed = || s.call("GET", "/templates/fills", None).1["buildStatus"] == "error";
    assert!(
        wait_until(Duration::from_secs(240), failed),
        "the build failed once its VM was paused\n{}",
        s.log()
    );
    let (_, t) = s.call("GET", "/templates/fills", None);
    let reason = t["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains(&format!("the state dir {} is full", s.state_dir.display()))
            && reason.contains(" bytes")
            && reason.contains("QEMU paused the build VM"),
        "{t}"
    );
    assert!(s.log().contains("result=paused_on_io_error"), "{}", s.log());
    assert_eq!(
        metric_sample(&s, "agentenv_vm_io_error_pauses_total "),
        Some(1.0)
    );
    assert_eq!(
        metric_sample(&s, "agentenv_vms_paused_on_io_error "),
        Some(0.0)
    );
    // Nothing of it is left: no VM, build dir or template files; one stop for its start.
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
    assert!(files_under(&s.state_dir.join("template-builds")).is_empty());
    let id = t["templateID"].as_str().unwrap();
    assert!(!s.state_dir.join("snapshots").join(id).exists());
    assert_eq!(ext.requests_for("start-fresh").len(), 1);
    assert_eq!(ext.requests_for("stop").len(), 1, "one stop per start");
    assert_eq!(s.call("DELETE", "/templates/fills", None).0, 204);
    std::fs::remove_file(&filler).unwrap();
    s.stop();
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    drop(s);
    drop(fs);
}
