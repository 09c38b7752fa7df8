//! `agentenv template build --file Dockerfile`: a single-stage Dockerfile read into the
//! steps of an E2B v2 build (`POST /v2/templates/{id}/builds/{buildID}`), the request
//! the SDKs send, so the server has one build path. It follows the python SDK's own
//! `from_dockerfile` conversion: steps run as root in `/` until USER/WORKDIR say
//! otherwise, and the sandboxes default to E2B's `user` in `/home/user` unless the file
//! names its own; ARG and ENV become the build's env (build-only, never a sandbox's);
//! CMD/ENTRYPOINT become the start command. `$VAR`/`${VAR}` in FROM, COPY, ADD, ENV,
//! ARG, WORKDIR and USER are expanded here from the ARG and ENV values so far (in ENV and
//! ARG values a name the file did not set is left for the build, which expands it from
//! the image's env); RUN and the start command leave them to the guest's shell.

use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;

/// Longest Dockerfile taken (the server's own limit on a step is 64 KiB).
pub const MAX_DOCKERFILE_BYTES: usize = 1 << 20;

/// A Dockerfile the CLI cannot turn into a build, with the line it is about.
#[derive(Debug, PartialEq, Eq)]
pub struct DockerfileError {
    pub line: usize,
    pub message: String,
}

impl fmt::Display for DockerfileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "Dockerfile: {}", self.message)
        } else {
            write!(f, "Dockerfile line {}: {}", self.line, self.message)
        }
    }
}

/// One build step, as the v2 build request carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanStep {
    Run(String),
    /// `src` relative to the build context; `mode` octal.
    Copy {
        src: String,
        dest: String,
        chown: Option<String>,
        mode: Option<String>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// What a Dockerfile builds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub from: String,
    pub steps: Vec<PlanStep>,
    /// CMD/ENTRYPOINT combined by Docker's rules.
    pub start_cmd: Option<String>,
    /// Things taken but ignored (EXPOSE, RUN --mount, ...), each naming its line.
    pub warnings: Vec<String>,
}

/// The python SDK's ready command for a Dockerfile's CMD (`wait_for_timeout(20_000)`).
pub const DEFAULT_READY_CMD: &str = "sleep 20";

/// One instruction: its keyword (upper case), the text after it, its first line.
struct Instruction {
    keyword: String,
    rest: String,
    line: usize,
}

/// Joins `\`-continued lines and drops comments and blank lines.
fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (continued, body) = match raw.trim_end().strip_suffix('\\') {
            Some(b) => (true, b.trim_end()),
            None => (false, raw.trim_end()),
        };
        let entry = current.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body.trim_start());
        if !continued {
            out.push(finish(current.take().expect("set above")));
        }
    }
    out.extend(current.map(finish));
    out
}

fn finish((line, text): (usize, String)) -> Instruction {
    let text = text.trim();
    let (keyword, rest) = text.split_once(char::is_whitespace).unwrap_or((text, ""));
    Instruction {
        keyword: keyword.to_ascii_uppercase(),
        rest: rest.trim().to_string(),
        line,
    }
}

/// The exec (JSON array) form, when the text is one.
fn exec_form(rest: &str) -> Option<Vec<String>> {
    if !rest.starts_with('[') {
        return None;
    }
    serde_json::from_str::<Vec<String>>(rest).ok()
}

/// A word quoted for `/bin/sh` (left bare when that is safe).
pub fn shell_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./_-".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r#"'"'"'"#))
    }
}

fn shell_join(words: &[String]) -> String {
    words
        .iter()
        .map(|w| shell_quote(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Docker's word rules for an instruction's arguments: whitespace splits words outside
/// quotes, `'…'` is literal, `"…"` and bare text expand `$VAR`, `${VAR}`,
/// `${VAR:-default}` and `${VAR:+alt}` from `vars` (an expanded value is never split),
/// and `\` escapes the next character.
fn words(text: &str, vars: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    lex(text, vars, false)
}

/// [`words`] for ENV and ARG values: a `$NAME`/`${NAME}` the file did not set stays as
/// written, for the build to expand from the image's env (`PATH=/opt/bin:$PATH`).
fn env_words(text: &str, vars: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    lex(text, vars, true)
}

fn lex(
    text: &str,
    vars: &BTreeMap<String, String>,
    keep_unknown: bool,
) -> Result<Vec<String>, String> {
    let mut lexer = Lexer {
        chars: text.chars().collect(),
        pos: 0,
        vars,
        keep_unknown,
    };
    lexer.words()
}

struct Lexer<'a> {
    chars: Vec<char>,
    pos: usize,
    vars: &'a BTreeMap<String, String>,
    keep_unknown: bool,
}

impl Lexer<'_> {
    fn next(&mut self) -> Option<char> {
        let c = self.chars.get(self.pos).copied();
        self.pos += 1;
        c
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn words(&mut self) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        let mut word: Option<String> = None;
        while let Some(c) = self.next() {
            match c {
                c if c.is_whitespace() => out.extend(word.take()),
                '\'' => {
                    let w = word.get_or_insert_with(String::new);
                    loop {
                        match self.next() {
                            Some('\'') => break,
                            Some(c) => w.push(c),
                            None => return Err("unterminated ' quote".into()),
                        }
                    }
                }
                '"' => {
                    let mut w = word.take().unwrap_or_default();
                    self.quoted(&mut w)?;
                    word = Some(w);
                }
                '\\' => {
                    let escaped = self.next().unwrap_or('\\');
                    word.get_or_insert_with(String::new).push(escaped);
                }
                '$' => {
                    let value = self.variable()?;
                    word.get_or_insert_with(String::new).push_str(&value);
                }
                c => word.get_or_insert_with(String::new).push(c),
            }
        }
        out.extend(word);
        Ok(out)
    }

    fn quoted(&mut self, w: &mut String) -> Result<(), String> {
        loop {
            match self.next() {
                Some('"') => return Ok(()),
                Some('\\') if matches!(self.peek(), Some('"' | '\\' | '$')) => {
                    w.push(self.next().expect("peeked"));
                }
                Some('$') => w.push_str(&self.variable()?),
                Some(c) => w.push(c),
                None => return Err("unterminated \" quote".into()),
            }
        }
    }

    /// After a `$`: the variable's value (a lone `$` stays itself).
    fn variable(&mut self) -> Result<String, String> {
        let braced = self.peek() == Some('{');
        if braced {
            self.pos += 1;
        }
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            self.pos += 1;
        }
        let name: String = self.chars[start..self.pos].iter().collect();
        let unknown = !self.vars.contains_key(&name) && self.keep_unknown;
        if !braced {
            return Ok(match name.is_empty() {
                true => "$".into(),
                false if unknown => format!("${name}"),
                false => self.vars.get(&name).cloned().unwrap_or_default(),
            });
        }
        if name.is_empty() {
            return Err("bad substitution: ${ needs a variable name".into());
        }
        let value = self.vars.get(&name).filter(|v| !v.is_empty()).cloned();
        match self.next() {
            Some('}') if unknown => Ok(format!("${{{name}}}")),
            Some('}') => Ok(value.unwrap_or_default()),
            Some(':') => {
                let op = self.next();
                let mut word = String::new();
                loop {
                    match self.next() {
                        Some('}') => break,
                        Some('$') => word.push_str(&self.variable()?),
                        Some(c) => word.push(c),
                        None => return Err(format!("missing }} after ${{{name}")),
                    }
                }
                match op {
                    Some('-') => Ok(value.unwrap_or(word)),
                    Some('+') => Ok(value.map(|_| word).unwrap_or_default()),
                    _ => Err(format!(
                        "unsupported modifier in ${{{name}:…}} (use :- or :+)"
                    )),
                }
            }
            _ => Err(format!("missing }} after ${{{name}")),
        }
    }
}

/// `--name=value` flags at the start of an instruction's words.
fn take_flags(words: &mut Vec<String>) -> Vec<(String, String)> {
    let n = words.iter().take_while(|w| w.starts_with("--")).count();
    words
        .drain(..n)
        .map(|w| {
            let body = &w[2..];
            match body.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (body.to_string(), String::new()),
            }
        })
        .collect()
}

/// The converter's state between instructions.
#[derive(Default)]
struct Converter {
    vars: BTreeMap<String, String>,
    build_args: BTreeMap<String, String>,
    used_args: Vec<String>,
    from: Option<String>,
    steps: Vec<PlanStep>,
    cmd: Option<StartWords>,
    entrypoint: Option<StartWords>,
    user_set: bool,
    workdir_set: bool,
    warnings: Vec<String>,
}

/// A CMD or ENTRYPOINT: exec form (words) or shell form (one script).
#[derive(Clone)]
enum StartWords {
    Exec(Vec<String>),
    Shell(String),
}

/// Reads a Dockerfile into a [`Plan`]; `build_args` are `--build-arg NAME=VALUE`.
pub fn parse(text: &str, build_args: &[(String, String)]) -> Result<Plan, DockerfileError> {
    if text.len() > MAX_DOCKERFILE_BYTES {
        return Err(DockerfileError {
            line: 0,
            message: format!("longer than {MAX_DOCKERFILE_BYTES} bytes"),
        });
    }
    let mut c = Converter {
        build_args: build_args.iter().cloned().collect(),
        ..Converter::default()
    };
    for ins in instructions(text) {
        c.instruction(&ins).map_err(|message| DockerfileError {
            line: ins.line,
            message: format!("{} {message}", ins.keyword),
        })?;
    }
    c.finish()
}

impl Converter {
    fn instruction(&mut self, ins: &Instruction) -> Result<(), String> {
        let rest = ins.rest.as_str();
        if self.from.is_none() && !matches!(ins.keyword.as_str(), "FROM" | "ARG") {
            return Err("comes before FROM (only ARG may)".into());
        }
        if matches!(ins.keyword.as_str(), "RUN" | "COPY" | "ADD") && has_heredoc(rest) {
            return Err("with a heredoc (<<EOF) is not supported: write the file in the build context and COPY it".into());
        }
        match ins.keyword.as_str() {
            "FROM" => self.base_image(rest),
            "RUN" => self.run(rest, ins.line),
            "COPY" | "ADD" => self.copy(&ins.keyword, rest, ins.line),
            "ENV" => self.env(rest),
            "ARG" => self.arg(rest),
            "WORKDIR" => {
                let dir = self.single(rest)?;
                self.workdir_set = true;
                self.steps.push(PlanStep::Workdir(dir));
                Ok(())
            }
            "USER" => {
                let user = self.single(rest)?;
                self.user_set = true;
                self.steps.push(PlanStep::User(user));
                Ok(())
            }
            "CMD" => {
                self.cmd = Some(start_words(rest)?);
                Ok(())
            }
            "ENTRYPOINT" => {
                self.entrypoint = Some(start_words(rest)?);
                Ok(())
            }
            "EXPOSE" | "VOLUME" | "LABEL" | "MAINTAINER" | "STOPSIGNAL" | "HEALTHCHECK" => {
                self.warnings.push(format!(
                    "line {}: {} has no meaning for a template; ignored",
                    ins.line, ins.keyword
                ));
                Ok(())
            }
            "" => Err("is empty".into()),
            _ => Err("is not an instruction agentenv knows (FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT; EXPOSE, VOLUME, LABEL, MAINTAINER, STOPSIGNAL, HEALTHCHECK are ignored)".into()),
        }
    }

    fn base_image(&mut self, rest: &str) -> Result<(), String> {
        if self.from.is_some() {
            return Err("a second time: multi-stage Dockerfiles are not supported".into());
        }
        let mut w = words(rest, &self.vars)?;
        for (flag, _) in take_flags(&mut w) {
            if flag != "platform" {
                return Err(format!("--{flag} is not a FROM flag agentenv knows"));
            }
        }
        let image = match w.as_slice() {
            [image] => image.clone(),
            [image, as_, _] if as_.eq_ignore_ascii_case("as") => image.clone(),
            _ => return Err("takes an image (and optionally AS name)".into()),
        };
        if image.is_empty() || image == "scratch" {
            return Err(format!("{image:?} is not an image agentenv can start from"));
        }
        self.from = Some(image);
        // ARGs before FROM are for FROM only (Docker); steps run as root in / by default.
        self.vars.clear();
        self.steps.push(PlanStep::User("root".into()));
        self.steps.push(PlanStep::Workdir("/".into()));
        Ok(())
    }

    fn run(&mut self, rest: &str, line: usize) -> Result<(), String> {
        let mut script = rest.to_string();
        while let Some(flag) = script.strip_prefix("--") {
            let (word, tail) = flag.split_once(char::is_whitespace).unwrap_or((flag, ""));
            let name = word.split('=').next().unwrap_or_default();
            if !matches!(name, "mount" | "network" | "security" | "device") {
                return Err(format!("--{name} is not a RUN flag agentenv knows"));
            }
            self.warnings.push(format!(
                "line {line}: RUN --{name} is not supported; ignored"
            ));
            script = tail.trim_start().to_string();
        }
        let cmd = match exec_form(&script) {
            Some(w) if w.is_empty() => return Err("needs a command".into()),
            Some(w) => shell_join(&w),
            None => script,
        };
        if cmd.trim().is_empty() {
            return Err("needs a command".into());
        }
        self.steps.push(PlanStep::Run(cmd));
        Ok(())
    }

    fn copy(&mut self, keyword: &str, rest: &str, line: usize) -> Result<(), String> {
        let mut w = words(rest, &self.vars)?;
        let mut chown = None;
        let mut mode = None;
        for (flag, value) in take_flags(&mut w) {
            match flag.as_str() {
                "chown" if !value.is_empty() => chown = Some(value),
                "chmod" if is_octal_mode(&value) => mode = Some(value),
                "chmod" => {
                    return Err(format!(
                        "--chmod={value:?} is not an octal mode such as 0755"
                    ))
                }
                "from" => return Err("--from is not supported (multi-stage builds are not)".into()),
                "link" | "exclude" | "parents" | "keep-git-dir" | "checksum" | "unpack" => {
                    self.warnings.push(format!(
                        "line {line}: {keyword} --{flag} is not supported; ignored"
                    ))
                }
                _ => return Err(format!("--{flag} is not a {keyword} flag agentenv knows")),
            }
        }
        // The exec form: ["src", ..., "dest"] (quotes already gone; brackets remain).
        if w.first().is_some_and(|f| f.starts_with('[')) {
            w = exec_form(&w.join(" ")).ok_or("[...] must be a JSON array of strings")?;
        }
        let Some((dest, sources)) = w.split_last().filter(|(_, s)| !s.is_empty()) else {
            return Err("takes one or more sources and a destination".into());
        };
        for src in sources {
            check_source(keyword, src)?;
            self.steps.push(PlanStep::Copy {
                src: src.trim_start_matches("./").to_string(),
                dest: dest.clone(),
                chown: chown.clone(),
                mode: mode.clone(),
            });
        }
        Ok(())
    }
}

fn has_heredoc(rest: &str) -> bool {
    rest.match_indices("<<").any(|(i, _)| {
        let after = rest[i + 2..].trim_start_matches('-');
        let after = after.trim_start_matches(['"', '\'']);
        after.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
    })
}

fn is_octal_mode(m: &str) -> bool {
    (3..=4).contains(&m.len()) && m.bytes().all(|b| (b'0'..=b'7').contains(&b))
}

/// A COPY/ADD source: a path inside the context (no URLs, no wildcards).
fn check_source(keyword: &str, src: &str) -> Result<(), String> {
    if src.contains("://") || src.starts_with("git@") {
        return Err(format!(
            "from a URL ({src}) is not supported: only files of the build context"
        ));
    }
    if src.starts_with('/') || src.split('/').any(|c| c == "..") {
        return Err(format!("source {src:?} is outside the build context"));
    }
    if src.contains(['*', '?', '[']) {
        return Err(format!(
            "source {src:?}: wildcards are not supported; name files or directories"
        ));
    }
    if src.is_empty() {
        return Err(format!("{keyword} source is empty"));
    }
    Ok(())
}

fn start_words(rest: &str) -> Result<StartWords, String> {
    match exec_form(rest) {
        Some(w) => Ok(StartWords::Exec(w)),
        None if rest.trim().is_empty() => Err("needs a command".into()),
        None => Ok(StartWords::Shell(rest.to_string())),
    }
}

impl Converter {
    fn env(&mut self, rest: &str) -> Result<(), String> {
        let w = env_words(rest, &self.vars)?;
        let pairs: Vec<(String, String)> = match w.first() {
            None => return Err("needs NAME=VALUE".into()),
            Some(first) if first.contains('=') => w
                .iter()
                .map(|p| {
                    p.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or_else(|| format!("{p:?} is not NAME=VALUE"))
                })
                .collect::<Result<_, _>>()?,
            // The old form: `ENV NAME the rest of the line`.
            Some(name) => vec![(name.clone(), w[1..].join(" "))],
        };
        for (k, v) in &pairs {
            if !valid_env_name(k) {
                return Err(format!("{k:?} is not an environment variable name"));
            }
            self.vars.insert(k.clone(), v.clone());
        }
        self.steps.push(PlanStep::Env(pairs));
        Ok(())
    }

    /// `ARG NAME[=default]…`: the `--build-arg` value, else the default; set ones are
    /// the build's env from here on (as Docker gives them to RUN).
    fn arg(&mut self, rest: &str) -> Result<(), String> {
        let w = env_words(rest, &self.vars)?;
        if w.is_empty() {
            return Err("needs a NAME".into());
        }
        let mut pairs = Vec::new();
        for a in w {
            let (name, default) = match a.split_once('=') {
                Some((n, d)) => (n.to_string(), Some(d.to_string())),
                None => (a, None),
            };
            if !valid_env_name(&name) {
                return Err(format!("{name:?} is not an argument name"));
            }
            self.used_args.push(name.clone());
            if let Some(v) = self.build_args.get(&name).cloned().or(default) {
                self.vars.insert(name.clone(), v.clone());
                pairs.push((name, v));
            }
        }
        if self.from.is_some() && !pairs.is_empty() {
            self.steps.push(PlanStep::Env(pairs));
        }
        Ok(())
    }

    fn single(&self, rest: &str) -> Result<String, String> {
        match words(rest, &self.vars)?.as_slice() {
            [one] if !one.is_empty() => Ok(one.clone()),
            _ => Err("takes exactly one argument".into()),
        }
    }

    /// The start command by Docker's rules: an exec-form ENTRYPOINT gets CMD appended (a
    /// shell-form CMD as `/bin/sh -c`), a shell-form ENTRYPOINT ignores CMD.
    fn start_cmd(&self) -> Option<String> {
        let cmd = match (&self.entrypoint, &self.cmd) {
            (Some(StartWords::Shell(s)), _) | (None, Some(StartWords::Shell(s))) => s.clone(),
            (Some(StartWords::Exec(e)), cmd) => {
                let mut w = e.clone();
                match cmd {
                    Some(StartWords::Exec(c)) => w.extend(c.iter().cloned()),
                    Some(StartWords::Shell(s)) => {
                        w.extend(["/bin/sh".into(), "-c".into(), s.clone()])
                    }
                    None => {}
                }
                shell_join(&w)
            }
            (None, Some(StartWords::Exec(c))) => shell_join(c),
            (None, None) => return None,
        };
        Some(cmd).filter(|c| !c.trim().is_empty())
    }

    fn finish(mut self) -> Result<Plan, DockerfileError> {
        let from = self.from.clone().ok_or(DockerfileError {
            line: 0,
            message: "has no FROM instruction".into(),
        })?;
        let start_cmd = self.start_cmd();
        // E2B's defaults for the sandboxes, unless the file chose its own.
        if !self.user_set {
            self.steps.push(PlanStep::User("user".into()));
        }
        if !self.workdir_set {
            self.steps.push(PlanStep::Workdir("/home/user".into()));
        }
        for name in self.build_args.keys() {
            if !self.used_args.contains(name) {
                self.warnings.push(format!(
                    "--build-arg {name} is not an ARG of the Dockerfile; unused"
                ));
            }
        }
        Ok(Plan {
            from,
            steps: self.steps,
            start_cmd,
            warnings: self.warnings,
        })
    }
}

fn valid_env_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// The v2 build request for `plan`: `files_hash(i)` gives the uploaded files' hash of
/// the plan's step `i` (a COPY).
pub fn build_request(
    plan: &Plan,
    start_cmd: Option<&str>,
    ready_cmd: Option<&str>,
    files_hash: impl Fn(usize) -> String,
) -> Value {
    let steps: Vec<Value> = plan
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| match s {
            PlanStep::Run(cmd) => serde_json::json!({"type": "RUN", "args": [cmd], "force": false}),
            PlanStep::Copy { src, dest, chown, mode } => serde_json::json!({
                "type": "COPY",
                "args": [src, dest, chown.clone().unwrap_or_default(), mode.clone().unwrap_or_default()],
                "force": false,
                "filesHash": files_hash(i),
            }),
            PlanStep::Env(pairs) => {
                let args: Vec<&str> = pairs.iter().flat_map(|(k, v)| [k.as_str(), v.as_str()]).collect();
                serde_json::json!({"type": "ENV", "args": args, "force": false})
            }
            PlanStep::Workdir(d) => serde_json::json!({"type": "WORKDIR", "args": [d], "force": false}),
            PlanStep::User(u) => serde_json::json!({"type": "USER", "args": [u], "force": false}),
        })
        .collect();
    let mut body = serde_json::json!({"fromImage": plan.from, "steps": steps, "force": false});
    if let Some(start) = start_cmd {
        body["startCmd"] = start.into();
        body["readyCmd"] = ready_cmd.unwrap_or(DEFAULT_READY_CMD).into();
    } else if let Some(ready) = ready_cmd {
        body["readyCmd"] = ready.into();
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(text: &str) -> Plan {
        parse(text, &[]).unwrap()
    }

    fn error(text: &str) -> DockerfileError {
        parse(text, &[]).unwrap_err()
    }

    #[test]
    fn instructions_become_the_sdk_steps() {
        let p = plan(
            "# a comment\nARG BASE=debian:12\nFROM ${BASE} AS app\nARG VERSION=1\n\
             ENV GREETING=\"hi there\" LEVEL=$VERSION\nRUN apt-get update && \\\n    \
             apt-get install -y jq\nRUN [\"echo\", \"it's\"]\nWORKDIR /srv/$GREETING\n\
             COPY --chown=user:user --chmod=0750 app ./tool.sh /srv/\nADD data /data\n\
             USER user\nEXPOSE 8080\nCMD python3 -m http.server 8080\n",
        );
        assert_eq!(p.from, "debian:12");
        assert_eq!(
            p.steps,
            vec![
                PlanStep::User("root".into()),
                PlanStep::Workdir("/".into()),
                PlanStep::Env(vec![("VERSION".into(), "1".into())]),
                PlanStep::Env(vec![
                    ("GREETING".into(), "hi there".into()),
                    ("LEVEL".into(), "1".into())
                ]),
                PlanStep::Run("apt-get update && apt-get install -y jq".into()),
                PlanStep::Run("echo 'it'\"'\"'s'".into()),
                PlanStep::Workdir("/srv/hi there".into()),
                PlanStep::Copy {
                    src: "app".into(),
                    dest: "/srv/".into(),
                    chown: Some("user:user".into()),
                    mode: Some("0750".into())
                },
                PlanStep::Copy {
                    src: "tool.sh".into(),
                    dest: "/srv/".into(),
                    chown: Some("user:user".into()),
                    mode: Some("0750".into())
                },
                PlanStep::Copy {
                    src: "data".into(),
                    dest: "/data".into(),
                    chown: None,
                    mode: None
                },
                PlanStep::User("user".into()),
            ]
        );
        assert_eq!(p.start_cmd.as_deref(), Some("python3 -m http.server 8080"));
        assert_eq!(p.warnings.len(), 1, "{:?}", p.warnings);
        assert!(p.warnings[0].contains("line 13"), "{:?}", p.warnings);
    }

    #[test]
    fn build_args_defaults_and_e2b_defaults() {
        let p = parse(
            "FROM busybox\nARG WHO=nobody\nARG UNSET\nRUN echo $WHO\n",
            &[("WHO".into(), "me".into()), ("EXTRA".into(), "x".into())],
        )
        .unwrap();
        assert_eq!(p.steps[2], PlanStep::Env(vec![("WHO".into(), "me".into())]));
        // No USER/WORKDIR: the sandboxes get E2B's user in its home.
        assert_eq!(
            p.steps[p.steps.len() - 2..],
            [
                PlanStep::User("user".into()),
                PlanStep::Workdir("/home/user".into())
            ]
        );
        assert!(
            p.warnings.iter().any(|w| w.contains("EXTRA")),
            "{:?}",
            p.warnings
        );
        assert_eq!(p.start_cmd, None);
    }

    #[test]
    fn entrypoint_and_cmd_follow_dockers_rules() {
        let start = |t: &str| plan(&format!("FROM busybox\n{t}")).start_cmd;
        assert_eq!(
            start("CMD [\"httpd\", \"-f\"]\n").as_deref(),
            Some("httpd -f")
        );
        assert_eq!(
            start("ENTRYPOINT [\"/bin/app\", \"--x\"]\nCMD [\"a b\"]\n").as_deref(),
            Some("/bin/app --x 'a b'")
        );
        assert_eq!(
            start("ENTRYPOINT [\"/bin/app\"]\nCMD serve now\n").as_deref(),
            Some("/bin/app /bin/sh -c 'serve now'")
        );
        assert_eq!(
            start("ENTRYPOINT run it\nCMD ignored\n").as_deref(),
            Some("run it")
        );
        let body = build_request(&plan("FROM busybox\nCMD top\n"), Some("top"), None, |_| {
            String::new()
        });
        assert_eq!(body["startCmd"], "top");
        assert_eq!(body["readyCmd"], DEFAULT_READY_CMD);
    }

    #[test]
    fn the_request_is_what_the_sdk_sends() {
        let p = plan("FROM busybox\nCOPY --chmod=755 a /b\nENV A=1 B=2\n");
        let body = build_request(&p, None, Some("true"), |i| format!("hash{i}"));
        assert_eq!(body["fromImage"], "busybox");
        assert_eq!(
            body["steps"][2],
            serde_json::json!({"type": "COPY", "args": ["a", "/b", "", "755"], "force": false, "filesHash": "hash2"})
        );
        assert_eq!(
            body["steps"][3]["args"],
            serde_json::json!(["A", "1", "B", "2"])
        );
        assert_eq!(body["readyCmd"], "true");
        assert!(body.get("startCmd").is_none());
    }

    #[test]
    fn bad_files_name_the_line() {
        for (text, line, needle) in [
            ("RUN echo\n", 1, "before FROM"),
            ("FROM a\nFROM b\n", 2, "multi-stage"),
            ("FROM a\n\nBOGUS x\n", 3, "BOGUS is not an instruction"),
            ("FROM a\nCOPY --from=x a b\n", 2, "--from"),
            ("FROM a\nADD https://x.example/f /f\n", 2, "URL"),
            ("FROM a\nCOPY ../etc /x\n", 2, "outside the build context"),
            ("FROM a\nCOPY *.txt /x\n", 2, "wildcards"),
            ("FROM a\nCOPY onlyone\n", 2, "sources and a destination"),
            ("FROM a\nCOPY --chmod=rw a b\n", 2, "octal"),
            ("FROM a\nENV 1X=2\n", 2, "environment variable name"),
            ("FROM a\nWORKDIR\n", 2, "exactly one"),
            ("FROM a\nRUN \"unterminated\nUSER 'x\n", 3, "unterminated"),
            ("FROM a\nRUN <<EOF\necho\nEOF\n", 2, "heredoc"),
            ("FROM a\nRUN --privileged true\n", 2, "--privileged"),
            ("FROM a\nWORKDIR ${X:?}\n", 2, "modifier"),
        ] {
            let e = error(text);
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.to_string().contains(needle), "{text:?}: {e}");
            assert!(
                e.to_string()
                    .starts_with(&format!("Dockerfile line {line}: ")),
                "{e}"
            );
        }
        assert!(error("# nothing\n").to_string().contains("no FROM"));
    }

    #[test]
    fn words_quote_escape_and_expand() {
        let vars: BTreeMap<String, String> = [("A".to_string(), "x y".to_string())].into();
        let w = |s: &str| words(s, &vars).unwrap();
        assert_eq!(w("a 'b c' \"d $A\" e\\ f"), ["a", "b c", "d x y", "e f"]);
        assert_eq!(w("$A"), ["x y"]);
        assert_eq!(
            w("${B:-def} ${A:+set} ${B:+no}x '$A'"),
            ["def", "set", "x", "$A"]
        );
        assert_eq!(w("cost$ $"), ["cost$", "$"]);
        let e = |s: &str| env_words(s, &vars).unwrap();
        assert_eq!(
            e("PATH=/opt/bin:$PATH:${PATH} A=$A"),
            ["PATH=/opt/bin:$PATH:${PATH}", "A=x y"]
        );
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("/usr/bin/x"), "/usr/bin/x");
    }
}
