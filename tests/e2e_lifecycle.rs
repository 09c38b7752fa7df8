//! End-to-end lifecycle against the real server, real VMs and a real recording extension:
//! pause/resume keep memory, disk and params and change the instance; snapshots fire no
//! hook; sandboxes from a snapshot inherit or override params and see the disk as of the
//! capture; fork children; a graceful restart keeps paused sandboxes; concurrent
//! lifecycle calls never answer 500; templates built from images.
//!
//! Fixture: one server and one recording extension shared by every test but the restart
//! (see [`shared`]), and on it one snapshot of a cold-booted sandbox that tests restore
//! their sandboxes from. Each test makes its own sandboxes and looks only at the hooks for
//! them. The restart test owns a server: it takes [`Shared::alone`], so it runs alone.

mod common;

use common::extension::{Extension, Recorded};
use common::shared::{assert_server_left_nothing, lock, stop_shared_server, Hold, Origin, Shared};
use common::*;
use serde_json::{json, Value};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The server every test but the restart shares.
static SHARED: Shared<Fixture> = Shared::new();

/// Template builds take turns: the build test counts the build hooks of the window it ran.
static BUILDS: Mutex<()> = Mutex::new(());

/// The snapshot [`Fixture::restored_sandbox`] restores from.
const ORIGIN: &str = "origin";

struct Fixture {
    server: Server,
    ext: Extension,
    origin: Origin,
}

impl common::shared::Fixture for Fixture {
    fn start() -> Fixture {
        let ext = Extension::start();
        let server = Server::start(&ext.config());
        Fixture {
            server,
            ext,
            origin: Origin::new(ORIGIN),
        }
    }

    /// Stops the server; unless a test failed, checks that nothing of it is left.
    fn stop(self, failed: bool) {
        if !failed {
            self.origin.delete(&self.server);
        }
        stop_shared_server(self.server, failed);
    }
}

impl Fixture {
    /// A running sandbox with [`params`], restored from a snapshot of a cold-booted
    /// sandbox whose /root holds only `d` ("disk").
    fn restored_sandbox(&self) -> String {
        let boot = |s: &Server| {
            let id = cold_boot(s);
            sh(s, &id, "echo disk > /root/d");
            id
        };
        let extra = json!({ "customExtensionParams": params() });
        self.origin.restore(&self.server, boot, extra)
    }
}

/// A hold on the shared server (started by the first test that asks).
fn shared() -> Hold<Fixture> {
    SHARED.hold()
}

fn params() -> Value {
    json!({"vpn": {"peers": ["10.8.0.2"]}})
}

/// A sandbox cold-booted from the base image with [`params`]. Every cold boot in this
/// file passes params: only template builds start with `{}`.
fn cold_boot(s: &Server) -> String {
    id_of(&s.create(json!({
        "image": base_image(), "timeout": 600, "customExtensionParams": params()
    })))
}

/// A sandbox from snapshot or template `template` (a name or an id).
fn from_snapshot(s: &Server, template: impl Into<Value>, params: Value) -> String {
    let body =
        json!({"templateID": template.into(), "timeout": 600, "customExtensionParams": params});
    let (code, v) = s.call("POST", "/sandboxes", Some(body));
    assert_eq!(code, 201, "{v}");
    id_of(&v)
}

fn snapshot(s: &Server, id: &str, name: &str) -> Value {
    let body = json!({ "name": name });
    let (code, snap) = s.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body));
    assert_eq!(code, 201, "{snap}");
    snap
}

fn fork(s: &Server, parent: &str, count: usize) -> Vec<String> {
    let body = json!({ "count": count });
    let (code, kids) = s.call("POST", &format!("/sandboxes/{parent}/fork"), Some(body));
    assert_eq!(code, 201, "{kids}");
    let kids = kids.as_array().unwrap();
    kids.iter().map(|k| id_of(&k["sandbox"])).collect()
}

fn status_code(s: &Server, method: &str, path: &str) -> u16 {
    s.call(method, path, None).0
}

fn delete(s: &Server, ids: &[&str]) {
    for id in ids {
        assert_eq!(status_code(s, "DELETE", &format!("/sandboxes/{id}")), 204);
    }
}

/// Starts `sleep 1000` in the background; its pid.
fn background_sleep(s: &Server, id: &str) -> String {
    sh(s, id, "sleep 1000 >/dev/null 2>&1 & echo $!")
        .trim()
        .to_string()
}

fn alive(s: &Server, id: &str, pid: &str) -> bool {
    sh(s, id, &format!("kill -0 {pid} && echo alive")) == "alive\n"
}

/// Every hook request about sandbox `id`.
fn hooks_for(ext: &Extension, id: &str) -> Vec<Recorded> {
    let all = ext.requests();
    all.into_iter().filter(|r| r.sandbox_id() == id).collect()
}

/// The `hook` requests about sandbox `id`.
fn hook_for(ext: &Extension, hook: &str, id: &str) -> Vec<Recorded> {
    let all = ext.requests_for(hook);
    all.into_iter().filter(|r| r.sandbox_id() == id).collect()
}

fn stop_reason(r: &Recorded) -> Option<&str> {
    r.header("X-Agentenv-Stop-Reason")
}

#[test]
fn pause_keeps_memory_disk_and_params_and_changes_the_instance() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let id = cold_boot(s);
    let fresh = hook_for(ext, "start-fresh", &id);
    assert_eq!(fresh.len(), 1);
    let first_instance = fresh[0].instance_id().to_string();
    let pid = background_sleep(s, &id);
    sh(s, &id, "echo mem > /dev/shm/m; echo disk > /root/d");

    // Pause: a stop with the same pair, state paused, no VM.
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let stops = hook_for(ext, "stop", &id);
    assert_eq!(stops.len(), 1);
    assert_eq!(stops[0].instance_id(), first_instance);
    assert_eq!(stop_reason(&stops[0]), Some("pause"));
    let (_, d) = s.call("GET", &format!("/sandboxes/{id}"), None);
    assert_eq!(d["state"], "paused");
    assert!(
        qemu_processes_with(&id).is_empty(),
        "a paused sandbox has no VM"
    );

    // Resume after 10 s: new instance after the stop, memory, disk, params and clock kept.
    std::thread::sleep(Duration::from_secs(10));
    let connect = json!({"timeout": 600});
    let (code, v) = s.call("POST", &format!("/sandboxes/{id}/connect"), Some(connect));
    assert_eq!(code, 201, "{v}");
    let resumes = hook_for(ext, "start-resume", &id);
    assert_eq!(resumes.len(), 1);
    assert_ne!(resumes[0].instance_id(), first_instance);
    assert!(resumes[0].seq > stops[0].seq, "stop before start-resume");
    assert_eq!(resumes[0].body["customExtensionParams"], params());
    assert!(alive(s, &id, &pid));
    assert_eq!(sh(s, &id, "cat /dev/shm/m /root/d"), "mem\ndisk\n");
    let guest: i64 = sh(s, &id, "date +%s").trim().parse().unwrap();
    let host = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest - host).abs() <= 2,
        "guest clock {guest} vs host {host}"
    );
    delete(s, &[&id]);
}

#[test]
fn a_paused_sandbox_refuses_commands_snapshots_and_param_patches_with_409() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let id = f.restored_sandbox();
    assert_eq!(
        status_code(s, "POST", &format!("/sandboxes/{id}/pause")),
        204
    );
    let hooks_before = hooks_for(ext, &id).len();
    assert_eq!(
        status_code(s, "POST", &format!("/sandboxes/{id}/pause")),
        204
    );
    assert_eq!(
        hooks_for(ext, &id).len(),
        hooks_before,
        "pause of a paused sandbox fires nothing"
    );
    let cmd = json!({"cmd": "true"});
    let commands = s.call("POST", &format!("/sandboxes/{id}/commands"), Some(cmd));
    assert_eq!(commands.0, 409);
    assert_eq!(
        status_code(s, "POST", &format!("/sandboxes/{id}/snapshots")),
        409
    );
    let path = format!("/sandboxes/{id}/custom-extension-params");
    assert_eq!(s.call("PATCH", &path, Some(json!({"x": 1}))).0, 409);
    let (code, p) = s.call("GET", &path, None);
    assert_eq!((code, &p), (200, &params()));
    delete(s, &[&id]);
}

#[test]
fn connect_on_a_running_sandbox_only_extends_its_ttl() {
    let f = shared();
    let s = &f.server;
    let id = f.restored_sandbox();
    let connect = json!({"timeout": 600});
    let (code, _) = s.call("POST", &format!("/sandboxes/{id}/connect"), Some(connect));
    assert_eq!(
        code, 200,
        "connect on a running sandbox only extends its TTL"
    );
    delete(s, &[&id]);
}

#[test]
fn snapshots_fire_no_hook_and_their_names_are_unique() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let id = f.restored_sandbox();
    let hooks_before = hooks_for(ext, &id).len();
    let snap = snapshot(s, &id, "unique");
    assert_eq!(snap["names"], json!(["unique"]));
    assert_eq!(
        hooks_for(ext, &id).len(),
        hooks_before,
        "snapshot fires nothing"
    );
    let again = json!({"name": "unique"});
    let (code, _) = s.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(again));
    assert_eq!(code, 409);
    let (code, got) = s.call("GET", "/snapshots/unique", None);
    assert_eq!((code, &got["snapshotID"]), (200, &snap["snapshotID"]));
    delete(s, &[&id]);
    assert_eq!(status_code(s, "DELETE", "/templates/unique"), 204);
}

#[test]
fn sandboxes_from_a_snapshot_inherit_or_override_params_and_see_the_disk_as_of_the_capture() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let parent = f.restored_sandbox();
    let pid = background_sleep(s, &parent);
    let snap = snapshot(s, &parent, "tpl1");
    sh(s, &parent, "echo later > /root/after");

    // `{}` inherits the params, others override.
    let inherit = from_snapshot(s, "tpl1", json!({}));
    let over = from_snapshot(s, snap["snapshotID"].clone(), json!({"y": 2}));
    let resume_of = |id: &str| hook_for(ext, "start-resume", id).remove(0);
    assert_eq!(resume_of(&inherit).body["customExtensionParams"], params());
    assert_eq!(
        resume_of(&over).body["customExtensionParams"],
        json!({"y": 2})
    );
    let path = format!("/sandboxes/{inherit}/custom-extension-params");
    assert_eq!(s.call("GET", &path, None).1, params());
    let script = format!("kill -0 {pid} && echo alive; cat /root/d; ls /root");
    assert_eq!(sh(s, &inherit, &script), "alive\ndisk\nd\n");
    let (_, d) = s.call("GET", &format!("/sandboxes/{inherit}"), None);
    assert_eq!(d["templateID"], snap["snapshotID"]);
    assert_eq!(d["alias"], "tpl1");
    for id in [&inherit, &over] {
        let fresh = hook_for(ext, "start-fresh", id);
        assert!(fresh.is_empty(), "a template never cold-boots");
    }
    delete(s, &[&parent, &inherit, &over]);
    assert_eq!(status_code(s, "DELETE", "/templates/tpl1"), 204);
}

#[test]
fn fork_children_get_new_ids_the_parents_params_and_disks_of_their_own() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let parent = f.restored_sandbox();
    sh(s, &parent, "echo later > /root/after");
    // The parent keeps its instance: no stop for it.
    let stops_before = hook_for(ext, "stop", &parent).len();
    let kids = fork(s, &parent, 2);
    assert_eq!(kids.len(), 2);
    assert!(kids.iter().all(|k| *k != parent));
    for k in &kids {
        let resume = hook_for(ext, "start-resume", k).remove(0);
        assert_eq!(resume.body["customExtensionParams"], params());
    }
    assert_eq!(hook_for(ext, "stop", &parent).len(), stops_before);
    sh(s, &kids[0], "echo mine > /root/kid");
    assert_eq!(sh(s, &kids[1], "ls /root"), "after\nd\n");
    assert_eq!(sh(s, &parent, "ls /root"), "after\nd\n");
    delete(s, &[&parent, &kids[0], &kids[1]]);
}

#[test]
fn concurrent_pause_connect_and_delete_never_answer_500() {
    let f = shared();
    let s = &f.server;
    let parent = f.restored_sandbox();
    let target = fork(s, &parent, 1).remove(0);
    let codes: Vec<u16> = std::thread::scope(|sc| {
        let t = &target;
        let calls = [
            sc.spawn(move || status_code(s, "POST", &format!("/sandboxes/{t}/pause"))),
            sc.spawn(move || {
                let body = json!({"timeout": 60});
                s.call("POST", &format!("/sandboxes/{t}/connect"), Some(body))
                    .0
            }),
            sc.spawn(move || status_code(s, "DELETE", &format!("/sandboxes/{t}"))),
        ];
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Answers from the table only.
    assert!(
        codes.iter().all(|c| [200, 201, 204, 404, 409].contains(c)),
        "{codes:?}"
    );
    assert!(!codes.contains(&500));
    let after = status_code(s, "GET", &format!("/sandboxes/{target}"));
    assert_eq!(after, 404, "{codes:?}");
    delete(s, &[&parent]);
}

/// Running sandboxes (cold-booted, from a snapshot, forked) are paused at a graceful stop
/// (stop reason shutdown) and come back paused with their params and processes; deleting
/// their snapshot then never breaks them. Owns its server: the restart would stop every
/// other test's sandboxes.
#[test]
fn a_graceful_restart_keeps_paused_sandboxes_even_after_their_snapshot_is_deleted() {
    let _alone = SHARED.alone();
    let ext = Extension::start();
    let mut s = Server::start(&ext.config());
    let parent = cold_boot(&s);
    let pid = background_sleep(&s, &parent);
    sh(&s, &parent, "echo disk > /root/d");
    snapshot(&s, &parent, "tpl1");
    let inherit = from_snapshot(&s, "tpl1", json!({}));
    let over = from_snapshot(&s, "tpl1", json!({"y": 2}));
    let kid = fork(&s, &parent, 1).remove(0);

    s.stop();
    let shutdown_stops = ext
        .requests_for("stop")
        .into_iter()
        .filter(|r| stop_reason(r) == Some("shutdown"))
        .count();
    assert_eq!(
        shutdown_stops, 4,
        "parent, two from the snapshot, one fork child"
    );
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    s.spawn();
    let (_, list) = s.call("GET", "/v2/sandboxes?state=paused", None);
    assert_eq!(list.as_array().unwrap().len(), 4, "{list}");
    let path = format!("/sandboxes/{parent}/custom-extension-params");
    assert_eq!(s.call("GET", &path, None).1, params());
    assert_eq!(
        status_code(&s, "POST", &format!("/sandboxes/{parent}/resume")),
        201
    );
    assert!(alive(&s, &parent, &pid));

    // Deleting the snapshot never breaks sandboxes made from it.
    assert_eq!(status_code(&s, "DELETE", "/templates/tpl1"), 204);
    assert_eq!(status_code(&s, "GET", "/snapshots/tpl1"), 404);
    assert_eq!(
        status_code(&s, "POST", &format!("/sandboxes/{inherit}/resume")),
        201
    );
    assert_eq!(sh(&s, &inherit, "cat /root/d"), "disk\n");

    delete(&s, &[&parent, &inherit, &over, &kid]);
    s.stop();
    assert_server_left_nothing(&s);
}

/// `POST /templates`: a build boots the image (start-fresh with `{}`), runs startCmd,
/// captures and stops (reason template-build); sandboxes start from it by name. A failing
/// startCmd ends in `error` with the exit code and stderr.
#[test]
fn a_template_build_boots_runs_start_cmd_and_stops_and_a_failing_one_ends_in_error() {
    let f = shared();
    let (s, ext) = (&f.server, &f.ext);
    let _builds = lock(&BUILDS);
    let seen_before = ext.requests().len();
    let (code, t) = s.call("POST", "/templates", Some(template_body("built")));
    assert_eq!(code, 202, "{t}");
    let status = t["buildStatus"].as_str().unwrap();
    assert!(["waiting", "building"].contains(&status), "{t}");
    let again = json!({"name": "built", "image": base_image()});
    assert_eq!(
        s.call("POST", "/templates", Some(again)).0,
        409,
        "names are unique"
    );
    let broken = json!({"name": "broken", "image": base_image(), "memoryMB": 256,
        "cpuCount": 1, "diskSizeMB": 1024, "startCmd": "echo oops >&2; exit 3"});
    let (code, bad) = s.call("POST", "/templates", Some(broken));
    assert_eq!(code, 202, "{bad}");
    let status = |name: &str| s.call("GET", &format!("/templates/{name}"), None).1;
    assert!(
        wait_until(Duration::from_secs(90), || status("built")["buildStatus"]
            == "ready"
            && status("broken")["buildStatus"] == "error"),
        "{} {}",
        status("built"),
        status("broken")
    );
    let reason = status("broken")["reason"].as_str().unwrap().to_string();
    assert!(
        reason.contains("code 3") && reason.contains("oops"),
        "{reason}"
    );
    // Every other cold boot here passes params: the `{}` ones are the two builds.
    let seen = ext.requests()[seen_before..].to_vec();
    let fresh: Vec<&Recorded> = seen
        .iter()
        .filter(|r| r.hook == "start-fresh" && r.body["customExtensionParams"] == json!({}))
        .collect();
    assert_eq!(fresh.len(), 2);
    for r in fresh {
        let stop = ext
            .requests_for("stop")
            .into_iter()
            .find(|st| st.instance_id() == r.instance_id())
            .expect("the build sandbox was stopped");
        assert_eq!(stop_reason(&stop), Some("template-build"));
    }
    let (_, list) = s.call("GET", "/templates", None);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let snapshot_of_build = s.call("GET", "/snapshots/built", None).0;
    assert_eq!(snapshot_of_build, 404, "a build is not a snapshot");
    let id = from_template(s, "built");
    let script = "cat /root/built; pidof sleep >/dev/null && echo running";
    assert_eq!(sh(s, &id, script), "template\nrunning\n");
    delete(s, &[&id]);
    for name in ["built", "broken"] {
        assert_eq!(s.call("DELETE", &format!("/templates/{name}"), None).0, 204);
        assert_eq!(s.call("GET", &format!("/templates/{name}"), None).0, 404);
    }
}

/// The template's RAM file is mapped copy-on-write by the clone; a pause saves only the
/// device state and the pages the clone changed (dirty-only), and links the template's
/// files into the sandbox's dir, so it resumes even after the template is gone.
#[test]
fn a_template_clone_pause_writes_only_changed_pages_and_outlives_its_template() {
    let f = shared();
    let s = &f.server;
    let _builds = lock(&BUILDS);
    let (code, t) = s.call("POST", "/templates", Some(template_body("cow")));
    assert_eq!(code, 202, "{t}");
    let ready = wait_until(Duration::from_secs(90), || {
        s.call("GET", "/templates/cow", None).1["buildStatus"] == "ready"
    });
    assert!(ready, "template cow not ready:\n{}", s.log());
    let id = from_template(s, "cow");
    sh(s, &id, "echo clone > /dev/shm/c");
    let paused = s.state_dir.join("sandboxes").join(&id).join("paused");
    let written = |what: &str| -> u64 {
        ["state.bin", "memory.pages"]
            .iter()
            .map(|f| {
                std::fs::metadata(paused.join(f))
                    .unwrap_or_else(|e| panic!("{what}: {}/{f}: {e}", paused.display()))
                    .len()
            })
            .sum()
    };
    let pause = format!("/sandboxes/{id}/pause");
    let resume = format!("/sandboxes/{id}/resume");
    assert_eq!(s.call("POST", &pause, None).0, 204);
    let idle = written("idle pause");
    assert!(
        idle < 24 << 20,
        "an idle template clone's pause wrote {idle} bytes"
    );
    assert_eq!(s.call("DELETE", "/templates/cow", None).0, 204);
    let everything = "cat /root/built /dev/shm/c; pidof sleep >/dev/null && echo running";
    // Round 0: 8 MiB the template never had, then a pause that writes them.
    assert_eq!(s.call("POST", &resume, None).0, 201);
    assert_eq!(
        sh(s, &id, everything),
        "template\nclone\nrunning\n",
        "round 0"
    );
    let random = "head -c 8388608 /dev/urandom > /dev/shm/r; md5sum /dev/shm/r > /root/r.md5";
    sh(s, &id, random);
    assert_eq!(s.call("POST", &pause, None).0, 204);
    let busy = written("pause after 8 MiB");
    assert!(
        busy >= idle + (8 << 20),
        "{busy} bytes after 8 MiB, {idle} idle"
    );
    // Round 1: they come back on the next resume.
    assert_eq!(s.call("POST", &resume, None).0, 201);
    assert_eq!(
        sh(s, &id, everything),
        "template\nclone\nrunning\n",
        "round 1"
    );
    let same = sh(s, &id, "md5sum -c /root/r.md5 >/dev/null && echo same");
    assert_eq!(same, "same\n");
    delete(s, &[&id]);
    assert_eq!(s.call("DELETE", "/templates/cow", None).0, 204);
    assert_eq!(s.call("GET", "/templates/cow", None).0, 404);
}

fn template_body(name: &str) -> Value {
    json!({
        "name": name, "image": base_image(), "memoryMB": 256, "cpuCount": 1,
        "diskSizeMB": 1024, "envVars": {"WHO": "template"},
        "startCmd": "echo $WHO > /root/built; sleep 1000 >/dev/null 2>&1 &"
    })
}

/// A sandbox from template `name`, timeout 60 s.
fn from_template(s: &Server, name: &str) -> String {
    let body = json!({"templateID": name, "timeout": 60});
    let (code, v) = s.call("POST", "/sandboxes", Some(body));
    assert_eq!(code, 201, "{v}");
    id_of(&v)
}
