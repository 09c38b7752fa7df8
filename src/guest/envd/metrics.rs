//! `GET /metrics`: what the guest sees of its CPU, memory and root disk, in envd's shape
//! (`ts`, `cpu_count`, `cpu_used_pct`, `mem_total`, `mem_used`, `mem_cache`, `disk_used`,
//! `disk_total`; sizes in bytes). The host turns it into the API's sandbox metrics.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::agent::protocol::GuestMetrics;
use crate::sys::guest as sys;

/// CPU use is measured over this window.
const CPU_WINDOW: Duration = Duration::from_millis(100);

/// One sample. Parts the guest cannot read are 0.
pub fn sample() -> GuestMetrics {
    let before = cpu_times();
    std::thread::sleep(CPU_WINDOW);
    let after = cpu_times();
    let cpu_used_pct = match (before, after) {
        (Some((busy0, all0)), Some((busy1, all1))) if all1 > all0 => {
            (busy1.saturating_sub(busy0) as f64 * 100.0 / (all1 - all0) as f64).min(100.0)
        }
        _ => 0.0,
    };
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total = meminfo_bytes(&meminfo, "MemTotal");
    let mem_available = meminfo_bytes(&meminfo, "MemAvailable");
    let mem_cache = meminfo_bytes(&meminfo, "Cached");
    let (disk_total, disk_free) = sys::filesystem_space(Path::new("/")).unwrap_or((0, 0));
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    GuestMetrics {
        ts,
        cpu_count: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        cpu_used_pct: (cpu_used_pct * 100.0).round() / 100.0,
        mem_total,
        mem_used: mem_total.saturating_sub(mem_available),
        mem_cache,
        disk_total,
        disk_used: disk_total.saturating_sub(disk_free),
    }
}

/// (busy, total) jiffies of all CPUs from `/proc/stat`.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_cpu_line(stat.lines().next()?)
}

fn parse_cpu_line(line: &str) -> Option<(u64, u64)> {
    let mut fields = line.split_whitespace();
    (fields.next()? == "cpu").then_some(())?;
    let values: Vec<u64> = fields.filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    let total: u64 = values.iter().take(8).sum();
    let idle = values.get(3).copied().unwrap_or(0) + values.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// A `/proc/meminfo` line's value in bytes (the file gives kB).
fn meminfo_bytes(meminfo: &str, key: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        assert_eq!(
            parse_cpu_line("cpu  10 0 5 80 5 0 0 0 0 0"),
            Some((15, 100))
        );
        assert_eq!(parse_cpu_line("intr 1 2"), None);
        let meminfo = "MemTotal:        1000 kB\nMemAvailable:     400 kB\nCached: 7 kB\n";
        assert_eq!(meminfo_bytes(meminfo, "MemTotal"), 1_024_000);
        assert_eq!(meminfo_bytes(meminfo, "MemAvailable"), 409_600);
        assert_eq!(meminfo_bytes(meminfo, "Mem"), 0);
    }

    #[test]
    fn a_sample_of_this_machine_is_plausible() {
        let s = sample();
        assert!(s.mem_total > 0, "{s:?}");
        assert!(s.disk_total > 0, "{s:?}");
        assert!(s.cpu_used_pct <= 100.0, "{s:?}");
    }
}
