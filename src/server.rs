//! `agentenv serve`: configuration → host checks → host lock → state dir lock → API key →
//! network reclaim → orchestrator → HTTP API, then a graceful shutdown on SIGTERM/SIGINT.

use crate::api::{ApiServer, Context};
use crate::config::{self, Config};
use crate::hooks::HookClient;
use crate::net::SlotManager;
use crate::orchestrator::{Orchestrator, Request};
use crate::store::layout::StateLayout;
use crate::{preflight, store, sys};
use std::path::Path;
use std::sync::Arc;

/// The host's runtime dir: the server lock, and the VMs' short socket dirs.
pub const RUNTIME_DIR: &str = "/run/agentenv";
/// Held by the one server that owns this host's network (slot namespaces, `aenv-*` links,
/// the `inet agentenv` table), whatever its state dir: a second server would reclaim the
/// first one's network at startup. Holds the owner's pid.
pub const HOST_LOCK: &str = "/run/agentenv/server.lock";

/// A startup failure: one line for the operator, and the process exit code.
pub struct StartupError(pub String);

impl<E: std::fmt::Display> From<E> for StartupError {
    fn from(e: E) -> StartupError {
        StartupError(e.to_string())
    }
}

pub fn serve(config_path: Option<&Path>) -> Result<(), StartupError> {
    sys::signals::block_termination_signals()?;
    let path = config::config_path(config_path);
    let config = Config::load(path.as_deref())?;
    match &path {
        Some(p) => log::info!("op=config source={}", p.display()),
        None => log::info!("op=config source=embedded-defaults"),
    }
    if let Some(node) = config.cluster.node() {
        crate::cluster::id::set_node(node)?;
        log::info!("op=config cluster.node={node}");
    }
    let problems = preflight::check(&config);
    if !problems.is_empty() {
        return Err(StartupError(problems.join("\n")));
    }
    let _host_lock = lock_host()?;
    match sys::process::raise_open_files_limit(1 << 20) {
        Ok((old, new)) if new > old => log::info!("op=startup open_files_limit={old}->{new}"),
        Ok((_, new)) => log::info!("op=startup open_files_limit={new}"),
        Err(e) => log::warn!("op=startup open_files_limit_error=\"{e}\""),
    }
    crate::vm::qemu::remove_stale_socket_dirs();
    let state_dir = &config.server.state_dir;
    // Everything this process and its children (QEMU, qemu-img, mkfs) create is private:
    // disks, captures and RAM files hold guest data.
    sys::fs::set_umask(0o077);
    store::ensure_private_dir(state_dir)?;
    let lock_path = StateLayout::new(state_dir).server_lock();
    let _lock = sys::fs::try_lock_exclusive(&lock_path)?.ok_or_else(|| {
        StartupError(format!(
            "another agentenv holds {}; stop it first (one server owns a host's slots)",
            lock_path.display()
        ))
    })?;
    match store::tighten_tree(state_dir, Some(&config.vm.assets_dir)) {
        Ok(0) => {}
        Ok(n) => log::warn!(
            "op=startup state_dir={} modes_tightened={n}",
            state_dir.display()
        ),
        Err(e) => {
            return Err(StartupError(format!(
                "cannot make the state dir private: {e}"
            )))
        }
    }
    let api_key = resolve_api_key(&config)?;
    let accel = crate::vm::detect_accel(config.vm.accel)?;
    log::info!("op=startup accel={accel:?}");
    if !matches!(accel, crate::vm::Accel::Kvm) {
        log::warn!(
            "op=startup accel=tcg warning=\"no KVM on this host: guests run under QEMU's TCG, \
             which QEMU does not treat as a security boundary (docs/security.md); run \
             untrusted guests on a host with KVM\""
        );
    }
    let hooks = HookClient::start(
        &config.custom_extension,
        StateLayout::new(state_dir).journal(),
    )?;
    // Slots recorded for open instances stay until their recovery stop's first attempt,
    // so the extension can still enter the namespace (network.md §6.3, custom-extension.md §9.3).
    let kept = hooks.recovering_slots();
    let slots = SlotManager::start(&config.network, &kept)?;
    hooks.recover();
    reclaim_after_recovery(hooks.clone(), slots.clone(), kept);
    kill_leftover_vms(&config.server.state_dir);
    let server_config = config.server.clone();
    let shutdown_timeout = config.server.shutdown_timeout_secs;
    let build_base = config.templates.build_base;
    let orchestrator = Arc::new(Orchestrator::start(config, slots, hooks, accel));
    if build_base {
        orchestrator.handle(Request::EnsureBaseTemplate)?;
    }
    let cluster = crate::cluster::Cluster::start(&orchestrator.config().cluster, &api_key)
        .map_err(|e| StartupError(format!("cannot start the cluster-peers thread: {e}")))?;
    let api = ApiServer::start(
        &server_config,
        Context::new(
            orchestrator.clone(),
            api_key,
            std::env::var("AENV_TEST_FAULTS").is_ok_and(|v| v == "1"),
            cluster,
        ),
    )
    .map_err(StartupError)?;
    log::info!("op=startup result=ready listen={}", api.local_addr());

    let sig = sys::signals::wait_for_termination()?;
    log::info!("op=shutdown signal={sig}");
    let clean = orchestrator.handle(Request::Shutdown)?.into_shut_down()?;
    api.stop();
    if !clean {
        return Err(StartupError(format!(
            "shutdown did not finish within {}s (server.shutdown_timeout_secs)",
            shutdown_timeout
        )));
    }
    log::info!("op=shutdown result=done");
    Ok(())
}

/// Takes [`HOST_LOCK`], or says which server holds it.
fn lock_host() -> Result<sys::fs::LockFile, StartupError> {
    let path = Path::new(HOST_LOCK);
    std::fs::create_dir_all(RUNTIME_DIR)
        .map_err(|e| StartupError(format!("cannot create {RUNTIME_DIR}: {e}")))?;
    match sys::fs::try_lock_exclusive(path)? {
        Some(lock) => {
            lock.set_contents(&format!("{}\n", std::process::id()))?;
            Ok(lock)
        }
        None => {
            // The holder writes its pid; one that has not yet (or a test) is unnamed.
            let holder = std::fs::read_to_string(path).unwrap_or_default();
            let holder = match holder.trim().parse::<u32>() {
                Ok(pid) if Path::new(&format!("/proc/{pid}")).exists() => format!(" (pid {pid})"),
                _ => String::new(),
            };
            Err(StartupError(format!(
                "another agentenv server runs on this host{holder} and holds {HOST_LOCK}: one \
                 server owns a host's network slots whatever its state dir; stop it first"
            )))
        }
    }
}

/// No VM outlives the server (custom-extension.md §9.3): QEMU processes are bound to their supervisor
/// thread, and any process still running from an earlier run of this state dir is killed.
fn kill_leftover_vms(state_dir: &Path) {
    let marker = state_dir.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let mut args = cmdline.split('\0');
        let is_qemu = args.next().is_some_and(|a| a.contains("qemu-system"));
        if is_qemu && cmdline.contains(&format!("{marker}/")) {
            log::warn!(
                "op=recover pid={pid} result=killed reason=\"leftover VM of this state dir\""
            );
            if let Err(e) = sys::process::kill_pid(pid) {
                log::warn!("op=recover pid={pid} error=\"{e}\"");
            }
        }
    }
}

/// Reclaims the slots kept for recovery stops once their first attempts are done, in the
/// background: the API serves meanwhile (custom-extension.md §9.4).
fn reclaim_after_recovery(hooks: Arc<HookClient>, slots: Arc<SlotManager>, kept: Vec<u32>) {
    if kept.is_empty() {
        return;
    }
    std::thread::Builder::new()
        .name("recovery".into())
        .spawn(move || {
            while !hooks.wait_recovery_first_attempts(std::time::Duration::from_secs(60)) {}
            for index in kept {
                if let Err(e) = slots.reclaim_kept(index) {
                    log::warn!("op=reclaim slot={index} error=\"{e}\"");
                }
            }
        })
        .expect("spawn recovery thread");
}

/// api.md §1.2: env, then config, then `<state_dir>/api-key` (generated, mode 0600).
fn resolve_api_key(config: &Config) -> Result<String, StartupError> {
    if let Some(key) = &config.server.api_key {
        return Ok(key.clone());
    }
    let path = StateLayout::new(&config.server.state_dir).api_key();
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let key = text.trim().to_string();
            config::validate_api_key(&key)
                .map_err(|m| StartupError(format!("{}: {m}", path.display())))?;
            log::info!("op=api_key source={}", path.display());
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut bytes = [0u8; 24];
            sys::fs::random_bytes(&mut bytes)?;
            let key = format!("aenv_{}", crate::util::hex(&bytes));
            store::write_atomic(&path, format!("{key}\n").as_bytes(), 0o600)?;
            log::info!("op=api_key source={} generated=true", path.display());
            Ok(key)
        }
        Err(e) => Err(StartupError(format!("cannot read {}: {e}", path.display()))),
    }
}
