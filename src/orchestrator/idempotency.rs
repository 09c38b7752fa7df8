//! `Idempotency-Key` on creates (api.md §4.2): a retry with the same key within
//! `[sandbox] idempotency_window_secs` gets the first call's sandbox instead of a second
//! one; the same key with a different request is 409. A retry that arrives while the first
//! call still runs waits for it (bounded). A create that failed forgets its key, so it can
//! be retried. Keys live in memory only: a restart forgets them.

use super::{OrchError, SandboxInfo};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Keys remembered at once; past it the oldest finished ones go first.
const MAX_KEYS: usize = 10_000;
/// How long a retry waits for the first call with its key.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(180);

/// What a request fingerprint is: the SHA-256 of its route and body.
pub type Fingerprint = [u8; 32];

enum Outcome {
    InFlight,
    Created(Box<SandboxInfo>),
}

struct Remembered {
    fingerprint: Fingerprint,
    at: Instant,
    outcome: Outcome,
}

/// The remembered keys of one server.
pub(crate) struct IdempotencyKeys {
    window: Duration,
    keys: Mutex<HashMap<String, Remembered>>,
    finished: Condvar,
}

/// What a create with a key does.
pub(crate) enum Claim<'a> {
    /// The first call: create, then [`KeyClaim::finish`].
    First(KeyClaim<'a>),
    /// A retry: the first call's sandbox, as it was created.
    Replay(Box<SandboxInfo>),
}

/// A key whose create runs now; dropped without [`KeyClaim::finish`], the key is forgotten.
pub(crate) struct KeyClaim<'a> {
    keys: &'a IdempotencyKeys,
    key: String,
    finished: bool,
}

impl IdempotencyKeys {
    pub fn new(window: Duration) -> IdempotencyKeys {
        IdempotencyKeys {
            window,
            keys: Mutex::new(HashMap::new()),
            finished: Condvar::new(),
        }
    }

    /// Claims `key` for a request with `fingerprint`.
    pub fn claim(&self, key: &str, fingerprint: Fingerprint) -> Result<Claim<'_>, OrchError> {
        let deadline = Instant::now() + IN_FLIGHT_WAIT;
        let mut keys = self.keys.lock();
        loop {
            let now = Instant::now();
            keys.retain(|_, r| matches!(r.outcome, Outcome::InFlight) || now - r.at < self.window);
            let Some(known) = keys.get(key) else {
                make_room(&mut keys);
                keys.insert(
                    key.to_string(),
                    Remembered {
                        fingerprint,
                        at: now,
                        outcome: Outcome::InFlight,
                    },
                );
                return Ok(Claim::First(KeyClaim {
                    keys: self,
                    key: key.to_string(),
                    finished: false,
                }));
            };
            if known.fingerprint != fingerprint {
                return Err(OrchError::Conflict(
                    "Idempotency-Key was already used with a different request body; use a new key for a new sandbox".into(),
                ));
            }
            match &known.outcome {
                Outcome::Created(info) => return Ok(Claim::Replay(info.clone())),
                Outcome::InFlight => {
                    if self.finished.wait_until(&mut keys, deadline).timed_out() {
                        return Err(OrchError::Conflict(
                            "a create with this Idempotency-Key is still in progress; retry later"
                                .into(),
                        ));
                    }
                }
            }
        }
    }
}

/// Drops the oldest finished keys while the map is full.
fn make_room(keys: &mut HashMap<String, Remembered>) {
    while keys.len() >= MAX_KEYS {
        let oldest = keys
            .iter()
            .filter(|(_, r)| matches!(r.outcome, Outcome::Created(_)))
            .min_by_key(|(_, r)| r.at)
            .map(|(k, _)| k.clone());
        match oldest {
            Some(k) => keys.remove(&k),
            None => return,
        };
    }
}

impl KeyClaim<'_> {
    /// The create succeeded: retries within the window get `info`.
    pub fn finish(mut self, info: &SandboxInfo) {
        if let Some(r) = self.keys.keys.lock().get_mut(&self.key) {
            r.outcome = Outcome::Created(Box::new(info.clone()));
            r.at = Instant::now();
        }
        self.finished = true;
    }
}

impl Drop for KeyClaim<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.keys.keys.lock().remove(&self.key);
        }
        self.keys.finished.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orchestrator::{fakes, SandboxState};

    #[test]
    fn a_retry_replays_a_different_body_conflicts_a_failure_forgets() {
        let keys = IdempotencyKeys::new(Duration::from_secs(60));
        let info = fakes::info("sb", SandboxState::Running);
        let Claim::First(claim) = keys.claim("k", [1; 32]).unwrap() else {
            panic!("first claim")
        };
        claim.finish(&info);
        match keys.claim("k", [1; 32]).unwrap() {
            Claim::Replay(i) => assert_eq!(i.id, "sb"),
            Claim::First(_) => panic!("a retry creates again"),
        }
        assert!(matches!(
            keys.claim("k", [2; 32]),
            Err(OrchError::Conflict(_))
        ));
        // A failed create (the claim dropped) leaves the key free.
        let Claim::First(claim) = keys.claim("other", [1; 32]).unwrap() else {
            panic!()
        };
        drop(claim);
        assert!(matches!(
            keys.claim("other", [3; 32]).unwrap(),
            Claim::First(_)
        ));
    }

    #[test]
    fn keys_expire_after_the_window() {
        let keys = IdempotencyKeys::new(Duration::from_millis(1));
        let Claim::First(claim) = keys.claim("k", [1; 32]).unwrap() else {
            panic!()
        };
        claim.finish(&fakes::info("sb", SandboxState::Running));
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(keys.claim("k", [2; 32]).unwrap(), Claim::First(_)));
    }

    #[test]
    fn a_retry_waits_for_the_first_call() {
        let keys = std::sync::Arc::new(IdempotencyKeys::new(Duration::from_secs(60)));
        let Claim::First(claim) = keys.claim("k", [1; 32]).unwrap() else {
            panic!()
        };
        let k2 = keys.clone();
        let retry = std::thread::spawn(move || match k2.claim("k", [1; 32]).unwrap() {
            Claim::Replay(i) => i.id,
            Claim::First(_) => "created again".into(),
        });
        std::thread::sleep(Duration::from_millis(50));
        claim.finish(&fakes::info("sb", SandboxState::Running));
        assert_eq!(retry.join().unwrap(), "sb");
    }
}
