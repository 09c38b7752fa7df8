//! The hook worker queue: one FIFO lane per key (a sandbox id) on an elastic pool of
//! worker threads.
//!
//! A lane is served by at most one worker at a time, so one sandbox's hooks run in
//! submission order. A lane with work never waits for a free worker: if no worker is idle,
//! a new one is spawned, so a hanging hook for one sandbox cannot hold back another.
//! Idle workers are reused (no thread spawn on the hot path) and exit after
//! `IDLE_EXIT` without work. When no worker thread can be spawned (the host is out of
//! threads or memory), the submitting thread serves the lane itself: a lane is never left
//! without a worker.

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use log::error;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// Starts a worker thread running the given closure (a seam: tests make it fail).
pub type Spawner = Box<dyn Fn(Job) -> std::io::Result<()> + Send + Sync>;

const IDLE_EXIT: Duration = Duration::from_secs(30);

pub struct Lanes {
    state: Mutex<State>,
    /// Keys of lanes handed to idle workers. Sent only under `state`'s lock, together with
    /// the decrement of `idle`, so that an exiting worker cannot strand a lane.
    ready_tx: Sender<String>,
    ready_rx: Receiver<String>,
    spawn: Spawner,
}

#[derive(Default)]
struct State {
    /// A key is present exactly while a worker owns its lane (running or handed over).
    lanes: HashMap<String, VecDeque<Job>>,
    idle: usize,
}

impl Lanes {
    pub fn new() -> Arc<Lanes> {
        Lanes::with_spawner(Box::new(|job| {
            std::thread::Builder::new()
                .name("hook-worker".into())
                .spawn(job)
                .map(drop)
        }))
    }

    pub fn with_spawner(spawn: Spawner) -> Arc<Lanes> {
        let (ready_tx, ready_rx) = unbounded();
        Arc::new(Lanes {
            state: Mutex::new(State::default()),
            ready_tx,
            ready_rx,
            spawn,
        })
    }

    /// Queues `job` at the end of `key`'s lane.
    pub fn submit(self: &Arc<Self>, key: &str, job: Job) {
        let mut st = self.state.lock();
        if let Some(queue) = st.lanes.get_mut(key) {
            queue.push_back(job);
            return;
        }
        st.lanes.insert(key.to_string(), VecDeque::from([job]));
        if st.idle > 0 {
            st.idle -= 1;
            self.ready_tx.send(key.to_string()).expect("receiver owned");
            return;
        }
        drop(st);
        let lanes = Arc::clone(self);
        let first = key.to_string();
        if let Err(e) = (self.spawn)(Box::new(move || lanes.worker(first))) {
            error!("cannot spawn a hook worker thread lane={key} error=\"{e}\"; the caller serves the lane");
            self.run_lane(key);
        }
    }

    /// Keys of the lanes that have queued or running work.
    pub fn active_keys(&self) -> Vec<String> {
        self.state.lock().lanes.keys().cloned().collect()
    }

    fn worker(&self, first: String) {
        self.run_lane(&first);
        loop {
            self.state.lock().idle += 1;
            let key = match self.ready_rx.recv_timeout(IDLE_EXIT) {
                Ok(key) => key,
                Err(RecvTimeoutError::Timeout) => {
                    let mut st = self.state.lock();
                    match self.ready_rx.try_recv() {
                        Ok(key) => key,
                        Err(_) => {
                            st.idle -= 1;
                            return;
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
            self.run_lane(&key);
        }
    }

    fn run_lane(&self, key: &str) {
        loop {
            let job = {
                let mut st = self.state.lock();
                match st.lanes.get_mut(key).and_then(VecDeque::pop_front) {
                    Some(job) => job,
                    None => {
                        st.lanes.remove(key);
                        return;
                    }
                }
            };
            if catch_unwind(AssertUnwindSafe(job)).is_err() {
                error!("hook job panicked lane={key}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn per_key_fifo_and_no_head_of_line_blocking() {
        let lanes = Lanes::new();
        let (tx, rx) = unbounded();
        let t0 = Instant::now();
        for i in 0..5 {
            let tx = tx.clone();
            lanes.submit(
                "a",
                Box::new(move || {
                    if i == 0 {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    tx.send(("a", i, t0.elapsed())).unwrap();
                }),
            );
        }
        let tx2 = tx.clone();
        lanes.submit(
            "b",
            Box::new(move || tx2.send(("b", 0, t0.elapsed())).unwrap()),
        );
        let first = rx.recv().unwrap();
        assert_eq!(first.0, "b");
        assert!(first.2 < Duration::from_millis(200), "{first:?}");
        let a: Vec<_> = (0..5).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(
            a.iter().map(|x| x.1).collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 4]
        );
        assert!(a.iter().all(|x| x.0 == "a"));
    }

    #[test]
    fn a_panicking_job_does_not_stall_its_lane() {
        let lanes = Lanes::new();
        let (tx, rx) = unbounded();
        lanes.submit("a", Box::new(|| panic!("boom")));
        lanes.submit("a", Box::new(move || tx.send(1).unwrap()));
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1));
    }

    #[test]
    fn a_lane_whose_worker_cannot_spawn_is_still_served() {
        let lanes = Lanes::with_spawner(Box::new(|_| Err(std::io::Error::other("no threads"))));
        let (tx, rx) = unbounded();
        for i in 0..3 {
            let tx = tx.clone();
            lanes.submit("a", Box::new(move || tx.send(i).unwrap()));
        }
        let got: Vec<i32> = rx.try_iter().collect();
        assert_eq!(got, [0, 1, 2]);
        assert!(lanes.active_keys().is_empty());
    }

    #[test]
    fn idle_workers_are_reused() {
        let lanes = Lanes::new();
        let (tx, rx) = unbounded();
        for i in 0..50 {
            let tx = tx.clone();
            lanes.submit(
                &format!("k{}", i % 3),
                Box::new(move || tx.send(i).unwrap()),
            );
            rx.recv().unwrap();
        }
        // After a job finished, at least one worker is idle again.
        std::thread::sleep(Duration::from_millis(20));
        assert!(lanes.state.lock().idle >= 1);
    }
}
