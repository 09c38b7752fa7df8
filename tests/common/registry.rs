//! A real registry for tests: Debian's `docker-registry` (distribution 2.8) on loopback
//! with a temp storage dir, optionally behind token auth (a small token server signing
//! JWTs with `openssl`) or htpasswd basic auth; plus a push helper speaking the
//! distribution API with ureq.

use std::fs;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

pub fn sha256(data: &[u8]) -> String {
    let d = Sha256::digest(data);
    format!(
        "sha256:{}",
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

fn base64(input: &[u8], url: bool) -> String {
    let alphabet: &[u8; 64] = if url {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut out = String::new();
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(alphabet[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else if !url {
                out.push('=');
            }
        }
    }
    out
}

pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "aenv-reg-{}-{name}-{:x}",
        std::process::id(),
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    ));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.stdin(Stdio::null()).output().expect("command runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// How the registry authenticates.
pub enum Auth {
    Anonymous,
    /// Bearer tokens from a token server the test runs.
    Token,
    /// Basic auth with one htpasswd user.
    Htpasswd {
        user: String,
        password: String,
    },
}

/// A token server: answers `GET /token?scope=…&service=…` with a JWT signed by `openssl`.
pub struct TokenServer {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub url: String,
    pub requests: Arc<AtomicUsize>,
    key: PathBuf,
    cert_der: Vec<u8>,
}

pub const TOKEN_SERVICE: &str = "test-registry";
pub const TOKEN_ISSUER: &str = "test-issuer";

impl TokenServer {
    fn start(dir: &Path) -> TokenServer {
        let key = dir.join("token.key");
        let cert = dir.join("token.crt");
        run(Command::new("openssl").args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=agentenv-test-token-issuer",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ]));
        let cert_der = run(Command::new("openssl").args([
            "x509",
            "-in",
            cert.to_str().unwrap(),
            "-outform",
            "DER",
        ]));
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = server.server_addr().to_ip().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let mut me = TokenServer {
            server: server.clone(),
            thread: None,
            url: format!("http://127.0.0.1:{port}/token"),
            requests: requests.clone(),
            key: key.clone(),
            cert_der: cert_der.clone(),
        };
        let signer = Signer {
            key,
            cert_der,
            dir: dir.to_path_buf(),
        };
        me.thread = Some(std::thread::spawn(move || {
            for req in server.incoming_requests() {
                requests.fetch_add(1, Ordering::SeqCst);
                let url = req.url().to_string();
                let scope = url
                    .split(['?', '&'])
                    .find_map(|kv| kv.strip_prefix("scope="))
                    .map(|s| {
                        s.replace("%3A", ":")
                            .replace("%2F", "/")
                            .replace("%2C", ",")
                    })
                    .unwrap_or_default();
                let token = signer.token(&scope);
                let body = json!({"token": token, "expires_in": 300}).to_string();
                let _ = req.respond(
                    tiny_http::Response::from_string(body).with_header(
                        "Content-Type: application/json"
                            .parse::<tiny_http::Header>()
                            .unwrap(),
                    ),
                );
            }
        }));
        me
    }

    /// A token for `scope` (`repository:name:pull,push`), for pushing.
    fn token(&self, scope: &str) -> String {
        Signer {
            key: self.key.clone(),
            cert_der: self.cert_der.clone(),
            dir: self.key.parent().unwrap().to_path_buf(),
        }
        .token(scope)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Signer {
    key: PathBuf,
    cert_der: Vec<u8>,
    dir: PathBuf,
}

static SIGN_SEQ: AtomicUsize = AtomicUsize::new(0);

impl Signer {
    /// A JWT granting what `scope` asks for, signed RS256 by `openssl dgst`.
    fn token(&self, scope: &str) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let access: Vec<Value> = scope
            .split(' ')
            .filter_map(|s| {
                let mut parts = s.splitn(3, ':');
                let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
            })
            .collect();
        let header = json!({"typ": "JWT", "alg": "RS256", "x5c": [base64(&self.cert_der, false)]});
        let n = SIGN_SEQ.fetch_add(1, Ordering::SeqCst);
        let claims = json!({
            "iss": TOKEN_ISSUER, "sub": "tester", "aud": TOKEN_SERVICE,
            "exp": now + 600, "nbf": now - 60, "iat": now - 60,
            "jti": format!("jti-{}-{n}", std::process::id()),
            "access": access,
        });
        let signing_input = format!(
            "{}.{}",
            base64(header.to_string().as_bytes(), true),
            base64(claims.to_string().as_bytes(), true)
        );
        let input_path = self.dir.join(format!("jwt-input-{n}"));
        fs::write(&input_path, &signing_input).unwrap();
        let sig = run(Command::new("openssl")
            .args(["dgst", "-sha256", "-binary", "-sign"])
            .arg(&self.key)
            .arg(&input_path));
        let _ = fs::remove_file(&input_path);
        format!("{signing_input}.{}", base64(&sig, true))
    }
}

/// An image pushed by digest.
#[derive(Clone, Debug)]
pub struct PushedImage {
    pub media_type: String,
    pub digest: String,
    pub bytes: Vec<u8>,
    pub config_digest: String,
    pub layer_digests: Vec<String>,
}

/// One layer to push: a tar, gzip-compressed or not.
pub struct TestLayer {
    pub tar: Vec<u8>,
    pub gzip: bool,
}

/// A running `docker-registry serve`, killed on drop.
pub struct TestRegistry {
    child: Option<Child>,
    pub addr: String,
    pub dir: PathBuf,
    log_path: PathBuf,
    pub token_server: Option<TokenServer>,
    basic: Option<(String, String)>,
}

impl TestRegistry {
    pub fn start(auth: Auth) -> TestRegistry {
        let dir = temp_dir("registry");
        let port = super::free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut token_server = None;
        let mut basic = None;
        let auth_yaml = match auth {
            Auth::Anonymous => String::new(),
            Auth::Token => {
                let ts = TokenServer::start(&dir);
                let yaml = format!(
                    "auth:\n  token:\n    realm: {}\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}\n",
                    ts.url,
                    dir.join("token.crt").display()
                );
                token_server = Some(ts);
                yaml
            }
            Auth::Htpasswd { user, password } => {
                let line = run(Command::new("htpasswd").args(["-Bbn", &user, &password]));
                fs::write(dir.join("htpasswd"), line).unwrap();
                basic = Some((user, password));
                format!(
                    "auth:\n  htpasswd:\n    realm: test-realm\n    path: {}\n",
                    dir.join("htpasswd").display()
                )
            }
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: info\n  formatter: text\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{auth_yaml}",
            dir.join("data").display()
        );
        fs::write(dir.join("config.yml"), config).unwrap();
        let log_path = dir.join("registry.log");
        let log = fs::File::create(&log_path).unwrap();
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("docker-registry is installed (scripts/setup.sh)");
        let reg = TestRegistry {
            child: Some(child),
            addr,
            dir,
            log_path,
            token_server,
            basic,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(&reg.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not start: {}",
                reg.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        reg
    }

    /// Copies an OCI layout (`oci:<dir>[:tag]`, e.g. [`super::debian_image`]) into this
    /// registry as `repo:tag` with skopeo; returns the reference to pull it by.
    pub fn push_layout(&self, layout: &str, repo: &str, tag: &str) -> String {
        let reference = format!("{}/{repo}:{tag}", self.addr);
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--dest-tls-verify=false"]);
        if let Some((user, password)) = &self.basic {
            cmd.arg(format!("--dest-creds={user}:{password}"));
        }
        cmd.arg(layout).arg(format!("docker://{reference}"));
        run(&mut cmd);
        reference
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Successful GETs of `repo`'s blob `digest`, from the registry's access log.
    pub fn blob_gets(&self, repo: &str, digest: &str) -> usize {
        let needle = format!("\"GET /v2/{repo}/blobs/{digest} HTTP/1.1\" 200");
        self.log().matches(&needle).count()
    }

    /// Where the registry stores blob `digest` (for tampering).
    pub fn blob_data_path(&self, digest: &str) -> PathBuf {
        let hex = &digest["sha256:".len()..];
        self.dir
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}/v2/{path}", self.addr)
    }

    fn authorize(&self, req: ureq::Request, repo: &str) -> ureq::Request {
        if let Some(ts) = &self.token_server {
            let token = ts.token(&format!("repository:{repo}:pull,push"));
            return req.set("Authorization", &format!("Bearer {token}"));
        }
        if let Some((u, p)) = &self.basic {
            return req.set(
                "Authorization",
                &format!("Basic {}", base64(format!("{u}:{p}").as_bytes(), false)),
            );
        }
        req
    }

    pub fn push_blob(&self, repo: &str, data: &[u8]) -> String {
        let digest = sha256(data);
        let resp = self
            .authorize(
                ureq::post(&self.url(&format!("{repo}/blobs/uploads/"))),
                repo,
            )
            .call()
            .unwrap();
        assert_eq!(resp.status(), 202);
        let location = resp.header("location").unwrap().to_string();
        let location = if location.starts_with('/') {
            format!("http://{}{location}", self.addr)
        } else {
            location
        };
        let sep = if location.contains('?') { '&' } else { '?' };
        let resp = self
            .authorize(ureq::put(&format!("{location}{sep}digest={digest}")), repo)
            .set("Content-Type", "application/octet-stream")
            .send_bytes(data)
            .unwrap();
        assert_eq!(resp.status(), 201);
        digest
    }

    pub fn push_manifest(&self, repo: &str, reference: &str, media_type: &str, bytes: &[u8]) {
        let resp = self
            .authorize(
                ureq::put(&self.url(&format!("{repo}/manifests/{reference}"))),
                repo,
            )
            .set("Content-Type", media_type)
            .send_bytes(bytes)
            .unwrap();
        assert_eq!(resp.status(), 201);
    }

    /// Pushes config, layers and the manifest (by digest) of a one-platform image.
    pub fn push_image(
        &self,
        repo: &str,
        arch: &str,
        working_dir: &str,
        layers: &[TestLayer],
        docker: bool,
    ) -> PushedImage {
        let mut diff_ids = Vec::new();
        let mut layer_descs = Vec::new();
        let mut layer_digests = Vec::new();
        for l in layers {
            diff_ids.push(sha256(&l.tar));
            let blob = if l.gzip {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(&l.tar).unwrap();
                gz.finish().unwrap()
            } else {
                l.tar.clone()
            };
            let digest = self.push_blob(repo, &blob);
            let media_type = match (docker, l.gzip) {
                (true, true) => "application/vnd.docker.image.rootfs.diff.tar.gzip",
                (true, false) => "application/vnd.docker.image.rootfs.diff.tar",
                (false, true) => "application/vnd.oci.image.layer.v1.tar+gzip",
                (false, false) => "application/vnd.oci.image.layer.v1.tar",
            };
            layer_descs
                .push(json!({"mediaType": media_type, "digest": digest, "size": blob.len()}));
            layer_digests.push(digest);
        }
        let config = json!({
            "architecture": arch, "os": "linux",
            "config": {"Env": ["PATH=/bin"], "WorkingDir": working_dir, "Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        })
        .to_string();
        let config_digest = self.push_blob(repo, config.as_bytes());
        let (manifest_type, config_type) = if docker {
            (
                DOCKER_MANIFEST,
                "application/vnd.docker.container.image.v1+json",
            )
        } else {
            (OCI_MANIFEST, "application/vnd.oci.image.config.v1+json")
        };
        let manifest = json!({
            "schemaVersion": 2, "mediaType": manifest_type,
            "config": {"mediaType": config_type, "digest": config_digest, "size": config.len()},
            "layers": layer_descs,
        })
        .to_string()
        .into_bytes();
        let digest = sha256(&manifest);
        self.push_manifest(repo, &digest, manifest_type, &manifest);
        PushedImage {
            media_type: manifest_type.to_string(),
            digest,
            bytes: manifest,
            config_digest,
            layer_digests,
        }
    }

    /// Pushes an index (OCI) or manifest list (Docker) of `images` under `tag`.
    pub fn push_index(
        &self,
        repo: &str,
        tag: &str,
        images: &[(&PushedImage, &str)],
        docker: bool,
    ) -> String {
        let media_type = if docker { DOCKER_LIST } else { OCI_INDEX };
        let manifests: Vec<Value> = images
            .iter()
            .map(|(img, arch)| {
                json!({"mediaType": img.media_type, "digest": img.digest, "size": img.bytes.len(),
                       "platform": {"architecture": arch, "os": "linux"}})
            })
            .collect();
        let index = json!({"schemaVersion": 2, "mediaType": media_type, "manifests": manifests})
            .to_string()
            .into_bytes();
        self.push_manifest(repo, tag, media_type, &index);
        sha256(&index)
    }

    pub fn tag(&self, repo: &str, tag: &str, image: &PushedImage) {
        self.push_manifest(repo, tag, &image.media_type, &image.bytes);
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
