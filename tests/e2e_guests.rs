//! End-to-end: real distro images as guests. The Debian 12 test image
//! (scripts/build-debian-image.sh, debootstrap, cached) goes through the local test
//! registry into a cold-started sandbox, which the python SDK then drives as E2B's
//! default account `user` (tests/sdk/guest_user.py): provisioned at boot, with its own
//! file permissions and passwordless sudo. The same server builds the default template
//! `base` at startup (`[templates] build_base`), which a bare `Sandbox.create()` uses
//! (a create sent while it still builds waits for it). Templates from the Debian image
//! are built with both SDKs' Template builders (tests/sdk/template_build.py, .mjs).
//! A template built from the Debian image runs tests/sdk/file_metadata.py (envd 0.6).

mod common;

use common::registry::{Auth, TestRegistry};
use common::sdk::{finish, run_sdk_with, sdk_tools};
use common::*;
use serde_json::json;
use std::time::Duration;

/// Debian 12 from the test registry cold-starts, runs its own python3, and is an E2B
/// guest: the account `user`, sudo, the hostname in /etc/hosts, file permissions.
#[test]
fn debian_image_from_the_registry_runs_python() {
    let image = debian_image();
    let registry = TestRegistry::start(Auth::Anonymous);
    let reference = registry.push_layout(&format!("{image}:12"), "debian", "12");
    let server = Server::builder()
        .env("AENV_TEMPLATES_BUILD_BASE", "true")
        .start();
    // A create from `base` while it is still building waits for the build, not 400.
    let (_, base) = server.call("GET", "/templates/base", None);
    assert!(
        base["buildStatus"] == "waiting" || base["buildStatus"] == "building",
        "{base}"
    );
    let url = format!("{}/sandboxes", server.base);
    let early = std::thread::spawn(move || {
        ureq::post(&url)
            .set("X-API-Key", API_KEY)
            .timeout(Duration::from_secs(120))
            .send_json(json!({"templateID": "base", "timeout": 60}))
            .map(|r| r.into_json::<serde_json::Value>().unwrap())
            .map_err(|e| e.to_string())
    });
    let created = server.create(json!({"image": reference, "timeout": 300}));
    let id = id_of(&created);
    let v = server.exec(
        &id,
        "python3",
        &[
            "-c",
            "import platform; print(platform.freedesktop_os_release()['VERSION_ID'])",
        ],
    );
    assert_eq!(v["exitCode"], 0, "{v}");
    assert_eq!(v["stdout"], "12\n", "{v}");
    // Provisioned in the guest at boot: the image itself has no `user`.
    let v = server.exec(&id, "sh", &["-c", "getent passwd user; stat -c '%U %a' /home/user; cat /etc/sudoers.d/agentenv-user; grep -c \"$(hostname)\" /etc/hosts"]);
    assert_eq!(
        v["stdout"],
        "user:x:1000:1000:user:/home/user:/bin/bash\nuser 755\nuser ALL=(ALL:ALL) NOPASSWD: ALL\n1\n",
        "{v}"
    );
    // Built from the built-in image in the background since startup; the early create
    // waited for it.
    let early = early.join().unwrap();
    let (_, base) = server.call("GET", "/templates/base", None);
    assert_eq!(base["buildStatus"], "ready", "{base}\n{}", server.log());
    let early_id = match &early {
        Ok(v) => id_of(v),
        Err(e) => panic!("the create from base while it built: {e}\n{}", server.log()),
    };
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{early_id}"), None);
    assert_eq!(status, 204);
    let (python, js_module) = sdk_tools();
    let script = format!("{}/tests/sdk/guest_user.py", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script)
        .env("E2B_API_URL", &server.base)
        .env("E2B_SANDBOX_URL", &server.base)
        .env("E2B_API_KEY", API_KEY)
        .env("AENV_SANDBOX_ID", &id)
        .env("AENV_DEFAULT_TEMPLATE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("E2B_DOMAIN");
    let lines = finish(&server, &script, cmd);
    println!("{}", lines.join("\n"));
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);

    // A template from the Debian image, built with the python SDK's Template builder
    // (the busybox variant of this script runs in e2e_templates): COPY with owner and
    // mode, RUN, ENV, WORKDIR, USER, a start command serving HTTP with python3 behind
    // wait_for_port; rebuilt with one changed last step (wait_for_url), the other steps
    // cached; a background build behind wait_for_process.
    let script = format!("{}/tests/sdk/template_build.py", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script)
        .env("E2B_API_URL", &server.base)
        .env("E2B_SANDBOX_URL", &server.base)
        .env("E2B_API_KEY", API_KEY)
        .env("PYTHONUNBUFFERED", "1")
        .env("AENV_TEST_IMAGE", &reference)
        .env("AENV_TEST_ALIAS", "debian-app")
        .env(
            "AENV_TEST_SERVE",
            "mkdir -p /tmp/www && echo served > /tmp/www/index.html && cd /tmp/www && \
             exec python3 -m http.server 8080",
        )
        .env("AENV_TEST_FETCH", "curl -s http://127.0.0.1:8080/")
        // The SDK's own ready commands (ss, curl, pgrep in the image) and a rebuild with
        // a changed last step, the rest from the step cache.
        .env("AENV_TEST_READY", "sdk")
        .env("AENV_TEST_CACHE", "1")
        .env_remove("E2B_DOMAIN");
    let lines = finish(&server, &script, cmd);
    println!("{}", lines.join("\n"));

    // The same template with the JS SDK (its own last step), on the layers the python
    // build left in the step cache where both SDKs send the same steps.
    let lines = run_sdk_with(
        &server,
        "node",
        "template_build.mjs",
        Some(&js_module),
        &[("AENV_TEST_IMAGE", &reference)],
    );
    println!("{}", lines.join("\n"));

    // The start command's server answers through the port routing on the API port.
    let id = server.create_from("debian-app", 120);
    let fetched = ureq::get(&format!("{}/", server.base))
        .set("E2b-Sandbox-Id", &id)
        .set("E2b-Sandbox-Port", "8080")
        .set("X-API-Key", API_KEY)
        .timeout(Duration::from_secs(30))
        .call()
        .map(|r| r.into_string().unwrap_or_default());
    assert_eq!(fetched.as_deref().ok(), Some("served\n"), "{fetched:?}");
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);

    // envd 0.6 on Debian's ext4 root (the busybox run is in e2e_sdk_lifecycle): file
    // metadata as xattrs, Stat and ListDir against coreutils' stat, watch entries.
    let lines = run_sdk_with(
        &server,
        &python,
        "file_metadata.py",
        None,
        &[("AENV_SDK_TEMPLATE", "debian-app")],
    );
    println!("{}", lines.join("\n"));
}
