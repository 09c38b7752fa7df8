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
            .max_idle_connections_per_host(32)
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
