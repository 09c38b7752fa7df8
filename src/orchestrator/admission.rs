//! Admission control: a VM (sandbox or template build) starts only while the host has the
//! memory headroom for it, and within the operator's caps (docs/configuration.md).
//!
//! Idle guests touch a small part of their nominal memory (~28 MiB of 256, docs/
//! performance.md), so summing nominal sizes would turn a host that holds hundreds into
//! one that holds a few dozen. The headroom check instead reads what the kernel says can
//! still be allocated (`MemAvailable`) and its memory pressure (PSI): a start needs
//! `reserved_memory_mb` kept for the host plus `vm_startup_mb` for itself (less for a
//! smaller VM), counting what starts of the last few seconds have not touched yet. The
//! nominal sums stay as operator caps (`max_memory_mb`, `max_vcpus`, `vcpu_overcommit`).
//!
//! A VM's [`Reservation`] is taken in `supervisor::start` before its supervisor thread
//! exists and lives on that thread, so it is given back exactly when the VM is gone
//! (delete, pause, crash, failed start), whatever path ended it. A standby takes its
//! share when it is made, but holds only what its warm-up touched, and the sandbox it
//! becomes grows past that, so the claim checks the host's headroom again ([`Admission::admit_claim`]): when headroom is
//! below the reserve, creates (with or without a standby) and resumes are all refused.
//!
//! Every refusal is counted by what was exhausted (`agentenv_admission_refusals_total`).

use super::error::OrchError;
use super::sides::HostFacts;
use crate::config::AdmissionConfig;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a new VM counts as not yet having touched its startup memory.
const SETTLE: Duration = Duration::from_secs(5);

/// What running VMs hold now, and the bounds.
pub(crate) struct Admission {
    limits: Limits,
    headroom: Option<(Headroom, Arc<dyn HostFacts>)>,
    used: Mutex<Usage>,
    refusals: Refusals,
}

/// What the standby pool means to a start now ([`Admission::would_admit`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Standbys {
    /// A standby of the template waits: a create claims it.
    pub claims: bool,
    /// The shares (memory MiB, vCPUs) all standbys hold.
    pub held: (u64, u64),
}

/// What a VM lacks, and the operator's message.
type Short = (Exhausted, String);

/// What a refused start lacked: the `reason` label of `agentenv_admission_refusals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exhausted {
    MemoryCap,
    VcpuCap,
    HostMemory,
    HostPressure,
}

impl Exhausted {
    const ALL: [Exhausted; 4] = [
        Exhausted::MemoryCap,
        Exhausted::VcpuCap,
        Exhausted::HostMemory,
        Exhausted::HostPressure,
    ];

    fn label(self) -> &'static str {
        match self {
            Exhausted::MemoryCap => "memory_cap",
            Exhausted::VcpuCap => "vcpu_cap",
            Exhausted::HostMemory => "host_memory",
            Exhausted::HostPressure => "host_pressure",
        }
    }
}

/// Refused starts since the server started, by [`Exhausted`].
#[derive(Debug, Default)]
struct Refusals([AtomicU64; 4]);

impl Refusals {
    /// Counts the refusal and makes its 429.
    fn refuse(&self, what: Exhausted, message: String) -> OrchError {
        self.0[what as usize].fetch_add(1, Ordering::Relaxed);
        OrchError::TooMany(message)
    }

    fn get(&self, what: Exhausted) -> u64 {
        self.0[what as usize].load(Ordering::Relaxed)
    }
}

/// The operator's caps on nominal sums; `None` = no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub memory_mb: Option<u64>,
    pub vcpus: Option<u64>,
}

/// What a start needs of the host's real memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Headroom {
    pub reserve_mb: u64,
    pub startup_mb: u64,
    /// 0 = pressure not checked.
    pub max_pressure_pct: f64,
}

#[derive(Debug, Default)]
struct Usage {
    memory_mb: u64,
    vcpus: u64,
    /// Starts within [`SETTLE`], with the startup memory each counts for.
    settling: VecDeque<(Instant, u64)>,
}

impl Limits {
    /// The configured caps: `max_memory_mb` (0 = none), `max_vcpus`, else
    /// `vcpu_overcommit` × the host's CPUs (both 0 = none).
    pub fn from_config(cfg: &AdmissionConfig, host_cpus: u32) -> Limits {
        let vcpus = match (cfg.max_vcpus, cfg.vcpu_overcommit) {
            (0, 0) => None,
            (0, over) => Some(u64::from(host_cpus) * u64::from(over)),
            (n, _) => Some(n),
        };
        Limits {
            memory_mb: (cfg.max_memory_mb > 0).then_some(cfg.max_memory_mb),
            vcpus,
        }
    }
}

impl Headroom {
    pub fn from_config(cfg: &AdmissionConfig) -> Headroom {
        Headroom {
            reserve_mb: cfg.reserved_memory_mb,
            startup_mb: cfg.vm_startup_mb,
            max_pressure_pct: cfg.max_memory_pressure_pct,
        }
    }
}

impl Admission {
    /// Caps only, no look at the host (unit tests).
    #[cfg(test)]
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            headroom: None,
            used: Mutex::new(Usage::default()),
            refusals: Refusals::default(),
        })
    }

    /// Caps and the host's headroom.
    pub fn with_host(
        limits: Limits,
        headroom: Headroom,
        host: Arc<dyn HostFacts>,
    ) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            headroom: Some((headroom, host)),
            used: Mutex::new(Usage::default()),
            refusals: Refusals::default(),
        })
    }

    /// Reserves a VM's memory and vCPUs, or says (429) what is exhausted.
    pub fn reserve(self: &Arc<Self>, memory_mb: u32, vcpus: u32) -> Result<Reservation, OrchError> {
        let (memory_mb, vcpus) = (u64::from(memory_mb), u64::from(vcpus));
        let mut used = self.used.lock();
        self.check_caps(&used, memory_mb, vcpus)?;
        let startup = self.check_headroom(&mut used, memory_mb)?;
        used.memory_mb += memory_mb;
        used.vcpus += vcpus;
        used.settling.push_back((Instant::now(), startup));
        Ok(Reservation {
            admission: self.clone(),
            memory_mb,
            vcpus,
        })
    }

    /// A create claims a standby, which took its share (and passed the caps) when it was
    /// made but has loaded no guest memory yet: the host's headroom now, or 429. The
    /// start then counts as settling like any other.
    pub fn admit_claim(&self, share: &Reservation) -> Result<(), OrchError> {
        let mut used = self.used.lock();
        let startup = self.check_headroom(&mut used, share.memory_mb)?;
        used.settling.push_back((Instant::now(), startup));
        Ok(())
    }

    /// Whether a VM of this size would be admitted now, without reserving anything
    /// (a cluster node asks before it places a create here): why not, when not. A
    /// create that claims a standby needs the host's headroom only (`standby.claims`);
    /// another start may take back the shares standbys hold (`standby.held`).
    pub fn would_admit(&self, memory_mb: u32, vcpus: u32, standby: Standbys) -> Result<(), String> {
        let (memory_mb, vcpus) = (u64::from(memory_mb), u64::from(vcpus));
        let mut used = self.used.lock();
        let caps = if standby.claims {
            Ok(())
        } else {
            let (m, v) = standby.held;
            let (memory, cpus) = (
                used.memory_mb.saturating_sub(m),
                used.vcpus.saturating_sub(v),
            );
            self.caps_room((memory, cpus), memory_mb, vcpus)
        };
        caps.and_then(|()| self.headroom_room(&mut used, memory_mb).map(|_| ()))
            .map_err(|(_, why)| why)
    }

    fn check_caps(&self, used: &Usage, memory_mb: u64, vcpus: u64) -> Result<(), OrchError> {
        self.caps_room((used.memory_mb, used.vcpus), memory_mb, vcpus)
            .map_err(|(kind, why)| self.refusals.refuse(kind, why))
    }

    /// The caps' verdict on a VM of this size when (memory MiB, vCPUs) are in use.
    fn caps_room(
        &self,
        (in_use_mb, in_use_vcpus): (u64, u64),
        memory_mb: u64,
        vcpus: u64,
    ) -> Result<(), Short> {
        if let Some(limit) = self.limits.memory_mb.filter(|l| in_use_mb + memory_mb > *l) {
            return Err((Exhausted::MemoryCap, format!(
                "not enough memory for another VM: {in_use_mb} of {limit} MiB in use by running sandboxes and builds, {memory_mb} MiB asked ([admission] max_memory_mb); pause or delete a sandbox"
            )));
        }
        if let Some(limit) = self.limits.vcpus.filter(|l| in_use_vcpus + vcpus > *l) {
            return Err((Exhausted::VcpuCap, format!(
                "not enough vCPUs for another VM: {in_use_vcpus} of {limit} in use by running sandboxes and builds, {vcpus} asked ([admission] max_vcpus, vcpu_overcommit); pause or delete a sandbox"
            )));
        }
        Ok(())
    }

    /// The startup memory this VM counts for while it settles; 429 when the host lacks
    /// it. Unknown host figures admit (a host without /proc/meminfo has the caps only).
    fn check_headroom(&self, used: &mut Usage, memory_mb: u64) -> Result<u64, OrchError> {
        self.headroom_room(used, memory_mb)
            .map_err(|(kind, why)| self.refusals.refuse(kind, why))
    }

    fn headroom_room(&self, used: &mut Usage, memory_mb: u64) -> Result<u64, Short> {
        let Some((room, host)) = &self.headroom else {
            return Ok(0);
        };
        let startup = room.startup_mb.min(memory_mb);
        let now = Instant::now();
        while used
            .settling
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) >= SETTLE)
        {
            used.settling.pop_front();
        }
        let settling: u64 = used.settling.iter().map(|(_, mb)| mb).sum();
        if let Some(available) = host.available_mb() {
            if available < room.reserve_mb + startup + settling {
                return Err((Exhausted::HostMemory, format!(
                    "not enough free host memory for another VM: {available} MiB available (MemAvailable), {} MiB kept for the host ([admission] reserved_memory_mb), {startup} MiB needed to start it and {settling} MiB by VMs still starting; pause or delete a sandbox, or lower the reserve",
                    room.reserve_mb
                )));
            }
        }
        if room.max_pressure_pct > 0.0 {
            if let Some(p) = host.pressure_pct().filter(|p| *p > room.max_pressure_pct) {
                return Err((Exhausted::HostPressure, format!(
                    "host memory under pressure: tasks stalled on memory {p:.1}% of the last 10 s, above {}% ([admission] max_memory_pressure_pct); pause or delete a sandbox",
                    room.max_pressure_pct
                )));
            }
        }
        Ok(startup)
    }

    /// What another VM could still have now (`GET /cluster/node`, `/metrics`): memory
    /// is the smaller of the host's headroom (`MemAvailable` less the reserve and what
    /// VMs still starting will touch) and the operator's cap less what is reserved; vCPUs
    /// are the cap less what is reserved, else the host's CPUs less what is reserved.
    pub fn capacity(&self, host_cpus: u32) -> Capacity {
        let used = self.used.lock();
        let now = Instant::now();
        let settling: u64 = used
            .settling
            .iter()
            .filter(|(at, _)| now.duration_since(*at) < SETTLE)
            .map(|(_, mb)| mb)
            .sum();
        let host_free = self.headroom.as_ref().and_then(|(room, host)| {
            host.available_mb()
                .map(|a| a.saturating_sub(room.reserve_mb + settling))
        });
        let cap_free = self
            .limits
            .memory_mb
            .map(|l| l.saturating_sub(used.memory_mb));
        let memory_free_mb = match (host_free, cap_free) {
            (Some(h), Some(c)) => Some(h.min(c)),
            (h, c) => h.or(c),
        };
        let vcpu_limit = self.limits.vcpus.unwrap_or(u64::from(host_cpus));
        Capacity {
            memory_free_mb,
            vcpus_free: vcpu_limit.saturating_sub(used.vcpus),
            vcpus_capped: self.limits.vcpus.is_some(),
            memory_reserved_mb: used.memory_mb,
            vcpus_reserved: used.vcpus,
        }
    }

    /// (memory MiB, vCPUs) in use now.
    pub fn in_use(&self) -> (u64, u64) {
        let used = self.used.lock();
        (used.memory_mb, used.vcpus)
    }

    /// `agentenv_admission_memory_mb`, `agentenv_admission_vcpus` (what running VMs
    /// reserved, and the caps when set) and `agentenv_host_memory_mb` (available, and the
    /// reserve), api.md §4.19.
    pub fn render_metrics(&self, out: &mut String) {
        let (memory, vcpus) = self.in_use();
        let with_limit = |v: u64, limit: Option<u64>| {
            let mut series = vec![("reserved", v)];
            series.extend(limit.map(|l| ("limit", l)));
            series
        };
        super::metrics::render_state_gauge(
            out,
            "agentenv_admission_memory_mb",
            "Memory (MiB) reserved by running VMs (nominal), and the operator's cap when set.",
            &with_limit(memory, self.limits.memory_mb),
        );
        super::metrics::render_state_gauge(
            out,
            "agentenv_admission_vcpus",
            "vCPUs reserved by running VMs, and the operator's cap when set.",
            &with_limit(vcpus, self.limits.vcpus),
        );
        if let Some((room, host)) = &self.headroom {
            let mut series = vec![("reserve", room.reserve_mb)];
            series.extend(host.available_mb().map(|a| ("available", a)));
            super::metrics::render_state_gauge(
                out,
                "agentenv_host_memory_mb",
                "Host memory (MiB) the kernel can still allocate (MemAvailable), and the reserve admission keeps.",
                &series,
            );
            let mut series: Vec<(&str, f64)> = host
                .pressure_pct()
                .map(|p| ("avg10", p))
                .into_iter()
                .collect();
            if room.max_pressure_pct > 0.0 {
                series.push(("limit", room.max_pressure_pct));
            }
            if !series.is_empty() {
                super::metrics::render_state_gauge(
                out,
                "agentenv_host_memory_pressure_pct",
                "Share (%) of the last 10 s some task stalled on memory (PSI some avg10), and the limit above which starts are refused.",
                &series,
            );
            }
        }
        let name = "agentenv_admission_refusals_total";
        let _ = writeln!(
            out,
            "# HELP {name} Starts (creates, resumes, builds) refused with 429, by what was exhausted.\n# TYPE {name} counter"
        );
        for what in Exhausted::ALL {
            let _ = writeln!(
                out,
                "{name}{{reason=\"{}\"}} {}",
                what.label(),
                self.refusals.get(what)
            );
        }
    }
}

/// Room for more VMs, as [`Admission::capacity`] sees it now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// MiB another VM may still take; `None` when neither the host's figure nor a cap is
    /// known.
    pub memory_free_mb: Option<u64>,
    pub vcpus_free: u64,
    /// Whether admission caps vCPUs (`max_vcpus`, `vcpu_overcommit`): without a cap,
    /// `vcpus_free` counts the host's CPUs but refuses nothing.
    pub vcpus_capped: bool,
    pub memory_reserved_mb: u64,
    pub vcpus_reserved: u64,
}

/// One running VM's share; given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    admission: Arc<Admission>,
    memory_mb: u64,
    vcpus: u64,
}

impl Reservation {
    /// The share held: (memory MiB, vCPUs).
    pub fn share(&self) -> (u64, u64) {
        (self.memory_mb, self.vcpus)
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("limits", &self.limits)
            .field("used", &self.in_use())
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut used = self.admission.used.lock();
        used.memory_mb -= self.memory_mb;
        used.vcpus -= self.vcpus;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orchestrator::fakes::sides::FakeHostFacts as FakeHost;

    #[test]
    fn the_vcpu_cap_and_host_limits_come_from_the_host_side() {
        let host = FakeHost::new(8192);
        let cfg = crate::config::AdmissionConfig {
            max_memory_mb: 0,
            reserved_memory_mb: 0,
            max_vcpus: 0,
            vcpu_overcommit: 2,
            vm_startup_mb: 0,
            max_memory_pressure_pct: 0.0,
        };
        let a = Admission::new(Limits::from_config(&cfg, host.online_cpus()));
        let held = a.reserve(128, 8).unwrap();
        assert!(a.reserve(128, 1).is_err(), "2 x 4 host CPUs are taken");
        drop(held);
        let limits = crate::orchestrator::HostLimits::of(&*host);
        assert_eq!((limits.cpus, limits.memory_mb), (4, 8192));
    }

    fn caps(memory_mb: Option<u64>, vcpus: Option<u64>) -> Limits {
        Limits { memory_mb, vcpus }
    }

    #[test]
    fn caps_are_bounded_and_given_back() {
        let a = Admission::new(caps(Some(1024), Some(2)));
        let first = a.reserve(512, 1).unwrap();
        let second = a.reserve(512, 1).unwrap();
        let e = a.reserve(1, 1).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("memory")),
            "{e:?}"
        );
        drop(first);
        let e = a.reserve(256, 2).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("vCPUs")),
            "{e:?}"
        );
        let _third = a.reserve(256, 1).unwrap();
        drop(second);
        assert_eq!(a.in_use(), (256, 1));
    }

    #[test]
    fn no_caps_by_default_and_the_operator_can_set_them() {
        let cfg = AdmissionConfig {
            max_memory_mb: 0,
            reserved_memory_mb: 1024,
            max_vcpus: 0,
            vcpu_overcommit: 0,
            vm_startup_mb: 64,
            max_memory_pressure_pct: 20.0,
        };
        assert_eq!(Limits::from_config(&cfg, 2), caps(None, None));
        let over = AdmissionConfig {
            vcpu_overcommit: 4,
            ..cfg.clone()
        };
        assert_eq!(Limits::from_config(&over, 2), caps(None, Some(8)));
        let set = AdmissionConfig {
            max_memory_mb: 300,
            max_vcpus: 1,
            ..over
        };
        assert_eq!(Limits::from_config(&set, 2), caps(Some(300), Some(1)));
    }

    #[test]
    fn starts_need_the_reserve_plus_their_startup_memory_counting_recent_ones() {
        let host = FakeHost::new(1024 + 200);
        let room = Headroom {
            reserve_mb: 1024,
            startup_mb: 64,
            max_pressure_pct: 20.0,
        };
        let a = Admission::with_host(caps(None, None), room, host.clone());
        // 200 MiB over the reserve: three starts of 64 MiB fit, a fourth does not, as
        // long as the first ones have not yet shown in MemAvailable.
        let held: Vec<_> = (0..3).map(|_| a.reserve(256, 1).unwrap()).collect();
        let e = a.reserve(256, 1).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("MemAvailable") && m.contains("192 MiB by VMs still starting")),
            "{e:?}"
        );
        // A small VM needs only its own size.
        let _small = a.reserve(8, 1).unwrap();
        // Nominal sums are no limit: 4 × 256 MiB "reserved" on 1.2 GiB available.
        assert_eq!(a.in_use().0, 3 * 256 + 8);
        host.available.store(900, Ordering::SeqCst);
        drop(held);
        let e = a.reserve(8, 1).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("900 MiB available")),
            "below the reserve nothing starts: {e:?}"
        );
        host.available.store(100_000, Ordering::SeqCst);
        host.pressure_tenths.store(255, Ordering::SeqCst);
        let e = a.reserve(8, 1).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("25.5%") && m.contains("max_memory_pressure_pct")),
            "{e:?}"
        );
        host.pressure_tenths.store(10, Ordering::SeqCst);
        assert!(a.reserve(8, 1).is_ok());
    }

    #[test]
    fn would_admit_reserves_nothing_and_says_why_not() {
        let a = Admission::new(caps(Some(1024), Some(4)));
        let none = Standbys::default();
        assert_eq!(a.would_admit(1024, 4, none), Ok(()));
        let _held = a.reserve(512, 1).unwrap();
        let why = a.would_admit(1024, 1, none).unwrap_err();
        assert!(why.contains("512 of 1024 MiB"), "{why}");
        assert!(a.would_admit(256, 4, none).unwrap_err().contains("vCPUs"));
        assert_eq!(a.in_use(), (512, 1), "asking reserved nothing");
        // The 512 MiB are a standby's: a claim needs no share, another start takes it back.
        let claims = Standbys {
            claims: true,
            held: (512, 1),
        };
        assert_eq!(a.would_admit(1024, 4, claims), Ok(()));
        let takes_back = Standbys {
            claims: false,
            held: (512, 1),
        };
        assert_eq!(a.would_admit(1024, 4, takes_back), Ok(()));
    }

    #[test]
    fn capacity_is_the_smaller_of_headroom_and_caps() {
        let host = FakeHost::new(1024 + 500);
        let room = Headroom {
            reserve_mb: 1024,
            startup_mb: 64,
            max_pressure_pct: 0.0,
        };
        let a = Admission::with_host(caps(Some(2048), None), room, host.clone());
        let free = a.capacity(4);
        assert_eq!((free.memory_free_mb, free.vcpus_free), (Some(500), 4));
        // A VM still starting counts for its startup memory; the cap for its size.
        let _held = a.reserve(1900, 3).unwrap();
        let free = a.capacity(4);
        assert_eq!(free.memory_free_mb, Some(148), "min(500 - 64, 2048 - 1900)");
        assert_eq!((free.vcpus_free, free.vcpus_reserved), (1, 3));
        assert_eq!(free.memory_reserved_mb, 1900);
        host.available.store(900, Ordering::SeqCst);
        assert_eq!(a.capacity(4).memory_free_mb, Some(0), "below the reserve");
        let capped = Admission::new(caps(None, Some(16)));
        let _one = capped.reserve(128, 2).unwrap();
        let free = capped.capacity(4);
        assert_eq!((free.memory_free_mb, free.vcpus_free), (None, 14));
    }

    #[test]
    fn a_claimed_standby_needs_the_hosts_headroom_again() {
        let host = FakeHost::new(1024 + 100);
        let room = Headroom {
            reserve_mb: 1024,
            startup_mb: 64,
            max_pressure_pct: 20.0,
        };
        let a = Admission::with_host(caps(None, None), room, host.clone());
        // Made while the host had room; its SETTLE window is over when it is claimed.
        let standby = a.reserve(256, 1).unwrap();
        a.used.lock().settling.clear();
        host.available.store(1024 + 10, Ordering::SeqCst);
        let e = a.admit_claim(&standby).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("1034 MiB available (MemAvailable)") && m.contains("lower the reserve")),
            "{e:?}"
        );
        host.available.store(1024 + 100, Ordering::SeqCst);
        a.admit_claim(&standby).unwrap();
        // The claim counts as a start: a second one right after does not fit in 100 MiB.
        let e = a.admit_claim(&standby).unwrap_err();
        assert!(
            matches!(&e, OrchError::TooMany(m) if m.contains("64 MiB by VMs still starting")),
            "{e:?}"
        );
        assert_eq!(a.in_use(), (256, 1), "a claim reserves nothing more");
    }

    #[test]
    fn refusals_are_counted_by_what_was_exhausted_and_pressure_is_a_metric() {
        let host = FakeHost::new(1024 + 10);
        let room = Headroom {
            reserve_mb: 1024,
            startup_mb: 64,
            max_pressure_pct: 20.0,
        };
        let a = Admission::with_host(caps(Some(512), Some(2)), room, host.clone());
        assert!(a.reserve(1024, 1).is_err(), "memory cap");
        assert!(a.reserve(8, 3).is_err(), "vCPU cap");
        assert!(a.reserve(256, 1).is_err(), "host memory");
        assert!(a.reserve(256, 1).is_err(), "host memory again");
        host.available.store(100_000, Ordering::SeqCst);
        host.pressure_tenths.store(305, Ordering::SeqCst);
        assert!(a.reserve(256, 1).is_err(), "pressure");
        let mut out = String::new();
        a.render_metrics(&mut out);
        for line in [
            "agentenv_admission_refusals_total{reason=\"memory_cap\"} 1",
            "agentenv_admission_refusals_total{reason=\"vcpu_cap\"} 1",
            "agentenv_admission_refusals_total{reason=\"host_memory\"} 2",
            "agentenv_admission_refusals_total{reason=\"host_pressure\"} 1",
            "agentenv_host_memory_pressure_pct{state=\"avg10\"} 30.5",
            "agentenv_host_memory_pressure_pct{state=\"limit\"} 20",
            "agentenv_host_memory_mb{state=\"available\"} 100000",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
    }
}
