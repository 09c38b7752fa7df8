//! E2B's `network` object (network.md §5.6): on create (`/sandboxes`, `/v2/sandboxes`)
//! and as the body of `PUT /sandboxes/{id}/network`. Parsed here into the one settings
//! type, [`NetworkPolicy`]; fields the SDK can send that agentenv does not build are
//! refused by name, never ignored, so a sandbox never runs with weaker isolation than its
//! creator asked for.

use super::body::Fields;
use super::error::ApiError;
use crate::config::Cidr;
use crate::orchestrator::NetworkPolicy;
use serde_json::{Map, Value};
use std::net::Ipv4Addr;

/// Most `allowOut` + `denyOut` entries one sandbox may have.
pub const MAX_NETWORK_RULES: usize = 256;
/// Most `dnsServers` entries (E2B's limit).
pub const MAX_DNS_SERVERS: usize = 10;

/// Network fields the SDKs can send that agentenv does not build (400 naming them).
const UNBUILT: &[&str] = &["rules", "egressProxy", "httpsPorts"];

/// The `network` field of a create body (absent or `null`: no policy), and the top-level
/// `iam`, which needs the egress proxy's token injection.
pub fn create_policy(f: &Fields) -> Result<NetworkPolicy, ApiError> {
    if !matches!(f.raw("iam"), None | Some(Value::Null)) {
        return Err(ApiError::bad_request(
            "field iam is not supported: workload identity tokens need an egress proxy, which agentenv does not have",
        ));
    }
    match f.raw("network") {
        None | Some(Value::Null) => Ok(NetworkPolicy::default()),
        Some(Value::Object(m)) => policy("network.", m),
        Some(_) => Err(ApiError::unprocessable("field network must be an object")),
    }
}

/// The body of `PUT …/network`: the new policy (replacing the old one whole) and
/// `allowInternetAccess`, where `false` is E2B's `denyOut: ["0.0.0.0/0"]`.
pub fn update_policy(f: &Fields) -> Result<(NetworkPolicy, Option<bool>), ApiError> {
    let mut p = policy("", &f.0)?;
    let internet = f.bool("allowInternetAccess")?;
    if internet == Some(false) && !p.deny_out.iter().any(|c| c == "0.0.0.0/0") {
        p.deny_out.push("0.0.0.0/0".into());
    }
    Ok((p, internet))
}

fn policy(prefix: &str, m: &Map<String, Value>) -> Result<NetworkPolicy, ApiError> {
    for k in UNBUILT {
        if !matches!(m.get(*k), None | Some(Value::Null)) {
            return Err(ApiError::bad_request(format!(
                "field {prefix}{k} is not supported by agentenv; leave it out"
            )));
        }
    }
    let allow_out = entries(prefix, "allowOut", m.get("allowOut"))?;
    let deny_out = entries(prefix, "denyOut", m.get("denyOut"))?;
    if allow_out.len() + deny_out.len() > MAX_NETWORK_RULES {
        return Err(ApiError::bad_request(format!(
            "{prefix}allowOut and {prefix}denyOut hold {} entries; at most {MAX_NETWORK_RULES} are allowed",
            allow_out.len() + deny_out.len()
        )));
    }
    let dns_servers = match m.get("dnsServers") {
        None | Some(Value::Null) => None,
        Some(v) => Some(dns_servers(prefix, v)?),
    };
    Ok(NetworkPolicy {
        allow_out,
        deny_out,
        dns_servers,
    })
}

/// An array of strings (absent or `null`: empty).
fn strings<'a>(name: &str, v: Option<&'a Value>) -> Result<Vec<&'a str>, ApiError> {
    let items = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::unprocessable(format!(
                "field {name} must be an array of strings"
            )))
        }
    };
    items
        .iter()
        .map(|i| {
            i.as_str().ok_or_else(|| {
                ApiError::unprocessable(format!("field {name} must be an array of strings"))
            })
        })
        .collect()
}

/// `allowOut` / `denyOut` entries as normalized CIDRs, and in `allowOut` domain names
/// (lower case, no trailing dot).
fn entries(prefix: &str, key: &str, v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let name = format!("{prefix}{key}");
    let list = strings(&name, v)?;
    if list.len() > MAX_NETWORK_RULES {
        return Err(ApiError::bad_request(format!(
            "{name} holds {} entries; at most {MAX_NETWORK_RULES} are allowed",
            list.len()
        )));
    }
    let mut out: Vec<String> = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let c = entry(e, key == "allowOut")
            .map_err(|why| ApiError::bad_request(format!("{name}[{i}] {e:?}: {why}")))?;
        if !out.contains(&c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// One entry: an IPv4 address (as /32) or an IPv4 CIDR with no host bits set; where
/// `domains` (allowOut), also a domain name, optionally `*.`-prefixed (E2B allows domains
/// only there).
fn entry(e: &str, domains: bool) -> Result<String, &'static str> {
    let e = e.trim();
    if let Ok(ip) = e.parse::<Ipv4Addr>() {
        return Ok(format!("{ip}/32"));
    }
    if e.contains('/') {
        return Cidr::parse(e)
            .map(|c| c.to_string())
            .ok_or("not an IPv4 CIDR (a.b.c.d/n, n ≤ 32, no host bits set)");
    }
    if is_domain(e) && domains {
        return Ok(e.trim_end_matches('.').to_ascii_lowercase());
    }
    if is_domain(e) {
        return Err("domain entries are allowed in allowOut only; deny by IP address or CIDR (0.0.0.0/0 denies everything the allowOut domains do not name)");
    }
    Err("not an IPv4 address, CIDR or domain name")
}

/// A DNS name, optionally with a leading `*.`: labels of 1..=63 letters, digits or
/// hyphens (not at either end), at least two labels, 253 characters at most.
fn is_domain(e: &str) -> bool {
    let name = e.strip_prefix("*.").unwrap_or(e);
    let labels: Vec<&str> = name.trim_end_matches('.').split('.').collect();
    name.len() <= 253
        && labels.len() >= 2
        && !labels
            .last()
            .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
        && labels.iter().all(|l| {
            (1..=63).contains(&l.len())
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn dns_servers(prefix: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    let name = format!("{prefix}dnsServers");
    let list = strings(&name, Some(v))?;
    if list.len() > MAX_DNS_SERVERS {
        return Err(ApiError::bad_request(format!(
            "{name} holds {} entries; at most {MAX_DNS_SERVERS} are allowed",
            list.len()
        )));
    }
    list.iter()
        .enumerate()
        .map(|(i, s)| {
            s.parse::<Ipv4Addr>().map(|ip| ip.to_string()).map_err(|_| {
                ApiError::bad_request(format!("{name}[{i}] {s:?} is not an IPv4 address"))
            })
        })
        .collect()
}

/// The `network` object GET shows (E2B's `SandboxNetworkConfig` fields); the ingress
/// fields are added next to them.
pub fn shown(p: &NetworkPolicy) -> Value {
    // Fields left unset are absent, as E2B's API has them.
    let mut v = serde_json::json!({});
    if !p.allow_out.is_empty() {
        v["allowOut"] = serde_json::json!(p.allow_out);
    }
    if !p.deny_out.is_empty() {
        v["denyOut"] = serde_json::json!(p.deny_out);
    }
    if let Some(d) = &p.dns_servers {
        v["dnsServers"] = serde_json::json!(d);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Value) -> Fields {
        Fields(v.as_object().unwrap().clone())
    }

    fn create(v: Value) -> Result<NetworkPolicy, String> {
        create_policy(&fields(v)).map_err(|e| e.message)
    }

    #[test]
    fn entries_are_normalized_and_bad_ones_named() {
        let p = create(
            json!({"network": {"allowOut": ["203.0.113.10", "203.0.113.10/32"],
            "denyOut": ["0.0.0.0/0"], "dnsServers": ["1.1.1.1"]}}),
        )
        .unwrap();
        assert_eq!(p.allow_out, ["203.0.113.10/32"]);
        assert_eq!(p.deny_out, ["0.0.0.0/0"]);
        assert_eq!(p.dns_servers, Some(vec!["1.1.1.1".to_string()]));
        let p = create(json!({"network": {"allowOut": ["Web.Example.COM.", "*.example.org"]}}))
            .unwrap();
        assert_eq!(p.allow_out, ["web.example.com", "*.example.org"]);
        for (bad, says) in [
            (
                json!({"allowOut": ["10.0.0.1/8"]}),
                "network.allowOut[0] \"10.0.0.1/8\"",
            ),
            (
                json!({"denyOut": ["1.2.3.4", "nope"]}),
                "network.denyOut[1] \"nope\"",
            ),
            (
                json!({"denyOut": ["example.com"]}),
                "domain entries are allowed in allowOut only",
            ),
            (json!({"denyOut": ["*.example.com"]}), "allowOut only"),
            (json!({"allowOut": ["*.*.example.com"]}), "not an IPv4"),
            (json!({"allowOut": ["exa_mple.com"]}), "not an IPv4"),
            (json!({"allowOut": ["1.2.3.4/33"]}), "not an IPv4 CIDR"),
            (json!({"dnsServers": ["x"]}), "network.dnsServers[0] \"x\""),
            (
                json!({"rules": {"a.com": []}}),
                "field network.rules is not supported",
            ),
            (
                json!({"egressProxy": {"address": "p:1080"}}),
                "network.egressProxy",
            ),
            (json!({"httpsPorts": [3000]}), "network.httpsPorts"),
        ] {
            let e = create(json!({"network": bad})).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let many: Vec<String> = (0..=MAX_NETWORK_RULES)
            .map(|i| format!("10.0.{}.{}", i / 256, i % 256))
            .collect();
        let e = create(json!({"network": {"denyOut": many}})).unwrap_err();
        assert!(e.contains("at most 256"), "{e}");
        let e = create(json!({"iam": {"tokens": {}}})).unwrap_err();
        assert!(e.contains("field iam"), "{e}");
        assert_eq!(
            create(json!({"network": null})).unwrap(),
            NetworkPolicy::default()
        );
    }

    #[test]
    fn no_internet_on_update_is_deny_all() {
        let (p, i) = update_policy(&fields(
            json!({"allowOut": ["1.2.3.4"], "allowInternetAccess": false}),
        ))
        .unwrap();
        assert_eq!(i, Some(false));
        assert_eq!(p.allow_out, ["1.2.3.4/32"]);
        assert_eq!(p.deny_out, ["0.0.0.0/0"]);
        let e = update_policy(&fields(json!({"denyOut": ["300.1.1.1"]}))).unwrap_err();
        assert!(e.message.contains("denyOut[0]"), "{e:?}");
    }
}
