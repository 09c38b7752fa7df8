//! The expiry thread: once a second, running sandboxes past `endAt` are stopped:
//! `autoPause: true` pauses (stop reason `timeout-pause`), `false` deletes
//! (`timeout-kill`). Paused sandboxes never expire.

use super::operations::pause;
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
            for (id, auto_pause) in expired(&shared, SystemTime::now()) {
                let shared = shared.clone();
                // Each expiry runs on its own thread so a slow teardown never delays
                // another sandbox's expiry.
                std::thread::spawn(move || {
                    let result = if auto_pause {
                        pause(&shared, &id, StopReason::TimeoutPause).map(|()| "paused")
                    } else {
                        delete(&shared, &id, StopReason::TimeoutKill).map(|()| "deleted")
                    };
                    match result {
                        Ok(what) => log::info!("sandboxId={id} op=expire result={what}"),
                        Err(e) => log::warn!("sandboxId={id} op=expire error=\"{e}\""),
                    }
                });
            }
        })
        .expect("spawn expiry thread");
}

fn expired(shared: &Shared, now: SystemTime) -> Vec<(String, bool)> {
    shared
        .sandboxes
        .read()
        .values()
        .filter_map(|e| {
            let info = e.info.lock();
            (info.state == SandboxState::Running && info.end_at <= now)
                .then(|| (info.id.clone(), info.auto_pause))
        })
        .collect()
}
