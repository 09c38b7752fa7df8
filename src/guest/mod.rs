//! The in-guest agent: boots the VM as PID 1 ([`boot`]), serves the host's calls over
//! the virtio-serial port (protocol in [`crate::agent::protocol`]), and speaks E2B's envd
//! protocol on its HTTP port ([`envd`]) for the E2B SDKs.
//!
//! The serving side is transport-agnostic: [`AgentServer::serve`] reads frames from any
//! byte stream, so tests run it over a unix socket pair on the host.

pub mod boot;
pub mod envd;
pub mod exec;
pub mod files;
pub mod provision;
pub mod reaper;
pub mod warmup;

use std::collections::HashMap;
use std::fmt;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use crate::agent::protocol::{
    ErrorKind, Frame, FrameKind, FrameReader, Request, Response, PROTOCOL_VERSION,
};
use reaper::Reaper;

/// Failures of one guest-side operation, reported to the host as an `Error` response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestError {
    NotFound(String),
    InvalidPath(String),
    Io(String),
    Protocol(String),
}

impl GuestError {
    fn kind(&self) -> ErrorKind {
        match self {
            GuestError::NotFound(_) => ErrorKind::NotFound,
            GuestError::InvalidPath(_) => ErrorKind::InvalidPath,
            GuestError::Io(_) => ErrorKind::Io,
            GuestError::Protocol(_) => ErrorKind::Protocol,
        }
    }

    fn message(&self) -> &str {
        match self {
            GuestError::NotFound(m)
            | GuestError::InvalidPath(m)
            | GuestError::Io(m)
            | GuestError::Protocol(m) => m,
        }
    }
}

impl fmt::Display for GuestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for GuestError {}

/// Frames the demultiplexer routes to a running file transfer.
#[derive(Debug)]
pub enum StreamEvent {
    Data(Vec<u8>),
    End,
    Credit(u32),
    Cancel,
    /// The host side of the channel went away.
    Disconnected,
}

/// The shared, serialised writing half of the channel. Write errors are logged and
/// dropped: the host may be gone (its next connection starts fresh).
pub struct FrameSink {
    writer: Mutex<Box<dyn Write + Send>>,
}

impl FrameSink {
    pub fn new(writer: Box<dyn Write + Send>) -> FrameSink {
        FrameSink {
            writer: Mutex::new(writer),
        }
    }

    pub fn send(&self, frame: &Frame) {
        let mut w = self.writer.lock();
        if let Err(e) = crate::agent::protocol::write_frame(&mut **w, frame) {
            log::debug!("dropping frame id={} kind={:?}: {e}", frame.id, frame.kind);
        }
    }

    pub fn response(&self, id: u64, response: &Response) {
        self.send(&Frame::json(FrameKind::Response, id, response));
    }

    pub fn error(&self, id: u64, err: &GuestError) {
        self.response(
            id,
            &Response::Error {
                kind: err.kind(),
                message: err.message().to_string(),
            },
        );
    }
}

/// What to do when the channel reads end-of-file.
#[derive(Clone, Copy)]
pub enum OnEof<'a> {
    /// Return from `serve` (a socket connection ended).
    Stop,
    /// Call the function, which returns once a host may be connected again, and read
    /// again: on a virtio-serial port, EOF only means no host is connected right now. The
    /// fd must stay open so the channel survives save/restore.
    Wait(&'a dyn Fn()),
}

/// The file root in the guest creates to make PID 1's agent break the protocol once
/// ([`AgentServer::with_fault_trigger`]).
pub const FAULT_TRIGGER: &str = "/run/agentenv-protocol-fault";

/// Serves host calls over one byte stream.
pub struct AgentServer {
    reaper: Arc<Reaper>,
    /// Set the guest clock on `set_time` (only as PID 1; tests must not touch the host's).
    set_clock: bool,
    sink: Arc<FrameSink>,
    streams: Arc<Mutex<HashMap<u64, Sender<StreamEvent>>>>,
    fault_trigger: Option<Arc<std::path::Path>>,
    /// Call ids for the metrics thread ([`metrics_thread`]).
    metrics: Option<Sender<u64>>,
}

/// Metrics calls waiting for the metrics thread; more are refused.
const METRICS_QUEUE: usize = 8;

/// The one thread that answers `Metrics` calls (each sample measures the CPU over
/// 100 ms), made with the agent: a guest restored from a capture then answers its
/// periodic samples without creating a thread, which keeps an idle guest's code path,
/// and the translated code it leaves under TCG, short (docs/performance.md). `None` when
/// the thread cannot be made (each call is then refused).
fn metrics_thread(sink: Arc<FrameSink>) -> Option<Sender<u64>> {
    let (tx, rx) = crossbeam_channel::bounded::<u64>(METRICS_QUEUE);
    let spawned = std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for id in rx {
                sink.response(id, &Response::Metrics(envd::metrics::sample()));
            }
        });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            log::warn!("no metrics thread: {e}");
            None
        }
    }
}

impl AgentServer {
    pub fn new(reaper: Arc<Reaper>, set_clock: bool, writer: Box<dyn Write + Send>) -> Self {
        let sink = Arc::new(FrameSink::new(writer));
        AgentServer {
            reaper,
            set_clock,
            metrics: metrics_thread(sink.clone()),
            sink,
            streams: Arc::new(Mutex::new(HashMap::new())),
            fault_trigger: None,
        }
    }

    /// After each command, if `path` exists, the agent removes it and sends the host a
    /// `Data` frame one byte over the chunk limit: a guest breaking the agent protocol, on
    /// demand, to test that the host closes the channel, marks the sandbox and carries on.
    /// This gives a guest nothing it lacks: the guest is untrusted, and root in it controls
    /// the guest kernel and can send anything on the port anyway (docs/security.md).
    pub fn with_fault_trigger(mut self, path: &std::path::Path) -> Self {
        self.fault_trigger = Some(path.into());
        self
    }

    /// Reads and dispatches frames until EOF (with [`OnEof::Stop`]) or forever.
    pub fn serve(&self, reader: impl Read, on_eof: OnEof<'_>) {
        let mut frames = FrameReader::new(reader);
        loop {
            match frames.read_frame() {
                Ok(Some(frame)) => self.dispatch(frame),
                Ok(None) => {
                    self.disconnect_streams();
                    match on_eof {
                        OnEof::Stop => return,
                        // No host is connected (e.g. right after a restore, before the
                        // new server-side client attaches): wait for one.
                        OnEof::Wait(wait) => wait(),
                    }
                }
                Err(e) => {
                    log::warn!("agent channel read failed: {e}");
                    self.disconnect_streams();
                    if let OnEof::Stop = on_eof {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    fn disconnect_streams(&self) {
        for (_, tx) in self.streams.lock().drain() {
            let _ = tx.send(StreamEvent::Disconnected);
        }
    }

    fn dispatch(&self, frame: Frame) {
        let event = match frame.kind {
            FrameKind::Request => return self.start(frame.id, &frame.payload),
            FrameKind::Data => StreamEvent::Data(frame.payload),
            FrameKind::End => StreamEvent::End,
            FrameKind::Credit => StreamEvent::Credit(frame.credit_bytes()),
            FrameKind::Cancel => StreamEvent::Cancel,
            FrameKind::Response => {
                log::debug!("ignoring a response frame from the host id={}", frame.id);
                return;
            }
        };
        if let Some(tx) = self.streams.lock().get(&frame.id) {
            let _ = tx.send(event);
        }
    }

    fn start(&self, id: u64, payload: &[u8]) {
        let request: Request = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                let err = GuestError::Protocol(format!("undecodable request: {e}"));
                return self.sink.error(id, &err);
            }
        };
        match request {
            Request::Hello { .. } => self.sink.response(
                id,
                &Response::Hello {
                    version: PROTOCOL_VERSION,
                    agent: format!("agentenv-agent {}", env!("CARGO_PKG_VERSION")),
                },
            ),
            Request::SetTime { unix_nanos } => {
                if self.set_clock {
                    if let Err(e) = crate::sys::guest::set_realtime(u128::from(unix_nanos)) {
                        return self.sink.error(id, &GuestError::Io(e.to_string()));
                    }
                }
                self.sink.response(id, &Response::Done);
            }
            Request::Sync => {
                crate::sys::guest::sync_filesystems();
                self.sink.response(id, &Response::Done);
            }
            Request::MountNfs {
                source,
                path,
                options,
            } => {
                // On its own thread: an NFS mount waits on the network.
                let sink = self.sink.clone();
                self.spawn(id, "mount", move || {
                    match mount_nfs(&source, &path, &options) {
                        Ok(()) => sink.response(id, &Response::Done),
                        Err(e) => sink.error(id, &e),
                    }
                });
            }
            Request::Exec(req) => {
                let sink = self.sink.clone();
                let reaper = self.reaper.clone();
                let fault_trigger = self.fault_trigger.clone();
                self.spawn(id, "exec", move || {
                    let answer = exec::run(&req, &reaper);
                    // One unlink per command, before its answer: a command the host sends
                    // after this answer cannot have made the file this check finds. It
                    // succeeds once per trigger file.
                    let break_protocol =
                        fault_trigger.is_some_and(|p| std::fs::remove_file(&*p).is_ok());
                    match answer {
                        Ok(result) => sink.response(id, &Response::Exec(result)),
                        Err(e) => sink.error(id, &e),
                    }
                    if break_protocol {
                        let oversized = vec![0; crate::agent::protocol::MAX_CHUNK + 1];
                        sink.send(&Frame::new(FrameKind::Data, id, oversized));
                    }
                });
            }
            Request::Warmup { port, path } => {
                let sink = self.sink.clone();
                self.spawn(id, "warmup", move || match warmup::run(port, &path) {
                    Ok(()) => sink.response(id, &Response::Done),
                    Err(e) => sink.error(id, &e),
                });
            }
            Request::Metrics => {
                let queued = self
                    .metrics
                    .as_ref()
                    .is_some_and(|q| q.try_send(id).is_ok());
                if !queued {
                    let busy = GuestError::Io("the metrics thread is busy or missing".into());
                    self.sink.error(id, &busy);
                }
            }
            Request::ReadFile { path } => {
                let (sink, events, guard) = self.open_stream(id);
                self.spawn(id, "download", move || {
                    files::download(&path, id, &events, &sink);
                    drop(guard);
                });
            }
            Request::WriteFile { path, len } => {
                let (sink, events, guard) = self.open_stream(id);
                self.spawn(id, "upload", move || {
                    files::upload(&path, len, id, &events, &sink);
                    drop(guard);
                });
            }
        }
    }

    /// Registers the stream before the next frame is read, so its first credit or data
    /// frame finds it.
    fn open_stream(
        &self,
        id: u64,
    ) -> (
        Arc<FrameSink>,
        crossbeam_channel::Receiver<StreamEvent>,
        StreamGuard,
    ) {
        let (tx, rx) = crossbeam_channel::unbounded();
        self.streams.lock().insert(id, tx);
        let guard = StreamGuard {
            streams: self.streams.clone(),
            id,
        };
        (self.sink.clone(), rx, guard)
    }

    fn spawn(&self, id: u64, what: &str, f: impl FnOnce() + Send + 'static) {
        let res = std::thread::Builder::new()
            .name(format!("{what}-{id:x}"))
            .spawn(f);
        if let Err(e) = res {
            let err = GuestError::Io(format!("cannot start a thread for {what}: {e}"));
            self.sink.error(id, &err);
        }
    }
}

/// Makes `path` (an absolute guest path) and mounts the NFS export `source` there.
fn mount_nfs(source: &str, path: &str, options: &str) -> Result<(), GuestError> {
    let target = std::path::Path::new(path);
    if !target.is_absolute() {
        return Err(GuestError::InvalidPath(format!(
            "mount path {path} is not absolute"
        )));
    }
    std::fs::create_dir_all(target)
        .map_err(|e| GuestError::Io(format!("cannot make {path}: {e}")))?;
    crate::sys::guest::mount(
        source,
        target,
        "nfs4",
        libc::MS_NOSUID | libc::MS_NODEV,
        options,
    )
    .map_err(|e| GuestError::Io(e.to_string()))
}

/// Unregisters a stream when its handler ends.
struct StreamGuard {
    streams: Arc<Mutex<HashMap<u64, Sender<StreamEvent>>>>,
    id: u64,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.streams.lock().remove(&self.id);
    }
}
