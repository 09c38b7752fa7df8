//! `agentenv sandbox|template|snapshot …`: a command-line client for people at a shell,
//! over the REST API (docs/api.md). Runs on the caller's thread, one blocking request at a
//! time; tables by default, `--json` for scripts, exit codes per failure kind (docs/cli.md).

mod args;
mod client;
mod dockerfile;
mod dockerfile_build;
mod exec;

use args::Args;
pub use client::{CliError, Client, Target};
use serde_json::{json, Map, Value};
use std::io::{IsTerminal, Read};
use std::time::{Duration, Instant};

pub const USAGE: &str = "\
usage: agentenv [--url URL] [--api-key KEY] [--config PATH] [--json] COMMAND ...

  sandbox create [--image REF | --template NAME] [--cpu N] [--memory MB] [--disk MB]
                 [--timeout SECS] [--no-auto-pause] [--metadata K=V]... [--env K=V]...
                 [--params JSON]
  sandbox ls [--state running,paused] [--metadata K=V]...
  sandbox info ID
  sandbox exec ID [--env K=V]... [--cwd DIR] [--timeout SECS] [--user NAME] [--stdin]
                 -- CMD [ARG]...  (output streams; exits with the command's code)
  sandbox cp SRC DST            (one of them ID:/abs/path; - is stdin/stdout)
  sandbox pause ID...
  sandbox resume ID [--timeout SECS]
  sandbox rm ID...
  sandbox logs ID [--lines N]   the guest console
  template build NAME --image REF [--start-cmd CMD] [--cpu N] [--memory MB] [--disk MB]
                 [--env K=V]... [--no-wait]
  template build --file Dockerfile [--alias NAME] [--start-cmd CMD] [--ready-cmd CMD]
                 [--build-arg K=V]... [--cpu N] [--memory MB] [CONTEXT]
  template ls
  template rm NAME...
  snapshot create ID [--name NAME]
  snapshot ls [--sandbox ID] [--name NAME]
  snapshot info NAME
  snapshot rm NAME...

The server: --url, else AENV_URL, else the local config's listen address.
The key: --api-key, else AENV_API_KEY, else the local config's key or <state_dir>/api-key.
Exit codes: 0 ok, 1 local file error, 2 usage or a Dockerfile the client cannot read,
3 server unreachable, 4 not found, 5 wrong state (409), 6 no or wrong API key, 7 request
refused (other 4xx), 8 server-side failure (5xx, failed build); `sandbox exec` exits with the command's code,
128+N after signal N, 124 after --timeout, 127 when the command could not be started.

The server itself: agentenv serve [--config PATH]; agentenv --version; docs/operations.md.";

/// Runs one CLI invocation (`args` without the program name) and returns the exit code.
pub fn run(args: Vec<String>) -> u8 {
    let mut args = match Args::new(args) {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    let global = (|| -> Result<(Target, bool), CliError> {
        let target = Target {
            url: args.value("--url")?,
            api_key: args.value("--api-key")?,
            config: args.value("--config")?.map(Into::into),
        };
        Ok((target, args.flag("--json")))
    })();
    let (target, json_out) = match global {
        Ok(g) => g,
        Err(e) => return fail(&e),
    };
    if args.flag("--help") || args.flag("-h") || args.positional.is_empty() {
        println!("{USAGE}");
        return 0;
    }
    let out = Output { json: json_out };
    let client = Client::new(target);
    match dispatch(&client, &out, &mut args) {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

fn fail(e: &CliError) -> u8 {
    eprintln!("agentenv: {e}");
    if matches!(e, CliError::Usage(_)) {
        eprintln!("(agentenv --help lists the commands)");
    }
    e.exit_code()
}

struct Output {
    json: bool,
}

impl Output {
    fn json(&self, v: &Value) {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    }
}

fn dispatch(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let noun = a.positional.remove(0);
    let verb = if a.positional.is_empty() {
        String::new()
    } else {
        a.positional.remove(0)
    };
    match (noun.as_str(), verb.as_str()) {
        ("sandbox", "create") => sandbox_create(c, out, a),
        ("sandbox", "ls") => sandbox_ls(c, out, a),
        ("sandbox", "info") => sandbox_info(c, out, a),
        ("sandbox", "exec") => sandbox_exec(c, out, a),
        ("sandbox", "cp") => sandbox_cp(c, a),
        ("sandbox", "pause") => sandbox_pause(c, a),
        ("sandbox", "resume") => sandbox_resume(c, out, a),
        ("sandbox", "rm") => sandbox_rm(c, a),
        ("sandbox", "logs") => sandbox_logs(c, a),
        ("template", "build") => template_build(c, out, a),
        ("template", "ls") => template_ls(c, out, a),
        ("template", "rm") | ("snapshot", "rm") => template_rm(c, a),
        ("snapshot", "create") => snapshot_create(c, out, a),
        ("snapshot", "ls") => snapshot_ls(c, out, a),
        ("snapshot", "info") => snapshot_info(c, out, a),
        _ => Err(CliError::Usage(format!("unknown command: {noun} {verb}"))),
    }
}

/// `K=V` flags as a JSON object.
fn pairs(a: &mut Args, flag: &str) -> Result<Map<String, Value>, CliError> {
    let mut m = Map::new();
    for kv in a.values(flag)? {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("{flag} wants KEY=VALUE, got {kv:?}")))?;
        m.insert(k.to_string(), json!(v));
    }
    Ok(m)
}

fn number(a: &mut Args, flag: &str) -> Result<Option<u64>, CliError> {
    a.value(flag)?
        .map(|v| {
            v.parse::<u64>()
                .map_err(|_| CliError::Usage(format!("{flag} wants a number, got {v:?}")))
        })
        .transpose()
}

/// Copies the numeric resource flags into a request body.
fn resources(a: &mut Args, body: &mut Value) -> Result<(), CliError> {
    for (flag, field) in [
        ("--cpu", "cpuCount"),
        ("--memory", "memoryMB"),
        ("--disk", "diskSizeMB"),
    ] {
        if let Some(n) = number(a, flag)? {
            body[field] = json!(n);
        }
    }
    Ok(())
}

fn one(a: &mut Args, what: &str) -> Result<String, CliError> {
    a.finish()?;
    match a.positional.as_slice() {
        [x] => Ok(x.clone()),
        _ => Err(CliError::Usage(format!("expected one {what}"))),
    }
}

fn some(a: &mut Args, what: &str) -> Result<Vec<String>, CliError> {
    a.finish()?;
    if a.positional.is_empty() {
        return Err(CliError::Usage(format!("expected at least one {what}")));
    }
    Ok(std::mem::take(&mut a.positional))
}

/// Runs `f` for each name; the exit code is that of the last failure.
fn each(names: Vec<String>, mut f: impl FnMut(&str) -> Result<(), CliError>) -> u8 {
    let mut code = 0;
    for n in names {
        if let Err(e) = f(&n) {
            code = fail(&e);
        }
    }
    code
}

fn sandbox_create(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let template = a.value("--template")?;
    let image = a.value("--image")?;
    let mut body = json!({});
    resources(a, &mut body)?;
    if let Some(t) = number(a, "--timeout")? {
        body["timeout"] = json!(t);
    }
    if a.flag("--no-auto-pause") {
        body["autoPause"] = json!(false);
    }
    body["metadata"] = Value::Object(pairs(a, "--metadata")?);
    body["envVars"] = Value::Object(pairs(a, "--env")?);
    if let Some(p) = a.value("--params")? {
        body["customExtensionParams"] = serde_json::from_str(&p)
            .map_err(|e| CliError::Usage(format!("--params is not JSON: {e}")))?;
    }
    a.finish()?;
    if !a.positional.is_empty() {
        return Err(CliError::Usage("sandbox create takes no arguments".into()));
    }
    let path = match (template, image) {
        (Some(_), Some(_)) => {
            return Err(CliError::Usage(
                "give --image or --template, not both".into(),
            ))
        }
        (Some(t), None) => {
            body["templateID"] = json!(t);
            "/sandboxes"
        }
        (None, image) => {
            body["image"] = json!(image.unwrap_or_else(default_image));
            "/sandboxes-cold"
        }
    };
    let (v, _) = c.json("POST", path, Some(&body))?;
    if out.json {
        out.json(&v);
    } else {
        println!("{}", str_field(&v, "sandboxID"));
    }
    Ok(0)
}

/// The built-in base image of the local server's assets.
fn default_image() -> String {
    let assets = crate::config::Config::load(None)
        .map(|c| c.vm.assets_dir)
        .unwrap_or_else(|_| "/var/lib/agentenv/assets".into());
    format!("oci:{}", assets.join("base-image").display())
}

fn str_field(v: &Value, k: &str) -> String {
    match v.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "-".into(),
        Some(other) => other.to_string(),
    }
}

fn sandbox_ls(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let mut q = Vec::new();
    if let Some(s) = a.value("--state")? {
        q.push(("state", s));
    }
    let meta = pairs(a, "--metadata")?;
    if !meta.is_empty() {
        let m: Vec<(&str, String)> = meta
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap_or("").to_string()))
            .collect();
        q.push(("metadata", client::encode_query(&m)));
    }
    a.finish()?;
    let list = c.list_all("/v2/sandboxes", &q)?;
    if out.json {
        out.json(&Value::Array(list));
        return Ok(0);
    }
    let rows = list
        .iter()
        .map(|s| {
            [
                "sandboxID",
                "state",
                "alias",
                "cpuCount",
                "memoryMB",
                "startedAt",
                "endAt",
            ]
            .iter()
            .map(|k| str_field(s, k))
            .collect()
        })
        .collect();
    table(
        &[
            "ID",
            "STATE",
            "TEMPLATE",
            "CPUS",
            "MEMORY MB",
            "STARTED",
            "ENDS",
        ],
        rows,
    );
    Ok(0)
}

fn sandbox_info(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let id = one(a, "sandbox id")?;
    let (v, _) = c.json("GET", &format!("/sandboxes/{}", client::encode(&id)), None)?;
    if out.json {
        out.json(&v);
    } else {
        key_values(&v);
    }
    Ok(0)
}

fn sandbox_exec(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let env = pairs(a, "--env")?;
    let cwd = a.value("--cwd")?;
    let timeout_secs = number(a, "--timeout")?;
    let user = a.value("--user")?.unwrap_or_else(|| "root".into());
    let stdin = a.flag("--stdin") | a.flag("-i");
    a.finish()?;
    let mut words = std::mem::take(&mut a.positional).into_iter();
    let (Some(sandbox), Some(cmd)) = (words.next(), words.next()) else {
        return Err(CliError::Usage(
            "usage: sandbox exec ID [--env K=V] [--cwd DIR] [--timeout SECS] [--user NAME] \
             [--stdin] -- CMD [ARG]..."
                .into(),
        ));
    };
    let e = exec::Exec {
        sandbox,
        cmd,
        args: words.collect(),
        env,
        cwd,
        timeout_secs,
        user,
        stdin,
    };
    exec::run(c, &e, out.json)
}

/// `ID:/path` → (id, path).
fn remote(spec: &str) -> Option<(&str, &str)> {
    spec.split_once(':').filter(|(id, p)| {
        p.starts_with('/') && !id.is_empty() && !id.contains('/') && !id.contains('.')
    })
}

fn sandbox_cp(c: &Client, a: &mut Args) -> Result<u8, CliError> {
    a.finish()?;
    let [src, dst] = a.positional.as_slice() else {
        return Err(CliError::Usage("usage: sandbox cp SRC DST".into()));
    };
    match (remote(src), remote(dst)) {
        (None, Some((id, path))) => {
            let files = format!(
                "/sandboxes/{}/files?path={}",
                client::encode(id),
                client::encode(path)
            );
            let local_err = |e: std::io::Error| CliError::Local(format!("{src}: {e}"));
            let req = c.request("PUT", &files)?;
            let resp = if src == "-" {
                let mut buf = Vec::new();
                std::io::stdin().read_to_end(&mut buf).map_err(local_err)?;
                req.send_bytes(&buf)
            } else {
                let file = std::fs::File::open(src).map_err(local_err)?;
                let len = file.metadata().map_err(local_err)?.len();
                req.set("Content-Length", &len.to_string()).send(file)
            };
            match resp {
                Ok(_) => Ok(0),
                Err(ureq::Error::Status(status, r)) => Err(CliError::Api {
                    status,
                    message: r.into_string().unwrap_or_default(),
                }),
                Err(ureq::Error::Transport(t)) => Err(CliError::Unreachable(t.to_string())),
            }
        }
        (Some((id, path)), None) => {
            let files = format!(
                "/sandboxes/{}/files?path={}",
                client::encode(id),
                client::encode(path)
            );
            let resp = c.send(c.request("GET", &files)?, None)?;
            let mut reader = resp.into_reader();
            let local_err = |e: std::io::Error| CliError::Local(format!("{dst}: {e}"));
            if dst == "-" {
                std::io::copy(&mut reader, &mut std::io::stdout().lock()).map_err(local_err)?;
            } else {
                let mut target = std::path::PathBuf::from(dst);
                if target.is_dir() {
                    target.push(path.rsplit('/').next().unwrap_or("file"));
                }
                let mut file = std::fs::File::create(&target).map_err(local_err)?;
                std::io::copy(&mut reader, &mut file).map_err(local_err)?;
            }
            Ok(0)
        }
        _ => Err(CliError::Usage(
            "sandbox cp copies between a local path and ID:/abs/path".into(),
        )),
    }
}

fn sandbox_pause(c: &Client, a: &mut Args) -> Result<u8, CliError> {
    let ids = some(a, "sandbox id")?;
    Ok(each(ids, |id| {
        c.json(
            "POST",
            &format!("/sandboxes/{}/pause", client::encode(id)),
            None,
        )
        .map(|_| ())
    }))
}

fn sandbox_resume(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let timeout = number(a, "--timeout")?;
    let id = one(a, "sandbox id")?;
    let body = match timeout {
        Some(t) => json!({"timeout": t}),
        None => json!({}),
    };
    // connect: resumes a paused sandbox, and only extends a running one's TTL.
    let (v, _) = c.json(
        "POST",
        &format!("/sandboxes/{}/connect", client::encode(&id)),
        Some(&body),
    )?;
    if out.json {
        out.json(&v);
    } else {
        println!("{}", str_field(&v, "sandboxID"));
    }
    Ok(0)
}

fn sandbox_rm(c: &Client, a: &mut Args) -> Result<u8, CliError> {
    let ids = some(a, "sandbox id")?;
    Ok(each(ids, |id| {
        c.json(
            "DELETE",
            &format!("/sandboxes/{}", client::encode(id)),
            None,
        )
        .map(|_| ())
    }))
}

fn sandbox_logs(c: &Client, a: &mut Args) -> Result<u8, CliError> {
    let lines = number(a, "--lines")?.unwrap_or(200);
    let id = one(a, "sandbox id")?;
    let resp = c.send(
        c.request(
            "GET",
            &format!("/sandboxes/{}/logs?lines={lines}", client::encode(&id)),
        )?,
        None,
    )?;
    std::io::copy(&mut resp.into_reader(), &mut std::io::stdout().lock())
        .map_err(|e| CliError::Unreachable(format!("reading the log: {e}")))?;
    Ok(0)
}

fn template_build(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    if let Some(file) = a.value("--file")? {
        return dockerfile_build::template_build(c, out, a, &file);
    }
    let image = a
        .value("--image")?
        .ok_or_else(|| CliError::Usage("template build needs --image REF".into()))?;
    let mut body = json!({"image": image, "envVars": pairs(a, "--env")?});
    resources(a, &mut body)?;
    if let Some(cmd) = a.value("--start-cmd")? {
        body["startCmd"] = json!(cmd);
    }
    let no_wait = a.flag("--no-wait");
    let name = one(a, "template name")?;
    body["name"] = json!(name);
    let (mut v, _) = c.json("POST", "/templates", Some(&body))?;
    let id = str_field(&v, "templateID");
    if !no_wait {
        v = wait_for_build(c, &name, &id, out.json)?;
    }
    if out.json {
        out.json(&v);
    } else if no_wait {
        println!("{id}");
    }
    match v.get("buildStatus").and_then(Value::as_str) {
        Some("error") => Err(CliError::Failed(format!(
            "template {name} failed: {}",
            str_field(&v, "reason")
        ))),
        _ => Ok(0),
    }
}

/// The phases of a build in order (api.md §4.15), for the bar.
const BUILD_PHASES: [&str; 8] = [
    "queued",
    "pulling",
    "unpacking",
    "building_disk",
    "booting",
    "start_cmd",
    "capturing",
    "ready",
];

/// Polls `GET /templates/{id}` until the build ends, showing its `progress` on stderr: on
/// a terminal one line redrawn (a bar over the phases, the pulled bytes, the elapsed
/// time); otherwise a line per phase change and per quarter of the image's bytes.
fn wait_for_build(c: &Client, name: &str, id: &str, quiet: bool) -> Result<Value, CliError> {
    let tty = !quiet && std::io::stderr().is_terminal();
    let start = Instant::now();
    let mut last_phase = String::new();
    let mut last_quarter = None;
    let mut last_fraction = 0.0;
    loop {
        let (v, _) = c.json("GET", &format!("/templates/{}", client::encode(id)), None)?;
        let status = str_field(&v, "buildStatus");
        let p = &v["progress"];
        let phase = p["phase"].as_str().unwrap_or(&status).to_string();
        let bytes = p["pullBytesDone"].as_u64().unwrap_or(0);
        let total = p["pullBytesTotal"].as_u64().unwrap_or(0);
        let secs = start.elapsed().as_secs();
        let ended = status == "ready" || status == "error";
        if tty {
            let step = BUILD_PHASES.iter().position(|p| *p == phase);
            let pulled = if total > 0 {
                bytes as f64 / total as f64
            } else {
                0.0
            };
            // A failed build's bar stays where it stopped.
            let fraction = match step {
                Some(1) => pulled / 6.0,
                Some(i) => (i.saturating_sub(1) as f64 / 6.0).min(1.0),
                None => last_fraction,
            };
            last_fraction = fraction;
            let filled = (fraction * 30.0).round() as usize;
            let bar: String = (0..30)
                .map(|i| if i < filled { '#' } else { '.' })
                .collect();
            let size = if total > 0 {
                format!("{}/{}", human_bytes(bytes), human_bytes(total))
            } else {
                String::new()
            };
            eprint!(
                "\r\x1b[K{name} [{bar}] {phase:<13} {size:<19} {:02}:{:02}",
                secs / 60,
                secs % 60
            );
            if ended {
                eprintln!();
            }
        } else if !quiet {
            let quarter = match total {
                0 => None,
                t => Some(bytes.saturating_mul(4) / t),
            };
            if quarter.is_some() && quarter > last_quarter {
                eprintln!(
                    "template {name}: pulled {bytes} of {total} bytes ({}%)",
                    bytes.saturating_mul(100) / total.max(1)
                );
                last_quarter = quarter;
            }
            if phase != last_phase {
                eprintln!("template {name} ({id}): {phase} after {secs}s");
            }
        }
        if ended {
            return Ok(v);
        }
        last_phase = phase;
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `n` bytes for people: `512 B`, `3.4 MiB`.
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn template_ls(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    a.finish()?;
    let (v, _) = c.json("GET", "/templates", None)?;
    if out.json {
        out.json(&v);
        return Ok(0);
    }
    let list = v.as_array().cloned().unwrap_or_default();
    let rows = list
        .iter()
        .map(|t| {
            let name = t
                .get("names")
                .and_then(|n| n.get(0))
                .and_then(Value::as_str)
                .unwrap_or("-")
                .to_string();
            let mut row = vec![name];
            row.extend(
                [
                    "templateID",
                    "buildStatus",
                    "cpuCount",
                    "memoryMB",
                    "diskSizeMB",
                    "image",
                ]
                .iter()
                .map(|k| str_field(t, k)),
            );
            row
        })
        .collect();
    table(
        &[
            "NAME",
            "ID",
            "STATUS",
            "CPUS",
            "MEMORY MB",
            "DISK MB",
            "IMAGE",
        ],
        rows,
    );
    Ok(0)
}

fn template_rm(c: &Client, a: &mut Args) -> Result<u8, CliError> {
    let names = some(a, "name or id")?;
    Ok(each(names, |n| {
        c.json("DELETE", &format!("/templates/{}", client::encode(n)), None)
            .map(|_| ())
    }))
}

fn snapshot_create(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let name = a.value("--name")?;
    let id = one(a, "sandbox id")?;
    let body = match name {
        Some(n) => json!({"name": n}),
        None => json!({}),
    };
    let (v, _) = c.json(
        "POST",
        &format!("/sandboxes/{}/snapshots", client::encode(&id)),
        Some(&body),
    )?;
    if out.json {
        out.json(&v);
    } else {
        println!("{}", str_field(&v, "snapshotID"));
    }
    Ok(0)
}

fn snapshot_ls(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let mut q = Vec::new();
    if let Some(s) = a.value("--sandbox")? {
        q.push(("sandboxID", s));
    }
    if let Some(n) = a.value("--name")? {
        q.push(("name", n));
    }
    a.finish()?;
    let list = c.list_all("/snapshots", &q)?;
    if out.json {
        out.json(&Value::Array(list));
        return Ok(0);
    }
    let rows = list
        .iter()
        .map(|s| {
            let name = s
                .get("names")
                .and_then(|n| n.get(0))
                .and_then(Value::as_str)
                .unwrap_or("-")
                .to_string();
            let mut row = vec![str_field(s, "snapshotID"), name];
            row.extend(
                ["sandboxID", "cpuCount", "memoryMB", "createdAt"]
                    .iter()
                    .map(|k| str_field(s, k)),
            );
            row
        })
        .collect();
    table(
        &["ID", "NAME", "SANDBOX", "CPUS", "MEMORY MB", "CREATED"],
        rows,
    );
    Ok(0)
}

fn snapshot_info(c: &Client, out: &Output, a: &mut Args) -> Result<u8, CliError> {
    let name = one(a, "snapshot id or name")?;
    let (v, _) = c.json(
        "GET",
        &format!("/snapshots/{}", client::encode(&name)),
        None,
    )?;
    if out.json {
        out.json(&v);
    } else {
        key_values(&v);
    }
    Ok(0)
}

/// Columns padded to their widest cell.
fn table(headers: &[&str], rows: Vec<Vec<String>>) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(headers.to_vec());
    for row in &rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// An object as `key: value` lines (nested values as compact JSON).
fn key_values(v: &Value) {
    if let Value::Object(m) = v {
        let width = m.keys().map(String::len).max().unwrap_or(0);
        for (k, val) in m {
            let text = match val {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            println!("{k:<width$}  {text}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_for_people() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20 | 400 << 10), "3.4 MiB");
        assert_eq!(human_bytes(u64::MAX), "16777216.0 TiB");
    }

    #[test]
    fn remote_paths_need_an_id_and_an_absolute_path() {
        assert_eq!(remote("abc:/etc/x"), Some(("abc", "/etc/x")));
        assert_eq!(remote("./a:b"), None);
        assert_eq!(remote("/tmp/a:/b"), None);
        assert_eq!(remote("file.txt"), None);
        assert_eq!(remote("abc:rel"), None);
    }
}
