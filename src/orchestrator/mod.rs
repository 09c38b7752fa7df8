//! The orchestrator: the sandbox registry, one supervisor thread per sandbox, expiry.
//!
//! API threads call the methods here. Lifecycle operations travel as [`Op`] messages to
//! the sandbox's supervisor thread, which alone owns its QEMU process and network slot.
//! Commands and file transfers go straight to the guest agent client; they are not
//! lifecycle operations and run concurrently. No global lock is held across a VM
//! operation, an image build or a slot allocation.

mod admission;
mod base;
mod build_files;
mod build_steps;
mod catalog;
mod envd;
mod error;
mod expiry;
#[cfg(test)]
mod failure_tests;
#[cfg(test)]
pub(crate) mod fakes;
pub mod guest_metrics;
mod idempotency;
mod kept;
mod lifecycle;
mod metrics;
mod operations;
mod records;
mod registry;
mod request;
mod sandbox;
pub mod sandbox_log;
mod settings;
mod sides;
mod snapshots;
mod standby;
#[cfg(test)]
mod standby_tests;
mod start;
mod state_disk;
mod step_cache;
pub mod steps;
mod supervisor;
mod templates;
mod views;
mod volumes;
mod wake;
pub mod warmup;

pub use admission::Capacity;
pub use build_files::UploadError;
pub use catalog::{valid_tag, BuildIds, CatalogTemplate, DEFAULT_TAG};
pub use envd::{Access, EnvdRoute, EnvdTarget};
pub use error::{NotReady, OrchError};
pub use request::{ConnectKind, CreateFrom, ExpiryChange, Request, Response};
pub use sandbox::{Call, SandboxInfo, SandboxState};
pub use settings::{
    Ingress, NetworkPolicy, PauseMode, PauseRequest, Resources, SandboxRequest, SandboxSettings,
    VolumeMount,
};
pub use snapshots::valid_name as valid_template_name;
pub use snapshots::SnapshotRecord;
pub use templates::{BuildStatus, LogEntry, LogLevel, TemplateBuild, TemplateRequest};
pub use views::{CatalogView, HostCapacity, Observer};

use crate::agent::{AgentClient, ExecRequest, ExecResult, FileDownload};
use crate::config::Config;
use crate::hooks::{HookClient, StopReason};
use crate::image::ImageStore;
use crate::net::SlotManager;
use crate::store::layout::StateLayout;
use crate::vm::Accel;
use lifecycle::{admit, Admitted};
use metrics::OperationCounters;
use registry::Registry;
use sandbox::SandboxEntry;
use start::Launcher;
use state_disk::{DiskUse, StateDisk};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// How long a create waits for a template still building (below the SDKs' 60 s request
/// timeout).
const BUILD_WAIT: Duration = Duration::from_secs(45);

/// `POST /sandboxes-cold`, checked field by field by the API.
#[derive(Debug, Clone)]
pub struct ColdStart {
    pub image: String,
    pub resources: Resources,
    pub request: SandboxRequest,
    pub params: serde_json::Value,
}

/// The answer to connect/resume: the sandbox, and whether it was resumed (201) or only
/// had its expiry changed.
pub struct Connected {
    pub info: SandboxInfo,
    pub resumed: bool,
}

/// `POST /sandboxes`, checked field by field by the API.
#[derive(Debug, Clone)]
pub struct FromSnapshot {
    pub template: String,
    pub request: SandboxRequest,
    /// `null`/`{}` inherit the snapshot's params (custom-extension.md §10.5).
    pub params: serde_json::Value,
    /// Must equal the snapshot's when given: a restore cannot change them.
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u32>,
}

/// A command request from the API; the env is merged here.
#[derive(Debug, Clone)]
pub struct CommandRequest {
    pub cmd: String,
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub timeout_ms: u64,
}

/// The host's CPU count and memory, the upper bounds of `cpuCount` and `memoryMB`.
pub struct HostLimits {
    pub cpus: u32,
    pub memory_mb: u64,
}

impl HostLimits {
    pub(crate) fn of(host: &dyn sides::HostFacts) -> HostLimits {
        HostLimits {
            cpus: host.online_cpus(),
            memory_mb: host.total_memory_mb(),
        }
    }
}

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What the orchestrator's operations share. Each operation takes only the parts it
/// needs: the [`Registry`] for anything on an existing sandbox, the [`Launcher`] to start
/// a VM, the snapshot store, the image store.
pub(crate) struct Shared {
    /// The host's CPUs and memory, behind the fakeable side.
    pub host: Arc<dyn sides::HostFacts>,
    pub config: Config,
    pub registry: Arc<Registry>,
    pub launcher: Arc<Launcher>,
    pub images: ImageStore,
    pub snapshots: snapshots::Snapshots,
    pub builds: templates::Builds,
    /// E2B templates (`/v3/templates`): names, tags, builds.
    pub catalog: catalog::Catalog,
    /// COPY files uploaded for builds.
    pub uploads: build_files::Uploads,
    /// Build steps' results, shared by every template.
    pub step_cache: step_cache::StepCache,
    pub operations: OperationCounters,
    /// Free space and the reserve of the state dir's filesystem.
    pub disk: Arc<StateDisk>,
    pub idempotency: idempotency::IdempotencyKeys,
    /// E2B volumes (`/volumes`, the content API).
    pub volumes: crate::volume::VolumeStore,
    pub shutting_down: AtomicBool,
    /// Keeps `base` built (retries a failed build).
    pub base: base::BaseKeeper,
}

pub struct Orchestrator {
    shared: Arc<Shared>,
}

impl Orchestrator {
    /// Builds the orchestrator and starts its expiry thread. The slot manager has done
    /// its startup reclaim already.
    pub fn start(
        config: Config,
        slots: Arc<SlotManager>,
        hooks: Arc<HookClient>,
        accel: Accel,
    ) -> Orchestrator {
        let layout = StateLayout::new(&config.server.state_dir);
        let images = ImageStore::with_options(
            layout.images(),
            crate::image::ImageOptions::from(&config.images),
        );
        let snapshots = snapshots::Snapshots::load(layout.snapshots());
        let sandboxes_dir = layout.sandboxes();
        let sandboxes = load_sandboxes(&sandboxes_dir);
        let builds = templates::Builds::load(layout.templates());
        // Build sandboxes are internal and never survive a restart (their builds became
        // `error` above); their disks go.
        let build_dirs = layout.template_builds();
        if let Err(e) = std::fs::remove_dir_all(&build_dirs) {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!("op=recover path={} error={e}", build_dirs.display());
            }
        }
        let host: Arc<dyn sides::HostFacts> = Arc::new(sides::ProcHost);
        let admission = admission::Admission::with_host(
            admission::Limits::from_config(&config.admission, host.online_cpus()),
            admission::Headroom::from_config(&config.admission),
            host.clone(),
        );
        let launcher = Launcher::new(
            &config,
            slots,
            hooks,
            Arc::new(sides::QemuMachines),
            admission,
            accel,
        );
        let launcher = Arc::new(launcher);
        standby::StandbyPool::start(&launcher, sandboxes_dir.clone());
        let registry =
            Arc::new(Registry::new(sandboxes_dir, sandboxes).with_kept(launcher.kept.clone()));
        expiry::spawn(Arc::downgrade(&registry));
        if config.metrics.sandbox_interval_secs > 0 {
            guest_metrics::spawn(
                Arc::downgrade(&registry),
                Duration::from_secs(config.metrics.sandbox_interval_secs),
                config.agent.port,
            );
        }
        let idempotency = idempotency::IdempotencyKeys::new(Duration::from_secs(
            config.sandbox.idempotency_window_secs,
        ));
        let catalog = catalog::Catalog::load(layout.catalog());
        let step_cache = step_cache::StepCache::new(layout.build_cache());
        let uploads = build_files::Uploads::new(
            layout.template_files(),
            config.templates.max_upload_bytes,
            build_files::link_key(config.server.api_key.as_deref()),
        );
        let disk = launcher.disk.clone();
        let volumes = crate::volume::VolumeStore::load(layout.volumes());
        let shared = Arc::new(Shared {
            host,
            volumes,
            disk,
            config,
            registry,
            launcher,
            images,
            snapshots,
            builds,
            catalog,
            uploads,
            step_cache,
            operations: OperationCounters::default(),
            idempotency,
            shutting_down: AtomicBool::new(false),
            base: base::BaseKeeper::default(),
        });
        Orchestrator { shared }
    }

    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// What one sandbox may ask for at most.
    pub fn host_limits(&self) -> HostLimits {
        HostLimits::of(self.shared.host.as_ref())
    }

    /// What the server stores (read only).
    pub fn catalog(&self) -> CatalogView<'_> {
        CatalogView { orch: self }
    }

    /// What sandboxes and the server report (read only).
    pub fn observe(&self) -> Observer<'_> {
        Observer { orch: self }
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::SeqCst)
    }

    fn refuse_when_shutting_down(&self) -> Result<(), OrchError> {
        if self.is_shutting_down() {
            return Err(OrchError::Unavailable("server is shutting down".into()));
        }
        Ok(())
    }

    /// Runs `write` as an operation that writes `op` on the state dir: refused up front
    /// below the reserve, and its failure on a full disk answered as 507.
    fn on_state_disk<T>(
        &self,
        op: DiskUse,
        write: impl FnOnce() -> Result<T, OrchError>,
    ) -> Result<T, OrchError> {
        let result = self
            .shared
            .disk
            .check(op)
            .and_then(|()| self.shared.disk.classify(op, write()));
        if let Some(e) = result.as_ref().err().filter(|e| e.status() == 507) {
            log::warn!(
                "op={} result=insufficient_storage reason=\"{e}\"",
                op.name()
            );
        }
        result
    }

    /// The memory size of sandbox `id` (what its pause or snapshot writes at most).
    fn memory_of(&self, id: &str) -> u32 {
        self.entry(id)
            .map(|e| e.read(|i| i.settings.resources.memory_mb))
            .unwrap_or(0)
    }

    /// `POST /sandboxes-cold`: image → disk → slot → VM → agent ready → visible.
    fn create_cold(&self, mut req: ColdStart) -> Result<SandboxInfo, OrchError> {
        let _claims = self.resolve_mounts(&mut req.request.volume_mounts)?;
        let mounts = req.request.volume_mounts.clone();
        let shared = &self.shared;
        self.on_state_disk(DiskUse::Create, || {
            operations::create_cold(&shared.images, &shared.registry, &shared.launcher, req)
        })
        .and_then(|info| self.mount_in_guest(info, &mounts))
    }

    /// Runs `create` once per `key` within the idempotency window (api.md §4.2): a retry
    /// with the same request gets the first call's sandbox, a different request 409.
    fn create_once(
        &self,
        idempotency: Option<(String, idempotency::Fingerprint)>,
        from: CreateFrom,
    ) -> Result<SandboxInfo, OrchError> {
        let create = || match from {
            CreateFrom::Snapshot(req) => self.create_from_snapshot(req),
            CreateFrom::Image(req) => self.create_cold(req),
        };
        let Some((key, fingerprint)) = idempotency else {
            return create();
        };
        match self.shared.idempotency.claim(&key, fingerprint)? {
            idempotency::Claim::Replay(info) => Ok(*info),
            idempotency::Claim::First(claim) => {
                let info = create()?;
                claim.finish(&info);
                Ok(info)
            }
        }
    }

    /// A visible sandbox's description.
    pub fn get(&self, id: &str) -> Result<SandboxInfo, OrchError> {
        let entry = self.entry(id)?;
        let info = entry.info();
        Ok(info)
    }

    /// Every visible sandbox.
    pub fn list(&self) -> Vec<SandboxInfo> {
        self.shared
            .registry
            .entries()
            .iter()
            .map(|e| e.info())
            .filter(|i| i.state().api_state().is_some())
            .collect()
    }

    fn entry(&self, id: &str) -> Result<Arc<SandboxEntry>, OrchError> {
        self.shared.registry.entry(id)
    }

    /// `DELETE /sandboxes/{id}`: invisible at once, then the supervisor tears down.
    fn delete(&self, id: &str) -> Result<(), OrchError> {
        self.on_state_disk(DiskUse::Record, || {
            delete(&self.shared.registry, id, StopReason::Delete)
        })
    }

    /// `POST …/timeout` ([`ExpiryChange::Set`]) and `POST …/refreshes`
    /// ([`ExpiryChange::AtLeast`]).
    fn set_timeout(&self, id: &str, secs: u64, change: ExpiryChange) -> Result<(), OrchError> {
        let entry = self.entry(id)?;
        admit(&entry, id, Call::Timeout)?;
        extend_expiry(&entry, secs, change);
        Ok(())
    }

    /// `PUT …/network` (network.md §5.6): replaces the sandbox's egress policy, applied at
    /// once to a running sandbox's slot and kept in its settings (a paused one gets it on
    /// resume). `allow_internet` `true` cannot reopen a sandbox created without access.
    fn set_network(
        &self,
        id: &str,
        policy: NetworkPolicy,
        allow_internet: Option<bool>,
    ) -> Result<(), OrchError> {
        let entry = self.entry(id)?;
        let _held = admit(&entry, id, Call::Network)?;
        if allow_internet == Some(true) && !entry.read(|i| i.settings.internet_access) {
            return Err(OrchError::BadRequest(format!(
                "sandbox {id} was created without internet access (allowInternetAccess: false, \
                 or [network] outbound is off); create a new sandbox to get it"
            )));
        }
        let runtime = entry.runtime();
        if let Some(rt) = runtime {
            let (reply, done) = crossbeam_channel::bounded(1);
            let op = sandbox::Op::SetEgress {
                rules: policy.rules(),
                reply,
            };
            let gone = || OrchError::vm_gone(supervisor::EGRESS_STEP);
            match rt.ops.send(op) {
                Ok(()) => done.recv().unwrap_or_else(|_| Err(gone()))?,
                Err(_) => return Err(gone()),
            }
        }
        let info = {
            entry.update(|info| {
                info.settings.network = policy;
                info.clone()
            })
        };
        let record = records::SandboxRecord {
            info,
            paused: entry.paused_capture(),
        };
        records::save(&self.shared.registry.dir(id), &record)?;
        log::info!("sandboxId={id} op=set_network result=ok");
        Ok(())
    }

    /// `POST …/connect` and `…/resume` (`kind`). A running sandbox only gets its
    /// expiry changed, with no hooks: connect never shortens it, resume resets it. A
    /// paused one is resumed (custom-extension.md §5.5).
    /// `from` [`PauseMode::Filesystem`] (E2B's `memory: false`) boots a paused sandbox from
    /// its disk whatever its pause kept.
    fn connect(
        &self,
        id: &str,
        secs: u64,
        kind: ConnectKind,
        from: PauseMode,
    ) -> Result<Connected, OrchError> {
        let shared = &self.shared;
        let paused = self
            .entry(id)
            .is_ok_and(|e| e.state() == SandboxState::Paused);
        let op = if paused {
            DiskUse::Resume
        } else {
            DiskUse::Record
        };
        self.on_state_disk(op, || {
            operations::resume(&shared.registry, &shared.launcher, id, secs, kind, from)
        })
    }

    /// `POST …/pause`: 204 once paused; a paused sandbox answers 204 with no hooks.
    fn pause(&self, id: &str, request: PauseRequest) -> Result<(), OrchError> {
        let op = DiskUse::Pause {
            memory_mb: self.memory_of(id),
        };
        self.on_state_disk(op, || {
            operations::pause(&self.shared.registry, id, StopReason::Pause, request)
        })
    }

    /// `POST …/snapshots`.
    fn snapshot(&self, id: &str, name: Option<String>) -> Result<SnapshotRecord, OrchError> {
        let shared = &self.shared;
        let op = DiskUse::Snapshot {
            memory_mb: self.memory_of(id),
        };
        let _claims = self.claim_sandbox_mounts(id)?;
        self.on_state_disk(op, || {
            operations::snapshot(&shared.registry, &shared.snapshots, id, name)
        })
    }

    /// `POST /v3/templates`: a new build of `name` (the template made when new).
    fn request_build(
        &self,
        name: &str,
        tags: Vec<String>,
        resources: Resources,
        ids: Option<BuildIds>,
    ) -> Result<(CatalogTemplate, TemplateBuild), OrchError> {
        self.on_state_disk(DiskUse::Build, || {
            templates::request_build(&self.shared, name, tags, resources, ids)
        })
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: the build starts with its steps.
    fn start_build(
        &self,
        template_id: &str,
        build_id: &str,
        spec: steps::BuildSpec,
    ) -> Result<(), OrchError> {
        self.on_state_disk(DiskUse::Build, || {
            templates::start_build(&self.shared, template_id, build_id, spec)
        })
    }

    /// `POST /templates`: 202 with the build, which goes on in the background.
    fn submit_template(&self, req: TemplateRequest) -> Result<TemplateBuild, OrchError> {
        self.on_state_disk(DiskUse::Build, || templates::submit(&self.shared, req))
    }

    /// `PATCH /templates/{idOrName}` `{"standbys": n}`: kept with the template's record;
    /// standbys above it go at once.
    fn set_template_standbys(&self, id_or_name: &str, standbys: u32) -> Result<(), OrchError> {
        let id = match self.shared.catalog.resolve(id_or_name) {
            Some(build) => build?,
            None => id_or_name.to_string(),
        };
        let snap = self
            .shared
            .snapshots
            .lookup(&id)
            .filter(|s| s.template.is_some())
            .ok_or_else(|| {
                OrchError::NotFound(format!(
                    "template {id_or_name} not found (or not built from an image, so it has no standbys)"
                ))
            })?;
        self.shared.snapshots.set_standbys(&snap.id, standbys)?;
        self.shared
            .launcher
            .standby
            .set_cap(&snap.id, Some(standbys));
        Ok(())
    }

    /// `DELETE /templates/{idOrName}`: a template or a snapshot; 409 while building.
    /// Sandboxes made from it keep working.
    fn delete_template(&self, id_or_name: &str) -> Result<(), OrchError> {
        if self.shared.catalog.find(id_or_name).is_some() {
            return templates::delete_catalog_template(&self.shared, id_or_name);
        }
        if let Some((Some(build), _)) = self.catalog().find_template(id_or_name) {
            if matches!(build.status, BuildStatus::Waiting | BuildStatus::Building) {
                return Err(OrchError::Conflict(format!(
                    "template {} is still {}",
                    build.name,
                    build.status.as_str()
                )));
            }
            let launcher = &self.shared.launcher;
            launcher.standby.forget(&build.id, &*launcher.net);
            self.shared.snapshots.delete(&build.id);
            self.shared.builds.remove(&build.id);
            return Ok(());
        }
        self.shared.snapshots.delete(id_or_name);
        Ok(())
    }

    /// `POST /sandboxes` (custom-extension.md §5.3): a new sandbox restored from a snapshot.
    fn create_from_snapshot(&self, mut req: FromSnapshot) -> Result<SandboxInfo, OrchError> {
        let _claims = self.resolve_mounts(&mut req.request.volume_mounts)?;
        let mounts = req.request.volume_mounts.clone();
        self.on_state_disk(DiskUse::Create, || self.create_from_snapshot_inner(req))
            .and_then(|info| self.mount_in_guest(info, &mounts))
    }

    /// The snapshot `key` names. While a `POST /templates` build of that name is still
    /// queued or running (the default template `base` on a fresh server), waits for it
    /// up to [`BUILD_WAIT`], as the SDKs expect `Sandbox.create()` to work right after
    /// startup; 409 when it is still not done.
    fn snapshot_when_built(&self, key: &str) -> Result<Option<SnapshotRecord>, OrchError> {
        let deadline = std::time::Instant::now() + BUILD_WAIT;
        loop {
            if let Some(snap) = self.shared.snapshots.lookup(key) {
                return Ok(Some(snap));
            }
            let building = self
                .shared
                .builds
                .find(key)
                .filter(|b| matches!(b.status, BuildStatus::Waiting | BuildStatus::Building));
            match building {
                None => return Ok(None),
                Some(b) if std::time::Instant::now() >= deadline => {
                    return Err(OrchError::Conflict(format!(
                        "template {} is still {} after {}s: try again when GET /templates/{} says ready",
                        b.name,
                        b.status.as_str(),
                        BUILD_WAIT.as_secs(),
                        b.name
                    )))
                }
                Some(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    fn create_from_snapshot_inner(&self, req: FromSnapshot) -> Result<SandboxInfo, OrchError> {
        // An E2B template (name, name:tag or id) means its ready build's snapshot, and
        // its name is the sandbox's `alias` (the SDKs' `get_info().name`).
        let catalog_name = self.shared.catalog.find(&req.template).map(|t| t.name);
        let key = match self.shared.catalog.resolve(&req.template) {
            Some(build) => build?,
            None => req.template.clone(),
        };
        let snap = self
            .snapshot_when_built(&key)?
            .ok_or_else(|| OrchError::BadRequest(format!("template {} not found", req.template)))?;
        let _claims = self.claim_mounts(
            &format!("snapshot {}", snap.id),
            &snap.settings.volume_mounts,
        )?;
        let resources = snap.settings.resources;
        for (field, asked, has) in [
            ("cpuCount", req.cpu_count, resources.cpu_count),
            ("memoryMB", req.memory_mb, resources.memory_mb),
        ] {
            if asked.is_some_and(|a| a != has) {
                return Err(OrchError::BadRequest(format!(
                    "{field} must equal the template's value {has}: a restored snapshot cannot change it"
                )));
            }
        }
        let launcher = &self.shared.launcher;
        let params = if is_empty_params(&req.params) {
            snap.settings.custom_extension_params.clone()
        } else if !launcher.hooks.enabled() {
            return Err(crate::hooks::HookError::Disabled.into());
        } else {
            req.params.clone()
        };
        let mut env_vars = snap.settings.env_vars.clone();
        env_vars.extend(req.request.env_vars.clone());
        let settings = SandboxSettings {
            template_id: snap.id.clone(),
            alias: catalog_name.or_else(|| snap.name.clone()),
            resources,
            timeout_secs: req.request.timeout_secs,
            auto_pause: req.request.auto_pause,
            auto_pause_memory: req.request.auto_pause_memory,
            auto_resume: req.request.auto_resume,
            internet_access: req.request.internet_access(launcher.outbound),
            ingress: req.request.ingress,
            network: req.request.network.clone(),
            metadata: req.request.metadata,
            env_vars,
            image_env: snap.settings.image_env.clone(),
            custom_extension_params: params,
            // A snapshot's guest has its volumes mounted already; the request adds more.
            volume_mounts: snap
                .settings
                .volume_mounts
                .iter()
                .cloned()
                .chain(req.request.volume_mounts)
                .collect(),
        };
        // A template built with POST /templates keeps standbys from its first use on.
        let standby = snap.template.as_ref().and_then(|t| {
            let cap = t.standbys;
            launcher
                .standby
                .want(&snap.id, &snap.capture, resources, cap);
            launcher.standby.claim(&snap.id, &*launcher.net)
        });
        let info = operations::clone_from_capture(
            &self.shared.registry,
            launcher,
            &snap.capture,
            settings,
            standby,
        )?;
        self.shared.snapshots.note_spawn(&snap.id);
        Ok(info)
    }

    /// `POST …/fork`: `count` children from one checkpoint; each entry is the child or its
    /// error.
    fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<u64>,
    ) -> Result<Vec<Result<SandboxInfo, OrchError>>, OrchError> {
        let _claims = self.claim_sandbox_mounts(id)?;
        let shared = &self.shared;
        self.on_state_disk(DiskUse::Create, || {
            operations::fork(
                &shared.registry,
                &shared.launcher,
                &shared.snapshots,
                id,
                count,
                timeout_secs,
            )
        })
    }

    /// `PATCH …/custom-extension-params` (custom-extension.md §10.11, after the body checks): 404, 409 when
    /// not running, 400 when the extension is disabled, 502 when the hook failed; else the
    /// new full params, stored before the answer.
    fn patch_params(
        &self,
        id: &str,
        patch: serde_json::Value,
    ) -> Result<serde_json::Value, OrchError> {
        let entry = self.entry(id)?;
        admit(&entry, id, Call::PatchParams)?;
        let hooks = &self.shared.launcher.hooks;
        if !hooks.enabled() {
            return Err(crate::hooks::HookError::Disabled.into());
        }
        if !entry.begin_patch() {
            return Err(OrchError::Conflict(format!(
                "sandbox {id} is {}",
                entry.state().name()
            )));
        }
        let result = hooks.patch_params(id, &patch);
        // Stored durably before the answer (custom-extension.md §10.3).
        let result = result.map_err(OrchError::from).and_then(|params| {
            let info = {
                entry.update(|info| {
                    info.settings.custom_extension_params = params.clone();
                    info.clone()
                })
            };
            operations::save_running(&self.shared.registry.dir(id), &info)?;
            Ok(params)
        });
        let result = self.shared.disk.classify(DiskUse::Record, result);
        entry.end_patch();
        result
    }

    /// The guest agent of a running sandbox, for a call that `call` admits.
    fn agent_for(
        &self,
        entry: &SandboxEntry,
        id: &str,
        call: Call,
    ) -> Result<Arc<AgentClient>, OrchError> {
        admit(entry, id, call)?;
        if let Some(pause) = entry.read(|i| i.paused_on_io_error.clone()) {
            return Err(OrchError::InsufficientStorage(pause.message.clone()));
        }
        entry
            .runtime()
            .map(|rt| rt.agent)
            .ok_or_else(|| OrchError::Conflict(format!("sandbox {id} is not running")))
    }

    /// `POST …/commands`.
    fn run_command(&self, id: &str, req: CommandRequest) -> Result<ExecResult, OrchError> {
        let entry = self.entry(id)?;
        let agent = self.agent_for(&entry, id, Call::Commands)?;
        let limit = self.shared.config.agent.max_concurrent_commands;
        let _permit = CommandPermit::take(&entry, limit)?;
        let env = entry
            .read(|info| merged_env(&info.settings.image_env, &info.settings.env_vars, &req.env));
        let exec = ExecRequest {
            cmd: req.cmd,
            args: req.args,
            env,
            cwd: req.cwd,
            timeout_ms: req.timeout_ms,
            max_output_bytes: self.shared.config.agent.max_output_bytes,
        };
        Ok(agent.exec(&exec)?)
    }

    /// `GET …/files`.
    fn read_file(&self, id: &str, path: &str) -> Result<FileDownload, OrchError> {
        let entry = self.entry(id)?;
        let agent = self.agent_for(&entry, id, Call::Commands)?;
        Ok(agent.read_file(path)?)
    }

    /// `PUT …/files`.
    fn write_file(
        &self,
        id: &str,
        path: &str,
        len: u64,
        body: &mut dyn std::io::Read,
    ) -> Result<(), OrchError> {
        let entry = self.entry(id)?;
        let agent = self.agent_for(&entry, id, Call::Commands)?;
        Ok(agent.write_file(path, len, body)?)
    }

    /// How the envd proxy reaches sandbox `id`, if at all.
    pub fn envd_route(&self, id: &str) -> EnvdRoute {
        envd::route(&self.shared.registry, id)
    }

    /// Where traffic for sandbox `id` goes (the one entry point of the envd proxy, for
    /// envd and every other port): as [`Orchestrator::envd_route`], except that a paused
    /// sandbox with `autoResume` is resumed first; the caller waits for that at most
    /// `[sandbox] auto_resume_wait_secs` (then 503), and concurrent callers share the
    /// one resume. Errors: the resume's own (429 at capacity, 502 when start-resume
    /// failed, ...), 409 for a filesystem-only pause, 503 during shutdown.
    fn route_waking(&self, id: &str) -> Result<EnvdRoute, OrchError> {
        let route = envd::route(&self.shared.registry, id);
        if matches!(
            route,
            EnvdRoute::Running(_) | EnvdRoute::PausedOnIoError { .. } | EnvdRoute::Unknown
        ) {
            return Ok(route);
        }
        self.refuse_when_shutting_down()?;
        let wait = Duration::from_secs(self.shared.config.sandbox.auto_resume_wait_secs);
        let shared = &self.shared;
        self.on_state_disk(DiskUse::Resume, || {
            wake::route_waking(&shared.registry, &shared.launcher, id, wait)
        })
    }

    /// Sends the guest of sandbox `id` at `addr` its `/init` (the env of `target`) unless
    /// VM `target.instance` already got it; blocks up to 10 s on the guest.
    pub fn init_guest(&self, id: &str, target: &EnvdTarget, addr: std::net::SocketAddr) {
        envd::init_guest(&self.shared.registry, id, target, addr)
    }

    /// Whether VM `instance` still runs sandbox `id`.
    pub fn envd_instance_alive(&self, id: &str, instance: u64) -> bool {
        envd::instance_alive(&self.shared.registry, id, instance)
    }

    /// Graceful shutdown (custom-extension.md §9.1): refuse new work, pause every running sandbox (stop
    /// reason `shutdown`; one whose pause fails is kept, never deleted), give pending stop
    /// retries a final attempt, release the network.
    ///
    /// Bounded by `[server] shutdown_timeout_secs`: returns `false` when that ran out
    /// (the caller exits with status 1; the VMs die with the process and their journal
    /// entries stay open for the next start, custom-extension.md §9.1).
    fn shutdown(&self) -> bool {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        let (registry, launcher) = (self.shared.registry.clone(), self.shared.launcher.clone());
        std::thread::spawn(move || {
            shutdown_all(&registry, &launcher);
            let _ = done_tx.send(());
        });
        let limit = Duration::from_secs(self.shared.config.server.shutdown_timeout_secs);
        let finished = done_rx.recv_timeout(limit).is_ok();
        if !finished {
            log::error!(
                "op=shutdown result=timeout after={}s; remaining VMs are killed with the server",
                limit.as_secs()
            );
        }
        self.shared.volumes.unmount_all();
        finished
    }
}

/// Discards the standbys, pauses every running sandbox (stop reason `shutdown`), then
/// final stop attempts and the network teardown.
fn shutdown_all(registry: &Arc<Registry>, launcher: &Launcher) {
    launcher.standby.drain(&*launcher.net);
    // The shutdown pauses quit their VMs: a kept one would die with the server.
    launcher.kept.drain();
    let ids = registry.ids();
    log::info!("op=shutdown sandboxes={}", ids.len());
    let handles: Vec<_> = ids
        .into_iter()
        .map(|id| {
            let registry = registry.clone();
            std::thread::spawn(move || {
                // A sandbox that could not be paused is never deleted: its VM ends
                // with the server, and what is stored of it stays.
                if let Err(e) =
                    operations::pause(&registry, &id, StopReason::Shutdown, PauseRequest::FULL)
                {
                    log::error!("sandboxId={id} op=shutdown_pause result=kept error=\"{e}\"");
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
    launcher.hooks.shutdown();
    launcher.net.shutdown();
}

/// Deletes one sandbox once no other lifecycle operation runs on it: unregister (so it
/// disappears), then let its supervisor tear everything down and wait for it.
pub(crate) fn delete(registry: &Registry, id: &str, reason: StopReason) -> Result<(), OrchError> {
    let entry = registry.entry(id)?;
    let Admitted::Proceed(_guard) = admit(&entry, id, Call::Delete)? else {
        return Err(OrchError::sandbox_not_found(id));
    };
    registry.unregister(id);
    entry.set_state(SandboxState::Deleting)?;
    // No patch-params may follow the instance's stop (custom-extension.md §6.4).
    entry.wait_patches();
    let runtime = entry.take_runtime();
    if let Some(runtime) = runtime {
        runtime.delete(reason);
    } else {
        // Paused: no VM but maybe a kept one, no hook (its stop was sent when it paused).
        registry.discard_kept(id);
        let dir = registry.dir(id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            log::warn!("sandboxId={id} op=delete path={} error={e}", dir.display());
        }
    }
    log::info!("sandboxId={id} op=delete result=ok");
    Ok(())
}

/// Paused sandboxes from their records; the directories of sandboxes that were running
/// when the server stopped are removed (their VMs died with it).
fn load_sandboxes(dir: &std::path::Path) -> HashMap<String, Arc<SandboxEntry>> {
    let loaded = records::load_all(dir);
    for stale in loaded.stale {
        if let Err(e) = std::fs::remove_dir_all(&stale) {
            log::warn!("op=recover path={} error={e}", stale.display());
        }
    }
    loaded
        .paused
        .into_iter()
        .map(|(_, mut record)| {
            // Records from before `pauseMode`: their capture says what it kept.
            let fs_only = record.paused.as_ref().is_some_and(|c| c.filesystem_only);
            let mode = *record.info.pause_mode.get_or_insert(if fs_only {
                PauseMode::Filesystem
            } else {
                PauseMode::Full
            });
            log::info!(
                "sandboxId={} op=recover result=paused mode={}",
                record.info.id,
                mode.name()
            );
            let id = record.info.id.clone();
            let entry = SandboxEntry::new(record.info, None);
            entry.set_paused_capture(record.paused);
            (id, Arc::new(entry))
        })
        .collect()
}

/// Absent, `null` and `{}` are the same (custom-extension.md §10.1).
fn is_empty_params(v: &serde_json::Value) -> bool {
    v.is_null() || v.as_object().is_some_and(|m| m.is_empty())
}

/// Sets `endAt` to now + `secs`; [`ExpiryChange::AtLeast`] takes only a later expiry.
pub(crate) fn extend_expiry(entry: &SandboxEntry, secs: u64, change: ExpiryChange) {
    let new_end = SystemTime::now() + Duration::from_secs(secs);
    entry.update(|info| {
        if change == ExpiryChange::Set || new_end > info.end_at {
            info.end_at = new_end;
        }
    });
}

/// Image env, then sandbox env, then request env; later wins. PATH defaults.
fn merged_env(
    image: &[(String, String)],
    sandbox: &BTreeMap<String, String>,
    request: &BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let mut merged: BTreeMap<String, String> = BTreeMap::new();
    merged.insert("PATH".into(), DEFAULT_PATH.into());
    let image = image.iter().map(|(k, v)| (k, v));
    for (k, v) in image.chain(sandbox).chain(request) {
        merged.insert(k.clone(), v.clone());
    }
    merged.into_iter().collect()
}

/// Counts a running command against the per-sandbox limit for as long as it lives.
struct CommandPermit<'a> {
    entry: &'a SandboxEntry,
}

impl<'a> CommandPermit<'a> {
    fn take(entry: &'a SandboxEntry, limit: u32) -> Result<CommandPermit<'a>, OrchError> {
        if !entry.begin_command(limit) {
            return Err(OrchError::TooMany(format!(
                "{limit} commands are already running in this sandbox (agent.max_concurrent_commands)"
            )));
        }
        Ok(CommandPermit { entry })
    }
}

impl Drop for CommandPermit<'_> {
    fn drop(&mut self) {
        self.entry.end_command();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_merge_order_and_default_path() {
        let image = vec![("A".to_string(), "image".to_string())];
        let sandbox = BTreeMap::from([("A".to_string(), "sandbox".to_string())]);
        let request = BTreeMap::from([("B".to_string(), "req".to_string())]);
        let env = merged_env(&image, &sandbox, &request);
        assert!(env.contains(&("A".into(), "sandbox".into())));
        assert!(env.contains(&("B".into(), "req".into())));
        assert!(env.contains(&("PATH".into(), DEFAULT_PATH.into())));
        let image = vec![("PATH".to_string(), "/x".to_string())];
        let env = merged_env(&image, &BTreeMap::new(), &BTreeMap::new());
        assert!(env.contains(&("PATH".into(), "/x".into())));
    }

    #[test]
    fn state_transitions() {
        use SandboxState::*;
        assert!(Creating.valid_transition(Running).is_ok());
        assert!(Running.valid_transition(Deleting).is_ok());
        assert!(
            Deleting.valid_transition(Deleting).is_ok(),
            "a move to itself is no move"
        );
        let refused = Deleting.valid_transition(Running).unwrap_err();
        assert_eq!(refused.status(), 409);
        assert!(refused
            .message()
            .contains("deleting sandbox cannot become running"));
        assert!(
            Paused.valid_transition(Running).is_err(),
            "a resume passes resuming"
        );
        assert_eq!(Running.api_state(), Some("running"));
        assert_eq!(Creating.api_state(), None);
    }
}
