//! Template builds from images (api.md §4.15, custom-extension.md §5.9): boot an internal build sandbox
//! (start-fresh with `{}`), run `startCmd`, capture it with the disk frozen, stop it (stop
//! reason `template-build`). The result is a snapshot with a name that `POST /sandboxes`
//! starts from. Builds run in the background, at most `[templates]
//! max_concurrent_builds` at once; their status is durable, and a build interrupted by a
//! restart becomes `error`.

use super::build_steps::{StepFailure, StepRunner};
use super::catalog::{BuildIds, CatalogTemplate};
use super::operations;
use super::sandbox::{Op, SandboxInfo};
use super::settings::{Resources, SandboxSettings};
use super::snapshots::{SnapshotRecord, TemplateSource};
use super::start::{StartKind, StartRequest};
use super::state_disk::DiskUse;
use super::steps::{BuildBase, BuildSpec, StepState};
use super::supervisor::{BuildWatch, PauseOutcome, RunDir};
use super::{OrchError, Shared};
use crate::agent::ExecRequest;
use crate::hooks::StopReason;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Most log entries a build keeps (later ones are counted, not kept).
const MAX_LOG_ENTRIES: usize = 20_000;

/// Most of a failed startCmd's stderr kept in the build's `reason`.
const STDERR_TAIL: usize = 4096;

/// A build request, checked field by field by the API.
#[derive(Debug, Clone)]
pub struct TemplateRequest {
    pub name: String,
    pub image: String,
    pub resources: Resources,
    pub start_cmd: Option<String>,
    pub env_vars: BTreeMap<String, String>,
    /// An E2B build (`/v3/templates`): its catalog template, tags and steps.
    pub catalog: Option<CatalogBuild>,
}

/// What an E2B build belongs to and runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CatalogBuild {
    pub template_id: String,
    pub tags: Vec<String>,
    /// Set when the build is started (`POST /v2/templates/{id}/builds/{buildID}`).
    pub spec: Option<BuildSpec>,
}

/// A log entry's level (E2B's `LogLevel`), lowest first: build logs and sandbox logs
/// ([`super::sandbox_log`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warn",
            LogLevel::Error => "error",
        }
    }

    pub const ALL: [LogLevel; 4] = [
        LogLevel::Debug,
        LogLevel::Info,
        LogLevel::Warn,
        LogLevel::Error,
    ];
}

/// One line of a build's log (E2B's `BuildLogEntry`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogEntry {
    pub timestamp: SystemTime,
    pub level: LogLevel,
    pub message: String,
    pub step: Option<String>,
}

/// A build's log, shared by its build thread and readers; bounded.
#[derive(Debug, Clone, Default)]
pub struct BuildLog(Arc<Mutex<Vec<LogEntry>>>);

impl BuildLog {
    pub fn push(&self, level: LogLevel, message: String, step: Option<&str>) {
        let mut log = self.0.lock();
        if log.len() < MAX_LOG_ENTRIES {
            log.push(LogEntry {
                timestamp: SystemTime::now(),
                level,
                message,
                step: step.map(str::to_string),
            });
        }
    }

    pub fn entries(&self) -> Vec<LogEntry> {
        self.0.lock().clone()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Waiting => "waiting",
            BuildStatus::Building => "building",
            BuildStatus::Ready => "ready",
            BuildStatus::Error => "error",
        }
    }
}

/// What a build is doing, as `GET /templates/{id}` shows it (api.md §4.15).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildPhase {
    Queued,
    Pulling,
    Unpacking,
    BuildingDisk,
    Booting,
    StartCmd,
    Capturing,
    Ready,
    Failed,
}

impl BuildPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildPhase::Queued => "queued",
            BuildPhase::Pulling => "pulling",
            BuildPhase::Unpacking => "unpacking",
            BuildPhase::BuildingDisk => "building_disk",
            BuildPhase::Booting => "booting",
            BuildPhase::StartCmd => "start_cmd",
            BuildPhase::Capturing => "capturing",
            BuildPhase::Ready => "ready",
            BuildPhase::Failed => "failed",
        }
    }
}

/// A build's progress, shared by its build thread and readers. Not stored: a restart
/// ends every running build.
#[derive(Debug, Clone, Default)]
pub struct BuildProgress {
    /// Set once the image is ready (the VM steps); before that the image's phase counts.
    vm_phase: Arc<Mutex<Option<BuildPhase>>>,
    image: crate::image::Progress,
    pub log: BuildLog,
    /// Set when the template is deleted during the build: the build stops.
    pub cancelled: Arc<AtomicBool>,
}

impl BuildProgress {
    fn set(&self, phase: BuildPhase) {
        *self.vm_phase.lock() = Some(phase);
    }

    fn phase(&self) -> BuildPhase {
        use crate::image::ImagePhase;
        if let Some(p) = *self.vm_phase.lock() {
            return p;
        }
        match self.image.phase() {
            ImagePhase::Pulling => BuildPhase::Pulling,
            ImagePhase::Unpacking => BuildPhase::Unpacking,
            ImagePhase::BuildingDisk => BuildPhase::BuildingDisk,
            ImagePhase::Done => BuildPhase::Booting,
        }
    }
}

/// One template build, as `GET /templates` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateBuild {
    pub id: String,
    pub name: String,
    pub image: String,
    pub start_cmd: Option<String>,
    pub env_vars: BTreeMap<String, String>,
    #[serde(flatten)]
    pub resources: Resources,
    pub status: BuildStatus,
    pub reason: Option<String>,
    /// The step a failed E2B build failed in (1-based, or `base` / `finalize`).
    #[serde(default)]
    pub reason_step: Option<String>,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    #[serde(default)]
    pub catalog: Option<CatalogBuild>,
    /// The log of a finished build (a running one's is in `progress`).
    #[serde(default)]
    pub logs: Vec<LogEntry>,
    /// The step cache entries this build made or used (kept while the record is).
    #[serde(default)]
    pub cache_keys: Vec<String>,
    #[serde(skip)]
    pub progress: BuildProgress,
}

impl TemplateBuild {
    pub fn phase(&self) -> BuildPhase {
        match self.status {
            BuildStatus::Waiting => BuildPhase::Queued,
            BuildStatus::Building => self.progress.phase(),
            BuildStatus::Ready => BuildPhase::Ready,
            BuildStatus::Error => BuildPhase::Failed,
        }
    }

    /// The build's log so far.
    pub fn log_entries(&self) -> Vec<LogEntry> {
        let live = self.progress.log.entries();
        if live.is_empty() {
            self.logs.clone()
        } else {
            live
        }
    }

    /// The image's layer bytes (local so far, in all), from the manifest's sizes; (0, 0)
    /// when not known (a build of an earlier server run).
    pub fn pull_bytes(&self) -> (u64, u64) {
        self.progress.image.bytes()
    }
}

/// The builds, and the queue of waiting ones. Waiting builds hold no thread: at most
/// `[templates] max_concurrent_builds` build threads exist, each taking the next waiting
/// build when it finishes one.
pub(crate) struct Builds {
    dir: PathBuf,
    builds: Mutex<BTreeMap<String, TemplateBuild>>,
    queue: Mutex<BuildQueue>,
}

#[derive(Default)]
struct BuildQueue {
    waiting: VecDeque<(String, TemplateRequest)>,
    threads: usize,
}

impl Builds {
    /// Loads the build records; unfinished builds become `error` (api.md §4.15).
    pub fn load(dir: PathBuf) -> Builds {
        let mut builds = BTreeMap::new();
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let Some(mut b) = std::fs::read(entry.path())
                    .ok()
                    .and_then(|t| serde_json::from_slice::<TemplateBuild>(&t).ok())
                else {
                    continue;
                };
                if matches!(b.status, BuildStatus::Waiting | BuildStatus::Building) {
                    b.status = BuildStatus::Error;
                    b.reason = Some("interrupted by server restart".into());
                    b.updated_at = SystemTime::now();
                    let _ = save(&dir, &b);
                }
                builds.insert(b.id.clone(), b);
            }
        }
        Builds {
            dir,
            builds: Mutex::new(builds),
            queue: Mutex::new(BuildQueue::default()),
        }
    }

    pub fn list(&self) -> Vec<TemplateBuild> {
        self.builds.lock().values().cloned().collect()
    }

    /// By id, or by name.
    pub fn find(&self, id_or_name: &str) -> Option<TemplateBuild> {
        let builds = self.builds.lock();
        builds
            .get(id_or_name)
            .or_else(|| builds.values().find(|b| b.name == id_or_name))
            .cloned()
    }

    fn update(&self, id: &str, status: BuildStatus, reason: Option<String>) {
        self.change(id, |b| {
            b.status = status;
            b.reason = reason;
        });
    }

    /// Changes a build's record and stores it.
    fn change(&self, id: &str, f: impl FnOnce(&mut TemplateBuild)) {
        let updated = {
            let mut builds = self.builds.lock();
            builds.get_mut(id).map(|b| {
                f(b);
                b.updated_at = SystemTime::now();
                b.clone()
            })
        };
        if let Some(b) = updated {
            if let Err(e) = save(&self.dir, &b) {
                log::warn!("templateId={id} op=save_build error=\"{e}\"");
            }
        }
    }

    /// Forgets a finished build (its template is deleted).
    pub fn remove(&self, id: &str) {
        self.builds.lock().remove(id);
        let _ = std::fs::remove_file(self.dir.join(format!("{id}.json")));
    }
}

fn save(dir: &std::path::Path, b: &TemplateBuild) -> Result<(), OrchError> {
    crate::store::ensure_private_dir(dir)?;
    Ok(crate::store::write_json(
        &dir.join(format!("{}.json", b.id)),
        b,
    )?)
}

/// The E2B SDKs' default template.
pub const BASE_TEMPLATE: &str = "base";

/// At startup (`[templates] build_base`) and after a failed build of it
/// ([`super::base`]): builds `base` from the built-in image in the background unless a
/// template (or a build under way) already has the name.
pub(crate) fn ensure_base(shared: &Arc<Shared>) {
    if shared.catalog.find(BASE_TEMPLATE).is_some()
        || shared.snapshots.lookup(BASE_TEMPLATE).is_some()
    {
        return;
    }
    if let Err(e) = shared.disk.check(DiskUse::Build) {
        log::warn!(
            "op=template_build name={BASE_TEMPLATE} result=insufficient_storage \
             reason=\"{e}\" (built at the next start with room)"
        );
        return;
    }
    let vm = &shared.config.vm;
    let image = format!("oci:{}", vm.assets_dir.join("base-image").display());
    let req = TemplateRequest {
        name: BASE_TEMPLATE.into(),
        image: image.clone(),
        resources: super::settings::Resources {
            cpu_count: vm.default_cpu_count,
            memory_mb: vm.default_memory_mb,
            disk_size_mb: vm.default_disk_size_mb,
        },
        start_cmd: None,
        env_vars: BTreeMap::new(),
        catalog: None,
    };
    match submit(shared, req) {
        Ok(b) => log::info!(
            "templateId={} op=template_build name={BASE_TEMPLATE} image={image} \
             result=queued reason=\"no template named {BASE_TEMPLATE}\"",
            b.id
        ),
        // Reserved meanwhile (a build record): nothing to do.
        Err(OrchError::Conflict(_)) => {}
        Err(e) => log::warn!("op=template_build name={BASE_TEMPLATE} error=\"{e}\""),
    }
}

/// `POST /templates`: registers the build (`waiting`) and starts it in the background.
pub(crate) fn submit(
    shared: &Arc<Shared>,
    req: TemplateRequest,
) -> Result<TemplateBuild, OrchError> {
    let id = crate::util::new_id();
    if shared.catalog.find(&req.name).is_some() {
        return Err(OrchError::Conflict(format!(
            "name {} is already used by a template",
            req.name
        )));
    }
    shared.snapshots.reserve_name(&req.name, &id)?;
    let build = new_build(&id, &req);
    if let Err(e) = save(&shared.builds.dir, &build) {
        shared.snapshots.release_name(&req.name);
        return Err(e);
    }
    shared
        .builds
        .builds
        .lock()
        .insert(id.clone(), build.clone());
    enqueue(shared, &id, req);
    Ok(build)
}

fn new_build(id: &str, req: &TemplateRequest) -> TemplateBuild {
    let now = SystemTime::now();
    TemplateBuild {
        id: id.to_string(),
        name: req.name.clone(),
        image: req.image.clone(),
        start_cmd: req.start_cmd.clone(),
        env_vars: req.env_vars.clone(),
        resources: req.resources,
        status: BuildStatus::Waiting,
        reason: None,
        reason_step: None,
        created_at: now,
        updated_at: now,
        catalog: req.catalog.clone(),
        logs: Vec::new(),
        cache_keys: Vec::new(),
        progress: BuildProgress::default(),
    }
}

/// Queues a registered build; starts a build thread when fewer than allowed run.
fn enqueue(shared: &Arc<Shared>, id: &str, req: TemplateRequest) {
    let id = id.to_string();
    let mut queue = shared.builds.queue.lock();
    queue.waiting.push_back((id.clone(), req));
    if queue.threads < shared.config.templates.max_concurrent_builds as usize {
        let thread_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("tpl-{}", &id[id.len() - 8..]))
            .spawn(move || run_builds(&thread_shared));
        match spawned {
            Ok(_) => queue.threads += 1,
            // A running build thread takes it later; with none, it stays waiting and
            // the next submit starts a thread.
            Err(e) => log::warn!(
                "templateId={id} op=template_build error=\"cannot start a build thread: {e}\""
            ),
        }
    }
}

/// `POST /v3/templates`: a new build of template `name` (made when new), waiting for its
/// steps (`POST /v2/templates/{id}/builds/{buildID}`).
pub(crate) fn request_build(
    shared: &Arc<Shared>,
    name: &str,
    tags: Vec<String>,
    resources: super::settings::Resources,
    ids: Option<BuildIds>,
) -> Result<(CatalogTemplate, TemplateBuild), OrchError> {
    if shared.catalog.find(name).is_none() && shared.snapshots.lookup(name).is_some() {
        return Err(OrchError::Conflict(format!(
            "name {name} is already used by a snapshot or a template built with POST /templates"
        )));
    }
    let build_id = match &ids {
        Some(ids) if shared.builds.builds.lock().contains_key(&ids.build_id) => {
            return Err(OrchError::Conflict(format!(
                "build {} exists on this node already",
                ids.build_id
            )))
        }
        Some(ids) => ids.build_id.clone(),
        None => crate::util::new_id(),
    };
    let template_id = ids.as_ref().map(|i| i.template_id.as_str());
    let template = shared.catalog.add_build(name, &build_id, template_id)?;
    let req = TemplateRequest {
        name: name.to_string(),
        image: String::new(),
        resources,
        start_cmd: None,
        env_vars: BTreeMap::new(),
        catalog: Some(CatalogBuild {
            template_id: template.id.clone(),
            tags,
            spec: None,
        }),
    };
    let build = new_build(&build_id, &req);
    if let Err(e) = save(&shared.builds.dir, &build) {
        shared.catalog.drop_build(&template.id, &build_id);
        return Err(e);
    }
    shared.builds.builds.lock().insert(build_id, build.clone());
    Ok((template, build))
}

/// `POST /v2/templates/{id}/builds/{buildID}`: starts a requested build with its steps.
/// 409 when it was started already or another build of the template is under way.
pub(crate) fn start_build(
    shared: &Arc<Shared>,
    template_id: &str,
    build_id: &str,
    spec: BuildSpec,
) -> Result<(), OrchError> {
    let template = shared
        .catalog
        .find(template_id)
        .ok_or_else(|| OrchError::NotFound(format!("template {template_id} not found")))?;
    let image = match &spec.base {
        BuildBase::Image(i) => i.clone(),
        BuildBase::Template(t) => {
            return Err(OrchError::BadRequest(format!(
                "fromTemplate ({t}) is not supported yet: build from its image (fromImage)"
            )))
        }
    };
    let req = {
        let mut builds = shared.builds.builds.lock();
        let busy = builds.values().find(|b| {
            b.id != build_id
                && matches!(b.status, BuildStatus::Waiting | BuildStatus::Building)
                && b.catalog
                    .as_ref()
                    .is_some_and(|c| c.template_id == template.id && c.spec.is_some())
        });
        if let Some(other) = busy {
            return Err(OrchError::Conflict(format!(
                "template {} is already building (build {}); wait for it to finish",
                template.name, other.id
            )));
        }
        let b = builds
            .get_mut(build_id)
            .filter(|b| {
                b.catalog
                    .as_ref()
                    .is_some_and(|c| c.template_id == template.id)
            })
            .ok_or_else(|| {
                OrchError::NotFound(format!(
                    "build {build_id} of template {template_id} not found"
                ))
            })?;
        let catalog = b.catalog.as_mut().expect("checked");
        if catalog.spec.is_some() || b.status != BuildStatus::Waiting {
            return Err(OrchError::Conflict(format!(
                "build {build_id} was started already"
            )));
        }
        catalog.spec = Some(spec.clone());
        b.image = image.clone();
        b.start_cmd = spec.start_cmd.clone();
        b.updated_at = SystemTime::now();
        TemplateRequest {
            name: b.name.clone(),
            image,
            resources: b.resources,
            start_cmd: spec.start_cmd.clone(),
            env_vars: BTreeMap::new(),
            catalog: b.catalog.clone(),
        }
    };
    if let Some(b) = shared.builds.find(build_id) {
        save(&shared.builds.dir, &b)?;
    }
    enqueue(shared, build_id, req);
    Ok(())
}

/// A build thread: builds waiting templates one after another until none waits.
fn run_builds(shared: &Arc<Shared>) {
    loop {
        let next = {
            let mut queue = shared.builds.queue.lock();
            let next = queue.waiting.pop_front();
            if next.is_none() {
                queue.threads -= 1;
            }
            next
        };
        let Some((id, req)) = next else {
            return;
        };
        run_build(shared, &id, req);
    }
}

fn run_build(shared: &Arc<Shared>, id: &str, req: TemplateRequest) {
    let started = std::time::Instant::now();
    let builds = &shared.builds;
    builds.update(id, BuildStatus::Building, None);
    let progress = builds.find(id).map(|b| b.progress).unwrap_or_default();
    // A queued build (the startup `base` one, a background one) keeps the reserve when it
    // starts, and a failure on a full disk names it, like a build answered at once.
    let result = shared
        .disk
        .check(DiskUse::Build)
        .map_err(BuildFailure::from)
        .and_then(|()| build(shared, id, &req, &progress))
        .map_err(|f| BuildFailure {
            error: shared.disk.classify_error(DiskUse::Build, f.error),
            step: f.step,
        })
        .and_then(|()| finish_catalog(shared, id, &req));
    let ok = result.is_ok();
    match result {
        Ok(()) => {
            progress
                .log
                .push(LogLevel::Info, "build finished: ready".into(), None);
            log::info!(
                "templateId={id} name={} op=template_build result=ready",
                req.name
            );
        }
        Err(f) => {
            if req.catalog.is_none() {
                shared.snapshots.release_name(&req.name);
            }
            let _ = std::fs::remove_dir_all(shared.snapshots.dir(id));
            if let Some(c) = &req.catalog {
                // A template never built leaves nothing behind; one built before keeps its tags.
                if shared
                    .catalog
                    .find(&c.template_id)
                    .is_some_and(|t| t.tags.is_empty())
                {
                    shared.catalog.drop_build(&c.template_id, id);
                }
            }
            log::warn!(
                "templateId={id} op=template_build result=error reason=\"{}\"",
                f.error
            );
            progress
                .log
                .push(LogLevel::Error, f.error.to_string(), f.step.as_deref());
        }
    }
    let entries = progress.log.entries();
    let reason = last_error(&entries);
    builds.change(id, |b| {
        b.logs = entries;
        if !ok {
            b.status = BuildStatus::Error;
            b.reason = Some(reason);
        } else {
            b.status = BuildStatus::Ready;
            b.reason = None;
        }
    });
    shared
        .operations
        .record("template_build", ok, started.elapsed());
}

/// The reason of a failed build: its last error entry.
fn last_error(entries: &[LogEntry]) -> String {
    entries
        .iter()
        .rev()
        .find(|e| e.level == LogLevel::Error)
        .map(|e| e.message.clone())
        .unwrap_or_else(|| "the build failed".into())
}

/// A failed build: the error and, for E2B builds, the step it failed in.
struct BuildFailure {
    error: OrchError,
    step: Option<String>,
}

impl From<OrchError> for BuildFailure {
    fn from(error: OrchError) -> BuildFailure {
        BuildFailure { error, step: None }
    }
}

impl From<StepFailure> for BuildFailure {
    fn from(f: StepFailure) -> BuildFailure {
        BuildFailure {
            error: OrchError::BadRequest(f.message),
            step: Some(f.step),
        }
    }
}

/// An E2B build that became ready: its tags point at it, builds no tag points at any
/// more go (snapshot, standbys, record).
fn finish_catalog(
    shared: &Arc<Shared>,
    id: &str,
    req: &TemplateRequest,
) -> Result<(), BuildFailure> {
    let Some(c) = &req.catalog else {
        return Ok(());
    };
    let finished = |b: &str| {
        shared
            .builds
            .find(b)
            .is_none_or(|b| matches!(b.status, BuildStatus::Ready | BuildStatus::Error))
    };
    let orphans = match shared
        .catalog
        .set_ready(&c.template_id, id, &c.tags, &finished)
    {
        Ok(o) => o,
        Err(e) => {
            shared.launcher.standby.forget(id, &*shared.launcher.net);
            shared.snapshots.delete(id);
            return Err(BuildFailure {
                error: e,
                step: Some(super::build_steps::FINALIZE_STEP.into()),
            });
        }
    };
    for old in orphans {
        remove_build(shared, &old);
    }
    Ok(())
}

/// Deletes a finished build: its standbys, snapshot and record. Sandboxes made from it
/// keep their own links to its layers.
pub(crate) fn remove_build(shared: &Arc<Shared>, build_id: &str) {
    shared
        .launcher
        .standby
        .forget(build_id, &*shared.launcher.net);
    shared.snapshots.delete(build_id);
    shared.builds.remove(build_id);
    collect_cache(shared);
}

/// The build itself. The build sandbox is internal: its id is never shown by the API.
fn build(
    shared: &Arc<Shared>,
    template_id: &str,
    req: &TemplateRequest,
    progress: &BuildProgress,
) -> Result<(), BuildFailure> {
    let base = |error: OrchError| BuildFailure {
        error,
        step: req.catalog.as_ref().map(|_| "base".to_string()),
    };
    if req.catalog.is_some() {
        progress
            .log
            .push(LogLevel::Info, format!("FROM {}", req.image), Some("base"));
    }
    let image = shared
        .images
        .prepare_rootfs_with(&req.image, req.resources.disk_size_mb, &progress.image)
        .map_err(|e| base(e.into()))?;
    progress.set(BuildPhase::Booting);
    let spec = req.catalog.as_ref().and_then(|c| c.spec.as_ref());
    let plan = spec.map(|spec| {
        let base = format!(
            "{}:{}",
            image.base_disk.display(),
            req.resources.disk_size_mb
        );
        shared.step_cache.plan(&base, spec)
    });
    if let Some(plan) = &plan {
        // Named now, so a collection meanwhile keeps what this build uses.
        let keys = plan.keys.clone();
        shared.builds.change(template_id, |b| b.cache_keys = keys);
    }
    let settings = build_settings(shared, req, &image);
    let cancelled = progress.cancelled.clone();
    let vm = BuildVm::boot(
        shared,
        template_id,
        &image,
        &settings,
        plan.as_ref(),
        cancelled,
    )?;
    let stop_build = || vm.booted.runtime.delete(StopReason::TemplateBuild);
    let prepared = match (spec, &plan) {
        (Some(spec), Some(plan)) => run_spec(shared, &vm, &image, spec, plan, progress),
        _ => legacy_start_cmd(shared, req, &image, &vm.booted.runtime.agent, progress)
            .map_err(BuildFailure::from),
    };
    if let Err(f) = prepared {
        stop_build();
        return Err(BuildFailure {
            error: vm.watch.named(f.error),
            step: f.step,
        });
    }
    progress.set(BuildPhase::Capturing);
    let captured = vm.capture(shared, template_id);
    stop_build();
    let capture = captured?;
    if progress.cancelled.load(Ordering::SeqCst) {
        return Err(OrchError::Conflict(
            "the build was cancelled (its template was deleted)".into(),
        )
        .into());
    }
    let info = SandboxInfo::new(
        vm.sandbox_id,
        settings,
        std::net::Ipv4Addr::UNSPECIFIED,
        PathBuf::new(),
    );
    let name = req.catalog.is_none().then(|| req.name.clone());
    let mut record = SnapshotRecord::new(template_id.to_string(), name, &info, capture);
    record.template = Some(TemplateSource {
        image: req.image.clone(),
        start_cmd: req.start_cmd.clone(),
        standbys: None,
    });
    let capture = record.capture.clone();
    shared.snapshots.insert(record)?;
    // Built to be used: its standbys start now.
    shared
        .launcher
        .standby
        .want(template_id, &capture, req.resources, None);
    Ok(())
}

/// The settings a template's sandboxes start from: the build's resources and env, the
/// configured defaults for the rest.
fn build_settings(
    shared: &Shared,
    req: &TemplateRequest,
    image: &crate::image::PreparedImage,
) -> SandboxSettings {
    SandboxSettings {
        template_id: image.reference.clone(),
        alias: None,
        resources: req.resources,
        timeout_secs: shared.config.sandbox.default_timeout_secs,
        auto_pause: true,
        auto_pause_memory: true,
        auto_resume: false,
        metadata: BTreeMap::new(),
        env_vars: req.env_vars.clone(),
        image_env: image.env.clone(),
        internet_access: shared.config.network.outbound,
        ingress: Default::default(),
        network: Default::default(),
        custom_extension_params: serde_json::json!({}),
        volume_mounts: Vec::new(),
    }
}

/// A template build's VM, booted and never registered as a sandbox.
struct BuildVm {
    sandbox_id: String,
    booted: super::start::Started,
    watch: BuildWatch,
}

impl BuildVm {
    /// Boots the build VM with its RAM in the template's directory: the capture then
    /// holds only device state, and every sandbox created from the template maps the RAM
    /// file copy-on-write instead of loading it (the fast path of create-from-template).
    /// On a step-cache hit it boots on the last cached step's disk.
    fn boot(
        shared: &Arc<Shared>,
        template_id: &str,
        image: &crate::image::PreparedImage,
        settings: &SandboxSettings,
        plan: Option<&super::step_cache::CachePlan>,
        cancelled: Arc<AtomicBool>,
    ) -> Result<BuildVm, OrchError> {
        let sandbox_id = crate::util::new_id();
        let run_dir = RunDir::create(
            crate::store::layout::StateLayout::new(&shared.config.server.state_dir)
                .template_builds()
                .join(&sandbox_id),
        )?;
        let template_dir = shared.snapshots.dir(template_id);
        crate::store::ensure_private_dir(&template_dir)?;
        let cached_disk = match plan.filter(|p| p.hit > 0) {
            Some(p) => Some(
                crate::vm::create_clone_disk(&p.layers, run_dir.path())
                    .map_err(|e| OrchError::vm("cloning the cached step's disk", e))?,
            ),
            None => None,
        };
        let watch = BuildWatch::new(cancelled);
        let start_req = StartRequest {
            id: sandbox_id.clone(),
            run_dir,
            kind: StartKind::Fresh {
                memory_file: Some(template_dir.join("memory.ram")),
                disk: cached_disk.clone(),
            },
            resources: settings.resources,
            internet_access: settings.internet_access,
            egress: settings.network.rules(),
            params: settings.custom_extension_params.clone(),
            failed_reason: StopReason::TemplateBuild,
            // Never registered: nothing to forget or mark; a death names the failure.
            watch: Box::new(watch.clone()),
            volumes: Vec::new(),
        };
        let booted = match cached_disk {
            Some(_) => super::start::start(&shared.launcher, start_req)?,
            None => operations::boot_fresh(&shared.launcher, image, start_req)?,
        };
        Ok(BuildVm {
            sandbox_id,
            booted,
            watch,
        })
    }

    /// Captures the build VM into the template's directory (the VM does not run on).
    fn capture(
        &self,
        shared: &Shared,
        template_id: &str,
    ) -> Result<crate::vm::CaptureRecord, BuildFailure> {
        let gone = || OrchError::vm_gone("capturing the built template");
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.booted
            .runtime
            .ops
            .send(Op::Snapshot {
                dir: shared.snapshots.dir(template_id),
                run_on: false,
                reply: tx,
            })
            .map_err(|_| self.watch.named(gone()))?;
        match rx.recv() {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(PauseOutcome::RanOn(e) | PauseOutcome::Gone(e))) => {
                Err(self.watch.named(e).into())
            }
            _ => Err(self.watch.named(gone()).into()),
        }
    }
}

/// Runs a build spec's steps (from the first the cache does not hold), its start and
/// ready commands, and hands the defaults over to the template's sandboxes.
fn run_spec(
    shared: &Arc<Shared>,
    vm: &BuildVm,
    image: &crate::image::PreparedImage,
    spec: &BuildSpec,
    plan: &super::step_cache::CachePlan,
    progress: &BuildProgress,
) -> Result<(), BuildFailure> {
    progress.set(BuildPhase::StartCmd);
    let (ops, agent) = (&vm.booted.runtime.ops, &vm.booted.runtime.agent);
    let addr = std::net::SocketAddr::new(vm.booted.host_ip.into(), shared.config.agent.port);
    let deadline = Instant::now() + Duration::from_secs(shared.config.templates.build_timeout_secs);
    let mut runner = StepRunner {
        addr,
        image_env: image.env.iter().cloned().collect(),
        state: StepState::default(),
        log: &progress.log,
        deadline,
        cancelled: progress.cancelled.clone(),
    };
    let copier = super::build_files::UploadedFiles {
        store: &shared.uploads,
        agent,
    };
    let mut caching = true;
    let freeze = |i: usize, runner: &StepRunner| {
        if caching {
            caching = cache_step(shared, ops, runner, &plan.keys[i], i + 1);
        }
    };
    runner
        .run_steps(&spec.steps, plan.hit, &copier, freeze)
        .and_then(|()| {
            runner.start_and_wait_ready(spec.start_cmd.as_deref(), spec.ready_cmd.as_deref())
        })
        .and_then(|()| runner.hand_over_defaults())
        .map_err(BuildFailure::from)?;
    progress.log.push(
        LogLevel::Info,
        "capturing the template".into(),
        Some(super::build_steps::FINALIZE_STEP),
    );
    Ok(())
}

/// `POST /templates`' start command: run to its end as root in `/`, with the template's
/// `envVars` (api.md §4.15).
fn legacy_start_cmd(
    shared: &Arc<Shared>,
    req: &TemplateRequest,
    image: &crate::image::PreparedImage,
    agent: &crate::agent::AgentClient,
    progress: &BuildProgress,
) -> Result<(), OrchError> {
    let mut env: BTreeMap<String, String> = image.env.iter().cloned().collect();
    env.extend(req.env_vars.clone());
    if let Some(cmd) = &req.start_cmd {
        progress.set(BuildPhase::StartCmd);
        let timeout = Duration::from_secs(shared.config.templates.start_cmd_timeout_secs);
        let ran = agent.exec(&ExecRequest {
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), cmd.clone()],
            env: env.clone().into_iter().collect(),
            cwd: "/".into(),
            timeout_ms: timeout.as_millis() as u64,
            max_output_bytes: shared.config.agent.max_output_bytes,
        });
        let failure = match ran {
            Ok(r) if r.exit_code == 0 && !r.timed_out => None,
            Ok(r) => {
                let tail_at = r.stderr.len().saturating_sub(STDERR_TAIL);
                let tail_at = (tail_at..=r.stderr.len())
                    .find(|i| r.stderr.is_char_boundary(*i))
                    .unwrap_or(r.stderr.len());
                Some(format!(
                    "startCmd exited with code {}{}; stderr: {}",
                    r.exit_code,
                    if r.timed_out { " (timed out)" } else { "" },
                    &r.stderr[tail_at..]
                ))
            }
            Err(e) => Some(format!("startCmd could not run: {e}")),
        };
        if let Some(reason) = failure {
            return Err(OrchError::BadRequest(reason));
        }
    }
    Ok(())
}

/// `DELETE /templates/{id}` of an E2B template: a build under way is cancelled (it stops
/// at its next step or wait, and cleans up after itself), every build of it goes.
pub(crate) fn delete_catalog_template(
    shared: &Arc<Shared>,
    id_or_name: &str,
) -> Result<(), OrchError> {
    let Some(t) = shared.catalog.remove(id_or_name) else {
        return Err(OrchError::NotFound(format!(
            "template {id_or_name} not found"
        )));
    };
    for build_id in &t.builds {
        match shared.builds.find(build_id).filter(|b| &b.id == build_id) {
            Some(b) if matches!(b.status, BuildStatus::Waiting | BuildStatus::Building) => {
                b.progress.cancelled.store(true, Ordering::SeqCst);
                let queued = {
                    let mut q = shared.builds.queue.lock();
                    let before = q.waiting.len();
                    q.waiting.retain(|(id, _)| id != build_id);
                    before != q.waiting.len()
                };
                if queued || b.catalog.as_ref().is_some_and(|c| c.spec.is_none()) {
                    shared.builds.update(
                        build_id,
                        BuildStatus::Error,
                        Some("cancelled: the template was deleted".into()),
                    );
                }
            }
            _ => remove_build(shared, build_id),
        }
    }
    Ok(())
}

/// `DELETE /templates/tags`.
pub(crate) fn remove_tags(
    shared: &Arc<Shared>,
    name: &str,
    tags: &[String],
) -> Result<(), OrchError> {
    let finished = |b: &str| {
        shared
            .builds
            .find(b)
            .is_none_or(|b| matches!(b.status, BuildStatus::Ready | BuildStatus::Error))
    };
    for old in shared.catalog.remove_tags(name, tags, &finished)? {
        remove_build(shared, &old);
    }
    Ok(())
}

/// Keeps step `n`'s result (the disk frozen after it) as cache entry `key`; `false` when
/// it cannot (the caller stops caching this build: its disk chain is too deep, or the
/// freeze failed), which is logged and does not fail the build.
fn cache_step(
    shared: &Arc<Shared>,
    ops: &crossbeam_channel::Sender<Op>,
    runner: &StepRunner,
    key: &str,
    n: usize,
) -> bool {
    let step = n.to_string();
    let kept = (|| {
        runner.shell(&step, "root", "sync", &[])?;
        let partial = shared.step_cache.partial_dir()?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        ops.send(Op::FreezeDisk {
            dir: partial.clone(),
            reply: tx,
        })
        .map_err(|_| "the build VM is gone".to_string())?;
        let frozen = rx
            .recv()
            .map_err(|_| "the build VM is gone".to_string())
            .and_then(|r| r);
        match frozen {
            Ok(layers) => shared.step_cache.commit(&partial, key, &layers),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&partial);
                Err(e)
            }
        }
    })();
    if let Err(why) = &kept {
        runner.log.push(
            LogLevel::Warn,
            format!("step {n} and later are not cached: {why}"),
            Some(&step),
        );
    }
    kept.is_ok()
}

/// Removes the cache entries no build record names.
pub(crate) fn collect_cache(shared: &Arc<Shared>) {
    let live: std::collections::HashSet<String> = shared
        .builds
        .list()
        .into_iter()
        .flat_map(|b| b.cache_keys)
        .collect();
    let removed = shared.step_cache.gc(&live);
    if removed > 0 {
        log::info!("op=step_cache_gc removed={removed}");
    }
}
