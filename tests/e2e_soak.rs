//! The soak of issue 24: random operations from several clients against one real server
//! with real VMs and a real recording extension, while the host breaks under it: the
//! extension fails and is slow for a while, QEMU processes are SIGKILLed, the server is
//! SIGKILLed and restarted, and its state disk (a small loop-mounted ext4) fills up for a
//! while. At the end every start the extension saw is paired with one stop, every 5xx
//! (and every other answer no client asked for) has a cause the faults explain, and
//! nothing is left: no QEMU, namespace, link, run dir, slot or reservation.
//!
//! The short soak runs in the suite; the long one (`AENV_SOAK_OPS`, default 3000, from 8
//! clients) is `scripts/soak`, which records its figures in docs/operations.md.

mod common;

use common::extension::{Behavior, Extension, Recorded};
use common::loopfs::LoopFs;
use common::*;
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The size of a soak and of its faults. Faults are due at operation counts (fractions
/// of `ops`, moved a little by the seed): the client that takes the operation a fault is
/// due at, and every one after it, waits until the fault has begun, so every run injects
/// every fault, whatever the machine's speed.
struct Plan {
    ops: usize,
    clients: usize,
    qemu_kills: usize,
    server_kills: usize,
    /// How long the state disk stays full.
    disk_full: Duration,
    /// How long the extension fails, then how long it is slow.
    hook_faults: Duration,
}

impl Plan {
    fn short() -> Plan {
        Plan {
            ops: 150,
            clients: 4,
            qemu_kills: 1,
            server_kills: 1,
            disk_full: Duration::from_secs(10),
            hook_faults: Duration::from_secs(6),
        }
    }

    fn long(ops: usize) -> Plan {
        Plan {
            ops,
            clients: 8,
            qemu_kills: (ops / 300).max(3),
            server_kills: 2,
            disk_full: Duration::from_secs(30),
            hook_faults: Duration::from_secs(15),
        }
    }
}

#[test]
fn short_soak_with_faults_loses_nothing() {
    let _serial = serial();
    soak(&Plan::short());
}

#[test]
#[ignore = "long soak: run scripts/soak"]
fn long_soak_with_faults_loses_nothing() {
    let _serial = serial();
    let ops = std::env::var("AENV_SOAK_OPS")
        .ok()
        .map(|v| v.parse().expect("AENV_SOAK_OPS is a number of operations"))
        .unwrap_or(3000);
    soak(&Plan::long(ops));
}

/// The state disk's size and the reserve kept on it.
const DISK_MB: u64 = 8192;
const RESERVE_MB: u64 = 128;
/// The extension's `timeout_ms`; its slow answers stay well under it.
const HOOK_TIMEOUT_MS: u64 = 3000;
/// Every sandbox lives long past the soak: nothing expires under it.
const SANDBOX_TIMEOUT: u64 = 7200;
/// After the disk has room again, a guest paused on an I/O error continues within this.
const DISK_GRACE: Duration = Duration::from_secs(15);
/// A QEMU killed within this of an answer about its sandbox explains that answer.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// The run's seed: `AENV_SOAK_SEED` repeats a run's choices (clients' operations, fault
/// positions, which QEMU is killed); otherwise taken from the clock and printed.
fn seed() -> u64 {
    let seed = std::env::var("AENV_SOAK_SEED")
        .ok()
        .map(|v| v.parse().expect("AENV_SOAK_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("soak: seed {seed} (AENV_SOAK_SEED={seed} repeats this run's choices)");
    seed
}

/// xorshift64* over `state`, in `0..n`.
fn next_rand(state: &mut u64, n: u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
}

fn soak(plan: &Plan) {
    let seed = seed();
    let ext = Extension::start();
    let scratch = scratch_dir();
    let fs = LoopFs::new(&scratch.join("state"), DISK_MB);
    let mut s = Server::builder()
        .dir(&scratch)
        .server_keys(&format!("disk_reserve_mb = {RESERVE_MB}"))
        .section(&format!(
            "[custom_extension]\nurl = \"{}\"\ntimeout_ms = {HOOK_TIMEOUT_MS}\n",
            ext.url()
        ))
        .start();
    let run = Run {
        base: s.base.clone(),
        issued: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        total: plan.ops,
        answers: Mutex::new(Vec::new()),
        faults: Mutex::new(Faults::default()),
        gate: Mutex::new(Gate::default()),
        gate_moved: Condvar::new(),
    };
    let due = schedule(plan, seed);
    run.gate.lock().due = due.iter().map(|(op, _)| *op).collect();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for n in 0..plan.clients {
            let run = &run;
            scope.spawn(move || Client::new(n, seed, run).work());
        }
        inject_faults(plan, &due, seed, &run, &ext, &fs, &mut s);
    });
    let took = started.elapsed();
    clean_up(&s, &run);
    s.stop();
    let report = Report::of(&run, &ext, (started, took), plan, &s.log());
    println!(
        "soak: faults at (s after the start) {}",
        run.faults.lock().timeline(started)
    );
    report.print();
    assert_nothing_left(&s, &run);
    report.print_log_of_unpaired(&s.log());
    report.assert_clean();
    drop(s);
    drop(fs);
}

// ---------------------------------------------------------------------------------------
// What happened: answers and faults.
// ---------------------------------------------------------------------------------------

/// One answer a client got.
#[derive(Clone, Debug)]
struct Answer {
    op: &'static str,
    sandbox: Option<String>,
    /// `None`: no HTTP answer at all (the connection failed).
    status: Option<u16>,
    message: String,
    start: Instant,
    end: Instant,
    /// When the client last saw the sandbox exist, and whether it was paused then (for a
    /// sandbox found gone).
    seen: Option<(Instant, bool)>,
    /// The client expected another answer (a 2xx wrong in content, or the wrong 2xx).
    wrong: Option<String>,
}

/// The faults injected, with when.
#[derive(Default)]
struct Faults {
    hook_errors: Vec<(Instant, Instant)>,
    hook_delays: Vec<(Instant, Instant)>,
    disk_full: Vec<(Instant, Instant)>,
    /// From just before the SIGKILL to the restarted server's first healthy answer.
    server_down: Vec<(Instant, Instant)>,
    qemu_kills: Vec<(String, Instant)>,
}

impl Faults {
    /// When each fault came, in seconds after `t0`, for a report a reader can line
    /// answers up with.
    fn timeline(&self, t0: Instant) -> String {
        let s = |t: &Instant| t.saturating_duration_since(t0).as_secs_f64();
        let spans = |v: &[(Instant, Instant)]| {
            v.iter()
                .map(|(a, b)| format!("{:.1}-{:.1}", s(a), s(b)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let kills: Vec<String> = self
            .qemu_kills
            .iter()
            .map(|(id, at)| format!("{id}@{:.1}", s(at)))
            .collect();
        format!(
            "hook errors {}; hook delays {}; disk full {}; server down {}; QEMU kills {}",
            spans(&self.hook_errors),
            spans(&self.hook_delays),
            spans(&self.disk_full),
            spans(&self.server_down),
            kills.join(" ")
        )
    }
}

/// The shared state of one soak.
struct Run {
    base: String,
    issued: AtomicUsize,
    done: AtomicUsize,
    total: usize,
    answers: Mutex<Vec<Answer>>,
    faults: Mutex<Faults>,
    gate: Mutex<Gate>,
    gate_moved: Condvar,
}

/// The operations faults are due at, and how many faults have begun.
#[derive(Default)]
struct Gate {
    due: Vec<usize>,
    begun: usize,
}

/// How long a client waits at the gate for a fault to begin (a QEMU kill may first start
/// a sandbox of its own) before the run fails.
const GATE_WAIT: Duration = Duration::from_secs(300);

impl Run {
    /// Waits until every fault due at or before operation `op` has begun.
    fn pass_gate(&self, op: usize) {
        let deadline = Instant::now() + GATE_WAIT;
        let mut gate = self.gate.lock();
        while gate.due.iter().filter(|d| **d <= op).count() > gate.begun {
            if self.gate_moved.wait_until(&mut gate, deadline).timed_out() {
                panic!("operation {op} waited {GATE_WAIT:?} for a fault to begin");
            }
        }
    }

    /// The fault numbered `n` (from 1) has begun: operations up to the next one go on.
    fn fault_begun(&self, n: usize) {
        let mut gate = self.gate.lock();
        gate.begun = gate.begun.max(n);
        self.gate_moved.notify_all();
    }

    /// One API call; transport errors are answers too (status `None`).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (Option<u16>, Value) {
        let req = ureq::request(method, &format!("{}{path}", self.base))
            .set("X-API-Key", API_KEY)
            .timeout(Duration::from_secs(240));
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        let resp = match result {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => return (None, Value::String(e.to_string())),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap_or_default();
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (Some(status), v)
    }

    /// Waits (bounded) until the server answers /health, e.g. after a restart.
    fn wait_up(&self) {
        wait_until(Duration::from_secs(90), || {
            matches!(self.call("GET", "/health", None).0, Some(204))
        });
    }
}

// ---------------------------------------------------------------------------------------
// The clients.
// ---------------------------------------------------------------------------------------

/// A sandbox a client created, as the client believes it is.
struct Owned {
    id: String,
    paused: bool,
    seen: Instant,
}

/// Each client owns up to two sandboxes (at most one running) and one snapshot, and
/// drives them with random operations; it knows what each answer should be.
struct Client<'r> {
    run: &'r Run,
    rng: u64,
    owned: Vec<Owned>,
    snapshot: Option<String>,
    counter: u64,
}

impl<'r> Client<'r> {
    fn new(n: usize, seed: u64, run: &'r Run) -> Client<'r> {
        Client {
            run,
            rng: seed ^ ((n as u64 + 1) * 0x9e37_79b9_7f4a_7c15),
            owned: Vec::new(),
            snapshot: None,
            counter: 0,
        }
    }

    fn rand(&mut self, n: u64) -> u64 {
        next_rand(&mut self.rng, n)
    }

    fn work(mut self) {
        loop {
            let op = self.run.issued.fetch_add(1, Ordering::SeqCst);
            if op >= self.run.total {
                break;
            }
            self.run.pass_gate(op);
            self.one_op();
            self.run.done.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn running(&self) -> Option<usize> {
        self.owned.iter().position(|o| !o.paused)
    }
    fn paused(&self) -> Option<usize> {
        self.owned.iter().position(|o| o.paused)
    }

    /// Picks an operation that fits what the client owns, and runs it.
    fn one_op(&mut self) {
        let roll = self.rand(100);
        let (running, paused) = (self.running(), self.paused());
        match (roll, running, paused) {
            (0..=14, None, _) if self.owned.len() < 2 => self.create(),
            (0..=24, Some(i), _) => self.exec(i),
            (25..=34, Some(i), _) => self.envd_exec(i),
            (35..=44, Some(i), _) if paused.is_none() => self.pause(i),
            (35..=54, _, Some(i)) => self.resume(i),
            (55..=59, Some(i), _) => self.snapshot(i),
            (60..=64, Some(i), _) => self.set_timeout(i),
            (65..=70, _, _) if !self.owned.is_empty() => {
                let i = self.rand(self.owned.len() as u64) as usize;
                self.delete(i)
            }
            (71..=76, _, _) if !self.owned.is_empty() => {
                let i = self.rand(self.owned.len() as u64) as usize;
                self.get(i)
            }
            (77..=82, Some(i), _) => self.connect_running(i),
            (_, None, _) if self.owned.len() < 2 => self.create(),
            (_, Some(i), _) if roll.is_multiple_of(2) => self.exec(i),
            _ => self.list(),
        }
    }

    /// Records an answer and returns it; a non-2xx answer about an owned sandbox is
    /// followed by a look at what became of it.
    fn answer(
        &mut self,
        op: &'static str,
        sandbox: Option<usize>,
        call: (Option<u16>, Value),
        start: Instant,
        wrong: Option<String>,
    ) -> (Option<u16>, Value) {
        let (status, v) = call;
        let owned = sandbox.map(|i| &self.owned[i]);
        let a = Answer {
            op,
            sandbox: owned.map(|o| o.id.clone()),
            status,
            message: message(&v),
            start,
            end: Instant::now(),
            seen: owned.map(|o| (o.seen, o.paused)),
            wrong,
        };
        self.run.answers.lock().push(a);
        if !matches!(status, Some(200..=299)) {
            // As a client would: back off a little after a failure, so that a fault window
            // does not burn the run's operations in fast failures.
            std::thread::sleep(Duration::from_secs(1));
        }
        if let Some(i) = sandbox {
            match status {
                Some(200..=299) => self.owned[i].seen = Instant::now(),
                _ => self.resync(i),
            }
        }
        (status, v)
    }

    /// After an unexpected answer: learns whether the sandbox still exists and in which
    /// state (once the server answers again).
    fn resync(&mut self, i: usize) {
        self.run.wait_up();
        let id = self.owned[i].id.clone();
        let start = Instant::now();
        let (status, v) = self.run.call("GET", &format!("/sandboxes/{id}"), None);
        let o = &self.owned[i];
        self.run.answers.lock().push(Answer {
            op: "resync",
            sandbox: Some(id),
            status,
            message: message(&v),
            start,
            end: Instant::now(),
            seen: Some((o.seen, o.paused)),
            wrong: None,
        });
        match status {
            Some(200) => {
                let o = &mut self.owned[i];
                o.paused = v["state"] == "paused";
                o.seen = Instant::now();
            }
            Some(404) => {
                self.owned.remove(i);
            }
            _ => {}
        }
    }

    fn create(&mut self) {
        let start = Instant::now();
        let from_snapshot = self.snapshot.clone().filter(|_| self.rand(2) == 0);
        let (op, call) = match from_snapshot {
            Some(snap) => (
                "create_from_snapshot",
                self.run.call(
                    "POST",
                    "/sandboxes",
                    Some(json!({"templateID": snap, "timeout": SANDBOX_TIMEOUT})),
                ),
            ),
            None => (
                "create",
                self.run.call(
                    "POST",
                    "/sandboxes-cold",
                    Some(json!({"image": base_image(), "timeout": SANDBOX_TIMEOUT})),
                ),
            ),
        };
        let (status, v) = self.answer(op, None, call, start, None);
        if status == Some(201) {
            self.owned.push(Owned {
                id: id_of(&v),
                paused: false,
                seen: Instant::now(),
            });
        }
    }

    fn exec(&mut self, i: usize) {
        self.counter += 1;
        let n = self.counter;
        let start = Instant::now();
        let call = self.run.call(
            "POST",
            &format!("/sandboxes/{}/commands", self.owned[i].id),
            Some(json!({"cmd": "sh", "args": ["-c", format!("echo $(({n} + 1))")]})),
        );
        let wrong = (call.0 == Some(200) && call.1["stdout"] != format!("{}\n", n + 1))
            .then(|| format!("stdout {}", call.1));
        self.answer("exec", Some(i), call, start, wrong);
    }

    fn envd_exec(&mut self, i: usize) {
        self.counter += 1;
        let n = self.counter;
        let start = Instant::now();
        let (call, wrong) = envd_echo(&self.run.base, &self.owned[i].id, n);
        self.answer("envd_exec", Some(i), call, start, wrong);
    }

    fn pause(&mut self, i: usize) {
        let start = Instant::now();
        let path = format!("/sandboxes/{}/pause", self.owned[i].id);
        let call = self.run.call("POST", &path, None);
        let (status, _) = self.answer("pause", Some(i), call, start, None);
        if status == Some(204) {
            if let Some(o) = self.owned.get_mut(i) {
                o.paused = true;
            }
        }
    }

    fn resume(&mut self, i: usize) {
        let start = Instant::now();
        let how = if self.rand(2) == 0 {
            "resume"
        } else {
            "connect"
        };
        let path = format!("/sandboxes/{}/{how}", self.owned[i].id);
        let call = self
            .run
            .call("POST", &path, Some(json!({"timeout": SANDBOX_TIMEOUT})));
        let wrong = matches!(call.0, Some(200 | 202..=299))
            .then(|| format!("a {how} of a paused sandbox answered {:?}", call.0));
        let (status, _) = self.answer(how, Some(i), call, start, wrong);
        if status == Some(201) {
            if let Some(o) = self.owned.get_mut(i) {
                o.paused = false;
            }
        }
    }

    fn connect_running(&mut self, i: usize) {
        let start = Instant::now();
        let path = format!("/sandboxes/{}/connect", self.owned[i].id);
        let call = self
            .run
            .call("POST", &path, Some(json!({"timeout": SANDBOX_TIMEOUT})));
        let wrong = matches!(call.0, Some(201..=299))
            .then(|| format!("a connect of a running sandbox answered {:?}", call.0));
        self.answer("connect_running", Some(i), call, start, wrong);
    }

    /// Takes a snapshot, or deletes the one the client has.
    fn snapshot(&mut self, i: usize) {
        let start = Instant::now();
        if let Some(snap) = self.snapshot.take() {
            let call = self.run.call("DELETE", &format!("/templates/{snap}"), None);
            let (status, _) = self.answer("delete_snapshot", None, call, start, None);
            if !matches!(status, Some(204 | 404)) {
                self.snapshot = Some(snap);
            }
            return;
        }
        let path = format!("/sandboxes/{}/snapshots", self.owned[i].id);
        let call = self.run.call("POST", &path, None);
        let (status, v) = self.answer("snapshot", Some(i), call, start, None);
        if status == Some(201) {
            self.snapshot = v["snapshotID"].as_str().map(str::to_string);
        }
    }

    fn set_timeout(&mut self, i: usize) {
        let start = Instant::now();
        let path = format!("/sandboxes/{}/timeout", self.owned[i].id);
        let call = self
            .run
            .call("POST", &path, Some(json!({"timeout": SANDBOX_TIMEOUT})));
        self.answer("timeout", Some(i), call, start, None);
    }

    fn delete(&mut self, i: usize) {
        let start = Instant::now();
        let path = format!("/sandboxes/{}", self.owned[i].id);
        let call = self.run.call("DELETE", &path, None);
        let (status, _) = self.answer("delete", Some(i), call, start, None);
        if status == Some(204) {
            self.owned.remove(i);
        }
    }

    fn get(&mut self, i: usize) {
        let start = Instant::now();
        let call = self
            .run
            .call("GET", &format!("/sandboxes/{}", self.owned[i].id), None);
        let want = if self.owned[i].paused {
            "paused"
        } else {
            "running"
        };
        let wrong = (call.0 == Some(200) && call.1["state"] != want)
            .then(|| format!("state {} where {want} was expected", call.1["state"]));
        self.answer("get", Some(i), call, start, wrong);
    }

    fn list(&mut self) {
        let start = Instant::now();
        let call = self.run.call("GET", "/v2/sandboxes", None);
        let wrong = (call.0 == Some(200) && !call.1.is_array()).then(|| call.1.to_string());
        self.answer("list", None, call, start, wrong);
    }
}

fn message(v: &Value) -> String {
    v["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| match v {
            Value::String(s) => s.clone(),
            _ => String::new(),
        })
}

/// `sh -c 'echo $((n+1))'` through envd's `process.Process/Start` on the API port's
/// port routing, as the SDKs run commands: the call's status (the stream's end, when it
/// ends in an error) and what was wrong with a 200.
fn envd_echo(base: &str, id: &str, n: u64) -> ((Option<u16>, Value), Option<String>) {
    let msg = json!({
        "process": {"cmd": "/bin/sh", "args": ["-c", format!("echo $(({n} + 1))")]},
        "stdin": false,
    })
    .to_string();
    let mut body = vec![0u8];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(msg.as_bytes());
    let sent = ureq::post(&format!("{base}/process.Process/Start"))
        .set("E2b-Sandbox-Id", id)
        .set("E2b-Sandbox-Port", "49983")
        .set("X-API-Key", API_KEY)
        .set("Content-Type", "application/connect+json")
        .timeout(Duration::from_secs(120))
        .send_bytes(&body);
    let resp = match sent {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let text = r.into_string().unwrap_or_default();
            let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
            return ((Some(code), v), None);
        }
        Err(e) => return ((None, Value::String(e.to_string())), None),
    };
    let mut raw = Vec::new();
    if let Err(e) = std::io::Read::read_to_end(&mut resp.into_reader(), &mut raw) {
        return (
            (None, Value::String(format!("reading the stream: {e}"))),
            None,
        );
    }
    let (stdout, end, trailer) = connect_messages(&raw);
    let want = format!("{}\n", n + 1);
    let wrong = if end["exitCode"] == 0 && stdout == want {
        None
    } else if trailer.get("error").is_some() {
        // The stream ended in an error: counted as the call's failure, a 502 of its own.
        return ((Some(502), trailer), None);
    } else {
        Some(format!("stdout {stdout:?} end {end} trailer {trailer}"))
    };
    ((Some(200), Value::Null), wrong)
}

/// The decoded stdout, the `end` event and the end-of-stream message of a Connect stream.
fn connect_messages(mut rest: &[u8]) -> (String, Value, Value) {
    use base64::Engine;
    let (mut stdout, mut end, mut trailer) = (String::new(), Value::Null, Value::Null);
    while rest.len() >= 5 {
        let len = u32::from_be_bytes(rest[1..5].try_into().unwrap()) as usize;
        let Some(payload) = rest.get(5..5 + len) else {
            break;
        };
        let v: Value = serde_json::from_slice(payload).unwrap_or(Value::Null);
        if rest[0] & 2 != 0 {
            trailer = v;
        } else if let Some(out) = v["event"]["data"]["stdout"].as_str() {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(out)
                .unwrap_or_default();
            stdout.push_str(&String::from_utf8_lossy(&bytes));
        } else if v["event"].get("end").is_some() {
            end = v["event"]["end"].clone();
        }
        rest = &rest[5 + len..];
    }
    (stdout, end, trailer)
}

// ---------------------------------------------------------------------------------------
// The faults.
// ---------------------------------------------------------------------------------------

/// One fault, due at an operation of the run ([`schedule`]).
enum Fault {
    Hooks,
    KillQemu,
    KillServer,
    DiskFull,
}

/// The plan's faults and the operation each is due at, in order: spread over the run,
/// each moved by up to 4 % of the run by the seed.
fn schedule(plan: &Plan, seed: u64) -> Vec<(usize, Fault)> {
    let mut at: Vec<(f64, Fault)> = vec![(0.10, Fault::Hooks), (0.60, Fault::DiskFull)];
    for k in 0..plan.qemu_kills {
        at.push((
            0.2 + 0.7 * (k as f64 + 0.5) / plan.qemu_kills as f64,
            Fault::KillQemu,
        ));
    }
    for k in 0..plan.server_kills {
        at.push((0.35 + 0.45 * k as f64, Fault::KillServer));
    }
    let mut rng = seed ^ 0x5eed_fa17;
    let mut due: Vec<(usize, Fault)> = at
        .into_iter()
        .map(|(f, fault)| {
            let jitter = next_rand(&mut rng, 81) as f64 / 1000.0 - 0.04;
            let op = ((f + jitter) * plan.ops as f64) as usize;
            (op.clamp(1, plan.ops - 1), fault)
        })
        .collect();
    due.sort_by_key(|(op, _)| *op);
    due
}

/// Injects the faults as the clients reach the operations they are due at; a fault
/// opens the gate (`fault_begun`) once it has begun, so no run ends before all of them.
fn inject_faults(
    plan: &Plan,
    due: &[(usize, Fault)],
    seed: u64,
    run: &Run,
    ext: &Extension,
    fs: &LoopFs,
    s: &mut Server,
) {
    let mut rng = seed ^ 0x0c1e_a7ed;
    for (n, (op, fault)) in due.iter().enumerate() {
        let reached = wait_until(GATE_WAIT, || run.issued.load(Ordering::SeqCst) > *op);
        assert!(reached, "the clients never reached operation {op}");
        let begun = || run.fault_begun(n + 1);
        match fault {
            Fault::Hooks => hook_faults(plan.hook_faults, run, ext, &begun),
            Fault::KillQemu => kill_a_qemu(run, s, &mut rng),
            Fault::KillServer => kill_the_server(run, s),
            Fault::DiskFull => fill_the_disk(plan.disk_full, run, fs, &begun),
        }
        begun();
    }
}

/// The extension fails every start (and the next two stop attempts) for `d`, then
/// answers slowly (under its timeout) for `d`.
fn hook_faults(d: Duration, run: &Run, ext: &Extension, begun: &dyn Fn()) {
    let t0 = Instant::now();
    ext.set("start-fresh", Behavior::status(503));
    ext.set(
        "start-resume",
        Behavior::json(500, json!({"error": "injected"})),
    );
    ext.script("stop", vec![Behavior::status(503); 2]);
    begun();
    std::thread::sleep(d);
    let t1 = Instant::now();
    for hook in ["start-fresh", "start-resume", "stop"] {
        ext.set(
            hook,
            Behavior::delay(HOOK_TIMEOUT_MS / 2, Behavior::Default),
        );
    }
    std::thread::sleep(d);
    for hook in ["start-fresh", "start-resume", "stop"] {
        ext.set(hook, Behavior::Default);
    }
    let mut f = run.faults.lock();
    f.hook_errors.push((t0, t1));
    f.hook_delays.push((t1, Instant::now()));
}

/// Sandbox ids of the server's running QEMU processes (their `-name guest=<run dir>`).
fn running_vms(s: &Server) -> Vec<(u32, String)> {
    let prefix = format!("guest={}/", s.state_dir.join("sandboxes").display());
    qemu_processes_with(&prefix)
        .into_iter()
        .filter_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            let rest = &cmdline[cmdline.find(&prefix)? + prefix.len()..];
            let id = rest.split([' ', '/', ',']).next()?.to_string();
            Some((pid, id))
        })
        .collect()
}

/// SIGKILLs the QEMU of a random running sandbox of the clients'. The clients wait at the
/// gate meanwhile and may all hold paused sandboxes only: then it starts one of its own
/// (deleted with the rest at the end) and kills that one.
fn kill_a_qemu(run: &Run, s: &Server, rng: &mut u64) {
    let mut vms = Vec::new();
    wait_until(Duration::from_secs(5), || {
        vms = running_vms(s);
        !vms.is_empty()
    });
    if vms.is_empty() {
        let body = json!({"image": base_image(), "timeout": SANDBOX_TIMEOUT});
        let (status, v) = run.call("POST", "/sandboxes-cold", Some(body));
        assert_eq!(status, Some(201), "a sandbox to kill: {v}\n{}", s.log());
        let id = id_of(&v);
        vms = running_vms(s)
            .into_iter()
            .filter(|(_, i)| *i == id)
            .collect();
        assert!(!vms.is_empty(), "no QEMU runs for {id}:\n{}", s.log());
    }
    let pick = next_rand(rng, vms.len() as u64) as usize;
    let (pid, id) = vms.swap_remove(pick);
    run.faults.lock().qemu_kills.push((id, Instant::now()));
    host("kill", &["-KILL", &pid.to_string()]);
}

/// SIGKILLs the server and starts it again on the same state dir.
fn kill_the_server(run: &Run, s: &mut Server) {
    let t0 = Instant::now();
    s.crash();
    let state = s.state_dir.display().to_string();
    assert!(
        wait_until(Duration::from_secs(20), || qemu_processes_with(&state)
            .is_empty()),
        "QEMU outlived the SIGKILLed server"
    );
    s.spawn();
    run.faults.lock().server_down.push((t0, Instant::now()));
}

/// Fills the state disk below the reserve, then completely, for `d`; then frees it.
fn fill_the_disk(d: Duration, run: &Run, fs: &LoopFs, begun: &dyn Fn()) {
    let t0 = Instant::now();
    begun();
    let below = fs.fill_to((RESERVE_MB / 4) << 20, 1);
    std::thread::sleep(d / 2);
    let full = fs.fill_to(0, 2);
    std::thread::sleep(d / 2);
    std::fs::remove_file(full).unwrap();
    std::fs::remove_file(below).unwrap();
    run.faults.lock().disk_full.push((t0, Instant::now()));
}

// ---------------------------------------------------------------------------------------
// The end: cleaning up, explaining, checking.
// ---------------------------------------------------------------------------------------

/// Deletes every sandbox and snapshot left, and waits (bounded) for every stop to be
/// delivered.
fn clean_up(s: &Server, run: &Run) {
    run.wait_up();
    let (_, list) = s.call("GET", "/v2/sandboxes?state=running,paused", None);
    for sb in list.as_array().cloned().unwrap_or_default() {
        let id = sb["sandboxID"].as_str().unwrap();
        let (code, v) = s.call("DELETE", &format!("/sandboxes/{id}"), None);
        assert_eq!(code, 204, "deleting {id} at the end: {v}\n{}", s.log());
    }
    let (_, snaps) = s.call("GET", "/snapshots", None);
    for snap in snaps.as_array().cloned().unwrap_or_default() {
        let id = snap["snapshotID"].as_str().unwrap();
        let (code, v) = s.call("DELETE", &format!("/templates/{id}"), None);
        assert_eq!(code, 204, "deleting snapshot {id} at the end: {v}");
    }
    let open = || metric(s, "agentenv_hook_open_instances ") == Some(0.0);
    assert!(
        wait_until(Duration::from_secs(60), open),
        "open journal entries remain at the end:\n{}",
        sdk::tail(&s.log(), 80)
    );
    let reserved = r#"agentenv_admission_memory_mb{state="reserved"}"#;
    assert!(
        wait_until(Duration::from_secs(10), || metric(s, reserved) == Some(0.0)),
        "memory still reserved at the end"
    );
    let in_use = r#"agentenv_network_slots{state="in_use"}"#;
    assert!(
        wait_until(Duration::from_secs(10), || metric(s, in_use) == Some(0.0)),
        "network slots still in use at the end"
    );
    assert_eq!(
        metric(s, "agentenv_hook_stop_undelivered_total "),
        Some(0.0)
    );
}

fn metric(s: &Server, line_start: &str) -> Option<f64> {
    let text = ureq::get(&format!("{}/metrics", s.base))
        .call()
        .ok()?
        .into_string()
        .ok()?;
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// No QEMU, namespace, link or run dir is left; quarantined run dirs are only those of
/// killed QEMUs.
fn assert_nothing_left(s: &Server, run: &Run) {
    let state = s.state_dir.display().to_string();
    assert!(
        qemu_processes_with(&state).is_empty(),
        "QEMU left for {state}"
    );
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    let left = files_under(&s.state_dir.join("sandboxes"));
    assert!(left.is_empty(), "run dirs left: {left:?}");
    let builds = files_under(&s.state_dir.join("template-builds"));
    assert!(builds.is_empty(), "build dirs left: {builds:?}");
    let killed: Vec<String> = run
        .faults
        .lock()
        .qemu_kills
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    let quarantine = std::fs::read_dir(s.state_dir.join("quarantine"))
        .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default();
    for q in quarantine.iter().filter(|p| p.is_dir()) {
        let name = q.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            killed
                .iter()
                .any(|id| name.starts_with(&format!("sandboxes-{id}-"))),
            "quarantined {name}, not a killed QEMU's ({killed:?}): {}",
            std::fs::read_to_string(q.with_extension("reason")).unwrap_or_default()
        );
        assert!(q.with_extension("reason").is_file(), "{name} has a reason");
    }
}

/// What a soak found.
struct Report {
    ops: usize,
    clients: usize,
    took: Duration,
    by_cause: BTreeMap<String, usize>,
    by_status: BTreeMap<String, usize>,
    /// Per operation: how many answered 2xx and their total seconds.
    by_op: BTreeMap<&'static str, (usize, f64)>,
    unexplained: Vec<String>,
    unpaired: Vec<String>,
    /// Stops given up, rightly, before a newer start of their sandbox (§6.2).
    given_up: usize,
    /// The three slowest answers: op, seconds, status.
    slowest: Vec<(&'static str, f64, Option<u16>)>,
    starts: usize,
    stops: usize,
}

impl Report {
    fn of(
        run: &Run,
        ext: &Extension,
        (t0, took): (Instant, Duration),
        plan: &Plan,
        log: &str,
    ) -> Report {
        let faults = run.faults.lock();
        let answers = run.answers.lock().clone();
        let mut r = Report {
            ops: plan.ops,
            clients: plan.clients,
            took,
            by_cause: BTreeMap::new(),
            by_status: BTreeMap::new(),
            by_op: BTreeMap::new(),
            unexplained: Vec::new(),
            unpaired: Vec::new(),
            given_up: 0,
            slowest: Vec::new(),
            starts: 0,
            stops: 0,
        };
        (r.unpaired, r.given_up) = pairing(ext, &faults, log);
        let mut slow: Vec<_> = answers
            .iter()
            .map(|a| (a.op, (a.end - a.start).as_secs_f64(), a.status))
            .collect();
        slow.sort_by(|a, b| b.1.total_cmp(&a.1));
        r.slowest = slow.into_iter().take(3).collect();
        r.starts = ext.requests_for("start-fresh").len() + ext.requests_for("start-resume").len();
        r.stops = ext.requests_for("stop").len();
        for a in &answers {
            let status = a.status.map_or("none".to_string(), |c| c.to_string());
            *r.by_status.entry(status).or_default() += 1;
            if matches!(a.status, Some(200..=299)) {
                let e = r.by_op.entry(a.op).or_default();
                e.0 += 1;
                e.1 += (a.end - a.start).as_secs_f64();
            }
            match explain(a, &faults) {
                Ok(None) => {}
                Ok(Some(cause)) => *r.by_cause.entry(cause.to_string()).or_default() += 1,
                Err(why) => r.unexplained.push(format!(
                    "{} {why} (from {:.1} s to {:.1} s): {a:?}",
                    a.op,
                    a.start.saturating_duration_since(t0).as_secs_f64(),
                    a.end.saturating_duration_since(t0).as_secs_f64()
                )),
            }
        }
        r
    }

    fn print(&self) {
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        println!(
            "soak: {} ops from {} clients in {:.0} s; load {}",
            self.ops,
            self.clients,
            self.took.as_secs_f64(),
            load.trim()
        );
        println!("soak: answers by status {:?}", self.by_status);
        println!("soak: explained non-2xx by cause {:?}", self.by_cause);
        let ops: Vec<String> = self
            .by_op
            .iter()
            .map(|(op, (n, secs))| format!("{op} {n} x {:.2} s", secs / *n as f64))
            .collect();
        println!("soak: successful operations, mean time: {}", ops.join(", "));
        println!(
            "soak: extension saw {} starts, {} stop attempts; {} stops given up before a newer start",
            self.starts, self.stops, self.given_up
        );
        println!("soak: slowest answers (op, s, status): {:?}", self.slowest);
    }

    /// The server's log lines about each unpaired instance, so that a failure explains
    /// itself (the log lives on the loop filesystem, gone once the test ends).
    fn print_log_of_unpaired(&self, log: &str) {
        for pair in &self.unpaired {
            let Some(id) = pair.split('"').nth(1) else {
                continue;
            };
            println!("soak: server log for {id}:");
            for line in log.lines().filter(|l| l.contains(id)) {
                println!("  {line}");
            }
        }
    }

    fn assert_clean(&self) {
        assert!(
            self.unpaired.is_empty(),
            "starts and stops not paired:\n{}",
            self.unpaired.join("\n")
        );
        assert!(
            self.unexplained.is_empty(),
            "{} answers no fault explains:\n{}",
            self.unexplained.len(),
            self.unexplained.join("\n")
        );
    }
}

/// Whether `t` falls in one of `windows`, stretched by `grace` after each end.
fn within(windows: &[(Instant, Instant)], a: &Answer, grace: Duration) -> bool {
    windows
        .iter()
        .any(|(t0, t1)| a.start <= *t1 + grace && a.end >= *t0)
}

/// The cause of an answer that is not the plain success (`Ok(None)`), or why none fits.
fn explain(a: &Answer, f: &Faults) -> Result<Option<&'static str>, String> {
    if let Some(wrong) = &a.wrong {
        return Err(format!("wrong answer ({wrong})"));
    }
    let killed = a.sandbox.as_ref().and_then(|id| {
        f.qemu_kills
            .iter()
            .find(|(k, _)| k == id)
            .map(|(_, at)| *at)
    });
    // A create does not know its sandbox's id until it answers: any QEMU killed while
    // it ran may have been its own (killed while it booted).
    let killed_around = match &a.sandbox {
        Some(_) => killed.is_some_and(|at| at <= a.end && a.start <= at + KILL_GRACE),
        None => f
            .qemu_kills
            .iter()
            .any(|(_, at)| a.start <= *at && *at <= a.end),
    };
    let crashed_since = |since: Instant| f.server_down.iter().any(|(t0, _)| *t0 >= since);
    let Some(status) = a.status else {
        return if within(&f.server_down, a, Duration::ZERO) {
            Ok(Some("no answer: server SIGKILLed"))
        } else {
            Err("no answer outside a server restart".into())
        };
    };
    let msg = a.message.as_str();
    match status {
        200..=299 => Ok(None),
        404 if a.sandbox.is_some() => {
            let (seen, paused) = a.seen.unwrap();
            if killed.is_some() && (msg.contains("died") || crashed_since(seen)) {
                Ok(Some("404: its QEMU was killed"))
            } else if killed.is_some() {
                Err("404 for a killed QEMU without saying it died".into())
            } else if crashed_since(seen) && !paused {
                Ok(Some("404: running at a server SIGKILL"))
            } else {
                Err("404 for a sandbox no fault removed".into())
            }
        }
        429 => Ok(Some("429: admission")),
        507 if within(&f.disk_full, a, DISK_GRACE) => Ok(Some("507: disk full")),
        502 if msg.contains("custom extension hook start-")
            && within(&f.hook_errors, a, Duration::ZERO) =>
        {
            Ok(Some("502: extension failing"))
        }
        500..=599 if killed_around => Ok(Some("5xx: its QEMU was killed")),
        502 if msg.contains("not found")
            && (killed.is_some() || a.seen.is_some_and(|(s, _)| crashed_since(s))) =>
        {
            Ok(Some("502: envd proxy, sandbox gone"))
        }
        _ => Err(format!("{status} unexplained")),
    }
}

/// Every start the extension received has a stop for its pair answered 2xx, only one
/// unless a server SIGKILL came between (custom-extension.md §4.7), and no stop names a
/// pair never started (§4.5). The one exception, counted apart: a stop whose retry was cut
/// short by a newer start of its sandbox, whose final attempt failed too (§6.2, §8.4).
fn pairing(ext: &Extension, f: &Faults, log: &str) -> (Vec<String>, usize) {
    let starts: Vec<Recorded> = ["start-fresh", "start-resume"]
        .iter()
        .flat_map(|h| ext.requests_for(h))
        .collect();
    let mut given_up = 0;
    let key = |r: &Recorded| (r.sandbox_id().to_string(), r.instance_id().to_string());
    let mut stops: HashMap<(String, String), Vec<Recorded>> = HashMap::new();
    for stop in ext.requests_for("stop") {
        stops.entry(key(&stop)).or_default().push(stop);
    }
    let mut bad = Vec::new();
    let mut started = std::collections::HashSet::new();
    for start in &starts {
        let pair = key(start);
        started.insert(pair.clone());
        let delivered: Vec<&Recorded> = stops
            .get(&pair)
            .map(|v| {
                v.iter()
                    .filter(|r| ext.answer_of(r).is_some_and(|c| (200..300).contains(&c)))
                    .collect()
            })
            .unwrap_or_default();
        let crash_between = |a: &Recorded, b: &Recorded| {
            f.server_down
                .iter()
                .any(|(t0, _)| *t0 >= a.at && *t0 <= b.at)
        };
        match delivered.as_slice() {
            [] if given_up_for_newer_start(&pair, stops.get(&pair), &starts, log) => given_up += 1,
            [] => bad.push(format!("{} {pair:?}: no stop delivered", start.hook)),
            [_] => {}
            [first, rest @ ..] if rest.iter().all(|r| crash_between(first, r)) => {}
            many => bad.push(format!(
                "{} {pair:?}: {} stops delivered with no crash between",
                start.hook,
                many.len()
            )),
        }
    }
    for pair in stops.keys().filter(|p| !started.contains(*p)) {
        bad.push(format!("a stop for {pair:?}, never started"));
    }
    (bad, given_up)
}

/// Whether the stop of `pair` was given up as §6.2 says: fewer than the four attempts, the
/// last one made right before a newer start of the same sandbox went out, and the server
/// logged giving it up.
fn given_up_for_newer_start(
    (sandbox, instance): &(String, String),
    attempts: Option<&Vec<Recorded>>,
    starts: &[Recorded],
    log: &str,
) -> bool {
    let Some(last) = attempts.and_then(|a| a.iter().max_by_key(|r| r.at)) else {
        return false;
    };
    let logged = format!("stop hook given up sandboxId={sandbox} sandboxInstanceId={instance} ");
    attempts.is_some_and(|a| a.len() < 4)
        && log.contains(&logged)
        && starts
            .iter()
            .any(|s| s.sandbox_id() == sandbox && s.instance_id() != instance && s.at >= last.at)
}
