//! Many hosts behind one endpoint (docs/cluster.md).
//!
//! Each node is a whole agentenv server; a standard load balancer spreads clients over
//! them and any node answers any request. Sandbox ids name their node ([`id`]), so a
//! request for a sandbox goes to its owner with no shared table ([`peers`] only says
//! where each node answers now); there is no cluster manager, consensus or database of
//! our own.

pub mod client;
pub mod id;
pub mod peer;
pub mod peers;

use crate::config::ClusterConfig;
use client::PeerClient;
use parking_lot::Mutex;
use peer::PeerUrl;
use peers::{Discovery, PeerSource, PeerTable};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

/// The header a request between nodes carries: the node that sent it. A request that
/// carries it is served where it arrives, never sent on (docs/cluster.md).
pub const FORWARDED_BY: &str = "X-Aenv-Forwarded-By";

/// This server as a cluster node: its name, its URL, its peers and what it forwarded.
pub struct Cluster {
    pub node: String,
    pub advertise_url: String,
    pub peers: Arc<PeerTable>,
    pub forwarded: ForwardCounts,
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
            forwarded: ForwardCounts::default(),
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

    /// `agentenv_cluster_forwarded_total{node,result}` and
    /// `agentenv_cluster_peers{state}` (api.md §4.19).
    pub fn render_metrics(&self, out: &mut String) {
        self.forwarded.render(out);
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

impl ForwardResult {
    fn label(self) -> &'static str {
        match self {
            ForwardResult::Answered => "answered",
            ForwardResult::Unreachable => "unreachable",
            ForwardResult::Refused => "refused",
        }
    }
}

/// Requests for other nodes' sandboxes, by owner and result.
#[derive(Default)]
pub struct ForwardCounts(Mutex<BTreeMap<(String, ForwardResult), u64>>);

impl ForwardCounts {
    pub fn record(&self, node: &str, result: ForwardResult) {
        *self.0.lock().entry((node.to_string(), result)).or_insert(0) += 1;
    }

    pub fn get(&self, node: &str, result: ForwardResult) -> u64 {
        self.0
            .lock()
            .get(&(node.to_string(), result))
            .copied()
            .unwrap_or(0)
    }

    fn render(&self, out: &mut String) {
        let name = "agentenv_cluster_forwarded_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests for another node's sandboxes, by owner and result (answered, unreachable, refused).\n# TYPE {name} counter"
        );
        for ((node, result), n) in self.0.lock().iter() {
            let _ = writeln!(
                out,
                "{name}{{node=\"{node}\",result=\"{}\"}} {n}",
                result.label()
            );
        }
    }
}
