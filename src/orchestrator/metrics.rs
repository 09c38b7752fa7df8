//! Counters for `GET /metrics` (Prometheus text format).

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Duration;

/// `agentenv_sandbox_operations_total{op,result}` and the time they took,
/// `agentenv_sandbox_operation_seconds_{sum,count}{op}`.
#[derive(Default)]
pub struct OperationCounters {
    counts: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// Per operation: the seconds taken in all, and how many were timed.
    seconds: Mutex<BTreeMap<&'static str, (f64, u64)>>,
}

impl OperationCounters {
    pub fn record(&self, op: &'static str, ok: bool, took: Duration) {
        let result = if ok { "success" } else { "error" };
        *self.counts.lock().entry((op, result)).or_default() += 1;
        let mut seconds = self.seconds.lock();
        let (sum, count) = seconds.entry(op).or_default();
        *sum += took.as_secs_f64();
        *count += 1;
    }

    pub fn render(&self, out: &mut String) {
        out.push_str("# HELP agentenv_sandbox_operations_total Lifecycle operations by result.\n");
        out.push_str("# TYPE agentenv_sandbox_operations_total counter\n");
        for ((op, result), n) in self.counts.lock().iter() {
            let _ = writeln!(
                out,
                "agentenv_sandbox_operations_total{{op=\"{op}\",result=\"{result}\"}} {n}"
            );
        }
        out.push_str("# HELP agentenv_sandbox_operation_seconds Time lifecycle operations took.\n");
        out.push_str("# TYPE agentenv_sandbox_operation_seconds summary\n");
        for (op, (sum, count)) in self.seconds.lock().iter() {
            let _ = writeln!(
                out,
                "agentenv_sandbox_operation_seconds_sum{{op=\"{op}\"}} {sum:.3}\n\
                 agentenv_sandbox_operation_seconds_count{{op=\"{op}\"}} {count}"
            );
        }
    }
}

/// Writes one gauge family with a `state` label.
pub fn render_state_gauge<N: std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    values: &[(&str, N)],
) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    for (state, v) in values {
        let _ = writeln!(out, "{name}{{state=\"{state}\"}} {v}");
    }
}

/// Writes one gauge without labels.
pub fn render_gauge<N: std::fmt::Display>(out: &mut String, name: &str, help: &str, value: N) {
    render_single(out, name, help, "gauge", value);
}

/// Writes one counter without labels.
pub fn render_counter(out: &mut String, name: &str, help: &str, value: u64) {
    render_single(out, name, help, "counter", value);
}

fn render_single<N: std::fmt::Display>(
    out: &mut String,
    name: &str,
    help: &str,
    kind: &str,
    value: N,
) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// `agentenv_vm_deaths_total{kind,cause}`: QEMU processes that ended without being asked
/// to, by what they were (`sandbox`, `standby`, `build`) and how they ended
/// ([`crate::vm::VmExit::cause`]).
#[derive(Default)]
pub struct VmDeaths {
    counts: Mutex<BTreeMap<(&'static str, String), u64>>,
}

impl VmDeaths {
    pub fn record(&self, kind: &'static str, exit: &crate::vm::VmExit) {
        *self.counts.lock().entry((kind, exit.cause())).or_default() += 1;
    }

    pub fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP agentenv_vm_deaths_total VM processes that ended on their own, by kind and cause.\n",
        );
        out.push_str("# TYPE agentenv_vm_deaths_total counter\n");
        for ((kind, cause), n) in self.counts.lock().iter() {
            let _ = writeln!(
                out,
                "agentenv_vm_deaths_total{{kind=\"{kind}\",cause=\"{cause}\"}} {n}"
            );
        }
    }
}
