//! Templates on every node (docs/cluster.md, "Templates on every node").
//!
//! A template request of E2B's build API that a cluster node served for a client is
//! sent again, as it came, to every peer that answers: the build's request (with the
//! ids this node chose, so the template and build ids are equal everywhere), the upload
//! of its files (the stored tar, under the same link: links are signed with a key every
//! node derives from the shared API key), its start with the same steps (each node then
//! builds from the same definition, in parallel), tags and deletes. The peers get
//! `X-Aenv-Forwarded-By` and never send it on. Each peer's call is bounded in time and
//! answer; a peer that fails is logged and named, and misses the template: placement
//! sends creates only to nodes whose card lists it ready.

use super::envd_proxy::header;
use super::forward::FORWARDED_BY;
use super::{ApiError, Context};
use crate::cluster::client::{Body, Call};
use crate::orchestrator::BuildIds;
use crate::util::is_uuid;
use std::time::Duration;
use tiny_http::Request;

/// The template id a build request from another node is made with.
pub const TEMPLATE_ID: &str = "X-Aenv-Template-Id";
/// The build id a build request from another node is made with.
pub const BUILD_ID: &str = "X-Aenv-Build-Id";
/// A peer's deadline for a JSON template request (none waits on a VM).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// A peer's deadline for taking a build's files (at most `[templates] max_upload_bytes`).
pub const UPLOAD_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest answer taken from a peer.
const MAX_ANSWER: u64 = 64 * 1024;

/// The ids another node chose for the build `req` asks for; `None` for a client's.
pub fn build_ids(req: &Request) -> Result<Option<BuildIds>, ApiError> {
    if header(req, FORWARDED_BY).is_none() {
        return Ok(None);
    }
    match (header(req, TEMPLATE_ID), header(req, BUILD_ID)) {
        (None, None) => Ok(None),
        (Some(t), Some(b)) if is_uuid(t) && is_uuid(b) => Ok(Some(BuildIds {
            template_id: t.to_string(),
            build_id: b.to_string(),
        })),
        _ => Err(ApiError::bad_request(format!(
            "{TEMPLATE_ID} and {BUILD_ID} must both be UUIDs"
        ))),
    }
}

/// Whether `req` came from a client to a cluster node (so it goes to every node).
pub fn from_client(ctx: &Context, req: &Request) -> bool {
    ctx.cluster.is_some() && header(req, FORWARDED_BY).is_none()
}

/// Sends `req` (served here) again to every answering peer with `body` and `headers`:
/// each peer's status, or why it has none. Nothing when `req` is not
/// [`from_client`]. Failures (no answer, a status of 300 or more) are logged.
pub fn echo(
    ctx: &Context,
    req: &Request,
    headers: &[(&str, &str)],
    body: Body<'_>,
    timeout: Duration,
) -> Vec<(String, Result<u16, String>)> {
    let Some(cluster) = ctx.cluster.as_ref().filter(|_| from_client(ctx, req)) else {
        return Vec::new();
    };
    let method = req.method().to_string();
    let call = Call {
        method: &method,
        target: req.url(),
        headers,
        body,
        timeout,
        max_answer: MAX_ANSWER,
    };
    let path = req.url().split('?').next().unwrap_or("");
    let answers = cluster.client.to_every_peer(&cluster.peers, call);
    answers
        .into_iter()
        .map(|(node, answer)| {
            let result = answer
                .map_err(|e| e.to_string())
                .and_then(|a| match a.status {
                    s if s < 300 => Ok(s),
                    s => Err(format!(
                        "answered {s}: {}",
                        String::from_utf8_lossy(&a.body)
                            .chars()
                            .take(300)
                            .collect::<String>()
                    )),
                });
            match &result {
                Ok(status) => log::info!(
                    "op=template_everywhere node={node} method={method} path={path} status={status}"
                ),
                Err(why) => log::warn!(
                    "op=template_everywhere node={node} method={method} path={path} error=\"{why}\""
                ),
            }
            (node, result)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiny_http::Header;

    fn request(headers: &[(&str, &str)]) -> Request {
        let mut r = tiny_http::TestRequest::new();
        for (k, v) in headers {
            r = r.with_header(Header::from_bytes(*k, *v).unwrap());
        }
        r.into()
    }

    #[test]
    fn only_a_peers_build_request_names_its_ids() {
        let (t, b) = (
            "01900000-0000-7000-8000-000000000001",
            "01900000-0000-7000-8000-000000000002",
        );
        let ids = build_ids(&request(&[
            (FORWARDED_BY, "n2"),
            (TEMPLATE_ID, t),
            (BUILD_ID, b),
        ]));
        let ids = ids.unwrap().unwrap();
        assert_eq!((ids.template_id.as_str(), ids.build_id.as_str()), (t, b));
        // A client's request: its ids are this node's to choose.
        assert!(build_ids(&request(&[(TEMPLATE_ID, t), (BUILD_ID, b)]))
            .unwrap()
            .is_none());
        assert!(build_ids(&request(&[(FORWARDED_BY, "n2")]))
            .unwrap()
            .is_none());
        for bad in [
            vec![(FORWARDED_BY, "n2"), (TEMPLATE_ID, t)],
            vec![(FORWARDED_BY, "n2"), (TEMPLATE_ID, "x"), (BUILD_ID, b)],
        ] {
            assert_eq!(build_ids(&request(&bad)).unwrap_err().status, 400);
        }
    }
}
