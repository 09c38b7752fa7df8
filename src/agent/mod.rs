//! Host side of the host↔guest agent protocol: [`AgentClient`] talks to the in-guest agent
//! (`crate::guest`) over QEMU's virtio-serial chardev socket.
//!
//! One connection carries every call; a reader thread demultiplexes frames by call id
//! (see [`protocol`]), so commands and file streams run concurrently.
//!
//! The guest is untrusted: every frame it sends is bounded by kind ([`guest_payload_limit`]),
//! `Data` only within the credit the host granted for that call, each call's queue is
//! bounded, and an exec result is cut to the request's cap again here. A guest that breaks
//! the protocol gets its channel closed (every call fails with [`AgentError::Protocol`]),
//! a log line, and [`AgentClient::protocol_violation`] says why; the server and other
//! sandboxes are unaffected.

pub mod protocol;

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use protocol::{
    ErrorKind, Frame, FrameDecoder, FrameKind, GuestMetrics, Request, Response, MAX_CHUNK,
    MAX_PAYLOAD, PROTOCOL_VERSION, STREAM_WINDOW,
};

/// One command to run in the guest (api.md §4.17), already validated and merged.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecRequest {
    pub cmd: String,
    pub args: Vec<String>,
    /// The merged environment, later entries win.
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub timeout_ms: u64,
    /// Cap per stream; output beyond it is discarded and flagged.
    pub max_output_bytes: u64,
}

/// What a command did (the JSON body of `POST /sandboxes/{id}/commands`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecResult {
    pub exit_code: i32,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub duration_ms: u64,
}

/// Agent call failures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentError {
    /// The agent cannot be reached or stopped answering (HTTP 502).
    Unreachable(String),
    /// The agent answered out of protocol (HTTP 502).
    Protocol(String),
    /// The guest file does not exist (HTTP 404).
    NotFound(String),
    /// The guest path is unusable: a directory, not a regular file, bad cwd (HTTP 400).
    InvalidPath(String),
    /// The guest failed an I/O operation (disk full, permission, ...).
    Io(String),
    /// Reading the upload body on the host failed or it ended early.
    Upload(String),
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentError::Unreachable(m) => write!(f, "guest agent unreachable: {m}"),
            AgentError::Protocol(m) => write!(f, "guest agent protocol error: {m}"),
            AgentError::NotFound(m) => write!(f, "{m}"),
            AgentError::InvalidPath(m) => write!(f, "{m}"),
            AgentError::Io(m) => write!(f, "guest I/O error: {m}"),
            AgentError::Upload(m) => write!(f, "upload body: {m}"),
        }
    }
}

impl std::error::Error for AgentError {}

impl AgentError {
    fn from_guest(kind: ErrorKind, message: String) -> AgentError {
        match kind {
            ErrorKind::NotFound => AgentError::NotFound(message),
            ErrorKind::InvalidPath => AgentError::InvalidPath(message),
            ErrorKind::Io => AgentError::Io(message),
            ErrorKind::Protocol => AgentError::Protocol(message),
        }
    }
}

/// How long the guest may stay silent in the middle of a file transfer.
const STREAM_IDLE: Duration = Duration::from_secs(120);
/// How long opening a file or answering a short request may take.
const SHORT_CALL: Duration = Duration::from_secs(30);
/// Extra time the guest gets beyond a command's own timeout (kill, drain, reply).
const EXEC_GRACE: Duration = Duration::from_secs(30);

/// Largest payload of a frame kind that carries no data (`End`, `Credit`, ...).
const SMALL_PAYLOAD: u32 = 64;
/// Frames queued per call: a window of data in 1 KiB frames; a guest that sends more
/// before the host reads them breaks the protocol.
const CALL_QUEUE: usize = (STREAM_WINDOW / 1024) as usize;
/// Bytes the host skips looking for a frame start before it gives up on the guest: one
/// torn frame at the start of the connection, and some.
const MAX_SKIPPED: u64 = MAX_PAYLOAD as u64 + (1 << 20);

/// The largest payload the host accepts from a guest for each kind: `Data` is one chunk,
/// a `Response` may hold an exec result, anything else is a few bytes.
pub fn guest_payload_limit(kind: FrameKind) -> u32 {
    match kind {
        FrameKind::Data => MAX_CHUNK as u32,
        FrameKind::Response => MAX_PAYLOAD,
        FrameKind::End | FrameKind::Credit | FrameKind::Request | FrameKind::Cancel => {
            SMALL_PAYLOAD
        }
    }
}

/// What the decoder refused or skipped so far, as a violation.
fn check_stream(decoder: &FrameDecoder) -> Result<(), String> {
    if let Some((kind, len)) = decoder.oversized {
        return Err(format!(
            "a {kind:?} frame of {len} bytes (the limit is {})",
            guest_payload_limit(kind)
        ));
    }
    if decoder.skipped >= MAX_SKIPPED {
        return Err(format!("{} bytes that are not frames", decoder.skipped));
    }
    Ok(())
}

/// What the demultiplexer hands to a call.
enum Inbound {
    Response(Response),
    Data(Vec<u8>),
    End,
    Credit(u32),
    Closed(String),
}

/// A call the demultiplexer feeds.
struct PendingCall {
    tx: Sender<Inbound>,
    /// Data bytes the guest may still send on this call (granted by the host's `Credit`).
    credit: u64,
}

struct Shared {
    writer: Mutex<UnixStream>,
    pending: Mutex<HashMap<u64, PendingCall>>,
    next_id: AtomicU64,
    /// Why the connection is gone, once it is.
    dead: Mutex<Option<String>>,
    /// Set when the guest broke the protocol (and the channel was closed for it).
    violation: Mutex<Option<String>>,
    /// Names the guest in log lines (the sandbox id).
    label: Mutex<String>,
}

impl Shared {
    fn send(&self, frame: &Frame) -> Result<(), AgentError> {
        if let Some(reason) = self.dead.lock().clone() {
            return Err(self.closed_error(reason));
        }
        if frame.kind == FrameKind::Credit {
            // Granted before it is on the wire: the guest's answer cannot overtake it.
            if let Some(call) = self.pending.lock().get_mut(&frame.id) {
                call.credit += u64::from(frame.credit_bytes());
            }
        }
        let mut w = self.writer.lock();
        protocol::write_frame(&mut *w, frame).map_err(|e| {
            let reason = format!("writing to the agent channel failed: {e}");
            *self.dead.lock() = Some(reason.clone());
            // The channel may have been shut down for a violation a moment ago.
            self.closed_error(reason)
        })
    }

    /// The error for a call on a closed channel.
    fn closed_error(&self, reason: String) -> AgentError {
        if self.violation.lock().is_some() {
            AgentError::Protocol(reason)
        } else {
            AgentError::Unreachable(reason)
        }
    }

    fn demux(self: Arc<Self>, mut stream: UnixStream) {
        let mut decoder = FrameDecoder::with_limit(guest_payload_limit);
        let mut chunk = vec![0u8; 128 * 1024];
        let reason = 'read: loop {
            while let Some(frame) = decoder.next_frame() {
                if let Err(violation) = self.dispatch(frame) {
                    break 'read self.violated(violation);
                }
            }
            if let Err(violation) = check_stream(&decoder) {
                break self.violated(violation);
            }
            let n = match stream.read(&mut chunk) {
                Ok(0) => break "the agent channel was closed".to_string(),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => break format!("reading the agent channel failed: {e}"),
            };
            decoder.push(&chunk[..n]);
        };
        // Dead before the shutdown, so a call made meanwhile fails with the reason.
        *self.dead.lock() = Some(reason.clone());
        if self.violation.lock().is_some() {
            // The guest sees its channel end; nothing more it sends is read.
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        for (_, call) in self.pending.lock().drain() {
            let _ = call.tx.try_send(Inbound::Closed(reason.clone()));
        }
    }

    /// Hands one frame to its call; `Err` when the frame breaks the protocol.
    fn dispatch(&self, frame: Frame) -> Result<(), String> {
        let msg = match frame.kind {
            FrameKind::Response => match serde_json::from_slice::<Response>(&frame.payload) {
                Ok(r) => Inbound::Response(r),
                Err(e) => return Err(format!("an undecodable response: {e}")),
            },
            FrameKind::Data => Inbound::Data(frame.payload),
            FrameKind::End => Inbound::End,
            FrameKind::Credit => Inbound::Credit(frame.credit_bytes()),
            FrameKind::Request | FrameKind::Cancel => {
                return Err(format!(
                    "a {:?} frame, which only the host sends",
                    frame.kind
                ))
            }
        };
        let mut pending = self.pending.lock();
        // Frames for calls nobody waits for any more (timed out, dropped) are dropped.
        let Some(call) = pending.get_mut(&frame.id) else {
            return Ok(());
        };
        if let Inbound::Data(bytes) = &msg {
            let len = bytes.len() as u64;
            if len > call.credit {
                return Err(format!(
                    "{len} data bytes on call {} with {} bytes of credit",
                    frame.id, call.credit
                ));
            }
            call.credit -= len;
        }
        match call.tx.try_send(msg) {
            Ok(()) => Ok(()),
            // The caller gave up on the call (timed out) and is about to unregister it.
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => Ok(()),
            Err(crossbeam_channel::TrySendError::Full(_)) => Err(format!(
                "more than {CALL_QUEUE} unread frames on call {}",
                frame.id
            )),
        }
    }

    /// Records a violation and returns the reason every call then fails with.
    fn violated(&self, what: String) -> String {
        let reason = format!("the guest broke the agent protocol ({what}); its channel is closed");
        log::warn!(
            "agent sandboxId={} result=protocol_violation reason=\"{what}\"",
            self.label.lock()
        );
        *self.violation.lock() = Some(reason.clone());
        reason
    }
}

/// One in-flight call: its id and the channel the demultiplexer feeds. Unregisters on drop.
struct Call {
    shared: Arc<Shared>,
    id: u64,
    rx: Receiver<Inbound>,
}

impl Call {
    fn open(shared: &Arc<Shared>, req: &Request) -> Result<Call, AgentError> {
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(CALL_QUEUE);
        shared
            .pending
            .lock()
            .insert(id, PendingCall { tx, credit: 0 });
        let call = Call {
            shared: shared.clone(),
            id,
            rx,
        };
        call.send(&Frame::json(FrameKind::Request, id, req))?;
        Ok(call)
    }

    fn send(&self, frame: &Frame) -> Result<(), AgentError> {
        self.shared.send(frame)
    }

    fn recv(&self, timeout: Duration, what: &str) -> Result<Inbound, AgentError> {
        match self.rx.recv_timeout(timeout) {
            Ok(Inbound::Closed(reason)) => Err(self.shared.closed_error(reason)),
            Ok(msg) => Ok(msg),
            Err(RecvTimeoutError::Timeout) => Err(AgentError::Unreachable(format!(
                "no answer to {what} within {} ms",
                timeout.as_millis()
            ))),
            Err(RecvTimeoutError::Disconnected) => Err(AgentError::Unreachable(
                "the agent channel was closed".into(),
            )),
        }
    }

    /// Waits for the final response of a call.
    fn response(&self, timeout: Duration, what: &str) -> Result<Response, AgentError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.recv(left, what)? {
                Inbound::Response(Response::Error { kind, message }) => {
                    return Err(AgentError::from_guest(kind, message))
                }
                Inbound::Response(r) => return Ok(r),
                // Credit for a stream that is already over; ignore.
                Inbound::Credit(_) => continue,
                Inbound::Data(_) | Inbound::End => {
                    return Err(AgentError::Protocol(format!(
                        "unexpected data frame while waiting for {what}"
                    )))
                }
                Inbound::Closed(reason) => return Err(self.shared.closed_error(reason)),
            }
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        self.shared.pending.lock().remove(&self.id);
    }
}

/// Cuts `text` to at most `cap` bytes (on a character boundary), flagging the cut.
fn cap_output(text: &mut String, truncated: &mut bool, cap: usize) {
    if text.len() > cap {
        let mut end = cap;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        *truncated = true;
    }
}

fn unexpected(what: &str, got: &Response) -> AgentError {
    AgentError::Protocol(format!("unexpected answer to {what}: {got:?}"))
}

/// Client for one guest's agent. Cheap to share between threads (`Send + Sync`).
pub struct AgentClient {
    shared: Arc<Shared>,
    stream: UnixStream,
}

impl AgentClient {
    /// Connects to QEMU's chardev unix socket (retrying until it exists), then pings until
    /// the guest answers or `deadline`.
    pub fn connect(socket: &Path, deadline: Instant) -> Result<AgentClient, AgentError> {
        AgentClient::connect_unless(socket, deadline, || None)
    }

    /// [`AgentClient::connect`], giving up early when `give_up` (asked between pings, about
    /// twice a second) names a reason the guest cannot answer (e.g. its VM is paused).
    pub fn connect_unless(
        socket: &Path,
        deadline: Instant,
        mut give_up: impl FnMut() -> Option<String>,
    ) -> Result<AgentClient, AgentError> {
        let stream = loop {
            match UnixStream::connect(socket) {
                Ok(s) => break s,
                Err(e) => {
                    if Instant::now() >= deadline {
                        return Err(AgentError::Unreachable(format!(
                            "cannot connect to {}: {e}",
                            socket.display()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let client = AgentClient::from_stream(stream)?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match client.ping(left.min(Duration::from_millis(500))) {
                Ok(()) => return Ok(client),
                Err(AgentError::Unreachable(reason)) => {
                    if client.shared.dead.lock().is_some() || left.is_zero() {
                        return Err(AgentError::Unreachable(format!(
                            "guest agent on {} did not answer: {reason}",
                            socket.display()
                        )));
                    }
                    if let Some(why) = give_up() {
                        return Err(AgentError::Unreachable(format!(
                            "guest agent on {} cannot answer: {why}",
                            socket.display()
                        )));
                    }
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// Wraps an already connected stream (tests, or a socket handed over by the caller).
    pub fn from_stream(stream: UnixStream) -> Result<AgentClient, AgentError> {
        let io_err = |e: io::Error| AgentError::Unreachable(format!("agent socket: {e}"));
        stream.set_write_timeout(Some(SHORT_CALL)).map_err(io_err)?;
        let reader = stream.try_clone().map_err(io_err)?;
        let writer = stream.try_clone().map_err(io_err)?;
        // Ids start at a time-derived value so answers meant for an earlier connection
        // cannot match a call of this one.
        let first_id = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let shared = Arc::new(Shared {
            writer: Mutex::new(writer),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(first_id),
            dead: Mutex::new(None),
            violation: Mutex::new(None),
            label: Mutex::new(String::new()),
        });
        let demux = shared.clone();
        std::thread::Builder::new()
            .name("agent-demux".into())
            .spawn(move || demux.demux(reader))
            .map_err(io_err)?;
        Ok(AgentClient { shared, stream })
    }

    /// Names the guest (its sandbox id) in this client's log lines.
    pub fn set_label(&self, label: &str) {
        *self.shared.label.lock() = label.to_string();
    }

    /// Why the channel was closed on the guest, when it broke the protocol.
    pub fn protocol_violation(&self) -> Option<String> {
        self.shared.violation.lock().clone()
    }

    /// Checks the agent answers and speaks our protocol version.
    pub fn ping(&self, timeout: Duration) -> Result<(), AgentError> {
        let call = Call::open(
            &self.shared,
            &Request::Hello {
                version: PROTOCOL_VERSION,
            },
        )?;
        match call.response(timeout, "ping")? {
            Response::Hello { version, .. } if version == PROTOCOL_VERSION => Ok(()),
            Response::Hello { version, agent } => Err(AgentError::Protocol(format!(
                "guest agent {agent} speaks protocol v{version}, this host speaks \
                 v{PROTOCOL_VERSION}; rebuild the initramfs with this release's agent"
            ))),
            other => Err(unexpected("ping", &other)),
        }
    }

    /// Runs one command and waits for it (up to its timeout plus a grace period).
    pub fn exec(&self, req: &ExecRequest) -> Result<ExecResult, AgentError> {
        let call = Call::open(&self.shared, &Request::Exec(req.clone()))?;
        let wait = Duration::from_millis(req.timeout_ms) + EXEC_GRACE;
        match call.response(wait, "command")? {
            Response::Exec(mut result) => {
                // The guest's own cap is not trusted.
                let cap = usize::try_from(req.max_output_bytes).unwrap_or(usize::MAX);
                cap_output(&mut result.stdout, &mut result.stdout_truncated, cap);
                cap_output(&mut result.stderr, &mut result.stderr_truncated, cap);
                Ok(result)
            }
            other => Err(unexpected("command", &other)),
        }
    }

    /// Opens a guest file for streaming download; errors before the first byte
    /// (NotFound, InvalidPath for directories and non-regular files, ...).
    pub fn read_file(&self, path: &str) -> Result<FileDownload, AgentError> {
        let call = Call::open(&self.shared, &Request::ReadFile { path: path.into() })?;
        call.send(&Frame::credit(call.id, STREAM_WINDOW))?;
        match call.response(SHORT_CALL, "file download")? {
            Response::FileOpened { size } => Ok(FileDownload {
                call,
                size,
                chunk: Vec::new(),
                pos: 0,
                unacked: 0,
                finished: false,
            }),
            other => Err(unexpected("file download", &other)),
        }
    }

    /// Streams `len` bytes from `body` into `path` (parents created 0755, temp file +
    /// rename, mode 0644, root-owned).
    pub fn write_file(&self, path: &str, len: u64, body: &mut dyn Read) -> Result<(), AgentError> {
        let call = Call::open(
            &self.shared,
            &Request::WriteFile {
                path: path.into(),
                len,
            },
        )?;
        match call.response(SHORT_CALL, "file upload")? {
            Response::UploadReady => {}
            other => return Err(unexpected("file upload", &other)),
        }
        let mut credit: u64 = 0;
        let mut sent: u64 = 0;
        let mut buf = vec![0u8; MAX_CHUNK];
        let shared = &self.shared;
        let handle = |msg: Inbound, credit: &mut u64| -> Result<(), AgentError> {
            match msg {
                Inbound::Credit(n) => {
                    *credit += u64::from(n);
                    Ok(())
                }
                Inbound::Response(Response::Error { kind, message }) => {
                    Err(AgentError::from_guest(kind, message))
                }
                Inbound::Response(other) => Err(unexpected("file upload", &other)),
                Inbound::Closed(reason) => Err(shared.closed_error(reason)),
                Inbound::Data(_) | Inbound::End => Err(AgentError::Protocol(
                    "unexpected data frame during upload".into(),
                )),
            }
        };
        while sent < len {
            // Pick up credit and early errors without blocking.
            loop {
                match call.rx.try_recv() {
                    Ok(msg) => handle(msg, &mut credit)?,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        return Err(AgentError::Unreachable(
                            "the agent channel was closed".into(),
                        ))
                    }
                }
            }
            if credit == 0 {
                let msg = call.recv(STREAM_IDLE, "file upload")?;
                handle(msg, &mut credit)?;
                continue;
            }
            let want = (len - sent).min(credit).min(MAX_CHUNK as u64) as usize;
            let n = match body.read(&mut buf[..want]) {
                Ok(0) => {
                    let _ = call.send(&Frame::new(FrameKind::Cancel, call.id, vec![]));
                    return Err(AgentError::Upload(format!(
                        "body ended after {sent} of {len} bytes"
                    )));
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = call.send(&Frame::new(FrameKind::Cancel, call.id, vec![]));
                    return Err(AgentError::Upload(format!("reading the body failed: {e}")));
                }
            };
            call.send(&Frame::new(FrameKind::Data, call.id, buf[..n].to_vec()))?;
            sent += n as u64;
            credit -= n as u64;
        }
        call.send(&Frame::new(FrameKind::End, call.id, vec![]))?;
        match call.response(STREAM_IDLE, "file upload")? {
            Response::Done => Ok(()),
            other => Err(unexpected("file upload", &other)),
        }
    }

    /// Sets the guest's wall clock (after a restore, the guest's clock is stale).
    pub fn set_time(&self, unix_nanos: u128) -> Result<(), AgentError> {
        let unix_nanos = u64::try_from(unix_nanos)
            .map_err(|_| AgentError::Protocol("time out of range".into()))?;
        self.call_done(&Request::SetTime { unix_nanos }, SHORT_CALL, "set_time")
    }

    /// One call the guest answers `Done`, waiting up to `timeout`.
    fn call_done(
        &self,
        request: &Request,
        timeout: Duration,
        what: &str,
    ) -> Result<(), AgentError> {
        let call = Call::open(&self.shared, request)?;
        match call.response(timeout, what)? {
            Response::Done => Ok(()),
            other => Err(unexpected(what, &other)),
        }
    }
}

impl AgentClient {
    /// Closes the channel from the host side: calls in flight and later ones fail at once
    /// (a build whose VM cannot go on stops waiting for its command).
    pub fn close(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Has the guest mount the NFS export `source` on `path` ([`Request::MountNfs`]),
    /// waiting up to `timeout`.
    pub fn mount_nfs(
        &self,
        source: &str,
        path: &str,
        options: &str,
        timeout: Duration,
    ) -> Result<(), AgentError> {
        let request = Request::MountNfs {
            source: source.to_string(),
            path: path.to_string(),
            options: options.to_string(),
        };
        self.call_done(&request, timeout, "mount_nfs")
    }

    /// One sample of the guest's CPU, memory and disk ([`Request::Metrics`]), waiting up
    /// to `timeout`. An agent older than the request answers a protocol error.
    pub fn metrics(&self, timeout: Duration) -> Result<GuestMetrics, AgentError> {
        let call = Call::open(&self.shared, &Request::Metrics)?;
        match call.response(timeout, "metrics")? {
            Response::Metrics(m) => Ok(m),
            other => Err(unexpected("metrics", &other)),
        }
    }

    /// Has the guest write its filesystems' dirty data to disk, waiting up to `timeout`.
    pub fn sync(&self, timeout: Duration) -> Result<(), AgentError> {
        self.call_done(&Request::Sync, timeout, "sync")
    }

    /// Has the guest run the envd half of a warm-up on its envd `port`, removing `path`
    /// and `<path>-envd` at the end ([`Request::Warmup`]), waiting up to `timeout`.
    pub fn warmup(&self, port: u16, path: &str, timeout: Duration) -> Result<(), AgentError> {
        let request = Request::Warmup {
            port,
            path: path.to_string(),
        };
        self.call_done(&request, timeout, "warmup")
    }
}

impl Drop for AgentClient {
    fn drop(&mut self) {
        // Ends the demultiplexer thread; outstanding downloads then fail.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// A guest file being streamed to the host. Dropping it early cancels the transfer.
pub struct FileDownload {
    call: Call,
    size: u64,
    chunk: Vec<u8>,
    pos: usize,
    /// Bytes consumed since credit was last returned to the guest.
    unacked: u32,
    finished: bool,
}

impl FileDownload {
    /// The file's size when it was opened.
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Read for FileDownload {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos >= self.chunk.len() {
            if self.finished {
                return Ok(0);
            }
            let msg = self
                .call
                .recv(STREAM_IDLE, "file download")
                .map_err(io::Error::other)?;
            match msg {
                Inbound::Data(bytes) => {
                    self.unacked += bytes.len() as u32;
                    self.chunk = bytes;
                    self.pos = 0;
                    if self.unacked >= STREAM_WINDOW / 2 {
                        self.call
                            .send(&Frame::credit(self.call.id, self.unacked))
                            .map_err(io::Error::other)?;
                        self.unacked = 0;
                    }
                }
                Inbound::End => self.finished = true,
                Inbound::Response(Response::Error { kind, message }) => {
                    self.finished = true;
                    return Err(io::Error::other(AgentError::from_guest(kind, message)));
                }
                Inbound::Response(other) => {
                    self.finished = true;
                    return Err(io::Error::other(unexpected("file download", &other)));
                }
                Inbound::Credit(_) => {}
                Inbound::Closed(reason) => {
                    self.finished = true;
                    return Err(io::Error::other(self.call.shared.closed_error(reason)));
                }
            }
        }
        let n = out.len().min(self.chunk.len() - self.pos);
        out[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Drop for FileDownload {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self
                .call
                .send(&Frame::new(FrameKind::Cancel, self.call.id, vec![]));
        }
    }
}

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;
