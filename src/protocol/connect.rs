//! The Connect RPC protocol with the JSON codec over HTTP/1.1, as the E2B SDKs speak it.
//!
//! Unary calls are `POST application/json` with the request message as the body; the
//! answer is the response message (200) or a Connect error object with the HTTP status
//! of its code. Streaming calls are `POST application/connect+json` whose bodies are
//! sequences of envelopes:
//!
//! ```text
//! +-------+----------------+----------------------+
//! | flags | length (u32 BE)| JSON message         |
//! +-------+----------------+----------------------+
//!   0x00 = message, 0x01 = compressed (refused), 0x02 = end of stream
//! ```
//!
//! A response stream always answers 200 and ends with an end-of-stream envelope holding
//! `{}` or `{"error": {"code": ..., "message": ...}}`; errors never change the status.

use std::fmt;
use std::io::{self, Read, Write};
use std::time::Duration;

use base64::Engine;
use serde::{Deserialize, Deserializer};
use serde_json::{json, Value};

/// Envelope flag: the payload is compressed (the SDKs never compress; refused).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream, the payload is the end message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Largest request message accepted (unary body or one envelope).
pub const MAX_MESSAGE: usize = 8 << 20;
/// Longest call timeout honoured (longer ones are cut to this).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(366 * 24 * 3600);
/// Keepalive interval when the client sends no `Keepalive-Ping-Interval` (envd's default).
pub const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

/// Connect error codes (connectrpc.com/docs/protocol#error-codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a unary error answers with.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A failed call: the code the SDK maps to its exception, and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> RpcError {
        RpcError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> RpcError {
        RpcError::new(Code::Internal, message)
    }

    /// The Connect error object.
    pub fn to_json(&self) -> Value {
        json!({"code": self.code.as_str(), "message": self.message})
    }
}

impl fmt::Display for RpcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

/// Reads one envelope. `Ok(None)` at a clean end of the body (before any header byte).
pub fn read_envelope(r: &mut dyn Read) -> Result<Option<(u8, Vec<u8>)>, RpcError> {
    let mut header = [0u8; 5];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(RpcError::invalid("request stream ended inside an envelope")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(RpcError::new(
                    Code::Canceled,
                    format!("reading the request: {e}"),
                ))
            }
        }
    }
    let flags = header[0];
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(RpcError::new(
            Code::Unimplemented,
            "compressed messages are not supported; send them uncompressed",
        ));
    }
    if len > MAX_MESSAGE {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            format!("message of {len} bytes is larger than the limit of {MAX_MESSAGE}"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .map_err(|e| RpcError::invalid(format!("request stream ended inside a message: {e}")))?;
    Ok(Some((flags, payload)))
}

/// One envelope around `payload`.
pub fn envelope(flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 5);
    out.push(flags);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// The end-of-stream envelope for a call's outcome.
pub fn end_stream(result: &Result<(), RpcError>) -> Vec<u8> {
    let body = match result {
        Ok(()) => json!({}),
        Err(e) => json!({"error": e.to_json()}),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// Where a server-streaming handler writes its messages. A write error means the client
/// is gone; handlers stop and return.
pub trait MessageSink {
    fn send(&mut self, message: &Value) -> io::Result<()>;
}

/// Writes enveloped messages, each flushed as it is written.
pub struct EnvelopeWriter<W: Write> {
    pub inner: W,
}

impl<W: Write> MessageSink for EnvelopeWriter<W> {
    fn send(&mut self, message: &Value) -> io::Result<()> {
        self.inner
            .write_all(&envelope(0, message.to_string().as_bytes()))?;
        self.inner.flush()
    }
}

/// Parses a request message; unknown fields are ignored, as protobuf JSON parsers do.
pub fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, RpcError> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| RpcError::invalid(format!("bad request message: {e}")))
}

/// Protobuf `bytes` in JSON: base64, standard or URL-safe, padded or not.
pub fn decode_bytes(s: &str) -> Result<Vec<u8>, RpcError> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(s).ok())
        .ok_or_else(|| RpcError::invalid("bytes field is not valid base64"))
}

/// Protobuf `bytes` for JSON output.
pub fn encode_bytes(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A protobuf JSON bytes field (absent, null or base64).
pub fn de_bytes<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    s.map(|s| decode_bytes(&s).map_err(serde::de::Error::custom))
        .transpose()
}

/// A protobuf JSON 32-bit unsigned integer: a number or a decimal string.
pub fn de_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom(format!("{n} is not a uint32"))),
        Some(Value::String(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom(format!("{s:?} is not a uint32"))),
        Some(other) => Err(serde::de::Error::custom(format!("{other} is not a uint32"))),
    }
}

/// A protobuf JSON list or map field: absent and `null` are empty.
pub fn de_or_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The timeout a client set with `Connect-Timeout-Ms`, if any.
pub fn timeout_header(value: Option<&str>) -> Result<Option<Duration>, RpcError> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(0) => Ok(None),
            Ok(ms) => Ok(Some(Duration::from_millis(ms).min(MAX_TIMEOUT))),
            Err(_) => Err(RpcError::invalid(format!("bad Connect-Timeout-Ms {v:?}"))),
        },
    }
}

/// The keepalive interval a client asked for with `Keepalive-Ping-Interval` (seconds).
pub fn keepalive_header(value: Option<&str>) -> Duration {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&s| s > 0)
        .map(|s| Duration::from_secs(s.min(3600)))
        .unwrap_or(DEFAULT_KEEPALIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_end_stream_carries_errors() {
        let mut bytes = envelope(0, br#"{"a":1}"#);
        bytes.extend(end_stream(&Err(RpcError::not_found("gone"))));
        let mut r = &bytes[..];
        let (flags, msg) = read_envelope(&mut r).unwrap().unwrap();
        assert_eq!((flags, &msg[..]), (0, &br#"{"a":1}"#[..]));
        let (flags, msg) = read_envelope(&mut r).unwrap().unwrap();
        assert_eq!(flags, FLAG_END_STREAM);
        let v: Value = serde_json::from_slice(&msg).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert!(read_envelope(&mut r).unwrap().is_none());
    }

    #[test]
    fn bad_envelopes_are_refused() {
        let mut r = &envelope(FLAG_COMPRESSED, b"x")[..];
        assert_eq!(read_envelope(&mut r).unwrap_err().code, Code::Unimplemented);
        let mut big = vec![0u8];
        big.extend_from_slice(&(MAX_MESSAGE as u32 + 1).to_be_bytes());
        assert_eq!(
            read_envelope(&mut &big[..]).unwrap_err().code,
            Code::ResourceExhausted
        );
        let mut short = &envelope(0, b"abcdef")[..8];
        assert_eq!(
            read_envelope(&mut short).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn protobuf_json_scalars() {
        assert_eq!(decode_bytes("aGk=").unwrap(), b"hi");
        assert_eq!(decode_bytes("aGk").unwrap(), b"hi");
        assert_eq!(decode_bytes("-_8").unwrap(), vec![0xfb, 0xff]);
        assert!(decode_bytes("!!").is_err());
        #[derive(Deserialize)]
        struct N {
            #[serde(default, deserialize_with = "de_u32")]
            n: Option<u32>,
        }
        let n: N = parse(br#"{"n":"7"}"#).unwrap();
        assert_eq!(n.n, Some(7));
        let n: N = parse(br#"{"n":7}"#).unwrap();
        assert_eq!(n.n, Some(7));
        let n: N = parse(b"").unwrap();
        assert_eq!(n.n, None);
        assert!(parse::<N>(br#"{"n":-1}"#).is_err());
        assert_eq!(
            timeout_header(Some("1500")).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(timeout_header(None).unwrap(), None);
        assert_eq!(
            timeout_header(Some("18446744073709551615")).unwrap(),
            Some(MAX_TIMEOUT)
        );
        assert!(timeout_header(Some("x")).is_err());
        assert_eq!(keepalive_header(Some("50")), Duration::from_secs(50));
        assert_eq!(keepalive_header(Some("0")), DEFAULT_KEEPALIVE);
    }
}
