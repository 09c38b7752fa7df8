//! PID 1 duties: bring the VM up from the initramfs, switch to the root disk, configure
//! the network, then serve the host over virtio-serial and envd over HTTP.
//!
//! Every step prints one line to the console when it fails; steps the agent can live
//! without are skipped, the rest power the VM off so the host sees it exit.

use std::fs::OpenOptions;
use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sys::guest as sys;
use crate::sys::SysResult;

use super::envd::users::Accounts;
use super::envd::{serve, Envd};
use super::reaper::Reaper;
use super::{AgentServer, OnEof};

/// Guest side of the network slot (a /30 shared with the host's tap).
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
pub const GUEST_NETMASK: Ipv4Addr = Ipv4Addr::new(255, 255, 255, 252);
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// Name of the virtio-serial port carrying the agent protocol.
pub const PORT_NAME: &str = "agentenv";
pub const DEFAULT_HTTP_PORT: u16 = 49983;

const MODULE_DIR: &str = "/lib/modules";
const ROOT_DEVICE: &str = "/dev/vda";
const NEW_ROOT: &str = "/newroot";
const DEVICE_WAIT: Duration = Duration::from_secs(10);
/// While no host is connected to the agent port, the agent sleeps until the port's SIGIO
/// says one connected; this bounds one such sleep (a lost signal costs at most this).
const HOST_WAIT_LIMIT: Duration = Duration::from_secs(60);
/// The re-poll interval if SIGIO cannot be armed (or waiting on it fails).
const HOST_REPOLL: Duration = Duration::from_millis(10);

/// Settings the host passes on the kernel command line (`agentenv.*=`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootConfig {
    pub http_port: u16,
    pub dns: Option<Ipv4Addr>,
    pub hostname: String,
}

impl BootConfig {
    /// Parses `/proc/cmdline`; unknown or malformed values fall back to defaults.
    pub fn from_cmdline(cmdline: &str) -> BootConfig {
        let mut cfg = BootConfig {
            http_port: DEFAULT_HTTP_PORT,
            dns: None,
            hostname: "agentenv".into(),
        };
        for word in cmdline.split_whitespace() {
            let Some((key, value)) = word.split_once('=') else {
                continue;
            };
            match key {
                "agentenv.port" => match value.parse() {
                    Ok(p) => cfg.http_port = p,
                    Err(_) => say(&format!("ignoring bad agentenv.port={value}")),
                },
                "agentenv.dns" => match value.parse() {
                    Ok(ip) => cfg.dns = Some(ip),
                    Err(_) => say(&format!("ignoring bad agentenv.dns={value}")),
                },
                "agentenv.hostname" if !value.is_empty() && value.len() <= 64 => {
                    cfg.hostname = value.into()
                }
                _ => {}
            }
        }
        cfg
    }
}

/// One line on the console (fd 2 is /dev/console for PID 1).
pub fn say(msg: &str) {
    eprintln!("agentenv-agent: {msg}");
}

fn fatal(msg: &str) -> ! {
    say(&format!("FATAL: {msg}; powering off"));
    let err = sys::power_off();
    say(&format!("power off failed: {err}"));
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn soft(step: &str, res: SysResult<()>) {
    if let Err(e) = res {
        say(&format!("{step} failed (continuing): {e}"));
    }
}

fn mkdir(path: &str) {
    if let Err(e) = std::fs::create_dir_all(path) {
        say(&format!("mkdir {path} failed: {e}"));
    }
}

fn wait_for(path: &Path, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    path.exists()
}

fn load_modules() {
    let order = match std::fs::read_to_string(format!("{MODULE_DIR}/order")) {
        Ok(o) => o,
        Err(e) => return say(&format!("no module list {MODULE_DIR}/order: {e}")),
    };
    for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = PathBuf::from(format!("{MODULE_DIR}/{name}.ko"));
        soft(&format!("loading module {name}"), sys::load_module(&path));
        // The initramfs lives in RAM; free what is no longer needed.
        let _ = std::fs::remove_file(&path);
    }
}

/// Mounts the root disk and makes it `/`, with the agent staying PID 1.
fn switch_root() -> SysResult<()> {
    mkdir(NEW_ROOT);
    sys::mount(ROOT_DEVICE, Path::new(NEW_ROOT), "ext4", 0, "")?;
    for m in ["/proc", "/sys", "/dev"] {
        soft(
            "unmounting initramfs fs",
            sys::umount(Path::new(m), libc::MNT_DETACH),
        );
    }
    std::env::set_current_dir(NEW_ROOT)
        .map_err(|e| crate::sys::SysError::from_io(format!("chdir {NEW_ROOT}"), e))?;
    sys::mount(".", Path::new("/"), "", libc::MS_MOVE, "")?;
    sys::chroot(Path::new("."))?;
    std::env::set_current_dir("/").map_err(|e| crate::sys::SysError::from_io("chdir /", e))
}

fn mount_api_filesystems() {
    let nosuid = libc::MS_NOSUID;
    let mounts: [(&str, &str, &str, libc::c_ulong, &str); 6] = [
        (
            "proc",
            "/proc",
            "proc",
            nosuid | libc::MS_NODEV | libc::MS_NOEXEC,
            "",
        ),
        (
            "sysfs",
            "/sys",
            "sysfs",
            nosuid | libc::MS_NODEV | libc::MS_NOEXEC,
            "",
        ),
        ("devtmpfs", "/dev", "devtmpfs", nosuid, "mode=0755"),
        (
            "devpts",
            "/dev/pts",
            "devpts",
            nosuid | libc::MS_NOEXEC,
            "mode=0620,ptmxmode=0666,gid=5",
        ),
        (
            "tmpfs",
            "/dev/shm",
            "tmpfs",
            nosuid | libc::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            nosuid | libc::MS_NODEV,
            "mode=0755",
        ),
    ];
    for (src, target, fstype, flags, data) in mounts {
        mkdir(target);
        soft(
            &format!("mounting {target}"),
            sys::mount(src, Path::new(target), fstype, flags, data),
        );
    }
}

fn configure_network() {
    soft("bringing up lo", sys::link_up("lo"));
    // virtio_net registers eth0 while its module loads, but allow it a moment.
    let end = Instant::now() + Duration::from_secs(2);
    let res = loop {
        let res = sys::set_ipv4("eth0", GUEST_ADDR, GUEST_NETMASK);
        match &res {
            Err(e) if e.errno() == Some(libc::ENODEV) && Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(20));
            }
            _ => break res,
        }
    };
    soft("configuring eth0 address", res);
    // No IPv6 path leaves a slot (network.md §7.5): without this the guest still sends
    // router and neighbour solicitations and MLD reports each time its carrier comes up,
    // running its IPv6 stack for nothing (translated code held by each idle guest).
    soft(
        "disabling IPv6 on eth0",
        crate::sys::netns::write_sysctl("net.ipv6.conf.eth0.disable_ipv6", "1"),
    );
    soft("bringing up eth0", sys::link_up("eth0"));
    soft("adding default route", sys::add_default_route(GATEWAY));
}

fn write_resolv_conf(dns: Ipv4Addr) {
    mkdir("/etc");
    // /etc/resolv.conf may be a dangling symlink (systemd-resolved images): replace it.
    let _ = std::fs::remove_file("/etc/resolv.conf");
    if let Err(e) = std::fs::write("/etc/resolv.conf", format!("nameserver {dns}\n")) {
        say(&format!("writing /etc/resolv.conf failed: {e}"));
    }
}

/// The `/dev/vportNpM` whose virtio-serial name is `name`.
pub fn find_port(name: &str) -> Option<PathBuf> {
    let entries = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for entry in entries.flatten() {
        let port_name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Some(Path::new("/dev").join(entry.file_name()));
        }
    }
    None
}

fn wait_for_port(name: &str) -> Option<PathBuf> {
    let end = Instant::now() + DEVICE_WAIT;
    loop {
        if let Some(p) = find_port(name) {
            if wait_for(&p, Duration::from_secs(2)) {
                return Some(p);
            }
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Serves envd (and `GET /health`, which proves host→guest routing through the slot) on
/// 0.0.0.0:`port`.
pub fn serve_envd(port: u16, reaper: Arc<Reaper>) {
    let server = match tiny_http::Server::http(("0.0.0.0", port)) {
        Ok(s) => s,
        Err(e) => return say(&format!("HTTP server on port {port} failed: {e}")),
    };
    let envd = Envd::new(reaper, Accounts::default());
    serve(server, envd);
}

/// Everything PID 1 does. Never returns.
pub fn run_pid1() -> ! {
    let started = Instant::now();
    let cfg = mount_early();
    enter_root(&cfg);
    let reaper = match Reaper::reap_all() {
        Ok(r) => r,
        Err(e) => fatal(&format!("starting the reaper thread: {e}")),
    };
    let http_port = cfg.http_port;
    let envd_reaper = reaper.clone();
    if let Err(e) = std::thread::Builder::new()
        .name("envd".into())
        .spawn(move || serve_envd(http_port, envd_reaper))
    {
        say(&format!("starting the HTTP thread failed: {e}"));
    }
    let (port_path, port, writer) = open_agent_port();
    say(&format!(
        "ready in {} ms: agent on {}, HTTP on port {http_port}",
        started.elapsed().as_millis(),
        port_path.display()
    ));
    serve_agent(reaper, &port_path, &port, writer)
}

/// The initramfs's own /dev, /proc and /sys, and the boot config from the kernel's
/// command line.
fn mount_early() -> BootConfig {
    sys::set_umask(0o022);
    mkdir("/dev");
    mkdir("/proc");
    mkdir("/sys");
    soft(
        "mounting /dev",
        sys::mount("devtmpfs", Path::new("/dev"), "devtmpfs", 0, ""),
    );
    soft(
        "mounting /proc",
        sys::mount("proc", Path::new("/proc"), "proc", 0, ""),
    );
    soft(
        "mounting /sys",
        sys::mount("sysfs", Path::new("/sys"), "sysfs", 0, ""),
    );
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    BootConfig::from_cmdline(&cmdline)
}

/// Switches to the root disk and sets the guest up: hostname, provisioning, network,
/// DNS.
fn enter_root(cfg: &BootConfig) {
    load_modules();
    if !wait_for(Path::new(ROOT_DEVICE), DEVICE_WAIT) {
        fatal(&format!(
            "root disk {ROOT_DEVICE} did not appear within {}s (virtio_blk loaded?)",
            DEVICE_WAIT.as_secs()
        ));
    }
    if let Err(e) = switch_root() {
        fatal(&format!("switching to the root disk {ROOT_DEVICE}: {e}"));
    }
    mount_api_filesystems();
    soft("setting hostname", sys::set_hostname(&cfg.hostname));
    for problem in super::provision::provision(Path::new("/"), &cfg.hostname) {
        say(&format!("{problem} (continuing)"));
    }
    configure_network();
    if let Some(dns) = cfg.dns {
        write_resolv_conf(dns);
    }
}

/// The agent's virtio-serial port: its path, a handle to read and one to write.
fn open_agent_port() -> (PathBuf, std::fs::File, std::fs::File) {
    let Some(port_path) = wait_for_port(PORT_NAME) else {
        fatal(&format!(
            "virtio-serial port {PORT_NAME:?} not found (virtio_console loaded? QEMU \
             virtserialport name={PORT_NAME}?)"
        ));
    };
    let port = match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&port_path)
    {
        Ok(f) => f,
        Err(e) => fatal(&format!("opening {}: {e}", port_path.display())),
    };
    let writer = match port.try_clone() {
        Ok(w) => w,
        Err(e) => fatal(&format!("duplicating {}: {e}", port_path.display())),
    };
    (port_path, port, writer)
}

/// Serves the host's agent protocol on the port for the guest's life, waiting for the
/// host whenever it is not connected.
fn serve_agent(
    reaper: Arc<Reaper>,
    port_path: &Path,
    port: &std::fs::File,
    writer: std::fs::File,
) -> ! {
    let server = AgentServer::new(reaper, true, Box::new(writer))
        .with_fault_trigger(Path::new(super::FAULT_TRIGGER));
    // Armed on this thread, the one that serves the port.
    let host = sys::HostConnectWait::arm(port.as_fd());
    if let Err(e) = &host {
        say(&format!(
            "cannot arm SIGIO on {} ({e}); re-polling every {} ms while no host is connected",
            port_path.display(),
            HOST_REPOLL.as_millis()
        ));
    }
    let wait_for_host = || match &host {
        Ok(host) => {
            if let Err(e) = host.wait(port.as_fd(), HOST_WAIT_LIMIT) {
                say(&format!(
                    "waiting for the host on the agent port failed: {e}"
                ));
                std::thread::sleep(HOST_REPOLL);
            }
        }
        Err(_) => std::thread::sleep(HOST_REPOLL),
    };
    server.serve(port, OnEof::Wait(&wait_for_host));
    fatal("the agent channel loop ended");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cmdline_settings() {
        let cfg = BootConfig::from_cmdline(
            "console=ttyS0 agentenv.dns=10.0.0.1 agentenv.port=8080 reboot=t\n",
        );
        assert_eq!(cfg.http_port, 8080);
        assert_eq!(cfg.dns, Some(Ipv4Addr::new(10, 0, 0, 1)));
        let cfg = BootConfig::from_cmdline("agentenv.port=x");
        assert_eq!(cfg.http_port, DEFAULT_HTTP_PORT);
        assert_eq!(cfg.dns, None);
    }
}
