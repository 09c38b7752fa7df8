//! Placing a create on a node with room (docs/cluster.md, "Placement").
//!
//! A `POST /sandboxes` (or `/v2/sandboxes`) from a template that reaches a cluster node
//! from a client is served here when this node has the template ready and its admission
//! would start a VM of the template's size now. Else it goes to the peers whose last
//! card lists the template with room for it, the one with most free memory first, at
//! most [`MAX_TRIES`] of them: a peer that answers 429 or cannot be reached makes way
//! for the next; any other answer is the client's. A create that carries
//! `X-Aenv-Forwarded-By` is never placed again: it is served (or refused) where it
//! arrived. The peer gets the create's JSON body again, so the create goes through the
//! bounded [`crate::cluster::client`] (its answer is a small JSON document) rather than
//! the streaming relay, which cannot send a body twice.

use super::body::Fields;
use super::envd_proxy::header;
use super::forward::FORWARDED_BY;
use super::{ApiError, Context, Reply};
use crate::cluster::client::{Body, Call};
use crate::cluster::peers::{CardTemplate, NodeCapacity, MAX_CARD_TEMPLATES};
use crate::cluster::{Cluster, ForwardResult};
use serde_json::Value;
use std::time::Duration;
use tiny_http::Request;

/// Most peers a create is offered to before it is refused.
pub const MAX_TRIES: usize = 3;
/// How long a peer may take to create (a restore takes about a second; a template whose
/// build is finishing makes the create wait for it).
const CREATE_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest create answer taken from a peer.
const MAX_ANSWER: u64 = 64 * 1024;

/// A create's size: (memory MiB, vCPUs).
type Size = (u32, u32);

/// The answer of another node to `req`'s create from `template`, when it is not served
/// here; `None`: serve it here (a single node, an already forwarded create, room here,
/// or no node has the template: then it fails here as on one node).
pub fn elsewhere(
    ctx: &Context,
    req: &Request,
    f: &Fields,
    template: &str,
) -> Result<Option<Reply>, ApiError> {
    let Some(cluster) = &ctx.cluster else {
        return Ok(None);
    };
    if header(req, FORWARDED_BY).is_some() {
        return Ok(None);
    }
    let local = ctx.orchestrator.catalog().ready_snapshot(template);
    let size = local.as_ref().map(|s| {
        (
            s.settings.resources.memory_mb,
            s.settings.resources.cpu_count,
        )
    });
    let mut why_not = Vec::new();
    match &local {
        Some(snapshot) => match ctx.orchestrator.observe().would_admit(snapshot) {
            Ok(()) => return Ok(None),
            Err(why) => why_not.push(format!("{} (here): {why}", cluster.node)),
        },
        None => why_not.push(format!(
            "{} (here) has no ready template {template}",
            cluster.node
        )),
    }
    let (room, full) = peers_with_room(cluster, template);
    let Some(size) = size.or_else(|| room.first().map(|r| r.1)) else {
        // No peer with room lists it; a full one may: its size names the refusal.
        if full.is_empty() {
            return Ok(None);
        }
        return Err(no_room(template, None, why_not.into_iter().chain(full)));
    };
    why_not.extend(full);
    let body = Value::Object(f.0.clone()).to_string();
    for (node, _) in room.iter().take(MAX_TRIES) {
        match offer(cluster, req, node, body.as_bytes()) {
            Ok(reply) => return Ok(Some(reply)),
            Err(why) => why_not.push(format!("{node}: {why}")),
        }
    }
    Err(no_room(template, Some(size), why_not.into_iter()))
}

/// The 429 of a create no node had room for, with each node's reason.
fn no_room(template: &str, size: Option<Size>, why: impl Iterator<Item = String>) -> ApiError {
    let size = size.map_or_else(String::new, |(m, c)| format!(" ({m} MiB, {c} vCPUs)"));
    let why: Vec<String> = why.collect();
    ApiError::new(
        429,
        format!(
            "no node has room for a sandbox of template {template}{size}: {}",
            why.join("; ")
        ),
    )
}

/// The answering peers whose last card lists `template` with room for it, most free
/// memory first, each with the template's size there; and why each other peer that
/// lists it has no room.
fn peers_with_room(cluster: &Cluster, template: &str) -> (Vec<(String, Size)>, Vec<String>) {
    let mut room = Vec::new();
    let mut full = Vec::new();
    for (node, peer) in cluster.peers.peers() {
        let listed = peer.card.template(template);
        let (Some(t), None) = (listed, &peer.failure) else {
            continue;
        };
        let size = (t.memory_mb, t.cpu_count);
        match has_room(&peer.card.capacity, size) {
            Ok(free) => room.push((free, node, size)),
            Err(why) => full.push(format!("{node}: {why}")),
        }
    }
    room.sort_by_key(|r| std::cmp::Reverse(r.0));
    (room.into_iter().map(|(_, n, s)| (n, s)).collect(), full)
}

/// Whether a card's free capacity covers a VM of `size`: its free memory (for the
/// order), or why not.
fn has_room(free: &NodeCapacity, (memory, vcpus): Size) -> Result<u64, String> {
    if free.vcpus_capped && free.vcpus_free < u64::from(vcpus) {
        return Err(format!(
            "{} vCPUs free, {vcpus} needed (its last card)",
            free.vcpus_free
        ));
    }
    match free.memory_free_mb {
        Some(mb) if mb < u64::from(memory) => Err(format!(
            "{mb} MiB free, {memory} MiB needed (its last card)"
        )),
        Some(mb) => Ok(mb),
        None => Ok(u64::MAX),
    }
}

/// The create sent to `node`: its answer for the client, or why it makes way for the
/// next node (429, or no answer). Counted in `agentenv_cluster_forwarded_total`.
fn offer(cluster: &Cluster, req: &Request, node: &str, body: &[u8]) -> Result<Reply, String> {
    let peer = cluster
        .peers
        .get(node)
        .ok_or_else(|| "no longer among the peers".to_string())?;
    let key = header(req, "Idempotency-Key");
    let headers: Vec<(&str, &str)> = key.map(|k| ("Idempotency-Key", k)).into_iter().collect();
    let call = Call {
        method: "POST",
        target: req.url(),
        headers: &headers,
        body: Body::Json(body),
        timeout: CREATE_TIMEOUT,
        max_answer: MAX_ANSWER,
    };
    let answer = match cluster.client.call(&peer.url, call) {
        Ok(a) => a,
        Err(why) => {
            cluster.forwarded.record(node, ForwardResult::Unreachable);
            log::warn!("op=place node={node} error=\"{why}\"");
            return Err(why.to_string());
        }
    };
    cluster.forwarded.record(node, ForwardResult::Answered);
    let value: Value = serde_json::from_slice(&answer.body).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(&answer.body);
        Value::String(text.chars().take(200).collect())
    });
    if answer.status == 429 {
        let message = value["message"]
            .as_str()
            .map_or_else(|| value.to_string(), str::to_string);
        return Err(format!("answered 429: {message}"));
    }
    log::info!("op=place node={node} status={}", answer.status);
    let headers = value["sandboxID"]
        .as_str()
        .map(|id| ("x-agentenv-sandbox-id".to_string(), id.to_string()))
        .into_iter()
        .collect();
    Ok(Reply::Json {
        status: answer.status,
        body: value,
        headers,
    })
}

/// What this node's card lists (api.md §4.29): its ready E2B templates, template builds
/// and snapshots, each with its size, at most [`MAX_CARD_TEMPLATES`].
pub fn card_templates(ctx: &Context) -> Vec<CardTemplate> {
    let catalog = ctx.orchestrator.catalog();
    let entry = |id: &str,
                 alias: Option<&str>,
                 tags: Vec<String>,
                 snap: &crate::orchestrator::SnapshotRecord| CardTemplate {
        template_id: id.to_string(),
        alias: alias.map(str::to_string),
        tags,
        memory_mb: snap.settings.resources.memory_mb,
        cpu_count: snap.settings.resources.cpu_count,
    };
    let mut list: Vec<CardTemplate> = Vec::new();
    for (t, snap) in catalog.catalog_templates() {
        if let Some(snap) = snap {
            list.push(entry(
                &t.id,
                Some(&t.name),
                t.tags.keys().cloned().collect(),
                &snap,
            ));
        }
    }
    for (b, snap) in catalog.templates() {
        if let Some(snap) = snap {
            list.push(entry(&b.id, Some(&b.name), Vec::new(), &snap));
        }
    }
    for snap in catalog.snapshots() {
        list.push(entry(&snap.id, snap.name.as_deref(), Vec::new(), &snap));
    }
    list.truncate(MAX_CARD_TEMPLATES);
    list
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::client::PeerClient;
    use crate::cluster::peer::PeerUrl;
    use crate::cluster::peers::{NodeCard, PeerTable};
    use crate::cluster::NodeCounts;
    use std::sync::Arc;
    use std::time::Instant;

    fn card(node: &str, free_mb: Option<u64>, vcpus: u64, templates: &[&str]) -> NodeCard {
        NodeCard {
            node: node.into(),
            advertise_url: format!("http://{node}:1"),
            capacity: NodeCapacity {
                memory_free_mb: free_mb,
                vcpus_free: vcpus,
                vcpus_capped: true,
                memory_reserved_mb: 0,
                vcpus_reserved: 0,
                running: 0,
            },
            templates: templates
                .iter()
                .map(|t| CardTemplate {
                    template_id: format!("id-{t}"),
                    alias: Some(t.to_string()),
                    tags: vec!["default".into()],
                    memory_mb: 512,
                    cpu_count: 1,
                })
                .collect(),
        }
    }

    #[test]
    fn peers_with_room_and_the_template_come_most_free_memory_first() {
        let table = PeerTable::new("n1");
        let url = |n: &str| PeerUrl::parse(&format!("http://{n}:1")).unwrap();
        table.apply(
            vec![
                (url("n2"), Ok(card("n2", Some(1000), 2, &["app"]))),
                (url("n3"), Ok(card("n3", Some(4000), 2, &["app"]))),
                (url("n4"), Ok(card("n4", Some(100), 2, &["app"]))),
                (url("n5"), Ok(card("n5", Some(9000), 0, &["app"]))),
                (url("n6"), Ok(card("n6", None, 2, &["other"]))),
                (url("n7"), Ok(card("n7", None, 2, &["app"]))),
            ],
            Instant::now(),
        );
        table.apply(vec![(url("n7"), Err("timed out".into()))], Instant::now());
        let cluster = Cluster {
            node: "n1".into(),
            advertise_url: String::new(),
            peers: Arc::new(table),
            forwarded: NodeCounts::default(),
            partial: NodeCounts::default(),
            peer_timeout: std::time::Duration::from_secs(1),
            client: PeerClient {
                this: "n1".into(),
                api_key: String::new(),
            },
        };
        let (room, full) = peers_with_room(&cluster, "app:default");
        let names: Vec<&str> = room.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["n3", "n2"],
            "silent n7 and full n4, n5 are left out"
        );
        assert_eq!(room[0].1, (512, 1));
        assert_eq!(full.len(), 2, "{full:?}");
        assert!(
            full[0].starts_with("n4: 100 MiB free, 512 MiB needed"),
            "{full:?}"
        );
        assert!(
            full[1].starts_with("n5: 0 vCPUs free, 1 needed"),
            "{full:?}"
        );
        assert!(peers_with_room(&cluster, "nowhere").0.is_empty());
        // A node that cannot tell its free memory is taken at its word.
        assert_eq!(
            has_room(&card("x", None, 1, &[]).capacity, (512, 1)),
            Ok(u64::MAX)
        );
    }
}
