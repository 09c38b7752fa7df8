//! The appliance: the static server binary, `scripts/bundle.sh`, and the bundle's
//! `install.sh` into a temporary root (install, upgrade over an install, run the installed
//! binary, uninstall, purge). Needs what `scripts/setup.sh` builds: the static binaries and
//! the guest assets.

mod common;

use common::shared::Shared;
use common::{assets_dir, Server};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Where scripts/build-static.sh (run by scripts/setup.sh) puts the static binaries.
fn static_binary(name: &str) -> PathBuf {
    let path = repo()
        .join("target/x86_64-unknown-linux-gnu/release")
        .join(name);
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup.sh (or scripts/build-static.sh) first",
        path.display()
    );
    path
}

/// The ELF program header types of a 64-bit little-endian ELF file.
fn program_header_types(path: &Path) -> Vec<u32> {
    let elf = std::fs::read(path).unwrap();
    assert_eq!(&elf[..4], b"\x7fELF", "{} is not ELF", path.display());
    assert_eq!(elf[4], 2, "{} is not a 64-bit ELF", path.display());
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().unwrap()) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    (0..phnum)
        .map(|i| {
            let o = phoff + i * phentsize;
            u32::from_le_bytes(elf[o..o + 4].try_into().unwrap())
        })
        .collect()
}

const PT_LOAD: u32 = 1;
const PT_INTERP: u32 = 3;

#[test]
fn static_binaries_have_no_interpreter() {
    for name in ["agentenv", "agentenv-agent"] {
        let path = static_binary(name);
        let types = program_header_types(&path);
        assert!(types.contains(&PT_LOAD), "{name}: no PT_LOAD: {types:?}");
        assert!(
            !types.contains(&PT_INTERP),
            "{name} has an ELF interpreter: it needs a dynamic loader and the host's libc"
        );
        // A static-pie binary relocates itself (PT_DYNAMIC without PT_INTERP); what matters
        // is that it names no shared library: ldd must say so.
        let out = Command::new("ldd").arg(&path).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            text.contains("statically linked") || text.contains("not a dynamic"),
            "{name}: ldd says {text}"
        );
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The bundle scripts/bundle.sh makes from the static binary and the assets, unpacked;
/// made for the tests that install it, removed after the last one (unless one failed).
/// Those tests' names sort after the others' (libtest runs tests in name order), so they
/// run one after another and it is made once.
struct Bundle {
    /// The scratch dir holding the tarball, the unpacked bundle and the tests' roots.
    work: PathBuf,
    tarball: PathBuf,
    /// The unpacked bundle.
    dir: PathBuf,
}

static BUNDLE: Shared<Bundle> = Shared::new();

impl common::shared::Fixture for Bundle {
    fn start() -> Bundle {
        let work = repo()
            .join("target/tmp")
            .join(format!("bundle-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        let out = run(Command::new(repo().join("scripts/bundle.sh"))
            .arg("--binary")
            .arg(static_binary("agentenv"))
            .arg("--assets")
            .arg(assets_dir())
            .arg("--out")
            .arg(work.join("out")));
        let tarball = PathBuf::from(out.lines().last().unwrap().trim());
        run(Command::new("tar")
            .arg("-C")
            .arg(&work)
            .arg("-xzf")
            .arg(&tarball));
        let name = tarball.file_name().unwrap().to_string_lossy().to_string();
        let dir = work.join(name.trim_end_matches(".tar.gz"));
        Bundle { work, tarball, dir }
    }

    fn stop(self, failed: bool) {
        if !failed {
            std::fs::remove_dir_all(&self.work).unwrap();
        }
    }
}

/// A temporary root of its own for a test, and the paths the bundle installs into it.
struct Root {
    root: PathBuf,
    bin: PathBuf,
    config: PathBuf,
    unit: PathBuf,
    assets: PathBuf,
    marker: PathBuf,
}

impl Root {
    fn new(bundle: &Bundle, name: &str) -> Root {
        let root = bundle.work.join(name);
        Root {
            bin: root.join("usr/local/bin/agentenv"),
            config: root.join("etc/agentenv/config.toml"),
            unit: root.join("etc/systemd/system/agentenv.service"),
            assets: root.join("var/lib/agentenv/assets"),
            marker: root.join("var/lib/agentenv/marker"),
            root,
        }
    }

    /// The bundle's install.sh into this root, with `extra` arguments: what it said.
    fn install(&self, bundle: &Bundle, extra: &[&str]) -> String {
        run(Command::new(bundle.dir.join("install.sh"))
            .arg("--root")
            .arg(&self.root)
            .args(extra))
    }

    /// As an operator: edits the installed config (returned) and leaves state behind.
    fn edit_config_and_leave_state(&self) -> String {
        let edited = format!(
            "{}\n# edited by the operator\n",
            std::fs::read_to_string(&self.config).unwrap()
        );
        std::fs::write(&self.config, &edited).unwrap();
        std::fs::write(&self.marker, "state").unwrap();
        edited
    }
}

#[test]
fn the_bundle_is_named_for_the_version_and_holds_what_install_needs() {
    let bundle = BUNDLE.hold();
    let name = bundle.tarball.file_name().unwrap().to_string_lossy();
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(name, format!("agentenv-{version}-x86_64-linux.tar.gz"));
    let size = std::fs::metadata(&bundle.tarball).unwrap().len();
    eprintln!("bundle {name}: {:.1} MiB", size as f64 / 1048576.0);
    for f in [
        "bin/agentenv",
        "assets/initramfs.img",
        "assets/base-image/index.json",
        "config/config.toml",
        "systemd/agentenv.service",
        "doc/operations.md",
        "install.sh",
        "VERSION",
    ] {
        assert!(bundle.dir.join(f).exists(), "bundle lacks {f}");
    }
    assert!(
        bundle.dir.join("assets/vmlinux").is_file() || bundle.dir.join("assets/vmlinuz").is_file(),
        "bundle has no guest kernel"
    );
}

/// Installs into an empty root; then an operator edits the config and installs again.
#[test]
fn the_install_puts_the_default_config_and_an_upgrade_keeps_the_edited_config_and_state() {
    let bundle = BUNDLE.hold();
    let r = Root::new(&bundle, "root-upgrade");
    let said = r.install(&bundle, &[]);
    assert!(said.contains("api-key"), "no API key location in:\n{said}");
    for p in [&r.bin, &r.config, &r.unit, &r.assets.join("initramfs.img")] {
        assert!(p.exists(), "{} not installed", p.display());
    }
    assert_eq!(
        std::fs::read(&r.config).unwrap(),
        std::fs::read(repo().join("config/default.toml")).unwrap()
    );
    let edited = r.edit_config_and_leave_state();
    r.install(&bundle, &[]);
    assert_eq!(
        std::fs::read_to_string(&r.config).unwrap(),
        edited,
        "an upgrade overwrote the operator's config"
    );
    assert!(r.marker.exists(), "upgrade lost state");
}

/// The installed binary says its version, serves from the installed assets and, as a
/// client, resolves a host name and talks to the server.
#[test]
fn the_installed_binary_serves_from_the_installed_assets_and_is_its_own_client() {
    let bundle = BUNDLE.hold();
    let r = Root::new(&bundle, "root-run");
    r.install(&bundle, &[]);
    let version_out = run(Command::new(&r.bin).arg("--version"));
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(version_out.trim(), format!("agentenv {version}"));

    let mut server = Server::builder()
        .binary(&r.bin)
        .vm(
            "assets_dir",
            format!("{:?}", r.assets.display().to_string()),
        )
        .start();
    let (status, body) = server.call("GET", "/sandboxes", None);
    assert_eq!(status, 200, "{body}");
    // The static binary as a client: it resolves a host name (glibc's built-in files
    // source, docs/operations.md §3.3) and talks to the server.
    let url = server.base.replace("127.0.0.1", "localhost");
    let listed = run(Command::new(&r.bin)
        .args(["--json", "--url", &url, "--api-key", common::API_KEY])
        .args(["sandbox", "ls"]));
    assert_eq!(listed.trim(), "[]");
    server.stop();
}

/// Uninstall (the installed install.sh) keeps the state dir and the edited config; purge
/// removes the rest.
#[test]
fn uninstall_keeps_the_state_and_an_edited_config_and_purge_removes_them() {
    let bundle = BUNDLE.hold();
    let r = Root::new(&bundle, "root-uninstall");
    r.install(&bundle, &[]);
    let edited = r.edit_config_and_leave_state();
    let said = run(
        Command::new(r.root.join("usr/local/share/agentenv/install.sh"))
            .arg("--root")
            .arg(&r.root)
            .arg("--uninstall"),
    );
    assert!(said.contains("kept"), "{said}");
    let share = r.root.join("usr/local/share/agentenv");
    for gone in [&r.bin, &r.unit, &r.assets, &share] {
        assert!(!gone.exists(), "{} left after uninstall", gone.display());
    }
    assert!(r.marker.exists());
    assert_eq!(std::fs::read_to_string(&r.config).unwrap(), edited);

    r.install(&bundle, &["--uninstall", "--purge"]);
    assert!(!r.root.join("var/lib/agentenv").exists());
    assert!(!r.root.join("etc/agentenv").exists());
}

#[test]
fn uninstall_takes_an_unedited_config_along_and_keeps_the_state() {
    let bundle = BUNDLE.hold();
    let r = Root::new(&bundle, "root-unedited");
    r.install(&bundle, &[]);
    r.install(&bundle, &["--uninstall"]);
    assert!(!r.config.exists(), "the untouched default config was kept");
    assert!(r.root.join("var/lib/agentenv").exists());
}

#[test]
fn systemd_unit_keeps_vms_alive_for_graceful_shutdown() {
    let unit = std::fs::read_to_string(repo().join("packaging/agentenv.service")).unwrap();
    let key = |k: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("unit has no {k}="))
            .trim()
            .to_string()
    };
    // SIGTERM to QEMU as well would kill the VMs before the server can pause them.
    assert_eq!(key("KillMode"), "mixed");
    let stop: u64 = key("TimeoutStopSec").parse().unwrap();
    let default = agentenv::config::Config::load(None).unwrap();
    assert!(
        stop > default.server.shutdown_timeout_secs,
        "TimeoutStopSec={stop} must exceed shutdown_timeout_secs"
    );
    assert_eq!(
        key("ExecStart"),
        "/usr/local/bin/agentenv serve --config /etc/agentenv/config.toml"
    );
    // Options that give the service its own mount namespace would hide the netns bind
    // mounts from the host.
    for k in [
        "PrivateTmp",
        "ProtectHome",
        "ProtectSystem",
        "PrivateDevices",
    ] {
        assert!(
            !unit.lines().any(|l| l.starts_with(&format!("{k}="))),
            "{k} breaks netns files or /dev/kvm"
        );
    }
    assert!(
        !unit.lines().any(|l| l.starts_with("ExecReload=")),
        "there is no config reload"
    );

    // systemd's own parser: every key known, every value valid. It checks that ExecStart
    // exists, so point it at a binary that does.
    let dir = repo()
        .join("target/tmp")
        .join(format!("unit-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("agentenv.service");
    std::fs::write(
        &copy,
        unit.replace("/usr/local/bin/agentenv", env!("CARGO_BIN_EXE_agentenv")),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("systemd-analyze (package systemd) is needed to check the unit");
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
