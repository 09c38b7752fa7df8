//! Response bodies (api.md §3). Field names marked [E2B] in the spec are read by E2B SDKs.

use crate::orchestrator::guest_metrics::GuestSample;
use crate::orchestrator::{
    CatalogTemplate, SandboxInfo, SandboxState, SnapshotRecord, TemplateBuild,
};
use crate::util::rfc3339;
use serde_json::{json, Value};

/// `Sandbox` (§3.1): what create, connect and fork answer, with the envd access token.
pub fn sandbox(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = identity(info, envd_version);
    with_token(&mut v, info);
    v
}

/// The fields every sandbox body starts with.
fn identity(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = json!({
        "sandboxID": info.id,
        "templateID": info.settings.template_id,
        "clientID": crate::cluster::id::node_of(&info.id).unwrap_or(""),
        "envdVersion": envd_version,
        "hostInteractionIp": info.host_ip.to_string(),
    });
    if let Some(alias) = &info.settings.alias {
        v["alias"] = json!(alias);
    }
    v
}

/// `envdAccessToken` [E2B]: the credential of the sandbox's envd (docs/e2b.md), and
/// `trafficAccessToken` [E2B], the credential of its other ports when they are not
/// public. Not in lists, as E2B's `ListedSandbox` has none.
fn with_token(v: &mut Value, info: &SandboxInfo) {
    if !info.envd_access_token.is_empty() {
        v["envdAccessToken"] = json!(info.envd_access_token);
    }
    if !info.settings.ingress.public && !info.traffic_access_token.is_empty() {
        v["trafficAccessToken"] = json!(info.traffic_access_token);
    }
}

/// `ListedSandbox` (§3.2): `SandboxDetail` without `lifecycle` and the token.
pub fn listed_sandbox(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = identity(info, envd_version);
    let extra = json!({
        "startedAt": rfc3339(info.started_at),
        "endAt": rfc3339(info.end_at),
        "cpuCount": info.settings.resources.cpu_count,
        "memoryMB": info.settings.resources.memory_mb,
        "diskSizeMB": info.settings.resources.disk_size_mb,
        "metadata": info.settings.metadata,
        "state": info.state().api_state().unwrap_or("running"),
        "networkNamespacePath": info.netns_path.display().to_string(),
    });
    merge(&mut v, extra);
    v
}

/// `SandboxDetail` (§3.2).
pub fn sandbox_detail(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = listed_sandbox(info, envd_version);
    with_token(&mut v, info);
    v["allowInternetAccess"] = json!(info.settings.internet_access);
    let ingress = &info.settings.ingress;
    v["network"] = super::network::shown(&info.settings.network);
    v["network"]["allowPublicTraffic"] = json!(ingress.public);
    if let Some(mask) = &ingress.mask_request_host {
        v["network"]["maskRequestHost"] = json!(mask);
    }
    if let Some(violation) = &info.guest_protocol_violation {
        v["guestProtocolViolation"] = json!(violation);
    }
    if let Some(pause) = &info.paused_on_io_error {
        v["pausedOnIoError"] = json!({"since": rfc3339(pause.since), "message": pause.message});
    }
    v["lifecycle"] = json!({
        "autoResume": info.settings.auto_resume,
        "onTimeout": if info.settings.auto_pause { "pause" } else { "kill" },
    });
    let mounts = &info.settings.volume_mounts;
    v["volumeMounts"] = json!(mounts
        .iter()
        .map(|m| json!({"name": m.name, "path": m.path}))
        .collect::<Vec<_>>());
    // Once a pause has finished: what it kept (E2B's `pauseMode`).
    if let (SandboxState::Paused, Some(mode)) = (info.state(), info.pause_mode) {
        v["pauseMode"] = json!(mode.name());
    }
    v
}

fn merge(into: &mut Value, from: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, from) {
        a.extend(b);
    }
}

/// `SnapshotInfo` (§3.3).
pub fn snapshot_info(r: &SnapshotRecord) -> Value {
    json!({
        "snapshotID": r.id,
        "names": r.name.iter().collect::<Vec<_>>(),
        "sandboxID": r.sandbox_id,
        "cpuCount": r.settings.resources.cpu_count,
        "memoryMB": r.settings.resources.memory_mb,
        "diskSizeMB": r.settings.resources.disk_size_mb,
        "createdAt": rfc3339(r.created_at),
        "updatedAt": rfc3339(r.created_at),
    })
}

/// `Template` (§3.4): a template build, a snapshot viewed as a template, or both.
pub fn template(
    build: Option<&TemplateBuild>,
    snapshot: Option<&SnapshotRecord>,
    envd_version: &str,
) -> Value {
    let (id, name) = match (build, snapshot) {
        (Some(b), _) => (b.id.clone(), Some(b.name.clone())),
        (None, Some(s)) => (s.id.clone(), s.name.clone()),
        (None, None) => return json!({}),
    };
    let names = vec![name.unwrap_or_else(|| id.clone())];
    let resources = match (build, snapshot) {
        (Some(b), _) => b.resources,
        (None, Some(s)) => s.settings.resources,
        (None, None) => unreachable!(),
    };
    let (cpu, mem, disk) = (
        resources.cpu_count,
        resources.memory_mb,
        resources.disk_size_mb,
    );
    let created = build
        .map(|b| b.created_at)
        .or(snapshot.map(|s| s.created_at))
        .expect("one of them");
    let updated = build.map(|b| b.updated_at).unwrap_or(created);
    let status = build.map(|b| b.status.as_str()).unwrap_or("ready");
    let mut v = json!({
        "templateID": id,
        "buildID": id,
        "names": names,
        "aliases": names,
        "cpuCount": cpu,
        "memoryMB": mem,
        "diskSizeMB": disk,
        "public": true,
        "createdBy": null,
        "createdAt": rfc3339(created),
        "updatedAt": rfc3339(updated),
        "lastSpawnedAt": snapshot.and_then(|s| s.last_spawned_at).map(rfc3339),
        "spawnCount": snapshot.map(|s| s.spawn_count).unwrap_or(0),
        "buildCount": 1,
        "envdVersion": envd_version,
        "buildStatus": status,
    });
    if let Some(b) = build {
        v["image"] = json!(b.image);
        if let Some(cmd) = &b.start_cmd {
            v["startCmd"] = json!(cmd);
        }
        if let Some(reason) = &b.reason {
            v["reason"] = json!(reason);
        }
    }
    let (phase, (done, total)) =
        build.map_or(("ready", (0, 0)), |b| (b.phase().as_str(), b.pull_bytes()));
    v["progress"] = json!({"phase": phase, "pullBytesDone": done, "pullBytesTotal": total});
    v
}

/// `Template` (§3.4) of an E2B template: its latest ready build (`buildID`, resources
/// from its snapshot), `building` until one is ready.
pub fn catalog_template(
    t: &CatalogTemplate,
    current: Option<&SnapshotRecord>,
    envd_version: &str,
) -> Value {
    let resources = current.map(|s| s.settings.resources);
    json!({
        "templateID": t.id,
        "buildID": t.current().unwrap_or(""),
        "names": [t.name],
        "aliases": [t.name],
        "cpuCount": resources.map_or(0, |r| r.cpu_count),
        "memoryMB": resources.map_or(0, |r| r.memory_mb),
        "diskSizeMB": resources.map_or(0, |r| r.disk_size_mb),
        "public": false,
        "createdBy": null,
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(t.updated_at),
        "lastSpawnedAt": current.and_then(|s| s.last_spawned_at).map(rfc3339),
        "spawnCount": current.map_or(0, |s| s.spawn_count),
        "buildCount": t.build_count,
        "envdVersion": envd_version,
        "buildStatus": if current.is_some() { "ready" } else { "building" },
        "tags": t.tags.keys().collect::<Vec<_>>(),
    })
}

/// One sandbox log entry in E2B's `SandboxLogEntry` shape.
pub fn log_entry(e: &crate::orchestrator::sandbox_log::LogEntry) -> Value {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(e.at_unix_ms);
    let fields: serde_json::Map<String, Value> = e
        .fields
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(v.as_str())))
        .collect();
    json!({
        "timestamp": rfc3339(at),
        "message": e.message,
        "level": e.level.as_str(),
        "fields": fields,
    })
}

/// One guest sample in E2B's `SandboxMetric` shape.
pub fn sandbox_metric(s: &GuestSample) -> Value {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(s.at_unix_ms);
    json!({
        "timestamp": rfc3339(at),
        "timestampUnix": s.at_unix_ms / 1000,
        "cpuCount": s.cpu_count,
        "cpuUsedPct": s.cpu_used_pct,
        "memUsed": s.mem_used,
        "memTotal": s.mem_total,
        "memCache": s.mem_cache,
        "diskUsed": s.disk_used,
        "diskTotal": s.disk_total,
        "egressBytes": s.egress_bytes,
        "egressRefused": s.egress_refused,
        "egressRefusedProtected": s.egress_refused_protected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::orchestrator::SandboxState;

    #[test]
    fn a_guest_protocol_violation_shows_in_the_detail_only_when_there_is_one() {
        let mut info = crate::orchestrator::fakes::info("sb", SandboxState::Running);
        assert!(sandbox_detail(&info, "0")
            .get("guestProtocolViolation")
            .is_none());
        info.guest_protocol_violation = Some("the guest broke the agent protocol".into());
        let v = sandbox_detail(&info, "0");
        assert_eq!(
            v["guestProtocolViolation"],
            "the guest broke the agent protocol"
        );
    }
}
