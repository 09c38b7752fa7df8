//! Registry pulls against a real registry (Debian's docker-registry) on loopback.

mod common;

use std::fs;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv::image::{ImageError, ImageOptions, ImageStore, LayerBuilder, PhaseTimings};
use agentenv::orchestrator::OrchError;
use common::registry::{temp_dir, Auth, TestLayer, TestRegistry};

/// Fails the test (never skips it) when the registry binary is missing.
fn require_registry() {
    assert!(
        Path::new("/usr/bin/docker-registry").is_file(),
        "docker-registry is not installed (run scripts/setup.sh)"
    );
}

fn debugfs(img: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(img)
        .output()
        .expect("debugfs (e2fsprogs) is installed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn layer(f: impl FnOnce(&mut LayerBuilder)) -> Vec<u8> {
    let mut b = LayerBuilder::new();
    f(&mut b);
    b.finish()
}

/// A lower gzip layer and an upper uncompressed one that whites out a lower file.
fn two_layers(marker: &str) -> Vec<TestLayer> {
    vec![
        TestLayer {
            tar: layer(|b| {
                b.dir("etc", 0o755).file("etc/gone", 0o644, b"lower").file(
                    "etc/kept",
                    0o644,
                    marker.as_bytes(),
                );
            }),
            gzip: true,
        },
        TestLayer {
            tar: layer(|b| {
                b.whiteout("etc/gone").file("etc/new", 0o600, b"upper");
            }),
            gzip: false,
        },
    ]
}

/// Files left in the cache (blobs, disks, temp files).
fn cache_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path().display().to_string());
            }
        }
    }
    out
}

struct Scratch(std::path::PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn new_store(name: &str, options: ImageOptions) -> (Scratch, ImageStore) {
    let dir = temp_dir(name);
    let store = ImageStore::with_options(dir.join("images"), options);
    (Scratch(dir), store)
}

#[test]
fn oci_index_with_amd64_not_first_is_pulled_with_gzip_plain_and_whiteout_layers() {
    require_registry();
    let reg = TestRegistry::start(Auth::Anonymous);
    let arm = reg.push_image("team/app", "arm64", "/arm", &two_layers("arm"), false);
    let amd = reg.push_image("team/app", "amd64", "/amd", &two_layers("amd"), false);
    let index = reg.push_index("team/app", "v1", &[(&arm, "arm64"), (&amd, "amd64")], false);

    let (_scratch, store) = new_store("oci-index", ImageOptions::default());
    let reference = format!("{}/team/app:v1", reg.addr);
    let img = store.prepare_rootfs(&reference, 64).unwrap();
    assert_eq!(img.reference, reference);
    assert_eq!(img.manifest_digest, amd.digest);
    assert_eq!(img.working_dir.as_deref(), Some("/amd"));
    let listing = debugfs(&img.base_disk, "ls -l /etc");
    assert!(
        listing.contains("kept") && listing.contains("new"),
        "{listing}"
    );
    assert!(!listing.contains("gone"), "{listing}");
    assert_eq!(debugfs(&img.base_disk, "cat /etc/kept"), "amd");
    assert_eq!(debugfs(&img.base_disk, "cat /etc/new"), "upper");
    // Only amd64's layers were downloaded.
    for d in arm
        .layer_digests
        .iter()
        .filter(|d| !amd.layer_digests.contains(d))
    {
        assert_eq!(reg.blob_gets("team/app", d), 0, "arm64 layer {d} pulled");
    }

    // Cache hit: one manifest round trip, no blob downloads, no build.
    let started = Instant::now();
    let again = store.prepare_rootfs(&reference, 64).unwrap();
    let hit_ms = started.elapsed().as_millis();
    assert_eq!(again.base_disk, img.base_disk);
    assert_eq!(store.builds(), 1);
    eprintln!("cache hit took {hit_ms} ms");
    assert!(hit_ms < 1000, "cache hit took {hit_ms} ms");
    for d in &amd.layer_digests {
        assert_eq!(reg.blob_gets("team/app", d), 1);
    }

    // By digest (of the index): same disk, and works with the registry gone.
    let by_digest = format!("{}/team/app@{index}", reg.addr);
    let img2 = store.prepare_rootfs(&by_digest, 64).unwrap();
    assert_eq!(img2.base_disk, img.base_disk);
    drop(reg);
    let offline = store.prepare_rootfs(&by_digest, 64).unwrap();
    assert_eq!(offline.base_disk, img.base_disk);

    let listed = store.list_cache().unwrap();
    assert!(listed
        .iter()
        .any(|e| e.kind == agentenv::image::EntryKind::BaseDisk && e.digest == amd.digest));
    assert!(listed.iter().any(|e| e.digest == amd.layer_digests[0]));
}

#[test]
fn docker_manifest_list_is_pulled() {
    require_registry();
    let reg = TestRegistry::start(Auth::Anonymous);
    let layers = vec![TestLayer {
        tar: layer(|b| {
            b.dir("srv", 0o755).file("srv/hello", 0o644, b"docker");
        }),
        gzip: true,
    }];
    let amd = reg.push_image("library/busy", "amd64", "/srv", &layers, true);
    let arm = reg.push_image("library/busy", "arm", "/", &layers[..0], true);
    reg.push_index(
        "library/busy",
        "latest",
        &[(&arm, "arm"), (&amd, "amd64")],
        true,
    );
    // A plain Docker v2 manifest under another tag.
    reg.tag("library/busy", "single", &amd);

    let (_scratch, store) = new_store("docker-list", ImageOptions::default());
    let img = store
        .prepare_rootfs(&format!("{}/library/busy", reg.addr), 64)
        .unwrap();
    assert_eq!(img.manifest_digest, amd.digest);
    assert_eq!(img.reference, format!("{}/library/busy:latest", reg.addr));
    assert_eq!(debugfs(&img.base_disk, "cat /srv/hello"), "docker");
    let single = store
        .prepare_rootfs(&format!("{}/library/busy:single", reg.addr), 64)
        .unwrap();
    assert_eq!(single.base_disk, img.base_disk);
    assert_eq!(store.builds(), 1);
}

#[test]
fn token_auth_is_negotiated_and_tokens_are_reused() {
    require_registry();
    let reg = TestRegistry::start(Auth::Token);
    let img = reg.push_image("team/secure", "amd64", "/", &two_layers("tok"), false);
    reg.tag("team/secure", "v1", &img);
    let pushes = reg
        .token_server
        .as_ref()
        .unwrap()
        .requests
        .load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(pushes, 0, "the push helper signs its own tokens");

    // Without a token the registry says 401.
    let anon = ureq::get(&format!("http://{}/v2/team/secure/manifests/v1", reg.addr)).call();
    assert!(matches!(anon, Err(ureq::Error::Status(401, _))));

    let (_scratch, store) = new_store("token", ImageOptions::default());
    let reference = format!("{}/team/secure:v1", reg.addr);
    let pulled = store.prepare_rootfs(&reference, 64).unwrap();
    assert_eq!(pulled.manifest_digest, img.digest);
    let requests = &reg.token_server.as_ref().unwrap().requests;
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    store.prepare_rootfs(&reference, 64).unwrap();
    assert_eq!(
        requests.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the token is cached"
    );
}

#[test]
fn basic_auth_uses_configured_or_docker_config_credentials() {
    require_registry();
    let reg = TestRegistry::start(Auth::Htpasswd {
        user: "puller".into(),
        password: "s3cret".into(),
    });
    let img = reg.push_image("team/private", "amd64", "/", &two_layers("basic"), false);
    reg.tag("team/private", "v1", &img);
    let reference = format!("{}/team/private:v1", reg.addr);

    let (_s1, anonymous) = new_store("basic-anon", ImageOptions::default());
    let err = anonymous.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::Denied(_)), "{err}");
    assert!(err.is_client_error());
    let msg = err.to_string();
    assert!(
        msg.contains(&reference) && msg.contains("credentials"),
        "{msg}"
    );
    assert_eq!(
        OrchError::from(err.clone()),
        OrchError::BadRequest(err.to_string())
    );

    let (_s2, wrong) = new_store(
        "basic-wrong",
        ImageOptions {
            credentials: vec![(reg.addr.clone(), "puller".into(), "nope".into())],
            ..ImageOptions::default()
        },
    );
    let err = wrong.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::Denied(_)), "{err}");

    let (_s3, configured) = new_store(
        "basic-config",
        ImageOptions {
            credentials: vec![(reg.addr.clone(), "puller".into(), "s3cret".into())],
            ..ImageOptions::default()
        },
    );
    assert_eq!(
        configured
            .prepare_rootfs(&reference, 64)
            .unwrap()
            .manifest_digest,
        img.digest
    );

    let dir = temp_dir("docker-config");
    let config = dir.join("config.json");
    // base64("puller:s3cret")
    fs::write(
        &config,
        format!(
            r#"{{"auths":{{"http://{}/v2/":{{"auth":"cHVsbGVyOnMzY3JldA=="}}}}}}"#,
            reg.addr
        ),
    )
    .unwrap();
    let (_s4, from_docker) = new_store(
        "basic-docker",
        ImageOptions {
            docker_config: Some(config),
            ..ImageOptions::default()
        },
    );
    assert_eq!(
        from_docker
            .prepare_rootfs(&reference, 64)
            .unwrap()
            .manifest_digest,
        img.digest
    );
    let _ = fs::remove_dir_all(dir);
}

#[test]
fn tampered_blob_is_refused_and_nothing_is_cached() {
    require_registry();
    let reg = TestRegistry::start(Auth::Anonymous);
    let layers = vec![TestLayer {
        tar: layer(|b| {
            b.file("data", 0o644, b"original contents");
        }),
        gzip: false,
    }];
    let img = reg.push_image("team/tampered", "amd64", "/", &layers, false);
    reg.tag("team/tampered", "latest", &img);
    // Same length, different bytes: only the digest can tell.
    let data = reg.blob_data_path(&img.layer_digests[0]);
    let mut bytes = fs::read(&data).unwrap();
    let pos = bytes.windows(8).position(|w| w == b"original").unwrap();
    bytes[pos..pos + 8].copy_from_slice(b"tampered");
    fs::write(&data, bytes).unwrap();

    let (scratch, store) = new_store("tampered", ImageOptions::default());
    let reference = format!("{}/team/tampered", reg.addr);
    let err = store.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::BadImage(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&img.layer_digests[0]) && msg.contains("digest") && msg.contains(&reference),
        "{msg}"
    );
    assert!(err.is_client_error());
    let left = cache_files(&scratch.0.join("images"));
    // Only the (verified) config blob may stay.
    let config_blob = format!("blobs/sha256/{}", &img.config_digest[7..]);
    assert!(left.iter().all(|f| f.ends_with(&config_blob)), "{left:?}");
}

#[test]
fn concurrent_cold_starts_download_and_build_once() {
    require_registry();
    let reg = TestRegistry::start(Auth::Anonymous);
    // ~4 MiB of incompressible data so the downloads overlap.
    let mut data = vec![0u8; 4 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let layers = vec![TestLayer {
        tar: layer(|b| {
            b.file("big", 0o644, &data);
        }),
        gzip: true,
    }];
    let img = reg.push_image("team/popular", "amd64", "/", &layers, false);
    reg.tag("team/popular", "latest", &img);
    let (_scratch, store) = new_store("concurrent", ImageOptions::default());
    let store = Arc::new(store);
    let reference = format!("{}/team/popular:latest", reg.addr);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            let reference = reference.clone();
            std::thread::spawn(move || store.prepare_rootfs(&reference, 64).unwrap())
        })
        .collect();
    let disks: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().unwrap().base_disk)
        .collect();
    assert!(disks.iter().all(|d| d == &disks[0]));
    assert_eq!(store.builds(), 1);
    assert_eq!(reg.blob_gets("team/popular", &img.layer_digests[0]), 1);
    assert_eq!(reg.blob_gets("team/popular", &img.config_digest), 1);
}

#[test]
fn unknown_tags_and_repositories_are_client_errors_naming_the_reference() {
    require_registry();
    let reg = TestRegistry::start(Auth::Anonymous);
    let img = reg.push_image("team/app", "amd64", "/", &two_layers("x"), false);
    reg.tag("team/app", "v1", &img);
    let (scratch, store) = new_store("unknown", ImageOptions::default());

    let reference = format!("{}/team/app:nope", reg.addr);
    let err = store.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::NotFound(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&reference) && msg.contains("MANIFEST_UNKNOWN"),
        "{msg}"
    );
    assert_eq!(OrchError::from(err).status(), 400, "a client error");

    let reference = format!("{}/team/missing:v1", reg.addr);
    let err = store.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::NotFound(_)), "{err}");
    assert!(err.to_string().contains(&reference), "{err}");
    assert!(cache_files(&scratch.0.join("images")).is_empty());
}

#[test]
fn unreachable_or_hanging_registries_are_upstream_errors() {
    require_registry();
    let mut reg = TestRegistry::start(Auth::Anonymous);
    let addr = reg.addr.clone();
    reg.stop();
    let (scratch, store) = new_store("down", ImageOptions::default());
    let reference = format!("{addr}/team/app:v1");
    let err = store.prepare_rootfs(&reference, 64).unwrap_err();
    assert!(matches!(err, ImageError::Upstream(_)), "{err}");
    assert!(err.to_string().contains(&reference), "{err}");
    assert!(!err.is_client_error());
    assert_eq!(OrchError::from(err).status(), 502, "an upstream error");

    // A registry that accepts connections and never answers hits the read timeout.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hang_addr = listener.local_addr().unwrap();
    let _hold = std::thread::spawn(move || {
        let conns: Vec<_> = listener.incoming().take(2).collect();
        std::thread::sleep(Duration::from_secs(10));
        drop(conns);
    });
    let (_s2, impatient) = new_store(
        "hang",
        ImageOptions {
            read_timeout: Duration::from_secs(1),
            ..ImageOptions::default()
        },
    );
    let started = Instant::now();
    let err = impatient
        .prepare_rootfs(&format!("{hang_addr}/team/app:v1"), 64)
        .unwrap_err();
    assert!(matches!(err, ImageError::Upstream(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(cache_files(&scratch.0.join("images")).is_empty());
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn run_ms(cmd: &mut Command) -> u64 {
    let started = Instant::now();
    let out = cmd.output().expect("command runs");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    started.elapsed().as_millis() as u64
}

/// A ~100 MB image of two gzip layers (busybox; 100 MB of random bytes) pushed as
/// `bench/big:latest`: its reference and the size of its layers' tars.
fn push_bench_image(reg: &TestRegistry) -> (String, usize) {
    let mut data = vec![0u8; 100 << 20];
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for chunk in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let busybox = fs::read("/bin/busybox").expect("busybox-static is installed");
    let layers = vec![
        TestLayer {
            tar: layer(|b| {
                b.dir("bin", 0o755)
                    .file("bin/busybox", 0o755, &busybox)
                    .symlink("bin/sh", "busybox")
                    .dir("tmp", 0o1777);
            }),
            gzip: true,
        },
        TestLayer {
            tar: layer(|b| {
                b.dir("data", 0o755).file("data/random", 0o644, &data);
            }),
            gzip: true,
        },
    ];
    drop(data);
    let img = reg.push_image("bench/big", "amd64", "/", &layers, false);
    reg.tag("bench/big", "latest", &img);
    let size = layers.iter().map(|l| l.tar.len()).sum();
    (format!("{}/bench/big:latest", reg.addr), size)
}

/// agentenv from a fresh store: the cold prepare's phases, then a cache hit (µs).
fn time_agentenv(reference: &str, size_mb: u32) -> (PhaseTimings, u64) {
    let (_scratch, store) = new_store("bench", ImageOptions::default());
    store.prepare_rootfs(reference, size_mb).unwrap();
    let cold = store.last_timings();
    let started = Instant::now();
    store.prepare_rootfs(reference, size_mb).unwrap();
    let hit = started.elapsed().as_micros() as u64;
    assert!(store.last_timings().cache_hit);
    (cold, hit)
}

/// The floor: `skopeo copy` + `tar -x` of each layer + `mkfs.ext4 -d` of the same image,
/// each step's ms.
fn time_skopeo_tar_mkfs(reference: &str, size_mb: u32) -> [u64; 3] {
    let dir = temp_dir("bench-skopeo");
    let layout = dir.join("layout");
    let copy = run_ms(
        Command::new("skopeo")
            .args(["copy", "--quiet", "--src-tls-verify=false"])
            .arg(format!("docker://{reference}"))
            .arg(format!("oci:{}:latest", layout.display())),
    );
    let started = Instant::now();
    let rootfs = dir.join("rootfs");
    fs::create_dir_all(&rootfs).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(layout.join("index.json")).unwrap()).unwrap();
    let blob = |d: &str| layout.join("blobs/sha256").join(&d[7..]);
    let manifest: serde_json::Value = serde_json::from_slice(
        &fs::read(blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    for l in manifest["layers"].as_array().unwrap() {
        run_ms(
            Command::new("tar")
                .arg("-xzf")
                .arg(blob(l["digest"].as_str().unwrap()))
                .arg("-C")
                .arg(&rootfs),
        );
    }
    let unpack = started.elapsed().as_millis() as u64;
    let mkfs = run_ms(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-b",
                "4096",
                "-I",
                "256",
                "-E",
                "lazy_journal_init=1",
                "-d",
            ])
            .arg(&rootfs)
            .arg(dir.join("disk.ext4"))
            .arg(format!("{size_mb}M")),
    );
    let _ = fs::remove_dir_all(&dir);
    [copy, unpack, mkfs]
}

/// Prints the medians as the table in docs/performance.md.
fn print_bench_table(image_mb: usize, cold: &[PhaseTimings], hit: &mut [u64], floor: &[[u64; 3]]) {
    let col = |f: fn(&PhaseTimings) -> u64| median(&mut cold.iter().map(f).collect::<Vec<_>>());
    let (resolve, download, unpack, mkfs, total) = (
        col(|t| t.resolve_ms),
        col(|t| t.download_ms),
        col(|t| t.unpack_ms),
        col(|t| t.mkfs_ms),
        col(|t| t.total_ms),
    );
    let sk = |i: usize| median(&mut floor.iter().map(|f| f[i]).collect::<Vec<_>>());
    let sk_total = median(&mut floor.iter().map(|f| f.iter().sum()).collect::<Vec<_>>());
    let hit_ms = median(hit) as f64 / 1000.0;
    println!();
    println!(
        "image phase, ~{image_mb} MB image (2 gzip layers), {} runs, medians in ms",
        cold.len()
    );
    println!("| | fetch | unpack | mkfs | total |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| agentenv cold (resolve {resolve} + download) | {} | {unpack} | {mkfs} | {total} |",
        resolve + download
    );
    println!(
        "| skopeo copy + tar -x + mkfs.ext4 -d | {} | {} | {} | {sk_total} |",
        sk(0),
        sk(1),
        sk(2)
    );
    println!("| agentenv cache hit | | | | {hit_ms:.1} |");
    println!(
        "cold / floor = {:.2} (goal <= 1.2); cache hit = {hit_ms:.1} ms (goal <= 50)",
        total as f64 / sk_total as f64
    );
}

/// The image phase for a ~100 MB image from a local registry: agentenv cold (download,
/// unpack, mkfs) and cache hit, beside `skopeo copy` + `tar -x` + `mkfs.ext4 -d` of the
/// same image. Run by scripts/bench-images (`AENV_BENCH_RUNS`, default 5).
#[test]
#[ignore = "benchmark: run by scripts/bench-images"]
fn bench_images_agentenv_cold_and_cached_beside_skopeo_tar_and_mkfs() {
    require_registry();
    assert!(
        Path::new("/usr/bin/skopeo").is_file(),
        "skopeo is not installed (run scripts/setup.sh)"
    );
    let runs: usize = std::env::var("AENV_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let reg = TestRegistry::start(Auth::Anonymous);
    let (reference, image_bytes) = push_bench_image(&reg);
    let size_mb = 1024;
    let (mut cold, mut hit, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (timings, hit_us) = time_agentenv(&reference, size_mb);
        cold.push(timings);
        hit.push(hit_us);
        floor.push(time_skopeo_tar_mkfs(&reference, size_mb));
    }
    print_bench_table(image_bytes >> 20, &cold, &mut hit, &floor);
}
