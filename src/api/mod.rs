//! The REST API: HTTP only. Routing, authentication, JSON bodies and the mapping of
//! orchestrator errors to statuses.
//!
//! Threads: `tiny_http` reads each connection on its own thread (bounded by
//! `server.max_connections`, with header/body/idle timeouts) and queues complete request
//! heads. One dispatcher thread takes them, authenticates, classifies them into a [`Lane`]
//! and hands them to that lane's bounded pool without ever blocking; refusals (401, 429,
//! 503) are answered by a few rejecter threads. A handler that panics answers 500.

mod body;
mod console;
mod e2b_templates;
mod envd_proxy;
mod error;
mod everywhere;
mod forward;
mod history;
mod merged;
mod models;
mod network;
mod placement;
mod query;
mod routes;
mod signed_url;
mod volumes;

pub use error::ApiError;

use crate::config::ServerConfig;
use crate::orchestrator::Orchestrator;
use crate::util::constant_time_eq;
use crossbeam_channel::{Sender, TrySendError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Read;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tiny_http::{Header, Request, Response, StatusCode};

/// What a handler answers.
pub enum Reply {
    Json {
        status: u16,
        body: serde_json::Value,
        headers: Vec<(String, String)>,
    },
    Empty(u16),
    Text {
        content_type: &'static str,
        body: String,
    },
    Stream {
        reader: Box<dyn Read + Send>,
        length: u64,
    },
    /// An embedded file of the console, with its headers.
    Asset {
        content_type: &'static str,
        body: &'static [u8],
        headers: Vec<(String, String)>,
    },
    /// 308 to another path of this server.
    Redirect(&'static str),
}

impl Reply {
    pub fn json(status: u16, body: serde_json::Value) -> Reply {
        Reply::Json {
            status,
            body,
            headers: Vec::new(),
        }
    }
}

/// Everything a handler may use.
pub struct Context {
    pub orchestrator: Arc<Orchestrator>,
    pub api_key: String,
    /// Test-only faults (`AENV_TEST_FAULTS=1`, docs/configuration.md): a request with
    /// `X-Aenv-Test-Fault: panic` makes its handler panic. Off in production.
    pub test_faults: bool,
    /// The last hour of `/metrics` numbers (`GET /metrics/history`).
    pub history: Arc<history::MetricsHistory>,
    /// This server as a cluster node (`[cluster] node`); `None` for a single node.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
}

impl Context {
    pub fn new(
        orchestrator: Arc<Orchestrator>,
        api_key: String,
        test_faults: bool,
        cluster: Option<Arc<crate::cluster::Cluster>>,
    ) -> Context {
        let interval = orchestrator.config().metrics.history_interval_secs;
        Context {
            orchestrator,
            api_key,
            test_faults,
            history: history::MetricsHistory::new(Duration::from_secs(interval)),
            cluster,
        }
    }
}

/// The lanes requests are served on (docs/architecture.md, "API lanes"): each has its
/// own bounded pool, so a lane full of slow work never delays another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Health, metrics, the OpenAPI document, reads of records: never wait on a VM.
    Quick,
    /// Lifecycle operations: creates, deletes, pause, resume, snapshots, templates.
    Control,
    /// Guest I/O that may take minutes (commands, files); limited per sandbox.
    Io,
    /// Requests for a sandbox's envd: the envd proxy forwards each on a stream thread of
    /// its own (bounded there), after a quick-lane worker handed it over.
    Stream,
}

/// Which lane serves an API request: its route's ([`routes::ROUTES`]); an unknown route
/// is answered (404, 405) on the quick lane. No body is read. Requests for envd are
/// recognised before this ([`envd_proxy::EnvdProxy::wants`]).
pub fn lane_of(request: &Request) -> Lane {
    let path = request.url().split('?').next().unwrap_or("");
    routes::find(request.method(), path).map_or(Lane::Quick, |(route, _)| route.lane)
}

/// The sandbox a request of [`Lane::Io`] works on.
fn io_sandbox(request: &Request) -> Option<String> {
    let path = request.url().split('?').next().unwrap_or("");
    let mut segments = path.trim_start_matches('/').split('/');
    match (segments.next(), segments.next()) {
        (Some("sandboxes"), Some(id)) => Some(id.to_string()),
        _ => None,
    }
}

/// Sizes of the lanes and per-sandbox limits (`[server]` keys).
#[derive(Debug, Clone)]
pub struct LaneSizes {
    pub quick_threads: usize,
    pub control_threads: usize,
    pub io_threads: usize,
    pub max_inflight_per_sandbox: usize,
}

/// A request with what the dispatcher reserved for it.
struct Job {
    request: Request,
    _permit: Option<InflightPermit>,
}

/// One request of a sandbox in flight on the I/O lane; released on drop.
struct InflightPermit {
    counts: Arc<Mutex<HashMap<String, usize>>>,
    sandbox: String,
}

impl InflightPermit {
    fn acquire(
        counts: &Arc<Mutex<HashMap<String, usize>>>,
        sandbox: String,
        max: usize,
    ) -> Option<InflightPermit> {
        let mut map = counts.lock();
        let n = map.entry(sandbox.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(InflightPermit {
            counts: counts.clone(),
            sandbox,
        })
    }
}

impl Drop for InflightPermit {
    fn drop(&mut self) {
        let mut map = self.counts.lock();
        if let Some(n) = map.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.sandbox);
            }
        }
    }
}

/// The running HTTP server: the dispatcher, one pool per lane and the rejecters.
pub struct ApiServer {
    server: Arc<tiny_http::Server>,
    threads: Vec<JoinHandle<()>>,
    _sampler: history::Sampler,
}

/// Threads that answer requests refused before a lane (401, 429, 503).
const REJECT_THREADS: usize = 4;

/// Binds `[server] listen` with the configured connection limits.
fn listen(cfg: &ServerConfig) -> Result<tiny_http::Server, String> {
    let listen = &cfg.listen;
    let secs = |s: u64| Some(Duration::from_secs(s));
    let limits = tiny_http::Limits {
        max_connections: cfg.max_connections,
        max_header_bytes: cfg.max_header_bytes,
        idle_timeout: secs(cfg.idle_timeout_secs),
        header_timeout: secs(cfg.header_timeout_secs),
        body_timeout: secs(cfg.body_timeout_secs),
        write_timeout: secs(cfg.write_timeout_secs),
        // JSON bodies are read by the connection's own thread before dispatch, so a
        // client that stalls mid-body never holds a worker.
        buffer_body_up_to: usize::try_from(cfg.max_body_bytes).unwrap_or(usize::MAX),
        ..tiny_http::Limits::default()
    };
    let config = tiny_http::ServerConfig {
        addr: tiny_http::ConfigListenAddr::from_socket_addrs(listen.as_str())
            .map_err(|e| format!("cannot resolve {listen}: {e}"))?,
        ssl: None,
    };
    let server = tiny_http::Server::with_limits(config, limits)
        .map_err(|e| format!("cannot listen on {listen}: {e}; set server.listen or AENV_LISTEN_ADDR to a free address"))?;
    Ok(server)
}

impl ApiServer {
    /// Binds `[server] listen` and starts the dispatcher, the lanes and the rejecters.
    pub fn start(cfg: &ServerConfig, ctx: Context) -> Result<ApiServer, String> {
        let server = Arc::new(listen(cfg)?);
        let forward = Arc::new(forward::Forwarder::new(
            ctx.cluster.clone(),
            Duration::from_secs(ctx.orchestrator.config().api.tunnel_idle_secs),
        ));
        let envd = Arc::new(envd_proxy::EnvdProxy::new(
            ctx.orchestrator.clone(),
            ctx.api_key.clone(),
            ctx.cluster.is_some().then(|| forward.clone()),
        ));
        let terminals = Arc::new(console::terminal::Terminals::new(
            ctx.orchestrator.clone(),
            ctx.api_key.clone(),
        ));
        let sampler = ctx.history.start(Arc::downgrade(&ctx.orchestrator));
        let ctx = Arc::new(ctx);
        let sizes = LaneSizes {
            quick_threads: cfg.quick_threads,
            control_threads: cfg.http_threads,
            io_threads: cfg.io_threads,
            max_inflight_per_sandbox: cfg.max_inflight_per_sandbox,
        };
        let mut threads = Vec::new();
        let mut lane = |name: &str, n: usize| {
            let (tx, rx) = crossbeam_channel::bounded::<Job>(n * 4);
            for i in 0..n {
                let rx = rx.clone();
                let ctx = ctx.clone();
                let envd = envd.clone();
                let terminals = terminals.clone();
                let forward = forward.clone();
                threads.push(spawn(format!("{name}-{i}"), move || {
                    for job in rx {
                        // Forwarding to other nodes, the envd proxy and the console's
                        // terminals take their requests onto threads of their own.
                        let request = forward
                            .divert(job.request)
                            .and_then(|r| envd.divert(r))
                            .and_then(|r| terminals.divert(r));
                        if let Some(request) = request {
                            serve_one(&ctx, request);
                        }
                    }
                }));
            }
            tx
        };
        let quick = lane("http-quick", sizes.quick_threads);
        let control = lane("http-control", sizes.control_threads);
        let io = lane("http-io", sizes.io_threads);
        let (reject_tx, reject_rx) = crossbeam_channel::unbounded::<(Request, ApiError)>();
        for i in 0..REJECT_THREADS {
            let rx = reject_rx.clone();
            threads.push(spawn(format!("http-reject-{i}"), move || {
                for (request, e) in rx {
                    let _ = respond_error(request, &e);
                }
            }));
        }
        let dispatcher = Dispatcher {
            ctx,
            envd,
            forward,
            sizes,
            quick,
            control,
            io,
            reject: reject_tx,
            inflight: Arc::new(Mutex::new(HashMap::new())),
        };
        let srv = server.clone();
        threads.push(spawn("http-dispatch".into(), move || {
            while let Ok(request) = srv.recv() {
                dispatcher.dispatch(request);
            }
        }));
        Ok(ApiServer {
            server,
            threads,
            _sampler: sampler,
        })
    }

    pub fn local_addr(&self) -> String {
        self.server.server_addr().to_string()
    }

    /// Stops accepting requests and joins the dispatcher and the pools.
    pub fn stop(self) {
        self.server.unblock();
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .expect("spawn http thread")
}

/// Hands each request to its lane without ever blocking: authentication and the
/// per-sandbox limit are checked here, refusals go to the rejecters.
struct Dispatcher {
    ctx: Arc<Context>,
    envd: Arc<envd_proxy::EnvdProxy>,
    forward: Arc<forward::Forwarder>,
    sizes: LaneSizes,
    quick: Sender<Job>,
    control: Sender<Job>,
    io: Sender<Job>,
    reject: Sender<(Request, ApiError)>,
    inflight: Arc<Mutex<HashMap<String, usize>>>,
}

impl Dispatcher {
    fn dispatch(&self, request: Request) {
        // envd requests carry their own credentials; the proxy (or the owner of a
        // sandbox on another node) checks them.
        let envd = self.envd.wants(&request);
        if !envd {
            if let Err(e) = check_auth(&self.ctx, &request) {
                return self.refuse(request, e);
            }
        }
        // Another node's sandbox: its owner applies its own lanes and limits.
        let lane = if envd || self.forward.wants(&request) {
            Lane::Stream
        } else {
            lane_of(&request)
        };
        let (sender, permit) = match lane {
            Lane::Quick | Lane::Stream => (&self.quick, None),
            Lane::Control => (&self.control, None),
            Lane::Io => {
                let permit = match io_sandbox(&request) {
                    Some(id) => match InflightPermit::acquire(
                        &self.inflight,
                        id.clone(),
                        self.sizes.max_inflight_per_sandbox,
                    ) {
                        Some(p) => Some(p),
                        None => {
                            let e = ApiError::new(
                                429,
                                format!(
                                    "sandbox {id} has {} commands and file transfers in flight (server.max_inflight_per_sandbox); retry when one ends",
                                    self.sizes.max_inflight_per_sandbox
                                ),
                            );
                            return self.refuse(request, e);
                        }
                    },
                    None => None,
                };
                (&self.io, permit)
            }
        };
        let job = Job {
            request,
            _permit: permit,
        };
        if let Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) = sender.try_send(job)
        {
            let e = ApiError::new(
                503,
                format!("server busy: the {lane:?} lane's queue is full; retry shortly"),
            );
            self.refuse(job.request, e);
        }
    }

    fn refuse(&self, request: Request, e: ApiError) {
        log::debug!(
            "method={} path={} status={} lane=refused",
            request.method(),
            request.url().split('?').next().unwrap_or(""),
            e.status
        );
        let _ = self.reject.send((request, e));
    }
}

fn serve_one(ctx: &Context, mut request: Request) {
    let started = std::time::Instant::now();
    let method = request.method().to_string();
    let url = request.url().to_string();
    // A panicking handler costs its request, never the worker (the pool keeps its size).
    let reply = std::panic::catch_unwind(AssertUnwindSafe(|| handle(ctx, &mut request)))
        .unwrap_or_else(|_| {
            log::error!("method={method} path={url} op=handler-panic");
            Err(ApiError::new(
                500,
                "internal error: the request's handler panicked; see the server log",
            ))
        });
    let status = match &reply {
        Ok(Reply::Json { status, .. }) => *status,
        Ok(Reply::Empty(s)) => *s,
        Ok(_) => 200,
        Err(e) => e.status,
    };
    log::debug!(
        "method={method} path={} status={status} ms={}",
        url.split('?').next().unwrap_or(""),
        started.elapsed().as_millis()
    );
    let result = match reply {
        Ok(reply) => respond(request, reply),
        Err(e) => respond_error(request, &e),
    };
    if let Err(e) = result {
        log::debug!("op=respond error={e}");
    }
}

/// Requests other than `GET /health`, `GET /openapi.json`, the console's files and
/// terminal (which checks the key itself), and `GET /metrics` unless configured
/// otherwise, need the API key.
fn check_auth(ctx: &Context, request: &Request) -> Result<(), ApiError> {
    let path = request.url().split('?').next().unwrap_or("");
    let metrics_open = !ctx.orchestrator.config().metrics.require_api_key;
    if exempt(request.method(), path, metrics_open) {
        Ok(())
    } else {
        authenticate(request, &ctx.api_key)
    }
}

/// Whether `method path` is served without the API key (api.md §1.2, docs/console.md).
fn exempt(method: &tiny_http::Method, path: &str, metrics_open: bool) -> bool {
    let is_get = *method == tiny_http::Method::Get;
    // A build's upload link and the volume content API carry their own tokens instead
    // (checked by their handlers).
    let upload = *method == tiny_http::Method::Put
        && path.starts_with("/templates/")
        && path.contains("/files/");
    upload
        || volumes::is_content(path)
        || console::is_public(method, path)
        || is_get
            && (path == "/health"
                || path == "/openapi.json"
                || (path == "/metrics" && metrics_open))
}

fn handle(ctx: &Context, request: &mut Request) -> Result<Reply, ApiError> {
    if ctx.test_faults
        && request
            .headers()
            .iter()
            .any(|h| h.field.equiv("X-Aenv-Test-Fault") && h.value.as_str() == "panic")
    {
        panic!("test fault: X-Aenv-Test-Fault: panic");
    }
    routes::route(ctx, request)
}

/// api.md §1.2: exactly one `X-API-Key` header equal to the key, compared in constant time.
fn authenticate(request: &Request, key: &str) -> Result<(), ApiError> {
    let mut values = request
        .headers()
        .iter()
        .filter(|h| h.field.equiv("X-API-Key"));
    match (values.next(), values.next()) {
        (Some(h), None) if constant_time_eq(h.value.as_bytes(), key.as_bytes()) => Ok(()),
        _ => Err(ApiError::unauthorized()),
    }
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("valid header")
}

fn respond(request: Request, reply: Reply) -> std::io::Result<()> {
    match reply {
        Reply::Json {
            status,
            body,
            headers,
        } => {
            let mut r = Response::from_string(body.to_string())
                .with_status_code(status)
                .with_header(header("Content-Type", "application/json"));
            for (k, v) in headers {
                r.add_header(header(&k, &v));
            }
            request.respond(r)
        }
        Reply::Empty(status) => request.respond(Response::empty(StatusCode(status))),
        Reply::Text { content_type, body } => request
            .respond(Response::from_string(body).with_header(header("Content-Type", content_type))),
        Reply::Stream { reader, length } => request.respond(Response::new(
            StatusCode(200),
            vec![header("Content-Type", "application/octet-stream")],
            reader,
            usize::try_from(length).ok(),
            None,
        )),
        Reply::Asset {
            content_type,
            body,
            headers,
        } => {
            let mut r = Response::from_data(body).with_header(header("Content-Type", content_type));
            for (k, v) in headers {
                r.add_header(header(&k, &v));
            }
            request.respond(r)
        }
        Reply::Redirect(to) => {
            request.respond(Response::empty(StatusCode(308)).with_header(header("Location", to)))
        }
    }
}

fn respond_error(request: Request, e: &ApiError) -> std::io::Result<()> {
    let mut r = Response::from_string(e.body())
        .with_status_code(e.status)
        .with_header(header("Content-Type", "application/json"));
    if let Some(allow) = &e.allow {
        r.add_header(header("Allow", allow));
    }
    request.respond(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiny_http::{Method, TestRequest};

    fn lane(method: Method, path: &str) -> Lane {
        let request: Request = TestRequest::new()
            .with_method(method)
            .with_path(path)
            .into();
        lane_of(&request)
    }

    #[test]
    fn lanes_by_method_and_path() {
        let id = "01900000-0000-7000-8000-000000000000";
        assert_eq!(lane(Method::Get, "/health"), Lane::Quick);
        assert_eq!(lane(Method::Get, &format!("/sandboxes/{id}")), Lane::Quick);
        assert_eq!(lane(Method::Get, "/v2/sandboxes?limit=1"), Lane::Quick);
        assert_eq!(lane(Method::Post, "/sandboxes"), Lane::Control);
        assert_eq!(
            lane(Method::Delete, &format!("/sandboxes/{id}")),
            Lane::Control
        );
        let commands = format!("/sandboxes/{id}/commands");
        assert_eq!(lane(Method::Post, &commands), Lane::Io);
        let files = format!("/sandboxes/{id}/files?path=/x");
        assert_eq!(lane(Method::Get, &files), Lane::Io);
        assert_eq!(lane(Method::Put, &files), Lane::Io);
        let metrics = format!("/sandboxes/{id}/metrics");
        assert_eq!(lane(Method::Get, &metrics), Lane::Io);
    }

    /// Every route needs the key except health, the document, metrics (when open), the
    /// console's files and the volume content API; the terminal checks the key itself
    /// (`console::terminal`).
    #[test]
    fn auth_of_every_route() {
        let id = "01900000-0000-7000-8000-000000000000";
        for route in routes::ROUTES {
            let path = route
                .path
                .replace("{sandboxID}", id)
                .replace("{idOrName}", "t")
                .replace("{asset}", "app.js");
            let open = exempt(&route.method, &path, true);
            let expected = matches!(
                route.path,
                "/health"
                    | "/openapi.json"
                    | "/metrics"
                    | "/console"
                    | "/console/"
                    | "/console/{asset}"
                    | "/console/terminal/{sandboxID}"
                    | "/templates/{templateID}/files/{hash}"
            ) && !(route.path == "/templates/{templateID}/files/{hash}"
                && route.method != Method::Put)
                // The content API checks the volume's token (`volumes::authorized`).
                || route.path.starts_with("/volumecontent/");
            assert_eq!(open, expected, "{} {}", route.method, route.path);
        }
        assert!(!exempt(&Method::Get, "/metrics", false));
        assert!(!exempt(&Method::Get, "/metrics/history", true));
        assert!(!exempt(&Method::Delete, "/console/app.js", true));
        assert!(!exempt(&Method::Get, "/console/terminal/nope", true));
    }

    #[test]
    fn inflight_permits_are_per_sandbox_and_released() {
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let a1 = InflightPermit::acquire(&counts, "a".into(), 2).unwrap();
        let _a2 = InflightPermit::acquire(&counts, "a".into(), 2).unwrap();
        assert!(InflightPermit::acquire(&counts, "a".into(), 2).is_none());
        assert!(InflightPermit::acquire(&counts, "b".into(), 2).is_some());
        drop(a1);
        assert!(InflightPermit::acquire(&counts, "a".into(), 2).is_some());
    }
}
