//! End-to-end: real distro images as guests. The Debian 12 test image
//! (scripts/build-debian-image.sh, debootstrap, cached) goes through the local test
//! registry into a cold-started sandbox.

mod common;

use common::registry::{Auth, TestRegistry};
use common::*;
use serde_json::json;

/// Debian 12 from the test registry cold-starts and runs its own python3.
#[test]
fn debian_image_from_the_registry_runs_python() {
    let image = debian_image();
    let registry = TestRegistry::start(Auth::Anonymous);
    let reference = registry.push_layout(&format!("{image}:12"), "debian", "12");
    let server = Server::start("");
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
    let (status, _) = server.call("DELETE", &format!("/sandboxes/{id}"), None);
    assert_eq!(status, 204);
}
