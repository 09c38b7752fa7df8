//! Runs an E2B build's steps, start and ready commands inside the build VM, through the
//! guest's envd (`envd::process`): each as the step's user, in the build's working
//! directory, with the image env plus the ENV steps so far. Nothing runs on the host.
//! Every step is logged (`[3/5] RUN ...`, its output, its time); a failure names the step
//! (1-based, as the SDKs map it to their stack traces), its command and its output tail.
//! The build's deadline bounds every call, and a cancel (the template deleted) ends the
//! wait within seconds.

use super::steps::{Step, StepKind, StepState};
use super::templates::{BuildLog, LogLevel};
use crate::envd::process::{self, ProcessError, ProcessSpec, Stream};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most output kept for a failed step's reason.
const OUTPUT_TAIL: usize = 2048;
/// Longest output line logged (longer ones are cut).
const MAX_LINE: usize = 4096;
/// One ready-command attempt may take this long.
const READY_ATTEMPT: Duration = Duration::from_secs(30);
/// Pause between ready-command attempts.
const READY_PAUSE: Duration = Duration::from_millis(500);

/// The step name E2B gives the start/ready phase (the SDK maps it to its last frame).
pub const FINALIZE_STEP: &str = "finalize";

/// A failed build: which step, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepFailure {
    pub step: String,
    pub message: String,
}

/// Copies a COPY step's uploaded files into the VM (the caller owns the agent).
pub trait CopyFiles {
    fn copy(&self, runner: &StepRunner, step: &str, kind: &StepKind) -> Result<(), String>;
}

pub struct StepRunner<'a> {
    pub addr: SocketAddr,
    pub image_env: BTreeMap<String, String>,
    pub state: StepState,
    pub log: &'a BuildLog,
    pub deadline: Instant,
    pub cancelled: Arc<AtomicBool>,
}

impl StepRunner<'_> {
    /// Runs `steps` in order; the first `cached` ran already (their result is the disk
    /// booted) and are only applied and logged as `CACHED`.
    pub fn run_steps(
        &mut self,
        steps: &[Step],
        cached: usize,
        copier: &dyn CopyFiles,
        mut on_step_done: impl FnMut(usize, &StepRunner),
    ) -> Result<(), StepFailure> {
        let total = steps.len();
        for (i, step) in steps.iter().enumerate() {
            let name = (i + 1).to_string();
            if i < cached {
                self.log.push(
                    LogLevel::Info,
                    format!("CACHED [{name}/{total}] {}", step.kind.describe()),
                    Some(&name),
                );
                self.state.apply(&step.kind, &self.image_env);
                continue;
            }
            let fail = |message: String| StepFailure {
                step: name.clone(),
                message: format!("step {name} ({}) failed: {message}", step.kind.describe()),
            };
            self.check_going().map_err(fail)?;
            let started = Instant::now();
            self.log.push(
                LogLevel::Info,
                format!("[{name}/{total}] {}", step.kind.describe()),
                Some(&name),
            );
            self.run_one(&name, &step.kind, copier).map_err(fail)?;
            self.state.apply(&step.kind, &self.image_env);
            on_step_done(i, self);
            self.log.push(
                LogLevel::Info,
                format!(
                    "[{name}/{total}] done in {:.1}s",
                    started.elapsed().as_secs_f64()
                ),
                Some(&name),
            );
        }
        Ok(())
    }

    fn run_one(&self, name: &str, kind: &StepKind, copier: &dyn CopyFiles) -> Result<(), String> {
        match kind {
            StepKind::Run { cmd, user } => {
                let user = user.as_deref().unwrap_or(self.state.user());
                self.shell(name, user, cmd, &[])
            }
            StepKind::Workdir { dir } => {
                let dir = self.state.resolve(dir);
                // Created as root (like Docker's WORKDIR) and given to the current user.
                let script = r#"[ -d "$1" ] || { mkdir -p -- "$1" && { chown -- "$2" "$1" 2>/dev/null || true; }; }"#;
                if dir.starts_with('/') {
                    self.shell(name, "root", script, &[&dir, self.state.user()])
                } else {
                    self.shell(name, self.state.user(), r#"mkdir -p -- "$1""#, &[&dir])
                }
            }
            StepKind::User { user } if user == super::steps::DEFAULT_USER => Ok(()),
            StepKind::User { user } => self
                .shell(name, "root", r#"id -- "$1" >/dev/null"#, &[user])
                .map_err(|_| format!("there is no user {user} in the image")),
            StepKind::Env { .. } => Ok(()),
            StepKind::Copy { .. } => copier.copy(self, name, kind),
        }
    }

    /// Whether the build may go on.
    fn check_going(&self) -> Result<(), String> {
        if self.cancelled.load(Ordering::SeqCst) {
            return Err("the build was cancelled (its template was deleted)".into());
        }
        if Instant::now() >= self.deadline {
            return Err("the build timeout ([templates] build_timeout_secs) was reached".into());
        }
        Ok(())
    }

    /// Runs `/bin/sh -c script sh args...` as `user`; output logged under step `name`.
    pub fn shell(&self, name: &str, user: &str, script: &str, args: &[&str]) -> Result<(), String> {
        let spec = self.spec(user, script, args);
        let left = self.deadline.saturating_duration_since(Instant::now());
        let mut tail = Tail::default();
        let log = self.log;
        let result = process::run(
            self.addr,
            &spec,
            left,
            &self.cancelled,
            &mut |stream, bytes| {
                tail.push(bytes);
                for line in tail.lines(bytes) {
                    let level = match stream {
                        Stream::Stdout => LogLevel::Info,
                        Stream::Stderr => LogLevel::Warn,
                    };
                    log.push(level, line, Some(name));
                }
            },
        );
        match result {
            Ok(end) if end.exit_code == 0 => Ok(()),
            Ok(end) => Err(format!(
                "{script:?} exited with code {} ({}); output: {}",
                end.exit_code,
                end.status,
                tail.text()
            )),
            Err(ProcessError::Timeout) => Err(format!(
                "{script:?} did not end within the build timeout ([templates] build_timeout_secs); output: {}",
                tail.text()
            )),
            Err(e) => {
                self.check_going()?;
                Err(format!("{script:?} could not run: {e}"))
            }
        }
    }

    fn spec(&self, user: &str, script: &str, args: &[&str]) -> ProcessSpec {
        let mut envs = self.image_env.clone();
        envs.extend(self.state.env.clone());
        let mut argv = vec!["-c".to_string(), script.to_string(), "sh".to_string()];
        argv.extend(args.iter().map(|a| a.to_string()));
        ProcessSpec {
            user: user.to_string(),
            cmd: "/bin/sh".into(),
            args: argv,
            envs,
            cwd: self.state.workdir.clone(),
        }
    }

    /// Starts the start command (left running into the snapshot), then waits until the
    /// ready command exits 0; both as the build's final user, env and working directory.
    pub fn start_and_wait_ready(
        &self,
        start_cmd: Option<&str>,
        ready_cmd: Option<&str>,
    ) -> Result<(), StepFailure> {
        let fail = |message: String| StepFailure {
            step: FINALIZE_STEP.into(),
            message,
        };
        if let Some(cmd) = start_cmd {
            self.log.push(
                LogLevel::Info,
                format!("start command: {cmd}"),
                Some(FINALIZE_STEP),
            );
            let mut spec = self.spec(self.state.user(), cmd, &[]);
            // Its output goes nowhere the build waits on; the sandbox keeps the process.
            spec.args[1] = format!("exec >/dev/null 2>&1 </dev/null; {cmd}");
            process::spawn(self.addr, &spec)
                .map_err(|e| fail(format!("the start command {cmd:?} could not start: {e}")))?;
        }
        let Some(ready) = ready_cmd else {
            return Ok(());
        };
        self.log.push(
            LogLevel::Info,
            format!("waiting for the ready command: {ready}"),
            Some(FINALIZE_STEP),
        );
        let started = Instant::now();
        let mut last = String::new();
        loop {
            self.check_going().map_err(|why| {
                fail(format!(
                    "the ready command {ready:?} did not succeed: {why}; last attempt: {last}"
                ))
            })?;
            let spec = self.spec(self.state.user(), ready, &[]);
            let mut tail = Tail::default();
            let attempt =
                READY_ATTEMPT.min(self.deadline.saturating_duration_since(Instant::now()));
            match process::run(self.addr, &spec, attempt, &self.cancelled, &mut |_, b| {
                tail.push(b)
            }) {
                Ok(end) if end.exit_code == 0 => break,
                Ok(end) => last = format!("exit code {}: {}", end.exit_code, tail.text()),
                Err(e) => last = e.to_string(),
            }
            std::thread::sleep(READY_PAUSE);
        }
        self.log.push(
            LogLevel::Info,
            format!("ready after {:.1}s", started.elapsed().as_secs_f64()),
            Some(FINALIZE_STEP),
        );
        Ok(())
    }
}

impl StepRunner<'_> {
    /// Makes the build's final USER and WORKDIR the defaults of the guest's envd, which
    /// the snapshot keeps: every sandbox of the template runs commands and resolves paths
    /// as that user in that directory unless a call names its own (the sandboxes' own
    /// `/init` sets only their env). The build's ENV is not handed over.
    pub fn hand_over_defaults(&self) -> Result<(), StepFailure> {
        let mut body = serde_json::json!({ "defaultUser": self.state.user() });
        if let Some(dir) = &self.state.workdir {
            body["defaultWorkdir"] = serde_json::json!(dir);
        }
        let timeout = READY_ATTEMPT.min(self.deadline.saturating_duration_since(Instant::now()));
        let fail = |why: String| StepFailure {
            step: FINALIZE_STEP.into(),
            message: format!("setting the sandboxes' default user and workdir failed: {why}"),
        };
        match crate::envd::call(
            self.addr,
            "POST",
            "/init",
            "application/json",
            body.to_string().as_bytes(),
            timeout,
        ) {
            Ok((status, _)) if (200..300).contains(&status) => Ok(()),
            Ok((status, answer)) => Err(fail(format!(
                "status {status}: {}",
                String::from_utf8_lossy(&answer)
            ))),
            Err(e) => Err(fail(e.to_string())),
        }
    }
}

/// The last bytes of a step's output (for its failure reason) and its partial line.
#[derive(Default)]
struct Tail {
    kept: Vec<u8>,
    partial: Vec<u8>,
}

impl Tail {
    fn push(&mut self, bytes: &[u8]) {
        self.kept.extend_from_slice(bytes);
        if self.kept.len() > OUTPUT_TAIL {
            self.kept.drain(..self.kept.len() - OUTPUT_TAIL);
        }
    }

    /// Complete lines of `bytes` (with what came before), each cut at [`MAX_LINE`].
    fn lines(&mut self, bytes: &[u8]) -> Vec<String> {
        self.partial.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=nl).collect();
            out.push(cut(&line[..line.len() - 1]));
        }
        if self.partial.len() > MAX_LINE {
            out.push(cut(&self.partial));
            self.partial.clear();
        }
        out
    }

    fn text(&self) -> String {
        let t = String::from_utf8_lossy(&self.kept).trim_end().to_string();
        if t.is_empty() {
            "(none)".into()
        } else {
            t
        }
    }
}

fn cut(line: &[u8]) -> String {
    String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_end_and_splits_lines() {
        let mut t = Tail::default();
        assert_eq!(t.lines(b"a\nb"), vec!["a"]);
        assert_eq!(t.lines(b"c\n"), vec!["bc"]);
        t.push(&vec![b'x'; 3000]);
        t.push(b"END");
        assert!(t.text().ends_with("END"));
        assert_eq!(t.text().len(), OUTPUT_TAIL);
    }
}
