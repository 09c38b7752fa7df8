//! The host client against a hostile guest (a fake peer on a unix socket pair): floods,
//! data beyond its credit, giant frames, output beyond its cap. Each closes the channel
//! with a protocol violation, or is cut to size; nothing unbounded is buffered.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::protocol::{
    write_frame, Frame, FrameKind, FrameReader, Request, Response, MAX_CHUNK, PROTOCOL_VERSION,
    STREAM_WINDOW,
};
use super::{AgentClient, AgentError, ExecRequest, ExecResult, CALL_QUEUE, MAX_SKIPPED};

/// A client whose guest end runs `guest` on a thread.
fn hostile(
    guest: impl FnOnce(FrameReader<UnixStream>, UnixStream) + Send + 'static,
) -> AgentClient {
    let (host, peer) = UnixStream::pair().unwrap();
    let writer = peer.try_clone().unwrap();
    std::thread::spawn(move || guest(FrameReader::new(peer), writer));
    AgentClient::from_stream(host).unwrap()
}

fn answer_hello(r: &mut FrameReader<UnixStream>, w: &mut UnixStream) {
    let f = r.read_frame().unwrap().unwrap();
    assert!(matches!(
        serde_json::from_slice::<Request>(&f.payload).unwrap(),
        Request::Hello { .. }
    ));
    let hello = Response::Hello {
        version: PROTOCOL_VERSION,
        agent: "hostile".into(),
    };
    write_frame(w, &Frame::json(FrameKind::Response, f.id, &hello)).unwrap();
}

/// Waits for the client to report the guest's violation.
fn violation(client: &AgentClient) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(v) = client.protocol_violation() {
            return v;
        }
        assert!(Instant::now() < deadline, "no protocol violation reported");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// After a violation every call fails fast with a protocol error.
fn assert_closed(client: &AgentClient) {
    match client.ping(Duration::from_secs(5)) {
        Err(AgentError::Protocol(m)) => assert!(m.contains("broke the agent protocol"), "{m}"),
        other => panic!("ping after a violation: {other:?}"),
    }
}

/// `FileOpened` for the first request, after reading the host's initial credit.
fn open_file(r: &mut FrameReader<UnixStream>, w: &mut UnixStream) -> u64 {
    let req = r.read_frame().unwrap().unwrap();
    let credit = r.read_frame().unwrap().unwrap();
    assert_eq!(credit.kind, FrameKind::Credit);
    assert_eq!(credit.credit_bytes(), STREAM_WINDOW);
    let opened = Response::FileOpened { size: 1 << 40 };
    write_frame(w, &Frame::json(FrameKind::Response, req.id, &opened)).unwrap();
    req.id
}

#[test]
fn data_beyond_the_granted_credit_closes_the_channel() {
    let client = hostile(|mut r, mut w| {
        let id = open_file(&mut r, &mut w);
        let chunk = vec![7u8; MAX_CHUNK];
        for _ in 0..(STREAM_WINDOW as usize / MAX_CHUNK + 4) {
            if write_frame(&mut w, &Frame::new(FrameKind::Data, id, chunk.clone())).is_err() {
                return;
            }
        }
    });
    let download = client.read_file("/big").unwrap();
    let v = violation(&client);
    assert!(v.contains("bytes of credit"), "{v}");
    drop(download);
    assert_closed(&client);
}

#[test]
fn giant_frames_are_refused_before_they_are_buffered() {
    let client = hostile(|mut r, mut w| {
        answer_hello(&mut r, &mut w);
        // A response announcing 4 GiB - 1, then a trickle: the host must not wait for it.
        let mut giant = Frame::new(FrameKind::Response, 1, vec![]).encode();
        giant[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let _ = w.write_all(&giant);
        let _ = w.write_all(&[b'{'; 1000]);
        std::thread::sleep(Duration::from_secs(30));
    });
    client.ping(Duration::from_secs(5)).unwrap();
    let v = violation(&client);
    assert!(v.contains("Response frame of 4294967295 bytes"), "{v}");
    assert_closed(&client);

    let client = hostile(|mut r, mut w| {
        answer_hello(&mut r, &mut w);
        let _ = write_frame(
            &mut w,
            &Frame::new(FrameKind::Data, 1, vec![0; MAX_CHUNK + 1]),
        );
        std::thread::sleep(Duration::from_secs(30));
    });
    client.ping(Duration::from_secs(5)).unwrap();
    let v = violation(&client);
    assert!(v.contains("Data frame of 65537 bytes"), "{v}");
}

#[test]
fn a_flood_of_garbage_closes_the_channel() {
    let client = hostile(|_r, mut w| {
        let junk = vec![0u8; 1 << 20];
        for _ in 0..(MAX_SKIPPED >> 20) + 2 {
            if w.write_all(&junk).is_err() {
                return;
            }
        }
    });
    let v = violation(&client);
    assert!(v.contains("bytes that are not frames"), "{v}");
}

#[test]
fn unread_frames_beyond_the_call_queue_close_the_channel() {
    let client = hostile(|mut r, mut w| {
        let id = open_file(&mut r, &mut w);
        // One byte each: well within the credit, far beyond the queue.
        for _ in 0..CALL_QUEUE + 10 {
            if write_frame(&mut w, &Frame::new(FrameKind::Data, id, vec![1])).is_err() {
                return;
            }
        }
    });
    let _download = client.read_file("/f").unwrap();
    let v = violation(&client);
    assert!(v.contains("unread frames"), "{v}");
}

#[test]
fn host_only_frame_kinds_from_the_guest_close_the_channel() {
    let client = hostile(|mut r, mut w| {
        answer_hello(&mut r, &mut w);
        let _ = write_frame(&mut w, &Frame::new(FrameKind::Cancel, 1, vec![]));
        std::thread::sleep(Duration::from_secs(30));
    });
    client.ping(Duration::from_secs(5)).unwrap();
    assert!(violation(&client).contains("Cancel frame"));
}

#[test]
fn exec_output_is_cut_to_the_cap_on_the_host() {
    let client = hostile(|mut r, mut w| {
        let f = r.read_frame().unwrap().unwrap();
        // "é" is two bytes: a cap of 101 falls inside one.
        let result = ExecResult {
            exit_code: 0,
            stdout: "é".repeat(5000),
            stderr: "x".repeat(50),
            timed_out: false,
            stdout_truncated: false,
            stderr_truncated: false,
            duration_ms: 1,
        };
        write_frame(
            &mut w,
            &Frame::json(FrameKind::Response, f.id, &Response::Exec(result)),
        )
        .unwrap();
    });
    let out = client
        .exec(&ExecRequest {
            cmd: "x".into(),
            args: vec![],
            env: vec![],
            cwd: "/".into(),
            timeout_ms: 1000,
            max_output_bytes: 101,
        })
        .unwrap();
    assert_eq!(out.stdout, "é".repeat(50));
    assert!(out.stdout_truncated);
    assert_eq!(out.stderr, "x".repeat(50));
    assert!(!out.stderr_truncated);
}
