//! The guests' DNS forwarder (network.md §5.5). Every slot DNATs the guest's queries to
//! its gateway `169.254.0.22:53` onto one UDP socket of the server in the root namespace
//! (`<host end of the veth>:<port>`); the forwarder relays them to the host's resolvers and
//! the answers back. Guests therefore never reach the resolvers (often loopback or private
//! addresses) nor any other host service.
//!
//! Threads: `dns-in` reads guest queries, `dns-out` reads upstream answers. Bounds: a query
//! is at most [`MAX_QUERY`] bytes, an answer at most [`MAX_ANSWER`]; each guest source
//! address gets [`RATE_PER_SEC`] queries a second (burst [`BURST`]) and at most
//! [`PER_GUEST_PENDING`] unanswered ones; [`MAX_PENDING`] in all, each forgotten after
//! [`ANSWER_TIMEOUT`]. Upstream ids are random and answers are accepted only from the
//! resolver the query went to.

use crate::config::{Cidr, NetworkConfig};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest query accepted from a guest (EDNS queries are far smaller).
pub const MAX_QUERY: usize = 1232;
/// Largest answer relayed to a guest (the usual EDNS buffer limit).
pub const MAX_ANSWER: usize = 4096;
/// Queries a second each guest may send, sustained.
pub const RATE_PER_SEC: f64 = 50.0;
/// Queries a guest may send at once.
pub const BURST: f64 = 100.0;
/// Unanswered queries per guest.
pub const PER_GUEST_PENDING: usize = 64;
/// Unanswered queries in all.
pub const MAX_PENDING: usize = 4096;
/// How long an upstream has to answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the threads look at the stop flag.
const POLL: Duration = Duration::from_millis(250);

/// The resolvers queries go to: `[network] dns`, else the host's `/etc/resolv.conf`,
/// following systemd-resolved's upstream list when it names the stub `127.0.0.53`.
pub fn upstream_resolvers(cfg: &NetworkConfig) -> Vec<Ipv4Addr> {
    if !cfg.dns.is_empty() {
        return cfg.dns.parse().into_iter().collect();
    }
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let host = nameservers(&read("/etc/resolv.conf"));
    if host.contains(&Ipv4Addr::new(127, 0, 0, 53)) {
        let upstream = nameservers(&read("/run/systemd/resolve/resolv.conf"));
        if !upstream.is_empty() {
            return upstream;
        }
    }
    host
}

/// The IPv4 `nameserver` lines of a resolv.conf, in order (at most 3, as libc reads).
pub(crate) fn nameservers(text: &str) -> Vec<Ipv4Addr> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver"))
                .then(|| w.next()?.parse::<Ipv4Addr>().ok())
                .flatten()
        })
        .take(3)
        .collect()
}

/// One query waiting for its answer.
struct Pending {
    guest: SocketAddr,
    guest_id: u16,
    upstream: SocketAddr,
    sent: Instant,
}

/// A guest's token bucket.
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Default)]
struct Table {
    pending: HashMap<u16, Pending>,
    buckets: HashMap<Ipv4Addr, Bucket>,
    next_upstream: usize,
}

impl Table {
    /// Drops expired queries and idle buckets.
    fn expire(&mut self, now: Instant) {
        self.pending
            .retain(|_, p| now.duration_since(p.sent) < ANSWER_TIMEOUT);
        self.buckets
            .retain(|_, b| now.duration_since(b.at) < Duration::from_secs(60));
    }

    /// Whether `guest` may send one more query now.
    fn admit(&mut self, guest: Ipv4Addr, now: Instant) -> bool {
        let b = self.buckets.entry(guest).or_insert(Bucket {
            tokens: BURST,
            at: now,
        });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * RATE_PER_SEC).min(BURST);
        b.at = now;
        if b.tokens < 1.0 || self.pending.len() >= MAX_PENDING {
            return false;
        }
        let mine = self
            .pending
            .values()
            .filter(|p| p.guest.ip() == IpAddr::V4(guest))
            .count();
        if mine >= PER_GUEST_PENDING {
            return false;
        }
        b.tokens -= 1.0;
        true
    }

    /// A fresh random id not in use (None when the random source fails).
    fn fresh_id(&self) -> Option<u16> {
        for _ in 0..16 {
            let mut b = [0u8; 2];
            crate::sys::fs::random_bytes(&mut b).ok()?;
            let id = u16::from_be_bytes(b);
            if !self.pending.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }
}

struct Inner {
    /// Receives guest queries, sends their answers.
    guests: UdpSocket,
    /// Sends queries upstream, receives the answers.
    upstream: UdpSocket,
    resolvers: Vec<SocketAddr>,
    /// Only sources in `host_interaction_cidr` (the guests after the slot's SNAT).
    allowed: Cidr,
    table: Mutex<Table>,
    stop: AtomicBool,
}

/// The running forwarder; [`DnsForwarder::stop`] (or drop) ends its threads.
pub struct DnsForwarder {
    inner: Arc<Inner>,
    port: u16,
    threads: Vec<JoinHandle<()>>,
}

impl DnsForwarder {
    /// Binds `0.0.0.0:<ephemeral>` (the root table admits only guests to it) and starts
    /// the two threads.
    pub fn start(resolvers: &[SocketAddr], guests_from: Cidr) -> std::io::Result<DnsForwarder> {
        let guests = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        let upstream = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        guests.set_read_timeout(Some(POLL))?;
        upstream.set_read_timeout(Some(POLL))?;
        let port = guests.local_addr()?.port();
        let inner = Arc::new(Inner {
            guests,
            upstream,
            resolvers: resolvers.to_vec(),
            allowed: guests_from,
            table: Mutex::new(Table::default()),
            stop: AtomicBool::new(false),
        });
        let mut threads = Vec::new();
        for (name, run) in [
            ("dns-in", Inner::queries as fn(&Inner)),
            ("dns-out", Inner::answers as fn(&Inner)),
        ] {
            let i = inner.clone();
            let spawned = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(&i));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let mut partial = DnsForwarder {
                        inner,
                        port,
                        threads,
                    };
                    partial.stop();
                    return Err(e);
                }
            }
        }
        log::info!("op=dns_start port={port} upstreams={resolvers:?}");
        Ok(DnsForwarder {
            inner,
            port,
            threads,
        })
    }

    /// The UDP port guests' queries are DNATed to.
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn stop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for DnsForwarder {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Inner {
    fn queries(&self) {
        let mut buf = [0u8; MAX_QUERY + 1];
        while !self.stop.load(Ordering::Relaxed) {
            let Ok((n, from)) = self.guests.recv_from(&mut buf) else {
                continue;
            };
            self.forward_query(&mut buf[..n], from);
        }
    }

    fn forward_query(&self, q: &mut [u8], from: SocketAddr) {
        let SocketAddr::V4(src) = from else { return };
        if q.len() < 12 || q.len() > MAX_QUERY || !self.allowed.contains(*src.ip()) {
            return;
        }
        // A query (QR bit clear) only: a guest cannot make us relay answers.
        if q[2] & 0x80 != 0 || self.resolvers.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut t = self.table.lock();
        t.expire(now);
        if !t.admit(*src.ip(), now) {
            log::debug!("op=dns_refuse guest={src} reason=rate");
            return;
        }
        let Some(id) = t.fresh_id() else { return };
        let upstream = self.resolvers[t.next_upstream % self.resolvers.len()];
        t.next_upstream = t.next_upstream.wrapping_add(1);
        let guest_id = u16::from_be_bytes([q[0], q[1]]);
        t.pending.insert(
            id,
            Pending {
                guest: from,
                guest_id,
                upstream,
                sent: now,
            },
        );
        drop(t);
        q[..2].copy_from_slice(&id.to_be_bytes());
        if let Err(e) = self.upstream.send_to(q, upstream) {
            log::debug!("op=dns_forward upstream={upstream} error=\"{e}\"");
            self.table.lock().pending.remove(&id);
        }
    }

    fn answers(&self) {
        let mut buf = [0u8; MAX_ANSWER];
        while !self.stop.load(Ordering::Relaxed) {
            let Ok((n, from)) = self.upstream.recv_from(&mut buf) else {
                continue;
            };
            if n < 12 {
                continue;
            }
            let id = u16::from_be_bytes([buf[0], buf[1]]);
            let waiting = {
                let mut t = self.table.lock();
                match t.pending.get(&id) {
                    Some(p) if p.upstream == from => t.pending.remove(&id),
                    _ => None,
                }
            };
            let Some(p) = waiting else { continue };
            buf[..2].copy_from_slice(&p.guest_id.to_be_bytes());
            let _ = self.guests.send_to(&buf[..n], p.guest);
        }
    }
}

/// The IPv4 addresses the upstream resolvers give for `name` (its A records, CNAME chains
/// followed by the resolver), asking each resolver in turn until one answers within
/// `timeout`. Used by the domain filter (network.md §5.6), which connects only to what the
/// host resolves, never to an address a guest chose.
pub(crate) fn resolve_v4(
    name: &str,
    resolvers: &[SocketAddr],
    timeout: Duration,
) -> std::io::Result<Vec<Ipv4Addr>> {
    use simple_dns::{Packet, PacketFlag, Question, CLASS, QCLASS, QTYPE, TYPE};
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut id = [0u8; 2];
    crate::sys::fs::random_bytes(&mut id).map_err(|e| invalid(e.to_string()))?;
    let id = u16::from_be_bytes(id);
    let mut q = Packet::new_query(id);
    q.set_flags(PacketFlag::RECURSION_DESIRED);
    let qname = simple_dns::Name::new(name).map_err(|e| invalid(format!("{name}: {e}")))?;
    q.questions.push(Question::new(
        qname,
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    let query = q.build_bytes_vec().map_err(|e| invalid(e.to_string()))?;
    let sock = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "no resolver");
    for r in resolvers {
        sock.send_to(&query, r)?;
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; MAX_ANSWER];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                last = std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("{r} did not answer"),
                );
                break;
            }
            sock.set_read_timeout(Some(left))?;
            let (n, from) = match sock.recv_from(&mut buf) {
                Ok(v) => v,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e),
            };
            // Only the resolver asked, and only the answer to this query.
            let Ok(answer) = Packet::parse(&buf[..n]) else {
                continue;
            };
            if from != *r || answer.id() != id || !answer.has_flags(PacketFlag::RESPONSE) {
                continue;
            }
            return Ok(answer
                .answers
                .iter()
                .filter_map(|rr| match &rr.rdata {
                    simple_dns::rdata::RData::A(a) => Some(Ipv4Addr::from(a.address)),
                    _ => None,
                })
                .collect());
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_parsing() {
        let t = "# c\nnameserver 127.0.0.53\nsearch x\nnameserver 192.0.2.1\nnameserver ::1\n";
        assert_eq!(
            nameservers(t),
            vec![Ipv4Addr::new(127, 0, 0, 53), Ipv4Addr::new(192, 0, 2, 1)]
        );
        assert!(nameservers("search x\n").is_empty());
    }

    #[test]
    fn rate_and_pending_bounds() {
        let mut t = Table::default();
        let now = Instant::now();
        let g = Ipv4Addr::new(198, 18, 0, 3);
        let admitted = (0..1000).filter(|_| t.admit(g, now)).count();
        assert_eq!(admitted, BURST as usize);
        // Refilled after a second, but not beyond the pending bound.
        let later = now + Duration::from_secs(1);
        for i in 0..PER_GUEST_PENDING as u16 {
            t.pending.insert(
                i,
                Pending {
                    guest: SocketAddr::from((g, 1000)),
                    guest_id: i,
                    upstream: SocketAddr::from(([192, 0, 2, 1], 53)),
                    sent: later,
                },
            );
        }
        assert!(!t.admit(g, later));
        assert!(t.admit(Ipv4Addr::new(198, 18, 0, 4), later));
        t.expire(later + ANSWER_TIMEOUT);
        assert!(t.pending.is_empty());
    }

    /// A real round trip on loopback: a query with a guest's source is relayed with a new
    /// id, the answer comes back with the guest's id; answers from elsewhere are ignored.
    #[test]
    fn relays_a_query_and_its_answer() {
        let resolver = UdpSocket::bind("127.0.0.1:0").unwrap();
        resolver
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let rport = resolver.local_addr().unwrap().port();
        let upstream = SocketAddr::from(([127, 0, 0, 1], rport));
        let mut fwd =
            DnsForwarder::start(&[upstream], Cidr::parse("127.0.0.0/8").unwrap()).unwrap();
        let guest = UdpSocket::bind("127.0.0.1:0").unwrap();
        guest
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let port = fwd.port();
        let query = [
            0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1,
        ];
        guest.send_to(&query, ("127.0.0.1", port)).unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = resolver.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[2..n], &query[2..]);
        let mut answer = buf[..n].to_vec();
        answer[2] |= 0x80;
        // From the wrong source: ignored.
        let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
        stranger.send_to(&answer, from).unwrap();
        resolver.send_to(&answer, from).unwrap();
        let (n, _) = guest.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..2], &[0xab, 0xcd]);
        assert_eq!(buf[2] & 0x80, 0x80);
        assert_eq!(n, query.len());
        fwd.stop();
    }
}
