//! The web console (docs/console.md): static assets under `/console/`, embedded in the
//! binary at build time, and the terminal's WebSocket ([`terminal`]).
//!
//! The assets hold no data and no secret, so they are served without the API key: the
//! page asks for the key (a login form), keeps it in the tab's `sessionStorage` only and
//! sends it as `X-API-Key` on every API call, like any other client. No cookie is ever
//! set, so a cross-site request carries no credential (nothing to forge). The terminal's
//! WebSocket, which a browser cannot give headers, carries the key as a subprotocol and
//! is refused without it. Every asset is sent with a strict Content-Security-Policy
//! (scripts and styles from the console's own files only, no inline code, no frames).

pub mod terminal;

use super::{ApiError, Reply};

/// The Content-Security-Policy of every console answer.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// One embedded file: its name under `/console/`, its type and its bytes.
pub struct Asset {
    pub name: &'static str,
    pub content_type: &'static str,
    pub body: &'static [u8],
}

macro_rules! asset {
    ($name:literal, $type:expr) => {
        Asset {
            name: $name,
            content_type: $type,
            body: include_bytes!(concat!("assets/", $name)),
        }
    };
}

const JS: &str = "text/javascript; charset=utf-8";

/// Every file of the console, embedded at build time (no CDN, nothing fetched at run time).
pub static ASSETS: &[Asset] = &[
    asset!("index.html", "text/html; charset=utf-8"),
    asset!("app.css", "text/css; charset=utf-8"),
    asset!("app.js", JS),
    asset!("dom.js", JS),
    asset!("sandboxes.js", JS),
    asset!("sandbox.js", JS),
    asset!("terminal.js", JS),
    asset!("vt.js", JS),
    asset!("templates.js", JS),
    asset!("host.js", JS),
    asset!("plot.js", JS),
    asset!("favicon.svg", "image/svg+xml"),
];

/// The asset called `name`.
pub fn asset(name: &str) -> Option<&'static Asset> {
    ASSETS.iter().find(|a| a.name == name)
}

/// Headers of every console answer: the CSP and what keeps the page out of frames and
/// other sites' reach.
pub fn security_headers() -> Vec<(String, String)> {
    [
        ("Content-Security-Policy", CSP),
        ("X-Content-Type-Options", "nosniff"),
        ("X-Frame-Options", "DENY"),
        ("Referrer-Policy", "no-referrer"),
        ("Cross-Origin-Opener-Policy", "same-origin"),
        ("Cross-Origin-Resource-Policy", "same-origin"),
        ("Cache-Control", "no-cache"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// Whether a request may skip the API-key check: the static assets (no data), and the
/// terminal's WebSocket, which checks the key itself ([`terminal`]).
pub fn is_public(method: &tiny_http::Method, path: &str) -> bool {
    if *method != tiny_http::Method::Get {
        return false;
    }
    match path.strip_prefix("/console") {
        Some("" | "/") => true,
        Some(rest) => {
            let rest = rest.strip_prefix('/').unwrap_or("-/");
            !rest.contains('/') || terminal::sandbox_of(path).is_some()
        }
        None => false,
    }
}

/// `GET /console`: to the console's page.
pub fn redirect() -> Result<Reply, ApiError> {
    Ok(Reply::Redirect("/console/"))
}

/// `GET /console/` and `GET /console/{asset}`.
pub fn serve(name: &str) -> Result<Reply, ApiError> {
    let name = if name.is_empty() { "index.html" } else { name };
    let a = asset(name).ok_or_else(|| ApiError::not_found(format!("no console file {name}")))?;
    Ok(Reply::Asset {
        content_type: a.content_type,
        body: a.body,
        headers: security_headers(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tiny_http::Method;

    #[test]
    fn every_asset_is_embedded_and_typed() {
        for a in ASSETS {
            assert!(!a.body.is_empty(), "{} is empty", a.name);
            let on_disk = std::fs::read(format!(
                "{}/src/api/console/assets/{}",
                env!("CARGO_MANIFEST_DIR"),
                a.name
            ))
            .unwrap();
            assert_eq!(a.body, &on_disk[..], "{} differs from its file", a.name);
        }
        let dir = format!("{}/src/api/console/assets", env!("CARGO_MANIFEST_DIR"));
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        let mut embedded: Vec<String> = ASSETS.iter().map(|a| a.name.to_string()).collect();
        embedded.sort();
        assert_eq!(
            files, embedded,
            "every file in assets/ is embedded, and only those"
        );
        assert!(asset("index.html")
            .unwrap()
            .content_type
            .starts_with("text/html"));
        assert!(asset("app.js")
            .unwrap()
            .content_type
            .starts_with("text/javascript"));
        assert!(asset("../Cargo.toml").is_none());
    }

    /// The page loads only its own files: no inline script or style, no remote URL, no
    /// HTML built from strings (every text goes in as text).
    #[test]
    fn assets_have_no_inline_code_remote_urls_or_html_sinks() {
        for a in ASSETS {
            // The SVG namespace is a name, not a URL anything is fetched from.
            let text = String::from_utf8_lossy(a.body).replace("http://www.w3.org/2000/svg", "");
            for bad in [
                "http://",
                "https://",
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "new Function",
                "setTimeout('",
            ] {
                assert!(!text.contains(bad), "{} contains {bad}", a.name);
            }
        }
        let index = String::from_utf8_lossy(asset("index.html").unwrap().body);
        assert!(!index.contains("<style"), "inline style");
        assert!(!index.contains(" style="), "inline style attribute");
        let handler = index.split(" on").skip(1).any(|rest| {
            let name: String = rest.chars().take_while(char::is_ascii_alphabetic).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(!handler, "inline event handler");
        for script in index.split("<script").skip(1) {
            assert!(script.contains("src="), "inline script: {script}");
        }
        assert!(CSP.contains("script-src 'self'") && !CSP.contains("unsafe"));
    }

    #[test]
    fn serves_assets_with_the_csp_and_404s_others() {
        let Ok(Reply::Asset { body, headers, .. }) = serve("") else {
            panic!("index")
        };
        assert_eq!(body, asset("index.html").unwrap().body);
        assert!(headers
            .iter()
            .any(|(k, v)| k == "Content-Security-Policy" && v == CSP));
        assert!(headers
            .iter()
            .any(|(k, v)| k == "X-Frame-Options" && v == "DENY"));
        assert_eq!(serve("nope.js").err().unwrap().status, 404);
        assert!(matches!(redirect(), Ok(Reply::Redirect("/console/"))));
    }

    #[test]
    fn only_assets_and_the_terminal_skip_the_key_check() {
        let id = "01900000-0000-7000-8000-000000000000";
        for path in ["/console", "/console/", "/console/app.js", "/console/nope"] {
            assert!(is_public(&Method::Get, path), "{path}");
        }
        assert!(is_public(&Method::Get, &format!("/console/terminal/{id}")));
        for (method, path) in [
            (Method::Post, "/console/"),
            (Method::Get, "/console/a/b"),
            (Method::Get, "/console/terminal/not-a-uuid"),
            (Method::Get, "/consolex"),
            (Method::Get, "/sandboxes"),
            (Method::Get, "/metrics/history"),
        ] {
            assert!(!is_public(&method, path), "{method} {path}");
        }
    }
}
