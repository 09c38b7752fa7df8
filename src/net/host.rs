//! Every privileged call the slot code makes, behind one trait (youki style), so the
//! rollback paths can be tested with a recording fake. [`RealHost`] is the libc/netlink
//! implementation.

use super::filter::{DomainFilter, FilterConfig};
use super::firewall::ROOT_REFUSALS_SET;
use super::layout::{
    parse_index, SlotLayout, GUEST_GATEWAY, GUEST_IP, GUEST_MAC, GUEST_PREFIX, LINK_PREFIX,
    NS_FILE_PREFIX, TAP_MAC, TAP_NAME, VETH_NS_NAME,
};
use super::NetError;
use crate::sys::netlink::{
    AddrInfo, NeighInfo, NetlinkSocket, RouteInfo, NFT_MSG_GETCHAIN, NFT_MSG_GETRULE,
    NFT_MSG_GETSET, NFT_MSG_GETTABLE, NUD_NOARP, NUD_PERMANENT,
};
use crate::sys::{netns, tun, SysError};
use parking_lot::Mutex;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// Kernel handles kept for a slot's namespace: netlink sockets opened inside it, so the
/// server never has to enter it again. `None` in the fake.
#[derive(Default)]
pub(crate) struct NsHandle {
    pub route: Option<NetlinkSocket>,
    pub netfilter: Option<NetlinkSocket>,
}

/// What a clean slot looks like, captured right after creation and compared on release.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct NsSnapshot {
    pub links: Vec<String>,
    pub addresses: Vec<AddrInfo>,
    pub routes: Vec<RouteInfo>,
    pub permanent_neighbours: Vec<NeighInfo>,
    /// nf_tables tables, chains, rules and sets, as the kernel dumps them.
    pub nftables: Vec<Vec<u8>>,
}

impl NsSnapshot {
    /// What differs between a clean snapshot (`self`) and `now`, for the INFO log line.
    pub fn differences(&self, now: &NsSnapshot) -> Vec<String> {
        let mut d = Vec::new();
        if self.links != now.links {
            d.push(format!("links={:?}", now.links));
        }
        if self.addresses != now.addresses {
            d.push("addresses changed".into());
        }
        if self.routes != now.routes {
            d.push("routes changed".into());
        }
        if self.permanent_neighbours != now.permanent_neighbours {
            d.push("permanent neighbours changed".into());
        }
        if self.nftables != now.nftables {
            d.push("nftables ruleset changed".into());
        }
        d
    }
}

pub(crate) trait NetHost: Send + Sync + 'static {
    fn ensure_netns_dir(&self, dir: &Path) -> Result<(), SysError>;
    fn create_ns_file(&self, path: &Path) -> Result<(), SysError>;
    fn remove_ns_file(&self, path: &Path) -> Result<(), SysError>;
    /// New namespace bound onto `path`, with its sysctls written and `tap0` created.
    /// On error nothing is left mounted.
    fn new_netns(&self, path: &Path) -> Result<NsHandle, SysError>;
    fn unmount_netns(&self, path: &Path) -> Result<(), SysError>;
    fn create_veth(&self, l: &SlotLayout) -> Result<(), SysError>;
    /// Deletes a root-namespace link; a missing link is not an error.
    fn delete_link(&self, name: &str) -> Result<(), SysError>;
    fn configure_netns(&self, l: &SlotLayout, ns: &mut NsHandle) -> Result<(), SysError>;
    fn configure_host_end(&self, l: &SlotLayout) -> Result<(), SysError>;
    /// Starts `nft -f -` with `ruleset` inside the namespace file `ns` (root when `None`);
    /// the result is collected with [`RulesetLoad::wait`].
    fn start_ruleset(&self, ns: Option<&Path>, ruleset: &str) -> Result<RulesetLoad, NetError>;
    /// Loads `ruleset` and waits for the outcome.
    fn load_ruleset(&self, ns: Option<&Path>, ruleset: &str) -> Result<(), NetError> {
        self.start_ruleset(ns, ruleset)?.wait()
    }
    fn snapshot(&self, ns: &mut NsHandle) -> Result<NsSnapshot, SysError>;
    fn processes_in(&self, path: &Path) -> Result<Vec<u32>, SysError>;
    /// Flushes conntrack and the non-permanent neighbour entries.
    fn flush(&self, ns: &mut NsHandle) -> Result<(), SysError>;
    fn list_ns_files(&self, dir: &Path) -> Result<Vec<u32>, SysError>;
    fn list_slot_links(&self) -> Result<Vec<u32>, SysError>;
    fn enable_root_forwarding(&self) -> Result<(), SysError>;
    /// The slot table's named counters inside the namespace file `ns` (network.md §5.8):
    /// (name, packets, bytes) each.
    fn read_counters(&self, ns: &Path) -> Result<Vec<(String, u64, u64)>, NetError>;
    /// The root table's count of refused connections to host addresses from the slot
    /// whose host interaction address is `host_ip` (network.md §5.8); 0 when it has none.
    fn read_root_refusals(&self, host_ip: Ipv4Addr) -> Result<u64, NetError>;
    /// Starts the domain filter of the slot `l` (network.md §5.7).
    fn start_filter(
        &self,
        l: &SlotLayout,
        cfg: FilterConfig,
        domains: Vec<String>,
    ) -> Result<DomainFilter, SysError>;
}

/// The counters of `nft -j list counters` output: (name, packets, bytes).
pub(crate) fn parse_counters(json: &[u8]) -> Result<Vec<(String, u64, u64)>, NetError> {
    let v: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| NetError::Firewall(format!("nft -j output: {e}")))?;
    let items = v["nftables"].as_array().cloned().unwrap_or_default();
    Ok(items
        .iter()
        .filter_map(|i| {
            let c = i.get("counter")?;
            Some((
                c["name"].as_str()?.to_string(),
                c["packets"].as_u64()?,
                c["bytes"].as_u64()?,
            ))
        })
        .collect())
}

/// The packet count of `host_ip`'s element in `nft -j list set` output (0 when absent).
pub(crate) fn parse_set_count(json: &[u8], host_ip: Ipv4Addr) -> Result<u64, NetError> {
    let v: serde_json::Value = serde_json::from_slice(json)
        .map_err(|e| NetError::Firewall(format!("nft -j output: {e}")))?;
    let want = host_ip.to_string();
    let items = v["nftables"].as_array().cloned().unwrap_or_default();
    Ok(items
        .iter()
        .filter_map(|i| i["set"]["elem"].as_array().cloned())
        .flatten()
        .filter(|e| e["elem"]["val"].as_str() == Some(want.as_str()))
        .filter_map(|e| e["elem"]["counter"]["packets"].as_u64())
        .sum())
}

/// An `nft` run in progress. Dropping it without [`RulesetLoad::wait`] kills and reaps
/// the process, so an unwinding slot creation never leaves it behind.
pub(crate) struct RulesetLoad {
    pub child: Option<Child>,
}

impl RulesetLoad {
    /// An already finished load (for fakes).
    #[cfg(test)]
    pub fn done() -> RulesetLoad {
        RulesetLoad { child: None }
    }

    pub fn wait(mut self) -> Result<(), NetError> {
        let Some(child) = self.child.take() else {
            return Ok(());
        };
        let out = child
            .wait_with_output()
            .map_err(|e| NetError::Firewall(format!("waiting for nft: {e}")))?;
        if !out.status.success() {
            return Err(NetError::Firewall(format!(
                "nft exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

impl Drop for RulesetLoad {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The real host: libc, rtnetlink, `/dev/net/tun`, and the `nft` binary.
pub(crate) struct RealHost {
    /// Root-namespace rtnetlink sockets, reused across threads.
    sockets: Mutex<Vec<NetlinkSocket>>,
    nft: PathBuf,
}

impl RealHost {
    /// `nft -j <args>` inside the namespace file `ns` (root when `None`): its stdout.
    fn nft_json(&self, ns: Option<&Path>, args: &[&str]) -> Result<Vec<u8>, NetError> {
        let ns_file = ns.map(netns::open).transpose()?;
        let mut cmd = Command::new(&self.nft);
        cmd.arg("-j").args(args).stdin(Stdio::null()).env_clear();
        if let Some(f) = &ns_file {
            netns::spawn_in_netns(&mut cmd, f);
        }
        let out = cmd
            .output()
            .map_err(|e| NetError::Firewall(format!("cannot run {}: {e}", self.nft.display())))?;
        if !out.status.success() {
            return Err(NetError::Firewall(format!(
                "nft {} exited with {}: {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(out.stdout)
    }

    pub fn new() -> RealHost {
        let nft = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft", "/bin/nft"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("/usr/sbin/nft"));
        RealHost {
            sockets: Mutex::new(Vec::new()),
            nft,
        }
    }

    fn with_root<R>(
        &self,
        f: impl FnOnce(&mut NetlinkSocket) -> Result<R, SysError>,
    ) -> Result<R, SysError> {
        let popped = self.sockets.lock().pop();
        let mut sock = match popped {
            Some(s) => s,
            None => NetlinkSocket::route()?,
        };
        let r = f(&mut sock);
        self.sockets.lock().push(sock);
        r
    }
}

fn missing(e: &SysError) -> bool {
    e.errno() == Some(libc::ENOENT)
}

fn route_sock(ns: &mut NsHandle) -> Result<&mut NetlinkSocket, SysError> {
    ns.route
        .as_mut()
        .ok_or_else(|| SysError::from_errno("namespace has no rtnetlink socket", libc::EBADF))
}

fn require_index(sock: &mut NetlinkSocket, name: &str) -> Result<u32, SysError> {
    sock.link_index(name)?
        .ok_or_else(|| SysError::from_errno(format!("link {name} vanished"), libc::ENODEV))
}

impl NetHost for RealHost {
    fn ensure_netns_dir(&self, dir: &Path) -> Result<(), SysError> {
        netns::ensure_shared_dir(dir)
    }

    fn create_ns_file(&self, path: &Path) -> Result<(), SysError> {
        netns::create_ns_file(path)
    }

    fn remove_ns_file(&self, path: &Path) -> Result<(), SysError> {
        netns::remove_ns_file(path).map(|_| ())
    }

    fn new_netns(&self, path: &Path) -> Result<NsHandle, SysError> {
        netns::with_new_netns(path, || {
            let route = NetlinkSocket::route()?;
            let netfilter = NetlinkSocket::netfilter()?;
            netns::write_sysctl("net.ipv4.ip_forward", "1")?;
            for key in [
                "net.ipv6.conf.all.disable_ipv6",
                "net.ipv6.conf.default.disable_ipv6",
            ] {
                match netns::write_sysctl(key, "1") {
                    Err(e) if missing(&e) => {}
                    r => r?,
                }
            }
            tun::create_persistent_tap(TAP_NAME)?;
            Ok(NsHandle {
                route: Some(route),
                netfilter: Some(netfilter),
            })
        })
    }

    fn unmount_netns(&self, path: &Path) -> Result<(), SysError> {
        netns::unmount_ns_file(path).map(|_| ())
    }

    fn create_veth(&self, l: &SlotLayout) -> Result<(), SysError> {
        let ns = netns::open(&l.ns_path)?;
        self.with_root(|s| s.create_veth(&l.link_name, VETH_NS_NAME, ns.as_fd()))
    }

    fn delete_link(&self, name: &str) -> Result<(), SysError> {
        self.with_root(|s| s.delete_link(name)).map(|_| ())
    }

    fn configure_netns(&self, l: &SlotLayout, ns: &mut NsHandle) -> Result<(), SysError> {
        let s = route_sock(ns)?;
        s.set_link_up("lo", None)?;
        let veth = require_index(s, VETH_NS_NAME)?;
        s.add_address(veth, l.veth_addr, 31)?;
        s.set_link_up(VETH_NS_NAME, None)?;
        let tap = require_index(s, TAP_NAME)?;
        s.set_link_up(TAP_NAME, Some(TAP_MAC))?;
        s.add_address(tap, GUEST_GATEWAY, GUEST_PREFIX)?;
        s.add_route(Ipv4Addr::UNSPECIFIED, 0, Some(l.link_addr), veth, None)?;
        s.add_permanent_neighbour(tap, GUEST_IP, GUEST_MAC)
    }

    fn configure_host_end(&self, l: &SlotLayout) -> Result<(), SysError> {
        self.with_root(|s| {
            let idx = require_index(s, &l.link_name)?;
            s.add_address(idx, l.link_addr, 31)?;
            let key = format!("net/ipv6/conf/{}/disable_ipv6", l.link_name);
            match netns::write_sysctl(&key, "1") {
                Err(e) if missing(&e) => {}
                r => r?,
            }
            s.set_link_up(&l.link_name, None)?;
            s.add_route(l.host_ip, 32, Some(l.veth_addr), idx, Some(l.link_addr))
        })
    }

    fn start_ruleset(&self, ns: Option<&Path>, ruleset: &str) -> Result<RulesetLoad, NetError> {
        let ns_file = ns.map(netns::open).transpose()?;
        let mut cmd = Command::new(&self.nft);
        cmd.args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env_clear();
        if let Some(f) = &ns_file {
            netns::spawn_in_netns(&mut cmd, f);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| NetError::Firewall(format!("cannot run {}: {e}", self.nft.display())))?;
        drop(ns_file);
        if let Some(mut stdin) = child.stdin.take() {
            // The ruleset fits in the pipe buffer; a write error shows up as nft's exit
            // status in `wait`.
            let _ = stdin.write_all(ruleset.as_bytes());
        }
        Ok(RulesetLoad { child: Some(child) })
    }

    fn snapshot(&self, ns: &mut NsHandle) -> Result<NsSnapshot, SysError> {
        let s = route_sock(ns)?;
        let mut links: Vec<String> = s.links()?.into_iter().map(|l| l.name).collect();
        links.sort();
        let mut addresses = s.addresses()?;
        addresses.sort();
        let mut routes = s.routes()?;
        routes.sort();
        let mut permanent_neighbours: Vec<NeighInfo> = s
            .neighbours()?
            .into_iter()
            .filter(|n| n.state & NUD_PERMANENT != 0)
            .collect();
        permanent_neighbours.sort();
        let nf = ns.netfilter.as_mut().ok_or_else(|| {
            SysError::from_errno("namespace has no nfnetlink socket", libc::EBADF)
        })?;
        let mut nftables = Vec::new();
        for kind in [
            NFT_MSG_GETTABLE,
            NFT_MSG_GETCHAIN,
            NFT_MSG_GETRULE,
            NFT_MSG_GETSET,
        ] {
            let mut objs = nf.nft_dump(kind)?;
            objs.sort();
            nftables.extend(objs);
        }
        Ok(NsSnapshot {
            links,
            addresses,
            routes,
            permanent_neighbours,
            nftables,
        })
    }

    fn processes_in(&self, path: &Path) -> Result<Vec<u32>, SysError> {
        Ok(netns::pids_in_netns(netns::ns_id(path)?))
    }

    fn flush(&self, ns: &mut NsHandle) -> Result<(), SysError> {
        if let Some(nf) = ns.netfilter.as_mut() {
            nf.flush_conntrack()?;
        }
        let s = route_sock(ns)?;
        for n in s.neighbours()? {
            if n.state & (NUD_PERMANENT | NUD_NOARP) == 0 && !n.dst.is_empty() {
                s.delete_neighbour(&n)?;
            }
        }
        Ok(())
    }

    fn list_ns_files(&self, dir: &Path) -> Result<Vec<u32>, SysError> {
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(SysError::from_io(format!("list {}", dir.display()), e)),
        };
        let mut v: Vec<u32> = rd
            .flatten()
            .filter_map(|e| parse_index(e.file_name().to_str()?, NS_FILE_PREFIX))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    fn list_slot_links(&self) -> Result<Vec<u32>, SysError> {
        let links = self.with_root(|s| s.links())?;
        let mut v: Vec<u32> = links
            .iter()
            .filter_map(|l| parse_index(&l.name, LINK_PREFIX))
            .collect();
        v.sort_unstable();
        Ok(v)
    }

    fn enable_root_forwarding(&self) -> Result<(), SysError> {
        netns::write_sysctl("net.ipv4.ip_forward", "1")
    }

    fn start_filter(
        &self,
        l: &SlotLayout,
        cfg: FilterConfig,
        domains: Vec<String>,
    ) -> Result<DomainFilter, SysError> {
        DomainFilter::start(l.index, &l.ns_path, cfg, domains)
    }

    fn read_counters(&self, ns: &Path) -> Result<Vec<(String, u64, u64)>, NetError> {
        let out = self.nft_json(Some(ns), &["list", "counters", "table", "ip", "agentenv"])?;
        parse_counters(&out)
    }

    fn read_root_refusals(&self, host_ip: Ipv4Addr) -> Result<u64, NetError> {
        let set = ["list", "set", "inet", "agentenv", ROOT_REFUSALS_SET];
        parse_set_count(&self.nft_json(None, &set)?, host_ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_refusal_count_is_read_from_its_element_of_the_root_set() {
        let json = br#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"set": {"family": "inet", "name": "refused_protected", "table": "agentenv",
             "elem": [{"elem": {"val": "198.18.0.7", "counter": {"packets": 3, "bytes": 180}}},
                      {"elem": {"val": "198.18.0.8", "counter": {"packets": 9, "bytes": 540}}}]}}]}"#;
        let ip = |s: &str| s.parse().unwrap();
        assert_eq!(parse_set_count(json, ip("198.18.0.7")).unwrap(), 3);
        assert_eq!(parse_set_count(json, ip("198.18.0.9")).unwrap(), 0);
        let empty = br#"{"nftables": [{"set": {"name": "refused_protected"}}]}"#;
        assert_eq!(parse_set_count(empty, ip("198.18.0.7")).unwrap(), 0);
        assert!(parse_set_count(b"not json", ip("198.18.0.7")).is_err());
    }
}
