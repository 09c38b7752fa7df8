//! Response bodies (api.md §3). Field names marked [E2B] in the spec are read by E2B SDKs.

use crate::orchestrator::{SandboxInfo, SnapshotRecord};
use crate::util::rfc3339;
use serde_json::{json, Value};

/// `Sandbox` (§3.1).
pub fn sandbox(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = json!({
        "sandboxID": info.id,
        "templateID": info.template_id,
        "clientID": "",
        "envdVersion": envd_version,
        "hostInteractionIp": info.host_ip.to_string(),
    });
    if let Some(alias) = &info.alias {
        v["alias"] = json!(alias);
    }
    v
}

/// `ListedSandbox` (§3.2): `SandboxDetail` without `lifecycle`.
pub fn listed_sandbox(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = sandbox(info, envd_version);
    let extra = json!({
        "startedAt": rfc3339(info.started_at),
        "endAt": rfc3339(info.end_at),
        "cpuCount": info.cpu_count,
        "memoryMB": info.memory_mb,
        "diskSizeMB": info.disk_size_mb,
        "metadata": info.metadata,
        "state": info.state.api_state().unwrap_or("running"),
        "networkNamespacePath": info.netns_path.display().to_string(),
    });
    merge(&mut v, extra);
    v
}

/// `SandboxDetail` (§3.2).
pub fn sandbox_detail(info: &SandboxInfo, envd_version: &str) -> Value {
    let mut v = listed_sandbox(info, envd_version);
    v["lifecycle"] = json!({
        "autoResume": false,
        "onTimeout": if info.auto_pause { "pause" } else { "kill" },
    });
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
        "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb,
        "diskSizeMB": r.disk_size_mb,
        "createdAt": rfc3339(r.created_at),
        "updatedAt": rfc3339(r.created_at),
    })
}

/// `Template` (§3.4) for a snapshot viewed as a template.
pub fn template(r: &SnapshotRecord, envd_version: &str) -> Value {
    let names = match &r.name {
        Some(n) => vec![n.clone()],
        None => vec![r.id.clone()],
    };
    json!({
        "templateID": r.id,
        "buildID": r.id,
        "names": names,
        "aliases": names,
        "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb,
        "diskSizeMB": r.disk_size_mb,
        "public": true,
        "createdBy": null,
        "createdAt": rfc3339(r.created_at),
        "updatedAt": rfc3339(r.created_at),
        "lastSpawnedAt": r.last_spawned_at.map(rfc3339),
        "spawnCount": r.spawn_count,
        "buildCount": 1,
        "envdVersion": envd_version,
        "buildStatus": "ready",
    })
}
