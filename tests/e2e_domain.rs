//! End-to-end, issue 19 item 4: the SDKs' default addressing. With only `E2B_DOMAIN` set
//! both SDKs call `https://api.<domain>` and `https://<port>-<id>.<domain>`; here that is
//! Debian's nginx terminating TLS with a wildcard certificate the test makes (openssl),
//! running deploy/nginx/agentenv.conf (the file docs/e2b.md shows) in front of the real
//! server, and Debian's dnsmasq answering `*.<domain>` with nginx's loopback address. The
//! SDK processes run in a private mount namespace whose /etc/resolv.conf names that
//! dnsmasq, and trust the test CA (python: SSL_CERT_FILE, which httpx honours; node:
//! NODE_EXTRA_CA_CERTS). Every SDK script of tests/e2e_sdk.rs and tests/e2e_sdk_lifecycle.rs
//! runs once more this way, and every JS script of the suite (basic, auto_resume, volumes,
//! template_build on the Debian image from the test registry, ports), plus tests/sdk/domain.py
//! and tests/sdk/ports.mjs (a guest port at `https://get_host(port)`, public and with the
//! traffic token). Left out, as they check the server rather than the addressing: the
//! python template builds (e2e_templates, e2e_guests: the JS build covers the SDK's build
//! calls and file uploads through the proxy), the volume scripts that restart the server
//! (e2e_volumes) and the scripts needing their own templates (e2e_ports).

mod common;

use common::registry::{Auth, TestRegistry};
use common::sdk::{finish, sdk_tools};
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

/// Under the reserved `.test` TLD (RFC 2606): resolved only by the test's dnsmasq.
const DOMAIN: &str = "e2b.agentenv.test";
/// nginx's and dnsmasq's loopback addresses (127/8 is all on `lo`).
const NGINX_ADDR: &str = "127.0.23.1";
const DNS_ADDR: &str = "127.0.23.2";

/// A helper process killed and reaped when the test ends, however it ends.
struct Helper(Child);

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `openssl` with a whitespace-separated argument list (paths under the temp dir).
fn openssl(args: &str) {
    run("openssl", &args.split_whitespace().collect::<Vec<_>>());
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A test CA and a certificate for `*.<DOMAIN>` signed by it: (ca.crt, site.crt, site.key).
fn make_certificates(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let d = path(dir);
    openssl(&format!(
        "req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=agentenv-e2e-domain-test-CA \
         -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
         -keyout {d}/ca.key -out {d}/ca.crt"
    ));
    openssl(&format!(
        "req -newkey rsa:2048 -nodes -subj /CN=*.{DOMAIN} -keyout {d}/site.key -out {d}/site.csr"
    ));
    std::fs::write(
        dir.join("site.ext"),
        format!(
            "subjectAltName=DNS:*.{DOMAIN}\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n\
             subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
        ),
    )
    .unwrap();
    openssl(&format!(
        "x509 -req -in {d}/site.csr -CA {d}/ca.crt -CAkey {d}/ca.key -CAcreateserial -days 2 \
         -extfile {d}/site.ext -out {d}/site.crt"
    ));
    let f = |name: &str| dir.join(name);
    (f("ca.crt"), f("site.crt"), f("site.key"))
}

/// deploy/nginx/agentenv.conf with the three values an operator changes replaced (each
/// must be there, so the test runs the documented file), inside a minimal nginx.conf.
fn nginx_config(dir: &Path, upstream: &str, crt: &Path, key: &Path) -> PathBuf {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/nginx/agentenv.conf");
    let mut site = std::fs::read_to_string(file).unwrap();
    let docs = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/e2b.md");
    assert!(
        std::fs::read_to_string(docs).unwrap().contains(&site),
        "docs/e2b.md shows {file} as it is"
    );
    let listen = format!("listen {NGINX_ADDR}:443 ssl http2;");
    for (from, to) in [
        ("listen 443 ssl http2;", listen.as_str()),
        ("/etc/ssl/wildcard.sandbox.example.com.crt", path(crt)),
        ("/etc/ssl/wildcard.sandbox.example.com.key", path(key)),
        ("http://10.0.0.5:8000", &format!("http://{upstream}")),
        ("sandbox.example.com", DOMAIN),
    ] {
        assert!(site.contains(from), "{file} no longer has {from}");
        site = site.replace(from, to);
    }
    let d = path(dir);
    let conf = format!(
        "daemon off;\n# One process: killing the child ends nginx (a master's worker outlives its SIGKILL).\nmaster_process off;\nuser root;\npid {d}/nginx.pid;\n\
         error_log {d}/nginx-error.log info;\nevents {{ worker_connections 512; }}\n\
         http {{\n    log_format hosts '$host $status $request';\n\
         access_log {d}/nginx-access.log hosts;\n\
         client_body_temp_path {d}/nginx-body;\n    proxy_temp_path {d}/nginx-proxy;\n\
         fastcgi_temp_path {d}/nginx-fastcgi;\n    uwsgi_temp_path {d}/nginx-uwsgi;\n\
         scgi_temp_path {d}/nginx-scgi;\n{site}}}\n"
    );
    let out = dir.join("nginx.conf");
    std::fs::write(&out, conf).unwrap();
    out
}

fn start_nginx(dir: &Path, upstream: &str, crt: &Path, key: &Path) -> Helper {
    let conf = nginx_config(dir, upstream, crt, key);
    run("nginx", &["-t", "-q", "-c", path(&conf)]);
    let child = Command::new("nginx")
        .args(["-c", path(&conf)])
        .spawn()
        .expect("nginx: run scripts/setup.sh");
    let listening = wait_until(Duration::from_secs(10), || {
        std::net::TcpStream::connect((NGINX_ADDR, 443)).is_ok()
    });
    assert!(listening, "nginx does not listen on {NGINX_ADDR}:443");
    Helper(child)
}

/// dnsmasq answering every name under DOMAIN with nginx's address, nothing else.
fn start_dnsmasq(dir: &Path) -> Helper {
    let child = Command::new("dnsmasq")
        .args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--bind-interfaces",
            &format!("--listen-address={DNS_ADDR}"),
            "--port=53",
            &format!("--address=/{DOMAIN}/{NGINX_ADDR}"),
            &format!("--pid-file={}", path(&dir.join("dnsmasq.pid"))),
            "--log-facility=-",
        ])
        .stderr(std::fs::File::create(dir.join("dnsmasq.log")).unwrap())
        .spawn()
        .expect("dnsmasq: run scripts/setup.sh");
    let answering = wait_until(Duration::from_secs(10), || {
        std::fs::read_to_string(dir.join("dnsmasq.log")).is_ok_and(|l| l.contains("started"))
    });
    assert!(answering, "dnsmasq did not start");
    Helper(child)
}

/// An SDK script in domain mode: a private mount namespace with our resolv.conf, the
/// test CA trusted, only E2B_DOMAIN and the key set.
fn domain_script(dir: &Path, ca: &Path, program: &str, script: &str, js: &str) -> Command {
    let resolv = dir.join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {DNS_ADDR}\n")).unwrap();
    let mut cmd = Command::new("unshare");
    // The paths go as arguments ($0, $@), never into the script text.
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        "mount --bind \"$0\" /etc/resolv.conf && exec \"$@\"",
        path(&resolv),
        program,
        script,
    ])
    .env("E2B_DOMAIN", DOMAIN)
    .env("E2B_API_KEY", API_KEY)
    .env("SSL_CERT_FILE", ca)
    .env("NODE_EXTRA_CA_CERTS", ca)
    .env("AENV_E2B_JS", js)
    .env("PYTHONUNBUFFERED", "1")
    .env_remove("E2B_API_URL")
    .env_remove("E2B_SANDBOX_URL")
    .env_remove("E2B_DEBUG");
    cmd
}

/// One server, one template, nginx and dnsmasq; every SDK script in domain mode.
#[test]
fn sdks_in_domain_mode_behind_nginx() {
    let (python, js) = sdk_tools();
    let registry = TestRegistry::start(Auth::Anonymous);
    let debian = registry.push_layout(&format!("{}:12", debian_image()), "debian", "12");
    let s = Server::start("");
    build_template(&s, "base");
    let dir = s.state_dir.parent().unwrap().join("domain");
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, crt, key) = make_certificates(&dir);
    let upstream = s.base.trim_start_matches("http://").to_string();
    let _nginx = start_nginx(&dir, &upstream, &crt, &key);
    let _dns = start_dnsmasq(&dir);
    let mut calls = Vec::new();
    let py = python.as_str();
    let fresh_build = [
        ("AENV_TEST_IMAGE", debian.as_str()),
        ("AENV_TEST_FRESH", "1"),
    ];
    for (program, script, env) in [
        (py, "domain.py", &[][..]),
        ("node", "ports.mjs", &[]),
        (py, "lifecycle.py", &[]),
        (py, "commands.py", &[]),
        (py, "files.py", &[]),
        (py, "pty_watch.py", &[]),
        (py, "latency.py", &[]),
        (py, "e2b_defaults.py", &[]),
        (py, "auto_resume.py", &[]),
        (py, "fs_pause.py", &[]),
        (py, "file_metadata.py", &[]),
        ("node", "basic.mjs", &[]),
        ("node", "auto_resume.mjs", &[]),
        ("node", "volumes.mjs", &[]),
        ("node", "template_build.mjs", &fresh_build),
    ] {
        let file = format!("{}/tests/sdk/{script}", env!("CARGO_MANIFEST_DIR"));
        let started = std::time::Instant::now();
        let mut cmd = domain_script(&dir, &ca, program, &file, &js);
        cmd.envs(env.iter().copied());
        calls.extend(finish(&s, &file, cmd));
        println!("{script} {:.1}s", started.elapsed().as_secs_f64());
    }
    println!("{}", calls.join("\n"));
    // fs_pause.py leaves its timeout-paused sandbox (e2e_sdk_lifecycle restarts the server
    // with it); here it goes.
    let left = calls
        .iter()
        .find_map(|l| l.strip_prefix("fs_pause.py: ok left "))
        .expect("fs_pause.py leaves its timeout-paused sandbox");
    let (code, v) = s.call("DELETE", &format!("/sandboxes/{left}"), None);
    assert_eq!(code, 204, "{v}");
    for want in [
        "domain.py: ok private port with the token",
        "ports.mjs: ok private port with e2b-traffic-access-token",
    ] {
        assert!(calls.iter().any(|c| c == want), "{want} missing: {calls:?}");
    }
    // The SDKs went through nginx by name: the API, envd and the guest port.
    let access = std::fs::read_to_string(dir.join("nginx-access.log")).unwrap();
    for host in [
        format!("api.{DOMAIN} 20"),
        "49983-".to_string(),
        "8080-".to_string(),
    ] {
        assert!(
            access.lines().any(|l| l.starts_with(&host)),
            "no request to {host} in nginx's log:\n{access}"
        );
    }
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(
        left,
        serde_json::json!([]),
        "the scripts kill what they create"
    );
}
