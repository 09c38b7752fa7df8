//! Schemathesis (installed by scripts/setup.sh) against the real server binary and the
//! document it serves at `GET /openapi.json`: once with the API key, once without, about a
//! minute each. Every response below 500 and as documented, the process alive and its RSS
//! stable.
//!
//! No VM boots: tests/fuzz/hooks.py points every generated image at a missing local OCI
//! layout (creates and template builds fail with 400 or an `error` build), no template is
//! ready and random sandbox ids are unknown (404). Every operation of the document is still
//! exercised, positive and negative data alike.

mod common;

use common::*;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SCHEMATHESIS: &str = "/opt/agentenv-tests/venv/bin/st";
/// Schemathesis' time budget per run.
const RUN_SECS: u64 = 55;

#[test]
fn schemathesis_finds_no_server_errors() {
    assert!(
        Path::new(SCHEMATHESIS).exists(),
        "{SCHEMATHESIS} is missing: run scripts/setup.sh"
    );
    let s = Server::start("");
    let pid = s.child.as_ref().unwrap().id();
    let rss_start = rss_kib(pid);
    let work = s.state_dir.parent().unwrap().join("fuzz");
    std::fs::create_dir_all(&work).unwrap();

    for key in [Some(API_KEY), None] {
        let log_from = s.log().len();
        let output = run_schemathesis(&s, &work, key);
        let log = s.log();
        let statuses = response_statuses(&log[log_from..]);
        let label = if key.is_some() {
            "with the key"
        } else {
            "without a key"
        };
        let server_errors: Vec<&String> = statuses.iter().filter(|l| status_of(l) >= 500).collect();
        assert!(
            server_errors.is_empty(),
            "{label}: {} responses >= 500:\n{}\n\nschemathesis:\n{output}",
            server_errors.len(),
            server_errors
                .iter()
                .take(20)
                .map(|l| l.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
        // A failed check (a 5xx, or an answer the document does not describe) fails the
        // test; schemathesis' own generation errors (its bugs) only show in the output.
        assert!(
            !output.contains(" FAILURES "),
            "{label}: schemathesis checks failed:\n{output}"
        );
        assert!(
            statuses.len() >= 300,
            "{label}: only {} requests reached the server; did schemathesis run?\n{output}",
            statuses.len()
        );
        if key.is_some() {
            // The key opened the routes: not everything was 401.
            assert!(statuses.iter().any(|l| status_of(l) == 404), "{output}");
        } else {
            // Keyless by design: health, metrics, the document, the console's own files, the
            // template upload link (its own token: 403 when wrong) and the volume content API.
            let public = [
                "path=/health ",
                "path=/metrics ",
                "path=/openapi.json ",
                "path=/console",
            ];
            let upload_link = |l: &str| {
                l.contains("method=PUT path=/templates/")
                    && l.contains("/files/")
                    && status_of(l) == 403
            };
            // The volume content API checks the volume's token itself (401 without); a
            // method it does not have is 405 before any handler runs, serving nothing.
            let content_method =
                |l: &str| l.contains("path=/volumecontent/") && status_of(l) == 405;
            let open: Vec<&String> = statuses
                .iter()
                .filter(|l| status_of(l) != 401 && !public.iter().any(|p| l.contains(p)))
                .filter(|l| !upload_link(l) && !content_method(l))
                .collect();
            assert!(open.is_empty(), "answered without a key: {open:?}");
        }
        eprintln!(
            "schemathesis {label}: {} requests, none >= 500",
            statuses.len()
        );
    }

    let rss_end = rss_kib(pid);
    eprintln!("server RSS: {rss_start} KiB at start, {rss_end} KiB after fuzzing");
    assert!(
        rss_end < 2 * rss_start + 32 * 1024,
        "RSS grew from {rss_start} KiB to {rss_end} KiB"
    );
    assert_health_within_1s(&s);
    assert!(
        qemu_processes_with(s.state_dir.to_str().unwrap()).is_empty(),
        "fuzzing booted a VM"
    );
}

/// Runs schemathesis for [`RUN_SECS`] against the served document; returns its output.
fn run_schemathesis(s: &Server, work: &Path, key: Option<&str>) -> String {
    let out_path: PathBuf = work.join(format!("st-{}.out", key.is_some()));
    let out = std::fs::File::create(&out_path).unwrap();
    let mut cmd = Command::new(SCHEMATHESIS);
    cmd.arg("run")
        .arg(format!("{}/openapi.json", s.base))
        .args(["--checks", "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"])
        .args(["--max-time", &RUN_SECS.to_string()])
        .args(["--workers", "2", "--request-timeout", "30"])
        .env("SCHEMATHESIS_HOOKS", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz/hooks.py"))
        .env("NO_COLOR", "1")
        .current_dir(work)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    if let Some(key) = key {
        cmd.args(["-H", &format!("X-API-Key: {key}")]);
    }
    let mut child = cmd.spawn().expect("start schemathesis");
    let deadline = Instant::now() + Duration::from_secs(RUN_SECS + 120);
    let status = wait_exit(&mut child, deadline).unwrap_or_else(|| {
        panic!(
            "schemathesis ran past its budget:\n{}",
            std::fs::read_to_string(&out_path).unwrap_or_default()
        )
    });
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    if !status.success() {
        eprintln!("schemathesis exited with {status}:\n{output}");
    }
    output
}

/// The server's per-request log lines (`method=… path=… status=…`).
fn response_statuses(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("method=") && l.contains(" path=") && l.contains(" status="))
        .map(str::to_string)
        .collect()
}

fn status_of(line: &str) -> u16 {
    line.split(" status=")
        .nth(1)
        .and_then(|s| s.get(..3))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("server process {pid} is gone: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

fn assert_health_within_1s(s: &Server) {
    let started = Instant::now();
    let mut c = TcpStream::connect(s.base.trim_start_matches("http://")).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    let _ = std::io::Read::read_to_string(&mut c, &mut answer);
    assert!(answer.starts_with("HTTP/1.1 204"), "{answer}\n{}", s.log());
    assert!(started.elapsed() < Duration::from_secs(1));
}
