//! Host requirements checked at startup (docs/operations.md §2): each missing one is reported on
//! one line that names it and how to fix it.

use crate::config::Config;
use std::path::Path;
use std::process::{Command, Stdio};

/// Every unmet requirement, as one line each. Empty when the host is ready.
pub fn check(config: &Config) -> Vec<String> {
    let mut problems = Vec::new();
    if !crate::sys::fs::is_root() {
        problems.push(
            "not running as root: agentenv needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) for network namespaces; run it with sudo".to_string(),
        );
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .is_err()
    {
        problems.push(
            "/dev/net/tun cannot be opened: load the tun module (modprobe tun) or run as root"
                .to_string(),
        );
    }
    match Command::new("nft")
        .args(["list", "tables"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => {}
        Ok(_) => problems.push(
            "nftables is not usable (`nft list tables` failed): the kernel needs nf_tables; run as root".to_string(),
        ),
        Err(_) => problems.push("nft not found: install nftables (scripts/setup.sh does)".to_string()),
    }
    if crate::util::find_in_path(&config.vm.qemu_binary).is_none() {
        problems.push(format!(
            "{} not found: install QEMU >= 10 (scripts/setup.sh does), or set vm.qemu_binary",
            config.vm.qemu_binary.display()
        ));
    }
    let assets = &config.vm.assets_dir;
    if !assets.join("vmlinuz").is_file() && !assets.join("vmlinux").is_file() {
        problems.push(format!(
            "guest kernel missing in {}: run scripts/setup.sh (or set vm.assets_dir)",
            assets.display()
        ));
    }
    if !assets.join("initramfs.img").is_file() {
        problems.push(format!(
            "{} missing: run scripts/setup.sh to build the guest agent's initramfs",
            assets.join("initramfs.img").display()
        ));
    }
    if crate::util::find_in_path(Path::new("mkfs.ext4")).is_none() {
        problems.push("mkfs.ext4 not found: install e2fsprogs".to_string());
    }
    if crate::util::find_in_path(Path::new("qemu-img")).is_none() {
        problems.push("qemu-img not found: install qemu-utils".to_string());
    }
    problems
}
