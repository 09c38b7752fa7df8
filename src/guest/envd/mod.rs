//! envd in the guest: the in-sandbox daemon protocol of E2B, served on the agent's HTTP
//! port (49983) so the unmodified E2B SDKs work through the host's envd proxy.
//!
//! Surface (the host proxy forwards the SDK's requests unchanged):
//! - Connect RPC, JSON codec ([`connect`]): `process.Process` ([`process`]) and
//!   `filesystem.Filesystem` ([`filesystem`], [`watch`]) at `/<service>/<Method>`;
//! - plain HTTP: `GET /health`, `POST /init`, `GET /envs`, `GET|POST /files` ([`files`]).
//!
//! Threads: tiny_http accepts and parses; one thread per request (at most
//! [`MAX_ACTIVE_REQUESTS`], more are answered 503 at once), so a long stream holds only
//! its own thread. Each process has one output thread that fans its output out to the
//! streams following it; each polled watcher has one thread. Streaming responses are
//! written straight onto the connection ([`http::ChunkedWriter`]) and flushed per
//! message, so output reaches the client as it happens.
//!
//! The guest trusts its caller: the host proxy checks the sandbox's access token before
//! forwarding, and processes inside the guest are the sandbox user's own anyway.

pub mod files;
pub mod filesystem;
pub mod http;
pub mod metadata;
pub mod metrics;
pub mod multipart;
pub mod process;
pub mod users;
pub mod watch;

use std::collections::BTreeMap;
use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use serde::Deserialize;
use serde_json::{json, Value};
use tiny_http::{Method, Request};

use super::reaper::Reaper;
use crate::protocol::connect::{self, Code, MessageSink, RpcError};
use users::{Accounts, User};

/// Requests served at once; each holds a thread for its duration.
pub const MAX_ACTIVE_REQUESTS: usize = 128;
/// Largest `/init` body.
const MAX_INIT_BODY: usize = 1 << 20;

/// What a request carries besides its message.
#[derive(Debug, Clone, Default)]
pub struct Call {
    /// The user named by `Authorization: Basic`, if any.
    pub user: Option<String>,
    /// `Connect-Timeout-Ms`.
    pub timeout: Option<Duration>,
    /// `Keepalive-Ping-Interval`.
    pub keepalive: Duration,
}

/// Settings `/init` changes for every later call.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    /// Environment of every process (the sandbox's `envs`), under each call's own.
    pub env: BTreeMap<String, String>,
    pub user: Option<String>,
    pub workdir: Option<String>,
}

/// The daemon's state, shared by all request threads.
pub struct Envd {
    accounts: Accounts,
    /// Run processes as the account's uid/gid (only possible when the agent is root).
    switch_users: bool,
    defaults: RwLock<Defaults>,
    processes: Arc<process::Table>,
    watchers: watch::Watchers,
    reaper: Arc<Reaper>,
    active: AtomicUsize,
}

impl Envd {
    pub fn new(reaper: Arc<Reaper>, accounts: Accounts) -> Arc<Envd> {
        Arc::new(Envd {
            accounts,
            switch_users: crate::sys::guest::is_root(),
            defaults: RwLock::new(Defaults::default()),
            processes: Arc::default(),
            watchers: watch::Watchers::default(),
            reaper,
            active: AtomicUsize::new(0),
        })
    }

    /// The account a call runs as: its Basic-auth user, else `/init`'s default user,
    /// else E2B's `user` (which falls back to root where it does not exist).
    pub fn user(&self, call: &Call) -> Result<User, RpcError> {
        let default = self.defaults.read().user.clone();
        let name = call
            .user
            .clone()
            .or(default)
            .unwrap_or_else(|| users::DEFAULT_USER.to_string());
        self.accounts.lookup(&name)
    }

    /// Resolves a request path for `user` (see [`users::resolve`]).
    pub fn resolve(&self, path: &str, user: &User) -> Result<std::path::PathBuf, RpcError> {
        let workdir = self.defaults.read().workdir.clone();
        users::resolve(path, user, workdir.as_deref())
    }

    /// This request thread acts on files as `user`, with its permissions, until the
    /// guard drops (an agent that is not root acts as itself).
    pub fn act_as(&self, user: &User) -> Result<Option<crate::sys::guest::FsIdentity>, RpcError> {
        if !self.switch_users {
            return Ok(None);
        }
        let groups = self.accounts.groups_of(user);
        crate::sys::guest::FsIdentity::assume(user.uid, user.gid, &groups)
            .map(Some)
            .map_err(|e| RpcError::internal(format!("cannot act as {}: {e}", user.name)))
    }

    pub fn defaults(&self) -> Defaults {
        self.defaults.read().clone()
    }
}

/// Serves requests until the server is dropped.
pub fn serve(server: tiny_http::Server, envd: Arc<Envd>) {
    for request in server.incoming_requests() {
        if envd.active.fetch_add(1, Ordering::SeqCst) >= MAX_ACTIVE_REQUESTS {
            envd.active.fetch_sub(1, Ordering::SeqCst);
            let err = RpcError::new(
                Code::Unavailable,
                format!("envd is serving {MAX_ACTIVE_REQUESTS} requests already; retry later"),
            );
            http::respond_json(request, 503, &err.to_json());
            continue;
        }
        let e = envd.clone();
        let spawned = std::thread::Builder::new()
            .name("envd-req".into())
            .spawn(move || {
                handle(&e, request);
                e.active.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(err) = spawned {
            envd.active.fetch_sub(1, Ordering::SeqCst);
            log::error!("cannot start a request thread: {err}");
        }
    }
}

fn call_of(req: &Request) -> Result<Call, RpcError> {
    Ok(Call {
        user: users::basic_auth_user(http::header(req, "Authorization").as_deref())?,
        timeout: connect::timeout_header(http::header(req, "Connect-Timeout-Ms").as_deref())?,
        keepalive: connect::keepalive_header(
            http::header(req, "Keepalive-Ping-Interval").as_deref(),
        ),
    })
}

fn handle(envd: &Envd, req: Request) {
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let method = req.method().clone();
    match (path, &method) {
        ("/health", Method::Get) => http::respond_json(req, 200, &json!({"status": "ok"})),
        ("/init", Method::Post) => init(envd, req),
        ("/metrics", Method::Get) => {
            let sample = serde_json::to_value(metrics::sample()).unwrap_or_default();
            http::respond_json(req, 200, &sample)
        }
        ("/envs", Method::Get) => {
            let env = envd.defaults().env;
            http::respond_json(req, 200, &json!(env))
        }
        ("/files", Method::Get) => files::download(envd, req, query),
        ("/files", Method::Post) => files::upload(envd, req, query),
        ("/health" | "/envs" | "/init" | "/files" | "/metrics", _) => http::respond_json(
            req,
            405,
            &json!({"code": 405, "message": format!("method {method} not allowed on {path}")}),
        ),
        _ => match path.strip_prefix('/').and_then(|p| p.split_once('/')) {
            Some((service, name)) => rpc(envd, req, service, name),
            None => http::respond_json(
                req,
                404,
                &json!({"code": 404, "message": format!("no such endpoint: {path}")}),
            ),
        },
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitRequest {
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    default_user: Option<String>,
    #[serde(default)]
    default_workdir: Option<String>,
}

/// `POST /init {"envVars": {...}, "defaultUser"?, "defaultWorkdir"?}` → 204. The env vars
/// replace those of an earlier call.
fn init(envd: &Envd, mut req: Request) {
    let mut body = Vec::new();
    let read = req
        .as_reader()
        .take(MAX_INIT_BODY as u64 + 1)
        .read_to_end(&mut body);
    if read.is_err() || body.len() > MAX_INIT_BODY {
        let msg = format!("unreadable or larger than {MAX_INIT_BODY} bytes");
        return http::respond_json(req, 400, &json!({"code": 400, "message": msg}));
    }
    let init: InitRequest = match connect::parse(&body) {
        Ok(i) => i,
        Err(e) => return http::respond_json(req, 400, &json!({"code": 400, "message": e.message})),
    };
    {
        let mut d = envd.defaults.write();
        if let Some(env) = init.env_vars {
            d.env = env;
        }
        if let Some(u) = init.default_user.filter(|u| !u.is_empty()) {
            d.user = Some(u);
        }
        if let Some(w) = init.default_workdir.filter(|w| !w.is_empty()) {
            d.workdir = Some(w);
        }
    }
    http::respond_empty(req, 204);
}

type UnaryFn = fn(&Envd, &Call, &[u8]) -> Result<Value, RpcError>;
type ServerStreamFn = fn(&Envd, &Call, &[u8], &mut dyn MessageSink) -> Result<(), RpcError>;
type ClientStreamFn = fn(&Envd, &Call, &mut dyn Read) -> Result<Value, RpcError>;

enum Rpc {
    Unary(UnaryFn),
    ServerStream(ServerStreamFn),
    ClientStream(ClientStreamFn),
}

fn lookup_rpc(service: &str, name: &str) -> Option<Rpc> {
    use Rpc::*;
    Some(match (service, name) {
        ("process.Process", "Start") => ServerStream(process::start),
        ("process.Process", "Connect") => ServerStream(process::connect),
        ("process.Process", "List") => Unary(process::list),
        ("process.Process", "SendInput") => Unary(process::send_input),
        ("process.Process", "StreamInput") => ClientStream(process::stream_input),
        ("process.Process", "CloseStdin") => Unary(process::close_stdin),
        ("process.Process", "SendSignal") => Unary(process::send_signal),
        ("process.Process", "Update") => Unary(process::update),
        ("filesystem.Filesystem", "Stat") => Unary(filesystem::stat),
        ("filesystem.Filesystem", "MakeDir") => Unary(filesystem::make_dir),
        ("filesystem.Filesystem", "Move") => Unary(filesystem::move_entry),
        ("filesystem.Filesystem", "ListDir") => Unary(filesystem::list_dir),
        ("filesystem.Filesystem", "Remove") => Unary(filesystem::remove),
        ("filesystem.Filesystem", "WatchDir") => ServerStream(watch::watch_dir),
        ("filesystem.Filesystem", "CreateWatcher") => Unary(watch::create_watcher),
        ("filesystem.Filesystem", "GetWatcherEvents") => Unary(watch::get_watcher_events),
        ("filesystem.Filesystem", "RemoveWatcher") => Unary(watch::remove_watcher),
        _ => return None,
    })
}

fn rpc(envd: &Envd, mut req: Request, service: &str, name: &str) {
    let Some(rpc) = lookup_rpc(service, name) else {
        let err = RpcError::new(
            Code::Unimplemented,
            format!("no such procedure: /{service}/{name}"),
        );
        return http::respond_json(req, 404, &err.to_json());
    };
    if req.method() != &Method::Post {
        let err = RpcError::new(Code::Unimplemented, "Connect calls must be POST");
        return http::respond_json(req, 405, &err.to_json());
    }
    let content_type = http::header(&req, "Content-Type").unwrap_or_default();
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let streaming = !matches!(rpc, Rpc::Unary(_));
    let expected = if streaming {
        "application/connect+json"
    } else {
        "application/json"
    };
    if media != expected {
        let err = RpcError::new(
            Code::Unimplemented,
            format!("content type {content_type:?} is not supported here; use {expected}"),
        );
        return http::respond_json(req, 415, &err.to_json());
    }
    let call = call_of(&req);
    match rpc {
        Rpc::Unary(f) => {
            let result = call.and_then(|call| {
                let body = http::read_body(&mut req, connect::MAX_MESSAGE)?;
                f(envd, &call, &body)
            });
            match result {
                Ok(v) => http::respond_json(req, 200, &v),
                Err(e) => http::respond_json(req, e.code.http_status(), &e.to_json()),
            }
        }
        Rpc::ServerStream(f) => {
            let message = call.and_then(|call| {
                let reader = req.as_reader();
                let msg = connect::read_envelope(reader)?
                    .ok_or_else(|| RpcError::invalid("the request stream holds no message"))?;
                // A chunked body still has its last chunk to come: read it, so the
                // connection is at the next request when the stream ends.
                http::drain(reader)?;
                Ok((call, msg.1))
            });
            let mut stream = match http::StreamResponse::start(req) {
                Ok(s) => s,
                Err(e) => return log::debug!("client left before the stream began: {e}"),
            };
            let result = message.and_then(|(call, msg)| f(envd, &call, &msg, &mut stream));
            stream.finish(&result);
        }
        Rpc::ClientStream(f) => {
            let result = call.and_then(|call| f(envd, &call, req.as_reader()));
            let mut body = Vec::new();
            if let Ok(v) = &result {
                body = connect::envelope(0, v.to_string().as_bytes());
            }
            body.extend(connect::end_stream(&result.map(drop)));
            http::respond_bytes(req, 200, "application/connect+json", body);
        }
    }
}
