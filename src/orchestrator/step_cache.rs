//! The build step cache: each step's result is the build VM's disk frozen right after it
//! (`Op::FreezeDisk`: the layers hard-linked, the guest synced first), kept under a key
//! of (parent result, step) as E2B does: `key_0` is the image's base disk and size,
//! `key_n = sha256(key_{n-1}, step n)` (a COPY's files hash is part of the step). A build
//! boots on the longest cached prefix of its steps and runs only the rest; `force` on
//! the build or a step (the SDK's `skip_cache`) stops the prefix there. Entries are
//! `<state_dir>/build-cache/<key>/` (the layers and `entry.json`, written last), shared by
//! every template; one no build record names any more is removed ([`StepCache::gc`]).

use super::steps::{BuildSpec, Step};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

const ENTRY_FILE: &str = "entry.json";
const PARTIAL_PREFIX: &str = ".partial-";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    key: String,
    /// The layers' file names, bottom first.
    layers: Vec<String>,
}

/// What a build can take from the cache.
#[derive(Debug, Clone, Default)]
pub struct CachePlan {
    /// The key of each step's result, in order.
    pub keys: Vec<String>,
    /// How many leading steps are cached.
    pub hit: usize,
    /// The disk layers after the last cached step (bottom first), when `hit > 0`.
    pub layers: Vec<PathBuf>,
}

pub(crate) struct StepCache {
    dir: PathBuf,
}

impl StepCache {
    /// Opens the cache; leftovers of freezes a crash interrupted go.
    pub fn new(dir: PathBuf) -> StepCache {
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if name.starts_with(PARTIAL_PREFIX) || !e.path().join(ENTRY_FILE).is_file() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        StepCache { dir }
    }

    /// The keys of `spec`'s steps over `base` (the image's base disk and disk size), and
    /// the longest cached prefix.
    pub fn plan(&self, base: &str, spec: &BuildSpec) -> CachePlan {
        let mut parent = hex(&Sha256::digest(base.as_bytes()));
        let mut plan = CachePlan::default();
        let mut prefix = !spec.force;
        for step in &spec.steps {
            parent = step_key(&parent, step);
            prefix &= !step.force;
            if prefix {
                match self.lookup(&parent) {
                    Some(layers) => {
                        plan.hit += 1;
                        plan.layers = layers;
                    }
                    None => prefix = false,
                }
            }
            plan.keys.push(parent.clone());
        }
        plan
    }

    fn lookup(&self, key: &str) -> Option<Vec<PathBuf>> {
        let dir = self.dir.join(key);
        let entry: Entry =
            serde_json::from_slice(&std::fs::read(dir.join(ENTRY_FILE)).ok()?).ok()?;
        let layers: Vec<PathBuf> = entry.layers.iter().map(|l| dir.join(l)).collect();
        (!layers.is_empty() && layers.iter().all(|l| l.is_file())).then_some(layers)
    }

    /// A fresh directory for a freeze in progress.
    pub fn partial_dir(&self) -> Result<PathBuf, String> {
        crate::store::ensure_private_dir(&self.dir).map_err(|e| e.to_string())?;
        Ok(self
            .dir
            .join(format!("{PARTIAL_PREFIX}{}", crate::util::new_id())))
    }

    /// Makes the frozen `layers` in `partial` the entry `key` (replacing an older one).
    pub fn commit(&self, partial: &Path, key: &str, layers: &[PathBuf]) -> Result<(), String> {
        let names = layers
            .iter()
            .filter_map(|l| l.file_name().map(|n| n.to_string_lossy().to_string()))
            .collect();
        let entry = Entry {
            key: key.to_string(),
            layers: names,
        };
        let bytes = serde_json::to_vec(&entry).map_err(|e| e.to_string())?;
        crate::store::write_atomic(&partial.join(ENTRY_FILE), &bytes, 0o600)
            .map_err(|e| e.to_string())?;
        let dest = self.dir.join(key);
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::rename(partial, &dest).map_err(|e| e.to_string())
    }

    /// Removes the entries whose key is not in `live` (freezes in progress stay).
    pub fn gc(&self, live: &HashSet<String>) -> usize {
        let mut removed = 0;
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if !name.starts_with(PARTIAL_PREFIX) && !live.contains(&name) {
                    let _ = std::fs::remove_dir_all(e.path());
                    removed += 1;
                }
            }
        }
        removed
    }
}

/// The key of `step`'s result over the result `parent`.
fn step_key(parent: &str, step: &Step) -> String {
    let mut h = Sha256::new();
    h.update(parent.as_bytes());
    h.update(b"\n");
    h.update(serde_json::to_vec(&step.kind).unwrap_or_default());
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    crate::util::hex(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orchestrator::steps::{BuildBase, StepKind};

    fn run(cmd: &str, force: bool) -> Step {
        Step {
            kind: StepKind::Run {
                cmd: cmd.into(),
                user: None,
            },
            force,
        }
    }

    fn spec(steps: Vec<Step>, force: bool) -> BuildSpec {
        BuildSpec {
            base: BuildBase::Image("x".into()),
            steps,
            start_cmd: None,
            ready_cmd: None,
            force,
        }
    }

    #[test]
    fn the_longest_cached_prefix_is_used_and_force_stops_it() {
        let dir = std::env::temp_dir().join(format!("aenv-cache-{}", crate::util::new_id()));
        let cache = StepCache::new(dir.clone());
        let s = spec(
            vec![run("a", false), run("b", false), run("c", false)],
            false,
        );
        let plan = cache.plan("base", &s);
        assert_eq!((plan.hit, plan.keys.len()), (0, 3));
        for key in &plan.keys[..2] {
            let partial = cache.partial_dir().unwrap();
            std::fs::create_dir_all(&partial).unwrap();
            std::fs::write(partial.join("disk.qcow2"), b"l").unwrap();
            cache
                .commit(&partial, key, &[partial.join("disk.qcow2")])
                .unwrap();
        }
        assert_eq!(cache.plan("base", &s).hit, 2);
        assert_eq!(
            cache.plan("other-base", &s).hit,
            0,
            "the parent is part of the key"
        );
        let changed = spec(
            vec![run("a", false), run("B", false), run("c", false)],
            false,
        );
        assert_eq!(cache.plan("base", &changed).hit, 1);
        let forced = spec(
            vec![run("a", false), run("b", true), run("c", false)],
            false,
        );
        assert_eq!(cache.plan("base", &forced).hit, 1);
        assert_eq!(cache.plan("base", &spec(s.steps.clone(), true)).hit, 0);
        let live: HashSet<String> = [plan.keys[0].clone()].into();
        assert_eq!(cache.gc(&live), 1);
        assert_eq!(cache.plan("base", &s).hit, 1);
        let _ = std::fs::remove_dir_all(dir);
    }
}
