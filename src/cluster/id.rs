//! Sandbox ids that name their node (docs/cluster.md, "Ids").
//!
//! A single node's sandbox id is a UUIDv7 (api.md §1.5). A cluster node's is
//! `<uuidv7>-<node>`: any node tells a sandbox's owner from its id alone, with no table
//! to keep in sync. The form fits a DNS label with a port in front
//! (`49983-<id>.<domain>`: at most 5 + 1 + 36 + 1 + 16 = 59 of 63 bytes), and the E2B
//! SDKs treat ids as opaque strings.

use crate::util::is_uuid;
use std::sync::OnceLock;

/// The longest node name.
pub const MAX_NODE_NAME: usize = 16;

/// This process's node, set once at startup when `[cluster] node` is configured.
static NODE: OnceLock<String> = OnceLock::new();

/// Whether `s` is a node name: 1–16 of `[a-z0-9-]`.
pub fn is_node_name(s: &str) -> bool {
    (1..=MAX_NODE_NAME).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Makes new sandbox ids carry `node` (startup, once). A second call with another name
/// is refused: ids already handed out name the first.
pub fn set_node(node: &str) -> Result<(), String> {
    let set = NODE.get_or_init(|| node.to_string());
    if set == node {
        Ok(())
    } else {
        Err(format!(
            "this process already names its sandboxes for node {set}"
        ))
    }
}

/// This process's node name, when it is a cluster node.
pub fn this_node() -> Option<&'static str> {
    NODE.get().map(String::as_str)
}

/// A fresh sandbox id: a UUIDv7, followed by `-<node>` on a cluster node.
pub fn new_sandbox_id() -> String {
    compose(&crate::util::new_id(), this_node())
}

fn compose(uuid: &str, node: Option<&str>) -> String {
    match node {
        Some(node) => format!("{uuid}-{node}"),
        None => uuid.to_string(),
    }
}

/// Whether `s` has the form of a sandbox id: a UUID, optionally followed by `-<node>`.
pub fn is_sandbox_id(s: &str) -> bool {
    match s.get(..36) {
        Some(uuid) if is_uuid(uuid) => match s.get(36..) {
            Some("") => true,
            Some(rest) => rest.strip_prefix('-').is_some_and(is_node_name),
            None => false,
        },
        _ => false,
    }
}

/// The node a sandbox id names; `None` for a single node's plain UUID (or no id).
pub fn node_of(id: &str) -> Option<&str> {
    is_sandbox_id(id)
        .then(|| id.get(37..))
        .flatten()
        .filter(|n| !n.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "01900000-0000-7000-8000-000000000000";

    #[test]
    fn node_names() {
        for ok in ["n1", "a", "node-2", "0123456789abcdef"] {
            assert!(is_node_name(ok), "{ok}");
        }
        for bad in ["", "N1", "n_1", "n.1", "0123456789abcdefg", "nó"] {
            assert!(!is_node_name(bad), "{bad}");
        }
    }

    #[test]
    fn ids_with_and_without_node() {
        let plain = compose(UUID, None);
        assert_eq!(plain, UUID);
        assert!(is_sandbox_id(&plain));
        assert_eq!(node_of(&plain), None);
        let id = compose(UUID, Some("node-2"));
        assert_eq!(id, format!("{UUID}-node-2"));
        assert!(is_sandbox_id(&id));
        assert_eq!(node_of(&id), Some("node-2"));
        // Fits a DNS label with a port in front.
        let longest = compose(UUID, Some("0123456789abcdef"));
        assert!(format!("49983-{longest}").len() <= 63);
        for bad in [
            "",
            "not-a-uuid",
            &format!("{UUID}-"),
            &format!("{UUID}x"),
            &format!("{UUID}-N1"),
            &format!("{UUID}-0123456789abcdefg"),
            &format!("{UUID}-n1/x"),
            &UUID[..35],
        ] {
            assert!(!is_sandbox_id(bad), "{bad}");
            assert_eq!(node_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn fresh_ids_are_sandbox_ids() {
        let id = new_sandbox_id();
        assert!(is_sandbox_id(&id));
        assert_eq!(node_of(&id), this_node());
    }
}
