//! Another process's memory, seen from the host: its mappings (`/proc/<pid>/maps`), the
//! state of each page of a mapping (`/proc/<pid>/pagemap`), and copying bytes out of and
//! into it (`process_vm_readv` / `process_vm_writev`).
//!
//! Used on QEMU processes the server started (children, confined, non-dumpable after their
//! uid change): the server, root with `CAP_SYS_PTRACE`, passes the kernel's ptrace access
//! check for them. Writing into a private file mapping breaks copy-on-write, exactly like a
//! write by the process itself.

use super::{SysError, SysResult};
use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;

/// pagemap entry bit: the page is present in RAM.
pub const PM_PRESENT: u64 = 1 << 63;
/// pagemap entry bit: the page is swapped out.
pub const PM_SWAPPED: u64 = 1 << 62;
/// pagemap entry bit: the page is a file page (page cache) or shared anonymous memory.
pub const PM_FILE: u64 = 1 << 61;
/// Size of one pagemap entry.
const PAGEMAP_ENTRY: u64 = 8;
/// Most iovecs one `process_vm_*` call takes (`UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// Offset into the mapped file.
    pub offset: u64,
    pub dev_major: u32,
    pub dev_minor: u32,
    /// The mapped file's inode; 0 for anonymous memory.
    pub inode: u64,
    /// `r`, `w`, `x`, `p`/`s`.
    pub perms: String,
}

impl Mapping {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Whether it maps the file with device number `dev` (as in `st_dev`) and inode `ino`.
    pub fn maps_file(&self, dev: u64, ino: u64) -> bool {
        let (major, minor) = dev_major_minor(dev);
        self.inode == ino && self.dev_major == major && self.dev_minor == minor
    }
}

/// glibc's split of a `dev_t` into major and minor numbers.
/// The proportional set size of process `pid` (KiB, `/proc/<pid>/smaps_rollup`);
/// `None` when unreadable.
pub fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = text.lines().find(|l| l.starts_with("Pss:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

pub fn dev_major_minor(dev: u64) -> (u32, u32) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// Parses one line of `/proc/<pid>/maps`:
/// `start-end perms offset major:minor inode [path]` (numbers in hex except the inode).
pub fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.to_owned();
    let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
    let (major, minor) = fields.next()?.split_once(':')?;
    let inode = fields.next()?.parse().ok()?;
    let mapping = Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset,
        dev_major: u32::from_str_radix(major, 16).ok()?,
        dev_minor: u32::from_str_radix(minor, 16).ok()?,
        inode,
        perms,
    };
    (mapping.start <= mapping.end).then_some(mapping)
}

/// The mappings of process `pid`.
pub fn mappings(pid: u32) -> SysResult<Vec<Mapping>> {
    let path = format!("/proc/{pid}/maps");
    let text = std::fs::read_to_string(&path).map_err(|e| SysError::from_io(path, e))?;
    Ok(text.lines().filter_map(parse_maps_line).collect())
}

/// The pagemap entries of `pages` pages of process `pid` from virtual address `start`
/// (page aligned): one u64 per page, see [`PM_PRESENT`], [`PM_SWAPPED`], [`PM_FILE`].
pub fn pagemap(pid: u32, start: u64, pages: usize, page_size: u64) -> SysResult<Vec<u64>> {
    let path = format!("/proc/{pid}/pagemap");
    let file = File::open(&path).map_err(|e| SysError::from_io(path.clone(), e))?;
    let mut bytes = vec![0u8; pages * PAGEMAP_ENTRY as usize];
    file.read_exact_at(&mut bytes, start / page_size * PAGEMAP_ENTRY)
        .map_err(|e| SysError::from_io(format!("read {path}"), e))?;
    Ok(bytes
        .chunks_exact(PAGEMAP_ENTRY as usize)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// A range of another process's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRange {
    pub addr: u64,
    pub len: usize,
}

/// Copies the bytes of `remote` (in order) out of process `pid` into `local`, which must
/// be exactly as long as the ranges together.
pub fn read_remote(pid: u32, remote: &[RemoteRange], local: &mut [u8]) -> SysResult<()> {
    transfer(pid, remote, local.len(), |done, iov_remote| {
        let mut local_iov = [IoSliceMut::new(&mut local[done..])];
        // SAFETY: the local iovec is one valid, writable slice of our own memory that lives
        // for the call; the remote iovecs only describe addresses in the other process,
        // which the kernel checks (EFAULT) and never dereferences in ours.
        unsafe {
            libc::process_vm_readv(
                pid as libc::pid_t,
                local_iov.as_mut_ptr().cast::<libc::iovec>(),
                1,
                iov_remote.as_ptr(),
                iov_remote.len() as libc::c_ulong,
                0,
            )
        }
    })
}

/// Copies `local` into the ranges `remote` (in order) of process `pid`; `local` must be
/// exactly as long as the ranges together.
pub fn write_remote(pid: u32, remote: &[RemoteRange], local: &[u8]) -> SysResult<()> {
    transfer(pid, remote, local.len(), |done, iov_remote| {
        let local_iov = [IoSlice::new(&local[done..])];
        // SAFETY: the local iovec is one valid, readable slice of our own memory that lives
        // for the call (IoSlice is ABI-compatible with iovec); the remote iovecs only
        // describe addresses in the other process, which the kernel checks (EFAULT).
        unsafe {
            libc::process_vm_writev(
                pid as libc::pid_t,
                local_iov.as_ptr().cast::<libc::iovec>(),
                1,
                iov_remote.as_ptr(),
                iov_remote.len() as libc::c_ulong,
                0,
            )
        }
    })
}

/// Drives `call(bytes done, remote iovecs still to do)` until every byte moved: the
/// kernel moves at most [`IOV_MAX`] remote iovecs per call and may stop early.
fn transfer(
    pid: u32,
    remote: &[RemoteRange],
    local_len: usize,
    mut call: impl FnMut(usize, &[libc::iovec]) -> isize,
) -> SysResult<()> {
    let total: usize = remote.iter().map(|r| r.len).sum();
    if total != local_len {
        return Err(SysError::from_errno(
            format!("process_vm pid {pid}: {local_len} local bytes for {total} remote bytes"),
            libc::EINVAL,
        ));
    }
    let mut iovs: Vec<libc::iovec> = remote
        .iter()
        .filter(|r| r.len > 0)
        .map(|r| libc::iovec {
            iov_base: r.addr as usize as *mut libc::c_void,
            iov_len: r.len,
        })
        .collect();
    let (mut first, mut done) = (0usize, 0usize);
    while first < iovs.len() {
        let end = (first + IOV_MAX).min(iovs.len());
        let moved = call(done, &iovs[first..end]);
        if moved < 0 {
            return Err(SysError::last(format!("process_vm pid {pid}")));
        }
        if moved == 0 {
            return Err(SysError::from_errno(
                format!("process_vm pid {pid}: no progress at byte {done} of {total}"),
                libc::EFAULT,
            ));
        }
        let mut moved = moved as usize;
        done += moved;
        // Skip the iovecs done; shorten a partly done one.
        while moved > 0 {
            let iov = &mut iovs[first];
            if moved >= iov.iov_len {
                moved -= iov.iov_len;
                first += 1;
            } else {
                iov.iov_base = (iov.iov_base as usize + moved) as *mut libc::c_void;
                iov.iov_len -= moved;
                moved = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines() {
        let m = parse_maps_line(
            "7f2a40000000-7f2a50000000 rw-p 00000000 fd:01 1311244                    /vm/memory",
        )
        .unwrap();
        assert_eq!(m.start, 0x7f2a40000000);
        assert_eq!(m.len(), 256 << 20);
        assert_eq!((m.dev_major, m.dev_minor, m.inode), (0xfd, 1, 1311244));
        assert_eq!(m.perms, "rw-p");
        let anon = parse_maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0 ").unwrap();
        assert_eq!(anon.inode, 0);
        assert!(parse_maps_line("").is_none());
        assert!(parse_maps_line("zz-1 rw-p 0 0:0 0").is_none());
        assert!(parse_maps_line("2000-1000 rw-p 0 0:0 0").is_none());
    }

    #[test]
    fn dev_numbers_match_stat() {
        use std::os::unix::fs::MetadataExt;
        let exe = std::env::current_exe().unwrap();
        let meta = std::fs::metadata(&exe).unwrap();
        let mine = mappings(std::process::id()).unwrap();
        assert!(
            mine.iter().any(|m| m.maps_file(meta.dev(), meta.ino())),
            "the test binary's own mapping is found by dev+inode"
        );
        assert_eq!(dev_major_minor(0xfd01), (0xfd, 1));
        assert_eq!(dev_major_minor((0x123 << 8) | 0x45), (0x123, 0x45));
    }

    #[test]
    fn copies_through_process_vm_calls() {
        // Our own process: the same calls, without needing a second one.
        let pid = std::process::id();
        let source: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        let ranges = [
            RemoteRange {
                addr: source.as_ptr() as u64 + 4096,
                len: 4096,
            },
            RemoteRange {
                addr: source.as_ptr() as u64,
                len: 100,
            },
        ];
        let mut out = vec![0u8; 4196];
        read_remote(pid, &ranges, &mut out).unwrap();
        assert_eq!(&out[..4096], &source[4096..8192]);
        assert_eq!(&out[4096..], &source[..100]);
        let mut target = vec![0u8; 8192];
        let into = [RemoteRange {
            addr: target.as_mut_ptr() as u64 + 10,
            len: 4196,
        }];
        write_remote(pid, &into, &out).unwrap();
        assert_eq!(&target[10..4206], &out[..]);
        assert!(read_remote(pid, &ranges, &mut [0u8; 3]).is_err());
        let page = 4096;
        let entries = pagemap(pid, source.as_ptr() as u64 / page * page, 1, page).unwrap();
        assert_ne!(entries[0] & PM_PRESENT, 0, "a page just read is present");
        assert_eq!(entries[0] & PM_FILE, 0, "heap memory is anonymous");
    }
}
