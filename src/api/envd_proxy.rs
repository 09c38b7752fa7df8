//! The envd proxy: E2B's sandbox URL served on the API port (docs/e2b.md).
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
//! Credentials: `X-Access-Token` equal to the sandbox's `envdAccessToken`, or the API key
//! (in `X-API-Key` or `X-Access-Token`). Anything else is 401 whether or not the sandbox
//! exists. With a credential, a sandbox that is paused or gone is 502 "... was not found",
//! which the SDKs read as "not running"; a running one whose guest does not answer on the
//! port is 502 "... port is not open". Credentials, `Host` and hop-by-hop headers never
//! reach the guest.
//!
//! The first request to a sandbox's envd port after its VM started (create, resume,
//! clone) is preceded by `POST /init` with the sandbox's environment (image env and the
//! create's `envVars`), so that every process envd starts sees it.

use super::ApiError;
use crate::envd::{self, EnvdError, Framing, Outgoing, Patience};
use crate::orchestrator::{EnvdRoute, EnvdTarget, Orchestrator};
use crate::util::{constant_time_eq, is_uuid};
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
/// How long `/init` may take.
const INIT_TIMEOUT: Duration = Duration::from_secs(10);
/// Slack over a request's own `Connect-Timeout-Ms` before the proxy gives up on a quiet
/// guest.
const DEADLINE_SLACK: Duration = Duration::from_secs(30);
/// Quiet time allowed on a request without a deadline: a stream (a command without a
/// timeout, a watch) may wait a long time for its next event; a unary call may not.
const STREAM_IDLE: Duration = Duration::from_secs(24 * 3600);
const UNARY_IDLE: Duration = Duration::from_secs(300);
/// Request headers the guest never sees.
const WITHHELD: [&str; 4] = [
    "x-api-key",
    "x-access-token",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
];

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
    /// Stream threads running (see [`EnvdProxy::divert`]).
    threads: AtomicUsize,
    /// Open exchanges per sandbox.
    open: Mutex<HashMap<String, usize>>,
    /// Per sandbox, the VM instance whose guest got `/init`.
    initialized: Mutex<HashMap<String, u64>>,
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
    pub fn new(orchestrator: Arc<Orchestrator>, api_key: String) -> EnvdProxy {
        let agent_port = orchestrator.config().agent.port;
        EnvdProxy {
            orchestrator,
            api_key,
            agent_port,
            threads: AtomicUsize::new(0),
            open: Mutex::new(HashMap::new()),
            initialized: Mutex::new(HashMap::new()),
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

    /// Answers one envd request: credentials, route, `/init` when due, then the exchange
    /// with the guest. Blocks for as long as the exchange lasts: run it on a thread that
    /// is no API worker.
    pub fn serve(self: &Arc<Self>, request: Request) {
        let Some(dest) = destination(&request, self.agent_port) else {
            return answer_error(request, &ApiError::not_found("no sandbox named"));
        };
        let route = self.orchestrator.envd_route(&dest.sandbox);
        let token = match &route {
            EnvdRoute::Running(t) => Some(t.token.as_str()),
            EnvdRoute::NotRunning { token } => Some(token.as_str()),
            EnvdRoute::Unknown => None,
        };
        if !authorized(&request, token, &self.api_key) {
            return answer_error(request, &unauthorized());
        }
        // Only a client with the credential wakes a sleeping sandbox (autoResume).
        let route = match route {
            EnvdRoute::NotRunning { .. } => match self.orchestrator.route_waking(&dest.sandbox) {
                Ok(route) => route,
                Err(e) => return answer_error(request, &ApiError::from(e)),
            },
            other => other,
        };
        let target = match route {
            EnvdRoute::Running(target) => target,
            EnvdRoute::NotRunning { .. } | EnvdRoute::Unknown => {
                self.initialized.lock().remove(&dest.sandbox);
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
            self.init_once(&dest.sandbox, target, addr);
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
        match exchange(request, addr, patience, dest) {
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

    /// `POST /init` with the sandbox's env, once per VM instance. A guest that has no
    /// `/init` (404) is not asked again; one that failed is asked on the next request.
    pub(super) fn init_once(&self, sandbox: &str, target: &EnvdTarget, addr: SocketAddr) {
        if self.initialized.lock().get(sandbox) == Some(&target.instance) {
            return;
        }
        let env: serde_json::Map<String, serde_json::Value> = target
            .env
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        let body = serde_json::json!({ "envVars": env }).to_string();
        let result = envd::call(
            addr,
            "POST",
            "/init",
            "application/json",
            body.as_bytes(),
            INIT_TIMEOUT,
        );
        match result {
            Ok((status, _)) if (200..300).contains(&status) || status == 404 => {
                self.initialized
                    .lock()
                    .insert(sandbox.to_string(), target.instance);
            }
            Ok((status, body)) => log::warn!(
                "sandboxId={sandbox} op=envd_init status={status} body={:?}",
                String::from_utf8_lossy(&body)
            ),
            Err(e) => log::warn!("sandboxId={sandbox} op=envd_init error=\"{e}\""),
        }
    }
}

/// Whether `request` is for a sandbox's envd rather than the API (headers only).
pub fn is_envd(request: &Request) -> bool {
    destination(request, 0).is_some()
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
    (is_uuid(&sandbox) && host.contains('.')).then_some(Destination { sandbox, port })
}

fn header<'a>(request: &'a Request, name: &str) -> Option<&'a str> {
    request
        .headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str())
}

/// The API key in `X-API-Key` or `X-Access-Token`, or the sandbox's token in
/// `X-Access-Token`; all compared in constant time.
fn authorized(request: &Request, token: Option<&str>, api_key: &str) -> bool {
    let key = header(request, "X-API-Key");
    let access = header(request, "X-Access-Token");
    credential_matches(key, access, token, api_key)
}

fn credential_matches(
    key: Option<&str>,
    access: Option<&str>,
    token: Option<&str>,
    api_key: &str,
) -> bool {
    let is_key = |v: &str| constant_time_eq(v.as_bytes(), api_key.as_bytes());
    let is_token = |v: &str| {
        token.is_some_and(|t| !t.is_empty() && constant_time_eq(v.as_bytes(), t.as_bytes()))
    };
    key.is_some_and(is_key) || access.is_some_and(|a| is_key(a) || is_token(a))
}

fn unauthorized() -> ApiError {
    ApiError::new(
        401,
        "missing or invalid X-Access-Token (the sandbox's envdAccessToken) or X-API-Key",
    )
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
fn idle_limit(request: &Request) -> Duration {
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

/// Sends `request` to the guest and its answer back; the answer's status.
fn exchange(
    mut request: Request,
    addr: SocketAddr,
    patience: Patience,
    dest: &Destination,
) -> Result<u16, EnvdError> {
    let target = request.url().to_string();
    if !target.starts_with('/') {
        answer_error(
            request,
            &ApiError::bad_request("request target must be a path"),
        );
        return Ok(400);
    }
    let method = request.method().to_string();
    let headers: Vec<(String, String)> = request
        .headers()
        .iter()
        .filter(|h| {
            let name = h.field.as_str().as_str();
            !envd::is_hop_by_hop(name) && !WITHHELD.iter().any(|w| name.eq_ignore_ascii_case(w))
        })
        .map(|h| (h.field.as_str().to_string(), h.value.as_str().to_string()))
        .collect();
    let framing = if header(&request, "Transfer-Encoding").is_some() {
        Framing::Chunked
    } else {
        match request.body_length() {
            Some(n) => Framing::Length(n as u64),
            None => Framing::None,
        }
    };
    let mut conn = match envd::Connection::open(addr, patience) {
        Ok(c) => c,
        Err(e) => {
            let message = format!(
                "The sandbox {} is running but port {} is not open: {e}",
                dest.sandbox, dest.port
            );
            answer_error(request, &ApiError::new(502, message));
            return Err(e);
        }
    };
    let outgoing = Outgoing {
        method: &method,
        target: &target,
        headers: &headers,
        body: framing,
    };
    let sent = conn.send(&outgoing, request.as_reader());
    let answer = match sent.and_then(|_| conn.answer()) {
        Ok(a) => a,
        Err(e) => {
            answer_error(request, &upstream_error(&e));
            return Err(e);
        }
    };
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

fn answer_error(request: Request, e: &ApiError) {
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
        let check = |k, a, t| credential_matches(k, a, t, key);
        assert!(check(Some(key), None, None));
        assert!(check(None, Some(key), None));
        assert!(check(None, Some("tok"), Some("tok")));
        assert!(!check(None, Some("tok"), Some("other")));
        assert!(!check(None, Some("tok"), None));
        assert!(!check(None, None, Some("tok")));
        assert!(
            !check(Some("tok"), None, Some("tok")),
            "a token is no API key"
        );
        assert!(
            !check(None, Some(""), Some("")),
            "an empty token opens nothing"
        );
    }
}
