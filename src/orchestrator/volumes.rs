//! The orchestrator's door for E2B volumes (api.md §4.27): names and sizes checked here,
//! the store (`crate::volume`) makes, mounts and removes them; the guest's mounts are
//! made here after every boot (create, and a resume that boots from disk).

use super::settings::VolumeMount;
use super::{OrchError, Orchestrator, SandboxInfo};
use crate::agent::{AgentClient, AgentError, ExecRequest};
use crate::config::VolumesConfig;
use crate::volume::nfs::Export;
use crate::volume::{VolumeClaim, VolumeRecord};
use std::path::Path;
use std::time::Duration;

impl Orchestrator {
    /// `POST /volumes`: a new volume `name` of `size_mb` MiB (`[volumes] default_size_mb`
    /// when `None`).
    pub(super) fn create_volume(
        &self,
        name: &str,
        size_mb: Option<u64>,
    ) -> Result<VolumeRecord, OrchError> {
        if !super::snapshots::valid_name(name) {
            return Err(OrchError::BadRequest(format!(
                "name: {name:?} must match [A-Za-z0-9_-]{{1,128}} and must not look like a UUID"
            )));
        }
        let cfg = &self.config().volumes;
        let size = size_mb.unwrap_or(cfg.default_size_mb);
        if !(VolumesConfig::MIN_SIZE_MB..=cfg.max_size_mb).contains(&size) {
            return Err(OrchError::BadRequest(format!(
                "sizeMB: {size} must lie within {}..={} (volumes.max_size_mb)",
                VolumesConfig::MIN_SIZE_MB,
                cfg.max_size_mb
            )));
        }
        let record = self.on_state_disk(super::DiskUse::Create, || {
            self.shared.volumes.create(name, size).map_err(|e| match e {
                crate::volume::VolumeError::Exists(_) => {
                    OrchError::Conflict(format!("name: a volume named {name} exists already"))
                }
                other => other.into(),
            })
        })?;
        log::info!(
            "op=create_volume volumeId={} name={} sizeMB={size}",
            record.id,
            record.name
        );
        Ok(record)
    }

    /// `DELETE /volumes/{id}`: 409 while a sandbox (any state) or a snapshot mounts it, or a
    /// create, fork or snapshot that will is in progress (its [`VolumeClaim`]).
    pub(super) fn delete_volume(&self, id: &str) -> Result<(), OrchError> {
        let deleted = self
            .shared
            .volumes
            .delete(id, |record| self.volume_users(record))?;
        if !deleted {
            return Err(OrchError::NotFound(format!("volume {id} not found")));
        }
        log::info!("op=delete_volume volumeId={id}");
        Ok(())
    }

    /// Who mounts `volume`, as the 409 says it: the sandboxes (registered, any state) and
    /// the snapshots (a sandbox made from one mounts it again) whose settings name it.
    fn volume_users(&self, volume: &VolumeRecord) -> Option<String> {
        let names = |m: &VolumeMount| m.volume_id == volume.id;
        let sandboxes: Vec<String> = self
            .shared
            .registry
            .entries()
            .iter()
            .filter(|e| e.read(|i| i.settings.volume_mounts.iter().any(names)))
            .map(|e| e.id().to_string())
            .collect();
        let snapshots: Vec<String> = self
            .shared
            .snapshots
            .list()
            .into_iter()
            .filter(|s| s.settings.volume_mounts.iter().any(names))
            .map(|s| match s.name {
                Some(name) => format!("{} ({name})", s.id),
                None => s.id,
            })
            .collect();
        let mut why = Vec::new();
        if !sandboxes.is_empty() {
            why.push(format!(
                "mounted by sandbox {}: delete or kill those sandboxes first",
                sandboxes.join(", ")
            ));
        }
        if !snapshots.is_empty() {
            why.push(format!(
                "mounted by snapshot {} (a sandbox created from it mounts the volume again): delete those snapshots first",
                snapshots.join(", ")
            ));
        }
        (!why.is_empty()).then(|| format!("volume {}: {}", volume.id, why.join("; ")))
    }

    /// Resolves each mount's volume by name (400 naming the entry when there is none) and
    /// claims it until the caller's sandbox is registered.
    pub(super) fn resolve_mounts(
        &self,
        mounts: &mut [VolumeMount],
    ) -> Result<Vec<VolumeClaim>, OrchError> {
        if !mounts.is_empty() {
            self.shared.volumes.require_nfs()?;
        }
        let mut claims = Vec::with_capacity(mounts.len());
        for (i, m) in mounts.iter_mut().enumerate() {
            let volume = self.shared.volumes.by_name(&m.name).ok_or_else(|| {
                OrchError::BadRequest(format!(
                    "volumeMounts[{i}].name: there is no volume named {:?}; create it first (POST /volumes)",
                    m.name
                ))
            })?;
            m.volume_id = volume.record.id.clone();
            claims.push(
                volume
                    .claim()
                    .map_err(|e| OrchError::Conflict(format!("volumeMounts[{i}].name: {e}")))?,
            );
        }
        Ok(claims)
    }

    /// Claims the volumes already resolved in `mounts` (a snapshot's, a sandbox's) until
    /// the caller's sandbox or snapshot is registered; 409 naming `owner` when one is
    /// gone or being deleted.
    pub(super) fn claim_mounts(
        &self,
        owner: &str,
        mounts: &[VolumeMount],
    ) -> Result<Vec<VolumeClaim>, OrchError> {
        if !mounts.is_empty() {
            self.shared.volumes.require_nfs()?;
        }
        mounts
            .iter()
            .map(|m| {
                let volume = self.shared.volumes.get(&m.volume_id).ok_or_else(|| {
                    OrchError::Conflict(format!(
                        "{owner} mounts volume {} ({}), which no longer exists",
                        m.name, m.volume_id
                    ))
                })?;
                volume
                    .claim()
                    .map_err(|e| OrchError::Conflict(format!("{owner} mounts {e}")))
            })
            .collect()
    }

    /// Claims the volumes sandbox `id` mounts, for a fork or snapshot of it (which
    /// registers children or a snapshot that mount them too).
    pub(super) fn claim_sandbox_mounts(&self, id: &str) -> Result<Vec<VolumeClaim>, OrchError> {
        let mounts = self.entry(id)?.read(|i| i.settings.volume_mounts.clone());
        self.claim_mounts(&format!("sandbox {id}"), &mounts)
    }

    /// Mounts `mounts` in the new sandbox's guest (its slot's NFS server exports them).
    /// A failure deletes the sandbox and answers 502 with what the guest said.
    pub(super) fn mount_in_guest(
        &self,
        info: SandboxInfo,
        mounts: &[VolumeMount],
    ) -> Result<SandboxInfo, OrchError> {
        if mounts.is_empty() {
            return Ok(info);
        }
        let entry = self.entry(&info.id)?;
        let mounted = self
            .agent_for(&entry, &info.id, super::Call::Commands)
            .and_then(|agent| mount_volumes(&agent, mounts));
        if let Err(e) = mounted {
            let _ = self.delete(&info.id);
            return Err(OrchError::Upstream(format!("{e}; the sandbox was deleted")));
        }
        Ok(info)
    }
}

/// Longest a guest's mount of a volume may take.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// Mounts each of `mounts` in a running guest from its gateway's NFS server: the agent
/// calls `mount(2)` itself ([`AgentClient::mount_nfs`]), so the image needs no `mount`
/// program. An agent from before that call (a guest restored from an older template)
/// runs the image's `mount -t nfs4` instead. 502 naming the volume on a failure.
pub(super) fn mount_volumes(agent: &AgentClient, mounts: &[VolumeMount]) -> Result<(), OrchError> {
    let gw = crate::net::GUEST_GATEWAY;
    // The kernel's own nfs4 options (mount.nfs would add addr= and clientaddr= itself).
    let options = format!(
        "vers=4.2,proto=tcp,hard,addr={gw},clientaddr={ip}",
        ip = crate::net::GUEST_IP
    );
    for m in mounts {
        let source = format!("{gw}:/{}", m.name);
        let result = match agent.mount_nfs(&source, &m.path, &options, MOUNT_TIMEOUT) {
            Err(AgentError::Protocol(p)) if p.contains("undecodable request") => {
                mount_by_command(agent, &source, &m.path, &options)
            }
            other => other.map_err(|e| e.to_string()),
        };
        result.map_err(|why| {
            OrchError::Upstream(format!(
                "volume {} could not be mounted at {} in the guest: {why}",
                m.name, m.path
            ))
        })?;
    }
    Ok(())
}

/// The older agents' way: `mkdir -p`, then the image's `mount -t nfs4`.
fn mount_by_command(
    agent: &AgentClient,
    source: &str,
    path: &str,
    options: &str,
) -> Result<(), String> {
    let options = format!("{options},nosuid,nodev");
    let steps: [(&str, Vec<&str>); 2] = [
        ("mkdir", vec!["-p", path]),
        ("mount", vec!["-t", "nfs4", "-o", &options, source, path]),
    ];
    for (cmd, args) in steps {
        let req = ExecRequest {
            cmd: cmd.to_string(),
            args: args.iter().map(|a| a.to_string()).collect(),
            env: Vec::new(),
            cwd: "/".into(),
            timeout_ms: MOUNT_TIMEOUT.as_millis() as u64,
            max_output_bytes: 64 * 1024,
        };
        match agent.exec(&req) {
            Ok(r) if r.exit_code == 0 => {}
            Ok(r) => return Err(format!("{cmd}: exit {}: {}", r.exit_code, r.stderr.trim())),
            Err(e) => return Err(format!("{cmd}: {e}")),
        }
    }
    Ok(())
}

/// Where `mounts`' volumes are on the host, for the sandbox's NFS server.
pub(crate) fn exports(volumes_dir: &Path, mounts: &[VolumeMount]) -> Vec<Export> {
    let mut exports: Vec<Export> = Vec::new();
    for m in mounts {
        if !exports.iter().any(|e| e.name == m.name) {
            exports.push(Export {
                name: m.name.clone(),
                dir: crate::volume::mount_dir(volumes_dir, &m.volume_id),
            });
        }
    }
    exports
}
