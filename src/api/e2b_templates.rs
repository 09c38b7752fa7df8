//! E2B's template build API, as the pinned SDKs call it (docs/api.md §4.15.1): request a
//! build, upload its COPY files, start it with its steps, follow its status and logs,
//! aliases and tags. The builds themselves are the orchestrator's (`templates.rs`).

use super::body::Fields;
use super::everywhere::{self, BUILD_ID, CALL_TIMEOUT, TEMPLATE_ID, UPLOAD_TIMEOUT};
use super::routes::{body, resources, Target};
use super::{models, ApiError, Context, Reply};
use crate::cluster::client::Body;
use crate::orchestrator::{
    steps, BuildStatus, CatalogTemplate, LogEntry, LogLevel, Request as OrchRequest, TemplateBuild,
};
use crate::util::rfc3339;
use serde_json::{json, Value};
use tiny_http::Request;

/// Most log entries one status or logs answer carries (E2B: 100).
const DEFAULT_LOG_LIMIT: usize = 100;

/// `POST /v3/templates`: `{name: "alias[:tag]", tags, cpuCount, memoryMB}` → 202.
pub fn request_build(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let full = match (f.str("name")?, f.str("alias")?) {
        (Some(n), _) | (None, Some(n)) => n.to_string(),
        (None, None) => return Err(ApiError::bad_request("name is required")),
    };
    let (name, tag) = match full.split_once(':') {
        Some((n, t)) => (n.to_string(), Some(t.to_string())),
        None => (full.clone(), None),
    };
    if !crate::orchestrator::valid_template_name(&name) {
        return Err(ApiError::bad_request(format!(
            "name {name:?} must match [A-Za-z0-9_-]{{1,128}} and must not look like a UUID"
        )));
    }
    let mut tags = f.string_list("tags")?;
    tags.extend(tag);
    if let Some(bad) = tags.iter().find(|t| !crate::orchestrator::valid_tag(t)) {
        return Err(ApiError::bad_request(format!(
            "tag {bad:?} must match [A-Za-z0-9_.-]{{1,128}}"
        )));
    }
    let resources = resources(ctx, &f)?;
    let ids = everywhere::build_ids(req)?;
    let (t, build) = ctx
        .orchestrator
        .handle(OrchRequest::RequestBuild {
            name: &name,
            tags: tags.clone(),
            resources,
            ids,
        })?
        .into_new_build()?;
    let ids = [(TEMPLATE_ID, t.id.as_str()), (BUILD_ID, build.id.as_str())];
    let body = Value::Object(f.0).to_string();
    everywhere::echo(ctx, req, &ids, Body::Json(body.as_bytes()), CALL_TIMEOUT);
    if tags.is_empty() {
        tags.push(crate::orchestrator::DEFAULT_TAG.to_string());
    }
    Ok(Reply::json(
        202,
        json!({
            "templateID": t.id,
            "buildID": build.id,
            "public": false,
            "names": [t.name],
            "aliases": [t.name],
            "tags": tags,
        }),
    ))
}

/// The catalog template a path's `{templateID}` names (id or name).
fn template(ctx: &Context, id: &str) -> Result<CatalogTemplate, ApiError> {
    ctx.orchestrator
        .catalog()
        .catalog_template(id)
        .ok_or_else(|| ApiError::not_found(format!("template {id} not found")))
}

/// `GET /templates/{templateID}/files/{hash}`: `present`, or where to `PUT` the tar.
pub fn upload_link(ctx: &Context, req: &Request, t: &Target) -> Result<Reply, ApiError> {
    let tpl = template(ctx, t.var)?;
    let hash = t.var2;
    if !steps::valid_hash(hash) {
        return Err(ApiError::bad_request(
            "hash must be 64 lowercase hex digits",
        ));
    }
    if ctx.orchestrator.catalog().files_present(hash) {
        return Ok(Reply::json(201, json!({"present": true})));
    }
    let token = ctx
        .orchestrator
        .handle(OrchRequest::GrantUpload { hash })?
        .into_upload_token()?;
    let url = format!(
        "{}/templates/{}/files/{hash}?token={token}",
        base_url(req),
        tpl.id
    );
    Ok(Reply::json(201, json!({"present": false, "url": url})))
}

/// The URL clients reach this server at: `Host` (and `X-Forwarded-Proto` from a TLS
/// proxy in front).
fn base_url(req: &Request) -> String {
    let header = |name: &'static str| {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.as_str().to_string())
    };
    let scheme = match header("X-Forwarded-Proto").as_deref() {
        Some("https") => "https",
        _ => "http",
    };
    format!(
        "{scheme}://{}",
        header("Host").unwrap_or_else(|| "localhost".into())
    )
}

/// `PUT /templates/{templateID}/files/{hash}?token=`: the upload link (no API key: the
/// token of the link is the credential).
pub fn upload(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let hash = t.var2;
    let pairs = super::query::parse(t.query);
    let token = super::query::get(&pairs, "token").unwrap_or_default();
    if !steps::valid_hash(hash) || !ctx.orchestrator.catalog().check_upload(hash, token) {
        return Err(ApiError::new(
            403,
            "the upload link is invalid or expired: ask GET /templates/{templateID}/files/{hash} again",
        ));
    }
    let limit = ctx.orchestrator.catalog().max_upload_bytes();
    if req.body_length().is_some_and(|n| n as u64 > limit) {
        return Err(ApiError::new(
            413,
            format!("the upload exceeds {limit} bytes ([templates] max_upload_bytes)"),
        ));
    }
    let body = req.as_reader();
    ctx.orchestrator
        .handle(OrchRequest::ReceiveFiles { hash, body })?
        .into_done()?;
    if let Some(tar) = ctx.orchestrator.catalog().files_tar(hash) {
        everywhere::echo(ctx, req, &[], Body::File(&tar), UPLOAD_TIMEOUT);
    }
    Ok(Reply::Empty(201))
}

/// `POST /v2/templates/{templateID}/builds/{buildID}`: the steps; 202, the build runs.
pub fn start_build(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let f: Fields = body(ctx, req)?;
    let steps = Value::Object(f.0);
    let spec = steps::parse_spec(&steps).map_err(ApiError::bad_request)?;
    ctx.orchestrator
        .handle(OrchRequest::StartBuild {
            template_id: t.var,
            build_id: t.var2,
            spec,
        })?
        .into_done()?;
    let body = steps.to_string();
    everywhere::echo(ctx, req, &[], Body::Json(body.as_bytes()), CALL_TIMEOUT);
    Ok(Reply::Empty(202))
}

/// A build of the template a path names.
fn build_of(ctx: &Context, t: &Target) -> Result<TemplateBuild, ApiError> {
    let tpl_id = ctx
        .orchestrator
        .catalog()
        .catalog_template(t.var)
        .map(|c| c.id)
        .unwrap_or_else(|| t.var.to_string());
    ctx.orchestrator
        .catalog()
        .build(t.var2)
        .filter(|b| b.catalog.as_ref().is_some_and(|c| c.template_id == tpl_id))
        .ok_or_else(|| {
            ApiError::not_found(format!("build {} of template {} not found", t.var2, t.var))
        })
}

fn entry(e: &LogEntry) -> Value {
    let mut v = json!({
        "timestamp": rfc3339(e.timestamp),
        "level": e.level.as_str(),
        "message": e.message,
    });
    if let Some(s) = &e.step {
        v["step"] = json!(s);
    }
    v
}

fn number(q: &[(String, String)], key: &str) -> Result<Option<u64>, ApiError> {
    super::query::get(q, key)
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("{key} must be a non-negative integer")))
        })
        .transpose()
}

/// `GET /templates/{templateID}/builds/{buildID}/status?logsOffset=&limit=&level=`.
pub fn build_status(ctx: &Context, t: &Target) -> Result<Reply, ApiError> {
    let b = build_of(ctx, t)?;
    let q = super::query::parse(t.query);
    let offset = number(&q, "logsOffset")?.unwrap_or(0) as usize;
    let limit = number(&q, "limit")?.map_or(DEFAULT_LOG_LIMIT, |l| l.clamp(1, 100) as usize);
    let min = super::query::min_level(&q)?;
    let entries: Vec<Value> = b
        .log_entries()
        .iter()
        .skip(offset)
        .filter(|e| e.level >= min)
        .take(limit)
        .map(entry)
        .collect();
    let tpl_id = b
        .catalog
        .as_ref()
        .map(|c| c.template_id.clone())
        .unwrap_or_default();
    let mut v = json!({
        "templateID": tpl_id,
        "buildID": b.id,
        "status": b.status.as_str(),
        "logs": [],
        "logEntries": entries,
    });
    if b.status == BuildStatus::Error {
        let message = b
            .reason
            .clone()
            .unwrap_or_else(|| "the build failed".into());
        let mut reason = json!({"message": message});
        let step = b
            .log_entries()
            .iter()
            .rev()
            .find(|e| e.level == LogLevel::Error)
            .and_then(|e| e.step.clone());
        if let Some(s) = step {
            reason["step"] = json!(s);
        }
        v["reason"] = reason;
    }
    Ok(Reply::json(200, v))
}

/// `GET /templates/{templateID}/builds/{buildID}/logs?cursor=&limit=&direction=&level=`:
/// `cursor` is a time in Unix milliseconds (entries from it on, or up to it backward).
pub fn build_logs(ctx: &Context, t: &Target) -> Result<Reply, ApiError> {
    let b = build_of(ctx, t)?;
    let q = super::query::parse(t.query);
    let cursor = number(&q, "cursor")?;
    let limit = number(&q, "limit")?.map_or(DEFAULT_LOG_LIMIT, |l| l.clamp(1, 100) as usize);
    let min = super::query::min_level(&q)?;
    let backward = super::query::backward(&q)?;
    let ms = |e: &LogEntry| {
        e.timestamp
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let mut all: Vec<LogEntry> = b
        .log_entries()
        .into_iter()
        .filter(|e| e.level >= min)
        .filter(|e| match cursor {
            None => true,
            Some(c) if backward => ms(e) <= c,
            Some(c) => ms(e) >= c,
        })
        .collect();
    if backward {
        all.reverse();
    }
    let logs: Vec<Value> = all.iter().take(limit).map(entry).collect();
    Ok(Reply::json(200, json!({"logs": logs})))
}

/// `GET /templates/aliases/{alias}`: 200 with the template, 404 when no template has it.
pub fn alias(ctx: &Context, t: &Target) -> Result<Reply, ApiError> {
    let tpl = ctx
        .orchestrator
        .catalog()
        .catalog_template(t.var)
        .filter(|c| c.name == t.var)
        .ok_or_else(|| ApiError::not_found(format!("template alias {} not found", t.var)))?;
    Ok(Reply::json(
        200,
        json!({"templateID": tpl.id, "public": false}),
    ))
}

/// `POST /templates/tags`: `{target: "name:tag", tags}` → 201 `{buildID, tags}`.
pub fn assign_tags(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let target = f.required_str("target")?.to_string();
    let tags = tag_list(&f)?;
    let build = ctx
        .orchestrator
        .handle(OrchRequest::AssignTags {
            target: &target,
            tags: &tags,
        })?
        .into_tagged()?;
    let body = json!({"target": target, "tags": tags}).to_string();
    everywhere::echo(ctx, req, &[], Body::Json(body.as_bytes()), CALL_TIMEOUT);
    Ok(Reply::json(201, json!({"buildID": build, "tags": tags})))
}

fn tag_list(f: &Fields) -> Result<Vec<String>, ApiError> {
    let tags = f.string_list("tags")?;
    if tags.is_empty() {
        return Err(ApiError::bad_request("tags must name at least one tag"));
    }
    if let Some(bad) = tags.iter().find(|t| !crate::orchestrator::valid_tag(t)) {
        return Err(ApiError::bad_request(format!(
            "tag {bad:?} must match [A-Za-z0-9_.-]{{1,128}}"
        )));
    }
    Ok(tags)
}

/// `DELETE /templates/tags`: `{name, tags}` → 204.
pub fn remove_tags(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let f = body(ctx, req)?;
    let name = f.required_str("name")?.to_string();
    let tags = tag_list(&f)?;
    ctx.orchestrator
        .handle(OrchRequest::RemoveTags {
            name: &name,
            tags: &tags,
        })?
        .into_done()?;
    let body = json!({"name": name, "tags": tags}).to_string();
    everywhere::echo(ctx, req, &[], Body::Json(body.as_bytes()), CALL_TIMEOUT);
    Ok(Reply::Empty(204))
}

/// `GET /templates/{templateID}/tags`: `[{tag, buildID, createdAt}]`.
pub fn tags(ctx: &Context, t: &Target) -> Result<Reply, ApiError> {
    let tpl = template(ctx, t.var)?;
    let list: Vec<Value> = tpl
        .tags
        .iter()
        .map(|(tag, target)| {
            json!({"tag": tag, "buildID": target.build_id, "createdAt": rfc3339(target.created_at)})
        })
        .collect();
    Ok(Reply::json(200, Value::Array(list)))
}

/// `GET /v2/templates`: every template, E2B's `Template` each.
pub fn list(ctx: &Context) -> Result<Reply, ApiError> {
    let envd = &ctx.orchestrator.config().api.envd_version;
    let mut list: Vec<Value> = ctx
        .orchestrator
        .catalog()
        .catalog_templates()
        .iter()
        .map(|(t, snap)| models::catalog_template(t, snap.as_ref(), envd))
        .collect();
    list.extend(
        ctx.orchestrator
            .catalog()
            .templates()
            .iter()
            .map(|(b, s)| models::template(Some(b), s.as_ref(), envd)),
    );
    Ok(Reply::json(200, Value::Array(list)))
}
