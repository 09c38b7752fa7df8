//! Child reaping that does not steal the exit status of the agent's own commands.
//!
//! As PID 1 the agent inherits every orphan and must reap them all, so one thread calls
//! `waitpid(-1)` and hands statuses to the command that spawned the pid. Elsewhere (tests
//! on the host) the process may have other children, so each command's pid is waited for
//! individually instead.
//!
//! A command learns that its child ended through a pipe: the reaper drops the write end,
//! so the read end polls as hung up next to the child's stdout and stderr.
//!
//! The PID 1 reaper first learns which child ended without reaping it (`WNOWAIT`), then
//! takes the children lock, which [`Reaper::spawn`] holds across `Command::spawn`. So
//! a child whose exec failed is reaped by std inside `spawn` (std waits for it) and never
//! by the reaper, and a child that ends at once is registered before its status is taken.

use std::collections::HashMap;
use std::io::{PipeReader, PipeWriter};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::sys::guest::{peek_ended_child, try_reap, wait_child, ExitStatus};

struct Slot {
    status: Option<ExitStatus>,
    notify: Option<PipeWriter>,
}

/// Hands exit statuses to the commands that spawned the children.
pub struct Reaper {
    reap_all: bool,
    children: Mutex<HashMap<i32, Slot>>,
    spawned: Condvar,
}

impl Reaper {
    /// PID 1 mode: a thread reaps every child, orphans included.
    pub fn reap_all() -> std::io::Result<Arc<Reaper>> {
        let reaper = Arc::new(Reaper {
            reap_all: true,
            children: Mutex::new(HashMap::new()),
            spawned: Condvar::new(),
        });
        let r = reaper.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r.reap_loop())?;
        Ok(reaper)
    }

    /// Waits only for children spawned through [`Reaper::spawn`].
    pub fn own_children() -> Arc<Reaper> {
        Arc::new(Reaper {
            reap_all: false,
            children: Mutex::new(HashMap::new()),
            spawned: Condvar::new(),
        })
    }

    /// Spawns `cmd` and registers the child before any status for it can be delivered.
    /// The returned pipe becomes readable (hung up) once the child has ended.
    ///
    /// `cmd` may use `pre_exec` hooks, uid/gid changes and any spawn path of std.
    pub fn spawn(self: &Arc<Self>, cmd: &mut Command) -> std::io::Result<(Child, PipeReader)> {
        let (exit_r, exit_w) = std::io::pipe()?;
        let child = {
            let mut children = self.children.lock();
            let child = cmd.spawn()?;
            children.insert(
                child.id() as i32,
                Slot {
                    status: None,
                    notify: Some(exit_w),
                },
            );
            child
        };
        let pid = child.id() as i32;
        if self.reap_all {
            self.spawned.notify_all();
        } else {
            let me = self.clone();
            std::thread::Builder::new()
                .name(format!("wait-{pid}"))
                .spawn(move || match wait_child(pid) {
                    Ok((_, status)) => me.deliver(pid, status),
                    Err(e) => log::error!("waiting for pid={pid} failed: {e}"),
                })?;
        }
        Ok((child, exit_r))
    }

    /// The exit status of an ended child, removing its record.
    pub fn take_status(&self, pid: i32) -> Option<ExitStatus> {
        self.children.lock().remove(&pid).and_then(|s| s.status)
    }

    fn deliver(&self, pid: i32, status: ExitStatus) {
        if let Some(slot) = self.children.lock().get_mut(&pid) {
            slot.status = Some(status);
            slot.notify = None;
        }
    }

    fn reap_loop(&self) {
        loop {
            match peek_ended_child() {
                Ok(pid) => {
                    let mut children = self.children.lock();
                    // Nothing to take means std reaped it inside a failed spawn (under
                    // this lock), or it has not ended after all.
                    if let Ok(Some(status)) = try_reap(pid) {
                        if let Some(slot) = children.get_mut(&pid) {
                            slot.status = Some(status);
                            slot.notify = None;
                        }
                    }
                }
                Err(e) if e.errno() == Some(libc::ECHILD) => {
                    let mut children = self.children.lock();
                    // No child at all: every process in the guest descends from PID 1, so
                    // the next child can only come from `spawn`, which notifies. (A child
                    // registered since waitid said "none" is reaped right away.)
                    if children.values().all(|s| s.status.is_some()) {
                        self.spawned.wait(&mut children);
                    }
                }
                Err(e) => {
                    log::error!("reaper: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}
