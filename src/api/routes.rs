//! Routing and the endpoint handlers of api.md §4.

use super::body::{check_env, read_json, Fields};
use super::e2b_templates as e2b;
use super::everywhere;
use super::merged::{self, Listing, Paging};
use super::volumes as vol;
use super::{console, models, query, ApiError, Context, Lane, Reply};
use crate::cluster::client::Body;
use crate::cluster::id::is_sandbox_id;
use crate::config::OnTimeout;
use crate::orchestrator::{
    ColdStart, CommandRequest, ConnectKind, CreateFrom, ExpiryChange, FromSnapshot, Ingress,
    PauseMode, PauseRequest, Request as OrchRequest, Resources, SandboxInfo, SandboxRequest,
    TemplateRequest,
};
use serde_json::{json, Value};
use std::io::Read;
use tiny_http::{Method, Request};

/// Largest root disk a create may ask for (256 GiB).
const MAX_DISK_SIZE_MB: u64 = 262_144;

/// Longest timeout a sandbox may have, in seconds (one year).
const MAX_TIMEOUT_SECS: u64 = 31_536_000;
/// A connect without `timeout` (the E2B SDKs send `{}`): E2B's default (api.md §4.10).
const CONNECT_DEFAULT_TIMEOUT_SECS: u64 = 300;

/// Where a request matched: the path's variables (`""` when it has none) and the raw
/// query string.
pub struct Target<'a> {
    pub var: &'a str,
    /// The second path variable (`{buildID}`, `{hash}`), `""` when there is none.
    pub var2: &'a str,
    pub query: &'a str,
}

type Handler = fn(&Context, &mut Request, &Target) -> Result<Reply, ApiError>;

/// One routed method and path. `{name}` in a path matches any one segment; the names are
/// those of docs/openapi.json, which documents exactly these routes.
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    pub lane: Lane,
    handler: Handler,
}

const fn r(method: Method, path: &'static str, lane: Lane, handler: Handler) -> Route {
    Route {
        method,
        path,
        lane,
        handler,
    }
}

use Lane::{Control, Io, Quick};
use Method::{Delete, Get, Patch, Post, Put};

/// Every route of the API (api.md §4), in one table: the router, the lanes, the 405
/// `Allow` lists and the OpenAPI test all read it.
pub static ROUTES: &[Route] = &[
    r(Get, "/health", Quick, |ctx, _, _| health(ctx)),
    r(Get, "/metrics", Quick, |ctx, _, _| metrics(ctx)),
    r(Get, "/openapi.json", Quick, |_, _, _| openapi()),
    r(Get, "/cluster/node", Quick, |ctx, _, _| cluster_node(ctx)),
    r(Get, "/cluster/signer", Quick, |ctx, _, q| {
        super::signed_url::signer_route(&ctx.orchestrator, q.query).map(|v| Reply::json(200, v))
    }),
    r(Get, "/sandboxes", Quick, |ctx, req, t| {
        merged::across(ctx, req, Listing::SandboxesV1, list_running(ctx, t.query))
    }),
    r(Post, "/sandboxes", Control, |ctx, req, _| {
        create_from_template(ctx, req, Defaults::agentenv(ctx))
    }),
    r(Post, "/sandboxes-cold", Control, |ctx, req, _| {
        create_cold(ctx, req)
    }),
    r(Get, "/v2/sandboxes", Quick, |ctx, req, t| {
        merged::across(ctx, req, Listing::SandboxesV2, list_v2(ctx, t.query))
    }),
    r(Post, "/v2/sandboxes", Control, |ctx, req, _| {
        create_from_template(ctx, req, Defaults::e2b(ctx))
    }),
    r(
        Post,
        "/v2/sandboxes/{sandboxID}/connect",
        Control,
        |ctx, req, t| connect(ctx, req, t.var, ConnectKind::Connect),
    ),
    r(Get, "/sandboxes/metrics", Quick, |ctx, req, t| {
        several_sandbox_metrics(ctx, req, t.query)
    }),
    r(Get, "/sandboxes/{sandboxID}", Quick, |ctx, _, t| {
        get_sandbox(ctx, t.var)
    }),
    r(Delete, "/sandboxes/{sandboxID}", Control, |ctx, _, t| {
        delete_sandbox(ctx, t.var)
    }),
    r(
        Post,
        "/sandboxes/{sandboxID}/timeout",
        Control,
        |ctx, req, t| set_timeout(ctx, req, t.var, ExpiryChange::Set),
    ),
    r(
        Put,
        "/sandboxes/{sandboxID}/network",
        Control,
        |ctx, req, t| set_network(ctx, req, t.var),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/refreshes",
        Control,
        |ctx, req, t| set_timeout(ctx, req, t.var, ExpiryChange::AtLeast),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/connect",
        Control,
        |ctx, req, t| connect(ctx, req, t.var, ConnectKind::Connect),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/resume",
        Control,
        |ctx, req, t| connect(ctx, req, t.var, ConnectKind::Resume),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/pause",
        Control,
        |ctx, req, t| pause(ctx, req, t.var),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/snapshots",
        Control,
        |ctx, req, t| snapshot(ctx, req, t.var),
    ),
    r(
        Post,
        "/sandboxes/{sandboxID}/fork",
        Control,
        |ctx, req, t| fork(ctx, req, t.var),
    ),
    // Guest I/O, which may take minutes: the I/O lane, bounded per sandbox.
    r(
        Post,
        "/sandboxes/{sandboxID}/commands",
        Io,
        |ctx, req, t| run_command(ctx, req, t.var),
    ),
    r(Get, "/sandboxes/{sandboxID}/files", Io, |ctx, _, t| {
        download(ctx, t.var, t.query)
    }),
    r(Put, "/sandboxes/{sandboxID}/files", Io, |ctx, req, t| {
        upload(ctx, req, t.var, t.query)
    }),
    r(Get, "/sandboxes/{sandboxID}/metrics", Io, |ctx, _, t| {
        sandbox_metrics(ctx, t.var, t.query)
    }),
    r(Get, "/sandboxes/{sandboxID}/logs", Quick, |ctx, _, t| {
        console_log(ctx, t.var, t.query)
    }),
    r(Get, "/v2/sandboxes/{sandboxID}/logs", Quick, |ctx, _, t| {
        sandbox_log(ctx, t.var, t.query)
    }),
    r(
        Get,
        "/sandboxes/{sandboxID}/custom-extension-params",
        Quick,
        |ctx, _, t| get_params(ctx, t.var),
    ),
    r(
        Patch,
        "/sandboxes/{sandboxID}/custom-extension-params",
        Control,
        |ctx, req, t| patch_params(ctx, req, t.var),
    ),
    r(Get, "/snapshots", Quick, |ctx, req, t| {
        merged::across(ctx, req, Listing::Snapshots, list_snapshots(ctx, t.query))
    }),
    r(Get, "/snapshots/{idOrName}", Quick, |ctx, _, t| {
        get_snapshot(ctx, t.var)
    }),
    // E2B's template build API (api.md §4.15.1); the fixed `/templates/tags` and
    // `/templates/aliases/…` paths come before `/templates/{idOrName}`.
    r(Post, "/v3/templates", Control, |ctx, req, _| {
        e2b::request_build(ctx, req)
    }),
    r(Get, "/v2/templates", Quick, |ctx, req, _| {
        merged::across(ctx, req, Listing::Templates, e2b::list(ctx))
    }),
    r(
        Post,
        "/v2/templates/{templateID}/builds/{buildID}",
        Control,
        e2b::start_build,
    ),
    r(
        Get,
        "/templates/{templateID}/builds/{buildID}/status",
        Quick,
        |ctx, _, t| e2b::build_status(ctx, t),
    ),
    r(
        Get,
        "/templates/{templateID}/builds/{buildID}/logs",
        Quick,
        |ctx, _, t| e2b::build_logs(ctx, t),
    ),
    r(
        Get,
        "/templates/{templateID}/files/{hash}",
        Quick,
        |ctx, req, t| e2b::upload_link(ctx, req, t),
    ),
    r(Put, "/templates/{templateID}/files/{hash}", Io, e2b::upload),
    r(Get, "/templates/aliases/{alias}", Quick, |ctx, _, t| {
        e2b::alias(ctx, t)
    }),
    r(Post, "/templates/tags", Control, |ctx, req, _| {
        e2b::assign_tags(ctx, req)
    }),
    r(Delete, "/templates/tags", Control, |ctx, req, _| {
        e2b::remove_tags(ctx, req)
    }),
    r(Get, "/templates/{templateID}/tags", Quick, |ctx, _, t| {
        e2b::tags(ctx, t)
    }),
    r(Get, "/templates", Quick, |ctx, req, _| {
        merged::across(ctx, req, Listing::Templates, list_templates(ctx))
    }),
    r(Post, "/templates", Control, |ctx, req, _| {
        create_template(ctx, req)
    }),
    r(Get, "/templates/{idOrName}", Quick, |ctx, _, t| {
        get_template(ctx, t.var)
    }),
    r(Patch, "/templates/{idOrName}", Control, |ctx, req, t| {
        patch_template(ctx, req, t.var)
    }),
    r(Delete, "/templates/{idOrName}", Control, |ctx, req, t| {
        delete_template(ctx, req, t.var)
    }),
    r(Get, "/metrics/history", Quick, |ctx, _, t| {
        metrics_history(ctx, t.query)
    }),
    // E2B volumes (api.md §4.27) and their content API (§4.28, the volume's token).
    r(Post, "/volumes", Control, |ctx, req, _| {
        vol::create(ctx, req)
    }),
    r(Get, "/volumes", Quick, |ctx, _, _| vol::list(ctx)),
    r(Get, "/volumes/{volumeID}", Quick, |ctx, _, t| {
        vol::get(ctx, t.var)
    }),
    r(Delete, "/volumes/{volumeID}", Control, |ctx, _, t| {
        vol::delete(ctx, t.var)
    }),
    r(Get, "/volumecontent/{volumeID}/path", Io, vol::stat),
    r(Patch, "/volumecontent/{volumeID}/path", Io, vol::set_meta),
    r(Delete, "/volumecontent/{volumeID}/path", Io, vol::remove),
    r(Get, "/volumecontent/{volumeID}/dir", Io, vol::list_dir),
    r(Post, "/volumecontent/{volumeID}/dir", Io, vol::make_dir),
    r(Get, "/volumecontent/{volumeID}/file", Io, vol::read),
    r(Put, "/volumecontent/{volumeID}/file", Io, vol::write),
    // The web console (docs/console.md): its files need no key; the terminal's
    // WebSocket is taken before routing (`console::terminal`), so a plain GET lands here.
    r(Get, "/console", Quick, |_, _, _| console::redirect()),
    r(Get, "/console/", Quick, |_, _, _| console::serve("")),
    r(Get, "/console/{asset}", Quick, |_, _, t| {
        console::serve(t.var)
    }),
    r(Get, "/console/terminal/{sandboxID}", Quick, |_, _, _| {
        Err(ApiError::new(
            426,
            "the terminal is a WebSocket: send Upgrade: websocket",
        ))
    }),
];

/// The route's path variables when `path` matches `pattern`, `""` for those it lacks.
fn matches<'a>(pattern: &str, path: &'a str) -> Option<[&'a str; 2]> {
    let mut vars = ["", ""];
    let mut n = 0;
    let mut have = path.trim_start_matches('/').split('/');
    for want in pattern.trim_start_matches('/').split('/') {
        let seg = have.next()?;
        if want.starts_with('{') {
            vars[n.min(1)] = seg;
            n += 1;
        } else if want != seg {
            return None;
        }
    }
    have.next().is_none().then_some(vars)
}

/// The route for `method` and `path`; `Err` with the methods `path` allows (empty when
/// the path is unknown).
pub fn find<'a>(
    method: &Method,
    path: &'a str,
) -> Result<(&'static Route, [&'a str; 2]), Vec<&'static str>> {
    let mut allowed = Vec::new();
    for route in ROUTES {
        if let Some(var) = matches(route.path, path) {
            if route.method == *method {
                return Ok((route, var));
            }
            allowed.push(route.method.as_str());
        }
    }
    Err(allowed)
}

pub fn route(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    match find(req.method(), path) {
        Ok((route, [var, var2])) => (route.handler)(ctx, req, &Target { var, var2, query }),
        Err(allowed) if allowed.is_empty() => {
            Err(ApiError::not_found(format!("no such endpoint: {path}")))
        }
        Err(allowed) => Err(ApiError::method_not_allowed(&allowed)),
    }
}

pub(super) fn body(ctx: &Context, req: &mut Request) -> Result<Fields, ApiError> {
    let content_type = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Content-Type"))
        .map(|h| h.value.as_str().to_string());
    let length = req.body_length();
    read_json(
        length,
        content_type.as_deref(),
        req.as_reader(),
        ctx.orchestrator.config().server.max_body_bytes,
    )
}

/// A `{id}` that is not a UUID is as unknown as an unknown id (api.md §1.5).
fn checked_id(id: &str) -> Result<&str, ApiError> {
    if is_sandbox_id(id) {
        Ok(id)
    } else {
        Err(ApiError::not_found(format!("sandbox {id} not found")))
    }
}

fn envd(ctx: &Context) -> &str {
    &ctx.orchestrator.config().api.envd_version
}

fn health(ctx: &Context) -> Result<Reply, ApiError> {
    if ctx.orchestrator.is_shutting_down() {
        return Err(ApiError::new(503, "server is shutting down"));
    }
    Ok(Reply::Empty(204))
}

fn metrics(ctx: &Context) -> Result<Reply, ApiError> {
    let mut body = ctx.orchestrator.observe().render_metrics();
    if let Some(cluster) = &ctx.cluster {
        cluster.render_metrics(&mut body);
    }
    Ok(Reply::Text {
        content_type: "text/plain; version=0.0.4",
        body,
    })
}

/// `GET /cluster/node` (api.md §4.29): this node's name, URL and free capacity, and the
/// peers it knows; a single node answers with `node` null and no peers.
fn cluster_node(ctx: &Context) -> Result<Reply, ApiError> {
    let room = ctx.orchestrator.observe().capacity();
    let capacity = crate::cluster::peers::NodeCapacity {
        memory_free_mb: room.free.memory_free_mb,
        vcpus_free: room.free.vcpus_free,
        vcpus_capped: room.free.vcpus_capped,
        memory_reserved_mb: room.free.memory_reserved_mb,
        vcpus_reserved: room.free.vcpus_reserved,
        running: room.running as u64,
    };
    let Some(cluster) = &ctx.cluster else {
        let templates = super::placement::card_templates(ctx);
        let body = json!({"node": null, "advertiseUrl": null, "capacity": capacity,
            "templates": templates, "peers": []});
        return Ok(Reply::json(200, body));
    };
    let peers: Vec<Value> = cluster
        .peers
        .peers()
        .into_iter()
        .map(|(node, p)| {
            json!({
                "node": node,
                "url": p.url.to_string(),
                "answering": p.failure.is_none(),
                "failure": p.failure,
                "lastAnsweredSecsAgo": p.answered.elapsed().as_secs(),
                "capacity": p.card.capacity,
                "templates": p.card.templates.len(),
            })
        })
        .collect();
    let card = crate::cluster::peers::NodeCard {
        node: cluster.node.clone(),
        advertise_url: cluster.advertise_url.clone(),
        capacity,
        templates: super::placement::card_templates(ctx),
    };
    let mut body = serde_json::to_value(card).unwrap_or_default();
    body["peers"] = Value::Array(peers);
    Ok(Reply::json(200, body))
}

/// `GET /metrics/history?since=`: the samples of `/metrics` taken in the last hour,
/// after `since` (unix seconds) when given (api.md §4.24).
fn metrics_history(ctx: &Context, query_string: &str) -> Result<Reply, ApiError> {
    let pairs = query::parse(query_string);
    let since = query::unix_seconds(&pairs, "since")?.unwrap_or(0);
    let node = ctx.orchestrator.observe().node_name();
    Ok(Reply::json(200, ctx.history.to_json(since, &node)))
}

/// The OpenAPI 3.1 document of this API (docs/openapi.json), built into the binary.
pub const OPENAPI: &str = include_str!("../../docs/openapi.json");

fn openapi() -> Result<Reply, ApiError> {
    Ok(Reply::Text {
        content_type: "application/json",
        body: OPENAPI.to_string(),
    })
}

/// Fields every create request rejects (api.md §4.2, §4.3).
fn reject_unsupported(f: &Fields) -> Result<(), ApiError> {
    if f.has("extraBootArgs") {
        return Err(ApiError::bad_request(
            "extraBootArgs cannot be set by API clients; only the custom extension's start-fresh answer sets boot arguments",
        ));
    }
    Ok(())
}

/// `customExtensionParams` as sent (custom-extension.md §10.1–10.2): an object, `{}` when absent or
/// `null`; any other type is 422.
fn params_field(f: &Fields) -> Result<Value, ApiError> {
    match f.raw("customExtensionParams") {
        None | Some(Value::Null) => Ok(json!({})),
        Some(v @ Value::Object(_)) => Ok(v.clone()),
        Some(_) => Err(ApiError::unprocessable(
            "field customExtensionParams must be an object or null",
        )),
    }
}

/// Params of a cold create: non-empty ones need an extension (custom-extension.md §10.2).
fn extension_params(ctx: &Context, f: &Fields) -> Result<Value, ApiError> {
    let params = params_field(f)?;
    let empty = params.as_object().is_some_and(|m| m.is_empty());
    if !empty && !ctx.orchestrator.observe().extension_enabled() {
        return Err(ApiError::bad_request(
            "customExtensionParams given but no custom extension is configured ([custom_extension].url is unset)",
        ));
    }
    Ok(params)
}

/// What a create that leaves a field out gets: agentenv's own routes keep their
/// documented defaults, E2B's route has E2B's (api.md §4.2).
#[derive(Clone, Copy)]
struct Defaults {
    timeout_secs: u64,
    auto_pause: bool,
}

impl Defaults {
    fn agentenv(ctx: &Context) -> Defaults {
        Defaults {
            timeout_secs: ctx.orchestrator.config().sandbox.default_timeout_secs,
            auto_pause: true,
        }
    }

    fn e2b(ctx: &Context) -> Defaults {
        let sandbox = &ctx.orchestrator.config().sandbox;
        Defaults {
            timeout_secs: sandbox.e2b_default_timeout_secs,
            auto_pause: sandbox.e2b_default_on_timeout == OnTimeout::Pause,
        }
    }
}

/// The fields every create shares (api.md §4.2), checked in one place.
fn create_fields(
    ctx: &Context,
    f: &Fields,
    defaults: Defaults,
) -> Result<SandboxRequest, ApiError> {
    let timeout_secs = f
        .int_in("timeout", 0..=MAX_TIMEOUT_SECS)?
        .unwrap_or(defaults.timeout_secs);
    let auto_pause = f.bool("autoPause")?.unwrap_or(defaults.auto_pause);
    let auto_pause_memory = f.bool("autoPauseMemory")?.unwrap_or(true);
    let auto_resume = auto_resume_field(f)?;
    if auto_resume && !auto_pause {
        return Err(ApiError::bad_request(
            "autoResume.enabled: true needs autoPause: true (onTimeout \"pause\"): a sandbox that is killed on timeout cannot resume",
        ));
    }
    if auto_resume && !auto_pause_memory {
        return Err(ApiError::bad_request(
            "autoResume.enabled: true cannot be combined with autoPauseMemory: false (mode \"filesystem\"): a filesystem-only pause must be resumed explicitly with connect",
        ));
    }
    let metadata = f.string_map("metadata")?;
    let env_vars = f.string_map("envVars")?;
    check_env("envVars", &env_vars)?;
    reject_unsupported(f)?;
    Ok(SandboxRequest {
        timeout_secs,
        auto_pause,
        auto_pause_memory,
        auto_resume,
        metadata,
        env_vars,
        allow_internet_access: internet_access(ctx, f)?,
        ingress: ingress_field(f)?,
        network: super::network::create_policy(f)?,
        volume_mounts: vol::mounts_field(f)?,
    })
}

/// `network.allowPublicTraffic` (absent or `null`: public) and `network.maskRequestHost`
/// (docs/e2b.md, "Public ports").
fn ingress_field(f: &Fields) -> Result<Ingress, ApiError> {
    let mut ingress = Ingress::default();
    let net = match f.raw("network") {
        None | Some(Value::Null) => return Ok(ingress),
        Some(Value::Object(net)) => net,
        Some(_) => {
            return Err(ApiError::unprocessable("field network must be an object"));
        }
    };
    match net.get("allowPublicTraffic") {
        None | Some(Value::Null) => {}
        Some(Value::Bool(b)) => ingress.public = *b,
        Some(_) => {
            return Err(ApiError::unprocessable(
                "field network.allowPublicTraffic must be a boolean",
            ))
        }
    }
    match net.get("maskRequestHost") {
        None | Some(Value::Null) => {}
        Some(Value::String(mask)) => {
            check_mask(mask)?;
            ingress.mask_request_host = Some(mask.clone());
        }
        Some(_) => {
            return Err(ApiError::unprocessable(
                "field network.maskRequestHost must be a string",
            ))
        }
    }
    Ok(ingress)
}

/// A host name (letters, digits, `.`, `-`, an optional `:port`) in which `${PORT}` may
/// stand for the port, at most 253 bytes.
fn check_mask(mask: &str) -> Result<(), ApiError> {
    let rest = mask.replace("${PORT}", "1");
    let ok = !mask.is_empty()
        && mask.len() <= 253
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_request(format!(
            "network.maskRequestHost {mask:?} is not a host name (letters, digits, '.', '-', ':port', with ${{PORT}} for the port; at most 253 bytes)"
        )))
    }
}

/// `autoResume`: absent, `null` or `{"enabled": bool}`.
fn auto_resume_field(f: &Fields) -> Result<bool, ApiError> {
    match f.raw("autoResume") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(m)) => match m.get("enabled") {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::unprocessable(
                "field autoResume.enabled must be a boolean",
            )),
        },
        Some(_) => Err(ApiError::unprocessable(
            "field autoResume must be an object {\"enabled\": bool}",
        )),
    }
}

/// `allowInternetAccess` / `allow_internet_access` (network.md §5.4): absent → the
/// server default.
fn internet_access(ctx: &Context, f: &Fields) -> Result<Option<bool>, ApiError> {
    let wanted = match f.bool("allowInternetAccess")? {
        Some(v) => Some(v),
        None => f.bool("allow_internet_access")?,
    };
    if wanted == Some(true) && !ctx.orchestrator.config().network.outbound {
        return Err(ApiError::bad_request(
            "outbound access is disabled on this server",
        ));
    }
    Ok(wanted)
}

fn create_from_template(
    ctx: &Context,
    req: &mut Request,
    defaults: Defaults,
) -> Result<Reply, ApiError> {
    let key = idempotency_key(req)?;
    let f = body(ctx, req)?;
    let template = f.required_str("templateID")?.to_string();
    if let Some(reply) = super::placement::elsewhere(ctx, req, &f, &template)? {
        return Ok(reply);
    }
    let request = create_fields(ctx, &f, defaults)?;
    let host = ctx.orchestrator.host_limits();
    let cpu_count = f
        .int_in("cpuCount", 1..=host.cpus as u64)?
        .map(|v| v as u32);
    let memory_mb = f
        .int_in("memoryMB", 1..=host.memory_mb.max(128))?
        .map(|v| v as u32);
    let params = params_field(&f)?;
    let create = FromSnapshot {
        template,
        request,
        params,
        cpu_count,
        memory_mb,
    };
    let fingerprint = fingerprint(req.url(), &f);
    let info = ctx
        .orchestrator
        .handle(OrchRequest::Create {
            from: CreateFrom::Snapshot(create),
            idempotency: key.map(|k| (k, fingerprint)),
        })?
        .into_sandbox()?;
    Ok(created(ctx, &info, 201))
}

/// `cpuCount`, `memoryMB` and `diskSizeMB` of a boot from an image (api.md §4.3).
pub(super) fn resources(ctx: &Context, f: &Fields) -> Result<Resources, ApiError> {
    let cfg = ctx.orchestrator.config();
    let host = ctx.orchestrator.host_limits();
    let cpu_count = f
        .int_in("cpuCount", 1..=host.cpus as u64)?
        .unwrap_or(cfg.vm.default_cpu_count as u64) as u32;
    let memory_mb = f
        .int_in("memoryMB", 128..=host.memory_mb.max(128))?
        .unwrap_or(cfg.vm.default_memory_mb as u64) as u32;
    let disk_size_mb = f
        .int_in("diskSizeMB", 1024..=MAX_DISK_SIZE_MB)?
        .unwrap_or(cfg.vm.default_disk_size_mb as u64);
    if !disk_size_mb.is_multiple_of(1024) {
        return Err(ApiError::bad_request(
            "diskSizeMB must be at least 1024 and a multiple of 1024",
        ));
    }
    Ok(Resources {
        cpu_count,
        memory_mb,
        disk_size_mb: disk_size_mb as u32,
    })
}

fn create_cold(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let key = idempotency_key(req)?;
    let f = body(ctx, req)?;
    let image = f.required_str("image")?.trim().to_string();
    if image.is_empty() {
        return Err(ApiError::bad_request("image must not be empty"));
    }
    let resources = resources(ctx, &f)?;
    let request = create_fields(ctx, &f, Defaults::agentenv(ctx))?;
    let params = extension_params(ctx, &f)?;
    let create = ColdStart {
        image,
        resources,
        request,
        params,
    };
    let fingerprint = fingerprint(req.url(), &f);
    let info = ctx
        .orchestrator
        .handle(OrchRequest::Create {
            from: CreateFrom::Image(create),
            idempotency: key.map(|k| (k, fingerprint)),
        })?
        .into_sandbox()?;
    Ok(created(ctx, &info, 201))
}

/// Longest `Idempotency-Key` (E2B's SDKs send 1..=255 characters).
const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The create's `Idempotency-Key` header (api.md §4.2): 1..=255 visible ASCII characters.
fn idempotency_key(req: &Request) -> Result<Option<String>, ApiError> {
    let Some(h) = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Idempotency-Key"))
    else {
        return Ok(None);
    };
    let key = h.value.as_str();
    if key.is_empty()
        || key.len() > MAX_IDEMPOTENCY_KEY
        || !key.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(ApiError::bad_request(format!(
            "Idempotency-Key must be 1..={MAX_IDEMPOTENCY_KEY} visible ASCII characters (got {} bytes)",
            key.len()
        )));
    }
    Ok(Some(key.to_string()))
}

/// What makes two creates the same request: the route and the body's fields.
fn fingerprint(url: &str, f: &Fields) -> [u8; 32] {
    use sha2::Digest;
    let path = url.split('?').next().unwrap_or(url);
    let mut hash = sha2::Sha256::new();
    hash.update(path.as_bytes());
    hash.update([0]);
    hash.update(Value::Object(f.0.clone()).to_string().as_bytes());
    hash.finalize().into()
}

fn created(ctx: &Context, info: &SandboxInfo, status: u16) -> Reply {
    Reply::Json {
        status,
        body: models::sandbox(info, envd(ctx)),
        headers: vec![("x-agentenv-sandbox-id".into(), info.id.clone())],
    }
}

fn metadata_matches(
    info: &SandboxInfo,
    filter: &std::collections::BTreeMap<String, String>,
) -> bool {
    filter
        .iter()
        .all(|(k, v)| info.settings.metadata.get(k) == Some(v))
}

fn list_running(ctx: &Context, query_string: &str) -> Result<Reply, ApiError> {
    let pairs = query::parse(query_string);
    let filter = query::get(&pairs, "metadata")
        .map(query::metadata_filter)
        .unwrap_or_default();
    let items: Vec<Value> = ctx
        .orchestrator
        .list()
        .iter()
        .filter(|i| i.state().api_state() == Some("running") && metadata_matches(i, &filter))
        .map(|i| models::listed_sandbox(i, envd(ctx)))
        .collect();
    Ok(Reply::json(200, Value::Array(items)))
}

/// Sort key of `GET /v2/sandboxes`: startedAt, then id (descending unless `order=asc`).
/// startedAt in ns but whole milliseconds, as the listed `startedAt` shows it: a node
/// merging other nodes' lists keys their items alike (`merged`).
fn list_key(info: &SandboxInfo) -> (u128, String) {
    let millis = info
        .started_at
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    (millis * 1_000_000, info.id.clone())
}

/// The order and page size of a `GET /v2/sandboxes` query, checked.
pub(super) fn v2_paging(query_string: &str) -> Result<Paging, ApiError> {
    let q = ListQuery::parse(query_string)?;
    Ok(Paging {
        ascending: q.ascending,
        limit: q.limit,
    })
}

pub(super) fn encode_token(key: &(u128, String)) -> String {
    crate::util::hex(format!("{}:{}", key.0, key.1).as_bytes())
}

fn decode_token(token: &str) -> Option<(u128, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let text = String::from_utf8(bytes?).ok()?;
    let (nanos, id) = text.split_once(':')?;
    is_sandbox_id(id).then_some(())?;
    Some((nanos.parse().ok()?, id.to_string()))
}

/// The filters and order of `GET /v2/sandboxes` (api.md §4.5), checked.
struct ListQuery {
    metadata: std::collections::BTreeMap<String, String>,
    states: Vec<String>,
    ascending: bool,
    started_after: Option<std::time::SystemTime>,
    started_before: Option<std::time::SystemTime>,
    template: Option<String>,
    limit: Option<usize>,
    after: Option<(u128, String)>,
}

impl ListQuery {
    fn parse(query_string: &str) -> Result<ListQuery, ApiError> {
        let pairs = query::parse(query_string);
        let states: Vec<String> = match query::get(&pairs, "state") {
            None => vec!["running".into(), "paused".into()],
            Some(v) => v.split(',').map(|s| s.trim().to_string()).collect(),
        };
        if states.iter().any(|s| s != "running" && s != "paused") {
            return Err(ApiError::bad_request(
                "state must be a comma-separated list of running and paused",
            ));
        }
        let ascending = query::choice(&pairs, "order", false, &[("desc", false), ("asc", true)])?;
        let after = match query::get(&pairs, "nextToken") {
            None => None,
            Some(t) => {
                Some(decode_token(t).ok_or_else(|| ApiError::bad_request("invalid nextToken"))?)
            }
        };
        let started_after = query::time(&pairs, "startedAfter")?;
        let started_before = query::time(&pairs, "startedBefore")?;
        Ok(ListQuery {
            metadata: query::get(&pairs, "metadata")
                .map(query::metadata_filter)
                .unwrap_or_default(),
            states,
            ascending,
            started_after,
            started_before,
            template: query::get(&pairs, "template").map(str::to_string),
            limit: query::limit(&pairs)?,
            after,
        })
    }

    fn matches(&self, i: &SandboxInfo) -> bool {
        i.state()
            .api_state()
            .is_some_and(|s| self.states.iter().any(|w| w == s))
            && metadata_matches(i, &self.metadata)
            && self.started_after.is_none_or(|t| i.started_at >= t)
            && self.started_before.is_none_or(|t| i.started_at <= t)
            && self.template.as_deref().is_none_or(|t| {
                i.settings.template_id == t || i.settings.alias.as_deref() == Some(t)
            })
    }

    /// Whether `key` comes after the page's cursor in the chosen order.
    fn past_cursor(&self, key: &(u128, String)) -> bool {
        match &self.after {
            None => true,
            Some(after) if self.ascending => key > after,
            Some(after) => key < after,
        }
    }
}

fn list_v2(ctx: &Context, query_string: &str) -> Result<Reply, ApiError> {
    let q = ListQuery::parse(query_string)?;
    let mut items: Vec<SandboxInfo> = ctx
        .orchestrator
        .list()
        .into_iter()
        .filter(|i| q.matches(i) && q.past_cursor(&list_key(i)))
        .collect();
    items.sort_by_key(list_key);
    if !q.ascending {
        items.reverse();
    }
    let mut headers = Vec::new();
    if let Some(limit) = q.limit {
        if items.len() > limit {
            items.truncate(limit);
            let last = items.last().expect("limit >= 1");
            headers.push(("X-Next-Token".to_string(), encode_token(&list_key(last))));
        }
    }
    let body = items
        .iter()
        .map(|i| models::listed_sandbox(i, envd(ctx)))
        .collect();
    Ok(Reply::Json {
        status: 200,
        body: Value::Array(body),
        headers,
    })
}

fn get_sandbox(ctx: &Context, id: &str) -> Result<Reply, ApiError> {
    let info = ctx.orchestrator.get(checked_id(id)?)?;
    Ok(Reply::json(200, models::sandbox_detail(&info, envd(ctx))))
}

fn delete_sandbox(ctx: &Context, id: &str) -> Result<Reply, ApiError> {
    let id = checked_id(id)?;
    ctx.orchestrator
        .handle(OrchRequest::Delete { id })?
        .into_done()?;
    Ok(Reply::Empty(204))
}

fn set_timeout(
    ctx: &Context,
    req: &mut Request,
    id: &str,
    change: ExpiryChange,
) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let id = checked_id(id)?;
    let default = ctx.orchestrator.config().sandbox.default_timeout_secs;
    let secs = match change {
        ExpiryChange::Set => f.int_in("timeout", 0..=MAX_TIMEOUT_SECS)?,
        ExpiryChange::AtLeast => f.int_in("duration", 0..=3600)?,
    }
    .unwrap_or(default);
    ctx.orchestrator
        .handle(OrchRequest::SetTimeout { id, secs, change })?
        .into_done()?;
    Ok(Reply::Empty(204))
}

/// `PUT /sandboxes/{id}/network` (network.md §5.6): 204 once applied.
fn set_network(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let id = checked_id(id)?;
    let (policy, internet) = super::network::update_policy(&f)?;
    ctx.orchestrator
        .handle(OrchRequest::SetNetwork {
            id,
            policy,
            allow_internet: internet,
        })?
        .into_done()?;
    Ok(Reply::Empty(204))
}

/// `connect` (timeout defaults to 300 s, expiry only extended) and `resume` (timeout
/// defaults to the server's, expiry reset).
fn connect(
    ctx: &Context,
    req: &mut Request,
    id: &str,
    kind: ConnectKind,
) -> Result<Reply, ApiError> {
    let id = checked_id(id)?;
    // An unknown sandbox is 404 before any body check (api.md §4.10).
    ctx.orchestrator.get(id)?;
    let f = body(ctx, req)?;
    let default = match kind {
        ConnectKind::Connect => CONNECT_DEFAULT_TIMEOUT_SECS,
        ConnectKind::Resume => ctx.orchestrator.config().sandbox.default_timeout_secs,
    };
    let secs = f
        .int_in("timeout", 0..=MAX_TIMEOUT_SECS)?
        .unwrap_or(default);
    // `memory: false`: boot from the paused disk, whatever the pause kept.
    let from = PauseMode::with_memory(f.bool("memory")?.unwrap_or(true));
    let connected = ctx
        .orchestrator
        .handle(OrchRequest::Connect {
            id,
            secs,
            kind,
            from,
        })?
        .into_connected()?;
    // Resume answers 201 either way; connect answers 200 when it only extended the TTL.
    let status = if kind == ConnectKind::Connect && !connected.resumed {
        200
    } else {
        201
    };
    Ok(created(ctx, &connected.info, status))
}

/// `POST …/pause` with E2B's `memory` (`false`: filesystem-only) and
/// `requireHealthyGuest` (docs/e2b.md, "Filesystem-only pause").
fn pause(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let request = PauseRequest {
        mode: PauseMode::with_memory(f.bool("memory")?.unwrap_or(true)),
        require_healthy_guest: f.bool("requireHealthyGuest")?.unwrap_or(false),
    };
    let id = checked_id(id)?;
    ctx.orchestrator
        .handle(OrchRequest::Pause { id, request })?
        .into_done()?;
    Ok(Reply::Empty(204))
}

fn snapshot(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let name = f.str("name")?.map(str::to_string);
    let id = checked_id(id)?;
    let record = ctx
        .orchestrator
        .handle(OrchRequest::Snapshot { id, name })?
        .into_snapshot()?;
    Ok(Reply::json(201, models::snapshot_info(&record)))
}

fn fork(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let timeout = f.int_in("timeout", 0..=MAX_TIMEOUT_SECS)?;
    let count = f.int_in("count", 1..=100)?.unwrap_or(1) as u32;
    let id = checked_id(id)?;
    let children = ctx
        .orchestrator
        .handle(OrchRequest::Fork {
            id,
            count,
            timeout_secs: timeout,
        })?
        .into_forked()?;
    let entries = children
        .into_iter()
        .map(|child| match child {
            Ok(info) => json!({"sandbox": models::sandbox(&info, envd(ctx))}),
            Err(e) => {
                let e = ApiError::from(e);
                json!({"error": {"code": e.status, "message": e.message}})
            }
        })
        .collect();
    Ok(Reply::json(201, Value::Array(entries)))
}

fn list_snapshots(ctx: &Context, query_string: &str) -> Result<Reply, ApiError> {
    let pairs = query::parse(query_string);
    let limit = query::limit(&pairs)?;
    let sandbox = query::get(&pairs, "sandboxID");
    // A `team/` prefix and a `:tag` suffix are stripped from `name` (api.md §4.14).
    let name = query::get(&pairs, "name").map(|n| {
        let n = n.rsplit('/').next().unwrap_or(n);
        n.split(':').next().unwrap_or(n).to_string()
    });
    let after = query::get(&pairs, "nextToken")
        .map(|t| {
            crate::util::is_uuid(t)
                .then(|| t.to_string())
                .ok_or_else(|| ApiError::bad_request("invalid nextToken"))
        })
        .transpose()?;
    let mut items: Vec<_> = ctx
        .orchestrator
        .catalog()
        .snapshots()
        .into_iter()
        .filter(|r| sandbox.is_none_or(|s| r.sandbox_id == s))
        .filter(|r| name.as_deref().is_none_or(|n| r.name.as_deref() == Some(n)))
        .collect();
    items.sort_by(|a, b| b.id.cmp(&a.id));
    if let Some(after) = &after {
        items.retain(|r| r.id < *after);
    }
    let mut headers = Vec::new();
    if let Some(limit) = limit {
        if items.len() > limit {
            items.truncate(limit);
            headers.push(("X-Next-Token".to_string(), items[limit - 1].id.clone()));
        }
    }
    Ok(Reply::Json {
        status: 200,
        body: Value::Array(items.iter().map(models::snapshot_info).collect()),
        headers,
    })
}

fn get_snapshot(ctx: &Context, id_or_name: &str) -> Result<Reply, ApiError> {
    let record = ctx
        .orchestrator
        .catalog()
        .find_snapshot(id_or_name)
        .ok_or_else(|| ApiError::not_found(format!("snapshot {id_or_name} not found")))?;
    Ok(Reply::json(200, models::snapshot_info(&record)))
}

fn get_template(ctx: &Context, id_or_name: &str) -> Result<Reply, ApiError> {
    let (build, snapshot) = ctx
        .orchestrator
        .catalog()
        .find_template(id_or_name)
        .ok_or_else(|| ApiError::not_found(format!("template {id_or_name} not found")))?;
    let mut v = models::template(build.as_ref(), snapshot.as_ref(), envd(ctx));
    let standbys = snapshot
        .as_ref()
        .and_then(|s| ctx.orchestrator.catalog().standbys(s));
    if let Some((most, ready, target)) = standbys {
        v["standbys"] = json!({"max": most, "ready": ready, "target": target});
    }
    Ok(Reply::json(200, v))
}

/// `PATCH /templates/{idOrName}` `{"standbys": n}` (0..=16): the most warm standbys the
/// template keeps; answered with the template.
fn patch_template(ctx: &Context, req: &mut Request, id_or_name: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let standbys = f
        .int_in("standbys", 0..=16)?
        .ok_or_else(|| ApiError::unprocessable("missing required field standbys (0..=16)"))?;
    ctx.orchestrator
        .handle(OrchRequest::SetTemplateStandbys {
            id_or_name,
            standbys: standbys as u32,
        })
        .and_then(|r| r.into_done())?;
    get_template(ctx, id_or_name)
}

fn list_templates(ctx: &Context) -> Result<Reply, ApiError> {
    let list = ctx
        .orchestrator
        .catalog()
        .templates()
        .iter()
        .map(|(b, s)| models::template(Some(b), s.as_ref(), envd(ctx)))
        .collect();
    Ok(Reply::json(200, Value::Array(list)))
}

fn create_template(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let name = f.required_str("name")?.to_string();
    let image = f.required_str("image")?.trim().to_string();
    if image.is_empty() {
        return Err(ApiError::bad_request("image must not be empty"));
    }
    let resources = resources(ctx, &f)?;
    let start_cmd = f.str("startCmd")?.map(str::to_string);
    let env_vars = f.string_map("envVars")?;
    check_env("envVars", &env_vars)?;
    let build = ctx
        .orchestrator
        .handle(OrchRequest::SubmitTemplate(TemplateRequest {
            name,
            image,
            resources,
            start_cmd,
            env_vars,
            catalog: None,
        }))?
        .into_build()?;
    Ok(Reply::json(
        202,
        models::template(Some(&build), None, envd(ctx)),
    ))
}

/// `DELETE /templates/{idOrName}`; on a cluster node, on every node (docs/cluster.md):
/// 204 when any node had it.
fn delete_template(ctx: &Context, req: &Request, id_or_name: &str) -> Result<Reply, ApiError> {
    let here = ctx
        .orchestrator
        .handle(OrchRequest::DeleteTemplate { id_or_name })
        .and_then(|r| r.into_done());
    let here = match here {
        Err(e) if e.status() != 404 => return Err(e.into()),
        other => other,
    };
    let there = everywhere::echo(ctx, req, &[], Body::Empty, everywhere::CALL_TIMEOUT);
    match here {
        Err(_) if there.iter().any(|(_, r)| r.is_ok()) => Ok(Reply::Empty(204)),
        Err(e) => Err(e.into()),
        Ok(()) => Ok(Reply::Empty(204)),
    }
}

fn get_params(ctx: &Context, id: &str) -> Result<Reply, ApiError> {
    let params = ctx
        .orchestrator
        .observe()
        .custom_extension_params(checked_id(id)?)?;
    Ok(Reply::json(200, params))
}

fn patch_params(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let id = checked_id(id)?;
    let params = ctx
        .orchestrator
        .handle(OrchRequest::PatchParams {
            id,
            patch: Value::Object(f.0),
        })?
        .into_params()?;
    Ok(Reply::json(200, params))
}

fn run_command(ctx: &Context, req: &mut Request, id: &str) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let cmd = f.required_str("cmd")?.to_string();
    if cmd.is_empty() || cmd.contains('\0') {
        return Err(ApiError::bad_request(
            "cmd must be a non-empty string without NUL",
        ));
    }
    let args = f.string_list("args")?;
    if args.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::bad_request("args must not contain NUL"));
    }
    let env = f.string_map("env")?;
    check_env("env", &env)?;
    let cwd = f.str("cwd")?.unwrap_or("/").to_string();
    if !cwd.starts_with('/') || cwd.contains('\0') {
        return Err(ApiError::bad_request("cwd must be an absolute path"));
    }
    let timeout_ms = f.int_in("timeoutMs", 1..=600_000)?.unwrap_or(60_000);
    let command = CommandRequest {
        cmd,
        args,
        env,
        cwd,
        timeout_ms,
    };
    let id = checked_id(id)?;
    let result = ctx
        .orchestrator
        .handle(OrchRequest::RunCommand { id, command })?
        .into_command()?;
    let body = serde_json::to_value(result).map_err(|e| ApiError::new(500, e.to_string()))?;
    Ok(Reply::json(200, body))
}

/// `GET /sandboxes/{id}/logs?lines=N`: the end of the guest console (api.md §4.20).
fn console_log(ctx: &Context, id: &str, query_string: &str) -> Result<Reply, ApiError> {
    let pairs = query::parse(query_string);
    let lines = match query::get(&pairs, "lines") {
        None => 200,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=10_000).contains(n))
            .ok_or_else(|| ApiError::bad_request("lines must be an integer in 1..=10000"))?,
    };
    let mut text = ctx
        .orchestrator
        .observe()
        .console_tail(checked_id(id)?, lines)?;
    if !text.is_empty() {
        text.push('\n');
    }
    Ok(Reply::Text {
        content_type: "text/plain; charset=utf-8",
        body: text,
    })
}

/// The `path` query parameter of the files endpoints.
fn file_path(query_string: &str) -> Result<String, ApiError> {
    let pairs = query::parse(query_string);
    let path = query::get(&pairs, "path")
        .ok_or_else(|| ApiError::bad_request("query parameter path is required"))?;
    if !path.starts_with('/') || path.contains('\0') {
        return Err(ApiError::bad_request(
            "path must be an absolute path without NUL",
        ));
    }
    Ok(path.to_string())
}

fn download(ctx: &Context, id: &str, query_string: &str) -> Result<Reply, ApiError> {
    let path = file_path(query_string)?;
    let id = checked_id(id)?;
    let file = ctx
        .orchestrator
        .handle(OrchRequest::ReadFile { id, path: &path })?
        .into_file()?;
    let length = file.size();
    Ok(Reply::Stream {
        reader: Box::new(file),
        length,
    })
}

fn upload(
    ctx: &Context,
    req: &mut Request,
    id: &str,
    query_string: &str,
) -> Result<Reply, ApiError> {
    let limit = ctx.orchestrator.config().agent.max_upload_bytes;
    let too_large = || {
        ApiError::new(
            413,
            format!("upload exceeds {limit} bytes (agent.max_upload_bytes)"),
        )
    };
    if req.body_length().is_some_and(|n| n as u64 > limit) {
        return Err(too_large());
    }
    let path = file_path(query_string)?;
    let id = checked_id(id)?;
    ctx.orchestrator.get(id)?;
    match req.body_length() {
        Some(len) => {
            let mut body = req.as_reader().take(len as u64);
            write_file(ctx, id, &path, len as u64, &mut body)?;
        }
        None => {
            // Chunked upload: the agent needs the length first, so buffer it (bounded).
            let mut buf = Vec::new();
            req.as_reader()
                .take(limit + 1)
                .read_to_end(&mut buf)
                .map_err(|e| ApiError::bad_request(format!("cannot read upload: {e}")))?;
            if buf.len() as u64 > limit {
                return Err(too_large());
            }
            write_file(ctx, id, &path, buf.len() as u64, &mut buf.as_slice())?;
        }
    }
    Ok(Reply::Empty(204))
}

fn write_file(
    ctx: &Context,
    id: &str,
    path: &str,
    len: u64,
    body: &mut dyn Read,
) -> Result<(), ApiError> {
    let write = OrchRequest::WriteFile {
        id,
        path,
        len,
        body,
    };
    Ok(ctx.orchestrator.handle(write)?.into_done()?)
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (E2B's sandbox metrics, api.md §4.21): the
/// samples of what the guest saw of its CPU, memory and root disk, taken every
/// `[metrics] sandbox_interval_secs` while it ran, within `[start, end]` (unix seconds;
/// default: the whole life kept).
fn sandbox_metrics(ctx: &Context, id: &str, query_string: &str) -> Result<Reply, ApiError> {
    let id = checked_id(id)?;
    let pairs = query::parse(query_string);
    let start = query::unix_seconds(&pairs, "start")?.unwrap_or(0);
    let end = query::unix_seconds(&pairs, "end")?.unwrap_or(u64::MAX);
    if start > end {
        return Err(ApiError::bad_request(format!(
            "start ({start}) must not be after end ({end})"
        )));
    }
    let samples = ctx.orchestrator.observe().sandbox_metrics(id, start, end)?;
    let body: Vec<Value> = samples.iter().map(models::sandbox_metric).collect();
    Ok(Reply::json(200, Value::Array(body)))
}

/// Entries one `GET /v2/sandboxes/{id}/logs` returns at most (E2B's default limit).
const MAX_LOG_ENTRIES: usize = 1000;
/// The longest `search` text.
const MAX_LOG_SEARCH: usize = 256;

/// `GET /v2/sandboxes/{id}/logs?cursor=&limit=&direction=&level=&search=` (E2B's
/// sandbox logs, api.md §4.26): `{"logs": [{timestamp, message, level, fields}]}`.
fn sandbox_log(ctx: &Context, id: &str, query_string: &str) -> Result<Reply, ApiError> {
    use crate::orchestrator::sandbox_log::LogQuery;
    let id = checked_id(id)?;
    let pairs = query::parse(query_string);
    let cursor = query::get(&pairs, "cursor")
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                ApiError::bad_request(format!("cursor must be unix milliseconds (got {v:?})"))
            })
        })
        .transpose()?;
    let limit = query::limit_within(&pairs, MAX_LOG_ENTRIES)?.unwrap_or(MAX_LOG_ENTRIES);
    let backward = query::backward(&pairs)?;
    let min_level = query::min_level(&pairs)?;
    let search = query::get(&pairs, "search").map(str::to_string);
    if search.as_ref().is_some_and(|s| s.len() > MAX_LOG_SEARCH) {
        return Err(ApiError::bad_request(format!(
            "search must be at most {MAX_LOG_SEARCH} bytes"
        )));
    }
    let q = LogQuery {
        cursor,
        limit,
        backward,
        min_level,
        search,
    };
    let entries = ctx.orchestrator.observe().sandbox_log(id, &q)?;
    let logs: Vec<Value> = entries.iter().map(models::log_entry).collect();
    Ok(Reply::json(200, json!({ "logs": logs })))
}

/// Sandboxes one call may ask about (E2B's limit).
const MAX_METRICS_IDS: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest sample of each listed sandbox
/// that has one, as `{"sandboxes": {id: metric}}` (api.md §4.21); on a cluster node those
/// of other nodes' sandboxes asked of their owners (`merged::peer_metrics`).
fn several_sandbox_metrics(
    ctx: &Context,
    req: &Request,
    query_string: &str,
) -> Result<Reply, ApiError> {
    let pairs = query::parse(query_string);
    let ids: Vec<String> = query::get(&pairs, "sandbox_ids")
        .ok_or_else(|| ApiError::bad_request("sandbox_ids is required (a comma-separated list)"))?
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if ids.is_empty() || ids.len() > MAX_METRICS_IDS {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids must name 1..={MAX_METRICS_IDS} sandboxes (got {})",
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|id| !is_sandbox_id(id)) {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids: {bad:?} is not a sandbox id"
        )));
    }
    let mut found: serde_json::Map<String, Value> = ctx
        .orchestrator
        .observe()
        .latest_metrics(&ids)
        .iter()
        .map(|(id, sample)| (id.clone(), models::sandbox_metric(sample)))
        .collect();
    found.extend(merged::peer_metrics(ctx, req, &ids));
    Ok(Reply::json(200, json!({ "sandboxes": found })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn document() -> Value {
        serde_json::from_str(OPENAPI).expect("docs/openapi.json is JSON")
    }

    #[test]
    fn request_host_masks() {
        for good in [
            "${PORT}-app.example.com",
            "app.example.com:8443",
            "x",
            "${PORT}",
        ] {
            assert!(check_mask(good).is_ok(), "{good}");
        }
        let long = "a".repeat(254);
        for bad in [
            "",
            "a b",
            "a\r\nX: y",
            "${HOST}.example.com",
            "é.example",
            long.as_str(),
        ] {
            assert!(check_mask(bad).is_err(), "{bad:?}");
        }
    }

    /// Every routed method and path is in docs/openapi.json, and nothing else is.
    #[test]
    fn openapi_documents_exactly_the_routes() {
        let doc = document();
        assert_eq!(doc["openapi"], "3.1.0");
        let mut documented = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
        let routed: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|r| (r.method.as_str().to_string(), r.path.to_string()))
            .collect();
        assert_eq!(routed.len(), ROUTES.len(), "a route is in the table twice");
        let missing: Vec<_> = routed.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&routed).collect();
        assert!(missing.is_empty(), "routed but not documented: {missing:?}");
        assert!(extra.is_empty(), "documented but not routed: {extra:?}");
    }

    /// Each path variable is declared as a path parameter, and every `$ref` resolves.
    #[test]
    fn openapi_parameters_and_refs_resolve() {
        let doc = document();
        for (path, item) in doc["paths"].as_object().unwrap() {
            let vars: BTreeSet<&str> = path
                .split('/')
                .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
                .collect();
            for (method, op) in item.as_object().unwrap() {
                let declared: BTreeSet<&str> = op["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["in"] == "path")
                    .map(|p| p["name"].as_str().unwrap())
                    .collect();
                assert_eq!(vars, declared, "{method} {path}");
                assert!(op["operationId"].is_string(), "{method} {path}");
            }
        }
        fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
            match v {
                Value::Object(m) => {
                    if let Some(Value::String(r)) = m.get("$ref") {
                        out.push(r);
                    }
                    m.values().for_each(|v| refs(v, out));
                }
                Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
                _ => {}
            }
        }
        let mut all = Vec::new();
        refs(&doc, &mut all);
        assert!(!all.is_empty());
        for r in all {
            let pointer = r.strip_prefix('#').expect("local $ref");
            assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
        }
    }

    #[test]
    fn routes_match_paths_and_list_allowed_methods() {
        let id = "01900000-0000-7000-8000-000000000000";
        let pause = format!("/sandboxes/{id}/pause");
        let (route, var) = find(&Method::Post, &pause).ok().unwrap();
        assert_eq!(
            (route.path, var),
            ("/sandboxes/{sandboxID}/pause", [id, ""])
        );
        assert_eq!(
            find(&Method::Get, "/v2/sandboxes").ok().unwrap().1,
            ["", ""]
        );
        let (route, vars) = find(&Method::Get, "/templates/t1/builds/b1/status").unwrap();
        assert_eq!(
            (route.path, vars),
            (
                "/templates/{templateID}/builds/{buildID}/status",
                ["t1", "b1"]
            )
        );
        let (route, _) = find(&Method::Delete, "/templates/tags").unwrap();
        assert_eq!(
            route.path, "/templates/tags",
            "fixed paths before /templates/{{idOrName}}"
        );
        assert_eq!(
            find(&Method::Put, &format!("/sandboxes/{id}"))
                .err()
                .unwrap(),
            vec!["GET", "DELETE"]
        );
        assert!(find(&Method::Get, &format!("/sandboxes/{id}/nope"))
            .err()
            .unwrap()
            .is_empty());
        assert!(find(&Method::Get, "/health/x").err().unwrap().is_empty());
        assert!(find(&Method::Get, "/").err().unwrap().is_empty());
    }

    #[test]
    fn next_token_round_trip() {
        let key = (1_234_567u128, crate::util::new_id());
        assert_eq!(decode_token(&encode_token(&key)), Some(key));
        assert_eq!(decode_token("zz"), None);
        assert_eq!(decode_token("abc"), None);
        assert_eq!(decode_token(&crate::util::hex(b"12:not-a-uuid")), None);
    }
}
