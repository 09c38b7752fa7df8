//! The web console (docs/console.md) against the real server binary: its embedded files,
//! their headers and the key checks of every console route (no VM), and the whole console
//! in headless Chromium driven by Playwright (tests/console/console.cjs) with real VMs, then
//! its essential checks in headless Firefox ESR driven by Puppeteer over WebDriver BiDi
//! (tests/console/firefox.cjs) on the same server.

mod common;

use common::*;
use std::time::Duration;

const ID: &str = "01900000-0000-7000-8000-000000000000";

fn get(s: &Server, path: &str) -> ureq::Response {
    let agent = ureq::AgentBuilder::new().redirects(0).build();
    match agent
        .get(&format!("{}{path}", s.base))
        .timeout(Duration::from_secs(10))
        .call()
    {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    }
}

/// A WebSocket handshake for the terminal, with `extra` headers; the status it gets.
fn upgrade(s: &Server, sandbox: &str, extra: &str) -> (u16, String) {
    let host = s.base.trim_start_matches("http://");
    s.raw(&format!(
        "GET /console/terminal/{sandbox}?cols=80&rows=24 HTTP/1.1\r\nHost: {host}\r\n\
         Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra}\r\n"
    ))
}

#[test]
fn console_files_and_auth_without_vms() {
    let _serial = serial();
    let s = Server::start("");
    // The page and its files need no key, carry the CSP and are what the binary embeds.
    let r = get(&s, "/console");
    assert_eq!(r.status(), 308);
    assert_eq!(r.header("Location"), Some("/console/"));
    let r = get(&s, "/console/");
    assert_eq!(r.status(), 200);
    assert_eq!(r.header("Content-Type"), Some("text/html; charset=utf-8"));
    let csp = r.header("Content-Security-Policy").unwrap().to_string();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe"),
        "{csp}"
    );
    assert_eq!(r.header("X-Frame-Options"), Some("DENY"));
    assert_eq!(r.header("X-Content-Type-Options"), Some("nosniff"));
    let page = r.into_string().unwrap();
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/src/api/console/assets/index.html"
    );
    assert_eq!(page, std::fs::read_to_string(file).unwrap());
    let js = get(&s, "/console/app.js");
    assert_eq!(js.status(), 200);
    assert_eq!(
        js.header("Content-Type"),
        Some("text/javascript; charset=utf-8")
    );
    assert_eq!(get(&s, "/console/nope.js").status(), 404);
    assert_eq!(get(&s, "/console/a/b").status(), 401, "not a console file");
    // The data behind the console needs the key like the rest of the API.
    assert_eq!(get(&s, "/metrics/history").status(), 401);
    let (code, history) = s.call("GET", "/metrics/history", None);
    assert_eq!(code, 200, "{history}");
    assert!(history["node"].as_str().is_some_and(|n| !n.is_empty()));
    let first = &history["samples"][0]["values"];
    assert_eq!(first["agentenv_sandboxes{state=\"running\"}"], 0.0);
    assert!(
        first["agentenv_host_memory_mb{state=\"available\"}"]
            .as_f64()
            .unwrap()
            >= 1.0,
        "{first}"
    );
    assert!(
        first
            .get("agentenv_admission_vcpus{state=\"limit\"}")
            .is_none(),
        "no vCPU cap by default: {first}"
    );
    assert_eq!(s.call("GET", "/metrics/history?since=x", None).0, 400);
    // A plain GET of the terminal is told to upgrade.
    assert_eq!(
        s.call("GET", &format!("/console/terminal/{ID}"), None).0,
        426
    );
    // The terminal's WebSocket: no key, a wrong key, the key without the protocol, or
    // another site's Origin are refused before anything is looked up.
    let key = format!("Sec-WebSocket-Protocol: agentenv.terminal, agentenv.key.{API_KEY}\r\n");
    for (extra, want) in [
        (String::new(), 401),
        (
            "Sec-WebSocket-Protocol: agentenv.terminal, agentenv.key.wrong\r\n".to_string(),
            401,
        ),
        (
            format!("Sec-WebSocket-Protocol: agentenv.key.{API_KEY}\r\n"),
            401,
        ),
        (format!("X-API-Key: {API_KEY}\r\n"), 401),
        (format!("{key}Origin: http://evil.example\r\n"), 403),
        (key.clone(), 404),
    ] {
        let (code, answer) = upgrade(&s, ID, &extra);
        assert_eq!(code, want, "{extra}: {answer}");
        assert!(!answer.contains("101 Switching"), "{answer}");
    }
    let (code, _) = upgrade(&s, "not-a-uuid", &key);
    assert_eq!(code, 401, "not a terminal path: the API's key check");
    // The server still answers after the refusals.
    assert_eq!(get(&s, "/health").status(), 204);
}

/// Where the browser test keeps its screenshots (a test artifact).
fn screenshots_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/console-screenshots")
}

/// Runs one browser script of tests/console against `s` with `env`; its JSON step lines.
/// Fails with the script's output and the server's log unless it ends with `done`.
fn browser_script(s: &Server, script: &str, env: &[(&str, &str)]) -> Vec<serde_json::Value> {
    let profile = scratch_dir().join("browser-profile");
    let started = std::time::Instant::now();
    let mut child = std::process::Command::new("node")
        .arg(format!(
            "{}/tests/console/{script}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("AENV_URL", &s.base)
        .env("AENV_KEY", API_KEY)
        .env("SHOTS", screenshots_dir())
        .env("USER_DATA_DIR", &profile)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("node");
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    let status = wait_exit(
        &mut child,
        std::time::Instant::now() + Duration::from_secs(30),
    );
    let _ = std::fs::remove_dir_all(profile.parent().unwrap());
    eprintln!("{out}{script}: {:?}", started.elapsed());
    assert!(
        status.is_some_and(|s| s.success()),
        "{script} failed:\n{out}\n{}",
        s.log()
    );
    let steps: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(steps.iter().any(|v| v["step"] == "done"), "{out}");
    steps
}

/// What console.cjs did in Chromium happened on the server: its sandbox is gone, its hooks
/// were sent, its snapshot exists, and every page has its screenshots.
fn chromium_did_it(s: &Server, ext: &extension::Extension, steps: &[serde_json::Value]) {
    let shots = screenshots_dir();
    let done = steps.iter().find(|v| v["step"] == "done").expect("done");
    let id = done["sandbox"].as_str().unwrap();
    assert_eq!(s.call("GET", &format!("/sandboxes/{id}"), None).0, 404);
    let resumes = ext.requests_for("start-resume");
    assert!(
        resumes.len() >= 2,
        "create and the page's resume: {}",
        resumes.len()
    );
    assert!(!ext.requests_for("stop").is_empty());
    let (code, snap) = s.call("GET", "/snapshots/console-snapshot", None);
    assert_eq!(code, 200, "the page's snapshot: {snap}");
    for page in [
        "login",
        "templates",
        "template",
        "sandboxes",
        "sandbox",
        "terminal",
        "host",
    ] {
        let f = shots.join(format!("{page}-1280.png"));
        assert!(std::fs::metadata(&f).is_ok_and(|m| m.len() > 1000), "{f:?}");
    }
    for page in ["sandboxes", "sandbox", "templates", "host", "terminal"] {
        assert!(shots.join(format!("{page}-390.png")).exists(), "{page}-390");
    }
}

/// The whole console in headless Chromium (tests/console/console.cjs): log in, watch a
/// template build's log, see a sandbox made through the API appear live (its XSS metadata
/// shown as text), filter, keyboard (tab order, visible focus), plots with points, the
/// terminal (`echo hi`, the default user, resize, a flood while /health answers, closing the
/// tab kills the PTY), pause, resume, set timeout and snapshot from the page, the host page,
/// phone width, delete; no console errors. Then, on the same server and template, the
/// essential checks in headless Firefox (tests/console/firefox.cjs, WebDriver BiDi): log
/// in, a sandbox appearing live with its XSS metadata as text, plot points, `echo hi`, no
/// console errors. One server, one sandbox per browser.
#[test]
fn console_in_chromium_and_firefox() {
    let _serial = serial();
    let playwright = "/opt/agentenv-tests/playwright/node_modules/playwright-core";
    let puppeteer = "/opt/agentenv-tests/puppeteer/node_modules/puppeteer-core";
    for need in [
        "/usr/bin/chromium",
        "/usr/bin/firefox-esr",
        playwright,
        puppeteer,
    ] {
        assert!(
            std::path::Path::new(need).exists(),
            "{need} missing: run scripts/setup.sh"
        );
    }
    let ext = extension::Extension::start();
    ext.set(
        "start-resume",
        extension::Behavior::delay(30, extension::Behavior::Default),
    );
    let s = Server::start(&format!(
        "[metrics]\nhistory_interval_secs = 1\n[custom_extension]\nurl = \"{}\"\n",
        ext.url()
    ));
    let (code, t) = s.call(
        "POST",
        "/templates",
        Some(
            serde_json::json!({"name": "console-tpl", "image": base_image(), "memoryMB": 256,
            "cpuCount": 1, "diskSizeMB": 1024, "startCmd": "echo built-for-the-console"}),
        ),
    );
    assert_eq!(code, 202, "{t}");
    let template = t["templateID"].as_str().unwrap().to_string();
    let shots = screenshots_dir();
    let _ = std::fs::remove_dir_all(&shots);
    let steps = browser_script(
        &s,
        "console.cjs",
        &[("TEMPLATE_ID", &template), ("PLAYWRIGHT_CORE", playwright)],
    );
    chromium_did_it(&s, &ext, &steps);
    let steps = browser_script(
        &s,
        "firefox.cjs",
        &[("TEMPLATE_ID", &template), ("PUPPETEER_CORE", puppeteer)],
    );
    let done = steps.iter().find(|v| v["step"] == "done").unwrap();
    let id = done["sandbox"].as_str().unwrap();
    assert_eq!(s.call("GET", &format!("/sandboxes/{id}"), None).0, 404);
    for page in ["login", "sandboxes", "sandbox", "terminal"] {
        let f = shots.join(format!("firefox-{page}-1280.png"));
        assert!(std::fs::metadata(&f).is_ok_and(|m| m.len() > 1000), "{f:?}");
    }
}
