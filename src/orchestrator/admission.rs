//! Admission control: the memory and vCPUs of every running VM (sandboxes and template
//! build sandboxes) stay within `[admission]` bounds (docs/configuration.md).
//!
//! A VM's [`Reservation`] is taken in `supervisor::start` before its supervisor thread
//! exists and lives on that thread, so it is given back exactly when the VM is gone
//! (delete, pause, crash, failed start), whatever path ended it.

use super::error::OrchError;
use crate::config::AdmissionConfig;
use parking_lot::Mutex;
use std::sync::Arc;

/// What running VMs hold now, and the bounds.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: Limits,
    used: Mutex<Usage>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub memory_mb: u64,
    pub vcpus: u64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Usage {
    memory_mb: u64,
    vcpus: u64,
}

impl Limits {
    /// The configured bounds; 0 means "from the host": its RAM minus the reserve, and
    /// `vcpu_overcommit` × its CPUs.
    pub fn from_config(cfg: &AdmissionConfig, host_memory_mb: u64, host_cpus: u32) -> Limits {
        let memory_mb = match cfg.max_memory_mb {
            0 => host_memory_mb
                .saturating_sub(cfg.reserved_memory_mb)
                .max(128),
            n => n,
        };
        let vcpus = match cfg.max_vcpus {
            0 => u64::from(host_cpus) * u64::from(cfg.vcpu_overcommit),
            n => n,
        };
        Limits { memory_mb, vcpus }
    }
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            used: Mutex::new(Usage::default()),
        })
    }

    /// Reserves a VM's memory and vCPUs, or says (429) which one is exhausted.
    pub fn reserve(self: &Arc<Self>, memory_mb: u32, vcpus: u32) -> Result<Reservation, OrchError> {
        let (memory_mb, vcpus) = (u64::from(memory_mb), u64::from(vcpus));
        let mut used = self.used.lock();
        if used.memory_mb + memory_mb > self.limits.memory_mb {
            return Err(OrchError::TooMany(format!(
                "not enough memory for another VM: {} of {} MiB in use by running sandboxes and builds, {memory_mb} MiB asked ([admission] max_memory_mb); pause or delete a sandbox",
                used.memory_mb, self.limits.memory_mb
            )));
        }
        if used.vcpus + vcpus > self.limits.vcpus {
            return Err(OrchError::TooMany(format!(
                "not enough vCPUs for another VM: {} of {} in use by running sandboxes and builds, {vcpus} asked ([admission] max_vcpus); pause or delete a sandbox",
                used.vcpus, self.limits.vcpus
            )));
        }
        used.memory_mb += memory_mb;
        used.vcpus += vcpus;
        Ok(Reservation {
            admission: self.clone(),
            memory_mb,
            vcpus,
        })
    }

    /// (memory MiB, vCPUs) in use now.
    pub fn in_use(&self) -> (u64, u64) {
        let used = self.used.lock();
        (used.memory_mb, used.vcpus)
    }

    /// `agentenv_admission_memory_mb` and `agentenv_admission_vcpus`: what running VMs
    /// reserved and the bounds (api.md §4.19).
    pub fn render_metrics(&self, out: &mut String) {
        let (memory, vcpus) = self.in_use();
        super::metrics::render_state_gauge(
            out,
            "agentenv_admission_memory_mb",
            "Memory (MiB) reserved by running VMs, and the admission limit.",
            &[("reserved", memory), ("limit", self.limits.memory_mb)],
        );
        super::metrics::render_state_gauge(
            out,
            "agentenv_admission_vcpus",
            "vCPUs reserved by running VMs, and the admission limit.",
            &[("reserved", vcpus), ("limit", self.limits.vcpus)],
        );
    }
}

/// One running VM's share; given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    admission: Arc<Admission>,
    memory_mb: u64,
    vcpus: u64,
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

    #[test]
    fn reservations_are_bounded_and_given_back() {
        let a = Admission::new(Limits {
            memory_mb: 1024,
            vcpus: 2,
        });
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
    fn defaults_come_from_the_host() {
        let cfg = AdmissionConfig {
            max_memory_mb: 0,
            reserved_memory_mb: 1024,
            max_vcpus: 0,
            vcpu_overcommit: 4,
        };
        let l = Limits::from_config(&cfg, 8192, 2);
        assert_eq!(
            l,
            Limits {
                memory_mb: 7168,
                vcpus: 8
            }
        );
        let cfg = AdmissionConfig {
            max_memory_mb: 300,
            max_vcpus: 1,
            ..cfg
        };
        assert_eq!(
            Limits::from_config(&cfg, 8192, 2),
            Limits {
                memory_mb: 300,
                vcpus: 1
            }
        );
    }
}
