//! `agentenv template build --file Dockerfile [CONTEXT]`: the Dockerfile read into a v2
//! build (`dockerfile.rs`), each COPY/ADD source of the context packed as a tar and
//! uploaded through the SDKs' files path (`GET /templates/{id}/files/{hash}`, then `PUT`
//! to its link unless the server already has it), the build started with
//! `POST /v2/templates/{id}/builds/{buildID}` and followed through its status log:
//! each step and its output as it comes, with the elapsed time; `--json` prints one
//! JSON object per line (the log's entries, then the result).

use super::args::Args;
use super::client::{self, CliError, Client};
use super::dockerfile::{self, Plan, PlanStep};
use super::Output;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How often the build's status is asked for.
const POLL: Duration = Duration::from_millis(300);

/// What `template build --file` was asked to do.
struct Request {
    plan: Plan,
    context: PathBuf,
    name: String,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    resources: Value,
}

pub fn template_build(c: &Client, out: &Output, a: &mut Args, file: &str) -> Result<u8, CliError> {
    let req = request(a, file)?;
    for w in &req.plan.warnings {
        note(
            out,
            &json!({"event": "warning", "message": w}),
            &format!("warning: {w}"),
        );
    }
    let mut body = req.resources.clone();
    body["name"] = json!(req.name);
    let (v, _) = c.json("POST", "/v3/templates", Some(&body))?;
    let tid = super::str_field(&v, "templateID");
    let bid = super::str_field(&v, "buildID");
    let hashes = upload_files(c, out, &req, &tid)?;
    let spec = dockerfile::build_request(
        &req.plan,
        req.start_cmd.as_deref(),
        req.ready_cmd.as_deref(),
        |i| hashes.get(&i).cloned().unwrap_or_default(),
    );
    let path = format!(
        "/v2/templates/{}/builds/{}",
        client::encode(&tid),
        client::encode(&bid)
    );
    c.json("POST", &path, Some(&spec))?;
    let end = follow(c, out, &tid, &bid)?;
    let result = json!({
        "event": "result",
        "templateID": tid,
        "buildID": bid,
        "name": req.name,
        "status": end["status"],
        "reason": end.get("reason").cloned().unwrap_or(Value::Null),
    });
    if out.json {
        println!("{result}");
    }
    match end["status"].as_str() {
        Some("ready") => {
            if !out.json {
                println!("{tid}");
            }
            Ok(0)
        }
        _ => Err(CliError::Failed(format!(
            "template {} failed: {}",
            req.name,
            end["reason"]["message"]
                .as_str()
                .unwrap_or("the build failed")
        ))),
    }
}

/// The command line and the Dockerfile read; nothing sent yet.
fn request(a: &mut Args, file: &str) -> Result<Request, CliError> {
    let alias = a.value("--alias")?;
    let start_cmd = a.value("--start-cmd")?;
    let ready_cmd = a.value("--ready-cmd")?;
    let mut build_args = Vec::new();
    for kv in a.values("--build-arg")? {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--build-arg wants NAME=VALUE, got {kv:?}")))?;
        build_args.push((k.to_string(), v.to_string()));
    }
    let mut resources = json!({});
    for (flag, field) in [("--cpu", "cpuCount"), ("--memory", "memoryMB")] {
        if let Some(n) = super::number(a, flag)? {
            resources[field] = json!(n);
        }
    }
    a.finish()?;
    let context = match a.positional.as_slice() {
        [] => PathBuf::from("."),
        [dir] => PathBuf::from(dir),
        _ => {
            return Err(CliError::Usage(
                "template build --file takes one CONTEXT directory".into(),
            ))
        }
    };
    if !context.is_dir() {
        return Err(CliError::Local(format!(
            "the build context {} is not a directory",
            context.display()
        )));
    }
    let text = read_dockerfile(Path::new(file))?;
    let plan = dockerfile::parse(&text, &build_args)
        .map_err(|e| CliError::Dockerfile(format!("{file}: {e}")))?;
    let name = match alias {
        Some(a) => a,
        None => default_name(&context)?,
    };
    let start_cmd = start_cmd.or_else(|| plan.start_cmd.clone());
    Ok(Request {
        plan,
        context,
        name,
        start_cmd,
        ready_cmd,
        resources,
    })
}

fn read_dockerfile(path: &Path) -> Result<String, CliError> {
    let local = |e: io::Error| CliError::Local(format!("cannot read {}: {e}", path.display()));
    let len = std::fs::metadata(path).map_err(local)?.len();
    if len > dockerfile::MAX_DOCKERFILE_BYTES as u64 {
        return Err(CliError::Dockerfile(format!(
            "{}: longer than {} bytes",
            path.display(),
            dockerfile::MAX_DOCKERFILE_BYTES
        )));
    }
    let bytes = std::fs::read(path).map_err(local)?;
    String::from_utf8(bytes)
        .map_err(|_| CliError::Dockerfile(format!("{}: not UTF-8 text", path.display())))
}

/// Without `--alias`: the context directory's name, in the characters a name may have.
fn default_name(context: &Path) -> Result<String, CliError> {
    let dir = std::fs::canonicalize(context)
        .map_err(|e| CliError::Local(format!("{}: {e}", context.display())))?;
    let name: String = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if name.trim_matches('-').is_empty() {
        return Err(CliError::Usage(
            "name the template with --alias NAME".into(),
        ));
    }
    Ok(name)
}

/// Packs and uploads each COPY source (once per distinct source); the files hash of
/// each COPY step, by its index in the plan.
fn upload_files(
    c: &Client,
    out: &Output,
    req: &Request,
    tid: &str,
) -> Result<HashMap<usize, String>, CliError> {
    let mut by_src: HashMap<&str, String> = HashMap::new();
    let mut hashes = HashMap::new();
    for (i, step) in req.plan.steps.iter().enumerate() {
        let PlanStep::Copy { src, .. } = step else {
            continue;
        };
        if let Some(h) = by_src.get(src.as_str()) {
            hashes.insert(i, h.clone());
            continue;
        }
        let packed = Packed::of(&req.context, src)?;
        let link_path = format!("/templates/{}/files/{}", client::encode(tid), packed.hash);
        let (link, _) = c.json("GET", &link_path, None)?;
        let present = link["present"].as_bool() == Some(true);
        if !present {
            let url = link["url"].as_str().ok_or_else(|| CliError::Api {
                status: 502,
                message: format!("GET {link_path} gave no upload url: {link}"),
            })?;
            packed.upload(url)?;
        }
        let message = match present {
            true => format!("files {src}: already on the server"),
            false => format!("files {src}: uploaded {} bytes", packed.len),
        };
        let event = json!({"event": "files", "src": src, "hash": packed.hash, "bytes": packed.len, "uploaded": !present});
        note(out, &event, &message);
        by_src.insert(src, packed.hash.clone());
        hashes.insert(i, packed.hash.clone());
    }
    Ok(hashes)
}

/// One COPY source packed as a gzipped tar in a temporary file (removed on drop), named
/// by the SHA-256 of its uncompressed tar.
struct Packed {
    path: PathBuf,
    hash: String,
    len: u64,
}

impl Drop for Packed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    sha: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sha.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Packed {
    fn of(context: &Path, src: &str) -> Result<Packed, CliError> {
        let root = context.join(src);
        let meta = std::fs::symlink_metadata(&root)
            .map_err(|e| CliError::Local(format!("COPY source {src}: {} ({e})", root.display())))?;
        let path =
            std::env::temp_dir().join(format!("agentenv-context-{}.tar.gz", uuid::Uuid::now_v7()));
        let mut packed = Packed {
            path,
            hash: String::new(),
            len: 0,
        };
        let local = |e: io::Error| CliError::Local(format!("packing {src}: {e}"));
        let file = File::create(&packed.path).map_err(local)?;
        let gz = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
        let mut tar = tar::Builder::new(Hashing {
            inner: gz,
            sha: Sha256::new(),
        });
        tar.follow_symlinks(false);
        let name = if src == "." {
            PathBuf::new()
        } else {
            PathBuf::from(src)
        };
        add_tree(&mut tar, &root, &name, &meta).map_err(local)?;
        let hashing = tar.into_inner().map_err(local)?;
        hashing
            .inner
            .finish()
            .map_err(local)?
            .sync_all()
            .map_err(local)?;
        packed.hash = hex(&hashing.sha.finalize());
        packed.len = std::fs::metadata(&packed.path).map_err(local)?.len();
        Ok(packed)
    }

    fn upload(&self, url: &str) -> Result<(), CliError> {
        let file = File::open(&self.path)
            .map_err(|e| CliError::Local(format!("{}: {e}", self.path.display())))?;
        // The link's token is the credential (no API key); Content-Length, not chunked.
        let req = ureq::put(url)
            .timeout(Duration::from_secs(3600))
            .set("Content-Type", "application/gzip")
            .set("Content-Length", &self.len.to_string());
        match req.send(file) {
            Ok(_) => Ok(()),
            Err(ureq::Error::Status(status, resp)) => Err(client::api_error(status, resp)),
            Err(ureq::Error::Transport(t)) => Err(CliError::Unreachable(t.to_string())),
        }
    }
}

/// Adds `path` (and what is under it, in name order) as `name`: owners 0, times fixed,
/// the permission bits as they are, so the same files give the same hash.
fn add_tree<W: Write>(
    tar: &mut tar::Builder<W>,
    path: &Path,
    name: &Path,
    meta: &std::fs::Metadata,
) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if !name.as_os_str().is_empty() {
        let mut h = tar::Header::new_gnu();
        h.set_metadata_in_mode(meta, tar::HeaderMode::Deterministic);
        h.set_mode(meta.permissions().mode() & 0o7777);
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(path)?;
            tar.append_link(&mut h, name, target)?;
        } else if meta.is_dir() {
            tar.append_data(&mut h, name, io::empty())?;
        } else if meta.is_file() {
            tar.append_data(&mut h, name, File::open(path)?)?;
        } else {
            return Err(io::Error::other(format!(
                "{} is not a file, directory or symlink",
                path.display()
            )));
        }
    }
    if meta.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let m = std::fs::symlink_metadata(e.path())?;
            add_tree(tar, &e.path(), &name.join(e.file_name()), &m)?;
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Prints an event: one JSON line with `--json`, else the text on stderr.
fn note(out: &Output, event: &Value, text: &str) {
    if out.json {
        println!("{event}");
    } else {
        eprintln!("{text}");
    }
}

/// Follows the build's status log until it is `ready` or `error`; the last status.
fn follow(c: &Client, out: &Output, tid: &str, bid: &str) -> Result<Value, CliError> {
    let start = Instant::now();
    let mut offset = 0usize;
    loop {
        let path = format!(
            "/templates/{}/builds/{}/status?logsOffset={offset}&limit=100",
            client::encode(tid),
            client::encode(bid)
        );
        let (v, _) = c.json("GET", &path, None)?;
        let entries = v["logEntries"].as_array().cloned().unwrap_or_default();
        offset += entries.len();
        let secs = start.elapsed().as_secs();
        for e in &entries {
            let message = e["message"].as_str().unwrap_or_default();
            let event = json!({
                "event": "log",
                "elapsedSecs": secs,
                "level": e["level"],
                "step": e["step"],
                "message": message,
            });
            note(
                out,
                &event,
                &format!("[{:02}:{:02}] {message}", secs / 60, secs % 60),
            );
        }
        let status = v["status"].as_str().unwrap_or_default();
        // Ended, and every entry read (a page is at most 100).
        if matches!(status, "ready" | "error") && entries.len() < 100 {
            return Ok(v);
        }
        if entries.len() < 100 {
            std::thread::sleep(POLL);
        }
    }
}
