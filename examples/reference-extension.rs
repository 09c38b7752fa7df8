//! Reference custom extension for agentenv: a small, real HTTP service that an operator can
//! copy. It implements the hook contract of `docs/custom-extension.md` (spec:
//! `custom-extension.md`, "CE" below) and does one real thing per sandbox: it loads its own
//! nftables table, `table inet refext`, inside the sandbox's network namespace.
//!
//! ```text
//! cargo run --release --example reference-extension -- \
//!     --listen 127.0.0.1:9090 [--state-dir DIR] [--prefix /PATH] [--token TOKEN]
//! ```
//!
//! `customExtensionParams` understood by this extension (every key optional, others kept
//! and echoed back untouched):
//!
//! ```json
//! {
//!   "firewall": {
//!     "allowTcpPorts": [8080, 3000],
//!     "denyCidrs": ["203.0.113.0/24"]
//!   },
//!   "bootArgs": "quiet",
//!   "vpn": { "peers": [{ "name": "office", "endpoint": "198.51.100.7:51820" }] }
//! }
//! ```
//!
//! - `firewall.allowTcpPorts`: TCP ports (1..=65535) of the guest that the host may open
//!   connections to. Other new TCP connections from the host are dropped. The guest agent
//!   port (`--agent-port`, default 49983) is always allowed, or agentenv could no longer
//!   reach its own agent. Absent = no port restriction.
//! - `firewall.denyCidrs`: IPv4 networks the guest may never reach (useful when the
//!   operator turned `[network] outbound` on).
//! - `bootArgs`: returned as `extraBootArgs` by start-fresh (fresh boots only, custom-extension.md §11).
//! - `vpn`: stored and echoed back, and its peer count logged. This reference extension does
//!   **not** create tunnels; a real one would configure WireGuard in the namespace here.
//!
//! The table only narrows what agentenv's own table (`ip agentenv`) allows: in nftables a
//! packet must pass every base chain on a hook, so an `accept` here grants nothing. The
//! extension never touches `ip agentenv`, `veth0` or `tap0` (network.md §8).
//!
//! patch-params applies the client's PATCH body as a JSON merge patch (RFC 7396: objects
//! merge, `null` removes a key, everything else replaces) and returns the full new params.
//!
//! State (the latest instance of each running sandbox) lives in `<state-dir>/state.json`,
//! written atomically after every change, so a restart of this service loses nothing.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Our nftables table. Never `ip agentenv`: that one belongs to agentenv.
const TABLE: &str = "inet refext";
/// Requests larger than this are refused; agentenv's hook bodies are far smaller.
const MAX_BODY_BYTES: u64 = 1024 * 1024;
const WORKER_THREADS: usize = 4;

// ---------------------------------------------------------------------------------------
// Command line

struct Options {
    listen: String,
    state_dir: PathBuf,
    prefix: String,
    token: Option<String>,
    agent_port: u16,
}

const USAGE: &str = "usage: reference-extension [--listen ADDR] [--state-dir DIR] \
[--prefix /PATH] [--token TOKEN] [--agent-port PORT]
  --listen      address to serve on (default 127.0.0.1:9090)
  --state-dir   where state.json lives (default /var/lib/agentenv-refext)
  --prefix      path prefix in front of /sandbox-hook/<hook> (default none)
  --token       require 'Authorization: Bearer TOKEN' (or set REFEXT_TOKEN)
  --agent-port  guest port that is always allowed from the host (default 49983)";

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        listen: "127.0.0.1:9090".into(),
        state_dir: PathBuf::from("/var/lib/agentenv-refext"),
        prefix: String::new(),
        token: std::env::var("REFEXT_TOKEN").ok().filter(|t| !t.is_empty()),
        agent_port: 49983,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.into());
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--listen" => options.listen = value,
            "--state-dir" => options.state_dir = PathBuf::from(value),
            "--prefix" => options.prefix = value.trim_end_matches('/').to_string(),
            "--token" => options.token = Some(value).filter(|t| !t.is_empty()),
            "--agent-port" => {
                options.agent_port = value
                    .parse()
                    .map_err(|_| format!("--agent-port: {value:?} is not a port"))?
            }
            _ => return Err(format!("unknown option {flag}\n{USAGE}")),
        }
    }
    if !options.prefix.is_empty() && !options.prefix.starts_with('/') {
        return Err(format!(
            "--prefix must start with '/': {:?}",
            options.prefix
        ));
    }
    Ok(options)
}

// ---------------------------------------------------------------------------------------
// Durable state

/// The latest started instance of one sandbox. Removed again when its stop arrives.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Instance {
    sandbox_instance_id: String,
    network_namespace_path: String,
    /// Identity of the namespace behind the path when the start hook arrived (device and
    /// inode of the nsfs file). A late stop only touches the namespace if it is still the
    /// same one: the path may have been recycled for another slot by then (custom-extension.md §12).
    netns_dev: u64,
    netns_ino: u64,
    host_interaction_ip: String,
    params: Value,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// Keyed by `sandboxId`.
    instances: BTreeMap<String, Instance>,
}

struct Store {
    path: PathBuf,
    state: State,
}

impl Store {
    fn open(dir: &Path) -> Result<Store, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create state dir {}: {e}", dir.display()))?;
        let path = dir.join("state.json");
        let state = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("cannot parse {}: {e}", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        Ok(Store { path, state })
    }

    /// Temp file, fsync, rename, fsync dir: the file is always either old or new.
    fn save(&self) -> Result<(), String> {
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(&self.state).map_err(|e| e.to_string())?;
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            if let Some(dir) = self.path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

// ---------------------------------------------------------------------------------------
// Params: the firewall schema and the JSON merge patch

/// The validated `customExtensionParams.firewall`.
#[derive(Debug, Default, PartialEq)]
struct Firewall {
    allow_tcp_ports: Option<Vec<u16>>,
    deny_cidrs: Vec<(Ipv4Addr, u8)>,
}

impl Firewall {
    /// Validates `params.firewall`. Only validated numbers and addresses ever reach the
    /// nftables script, so params cannot inject rules.
    fn from_params(params: &Value) -> Result<Firewall, String> {
        let Some(firewall) = params.get("firewall").filter(|v| !v.is_null()) else {
            return Ok(Firewall::default());
        };
        let firewall = firewall.as_object().ok_or("firewall must be an object")?;
        let mut result = Firewall::default();
        for (key, value) in firewall {
            match key.as_str() {
                "allowTcpPorts" if value.is_null() => {}
                "allowTcpPorts" => {
                    let ports = value
                        .as_array()
                        .ok_or("firewall.allowTcpPorts must be an array of ports")?;
                    let ports = ports
                        .iter()
                        .map(|p| {
                            p.as_u64()
                                .filter(|p| (1..=65535).contains(p))
                                .map(|p| p as u16)
                                .ok_or_else(|| {
                                    format!("firewall.allowTcpPorts: {p} is not a port 1..=65535")
                                })
                        })
                        .collect::<Result<Vec<u16>, String>>()?;
                    result.allow_tcp_ports = Some(ports);
                }
                "denyCidrs" if value.is_null() => {}
                "denyCidrs" => {
                    let cidrs = value
                        .as_array()
                        .ok_or("firewall.denyCidrs must be an array of IPv4 CIDRs")?;
                    for cidr in cidrs {
                        result.deny_cidrs.push(parse_cidr(cidr).ok_or_else(|| {
                            format!("firewall.denyCidrs: {cidr} is not an IPv4 CIDR")
                        })?);
                    }
                }
                _ => return Err(format!("firewall.{key}: unknown key")),
            }
        }
        Ok(result)
    }

    fn is_empty(&self) -> bool {
        self.allow_tcp_ports.is_none() && self.deny_cidrs.is_empty()
    }

    /// The nftables script that replaces our table in one transaction (the `table` +
    /// `delete table` pair makes the delete succeed whether or not it existed).
    fn ruleset(&self, agent_port: u16) -> String {
        let mut script = format!("table {TABLE}\ndelete table {TABLE}\n");
        if self.is_empty() {
            return script;
        }
        let _ = writeln!(script, "table {TABLE} {{");
        script.push_str("  chain forward {\n");
        script.push_str("    type filter hook forward priority filter; policy accept;\n");
        if let Some(ports) = &self.allow_tcp_ports {
            let mut ports = ports.clone();
            ports.push(agent_port);
            ports.sort_unstable();
            ports.dedup();
            let list: Vec<String> = ports.iter().map(u16::to_string).collect();
            let _ = writeln!(
                script,
                "    iifname \"veth0\" oifname \"tap0\" ct state new tcp dport != {{ {} }} drop",
                list.join(", ")
            );
        }
        if !self.deny_cidrs.is_empty() {
            let list: Vec<String> = self
                .deny_cidrs
                .iter()
                .map(|(addr, len)| format!("{addr}/{len}"))
                .collect();
            let _ = writeln!(
                script,
                "    iifname \"tap0\" ip daddr {{ {} }} drop",
                list.join(", ")
            );
        }
        script.push_str("  }\n}\n");
        script
    }

    fn summary(&self) -> String {
        if self.is_empty() {
            return "firewall=none".into();
        }
        let ports = match &self.allow_tcp_ports {
            Some(ports) => ports.len().to_string(),
            None => "any".into(),
        };
        format!("allowTcpPorts={ports} denyCidrs={}", self.deny_cidrs.len())
    }
}

/// `a.b.c.d/len` with the host bits zero (nft refuses the others).
fn parse_cidr(value: &Value) -> Option<(Ipv4Addr, u8)> {
    let (addr, len) = value.as_str()?.split_once('/')?;
    let addr: Ipv4Addr = addr.parse().ok()?;
    let len: u8 = len.parse().ok().filter(|l| *l <= 32)?;
    let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
    (u32::from(addr) & !mask == 0).then_some((addr, len))
}

/// RFC 7396 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let target = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

fn vpn_summary(params: &Value) -> String {
    match params.pointer("/vpn/peers").and_then(Value::as_array) {
        Some(peers) => format!(" vpnPeers={} (stored only, no tunnel)", peers.len()),
        None => String::new(),
    }
}

// ---------------------------------------------------------------------------------------
// The namespace: `nsenter --net=<path> nft -f -`, explicit argv, ruleset on stdin

fn netns_identity(path: &str) -> Result<(u64, u64), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("namespace {path}: {e}"))?;
    Ok((meta.dev(), meta.ino()))
}

fn run_nft(netns_path: &str, script: &str) -> Result<(), String> {
    let mut child = Command::new("nsenter")
        .arg(format!("--net={netns_path}"))
        .args(["--", "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nsenter: {e}"))?;
    // A short script fits in the pipe buffer, so writing before waiting cannot deadlock.
    let written = child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(script.as_bytes());
    let output = child
        .wait_with_output()
        .map_err(|e| format!("nsenter: {e}"))?;
    written.map_err(|e| format!("cannot write the ruleset to nft: {e}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft in {netns_path} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

// ---------------------------------------------------------------------------------------
// Hooks

/// What a hook answers: a status, a JSON body and a short text for the log line.
struct Reply {
    status: u16,
    body: Value,
    note: String,
}

impl Reply {
    fn ok(body: Value, note: impl Into<String>) -> Reply {
        Reply {
            status: 200,
            body,
            note: note.into(),
        }
    }

    fn error(status: u16, message: impl Into<String>) -> Reply {
        let message = message.into();
        Reply {
            status,
            body: json!({ "error": message }),
            note: message,
        }
    }
}

struct Extension {
    store: Mutex<Store>,
    agent_port: u16,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartRequest {
    sandbox_id: String,
    sandbox_instance_id: String,
    network_namespace_path: String,
    host_interaction_ip: String,
    #[serde(default)]
    custom_extension_params: Value,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PatchRequest {
    sandbox_id: String,
    patch: Value,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StopRequest {
    sandbox_id: String,
    sandbox_instance_id: String,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Reply> {
    serde_json::from_slice(body).map_err(|e| Reply::error(400, format!("bad request body: {e}")))
}

impl Extension {
    // One lock over the whole hook, nft included: hooks are applied in arrival order, so
    // overlapping patch-params calls of one sandbox cannot interleave (custom-extension.md §6.5). Each hook
    // is a few milliseconds of work, well inside agentenv's timeout_ms.

    fn start(&self, body: &[u8], fresh: bool) -> Reply {
        let req: StartRequest = match parse(body) {
            Ok(req) => req,
            Err(reply) => return reply,
        };
        let params = match req.custom_extension_params {
            Value::Null => json!({}),
            Value::Object(map) => Value::Object(map),
            _ => return Reply::error(400, "customExtensionParams must be an object"),
        };
        let firewall = match Firewall::from_params(&params) {
            Ok(firewall) => firewall,
            Err(why) => return Reply::error(422, why),
        };
        let boot_args = match params.get("bootArgs") {
            None | Some(Value::Null) => None,
            Some(Value::String(args)) => Some(args.clone()),
            Some(_) => return Reply::error(422, "bootArgs must be a string"),
        };
        if req.host_interaction_ip.parse::<Ipv4Addr>().is_err() {
            return Reply::error(400, "hostInteractionIp is not an IPv4 address");
        }
        if !req.network_namespace_path.starts_with('/') {
            return Reply::error(400, "networkNamespacePath must be absolute");
        }
        let (netns_dev, netns_ino) = match netns_identity(&req.network_namespace_path) {
            Ok(id) => id,
            Err(why) => return Reply::error(422, why),
        };

        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let instance = Instance {
            sandbox_instance_id: req.sandbox_instance_id.clone(),
            network_namespace_path: req.network_namespace_path.clone(),
            netns_dev,
            netns_ino,
            host_interaction_ip: req.host_interaction_ip.clone(),
            params: params.clone(),
        };
        // Record the instance before touching the namespace: if what follows fails,
        // agentenv still sends stop for this pair (custom-extension.md §7.3), and that stop cleans up.
        let previous = store
            .state
            .instances
            .insert(req.sandbox_id.clone(), instance);
        if let Err(why) = store.save() {
            return Reply::error(500, why);
        }
        if let Some(previous) = previous {
            log::warn!(
                "sandboxId={} replaced instance {} whose stop never arrived",
                req.sandbox_id,
                previous.sandbox_instance_id
            );
        }
        if let Err(why) = run_nft(
            &req.network_namespace_path,
            &firewall.ruleset(self.agent_port),
        ) {
            return Reply::error(500, why);
        }
        let note = format!(
            "netns={} hostIp={} {}{}",
            req.network_namespace_path,
            req.host_interaction_ip,
            firewall.summary(),
            vpn_summary(&params)
        );
        // extraBootArgs is read from start-fresh only (custom-extension.md §3.1); start-resume ignores bodies.
        match (fresh, boot_args) {
            (true, Some(args)) => Reply::ok(json!({ "extraBootArgs": args }), note),
            _ => Reply::ok(json!({}), note),
        }
    }

    fn patch_params(&self, body: &[u8]) -> Reply {
        let req: PatchRequest = match parse(body) {
            Ok(req) => req,
            Err(reply) => return reply,
        };
        if !req.patch.is_object() {
            return Reply::error(400, "patch must be an object");
        }
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        let Some(instance) = store.state.instances.get(&req.sandbox_id) else {
            return Reply::error(404, format!("unknown sandbox {}", req.sandbox_id));
        };
        let mut params = instance.params.clone();
        merge_patch(&mut params, &req.patch);
        let firewall = match Firewall::from_params(&params) {
            Ok(firewall) => firewall,
            Err(why) => return Reply::error(422, why),
        };
        if params.get("bootArgs").is_some_and(|v| !v.is_string()) {
            return Reply::error(422, "bootArgs must be a string");
        }
        // nft -f is one transaction: on failure the old rules stay and so do the params.
        if let Err(why) = run_nft(
            &instance.network_namespace_path,
            &firewall.ruleset(self.agent_port),
        ) {
            return Reply::error(500, why);
        }
        let note = format!(
            "latestInstance={} {}{}",
            instance.sandbox_instance_id,
            firewall.summary(),
            vpn_summary(&params)
        );
        if let Some(instance) = store.state.instances.get_mut(&req.sandbox_id) {
            instance.params = params.clone();
        }
        if let Err(why) = store.save() {
            return Reply::error(500, why);
        }
        Reply::ok(json!({ "customExtensionParams": params }), note)
    }

    fn stop(&self, body: &[u8]) -> Reply {
        let req: StopRequest = match parse(body) {
            Ok(req) => req,
            Err(reply) => return reply,
        };
        let mut store = self.store.lock().unwrap_or_else(|e| e.into_inner());
        // Fence on the pair (custom-extension.md §4.8): a stop for anything but the latest started
        // instance, or a repeated stop, is answered 2xx and changes nothing.
        let latest = store.state.instances.get(&req.sandbox_id);
        let Some(instance) = latest.filter(|i| i.sandbox_instance_id == req.sandbox_instance_id)
        else {
            let note = match latest {
                Some(i) => format!("ignored: latest instance is {}", i.sandbox_instance_id),
                None => "ignored: no running instance (duplicate or unknown stop)".into(),
            };
            return Reply::ok(json!({}), note);
        };
        let path = instance.network_namespace_path.clone();
        let same_namespace =
            netns_identity(&path).is_ok_and(|id| id == (instance.netns_dev, instance.netns_ino));
        // A retried stop can arrive after the slot went to another sandbox (custom-extension.md §3.4).
        let claimed_by_other = store.state.instances.iter().any(|(id, other)| {
            *id != req.sandbox_id
                && (other.netns_dev, other.netns_ino) == (instance.netns_dev, instance.netns_ino)
        });
        let note = if !same_namespace {
            "namespace gone or replaced; nothing to remove".to_string()
        } else if claimed_by_other {
            "namespace now belongs to another sandbox; left alone".to_string()
        } else {
            // The bare `table` + `delete table` pair: removing is idempotent.
            if let Err(why) = run_nft(&path, &Firewall::default().ruleset(self.agent_port)) {
                // Keep the instance so agentenv's retry can try again.
                return Reply::error(500, why);
            }
            format!("removed table {TABLE} from {path}")
        };
        store.state.instances.remove(&req.sandbox_id);
        if let Err(why) = store.save() {
            return Reply::error(500, why);
        }
        Reply::ok(json!({}), note)
    }
}

// ---------------------------------------------------------------------------------------
// HTTP

fn header<'a>(request: &'a tiny_http::Request, name: &'static str) -> Option<&'a str> {
    request
        .headers()
        .iter()
        .find(|h| h.field.equiv(name))
        .map(|h| h.value.as_str())
}

/// Compares without an early exit, so response time does not reveal the token.
fn token_matches(expected: &str, authorization: Option<&str>) -> bool {
    let Some(given) = authorization.and_then(|a| a.strip_prefix("Bearer ")) else {
        return false;
    };
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

fn handle(extension: &Extension, options: &Options, mut request: tiny_http::Request) {
    let started = Instant::now();
    let url = request.url().split('?').next().unwrap_or("").to_string();
    let hook = url
        .strip_prefix(options.prefix.as_str())
        .and_then(|rest| rest.strip_prefix("/sandbox-hook/"))
        .unwrap_or("")
        .to_string();
    let context = format!(
        "requestId={} attempt={}{}",
        header(&request, "X-Request-Id").unwrap_or("-"),
        header(&request, "X-Agentenv-Attempt").unwrap_or("-"),
        header(&request, "X-Agentenv-Stop-Reason")
            .map(|r| format!(" stopReason={r}"))
            .unwrap_or_default(),
    );

    let mut body = Vec::new();
    let reply = if *request.method() != tiny_http::Method::Post {
        Reply::error(405, "only POST is served")
    } else if !matches!(
        hook.as_str(),
        "start-fresh" | "start-resume" | "patch-params" | "stop"
    ) {
        Reply::error(404, format!("no such hook: {url}"))
    } else if options
        .token
        .as_deref()
        .is_some_and(|t| !token_matches(t, header(&request, "Authorization")))
    {
        Reply::error(401, "missing or wrong bearer token")
    } else if let Err(e) = request
        .as_reader()
        .take(MAX_BODY_BYTES + 1)
        .read_to_end(&mut body)
    {
        Reply::error(400, format!("cannot read body: {e}"))
    } else if body.len() as u64 > MAX_BODY_BYTES {
        Reply::error(413, "body too large")
    } else {
        match hook.as_str() {
            "start-fresh" => extension.start(&body, true),
            "start-resume" => extension.start(&body, false),
            "patch-params" => extension.patch_params(&body),
            _ => extension.stop(&body),
        }
    };

    let ids = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
    let field = |key: &str| match ids.get(key).and_then(Value::as_str) {
        Some(value) => format!(" {key}={value}"),
        None => String::new(),
    };
    let line = format!(
        "hook={}{}{} {context} status={} ms={} {}",
        if hook.is_empty() { url.as_str() } else { &hook },
        field("sandboxId"),
        field("sandboxInstanceId"),
        reply.status,
        started.elapsed().as_millis(),
        reply.note
    );
    if reply.status < 300 {
        log::info!("{line}");
    } else {
        log::warn!("{line}");
    }

    let mut response = tiny_http::Response::from_string(reply.body.to_string())
        .with_status_code(reply.status)
        .with_header(
            "Content-Type: application/json"
                .parse::<tiny_http::Header>()
                .expect("static header"),
        );
    if reply.status == 401 {
        response = response.with_header(
            "WWW-Authenticate: Bearer"
                .parse::<tiny_http::Header>()
                .expect("static header"),
        );
    }
    if let Err(e) = request.respond(response) {
        log::warn!("hook={hook} cannot send the response: {e}");
    }
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let store = match Store::open(&options.state_dir) {
        Ok(store) => store,
        Err(message) => {
            log::error!("{message}");
            return ExitCode::FAILURE;
        }
    };
    let server = match tiny_http::Server::http(&options.listen) {
        Ok(server) => Arc::new(server),
        Err(e) => {
            log::error!("cannot listen on {}: {e}", options.listen);
            return ExitCode::FAILURE;
        }
    };
    log::info!(
        "reference extension listening on http://{}{} state={} instances={} token={}",
        options.listen,
        options.prefix,
        store.path.display(),
        store.state.instances.len(),
        if options.token.is_some() {
            "required"
        } else {
            "off"
        }
    );
    let extension = Arc::new(Extension {
        store: Mutex::new(store),
        agent_port: options.agent_port,
    });
    let options = Arc::new(options);
    let workers: Vec<_> = (0..WORKER_THREADS)
        .map(|_| {
            let (server, extension, options) = (server.clone(), extension.clone(), options.clone());
            std::thread::spawn(move || {
                for request in server.incoming_requests() {
                    handle(&extension, &options, request);
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_patch_follows_rfc7396() {
        let mut params = json!({"a": {"b": 1, "c": 2}, "vpn": {"peers": ["x"]}, "d": 1});
        merge_patch(
            &mut params,
            &json!({"a": {"b": null, "e": 3}, "vpn": {"peers": ["y", "z"]}, "d": null}),
        );
        assert_eq!(
            params,
            json!({"a": {"c": 2, "e": 3}, "vpn": {"peers": ["y", "z"]}})
        );
    }

    #[test]
    fn firewall_schema_is_validated() {
        let ok = json!({"firewall": {"allowTcpPorts": [8080], "denyCidrs": ["203.0.113.0/24"]}});
        let firewall = Firewall::from_params(&ok).unwrap();
        let script = firewall.ruleset(49983);
        assert!(
            script.contains("tcp dport != { 8080, 49983 } drop"),
            "{script}"
        );
        assert!(
            script.contains("ip daddr { 203.0.113.0/24 } drop"),
            "{script}"
        );
        for bad in [
            json!({"firewall": []}),
            json!({"firewall": {"allowTcpPorts": [0]}}),
            json!({"firewall": {"allowTcpPorts": ["22; flush ruleset"]}}),
            json!({"firewall": {"denyCidrs": ["203.0.113.1/24"]}}),
            json!({"firewall": {"denyCidrs": ["10.0.0.0/33"]}}),
            json!({"firewall": {"other": 1}}),
        ] {
            assert!(Firewall::from_params(&bad).is_err(), "{bad}");
        }
        assert!(Firewall::from_params(&json!({})).unwrap().is_empty());
        assert_eq!(
            Firewall::default().ruleset(49983),
            "table inet refext\ndelete table inet refext\n"
        );
    }

    #[test]
    fn bearer_token_must_match_exactly() {
        assert!(token_matches("s3cret", Some("Bearer s3cret")));
        assert!(!token_matches("s3cret", Some("Bearer s3cre")));
        assert!(!token_matches("s3cret", Some("s3cret")));
        assert!(!token_matches("s3cret", None));
    }
}
