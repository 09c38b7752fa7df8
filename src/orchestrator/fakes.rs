//! Fakes of the host sides ([`super::sides`]) and sample values for the orchestrator's
//! unit tests: failure paths run without root, QEMU or an extension.

use super::sandbox::{SandboxInfo, SandboxState};
use super::settings::{Resources, SandboxSettings};

/// Settings of a small sandbox.
pub(crate) fn settings() -> SandboxSettings {
    SandboxSettings {
        template_id: "t".into(),
        alias: None,
        resources: Resources {
            cpu_count: 1,
            memory_mb: 128,
            disk_size_mb: 1024,
        },
        timeout_secs: 1,
        auto_pause: true,
        auto_pause_memory: true,
        auto_resume: false,
        metadata: Default::default(),
        env_vars: Default::default(),
        image_env: vec![],
        internet_access: false,
        ingress: Default::default(),
        network: Default::default(),
        custom_extension_params: serde_json::json!({}),
        volume_mounts: Vec::new(),
    }
}

/// The description of sandbox `id` in `state`.
pub(crate) fn info(id: &str, state: SandboxState) -> SandboxInfo {
    SandboxInfo::new(
        id.into(),
        settings(),
        std::net::Ipv4Addr::LOCALHOST,
        "/x".into(),
    )
    .in_state(state)
}

/// A capture record whose files do not exist.
pub(crate) fn capture() -> crate::vm::CaptureRecord {
    crate::vm::CaptureRecord {
        format: 1,
        captured_at_unix_ms: 0,
        machine: crate::vm::MachineConfig {
            kernel: "/assets/vmlinuz".into(),
            initramfs: "/assets/initramfs.img".into(),
            cpu_count: 1,
            memory_mb: 128,
        },
        kernel_cmdline: String::new(),
        accel: "tcg".into(),
        nic: true,
        state_file: "/nowhere/state.bin".into(),
        state_bytes: 0,
        memory_file: None,
        disk: "/nowhere/disk.qcow2".into(),
        disk_layers: vec!["/nowhere/disk.qcow2".into()],
        disk_base: None,
        disk_virtual_bytes: 0,
        disk_allocated_bytes: 0,
        disk_frozen: false,
        dirty: None,
        filesystem_only: false,
    }
}

/// Counts what the start sequence and the supervisors hold; a test ends with all of it
/// given back.
pub(crate) mod sides {
    use crate::agent::protocol::{
        write_frame, Frame, FrameKind, FrameReader, Request, Response, PROTOCOL_VERSION,
    };
    use crate::agent::{AgentClient, AgentError};
    use crate::hooks::{Cause, Hook, HookError, Instance, StartContext, StopReason};
    use crate::net::{FakeHost, NetError, Slot, SlotManager, SlotStats};
    use crate::orchestrator::sides::{Extension, Machine, Machines, Network};
    use crate::orchestrator::warmup::{WarmUp, WarmUpError};
    use crate::vm::{
        CaptureRecord, CaptureStats, DiskCapture, MemoryFile, Priority, VmError, VmSpec,
    };
    use parking_lot::Mutex;
    use serde_json::Value;
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Real slots over the recording fake host, counted.
    pub(crate) struct FakeNet {
        pub slots: Arc<SlotManager>,
        pub host: Arc<FakeHost>,
        pub fail_acquire: AtomicBool,
        pub acquired: AtomicUsize,
        pub released: AtomicUsize,
    }

    impl FakeNet {
        pub fn new(cfg: &crate::config::NetworkConfig) -> Arc<FakeNet> {
            let host = Arc::new(FakeHost::default());
            let slots = SlotManager::start_with(host.clone(), cfg, &[]).unwrap();
            Arc::new(FakeNet {
                slots,
                host,
                fail_acquire: AtomicBool::new(false),
                acquired: AtomicUsize::new(0),
                released: AtomicUsize::new(0),
            })
        }
    }

    impl Network for FakeNet {
        fn acquire(&self) -> Result<Slot, NetError> {
            if self.fail_acquire.load(Ordering::SeqCst) {
                return Err(NetError::NoFreeSlot { max_slots: 0 });
            }
            let slot = self.slots.acquire()?;
            self.acquired.fetch_add(1, Ordering::SeqCst);
            Ok(slot)
        }
        fn release(&self, slot: Slot) {
            self.released.fetch_add(1, Ordering::SeqCst);
            self.slots.release(slot)
        }
        fn stats(&self) -> SlotStats {
            self.slots.stats()
        }
        fn shutdown(&self) {
            self.slots.shutdown()
        }
    }

    /// A recording extension: every hook as a line ("start-fresh sb-1", "stop sb-1
    /// start-failed"), the instances it opened and not yet stopped, failures on demand.
    #[derive(Default)]
    pub(crate) struct FakeHooks {
        pub fail_start: AtomicBool,
        pub calls: Mutex<Vec<String>>,
        open: Mutex<Vec<String>>,
        next: AtomicUsize,
    }

    impl FakeHooks {
        pub fn calls(&self) -> Vec<String> {
            self.calls.lock().clone()
        }

        /// Instances a start hook opened that no stop has closed.
        pub fn open_instances(&self) -> usize {
            self.open.lock().len()
        }

        fn start(&self, hook: Hook, s: &StartContext) -> (Instance, Result<(), HookError>) {
            self.calls.lock().push(format!("{hook} {}", s.sandbox_id));
            let instance_id = format!("i{}", self.next.fetch_add(1, Ordering::SeqCst));
            self.open.lock().push(instance_id.clone());
            let instance = Instance {
                sandbox_id: s.sandbox_id.clone(),
                instance_id: Some(instance_id),
            };
            if self.fail_start.load(Ordering::SeqCst) {
                let cause = Cause::Status(500);
                return (instance, Err(HookError::Failed { hook, cause }));
            }
            (instance, Ok(()))
        }
    }

    impl Extension for FakeHooks {
        fn enabled(&self) -> bool {
            true
        }
        fn start_fresh(
            &self,
            s: &StartContext,
            _: usize,
        ) -> (Instance, Result<Option<String>, HookError>) {
            let (instance, r) = self.start(Hook::StartFresh, s);
            (instance, r.map(|()| None))
        }
        fn start_resume(&self, s: &StartContext) -> (Instance, Result<(), HookError>) {
            self.start(Hook::StartResume, s)
        }
        fn patch_params(&self, _: &str, patch: &Value) -> Result<Value, HookError> {
            Ok(patch.clone())
        }
        fn stop(&self, instance: Instance, reason: StopReason) {
            let Some(id) = instance.instance_id else {
                return;
            };
            self.calls
                .lock()
                .push(format!("stop {} {reason}", instance.sandbox_id));
            let mut open = self.open.lock();
            let at = open.iter().position(|i| *i == id);
            open.remove(at.expect("a stop for an instance that is not open"));
        }
        fn shutdown(&self) {}
        fn render_metrics(&self, _: &mut String) {}
    }

    /// What the fake VMs do.
    #[derive(Default, Clone, Copy)]
    pub(crate) struct Script {
        pub fail_boot: bool,
        /// The VM runs but its guest agent never answers.
        pub silent_agent: bool,
        /// The guest breaks the agent protocol once it said hello.
        pub hostile_agent: bool,
        /// A pause fails and the VM runs on.
        pub fail_pause: bool,
        /// Loading the state into a standby fails.
        pub fail_load: bool,
        /// A pause fails and the VM cannot run on (it stopped answering).
        pub stuck_pause: bool,
        /// Dropping what only the boot needed fails.
        pub fail_boot_finished: bool,
        /// The guest agent answers everything but `sync` (with an error).
        pub fail_sync: bool,
        /// A standby's warm-up takes this long.
        pub warm_up_ms: u64,
        /// A pause leaves the VM stopped in place ([`Machine::pause_keeping`]).
        pub keep_paused: bool,
    }

    /// Fake VMs: no process, a fake guest agent on a socket pair.
    #[derive(Default)]
    pub(crate) struct FakeMachines {
        pub script: Mutex<Script>,
        /// VMs alive now.
        pub alive: Arc<AtomicUsize>,
        pub boots: AtomicUsize,
        pub pauses: Arc<AtomicUsize>,
        /// Standbys started.
        pub standbys: AtomicUsize,
        /// Set: every VM made so far reports that it exited.
        pub died: Arc<AtomicBool>,
        /// Cold-booted guests told that their boot is over.
        pub boots_finished: Arc<AtomicUsize>,
    }

    impl FakeMachines {
        fn machine(&self, run_dir: &Path) -> Result<Box<dyn Machine>, VmError> {
            let script = *self.script.lock();
            if script.fail_boot {
                return Err(VmError::InvalidSpec("the fake VM does not boot".into()));
            }
            self.boots.fetch_add(1, Ordering::SeqCst);
            self.alive.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(FakeMachine {
                script,
                run_dir: run_dir.to_path_buf(),
                alive: self.alive.clone(),
                pauses: self.pauses.clone(),
                died: self.died.clone(),
                boots_finished: self.boots_finished.clone(),
                quit: false,
            }))
        }
    }

    impl Machines for FakeMachines {
        fn boot(&self, spec: VmSpec, _: Option<MemoryFile>) -> Result<Box<dyn Machine>, VmError> {
            self.machine(&spec.host.run_dir)
        }
        fn restore(
            &self,
            _: &CaptureRecord,
            spec: crate::vm::RestoreSpec,
        ) -> Result<Box<dyn Machine>, VmError> {
            self.machine(&spec.host.run_dir)
        }
        fn standby(
            &self,
            _: &CaptureRecord,
            spec: crate::vm::RestoreSpec,
        ) -> Result<Box<dyn Machine>, VmError> {
            let vm = self.machine(&spec.host.run_dir)?;
            self.standbys.fetch_add(1, Ordering::SeqCst);
            Ok(vm)
        }
    }

    struct FakeMachine {
        script: Script,
        run_dir: PathBuf,
        alive: Arc<AtomicUsize>,
        pauses: Arc<AtomicUsize>,
        died: Arc<AtomicBool>,
        boots_finished: Arc<AtomicUsize>,
        /// Paused (captured and quit).
        quit: bool,
    }

    impl Drop for FakeMachine {
        fn drop(&mut self) {
            self.alive.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Machine for FakeMachine {
        fn connect_agent(&mut self, deadline: Instant) -> Result<AgentClient, AgentError> {
            if self.script.silent_agent {
                return Err(AgentError::Unreachable("the fake guest is silent".into()));
            }
            let (host, guest) = UnixStream::pair().expect("socket pair");
            let (hostile, fail_sync) = (self.script.hostile_agent, self.script.fail_sync);
            std::thread::spawn(move || fake_guest(guest, hostile, fail_sync));
            let client = AgentClient::from_stream(host)?;
            client.ping(deadline.saturating_duration_since(Instant::now()))?;
            Ok(client)
        }
        fn console_tail(&self, _: usize) -> String {
            String::new()
        }
        fn exited(&mut self) -> Option<crate::vm::VmExit> {
            if self.died.load(Ordering::SeqCst) {
                return Some(crate::vm::VmExit::Signal(9));
            }
            self.quit.then_some(crate::vm::VmExit::Code(0))
        }
        fn kill(self: Box<Self>) {}
        fn pause(&mut self, dir: &Path) -> Result<(CaptureRecord, CaptureStats), VmError> {
            self.pauses.fetch_add(1, Ordering::SeqCst);
            if self.script.fail_pause || self.script.stuck_pause {
                return Err(VmError::Migration {
                    status: "failed".into(),
                    message: "the fake VM cannot migrate".into(),
                });
            }
            let record = capture_into(dir, &self.run_dir)?;
            self.quit = true;
            Ok((record, CaptureStats::default()))
        }
        fn pause_keeping(
            &mut self,
            dir: &Path,
        ) -> Result<(CaptureRecord, CaptureStats, bool), VmError> {
            let keep = self.script.keep_paused;
            let (record, stats) = self.pause(dir)?;
            self.quit = !keep;
            Ok((record, stats, keep))
        }
        fn move_onto_layer(&mut self, _: &Path) -> Result<(), VmError> {
            Ok(())
        }
        fn pause_to_disk(&mut self) -> Result<CaptureRecord, VmError> {
            self.pauses.fetch_add(1, Ordering::SeqCst);
            if self.script.fail_pause || self.script.stuck_pause {
                return Err(VmError::InvalidSpec("the fake VM does not stop".into()));
            }
            let mut record = super::capture();
            record.state_file = PathBuf::new();
            record.disk = self.run_dir.join("disk.qcow2");
            record.disk_layers = vec![record.disk.clone()];
            record.filesystem_only = true;
            self.quit = true;
            Ok(record)
        }
        fn capture(
            &mut self,
            dir: &Path,
            _: DiskCapture,
        ) -> Result<(CaptureRecord, CaptureStats), VmError> {
            Ok((capture_into(dir, &self.run_dir)?, CaptureStats::default()))
        }
        fn resume_vcpus(&mut self) -> Result<(), VmError> {
            if self.script.stuck_pause {
                return Err(VmError::InvalidSpec("the fake VM does not answer".into()));
            }
            Ok(())
        }
        fn paused_on_io_error(&mut self) -> Result<bool, VmError> {
            Ok(false)
        }
        fn boot_finished(&mut self) -> Result<(), VmError> {
            self.boots_finished.fetch_add(1, Ordering::SeqCst);
            if self.script.fail_boot_finished {
                return Err(VmError::InvalidSpec("the fake VM keeps its PIT".into()));
            }
            Ok(())
        }
        fn load_state(&mut self, _: &CaptureRecord) -> Result<(), VmError> {
            if self.script.fail_load {
                return Err(VmError::InvalidSpec("the fake state does not load".into()));
            }
            Ok(())
        }
        fn warm_up(
            &mut self,
            record: &CaptureRecord,
            _: WarmUp,
            _: &str,
        ) -> Result<AgentClient, WarmUpError> {
            self.load_state(record).map_err(|source| WarmUpError::Vm {
                step: "loading the template's state",
                source,
            })?;
            std::thread::sleep(Duration::from_millis(self.script.warm_up_ms));
            let deadline = Instant::now() + Duration::from_secs(5);
            self.connect_agent(deadline)
                .map_err(|source| WarmUpError::Agent {
                    step: "connecting to the guest agent",
                    source,
                })
        }
        fn stop_vcpus(&mut self) -> Result<(), VmError> {
            Ok(())
        }
        fn set_carrier(&mut self, _: bool) -> Result<(), VmError> {
            Ok(())
        }
        fn set_priority(&mut self, _: Priority) -> Result<(), VmError> {
            Ok(())
        }
        fn memory_kib(&mut self) -> Option<u64> {
            Some(40 << 10)
        }
        fn disk_chain_depth(&mut self) -> Result<usize, VmError> {
            Ok(1)
        }
        fn flatten_disk(&mut self, _: Duration) -> Result<(), VmError> {
            Ok(())
        }
        fn freeze_disk(&mut self, _: &Path) -> Result<Vec<std::path::PathBuf>, VmError> {
            Ok(Vec::new())
        }
    }

    /// A capture into `dir` (its state file) of the disk in `run_dir`.
    fn capture_into(dir: &Path, run_dir: &Path) -> Result<CaptureRecord, VmError> {
        let io = |e| VmError::io("fake capture", e);
        std::fs::create_dir_all(dir).map_err(io)?;
        let mut record = super::capture();
        record.state_file = dir.join(crate::vm::capture::STATE_FILE);
        record.disk = run_dir.join("disk.qcow2");
        record.disk_layers = vec![record.disk.clone()];
        std::fs::write(&record.state_file, b"state").map_err(io)?;
        Ok(record)
    }

    /// Answers hello, set-time and sync (unless `fail_sync`); a hostile guest then sends a
    /// frame only the host may send.
    fn fake_guest(stream: UnixStream, hostile: bool, fail_sync: bool) {
        let mut writer = stream.try_clone().expect("clone");
        let mut reader = FrameReader::new(stream);
        while let Ok(Some(frame)) = reader.read_frame() {
            if frame.kind != FrameKind::Request {
                continue;
            }
            let answer = match serde_json::from_slice::<Request>(&frame.payload) {
                Ok(Request::Hello { .. }) => Response::Hello {
                    version: PROTOCOL_VERSION,
                    agent: "fake".into(),
                },
                Ok(Request::Sync) if fail_sync => Response::Error {
                    kind: crate::agent::protocol::ErrorKind::Io,
                    message: "the fake guest cannot sync".into(),
                },
                Ok(Request::SetTime { .. } | Request::Sync) => Response::Done,
                _ => Response::Error {
                    kind: crate::agent::protocol::ErrorKind::Io,
                    message: "not in the fake guest".into(),
                },
            };
            let reply = Frame::json(FrameKind::Response, frame.id, &answer);
            if write_frame(&mut writer, &reply).is_err() {
                return;
            }
            if hostile {
                let bad = Frame::json(FrameKind::Request, 1, &Request::Hello { version: 1 });
                let _ = write_frame(&mut writer, &bad);
            }
        }
    }

    /// A host of 4 CPUs and 8 GiB whose available memory and pressure the test sets.
    pub(crate) struct FakeHostFacts {
        pub available: std::sync::atomic::AtomicU64,
        /// Memory pressure in tenths of a percent.
        pub pressure_tenths: std::sync::atomic::AtomicU64,
    }

    impl FakeHostFacts {
        pub fn new(available_mb: u64) -> Arc<FakeHostFacts> {
            Arc::new(FakeHostFacts {
                available: available_mb.into(),
                pressure_tenths: 0.into(),
            })
        }
    }

    impl crate::orchestrator::sides::HostFacts for FakeHostFacts {
        fn online_cpus(&self) -> u32 {
            4
        }
        fn total_memory_mb(&self) -> u64 {
            8192
        }
        fn available_mb(&self) -> Option<u64> {
            Some(self.available.load(Ordering::SeqCst))
        }
        fn pressure_pct(&self) -> Option<f64> {
            Some(self.pressure_tenths.load(Ordering::SeqCst) as f64 / 10.0)
        }
    }
}
