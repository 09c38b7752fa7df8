//! Running one command for the host (api.md §4.17).

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::reaper::Reaper;
use super::GuestError;
use crate::agent::{ExecRequest, ExecResult};
use crate::sys::guest::{kill_group, poll_readable, ExitStatus};

/// `PATH` used when the merged environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// After the child exits, how long to keep reading output that is already buffered.
const DRAIN_LIMIT: Duration = Duration::from_millis(200);
/// After SIGKILL, how long to wait for the child to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Output of one stream, capped.
struct Capture {
    buf: Vec<u8>,
    cap: usize,
    truncated: bool,
}

impl Capture {
    fn new(cap: u64) -> Capture {
        Capture {
            buf: Vec::new(),
            cap: usize::try_from(cap).unwrap_or(usize::MAX),
            truncated: false,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        let room = self.cap.saturating_sub(self.buf.len());
        if bytes.len() > room {
            self.truncated = true;
        }
        self.buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf).into_owned()
    }
}

fn is_executable_file(path: &Path) -> Option<bool> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() {
        return None;
    }
    Some(meta.permissions().mode() & 0o111 != 0)
}

pub(crate) enum Lookup {
    Found(PathBuf),
    NotExecutable(PathBuf),
    NotFound,
}

/// Finds `cmd` the way a shell does: a name with `/` is used as is (relative to `cwd`),
/// otherwise the first executable regular file in `PATH` wins.
pub(crate) fn lookup(cmd: &str, path_var: &str, cwd: &Path) -> Lookup {
    if cmd.contains('/') {
        let p = cwd.join(cmd);
        return match is_executable_file(&p) {
            Some(true) => Lookup::Found(PathBuf::from(cmd)),
            Some(false) => Lookup::NotExecutable(p),
            None if p.is_dir() => Lookup::NotExecutable(p),
            None => Lookup::NotFound,
        };
    }
    let mut not_exec = None;
    for dir in path_var.split(':') {
        let dir = if dir.is_empty() {
            cwd.to_path_buf()
        } else {
            cwd.join(dir)
        };
        let candidate = dir.join(cmd);
        match is_executable_file(&candidate) {
            Some(true) => return Lookup::Found(candidate),
            Some(false) if not_exec.is_none() => not_exec = Some(candidate),
            _ => {}
        }
    }
    match not_exec {
        Some(p) => Lookup::NotExecutable(p),
        None => Lookup::NotFound,
    }
}

fn failed(code: i32, message: String, start: Instant) -> ExecResult {
    ExecResult {
        exit_code: code,
        stdout: String::new(),
        stderr: format!("agentenv: {message}\n"),
        timed_out: false,
        stdout_truncated: false,
        stderr_truncated: false,
        duration_ms: start.elapsed().as_millis() as u64,
    }
}

/// Runs the command and collects its result.
pub fn run(req: &ExecRequest, reaper: &Arc<Reaper>) -> Result<ExecResult, GuestError> {
    let start = Instant::now();
    let cwd = if req.cwd.is_empty() { "/" } else { &req.cwd };
    let cwd_path = Path::new(cwd);
    if !cwd_path.is_absolute() || !cwd_path.is_dir() {
        return Err(GuestError::InvalidPath(format!(
            "working directory {cwd} does not exist in the sandbox or is not a directory"
        )));
    }
    let mut env = req.env.clone();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    let path_var = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let program = match lookup(&req.cmd, &path_var, cwd_path) {
        Lookup::Found(p) => p,
        Lookup::NotExecutable(p) => {
            let msg = format!(
                "{}: {}: permission denied (not executable)",
                req.cmd,
                p.display()
            );
            return Ok(failed(126, msg, start));
        }
        Lookup::NotFound if req.cmd.contains('/') => {
            let msg = format!("{}: no such file or directory", req.cmd);
            return Ok(failed(127, msg, start));
        }
        Lookup::NotFound => {
            let msg = format!("{}: command not found (PATH={path_var})", req.cmd);
            return Ok(failed(127, msg, start));
        }
    };

    let mut cmd = Command::new(&program);
    cmd.arg0(&req.cmd)
        .args(&req.args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd_path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let (mut child, exit_pipe) = match reaper.spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) => {
            let code = match e.raw_os_error() {
                Some(libc::ENOENT) | Some(libc::ENOTDIR) => 127,
                Some(_) | None => 126,
            };
            return Ok(failed(
                code,
                format!("cannot execute {}: {e}", req.cmd),
                start,
            ));
        }
    };
    let pid = child.id() as i32;
    let mut streams: Vec<Option<File>> = vec![
        child.stdout.take().map(|s| File::from(OwnedFd::from(s))),
        child.stderr.take().map(|s| File::from(OwnedFd::from(s))),
    ];
    let mut captures = [
        Capture::new(req.max_output_bytes),
        Capture::new(req.max_output_bytes),
    ];
    let deadline = start + Duration::from_millis(req.timeout_ms);
    let mut timed_out = false;
    let mut kill_deadline = None;
    let mut buf = vec![0u8; 64 * 1024];

    loop {
        let now = Instant::now();
        if !timed_out && now >= deadline {
            timed_out = true;
            if let Err(e) = kill_group(pid, libc::SIGKILL) {
                log::warn!("timeout kill of pid={pid} failed: {e}");
            }
            kill_deadline = Some(now + KILL_WAIT);
        }
        let wait = match kill_deadline {
            Some(k) if now >= k => {
                return Err(GuestError::Io(format!(
                    "command {} (pid {pid}) did not die after SIGKILL",
                    req.cmd
                )))
            }
            Some(k) => k - now,
            None => deadline - now,
        };
        let (exited, _) = pump(
            &mut streams,
            &mut captures,
            &exit_pipe,
            Some(wait),
            &mut buf,
        )?;
        if exited {
            break;
        }
    }
    // The child is gone; take what is already in the pipes, but do not wait for
    // descendants that may still hold them open.
    let drain_end = Instant::now() + DRAIN_LIMIT;
    while Instant::now() < drain_end && streams.iter().any(Option::is_some) {
        let (_, progressed) = pump(
            &mut streams,
            &mut captures,
            &exit_pipe,
            Some(Duration::ZERO),
            &mut buf,
        )?;
        if !progressed {
            break;
        }
    }
    let status = reaper.take_status(pid);
    let exit_code = match (timed_out, status) {
        (true, _) => 137,
        (false, Some(ExitStatus::Exited(c))) => c,
        (false, Some(ExitStatus::Signaled(s))) => 128 + s,
        (false, None) => return Err(GuestError::Io(format!("exit status of pid {pid} was lost"))),
    };
    let [out, err] = captures;
    Ok(ExecResult {
        exit_code,
        stdout: out.text(),
        stderr: err.text(),
        timed_out,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        duration_ms: start.elapsed().as_millis() as u64,
    })
}

/// Waits up to `wait` for output or the child's exit and reads what is ready. Returns
/// whether the child has exited and whether any stream made progress (data or EOF).
fn pump(
    streams: &mut [Option<File>],
    captures: &mut [Capture],
    exit_pipe: &std::io::PipeReader,
    wait: Option<Duration>,
    buf: &mut [u8],
) -> Result<(bool, bool), GuestError> {
    let mut fds = Vec::with_capacity(3);
    let mut which = Vec::with_capacity(2);
    for (i, s) in streams.iter().enumerate() {
        if let Some(f) = s {
            fds.push(f.as_fd());
            which.push(i);
        }
    }
    fds.push(exit_pipe.as_fd());
    let ready = poll_readable(&fds, wait).map_err(|e| GuestError::Io(e.to_string()))?;
    let exited = ready[ready.len() - 1];
    let mut progressed = false;
    for (k, &i) in which.iter().enumerate() {
        if !ready[k] {
            continue;
        }
        let Some(file) = streams[i].as_mut() else {
            continue;
        };
        progressed = true;
        match file.read(buf) {
            Ok(0) => streams[i] = None,
            Ok(n) => captures[i].push(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => streams[i] = None,
        }
    }
    Ok((exited, progressed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_truncates_and_flags() {
        let mut c = Capture::new(4);
        c.push(b"ab");
        assert!(!c.truncated);
        c.push(b"cdef");
        assert!(c.truncated);
        assert_eq!(c.text(), "abcd");
    }

    #[test]
    fn lookup_follows_path_order() {
        match lookup("sh", "/nonexistent:/bin:/usr/bin", Path::new("/")) {
            Lookup::Found(p) => assert_eq!(p, Path::new("/bin/sh")),
            _ => panic!("sh not found"),
        }
        assert!(matches!(
            lookup("no-such-cmd-xyz", "/bin", Path::new("/")),
            Lookup::NotFound
        ));
        assert!(matches!(
            lookup("/etc/passwd", "", Path::new("/")),
            Lookup::NotExecutable(_)
        ));
    }
}
