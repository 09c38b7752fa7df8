//! What the envd proxy (api/envd_proxy.rs) may know about a sandbox: its access token,
//! whether a VM runs it and where the guest listens, and the environment every process
//! in it starts with. Deleted sandboxes leave their token behind for a while, so that a
//! client holding it learns "was not found" (E2B's answer for a sandbox that is gone)
//! while a client without it learns nothing.

use super::registry::Registry;
use super::sandbox::{SandboxEntry, SandboxState};
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;

/// How many deleted sandboxes keep their token (memory only; a restart forgets them).
const GONE_CAPACITY: usize = 4096;

/// A sandbox as the envd proxy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvdRoute {
    /// A VM runs it.
    Running(EnvdTarget),
    /// Paused, between states, or deleted: its token still identifies it.
    NotRunning { token: String },
    /// Never seen, or deleted long ago.
    Unknown,
}

/// Where a running sandbox's guest listens, and what its processes start with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdTarget {
    pub token: String,
    pub host_ip: Ipv4Addr,
    /// The VM instance ([`super::sandbox::RuntimeHandle::instance`]); a new one needs `/init`.
    pub instance: u64,
    /// Image env, then the create's `envVars` (later wins), `PATH` defaulted.
    pub env: Vec<(String, String)>,
}

/// Tokens of recently deleted sandboxes, oldest dropped first.
#[derive(Default)]
pub(crate) struct GoneTokens {
    inner: Mutex<(HashMap<String, String>, VecDeque<String>)>,
}

impl GoneTokens {
    pub fn remember(&self, id: &str, token: &str) {
        let mut guard = self.inner.lock();
        let (map, order) = &mut *guard;
        if map.insert(id.to_string(), token.to_string()).is_none() {
            order.push_back(id.to_string());
        }
        while order.len() > GONE_CAPACITY {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    pub fn token(&self, id: &str) -> Option<String> {
        self.inner.lock().0.get(id).cloned()
    }
}

/// The route of `id` now.
pub(crate) fn route(registry: &Registry, id: &str) -> EnvdRoute {
    let Ok(entry) = registry.entry(id) else {
        return match registry.gone_token(id) {
            Some(token) => EnvdRoute::NotRunning { token },
            None => EnvdRoute::Unknown,
        };
    };
    route_of(&entry)
}

fn route_of(entry: &SandboxEntry) -> EnvdRoute {
    let info = entry.info.lock().clone();
    let instance = entry.runtime.lock().as_ref().map(|rt| rt.instance);
    let serving = matches!(
        info.state,
        SandboxState::Running | SandboxState::Snapshotting | SandboxState::Forking
    );
    match instance {
        Some(instance) if serving => EnvdRoute::Running(EnvdTarget {
            token: info.envd_access_token,
            host_ip: info.host_ip,
            instance,
            env: super::merged_env(
                &info.settings.image_env,
                &info.settings.env_vars,
                &Default::default(),
            ),
        }),
        _ => EnvdRoute::NotRunning {
            token: info.envd_access_token,
        },
    }
}

/// Whether `instance` still runs `id` (a long stream checks this while the guest is quiet).
pub(crate) fn instance_alive(registry: &Registry, id: &str, instance: u64) -> bool {
    matches!(route(registry, id), EnvdRoute::Running(t) if t.instance == instance)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_tokens_are_bounded_oldest_first() {
        let gone = GoneTokens::default();
        for i in 0..GONE_CAPACITY + 2 {
            gone.remember(&format!("id{i}"), &format!("t{i}"));
        }
        assert_eq!(gone.token("id0"), None);
        assert_eq!(gone.token("id1"), None);
        assert_eq!(gone.token("id2").as_deref(), Some("t2"));
        let last = GONE_CAPACITY + 1;
        assert_eq!(gone.token(&format!("id{last}")), Some(format!("t{last}")));
        gone.remember("id2", "again");
        assert_eq!(gone.inner.lock().1.len(), GONE_CAPACITY);
    }
}
