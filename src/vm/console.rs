//! A guest's console log: QEMU writes the serial console into a pipe, a writer thread
//! copies it into `console.log`, rotating to `console.log.1` at [`CONSOLE_FILE_MAX`]: a
//! guest that floods its console (`cat /dev/zero > /dev/console`) costs at most twice that
//! on disk. The end of the log goes into error reports ("the guest never became ready;
//! its console ends with ...").

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::io::{PipeReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

/// Size at which `console.log` is rotated to `console.log.1` (which it replaces).
pub const CONSOLE_FILE_MAX: u64 = 2 * 1024 * 1024;

/// The rotated predecessor of a console log, `<path>.1`.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".1");
    PathBuf::from(name)
}

/// Starts the thread that copies QEMU's console output from `pipe` into `path` (appending,
/// rotating at `file_max`). It ends when every write end is closed (QEMU exited).
pub(crate) fn spawn_writer(
    pipe: PipeReader,
    path: PathBuf,
    file_max: u64,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("vm-console".into())
        .spawn(move || copy_rotating(pipe, &path, file_max))
}

fn copy_rotating(mut pipe: impl Read, path: &Path, file_max: u64) {
    let mut out = RotatingFile::open(path, file_max);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match pipe.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                log::warn!("vm op=console path={} error=\"{e}\"", path.display());
                return;
            }
        };
        // A failing disk never stalls QEMU: the output is then read and dropped.
        out.write(&buf[..n]);
    }
}

/// `console.log` plus its one rotated predecessor.
struct RotatingFile<'a> {
    path: &'a Path,
    file: Option<File>,
    len: u64,
    file_max: u64,
    failed: bool,
}

impl<'a> RotatingFile<'a> {
    fn open(path: &'a Path, file_max: u64) -> RotatingFile<'a> {
        let mut f = RotatingFile {
            path,
            file: None,
            len: 0,
            file_max: file_max.max(1),
            failed: false,
        };
        f.reopen();
        f
    }

    fn reopen(&mut self) {
        use std::os::unix::fs::OpenOptionsExt;
        match OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(self.path)
        {
            Ok(file) => {
                self.len = file.metadata().map(|m| m.len()).unwrap_or(0);
                self.file = Some(file);
            }
            Err(e) => self.fail(&e),
        }
    }

    fn fail(&mut self, e: &std::io::Error) {
        self.file = None;
        self.dropping(e);
    }

    /// Output is dropped while the disk refuses it (a full state dir): the log stops
    /// growing, the VM never notices, and writing resumes once there is room.
    fn dropping(&mut self, e: &std::io::Error) {
        if !self.failed {
            self.failed = true;
            log::warn!(
                "vm op=console path={} error=\"{e}\" (console output is dropped)",
                self.path.display()
            );
        }
    }

    fn write(&mut self, mut bytes: &[u8]) {
        if self.file.is_none() {
            self.reopen();
        }
        while !bytes.is_empty() {
            if self.len >= self.file_max {
                if let Err(e) = std::fs::rename(self.path, rotated_path(self.path)) {
                    self.fail(&e);
                    return;
                }
                self.reopen();
            }
            let Some(file) = self.file.as_mut() else {
                return;
            };
            let room = (self.file_max - self.len.min(self.file_max)) as usize;
            let n = bytes.len().min(room.max(1));
            if let Err(e) = file.write_all(&bytes[..n]) {
                self.len = file.metadata().map_or(self.len, |m| m.len());
                self.dropping(&e);
                return;
            }
            self.len += n as u64;
            bytes = &bytes[n..];
        }
        if std::mem::take(&mut self.failed) {
            log::warn!(
                "vm op=console path={} result=resumed (output since the error was dropped)",
                self.path.display()
            );
        }
    }
}

/// How much of the file end is read: enough for any sensible `lines`.
const TAIL_BYTES: u64 = 64 * 1024;

/// The last `lines` lines of the file at `path`, lossily decoded, without carriage
/// returns. An unreadable or missing file gives an empty string.
/// A console log just rotated also contributes the end of `<path>.1`.
pub fn tail_lines(path: &Path, lines: usize) -> String {
    let (mut buf, truncated) = tail_bytes(path, TAIL_BYTES);
    let (mut earlier, mut truncated) = (Vec::new(), truncated);
    if !truncated && (buf.len() as u64) < TAIL_BYTES {
        let (prev, prev_truncated) = tail_bytes(&rotated_path(path), TAIL_BYTES - buf.len() as u64);
        if !prev.is_empty() {
            earlier = prev;
            truncated = prev_truncated;
        }
    }
    earlier.append(&mut buf);
    last_lines(&String::from_utf8_lossy(&earlier), lines, truncated)
}

/// The last `max` bytes of a file, and whether that is less than the whole file.
fn tail_bytes(path: &Path, max: u64) -> (Vec<u8>, bool) {
    let Ok(mut file) = File::open(path) else {
        return (Vec::new(), false);
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if file.seek(SeekFrom::Start(start)).is_err() {
        return (Vec::new(), false);
    }
    let mut buf = Vec::new();
    if file.take(max).read_to_end(&mut buf).is_err() {
        return (Vec::new(), false);
    }
    (buf, start > 0)
}

/// The last `n` lines of `text`; when `truncated`, the first (partial) line is dropped.
fn last_lines(text: &str, n: usize, truncated: bool) -> String {
    let text = text.replace('\r', "");
    let mut all: Vec<&str> = text.lines().collect();
    if truncated && !all.is_empty() {
        all.remove(0);
    }
    all[all.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flooding_output_stays_within_two_files() {
        let dir = std::env::temp_dir().join(format!("aenv-console-{}", crate::util::new_id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("console.log");
        // 10 MB in odd-sized reads through a 100 KB cap.
        let flood: Vec<u8> = (0..10_000_000u32)
            .map(|i| if i % 80 == 79 { b'\n' } else { b'z' })
            .chain(b"last line\n".iter().copied())
            .collect();
        copy_rotating(std::io::Cursor::new(flood), &path, 100_000);
        let cur = std::fs::metadata(&path).unwrap().len();
        let prev = std::fs::metadata(rotated_path(&path)).unwrap().len();
        assert!(cur <= 100_000 && prev == 100_000, "{cur} {prev}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        assert_eq!(tail_lines(&path, 1), "last line");
        // A restart appends to the same file and keeps the bound.
        copy_rotating(std::io::Cursor::new(vec![b'y'; 250_000]), &path, 100_000);
        assert!(std::fs::metadata(&path).unwrap().len() <= 100_000);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn tail_reaches_into_the_rotated_file() {
        let dir = std::env::temp_dir().join(format!("aenv-console-{}", crate::util::new_id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("console.log");
        std::fs::write(rotated_path(&path), "a\nb\nc\n").unwrap();
        std::fs::write(&path, "d\n").unwrap();
        assert_eq!(tail_lines(&path, 3), "b\nc\nd");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn takes_the_last_lines() {
        assert_eq!(last_lines("a\r\nb\nc\n", 2, false), "b\nc");
        assert_eq!(last_lines("a\nb", 5, false), "a\nb");
        assert_eq!(last_lines("partial\nb\nc", 5, true), "b\nc");
        assert_eq!(last_lines("", 3, false), "");
    }

    #[test]
    fn reads_only_the_end_of_big_files() {
        let dir = std::env::temp_dir().join(format!("agentenv-tail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("console.log");
        let mut text = String::new();
        for i in 0..20_000 {
            text.push_str(&format!("line {i}\n"));
        }
        std::fs::write(&path, text).unwrap();
        assert_eq!(tail_lines(&path, 2), "line 19998\nline 19999");
        assert_eq!(tail_lines(&dir.join("missing"), 2), "");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
