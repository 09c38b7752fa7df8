//! End-to-end egress (network.md §5.4, §5.5): an "internet" network namespace holding
//! documentation addresses (203.0.113.0/24 with an HTTP server and a DNS server, plus two
//! CGNAT addresses that stand for private ranges), routed from the host only while the
//! test runs. Real guests reach it by IP and by name through the DNS forwarder; a sandbox
//! created with `allowInternetAccess: false` does not; the host, other sandboxes and
//! denied ranges stay refused; per-sandbox allowOut/denyOut change live with PUT; choices
//! survive pause/resume. Two cold boots.

mod common;

use common::*;
use serde_json::json;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const NS: &str = "egress-inet";
/// Root end of the link to the "internet" (never named `aenv-*`: that is agentenv's).
const LINK: &str = "egrinet0";
const ROOT_END: &str = "198.51.100.1";
const NS_END: &str = "198.51.100.2";
const WEB: &str = "203.0.113.10";
const DNS: &str = "203.0.113.53";
/// In 100.64.0.0/10 (denied by default) and not allowed.
const PRIVATE_DENIED: &str = "100.127.255.1";
/// In 100.64.0.0/10 and named by the operator's `outbound_allowed_cidrs`.
const PRIVATE_ALLOWED: &str = "100.127.255.2";
const NAME: &str = "web.egress.test";
const PAGE: &str = "hello from the test internet";

/// The DNS server of the test internet: A records for `web.egress.test`, NXDOMAIN for
/// everything else; every question it receives is appended to the log file.
const DNS_SERVER: &str = r#"
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
log = open(sys.argv[2], "a", buffering=1)
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 12:
        continue
    i, labels = 12, []
    while i < len(q) and q[i] != 0:
        labels.append(q[i + 1:i + 1 + q[i]].decode("ascii", "replace"))
        i += 1 + q[i]
    name, qtype = ".".join(labels).lower(), struct.unpack(">H", q[i + 1:i + 3])[0]
    question = q[12:i + 5]
    log.write("%s %d %s\n" % (name, qtype, peer[0]))
    found = name == sys.argv[3] and qtype == 1
    flags = 0x8180 if found or name == sys.argv[3] else 0x8183
    head = q[:2] + struct.pack(">HHHHH", flags, 1, 1 if found else 0, 0, 0)
    answer = b""
    if found:
        answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + socket.inet_aton(sys.argv[4])
    s.sendto(head + question + answer, peer)
"#;

/// The test internet; dropping it kills its servers and deletes the namespace, which
/// removes the link and the host routes through it (also on panic).
struct Internet {
    servers: Vec<Child>,
    dns_log: PathBuf,
    dir: PathBuf,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Internet {
    fn start() -> Internet {
        // Leftovers of an aborted run.
        let _ = Command::new("ip").args(["netns", "del", NS]).output();
        let _ = Command::new("ip").args(["link", "del", LINK]).output();
        let dir = scratch_dir();
        std::fs::create_dir_all(dir.join("www")).unwrap();
        std::fs::write(dir.join("www/index.html"), PAGE).unwrap();
        let mut net = Internet {
            servers: Vec::new(),
            dns_log: dir.join("dns.log"),
            dir,
        };
        ip(&["netns", "add", NS]);
        ip(&[
            "link", "add", LINK, "type", "veth", "peer", "name", "eth0", "netns", NS,
        ]);
        ip(&["addr", "add", &format!("{ROOT_END}/30"), "dev", LINK]);
        ip(&["link", "set", LINK, "up"]);
        let nsip = |args: &[&str]| {
            let mut v = vec!["-n", NS];
            v.extend_from_slice(args);
            ip(&v)
        };
        nsip(&["link", "set", "lo", "up"]);
        nsip(&["addr", "add", &format!("{NS_END}/30"), "dev", "eth0"]);
        nsip(&["link", "set", "eth0", "up"]);
        for a in [WEB, DNS, PRIVATE_DENIED, PRIVATE_ALLOWED] {
            nsip(&["addr", "add", &format!("{a}/32"), "dev", "lo"]);
        }
        nsip(&["route", "add", "default", "via", ROOT_END]);
        ip(&["route", "add", "203.0.113.0/24", "via", NS_END, "dev", LINK]);
        ip(&[
            "route",
            "add",
            "100.127.255.0/30",
            "via",
            NS_END,
            "dev",
            LINK,
        ]);
        let www = net.dir.join("www");
        net.spawn(&[
            "python3",
            "-m",
            "http.server",
            "80",
            "--bind",
            "0.0.0.0",
            "--directory",
            www.to_str().unwrap(),
        ]);
        let script = net.dir.join("dns.py");
        std::fs::write(&script, DNS_SERVER).unwrap();
        let log = net.dns_log.clone();
        net.spawn(&[
            "python3",
            script.to_str().unwrap(),
            DNS,
            log.to_str().unwrap(),
            NAME,
            WEB,
        ]);
        // Both answer from the host before any guest asks.
        let ready = wait_until(Duration::from_secs(20), || {
            host(
                "wget",
                &["-q", "-T", "1", "-O", "-", &format!("http://{WEB}/")],
            )
            .contains(PAGE)
        });
        assert!(ready, "the test internet's HTTP server did not come up");
        net
    }

    fn spawn(&mut self, argv: &[&str]) {
        let child = Command::new("ip")
            .args(["netns", "exec", NS, "/usr/bin/env"])
            .args(argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
    }

    fn dns_questions(&self) -> String {
        std::fs::read_to_string(&self.dns_log).unwrap_or_default()
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip").args(["netns", "del", NS]).output();
        let _ = Command::new("ip").args(["link", "del", LINK]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `script` in the guest; (exit code, stdout + stderr).
fn guest(s: &Server, id: &str, script: &str) -> (i64, String) {
    let v = s.exec(id, "sh", &["-c", script]);
    let out = format!(
        "{}{}",
        v["stdout"].as_str().unwrap_or(""),
        v["stderr"].as_str().unwrap_or("")
    );
    (v["exitCode"].as_i64().unwrap_or(-1), out)
}

/// An HTTP GET of `http://<target>/` from the guest with busybox `nc` (3 s timeout). A
/// name is resolved with busybox `nslookup` (the static busybox's libc lookups do not work
/// in the bare guest), and the connection goes to the address it printed.
fn fetch(s: &Server, id: &str, target: &str) -> (i64, String) {
    let addr = if target.parse::<std::net::Ipv4Addr>().is_ok() {
        target.to_string()
    } else {
        format!("$(nslookup {target} | sed -n 's/^Address: *//p' | tail -n 1)")
    };
    guest(
        s,
        id,
        &format!(
            "a={addr}; printf 'GET / HTTP/1.0\\r\\nHost: {target}\\r\\n\\r\\n' | nc -w 3 \"$a\" 80"
        ),
    )
}

fn assert_reaches(s: &Server, id: &str, target: &str) {
    let (code, out) = fetch(s, id, target);
    assert!(
        code == 0 && out.contains(PAGE),
        "{id} did not reach {target}: {code} {out}\n{}",
        s.log()
    );
}

fn assert_refused(s: &Server, id: &str, target: &str) {
    let (code, out) = fetch(s, id, target);
    assert!(
        code != 0 && !out.contains(PAGE),
        "{id} reached {target}: {out}"
    );
}

/// A TCP connection from the guest to `ip:port` (busybox nc, 2 s); whether it opened.
fn tcp_opens(s: &Server, id: &str, ip: &str, port: &str) -> bool {
    let (_, out) = guest(
        s,
        id,
        &format!("printf 'GET /health HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} {port}"),
    );
    out.contains("HTTP/")
}

fn host_ip_of(s: &Server, id: &str) -> String {
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 200, "{v}");
    v["hostInteractionIp"].as_str().unwrap().to_string()
}

/// The host's own address on its default route (e.g. eth0's), where nothing of the host
/// may be reached from a guest.
fn host_primary_address() -> String {
    let out = host("ip", &["-4", "route", "get", "192.0.2.255"]);
    let mut words = out.split_whitespace();
    while let Some(w) = words.next() {
        if w == "src" {
            return words.next().unwrap().to_string();
        }
    }
    panic!("no source address in {out:?}");
}

#[test]
fn guests_reach_the_internet_by_default_and_nothing_of_the_host() {
    let net = Internet::start();
    let s = Server::start(&format!(
        "outbound = true\ndns = \"{DNS}\"\noutbound_allowed_cidrs = [\"{PRIVATE_ALLOWED}/32\"]\n"
    ));
    let (open, closed) = std::thread::scope(|sc| {
        let open = sc.spawn(|| s.create(json!({"image": base_image(), "timeout": 600})));
        let closed = sc.spawn(|| {
            s.create(json!({"image": base_image(), "timeout": 600,
                            "allowInternetAccess": false}))
        });
        (id_of(&open.join().unwrap()), id_of(&closed.join().unwrap()))
    });

    // By IP and by name: the guest's resolver is its gateway, which forwards to the
    // configured upstream (the test internet's DNS server saw the question).
    assert_reaches(&s, &open, WEB);
    let (_, resolv) = guest(&s, &open, "cat /etc/resolv.conf");
    assert!(resolv.contains("nameserver 169.254.0.22"), "{resolv}");
    let (code, out) = guest(&s, &open, &format!("nslookup {NAME}"));
    assert!(code == 0 && out.contains(WEB), "nslookup: {code} {out}");
    assert!(
        net.dns_questions().contains(NAME),
        "the upstream saw no question: {}",
        net.dns_questions()
    );
    assert_reaches(&s, &open, NAME);
    // Denied ranges stay refused unless the operator's allow list names them.
    assert_refused(&s, &open, PRIVATE_DENIED);
    assert_reaches(&s, &open, PRIVATE_ALLOWED);

    // Nothing of the host, whatever address: its primary address, its end of the test
    // link, its end of the slot's veth, the gateway; nor another sandbox.
    let api_port = s.base.rsplit(':').next().unwrap().to_string();
    let n: u32 = host_ip_of(&s, &open)
        .rsplit('.')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let veth_end = format!("198.19.{}.{}", (2 * n) / 256, (2 * n) % 256);
    assert!(tcp_opens(&s, &open, "127.0.0.1", "49983"), "probe control");
    for target in [host_primary_address(), ROOT_END.to_string(), veth_end] {
        assert!(
            !tcp_opens(&s, &open, &target, &api_port),
            "guest reached the API at {target}"
        );
    }
    assert!(!tcp_opens(&s, &open, "169.254.0.22", &api_port));
    assert!(
        !tcp_opens(&s, &open, "169.254.0.22", "53"),
        "TCP to the forwarder"
    );
    assert!(!tcp_opens(&s, &open, &host_ip_of(&s, &closed), "49983"));

    // allowInternetAccess: false → neither the internet nor names.
    closed_is_closed(&s, &net, &closed);
    // The choice survives pause and resume (into whichever slot the pool hands out).
    let (code, v) = s.call("POST", &format!("/sandboxes/{closed}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{closed}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert!(code == 200 || code == 201, "{code} {v}");
    closed_is_closed(&s, &net, &closed);
    policy_changes_live(&s, &open);
}

fn put_network(s: &Server, id: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    s.call("PUT", &format!("/sandboxes/{id}/network"), Some(body))
}

/// `PUT …/network` replaces the policy of a running guest at once (no restart: the same
/// boot id before and after), GET shows it, it survives pause/resume, and bad entries
/// or unbuilt fields are 400s naming them.
fn policy_changes_live(s: &Server, id: &str) {
    let (_, boot) = guest(s, id, "cat /proc/sys/kernel/random/boot_id");
    let (code, v) = put_network(s, id, json!({"denyOut": ["203.0.113.0/24"]}));
    assert_eq!(code, 204, "{v}");
    assert_refused(s, id, WEB);
    assert_reaches(s, id, PRIVATE_ALLOWED);
    // Allowed entries win over denied ones.
    let (code, v) = put_network(s, id, json!({"allowOut": [WEB], "denyOut": ["0.0.0.0/0"]}));
    assert_eq!(code, 204, "{v}");
    assert_reaches(s, id, WEB);
    assert_refused(s, id, PRIVATE_ALLOWED);
    let (_, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(
        v["network"]["allowOut"],
        json!([format!("{WEB}/32")]),
        "{v}"
    );
    assert_eq!(v["network"]["denyOut"], json!(["0.0.0.0/0"]), "{v}");
    let (_, after) = guest(s, id, "cat /proc/sys/kernel/random/boot_id");
    assert_eq!(boot, after, "the guest restarted");

    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert!(code == 200 || code == 201, "{code} {v}");
    assert_reaches(s, id, WEB);
    assert_refused(s, id, PRIVATE_ALLOWED);

    for (body, says) in [
        (json!({"denyOut": ["nope"]}), "denyOut[0] \"nope\""),
        (json!({"allowOut": ["example.com"]}), "domain entries"),
        (json!({"rules": {"a.example.com": []}}), "field rules"),
        (
            json!({"egressProxy": {"address": "p:1080"}}),
            "field egressProxy",
        ),
    ] {
        let (code, v) = put_network(s, id, body.clone());
        assert_eq!(code, 400, "{body}: {v}");
        assert!(v["message"].as_str().unwrap().contains(says), "{body}: {v}");
    }
    let (code, v) = s.call(
        "POST",
        "/sandboxes-cold",
        Some(json!({"image": base_image(), "network": {"httpsPorts": [3000]}})),
    );
    assert_eq!(code, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("network.httpsPorts"),
        "{v}"
    );
    // An empty policy opens everything the server allows again.
    let (code, v) = put_network(s, id, json!({}));
    assert_eq!(code, 204, "{v}");
    assert_reaches(s, id, PRIVATE_ALLOWED);
    assert_eq!(
        put_network(s, "0190a0b0-0000-7000-8000-000000000000", json!({})).0,
        404
    );
}

fn closed_is_closed(s: &Server, net: &Internet, id: &str) {
    assert_refused(s, id, WEB);
    let before = net.dns_questions().lines().count();
    let (code, out) = guest(s, id, "nslookup closed.egress.test");
    assert!(code != 0, "a closed sandbox resolved a name: {out}");
    assert_eq!(
        net.dns_questions().lines().count(),
        before,
        "its query went out"
    );
}
