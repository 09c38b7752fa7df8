//! End-to-end: E2B's template build API driven by the real python SDK (`Template` ...
//! `Template.build`) against the real server, real build microVMs and the built-in
//! busybox image; plus the routes' bad input over plain HTTP. Checks what the sandboxes
//! see (files, owners, modes, env, user, the start command's server) and that a failed
//! build leaves nothing behind.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Where scripts/setup.sh installs the SDKs.
const TOOLS: &str = "/opt/agentenv-tests";

#[test]
fn e2b_template_builds_end_to_end() {
    let python = format!("{TOOLS}/venv/bin/python");
    assert!(
        std::path::Path::new(&python).exists(),
        "the E2B python SDK is missing under {TOOLS}: run scripts/setup.sh"
    );
    let ext = extension::Extension::start();
    let s = Server::start(&format!("[custom_extension]\nurl = \"{}\"\n", ext.url()));
    bad_input(&s);
    let started = Instant::now();
    let out = run_script(
        &s,
        &python,
        "template_build.py",
        &[("AENV_TEST_IMAGE", &base_image()), ("AENV_TEST_CACHE", "1")],
    );
    println!(
        "{out}\ntemplate_build.py took {:.1}s",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    dockerfile_through_the_cli(&s);
    println!(
        "the Dockerfile builds took {:.1}s",
        started.elapsed().as_secs_f64()
    );
    // Nothing is left of the builds: no build VM dirs, no sandboxes, every start stopped.
    let builds_dir = s.state_dir.join("template-builds");
    assert!(
        wait_until(Duration::from_secs(30), || files_under(&builds_dir)
            .is_empty()),
        "build VMs left files: {:?}",
        files_under(&builds_dir)
    );
    let (_, left) = s.call("GET", "/v2/sandboxes", None);
    assert_eq!(left, json!([]), "the script kills what it creates");
    let starts = ext.requests_for("start-fresh").len() + ext.requests_for("start-resume").len();
    assert!(
        wait_until(Duration::from_secs(30), || ext.requests_for("stop").len()
            >= starts),
        "the extension saw {starts} starts but only {} stops",
        ext.requests_for("stop").len()
    );
}

/// Malformed requests: 400/404/403/413 naming what is wrong, nothing started.
fn bad_input(s: &Server) {
    let (code, v) = s.call("POST", "/v3/templates", Some(json!({"name": "bad name!"})));
    assert_eq!(code, 400, "{v}");
    let (code, v) = s.call("POST", "/v3/templates", Some(json!({"name": "probe:v1"})));
    assert_eq!(code, 202, "{v}");
    let (tid, bid) = (
        v["templateID"].as_str().unwrap(),
        v["buildID"].as_str().unwrap(),
    );
    assert_eq!(v["tags"], json!(["v1"]));
    let path = format!("/v2/templates/{tid}/builds/{bid}");
    for (body, want) in [
        (
            json!({"fromImage": "x", "steps": [{"type": "RUN", "args": []}]}),
            "steps[0]: args[0]",
        ),
        (
            json!({"fromImage": "x", "steps": [{"type": "RUN"}, {"type": "FOO", "args": ["a"]}]}),
            "steps[0]",
        ),
        (
            json!({"fromImage": "x", "steps": [{"type": "RUN", "args": ["a"]}, {"type": "FOO", "args": ["a"]}]}),
            "steps[1]: type",
        ),
        (json!({"steps": []}), "fromImage or fromTemplate"),
        (
            json!({"fromImage": "x", "steps": [{"type": "COPY", "args": ["a", "/b"], "filesHash": "nothex"}]}),
            "steps[0]: filesHash",
        ),
    ] {
        let (code, v) = s.call("POST", &path, Some(body.clone()));
        assert_eq!(code, 400, "{body}: {v}");
        assert!(v["message"].as_str().unwrap().contains(want), "{body}: {v}");
    }
    let (code, _) = s.call(
        "POST",
        &format!("/v2/templates/{tid}/builds/{}", tid),
        Some(json!({"fromImage": "x"})),
    );
    assert_eq!(code, 404, "an unknown build");
    // The upload link needs its token; a wrong one is 403, an upload over the limit 413.
    let hash = "ab".repeat(32);
    let (code, link) = s.call("GET", &format!("/templates/{tid}/files/{hash}"), None);
    assert_eq!(
        (code, link["present"].clone()),
        (201, json!(false)),
        "{link}"
    );
    let url = link["url"].as_str().unwrap().to_string();
    let bad = url.replace("token=", "token=x");
    assert_eq!(put(&bad, b"x"), 403);
    let evil = hostile_tar();
    let (code, body) = put_body(&url, &evil);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("etc/evil"), "the 400 names the entry: {body}");
    let (code, v) = s.call("GET", &format!("/templates/{tid}/files/{hash}"), None);
    assert_eq!(
        (code, v["present"].clone()),
        (201, json!(false)),
        "a refused upload is not kept"
    );
    // An unknown image: the build fails with the registry's reason, in the base step.
    let (code, v) = s.call("POST", &path, Some(json!({"fromImage": "oci:/nonexistent/image", "steps": [{"type": "RUN", "args": ["true"]}]})));
    assert_eq!(code, 202, "{v}");
    let status = wait_status(s, tid, bid);
    assert_eq!(status["status"], "error", "{status}");
    assert_eq!(status["reason"]["step"], "base", "{status}");
    assert!(
        status["reason"]["message"]
            .as_str()
            .unwrap()
            .contains("nonexistent"),
        "{status}"
    );
    let (code, _) = s.call("GET", "/templates/aliases/probe", None);
    assert_eq!(code, 404, "a template never built is gone");
    let (code, v) = s.call("POST", &path, Some(json!({"fromImage": "x"})));
    assert!(
        code == 404 || code == 409,
        "a finished build cannot start again: {code} {v}"
    );
}

fn wait_status(s: &Server, tid: &str, bid: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, v) = s.call(
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status"),
            None,
        );
        if v["status"] == "ready" || v["status"] == "error" || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn put(url: &str, body: &[u8]) -> u16 {
    put_body(url, body).0
}

fn put_body(url: &str, body: &[u8]) -> (u16, String) {
    match ureq::put(url)
        .timeout(Duration::from_secs(30))
        .send_bytes(body)
    {
        Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap_or_default()),
        Err(e) => panic!("PUT {url}: {e}"),
    }
}

/// A tar whose one entry climbs out of the tree.
fn hostile_tar() -> Vec<u8> {
    let mut header = [0u8; 512];
    let name = b"../../etc/evil";
    header[..name.len()].copy_from_slice(name);
    header[100..107].copy_from_slice(b"0000644");
    header[108..115].copy_from_slice(b"0000000");
    header[116..123].copy_from_slice(b"0000000");
    header[124..135].copy_from_slice(b"00000000001");
    header[136..147].copy_from_slice(b"00000000000");
    header[156] = b'0';
    header[257..263].copy_from_slice(b"ustar\0");
    header[263..265].copy_from_slice(b"00");
    header[148..156].copy_from_slice(b"        ");
    let sum: u32 = header.iter().map(|b| *b as u32).sum();
    header[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
    let mut out = header.to_vec();
    let mut data = [0u8; 512];
    data[0] = b'x';
    out.extend_from_slice(&data);
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// Runs `tests/sdk/<script>` with the SDK pointed at `s`; its output, or a panic with it.
fn run_script(s: &Server, program: &str, script: &str, env: &[(&str, &str)]) -> String {
    let path = format!("{}/tests/sdk/{script}", env!("CARGO_MANIFEST_DIR"));
    let out_path = s.state_dir.parent().unwrap().join(format!("{script}.out"));
    let out = std::fs::File::create(&out_path).unwrap();
    let mut cmd = std::process::Command::new(program);
    cmd.arg(&path)
        .env("E2B_API_URL", &s.base)
        .env("E2B_SANDBOX_URL", &s.base)
        .env("E2B_API_KEY", API_KEY)
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("E2B_DOMAIN")
        .env_remove("E2B_DEBUG")
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let status = wait_exit(&mut child, Instant::now() + Duration::from_secs(900));
    let output = std::fs::read_to_string(&out_path).unwrap_or_default();
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        status.is_some_and(|st| st.success()),
        "{script} failed ({status:?}):\n{output}\n--- server log tail:\n{}",
        s.log()
            .lines()
            .rev()
            .take(80)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    output
}

/// The Dockerfile of [`dockerfile_through_the_cli`]: every instruction the CLI takes.
const DOCKERFILE: &str = r#"# syntax=docker/dockerfile:1
ARG BASE
FROM ${BASE} AS app
ARG WHO=nobody
ENV STAMP_DIR=/srv/df PATH=/srv/df/bin:$PATH
WORKDIR $STAMP_DIR
COPY --chown=user --chmod=0640 app ./app/
ADD tool.sh /usr/local/bin/
RUN echo "built by $WHO" > who && echo "$PATH" > path && \
    id -un > runner && echo df-step-output
RUN ["sh", "-c", "echo exec-form > exec"]
USER user
EXPOSE 8080
CMD ["httpd", "-f", "-p", "8080", "-h", "/srv/df"]
"#;

/// `agentenv template build --file Dockerfile`: built (with `--json` events), a sandbox
/// from it sees what the steps left, a rebuild takes every step from the cache and skips
/// the uploads (plain progress), and a malformed Dockerfile is refused naming its line
/// before anything reaches the server.
fn dockerfile_through_the_cli(s: &Server) {
    let ctx = s.state_dir.parent().unwrap().join("df-context");
    std::fs::create_dir_all(ctx.join("app/sub")).unwrap();
    std::fs::write(ctx.join("app/hello.txt"), "hello from the dockerfile\n").unwrap();
    std::fs::write(ctx.join("app/sub/deep.txt"), "deep\n").unwrap();
    std::fs::write(ctx.join("tool.sh"), "#!/bin/sh\necho df-tool-ran\n").unwrap();
    std::fs::set_permissions(
        ctx.join("tool.sh"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::write(ctx.join("Dockerfile"), DOCKERFILE).unwrap();
    let base = format!("BASE={}", base_image());
    let build = |json: bool| {
        let mut args = vec!["template", "build", "--file"];
        let file = ctx.join("Dockerfile");
        let file = file.to_str().unwrap();
        args.extend([file, "--alias", "df-app", "--build-arg", &base]);
        args.extend(["--build-arg", "WHO=cli", "--ready-cmd"]);
        args.extend([
            "wget -q -O- http://127.0.0.1:8080/who",
            ctx.to_str().unwrap(),
        ]);
        if json {
            args.insert(0, "--json");
        }
        cli(s, &args)
    };
    let (code, stdout, stderr) = build(true);
    assert_eq!(code, 0, "{stdout}\n{stderr}\n{}", s.log());
    let events: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let messages: Vec<&str> = events
        .iter()
        .filter_map(|e| e["message"].as_str())
        .collect();
    let said = |needle: &str| messages.iter().any(|m| m.contains(needle));
    assert!(
        said("EXPOSE has no meaning") && said("df-step-output"),
        "{stdout}"
    );
    assert!(said("RUN sh -c 'echo exec-form > exec'"), "{stdout}");
    let uploads: Vec<&Value> = events.iter().filter(|e| e["event"] == "files").collect();
    assert_eq!(uploads.len(), 2, "{stdout}");
    assert!(uploads.iter().all(|u| u["uploaded"] == true), "{stdout}");
    let result = events.last().unwrap();
    assert_eq!(result["event"], "result", "{stdout}");
    assert_eq!(result["status"], "ready", "{stdout}");

    let id = s.create_from("df-app", 120);
    let seen = sh(
        s,
        &id,
        "cd /srv/df && cat who runner exec path && stat -c '%U %a' app/hello.txt app/sub/deep.txt \
         && /usr/local/bin/tool.sh && echo \"[$STAMP_DIR][$WHO]\" \
         && wget -q -O- http://127.0.0.1:8080/exec && ps -o user,args | grep '[h]ttpd -f'",
    );
    // The start command (CMD) runs as the file's last USER and serves after the resume.
    assert_eq!(
        seen.split_whitespace().collect::<Vec<_>>().join(" "),
        "built by cli root exec-form /srv/df/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
         user 640 user 640 df-tool-ran [][] exec-form \
         user httpd -f -p 8080 -h /srv/df",
        "{seen}"
    );
    let (status, _) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);

    // The same again, plain: the files are on the server, every step is cached.
    let (code, stdout, stderr) = build(false);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert_eq!(
        stdout.trim(),
        result["templateID"].as_str().unwrap(),
        "{stderr}"
    );
    assert!(
        stderr.contains("files app: already on the server"),
        "{stderr}"
    );
    let cached = stderr.lines().filter(|l| l.contains("CACHED [")).count();
    let steps = result_steps(&stderr);
    assert!(
        cached > 0 && cached == steps,
        "{cached} of {steps} cached:\n{stderr}"
    );
    assert!(
        stderr.lines().all(|l| !l.ends_with("] df-step-output")),
        "{stderr}"
    );
    assert!(stderr.lines().any(|l| l.starts_with("[00:")), "{stderr}");

    // Malformed: refused before a template exists, naming the line.
    std::fs::write(
        ctx.join("Bad.dockerfile"),
        "FROM busybox\nRUN true\nCOPY --from=builder /a /b\n",
    )
    .unwrap();
    let bad = ctx.join("Bad.dockerfile");
    let (code, _, stderr) = cli(
        s,
        &[
            "template",
            "build",
            "--file",
            bad.to_str().unwrap(),
            "--alias",
            "df-bad",
            ctx.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("Dockerfile line 3: COPY --from is not supported"),
        "{stderr}"
    );
    assert_eq!(s.call("GET", "/templates/df-bad", None).0, 404);
    let _ = std::fs::remove_dir_all(&ctx);
}

/// How many steps the build log numbered (`[i/n]`): n.
fn result_steps(log: &str) -> usize {
    log.lines()
        .filter_map(|l| l.split_once("] ").map(|(_, rest)| rest))
        .filter_map(|rest| rest.trim_start_matches("CACHED ").strip_prefix('['))
        .filter_map(|r| r.split_once(']').and_then(|(n, _)| n.split_once('/')))
        .filter_map(|(_, total)| total.parse().ok())
        .max()
        .unwrap_or(0)
}

/// Runs the CLI against `s`: exit code, stdout, stderr.
fn cli(s: &Server, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_agentenv"))
        .args(args)
        .env("AENV_URL", &s.base)
        .env("AENV_API_KEY", API_KEY)
        .env_remove("AENV_CONFIG_PATH")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
