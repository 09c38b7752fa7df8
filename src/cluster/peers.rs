//! The peer table: which node answers at which URL, and what room it has.
//!
//! Filled by asking every configured peer (`[cluster] peers`, or the addresses
//! `peers_dns` resolves to now) for `GET /cluster/node`, on the `cluster-peers` thread
//! every `refresh_secs`. Each question has the `peer_timeout_ms` deadline and an answer of
//! at most [`MAX_CARD_BYTES`]; the peers are asked at once, one short thread each, and
//! the table's lock is taken only to apply the round's answers, never across a call. A
//! sandbox's node follows from its id (`cluster::id`); this table only says where that
//! node is now (a restarted pod may come back at another address).

use super::ask::{at_once, get};
use super::client::PeerClient;
use super::peer::{resolve_dns, PeerUrl};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Largest `GET /cluster/node` answer taken from a peer.
pub const MAX_CARD_BYTES: u64 = 256 * 1024;
/// Most templates a card lists (the newest first); a node with more serves the others
/// only to creates that reach it (docs/cluster.md, "Placement").
pub const MAX_CARD_TEMPLATES: usize = 1000;

/// What a node says of itself at `GET /cluster/node` (api.md §4.29).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeCard {
    pub node: String,
    pub advertise_url: String,
    pub capacity: NodeCapacity,
    /// What creates may start from here: the ready templates and snapshots, at most
    /// [`MAX_CARD_TEMPLATES`] (a card without the field lists none).
    #[serde(default)]
    pub templates: Vec<CardTemplate>,
}

/// One template (or snapshot) a node can start sandboxes from, and their size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CardTemplate {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Its name (the E2B alias), when it has one.
    #[serde(default)]
    pub alias: Option<String>,
    /// Its tags with a ready build (`default` among them) for an E2B template.
    #[serde(default)]
    pub tags: Vec<String>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    pub cpu_count: u32,
}

impl NodeCard {
    /// The template `wanted` (id, name or `name:tag`, as a create names it) if this node
    /// can start it.
    pub fn template(&self, wanted: &str) -> Option<&CardTemplate> {
        let (name, tag) = match wanted.split_once(':') {
            Some((n, t)) => (n, Some(t)),
            None => (wanted, None),
        };
        self.templates.iter().find(|t| {
            (t.template_id == name || t.alias.as_deref() == Some(name))
                && tag.is_none_or(|tag| t.tags.iter().any(|x| x == tag))
        })
    }
}

/// A node's free capacity, from its admission (docs/operations.md §12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeCapacity {
    /// MiB another VM may still take; `null` when the node cannot tell.
    #[serde(rename = "memoryFreeMB")]
    pub memory_free_mb: Option<u64>,
    pub vcpus_free: u64,
    /// Whether `vcpusFree` is a cap admission enforces (else it counts host CPUs).
    #[serde(default)]
    pub vcpus_capped: bool,
    #[serde(rename = "memoryReservedMB")]
    pub memory_reserved_mb: u64,
    pub vcpus_reserved: u64,
    /// Sandboxes running there.
    pub running: u64,
}

/// One known peer.
#[derive(Debug, Clone)]
pub struct Peer {
    /// Where it answered (requests for its sandboxes go there).
    pub url: PeerUrl,
    /// Its last answer.
    pub card: NodeCard,
    /// When it last answered.
    pub answered: Instant,
    /// Why the last question at `url` failed, when it did.
    pub failure: Option<String>,
}

/// Node name → where it is, for every node but this one.
pub struct PeerTable {
    this: String,
    peers: RwLock<BTreeMap<String, Peer>>,
}

impl PeerTable {
    pub fn new(this: &str) -> PeerTable {
        PeerTable {
            this: this.to_string(),
            peers: RwLock::new(BTreeMap::new()),
        }
    }

    /// Where node `node` answered last, and why its last question failed (if it did).
    pub fn get(&self, node: &str) -> Option<Peer> {
        self.peers.read().get(node).cloned()
    }

    /// Every known peer, by name.
    pub fn peers(&self) -> Vec<(String, Peer)> {
        self.peers
            .read()
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Applies one round of answers: a URL that answered names its node there (and no
    /// other node is there any more); a URL that failed marks the node last seen there.
    /// This node's own answer is left out. Nodes that stop answering stay, marked, so
    /// that a request for their sandboxes is told which node does not answer and why.
    pub fn apply(&self, round: Vec<(PeerUrl, Result<NodeCard, String>)>, now: Instant) {
        let mut peers = self.peers.write();
        for (url, answer) in round {
            match answer {
                Ok(card) if card.node == self.this => {}
                Ok(card) => {
                    peers.retain(|name, p| p.url != url || *name == card.node);
                    let name = card.node.clone();
                    let before = peers.insert(
                        name.clone(),
                        Peer {
                            url: url.clone(),
                            card,
                            answered: now,
                            failure: None,
                        },
                    );
                    match before {
                        None => log::info!("op=cluster_peer node={name} url={url} result=found"),
                        Some(b) if b.url != url => {
                            log::info!(
                                "op=cluster_peer node={name} url={url} was={} result=moved",
                                b.url
                            )
                        }
                        Some(b) if b.failure.is_some() => {
                            log::info!("op=cluster_peer node={name} url={url} result=answers")
                        }
                        Some(_) => {}
                    }
                }
                Err(why) => {
                    for (name, p) in peers.iter_mut().filter(|(_, p)| p.url == url) {
                        if p.failure.is_none() {
                            log::warn!("op=cluster_peer node={name} url={url} error=\"{why}\"");
                        }
                        p.failure = Some(why.clone());
                    }
                }
            }
        }
    }
}

/// Where the peers are configured.
#[derive(Debug, Clone)]
pub enum PeerSource {
    /// `[cluster] peers`.
    Static(Vec<PeerUrl>),
    /// `[cluster] peers_dns`: `NAME:PORT`, resolved again each round.
    Dns(String),
}

/// Asks the peers each round.
pub struct Discovery {
    pub source: PeerSource,
    pub client: PeerClient,
    pub timeout: Duration,
}

impl Discovery {
    /// One round: every peer asked at once, each within the timeout, then the answers
    /// applied to `table`.
    pub fn round(&self, table: &PeerTable) {
        let urls = match &self.source {
            PeerSource::Static(urls) => urls.clone(),
            PeerSource::Dns(name) => match resolve_dns(name) {
                Ok(urls) => urls,
                Err(e) => {
                    log::warn!("op=cluster_peers peers_dns={name} error=\"{e}\"");
                    return;
                }
            },
        };
        let round = at_once(urls, |url| {
            let answer = ask(&self.client, &url, self.timeout);
            (url, answer)
        });
        table.apply(round, Instant::now());
    }

    /// Runs a round now and then every `every` on the `cluster-peers` thread, for as
    /// long as `table` is in use.
    pub fn spawn(self, table: &Arc<PeerTable>, every: Duration) -> std::io::Result<()> {
        let table: Weak<PeerTable> = Arc::downgrade(table);
        std::thread::Builder::new()
            .name("cluster-peers".into())
            .spawn(move || {
                while let Some(table) = table.upgrade() {
                    self.round(&table);
                    drop(table);
                    std::thread::sleep(every);
                }
            })
            .map(|_| ())
    }
}

/// `GET <url>/cluster/node` with the API key: the node's card, or why not.
fn ask(client: &PeerClient, url: &PeerUrl, timeout: Duration) -> Result<NodeCard, String> {
    let answer =
        get(client, url, "/cluster/node", timeout, MAX_CARD_BYTES).map_err(|e| e.to_string())?;
    let card: NodeCard = serde_json::from_value(answer.body)
        .map_err(|e| format!("GET /cluster/node answered no node card: {e}"))?;
    if !super::id::is_node_name(&card.node) {
        return Err(format!("answered the node name {:?}", card.node));
    }
    let mut card = card;
    card.templates.truncate(MAX_CARD_TEMPLATES);
    Ok(card)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> PeerUrl {
        PeerUrl::parse(s).unwrap()
    }

    fn card(node: &str) -> NodeCard {
        NodeCard {
            node: node.into(),
            advertise_url: format!("http://{node}:3000"),
            capacity: NodeCapacity {
                memory_free_mb: Some(1000),
                vcpus_free: 4,
                vcpus_capped: true,
                memory_reserved_mb: 0,
                vcpus_reserved: 0,
                running: 0,
            },
            templates: Vec::new(),
        }
    }

    #[test]
    fn a_round_names_nodes_and_marks_the_silent_ones() {
        let table = PeerTable::new("n1");
        let (a, b, c) = (url("http://a:1"), url("http://b:1"), url("http://c:1"));
        let t0 = Instant::now();
        table.apply(
            vec![
                (a.clone(), Ok(card("n1"))),
                (b.clone(), Ok(card("n2"))),
                (c.clone(), Err("connection refused".into())),
            ],
            t0,
        );
        let names: Vec<_> = table.peers().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["n2"], "this node and silent URLs are not peers");
        assert_eq!(table.get("n2").unwrap().url, b);
        assert!(table.get("n1").is_none());

        // n2 stops answering: it stays, with why.
        table.apply(vec![(b.clone(), Err("timed out".into()))], t0);
        let n2 = table.get("n2").unwrap();
        assert_eq!(
            (n2.url, n2.failure.as_deref()),
            (b.clone(), Some("timed out"))
        );

        // n2 comes back elsewhere, and n3 takes its old address.
        table.apply(
            vec![(c.clone(), Ok(card("n2"))), (b.clone(), Ok(card("n3")))],
            t0,
        );
        let n2 = table.get("n2").unwrap();
        assert_eq!((n2.url, n2.failure), (c.clone(), None));
        assert_eq!(table.get("n3").unwrap().url, b);

        // A URL that now answers as another node is that node's alone.
        table.apply(vec![(c.clone(), Ok(card("n4")))], t0);
        assert!(table.get("n2").is_none(), "n2 is no longer at {c}");
        assert_eq!(table.get("n4").unwrap().url, c);
    }

    #[test]
    fn a_card_names_its_templates_by_id_alias_and_tag() {
        let mut c = card("n2");
        c.templates.push(CardTemplate {
            template_id: "01900000-0000-7000-8000-000000000001".into(),
            alias: Some("app".into()),
            tags: vec!["default".into(), "v1".into()],
            memory_mb: 512,
            cpu_count: 1,
        });
        for hit in [
            "app",
            "app:v1",
            "app:default",
            "01900000-0000-7000-8000-000000000001",
        ] {
            assert_eq!(c.template(hit).map(|t| t.memory_mb), Some(512), "{hit}");
        }
        for miss in ["app:v2", "other", "01900000-0000-7000-8000-000000000002"] {
            assert!(c.template(miss).is_none(), "{miss}");
        }
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["templates"][0]["templateID"], c.templates[0].template_id);
        assert_eq!(v["templates"][0]["memoryMB"], 512);
        // A card of a node without templates on its card still reads.
        let mut old = v.clone();
        old.as_object_mut().unwrap().remove("templates");
        let back: NodeCard = serde_json::from_value(old).unwrap();
        assert!(back.templates.is_empty());
    }

    #[test]
    fn the_card_is_camel_case_json() {
        let v = serde_json::to_value(card("n2")).unwrap();
        assert_eq!(v["node"], "n2");
        assert_eq!(v["advertiseUrl"], "http://n2:3000");
        assert_eq!(v["capacity"]["memoryFreeMB"], 1000);
        assert_eq!(v["capacity"]["vcpusFree"], 4);
        let back: NodeCard = serde_json::from_value(v).unwrap();
        assert_eq!(back, card("n2"));
    }
}
