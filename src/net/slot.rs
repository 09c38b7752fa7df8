//! Creating (network.md §3.2) and destroying (§3.3) one slot, and the public [`Slot`].

use super::filter::DomainFilter;
use super::firewall::{
    slot_ruleset, EgressRules, FirewallPolicy, EGRESS_BYTES, REFUSE, REFUSED, REFUSED_PROTECTED,
};
use super::host::{NetHost, NsHandle, NsSnapshot};
use super::layout::{SlotLayout, TAP_NAME, VETH_NS_NAME};
use super::manager::Shared;
use super::NetError;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;

/// A fully built slot, owned by the pool, a [`Slot`], or the janitor.
pub(crate) struct SlotParts {
    pub layout: SlotLayout,
    pub ns: NsHandle,
    pub clean: NsSnapshot,
    /// Changed for one sandbox (outbound denied): never pooled again.
    pub dedicated: bool,
}

/// Undo steps, registered before the step after the one they undo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Undo {
    RemoveFile,
    Unmount,
    DeleteLink,
}

/// Runs the registered undo steps in reverse order unless disarmed.
struct Rollback<'a> {
    host: &'a dyn NetHost,
    layout: &'a SlotLayout,
    steps: Vec<Undo>,
}

impl Drop for Rollback<'_> {
    fn drop(&mut self) {
        if !self.steps.is_empty() {
            let steps = std::mem::take(&mut self.steps);
            if let Err(e) = undo(self.host, self.layout, &steps) {
                log::error!(
                    "slot={} op=rollback error=\"{e}\" the leftovers are reclaimed at next start",
                    self.layout.index
                );
            }
        }
    }
}

/// Undoes `steps` (in creation order) from the last one back. A failed unmount keeps the
/// namespace file, since its presence marks possible kernel state for startup reclaim.
fn undo(host: &dyn NetHost, l: &SlotLayout, steps: &[Undo]) -> Result<(), NetError> {
    let mut first_err: Option<NetError> = None;
    let mut keep_file = false;
    for step in steps.iter().rev() {
        let r = match step {
            Undo::DeleteLink => host.delete_link(&l.link_name),
            Undo::Unmount => host
                .unmount_netns(&l.ns_path)
                .inspect_err(|_| keep_file = true),
            Undo::RemoveFile if keep_file => continue,
            Undo::RemoveFile => host.remove_ns_file(&l.ns_path),
        };
        if let Err(e) = r {
            first_err.get_or_insert(e.into());
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Builds slot `layout.index` (whose index the caller has reserved).
pub(crate) fn create(
    host: &dyn NetHost,
    layout: SlotLayout,
    policy: &FirewallPolicy,
) -> Result<SlotParts, NetError> {
    let mut rb = Rollback {
        host,
        layout: &layout,
        steps: Vec::new(),
    };
    host.create_ns_file(&layout.ns_path)?;
    rb.steps.push(Undo::RemoveFile);
    let mut ns = host.new_netns(&layout.ns_path)?;
    rb.steps.push(Undo::Unmount);
    // The table names interfaces, it does not need them to exist: nft (~3 ms, most of a
    // slot's creation time) runs while the links are made. Declared after `rb`, the run
    // is killed and reaped before any undo step runs.
    let firewall = host.start_ruleset(Some(&layout.ns_path), &slot_ruleset(&layout, policy))?;
    host.create_veth(&layout)?;
    rb.steps.push(Undo::DeleteLink);
    host.configure_netns(&layout, &mut ns)?;
    host.configure_host_end(&layout)?;
    firewall.wait()?;
    let clean = host.snapshot(&mut ns)?;
    rb.steps.clear();
    drop(rb);
    Ok(SlotParts {
        layout,
        ns,
        clean,
        dedicated: false,
    })
}

/// Tears a slot down: link, then mount, then file (§3.3).
pub(crate) fn destroy(host: &dyn NetHost, parts: SlotParts) -> Result<(), NetError> {
    let SlotParts { layout, ns, .. } = parts;
    drop(ns);
    undo(
        host,
        &layout,
        &[Undo::RemoveFile, Undo::Unmount, Undo::DeleteLink],
    )
}

/// Tears down a leftover slot found at startup, whatever state it is in.
pub(crate) fn reclaim(host: &dyn NetHost, layout: &SlotLayout) -> Result<(), NetError> {
    undo(
        host,
        layout,
        &[Undo::RemoveFile, Undo::Unmount, Undo::DeleteLink],
    )
}

/// Why a released slot cannot be reused (§4.2), or `None` when it is clean.
pub(crate) fn dirt(host: &dyn NetHost, parts: &mut SlotParts) -> Option<String> {
    let mut found = Vec::new();
    match host.processes_in(&parts.layout.ns_path) {
        Ok(p) if p.is_empty() => {}
        Ok(p) => found.push(format!("processes={p:?}")),
        Err(e) => found.push(format!("process check failed: {e}")),
    }
    match host.snapshot(&mut parts.ns) {
        Ok(now) => found.extend(parts.clean.differences(&now)),
        Err(e) => found.push(format!("inspection failed: {e}")),
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// A slot's egress counters (network.md §5.8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EgressCounts {
    /// Bytes the guest sent beyond its slot (IP packets, headers included).
    pub bytes_out: u64,
    /// New outbound connections the sandbox's policy refused (`denyOut`, no internet
    /// access, outbound off, the connection limit, and connections the domain filter
    /// closed). Each TCP connection counts once; other protocols once a packet.
    pub refused: u64,
    /// New outbound connections to what is always refused: the host itself (any of its
    /// addresses, the slot's gateway included), other sandboxes, the denied ranges.
    pub refused_protected: u64,
}

/// One network slot handed to a sandbox. Dropping it without
/// [`SlotManager::release`](super::SlotManager::release) destroys it in the background.
pub struct Slot {
    pub(crate) parts: Option<SlotParts>,
    pub(crate) shared: Arc<Shared>,
    /// The domain filter, while the sandbox's policy names domains (network.md §5.7).
    pub(crate) filter: Option<DomainFilter>,
    /// `allowInternetAccess: false`: no filter ever opens a way out.
    pub(crate) outbound_denied: bool,
}

impl Slot {
    pub(crate) fn new(parts: SlotParts, shared: Arc<Shared>) -> Slot {
        Slot {
            parts: Some(parts),
            shared,
            filter: None,
            outbound_denied: false,
        }
    }

    /// The slot index n.
    pub fn index(&self) -> u32 {
        self.layout().index
    }

    /// `<netns_dir>/agentenv-ns-<n>` (`networkNamespacePath`).
    pub fn netns_path(&self) -> &Path {
        &self.layout().ns_path
    }

    /// `hostInteractionIp`: where the host reaches the guest.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.layout().host_ip
    }

    /// The host end's address, the source of host→guest connections.
    pub fn host_link_ip(&self) -> Ipv4Addr {
        self.layout().link_addr
    }

    /// An O_CLOEXEC descriptor of the namespace, for `setns` in a child (see
    /// [`crate::sys::netns::spawn_in_netns`]).
    pub fn open_netns(&self) -> std::io::Result<std::fs::File> {
        std::fs::File::open(self.netns_path())
    }

    /// Drops every new outbound connection of this slot's guest, whatever `[network]
    /// outbound` says (per-sandbox `allowInternetAccess: false`, network.md §5.4). The
    /// slot is destroyed rather than pooled when released.
    pub fn deny_outbound(&mut self) -> Result<(), NetError> {
        // A kept paused VM's slot comes back with its rule in place.
        if self.outbound_denied {
            return Ok(());
        }
        let parts = self.parts.as_mut().expect("slot parts present until drop");
        parts.dedicated = true;
        self.outbound_denied = true;
        self.filter = None;
        let rule = format!(
            "insert rule ip agentenv forward iifname \"{TAP_NAME}\" oifname \"{VETH_NS_NAME}\" ct state new {REFUSE}\n"
        );
        self.shared
            .host
            .load_ruleset(Some(&parts.layout.ns_path), &rule)
    }

    /// Replaces this sandbox's own egress chain atomically (network.md §5.6); the guest
    /// and its open connections are untouched. The slot is destroyed rather than pooled
    /// when released.
    pub fn set_egress(&mut self, rules: &EgressRules) -> Result<(), NetError> {
        let parts = self.parts.as_mut().expect("slot parts present until drop");
        parts.dedicated = true;
        let filters = rules.filters() && !self.outbound_denied;
        // The filter listens before the rules send anything to it.
        let started = match (&self.filter, filters) {
            (Some(f), true) => {
                f.set_domains(rules.domains.clone());
                None
            }
            (None, true) => Some(self.shared.host.start_filter(
                &parts.layout,
                self.shared.filter.clone(),
                rules.domains.clone(),
            )?),
            (_, false) => None,
        };
        let mut update = rules.clone();
        if !filters {
            update.domains.clear();
        }
        self.shared
            .host
            .load_ruleset(Some(&parts.layout.ns_path), &update.chain_update())?;
        if started.is_some() {
            self.filter = started;
        } else if !filters {
            self.filter = None;
        }
        Ok(())
    }

    /// What this slot's guest sent out and how many of its new connections were
    /// refused since the slot was handed out (network.md §5.8): the slot table's
    /// counters, the root table's count of refusals of host addresses for this slot, and
    /// the domain filter's.
    pub fn egress_counts(&self) -> Result<EgressCounts, NetError> {
        let parts = self.parts.as_ref().expect("slot parts present until drop");
        let mut c = EgressCounts::default();
        for (name, packets, bytes) in self.shared.host.read_counters(&parts.layout.ns_path)? {
            match name.as_str() {
                EGRESS_BYTES => c.bytes_out += bytes,
                REFUSED => c.refused += packets,
                REFUSED_PROTECTED => c.refused_protected += packets,
                _ => {}
            }
        }
        c.refused_protected += self.shared.host.read_root_refusals(parts.layout.host_ip)?;
        if let Some(f) = &self.filter {
            let f = f.counts();
            c.refused += f.refused;
            c.refused_protected += f.refused_protected;
            c.bytes_out += f.bytes_out;
        }
        Ok(c)
    }

    fn layout(&self) -> &SlotLayout {
        &self
            .parts
            .as_ref()
            .expect("slot parts present until drop")
            .layout
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("index", &self.index())
            .field("host_ip", &self.host_ip())
            .finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(parts) = self.parts.take() {
            self.shared.discard(parts);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{Cidr, Config};
    use crate::net::host::RulesetLoad;
    use crate::sys::SysError;
    use parking_lot::Mutex;
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    /// Recording fake host: tracks the kernel objects it "owns" and fails on demand.
    #[derive(Default)]
    pub(crate) struct FakeHost {
        pub fail_at: Mutex<Option<&'static str>>,
        pub calls: Mutex<Vec<String>>,
        pub files: Mutex<BTreeSet<PathBuf>>,
        pub mounts: Mutex<BTreeSet<PathBuf>>,
        pub links: Mutex<BTreeSet<String>>,
    }

    impl FakeHost {
        fn step(&self, name: &'static str) -> Result<(), SysError> {
            self.calls.lock().push(name.to_string());
            if *self.fail_at.lock() == Some(name) {
                return Err(SysError::from_errno(name, libc::EIO));
            }
            Ok(())
        }

        pub fn is_empty(&self) -> bool {
            self.files.lock().is_empty()
                && self.mounts.lock().is_empty()
                && self.links.lock().is_empty()
        }
    }

    impl NetHost for FakeHost {
        fn ensure_netns_dir(&self, _: &Path) -> Result<(), SysError> {
            self.step("ensure_netns_dir")
        }
        fn create_ns_file(&self, path: &Path) -> Result<(), SysError> {
            self.step("create_ns_file")?;
            self.files.lock().insert(path.to_path_buf());
            Ok(())
        }
        fn remove_ns_file(&self, path: &Path) -> Result<(), SysError> {
            self.step("remove_ns_file")?;
            self.files.lock().remove(path);
            Ok(())
        }
        fn new_netns(&self, path: &Path) -> Result<NsHandle, SysError> {
            self.step("new_netns")?;
            self.mounts.lock().insert(path.to_path_buf());
            Ok(NsHandle::default())
        }
        fn unmount_netns(&self, path: &Path) -> Result<(), SysError> {
            self.step("unmount_netns")?;
            self.mounts.lock().remove(path);
            Ok(())
        }
        fn create_veth(&self, l: &SlotLayout) -> Result<(), SysError> {
            self.step("create_veth")?;
            self.links.lock().insert(l.link_name.clone());
            Ok(())
        }
        fn delete_link(&self, name: &str) -> Result<(), SysError> {
            self.step("delete_link")?;
            self.links.lock().remove(name);
            Ok(())
        }
        fn configure_netns(&self, _: &SlotLayout, _: &mut NsHandle) -> Result<(), SysError> {
            self.step("configure_netns")
        }
        fn configure_host_end(&self, _: &SlotLayout) -> Result<(), SysError> {
            self.step("configure_host_end")
        }
        fn start_ruleset(&self, ns: Option<&Path>, _: &str) -> Result<RulesetLoad, NetError> {
            let name = if ns.is_some() {
                "load_slot_ruleset"
            } else {
                "load_root_ruleset"
            };
            self.step(name)
                .map_err(|e| NetError::Firewall(e.to_string()))?;
            Ok(RulesetLoad::done())
        }
        fn snapshot(&self, _: &mut NsHandle) -> Result<NsSnapshot, SysError> {
            self.step("snapshot")?;
            Ok(NsSnapshot::default())
        }
        fn processes_in(&self, _: &Path) -> Result<Vec<u32>, SysError> {
            self.step("processes_in").map(|_| Vec::new())
        }
        fn flush(&self, _: &mut NsHandle) -> Result<(), SysError> {
            self.step("flush")
        }
        fn list_ns_files(&self, _: &Path) -> Result<Vec<u32>, SysError> {
            self.step("list_ns_files")?;
            Ok(Vec::new())
        }
        fn list_slot_links(&self) -> Result<Vec<u32>, SysError> {
            self.step("list_slot_links")?;
            Ok(Vec::new())
        }
        fn enable_root_forwarding(&self) -> Result<(), SysError> {
            self.step("enable_root_forwarding")
        }

        fn start_filter(
            &self,
            _l: &SlotLayout,
            _cfg: crate::net::filter::FilterConfig,
            _domains: Vec<String>,
        ) -> Result<crate::net::filter::DomainFilter, SysError> {
            self.step("start_filter")?;
            Ok(crate::net::filter::DomainFilter::inert())
        }

        fn read_counters(&self, _ns: &Path) -> Result<Vec<(String, u64, u64)>, NetError> {
            self.step("read_counters")?;
            Ok(vec![
                ("egress_bytes".into(), 2, 100),
                ("refused".into(), 3, 180),
                ("refused_protected".into(), 4, 240),
            ])
        }

        fn read_root_refusals(&self, _host_ip: Ipv4Addr) -> Result<u64, NetError> {
            self.step("read_root_refusals")?;
            Ok(5)
        }
    }

    fn layout() -> SlotLayout {
        SlotLayout::new(
            Path::new("/run/test-netns"),
            Cidr::parse("198.18.0.0/16").unwrap(),
            Cidr::parse("198.19.0.0/16").unwrap(),
            3,
        )
    }

    fn policy() -> FirewallPolicy {
        FirewallPolicy::from_config(&Config::from_sources(None, &[]).unwrap().network)
    }

    const STEPS: [&str; 7] = [
        "create_ns_file",
        "new_netns",
        "load_slot_ruleset",
        "create_veth",
        "configure_netns",
        "configure_host_end",
        "snapshot",
    ];

    #[test]
    fn failure_at_every_creation_step_leaves_nothing() {
        for (i, step) in STEPS.iter().enumerate() {
            let host = FakeHost::default();
            *host.fail_at.lock() = Some(step);
            assert!(create(&host, layout(), &policy()).is_err(), "{step}");
            assert!(host.is_empty(), "leftovers after failing at {step}");
            let calls = host.calls.lock().clone();
            assert_eq!(&calls[..=i], &STEPS[..=i], "{step}");
            // Undo runs in reverse order of creation.
            let undo: Vec<&str> = calls[i + 1..].iter().map(String::as_str).collect();
            // Undo steps registered once steps 0 (file), 1 (mount), 3 (veth) succeeded.
            let registered = match i {
                0 => 0,
                1..=3 => i.min(2),
                _ => 3,
            };
            let expected: Vec<&str> = ["delete_link", "unmount_netns", "remove_ns_file"]
                .into_iter()
                .skip(3 - registered)
                .collect();
            assert_eq!(undo, expected, "undo after failing at {step}");
        }
    }

    #[test]
    fn creation_then_destruction_in_reverse_order() {
        let host = FakeHost::default();
        let parts = create(&host, layout(), &policy()).unwrap();
        assert_eq!(host.calls.lock().as_slice(), &STEPS[..]);
        assert!(!host.is_empty());
        host.calls.lock().clear();
        destroy(&host, parts).unwrap();
        assert!(host.is_empty());
        assert_eq!(
            host.calls.lock().as_slice(),
            &["delete_link", "unmount_netns", "remove_ns_file"]
        );
    }

    #[test]
    fn failed_unmount_keeps_the_file_for_reclaim() {
        let host = FakeHost::default();
        let parts = create(&host, layout(), &policy()).unwrap();
        *host.fail_at.lock() = Some("unmount_netns");
        assert!(destroy(&host, parts).is_err());
        assert!(host.links.lock().is_empty());
        assert_eq!(host.files.lock().len(), 1);
    }
}
