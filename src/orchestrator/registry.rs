//! The sandbox registry: every sandbox the server knows by id, and where their
//! directories live. Operations on an existing sandbox need this and nothing else of the
//! orchestrator's state.

use super::envd::{Access, Recent};
use super::sandbox::{SandboxEntry, SandboxState};
use super::OrchError;
use parking_lot::RwLock;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

pub(crate) struct Registry {
    /// `<state_dir>/sandboxes`: one directory per sandbox (disk layers, record, console).
    dir: PathBuf,
    sandboxes: RwLock<HashMap<String, Arc<SandboxEntry>>>,
    /// Access tokens of deleted sandboxes (envd answers "was not found" to them).
    gone: Recent<Access>,
    /// What the 404 of a sandbox whose VM died says (the death, where its files went);
    /// the same bounded id → text map as the tokens.
    deaths: Recent<String>,
    /// Paused sandboxes' kept VMs, let go when their sandbox is deleted.
    kept: Option<Arc<super::kept::KeptPool>>,
}

impl Registry {
    pub fn new(dir: PathBuf, sandboxes: HashMap<String, Arc<SandboxEntry>>) -> Registry {
        Registry {
            dir,
            sandboxes: RwLock::new(sandboxes),
            gone: Recent::default(),
            deaths: Recent::default(),
            kept: None,
        }
    }

    /// The registry whose paused sandboxes may have their VMs in `kept`.
    pub fn with_kept(mut self, kept: Arc<super::kept::KeptPool>) -> Registry {
        self.kept = Some(kept);
        self
    }

    /// Lets go of paused sandbox `id`'s kept VM, if any (before its files are removed).
    pub fn discard_kept(&self, id: &str) {
        if let Some(kept) = &self.kept {
            kept.discard(id, "deleted");
        }
    }

    /// Lets go of the VMs kept too long.
    pub fn sweep_kept(&self) {
        if let Some(kept) = &self.kept {
            kept.sweep();
        }
    }

    /// The directory of sandbox `id`.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// A registered sandbox, visible or not.
    pub fn entry(&self, id: &str) -> Result<Arc<SandboxEntry>, OrchError> {
        self.sandboxes
            .read()
            .get(id)
            .cloned()
            .ok_or_else(|| match self.deaths.get(id) {
                Some(death) => OrchError::NotFound(death),
                None => OrchError::sandbox_not_found(id),
            })
    }

    /// Makes a sandbox known (its record is stored already).
    pub fn insert(&self, entry: Arc<SandboxEntry>) {
        let id = entry.id();
        self.sandboxes.write().insert(id, entry);
    }

    /// Every registered sandbox.
    pub fn entries(&self) -> Vec<Arc<SandboxEntry>> {
        self.sandboxes.read().values().cloned().collect()
    }

    pub fn ids(&self) -> Vec<String> {
        self.sandboxes.read().keys().cloned().collect()
    }

    /// Forgets a sandbox whose VM died on its own (the supervisor tears it down); its
    /// 404 says `death` from now on.
    pub fn forget_dead(&self, id: &str, death: &str) {
        if let Some(entry) = self.unregister_gone(id, death) {
            entry.take_runtime();
            if let Err(e) = entry.set_state(SandboxState::Deleting) {
                log::error!("sandboxId={id} op=forget_dead error=\"{e}\"");
            }
        }
    }

    /// Removes a sandbox that ended without being deleted: later calls see 404 with `why`
    /// (its VM died, or a capture left it unable to run on), not a bare "not found".
    pub fn unregister_gone(&self, id: &str, why: &str) -> Option<Arc<SandboxEntry>> {
        self.deaths.remember(id, why.to_string());
        self.unregister(id)
    }

    /// Removes a sandbox from the registry; later calls see 404.
    pub fn unregister(&self, id: &str) -> Option<Arc<SandboxEntry>> {
        let entry = self.sandboxes.write().remove(id);
        if let Some(entry) = &entry {
            self.gone.remember(id, Access::of(&entry.info()));
        }
        entry
    }

    /// What opened a recently deleted sandbox.
    pub fn gone_access(&self, id: &str) -> Option<Access> {
        self.gone.get(id)
    }
}

/// Runs `tick` every `interval` on a thread named `name`, as long as the registry exists
/// (the expiry and sandbox-metrics threads).
pub(crate) fn spawn_periodic(
    name: &str,
    registry: std::sync::Weak<Registry>,
    interval: std::time::Duration,
    mut tick: impl FnMut(&Arc<Registry>) + Send + 'static,
) {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            let Some(registry) = registry.upgrade() else {
                return;
            };
            tick(&registry);
        })
        .unwrap_or_else(|e| panic!("spawn {name} thread: {e}"));
}
