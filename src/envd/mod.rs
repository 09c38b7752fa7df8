//! Host side of a guest's envd: E2B's in-sandbox HTTP surface (Connect RPC, `/files`,
//! `/health`, `/init`), served by the guest agent at `<hostInteractionIp>:<[agent] port>`.
//!
//! One HTTP/1.1 exchange per TCP connection (`Connection: close`), half duplex: the
//! request head and body go out, then the answer head is read and its body streamed.
//! The guest is untrusted: the answer head is bounded in size and header count, chunk
//! framing is checked strictly, every write has a timeout, and a read that waits sees a
//! deadline and a liveness check (a sandbox paused or deleted under a long stream ends
//! it at once instead of leaving a thread waiting on a dead address).
//!
//! Callers: the envd proxy (`api/envd_proxy.rs`) on its stream threads.

mod chunked;
pub mod process;
pub mod tunnel;

pub use chunked::ChunkedReader;

use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest answer head (status line and headers) taken from a guest.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most headers taken from a guest.
pub const MAX_HEADERS: usize = 64;
/// How long a connection to the guest may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one write to the guest may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// A waiting read wakes this often to check the deadline and the sandbox.
const POLL: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub enum EnvdError {
    /// No connection (the guest does not listen, or its network is down).
    Connect(io::Error),
    /// The exchange broke after the connection was made.
    Io(io::Error),
    /// The guest answered something that is not bounded HTTP/1.1.
    BadAnswer(String),
    /// Nothing came within the idle limit.
    Timeout,
    /// The sandbox stopped running while the exchange waited.
    Stopped,
}

impl fmt::Display for EnvdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EnvdError::Connect(e) => write!(f, "cannot connect to the sandbox's envd: {e}"),
            EnvdError::Io(e) => write!(f, "connection to the sandbox's envd failed: {e}"),
            EnvdError::BadAnswer(m) => write!(f, "the sandbox's envd answered badly: {m}"),
            EnvdError::Timeout => write!(f, "the sandbox's envd did not answer in time"),
            EnvdError::Stopped => write!(f, "the sandbox stopped running"),
        }
    }
}

impl std::error::Error for EnvdError {}

/// When a read that waits gives up: after `idle` without a byte, or when `alive` says
/// the sandbox no longer runs.
#[derive(Clone)]
pub struct Patience {
    pub idle: Duration,
    pub alive: Arc<dyn Fn() -> bool + Send + Sync>,
}

/// How a body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    None,
    Length(u64),
    Chunked,
    /// Until the guest closes (answers only).
    Close,
}

/// A request to send: method, path with query, `Host`, headers (hop-by-hop ones already
/// removed), the body's framing and, for an HTTP/1.1 upgrade (WebSocket), the protocol
/// asked for.
pub struct Outgoing<'a> {
    pub method: &'a str,
    pub target: &'a str,
    pub host: &'a str,
    pub headers: &'a [(String, String)],
    pub body: Framing,
    pub upgrade: Option<&'a str>,
}

/// A guest's answer: status, headers (framing and hop-by-hop ones removed) and the body.
/// A `101 Switching Protocols` to an upgrade request has no body: the connection itself
/// is handed over in `upgraded`.
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub framing: Framing,
    pub body: Box<dyn Read + Send>,
    pub upgraded: Option<Upgraded>,
}

/// The guest's side of an upgraded connection: the socket and what the guest already
/// sent past its answer head.
pub struct Upgraded {
    pub stream: TcpStream,
    pub buffered: Vec<u8>,
}

/// Headers that describe one connection, never forwarded (RFC 9110 §7.6.1).
pub fn is_hop_by_hop(name: &str) -> bool {
    [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        "expect",
    ]
    .iter()
    .any(|h| name.eq_ignore_ascii_case(h))
}

/// An open connection to a guest's envd, request not yet sent.
pub struct Connection {
    stream: TcpStream,
    patience: Patience,
}

impl Connection {
    pub fn open(addr: SocketAddr, patience: Patience) -> Result<Connection, EnvdError> {
        let stream =
            TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(EnvdError::Connect)?;
        stream
            .set_write_timeout(Some(WRITE_TIMEOUT))
            .and_then(|_| stream.set_read_timeout(Some(POLL)))
            .and_then(|_| stream.set_nodelay(true))
            .map_err(EnvdError::Io)?;
        Ok(Connection { stream, patience })
    }

    /// Sends the request head, then `body` framed as the head says (a chunk per read,
    /// so input streamed by the client reaches the guest as it comes).
    pub fn send(&mut self, req: &Outgoing, body: &mut dyn Read) -> Result<(), EnvdError> {
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: {}\r\n",
            req.method, req.target, req.host
        );
        for (k, v) in req.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        match req.body {
            Framing::Length(n) => head.push_str(&format!("Content-Length: {n}\r\n")),
            Framing::Chunked => head.push_str("Transfer-Encoding: chunked\r\n"),
            Framing::None | Framing::Close => {}
        }
        match req.upgrade {
            Some(protocol) => head.push_str(&format!(
                "Connection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n"
            )),
            None => head.push_str("Connection: close\r\n\r\n"),
        }
        let io = |e| EnvdError::Io(e);
        self.stream.write_all(head.as_bytes()).map_err(io)?;
        match req.body {
            Framing::Length(n) => {
                let copied = io::copy(&mut body.take(n), &mut self.stream).map_err(io)?;
                if copied != n {
                    return Err(EnvdError::Io(io::ErrorKind::UnexpectedEof.into()));
                }
            }
            Framing::Chunked => {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match body.read(&mut buf) {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => return Err(EnvdError::Io(e)),
                    };
                    let mut chunk = format!("{n:x}\r\n").into_bytes();
                    chunk.extend_from_slice(&buf[..n]);
                    chunk.extend_from_slice(b"\r\n");
                    self.stream.write_all(&chunk).map_err(io)?;
                    if n == 0 {
                        break;
                    }
                }
            }
            Framing::None | Framing::Close => {}
        }
        self.stream.flush().map_err(io)
    }

    /// Reads the answer head (bounded) and hands back the body as a reader, or the
    /// connection after a `101` to an upgrade request.
    pub fn answer(self, upgrading: bool) -> Result<Answer, EnvdError> {
        let mut reader = BufReader::new(Patient {
            stream: self.stream,
            patience: self.patience,
            last: Instant::now(),
        });
        let (status, raw) = read_head(&mut reader)?;
        let headers = raw
            .iter()
            .filter(|(k, _)| !is_hop_by_hop(k))
            .cloned()
            .collect();
        if status == 101 {
            if !upgrading {
                return Err(bad("101 to a request that asked for no upgrade".into()));
            }
            let buffered = reader.buffer().to_vec();
            let stream = reader.into_inner().stream;
            return Ok(Answer {
                status,
                headers,
                framing: Framing::None,
                body: Box::new(io::empty()),
                upgraded: Some(Upgraded { stream, buffered }),
            });
        }
        let framing = framing_of(status, &raw)?;
        let body: Box<dyn Read + Send> = match framing {
            Framing::None => Box::new(io::empty()),
            Framing::Length(n) => Box::new(Exact {
                inner: reader,
                left: n,
            }),
            Framing::Chunked => Box::new(ChunkedReader::new(reader)),
            Framing::Close => Box::new(reader),
        };
        Ok(Answer {
            status,
            headers,
            framing,
            body,
            upgraded: None,
        })
    }
}

/// One small exchange with a bounded answer body: `/init` and the like.
pub fn call(
    addr: SocketAddr,
    method: &str,
    target: &str,
    content_type: &str,
    body: &[u8],
    timeout: Duration,
) -> Result<(u16, Vec<u8>), EnvdError> {
    let patience = Patience {
        idle: timeout,
        alive: Arc::new(|| true),
    };
    let mut conn = Connection::open(addr, patience)?;
    let headers = [("Content-Type".to_string(), content_type.to_string())];
    let req = Outgoing {
        method,
        target,
        host: "envd",
        headers: &headers,
        body: Framing::Length(body.len() as u64),
        upgrade: None,
    };
    conn.send(&req, &mut &body[..])?;
    let answer = conn.answer(false)?;
    let mut out = Vec::new();
    answer
        .body
        .take(64 * 1024)
        .read_to_end(&mut out)
        .map_err(read_error)?;
    Ok((answer.status, out))
}

/// Maps a read error of an answer body back to what happened.
pub fn read_error(e: io::Error) -> EnvdError {
    match e.get_ref().and_then(|inner| inner.downcast_ref::<Why>()) {
        Some(Why::Idle) => EnvdError::Timeout,
        Some(Why::Stopped) => EnvdError::Stopped,
        None => EnvdError::Io(e),
    }
}

/// Why a patient read gave up (carried inside the `io::Error`).
#[derive(Debug)]
enum Why {
    Idle,
    Stopped,
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::Idle => write!(f, "the sandbox's envd sent nothing for too long"),
            Why::Stopped => write!(f, "the sandbox stopped running"),
        }
    }
}

impl std::error::Error for Why {}

/// The socket, read in `POLL` slices until data, the idle limit, or a stopped sandbox.
struct Patient {
    stream: TcpStream,
    patience: Patience,
    last: Instant,
}

impl Read for Patient {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.stream.read(buf) {
                Ok(n) => {
                    self.last = Instant::now();
                    return Ok(n);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if !(self.patience.alive)() {
                        return Err(io::Error::other(Why::Stopped));
                    }
                    if self.last.elapsed() >= self.patience.idle {
                        return Err(io::Error::new(io::ErrorKind::TimedOut, Why::Idle));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// A `Content-Length` body: exactly `left` more bytes; an early end is an error.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Status line and headers, at most [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`].
fn read_head(reader: &mut impl BufRead) -> Result<(u16, Vec<(String, String)>), EnvdError> {
    let mut budget = MAX_HEAD_BYTES;
    let status_line = read_line(reader, &mut budget)?;
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..=599).contains(s));
    let status = match (version, status) {
        ("HTTP/1.1" | "HTTP/1.0", Some(s)) => s,
        _ => return Err(bad(format!("status line {status_line:?}"))),
    };
    let mut headers = Vec::new();
    loop {
        let line = read_line(reader, &mut budget)?;
        if line.is_empty() {
            break;
        }
        if headers.len() == MAX_HEADERS {
            return Err(bad(format!("more than {MAX_HEADERS} headers")));
        }
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| bad(format!("header line {line:?}")))?;
        let name_ok = !k.is_empty() && k.bytes().all(|b| b.is_ascii_graphic() && b != b':');
        if !name_ok {
            return Err(bad(format!("header name {k:?}")));
        }
        headers.push((k.to_string(), v.trim().to_string()));
    }
    if status == 100 {
        // An interim answer to a request with Expect; the real one follows.
        return read_head(reader);
    }
    Ok((status, headers))
}

/// One CRLF-terminated line of visible ASCII, charged against `budget`.
fn read_line(reader: &mut impl BufRead, budget: &mut usize) -> Result<String, EnvdError> {
    let mut line = Vec::new();
    let limit = (*budget as u64) + 1;
    reader
        .by_ref()
        .take(limit)
        .read_until(b'\n', &mut line)
        .map_err(read_error)?;
    if !line.ends_with(b"\n") {
        return Err(if line.len() as u64 >= limit {
            bad(format!("answer head over {MAX_HEAD_BYTES} bytes"))
        } else {
            EnvdError::Io(io::ErrorKind::UnexpectedEof.into())
        });
    }
    *budget -= line.len();
    line.pop();
    if line.ends_with(b"\r") {
        line.pop();
    }
    if !line.iter().all(|b| *b == b'\t' || (0x20..0x7f).contains(b)) {
        return Err(bad("non-ASCII bytes in the answer head".into()));
    }
    Ok(String::from_utf8(line).expect("ASCII"))
}

/// The body framing of an answer (RFC 9112 §6.3), refusing ambiguous ones.
fn framing_of(status: u16, headers: &[(String, String)]) -> Result<Framing, EnvdError> {
    if (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(Framing::None);
    }
    let values = |name: &str| -> Vec<&str> {
        headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    };
    let te = values("transfer-encoding");
    let cl = values("content-length");
    match (te.as_slice(), cl.as_slice()) {
        ([], []) => Ok(Framing::Close),
        ([], [n]) => n
            .parse()
            .map(Framing::Length)
            .map_err(|_| bad(format!("Content-Length {n:?}"))),
        ([t], []) if t.eq_ignore_ascii_case("chunked") => Ok(Framing::Chunked),
        _ => Err(bad("ambiguous body framing".into())),
    }
}

fn bad(message: String) -> EnvdError {
    EnvdError::BadAnswer(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<(u16, Vec<(String, String)>), EnvdError> {
        read_head(&mut BufReader::new(text.as_bytes()))
    }

    #[test]
    fn heads_are_parsed_and_bounded() {
        let (status, h) = head("HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nX:  y \r\n\r\n").unwrap();
        assert_eq!(status, 200);
        assert_eq!(
            h,
            vec![
                ("Content-Type".into(), "a/b".into()),
                ("X".into(), "y".into())
            ]
        );
        let (status, _) = head("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 No\r\n\r\n").unwrap();
        assert_eq!(status, 404);
        assert!(matches!(
            head("SSH-2.0\r\n\r\n"),
            Err(EnvdError::BadAnswer(_))
        ));
        assert!(matches!(
            head("HTTP/1.1 99 x\r\n\r\n"),
            Err(EnvdError::BadAnswer(_))
        ));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\nnocolon\r\n\r\n"),
            Err(EnvdError::BadAnswer(_))
        ));
        let many: String = (0..=MAX_HEADERS).map(|i| format!("H{i}: v\r\n")).collect();
        let text = format!("HTTP/1.1 200 OK\r\n{many}\r\n");
        assert!(matches!(head(&text), Err(EnvdError::BadAnswer(_))));
        let long = format!(
            "HTTP/1.1 200 OK\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert!(matches!(head(&long), Err(EnvdError::BadAnswer(_))));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\nX: y"),
            Err(EnvdError::Io(_))
        ));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\nX: \u{e9}\r\n\r\n"),
            Err(EnvdError::BadAnswer(_))
        ));
    }

    #[test]
    fn framing_rules() {
        let h = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            framing_of(204, &h(&[("Content-Length", "5")])).unwrap(),
            Framing::None
        );
        assert_eq!(framing_of(200, &h(&[])).unwrap(), Framing::Close);
        assert_eq!(
            framing_of(200, &h(&[("content-length", "7")])).unwrap(),
            Framing::Length(7)
        );
        assert_eq!(
            framing_of(200, &h(&[("Transfer-Encoding", "Chunked")])).unwrap(),
            Framing::Chunked
        );
        for bad in [
            h(&[("Content-Length", "1"), ("Content-Length", "2")]),
            h(&[("Content-Length", "-1")]),
            h(&[("Transfer-Encoding", "chunked"), ("Content-Length", "2")]),
            h(&[("Transfer-Encoding", "gzip")]),
        ] {
            assert!(framing_of(200, &bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn exact_bodies_end_where_they_say() {
        let mut r = Exact {
            inner: &b"hello world"[..],
            left: 5,
        };
        let mut out = String::new();
        r.read_to_string(&mut out).unwrap();
        assert_eq!(out, "hello");
        let mut short = Exact {
            inner: &b"hi"[..],
            left: 5,
        };
        assert_eq!(
            short.read_to_end(&mut Vec::new()).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn a_quiet_guest_hits_the_idle_limit_or_the_liveness_check() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            s.write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
                .unwrap();
            std::thread::sleep(Duration::from_secs(3));
        });
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let flag = alive.clone();
        let patience = Patience {
            idle: Duration::from_secs(60),
            alive: Arc::new(move || flag.load(std::sync::atomic::Ordering::SeqCst)),
        };
        let mut conn = Connection::open(addr, patience).unwrap();
        let req = Outgoing {
            method: "GET",
            target: "/x",
            host: "envd",
            headers: &[],
            body: Framing::None,
            upgrade: None,
        };
        conn.send(&req, &mut io::empty()).unwrap();
        let mut answer = conn.answer(false).unwrap();
        let mut buf = [0u8; 16];
        let n = answer.body.read(&mut buf).unwrap();
        assert_eq!(
            &buf[..n],
            b"abc",
            "the first chunk arrives before the body ends"
        );
        alive.store(false, std::sync::atomic::Ordering::SeqCst);
        let e = answer.body.read(&mut buf).unwrap_err();
        assert!(matches!(read_error(e), EnvdError::Stopped));
        server.join().unwrap();
    }
}
