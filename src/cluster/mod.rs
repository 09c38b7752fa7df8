//! Many hosts behind one endpoint (docs/cluster.md).
//!
//! Each node is a whole agentenv server; a standard load balancer spreads clients over
//! them and any node answers any request. Sandbox ids name their node ([`id`]), so a
//! request for a sandbox goes to its owner with no shared table ([`peers`] only says
//! where each node answers now); there is no cluster manager, consensus or database of
//! our own.

pub mod ask;
pub mod client;
pub mod id;
pub mod peer;
pub mod peers;

use crate::config::ClusterConfig;
pub use ask::PartialReason;
use ask::{Answer, AskError};
use client::PeerClient;
use parking_lot::Mutex;
use peer::PeerUrl;
use peers::{Discovery, Peer, PeerSource, PeerTable};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

/// The header a request relayed by a node carries: that node's name. Such a request is
/// answered by the node it reaches alone (never forwarded again, lists not merged).
pub const FORWARDED_BY: &str = "X-Aenv-Forwarded-By";

/// This server as a cluster node: its name, its URL, its peers and what it forwarded.
pub struct Cluster {
    pub node: String,
    pub advertise_url: String,
    pub peers: Arc<PeerTable>,
    pub forwarded: NodeCounts<ForwardResult>,
    /// Peers left out of a merged answer, by why.
    pub partial: NodeCounts<PartialReason>,
    /// How long a question to a peer may take (`[cluster] peer_timeout_ms`).
    pub peer_timeout: Duration,
    /// Asks the peers (cards, placed creates, templates on every node).
    pub client: PeerClient,
}

impl Cluster {
    /// This node per `cfg` (`None` for a single node), with its `cluster-peers` thread
    /// started.
    pub fn start(cfg: &ClusterConfig, api_key: &str) -> std::io::Result<Option<Arc<Cluster>>> {
        let Some(node) = cfg.node() else {
            return Ok(None);
        };
        let source = if cfg.peers_dns.is_empty() {
            // Validated at startup (`ClusterConfig::validate`).
            PeerSource::Static(
                cfg.peers
                    .iter()
                    .filter_map(|p| PeerUrl::parse(p).ok())
                    .collect(),
            )
        } else {
            PeerSource::Dns(cfg.peers_dns.clone())
        };
        let cluster = Arc::new(Cluster {
            node: node.to_string(),
            advertise_url: cfg.advertise_url.clone(),
            peers: Arc::new(PeerTable::new(node)),
            forwarded: NodeCounts::default(),
            partial: NodeCounts::default(),
            peer_timeout: Duration::from_millis(cfg.peer_timeout_ms),
            client: PeerClient {
                this: node.to_string(),
                api_key: api_key.to_string(),
            },
        });
        let discovery = Discovery {
            source,
            client: PeerClient {
                this: node.to_string(),
                api_key: api_key.to_string(),
            },
            timeout: Duration::from_millis(cfg.peer_timeout_ms),
        };
        discovery.spawn(&cluster.peers, Duration::from_secs(cfg.refresh_secs))?;
        Ok(Some(cluster))
    }

    /// `GET target` of each `(node, target)`, all at once, each within the peer timeout
    /// and `max` bytes, with the API key and `X-Aenv-Forwarded-By: <this node>` (the
    /// node answers with its own items alone). A node unknown or silent in the peer
    /// table is not asked. The answers in the order asked.
    pub fn ask_nodes(
        &self,
        asks: Vec<(String, String)>,
        max: u64,
    ) -> Vec<(String, Result<Answer, AskError>)> {
        ask::at_once(asks, |(node, target)| {
            let answer = match self.peers.get(&node) {
                None => Err(AskError::Unknown),
                Some(Peer {
                    failure: Some(why), ..
                }) => Err(AskError::Silent(why)),
                Some(peer) => ask::get(&self.client, &peer.url, &target, self.peer_timeout, max),
            };
            (node, answer)
        })
    }

    /// [`Cluster::ask_nodes`] of `target` on every peer in the table.
    pub fn ask_peers(&self, target: &str, max: u64) -> Vec<(String, Result<Answer, AskError>)> {
        let asks = self
            .peers
            .peers()
            .into_iter()
            .map(|(node, _)| (node, target.to_string()))
            .collect();
        self.ask_nodes(asks, max)
    }

    /// `agentenv_cluster_forwarded_total{node,result}`,
    /// `agentenv_cluster_list_partial_total{node,reason}` and
    /// `agentenv_cluster_peers{state}` (api.md §4.19).
    pub fn render_metrics(&self, out: &mut String) {
        self.forwarded.render(
            out,
            "agentenv_cluster_forwarded_total",
            "Requests for another node's sandboxes, by owner and result (answered, unreachable, refused).",
        );
        self.partial.render(
            out,
            "agentenv_cluster_list_partial_total",
            "Peers left out of a merged list or metrics answer, by node and reason (silent, unreachable, bad_answer, unknown).",
        );
        let peers = self.peers.peers();
        let silent = peers.iter().filter(|(_, p)| p.failure.is_some()).count();
        let _ = writeln!(
            out,
            "# HELP agentenv_cluster_peers Other nodes this node knows, by whether they answered the last question.\n\
             # TYPE agentenv_cluster_peers gauge\n\
             agentenv_cluster_peers{{state=\"answering\"}} {}\n\
             agentenv_cluster_peers{{state=\"silent\"}} {silent}",
            peers.len() - silent
        );
    }
}

/// A label of a per-node counter: its name and each value's text.
pub trait Label: Copy + Ord {
    const NAME: &'static str;
    fn label(self) -> &'static str;
}

/// What became of a request for another node's sandbox: the `result` label of
/// `agentenv_cluster_forwarded_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ForwardResult {
    /// The owner answered (whatever its status).
    Answered,
    /// The owner is unknown or did not answer: 502 here.
    Unreachable,
    /// Already forwarded once: answered here, never forwarded again.
    Refused,
}

impl Label for ForwardResult {
    const NAME: &'static str = "result";
    fn label(self) -> &'static str {
        match self {
            ForwardResult::Answered => "answered",
            ForwardResult::Unreachable => "unreachable",
            ForwardResult::Refused => "refused",
        }
    }
}

/// A counter by node and one more label.
pub struct NodeCounts<L>(Mutex<BTreeMap<(String, L), u64>>);

impl<L> Default for NodeCounts<L> {
    fn default() -> Self {
        NodeCounts(Mutex::new(BTreeMap::new()))
    }
}

impl<L: Label> NodeCounts<L> {
    pub fn record(&self, node: &str, label: L) {
        *self.0.lock().entry((node.to_string(), label)).or_insert(0) += 1;
    }

    pub fn get(&self, node: &str, label: L) -> u64 {
        self.0
            .lock()
            .get(&(node.to_string(), label))
            .copied()
            .unwrap_or(0)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for ((node, label), n) in self.0.lock().iter() {
            let _ = writeln!(
                out,
                "{name}{{node=\"{node}\",{}=\"{}\"}} {n}",
                L::NAME,
                label.label()
            );
        }
    }
}
