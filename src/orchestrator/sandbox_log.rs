//! Each sandbox's log as E2B's `GET /v2/sandboxes/{id}/logs` shows it (api.md §4.26):
//! what happened to it (created, paused, resumed, timeout changes, snapshots, forks; the
//! orchestrator records these) and what its guest wrote on its console (the
//! `sandbox-metrics` thread reads the console file's new complete lines each round, so a
//! line's timestamp is when the host read it, at most one sampling interval late).
//!
//! Bounded: at most [`MAX_ENTRIES`] entries (the oldest dropped first), each message cut
//! to [`MAX_MESSAGE`] bytes, at most [`MAX_READ`] console bytes a round. Memory only: a
//! restart forgets them (the console file itself stays with the sandbox).

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub const MAX_ENTRIES: usize = 2000;
pub const MAX_MESSAGE: usize = 1024;
const MAX_READ: u64 = 64 * 1024;

pub use super::templates::LogLevel;

/// One entry.
#[derive(Debug, Clone, PartialEq)]
pub struct LogEntry {
    pub at_unix_ms: u64,
    pub level: LogLevel,
    pub message: String,
    /// `source` (`agentenv` or `console`), and for events the operation.
    pub fields: Vec<(&'static str, String)>,
}

/// Which entries a reader wants.
#[derive(Debug, Clone)]
pub struct LogQuery {
    /// Unix ms: forward → entries at or after it, backward → at or before it.
    pub cursor: Option<u64>,
    pub limit: usize,
    pub backward: bool,
    pub min_level: LogLevel,
    pub search: Option<String>,
}

#[derive(Default)]
struct State {
    entries: VecDeque<LogEntry>,
    /// How far the console file has been read.
    console_offset: u64,
}

/// A sandbox's log.
#[derive(Default)]
pub struct SandboxLog {
    state: Mutex<State>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `s` cut to at most [`MAX_MESSAGE`] bytes on a character boundary.
fn bounded(s: &str) -> String {
    let mut end = s.len().min(MAX_MESSAGE);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl SandboxLog {
    fn push(state: &mut State, entry: LogEntry) {
        if state.entries.len() == MAX_ENTRIES {
            state.entries.pop_front();
        }
        state.entries.push_back(entry);
    }

    /// Records something that happened to the sandbox.
    pub fn event(&self, level: LogLevel, op: &'static str, message: &str) {
        let entry = LogEntry {
            at_unix_ms: now_ms(),
            level,
            message: bounded(message),
            fields: vec![("source", "agentenv".into()), ("operation", op.into())],
        };
        Self::push(&mut self.state.lock(), entry);
    }

    /// Takes the console file's complete lines written since the last call (a partial
    /// last line waits for its end; a file that shrank is read again from its start).
    pub fn read_console(&self, path: &Path) {
        let Ok(mut file) = std::fs::File::open(path) else {
            return;
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut state = self.state.lock();
        if len < state.console_offset {
            state.console_offset = 0;
        }
        if len == state.console_offset || file.seek(SeekFrom::Start(state.console_offset)).is_err()
        {
            return;
        }
        let mut buf = Vec::new();
        if file.take(MAX_READ).read_to_end(&mut buf).is_err() {
            return;
        }
        // A full read with no newline is taken whole, so one endless line cannot stall it.
        let complete = match buf.iter().rposition(|b| *b == b'\n') {
            Some(i) => i + 1,
            None if buf.len() as u64 == MAX_READ => buf.len(),
            None => return,
        };
        state.console_offset += complete as u64;
        let at = now_ms();
        for line in String::from_utf8_lossy(&buf[..complete]).lines() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let entry = LogEntry {
                at_unix_ms: at,
                level: LogLevel::Info,
                message: bounded(line),
                fields: vec![("source", "console".into())],
            };
            Self::push(&mut state, entry);
        }
    }

    /// The entries `q` asks for, in its direction.
    pub fn query(&self, q: &LogQuery) -> Vec<LogEntry> {
        let state = self.state.lock();
        let wanted = |e: &&LogEntry| {
            e.level >= q.min_level
                && q.search.as_deref().is_none_or(|s| e.message.contains(s))
                && q.cursor.is_none_or(|c| {
                    if q.backward {
                        e.at_unix_ms <= c
                    } else {
                        e.at_unix_ms >= c
                    }
                })
        };
        let picked: Vec<LogEntry> = if q.backward {
            state
                .entries
                .iter()
                .rev()
                .filter(wanted)
                .take(q.limit)
                .cloned()
                .collect()
        } else {
            state
                .entries
                .iter()
                .filter(wanted)
                .take(q.limit)
                .cloned()
                .collect()
        };
        picked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> LogQuery {
        LogQuery {
            cursor: None,
            limit: 1000,
            backward: false,
            min_level: LogLevel::Debug,
            search: None,
        }
    }

    #[test]
    fn console_lines_are_taken_once_whole_and_bounded() {
        let dir = std::env::temp_dir().join(format!("aenv-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("console.log");
        std::fs::write(&path, "boot ok\r\n\npart").unwrap();
        let log = SandboxLog::default();
        log.read_console(&path);
        log.read_console(&path);
        let got: Vec<String> = log.query(&all()).into_iter().map(|e| e.message).collect();
        assert_eq!(got, vec!["boot ok"]);
        std::fs::write(
            &path,
            format!("boot ok\r\n\npartial {}\n", "x".repeat(5000)),
        )
        .unwrap();
        log.read_console(&path);
        let got = log.query(&all());
        assert_eq!(got.len(), 2);
        assert!(got[1].message.starts_with("partial x") && got[1].message.len() == MAX_MESSAGE);
        assert_eq!(got[1].fields, vec![("source", "console".to_string())]);
        // A file that shrank (recreated) is read from its start.
        std::fs::write(&path, "again\n").unwrap();
        log.read_console(&path);
        assert_eq!(log.query(&all()).last().unwrap().message, "again");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn queries_filter_by_level_text_cursor_and_direction() {
        let log = SandboxLog::default();
        log.event(LogLevel::Info, "create", "sandbox created");
        log.event(LogLevel::Warn, "pause", "paused by timeout");
        log.event(LogLevel::Error, "resume", "resume failed");
        let warn = LogQuery {
            min_level: LogLevel::Warn,
            ..all()
        };
        assert_eq!(log.query(&warn).len(), 2);
        let search = LogQuery {
            search: Some("created".into()),
            ..all()
        };
        assert_eq!(log.query(&search)[0].fields[1].1, "create");
        let back = LogQuery {
            backward: true,
            limit: 2,
            ..all()
        };
        let msgs: Vec<_> = log.query(&back).into_iter().map(|e| e.message).collect();
        assert_eq!(msgs, vec!["resume failed", "paused by timeout"]);
        let future = LogQuery {
            cursor: Some(u64::MAX),
            ..all()
        };
        assert!(log.query(&future).is_empty());
        for i in 0..MAX_ENTRIES + 5 {
            log.event(LogLevel::Debug, "x", &i.to_string());
        }
        assert_eq!(
            log.query(&LogQuery {
                limit: usize::MAX,
                ..all()
            })
            .len(),
            MAX_ENTRIES
        );
    }
}
