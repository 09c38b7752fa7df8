//! A synchronous QMP client over a unix socket.
//!
//! One command at a time: each carries an `id`, and replies with another id (left over from
//! a command that timed out) and asynchronous events are skipped.

use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::VmError;

/// Default time a QMP command may take.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// A connected, capability-negotiated QMP session.
pub struct Qmp {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    /// Bytes of a line not yet complete when a read timed out.
    pending: Vec<u8>,
    next_id: u64,
    timeout: Duration,
}

impl Qmp {
    /// Connects to `path`, reads the greeting and negotiates capabilities.
    pub fn connect(path: &Path, timeout: Duration) -> Result<Qmp, VmError> {
        let stream = UnixStream::connect(path).map_err(|source| VmError::QmpIo {
            command: format!("connect {}", path.display()),
            source,
        })?;
        Qmp::handshake(stream, timeout)
    }

    /// Reads the greeting from an already connected socket and negotiates capabilities.
    pub fn handshake(stream: UnixStream, timeout: Duration) -> Result<Qmp, VmError> {
        let io_err = |source| VmError::QmpIo {
            command: "greeting".into(),
            source,
        };
        let writer = stream.try_clone().map_err(io_err)?;
        let mut qmp = Qmp {
            writer,
            reader: BufReader::new(stream),
            pending: Vec::new(),
            next_id: 1,
            timeout,
        };
        let deadline = Instant::now() + timeout;
        let greeting = qmp.read_message("greeting", deadline)?;
        if greeting.get("QMP").is_none() {
            return Err(VmError::Qmp {
                command: "greeting".into(),
                message: format!("not a QMP greeting: {greeting}"),
            });
        }
        qmp.execute("qmp_capabilities", None)?;
        Ok(qmp)
    }

    /// Changes the per-command timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs `command` with `arguments` and returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, VmError> {
        let timeout = self.timeout;
        self.execute_with_timeout(command, arguments, timeout)
    }

    /// [`Qmp::execute`] with an explicit timeout.
    pub fn execute_with_timeout(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, VmError> {
        self.execute_passing(command, arguments, timeout, None)
    }

    /// [`Qmp::execute_with_timeout`], with `fd` attached to the command (`SCM_RIGHTS`) for
    /// `add-fd` and `getfd`.
    fn execute_passing(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        timeout: Duration,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, VmError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut request = json!({ "execute": command, "id": id });
        if let Some(args) = arguments {
            request["arguments"] = args;
        }
        let mut line = request.to_string();
        line.push('\n');
        let io_err = |source| VmError::QmpIo {
            command: command.into(),
            source,
        };
        match fd {
            Some(fd) => crate::sys::fs::send_with_fd(&self.writer, line.as_bytes(), fd)
                .map_err(|e| io_err(e.source))?,
            None => self.writer.write_all(line.as_bytes()).map_err(io_err)?,
        }
        let deadline = Instant::now() + timeout;
        loop {
            let message = self.read_message(command, deadline)?;
            if message.get("event").is_some() {
                log::debug!("qmp event={}", message["event"]);
                continue;
            }
            if message.get("id").and_then(Value::as_u64) != Some(id) {
                log::debug!("qmp op=skip_stale_reply command={command} reply={message}");
                continue;
            }
            if let Some(ret) = message.get("return") {
                return Ok(ret.clone());
            }
            let message = match message.get("error") {
                Some(e) => format!(
                    "{}: {}",
                    e["class"].as_str().unwrap_or("Error"),
                    e["desc"].as_str().unwrap_or("(no description)")
                ),
                None => format!("unexpected reply {message}"),
            };
            return Err(VmError::Qmp {
                command: command.into(),
                message,
            });
        }
    }

    /// Reads one JSON message (one line), waiting at most until `deadline`.
    fn read_message(&mut self, command: &str, deadline: Instant) -> Result<Value, VmError> {
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(VmError::Timeout {
                    what: format!("the QMP reply to {command}"),
                    after_ms: self.timeout.as_millis() as u64,
                });
            }
            let io_err = |source| VmError::QmpIo {
                command: command.into(),
                source,
            };
            self.reader
                .get_ref()
                .set_read_timeout(Some(deadline - now))
                .map_err(io_err)?;
            match self.reader.read_until(b'\n', &mut self.pending) {
                Ok(0) => {
                    return Err(io_err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "QEMU closed the QMP socket",
                    )))
                }
                Ok(_) if self.pending.ends_with(b"\n") => {
                    let line = std::mem::take(&mut self.pending);
                    return serde_json::from_slice(&line).map_err(|e| VmError::Qmp {
                        command: command.into(),
                        message: format!(
                            "malformed QMP message {:?}: {e}",
                            String::from_utf8_lossy(&line)
                        ),
                    });
                }
                // EOF in the middle of a line.
                Ok(_) => {
                    return Err(io_err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "QEMU closed the QMP socket mid-message",
                    )))
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(io_err(e)),
            }
        }
    }

    /// Pauses the guest's vCPUs.
    pub fn stop(&mut self) -> Result<(), VmError> {
        self.execute("stop", None).map(drop)
    }

    /// Sets the carrier of the network device `name` (its backend and the guest's NIC):
    /// down, no frame passes either way and the guest sees its link down.
    pub fn set_link(&mut self, name: &str, up: bool) -> Result<(), VmError> {
        let args = serde_json::json!({"name": name, "up": up});
        self.execute("set_link", Some(args)).map(drop)
    }

    /// Resumes the guest's vCPUs.
    pub fn cont(&mut self) -> Result<(), VmError> {
        self.execute("cont", None).map(drop)
    }

    /// The run state: "running", "paused", "inmigrate", "postmigrate", "shutdown", ...
    pub fn query_status(&mut self) -> Result<String, VmError> {
        let ret = self.execute("query-status", None)?;
        ret["status"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| VmError::Qmp {
                command: "query-status".into(),
                message: format!("no status in {ret}"),
            })
    }

    /// Asks QEMU to exit. QEMU may close the socket before its reply arrives; that counts
    /// as success. The caller still reaps the process.
    pub fn quit(&mut self) -> Result<(), VmError> {
        match self.execute("quit", None) {
            Ok(_) => Ok(()),
            Err(VmError::QmpIo { source, .. })
                if matches!(
                    source.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Sets the migration bandwidth cap (bytes per second). QEMU's default (128 MiB/s)
    /// makes saving a guest several times slower than it needs to be.
    pub fn migrate_set_parameters(&mut self, max_bandwidth: u64) -> Result<(), VmError> {
        self.execute(
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": max_bandwidth })),
        )
        .map(drop)
    }

    /// Hands `fd` to QEMU in a new fd set and returns the set's id: QEMU then opens
    /// `/dev/fdset/<id>` (with the fd's access mode) instead of a path it cannot reach.
    pub fn add_fd(&mut self, fd: BorrowedFd<'_>, opaque: &str) -> Result<u64, VmError> {
        let timeout = self.timeout;
        let ret = self.execute_passing(
            "add-fd",
            Some(json!({ "opaque": opaque })),
            timeout,
            Some(fd),
        )?;
        ret["fdset-id"].as_u64().ok_or_else(|| VmError::Qmp {
            command: "add-fd".into(),
            message: format!("no fdset-id in {ret}"),
        })
    }

    /// Adds `fd` to the existing fd set `fdset` (e.g. a read-only descriptor next to a
    /// read-write one of the same file).
    pub fn add_fd_to(
        &mut self,
        fdset: u64,
        fd: BorrowedFd<'_>,
        opaque: &str,
    ) -> Result<(), VmError> {
        let timeout = self.timeout;
        self.execute_passing(
            "add-fd",
            Some(json!({ "fdset-id": fdset, "opaque": opaque })),
            timeout,
            Some(fd),
        )
        .map(drop)
    }

    /// Closes QEMU's copies of the fds in set `fdset` (once nothing uses them any more).
    pub fn remove_fd(&mut self, fdset: u64) -> Result<(), VmError> {
        self.execute("remove-fd", Some(json!({ "fdset-id": fdset })))
            .map(drop)
    }

    /// Closes QEMU's descriptor `fd` (its own number, see [`Qmp::query_fdsets`]) of set
    /// `fdset` (at once since QEMU 9.1; dups QEMU made of it are not affected).
    pub fn remove_fd_from(&mut self, fdset: u64, fd: u64) -> Result<(), VmError> {
        self.execute("remove-fd", Some(json!({ "fdset-id": fdset, "fd": fd })))
            .map(drop)
    }

    /// Every fd set QEMU holds, with its descriptors (QEMU's numbers).
    pub fn query_fdsets(&mut self) -> Result<Vec<FdSet>, VmError> {
        let ret = self.execute("query-fdsets", None)?;
        serde_json::from_value(ret.clone()).map_err(|e| VmError::Qmp {
            command: "query-fdsets".into(),
            message: format!("unexpected answer {ret}: {e}"),
        })
    }

    /// Starts saving the VM state to `path` (`file:` migration, QEMU >= 9). Returns at
    /// once; follow with [`Qmp::wait_migration`]. The server creates the file (mode 0600)
    /// and hands QEMU the descriptor: a confined QEMU cannot reach the path.
    pub fn migrate_to_file(&mut self, path: &Path) -> Result<(), VmError> {
        let file = create_state_file(path)?;
        self.migrate_via_fdset("migrate", &file)
    }

    /// `command` (`migrate` or `migrate-incoming`) with a `file:` URI naming a new fd set
    /// that holds `file`; QEMU's own copy of the descriptor is released once it has
    /// opened the file.
    fn migrate_via_fdset(&mut self, command: &str, file: &std::fs::File) -> Result<(), VmError> {
        self.execute_with_fd(
            command,
            file,
            |fdset| json!({ "uri": format!("file:/dev/fdset/{fdset}") }),
        )
        .map(drop)
    }

    /// `command` with the arguments `args` builds around the id of a new fd set that holds
    /// `file`; QEMU's own copy of the descriptor is released once the command returned.
    pub(crate) fn execute_with_fd(
        &mut self,
        command: &str,
        file: &std::fs::File,
        args: impl FnOnce(u64) -> Value,
    ) -> Result<Value, VmError> {
        use std::os::fd::AsFd;
        let fdset = self.add_fd(file.as_fd(), command)?;
        let done = self.execute(command, Some(args(fdset)));
        let removed = self.remove_fd(fdset);
        let done = done?;
        removed.map(|()| done)
    }
    /// Turns migration capabilities on or off, e.g. `[("x-ignore-shared", true)]`.
    pub fn migrate_set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), VmError> {
        let caps: Vec<Value> = caps
            .iter()
            .map(|(name, state)| json!({ "capability": name, "state": state }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": caps })),
        )
        .map(drop)
    }

    /// On a VM started with `-incoming defer`: starts loading the state saved in `path`
    /// (opened here, handed to QEMU as a descriptor). Returns at once; wait for the
    /// `paused` status.
    pub fn migrate_incoming_file(&mut self, path: &Path) -> Result<(), VmError> {
        let file = std::fs::File::open(path)
            .map_err(|e| VmError::io(format!("cannot open {}", path.display()), e))?;
        self.migrate_via_fdset("migrate-incoming", &file)
    }

    /// Switches the guest from the block node `node` onto `overlay`, a qcow2 node added
    /// with `"backing": null` whose image names `node`'s image as its backing file: from
    /// then on the guest writes to `overlay`, and `node` is never written again. QEMU keeps
    /// the overlay's backing-file string as it is, so a relative one stays relative.
    pub fn blockdev_snapshot(&mut self, node: &str, overlay: &str) -> Result<(), VmError> {
        self.execute(
            "blockdev-snapshot",
            Some(json!({ "node": node, "overlay": overlay })),
        )
        .map(drop)
    }

    /// Polls `query-status` until it reports `want` (Ok), at most `timeout`. Fails at once
    /// when an incoming migration failed or the guest shut down.
    pub fn wait_status(&mut self, want: &str, timeout: Duration) -> Result<(), VmError> {
        let start = Instant::now();
        let mut interval = Duration::from_micros(500);
        loop {
            let status = self.query_status()?;
            if status == want {
                return Ok(());
            }
            if matches!(
                status.as_str(),
                "shutdown" | "internal-error" | "io-error" | "guest-panicked"
            ) {
                return Err(VmError::Qmp {
                    command: "query-status".into(),
                    message: format!("the VM is {status}, expected {want}"),
                });
            }
            if start.elapsed() >= timeout {
                return Err(VmError::Timeout {
                    what: format!("the VM to be {want} (it is {status})"),
                    after_ms: timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(interval);
            interval = (interval * 2).min(Duration::from_millis(5));
        }
    }

    /// The raw `query-migrate` reply.
    pub fn query_migrate(&mut self) -> Result<Value, VmError> {
        self.execute("query-migrate", None)
    }

    /// Polls `query-migrate` until the migration completed (Ok) or failed/was cancelled
    /// (Err), at most `timeout`.
    pub fn wait_migration(&mut self, timeout: Duration) -> Result<(), VmError> {
        let start = Instant::now();
        let mut interval = Duration::from_millis(1);
        loop {
            let info = self.query_migrate()?;
            let status = info["status"].as_str().unwrap_or("none");
            match status {
                "completed" => return Ok(()),
                "failed" | "cancelled" | "none" => {
                    return Err(VmError::Migration {
                        status: status.into(),
                        message: info["error-desc"]
                            .as_str()
                            .unwrap_or("no error description")
                            .into(),
                    })
                }
                _ => {}
            }
            if start.elapsed() >= timeout {
                return Err(VmError::Timeout {
                    what: format!("the VM state save (last status {status})"),
                    after_ms: timeout.as_millis() as u64,
                });
            }
            std::thread::sleep(interval);
            interval = (interval * 2).min(Duration::from_millis(5));
        }
    }
}

/// One fd set of `query-fdsets`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct FdSet {
    #[serde(rename = "fdset-id")]
    pub id: u64,
    pub fds: Vec<FdSetFd>,
}

/// A descriptor in an fd set: QEMU's number for it, and the `opaque` it was added with.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct FdSetFd {
    pub fd: u64,
    #[serde(default)]
    pub opaque: String,
}

/// Creates (or truncates) `path`, mode 0600, for QEMU to write a state into through a
/// descriptor.
pub(crate) fn create_state_file(path: &Path) -> Result<std::fs::File, VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| VmError::io(format!("cannot create {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A fake QEMU on the other end of a socket pair: sends `script` lines in reply to
    /// each request line it reads.
    fn fake(replies: Vec<Vec<&'static str>>) -> (UnixStream, std::thread::JoinHandle<Vec<Value>>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || {
            let mut w = theirs.try_clone().unwrap();
            let mut r = BufReader::new(theirs);
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let mut seen = Vec::new();
            for lines in replies {
                let mut req = String::new();
                if r.read_line(&mut req).unwrap() == 0 {
                    break;
                }
                let req: Value = serde_json::from_str(&req).unwrap();
                for l in lines {
                    let l = l.replace("ID", &req["id"].to_string());
                    w.write_all(l.as_bytes()).unwrap();
                    w.write_all(b"\n").unwrap();
                }
                seen.push(req);
            }
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            seen
        });
        (ours, handle)
    }

    #[test]
    fn negotiates_skips_events_and_stale_replies() {
        let (sock, peer) = fake(vec![
            vec![r#"{"return": {}, "id": ID}"#],
            vec![
                r#"{"event": "STOP", "timestamp": {}}"#,
                r#"{"return": {"status": "old"}, "id": 999}"#,
                r#"{"return": {"status": "paused", "running": false}, "id": ID}"#,
            ],
            vec![r#"{"error": {"class": "GenericError", "desc": "nope"}, "id": ID}"#],
        ]);
        let mut qmp = Qmp::handshake(sock, Duration::from_secs(2)).unwrap();
        assert_eq!(qmp.query_status().unwrap(), "paused");
        let e = qmp.execute("cont", None).unwrap_err();
        assert_eq!(e.to_string(), "QMP cont failed: GenericError: nope");
        drop(qmp);
        let seen = peer.join().unwrap();
        assert_eq!(seen[0]["execute"], "qmp_capabilities");
        assert_eq!(seen[1]["execute"], "query-status");
        assert!(seen[1].get("arguments").is_none());
    }

    #[test]
    fn times_out_and_recovers() {
        let (sock, peer) = fake(vec![
            vec![r#"{"return": {}, "id": ID}"#],
            vec![],
            vec![
                r#"{"return": {"status": "running"}, "id": 2}"#,
                r#"{"return": {"status": "running"}, "id": ID}"#,
            ],
        ]);
        let mut qmp = Qmp::handshake(sock, Duration::from_millis(200)).unwrap();
        let e = qmp.execute("query-status", None).unwrap_err();
        assert!(matches!(e, VmError::Timeout { .. }), "{e}");
        assert_eq!(qmp.query_status().unwrap(), "running");
        drop(qmp);
        peer.join().unwrap();
    }

    #[test]
    fn quit_tolerates_a_closed_socket() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let peer = std::thread::spawn(move || {
            let mut w = theirs.try_clone().unwrap();
            let mut r = BufReader::new(theirs);
            w.write_all(b"{\"QMP\": {}}\n").unwrap();
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            w.write_all(b"{\"return\": {}, \"id\": 1}\n").unwrap();
            line.clear();
            r.read_line(&mut line).unwrap();
            assert!(line.contains("quit"));
            // Exits without replying, as QEMU sometimes does.
        });
        let mut qmp = Qmp::handshake(ours, Duration::from_secs(2)).unwrap();
        qmp.quit().unwrap();
        peer.join().unwrap();
    }

    #[test]
    fn migration_failure_is_reported() {
        let (sock, peer) = fake(vec![
            vec![r#"{"return": {}, "id": ID}"#],
            vec![r#"{"return": {"status": "active"}, "id": ID}"#],
            vec![r#"{"return": {"status": "failed", "error-desc": "disk full"}, "id": ID}"#],
        ]);
        let mut qmp = Qmp::handshake(sock, Duration::from_secs(2)).unwrap();
        let e = qmp.wait_migration(Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("disk full"), "{e}");
        drop(qmp);
        peer.join().unwrap();
    }
}
