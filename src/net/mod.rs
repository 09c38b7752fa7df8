//! Network slots (network.md): one namespace per running sandbox, linked to the host by a
//! veth pair, with a tap for the VM, a per-slot nftables table, a warm pool, startup
//! reclaim of leftovers and the root-namespace table.
//!
//! Entry point: [`SlotManager`]. Host calls go through the [`host::NetHost`] trait so the
//! rollback paths are tested with a recording fake.

pub mod dns;
pub mod filter;
mod firewall;
mod host;
mod layout;
mod manager;
mod slot;

#[cfg(test)]
mod real_tests;

pub use firewall::{EgressRules, MAX_GUEST_CONNECTIONS};
pub use layout::{
    SlotLayout, GUEST_GATEWAY, GUEST_IP, GUEST_MAC, GUEST_NFS_PORT, TAP_MAC, TAP_NAME,
};
pub use manager::{SlotManager, SlotStats};
#[cfg(test)]
pub(crate) use slot::tests::FakeHost;
pub use slot::{EgressCounts, Slot};

use crate::sys::SysError;
use std::fmt;

/// Errors of the network slot module.
#[derive(Debug)]
pub enum NetError {
    /// Every index up to `max_slots` is in use and the pool is empty.
    NoFreeSlot { max_slots: u32 },
    /// A system call failed.
    Sys(SysError),
    /// Loading an nftables ruleset failed (message includes nft's output).
    Firewall(String),
    /// The manager has been shut down.
    ShuttingDown,
}

impl fmt::Display for NetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetError::NoFreeSlot { max_slots } => {
                write!(f, "no free network slot (max_slots={max_slots})")
            }
            NetError::Sys(e) => write!(
                f,
                "network slot setup failed: {e}; agentenv needs root (CAP_NET_ADMIN, \
                 CAP_SYS_ADMIN) and the veth, tun and nf_tables kernel features"
            ),
            NetError::Firewall(m) => write!(
                f,
                "loading the nftables ruleset failed: {m}; check that the nft binary \
                 (package nftables) is installed and the kernel has nf_tables and nf_nat"
            ),
            NetError::ShuttingDown => write!(f, "the network slot manager is shutting down"),
        }
    }
}

impl std::error::Error for NetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NetError::Sys(e) => Some(e),
            _ => None,
        }
    }
}

/// The resolver a fresh guest is given (its `/etc/resolv.conf`): the DNS forwarder on
/// its gateway when guests may reach out and the host names a resolver (network.md §5.5).
pub fn guest_dns(cfg: &crate::config::NetworkConfig) -> Option<std::net::Ipv4Addr> {
    (cfg.outbound && !dns::upstream_resolvers(cfg).is_empty()).then_some(GUEST_GATEWAY)
}

impl From<SysError> for NetError {
    fn from(e: SysError) -> NetError {
        NetError::Sys(e)
    }
}
