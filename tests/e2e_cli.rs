//! The command-line client (`agentenv sandbox|template|snapshot …`) against a real server:
//! every subcommand, tables and `--json`, exit codes. Two cold boots (one sandbox, one
//! template build); everything else restores. One test, because one server owns the host.

mod common;

use common::registry::{Auth, TestLayer, TestRegistry};
use common::{base_image, Server, API_KEY};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

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

#[test]
fn cli_drives_every_subcommand_against_a_real_server() {
    let server = Server::start("");
    let cli = Cli { server: &server };
    let image = base_image();

    // Create (cold boot 1): the plain output is the id alone, for $(...).
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

    // exec: output to the right streams, and the command's exit code.
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
    exec_streams_and_says_how_the_command_ended(&cli, &id);

    // cp both ways, binary-safe.
    let dir = std::env::temp_dir().join(format!("aenv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(dir.join("up.bin"), &payload).unwrap();
    let remote = format!("{id}:/root/sub dir/up.bin");
    cli.ok(&[
        "sandbox",
        "cp",
        dir.join("up.bin").to_str().unwrap(),
        &remote,
    ]);
    cli.ok(&["sandbox", "cp", &remote, dir.to_str().unwrap()]);
    assert_eq!(std::fs::read(dir.join("up.bin")).unwrap(), payload);
    let size = cli.ok(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "wc",
        "-c",
        "/root/sub dir/up.bin",
    ]);
    assert!(size.starts_with("200000"), "{size}");
    std::fs::remove_dir_all(&dir).unwrap();
    // `-` is stdin / stdout.
    let mut up = cli
        .command(&["sandbox", "cp", "-", &format!("{id}:/tmp/piped")])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    up.stdin
        .take()
        .unwrap()
        .write_all(b"through a pipe\n")
        .unwrap();
    assert!(up.wait().unwrap().success());
    assert_eq!(
        cli.ok(&["sandbox", "cp", &format!("{id}:/tmp/piped"), "-"]),
        "through a pipe\n"
    );

    // logs: the guest console (the agent's boot lines, and what the guest writes to it).
    cli.ok(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo cli-console-mark > /dev/console",
    ]);
    let logs = cli.ok(&["sandbox", "logs", &id, "--lines", "5000"]);
    assert!(logs.contains("agentenv-agent"), "console:\n{logs}");
    assert!(logs.contains("cli-console-mark"), "console:\n{logs}");
    assert!(
        cli.ok(&["sandbox", "logs", &id, "--lines", "3"])
            .lines()
            .count()
            <= 3
    );

    // snapshot, then pause / resume, then a sandbox from the snapshot.
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
    cli.ok(&["sandbox", "pause", &id]);
    assert_eq!(cli.json(&["sandbox", "info", &id])["state"], "paused");
    // A paused sandbox runs no commands: 409 → exit 5.
    assert_eq!(cli.code(&["sandbox", "exec", &id, "--", "true"]), 5);
    cli.ok(&["sandbox", "resume", &id, "--timeout", "600"]);
    assert_eq!(cli.json(&["sandbox", "info", &id])["state"], "running");
    // resume of a running sandbox only extends its time to live.
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
    let child = cli
        .ok(&["sandbox", "create", "--template", "cli-snap"])
        .trim()
        .to_string();
    let seen = cli.ok(&[
        "sandbox",
        "exec",
        &child,
        "--",
        "wc",
        "-c",
        "/root/sub dir/up.bin",
    ]);
    assert!(seen.starts_with("200000"), "{seen}");

    // template build (cold boot 2) from a registry on loopback: plain progress lines off
    // a terminal (phases, the image's bytes), then ready.
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
        server.log()
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
    let built = cli.json(&["template", "ls"]);
    assert_eq!(built[0]["progress"]["phase"], "ready", "{built}");
    assert_eq!(built[0]["progress"]["pullBytesTotal"], layer_bytes);
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
    // Builds that fail (no such tag; no VM boots): --json prints the final template and
    // the exit code is 8; on a terminal the bar ends on the failed phase.
    let missing = format!("{}/cli:missing", registry.addr);
    // --no-wait: the id at once; the build goes on (and fails) in the background.
    let queued = cli
        .ok(&[
            "template",
            "build",
            "cli-later",
            "--image",
            &missing,
            "--no-wait",
        ])
        .trim()
        .to_string();
    assert!(
        common::wait_until(std::time::Duration::from_secs(30), || {
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
        .env("AENV_URL", &server.base)
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
    drop(registry);

    // Errors say what failed.
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

    // rm, several at once; snapshots and templates by name.
    cli.ok(&["sandbox", "rm", &id, &child, &from_tpl]);
    assert_eq!(cli.json(&["sandbox", "ls"]), Value::Array(vec![]));
    cli.ok(&["snapshot", "rm", "cli-snap"]);
    cli.ok(&[
        "template",
        "rm",
        "cli-tpl",
        "cli-bad",
        "cli-bad-tty",
        "cli-later",
    ]);
    assert_eq!(cli.json(&["template", "ls"]), Value::Array(vec![]));
    assert_eq!(cli.code(&["snapshot", "info", "cli-snap"]), 4);
}

/// `sandbox exec` streams: the command's first line reaches the CLI's stdout while the
/// command still runs (it waits for a file the test creates only after reading that
/// line), then signals, `--timeout`, a command that cannot start, `--stdin`.
fn exec_streams_and_says_how_the_command_ended(cli: &Cli, id: &str) {
    let started = Instant::now();
    let mut child = cli
        .command(&[
            "sandbox",
            "exec",
            id,
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
        cli.code(&["sandbox", "exec", id, "--", "touch", "/tmp/cli-go"]),
        0
    );
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(rest, "second\n");
    assert_eq!(err, "late\n");
    assert_eq!(child.wait().unwrap().code(), Some(4));

    // A signal: 128 + N, like a shell.
    let out = cli.run(&["sandbox", "exec", id, "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(143), "{out:?}");
    // --timeout kills the command: 124.
    let out = cli.run(&["sandbox", "exec", id, "--timeout", "1", "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
    // A command that cannot be started: 127, and why.
    let out = cli.run(&["sandbox", "exec", id, "--", "/no/such/program"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("could not be started"),
        "{out:?}"
    );
    // Another user's view: --user.
    assert_eq!(
        cli.ok(&["sandbox", "exec", id, "--user", "user", "--", "id", "-un"]),
        "user\n"
    );
    // --json: one object at the end.
    let out = cli.run(&[
        "--json",
        "sandbox",
        "exec",
        id,
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
    // --stdin: the client's stdin reaches the command, EOF included.
    let mut child = cli
        .command(&[
            "sandbox",
            "exec",
            id,
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
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&[b'x'; 100_000])
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100000");
    assert!(out.stderr.is_empty());
    // A sandbox that does not exist: 4.
    assert_eq!(
        cli.code(&[
            "sandbox",
            "exec",
            "0190d5a0-0000-7000-8000-000000000000",
            "--",
            "true"
        ]),
        4
    );
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
