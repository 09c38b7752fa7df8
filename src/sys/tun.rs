//! Persistent tap devices through `/dev/net/tun`.

use super::{check, SysError, SysResult};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// `struct ifreq` with the flags member of its union; 40 bytes like the kernel's.
#[repr(C)]
struct IfReqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Opens `/dev/net/tun` and attaches it to the tap `name` (created if missing) with
/// `flags`.
fn attach(name: &str, flags: libc::c_short) -> SysResult<std::fs::File> {
    if name.len() >= libc::IFNAMSIZ {
        return Err(SysError::from_errno(
            format!("tap name {name:?} too long"),
            libc::EINVAL,
        ));
    }
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(|e| SysError::from_io("open /dev/net/tun (is the tun driver available?)", e))?;
    let mut req = IfReqFlags {
        name: [0; libc::IFNAMSIZ],
        flags,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` has the layout and
    // size of; the fd is open for the duration of the call.
    let ret = unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, &mut req as *mut IfReqFlags) };
    check(ret, || format!("TUNSETIFF {name}"))?;
    Ok(tun)
}

/// Creates the persistent tap `name` (`IFF_TAP|IFF_NO_PI`) in the calling thread's network
/// namespace. The device outlives the descriptor and goes away with its namespace.
pub fn create_persistent_tap(name: &str) -> SysResult<()> {
    let tun = attach(name, IFF_TAP | IFF_NO_PI)?;
    // SAFETY: TUNSETPERSIST takes an integer argument by value.
    let ret = unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETPERSIST as _, 1 as libc::c_ulong) };
    check(ret, || format!("TUNSETPERSIST {name}"))?;
    Ok(())
}

/// Opens the existing tap `name` in the calling thread's network namespace as QEMU would
/// (`IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`), for handing the descriptor to an unprivileged QEMU
/// (`-netdev tap,fd=N`), which may not open it itself.
pub fn open_tap(name: &str) -> SysResult<std::fs::File> {
    const IFF_VNET_HDR: libc::c_short = 0x4000;
    attach(name, IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
}
