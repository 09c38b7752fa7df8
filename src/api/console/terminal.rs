//! The console's terminal: a PTY in a running sandbox, through its guest's envd, over a
//! WebSocket at `GET /console/terminal/{sandboxID}?cols=&rows=` (docs/console.md).
//!
//! Credentials: a browser cannot give a WebSocket headers, so the page offers two
//! subprotocols, `agentenv.terminal` and `agentenv.key.<API key>`; the key is compared in
//! constant time and a request without it is 401 before anything is looked up. An
//! `Origin` naming another host than `Host` is 403.
//!
//! Threads: a quick-lane worker only checks the request ([`Terminals::divert`]) and hands
//! it to a `console-pty` thread, which upgrades the connection (the WebSocket protocol is
//! `tungstenite`'s) and starts `process.Process/Start` with a PTY as the sandbox's
//! default user (envd's, no `Authorization`). A `console-pty-out` thread reads the PTY's
//! output stream into a bounded queue; the `console-pty` thread moves it to the browser
//! in batches and sends the browser's keys and sizes to envd (`SendInput`, `Update`).
//! A flood of output is held back by the queue (the guest's own stream waits), so memory
//! stays bounded and no API worker is involved. When the browser goes (tab closed,
//! connection lost, a write stalled past `[server] write_timeout_secs`), the process
//! gets SIGKILL. Terminals are bounded in total and per sandbox (429 beyond).

use super::super::ApiError;
use crate::cluster::id::is_sandbox_id;
use crate::envd::{self, Framing, Outgoing, Patience};
use crate::orchestrator::{EnvdRoute, EnvdTarget, Orchestrator};
use crate::protocol::connect::{self, FLAG_END_STREAM};
use crate::util::constant_time_eq;
use crossbeam_channel::{bounded, Receiver, Sender, TryRecvError};
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::Duration;
use tiny_http::{Request, Response, StatusCode};
use tungstenite::protocol::{Role, WebSocketConfig};
use tungstenite::{Message, WebSocket};

/// Terminals open at once, over all sandboxes.
pub const MAX_TERMINALS: usize = 16;
/// Terminals open at once in one sandbox.
pub const MAX_PER_SANDBOX: usize = 4;
/// The subprotocol the server answers with.
pub const PROTOCOL: &str = "agentenv.terminal";
/// The subprotocol that carries the API key: `agentenv.key.<key>`.
pub const KEY_PREFIX: &str = "agentenv.key.";
/// Largest message taken from the browser (a paste).
const MAX_INPUT: usize = 64 * 1024;
/// Output chunks queued between the guest and the browser.
const QUEUE: usize = 64;
/// Most output bytes in one WebSocket message.
const BATCH: usize = 64 * 1024;
/// How long a read of the browser waits before the queued output goes out.
const POLL: Duration = Duration::from_millis(20);
/// How long one unary envd call (input, resize, kill) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A terminal with no output for this long (keepalives count) is ended.
const QUIET: Duration = Duration::from_secs(3600);

/// The sandbox of a terminal path.
pub fn sandbox_of(path: &str) -> Option<&str> {
    path.strip_prefix("/console/terminal/")
        .filter(|id| is_sandbox_id(id))
}

/// The open terminals, and what they need to start.
pub struct Terminals {
    orchestrator: Arc<Orchestrator>,
    api_key: String,
    open: Mutex<HashMap<String, usize>>,
}

/// One terminal's place in the bounds; given back on drop.
struct Permit {
    terminals: Arc<Terminals>,
    sandbox: String,
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut open = self.terminals.open.lock();
        if let Some(n) = open.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.sandbox);
            }
        }
    }
}

impl Terminals {
    pub fn new(orchestrator: Arc<Orchestrator>, api_key: String) -> Self {
        Terminals {
            orchestrator,
            api_key,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a terminal's WebSocket request, answers refusals at once and serves the rest
    /// on a `console-pty` thread; gives any other request back.
    pub fn divert(self: &Arc<Self>, request: Request) -> Option<Request> {
        let path = request.url().split('?').next().unwrap_or("");
        let Some(sandbox) = sandbox_of(path).map(str::to_string) else {
            return Some(request);
        };
        if !wants_websocket(&request) {
            return Some(request);
        }
        let (permit, target) = match self.admit(&request, &sandbox) {
            Ok(admitted) => admitted,
            Err(e) => {
                log::info!(
                    "sandboxId={sandbox} op=terminal status={} error=\"{}\"",
                    e.status,
                    e.message
                );
                let _ = super::super::respond_error(request, &e);
                return None;
            }
        };
        let terminals = self.clone();
        let spawned = std::thread::Builder::new()
            .name("console-pty".into())
            .spawn(move || terminals.serve(request, &permit, &target));
        if let Err(e) = spawned {
            log::error!("op=terminal error=\"cannot spawn a terminal thread: {e}\"");
        }
        None
    }

    /// The checks, in order: key, origin, handshake, sandbox, bounds.
    fn admit(
        self: &Arc<Self>,
        request: &Request,
        sandbox: &str,
    ) -> Result<(Permit, EnvdTarget), ApiError> {
        let protocols = header(request, "Sec-WebSocket-Protocol").unwrap_or("");
        if !key_offered(protocols, &self.api_key) {
            return Err(ApiError::new(
                401,
                format!("missing or invalid API key: offer the subprotocols {PROTOCOL} and {KEY_PREFIX}<key>"),
            ));
        }
        if !same_origin(header(request, "Origin"), header(request, "Host")) {
            return Err(ApiError::new(403, "the WebSocket's Origin is another site"));
        }
        if header(request, "Sec-WebSocket-Version") != Some("13")
            || header(request, "Sec-WebSocket-Key").is_none()
        {
            return Err(ApiError::bad_request(
                "not a WebSocket handshake (Sec-WebSocket-Version 13 and Sec-WebSocket-Key needed)",
            ));
        }
        let target = match self.orchestrator.envd_route(sandbox) {
            EnvdRoute::Running(t) => t,
            EnvdRoute::PausedOnIoError { message, .. } => return Err(ApiError::new(507, message)),
            EnvdRoute::NotRunning { .. } => {
                return Err(ApiError::new(
                    409,
                    format!("sandbox {sandbox} is not running: resume it first"),
                ))
            }
            EnvdRoute::Unknown => {
                return Err(ApiError::not_found(format!("sandbox {sandbox} not found")))
            }
        };
        let mut open = self.open.lock();
        let total: usize = open.values().sum();
        let mine = open.get(sandbox).copied().unwrap_or(0);
        if total >= MAX_TERMINALS || mine >= MAX_PER_SANDBOX {
            return Err(ApiError::new(
                429,
                format!("{MAX_TERMINALS} terminals (or {MAX_PER_SANDBOX} in this sandbox) are open; close one first"),
            ));
        }
        *open.entry(sandbox.to_string()).or_insert(0) += 1;
        let permit = Permit {
            terminals: self.clone(),
            sandbox: sandbox.to_string(),
        };
        Ok((permit, target))
    }

    /// On the `console-pty` thread: upgrade, start the PTY, relay until either side ends.
    fn serve(&self, request: Request, permit: &Permit, target: &EnvdTarget) {
        let sandbox = permit.sandbox.as_str();
        let port = self.orchestrator.config().agent.port;
        let addr = SocketAddr::V4(SocketAddrV4::new(target.host_ip, port));
        self.orchestrator.init_guest(sandbox, target, addr);
        let size = initial_size(request.url());
        let accept = header(&request, "Sec-WebSocket-Key")
            .map(|k| tungstenite::handshake::derive_accept_key(k.as_bytes()))
            .unwrap_or_default();
        // Reads of the upgraded stream wake every POLL, so queued output goes out.
        request.set_body_timeout(Some(POLL));
        let response = Response::empty(StatusCode(101))
            .with_header(h("Sec-WebSocket-Accept", &accept))
            .with_header(h("Sec-WebSocket-Protocol", PROTOCOL));
        let stream = request.upgrade("websocket", response);
        let config = WebSocketConfig::default()
            .max_message_size(Some(MAX_INPUT))
            .max_frame_size(Some(MAX_INPUT));
        let mut ws = WebSocket::from_raw_socket(Polled(stream), Role::Server, Some(config));
        let alive = {
            let (o, id, instance) = (
                self.orchestrator.clone(),
                sandbox.to_string(),
                target.instance,
            );
            Arc::new(move || o.envd_instance_alive(&id, instance))
                as Arc<dyn Fn() -> bool + Send + Sync>
        };
        let session = match Pty::start(addr, size, alive) {
            Ok(s) => s,
            Err(e) => {
                log::info!("sandboxId={sandbox} op=terminal error=\"{e}\"");
                let _ = ws.send(event(json!({"type": "error", "message": e})));
                let _ = ws.close(None);
                let _ = ws.flush();
                return;
            }
        };
        log::info!(
            "sandboxId={sandbox} op=terminal pid={} event=open",
            session.pid
        );
        let ended = relay(&mut ws, &session);
        if !ended {
            session.kill();
        }
        log::info!(
            "sandboxId={sandbox} op=terminal pid={} event=close exited={ended}",
            session.pid
        );
        let _ = ws.close(None);
        let _ = ws.flush();
    }
}

/// What the output thread hands to the relay.
enum Output {
    Data(Vec<u8>),
    /// The process ended (its status) or the stream broke (why).
    End(String),
}

/// A PTY process in the guest: its pid, where its envd is, and its output queue.
struct Pty {
    addr: SocketAddr,
    pid: u64,
    output: Receiver<Output>,
}

impl Pty {
    /// Starts `/bin/bash -i -l` (or `/bin/sh -i` in images without bash) with a PTY of
    /// `size` (cols, rows), and its output thread.
    fn start(
        addr: SocketAddr,
        size: (u32, u32),
        alive: Arc<dyn Fn() -> bool + Send + Sync>,
    ) -> Result<Pty, String> {
        let mut last = String::new();
        for (cmd, args) in [("/bin/bash", vec!["-i", "-l"]), ("/bin/sh", vec!["-i"])] {
            let request = json!({
                "process": {"cmd": cmd, "args": args,
                            "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}},
                "pty": {"size": {"cols": size.0, "rows": size.1}},
            });
            match open_stream(addr, &request, alive.clone()) {
                Ok((pid, body)) => {
                    let (tx, rx) = bounded(QUEUE);
                    std::thread::Builder::new()
                        .name("console-pty-out".into())
                        .spawn(move || pump(body, &tx))
                        .map_err(|e| format!("cannot spawn the terminal's output thread: {e}"))?;
                    return Ok(Pty {
                        addr,
                        pid,
                        output: rx,
                    });
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// A unary `process.Process` call about this process.
    fn call(&self, method: &str, body: Value) -> Result<(), String> {
        let path = format!("/process.Process/{method}");
        let (status, answer) = envd::call(
            self.addr,
            "POST",
            &path,
            "application/json",
            body.to_string().as_bytes(),
            CALL_TIMEOUT,
        )
        .map_err(|e| e.to_string())?;
        if status == 200 {
            Ok(())
        } else {
            Err(format!(
                "{method}: envd answered {status}: {}",
                String::from_utf8_lossy(&answer)
            ))
        }
    }

    fn input(&self, bytes: &[u8]) -> Result<(), String> {
        let data = connect::encode_bytes(bytes);
        self.call(
            "SendInput",
            json!({"process": {"pid": self.pid}, "input": {"pty": data}}),
        )
    }

    fn resize(&self, cols: u32, rows: u32) -> Result<(), String> {
        let size = json!({"cols": cols, "rows": rows});
        self.call(
            "Update",
            json!({"process": {"pid": self.pid}, "pty": {"size": size}}),
        )
    }

    fn kill(&self) {
        let kill = json!({"process": {"pid": self.pid}, "signal": "SIGNAL_SIGKILL"});
        if let Err(e) = self.call("SendSignal", kill) {
            log::info!("op=terminal pid={} kill_error=\"{e}\"", self.pid);
        }
    }
}

/// Sends `Start` and reads up to its `start` event: the pid and the rest of the stream.
fn open_stream(
    addr: SocketAddr,
    request: &Value,
    alive: Arc<dyn Fn() -> bool + Send + Sync>,
) -> Result<(u64, Box<dyn Read + Send>), String> {
    let patience = Patience { idle: QUIET, alive };
    let mut conn = envd::Connection::open(addr, patience).map_err(|e| e.to_string())?;
    let body = connect::envelope(0, request.to_string().as_bytes());
    let headers = [
        (
            "Content-Type".to_string(),
            "application/connect+json".to_string(),
        ),
        ("Keepalive-Ping-Interval".to_string(), "30".to_string()),
    ];
    let outgoing = Outgoing {
        method: "POST",
        target: "/process.Process/Start",
        host: "envd",
        headers: &headers,
        body: Framing::Length(body.len() as u64),
        upgrade: None,
    };
    conn.send(&outgoing, &mut &body[..])
        .map_err(|e| e.to_string())?;
    let mut answer = conn.answer(false).map_err(|e| e.to_string())?;
    if answer.status != 200 {
        return Err(format!(
            "envd refused the terminal (HTTP {})",
            answer.status
        ));
    }
    loop {
        let (flags, msg) = connect::read_envelope(&mut answer.body)
            .map_err(|e| e.message)?
            .ok_or("the terminal's stream ended before the shell started")?;
        let msg: Value =
            serde_json::from_slice(&msg).map_err(|e| format!("bad message from envd: {e}"))?;
        if flags & FLAG_END_STREAM != 0 {
            let why = msg["error"]["message"]
                .as_str()
                .unwrap_or("no reason given");
            return Err(format!("the shell could not be started: {why}"));
        }
        if let Some(pid) = msg["event"]["start"]["pid"].as_u64() {
            return Ok((pid, answer.body));
        }
    }
}

/// On `console-pty-out`: the PTY's output into the queue (waits while it is full), then
/// how it ended.
fn pump(mut body: Box<dyn Read + Send>, tx: &Sender<Output>) {
    let end = loop {
        let (flags, msg) = match connect::read_envelope(&mut body) {
            Ok(Some(m)) => m,
            Ok(None) => break "the terminal's stream ended".to_string(),
            Err(e) => break format!("the terminal's stream broke: {}", e.message),
        };
        let Ok(msg) = serde_json::from_slice::<Value>(&msg) else {
            break "bad message from envd".into();
        };
        if flags & FLAG_END_STREAM != 0 {
            break msg["error"]["message"]
                .as_str()
                .unwrap_or("the shell ended")
                .to_string();
        }
        let event = &msg["event"];
        if let Some(data) = event["data"]["pty"].as_str() {
            let Ok(bytes) = connect::decode_bytes(data) else {
                break "bad output from envd".into();
            };
            if tx.send(Output::Data(bytes)).is_err() {
                return; // the browser went
            }
        } else if let Some(end) = event.get("end") {
            break end["status"].as_str().unwrap_or("exited").to_string();
        }
    };
    let _ = tx.send(Output::End(end));
}

/// Moves output to the browser and input to the PTY until one side ends; whether the
/// process ended (else the browser went).
fn relay<S: Read + Write>(ws: &mut WebSocket<S>, pty: &Pty) -> bool {
    loop {
        match ws.read() {
            Ok(Message::Text(text)) => {
                if let Err(e) = control(pty, text.as_str()) {
                    let _ = ws.send(event(json!({"type": "error", "message": e})));
                }
            }
            Ok(Message::Binary(bytes)) => {
                if let Err(e) = pty.input(&bytes) {
                    let _ = ws.send(event(json!({"type": "error", "message": e})));
                }
            }
            Ok(Message::Close(_)) => return false,
            Ok(_) => {}
            Err(tungstenite::Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return false,
        }
        let mut batch = Vec::new();
        let mut end = None;
        while batch.len() < BATCH {
            match pty.output.try_recv() {
                Ok(Output::Data(d)) => batch.extend_from_slice(&d),
                Ok(Output::End(why)) => {
                    end = Some(why);
                    break;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    end = Some("the terminal's output thread ended".into());
                    break;
                }
            }
        }
        if !batch.is_empty() && ws.send(Message::binary(batch)).is_err() {
            return false;
        }
        if let Some(status) = end {
            let _ = ws.send(event(json!({"type": "exit", "status": status})));
            return true;
        }
    }
}

/// A control message from the page: `{"type":"input","data":"..."}` or
/// `{"type":"resize","cols":N,"rows":N}`.
fn control(pty: &Pty, text: &str) -> Result<(), String> {
    let msg: Value = serde_json::from_str(text).map_err(|e| format!("bad control message: {e}"))?;
    match msg["type"].as_str() {
        Some("input") => {
            let data = msg["data"].as_str().ok_or("input needs data")?;
            pty.input(data.as_bytes())
        }
        Some("resize") => {
            let (cols, rows) = (dimension(&msg["cols"]), dimension(&msg["rows"]));
            match (cols, rows) {
                (Some(c), Some(r)) => pty.resize(c, r),
                _ => Err("resize needs cols and rows in 1..=1000".into()),
            }
        }
        _ => Err("unknown control message".into()),
    }
}

fn dimension(v: &Value) -> Option<u32> {
    v.as_u64()
        .filter(|n| (1..=1000).contains(n))
        .map(|n| n as u32)
}

/// `cols` and `rows` of the query, else 80×24.
fn initial_size(url: &str) -> (u32, u32) {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    let pairs = super::super::query::parse(query);
    let get = |k: &str, d: u32| {
        super::super::query::get(&pairs, k)
            .and_then(|v| v.parse::<u64>().ok())
            .and_then(|n| dimension(&json!(n)))
            .unwrap_or(d)
    };
    (get("cols", 80), get("rows", 24))
}

fn event(v: Value) -> Message {
    Message::text(v.to_string())
}

/// Whether `protocols` (a `Sec-WebSocket-Protocol` list) offers the terminal protocol and
/// the API key.
fn key_offered(protocols: &str, api_key: &str) -> bool {
    let offered: Vec<&str> = protocols.split(',').map(str::trim).collect();
    offered.contains(&PROTOCOL)
        && offered.iter().any(|p| {
            p.strip_prefix(KEY_PREFIX)
                .is_some_and(|k| constant_time_eq(k.as_bytes(), api_key.as_bytes()))
        })
}

/// No `Origin` (not a browser), or one whose host is `Host`.
fn same_origin(origin: Option<&str>, host: Option<&str>) -> bool {
    let Some(origin) = origin else {
        return true;
    };
    let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
    host.is_some_and(|h| !h.is_empty() && origin_host.eq_ignore_ascii_case(h))
}

fn wants_websocket(request: &Request) -> bool {
    header(request, "Upgrade").is_some_and(|u| u.eq_ignore_ascii_case("websocket"))
}

fn header<'a>(request: &'a Request, name: &'static str) -> Option<&'a str> {
    request
        .headers()
        .iter()
        .find(|h| h.field.equiv(name))
        .map(|h| h.value.as_str())
}

fn h(name: &str, value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("valid header")
}

/// The upgraded connection; a read that timed out (the connection's per-read timeout)
/// reads as `WouldBlock`, which `tungstenite` retries without losing its place.
struct Polled(Box<dyn tiny_http::ReadWrite + Send>);

impl Read for Polled {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf).map_err(|e| match e.kind() {
            io::ErrorKind::TimedOut => io::Error::from(io::ErrorKind::WouldBlock),
            _ => e,
        })
    }
}

impl Write for Polled {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "k0123456789abcdefghijklmnopqrstuvwxyz";

    #[test]
    fn the_key_must_be_offered_with_the_protocol() {
        assert!(key_offered(&format!("{PROTOCOL}, {KEY_PREFIX}{KEY}"), KEY));
        assert!(
            !key_offered(&format!("{KEY_PREFIX}{KEY}"), KEY),
            "no protocol"
        );
        assert!(!key_offered(PROTOCOL, KEY), "no key");
        assert!(!key_offered(
            &format!("{PROTOCOL}, {KEY_PREFIX}{KEY}x"),
            KEY
        ));
        assert!(!key_offered(&format!("{PROTOCOL}, {KEY_PREFIX}"), KEY));
        assert!(!key_offered("", KEY));
    }

    #[test]
    fn origins() {
        assert!(same_origin(None, Some("h:1")));
        assert!(same_origin(Some("http://h:1"), Some("h:1")));
        assert!(same_origin(Some("https://H:1"), Some("h:1")));
        assert!(!same_origin(Some("http://evil.example"), Some("h:1")));
        assert!(!same_origin(Some("null"), Some("h:1")));
        assert!(!same_origin(Some("http://h:1"), None));
    }

    #[test]
    fn sizes_and_paths() {
        assert_eq!(
            initial_size("/console/terminal/x?cols=120&rows=40"),
            (120, 40)
        );
        assert_eq!(
            initial_size("/console/terminal/x?cols=0&rows=99999"),
            (80, 24)
        );
        assert_eq!(initial_size("/console/terminal/x"), (80, 24));
        let id = "01900000-0000-7000-8000-000000000000";
        assert_eq!(sandbox_of(&format!("/console/terminal/{id}")), Some(id));
        assert_eq!(sandbox_of("/console/terminal/x"), None);
        assert_eq!(sandbox_of(&format!("/console/terminal/{id}/x")), None);
    }
}
