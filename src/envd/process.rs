//! Host-side `process.Process/Start` on a guest's envd: how template builds run their
//! steps, start and ready commands inside the build VM as the step's user (envd switches
//! to the account itself, as for the SDKs' commands). Connect streaming with the JSON
//! codec: enveloped messages, each bounded; the guest is untrusted, so every message, the
//! output kept and the time waited are capped.

use super::{Connection, EnvdError, Framing, Outgoing, Patience};
use base64::Engine;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest message taken from the guest (envd sends ≤ 32 KiB of output per event).
const MAX_MESSAGE: usize = 1024 * 1024;

/// A process to start.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    /// The account envd runs it as (its `Authorization: Basic` user).
    pub user: String,
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    /// Relative to the user's home; `None` is the home.
    pub cwd: Option<String>,
}

/// How a process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnd {
    pub exit_code: i32,
    /// envd's status ("exit status 1", "signal: killed").
    pub status: String,
}

/// Which stream a piece of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// What went wrong with a process call.
#[derive(Debug)]
pub enum ProcessError {
    Envd(EnvdError),
    /// envd refused the call (unknown user, missing cwd, ...): its Connect error.
    Refused(String),
    /// The call's time ran out (envd killed the process).
    Timeout,
}

impl std::fmt::Display for ProcessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessError::Envd(e) => write!(f, "{e}"),
            ProcessError::Refused(m) => write!(f, "{m}"),
            ProcessError::Timeout => f.write_str("timed out"),
        }
    }
}

impl From<EnvdError> for ProcessError {
    fn from(e: EnvdError) -> ProcessError {
        match e {
            EnvdError::Timeout => ProcessError::Timeout,
            other => ProcessError::Envd(other),
        }
    }
}

/// Runs `spec` to its end, at most `timeout` (envd kills it then), handing output to
/// `on_output` as it arrives. Setting `cancelled` ends the wait within seconds.
pub fn run(
    addr: SocketAddr,
    spec: &ProcessSpec,
    timeout: Duration,
    cancelled: &Arc<AtomicBool>,
    on_output: &mut dyn FnMut(Stream, &[u8]),
) -> Result<ProcessEnd, ProcessError> {
    let deadline = Instant::now() + timeout;
    let mut body = open(addr, spec, Some(timeout), cancelled)?;
    loop {
        if Instant::now() > deadline + Duration::from_secs(10) {
            return Err(ProcessError::Timeout);
        }
        match next_event(&mut body)? {
            Event::Output(stream, bytes) => on_output(stream, &bytes),
            Event::End(end) => return Ok(end),
            Event::Started(_) | Event::Other => {}
            Event::Closed(Some(err)) if err.contains("deadline_exceeded") => {
                return Err(ProcessError::Timeout)
            }
            Event::Closed(Some(err)) => return Err(ProcessError::Refused(err)),
            Event::Closed(None) => {
                return Err(ProcessError::Refused(
                    "envd ended the stream before the process ended".into(),
                ))
            }
        }
    }
}

/// Starts `spec` and leaves it running (no timeout): the start command. Returns its pid.
pub fn spawn(addr: SocketAddr, spec: &ProcessSpec) -> Result<u32, ProcessError> {
    let mut body = open(addr, spec, None, &Arc::new(AtomicBool::new(false)))?;
    loop {
        match next_event(&mut body)? {
            Event::Other => continue,
            Event::Output(..) => continue,
            Event::End(end) => {
                return Err(ProcessError::Refused(format!(
                    "the process ended at once ({})",
                    end.status
                )))
            }
            Event::Closed(err) => {
                return Err(ProcessError::Refused(
                    err.unwrap_or_else(|| "envd ended the stream".into()),
                ))
            }
            Event::Started(pid) => return Ok(pid),
        }
    }
}

enum Event {
    Started(u32),
    Output(Stream, Vec<u8>),
    End(ProcessEnd),
    Other,
    /// The end-of-stream message: its error, if any.
    Closed(Option<String>),
}

fn open(
    addr: SocketAddr,
    spec: &ProcessSpec,
    timeout: Option<Duration>,
    cancelled: &Arc<AtomicBool>,
) -> Result<Box<dyn Read + Send>, ProcessError> {
    let cancelled = cancelled.clone();
    let patience = Patience {
        // Keepalives come every few seconds on a quiet stream; silence this long is a dead guest.
        idle: Duration::from_secs(120),
        alive: Arc::new(move || !cancelled.load(Ordering::SeqCst)),
    };
    let mut conn = Connection::open(addr, patience)?;
    let mut process = json!({"cmd": spec.cmd, "args": spec.args, "envs": spec.envs});
    if let Some(cwd) = &spec.cwd {
        process["cwd"] = json!(cwd);
    }
    let payload = json!({"process": process, "stdin": false}).to_string();
    let mut framed = Vec::with_capacity(payload.len() + 5);
    framed.push(0);
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload.as_bytes());
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{}:", spec.user));
    let mut headers = vec![
        (
            "Content-Type".to_string(),
            "application/connect+json".to_string(),
        ),
        ("Connect-Protocol-Version".into(), "1".into()),
        ("Keepalive-Ping-Interval".into(), "5".into()),
        ("Authorization".into(), format!("Basic {auth}")),
    ];
    if let Some(t) = timeout {
        headers.push(("Connect-Timeout-Ms".into(), t.as_millis().to_string()));
    }
    let req = Outgoing {
        method: "POST",
        target: "/process.Process/Start",
        host: "envd",
        headers: &headers,
        body: Framing::Length(framed.len() as u64),
        upgrade: None,
    };
    conn.send(&req, &mut &framed[..])?;
    let answer = conn.answer(false)?;
    if answer.status != 200 {
        let mut text = String::new();
        let _ = answer.body.take(4096).read_to_string(&mut text);
        return Err(ProcessError::Refused(format!(
            "envd answered {}: {}",
            answer.status,
            error_message(&text)
        )));
    }
    Ok(answer.body)
}

/// The message of a Connect error body, else the text itself.
fn error_message(text: &str) -> String {
    serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| {
            let code = v["code"].as_str().unwrap_or("");
            v["message"].as_str().map(|m| format!("{code}: {m}"))
        })
        .unwrap_or_else(|| text.to_string())
}

fn next_event(body: &mut dyn Read) -> Result<Event, ProcessError> {
    let mut head = [0u8; 5];
    body.read_exact(&mut head)
        .map_err(|e| ProcessError::from(super::read_error(e)))?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(EnvdError::BadAnswer(format!("a {len}-byte message")).into());
    }
    let mut msg = vec![0u8; len];
    body.read_exact(&mut msg)
        .map_err(|e| ProcessError::from(super::read_error(e)))?;
    let v: Value = serde_json::from_slice(&msg)
        .map_err(|e| EnvdError::BadAnswer(format!("a message that is not JSON: {e}")))?;
    if head[0] & 0x02 != 0 {
        return Ok(Event::Closed(v.get("error").map(|e| {
            format!(
                "{}: {}",
                e["code"].as_str().unwrap_or("unknown"),
                e["message"].as_str().unwrap_or("")
            )
        })));
    }
    let event = &v["event"];
    if let Some(pid) = event["start"]["pid"].as_u64() {
        return Ok(Event::Started(pid as u32));
    }
    if let Some(data) = event.get("data") {
        for (field, stream) in [("stdout", Stream::Stdout), ("stderr", Stream::Stderr)] {
            if let Some(b64) = data[field].as_str() {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|e| EnvdError::BadAnswer(format!("output not base64: {e}")))?;
                return Ok(Event::Output(stream, bytes));
            }
        }
    }
    if let Some(end) = event.get("end") {
        return Ok(Event::End(ProcessEnd {
            exit_code: end["exitCode"].as_i64().unwrap_or(-1) as i32,
            status: end["status"].as_str().unwrap_or("unknown").to_string(),
        }));
    }
    Ok(Event::Other)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flags: u8, v: Value) -> Vec<u8> {
        let p = v.to_string();
        let mut out = vec![flags];
        out.extend_from_slice(&(p.len() as u32).to_be_bytes());
        out.extend_from_slice(p.as_bytes());
        out
    }

    #[test]
    fn events_decode_and_oversize_messages_are_refused() {
        let mut stream = Vec::new();
        stream.extend(frame(0, json!({"event": {"start": {"pid": 7}}})));
        stream.extend(frame(0, json!({"event": {"data": {"stdout": "aGk="}}})));
        stream.extend(frame(
            0,
            json!({"event": {"end": {"exitCode": 3, "status": "exit status 3"}}}),
        ));
        stream.extend(frame(
            2,
            json!({"error": {"code": "not_found", "message": "x"}}),
        ));
        let mut r = &stream[..];
        assert!(matches!(next_event(&mut r).unwrap(), Event::Started(7)));
        assert!(
            matches!(next_event(&mut r).unwrap(), Event::Output(Stream::Stdout, b) if b == b"hi")
        );
        assert!(matches!(next_event(&mut r).unwrap(), Event::End(e) if e.exit_code == 3));
        assert!(
            matches!(next_event(&mut r).unwrap(), Event::Closed(Some(e)) if e == "not_found: x")
        );
        let mut big = vec![0u8, 0x7f, 0, 0, 0];
        big.extend(vec![b' '; 16]);
        assert!(next_event(&mut &big[..]).is_err());
    }
}
