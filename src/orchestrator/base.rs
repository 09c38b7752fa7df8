//! Keeps `base` (the E2B SDKs' default template, built from the built-in image) built.
//!
//! Its build calls the extension like any build, so the extension down or answering 500
//! at that moment, a full state disk, or a server killed mid-build leaves it in `error`,
//! and every `Sandbox.create()` without a template would fail until an operator deleted
//! it. A keeper thread retries instead: once a build of `base` failed, it waits (5 s,
//! doubled per further failure, up to 5 minutes), forgets the failed build and builds
//! again, until `base` is ready. Each retry is logged and counted in
//! `agentenv_base_template_retries_total`.

use super::templates::{ensure_base, BuildStatus, BASE_TEMPLATE};
use super::Shared;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

const CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// The wait after a first failure; doubled per further failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(5);
const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// The keeper's memory: failures in a row and when the next build may start.
#[derive(Default)]
pub(crate) struct BaseKeeper {
    attempts: Mutex<Attempts>,
    retries: AtomicU64,
}

#[derive(Default)]
struct Attempts {
    /// Failed builds of `base` in a row.
    failures: u32,
    /// The failed build the backoff below is for.
    failed_build: Option<String>,
    not_before: Option<Instant>,
}

impl BaseKeeper {
    pub fn render_metrics(&self, out: &mut String) {
        super::metrics::render_counter(
            out,
            "agentenv_base_template_retries_total",
            "Builds of the base template started again after one failed.",
            self.retries.load(Ordering::Relaxed),
        );
    }
}

/// At startup: builds `base` unless it is there (a failed build of an earlier run is
/// built again at once), then keeps it built on a thread of its own.
pub(crate) fn keep_built(shared: &Arc<Shared>) {
    forget_failed_builds(shared);
    ensure_base(shared);
    let weak = Arc::downgrade(shared);
    let spawned = std::thread::Builder::new()
        .name("base-keeper".into())
        .spawn(move || watch(weak));
    if let Err(e) = spawned {
        log::warn!(
            "op=template_build name={BASE_TEMPLATE} error=\"cannot start the keeper thread: {e}\" \
             (a failed build of it is retried at the next start)"
        );
    }
}

fn watch(shared: Weak<Shared>) {
    loop {
        std::thread::sleep(CHECK_INTERVAL);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        check(&shared, Instant::now());
    }
}

/// One look: nothing to do while `base` is there or building; after a failure, builds
/// again once the backoff has passed.
fn check(shared: &Arc<Shared>, now: Instant) {
    let keeper = &shared.base;
    if base_exists(shared) {
        *keeper.attempts.lock() = Attempts::default();
        return;
    }
    let (failed, in_progress) = base_builds(shared);
    if in_progress {
        return;
    }
    // Without a failed build, `base` was deleted by an operator (left so) or never
    // submitted (a full disk at startup: built at the next start with room).
    let Some((id, reason)) = failed.first() else {
        return;
    };
    {
        let mut a = keeper.attempts.lock();
        if a.failed_build.as_deref() != Some(id.as_str()) {
            a.failures += 1;
            let wait = backoff(a.failures);
            a.failed_build = Some(id.clone());
            a.not_before = Some(now + wait);
            log::warn!(
                "templateId={id} op=template_build name={BASE_TEMPLATE} result=error \
                 failures={} retry_in_s={} reason=\"{reason}\"",
                a.failures,
                wait.as_secs()
            );
        }
        if a.not_before.is_some_and(|t| now < t) {
            return;
        }
    }
    forget_failed_builds(shared);
    let n = keeper.retries.fetch_add(1, Ordering::Relaxed) + 1;
    log::info!("op=template_build name={BASE_TEMPLATE} result=retry retries={n}");
    ensure_base(shared);
}

fn backoff(failures: u32) -> Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(16);
    (FIRST_BACKOFF * factor).min(MAX_BACKOFF)
}

/// Whether `base` is a template (a ready build or a catalog template).
fn base_exists(shared: &Shared) -> bool {
    shared.catalog.find(BASE_TEMPLATE).is_some() || shared.snapshots.lookup(BASE_TEMPLATE).is_some()
}

/// The failed builds named `base` (id, reason), newest first, and whether one is waiting
/// or building.
fn base_builds(shared: &Shared) -> (Vec<(String, String)>, bool) {
    let mut builds: Vec<_> = shared
        .builds
        .list()
        .into_iter()
        .filter(|b| b.name == BASE_TEMPLATE && b.catalog.is_none())
        .collect();
    builds.sort_by_key(|b| std::cmp::Reverse(b.updated_at));
    let in_progress = builds
        .iter()
        .any(|b| matches!(b.status, BuildStatus::Waiting | BuildStatus::Building));
    let failed = builds
        .into_iter()
        .filter(|b| b.status == BuildStatus::Error)
        .map(|b| (b.id, b.reason.unwrap_or_default()))
        .collect();
    (failed, in_progress)
}

/// Forgets the failed builds of `base`, so that the name is free and its detail names
/// the build under way rather than an old failure.
fn forget_failed_builds(shared: &Shared) {
    for (id, _) in base_builds(shared).0 {
        shared.builds.remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_doubles_from_five_seconds_up_to_five_minutes() {
        let secs: Vec<u64> = (1..=9).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(backoff(u32::MAX).as_secs(), 300);
    }
}
