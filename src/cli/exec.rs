//! `sandbox exec`: the command runs through the sandbox's envd, reached over the API's
//! envd proxy (docs/e2b.md): `process.Process/Start` is a Connect server stream (JSON
//! codec, 5-byte envelopes), so output is written to stdout and stderr as the guest
//! reports it, not when the command ends. With `--stdin` the client's stdin goes to the
//! command (`SendInput`, then `CloseStdin` at end of file) from a thread of its own.
//!
//! Exit code: the command's own; 128+N when a signal N ended it; [`TIMED_OUT`] when
//! `--timeout` killed it; [`NOT_STARTED`] when the guest could not start it. Failures
//! before the command exists keep the client's codes (docs/cli.md §3).

use super::client::{self, CliError, Client};
use crate::protocol::connect::{self, FLAG_END_STREAM};
use serde_json::{json, Map, Value};
use std::io::{Read, Write};

/// Exit code when `--timeout` passed and the command was killed (as `timeout(1)`).
pub const TIMED_OUT: u8 = 124;
/// Exit code when the command could not be started (not found, not executable, bad
/// working directory, unknown user), as a shell's 127.
pub const NOT_STARTED: u8 = 127;
/// The output `--json` keeps of each stream.
const JSON_OUTPUT_CAP: usize = 64 << 20;
/// Keepalive interval asked of the guest (seconds): a command quiet for longer than the
/// client's read timeout would otherwise be cut.
const KEEPALIVE_SECS: &str = "30";
/// Bytes read from stdin per `SendInput`.
const INPUT_CHUNK: usize = 64 * 1024;

/// What to run.
pub struct Exec {
    pub sandbox: String,
    pub cmd: String,
    pub args: Vec<String>,
    pub env: Map<String, Value>,
    pub cwd: Option<String>,
    pub timeout_secs: Option<u64>,
    pub user: String,
    pub stdin: bool,
}

/// How the command ended, as `--json` prints it.
#[derive(Default)]
struct Outcome {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    truncated: bool,
    end: Option<Value>,
    error: Option<(String, String)>,
}

/// Runs the command, streaming its output unless `json`; returns the exit code.
pub fn run(c: &Client, e: &Exec, json: bool) -> Result<u8, CliError> {
    let mut process = json!({"cmd": e.cmd, "args": e.args, "envs": e.env});
    if let Some(d) = &e.cwd {
        process["cwd"] = json!(d);
    }
    let body = json!({"process": process, "stdin": e.stdin}).to_string();
    let mut req = rpc(c, &e.sandbox, &e.user, "Start")?
        .set("Content-Type", "application/connect+json")
        .set("Keepalive-Ping-Interval", KEEPALIVE_SECS);
    if let Some(t) = e.timeout_secs.filter(|t| *t > 0) {
        req = req.set("Connect-Timeout-Ms", &t.saturating_mul(1000).to_string());
    }
    let resp = match req.send_bytes(&connect::envelope(0, body.as_bytes())) {
        Ok(r) => r,
        Err(ureq::Error::Status(status, r)) => return Err(not_running(c, &e.sandbox, status, r)),
        Err(ureq::Error::Transport(t)) => return Err(CliError::Unreachable(t.to_string())),
    };
    let mut stream = resp.into_reader();
    let mut out = Outcome::default();
    loop {
        let (flags, msg) = match connect::read_envelope(&mut stream) {
            Ok(Some(m)) => m,
            Ok(None) => break,
            Err(err) => {
                return Err(CliError::Failed(format!(
                    "the command's output stream broke: {}",
                    err.message
                )))
            }
        };
        let msg: Value = serde_json::from_slice(&msg).map_err(|err| {
            CliError::Failed(format!("the guest sent a message that is not JSON: {err}"))
        })?;
        if flags & FLAG_END_STREAM != 0 {
            if let Some(err) = msg.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("").into();
                out.error = Some((field("code"), field("message")));
            }
            break;
        }
        let event = &msg["event"];
        if let Some(pid) = event["start"]["pid"].as_u64() {
            if e.stdin {
                feed_stdin(c, e, pid);
            }
        } else if let Some(data) = event.get("data") {
            out.data(data, json)?;
        } else if let Some(end) = event.get("end") {
            out.end = Some(end.clone());
        }
    }
    let code = out.exit_code(&e.sandbox)?;
    if json {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut v = json!({
            "exitCode": code,
            "stdout": text(&out.stdout),
            "stderr": text(&out.stderr),
            "truncated": out.truncated,
        });
        if let Some(end) = &out.end {
            v["status"] = end["status"].clone();
        }
        if let Some((code, message)) = &out.error {
            v["error"] = json!({"code": code, "message": message});
        }
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    Ok(code)
}

impl Outcome {
    /// One data event: written at once (or kept for `--json`).
    fn data(&mut self, data: &Value, json: bool) -> Result<(), CliError> {
        for (k, v) in data.as_object().into_iter().flatten() {
            let bytes = v
                .as_str()
                .and_then(|s| connect::decode_bytes(s).ok())
                .ok_or_else(|| CliError::Failed(format!("the guest sent bad {k} data")))?;
            let kept = match k.as_str() {
                "stdout" | "pty" => &mut self.stdout,
                "stderr" => &mut self.stderr,
                _ => continue,
            };
            if json {
                let room = JSON_OUTPUT_CAP.saturating_sub(kept.len());
                self.truncated |= bytes.len() > room;
                kept.extend_from_slice(&bytes[..bytes.len().min(room)]);
                continue;
            }
            let written = if k == "stderr" {
                let mut err = std::io::stderr().lock();
                err.write_all(&bytes).and_then(|_| err.flush())
            } else {
                let mut o = std::io::stdout().lock();
                o.write_all(&bytes).and_then(|_| o.flush())
            };
            // A closed pipe (`| head`) ends the client, as it would a local command.
            written.map_err(|err| CliError::Local(format!("writing the {k}: {err}")))?;
        }
        Ok(())
    }

    /// The exit code for how the stream ended (module docs).
    fn exit_code(&self, sandbox: &str) -> Result<u8, CliError> {
        if let Some(end) = &self.end {
            if end["exited"].as_bool() == Some(true) {
                return Ok(end["exitCode"].as_i64().unwrap_or(1).clamp(0, 255) as u8);
            }
            let status = end["status"].as_str().unwrap_or("");
            eprintln!("agentenv: the command ended: {status}");
            return Ok(status
                .strip_prefix("signal: ")
                .and_then(signal_number)
                .map_or(1, |n| 128 + n));
        }
        match &self.error {
            Some((code, message)) if code == "deadline_exceeded" => {
                eprintln!("agentenv: the command timed out and was killed ({message})");
                Ok(TIMED_OUT)
            }
            Some((code, message)) if code == "invalid_argument" || code == "unauthenticated" => {
                eprintln!("agentenv: the command could not be started: {message}");
                Ok(NOT_STARTED)
            }
            Some((code, message)) => Err(CliError::Failed(format!(
                "running the command in sandbox {sandbox} failed: {code}: {message}"
            ))),
            None => Err(CliError::Failed(format!(
                "the output stream of sandbox {sandbox} ended before the command did \
                 (the sandbox stopped?)"
            ))),
        }
    }
}

/// The signal a Go-style status names (`signal: killed`), from the guest's own table.
fn signal_number(name: &str) -> Option<u8> {
    (1..=64u8).find(|&n| crate::guest::envd::process::signal_name(n.into()) == name)
}

/// A `process.Process` call to the sandbox's envd through the API's proxy, as `user`.
fn rpc(c: &Client, sandbox: &str, user: &str, method: &str) -> Result<ureq::Request, CliError> {
    let user = connect::encode_bytes(format!("{user}:").as_bytes());
    Ok(c.request("POST", &format!("/process.Process/{method}"))?
        .set("E2b-Sandbox-Id", sandbox)
        .set("Connect-Protocol-Version", "1")
        .set("Authorization", &format!("Basic {user}")))
}

/// The proxy's refusal, told the CLI's way: a sandbox that is unknown is 404 and one
/// that is paused 409 (the proxy answers both with E2B's 502 "not found").
fn not_running(c: &Client, sandbox: &str, status: u16, resp: ureq::Response) -> CliError {
    let refused = client::api_error(status, resp);
    if status != 502 {
        return refused;
    }
    match c.json(
        "GET",
        &format!("/sandboxes/{}", client::encode(sandbox)),
        None,
    ) {
        Err(e @ CliError::Api { status: 404, .. }) => e,
        Ok((v, _)) if v["state"] != "running" => CliError::Api {
            status: 409,
            message: format!(
                "sandbox {sandbox} is {}: resume it first (agentenv sandbox resume)",
                v["state"].as_str().unwrap_or("not running")
            ),
        },
        _ => refused,
    }
}

/// Copies stdin to the command from a thread of its own; EOF closes the command's stdin.
/// The thread is left behind when the command ends first (the client exits).
fn feed_stdin(c: &Client, e: &Exec, pid: u64) {
    let (c, sandbox, user) = (c.clone(), e.sandbox.clone(), e.user.clone());
    let send = move |method: &str, body: Value| -> Result<(), CliError> {
        let req = rpc(&c, &sandbox, &user, method)?.set("Content-Type", "application/json");
        c.send(req, Some(&body)).map(|_| ())
    };
    let copy = move || -> Result<(), CliError> {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; INPUT_CHUNK];
        loop {
            let n = stdin
                .read(&mut buf)
                .map_err(|err| CliError::Local(format!("reading stdin: {err}")))?;
            if n == 0 {
                return send("CloseStdin", json!({"process": {"pid": pid}}));
            }
            let data = connect::encode_bytes(&buf[..n]);
            send(
                "SendInput",
                json!({"process": {"pid": pid}, "input": {"stdin": data}}),
            )?;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("stdin".into())
        .spawn(move || {
            if let Err(err) = copy() {
                eprintln!("agentenv: stdin was not passed on: {err}");
            }
        });
    if let Err(err) = spawned {
        eprintln!("agentenv: stdin is not passed on: {err}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(end: Value) -> Outcome {
        Outcome {
            end: Some(end),
            ..Outcome::default()
        }
    }

    fn failed(code: &str) -> Outcome {
        Outcome {
            error: Some((code.into(), "why".into())),
            ..Outcome::default()
        }
    }

    #[test]
    fn exit_codes_say_how_the_command_ended() {
        let exited = ended(json!({"exitCode": 7, "exited": true, "status": "exit status 7"}));
        assert_eq!(exited.exit_code("s").unwrap(), 7);
        let killed = ended(json!({"exitCode": -1, "exited": false, "status": "signal: killed"}));
        assert_eq!(killed.exit_code("s").unwrap(), 137);
        let odd = ended(json!({"exitCode": -1, "exited": false, "status": "signal 40"}));
        assert_eq!(odd.exit_code("s").unwrap(), 1, "no `signal: ` prefix");
        assert_eq!(signal_number("signal 40"), Some(40));
        assert_eq!(signal_number("terminated"), Some(15));
        assert_eq!(
            failed("deadline_exceeded").exit_code("s").unwrap(),
            TIMED_OUT
        );
        assert_eq!(
            failed("invalid_argument").exit_code("s").unwrap(),
            NOT_STARTED
        );
        assert_eq!(
            failed("internal").exit_code("s").unwrap_err().exit_code(),
            8
        );
        assert_eq!(
            Outcome::default().exit_code("s").unwrap_err().exit_code(),
            8,
            "a stream that ends without an end event"
        );
    }
}
