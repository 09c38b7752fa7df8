//! The NFS server a sandbox's guest mounts its volumes from: one nfs-ganesha (NFSv4.2,
//! TCP, VFS backend) per running sandbox, in the sandbox's slot namespace, exporting only
//! that sandbox's volumes (docs/operations.md §11, docs/security.md "Volumes").
//!
//! It runs in a jail (`sys::jail`): a mount namespace holding the system's libraries and
//! ganesha's plugins read-only, its own directory (config, log, recovery state) and the
//! exported volume trees read-write, nothing else of the host. Every export sets
//! `Attr_Expiration_Time = 0`, so each of the ganeshas serving one volume revalidates
//! attributes on every call and sandboxes see each other's writes (close-to-open, as NFS).
//! Spawned by the sandbox's supervisor thread with `PR_SET_PDEATHSIG`, and killed (and
//! reaped) by drop before the slot is released.

use super::VolumeError;
use crate::sys::jail::{Access, Jail};
use crate::sys::process::{configure_child, kill_and_reap, ChildSetup, CAP_MKNOD};
use std::fs::File;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What ganesha reads of the host's /etc (besides its own config): libraries, accounts,
/// the RPC transports (`/etc/netconfig`), protocol and service names.
const SYSTEM_FILES: &[&str] = &[
    "/usr",
    "/etc/ld.so.cache",
    "/etc/passwd",
    "/etc/group",
    "/etc/netconfig",
    "/etc/protocols",
    "/etc/services",
    "/etc/nsswitch.conf",
    "/etc/hosts",
];

/// Longest a ganesha may take to listen (it takes about a second on the test host).
const READY_TIMEOUT: Duration = Duration::from_secs(20);
const PROBE_TIMEOUT: Duration = Duration::from_millis(200);
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// The program (Debian's `nfs-ganesha` and `nfs-ganesha-vfs`).
pub const GANESHA: &str = "/usr/bin/ganesha.nfsd";
/// Where Debian keeps ganesha's FSAL plugins.
const PLUGINS: &str = "/usr/lib/x86_64-linux-gnu/ganesha";
use crate::net::GUEST_NFS_PORT as NFS_PORT;

/// What to tell the operator when ganesha is missing or unusable.
const INSTALL: &str = "install Debian's nfs-ganesha and nfs-ganesha-vfs (scripts/setup.sh does): sandboxes cannot mount volumes until then";

/// Whether `program` (ganesha) runs here and its VFS backend is in `plugins`: its release
/// (`ganesha.nfsd -v`), or the one line that says what is wrong and what to install.
pub fn check_usable(program: &Path, plugins: &Path) -> Result<String, String> {
    let out = Command::new(program)
        .arg("-v")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}; {INSTALL}", program.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text
        .lines()
        .find_map(|l| l.split_once("Release = "))
        .map(|(_, r)| r.trim().to_string());
    let release = match (out.status.success(), release) {
        (true, Some(r)) => r,
        _ => {
            return Err(format!(
                "{} -v failed ({}): {}; {INSTALL}",
                program.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    };
    let vfs = plugins.join("libfsalvfs.so");
    if !vfs.is_file() {
        return Err(format!(
            "ganesha's VFS backend {} is missing; {INSTALL}",
            vfs.display()
        ));
    }
    Ok(release)
}

/// [`check_usable`] for the installed ganesha.
pub fn check_installed() -> Result<String, String> {
    check_usable(Path::new(GANESHA), Path::new(PLUGINS))
}

/// One exported volume: the guest mounts `<gateway>:/<name>`.
#[derive(Debug, Clone)]
pub struct Export {
    pub name: String,
    /// The volume's mounted tree on the host.
    pub dir: PathBuf,
}

/// A running ganesha; killed and reaped on drop.
pub struct NfsServer {
    child: Child,
}

impl Drop for NfsServer {
    fn drop(&mut self) {
        let _ = kill_and_reap(&mut self.child);
    }
}

/// The configuration: NFSv4 over TCP only, no NLM, RQUOTA, UDP, Kerberos or grace
/// period; every export read-write without squashing (the guest's root is the guest's).
pub fn config(dir: &Path, exports: &[Export]) -> String {
    let mut s = format!(
        "NFS_CORE_PARAM {{ Protocols = 4; NFS_Port = {NFS_PORT}; Enable_NLM = false; \
         Enable_RQUOTA = false; Enable_UDP = false; Plugins_Dir = \"{PLUGINS}\"; }}\n\
         NFSv4 {{ Graceless = true; RecoveryRoot = \"{}\"; }}\n\
         NFS_KRB5 {{ Active_krb5 = false; }}\n\
         EXPORT_DEFAULTS {{ Attr_Expiration_Time = 0; }}\n",
        dir.join("recovery").display()
    );
    for (i, e) in exports.iter().enumerate() {
        s.push_str(&format!(
            "EXPORT {{ Export_Id = {}; Path = \"{}\"; Pseudo = \"/{}\"; Access_Type = RW; \
             Squash = None; Protocols = 4; Transports = TCP; SecType = sys; \
             Attr_Expiration_Time = 0; FSAL {{ Name = VFS; }} }}\n",
            i + 1,
            e.dir.display(),
            e.name
        ));
    }
    s
}

impl NfsServer {
    /// Starts ganesha in `netns` serving `exports`, its files in `dir` (created; the
    /// sandbox's run dir holds it). Spawned from the calling thread with
    /// `PR_SET_PDEATHSIG`: call it on the supervisor thread that owns the slot.
    pub fn start(dir: &Path, netns: &File, exports: &[Export]) -> Result<NfsServer, VolumeError> {
        let io = |e| VolumeError::io(dir.display(), e);
        std::fs::create_dir_all(dir.join("recovery")).map_err(io)?;
        // The jail's root: beside `dir`, which the jail holds.
        let root = dir.with_file_name("nfs-jail");
        std::fs::create_dir_all(&root).map_err(io)?;
        let conf = dir.join("ganesha.conf");
        std::fs::write(&conf, config(dir, exports)).map_err(io)?;
        let mut jail = Jail::new(&root)?;
        for sys in SYSTEM_FILES {
            jail.bind_if_present(Path::new(sys), Access::ReadOnly)?;
        }
        // The VFS backend finds an export's file system in /etc/mtab (there is no /proc
        // in the jail): one line per volume, each its own ext4 mount.
        let mtab = dir.join("mtab");
        let lines: String = exports
            .iter()
            .map(|e| format!("agentenv-volume {} ext4 rw 0 0\n", e.dir.display()))
            .collect();
        std::fs::write(&mtab, lines).map_err(io)?;
        jail.bind_as(&mtab, Path::new("/etc/mtab"), Access::ReadOnly)?;
        for link in ["/lib", "/lib64", "/bin", "/sbin"] {
            jail.bind_if_present(Path::new(link), Access::ReadOnly)?;
        }
        for dev in ["/dev/null", "/dev/urandom"] {
            jail.bind(Path::new(dev), Access::Device)?;
        }
        jail.bind(dir, Access::ReadWrite)?;
        for e in exports {
            jail.bind(&e.dir, Access::ReadWrite)?;
        }
        let mut cmd = Command::new(GANESHA);
        cmd.arg("-F")
            .arg("-L")
            .arg(dir.join("ganesha.log"))
            .arg("-f")
            .arg(&conf)
            .arg("-p")
            .arg(dir.join("ganesha.pid"))
            .args(["-N", "NIV_EVENT"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        configure_child(
            &mut cmd,
            ChildSetup {
                netns: Some(netns.as_raw_fd()),
                parent_death_signal: Some(libc::SIGKILL),
                jail: Some(jail),
                // Root in its jail, but without making device nodes: a guest's mknod on a
                // volume is EPERM (FIFOs and sockets need no capability and stay inert).
                dropped_capabilities: &[CAP_MKNOD],
                ..ChildSetup::default()
            },
        );
        let child = cmd.spawn().map_err(|e| {
            VolumeError::NoNfsServer(format!("cannot start {GANESHA}: {e}; {INSTALL}"))
        })?;
        let mut server = NfsServer { child };
        server.wait_listening(dir, netns)?;
        Ok(server)
    }

    /// Waits (bounded) until it accepts connections on the gateway's NFS port, so the
    /// guest's mount, or a restored guest's reconnect, finds it; an exit or a timeout is
    /// an error with its log's last lines.
    fn wait_listening(&mut self, dir: &Path, netns: &File) -> Result<(), VolumeError> {
        let started = Instant::now();
        let addr = SocketAddr::from((crate::net::GUEST_GATEWAY, NFS_PORT));
        let failed = |why: String| {
            let log = std::fs::read_to_string(dir.join("ganesha.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            VolumeError::Disk(format!(
                "the volumes' NFS server {why}; its log ends: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            ))
        };
        loop {
            self.check().map_err(|e| failed(e.to_string()))?;
            let probe = || Ok(TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).is_ok());
            if crate::sys::netns::with_netns(netns, probe).unwrap_or(false) {
                log::info!(
                    "op=nfs_start result=ready ms={}",
                    started.elapsed().as_millis()
                );
                return Ok(());
            }
            if started.elapsed() > READY_TIMEOUT {
                return Err(failed(format!(
                    "did not listen on {addr} within {}s",
                    READY_TIMEOUT.as_secs()
                )));
            }
            std::thread::sleep(PROBE_INTERVAL);
        }
    }

    /// Whether it still runs (`Err` with its exit when it ended).
    pub fn check(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!("ganesha exited ({status})")),
            Err(e) => Err(format!("ganesha: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_ganesha_or_backend_says_what_to_install() {
        let e =
            check_usable(Path::new("/nonexistent/ganesha.nfsd"), Path::new(PLUGINS)).unwrap_err();
        assert!(
            e.contains("install Debian's nfs-ganesha and nfs-ganesha-vfs"),
            "{e}"
        );
        // `true -v` runs but is no ganesha.
        let e = check_usable(Path::new("/bin/true"), Path::new(PLUGINS)).unwrap_err();
        assert!(e.contains("-v failed") && e.contains("nfs-ganesha"), "{e}");
        let release = check_installed().expect("scripts/setup.sh installs nfs-ganesha");
        assert!(release.starts_with('V'), "{release}");
        let e = check_usable(Path::new(GANESHA), Path::new("/nonexistent")).unwrap_err();
        assert!(e.contains("libfsalvfs.so is missing"), "{e}");
    }
}
