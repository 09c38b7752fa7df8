//! The domain filter of one slot (network.md §5.7): for a sandbox whose `allowOut` names
//! domains, the slot's table redirects the guest's new TCP connections to ports 80 and 443
//! of denied destinations to two listeners inside the slot's namespace. Each connection is
//! judged by the name it carries (the TLS SNI on 443, the HTTP `Host` on 80), never by the
//! guest's DNS: an allowed name is resolved by the host (the DNS forwarder's upstreams) and
//! the connection goes to that address, from inside the slot's namespace, so the server's
//! own rules (§5.4) still apply to it and a forged name reaches only what it names.
//!
//! Threads: `egress-filter` polls both listeners and spawns one `egress-conn` thread per
//! accepted connection (at most [`MAX_CONNECTIONS`] at once), which reads the name
//! (at most [`MAX_HEAD`] bytes within [`HEAD_TIMEOUT`]), resolves, connects and then relays
//! both ways with the envd tunnel's two-way copy, ended by the idle limit or the filter's
//! stop. Dropping the [`DomainFilter`] stops all of them.

use super::dns::resolve_v4;
use super::firewall::FirewallPolicy;
use super::layout::GUEST_GATEWAY;
use crate::envd::tunnel;
use crate::envd::{Patience, Upgraded};
use crate::sys::{netns, SysError};
use parking_lot::RwLock;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Port of the listener for redirected HTTP (guest port 80) inside every slot namespace.
pub const HTTP_FILTER_PORT: u16 = 10080;
/// Port of the listener for redirected TLS (guest port 443).
pub const TLS_FILTER_PORT: u16 = 10443;
/// Most filtered connections one sandbox may have open; beyond it new ones are closed.
pub const MAX_CONNECTIONS: usize = 256;
/// Most bytes read from a guest before its name must be known.
pub const MAX_HEAD: usize = 16 * 1024;
/// How long a guest has to send its ClientHello or request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the host's resolvers have to answer, and an upstream to accept.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A relayed connection with no byte either way for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How often waiting threads look at the stop flag.
const POLL: Duration = Duration::from_millis(250);

/// What every slot's filter shares, from the server's config.
#[derive(Clone)]
pub(crate) struct FilterConfig {
    pub resolvers: Vec<SocketAddr>,
    pub policy: FirewallPolicy,
}

/// Which inspected port a connection came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inspected {
    Http,
    Tls,
}

impl Inspected {
    fn upstream_port(self) -> u16 {
        match self {
            Inspected::Http => 80,
            Inspected::Tls => 443,
        }
    }
}

/// Whether `name` matches one `allowOut` domain entry: `example.com` only itself,
/// `*.example.com` every name below it (not `example.com`). Case-insensitive; a trailing
/// dot is ignored.
pub fn domain_matches(pattern: &str, name: &str) -> bool {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    match pattern.strip_prefix("*.") {
        Some(parent) => name
            .strip_suffix(parent)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => name == pattern,
    }
}

/// Counts one filter keeps (network.md §5.8).
#[derive(Debug, Default)]
pub(crate) struct FilterCounts {
    pub refused: AtomicU64,
    pub refused_protected: AtomicU64,
    pub bytes_out: AtomicU64,
    pub bytes_in: AtomicU64,
}

/// What a filter counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FilterTotals {
    /// Connections closed by the policy (no name, a name not allowed, unreachable, over
    /// the limit).
    pub refused: u64,
    /// Connections whose allowed name resolved only to addresses always refused (§5.4).
    pub refused_protected: u64,
    /// Guest→internet bytes relayed.
    pub bytes_out: u64,
    /// Internet→guest bytes relayed.
    pub bytes_in: u64,
}

/// Why a filtered connection was closed, for its count and its log line.
struct Refusal {
    protected: bool,
    why: String,
}

impl From<String> for Refusal {
    fn from(why: String) -> Refusal {
        Refusal {
            protected: false,
            why,
        }
    }
}

struct Shared {
    ns: File,
    cfg: FilterConfig,
    domains: RwLock<Vec<String>>,
    open: AtomicUsize,
    stop: AtomicBool,
    counts: FilterCounts,
    slot: u32,
}

/// One slot's running filter; dropping it ends every thread and connection it has.
pub struct DomainFilter {
    shared: Option<Arc<Shared>>,
    acceptor: Option<JoinHandle<()>>,
}

impl DomainFilter {
    /// Binds both listeners inside the namespace at `ns_path` and starts the acceptor.
    pub(crate) fn start(
        slot: u32,
        ns_path: &std::path::Path,
        cfg: FilterConfig,
        domains: Vec<String>,
    ) -> Result<DomainFilter, SysError> {
        let ns = netns::open(ns_path)?;
        let listeners = netns::with_netns(&ns, || {
            let bind = |port| {
                TcpListener::bind(SocketAddrV4::new(GUEST_GATEWAY, port))
                    .map_err(|e| SysError::from_io(format!("bind {GUEST_GATEWAY}:{port}"), e))
            };
            Ok((bind(HTTP_FILTER_PORT)?, bind(TLS_FILTER_PORT)?))
        })?;
        let shared = Arc::new(Shared {
            ns,
            cfg,
            domains: RwLock::new(domains),
            open: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            counts: FilterCounts::default(),
            slot,
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("egress-filter".into())
            .spawn(move || accept_loop(&s, listeners.0, listeners.1))
            .map_err(|e| SysError::from_io("spawn egress-filter", e))?;
        log::info!("slot={slot} op=egress_filter_start");
        Ok(DomainFilter {
            shared: Some(shared),
            acceptor: Some(acceptor),
        })
    }

    /// A filter that only holds its domains (fake hosts in unit tests).
    #[cfg(test)]
    pub(crate) fn inert() -> DomainFilter {
        DomainFilter {
            shared: None,
            acceptor: None,
        }
    }

    /// Replaces the allowed domains; connections already relayed are kept.
    pub fn set_domains(&self, domains: Vec<String>) {
        if let Some(s) = &self.shared {
            *s.domains.write() = domains;
        }
    }

    /// What this filter counted since it started.
    pub fn counts(&self) -> FilterTotals {
        self.shared.as_ref().map_or(FilterTotals::default(), |s| {
            let c = &s.counts;
            FilterTotals {
                refused: c.refused.load(Ordering::Relaxed),
                refused_protected: c.refused_protected.load(Ordering::Relaxed),
                bytes_out: c.bytes_out.load(Ordering::Relaxed),
                bytes_in: c.bytes_in.load(Ordering::Relaxed),
            }
        })
    }
}

impl Drop for DomainFilter {
    fn drop(&mut self) {
        if let Some(s) = &self.shared {
            s.stop.store(true, Ordering::Release);
            log::info!("slot={} op=egress_filter_stop", s.slot);
        }
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(s: &Arc<Shared>, http: TcpListener, tls: TcpListener) {
    while !s.stop.load(Ordering::Acquire) {
        let ready = match crate::sys::guest::poll_readable(&[http.as_fd(), tls.as_fd()], Some(POLL))
        {
            Ok(r) => r,
            Err(e) => {
                log::warn!("slot={} op=egress_filter error=\"{e}\"", s.slot);
                std::thread::sleep(POLL);
                continue;
            }
        };
        for (listener, kind, r) in [
            (&http, Inspected::Http, ready[0]),
            (&tls, Inspected::Tls, ready[1]),
        ] {
            if !r {
                continue;
            }
            if let Ok((conn, _)) = listener.accept() {
                admit(s, conn, kind);
            }
        }
    }
}

/// Hands `conn` to its own thread, or closes it when the sandbox has too many.
fn admit(s: &Arc<Shared>, conn: TcpStream, kind: Inspected) {
    if s.open.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        s.open.fetch_sub(1, Ordering::AcqRel);
        s.counts.refused.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let sh = s.clone();
    let spawned = std::thread::Builder::new()
        .name("egress-conn".into())
        .spawn(move || {
            if let Err(r) = serve(&sh, conn, kind) {
                let count = match r.protected {
                    true => &sh.counts.refused_protected,
                    false => &sh.counts.refused,
                };
                count.fetch_add(1, Ordering::Relaxed);
                log::info!("slot={} op=egress_refused {}", sh.slot, r.why);
            }
            sh.open.fetch_sub(1, Ordering::AcqRel);
        });
    if spawned.is_err() {
        s.open.fetch_sub(1, Ordering::AcqRel);
        s.counts.refused.fetch_add(1, Ordering::Relaxed);
    }
}

/// One redirected connection: its name, the policy's verdict, the host's address for the
/// name, then the relay. An `Err` is a refusal (the guest's connection is closed).
fn serve(s: &Arc<Shared>, mut conn: TcpStream, kind: Inspected) -> Result<(), Refusal> {
    let (head, name) = read_name(&mut conn, kind)?;
    let allowed = s.domains.read().iter().any(|d| domain_matches(d, &name));
    if !allowed {
        return Err(format!("name={name:?} reason=not_allowed").into());
    }
    let addrs = resolve_v4(&name, &s.cfg.resolvers, RESOLVE_TIMEOUT)
        .map_err(|e| format!("name={name:?} reason=resolve error=\"{e}\""))?;
    let Some(ip) = addrs.into_iter().find(|ip| !s.cfg.policy.refuses(*ip)) else {
        return Err(Refusal {
            protected: true,
            why: format!("name={name:?} reason=no_allowed_address"),
        });
    };
    let to = SocketAddr::from((ip, kind.upstream_port()));
    let mut upstream = netns::with_netns(&s.ns, || {
        TcpStream::connect_timeout(&to, CONNECT_TIMEOUT)
            .map_err(|e| SysError::from_io(format!("connect {to}"), e))
    })
    .map_err(|e| format!("name={name:?} reason=connect error=\"{e}\""))?;
    let io = |e: std::io::Error| format!("name={name:?} error=\"{e}\"");
    upstream.write_all(&head).map_err(io)?;
    upstream.set_read_timeout(Some(POLL)).map_err(io)?;
    conn.set_read_timeout(Some(POLL)).map_err(io)?;
    let reader = conn.try_clone().map_err(io)?;
    let patience = Patience {
        idle: IDLE_TIMEOUT,
        alive: {
            let s = s.clone();
            Arc::new(move || !s.stop.load(Ordering::Acquire))
        },
    };
    let upstream = Upgraded {
        stream: upstream,
        buffered: Vec::new(),
    };
    let relay = tunnel::relay(Box::new(reader), Box::new(conn), upstream, patience);
    if let Ok(t) = relay {
        let out = t.to_guest + head.len() as u64;
        s.counts.bytes_out.fetch_add(out, Ordering::Relaxed);
        s.counts.bytes_in.fetch_add(t.to_client, Ordering::Relaxed);
        log::debug!(
            "slot={} op=egress_relayed name={name:?} out={out} in={} end={:?}",
            s.slot,
            t.to_client,
            t.end
        );
    }
    Ok(())
}

/// Reads from the guest until its name is known: (every byte read, the name).
fn read_name(conn: &mut TcpStream, kind: Inspected) -> Result<(Vec<u8>, String), String> {
    let started = Instant::now();
    let mut head = Vec::new();
    let mut tls = rustls::server::Acceptor::default();
    let mut buf = [0u8; 4096];
    loop {
        let left = HEAD_TIMEOUT.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err("reason=slow_head".into());
        }
        conn.set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        let n = match conn.read(&mut buf) {
            Ok(0) => return Err("reason=closed_before_name".into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Err("reason=slow_head".into()),
        };
        head.extend_from_slice(&buf[..n]);
        let name = match kind {
            Inspected::Tls => sni(&mut tls, &buf[..n])?,
            Inspected::Http => http_host(&head)?,
        };
        if let Some(name) = name {
            return Ok((head, name));
        }
        if head.len() >= MAX_HEAD {
            return Err("reason=head_too_large".into());
        }
    }
}

/// The SNI of a ClientHello fed in pieces; `None` until the hello is complete.
fn sni(tls: &mut rustls::server::Acceptor, mut chunk: &[u8]) -> Result<Option<String>, String> {
    while !chunk.is_empty() {
        tls.read_tls(&mut chunk)
            .map_err(|e| format!("reason=not_tls error=\"{e}\""))?;
        match tls.accept() {
            Ok(None) => {}
            Ok(Some(hello)) => {
                return hello
                    .client_hello()
                    .server_name()
                    .map(|n| Some(n.to_ascii_lowercase()))
                    .ok_or_else(|| "reason=no_sni".to_string())
            }
            Err((e, _)) => return Err(format!("reason=not_tls error=\"{e}\"")),
        }
    }
    Ok(None)
}

/// The `Host` of an HTTP/1 request head (without its port); `None` until the head is
/// complete.
fn http_host(head: &[u8]) -> Result<Option<String>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Partial) => Ok(None),
        Ok(httparse::Status::Complete(_)) => {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .and_then(|h| std::str::from_utf8(h.value).ok())
                .ok_or("reason=no_host")?;
            let name = host.trim().rsplit_once(':').map_or(host.trim(), |(n, _)| n);
            if name.is_empty() || name.parse::<Ipv4Addr>().is_ok() {
                return Err(format!("host={name:?} reason=not_a_name"));
            }
            Ok(Some(name.to_ascii_lowercase()))
        }
        Err(e) => Err(format!("reason=not_http error=\"{e}\"")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_and_wildcard_names() {
        assert!(domain_matches("example.com", "example.com"));
        assert!(domain_matches("example.com", "Example.COM."));
        assert!(!domain_matches("example.com", "www.example.com"));
        assert!(domain_matches("*.example.com", "www.example.com"));
        assert!(domain_matches("*.example.com", "a.b.example.com"));
        assert!(!domain_matches("*.example.com", "example.com"));
        assert!(!domain_matches("*.example.com", "badexample.com"));
        assert!(!domain_matches("*.example.com", ".example.com"));
    }

    #[test]
    fn host_header_needs_a_complete_head_and_a_name() {
        assert_eq!(http_host(b"GET / HTTP/1.1\r\nHost: a.test"), Ok(None));
        assert_eq!(
            http_host(b"GET / HTTP/1.1\r\nHost: A.Test:8080\r\n\r\n"),
            Ok(Some("a.test".into()))
        );
        assert!(http_host(b"GET / HTTP/1.1\r\n\r\n").is_err());
        assert!(http_host(b"GET / HTTP/1.1\r\nHost: 203.0.113.9\r\n\r\n").is_err());
        assert!(http_host(b"\x16\x03\x01\x02\x00").is_err());
    }

    #[test]
    fn sni_from_a_real_client_hello_in_pieces() {
        // Python's ssl module's ClientHello for server_hostname "Web.Egress.Test".
        let hello = include_bytes!("testdata/client_hello_sni.bin");
        let mut a = rustls::server::Acceptor::default();
        let mut got = None;
        for piece in hello.chunks(100) {
            assert_eq!(got, None, "complete before the last piece");
            got = sni(&mut a, piece).unwrap();
        }
        assert_eq!(got.as_deref(), Some("web.egress.test"));
        let mut a = rustls::server::Acceptor::default();
        assert!(sni(&mut a, b"GET / HTTP/1.1\r\n").is_err());
    }
}
