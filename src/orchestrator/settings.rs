//! What a sandbox is made with: one settings struct that a create request resolves to,
//! that a running or paused sandbox keeps ([`super::SandboxInfo`]), that a snapshot stores
//! ([`super::SnapshotRecord`]) and that a sandbox created from it or forked inherits.
//! Records flatten it, so their stored field names are those of the struct's fields.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// A VM's size: vCPUs, memory and root disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resources {
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
}

/// The settings of one sandbox, kept across pause, resume, snapshot and fork.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSettings {
    /// The image reference of a cold start, or the template (snapshot) it started from.
    /// Snapshot records of schema 2 stored it as `sourceTemplateId`.
    #[serde(alias = "sourceTemplateId")]
    pub template_id: String,
    /// The template's name, when it started from a named one.
    #[serde(default)]
    pub alias: Option<String>,
    #[serde(flatten)]
    pub resources: Resources,
    pub timeout_secs: u64,
    pub auto_pause: bool,
    /// What a timeout's pause keeps: memory and disk (`true`, E2B's `mode: "full"`) or the
    /// disk only (`false`, `mode: "filesystem"`). Records from before it: full.
    #[serde(default = "full_pause")]
    pub auto_pause_memory: bool,
    /// Whether a request for the paused sandbox resumes it (E2B's `autoResume`).
    #[serde(default)]
    pub auto_resume: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// The image's own environment, lowest precedence for commands.
    pub image_env: Vec<(String, String)>,
    /// Whether the guest may open outbound connections.
    pub internet_access: bool,
    /// Who may reach the guest's ports through the API port (E2B's
    /// `network.allowPublicTraffic` and `maskRequestHost`). Records from before it: public.
    #[serde(default)]
    pub ingress: Ingress,
    /// The sandbox's own egress policy (`network` on create, `PUT …/network`).
    #[serde(default)]
    pub network: NetworkPolicy,
    /// Snapshot records of schema 2 stored them as `params`.
    #[serde(alias = "params")]
    pub custom_extension_params: Value,
    /// The volumes mounted into the guest (E2B's `volumeMounts`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
}

/// One volume mounted into a sandbox's guest (api.md §4.27).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    /// The volume's name, as the request gave it.
    pub name: String,
    /// Its id, resolved at create.
    pub volume_id: String,
    /// Where the guest sees it (absolute, checked).
    pub path: String,
}

fn full_pause() -> bool {
    true
}

/// What a pause keeps (E2B's `pauseMode`): the memory and the disk, resumed where the
/// guest left off, or the disk only, resumed by a cold boot from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    Full,
    Filesystem,
}

impl PauseMode {
    /// The mode of E2B's `memory` flag (`true`: full).
    pub fn with_memory(memory: bool) -> PauseMode {
        if memory {
            PauseMode::Full
        } else {
            PauseMode::Filesystem
        }
    }

    /// The name E2B's API uses.
    pub fn name(self) -> &'static str {
        match self {
            PauseMode::Full => "full",
            PauseMode::Filesystem => "filesystem",
        }
    }
}

/// One pause as asked for: what it keeps, and whether a guest agent that does not answer
/// refuses it (E2B's `requireHealthyGuest`; a filesystem-only pause always needs the
/// agent, which syncs the guest's disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PauseRequest {
    pub mode: PauseMode,
    pub require_healthy_guest: bool,
}

impl PauseRequest {
    /// A full pause that goes on whatever the agent does (shutdown, the defaults).
    pub const FULL: PauseRequest = PauseRequest {
        mode: PauseMode::Full,
        require_healthy_guest: false,
    };

    /// Whether the guest agent must answer before the VM stops.
    pub fn needs_agent(self) -> bool {
        self.require_healthy_guest || self.mode == PauseMode::Filesystem
    }
}

/// How the guest's ports are reached from outside (docs/e2b.md, "Public ports").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ingress {
    /// Ports other than envd's open without a credential (`allowPublicTraffic`, E2B's
    /// default `true`); when `false` a request needs the sandbox's traffic access token.
    pub public: bool,
    /// The `Host` a guest port receives, `${PORT}` replaced by the port
    /// (`maskRequestHost`); `None`: the client's own `Host`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_request_host: Option<String>,
}

impl Default for Ingress {
    fn default() -> Ingress {
        Ingress {
            public: true,
            mask_request_host: None,
        }
    }
}

impl Ingress {
    /// The `Host` that port `port` of the guest receives for a client's `host`.
    pub fn host_for(&self, port: u16, host: &str) -> String {
        match &self.mask_request_host {
            Some(mask) => mask.replace("${PORT}", &port.to_string()),
            None => host.to_string(),
        }
    }
}

/// What every create request sets (a cold start and a start from a snapshot), checked
/// field by field by the API.
#[derive(Debug, Clone)]
pub struct SandboxRequest {
    pub timeout_secs: u64,
    pub auto_pause: bool,
    pub auto_pause_memory: bool,
    pub auto_resume: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// `None`: the server default (`[network] outbound`).
    pub allow_internet_access: Option<bool>,
    pub ingress: Ingress,
    pub network: NetworkPolicy,
    /// `volumeMounts`, the paths checked by the API; the orchestrator resolves the names
    /// (`volume_id` is empty until then).
    pub volume_mounts: Vec<VolumeMount>,
}

/// A sandbox's egress policy as E2B's `network` object has it (network.md §5.6): entries
/// are normalized CIDRs (`a.b.c.d/n`), checked by the API.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    /// E2B's `dnsServers`: with domain entries in `allowOut`, the resolvers the guest may
    /// reach directly (network.md §5.7). `None`: E2B's default, `8.8.8.8`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns_servers: Option<Vec<String>>,
}

/// The resolver E2B opens when `allowOut` names domains and `dnsServers` is left out.
const DEFAULT_DNS_SERVER: &str = "8.8.8.8/32";

impl NetworkPolicy {
    /// The rules the slot's `egress` chain and domain filter get: `allowOut` entries are
    /// CIDRs or domains; with domains, the `dnsServers` are allowed too.
    pub fn rules(&self) -> crate::net::EgressRules {
        use crate::config::Cidr;
        let mut allow: Vec<Cidr> = Vec::new();
        let mut domains = Vec::new();
        for e in &self.allow_out {
            match Cidr::parse(e) {
                Some(c) => allow.push(c),
                None => domains.push(e.clone()),
            }
        }
        if !domains.is_empty() {
            let servers = match &self.dns_servers {
                Some(d) => d.iter().map(|s| format!("{s}/32")).collect(),
                None => vec![DEFAULT_DNS_SERVER.to_string()],
            };
            allow.extend(servers.iter().filter_map(|s| Cidr::parse(s)));
        }
        crate::net::EgressRules {
            allow,
            deny: self
                .deny_out
                .iter()
                .filter_map(|c| Cidr::parse(c))
                .collect(),
            domains,
        }
    }
}

impl SandboxRequest {
    /// Whether the new sandbox may reach out: only when the server allows outbound
    /// traffic and the request did not refuse it.
    pub fn internet_access(&self, outbound: bool) -> bool {
        outbound && self.allow_internet_access != Some(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_2_snapshot_field_names_still_load() {
        let old = serde_json::json!({
            "sourceTemplateId": "tpl", "cpuCount": 1, "memoryMb": 256, "diskSizeMb": 1024,
            "timeoutSecs": 60, "autoPause": true, "metadata": {}, "envVars": {},
            "imageEnv": [["A", "b"]], "internetAccess": false, "params": {"x": 1}
        });
        let s: SandboxSettings = serde_json::from_value(old).unwrap();
        assert_eq!(s.template_id, "tpl");
        assert_eq!(s.alias, None);
        assert_eq!(s.resources.memory_mb, 256);
        assert_eq!(s.custom_extension_params, serde_json::json!({"x": 1}));
        let back = serde_json::to_value(&s).unwrap();
        assert_eq!(back["templateId"], "tpl");
        assert_eq!(back["memoryMb"], 256);
        assert_eq!(s.ingress, Ingress::default(), "old records: public ports");
    }

    #[test]
    fn masked_hosts() {
        let open = Ingress::default();
        assert_eq!(
            open.host_for(8080, "8080-x.example.com"),
            "8080-x.example.com"
        );
        let masked = Ingress {
            public: false,
            mask_request_host: Some("${PORT}-app.example.com".into()),
        };
        assert_eq!(masked.host_for(3000, "ignored"), "3000-app.example.com");
    }
}
