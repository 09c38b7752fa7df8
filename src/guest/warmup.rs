//! The envd half of a warm standby's warm-up (docs/architecture.md, "Standby pool"):
//! the calls an E2B SDK's first command and first file write make, sent to this guest's
//! own envd over loopback, so that the code they run (the guest kernel's socket and
//! process paths, envd's HTTP and Connect handling, the shell) is translated before a
//! client calls. The NIC's carrier is down meanwhile: nothing here leaves the guest.
//!
//! The warm-up leaves nothing behind: the process it starts ends before the answer, the
//! file it writes through envd (`<path>-envd`, as envd's default user) and the one the
//! host's half wrote through the agent (`path`, as root) are removed, and no call changes
//! envd's settings (`/init` is not called).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use super::GuestError;
use crate::protocol::connect;

/// Longest wait for one warm-up call.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest answer read from envd (the warm-up's own, small).
const MAX_ANSWER: u64 = 1 << 20;
/// What the warm-up's command prints, and its file holds.
const MARK: &str = "agentenv-warmup";
const BOUNDARY: &str = "agentenv-warmup-boundary";

/// Runs the SDK's first calls against envd on `port`: a process start with its output
/// stream (`/bin/bash -l -c`, as the SDKs run commands), an upload and a download of
/// `<path>-envd`; then removes both that file and `path`.
pub fn run(port: u16, path: &str) -> Result<(), GuestError> {
    let envd_file = format!("{path}-envd");
    let done = calls(port, &envd_file);
    let mut removed = Ok(());
    for file in [path, envd_file.as_str()] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                removed = Err(GuestError::Io(format!(
                    "cannot remove the warm-up file {file}: {e}"
                )));
            }
            _ => {}
        }
    }
    done.and(removed)
}

fn calls(port: u16, path: &str) -> Result<(), GuestError> {
    let shell = if std::path::Path::new("/bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    };
    let start = serde_json::json!({
        "process": {"cmd": shell, "args": ["-l", "-c", format!("echo {MARK}")], "envs": {}},
        "stdin": false,
    });
    let body = connect::envelope(0, start.to_string().as_bytes());
    let head = "POST /process.Process/Start HTTP/1.1\r\n\
                Content-Type: application/connect+json\r\nConnect-Protocol-Version: 1\r\n";
    let answer = exchange(port, head, &body)?;
    // The output arrives base64-encoded; the end event carries the exit code.
    expect(&answer, "process start", &["\"data\"", "\"exitCode\":0"])?;

    let mut upload = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{path}\"\r\n\
         Content-Type: application/octet-stream\r\n\r\n{MARK}\r\n--{BOUNDARY}--\r\n"
    )
    .into_bytes();
    let head = format!(
        "POST /files?path={path} HTTP/1.1\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
    );
    let answer = exchange(port, &head, &upload)?;
    expect(&answer, "file upload", &[path])?;
    upload.clear();

    let head = format!("GET /files?path={path} HTTP/1.1\r\n");
    let answer = exchange(port, &head, &upload)?;
    expect(&answer, "file download", &[MARK])
}

/// One HTTP/1.1 exchange (`Connection: close`); the whole answer, bounded.
fn exchange(port: u16, head: &str, body: &[u8]) -> Result<Vec<u8>, GuestError> {
    let io = |e: std::io::Error| GuestError::Io(format!("warm-up call to envd failed: {e}"));
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut stream = TcpStream::connect_timeout(&addr, CALL_TIMEOUT).map_err(io)?;
    stream.set_read_timeout(Some(CALL_TIMEOUT)).map_err(io)?;
    stream.set_write_timeout(Some(CALL_TIMEOUT)).map_err(io)?;
    let request = format!(
        "{head}Host: localhost\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(io)?;
    stream.write_all(body).map_err(io)?;
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER)
        .read_to_end(&mut answer)
        .map_err(io)?;
    Ok(answer)
}

/// A 200 whose bytes hold every one of `marks`.
fn expect(answer: &[u8], what: &str, marks: &[&str]) -> Result<(), GuestError> {
    let text = String::from_utf8_lossy(answer);
    let ok = text.starts_with("HTTP/1.1 200") && marks.iter().all(|m| text.contains(m));
    if ok {
        return Ok(());
    }
    let shown: String = text.chars().take(300).collect();
    Err(GuestError::Io(format!("warm-up {what} answered: {shown}")))
}
