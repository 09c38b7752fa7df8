//! End-to-end slot tests against the real kernel (run as root). They share the fixed
//! names `agentenv-ns-<n>` / `aenv-<n>`, and a manager's start reclaims every leftover, so
//! they run one at a time under [`SERIAL`], and only while no server owns the host
//! (they hold its host lock, [`crate::server::HOST_LOCK`]); each cleans up even when it
//! fails.

use super::*;
use crate::config::{Config, NetworkConfig};
use crate::sys::netns;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

static SERIAL: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// One test at a time, and no server on the host meanwhile (its slots would be reclaimed):
/// waits up to two minutes for a running server to stop, then fails saying which.
fn serial() -> (
    parking_lot::MutexGuard<'static, ()>,
    crate::sys::fs::LockFile,
) {
    let guard = SERIAL.lock();
    std::fs::create_dir_all(crate::server::RUNTIME_DIR).unwrap();
    let path = std::path::Path::new(crate::server::HOST_LOCK);
    let deadline = Instant::now() + Duration::from_secs(120);
    let lock = loop {
        if let Some(lock) = crate::sys::fs::try_lock_exclusive(path).unwrap() {
            break lock;
        }
        let holder = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            Instant::now() < deadline,
            "an agentenv server (pid {}) holds {}: stop it to run the real network tests",
            holder.trim(),
            path.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    lock.set_contents(&format!("{}\n", std::process::id()))
        .unwrap();
    (guard, lock)
}

fn cfg(max_slots: u32, pool_min: u32, pool_max: u32) -> NetworkConfig {
    let mut n = Config::from_sources(None, &[]).unwrap().network;
    n.max_slots = max_slots;
    n.pool_min = pool_min;
    n.pool_max = pool_max;
    n
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), s)
}

fn leftovers() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/var/run/netns")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| super::layout::parse_index(n, "agentenv-ns-").is_some())
                .collect()
        })
        .unwrap_or_default();
    let (_, links) = run(&["ip", "-o", "link"]);
    v.extend(
        links
            .lines()
            .filter(|l| l.contains(" aenv-"))
            .map(|l| l.to_string()),
    );
    v
}

/// Removes everything agentenv-shaped, whatever happened in the test.
struct Cleanup(Option<Arc<SlotManager>>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            m.shutdown();
        }
        let host = super::host::RealHost::new();
        let m = SlotManager::start_with(Arc::new(host), &cfg(8, 0, 0), &[]);
        if let Ok(m) = m {
            m.shutdown();
        }
        let _ = run(&["ip", "netns", "del", "agentenv-ns-x1"]);
    }
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

#[test]
fn slot_is_built_as_specified_and_leaves_nothing() {
    let _g = serial();
    let mut guard = Cleanup(None);
    let m = SlotManager::start(&cfg(4, 0, 2), &[]).unwrap();
    guard.0 = Some(m.clone());
    let slot = m.acquire().unwrap();
    assert_eq!(slot.index(), 1);
    assert_eq!(slot.host_ip(), Ipv4Addr::new(198, 18, 0, 1));
    assert_eq!(
        slot.netns_path(),
        std::path::Path::new("/var/run/netns/agentenv-ns-1")
    );
    assert_eq!(
        m.stats(),
        SlotStats {
            in_use: 1,
            pooled: 0
        }
    );

    let (ok, out) = run(&["ip", "netns", "list"]);
    assert!(ok && out.contains("agentenv-ns-1"), "{out}");
    let (ok, out) = run(&["ip", "-o", "addr", "show", "dev", "aenv-1"]);
    assert!(ok && out.contains("198.19.0.2/31"), "{out}");
    assert!(!out.contains("inet6"), "{out}");
    let (ok, out) = run(&["ip", "route", "get", "198.18.0.1"]);
    assert!(
        ok && out.contains("via 198.19.0.3 dev aenv-1 src 198.19.0.2"),
        "{out}"
    );
    let (_, out) = run(&["ip", "-n", "agentenv-ns-1", "-o", "addr"]);
    assert!(
        out.contains("veth0") && out.contains("198.19.0.3/31"),
        "{out}"
    );
    assert!(
        out.contains("tap0") && out.contains("169.254.0.22/30"),
        "{out}"
    );
    assert!(!out.contains("inet6"), "{out}");
    let (_, out) = run(&["ip", "-n", "agentenv-ns-1", "-o", "link"]);
    assert!(out.contains("06:00:a9:fe:00:16"), "{out}");
    assert_eq!(out.lines().count(), 3, "{out}");
    let (_, out) = run(&["ip", "-n", "agentenv-ns-1", "route"]);
    assert!(out.contains("default via 198.19.0.2 dev veth0"), "{out}");
    let (_, out) = run(&["ip", "-n", "agentenv-ns-1", "neigh"]);
    assert!(
        out.contains("169.254.0.21 dev tap0 lladdr 06:00:a9:fe:00:15 PERMANENT"),
        "{out}"
    );
    let (ok, out) = run(&[
        "ip",
        "netns",
        "exec",
        "agentenv-ns-1",
        "nft",
        "list",
        "ruleset",
    ]);
    assert!(ok && out.contains("table ip agentenv"), "{out}");
    assert!(out.contains("dnat to 169.254.0.21"), "{out}");
    let (_, out) = run(&[
        "ip",
        "netns",
        "exec",
        "agentenv-ns-1",
        "cat",
        "/proc/sys/net/ipv4/ip_forward",
    ]);
    assert_eq!(out.trim(), "1");
    let (ok, out) = run(&["nft", "list", "table", "inet", "agentenv"]);
    assert!(ok && out.contains("iifname \"aenv-*\" drop"), "{out}");

    drop(slot);
    assert!(
        wait_until(Duration::from_secs(3), || leftovers().is_empty()),
        "{:?}",
        leftovers()
    );
    assert_eq!(m.stats(), SlotStats::default());
    m.shutdown();
    m.shutdown();
    assert!(leftovers().is_empty(), "{:?}", leftovers());
    let (ok, _) = run(&["nft", "list", "table", "inet", "agentenv"]);
    assert!(!ok, "root table still present after shutdown");
}

#[test]
fn pool_reuse_and_dirty_slot_destroyed() {
    let _g = serial();
    let mut guard = Cleanup(None);
    let m = SlotManager::start(&cfg(4, 1, 2), &[]).unwrap();
    guard.0 = Some(m.clone());
    assert!(m.wait_pooled(1, Duration::from_secs(3)));
    let a = m.acquire().unwrap();
    assert_eq!(a.index(), 1);
    // The filler tops the pool up again.
    assert!(m.wait_pooled(1, Duration::from_secs(3)));
    m.release(a);
    assert!(wait_until(Duration::from_secs(3), || m.stats().pooled == 2));
    assert_eq!(m.stats().in_use, 0);

    // Leave an extra link behind: the slot must be destroyed, not pooled.
    let b = m.acquire().unwrap();
    let name = format!("agentenv-ns-{}", b.index());
    let (ok, out) = run(&[
        "ip", "-n", &name, "link", "add", "extra0", "type", "veth", "peer", "extra1",
    ]);
    assert!(ok, "{out}");
    let path = b.netns_path().to_path_buf();
    m.release(b);
    assert!(
        wait_until(Duration::from_secs(3), || !path.exists()),
        "dirty slot kept"
    );

    // The same for an extra nftables table.
    let c = m.acquire().unwrap();
    let name = format!("agentenv-ns-{}", c.index());
    let (ok, out) = run(&[
        "ip",
        "netns",
        "exec",
        &name,
        "nft",
        "add",
        "table",
        "ip",
        "extension",
    ]);
    assert!(ok, "{out}");
    let path = c.netns_path().to_path_buf();
    m.release(c);
    assert!(
        wait_until(Duration::from_secs(3), || !path.exists()),
        "dirty slot kept"
    );

    m.shutdown();
    assert!(leftovers().is_empty(), "{:?}", leftovers());
}

#[test]
fn no_free_slot_when_full() {
    let _g = serial();
    let mut guard = Cleanup(None);
    let m = SlotManager::start(&cfg(2, 0, 2), &[]).unwrap();
    guard.0 = Some(m.clone());
    let a = m.acquire().unwrap();
    let b = m.acquire().unwrap();
    let e = m.acquire().unwrap_err();
    assert_eq!(e.to_string(), "no free network slot (max_slots=2)");
    drop((a, b));
    m.shutdown();
    assert!(leftovers().is_empty(), "{:?}", leftovers());
}

#[test]
fn startup_reclaims_leftovers_but_keeps_others() {
    let _g = serial();
    let mut guard = Cleanup(None);
    for args in [
        &["ip", "netns", "add", "agentenv-ns-3"][..],
        &["ip", "netns", "add", "agentenv-ns-4"][..],
        &["ip", "netns", "add", "agentenv-ns-x1"][..],
        &[
            "ip",
            "link",
            "add",
            "aenv-5",
            "type",
            "veth",
            "peer",
            "aenvpeer5",
        ][..],
        &[
            "ip",
            "link",
            "add",
            "aenv-3",
            "type",
            "veth",
            "peer",
            "name",
            "p3",
            "netns",
            "agentenv-ns-3",
        ][..],
    ] {
        let (ok, out) = run(args);
        assert!(ok, "{args:?}: {out}");
    }
    let m = SlotManager::start(&cfg(8, 0, 2), &[4]).unwrap();
    guard.0 = Some(m.clone());
    let left = leftovers();
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0], "agentenv-ns-4");
    assert!(std::path::Path::new("/var/run/netns/agentenv-ns-x1").exists());
    // Kept indices are not handed out until reclaimed.
    let slots: Vec<Slot> = (0..4).map(|_| m.acquire().unwrap()).collect();
    let idx: Vec<u32> = slots.iter().map(|s| s.index()).collect();
    assert_eq!(idx, vec![1, 2, 3, 5]);
    drop(slots);
    m.reclaim_kept(4).unwrap();
    assert!(!std::path::Path::new("/var/run/netns/agentenv-ns-4").exists());
    m.shutdown();
    let _ = run(&["ip", "netns", "del", "agentenv-ns-x1"]);
    assert!(leftovers().is_empty(), "{:?}", leftovers());
}

fn connect_from(ns: Option<&std::fs::File>, to: SocketAddr) -> bool {
    let attempt = || TcpStream::connect_timeout(&to, Duration::from_millis(400)).is_ok();
    match ns {
        None => attempt(),
        Some(f) => netns::with_netns(f, || Ok(attempt())).unwrap(),
    }
}

#[test]
fn slots_are_isolated() {
    let _g = serial();
    let mut guard = Cleanup(None);
    let m = SlotManager::start(&cfg(4, 0, 2), &[]).unwrap();
    guard.0 = Some(m.clone());
    let a = m.acquire().unwrap();
    let b = m.acquire().unwrap();
    // Stand in for B's guest: give its namespace the guest address and listen there.
    let b_name = format!("agentenv-ns-{}", b.index());
    let (ok, out) = run(&[
        "ip",
        "-n",
        &b_name,
        "addr",
        "add",
        "169.254.0.21/32",
        "dev",
        "lo",
    ]);
    assert!(ok, "{out}");
    let b_ns = b.open_netns().unwrap();
    let listener = netns::with_netns(&b_ns, || {
        TcpListener::bind("169.254.0.21:0").map_err(|e| crate::sys::SysError::from_io("bind", e))
    })
    .unwrap();
    let port = listener.local_addr().unwrap().port();
    let root_listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let root_port = root_listener.local_addr().unwrap().port();
    let a_ns = a.open_netns().unwrap();

    // The host reaches B at its host interaction address.
    assert!(connect_from(
        None,
        SocketAddr::new(b.host_ip().into(), port)
    ));
    // A cannot reach B's host interaction address nor the host.
    assert!(!connect_from(
        Some(&a_ns),
        SocketAddr::new(b.host_ip().into(), port)
    ));
    assert!(!connect_from(
        Some(&a_ns),
        SocketAddr::new(a.host_link_ip().into(), root_port)
    ));
    assert!(!connect_from(
        Some(&a_ns),
        SocketAddr::new(b.host_link_ip().into(), root_port)
    ));
    drop((a, b, a_ns, b_ns));
    m.shutdown();
    assert!(leftovers().is_empty(), "{:?}", leftovers());
}

#[test]
fn create_and_destroy_timing() {
    let _g = serial();
    let _guard = Cleanup(None);
    let m = SlotManager::start(&cfg(64, 0, 0), &[]).unwrap();
    let host = super::host::RealHost::new();
    let policy = super::firewall::FirewallPolicy::from_config(&cfg(64, 0, 0));
    let dir = std::path::PathBuf::from("/var/run/netns");
    let (hc, vc) = (cfg(1, 0, 0).host_cidr(), cfg(1, 0, 0).veth_cidr());
    let mut create = Vec::new();
    let mut destroy = Vec::new();
    for i in 0..15u32 {
        let l = super::layout::SlotLayout::new(&dir, hc, vc, 40 + i);
        let t = Instant::now();
        let parts = super::slot::create(&host, l, &policy).unwrap();
        create.push(t.elapsed());
        let t = Instant::now();
        super::slot::destroy(&host, parts).unwrap();
        destroy.push(t.elapsed());
    }
    create.sort();
    destroy.sort();
    eprintln!(
        "slot create median={:?} min={:?} max={:?}; destroy median={:?}",
        create[create.len() / 2],
        create[0],
        create[create.len() - 1],
        destroy[destroy.len() / 2]
    );
    m.shutdown();
    assert!(leftovers().is_empty(), "{:?}", leftovers());
}

#[test]
fn denied_outbound_inserts_a_refusal_and_the_slot_is_not_reused() {
    let _g = serial();
    let mut guard = Cleanup(None);
    let mut c = cfg(8, 0, 4);
    c.outbound = true;
    c.dns = "192.0.2.53".into();
    let m = SlotManager::start(&c, &[]).unwrap();
    guard.0 = Some(m.clone());
    let mut slot = m.acquire().unwrap();
    let ns = slot
        .netns_path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let (_, before) = run(&[
        "ip", "netns", "exec", &ns, "nft", "list", "chain", "ip", "agentenv", "forward",
    ]);
    assert!(
        !before.contains("oifname \"veth0\" ct state new jump refuse\n"),
        "{before}"
    );
    slot.deny_outbound().unwrap();
    let (ok, after) = run(&[
        "ip", "netns", "exec", &ns, "nft", "list", "chain", "ip", "agentenv", "forward",
    ]);
    assert!(ok, "{after}");
    // The refusal comes before the outbound accept rules.
    let drop_at = after
        .find("iifname \"tap0\" oifname \"veth0\" ct state new jump refuse\n")
        .unwrap_or_else(|| panic!("no refusal rule: {after}"));
    let accept_at = after
        .rfind("oifname \"veth0\" ct state new accept")
        .unwrap();
    assert!(drop_at < accept_at, "{after}");
    let path = slot.netns_path().to_path_buf();
    m.release(slot);
    assert!(
        wait_until(Duration::from_secs(5), || !path.exists()),
        "dedicated slot was pooled"
    );
    assert_eq!(m.stats().pooled, 0);
}
