//! The E2B SDKs (python `e2b`, JS `e2b`, installed by scripts/setup.sh) driving a test
//! server: each script under tests/sdk prints `ok <call>` per checked call.

use super::Server;
use super::API_KEY;
use std::time::Duration;

/// Where scripts/setup.sh installs the SDKs.
pub const TOOLS: &str = "/opt/agentenv-tests";

/// The python interpreter of the test venv and the JS SDK's module (node >= 20 checked).
pub fn sdk_tools() -> (String, String) {
    let python = format!("{TOOLS}/venv/bin/python");
    let js_module = format!("{TOOLS}/node/node_modules/e2b/dist/index.mjs");
    assert!(
        std::path::Path::new(&python).exists() && std::path::Path::new(&js_module).exists(),
        "the E2B SDKs are missing under {TOOLS}: run scripts/setup.sh"
    );
    let out = std::process::Command::new("node")
        .arg("--version")
        .output()
        .expect("node not found: run scripts/setup.sh");
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let major: u32 = version
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    assert!(
        major >= 20,
        "node {version} is too old for the e2b JS SDK (needs >= 20.18)"
    );
    (python, js_module)
}

/// Runs `tests/sdk/<script>` with the SDK pointed at `s` (and, for JS, the SDK module
/// in `AENV_E2B_JS`); asserts it succeeded and returns its `ok ...` lines.
pub fn run_sdk(s: &Server, program: &str, script: &str, js_module: Option<&str>) -> Vec<String> {
    run_sdk_with(s, program, script, js_module, &[])
}

/// [`run_sdk`] with extra environment variables for the script.
pub fn run_sdk_with(
    s: &Server,
    program: &str,
    script: &str,
    js_module: Option<&str>,
    env: &[(&str, &str)],
) -> Vec<String> {
    let script = format!("{}/tests/sdk/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = sdk_command(s, program, &script);
    cmd.envs(env.iter().copied());
    if let Some(module) = js_module {
        cmd.env("AENV_E2B_JS", module);
    }
    finish(s, &script, cmd)
}

/// `program script` with the SDK pointed at `s` (add arguments, then [`finish`]).
pub fn sdk_command(s: &Server, program: &str, script: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(program);
    cmd.arg(script)
        .env("E2B_API_URL", &s.base)
        .env("E2B_SANDBOX_URL", &s.base)
        .env("E2B_API_KEY", API_KEY)
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG");
    cmd
}

/// Waits (bounded) for an SDK script; its `ok` lines, or a panic with its output.
pub fn finish(s: &Server, script: &str, mut cmd: std::process::Command) -> Vec<String> {
    let dir = s.state_dir.parent().unwrap().to_path_buf();
    let name = script.rsplit('/').next().unwrap();
    let out_path = dir.join(format!("{name}.out"));
    let out = std::fs::File::create(&out_path).unwrap();
    let mut child = cmd
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    assert!(
        status.is_some_and(|st| st.success()),
        "{name} failed ({status:?}):\n{output}\n--- server log tail:\n{}",
        tail(&s.log(), 60)
    );
    output
        .lines()
        .filter(|l| l.starts_with("ok ") || l.starts_with("latency"))
        .map(|l| format!("{name}: {l}"))
        .collect()
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
