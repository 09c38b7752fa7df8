//! Shared harness for end-to-end tests: starts the real `agentenv` binary on loopback with
//! its own state dir, talks HTTP to it, and inspects what it leaves on the host.

#![allow(dead_code)]

pub mod registry;

pub mod extension;

pub mod sdk;

pub mod loopfs;

pub mod cluster;

pub mod shared;

use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The servers' key, in E2B's own form (`e2b_` and 40 hex digits), so every test and SDK
/// run uses the key format E2B users bring.
pub const API_KEY: &str = "e2b_0123456789abcdef0123456789abcdef01234567";

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
    /// `RUST_LOG` for the process.
    pub log_level: String,
    /// The process's stdout goes to the log with its stderr; `false`: to /dev/null.
    pub stdout_to_log: bool,
    pub base: String,
    pub state_dir: PathBuf,
    pub log_path: PathBuf,
    pub config_path: PathBuf,
    /// A client that keeps its connections open from call to call, as an SDK does (the
    /// benches' client); [`Server::call`] opens a new one each call. Made anew at every
    /// spawn, so it holds no connection to an earlier process.
    pub keep_alive: ureq::Agent,
}

/// How to configure and start a [`Server`]: the test config (`[server]` on a free port,
/// the test `[vm]` keys, `[network] pool_min = 1`) with whatever a test changes.
pub struct ServerBuilder {
    vm: Vec<(String, String)>,
    server_keys: String,
    sections: String,
    env: Vec<(String, String)>,
    binary: PathBuf,
    dir: Option<PathBuf>,
    launcher: Vec<String>,
    log_level: String,
    stdout_to_log: bool,
    listen: Option<String>,
    url: Option<String>,
    pool_min: u32,
}

impl ServerBuilder {
    /// Overrides the `[vm]` key `key` (the value is a TOML literal: `5`, `"\"/path\""`).
    pub fn vm(mut self, key: &str, value: impl std::fmt::Display) -> Self {
        self.vm.push((key.to_string(), value.to_string()));
        self
    }

    /// Appends TOML lines to `[server]`.
    pub fn server_keys(mut self, lines: &str) -> Self {
        self.server_keys.push_str(lines);
        self.server_keys.push('\n');
        self
    }

    /// Appends TOML (whole sections) after `[network]`.
    pub fn section(mut self, toml: &str) -> Self {
        self.sections.push_str(toml);
        self.sections.push('\n');
        self
    }

    /// Sets `[network] pool_min` (1 unless said).
    pub fn pool_min(mut self, slots: u32) -> Self {
        self.pool_min = slots;
        self
    }

    /// An environment variable for the process [`ServerBuilder::start`] spawns (not for a
    /// later [`Server::spawn`]).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Runs another server binary (e.g. one installed from the bundle).
    pub fn binary(mut self, binary: &Path) -> Self {
        self.binary = binary.to_path_buf();
        self
    }

    /// Keeps config, state dir (`<dir>/state`) and log in `dir` rather than a fresh
    /// [`scratch_dir`]; the server's drop removes it unless the test failed.
    pub fn dir(mut self, dir: &Path) -> Self {
        self.dir = Some(dir.to_path_buf());
        self
    }

    /// Runs the binary under `program args…` (see [`Server::launcher`]).
    pub fn launcher(mut self, argv: Vec<String>) -> Self {
        self.launcher = argv;
        self
    }

    /// `RUST_LOG` for the process (`debug` unless said).
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.to_string();
        self
    }

    /// Sends the process's stdout to /dev/null (the log keeps its stderr).
    pub fn no_stdout(mut self) -> Self {
        self.stdout_to_log = false;
        self
    }

    /// `[server] listen` (`0.0.0.0:<a free port>` unless said); the harness calls it on
    /// 127.0.0.1 unless [`ServerBuilder::url`] says otherwise.
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = Some(addr.to_string());
        self
    }

    /// The URL the harness calls the server on.
    pub fn url(mut self, base: &str) -> Self {
        self.url = Some(base.to_string());
        self
    }

    /// Writes the config, without starting the process (call [`Server::spawn`], or run the
    /// binary on `config_path` yourself).
    pub fn configure(self) -> Server {
        let dir = self.dir.unwrap_or_else(scratch_dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listen = self
            .listen
            .unwrap_or_else(|| format!("0.0.0.0:{}", free_port()));
        let base = self
            .url
            .unwrap_or_else(|| format!("http://{}", listen.replace("0.0.0.0", "127.0.0.1")));
        let state_dir = dir.join("state");
        let config_path = dir.join("config.toml");
        let config = format!(
            r#"
[server]
listen = "{listen}"
state_dir = "{state}"
api_key = "{API_KEY}"
{server_keys}

[vm]
{vm}

[network]
pool_min = {pool_min}
{sections}
"#,
            state = state_dir.display(),
            server_keys = self.server_keys,
            vm = vm_table(&self.vm),
            pool_min = self.pool_min,
            sections = self.sections,
        );
        std::fs::write(&config_path, config).unwrap();
        Server {
            child: None,
            binary: self.binary,
            launcher: self.launcher,
            log_level: self.log_level,
            stdout_to_log: self.stdout_to_log,
            base,
            state_dir,
            log_path: dir.join("server.log"),
            config_path,
            keep_alive: client(),
        }
    }

    /// Writes the config and starts the process; returns once `/health` answers.
    pub fn start(mut self) -> Server {
        let env = std::mem::take(&mut self.env);
        let mut server = self.configure();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        server.spawn_with_env(&env);
        server
    }
}

impl Server {
    /// A [`ServerBuilder`] on the test defaults.
    pub fn builder() -> ServerBuilder {
        ServerBuilder {
            vm: Vec::new(),
            server_keys: String::new(),
            sections: String::new(),
            env: Vec::new(),
            binary: PathBuf::from(env!("CARGO_BIN_EXE_agentenv")),
            dir: None,
            launcher: Vec::new(),
            log_level: "debug".to_string(),
            stdout_to_log: true,
            listen: None,
            url: None,
            pool_min: 1,
        }
    }

    /// Starts a server with the given extra TOML appended to the test config.
    pub fn start(extra_toml: &str) -> Server {
        Server::builder().section(extra_toml).start()
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
            .env("RUST_LOG", &self.log_level)
            // A test that wants the default template built at startup says so.
            .env("AENV_TEMPLATES_BUILD_BASE", "false")
            // The config says which extension runs, not the shell the tests run from.
            .env_remove("AENV_CUSTOM_EXTENSION_URL")
            .env_remove("AENV_CUSTOM_EXTENSION_AUTH_TOKEN")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(if self.stdout_to_log {
                Stdio::from(log.try_clone().unwrap())
            } else {
                Stdio::null()
            })
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.keep_alive = client();
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

    /// One API call: the status and the body as JSON (a string when it is not JSON).
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call_via(&client(), method, path, body)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Server::call`] through `agent` (e.g. one that keeps its connections), with what
    /// failed before an answer as an error.
    pub fn call_via(
        &self,
        agent: &ureq::Agent,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), String> {
        let req = agent
            .request(method, &format!("{}{}", self.base, path))
            .set("X-API-Key", API_KEY);
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => return Err(format!("{method} {path}: {e}")),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap_or_default();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, value))
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

/// An HTTP client whose calls give up after 180 s.
pub fn client() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(180))
        .build()
}

/// The test `[vm]` keys, with overrides.
fn vm_table(overrides: &[(String, String)]) -> String {
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
        keys.push((k.as_str(), v.clone()));
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

/// `n` uploads to sandbox `id` that send their head and 1000 bytes of an 8 MiB body, then
/// stall until the returned connections are dropped.
pub fn stalled_uploads(s: &Server, id: &str, n: usize) -> Vec<TcpStream> {
    let addr = s.base.trim_start_matches("http://");
    (0..n)
        .map(|i| {
            let mut c = TcpStream::connect(addr).unwrap();
            write!(
                c,
                "PUT /sandboxes/{id}/files?path=/tmp/stalled-{i} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Length: {}\r\n\r\n",
                8 << 20
            )
            .unwrap();
            c.write_all(&[b'x'; 1000]).unwrap();
            c
        })
        .collect()
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

/// SIGSTOPs process `pid` and waits (up to 10 s) until every one of its threads is
/// stopped: `kill` returns before they are, and a thread already running may still answer
/// a request in between.
pub fn stop_process(pid: u32) {
    host("kill", &["-STOP", &pid.to_string()]);
    let all_stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
            tasks.flatten().all(|t| {
                std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                    stat.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().next())
                        .is_some_and(|state| state == "T")
                })
            })
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), all_stopped),
        "process {pid} did not stop within 10 s of SIGSTOP"
    );
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
