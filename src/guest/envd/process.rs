//! `process.Process`: start processes (pipes or a PTY), follow their output, feed their
//! input, signal them.
//!
//! Each process has one output thread ([`pump`]) that reads its stdout and stderr (or
//! its PTY) and hands every chunk to the streams following it (its `Start` stream and
//! any `Connect`s), each through a bounded queue: a follower that stops reading for
//! [`FOLLOWER_STALL`] is dropped rather than blocking the others; output nobody follows
//! is discarded, as envd does. The thread also enforces the `Start` call's timeout
//! (SIGKILL to the process group) even after the client went away, and after the
//! process exits it sends the end event, keeping it [`RETAIN_ENDED`] for a late
//! `Connect`.
//!
//! Every non-PTY process leads its own process group and a PTY process its own session,
//! so signals reach what it started in the background too.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{PipeReader, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{Call, Envd};
use crate::guest::exec::{lookup, Lookup, DEFAULT_PATH};
use crate::guest::reaper::Reaper;
use crate::protocol::connect::{
    self, de_bytes, de_or_default, de_u32, Code, MessageSink, RpcError,
};
use crate::sys::guest::{self as sys, ExitStatus};

/// Processes running at once.
pub const MAX_PROCESSES: usize = 256;
/// How long an ended process stays reachable by `Connect` (envd keeps it 30 s).
pub const RETAIN_ENDED: Duration = Duration::from_secs(30);
/// Ended processes kept at most.
const MAX_RETAINED: usize = 256;
/// Output chunks queued per follower.
const FOLLOWER_QUEUE: usize = 64;
/// A follower whose queue stays full this long is dropped.
pub const FOLLOWER_STALL: Duration = Duration::from_secs(10);
/// How long an input write waits for the process to read.
const INPUT_STALL: Duration = Duration::from_secs(30);
/// Largest output chunk (envd: 32 KiB for pipes).
const CHUNK: usize = 32 * 1024;
/// After the process exits, output still arriving is forwarded this long at most (a
/// background child may hold the pipes open forever) ...
const DRAIN_LIMIT: Duration = Duration::from_millis(500);
/// ... and until the pipes stay quiet this long.
const DRAIN_IDLE: Duration = Duration::from_millis(50);

/// `ProcessConfig` of process.proto.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default, deserialize_with = "de_or_default")]
    pub args: Vec<String>,
    #[serde(default, deserialize_with = "de_or_default")]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
}

impl ProcessConfig {
    fn to_json(&self) -> Value {
        let mut v = json!({"cmd": self.cmd, "args": self.args, "envs": self.envs});
        if let Some(cwd) = &self.cwd {
            v["cwd"] = json!(cwd);
        }
        v
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct PtySize {
    #[serde(default, deserialize_with = "de_u32")]
    cols: Option<u32>,
    #[serde(default, deserialize_with = "de_u32")]
    rows: Option<u32>,
}

impl PtySize {
    fn rows_cols(self) -> (u16, u16) {
        let clamp = |v: Option<u32>, d: u16| v.map_or(d, |v| v.clamp(1, u16::MAX as u32) as u16);
        (clamp(self.rows, 24), clamp(self.cols, 80))
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct Pty {
    #[serde(default)]
    size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
struct StartRequest {
    #[serde(default)]
    process: Option<ProcessConfig>,
    #[serde(default)]
    pty: Option<Pty>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Debug, Default, Deserialize)]
struct Selector {
    #[serde(default, deserialize_with = "de_u32")]
    pid: Option<u32>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct SelectorRequest {
    #[serde(default)]
    process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
struct Input {
    #[serde(default, deserialize_with = "de_bytes")]
    stdin: Option<Vec<u8>>,
    #[serde(default, deserialize_with = "de_bytes")]
    pty: Option<Vec<u8>>,
}

#[derive(Debug, Default, Deserialize)]
struct SendInputRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamInputData {
    #[serde(default)]
    input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamInputRequest {
    #[serde(default)]
    start: Option<SelectorRequest>,
    #[serde(default)]
    data: Option<StreamInputData>,
}

#[derive(Debug, Default, Deserialize)]
struct SendSignalRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    signal: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct UpdateRequest {
    #[serde(default)]
    process: Option<Selector>,
    #[serde(default)]
    pty: Option<Pty>,
}

/// Which output a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    Stdout,
    Stderr,
    Pty,
}

impl Output {
    fn field(self) -> &'static str {
        match self {
            Output::Stdout => "stdout",
            Output::Stderr => "stderr",
            Output::Pty => "pty",
        }
    }
}

/// How a process ended (`ProcessEvent.EndEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

/// The name Go gives a signal in a `ProcessState` ("killed", "terminated", or "signal N").
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "hangup",
        libc::SIGINT => "interrupt",
        libc::SIGQUIT => "quit",
        libc::SIGABRT => "aborted",
        libc::SIGKILL => "killed",
        libc::SIGSEGV => "segmentation fault",
        libc::SIGPIPE => "broken pipe",
        libc::SIGALRM => "alarm clock",
        libc::SIGTERM => "terminated",
        _ => return format!("signal {sig}"),
    };
    name.to_string()
}

impl End {
    /// Like Go's `ProcessState`: exit code -1 and "signal: killed" for a signal.
    fn from_status(status: Option<ExitStatus>) -> End {
        match status {
            Some(ExitStatus::Exited(code)) => {
                let status = format!("exit status {code}");
                End {
                    exit_code: code,
                    exited: true,
                    error: (code != 0).then(|| status.clone()),
                    status,
                }
            }
            Some(ExitStatus::Signaled(sig)) => {
                let status = format!("signal: {}", signal_name(sig));
                End {
                    exit_code: -1,
                    exited: false,
                    error: Some(status.clone()),
                    status,
                }
            }
            None => End {
                exit_code: -1,
                exited: false,
                status: "unknown".into(),
                error: Some("the exit status of the process was lost".into()),
            },
        }
    }

    fn event(&self) -> Value {
        let mut end =
            json!({"exitCode": self.exit_code, "exited": self.exited, "status": self.status});
        if let Some(e) = &self.error {
            end["error"] = json!(e);
        }
        json!({"event": {"end": end}})
    }
}

#[derive(Debug, Clone)]
enum Event {
    Data(Output, Arc<Vec<u8>>),
    End(End),
}

#[derive(Default)]
struct Followers {
    queues: Vec<Sender<Event>>,
    end: Option<End>,
}

/// One started process.
pub struct Proc {
    pid: u32,
    config: ProcessConfig,
    tag: Option<String>,
    stdin: Mutex<Option<File>>,
    pty: Option<File>,
    followers: Mutex<Followers>,
}

impl Proc {
    /// A new follower queue; `Err(end)` when the process has ended already.
    fn follow(&self) -> Result<Receiver<Event>, End> {
        let mut f = self.followers.lock();
        if let Some(end) = &f.end {
            return Err(end.clone());
        }
        let (tx, rx) = bounded(FOLLOWER_QUEUE);
        f.queues.push(tx);
        Ok(rx)
    }

    fn broadcast(&self, event: Event) {
        let queues = self.followers.lock().queues.clone();
        let mut dropped = Vec::new();
        for q in &queues {
            if q.send_timeout(event.clone(), FOLLOWER_STALL).is_err() {
                dropped.push(q.clone());
            }
        }
        if !dropped.is_empty() {
            self.followers
                .lock()
                .queues
                .retain(|q| !dropped.iter().any(|d| d.same_channel(q)));
        }
    }

    fn finish(&self, end: End) {
        let queues = {
            let mut f = self.followers.lock();
            f.end = Some(end.clone());
            std::mem::take(&mut f.queues)
        };
        for q in queues {
            let _ = q.send_timeout(Event::End(end.clone()), FOLLOWER_STALL);
        }
    }

    /// Signals the process group (the session for a PTY), or the process alone when the
    /// group is gone.
    fn signal(&self, sig: libc::c_int) -> Result<(), RpcError> {
        let pid = self.pid as i32;
        match sys::kill_group(pid, sig) {
            Ok(()) => Ok(()),
            Err(e) if e.errno() == Some(libc::ESRCH) => sys::signal_pid(pid, sig)
                .or_else(|e| match e.errno() {
                    Some(libc::ESRCH) => Ok(()),
                    _ => Err(e),
                })
                .map_err(|e| RpcError::internal(format!("error sending signal: {e}"))),
            Err(e) => Err(RpcError::internal(format!("error sending signal: {e}"))),
        }
    }

    fn info(&self) -> Value {
        let mut v = json!({"config": self.config.to_json(), "pid": self.pid});
        if let Some(tag) = &self.tag {
            v["tag"] = json!(tag);
        }
        v
    }

    fn write_input(&self, input: Option<Input>) -> Result<(), RpcError> {
        let input = input.unwrap_or_default();
        let result = match (input.stdin, input.pty) {
            (Some(data), _) => {
                if self.pty.is_some() {
                    return Err(RpcError::internal(
                        "error writing to stdin: the process has a PTY; send input as pty",
                    ));
                }
                let mut stdin = self.stdin.lock();
                let Some(pipe) = stdin.as_mut() else {
                    return Err(RpcError::internal(
                        "error writing to stdin: stdin not enabled or closed",
                    ));
                };
                write_bounded(pipe, &data)
            }
            (None, Some(data)) => match &self.pty {
                Some(master) => write_bounded(master, &data),
                None => {
                    return Err(RpcError::internal(
                        "error writing to tty: the process has no PTY; send input as stdin",
                    ))
                }
            },
            (None, None) => return Err(RpcError::new(Code::Unimplemented, "invalid input type")),
        };
        result.map_err(|e| {
            RpcError::internal(format!("error writing input of process {}: {e}", self.pid))
        })
    }
}

/// Writes all of `data` to a non-blocking pipe or PTY, waiting at most [`INPUT_STALL`]
/// for the process to make room, so a process that never reads its input cannot hold
/// the request thread forever.
fn write_bounded(file: &File, data: &[u8]) -> std::io::Result<()> {
    let mut rest = data;
    let deadline = Instant::now() + INPUT_STALL;
    while !rest.is_empty() {
        match (&*file).write(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                let writable = sys::poll_writable(file.as_fd(), left).map_err(|e| e.source)?;
                if left.is_zero() || !writable {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the process has not read its input for {} s",
                            INPUT_STALL.as_secs()
                        ),
                    ));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Running processes, and ended ones kept for a while.
#[derive(Default)]
pub struct Table {
    inner: Mutex<TableInner>,
}

#[derive(Default)]
struct TableInner {
    running: HashMap<u32, Arc<Proc>>,
    ended: Vec<(Instant, Arc<Proc>)>,
}

fn find_in<'a>(procs: impl Iterator<Item = &'a Arc<Proc>>, sel: &Selector) -> Option<Arc<Proc>> {
    let mut procs = procs;
    match (sel.pid, &sel.tag) {
        (Some(pid), _) => procs.find(|p| p.pid == pid).cloned(),
        (None, Some(tag)) => procs.find(|p| p.tag.as_deref() == Some(tag)).cloned(),
        (None, None) => None,
    }
}

fn not_found(sel: &Selector) -> RpcError {
    match (sel.pid, &sel.tag) {
        (Some(pid), _) => RpcError::not_found(format!("process with pid {pid} not found")),
        (None, Some(tag)) => RpcError::not_found(format!("process with tag {tag} not found")),
        (None, None) => RpcError::invalid("no process selected: give a pid or a tag"),
    }
}

impl Table {
    /// A running process.
    fn running(&self, sel: Option<Selector>) -> Result<Arc<Proc>, RpcError> {
        let sel = sel.unwrap_or_default();
        find_in(self.inner.lock().running.values(), &sel).ok_or_else(|| not_found(&sel))
    }

    /// A running process, or one that ended less than [`RETAIN_ENDED`] ago.
    fn any(&self, sel: Option<Selector>) -> Result<Arc<Proc>, RpcError> {
        let sel = sel.unwrap_or_default();
        let mut inner = self.inner.lock();
        inner.ended.retain(|(at, _)| at.elapsed() < RETAIN_ENDED);
        if let Some(p) = find_in(inner.running.values(), &sel) {
            return Ok(p);
        }
        find_in(inner.ended.iter().rev().map(|(_, p)| p), &sel).ok_or_else(|| not_found(&sel))
    }

    fn check_room(&self) -> Result<(), RpcError> {
        if self.inner.lock().running.len() >= MAX_PROCESSES {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("{MAX_PROCESSES} processes are running already; wait for some to end"),
            ));
        }
        Ok(())
    }

    fn insert(&self, p: Arc<Proc>) {
        self.inner.lock().running.insert(p.pid, p);
    }

    fn ended(&self, pid: u32) {
        let mut inner = self.inner.lock();
        if let Some(p) = inner.running.remove(&pid) {
            inner
                .ended
                .retain(|(at, e)| at.elapsed() < RETAIN_ENDED && e.pid != pid);
            if inner.ended.len() >= MAX_RETAINED {
                inner.ended.remove(0);
            }
            inner.ended.push((Instant::now(), p));
        }
    }

    fn list(&self) -> Vec<Value> {
        let inner = self.inner.lock();
        let mut procs: Vec<&Arc<Proc>> = inner.running.values().collect();
        procs.sort_by_key(|p| p.pid);
        procs.iter().map(|p| p.info()).collect()
    }
}

/// Starts the process a `StartRequest` describes, killed by its output thread at
/// `deadline`; returns it with its first follower.
fn spawn(
    envd: &Envd,
    call: &Call,
    req: StartRequest,
    deadline: Option<Instant>,
) -> Result<(Arc<Proc>, Receiver<Event>), RpcError> {
    let config = req.process.unwrap_or_default();
    if config.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    let user = envd.user(call)?;
    let cwd = envd.resolve(config.cwd.as_deref().unwrap_or(""), &user)?;
    if !cwd.is_dir() {
        return Err(RpcError::invalid(format!(
            "cwd '{}' does not exist",
            cwd.display()
        )));
    }
    let env = process_env(envd, &user, &config);
    let starting = |e: &dyn std::fmt::Display| {
        RpcError::invalid(format!("error starting process '{}': {e}", config.cmd))
    };
    let program = match lookup(&config.cmd, &env["PATH"], &cwd) {
        Lookup::Found(p) => p,
        Lookup::NotExecutable(p) => {
            return Err(starting(&format!("{}: permission denied", p.display())))
        }
        Lookup::NotFound => return Err(starting(&"executable file not found in $PATH")),
    };
    envd.processes.check_room()?;

    let mut cmd = Command::new(&program);
    cmd.arg0(&config.cmd)
        .args(&config.args)
        .env_clear()
        .envs(&env)
        .current_dir(&cwd);
    if envd.switch_users {
        // With the user's supplementary groups (std's `uid` would drop them all).
        let groups = envd.accounts.groups_of(&user);
        sys::switch_user_on_spawn(&mut cmd, user.uid, user.gid, groups);
    }
    let pty = match req.pty {
        Some(p) => Some(attach_pty(
            &mut cmd,
            p.size.unwrap_or_default().rows_cols(),
        )?),
        None => {
            let stdin = if req.stdin.unwrap_or(true) {
                Stdio::piped()
            } else {
                Stdio::null()
            };
            cmd.stdin(stdin)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0);
            None
        }
    };
    let (child, exit_pipe) = envd.reaper.spawn(&mut cmd).map_err(|e| starting(&e))?;
    // The command holds the parent's copies of the PTY slave: close them, or the PTY
    // never reports the end of the session.
    drop(cmd);
    let (pty, pty_reader) = pty.unzip();
    let (pid, stdin, outputs) = take_pipes(child, pty_reader);
    for f in stdin.iter().chain(pty.iter()) {
        if let Err(e) = sys::set_nonblocking(f.as_fd()) {
            log::warn!("envd process pid={pid}: input stays blocking: {e}");
        }
    }
    let proc = Arc::new(Proc {
        pid,
        config,
        tag: req.tag,
        stdin: Mutex::new(stdin),
        pty,
        followers: Mutex::new(Followers::default()),
    });
    let first = proc.follow().expect("a new process has not ended");
    envd.processes.insert(proc.clone());
    let (p, reaper, table) = (proc.clone(), envd.reaper.clone(), envd.processes.clone());
    let spawned = std::thread::Builder::new()
        .name(format!("proc-{pid}"))
        .spawn(move || pump(&p, outputs, &exit_pipe, deadline, &reaper, &table));
    if let Err(e) = spawned {
        let _ = proc.signal(libc::SIGKILL);
        envd.processes.ended(pid);
        return Err(internal("cannot start the output thread", &e));
    }
    log::info!("envd process started pid={pid} cmd={:?}", proc.config.cmd);
    Ok((proc, first))
}

fn internal(what: &str, e: &dyn std::fmt::Display) -> RpcError {
    RpcError::internal(format!("{what}: {e}"))
}

/// What a process starts with: a login's basics, then the sandbox's defaults, then the
/// request's own (later wins).
fn process_env(
    envd: &Envd,
    user: &super::User,
    config: &ProcessConfig,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".into(), user.home.to_string_lossy().into_owned());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.insert("E2B_SANDBOX".into(), "true".into());
    env.extend(envd.defaults().env);
    env.extend(config.envs.clone());
    env
}

/// Gives the command a new PTY of `rows` x `cols` as its controlling terminal and its
/// stdio; returns the master and a second handle on it for the output thread.
fn attach_pty(cmd: &mut Command, (rows, cols): (u16, u16)) -> Result<(File, File), RpcError> {
    let (master, slave) = sys::open_pty(rows, cols).map_err(|e| internal("opening a PTY", &e))?;
    let slave = File::from(slave);
    let dup = |f: &File| {
        f.try_clone()
            .map_err(|e| internal("duplicating the PTY", &e))
    };
    cmd.stdin(dup(&slave)?).stdout(dup(&slave)?).stderr(slave);
    sys::controlling_terminal_on_spawn(cmd);
    let master = File::from(master);
    let reader = dup(&master)?;
    Ok((master, reader))
}

/// The streams the output thread reads, each with its kind.
type Outputs = Vec<(Output, Option<File>)>;

/// The child's pid, its stdin pipe, and the outputs the output thread reads (the PTY's
/// master, or stdout and stderr).
fn take_pipes(
    mut child: std::process::Child,
    pty_reader: Option<File>,
) -> (u32, Option<File>, Outputs) {
    let file = |fd: OwnedFd| File::from(fd);
    let outputs = match pty_reader {
        Some(r) => vec![(Output::Pty, Some(r))],
        None => vec![
            (Output::Stdout, child.stdout.take().map(|s| file(s.into()))),
            (Output::Stderr, child.stderr.take().map(|s| file(s.into()))),
        ],
    };
    let stdin = child.stdin.take().map(|s| file(s.into()));
    (child.id(), stdin, outputs)
}

/// The output thread of one process (see the module docs).
fn pump(
    proc: &Proc,
    mut outputs: Outputs,
    exit_pipe: &PipeReader,
    deadline: Option<Instant>,
    reaper: &Reaper,
    table: &Table,
) {
    let mut buf = vec![0u8; CHUNK];
    let mut exited_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        let now = Instant::now();
        if let Some(at) = exited_at {
            if now >= at + DRAIN_LIMIT {
                break;
            }
        }
        if let (Some(d), false, None) = (deadline, killed, exited_at) {
            if now >= d {
                log::info!("envd process timed out pid={}", proc.pid);
                let _ = proc.signal(libc::SIGKILL);
                killed = true;
            }
        }
        let open: Vec<usize> = (0..outputs.len())
            .filter(|&i| outputs[i].1.is_some())
            .collect();
        if open.is_empty() && exited_at.is_some() {
            break;
        }
        let mut fds: Vec<_> = open
            .iter()
            .map(|&i| outputs[i].1.as_ref().expect("open output").as_fd())
            .collect();
        if exited_at.is_none() {
            fds.push(exit_pipe.as_fd());
        }
        let wait = match (exited_at, deadline) {
            (Some(_), _) => Some(DRAIN_IDLE),
            (None, Some(d)) if !killed => Some(d.saturating_duration_since(now)),
            _ => None,
        };
        let ready = match sys::poll_readable(&fds, wait) {
            Ok(r) => r,
            Err(e) => {
                log::error!("envd process pid={} poll failed: {e}", proc.pid);
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let mut progressed = false;
        for (k, &i) in open.iter().enumerate() {
            if !ready[k] {
                continue;
            }
            progressed = true;
            let (kind, file) = &mut outputs[i];
            let Some(f) = file.as_mut() else { continue };
            match f.read(&mut buf) {
                Ok(0) => *file = None,
                Ok(n) => proc.broadcast(Event::Data(*kind, Arc::new(buf[..n].to_vec()))),
                // The PTY description is non-blocking (for input): nothing after all.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                    ) => {}
                // EIO: the last holder of the PTY slave closed it.
                Err(_) => *file = None,
            }
        }
        if exited_at.is_none() && ready.len() > open.len() && ready[open.len()] {
            exited_at = Some(Instant::now());
        } else if exited_at.is_some() && !progressed {
            break;
        }
    }
    let end = End::from_status(reaper.take_status(proc.pid as i32));
    log::info!(
        "envd process ended pid={} status={:?}",
        proc.pid,
        end.status
    );
    proc.stdin.lock().take();
    proc.finish(end);
    table.ended(proc.pid);
}

/// Streams a process's events to `sink` until it ends, the client leaves, or `deadline`
/// (the call's timeout) passes (then `deadline_exceeded`; `Start` kills the process first).
fn stream_events(
    proc: &Proc,
    events: Receiver<Event>,
    (call, deadline): (&Call, Option<Instant>),
    sink: &mut dyn MessageSink,
    kill_at_deadline: bool,
) -> Result<(), RpcError> {
    if sink
        .send(&json!({"event": {"start": {"pid": proc.pid}}}))
        .is_err()
    {
        return Ok(());
    }
    let mut next_ping = Instant::now() + call.keepalive;
    loop {
        let wake = deadline.map_or(next_ping, |d| d.min(next_ping));
        let message = match events.recv_timeout(wake.saturating_duration_since(Instant::now())) {
            Ok(Event::Data(kind, bytes)) => {
                json!({"event": {"data": {kind.field(): connect::encode_bytes(&bytes)}}})
            }
            // The output thread kills a process at its deadline: that end is the timeout.
            Ok(Event::End(_)) if deadline.is_some_and(|d| Instant::now() >= d) => {
                return Err(timed_out(proc, call))
            }
            Ok(Event::End(end)) => {
                let _ = sink.send(&end.event());
                return Ok(());
            }
            Err(RecvTimeoutError::Timeout) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    if kill_at_deadline {
                        let _ = proc.signal(libc::SIGKILL);
                    }
                    return Err(timed_out(proc, call));
                }
                json!({"event": {"keepalive": {}}})
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(RpcError::internal(format!(
                    "the client read the output of process {} too slowly; the stream was dropped",
                    proc.pid
                )))
            }
        };
        if sink.send(&message).is_err() {
            return Ok(());
        }
        next_ping = Instant::now() + call.keepalive;
    }
}

fn timed_out(proc: &Proc, call: &Call) -> RpcError {
    let ms = call.timeout.unwrap_or_default().as_millis();
    RpcError::new(
        Code::DeadlineExceeded,
        format!(
            "the call's timeout of {ms} ms was reached (process {})",
            proc.pid
        ),
    )
}

/// `Start` (server stream): start event with the pid, output, end event.
pub fn start(
    envd: &Envd,
    call: &Call,
    msg: &[u8],
    sink: &mut dyn MessageSink,
) -> Result<(), RpcError> {
    let req: StartRequest = connect::parse(msg)?;
    // One deadline for the output thread that kills the process and for the stream that
    // reports it: an end the kill caused is then always the timeout's.
    let deadline = call.timeout.map(|t| Instant::now() + t);
    let (proc, events) = spawn(envd, call, req, deadline)?;
    stream_events(&proc, events, (call, deadline), sink, true)
}

/// `Connect` (server stream): re-attach to a running (or just ended) process.
pub fn connect(
    envd: &Envd,
    call: &Call,
    msg: &[u8],
    sink: &mut dyn MessageSink,
) -> Result<(), RpcError> {
    let req: SelectorRequest = connect::parse(msg)?;
    let proc = envd.processes.any(req.process)?;
    match proc.follow() {
        Ok(events) => {
            let deadline = call.timeout.map(|t| Instant::now() + t);
            stream_events(&proc, events, (call, deadline), sink, false)
        }
        Err(end) => {
            let start = json!({"event": {"start": {"pid": proc.pid}}});
            if sink.send(&start).is_ok() {
                let _ = sink.send(&end.event());
            }
            Ok(())
        }
    }
}

/// `List`: the running processes.
pub fn list(envd: &Envd, _call: &Call, _msg: &[u8]) -> Result<Value, RpcError> {
    Ok(json!({"processes": envd.processes.list()}))
}

/// `SendInput`: bytes to the process's stdin or PTY.
pub fn send_input(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: SendInputRequest = connect::parse(msg)?;
    envd.processes
        .running(req.process)?
        .write_input(req.input)?;
    Ok(json!({}))
}

/// `StreamInput` (client stream): a start message selecting the process, then input.
pub fn stream_input(envd: &Envd, _call: &Call, body: &mut dyn Read) -> Result<Value, RpcError> {
    let mut proc = None;
    while let Some((flags, msg)) = connect::read_envelope(body)? {
        if flags & connect::FLAG_END_STREAM != 0 {
            break;
        }
        let req: StreamInputRequest = connect::parse(&msg)?;
        if let Some(start) = req.start {
            proc = Some(envd.processes.running(start.process)?);
        } else if let Some(data) = req.data {
            let Some(p) = &proc else {
                return Err(RpcError::invalid("input came before the start message"));
            };
            p.write_input(data.input)?;
        }
    }
    Ok(json!({}))
}

/// `CloseStdin`: EOF on the process's stdin (not for PTYs: send Ctrl-D there).
pub fn close_stdin(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: SelectorRequest = connect::parse(msg)?;
    let proc = envd.processes.running(req.process)?;
    if proc.pty.is_some() {
        return Err(RpcError::new(
            Code::Unknown,
            "error closing stdin: the process has a PTY; send Ctrl+D (0x04) instead",
        ));
    }
    proc.stdin.lock().take();
    Ok(json!({}))
}

/// `SendSignal`: SIGKILL or SIGTERM to the process (and its process group).
pub fn send_signal(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: SendSignalRequest = connect::parse(msg)?;
    let proc = envd.processes.running(req.process)?;
    let sig = match &req.signal {
        Some(Value::String(s)) if s == "SIGNAL_SIGKILL" => libc::SIGKILL,
        Some(Value::String(s)) if s == "SIGNAL_SIGTERM" => libc::SIGTERM,
        Some(Value::Number(n)) if n.as_i64() == Some(9) => libc::SIGKILL,
        Some(Value::Number(n)) if n.as_i64() == Some(15) => libc::SIGTERM,
        other => {
            return Err(RpcError::new(
                Code::Unimplemented,
                format!("invalid signal: {}", other.clone().unwrap_or(Value::Null)),
            ))
        }
    };
    proc.signal(sig)?;
    Ok(json!({}))
}

/// `Update`: resize the process's PTY.
pub fn update(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: UpdateRequest = connect::parse(msg)?;
    let proc = envd.processes.running(req.process)?;
    if let Some(p) = req.pty {
        let Some(master) = &proc.pty else {
            return Err(RpcError::internal(
                "error resizing tty: the process has no PTY",
            ));
        };
        let (rows, cols) = p.size.unwrap_or_default().rows_cols();
        sys::set_window_size(master.as_fd(), rows, cols)
            .map_err(|e| RpcError::internal(format!("error resizing tty: {e}")))?;
    }
    Ok(json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_events_read_like_envd() {
        let ok = End::from_status(Some(ExitStatus::Exited(0)));
        assert_eq!(
            ok.event(),
            json!({"event": {"end": {"exitCode": 0, "exited": true, "status": "exit status 0"}}})
        );
        let failed = End::from_status(Some(ExitStatus::Exited(3)));
        assert_eq!(failed.error.as_deref(), Some("exit status 3"));
        let killed = End::from_status(Some(ExitStatus::Signaled(libc::SIGKILL)));
        assert_eq!(
            (killed.exit_code, killed.exited, killed.status.as_str()),
            (-1, false, "signal: killed")
        );
    }

    #[test]
    fn requests_parse_protobuf_json() {
        let r: StartRequest = connect::parse(
            br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":null},"pty":{"size":{"cols":"100","rows":30}},"stdin":false,"unknown":1}"#,
        )
        .unwrap();
        let p = r.process.unwrap();
        assert_eq!(
            (p.cmd.as_str(), p.args.len(), p.envs["A"].as_str(), p.cwd),
            ("/bin/bash", 3, "1", None)
        );
        assert_eq!(r.pty.unwrap().size.unwrap().rows_cols(), (30, 100));
        assert_eq!(r.stdin, Some(false));
        let s: SendInputRequest =
            connect::parse(br#"{"process":{"pid":"12"},"input":{"stdin":"aGk="}}"#).unwrap();
        assert_eq!(s.process.unwrap().pid, Some(12));
        assert_eq!(s.input.unwrap().stdin.unwrap(), b"hi");
    }
}
