//! The agentenv binary: the server (`serve`), its maintenance commands, and the
//! command-line client (`sandbox`, `template`, `snapshot`: src/cli).

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: agentenv serve [--config PATH]
       agentenv build-base-image --out DIR [--busybox PATH] [--bash PATH]
       agentenv images [--config PATH]
       agentenv --version
       agentenv [--url URL] [--api-key KEY] [--json] sandbox|template|snapshot ...
                (agentenv --help: the client's commands)";

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    // The client's commands may start with its global options (`--url X sandbox ls`).
    let client_command =
        first_command(&args).is_some_and(|a| matches!(a, "sandbox" | "template" | "snapshot"));
    if client_command || matches!(args.first().map(String::as_str), Some("--help" | "-h")) {
        return ExitCode::from(agentenv::cli::run(args));
    }
    match args.first().map(String::as_str) {
        Some("--version") | Some("-V") => {
            println!("agentenv {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Some("serve") => match agentenv::server::serve(flag("--config").as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("agentenv: {}", e.0);
                ExitCode::FAILURE
            }
        },
        Some("build-base-image") => {
            let Some(out) = flag("--out") else {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            };
            let busybox = flag("--busybox").unwrap_or_else(|| PathBuf::from("/bin/busybox"));
            let bash = flag("--bash");
            match agentenv::image::build_busybox_layout(&busybox, bash.as_deref(), &out) {
                Ok(()) => {
                    println!("built-in base image written to {}", out.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("agentenv: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("images") => match list_images(flag("--config").as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("agentenv: {e}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// The first word that is neither an option nor the value of one.
fn first_command(args: &[String]) -> Option<&str> {
    let mut words = args.iter().map(String::as_str);
    while let Some(w) = words.next() {
        match w {
            "--url" | "--api-key" | "--config" => {
                words.next();
            }
            w if w.starts_with('-') => {}
            w => return Some(w),
        }
    }
    None
}

/// Prints the image cache (pulled blobs and built base disks), most recently used first.
fn list_images(config: Option<&std::path::Path>) -> Result<(), String> {
    let config = agentenv::config::Config::load(config).map_err(|e| e.to_string())?;
    let dir = agentenv::store::layout::StateLayout::new(&config.server.state_dir).images();
    // Read-only: unlike ImageStore, this leaves a running server's downloads alone.
    let entries = agentenv::image::cache::BlobCache::new(dir.clone())
        .list()
        .map_err(|e| e.to_string())?;
    println!(
        "{:<10} {:<71} {:>8} {:>10} {:>8} IN USE",
        "KIND", "DIGEST", "DISK MB", "SIZE MB", "AGE"
    );
    let mut total = 0;
    for e in &entries {
        total += e.bytes;
        let kind = match e.kind {
            agentenv::image::EntryKind::Blob => "blob",
            agentenv::image::EntryKind::BaseDisk => "base-disk",
        };
        let age = e.last_used.elapsed().map(|d| d.as_secs()).unwrap_or(0);
        println!(
            "{kind:<10} {:<71} {:>8} {:>10.1} {:>8} {}",
            e.digest,
            e.size_mb
                .map(|s| s.to_string())
                .unwrap_or_else(|| "-".into()),
            e.bytes as f64 / 1048576.0,
            human_age(age),
            if e.in_use { "yes" } else { "no" }
        );
    }
    let cap = match config.images.cache_max_mb {
        0 => "no cap".to_string(),
        mb => format!("cap {mb} MiB"),
    };
    println!(
        "{} entries, {:.1} MiB in {} ({cap})",
        entries.len(),
        total as f64 / 1048576.0,
        dir.display()
    );
    Ok(())
}

fn human_age(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}
