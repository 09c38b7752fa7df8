//! What the benches share beyond the tests' harness (tests/common, included by each bench
//! as `common`): the bench configuration of its [`Server`], the timed API operations, the
//! raw QEMU floor, and the statistics they print. Included with `#[path]` as `bench`.

#![allow(dead_code)]

use crate::common::extension::Extension;
use crate::common::{metric, wait_until, Server, API_KEY};
use agentenv::agent::{AgentClient, ExecRequest};
use agentenv::vm::{self, Accel, Qmp, GUEST_MAC};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const MEMORY_MB: u32 = 256;
pub const DISK_MB: u32 = 1024;

/// Writes 32 MiB of non-zero data into guest RAM (tmpfs); rewritten on every run.
pub const DIRTY_32M: &str = "head -c 1048576 /dev/urandom > /dev/shm/seed && \
     for i in $(seq 32); do cat /dev/shm/seed; done > /dev/shm/dirty && rm /dev/shm/seed";
/// Wait between operations so the guest is idle when the next one starts.
pub const SETTLE: Duration = Duration::from_millis(250);
/// The migration bandwidth cap the product uses for captures (QEMU's default of
/// 128 MiB/s is several times slower than writing the file).
pub const CAPTURE_BANDWIDTH: u64 = 64 << 30;
/// What the product sets on every capture and restore.
pub const MIGRATION_CAPS: &[(&str, bool)] = &[("x-ignore-shared", true)];
/// Upper bound for any single step of the floor (boot, save, load).
pub const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs per row: `AENV_BENCH_RUNS`, else `default`; at least one.
pub fn runs(default: usize) -> usize {
    env_or("AENV_BENCH_RUNS", default)
}

/// The count in environment variable `name`, else `default`; at least one.
pub fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        .max(1)
}

/// The guest assets: `AENV_ASSETS_DIR`, else where setup puts them.
pub fn assets_dir() -> PathBuf {
    PathBuf::from(
        std::env::var("AENV_ASSETS_DIR").unwrap_or_else(|_| "/var/lib/agentenv/assets".into()),
    )
}

pub fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    s
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    sorted(v)[v.len() / 2]
}

pub fn p90(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let s = sorted(v);
    s[((s.len() as f64 * 0.9).ceil() as usize).saturating_sub(1)]
}

pub fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Milliseconds from `t` to `at`, when `at` came at or after `t`.
pub fn ms_after(at: Option<Instant>, t: Instant) -> Option<f64> {
    let at = at?;
    (at >= t).then(|| (at - t).as_secs_f64() * 1000.0)
}

pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

pub fn field(line: &str, key: &str) -> Option<f64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// The medians of `keys` over the log lines that contain `marker` ("key 12, key 3"),
/// and how many lines there were.
pub fn log_medians(log: &str, marker: &str, keys: &[&str]) -> (String, usize) {
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(marker)).collect();
    let fields: Vec<String> = keys
        .iter()
        .map(|key| {
            let values: Vec<f64> = lines.iter().filter_map(|l| field(l, key)).collect();
            format!("{key} {:.0}", median(&values))
        })
        .collect();
    (fields.join(", "), lines.len())
}

/// The bench server in `work`: the binary cargo built for the benches (release), or
/// `AENV_BENCH_BINARY`; info log, stdout discarded, on 127.0.0.1, a pool of 2 slots, the
/// bench guest size, `extension` as its custom extension and `extra` (whole sections)
/// added to the config. Returns once the pool had time to fill, so slot creation is not
/// on a measured path.
pub fn start_server(work: &Path, extension: Option<&Extension>, extra: &str) -> Server {
    let mut builder = Server::builder()
        .dir(work)
        .listen(&format!("127.0.0.1:{}", crate::common::free_port()))
        .log_level("info")
        .no_stdout()
        .pool_min(2)
        .vm(
            "assets_dir",
            format!("{:?}", assets_dir().display().to_string()),
        )
        .vm("default_memory_mb", MEMORY_MB)
        .vm("default_disk_size_mb", DISK_MB)
        .section(extra);
    if let Some(binary) = std::env::var_os("AENV_BENCH_BINARY") {
        builder = builder.binary(Path::new(&binary));
    }
    if let Some(extension) = extension {
        builder = builder.section(&format!(
            "[custom_extension]\nurl = \"{}\"",
            extension.url()
        ));
    }
    let server = builder.start();
    // Slot creation stays off the measured path: wait (bounded) for the pool to fill.
    let filled = wait_until(Duration::from_secs(10), || {
        metric(&server, "agentenv_network_slots{state=\"pooled\"} ") >= 2
    });
    assert!(filled, "the network pool did not fill:\n{}", server.log());
    server
}

/// What the benches do through the API, on the tests' [`Server`] (this bench crate
/// includes tests/common, so its `Server` takes more methods here): calls that must answer
/// a given status, on the server's kept-alive client, and the operations the benches time.
impl Server {
    /// One API call that must answer `want`; the JSON body.
    pub fn call_expect(&self, method: &str, path: &str, body: Option<Value>, want: u16) -> Value {
        self.try_call(method, path, body, want)
            .unwrap_or_else(|e| panic!("{}", self.failure(&e)))
    }

    /// [`Server::call_expect`], with what went wrong as an error.
    pub fn try_call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        want: u16,
    ) -> Result<Value, String> {
        let (status, v) = self.call_via(&self.keep_alive, method, path, body)?;
        if status != want {
            return Err(format!(
                "answered {method} {path} with {status} (wanted {want}): {v}"
            ));
        }
        Ok(v)
    }

    /// The last lines of the server's log, for a panic message.
    pub fn failure(&self, what: &str) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(30)..].join("\n");
        format!("the server {what}; its log ends with:\n{tail}")
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the server runs").id()
    }

    /// Creates a sandbox from `template` and runs `true` in it; its id.
    pub fn try_create_and_run(&self, template: &str) -> Result<String, String> {
        let v = self.try_call(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": template, "timeout": 600})),
            201,
        )?;
        let id = v["sandboxID"].as_str().unwrap_or_default().to_string();
        let answer = self.try_call(
            "POST",
            &format!("/sandboxes/{id}/commands"),
            Some(json!({"cmd": "true"})),
            200,
        );
        if let Err(e) = answer {
            let _ = self.try_call("DELETE", &format!("/sandboxes/{id}"), None, 204);
            return Err(e);
        }
        Ok(id)
    }

    /// Builds a template from `image` with `POST /templates` and waits until it is ready.
    pub fn build_template(&self, image: &str, name: &str) -> String {
        self.call_expect(
            "POST",
            "/templates",
            Some(json!({"name": name, "image": image, "cpuCount": 1, "memoryMB": MEMORY_MB, "diskSizeMB": DISK_MB})),
            202,
        );
        let ready = wait_until(Duration::from_secs(180), || {
            self.call_expect("GET", &format!("/templates/{name}"), None, 200)["buildStatus"]
                == "ready"
        });
        assert!(
            ready,
            "{}",
            self.failure("did not finish the template build")
        );
        name.to_string()
    }

    /// Runs `script` (`true` as is, anything else with `sh -c`) in the sandbox; its time.
    pub fn command(&self, id: &str, script: &str) -> f64 {
        let body = if script == "true" {
            json!({"cmd": "true"})
        } else {
            json!({"cmd": "sh", "args": ["-c", script]})
        };
        let t = Instant::now();
        let v = self.call_expect(
            "POST",
            &format!("/sandboxes/{id}/commands"),
            Some(body),
            200,
        );
        assert_eq!(v["exitCode"], 0, "command {script:?}: {v}");
        ms_since(t)
    }

    /// Creates a sandbox from `image` with `POST /sandboxes-cold`; its id.
    pub fn create_cold(&self, image: &str) -> String {
        let v = self.call_expect(
            "POST",
            "/sandboxes-cold",
            Some(json!({"image": image, "timeout": 600})),
            201,
        );
        v["sandboxID"].as_str().unwrap().to_string()
    }

    /// Pauses the sandbox; the time to the 204.
    pub fn pause(&self, id: &str) -> f64 {
        let t = Instant::now();
        self.call_expect("POST", &format!("/sandboxes/{id}/pause"), None, 204);
        ms_since(t)
    }

    /// Resumes the sandbox; the time to the 201.
    pub fn resume(&self, id: &str) -> f64 {
        let t = Instant::now();
        self.call_expect(
            "POST",
            &format!("/sandboxes/{id}/resume"),
            Some(json!({"timeout": 600})),
            201,
        );
        ms_since(t)
    }

    /// Snapshots the sandbox as template `name`; the time to the 201.
    pub fn snapshot(&self, id: &str, name: &str) -> f64 {
        let t = Instant::now();
        self.call_expect(
            "POST",
            &format!("/sandboxes/{id}/snapshots"),
            Some(json!({ "name": name })),
            201,
        );
        ms_since(t)
    }

    /// Waits (up to 60 s) until a warm standby waits: a create then measures a hit.
    pub fn wait_standby(&self) {
        let ready = wait_until(Duration::from_secs(60), || {
            metric(self, "agentenv_standby_vms{state=\"ready\"}") > 0
        });
        assert!(ready, "no standby became ready within 60 s");
    }

    /// Creates a sandbox from `template`: its id and the time to its 201.
    pub fn create_from_template(&self, template: &str) -> (String, f64) {
        let t = Instant::now();
        let v = self.call_expect(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": template, "timeout": 600})),
            201,
        );
        let took = ms_since(t);
        (v["sandboxID"].as_str().unwrap().to_string(), took)
    }

    /// Deletes the sandbox.
    pub fn delete(&self, id: &str) {
        self.call_expect("DELETE", &format!("/sandboxes/{id}"), None, 204);
    }

    /// Deletes the template.
    pub fn delete_template(&self, name: &str) {
        self.call_expect("DELETE", &format!("/templates/{name}"), None, 204);
    }

    /// `GET /sandboxes/{id}` from `threads` clients for `duration`: the latencies and
    /// requests per second.
    pub fn get_throughput(&self, id: &str, threads: usize, duration: Duration) -> (Vec<f64>, f64) {
        let url = format!("{}/sandboxes/{id}", self.base);
        let start = Instant::now();
        let lat: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let url = url.clone();
                    s.spawn(move || {
                        let agent = ureq::AgentBuilder::new().build();
                        let mut lat = Vec::new();
                        while start.elapsed() < duration && lat.len() < 200_000 {
                            let t = Instant::now();
                            agent.get(&url).set("X-API-Key", API_KEY).call().unwrap();
                            lat.push(ms_since(t));
                        }
                        lat
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let rate = lat.len() as f64 / start.elapsed().as_secs_f64();
        (lat, rate)
    }

    /// How many snapshots `GET /snapshots` lists.
    pub fn count_snapshots(&self) -> usize {
        let v = self.call_expect("GET", "/snapshots", None, 200);
        v.as_array().map_or(0, Vec::len)
    }
}

/// The raw floor: QEMU by hand.
pub struct Floor {
    pub assets: PathBuf,
    pub accel: Accel,
    pub cmdline: String,
}

/// One hand-started QEMU; killed on drop.
pub struct FloorVm {
    pub child: Child,
    pub qmp: Qmp,
    pub agent: PathBuf,
    pub client: Option<AgentClient>,
}

/// A floor template: the idle VM's state, its (now immutable) disk, and its RAM file when
/// it ran with one.
pub struct FloorTemplate {
    pub state: PathBuf,
    pub disk: PathBuf,
    pub memory: Option<PathBuf>,
}

impl Floor {
    /// The floor for the assets in `assets`: the accelerator the product would pick and
    /// the product's kernel command line.
    pub fn new(assets: &Path) -> Floor {
        let accel = vm::detect_accel(agentenv::config::AccelMode::Auto).unwrap();
        Floor {
            assets: assets.to_path_buf(),
            accel,
            cmdline: vm::kernel_cmdline(accel, &["agentenv.port=49983".into()]).unwrap(),
        }
    }

    /// Spawns QEMU in `run` on `disk` with the product's argv shape, and connects QMP.
    /// `memory`: the RAM file and whether it is mapped shared (else anonymous RAM).
    pub fn spawn(
        &self,
        run: &Path,
        disk: &Path,
        incoming: bool,
        memory: Option<(&Path, bool)>,
    ) -> FloorVm {
        std::fs::create_dir_all(run).unwrap();
        let (qmp_sock, agent) = (run.join("qmp.sock"), run.join("agent.sock"));
        for socket in [&qmp_sock, &agent] {
            let _ = std::fs::remove_file(socket);
        }
        let mut machine =
            String::from("microvm,acpi=on,auto-kernel-cmdline=off,memory-backend=ram");
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm", "host"),
            Accel::Tcg { .. } => {
                machine.push_str(",pit=on,pic=off");
                ("tcg,tb-size=32", "max")
            }
        };
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
            .args(["-M", &machine, "-accel", accel, "-cpu", cpu])
            .args(["-smp", "1", "-m", &format!("{MEMORY_MB}M")])
            .args([
                "-sandbox",
                "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
            ])
            .arg("-kernel")
            .arg(vm::guest_kernel(&self.assets))
            .arg("-initrd")
            .arg(self.assets.join("initramfs.img"))
            .args(["-append", &self.cmdline])
            .args([
                "-object",
                &match memory {
                    Some((path, shared)) => format!(
                        "memory-backend-file,id=ram,size={MEMORY_MB}M,mem-path={},share={}",
                        path.display(),
                        if shared { "on" } else { "off" }
                    ),
                    None => format!("memory-backend-ram,id=ram,size={MEMORY_MB}M"),
                },
                "-chardev",
                &format!(
                    "file,id=console,path={},append=on",
                    run.join("console.log").display()
                ),
                "-serial",
                "chardev:console",
                "-drive",
                &format!(
                    "id=root,file={},format=qcow2,if=none,discard=unmap",
                    disk.display()
                ),
                "-device",
                "virtio-blk-device,drive=root",
                "-netdev",
                "hubport,id=net0,hubid=0",
                "-device",
                &format!("virtio-net-device,netdev=net0,mac={GUEST_MAC}"),
                "-chardev",
                &format!(
                    "socket,id=agent,path={},server=on,wait=off",
                    agent.display()
                ),
                "-device",
                "virtio-serial-device",
                "-device",
                "virtserialport,chardev=agent,name=agentenv",
                "-chardev",
                &format!(
                    "socket,id=qmp,path={},server=on,wait=off",
                    qmp_sock.display()
                ),
                "-mon",
                "chardev=qmp,mode=control",
            ]);
        if incoming {
            // -S as the product: a dirty-only state's global state says "running".
            cmd.args(["-incoming", "defer", "-S"]);
        }
        let log = std::fs::File::create(run.join("qemu.log")).unwrap();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "floor QEMU exited ({status}): {}",
                    std::fs::read_to_string(run.join("qemu.log")).unwrap_or_default()
                );
            }
            match std::os::unix::net::UnixStream::connect(&qmp_sock) {
                Ok(s) => break s,
                Err(e) => assert!(Instant::now() < deadline, "floor QMP socket: {e}"),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut qmp = Qmp::handshake(stream, Duration::from_secs(10)).unwrap();
        qmp.migrate_set_capabilities(MIGRATION_CAPS).unwrap();
        FloorVm {
            child,
            qmp,
            agent,
            client: None,
        }
    }

    /// Boots a VM cold (its RAM in a shared file with `ram_file`), lets it go idle and
    /// saves it: the floor's template.
    pub fn make_template(&self, base: &Path, dir: &Path, ram_file: bool) -> FloorTemplate {
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk.qcow2");
        vm::create_overlay(base, &disk, DISK_MB).unwrap();
        let memory = ram_file.then(|| dir.join("memory.ram"));
        let mut vm = self.spawn(dir, &disk, false, memory.as_deref().map(|m| (m, true)));
        AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT)
            .expect("the floor template VM never answered");
        vm::stop_boot_timer(&mut vm.qmp, self.accel).unwrap();
        std::thread::sleep(SETTLE);
        let state = dir.join("state.bin");
        vm.pause(&state);
        FloorTemplate {
            state,
            disk,
            memory,
        }
    }

    /// A clone of `template` in `dir`: a fresh overlay, then a restore (RAM mapped
    /// copy-on-write from the template's RAM file, if it has one), timed from the overlay
    /// to the agent's first answer.
    pub fn clone_template(&self, template: &FloorTemplate, dir: &Path) -> (FloorVm, f64) {
        let t = Instant::now();
        let (disk, _) = self.clone_disk(&template.disk, dir);
        let memory = template.memory.as_deref().map(|m| (m, false));
        let (vm, _) = self.restore(dir, &disk, &template.state, memory);
        (vm, ms_since(t))
    }

    /// A new writable overlay over the (immutable) floor template disk, and its time.
    pub fn clone_disk(&self, template_disk: &Path, dir: &Path) -> (PathBuf, f64) {
        std::fs::create_dir_all(dir).unwrap();
        let disk = dir.join("disk.qcow2");
        let t = Instant::now();
        let status = Command::new("qemu-img")
            .args(["create", "-q", "-u", "-f", "qcow2", "-F", "qcow2", "-b"])
            .arg(template_disk)
            .arg(&disk)
            .arg(format!("{DISK_MB}M"))
            .status()
            .unwrap();
        assert!(status.success(), "qemu-img create failed");
        (disk, ms_since(t))
    }

    /// Restore by hand, timed from spawn to the agent's first answer.
    pub fn restore(
        &self,
        run: &Path,
        disk: &Path,
        state: &Path,
        memory: Option<(&Path, bool)>,
    ) -> (FloorVm, f64) {
        let t = Instant::now();
        let mut vm = self.spawn(run, disk, true, memory);
        vm.qmp.migrate_incoming_file(state).unwrap();
        vm.qmp.wait_status("paused", STEP_TIMEOUT).unwrap();
        vm.qmp.cont().unwrap();
        vm.client = Some(
            AgentClient::connect(&vm.agent, Instant::now() + STEP_TIMEOUT)
                .expect("the floor VM's agent did not answer after a restore"),
        );
        (vm, ms_since(t))
    }
}

impl FloorVm {
    /// Runs `script` with `sh -c` (or `true` as is) through the agent; its time.
    pub fn exec(&self, script: &str) -> f64 {
        let (cmd, args) = if script == "true" {
            ("true", vec![])
        } else {
            ("sh", vec!["-c".to_string(), script.to_string()])
        };
        let t = Instant::now();
        let result = self
            .client
            .as_ref()
            .expect("the floor VM was restored")
            .exec(&ExecRequest {
                cmd: cmd.into(),
                args,
                env: Vec::new(),
                cwd: "/".into(),
                timeout_ms: 60_000,
                max_output_bytes: 1 << 16,
            })
            .unwrap();
        assert_eq!(result.exit_code, 0, "floor command {script:?}: {result:?}");
        ms_since(t)
    }

    /// stop + migrate to `state` until completed; the VM is left stopped.
    pub fn save(&mut self, state: &Path) {
        self.qmp.stop().unwrap();
        self.qmp.migrate_set_parameters(CAPTURE_BANDWIDTH).unwrap();
        self.qmp.migrate_to_file(state).unwrap();
        self.qmp.wait_migration(STEP_TIMEOUT).unwrap();
    }

    /// Save, then quit and wait for QEMU to exit.
    pub fn pause(&mut self, state: &Path) -> f64 {
        self.client = None;
        let t = Instant::now();
        self.save(state);
        self.qmp.quit().unwrap();
        self.child.wait().unwrap();
        ms_since(t)
    }

    /// Save, then let the VM run on.
    pub fn snapshot(&mut self, state: &Path) -> f64 {
        let t = Instant::now();
        self.save(state);
        self.qmp.cont().unwrap();
        ms_since(t)
    }
}

impl Drop for FloorVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
