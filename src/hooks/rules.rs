//! Per-hook response body rules (custom-extension.md §3). Pure functions over the bytes that were read.

use super::boot_args;
use super::error::Cause;
use serde_json::{Map, Value};

/// Parses a body that must be a JSON object.
fn json_object(body: &[u8]) -> Result<Map<String, Value>, Cause> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(Cause::NotJsonObject),
    }
}

fn is_blank(body: &[u8]) -> bool {
    body.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

/// start-fresh (custom-extension.md §3.1): the extra boot arguments to append, if any.
pub fn start_fresh(body: &[u8], base_cmdline_len: usize) -> Result<Option<String>, Cause> {
    if is_blank(body) {
        return Ok(None);
    }
    match json_object(body)?.get("extraBootArgs") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            boot_args::process(s, base_cmdline_len).map_err(Cause::ExtraBootArgsRejected)
        }
        Some(_) => Err(Cause::ExtraBootArgsType),
    }
}

/// patch-params (custom-extension.md §3.3): the sandbox's new full params (`{}` when cleared).
pub fn patch_params(body: &[u8]) -> Result<Value, Cause> {
    match json_object(body)?.remove("customExtensionParams") {
        None | Some(Value::Null) => Ok(Value::Object(Map::new())),
        Some(v @ Value::Object(_)) => Ok(v),
        Some(_) => Err(Cause::ParamsType),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn start_fresh_rules() {
        assert_eq!(start_fresh(b"", 100), Ok(None));
        assert_eq!(start_fresh(b" \r\n\t", 100), Ok(None));
        assert_eq!(start_fresh(b"{}", 100), Ok(None));
        assert_eq!(
            start_fresh(br#"{"extraBootArgs":null,"x":1}"#, 100),
            Ok(None)
        );
        assert_eq!(
            start_fresh(br#"{"extraBootArgs":"  a=1 b  "}"#, 100),
            Ok(Some("a=1 b".into()))
        );
        assert_eq!(start_fresh(br#"{"extraBootArgs":" "}"#, 100), Ok(None));
        assert_eq!(
            start_fresh(br#"{"extraBootArgs":5}"#, 100),
            Err(Cause::ExtraBootArgsType)
        );
        assert_eq!(
            start_fresh(br#"{"extraBootArgs":["a"]}"#, 100),
            Err(Cause::ExtraBootArgsType)
        );
        for bad in [
            &b"[]"[..],
            b"\"s\"",
            b"null",
            b"1",
            b"not json",
            b"{",
            b"\xff",
        ] {
            assert_eq!(start_fresh(bad, 100), Err(Cause::NotJsonObject), "{bad:?}");
        }
        assert_eq!(
            start_fresh(br#"{"extraBootArgs":"a\u0001"}"#, 100),
            Err(Cause::ExtraBootArgsRejected(
                "invalid character at byte 1".into()
            ))
        );
    }

    #[test]
    fn patch_params_rules() {
        assert_eq!(
            patch_params(br#"{"customExtensionParams":{"a":[1]},"z":0}"#),
            Ok(json!({"a":[1]}))
        );
        assert_eq!(patch_params(b"{}"), Ok(json!({})));
        assert_eq!(
            patch_params(br#"{"customExtensionParams":null}"#),
            Ok(json!({}))
        );
        assert_eq!(
            patch_params(br#"{"customExtensionParams":"x"}"#),
            Err(Cause::ParamsType)
        );
        assert_eq!(
            patch_params(br#"{"customExtensionParams":[]}"#),
            Err(Cause::ParamsType)
        );
        for bad in [&b""[..], b"  ", b"[]", b"null", b"nope"] {
            assert_eq!(patch_params(bad), Err(Cause::NotJsonObject), "{bad:?}");
        }
    }
}
