//! Custom-extension client (`custom-extension.md`): sends the four hooks, keeps the
//! open-instance journal, retries stops in the background and counts what it did.
//!
//! Threads:
//! - an elastic pool of `hook-worker` threads serving one FIFO lane per sandbox
//!   ([`lanes`]): start, stop and retry attempts of one sandbox go out in submission
//!   order, and different sandboxes never wait for each other (custom-extension.md §2.9, §6.1);
//! - one `hook-retry` timer thread that queues stop retries 1 s, 2 s and 4 s after the
//!   previous attempt ended (custom-extension.md §8.2).
//!
//! API-facing calls block their caller until the attempt finished, at most `timeout_ms`
//! after the attempt began (plus a few milliseconds), even if the worker is stuck in
//! something ureq does not bound (DNS).

pub mod boot_args;
mod error;
mod journal;
mod lanes;
mod metrics;
mod rules;
mod transport;

pub use error::{Cause, HookError};
pub use journal::{HookJournal, JournalEntry};
pub use transport::MAX_BODY;

use crate::config::CustomExtensionConfig;
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use lanes::Lanes;
use log::{error, info, warn};
use metrics::HookMetrics;
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use transport::Transport;

/// The four hooks, with their wire names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    StartFresh = 0,
    StartResume = 1,
    PatchParams = 2,
    Stop = 3,
}

impl Hook {
    pub const ALL: [Hook; 4] = [
        Hook::StartFresh,
        Hook::StartResume,
        Hook::PatchParams,
        Hook::Stop,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Hook::StartFresh => "start-fresh",
            Hook::StartResume => "start-resume",
            Hook::PatchParams => "patch-params",
            Hook::Stop => "stop",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an instance ends; sent as `X-Agentenv-Stop-Reason` (custom-extension.md §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StopReason {
    Pause,
    TimeoutPause,
    TimeoutKill,
    Delete,
    Shutdown,
    StartFailed,
    Failure,
    TemplateBuild,
    Recovery,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Pause => "pause",
            StopReason::TimeoutPause => "timeout-pause",
            StopReason::TimeoutKill => "timeout-kill",
            StopReason::Delete => "delete",
            StopReason::Shutdown => "shutdown",
            StopReason::StartFailed => "start-failed",
            StopReason::Failure => "failure",
            StopReason::TemplateBuild => "template-build",
            StopReason::Recovery => "recovery",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a start hook needs to know about the new instance.
#[derive(Debug, Clone)]
pub struct StartContext {
    pub sandbox_id: String,
    /// `<netns_dir>/agentenv-ns-<n>`, as configured (not resolved through symlinks).
    pub netns_path: PathBuf,
    pub host_ip: Ipv4Addr,
    /// Recorded in the journal so that network reclaim can keep the slot until the
    /// recovery stop's first attempt (custom-extension.md §3.4, §9.3).
    pub slot_index: u32,
    /// The effective params; absent, `null` and `{}` are all sent as `{}` (custom-extension.md §10.1).
    pub params: Value,
}

/// One start attempt's identity. Every instance with an id must be passed to
/// [`HookClient::stop`] exactly once, whatever happened after the start (custom-extension.md §4.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    pub sandbox_id: String,
    /// `None` when no start hook was attempted (extension disabled, or the journal write
    /// failed): stopping it is a no-op (custom-extension.md §4.5).
    pub instance_id: Option<String>,
}

/// Retries follow the first attempt at most this many times minus one (custom-extension.md §8.2).
pub const MAX_STOP_ATTEMPTS: u32 = 4;

/// Delay before attempt `done + 1`, after attempt `done` failed: 1 s, 2 s, 4 s.
pub fn retry_delay(done: u32) -> Duration {
    Duration::from_secs(1 << (done.clamp(1, 3) - 1))
}

/// How long a caller waits past `timeout_ms` for a worker whose attempt ureq did not end
/// in time (DNS lookups are not bounded by ureq).
const CALLER_GRACE: Duration = Duration::from_millis(25);

/// The custom-extension client. Shared as `Arc<HookClient>`.
pub struct HookClient {
    inner: Arc<Inner>,
}

struct Inner {
    /// `None` when the extension is disabled.
    transport: Option<Transport>,
    journal: HookJournal,
    lanes: Arc<Lanes>,
    metrics: HookMetrics,
    /// Instance ids with an open journal entry.
    open: Mutex<HashSet<String>>,
    /// Stops waiting for a background retry, by instance id.
    pending: Mutex<HashMap<String, PendingStop>>,
    retry_tx: Sender<(Instant, String)>,
    recovery: Mutex<Recovery>,
    recovery_done: Condvar,
    shutting_down: AtomicBool,
    /// Set when the client is dropped: no further retries (as after a crash).
    closed: AtomicBool,
}

#[derive(Default)]
struct Recovery {
    /// Entries loaded at startup; taken by `recover`.
    to_recover: Option<Vec<JournalEntry>>,
    /// The same, kept for `recovery_entries`.
    loaded: Vec<JournalEntry>,
    /// Instance id → slot index, until the recovery stop's first attempt has finished.
    first_attempt_pending: HashMap<String, u32>,
}

#[derive(Debug, Clone)]
struct PendingStop {
    sandbox_id: String,
    instance_id: String,
    reason: StopReason,
    /// Attempts made so far.
    attempts: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopMode {
    /// First attempt or a scheduled retry.
    Normal,
    /// §6.2: a newer instance of the sandbox is about to start.
    FinalBeforeNewerStart,
    /// §9.1: graceful shutdown.
    FinalAtShutdown,
}

/// Worker → caller messages for one blocking call.
enum Reply<T> {
    /// The attempt is about to go out (the journal entry is on disk for starts).
    Began(Instant),
    Done(Result<T, HookError>),
}

impl HookClient {
    /// Builds the client and loads the journal at `journal_dir` (created if missing).
    /// Nothing is sent until [`HookClient::recover`] or a lifecycle call.
    pub fn start(
        cfg: &CustomExtensionConfig,
        journal_dir: PathBuf,
    ) -> Result<Arc<HookClient>, HookError> {
        let (journal, loaded) = HookJournal::open(&journal_dir)?;
        let transport = cfg
            .base_url()
            .map(|url| Transport::new(url, cfg.token(), cfg.timeout_ms));
        let first_attempt_pending = if transport.is_some() {
            loaded
                .iter()
                .map(|e| (e.sandbox_instance_id.clone(), e.slot_index))
                .collect()
        } else {
            HashMap::new()
        };
        let (retry_tx, retry_rx) = unbounded();
        let inner = Arc::new(Inner {
            transport,
            journal,
            lanes: Lanes::new(),
            metrics: HookMetrics::default(),
            open: Mutex::new(
                loaded
                    .iter()
                    .map(|e| e.sandbox_instance_id.clone())
                    .collect(),
            ),
            pending: Mutex::new(HashMap::new()),
            retry_tx,
            recovery: Mutex::new(Recovery {
                to_recover: Some(loaded.clone()),
                loaded,
                first_attempt_pending,
            }),
            recovery_done: Condvar::new(),
            shutting_down: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("hook-retry".into())
            .spawn(move || retry_timer(weak, retry_rx))
            .map_err(|e| HookError::Journal(format!("cannot spawn the hook retry thread: {e}")))?;
        Ok(Arc::new(HookClient { inner }))
    }

    /// Whether an extension URL is configured.
    pub fn enabled(&self) -> bool {
        self.inner.transport.is_some()
    }

    /// `timeout_ms` of the configuration.
    pub fn timeout_ms(&self) -> Option<u64> {
        self.inner.transport.as_ref().map(Transport::timeout_ms)
    }

    /// Sends stop (reason `recovery`, normal retry policy) for every journal entry that was
    /// open at startup, in the background, per-sandbox ordered (custom-extension.md §9.3). With the
    /// extension disabled, the entries are dropped with a WARN each (custom-extension.md §9.6). Runs once;
    /// later calls do nothing.
    pub fn recover(&self) {
        let inner = &self.inner;
        let Some(entries) = inner.recovery.lock().to_recover.take() else {
            return;
        };
        if !self.enabled() {
            for e in &entries {
                warn!(
                    "dropping open hook journal entry: the custom extension is disabled sandboxId={} sandboxInstanceId={}",
                    e.sandbox_id, e.sandbox_instance_id
                );
                inner.close_entry(&e.sandbox_instance_id);
            }
            return;
        }
        if !entries.is_empty() {
            info!("sending recovery stops count={}", entries.len());
        }
        for e in entries {
            let inner2 = Arc::clone(inner);
            let lane = e.sandbox_id.clone();
            inner.lanes.submit(
                &lane,
                Box::new(move || {
                    let stop = PendingStop {
                        sandbox_id: e.sandbox_id,
                        instance_id: e.sandbox_instance_id,
                        reason: StopReason::Recovery,
                        attempts: 0,
                    };
                    let id = stop.instance_id.clone();
                    if !inner2.closed.load(Ordering::SeqCst) {
                        inner2.stop_attempt(stop, StopMode::Normal);
                    }
                    inner2.recovery.lock().first_attempt_pending.remove(&id);
                    inner2.recovery_done.notify_all();
                }),
            );
        }
    }

    /// The journal entries that were open at startup (the instances that were running, or
    /// whose stop was still owed, when the previous server process ended).
    pub fn recovery_entries(&self) -> Vec<JournalEntry> {
        self.inner.recovery.lock().loaded.clone()
    }

    /// Slot indices of startup entries whose recovery stop's first attempt has not
    /// finished yet. Network reclaim keeps these slots' namespaces until then (custom-extension.md §3.4).
    pub fn recovering_slots(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .inner
            .recovery
            .lock()
            .first_attempt_pending
            .values()
            .copied()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Waits until every recovery stop's first attempt has finished. `false` on timeout.
    pub fn wait_recovery_first_attempts(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut rec = self.inner.recovery.lock();
        while !rec.first_attempt_pending.is_empty() {
            if self
                .inner
                .recovery_done
                .wait_until(&mut rec, deadline)
                .timed_out()
            {
                return rec.first_attempt_pending.is_empty();
            }
        }
        true
    }

    /// Records the instance in the journal (durably), then sends start-fresh and applies
    /// custom-extension.md §3.1 and §11. `base_cmdline_len` is the length of the kernel command line the
    /// arguments would be appended to (as `" " + args`).
    ///
    /// The instance is returned even on failure: if it has an id, the caller owes it a
    /// stop (reason `start-failed`, custom-extension.md §7.3).
    pub fn start_fresh(
        &self,
        s: &StartContext,
        base_cmdline_len: usize,
    ) -> (Instance, Result<Option<String>, HookError>) {
        self.start_hook(Hook::StartFresh, s, base_cmdline_len)
    }

    /// Like [`HookClient::start_fresh`] for start-resume (custom-extension.md §3.2): any 2xx succeeds.
    pub fn start_resume(&self, s: &StartContext) -> (Instance, Result<(), HookError>) {
        let (instance, r) = self.start_hook(Hook::StartResume, s, 0);
        (instance, r.map(|_| ()))
    }

    /// Sends patch-params and returns the sandbox's new full params (`{}` when cleared).
    /// `HookError::Disabled` when the extension is disabled (the API's 400).
    ///
    /// Calls for one sandbox are not serialised with each other (custom-extension.md §6.5); the orchestrator
    /// keeps them inside the running instance (custom-extension.md §6.4).
    pub fn patch_params(&self, sandbox_id: &str, patch: &Value) -> Result<Value, HookError> {
        if !self.enabled() {
            return Err(HookError::Disabled);
        }
        let body = serde_json::to_vec(&json!({ "sandboxId": sandbox_id, "patch": patch }))
            .expect("JSON serializes");
        let (tx, rx) = bounded(2);
        let inner = Arc::clone(&self.inner);
        let sandbox = sandbox_id.to_string();
        // A lane of its own: overlapping PATCH calls do not queue behind each other.
        self.inner.lanes.submit(
            &format!("patch:{}", crate::util::new_id()),
            Box::new(move || {
                let began = Instant::now();
                let _ = tx.send(Reply::Began(began));
                let r = inner
                    .transport()
                    .send(Hook::PatchParams, &body, 1, None)
                    .and_then(|b| rules::patch_params(&b));
                let outcome = r.as_ref().map(drop);
                inner
                    .metrics
                    .request(Hook::PatchParams, outcome, began.elapsed());
                let r = r.map_err(|cause| HookError::Failed {
                    hook: Hook::PatchParams,
                    cause,
                });
                if let Err(e) = &r {
                    warn!("hook failed hook=patch-params sandboxId={sandbox} error=\"{e}\"");
                }
                let _ = tx.send(Reply::Done(r));
            }),
        );
        self.wait(rx, Hook::PatchParams).1
    }

    /// Sends stop for `instance` and waits for the first attempt (at most `timeout_ms`).
    /// A failed attempt is retried in the background (custom-extension.md §8); the journal entry is closed
    /// on delivery or when the stop is given up. No-op when the instance has no id.
    pub fn stop(&self, instance: Instance, reason: StopReason) {
        let Some(instance_id) = instance.instance_id else {
            return;
        };
        if !self.enabled() {
            return;
        }
        let (tx, rx) = bounded(2);
        let inner = Arc::clone(&self.inner);
        let stop = PendingStop {
            sandbox_id: instance.sandbox_id,
            instance_id,
            reason,
            attempts: 0,
        };
        let lane = stop.sandbox_id.clone();
        self.inner.lanes.submit(
            &lane,
            Box::new(move || {
                let _ = tx.send(Reply::Began(Instant::now()));
                inner.stop_attempt(stop, StopMode::Normal);
                let _ = tx.send(Reply::Done(Ok(())));
            }),
        );
        let _ = self.wait(rx, Hook::Stop);
    }

    /// Graceful shutdown (custom-extension.md §9.1 step 4): every stop waiting for a retry gets one final
    /// attempt now; a failed one stays open in the journal for the next start. Also waits
    /// for hooks already queued. Stops sent after this make one attempt, no retries.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        // Set under the lock that `stop_attempt` checks it under: every stop is either
        // drained here or sees the flag and schedules no retry.
        let pending: Vec<PendingStop> = {
            let mut pending = inner.pending.lock();
            inner.shutting_down.store(true, Ordering::SeqCst);
            pending.drain().map(|(_, p)| p).collect()
        };
        let mut done = Vec::new();
        for p in pending {
            let (tx, rx) = bounded::<()>(1);
            let inner2 = Arc::clone(inner);
            let lane = p.sandbox_id.clone();
            inner.lanes.submit(
                &lane,
                Box::new(move || {
                    inner2.stop_attempt(p, StopMode::FinalAtShutdown);
                    let _ = tx.send(());
                }),
            );
            done.push(rx);
        }
        for lane in inner.lanes.active_keys() {
            let (tx, rx) = bounded::<()>(1);
            inner.lanes.submit(
                &lane,
                Box::new(move || {
                    let _ = tx.send(());
                }),
            );
            done.push(rx);
        }
        for rx in done {
            let _ = rx.recv();
        }
    }

    /// Open journal entries right now.
    pub fn open_instances(&self) -> usize {
        self.inner.open.lock().len()
    }

    /// Appends the hook metric families (custom-extension.md §8.7) in Prometheus text format.
    pub fn render_metrics(&self, out: &mut String) {
        self.inner.metrics.render(out, self.open_instances());
    }

    fn start_hook(
        &self,
        hook: Hook,
        s: &StartContext,
        base_cmdline_len: usize,
    ) -> (Instance, Result<Option<String>, HookError>) {
        let mut instance = Instance {
            sandbox_id: s.sandbox_id.clone(),
            instance_id: None,
        };
        if !self.enabled() {
            return (instance, Ok(None));
        }
        let instance_id = crate::util::new_id();
        let entry = JournalEntry {
            sandbox_id: s.sandbox_id.clone(),
            sandbox_instance_id: instance_id.clone(),
            network_namespace_path: s.netns_path.clone(),
            host_interaction_ip: s.host_ip,
            slot_index: s.slot_index,
            started_at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        let params = match &s.params {
            Value::Object(_) => s.params.clone(),
            _ => json!({}),
        };
        let body = serde_json::to_vec(&json!({
            "sandboxId": s.sandbox_id,
            "sandboxInstanceId": instance_id,
            "networkNamespacePath": s.netns_path.to_string_lossy(),
            "hostInteractionIp": s.host_ip.to_string(),
            "customExtensionParams": params,
        }))
        .expect("JSON serializes");
        let (tx, rx) = bounded(2);
        let inner = Arc::clone(&self.inner);
        self.inner.lanes.submit(
            &s.sandbox_id,
            Box::new(move || inner.run_start(hook, entry, body, base_cmdline_len, tx)),
        );
        let (began, result) = self.wait(rx, hook);
        if began {
            instance.instance_id = Some(instance_id);
        }
        (instance, result)
    }

    /// Waits for a worker's reply: without limit until the attempt begins (what is ahead
    /// in the lane is itself bounded), then at most `timeout_ms` + a small grace.
    fn wait<T>(&self, rx: Receiver<Reply<T>>, hook: Hook) -> (bool, Result<T, HookError>) {
        let timeout_ms = self.timeout_ms().unwrap_or(0);
        let limit = Duration::from_millis(timeout_ms) + CALLER_GRACE;
        let mut deadline: Option<Instant> = None;
        loop {
            let msg = match deadline {
                None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_deadline(d),
            };
            match msg {
                Ok(Reply::Began(at)) => deadline = Some(at + limit),
                Ok(Reply::Done(r)) => return (deadline.is_some(), r),
                Err(RecvTimeoutError::Timeout) => {
                    let cause = Cause::TimedOut { ms: timeout_ms };
                    return (true, Err(HookError::Failed { hook, cause }));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let cause = Cause::Connection("the hook worker ended unexpectedly".into());
                    return (deadline.is_some(), Err(HookError::Failed { hook, cause }));
                }
            }
        }
    }
}

impl Drop for HookClient {
    fn drop(&mut self) {
        // Like a crash: pending retries are abandoned and their entries stay open.
        self.inner.closed.store(true, Ordering::SeqCst);
    }
}

impl Inner {
    fn transport(&self) -> &Transport {
        self.transport
            .as_ref()
            .expect("hooks are only queued when the extension is enabled")
    }

    /// Runs in the sandbox's lane.
    fn run_start(
        self: &Arc<Self>,
        hook: Hook,
        entry: JournalEntry,
        body: Vec<u8>,
        base_cmdline_len: usize,
        reply: Sender<Reply<Option<String>>>,
    ) {
        // §6.2: an older instance's stop still waiting for a retry gets one final attempt
        // and is closed before this start goes out.
        let stale: Vec<PendingStop> = {
            let mut pending = self.pending.lock();
            let ids: Vec<String> = pending
                .values()
                .filter(|p| p.sandbox_id == entry.sandbox_id)
                .map(|p| p.instance_id.clone())
                .collect();
            ids.iter().filter_map(|id| pending.remove(id)).collect()
        };
        for p in stale {
            self.stop_attempt(p, StopMode::FinalBeforeNewerStart);
        }
        if let Err(e) = self.journal.record(&entry) {
            error!(
                "cannot record the instance; start hook not sent hook={hook} sandboxId={} sandboxInstanceId={} error=\"{e}\"",
                entry.sandbox_id, entry.sandbox_instance_id
            );
            let _ = reply.send(Reply::Done(Err(e)));
            return;
        }
        self.open.lock().insert(entry.sandbox_instance_id.clone());
        let began = Instant::now();
        let _ = reply.send(Reply::Began(began));
        let r = self
            .transport()
            .send(hook, &body, 1, None)
            .and_then(|b| match hook {
                Hook::StartFresh => rules::start_fresh(&b, base_cmdline_len),
                _ => Ok(None),
            });
        self.metrics
            .request(hook, r.as_ref().map(drop), began.elapsed());
        let r = r.map_err(|cause| HookError::Failed { hook, cause });
        if let Err(e) = &r {
            warn!(
                "hook failed hook={hook} sandboxId={} sandboxInstanceId={} error=\"{e}\"",
                entry.sandbox_id, entry.sandbox_instance_id
            );
        }
        let _ = reply.send(Reply::Done(r));
    }

    /// Makes attempt `stop.attempts + 1` and decides what follows. Runs in the sandbox's
    /// lane. Returns whether the stop was delivered.
    fn stop_attempt(self: &Arc<Self>, mut stop: PendingStop, mode: StopMode) -> bool {
        let n = stop.attempts + 1;
        stop.attempts = n;
        let body = serde_json::to_vec(&json!({
            "sandboxId": stop.sandbox_id,
            "sandboxInstanceId": stop.instance_id,
        }))
        .expect("JSON serializes");
        let began = Instant::now();
        let r = self
            .transport()
            .send(Hook::Stop, &body, n, Some(stop.reason));
        self.metrics
            .request(Hook::Stop, r.as_ref().map(drop), began.elapsed());
        if n > 1 {
            self.metrics.stop_retry();
        }
        let (sid, iid, reason) = (&stop.sandbox_id, &stop.instance_id, stop.reason);
        let cause = match r {
            Ok(_) => {
                if n > 1 {
                    info!(
                        "stop hook delivered sandboxId={sid} sandboxInstanceId={iid} attempt={n}/{MAX_STOP_ATTEMPTS} stopReason={reason}"
                    );
                }
                self.close_entry(iid);
                return true;
            }
            Err(cause) => cause,
        };
        warn!(
            "stop hook failed sandboxId={sid} sandboxInstanceId={iid} attempt={n}/{MAX_STOP_ATTEMPTS} reason=\"{cause}\" stopReason={reason}"
        );
        let retryable = cause.is_retryable();
        let mut pending = self.pending.lock();
        let halted =
            self.shutting_down.load(Ordering::SeqCst) || self.closed.load(Ordering::SeqCst);
        if retryable && mode == StopMode::Normal && !halted && n < MAX_STOP_ATTEMPTS {
            let due = Instant::now() + retry_delay(n);
            let id = stop.instance_id.clone();
            pending.insert(id.clone(), stop);
            let _ = self.retry_tx.send((due, id));
            return false;
        }
        drop(pending);
        if retryable && (mode == StopMode::FinalAtShutdown || halted) {
            warn!(
                "stop hook left open for the next start sandboxId={sid} sandboxInstanceId={iid} attempt={n}/{MAX_STOP_ATTEMPTS} reason=\"{cause}\" stopReason={reason}"
            );
        } else {
            error!(
                "stop hook given up sandboxId={sid} sandboxInstanceId={iid} attempt={n}/{MAX_STOP_ATTEMPTS} reason=\"{cause}\" stopReason={reason}"
            );
            self.metrics.stop_undelivered();
            self.close_entry(iid);
        }
        false
    }

    fn close_entry(&self, instance_id: &str) {
        if let Err(e) = self.journal.close(instance_id) {
            error!("cannot close hook journal entry sandboxInstanceId={instance_id} error=\"{e}\"");
        }
        self.open.lock().remove(instance_id);
    }

    /// Called by the timer: queues the retry in the sandbox's lane.
    fn fire_retry(self: &Arc<Self>, instance_id: String) {
        if self.closed.load(Ordering::SeqCst) || self.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let Some(lane) = self
            .pending
            .lock()
            .get(&instance_id)
            .map(|p| p.sandbox_id.clone())
        else {
            return;
        };
        let inner = Arc::clone(self);
        self.lanes.submit(
            &lane,
            Box::new(move || {
                if inner.closed.load(Ordering::SeqCst) {
                    return;
                }
                // Gone when a newer start or shutdown already made the final attempt.
                let Some(p) = inner.pending.lock().remove(&instance_id) else {
                    return;
                };
                inner.stop_attempt(p, StopMode::Normal);
            }),
        );
    }
}

/// The `hook-retry` thread: fires each scheduled retry when it is due. Ends when the
/// client is gone.
fn retry_timer(inner: Weak<Inner>, rx: Receiver<(Instant, String)>) {
    use std::cmp::Reverse;
    let mut due: BinaryHeap<Reverse<(Instant, String)>> = BinaryHeap::new();
    loop {
        let msg = match due.peek() {
            Some(Reverse((at, _))) => rx.recv_deadline(*at),
            None => rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        match msg {
            Ok(item) => due.push(Reverse(item)),
            Err(RecvTimeoutError::Timeout) => {
                let Some(inner) = inner.upgrade() else { return };
                let now = Instant::now();
                while let Some(Reverse((at, _))) = due.peek() {
                    if *at > now {
                        break;
                    }
                    let Reverse((_, id)) = due.pop().expect("peeked");
                    inner.fire_retry(id);
                }
            }
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_are_1_2_4_seconds() {
        assert_eq!(retry_delay(1), Duration::from_secs(1));
        assert_eq!(retry_delay(2), Duration::from_secs(2));
        assert_eq!(retry_delay(3), Duration::from_secs(4));
    }

    #[test]
    fn wire_names() {
        let names: Vec<_> = Hook::ALL.iter().map(|h| h.as_str()).collect();
        assert_eq!(
            names,
            ["start-fresh", "start-resume", "patch-params", "stop"]
        );
        assert_eq!(StopReason::TimeoutPause.as_str(), "timeout-pause");
        assert_eq!(StopReason::StartFailed.as_str(), "start-failed");
        assert_eq!(StopReason::TemplateBuild.as_str(), "template-build");
    }
}
