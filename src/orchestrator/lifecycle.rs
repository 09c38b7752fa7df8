//! Admission of calls against a sandbox's state (api.md §2.2–2.3): one lifecycle
//! operation at a time per sandbox, bounded waits through transitions, 409s and 404s from
//! the one decision table in [`decide`].

use super::sandbox::{decide, Call, Decision, SandboxEntry, SandboxState};
use super::OrchError;
use parking_lot::MutexGuard;
use std::time::{Duration, Instant};

/// How long a call waits for the current transition to end (api.md §2.3).
pub(crate) const TRANSITION_WAIT: Duration = Duration::from_secs(60);
/// How often a wait re-reads a state that nobody holds the lock for.
const STUCK_POLL: Duration = Duration::from_millis(20);

/// The outcome of admitting a call.
#[derive(Debug)]
pub(crate) enum Admitted<'a> {
    /// Go ahead; for lifecycle calls the lock is held until the guard drops.
    Proceed(Option<MutexGuard<'a, ()>>),
    /// Nothing to do in this state (e.g. pause of a paused sandbox).
    AlreadyDone(#[allow(dead_code)] SandboxState),
}

/// Whether `call` is a lifecycle operation, which holds the sandbox's lifecycle lock while
/// it runs. The others (timeout, commands, PATCH) only need the state to allow them.
fn is_lifecycle(call: Call) -> bool {
    matches!(
        call,
        Call::Pause
            | Call::Resume
            | Call::Connect
            | Call::Delete
            | Call::Snapshot
            | Call::Fork
            | Call::Network
    )
}

/// Decides `call` against the current state, waiting at most [`TRANSITION_WAIT`] through
/// transitions. A lifecycle call returns holding the lifecycle lock, with the state
/// re-checked under it.
pub(crate) fn admit<'a>(
    entry: &'a SandboxEntry,
    id: &str,
    call: Call,
) -> Result<Admitted<'a>, OrchError> {
    admit_within(entry, id, call, TRANSITION_WAIT)
}

pub(crate) fn admit_within<'a>(
    entry: &'a SandboxEntry,
    id: &str,
    call: Call,
    wait: Duration,
) -> Result<Admitted<'a>, OrchError> {
    let deadline = Instant::now() + wait;
    loop {
        let state = entry.state();
        match decide(call, state) {
            Decision::NotFound => return Err(OrchError::sandbox_not_found(id)),
            Decision::Conflict => {
                return Err(OrchError::Conflict(format!(
                    "sandbox {id} is {}",
                    state.name()
                )))
            }
            Decision::AlreadyDone => return Ok(Admitted::AlreadyDone(state)),
            Decision::Wait => {
                // The transition's owner holds the lock; getting it means it ended, unless
                // the state did not move: an operation that failed midway (a panic) left
                // it behind. Then the wait is bounded by the deadline like any other.
                match entry.lifecycle().try_lock_until(deadline) {
                    Some(guard) => {
                        let stuck = entry.state() == state;
                        drop(guard);
                        if stuck {
                            if Instant::now() >= deadline {
                                return Err(OrchError::Conflict(format!(
                                    "sandbox {id} is still {}",
                                    state.name()
                                )));
                            }
                            std::thread::sleep(STUCK_POLL);
                        }
                    }
                    None => {
                        return Err(OrchError::Conflict(format!(
                            "sandbox {id} is still {}",
                            entry.state().name()
                        )))
                    }
                }
            }
            Decision::Proceed if !is_lifecycle(call) => return Ok(Admitted::Proceed(None)),
            Decision::Proceed => {
                let Some(guard) = entry.lifecycle().try_lock_until(deadline) else {
                    return Err(OrchError::Conflict(format!(
                        "sandbox {id} is still {}",
                        entry.state().name()
                    )));
                };
                // Re-check under the lock: another operation may have run meanwhile.
                match decide(call, entry.state()) {
                    Decision::Proceed => return Ok(Admitted::Proceed(Some(guard))),
                    _ => drop(guard),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn entry(state: SandboxState) -> SandboxEntry {
        SandboxEntry::new(crate::orchestrator::fakes::info("s", state), None)
    }

    #[test]
    fn table_answers() {
        let e = entry(SandboxState::Paused);
        assert!(matches!(
            admit(&e, "s", Call::Pause).unwrap(),
            Admitted::AlreadyDone(SandboxState::Paused)
        ));
        let err = admit(&e, "s", Call::Snapshot).unwrap_err();
        assert_eq!(err, OrchError::Conflict("sandbox s is paused".into()));
        let e = entry(SandboxState::Deleting);
        assert!(matches!(
            admit(&e, "s", Call::Delete).unwrap_err(),
            OrchError::NotFound(_)
        ));
        let e = entry(SandboxState::Running);
        assert!(matches!(
            admit(&e, "s", Call::Timeout).unwrap(),
            Admitted::Proceed(None)
        ));
        assert!(matches!(
            admit(&e, "s", Call::Delete).unwrap(),
            Admitted::Proceed(Some(_))
        ));
    }

    #[test]
    fn waits_through_a_transition_then_decides_again() {
        let e = Arc::new(entry(SandboxState::Pausing));
        let guard = e.lifecycle().lock();
        let e2 = e.clone();
        let t = std::thread::spawn(move || {
            matches!(
                admit(&e2, "s", Call::Pause).unwrap(),
                Admitted::AlreadyDone(SandboxState::Paused)
            )
        });
        std::thread::sleep(Duration::from_millis(50));
        e.set_state(SandboxState::Paused).unwrap();
        drop(guard);
        assert!(
            t.join().unwrap(),
            "pause during pausing waits, then is a no-op"
        );
    }

    #[test]
    fn a_transition_left_behind_by_a_failed_operation_ends_in_409_at_the_deadline() {
        // Pausing, and nobody holds the lifecycle lock: the operation that set it is gone.
        let e = Arc::new(entry(SandboxState::Pausing));
        let (tx, rx) = crossbeam_channel::bounded(1);
        let e2 = e.clone();
        std::thread::spawn(move || {
            let _ = tx
                .send(admit_within(&e2, "s", Call::Pause, Duration::from_millis(100)).map(|_| ()));
        });
        let result = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("admit spun past its deadline");
        assert_eq!(
            result.unwrap_err(),
            OrchError::Conflict("sandbox s is still pausing".into())
        );
    }

    #[test]
    fn a_wait_that_runs_out_is_409() {
        let e = entry(SandboxState::Resuming);
        let _guard = e.lifecycle().lock();
        let err = admit_within(&e, "s", Call::Connect, Duration::from_millis(50)).unwrap_err();
        assert_eq!(
            err,
            OrchError::Conflict("sandbox s is still resuming".into())
        );
    }
}
