//! How far one `prepare_rootfs` got, readable from other threads while it runs: a
//! template build shows it in `GET /templates/{id}` (docs/api.md §4.15). The preparing
//! thread writes, anyone reads; clones share one record.

use std::io::{self, Read};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// What an image preparation is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImagePhase {
    /// Fetching the manifest and config, then the layers the cache lacks.
    Pulling,
    /// Verifying the layers and applying them to a staging tree.
    Unpacking,
    /// `mkfs.ext4 -d` and the fixups.
    BuildingDisk,
    /// The base disk is there (built now or found in the cache).
    Done,
}

impl ImagePhase {
    fn from_u8(v: u8) -> ImagePhase {
        match v {
            0 => ImagePhase::Pulling,
            1 => ImagePhase::Unpacking,
            2 => ImagePhase::BuildingDisk,
            _ => ImagePhase::Done,
        }
    }
}

/// Phase and layer bytes of one preparation.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    phase: AtomicU8,
    /// Layer bytes local so far (downloaded now, or found in the blob cache).
    done: AtomicU64,
    /// The layers' sizes from the manifest (compressed, as pulled); 0 until resolved.
    total: AtomicU64,
}

impl Progress {
    pub fn phase(&self) -> ImagePhase {
        ImagePhase::from_u8(self.0.phase.load(Ordering::Relaxed))
    }

    /// (bytes done, bytes total) of the layers; done never exceeds total.
    pub fn bytes(&self) -> (u64, u64) {
        let total = self.0.total.load(Ordering::Relaxed);
        (self.0.done.load(Ordering::Relaxed).min(total), total)
    }

    pub(crate) fn set_phase(&self, phase: ImagePhase) {
        self.0.phase.store(phase as u8, Ordering::Relaxed);
    }

    pub(crate) fn set_total(&self, total: u64) {
        self.0.total.store(total, Ordering::Relaxed);
    }

    /// Every layer is local: done = total.
    pub(crate) fn all_done(&self) {
        let total = self.0.total.load(Ordering::Relaxed);
        self.0.done.store(total, Ordering::Relaxed);
    }

    pub(crate) fn add(&self, n: u64) {
        self.0.done.fetch_add(n, Ordering::Relaxed);
    }

    /// `reader`, counting what is read from it here and in `counted`.
    pub(crate) fn counting(
        &self,
        reader: Box<dyn Read + Send>,
        counted: Arc<AtomicU64>,
    ) -> Box<dyn Read + Send> {
        Box::new(Counting {
            inner: reader,
            progress: self.clone(),
            counted,
        })
    }
}

struct Counting {
    inner: Box<dyn Read + Send>,
    progress: Progress,
    counted: Arc<AtomicU64>,
}

impl Read for Counting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.add(n as u64);
        self.counted.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_reads_and_never_reports_more_than_the_total() {
        let p = Progress::default();
        assert_eq!((p.phase(), p.bytes()), (ImagePhase::Pulling, (0, 0)));
        p.set_total(10);
        let counted = Arc::new(AtomicU64::new(0));
        let mut r = p.counting(Box::new(&b"abcdef"[..]), counted.clone());
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        assert_eq!((p.bytes(), counted.load(Ordering::Relaxed)), ((6, 10), 6));
        p.add(100);
        assert_eq!(p.bytes(), (10, 10));
        p.set_phase(ImagePhase::BuildingDisk);
        assert_eq!(p.clone().phase(), ImagePhase::BuildingDisk);
    }
}
