//! Peer addresses: `http://ADDR:PORT` URLs and `NAME:PORT` DNS names.

use std::net::{SocketAddr, ToSocketAddrs};

/// A node's API as peers reach it: plain HTTP to `host:port` (nodes talk inside the
/// cluster's network; TLS belongs to the load balancer in front).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerUrl {
    pub host: String,
    pub port: u16,
}

impl PeerUrl {
    /// `http://HOST:PORT`, optionally with a trailing `/`; nothing else.
    pub fn parse(url: &str) -> Result<PeerUrl, &'static str> {
        let rest = url
            .strip_prefix("http://")
            .ok_or("must be an http://ADDR:PORT URL")?;
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains(['/', '?', '#', '@']) {
            return Err("must be http://ADDR:PORT with no path, query or credentials");
        }
        let (host, port) = authority
            .rsplit_once(':')
            .ok_or("must name a port (http://ADDR:PORT)")?;
        let port = port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or("has an invalid port")?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err("has no host");
        }
        Ok(PeerUrl {
            host: host.to_string(),
            port,
        })
    }

    /// The peer's socket address (a name is resolved each time: a restarted pod may
    /// come back elsewhere).
    pub fn resolve(&self) -> std::io::Result<SocketAddr> {
        (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{} has no address", self.host)))
    }

    /// `HOST:PORT` as a `Host` header carries it.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl std::fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}", self.authority())
    }
}

/// `NAME:PORT` of `[cluster] peers_dns`, split.
pub fn dns_name(s: &str) -> Option<(&str, u16)> {
    let (name, port) = s.rsplit_once(':')?;
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    let label = |l: &str| {
        !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    (name.len() <= 253 && name.trim_end_matches('.').split('.').all(label)).then_some((name, port))
}

/// Every address `peers_dns` resolves to now, as peers.
pub fn resolve_dns(s: &str) -> std::io::Result<Vec<PeerUrl>> {
    let (name, port) = dns_name(s).ok_or_else(|| std::io::Error::other("not NAME:PORT"))?;
    let mut peers: Vec<PeerUrl> = (name, port)
        .to_socket_addrs()?
        .map(|a| PeerUrl {
            host: a.ip().to_string(),
            port,
        })
        .collect();
    peers.sort();
    peers.dedup();
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_urls() {
        let p = PeerUrl::parse("http://198.51.100.2:3000").unwrap();
        assert_eq!((p.host.as_str(), p.port), ("198.51.100.2", 3000));
        assert_eq!(p.to_string(), "http://198.51.100.2:3000");
        assert_eq!(PeerUrl::parse("http://n1.local:80/").unwrap().port, 80);
        let v6 = PeerUrl::parse("http://[2001:db8::1]:3000").unwrap();
        assert_eq!(v6.authority(), "[2001:db8::1]:3000");
        for bad in [
            "",
            "198.51.100.2:3000",
            "https://198.51.100.2:3000",
            "http://198.51.100.2",
            "http://198.51.100.2:0",
            "http://198.51.100.2:3000/api",
            "http://u@198.51.100.2:3000",
            "http://:3000",
        ] {
            assert!(PeerUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dns_names() {
        assert_eq!(
            dns_name("agentenv-peers.default.svc.cluster.local:3000"),
            Some(("agentenv-peers.default.svc.cluster.local", 3000))
        );
        for bad in ["agentenv", "agentenv:", "a b:1", ":3000", "x:0"] {
            assert_eq!(dns_name(bad), None, "{bad}");
        }
    }
}
