//! Signed file URLs (E2B's `download_url` / `upload_url` on a secure sandbox): a
//! `GET` or `POST /files?path=…&signature=v1_…[&signature_expiration=…][&username=…]`
//! that works with no header, from curl or a browser (docs/e2b.md, "Signed file URLs").
//!
//! The SDK signs `path:operation:user:envdAccessToken[:expiration]` (operation `read`
//! for a download, `write` for an upload; user `""` for the default one) with SHA-256,
//! base64 without padding, prefixed `v1_`. The envd proxy checks it against the
//! sandbox's token before forwarding (constant-time); a URL whose path, user, operation
//! or expiry was changed does not match, and one past its expiry is refused even when it
//! matches. Nothing of the URL's query is logged.

use super::{query, ApiError};
use crate::orchestrator::Orchestrator;
use crate::util::constant_time_eq;
use base64::Engine;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tiny_http::{Method, Request};

/// A signed `/files` request, as parsed from its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedUrl {
    path: String,
    operation: &'static str,
    user: String,
    signature: String,
    /// Unix seconds, when the URL carries one.
    expiration: Option<String>,
}

/// Why a signed URL is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It does not match the sandbox's token (changed, or never signed by it).
    Mismatch,
    /// It matches, but its `signature_expiration` has passed.
    Expired,
}

impl SignedUrl {
    /// The signed file request in `request`, if it is one (`/files` with a `signature`).
    pub fn of(request: &Request) -> Option<SignedUrl> {
        let operation = match request.method() {
            Method::Get => "read",
            Method::Post => "write",
            _ => return None,
        };
        SignedUrl::parse(operation, request.url())
    }

    fn parse(operation: &'static str, url: &str) -> Option<SignedUrl> {
        let (path, query) = url.split_once('?')?;
        if path != "/files" {
            return None;
        }
        SignedUrl::from_query(operation, query)
    }

    /// The signed file request of `query` (a `/files` URL's) for `operation`.
    fn from_query(operation: &'static str, query: &str) -> Option<SignedUrl> {
        let pairs = query::parse(query);
        let get = |k: &str| query::get(&pairs, k).map(str::to_string);
        Some(SignedUrl {
            path: get("path").unwrap_or_default(),
            operation,
            user: get("username").unwrap_or_default(),
            signature: get("signature")?,
            expiration: get("signature_expiration"),
        })
    }

    /// Whether the URL was signed with `token` and has not expired at `now` (unix s).
    pub fn check(&self, token: &str, now: u64) -> Result<(), Refusal> {
        if token.is_empty() {
            return Err(Refusal::Mismatch);
        }
        let expected = signature(
            &self.path,
            self.operation,
            &self.user,
            token,
            self.expiration.as_deref(),
        );
        if !constant_time_eq(expected.as_bytes(), self.signature.as_bytes()) {
            return Err(Refusal::Mismatch);
        }
        match &self.expiration {
            None => Ok(()),
            Some(e) => match e.parse::<u64>() {
                Ok(at) if now <= at => Ok(()),
                _ => Err(Refusal::Expired),
            },
        }
    }
}

/// The sandbox of this node whose envd token signed `signed` (expired or not: the
/// envd proxy refuses an expired one), if any.
pub fn signer(orchestrator: &Orchestrator, signed: &SignedUrl) -> Option<String> {
    let now = crate::util::unix_secs();
    orchestrator
        .list()
        .into_iter()
        .find(|info| signed.check(&info.envd_access_token, now) != Err(Refusal::Mismatch))
        .map(|info| info.id)
}

/// `GET /cluster/signer?operation=read|write&<a signed /files URL's query>` (api.md
/// §4.29): which of this node's sandboxes signed the URL, asked by a node that got a
/// signed URL naming no sandbox (setup 1). 404 when none did.
pub fn signer_route(orchestrator: &Orchestrator, query: &str) -> Result<Value, ApiError> {
    let pairs = query::parse(query);
    let operation = match query::get(&pairs, "operation") {
        Some("read") => "read",
        Some("write") => "write",
        _ => return Err(ApiError::bad_request("operation must be read or write")),
    };
    let signed = SignedUrl::from_query(operation, query)
        .ok_or_else(|| ApiError::bad_request("the query has no signature"))?;
    match signer(orchestrator, &signed) {
        Some(id) => Ok(json!({ "sandboxID": id })),
        None => Err(ApiError::new(
            404,
            "no sandbox of this node signed that URL",
        )),
    }
}

/// The signer question for `request`'s signed URL (its query plus the operation).
pub fn signer_question(request: &Request, signed: &SignedUrl) -> String {
    let query = request.url().split_once('?').map_or("", |(_, q)| q);
    format!("/cluster/signer?operation={}&{query}", signed.operation)
}

/// E2B's v1 signature of a file URL.
fn signature(path: &str, operation: &str, user: &str, token: &str, exp: Option<&str>) -> String {
    let raw = match exp {
        Some(exp) => format!("{path}:{operation}:{user}:{token}:{exp}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest);
    format!("v1_{encoded}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "tok";

    /// What the python SDK's `get_signature` gives for these inputs (e2b 2.63.0).
    #[test]
    fn the_sdks_signatures() {
        assert_eq!(
            signature("/home/user/a.txt", "read", "", TOKEN, None),
            "v1_Zkbb3914oLJLvMBzCAHQhm2ydBLxbSx2eQUR/kLdvIY"
        );
        assert_eq!(
            signature(
                "/home/user/a.txt",
                "write",
                "root",
                TOKEN,
                Some("1800000000")
            ),
            "v1_PwEbZAn30wCkhlh05woI7V2lhGG+88oGp2wSFYqrHxk"
        );
    }

    fn url(path: &str, op: &'static str, user: &str, exp: Option<&str>) -> String {
        let sig = signature(path, op, user, TOKEN, exp);
        let mut u = format!(
            "/files?path={}&signature={}",
            path.replace('/', "%2F"),
            sig.replace('+', "%2B").replace('/', "%2F")
        );
        if !user.is_empty() {
            u.push_str(&format!("&username={user}"));
        }
        if let Some(e) = exp {
            u.push_str(&format!("&signature_expiration={e}"));
        }
        u
    }

    #[test]
    fn changed_urls_do_not_match_and_old_ones_expire() {
        let good = url("/a b", "read", "", None);
        let s = SignedUrl::parse("read", &good).unwrap();
        assert_eq!(s.check(TOKEN, 0), Ok(()));
        assert_eq!(s.check("other", 0), Err(Refusal::Mismatch));
        assert_eq!(s.check("", 0), Err(Refusal::Mismatch));
        let as_write = SignedUrl::parse("write", &good).unwrap();
        assert_eq!(as_write.check(TOKEN, 0), Err(Refusal::Mismatch));
        let other_path = good.replace("%2Fa", "%2Fb");
        let s = SignedUrl::parse("read", &other_path).unwrap();
        assert_eq!(s.check(TOKEN, 0), Err(Refusal::Mismatch));
        let as_root = format!("{good}&username=root");
        let s = SignedUrl::parse("read", &as_root).unwrap();
        assert_eq!(s.check(TOKEN, 0), Err(Refusal::Mismatch));

        let timed = url("/x", "write", "user", Some("1000"));
        let s = SignedUrl::parse("write", &timed).unwrap();
        assert_eq!(s.check(TOKEN, 1000), Ok(()));
        assert_eq!(s.check(TOKEN, 1001), Err(Refusal::Expired));
        let later = timed.replace("expiration=1000", "expiration=9000");
        let s = SignedUrl::parse("write", &later).unwrap();
        assert_eq!(s.check(TOKEN, 1001), Err(Refusal::Mismatch));
        let dropped = timed.replace("&signature_expiration=1000", "");
        let s = SignedUrl::parse("write", &dropped).unwrap();
        assert_eq!(s.check(TOKEN, 1001), Err(Refusal::Mismatch));

        assert_eq!(SignedUrl::parse("read", "/files?path=/x"), None);
        assert_eq!(SignedUrl::parse("read", "/other?signature=v1_x"), None);
    }
}
