//! Every path under the state dir (docs/operations.md §2), named once, as `net/layout.rs`
//! names the network's. Modules take the directory they own from here; nothing else
//! spells a state-dir path.

use std::path::{Path, PathBuf};

/// The state dir's layout.
#[derive(Debug, Clone)]
pub struct StateLayout {
    root: PathBuf,
}

impl StateLayout {
    pub fn new(state_dir: &Path) -> StateLayout {
        StateLayout {
            root: state_dir.to_path_buf(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The API key the server made at its first start (mode 0600).
    pub fn api_key(&self) -> PathBuf {
        self.root.join("api-key")
    }

    /// The lock one server holds for as long as it runs on this state dir.
    pub fn server_lock(&self) -> PathBuf {
        self.root.join("agentenv.lock")
    }

    /// The custom extension's hook journal.
    pub fn journal(&self) -> PathBuf {
        self.root.join("journal")
    }

    /// Unpacked images and their blob cache.
    pub fn images(&self) -> PathBuf {
        self.root.join("images")
    }

    /// Snapshot records and their captures.
    pub fn snapshots(&self) -> PathBuf {
        self.root.join("snapshots")
    }

    /// One run directory per sandbox (its disk, record, console log).
    pub fn sandboxes(&self) -> PathBuf {
        self.root.join("sandboxes")
    }

    /// Template build records (`POST /templates`, `/v3/templates`).
    pub fn templates(&self) -> PathBuf {
        self.root.join("templates")
    }

    /// The run directories of build sandboxes; never kept across a restart.
    pub fn template_builds(&self) -> PathBuf {
        self.root.join("template-builds")
    }

    /// E2B template names, tags and builds.
    pub fn catalog(&self) -> PathBuf {
        self.root.join("catalog")
    }

    /// Build steps' results, shared by every template.
    pub fn build_cache(&self) -> PathBuf {
        self.root.join("build-cache")
    }

    /// COPY files uploaded for builds.
    pub fn template_files(&self) -> PathBuf {
        self.root.join("template-files")
    }

    /// E2B volumes.
    pub fn volumes(&self) -> PathBuf {
        self.root.join("volumes")
    }

    /// Whatever could not be read or was left by a VM that died, kept for the operator.
    pub fn quarantine(&self) -> PathBuf {
        self.root.join("quarantine")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_is_a_distinct_child_of_the_state_dir() {
        let l = StateLayout::new(Path::new("/s"));
        let all = [
            l.api_key(),
            l.server_lock(),
            l.journal(),
            l.images(),
            l.snapshots(),
            l.sandboxes(),
            l.templates(),
            l.template_builds(),
            l.catalog(),
            l.build_cache(),
            l.template_files(),
            l.volumes(),
            l.quarantine(),
        ];
        let distinct: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len());
        assert!(all.iter().all(|p| p.parent() == Some(l.root())));
    }
}
