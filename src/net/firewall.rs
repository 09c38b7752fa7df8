//! nftables rulesets: the per-slot table `ip agentenv` (network.md §5.1) and the root
//! table `inet agentenv` (§5.2, §5.4). Pure text generation; loading is in `host`.

use super::filter::{HTTP_FILTER_PORT, TLS_FILTER_PORT};
use super::layout::{
    SlotLayout, GUEST_GATEWAY, GUEST_IP, GUEST_NFS_PORT, LINK_PREFIX, TAP_NAME, VETH_NS_NAME,
};
use crate::config::{Cidr, NetworkConfig};
use std::fmt::Write;

/// What the rulesets depend on, derived once from the config.
#[derive(Debug, Clone)]
pub(crate) struct FirewallPolicy {
    pub outbound: bool,
    pub host_cidr: Cidr,
    /// Never reachable from a guest, whatever any allow list says: the host interaction
    /// and veth ranges (other sandboxes and the host's slot ends).
    pub always_denied: Vec<Cidr>,
    /// `outbound_denied_cidrs` (with the ranges above), minimal (no CIDR inside another).
    pub denied: Vec<Cidr>,
    /// `outbound_allowed_cidrs`: the operator's exceptions to `denied`.
    pub allowed: Vec<Cidr>,
    /// The DNS forwarder's UDP port in the root namespace (§5.5), when it runs.
    pub dns_port: Option<u16>,
}

impl FirewallPolicy {
    pub fn from_config(cfg: &NetworkConfig) -> FirewallPolicy {
        let parse =
            |v: &[String]| -> Vec<Cidr> { v.iter().filter_map(|c| Cidr::parse(c)).collect() };
        let always = minimal_cidrs(vec![cfg.host_cidr(), cfg.veth_cidr()]);
        let mut all = parse(&cfg.outbound_denied_cidrs);
        all.extend(always.iter().copied());
        FirewallPolicy {
            outbound: cfg.outbound,
            host_cidr: cfg.host_cidr(),
            always_denied: always,
            denied: minimal_cidrs(all),
            allowed: minimal_cidrs(parse(&cfg.outbound_allowed_cidrs)),
            dns_port: None,
        }
    }

    /// Whether the server's own rules (§5.4) refuse a guest connection to `ip`, checked
    /// again by the domain filter on the addresses it resolves: the always-denied ranges,
    /// the guest link itself, and the denied ranges unless the operator allowed them.
    pub fn refuses(&self, ip: std::net::Ipv4Addr) -> bool {
        let guest_link = Cidr {
            addr: GUEST_IP,
            prefix: 30,
        };
        let has = |v: &[Cidr]| v.iter().any(|c| c.contains(ip));
        guest_link.contains(ip)
            || has(&self.always_denied)
            || (has(&self.denied) && !has(&self.allowed))
    }

    /// The outbound rules after `from` (a match on the guest's new connections): the
    /// always-denied ranges, the denied ones unless allowed, the sandbox's own chain
    /// (`jump`), then accept.
    /// `drop` is the verdict statement for the protected destinations (in the slot, a
    /// jump to its counted refusal).
    fn outbound_rules(&self, s: &mut String, from: &str, jump: Option<&str>, drop: &str) {
        let _ = writeln!(
            s,
            "\t\t{from} ip daddr {} {drop}",
            set_of(&self.always_denied)
        );
        if self.allowed.is_empty() {
            let _ = writeln!(s, "\t\t{from} ip daddr {} {drop}", set_of(&self.denied));
        } else {
            let _ = writeln!(
                s,
                "\t\t{from} ip daddr != {} ip daddr {} {drop}",
                set_of(&self.allowed),
                set_of(&self.denied)
            );
        }
        if let Some(chain) = jump {
            let _ = writeln!(s, "\t\t{from} jump {chain}");
        }
        let _ = writeln!(s, "\t\t{from} accept");
    }
}

/// Most connections one guest may have tracked at once (a per-sandbox conntrack limit):
/// beyond it new outbound connections are dropped, so a guest opening connections as fast
/// as it can does not fill the host's table.
pub const MAX_GUEST_CONNECTIONS: u32 = 8192;

/// Name of the per-sandbox chain in the slot's table (network.md §5.6).
const EGRESS_CHAIN: &str = "egress";
/// Named counters of the slot's table (network.md §5.8): bytes the guest sent out; new
/// outbound connections refused by the sandbox's policy (`denyOut`, no internet access,
/// the connection limit); new connections to what is always refused (the slot itself,
/// other sandboxes, the denied ranges).
pub(crate) const EGRESS_BYTES: &str = "egress_bytes";
pub(crate) const REFUSED: &str = "refused";
pub(crate) const REFUSED_PROTECTED: &str = "refused_protected";
/// The slot's verdict for a guest's new connection its policy refuses: counted, then
/// rejected (a TCP reset, else ICMP admin-prohibited), so a client fails at once and does
/// not retry: one refused connection counts once.
pub(crate) const REFUSE: &str = "jump refuse";
/// The same for a destination that is always refused, counted apart.
const REFUSE_PROTECTED: &str = "jump refuse_protected";
/// The root table's set of per-slot refusals of host addresses (§5.8): one element per
/// slot's host interaction address (the source of its guest's packets after the slot's
/// SNAT), each with its own counter.
pub(crate) const ROOT_REFUSALS_SET: &str = "refused_protected";

/// A chain that counts a refusal in `counter` and rejects it (ip family).
fn refusal_chain(chain: &str, counter: &str) -> String {
    format!(
        "\tchain {chain} {{\n\
         \t\tcounter name \"{counter}\"\n\
         \t\tmeta l4proto tcp reject with tcp reset\n\
         \t\treject with icmp type admin-prohibited\n\
         \t}}\n"
    )
}

/// Forgets the root table's refusal count of the slot at `host_ip`, whether or not it
/// has one (adding an element that exists is no error; the delete then removes it).
pub(crate) fn forget_root_refusals(host_ip: std::net::Ipv4Addr) -> String {
    format!(
        "add element inet agentenv {ROOT_REFUSALS_SET} {{ {host_ip} }}\n\
         delete element inet agentenv {ROOT_REFUSALS_SET} {{ {host_ip} }}\n"
    )
}

/// Name of the per-sandbox NAT chain that hands connections to the domain filter (§5.7).
const EGRESS_NAT_CHAIN: &str = "egress_nat";

/// One sandbox's own egress policy (E2B's `allowOut` / `denyOut`), applied after the
/// server's rules: it can only narrow them. Allowed entries win over denied ones.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EgressRules {
    pub allow: Vec<Cidr>,
    pub deny: Vec<Cidr>,
    /// `allowOut` domain entries (`example.com`, `*.example.com`), lower case.
    pub domains: Vec<String>,
}

impl EgressRules {
    /// Whether connections need the domain filter: domains allowed, and something
    /// denied that they could open.
    pub fn filters(&self) -> bool {
        !self.domains.is_empty() && !self.deny.is_empty()
    }

    /// The transaction that replaces the slot's `egress` and `egress_nat` chains,
    /// atomically. With domains, new TCP connections to ports 80 and 443 of denied
    /// destinations (not allowed by CIDR) go to the slot's domain filter instead.
    pub(crate) fn chain_update(&self) -> String {
        let mut s = format!(
            "flush chain ip agentenv {EGRESS_CHAIN}\nflush chain ip agentenv {EGRESS_NAT_CHAIN}\n"
        );
        if self.filters() {
            let nat = format!("add rule ip agentenv {EGRESS_NAT_CHAIN}");
            if !self.allow.is_empty() {
                let allow = set_of(&minimal_cidrs(self.allow.clone()));
                let _ = writeln!(s, "{nat} ip daddr {allow} return");
            }
            let deny = set_of(&minimal_cidrs(self.deny.clone()));
            for (port, to) in [(80, HTTP_FILTER_PORT), (443, TLS_FILTER_PORT)] {
                let _ = writeln!(
                    s,
                    "{nat} ip daddr {deny} tcp dport {port} redirect to :{to}"
                );
            }
        }
        let add = format!("add rule ip agentenv {EGRESS_CHAIN}");
        if !self.allow.is_empty() {
            let _ = writeln!(
                s,
                "{add} ip daddr {} return",
                set_of(&minimal_cidrs(self.allow.clone()))
            );
        }
        if !self.deny.is_empty() {
            let _ = writeln!(
                s,
                "{add} ip daddr {} {REFUSE}",
                set_of(&minimal_cidrs(self.deny.clone()))
            );
        }
        s
    }
}

/// An anonymous nft set of CIDRs.
fn set_of(v: &[Cidr]) -> String {
    let items: Vec<String> = v.iter().map(|c| c.to_string()).collect();
    format!("{{ {} }}", items.join(", "))
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

/// The slot's table, loaded inside its namespace.
pub(crate) fn slot_ruleset(l: &SlotLayout, p: &FirewallPolicy) -> String {
    let host = l.host_ip;
    let link = l.link_addr;
    let veth = l.veth_addr;
    // The guest's queries to its gateway go to the forwarder at the host end (§5.5).
    let dns_dnat = match (p.outbound, p.dns_port) {
        (true, Some(port)) => format!(
            "\t\tiifname \"{TAP_NAME}\" ip daddr {GUEST_GATEWAY} udp dport 53 dnat to {link}:{port}\n"
        ),
        _ => String::new(),
    };
    let mut s = String::new();
    let _ = write!(
        s,
        "table ip agentenv {{\n\
         \tchain prerouting {{\n\
         \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
         \t\tiifname \"{VETH_NS_NAME}\" ip daddr {host} dnat to {GUEST_IP}\n\
         {dns_dnat}\
         \t\tiifname \"{TAP_NAME}\" meta l4proto tcp jump {EGRESS_NAT_CHAIN}\n\
         \t}}\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{VETH_NS_NAME}\" ip saddr {GUEST_IP} snat to {host}\n\
         \t\toifname \"{VETH_NS_NAME}\" ip saddr {veth} snat to {host}\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname \"{TAP_NAME}\" ip daddr {GUEST_GATEWAY} tcp dport {GUEST_NFS_PORT} accept\n\
         \t\tiifname \"{TAP_NAME}\" ct status dnat tcp dport {{ {HTTP_FILTER_PORT}, {TLS_FILTER_PORT} }} accept\n\
         \t\tiifname \"{TAP_NAME}\" ct state new {REFUSE_PROTECTED}\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy drop;\n\
         \t\tiifname \"{TAP_NAME}\" oifname \"{VETH_NS_NAME}\" counter name \"{EGRESS_BYTES}\"\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"{TAP_NAME}\" ip saddr != {GUEST_IP} drop\n\
         \t\tiifname \"{VETH_NS_NAME}\" oifname \"{TAP_NAME}\" ct state new ip saddr {link} ip daddr {GUEST_IP} accept\n"
    );
    if p.outbound {
        let from = format!("iifname \"{TAP_NAME}\" oifname \"{VETH_NS_NAME}\" ct state new");
        let _ = writeln!(
            s,
            "\t\t{from} ct count over {MAX_GUEST_CONNECTIONS} {REFUSE}"
        );
        if let Some(port) = p.dns_port {
            let _ = writeln!(s, "\t\t{from} ip daddr {link} udp dport {port} accept");
        }
        p.outbound_rules(&mut s, &from, Some(EGRESS_CHAIN), REFUSE_PROTECTED);
    }
    let _ = writeln!(s, "\t\tiifname \"{TAP_NAME}\" ct state new {REFUSE}");
    let _ = write!(
        s,
        "\t}}\n\tchain {EGRESS_CHAIN} {{\n\t}}\n\tchain {EGRESS_NAT_CHAIN} {{\n\t}}\n\
         {}{}\
         \tcounter {EGRESS_BYTES} {{\n\t}}\n\tcounter {REFUSED} {{\n\t}}\n\
         \tcounter {REFUSED_PROTECTED} {{\n\t}}\n}}\n",
        refusal_chain("refuse", REFUSED),
        refusal_chain("refuse_protected", REFUSED_PROTECTED),
    );
    s
}

/// The root table's refusals of the host's own addresses (§5.2): counted per slot in
/// [`ROOT_REFUSALS_SET`] by the source address, then rejected as in the slots. Bounded by
/// the host interaction range (one element per slot).
const ROOT_REFUSALS: &str = "\tset refused_protected {\n\
     \t\ttype ipv4_addr; size 65536; flags dynamic; counter;\n\
     \t}\n\
     \tchain refuse_protected {\n\
     \t\tmeta nfproto != ipv4 drop\n\
     \t\tupdate @refused_protected { ip saddr }\n\
     \t\tmeta l4proto tcp reject with tcp reset\n\
     \t\treject with icmpx type admin-prohibited\n\
     \t}\n";

/// The root namespace's table, replacing any earlier copy in one transaction.
pub(crate) fn root_ruleset(p: &FirewallPolicy) -> String {
    let a = format!("\"{LINK_PREFIX}*\"");
    let mut s = String::from("table inet agentenv\ndelete table inet agentenv\n");
    // Guests reach the DNS forwarder (§5.5) and nothing else of the host; nobody else
    // reaches the forwarder.
    let dns_in = match (p.outbound, p.dns_port) {
        (true, Some(port)) => format!(
            "\t\tiifname {a} ip saddr {} udp dport {port} accept\n\
             \t\tudp dport {port} drop\n",
            p.host_cidr
        ),
        _ => String::new(),
    };
    let _ = write!(
        s,
        "table inet agentenv {{\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy accept;\n\
         \t\tiifname {a} ct state established,related accept\n\
         {dns_in}\
         \t\tiifname {a} ct state new jump refuse_protected\n\
         \t\tiifname {a} drop\n\
         \t}}\n\
         {ROOT_REFUSALS}\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         \t\tiifname {a} oifname {a} drop\n\
         \t\toifname {a} ct state established,related accept\n\
         \t\toifname {a} drop\n"
    );
    if p.outbound {
        let _ = writeln!(s, "\t\tiifname {a} ct state established,related accept");
        let _ = writeln!(s, "\t\tiifname {a} meta nfproto ipv6 drop");
        p.outbound_rules(&mut s, &format!("iifname {a}"), None, "drop");
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
        p.dns_port = Some(5300);
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
        let a: Vec<String> = p.always_denied.iter().map(|c| c.to_string()).collect();
        assert_eq!(a, ["198.18.0.0/16", "198.19.0.0/16"]);
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
        assert!(!off.contains("dport 53"));
        let on = slot_ruleset(&l, &policy(true));
        assert!(on.contains(
            "iifname \"tap0\" ip daddr 169.254.0.22 udp dport 53 dnat to 198.19.0.14:5300"
        ));
        assert!(on.contains("ct state new ip daddr 198.19.0.14 udp dport 5300 accept"));
        assert!(on.contains("ip daddr { 198.18.0.0/16, 198.19.0.0/16 } jump refuse_protected"));
        assert!(on.contains("iifname \"tap0\" oifname \"veth0\" ct state new accept"));
        // Counted: what the guest sends out, and every refusal of a new connection, which
        // is rejected so that a client does not retry (one connection, one count).
        assert!(on.contains("oifname \"veth0\" counter name \"egress_bytes\"\n\t\tct state"));
        assert!(on.contains(
            "\tcounter egress_bytes {\n\t}\n\tcounter refused {\n\t}\n\tcounter refused_protected {\n\t}\n"
        ));
        assert!(off.contains("\t\tiifname \"tap0\" ct state new jump refuse\n\t}"));
        assert!(off.contains("\t\tiifname \"tap0\" ct state new jump refuse_protected\n\t}"));
        for (chain, counter) in [
            ("refuse", "refused"),
            ("refuse_protected", "refused_protected"),
        ] {
            assert!(on.contains(&format!(
                "\tchain {chain} {{\n\t\tcounter name \"{counter}\"\n\
                 \t\tmeta l4proto tcp reject with tcp reset\n\
                 \t\treject with icmp type admin-prohibited\n\t}}\n"
            )));
        }
    }

    #[test]
    fn operator_allow_list_is_an_exception_to_the_denied_ranges_only() {
        let mut p = policy(true);
        p.allowed = vec![Cidr::parse("10.1.0.0/16").unwrap()];
        let root = root_ruleset(&p);
        assert!(root.contains("ip daddr { 198.18.0.0/16, 198.19.0.0/16 } drop"));
        assert!(root.contains("ip daddr != { 10.1.0.0/16 } ip daddr { 10.0.0.0/8,"));
    }

    #[test]
    fn egress_chain_is_replaced_in_one_transaction() {
        let on = slot_ruleset(
            &SlotLayout::new(
                Path::new("/x"),
                Cidr::parse("198.18.0.0/16").unwrap(),
                Cidr::parse("198.19.0.0/16").unwrap(),
                7,
            ),
            &policy(true),
        );
        let jump = on.find("ct state new jump egress").unwrap();
        assert!(jump < on.rfind("oifname \"veth0\" ct state new accept").unwrap());
        assert!(on.contains("ct state new ct count over 8192 jump refuse\n"));
        assert!(on.contains("\tchain egress {\n\t}\n"));
        let mut r = EgressRules {
            allow: vec![Cidr::parse("203.0.113.10/32").unwrap()],
            deny: vec![Cidr::parse("0.0.0.0/0").unwrap()],
            domains: vec![],
        };
        let flush = "flush chain ip agentenv egress\nflush chain ip agentenv egress_nat\n";
        assert_eq!(
            r.chain_update(),
            format!(
                "{flush}\
                 add rule ip agentenv egress ip daddr {{ 203.0.113.10/32 }} return\n\
                 add rule ip agentenv egress ip daddr {{ 0.0.0.0/0 }} jump refuse\n"
            )
        );
        assert_eq!(EgressRules::default().chain_update(), flush);
        // Domains: ports 80 and 443 of denied destinations go to the filter.
        r.domains = vec!["*.example.com".into()];
        let u = r.chain_update();
        assert!(u.contains(
            "add rule ip agentenv egress_nat ip daddr { 203.0.113.10/32 } return\n\
             add rule ip agentenv egress_nat ip daddr { 0.0.0.0/0 } tcp dport 80 redirect to :10080\n\
             add rule ip agentenv egress_nat ip daddr { 0.0.0.0/0 } tcp dport 443 redirect to :10443\n"
        ), "{u}");
        // Nothing denied: domains change nothing.
        r.deny.clear();
        assert!(!r.filters());
        assert!(!r.chain_update().contains("redirect"));
        assert!(on.contains("iifname \"tap0\" meta l4proto tcp jump egress_nat"));
        assert!(on.contains("ct status dnat tcp dport { 10080, 10443 } accept"));
        assert!(on.contains("oifname \"veth0\" ip saddr 198.19.0.15 snat to 198.18.0.7"));
    }

    #[test]
    fn the_filter_refuses_what_the_server_refuses() {
        let mut p = policy(true);
        p.allowed = vec![Cidr::parse("10.1.0.0/16").unwrap()];
        let ip = |s: &str| s.parse().unwrap();
        assert!(p.refuses(ip("127.0.0.1")));
        assert!(p.refuses(ip("169.254.0.22")));
        assert!(p.refuses(ip("198.18.0.9")));
        assert!(p.refuses(ip("10.2.0.1")));
        assert!(!p.refuses(ip("10.1.0.1")));
        assert!(!p.refuses(ip("203.0.113.10")));
    }

    #[test]
    fn root_ruleset_off_and_on() {
        let off = root_ruleset(&policy(false));
        assert!(off.starts_with("table inet agentenv\ndelete table inet agentenv\n"));
        assert!(!off.contains("masquerade"));
        assert!(!off.contains("5300"));
        let on = root_ruleset(&policy(true));
        assert!(on.contains("ip saddr 198.18.0.0/16 oifname != \"aenv-*\" masquerade"));
        assert!(on.contains("iifname \"aenv-*\" ip saddr 198.18.0.0/16 udp dport 5300 accept"));
        // Host addresses: counted per slot (by its SNAT address) and rejected.
        assert!(on.contains(
            "\t\tudp dport 5300 drop\n\t\tiifname \"aenv-*\" ct state new jump refuse_protected\n\
             \t\tiifname \"aenv-*\" drop\n"
        ));
        assert!(on.contains("update @refused_protected { ip saddr }\n"));
        assert_eq!(
            forget_root_refusals("198.18.0.7".parse().unwrap()),
            "add element inet agentenv refused_protected { 198.18.0.7 }\n\
             delete element inet agentenv refused_protected { 198.18.0.7 }\n"
        );
    }
}
