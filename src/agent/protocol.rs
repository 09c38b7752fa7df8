//! The host↔guest wire protocol, shared by the host client and the in-guest agent.
//!
//! One byte stream (the virtio-serial port) carries frames:
//!
//! ```text
//! magic "AE" (2) | kind (1) | reserved 0 (1) | id u64 LE (8) | len u32 LE (4) | payload (len)
//! ```
//!
//! Every call has an `id` chosen by the host; frames of different calls interleave freely.
//! - `Request` (host→guest, JSON [`Request`]) opens a call.
//! - `Response` (guest→host, JSON [`Response`]) answers it. It is final, except
//!   [`Response::FileOpened`] and [`Response::UploadReady`], which start a data stream.
//! - `Data` carries at most [`MAX_CHUNK`] raw bytes of a file stream, `End` closes it.
//! - `Credit` (u32 LE) lets the other side send that many more data bytes: both directions
//!   are flow-controlled per call, so a large transfer never blocks the demultiplexer or
//!   other calls, and no side buffers more than [`STREAM_WINDOW`] per stream.
//! - `Cancel` (host→guest) abandons a stream.
//!
//! Sequences: `Hello`/`SetTime`/`Sync`/`MountNfs`/`Exec`/`Warmup`/`Metrics` → one `Response`. `ReadFile` → `FileOpened{size}`
//! (host sends `Credit`s) → `Data`… → `End`, or an `Error` response at any point.
//! `WriteFile` → `UploadReady` + `Credit` → host sends `Data`… `End` → `Done` or `Error`.
//!
//! A reader that sees a bad magic or an oversized length skips ahead to the next magic, so a
//! peer that reconnects in the middle of a frame resynchronises. A receiver may bound each
//! kind's payload tighter than [`MAX_PAYLOAD`] ([`FrameDecoder::with_limit`]): the host does
//! for everything a guest sends, so a half-received frame never holds more than its kind
//! allows, and reports what a well-behaved peer never sends ([`FrameDecoder::oversized`],
//! [`FrameDecoder::skipped`]).

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use super::ExecRequest;
use super::ExecResult;

/// Bumped on any incompatible change; checked by `Hello`.
pub const PROTOCOL_VERSION: u32 = 1;
/// Largest `Data` payload.
pub const MAX_CHUNK: usize = 64 * 1024;
/// Bytes a receiver lets the sender have in flight per stream.
pub const STREAM_WINDOW: u32 = 16 * MAX_CHUNK as u32;
/// Largest payload of any frame (an exec result holds two capped, JSON-escaped streams).
pub const MAX_PAYLOAD: u32 = 64 * 1024 * 1024;

const MAGIC: [u8; 2] = *b"AE";
const HEADER_LEN: usize = 16;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    Request = 1,
    Response = 2,
    Data = 3,
    End = 4,
    Credit = 5,
    Cancel = 6,
}

impl FrameKind {
    fn from_byte(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            3 => FrameKind::Data,
            4 => FrameKind::End,
            5 => FrameKind::Credit,
            6 => FrameKind::Cancel,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub id: u64,
    pub payload: Vec<u8>,
}

impl Frame {
    pub fn new(kind: FrameKind, id: u64, payload: Vec<u8>) -> Frame {
        Frame { kind, id, payload }
    }

    pub fn json<T: Serialize>(kind: FrameKind, id: u64, body: &T) -> Frame {
        // Serializing our own plain enums cannot fail.
        let payload = serde_json::to_vec(body).unwrap_or_default();
        Frame { kind, id, payload }
    }

    pub fn credit(id: u64, bytes: u32) -> Frame {
        Frame::new(FrameKind::Credit, id, bytes.to_le_bytes().to_vec())
    }

    /// The credit amount of a `Credit` frame (0 when malformed).
    pub fn credit_bytes(&self) -> u32 {
        self.payload
            .get(..4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .unwrap_or(0)
    }

    /// Encodes header and payload into one buffer, so one `write_all` puts it on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.payload.len());
        out.extend_from_slice(&MAGIC);
        out.push(self.kind as u8);
        out.push(0);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.payload);
        out
    }
}

/// Writes one whole frame.
pub fn write_frame(w: &mut dyn Write, frame: &Frame) -> io::Result<()> {
    w.write_all(&frame.encode())?;
    w.flush()
}

/// The largest payload a receiver accepts for each kind.
pub type PayloadLimit = fn(FrameKind) -> u32;

/// Incremental decoder: feed bytes as they arrive, take complete frames out.
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Where the unread bytes of `buf` start (skipping moves this, not the bytes).
    start: usize,
    limit: PayloadLimit,
    /// A complete frame was decoded: the stream is in sync from here on.
    synced: bool,
    /// Bytes skipped while looking for a frame start.
    pub skipped: u64,
    /// A well-formed header whose length exceeds its kind's limit, met after the stream
    /// was in sync (a peer breaking the protocol rather than a torn frame).
    pub oversized: Option<(FrameKind, u32)>,
}

impl Default for FrameDecoder {
    fn default() -> FrameDecoder {
        FrameDecoder::with_limit(|_| MAX_PAYLOAD)
    }
}

impl FrameDecoder {
    pub fn new() -> FrameDecoder {
        FrameDecoder::default()
    }

    /// A decoder that treats a frame longer than `limit(kind)` as garbage.
    pub fn with_limit(limit: PayloadLimit) -> FrameDecoder {
        FrameDecoder {
            buf: Vec::new(),
            start: 0,
            limit,
            synced: false,
            skipped: 0,
            oversized: None,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes held: at most one partial frame (within its kind's limit) plus the last push.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Drops any partial frame (the peer went away mid-frame).
    pub fn reset(&mut self) {
        self.buf.clear();
        self.start = 0;
    }

    /// The next complete frame, if one is buffered. Garbage before it is skipped.
    pub fn next_frame(&mut self) -> Option<Frame> {
        loop {
            let rest = &self.buf[self.start..];
            if rest.len() < HEADER_LEN {
                self.drop_garbage_prefix();
                return None;
            }
            let kind = FrameKind::from_byte(rest[2]);
            let len = u32::from_le_bytes([rest[12], rest[13], rest[14], rest[15]]);
            let Some(kind) = kind.filter(|_| rest[..2] == MAGIC && rest[3] == 0) else {
                self.skip(1);
                continue;
            };
            if len > (self.limit)(kind).min(MAX_PAYLOAD) {
                if self.synced && self.oversized.is_none() {
                    self.oversized = Some((kind, len));
                }
                self.skip(1);
                continue;
            }
            let total = HEADER_LEN + len as usize;
            if rest.len() < total {
                return None;
            }
            let id = u64::from_le_bytes(rest[4..12].try_into().unwrap_or([0; 8]));
            let payload = rest[HEADER_LEN..total].to_vec();
            self.start += total;
            self.synced = true;
            return Some(Frame { kind, id, payload });
        }
    }

    /// Skips `n` bytes, then on to the next byte that may start a frame.
    fn skip(&mut self, n: usize) {
        let rest = &self.buf[self.start + n..];
        let next = rest
            .iter()
            .position(|&b| b == MAGIC[0])
            .unwrap_or(rest.len());
        self.start += n + next;
        self.skipped += (n + next) as u64;
    }

    /// With less than a header buffered, drop bytes that cannot start a frame.
    fn drop_garbage_prefix(&mut self) {
        while let Some(&b) = self.buf.get(self.start) {
            let rest = &self.buf[self.start..];
            let ok = match rest.len() {
                1 => b == MAGIC[0],
                _ => rest[..2] == MAGIC,
            };
            if ok {
                break;
            }
            self.skip(1);
        }
    }
}

/// Blocking frame reader over any byte stream.
pub struct FrameReader<R> {
    inner: R,
    decoder: FrameDecoder,
    chunk: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    pub fn new(inner: R) -> FrameReader<R> {
        FrameReader {
            inner,
            decoder: FrameDecoder::new(),
            chunk: vec![0; 128 * 1024],
        }
    }

    /// The next frame; `Ok(None)` at end of stream.
    pub fn read_frame(&mut self) -> io::Result<Option<Frame>> {
        loop {
            if let Some(frame) = self.decoder.next_frame() {
                return Ok(Some(frame));
            }
            let n = match self.inner.read(&mut self.chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                self.decoder.reset();
                return Ok(None);
            }
            self.decoder.push(&self.chunk[..n]);
        }
    }
}

/// Host → guest call openers.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Hello {
        version: u32,
    },
    SetTime {
        unix_nanos: u64,
    },
    /// Flush every filesystem's dirty data to its disk (`sync(2)`), answered `Done` once
    /// done: before a filesystem-only pause drops the guest's memory.
    Sync,
    /// Mounts the NFS export `source` (`<server>:/<export>`) on `path` (made with its
    /// parents when missing) with `mount(2)`: type `nfs4`, `nosuid,nodev`, `options` the
    /// kernel's own option string (`vers=4.2,addr=…,clientaddr=…`). Answered `Done`; the
    /// guest needs no `mount` program.
    MountNfs {
        source: String,
        path: String,
        options: String,
    },
    Exec(ExecRequest),
    ReadFile {
        path: String,
    },
    WriteFile {
        path: String,
        len: u64,
    },
    /// A warm standby's warm-up (docs/architecture.md, "Standby pool"): the guest calls
    /// its own envd on `port` over loopback as an SDK's first command and file write
    /// would (its file is `<path>-envd`), then removes that file and `path`. Answered
    /// `Done`.
    Warmup {
        port: u16,
        path: String,
    },
    /// One sample of what the guest sees of its CPU, memory and root disk, answered
    /// [`Response::Metrics`]. Over this channel rather than envd's `GET /metrics`: an idle
    /// guest sampled every few seconds then runs no network stack or HTTP server for it
    /// (their translated code held by every guest under TCG, docs/performance.md).
    Metrics,
}

/// Guest-side failure classes, mapped to [`super::AgentError`] on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    NotFound,
    InvalidPath,
    Io,
    Protocol,
}

/// Guest → host answers.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Response {
    Hello { version: u32, agent: String },
    Done,
    Exec(ExecResult),
    FileOpened { size: u64 },
    UploadReady,
    Metrics(GuestMetrics),
    Error { kind: ErrorKind, message: String },
}

/// What the guest sees of its CPU, memory and root disk: the answer to
/// [`Request::Metrics`] and envd's `GET /metrics` body. Sizes in bytes; `cpu_used_pct`
/// over 100 ms; `ts` the guest's clock (unix seconds). A missing field reads 0.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct GuestMetrics {
    pub ts: u64,
    pub cpu_count: u64,
    pub cpu_used_pct: f64,
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_cache: u64,
    pub disk_total: u64,
    pub disk_used: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(dec: &mut FrameDecoder) -> Vec<Frame> {
        std::iter::from_fn(|| dec.next_frame()).collect()
    }

    #[test]
    fn round_trip_byte_by_byte() {
        let a = Frame::new(FrameKind::Data, 7, vec![1, 2, 3]);
        let b = Frame::credit(u64::MAX, 65536);
        let c = Frame::new(FrameKind::End, 9, vec![]);
        let mut wire = a.encode();
        wire.extend(b.encode());
        wire.extend(c.encode());
        let mut dec = FrameDecoder::new();
        let mut got = vec![];
        for byte in wire {
            dec.push(&[byte]);
            got.extend(frames(&mut dec));
        }
        assert_eq!(got, vec![a, b.clone(), c]);
        assert_eq!(b.credit_bytes(), 65536);
        assert_eq!(dec.skipped, 0);
    }

    #[test]
    fn resyncs_after_garbage_and_truncated_frame() {
        let good = Frame::json(FrameKind::Request, 3, &Request::Hello { version: 1 });
        let mut wire = b"xxAEgarbage".to_vec();
        // A header announcing an oversized payload must be skipped too.
        let mut bogus = Frame::new(FrameKind::Data, 1, vec![]).encode();
        bogus[12..16].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        wire.extend(bogus);
        wire.extend(good.encode());
        let mut dec = FrameDecoder::new();
        dec.push(&wire);
        assert_eq!(frames(&mut dec), vec![good]);
        assert!(dec.skipped > 0);
    }

    #[test]
    fn per_kind_limits_bound_the_buffer_and_report_oversized_frames() {
        let limit: PayloadLimit = |k| if k == FrameKind::Data { 8 } else { 64 };
        let mut dec = FrameDecoder::with_limit(limit);
        // Before the first good frame an oversized header is a torn frame: skipped quietly.
        dec.push(&Frame::new(FrameKind::Data, 1, vec![1; 9]).encode());
        assert_eq!(dec.next_frame(), None);
        assert!(dec.oversized.is_none() && dec.skipped > 0);
        let ok = Frame::new(FrameKind::Data, 1, vec![2; 8]);
        dec.push(&ok.encode());
        assert_eq!(dec.next_frame(), Some(ok));
        // In sync, a header announcing a giant frame is reported and never buffered.
        let mut giant = Frame::new(FrameKind::Data, 1, vec![]).encode();
        giant[12..16].copy_from_slice(&(1u32 << 30).to_le_bytes());
        dec.push(&giant);
        dec.push(&[0u8; 4096]);
        assert_eq!(dec.next_frame(), None);
        assert_eq!(dec.oversized, Some((FrameKind::Data, 1 << 30)));
        assert!(dec.buffered() < HEADER_LEN, "{}", dec.buffered());
    }

    #[test]
    fn garbage_is_skipped_in_linear_time() {
        let mut dec = FrameDecoder::new();
        // Every byte a possible frame start: 4 MiB of 'A's.
        dec.push(&vec![b'A'; 4 << 20]);
        assert_eq!(dec.next_frame(), None);
        assert!(dec.buffered() < HEADER_LEN);
        let good = Frame::new(FrameKind::End, 5, vec![]);
        dec.push(&good.encode());
        assert_eq!(dec.next_frame(), Some(good));
    }

    #[test]
    fn reset_drops_partial_frame() {
        let f = Frame::new(FrameKind::Data, 1, vec![5; 100]);
        let enc = f.encode();
        let mut dec = FrameDecoder::new();
        dec.push(&enc[..50]);
        assert!(dec.next_frame().is_none());
        dec.reset();
        dec.push(&enc);
        assert_eq!(dec.next_frame(), Some(f));
    }

    #[test]
    fn reader_reports_eof() {
        let f = Frame::new(FrameKind::Cancel, 2, vec![]);
        let wire = f.encode();
        let mut r = FrameReader::new(&wire[..]);
        assert_eq!(r.read_frame().unwrap(), Some(f));
        assert_eq!(r.read_frame().unwrap(), None);
    }

    #[test]
    fn request_json_shape() {
        let req = Request::WriteFile {
            path: "/a".into(),
            len: 3,
        };
        let f = Frame::json(FrameKind::Request, 1, &req);
        let back: Request = serde_json::from_slice(&f.payload).unwrap();
        assert!(matches!(back, Request::WriteFile { len: 3, .. }));
    }
}
