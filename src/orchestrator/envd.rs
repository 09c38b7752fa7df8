//! What the envd proxy (api/envd_proxy.rs) may know about a sandbox: what opens its ports
//! (its access tokens and ingress settings), whether a VM runs it and where the guest
//! listens, and the environment every process in it starts with. Deleted sandboxes leave
//! their access behind for a while, so that a client holding a token learns "was not
//! found" (E2B's answer for a sandbox that is gone) while a client without one learns
//! nothing.

use super::registry::Registry;
use super::sandbox::{SandboxEntry, SandboxInfo, SandboxState};
use super::settings::Ingress;
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
    /// Its VM is paused on a full state disk (operations.md §10.3): calls answer 507 with
    /// `message` until it runs again.
    PausedOnIoError { target: EnvdTarget, message: String },
    /// Paused, between states, or deleted: its tokens still identify it.
    NotRunning { access: Access },
    /// Never seen, or deleted long ago.
    Unknown,
}

/// What opens a sandbox's ports through the proxy (docs/e2b.md, "Public ports").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// `envdAccessToken`: opens every port (empty in records from before it).
    pub envd_token: String,
    /// `trafficAccessToken`: opens the ports other than envd's of a non-public sandbox.
    pub traffic_token: String,
    pub ingress: Ingress,
}

impl Access {
    pub(crate) fn of(info: &SandboxInfo) -> Access {
        Access {
            envd_token: info.envd_access_token.clone(),
            traffic_token: info.traffic_access_token.clone(),
            ingress: info.settings.ingress.clone(),
        }
    }
}

/// Where a running sandbox's guest listens, and what its processes start with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdTarget {
    pub access: Access,
    pub host_ip: Ipv4Addr,
    /// The VM instance ([`super::sandbox::RuntimeHandle::instance`]); a new one needs `/init`.
    pub instance: u64,
    /// Image env, then the create's `envVars` (later wins), `PATH` defaulted.
    pub env: Vec<(String, String)>,
}

/// A bounded memory of recently deleted sandboxes (their access, or how they died),
/// oldest dropped first.
pub(crate) struct Recent<T> {
    inner: Mutex<(HashMap<String, T>, VecDeque<String>)>,
}

impl<T> Default for Recent<T> {
    fn default() -> Recent<T> {
        Recent {
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }
}

impl<T: Clone> Recent<T> {
    pub fn remember(&self, id: &str, value: T) {
        let mut guard = self.inner.lock();
        let (map, order) = &mut *guard;
        if map.insert(id.to_string(), value).is_none() {
            order.push_back(id.to_string());
        }
        while order.len() > GONE_CAPACITY {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<T> {
        self.inner.lock().0.get(id).cloned()
    }
}

/// The route of `id` now.
pub(crate) fn route(registry: &Registry, id: &str) -> EnvdRoute {
    let Ok(entry) = registry.entry(id) else {
        return match registry.gone_access(id) {
            Some(access) => EnvdRoute::NotRunning { access },
            None => EnvdRoute::Unknown,
        };
    };
    route_of(&entry)
}

fn route_of(entry: &SandboxEntry) -> EnvdRoute {
    let info = entry.info();
    let instance = entry.runtime().map(|rt| rt.instance);
    let serving = matches!(
        info.state(),
        SandboxState::Running | SandboxState::Snapshotting | SandboxState::Forking
    );
    let Some(instance) = instance.filter(|_| serving) else {
        return EnvdRoute::NotRunning {
            access: Access::of(&info),
        };
    };
    let target = EnvdTarget {
        access: Access::of(&info),
        host_ip: info.host_ip,
        instance,
        env: super::merged_env(
            &info.settings.image_env,
            &info.settings.env_vars,
            &Default::default(),
        ),
    };
    match info.paused_on_io_error {
        Some(pause) => EnvdRoute::PausedOnIoError {
            target,
            message: pause.message,
        },
        None => EnvdRoute::Running(target),
    }
}

/// Whether `instance` still runs `id` (a long stream checks this while the guest is
/// quiet; one paused on a full state disk runs on once space is back).
pub(crate) fn instance_alive(registry: &Registry, id: &str, instance: u64) -> bool {
    matches!(
        route(registry, id),
        EnvdRoute::Running(t) | EnvdRoute::PausedOnIoError { target: t, .. } if t.instance == instance
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gone_tokens_are_bounded_oldest_first() {
        let gone = Recent::default();
        let token = |id: &str| gone.get(id);
        for i in 0..GONE_CAPACITY + 2 {
            gone.remember(&format!("id{i}"), format!("t{i}"));
        }
        assert_eq!(token("id0"), None);
        assert_eq!(token("id1"), None);
        assert_eq!(token("id2").as_deref(), Some("t2"));
        let last = GONE_CAPACITY + 1;
        assert_eq!(token(&format!("id{last}")), Some(format!("t{last}")));
        gone.remember("id2", "again".to_string());
        assert_eq!(gone.inner.lock().1.len(), GONE_CAPACITY);
    }
}
