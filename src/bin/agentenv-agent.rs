//! The in-guest agent. As PID 1 it boots the VM and serves the host (see
//! `agentenv::guest::boot`). Otherwise it serves the protocol for testing:
//!
//! ```text
//! agentenv-agent --stdio            serve on stdin/stdout until EOF
//! agentenv-agent --listen <socket>  serve each unix-socket connection in turn
//! agentenv-agent --envd <addr:port>  serve envd over HTTP (prints the bound address)
//! ```

use std::os::unix::net::UnixListener;
use std::process::ExitCode;

use agentenv::guest::boot;
use agentenv::guest::envd::{self, users::Accounts, Envd};
use agentenv::guest::reaper::Reaper;
use agentenv::guest::{AgentServer, OnEof};

fn usage() -> ExitCode {
    eprintln!(
        "usage: agentenv-agent [--stdio | --listen <unix-socket-path> | --envd <addr:port>] \
         (PID 1: no arguments)"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    if std::process::id() == 1 {
        boot::run_pid1();
    }
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["--stdio"] => {
            let server =
                AgentServer::new(Reaper::own_children(), false, Box::new(std::io::stdout()));
            server.serve(std::io::stdin(), OnEof::Stop);
            ExitCode::SUCCESS
        }
        ["--listen", path] => {
            let _ = std::fs::remove_file(path);
            let listener = match UnixListener::bind(path) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("agentenv-agent: cannot listen on {path}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let reaper = Reaper::own_children();
            for conn in listener.incoming() {
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("agentenv-agent: accept failed: {e}");
                        continue;
                    }
                };
                let writer = match conn.try_clone() {
                    Ok(w) => w,
                    Err(e) => {
                        eprintln!("agentenv-agent: {e}");
                        continue;
                    }
                };
                AgentServer::new(reaper.clone(), false, Box::new(writer)).serve(conn, OnEof::Stop);
            }
            ExitCode::SUCCESS
        }
        ["--envd", addr] => {
            let server = match tiny_http::Server::http(addr) {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("agentenv-agent: cannot listen on {addr}: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match server.server_addr().to_ip() {
                Some(bound) => println!("envd listening on {bound}"),
                None => println!("envd listening on {addr}"),
            }
            let envd = Envd::new(Reaper::own_children(), Accounts::default());
            envd::serve(server, envd);
            ExitCode::SUCCESS
        }
        _ => usage(),
    }
}
