//! Hook metrics (custom-extension.md §8.7), rendered in Prometheus text format.

use super::{Cause, Hook};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Upper bounds (seconds) of the buckets of `agentenv_hook_duration_seconds`.
const BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

#[derive(Default)]
pub struct HookMetrics {
    /// Indexed by `Hook as usize`, then 0 = success, 1 = failure.
    requests: [[AtomicU64; 2]; 4],
    /// Attempt durations by hook and [`status_label`]; the labels are a small fixed set.
    durations: Mutex<BTreeMap<(Hook, &'static str), Histogram>>,
    stop_retries: AtomicU64,
    stop_undelivered: AtomicU64,
}

/// One Prometheus histogram: cumulative bucket counts, the sum and the count.
#[derive(Default)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

/// The `status` label of one attempt: `2xx`, the final HTTP status, `timeout`,
/// `connection`, or `invalid` (a 2xx answer that broke the hook's body rules).
fn status_label(result: Result<(), &Cause>) -> &'static str {
    const STATUSES: [(u16, &str); 14] = [
        (300, "300"),
        (301, "301"),
        (302, "302"),
        (307, "307"),
        (400, "400"),
        (401, "401"),
        (403, "403"),
        (404, "404"),
        (408, "408"),
        (409, "409"),
        (429, "429"),
        (500, "500"),
        (502, "502"),
        (503, "503"),
    ];
    let code = match result {
        Ok(()) => return "2xx",
        Err(Cause::Status(s) | Cause::Redirect(s)) => *s,
        Err(Cause::TimedOut { .. }) => return "timeout",
        Err(Cause::Connection(_)) => return "connection",
        Err(_) => return "invalid",
    };
    match STATUSES.iter().find(|(c, _)| *c == code) {
        Some((_, label)) => label,
        None if code < 400 => "3xx",
        None if code < 500 => "4xx",
        None => "5xx",
    }
}

impl HookMetrics {
    /// One attempt of `hook`: its result and how long it took.
    pub fn request(&self, hook: Hook, result: Result<(), &Cause>, took: Duration) {
        self.requests[hook as usize][usize::from(result.is_err())].fetch_add(1, Relaxed);
        let secs = took.as_secs_f64();
        let mut durations = self.durations.lock();
        let h = durations.entry((hook, status_label(result))).or_default();
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                h.buckets[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
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
        self.render_durations(out);
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

    fn render_durations(&self, out: &mut String) {
        let name = "agentenv_hook_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Custom extension hook attempt durations by hook and status."
        );
        let _ = writeln!(out, "# TYPE {name} histogram");
        for ((hook, status), h) in self.durations.lock().iter() {
            let labels = format!("hook=\"{hook}\",status=\"{status}\"");
            for (le, n) in BUCKETS.iter().zip(h.buckets) {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {n}");
            }
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_by_hook_and_status() {
        let m = HookMetrics::default();
        m.request(Hook::Stop, Ok(()), Duration::from_millis(20));
        m.request(
            Hook::Stop,
            Err(&Cause::Status(503)),
            Duration::from_millis(3),
        );
        m.request(
            Hook::Stop,
            Err(&Cause::Status(599)),
            Duration::from_secs(20),
        );
        let mut out = String::new();
        m.render(&mut out, 0);
        assert!(out.contains("agentenv_hook_requests_total{hook=\"stop\",result=\"failure\"} 2"));
        let ok = "agentenv_hook_duration_seconds_bucket{hook=\"stop\",status=\"2xx\",le=";
        assert!(out.contains(&format!("{ok}\"0.01\"}} 0")), "{out}");
        assert!(out.contains(&format!("{ok}\"0.025\"}} 1")), "{out}");
        assert!(
            out.contains("agentenv_hook_duration_seconds_count{hook=\"stop\",status=\"503\"} 1")
        );
        assert!(out.contains(
            "agentenv_hook_duration_seconds_bucket{hook=\"stop\",status=\"5xx\",le=\"10\"} 0"
        ));
        assert!(out.contains("agentenv_hook_duration_seconds_sum{hook=\"stop\",status=\"5xx\"} 20"));
    }
}
