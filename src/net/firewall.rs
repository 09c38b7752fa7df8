//! nftables rulesets: the per-slot table `ip agentenv` (network.md §5.1) and the root
//! table `inet agentenv` (§5.2, §5.4). Pure text generation; loading is in `host`.

use super::layout::{SlotLayout, GUEST_IP, LINK_PREFIX, TAP_NAME, VETH_NS_NAME};
use crate::config::{Cidr, NetworkConfig};
use std::fmt::Write;
use std::net::Ipv4Addr;

/// What the rulesets depend on, derived once from the config.
#[derive(Debug, Clone)]
pub(crate) struct FirewallPolicy {
    pub outbound: bool,
    pub host_cidr: Cidr,
    /// Denied destinations for outbound traffic, minimal (no CIDR inside another).
    pub denied: Vec<Cidr>,
    pub dns: Option<Ipv4Addr>,
}

impl FirewallPolicy {
    pub fn from_config(cfg: &NetworkConfig) -> FirewallPolicy {
        let mut all: Vec<Cidr> = cfg
            .outbound_denied_cidrs
            .iter()
            .filter_map(|c| Cidr::parse(c))
            .collect();
        all.push(cfg.host_cidr());
        all.push(cfg.veth_cidr());
        FirewallPolicy {
            outbound: cfg.outbound,
            host_cidr: cfg.host_cidr(),
            denied: minimal_cidrs(all),
            dns: guest_dns(cfg),
        }
    }

    fn denied_set(&self) -> String {
        let items: Vec<String> = self.denied.iter().map(|c| c.to_string()).collect();
        format!("{{ {} }}", items.join(", "))
    }
}

/// Drops every CIDR contained in another one: nftables refuses overlapping intervals in
/// one set.
fn minimal_cidrs(mut v: Vec<Cidr>) -> Vec<Cidr> {
    v.sort_by_key(|c| (c.prefix, u32::from(c.addr)));
    let mut out: Vec<Cidr> = Vec::new();
    for c in v {
        if !out.iter().any(|o| o.overlaps(&c)) {
            out.push(c);
        }
    }
    out.sort_by_key(|c| u32::from(c.addr));
    out
}

/// The resolver given to guests (§5.5): `[network] dns`, else the first non-loopback
/// `nameserver` of `/run/systemd/resolve/resolv.conf`, else of `/etc/resolv.conf`.
pub fn guest_dns(cfg: &NetworkConfig) -> Option<Ipv4Addr> {
    if !cfg.dns.is_empty() {
        return cfg.dns.parse().ok();
    }
    ["/run/systemd/resolve/resolv.conf", "/etc/resolv.conf"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|text| first_nameserver(&text))
}

fn first_nameserver(text: &str) -> Option<Ipv4Addr> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some("nameserver"))
            .then(|| w.next()?.parse::<Ipv4Addr>().ok())
            .flatten()
            .filter(|a| !a.is_loopback())
    })
}

/// The slot's table, loaded inside its namespace.
pub(crate) fn slot_ruleset(l: &SlotLayout, p: &FirewallPolicy) -> String {
    let host = l.host_ip;
    let mut s = String::new();
    let _ = write!(
        s,
        "table ip agentenv {{\n\
         \tchain prerouting {{\n\
         \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
         \t\tiifname \"{VETH_NS_NAME}\" ip daddr {host} dnat to {GUEST_IP}\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{VETH_NS_NAME}\" ip saddr {GUEST_IP} snat to {host}\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{TAP_NAME}\" ct state new drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy drop;\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"{TAP_NAME}\" ip saddr != {GUEST_IP} drop\n\
         \t\tiifname \"{VETH_NS_NAME}\" oifname \"{TAP_NAME}\" ct state new ip saddr {} ip daddr {GUEST_IP} accept\n",
        l.link_addr
    );
    if p.outbound {
        let from = format!("iifname \"{TAP_NAME}\" oifname \"{VETH_NS_NAME}\" ct state new");
        if let Some(dns) = p.dns {
            let _ = writeln!(s, "\t\t{from} ip daddr {dns} udp dport 53 accept");
            let _ = writeln!(s, "\t\t{from} ip daddr {dns} tcp dport 53 accept");
        }
        let _ = writeln!(s, "\t\t{from} ip daddr {} drop", p.denied_set());
        let _ = writeln!(s, "\t\t{from} accept");
    }
    s.push_str("\t}\n}\n");
    s
}

/// The root namespace's table, replacing any earlier copy in one transaction.
pub(crate) fn root_ruleset(p: &FirewallPolicy) -> String {
    let a = format!("\"{LINK_PREFIX}*\"");
    let mut s = String::from("table inet agentenv\ndelete table inet agentenv\n");
    let _ = write!(
        s,
        "table inet agentenv {{\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname {a} ct state established,related accept\n\
         \t\tiifname {a} drop\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname {a} oifname {a} drop\n\
         \t\toifname {a} ct state established,related accept\n\
         \t\toifname {a} drop\n"
    );
    if p.outbound {
        let _ = writeln!(s, "\t\tiifname {a} ct state established,related accept");
        let _ = writeln!(s, "\t\tiifname {a} meta nfproto ipv6 drop");
        if let Some(dns) = p.dns {
            let _ = writeln!(s, "\t\tiifname {a} ip daddr {dns} udp dport 53 accept");
            let _ = writeln!(s, "\t\tiifname {a} ip daddr {dns} tcp dport 53 accept");
        }
        let _ = writeln!(s, "\t\tiifname {a} ip daddr {} drop", p.denied_set());
        let _ = writeln!(s, "\t\tiifname {a} accept");
    } else {
        let _ = writeln!(s, "\t\tiifname {a} drop");
    }
    s.push_str("\t}\n");
    if p.outbound {
        let _ = write!(
            s,
            "\tchain postrouting {{\n\
             \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
             \t\tip saddr {} oifname != {a} masquerade\n\
             \t}}\n",
            p.host_cidr
        );
    }
    s.push_str("}\n");
    s
}

/// Removes the root table whether or not it exists.
pub(crate) const ROOT_REMOVE: &str = "table inet agentenv\ndelete table inet agentenv\n";

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn policy(outbound: bool) -> FirewallPolicy {
        let cfg = crate::config::Config::from_sources(None, &[])
            .unwrap()
            .network;
        let mut p = FirewallPolicy::from_config(&cfg);
        p.outbound = outbound;
        p.dns = Some(Ipv4Addr::new(10, 0, 0, 2));
        p
    }

    #[test]
    fn denied_set_is_minimal() {
        let p = policy(true);
        let d: Vec<String> = p.denied.iter().map(|c| c.to_string()).collect();
        // 198.18.0.0/16 and 198.19.0.0/16 fall inside 198.18.0.0/15.
        assert!(d.contains(&"198.18.0.0/15".to_string()), "{d:?}");
        assert!(!d.contains(&"198.18.0.0/16".to_string()), "{d:?}");
        assert_eq!(d.len(), 9, "{d:?}");
    }

    #[test]
    fn slot_ruleset_off_and_on() {
        let host = Cidr::parse("198.18.0.0/16").unwrap();
        let veth = Cidr::parse("198.19.0.0/16").unwrap();
        let l = SlotLayout::new(Path::new("/x"), host, veth, 7);
        let off = slot_ruleset(&l, &policy(false));
        assert!(off.contains("ip daddr 198.18.0.7 dnat to 169.254.0.21"));
        assert!(off.contains("snat to 198.18.0.7"));
        assert!(off.contains("ip saddr 198.19.0.14 ip daddr 169.254.0.21 accept"));
        assert!(!off.contains("oifname \"veth0\" ct state new accept"));
        let on = slot_ruleset(&l, &policy(true));
        assert!(on.contains("ip daddr 10.0.0.2 udp dport 53 accept"));
        assert!(on.contains("iifname \"tap0\" oifname \"veth0\" ct state new accept"));
    }

    #[test]
    fn root_ruleset_off_and_on() {
        let off = root_ruleset(&policy(false));
        assert!(off.starts_with("table inet agentenv\ndelete table inet agentenv\n"));
        assert!(!off.contains("masquerade"));
        let on = root_ruleset(&policy(true));
        assert!(on.contains("ip saddr 198.18.0.0/16 oifname != \"aenv-*\" masquerade"));
    }

    #[test]
    fn nameserver_parsing_skips_loopback() {
        let t = "# c\nnameserver 127.0.0.53\nnameserver 192.0.2.1\n";
        assert_eq!(first_nameserver(t), Some(Ipv4Addr::new(192, 0, 2, 1)));
        assert_eq!(first_nameserver("search x\n"), None);
    }
}
