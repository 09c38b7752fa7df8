//! Choosing between KVM and QEMU's software CPU (TCG).
//!
//! `/dev/kvm` alone proves nothing: nested "PVM" hosts expose it without `vmx`/`svm`, and
//! stock guest kernels die under it. So KVM needs both the CPU flag and an openable
//! `/dev/kvm`; anything else runs under TCG.

use std::sync::Once;

use super::VmError;
use crate::config::AccelMode;

/// How the guest CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualization: `-accel kvm -cpu host`.
    Kvm,
    /// Software CPU. The guest kernel cannot calibrate its TSC against the emulated PIT,
    /// so it is told the host's TSC rate (`tsc_early_khz`).
    Tcg { tsc_khz: u64 },
}

impl Accel {
    pub fn name(&self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg { .. } => "tcg",
        }
    }
}

static LOG_ONCE: Once = Once::new();

/// Picks the accelerator for `mode`; `auto` prefers KVM when usable. Requesting `kvm` on a
/// host where it is unusable is an error. The choice is logged the first time.
pub fn detect_accel(mode: AccelMode) -> Result<Accel, VmError> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")
        .map_err(|e| VmError::io("cannot read /proc/cpuinfo", e))?;
    let kvm = kvm_usable(&cpuinfo);
    let accel = match (mode, &kvm) {
        (AccelMode::Kvm, Err(reason)) => {
            return Err(VmError::KvmUnavailable {
                reason: reason.clone(),
            })
        }
        (AccelMode::Kvm | AccelMode::Auto, Ok(())) => Accel::Kvm,
        (AccelMode::Tcg, _) | (AccelMode::Auto, Err(_)) => Accel::Tcg {
            tsc_khz: tsc_khz_from_cpuinfo(&cpuinfo).ok_or_else(|| {
                VmError::InvalidSpec(
                    "cannot find the host CPU frequency (\"cpu MHz\") in /proc/cpuinfo, \
                     needed for TCG guests"
                        .into(),
                )
            })?,
        },
    };
    LOG_ONCE.call_once(|| {
        let why = match &kvm {
            Ok(()) => "kvm usable".to_string(),
            Err(reason) => reason.clone(),
        };
        match accel {
            Accel::Kvm => log::info!("vm accel=kvm mode={mode:?} reason={why:?}"),
            Accel::Tcg { tsc_khz } => {
                log::info!("vm accel=tcg mode={mode:?} tscKhz={tsc_khz} reason={why:?}")
            }
        }
    });
    Ok(accel)
}

fn kvm_usable(cpuinfo: &str) -> Result<(), String> {
    if !cpu_has_virt_flag(cpuinfo) {
        return Err("the CPU has no vmx/svm flag (no hardware virtualization)".into());
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(drop)
        .map_err(|e| format!("cannot open /dev/kvm: {e}"))
}

fn cpu_has_virt_flag(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .filter_map(|l| l.split_once(':'))
        .any(|(_, flags)| flags.split_whitespace().any(|f| f == "vmx" || f == "svm"))
}

/// The first CPU's "cpu MHz" in kHz (the TSC rate on the hosts where TCG is used).
fn tsc_khz_from_cpuinfo(cpuinfo: &str) -> Option<u64> {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("cpu MHz"))
        .filter_map(|l| l.split_once(':'))
        .find_map(|(_, v)| v.trim().parse::<f64>().ok())
        .filter(|mhz| *mhz > 0.0)
        .map(|mhz| (mhz * 1000.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PVM: &str =
        "processor\t: 0\ncpu MHz\t\t: 2596.144\nflags\t\t: fpu vme sse hypervisor\n\n";
    const VMX: &str = "processor\t: 0\ncpu MHz\t\t: 3000.000\nflags\t\t: fpu vmx sse\n";

    #[test]
    fn parses_cpuinfo() {
        assert!(!cpu_has_virt_flag(PVM));
        assert!(cpu_has_virt_flag(VMX));
        assert!(cpu_has_virt_flag("flags : svm\n"));
        assert!(!cpu_has_virt_flag("flags : svmx\n"));
        assert_eq!(tsc_khz_from_cpuinfo(PVM), Some(2_596_144));
        assert_eq!(tsc_khz_from_cpuinfo("flags : x\n"), None);
    }

    #[test]
    fn no_virt_flag_means_no_kvm() {
        assert!(kvm_usable(PVM).unwrap_err().contains("vmx/svm"));
    }

    #[test]
    fn tcg_mode_always_works() {
        assert!(matches!(
            detect_accel(AccelMode::Tcg).unwrap(),
            Accel::Tcg { tsc_khz } if tsc_khz > 0
        ));
    }
}
