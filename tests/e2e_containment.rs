//! End-to-end containment against the real server: a 100-character state dir works (QEMU's
//! sockets live elsewhere); each QEMU runs as a uid of its own with agentenv-vm's group, in a mount namespace without the state
//! dir, and after a snapshot no descriptor that can write the frozen layer; a guest flooding its console fills at most two 2 MiB files; one host has one network owner (a second server refuses to
//! start and the first one's sandbox keeps working); a guest agent that breaks the protocol
//! gets its sandbox marked while the server and another sandbox carry on.
//! One server and few cold boots serve every assertion, to keep TCG boots few.

mod common;

use common::*;
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn hostile_hosts_and_guests_are_contained() {
    // A 100-character state dir: QEMU's sockets do not live under it.
    let base = scratch_dir();
    let pad = 100usize.saturating_sub(base.as_os_str().len() + "/state".len());
    let dir = std::path::PathBuf::from(format!("{}{}", base.display(), "x".repeat(pad)));
    let mut server = Server::builder().dir(&dir).configure();
    assert!(server.state_dir.as_os_str().len() >= 100);
    server.spawn();
    let id = sandbox_from_a_template(&server);
    qemu_gets_an_empty_environment(&id);
    qemu_is_unprivileged_and_sees_only_its_own_files(&server, &id);
    frozen_layers_are_read_only_to_qemu(&server, &id);
    console_flood_is_bounded(&server, &id);
    second_server_is_refused(&server, &id);
    guest_protocol_violation_is_contained(&server, &id);
}

/// Root in sandbox A makes its guest agent send an oversized frame (the agent's fault
/// trigger, a file under /run): the server logs the violation, closes A's agent channel
/// and marks A (`guestProtocolViolation`); the server and sandbox B carry on, and A can
/// still be deleted.
fn guest_protocol_violation_is_contained(s: &Server, a: &str) {
    let b = s.create_from("t", 600);
    let detail = |id: &str| s.call("GET", &format!("/sandboxes/{id}"), None).1;
    assert!(detail(a).get("guestProtocolViolation").is_none());
    let v = s.exec(a, "touch", &["/run/agentenv-protocol-fault"]);
    assert_eq!(v["exitCode"], 0, "{v}");
    assert!(
        wait_until(Duration::from_secs(10), || detail(a)
            ["guestProtocolViolation"]
            .is_string()),
        "{}\n{}",
        detail(a),
        s.log()
    );
    let mark = detail(a)["guestProtocolViolation"].to_string();
    assert!(mark.contains("a Data frame of 65537 bytes"), "{mark}");
    let log = s.log();
    assert!(
        log.lines().any(|l| l.contains(&format!("sandboxId={a}"))
            && l.contains("result=guest_protocol_violation")),
        "no log line names the sandbox and the violation:\n{log}"
    );
    // A's channel is closed; the server, B and B's mark are untouched.
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{a}/commands"),
        Some(json!({"cmd": "true"})),
    );
    assert_ne!(code, 200, "{v}");
    assert_eq!(s.exec(&b, "echo", &["b", "runs"])["stdout"], "b runs\n");
    assert!(detail(&b).get("guestProtocolViolation").is_none());
    assert_eq!(s.call("GET", "/sandboxes", None).0, 200);
    for id in [a, b.as_str()] {
        let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(code, 204, "{v}");
    }
}

/// The server's environment (API key, extension token) does not reach QEMU.
fn qemu_gets_an_empty_environment(id: &str) {
    let pids = qemu_processes_with(id);
    assert_eq!(pids.len(), 1, "{pids:?}");
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    assert!(environ.is_empty(), "{}", String::from_utf8_lossy(&environ));
}

/// QEMU runs as a uid of its own (from agentenv-vm's subordinate range; another sandbox's
/// QEMU has another) with agentenv-vm's group, no other groups, no capabilities and
/// no_new_privs, in a mount namespace of its own without the state dir: from inside it, as
/// that uid (and even as root), another sandbox's disk and the state dir cannot be opened;
/// outside it the uid cannot open them either.
fn qemu_is_unprivileged_and_sees_only_its_own_files(s: &Server, id: &str) {
    let other = s.create_from("t", 600);
    let pids = qemu_processes_with(&format!("sandboxes/{id}"));
    assert_eq!(pids.len(), 1, "{pids:?}");
    let pid = pids[0];
    let account = host("id", &["-u", "agentenv-vm"]).trim().to_string();
    let gid = host("id", &["-g", "agentenv-vm"]).trim().to_string();
    assert!(
        !account.is_empty() && account != "0",
        "no agentenv-vm account: run scripts/setup.sh"
    );
    // Each QEMU has a uid of its own from the account's subordinate range.
    let subuid = std::fs::read_to_string("/etc/subuid").unwrap_or_default();
    let (first, count): (u32, u32) = subuid
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() == 3 && (f[0] == "agentenv-vm" || f[0] == account))
                .then(|| (f[1].parse().unwrap(), f[2].parse().unwrap()))
        })
        .expect("agentenv-vm has no subordinate uid range: run scripts/setup.sh");
    let status_of = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field_of = |status: &str, name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let status = status_of(pid);
    let field = |name: &str| field_of(&status, name);
    let uid = field("Uid")[0].clone();
    assert_eq!(field("Uid"), [uid.as_str(); 4], "{status}");
    let n: u32 = uid.parse().unwrap();
    assert!(
        (first..first + count).contains(&n),
        "QEMU runs as {n}, not a uid of agentenv-vm's range {first}+{count}"
    );
    let other_pids = qemu_processes_with(&format!("sandboxes/{other}"));
    assert_eq!(other_pids.len(), 1, "{other_pids:?}");
    let other_uid = field_of(&status_of(other_pids[0]), "Uid");
    assert_ne!(other_uid[0], uid, "two QEMUs share a uid");
    assert_eq!(
        field_of(&status_of(other_pids[0]), "Gid"),
        [gid.as_str(); 4]
    );
    assert_eq!(field("Gid"), [gid.as_str(); 4], "{status}");
    assert!(field("Groups").is_empty(), "{status}");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(field(caps), ["0000000000000000"], "{caps}: {status}");
    }
    assert_eq!(field("NoNewPrivs"), ["1"], "{status}");
    let ns = |p: &str| std::fs::read_link(format!("/proc/{p}/ns/mnt")).unwrap();
    assert_ne!(
        ns(&pid.to_string()),
        ns("self"),
        "QEMU shares the host's mount namespace"
    );

    let other_disk = std::fs::read_dir(s.state_dir.join("sandboxes").join(&other))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "qcow2"))
        .expect("the other sandbox has a qcow2 disk");
    let state_dir = s.state_dir.to_str().unwrap();
    let other_disk = other_disk.to_str().unwrap();
    // `setpriv` argv that runs the rest as QEMU's uid and gid, without groups.
    let as_qemu = [
        "setpriv",
        "--reuid",
        &uid,
        "--regid",
        &gid,
        "--clear-groups",
        "--",
    ];
    // Inside QEMU's namespace, as its account, then as root: neither exists there.
    let inside = |as_vm: bool, args: &[&str]| {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &pid.to_string(), "-m", "--"]);
        if as_vm {
            cmd.args(as_qemu);
        }
        let out = cmd.args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stderr), text(&out.stdout))
    };
    for as_vm in [true, false] {
        for path in [other_disk, state_dir] {
            let (ok, err, _) = inside(as_vm, &["cat", path]);
            assert!(
                !ok && err.contains("No such file"),
                "as_vm={as_vm} {path}: {err}"
            );
        }
    }
    // All its namespace holds: system files, a few devices, its kernel, initramfs and RAM
    // file; nothing writable.
    let (ok, err, listed) = inside(false, &["ls", "-A", "/", "/dev", "/vm"]);
    assert!(ok, "{err}");
    // The /lib* links vary between distributions.
    let listed: Vec<&str> = listed
        .split_whitespace()
        .filter(|n| !n.starts_with("lib"))
        .collect();
    assert_eq!(
        listed,
        [
            "/:",
            "dev",
            "etc",
            "usr",
            "vm",
            "/dev:",
            "null",
            "random",
            "urandom",
            "zero",
            "/vm:",
            "initramfs",
            "kernel",
            "memory"
        ],
        "{listed:?}"
    );
    for path in ["/usr/x", "/x", "/vm/x"] {
        let (ok, err, _) = inside(true, &["touch", path]);
        assert!(!ok, "{path}: {err}");
    }
    // Outside the namespace the account is kept out of the state dir by its mode.
    let outside = Command::new(as_qemu[0])
        .args(&as_qemu[1..])
        .args(["cat", other_disk])
        .output()
        .unwrap();
    assert!(
        !outside.status.success()
            && String::from_utf8_lossy(&outside.stderr).contains("Permission denied"),
        "{outside:?}"
    );
    let (code, v) = s.call("DELETE", &format!("/sandboxes/{other}"), None);
    assert_eq!(code, 204, "{v}");
}

/// A snapshot freezes the sandbox's top layer under a new one: afterwards QEMU holds no
/// descriptor that can write the frozen layer (it stays open read-only); the only disk
/// file open for writing is the new top.
fn frozen_layers_are_read_only_to_qemu(s: &Server, id: &str) {
    let pids = qemu_processes_with(&format!("sandboxes/{id}"));
    assert_eq!(pids.len(), 1, "{pids:?}");
    let pid = pids[0];
    let writable = |disks: &[(String, bool)]| {
        let mut w: Vec<String> = disks.iter().filter(|d| d.1).map(|d| d.0.clone()).collect();
        w.dedup();
        w
    };
    let before = open_disks(pid);
    let top = writable(&before[..]);
    assert_eq!(top.len(), 1, "{before:?}");
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/snapshots"), None);
    assert_eq!(code, 201, "{v}");
    let after = open_disks(pid);
    let new_top = writable(&after[..]);
    assert_eq!(new_top.len(), 1, "{after:?}");
    assert_ne!(
        new_top, top,
        "the frozen layer is still writable: {after:?}"
    );
    assert!(
        after.iter().any(|(p, w)| *p == top[0] && !w),
        "the frozen layer is not open read-only: {after:?}"
    );
    assert_eq!(s.exec(id, "echo", &["runs"])["stdout"], "runs\n");
}

/// The qcow2 files process `pid` has open, one entry per descriptor, sorted, with whether
/// that descriptor can write (its fdinfo flags).
fn open_disks(pid: u32) -> Vec<(String, bool)> {
    let mut disks = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        if !target.ends_with(".qcow2") {
            continue;
        }
        let fd = entry.file_name().to_string_lossy().into_owned();
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        disks.push((target, flags & 3 != 0));
    }
    disks.sort();
    disks
}

/// `yes … > /dev/console` in a guest: the console log rotates at 2 MiB and keeps one
/// older file, whatever the guest writes.
fn console_flood_is_bounded(s: &Server, id: &str) {
    const FLOOD: u64 = 6 * 1024 * 1024;
    const FILE_MAX: u64 = 2 * 1024 * 1024;
    let log = s.state_dir.join("sandboxes").join(id).join("console.log");
    let rotated = log.with_file_name("console.log.1");
    assert!(log.is_file(), "no console log at {}", log.display());
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/commands"),
        Some(json!({"cmd": "sh", "args": ["-c",
            format!("yes console-flood-console-flood | head -c {FLOOD} > /dev/console; echo done")],
            "timeoutMs": 300_000})),
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["stdout"], "done\n", "{v}");
    let size = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    // The writer thread may still drain the pipe's last bytes.
    assert!(
        wait_until(Duration::from_secs(10), || size(&rotated) == FILE_MAX),
        "console.log.1 is {} bytes",
        size(&rotated)
    );
    assert!(
        size(&log) <= FILE_MAX,
        "console.log is {} bytes",
        size(&log)
    );
    let names: Vec<_> = std::fs::read_dir(log.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("console"))
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let v = s.exec(id, "echo", &["alive"]);
    assert_eq!(v["stdout"], "alive\n", "{v}");
}

/// A template build (a cold boot and a capture) and a sandbox cloned from it.
fn sandbox_from_a_template(s: &Server) -> String {
    let (code, t) = s.call(
        "POST",
        "/templates",
        Some(
            json!({"name": "t", "image": base_image(), "memoryMB": 256, "cpuCount": 1,
                    "diskSizeMB": 1024, "startCmd": "echo built > /root/built"}),
        ),
    );
    assert_eq!(code, 202, "{t}");
    let status = || s.call("GET", "/templates/t", None).1;
    assert!(
        wait_until(Duration::from_secs(120), || {
            ["ready", "error"].contains(&status()["buildStatus"].as_str().unwrap_or(""))
        }),
        "{}",
        status()
    );
    assert_eq!(
        status()["buildStatus"],
        "ready",
        "{}\n{}",
        status(),
        s.log()
    );
    let id = s.create_from("t", 600);
    assert_eq!(s.exec(&id, "cat", &["/root/built"])["stdout"], "built\n");
    id
}

/// A second server on the host, with its own state dir, exits non-zero with a message
/// naming the host lock, and leaves the first one's network and sandbox alone.
fn second_server_is_refused(first: &Server, id: &str) {
    let netns_before = netns_files();
    assert!(!netns_before.is_empty());
    let second = Server::builder().configure();
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentenv"))
        .args(["serve", "--config"])
        .arg(&second.config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status =
        wait_exit(&mut child, deadline).expect("a second server kept running next to the first");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("another agentenv server runs on this host")
            && stderr.contains("/run/agentenv/server.lock"),
        "{stderr}"
    );
    assert!(
        !second.state_dir.exists(),
        "the refused server wrote its state dir"
    );
    let _ = std::fs::remove_dir_all(second.state_dir.parent().unwrap());
    assert_eq!(netns_files(), netns_before);
    let v = first.exec(id, "echo", &["still", "here"]);
    assert_eq!(v["stdout"], "still here\n", "{v}");
}
