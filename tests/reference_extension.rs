//! End-to-end test of `examples/reference-extension.rs`: builds the example with cargo,
//! runs it, and sends it hooks by hand while it manages a real network namespace
//! (`aenv-reftest-<pid>`, never an `agentenv-ns-*` name). Needs root, `ip`, `nsenter` and
//! `nft`.

use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "refext-test-token";
const PREFIX: &str = "/ext";

/// Builds the example in the profile this test was built with and returns its path, taken
/// from cargo's own artifact messages rather than guessed.
fn build_example() -> PathBuf {
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args([
        "build",
        "--example",
        "reference-extension",
        "--message-format=json-render-diagnostics",
        "--manifest-path",
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
    ]);
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    let output = cargo
        .stderr(Stdio::inherit())
        .output()
        .expect("run cargo build");
    assert!(output.status.success(), "cargo build --example failed");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter(|m| m["target"]["name"] == "reference-extension")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .expect("cargo reported no reference-extension executable")
}

/// A network namespace made with `ip netns add`; deleted on drop, also when a check fails.
struct Netns {
    name: String,
}

impl Netns {
    fn create(name: String) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        let netns = Netns { name };
        // Stand-ins for agentenv's own objects, which the extension must leave alone.
        let ns = netns.name.as_str();
        run(&[
            "ip", "-n", ns, "link", "add", "veth0", "type", "veth", "peer", "refpeer0",
        ]);
        run(&["ip", "-n", ns, "tuntap", "add", "tap0", "mode", "tap"]);
        netns.nft_load(
            "table ip agentenv {\n  chain forward {\n    type filter hook forward priority filter; \
             policy accept;\n    iifname \"tap0\" ip saddr != 169.254.0.21 drop\n  }\n}\n",
        );
        netns
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    fn nft_load(&self, script: &str) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("run nft");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        assert!(child.wait().unwrap().success(), "nft -f failed");
    }

    /// `nft list table <table>` inside the namespace; `None` if the table does not exist.
    fn table(&self, table: &str) -> Option<String> {
        let mut args = vec!["netns", "exec", &self.name, "nft", "list", "table"];
        args.extend(table.split(' '));
        let output = Command::new("ip").args(&args).output().expect("run nft");
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn links(&self) -> String {
        let output = Command::new("ip")
            .args(["-n", &self.name, "-o", "link"])
            .output()
            .expect("run ip link");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

fn run(argv: &[&str]) {
    let status = Command::new(argv[0])
        .args(&argv[1..])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {argv:?}: {e}"));
    assert!(status.success(), "{argv:?} failed: {status}");
}

/// A running extension process, killed on drop. Its log is printed if the test fails.
struct Extension {
    child: Child,
    base: String,
    log: PathBuf,
}

impl Extension {
    fn start(binary: &Path, state_dir: &Path, run: u32) -> Extension {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = state_dir.with_extension(format!("log{run}"));
        let child = Command::new(binary)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--state-dir", state_dir.to_str().unwrap()])
            .args(["--prefix", PREFIX, "--token", TOKEN])
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the reference extension");
        let extension = Extension {
            child,
            base: format!("http://127.0.0.1:{port}{PREFIX}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "the extension did not start listening"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        extension
    }

    /// Sends one hook and returns (status, body). A body that is not JSON becomes `Null`.
    fn hook(&self, hook: &str, body: Value) -> (u16, Value) {
        self.hook_with_token(hook, body, Some(TOKEN))
    }

    fn hook_with_token(&self, hook: &str, body: Value, token: Option<&str>) -> (u16, Value) {
        let mut request = ureq::post(&format!("{}/sandbox-hook/{hook}", self.base))
            .timeout(Duration::from_secs(10))
            .set("X-Agentenv-Hook", hook);
        if let Some(token) = token {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        let response = match request.send_json(body) {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => response,
            Err(e) => panic!("hook {hook}: {e}"),
        };
        let status = response.status();
        let body = response.into_json().unwrap_or(Value::Null);
        (status, body)
    }
}

impl Drop for Extension {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("--- reference extension log ---\n{log}");
        }
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        for run in 1..=2 {
            let _ = std::fs::remove_file(self.0.with_extension(format!("log{run}")));
        }
    }
}

#[test]
fn reference_extension_manages_its_table_in_a_real_namespace() {
    let binary = build_example();
    let netns = Netns::create(format!("aenv-reftest-{}", std::process::id()));
    let agentenv_table = netns.table("ip agentenv").expect("fake agentenv table");
    let state = TempDir(std::env::temp_dir().join(format!("aenv-reftest-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&state.0);

    let sandbox = uuid::Uuid::now_v7().to_string();
    let instance = uuid::Uuid::now_v7().to_string();
    let params = json!({
        "firewall": {"allowTcpPorts": [8080], "denyCidrs": ["203.0.113.0/24"]},
        "bootArgs": "quiet refext.test=1",
        "vpn": {"peers": [{"name": "office", "endpoint": "198.51.100.7:51820"}]},
    });
    let start = json!({
        "sandboxId": sandbox,
        "sandboxInstanceId": instance,
        "networkNamespacePath": netns.path(),
        "hostInteractionIp": "198.18.0.7",
        "customExtensionParams": params,
    });

    let extension = Extension::start(&binary, &state.0, 1);

    // Authentication and routing come first: nothing is applied.
    for token in [None, Some("wrong-token")] {
        let (status, _) = extension.hook_with_token("start-fresh", start.clone(), token);
        assert_eq!(status, 401, "token {token:?}");
    }
    assert_eq!(extension.hook("no-such-hook", json!({})).0, 404);
    assert_eq!(
        netns.table("inet refext"),
        None,
        "rejected hooks changed nothing"
    );

    // start-fresh loads the table and returns bootArgs as extraBootArgs.
    let (status, body) = extension.hook("start-fresh", start.clone());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"extraBootArgs": "quiet refext.test=1"}));
    let table = netns
        .table("inet refext")
        .expect("table inet refext after start-fresh");
    assert!(
        table.contains("tcp dport != { 8080, 49983 } drop"),
        "{table}"
    );
    assert!(table.contains("ip daddr 203.0.113.0/24 drop"), "{table}");

    // patch-params replaces the rules and answers with the full merged params.
    let (status, body) = extension.hook(
        "patch-params",
        json!({"sandboxId": sandbox, "patch": {
            "firewall": {"allowTcpPorts": [9090, 3000], "denyCidrs": ["198.51.100.0/24"]},
            "vpn": {"peers": [{"name": "lab", "endpoint": "192.0.2.1:51820"}]},
        }}),
    );
    assert_eq!(status, 200, "{body}");
    let patched = json!({
        "firewall": {"allowTcpPorts": [9090, 3000], "denyCidrs": ["198.51.100.0/24"]},
        "bootArgs": "quiet refext.test=1",
        "vpn": {"peers": [{"name": "lab", "endpoint": "192.0.2.1:51820"}]},
    });
    assert_eq!(body, json!({"customExtensionParams": patched}));
    let table = netns
        .table("inet refext")
        .expect("table after patch-params");
    assert!(
        table.contains("tcp dport != { 3000, 9090, 49983 } drop"),
        "{table}"
    );
    assert!(table.contains("ip daddr 198.51.100.0/24 drop"), "{table}");
    assert!(
        !table.contains("8080") && !table.contains("203.0.113"),
        "{table}"
    );

    // An invalid patch is refused and leaves rules and params as they were.
    let (status, _) = extension.hook(
        "patch-params",
        json!({"sandboxId": sandbox, "patch": {"firewall": {"allowTcpPorts": [70000]}}}),
    );
    assert_eq!(status, 422);
    assert_eq!(netns.table("inet refext").as_deref(), Some(table.as_str()));

    // A stop for another instance of the sandbox is acknowledged and changes nothing.
    let stale =
        json!({"sandboxId": sandbox, "sandboxInstanceId": uuid::Uuid::now_v7().to_string()});
    assert_eq!(extension.hook("stop", stale.clone()).0, 200);
    assert_eq!(netns.table("inet refext").as_deref(), Some(table.as_str()));

    // Restart: the instance, its namespace and its params come back from state.json.
    drop(extension);
    let extension = Extension::start(&binary, &state.0, 2);
    let (status, body) = extension.hook(
        "patch-params",
        json!({"sandboxId": sandbox, "patch": {"firewall": {"denyCidrs": null}}}),
    );
    assert_eq!(status, 200, "{body}");
    let mut expected = patched.clone();
    expected["firewall"]
        .as_object_mut()
        .unwrap()
        .remove("denyCidrs");
    assert_eq!(body, json!({"customExtensionParams": expected}));
    let table = netns.table("inet refext").expect("table after restart");
    assert!(
        table.contains("tcp dport != { 3000, 9090, 49983 } drop"),
        "{table}"
    );
    assert!(!table.contains("daddr"), "{table}");
    assert_eq!(extension.hook("stop", stale).0, 200);
    assert!(
        netns.table("inet refext").is_some(),
        "stale stop after restart"
    );

    // The right stop removes the table; a repeated stop is a harmless no-op.
    let stop = json!({"sandboxId": sandbox, "sandboxInstanceId": instance});
    assert_eq!(extension.hook("stop", stop.clone()).0, 200);
    assert_eq!(netns.table("inet refext"), None, "table left after stop");
    assert_eq!(extension.hook("stop", stop).0, 200);
    let (status, _) = extension.hook(
        "patch-params",
        json!({"sandboxId": sandbox, "patch": {"vpn": null}}),
    );
    assert_eq!(status, 404, "patch-params after stop");

    // start-resume with empty params: nothing loaded, empty answer, stop still clean.
    let resumed = uuid::Uuid::now_v7().to_string();
    let mut resume = start.clone();
    resume["sandboxInstanceId"] = json!(resumed);
    resume["customExtensionParams"] = json!({});
    let (status, body) = extension.hook("start-resume", resume);
    assert_eq!((status, body), (200, json!({})));
    assert_eq!(netns.table("inet refext"), None);
    let stop = json!({"sandboxId": sandbox, "sandboxInstanceId": resumed});
    assert_eq!(extension.hook("stop", stop).0, 200);

    // A late stop of sandbox A after its namespace went to sandbox B leaves B's rules alone.
    let (a, b) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    let (a1, b1) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    for (sandbox, instance, cidr) in [(&a, &a1, "203.0.113.0/24"), (&b, &b1, "192.0.2.0/24")] {
        let mut start = start.clone();
        start["sandboxId"] = json!(sandbox);
        start["sandboxInstanceId"] = json!(instance);
        start["customExtensionParams"] = json!({"firewall": {"denyCidrs": [cidr]}});
        assert_eq!(extension.hook("start-fresh", start).0, 200);
    }
    let stop_a = json!({"sandboxId": a, "sandboxInstanceId": a1});
    assert_eq!(extension.hook("stop", stop_a).0, 200);
    let table = netns
        .table("inet refext")
        .expect("B's table after A's late stop");
    assert!(table.contains("192.0.2.0/24"), "{table}");
    let stop_b = json!({"sandboxId": b, "sandboxInstanceId": b1});
    assert_eq!(extension.hook("stop", stop_b).0, 200);
    assert_eq!(
        netns.table("inet refext"),
        None,
        "table left after B's stop"
    );

    // agentenv's objects were never touched.
    assert_eq!(
        netns.table("ip agentenv").as_deref(),
        Some(agentenv_table.as_str())
    );
    let links = netns.links();
    assert!(
        links.contains(" veth0@") && links.contains(" tap0:"),
        "{links}"
    );
}
