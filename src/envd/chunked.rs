//! A strict reader of `Transfer-Encoding: chunked` bodies from an untrusted peer.
//!
//! Not `chunked_transfer::Decoder` (in the tree through tiny_http), because for a hostile
//! guest that decoder is unsafe twice: it collects a chunk-size line of any length in
//! memory, and a connection closed inside a chunk reads as a clean end of body, which
//! would hand a truncated answer on as complete. Here the size line is at most 256 bytes,
//! an early close is `UnexpectedEof`, and trailers (bounded too) are skipped.

use std::io::{self, BufRead, Read};

/// Longest chunk-size line (hex size plus extensions) or trailer line.
const MAX_LINE: usize = 256;
/// Most trailer lines after the last chunk.
const MAX_TRAILERS: usize = 32;

pub struct ChunkedReader<R> {
    inner: R,
    /// Bytes left in the current chunk; `None` between chunks.
    left: Option<u64>,
    done: bool,
}

impl<R: BufRead> ChunkedReader<R> {
    pub fn new(inner: R) -> ChunkedReader<R> {
        ChunkedReader {
            inner,
            left: None,
            done: false,
        }
    }

    fn line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        (&mut self.inner)
            .take(MAX_LINE as u64 + 2)
            .read_until(b'\n', &mut line)?;
        if !line.ends_with(b"\r\n") {
            return Err(if line.len() > MAX_LINE {
                invalid("chunk line too long")
            } else {
                io::ErrorKind::UnexpectedEof.into()
            });
        }
        line.truncate(line.len() - 2);
        Ok(line)
    }

    fn chunk_size(&mut self) -> io::Result<u64> {
        let line = self.line()?;
        let size = line.split(|b| *b == b';').next().unwrap_or(&[]);
        let size = std::str::from_utf8(size)
            .ok()
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= 16)
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| invalid("bad chunk size"))?;
        Ok(size)
    }
}

impl<R: BufRead> Read for ChunkedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        let left = match self.left {
            Some(n) => n,
            None => {
                let size = self.chunk_size()?;
                if size == 0 {
                    for _ in 0..=MAX_TRAILERS {
                        if self.line()?.is_empty() {
                            self.done = true;
                            return Ok(0);
                        }
                    }
                    return Err(invalid("too many trailers"));
                }
                size
            }
        };
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let rest = left - n as u64;
        self.left = if rest == 0 {
            if self.line()?.is_empty() {
                None
            } else {
                return Err(invalid("chunk longer than its size"));
            }
        } else {
            Some(rest)
        };
        Ok(n)
    }
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(wire: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        ChunkedReader::new(io::BufReader::new(wire)).read_to_end(&mut out)?;
        Ok(out)
    }

    #[test]
    fn decodes_chunks_extensions_and_trailers() {
        assert_eq!(
            decode(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert_eq!(
            decode(b"A\r\n0123456789\r\n0\r\nT: 1\r\n\r\n").unwrap(),
            b"0123456789"
        );
    }

    #[test]
    fn refuses_what_a_hostile_peer_sends() {
        let kind = |wire: &[u8]| decode(wire).unwrap_err().kind();
        // Closed inside a chunk, or before the last chunk: never a clean end.
        assert_eq!(kind(b"5\r\nab"), io::ErrorKind::UnexpectedEof);
        assert_eq!(kind(b"3\r\nabc\r\n"), io::ErrorKind::UnexpectedEof);
        // An endless size line stops at the bound.
        let long = [b'1'; 4096];
        assert_eq!(kind(&long), io::ErrorKind::InvalidData);
        assert_eq!(kind(b"zz\r\nab\r\n"), io::ErrorKind::InvalidData);
        assert_eq!(kind(b"ffffffffffffffffff\r\n"), io::ErrorKind::InvalidData);
        assert_eq!(kind(b"2\r\nabc\r\n0\r\n\r\n"), io::ErrorKind::InvalidData);
        let trailers: Vec<u8> = std::iter::once(&b"0\r\n"[..])
            .chain(std::iter::repeat_n(&b"T: 1\r\n"[..], 40))
            .flatten()
            .copied()
            .collect();
        assert_eq!(kind(&trailers), io::ErrorKind::InvalidData);
    }
}
