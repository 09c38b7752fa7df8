//! Configuration: one struct tree deserialized from TOML with unknown keys refused,
//! defaults in one place (`config/default.toml`, embedded), env overrides applied in one
//! function, validated once at startup.

use serde::Deserialize;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

/// The embedded defaults; every key is documented there.
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

#[derive(Debug)]
pub enum ConfigError {
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    Parse {
        origin: String,
        message: String,
    },
    Invalid {
        key: &'static str,
        message: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, source } => {
                write!(f, "cannot read config file {}: {source}", path.display())
            }
            ConfigError::Parse { origin, message } => {
                write!(f, "invalid config in {origin}: {message}")
            }
            ConfigError::Invalid { key, message } => write!(f, "invalid config {key}: {message}"),
        }
    }
}

impl std::error::Error for ConfigError {}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    pub network: NetworkConfig,
    pub vm: VmConfig,
    pub agent: AgentConfig,
    pub sandbox: SandboxConfig,
    pub images: ImagesConfig,
    pub metrics: MetricsConfig,
    pub api: ApiConfig,
    pub custom_extension: CustomExtensionConfig,
    pub templates: TemplatesConfig,
    pub admission: AdmissionConfig,
    pub volumes: VolumesConfig,
    pub cluster: ClusterConfig,
}

/// `[cluster]`: this server as one node of many behind one endpoint (docs/cluster.md).
/// Without `node` the server is a single node and the other keys must stay unset.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// This node's name, 1–16 of `[a-z0-9-]`; it ends every sandbox id made here.
    #[serde(default)]
    pub node: Option<String>,
    /// How peers reach this node's API: `http://ADDR:PORT`.
    pub advertise_url: String,
    /// The nodes' API URLs (may include this node's own).
    pub peers: Vec<String>,
    /// Or `NAME:PORT`: a DNS name whose A/AAAA records are the nodes, re-resolved every
    /// `refresh_secs`.
    pub peers_dns: String,
    /// How often the peers are looked at again (DNS, names and capacities).
    pub refresh_secs: u64,
    /// How long a peer may take to answer a list or capacity question before it is left
    /// out of the answer.
    pub peer_timeout_ms: u64,
}

impl ClusterConfig {
    /// This node's name, when it is a cluster node.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref().filter(|n| !n.is_empty())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        let Some(node) = self.node() else {
            if !self.advertise_url.is_empty()
                || !self.peers.is_empty()
                || !self.peers_dns.is_empty()
            {
                return invalid(
                    "cluster.node",
                    "is unset while other [cluster] keys are set; name this node (1-16 of [a-z0-9-]) or remove them".into(),
                );
            }
            return Ok(());
        };
        if !crate::cluster::id::is_node_name(node) {
            return invalid(
                "cluster.node",
                format!("{node:?} must be 1-16 of [a-z0-9-]"),
            );
        }
        if let Err(why) = crate::cluster::peer::PeerUrl::parse(&self.advertise_url) {
            return invalid(
                "cluster.advertise_url",
                format!("{:?} {why}", self.advertise_url),
            );
        }
        for peer in &self.peers {
            if let Err(why) = crate::cluster::peer::PeerUrl::parse(peer) {
                return invalid("cluster.peers", format!("{peer:?} {why}"));
            }
        }
        if !self.peers.is_empty() && !self.peers_dns.is_empty() {
            return invalid(
                "cluster.peers_dns",
                "set either cluster.peers or cluster.peers_dns, not both".into(),
            );
        }
        if !self.peers_dns.is_empty() && crate::cluster::peer::dns_name(&self.peers_dns).is_none() {
            return invalid(
                "cluster.peers_dns",
                format!("{:?} is not NAME:PORT", self.peers_dns),
            );
        }
        if !(1..=3600).contains(&self.refresh_secs) {
            return invalid("cluster.refresh_secs", "must be within 1..=3600".into());
        }
        if !(1..=60_000).contains(&self.peer_timeout_ms) {
            return invalid("cluster.peer_timeout_ms", "must be within 1..=60000".into());
        }
        Ok(())
    }
}

/// `[volumes]`: the quota of E2B volumes (docs/operations.md, "Volumes").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumesConfig {
    /// A volume's size when its create gives no `sizeMB`, in MiB.
    pub default_size_mb: u64,
    /// The largest `sizeMB` a create may ask for, in MiB.
    pub max_size_mb: u64,
}

impl VolumesConfig {
    /// The smallest volume: ext4 with its journal needs a few MiB.
    pub const MIN_SIZE_MB: u64 = 16;

    fn validate(&self) -> Result<(), ConfigError> {
        let within = Self::MIN_SIZE_MB..=self.max_size_mb;
        if self.max_size_mb < Self::MIN_SIZE_MB || !within.contains(&self.default_size_mb) {
            return Err(ConfigError::Invalid {
                key: "volumes.default_size_mb",
                message: format!(
                    "{} must lie within {}..=volumes.max_size_mb ({})",
                    self.default_size_mb,
                    Self::MIN_SIZE_MB,
                    self.max_size_mb
                ),
            });
        }
        Ok(())
    }
}

/// `[admission]`: bounds on the memory and vCPUs of all running VMs together.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// A cap on the nominal memory of all running VMs; 0 = none.
    pub max_memory_mb: u64,
    /// Host memory (MemAvailable) a start must leave.
    pub reserved_memory_mb: u64,
    /// 0 = `vcpu_overcommit` × host CPUs, both 0 = no cap.
    pub max_vcpus: u64,
    pub vcpu_overcommit: u32,
    /// Memory a new VM touches as it starts (at most its own size).
    pub vm_startup_mb: u64,
    /// Starts refused while PSI "some avg10" of memory exceeds it; 0 = not checked.
    pub max_memory_pressure_pct: f64,
}

/// `[templates]`: builds of templates from images (api.md §4.15).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplatesConfig {
    pub max_concurrent_builds: u32,
    pub start_cmd_timeout_secs: u64,
    /// Most warm standbys kept per built template (0 = none); a template's own
    /// `standbys` setting overrides it.
    pub standby_per_template: u32,
    /// Memory all standbys together may hold (MiB of their QEMUs' PSS).
    pub standby_memory_mb: u64,
    /// A template's standby target shrinks by one per this many seconds without a create.
    pub standby_idle_secs: u64,
    /// A template build (steps, start and ready commands) must end within this.
    pub build_timeout_secs: u64,
    /// Largest files upload of a template build (`PUT` of a COPY step's tar).
    pub max_upload_bytes: u64,
    /// Build the SDKs' default template `base` from the built-in image at startup, in the
    /// background, when no template has that name.
    pub build_base: bool,
}

/// `[custom_extension]` (custom-extension.md §1). `url` unset, empty or whitespace-only
/// disables the extension.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomExtensionConfig {
    #[serde(default)]
    pub url: Option<String>,
    pub timeout_ms: u64,
    #[serde(default)]
    pub auth_token: Option<String>,
    /// Where `url` came from, for startup messages.
    #[serde(skip)]
    pub url_source: Source,
    #[serde(skip)]
    pub auth_token_source: Source,
}

/// Where a config value came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Source {
    #[default]
    File,
    Environment,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Source::File => "config file",
            Source::Environment => "environment",
        })
    }
}

impl CustomExtensionConfig {
    /// The normalised base URL (custom-extension.md §1.4), or `None` when the extension is disabled.
    pub fn base_url(&self) -> Option<String> {
        let url = self.url.as_deref()?.trim();
        let url = url.trim_end_matches('/');
        (!url.is_empty()).then(|| url.to_string())
    }

    /// The bearer token, when one is set and non-blank.
    pub fn token(&self) -> Option<&str> {
        self.auth_token.as_deref().filter(|t| !t.trim().is_empty())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        if !(1..=600_000).contains(&self.timeout_ms) {
            return invalid(
                "custom_extension.timeout_ms",
                "must be within 1..=600000".into(),
            );
        }
        if let Some(url) = self.base_url() {
            if let Err(why) = check_extension_url(&url) {
                return invalid(
                    "custom_extension.url",
                    format!("{url:?} (from the {}) {why}", self.url_source),
                );
            }
        }
        if let Some(token) = self.token() {
            if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return invalid(
                    "custom_extension.auth_token",
                    format!(
                        "(from the {}) must not contain whitespace or control characters",
                        self.auth_token_source
                    ),
                );
            }
        }
        Ok(())
    }
}

/// Every VM, record and capture names files by their path under the state dir, and QEMU
/// takes them in `key=value` options and `file:` URIs: the dir must be absolute, UTF-8 and
/// free of commas.
fn check_state_dir(dir: &std::path::Path) -> Result<(), String> {
    let shown = dir.display();
    if !dir.is_absolute() {
        return Err(format!("{shown:?} is relative; give an absolute path"));
    }
    match dir.to_str() {
        None => Err(format!("{shown:?} is not UTF-8; choose another path")),
        Some(s) if s.contains(',') => Err(format!(
            "{s:?} holds a comma, which QEMU options cannot carry; choose another path"
        )),
        Some(_) => Ok(()),
    }
}

/// custom-extension.md §1.5: http or https, a host, no query, fragment or user credentials.
fn check_extension_url(url: &str) -> Result<(), &'static str> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or("is not an http:// or https:// URL")?;
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return Err("must use http or https");
    }
    if rest.contains('?') {
        return Err("must not have a query");
    }
    if rest.contains('#') {
        return Err("must not have a fragment");
    }
    let authority = rest.split('/').next().unwrap_or("");
    if authority.contains('@') {
        return Err("must not contain user credentials");
    }
    let host = if authority.starts_with('[') {
        authority
            .split(']')
            .next()
            .map(|h| h.trim_start_matches('['))
    } else {
        authority
            .rsplit_once(':')
            .map(|(h, _)| h)
            .or(Some(authority))
    };
    if host.is_none_or(str::is_empty) {
        return Err("has no host");
    }
    if let Some((_, port)) = authority
        .rsplit_once(':')
        .filter(|_| !authority.ends_with(']'))
    {
        if !authority.starts_with('[') && port.parse::<u16>().is_err() {
            return Err("has an invalid port");
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub listen: String,
    pub state_dir: PathBuf,
    #[serde(default)]
    pub api_key: Option<String>,
    pub max_body_bytes: u64,
    pub http_threads: usize,
    pub quick_threads: usize,
    pub io_threads: usize,
    pub max_inflight_per_sandbox: usize,
    pub max_connections: usize,
    pub max_header_bytes: usize,
    pub idle_timeout_secs: u64,
    pub header_timeout_secs: u64,
    pub body_timeout_secs: u64,
    pub write_timeout_secs: u64,
    pub shutdown_timeout_secs: u64,
    /// Free space (MiB) kept on the state dir's filesystem: below it creates, resumes,
    /// snapshots and builds answer 507 up front (operations.md §10.2).
    pub disk_reserve_mb: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    pub netns_dir: PathBuf,
    pub host_interaction_cidr: String,
    pub veth_cidr: String,
    pub max_slots: u32,
    pub pool_min: u32,
    pub pool_max: u32,
    pub outbound: bool,
    pub outbound_denied_cidrs: Vec<String>,
    /// Exceptions to `outbound_denied_cidrs` (never the host or veth ranges).
    pub outbound_allowed_cidrs: Vec<String>,
    /// The DNS forwarder's upstream; empty: the host's resolv.conf (network.md §5.5).
    #[serde(default)]
    pub dns: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccelMode {
    Auto,
    Kvm,
    Tcg,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub accel: AccelMode,
    pub default_cpu_count: u32,
    pub default_memory_mb: u32,
    pub default_disk_size_mb: u32,
    pub ready_timeout_secs: u64,
    pub qemu_binary: PathBuf,
    pub assets_dir: PathBuf,
    /// A pause's frozen window runs in the real-time class (else at nice -10).
    pub pause_realtime: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub port: u16,
    pub max_output_bytes: u64,
    pub max_upload_bytes: u64,
    pub max_concurrent_commands: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// The timeout of a create on agentenv's own routes (`POST /sandboxes`,
    /// `/sandboxes-cold`) that names none.
    pub default_timeout_secs: u64,
    /// E2B's defaults for `POST /v2/sandboxes` (the SDKs' route): the timeout when the
    /// request names none, and what a timeout does when it sets no `autoPause`.
    pub e2b_default_timeout_secs: u64,
    pub e2b_default_on_timeout: OnTimeout,
    /// How long a create's `Idempotency-Key` is remembered, in seconds.
    pub idempotency_window_secs: u64,
    /// How long a request for a paused sandbox with `autoResume` waits for its resume.
    pub auto_resume_wait_secs: u64,
    /// Most paused sandboxes whose QEMU is kept stopped in memory, so their resume runs
    /// in the same process (its translated code kept); 0 turns it off.
    pub keep_paused_vms: u64,
    /// Memory (PSS) all kept paused VMs together may hold, in MiB.
    pub keep_paused_memory_mb: u64,
    /// How long a paused sandbox's VM is kept before it is let go (its resume then
    /// restores into a new QEMU), in seconds.
    pub keep_paused_secs: u64,
}

/// `[sandbox]`'s numeric settings within their ranges.
fn validate_sandbox(sb: &SandboxConfig) -> Result<(), ConfigError> {
    for (key, value, range) in [
        (
            "sandbox.e2b_default_timeout_secs",
            sb.e2b_default_timeout_secs,
            0..=31_536_000,
        ),
        (
            "sandbox.idempotency_window_secs",
            sb.idempotency_window_secs,
            1..=86_400,
        ),
        (
            "sandbox.auto_resume_wait_secs",
            sb.auto_resume_wait_secs,
            1..=600,
        ),
        ("sandbox.keep_paused_vms", sb.keep_paused_vms, 0..=4096),
        (
            "sandbox.keep_paused_memory_mb",
            sb.keep_paused_memory_mb,
            0..=1_048_576,
        ),
        ("sandbox.keep_paused_secs", sb.keep_paused_secs, 1..=86_400),
    ] {
        if !range.contains(&value) {
            return Err(ConfigError::Invalid {
                key,
                message: format!("must be within {}..={}", range.start(), range.end()),
            });
        }
    }
    Ok(())
}

/// What a sandbox's timeout does (E2B's `lifecycle.onTimeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    Pause,
    Kill,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagesConfig {
    pub insecure_registries: Vec<String>,
    /// Registry logins; they take precedence over `docker_config`.
    pub credentials: Vec<RegistryCredential>,
    /// A Docker `config.json` whose `auths` are used for registry logins; "" = none.
    pub docker_config: String,
    /// Cap on the image cache (blobs and base disks) in MiB; 0 = no cap.
    pub cache_max_mb: u64,
    pub connect_timeout_secs: u64,
    pub read_timeout_secs: u64,
}

/// One `[[images.credentials]]` entry: basic credentials for a registry (`host[:port]`,
/// `docker.io` for Docker Hub).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistryCredential {
    pub registry: String,
    pub username: String,
    pub password: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    pub require_api_key: bool,
    /// How often the last hour's history of these numbers is sampled
    /// (`GET /metrics/history`, the console's host page).
    pub history_interval_secs: u64,
    /// How often each running sandbox's guest is sampled for
    /// `GET /sandboxes/{id}/metrics`; 0 = never (one live sample per call).
    pub sandbox_interval_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    pub envd_version: String,
    /// Quiet seconds (both ways) after which a tunnelled upgrade (WebSocket) is closed.
    pub tunnel_idle_secs: u64,
}

/// An IPv4 network in CIDR form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Option<Cidr> {
        let (a, p) = s.split_once('/')?;
        let addr: Ipv4Addr = a.parse().ok()?;
        let prefix: u8 = p.parse().ok()?;
        if prefix > 32 {
            return None;
        }
        let cidr = Cidr { addr, prefix };
        (cidr.network() == addr).then_some(cidr)
    }

    fn mask(&self) -> u32 {
        if self.prefix == 0 {
            0
        } else {
            u32::MAX << (32 - self.prefix)
        }
    }

    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr) & self.mask())
    }

    /// Number of addresses in the network.
    pub fn size(&self) -> u64 {
        1u64 << (32 - self.prefix as u32)
    }

    /// The network address plus `offset`.
    pub fn nth(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network()).wrapping_add(offset))
    }

    /// Whether `ip` lies in this network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == u32::from(self.addr) & self.mask()
    }

    pub fn overlaps(&self, other: &Cidr) -> bool {
        let m = self.mask() & other.mask();
        u32::from(self.addr) & m == u32::from(other.addr) & m
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl NetworkConfig {
    pub fn host_cidr(&self) -> Cidr {
        Cidr::parse(&self.host_interaction_cidr).expect("validated at startup")
    }
    pub fn veth_cidr(&self) -> Cidr {
        Cidr::parse(&self.veth_cidr).expect("validated at startup")
    }
}

/// Where the config comes from: an explicit path, `AENV_CONFIG_PATH`, or the defaults.
pub fn config_path(cli: Option<&Path>) -> Option<PathBuf> {
    cli.map(Path::to_path_buf).or_else(|| {
        std::env::var_os("AENV_CONFIG_PATH")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    })
}

impl Config {
    /// Loads the embedded defaults, merges the file over them, applies env overrides and
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let user = match path {
            Some(p) => Some((
                p.display().to_string(),
                std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                })?,
            )),
            None => None,
        };
        let env: Vec<(String, String)> = std::env::vars().collect();
        Config::from_sources(user.as_ref().map(|(o, t)| (o.as_str(), t.as_str())), &env)
    }

    /// Pure form of [`Config::load`], for tests.
    pub fn from_sources(
        user: Option<(&str, &str)>,
        env: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let mut merged: toml::Table =
            toml::from_str(DEFAULT_TOML).map_err(|e| ConfigError::Parse {
                origin: "embedded defaults".into(),
                message: e.to_string(),
            })?;
        if let Some((origin, text)) = user {
            let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
                origin: origin.into(),
                message: e.to_string(),
            })?;
            merge(&mut merged, table);
        }
        let mut config: Config =
            toml::Value::Table(merged)
                .try_into()
                .map_err(|e: toml::de::Error| ConfigError::Parse {
                    origin: user.map(|u| u.0).unwrap_or("embedded defaults").into(),
                    message: e.to_string(),
                })?;
        config.apply_env(env);
        config.validate()?;
        Ok(config)
    }

    fn apply_env(&mut self, env: &[(String, String)]) {
        for (k, v) in env {
            match k.as_str() {
                "AENV_LISTEN_ADDR" if !v.is_empty() => self.server.listen = v.clone(),
                "AENV_API_KEY" if !v.is_empty() => self.server.api_key = Some(v.clone()),
                "AENV_STATE_DIR" if !v.is_empty() => self.server.state_dir = PathBuf::from(v),
                "AENV_TEMPLATES_BUILD_BASE" => match v.as_str() {
                    "true" | "1" => self.templates.build_base = true,
                    "false" | "0" => self.templates.build_base = false,
                    _ => {}
                },
                "AENV_CLUSTER_NODE" => self.cluster.node = Some(v.clone()),
                "AENV_CLUSTER_ADVERTISE_URL" => self.cluster.advertise_url = v.clone(),
                "AENV_CLUSTER_PEERS" => {
                    self.cluster.peers = v
                        .split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(str::to_string)
                        .collect()
                }
                "AENV_CLUSTER_PEERS_DNS" => self.cluster.peers_dns = v.clone(),
                // Set but blank still wins: it disables the extension (custom-extension.md §1.3).
                "AENV_CUSTOM_EXTENSION_URL" => {
                    self.custom_extension.url = Some(v.clone());
                    self.custom_extension.url_source = Source::Environment;
                }
                "AENV_CUSTOM_EXTENSION_AUTH_TOKEN" => {
                    self.custom_extension.auth_token = Some(v.clone());
                    self.custom_extension.auth_token_source = Source::Environment;
                }
                _ => {}
            }
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        if self.server.listen.parse::<SocketAddr>().is_err() {
            return invalid(
                "server.listen",
                format!("{:?} is not an address:port", self.server.listen),
            );
        }
        if let Some(key) = &self.server.api_key {
            if let Err(m) = validate_api_key(key) {
                return invalid("server.api_key", m);
            }
        }
        let s = &self.server;
        let at_least_one = [
            ("server.http_threads", s.http_threads as u64),
            ("server.quick_threads", s.quick_threads as u64),
            ("server.io_threads", s.io_threads as u64),
            (
                "server.max_inflight_per_sandbox",
                s.max_inflight_per_sandbox as u64,
            ),
            ("server.max_connections", s.max_connections as u64),
            ("server.idle_timeout_secs", s.idle_timeout_secs),
            ("server.header_timeout_secs", s.header_timeout_secs),
            ("server.body_timeout_secs", s.body_timeout_secs),
            ("server.write_timeout_secs", s.write_timeout_secs),
        ];
        for (key, value) in at_least_one {
            if value == 0 {
                return invalid(key, "must be at least 1".into());
            }
        }
        if s.max_header_bytes < 1024 {
            return invalid("server.max_header_bytes", "must be at least 1024".into());
        }
        if let Err(m) = check_state_dir(&self.server.state_dir) {
            return invalid("server.state_dir", m);
        }
        if !(1..=3600).contains(&self.metrics.history_interval_secs) {
            return invalid(
                "metrics.history_interval_secs",
                "must be in 1..=3600".into(),
            );
        }
        if self.metrics.sandbox_interval_secs > 3600 {
            return invalid(
                "metrics.sandbox_interval_secs",
                "must be in 0..=3600 (0 = no history)".into(),
            );
        }
        if !(1..=86400).contains(&self.api.tunnel_idle_secs) {
            return invalid("api.tunnel_idle_secs", "must be in 1..=86400".into());
        }
        validate_sandbox(&self.sandbox)?;
        if self.images.connect_timeout_secs == 0 {
            return invalid("images.connect_timeout_secs", "must be at least 1".into());
        }
        if self.images.read_timeout_secs == 0 {
            return invalid("images.read_timeout_secs", "must be at least 1".into());
        }
        self.network.validate()?;
        self.vm.validate()?;
        self.custom_extension.validate()?;
        self.templates.validate()?;
        if self.agent.max_concurrent_commands == 0 {
            return invalid("agent.max_concurrent_commands", "must be at least 1".into());
        }
        self.volumes.validate()?;
        self.cluster.validate()?;
        self.admission.validate()
    }
}

impl NetworkConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        let n = self;
        let host = Cidr::parse(&n.host_interaction_cidr);
        let veth = Cidr::parse(&n.veth_cidr);
        let Some(host) = host else {
            return invalid(
                "network.host_interaction_cidr",
                format!("{:?} is not an IPv4 CIDR", n.host_interaction_cidr),
            );
        };
        let Some(veth) = veth else {
            return invalid(
                "network.veth_cidr",
                format!("{:?} is not an IPv4 CIDR", n.veth_cidr),
            );
        };
        for c in &n.outbound_denied_cidrs {
            if Cidr::parse(c).is_none() {
                return invalid(
                    "network.outbound_denied_cidrs",
                    format!("{c:?} is not an IPv4 CIDR"),
                );
            }
        }
        validate_allowed(n, host, veth)?;
        if !n.dns.is_empty() && n.dns.parse::<Ipv4Addr>().is_err() {
            return invalid("network.dns", format!("{:?} is not an IPv4 address", n.dns));
        }
        let guest = Cidr::parse("169.254.0.20/30").expect("constant");
        if host.overlaps(&veth) || host.overlaps(&guest) || veth.overlaps(&guest) {
            return invalid(
                "network.host_interaction_cidr",
                "host_interaction_cidr, veth_cidr and 169.254.0.20/30 must not overlap".into(),
            );
        }
        if !(1..=32767).contains(&n.max_slots) {
            return invalid("network.max_slots", "must be within 1..=32767".into());
        }
        if host.size() < n.max_slots as u64 + 2 {
            return invalid(
                "network.host_interaction_cidr",
                format!(
                    "holds fewer than max_slots + 2 = {} addresses",
                    n.max_slots + 2
                ),
            );
        }
        if veth.size() < 2 * (n.max_slots as u64 + 1) {
            return invalid(
                "network.veth_cidr",
                format!(
                    "holds fewer than 2 x (max_slots + 1) = {} addresses",
                    2 * (n.max_slots + 1)
                ),
            );
        }
        if n.pool_min > n.pool_max {
            return invalid(
                "network.pool_min",
                "must not exceed network.pool_max".into(),
            );
        }
        Ok(())
    }
}

impl VmConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        let v = self;
        if v.default_cpu_count == 0 {
            return invalid("vm.default_cpu_count", "must be at least 1".into());
        }
        if v.default_memory_mb < 128 {
            return invalid("vm.default_memory_mb", "must be at least 128".into());
        }
        if v.default_disk_size_mb < 1024 || !v.default_disk_size_mb.is_multiple_of(1024) {
            return invalid(
                "vm.default_disk_size_mb",
                "must be at least 1024 and a multiple of 1024".into(),
            );
        }
        if v.ready_timeout_secs == 0 {
            return invalid("vm.ready_timeout_secs", "must be at least 1".into());
        }
        Ok(())
    }
}

impl TemplatesConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        let t = self;
        if t.max_concurrent_builds == 0 {
            return invalid(
                "templates.max_concurrent_builds",
                "must be at least 1".into(),
            );
        }
        if t.standby_per_template > 16 {
            return invalid(
                "templates.standby_per_template",
                "must be at most 16".into(),
            );
        }
        if !(1..=86_400).contains(&t.standby_idle_secs) {
            return invalid(
                "templates.standby_idle_secs",
                "must be within 1..=86400".into(),
            );
        }
        if !(1..=86_400).contains(&t.build_timeout_secs) {
            return invalid(
                "templates.build_timeout_secs",
                "must be within 1..=86400".into(),
            );
        }
        if !(1..=86_400).contains(&t.start_cmd_timeout_secs) {
            return invalid(
                "templates.start_cmd_timeout_secs",
                "must be within 1..=86400".into(),
            );
        }
        Ok(())
    }
}

impl AdmissionConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let invalid =
            |key: &'static str, message: String| Err(ConfigError::Invalid { key, message });
        let p = self.max_memory_pressure_pct;
        if !(p.is_finite() && (0.0..=100.0).contains(&p)) {
            return invalid(
                "admission.max_memory_pressure_pct",
                "must be within 0..=100 (0 = not checked)".into(),
            );
        }
        if self.vm_startup_mb > 65_536 {
            return invalid("admission.vm_startup_mb", "must be at most 65536".into());
        }
        Ok(())
    }
}

/// `outbound_allowed_cidrs`: IPv4 CIDRs that open nothing of the host interaction, veth
/// or guest ranges.
fn validate_allowed(n: &NetworkConfig, host: Cidr, veth: Cidr) -> Result<(), ConfigError> {
    let guest = Cidr::parse("169.254.0.20/30").expect("constant");
    for c in &n.outbound_allowed_cidrs {
        let message = match Cidr::parse(c) {
            None => format!("{c:?} is not an IPv4 CIDR"),
            Some(a) if a.overlaps(&host) || a.overlaps(&veth) || a.overlaps(&guest) => format!(
                "{c:?} overlaps host_interaction_cidr, veth_cidr or 169.254.0.20/30, which \
                 guests may never reach"
            ),
            Some(_) => continue,
        };
        return Err(ConfigError::Invalid {
            key: "network.outbound_allowed_cidrs",
            message,
        });
    }
    Ok(())
}

/// API key rule of api.md §1.2: 32–256 characters from `[A-Za-z0-9_.~-]`, which holds
/// E2B's own form (`e2b_` and 40 hex digits) that users bring from their setups.
pub fn validate_api_key(key: &str) -> Result<(), String> {
    let ok_chars = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_.~-".contains(&b));
    if !(32..=256).contains(&key.len()) || !ok_chars {
        return Err("an API key must be 32-256 characters from [A-Za-z0-9_.~-]".into());
    }
    Ok(())
}

/// Recursive table merge: values from `over` replace those in `base`; unknown keys are
/// kept so that deserialization refuses them with their name.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Config, ConfigError> {
        Config::from_sources(Some(("test.toml", text)), &[])
    }

    #[test]
    fn defaults_are_valid() {
        let c = Config::from_sources(None, &[]).unwrap();
        assert_eq!(c.server.listen, "0.0.0.0:8000");
        assert_eq!(c.network.max_slots, 1024);
        assert_eq!(c.vm.accel, AccelMode::Auto);
        assert_eq!(c.agent.port, 49983);
    }

    #[test]
    fn unknown_keys_are_refused_with_their_name() {
        let e = load("[server]\nlisten_addr = \"1.2.3.4:1\"\n").unwrap_err();
        assert!(e.to_string().contains("listen_addr"), "{e}");
        let e = load("[nope]\n").unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn env_overrides_file() {
        let env = vec![("AENV_LISTEN_ADDR".to_string(), "127.0.0.1:9".to_string())];
        let c =
            Config::from_sources(Some(("f", "[server]\nlisten=\"127.0.0.1:1\"")), &env).unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:9");
    }

    #[test]
    fn cluster_keys() {
        let c = Config::from_sources(None, &[]).unwrap();
        assert_eq!(c.cluster.node(), None);
        let file = "[cluster]\nnode = \"n1\"\nadvertise_url = \"http://198.51.100.1:3000\"\n\
                    peers = [\"http://198.51.100.1:3000\", \"http://198.51.100.2:3000\"]\n";
        let c = load(file).unwrap();
        assert_eq!(c.cluster.node(), Some("n1"));
        assert_eq!(c.cluster.peers.len(), 2);
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let c = Config::from_sources(
            Some(("f", file)),
            &env(&[
                ("AENV_CLUSTER_NODE", "n-2"),
                ("AENV_CLUSTER_ADVERTISE_URL", "http://198.51.100.2:3000"),
                ("AENV_CLUSTER_PEERS", ""),
                ("AENV_CLUSTER_PEERS_DNS", "agentenv-peers.default.svc:3000"),
            ]),
        )
        .unwrap();
        assert_eq!(c.cluster.node(), Some("n-2"));
        assert!(c.cluster.peers.is_empty());
        assert_eq!(c.cluster.peers_dns, "agentenv-peers.default.svc:3000");
        let bad = [
            ("[cluster]\nnode = \"N1\"\nadvertise_url = \"http://a:1\"\n", "cluster.node"),
            ("[cluster]\nnode = \"n1\"\n", "cluster.advertise_url"),
            ("[cluster]\npeers = [\"http://a:1\"]\n", "cluster.node"),
            (
                "[cluster]\nnode = \"n1\"\nadvertise_url = \"http://a:1\"\npeers = [\"a:1\"]\n",
                "cluster.peers",
            ),
            (
                "[cluster]\nnode = \"n1\"\nadvertise_url = \"http://a:1\"\npeers = [\"http://a:1\"]\npeers_dns = \"p:1\"\n",
                "cluster.peers_dns",
            ),
            (
                "[cluster]\nnode = \"n1\"\nadvertise_url = \"http://a:1\"\npeers_dns = \"p\"\n",
                "cluster.peers_dns",
            ),
        ];
        for (text, key) in bad {
            let e = load(text).unwrap_err();
            assert!(e.to_string().contains(key), "{text}: {e}");
        }
    }

    #[test]
    fn state_dir_must_be_absolute_utf8_without_commas() {
        let e = load("[server]\nstate_dir = \"var/lib/agentenv\"\n").unwrap_err();
        assert!(
            e.to_string().contains("server.state_dir") && e.to_string().contains("relative"),
            "{e}"
        );
        let env = vec![("AENV_STATE_DIR".to_string(), "./state".to_string())];
        assert!(Config::from_sources(None, &env).is_err());
        let e = load("[server]\nstate_dir = \"/srv/a,b\"\n").unwrap_err();
        assert!(e.to_string().contains("comma"), "{e}");
        let long = format!("/{}", "d".repeat(120));
        assert!(load(&format!("[server]\nstate_dir = \"{long}\"\n")).is_ok());
    }

    #[test]
    fn network_validation() {
        let e = load("[network]\nveth_cidr = \"198.18.0.0/16\"\n").unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = load("[network]\nhost_interaction_cidr = \"198.18.0.0/24\"\n").unwrap_err();
        assert!(e.to_string().contains("max_slots + 2"), "{e}");
        let e = load("[network]\npool_min = 9\npool_max = 3\n").unwrap_err();
        assert!(e.to_string().contains("pool_min"), "{e}");
        let e = load("[network]\nmax_slots = 0\n").unwrap_err();
        assert!(e.to_string().contains("max_slots"), "{e}");
        let e = load("[network]\nveth_cidr = \"bogus\"\n").unwrap_err();
        assert!(e.to_string().contains("veth_cidr"), "{e}");
    }

    #[test]
    fn api_key_rules() {
        assert!(validate_api_key(&"a".repeat(32)).is_ok());
        assert!(validate_api_key(&"a".repeat(31)).is_err());
        assert!(validate_api_key(&format!("{}!", "a".repeat(32))).is_err());
        // E2B's form, as users paste it from an E2B setup.
        let e2b = format!("e2b_{}", "0123456789abcdef0123456789abcdef01234567");
        assert_eq!(e2b.len(), 44);
        assert!(validate_api_key(&e2b).is_ok());
        assert!(validate_api_key(&format!("{e2b} ")).is_err());
        let e = load(&format!("[server]\napi_key = \"{}\"\n", "short")).unwrap_err();
        assert!(e.to_string().contains("api_key"), "{e}");
    }

    #[test]
    fn extension_url_normalisation_and_validation() {
        let c = load("[custom_extension]\nurl = \"  http://ext:9090//  \"\n").unwrap();
        assert_eq!(
            c.custom_extension.base_url().as_deref(),
            Some("http://ext:9090")
        );
        let c = load("[custom_extension]\nurl = \"http://127.0.0.1:9090/prefix/\"\n").unwrap();
        assert_eq!(
            c.custom_extension.base_url().as_deref(),
            Some("http://127.0.0.1:9090/prefix")
        );
        let c = load("[custom_extension]\nurl = \"   \"\n").unwrap();
        assert_eq!(c.custom_extension.base_url(), None);
        for bad in [
            "ftp://x",
            "http://",
            "http://x/?q=1",
            "http://x/#f",
            "http://u:p@x/",
            "x:9090",
        ] {
            let e = load(&format!("[custom_extension]\nurl = \"{bad}\"\n")).unwrap_err();
            assert!(e.to_string().contains("custom_extension.url"), "{bad}: {e}");
            assert!(e.to_string().contains("config file"), "{bad}: {e}");
        }
        let e = load("[custom_extension]\ntimeout_ms = 0\n").unwrap_err();
        assert!(e.to_string().contains("timeout_ms"), "{e}");
        let e = load("[custom_extension]\nauth_token = \"a b\"\n").unwrap_err();
        assert!(e.to_string().contains("auth_token"), "{e}");
        let e = load("[custom_extension]\nurl2 = \"x\"\n").unwrap_err();
        assert!(e.to_string().contains("url2"), "{e}");
    }

    #[test]
    fn extension_env_overrides_even_when_blank() {
        let env = vec![("AENV_CUSTOM_EXTENSION_URL".to_string(), " ".to_string())];
        let c = Config::from_sources(
            Some(("f", "[custom_extension]\nurl = \"http://a:1\"\n")),
            &env,
        )
        .unwrap();
        assert_eq!(c.custom_extension.base_url(), None);
        let env = vec![(
            "AENV_CUSTOM_EXTENSION_URL".to_string(),
            "gopher://x".to_string(),
        )];
        let e = Config::from_sources(None, &env).unwrap_err();
        assert!(e.to_string().contains("environment"), "{e}");
    }

    #[test]
    fn cidr_math() {
        let c = Cidr::parse("198.18.0.0/16").unwrap();
        assert_eq!(c.nth(300), "198.18.1.44".parse::<Ipv4Addr>().unwrap());
        assert!(Cidr::parse("198.18.0.1/16").is_none());
        assert!(c.overlaps(&Cidr::parse("198.18.5.0/24").unwrap()));
        assert!(!c.overlaps(&Cidr::parse("198.19.0.0/16").unwrap()));
    }
}
