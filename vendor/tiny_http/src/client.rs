use ascii::AsciiString;

use std::io::Error as IoError;
use std::io::Result as IoResult;
use std::io::{BufReader, BufWriter, ErrorKind, Read};

use std::net::SocketAddr;
use std::str::FromStr;

use crate::common::{HTTPVersion, Method};
use crate::limits::{ConnControl, Limits};
use std::sync::Arc;
use crate::util::RefinedTcpStream;
use crate::util::{SequentialReader, SequentialReaderBuilder, SequentialWriterBuilder};
use crate::Request;

/// A ClientConnection is an object that will store a socket to a client
/// and return Request objects.
pub struct ClientConnection {
    // address of the client
    remote_addr: IoResult<Option<SocketAddr>>,

    // sequence of Readers to the stream, so that the data is not read in
    //  the wrong order
    source: SequentialReaderBuilder<BufReader<RefinedTcpStream>>,

    // sequence of Writers to the stream, to avoid writing response #2 before
    //  response #1
    sink: SequentialWriterBuilder<BufWriter<RefinedTcpStream>>,

    // Reader to read the next header from
    next_header_source: SequentialReader<BufReader<RefinedTcpStream>>,

    // set to true if we know that the previous request is the last one
    no_more_requests: bool,

    // true if the connection goes through SSL
    secure: bool,

    // agentenv patch: the connection's bounds and its shared read deadlines
    limits: Arc<Limits>,
    control: Arc<ConnControl>,
}

/// Error that can happen when reading a request.
#[derive(Debug)]
enum ReadError {
    WrongRequestLine,
    WrongHeader(HTTPVersion),
    /// request line and headers exceed `Limits::max_header_bytes`
    HeaderTooLarge,
    /// the connection was idle (no byte of a new request) past `Limits::idle_timeout`, or
    /// the previous request left a body that could not be drained
    Closed,
    /// the client sent an unrecognized `Expect` header
    ExpectationFailed(HTTPVersion),
    ReadIoError(IoError),
}

impl ClientConnection {
    /// Creates a new `ClientConnection` that takes ownership of the `TcpStream`.
    pub fn new(
        write_socket: RefinedTcpStream,
        read_socket: RefinedTcpStream,
        limits: Arc<Limits>,
    ) -> ClientConnection {
        let control = ConnControl::new();
        let mut read_socket = read_socket.with_control(control.clone());
        let remote_addr = read_socket.peer_addr();
        let secure = read_socket.secure();

        let mut source = SequentialReaderBuilder::new(BufReader::with_capacity(1024, read_socket));
        let first_header = source.next().unwrap();

        ClientConnection {
            source,
            sink: SequentialWriterBuilder::new(BufWriter::with_capacity(1024, write_socket)),
            remote_addr,
            next_header_source: first_header,
            no_more_requests: false,
            secure,
            limits,
            control,
        }
    }

    /// true if the connection is HTTPS
    pub fn secure(&self) -> bool {
        self.secure
    }

    /// Reads the next line from self.next_header_source.
    ///
    /// Reads until `CRLF` is reached. The next read will start
    ///  at the first byte of the new line.
    ///
    /// agentenv patch: at most `budget` bytes (else `ReadError::HeaderTooLarge`); the
    /// first byte of a request switches the idle deadline to the header deadline.
    fn read_next_line(&mut self, budget: &mut usize, started: &mut bool) -> Result<AsciiString, ReadError> {
        let mut buf = Vec::new();
        let mut prev_byte_was_cr = false;

        loop {
            let byte = self.next_header_source.by_ref().bytes().next();

            let byte = match byte {
                Some(Ok(b)) => b,
                Some(Err(e)) if e.kind() == ErrorKind::TimedOut && !*started => {
                    return Err(ReadError::Closed)
                }
                Some(Err(e)) => return Err(ReadError::ReadIoError(e)),
                None => {
                    return Err(ReadError::ReadIoError(IoError::new(
                        ErrorKind::ConnectionAborted,
                        "Unexpected EOF",
                    )))
                }
            };
            if !*started {
                *started = true;
                self.control.set_deadline(self.limits.header_timeout);
            }
            if *budget == 0 {
                return Err(ReadError::HeaderTooLarge);
            }
            *budget -= 1;

            if byte == b'\n' && prev_byte_was_cr {
                buf.pop(); // removing the '\r'
                return AsciiString::from_ascii(buf).map_err(|_| {
                    ReadError::ReadIoError(IoError::new(
                        ErrorKind::InvalidInput,
                        "Header is not in ASCII",
                    ))
                });
            }

            prev_byte_was_cr = byte == b'\r';

            buf.push(byte);
        }
    }

    /// Reads a request from the stream.
    /// Blocks until the header has been read.
    fn read(&mut self) -> Result<Request, ReadError> {
        // agentenv patch: once the previous request has released the stream, a connection
        // whose previous body was left undrained closes; otherwise the idle timer starts.
        self.next_header_source.wait_turn();
        if self.control.must_close() {
            self.linger();
            return Err(ReadError::Closed);
        }
        self.control.set_per_read(None);
        self.control.set_deadline(self.limits.idle_timeout);
        let mut budget = self.limits.max_header_bytes;
        let mut started = false;

        let (method, path, version, headers) = {
            // reading the request line
            let (method, path, version) = {
                let line = self.read_next_line(&mut budget, &mut started)?;

                parse_request_line(
                    line.as_str().trim(), // TODO: remove this conversion
                )?
            };

            // getting all headers
            let headers = {
                let mut headers = Vec::new();
                loop {
                    let line = self.read_next_line(&mut budget, &mut started)?;

                    if line.is_empty() {
                        break;
                    };
                    headers.push(match FromStr::from_str(line.as_str().trim()) {
                        // TODO: remove this conversion
                        Ok(h) => h,
                        _ => return Err(ReadError::WrongHeader(version)),
                    });
                }

                headers
            };

            (method, path, version, headers)
        };

        // building the writer for the request
        let writer = self.sink.next().unwrap();

        // follow-up for next potential request
        let mut data_source = self.source.next().unwrap();
        std::mem::swap(&mut self.next_header_source, &mut data_source);

        // building the next reader (a buffered body still counts against the header
        // deadline; a streamed one gets the per-read body timeout)
        let request = crate::request::new_request(
            self.secure,
            method,
            path,
            version.clone(),
            headers,
            self.remote_addr.as_ref().ok().copied().flatten(),
            data_source,
            writer,
            &self.limits,
            &self.control,
        )
        .map_err(|e| {
            use crate::request;
            match e {
                request::RequestCreationError::CreationIoError(e) => ReadError::ReadIoError(e),
                request::RequestCreationError::ExpectationFailed => {
                    ReadError::ExpectationFailed(version)
                }
                request::RequestCreationError::BadLength => ReadError::WrongHeader(version),
            }
        })?;
        self.control.set_deadline(None);
        self.control.set_per_read(self.limits.body_timeout);

        // return the request
        Ok(request)
    }
}

impl Iterator for ClientConnection {
    type Item = Request;

    /// Blocks until the next Request is available.
    /// Returns None when no new Requests will come from the client.
    fn next(&mut self) -> Option<Request> {
        use crate::{Response, StatusCode};

        // the client sent a "connection: close" header in this previous request
        //  or is using HTTP 1.0, meaning that no new request will come
        // agentenv patch: once that request is done, a body it left unread closes lingering.
        if self.no_more_requests {
            self.next_header_source.wait_turn();
            if self.control.must_close() {
                self.linger();
            }
            return None;
        }

        loop {
            let rq = match self.read() {
                // we don't know where the next request would start, so we have to close
                Err(ReadError::WrongRequestLine) => {
                    self.reject(400, HTTPVersion(1, 1));
                    return None;
                }

                Err(ReadError::WrongHeader(ver)) => {
                    self.reject(400, ver);
                    return None;
                }

                Err(ReadError::HeaderTooLarge) => {
                    self.reject(431, HTTPVersion(1, 1));
                    return None;
                }

                Err(ReadError::Closed) => return None,

                Err(ReadError::ReadIoError(ref err)) if err.kind() == ErrorKind::TimedOut => {
                    self.reject(408, HTTPVersion(1, 1));
                    return None;
                }

                Err(ReadError::ExpectationFailed(ver)) => {
                    let writer = self.sink.next().unwrap();
                    let response = Response::new_empty(StatusCode(417));
                    response.raw_print(writer, ver, &[], true, None).ok();
                    return None; // TODO: should be recoverable, but needs handling in case of body
                }

                Err(ReadError::ReadIoError(_)) => return None,

                Ok(rq) => rq,
            };

            // checking HTTP version
            if *rq.http_version() > (1, 1) {
                let writer = self.sink.next().unwrap();
                let response = Response::from_string(
                    "This server only supports HTTP versions 1.0 and 1.1".to_owned(),
                )
                .with_status_code(StatusCode(505));
                response
                    .raw_print(writer, HTTPVersion(1, 1), &[], false, None)
                    .ok();
                continue;
            }

            // updating the status of the connection
            let connection_header = rq
                .headers()
                .iter()
                .find(|h| h.field.equiv("Connection"))
                .map(|h| h.value.as_str());

            let lowercase = connection_header.map(|h| h.to_ascii_lowercase());

            match lowercase {
                Some(ref val) if val.contains("close") => self.no_more_requests = true,
                Some(ref val) if val.contains("upgrade") => self.no_more_requests = true,
                Some(ref val)
                    if !val.contains("keep-alive") && *rq.http_version() == HTTPVersion(1, 0) =>
                {
                    self.no_more_requests = true
                }
                None if *rq.http_version() == HTTPVersion(1, 0) => self.no_more_requests = true,
                _ => (),
            };

            // returning the request
            return Some(rq);
        }
    }
}

impl ClientConnection {
    /// agentenv patch: answers `status` with `Connection: close`, then closes lingering.
    fn reject(&mut self, status: u16, version: HTTPVersion) {
        use crate::{Response, StatusCode};
        use std::io::Write;
        let mut writer = self.sink.next().unwrap();
        let response = Response::new_empty(StatusCode(status)).with_connection_close();
        if response
            .raw_print(&mut writer, version, &[], false, None)
            .and_then(|_| writer.flush())
            .is_err()
        {
            return;
        }
        self.linger();
    }

    /// agentenv patch: a lingering close, for a connection that closes while the client
    /// may still be sending. Shuts down for writing (the answers already written reach the
    /// client, then its end of stream), then reads and discards what the client still
    /// sends until it closes, at most `Limits::linger_limit` bytes within
    /// `Limits::linger_timeout`. Closing with unread data makes the kernel reset the
    /// connection, which fails a client still sending before it reads the answer (and on
    /// some systems destroys the answer in its receive buffer).
    fn linger(&mut self) {
        if let Some(reader) = self.next_header_source.get_mut() {
            reader.get_mut().shutdown_write();
        }
        self.control.set_per_read(None);
        self.control.set_deadline(Some(self.limits.linger_timeout));
        let mut rest = (&mut self.next_header_source).take(self.limits.linger_limit);
        let _ = std::io::copy(&mut rest, &mut std::io::sink());
    }
}

/// Parses a "HTTP/1.1" string.
fn parse_http_version(version: &str) -> Result<HTTPVersion, ReadError> {
    let (major, minor) = match version {
        "HTTP/0.9" => (0, 9),
        "HTTP/1.0" => (1, 0),
        "HTTP/1.1" => (1, 1),
        "HTTP/2.0" => (2, 0),
        "HTTP/3.0" => (3, 0),
        _ => return Err(ReadError::WrongRequestLine),
    };

    Ok(HTTPVersion(major, minor))
}

/// Parses the request line of the request.
/// eg. GET / HTTP/1.1
fn parse_request_line(line: &str) -> Result<(Method, String, HTTPVersion), ReadError> {
    let mut parts = line.split(' ');

    let method = parts.next().and_then(|w| w.parse().ok());
    let path = parts.next().map(ToOwned::to_owned);
    let version = parts.next().and_then(|w| parse_http_version(w).ok());

    method
        .and_then(|method| Some((method, path?, version?)))
        .ok_or(ReadError::WrongRequestLine)
}

#[cfg(test)]
mod test {
    #[test]
    fn test_parse_request_line() {
        let (method, path, ver) = super::parse_request_line("GET /hello HTTP/1.1").unwrap();

        assert!(method == crate::Method::Get);
        assert!(path == "/hello");
        assert!(ver == crate::common::HTTPVersion(1, 1));

        assert!(super::parse_request_line("GET /hello").is_err());
        assert!(super::parse_request_line("qsd qsd qsd").is_err());
    }
}
