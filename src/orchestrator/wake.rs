//! Auto-resume (api.md §4.23, E2B's `autoResume`): traffic for a sandbox that is paused
//! with `autoResume` enabled wakes it. [`route_waking`] is the one entry point for
//! traffic to a sandbox (the envd proxy, for envd and every other port): it answers
//! where the sandbox runs, resuming it first when it sleeps.
//!
//! One resume per sandbox at a time: the first request that finds it paused starts a
//! `wake` thread (an ordinary connect, so the extension sees start-resume, and the next
//! pause sends stop, as for any resume); every request, the first included, then waits
//! for the sandbox to run, at most `[sandbox] auto_resume_wait_secs`. A request whose
//! wait runs out is answered 503; the resume goes on.

use super::envd::{route, EnvdRoute};
use super::registry::Registry;
use super::sandbox::{SandboxEntry, SandboxState};
use super::settings::PauseMode;
use super::start::Launcher;
use super::OrchError;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting request looks whether the sandbox runs.
const POLL: Duration = Duration::from_millis(25);

/// Where sandbox `id` runs; a paused one with `autoResume` is resumed first, waiting at
/// most `wait`. Without `autoResume` (or for an unknown sandbox) this is [`route`].
pub(crate) fn route_waking(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    id: &str,
    wait: Duration,
) -> Result<EnvdRoute, OrchError> {
    let first = route(registry, id);
    let EnvdRoute::NotRunning { .. } = first else {
        return Ok(first);
    };
    let Ok(entry) = registry.entry(id) else {
        return Ok(first);
    };
    if !wants_wake(&entry)? {
        return Ok(first);
    }
    let deadline = Instant::now() + wait;
    start_wake(registry, launcher, &entry, id);
    loop {
        let now = route(registry, id);
        if matches!(now, EnvdRoute::Running(_)) {
            return Ok(now);
        }
        if let Some(e) = entry.wake_error() {
            return Err(e);
        }
        // Deleted, or its VM died: answer as for any sandbox that is gone.
        if registry.entry(id).is_err() {
            return Ok(now);
        }
        if Instant::now() >= deadline {
            return Err(OrchError::Unavailable(format!(
                "sandbox {id} is resuming (autoResume) and did not run within {} s \
                 ([sandbox] auto_resume_wait_secs); retry",
                wait.as_secs()
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// Whether traffic should wake `entry`: paused (or on its way there) with `autoResume`.
/// A sandbox paused filesystem-only never wakes on traffic (it would cold-boot): 409.
fn wants_wake(entry: &SandboxEntry) -> Result<bool, OrchError> {
    let info = entry.info();
    if !info.settings.auto_resume {
        return Ok(false);
    }
    let sleeping = matches!(
        info.state(),
        SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming
    );
    if sleeping && entry.paused_filesystem_only() {
        return Err(OrchError::Conflict(format!(
            "sandbox {} is paused filesystem-only, which auto-resume cannot wake; resume it \
             with connect",
            info.id
        )));
    }
    Ok(sleeping)
}

/// Starts the resume of `entry` on a `wake` thread unless one runs already.
fn start_wake(
    registry: &Arc<Registry>,
    launcher: &Arc<Launcher>,
    entry: &Arc<SandboxEntry>,
    id: &str,
) {
    if !entry.begin_wake() {
        return;
    }
    let (registry, launcher, entry2) = (registry.clone(), launcher.clone(), entry.clone());
    let sandbox = id.to_string();
    let spawned = std::thread::Builder::new()
        .name("wake".into())
        .spawn(move || {
            let secs = entry2.read(|i| i.settings.timeout_secs);
            let result = super::operations::resume(
                &registry,
                &launcher,
                &sandbox,
                secs,
                super::ConnectKind::Connect,
                PauseMode::Full,
            );
            match &result {
                Ok(c) => log::info!(
                    "sandboxId={sandbox} op=auto_resume result=ok resumed={}",
                    c.resumed
                ),
                Err(e) => log::warn!("sandboxId={sandbox} op=auto_resume error=\"{e}\""),
            }
            entry2.end_wake(result.err());
        });
    if let Err(e) = spawned {
        entry.end_wake(Some(OrchError::Unavailable(format!(
            "cannot start the auto-resume of sandbox {id}: {e}"
        ))));
    }
}
