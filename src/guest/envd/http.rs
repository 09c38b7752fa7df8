//! tiny_http glue: headers, bounded bodies, plain responses, and streaming responses
//! written onto the connection itself.
//!
//! tiny_http 0.12 sends a body of unknown length through a chunk encoder that buffers
//! 8 KiB before writing, so a stream's first message would sit in a buffer. A stream
//! therefore takes the connection's writer ([`Request::into_writer`]) after its request
//! body is read, writes its own head, and sends each message as one chunk, flushed at
//! once. The connection stays usable for the next request afterwards.

use std::io::{self, Read, Write};

use serde_json::Value;
use tiny_http::{Header, Request, Response};

use crate::protocol::connect::{self, EnvelopeWriter, MessageSink, RpcError};

/// The first value of header `name`.
pub fn header(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .iter()
        .find(|h| h.field.as_str().as_str().eq_ignore_ascii_case(name))
        .map(|h| h.value.as_str().to_string())
}

/// Reads the whole body, refusing one over `limit` bytes.
pub fn read_body(req: &mut Request, limit: usize) -> Result<Vec<u8>, RpcError> {
    let mut body = Vec::new();
    req.as_reader()
        .take(limit as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| RpcError::invalid(format!("reading the request body: {e}")))?;
    if body.len() > limit {
        return Err(RpcError::new(
            connect::Code::ResourceExhausted,
            format!("request body is larger than the limit of {limit} bytes"),
        ));
    }
    Ok(body)
}

/// Reads what is left of a request body that should hold nothing more.
pub fn drain(body: &mut dyn Read) -> Result<(), RpcError> {
    let mut rest = Vec::new();
    body.take(connect::MAX_MESSAGE as u64 + 1)
        .read_to_end(&mut rest)
        .map_err(|e| RpcError::invalid(format!("reading the request body: {e}")))?;
    if rest.len() > connect::MAX_MESSAGE {
        return Err(RpcError::invalid(
            "the request holds more than the one message of a server stream",
        ));
    }
    Ok(())
}

fn content_type(value: &str) -> Header {
    Header::from_bytes("Content-Type", value).expect("static header is valid")
}

pub fn respond_bytes(req: Request, status: u16, content_type_value: &str, body: Vec<u8>) {
    let response = Response::from_data(body)
        .with_status_code(status)
        .with_header(content_type(content_type_value));
    if let Err(e) = req.respond(response) {
        log::debug!("client left before the answer: {e}");
    }
}

pub fn respond_json(req: Request, status: u16, body: &Value) {
    respond_bytes(
        req,
        status,
        "application/json",
        body.to_string().into_bytes(),
    );
}

pub fn respond_empty(req: Request, status: u16) {
    if let Err(e) = req.respond(Response::empty(status)) {
        log::debug!("client left before the answer: {e}");
    }
}

/// Writes each `write` as one HTTP/1.1 chunk (HTTP/1.0: raw, connection closes at the end).
pub struct ChunkedWriter {
    inner: Box<dyn Write + Send>,
    chunked: bool,
}

impl Write for ChunkedWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.chunked {
            write!(self.inner, "{:x}\r\n", buf.len())?;
            self.inner.write_all(buf)?;
            self.inner.write_all(b"\r\n")?;
        } else {
            self.inner.write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A Connect server stream on the wire: 200, `application/connect+json`, chunked.
pub struct StreamResponse {
    out: EnvelopeWriter<ChunkedWriter>,
}

impl StreamResponse {
    /// Writes the response head. The request body must have been read.
    pub fn start(req: Request) -> io::Result<StreamResponse> {
        let chunked = req.http_version() != &tiny_http::HTTPVersion(1, 0);
        let mut inner = req.into_writer();
        let framing = if chunked {
            "Transfer-Encoding: chunked\r\n"
        } else {
            "Connection: close\r\n"
        };
        write!(
            inner,
            "HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n\
             Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n{framing}\r\n"
        )?;
        inner.flush()?;
        Ok(StreamResponse {
            out: EnvelopeWriter {
                inner: ChunkedWriter { inner, chunked },
            },
        })
    }

    /// Sends the end-of-stream message and ends the body.
    pub fn finish(mut self, result: &Result<(), RpcError>) {
        let end = connect::end_stream(result);
        let w = &mut self.out.inner;
        let res = w.write_all(&end).and_then(|_| {
            if w.chunked {
                w.inner.write_all(b"0\r\n\r\n")?;
            }
            w.flush()
        });
        if let Err(e) = res {
            log::debug!("client left before the end of the stream: {e}");
        }
    }
}

impl MessageSink for StreamResponse {
    fn send(&mut self, message: &Value) -> io::Result<()> {
        self.out.send(message)
    }
}
