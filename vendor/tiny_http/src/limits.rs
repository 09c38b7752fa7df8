//! Bounds on what one client connection may cost (agentenv patch, see PATCHES.md).

use std::convert::TryFrom;
use std::io::{ErrorKind, Read, Result as IoResult};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Limits applied to every connection of a [`crate::Server`].
///
/// `Limits::default()` keeps upstream's behaviour where it is safe (no timeouts, no
/// connection cap) and bounds what upstream left unbounded (header block, body drain).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Connections open at once; past it a connection gets `503` and is closed.
    pub max_connections: usize,
    /// Request line plus headers, in bytes; past it the client gets `431`.
    pub max_header_bytes: usize,
    /// Wait for the first byte of a request on an open connection; then it is closed.
    pub idle_timeout: Option<Duration>,
    /// Request line, headers and a buffered body must arrive within this; then `408`.
    pub header_timeout: Option<Duration>,
    /// Longest wait for any read of a streamed body.
    pub body_timeout: Option<Duration>,
    /// Longest wait for any write of a response.
    pub write_timeout: Option<Duration>,
    /// Bodies with a `Content-Length` up to this are read by the connection's own thread
    /// before the request is handed out (upstream: 1024).
    pub buffer_body_up_to: usize,
    /// A body the handler left unread is discarded up to this many bytes within
    /// `drain_timeout`; past either the connection is closed instead.
    pub drain_limit: u64,
    pub drain_timeout: Duration,
    /// A connection closed while the client may still be sending (an answer given before
    /// its body was read, a rejected request) is closed lingering: shut down for writing,
    /// then what arrives is discarded until the client closes, up to this many bytes
    /// within `linger_timeout`.
    pub linger_limit: u64,
    pub linger_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: usize::MAX,
            max_header_bytes: 64 * 1024,
            idle_timeout: None,
            header_timeout: None,
            body_timeout: None,
            write_timeout: None,
            buffer_body_up_to: 1024,
            drain_limit: 64 * 1024,
            drain_timeout: Duration::from_secs(1),
            linger_limit: 64 * 1024 * 1024,
            linger_timeout: Duration::from_secs(2),
        }
    }
}

/// Read-side state one connection shares between its reader thread, the request being
/// served and the socket: the current read deadline, the per-read timeout and whether the
/// connection must close once the current request is done.
#[derive(Debug)]
pub(crate) struct ConnControl {
    base: Instant,
    /// Nanoseconds after `base` plus one; 0 = no deadline.
    deadline: AtomicU64,
    /// Milliseconds; 0 = none.
    per_read: AtomicU64,
    close: AtomicBool,
}

impl ConnControl {
    pub(crate) fn new() -> Arc<ConnControl> {
        Arc::new(ConnControl {
            base: Instant::now(),
            deadline: AtomicU64::new(0),
            per_read: AtomicU64::new(0),
            close: AtomicBool::new(false),
        })
    }

    /// Reads must complete within `within` from now (`None`: no overall deadline).
    pub(crate) fn set_deadline(&self, within: Option<Duration>) {
        let v = within.map_or(0, |d| {
            let at = self.base.elapsed().saturating_add(d);
            u64::try_from(at.as_nanos()).unwrap_or(u64::MAX - 1) + 1
        });
        self.deadline.store(v, Ordering::Release);
    }

    pub(crate) fn set_per_read(&self, timeout: Option<Duration>) {
        let ms = timeout.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
        self.per_read.store(ms, Ordering::Release);
    }

    /// The timeout the next socket read should use; `Err(TimedOut)` past the deadline.
    pub(crate) fn read_timeout(&self) -> IoResult<Option<Duration>> {
        let per_read = match self.per_read.load(Ordering::Acquire) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        };
        let deadline = match self.deadline.load(Ordering::Acquire) {
            0 => return Ok(per_read),
            at => Duration::from_nanos(at - 1),
        };
        let now = self.base.elapsed();
        if now >= deadline {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "read deadline passed"));
        }
        let left = (deadline - now).max(Duration::from_millis(1));
        Ok(Some(per_read.map_or(left, |p| p.min(left))))
    }

    pub(crate) fn close_after_request(&self) {
        self.close.store(true, Ordering::Release);
    }

    pub(crate) fn must_close(&self) -> bool {
        self.close.load(Ordering::Acquire)
    }
}

/// A request body that, when dropped unread, discards at most `limit` bytes within
/// `timeout` and otherwise marks the connection for closing. Upstream drained the rest of
/// the body by allocating a buffer of the client's claimed length.
pub(crate) struct Drained<R: Read> {
    inner: R,
    finished: bool,
    /// Bytes still to come when the length is known.
    remaining: Option<u64>,
    limit: u64,
    timeout: Duration,
    control: Arc<ConnControl>,
}

impl<R: Read> Drained<R> {
    pub(crate) fn new(
        inner: R,
        length: Option<u64>,
        limit: u64,
        timeout: Duration,
        control: Arc<ConnControl>,
    ) -> Self {
        Drained {
            inner,
            finished: false,
            remaining: length,
            limit,
            timeout,
            control,
        }
    }
}

impl<R: Read> Read for Drained<R> {
    fn read(&mut self, buf: &mut [u8]) -> IoResult<usize> {
        if self.finished {
            return Ok(0);
        }
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.finished = true;
        }
        if let Some(r) = self.remaining.as_mut() {
            *r = r.saturating_sub(n as u64);
        }
        Ok(n)
    }
}

impl<R: Read> Drop for Drained<R> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if self.remaining.is_some_and(|r| r > self.limit) {
            // Known to be too long to discard: close without reading.
            self.control.close_after_request();
            return;
        }
        self.control.set_deadline(Some(self.timeout));
        let mut buf = [0u8; 4096];
        let mut left = self.limit;
        let drained = loop {
            match self.inner.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) if (n as u64) < left => left -= n as u64,
                Ok(_) | Err(_) => break false,
            }
        };
        self.control.set_deadline(None);
        if !drained {
            self.control.close_after_request();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn drains_small_rest_and_keeps_connection() {
        let control = ConnControl::new();
        let mut data = Cursor::new(vec![7u8; 1000]);
        {
            let mut d = Drained::new(&mut data, None, 4096, Duration::from_secs(1), control.clone());
            let mut one = [0u8; 10];
            d.read_exact(&mut one).unwrap();
        }
        assert_eq!(data.position(), 1000);
        assert!(!control.must_close());
    }

    #[test]
    fn large_rest_closes_instead_of_draining() {
        let control = ConnControl::new();
        let mut data = Cursor::new(vec![7u8; 100_000]);
        drop(Drained::new(&mut data, None, 4096, Duration::from_secs(1), control.clone()));
        assert!(data.position() <= 8192);
        assert!(control.must_close());
        let control = ConnControl::new();
        let mut data = Cursor::new(vec![7u8; 100_000]);
        drop(Drained::new(&mut data, Some(100_000), 4096, Duration::from_secs(1), control.clone()));
        assert_eq!(data.position(), 0, "a known long rest is not read at all");
        assert!(control.must_close());
    }

    #[test]
    fn deadline_times_out_reads() {
        let control = ConnControl::new();
        control.set_deadline(Some(Duration::from_millis(0)));
        assert_eq!(control.read_timeout().unwrap_err().kind(), ErrorKind::TimedOut);
        control.set_deadline(None);
        control.set_per_read(Some(Duration::from_secs(3)));
        assert_eq!(control.read_timeout().unwrap(), Some(Duration::from_secs(3)));
    }
}
