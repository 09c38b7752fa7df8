//! End-to-end egress (network.md §5.4, §5.5): an "internet" network namespace holding
//! documentation addresses (203.0.113.0/24 with an HTTP server and a DNS server, plus two
//! CGNAT addresses that stand for private ranges), routed from the host only while the
//! test runs. Real guests reach it by IP and by name through the DNS forwarder; a sandbox
//! created with `allowInternetAccess: false` does not; the host, other sandboxes and
//! denied ranges stay refused; per-sandbox allowOut/denyOut change live with PUT; choices
//! survive pause/resume; allowOut domains are matched on the TLS SNI and the HTTP Host by
//! the host-side filter (a Debian guest with curl, a TLS server with a certificate the test
//! makes). Three cold boots.

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
/// A second web server, named `other.egress.test`.
const OTHER: &str = "203.0.113.11";
const OTHER_NAME: &str = "other.egress.test";
/// Names below `sub.egress.test` (a wildcard record) resolve to WEB.
const SUB_NAME: &str = "api.sub.egress.test";

/// The web servers of the test internet: on port 80, plain HTTP; on 443, TLS with the
/// test's certificate. Every answer says which address was reached and which name the
/// client sent (Host or SNI), so a test sees where a connection really went.
const WEB_SERVER: &str = r#"
import socket, ssl, sys, threading
page, cert, key, addrs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
def answer(c, addr):
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 8192:
        more = c.recv(4096)
        if not more:
            break
        head += more
    host = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"host:")]
    body = ("%s at %s for %s\n" % (page, addr, (host or [b"-"])[0].decode())).encode()
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
def handle(c, tls):
    try:
        addr = c.getsockname()[0]
        c.settimeout(10)
        if tls:
            c = ctx.wrap_socket(c, server_side=True)
        answer(c, addr)
    except Exception:
        pass
    finally:
        c.close()
def serve(addr, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=handle, args=(c, port == 443), daemon=True).start()
for a in addrs:
    for p in (80, 443):
        threading.Thread(target=serve, args=(a, p), daemon=True).start()
threading.Event().wait()
"#;

/// The DNS server of the test internet: A records from its `name=address` arguments (a
/// `*.` name stands for every name below it), NXDOMAIN for everything else; every question
/// it receives is appended to the log file.
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
    records = dict(a.split("=") for a in sys.argv[3:])
    addr = records.get(name) or records.get("*." + name.split(".", 1)[-1])
    found = addr is not None and qtype == 1
    flags = 0x8180 if addr else 0x8183
    head = q[:2] + struct.pack(">HHHHH", flags, 1, 1 if found else 0, 0, 0)
    answer = b""
    if found:
        answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 30, 4) + socket.inet_aton(addr)
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
        std::fs::create_dir_all(&dir).unwrap();
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
        for a in [WEB, OTHER, DNS, PRIVATE_DENIED, PRIVATE_ALLOWED] {
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
        let web = net.dir.join("web.py");
        std::fs::write(&web, WEB_SERVER).unwrap();
        let (cert, key) = (net.dir.join("cert.pem"), net.dir.join("key.pem"));
        let made = Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=egress.test", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .args([
                "-addext",
                "subjectAltName=DNS:*.egress.test,DNS:*.sub.egress.test",
            ])
            .output()
            .unwrap();
        assert!(made.status.success(), "openssl: {made:?}");
        let mut argv = vec!["python3", web.to_str().unwrap(), PAGE];
        argv.extend([cert.to_str().unwrap(), key.to_str().unwrap()]);
        argv.push("0.0.0.0");
        net.spawn(&argv);
        let script = net.dir.join("dns.py");
        std::fs::write(&script, DNS_SERVER).unwrap();
        let log = net.dns_log.clone();
        net.spawn(&[
            "python3",
            script.to_str().unwrap(),
            DNS,
            log.to_str().unwrap(),
            &format!("{NAME}={WEB}"),
            &format!("{OTHER_NAME}={OTHER}"),
            &format!("*.sub.egress.test={WEB}"),
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

/// A guest command's (exit code, output) succeeded and shows `page`.
fn assert_got(s: &Server, (code, out): (i64, String), page: &str, what: &str) {
    assert!(
        code == 0 && out.contains(page),
        "{what} did not reach {page:?}: {code} {out}\n{}",
        s.log()
    );
}

/// A guest command's (exit code, output) failed and shows no page.
fn assert_kept_out((code, out): (i64, String), what: &str) {
    assert!(
        code != 0 && !out.contains(PAGE),
        "{what} got through: {out}"
    );
}

fn assert_reaches(s: &Server, id: &str, target: &str) {
    assert_got(s, fetch(s, id, target), PAGE, &format!("{id} → {target}"));
}

fn assert_refused(s: &Server, id: &str, target: &str) {
    assert_kept_out(fetch(s, id, target), &format!("{id} → {target}"));
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
    let _serial = serial();
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
    // No IPv6 leaves a slot, so the guest's NIC has none (and sent none: no router or
    // neighbour solicitations, no MLD reports); loopback keeps ::1.
    let (_, v6) = guest(
        &s,
        &open,
        "cat /proc/sys/net/ipv6/conf/eth0/disable_ipv6 /proc/net/if_inet6; \
         grep -E '^Ip6OutRequests' /proc/net/snmp6",
    );
    let mut lines = v6.lines();
    assert_eq!(lines.next(), Some("1"), "eth0's disable_ipv6: {v6}");
    assert!(v6.contains(" lo") && !v6.contains("eth0"), "{v6}");
    let sent = v6
        .lines()
        .find_map(|l| l.strip_prefix("Ip6OutRequests"))
        .map(str::trim);
    assert_eq!(sent, Some("0"), "IPv6 packets the guest sent: {v6}");
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
    refusals_are_counted_once_each(&s, &open, &closed);

    // allowInternetAccess: false → neither the internet nor names.
    closed_is_closed(&s, &net, &closed);
    // The choice survives pause and resume (into whichever slot the pool hands out).
    pause_and_resume(&s, &closed);
    closed_is_closed(&s, &net, &closed);
    policy_changes_live(&s, &open);
}

/// Pauses a sandbox and resumes it (into whichever slot the pool hands out).
fn pause_and_resume(s: &Server, id: &str) {
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{id}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert!(code == 200 || code == 201, "{code} {v}");
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

    pause_and_resume(s, id);
    assert_reaches(s, id, WEB);
    assert_refused(s, id, PRIVATE_ALLOWED);

    for (body, says) in [
        (json!({"denyOut": ["nope"]}), "denyOut[0] \"nope\""),
        (json!({"denyOut": ["example.com"]}), "allowOut only"),
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

/// `curl` in the guest (5 s limit, `-k`: the test's certificate); (exit code, output).
fn curl(s: &Server, id: &str, args: &str) -> (i64, String) {
    guest(s, id, &format!("curl -sSk --max-time 5 {args}"))
}

/// Asserts a curl reached the server at `addr` (its answer names the address it was
/// reached at).
fn assert_curl_reaches(s: &Server, id: &str, args: &str, addr: &str) {
    let page = format!("{PAGE} at {addr} ");
    assert_got(s, curl(s, id, args), &page, &format!("curl {args}"));
}

fn assert_curl_refused(s: &Server, id: &str, args: &str) {
    assert_kept_out(curl(s, id, args), &format!("curl {args}"));
}

/// One DNS question from the guest straight to the test internet's resolver (not
/// through the forwarder); whether an answer came back.
fn direct_dns_answers(s: &Server, id: &str) -> bool {
    let (_, out) = guest(
        s,
        id,
        &format!(
            "python3 -c \"import socket; s = socket.socket(2, 2); s.settimeout(2); \
             s.sendto(bytes.fromhex('abcd01000001000000000000037765620665677265737304746573740000010001'), \
             ('{DNS}', 53)); print('answered', len(s.recv(512)))\""
        ),
    );
    out.contains("answered")
}

#[test]
fn allow_out_domains_are_matched_on_sni_and_host() {
    let _serial = serial();
    let _net = Internet::start();
    let s = Server::start(&format!("outbound = true\ndns = \"{DNS}\"\n"));
    let policy = json!({"allowOut": [NAME, "*.sub.egress.test"], "denyOut": ["0.0.0.0/0"]});
    let v = s.create(
        json!({"image": debian_image(), "timeout": 600, "memoryMB": 512,
                            "network": policy}),
    );
    let id = id_of(&v);
    let (_, v) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(
        v["network"]["allowOut"],
        json!([NAME, "*.sub.egress.test"]),
        "{v}"
    );
    let before = egress_counts(&s, &id);
    domain_policy_holds(&s, &id);
    counters_moved(&s, &id, before);

    // A forged name reaches only what it names: the filter connects to the address the
    // host resolves for it, never to the one the guest chose.
    assert_curl_reaches(
        &s,
        &id,
        &format!("--resolve {NAME}:443:{OTHER} https://{NAME}/"),
        WEB,
    );
    assert_curl_reaches(&s, &id, &format!("-H 'Host: {NAME}' http://{OTHER}/"), WEB);
    // With a domain entry and no dnsServers, E2B's default resolver is opened, not ours;
    // naming ours opens it for direct queries.
    assert!(
        !direct_dns_answers(&s, &id),
        "a resolver not allowed answered"
    );
    let with_dns = json!({"allowOut": [NAME], "denyOut": ["0.0.0.0/0"], "dnsServers": [DNS]});
    let (code, v) = put_network(&s, &id, with_dns);
    assert_eq!(code, 204, "{v}");
    assert!(direct_dns_answers(&s, &id), "dnsServers did not open {DNS}");

    // Live changes: another domain, then plain-IP mode again, then domains again.
    let (code, v) = put_network(
        &s,
        &id,
        json!({"allowOut": [OTHER_NAME], "denyOut": ["0.0.0.0/0"]}),
    );
    assert_eq!(code, 204, "{v}");
    assert_curl_reaches(&s, &id, &format!("https://{OTHER_NAME}/"), OTHER);
    assert_curl_refused(&s, &id, &format!("https://{NAME}/"));
    let (code, v) = put_network(&s, &id, json!({"denyOut": [format!("{WEB}/32")]}));
    assert_eq!(code, 204, "{v}");
    assert_curl_reaches(&s, &id, &format!("https://{OTHER}/"), OTHER);
    assert_curl_refused(&s, &id, &format!("https://{NAME}/"));
    let (code, v) = put_network(&s, &id, policy.clone());
    assert_eq!(code, 204, "{v}");

    // The policy, filter included, survives pause and resume.
    pause_and_resume(&s, &id);
    domain_policy_holds(&s, &id);
    let (code, v) = put_network(&s, &id, json!({"denyOut": ["web.egress.test"]}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("allowOut only"),
        "{v}"
    );
}

/// One metrics sample's egress counts (api.md §4.21).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Egress {
    at_unix: u64,
    bytes: u64,
    refused: u64,
    protected: u64,
}

/// The newest metrics sample's egress counts of a running sandbox.
fn egress_counts(s: &Server, id: &str) -> Egress {
    let (code, v) = s.call("GET", &format!("/sandboxes/{id}/metrics"), None);
    assert_eq!(code, 200, "{v}");
    let last = v
        .as_array()
        .and_then(|a| a.last())
        .cloned()
        .unwrap_or_default();
    let n = |k: &str| last[k].as_u64().unwrap_or(0);
    Egress {
        at_unix: n("timestampUnix"),
        bytes: n("egressBytes"),
        refused: n("egressRefused"),
        protected: n("egressRefusedProtected"),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The counts of the first sample taken after this call (samples come every 5 s), so
/// that everything the test did before is in them.
fn counts_from_now(s: &Server, id: &str) -> Egress {
    let since = unix_now();
    let mut now = Egress::default();
    let sampled = wait_until(Duration::from_secs(30), || {
        now = egress_counts(s, id);
        now.at_unix > since
    });
    assert!(sampled, "no metrics sample of {id} after {since}: {now:?}");
    now
}

/// `n` TCP connections from the guest to `ip:port`, each refused at once (busybox nc).
fn refused_connects(s: &Server, id: &str, ip: &str, port: &str, n: u32) {
    let (code, out) = guest(
        s,
        id,
        &format!(
            "ok=0; for i in $(seq {n}); do nc -w 2 {ip} {port} </dev/null && ok=1; done; exit $ok"
        ),
    );
    assert_eq!(code, 0, "a connection to {ip}:{port} opened: {out}");
}

/// Refused connections count once each (the refusal is a reset, so no SYN is retried),
/// apart by kind: to a denied range (refused in the slot), to a host address outside the
/// denied ranges (the host's end of the test link, refused by the root table) and to the
/// slot's gateway count as protected; to a `denyOut` destination, and from a sandbox
/// without internet access, as refused by the policy.
fn refusals_are_counted_once_each(s: &Server, open: &str, closed: &str) {
    let (open0, closed0) = (counts_from_now(s, open), counts_from_now(s, closed));
    let (code, v) = put_network(s, open, json!({"denyOut": [format!("{OTHER}/32")]}));
    assert_eq!(code, 204, "{v}");
    refused_connects(s, open, PRIVATE_DENIED, "80", 3);
    refused_connects(s, open, ROOT_END, "80", 2);
    refused_connects(s, open, "169.254.0.22", "80", 1);
    refused_connects(s, open, OTHER, "80", 4);
    refused_connects(s, closed, WEB, "80", 3);
    refused_connects(s, closed, "169.254.0.22", "80", 2);
    let (code, v) = put_network(s, open, json!({}));
    assert_eq!(code, 204, "{v}");
    let (open1, closed1) = (counts_from_now(s, open), counts_from_now(s, closed));
    let moved = |a: Egress, b: Egress| (b.refused - a.refused, b.protected - a.protected);
    assert_eq!(moved(open0, open1), (4, 6), "{open0:?} → {open1:?}");
    assert_eq!(moved(closed0, closed1), (3, 2), "{closed0:?} → {closed1:?}");
    assert_metric(
        s,
        open,
        "agentenv_sandbox_egress_refused_protected_total",
        open1.protected,
    );
}

/// `/metrics` shows `name` with the sandbox's label and at least `min`.
fn assert_metric(s: &Server, id: &str, name: &str, min: u64) {
    let (_, text) = s.call("GET", "/metrics", None);
    let text = text.as_str().unwrap_or_default().to_string();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{sandbox=\"{id}\"}} ")))
        .unwrap_or_else(|| panic!("no {name} for {id} in /metrics:\n{text}"));
    let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= min, "{line}");
}

/// Both counters grew past `before` in the sandbox's samples (taken every 5 s), and
/// `/metrics` shows them with the sandbox's label.
fn counters_moved(s: &Server, id: &str, before: Egress) {
    let mut now = before;
    let grew = wait_until(Duration::from_secs(30), || {
        now = egress_counts(s, id);
        now.bytes > before.bytes && now.refused > before.refused
    });
    assert!(grew, "egress counters did not move: {before:?} → {now:?}");
    assert_metric(s, id, "agentenv_sandbox_egress_bytes_total", 1);
    assert_metric(s, id, "agentenv_sandbox_egress_refused_total", 1);
    assert_metric(s, id, "agentenv_sandbox_egress_refused_protected_total", 0);
}

/// allowOut [NAME, *.sub.egress.test], denyOut 0.0.0.0/0: the allowed names over TLS
/// (SNI) and HTTP (Host), the wildcard, and nothing else.
fn domain_policy_holds(s: &Server, id: &str) {
    assert_curl_reaches(s, id, &format!("https://{NAME}/"), WEB);
    assert_curl_reaches(s, id, &format!("http://{NAME}/"), WEB);
    assert_curl_reaches(s, id, &format!("https://{SUB_NAME}/"), WEB);
    assert_curl_refused(s, id, &format!("https://{OTHER_NAME}/"));
    assert_curl_refused(s, id, &format!("http://{OTHER_NAME}/"));
    assert_curl_refused(s, id, &format!("https://{OTHER}/"));
    assert_curl_refused(
        s,
        id,
        &format!("--resolve sub.egress.test:443:{WEB} https://sub.egress.test/"),
    );
}
