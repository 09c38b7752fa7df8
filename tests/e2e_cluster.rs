//! End-to-end, issue 22: three agentenv nodes behind HAProxy on one machine, each a host
//! of its own (tests/common/cluster.rs: its own network and mount namespaces, state dir,
//! `/run/netns`, `/run/agentenv` and nftables), HAProxy running deploy/haproxy/haproxy.cfg
//! as it is. Creates through HAProxy spread over the nodes and their ids name the node; a
//! command runs on each; a node SIGKILLed fails HAProxy's health check, leaves no QEMU, and
//! creates go on on the others; restarted, it passes the check again and takes creates;
//! lists and metrics asked of any node answer every node's sandboxes, a stopped or killed
//! node left out within the peer timeout; at the end nothing is left on any node nor on
//! the host.

mod common;

use common::cluster::*;
use common::shared::{Hold, Shared};
use common::*;
use serde_json::json;
use std::collections::btree_map::{BTreeMap, Entry};
use std::sync::MutexGuard;
use std::time::Duration;

/// Creates a sandbox through HAProxy; (its node, its id), checking the id names the node.
fn create_via_lb(c: &Cluster) -> (String, String) {
    let v = c.lb.create(json!({"image": base_image(), "timeout": 600}));
    let id = id_of(&v);
    let node = v["clientID"].as_str().unwrap().to_string();
    assert!(NODES.contains(&node.as_str()), "clientID {node}: {v}");
    assert!(id.ends_with(&format!("-{node}")), "{id} names {node}");
    (node, id)
}

fn delete(s: &Server, id: &str) {
    let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "delete {id}: {v}");
}

/// Stops every node gracefully; each leaves nothing on its host.
fn stop_all_leaving_nothing(c: &mut Cluster) {
    for name in NODES {
        c.node_mut(name).stop();
        let left = c.node_leftovers(name);
        assert!(left.is_empty(), "{name} left {left:?}");
    }
}

#[test]
fn three_nodes_behind_haproxy_spread_creates_and_survive_a_killed_node() {
    let _alone = SHARED.alone();
    let _one = serial();
    {
        let mut c = Cluster::start();
        // Round-robin spreads creates over the nodes: one sandbox kept per node.
        let mut owned: BTreeMap<String, String> = BTreeMap::new();
        for _ in 0..6 {
            if owned.len() == NODES.len() {
                break;
            }
            let (node, id) = create_via_lb(&c);
            match owned.entry(node) {
                Entry::Occupied(e) => delete(c.node(e.key()), &id),
                Entry::Vacant(e) => {
                    e.insert(id);
                }
            }
        }
        assert_eq!(owned.len(), NODES.len(), "creates landed on {owned:?}");
        for (node, id) in &owned {
            let out = sh(c.node(node), id, "echo hello; uname -s");
            assert_eq!(out, "hello\nLinux\n", "{node}");
            // Each node's slot is `agentenv-ns-<n>` in its own /run/netns.
            let (code, v) = c.node(node).call("GET", &format!("/sandboxes/{id}"), None);
            assert_eq!(code, 200, "{v}");
            assert_eq!(v["clientID"], node.as_str(), "{v}");
        }

        // n2 SIGKILLed: HAProxy's checks fail, its QEMU died with it, creates go on.
        let n2_state = c.node("n2").state_dir.display().to_string();
        c.node_mut("n2").crash();
        c.wait_lb_check("n2", "failed");
        must(Duration::from_secs(10), "n2's QEMU outlived it", || {
            qemu_processes_with(&n2_state).is_empty()
        });
        for _ in 0..2 {
            let (node, id) = create_via_lb(&c);
            assert_ne!(node, "n2", "a create went to the killed node");
            delete(c.node(&node), &id);
        }

        // Restarted on the same "host": its recovery removes the sandbox that was running
        // (its memory died), HAProxy's checks pass again and it takes creates.
        c.node_mut("n2").spawn();
        c.wait_lb_check("n2", "succeeded");
        let lost = owned.remove("n2").unwrap();
        must(
            Duration::from_secs(30),
            "n2 still lists its lost sandbox",
            || {
                c.node("n2")
                    .call("GET", &format!("/sandboxes/{lost}"), None)
                    .0
                    == 404
            },
        );
        let mut n2_again = None;
        for _ in 0..4 {
            let (node, id) = create_via_lb(&c);
            if node == "n2" {
                n2_again = Some(id);
                break;
            }
            delete(c.node(&node), &id);
        }
        let id = n2_again.expect("no create went to n2 after its restart");
        assert_eq!(sh(c.node("n2"), &id, "echo back"), "back\n");
        owned.insert("n2".to_string(), id);

        for (node, id) in &owned {
            delete(c.node(node), id);
        }
        stop_all_leaving_nothing(&mut c);
    }
    let left = host_leftovers();
    assert!(left.is_empty(), "the harness left {left:?}");
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
}

/// `GET /cluster/node` of `s`.
fn card(s: &Server) -> serde_json::Value {
    let (code, v) = s.call("GET", "/cluster/node", None);
    assert_eq!(code, 200, "{v}");
    v
}

/// Whether `s` knows node `peer` and got its last answer.
fn knows(s: &Server, peer: &str) -> bool {
    card(s)["peers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["node"] == peer && p["answering"] == true)
}

/// `GET path` on `s` with extra headers and no API key unless given: (status, body).
fn get_with(s: &Server, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = ureq::get(&format!("{}{path}", s.base)).timeout(Duration::from_secs(60));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    match req.call() {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

/// E2B's v1 file URL signature for the default user, without expiry (api::signed_url).
fn signature(path: &str, operation: &str, token: &str) -> String {
    use base64::Engine;
    use sha2::Digest;
    let digest = sha2::Sha256::digest(format!("{path}:{operation}::{token}").as_bytes());
    let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest);
    format!("v1_{}", encoded.replace('+', "%2B").replace('/', "%2F"))
}

/// Opens the console's terminal for `id` on `s`, types `keys`, and returns what the PTY
/// printed until `want` appeared (bounded: 30 s, 1 MiB).
fn terminal_through(s: &Server, id: &str, keys: &str, want: &str) -> String {
    use tungstenite::client::IntoClientRequest;
    use tungstenite::Message;
    let host = s.base.trim_start_matches("http://");
    let url = format!("ws://{host}/console/terminal/{id}?cols=80&rows=24");
    let mut request = url.into_client_request().unwrap();
    let protocols = format!("agentenv.terminal, agentenv.key.{API_KEY}");
    request
        .headers_mut()
        .insert("Sec-WebSocket-Protocol", protocols.parse().unwrap());
    let stream = std::net::TcpStream::connect(host).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let (mut ws, answer) = tungstenite::client::client(request, stream)
        .unwrap_or_else(|e| panic!("terminal upgrade via {host}: {e}"));
    assert_eq!(answer.status(), 101);
    let input = json!({"type": "input", "data": keys}).to_string();
    ws.send(Message::text(input)).unwrap();
    let (started, mut seen) = (std::time::Instant::now(), String::new());
    while !seen.contains(want) && started.elapsed() < Duration::from_secs(30) {
        match ws
            .read()
            .unwrap_or_else(|e| panic!("terminal read: {e}; saw {seen:?}"))
        {
            Message::Binary(b) => seen.push_str(&String::from_utf8_lossy(&b)),
            Message::Text(t) => seen.push_str(t.as_str()),
            _ => {}
        }
        assert!(seen.len() < 1 << 20, "a flood: {}", seen.len());
    }
    let _ = ws.close(None);
    seen
}

/// The value of the series `series` in `s`'s `/metrics` (0 when absent).
fn metric(s: &Server, series: &str) -> u64 {
    let (code, v) = s.call("GET", "/metrics", None);
    assert_eq!(code, 200);
    let text = v.as_str().unwrap().to_string();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// The cluster the tests that kill no node share: every node knows the others, n1 holds
/// [`Pair::a`] and n2 [`Pair::b`], n3 none. Its tests take turns ([`on_shared_cluster`]):
/// their lists and counts are of the whole cluster, so each removes what else it makes.
/// The tests that kill a node, or configure one, own a cluster of their own and take
/// [`Shared::alone`] (there is one lan: one cluster at a time). libtest runs tests in the
/// order of their names, and those sort before and after the shared ones, so the shared
/// cluster starts once.
struct Nodes {
    c: Cluster,
    pair: Pair,
}

static SHARED: Shared<Nodes> = Shared::new();

impl common::shared::Fixture for Nodes {
    fn start() -> Nodes {
        let c = Cluster::start();
        all_know_each_other(&c);
        let pair = Pair::make(&c);
        Nodes { c, pair }
    }

    /// Deletes the pair and stops every node; unless a test failed, checks that nothing is
    /// left on any node nor on the host.
    fn stop(mut self, failed: bool) {
        if failed {
            for node in std::mem::take(&mut self.c.nodes) {
                eprintln!("node log kept: {}", node.log_path.display());
                std::mem::forget(node);
            }
            return;
        }
        delete(self.c.node("n1"), &self.pair.a);
        delete(self.c.node("n2"), &self.pair.b);
        stop_all_leaving_nothing(&mut self.c);
        drop(self.c);
        let left = host_leftovers();
        assert!(left.is_empty(), "the harness left {left:?}");
    }
}

/// A hold on the shared cluster, and the turn on it.
fn on_shared_cluster() -> (Hold<Nodes>, MutexGuard<'static, ()>) {
    let hold = SHARED.hold();
    (hold, serial())
}

/// One sandbox made directly on n1, then one on n2 (metadata `suite=lists`, `i=a|b`).
struct Pair {
    a: String,
    /// a's envd access token.
    a_token: String,
    b: String,
}

impl Pair {
    fn make(c: &Cluster) -> Pair {
        let mine = |i: &str| json!({"image": base_image(), "timeout": 600, "metadata": {"suite": "lists", "i": i}});
        let v = c.node("n1").create(mine("a"));
        let a_token = v["envdAccessToken"].as_str().unwrap().to_string();
        let a = id_of(&v);
        let b = id_of(&c.node("n2").create(mine("b")));
        Pair { a, a_token, b }
    }

    fn both(&self) -> Vec<String> {
        sorted(vec![self.a.clone(), self.b.clone()])
    }
}

/// `PUT /sandboxes/{id}/files?path=<path>` of `bytes` on `s`, asserting 204.
fn put_file(s: &Server, id: &str, path: &str, bytes: &[u8]) {
    let put = ureq::put(&format!("{}/sandboxes/{id}/files?path={path}", s.base))
        .set("X-API-Key", API_KEY)
        .send_bytes(bytes);
    assert_eq!(
        put.map(|r| r.status()).unwrap_or_else(|e| panic!("{e}")),
        204
    );
}

#[test]
fn every_node_finds_its_peers_and_tells_its_name_url_capacity_and_running_sandboxes() {
    let (n, _turn) = on_shared_cluster();
    let c = &n.c;
    for (a, b) in [("n1", "n2"), ("n2", "n1"), ("n3", "n1")] {
        must(
            Duration::from_secs(20),
            &format!("{a} never found {b}"),
            || knows(c.node(a), b),
        );
    }
    let n1 = card(c.node("n1"));
    assert_eq!(n1["node"], "n1", "{n1}");
    assert_eq!(n1["advertiseUrl"], node_url("n1"), "{n1}");
    assert!(n1["capacity"]["vcpusFree"].as_u64().unwrap() > 0, "{n1}");
    assert!(n1["capacity"]["memoryFreeMB"].as_u64().is_some(), "{n1}");
    assert!(metric(c.node("n1"), "agentenv_free_vcpus") > 0);
    // n1 runs one sandbox, made there.
    assert!(n.pair.a.ends_with("-n1"), "{}", n.pair.a);
    assert_eq!(card(c.node("n1"))["capacity"]["running"], 1);
}

/// Made on n1, used through n2 (not its owner) for everything, the credentials checked by
/// n1; deleted through n2, gone on n1.
#[test]
fn another_nodes_sandbox_is_used_and_deleted_through_any_node_its_owner_checking_credentials() {
    let (n, _turn) = on_shared_cluster();
    let (b, a) = (n.c.node("n2"), n.c.node("n1"));
    let answered = "agentenv_cluster_forwarded_total{node=\"n1\",result=\"answered\"}";
    let forwarded_before = metric(b, answered);
    let v = a.create(json!({"image": base_image(), "timeout": 600}));
    let id = id_of(&v);
    let token = v["envdAccessToken"].as_str().unwrap().to_string();
    assert!(id.ends_with("-n1"), "{id}");
    let (code, got) = b.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!((code, &got["clientID"]), (200, &json!("n1")), "{got}");
    assert_eq!(
        sh(b, &id, "echo via-rest; hostname >/dev/null"),
        "via-rest\n"
    );
    let (out, exit) = envd_sh(b, &id, &token, "echo via-envd");
    assert_eq!((out.as_str(), exit), ("via-envd\n", 0));
    // A file written through n2's REST path, read back through n2's REST path and
    // envd, and on the owner.
    put_file(b, &id, "/tmp/f.txt", b"forwarded bytes\n");
    let key = [("X-API-Key", API_KEY)];
    let (code, text) = get_with(b, &format!("/sandboxes/{id}/files?path=/tmp/f.txt"), &key);
    assert_eq!((code, text.as_str()), (200, "forwarded bytes\n"));
    let envd = [
        ("E2b-Sandbox-Id", id.as_str()),
        ("X-Access-Token", token.as_str()),
    ];
    let (code, text) = get_with(b, "/files?path=/tmp/f.txt&username=root", &envd);
    assert_eq!((code, text.as_str()), (200, "forwarded bytes\n"));
    assert_eq!(sh(a, &id, "cat /tmp/f.txt"), "forwarded bytes\n");
    // Credentials are the owner's to check: a wrong envd token is its 401.
    let wrong = [("E2b-Sandbox-Id", id.as_str()), ("X-Access-Token", "nope")];
    assert_eq!(get_with(b, "/files?path=/tmp/f.txt", &wrong).0, 401);
    assert_eq!(get_with(b, &format!("/sandboxes/{id}"), &[]).0, 401);
    // A forward is counted once its answer has reached the client: wait for it.
    must(
        Duration::from_secs(10),
        "n2 never counted 7 forwards",
        || metric(b, answered) >= forwarded_before + 7,
    );

    // Deleted through n2: gone on n1.
    let (code, v) = b.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(code, 204, "{v}");
    assert_eq!(a.call("GET", &format!("/sandboxes/{id}"), None).0, 404);
}

/// Already forwarded (by n2): n3 answers for n1's sandbox itself, never forwarding again.
#[test]
fn any_node_answers_an_already_forwarded_request_itself_and_never_forwards_it_again() {
    let (n, _turn) = on_shared_cluster();
    let (n3, id) = (n.c.node("n3"), &n.pair.a);
    let refused = "agentenv_cluster_forwarded_total{node=\"n1\",result=\"refused\"}";
    let sent_on = "agentenv_cluster_forwarded_total{node=\"n1\",result=\"answered\"}";
    let (refused_before, sent_before) = (metric(n3, refused), metric(n3, sent_on));
    let once = [("X-API-Key", API_KEY), ("X-Aenv-Forwarded-By", "n2")];
    let (code, text) = get_with(n3, &format!("/sandboxes/{id}"), &once);
    assert_eq!(code, 404, "{text}");
    assert!(
        text.contains("lives on node n1") && text.contains("not forwarded again"),
        "{text}"
    );
    assert_eq!(metric(n3, refused), refused_before + 1);
    assert_eq!(metric(n3, sent_on), sent_before, "n3 sent nothing on");
}

/// The console's terminal (a WebSocket: an upgrade, then a byte tunnel both ways) through
/// n2 to n1's sandbox.
#[test]
fn the_console_terminal_reaches_another_nodes_sandbox_through_any_node() {
    let (n, _turn) = on_shared_cluster();
    let typed = terminal_through(
        n.c.node("n2"),
        &n.pair.a,
        "echo ws-$((40+2))-across\n",
        "ws-42-across",
    );
    assert!(typed.contains("ws-42-across"), "{typed}");
}

/// A signed download URL naming no sandbox (setup 1), sent to n2 and n3 with no
/// credential: served from n1's sandbox, whose token signed it; changed, it is 401.
#[test]
fn signed_urls_naming_no_sandbox_are_served_by_any_node_from_the_sandbox_that_signed_them() {
    let (n, _turn) = on_shared_cluster();
    let (id, token) = (&n.pair.a, &n.pair.a_token);
    put_file(n.c.node("n1"), id, "/tmp/f.txt", b"forwarded bytes\n");
    let url = |sig: &str| format!("/files?path=/tmp/f.txt&signature={sig}");
    let good = url(&signature("/tmp/f.txt", "read", token));
    for node in ["n2", "n3"] {
        let (code, text) = get_with(n.c.node(node), &good, &[]);
        assert_eq!(
            (code, text.as_str()),
            (200, "forwarded bytes\n"),
            "via {node}"
        );
    }
    let bad = url(&signature("/tmp/other.txt", "read", token));
    let (code, text) = get_with(n.c.node("n2"), &bad, &[]);
    assert_eq!(code, 401, "{text}");
}

/// A paused sandbox of n1 (paused through n2), then n1 SIGKILLed: n2 answers 502 naming
/// n1; restarted, n1 serves it again through n2.
#[test]
fn a_paused_sandbox_of_a_killed_node_answers_502_naming_it_and_is_served_again_after_restart() {
    let _alone = SHARED.alone();
    let _one = serial();
    {
        let mut c = Cluster::start();
        all_know_each_other(&c);
        let (b, a) = (c.node("n2"), c.node("n1"));
        let paused = id_of(&a.create(json!({"image": base_image(), "timeout": 600})));
        let (code, v) = b.call("POST", &format!("/sandboxes/{paused}/pause"), None);
        assert_eq!(code, 204, "{v}");
        c.node_mut("n1").crash();
        let b = c.node("n2");
        for path in [
            format!("/sandboxes/{paused}"),
            format!("/sandboxes/{paused}/logs"),
        ] {
            let (code, v) = b.call("GET", &path, None);
            assert_eq!(code, 502, "{path}: {v}");
            let message = v["message"].as_str().unwrap();
            assert!(
                message.starts_with(&format!(
                    "sandbox {paused} lives on node n1, which does not answer: "
                )),
                "{message}"
            );
        }
        let envd = [("E2b-Sandbox-Id", paused.as_str()), ("X-Access-Token", "t")];
        let (code, text) = get_with(b, "/files?path=/x", &envd);
        assert_eq!(code, 502, "{text}");
        assert!(text.contains("node n1"), "{text}");
        let unreachable = "agentenv_cluster_forwarded_total{node=\"n1\",result=\"unreachable\"}";
        must(
            Duration::from_secs(10),
            "n2 never counted 3 unreachable",
            || metric(b, unreachable) >= 3,
        );
        must(Duration::from_secs(20), "n2 never marked n1 silent", || {
            !knows(c.node("n2"), "n1")
        });

        c.node_mut("n1").spawn();
        must(Duration::from_secs(30), "n2 never found n1 again", || {
            knows(c.node("n2"), "n1")
        });
        let b = c.node("n2");
        let (code, v) = b.call("GET", &format!("/sandboxes/{paused}"), None);
        assert_eq!((code, &v["state"]), (200, &json!("paused")), "{v}");
        let (code, v) = b.call("DELETE", &format!("/sandboxes/{paused}"), None);
        assert_eq!(code, 204, "{v}");

        stop_all_leaving_nothing(&mut c);
    }
    let left = host_leftovers();
    assert!(left.is_empty(), "the harness left {left:?}");
}

/// `GET path` on `s` with the API key: the listed items' `id_field`s in order, the
/// `X-Next-Token` if any.
fn listed(s: &Server, path: &str, id_field: &str) -> (Vec<String>, Option<String>) {
    let r = ureq::get(&format!("{}{path}", s.base))
        .set("X-API-Key", API_KEY)
        .timeout(Duration::from_secs(30))
        .call()
        .unwrap_or_else(|e| panic!("GET {path} via {}: {e}", s.base));
    let next = r.header("X-Next-Token").map(str::to_string);
    let v: serde_json::Value = r.into_json().unwrap();
    let ids = v
        .as_array()
        .unwrap_or_else(|| panic!("{path}: {v}"))
        .iter()
        .map(|i| i[id_field].as_str().unwrap().to_string())
        .collect();
    (ids, next)
}

/// The `id_field`s of `GET <list>?<query>` on `s`, walked page by page with `limit=1`
/// and `nextToken`; each page holds one item.
fn walk(s: &Server, list: &str, query: &str, id_field: &str) -> Vec<String> {
    let (mut all, mut token) = (Vec::new(), None::<String>);
    for _ in 0..10 {
        let mut path = format!("{list}?limit=1&{query}");
        if let Some(t) = &token {
            path.push_str(&format!("&nextToken={t}"));
        }
        let (ids, next) = listed(s, &path, id_field);
        assert!(ids.len() <= 1, "{path}: {ids:?}");
        all.extend(ids);
        match next {
            Some(t) => token = Some(t),
            None => return all,
        }
    }
    panic!("paging {list} via {} never ended: {all:?}", s.base);
}

/// [`walk`] over `GET /v2/sandboxes`.
fn walk_v2(s: &Server, query: &str) -> Vec<String> {
    walk(s, "/v2/sandboxes", query, "sandboxID")
}

/// Sorted, to compare as sets.
fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// The ids `GET /sandboxes/metrics?sandbox_ids=…` on `s` has a sample of.
fn sampled(s: &Server, ids: &[&str]) -> Vec<String> {
    let path = format!("/sandboxes/metrics?sandbox_ids={}", ids.join(","));
    let (code, v) = s.call("GET", &path, None);
    assert_eq!(code, 200, "{v}");
    let found = v["sandboxes"].as_object().unwrap();
    for m in found.values() {
        assert!(m["memTotal"].as_u64().unwrap() > 0, "{v}");
    }
    sorted(found.keys().cloned().collect())
}

/// Lists of sandboxes, v1 and v2, asked of any node or HAProxy: every node's, filtered by
/// metadata, newest first, one page each with the token valid across the nodes.
#[test]
fn lists_via_any_node_or_haproxy_answer_every_nodes_sandboxes_newest_first_and_paged() {
    let (n, _turn) = on_shared_cluster();
    let (c, a, b, both) = (&n.c, &n.pair.a, &n.pair.b, n.pair.both());
    for via in c.nodes.iter().chain([&c.lb]) {
        for path in ["/sandboxes", "/v2/sandboxes"] {
            let (all, next) = listed(via, path, "sandboxID");
            assert_eq!(
                (sorted(all), next),
                (both.clone(), None),
                "{path} via {}",
                via.base
            );
        }
        let (v1, _) = listed(via, "/sandboxes?metadata=i%3Db", "sandboxID");
        assert_eq!(v1, [b.as_str()], "v1 filtered via {}", via.base);
        // Newest first, one page each, the token valid across the nodes.
        assert_eq!(walk_v2(via, ""), [b.clone(), a.clone()], "via {}", via.base);
        assert_eq!(walk_v2(via, "order=asc"), [a.clone(), b.clone()]);
        assert_eq!(
            walk_v2(via, "metadata=suite%3Dlists"),
            [b.clone(), a.clone()]
        );
        assert_eq!(walk_v2(via, "metadata=i%3Da"), [a.as_str()]);
        assert!(walk_v2(via, "metadata=i%3Dnone").is_empty());
    }
}

/// A snapshot of each sandbox, captured on its owner through n3: newest first, paged, via
/// any node; deleted on the owners, gone from the list.
#[test]
fn snapshots_captured_through_a_third_node_are_listed_and_paged_via_any_node() {
    let (n, _turn) = on_shared_cluster();
    let (c, a, b) = (&n.c, &n.pair.a, &n.pair.b);
    let snapshot = |id: &str| {
        let path = format!("/sandboxes/{id}/snapshots");
        let (code, v) = c.node("n3").call("POST", &path, Some(json!({})));
        assert_eq!(code, 201, "{v}");
        v["snapshotID"].as_str().unwrap().to_string()
    };
    let (sa, sb) = (snapshot(a), snapshot(b));
    for via in &c.nodes {
        let walked = walk(via, "/snapshots", "", "snapshotID");
        assert_eq!(walked, [sb.as_str(), sa.as_str()], "via {}", via.base);
        let (of_b, _) = listed(via, &format!("/snapshots?sandboxID={b}"), "snapshotID");
        assert_eq!(of_b, [sb.as_str()], "via {}", via.base);
    }
    for (owner, snap) in [("n1", &sa), ("n2", &sb)] {
        let (code, v) = c
            .node(owner)
            .call("DELETE", &format!("/templates/{snap}"), None);
        assert_eq!(code, 204, "{v}");
    }
    assert!(listed(c.node("n3"), "/snapshots", "snapshotID")
        .0
        .is_empty());
}

/// What a node asked on behalf of another answers with: its own alone.
const ON_BEHALF_OF_N3: [(&str, &str); 2] = [("X-API-Key", API_KEY), ("X-Aenv-Forwarded-By", "n3")];

#[test]
fn asked_on_behalf_of_another_a_node_lists_its_own_sandboxes_alone() {
    let (n, _turn) = on_shared_cluster();
    let (a, b) = (&n.pair.a, &n.pair.b);
    let (code, text) = get_with(n.c.node("n2"), "/v2/sandboxes", &ON_BEHALF_OF_N3);
    assert_eq!(code, 200, "{text}");
    assert!(text.contains(b) && !text.contains(a), "{text}");
}

/// Templates asked of a node: each id once, every node's.
#[test]
fn template_lists_hold_every_nodes_templates_once() {
    let (n, _turn) = on_shared_cluster();
    let c = &n.c;
    for path in ["/templates", "/v2/templates"] {
        let (merged, _) = listed(c.node("n1"), path, "templateID");
        let mut union = Vec::new();
        for name in NODES {
            let (code, text) = get_with(c.node(name), path, &ON_BEHALF_OF_N3);
            assert_eq!(code, 200, "{text}");
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            for t in v.as_array().unwrap() {
                union.push(t["templateID"].as_str().unwrap().to_string());
            }
        }
        union.sort();
        union.dedup();
        assert_eq!(sorted(merged.clone()), union, "{path}");
        assert_eq!(merged.len(), union.len(), "{path} lists a template twice");
    }
}

/// Metrics of ids on two nodes, asked of each node (n3 owns neither).
#[test]
fn sandbox_metrics_of_ids_on_two_nodes_are_answered_by_every_node() {
    let (n, _turn) = on_shared_cluster();
    let (c, a, b, both) = (&n.c, &n.pair.a, &n.pair.b, n.pair.both());
    must(Duration::from_secs(30), "no samples of both", || {
        sampled(c.node("n3"), &[a, b]) == both
    });
    assert_eq!(sampled(c.node("n1"), &[a, b]), both);
    assert_eq!(sampled(c.node("n2"), &[a, b]), both);
}

/// n3 stopped (SIGSTOP: it takes connections and never answers): lists via n1 wait for it
/// only up to the peer timeout (2 s), then answer without it.
#[test]
fn lists_via_a_node_leave_out_a_stopped_node_once_the_peer_timeout_passed() {
    let (n, _turn) = on_shared_cluster();
    let (c, both) = (&n.c, n.pair.both());
    let left_out = "op=cluster_merge node=n3 path=/v2/sandboxes";
    let logged_before = c.node("n1").log().matches(left_out).count();
    let n3 = c.node("n3").child.as_ref().unwrap().id().to_string();
    stop_process(n3.parse().unwrap());
    // The list answers while n3 is still stopped (it never answers until SIGCONT
    // below), so n1 gave up on n3 by its peer timeout rather than waiting for it; the
    // log says why it left n3 out. No wall-clock bound: the event is the answer.
    let (v2, _) = listed(c.node("n1"), "/v2/sandboxes", "sandboxID");
    run("kill", &["-CONT", &n3]);
    assert_eq!(sorted(v2), both);
    let log = c.node("n1").log();
    assert!(
        log.matches(left_out).count() > logged_before,
        "n1 did not log leaving n3 out:\n{}",
        sdk::tail(&log, 40)
    );
    // The next test finds the cluster whole again.
    must(Duration::from_secs(20), "n1 never found n3 again", || {
        knows(c.node("n1"), "n3")
    });
}

/// n2 SIGKILLed: its sandbox is left out of lists via any node, its metrics too; counted
/// and logged, and once n1 marked it silent, left out without asking. Restarted, n2's
/// recovery removes its lost sandbox; nothing is left anywhere.
#[test]
fn a_killed_nodes_sandboxes_and_metrics_are_left_out_of_lists_counted_and_logged() {
    let _alone = SHARED.alone();
    let _one = serial();
    {
        let mut c = Cluster::start();
        all_know_each_other(&c);
        let Pair { a, b, .. } = Pair::make(&c);
        c.node_mut("n2").crash();
        let (v2, _) = listed(c.node("n1"), "/v2/sandboxes", "sandboxID");
        assert_eq!(v2, [a.as_str()]);
        let (v1, _) = listed(c.node("n3"), "/sandboxes", "sandboxID");
        assert_eq!(v1, [a.as_str()]);
        assert_eq!(sampled(c.node("n3"), &[&a, &b]), [a.as_str()]);
        let unreachable = "agentenv_cluster_list_partial_total{node=\"n2\",reason=\"unreachable\"}";
        let silent = "agentenv_cluster_list_partial_total{node=\"n2\",reason=\"silent\"}";
        let left = |s: &Server| metric(s, unreachable) + metric(s, silent);
        assert!(left(c.node("n1")) >= 1 && left(c.node("n3")) >= 2);
        assert!(c.node("n3").log().contains("op=cluster_merge node=n2"));
        must(Duration::from_secs(20), "n1 never marked n2 silent", || {
            !knows(c.node("n1"), "n2")
        });
        let before = metric(c.node("n1"), silent);
        assert_eq!(
            listed(c.node("n1"), "/v2/sandboxes", "sandboxID").0,
            [a.as_str()]
        );
        assert_eq!(metric(c.node("n1"), silent), before + 1);

        // Restarted, n2's recovery removes its lost sandbox; nothing is left anywhere.
        c.node_mut("n2").spawn();
        delete(c.node("n3"), &a);
        must(Duration::from_secs(30), "lists never emptied", || {
            listed(c.node("n1"), "/v2/sandboxes", "sandboxID")
                .0
                .is_empty()
        });
        stop_all_leaving_nothing(&mut c);
    }
    let left = host_leftovers();
    assert!(left.is_empty(), "the harness left {left:?}");
}

/// The alias of the one template the placement test builds.
const ALIAS: &str = "cluster-app";

/// The sum of `agentenv_cluster_forwarded_total{node=<peer>,result="answered"}` over
/// the other nodes in `s`'s `/metrics`.
fn answered_by_peers(s: &Server, this: &str) -> u64 {
    NODES
        .iter()
        .filter(|n| **n != this)
        .map(|n| {
            metric(
                s,
                &format!("agentenv_cluster_forwarded_total{{node=\"{n}\",result=\"answered\"}}"),
            )
        })
        .sum()
}

/// `POST /sandboxes` from `template` on `s` with extra headers: (status, answer).
fn create_with(s: &Server, template: &str, headers: &[(&str, &str)]) -> (u16, serde_json::Value) {
    let mut req = ureq::post(&format!("{}/sandboxes", s.base))
        .set("X-API-Key", API_KEY)
        .timeout(Duration::from_secs(180));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    match req.send_json(json!({"templateID": template, "timeout": 600})) {
        Ok(r) => (r.status(), r.into_json().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or_default()),
        Err(e) => panic!("POST /sandboxes on {}: {e}", s.base),
    }
}

/// Waits until every node's peer table has every other node.
fn all_know_each_other(c: &Cluster) {
    for a in NODES {
        for b in NODES.iter().filter(|b| **b != a) {
            must(
                Duration::from_secs(20),
                &format!("{a} never found {b}"),
                || knows(c.node(a), b),
            );
        }
    }
}

/// Builds [`ALIAS`] once with the python SDK through HAProxy; its template id, after
/// checking every node has it under that id and every node's peers list it.
fn build_everywhere(c: &Cluster) -> String {
    all_know_each_other(c);
    let lines = common::sdk::run_sdk_with(
        &c.lb,
        &common::sdk::sdk_tools().0,
        "cluster_template.py",
        None,
        &[
            ("AENV_TEST_IMAGE", &base_image()),
            ("AENV_TEST_ALIAS", ALIAS),
        ],
    );
    let id = lines
        .iter()
        .find_map(|l| l.split("ok template ").nth(1))
        .unwrap_or_else(|| panic!("no template id in {lines:?}"))
        .to_string();
    for name in NODES {
        // Each node built it from the same steps: ready there under the same id.
        must(
            Duration::from_secs(300),
            &format!("{name} never had {ALIAS} ready"),
            || {
                card(c.node(name))["templates"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|t| t["alias"] == ALIAS)
            },
        );
        let (code, v) = c
            .node(name)
            .call("GET", &format!("/templates/aliases/{ALIAS}"), None);
        assert_eq!(
            (code, v["templateID"].as_str()),
            (200, Some(id.as_str())),
            "{name}: {v}"
        );
    }
    for name in NODES {
        must(
            Duration::from_secs(20),
            &format!("{name}'s peers never listed {ALIAS}"),
            || {
                let peers = card(c.node(name))["peers"].as_array().unwrap().clone();
                peers.len() == 2 && peers.iter().all(|p| p["templates"] == 1)
            },
        );
    }
    id
}

#[test]
fn a_template_built_once_serves_creates_on_every_node_and_a_full_node_places_them() {
    let _alone = SHARED.alone();
    let _one = serial();
    {
        // n1's admission holds one 256 MiB sandbox (and the 256 MiB build VM) at most.
        let mut c = Cluster::start_with(&[("n1", "[admission]\nmax_memory_mb = 300\n")]);
        let template = build_everywhere(&c);

        // A dozen creates through HAProxy: all succeed, on more than one node, none
        // beyond n1's room; each answer names its node.
        let mut owned: Vec<(String, String)> = Vec::new();
        for i in 0..12 {
            let (code, v) = create_with(&c.lb, ALIAS, &[]);
            assert_eq!(code, 201, "create {i}: {v}");
            let (id, node) = (id_of(&v), v["clientID"].as_str().unwrap().to_string());
            assert!(id.ends_with(&format!("-{node}")), "{id} names {node}");
            owned.push((node, id));
        }
        let on = |n: &str| owned.iter().filter(|(node, _)| node == n).count();
        assert!(on("n1") <= 1, "n1 holds {} sandboxes: {owned:?}", on("n1"));
        assert!(on("n2") > 0 && on("n3") > 0, "creates landed on {owned:?}");
        assert_eq!(card(c.node("n1"))["capacity"]["running"], on("n1"));
        // The template's files and steps are in a sandbox of each node.
        for n in ["n2", "n3"] {
            let id = &owned.iter().find(|(node, _)| node == n).unwrap().1;
            let out = sh(&c.lb, id, "cat /srv/marker.txt /srv/built");
            assert_eq!(out, "copied through the cluster\nbuilt\n", "{n}");
        }

        // n1 full: a create it gets goes to a node with room, and n1 counts it.
        if on("n1") == 0 {
            let v = c.node("n1").create_from(ALIAS, 600);
            owned.push(("n1".to_string(), v));
        }
        let before = answered_by_peers(c.node("n1"), "n1");
        let (code, v) = create_with(c.node("n1"), ALIAS, &[]);
        assert_eq!(code, 201, "{v}");
        let node = v["clientID"].as_str().unwrap().to_string();
        assert_ne!(node, "n1", "{v}");
        owned.push((node, id_of(&v)));
        assert_eq!(answered_by_peers(c.node("n1"), "n1"), before + 1);
        // A create forwarded once is served or refused where it arrives: n1 has no room.
        let (code, v) = create_with(c.node("n1"), ALIAS, &[("X-Aenv-Forwarded-By", "n2")]);
        assert_eq!(code, 429, "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("max_memory_mb"),
            "{v}"
        );
        assert_eq!(answered_by_peers(c.node("n1"), "n1"), before + 1);

        // The python SDK through HAProxy, as a user: creates from the template on more
        // than one node, commands, files and a PTY on each, one list of all, pause and
        // resume on each node (tests/sdk/cluster.py).
        let lines = common::sdk::run_sdk_with(
            &c.lb,
            &common::sdk::sdk_tools().0,
            "cluster.py",
            None,
            &[("AENV_SDK_TEMPLATE", ALIAS), ("AENV_CLUSTER_CREATES", "6")],
        );
        for want in [
            "land on more than one node",
            "Sandbox.list shows every node",
            "resume on n",
        ] {
            assert!(lines.iter().any(|l| l.contains(want)), "{want}: {lines:?}");
        }

        for (node, id) in &owned {
            delete(c.node(node), id);
        }
        // Deleted through n2: gone on every node, its alias too.
        let (code, v) = c
            .node("n2")
            .call("DELETE", &format!("/templates/{ALIAS}"), None);
        assert_eq!(code, 204, "{v}");
        for name in NODES {
            let s = c.node(name);
            assert_eq!(
                s.call("GET", &format!("/templates/{template}"), None).0,
                404,
                "{name}"
            );
            let (code, _) = s.call("GET", &format!("/templates/aliases/{ALIAS}"), None);
            assert_eq!(code, 404, "{name}");
            assert_eq!(card(s)["templates"], json!([]), "{name}");
        }
        let (code, v) = create_with(&c.lb, ALIAS, &[]);
        assert!(
            code == 400 || code == 404,
            "a create from the deleted template: {code} {v}"
        );
        stop_all_leaving_nothing(&mut c);
    }
    let left = host_leftovers();
    assert!(left.is_empty(), "the harness left {left:?}");
}
