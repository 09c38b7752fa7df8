//! One hook attempt over HTTP/1.1 (custom-extension.md §2): headers, the total time bound, no redirects,
//! the 1 MiB body cap.

use super::error::Cause;
use super::{Hook, StopReason};
use std::io::Read;
use std::time::{Duration, Instant};

/// custom-extension.md §2.5: at most this much response body is read.
pub const MAX_BODY: u64 = 1024 * 1024;

/// A blocking HTTP client bound to the configured extension.
pub struct Transport {
    agent: ureq::Agent,
    base_url: String,
    /// `Bearer <token>`, kept out of every log line and message.
    authorization: Option<String>,
    timeout_ms: u64,
}

impl Transport {
    pub fn new(base_url: String, token: Option<&str>, timeout_ms: u64) -> Transport {
        let timeout = Duration::from_millis(timeout_ms);
        let agent = ureq::AgentBuilder::new()
            // `timeout` sets one deadline for the whole request: ureq re-arms the socket
            // timeouts to the time left before every read and write, so a server that
            // accepts and never answers, or trickles bytes, is cut off at the deadline.
            // The connect timeout defaults to 30 s and would take precedence over the
            // deadline for the connect step, so it is bounded the same way.
            .timeout(timeout)
            .timeout_connect(timeout)
            .redirects(0)
            .user_agent(&format!("agentenv/{}", env!("CARGO_PKG_VERSION")))
            // A fresh connection per attempt. On a reused keep-alive connection the
            // client's kernel delays its ACKs (it sees an interactive exchange), and an
            // extension that writes the response head and body in two writes with Nagle
            // on (Python's http.server, many frameworks) then holds the body until that
            // delayed ACK: 40+ ms per hook. A new loopback connection costs ~0.1 ms.
            .max_idle_connections(0)
            .max_idle_connections_per_host(0)
            .build();
        Transport {
            agent,
            base_url,
            authorization: token.map(|t| format!("Bearer {t}")),
            timeout_ms,
        }
    }

    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// Sends one attempt and returns the response body of a 2xx answer.
    pub fn send(
        &self,
        hook: Hook,
        body: &[u8],
        attempt: u32,
        stop_reason: Option<StopReason>,
    ) -> Result<Vec<u8>, Cause> {
        let started = Instant::now();
        let url = format!("{}/sandbox-hook/{hook}", self.base_url);
        let mut req = self
            .agent
            .post(&url)
            .set("Content-Type", "application/json")
            .set("X-Agentenv-Hook", hook.as_str())
            .set("X-Request-Id", &crate::util::new_id())
            .set("X-Agentenv-Attempt", &attempt.to_string());
        if let Some(auth) = &self.authorization {
            req = req.set("Authorization", auth);
        }
        if let Some(reason) = stop_reason {
            req = req.set("X-Agentenv-Stop-Reason", reason.as_str());
        }
        let resp = match req.send_bytes(body) {
            Ok(resp) => resp,
            Err(ureq::Error::Status(code, _)) => return Err(Cause::Status(code)),
            Err(ureq::Error::Transport(t)) => return Err(self.transport_cause(&t, started)),
        };
        let status = resp.status();
        if (300..400).contains(&status) {
            return Err(Cause::Redirect(status));
        }
        if !(200..300).contains(&status) {
            return Err(Cause::Status(status));
        }
        let announced = resp
            .header("Content-Length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        if announced.is_some_and(|n| n > MAX_BODY) {
            return Err(Cause::BodyTooLarge);
        }
        let mut buf = Vec::new();
        match resp.into_reader().take(MAX_BODY + 1).read_to_end(&mut buf) {
            Ok(_) if buf.len() as u64 > MAX_BODY => Err(Cause::BodyTooLarge),
            Ok(_) => Ok(buf),
            Err(e) => Err(self.io_cause(&e, started)),
        }
    }

    fn timed_out(&self) -> Cause {
        Cause::TimedOut {
            ms: self.timeout_ms,
        }
    }

    fn io_cause(&self, e: &std::io::Error, started: Instant) -> Cause {
        use std::io::ErrorKind::{TimedOut, WouldBlock};
        if matches!(e.kind(), TimedOut | WouldBlock) || self.past_deadline(started) {
            return self.timed_out();
        }
        Cause::Connection(e.to_string())
    }

    fn past_deadline(&self, started: Instant) -> bool {
        started.elapsed() >= Duration::from_millis(self.timeout_ms)
    }

    /// Maps a ureq transport error. The detail is the innermost I/O error when there is
    /// one, without the URL (which holds no secret, but is noise in an API message).
    fn transport_cause(&self, t: &ureq::Transport, started: Instant) -> Cause {
        let mut io: Option<&std::io::Error> = None;
        let mut src = std::error::Error::source(t);
        while let Some(e) = src {
            if let Some(e) = e.downcast_ref::<std::io::Error>() {
                io = Some(e);
            }
            src = e.source();
        }
        if let Some(e) = io {
            return self.io_cause(e, started);
        }
        if self.past_deadline(started) {
            return self.timed_out();
        }
        Cause::Connection(match t.message() {
            Some(m) => format!("{}: {m}", t.kind()),
            None => t.kind().to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::net::TcpListener;

    /// An extension that keeps connections alive (HTTP/1.1) and answers head and body
    /// in two writes, like Python's http.server: every attempt still arrives on a
    /// connection of its own, so no attempt waits on a reused connection's delayed ACK.
    #[test]
    fn every_attempt_uses_a_fresh_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let mut connections = 0;
            let mut requests = 0;
            while requests < 3 {
                let (stream, _) = listener.accept().unwrap();
                connections += 1;
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                // Serve requests on this connection until the client closes it.
                loop {
                    let mut len = 0usize;
                    let mut line = String::new();
                    let mut saw_request = false;
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            break;
                        }
                        saw_request = true;
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    if !saw_request {
                        break;
                    }
                    let mut body = vec![0u8; len];
                    std::io::Read::read_exact(&mut reader, &mut body).unwrap();
                    requests += 1;
                    writer
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\n")
                        .unwrap();
                    writer.write_all(b"{}").unwrap();
                    if requests == 3 {
                        break;
                    }
                }
            }
            connections
        });
        let transport = Transport::new(format!("http://127.0.0.1:{port}"), None, 5000);
        for attempt in 1..=3 {
            let body = transport
                .send(Hook::StartResume, b"{}", attempt, None)
                .unwrap();
            assert_eq!(body, b"{}");
        }
        assert_eq!(server.join().unwrap(), 3, "one connection per attempt");
    }
}
