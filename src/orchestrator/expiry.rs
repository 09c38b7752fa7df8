//! The expiry thread: once a second, running sandboxes past `endAt` are stopped:
//! `autoPause: true` pauses (stop reason `timeout-pause`), `false` deletes
//! (`timeout-kill`). Paused sandboxes never expire. One expiry per sandbox runs at a time,
//! and one that failed (a pause migrates all of the guest's RAM) is retried with an
//! exponential backoff, not every second.

use super::operations::pause;
use super::registry::Registry;
use super::settings::{PauseMode, PauseRequest};
use super::{delete, SandboxState};
use crate::hooks::StopReason;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Wait after a first failed expiry; doubled per further failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Expiries in flight, and when failed ones may run again.
#[derive(Default)]
pub(crate) struct Backoff {
    sandboxes: HashMap<String, Attempts>,
}

struct Attempts {
    failures: u32,
    not_before: SystemTime,
    in_flight: bool,
}

impl Backoff {
    /// Whether an expiry of `id` may start now; if so it is in flight until [`Backoff::done`].
    fn start(&mut self, id: &str, now: SystemTime) -> bool {
        let a = self.sandboxes.entry(id.to_string()).or_insert(Attempts {
            failures: 0,
            not_before: now,
            in_flight: false,
        });
        if a.in_flight || now < a.not_before {
            return false;
        }
        a.in_flight = true;
        true
    }

    fn done(&mut self, id: &str, ok: bool, now: SystemTime) {
        if ok {
            self.sandboxes.remove(id);
            return;
        }
        if let Some(a) = self.sandboxes.get_mut(id) {
            a.in_flight = false;
            a.failures += 1;
            let factor = 1u32 << (a.failures - 1).min(16);
            a.not_before = now + (FIRST_BACKOFF * factor).min(MAX_BACKOFF);
        }
    }

    /// Forgets sandboxes that are no longer expired (deleted, extended), unless in flight.
    fn keep_only<T>(&mut self, expired: &[(String, T)]) {
        self.sandboxes
            .retain(|id, a| a.in_flight || expired.iter().any(|(e, _)| e == id));
    }
}

pub(crate) fn spawn(registry: Weak<Registry>) {
    let backoff = Arc::new(Mutex::new(Backoff::default()));
    super::registry::spawn_periodic("expiry", registry, CHECK_INTERVAL, move |registry| {
        tick(registry, &backoff, SystemTime::now());
        registry.sweep_kept();
    });
}

/// One check: every running sandbox past `endAt` whose backoff allows it is paused or
/// deleted on a thread of its own (so a slow teardown never delays another sandbox's
/// expiry). Returns those threads.
pub(crate) fn tick(
    registry: &Arc<Registry>,
    backoff: &Arc<Mutex<Backoff>>,
    now: SystemTime,
) -> Vec<JoinHandle<()>> {
    let expired = expired(registry, now);
    backoff.lock().keep_only(&expired);
    let mut threads = Vec::new();
    for (id, on_timeout) in expired {
        if !backoff.lock().start(&id, now) {
            continue;
        }
        let registry = registry.clone();
        let spawned = std::thread::Builder::new().name("expire".into()).spawn({
            let id = id.clone();
            let backoff = backoff.clone();
            move || {
                let result = match on_timeout {
                    Some(request) => {
                        pause(&registry, &id, StopReason::TimeoutPause, request).map(|()| "paused")
                    }
                    None => delete(&registry, &id, StopReason::TimeoutKill).map(|()| "deleted"),
                };
                backoff.lock().done(&id, result.is_ok(), SystemTime::now());
                match result {
                    Ok(what) => {
                        if let Ok(entry) = registry.entry(&id) {
                            let level = super::sandbox_log::LogLevel::Info;
                            entry.log.event(level, "pause", "paused by its timeout");
                        }
                        log::info!("sandboxId={id} op=expire result={what}")
                    }
                    Err(e) => {
                        log::warn!("sandboxId={id} op=expire error=\"{e}\" (retried with backoff)")
                    }
                }
            }
        });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                log::warn!("sandboxId={id} op=expire error=\"cannot spawn a thread: {e}\"");
                backoff.lock().done(&id, false, SystemTime::now());
            }
        }
    }
    threads
}

/// The running sandboxes past `endAt`, each with the pause its timeout asks for (`None`:
/// it is deleted).
fn expired(registry: &Registry, now: SystemTime) -> Vec<(String, Option<PauseRequest>)> {
    registry
        .entries()
        .iter()
        .filter_map(|e| {
            let info = e.info();
            (info.state() == SandboxState::Running && info.end_at <= now).then(|| {
                let s = &info.settings;
                let request = s.auto_pause.then_some(PauseRequest {
                    mode: PauseMode::with_memory(s.auto_pause_memory),
                    require_healthy_guest: false,
                });
                (info.id.clone(), request)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_expiry_backs_off_and_never_overlaps() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut b = Backoff::default();
        assert!(b.start("a", t0));
        assert!(!b.start("a", at(1)), "one expiry of a sandbox at a time");
        b.done("a", false, at(1));
        // Not every second: 5 s, then 10 s, then 20 s after each failure.
        assert!(!b.start("a", at(2)));
        assert!(!b.start("a", at(5)));
        assert!(b.start("a", at(6)));
        b.done("a", false, at(6));
        assert!(!b.start("a", at(15)));
        assert!(b.start("a", at(16)));
        b.done("a", false, at(16));
        assert!(!b.start("a", at(35)));
        assert!(b.start("a", at(36)));
        b.done("a", true, at(37));
        assert!(b.sandboxes.is_empty());
        // The cap holds however often it failed.
        for i in 0..40 {
            assert!(b.start("b", at(10_000 * i)));
            b.done("b", false, at(10_000 * i));
        }
        assert!(b.sandboxes["b"].not_before <= at(10_000 * 39) + MAX_BACKOFF);
        // A sandbox that is no longer expired is forgotten.
        b.keep_only::<()>(&[]);
        assert!(b.sandboxes.is_empty());
    }
}
