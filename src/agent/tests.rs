//! The host client against the real guest-side logic over a unix socket pair: no VM.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{AgentClient, AgentError, ExecRequest};
use crate::guest::reaper::Reaper;
use crate::guest::{AgentServer, OnEof};

fn pair() -> AgentClient {
    let (host, guest) = UnixStream::pair().unwrap();
    let writer = guest.try_clone().unwrap();
    std::thread::spawn(move || {
        AgentServer::new(Reaper::own_children(), false, Box::new(writer)).serve(guest, OnEof::Stop)
    });
    let client = AgentClient::from_stream(host).unwrap();
    client.ping(Duration::from_secs(5)).unwrap();
    client
}

fn req(cmd: &str, args: &[&str]) -> ExecRequest {
    ExecRequest {
        cmd: cmd.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        env: vec![],
        cwd: "/".into(),
        timeout_ms: 10_000,
        max_output_bytes: 1 << 20,
    }
}

fn temp_dir(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "agentenv-agent-test-{name}-{}-{n}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e3779b97f4a7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn exec_captures_streams_and_exit_code() {
    let c = pair();
    let r = c
        .exec(&req("sh", &["-c", "echo out; echo err >&2; exit 3"]))
        .unwrap();
    assert_eq!(r.exit_code, 3);
    assert_eq!(r.stdout, "out\n");
    assert_eq!(r.stderr, "err\n");
    assert!(!r.timed_out && !r.stdout_truncated && !r.stderr_truncated);
}

#[test]
fn exec_env_cwd_and_empty_stdin() {
    let c = pair();
    let mut r = req("sh", &["-c", "printf '%s %s ' \"$FOO\" \"$PWD\"; pwd; cat"]);
    r.env = vec![("FOO".into(), "a".into()), ("FOO".into(), "b".into())];
    r.cwd = "/tmp".into();
    let res = c.exec(&r).unwrap();
    assert_eq!(res.exit_code, 0, "{res:?}");
    assert_eq!(res.stdout, "b /tmp /tmp\n");
}

#[test]
fn exec_not_found_and_not_executable() {
    let c = pair();
    let r = c.exec(&req("no-such-command-agentenv", &[])).unwrap();
    assert_eq!(r.exit_code, 127);
    assert!(r.stderr.contains("command not found"), "{}", r.stderr);

    let dir = temp_dir("noexec");
    let script = dir.join("script");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = c.exec(&req(script.to_str().unwrap(), &[])).unwrap();
    assert_eq!(r.exit_code, 126);
    assert!(r.stderr.contains("permission denied"), "{}", r.stderr);

    let r = c.exec(&req("/no/such/path", &[])).unwrap();
    assert_eq!(r.exit_code, 127);

    let mut bad_cwd = req("true", &[]);
    bad_cwd.cwd = "/no/such/dir".into();
    assert!(matches!(c.exec(&bad_cwd), Err(AgentError::InvalidPath(_))));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn exec_timeout_kills_the_group() {
    let c = pair();
    let mut r = req("sh", &["-c", "sleep 30 & sleep 30"]);
    r.timeout_ms = 300;
    let start = Instant::now();
    let res = c.exec(&r).unwrap();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(res.timed_out);
    assert_eq!(res.exit_code, 137);
}

#[test]
fn exec_signal_exit_code() {
    let c = pair();
    let r = c.exec(&req("sh", &["-c", "kill -TERM $$"])).unwrap();
    assert_eq!(r.exit_code, 128 + 15);
    assert!(!r.timed_out);
}

#[test]
fn exec_truncates_each_stream_separately() {
    let c = pair();
    let mut r = req(
        "sh",
        &[
            "-c",
            "head -c 300000 /dev/zero | tr '\\0' x; echo small >&2",
        ],
    );
    r.max_output_bytes = 1000;
    let res = c.exec(&r).unwrap();
    assert_eq!(res.exit_code, 0);
    assert_eq!(res.stdout.len(), 1000);
    assert!(res.stdout_truncated);
    assert_eq!(res.stderr, "small\n");
    assert!(!res.stderr_truncated);
}

#[test]
fn exec_invalid_utf8_is_replaced() {
    let c = pair();
    let res = c.exec(&req("printf", &["a\\377b"])).unwrap();
    assert_eq!(res.stdout, "a\u{fffd}b");
}

#[test]
fn exec_returns_when_the_process_exits_even_if_descendants_hold_the_pipes() {
    let c = pair();
    let start = Instant::now();
    let res = c
        .exec(&req("sh", &["-c", "sleep 5 & echo started"]))
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(res.exit_code, 0);
    assert_eq!(res.stdout, "started\n");
}

#[test]
fn commands_run_concurrently() {
    let c = Arc::new(pair());
    let start = Instant::now();
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let c = c.clone();
            std::thread::spawn(move || {
                let r = c.exec(&req("sh", &["-c", &format!("sleep 0.5; echo {i}")]));
                (i, r.unwrap())
            })
        })
        .collect();
    for h in handles {
        let (i, r) = h.join().unwrap();
        assert_eq!(r.stdout, format!("{i}\n"));
    }
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn file_round_trip_5mib() {
    let c = pair();
    let dir = temp_dir("files");
    let path = dir.join("new/sub/data.bin");
    let data = pseudo_random(5 * 1024 * 1024 + 123);
    c.write_file(path.to_str().unwrap(), data.len() as u64, &mut &data[..])
        .unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    let parent_mode = std::fs::metadata(dir.join("new/sub"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(parent_mode & 0o777, 0o755);

    let mut dl = c.read_file(path.to_str().unwrap()).unwrap();
    assert_eq!(dl.size(), data.len() as u64);
    let mut back = Vec::new();
    dl.read_to_end(&mut back).unwrap();
    assert!(back == data, "downloaded bytes differ");

    // Overwrite atomically with a shorter file; no temp files left behind.
    c.write_file(path.to_str().unwrap(), 3, &mut &b"abc"[..])
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"abc");
    assert_eq!(std::fs::read_dir(dir.join("new/sub")).unwrap().count(), 1);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn file_errors() {
    let c = pair();
    let dir = temp_dir("errors");
    let missing = dir.join("missing.txt");
    match c.read_file(missing.to_str().unwrap()) {
        Err(AgentError::NotFound(m)) => assert!(m.contains("missing.txt"), "{m}"),
        other => panic!("expected NotFound, got {:?}", other.err()),
    }
    assert!(matches!(
        c.read_file(dir.to_str().unwrap()),
        Err(AgentError::InvalidPath(_))
    ));
    assert!(matches!(
        c.read_file("/dev/null"),
        Err(AgentError::InvalidPath(_))
    ));
    assert!(matches!(
        c.write_file(dir.to_str().unwrap(), 1, &mut &b"x"[..]),
        Err(AgentError::InvalidPath(_))
    ));
    assert!(matches!(
        c.read_file("relative/path"),
        Err(AgentError::InvalidPath(_))
    ));
    // A body shorter than announced fails on the host and leaves nothing behind.
    let short = dir.join("short");
    assert!(matches!(
        c.write_file(short.to_str().unwrap(), 10, &mut &b"abc"[..]),
        Err(AgentError::Upload(_))
    ));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    // The connection is still usable.
    c.ping(Duration::from_secs(5)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn transfers_do_not_block_other_calls() {
    let c = pair();
    let dir = temp_dir("interleave");
    let path = dir.join("big");
    let data = pseudo_random(8 * 1024 * 1024);
    std::fs::write(&path, &data).unwrap();
    let mut dl = c.read_file(path.to_str().unwrap()).unwrap();
    let mut first = vec![0u8; 1000];
    dl.read_exact(&mut first).unwrap();
    // The download is paused by flow control; a command still gets through.
    let r = c.exec(&req("echo", &["hi"])).unwrap();
    assert_eq!(r.stdout, "hi\n");
    drop(dl);
    c.ping(Duration::from_secs(5)).unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn set_time_is_acknowledged() {
    let c = pair();
    c.set_time(1_700_000_000_000_000_000).unwrap();
}

#[test]
fn client_reports_unreachable_when_agent_goes_away() {
    let (host, guest) = UnixStream::pair().unwrap();
    let c = AgentClient::from_stream(host).unwrap();
    drop(guest);
    assert!(matches!(
        c.ping(Duration::from_secs(5)),
        Err(AgentError::Unreachable(_))
    ));
}

#[test]
fn connect_times_out_on_missing_socket() {
    let start = Instant::now();
    let res = AgentClient::connect(
        std::path::Path::new("/nonexistent/agent.sock"),
        Instant::now() + Duration::from_millis(200),
    );
    assert!(matches!(res, Err(AgentError::Unreachable(_))));
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_guest_agent_told_to_break_the_protocol_gets_its_channel_closed() {
    let trigger = temp_dir("fault").join("break-protocol");
    let (host, guest) = UnixStream::pair().unwrap();
    let writer = guest.try_clone().unwrap();
    let at = trigger.clone();
    std::thread::spawn(move || {
        AgentServer::new(Reaper::own_children(), false, Box::new(writer))
            .with_fault_trigger(&at)
            .serve(guest, OnEof::Stop)
    });
    let client = AgentClient::from_stream(host).unwrap();
    client.ping(Duration::from_secs(5)).unwrap();
    // Without the file, commands run as usual.
    assert_eq!(client.exec(&req("true", &[])).unwrap().exit_code, 0);
    assert!(client.protocol_violation().is_none());
    // The command that creates it still gets its answer; then the agent breaks the
    // protocol, once.
    let touched = client.exec(&req("touch", &[trigger.to_str().unwrap()]));
    assert_eq!(touched.unwrap().exit_code, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let violation = loop {
        if let Some(v) = client.protocol_violation() {
            break v;
        }
        assert!(Instant::now() < deadline, "no protocol violation reported");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        violation.contains("Data frame of 65537 bytes"),
        "{violation}"
    );
    assert!(!trigger.exists(), "the trigger is used up");
    assert!(matches!(
        client.ping(Duration::from_secs(5)),
        Err(AgentError::Protocol(_))
    ));
}

#[test]
fn metrics_are_sampled_over_the_channel_by_one_thread() {
    let c = pair();
    let m = c.metrics(Duration::from_secs(5)).unwrap();
    // The "guest" here is this host: its own /proc and root filesystem.
    assert!(m.cpu_count >= 1, "{m:?}");
    assert!((0.0..=100.0).contains(&m.cpu_used_pct), "{m:?}");
    assert!(m.mem_total > m.mem_used && m.mem_used > 0, "{m:?}");
    assert!(m.disk_total >= m.disk_used && m.disk_total > 0, "{m:?}");
    // More calls at once than the queue holds: each is answered, a sample or a refusal,
    // and the channel goes on.
    let c = Arc::new(c);
    let answers: Vec<_> = (0..12)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || c.metrics(Duration::from_secs(10)))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    assert!(answers.iter().any(|a| a.is_ok()));
    for a in &answers {
        match a {
            Ok(_) => {}
            Err(AgentError::Io(m)) => assert!(m.contains("busy"), "{m}"),
            Err(e) => panic!("unexpected answer: {e}"),
        }
    }
    c.ping(Duration::from_secs(5)).unwrap();
}
