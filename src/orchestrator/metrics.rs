//! Counters for `GET /metrics` (Prometheus text format).

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::fmt::Write;

/// `agentenv_sandbox_operations_total{op,result}`.
#[derive(Default)]
pub struct OperationCounters {
    counts: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl OperationCounters {
    pub fn record(&self, op: &'static str, ok: bool) {
        let result = if ok { "success" } else { "error" };
        *self.counts.lock().entry((op, result)).or_default() += 1;
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
