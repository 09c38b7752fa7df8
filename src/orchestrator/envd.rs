//! What the envd proxy (api/envd_proxy.rs) may know about a sandbox: what opens its ports
//! (its access tokens and ingress settings), whether a VM runs it and where the guest
//! listens, and the environment every process in it starts with. Deleted sandboxes leave
//! their access behind for a while, so that a client holding a token learns "was not
//! found" (E2B's answer for a sandbox that is gone) while a client without one learns
//! nothing.
//!
//! And the guest's `/init` ([`init_guest`]): envd's environment for a VM instance, sent
//! once per instance before the first call through the proxy or the console's terminal,
//! on the caller's thread; the entry remembers which instance got it.

use super::registry::Registry;
use super::sandbox::{SandboxEntry, SandboxInfo, SandboxState};
use super::settings::Ingress;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

/// How many deleted sandboxes keep their token (memory only; a restart forgets them).
const GONE_CAPACITY: usize = 4096;
/// How long `/init` may take.
const INIT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// `POST /init` with the sandbox's env to its guest at `addr`, once per VM instance. A
/// guest that has no `/init` (404) is not asked again; one that failed (logged) is asked
/// on the next call. A sandbox gone meanwhile is not asked.
pub(crate) fn init_guest(registry: &Registry, id: &str, target: &EnvdTarget, addr: SocketAddr) {
    let Ok(entry) = registry.entry(id) else {
        return;
    };
    if entry.guest_initialized(target.instance) {
        return;
    }
    let env: serde_json::Map<String, serde_json::Value> = target
        .env
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    let body = serde_json::json!({ "envVars": env }).to_string();
    let result = crate::envd::call(
        addr,
        "POST",
        "/init",
        "application/json",
        body.as_bytes(),
        INIT_TIMEOUT,
    );
    match result {
        Ok((status, _)) if (200..300).contains(&status) || status == 404 => {
            entry.set_guest_initialized(target.instance);
        }
        Ok((status, body)) => log::warn!(
            "sandboxId={id} op=envd_init status={status} body={:?}",
            String::from_utf8_lossy(&body)
        ),
        Err(e) => log::warn!("sandboxId={id} op=envd_init error=\"{e}\""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A guest that answers `/init` with `statuses`, one per request, and reports each
    /// request's path and body.
    fn guest(statuses: Vec<u16>) -> (SocketAddr, crossbeam_channel::Receiver<(String, String)>) {
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for status in statuses {
                let mut request = server.recv().unwrap();
                let mut body = String::new();
                std::io::Read::read_to_string(request.as_reader(), &mut body).unwrap();
                tx.send((request.url().to_string(), body)).unwrap();
                let _ = request.respond(tiny_http::Response::empty(status));
            }
        });
        (addr, rx)
    }

    #[test]
    fn init_goes_once_per_instance_and_again_after_a_failure() {
        let registry = Registry::new("/nowhere".into(), HashMap::new());
        let info = super::super::fakes::info("s1", SandboxState::Running);
        registry.insert(Arc::new(SandboxEntry::new(info.clone(), None)));
        let entry = registry.entry("s1").unwrap();
        let (addr, asked) = guest(vec![500, 200, 404]);
        let target = |instance| EnvdTarget {
            access: Access::of(&info),
            host_ip: Ipv4Addr::LOCALHOST,
            instance,
            env: vec![("A".into(), "1".into())],
        };
        init_guest(&registry, "s1", &target(7), addr);
        assert!(!entry.guest_initialized(7), "a 500 is asked again");
        init_guest(&registry, "s1", &target(7), addr);
        assert!(entry.guest_initialized(7));
        init_guest(&registry, "s1", &target(7), addr);
        init_guest(&registry, "unknown", &target(9), addr);
        init_guest(&registry, "s1", &target(8), addr);
        assert!(
            entry.guest_initialized(8),
            "a guest without /init (404) is not asked again"
        );
        assert!(!entry.guest_initialized(7));
        let requests: Vec<_> = asked.iter().collect();
        assert_eq!(requests.len(), 3, "{requests:?}");
        for (path, body) in requests {
            assert_eq!(path, "/init");
            assert_eq!(body, r#"{"envVars":{"A":"1"}}"#);
        }
    }

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
