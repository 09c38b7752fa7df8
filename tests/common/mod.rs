//! Shared harness for end-to-end tests: starts the real `agentenv` binary on loopback with
//! its own state dir, talks HTTP to it, and inspects what it leaves on the host.

#![allow(dead_code)]

pub mod registry;

pub mod extension;

pub mod sdk;

pub mod loopfs;

pub mod cluster;

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const API_KEY: &str = "test-key-0123456789abcdefghijklmnopqrstuvwxyz";

/// Where scripts/setup.sh put the kernel, initramfs and base image.
pub fn assets_dir() -> PathBuf {
    std::env::var_os("AENV_TEST_ASSETS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/agentenv/assets"))
}

pub fn base_image() -> String {
    format!("oci:{}", assets_dir().join("base-image").display())
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Server {
    pub child: Option<Child>,
    /// The server binary this harness runs (the one cargo built, unless a test installed
    /// another).
    pub binary: PathBuf,
    /// A program and its arguments the binary is run under (e.g. `nsenter` into a test's
    /// namespaces, tests/common/cluster.rs); empty: the binary is run directly.
    pub launcher: Vec<String>,
    pub base: String,
    pub state_dir: PathBuf,
    pub log_path: PathBuf,
    pub config_path: PathBuf,
}

impl Server {
    /// Starts a server with the given extra TOML appended to the test config.
    pub fn start(extra_toml: &str) -> Server {
        Server::start_full(&[], extra_toml)
    }

    /// Starts a server with some `[vm]` keys overridden (values are TOML literals).
    pub fn start_with_vm(vm: &[(&str, String)]) -> Server {
        Server::start_full(vm, "")
    }

    /// Starts another server binary (e.g. one installed from the bundle) with some `[vm]`
    /// keys overridden.
    pub fn start_binary(binary: &Path, vm: &[(&str, String)]) -> Server {
        let mut server = Server::configure(&scratch_dir(), vm, "");
        server.binary = binary.to_path_buf();
        server.spawn();
        server
    }

    /// Starts a server with extra `[server]` keys (TOML lines) and environment variables.
    pub fn start_with_server_keys(server_keys: &str, env: &[(&str, &str)]) -> Server {
        let mut server = Server::configure_full(&scratch_dir(), &[], server_keys, "");
        server.spawn_with_env(env);
        server
    }

    fn start_full(vm_overrides: &[(&str, String)], extra_toml: &str) -> Server {
        let mut server = Server::configure(&scratch_dir(), vm_overrides, extra_toml);
        server.spawn();
        server
    }

    /// Writes a config whose state dir is `<dir>/state`, without starting the process
    /// (call [`Server::spawn`], or run the binary on `config_path` yourself).
    pub fn configure(dir: &Path, vm_overrides: &[(&str, String)], extra_toml: &str) -> Server {
        Server::configure_full(dir, vm_overrides, "", extra_toml)
    }

    /// Like [`Server::configure`], with extra `[server]` keys (TOML lines).
    pub fn configure_full(
        dir: &Path,
        vm_overrides: &[(&str, String)],
        server_keys: &str,
        extra_toml: &str,
    ) -> Server {
        let state_dir = dir.to_path_buf();
        std::fs::create_dir_all(&state_dir).unwrap();
        let port = free_port();
        let config_path = state_dir.join("config.toml");
        let config = format!(
            r#"
[server]
listen = "0.0.0.0:{port}"
state_dir = "{state}"
api_key = "{API_KEY}"
{server_keys}

[vm]
{vm}

[network]
pool_min = 1
{extra_toml}
"#,
            state = state_dir.join("state").display(),
            vm = vm_table(vm_overrides),
        );
        std::fs::write(&config_path, config).unwrap();
        Server {
            child: None,
            binary: PathBuf::from(env!("CARGO_BIN_EXE_agentenv")),
            launcher: Vec::new(),
            base: format!("http://127.0.0.1:{port}"),
            state_dir: state_dir.join("state"),
            log_path: state_dir.join("server.log"),
            config_path,
        }
    }

    /// (Re)starts the process on the same config and state dir.
    pub fn spawn(&mut self) {
        self.spawn_with_env(&[]);
    }

    /// Like [`Server::spawn`], with extra environment variables for the process (e.g. the
    /// `AENV_CUSTOM_EXTENSION_*` overrides).
    pub fn spawn_with_env(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap();
        let mut cmd = match self.launcher.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&self.binary);
                cmd
            }
            None => Command::new(&self.binary),
        };
        let child = cmd
            .args(["serve", "--config"])
            .arg(&self.config_path)
            .env("RUST_LOG", "debug")
            // A test that wants the default template built at startup says so.
            .env("AENV_TEMPLATES_BUILD_BASE", "false")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(resp) = ureq::get(&format!("{}/health", self.base))
                .timeout(Duration::from_secs(2))
                .call()
            {
                assert_eq!(resp.status(), 204);
                return;
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("server exited during startup ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "server not ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for a graceful exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(60);
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    panic!("server did not stop within 60 s:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// kill -9, as a crash.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let req = ureq::request(method, &format!("{}{}", self.base, path))
            .set("X-API-Key", API_KEY)
            .timeout(Duration::from_secs(180));
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap_or_default();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    /// Creates a sandbox from `image`, asserting 201.
    pub fn create(&self, body: Value) -> Value {
        let (status, v) = self.call("POST", "/sandboxes-cold", Some(body));
        assert_eq!(status, 201, "create failed: {v}\n{}", self.log());
        v
    }

    /// Creates a sandbox from a built template (`POST /sandboxes`), asserting 201; its id.
    pub fn create_from(&self, template: &str, timeout_secs: u64) -> String {
        let body = serde_json::json!({"templateID": template, "timeout": timeout_secs});
        let (status, v) = self.call("POST", "/sandboxes", Some(body));
        assert_eq!(
            status,
            201,
            "create from {template} failed: {v}\n{}",
            self.log()
        );
        id_of(&v)
    }

    pub fn exec(&self, id: &str, cmd: &str, args: &[&str]) -> Value {
        let (status, v) = self.call(
            "POST",
            &format!("/sandboxes/{id}/commands"),
            Some(serde_json::json!({"cmd": cmd, "args": args})),
        );
        assert_eq!(status, 200, "command failed: {v}");
        v
    }

    /// Sends raw bytes and returns the status line's code and the whole response.
    pub fn raw(&self, request: &str) -> (u16, String) {
        let addr = self.base.trim_start_matches("http://");
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // The server may answer and close before it has read everything (e.g. 413): what
        // it answered is still read below.
        if let Err(e) = s.write_all(request.as_bytes()) {
            assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ),
                "cannot send the request: {e}"
            );
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let code = out
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, out)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        // A passing test leaves nothing in /tmp; a failing one keeps its state dir and
        // server log for inspection.
        if !std::thread::panicking() {
            if let Some(dir) = self.state_dir.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

/// The test `[vm]` keys, with overrides.
pub fn vm_table(overrides: &[(&str, String)]) -> String {
    let mut keys = vec![
        (
            "assets_dir",
            format!("{:?}", assets_dir().display().to_string()),
        ),
        ("default_memory_mb", "256".to_string()),
        ("default_cpu_count", "1".to_string()),
        ("default_disk_size_mb", "1024".to_string()),
        ("ready_timeout_secs", "60".to_string()),
    ];
    for (k, v) in overrides {
        keys.retain(|(key, _)| key != k);
        keys.push((k, v.clone()));
    }
    keys.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
}

/// A fresh per-server directory under the temp dir.
pub fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("aenv-e2e-{}-{:x}", std::process::id(), rand_u64()))
}

pub fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    u64::from_le_bytes(b)
}

/// Output of a host command, for inspecting the host.
pub fn host(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn netns_files() -> Vec<String> {
    std::fs::read_dir("/var/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("agentenv-ns-"))
                .collect()
        })
        .unwrap_or_default()
}

pub fn aenv_links() -> Vec<String> {
    host("ip", &["-o", "link"])
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_string())
        .filter(|n| n.starts_with("aenv-"))
        .collect()
}

/// PIDs of QEMU processes whose command line mentions `needle`.
pub fn qemu_processes_with(needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("qemu-system") && cmdline.contains(needle) {
            pids.push(pid);
        }
    }
    pids
}

/// Files left under `dir` (recursively), for leak checks.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            out.push(e.path());
            if e.path().is_dir() {
                out.extend(files_under(&e.path()));
            }
        }
    }
    out
}

static ONE_SERVER: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One agentenv server on a host at a time: tests of one binary that start a server take
/// turns through this, even when the harness runs them in parallel.
/// A sample of `GET /metrics` (`name{labels}` as written there), 0 when absent.
#[allow(dead_code)]
pub fn metric(s: &Server, sample: &str) -> u64 {
    metric_sample(s, sample).unwrap_or(0.0) as u64
}

/// A sample of `GET /metrics`, `None` when absent.
#[allow(dead_code)]
pub fn metric_sample(s: &Server, sample: &str) -> Option<f64> {
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
}

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_SERVER.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits until `f` is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    f()
}

/// Builds template `name` from the built-in base image and waits until it is ready.
pub fn build_template(s: &Server, name: &str) {
    let (code, t) = s.call(
        "POST",
        "/templates",
        Some(
            serde_json::json!({"name": name, "image": base_image(), "memoryMB": 256, "cpuCount": 1,
                    "diskSizeMB": 1024, "envVars": {"FROM_TEMPLATE": "yes"}}),
        ),
    );
    assert_eq!(code, 202, "{t}");
    let ready = wait_until(Duration::from_secs(180), || {
        s.call("GET", &format!("/templates/{name}"), None).1["buildStatus"] == "ready"
    });
    assert!(ready, "template {name} not ready:\n{}", s.log());
}

/// Runs `sh -c script` in sandbox `id` through the API; asserts exit 0, returns stdout.
pub fn sh(s: &Server, id: &str, script: &str) -> String {
    let v = s.exec(id, "sh", &["-c", script]);
    assert_eq!(v["exitCode"], 0, "{script}: {v}");
    v["stdout"].as_str().unwrap().to_string()
}

/// The `sandboxID` of a create/resume answer.
pub fn id_of(v: &Value) -> String {
    v["sandboxID"].as_str().unwrap().to_string()
}

/// Waits for `child` to exit until `deadline`; past it, kills and reaps it and returns None.
pub fn wait_exit(child: &mut Child, deadline: Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Debian 12 test image as `oci:<dir>`: built by scripts/build-debian-image.sh
/// (debootstrap from the host's apt mirror) the first time, cached afterwards in
/// `$AENV_TEST_IMAGES_DIR` (default /var/lib/agentenv/test-images).
pub fn debian_image() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-debian-image.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .expect("scripts/build-debian-image.sh runs");
    assert!(
        out.status.success(),
        "building the Debian 12 test image failed (needs root and debootstrap; scripts/setup.sh \
         installs it): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = std::env::var_os("AENV_TEST_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/agentenv/test-images"))
        .join("debian-12");
    format!("oci:{}", dir.display())
}
