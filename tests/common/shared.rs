//! One fixture (a server and what the tests of a binary build on it) shared by the tests
//! of a binary that do not conflict: started by the first test that asks, stopped by the
//! last that leaves. Statics are never dropped, so a fixture kept for the whole process
//! would outlive it and leave its server behind; counting the holders avoids that.
//!
//! A test that needs the host to itself (it owns a server, or restarts one) takes
//! [`Shared::alone`]: it waits for every holder to leave and keeps new ones out.

#![allow(dead_code)]

use super::{aenv_links, files_under, id_of, netns_files, qemu_processes_with, Server};
use serde_json::{json, Value};
use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{
    Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// What a binary shares: how it starts, and how it stops once the last test left.
pub trait Fixture: Send + Sync + 'static {
    fn start() -> Self;
    /// Stops the fixture; `failed` says a test that held it failed (its sandboxes may be
    /// left, so keep the state for a look rather than check for leftovers).
    fn stop(self, failed: bool);
}

/// The one shared fixture of type `F` in a test binary: `static S: Shared<F> = Shared::new();`.
pub struct Shared<F> {
    slot: Mutex<Slot<F>>,
    turns: RwLock<()>,
    /// Tests in [`Shared::hold`] waiting for the slot (e.g. while the first one starts the
    /// fixture): the last holder leaving leaves the fixture to them rather than stopping it.
    waiting: AtomicUsize,
}

struct Slot<F> {
    users: usize,
    fixture: Option<Arc<F>>,
    failed: bool,
}

impl<F: Fixture> Shared<F> {
    pub const fn new() -> Self {
        Shared {
            slot: Mutex::new(Slot {
                users: 0,
                fixture: None,
                failed: false,
            }),
            turns: RwLock::new(()),
            waiting: AtomicUsize::new(0),
        }
    }

    /// A hold on the fixture, started if no test holds it.
    pub fn hold(&'static self) -> Hold<F> {
        let turn = self.turns.read().unwrap_or_else(PoisonError::into_inner);
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let mut slot = lock(&self.slot);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        let fixture = Arc::clone(slot.fixture.get_or_insert_with(|| Arc::new(F::start())));
        slot.users += 1;
        Hold {
            shared: self,
            fixture: Some(fixture),
            _turn: turn,
        }
    }

    /// The host to this test alone: no fixture runs while the guard lives.
    pub fn alone(&'static self) -> RwLockWriteGuard<'static, ()> {
        self.turns.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<F: Fixture> Default for Shared<F> {
    fn default() -> Self {
        Self::new()
    }
}

/// A test's hold on the shared fixture; the last one dropped stops it.
pub struct Hold<F: Fixture> {
    shared: &'static Shared<F>,
    fixture: Option<Arc<F>>,
    _turn: RwLockReadGuard<'static, ()>,
}

impl<F: Fixture> Deref for Hold<F> {
    type Target = F;
    fn deref(&self) -> &F {
        self.fixture.as_ref().expect("held until dropped")
    }
}

impl<F: Fixture> Drop for Hold<F> {
    fn drop(&mut self) {
        let mut slot = lock(&self.shared.slot);
        self.fixture = None;
        slot.failed |= std::thread::panicking();
        slot.users -= 1;
        if slot.users == 0 && self.shared.waiting.load(Ordering::SeqCst) == 0 {
            let failed = std::mem::take(&mut slot.failed);
            let fixture = slot.fixture.take().and_then(Arc::into_inner);
            fixture.expect("no test holds the fixture").stop(failed);
        }
    }
}

/// A mutex's guard, poisoned or not (a failed test must not fail the ones after it).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A snapshot that tests restore their sandboxes from (cheaper than a cold boot each),
/// captured once, by the first test that asks.
pub struct Origin {
    name: &'static str,
    made: OnceLock<()>,
}

impl Origin {
    pub const fn new(name: &'static str) -> Self {
        Origin {
            name,
            made: OnceLock::new(),
        }
    }

    /// The snapshot's name; on first use, captures the sandbox `boot` starts on `s`, then
    /// deletes that sandbox.
    pub fn name(&self, s: &Server, boot: impl FnOnce(&Server) -> String) -> &'static str {
        self.made.get_or_init(|| {
            let id = boot(s);
            let body = json!({ "name": self.name });
            let (code, v) = s.call("POST", &format!("/sandboxes/{id}/snapshots"), Some(body));
            assert_eq!(code, 201, "{v}");
            assert_eq!(s.call("DELETE", &format!("/sandboxes/{id}"), None).0, 204);
        });
        self.name
    }

    /// A running sandbox restored from the snapshot (made with `boot` if not yet), with
    /// the extra create fields in `extra`.
    pub fn restore(
        &self,
        s: &Server,
        boot: impl FnOnce(&Server) -> String,
        extra: Value,
    ) -> String {
        let mut body = json!({"templateID": self.name(s, boot), "timeout": 600});
        if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
            body.extend(extra);
        }
        let (code, v) = s.call("POST", "/sandboxes", Some(body));
        assert_eq!(code, 201, "{v}");
        id_of(&v)
    }

    /// Deletes the snapshot if it was made.
    pub fn delete(&self, s: &Server) {
        if self.made.get().is_some() {
            let (code, v) = s.call("DELETE", &format!("/templates/{}", self.name), None);
            assert_eq!(code, 204, "{v}");
        }
    }
}

/// Stops a shared server: after a failure keeps its state dir and log (and says where);
/// otherwise checks that nothing of it is left.
pub fn stop_shared_server(mut server: Server, failed: bool) {
    server.stop();
    if failed || std::thread::panicking() {
        eprintln!("shared server kept in {}", server.state_dir.display());
        std::mem::forget(server);
        return;
    }
    assert_server_left_nothing(&server);
}

/// After a server stopped: no sandbox file, namespace, link or QEMU of it is left.
pub fn assert_server_left_nothing(s: &Server) {
    let sandboxes = files_under(&s.state_dir.join("sandboxes"));
    assert!(sandboxes.is_empty(), "{sandboxes:?}");
    assert!(netns_files().is_empty(), "{:?}", netns_files());
    assert!(aenv_links().is_empty(), "{:?}", aenv_links());
    assert!(qemu_processes_with(&s.state_dir.display().to_string()).is_empty());
}

/// The fixture of a binary whose tests share one server on the embedded defaults and
/// restore their sandboxes from its [`Origin`] snapshot.
pub struct DefaultServer {
    pub server: Server,
    pub origin: Origin,
}

impl Fixture for DefaultServer {
    fn start() -> DefaultServer {
        DefaultServer {
            server: Server::start(""),
            origin: Origin::new("origin"),
        }
    }

    /// Stops the server; unless a test failed, checks that nothing of it is left.
    fn stop(self, failed: bool) {
        if !failed {
            self.origin.delete(&self.server);
        }
        stop_shared_server(self.server, failed);
    }
}
