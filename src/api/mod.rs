//! The REST API: HTTP only. Routing, authentication, JSON bodies and the mapping of
//! orchestrator errors to statuses. A bounded pool of worker threads serves `tiny_http`.

mod body;
mod envd_proxy;
mod error;
mod models;
mod query;
mod routes;

pub use error::ApiError;

use crate::orchestrator::Orchestrator;
use crate::util::constant_time_eq;
use std::io::Read;
use std::sync::Arc;
use std::thread::JoinHandle;
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
}

/// The running HTTP server and its worker threads.
pub struct ApiServer {
    server: Arc<tiny_http::Server>,
    workers: Vec<JoinHandle<()>>,
}

impl ApiServer {
    /// Binds `listen` and starts `threads` workers.
    pub fn start(listen: &str, threads: usize, ctx: Context) -> Result<ApiServer, String> {
        let server = tiny_http::Server::http(listen)
            .map_err(|e| format!("cannot listen on {listen}: {e}; set server.listen or AENV_LISTEN_ADDR to a free address"))?;
        let server = Arc::new(server);
        let envd = Arc::new(envd_proxy::EnvdProxy::new(
            ctx.orchestrator.clone(),
            ctx.api_key.clone(),
        ));
        let ctx = Arc::new(ctx);
        let workers = (0..threads)
            .map(|i| {
                let server = server.clone();
                let ctx = ctx.clone();
                let envd = envd.clone();
                std::thread::Builder::new()
                    .name(format!("http-{i}"))
                    .spawn(move || {
                        while let Ok(request) = server.recv() {
                            // Requests for a sandbox's envd go to stream threads.
                            if let Some(request) = envd.divert(request) {
                                serve_one(&ctx, request);
                            }
                        }
                    })
                    .expect("spawn http worker")
            })
            .collect();
        Ok(ApiServer { server, workers })
    }

    pub fn local_addr(&self) -> String {
        self.server.server_addr().to_string()
    }

    /// Stops accepting requests and joins the workers.
    pub fn stop(self) {
        for _ in 0..self.workers.len() {
            self.server.unblock();
        }
        for w in self.workers {
            let _ = w.join();
        }
    }
}

fn serve_one(ctx: &Context, mut request: Request) {
    let started = std::time::Instant::now();
    let method = request.method().to_string();
    let url = request.url().to_string();
    let reply = handle(ctx, &mut request);
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

fn handle(ctx: &Context, request: &mut Request) -> Result<Reply, ApiError> {
    let path = request.url().split('?').next().unwrap_or("").to_string();
    let is_get = *request.method() == tiny_http::Method::Get;
    let exempt = is_get
        && (path == "/health"
            || (path == "/metrics" && !ctx.orchestrator.config().metrics.require_api_key));
    if !exempt {
        authenticate(request, &ctx.api_key)?;
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
