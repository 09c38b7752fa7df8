//! The orchestrator's read accessors, grouped: [`CatalogView`] for what is stored
//! (snapshots, templates, builds, uploads, volumes) and [`Observer`] for what a sandbox and
//! the server report (logs, params, metrics). They change nothing; every operation that
//! does goes through [`super::Request`].

use super::{
    guest_metrics, metrics, sandbox_log, CatalogTemplate, OrchError, Orchestrator, SandboxEntry,
    SnapshotRecord, TemplateBuild,
};
use crate::volume::{Volume, VolumeRecord};
use std::sync::Arc;

/// What the server stores: snapshots, templates and their builds, uploads, volumes.
pub struct CatalogView<'a> {
    pub(super) orch: &'a Orchestrator,
}

/// What sandboxes and the server report: logs, extension params, metrics.
/// What [`Observer::capacity`] answers.
#[derive(Debug, Clone, Copy)]
pub struct HostCapacity {
    pub free: super::admission::Capacity,
    pub running: usize,
}

pub struct Observer<'a> {
    pub(super) orch: &'a Orchestrator,
}

impl CatalogView<'_> {
    /// The warm standbys of template (snapshot) `id`: `(most, ready, target)`.
    pub fn standbys(
        &self,
        snapshot: &super::snapshots::SnapshotRecord,
    ) -> Option<(u32, usize, usize)> {
        let source = snapshot.template.as_ref()?;
        let launcher = &self.orch.shared.launcher;
        let most = source
            .standbys
            .unwrap_or(self.orch.shared.config.templates.standby_per_template);
        let (ready, target) = launcher.standby.of(&snapshot.id);
        Some((most, ready, target))
    }

    /// Every snapshot captured from a sandbox (template builds are not listed).
    pub fn snapshots(&self) -> Vec<SnapshotRecord> {
        let mut list = self.orch.shared.snapshots.list();
        list.retain(|r| r.template.is_none());
        list
    }

    /// A snapshot captured from a sandbox (not a template build).
    pub fn find_snapshot(&self, id_or_name: &str) -> Option<SnapshotRecord> {
        self.orch
            .shared
            .snapshots
            .lookup(id_or_name)
            .filter(|r| r.template.is_none())
    }

    /// A template build, or a snapshot viewed as a template.
    pub fn find_template(
        &self,
        id_or_name: &str,
    ) -> Option<(Option<TemplateBuild>, Option<SnapshotRecord>)> {
        let snapshot = self.orch.shared.snapshots.lookup(id_or_name);
        let build = self.orch.shared.builds.find(id_or_name).or_else(|| {
            snapshot
                .as_ref()
                .and_then(|s| self.orch.shared.builds.find(&s.id))
        });
        let snapshot = snapshot.or_else(|| {
            build
                .as_ref()
                .and_then(|b| self.orch.shared.snapshots.lookup(&b.id))
        });
        (build.is_some() || snapshot.is_some()).then_some((build, snapshot))
    }

    /// Every template build with its snapshot once ready (E2B builds are listed by
    /// [`CatalogView::catalog_templates`]).
    pub fn templates(&self) -> Vec<(TemplateBuild, Option<SnapshotRecord>)> {
        self.orch
            .shared
            .builds
            .list()
            .into_iter()
            .filter(|b| b.catalog.is_none())
            .map(|b| {
                let snap = self.orch.shared.snapshots.lookup(&b.id);
                (b, snap)
            })
            .collect()
    }

    /// The E2B templates, each with its latest ready build (and that build's snapshot).
    pub fn catalog_templates(&self) -> Vec<(CatalogTemplate, Option<SnapshotRecord>)> {
        self.orch
            .shared
            .catalog
            .list()
            .into_iter()
            .map(|t| {
                let snap = t
                    .current()
                    .and_then(|b| self.orch.shared.snapshots.lookup(b));
                (t, snap)
            })
            .collect()
    }

    /// An E2B template by id or name.
    pub fn catalog_template(&self, id_or_name: &str) -> Option<CatalogTemplate> {
        self.orch.shared.catalog.find(id_or_name)
    }

    /// A build by id (any kind).
    pub fn build(&self, build_id: &str) -> Option<TemplateBuild> {
        self.orch
            .shared
            .builds
            .find(build_id)
            .filter(|b| b.id == build_id)
    }

    /// The snapshot a create from `template` starts from when it is ready here: an E2B
    /// template's (id, name or `name:tag`: its build's), a template build's or a
    /// snapshot's own, as `POST /sandboxes` resolves it.
    pub fn ready_snapshot(&self, template: &str) -> Option<SnapshotRecord> {
        let key = match self.orch.shared.catalog.resolve(template) {
            Some(Ok(build)) => build,
            Some(Err(_)) => return None,
            None => template.to_string(),
        };
        self.orch.shared.snapshots.lookup(&key)
    }

    /// The stored files of `hash` (a tar), when they are uploaded.
    pub fn files_tar(&self, hash: &str) -> Option<std::path::PathBuf> {
        let uploads = &self.orch.shared.uploads;
        uploads.present(hash).then(|| uploads.tar_path(hash))
    }

    /// Whether a build's files of `hash` are uploaded already.
    pub fn files_present(&self, hash: &str) -> bool {
        self.orch.shared.uploads.present(hash)
    }

    /// Whether `token` opens the upload link of `hash`.
    pub fn check_upload(&self, hash: &str, token: &str) -> bool {
        self.orch.shared.uploads.check(hash, token)
    }

    /// The largest files upload taken.
    pub fn max_upload_bytes(&self) -> u64 {
        self.orch.shared.uploads.max_bytes()
    }

    pub fn list_volumes(&self) -> Vec<VolumeRecord> {
        self.orch.shared.volumes.list()
    }

    /// A volume by id (the content API's too).
    pub fn volume(&self, id: &str) -> Result<Arc<Volume>, OrchError> {
        self.orch
            .shared
            .volumes
            .get(id)
            .ok_or_else(|| OrchError::NotFound(format!("volume {id} not found")))
    }
}

impl Observer<'_> {
    /// The last `lines` lines of a visible sandbox's guest console (api.md §4.20); empty
    /// when the guest has written nothing yet.
    pub fn console_tail(&self, id: &str, lines: usize) -> Result<String, OrchError> {
        self.orch.entry(id)?;
        let path = self.orch.shared.registry.dir(id).join("console.log");
        Ok(crate::vm::tail_lines(&path, lines))
    }

    /// A visible sandbox's log entries (api.md §4.26).
    pub fn sandbox_log(
        &self,
        id: &str,
        query: &sandbox_log::LogQuery,
    ) -> Result<Vec<sandbox_log::LogEntry>, OrchError> {
        let entry = self.orch.entry(id)?;
        if entry
            .guest_agent_addr(self.orch.shared.config.agent.port)
            .is_some()
        {
            entry
                .log
                .read_console(&self.orch.shared.registry.dir(id).join("console.log"));
        }
        Ok(entry.log.query(query))
    }

    /// Whether a custom extension is configured.
    pub fn extension_enabled(&self) -> bool {
        self.orch.shared.launcher.hooks.enabled()
    }

    /// Stored extension params, `{}` when empty; in every state.
    pub fn custom_extension_params(&self, id: &str) -> Result<serde_json::Value, OrchError> {
        Ok(self.orch.get(id)?.settings.custom_extension_params)
    }

    /// A visible sandbox's guest samples taken in `[start, end]` (unix seconds), oldest
    /// first; a paused one gives what was kept of its life.
    pub fn sandbox_metrics(
        &self,
        id: &str,
        start: u64,
        end: u64,
    ) -> Result<Vec<guest_metrics::GuestSample>, OrchError> {
        let entry = self.orch.entry(id)?;
        self.sample_if_unsampled(&entry);
        Ok(entry.metrics.between(start, end))
    }

    /// The newest sample of each visible sandbox among `ids` that has one.
    pub fn latest_metrics(&self, ids: &[String]) -> Vec<(String, guest_metrics::GuestSample)> {
        ids.iter()
            .filter_map(|id| {
                let entry = self.orch.entry(id).ok()?;
                self.sample_if_unsampled(&entry);
                Some((id.clone(), entry.metrics.latest()?))
            })
            .collect()
    }

    /// Prometheus text for `GET /metrics`.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let listed = self.orch.list();
        let count = |s: &str| {
            listed
                .iter()
                .filter(|i| i.state().api_state() == Some(s))
                .count()
        };
        metrics::render_state_gauge(
            &mut out,
            "agentenv_sandboxes",
            "Sandboxes by API state.",
            &[("running", count("running")), ("paused", count("paused"))],
        );
        self.orch.shared.operations.render(&mut out);
        self.orch.shared.base.render_metrics(&mut out);
        self.orch.shared.launcher.hooks.render_metrics(&mut out);
        self.orch.shared.launcher.standby.render_metrics(&mut out);
        self.orch.shared.launcher.kept.render_metrics(&mut out);
        self.orch.shared.launcher.deaths.render(&mut out);
        let slots = self.orch.shared.launcher.net.stats();
        metrics::render_state_gauge(
            &mut out,
            "agentenv_network_slots",
            "Network slots in use and waiting in the pool.",
            &[("in_use", slots.in_use), ("pooled", slots.pooled)],
        );
        self.orch.shared.launcher.admission.render_metrics(&mut out);
        let free = self
            .orch
            .shared
            .launcher
            .admission
            .capacity(self.orch.shared.host.online_cpus());
        if let Some(mb) = free.memory_free_mb {
            metrics::render_gauge(
                &mut out,
                "agentenv_free_memory_mb",
                "Memory (MiB) another VM may still take here: the host's headroom over the reserve, within the operator's cap.",
                mb,
            );
        }
        metrics::render_gauge(
            &mut out,
            "agentenv_free_vcpus",
            "vCPUs not reserved by running VMs, of the cap (or of the host's CPUs without one).",
            free.vcpus_free,
        );
        self.orch.shared.disk.render_metrics(&mut out);
        guest_metrics::render_egress(&mut out, &self.orch.shared.registry.entries());
        out
    }

    /// Room for more VMs here, and how many sandboxes run (`GET /cluster/node`).
    pub fn capacity(&self) -> HostCapacity {
        let running = self
            .orch
            .list()
            .iter()
            .filter(|i| i.state().api_state() == Some("running"))
            .count();
        let cpus = self.orch.shared.host.online_cpus();
        HostCapacity {
            free: self.orch.shared.launcher.admission.capacity(cpus),
            running,
        }
    }

    /// Whether admission would start a sandbox from `snapshot` now, reserving nothing
    /// (cluster placement): with a standby of it waiting, as its claim would; why not,
    /// when not.
    pub fn would_admit(&self, snapshot: &SnapshotRecord) -> Result<(), String> {
        let launcher = &self.orch.shared.launcher;
        let r = snapshot.settings.resources;
        let standby = launcher.standby.standing(&snapshot.id);
        launcher
            .admission
            .would_admit(r.memory_mb, r.cpu_count, standby)
    }

    /// This host's name, as the console shows it next to each sandbox.
    pub fn node_name(&self) -> String {
        crate::sys::fs::host_name()
    }

    /// Asks a running guest once when the sampler has not (yet) done so, or is off.
    fn sample_if_unsampled(&self, entry: &SandboxEntry) {
        let sampler_off = self.orch.shared.config.metrics.sandbox_interval_secs == 0;
        if !sampler_off && entry.metrics.latest().is_some() {
            return;
        }
        let live = entry
            .guest_agent_addr(self.orch.shared.config.agent.port)
            .and_then(|addr| guest_metrics::sample_sandbox(entry, addr));
        if let Some(sample) = live {
            entry.metrics.push(sample);
        }
    }
}
