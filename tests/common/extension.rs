//! A real recording custom extension for tests: an HTTP/1.1 server on 127.0.0.1:0 with its
//! own threads (one per connection, keep-alive supported) that records every request and
//! answers as told, per hook.
//!
//! It speaks raw HTTP over `std::net` rather than through tiny_http because several
//! behaviours need control tiny_http does not give: closing a connection without any
//! answer (tiny_http answers 500 when a request is dropped), trickling a body, announcing
//! a length it never sends.
//!
//! Defaults: start-fresh and start-resume answer `200 {}`, stop answers `204`, and
//! patch-params answers `200 {"customExtensionParams": P}` where P is the JSON merge patch
//! (RFC 7396) of the request's `patch` over the sandbox's current params (those of its
//! latest start hook, or of the previous patch).

#![allow(dead_code)]

use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the extension does with one request.
#[derive(Clone, Debug)]
pub enum Behavior {
    /// The built-in answer for the hook (see the module docs).
    Default,
    /// `status` with `body` and a correct `Content-Length`.
    Respond { status: u16, body: Vec<u8> },
    /// Waits, then behaves like the inner behaviour.
    Delay(Duration, Box<Behavior>),
    /// Reads the request and never answers (until the extension is dropped or
    /// [`Extension::release_hangs`]); then closes the connection.
    Hang,
    /// Reads the request and closes the connection without answering.
    Close,
    /// `status` (3xx) with a `Location` pointing back at the same path.
    Redirect(u16),
    /// `200` announcing a 1000-byte body, then one byte every `every`.
    Trickle { every: Duration },
    /// `200` with 1 MiB + 1 bytes of body: announced in `Content-Length`, or sent chunked
    /// so that the size is only found while reading.
    Oversized { announced: bool },
    /// Writes these bytes as the whole response, then closes the connection.
    Raw(Vec<u8>),
}

impl Behavior {
    pub fn status(status: u16) -> Behavior {
        Behavior::Respond {
            status,
            body: Vec::new(),
        }
    }
    pub fn body(status: u16, body: &str) -> Behavior {
        Behavior::Respond {
            status,
            body: body.as_bytes().to_vec(),
        }
    }
    pub fn json(status: u16, v: Value) -> Behavior {
        Behavior::Respond {
            status,
            body: serde_json::to_vec(&v).unwrap(),
        }
    }
    pub fn delay(ms: u64, then: Behavior) -> Behavior {
        Behavior::Delay(Duration::from_millis(ms), Box::new(then))
    }
}

/// One request as the extension saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Arrival order, from 0.
    pub seq: usize,
    /// The last path segment after `/sandbox-hook/`, or the whole path.
    pub hook: String,
    pub method: String,
    pub path: String,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub raw_body: Vec<u8>,
    /// The body parsed as JSON (`Value::Null` when it is not JSON).
    pub body: Value,
    /// When the request (headers and body) had been read completely.
    pub at: Instant,
    /// Which connection it came on (to see keep-alive).
    pub connection: usize,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn header_count(&self, name: &str) -> usize {
        let name = name.to_ascii_lowercase();
        self.headers.iter().filter(|(k, _)| *k == name).count()
    }
    pub fn sandbox_id(&self) -> &str {
        self.body["sandboxId"].as_str().unwrap_or("")
    }
    pub fn instance_id(&self) -> &str {
        self.body["sandboxInstanceId"].as_str().unwrap_or("")
    }
}

type Observer = Box<dyn Fn(&Recorded) + Send + Sync>;

#[derive(Default)]
struct State {
    requests: Vec<Recorded>,
    defaults: HashMap<String, Behavior>,
    scripts: HashMap<String, VecDeque<Behavior>>,
    params: HashMap<String, Value>,
    connections: usize,
    observer: Option<Arc<Observer>>,
    /// The status each request (by `seq`) was given, when it was given one.
    answers: HashMap<usize, u16>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    released: AtomicBool,
    stopping: AtomicBool,
}

pub struct Extension {
    pub port: u16,
    shared: Arc<Shared>,
}

impl Extension {
    pub fn start() -> Extension {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            released: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        });
        let s = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("test-ext-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if s.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    let s = Arc::clone(&s);
                    let conn = {
                        let mut st = s.state.lock().unwrap();
                        st.connections += 1;
                        st.connections
                    };
                    std::thread::spawn(move || serve_connection(stream, s, conn));
                }
            })
            .unwrap();
        Extension { port, shared }
    }

    /// The server's `[custom_extension]` section for this extension (3 s per call).
    pub fn config(&self) -> String {
        format!(
            "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n",
            self.url()
        )
    }

    /// The base URL to configure (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// How every later request for `hook` is answered (after any script).
    pub fn set(&self, hook: &str, b: Behavior) {
        self.shared
            .state
            .lock()
            .unwrap()
            .defaults
            .insert(hook.into(), b);
    }

    /// The next requests for `hook` are answered by these behaviours, in order; then the
    /// default applies again. `script("stop", vec![Behavior::status(503); k])` fails the
    /// first k stop attempts.
    pub fn script(&self, hook: &str, bs: Vec<Behavior>) {
        self.shared
            .state
            .lock()
            .unwrap()
            .scripts
            .entry(hook.into())
            .or_default()
            .extend(bs);
    }

    /// Called on each request's arrival, before it is answered.
    pub fn observe(&self, f: impl Fn(&Recorded) + Send + Sync + 'static) {
        self.shared.state.lock().unwrap().observer = Some(Arc::new(Box::new(f)));
    }

    /// Lets every hanging request go (their connections are closed).
    pub fn release_hangs(&self) {
        self.shared.released.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.state.lock().unwrap().requests.clone()
    }

    pub fn requests_for(&self, hook: &str) -> Vec<Recorded> {
        self.requests()
            .into_iter()
            .filter(|r| r.hook == hook)
            .collect()
    }

    /// How many requests for `hook` arrived.
    pub fn count(&self, hook: &str) -> usize {
        let st = self.shared.state.lock().unwrap();
        st.requests.iter().filter(|r| r.hook == hook).count()
    }

    /// When the last request for `hook` had arrived, if one did.
    pub fn last_at(&self, hook: &str) -> Option<Instant> {
        let st = self.shared.state.lock().unwrap();
        st.requests
            .iter()
            .rev()
            .find(|r| r.hook == hook)
            .map(|r| r.at)
    }

    /// The status the extension answered (or is answering) request `r` with; `None` for
    /// a request closed, hung or cut off without a status line.
    pub fn answer_of(&self, r: &Recorded) -> Option<u16> {
        self.shared
            .state
            .lock()
            .unwrap()
            .answers
            .get(&r.seq)
            .copied()
    }

    pub fn connections(&self) -> usize {
        self.shared.state.lock().unwrap().connections
    }

    /// Waits until at least `n` requests for `hook` arrived; returns them all.
    pub fn wait_for(&self, hook: &str, n: usize, timeout: Duration) -> Vec<Recorded> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock().unwrap();
        loop {
            let got: Vec<_> = st
                .requests
                .iter()
                .filter(|r| r.hook == hook)
                .cloned()
                .collect();
            let now = Instant::now();
            if got.len() >= n || now >= deadline {
                return got;
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap()
                .0;
        }
    }
}

impl Drop for Extension {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.release_hangs();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve_connection(stream: TcpStream, shared: Arc<Shared>, conn: usize) {
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut out = stream;
    loop {
        let Some((method, path, headers, body)) = read_request(&mut reader) else {
            return;
        };
        let hook = path
            .rsplit_once("/sandbox-hook/")
            .map(|(_, h)| h.to_string())
            .unwrap_or_else(|| path.clone());
        let parsed: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let (rec, behavior, observer) = {
            let mut st = shared.state.lock().unwrap();
            let rec = Recorded {
                seq: st.requests.len(),
                hook: hook.clone(),
                method,
                path: path.clone(),
                headers,
                raw_body: body,
                body: parsed,
                at: Instant::now(),
                connection: conn,
            };
            st.requests.push(rec.clone());
            let behavior = st
                .scripts
                .get_mut(&hook)
                .and_then(VecDeque::pop_front)
                .or_else(|| st.defaults.get(&hook).cloned())
                .unwrap_or(Behavior::Default);
            if let Some(status) = planned_status(&behavior, &rec.hook) {
                st.answers.insert(rec.seq, status);
            }
            (rec, behavior, st.observer.clone())
        };
        shared.changed.notify_all();
        if let Some(f) = observer {
            f(&rec);
        }
        let close_after = rec
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        if !respond(&mut out, &shared, &rec, behavior) || close_after {
            let _ = out.shutdown(Shutdown::Both);
            return;
        }
    }
}

type RawRequest = (String, String, Vec<(String, String)>, Vec<u8>);

fn read_request(r: &mut BufReader<TcpStream>) -> Option<RawRequest> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end_matches(['\r', '\n']);
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let len = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some((method, path, headers, body))
}

/// The status `b` answers a request for `hook` with, if it sends one it means.
fn planned_status(b: &Behavior, hook: &str) -> Option<u16> {
    match b {
        Behavior::Default => Some(match hook {
            "start-fresh" | "start-resume" | "patch-params" => 200,
            "stop" => 204,
            _ => 404,
        }),
        Behavior::Respond { status, .. } | Behavior::Redirect(status) => Some(*status),
        Behavior::Delay(_, then) => planned_status(then, hook),
        _ => None,
    }
}

/// Answers one request; `false` when the connection must be closed afterwards.
fn respond(out: &mut TcpStream, shared: &Shared, rec: &Recorded, b: Behavior) -> bool {
    match b {
        Behavior::Default => {
            let (status, body) = default_answer(shared, rec);
            write_response(out, status, &[], &body)
        }
        Behavior::Respond { status, body } => write_response(out, status, &[], &body),
        Behavior::Delay(d, then) => {
            std::thread::sleep(d);
            respond(out, shared, rec, *then)
        }
        Behavior::Hang => {
            let mut st = shared.state.lock().unwrap();
            while !shared.released.load(Ordering::SeqCst) {
                st = shared
                    .changed
                    .wait_timeout(st, Duration::from_millis(200))
                    .unwrap()
                    .0;
            }
            false
        }
        Behavior::Close => false,
        Behavior::Redirect(status) => {
            let loc = format!("Location: {}", rec.path);
            write_response(out, status, &[&loc], b"")
        }
        Behavior::Trickle { every } => {
            let head = "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n";
            if out.write_all(head.as_bytes()).is_err() {
                return false;
            }
            for _ in 0..1000 {
                std::thread::sleep(every);
                if out.write_all(b" ").is_err() || shared.released.load(Ordering::SeqCst) {
                    return false;
                }
            }
            true
        }
        Behavior::Oversized { announced } => {
            let n = 1024 * 1024 + 1;
            if announced {
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n");
                let _ = out.write_all(head.as_bytes());
                let _ = out.write_all(&vec![b' '; n]);
            } else {
                let _ = out.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
                let chunk = vec![b' '; 64 * 1024];
                let mut sent = 0;
                while sent < n {
                    let c = &chunk[..chunk.len().min(n - sent)];
                    let framed = [format!("{:x}\r\n", c.len()).as_bytes(), c, b"\r\n"].concat();
                    if out.write_all(&framed).is_err() {
                        return false;
                    }
                    sent += c.len();
                }
                let _ = out.write_all(b"0\r\n\r\n");
            }
            false
        }
        Behavior::Raw(bytes) => {
            let _ = out.write_all(&bytes);
            false
        }
    }
}

fn write_response(out: &mut TcpStream, status: u16, extra: &[&str], body: &[u8]) -> bool {
    let mut head = format!("HTTP/1.1 {status} X\r\nContent-Length: {}\r\n", body.len());
    for h in extra {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    // One write: with a separate body write, Nagle + delayed ACK add ~40 ms.
    let bytes = [head.as_bytes(), body].concat();
    out.write_all(&bytes).is_ok() && out.flush().is_ok()
}

fn default_answer(shared: &Shared, rec: &Recorded) -> (u16, Vec<u8>) {
    let sandbox = rec.sandbox_id().to_string();
    match rec.hook.as_str() {
        "start-fresh" | "start-resume" => {
            let params = rec.body["customExtensionParams"].clone();
            shared.state.lock().unwrap().params.insert(sandbox, params);
            (200, b"{}".to_vec())
        }
        "patch-params" => {
            let mut st = shared.state.lock().unwrap();
            let mut params = st.params.get(&sandbox).cloned().unwrap_or(json!({}));
            merge_patch(&mut params, &rec.body["patch"]);
            st.params.insert(sandbox, params.clone());
            let body = json!({ "customExtensionParams": params });
            (200, serde_json::to_vec(&body).unwrap())
        }
        "stop" => (204, Vec::new()),
        _ => (404, Vec::new()),
    }
}

/// RFC 7396 JSON merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let t = target.as_object_mut().unwrap();
    for (k, v) in p {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}
