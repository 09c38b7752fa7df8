//! The REST client under the CLI: where the server and its key are, one blocking ureq call
//! per request, and API errors turned into exit codes.

use crate::config::{self, Config};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Why a CLI command failed; each kind has its own exit code (docs/cli.md §3).
#[derive(Debug)]
pub enum CliError {
    /// Bad arguments.
    Usage(String),
    /// The server did not answer (connection refused, DNS, timeout).
    Unreachable(String),
    /// The server answered with an error status.
    Api { status: u16, message: String },
    /// No API key could be found.
    NoKey(String),
    /// A local file could not be read or written.
    Local(String),
    /// An accepted operation ended badly (a template build in `error`).
    Failed(String),
    /// A Dockerfile the CLI cannot turn into a build (the message names the line).
    Dockerfile(String),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Local(_) => 1,
            CliError::Usage(_) | CliError::Dockerfile(_) => 2,
            CliError::Unreachable(_) => 3,
            CliError::Api { status: 404, .. } => 4,
            CliError::Api { status: 409, .. } => 5,
            CliError::Api {
                status: 401 | 403, ..
            }
            | CliError::NoKey(_) => 6,
            CliError::Api {
                status: 400..=499, ..
            } => 7,
            CliError::Api { .. } | CliError::Failed(_) => 8,
        }
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Usage(m)
            | CliError::Local(m)
            | CliError::NoKey(m)
            | CliError::Failed(m)
            | CliError::Dockerfile(m) => f.write_str(m),
            CliError::Unreachable(m) => write!(f, "cannot reach the server: {m}"),
            CliError::Api { status, message } => write!(f, "{message} (HTTP {status})"),
        }
    }
}

/// Where to find the server, from flags, then the environment, then the local config.
pub struct Target {
    pub url: Option<String>,
    pub api_key: Option<String>,
    pub config: Option<std::path::PathBuf>,
}

/// The installed config, read when neither a flag nor `AENV_CONFIG_PATH` names one.
const INSTALLED_CONFIG: &str = "/etc/agentenv/config.toml";

/// A connection to one agentenv server.
#[derive(Clone)]
pub struct Client {
    base: String,
    key: Result<String, String>,
    agent: ureq::Agent,
}

impl Client {
    /// Resolves URL and key (docs/cli.md §1): `--url`/`--api-key`, then `AENV_URL` /
    /// `AENV_API_KEY`, then the local server's config and its `<state_dir>/api-key`.
    pub fn new(target: Target) -> Client {
        let local = local_config(target.config.as_deref());
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let base = target
            .url
            .or_else(|| env("AENV_URL"))
            .or_else(|| {
                local
                    .as_ref()
                    .ok()
                    .map(|c| url_for_listen(&c.server.listen))
            })
            .unwrap_or_else(|| "http://127.0.0.1:8000".into());
        let key = match target.api_key.or_else(|| env("AENV_API_KEY")) {
            Some(k) => Ok(k),
            None => key_from_config(&local),
        };
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            // Creates may pull an image and template builds boot a VM: be patient.
            .timeout_read(Duration::from_secs(900))
            .timeout_write(Duration::from_secs(300))
            .build();
        Client {
            base: base.trim_end_matches('/').to_string(),
            key,
            agent,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// A request with the key set; fails when no key was found.
    pub fn request(&self, method: &str, path: &str) -> Result<ureq::Request, CliError> {
        let key = self.key.clone().map_err(CliError::NoKey)?;
        Ok(self
            .agent
            .request(method, &format!("{}{path}", self.base))
            .set("X-API-Key", &key))
    }

    /// Sends the request (with a JSON body, if any) and returns the response of a 2xx.
    pub fn send(
        &self,
        req: ureq::Request,
        body: Option<&Value>,
    ) -> Result<ureq::Response, CliError> {
        let result = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match result {
            Ok(resp) => Ok(resp),
            Err(ureq::Error::Status(status, resp)) => Err(api_error(status, resp)),
            Err(ureq::Error::Transport(t)) => Err(CliError::Unreachable(t.to_string())),
        }
    }

    /// A JSON call: the parsed body (`null` for an empty one) and the `X-Next-Token`.
    pub fn json(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(Value, Option<String>), CliError> {
        let resp = self.send(self.request(method, path)?, body)?;
        let next = resp.header("X-Next-Token").map(str::to_string);
        let text = resp
            .into_string()
            .map_err(|e| CliError::Unreachable(format!("reading the response: {e}")))?;
        if text.trim().is_empty() {
            return Ok((Value::Null, next));
        }
        let value = serde_json::from_str(&text).map_err(|e| CliError::Api {
            status: 502,
            message: format!("the server's answer is not JSON: {e}"),
        })?;
        Ok((value, next))
    }

    /// Every page of a list endpoint (`limit`/`nextToken`, api.md §4.5).
    pub fn list_all(&self, path: &str, query: &[(&str, String)]) -> Result<Vec<Value>, CliError> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q: Vec<(&str, String)> = query.to_vec();
            q.push(("limit", "100".into()));
            if let Some(t) = &token {
                q.push(("nextToken", t.clone()));
            }
            let (page, next) = self.json("GET", &format!("{path}?{}", encode_query(&q)), None)?;
            if let Value::Array(items) = page {
                all.extend(items);
            }
            match next {
                Some(t) if !t.is_empty() => token = Some(t),
                _ => return Ok(all),
            }
        }
    }
}

/// An error answer as a [`CliError`], with the message of its JSON body.
pub fn api_error(status: u16, resp: ureq::Response) -> CliError {
    let text = resp.into_string().unwrap_or_default();
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| text.trim().chars().take(500).collect());
    CliError::Api { status, message }
}

fn local_config(path: Option<&Path>) -> Result<Config, String> {
    let path = config::config_path(path).or_else(|| {
        Path::new(INSTALLED_CONFIG)
            .is_file()
            .then(|| INSTALLED_CONFIG.into())
    });
    Config::load(path.as_deref()).map_err(|e| e.to_string())
}

fn key_from_config(local: &Result<Config, String>) -> Result<String, String> {
    let config = local
        .as_ref()
        .map_err(|e| format!("no API key: pass --api-key or set AENV_API_KEY ({e})"))?;
    if let Some(k) = &config.server.api_key {
        return Ok(k.clone());
    }
    let path = crate::store::layout::StateLayout::new(&config.server.state_dir).api_key();
    std::fs::read_to_string(&path)
        .map(|k| k.trim().to_string())
        .map_err(|e| {
            format!(
                "no API key: pass --api-key, set AENV_API_KEY, or make {} readable \
                 (it is root's, mode 0600: sudo): {e}",
                path.display()
            )
        })
}

/// The URL a local client uses for a `listen` address: wildcard addresses become loopback.
fn url_for_listen(listen: &str) -> String {
    let host_port = match listen.rsplit_once(':') {
        Some(("0.0.0.0", port)) => format!("127.0.0.1:{port}"),
        Some(("[::]", port)) => format!("[::1]:{port}"),
        _ => listen.to_string(),
    };
    format!("http://{host_port}")
}

/// `k=v&k2=v2` with each part percent-encoded (RFC 3986 unreserved characters kept).
pub fn encode_query(pairs: &[(&str, String)]) -> String {
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", encode(k), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

pub fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_listen_addresses_become_loopback() {
        assert_eq!(url_for_listen("0.0.0.0:8000"), "http://127.0.0.1:8000");
        assert_eq!(url_for_listen("[::]:9"), "http://[::1]:9");
        assert_eq!(url_for_listen("10.1.2.3:80"), "http://10.1.2.3:80");
    }

    #[test]
    fn query_parts_are_percent_encoded() {
        assert_eq!(
            encode_query(&[("path", "/tmp/a b&c".into()), ("k", "x=y".into())]),
            "path=/tmp/a%20b%26c&k=x%3Dy"
        );
    }

    #[test]
    fn exit_codes_say_what_failed() {
        let api = |status| CliError::Api {
            status,
            message: String::new(),
        };
        assert_eq!(api(404).exit_code(), 4);
        assert_eq!(api(409).exit_code(), 5);
        assert_eq!(api(401).exit_code(), 6);
        assert_eq!(api(422).exit_code(), 7);
        assert_eq!(api(502).exit_code(), 8);
        assert_eq!(CliError::Unreachable(String::new()).exit_code(), 3);
        assert_eq!(CliError::Usage(String::new()).exit_code(), 2);
    }
}
