//! Forwarding: a request for another node's sandbox is relayed to that node
//! (docs/cluster.md, "Forwarding").
//!
//! Which sandbox a request is for follows from the request alone ([`target_of`]): an
//! envd request's `E2b-Sandbox-Id` or `<port>-<id>.<domain>` host (`envd_proxy`), else
//! the id in `/sandboxes/{id}…`, `/v2/sandboxes/{id}…` or `/console/terminal/{id}`. The
//! id names its node (`cluster::id`); when that is another node, the dispatcher hands
//! the request here and a `cluster-forward` thread relays it to the node's URL from the
//! peer table: same method, target, `Host`, headers (credentials included) and body,
//! with `X-Aenv-Forwarded-By: <this node>` added; the answer streams back as it comes,
//! and an upgrade (WebSocket) becomes a byte tunnel. A request that already carries
//! `X-Aenv-Forwarded-By` is never forwarded again ([`decide`]): loops are impossible.
//! Bounds: at most [`MAX_FORWARDS`] relays at once (503 beyond), a connect within 5 s,
//! every write within 30 s, the answer head ≤ 16 KiB, quiet waits as the envd proxy's
//! (at least [`API_IDLE`]), tunnels by `[api] tunnel_idle_secs`; bodies stream through
//! fixed buffers and are never held.

use super::envd_proxy::{self, answer_error, header};
use super::signed_url::{self, Refusal, SignedUrl};
use super::ApiError;
use crate::cluster::{Cluster, ForwardResult};
use crate::envd::{self, EnvdError, Framing, Outgoing, Patience};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tiny_http::Request;

pub use crate::cluster::FORWARDED_BY;
/// Relays in flight at once.
pub const MAX_FORWARDS: usize = 512;
/// The largest answer to a signer question (`{"sandboxID": "..."}`).
const SIGNER_ANSWER_MAX: u64 = 4096;
/// Quiet time allowed on a forwarded API request: a command may run 600 s before its
/// answer (api.md §4.17).
pub const API_IDLE: Duration = Duration::from_secs(900);

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Not for another node's sandbox: served here.
    Local,
    /// For a sandbox of this node (another one): relayed there.
    Forward(String),
    /// For another node's sandbox, but already forwarded once (by the node named):
    /// answered here with an error.
    Refuse { owner: String, by: String },
}

/// Where a request for `sandbox` goes, on node `this` (`None`: a single node), given
/// the `X-Aenv-Forwarded-By` it carries.
pub fn decide(this: Option<&str>, sandbox: Option<&str>, forwarded_by: Option<&str>) -> Decision {
    let owner = sandbox.and_then(crate::cluster::id::node_of);
    match (this, owner) {
        (Some(this), Some(owner)) if owner != this => match forwarded_by {
            None => Decision::Forward(owner.to_string()),
            Some(by) => Decision::Refuse {
                owner: owner.to_string(),
                by: by.to_string(),
            },
        },
        _ => Decision::Local,
    }
}

/// The sandbox an API path is for: `/sandboxes/{id}…`, `/v2/sandboxes/{id}…`,
/// `/console/terminal/{id}` (ids only: `/sandboxes/metrics` is none).
pub fn sandbox_of_path(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/sandboxes/")
        .or_else(|| path.strip_prefix("/v2/sandboxes/"))
        .or_else(|| path.strip_prefix("/console/terminal/"))?;
    let id = rest.split('/').next()?;
    crate::cluster::id::is_sandbox_id(id).then_some(id)
}

/// The sandbox `request` is for, from its headers (envd) or its path.
fn target_of(request: &Request) -> Option<String> {
    if let Some(dest) = envd_proxy::sandbox_of(request) {
        return Some(dest);
    }
    let path = request.url().split('?').next().unwrap_or("");
    sandbox_of_path(path).map(str::to_string)
}

/// Relays requests for other nodes' sandboxes.
pub struct Forwarder {
    cluster: Option<Arc<Cluster>>,
    tunnel_idle: Duration,
    threads: AtomicUsize,
}

impl Forwarder {
    pub fn new(cluster: Option<Arc<Cluster>>, tunnel_idle: Duration) -> Forwarder {
        Forwarder {
            cluster,
            tunnel_idle,
            threads: AtomicUsize::new(0),
        }
    }

    /// A signed file URL naming no sandbox (setup 1) that no sandbox of this node signed:
    /// asks every peer which of its sandboxes did (`GET /cluster/signer`, all at once,
    /// each within the peer timeout) and relays the request to that node on this thread;
    /// 401 when none did, or when it was forwarded to this node already. Runs on an envd
    /// stream thread, never an API worker.
    pub fn relay_signed(&self, request: Request, signed: &SignedUrl) {
        let mismatch = || envd_proxy::refused(Refusal::Mismatch);
        let Some(cluster) = self
            .cluster
            .as_ref()
            .filter(|_| header(&request, FORWARDED_BY).is_none())
        else {
            return answer_error(request, &mismatch());
        };
        let question = signed_url::signer_question(&request, signed);
        let signer = cluster
            .ask_peers(&question, SIGNER_ANSWER_MAX)
            .into_iter()
            .find_map(|(node, answer)| {
                let id = answer.ok()?.body["sandboxID"].as_str()?.to_string();
                // Only the node that owns the id may claim it.
                (crate::cluster::id::node_of(&id) == Some(node.as_str())).then_some((node, id))
            });
        match signer {
            Some((owner, id)) => self.relay(cluster, &owner, &id, request),
            None => answer_error(request, &mismatch()),
        }
    }

    fn decision(&self, request: &Request) -> Decision {
        let Some(cluster) = &self.cluster else {
            return Decision::Local;
        };
        decide(
            Some(&cluster.node),
            target_of(request).as_deref(),
            header(request, FORWARDED_BY),
        )
    }

    /// Whether `request` is for another node's sandbox (headers and path only).
    pub fn wants(&self, request: &Request) -> bool {
        self.decision(request) != Decision::Local
    }

    /// Takes `request` when it is for another node's sandbox: relays it on a thread of
    /// its own (at most [`MAX_FORWARDS`]) or refuses a forwarded one; gives any other
    /// request back.
    pub fn divert(self: &Arc<Self>, request: Request) -> Option<Request> {
        let (owner, cluster) = match (self.decision(&request), &self.cluster) {
            (Decision::Forward(owner), Some(cluster)) => (owner, cluster.clone()),
            (Decision::Refuse { owner, by }, Some(cluster)) => {
                cluster.forwarded.record(&owner, ForwardResult::Refused);
                let id = target_of(&request).unwrap_or_default();
                answer_error(request, &refusal(&id, &owner, &cluster.node, &by));
                return None;
            }
            _ => return Some(request),
        };
        if self.threads.fetch_add(1, Ordering::AcqRel) >= MAX_FORWARDS {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            let e = ApiError::new(
                503,
                "too many requests forwarded to other nodes at once; retry shortly",
            );
            answer_error(request, &e);
            return None;
        }
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("cluster-forward".into())
            .spawn(move || {
                let id = target_of(&request).unwrap_or_default();
                me.relay(&cluster, &owner, &id, request);
                me.threads.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            log::error!("op=forward error=\"cannot spawn a forward thread: {e}\"");
        }
        None
    }

    /// On the forward thread: the request to `owner` and its answer back; counted.
    fn relay(&self, cluster: &Cluster, owner: &str, id: &str, request: Request) {
        let started = std::time::Instant::now();
        let method = request.method().to_string();
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let hop = Hop {
            this: &cluster.node,
            owner,
            sandbox: id,
            tunnel_idle: self.tunnel_idle,
        };
        let result = match hop.run(cluster, request) {
            Ok(status) => {
                log::debug!(
                    "sandboxId={id} op=forward node={owner} method={method} path={path} status={status} ms={}",
                    started.elapsed().as_millis()
                );
                ForwardResult::Answered
            }
            Err(Failure::Before(why)) => {
                log::warn!("sandboxId={id} op=forward node={owner} method={method} path={path} error=\"{why}\"");
                ForwardResult::Unreachable
            }
            Err(Failure::During(why)) => {
                log::info!("sandboxId={id} op=forward node={owner} method={method} path={path} error=\"{why}\"");
                ForwardResult::Answered
            }
        };
        cluster.forwarded.record(owner, result);
    }
}

/// How a relay failed: before the owner answered (the client got a 502 naming it), or
/// while its answer streamed.
enum Failure {
    Before(String),
    During(String),
}

/// One request's way to the node that owns its sandbox.
struct Hop<'a> {
    this: &'a str,
    owner: &'a str,
    sandbox: &'a str,
    tunnel_idle: Duration,
}

impl Hop<'_> {
    /// Sends `request` to the owner and its answer back (or tunnels an upgrade); the
    /// answer's status.
    fn run(&self, cluster: &Cluster, mut request: Request) -> Result<u16, Failure> {
        let addr = match cluster.peers.get(self.owner) {
            None => Err(
                "it is not among the peers this node found ([cluster] peers or peers_dns)"
                    .to_string(),
            ),
            Some(peer) => peer
                .url
                .resolve()
                .map_err(|e| format!("cannot resolve {}: {e}", peer.url))
                .map(|a| (a, peer.url)),
        };
        let (addr, url) = match addr {
            Ok(a) => a,
            Err(why) => return Err(self.unreachable(request, why)),
        };
        let upgrade = match envd_proxy::upgrade_of(&request) {
            Ok(u) => u,
            Err(e) => {
                answer_error(request, &e);
                return Ok(400);
            }
        };
        let idle = envd_proxy::idle_limit(&request).max(API_IDLE);
        request.set_body_timeout(Some(idle));
        let patience = Patience {
            idle,
            alive: Arc::new(|| true),
        };
        let mut headers = forwarded_headers(&request);
        headers.push((FORWARDED_BY.to_string(), self.this.to_string()));
        let host = header(&request, "Host")
            .map(str::to_string)
            .unwrap_or_else(|| url.authority());
        let target = request.url().to_string();
        let method = request.method().to_string();
        let outgoing = Outgoing {
            method: &method,
            target: &target,
            host: &host,
            headers: &headers,
            body: match upgrade {
                Some(_) => Framing::None,
                None => envd_proxy::body_framing(&request),
            },
            upgrade: upgrade.as_deref(),
        };
        let mut conn = match envd::Connection::open(addr, patience.clone()) {
            Ok(c) => c,
            Err(e) => return Err(self.unreachable(request, cause(&e, &url))),
        };
        let sent = conn.send(&outgoing, request.as_reader());
        let answer = match sent.and_then(|_| conn.answer(upgrade.is_some())) {
            Ok(a) => a,
            Err(e) => return Err(self.unreachable(request, cause(&e, &url))),
        };
        match (upgrade, answer.upgraded) {
            (Some(protocol), Some(owner)) => {
                self.tunnel(request, &protocol, &answer.headers, owner, patience)?;
                Ok(101)
            }
            (_, upgraded) => {
                let answer = envd::Answer { upgraded, ..answer };
                envd_proxy::relay_answer(request, answer)
                    .map_err(|e| Failure::During(cause(&e, &url)))
            }
        }
    }

    /// Answers the 502 that names the owner, and says why.
    fn unreachable(&self, request: Request, why: String) -> Failure {
        let message = format!(
            "sandbox {} lives on node {}, which does not answer: {why}",
            self.sandbox, self.owner
        );
        answer_error(request, &ApiError::new(502, message));
        Failure::Before(why)
    }

    /// Answers `101` with the owner's headers, then relays bytes both ways until either
    /// side closes or both stay quiet for the tunnel's idle limit.
    fn tunnel(
        &self,
        request: Request,
        protocol: &str,
        headers: &[(String, String)],
        owner: envd::Upgraded,
        patience: Patience,
    ) -> Result<(), Failure> {
        let patience = Patience {
            idle: self.tunnel_idle,
            ..patience
        };
        let totals = envd_proxy::tunnel_upgrade(request, protocol, headers, owner, patience)
            .map_err(|e| Failure::During(e.to_string()))?;
        log::info!(
            "sandboxId={} op=forward_tunnel node={} protocol={protocol} toOwner={} toClient={} end={:?}",
            self.sandbox,
            self.owner,
            totals.to_guest,
            totals.to_client,
            totals.end
        );
        Ok(())
    }
}

/// The request's headers the owner gets: all but hop-by-hop ones (credentials
/// included: the owner checks them) and any `X-Aenv-Forwarded-By`, which the forwarder
/// sets.
fn forwarded_headers(request: &Request) -> Vec<(String, String)> {
    envd_proxy::headers_without(request, &[FORWARDED_BY])
}

/// What went wrong with the owner at `url`, in words about the node (not a guest).
fn cause(e: &EnvdError, url: &crate::cluster::peer::PeerUrl) -> String {
    match e {
        EnvdError::Connect(e) => format!("cannot connect to {url}: {e}"),
        EnvdError::Io(e) => format!("the connection to {url} failed: {e}"),
        EnvdError::BadAnswer(m) => format!("{url} answered badly: {m}"),
        EnvdError::Timeout => format!("{url} did not answer in time"),
        EnvdError::Stopped => format!("{url} went away"),
    }
}

/// The answer to a request for another node's sandbox that was forwarded here already.
fn refusal(id: &str, owner: &str, this: &str, by: &str) -> ApiError {
    ApiError::new(
        404,
        format!(
            "sandbox {id} lives on node {owner}, not on this node {this}; the request was forwarded here by {by} and is not forwarded again (do the nodes' peers agree on where {owner} is?)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiny_http::Header;

    const UUID: &str = "01900000-0000-7000-8000-000000000000";

    #[test]
    fn requests_for_other_nodes_are_forwarded_once() {
        let theirs = format!("{UUID}-n2");
        let ours = format!("{UUID}-n1");
        let d = |this, id: &str, by| decide(this, Some(id), by);
        assert_eq!(d(Some("n1"), &theirs, None), Decision::Forward("n2".into()));
        assert_eq!(d(Some("n1"), &ours, None), Decision::Local);
        assert_eq!(
            d(Some("n1"), UUID, None),
            Decision::Local,
            "a single node's id"
        );
        assert_eq!(d(None, &theirs, None), Decision::Local, "a single node");
        assert_eq!(decide(Some("n1"), None, None), Decision::Local);
        // Already forwarded: never again, whoever says so.
        assert_eq!(
            d(Some("n1"), &theirs, Some("n3")),
            Decision::Refuse {
                owner: "n2".into(),
                by: "n3".into()
            }
        );
        assert_eq!(d(Some("n1"), &ours, Some("n3")), Decision::Local);
        assert_eq!(d(Some("n1"), "not-an-id-n2", None), Decision::Local);
    }

    #[test]
    fn the_sandbox_of_a_path() {
        let id = format!("{UUID}-n2");
        for path in [
            format!("/sandboxes/{id}"),
            format!("/sandboxes/{id}/commands"),
            format!("/sandboxes/{id}/files"),
            format!("/v2/sandboxes/{id}/logs"),
            format!("/v2/sandboxes/{id}/connect"),
            format!("/console/terminal/{id}"),
        ] {
            assert_eq!(sandbox_of_path(&path), Some(id.as_str()), "{path}");
        }
        for path in [
            "/sandboxes",
            "/sandboxes/metrics",
            "/v2/sandboxes",
            "/templates/x",
            "/snapshots/x",
            "/health",
        ] {
            assert_eq!(sandbox_of_path(path), None, "{path}");
        }
    }

    #[test]
    fn the_forwarded_headers_keep_credentials_and_drop_hops() {
        let request: Request = tiny_http::TestRequest::new()
            .with_header(Header::from_bytes("X-API-Key", "k").unwrap())
            .with_header(Header::from_bytes("X-Access-Token", "t").unwrap())
            .with_header(Header::from_bytes("Connection", "keep-alive").unwrap())
            .with_header(Header::from_bytes(FORWARDED_BY, "n9").unwrap())
            .into();
        let names: Vec<String> = forwarded_headers(&request)
            .into_iter()
            .map(|(k, _)| k.to_ascii_lowercase())
            .collect();
        assert!(names.contains(&"x-api-key".to_string()), "{names:?}");
        assert!(names.contains(&"x-access-token".to_string()), "{names:?}");
        assert!(!names.contains(&"connection".to_string()), "{names:?}");
        assert!(
            !names.iter().any(|n| n == "x-aenv-forwarded-by"),
            "{names:?}"
        );
    }
}
