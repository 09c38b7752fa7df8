//! Template builds from images (api.md §4.15, custom-extension.md §5.9): boot an internal build sandbox
//! (start-fresh with `{}`), run `startCmd`, capture it with the disk frozen, stop it (stop
//! reason `template-build`). The result is a snapshot with a name that `POST /sandboxes`
//! starts from. Builds run in the background, at most `[templates]
//! max_concurrent_builds` at once; their status is durable, and a build interrupted by a
//! restart becomes `error`.

use super::operations;
use super::sandbox::{Op, SandboxInfo};
use super::settings::{Resources, SandboxSettings};
use super::snapshots::{SnapshotRecord, TemplateSource};
use super::start::{StartKind, StartRequest};
use super::supervisor::{PauseOutcome, RunDir, Unwatched};
use super::{OrchError, Shared};
use crate::agent::ExecRequest;
use crate::hooks::StopReason;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

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
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
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
        let updated = {
            let mut builds = self.builds.lock();
            builds.get_mut(id).map(|b| {
                b.status = status;
                b.reason = reason;
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
    crate::store::ensure_private_dir(dir).map_err(|e| OrchError::Internal(e.to_string()))?;
    let bytes = serde_json::to_vec_pretty(b)
        .map_err(|e| OrchError::Internal(format!("cannot encode build record: {e}")))?;
    crate::store::write_atomic(&dir.join(format!("{}.json", b.id)), &bytes, 0o600)
        .map_err(|e| OrchError::Internal(e.to_string()))
}

/// `POST /templates`: registers the build (`waiting`) and starts it in the background.
pub(crate) fn submit(
    shared: &Arc<Shared>,
    req: TemplateRequest,
) -> Result<TemplateBuild, OrchError> {
    let id = crate::util::new_id();
    shared.snapshots.reserve_name(&req.name, &id)?;
    let now = SystemTime::now();
    let build = TemplateBuild {
        id: id.clone(),
        name: req.name.clone(),
        image: req.image.clone(),
        start_cmd: req.start_cmd.clone(),
        env_vars: req.env_vars.clone(),
        resources: req.resources,
        status: BuildStatus::Waiting,
        reason: None,
        created_at: now,
        updated_at: now,
        progress: BuildProgress::default(),
    };
    if let Err(e) = save(&shared.builds.dir, &build) {
        shared.snapshots.release_name(&req.name);
        return Err(e);
    }
    shared
        .builds
        .builds
        .lock()
        .insert(id.clone(), build.clone());
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
    Ok(build)
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
    let builds = &shared.builds;
    builds.update(id, BuildStatus::Building, None);
    let progress = builds.find(id).map(|b| b.progress).unwrap_or_default();
    let result = build(shared, id, &req, &progress);
    match result {
        Ok(()) => {
            builds.update(id, BuildStatus::Ready, None);
            log::info!(
                "templateId={id} name={} op=template_build result=ready",
                req.name
            );
        }
        Err(e) => {
            shared.snapshots.release_name(&req.name);
            let _ = std::fs::remove_dir_all(shared.snapshots.dir(id));
            log::warn!("templateId={id} op=template_build result=error reason=\"{e}\"");
            builds.update(id, BuildStatus::Error, Some(e.to_string()));
        }
    }
    shared.operations.record(
        "template_build",
        builds
            .find(id)
            .is_some_and(|b| b.status == BuildStatus::Ready),
    );
}

/// The build itself. The build sandbox is internal: its id is never shown by the API.
fn build(
    shared: &Arc<Shared>,
    template_id: &str,
    req: &TemplateRequest,
    progress: &BuildProgress,
) -> Result<(), OrchError> {
    let image = shared.images.prepare_rootfs_with(
        &req.image,
        req.resources.disk_size_mb,
        &progress.image,
    )?;
    progress.set(BuildPhase::Booting);
    let sandbox_id = crate::util::new_id();
    let run_dir = RunDir::create(
        shared
            .config
            .server
            .state_dir
            .join("template-builds")
            .join(&sandbox_id),
    )?;
    let settings = SandboxSettings {
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
        custom_extension_params: serde_json::json!({}),
    };
    // The build VM's RAM lives in the template's directory: its capture then holds only
    // device state, and every sandbox created from the template maps the RAM file
    // copy-on-write instead of loading it (the fast path of create-from-template).
    let template_dir = shared.snapshots.dir(template_id);
    crate::store::ensure_private_dir(&template_dir)
        .map_err(|e| OrchError::Internal(e.to_string()))?;
    let booted = operations::boot_fresh(
        &shared.launcher,
        &image,
        StartRequest {
            id: sandbox_id.clone(),
            run_dir,
            kind: StartKind::Fresh {
                memory_file: Some(template_dir.join("memory.ram")),
            },
            resources: settings.resources,
            internet_access: settings.internet_access,
            params: settings.custom_extension_params.clone(),
            failed_reason: StopReason::TemplateBuild,
            // Never registered: nothing to forget or mark.
            watch: Box::new(Unwatched),
        },
    )?;
    let (ops, agent) = (&booted.runtime.ops, &booted.runtime.agent);
    let stop_build = || booted.runtime.delete(StopReason::TemplateBuild);
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
            stop_build();
            return Err(OrchError::BadRequest(reason));
        }
    }
    progress.set(BuildPhase::Capturing);
    let (tx, rx) = crossbeam_channel::bounded(1);
    ops.send(Op::Snapshot {
        dir: shared.snapshots.dir(template_id),
        run_on: false,
        reply: tx,
    })
    .map_err(|_| OrchError::Internal("the build VM is gone".into()))?;
    let captured = rx.recv();
    stop_build();
    let capture = match captured {
        Ok(Ok(c)) => c,
        Ok(Err(PauseOutcome::RanOn(e) | PauseOutcome::Gone(e))) => return Err(e),
        _ => return Err(OrchError::Internal("the build VM is gone".into())),
    };
    let info = SandboxInfo::new(
        sandbox_id,
        settings,
        std::net::Ipv4Addr::UNSPECIFIED,
        PathBuf::new(),
    );
    let mut record = SnapshotRecord::new(
        template_id.to_string(),
        Some(req.name.clone()),
        &info,
        capture,
    );
    record.template = Some(TemplateSource {
        image: req.image.clone(),
        start_cmd: req.start_cmd.clone(),
    });
    let capture = record.capture.clone();
    shared.snapshots.insert(record)?;
    // Built to be used: its standbys start now.
    shared
        .launcher
        .standby
        .want(template_id, &capture, req.resources);
    Ok(())
}
