//! End-to-end: real VMs in real network slots behind the real server binary. Two cold
//! boots serve every assertion (commands, files, cmdline, routing, isolation, layered
//! image, delete, expiry, shutdown), to keep TCG boots few.

mod common;

use common::registry::{Auth, TestLayer, TestRegistry};
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

#[test]
fn sandboxes_end_to_end() {
    let mut server = Server::start("");
    let layout = layered_test_image(&server.state_dir.parent().unwrap().join("layered"));
    let registry = TestRegistry::start(Auth::Anonymous);
    let pulled = push_layered_image(&registry);
    let (a, b, c) = std::thread::scope(|sc| {
        let s = &server;
        let pulled = &pulled;
        let a = sc.spawn(move || {
            s.create(json!({
                "image": base_image(),
                "metadata": {"role": "a"},
                "envVars": {"GREETING": "hello"},
                "timeout": 600,
                "autoPause": false,
            }))
        });
        let b = sc.spawn(move || {
            s.create(json!({"image": format!("oci:{}:v1", layout.display()), "timeout": 600}))
        });
        let c = sc.spawn(move || s.create(json!({"image": pulled, "timeout": 600})));
        (a.join().unwrap(), b.join().unwrap(), c.join().unwrap())
    });
    // Cold start from a real registry on loopback: the guest sees the image's files.
    let c_id = c["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(c["templateID"], pulled);
    let v = server.exec(&c_id, "cat", &["/etc/layer2.txt", "/etc/kept.txt"]);
    assert_eq!(v["stdout"], "from layer two\nkept\n", "{v}");
    let v = server.exec(&c_id, "ls", &["/etc/removed.txt"]);
    assert_ne!(v["exitCode"], 0, "whiteout from the registry image: {v}");
    assert_eq!(
        server.call("DELETE", &format!("/sandboxes/{c_id}"), None).0,
        204
    );
    drop(registry);
    let a_id = a["sandboxID"].as_str().unwrap().to_string();
    let b_id = b["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(a["templateID"], base_image());
    assert_eq!(a["clientID"], "");
    assert_eq!(a["envdVersion"], "0.6.4");

    commands(&server, &a_id);
    guest_cmdline(&server, &a_id);
    files(&server, &a_id);
    layered_image(&server, &b_id);
    listing(&server, &a_id, &b_id);
    let a_ip = detail(&server, &a_id)["hostInteractionIp"]
        .as_str()
        .unwrap()
        .to_string();
    let b_ip = detail(&server, &b_id)["hostInteractionIp"]
        .as_str()
        .unwrap()
        .to_string();
    host_reaches_guest(&a_ip);
    envd_runs_bash_as_user(&a_ip);
    host_reaches_guest(&b_ip);
    guests_are_isolated(&server, &a_id, &a_ip, &b_ip);
    delete_leaves_nothing(&server, &a_id);
    expiry_pauses(&server, &b_id);

    server.stop();
    assert!(
        netns_files().is_empty(),
        "netns left after shutdown: {:?}",
        netns_files()
    );
    assert!(
        aenv_links().is_empty(),
        "links left after shutdown: {:?}",
        aenv_links()
    );
    assert!(qemu_processes_with(&server.state_dir.display().to_string()).is_empty());
    let table = std::process::Command::new("nft")
        .args(["list", "table", "inet", "agentenv"])
        .output()
        .unwrap();
    assert!(!table.status.success(), "root table left after shutdown");
}

fn detail(s: &Server, id: &str) -> Value {
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{v}");
    v
}

fn commands(s: &Server, id: &str) {
    let v = s.exec(id, "echo", &["hello", "world"]);
    assert_eq!(v["stdout"], "hello world\n", "{v}");
    assert_eq!(v["exitCode"], 0);
    assert_eq!(v["timedOut"], false);
    let v = s.exec(id, "sh", &["-c", "echo oops >&2; exit 3"]);
    assert_eq!(v["exitCode"], 3, "{v}");
    assert_eq!(v["stderr"], "oops\n");
    let v = s.exec(id, "sh", &["-c", "echo $GREETING"]);
    assert_eq!(
        v["stdout"], "hello\n",
        "sandbox envVars reach commands: {v}"
    );
    let v = s.exec(id, "no-such-program", &[]);
    assert_eq!(v["exitCode"], 127, "{v}");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/commands"),
        Some(json!({"cmd": "sleep", "args": ["30"], "timeoutMs": 500})),
    );
    assert_eq!(code, 200);
    assert_eq!(v["timedOut"], true, "{v}");
    assert_eq!(v["exitCode"], 137);
    let (code, _) = s.call(
        "POST",
        &format!("/sandboxes/{id}/commands"),
        Some(json!({"cmd": "true", "cwd": "relative"})),
    );
    assert_eq!(code, 400);
}

fn guest_cmdline(s: &Server, id: &str) {
    let v = s.exec(id, "cat", &["/proc/cmdline"]);
    let cmdline = v["stdout"].as_str().unwrap();
    assert!(cmdline.contains("console=ttyS0"), "{cmdline}");
    // agentenv's own arguments come last: the agent port, and the guest's resolver (the
    // slot's DNS forwarder, since outbound access is on by default).
    assert!(
        cmdline
            .trim_end()
            .ends_with("agentenv.port=49983 agentenv.dns=169.254.0.22"),
        "{cmdline}"
    );
    let v = s.exec(id, "ip", &["-4", "addr", "show", "eth0"]);
    assert!(
        v["stdout"].as_str().unwrap().contains("169.254.0.21/30"),
        "{v}"
    );
}

fn files(s: &Server, id: &str) {
    let mut data = vec![0u8; 5 * 1024 * 1024];
    let mut x: u32 = 0x1234_5678;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = x as u8;
    }
    let url = format!("{}/sandboxes/{id}/files?path=/data/dir/blob.bin", s.base);
    let resp = ureq::put(&url)
        .set("X-API-Key", API_KEY)
        .set("Content-Type", "application/octet-stream")
        .send_bytes(&data)
        .unwrap();
    assert_eq!(resp.status(), 204);
    let resp = ureq::get(&url).set("X-API-Key", API_KEY).call().unwrap();
    assert_eq!(
        resp.header("Content-Type"),
        Some("application/octet-stream")
    );
    let mut back = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut back).unwrap();
    assert!(
        back == data,
        "5 MiB round trip differs ({} bytes back)",
        back.len()
    );
    let v = s.exec(id, "stat", &["-c", "%a %u", "/data/dir/blob.bin"]);
    assert_eq!(v["stdout"], "644 0\n", "{v}");
    let (code, v) = s.call(
        "GET",
        &format!("/sandboxes/{id}/files?path=/no/such/file"),
        None,
    );
    assert_eq!(code, 404, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("/no/such/file"),
        "{v}"
    );
    let (code, _) = s.call("GET", &format!("/sandboxes/{id}/files?path=/etc"), None);
    assert_eq!(code, 400);
    let (code, _) = s.call("GET", &format!("/sandboxes/{id}/files?path=relative"), None);
    assert_eq!(code, 400);
    let (code, _) = s.call("GET", &format!("/sandboxes/{id}/files"), None);
    assert_eq!(code, 400);
}

fn layered_image(s: &Server, id: &str) {
    let v = s.exec(id, "cat", &["/etc/layer2.txt"]);
    assert_eq!(v["stdout"], "from layer two\n", "{v}");
    let v = s.exec(id, "cat", &["/etc/kept.txt"]);
    assert_eq!(v["stdout"], "kept\n", "{v}");
    let v = s.exec(id, "ls", &["/etc/removed.txt"]);
    assert_ne!(v["exitCode"], 0, "whiteout must hide the file: {v}");
    let v = s.exec(id, "sh", &["-c", "echo $FROM_IMAGE"]);
    assert_eq!(v["stdout"], "yes\n", "image Env reaches commands: {v}");
}

fn listing(s: &Server, a: &str, b: &str) {
    let (_, v) = s.call("GET", "/v2/sandboxes", None);
    let ids: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["sandboxID"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&a) && ids.contains(&b), "{v}");
    let (_, v) = s.call("GET", "/v2/sandboxes?metadata=role%3Da", None);
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");
    assert_eq!(v[0]["sandboxID"], a);
    assert_eq!(v[0]["state"], "running");
    let resp = ureq::get(&format!("{}/v2/sandboxes?limit=1", s.base))
        .set("X-API-Key", API_KEY)
        .call()
        .unwrap();
    let token = resp.header("X-Next-Token").expect("next token").to_string();
    let first: Value = resp.into_json().unwrap();
    let (_, second) = s.call(
        "GET",
        &format!("/v2/sandboxes?limit=1&nextToken={token}"),
        None,
    );
    assert_eq!(second.as_array().unwrap().len(), 1);
    assert_ne!(first[0]["sandboxID"], second[0]["sandboxID"]);
    let d = detail(s, a);
    assert_eq!(d["lifecycle"]["onTimeout"], "kill");
    assert_eq!(d["cpuCount"], 1);
    assert_eq!(d["memoryMB"], 256);
    assert_eq!(d["metadata"]["role"], "a");
    assert!(d["startedAt"].as_str().unwrap().ends_with('Z'));
}

fn host_reaches_guest(ip: &str) {
    let resp = ureq::get(&format!("http://{ip}:49983/health"))
        .timeout(Duration::from_secs(5))
        .call()
        .unwrap_or_else(|e| panic!("host cannot reach guest agent at {ip}: {e}"));
    assert_eq!(resp.status(), 200);
}

/// The guest's envd (what the E2B SDKs reach through the host proxy) runs a command the
/// way `commands.run` does: /bin/bash from the base image, as E2B's `user`, in its home.
fn envd_runs_bash_as_user(ip: &str) {
    let msg = json!({
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo $BASH_VERSION; whoami; pwd"]},
        "stdin": false,
    })
    .to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg.as_bytes());
    let resp = ureq::post(&format!("http://{ip}:49983/process.Process/Start"))
        .set("Content-Type", "application/connect+json")
        .timeout(Duration::from_secs(20))
        .send_bytes(&body)
        .unwrap_or_else(|e| panic!("envd Start on {ip}: {e}"));
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut raw).unwrap();
    let (mut stdout, mut rest, mut end) = (String::new(), &raw[..], Value::Null);
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let v: Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
        if let Some(out) = v["event"]["data"]["stdout"].as_str() {
            use base64::Engine;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(out)
                .unwrap();
            stdout.push_str(&String::from_utf8_lossy(&bytes));
        }
        if v["event"].get("end").is_some() {
            end = v["event"]["end"].clone();
        }
        rest = &rest[5 + len..];
    }
    assert_eq!(end["exitCode"], 0, "{}", String::from_utf8_lossy(&raw));
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("5.2"), "{stdout}");
    assert_eq!(&lines[1..], ["user", "/home/user"], "{stdout}");
}

fn guests_are_isolated(s: &Server, from: &str, own_ip: &str, other_ip: &str) {
    // The other sandbox's agent is reachable from the host (checked above) but not from
    // this guest; nor is the API port on the host end of this slot's veth
    // (veth_cidr + 2n, network.md §2.3), nor on the tap gateway.
    let api_port = s.base.rsplit(':').next().unwrap();
    let n: u32 = own_ip.rsplit('.').next().unwrap().parse().unwrap();
    let host_end = format!("198.19.{}.{}", (2 * n) / 256, (2 * n) % 256);
    let targets = [
        (other_ip.to_string(), "49983".to_string()),
        (host_end, api_port.to_string()),
        ("169.254.0.22".to_string(), api_port.to_string()),
    ];
    // Positive control: the same probe reaches the guest's own agent.
    let own = http_probe(s, from, "127.0.0.1", "49983");
    assert!(
        own.contains("200 OK"),
        "probe does not work inside the guest: {own}"
    );
    // The firewall rejects a refused connection with a TCP reset (network.md §5.8), so
    // the probe sees "refused" at once: never an HTTP answer, and never a time-out (that
    // would be a drop, which the firewall does not do). The other guest's agent listens
    // on its port, so its "refused" is the firewall's.
    for (ip, port) in targets {
        let out = http_probe(s, from, &ip, &port);
        assert!(
            !out.contains("HTTP/") && out.contains("Connection refused"),
            "guest reached {ip}:{port}, or was not refused by a reset: {out}"
        );
    }
    let v = s.exec(from, "ping", &["-c", "1", "-W", "1", other_ip]);
    let out = v["stdout"].as_str().unwrap();
    assert!(
        out.contains("100% packet loss"),
        "guest pinged {other_ip}: {v}"
    );
}

/// An HTTP GET from inside the guest with busybox `nc` (2 s timeout); stdout + stderr.
fn http_probe(s: &Server, id: &str, ip: &str, port: &str) -> String {
    let script = format!("printf 'GET /health HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} {port}");
    let v = s.exec(id, "sh", &["-c", &script]);
    format!(
        "{}{}",
        v["stdout"].as_str().unwrap(),
        v["stderr"].as_str().unwrap()
    )
}

fn delete_leaves_nothing(s: &Server, id: &str) {
    let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "{v}");
    let (code, _) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404);
    let (code, _) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 404);
    assert!(
        qemu_processes_with(id).is_empty(),
        "qemu of {id} still running"
    );
    assert!(!s.state_dir.join("sandboxes").join(id).exists());
    let log = s.log();
    assert!(
        log.contains(&format!("sandboxId={id} op=delete")),
        "delete logged"
    );
}

/// `autoPause: true` (the default): expiry pauses; the paused sandbox is then deleted
/// without a VM.
fn expiry_pauses(s: &Server, id: &str) {
    let (code, _) = s.call(
        "POST",
        &format!("/sandboxes/{id}/timeout"),
        Some(json!({"timeout": 0})),
    );
    assert_eq!(code, 204);
    assert!(
        wait_until(Duration::from_secs(10), || s
            .call("GET", &format!("/sandboxes/{id}"), None)
            .1["state"]
            == "paused"),
        "sandbox did not expire into paused"
    );
    assert!(wait_until(Duration::from_secs(10), || qemu_processes_with(
        id
    )
    .is_empty()));
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    assert_eq!(s.call("GET", &format!("/sandboxes/{id}"), None).0, 404);
    assert!(!s.state_dir.join("sandboxes").join(id).exists());
}

/// The layers of the test image: busybox and three files, then one file more and a
/// whiteout of another.
fn test_layers() -> (Vec<u8>, Vec<u8>) {
    use agentenv::image::LayerBuilder;
    let busybox = std::fs::read("/bin/busybox").unwrap();
    let mut one = LayerBuilder::new();
    one.dir("bin", 0o755).file("bin/busybox", 0o755, &busybox);
    for applet in [
        "sh", "cat", "ls", "echo", "stat", "wget", "ip", "sleep", "ping", "true",
    ] {
        one.symlink(&format!("bin/{applet}"), "busybox");
    }
    one.dir("etc", 0o755)
        .file("etc/kept.txt", 0o644, b"kept\n")
        .file("etc/removed.txt", 0o644, b"removed\n");
    for d in ["proc", "sys", "dev", "tmp", "run"] {
        one.dir(d, 0o755);
    }
    let mut two = LayerBuilder::new();
    two.file("etc/layer2.txt", 0o644, b"from layer two\n")
        .whiteout("etc/removed.txt");
    (one.finish(), two.finish())
}

/// A two-layer OCI layout of [`test_layers`]; the config sets an env var.
fn layered_test_image(dir: &std::path::Path) -> std::path::PathBuf {
    use agentenv::image::{ImageSpec, LayerBlob, LayoutWriter};
    let (one, two) = test_layers();
    let mut writer = LayoutWriter::create(dir).unwrap();
    let spec = ImageSpec {
        env: vec!["PATH=/bin".into(), "FROM_IMAGE=yes".into()],
        ..ImageSpec::default()
    };
    let desc = writer
        .add_image(&spec, &[LayerBlob::gzip(one), LayerBlob::plain(two)])
        .unwrap();
    writer.tag(desc, Some("v1"));
    writer.finish().unwrap();
    dir.to_path_buf()
}

/// Pushes [`test_layers`] to the registry as `layered:v1` (a gzip and an uncompressed
/// layer); returns the reference to create from.
fn push_layered_image(registry: &TestRegistry) -> String {
    let (one, two) = test_layers();
    let image = registry.push_image(
        "layered",
        "amd64",
        "/",
        &[
            TestLayer {
                tar: one,
                gzip: true,
            },
            TestLayer {
                tar: two,
                gzip: false,
            },
        ],
        false,
    );
    registry.tag("layered", "v1", &image);
    format!("{}/layered:v1", registry.addr)
}
