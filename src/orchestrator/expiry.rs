//! The expiry thread: once a second, sandboxes past `endAt` are stopped. `autoPause:
//! false` deletes; until pause exists, `autoPause: true` also deletes (docs/api.md says so).

use super::{delete, SandboxState, Shared};
use crate::hooks::StopReason;
use std::sync::Weak;
use std::time::{Duration, SystemTime};

const CHECK_INTERVAL: Duration = Duration::from_secs(1);

pub(crate) fn spawn(shared: Weak<Shared>) {
    std::thread::Builder::new()
        .name("expiry".into())
        .spawn(move || loop {
            std::thread::sleep(CHECK_INTERVAL);
            let Some(shared) = shared.upgrade() else {
                return;
            };
            for id in expired(&shared, SystemTime::now()) {
                let shared = shared.clone();
                // Each expiry runs on its own thread so a slow teardown never delays
                // another sandbox's expiry.
                std::thread::spawn(move || {
                    if delete(&shared, &id, StopReason::TimeoutKill).is_ok() {
                        log::info!("sandboxId={id} op=expire result=deleted");
                    }
                });
            }
        })
        .expect("spawn expiry thread");
}

fn expired(shared: &Shared, now: SystemTime) -> Vec<String> {
    shared
        .sandboxes
        .read()
        .values()
        .filter_map(|e| {
            let info = e.info.lock();
            (info.state == SandboxState::Running && info.end_at <= now).then(|| info.id.clone())
        })
        .collect()
}
