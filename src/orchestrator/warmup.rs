//! A warm standby's warm-up (docs/architecture.md, "Standby pool"): the template's state
//! is loaded into the standby's QEMU, its NIC's carrier is put down (QEMU then passes no
//! frame either way, and the guest sees no link), and the guest runs the calls a client's
//! first request makes: the REST command path (an agent exec), the REST file paths (an
//! agent write and read), and an SDK's first command and file write against the guest's
//! own envd over loopback ([`crate::guest::warmup`]). Then its vCPUs stop and it waits.
//!
//! Why: under TCG a fresh QEMU translates every guest instruction it runs for the first
//! time (the first command of a fresh restore costs ~190 ms more than the next one);
//! under KVM the first touch of each page of the template's RAM file faults it in. Both
//! are paid here, for no client, instead of at the first call.
//!
//! Only the template's own code runs, for no client, and nothing is left: the command is
//! `true`, the one scratch file is removed, no environment is set, and no process stays.
//! While it warms up, QEMU runs below live sandboxes (nice [`WARMUP_NICE`]).

use super::sides::Machine;
use crate::agent::{AgentClient, AgentError, ExecRequest};
use crate::vm::{CaptureRecord, Priority, VmError};
use std::fmt;
use std::io::Read;
use std::time::{Duration, Instant};

/// The nice value of a standby's QEMU while its guest warms up.
pub(crate) const WARMUP_NICE: i32 = 10;
/// Longest warm-up step (each agent call).
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// What the warm-up's file holds.
const MARK: &[u8] = b"agentenv-warmup\n";

/// What a warm-up needs to know of the server.
#[derive(Debug, Clone, Copy)]
pub struct WarmUp {
    /// `[agent] port`: where the guest's envd listens.
    pub envd_port: u16,
    /// How long the guest agent may take to answer after the state loaded.
    pub ready_timeout: Duration,
}

/// A warm-up step that failed, and why.
#[derive(Debug)]
pub enum WarmUpError {
    Vm {
        step: &'static str,
        source: VmError,
    },
    Agent {
        step: &'static str,
        source: AgentError,
    },
}

impl fmt::Display for WarmUpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WarmUpError::Vm { step, source } => write!(f, "warm-up: {step}: {source}"),
            WarmUpError::Agent { step, source } => write!(
                f,
                "warm-up: {step}: {source} (the template's guest agent must serve envd; \
                 rebuild the template with this release's initramfs)"
            ),
        }
    }
}

impl std::error::Error for WarmUpError {}

fn vm_step(step: &'static str) -> impl FnOnce(VmError) -> WarmUpError {
    move |source| WarmUpError::Vm { step, source }
}

fn agent_step(step: &'static str) -> impl FnOnce(AgentError) -> WarmUpError {
    move |source| WarmUpError::Agent { step, source }
}

/// Loads `record` into the standby `vm` (waiting for its state), runs the warm-up with the
/// carrier down, and leaves the vCPUs stopped. The agent connection stays open for the
/// claim. On error the caller kills the VM.
pub(crate) fn warm(
    vm: &mut dyn Machine,
    record: &CaptureRecord,
    w: WarmUp,
    scratch: &str,
) -> Result<AgentClient, WarmUpError> {
    vm.set_priority(Priority::Nice(WARMUP_NICE))
        .map_err(vm_step("lowering QEMU's priority"))?;
    vm.load_state(record)
        .map_err(vm_step("loading the template's state"))?;
    vm.set_carrier(false)
        .map_err(vm_step("putting the NIC's carrier down"))?;
    vm.resume_vcpus().map_err(vm_step("starting the vCPUs"))?;
    let agent = vm
        .connect_agent(Instant::now() + w.ready_timeout)
        .map_err(agent_step("connecting to the guest agent"))?;
    crate::vm::sync_guest_clock(&agent).map_err(agent_step("setting the guest clock"))?;
    run_calls(&agent, w.envd_port, scratch)?;
    vm.stop_vcpus().map_err(vm_step("stopping the vCPUs"))?;
    vm.set_priority(Priority::Nice(0))
        .map_err(vm_step("restoring QEMU's priority"))?;
    Ok(agent)
}

/// The calls themselves: the REST command and file paths through the agent, then the
/// envd half in the guest, which removes `scratch`.
fn run_calls(agent: &AgentClient, envd_port: u16, scratch: &str) -> Result<(), WarmUpError> {
    let exec = ExecRequest {
        cmd: "true".into(),
        args: Vec::new(),
        env: Vec::new(),
        cwd: "/".into(),
        timeout_ms: STEP_TIMEOUT.as_millis() as u64,
        max_output_bytes: 4096,
    };
    let ran = agent.exec(&exec).map_err(agent_step("running `true`"))?;
    if ran.exit_code != 0 {
        let source = AgentError::Protocol(format!("`true` exited {}", ran.exit_code));
        return Err(agent_step("running `true`")(source));
    }
    agent
        .write_file(scratch, MARK.len() as u64, &mut &MARK[..])
        .map_err(agent_step("writing a file"))?;
    let mut read = Vec::new();
    agent
        .read_file(scratch)
        .and_then(|f| {
            f.take(MARK.len() as u64 + 1)
                .read_to_end(&mut read)
                .map_err(|e| AgentError::Protocol(e.to_string()))
        })
        .map_err(agent_step("reading the file back"))?;
    if read != MARK {
        let source = AgentError::Protocol("the file read back differs".into());
        return Err(agent_step("reading the file back")(source));
    }
    agent
        .warmup(envd_port, scratch, STEP_TIMEOUT)
        .map_err(agent_step("the envd calls"))
}

/// The scratch file of standby `id`: in /tmp, named so that nothing else uses it.
pub(crate) fn scratch_path(id: &str) -> String {
    format!("/tmp/.agentenv-warmup-{id}")
}
