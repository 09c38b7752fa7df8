//! Names and addresses of slot n (network.md §2.3).

use crate::config::Cidr;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// The guest's `eth0` address, the same in every slot.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
/// The guest's gateway: `tap0`'s address, the same in every slot.
pub const GUEST_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// The port of the NFS server that serves a sandbox's volumes on its gateway, inside its
/// slot (docs/operations.md §11); nothing listens there for a sandbox without volumes.
pub const GUEST_NFS_PORT: u16 = 2049;
/// Prefix length of the guest link.
pub const GUEST_PREFIX: u8 = 30;
/// The guest NIC's MAC.
pub const GUEST_MAC: [u8; 6] = [0x06, 0x00, 0xa9, 0xfe, 0x00, 0x15];
/// `tap0`'s MAC.
pub const TAP_MAC: [u8; 6] = [0x06, 0x00, 0xa9, 0xfe, 0x00, 0x16];
/// Name of the tap inside every slot namespace.
pub const TAP_NAME: &str = "tap0";
/// Name of the namespace end of the veth.
pub const VETH_NS_NAME: &str = "veth0";
/// Prefix of namespace file names.
pub const NS_FILE_PREFIX: &str = "agentenv-ns-";
/// Prefix of host-end veth names.
pub const LINK_PREFIX: &str = "aenv-";

/// Everything that identifies slot `index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotLayout {
    pub index: u32,
    /// `<netns_dir>/agentenv-ns-<n>`.
    pub ns_path: PathBuf,
    /// `hostInteractionIp`: host network + n.
    pub host_ip: Ipv4Addr,
    /// `aenv-<n>`.
    pub link_name: String,
    /// Host end of the veth: veth network + 2n, /31.
    pub link_addr: Ipv4Addr,
    /// Namespace end (`veth0`): veth network + 2n + 1, /31.
    pub veth_addr: Ipv4Addr,
}

impl SlotLayout {
    pub fn new(netns_dir: &Path, host: Cidr, veth: Cidr, index: u32) -> SlotLayout {
        SlotLayout {
            index,
            ns_path: netns_dir.join(format!("{NS_FILE_PREFIX}{index}")),
            host_ip: host.nth(index),
            link_name: format!("{LINK_PREFIX}{index}"),
            link_addr: veth.nth(index.wrapping_mul(2)),
            veth_addr: veth.nth(index.wrapping_mul(2).wrapping_add(1)),
        }
    }
}

/// The index in a name `<prefix><digits>`, if it has that exact shape.
pub fn parse_index(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_slot_7_and_300() {
        let host = Cidr::parse("198.18.0.0/16").unwrap();
        let veth = Cidr::parse("198.19.0.0/16").unwrap();
        let l = SlotLayout::new(Path::new("/var/run/netns"), host, veth, 7);
        assert_eq!(l.ns_path, Path::new("/var/run/netns/agentenv-ns-7"));
        assert_eq!(l.host_ip, Ipv4Addr::new(198, 18, 0, 7));
        assert_eq!(l.link_name, "aenv-7");
        assert_eq!(l.link_addr, Ipv4Addr::new(198, 19, 0, 14));
        assert_eq!(l.veth_addr, Ipv4Addr::new(198, 19, 0, 15));
        let l = SlotLayout::new(Path::new("/x"), host, veth, 300);
        assert_eq!(l.host_ip, Ipv4Addr::new(198, 18, 1, 44));
    }

    #[test]
    fn index_parsing_is_strict() {
        assert_eq!(parse_index("agentenv-ns-12", NS_FILE_PREFIX), Some(12));
        assert_eq!(parse_index("agentenv-ns-", NS_FILE_PREFIX), None);
        assert_eq!(parse_index("agentenv-ns-1a", NS_FILE_PREFIX), None);
        assert_eq!(parse_index("aenv-+3", LINK_PREFIX), None);
        assert_eq!(parse_index("other", LINK_PREFIX), None);
    }
}
