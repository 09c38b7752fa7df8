//! The command-line client (`agentenv sandbox|template|snapshot …`) against a real server:
//! every subcommand, tables and `--json`, exit codes.
//!
//! Fixture: one server shared by every test (see [`shared`]) and on it one snapshot of a
//! cold-booted sandbox that tests restore their sandboxes from; the tests that check a
//! boot (create, logs, a template build) boot their own. Each test makes its own
//! sandboxes, snapshots and templates, and looks only at those in listings.

mod common;

use common::registry::{Auth, TestLayer, TestRegistry};
use common::shared::{DefaultServer, Hold, Shared};
use common::{base_image, id_of, Server, API_KEY};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The server every test shares.
static SHARED: Shared<DefaultServer> = Shared::new();

/// What the tests use of the shared server.
trait Fixture {
    fn cli(&self) -> Cli<'_>;
    /// A running sandbox (timeout 600 s) restored from a snapshot of a cold-booted one.
    fn restored_sandbox(&self) -> String;
}

impl Fixture for DefaultServer {
    fn cli(&self) -> Cli<'_> {
        Cli {
            server: &self.server,
        }
    }

    fn restored_sandbox(&self) -> String {
        let boot = |s: &Server| id_of(&s.create(json!({"image": base_image(), "timeout": 600})));
        let origin = self.origin.name(&self.server, boot);
        let create = [
            "sandbox",
            "create",
            "--template",
            origin,
            "--timeout",
            "600",
        ];
        self.cli().ok(&create).trim().to_string()
    }
}

/// A hold on the shared server (started by the first test that asks).
fn shared() -> Hold<DefaultServer> {
    SHARED.hold()
}

struct Cli<'a> {
    server: &'a Server,
}

impl Cli<'_> {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentenv"));
        // A host name, not an address: the client resolves it.
        let url = self.server.base.replace("127.0.0.1", "localhost");
        cmd.args(args)
            .env("AENV_URL", url)
            .env("AENV_API_KEY", API_KEY)
            .env_remove("AENV_CONFIG_PATH");
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// Runs and asserts exit 0; returns stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "agentenv {args:?} exited {:?}\nstdout: {}\nstderr: {}\nserver log:\n{}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.server.log()
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let text = self.ok(&all);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{args:?}: {e}: {text}"))
    }

    fn code(&self, args: &[&str]) -> i32 {
        self.run(args).status.code().unwrap()
    }
}

/// The ids `sandbox ls` lists.
fn listed_sandboxes(cli: &Cli) -> Vec<String> {
    let all = cli.json(&["sandbox", "ls"]);
    all.as_array().unwrap().iter().map(id_of).collect()
}

/// Whether `template ls` lists a template named `name`.
fn template_listed(cli: &Cli, name: &str) -> bool {
    let all = cli.json(&["template", "ls"]);
    all.as_array().unwrap().iter().any(|t| has_name(t, name))
}

fn has_name(template: &Value, name: &str) -> bool {
    template["names"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n == name)
}

/// Create (a cold boot): the plain output is the id alone, for $(...); `ls` and `info`
/// show the sandbox, as a table and as JSON, filtered by metadata.
#[test]
fn sandbox_create_prints_the_id_and_ls_and_info_show_it() {
    let f = shared();
    let cli = f.cli();
    let image = base_image();
    let id = cli
        .ok(&[
            "sandbox",
            "create",
            "--image",
            &image,
            "--timeout",
            "600",
            "--metadata",
            "who=cli",
        ])
        .trim()
        .to_string();
    assert_eq!(id.len(), 36, "not a sandbox id: {id:?}");

    let table = cli.ok(&["sandbox", "ls"]);
    let header = table.lines().next().unwrap();
    assert!(
        header.starts_with("ID") && header.contains("STATE"),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with(&id))
        .expect("sandbox in ls");
    assert!(row.contains("running"), "{row}");
    let listed = cli.json(&["sandbox", "ls", "--metadata", "who=cli"]);
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(listed[0]["sandboxID"], id.as_str());
    let none = cli.json(&["sandbox", "ls", "--metadata", "who=nobody"]);
    assert_eq!(none, Value::Array(vec![]));
    let info = cli.json(&["sandbox", "info", &id]);
    assert_eq!(info["state"], "running");
    assert!(cli.ok(&["sandbox", "info", &id]).contains("memoryMB"));
    cli.ok(&["sandbox", "rm", &id]);
}

/// Output to the right streams, the command's exit code; `--json`: one object at the end.
#[test]
fn exec_sends_output_to_its_streams_and_exits_with_the_command_code() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let out = cli.run(&[
        "sandbox",
        "exec",
        &id,
        "--env",
        "WHO=cli",
        "--",
        "sh",
        "-c",
        "echo out $WHO; echo err >&2; exit 7",
    ]);
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out cli\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    assert_eq!(cli.code(&["sandbox", "exec", &id, "--", "true"]), 0);
    let out = cli.run(&[
        "--json",
        "sandbox",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo o; echo e >&2; exit 2",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["exitCode"], 2);
    assert_eq!(v["stdout"], "o\n");
    assert_eq!(v["stderr"], "e\n");
    cli.ok(&["sandbox", "rm", &id]);
}

/// The command's first line reaches the CLI's stdout while the command still runs (it
/// waits for a file the test creates only after reading that line).
#[test]
fn exec_streams_output_while_the_command_runs() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let started = Instant::now();
    let mut child = cli
        .command(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "echo first; i=0; while [ ! -e /tmp/cli-go ] && [ $i -lt 600 ]; do \
             sleep 0.1; i=$((i+1)); done; sleep 2; echo second; echo late >&2; exit 4",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    let first_output = started.elapsed();
    assert_eq!(first, "first\n");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the CLI ended before the command was let go"
    );
    eprintln!(
        "exec: first line after {} ms (CLI start to first output)",
        first_output.as_millis()
    );
    // Another exec lets the first command go on.
    assert_eq!(
        cli.code(&["sandbox", "exec", &id, "--", "touch", "/tmp/cli-go"]),
        0
    );
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let mut err = String::new();
    let mut stderr = child.stderr.take().unwrap();
    stderr.read_to_string(&mut err).unwrap();
    assert_eq!(rest, "second\n");
    assert_eq!(err, "late\n");
    assert_eq!(child.wait().unwrap().code(), Some(4));
    cli.ok(&["sandbox", "rm", &id]);
}

/// A signal: 128 + N, like a shell; `--timeout`: 124; a command that cannot start: 127;
/// a sandbox that does not exist: 4.
#[test]
fn exec_exit_codes_say_how_the_command_ended() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let out = cli.run(&["sandbox", "exec", &id, "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(143), "{out:?}");
    let out = cli.run(&[
        "sandbox",
        "exec",
        &id,
        "--timeout",
        "1",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
    let out = cli.run(&["sandbox", "exec", &id, "--", "/no/such/program"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("could not be started"),
        "{out:?}"
    );
    let unknown = "0190d5a0-0000-7000-8000-000000000000";
    assert_eq!(cli.code(&["sandbox", "exec", unknown, "--", "true"]), 4);
    cli.ok(&["sandbox", "rm", &id]);
}

/// `--user` runs the command as another user; `--stdin`: the client's stdin reaches the
/// command, EOF included.
#[test]
fn exec_runs_as_another_user_and_passes_stdin_through() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    assert_eq!(
        cli.ok(&["sandbox", "exec", &id, "--user", "user", "--", "id", "-un"]),
        "user\n"
    );
    let mut child = cli
        .command(&[
            "sandbox",
            "exec",
            &id,
            "--stdin",
            "--",
            "sh",
            "-c",
            "wc -c; cat >&2",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(&[b'x'; 100_000]).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");
    assert!(out.stderr.is_empty());
    cli.ok(&["sandbox", "rm", &id]);
}

/// `cp` both ways, binary-safe, into a path with a space; `-` is stdin / stdout.
#[test]
fn cp_copies_both_ways_binary_safe_and_through_pipes() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let dir = std::env::temp_dir().join(format!("aenv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
    let local = dir.join("up.bin");
    std::fs::write(&local, &payload).unwrap();
    let remote = format!("{id}:/root/sub dir/up.bin");
    cli.ok(&["sandbox", "cp", local.to_str().unwrap(), &remote]);
    cli.ok(&["sandbox", "cp", &remote, dir.to_str().unwrap()]);
    assert_eq!(std::fs::read(&local).unwrap(), payload);
    let wc = [
        "sandbox",
        "exec",
        &id,
        "--",
        "wc",
        "-c",
        "/root/sub dir/up.bin",
    ];
    let size = cli.ok(&wc);
    assert!(size.starts_with("200000"), "{size}");
    std::fs::remove_dir_all(&dir).unwrap();
    let mut up = cli
        .command(&["sandbox", "cp", "-", &format!("{id}:/tmp/piped")])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = up.stdin.take().unwrap();
    stdin.write_all(b"through a pipe\n").unwrap();
    drop(stdin);
    assert!(up.wait().unwrap().success());
    assert_eq!(
        cli.ok(&["sandbox", "cp", &format!("{id}:/tmp/piped"), "-"]),
        "through a pipe\n"
    );
    cli.ok(&["sandbox", "rm", &id]);
}

/// `logs`: the guest console of a booted sandbox (the agent's boot lines, and what the
/// guest writes to it), its last N lines.
#[test]
fn logs_show_the_guest_console() {
    let f = shared();
    let cli = f.cli();
    let image = base_image();
    let create = ["sandbox", "create", "--image", &image, "--timeout", "600"];
    let id = cli.ok(&create).trim().to_string();
    let mark = "echo cli-console-mark > /dev/console";
    cli.ok(&["sandbox", "exec", &id, "--", "sh", "-c", mark]);
    // The guest's write returns before the line has gone through the serial port and the
    // server's console writer into the log: wait (bounded) for it.
    let mut logs = String::new();
    common::wait_until(Duration::from_secs(10), || {
        logs = cli.ok(&["sandbox", "logs", &id, "--lines", "5000"]);
        logs.contains("cli-console-mark")
    });
    assert!(logs.contains("agentenv-agent"), "console:\n{logs}");
    assert!(logs.contains("cli-console-mark"), "console:\n{logs}");
    let last = cli.ok(&["sandbox", "logs", &id, "--lines", "3"]);
    assert!(last.lines().count() <= 3);
    cli.ok(&["sandbox", "rm", &id]);
}

/// `snapshot create|ls|info|rm`; a sandbox from the snapshot sees the disk; `sandbox rm`
/// takes several ids.
#[test]
fn snapshots_are_listed_and_start_sandboxes_and_rm_takes_several() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let write = "mkdir -p '/root/sub dir' && head -c 200000 /dev/zero > '/root/sub dir/up.bin'";
    cli.ok(&["sandbox", "exec", &id, "--", "sh", "-c", write]);
    let snap = cli
        .ok(&["snapshot", "create", &id, "--name", "cli-snap"])
        .trim()
        .to_string();
    let snaps = cli.ok(&["snapshot", "ls", "--sandbox", &id]);
    assert!(
        snaps
            .lines()
            .any(|l| l.starts_with(&snap) && l.contains("cli-snap")),
        "{snaps}"
    );
    assert_eq!(
        cli.json(&["snapshot", "info", "cli-snap"])["snapshotID"],
        snap.as_str()
    );
    let child = cli
        .ok(&["sandbox", "create", "--template", "cli-snap"])
        .trim()
        .to_string();
    let wc = [
        "sandbox",
        "exec",
        &child,
        "--",
        "wc",
        "-c",
        "/root/sub dir/up.bin",
    ];
    let seen = cli.ok(&wc);
    assert!(seen.starts_with("200000"), "{seen}");

    cli.ok(&["sandbox", "rm", &id, &child]);
    let listed = listed_sandboxes(&cli);
    assert!(
        !listed.contains(&id) && !listed.contains(&child),
        "{listed:?}"
    );
    cli.ok(&["snapshot", "rm", "cli-snap"]);
    assert_eq!(cli.code(&["snapshot", "info", "cli-snap"]), 4);
}

/// `pause` and `resume` change the state; a paused sandbox runs no commands: 409 → exit 5.
#[test]
fn pause_and_resume_change_the_state_and_a_paused_sandbox_runs_no_commands() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    cli.ok(&["sandbox", "pause", &id]);
    assert_eq!(cli.json(&["sandbox", "info", &id])["state"], "paused");
    assert_eq!(cli.code(&["sandbox", "exec", &id, "--", "true"]), 5);
    cli.ok(&["sandbox", "resume", &id, "--timeout", "600"]);
    assert_eq!(cli.json(&["sandbox", "info", &id])["state"], "running");
    cli.ok(&["sandbox", "rm", &id]);
}

#[test]
fn resume_of_a_running_sandbox_only_extends_its_time_to_live() {
    let f = shared();
    let cli = f.cli();
    let id = f.restored_sandbox();
    let before = cli.json(&["sandbox", "info", &id])["endAt"].clone();
    assert_eq!(
        cli.ok(&["sandbox", "resume", &id, "--timeout", "900"])
            .trim(),
        id
    );
    let after = cli.json(&["sandbox", "info", &id]);
    assert_eq!(after["state"], "running");
    assert!(
        after["endAt"].as_str() > before.as_str(),
        "{before} -> {after}"
    );
    cli.ok(&["sandbox", "rm", &id]);
}

/// A build (a cold boot) from a registry on loopback: plain progress lines off a terminal
/// (phases, the image's bytes), then ready; `ls` shows it; sandboxes start from it.
#[test]
fn template_build_shows_progress_and_the_template_starts_sandboxes() {
    let f = shared();
    let cli = f.cli();
    let registry = TestRegistry::start(Auth::Anonymous);
    let (reference, layer_bytes) = push_bootable_image(&registry);
    let out = cli.run(&[
        "template",
        "build",
        "cli-tpl",
        "--image",
        &reference,
        "--start-cmd",
        "echo built > /etc/cli-mark",
    ]);
    let progress = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        out.status.success(),
        "build failed: {progress}\n{}",
        f.server.log()
    );
    for phase in ["booting", "ready"] {
        assert!(
            progress.contains(&format!(": {phase} after ")),
            "no {phase} line:\n{progress}"
        );
    }
    assert!(
        progress.contains(&format!(
            "cli-tpl: pulled {layer_bytes} of {layer_bytes} bytes (100%)"
        )),
        "no pulled-bytes line for {layer_bytes} bytes:\n{progress}"
    );
    let all = cli.json(&["template", "ls"]);
    let built = all
        .as_array()
        .unwrap()
        .iter()
        .find(|t| has_name(t, "cli-tpl"));
    let built = built.unwrap_or_else(|| panic!("cli-tpl not in {all}"));
    assert_eq!(built["progress"]["phase"], "ready", "{built}");
    assert_eq!(built["progress"]["pullBytesTotal"], layer_bytes);
    let templates = cli.ok(&["template", "ls"]);
    let row = templates
        .lines()
        .find(|l| l.starts_with("cli-tpl"))
        .expect("template in ls");
    assert!(row.contains("ready"), "{row}");
    let from_tpl = cli
        .ok(&["sandbox", "create", "--template", "cli-tpl"])
        .trim()
        .to_string();
    assert_eq!(
        cli.ok(&["sandbox", "exec", &from_tpl, "--", "cat", "/etc/cli-mark"]),
        "built\n"
    );
    cli.ok(&["sandbox", "rm", &from_tpl]);
    assert!(!listed_sandboxes(&cli).contains(&from_tpl));
    cli.ok(&["template", "rm", "cli-tpl"]);
    assert!(!template_listed(&cli, "cli-tpl"));
}

/// Builds that fail (no such tag; no VM boots): `--no-wait` prints the id at once and the
/// build fails in the background; `--json` prints the final template and the exit code
/// is 8; on a terminal the bar ends on the failed phase. `template rm` takes several.
#[test]
fn failed_template_builds_exit_8_and_say_why() {
    let f = shared();
    let cli = f.cli();
    let registry = TestRegistry::start(Auth::Anonymous);
    let missing = format!("{}/cli:missing", registry.addr);
    let no_wait = [
        "template",
        "build",
        "cli-later",
        "--image",
        &missing,
        "--no-wait",
    ];
    let queued = cli.ok(&no_wait).trim().to_string();
    assert!(
        common::wait_until(Duration::from_secs(30), || {
            cli.json(&["template", "ls"])
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["templateID"] == queued.as_str() && t["buildStatus"] == "error")
        }),
        "the --no-wait build {queued} did not end"
    );
    let out = cli.run(&[
        "--json", "template", "build", "cli-bad", "--image", &missing,
    ]);
    assert_eq!(out.status.code(), Some(8), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["buildStatus"], "error", "{v}");
    assert_eq!(v["progress"]["phase"], "failed", "{v}");
    assert!(v["reason"].as_str().unwrap().contains("cli:missing"), "{v}");
    let agentenv = env!("CARGO_BIN_EXE_agentenv");
    let out = Command::new("script")
        .args([
            "-qec",
            &format!("{agentenv} template build cli-bad-tty --image {missing}"),
            "/dev/null",
        ])
        .env("AENV_URL", &f.server.base)
        .env("AENV_API_KEY", API_KEY)
        .env_remove("AENV_CONFIG_PATH")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(8), "{screen}");
    assert!(
        screen.contains("cli-bad-tty [") && screen.contains("failed"),
        "no progress bar on a terminal:\n{screen}"
    );
    cli.ok(&["template", "rm", "cli-bad", "cli-bad-tty", "cli-later"]);
    for name in ["cli-bad", "cli-bad-tty", "cli-later"] {
        assert!(!template_listed(&cli, name), "{name} still listed");
    }
}

/// Errors say what failed: unknown sandbox 4, wrong key 6, no server 3, usage 2.
#[test]
fn errors_exit_with_codes_that_say_what_failed() {
    let f = shared();
    let cli = f.cli();
    let unknown = "0190d5a0-0000-7000-8000-000000000000";
    assert_eq!(cli.code(&["sandbox", "info", unknown]), 4);
    assert_eq!(
        cli.command(&["sandbox", "ls"])
            .env("AENV_API_KEY", "wrong-key-0123456789-0123456789-x")
            .output()
            .unwrap()
            .status
            .code(),
        Some(6)
    );
    assert_eq!(
        cli.command(&["sandbox", "ls"])
            .env("AENV_URL", "http://127.0.0.1:1")
            .output()
            .unwrap()
            .status
            .code(),
        Some(3)
    );
    assert_eq!(cli.code(&["sandbox", "frobnicate"]), 2);
    assert_eq!(cli.code(&["sandbox", "ls", "--bogus", "x"]), 2);
}

/// Pushes a small bootable image (busybox, the directories a guest needs, 1 MiB of
/// filler in a second, uncompressed layer) as `cli:v1`; returns its reference and the
/// sum of its layers' sizes.
fn push_bootable_image(registry: &TestRegistry) -> (String, u64) {
    use agentenv::image::LayerBuilder;
    let busybox = std::fs::read("/bin/busybox").unwrap();
    let mut one = LayerBuilder::new();
    one.dir("bin", 0o755).file("bin/busybox", 0o755, &busybox);
    for applet in [
        "sh", "cat", "echo", "ls", "touch", "sleep", "wc", "id", "true",
    ] {
        one.symlink(&format!("bin/{applet}"), "busybox");
    }
    for d in ["etc", "root", "proc", "sys", "dev", "tmp", "run"] {
        one.dir(d, 0o755);
    }
    let filler: Vec<u8> = (0..1u32 << 20).map(|i| (i * 131 % 251) as u8).collect();
    let mut two = LayerBuilder::new();
    two.dir("opt", 0o755).file("opt/filler", 0o644, &filler);
    let layers = [
        TestLayer {
            tar: one.finish(),
            gzip: true,
        },
        TestLayer {
            tar: two.finish(),
            gzip: false,
        },
    ];
    let image = registry.push_image("cli", "amd64", "/", &layers, false);
    registry.tag("cli", "v1", &image);
    let manifest: Value = serde_json::from_slice(&image.bytes).unwrap();
    let total = manifest["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["size"].as_u64().unwrap())
        .sum();
    (format!("{}/cli:v1", registry.addr), total)
}
