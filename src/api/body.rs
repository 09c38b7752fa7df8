//! Request bodies and fields, with the status rules of api.md §1.4: 413 for size, 415 for
//! content type, 400 for malformed JSON or bad values, 422 for wrong shapes and types.

use super::error::ApiError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::io::Read;

/// Deepest nesting of arrays and objects a JSON body may have. No request needs more than
/// a few levels; the limit keeps a hostile body's cost (parse recursion, what the custom
/// extension is sent) small, and its 400 says what was wrong.
pub const MAX_JSON_DEPTH: usize = 32;

/// Reads a JSON body of at most `limit` bytes. A missing or empty body is `{}`.
pub fn read_json(
    content_length: Option<usize>,
    content_type: Option<&str>,
    reader: &mut dyn Read,
    limit: u64,
) -> Result<Fields, ApiError> {
    if content_length.is_some_and(|n| n as u64 > limit) {
        return Err(too_large(limit));
    }
    let mut buf = Vec::new();
    reader
        .take(limit + 1)
        .read_to_end(&mut buf)
        .map_err(|e| ApiError::bad_request(format!("cannot read request body: {e}")))?;
    if buf.len() as u64 > limit {
        return Err(too_large(limit));
    }
    if buf.iter().all(u8::is_ascii_whitespace) {
        return Ok(Fields(Map::new()));
    }
    if !content_type.is_some_and(is_json_content_type) {
        return Err(ApiError::new(
            415,
            "request body must have Content-Type: application/json",
        ));
    }
    if nests_deeper_than(&buf, MAX_JSON_DEPTH) {
        return Err(ApiError::bad_request(format!(
            "JSON body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
        )));
    }
    let value: Value = serde_json::from_slice(&buf)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))?;
    match value {
        Value::Object(map) => Ok(Fields(map)),
        _ => Err(ApiError::unprocessable(
            "request body must be a JSON object",
        )),
    }
}

/// Whether arrays and objects in `json` nest deeper than `max` (brackets inside strings do
/// not count). A scan of the bytes, before any parser recurses.
fn nests_deeper_than(json: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in json {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

fn too_large(limit: u64) -> ApiError {
    ApiError::new(
        413,
        format!("request body exceeds {limit} bytes (server.max_body_bytes)"),
    )
}

/// `application/json`, parameters such as `charset` allowed.
fn is_json_content_type(ct: &str) -> bool {
    ct.split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// The top-level object of a JSON body, with typed accessors. A wrong type is 422.
#[derive(Debug)]
pub struct Fields(pub Map<String, Value>);

impl Fields {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// The raw value, `null` included.
    pub fn raw(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(wrong_type(key, "a string")),
        }
    }

    pub fn required_str(&self, key: &str) -> Result<&str, ApiError> {
        self.str(key)?
            .ok_or_else(|| ApiError::unprocessable(format!("missing required field {key}")))
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(wrong_type(key, "a boolean")),
        }
    }

    /// An integer within `range` (400 when out of it).
    pub fn int_in(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<u64>,
    ) -> Result<Option<u64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = match v {
            Value::Number(n) if n.is_i64() || n.is_u64() => n.as_i64().map(i128::from),
            _ => return Err(wrong_type(key, "an integer")),
        }
        .or_else(|| v.as_u64().map(i128::from))
        .unwrap_or(i128::MAX);
        if n < *range.start() as i128 || n > *range.end() as i128 {
            return Err(ApiError::bad_request(format!(
                "{key} must be within {}..={}",
                range.start(),
                range.end()
            )));
        }
        Ok(Some(n as u64))
    }

    /// An object of string values.
    pub fn string_map(&self, key: &str) -> Result<BTreeMap<String, String>, ApiError> {
        match self.get(key) {
            None => Ok(BTreeMap::new()),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    _ => Err(wrong_type(key, "an object of strings")),
                })
                .collect(),
            Some(_) => Err(wrong_type(key, "an object of strings")),
        }
    }

    pub fn string_list(&self, key: &str) -> Result<Vec<String>, ApiError> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(wrong_type(key, "an array of strings")),
                })
                .collect(),
            Some(_) => Err(wrong_type(key, "an array of strings")),
        }
    }
}

fn wrong_type(key: &str, what: &str) -> ApiError {
    ApiError::unprocessable(format!("field {key} must be {what}"))
}

/// Environment variable rules (api.md §4.2): names `[A-Za-z_][A-Za-z0-9_]*`, no NUL.
pub fn check_env(key: &str, env: &BTreeMap<String, String>) -> Result<(), ApiError> {
    for (k, v) in env {
        let mut bytes = k.bytes();
        let first_ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
        if !first_ok || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(ApiError::bad_request(format!(
                "{key}: invalid variable name {k:?}; names match [A-Za-z_][A-Za-z0-9_]*"
            )));
        }
        if v.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "{key}: value of {k} contains NUL"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str, ct: Option<&str>) -> Result<Fields, ApiError> {
        read_json(Some(body.len()), ct, &mut body.as_bytes(), 64)
    }

    #[test]
    fn body_status_rules() {
        assert_eq!(parse("", None).unwrap().0.len(), 0);
        assert_eq!(parse("{}", Some("text/plain")).unwrap_err().status, 415);
        assert!(parse("{}", Some("application/json; charset=utf-8")).is_ok());
        assert_eq!(
            parse("{", Some("application/json")).unwrap_err().status,
            400
        );
        assert_eq!(
            parse("[1]", Some("application/json")).unwrap_err().status,
            422
        );
        let big = format!("{{\"a\":\"{}\"}}", "x".repeat(100));
        assert_eq!(
            parse(&big, Some("application/json")).unwrap_err().status,
            413
        );
        // Found while reading, with no length announced.
        let e = read_json(None, Some("application/json"), &mut big.as_bytes(), 64).unwrap_err();
        assert_eq!(e.status, 413);
    }

    #[test]
    fn nesting_depth_is_limited_before_parsing() {
        let nested = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n - 1), "]".repeat(n - 1));
        let parse = |body: &str| {
            read_json(
                None,
                Some("application/json"),
                &mut body.as_bytes(),
                1 << 20,
            )
        };
        assert!(parse(&nested(MAX_JSON_DEPTH)).is_ok());
        let e = parse(&nested(MAX_JSON_DEPTH + 1)).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("deeper than 32"), "{}", e.message);
        // Far past serde_json's own recursion limit: still our 400.
        let e = parse(&"[".repeat(100_000)).unwrap_err();
        assert!(e.message.contains("deeper than 32"), "{}", e.message);
        // Brackets in strings, escaped quotes included, do not count.
        let quoted = format!("{{\"a\":\"\\\"{}\"}}", "[{".repeat(100));
        assert!(parse(&quoted).is_ok(), "{quoted}");
    }

    #[test]
    fn field_types_and_ranges() {
        let f = parse(
            r#"{"t":5,"neg":-1,"s":"x","b":true,"m":{"k":"v"},"bad":{"k":1}}"#,
            Some("application/json"),
        )
        .unwrap();
        assert_eq!(f.int_in("t", 0..=10).unwrap(), Some(5));
        assert_eq!(f.int_in("t", 6..=10).unwrap_err().status, 400);
        assert_eq!(f.int_in("neg", 0..=10).unwrap_err().status, 400);
        assert_eq!(f.int_in("s", 0..=10).unwrap_err().status, 422);
        assert_eq!(f.str("t").unwrap_err().status, 422);
        assert_eq!(f.bool("b").unwrap(), Some(true));
        assert_eq!(f.string_map("m").unwrap().get("k").unwrap(), "v");
        assert_eq!(f.string_map("bad").unwrap_err().status, 422);
        assert_eq!(f.required_str("missing").unwrap_err().status, 422);
        assert_eq!(f.int_in("missing", 0..=1).unwrap(), None);
    }

    #[test]
    fn env_names() {
        let ok = BTreeMap::from([("_A1".to_string(), "v".to_string())]);
        assert!(check_env("envVars", &ok).is_ok());
        let bad = BTreeMap::from([("1A".to_string(), "v".to_string())]);
        assert_eq!(check_env("envVars", &bad).unwrap_err().status, 400);
        let nul = BTreeMap::from([("A".to_string(), "a\0b".to_string())]);
        assert_eq!(check_env("envVars", &nul).unwrap_err().status, 400);
    }
}
