//! The orchestrator's front door, as Firecracker's `VmmAction`: every operation the API
//! asks of the orchestrator is one [`Request`] variant with its typed arguments, and
//! [`Orchestrator::handle`] is the one dispatch. It refuses work during shutdown, counts
//! each operation by result, times it, notes it in the sandbox's log and logs it, once for
//! every operation; the operations themselves (private methods) only do their work.
//!
//! Reads that change nothing (a sandbox's description, lists, catalogs, metrics) stay read
//! accessors: `get`, `list`, [`Orchestrator::catalog`] and [`Orchestrator::observe`].

use super::{
    idempotency, CatalogTemplate, ColdStart, CommandRequest, Connected, EnvdRoute, FromSnapshot,
    NetworkPolicy, OrchError, Orchestrator, PauseMode, PauseRequest, Resources, SandboxInfo,
    SnapshotRecord, TemplateBuild, TemplateRequest,
};
use crate::agent::{ExecResult, FileDownload};
use crate::volume::VolumeRecord;
use std::time::Instant;

/// Where a new sandbox comes from.
pub enum CreateFrom {
    /// `POST /sandboxes`, `/v2/sandboxes`: restored from a template's snapshot.
    Snapshot(FromSnapshot),
    /// `POST /sandboxes-cold`: booted from an image.
    Image(ColdStart),
}

/// How `POST …/timeout` and `…/refreshes` move a sandbox's expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiryChange {
    /// To now + the given seconds, earlier or later (`timeout`).
    Set,
    /// To now + the given seconds only when that is later (`refreshes`).
    AtLeast,
}

/// `POST …/connect` or `…/resume`: they differ in their hooks-free answer for a running
/// sandbox (connect never shortens its expiry, resume resets it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectKind {
    Connect,
    Resume,
}

/// One operation, with its typed arguments (api.md names the route of each).
pub enum Request<'a> {
    /// A new sandbox; with an `Idempotency-Key` (key, request fingerprint), a retry within
    /// the window gets the first call's sandbox (api.md §4.2).
    Create {
        from: CreateFrom,
        idempotency: Option<(String, idempotency::Fingerprint)>,
    },
    Delete {
        id: &'a str,
    },
    SetTimeout {
        id: &'a str,
        secs: u64,
        change: ExpiryChange,
    },
    /// `PUT …/network`: the egress policy, applied live.
    SetNetwork {
        id: &'a str,
        policy: NetworkPolicy,
        allow_internet: Option<bool>,
    },
    /// `from` [`PauseMode::Filesystem`] boots a paused sandbox from its disk.
    Connect {
        id: &'a str,
        secs: u64,
        kind: ConnectKind,
        from: PauseMode,
    },
    Pause {
        id: &'a str,
        request: PauseRequest,
    },
    Snapshot {
        id: &'a str,
        name: Option<String>,
    },
    Fork {
        id: &'a str,
        count: u32,
        timeout_secs: Option<u64>,
    },
    PatchParams {
        id: &'a str,
        patch: serde_json::Value,
    },
    /// The envd proxy's entry point: where traffic for a sandbox goes, waking a paused
    /// sandbox with `autoResume` first.
    Route {
        id: &'a str,
    },
    RunCommand {
        id: &'a str,
        command: CommandRequest,
    },
    ReadFile {
        id: &'a str,
        path: &'a str,
    },
    WriteFile {
        id: &'a str,
        path: &'a str,
        len: u64,
        body: &'a mut dyn std::io::Read,
    },
    /// `POST /templates`.
    SubmitTemplate(TemplateRequest),
    /// `POST /v3/templates`.
    RequestBuild {
        name: &'a str,
        tags: Vec<String>,
        resources: Resources,
        /// The ids another node chose (a cluster's build on every node), else fresh.
        ids: Option<super::BuildIds>,
    },
    /// `POST /v2/templates/{id}/builds/{buildID}`.
    StartBuild {
        template_id: &'a str,
        build_id: &'a str,
        spec: super::steps::BuildSpec,
    },
    DeleteTemplate {
        id_or_name: &'a str,
    },
    /// `PATCH /templates/{idOrName}`: the most warm standbys the template may have.
    SetTemplateStandbys {
        id_or_name: &'a str,
        standbys: u32,
    },
    /// `POST /templates/tags`: `tags` for the build `target` (`name:tag`) points at.
    AssignTags {
        target: &'a str,
        tags: &'a [String],
    },
    RemoveTags {
        name: &'a str,
        tags: &'a [String],
    },
    /// A token for the upload link of a build's files.
    GrantUpload {
        hash: &'a str,
    },
    /// The `PUT` of a build's files (a tar, maybe gzipped).
    ReceiveFiles {
        hash: &'a str,
        body: &'a mut dyn std::io::Read,
    },
    CreateVolume {
        name: &'a str,
        size_mb: Option<u64>,
    },
    DeleteVolume {
        id: &'a str,
    },
    /// At startup: the default template `base`, built in the background when missing.
    EnsureBaseTemplate,
    /// Graceful shutdown (custom-extension.md §9.1).
    Shutdown,
}

/// What an operation answers; each [`Request`] has one kind of answer, taken out with the
/// `into_*` method of that kind.
pub enum Response {
    Done,
    Sandbox(Box<SandboxInfo>),
    Connected(Box<Connected>),
    Snapshot(Box<SnapshotRecord>),
    /// Each child of a fork, or its error.
    Forked(Vec<Result<SandboxInfo, OrchError>>),
    Params(serde_json::Value),
    Route(EnvdRoute),
    Command(ExecResult),
    File(FileDownload),
    Build(Box<TemplateBuild>),
    NewBuild(Box<(CatalogTemplate, TemplateBuild)>),
    /// The build id a tag now points at.
    Tagged(String),
    UploadToken(String),
    Volume(VolumeRecord),
    /// Whether shutdown finished within its bound.
    ShutDown(bool),
}

/// `into_kind(self) -> Result<T, OrchError>` for each answer kind: a mismatch is a broken
/// invariant of the dispatch, answered as a 500, never a panic.
macro_rules! answers {
    ($($method:ident: $variant:ident => $ty:ty, |$v:ident| $out:expr;)*) => {
        impl Response {
            $(pub fn $method(self) -> Result<$ty, OrchError> {
                match self {
                    Response::$variant($v) => Ok($out),
                    other => Err(other.mismatch(stringify!($variant))),
                }
            })*
        }
    };
}

answers! {
    into_sandbox: Sandbox => SandboxInfo, |v| *v;
    into_connected: Connected => Connected, |v| *v;
    into_snapshot: Snapshot => SnapshotRecord, |v| *v;
    into_forked: Forked => Vec<Result<SandboxInfo, OrchError>>, |v| v;
    into_params: Params => serde_json::Value, |v| v;
    into_route: Route => EnvdRoute, |v| v;
    into_command: Command => ExecResult, |v| v;
    into_file: File => FileDownload, |v| v;
    into_build: Build => TemplateBuild, |v| *v;
    into_new_build: NewBuild => (CatalogTemplate, TemplateBuild), |v| *v;
    into_tagged: Tagged => String, |v| v;
    into_upload_token: UploadToken => String, |v| v;
    into_volume: Volume => VolumeRecord, |v| v;
    into_shut_down: ShutDown => bool, |v| v;
}

impl Response {
    /// For operations that answer nothing.
    pub fn into_done(self) -> Result<(), OrchError> {
        match self {
            Response::Done => Ok(()),
            other => Err(other.mismatch("Done")),
        }
    }

    fn mismatch(&self, wanted: &str) -> OrchError {
        OrchError::Internal(format!(
            "the orchestrator answered {} where {wanted} was expected",
            self.kind()
        ))
    }

    fn kind(&self) -> &'static str {
        match self {
            Response::Done => "Done",
            Response::Sandbox(_) => "Sandbox",
            Response::Connected(_) => "Connected",
            Response::Snapshot(_) => "Snapshot",
            Response::Forked(_) => "Forked",
            Response::Params(_) => "Params",
            Response::Route(_) => "Route",
            Response::Command(_) => "Command",
            Response::File(_) => "File",
            Response::Build(_) => "Build",
            Response::NewBuild(_) => "NewBuild",
            Response::Tagged(_) => "Tagged",
            Response::UploadToken(_) => "UploadToken",
            Response::Volume(_) => "Volume",
            Response::ShutDown(_) => "ShutDown",
        }
    }
}

/// What the dispatch needs to know of a request once it has been handed to its operation.
struct Ticket {
    op: &'static str,
    sandbox: Option<String>,
    /// The `agentenv_sandbox_operations_total` name, for the operations it counts.
    counted: Option<&'static str>,
    /// What the sandbox's log says on success, when the request alone tells.
    done: Option<String>,
}

impl Request<'_> {
    /// The operation's name in logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Create { .. } => "create",
            Request::Delete { .. } => "delete",
            Request::SetTimeout { .. } => "timeout",
            Request::SetNetwork { .. } => "set_network",
            Request::Connect { .. } => "resume",
            Request::Pause { .. } => "pause",
            Request::Snapshot { .. } => "snapshot",
            Request::Fork { .. } => "fork",
            Request::PatchParams { .. } => "patch_params",
            Request::Route { .. } => "route",
            Request::RunCommand { .. } => "command",
            Request::ReadFile { .. } => "read_file",
            Request::WriteFile { .. } => "write_file",
            Request::SubmitTemplate(_) => "submit_template",
            Request::RequestBuild { .. } => "request_build",
            Request::StartBuild { .. } => "start_build",
            Request::DeleteTemplate { .. } => "delete_template",
            Request::SetTemplateStandbys { .. } => "set_template_standbys",
            Request::AssignTags { .. } => "assign_tags",
            Request::RemoveTags { .. } => "remove_tags",
            Request::GrantUpload { .. } => "grant_upload",
            Request::ReceiveFiles { .. } => "receive_files",
            Request::CreateVolume { .. } => "create_volume",
            Request::DeleteVolume { .. } => "delete_volume",
            Request::EnsureBaseTemplate => "ensure_base_template",
            Request::Shutdown => "shutdown",
        }
    }

    /// The sandbox the request is for, if any.
    fn sandbox(&self) -> Option<&str> {
        match self {
            Request::Delete { id }
            | Request::SetTimeout { id, .. }
            | Request::SetNetwork { id, .. }
            | Request::Connect { id, .. }
            | Request::Pause { id, .. }
            | Request::Snapshot { id, .. }
            | Request::Fork { id, .. }
            | Request::PatchParams { id, .. }
            | Request::Route { id }
            | Request::RunCommand { id, .. }
            | Request::ReadFile { id, .. }
            | Request::WriteFile { id, .. } => Some(id),
            _ => None,
        }
    }

    /// Whether the request starts new work, which a shutting-down server refuses (503).
    /// Guest calls, tags and uploads go on; the envd route refuses only the wake it may
    /// need; shutdown itself is what is running.
    fn refused_during_shutdown(&self) -> bool {
        !matches!(
            self,
            Request::Route { .. }
                | Request::RunCommand { .. }
                | Request::ReadFile { .. }
                | Request::WriteFile { .. }
                | Request::AssignTags { .. }
                | Request::RemoveTags { .. }
                | Request::GrantUpload { .. }
                | Request::ReceiveFiles { .. }
                | Request::EnsureBaseTemplate
                | Request::Shutdown
        )
    }

    /// Lifecycle operations are counted in `/metrics` by result, under this name.
    fn counted(&self) -> Option<&'static str> {
        match self {
            Request::Create {
                from: CreateFrom::Image(_),
                ..
            } => Some("create_cold"),
            Request::Create { .. }
            | Request::Delete { .. }
            | Request::Connect { .. }
            | Request::Pause { .. }
            | Request::Snapshot { .. }
            | Request::Fork { .. }
            | Request::PatchParams { .. }
            | Request::CreateVolume { .. }
            | Request::DeleteVolume { .. } => Some(self.name()),
            _ => None,
        }
    }

    fn ticket(&self) -> Ticket {
        let done = match self {
            Request::SetTimeout { secs, change, .. } => {
                let how = match change {
                    ExpiryChange::Set => "set to",
                    ExpiryChange::AtLeast => "extended to at least",
                };
                Some(format!("timeout {how} {secs} s from now"))
            }
            Request::Connect { .. } => Some("resumed".into()),
            Request::Pause { .. } => Some("paused".into()),
            _ => None,
        };
        Ticket {
            op: self.name(),
            sandbox: self.sandbox().map(str::to_owned),
            counted: self.counted(),
            done,
        }
    }
}

impl Orchestrator {
    /// The one dispatch of every [`Request`] (see the module doc).
    pub fn handle(&self, request: Request<'_>) -> Result<Response, OrchError> {
        if request.refused_during_shutdown() {
            self.refuse_when_shutting_down()?;
        }
        let ticket = request.ticket();
        let started = Instant::now();
        let result = self.run(request);
        self.account(&ticket, &result, started.elapsed());
        result
    }

    /// Hands each request to its operation.
    fn run(&self, request: Request<'_>) -> Result<Response, OrchError> {
        use Response as R;
        Ok(match request {
            Request::Create { from, idempotency } => {
                R::Sandbox(Box::new(self.create_once(idempotency, from)?))
            }
            Request::Delete { id } => self.delete(id).map(|()| R::Done)?,
            Request::SetTimeout { id, secs, change } => {
                self.set_timeout(id, secs, change).map(|()| R::Done)?
            }
            Request::SetNetwork {
                id,
                policy,
                allow_internet,
            } => self
                .set_network(id, policy, allow_internet)
                .map(|()| R::Done)?,
            Request::Connect {
                id,
                secs,
                kind,
                from,
            } => R::Connected(Box::new(self.connect(id, secs, kind, from)?)),
            Request::Pause { id, request } => self.pause(id, request).map(|()| R::Done)?,
            Request::Snapshot { id, name } => R::Snapshot(Box::new(self.snapshot(id, name)?)),
            Request::Fork {
                id,
                count,
                timeout_secs,
            } => R::Forked(self.fork(id, count, timeout_secs)?),
            Request::PatchParams { id, patch } => R::Params(self.patch_params(id, patch)?),
            Request::Route { id } => R::Route(self.route_waking(id)?),
            Request::RunCommand { id, command } => R::Command(self.run_command(id, command)?),
            Request::ReadFile { id, path } => R::File(self.read_file(id, path)?),
            Request::WriteFile {
                id,
                path,
                len,
                body,
            } => self.write_file(id, path, len, body).map(|()| R::Done)?,
            other => self.run_catalog(other)?,
        })
    }

    /// Templates, uploads, volumes and the server's own life.
    fn run_catalog(&self, request: Request<'_>) -> Result<Response, OrchError> {
        use Response as R;
        Ok(match request {
            Request::SubmitTemplate(req) => R::Build(Box::new(self.submit_template(req)?)),
            Request::RequestBuild {
                name,
                tags,
                resources,
                ids,
            } => R::NewBuild(Box::new(self.request_build(name, tags, resources, ids)?)),
            Request::StartBuild {
                template_id,
                build_id,
                spec,
            } => self
                .start_build(template_id, build_id, spec)
                .map(|()| R::Done)?,
            Request::DeleteTemplate { id_or_name } => {
                self.delete_template(id_or_name).map(|()| R::Done)?
            }
            Request::SetTemplateStandbys {
                id_or_name,
                standbys,
            } => self
                .set_template_standbys(id_or_name, standbys)
                .map(|()| R::Done)?,
            Request::AssignTags { target, tags } => {
                R::Tagged(self.shared.catalog.assign_tags(target, tags)?)
            }
            Request::RemoveTags { name, tags } => {
                super::templates::remove_tags(&self.shared, name, tags).map(|()| R::Done)?
            }
            Request::GrantUpload { hash } => R::UploadToken(self.shared.uploads.grant(hash)),
            Request::ReceiveFiles { hash, body } => {
                self.shared.uploads.receive(hash, body).map(|()| R::Done)?
            }
            Request::CreateVolume { name, size_mb } => {
                R::Volume(self.create_volume(name, size_mb)?)
            }
            Request::DeleteVolume { id } => self.delete_volume(id).map(|()| R::Done)?,
            Request::EnsureBaseTemplate => {
                super::base::keep_built(&self.shared);
                R::Done
            }
            Request::Shutdown => R::ShutDown(self.shutdown()),
            other => {
                return Err(OrchError::Internal(format!(
                    "no operation handles {}",
                    other.name()
                )))
            }
        })
    }

    /// Counting, timing, the sandbox's log and the server log, for every request.
    fn account(
        &self,
        ticket: &Ticket,
        result: &Result<Response, OrchError>,
        elapsed: std::time::Duration,
    ) {
        // A connect to a running sandbox only changed its expiry: no resume happened.
        let no_op = matches!(result, Ok(Response::Connected(c)) if !c.resumed);
        if let (Some(op), false) = (ticket.counted, no_op) {
            self.shared.operations.record(op, result.is_ok(), elapsed);
        }
        let sandbox = match result {
            Ok(Response::Sandbox(info)) => Some(info.id.as_str()),
            _ => ticket.sandbox.as_deref(),
        };
        if let Some(id) = sandbox.filter(|_| !no_op) {
            self.note_in_sandbox_log(id, ticket, result);
        }
        let ms = elapsed.as_millis();
        match result {
            Ok(_) => log::debug!(
                "op={} sandboxId={} result=ok ms={ms}",
                ticket.op,
                sandbox.unwrap_or("-")
            ),
            Err(e) => log::info!(
                "op={} sandboxId={} result=error status={} ms={ms} error=\"{e}\"",
                ticket.op,
                sandbox.unwrap_or("-"),
                e.status()
            ),
        }
    }

    /// The sandbox log's entry (api.md §4.26) for the operations it records.
    fn note_in_sandbox_log(&self, id: &str, ticket: &Ticket, result: &Result<Response, OrchError>) {
        let done = match result {
            Ok(Response::Sandbox(_)) if ticket.counted == Some("create_cold") => {
                Some("sandbox created from an image".to_string())
            }
            Ok(Response::Sandbox(info)) => Some(format!(
                "sandbox created from {}",
                info.settings.template_id
            )),
            Ok(Response::Snapshot(r)) => Some(format!("snapshot {} taken", r.id)),
            Ok(Response::Forked(forks)) => Some(format!(
                "forked into {} of {} sandboxes",
                forks.iter().filter(|f| f.is_ok()).count(),
                forks.len()
            )),
            Ok(_) => ticket.done.clone(),
            // Failures of the operations that note their successes.
            Err(_) if matches!(ticket.op, "resume" | "pause" | "snapshot") => Some(String::new()),
            Err(_) => None,
        };
        let Some(done) = done else {
            return;
        };
        let Ok(entry) = self.shared.registry.entry(id) else {
            return;
        };
        match result {
            Ok(_) => entry
                .log
                .event(super::sandbox_log::LogLevel::Info, ticket.op, &done),
            Err(e) => entry.log.event(
                super::sandbox_log::LogLevel::Warn,
                ticket.op,
                &format!("{} failed: {e}", ticket.op),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatched_answer_is_a_500_not_a_panic() {
        let e = Response::Done.into_sandbox().unwrap_err();
        assert_eq!(e.status(), 500);
        assert!(e.message().contains("answered Done where Sandbox"));
        assert!(Response::Done.into_done().is_ok());
        assert!(Response::ShutDown(true).into_shut_down().unwrap());
    }

    #[test]
    fn shutdown_refuses_new_work_and_lets_guest_calls_finish() {
        let new_work = [
            Request::Delete { id: "a" },
            Request::Pause {
                id: "a",
                request: PauseRequest::FULL,
            },
            Request::CreateVolume {
                name: "v",
                size_mb: None,
            },
        ];
        assert!(new_work.iter().all(Request::refused_during_shutdown));
        let ongoing = [
            Request::Route { id: "a" },
            Request::ReadFile { id: "a", path: "/" },
            Request::Shutdown,
        ];
        assert!(!ongoing.iter().any(Request::refused_during_shutdown));
    }

    #[test]
    fn counted_under_their_metric_names() {
        let timeout = Request::SetTimeout {
            id: "a",
            secs: 5,
            change: ExpiryChange::AtLeast,
        };
        assert_eq!(timeout.counted(), None);
        let t = timeout.ticket();
        assert_eq!(
            t.done.as_deref(),
            Some("timeout extended to at least 5 s from now")
        );
        assert_eq!(t.sandbox.as_deref(), Some("a"));
        let connect = Request::Connect {
            id: "a",
            secs: 1,
            kind: ConnectKind::Connect,
            from: PauseMode::Full,
        };
        assert_eq!(connect.counted(), Some("resume"));
        assert_eq!(Request::Delete { id: "a" }.counted(), Some("delete"));
    }
}
