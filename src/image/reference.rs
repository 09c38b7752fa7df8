//! Image reference parsing: local OCI layouts (`oci:/abs/path[:tag]`) and registry
//! references normalised the way Docker does (`ubuntu` → `docker.io/library/ubuntu:latest`).

use std::fmt;
use std::path::{Component, PathBuf};

use super::ImageError;

/// A parsed, normalised image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference {
    /// A local OCI image layout directory, optionally naming a tag
    /// (the `org.opencontainers.image.ref.name` annotation in its index.json).
    Layout { path: PathBuf, tag: Option<String> },
    /// An image in a registry.
    Registry(RegistryReference),
}

/// A registry reference in Docker's normalised form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryReference {
    /// `docker.io`, `registry.example:5000`, `127.0.0.1:5000`, `localhost`.
    pub domain: String,
    /// `library/ubuntu`, `team/app`.
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

impl fmt::Display for RegistryReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.domain, self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Layout { path, tag: None } => write!(f, "oci:{}", path.display()),
            Reference::Layout {
                path,
                tag: Some(tag),
            } => write!(f, "oci:{}:{tag}", path.display()),
            Reference::Registry(r) => r.fmt(f),
        }
    }
}

const DEFAULT_DOMAIN: &str = "docker.io";
const MAX_NAME_LEN: usize = 255;

impl Reference {
    /// Parses `input` into a normalised reference. Errors are
    /// [`ImageError::InvalidReference`] naming the input and what is wrong with it.
    pub fn parse(input: &str) -> Result<Reference, ImageError> {
        let invalid = |why: &str| ImageError::InvalidReference(format!("{input:?}: {why}"));
        if input.is_empty() {
            return Err(invalid("the image reference is empty"));
        }
        if input.trim() != input || input.chars().any(|c| c.is_control()) {
            return Err(invalid("contains whitespace or control characters"));
        }
        if let Some(rest) = input.strip_prefix("oci:") {
            return parse_layout(rest).map_err(|why| invalid(&why));
        }
        let rest = input.strip_prefix("docker://").unwrap_or(input);
        parse_registry(rest)
            .map(Reference::Registry)
            .map_err(|why| invalid(&why))
    }
}

fn parse_layout(rest: &str) -> Result<Reference, String> {
    // Like skopeo's `oci:` transport, the first colon separates path and tag, so layout
    // paths cannot contain a colon.
    let (path, tag) = match rest.split_once(':') {
        Some((path, tag)) => (path, Some(tag)),
        None => (rest, None),
    };
    if !path.starts_with('/') {
        return Err(format!(
            "the layout path {path:?} must be absolute (oci:/abs/path[:tag])"
        ));
    }
    let mut clean = PathBuf::from("/");
    for component in PathBuf::from(path).components() {
        match component {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(c) => clean.push(c),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(format!("the layout path {path:?} must not contain '..'"));
            }
        }
    }
    let tag = match tag {
        None => None,
        Some(t) if valid_tag(t) => Some(t.to_string()),
        Some(t) => {
            return Err(format!(
                "{t:?} is not a valid tag (letters, digits, '_', '.', '-'; at most 128)"
            ))
        }
    };
    Ok(Reference::Layout { path: clean, tag })
}

fn valid_tag(tag: &str) -> bool {
    let b = tag.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

fn valid_digest(digest: &str) -> bool {
    match digest.split_once(':') {
        Some(("sha256", hex)) => {
            hex.len() == 64 && hex.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        }
        _ => false,
    }
}

/// One path component: lowercase alphanumerics separated by `.`, `_`, `__` or runs of `-`.
fn valid_path_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        let ch = b[i];
        if ch.is_ascii_lowercase() || ch.is_ascii_digit() {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !(b[i].is_ascii_lowercase() || b[i].is_ascii_digit()) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|s| s == b'-');
        if !ok {
            return false;
        }
    }
    true
}

fn valid_domain(domain: &str) -> bool {
    let (host, port) = match domain.rsplit_once(':') {
        // An IPv6 literal in brackets keeps its colons.
        Some((h, p)) if !p.contains(']') => (h, Some(p)),
        _ => (domain, None),
    };
    if let Some(port) = port {
        if port.is_empty() || port.len() > 5 || !port.bytes().all(|c| c.is_ascii_digit()) {
            return false;
        }
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().is_ok();
    }
    !host.is_empty()
        && host.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn parse_registry(input: &str) -> Result<RegistryReference, String> {
    let (name_tag, digest) = match input.split_once('@') {
        Some((n, d)) => {
            if !valid_digest(d) {
                return Err(format!(
                    "{d:?} is not a valid digest (expected sha256:<64 lowercase hex>)"
                ));
            }
            (n, Some(d.to_string()))
        }
        None => (input, None),
    };
    // The tag follows the last colon, unless that colon is part of a `host:port` prefix.
    let (name, tag) = match name_tag.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => {
            if !valid_tag(t) {
                return Err(format!(
                    "{t:?} is not a valid tag (letters, digits, '_', '.', '-'; at most 128)"
                ));
            }
            (n, Some(t.to_string()))
        }
        _ => (name_tag, None),
    };
    if name.is_empty() {
        return Err("the repository name is empty".into());
    }
    let (domain, remainder) = match name.split_once('/') {
        Some((first, rest))
            if first.contains(['.', ':'])
                || first == "localhost"
                || first.bytes().any(|c| c.is_ascii_uppercase()) =>
        {
            (first.to_string(), rest.to_string())
        }
        _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
    };
    let domain = if domain == "index.docker.io" {
        DEFAULT_DOMAIN.to_string()
    } else {
        domain
    };
    if !valid_domain(&domain) {
        return Err(format!("{domain:?} is not a valid registry host[:port]"));
    }
    let repository = if domain == DEFAULT_DOMAIN && !remainder.contains('/') {
        format!("library/{remainder}")
    } else {
        remainder
    };
    if let Some(bad) = repository.split('/').find(|c| !valid_path_component(c)) {
        return Err(format!(
            "repository component {bad:?} is invalid (lowercase letters, digits and \
             single '.', '_', '__' or '-' separators)"
        ));
    }
    if domain.len() + 1 + repository.len() > MAX_NAME_LEN {
        return Err(format!(
            "the repository name is longer than {MAX_NAME_LEN} characters"
        ));
    }
    let tag = if tag.is_none() && digest.is_none() {
        Some("latest".to_string())
    } else {
        tag
    };
    Ok(RegistryReference {
        domain,
        repository,
        tag,
        digest,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        Reference::parse(s).unwrap().to_string()
    }

    #[test]
    fn docker_style_normalisation() {
        let d = "sha256:".to_string() + &"ab".repeat(32);
        assert_eq!(norm("ubuntu"), "docker.io/library/ubuntu:latest");
        assert_eq!(norm("ubuntu:24.04"), "docker.io/library/ubuntu:24.04");
        assert_eq!(
            norm("docker.io/library/ubuntu:24.04"),
            "docker.io/library/ubuntu:24.04"
        );
        assert_eq!(norm("index.docker.io/foo/bar"), "docker.io/foo/bar:latest");
        assert_eq!(norm("team/app"), "docker.io/team/app:latest");
        assert_eq!(
            norm("127.0.0.1:5000/busybox:latest"),
            "127.0.0.1:5000/busybox:latest"
        );
        assert_eq!(norm("localhost/x"), "localhost/x:latest");
        assert_eq!(
            norm(&format!("registry.example:5000/team/app@{d}")),
            format!("registry.example:5000/team/app@{d}")
        );
        assert_eq!(
            norm(&format!("host:5000/x:v1@{d}")),
            format!("host:5000/x:v1@{d}")
        );
        assert_eq!(norm("docker://alpine:3"), "docker.io/library/alpine:3");
        match Reference::parse("host:5000/x").unwrap() {
            Reference::Registry(r) => {
                assert_eq!(r.domain, "host:5000");
                assert_eq!(r.repository, "x");
                assert_eq!(r.tag.as_deref(), Some("latest"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn invalid_registry_references() {
        for bad in [
            "",
            "Ubuntu",
            "ubuntu:",
            "ubuntu:-x",
            "ubuntu@sha256:abc",
            "ubuntu@md5:00",
            "a//b",
            "a/b/",
            "x y",
            "host:99999999/x",
        ] {
            let err = Reference::parse(bad).unwrap_err();
            assert!(
                matches!(err, ImageError::InvalidReference(_)),
                "{bad:?} → {err}"
            );
        }
    }

    #[test]
    fn oci_layout_references() {
        assert_eq!(
            Reference::parse("oci:/a/b/").unwrap(),
            Reference::Layout {
                path: "/a/b".into(),
                tag: None
            }
        );
        assert_eq!(norm("oci:/a//./b:v1.0"), "oci:/a/b:v1.0");
        for bad in [
            "oci:rel/path",
            "oci:/a/../b",
            "oci:/a:",
            "oci:/a:b:c",
            "oci:",
        ] {
            assert!(
                matches!(Reference::parse(bad), Err(ImageError::InvalidReference(_))),
                "{bad}"
            );
        }
    }
}
