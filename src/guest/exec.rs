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
    let cwd = working_dir(&req.cwd)?;
    let env = with_default_path(&req.env);
    let program = match program_of(req, &env, cwd) {
        Ok(p) => p,
        Err((code, message)) => return Ok(failed(code, message, start)),
    };
    let mut cmd = Command::new(&program);
    cmd.arg0(&req.cmd)
        .args(&req.args)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir(cwd)
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
            let message = format!("cannot execute {}: {e}", req.cmd);
            return Ok(failed(code, message, start));
        }
    };
    let pid = child.id() as i32;
    let mut output = Output {
        streams: vec![
            child.stdout.take().map(|s| File::from(OwnedFd::from(s))),
            child.stderr.take().map(|s| File::from(OwnedFd::from(s))),
        ],
        captures: [
            Capture::new(req.max_output_bytes),
            Capture::new(req.max_output_bytes),
        ],
        exit_pipe,
        buf: vec![0u8; 64 * 1024],
    };
    let deadline = start + Duration::from_millis(req.timeout_ms);
    let timed_out = output.until_exit(pid, deadline, &req.cmd)?;
    output.drain()?;
    let status = reaper.take_status(pid);
    let exit_code = match (timed_out, status) {
        (true, _) => 137,
        (false, Some(ExitStatus::Exited(c))) => c,
        (false, Some(ExitStatus::Signaled(s))) => 128 + s,
        (false, None) => return Err(GuestError::Io(format!("exit status of pid {pid} was lost"))),
    };
    let [out, err] = output.captures;
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

/// The command's working directory (`/` when none is given): absolute and existing.
fn working_dir(cwd: &str) -> Result<&Path, GuestError> {
    let cwd = if cwd.is_empty() { "/" } else { cwd };
    let path = Path::new(cwd);
    if !path.is_absolute() || !path.is_dir() {
        return Err(GuestError::InvalidPath(format!(
            "working directory {cwd} does not exist in the sandbox or is not a directory"
        )));
    }
    Ok(path)
}

/// `env` with [`DEFAULT_PATH`] added when it sets no `PATH`.
fn with_default_path(env: &[(String, String)]) -> Vec<(String, String)> {
    let mut env = env.to_vec();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    env
}

/// The program to run, as a shell finds it; else the exit code and message a shell
/// would give (126 not executable, 127 not found).
fn program_of(
    req: &ExecRequest,
    env: &[(String, String)],
    cwd: &Path,
) -> Result<PathBuf, (i32, String)> {
    let path_var = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    match lookup(&req.cmd, &path_var, cwd) {
        Lookup::Found(p) => Ok(p),
        Lookup::NotExecutable(p) => Err((
            126,
            format!(
                "{}: {}: permission denied (not executable)",
                req.cmd,
                p.display()
            ),
        )),
        Lookup::NotFound if req.cmd.contains('/') => {
            Err((127, format!("{}: no such file or directory", req.cmd)))
        }
        Lookup::NotFound => Err((
            127,
            format!("{}: command not found (PATH={path_var})", req.cmd),
        )),
    }
}

/// A running command's stdout and stderr, captured up to their limits.
struct Output {
    streams: Vec<Option<File>>,
    captures: [Capture; 2],
    exit_pipe: std::io::PipeReader,
    buf: Vec<u8>,
}

impl Output {
    /// Captures output until the child exits; at `deadline` its process group is
    /// SIGKILLed. Returns whether it timed out.
    fn until_exit(&mut self, pid: i32, deadline: Instant, cmd: &str) -> Result<bool, GuestError> {
        let mut timed_out = false;
        let mut kill_deadline = None;
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
                        "command {cmd} (pid {pid}) did not die after SIGKILL"
                    )))
                }
                Some(k) => k - now,
                None => deadline - now,
            };
            if self.pump(Some(wait))?.0 {
                return Ok(timed_out);
            }
        }
    }

    /// The child is gone: takes what is already in the pipes, but does not wait for
    /// descendants that may still hold them open.
    fn drain(&mut self) -> Result<(), GuestError> {
        let drain_end = Instant::now() + DRAIN_LIMIT;
        while Instant::now() < drain_end && self.streams.iter().any(Option::is_some) {
            if !self.pump(Some(Duration::ZERO))?.1 {
                break;
            }
        }
        Ok(())
    }

    fn pump(&mut self, wait: Option<Duration>) -> Result<(bool, bool), GuestError> {
        pump(
            &mut self.streams,
            &mut self.captures,
            &self.exit_pipe,
            wait,
            &mut self.buf,
        )
    }
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
