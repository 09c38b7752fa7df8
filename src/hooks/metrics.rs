//! Hook metrics (custom-extension.md §8.7), rendered in Prometheus text format.

use super::Hook;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Default)]
pub struct HookMetrics {
    /// Indexed by `Hook as usize`, then 0 = success, 1 = failure.
    requests: [[AtomicU64; 2]; 4],
    stop_retries: AtomicU64,
    stop_undelivered: AtomicU64,
}

impl HookMetrics {
    pub fn request(&self, hook: Hook, ok: bool) {
        self.requests[hook as usize][usize::from(!ok)].fetch_add(1, Relaxed);
    }
    pub fn stop_retry(&self) {
        self.stop_retries.fetch_add(1, Relaxed);
    }
    pub fn stop_undelivered(&self) {
        self.stop_undelivered.fetch_add(1, Relaxed);
    }
    /// Renders every family; `open_instances` is the journal's current entry count.
    pub fn render(&self, out: &mut String, open_instances: usize) {
        let family = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
        };
        family(
            out,
            "agentenv_hook_requests_total",
            "counter",
            "Custom extension hook attempts by hook and result.",
        );
        for hook in Hook::ALL {
            for (i, result) in ["success", "failure"].iter().enumerate() {
                let n = self.requests[hook as usize][i].load(Relaxed);
                let _ = writeln!(
                    out,
                    "agentenv_hook_requests_total{{hook=\"{hook}\",result=\"{result}\"}} {n}"
                );
            }
        }
        family(
            out,
            "agentenv_hook_stop_retries_total",
            "counter",
            "Stop hook retry attempts sent.",
        );
        let _ = writeln!(
            out,
            "agentenv_hook_stop_retries_total {}",
            self.stop_retries.load(Relaxed)
        );
        family(
            out,
            "agentenv_hook_stop_undelivered_total",
            "counter",
            "Instances whose stop hook was given up without a success.",
        );
        let _ = writeln!(
            out,
            "agentenv_hook_stop_undelivered_total {}",
            self.stop_undelivered.load(Relaxed)
        );
        family(
            out,
            "agentenv_hook_open_instances",
            "gauge",
            "Open entries in the hook journal (instances whose stop is still owed).",
        );
        let _ = writeln!(out, "agentenv_hook_open_instances {open_instances}");
    }
}
