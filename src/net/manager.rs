//! The slot manager: index allocation, warm pool with its filler thread, release checks
//! and background destruction on a janitor thread, startup reclaim, shutdown (§4, §6).

use super::dns::{upstream_resolvers, DnsForwarder};
use super::filter::FilterConfig;
use super::firewall::{forget_root_refusals, root_ruleset, FirewallPolicy, ROOT_REMOVE};
use super::host::{NetHost, RealHost};
use super::layout::SlotLayout;
use super::slot::{self, Slot, SlotParts};
use super::NetError;
use crate::config::{Cidr, NetworkConfig};
use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Counts for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotStats {
    /// Slots handed out and not yet released.
    pub in_use: usize,
    /// Ready slots waiting in the pool.
    pub pooled: usize,
}

enum Job {
    Release(SlotParts),
    Destroy(SlotParts),
    Stop,
}

struct State {
    /// `used[n]`: index n is taken (pooled, in use, being built or torn down, or kept).
    used: Vec<bool>,
    /// Leftover indices kept at startup until [`SlotManager::reclaim_kept`].
    kept: Vec<u32>,
    pool: VecDeque<SlotParts>,
    in_use: usize,
    creating: usize,
    stopping: bool,
    janitor_stopped: bool,
}

pub(crate) struct Shared {
    pub(crate) host: Arc<dyn NetHost>,
    netns_dir: PathBuf,
    host_cidr: Cidr,
    veth_cidr: Cidr,
    max_slots: u32,
    pool_min: usize,
    pool_max: usize,
    policy: FirewallPolicy,
    /// What every slot's domain filter needs (network.md §5.7).
    pub(crate) filter: FilterConfig,
    state: Mutex<State>,
    filler_wake: Condvar,
    jobs: Sender<Job>,
}

impl Shared {
    fn layout(&self, index: u32) -> SlotLayout {
        SlotLayout::new(&self.netns_dir, self.host_cidr, self.veth_cidr, index)
    }

    fn reserve(st: &mut State) -> Option<u32> {
        let n = st.used.iter().skip(1).position(|u| !u)? as u32 + 1;
        st.used[n as usize] = true;
        Some(n)
    }

    fn free(&self, index: u32) {
        self.state.lock().used[index as usize] = false;
    }

    /// Builds slot `index` (already reserved); frees the index on failure.
    fn build(&self, index: u32) -> Result<SlotParts, NetError> {
        let t = Instant::now();
        match slot::create(&*self.host, self.layout(index), &self.policy) {
            Ok(p) => {
                log::debug!("slot={index} op=create us={}", t.elapsed().as_micros());
                Ok(p)
            }
            Err(e) => {
                log::warn!("slot={index} op=create error=\"{e}\"");
                self.free(index);
                Err(e)
            }
        }
    }

    /// A slot dropped without release: destroyed in the background.
    pub(crate) fn discard(&self, parts: SlotParts) {
        self.state.lock().in_use -= 1;
        self.submit(Job::Destroy(parts));
    }

    fn submit(&self, job: Job) {
        let inline = {
            let st = self.state.lock();
            if st.janitor_stopped {
                Some(job)
            } else {
                // The receiver lives until janitor_stopped is set, under this lock.
                let _ = self.jobs.send(job);
                None
            }
        };
        if let Some(job) = inline {
            self.run(job);
        }
    }

    fn run(&self, job: Job) {
        match job {
            Job::Release(parts) => self.recycle(parts),
            Job::Destroy(parts) => self.destroy(parts),
            Job::Stop => {}
        }
    }

    fn destroy(&self, parts: SlotParts) {
        let index = parts.layout.index;
        self.forget_root_refusals(&parts);
        let t = Instant::now();
        match slot::destroy(&*self.host, parts) {
            Ok(()) => {
                log::debug!("slot={index} op=destroy us={}", t.elapsed().as_micros());
                self.free(index);
            }
            // The index stays reserved: its kernel objects may still exist.
            Err(e) => log::error!(
                "slot={index} op=destroy error=\"{e}\" the index stays unused until restart"
            ),
        }
    }

    /// Drops the root table's refusal count of the slot (network.md §5.8), so the index's
    /// next sandbox starts from zero. A failure (the root table already gone at shutdown)
    /// leaves at worst a stale count behind.
    fn forget_root_refusals(&self, parts: &SlotParts) {
        let forget = forget_root_refusals(parts.layout.host_ip);
        if let Err(e) = self.host.load_ruleset(None, &forget) {
            log::debug!(
                "slot={} op=forget_root_refusals error=\"{e}\"",
                parts.layout.index
            );
        }
    }

    /// Release checks (§4.2–4.4): clean → flush → pool tail, else destroy.
    fn recycle(&self, mut parts: SlotParts) {
        let index = parts.layout.index;
        if parts.dedicated {
            log::debug!("slot={index} op=release outcome=destroy reason=dedicated");
            return self.destroy(parts);
        }
        if let Some(found) = slot::dirt(&*self.host, &mut parts) {
            log::info!("slot={index} op=release outcome=destroy reason=\"not clean: {found}\"");
            return self.destroy(parts);
        }
        if let Err(e) = self.host.flush(&mut parts.ns) {
            log::info!("slot={index} op=release outcome=destroy reason=\"flush failed: {e}\"");
            return self.destroy(parts);
        }
        // The next sandbox's counters start at zero.
        let reset = "reset counters table ip agentenv\n";
        self.forget_root_refusals(&parts);
        if let Err(e) = self.host.load_ruleset(Some(&parts.layout.ns_path), reset) {
            log::info!(
                "slot={index} op=release outcome=destroy reason=\"counter reset failed: {e}\""
            );
            return self.destroy(parts);
        }
        let mut st = self.state.lock();
        if !st.stopping && st.pool.len() < self.pool_max {
            st.pool.push_back(parts);
            log::debug!("slot={index} op=release outcome=pooled");
        } else {
            drop(st);
            self.destroy(parts);
        }
    }

    fn filler(&self) {
        loop {
            let index = {
                let mut st = self.state.lock();
                loop {
                    if st.stopping {
                        return;
                    }
                    if st.pool.len() + st.creating < self.pool_min {
                        if let Some(n) = Self::reserve(&mut st) {
                            st.creating += 1;
                            break n;
                        }
                    }
                    self.filler_wake.wait_for(&mut st, Duration::from_secs(1));
                }
            };
            let built = self.build(index);
            let mut st = self.state.lock();
            st.creating -= 1;
            match built {
                Ok(parts) if !st.stopping => st.pool.push_back(parts),
                Ok(parts) => {
                    drop(st);
                    self.destroy(parts);
                }
                Err(_) => {
                    // Back off so a broken host does not spin; woken early on shutdown.
                    self.filler_wake.wait_for(&mut st, Duration::from_secs(1));
                }
            }
        }
    }

    fn janitor(&self, rx: Receiver<Job>) {
        for job in rx {
            if let Job::Stop = job {
                return;
            }
            self.run(job);
        }
    }
}

/// The DNS forwarder when guests may reach out and the host names a resolver.
/// The upstream resolvers, as the forwarder and the domain filter ask them.
fn resolver_addrs(cfg: &NetworkConfig) -> Vec<SocketAddr> {
    upstream_resolvers(cfg)
        .iter()
        .map(|ip| SocketAddr::from((*ip, 53)))
        .collect()
}

fn start_dns(cfg: &NetworkConfig) -> Result<Option<DnsForwarder>, NetError> {
    let to = resolver_addrs(cfg);
    if !cfg.outbound || to.is_empty() {
        return Ok(None);
    }
    DnsForwarder::start(&to, cfg.host_cidr())
        .map(Some)
        .map_err(|e| NetError::Sys(crate::sys::SysError::from_io("bind the DNS forwarder", e)))
}

/// Owns every network slot of the server.
pub struct SlotManager {
    shared: Arc<Shared>,
    /// The guests' DNS forwarder (§5.5), with `outbound` and a resolver to forward to.
    dns: Mutex<Option<DnsForwarder>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    shut_down: Mutex<bool>,
}

impl SlotManager {
    /// Reclaims leftovers (every `agentenv-ns-<digits>` file and `aenv-<digits>` link,
    /// except the `keep` indices), installs the root table, and starts the pool filler
    /// (`pool_min` slots) and the janitor.
    pub fn start(cfg: &NetworkConfig, keep: &[u32]) -> Result<Arc<SlotManager>, NetError> {
        Self::start_with(Arc::new(RealHost::new()), cfg, keep)
    }

    pub(crate) fn start_with(
        host: Arc<dyn NetHost>,
        cfg: &NetworkConfig,
        keep: &[u32],
    ) -> Result<Arc<SlotManager>, NetError> {
        host.ensure_netns_dir(&cfg.netns_dir)?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut policy = FirewallPolicy::from_config(cfg);
        let dns = start_dns(cfg)?;
        policy.dns_port = dns.as_ref().map(|d| d.port());
        let mut used = vec![false; cfg.max_slots as usize + 1];
        used[0] = true;
        let kept: Vec<u32> = keep
            .iter()
            .copied()
            .filter(|&n| n >= 1 && n <= cfg.max_slots)
            .collect();
        for &n in &kept {
            used[n as usize] = true;
        }
        let shared = Arc::new(Shared {
            host: host.clone(),
            netns_dir: cfg.netns_dir.clone(),
            host_cidr: cfg.host_cidr(),
            veth_cidr: cfg.veth_cidr(),
            max_slots: cfg.max_slots,
            pool_min: cfg.pool_min as usize,
            pool_max: cfg.pool_max as usize,
            filter: FilterConfig {
                resolvers: resolver_addrs(cfg),
                policy: policy.clone(),
            },
            policy,
            state: Mutex::new(State {
                used,
                kept,
                pool: VecDeque::new(),
                in_use: 0,
                creating: 0,
                stopping: false,
                janitor_stopped: false,
            }),
            filler_wake: Condvar::new(),
            jobs: tx,
        });
        reclaim_leftovers(&shared, keep)?;
        host.load_ruleset(None, &root_ruleset(&shared.policy))?;
        if shared.policy.outbound {
            host.enable_root_forwarding()?;
        }
        let mut threads = Vec::new();
        let s = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("net-pool-filler".into())
                .spawn(move || s.filler())
                .map_err(|e| NetError::Sys(crate::sys::SysError::from_io("spawn thread", e)))?,
        );
        let s = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("net-janitor".into())
                .spawn(move || s.janitor(rx))
                .map_err(|e| NetError::Sys(crate::sys::SysError::from_io("spawn thread", e)))?,
        );
        log::info!(
            "op=net_start max_slots={} pool_min={} pool_max={} outbound={}",
            cfg.max_slots,
            cfg.pool_min,
            cfg.pool_max,
            cfg.outbound
        );
        Ok(Arc::new(SlotManager {
            shared,
            dns: Mutex::new(dns),
            threads: Mutex::new(threads),
            shut_down: Mutex::new(false),
        }))
    }

    /// The head of the pool, or a slot made on the spot.
    pub fn acquire(&self) -> Result<Slot, NetError> {
        let sh = &self.shared;
        let index = {
            let mut st = sh.state.lock();
            if st.stopping {
                return Err(NetError::ShuttingDown);
            }
            if let Some(parts) = st.pool.pop_front() {
                st.in_use += 1;
                drop(st);
                sh.filler_wake.notify_one();
                return Ok(Slot::new(parts, sh.clone()));
            }
            Shared::reserve(&mut st).ok_or(NetError::NoFreeSlot {
                max_slots: sh.max_slots,
            })?
        };
        let parts = sh.build(index)?;
        sh.state.lock().in_use += 1;
        sh.filler_wake.notify_one();
        Ok(Slot::new(parts, sh.clone()))
    }

    /// Gives a slot back after its VM exited. Checks, flush and pooling (or destruction)
    /// run on the janitor thread; this returns at once.
    pub fn release(&self, mut slot: Slot) {
        if let Some(parts) = slot.parts.take() {
            self.shared.state.lock().in_use -= 1;
            self.shared.submit(Job::Release(parts));
        }
    }

    /// Tears down a leftover slot kept at startup (§6.3) and makes its index usable.
    pub fn reclaim_kept(&self, index: u32) -> Result<(), NetError> {
        let sh = &self.shared;
        {
            let mut st = sh.state.lock();
            let Some(pos) = st.kept.iter().position(|&k| k == index) else {
                return Ok(());
            };
            st.kept.remove(pos);
        }
        slot::reclaim(&*sh.host, &sh.layout(index))?;
        sh.free(index);
        sh.filler_wake.notify_one();
        Ok(())
    }

    /// Destroys the pooled slots and removes the root table. Idempotent. Slots still in
    /// use are destroyed when released or dropped.
    pub fn shutdown(&self) {
        {
            let mut done = self.shut_down.lock();
            if *done {
                return;
            }
            *done = true;
        }
        let sh = &self.shared;
        sh.state.lock().stopping = true;
        sh.filler_wake.notify_all();
        {
            let mut st = sh.state.lock();
            st.janitor_stopped = true;
            let _ = sh.jobs.send(Job::Stop);
        }
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        let pooled: Vec<SlotParts> = sh.state.lock().pool.drain(..).collect();
        let n = pooled.len();
        for parts in pooled {
            sh.destroy(parts);
        }
        if let Some(mut d) = self.dns.lock().take() {
            d.stop();
        }
        if let Err(e) = sh.host.load_ruleset(None, ROOT_REMOVE) {
            log::error!("op=net_shutdown error=\"cannot remove table inet agentenv: {e}\"");
        }
        log::info!("op=net_shutdown destroyed_pooled={n}");
    }

    pub fn stats(&self) -> SlotStats {
        let st = self.shared.state.lock();
        SlotStats {
            in_use: st.in_use,
            pooled: st.pool.len(),
        }
    }

    /// Waits until the pool holds at least `n` slots (tests, startup readiness).
    pub fn wait_pooled(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.stats().pooled >= n {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stats().pooled >= n
    }
}

impl Drop for SlotManager {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// §6.2: every `agentenv-ns-<digits>` file, then every `aenv-<digits>` link, except `keep`.
fn reclaim_leftovers(sh: &Shared, keep: &[u32]) -> Result<(), NetError> {
    let host = &*sh.host;
    let mut count = 0;
    for n in host.list_ns_files(&sh.netns_dir)? {
        if keep.contains(&n) {
            continue;
        }
        slot::reclaim(host, &sh.layout(n))?;
        count += 1;
    }
    for n in host.list_slot_links()? {
        if keep.contains(&n) {
            continue;
        }
        host.delete_link(&format!("aenv-{n}"))?;
        count += 1;
    }
    if count > 0 {
        log::info!("op=net_reclaim reclaimed={count}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::slot::tests::FakeHost;

    fn cfg(max_slots: u32, pool_min: u32, pool_max: u32) -> NetworkConfig {
        let mut n = crate::config::Config::from_sources(None, &[])
            .unwrap()
            .network;
        n.netns_dir = PathBuf::from("/run/test-netns");
        n.max_slots = max_slots;
        n.pool_min = pool_min;
        n.pool_max = pool_max;
        n
    }

    #[test]
    fn pool_fill_acquire_exhaust_release_shutdown() {
        let host = Arc::new(FakeHost::default());
        let m = SlotManager::start_with(host.clone(), &cfg(3, 2, 2), &[]).unwrap();
        assert!(m.wait_pooled(2, Duration::from_secs(2)));
        let a = m.acquire().unwrap();
        let b = m.acquire().unwrap();
        let c = m.acquire().unwrap();
        let mut idx = [a.index(), b.index(), c.index()];
        idx.sort();
        assert_eq!(idx, [1, 2, 3]);
        assert!(matches!(
            m.acquire(),
            Err(NetError::NoFreeSlot { max_slots: 3 })
        ));
        assert_eq!(
            m.stats(),
            SlotStats {
                in_use: 3,
                pooled: 0
            }
        );
        m.release(a);
        m.release(b);
        drop(c);
        let deadline = Instant::now() + Duration::from_secs(2);
        while m.stats().pooled != 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            m.stats(),
            SlotStats {
                in_use: 0,
                pooled: 2
            }
        );
        m.shutdown();
        assert!(host.is_empty());
        assert!(host.calls.lock().iter().any(|c| c == "load_root_ruleset"));
        assert!(matches!(m.acquire(), Err(NetError::ShuttingDown)));
    }

    #[test]
    fn failed_creation_frees_the_index() {
        let host = Arc::new(FakeHost::default());
        let m = SlotManager::start_with(host.clone(), &cfg(1, 0, 1), &[]).unwrap();
        *host.fail_at.lock() = Some("configure_host_end");
        assert!(m.acquire().is_err());
        assert!(host.is_empty());
        *host.fail_at.lock() = None;
        let s = m.acquire().unwrap();
        assert_eq!(s.index(), 1);
        drop(s);
        m.shutdown();
        assert!(host.is_empty());
    }
}
