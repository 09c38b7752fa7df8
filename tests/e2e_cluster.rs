//! End-to-end, issue 22: three agentenv nodes behind HAProxy on one machine, each a host
//! of its own (tests/common/cluster.rs: its own network and mount namespaces, state dir,
//! `/run/netns`, `/run/agentenv` and nftables), HAProxy running deploy/haproxy/haproxy.cfg
//! as it is. Creates through HAProxy spread over the nodes and their ids name the node; a
//! command runs on each; a node SIGKILLed fails HAProxy's health check, leaves no QEMU, and
//! creates go on on the others; restarted, it passes the check again and takes creates;
//! at the end nothing is left on any node nor on the host.

mod common;

use common::cluster::*;
use common::*;
use serde_json::json;
use std::collections::btree_map::{BTreeMap, Entry};
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

#[test]
fn three_nodes_behind_haproxy_spread_creates_and_survive_a_killed_node() {
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
        for name in NODES {
            c.node_mut(name).stop();
            let left = c.node_leftovers(name);
            assert!(left.is_empty(), "{name} left {left:?}");
        }
    }
    let left = host_leftovers();
    assert!(left.is_empty(), "the harness left {left:?}");
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
}
