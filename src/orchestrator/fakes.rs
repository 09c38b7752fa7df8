//! Fakes of the host sides ([`super::sides`]) and sample values for the orchestrator's
//! unit tests: failure paths run without root, QEMU or an extension.

use super::sandbox::{SandboxInfo, SandboxState};
use super::settings::{Resources, SandboxSettings};

/// Settings of a small sandbox.
pub(crate) fn settings() -> SandboxSettings {
    SandboxSettings {
        template_id: "t".into(),
        alias: None,
        resources: Resources {
            cpu_count: 1,
            memory_mb: 128,
            disk_size_mb: 1024,
        },
        timeout_secs: 1,
        auto_pause: true,
        metadata: Default::default(),
        env_vars: Default::default(),
        image_env: vec![],
        internet_access: false,
        custom_extension_params: serde_json::json!({}),
    }
}

/// The description of sandbox `id` in `state`.
pub(crate) fn info(id: &str, state: SandboxState) -> SandboxInfo {
    let mut info = SandboxInfo::new(
        id.into(),
        settings(),
        std::net::Ipv4Addr::LOCALHOST,
        "/x".into(),
    );
    info.state = state;
    info
}

/// A capture record whose files do not exist.
pub(crate) fn capture() -> crate::vm::CaptureRecord {
    crate::vm::CaptureRecord {
        format: 1,
        captured_at_unix_ms: 0,
        kernel: "/assets/vmlinuz".into(),
        initramfs: "/assets/initramfs.img".into(),
        kernel_cmdline: String::new(),
        cpu_count: 1,
        memory_mb: 128,
        accel: "tcg".into(),
        nic: true,
        state_file: "/nowhere/state.bin".into(),
        state_bytes: 0,
        memory_file: None,
        disk: "/nowhere/disk.qcow2".into(),
        disk_layers: vec!["/nowhere/disk.qcow2".into()],
        disk_base: None,
        disk_virtual_bytes: 0,
        disk_allocated_bytes: 0,
        disk_frozen: false,
    }
}
