//! Query strings: percent-decoding and the list filters of api.md §4.4–4.5.

use super::error::ApiError;
use crate::orchestrator::LogLevel;
use std::collections::BTreeMap;
use std::time::SystemTime;

/// Splits `a=b&c=d` into decoded pairs, in order.
pub fn parse(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Percent-decoding with `+` as space; invalid escapes are kept as they are.
pub fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex_digit(bytes[i + 1]), hex_digit(bytes[i + 2]))
            {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex_digit(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// The `metadata` filter: a URL-encoded `k=v&k2=v2`, every pair must match.
pub fn metadata_filter(value: &str) -> BTreeMap<String, String> {
    parse(value).into_iter().collect()
}

/// The first value of `key`.
pub fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// `limit`: 1..=100.
pub fn limit(pairs: &[(String, String)]) -> Result<Option<usize>, ApiError> {
    limit_within(pairs, 100)
}

/// `limit`: 1..=`max`.
pub fn limit_within(pairs: &[(String, String)], max: usize) -> Result<Option<usize>, ApiError> {
    match get(pairs, "limit") {
        None => Ok(None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::bad_request(format!(
                "limit must be an integer within 1..={max} (got {v:?})"
            ))),
        },
    }
}

/// The value `key` names among `choices` (name, value); absent → `default`; any other
/// text → 400 listing the names.
pub fn choice<T: Copy>(
    pairs: &[(String, String)],
    key: &str,
    default: T,
    choices: &[(&str, T)],
) -> Result<T, ApiError> {
    let Some(v) = get(pairs, key) else {
        return Ok(default);
    };
    choices
        .iter()
        .find(|(name, _)| *name == v)
        .map(|(_, value)| *value)
        .ok_or_else(|| {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            ApiError::bad_request(format!(
                "{key} must be one of {} (got {v:?})",
                names.join(", ")
            ))
        })
}

/// `direction=forward|backward` of a log query (default forward): true for backward.
pub fn backward(pairs: &[(String, String)]) -> Result<bool, ApiError> {
    choice(
        pairs,
        "direction",
        false,
        &[("forward", false), ("backward", true)],
    )
}

/// `level=` of a log query: the least severe level wanted (default debug, so all).
pub fn min_level(pairs: &[(String, String)]) -> Result<LogLevel, ApiError> {
    let levels = LogLevel::ALL.map(|l| (l.as_str(), l));
    choice(pairs, "level", LogLevel::Debug, &levels)
}

/// A unix time in seconds named `key`, when given.
pub fn unix_seconds(pairs: &[(String, String)], key: &str) -> Result<Option<u64>, ApiError> {
    get(pairs, key)
        .map(|v| {
            v.trim().parse::<u64>().map_err(|_| {
                ApiError::bad_request(format!("{key} must be unix seconds (got {v:?})"))
            })
        })
        .transpose()
}

/// An RFC 3339 time (`2026-12-01T10:00:00Z`, `...+02:00`, fractions allowed), named `key`.
pub fn time(pairs: &[(String, String)], key: &str) -> Result<Option<SystemTime>, ApiError> {
    let Some(v) = get(pairs, key) else {
        return Ok(None);
    };
    let bad = || ApiError::bad_request(format!("{key} must be an RFC 3339 time (got {v:?})"));
    // An unencoded `+` of the offset arrives as a space.
    let text = v.trim().replace(' ', "+");
    let t: jiff::Timestamp = text.parse().map_err(|_| bad())?;
    Ok(Some(SystemTime::try_from(t).map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding() {
        assert_eq!(decode("a%3Db%26c"), "a=b&c");
        assert_eq!(decode("a+b"), "a b");
        assert_eq!(decode("100%"), "100%");
        assert_eq!(decode("%zz"), "%zz");
        let pairs = parse("metadata=team%3Dai%26env%3Dprod&limit=5");
        assert_eq!(get(&pairs, "limit"), Some("5"));
        let m = metadata_filter(get(&pairs, "metadata").unwrap());
        assert_eq!(m.get("team").unwrap(), "ai");
        assert_eq!(m.get("env").unwrap(), "prod");
    }

    #[test]
    fn times() {
        let t = |q: &str| time(&parse(q), "t");
        let epoch = |s: u64| Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(t("t=1970-01-01T00:01:00Z").unwrap(), epoch(60));
        assert_eq!(t("t=1970-01-01T01:01:00%2B01:00").unwrap(), epoch(60));
        assert_eq!(t("t=1970-01-01T01:01:00+01:00").unwrap(), epoch(60));
        assert_eq!(t("").unwrap(), None);
        assert_eq!(t("t=yesterday").unwrap_err().status, 400);
    }

    #[test]
    fn limits() {
        assert_eq!(limit(&parse("limit=0")).unwrap_err().status, 400);
        assert_eq!(limit(&parse("limit=101")).unwrap_err().status, 400);
        assert_eq!(limit(&parse("limit=x")).unwrap_err().status, 400);
        assert_eq!(limit(&parse("limit=100")).unwrap(), Some(100));
    }
}
