//! End-to-end lifecycle against the real server, real VMs and a real recording extension:
//! pause/resume keep memory, disk and params and change the instance; snapshots fire no
//! hook; sandboxes from a snapshot inherit or override params and see the disk as of the
//! capture; fork children; a graceful restart keeps paused sandboxes; concurrent
//! lifecycle calls never answer 500. One cold boot serves every assertion.

mod common;

use common::extension::Extension;
use common::*;
use serde_json::json;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[test]
fn lifecycle_end_to_end() {
    let ext = Extension::start();
    let mut s = Server::start(&format!(
        "[custom_extension]\nurl = \"{}\"\ntimeout_ms = 3000\n",
        ext.url()
    ));
    let params = json!({"vpn": {"peers": ["10.8.0.2"]}});
    let parent = id_of(&s.create(json!({
        "image": base_image(), "timeout": 600, "customExtensionParams": params
    })));
    let fresh = ext.wait_for("start-fresh", 1, Duration::from_secs(5));
    let first_instance = fresh[0].instance_id().to_string();

    let pid = sh(&s, &parent, "sleep 1000 >/dev/null 2>&1 & echo $!")
        .trim()
        .to_string();
    sh(&s, &parent, "echo mem > /dev/shm/m; echo disk > /root/d");

    // Pause: stop with the same pair, state paused, idempotent, wrong-state calls 409.
    let (code, v) = s.call("POST", &format!("/sandboxes/{parent}/pause"), None);
    assert_eq!(code, 204, "{v}");
    let stops = ext.requests_for("stop");
    assert_eq!(stops.len(), 1);
    assert_eq!(stops[0].instance_id(), first_instance);
    assert_eq!(stops[0].header("X-Agentenv-Stop-Reason"), Some("pause"));
    let (_, d) = s.call("GET", &format!("/sandboxes/{parent}"), None);
    assert_eq!(d["state"], "paused");
    let hooks_before = ext.requests().len();
    assert_eq!(
        s.call("POST", &format!("/sandboxes/{parent}/pause"), None)
            .0,
        204
    );
    assert_eq!(
        ext.requests().len(),
        hooks_before,
        "pause of a paused sandbox fires nothing"
    );
    let cmd = json!({"cmd": "true"});
    assert_eq!(
        s.call("POST", &format!("/sandboxes/{parent}/commands"), Some(cmd))
            .0,
        409
    );
    assert_eq!(
        s.call("POST", &format!("/sandboxes/{parent}/snapshots"), None)
            .0,
        409
    );
    let patch = json!({"x": 1});
    assert_eq!(
        s.call(
            "PATCH",
            &format!("/sandboxes/{parent}/custom-extension-params"),
            Some(patch)
        )
        .0,
        409
    );
    let (code, p) = s.call(
        "GET",
        &format!("/sandboxes/{parent}/custom-extension-params"),
        None,
    );
    assert_eq!((code, &p), (200, &params));
    assert!(
        qemu_processes_with(&parent).is_empty(),
        "a paused sandbox has no VM"
    );

    // Resume after 10 s: new instance after the stop, memory, disk, params and clock kept.
    std::thread::sleep(Duration::from_secs(10));
    let (code, v) = s.call(
        "POST",
        &format!("/sandboxes/{parent}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert_eq!(code, 201, "{v}");
    let resumes = ext.requests_for("start-resume");
    assert_eq!(resumes.len(), 1);
    let resumed_instance = resumes[0].instance_id().to_string();
    assert_ne!(resumed_instance, first_instance);
    assert!(resumes[0].seq > stops[0].seq, "stop before start-resume");
    assert_eq!(resumes[0].body["customExtensionParams"], params);
    assert_eq!(
        sh(&s, &parent, &format!("kill -0 {pid} && echo alive")),
        "alive\n"
    );
    assert_eq!(sh(&s, &parent, "cat /dev/shm/m /root/d"), "mem\ndisk\n");
    let guest: i64 = sh(&s, &parent, "date +%s").trim().parse().unwrap();
    let host = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (guest - host).abs() <= 2,
        "guest clock {guest} vs host {host}"
    );
    let (code, _) = s.call(
        "POST",
        &format!("/sandboxes/{parent}/connect"),
        Some(json!({"timeout": 600})),
    );
    assert_eq!(
        code, 200,
        "connect on a running sandbox only extends its TTL"
    );

    // Snapshot: no hook, same instance; a name is unique.
    let hooks_before = ext.requests().len();
    let (code, snap) = s.call(
        "POST",
        &format!("/sandboxes/{parent}/snapshots"),
        Some(json!({"name": "tpl1"})),
    );
    assert_eq!(code, 201, "{snap}");
    assert_eq!(snap["names"], json!(["tpl1"]));
    assert_eq!(ext.requests().len(), hooks_before, "snapshot fires nothing");
    let (code, _) = s.call(
        "POST",
        &format!("/sandboxes/{parent}/snapshots"),
        Some(json!({"name": "tpl1"})),
    );
    assert_eq!(code, 409);
    let (code, got) = s.call("GET", "/snapshots/tpl1", None);
    assert_eq!((code, &got["snapshotID"]), (200, &snap["snapshotID"]));
    sh(&s, &parent, "echo later > /root/after");

    // From the snapshot: `{}` inherits the params, others override; disk as of capture.
    let inherit = id_of(
        &s.call(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": "tpl1", "timeout": 600, "customExtensionParams": {}})),
        )
        .1,
    );
    let over = id_of(&s.call("POST", "/sandboxes", Some(json!({"templateID": snap["snapshotID"], "timeout": 600, "customExtensionParams": {"y": 2}}))).1);
    let by_sandbox = |id: &str| {
        ext.requests_for("start-resume")
            .into_iter()
            .find(|r| r.sandbox_id() == id)
            .unwrap_or_else(|| panic!("no start-resume for {id}"))
    };
    assert_eq!(by_sandbox(&inherit).body["customExtensionParams"], params);
    assert_eq!(
        by_sandbox(&over).body["customExtensionParams"],
        json!({"y": 2})
    );
    assert_eq!(
        s.call(
            "GET",
            &format!("/sandboxes/{inherit}/custom-extension-params"),
            None
        )
        .1,
        params
    );
    assert_eq!(
        sh(
            &s,
            &inherit,
            &format!("kill -0 {pid} && echo alive; cat /root/d; ls /root")
        ),
        "alive\ndisk\nd\n"
    );
    let (_, d) = s.call("GET", &format!("/sandboxes/{inherit}"), None);
    assert_eq!(d["templateID"], snap["snapshotID"]);
    assert_eq!(d["alias"], "tpl1");
    assert!(
        ext.requests_for("start-fresh").len() == 1,
        "a template never cold-boots"
    );

    // Fork: two children, new ids, the parent's params, independent disks; the parent
    // keeps its instance (no stop for it).
    let stops_before = ext.requests_for("stop").len();
    let (code, kids) = s.call(
        "POST",
        &format!("/sandboxes/{parent}/fork"),
        Some(json!({"count": 2})),
    );
    assert_eq!(code, 201, "{kids}");
    let kids: Vec<String> = kids
        .as_array()
        .unwrap()
        .iter()
        .map(|k| id_of(&k["sandbox"]))
        .collect();
    assert_eq!(kids.len(), 2);
    assert!(kids.iter().all(|k| *k != parent));
    for k in &kids {
        assert_eq!(by_sandbox(k).body["customExtensionParams"], params);
    }
    assert_eq!(ext.requests_for("stop").len(), stops_before);
    sh(&s, &kids[0], "echo mine > /root/kid");
    assert_eq!(sh(&s, &kids[1], "ls /root"), "after\nd\n");
    assert_eq!(sh(&s, &parent, "ls /root"), "after\nd\n");

    // Concurrent pause + connect + delete on one sandbox: answers from the table only.
    let target = kids[1].clone();
    let codes: Vec<u16> = std::thread::scope(|sc| {
        let s = &s;
        let t = &target;
        let calls = [
            sc.spawn(move || s.call("POST", &format!("/sandboxes/{t}/pause"), None).0),
            sc.spawn(move || {
                s.call(
                    "POST",
                    &format!("/sandboxes/{t}/connect"),
                    Some(json!({"timeout": 60})),
                )
                .0
            }),
            sc.spawn(move || s.call("DELETE", &format!("/sandboxes/{t}"), None).0),
        ];
        calls.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        codes.iter().all(|c| [200, 201, 204, 404, 409].contains(c)),
        "{codes:?}"
    );
    assert!(!codes.contains(&500));
    assert_eq!(
        s.call("GET", &format!("/sandboxes/{target}"), None).0,
        404,
        "{codes:?}"
    );

    // Graceful restart: running sandboxes are paused (stop reason shutdown) and come back
    // paused with their params.
    s.stop();
    let shutdown_stops = ext
        .requests_for("stop")
        .into_iter()
        .filter(|r| r.header("X-Agentenv-Stop-Reason") == Some("shutdown"))
        .count();
    assert_eq!(
        shutdown_stops, 4,
        "parent, two from the snapshot, one fork child"
    );
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    s.spawn();
    let (_, list) = s.call("GET", "/v2/sandboxes?state=paused", None);
    assert_eq!(list.as_array().unwrap().len(), 4, "{list}");
    assert_eq!(
        s.call(
            "GET",
            &format!("/sandboxes/{parent}/custom-extension-params"),
            None
        )
        .1,
        params
    );
    let (code, _) = s.call("POST", &format!("/sandboxes/{parent}/resume"), None);
    assert_eq!(code, 201);
    assert_eq!(
        sh(&s, &parent, &format!("kill -0 {pid} && echo alive")),
        "alive\n"
    );

    // Deleting the template never breaks sandboxes made from it.
    assert_eq!(s.call("DELETE", "/templates/tpl1", None).0, 204);
    assert_eq!(s.call("GET", "/snapshots/tpl1", None).0, 404);
    let (code, _) = s.call("POST", &format!("/sandboxes/{inherit}/resume"), None);
    assert_eq!(code, 201);
    assert_eq!(sh(&s, &inherit, "cat /root/d"), "disk\n");

    templates_from_images(&s, &ext);

    for id in [&parent, &inherit, &over, &kids[0]] {
        assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    }
    s.stop();
    assert!(files_under(&s.state_dir.join("sandboxes")).is_empty());
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
}

/// `POST /templates`: a build boots the image (start-fresh with `{}`), runs startCmd,
/// captures and stops (reason template-build); sandboxes start from it by name. A failing
/// startCmd ends in `error` with the exit code and stderr.
fn templates_from_images(s: &Server, ext: &Extension) {
    let fresh_before = ext.requests_for("start-fresh").len();
    let (code, t) = s.call(
        "POST",
        "/templates",
        Some(json!({
            "name": "built", "image": base_image(), "memoryMB": 256, "cpuCount": 1,
            "diskSizeMB": 1024, "envVars": {"WHO": "template"},
            "startCmd": "echo $WHO > /root/built; sleep 1000 >/dev/null 2>&1 &"
        })),
    );
    assert_eq!(code, 202, "{t}");
    assert!(
        ["waiting", "building"].contains(&t["buildStatus"].as_str().unwrap()),
        "{t}"
    );
    let (code, _) = s.call(
        "POST",
        "/templates",
        Some(json!({"name": "built", "image": base_image()})),
    );
    assert_eq!(code, 409, "names are unique");
    let (code, bad) = s.call(
        "POST",
        "/templates",
        Some(
            json!({"name": "broken", "image": base_image(), "memoryMB": 256, "cpuCount": 1,
                    "diskSizeMB": 1024, "startCmd": "echo oops >&2; exit 3"}),
        ),
    );
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
    let fresh = ext.requests_for("start-fresh");
    assert_eq!(fresh.len(), fresh_before + 2);
    for r in &fresh[fresh_before..] {
        assert_eq!(r.body["customExtensionParams"], json!({}));
        let stop = ext
            .requests_for("stop")
            .into_iter()
            .find(|st| st.instance_id() == r.instance_id())
            .expect("the build sandbox was stopped");
        assert_eq!(
            stop.header("X-Agentenv-Stop-Reason"),
            Some("template-build")
        );
    }
    let (_, list) = s.call("GET", "/templates", None);
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    assert_eq!(
        s.call("GET", "/snapshots/built", None).0,
        404,
        "a build is not a snapshot"
    );
    let id = id_of(
        &s.call(
            "POST",
            "/sandboxes",
            Some(json!({"templateID": "built", "timeout": 60})),
        )
        .1,
    );
    assert_eq!(
        sh(
            s,
            &id,
            "cat /root/built; pidof sleep >/dev/null && echo running"
        ),
        "template\nrunning\n"
    );
    // The template's RAM file is mapped copy-on-write by the clone; a pause saves only
    // the device state and the pages the clone changed (dirty-only), and links the
    // template's files into the sandbox's dir, so it resumes even after the template is
    // gone.
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
    assert_eq!(
        s.call("POST", &format!("/sandboxes/{id}/pause"), None).0,
        204
    );
    let idle = written("idle pause");
    assert!(
        idle < 24 << 20,
        "an idle template clone's pause wrote {idle} bytes"
    );
    assert_eq!(s.call("DELETE", "/templates/built", None).0, 204);
    for round in 0..2 {
        assert_eq!(
            s.call("POST", &format!("/sandboxes/{id}/resume"), None).0,
            201
        );
        assert_eq!(
            sh(
                s,
                &id,
                "cat /root/built /dev/shm/c; pidof sleep >/dev/null && echo running"
            ),
            "template\nclone\nrunning\n",
            "round {round}"
        );
        if round == 0 {
            // 8 MiB the template never had; they must come back on the next resume.
            sh(
                s,
                &id,
                "head -c 8388608 /dev/urandom > /dev/shm/r; md5sum /dev/shm/r > /root/r.md5",
            );
        } else {
            assert_eq!(
                sh(s, &id, "md5sum -c /root/r.md5 >/dev/null && echo same"),
                "same\n"
            );
        }
        if round == 0 {
            assert_eq!(
                s.call("POST", &format!("/sandboxes/{id}/pause"), None).0,
                204
            );
            let busy = written("pause after 8 MiB");
            assert!(
                busy >= idle + (8 << 20),
                "{busy} bytes after 8 MiB, {idle} idle"
            );
        }
    }
    assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
    for name in ["built", "broken"] {
        assert_eq!(s.call("DELETE", &format!("/templates/{name}"), None).0, 204);
        assert_eq!(s.call("GET", &format!("/templates/{name}"), None).0, 404);
    }
}
