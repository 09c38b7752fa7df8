//! The HTTP client nodes ask each other with, outside the streaming relay of
//! `api/forward.rs`: the peer cards (`peers`), placed creates and the template requests
//! sent to every node (docs/cluster.md). ureq on the calling thread, a connect deadline
//! and a whole-call deadline per call, the answer read up to a bound; every call carries
//! the API key and `X-Aenv-Forwarded-By`, so the peer serves it itself and never sends it
//! on.

use super::ask::AskError;
use super::peer::PeerUrl;
use super::peers::PeerTable;
use super::FORWARDED_BY;
use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// What a call sends as its body.
#[derive(Clone, Copy)]
pub enum Body<'a> {
    Empty,
    Json(&'a [u8]),
    /// A file, streamed with its length.
    File(&'a Path),
}

/// One request to a peer.
#[derive(Clone, Copy)]
pub struct Call<'a> {
    pub method: &'a str,
    /// Path and query.
    pub target: &'a str,
    /// Headers besides the API key, `X-Aenv-Forwarded-By` and the body's.
    pub headers: &'a [(&'a str, &'a str)],
    pub body: Body<'a>,
    /// The whole call's deadline (the connect has [`CONNECT_TIMEOUT`]).
    pub timeout: Duration,
    /// The longest answer body taken.
    pub max_answer: u64,
}

/// A peer's answer: its status and body (whatever the status).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    /// Its `X-Next-Token` header (a paged list: the peer has more after this page).
    pub next_token: Option<String>,
}

/// How long a connect to a peer may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Asks peers as node `this`, with the cluster's API key.
pub struct PeerClient {
    pub this: String,
    pub api_key: String,
}

impl PeerClient {
    /// `call` at `url`: the answer, or why there is none.
    pub fn call(&self, url: &PeerUrl, call: Call<'_>) -> Result<Answer, AskError> {
        // No redirects: the API key goes to the peer asked, nowhere else.
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT.min(call.timeout))
            .timeout(call.timeout)
            .redirects(0)
            .build();
        let mut req = agent
            .request(call.method, &format!("{url}{}", call.target))
            .set("X-API-Key", &self.api_key)
            .set(FORWARDED_BY, &self.this);
        for (k, v) in call.headers {
            req = req.set(k, v);
        }
        let sent = match call.body {
            Body::Empty => req.call(),
            Body::Json(bytes) => req
                .set("Content-Type", "application/json")
                .send_bytes(bytes),
            Body::File(path) => {
                let file = std::fs::File::open(path).map_err(|e| {
                    AskError::Transport(format!("cannot open {}: {e}", path.display()))
                })?;
                let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                req.set("Content-Length", &len.to_string())
                    .set("Content-Type", "application/octet-stream")
                    .send(file)
            }
        };
        let response = match sent {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(ureq::Error::Transport(t)) => {
                return Err(AskError::Transport(format!("{url}: {t}")))
            }
        };
        let status = response.status();
        let next_token = response.header("X-Next-Token").map(str::to_string);
        let mut body = Vec::new();
        response
            .into_reader()
            .take(call.max_answer + 1)
            .read_to_end(&mut body)
            .map_err(|e| AskError::Transport(format!("{url}: reading the answer: {e}")))?;
        if body.len() as u64 > call.max_answer {
            return Err(AskError::TooLarge {
                path: call.target.split('?').next().unwrap_or("").to_string(),
                max: call.max_answer,
            });
        }
        Ok(Answer {
            status,
            body,
            next_token,
        })
    }

    /// `call` to every peer that answered its last card question, all at once: each
    /// node's answer or why not. Silent peers are not asked (they are reported silent).
    pub fn to_every_peer(
        &self,
        peers: &PeerTable,
        call: Call<'_>,
    ) -> Vec<(String, Result<Answer, AskError>)> {
        super::ask::at_once(peers.peers(), |(node, peer)| {
            let answer = match &peer.failure {
                Some(why) => Err(AskError::Silent(why.clone())),
                None => self.call(&peer.url, call),
            };
            (node, answer)
        })
    }
}
