//! The agentenv server binary.

use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: agentenv serve [--config PATH]
       agentenv build-base-image --out DIR [--busybox PATH]
       agentenv --version";

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
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
            match agentenv::image::build_busybox_layout(&busybox, &out) {
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
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
