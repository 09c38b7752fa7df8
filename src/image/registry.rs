//! Pulling from registries (OCI distribution API): endpoint and scheme selection,
//! anonymous, basic and bearer-token auth, manifest negotiation with digest checks, and a
//! [`BlobSource`] whose blobs land in the content-addressed cache.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Cursor, Read};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::Deserialize;

use super::cache::{BlobCache, Pin};
use super::layout::{
    digest_hex, sha256_digest, BlobSource, Descriptor, DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX,
    OCI_MANIFEST,
};
use super::reference::RegistryReference;
use super::{ImageError, Progress};

/// Manifests larger than this are refused.
const MAX_MANIFEST: u64 = 8 << 20;
/// Layers downloaded at once per pull.
const PARALLEL_DOWNLOADS: usize = 3;
/// Token lifetime when the token server does not say (distribution's default).
const DEFAULT_TOKEN_SECS: u64 = 60;
const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
     application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_SCHEMA1: &str = "application/vnd.docker.distribution.manifest.v1";

/// How images are pulled and cached (`[images]` in the config).
#[derive(Debug, Clone)]
pub struct ImageOptions {
    /// `host[:port]` registries reached over plain HTTP besides loopback ones.
    pub insecure_registries: Vec<String>,
    /// `(registry, username, password)`; `docker.io` names Docker Hub.
    pub credentials: Vec<(String, String, String)>,
    /// A Docker `config.json` read for `auths`; missing is fine.
    pub docker_config: Option<PathBuf>,
    /// 0 = no cap.
    pub cache_max_mb: u64,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
}

impl Default for ImageOptions {
    fn default() -> ImageOptions {
        ImageOptions {
            insecure_registries: Vec::new(),
            credentials: Vec::new(),
            docker_config: None,
            cache_max_mb: 0,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(60),
        }
    }
}

impl From<&crate::config::ImagesConfig> for ImageOptions {
    fn from(c: &crate::config::ImagesConfig) -> ImageOptions {
        ImageOptions {
            insecure_registries: c.insecure_registries.clone(),
            credentials: c
                .credentials
                .iter()
                .map(|c| (c.registry.clone(), c.username.clone(), c.password.clone()))
                .collect(),
            docker_config: Some(PathBuf::from(&c.docker_config))
                .filter(|p| !p.as_os_str().is_empty()),
            cache_max_mb: c.cache_max_mb,
            connect_timeout: Duration::from_secs(c.connect_timeout_secs),
            read_timeout: Duration::from_secs(c.read_timeout_secs),
        }
    }
}

/// The API host for a reference domain: Docker Hub's images live on `registry-1.docker.io`.
pub fn api_host(domain: &str) -> &str {
    if domain == "docker.io" || domain == "index.docker.io" {
        "registry-1.docker.io"
    } else {
        domain
    }
}

/// The host part of `host[:port]` / `[v6]:port`, without brackets.
fn host_of(domain: &str) -> &str {
    if let Some(rest) = domain.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    domain.split(':').next().unwrap_or(domain)
}

/// Whether `domain` (`host[:port]`) is this machine.
pub fn is_loopback(domain: &str) -> bool {
    let host = host_of(domain);
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Plain HTTP for loopback and listed insecure registries, HTTPS otherwise.
pub fn scheme_for(domain: &str, insecure: &[String]) -> &'static str {
    if is_loopback(domain) || insecure.iter().any(|r| r == domain) {
        "http"
    } else {
        "https"
    }
}

/// A parsed `WWW-Authenticate` challenge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// Lowercase: `bearer` or `basic`.
    pub scheme: String,
    pub params: HashMap<String, String>,
}

/// Parses `Bearer realm="…",service="…",scope="…"`. Quoted values may contain commas.
pub fn parse_challenge(header: &str) -> Option<Challenge> {
    let header = header.trim();
    let (scheme, rest) = header.split_once(' ').unwrap_or((header, ""));
    if scheme.is_empty() {
        return None;
    }
    let mut params = HashMap::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars
            .by_ref()
            .take_while(|c| *c != '=')
            .collect::<String>()
            .trim()
            .to_ascii_lowercase();
        if key.is_empty() {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.peek() {
                if *c == ',' {
                    break;
                }
                value.push(*c);
                chars.next();
            }
            value = value.trim().to_string();
        }
        params.insert(key, value);
    }
    Some(Challenge {
        scheme: scheme.to_ascii_lowercase(),
        params,
    })
}

/// Decodes standard base64 (with or without padding). Not crypto: Docker's config.json
/// stores `user:password` this way.
pub fn base64_decode(input: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(input.len() * 3 / 4);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for c in input.trim_end_matches('=').bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

fn base64_encode(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The registry key a Docker config.json entry stands for: scheme and path dropped,
/// Docker Hub's aliases folded to `docker.io`.
fn normalise_auth_key(key: &str) -> String {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = key.split('/').next().unwrap_or(key);
    match host {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".to_string()
        }
        h => h.to_string(),
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, DockerAuth>,
}

#[derive(Deserialize)]
struct DockerAuth {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Credentials for `domain` from a Docker config.json text.
pub fn docker_config_credentials(text: &str, domain: &str) -> Option<(String, String)> {
    let config: DockerConfig = serde_json::from_str(text).ok()?;
    let want = normalise_auth_key(domain);
    let entry = config
        .auths
        .iter()
        .find(|(k, _)| normalise_auth_key(k) == want)?
        .1;
    if let Some(auth) = entry.auth.as_deref().filter(|a| !a.is_empty()) {
        let decoded = String::from_utf8(base64_decode(auth)?).ok()?;
        let (user, pass) = decoded.split_once(':')?;
        return Some((user.to_string(), pass.to_string()));
    }
    Some((entry.username.clone()?, entry.password.clone()?))
}

#[derive(Deserialize)]
struct TokenResponse {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
    #[serde(default)]
    expires_in: Option<u64>,
}

#[derive(Deserialize)]
struct RegistryErrors {
    #[serde(default)]
    errors: Vec<RegistryErrorEntry>,
}

#[derive(Deserialize)]
struct RegistryErrorEntry {
    #[serde(default)]
    code: String,
    #[serde(default)]
    message: String,
}

/// The registry's own words from an error body (`MANIFEST_UNKNOWN: manifest unknown`).
fn registry_answer(status: u16, body: &str) -> String {
    let from_json = serde_json::from_str::<RegistryErrors>(body)
        .ok()
        .map(|e| {
            e.errors
                .iter()
                .map(|e| format!("{}: {}", e.code, e.message))
                .collect::<Vec<_>>()
                .join("; ")
        })
        .filter(|s| !s.is_empty());
    match from_json {
        Some(s) => format!("HTTP {status} {s}"),
        None => {
            let text: String = body.trim().chars().take(200).collect();
            if text.is_empty() {
                format!("HTTP {status}")
            } else {
                format!("HTTP {status} {text}")
            }
        }
    }
}

/// How many redirects one request may follow (blob storage, token servers).
const MAX_REDIRECTS: usize = 5;

/// Why a registry GET failed.
enum Fetch {
    /// A 4xx or 5xx answer.
    Status(u16, Box<ureq::Response>),
    /// No answer: transport error, or a redirect that is refused.
    Failed(String),
}

/// The origin (scheme, lowercase host, port) of an http(s) URL; `None` for other schemes
/// and for URLs carrying credentials (`user:pass@`).
fn origin(url: &str) -> Option<(&'static str, String, u16)> {
    let (scheme, rest, default_port) = if let Some(rest) = url.strip_prefix("https://") {
        ("https", rest, 443)
    } else if let Some(rest) = url.strip_prefix("http://") {
        ("http", rest, 80)
    } else {
        return None;
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && (!h.starts_with('[') || h.ends_with(']')) => {
            (h, p.parse::<u16>().ok()?)
        }
        _ if authority.starts_with('[') && !authority.ends_with(']') => return None,
        _ => (authority, default_port),
    };
    Some((scheme, host.to_ascii_lowercase(), port))
}

/// Resolves a `Location` header against the URL that sent it; `None` unless the result is
/// an http(s) URL without credentials.
fn resolve_location(base: &str, location: &str) -> Option<String> {
    let location = location.trim();
    let (scheme, rest) = base.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let resolved = if location.contains("://") {
        location.to_string()
    } else if let Some(rest) = location.strip_prefix("//") {
        format!("{scheme}://{rest}")
    } else if location.starts_with('/') {
        format!("{scheme}://{authority}{location}")
    } else if location.is_empty() {
        return None;
    } else {
        let path = rest[authority.len()..]
            .split(['?', '#'])
            .next()
            .unwrap_or("");
        let dir = path.rsplit_once('/').map_or("", |(d, _)| d);
        format!("{scheme}://{authority}{dir}/{location}")
    };
    origin(&resolved).map(|_| resolved)
}

/// Percent-encodes a query value.
fn query_escape(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A cached `Authorization` value for one registry and repository.
struct CachedAuth {
    header: String,
    expires: Option<Instant>,
}

/// Talks to registries. Shared by all pulls; keeps bearer tokens per repository.
pub struct RegistryClient {
    agent: ureq::Agent,
    options: ImageOptions,
    auth: Mutex<HashMap<(String, String), CachedAuth>>,
}

impl RegistryClient {
    pub fn new(options: ImageOptions) -> RegistryClient {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(options.connect_timeout)
            .timeout_read(options.read_timeout)
            .timeout_write(options.read_timeout)
            // Redirects are followed by hand (see `fetch`): ureq's same-host rule keeps
            // `Authorization` for another port on the same host.
            .redirects(0)
            .user_agent(concat!("agentenv/", env!("CARGO_PKG_VERSION")))
            .build();
        RegistryClient {
            agent,
            options,
            auth: Mutex::new(HashMap::new()),
        }
    }

    fn base_url(&self, domain: &str) -> String {
        format!(
            "{}://{}",
            scheme_for(domain, &self.options.insecure_registries),
            api_host(domain)
        )
    }

    fn may_send_secrets_to(&self, url: &str) -> bool {
        if url.starts_with("https://") {
            return true;
        }
        let host = url
            .strip_prefix("http://")
            .and_then(|r| r.split('/').next())
            .unwrap_or("");
        is_loopback(host) || self.options.insecure_registries.iter().any(|r| r == host)
    }

    /// Basic credentials for `domain`: `[images] credentials`, then the Docker config.
    fn credentials(&self, domain: &str) -> Option<(String, String)> {
        let want = normalise_auth_key(domain);
        if let Some((_, u, p)) = self
            .options
            .credentials
            .iter()
            .find(|(r, _, _)| normalise_auth_key(r) == want)
        {
            return Some((u.clone(), p.clone()));
        }
        let path = self.options.docker_config.as_ref()?;
        let text = std::fs::read_to_string(path).ok()?;
        docker_config_credentials(&text, domain)
    }

    fn basic_header(user: &str, pass: &str) -> String {
        format!(
            "Basic {}",
            base64_encode(format!("{user}:{pass}").as_bytes())
        )
    }

    /// GET `path` (under `/v2/`) on the reference's registry, authenticating on a 401
    /// challenge and retrying once. Non-2xx answers become errors naming `what`.
    fn get(
        &self,
        r: &RegistryReference,
        path: &str,
        accept: Option<&str>,
        what: &str,
    ) -> Result<ureq::Response, ImageError> {
        let url = format!("{}/v2/{}", self.base_url(&r.domain), path);
        let key = (r.domain.clone(), r.repository.clone());
        let mut retried = false;
        loop {
            let cached = {
                let mut map = self.auth.lock();
                match map.get(&key) {
                    Some(a) if a.expires.is_none_or(|e| e > Instant::now()) => {
                        Some(a.header.clone())
                    }
                    Some(_) => {
                        map.remove(&key);
                        None
                    }
                    None => None,
                }
            };
            match self.fetch(&url, accept, cached.as_deref()) {
                Ok(resp) => return Ok(resp),
                Err(Fetch::Status(401, resp)) if !retried => {
                    retried = true;
                    let header = resp.header("www-authenticate").unwrap_or("").to_string();
                    let answer = registry_answer(401, &resp.into_string().unwrap_or_default());
                    let auth = self.authenticate(r, &header, &answer)?;
                    self.auth.lock().insert(key.clone(), auth);
                }
                Err(Fetch::Status(code, resp)) => {
                    let answer = registry_answer(code, &resp.into_string().unwrap_or_default());
                    return Err(status_error(code, r, what, &answer, cached.is_some()));
                }
                Err(Fetch::Failed(t)) => {
                    return Err(ImageError::Upstream(format!(
                        "cannot reach registry {} ({url}) for {what}: {t}",
                        r.domain
                    )))
                }
            }
        }
    }

    /// GET `url`, following up to [`MAX_REDIRECTS`] redirects by hand: only to http(s)
    /// URLs without credentials in them, never from https down to plain http (except to
    /// loopback or listed insecure registries), and with `Authorization` only while the
    /// origin (scheme, host and port) is the one it was meant for.
    fn fetch(
        &self,
        url: &str,
        accept: Option<&str>,
        authorization: Option<&str>,
    ) -> Result<ureq::Response, Fetch> {
        let first_origin = origin(url);
        let mut url = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.get(&url);
            if let Some(a) = accept {
                req = req.set("Accept", a);
            }
            if let Some(h) = authorization.filter(|_| origin(&url) == first_origin) {
                req = req.set("Authorization", h);
            }
            let resp = match req.call() {
                Ok(resp) => resp,
                Err(ureq::Error::Status(code, resp)) => {
                    return Err(Fetch::Status(code, Box::new(resp)))
                }
                Err(ureq::Error::Transport(t)) => return Err(Fetch::Failed(t.to_string())),
            };
            if !(300..400).contains(&resp.status()) {
                return Ok(resp);
            }
            let location = resp.header("location").unwrap_or("").to_string();
            let next = resolve_location(&url, &location).ok_or_else(|| {
                Fetch::Failed(format!(
                    "{url} redirected to {location:?}, which is not an http(s) URL without \
                     credentials"
                ))
            })?;
            if url.starts_with("https://")
                && next.starts_with("http://")
                && !self.may_send_secrets_to(&next)
            {
                return Err(Fetch::Failed(format!(
                    "{url} redirected from https down to plain http ({next})"
                )));
            }
            url = next;
        }
        Err(Fetch::Failed(format!(
            "more than {MAX_REDIRECTS} redirects, the last to {url}"
        )))
    }

    /// Answers a 401 challenge with basic credentials or a bearer token.
    fn authenticate(
        &self,
        r: &RegistryReference,
        header: &str,
        answer: &str,
    ) -> Result<CachedAuth, ImageError> {
        let creds = self.credentials(&r.domain);
        let denied = |why: String| {
            ImageError::Denied(format!("registry {} refused access ({why})", r.domain))
        };
        let Some(challenge) = parse_challenge(header) else {
            return Err(denied(format!("{answer}, with no usable WWW-Authenticate")));
        };
        match challenge.scheme.as_str() {
            "basic" => {
                let Some((u, p)) = creds else {
                    return Err(denied(format!(
                        "{answer}; it wants a login: add it to [images] credentials or the \
                         Docker config.json"
                    )));
                };
                if !self.may_send_secrets_to(&self.base_url(&r.domain)) {
                    return Err(denied(
                        "refusing to send credentials over plain HTTP".into(),
                    ));
                }
                Ok(CachedAuth {
                    header: Self::basic_header(&u, &p),
                    expires: None,
                })
            }
            "bearer" => self.bearer_token(r, &challenge, creds, denied),
            other => Err(denied(format!(
                "{answer}; unsupported auth scheme {other:?}"
            ))),
        }
    }

    /// Answers a bearer challenge: asks its token realm (with the basic credentials, when
    /// they may go there) for a pull token of `r`'s repository, or the scope it names.
    fn bearer_token(
        &self,
        r: &RegistryReference,
        challenge: &Challenge,
        creds: Option<(String, String)>,
        denied: impl Fn(String) -> ImageError,
    ) -> Result<CachedAuth, ImageError> {
        let realm = challenge.params.get("realm").cloned().unwrap_or_default();
        if !(realm.starts_with("https://") || realm.starts_with("http://")) {
            return Err(denied(format!(
                "token realm {realm:?} is not an http(s) URL"
            )));
        }
        let scope = challenge
            .params
            .get("scope")
            .cloned()
            .unwrap_or_else(|| format!("repository:{}:pull", r.repository));
        if origin(&realm).is_none() {
            return Err(denied(format!(
                "token realm {realm:?} is not a plain http(s) URL"
            )));
        }
        let mut token_url = format!(
            "{realm}{}scope={}",
            if realm.contains('?') { '&' } else { '?' },
            query_escape(&scope)
        );
        if let Some(service) = challenge.params.get("service") {
            token_url.push_str(&format!("&service={}", query_escape(service)));
        }
        let basic = creds
            .as_ref()
            .filter(|_| self.may_send_secrets_to(&realm))
            .map(|(u, p)| Self::basic_header(u, p));
        let resp = match self.fetch(&token_url, None, basic.as_deref()) {
            Ok(resp) => resp,
            Err(Fetch::Status(code, resp)) if code < 500 && code != 429 => {
                let answer = registry_answer(code, &resp.into_string().unwrap_or_default());
                return Err(denied(format!("token server {realm}: {answer}")));
            }
            Err(Fetch::Status(code, resp)) => {
                let answer = registry_answer(code, &resp.into_string().unwrap_or_default());
                return Err(ImageError::Upstream(format!(
                    "token server {realm} for {}: {answer}",
                    r.domain
                )));
            }
            Err(Fetch::Failed(t)) => {
                return Err(ImageError::Upstream(format!(
                    "cannot reach token server {realm} for {}: {t}",
                    r.domain
                )))
            }
        };
        read_token(resp, &realm)
    }

    /// Fetches a manifest or index by tag or digest and checks its digest. Returns the
    /// descriptor (media type from the response) and the bytes.
    pub fn fetch_manifest(
        &self,
        r: &RegistryReference,
        tag_or_digest: &str,
    ) -> Result<(Descriptor, Vec<u8>), ImageError> {
        let what = format!("manifest {tag_or_digest}");
        let resp = self.get(
            r,
            &format!("{}/manifests/{tag_or_digest}", r.repository),
            Some(MANIFEST_ACCEPT),
            &what,
        )?;
        let content_type = resp.content_type().to_string();
        let header_digest = resp.header("docker-content-digest").map(str::to_string);
        let mut body = Vec::new();
        resp.into_reader()
            .take(MAX_MANIFEST + 1)
            .read_to_end(&mut body)
            .map_err(|e| ImageError::Upstream(format!("reading {what} from {}: {e}", r.domain)))?;
        if body.len() as u64 > MAX_MANIFEST {
            return Err(ImageError::BadImage(format!(
                "{what} is larger than {MAX_MANIFEST} bytes"
            )));
        }
        let digest = sha256_digest(&body);
        if tag_or_digest.starts_with("sha256:") && digest != tag_or_digest {
            return Err(ImageError::BadImage(format!(
                "{what} from {} has digest {digest}",
                r.domain
            )));
        }
        if let Some(h) = header_digest.filter(|h| h.starts_with("sha256:")) {
            if h != digest {
                return Err(ImageError::BadImage(format!(
                    "{what} from {} has digest {digest}, the registry says {h}",
                    r.domain
                )));
            }
        }
        let media_type = manifest_media_type(&content_type, &body)?;
        Ok((
            Descriptor {
                media_type,
                digest,
                size: body.len() as u64,
                platform: None,
                annotations: Default::default(),
            },
            body,
        ))
    }

    /// Opens a blob download; redirects (to blob storage) are followed.
    pub fn open_blob(
        &self,
        r: &RegistryReference,
        desc: &Descriptor,
    ) -> Result<Box<dyn Read + Send>, ImageError> {
        let what = format!("blob {}", desc.digest);
        let resp = self.get(
            r,
            &format!("{}/blobs/{}", r.repository, desc.digest),
            None,
            &what,
        )?;
        if let Some(len) = resp
            .header("content-length")
            .and_then(|l| l.parse::<u64>().ok())
        {
            if len != desc.size {
                return Err(ImageError::BadImage(format!(
                    "{what} is {len} bytes, its descriptor says {}",
                    desc.size
                )));
            }
        }
        Ok(Box::new(resp.into_reader()))
    }
}

/// The token in a token server's answer (at most 1 MiB), cached until a little before
/// it expires.
fn read_token(resp: ureq::Response, realm: &str) -> Result<CachedAuth, ImageError> {
    let mut body = Vec::new();
    resp.into_reader()
        .take(1 << 20)
        .read_to_end(&mut body)
        .map_err(|e| ImageError::Upstream(format!("reading a token from {realm}: {e}")))?;
    let answer: TokenResponse = serde_json::from_slice(&body)
        .map_err(|e| ImageError::Upstream(format!("token server {realm} answered badly: {e}")))?;
    // Refresh a little early.
    let secs = answer
        .expires_in
        .unwrap_or(DEFAULT_TOKEN_SECS)
        .saturating_sub(5)
        .max(1);
    let Some(token) = answer.token.or(answer.access_token) else {
        return Err(ImageError::Upstream(format!(
            "token server {realm} sent no token"
        )));
    };
    Ok(CachedAuth {
        header: format!("Bearer {token}"),
        expires: Some(Instant::now() + Duration::from_secs(secs)),
    })
}

fn status_error(
    code: u16,
    r: &RegistryReference,
    what: &str,
    answer: &str,
    authenticated: bool,
) -> ImageError {
    match code {
        404 => ImageError::NotFound(format!(
            "{what} not found in {}/{}: registry answered {answer}",
            r.domain, r.repository
        )),
        401 | 403 => ImageError::Denied(format!(
            "registry {} denied {what} of {} ({}): {answer}",
            r.domain,
            r.repository,
            if authenticated {
                "the repository does not exist or the credentials do not allow pulling it"
            } else {
                "credentials needed"
            }
        )),
        429 | 500..=599 => ImageError::Upstream(format!(
            "registry {} failed {what} of {}: {answer}",
            r.domain, r.repository
        )),
        _ => ImageError::Upstream(format!(
            "registry {} gave an unexpected answer to {what} of {}: {answer}",
            r.domain, r.repository
        )),
    }
}

/// The manifest media type: the response's Content-Type, else the body's `mediaType`.
fn manifest_media_type(content_type: &str, body: &[u8]) -> Result<String, ImageError> {
    let known = |t: &str| matches!(t, OCI_INDEX | OCI_MANIFEST | DOCKER_LIST | DOCKER_MANIFEST);
    let ct = content_type.split(';').next().unwrap_or("").trim();
    if known(ct) {
        return Ok(ct.to_string());
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        #[serde(default)]
        media_type: Option<String>,
        #[serde(default)]
        schema_version: Option<u32>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
        #[serde(default)]
        layers: Option<serde_json::Value>,
    }
    let probe: Probe = serde_json::from_slice(body)
        .map_err(|e| ImageError::BadImage(format!("the manifest is not valid JSON: {e}")))?;
    if ct.starts_with(DOCKER_SCHEMA1) || probe.schema_version == Some(1) {
        return Err(ImageError::Unsupported(
            "Docker schema 1 manifests are not supported; push the image again with a \
             current tool"
                .into(),
        ));
    }
    match probe.media_type.as_deref() {
        Some(t) if known(t) => Ok(t.to_string()),
        Some(t) => Err(ImageError::BadImage(format!(
            "unknown manifest media type {t:?}"
        ))),
        None if probe.manifests.is_some() => Ok(OCI_INDEX.to_string()),
        None if probe.layers.is_some() => Ok(OCI_MANIFEST.to_string()),
        None => Err(ImageError::BadImage(format!(
            "unknown manifest content type {ct:?}"
        ))),
    }
}

fn is_manifest_type(media_type: &str) -> bool {
    matches!(
        media_type,
        OCI_INDEX | OCI_MANIFEST | DOCKER_LIST | DOCKER_MANIFEST
    )
}

/// One image in a registry, as a [`BlobSource`]. Manifests stay in memory (and, when
/// addressed by digest, in the cache); configs and layers are downloaded into the
/// cache and read from there.
pub struct RegistrySource {
    client: Arc<RegistryClient>,
    cache: Arc<BlobCache>,
    reference: RegistryReference,
    manifests: Mutex<HashMap<String, Vec<u8>>>,
    pins: Mutex<Vec<Pin>>,
}

impl RegistrySource {
    pub fn new(
        client: Arc<RegistryClient>,
        cache: Arc<BlobCache>,
        reference: RegistryReference,
    ) -> RegistrySource {
        RegistrySource {
            client,
            cache,
            reference,
            manifests: Mutex::new(HashMap::new()),
            pins: Mutex::new(Vec::new()),
        }
    }

    /// The blob, downloaded into the cache if absent, pinned for this pull.
    fn cached_blob(&self, desc: &Descriptor) -> Result<PathBuf, ImageError> {
        self.cached_blob_counted(desc, &Progress::default())
    }

    /// [`RegistrySource::cached_blob`], its bytes added to `progress` as they arrive
    /// (all of them at once when the cache had it).
    fn cached_blob_counted(
        &self,
        desc: &Descriptor,
        progress: &Progress,
    ) -> Result<PathBuf, ImageError> {
        let what = format!("reference={} blob={}", self.reference, desc.digest);
        let counted = Arc::new(AtomicU64::new(0));
        let path = self
            .cache
            .get_or_fetch(&desc.digest, Some(desc.size), &what, || {
                let blob = self.client.open_blob(&self.reference, desc)?;
                Ok(progress.counting(blob, counted.clone()))
            })?;
        progress.add(desc.size.saturating_sub(counted.load(Ordering::Relaxed)));
        self.pins.lock().push(self.cache.pin(&path));
        Ok(path)
    }

    fn manifest_bytes(&self, desc: &Descriptor) -> Result<Vec<u8>, ImageError> {
        if let Some(b) = self.manifests.lock().get(&desc.digest) {
            return Ok(b.clone());
        }
        if let Some(path) = self.cache.cached(&desc.digest)? {
            if let Ok(b) = std::fs::read(&path) {
                if sha256_digest(&b) == desc.digest {
                    return Ok(b);
                }
            }
        }
        let (_, body) = self.client.fetch_manifest(&self.reference, &desc.digest)?;
        // By digest: immutable, so worth keeping.
        self.cache.put(&desc.digest, &body)?;
        self.manifests
            .lock()
            .insert(desc.digest.clone(), body.clone());
        Ok(body)
    }
}

impl BlobSource for RegistrySource {
    fn root_descriptor(&self) -> Result<Descriptor, ImageError> {
        let r = &self.reference;
        // A digest reference is immutable: a cached copy needs no registry round trip.
        if let Some(digest) = &r.digest {
            digest_hex(digest)?;
            if let Some(path) = self.cache.cached(digest)? {
                if let Ok(body) = std::fs::read(&path) {
                    if &sha256_digest(&body) == digest {
                        let media_type = manifest_media_type("", &body)?;
                        let desc = Descriptor {
                            media_type,
                            digest: digest.clone(),
                            size: body.len() as u64,
                            platform: None,
                            annotations: Default::default(),
                        };
                        self.manifests.lock().insert(digest.clone(), body);
                        return Ok(desc);
                    }
                }
            }
        }
        let target = r
            .digest
            .clone()
            .or_else(|| r.tag.clone())
            .unwrap_or_else(|| "latest".to_string());
        let (desc, body) = self.client.fetch_manifest(r, &target)?;
        if r.digest.is_some() {
            self.cache.put(&desc.digest, &body)?;
        }
        self.manifests.lock().insert(desc.digest.clone(), body);
        Ok(desc)
    }

    fn open_blob(&self, desc: &Descriptor) -> Result<Box<dyn Read + Send>, ImageError> {
        if is_manifest_type(&desc.media_type) {
            return Ok(Box::new(Cursor::new(self.manifest_bytes(desc)?)));
        }
        let path = self.cached_blob(desc)?;
        let file = File::open(&path)
            .map_err(|e| ImageError::Io(format!("cannot open {}: {e}", path.display())))?;
        Ok(Box::new(file))
    }

    fn prefetch(&self, layers: &[Descriptor], progress: &Progress) -> Result<(), ImageError> {
        let next = std::sync::atomic::AtomicUsize::new(0);
        let first_error: Mutex<Option<ImageError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..PARALLEL_DOWNLOADS.min(layers.len()) {
                s.spawn(|| loop {
                    if first_error.lock().is_some() {
                        return;
                    }
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(layer) = layers.get(i) else { return };
                    if let Err(e) = self.cached_blob_counted(layer, progress) {
                        first_error.lock().get_or_insert(e);
                        return;
                    }
                });
            }
        });
        match first_error.into_inner() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_redirect_targets() {
        assert_eq!(
            origin("http://127.0.0.1:5000/v2/"),
            Some(("http", "127.0.0.1".into(), 5000))
        );
        assert_eq!(
            origin("https://Reg.Example/v2"),
            Some(("https", "reg.example".into(), 443))
        );
        assert_eq!(
            origin("http://[::1]:80/x"),
            Some(("http", "[::1]".into(), 80))
        );
        assert_eq!(origin("http://user:pw@host/x"), None);
        assert_eq!(origin("file:///etc/passwd"), None);
        assert_eq!(origin("ftp://host/x"), None);
        let base = "http://127.0.0.1:5000/v2/a/blobs/sha256:1?x=1";
        assert_eq!(
            resolve_location(base, "/store/b").as_deref(),
            Some("http://127.0.0.1:5000/store/b")
        );
        assert_eq!(
            resolve_location(base, "c").as_deref(),
            Some("http://127.0.0.1:5000/v2/a/blobs/c")
        );
        assert_eq!(
            resolve_location(base, "//other:1/p").as_deref(),
            Some("http://other:1/p")
        );
        assert_eq!(resolve_location(base, "file:///etc/shadow"), None);
        assert_eq!(resolve_location(base, "http://u:p@evil/x"), None);
        assert_eq!(
            query_escape("repository:a/b:pull"),
            "repository%3Aa%2Fb%3Apull"
        );
    }

    /// A one-request HTTP server on loopback: answers `answer` and returns the request it
    /// got.
    fn serve_once(answer: String) -> (u16, std::thread::JoinHandle<String>) {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let handle = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                request.push_str(&line);
            }
            stream.write_all(answer.as_bytes()).unwrap();
            request
        });
        (port, handle)
    }

    #[test]
    fn a_redirect_to_another_port_does_not_get_the_authorization_header() {
        let (storage_port, storage) = serve_once(
            "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".into(),
        );
        let (registry_port, registry) = serve_once(format!(
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{storage_port}/blob\r\n\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        ));
        let client = RegistryClient::new(ImageOptions::default());
        let resp = client
            .fetch(
                &format!("http://127.0.0.1:{registry_port}/v2/a/blobs/x"),
                None,
                Some("Bearer secret-token"),
            )
            .unwrap_or_else(|_| panic!("fetch failed"));
        assert_eq!(resp.into_string().unwrap(), "ok");
        let first = registry.join().unwrap();
        assert!(first.contains("Bearer secret-token"), "{first}");
        let second = storage.join().unwrap();
        assert!(
            !second.to_ascii_lowercase().contains("authorization"),
            "the token went to another port: {second}"
        );
    }

    #[test]
    fn challenges_parse_with_quoted_commas() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/ubuntu:pull,push""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "bearer");
        assert_eq!(c.params["realm"], "https://auth.docker.io/token");
        assert_eq!(c.params["service"], "registry.docker.io");
        assert_eq!(c.params["scope"], "repository:library/ubuntu:pull,push");
        let b = parse_challenge(r#"Basic realm="Registry Realm""#).unwrap();
        assert_eq!(b.scheme, "basic");
        assert_eq!(b.params["realm"], "Registry Realm");
        let bare = parse_challenge("Bearer realm=http://x/token, service=svc").unwrap();
        assert_eq!(bare.params["realm"], "http://x/token");
        assert_eq!(bare.params["service"], "svc");
    }

    #[test]
    fn schemes_and_hosts() {
        assert_eq!(scheme_for("127.0.0.1:5000", &[]), "http");
        assert_eq!(scheme_for("localhost:5000", &[]), "http");
        assert_eq!(scheme_for("[::1]:5000", &[]), "http");
        assert_eq!(scheme_for("registry.example:5000", &[]), "https");
        assert_eq!(
            scheme_for("registry.example:5000", &["registry.example:5000".into()]),
            "http"
        );
        assert_eq!(scheme_for("10.0.0.1:5000", &[]), "https");
        assert_eq!(api_host("docker.io"), "registry-1.docker.io");
        assert_eq!(api_host("ghcr.io"), "ghcr.io");
    }

    #[test]
    fn base64_round_trips_and_docker_config_auths_are_read() {
        for s in ["", "a", "ab", "abc", "user:p@ss:word", "ünïcode"] {
            assert_eq!(
                base64_decode(&base64_encode(s.as_bytes())).unwrap(),
                s.as_bytes()
            );
        }
        assert_eq!(base64_encode(b"user:pass"), "dXNlcjpwYXNz");
        assert!(base64_decode("not base64!").is_none());
        let config = r#"{"auths":{
            "https://index.docker.io/v1/":{"auth":"aHViOnNlY3JldA=="},
            "registry.example:5000":{"auth":"dXNlcjpwYXNz"},
            "http://other.example/v2/":{"username":"u","password":"p"}}}"#;
        assert_eq!(
            docker_config_credentials(config, "docker.io"),
            Some(("hub".into(), "secret".into()))
        );
        assert_eq!(
            docker_config_credentials(config, "registry.example:5000"),
            Some(("user".into(), "pass".into()))
        );
        assert_eq!(
            docker_config_credentials(config, "other.example"),
            Some(("u".into(), "p".into()))
        );
        assert_eq!(docker_config_credentials(config, "ghcr.io"), None);
    }

    #[test]
    fn manifest_media_types_are_negotiated_or_probed() {
        assert_eq!(
            manifest_media_type("application/vnd.oci.image.index.v1+json", b"{}").unwrap(),
            OCI_INDEX
        );
        assert_eq!(
            manifest_media_type("application/json", br#"{"schemaVersion":2,"manifests":[]}"#)
                .unwrap(),
            OCI_INDEX
        );
        let err = manifest_media_type(
            "application/vnd.docker.distribution.manifest.v1+prettyjws",
            br#"{"schemaVersion":1}"#,
        )
        .unwrap_err();
        assert!(matches!(err, ImageError::Unsupported(_)), "{err}");
    }

    #[test]
    fn registry_answers_are_quoted() {
        assert_eq!(
            registry_answer(
                404,
                r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#
            ),
            "HTTP 404 MANIFEST_UNKNOWN: manifest unknown"
        );
        assert_eq!(registry_answer(502, ""), "HTTP 502");
    }
}
