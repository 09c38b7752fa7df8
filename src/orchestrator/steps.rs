//! The steps of an E2B template build (`POST /v2/templates/{id}/builds/{buildID}`), as the
//! pinned SDKs send them: `{type, args, force, filesHash}` for RUN, COPY, ENV, WORKDIR and
//! USER (the SDK's helpers — apt_install, pip_install, make_symlink, remove, ... — compile
//! to RUN). Parsed and checked here, before anything is queued, so a malformed list is a
//! 400 naming the step and the field. [`StepState`] is what the steps so far leave for
//! the next one: its user, working directory and build env.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// Most steps a build may have.
pub const MAX_STEPS: usize = 256;
/// Longest argument of a step (a RUN script, a path, an env value).
const MAX_ARG_BYTES: usize = 64 * 1024;

/// One build step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub kind: StepKind,
    /// Run even when a cached result exists (`force`, the SDK's `skip_cache()`).
    #[serde(default)]
    pub force: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "type")]
pub enum StepKind {
    /// A shell script, as `user` (else the current user).
    Run {
        cmd: String,
        user: Option<String>,
    },
    /// Files uploaded under `files_hash` (a tar of `src` relative to the context) placed
    /// at `dest`, owned by `user` (`user[:group]`) with `mode` (octal) when given.
    Copy {
        src: String,
        dest: String,
        user: Option<String>,
        mode: Option<u32>,
        files_hash: String,
    },
    Env {
        vars: Vec<(String, String)>,
    },
    Workdir {
        dir: String,
    },
    User {
        user: String,
    },
}

impl StepKind {
    /// The step as the logs and failure reasons show it (`RUN echo hi`).
    pub fn describe(&self) -> String {
        match self {
            StepKind::Run { cmd, user } => match user {
                Some(u) => format!("RUN {cmd} (as {u})"),
                None => format!("RUN {cmd}"),
            },
            StepKind::Copy { src, dest, .. } => format!("COPY {src} {dest}"),
            StepKind::Env { vars } => {
                let pairs: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!("ENV {}", pairs.join(" "))
            }
            StepKind::Workdir { dir } => format!("WORKDIR {dir}"),
            StepKind::User { user } => format!("USER {user}"),
        }
    }
}

/// Where a build starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum BuildBase {
    /// An image reference, as `POST /templates` takes it.
    Image(String),
    /// Another template (id or alias), its start command not inherited.
    Template(String),
}

/// A whole build request (`TemplateBuildStartV2`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildSpec {
    pub base: BuildBase,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
    /// Rebuild every step (`force`, the SDK's `skip_cache=True`).
    pub force: bool,
}

/// What the steps so far leave for the next: E2B's defaults are user `user` in its home.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepState {
    pub user: Option<String>,
    pub workdir: Option<String>,
    /// ENV steps' variables, in order (later wins); build-only, never a sandbox's.
    pub env: BTreeMap<String, String>,
}

/// E2B's default account for steps and sandboxes.
pub const DEFAULT_USER: &str = "user";

impl StepState {
    pub fn user(&self) -> &str {
        self.user.as_deref().unwrap_or(DEFAULT_USER)
    }

    /// Takes in what a step changes (ENV, WORKDIR, USER); RUN and COPY change nothing here.
    /// An ENV value's `$NAME`/`${NAME}` are the values before the step (earlier ENV steps,
    /// else `image_env`), as `PATH=/opt/bin:$PATH` means; names neither has stay as
    /// written, so a `$` in a secret is kept.
    pub fn apply(&mut self, step: &StepKind, image_env: &BTreeMap<String, String>) {
        match step {
            StepKind::Env { vars } => {
                let lookup = |n: &str| self.env.get(n).or_else(|| image_env.get(n)).cloned();
                let expanded: Vec<(String, String)> = vars
                    .iter()
                    .map(|(k, v)| (k.clone(), expand_env(v, &lookup)))
                    .collect();
                self.env.extend(expanded);
            }
            StepKind::Workdir { dir } => self.workdir = Some(self.resolve(dir)),
            StepKind::User { user } => self.user = Some(user.clone()),
            StepKind::Run { .. } | StepKind::Copy { .. } => {}
        }
    }

    /// `path` against the working directory; relative (to the user's home) when unset.
    pub fn resolve(&self, path: &str) -> String {
        if path.starts_with('/') {
            return path.to_string();
        }
        match &self.workdir {
            Some(w) => format!("{}/{path}", w.trim_end_matches('/')),
            None => path.to_string(),
        }
    }
}

/// `$NAME` and `${NAME}` in `value` replaced by `lookup`'s value; a name it does not know
/// (and any other `$`) is left as written.
pub fn expand_env(value: &str, lookup: &dyn Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, braced) = match after.strip_prefix('{') {
            Some(inner) => (
                inner.split('}').next().filter(|_| inner.contains('}')),
                true,
            ),
            None => (Some(after), false),
        };
        let name = name.map(|n| {
            let len = n
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(n.len());
            &n[..len]
        });
        // `${NAME}` must close right after the name; `$NAME` ends at the first non-name byte.
        let whole =
            name.filter(|n| !n.is_empty() && (!braced || after[1 + n.len()..].starts_with('}')));
        match whole.and_then(|n| lookup(n).map(|v| (n, v))) {
            Some((n, v)) => {
                out.push_str(&v);
                rest = &after[n.len() + if braced { 2 } else { 0 }..];
            }
            None => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Parses `TemplateBuildStartV2`; the error names the step and field.
pub fn parse_spec(body: &Value) -> Result<BuildSpec, String> {
    let obj = body.as_object().ok_or("the body must be a JSON object")?;
    let text = |field: &str| -> Result<Option<String>, String> {
        match obj.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.len() <= MAX_ARG_BYTES => Ok(Some(s.clone())),
            Some(Value::String(_)) => Err(format!("{field} is longer than {MAX_ARG_BYTES} bytes")),
            Some(_) => Err(format!("{field} must be a string")),
        }
    };
    let base = match (text("fromImage")?, text("fromTemplate")?) {
        (Some(_), Some(_)) => return Err("give fromImage or fromTemplate, not both".into()),
        (Some(i), None) if !i.trim().is_empty() => BuildBase::Image(i.trim().to_string()),
        (None, Some(t)) if !t.trim().is_empty() => BuildBase::Template(t.trim().to_string()),
        _ => return Err("fromImage or fromTemplate is required".into()),
    };
    if obj.get("fromImageRegistry").is_some_and(|v| !v.is_null()) {
        return Err("fromImageRegistry is not supported: name a registry the server can pull from (docs/e2b.md)".into());
    }
    let force = match obj.get("force") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("force must be a boolean".into()),
    };
    let steps = match obj.get("steps") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) if list.len() <= MAX_STEPS => list
            .iter()
            .enumerate()
            .map(|(i, s)| parse_step(s).map_err(|e| format!("steps[{i}]: {e}")))
            .collect::<Result<_, _>>()?,
        Some(Value::Array(_)) => return Err(format!("steps: at most {MAX_STEPS} steps")),
        Some(_) => return Err("steps must be an array".into()),
    };
    Ok(BuildSpec {
        base,
        steps,
        start_cmd: text("startCmd")?.filter(|c| !c.trim().is_empty()),
        ready_cmd: text("readyCmd")?.filter(|c| !c.trim().is_empty()),
        force,
    })
}

fn parse_step(v: &Value) -> Result<Step, String> {
    let obj = v.as_object().ok_or("must be an object")?;
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .ok_or("type is required (RUN, COPY, ENV, WORKDIR or USER)")?;
    let args: Vec<String> = match obj.get("args") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, x)| match x {
                Value::String(s) if s.len() <= MAX_ARG_BYTES => Ok(s.clone()),
                Value::String(_) => Err(format!("args[{i}] is longer than {MAX_ARG_BYTES} bytes")),
                _ => Err(format!("args[{i}] must be a string")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("args must be an array of strings".into()),
    };
    let force = match obj.get("force") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("force must be a boolean".into()),
    };
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or("");
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let kind = match kind.to_ascii_uppercase().as_str() {
        "RUN" if arg(0).trim().is_empty() => return Err("args[0] (the command) is empty".into()),
        "RUN" if args.len() > 2 => return Err("args: RUN takes [command, user?]".into()),
        "RUN" => StepKind::Run {
            cmd: arg(0).to_string(),
            user: some(arg(1)),
        },
        "COPY" => parse_copy(obj, &args)?,
        "ENV" if args.is_empty() || !args.len().is_multiple_of(2) => {
            return Err("args: ENV takes pairs [name, value, ...]".into())
        }
        "ENV" => {
            let vars: Vec<(String, String)> = args
                .chunks(2)
                .map(|p| (p[0].clone(), p[1].clone()))
                .collect();
            if let Some((k, _)) = vars.iter().find(|(k, _)| !valid_env_name(k)) {
                return Err(format!("args: {k:?} is not an environment variable name"));
            }
            StepKind::Env { vars }
        }
        "WORKDIR" if args.len() != 1 || arg(0).trim().is_empty() => {
            return Err("args: WORKDIR takes [directory]".into())
        }
        "WORKDIR" => StepKind::Workdir {
            dir: arg(0).to_string(),
        },
        "USER" if args.len() != 1 || !valid_user(arg(0)) => {
            return Err("args: USER takes [name] (letters, digits, _ . -)".into())
        }
        "USER" => StepKind::User {
            user: arg(0).to_string(),
        },
        other => {
            return Err(format!(
                "type {other:?} is not RUN, COPY, ENV, WORKDIR or USER"
            ))
        }
    };
    if let StepKind::Run {
        user: Some(user), ..
    } = &kind
    {
        if !valid_user(user) {
            return Err(format!("args[1]: {user:?} is not a user name"));
        }
    }
    Ok(Step { kind, force })
}

fn parse_copy(obj: &serde_json::Map<String, Value>, args: &[String]) -> Result<StepKind, String> {
    if args.len() < 2 || args.len() > 4 {
        return Err("args: COPY takes [src, dest, user?, mode?]".into());
    }
    let files_hash = obj
        .get("filesHash")
        .and_then(Value::as_str)
        .ok_or("filesHash is required for COPY (the hash the files were uploaded under)")?;
    if !valid_hash(files_hash) {
        return Err("filesHash must be 64 lowercase hex digits".into());
    }
    let (src, dest) = (&args[0], &args[1]);
    if src.is_empty() || src.starts_with('/') || src.split('/').any(|c| c == "..") {
        return Err("args[0]: the source must be a relative path inside the context".into());
    }
    if dest.trim().is_empty() {
        return Err("args[1]: the destination is empty".into());
    }
    let user = args.get(2).filter(|u| !u.is_empty()).cloned();
    if let Some(u) = &user {
        if !u.split(':').all(valid_user) || u.split(':').count() > 2 {
            return Err(format!("args[2]: {u:?} is not user or user:group"));
        }
    }
    let mode = match args.get(3).filter(|m| !m.is_empty()) {
        None => None,
        Some(m) => Some(
            u32::from_str_radix(m, 8)
                .ok()
                .filter(|m| *m <= 0o7777)
                .ok_or_else(|| format!("args[3]: {m:?} is not an octal mode"))?,
        ),
    };
    Ok(StepKind::Copy {
        src: src.clone(),
        dest: dest.clone(),
        user,
        mode,
        files_hash: files_hash.to_string(),
    })
}

/// A files hash as the SDKs compute it: lowercase hex SHA-256.
pub fn valid_hash(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A POSIX-ish account name (or a numeric id).
fn valid_user(u: &str) -> bool {
    (1..=32).contains(&u.len())
        && !u.starts_with('-')
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(steps: Value) -> Result<BuildSpec, String> {
        parse_spec(&json!({"fromImage": "debian:12", "steps": steps, "force": false}))
    }

    #[test]
    fn the_sdk_step_list_parses() {
        let hash = "a".repeat(64);
        let s = spec(json!([
            {"type": "ENV", "args": ["A", "1", "B", "two words"], "force": false},
            {"type": "WORKDIR", "args": ["/app"], "force": false},
            {"type": "COPY", "args": ["src", "/app/", "user", "0755"], "force": false, "filesHash": hash},
            {"type": "RUN", "args": ["echo hi && id", "root"], "force": true},
            {"type": "USER", "args": ["user"], "force": false},
        ]))
        .unwrap();
        assert_eq!(s.base, BuildBase::Image("debian:12".into()));
        assert_eq!(s.steps.len(), 5);
        assert!(s.steps[3].force);
        assert_eq!(
            s.steps[2].kind,
            StepKind::Copy {
                src: "src".into(),
                dest: "/app/".into(),
                user: Some("user".into()),
                mode: Some(0o755),
                files_hash: hash
            }
        );
        assert_eq!(s.steps[3].kind.describe(), "RUN echo hi && id (as root)");
    }

    #[test]
    fn bad_steps_name_the_step_and_field() {
        for (steps, want) in [
            (json!([{"type": "RUN", "args": []}]), "steps[0]: args[0]"),
            (
                json!([{"type": "ENV", "args": ["A"]}]),
                "steps[0]: args: ENV",
            ),
            (
                json!([{"type": "ENV", "args": ["1A", "x"]}]),
                "steps[0]: args:",
            ),
            (
                json!([{"type": "RUN", "args": ["x"]}, {"type": "NOPE"}]),
                "steps[1]: type",
            ),
            (
                json!([{"type": "COPY", "args": ["a", "/b"]}]),
                "steps[0]: filesHash",
            ),
            (
                json!([{"type": "COPY", "args": ["../a", "/b"], "filesHash": "a".repeat(64)}]),
                "steps[0]: args[0]",
            ),
            (
                json!([{"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": "a".repeat(64)}]),
                "steps[0]: args[3]",
            ),
            (
                json!([{"type": "USER", "args": ["a b"]}]),
                "steps[0]: args: USER",
            ),
            (
                json!([{"type": "RUN", "args": [1]}]),
                "steps[0]: args[0] must be",
            ),
            (json!("x"), "steps must be"),
        ] {
            let e = spec(steps.clone()).unwrap_err();
            assert!(e.starts_with(want), "{steps}: {e}");
        }
        assert!(parse_spec(&json!({"steps": []}))
            .unwrap_err()
            .contains("fromImage"));
    }

    #[test]
    fn state_follows_env_workdir_and_user() {
        let mut st = StepState::default();
        assert_eq!(st.user(), "user");
        assert_eq!(st.resolve("x"), "x");
        let image: BTreeMap<String, String> = [("PATH".to_string(), "/bin".to_string())].into();
        st.apply(&StepKind::Workdir { dir: "/app".into() }, &image);
        st.apply(&StepKind::Workdir { dir: "sub".into() }, &image);
        st.apply(
            &StepKind::User {
                user: "root".into(),
            },
            &image,
        );
        st.apply(
            &StepKind::Env {
                vars: vec![("A".into(), "1".into()), ("A".into(), "2".into())],
            },
            &image,
        );
        assert_eq!(st.workdir.as_deref(), Some("/app/sub"));
        assert_eq!(st.user(), "root");
        assert_eq!(st.env["A"], "2");
        // Values are expanded from before the step: earlier ENV, then the image's env.
        let env = StepKind::Env {
            vars: vec![
                ("PATH".into(), "/opt/bin:$PATH".into()),
                ("B".into(), "${A}x-$PATH-pa$word-$-${A".into()),
            ],
        };
        st.apply(&env, &image);
        assert_eq!(st.env["PATH"], "/opt/bin:/bin");
        assert_eq!(st.env["B"], "2x-/bin-pa$word-$-${A");
        st.apply(&env, &image);
        assert_eq!(st.env["PATH"], "/opt/bin:/opt/bin:/bin");
    }
}
