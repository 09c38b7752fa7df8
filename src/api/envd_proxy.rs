//! The envd proxy: E2B's sandbox URL and public ports served on the API port
//! (docs/e2b.md).
//!
//! The E2B SDKs talk to envd, the daemon inside an E2B sandbox, at one base URL for every
//! sandbox (`E2B_SANDBOX_URL`) with an `E2b-Sandbox-Id` header, or at
//! `https://<port>-<sandboxID>.<E2B_DOMAIN>` behind a wildcard TLS proxy. Requests of
//! either shape ([`is_envd`], from the headers alone) are taken off the API workers and
//! answered by [`EnvdProxy::serve`] on a stream thread of their own: forwarded to the
//! guest agent, which serves envd's surface at
//! `<hostInteractionIp>:<port>`. Streams (Connect server streams, uploads, watches) can
//! last as long as a command runs; they never hold an API worker. Threads are bounded in
//! total and per sandbox (429 beyond).
//!
//! Credentials ([`admitted`]): the API key (in `X-API-Key` or `X-Access-Token`) opens
//! every port; envd's port needs `X-Access-Token` equal to the sandbox's
//! `envdAccessToken`; other ports are open (E2B's `allowPublicTraffic`, default true)
//! unless the sandbox was created with `network.allowPublicTraffic: false`, then they
//! need `e2b-traffic-access-token` equal to its `trafficAccessToken` (or the envd token).
//! Anything else is 401 whether or not the sandbox exists. With a credential, a sandbox
//! that is paused or gone is 502 "... was not found", which the SDKs read as "not
//! running"; a running one whose guest does not answer on the port is 502 "... port is
//! not open". Credentials and hop-by-hop headers never reach the guest; envd's port gets
//! `Host: envd`, other ports the client's `Host` or the sandbox's `maskRequestHost`.
//!
//! A signed file URL (`GET`/`POST /files?…&signature=…`, `api::signed_url`) opens
//! envd's `/files` with no header; without a sandbox in its headers (setup 1's
//! `E2B_SANDBOX_URL`) it goes to the sandbox whose token signed it. A changed one is 401,
//! an expired one 403.
//!
//! An HTTP/1.1 upgrade (WebSocket) goes to the guest as such; a `101` turns the
//! connection into a byte tunnel (`envd::tunnel`), bounded by `[api] tunnel_idle_secs`.
//!
//! The first request to a sandbox's envd port after its VM started (create, resume,
//! clone) is preceded by `POST /init` with the sandbox's environment (image env and the
//! create's `envVars`), so that every process envd starts sees it.

use super::signed_url::{signer, Refusal, SignedUrl};
use super::ApiError;
use crate::cluster::id::is_sandbox_id;
use crate::envd::{self, EnvdError, Framing, Outgoing, Patience};
use crate::orchestrator::{Access, EnvdRoute, EnvdTarget, OrchError, Orchestrator};
use crate::util::constant_time_eq;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tiny_http::{Header, Request, Response, StatusCode};

/// Proxied exchanges in flight at once, over all sandboxes.
const MAX_STREAMS: usize = 512;
/// Proxied exchanges in flight at once for one sandbox.
const MAX_STREAMS_PER_SANDBOX: usize = 64;
/// Slack over a request's own `Connect-Timeout-Ms` before the proxy gives up on a quiet
/// guest.
const DEADLINE_SLACK: Duration = Duration::from_secs(30);
/// Quiet time allowed on a request without a deadline: a stream (a command without a
/// timeout, a watch) may wait a long time for its next event; a unary call may not.
const STREAM_IDLE: Duration = Duration::from_secs(24 * 3600);
const UNARY_IDLE: Duration = Duration::from_secs(300);
/// Request headers the guest never sees.
const WITHHELD: [&str; 5] = [
    "x-api-key",
    "x-access-token",
    "e2b-traffic-access-token",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
];
/// How often a tunnel's client side wakes to look at the other side and the sandbox.
const TUNNEL_POLL: Duration = Duration::from_secs(2);

/// Where an envd request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Destination {
    sandbox: String,
    port: u16,
}

pub struct EnvdProxy {
    orchestrator: Arc<Orchestrator>,
    api_key: String,
    agent_port: u16,
    /// How long an upgraded connection (WebSocket) may stay quiet both ways.
    tunnel_idle: Duration,
    /// A cluster node's forwarder: signed file URLs another node's sandbox signed.
    forward: Option<Arc<super::forward::Forwarder>>,
    /// Stream threads running (see [`EnvdProxy::divert`]).
    threads: AtomicUsize,
    /// Open exchanges per sandbox.
    open: Mutex<HashMap<String, usize>>,
}

/// One open exchange of a sandbox; gives its place back on drop.
struct StreamPermit {
    proxy: Arc<EnvdProxy>,
    sandbox: String,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut open = self.proxy.open.lock();
        if let Some(n) = open.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.sandbox);
            }
        }
    }
}

impl EnvdProxy {
    /// `forward`: asked for a signed file URL no sandbox of this node signed (a cluster
    /// node's).
    pub fn new(
        orchestrator: Arc<Orchestrator>,
        api_key: String,
        forward: Option<Arc<super::forward::Forwarder>>,
    ) -> EnvdProxy {
        let agent_port = orchestrator.config().agent.port;
        let tunnel_idle = Duration::from_secs(orchestrator.config().api.tunnel_idle_secs);
        EnvdProxy {
            orchestrator,
            api_key,
            forward,
            agent_port,
            tunnel_idle,
            threads: AtomicUsize::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `request` is for a sandbox's envd (headers only; nothing is looked up).
    pub fn wants(&self, request: &Request) -> bool {
        is_envd(request)
    }

    /// Takes `request` when it is for a sandbox's envd and answers it on a thread of its
    /// own (at most [`MAX_STREAMS`]); gives any other request back to the API.
    pub fn divert(self: &Arc<Self>, request: Request) -> Option<Request> {
        if !is_envd(&request) {
            return Some(request);
        }
        if self.threads.fetch_add(1, Ordering::AcqRel) >= MAX_STREAMS {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            let e = ApiError::new(503, "too many envd streams open; retry when one ends");
            answer_error(request, &e);
            return None;
        }
        let proxy = self.clone();
        let spawned = std::thread::Builder::new()
            .name("envd-stream".into())
            .spawn(move || {
                proxy.serve(request);
                proxy.threads.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            self.threads.fetch_sub(1, Ordering::AcqRel);
            // The request went with the closure; its client sees the connection close.
            log::error!("op=envd_proxy error=\"cannot spawn a stream thread: {e}\"");
        }
        None
    }

    /// Answers one request for a sandbox's port: credentials, route, `/init` when due,
    /// then the exchange with the guest. Blocks for as long as the exchange lasts: run it
    /// on a thread that is no API worker.
    pub fn serve(self: &Arc<Self>, request: Request) {
        let signed = SignedUrl::of(&request);
        let dest = match destination(&request, self.agent_port) {
            Some(dest) => dest,
            // A signed file URL of setup 1 names no sandbox: the one whose token signed it,
            // here or (asked by the forwarder) on another node.
            None => match signed.as_ref().map(|s| (s, signer(&self.orchestrator, s))) {
                Some((_, Some(sandbox))) => Destination {
                    sandbox,
                    port: self.agent_port,
                },
                Some((signed, None)) => match &self.forward {
                    Some(forward) => return forward.relay_signed(request, signed),
                    None => return answer_error(request, &refused(Refusal::Mismatch)),
                },
                None => return answer_error(request, &refused(Refusal::Mismatch)),
            },
        };
        let route = self.orchestrator.envd_route(&dest.sandbox);
        let access = match &route {
            EnvdRoute::Running(t) | EnvdRoute::PausedOnIoError { target: t, .. } => Some(&t.access),
            EnvdRoute::NotRunning { access } => Some(access),
            EnvdRoute::Unknown => None,
        };
        if let Err(e) = self.gate(&request, &dest, access, signed.as_ref()) {
            return answer_error(request, &e);
        }
        // Only admitted traffic wakes a sleeping sandbox (autoResume).
        let route = match route {
            EnvdRoute::NotRunning { .. } => match self.wake(&dest.sandbox) {
                Ok(route) => route,
                Err(e) => return answer_error(request, &ApiError::from(e)),
            },
            other => other,
        };
        let target = match route {
            EnvdRoute::Running(target) => target,
            EnvdRoute::PausedOnIoError { message, .. } => {
                let e =
                    ApiError::from(crate::orchestrator::OrchError::InsufficientStorage(message));
                return answer_error(request, &e);
            }
            EnvdRoute::NotRunning { .. } | EnvdRoute::Unknown => {
                return answer_error(request, &not_found(&dest.sandbox));
            }
        };
        let Some(_permit) = self.permit(&dest.sandbox) else {
            let message = format!(
                "{MAX_STREAMS_PER_SANDBOX} envd requests of sandbox {} are open; retry when one ends",
                dest.sandbox
            );
            return answer_error(request, &ApiError::new(429, message));
        };
        self.forward(request, &dest, &target);
    }

    /// Lets a request in ([`admitted`]), or a signed file URL to envd's port that the
    /// sandbox's token signed and that has not expired.
    /// Where traffic for a paused `sandbox` goes once it is awake (autoResume).
    fn wake(&self, sandbox: &str) -> Result<EnvdRoute, OrchError> {
        let wake = crate::orchestrator::Request::Route { id: sandbox };
        self.orchestrator.handle(wake)?.into_route()
    }

    fn gate(
        &self,
        request: &Request,
        dest: &Destination,
        access: Option<&Access>,
        signed: Option<&SignedUrl>,
    ) -> Result<(), ApiError> {
        let envd_port = dest.port == self.agent_port;
        if admitted(&Credentials::of(request), envd_port, access, &self.api_key) {
            return Ok(());
        }
        match (envd_port, signed, access) {
            (true, Some(signed), Some(access)) => signed
                .check(&access.envd_token, crate::util::unix_secs())
                .map_err(refused),
            _ => Err(unauthorized(envd_port)),
        }
    }

    fn permit(self: &Arc<Self>, sandbox: &str) -> Option<StreamPermit> {
        let mut open = self.open.lock();
        let mine = open.entry(sandbox.to_string()).or_insert(0);
        if *mine >= MAX_STREAMS_PER_SANDBOX {
            return None;
        }
        *mine += 1;
        Some(StreamPermit {
            proxy: self.clone(),
            sandbox: sandbox.to_string(),
        })
    }

    /// On the stream thread: `/init` when due, then the exchange with the guest.
    fn forward(&self, request: Request, dest: &Destination, target: &EnvdTarget) {
        let addr = SocketAddr::V4(SocketAddrV4::new(target.host_ip, dest.port));
        if dest.port == self.agent_port {
            self.orchestrator.init_guest(&dest.sandbox, target, addr);
        }
        let orchestrator = self.orchestrator.clone();
        let (sandbox, instance) = (dest.sandbox.clone(), target.instance);
        let idle = idle_limit(&request);
        // A streamed request body (stdin of a command) may pause as long as the answer.
        request.set_body_timeout(Some(idle));
        let patience = Patience {
            idle,
            alive: Arc::new(move || orchestrator.envd_instance_alive(&sandbox, instance)),
        };
        let started = std::time::Instant::now();
        let method = request.method().to_string();
        let path = request.url().split('?').next().unwrap_or("").to_string();
        let host = if dest.port == self.agent_port {
            "envd".to_string()
        } else {
            let client_host = header(&request, "Host").unwrap_or("localhost");
            target.access.ingress.host_for(dest.port, client_host)
        };
        let exchange = Exchange {
            addr,
            patience,
            dest,
            host: &host,
            tunnel_idle: self.tunnel_idle,
            orchestrator: &self.orchestrator,
        };
        match exchange.run(request) {
            Ok(status) => log::debug!(
                "sandboxId={} op=envd method={method} path={path} status={status} ms={}",
                dest.sandbox,
                started.elapsed().as_millis()
            ),
            Err(e) => log::info!(
                "sandboxId={} op=envd method={method} path={path} error=\"{e}\"",
                dest.sandbox
            ),
        }
    }
}

/// Whether `request` is for a sandbox's envd rather than the API (headers only).
pub fn is_envd(request: &Request) -> bool {
    destination(request, 0).is_some() || SignedUrl::of(request).is_some()
}

/// The sandbox an envd request is for, from its headers (`None`: no envd request, or
/// a signed file URL that names none).
pub(super) fn sandbox_of(request: &Request) -> Option<String> {
    destination(request, 0).map(|d| d.sandbox)
}

/// The sandbox and port of an envd request: the `E2b-Sandbox-Id` header (port from
/// `E2b-Sandbox-Port`, else the agent port), or a `Host` of the form
/// `<port>-<sandboxID>.<domain>`.
fn destination(request: &Request, agent_port: u16) -> Option<Destination> {
    if let Some(id) = header(request, "E2b-Sandbox-Id") {
        let port = header(request, "E2b-Sandbox-Port")
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .unwrap_or(agent_port);
        return Some(Destination {
            sandbox: id.trim().to_string(),
            port,
        });
    }
    host_destination(header(request, "Host")?)
}

fn host_destination(host: &str) -> Option<Destination> {
    let label = host.split('.').next()?;
    let (port, sandbox) = label.split_once('-')?;
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))?;
    let sandbox = sandbox.to_ascii_lowercase();
    // A dot is required: `<port>-<id>` alone is not a sandbox host name.
    (is_sandbox_id(&sandbox) && host.contains('.')).then_some(Destination { sandbox, port })
}

pub(super) fn header<'a>(request: &'a Request, name: &str) -> Option<&'a str> {
    request
        .headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

/// The credentials a request carries.
#[derive(Default)]
struct Credentials<'a> {
    /// `X-API-Key`.
    api_key: Option<&'a str>,
    /// `X-Access-Token`: the API key or the sandbox's `envdAccessToken`.
    access: Option<&'a str>,
    /// `e2b-traffic-access-token`: the sandbox's `trafficAccessToken`.
    traffic: Option<&'a str>,
}

impl<'a> Credentials<'a> {
    fn of(request: &'a Request) -> Credentials<'a> {
        Credentials {
            api_key: header(request, "X-API-Key"),
            access: header(request, "X-Access-Token"),
            traffic: header(request, "e2b-traffic-access-token"),
        }
    }
}

/// Whether a request with `creds` may reach a port of a sandbox with `access` (`None`:
/// unknown): the API key opens every port; the envd port needs the envd token; another
/// port is open when the sandbox is public, else needs the traffic token (or the envd
/// token, which opens more). Secrets are compared in constant time; an empty one opens
/// nothing.
fn admitted(creds: &Credentials, envd_port: bool, access: Option<&Access>, api_key: &str) -> bool {
    let is = |given: Option<&str>, secret: &str| {
        given.is_some_and(|g| {
            !secret.is_empty() && constant_time_eq(g.as_bytes(), secret.as_bytes())
        })
    };
    if is(creds.api_key, api_key) || is(creds.access, api_key) {
        return true;
    }
    let Some(access) = access else {
        return false;
    };
    if is(creds.access, &access.envd_token) {
        return true;
    }
    !envd_port && (access.ingress.public || is(creds.traffic, &access.traffic_token))
}

/// The answer to a signed file URL that does not open the file (nothing of it logged).
pub(super) fn refused(why: Refusal) -> ApiError {
    match why {
        Refusal::Mismatch => ApiError::new(
            401,
            "invalid file URL signature: the URL was changed or not signed with this sandbox's envdAccessToken",
        ),
        Refusal::Expired => ApiError::new(403, "the signed file URL has expired"),
    }
}

fn unauthorized(envd_port: bool) -> ApiError {
    let message = if envd_port {
        "missing or invalid X-Access-Token (the sandbox's envdAccessToken) or X-API-Key"
    } else {
        "missing or invalid e2b-traffic-access-token (the sandbox's trafficAccessToken): this sandbox's ports are not public"
    };
    ApiError::new(401, message)
}

/// The words the E2B SDKs look for to tell a sandbox that is not running.
fn not_found(sandbox: &str) -> ApiError {
    ApiError::new(
        502,
        format!("The sandbox {sandbox} was not found: it is paused, deleted or not running"),
    )
}

/// How long the guest may stay quiet: the request's own Connect deadline plus slack,
/// else long for streams and short for unary calls.
pub(super) fn idle_limit(request: &Request) -> Duration {
    if let Some(ms) = header(request, "Connect-Timeout-Ms").and_then(|v| v.parse::<u64>().ok()) {
        return Duration::from_millis(ms) + DEADLINE_SLACK;
    }
    let streaming = header(request, "Content-Type")
        .is_some_and(|ct| ct.to_ascii_lowercase().starts_with("application/connect+"));
    if streaming {
        STREAM_IDLE
    } else {
        UNARY_IDLE
    }
}

/// One request's way to a guest port.
struct Exchange<'a> {
    addr: SocketAddr,
    patience: Patience,
    dest: &'a Destination,
    /// The `Host` the guest receives.
    host: &'a str,
    tunnel_idle: Duration,
    orchestrator: &'a Orchestrator,
}

impl Exchange<'_> {
    /// Why the guest port did not answer: a VM that QEMU paused on a full state disk
    /// while the connect waited answers 507 like a call made after it (operations.md
    /// §10.3), anything else 502.
    fn unreachable(&self, e: &EnvdError) -> ApiError {
        let route = self.orchestrator.envd_route(&self.dest.sandbox);
        if let EnvdRoute::PausedOnIoError { message, .. } = route {
            return ApiError::from(OrchError::InsufficientStorage(message));
        }
        let message = format!(
            "The sandbox {} is running but port {} is not open: {e}",
            self.dest.sandbox, self.dest.port
        );
        ApiError::new(502, message)
    }

    /// Sends `request` to the guest and its answer back (or, after a `101` to an
    /// upgrade, tunnels the connection); the answer's status.
    fn run(&self, mut request: Request) -> Result<u16, EnvdError> {
        let target = request.url().to_string();
        if !target.starts_with('/') {
            let e = ApiError::bad_request("request target must be a path");
            answer_error(request, &e);
            return Ok(400);
        }
        let upgrade = match upgrade_of(&request) {
            Ok(u) => u,
            Err(e) => {
                answer_error(request, &e);
                return Ok(400);
            }
        };
        let method = request.method().to_string();
        let headers = forwarded_headers(&request);
        let framing = match upgrade {
            Some(_) => Framing::None,
            None => body_framing(&request),
        };
        let mut conn = match envd::Connection::open(self.addr, self.patience.clone()) {
            Ok(c) => c,
            Err(e) => {
                answer_error(request, &self.unreachable(&e));
                return Err(e);
            }
        };
        let outgoing = Outgoing {
            method: &method,
            target: &target,
            host: self.host,
            headers: &headers,
            body: framing,
            upgrade: upgrade.as_deref(),
        };
        let sent = conn.send(&outgoing, request.as_reader());
        let answer = match sent.and_then(|_| conn.answer(upgrade.is_some())) {
            Ok(a) => a,
            Err(e) => {
                answer_error(request, &upstream_error(&e));
                return Err(e);
            }
        };
        match (upgrade, answer.upgraded) {
            (Some(protocol), Some(guest)) => {
                self.tunnel(request, &protocol, &answer.headers, guest)?;
                Ok(101)
            }
            (_, upgraded) => {
                let answer = envd::Answer { upgraded, ..answer };
                relay_answer(request, answer)
            }
        }
    }

    /// Answers `101` with the guest's headers, then relays bytes both ways until either
    /// side closes, the sandbox stops or both stay quiet for the tunnel's idle limit.
    fn tunnel(
        &self,
        request: Request,
        protocol: &str,
        headers: &[(String, String)],
        guest: envd::Upgraded,
    ) -> Result<(), EnvdError> {
        let patience = Patience {
            idle: self.tunnel_idle,
            alive: self.patience.alive.clone(),
        };
        let totals = tunnel_upgrade(request, protocol, headers, guest, patience)?;
        log::info!(
            "sandboxId={} op=tunnel port={} protocol={protocol} toGuest={} toClient={} end={:?}",
            self.dest.sandbox,
            self.dest.port,
            totals.to_guest,
            totals.to_client,
            totals.end
        );
        Ok(())
    }
}

/// Answers `101` with the upstream's `headers`, then relays bytes both ways between the
/// client and `upstream` (`envd::tunnel::relay`, bounded by `patience`).
pub(super) fn tunnel_upgrade(
    request: Request,
    protocol: &str,
    headers: &[(String, String)],
    upstream: envd::Upgraded,
    patience: Patience,
) -> Result<envd::tunnel::Totals, EnvdError> {
    let mut response = Response::empty(StatusCode(101));
    for (k, v) in headers {
        if let Ok(h) = Header::from_bytes(k.as_bytes(), v.as_bytes()) {
            response.add_header(h);
        }
    }
    // Client reads wake every TUNNEL_POLL to look at the other side and the sandbox.
    request.set_body_timeout(Some(TUNNEL_POLL));
    let (reader, writer) = request
        .upgrade_split(protocol, response)
        .map_err(envd::read_error)?;
    envd::tunnel::relay(reader, writer, upstream, patience)
}

/// The protocol of an HTTP/1.1 upgrade request (`Connection: upgrade` and `Upgrade`),
/// `None` for any other request. An upgrade with a body is refused: what follows the
/// head belongs to the new protocol.
pub(super) fn upgrade_of(request: &Request) -> Result<Option<String>, ApiError> {
    let wants = header(request, "Connection").is_some_and(|c| {
        c.split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
    });
    let Some(protocol) = header(request, "Upgrade").filter(|_| wants) else {
        return Ok(None);
    };
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~/, ".contains(&b);
    if protocol.is_empty() || protocol.len() > 256 || !protocol.bytes().all(token) {
        return Err(ApiError::bad_request(format!(
            "Upgrade {protocol:?} is not a protocol name"
        )));
    }
    let has_body = header(request, "Transfer-Encoding").is_some()
        || request.body_length().is_some_and(|n| n > 0);
    if has_body {
        return Err(ApiError::bad_request(
            "an upgrade request cannot have a body",
        ));
    }
    Ok(Some(protocol.to_string()))
}

/// The request's headers the guest may see: no hop-by-hop ones, no credentials.
fn forwarded_headers(request: &Request) -> Vec<(String, String)> {
    headers_without(request, &WITHHELD)
}

/// The request's headers but hop-by-hop ones and those named in `withheld`.
pub(super) fn headers_without(request: &Request, withheld: &[&str]) -> Vec<(String, String)> {
    request
        .headers()
        .iter()
        .filter(|h| {
            let name = h.field.as_str().as_str();
            !envd::is_hop_by_hop(name) && !withheld.iter().any(|w| name.eq_ignore_ascii_case(w))
        })
        .map(|h| (h.field.as_str().to_string(), h.value.as_str().to_string()))
        .collect()
}

pub(super) fn body_framing(request: &Request) -> Framing {
    if header(request, "Transfer-Encoding").is_some() {
        Framing::Chunked
    } else {
        match request.body_length() {
            Some(n) => Framing::Length(n as u64),
            None => Framing::None,
        }
    }
}

/// Sends the guest's answer head and streams its body to the client.
pub(super) fn relay_answer(request: Request, answer: envd::Answer) -> Result<u16, EnvdError> {
    let status = answer.status;
    let headers: Vec<Header> = answer
        .headers
        .iter()
        .filter_map(|(k, v)| Header::from_bytes(k.as_bytes(), v.as_bytes()).ok())
        .collect();
    let length = match answer.framing {
        Framing::Length(n) => usize::try_from(n).ok(),
        Framing::None => Some(0),
        Framing::Chunked | Framing::Close => None,
    };
    let response = Response::new(StatusCode(status), headers, answer.body, length, None);
    request.respond(response).map_err(envd::read_error)?;
    Ok(status)
}

fn upstream_error(e: &EnvdError) -> ApiError {
    match e {
        EnvdError::Timeout => ApiError::new(504, e.to_string()),
        EnvdError::Stopped => ApiError::new(502, "The sandbox was not found: it stopped running"),
        _ => ApiError::new(502, e.to_string()),
    }
}

pub(super) fn answer_error(request: Request, e: &ApiError) {
    if let Err(err) = super::respond_error(request, e) {
        log::debug!("op=envd_proxy respond_error=\"{err}\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0190f3c4-1c2d-7e3f-8a4b-5c6d7e8f9a0b";

    #[test]
    fn sandbox_host_names() {
        let d = host_destination(&format!("49983-{ID}.sandbox.example.com")).unwrap();
        assert_eq!(
            d,
            Destination {
                sandbox: ID.into(),
                port: 49983
            }
        );
        let upper = ID.to_ascii_uppercase();
        let d = host_destination(&format!("8080-{upper}.example.com:443")).unwrap();
        assert_eq!(d.port, 8080);
        assert_eq!(d.sandbox, ID);
        // A cluster node's id carries its node (`cluster::id`).
        let d = host_destination(&format!("3000-{ID}-node-2.example.com")).unwrap();
        assert_eq!((d.port, d.sandbox), (3000, format!("{ID}-node-2")));
        for host in [
            "api.example.com".to_string(),
            "127.0.0.1:8000".to_string(),
            format!("49983-{ID}"),
            format!("0-{ID}.example.com"),
            format!("+1-{ID}.example.com"),
            format!("99999-{ID}.example.com"),
            "49983-not-a-uuid.example.com".to_string(),
        ] {
            assert_eq!(host_destination(&host), None, "{host}");
        }
    }

    #[test]
    fn credentials() {
        let key = "the-api-key";
        let private = Access {
            envd_token: "envd".into(),
            traffic_token: "traffic".into(),
            ingress: crate::orchestrator::Ingress {
                public: false,
                mask_request_host: None,
            },
        };
        let public = Access {
            ingress: Default::default(),
            ..private.clone()
        };
        let creds = |k, a, t| Credentials {
            api_key: k,
            access: a,
            traffic: t,
        };
        let none = Credentials::default();
        // The API key opens every port of every sandbox, known or not.
        for envd in [true, false] {
            assert!(admitted(&creds(Some(key), None, None), envd, None, key));
            assert!(admitted(
                &creds(None, Some(key), None),
                envd,
                Some(&private),
                key
            ));
            assert!(admitted(
                &creds(None, Some("envd"), None),
                envd,
                Some(&private),
                key
            ));
            assert!(!admitted(&none, envd, None, key), "unknown sandbox");
            assert!(
                !admitted(&creds(Some("envd"), None, None), envd, Some(&private), key),
                "a token is no API key"
            );
        }
        // envd's port: its token only, public or not.
        assert!(!admitted(&none, true, Some(&public), key));
        assert!(!admitted(
            &creds(None, None, Some("traffic")),
            true,
            Some(&private),
            key
        ));
        assert!(!admitted(
            &creds(None, Some("other"), None),
            true,
            Some(&public),
            key
        ));
        // Other ports: open when public, else the traffic token.
        assert!(admitted(&none, false, Some(&public), key));
        assert!(!admitted(&none, false, Some(&private), key));
        assert!(admitted(
            &creds(None, None, Some("traffic")),
            false,
            Some(&private),
            key
        ));
        assert!(!admitted(
            &creds(None, None, Some("traffik")),
            false,
            Some(&private),
            key
        ));
        assert!(
            !admitted(
                &creds(None, Some("traffic"), None),
                false,
                Some(&private),
                key
            ),
            "the traffic token is no envd token"
        );
        let empty = Access {
            envd_token: String::new(),
            traffic_token: String::new(),
            ..private.clone()
        };
        assert!(
            !admitted(&creds(None, Some(""), Some("")), false, Some(&empty), key),
            "an empty token opens nothing"
        );
        assert!(
            !admitted(&creds(Some(""), None, None), true, None, ""),
            "nor an empty key"
        );
    }
}
