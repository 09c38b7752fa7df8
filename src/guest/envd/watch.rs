//! Directory watches on inotify: `WatchDir` (a server stream, used by the JS SDK) and the
//! polled watchers `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` (the python
//! SDK). A recursive watch adds a watch per subdirectory, including ones created later.
//!
//! Event types follow fsnotify, which envd uses: created or moved in → CREATE, modified
//! → WRITE, deleted → REMOVE, moved away → RENAME, attributes changed → CHMOD. Names are
//! relative to the watched directory.
//!
//! A directory on a network file system (NFS, as volumes are, SMB/CIFS, FUSE) is refused
//! unless the request sets `allowNetworkMounts` (envd 0.6.4): inotify there reports only
//! what this guest does, never writes by other clients of the same server. The check is on
//! the watched directory; a recursive watch includes what is mounted below it.
//!
//! Bounds: [`MAX_WATCHES`] watches at once (streams and polled ones together), each
//! recursive watch covers at most [`MAX_DIRS`] directories, and a polled watcher queues
//! at most [`MAX_QUEUED`] events (more is an error the next poll reports).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};

use super::filesystem::entry_info;
use super::users::OwnerNames;
use super::{Call, Envd};
use crate::protocol::connect::{self, Code, MessageSink, RpcError};
use crate::sys::guest::{poll_readable, Inotify};

/// Watches open at once.
pub const MAX_WATCHES: usize = 64;
/// Directories one recursive watch covers.
pub const MAX_DIRS: usize = 8192;
/// Events a polled watcher holds between polls.
pub const MAX_QUEUED: usize = 10_000;
/// How often a polled watcher's thread checks for removal.
const POLL_TICK: Duration = Duration::from_millis(250);

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
    #[serde(default, alias = "allow_network_mounts")]
    allow_network_mounts: bool,
}

/// `statfs` types of network file systems, which inotify sees only the local side of.
const NETWORK_FILESYSTEMS: [(i64, &str); 5] = [
    (0x6969, "NFS"),
    (0x517B, "SMB"),
    (0xFF53_4D42, "CIFS"),
    (0xFE53_4D42, "SMB2"),
    (0x6573_5546, "FUSE"),
];

/// The network file system `path` is on, if any.
fn network_filesystem(path: &Path) -> Option<&'static str> {
    let kind = crate::sys::guest::filesystem_type(path).ok()?;
    NETWORK_FILESYSTEMS
        .iter()
        .find(|(magic, _)| *magic == kind)
        .map(|(_, name)| *name)
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatcherIdRequest {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

/// One inotify instance over a directory (and its subdirectories when recursive).
struct Watch {
    inotify: Inotify,
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    dirs: HashMap<i32, PathBuf>,
}

fn internal(e: impl std::fmt::Display) -> RpcError {
    RpcError::internal(format!("watcher error: {e}"))
}

impl Watch {
    fn new(root: PathBuf, recursive: bool, include_entry: bool) -> Result<Watch, RpcError> {
        let mut w = Watch {
            inotify: Inotify::new().map_err(internal)?,
            root: root.clone(),
            recursive,
            include_entry,
            dirs: HashMap::new(),
        };
        w.add_tree(&root)?;
        Ok(w)
    }

    fn add_tree(&mut self, dir: &Path) -> Result<(), RpcError> {
        if self.dirs.len() >= MAX_DIRS {
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("a recursive watch covers {MAX_DIRS} directories at most"),
            ));
        }
        let wd = self.inotify.add_watch(dir, MASK).map_err(internal)?;
        self.dirs.insert(wd, dir.to_path_buf());
        if self.recursive {
            let Ok(read) = std::fs::read_dir(dir) else {
                return Ok(());
            };
            for entry in read.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    self.add_tree(&entry.path())?;
                }
            }
        }
        Ok(())
    }

    /// The events ready now, as `FilesystemEvent`s.
    fn read(&mut self, names: &OwnerNames) -> Result<Vec<Value>, RpcError> {
        let mut out = Vec::new();
        for ev in self.inotify.read_events().map_err(internal)? {
            if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                return Err(internal("the kernel event queue overflowed"));
            }
            if ev.mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&ev.wd);
                continue;
            }
            let Some(dir) = self.dirs.get(&ev.wd) else {
                continue;
            };
            let full = if ev.name.is_empty() {
                dir.clone()
            } else {
                dir.join(&ev.name)
            };
            if self.recursive
                && ev.mask & libc::IN_ISDIR != 0
                && ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0
            {
                // A directory that appears is watched too (errors: it went away again).
                let _ = self.add_tree(&full);
            }
            let name = full
                .strip_prefix(&self.root)
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            for (bits, kind, carries_entry) in [
                (
                    libc::IN_CREATE | libc::IN_MOVED_TO,
                    "EVENT_TYPE_CREATE",
                    true,
                ),
                (
                    libc::IN_MOVED_FROM | libc::IN_MOVE_SELF,
                    "EVENT_TYPE_RENAME",
                    false,
                ),
                (libc::IN_ATTRIB, "EVENT_TYPE_CHMOD", true),
                (libc::IN_MODIFY, "EVENT_TYPE_WRITE", true),
                (
                    libc::IN_DELETE | libc::IN_DELETE_SELF,
                    "EVENT_TYPE_REMOVE",
                    false,
                ),
            ] {
                if ev.mask & bits == 0 {
                    continue;
                }
                let mut event = json!({"name": name, "type": kind});
                if self.include_entry && carries_entry {
                    if let Ok(entry) = entry_info(&full, names) {
                        event["entry"] = entry;
                    }
                }
                out.push(event);
            }
        }
        Ok(out)
    }

    /// Waits up to `timeout` for events.
    fn wait(&self, timeout: Duration) -> Result<bool, RpcError> {
        let ready = poll_readable(&[self.inotify.as_fd()], Some(timeout)).map_err(internal)?;
        Ok(ready[0])
    }
}

/// Frees a watch slot when dropped.
struct Slot<'a>(&'a AtomicUsize);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Polled {
    queue: Mutex<Result<Vec<Value>, RpcError>>,
    stop: AtomicBool,
}

/// The watches of the daemon.
#[derive(Default)]
pub struct Watchers {
    open: Arc<AtomicUsize>,
    polled: Mutex<HashMap<String, Arc<Polled>>>,
}

impl Watchers {
    fn take_slot(&self) -> Result<(), RpcError> {
        if self.open.fetch_add(1, Ordering::SeqCst) >= MAX_WATCHES {
            self.open.fetch_sub(1, Ordering::SeqCst);
            return Err(RpcError::new(
                Code::ResourceExhausted,
                format!("{MAX_WATCHES} directory watches are open already; remove some"),
            ));
        }
        Ok(())
    }
}

/// Resolves and checks the directory of a watch request.
fn open_watch(envd: &Envd, call: &Call, req: &WatchRequest) -> Result<Watch, RpcError> {
    let user = envd.user(call)?;
    // The directory must be the caller's to read; events come from the agent's inotify.
    let _acting = envd.act_as(&user)?;
    let path = envd.resolve(&req.path, &user)?;
    match std::fs::read_dir(&path).and_then(|_| std::fs::metadata(&path)) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "path {} not a directory",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RpcError::not_found(format!(
                "path {} not found",
                path.display()
            )))
        }
        Err(e) => {
            return Err(internal(format!(
                "error statting path {}: {e}",
                path.display()
            )))
        }
    }
    if let Some(fs) = network_filesystem(&path).filter(|_| !req.allow_network_mounts) {
        return Err(RpcError::new(
            Code::FailedPrecondition,
            format!(
                "path {} is on a network file system mount ({fs}): its watch would miss changes made by other clients; set allow_network_mounts to watch it anyway",
                path.display()
            ),
        ));
    }
    Watch::new(path, req.recursive, req.include_entry)
}

/// `WatchDir` (server stream): a start event, then events as they happen.
pub fn watch_dir(
    envd: &Envd,
    call: &Call,
    msg: &[u8],
    sink: &mut dyn MessageSink,
) -> Result<(), RpcError> {
    let req: WatchRequest = connect::parse(msg)?;
    envd.watchers.take_slot()?;
    let _slot = Slot(&envd.watchers.open);
    let mut watch = open_watch(envd, call, &req)?;
    if sink.send(&json!({"start": {}})).is_err() {
        return Ok(());
    }
    let names = envd.accounts.names();
    let deadline = call.timeout.map(|t| Instant::now() + t);
    let mut next_ping = Instant::now() + call.keepalive;
    loop {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            return Err(RpcError::new(
                Code::DeadlineExceeded,
                "the watch's timeout was reached",
            ));
        }
        if now >= next_ping {
            if sink.send(&json!({"keepalive": {}})).is_err() {
                return Ok(());
            }
            next_ping = now + call.keepalive;
        }
        let wake = deadline.map_or(next_ping, |d| d.min(next_ping));
        if !watch.wait(wake.saturating_duration_since(now))? {
            continue;
        }
        for event in watch.read(&names)? {
            if sink.send(&json!({"filesystem": event})).is_err() {
                return Ok(());
            }
            next_ping = Instant::now() + call.keepalive;
        }
    }
}

/// `CreateWatcher`: starts a watch whose events `GetWatcherEvents` collects.
pub fn create_watcher(envd: &Envd, call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: WatchRequest = connect::parse(msg)?;
    envd.watchers.take_slot()?;
    let mut watch = match open_watch(envd, call, &req) {
        Ok(w) => w,
        Err(e) => {
            envd.watchers.open.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
    };
    let id = format!("w{}", crate::util::new_id());
    let polled = Arc::new(Polled {
        queue: Mutex::new(Ok(Vec::new())),
        stop: AtomicBool::new(false),
    });
    let (p, open, names) = (
        polled.clone(),
        envd.watchers.open.clone(),
        envd.accounts.names(),
    );
    let spawned = std::thread::Builder::new()
        .name("envd-watch".into())
        .spawn(move || {
            let _slot = Slot(&open);
            while !p.stop.load(Ordering::SeqCst) {
                let events = watch.wait(POLL_TICK).and_then(|ready| {
                    if ready {
                        watch.read(&names)
                    } else {
                        Ok(Vec::new())
                    }
                });
                let mut queue = p.queue.lock();
                let Ok(queued) = queue.as_mut() else { break };
                match events {
                    Ok(events) if queued.len() + events.len() > MAX_QUEUED => {
                        *queue = Err(RpcError::new(
                            Code::ResourceExhausted,
                            format!("more than {MAX_QUEUED} events queued; poll more often"),
                        ));
                        break;
                    }
                    Ok(events) => queued.extend(events),
                    Err(e) => {
                        *queue = Err(e);
                        break;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        envd.watchers.open.fetch_sub(1, Ordering::SeqCst);
        return Err(internal(format!("cannot start a watcher thread: {e}")));
    }
    envd.watchers.polled.lock().insert(id.clone(), polled);
    Ok(json!({"watcherId": id}))
}

fn polled(envd: &Envd, id: &str) -> Result<Arc<Polled>, RpcError> {
    envd.watchers
        .polled
        .lock()
        .get(id)
        .cloned()
        .ok_or_else(|| RpcError::not_found(format!("watcher with id {id} not found")))
}

/// `GetWatcherEvents`: the events since the last call.
pub fn get_watcher_events(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: WatcherIdRequest = connect::parse(msg)?;
    let p = polled(envd, &req.watcher_id)?;
    let mut queue = p.queue.lock();
    let events = match queue.as_mut() {
        Ok(q) => std::mem::take(q),
        Err(e) => return Err(e.clone()),
    };
    Ok(json!({"events": events}))
}

/// `RemoveWatcher`.
pub fn remove_watcher(envd: &Envd, _call: &Call, msg: &[u8]) -> Result<Value, RpcError> {
    let req: WatcherIdRequest = connect::parse(msg)?;
    let p = envd
        .watchers
        .polled
        .lock()
        .remove(&req.watcher_id)
        .ok_or_else(|| {
            RpcError::not_found(format!("watcher with id {} not found", req.watcher_id))
        })?;
    p.stop.store(true, Ordering::SeqCst);
    Ok(json!({}))
}
