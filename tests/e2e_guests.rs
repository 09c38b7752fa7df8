//! End-to-end: real distro images as guests. The Debian 12 test image
//! (scripts/build-debian-image.sh, debootstrap, cached) goes through the local test
//! registry into a cold-started sandbox, which the python SDK then drives as E2B's
//! default account `user` (tests/sdk/guest_user.py): provisioned at boot, with its own
//! file permissions and passwordless sudo. The same server builds the default template
//! `base` at startup (`[templates] build_base`), which a bare `Sandbox.create()` uses
//! (a create sent while it still builds waits for it). Templates from the Debian image
//! are built with both SDKs' Template builders (tests/sdk/template_build.py, .mjs).
//! A template built from the Debian image runs tests/sdk/file_metadata.py (envd 0.6).
//! The tests share one registry, server and Debian sandbox ([`Guests`]).

mod common;

use common::registry::{Auth, TestRegistry};
use common::sdk::{finish, run_sdk_with, sdk_tools};
use common::shared::{lock, Hold, Shared};
use common::*;
use serde_json::{json, Value};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// The registry with the Debian image and the server every test of this binary shares.
static GUESTS: Shared<Guests> = Shared::new();

struct Guests {
    server: Server,
    /// The Debian 12 image in the test registry (kept running: the template builds pull
    /// from it).
    reference: String,
    _registry: TestRegistry,
    /// `GET /templates/base` right after startup.
    base_at_start: Value,
    /// A create from `base` sent right after startup, while it was building.
    early: Mutex<Option<JoinHandle<Result<Value, String>>>>,
    /// A sandbox cold-started from the Debian image.
    debian: OnceLock<String>,
    /// The template `debian-app`, built by the python SDK's Template builder.
    debian_app: OnceLock<()>,
}

impl common::shared::Fixture for Guests {
    /// Pushes the Debian image, starts a server that builds `base` at startup, and sends a
    /// create from `base` while it still builds.
    fn start() -> Guests {
        let image = debian_image();
        let registry = TestRegistry::start(Auth::Anonymous);
        let reference = registry.push_layout(&format!("{image}:12"), "debian", "12");
        let server = Server::builder()
            .env("AENV_TEMPLATES_BUILD_BASE", "true")
            .start();
        let (_, base_at_start) = server.call("GET", "/templates/base", None);
        let url = format!("{}/sandboxes", server.base);
        let early = std::thread::spawn(move || {
            ureq::post(&url)
                .set("X-API-Key", API_KEY)
                .timeout(Duration::from_secs(120))
                .send_json(json!({"templateID": "base", "timeout": 60}))
                .map(|r| r.into_json::<Value>().unwrap())
                .map_err(|e| e.to_string())
        });
        Guests {
            server,
            reference,
            _registry: registry,
            base_at_start,
            early: Mutex::new(Some(early)),
            debian: OnceLock::new(),
            debian_app: OnceLock::new(),
        }
    }

    /// Deletes the Debian sandbox (204) and stops the server; a failed run keeps its state.
    fn stop(mut self, failed: bool) {
        if let Some(early) = lock(&self.early).take() {
            // No test looked at the early create: it goes with the server.
            let _ = early.join();
        }
        if let Some(id) = self.debian.get() {
            let (status, _) = self
                .server
                .call("DELETE", &format!("/sandboxes/{id}"), None);
            assert!(failed || status == 204, "delete {id}: {status}");
        }
        self.server.stop();
        if failed || std::thread::panicking() {
            eprintln!("shared server kept in {}", self.server.state_dir.display());
            std::mem::forget(self.server);
        }
    }
}

impl Guests {
    /// The sandbox cold-started from the Debian image (created by the first test that asks).
    fn debian(&self) -> &str {
        self.debian.get_or_init(|| {
            id_of(
                &self
                    .server
                    .create(json!({"image": self.reference, "timeout": 300})),
            )
        })
    }

    /// Builds `debian-app` from the Debian image with the python SDK's Template builder,
    /// once (the busybox variant of this script runs in e2e_templates): COPY with owner and
    /// mode, RUN, ENV, WORKDIR, USER, a start command serving HTTP with python3 behind
    /// wait_for_port; rebuilt with one changed last step (wait_for_url), the other steps
    /// cached; a background build behind wait_for_process.
    fn debian_app(&self) {
        self.debian_app.get_or_init(|| {
            let server = &self.server;
            let (python, _) = sdk_tools();
            let script = format!("{}/tests/sdk/template_build.py", env!("CARGO_MANIFEST_DIR"));
            let mut cmd = std::process::Command::new(&python);
            cmd.arg(&script)
                .env("E2B_API_URL", &server.base)
                .env("E2B_SANDBOX_URL", &server.base)
                .env("E2B_API_KEY", API_KEY)
                .env("PYTHONUNBUFFERED", "1")
                .env("AENV_TEST_IMAGE", &self.reference)
                .env("AENV_TEST_ALIAS", "debian-app")
                .env(
                    "AENV_TEST_SERVE",
                    "mkdir -p /tmp/www && echo served > /tmp/www/index.html && cd /tmp/www && \
                     exec python3 -m http.server 8080",
                )
                .env("AENV_TEST_FETCH", "curl -s http://127.0.0.1:8080/")
                // The SDK's own ready commands (ss, curl, pgrep in the image) and a rebuild
                // with a changed last step, the rest from the step cache.
                .env("AENV_TEST_READY", "sdk")
                .env("AENV_TEST_CACHE", "1")
                .env_remove("E2B_DOMAIN");
            let lines = finish(server, &script, cmd);
            println!("{}", lines.join("\n"));
        });
    }
}

fn guests() -> Hold<Guests> {
    GUESTS.hold()
}

/// Debian 12 from the test registry cold-starts and runs its own python3.
#[test]
fn debian_image_from_the_registry_runs_its_own_python3() {
    let f = guests();
    let v = f.server.exec(
        f.debian(),
        "python3",
        &[
            "-c",
            "import platform; print(platform.freedesktop_os_release()['VERSION_ID'])",
        ],
    );
    assert_eq!(v["exitCode"], 0, "{v}");
    assert_eq!(v["stdout"], "12\n", "{v}");
}

/// The Debian guest is an E2B guest: the account `user`, sudo, the hostname in /etc/hosts,
/// file permissions (tests/sdk/guest_user.py, which also creates from `base` bare).
#[test]
fn a_debian_guest_gets_the_e2b_account_user_at_boot() {
    let f = guests();
    let (server, id) = (&f.server, f.debian());
    // Provisioned in the guest at boot: the image itself has no `user`.
    let v = server.exec(id, "sh", &["-c", "getent passwd user; stat -c '%U %a' /home/user; cat /etc/sudoers.d/agentenv-user; grep -c \"$(hostname)\" /etc/hosts"]);
    assert_eq!(
        v["stdout"],
        "user:x:1000:1000:user:/home/user:/bin/bash\nuser 755\nuser ALL=(ALL:ALL) NOPASSWD: ALL\n1\n",
        "{v}"
    );
    let (python, _) = sdk_tools();
    let script = format!("{}/tests/sdk/guest_user.py", env!("CARGO_MANIFEST_DIR"));
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script)
        .env("E2B_API_URL", &server.base)
        .env("E2B_SANDBOX_URL", &server.base)
        .env("E2B_API_KEY", API_KEY)
        .env("AENV_SANDBOX_ID", id)
        .env("AENV_DEFAULT_TEMPLATE", "1")
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("E2B_DOMAIN");
    let lines = finish(server, &script, cmd);
    println!("{}", lines.join("\n"));
}

/// `base` is built from the built-in image in the background since startup; a create
/// from it sent while it still built waited for the build, not 400.
#[test]
fn a_create_from_base_while_it_builds_waits_for_the_build() {
    let f = guests();
    let server = &f.server;
    let base = &f.base_at_start;
    assert!(
        base["buildStatus"] == "waiting" || base["buildStatus"] == "building",
        "{base}"
    );
    let early = lock(&f.early)
        .take()
        .expect("one test joins the early create");
    let early = early.join().unwrap();
    let (_, base) = server.call("GET", "/templates/base", None);
    assert_eq!(base["buildStatus"], "ready", "{base}\n{}", server.log());
    let early_id = match &early {
        Ok(v) => id_of(v),
        Err(e) => panic!("the create from base while it built: {e}\n{}", server.log()),
    };
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{early_id}"), None);
    assert_eq!(status, 204);
}

/// The python SDK's Template builder builds `debian-app` and rebuilds it from the step
/// cache (the checks are the script's, see [`Guests::debian_app`]).
#[test]
fn the_python_template_builder_builds_from_the_debian_image_and_its_step_cache() {
    guests().debian_app();
}

/// The same template with the JS SDK (its own last step), on the layers the python build
/// left in the step cache where both SDKs send the same steps.
#[test]
fn the_js_template_builder_reuses_the_steps_the_python_builder_cached() {
    let f = guests();
    f.debian_app();
    let (_, js_module) = sdk_tools();
    let lines = run_sdk_with(
        &f.server,
        "node",
        "template_build.mjs",
        Some(&js_module),
        &[("AENV_TEST_IMAGE", &f.reference)],
    );
    println!("{}", lines.join("\n"));
}

/// The start command's server of a Debian template answers through the port routing on
/// the API port.
#[test]
fn a_debian_templates_start_command_answers_through_the_port_routing() {
    let f = guests();
    f.debian_app();
    let server = &f.server;
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
}

/// envd 0.6 on Debian's ext4 root (the busybox run is in e2e_sdk_lifecycle): file
/// metadata as xattrs, Stat and ListDir against coreutils' stat, watch entries.
#[test]
fn envd_file_metadata_works_on_a_debian_ext4_root() {
    let f = guests();
    f.debian_app();
    let (python, _) = sdk_tools();
    let lines = run_sdk_with(
        &f.server,
        &python,
        "file_metadata.py",
        None,
        &[("AENV_SDK_TEMPLATE", "debian-app")],
    );
    println!("{}", lines.join("\n"));
}
