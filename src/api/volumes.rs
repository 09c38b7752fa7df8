//! E2B volumes (api.md §4.27) and their content API (§4.28): `/volumes` with the API
//! key, `/volumecontent/{volumeID}/…` with the volume's token (`Authorization: Bearer`,
//! as the SDKs send it; the API key is taken too).

use super::body::Fields;
use super::routes::{body, Target};
use super::{query, ApiError, Context, Reply};
use crate::orchestrator::{OrchError, Request as OrchRequest, VolumeMount};
use crate::util::{constant_time_eq, rfc3339};
use crate::volume::content::{Entry, Meta, Tree, VolumePath, MAX_DEPTH};
use crate::volume::{Volume, VolumeError, VolumeRecord};
use serde_json::{json, Value};
use std::io::Read;
use std::sync::Arc;
use tiny_http::Request;

/// Whether `path` is the content API's: it carries the volume's token instead of the API
/// key (checked by its handlers).
pub fn is_content(path: &str) -> bool {
    path.starts_with("/volumecontent/")
}

fn with_token(r: &VolumeRecord) -> Value {
    json!({"volumeID": r.id, "name": r.name, "token": r.token, "sizeMB": r.size_mb})
}

/// `POST /volumes` `{name, sizeMB?}` → 201 with the volume's token.
pub fn create(ctx: &Context, req: &mut Request) -> Result<Reply, ApiError> {
    let fields = body(ctx, req)?;
    let name = fields
        .str("name")?
        .ok_or_else(|| ApiError::bad_request("name: a volume needs a name"))?;
    let size = fields.int_in("sizeMB", 1..=u64::from(u32::MAX))?;
    let record = ctx
        .orchestrator
        .handle(OrchRequest::CreateVolume {
            name,
            size_mb: size,
        })?
        .into_volume()?;
    Ok(Reply::json(201, with_token(&record)))
}

pub fn list(ctx: &Context) -> Result<Reply, ApiError> {
    let volumes: Vec<Value> = ctx
        .orchestrator
        .catalog()
        .list_volumes()
        .iter()
        .map(|r| json!({"volumeID": r.id, "name": r.name, "sizeMB": r.size_mb}))
        .collect();
    Ok(Reply::json(200, Value::Array(volumes)))
}

pub fn get(ctx: &Context, id: &str) -> Result<Reply, ApiError> {
    let volume = ctx.orchestrator.catalog().volume(id)?;
    Ok(Reply::json(200, with_token(&volume.record)))
}

pub fn delete(ctx: &Context, id: &str) -> Result<Reply, ApiError> {
    ctx.orchestrator
        .handle(OrchRequest::DeleteVolume { id })?
        .into_done()?;
    Ok(Reply::Empty(204))
}

/// The volume a content request names, once its token (or the API key) checks out. The
/// credentials are checked before anything else of the request, and a caller with
/// neither learns nothing (not even whether the volume exists).
fn authorized(ctx: &Context, req: &Request, id: &str) -> Result<Arc<Volume>, ApiError> {
    let header = |name: &'static str| {
        req.headers()
            .iter()
            .find(|h| h.field.equiv(name))
            .map(|h| h.value.as_str().to_string())
    };
    let refused = || {
        ApiError::new(
            401,
            "missing or invalid volume token: send Authorization: Bearer <the volume's token>",
        )
    };
    let key =
        header("X-API-Key").is_some_and(|k| constant_time_eq(k.as_bytes(), ctx.api_key.as_bytes()));
    if key {
        return Ok(ctx.orchestrator.catalog().volume(id)?);
    }
    let bearer = header("Authorization")
        .and_then(|v| v.strip_prefix("Bearer ").map(str::to_string))
        .ok_or_else(refused)?;
    let volume = ctx
        .orchestrator
        .catalog()
        .volume(id)
        .map_err(|_| refused())?;
    if constant_time_eq(bearer.as_bytes(), volume.record.token.as_bytes()) {
        Ok(volume)
    } else {
        Err(refused())
    }
}

fn entry(e: &Entry) -> Value {
    let mut v = json!({
        "name": e.name,
        "type": e.kind.as_str(),
        "path": e.path,
        "size": e.size,
        "mode": e.mode,
        "uid": e.uid,
        "gid": e.gid,
        "atime": rfc3339(e.atime),
        "mtime": rfc3339(e.mtime),
        "ctime": rfc3339(e.ctime),
    });
    if let Some(t) = &e.target {
        v["target"] = json!(t);
    }
    v
}

/// The request's `path`, checked (400 naming it).
fn path_of(pairs: &[(String, String)]) -> Result<VolumePath, ApiError> {
    let raw = query::get(pairs, "path")
        .ok_or_else(|| ApiError::bad_request("path: query parameter path is required"))?;
    Ok(VolumePath::parse(raw).map_err(OrchError::from)?)
}

fn number(pairs: &[(String, String)], key: &str, max: u32) -> Result<Option<u32>, ApiError> {
    query::get(pairs, key)
        .map(|v| match v.parse::<u32>() {
            Ok(n) if n <= max => Ok(n),
            _ => Err(ApiError::bad_request(format!(
                "{key}: must be an integer within 0..={max} (got {v:?})"
            ))),
        })
        .transpose()
}

fn flag(pairs: &[(String, String)], key: &str) -> Result<bool, ApiError> {
    query::choice(pairs, key, false, &[("true", true), ("false", false)])
}

fn meta_of(pairs: &[(String, String)]) -> Result<Meta, ApiError> {
    Ok(Meta {
        uid: number(pairs, "uid", u32::MAX - 1)?,
        gid: number(pairs, "gid", u32::MAX - 1)?,
        mode: number(pairs, "mode", 0o7777)?,
    })
}

/// Runs `op` on the mounted tree of a volume the request was authorized for.
fn on_tree<T>(
    volume: &Volume,
    op: impl FnOnce(&Tree) -> Result<T, VolumeError>,
) -> Result<T, ApiError> {
    let mounted = volume.mounted().map_err(OrchError::from)?;
    let tree = mounted.tree();
    Ok(op(&tree).map_err(OrchError::from)?)
}

/// `GET /volumecontent/{id}/path?path=`: what the entry is.
pub fn stat(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let path = path_of(&pairs)?;
    let e = on_tree(&volume, |tree| tree.stat(&path))?;
    Ok(Reply::json(200, entry(&e)))
}

/// `GET /volumecontent/{id}/dir?path=&depth=`: the entries under a directory.
pub fn list_dir(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let path = path_of(&pairs)?;
    let depth = number(&pairs, "depth", MAX_DEPTH)?.unwrap_or(1).max(1);
    let entries = on_tree(&volume, |tree| tree.list(&path, depth))?;
    Ok(Reply::json(
        200,
        Value::Array(entries.iter().map(entry).collect()),
    ))
}

/// `POST /volumecontent/{id}/dir?path=&uid=&gid=&mode=&force=`: 201 with the new
/// directory; `force` makes its missing parents.
pub fn make_dir(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let (path, meta, force) = (path_of(&pairs)?, meta_of(&pairs)?, flag(&pairs, "force")?);
    let e = on_tree(&volume, |tree| tree.make_dir(&path, meta, force))?;
    Ok(Reply::json(201, entry(&e)))
}

/// `GET /volumecontent/{id}/file?path=`: the file's bytes.
pub fn read(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let path = path_of(&pairs)?;
    let (file, length) = on_tree(&volume, |tree| tree.read(&path))?;
    Ok(Reply::Stream {
        reader: Box::new(file),
        length,
    })
}

/// `PUT /volumecontent/{id}/file?path=&uid=&gid=&mode=&force=`: the body becomes the file
/// (created or overwritten); 201 with what it is now. `force` makes missing parents.
pub fn write(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let (path, meta, force) = (path_of(&pairs)?, meta_of(&pairs)?, flag(&pairs, "force")?);
    let mounted = volume.mounted().map_err(OrchError::from)?;
    let length = req.body_length();
    let mut reader: Box<dyn Read> = match length {
        Some(n) => Box::new(req.as_reader().take(n as u64)),
        None => Box::new(req.as_reader()),
    };
    let e = mounted
        .tree()
        .write(&path, &mut reader, meta, force)
        .map_err(OrchError::from)?;
    Ok(Reply::json(201, entry(&e)))
}

/// `PATCH /volumecontent/{id}/path?path=` `{uid?, gid?, mode?}`.
pub fn set_meta(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let path = path_of(&pairs)?;
    let fields = body(ctx, req)?;
    let id = |k| {
        fields
            .int_in(k, 0..=u64::from(u32::MAX - 1))
            .map(|v| v.map(|n| n as u32))
    };
    let meta = Meta {
        uid: id("uid")?,
        gid: id("gid")?,
        mode: fields.int_in("mode", 0..=0o7777)?.map(|n| n as u32),
    };
    let e = on_tree(&volume, |tree| tree.set_meta(&path, meta))?;
    Ok(Reply::json(200, entry(&e)))
}

/// `DELETE /volumecontent/{id}/path?path=`: the entry and all under it.
pub fn remove(ctx: &Context, req: &mut Request, t: &Target) -> Result<Reply, ApiError> {
    let volume = authorized(ctx, req, t.var)?;
    let pairs = query::parse(t.query);
    let path = path_of(&pairs)?;
    on_tree(&volume, |tree| tree.remove(&path))?;
    Ok(Reply::Empty(204))
}

/// Most volumes one sandbox mounts.
const MAX_MOUNTS: usize = 16;

/// Guest directories a volume may not be mounted on, under or above: the guest's system.
const SYSTEM_DIRS: &[&str] = &[
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run",
    "/sbin", "/sys", "/usr", "/var/lib", "/var/run",
];

/// `volumeMounts` of a create: `[{"name", "path"}]`, each path absolute, plain (no `.`,
/// `..` or empty component), not a system directory nor above or under one, and no two
/// paths inside one another. The names are resolved by the orchestrator.
pub fn mounts_field(f: &Fields) -> Result<Vec<VolumeMount>, ApiError> {
    let items = match f.raw("volumeMounts") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(ApiError::unprocessable(
                "field volumeMounts must be an array",
            ))
        }
    };
    if items.len() > MAX_MOUNTS {
        return Err(ApiError::bad_request(format!(
            "volumeMounts: at most {MAX_MOUNTS} volumes per sandbox"
        )));
    }
    let mut mounts: Vec<VolumeMount> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let field = |k: &str| match item.get(k) {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(ApiError::unprocessable(format!(
                "field volumeMounts[{i}].{k} must be a string"
            ))),
        };
        let (name, path) = (field("name")?, field("path")?);
        check_mount_path(&path).map_err(|why| {
            ApiError::bad_request(format!("volumeMounts[{i}].path: {path:?} {why}"))
        })?;
        if let Some(other) = mounts.iter().find(|m| nested(&m.path, &path)) {
            return Err(ApiError::bad_request(format!(
                "volumeMounts[{i}].path: {path:?} overlaps {:?}; give each volume its own directory",
                other.path
            )));
        }
        mounts.push(VolumeMount {
            name,
            volume_id: String::new(),
            path,
        });
    }
    Ok(mounts)
}

/// Whether one of two plain absolute paths is the other or inside it.
fn nested(a: &str, b: &str) -> bool {
    let under = |x: &str, y: &str| x == y || x.starts_with(&format!("{y}/"));
    under(a, b) || under(b, a)
}

fn check_mount_path(path: &str) -> Result<(), &'static str> {
    if !path.starts_with('/') || path.len() > 4096 || path.contains('\0') {
        return Err("must be an absolute path (at most 4096 bytes, no NUL)");
    }
    if path == "/" {
        return Err("is the guest's root: mount a volume on a directory of its own");
    }
    if path[1..]
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("must be plain: no empty, `.` or `..` component, no trailing /");
    }
    if SYSTEM_DIRS.iter().any(|d| nested(d, path)) {
        return Err(
            "is, holds or lies in a system directory of the guest (/etc, /usr, /proc, ...)",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths() {
        for good in [
            "/mnt/data",
            "/home/user/work",
            "/data",
            "/var/data",
            "/tmp/x",
        ] {
            assert_eq!(check_mount_path(good), Ok(()), "{good}");
        }
        for bad in [
            "/",
            "mnt",
            "/mnt/../etc",
            "/mnt/",
            "/a//b",
            "/etc",
            "/etc/x",
            "/usr/local",
            "/var",
            "/proc/1",
            "/dev",
        ] {
            assert!(check_mount_path(bad).is_err(), "{bad}");
        }
        assert!(nested("/a", "/a/b") && nested("/a/b", "/a") && !nested("/a", "/ab"));
    }
}
