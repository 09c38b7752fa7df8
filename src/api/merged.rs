//! Lists and metrics across nodes (docs/cluster.md, "Lists and metrics").
//!
//! On a cluster node, a list that does not carry `X-Aenv-Forwarded-By` answers every
//! node's items: the handler's own answer first (which also checks the query: bad input
//! is this node's 400, no peer asked), then the same path and query asked of every peer
//! at once, with `X-Aenv-Forwarded-By: <this node>` so that each answers its own items
//! alone (`Cluster::ask_peers`: the peer timeout and [`MAX_LIST_BYTES`] bound each). A
//! peer that is silent, does not answer in time, answers an error or garbage is left out,
//! logged and counted (`agentenv_cluster_list_partial_total`); the list never waits
//! longer nor fails for it.
//!
//! Paging stays valid across the merge: every node is asked for the items after the same
//! cursor and at most `limit`, the pages are merge-sorted by the list's key and cut at
//! `limit`, and the next token is the key of the last item given ([`merge`]).

use super::envd_proxy::header;
use super::{ApiError, Context, Reply};
use crate::cluster::ask::{Answer, AskError};
use crate::cluster::id::{is_sandbox_id, node_of};
use crate::cluster::{Cluster, Label, FORWARDED_BY};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use tiny_http::Request;

/// Largest list answer taken from a peer (some 10 000 sandboxes).
pub const MAX_LIST_BYTES: u64 = 8 << 20;
/// Largest `GET /sandboxes/metrics` answer taken from a peer (100 ids at most).
pub const MAX_METRICS_BYTES: u64 = 1 << 20;

/// Where an item sorts in its list: `(startedAt in ns, sandboxID)` for `GET
/// /v2/sandboxes`, `(0, id)` for the others.
pub type Key = (u128, String);

/// A list answered merged across nodes, and how its items merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    /// `GET /sandboxes`: every node's, this node's first, once per `sandboxID`.
    SandboxesV1,
    /// `GET /v2/sandboxes`: by `(startedAt, sandboxID)`, paged (`limit`, `nextToken`).
    SandboxesV2,
    /// `GET /snapshots`: newest `snapshotID` first, paged.
    Snapshots,
    /// `GET /templates`, `GET /v2/templates`: once per `templateID` (a template built on
    /// every node is one), this node's copy first.
    Templates,
}

impl Listing {
    fn id_field(self) -> &'static str {
        match self {
            Listing::SandboxesV1 | Listing::SandboxesV2 => "sandboxID",
            Listing::Snapshots => "snapshotID",
            Listing::Templates => "templateID",
        }
    }

    /// The item's key; `None` when it has no valid one (a peer's garbage).
    fn key(self, item: &Value) -> Option<Key> {
        let id = item.get(self.id_field())?.as_str()?;
        match self {
            Listing::SandboxesV1 => is_sandbox_id(id).then(|| (0, id.to_string())),
            Listing::SandboxesV2 => {
                let started: jiff::Timestamp = item.get("startedAt")?.as_str()?.parse().ok()?;
                let nanos = u128::try_from(started.as_nanosecond()).ok()?;
                is_sandbox_id(id).then(|| (nanos, id.to_string()))
            }
            Listing::Snapshots => crate::util::is_uuid(id).then(|| (0, id.to_string())),
            Listing::Templates => (!id.is_empty() && id.len() <= 256).then(|| (0, id.to_string())),
        }
    }

    /// How the list is ordered and cut; `None` for the unordered ones.
    fn paging(self, query_string: &str) -> Result<Option<Paging>, ApiError> {
        match self {
            Listing::SandboxesV2 => super::routes::v2_paging(query_string).map(Some),
            Listing::Snapshots => Ok(Some(Paging {
                ascending: false,
                limit: super::query::limit(&super::query::parse(query_string))?,
            })),
            Listing::SandboxesV1 | Listing::Templates => Ok(None),
        }
    }

    /// The `X-Next-Token` that continues after `key`.
    fn token(self, key: &Key) -> String {
        match self {
            Listing::SandboxesV2 => super::routes::encode_token(key),
            _ => key.1.clone(),
        }
    }
}

/// The order and page size of a paged list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Paging {
    pub ascending: bool,
    pub limit: Option<usize>,
}

/// One node's page: its items (in any order), and whether it has more after them.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub items: Vec<Value>,
    pub more: bool,
}

/// The pages of every node as one: each item once (by key; the first page's copy),
/// sorted and cut at `limit` when paged. The next token when there is more after the cut.
pub fn merge(
    listing: Listing,
    paging: Option<Paging>,
    pages: Vec<Page>,
) -> (Vec<Value>, Option<String>) {
    let more = pages.iter().any(|p| p.more);
    let mut seen = BTreeSet::new();
    let mut keyed: Vec<(Key, Value)> = pages
        .into_iter()
        .flat_map(|p| p.items)
        .filter_map(|item| Some((listing.key(&item)?, item)))
        .filter(|(key, _)| seen.insert(key.clone()))
        .collect();
    let Some(paging) = paging else {
        return (keyed.into_iter().map(|(_, v)| v).collect(), None);
    };
    // Stable: of equal keys (none after the dedup) the first page's first.
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    if !paging.ascending {
        keyed.reverse();
    }
    let mut next = None;
    if let Some(limit) = paging.limit {
        if keyed.len() > limit || more {
            keyed.truncate(limit);
            next = keyed.last().map(|(key, _)| listing.token(key));
        }
    }
    (keyed.into_iter().map(|(_, v)| v).collect(), next)
}

/// This node's answer to a list, merged with every peer's when this is a cluster node and
/// the request was not forwarded here (module doc).
pub fn across(
    ctx: &Context,
    req: &Request,
    listing: Listing,
    local: Result<Reply, ApiError>,
) -> Result<Reply, ApiError> {
    let local = local?;
    let Some(cluster) = ctx.cluster.as_deref() else {
        return Ok(local);
    };
    if header(req, FORWARDED_BY).is_some() {
        return Ok(local);
    }
    let Reply::Json {
        status: 200,
        body: Value::Array(items),
        headers,
    } = local
    else {
        return Ok(local);
    };
    let target = req.url();
    let paging = listing.paging(target.split_once('?').map_or("", |(_, q)| q))?;
    let more = headers.iter().any(|(k, _)| k == "X-Next-Token");
    let mut pages = vec![Page { items, more }];
    pages.extend(peer_pages(cluster, listing, target));
    let (items, next) = merge(listing, paging, pages);
    Ok(Reply::Json {
        status: 200,
        body: Value::Array(items),
        headers: next
            .map(|t| vec![("X-Next-Token".to_string(), t)])
            .unwrap_or_default(),
    })
}

/// Every answering peer's page of `target`; the others left out (logged, counted).
fn peer_pages(cluster: &Cluster, listing: Listing, target: &str) -> Vec<Page> {
    let path = target.split('?').next().unwrap_or(target);
    cluster
        .ask_peers(target, MAX_LIST_BYTES)
        .into_iter()
        .filter_map(
            |(node, answer)| match answer.and_then(|a| page_of(listing, a, path)) {
                Ok(page) => Some(page),
                Err(e) => {
                    left_out(cluster, &node, path, &e);
                    None
                }
            },
        )
        .collect()
}

/// A peer's answer as a page: a JSON array whose every item has a valid key.
fn page_of(listing: Listing, answer: Answer, path: &str) -> Result<Page, AskError> {
    let bad = |why: String| AskError::BadAnswer {
        path: path.to_string(),
        why,
    };
    let Value::Array(items) = answer.body else {
        return Err(bad("not a JSON array".into()));
    };
    if items.iter().any(|i| listing.key(i).is_none()) {
        return Err(bad(format!("an item has no valid {}", listing.id_field())));
    }
    Ok(Page {
        items,
        more: answer.next_token.is_some(),
    })
}

/// Logs and counts a peer left out of a merged answer.
fn left_out(cluster: &Cluster, node: &str, path: &str, e: &AskError) {
    let reason = e.reason();
    log::warn!(
        "op=cluster_merge node={node} path={path} reason={} error=\"{e}\" (left out of the answer)",
        reason.label()
    );
    cluster.partial.record(node, reason);
}

/// `GET /sandboxes/metrics`: the newest samples of those of `ids` other nodes own, each
/// owner asked for its own ids at once (forwarded, bounded as lists). An owner that does
/// not answer leaves its ids out, as a sandbox with no sample is left out on one node.
pub fn peer_metrics(ctx: &Context, req: &Request, ids: &[String]) -> Map<String, Value> {
    let mut found = Map::new();
    let Some(cluster) = ctx.cluster.as_deref() else {
        return found;
    };
    if header(req, FORWARDED_BY).is_some() {
        return found;
    }
    let owners = by_owner(&cluster.node, ids);
    let asks = owners
        .iter()
        .map(|(node, ids)| {
            let target = format!("/sandboxes/metrics?sandbox_ids={}", ids.join(","));
            (node.clone(), target)
        })
        .collect();
    let path = "/sandboxes/metrics";
    for (node, answer) in cluster.ask_nodes(asks, MAX_METRICS_BYTES) {
        let asked = owners.get(&node).map(Vec::as_slice).unwrap_or_default();
        match answer.and_then(|a| metrics_of(a, asked, path)) {
            Ok(m) => found.extend(m),
            Err(e) => left_out(cluster, &node, path, &e),
        }
    }
    found
}

/// Node → the ids of `ids` it owns, for every node but `this` (plain UUIDs are this
/// node's).
fn by_owner<'a>(this: &str, ids: &'a [String]) -> BTreeMap<String, Vec<&'a str>> {
    let mut owners: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for id in ids {
        match node_of(id) {
            Some(node) if node != this => owners.entry(node.to_string()).or_default().push(id),
            _ => {}
        }
    }
    owners
}

/// The samples of a peer's `{"sandboxes": {id: metric}}` for the ids it was asked about.
fn metrics_of(answer: Answer, asked: &[&str], path: &str) -> Result<Map<String, Value>, AskError> {
    let Some(Value::Object(all)) = answer.body.get("sandboxes").cloned() else {
        return Err(AskError::BadAnswer {
            path: path.to_string(),
            why: "no \"sandboxes\" object".into(),
        });
    };
    Ok(all
        .into_iter()
        .filter(|(id, v)| asked.contains(&id.as_str()) && v.is_object())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const UUID: &str = "01900000-0000-7000-8000-00000000000";

    /// A `GET /v2/sandboxes` item of node `node`, started at `ms`, id ending in `n`.
    fn sandbox(n: u8, node: &str, ms: u64) -> Value {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
        json!({"sandboxID": format!("{UUID}{n}-{node}"), "startedAt": crate::util::rfc3339(at)})
    }

    fn ids(items: &[Value]) -> Vec<String> {
        items
            .iter()
            .map(|i| i["sandboxID"].as_str().unwrap()[35..].to_string())
            .collect()
    }

    fn page(items: Vec<Value>, more: bool) -> Page {
        Page { items, more }
    }

    /// Every node's items, filtered past `after` and cut at `limit` as a node does.
    fn node_page(all: &[Value], paging: Paging, after: Option<&Key>) -> Page {
        let (mut items, _) = merge(
            Listing::SandboxesV2,
            Some(Paging {
                limit: None,
                ..paging
            }),
            vec![page(all.to_vec(), false)],
        );
        items.retain(|i| {
            let key = Listing::SandboxesV2.key(i).unwrap();
            after.is_none_or(|a| if paging.ascending { key > *a } else { key < *a })
        });
        let limit = paging.limit.unwrap();
        let more = items.len() > limit;
        items.truncate(limit);
        page(items, more)
    }

    #[test]
    fn pages_walk_every_nodes_items_once_in_order() {
        let n1 = vec![
            sandbox(1, "n1", 5000),
            sandbox(2, "n1", 1000),
            sandbox(3, "n1", 3000),
        ];
        let n2 = vec![
            sandbox(4, "n2", 4000),
            sandbox(5, "n2", 2000),
            sandbox(6, "n2", 3000),
        ];
        for ascending in [false, true] {
            for limit in 1..=7 {
                let paging = Paging {
                    ascending,
                    limit: Some(limit),
                };
                let (mut walked, mut after, mut rounds) = (Vec::new(), None::<Key>, 0);
                loop {
                    rounds += 1;
                    assert!(rounds < 10, "no end");
                    let pages = vec![
                        node_page(&n1, paging, after.as_ref()),
                        node_page(&n2, paging, after.as_ref()),
                    ];
                    let (items, next) = merge(Listing::SandboxesV2, Some(paging), pages);
                    assert!(items.len() <= limit);
                    walked.extend(ids(&items));
                    let Some(token) = next else { break };
                    let key = Listing::SandboxesV2.key(items.last().unwrap()).unwrap();
                    assert_eq!(token, super::super::routes::encode_token(&key));
                    after = Some(key);
                }
                let mut want = vec!["2-n1", "5-n2", "3-n1", "6-n2", "4-n2", "1-n1"];
                if !ascending {
                    want.reverse();
                }
                assert_eq!(walked, want, "ascending={ascending} limit={limit}");
            }
        }
    }

    #[test]
    fn a_full_page_with_more_behind_it_gives_a_token() {
        let paging = Some(Paging {
            ascending: false,
            limit: Some(2),
        });
        let full = page(vec![sandbox(1, "n1", 2000), sandbox(2, "n1", 1000)], true);
        let (items, next) = merge(
            Listing::SandboxesV2,
            paging,
            vec![full, page(vec![], false)],
        );
        assert_eq!(ids(&items), ["1-n1", "2-n1"]);
        assert!(next.is_some(), "n1 has more");
        let exact = page(vec![sandbox(1, "n1", 2000)], false);
        let (_, next) = merge(Listing::SandboxesV2, paging, vec![exact]);
        assert_eq!(next, None);
    }

    #[test]
    fn unordered_lists_keep_one_copy_of_each_id_the_first_pages() {
        let here = json!({"templateID": "base", "buildStatus": "ready"});
        let there = json!({"templateID": "base", "buildStatus": "building"});
        let other = json!({"templateID": "py"});
        let (items, next) = merge(
            Listing::Templates,
            None,
            vec![
                page(vec![here.clone()], false),
                page(vec![there, other.clone()], false),
            ],
        );
        assert_eq!((items, next), (vec![here, other], None));
    }

    #[test]
    fn a_peers_garbage_is_refused_whole() {
        let answer = |body| Answer {
            body,
            next_token: None,
        };
        let p = "/v2/sandboxes";
        let err = page_of(Listing::SandboxesV2, answer(json!({"a": 1})), p).unwrap_err();
        assert_eq!(
            err.to_string(),
            "GET /v2/sandboxes answered badly: not a JSON array"
        );
        let no_time = json!([{"sandboxID": format!("{UUID}1-n2")}]);
        let err = page_of(Listing::SandboxesV2, answer(no_time), p).unwrap_err();
        assert_eq!(err.reason().label(), "bad_answer");
        let bad_id = json!([{"sandboxID": "../x", "startedAt": "2026-12-01T00:00:00.000Z"}]);
        assert!(page_of(Listing::SandboxesV2, answer(bad_id), p).is_err());
        let good = json!([sandbox(1, "n2", 1)]);
        let mut ok = answer(good);
        ok.next_token = Some("t".into());
        assert!(page_of(Listing::SandboxesV2, ok, p).unwrap().more);
    }

    #[test]
    fn metrics_are_asked_of_each_owner_for_its_own_ids() {
        let ids: Vec<String> = ["1-n1", "2-n2", "3-n3", "4-n2"]
            .iter()
            .map(|s| format!("{UUID}{s}"))
            .chain([format!("{UUID}5")])
            .collect();
        let owners = by_owner("n1", &ids);
        assert_eq!(owners.keys().collect::<Vec<_>>(), ["n2", "n3"]);
        assert_eq!(owners["n2"], [ids[1].as_str(), ids[3].as_str()]);
        // A peer's answer about ids it was not asked about is dropped.
        let answer = Answer {
            body: json!({"sandboxes": {
                ids[1].clone(): {"cpuCount": 1},
                ids[2].clone(): {"cpuCount": 2},
                ids[3].clone(): "garbage",
            }}),
            next_token: None,
        };
        let got = metrics_of(answer, &owners["n2"], "/sandboxes/metrics").unwrap();
        assert_eq!(got.keys().collect::<Vec<_>>(), [&ids[1]]);
        let none = Answer {
            body: json!([]),
            next_token: None,
        };
        assert!(metrics_of(none, &owners["n2"], "/sandboxes/metrics").is_err());
    }
}
