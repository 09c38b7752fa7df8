//! A streaming `multipart/form-data` reader (RFC 7578): parts are read one at a time and
//! their bodies copied out without holding a whole part in memory.

use std::io::{self, Read, Write};

/// Largest header block of one part.
const MAX_PART_HEADERS: usize = 16 * 1024;
const READ_SIZE: usize = 64 * 1024;

/// A malformed body, or a failure reading it or writing a part out.
#[derive(Debug)]
pub enum MultipartError {
    /// The body is not valid multipart (a client error).
    Malformed(String),
    Read(io::Error),
    Write(io::Error),
}

/// What a part's headers say about it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PartInfo {
    /// The form field name (`name=`).
    pub name: String,
    /// `filename=` (or a decoded `filename*=`), as sent: E2B clients put the path here.
    pub filename: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first delimiter.
    Preamble,
    /// Inside a part's body.
    Body,
    /// Just after a delimiter.
    Delimited,
    Done,
}

pub struct Multipart<R: Read> {
    r: R,
    buf: Vec<u8>,
    pos: usize,
    eof: bool,
    /// `\r\n--boundary`
    delim: Vec<u8>,
    state: State,
}

/// The `boundary` parameter of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<String> {
    let (media, params) = content_type.split_once(';')?;
    if !media.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    param(params, "boundary").filter(|b| !b.is_empty() && b.len() <= 200)
}

/// A parameter of a header value (`; key=value` or `; key="quoted"`).
fn param(params: &str, key: &str) -> Option<String> {
    let mut rest = params;
    loop {
        rest = rest.trim_start_matches([';', ' ', '\t']);
        if rest.is_empty() {
            return None;
        }
        let eq = rest.find('=')?;
        let name = rest[..eq].trim();
        rest = &rest[eq + 1..];
        let value;
        if let Some(quoted) = rest.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = quoted.char_indices();
            let mut end = quoted.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            out.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => out.push(c),
                }
            }
            value = out;
            rest = &quoted[end.min(quoted.len())..];
        } else {
            let end = rest.find(';').unwrap_or(rest.len());
            value = rest[..end].trim().to_string();
            rest = &rest[end..];
        }
        if name.eq_ignore_ascii_case(key) {
            return Some(value);
        }
    }
}

/// `filename*=UTF-8''percent-encoded` (RFC 5987).
fn ext_value(v: &str) -> Option<String> {
    let (_charset, rest) = v.split_once('\'')?;
    let (_lang, encoded) = rest.split_once('\'')?;
    Some(
        percent_encoding::percent_decode_str(encoded)
            .decode_utf8_lossy()
            .into_owned(),
    )
}

/// Browsers, undici (the JS SDK) and httpx (the python SDK) write `"`, CR and LF in a
/// filename as `%22`, `%0D` and `%0A` (the WHATWG form encoding): undo exactly that.
fn unescape_whatwg(name: &str) -> String {
    name.replace("%22", "\"")
        .replace("%0D", "\r")
        .replace("%0A", "\n")
}

fn parse_headers(block: &[u8]) -> PartInfo {
    let text = String::from_utf8_lossy(block);
    let mut info = PartInfo::default();
    for line in text.split("\r\n") {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if !name.trim().eq_ignore_ascii_case("content-disposition") {
            continue;
        }
        let params = value.split_once(';').map_or("", |(_, p)| p);
        info.name = param(params, "name").unwrap_or_default();
        info.filename = param(params, "filename*")
            .and_then(|v| ext_value(&v))
            .or_else(|| param(params, "filename").map(|f| unescape_whatwg(&f)));
    }
    info
}

impl<R: Read> Multipart<R> {
    pub fn new(r: R, boundary: &str) -> Multipart<R> {
        Multipart {
            r,
            // The first delimiter has no CRLF before it: pretend it has.
            buf: b"\r\n".to_vec(),
            pos: 0,
            eof: false,
            delim: format!("\r\n--{boundary}").into_bytes(),
            state: State::Preamble,
        }
    }

    fn fill(&mut self) -> Result<bool, MultipartError> {
        if self.eof {
            return Ok(false);
        }
        if self.pos > 0 && self.pos >= self.buf.len() / 2 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + READ_SIZE, 0);
        let n = loop {
            match self.r.read(&mut self.buf[old..]) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.buf.truncate(old);
                    return Err(MultipartError::Read(e));
                }
            }
        };
        self.buf.truncate(old + n);
        self.eof = n == 0;
        Ok(n > 0)
    }

    /// Moves data up to the next delimiter into `out` and consumes the delimiter.
    fn copy_to_delimiter(&mut self, out: &mut dyn Write) -> Result<u64, MultipartError> {
        let mut copied = 0u64;
        loop {
            let window = &self.buf[self.pos..];
            if let Some(i) = memchr::memmem::find(window, &self.delim) {
                out.write_all(&window[..i]).map_err(MultipartError::Write)?;
                self.pos += i + self.delim.len();
                return Ok(copied + i as u64);
            }
            // Keep a tail that may be the start of the delimiter.
            let safe = window.len().saturating_sub(self.delim.len() - 1);
            out.write_all(&window[..safe])
                .map_err(MultipartError::Write)?;
            copied += safe as u64;
            self.pos += safe;
            if !self.fill()? {
                return Err(MultipartError::Malformed(
                    "the multipart body ended before its closing boundary".into(),
                ));
            }
        }
    }

    fn need(&mut self, n: usize) -> Result<bool, MultipartError> {
        while self.buf.len() - self.pos < n {
            if !self.fill()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Advances to the next part (skipping the rest of the current one). `None` after
    /// the closing delimiter.
    pub fn next_part(&mut self) -> Result<Option<PartInfo>, MultipartError> {
        match self.state {
            State::Done => return Ok(None),
            State::Preamble | State::Body => {
                self.copy_to_delimiter(&mut io::sink())?;
            }
            State::Delimited => {}
        }
        if !self.need(2)? {
            return Err(MultipartError::Malformed(
                "the multipart body ended after a boundary".into(),
            ));
        }
        if &self.buf[self.pos..self.pos + 2] == b"--" {
            self.state = State::Done;
            return Ok(None);
        }
        // Transport padding, then CRLF.
        loop {
            if !self.need(1)? {
                return Err(MultipartError::Malformed("truncated boundary line".into()));
            }
            match self.buf[self.pos] {
                b' ' | b'\t' => self.pos += 1,
                _ => break,
            }
        }
        if !self.need(2)? || &self.buf[self.pos..self.pos + 2] != b"\r\n" {
            return Err(MultipartError::Malformed(
                "a boundary line does not end with CRLF".into(),
            ));
        }
        self.pos += 2;
        // Headers up to the empty line (a part may have no headers at all).
        loop {
            let window = &self.buf[self.pos..];
            if window.starts_with(b"\r\n") {
                self.pos += 2;
                self.state = State::Body;
                return Ok(Some(PartInfo::default()));
            }
            if let Some(i) = memchr::memmem::find(window, b"\r\n\r\n") {
                let info = parse_headers(&window[..i]);
                self.pos += i + 4;
                self.state = State::Body;
                return Ok(Some(info));
            }
            if window.len() > MAX_PART_HEADERS {
                return Err(MultipartError::Malformed(format!(
                    "part headers are longer than {MAX_PART_HEADERS} bytes"
                )));
            }
            if !self.fill()? {
                return Err(MultipartError::Malformed(
                    "the multipart body ended inside part headers".into(),
                ));
            }
        }
    }

    /// Copies the current part's body to `out`; returns its length.
    pub fn copy_part(&mut self, out: &mut dyn Write) -> Result<u64, MultipartError> {
        if self.state != State::Body {
            return Ok(0);
        }
        let n = self.copy_to_delimiter(out)?;
        self.state = State::Delimited;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads one byte at a time, to cross every buffer edge.
    struct Trickle<'a>(&'a [u8]);
    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0.is_empty() || buf.is_empty() {
                return Ok(0);
            }
            buf[0] = self.0[0];
            self.0 = &self.0[1..];
            Ok(1)
        }
    }

    fn parts(body: &[u8], boundary: &str) -> Result<Vec<(PartInfo, Vec<u8>)>, MultipartError> {
        let mut m = Multipart::new(Trickle(body), boundary);
        let mut out = Vec::new();
        while let Some(info) = m.next_part()? {
            let mut data = Vec::new();
            m.copy_part(&mut data)?;
            out.push((info, data));
        }
        Ok(out)
    }

    #[test]
    fn reads_files_with_paths_and_binary_bodies() {
        let body = b"preamble\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/a \\\"q%22.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XyZ\r\ncontent-disposition: form-data; name=file; filename*=UTF-8''%2Ftmp%2Fb%20c\r\n\r\n\r\n--Xy\x00\xff\r\n--XyZ--\r\nepilogue";
        let got = parts(body, "XyZ").unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0.name, "file");
        assert_eq!(got[0].0.filename.as_deref(), Some("/home/user/a \"q\".txt"));
        assert_eq!(got[0].1, b"hello");
        assert_eq!(got[1].0.filename.as_deref(), Some("/tmp/b c"));
        assert_eq!(got[1].1, b"\r\n--Xy\x00\xff");
    }

    #[test]
    fn truncated_bodies_are_malformed() {
        let body = b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc";
        assert!(matches!(
            parts(body, "b"),
            Err(MultipartError::Malformed(_))
        ));
        assert!(matches!(parts(b"", "b"), Err(MultipartError::Malformed(_))));
    }

    #[test]
    fn boundary_comes_from_the_content_type() {
        assert_eq!(
            boundary("multipart/form-data; boundary=\"abc def\"").as_deref(),
            Some("abc def")
        );
        assert_eq!(
            boundary("Multipart/Form-Data;boundary=x1").as_deref(),
            Some("x1")
        );
        assert_eq!(boundary("application/json"), None);
    }
}
