//! Dirty-only pause and resume of a VM whose RAM is a template's RAM file mapped privately
//! (copy-on-write): a pause writes only the guest pages that changed since the template,
//! and a resume maps the template's file again and writes back only those pages.
//!
//! What changed since the template is exactly the set of pages of QEMU's RAM mapping that
//! are private copies now: the kernel made a copy when the guest (or a device on its
//! behalf) first wrote a page; pages only read still map the file's page cache. The host
//! reads that set from `/proc/<qemu>/pagemap` (present or swapped, and not a file page)
//! and copies those pages out with `process_vm_readv`.
//!
//! Pause ([`Vm::pause_dirty`]), with the vCPUs stopped:
//! 1. `stop`;
//! 2. QMP `xen-save-devices-state` (despite the name, QEMU's generic "every device, no
//!    RAM" save) into a scratch file;
//! 3. the private pages into `memory.pages` ([`PagesIndex`], then the pages);
//! 4. `quit`, while `state.bin` is made from the device state ([`stitch_state`]) and both
//!    files are fsync'd; then both are renamed into place.
//!
//! A device-only stream does not load as it is: it lacks the configuration section a
//! QEMU outside Xen requires, and it lacks the ROM and firmware blocks (BIOS, ACPI
//! tables), which a restoring QEMU leaves empty while an incoming migration is pending.
//! The template's own state file holds both, in front of its device sections:
//! [`stitch_state`] puts the paused VM's device sections in place of the template's. (QMP
//! `xen-load-devices-state` cannot load it after the template's state either: QEMU 10
//! aborts in its cleanup, which assumes an incoming migration is pending.)
//!
//! The record (format [`DIRTY_FORMAT`]) names the template's RAM file and state file
//! through hard links in the VM's run dir (`template-memory.ram`, `template-state.bin`),
//! so deleting the template never breaks a paused sandbox.
//!
//! Resume ([`Vm::load_dirty`]), before any guest code runs in the new QEMU (started with
//! `-incoming defer -S` over the template's RAM file, mapped privately as for any clone):
//! 1. the saved pages are written into QEMU's RAM mapping (`process_vm_writev`): they
//!    become private copies again, so the next pause still finds everything changed since
//!    the template, and paused state never forms chains;
//! 2. `migrate-incoming` of `state.bin` (after the RAM, since virtio devices read their
//!    rings from guest memory when they load). Its global state says "running" (that is
//!    what `xen-save-devices-state` records), hence `-S`: the VM waits `paused`.
//!
//! Nothing is written after the guest ran in that QEMU, so TCG's translated code never
//! sees memory change under it.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::capture::{CaptureRecord, CaptureStats, CAPTURE_BANDWIDTH, MIGRATION_CAPS};
use super::qemu::Vm;
use super::VmError;
use crate::sys::procmem::{self, Mapping, RemoteRange, PM_FILE, PM_PRESENT, PM_SWAPPED};

/// [`CaptureRecord::format`] of a dirty-only capture.
pub const DIRTY_FORMAT: u32 = 2;
/// The pages file's name inside a capture directory.
pub const PAGES_FILE: &str = "memory.pages";
/// Names of the template files' links in a VM's run dir.
const BASE_MEMORY_LINK: &str = "template-memory.ram";
const BASE_STATE_LINK: &str = "template-state.bin";
/// Guest pages are host pages (x86-64).
pub const PAGE_SIZE: u64 = 4096;
const MAGIC: &[u8; 8] = b"AENVPGS1";
/// magic, page size u32, reserved u32, RAM bytes u64, runs u64, data offset u64.
const HEADER_LEN: usize = 40;
const RUN_LEN: usize = 16;
/// How many bytes are copied per `process_vm_*` call and file write.
const CHUNK_BYTES: u64 = 4 << 20;
/// How long loading the state may take.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);

/// What a dirty-only capture holds besides the device state (`state_file`) and the
/// template's RAM file (`memory_file`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DirtyMemory {
    /// The template's own state file (a link to it): the next dirty pause after a resume
    /// takes the configuration and ROM blocks from it ([`stitch_state`]).
    pub base_state: PathBuf,
    /// The pages that differ from the template's RAM file ([`PagesIndex`] format).
    pub pages_file: PathBuf,
    /// How many pages it holds.
    pub pages: u64,
}

/// A run of consecutive pages, by page number within the RAM block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first: u64,
    pub pages: u64,
}

/// Whether a pagemap entry is a private copy: present or swapped, and not a page of the
/// mapped file.
fn is_private_copy(entry: u64) -> bool {
    entry & (PM_PRESENT | PM_SWAPPED) != 0 && entry & PM_FILE == 0
}

/// The private pages of a mapping, from its pagemap entries, as runs.
pub fn dirty_runs(entries: &[u64]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (i, _) in entries
        .iter()
        .enumerate()
        .filter(|(_, e)| is_private_copy(**e))
    {
        let i = i as u64;
        match runs.last_mut() {
            Some(run) if run.first + run.pages == i => run.pages += 1,
            _ => runs.push(Run { first: i, pages: 1 }),
        }
    }
    runs
}

/// `runs` cut into pieces of at most `max_pages` pages each, in order.
fn chunks(runs: &[Run], max_pages: u64) -> Vec<Vec<Run>> {
    let mut out: Vec<Vec<Run>> = Vec::new();
    let mut current: Vec<Run> = Vec::new();
    let mut room = max_pages;
    for run in runs {
        let mut run = *run;
        while run.pages > 0 {
            let take = run.pages.min(room);
            current.push(Run {
                first: run.first,
                pages: take,
            });
            run.first += take;
            run.pages -= take;
            room -= take;
            if room == 0 {
                out.push(std::mem::take(&mut current));
                room = max_pages;
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The head of a pages file: which pages it holds, where their data starts. The data is
/// the pages of every run, in order, from `data_offset` (page aligned) to the end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagesIndex {
    pub ram_bytes: u64,
    pub runs: Vec<Run>,
}

impl PagesIndex {
    pub fn pages(&self) -> u64 {
        self.runs.iter().map(|r| r.pages).sum()
    }

    pub fn data_offset(&self) -> u64 {
        let head = (HEADER_LEN + RUN_LEN * self.runs.len()) as u64;
        head.div_ceil(PAGE_SIZE) * PAGE_SIZE
    }

    /// The whole file's length.
    pub fn file_len(&self) -> u64 {
        self.data_offset() + self.pages() * PAGE_SIZE
    }

    /// Header and index, padded to `data_offset`.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data_offset() as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.ram_bytes.to_le_bytes());
        out.extend_from_slice(&(self.runs.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.data_offset().to_le_bytes());
        for run in &self.runs {
            out.extend_from_slice(&run.first.to_le_bytes());
            out.extend_from_slice(&run.pages.to_le_bytes());
        }
        out.resize(self.data_offset() as usize, 0);
        out
    }

    /// Reads and checks the index of a pages file of `file_len` bytes for a VM with
    /// `ram_bytes` of RAM: every run inside the RAM, in order, not overlapping, and the
    /// file exactly as long as its pages.
    pub fn read(file: &File, file_len: u64, ram_bytes: u64) -> Result<PagesIndex, String> {
        let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        let mut head = [0u8; HEADER_LEN];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| format!("cannot read its header: {e}"))?;
        if &head[..8] != MAGIC {
            return Err("it is not a pages file (bad magic)".into());
        }
        let page = u32::from_le_bytes(head[8..12].try_into().unwrap());
        if u64::from(page) != PAGE_SIZE {
            return Err(format!("its page size is {page}, not {PAGE_SIZE}"));
        }
        if u64_at(&head, 16) != ram_bytes {
            return Err(format!(
                "it was saved for {} bytes of RAM, the VM has {ram_bytes}",
                u64_at(&head, 16)
            ));
        }
        let count = u64_at(&head, 24);
        let ram_pages = ram_bytes / PAGE_SIZE;
        if count > ram_pages {
            return Err(format!("it claims {count} runs for {ram_pages} pages"));
        }
        let mut index = vec![0u8; count as usize * RUN_LEN];
        file.read_exact_at(&mut index, HEADER_LEN as u64)
            .map_err(|e| format!("cannot read its index: {e}"))?;
        let runs: Vec<Run> = index
            .chunks_exact(RUN_LEN)
            .map(|c| Run {
                first: u64_at(c, 0),
                pages: u64_at(c, 8),
            })
            .collect();
        let mut next_free = 0u64;
        for run in &runs {
            let end = run.first.saturating_add(run.pages);
            if run.pages == 0 || run.first < next_free || end > ram_pages {
                return Err(format!(
                    "run of {} pages at page {} is empty, out of order or outside the RAM",
                    run.pages, run.first
                ));
            }
            next_free = end;
        }
        let parsed = PagesIndex { ram_bytes, runs };
        if u64_at(&head, 32) != parsed.data_offset() || file_len != parsed.file_len() {
            return Err(format!(
                "it is {file_len} bytes with data at {}, expected {} with data at {}",
                u64_at(&head, 32),
                parsed.file_len(),
                parsed.data_offset()
            ));
        }
        Ok(parsed)
    }
}

/// What a dirty save or write-back moved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PagesStats {
    pub pages: u64,
    /// Finding the mapping and reading its pagemap.
    pub scan_ms: u64,
    /// Copying the pages.
    pub copy_ms: u64,
}

/// The mapping of `memory_file` (the whole file, `ram_bytes` long) in process `pid`:
/// found by device and inode, since QEMU sees the file under another path.
pub fn find_ram(pid: u32, memory_file: &Path, ram_bytes: u64) -> Result<Mapping, VmError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(memory_file)
        .map_err(|e| VmError::io(format!("cannot stat {}", memory_file.display()), e))?;
    let mappings = procmem::mappings(pid)
        .map_err(|e| VmError::io(format!("cannot read QEMU {pid}'s mappings"), e.source))?;
    let mut found = mappings
        .into_iter()
        .filter(|m| m.maps_file(meta.dev(), meta.ino()) && m.offset == 0 && m.len() == ram_bytes);
    match (found.next(), found.next()) {
        (Some(m), None) => Ok(m),
        (None, _) => Err(VmError::InvalidSpec(format!(
            "QEMU {pid} does not map {} as its RAM",
            memory_file.display()
        ))),
        (Some(_), Some(_)) => Err(VmError::InvalidSpec(format!(
            "QEMU {pid} maps {} more than once",
            memory_file.display()
        ))),
    }
}

fn ranges(base: u64, runs: &[Run]) -> Vec<RemoteRange> {
    runs.iter()
        .map(|r| RemoteRange {
            addr: base + r.first * PAGE_SIZE,
            len: (r.pages * PAGE_SIZE) as usize,
        })
        .collect()
}

/// Writes the private pages of QEMU `pid`'s mapping of `memory_file` into a new pages
/// file `out` (mode 0600). The VM must be stopped. What is copied is made durable while
/// the copy goes on ([`FlushAlong`]); the caller's fsync then waits for the last chunk
/// only (it may overlap QEMU's exit).
pub fn save_pages(
    pid: u32,
    memory_file: &Path,
    ram_bytes: u64,
    out: &Path,
) -> Result<(File, PagesIndex, PagesStats), VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let started = Instant::now();
    let ram = find_ram(pid, memory_file, ram_bytes)?;
    let entries = procmem::pagemap(pid, ram.start, (ram_bytes / PAGE_SIZE) as usize, PAGE_SIZE)
        .map_err(|e| VmError::io(format!("cannot read QEMU {pid}'s pagemap"), e.source))?;
    let index = PagesIndex {
        ram_bytes,
        runs: dirty_runs(&entries),
    };
    let scan_ms = started.elapsed().as_millis() as u64;
    let copying = Instant::now();
    let io = |e| VmError::io(format!("cannot write {}", out.display()), e);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(out)
        .map_err(io)?;
    (&file).write_all(&index.encode()).map_err(io)?;
    FlushAlong::run(&file, out, |flush| {
        let mut buf = Vec::new();
        let mut written = 0u64;
        for chunk in chunks(&index.runs, CHUNK_BYTES / PAGE_SIZE) {
            let len: u64 = chunk.iter().map(|r| r.pages * PAGE_SIZE).sum();
            buf.resize(len as usize, 0);
            procmem::read_remote(pid, &ranges(ram.start, &chunk), &mut buf)
                .map_err(|e| VmError::io(format!("cannot read QEMU {pid}'s RAM"), e.source))?;
            (&file).write_all(&buf).map_err(io)?;
            // The disk starts on each chunk while the next is copied.
            let done = written + index.data_offset();
            crate::sys::fs::start_writeback(&file, done, len)
                .map_err(|e| VmError::io(format!("cannot write {}", out.display()), e.source))?;
            flush.written().map_err(io)?;
            written += len;
        }
        Ok(())
    })?;
    let stats = PagesStats {
        pages: index.pages(),
        scan_ms,
        copy_ms: copying.elapsed().as_millis() as u64,
    };
    Ok((file, index, stats))
}

/// Makes a file durable while it is still being written: a thread fdatasyncs whatever
/// was written so far each time the writer says it wrote more (calls coalesce: one flush
/// runs, one more waits). On a disk whose cost is in the cache flush (a virtual disk:
/// the host writes the data out on the guest's flush, about 1 ms per MiB on the
/// development hosts) the flushes then run alongside the copy instead of all after it:
/// 40 MiB went from 65 ms (copy, then fsync) to 50 ms.
struct FlushAlong {
    /// Closed once the flusher stopped on an error: the writer stops too.
    wanted: crossbeam_channel::Sender<()>,
}

impl FlushAlong {
    /// Runs `write` with a flusher for `file` (at `path`); the first error of either is
    /// returned (a flush error is never lost: the kernel reports it to one fsync of this
    /// file only, and that may be the flusher's).
    fn run<T>(
        file: &File,
        path: &Path,
        write: impl FnOnce(&FlushAlong) -> Result<T, VmError>,
    ) -> Result<T, VmError> {
        let (wanted, asked) = crossbeam_channel::bounded::<()>(1);
        std::thread::scope(|s| {
            // `asked` goes with the thread: a flusher that stops closes the channel.
            let flusher = s.spawn(move || {
                for () in asked.iter() {
                    file.sync_data()
                        .map_err(|e| VmError::io(format!("cannot fsync {}", path.display()), e))?;
                }
                Ok(())
            });
            let written = write(&FlushAlong { wanted });
            let flushed = super::joined(flusher, "flusher");
            match (written, flushed) {
                (Ok(value), Ok(())) => Ok(value),
                // The flusher's error is the cause of the writer's, if both failed.
                (_, Err(e)) | (Err(e), Ok(())) => Err(e),
            }
        })
    }

    /// More was written: a flush is wanted. Fails once the flusher has stopped on an
    /// error (its error is the one `run` returns).
    fn written(&self) -> std::io::Result<()> {
        match self.wanted.try_send(()) {
            Err(crossbeam_channel::TrySendError::Disconnected(())) => {
                Err(std::io::Error::other("the pages file could not be flushed"))
            }
            // Full: a flush is already waiting, and it will cover this chunk too.
            Ok(()) | Err(crossbeam_channel::TrySendError::Full(())) => Ok(()),
        }
    }
}

/// Writes the pages of the pages file `pages` into QEMU `pid`'s mapping of `memory_file`
/// (which must not have run guest code yet).
pub fn write_back_pages(
    pid: u32,
    memory_file: &Path,
    ram_bytes: u64,
    pages: &Path,
) -> Result<PagesStats, VmError> {
    let started = Instant::now();
    let ram = find_ram(pid, memory_file, ram_bytes)?;
    let io = |e| VmError::io(format!("cannot read {}", pages.display()), e);
    let file = File::open(pages).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let index = PagesIndex::read(&file, len, ram_bytes).map_err(|why| {
        VmError::InvalidSpec(format!("pages file {} is unusable: {why}", pages.display()))
    })?;
    let scan_ms = started.elapsed().as_millis() as u64;
    let copying = Instant::now();
    let mut offset = index.data_offset();
    let mut buf = Vec::new();
    for chunk in chunks(&index.runs, CHUNK_BYTES / PAGE_SIZE) {
        let len: u64 = chunk.iter().map(|r| r.pages * PAGE_SIZE).sum();
        buf.resize(len as usize, 0);
        file.read_exact_at(&mut buf, offset).map_err(io)?;
        procmem::write_remote(pid, &ranges(ram.start, &chunk), &buf)
            .map_err(|e| VmError::io(format!("cannot write QEMU {pid}'s RAM"), e.source))?;
        offset += len;
    }
    Ok(PagesStats {
        pages: index.pages(),
        scan_ms,
        copy_ms: copying.elapsed().as_millis() as u64,
    })
}

/// Hard-links `src` as `dir/name` (replacing another file of that name); nothing to do
/// when it already is that file. Returns the link's path, and whether it is new.
fn link_as(src: &Path, dir: &Path, name: &str) -> Result<(PathBuf, bool), VmError> {
    use std::os::unix::fs::MetadataExt;
    let dest = dir.join(name);
    let stat = |p: &Path| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
    let src_id = stat(src).map_err(|e| VmError::io(format!("cannot stat {}", src.display()), e))?;
    if stat(&dest).ok() == Some(src_id) {
        return Ok((dest, false));
    }
    let tmp = dir.join(format!("{name}.link"));
    let _ = std::fs::remove_file(&tmp);
    std::fs::hard_link(src, &tmp)
        .and_then(|()| std::fs::rename(&tmp, &dest))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            VmError::io(
                format!("cannot link {} to {}", src.display(), dest.display()),
                e,
            )
        })?;
    Ok((dest, true))
}

fn remove_if_present(path: &Path) -> Result<(), VmError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(VmError::io(
            format!("cannot remove old {}", path.display()),
            e,
        )),
    }
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// The template files a dirty pause of this VM refers to: its RAM file and the template's
/// state file, linked into the run dir.
pub(crate) struct Base {
    memory: PathBuf,
    state: PathBuf,
}

/// What an earlier, unfinished capture into the same files left.
fn remove_stale_capture(state: &Path, pages: &Path) -> Result<(), VmError> {
    let partial = |p: &Path| p.with_extension("partial");
    let stale = [
        state.to_path_buf(),
        pages.to_path_buf(),
        partial(state),
        partial(pages),
        devices_path(&partial(state)),
    ];
    for stale in &stale {
        remove_if_present(stale)?;
    }
    Ok(())
}

impl Vm {
    /// Whether a pause can be dirty-only: the RAM is a template's file mapped privately
    /// and the VM was restored from that template's state (or from a dirty capture).
    pub(crate) fn can_pause_dirty(&self) -> bool {
        self.facts.base_state.is_some() && self.facts.memory.as_ref().is_some_and(|m| !m.shared)
    }

    /// Links the template's files into the run dir (once per sandbox: a VM resumed from
    /// a dirty capture maps those links already).
    pub(crate) fn link_base(&self) -> Result<Base, VmError> {
        let (Some(memory), Some(state)) = (&self.facts.memory, &self.facts.base_state) else {
            return Err(VmError::InvalidSpec(
                "the VM's RAM is not a template's file".into(),
            ));
        };
        let run_dir = &self.facts.run_dir;
        let (memory, new_memory) = link_as(&memory.path, run_dir, BASE_MEMORY_LINK)?;
        let (state, new_state) = link_as(state, run_dir, BASE_STATE_LINK)?;
        if new_memory || new_state {
            crate::sys::fs::fsync_dir(run_dir).map_err(|e| {
                VmError::io(format!("cannot fsync {}", run_dir.display()), e.source)
            })?;
        }
        Ok(Base { memory, state })
    }

    /// A kept VM's next pause links from the sandbox's own links of the template's
    /// files: the template may be gone by then.
    fn follow_links(&mut self, base: &Base) {
        if let Some(memory) = self.facts.memory.as_mut() {
            memory.path = base.memory.clone();
        }
        self.facts.base_state = Some(base.state.clone());
    }

    /// Dirty-only pause (see the module docs) into `dir`: device state in `state.bin`,
    /// the pages changed since the template in `memory.pages`; QEMU quits. On an error
    /// before QEMU was told to quit, the VM is left stopped and no file of the capture is
    /// left in `dir`.
    pub(crate) fn pause_dirty(
        &mut self,
        dir: &Path,
        base: Base,
        quit: bool,
    ) -> Result<(CaptureRecord, CaptureStats), VmError> {
        let started = Instant::now();
        crate::store::ensure_private_dir(dir).map_err(|e| {
            VmError::io(
                format!("cannot create capture dir {}", dir.display()),
                std::io::Error::other(e.to_string()),
            )
        })?;
        let state = dir.join(super::capture::STATE_FILE);
        let pages = dir.join(PAGES_FILE);
        let partial = |p: &Path| p.with_extension("partial");
        remove_stale_capture(&state, &pages)?;
        let chain = super::disk::disk_chain(&self.facts.disk)?;
        let mut stats = CaptureStats {
            prepare_ms: ms(started.elapsed()),
            ..CaptureStats::default()
        };
        let stopped = Instant::now();
        let result = self.pause_dirty_stopped(
            &base,
            (&partial(&state), &partial(&pages)),
            quit,
            &mut stats,
        );
        let (index, copied) = match result {
            Ok(done) => done,
            Err(e) => {
                for path in [
                    partial(&state),
                    partial(&pages),
                    devices_path(&partial(&state)),
                ] {
                    let _ = std::fs::remove_file(path);
                }
                log::warn!(
                    "vm op=capture pid={} result=error dir={} dirty=true error={e}",
                    self.pid(),
                    dir.display()
                );
                return Err(e);
            }
        };
        let sync = Instant::now();
        for (from, to) in [(partial(&state), &state), (partial(&pages), &pages)] {
            std::fs::rename(&from, to).map_err(|e| {
                VmError::io(
                    format!("cannot rename {} to {}", from.display(), to.display()),
                    e,
                )
            })?;
        }
        crate::sys::fs::fsync_dir(dir)
            .map_err(|e| VmError::io(format!("cannot fsync {}", dir.display()), e.source))?;
        stats.sync_ms += ms(sync.elapsed());
        stats.frozen_ms = ms(stopped.elapsed());
        stats.total_ms = ms(started.elapsed());

        let mut record = self.record(
            state,
            stats.state_bytes,
            &chain,
            chain.layers.clone(),
            false,
        );
        record.format = DIRTY_FORMAT;
        if !quit {
            self.follow_links(&base);
        }
        record.memory_file = Some(base.memory);
        record.dirty = Some(DirtyMemory {
            base_state: base.state,
            pages_file: pages,
            pages: index.pages(),
        });
        log::info!(
            "vm op=capture pid={} result=ok dir={} dirty=true pages={} stateBytes={} stopMs={} \
             migrateMs={} scanMs={} copyMs={} syncMs={} frozenMs={} totalMs={}",
            self.pid(),
            dir.display(),
            index.pages(),
            stats.state_bytes,
            stats.stop_ms,
            stats.migrate_ms,
            copied.scan_ms,
            copied.copy_ms,
            stats.sync_ms,
            stats.frozen_ms,
            stats.total_ms
        );
        Ok((record, stats))
    }

    /// The part with the vCPUs stopped: device state and pages written, QEMU gone (or,
    /// without `quit`, left stopped with its disk active: it can run on), both files
    /// fsync'd.
    fn pause_dirty_stopped(
        &mut self,
        base: &Base,
        (state, pages): (&Path, &Path),
        quit: bool,
        stats: &mut CaptureStats,
    ) -> Result<(PagesIndex, PagesStats), VmError> {
        let t = Instant::now();
        self.qmp().stop()?;
        stats.stop_ms = ms(t.elapsed());
        let t = Instant::now();
        if !self.migration_tuned {
            // The configuration section names the capabilities, and the restoring QEMU
            // (which sets them) checks that they match.
            self.qmp().migrate_set_parameters(CAPTURE_BANDWIDTH)?;
            self.qmp().migrate_set_capabilities(MIGRATION_CAPS)?;
            self.migration_tuned = true;
        }
        let devices = devices_path(state);
        self.save_device_state(&devices)?;
        stats.migrate_ms = ms(t.elapsed());
        let ram_bytes = u64::from(self.facts.machine.memory_mb) << 20;
        let pid = self.pid();
        // The state file is made from the device state and made durable while the pages
        // are copied.
        let (saved, state_len) = std::thread::scope(|s| {
            let state_writer = s.spawn(|| write_state(&base.state, &devices, state));
            let saved = save_pages(pid, &base.memory, ram_bytes, pages);
            let state_len = super::joined(state_writer, "state writer");
            (saved, state_len)
        });
        let (pages_file, index, copied) = saved?;
        let state_len = state_len?;

        let t = Instant::now();
        // QEMU's memory is no longer needed: it exits while the last pages are made
        // durable.
        self.sync_while_quitting(quit, &pages_file, pages)?;
        let _ = std::fs::remove_file(&devices);
        stats.sync_ms = ms(t.elapsed());
        stats.state_bytes = state_len + index.file_len();
        Ok((index, copied))
    }

    /// QMP `xen-save-devices-state` into a new file `path` (handed to QEMU as a
    /// descriptor).
    fn save_device_state(&mut self, path: &Path) -> Result<(), VmError> {
        let file = super::qmp::create_state_file(path)?;
        // live=false: the disk stays active, so a VM whose pause fails later can run on.
        self.qmp()
            .execute_with_fd(
                "xen-save-devices-state",
                &file,
                |fdset| json!({ "filename": format!("/dev/fdset/{fdset}"), "live": false }),
            )
            .map(drop)
    }

    /// Resume of a dirty capture on a VM started with `-incoming defer -S` over the
    /// capture's RAM file (see the module docs). Returns once the VM is `paused` with
    /// everything loaded; its vCPUs have not run.
    pub(crate) fn load_dirty(
        &mut self,
        record: &CaptureRecord,
        dirty: &DirtyMemory,
    ) -> Result<(), VmError> {
        let memory = self
            .facts
            .memory
            .as_ref()
            .filter(|m| !m.shared)
            .map(|m| m.path.clone())
            .ok_or_else(|| VmError::InvalidSpec("the VM has no private RAM file".into()))?;
        let ram_bytes = u64::from(self.facts.machine.memory_mb) << 20;
        let written = write_back_pages(self.pid(), &memory, ram_bytes, &dirty.pages_file)?;
        let t = Instant::now();
        self.qmp().migrate_set_capabilities(MIGRATION_CAPS)?;
        self.qmp().migrate_incoming_file(&record.state_file)?;
        self.qmp().wait_status("paused", LOAD_TIMEOUT)?;
        self.facts.base_state = Some(dirty.base_state.clone());
        log::info!(
            "vm op=load_dirty pid={} pages={} scanMs={} writeMs={} devicesMs={}",
            self.pid(),
            written.pages,
            written.scan_ms,
            written.copy_ms,
            ms(t.elapsed())
        );
        Ok(())
    }
}

/// The scratch file QEMU writes the device state into, next to `state`.
fn devices_path(state: &Path) -> PathBuf {
    state.with_extension("devices")
}

/// Writes `state` (mode 0600, fsync'd) from the template's state file `base` and the
/// device-only stream in `devices` ([`stitch_state`]); returns its length.
fn write_state(base: &Path, devices: &Path, state: &Path) -> Result<u64, VmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let read = |p: &Path| {
        let file =
            File::open(p).map_err(|e| VmError::io(format!("cannot open {}", p.display()), e))?;
        let len = file
            .metadata()
            .map_err(|e| VmError::io(format!("cannot stat {}", p.display()), e))?
            .len();
        if len > MAX_STREAM_BYTES {
            return Err(VmError::InvalidSpec(format!(
                "{} is {len} bytes; a device state over {MAX_STREAM_BYTES} is not expected",
                p.display()
            )));
        }
        std::fs::read(p).map_err(|e| VmError::io(format!("cannot read {}", p.display()), e))
    };
    let stitched = stitch_state(&read(base)?, &read(devices)?).map_err(|why| {
        VmError::InvalidSpec(format!(
            "cannot make a loadable state from {} and {}: {why}",
            base.display(),
            devices.display()
        ))
    })?;
    let io = |e| VmError::io(format!("cannot write {}", state.display()), e);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(state)
        .map_err(io)?;
    file.write_all(&stitched).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(stitched.len() as u64)
}

/// Migration stream constants (QEMU's `migration/savevm.c`).
const STREAM_MAGIC: &[u8; 8] = b"QEVM\0\0\0\x03";
const SECTION_FULL: u8 = 0x04;
const SECTION_FOOTER: u8 = 0x7e;
const STREAM_EOF: u8 = 0x00;
const VMDESCRIPTION: u8 = 0x06;
/// Largest template state or device state read into memory to stitch them.
const MAX_STREAM_BYTES: u64 = 256 << 20;

/// A migration stream that loads the device-only stream `devices` (as
/// `xen-save-devices-state` writes it: header, device sections, end) over a template:
/// the template's state `template` up to its first device section (header,
/// configuration, RAM section: the ROM and firmware blocks; the template's guest RAM is
/// not in it), then the device sections of `devices`, then the template's trailing VM
/// description (which the loader reads and discards).
///
/// The template's first device section is found by its header (type, section id, name,
/// instance, version), which is the same as the first one of `devices` (one QEMU build,
/// one machine: the same devices, registered in the same order), right after the
/// previous section's footer. The bytes before it are QEMU's own (configuration and
/// ROMs), never guest data.
pub fn stitch_state(template: &[u8], devices: &[u8]) -> Result<Vec<u8>, String> {
    let magic = STREAM_MAGIC.len();
    if !template.starts_with(STREAM_MAGIC) || !devices.starts_with(STREAM_MAGIC) {
        return Err("not QEMU migration streams of version 3".into());
    }
    // type, section id (4), name length (1), name, instance id (4), version id (4)
    let name_len = *devices.get(magic + 5).ok_or("the device state is empty")? as usize;
    let header = devices
        .get(magic..magic + 1 + 4 + 1 + name_len + 8)
        .ok_or("the device state is cut short")?;
    if header[0] != SECTION_FULL {
        return Err(format!(
            "the device state starts with section type {}",
            header[0]
        ));
    }
    if devices.last() != Some(&STREAM_EOF) {
        return Err("the device state does not end with the end-of-stream mark".into());
    }
    let first = template[magic..]
        .windows(header.len())
        .position(|w| w == header)
        .map(|p| p + magic)
        .ok_or("the template's state has no device section like the first one saved")?;
    if first < 5 || template[first - 5] != SECTION_FOOTER {
        return Err("the template's first device section does not follow a section footer".into());
    }
    // EOF, then VMDESCRIPTION with a be32 length running to the end of the file.
    let description = (first..=template.len().saturating_sub(5)).rev().find(|&p| {
        template[p] == VMDESCRIPTION
            && template[p - 1] == STREAM_EOF
            && u32::from_be_bytes(template[p + 1..p + 5].try_into().unwrap()) as usize
                == template.len() - p - 5
    });
    let tail = description.map_or(&[][..], |p| &template[p..]);
    let mut out = Vec::with_capacity(first + devices.len() - magic + tail.len());
    out.extend_from_slice(&template[..first]);
    out.extend_from_slice(&devices[magic..]);
    out.extend_from_slice(tail);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PM_PRESENT;

    #[test]
    fn flush_along_returns_what_was_written() {
        let dir = std::env::temp_dir().join(format!("aenv-flush-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pages");
        let file = File::create(&path).unwrap();
        let chunks = FlushAlong::run(&file, &path, |flush| {
            for i in 0..8u8 {
                (&file).write_all(&[i; 4096]).unwrap();
                flush.written().unwrap();
            }
            Ok(8)
        });
        assert_eq!(chunks.unwrap(), 8);
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), 8 * 4096);
        assert_eq!(back[7 * 4096], 7);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_flush_stops_the_writer_and_is_the_error() {
        // fsync of a character device fails (EINVAL) while its writes succeed.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        let path = Path::new("/dev/null");
        let mut writer_stopped = false;
        let result: Result<(), VmError> = FlushAlong::run(&file, path, |flush| {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                (&file).write_all(&[0; 4096]).unwrap();
                if let Err(e) = flush.written() {
                    writer_stopped = true;
                    return Err(VmError::io("the writer stopped", e));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        });
        let e = result.unwrap_err().to_string();
        assert!(e.contains("cannot fsync /dev/null"), "{e}");
        assert!(writer_stopped, "the writer went on after the flush failed");
    }

    #[test]
    fn a_failed_write_is_the_error() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .unwrap();
        let result: Result<(), VmError> = FlushAlong::run(&file, Path::new("/dev/null"), |_| {
            Err(VmError::InvalidSpec("the copy failed".into()))
        });
        assert!(result.unwrap_err().to_string().contains("the copy failed"));
    }

    #[test]
    fn private_pages_become_runs() {
        let file_page = PM_PRESENT | PM_FILE;
        let entries = [
            0,         // never touched: the template's page
            P,         // private copy
            P,         // private copy
            file_page, // read only: the template's page
            PM_SWAPPED,
            P,
            0,
            PM_SWAPPED | PM_FILE, // a swapped shared page is still the file's
            P,
        ];
        assert_eq!(
            dirty_runs(&entries),
            [
                Run { first: 1, pages: 2 },
                Run { first: 4, pages: 2 },
                Run { first: 8, pages: 1 },
            ]
        );
        assert!(dirty_runs(&[0, file_page, 0]).is_empty());
    }

    #[test]
    fn chunks_cut_runs_at_the_limit() {
        let runs = [
            Run { first: 0, pages: 5 },
            Run {
                first: 10,
                pages: 2,
            },
        ];
        let cut = chunks(&runs, 3);
        assert_eq!(
            cut,
            [
                vec![Run { first: 0, pages: 3 }],
                vec![
                    Run { first: 3, pages: 2 },
                    Run {
                        first: 10,
                        pages: 1
                    }
                ],
                vec![Run {
                    first: 11,
                    pages: 1
                }],
            ]
        );
        assert!(chunks(&[], 3).is_empty());
        let total: u64 = cut.iter().flatten().map(|r| r.pages).sum();
        assert_eq!(total, 7);
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "agentenv-dirty-{}-{name}-{}",
            std::process::id(),
            crate::util::new_id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn write_file(path: &Path, index: &PagesIndex, extra: i64) -> File {
        let mut bytes = index.encode();
        let data = (index.pages() * PAGE_SIZE) as i64 + extra;
        bytes.resize(bytes.len() + data.max(0) as usize, 7);
        std::fs::write(path, &bytes).unwrap();
        File::open(path).unwrap()
    }

    #[test]
    fn pages_index_round_trips_and_refuses_what_does_not_fit() {
        let dir = scratch("index");
        let ram = 64 * PAGE_SIZE;
        let index = PagesIndex {
            ram_bytes: ram,
            runs: vec![
                Run { first: 0, pages: 2 },
                Run {
                    first: 60,
                    pages: 4,
                },
            ],
        };
        assert_eq!(index.data_offset(), PAGE_SIZE);
        assert_eq!(index.file_len(), 7 * PAGE_SIZE);
        let path = dir.join("p");
        let f = write_file(&path, &index, 0);
        assert_eq!(PagesIndex::read(&f, index.file_len(), ram).unwrap(), index);
        // Another RAM size, a truncated or padded file.
        assert!(PagesIndex::read(&f, index.file_len(), ram * 2).is_err());
        let short = write_file(&path, &index, -1);
        assert!(PagesIndex::read(&short, index.file_len() - 1, ram).is_err());
        let long = write_file(&path, &index, 1);
        assert!(PagesIndex::read(&long, index.file_len() + 1, ram).is_err());
        // Runs outside the RAM, overlapping, or empty.
        for runs in [
            vec![Run {
                first: 62,
                pages: 4,
            }],
            vec![Run { first: 0, pages: 4 }, Run { first: 3, pages: 1 }],
            vec![Run { first: 5, pages: 0 }],
            vec![Run {
                first: u64::MAX,
                pages: 2,
            }],
        ] {
            let bad = PagesIndex {
                ram_bytes: ram,
                runs,
            };
            let pages = bad.pages().min(64);
            let mut bytes = bad.encode();
            bytes.resize(bytes.len() + (pages * PAGE_SIZE) as usize, 0);
            std::fs::write(&path, &bytes).unwrap();
            let f = File::open(&path).unwrap();
            assert!(
                PagesIndex::read(&f, bytes.len() as u64, ram).is_err(),
                "{bad:?}"
            );
        }
        // Not a pages file at all.
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        assert!(PagesIndex::read(&File::open(&path).unwrap(), 8192, ram).is_err());
        // An empty set is a header page only.
        let empty = PagesIndex {
            ram_bytes: ram,
            runs: Vec::new(),
        };
        assert_eq!(empty.file_len(), PAGE_SIZE);
        let f = write_file(&path, &empty, 0);
        assert_eq!(PagesIndex::read(&f, PAGE_SIZE, ram).unwrap(), empty);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A section: type, id, name, instance 0, version 1, payload, footer.
    fn section(kind: u8, id: u32, name: &str, payload: &[u8]) -> Vec<u8> {
        let mut s = vec![kind];
        s.extend_from_slice(&id.to_be_bytes());
        s.push(name.len() as u8);
        s.extend_from_slice(name.as_bytes());
        s.extend_from_slice(&0u32.to_be_bytes());
        s.extend_from_slice(&1u32.to_be_bytes());
        s.extend_from_slice(payload);
        s.push(SECTION_FOOTER);
        s.extend_from_slice(&id.to_be_bytes());
        s
    }

    #[test]
    fn device_state_is_stitched_behind_the_templates_rom_blocks() {
        let config = b"\x07\0\0\0\x07microvm".to_vec();
        let description = b"{\"page_size\":4096}";
        let mut template = STREAM_MAGIC.to_vec();
        template.extend(&config);
        template.extend(section(0x01, 1, "ram", b"ROM BLOCKS"));
        template.extend(section(SECTION_FULL, 0, "timer", b"template timer"));
        template.extend(section(SECTION_FULL, 2, "cpu", b"template cpu"));
        template.push(STREAM_EOF);
        template.push(VMDESCRIPTION);
        template.extend((description.len() as u32).to_be_bytes());
        template.extend(description);
        let mut devices = STREAM_MAGIC.to_vec();
        let device_sections = [
            section(SECTION_FULL, 0, "timer", b"paused timer"),
            section(SECTION_FULL, 2, "cpu", b"paused cpu"),
        ]
        .concat();
        devices.extend(&device_sections);
        devices.push(STREAM_EOF);

        let stitched = stitch_state(&template, &devices).unwrap();
        let mut want = STREAM_MAGIC.to_vec();
        want.extend(&config);
        want.extend(section(0x01, 1, "ram", b"ROM BLOCKS"));
        want.extend(&device_sections);
        want.push(STREAM_EOF);
        want.push(VMDESCRIPTION);
        want.extend((description.len() as u32).to_be_bytes());
        want.extend(description);
        assert_eq!(stitched, want);

        // Without a description the stream simply ends.
        let bare = &template[..template.len() - description.len() - 5];
        assert!(stitch_state(bare, &devices)
            .unwrap()
            .ends_with(&[STREAM_EOF]));
        // Streams that do not fit are refused.
        let other = [
            STREAM_MAGIC.as_slice(),
            &section(SECTION_FULL, 9, "rtc", b"x"),
            &[0],
        ]
        .concat();
        assert!(stitch_state(&template, &other).is_err(), "no such section");
        assert!(
            stitch_state(&template, &devices[..devices.len() - 1]).is_err(),
            "no EOF"
        );
        assert!(stitch_state(&template, b"QEVM").is_err());
        assert!(stitch_state(b"junk", &devices).is_err());
        let no_footer = [
            STREAM_MAGIC.as_slice(),
            &section(SECTION_FULL, 0, "timer", b"x"),
            &[0],
        ]
        .concat();
        assert!(
            stitch_state(&no_footer, &devices).is_err(),
            "not behind a footer"
        );
    }

    #[test]
    fn links_replace_other_files_and_keep_the_same_one() {
        let dir = scratch("link");
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        let (linked, new) = link_as(&a, &dir, "l").unwrap();
        assert!(new);
        assert_eq!(std::fs::read(&linked).unwrap(), b"a");
        assert_eq!(
            link_as(&linked, &dir, "l").unwrap(),
            (linked.clone(), false)
        );
        assert!(link_as(&b, &dir, "l").unwrap().1);
        assert_eq!(std::fs::read(&linked).unwrap(), b"b");
        assert!(!dir.join("l.link").exists());
        assert!(link_as(&dir.join("missing"), &dir, "l").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
