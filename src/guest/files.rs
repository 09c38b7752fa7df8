//! File downloads and uploads for the host (api.md §4.18), streamed with credit-based flow
//! control.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use super::{FrameSink, GuestError, StreamEvent};
use crate::agent::protocol::{Frame, FrameKind, Response, MAX_CHUNK, STREAM_WINDOW};

/// How long a stream may stay silent before the guest gives up on it.
const STREAM_IDLE: Duration = Duration::from_secs(120);

fn check_path(path: &str) -> Result<&Path, GuestError> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(GuestError::InvalidPath(format!(
            "path {path:?} must be absolute and must not contain NUL"
        )));
    }
    Ok(Path::new(path))
}

fn io_error(path: &str, what: &str, e: &io::Error) -> GuestError {
    match e.kind() {
        io::ErrorKind::NotFound => {
            GuestError::NotFound(format!("file {path} does not exist in the sandbox"))
        }
        io::ErrorKind::NotADirectory => {
            GuestError::InvalidPath(format!("{path}: a parent of the path is not a directory"))
        }
        io::ErrorKind::IsADirectory => {
            GuestError::InvalidPath(format!("{path} is a directory, not a regular file"))
        }
        _ => GuestError::Io(format!("{what} {path}: {e}")),
    }
}

/// Opens `path` and checks it is a regular file.
fn open_regular(path: &str) -> Result<File, GuestError> {
    let p = check_path(path)?;
    let meta = std::fs::metadata(p).map_err(|e| io_error(path, "stat", &e))?;
    if meta.is_dir() {
        return Err(GuestError::InvalidPath(format!(
            "{path} is a directory, not a regular file"
        )));
    }
    if !meta.is_file() {
        return Err(GuestError::InvalidPath(format!(
            "{path} is not a regular file"
        )));
    }
    let file = File::open(p).map_err(|e| io_error(path, "open", &e))?;
    Ok(file)
}

/// Streams a file to the host: `FileOpened`, then `Data` as credit allows, then `End`.
pub fn download(path: &str, id: u64, events: &Receiver<StreamEvent>, sink: &FrameSink) {
    let mut file = match open_regular(path) {
        Ok(f) => f,
        Err(e) => return sink.error(id, &e),
    };
    let size = match file.metadata() {
        Ok(m) => m.len(),
        Err(e) => return sink.error(id, &io_error(path, "stat", &e)),
    };
    sink.response(id, &Response::FileOpened { size });
    let mut credit: u64 = 0;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        // Take credit and cancellation as they come; block only when out of credit.
        loop {
            let event = if credit == 0 {
                match events.recv_timeout(STREAM_IDLE) {
                    Ok(ev) => ev,
                    Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                        log::warn!("download id={id} path={path}: host stopped reading");
                        return;
                    }
                }
            } else {
                match events.try_recv() {
                    Ok(ev) => ev,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            match event {
                StreamEvent::Credit(n) => credit += u64::from(n),
                StreamEvent::Cancel | StreamEvent::Disconnected => return,
                StreamEvent::Data(_) | StreamEvent::End => {}
            }
        }
        let want = credit.min(MAX_CHUNK as u64) as usize;
        let n = match file.read(&mut buf[..want]) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return sink.error(id, &io_error(path, "read", &e)),
        };
        if n == 0 {
            sink.send(&Frame::new(FrameKind::End, id, vec![]));
            return;
        }
        sink.send(&Frame::new(FrameKind::Data, id, buf[..n].to_vec()));
        credit -= n as u64;
    }
}

/// Removes the temporary file unless the upload was committed.
struct TempFile {
    path: PathBuf,
    committed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

fn prepare_upload(path: &str, id: u64) -> Result<(File, TempFile), GuestError> {
    let p = check_path(path)?;
    let name = match p.file_name() {
        Some(n) if !path.ends_with('/') => n.to_string_lossy().into_owned(),
        _ => {
            return Err(GuestError::InvalidPath(format!(
                "{path} is a directory, not a file path"
            )))
        }
    };
    if p.is_dir() {
        return Err(GuestError::InvalidPath(format!("{path} is a directory")));
    }
    let parent = p.parent().unwrap_or(Path::new("/"));
    DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(parent)
        .map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists | io::ErrorKind::NotADirectory => {
                GuestError::InvalidPath(format!(
                    "cannot create {}: a path component is not a directory",
                    parent.display()
                ))
            }
            _ => GuestError::Io(format!("creating {}: {e}", parent.display())),
        })?;
    let tmp_path = parent.join(format!(".{name}.agentenv-{id:x}.tmp"));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp_path)
        .map_err(|e| GuestError::Io(format!("creating {}: {e}", tmp_path.display())))?;
    let tmp = TempFile {
        path: tmp_path,
        committed: false,
    };
    // The umask may have cleared bits; the API promises 0644, owned by root.
    file.set_permissions(std::fs::Permissions::from_mode(0o644))
        .map_err(|e| GuestError::Io(format!("chmod {}: {e}", tmp.path.display())))?;
    if crate::sys::guest::is_root() {
        std::os::unix::fs::fchown(&file, Some(0), Some(0))
            .map_err(|e| GuestError::Io(format!("chown {}: {e}", tmp.path.display())))?;
    }
    Ok((file, tmp))
}

/// Receives a file from the host into a temporary file and renames it into place.
pub fn upload(path: &str, len: u64, id: u64, events: &Receiver<StreamEvent>, sink: &FrameSink) {
    match receive(path, len, id, events, sink) {
        Ok(true) => sink.response(id, &Response::Done),
        Ok(false) => log::info!("upload id={id} path={path} cancelled by the host"),
        Err(e) => sink.error(id, &e),
    }
}

/// Returns `Ok(false)` when the host cancelled or went away.
fn receive(
    path: &str,
    len: u64,
    id: u64,
    events: &Receiver<StreamEvent>,
    sink: &FrameSink,
) -> Result<bool, GuestError> {
    let (mut file, mut tmp) = prepare_upload(path, id)?;
    sink.response(id, &Response::UploadReady);
    sink.send(&Frame::credit(id, STREAM_WINDOW));
    let mut received: u64 = 0;
    let mut unacked: u32 = 0;
    loop {
        let event = match events.recv_timeout(STREAM_IDLE) {
            Ok(ev) => ev,
            Err(_) => return Ok(false),
        };
        match event {
            StreamEvent::Data(bytes) => {
                received += bytes.len() as u64;
                if received > len {
                    return Err(GuestError::Protocol(format!(
                        "upload to {path} sent more than the announced {len} bytes"
                    )));
                }
                file.write_all(&bytes)
                    .map_err(|e| GuestError::Io(format!("writing {path}: {e}")))?;
                unacked += bytes.len() as u32;
                if unacked >= STREAM_WINDOW / 2 {
                    sink.send(&Frame::credit(id, unacked));
                    unacked = 0;
                }
            }
            StreamEvent::End => break,
            StreamEvent::Credit(_) => {}
            StreamEvent::Cancel | StreamEvent::Disconnected => return Ok(false),
        }
    }
    if received != len {
        return Err(GuestError::Protocol(format!(
            "upload to {path} ended after {received} of {len} bytes"
        )));
    }
    drop(file);
    std::fs::rename(&tmp.path, path).map_err(|e| match e.kind() {
        io::ErrorKind::IsADirectory | io::ErrorKind::DirectoryNotEmpty => {
            GuestError::InvalidPath(format!("{path} is a directory"))
        }
        _ => GuestError::Io(format!("renaming into {path}: {e}")),
    })?;
    tmp.committed = true;
    Ok(true)
}
