//! The guest agent's envd surface, served by the real `agentenv-agent --envd` binary on
//! loopback (no VM): every Connect RPC of `process.Process` and `filesystem.Filesystem`,
//! `/files`, `/init` and `/health`, spoken as the E2B SDKs speak them (JSON codec,
//! enveloped streams). Files live under cargo's per-target scratch dir. Shells run
//! without login files (the SDK's `bash -l` would read the host's dotfiles); the VM test
//! in e2e_sandbox runs the login shell of the base image.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

struct Envd {
    child: Child,
    base: String,
    dir: PathBuf,
}

impl Envd {
    fn start(name: &str) -> Envd {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("envd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_agentenv-agent"))
            .args(["--envd", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start agentenv-agent --envd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("envd listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_string();
        Envd {
            child,
            base: format!("http://{addr}"),
            dir,
        }
    }

    fn path(&self, rel: &str) -> String {
        self.dir.join(rel).to_string_lossy().into_owned()
    }

    fn post(&self, path: &str, content_type: &str, headers: &[(&str, &str)]) -> ureq::Request {
        let mut r = ureq::post(&format!("{}{path}", self.base))
            .timeout(Duration::from_secs(30))
            .set("Content-Type", content_type);
        for (k, v) in headers {
            r = r.set(k, v);
        }
        r
    }

    /// A unary call: (HTTP status, JSON body).
    fn unary_with(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> (u16, Value) {
        let res = self
            .post(path, "application/json", headers)
            .send_string(&body.to_string());
        let resp = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn unary(&self, path: &str, body: Value) -> (u16, Value) {
        self.unary_with(path, body, &[])
    }

    fn ok(&self, path: &str, body: Value) -> Value {
        let (status, v) = self.unary(path, body);
        assert_eq!(status, 200, "{path}: {v}");
        v
    }

    /// A server-streaming call.
    fn stream(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> Stream {
        let resp = self
            .post(path, "application/connect+json", headers)
            .send_bytes(&envelope(0, &body))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.header("Content-Type"),
            Some("application/connect+json")
        );
        Stream {
            body: Box::new(resp.into_reader()),
            end: None,
        }
    }

    fn start_process(&self, process: Value) -> (u32, Stream) {
        let mut s = self.stream("/process.Process/Start", process, &[]);
        let first = s.next().expect("a start event");
        let pid = first["event"]["start"]["pid"].as_u64().expect("pid") as u32;
        (pid, s)
    }

    fn bash(&self, script: &str) -> Value {
        json!({"process": {"cmd": "/bin/bash", "args": ["-c", script]}, "stdin": false})
    }
}

impl Drop for Envd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn envelope(flags: u8, body: &Value) -> Vec<u8> {
    let payload = body.to_string().into_bytes();
    let mut out = vec![flags];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend(payload);
    out
}

struct Stream {
    body: Box<dyn Read + Send>,
    /// The end-of-stream message, once read.
    end: Option<Value>,
}

impl Stream {
    /// The next message; `None` after the end-of-stream message.
    fn next(&mut self) -> Option<Value> {
        if self.end.is_some() {
            return None;
        }
        let mut header = [0u8; 5];
        self.body.read_exact(&mut header).expect("envelope header");
        let len = u32::from_be_bytes(header[1..].try_into().unwrap()) as usize;
        let mut payload = vec![0u8; len];
        self.body.read_exact(&mut payload).unwrap();
        let v: Value = serde_json::from_slice(&payload).unwrap();
        if header[0] & 2 != 0 {
            self.end = Some(v);
            return None;
        }
        Some(v)
    }

    /// Reads to the end: (stdout, stderr, pty output, end event, end-of-stream message).
    fn collect(&mut self) -> Collected {
        let mut c = Collected::default();
        while let Some(v) = self.next() {
            let event = &v["event"];
            if let Some(data) = event.get("data") {
                for (k, buf) in [
                    ("stdout", &mut c.stdout),
                    ("stderr", &mut c.stderr),
                    ("pty", &mut c.pty),
                ] {
                    if let Some(s) = data.get(k).and_then(Value::as_str) {
                        buf.extend(B64.decode(s).unwrap());
                    }
                }
            } else if let Some(end) = event.get("end") {
                c.end = Some(end.clone());
            }
        }
        c.trailer = self.end.clone().unwrap();
        c
    }
}

#[derive(Default)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pty: Vec<u8>,
    end: Option<Value>,
    trailer: Value,
}

impl Collected {
    fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
}

fn sel(pid: u32) -> Value {
    json!({"pid": pid})
}

fn stdin(pid: u32, data: &str) -> Value {
    json!({"process": sel(pid), "input": {"stdin": B64.encode(data)}})
}

/// The next data event's bytes (skipping keepalives).
fn next_data(s: &mut Stream) -> (String, Vec<u8>) {
    loop {
        let v = s.next().expect("more events");
        if let Some(data) = v["event"].get("data") {
            let (k, b) = data.as_object().unwrap().iter().next().unwrap();
            return (k.clone(), B64.decode(b.as_str().unwrap()).unwrap());
        }
    }
}

#[test]
fn start_streams_output_as_it_happens_and_reports_the_exit() {
    let e = Envd::start("start");
    // The command waits for input that is only sent after its first line arrived, so the
    // test only passes if that line was streamed before the command ended.
    let (pid, mut s) = e.start_process(json!({
        "process": {"cmd": "/bin/bash", "args": ["-c", "echo one; read x; echo \"got $x\" >&2; exit 3"]},
        "stdin": true,
    }));
    assert!(pid > 0);
    assert_eq!(next_data(&mut s), ("stdout".into(), b"one\n".to_vec()));
    e.ok("/process.Process/SendInput", stdin(pid, "two\n"));
    let c = s.collect();
    assert_eq!(String::from_utf8_lossy(&c.stderr), "got two\n");
    let end = c.end.unwrap();
    assert_eq!(end["exitCode"], 3);
    assert_eq!(end["exited"], true);
    assert_eq!(end["status"], "exit status 3");
    assert_eq!(c.trailer, json!({}));
}

#[test]
fn environment_cwd_and_init_defaults_apply() {
    let e = Envd::start("env");
    let (status, _) = {
        let r = ureq::post(&format!("{}/init", e.base))
            .send_string(r#"{"envVars": {"FROM_INIT": "yes", "OVERRIDDEN": "init"}}"#)
            .unwrap();
        (r.status(), ())
    };
    assert_eq!(status, 204);
    let envs = ureq::get(&format!("{}/envs", e.base)).call().unwrap();
    assert_eq!(envs.into_json::<Value>().unwrap()["FROM_INIT"], "yes");
    let (_, mut s) = e.start_process(json!({
        "process": {
            "cmd": "/bin/bash",
            "args": ["-c", "echo $FROM_INIT $OVERRIDDEN $OWN $E2B_SANDBOX; pwd"],
            "envs": {"OWN": "own", "OVERRIDDEN": "call"},
            "cwd": e.dir.to_string_lossy(),
        },
        "stdin": false,
    }));
    let c = s.collect();
    assert_eq!(c.out(), format!("yes call own true\n{}\n", e.dir.display()));
    // Without a cwd the process starts in the account's home.
    let (_, mut s) = e.start_process(e.bash("pwd; echo $HOME"));
    let out = s.collect().out();
    let mut lines = out.lines();
    assert_eq!(lines.next(), lines.next(), "{out}");
}

#[test]
fn bad_starts_end_the_stream_with_the_right_code() {
    let e = Envd::start("badstart");
    let mut s = e.stream(
        "/process.Process/Start",
        json!({"process": {"cmd": "/bin/true", "cwd": e.path("missing")}}),
        &[],
    );
    assert!(s.next().is_none());
    assert_eq!(s.end.as_ref().unwrap()["error"]["code"], "invalid_argument");
    let mut s = e.stream(
        "/process.Process/Start",
        json!({"process": {"cmd": "no-such-command-xyz"}}),
        &[],
    );
    assert!(s.next().is_none());
    let err = &s.end.as_ref().unwrap()["error"];
    assert_eq!(err["code"], "invalid_argument");
    assert!(
        err["message"].as_str().unwrap().contains("not found"),
        "{err}"
    );
}

#[test]
fn list_signal_and_connect_by_tag() {
    let e = Envd::start("signal");
    let (pid, mut s) = e.start_process(json!({
        "process": {"cmd": "/bin/sleep", "args": ["30"]},
        "tag": "sleeper",
        "stdin": false,
    }));
    let list = e.ok("/process.Process/List", json!({}));
    let procs = list["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1);
    assert_eq!(procs[0]["pid"], pid);
    assert_eq!(procs[0]["tag"], "sleeper");
    assert_eq!(procs[0]["config"]["cmd"], "/bin/sleep");
    assert_eq!(procs[0]["config"]["args"], json!(["30"]));

    // A second follower by tag sees the same end.
    let mut follower = e.stream(
        "/process.Process/Connect",
        json!({"process": {"tag": "sleeper"}}),
        &[],
    );
    assert_eq!(follower.next().unwrap()["event"]["start"]["pid"], pid);
    e.ok(
        "/process.Process/SendSignal",
        json!({"process": sel(pid), "signal": "SIGNAL_SIGKILL"}),
    );
    for stream in [&mut s, &mut follower] {
        let end = stream.collect().end.unwrap();
        assert_eq!(end["exitCode"], -1);
        assert_eq!(end["status"], "signal: killed");
    }
    assert_eq!(
        e.ok("/process.Process/List", json!({}))["processes"],
        json!([])
    );
    // Ended processes stay connectable for a while: start and end at once.
    let mut late = e.stream(
        "/process.Process/Connect",
        json!({"process": sel(pid)}),
        &[],
    );
    assert_eq!(late.next().unwrap()["event"]["start"]["pid"], pid);
    assert_eq!(
        late.next().unwrap()["event"]["end"]["status"],
        "signal: killed"
    );
    // But no longer signalable.
    let (status, v) = e.unary(
        "/process.Process/SendSignal",
        json!({"process": sel(pid), "signal": "SIGNAL_SIGTERM"}),
    );
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));
    let (status, v) = e.unary(
        "/process.Process/SendSignal",
        json!({"process": {"pid": 1}, "signal": "SIGNAL_SIGHUP"}),
    );
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));
}

#[test]
fn timeouts_kill_the_process_and_end_with_deadline_exceeded() {
    let e = Envd::start("timeout");
    let mut s = e.stream(
        "/process.Process/Start",
        e.bash("sleep 30"),
        &[("Connect-Timeout-Ms", "300")],
    );
    let pid = s.next().unwrap()["event"]["start"]["pid"].as_u64().unwrap();
    while s.next().is_some() {}
    assert_eq!(s.end.unwrap()["error"]["code"], "deadline_exceeded");
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        // A zombie until the output thread takes its status: check the state.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.contains(") Z ") {
            break;
        }
        assert!(Instant::now() < deadline, "pid {pid} survived its timeout");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn keepalives_flow_while_a_process_is_quiet() {
    let e = Envd::start("keepalive");
    let mut s = e.stream(
        "/process.Process/Start",
        e.bash("sleep 2"),
        &[("Keepalive-Ping-Interval", "1")],
    );
    let mut keepalives = 0;
    while let Some(v) = s.next() {
        if v["event"].get("keepalive").is_some() {
            keepalives += 1;
        }
    }
    assert!(keepalives >= 1);
    assert_eq!(s.end.unwrap(), json!({}));
}

#[test]
fn stdin_close_and_client_streamed_input() {
    let e = Envd::start("stdin");
    let (pid, mut s) = e.start_process(json!({"process": {"cmd": "/bin/cat"}, "stdin": true}));
    e.ok("/process.Process/SendInput", stdin(pid, "abc"));
    assert_eq!(next_data(&mut s).1, b"abc");
    // More than a pipe holds: the write waits for cat to read, while the output flows.
    let big = "x".repeat(1 << 20);
    e.ok("/process.Process/SendInput", stdin(pid, &big));
    e.ok("/process.Process/CloseStdin", json!({"process": sel(pid)}));
    let c = s.collect();
    assert_eq!(c.stdout.len(), 1 << 20);
    assert_eq!(c.end.unwrap()["exitCode"], 0);

    let (pid, mut s) = e.start_process(json!({"process": {"cmd": "/bin/cat"}, "stdin": true}));
    let mut body = envelope(0, &json!({"start": {"process": sel(pid)}}));
    body.extend(envelope(0, &json!({"keepalive": {}})));
    body.extend(envelope(
        0,
        &json!({"data": {"input": {"stdin": B64.encode("streamed")}}}),
    ));
    let resp = e
        .post(
            "/process.Process/StreamInput",
            "application/connect+json",
            &[],
        )
        .send_bytes(&body)
        .unwrap();
    let mut reply = Stream {
        body: Box::new(resp.into_reader()),
        end: None,
    };
    assert_eq!(reply.next(), Some(json!({})));
    assert!(reply.next().is_none());
    assert_eq!(reply.end, Some(json!({})));
    assert_eq!(next_data(&mut s).1, b"streamed");
    e.ok("/process.Process/CloseStdin", json!({"process": sel(pid)}));
    s.collect();

    // Without stdin the process reads EOF and input is refused.
    let (pid, mut s) =
        e.start_process(json!({"process": {"cmd": "/bin/sleep", "args": ["5"]}, "stdin": false}));
    let (status, v) = e.unary("/process.Process/SendInput", stdin(pid, "x"));
    assert_eq!((status, v["code"].as_str()), (500, Some("internal")));
    e.ok(
        "/process.Process/SendSignal",
        json!({"process": sel(pid), "signal": 9}),
    );
    s.collect();
}

#[test]
fn pty_sessions_take_input_and_resize() {
    let e = Envd::start("pty");
    let (pid, mut s) = e.start_process(json!({
        "process": {"cmd": "/bin/bash", "args": ["--norc", "--noprofile", "-i"], "envs": {"TERM": "xterm-256color"}},
        "pty": {"size": {"cols": 80, "rows": 24}},
    }));
    e.ok(
        "/process.Process/Update",
        json!({"process": sel(pid), "pty": {"size": {"cols": 100, "rows": 30}}}),
    );
    let input = B64.encode("tty; stty size; exit 5\n");
    e.ok(
        "/process.Process/SendInput",
        json!({"process": sel(pid), "input": {"pty": input}}),
    );
    let c = s.collect();
    let out = String::from_utf8_lossy(&c.pty);
    assert!(out.contains("/dev/pts/"), "{out}");
    assert!(out.contains("30 100"), "{out}");
    assert_eq!(c.end.unwrap()["exitCode"], 5);
    // A pipe process has no PTY to resize.
    let (pid, mut s) = e.start_process(json!({"process": {"cmd": "/bin/sleep", "args": ["5"]}}));
    let (status, _) = e.unary(
        "/process.Process/Update",
        json!({"process": sel(pid), "pty": {"size": {"cols": 1, "rows": 1}}}),
    );
    assert_eq!(status, 500);
    e.ok(
        "/process.Process/SendSignal",
        json!({"process": sel(pid), "signal": "SIGNAL_SIGKILL"}),
    );
    s.collect();
}

fn multipart(files: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "----envdtestboundary";
    let mut body = Vec::new();
    for (name, data) in files {
        write!(
            body,
            "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .unwrap();
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    write!(body, "--{boundary}--\r\n").unwrap();
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn download(e: &Envd, path: &str) -> (u16, Vec<u8>) {
    let url = format!("{}/files", e.base);
    match ureq::get(&url).query("path", path).call() {
        Ok(r) => {
            let mut b = Vec::new();
            r.into_reader().read_to_end(&mut b).unwrap();
            (200, b)
        }
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap().into_bytes()),
        Err(err) => panic!("{err}"),
    }
}

#[test]
fn files_upload_and_download() {
    let e = Envd::start("files");
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let a = e.path("new/dir/a.txt");
    let b = e.path("b.bin");
    let (ct, body) = multipart(&[(&a, b"hello"), (&b, &big)]);
    let resp = e.post("/files", &ct, &[]).send_bytes(&body).unwrap();
    let written: Value = resp.into_json().unwrap();
    assert_eq!(
        written,
        json!([
            {"name": "a.txt", "type": "file", "path": a},
            {"name": "b.bin", "type": "file", "path": b},
        ])
    );
    assert_eq!(download(&e, &a), (200, b"hello".to_vec()));
    assert_eq!(download(&e, &b).1, big);

    // Raw and gzip bodies need ?path=.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(b"zipped").unwrap();
    let raw = e.path("raw.txt");
    let url = format!("/files?path={}", raw.replace('/', "%2F"));
    let resp = e
        .post(
            &url,
            "application/octet-stream",
            &[("Content-Encoding", "gzip")],
        )
        .send_bytes(&gz.finish().unwrap())
        .unwrap();
    assert_eq!(resp.into_json::<Value>().unwrap()[0]["path"], raw);
    assert_eq!(download(&e, &raw).1, b"zipped");

    let (status, body) = download(&e, &e.path("missing"));
    assert_eq!(status, 404);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["code"], 404);
    assert_eq!(download(&e, &e.path("new")).0, 400);
    // Uploading onto a directory is refused with 400.
    let (ct, body) = multipart(&[(&e.path("new"), b"x")]);
    match e.post("/files", &ct, &[]).send_bytes(&body) {
        Err(ureq::Error::Status(400, _)) => {}
        other => panic!("expected 400, got {other:?}"),
    }
}

#[test]
fn file_metadata_is_kept_as_user_xattrs() {
    let e = Envd::start("metadata");
    let file = e.path("meta.txt");
    let url = format!("/files?path={}", file.replace('/', "%2F"));
    let upload = |headers: &[(&str, &str)]| match e
        .post(&url, "application/octet-stream", headers)
        .send_bytes(b"data")
    {
        Ok(r) => (r.status(), r.into_json::<Value>().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json::<Value>().unwrap()),
        Err(other) => panic!("{other}"),
    };
    let (status, written) = upload(&[("X-Metadata-Owner", "Team A"), ("x-metadata-stage", "1")]);
    assert_eq!(status, 200, "{written}");
    let want = json!({"owner": "Team A", "stage": "1"});
    assert_eq!(written[0]["metadata"], want, "keys lowercased");
    let stat = e.ok("/filesystem.Filesystem/Stat", json!({"path": file}));
    assert_eq!(stat["entry"]["metadata"], want, "{stat}");
    let listed = e.ok(
        "/filesystem.Filesystem/ListDir",
        json!({"path": e.path("")}),
    );
    let entry = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "meta.txt")
        .cloned()
        .unwrap();
    assert_eq!(entry["metadata"], want, "{entry}");
    // A rewrite sets what it gives and keeps the rest.
    let (_, again) = upload(&[("X-Metadata-Stage", "2")]);
    assert_eq!(
        again[0]["metadata"],
        json!({"owner": "Team A", "stage": "2"})
    );
    let many: Vec<(String, String)> = (0..33)
        .map(|i| (format!("X-Metadata-k{i}"), "v".into()))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let big = "v".repeat(1025);
    let (status, err) = upload(&[("X-Metadata-big", big.as_str())]);
    assert_eq!(status, 400, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("at most 1024"),
        "{err}"
    );
    let (status, err) = upload(&many);
    assert_eq!(status, 400, "{err}");
    assert!(
        err["message"].as_str().unwrap().contains("at most 32"),
        "{err}"
    );
}

#[test]
fn filesystem_calls() {
    let e = Envd::start("fs");
    let (status, v) = e.unary(
        "/filesystem.Filesystem/Stat",
        json!({"path": e.path("nope")}),
    );
    assert_eq!((status, v["code"].as_str()), (404, Some("not_found")));

    let dir = e.path("d1/d2");
    let made = e.ok("/filesystem.Filesystem/MakeDir", json!({"path": dir}));
    assert_eq!(made["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(made["entry"]["name"], "d2");
    let (status, v) = e.unary("/filesystem.Filesystem/MakeDir", json!({"path": dir}));
    assert_eq!((status, v["code"].as_str()), (409, Some("already_exists")));

    std::fs::write(e.dir.join("d1/d2/f.txt"), "12345").unwrap();
    let st = e.ok(
        "/filesystem.Filesystem/Stat",
        json!({"path": e.path("d1/d2/f.txt")}),
    );
    let entry = &st["entry"];
    assert_eq!(entry["type"], "FILE_TYPE_FILE");
    assert_eq!(entry["size"], "5");
    assert_eq!(entry["permissions"], "-rw-r--r--");
    assert_eq!(entry["mode"], 0o644);
    assert!(entry["modifiedTime"].as_str().unwrap().ends_with('Z'));

    let listed = e.ok(
        "/filesystem.Filesystem/ListDir",
        json!({"path": e.path("d1"), "depth": 1}),
    );
    let names: Vec<&str> = listed["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["path"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec![e.path("d1/d2")]);
    let listed = e.ok(
        "/filesystem.Filesystem/ListDir",
        json!({"path": e.path("d1"), "depth": 2}),
    );
    assert_eq!(listed["entries"].as_array().unwrap().len(), 2);

    let moved = e.ok(
        "/filesystem.Filesystem/Move",
        json!({"source": e.path("d1/d2/f.txt"), "destination": e.path("d3/g.txt")}),
    );
    assert_eq!(moved["entry"]["path"], e.path("d3/g.txt"));
    let (status, _) = e.unary(
        "/filesystem.Filesystem/Move",
        json!({"source": e.path("d1/d2/f.txt"), "destination": e.path("x")}),
    );
    assert_eq!(status, 404);

    e.ok(
        "/filesystem.Filesystem/Remove",
        json!({"path": e.path("d1")}),
    );
    assert!(!e.dir.join("d1").exists());
    e.ok(
        "/filesystem.Filesystem/Remove",
        json!({"path": e.path("d1")}),
    );
    let (status, _) = e.unary(
        "/filesystem.Filesystem/ListDir",
        json!({"path": e.path("d3/g.txt")}),
    );
    assert_eq!(status, 400);
}

#[test]
fn watchers_report_changes() {
    let e = Envd::start("watch");
    std::fs::create_dir_all(e.dir.join("w/sub")).unwrap();
    let created = e.ok(
        "/filesystem.Filesystem/CreateWatcher",
        json!({"path": e.path("w"), "recursive": true}),
    );
    let id = created["watcherId"].as_str().unwrap().to_string();
    std::fs::write(e.dir.join("w/sub/new.txt"), "x").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|(n, t)| n == "sub/new.txt" && t == "EVENT_TYPE_CREATE")
    {
        assert!(Instant::now() < deadline, "no create event: {seen:?}");
        std::thread::sleep(Duration::from_millis(100));
        let v = e.ok(
            "/filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": id}),
        );
        for ev in v["events"].as_array().unwrap() {
            seen.push((
                ev["name"].as_str().unwrap().to_string(),
                ev["type"].as_str().unwrap().to_string(),
            ));
        }
    }
    e.ok(
        "/filesystem.Filesystem/RemoveWatcher",
        json!({"watcherId": id}),
    );
    let (status, _) = e.unary(
        "/filesystem.Filesystem/GetWatcherEvents",
        json!({"watcherId": id}),
    );
    assert_eq!(status, 404);

    let mut s = e.stream(
        "/filesystem.Filesystem/WatchDir",
        json!({"path": e.path("w"), "includeEntry": true}),
        &[],
    );
    assert_eq!(s.next(), Some(json!({"start": {}})));
    std::fs::write(e.dir.join("w/streamed.txt"), "y").unwrap();
    let ev = loop {
        let v = s.next().expect("an event");
        if let Some(fs) = v.get("filesystem") {
            break fs.clone();
        }
    };
    assert_eq!(ev["name"], "streamed.txt");
    assert_eq!(ev["type"], "EVENT_TYPE_CREATE");
    assert_eq!(ev["entry"]["name"], "streamed.txt");
    let (status, _) = e.unary(
        "/filesystem.Filesystem/CreateWatcher",
        json!({"path": e.path("missing")}),
    );
    assert_eq!(status, 404);
}

#[test]
fn users_health_and_protocol_errors() {
    let e = Envd::start("proto");
    let health = ureq::get(&format!("{}/health", e.base)).call().unwrap();
    assert_eq!(health.status(), 200);

    let root = format!("Basic {}", B64.encode("root:"));
    let (status, _) = e.unary_with(
        "/process.Process/List",
        json!({}),
        &[("Authorization", &root)],
    );
    assert_eq!(status, 200);
    let stranger = format!("Basic {}", B64.encode("no-such-user-xyz:"));
    let (status, v) = e.unary_with(
        "/filesystem.Filesystem/Stat",
        json!({"path": "/"}),
        &[("Authorization", &stranger)],
    );
    assert_eq!((status, v["code"].as_str()), (401, Some("unauthenticated")));

    let (status, v) = e.unary("/process.Process/Nope", json!({}));
    assert_eq!((status, v["code"].as_str()), (404, Some("unimplemented")));
    let resp = e
        .post("/process.Process/List", "application/proto", &[])
        .send_bytes(b"");
    assert!(matches!(resp, Err(ureq::Error::Status(415, _))));
    let (status, v) = e.unary("/filesystem.Filesystem/Stat", json!({"path": 7}));
    assert_eq!(
        (status, v["code"].as_str()),
        (400, Some("invalid_argument"))
    );
}
