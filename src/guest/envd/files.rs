//! `GET /files?path=` (download) and `POST /files[?path=]` (upload), envd's plain HTTP
//! file transfer. Errors are `{"code": <status>, "message": ...}` as envd sends them.
//!
//! Uploads are `multipart/form-data` (each `file` part's filename is its path unless
//! `?path=` names one; several files per request) or `application/octet-stream` with
//! `?path=`, optionally `Content-Encoding: gzip`. Missing parent directories are created
//! and owned by the caller's account, as is the file; `X-Metadata-<key>` headers become
//! the file's `user.e2b.<key>` attributes ([`super::metadata`]); the answer lists what was
//! written as `[{"name", "type": "file", "path", "metadata"?}]`.
//!
//! Both act with the caller's own permissions ([`Envd::act_as`]): a path the account could
//! not read or write from a shell is 403, as on E2B.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde_json::{json, Value};
use tiny_http::{Header, Request, Response};

use super::http;
use super::metadata::Metadata;
use super::multipart::{self, Multipart, MultipartError};
use super::users::User;
use super::{Call, Envd};
use crate::protocol::connect::RpcError;

/// A failed transfer: the HTTP status and the message.
#[derive(Debug)]
pub struct FileError {
    pub status: u16,
    pub message: String,
}

impl FileError {
    fn new(status: u16, message: impl Into<String>) -> FileError {
        FileError {
            status,
            message: message.into(),
        }
    }

    fn respond(self, req: Request) {
        let body = json!({"code": self.status, "message": self.message});
        http::respond_json(req, self.status, &body);
    }
}

impl From<RpcError> for FileError {
    fn from(e: RpcError) -> FileError {
        FileError::new(e.code.http_status(), e.message)
    }
}

fn io_status(e: &io::Error) -> u16 {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => 507,
        _ => match e.kind() {
            io::ErrorKind::NotFound => 404,
            io::ErrorKind::PermissionDenied => 403,
            _ => 500,
        },
    }
}

/// The account of a transfer: `?username=`, else the Basic-auth user, else the default.
fn transfer_user(
    envd: &Envd,
    req: &Request,
    params: &[(String, String)],
) -> Result<User, FileError> {
    let user = match query(params, "username") {
        Some(u) if !u.is_empty() => Some(u.to_string()),
        _ => super::users::basic_auth_user(http::header(req, "Authorization").as_deref())?,
    };
    let call = Call {
        user,
        ..Call::default()
    };
    envd.user(&call).map_err(|e| FileError::new(401, e.message))
}

fn query<'a>(params: &'a [(String, String)], key: &str) -> Option<&'a str> {
    params
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

fn parse_query(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// `GET /files?path=[&username=]`: the file's bytes.
pub fn download(envd: &Envd, req: Request, query_string: &str) {
    let params = parse_query(query_string);
    let opened = (|| {
        let user = transfer_user(envd, &req, &params)?;
        let _acting = envd.act_as(&user)?;
        let path = envd.resolve(query(&params, "path").unwrap_or(""), &user)?;
        let shown = path.display();
        let meta = std::fs::metadata(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                FileError::new(404, format!("path '{shown}' does not exist"))
            }
            _ => FileError::new(
                io_status(&e),
                format!("error checking if path exists '{shown}': {e}"),
            ),
        })?;
        if meta.is_dir() {
            return Err(FileError::new(
                400,
                format!("path '{shown}' is a directory"),
            ));
        }
        let file = File::open(&path).map_err(|e| {
            FileError::new(io_status(&e), format!("error opening file '{shown}': {e}"))
        })?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().replace(['"', '\\', '\r', '\n'], "_"))
            .unwrap_or_default();
        Ok((file, meta.len(), name))
    })();
    let (file, len, name) = match opened {
        Ok(o) => o,
        Err(e) => return e.respond(req),
    };
    let headers = [
        ("Content-Type", "application/octet-stream".to_string()),
        (
            "Content-Disposition",
            format!("inline; filename=\"{name}\""),
        ),
    ]
    .into_iter()
    .filter_map(|(k, v)| Header::from_bytes(k, v.as_bytes()).ok())
    .collect();
    let response = Response::new(200.into(), headers, file, Some(len as usize), None);
    if let Err(e) = req.respond(response) {
        log::debug!("download ended early: {e}");
    }
}

/// Writes one uploaded file from `copy`, which moves the bytes into the open file, then
/// sets `metadata` on it.
fn write_file(
    path: &Path,
    metadata: &Metadata,
    copy: &mut dyn FnMut(&mut File) -> Result<(), FileError>,
) -> Result<Value, FileError> {
    let shown = path.display();
    if let Some(parent) = path.parent() {
        super::filesystem::ensure_dirs(parent)?;
    }
    if path.is_dir() {
        return Err(FileError::new(400, format!("path is a directory: {shown}")));
    }
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o666)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| FileError::new(io_status(&e), format!("error opening file {shown}: {e}")))?;
    copy(&mut file)?;
    super::metadata::apply(&file, metadata).map_err(|e| metadata_error(path, &e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut entry = json!({"name": name, "type": "file", "path": path.to_string_lossy()});
    if let Some(kept) = super::metadata::read(path) {
        entry["metadata"] = json!(kept);
    }
    Ok(entry)
}

/// A file written whose metadata could not be kept.
fn metadata_error(path: &Path, e: &crate::sys::SysError) -> FileError {
    let shown = path.display();
    match e.errno() {
        Some(libc::ENOTSUP) => FileError::new(
            400,
            format!(
                "the file system of {shown} does not keep user extended attributes, so it \
                 cannot hold file metadata (tmpfs needs CONFIG_TMPFS_XATTR)"
            ),
        ),
        Some(libc::E2BIG) | Some(libc::ENOSPC) | Some(libc::ERANGE) => FileError::new(
            400,
            format!("the metadata does not fit the extended attributes of {shown}: {e}"),
        ),
        Some(libc::EPERM) | Some(libc::EACCES) => {
            FileError::new(403, format!("cannot set metadata on {shown}: {e}"))
        }
        _ => FileError::new(500, format!("cannot set metadata on {shown}: {e}")),
    }
}

fn copy_error(e: io::Error) -> FileError {
    match io_status(&e) {
        507 => FileError::new(507, "not enough disk space available"),
        status => FileError::new(status, format!("error writing file: {e}")),
    }
}

fn multipart_error(e: MultipartError) -> FileError {
    match e {
        MultipartError::Malformed(m) => FileError::new(400, m),
        MultipartError::Read(e) => FileError::new(400, format!("reading the upload: {e}")),
        MultipartError::Write(e) => copy_error(e),
    }
}

/// `POST /files`: writes one or many files.
pub fn upload(envd: &Envd, mut req: Request, query_string: &str) {
    let params = parse_query(query_string);
    let content_type = http::header(&req, "Content-Type").unwrap_or_default();
    let encoding = http::header(&req, "Content-Encoding")
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let user = match transfer_user(envd, &req, &params) {
        Ok(u) => u,
        Err(e) => return e.respond(req),
    };
    let _acting = match envd.act_as(&user) {
        Ok(a) => a,
        Err(e) => return FileError::from(e).respond(req),
    };
    let path_param = query(&params, "path").filter(|p| !p.is_empty());
    let metadata = match super::metadata::from_request(&req) {
        Ok(m) => m,
        Err(e) => return FileError::new(400, e).respond(req),
    };
    let result = (|| {
        let raw: Box<dyn Read + '_> = match encoding.as_str() {
            "" | "identity" => Box::new(req.as_reader()),
            "gzip" => Box::new(flate2::read::GzDecoder::new(req.as_reader())),
            other => {
                return Err(FileError::new(
                    400,
                    format!("unsupported Content-Encoding {other:?}; use gzip or none"),
                ))
            }
        };
        let media = content_type.split(';').next().unwrap_or_default().trim();
        if media.eq_ignore_ascii_case("application/octet-stream") {
            let Some(p) = path_param else {
                return Err(FileError::new(
                    400,
                    "path query parameter is required for raw body upload",
                ));
            };
            let path = envd.resolve(p, &user)?;
            let mut raw = raw;
            let entry = write_file(&path, &metadata, &mut |f| {
                io::copy(&mut raw, f).map(drop).map_err(copy_error)
            })?;
            return Ok(vec![entry]);
        }
        let Some(boundary) = multipart::boundary(&content_type) else {
            return Err(FileError::new(
                400,
                format!(
                    "unsupported content type: {content_type}, expected multipart/form-data or \
                     application/octet-stream"
                ),
            ));
        };
        let mut form = Multipart::new(raw, &boundary);
        let mut written: Vec<Value> = Vec::new();
        while let Some(part) = form.next_part().map_err(multipart_error)? {
            if part.name != "file" {
                continue;
            }
            let name = match (path_param, part.filename.as_deref()) {
                (Some(p), _) => p.to_string(),
                (None, Some(f)) if !f.is_empty() => f.to_string(),
                _ => {
                    return Err(FileError::new(
                        400,
                        "a file part has no filename and no path query parameter was given",
                    ))
                }
            };
            let path = envd.resolve(&name, &user)?;
            let shown = path.to_string_lossy();
            if written.iter().any(|w| w["path"] == *shown) {
                return Err(FileError::new(
                    400,
                    format!(
                        "you cannot upload multiple files to the same path '{shown}' in one \
                         upload request"
                    ),
                ));
            }
            let entry = write_file(&path, &metadata, &mut |f| {
                form.copy_part(f).map(drop).map_err(multipart_error)
            })?;
            written.push(entry);
        }
        Ok(written)
    })();
    match result {
        Ok(written) => http::respond_json(req, 200, &Value::Array(written)),
        Err(e) => e.respond(req),
    }
}
