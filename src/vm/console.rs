//! The end of a guest's console log, for error reports ("the guest never became ready;
//! its console ends with ...").

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// How much of the file end is read: enough for any sensible `lines`.
const TAIL_BYTES: u64 = 64 * 1024;

/// The last `lines` lines of the file at `path`, lossily decoded, without carriage
/// returns. An unreadable or missing file gives an empty string.
pub fn tail_lines(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(TAIL_BYTES);
    if file.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    if file.read_to_end(&mut buf).is_err() {
        return String::new();
    }
    last_lines(&String::from_utf8_lossy(&buf), lines, start > 0)
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
