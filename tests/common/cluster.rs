//! Three agentenv nodes on one machine behind HAProxy (issue 22, docs/cluster.md).
//!
//! Each node is the real server binary on a host of its own, as far as agentenv can tell:
//! - its own network namespace `aec-<node>` (links, routes, nftables, sysctls, its API on
//!   port 3000), with `eth0` at 198.51.100.1k for node `nk` (TEST-NET-2, RFC 5737);
//! - its own persistent mount namespace (bound on `/run/aec/mnt/<node>`, so it outlives a
//!   killed server and a restarted one comes back to the same "host"), in which private
//!   directories are bound over `/run/netns` (its slot namespace files) and `/run/agentenv`
//!   (its host lock and VM socket dirs), and a sysfs of its network namespace over `/sys`;
//! - its own state dir (a scratch dir, as for every test server).
//!
//! Slot names are derived from a per-server index alone (src/net/layout.rs:
//! `<netns_dir>/agentenv-ns-<n>`, the host-end link `aenv-<n>`, addresses from
//! `host_interaction_cidr` and `veth_cidr`), so all three nodes use the same names: they do
//! not collide because each node's files are in its own `/run/netns` and its links,
//! addresses and `inet agentenv` table in its own network namespace. The host's own
//! `/run/netns`, links and tables see none of them.
//!
//! The nodes' `eth0`s are veths to a bridge in the `aec-lan` namespace, where HAProxy runs
//! deploy/haproxy/haproxy.cfg as it is (its `${VAR}`s set) on 198.51.100.1:8080. The test
//! process reaches the lan through the veth `aec-host` (198.51.100.254/24).
//!
//! Everything is made with `ip`, `unshare`, `nsenter` and `mount` from argument vectors and
//! removed when the [`Cluster`] drops, also when the test fails: processes in a node's
//! namespaces are killed, the mount namespaces released (their slot namespaces go with
//! them), the network namespaces deleted (their veths go with them). A run that was
//! itself killed leaves its leftovers to the next run, whose start removes them first.

use super::{rand_u64, wait_until, Server};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The nodes' names, in order.
pub const NODES: [&str; 3] = ["n1", "n2", "n3"];
/// Every node's API port (each in its own network namespace).
pub const NODE_PORT: u16 = 3000;
/// Where HAProxy listens, in the lan namespace.
pub const LB_ADDR: &str = "198.51.100.1:8080";
/// The lan namespace: the bridge and HAProxy.
pub const LAN_NS: &str = "aec-lan";
/// The test process's end of the lan, in the host's namespace.
const HOST_LINK: &str = "aec-host";
const HOST_ADDR: &str = "198.51.100.254/24";
/// The nodes' runtime dirs and mount namespace files.
const ROOT: &str = "/run/aec";

/// The network namespace of node `name`.
pub fn node_ns(name: &str) -> String {
    format!("aec-{name}")
}

/// Node `name`'s address on the lan (`n1` is 198.51.100.11).
pub fn node_addr(name: &str) -> String {
    format!("198.51.100.1{}", name.trim_start_matches('n'))
}

/// Node `name`'s API URL, as peers and HAProxy reach it.
pub fn node_url(name: &str) -> String {
    format!("http://{}:{NODE_PORT}", node_addr(name))
}

fn mount_ns_file(name: &str) -> PathBuf {
    Path::new(ROOT).join("mnt").join(name)
}

fn node_dir(name: &str) -> PathBuf {
    Path::new(ROOT).join(name)
}

/// Runs `program args`, panicking with its stderr when it fails.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `program args` for cleanup: failures (nothing to remove) are ignored.
fn run_quietly(program: &str, args: &[&str]) {
    let _ = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// `program args` run inside node `name`'s network and mount namespaces.
pub fn in_node(name: &str, program: &str, args: &[&str]) -> String {
    let net = format!("--net=/run/netns/{}", node_ns(name));
    let mnt = format!("--mount={}", mount_ns_file(name).display());
    let mut all = vec![net.as_str(), mnt.as_str(), "--", program];
    all.extend_from_slice(args);
    run("nsenter", &all)
}

/// The lan, the nodes' namespaces and their runtime dirs; removed on drop.
pub struct Lan;

impl Lan {
    /// Removes what a killed run left, then builds the lan and one "host" per node.
    pub fn create() -> Lan {
        teardown();
        let lan = Lan;
        run("ip", &["netns", "add", LAN_NS]);
        let ip_lan = |args: &[&str]| run("ip", &[&["-n", LAN_NS], args].concat());
        ip_lan(&["link", "set", "lo", "up"]);
        ip_lan(&["link", "add", "br0", "type", "bridge"]);
        ip_lan(&["addr", "add", "198.51.100.1/24", "dev", "br0"]);
        ip_lan(&["link", "set", "br0", "up"]);
        run(
            "ip",
            &[
                "link", "add", HOST_LINK, "type", "veth", "peer", "name", "up0", "netns", LAN_NS,
            ],
        );
        run("ip", &["addr", "add", HOST_ADDR, "dev", HOST_LINK]);
        run("ip", &["link", "set", HOST_LINK, "up"]);
        ip_lan(&["link", "set", "up0", "master", "br0", "up"]);
        // The mount namespace files must sit on a mount that is not shared (unshare(1)).
        let mnt = Path::new(ROOT).join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        let mnt_s = mnt.to_str().unwrap();
        run("mount", &["--bind", mnt_s, mnt_s]);
        run("mount", &["--make-private", mnt_s]);
        for name in NODES {
            add_node_host(name);
        }
        lan
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        teardown();
    }
}

/// Node `name`'s network namespace on the lan and its mount namespace.
fn add_node_host(name: &str) {
    let ns = node_ns(name);
    run("ip", &["netns", "add", &ns]);
    let ip_node = |args: &[&str]| run("ip", &[&["-n", ns.as_str()], args].concat());
    ip_node(&["link", "set", "lo", "up"]);
    // The lan end is named after the node; the node's end is its eth0.
    run(
        "ip",
        &[
            "link", "add", &ns, "netns", LAN_NS, "type", "veth", "peer", "name", "eth0", "netns",
            &ns,
        ],
    );
    run(
        "ip",
        &["-n", LAN_NS, "link", "set", &ns, "master", "br0", "up"],
    );
    ip_node(&[
        "addr",
        "add",
        &format!("{}/24", node_addr(name)),
        "dev",
        "eth0",
    ]);
    ip_node(&["link", "set", "eth0", "up"]);
    ip_node(&["route", "add", "default", "via", "198.51.100.1"]);

    let dir = node_dir(name);
    for sub in ["netns", "run"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    // The mount targets must exist on the host (they usually do).
    for target in ["/run/netns", "/run/agentenv"] {
        std::fs::create_dir_all(target).unwrap();
    }
    let file = mount_ns_file(name);
    std::fs::write(&file, b"").unwrap();
    let persist = format!("--mount={}", file.display());
    run("unshare", &[&persist, "--propagation", "private", "true"]);
    let netns_dir = dir.join("netns").display().to_string();
    let run_dir = dir.join("run").display().to_string();
    in_node(name, "mount", &["--bind", &netns_dir, "/run/netns"]);
    in_node(name, "mount", &["--bind", &run_dir, "/run/agentenv"]);
    // As `ip netns exec`: /sys shows this network namespace's links.
    in_node(name, "mount", &["-t", "sysfs", "sysfs", "/sys"]);
}

/// The inode of the namespace bound on `file`, if one is.
fn ns_inode(file: &Path) -> Option<u64> {
    let m = std::fs::metadata(file).ok()?;
    let parent = std::fs::metadata(file.parent()?).ok()?;
    (m.len() == 0 && m.dev() != parent.dev()).then_some(m.ino())
}

/// PIDs of the processes whose namespace `kind` (`mnt`, `net`) has inode `ino`.
fn processes_in(kind: &str, ino: u64) -> Vec<u32> {
    let want = format!("{kind}:[{ino}]");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
                .is_ok_and(|l| l.to_string_lossy() == want)
        })
        .collect()
}

/// Kills every process in the nodes' mount and network namespaces and the lan's, and
/// waits (bounded) until they are gone.
fn kill_everything_inside() {
    let mut spaces = Vec::new();
    for name in NODES {
        if let Some(ino) = ns_inode(&mount_ns_file(name)) {
            spaces.push(("mnt", ino));
        }
        if let Some(ino) = ns_inode(&Path::new("/run/netns").join(node_ns(name))) {
            spaces.push(("net", ino));
        }
    }
    if let Some(ino) = ns_inode(&Path::new("/run/netns").join(LAN_NS)) {
        spaces.push(("net", ino));
    }
    let pids = || -> Vec<u32> {
        spaces
            .iter()
            .flat_map(|(kind, ino)| processes_in(kind, *ino))
            .collect()
    };
    for pid in pids() {
        run_quietly("kill", &["-KILL", &pid.to_string()]);
    }
    wait_until(Duration::from_secs(10), || pids().is_empty());
}

/// Removes everything [`Lan::create`] makes; each step tolerates its object's absence.
fn teardown() {
    kill_everything_inside();
    for name in NODES {
        run_quietly("umount", &["--lazy", mount_ns_file(name).to_str().unwrap()]);
    }
    run_quietly("umount", &["--lazy", &format!("{ROOT}/mnt")]);
    for name in NODES {
        run_quietly("ip", &["netns", "delete", &node_ns(name)]);
    }
    run_quietly("ip", &["netns", "delete", LAN_NS]);
    run_quietly("ip", &["link", "delete", HOST_LINK]);
    let _ = std::fs::remove_dir_all(ROOT);
}

/// What the cluster harness may leave on the host, listed (empty when clean): its
/// namespaces, its link, its mounts, its runtime dir.
pub fn host_leftovers() -> Vec<String> {
    let mut left: Vec<String> = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("aec-"))
                .collect()
        })
        .unwrap_or_default();
    if Path::new(&format!("/sys/class/net/{HOST_LINK}")).exists() {
        left.push(HOST_LINK.to_string());
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    left.extend(
        mounts
            .lines()
            .filter(|l| l.contains(ROOT))
            .map(|l| format!("mount: {l}")),
    );
    if Path::new(ROOT).exists() {
        left.push(ROOT.to_string());
    }
    left
}

/// A node's server: its config's `[cluster]` names it and lists every node as a peer;
/// `extra` is appended (further sections).
fn configure_node(name: &str, extra: &str) -> Server {
    let dir = std::env::temp_dir().join(format!(
        "aenv-e2e-{}-{name}-{:x}",
        std::process::id(),
        rand_u64()
    ));
    let peers: Vec<String> = NODES
        .iter()
        .map(|n| format!("\"{}\"", node_url(n)))
        .collect();
    Server::builder()
        .dir(&dir)
        .listen(&format!("0.0.0.0:{NODE_PORT}"))
        .url(&node_url(name))
        .launcher(vec![
            "nsenter".to_string(),
            format!("--net=/run/netns/{}", node_ns(name)),
            format!("--mount={}", mount_ns_file(name).display()),
            "--".to_string(),
        ])
        .section(&format!(
            "[cluster]\nnode = \"{name}\"\nadvertise_url = \"{url}\"\npeers = [{peers}]",
            url = node_url(name),
            peers = peers.join(", "),
        ))
        .section(extra)
        .configure()
}

/// HAProxy on deploy/haproxy/haproxy.cfg, as it is, in the lan namespace. The returned
/// [`Server`] talks to it (its log is HAProxy's output; its drop stops HAProxy).
fn start_haproxy() -> Server {
    let dir = std::env::temp_dir().join(format!(
        "aenv-e2e-{}-lb-{:x}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/haproxy/haproxy.cfg");
    let log_path = dir.join("haproxy.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{LAN_NS}"))
        .args(["--", "haproxy", "-db", "-f", config])
        .envs(haproxy_env())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    let child = cmd.spawn().expect("haproxy: run scripts/setup.sh");
    Server {
        child: Some(child),
        binary: PathBuf::from("haproxy"),
        launcher: Vec::new(),
        log_level: String::new(),
        stdout_to_log: true,
        base: format!("http://{LB_ADDR}"),
        state_dir: dir.join("state"),
        log_path,
        config_path: PathBuf::from(config),
        keep_alive: super::client(),
    }
}

/// The environment deploy/haproxy/haproxy.cfg expands.
pub fn haproxy_env() -> Vec<(String, String)> {
    let mut env = vec![("AENV_LB_BIND".to_string(), LB_ADDR.to_string())];
    for (i, name) in NODES.iter().enumerate() {
        env.push((
            format!("AENV_NODE{}", i + 1),
            format!("{}:{NODE_PORT}", node_addr(name)),
        ));
    }
    env
}

/// Three nodes behind HAProxy. Dropped in order: HAProxy, the nodes (a graceful stop
/// each), then the lan and everything in it.
pub struct Cluster {
    /// HAProxy: requests through it go to any node.
    pub lb: Server,
    /// The nodes, in the order of [`NODES`].
    pub nodes: Vec<Server>,
    _lan: Lan,
}

impl Cluster {
    /// Builds the lan, starts the three nodes and HAProxy, and waits until HAProxy's
    /// health checks have passed on every node.
    pub fn start() -> Cluster {
        Cluster::start_with(&[])
    }

    /// [`Cluster::start`] with more config for some nodes: (node, TOML sections).
    pub fn start_with(extra: &[(&str, &str)]) -> Cluster {
        let lan = Lan::create();
        let mut nodes = Vec::new();
        for name in NODES {
            let more = extra.iter().find(|(n, _)| *n == name).map_or("", |e| e.1);
            let mut node = configure_node(name, more);
            node.spawn();
            nodes.push(node);
        }
        let lb = start_haproxy();
        let cluster = Cluster {
            lb,
            nodes,
            _lan: lan,
        };
        for name in NODES {
            cluster.wait_lb_check(name, "succeeded");
        }
        cluster
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> &Server {
        let i = NODES.iter().position(|n| *n == name).unwrap();
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, name: &str) -> &mut Server {
        let i = NODES.iter().position(|n| *n == name).unwrap();
        &mut self.nodes[i]
    }

    /// Waits until HAProxy's log says node `name`'s health check `outcome` (`succeeded`,
    /// `failed`) since the start or the last time this was asked about that outcome.
    pub fn wait_lb_check(&self, name: &str, outcome: &str) {
        let needle = format!("Health check for server agentenv_nodes/{name} {outcome}");
        let seen = wait_until(Duration::from_secs(20), || {
            self.lb.log().matches(&needle).count() > self.lb_seen(&needle)
        });
        assert!(
            seen,
            "HAProxy never logged \"{needle}\":\n{}",
            self.lb.log()
        );
        self.mark_lb_seen(&needle);
    }

    fn lb_seen(&self, needle: &str) -> usize {
        let marks = self.lb.log_path.with_extension("seen");
        std::fs::read_to_string(marks)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == needle)
            .count()
    }

    fn mark_lb_seen(&self, needle: &str) {
        let marks = self.lb.log_path.with_extension("seen");
        let seen = self.lb.log().matches(needle).count();
        let mut text = std::fs::read_to_string(&marks).unwrap_or_default();
        for _ in self.lb_seen(needle)..seen {
            text.push_str(needle);
            text.push('\n');
        }
        std::fs::write(marks, text).unwrap();
    }

    /// What node `name` leaves on its host (empty when nothing): QEMU processes of its
    /// state dir, slot namespace files and mounts, `aenv-*` links, run dirs.
    pub fn node_leftovers(&self, name: &str) -> Vec<String> {
        let node = self.node(name);
        let mut left: Vec<String> =
            super::qemu_processes_with(&node.state_dir.display().to_string())
                .iter()
                .map(|pid| format!("qemu pid {pid}"))
                .collect();
        let files = std::fs::read_dir(node_dir(name).join("netns"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_else(|_| Vec::new());
        left.extend(files.into_iter().map(|f| format!("netns file {f}")));
        let mounts = in_node(name, "cat", &["/proc/self/mountinfo"]);
        left.extend(
            mounts
                .lines()
                .filter(|l| l.contains("agentenv-ns-"))
                .map(|l| format!("mount {l}")),
        );
        let links = run("ip", &["-n", &node_ns(name), "-o", "link"]);
        left.extend(
            links
                .lines()
                .filter_map(|l| l.split(": ").nth(1))
                .filter(|n| n.starts_with("aenv-"))
                .map(|n| format!("link {n}")),
        );
        left.extend(
            super::files_under(&node.state_dir.join("sandboxes"))
                .iter()
                .map(|p| format!("run dir {}", p.display())),
        );
        left
    }
}

/// Waits for `f` until `timeout`, then panics with `what`.
pub fn must(timeout: Duration, what: &str, f: impl FnMut() -> bool) {
    let start = Instant::now();
    assert!(
        wait_until(timeout, f),
        "{what} (waited {:?})",
        start.elapsed()
    );
}

/// `sh -c script` through envd's `process.Process/Start` (a Connect server stream) on
/// `s`, as the SDKs run commands: its stdout and exit code.
pub fn envd_sh(s: &Server, id: &str, token: &str, script: &str) -> (String, i64) {
    use base64::Engine;
    let msg =
        serde_json::json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}, "stdin": false})
            .to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg.as_bytes());
    let resp = ureq::post(&format!("{}/process.Process/Start", s.base))
        .set("E2b-Sandbox-Id", id)
        .set("X-Access-Token", token)
        .set("Content-Type", "application/connect+json")
        .timeout(Duration::from_secs(60))
        .send_bytes(&body)
        .unwrap_or_else(|e| panic!("envd Start via {}: {e}", s.base));
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut resp.into_reader(), &mut raw).unwrap();
    let (mut stdout, mut exit, mut rest) = (String::new(), -1, &raw[..]);
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let v: serde_json::Value = serde_json::from_slice(&rest[5..5 + len]).unwrap();
        if let Some(out) = v["event"]["data"]["stdout"].as_str() {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(out)
                .unwrap();
            stdout.push_str(&String::from_utf8_lossy(&bytes));
        }
        if let Some(end) = v["event"].get("end") {
            exit = end["exitCode"].as_i64().unwrap_or(0);
        }
        rest = &rest[5 + len..];
    }
    (stdout, exit)
}
