//! End-to-end test of `examples/reference-extension.rs`: builds the example with cargo,
//! runs it, and sends it hooks by hand while it manages a real network namespace
//! (`aenv-reftest-<pid>`, never an `agentenv-ns-*` name). Needs root, `ip`, `nsenter` and
//! `nft`.

use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
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

/// The example, built once for the binary.
fn example() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(build_example)
}

/// One test's extension and namespace, with a sandbox instance to send hooks for.
struct Case {
    extension: Option<Extension>,
    state: TempDir,
    netns: Netns,
    /// agentenv's fake table as the namespace was made with it.
    agentenv_table: String,
    sandbox: String,
    instance: String,
    /// The start hook of the instance: firewall rules, bootArgs and a VPN peer.
    start: Value,
}

impl Case {
    /// A fresh namespace and state dir (`aenv-reftest-<pid>-<tag>`) and a running extension.
    fn new(tag: &str) -> Case {
        let name = format!("aenv-reftest-{}-{tag}", std::process::id());
        let netns = Netns::create(name.clone());
        let agentenv_table = netns.table("ip agentenv").expect("fake agentenv table");
        let state = TempDir(std::env::temp_dir().join(name));
        let _ = std::fs::remove_dir_all(&state.0);
        let sandbox = uuid::Uuid::now_v7().to_string();
        let instance = uuid::Uuid::now_v7().to_string();
        let start = json!({
            "sandboxId": sandbox,
            "sandboxInstanceId": instance,
            "networkNamespacePath": netns.path(),
            "hostInteractionIp": "198.18.0.7",
            "customExtensionParams": {
                "firewall": {"allowTcpPorts": [8080], "denyCidrs": ["203.0.113.0/24"]},
                "bootArgs": "quiet refext.test=1",
                "vpn": {"peers": [{"name": "office", "endpoint": "198.51.100.7:51820"}]},
            },
        });
        let extension = Some(Extension::start(example(), &state.0, 1));
        Case {
            extension,
            state,
            netns,
            agentenv_table,
            sandbox,
            instance,
            start,
        }
    }

    fn ext(&self) -> &Extension {
        self.extension.as_ref().expect("a running extension")
    }

    /// Stops the extension and starts it again on the same state dir.
    fn restart(&mut self) {
        self.extension = None;
        self.extension = Some(Extension::start(example(), &self.state.0, 2));
    }

    fn table(&self) -> Option<String> {
        self.netns.table("inet refext")
    }

    /// start-fresh of the instance, asserting 200.
    fn start_fresh(&self) {
        let (status, body) = self.ext().hook("start-fresh", self.start.clone());
        assert_eq!(status, 200, "{body}");
    }

    /// patch-params with `patch` for the sandbox: status and body.
    fn patch(&self, patch: Value) -> (u16, Value) {
        let body = json!({"sandboxId": self.sandbox, "patch": patch});
        self.ext().hook("patch-params", body)
    }

    /// The patch that replaces the firewall rules and the VPN peer, asserting 200.
    fn patch_lab(&self) {
        let (status, body) = self.patch(lab_patch());
        assert_eq!(status, 200, "{body}");
    }

    fn stop_hook(&self, sandbox: &str, instance: &str) -> u16 {
        let stop = json!({"sandboxId": sandbox, "sandboxInstanceId": instance});
        self.ext().hook("stop", stop).0
    }

    /// agentenv's objects were never touched.
    fn assert_agentenv_untouched(&self) {
        assert_eq!(
            self.netns.table("ip agentenv").as_deref(),
            Some(self.agentenv_table.as_str())
        );
        let links = self.netns.links();
        assert!(
            links.contains(" veth0@") && links.contains(" tap0:"),
            "{links}"
        );
    }
}

fn lab_patch() -> Value {
    json!({
        "firewall": {"allowTcpPorts": [9090, 3000], "denyCidrs": ["198.51.100.0/24"]},
        "vpn": {"peers": [{"name": "lab", "endpoint": "192.0.2.1:51820"}]},
    })
}

/// The params after [`lab_patch`].
fn patched() -> Value {
    json!({
        "firewall": {"allowTcpPorts": [9090, 3000], "denyCidrs": ["198.51.100.0/24"]},
        "bootArgs": "quiet refext.test=1",
        "vpn": {"peers": [{"name": "lab", "endpoint": "192.0.2.1:51820"}]},
    })
}

/// Authentication and routing come first: nothing is applied.
#[test]
fn hooks_without_the_token_or_to_an_unknown_name_are_refused_and_change_nothing() {
    let case = Case::new("auth");
    for token in [None, Some("wrong-token")] {
        let (status, _) = case
            .ext()
            .hook_with_token("start-fresh", case.start.clone(), token);
        assert_eq!(status, 401, "token {token:?}");
    }
    assert_eq!(case.ext().hook("no-such-hook", json!({})).0, 404);
    assert_eq!(case.table(), None, "rejected hooks changed nothing");
    case.assert_agentenv_untouched();
}

/// start-fresh loads the table and returns bootArgs as extraBootArgs.
#[test]
fn start_fresh_loads_the_table_and_returns_the_boot_args() {
    let case = Case::new("fresh");
    let (status, body) = case.ext().hook("start-fresh", case.start.clone());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"extraBootArgs": "quiet refext.test=1"}));
    let table = case.table().expect("table inet refext after start-fresh");
    assert!(
        table.contains("tcp dport != { 8080, 49983 } drop"),
        "{table}"
    );
    assert!(table.contains("ip daddr 203.0.113.0/24 drop"), "{table}");
    case.assert_agentenv_untouched();
}

/// patch-params replaces the rules and answers with the full merged params; an invalid
/// patch is refused and leaves rules and params as they were.
#[test]
fn patch_params_replaces_the_rules_and_an_invalid_patch_changes_nothing() {
    let case = Case::new("patch");
    case.start_fresh();
    let (status, body) = case.patch(lab_patch());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"customExtensionParams": patched()}));
    let table = case.table().expect("table after patch-params");
    assert!(
        table.contains("tcp dport != { 3000, 9090, 49983 } drop"),
        "{table}"
    );
    assert!(table.contains("ip daddr 198.51.100.0/24 drop"), "{table}");
    assert!(
        !table.contains("8080") && !table.contains("203.0.113"),
        "{table}"
    );

    let (status, _) = case.patch(json!({"firewall": {"allowTcpPorts": [70000]}}));
    assert_eq!(status, 422);
    assert_eq!(case.table().as_deref(), Some(table.as_str()));
    case.assert_agentenv_untouched();
}

/// A stop for another instance of the sandbox is acknowledged and changes nothing.
#[test]
fn a_stop_for_another_instance_of_the_sandbox_changes_nothing() {
    let case = Case::new("stale");
    case.start_fresh();
    case.patch_lab();
    let table = case.table().expect("table after patch-params");
    let stale = uuid::Uuid::now_v7().to_string();
    assert_eq!(case.stop_hook(&case.sandbox, &stale), 200);
    assert_eq!(case.table().as_deref(), Some(table.as_str()));
    case.assert_agentenv_untouched();
}

/// Restart: the instance, its namespace and its params come back from state.json.
#[test]
fn a_restarted_extension_takes_its_instances_back_from_its_state() {
    let mut case = Case::new("restart");
    case.start_fresh();
    case.patch_lab();
    case.restart();
    let (status, body) = case.patch(json!({"firewall": {"denyCidrs": null}}));
    assert_eq!(status, 200, "{body}");
    let mut expected = patched();
    expected["firewall"]
        .as_object_mut()
        .unwrap()
        .remove("denyCidrs");
    assert_eq!(body, json!({"customExtensionParams": expected}));
    let table = case.table().expect("table after restart");
    assert!(
        table.contains("tcp dport != { 3000, 9090, 49983 } drop"),
        "{table}"
    );
    assert!(!table.contains("daddr"), "{table}");
    let stale = uuid::Uuid::now_v7().to_string();
    assert_eq!(case.stop_hook(&case.sandbox, &stale), 200);
    assert!(case.table().is_some(), "stale stop after restart");
    case.assert_agentenv_untouched();
}

/// The right stop removes the table; a repeated stop is a harmless no-op (also after a
/// restart), and the instance is gone for patch-params.
#[test]
fn the_instances_stop_removes_the_table_and_a_repeated_stop_is_a_no_op() {
    let mut case = Case::new("stop");
    case.start_fresh();
    case.restart();
    assert_eq!(case.stop_hook(&case.sandbox, &case.instance), 200);
    assert_eq!(case.table(), None, "table left after stop");
    assert_eq!(case.stop_hook(&case.sandbox, &case.instance), 200);
    let (status, _) = case.patch(json!({"vpn": null}));
    assert_eq!(status, 404, "patch-params after stop");
    case.assert_agentenv_untouched();
}

/// start-resume with empty params: nothing loaded, empty answer, stop still clean.
#[test]
fn start_resume_with_empty_params_loads_nothing_and_its_stop_is_clean() {
    let case = Case::new("resume");
    let resumed = uuid::Uuid::now_v7().to_string();
    let mut resume = case.start.clone();
    resume["sandboxInstanceId"] = json!(resumed);
    resume["customExtensionParams"] = json!({});
    let (status, body) = case.ext().hook("start-resume", resume);
    assert_eq!((status, body), (200, json!({})));
    assert_eq!(case.table(), None);
    assert_eq!(case.stop_hook(&case.sandbox, &resumed), 200);
    case.assert_agentenv_untouched();
}

/// A late stop of sandbox A after its namespace went to sandbox B leaves B's rules alone.
#[test]
fn a_late_stop_of_a_namespaces_previous_sandbox_leaves_the_next_ones_rules() {
    let case = Case::new("late");
    let (a, b) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    let (a1, b1) = (
        uuid::Uuid::now_v7().to_string(),
        uuid::Uuid::now_v7().to_string(),
    );
    for (sandbox, instance, cidr) in [(&a, &a1, "203.0.113.0/24"), (&b, &b1, "192.0.2.0/24")] {
        let mut start = case.start.clone();
        start["sandboxId"] = json!(sandbox);
        start["sandboxInstanceId"] = json!(instance);
        start["customExtensionParams"] = json!({"firewall": {"denyCidrs": [cidr]}});
        assert_eq!(case.ext().hook("start-fresh", start).0, 200);
    }
    assert_eq!(case.stop_hook(&a, &a1), 200);
    let table = case.table().expect("B's table after A's late stop");
    assert!(table.contains("192.0.2.0/24"), "{table}");
    assert_eq!(case.stop_hook(&b, &b1), 200);
    assert_eq!(case.table(), None, "table left after B's stop");
    case.assert_agentenv_untouched();
}
