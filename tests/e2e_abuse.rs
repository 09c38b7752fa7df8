//! Hostile and careless clients at the socket level (issue: "the API server survives
//! hostile and careless clients"). Raw TCP against the real server binary; after every
//! attack the process still runs and `GET /health` answers within 1 s. No VM is booted
//! here (tests/e2e_abuse_vm.rs has the attacks that need a sandbox).

mod common;

use common::*;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Tight timeouts so the test sees them fire; test faults on.
const KEYS: &str = "header_timeout_secs = 2\nidle_timeout_secs = 3\nbody_timeout_secs = 2\nmax_connections = 64\nquick_threads = 2\nhttp_threads = 4";

#[test]
fn hostile_clients_cannot_crash_wedge_or_starve_the_server() {
    let mut s = Server::builder()
        .server_keys(KEYS)
        .env("AENV_TEST_FAULTS", "1")
        .start();
    huge_content_length(&mut s);
    bad_content_lengths(&mut s);
    unread_bodies_close_the_connection(&mut s);
    early_answers_reach_a_client_still_sending(&mut s);
    stalled_bodies(&mut s);
    slowloris_headers(&mut s);
    oversize_headers(&mut s);
    idle_connections_are_closed(&mut s);
    keep_alive_and_chunked_bodies_still_work(&mut s);
    panics_cost_one_request(&mut s);
    connection_flood(&mut s);
    let log = s.log();
    assert!(
        !log.contains("memory allocation") && !log.contains("capacity overflow"),
        "{log}"
    );
    drop(s);
    // Without AENV_TEST_FAULTS the fault header does nothing.
    let s = Server::builder()
        .section("[admission]\nmax_memory_mb = 200\n")
        .start();
    let (code, _) = s.raw(&format!(
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nX-Aenv-Test-Fault: panic\r\nConnection: close\r\n\r\n"
    ));
    assert_eq!(code, 200);
    admission_control(&s);
}

/// `[admission] max_memory_mb = 200`: a 256 MiB sandbox is refused with 429 naming memory,
/// before any VM starts; nothing is left behind.
fn admission_control(s: &Server) {
    let (code, v) = s.call(
        "POST",
        "/sandboxes-cold",
        Some(serde_json::json!({"image": base_image(), "memoryMB": 256})),
    );
    assert_eq!(code, 429, "{v}");
    assert!(v["message"].as_str().unwrap().contains("memory"), "{v}");
    let (code, v) = s.call("GET", "/sandboxes", None);
    assert_eq!((code, v), (200, serde_json::json!([])));
    assert!(qemu_processes_with(s.state_dir.to_str().unwrap()).is_empty());
}

fn addr(s: &Server) -> String {
    s.base.trim_start_matches("http://").to_string()
}

fn connect(s: &Server) -> TcpStream {
    let c = TcpStream::connect(addr(s)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c
}

/// Reads one response head; returns its status (0 when the connection closed first).
fn read_status(c: &mut TcpStream) -> u16 {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match c.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head)
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// Reads one whole response (head and body by Content-Length).
fn read_response(c: &mut TcpStream) -> (u16, String) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match c.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    if let Err(e) = c.read_exact(&mut body) {
        return (0, format!("status {status}, then the body was lost: {e}"));
    }
    (status, String::from_utf8_lossy(&body).to_string())
}

/// The server closes `c` within `within` (EOF or reset, no further answer).
fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
    c.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// The process runs and `GET /health` answers 204 within 1 s.
fn assert_healthy(s: &mut Server, after: &str) {
    if let Some(status) = s.child.as_mut().unwrap().try_wait().unwrap() {
        panic!("server died after {after} ({status}):\n{}", s.log());
    }
    let started = Instant::now();
    let mut c = TcpStream::connect(addr(s)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let status = read_status(&mut c);
    let took = started.elapsed();
    assert_eq!(status, 204, "GET /health after {after}:\n{}", s.log());
    assert!(
        took < Duration::from_secs(1),
        "GET /health took {took:?} after {after}"
    );
}

/// An authenticated quick read answers within 1 s too.
fn assert_reads_answer(s: &Server, during: &str) {
    let started = Instant::now();
    let mut c = connect(s);
    c.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    write!(
        c,
        "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    assert_eq!(read_status(&mut c), 200, "GET /sandboxes during {during}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "GET /sandboxes during {during}"
    );
}

fn huge_content_length(s: &mut Server) {
    // The original crash: 401, then `memory allocation of 4611686018427387904 bytes failed`.
    for length in ["4611686018427387904", "18446744073709551615"] {
        let mut c = connect(s);
        write!(
            c,
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
        )
        .unwrap();
        assert_eq!(read_status(&mut c), 401);
        assert!(
            closed_within(&mut c, Duration::from_secs(5)),
            "unread body keeps the connection"
        );
        assert_healthy(s, &format!("unauthenticated Content-Length {length}"));
        let mut c = connect(s);
        write!(
            c,
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n{{}}"
        )
        .unwrap();
        let (code, body) = read_response(&mut c);
        assert_eq!(code, 413, "{body}");
        assert!(body.contains("max_body_bytes"), "{body}");
        assert!(closed_within(&mut c, Duration::from_secs(5)));
        assert_healthy(s, &format!("authenticated Content-Length {length}"));
    }
}

fn bad_content_lengths(s: &mut Server) {
    for lengths in [
        "Content-Length: 18446744073709551616\r\n",
        "Content-Length: abc\r\n",
        "Content-Length: 2\r\nContent-Length: 3\r\n",
    ] {
        let mut c = connect(s);
        write!(
            c,
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\n{lengths}\r\n{{}}"
        )
        .unwrap();
        assert_eq!(read_status(&mut c), 400, "{lengths:?}");
        assert!(closed_within(&mut c, Duration::from_secs(5)));
    }
    assert_healthy(s, "bad Content-Length headers");
}

fn unread_bodies_close_the_connection(s: &mut Server) {
    // 401 and 413 answered without reading a 10 MiB / 2 MiB body: the connection closes
    // instead of the server draining (or allocating) it.
    let chunk = vec![b'x'; 64 * 1024];
    let cases = [
        (String::new(), 10 << 20, 401),
        (format!("X-API-Key: {API_KEY}\r\n"), 2 << 20, 413),
    ];
    for (auth, length, want) in cases {
        let mut c = connect(s);
        write!(
            c,
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
        .unwrap();
        c.write_all(&chunk).unwrap();
        assert_eq!(read_status(&mut c), want);
        assert!(
            closed_within(&mut c, Duration::from_secs(5)),
            "status {want}"
        );
        assert_healthy(s, &format!("{want} with an unread body"));
    }
    // A small unread rest is drained and the connection stays usable.
    let mut c = connect(s);
    c.write_all(b"POST /sandboxes HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        .unwrap();
    assert_eq!(read_response(&mut c).0, 401);
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(read_status(&mut c), 204);
}

/// A client that sends its whole request before reading (as simple HTTP clients do) gets
/// the 401 or 413 the server answered early: the server shuts its side down and discards
/// what still comes (a lingering close) instead of closing with unread data, whose reset
/// fails the client's send before it ever reads the answer.
fn early_answers_reach_a_client_still_sending(s: &mut Server) {
    // More than loopback's socket buffers hold, so the server must read for the client to
    // finish sending.
    let length = 24 << 20;
    let cases = [
        (String::new(), 401),
        (format!("X-API-Key: {API_KEY}\r\n"), 413),
    ];
    for (auth, want) in cases {
        for round in 0..3 {
            let mut c = connect(s);
            c.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(
                c,
                "POST /sandboxes HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            )
            .unwrap();
            let chunk = vec![b' '; 1 << 20];
            for i in 0..length / chunk.len() {
                if let Err(e) = c.write_all(&chunk) {
                    panic!("{want} round {round}: sending MiB {i} failed: {e}");
                }
            }
            let (code, body) = read_response(&mut c);
            assert_eq!(code, want, "round {round}: {body}");
            assert!(closed_within(&mut c, Duration::from_secs(5)));
        }
        assert_healthy(s, &format!("{want} while the client was still sending"));
    }
}

fn stalled_bodies(s: &mut Server) {
    // 40 JSON bodies (more than every worker) and 20 large uploads that stop mid-body.
    let mut stalled = Vec::new();
    for _ in 0..40 {
        let mut c = connect(s);
        write!(
            c,
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 2048\r\n\r\n{{\"templateID\":"
        )
        .unwrap();
        stalled.push(c);
    }
    let id = "01900000-0000-7000-8000-000000000000";
    let mut uploads = Vec::new();
    for _ in 0..20 {
        let mut c = connect(s);
        write!(
            c,
            "PUT /sandboxes/{id}/files?path=/x HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Length: 50000000\r\n\r\n"
        )
        .unwrap();
        c.write_all(&[0u8; 1000]).unwrap();
        uploads.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_healthy(s, "stalled bodies");
    assert_reads_answer(s, "stalled bodies");
    // The control lane still works: a bad create answers at once.
    let started = Instant::now();
    let mut c = connect(s);
    write!(
        c,
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    )
    .unwrap();
    assert_eq!(read_status(&mut c), 422);
    assert!(started.elapsed() < Duration::from_secs(1));
    // Past header_timeout_secs (2 s) a stalled small body gets 408 and is closed.
    for c in stalled.iter_mut() {
        assert_eq!(read_status(c), 408);
        assert!(closed_within(c, Duration::from_secs(5)));
    }
    // The uploads' sandbox does not exist (404); the unread rest closes each connection.
    for c in uploads.iter_mut() {
        assert_eq!(read_status(c), 404);
        assert!(closed_within(c, Duration::from_secs(5)));
    }
    assert_healthy(s, "stalled bodies timed out");
}

fn slowloris_headers(s: &mut Server) {
    let mut conns: Vec<TcpStream> = (0..40)
        .map(|_| {
            let mut c = connect(s);
            c.write_all(b"GET /health HTTP/1.1\r\nX-Slow: ").unwrap();
            c
        })
        .collect();
    // One more byte every 200 ms: each read makes progress, the deadline still holds.
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1200) {
        for c in conns.iter_mut() {
            let _ = c.write_all(b"a");
        }
        std::thread::sleep(Duration::from_millis(200));
        assert_healthy(s, "slowloris (open)");
    }
    let mut timed_out = 0;
    for c in conns.iter_mut() {
        let _ = c.write_all(b"a");
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if read_status(c) == 408 {
            timed_out += 1;
        }
    }
    assert_eq!(
        timed_out,
        conns.len(),
        "header_timeout_secs ends every slow request"
    );
    assert!(started.elapsed() < Duration::from_secs(8));
    assert_healthy(s, "slowloris");
}

fn oversize_headers(s: &mut Server) {
    let mut c = connect(s);
    let mut request = b"GET /health HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..70 {
        request.extend_from_slice(format!("X-Big-{i}: {}\r\n", "y".repeat(1000)).as_bytes());
    }
    request.extend_from_slice(b"\r\n");
    c.write_all(&request).unwrap();
    assert_eq!(read_status(&mut c), 431);
    assert!(closed_within(&mut c, Duration::from_secs(5)));
    // One endless header line, too.
    let mut c = connect(s);
    c.write_all(b"GET /health HTTP/1.1\r\nX-Long: ").unwrap();
    let _ = c.write_all(&vec![b'z'; 100 * 1024]);
    assert_eq!(read_status(&mut c), 431);
    assert_healthy(s, "oversize headers");
}

fn idle_connections_are_closed(s: &mut Server) {
    let mut c = connect(s);
    let started = Instant::now();
    assert!(closed_within(&mut c, Duration::from_secs(8)));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2),
        "closed after {took:?}, idle_timeout_secs is 3"
    );
    assert_healthy(s, "idle connections");
}

fn keep_alive_and_chunked_bodies_still_work(s: &mut Server) {
    let mut c = connect(s);
    for _ in 0..3 {
        write!(
            c,
            "GET /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\n\r\n"
        )
        .unwrap();
        let (code, body) = read_response(&mut c);
        assert_eq!((code, body.as_str()), (200, "[]"));
    }
    write!(
        c,
        "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n"
    )
    .unwrap();
    let (code, body) = read_response(&mut c);
    assert_eq!(code, 422, "{body}");
    write!(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(read_status(&mut c), 204);
}

fn panics_cost_one_request(s: &mut Server) {
    // More panics than any lane has workers (quick_threads = 2, http_threads = 4).
    for (method, path) in [("GET", "/sandboxes"), ("POST", "/templates")] {
        for _ in 0..10 {
            let mut c = connect(s);
            write!(
                c,
                "{method} {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nX-Aenv-Test-Fault: panic\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let (code, body) = read_response(&mut c);
            assert_eq!(code, 500);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["code"], 500, "{body}");
        }
    }
    assert_healthy(s, "handler panics");
    assert_reads_answer(s, "after handler panics");
    let (code, _) = s.call("POST", "/templates", Some(serde_json::json!({})));
    assert_eq!(code, 422, "the control lane keeps its workers");
}

fn connection_flood(s: &mut Server) {
    // max_connections = 64: the rest are answered 503 and closed at once.
    let mut conns: Vec<TcpStream> = (0..100).map(|_| connect(s)).collect();
    let mut refused = 0;
    for c in conns.iter_mut() {
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut buf = [0u8; 256];
        if let Ok(n) = c.read(&mut buf) {
            if String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 503") {
                refused += 1;
            }
        }
    }
    assert!(
        (30..=40).contains(&refused),
        "{refused} of 100 refused with max_connections 64"
    );
    drop(conns);
    // The refused and closed connections are gone at once.
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline {
        let mut c = connect(s);
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        if read_status(&mut c) == 204 {
            break;
        }
    }
    assert_healthy(s, "connection flood");
}
