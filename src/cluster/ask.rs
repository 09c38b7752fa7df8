//! Questions to peers: one `GET` of a JSON answer bounded in time and size ([`get`],
//! through the nodes' one client, `client::PeerClient`), many at once ([`at_once`]).
//!
//! Used by the `cluster-peers` thread for each peer's card and by the API threads for
//! lists and metrics merged across nodes (docs/cluster.md, "Lists"). Every byte of an
//! answer is a peer's and untrusted: the agent's timeout bounds the whole call, the body
//! is read to at most `max` bytes and must be JSON.

use super::client::{Body, Call, PeerClient};
use super::peer::PeerUrl;
use serde_json::Value;
use std::time::Duration;

/// Why a peer gave no usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AskError {
    /// The node is not in the peer table.
    Unknown,
    /// The node did not answer the last round of the `cluster-peers` thread: not asked.
    Silent(String),
    /// Cannot connect, the connection broke, or the answer took longer than the timeout.
    Transport(String),
    /// The answer's status was not 200.
    Status { path: String, code: u16 },
    /// The answer was larger than allowed.
    TooLarge { path: String, max: u64 },
    /// The answer was no JSON, or not of the expected shape.
    BadAnswer { path: String, why: String },
}

/// Why a peer was left out of a merged answer: the `reason` label of
/// `agentenv_cluster_list_partial_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PartialReason {
    Unknown,
    Silent,
    Unreachable,
    BadAnswer,
}

impl super::Label for PartialReason {
    const NAME: &'static str = "reason";
    fn label(self) -> &'static str {
        match self {
            PartialReason::Unknown => "unknown",
            PartialReason::Silent => "silent",
            PartialReason::Unreachable => "unreachable",
            PartialReason::BadAnswer => "bad_answer",
        }
    }
}

impl AskError {
    /// What kind of failure this is, as counted.
    pub fn reason(&self) -> PartialReason {
        match self {
            AskError::Unknown => PartialReason::Unknown,
            AskError::Silent(_) => PartialReason::Silent,
            AskError::Transport(_) => PartialReason::Unreachable,
            AskError::Status { .. } | AskError::TooLarge { .. } | AskError::BadAnswer { .. } => {
                PartialReason::BadAnswer
            }
        }
    }
}

impl std::fmt::Display for AskError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AskError::Unknown => write!(
                f,
                "it is not among the peers this node found ([cluster] peers or peers_dns)"
            ),
            AskError::Silent(why) => write!(f, "it did not answer the last peer round: {why}"),
            AskError::Transport(why) => write!(f, "{why}"),
            AskError::Status { path, code } => write!(f, "GET {path} answered {code}"),
            AskError::TooLarge { path, max } => write!(f, "GET {path} answered over {max} bytes"),
            AskError::BadAnswer { path, why } => write!(f, "GET {path} answered badly: {why}"),
        }
    }
}

impl std::error::Error for AskError {}

/// A peer's 200 answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub body: Value,
    /// Its `X-Next-Token` header: the peer has more items after its page.
    pub next_token: Option<String>,
}

/// `GET <url><target>` through `client`, within `timeout`: the JSON body of a 200 answer
/// of at most `max` bytes.
pub fn get(
    client: &PeerClient,
    url: &PeerUrl,
    target: &str,
    timeout: Duration,
    max: u64,
) -> Result<Answer, AskError> {
    let path = target.split('?').next().unwrap_or(target).to_string();
    let call = Call {
        method: "GET",
        target,
        headers: &[],
        body: Body::Empty,
        timeout,
        max_answer: max,
    };
    let answer = client.call(url, call)?;
    if answer.status != 200 {
        let code = answer.status;
        return Err(AskError::Status { path, code });
    }
    let body = serde_json::from_slice(&answer.body).map_err(|e| AskError::BadAnswer {
        path,
        why: format!("not JSON: {e}"),
    })?;
    Ok(Answer {
        body,
        next_token: answer.next_token,
    })
}

/// `f` of every item, each on a thread of its own, all at once; the results in the
/// items' order (a thread that panicked leaves its item out).
pub fn at_once<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let threads: Vec<_> = items
            .into_iter()
            .map(|item| s.spawn(move || f(item)))
            .collect();
        threads.into_iter().filter_map(|t| t.join().ok()).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::Label;

    #[test]
    fn at_once_keeps_the_order() {
        let out = at_once(vec![3u64, 1, 2], |n| {
            std::thread::sleep(std::time::Duration::from_millis(n * 5));
            n * 10
        });
        assert_eq!(out, [30, 10, 20]);
    }

    #[test]
    fn reasons_and_messages() {
        let e = AskError::Status {
            path: "/v2/sandboxes".into(),
            code: 500,
        };
        assert_eq!(
            (e.reason().label(), e.to_string().as_str()),
            ("bad_answer", "GET /v2/sandboxes answered 500")
        );
        let silent = AskError::Silent("timed out".into()).reason();
        assert_eq!(silent.label(), "silent");
        let refused = AskError::Transport("refused".into()).reason();
        assert_eq!(refused.label(), "unreachable");
    }
}
