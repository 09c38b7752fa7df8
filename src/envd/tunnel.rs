//! A byte tunnel between a client's upgraded connection (a WebSocket, or any other
//! HTTP/1.1 upgrade the guest accepted with `101`) and the guest's port.
//!
//! Two directions at once: the calling thread copies client → guest, an `envd-tunnel`
//! thread copies guest → client, each byte written (and flushed) as it arrives. Both
//! sides' reads wake every poll interval (the guest socket's read timeout, and the
//! client reader's per-read timeout that the caller sets) to check three things: the
//! other direction ended, the sandbox no longer runs the VM instance, or neither
//! direction moved a byte for `idle` (a tunnel that never closes holds a thread pair for
//! at most that long). The client closing its side half-closes the guest's; the guest
//! closing its side ends the tunnel.

use super::{EnvdError, Patience, Upgraded};
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes moved each way, and why the tunnel ended.
#[derive(Debug)]
pub struct Totals {
    pub to_guest: u64,
    pub to_client: u64,
    pub end: End,
}

/// Why a tunnel ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The guest closed its side (after the client closed, or on its own).
    GuestClosed,
    /// Nothing moved either way for the idle limit.
    Idle,
    /// The sandbox stopped running the VM instance.
    Stopped,
    /// A read or write failed (a reset, a client that stopped reading).
    Broken,
}

/// What both directions share: when a byte last moved, and whether one has ended.
struct Shared {
    started: Instant,
    last_ms: AtomicU64,
    done: AtomicBool,
    patience: Patience,
}

impl Shared {
    fn touch(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Why a waiting read should give up now, if it should.
    fn should_end(&self) -> Option<End> {
        if self.done.load(Ordering::Acquire) {
            return Some(End::GuestClosed);
        }
        if !(self.patience.alive)() {
            return Some(End::Stopped);
        }
        let quiet =
            self.started.elapsed().as_millis() as u64 - self.last_ms.load(Ordering::Relaxed);
        (Duration::from_millis(quiet) >= self.patience.idle).then_some(End::Idle)
    }
}

/// Relays between the client's halves and the guest until one of the ends above. The
/// client reader must time out its reads (tiny_http's per-read timeout), or a quiet
/// client holds the tunnel past its idle limit.
pub fn relay(
    mut client_reader: Box<dyn Read + Send>,
    client_writer: Box<dyn Write + Send>,
    guest: Upgraded,
    patience: Patience,
) -> Result<Totals, EnvdError> {
    let shared = Arc::new(Shared {
        started: Instant::now(),
        last_ms: AtomicU64::new(0),
        done: AtomicBool::new(false),
        patience,
    });
    let guest_reader = guest.stream.try_clone().map_err(EnvdError::Io)?;
    let mut guest_writer = guest.stream;
    let outbound = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("envd-tunnel".into())
            .spawn(move || to_client(guest_reader, guest.buffered, client_writer, &shared))
            .map_err(EnvdError::Io)?
    };
    let (to_guest, inbound_end) = to_guest(&mut *client_reader, &mut guest_writer, &shared);
    if inbound_end.is_some() {
        // The tunnel ends here: wake the other direction out of its read.
        shared.done.store(true, Ordering::Release);
        let _ = guest_writer.shutdown(Shutdown::Both);
    }
    let (to_client, outbound_end) = outbound.join().unwrap_or((0, End::Broken));
    Ok(Totals {
        to_guest,
        to_client,
        // The inbound side ended first for its own reason, or followed the outbound one.
        end: match inbound_end {
            None | Some(End::GuestClosed) => outbound_end,
            Some(end) => end,
        },
    })
}

/// Client → guest. `None` when the client closed its side (the guest's is half-closed
/// and the other direction goes on), else why the tunnel must end.
fn to_guest(client: &mut dyn Read, guest: &mut TcpStream, shared: &Shared) -> (u64, Option<End>) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut moved = 0u64;
    loop {
        match client.read(&mut buf) {
            Ok(0) => {
                let _ = guest.shutdown(Shutdown::Write);
                return (moved, None);
            }
            Ok(n) => {
                if guest.write_all(&buf[..n]).is_err() {
                    return (moved, Some(End::Broken));
                }
                moved += n as u64;
                shared.touch();
            }
            Err(e) if waited(&e) => {
                if let Some(end) = shared.should_end() {
                    return (moved, Some(end));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return (moved, Some(End::Broken)),
        }
    }
}

/// Guest → client, starting with what the guest sent along with its `101`. Always ends
/// the tunnel.
fn to_client(
    mut guest: TcpStream,
    buffered: Vec<u8>,
    mut client: Box<dyn Write + Send>,
    shared: &Shared,
) -> (u64, End) {
    let mut moved = 0u64;
    let end = (|| {
        if !buffered.is_empty() {
            client.write_all(&buffered)?;
            client.flush()?;
            moved += buffered.len() as u64;
        }
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match guest.read(&mut buf) {
                Ok(0) => return Ok(End::GuestClosed),
                Ok(n) => {
                    client.write_all(&buf[..n])?;
                    client.flush()?;
                    moved += n as u64;
                    shared.touch();
                }
                Err(e) if waited(&e) => {
                    if let Some(end) = shared.should_end() {
                        return Ok(end);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    })()
    .unwrap_or(End::Broken);
    shared.done.store(true, Ordering::Release);
    (moved, end)
}

/// A read that only waited (its timeout passed with nothing to read).
fn waited(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A socket pair: (our end, the peer's end).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    fn patience(idle: Duration) -> Patience {
        Patience {
            idle,
            alive: Arc::new(|| true),
        }
    }

    /// Guest socket with a short read timeout, as `Connection::open` sets one.
    fn guest_end() -> (Upgraded, TcpStream) {
        let (ours, theirs) = pair();
        ours.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let upgraded = Upgraded {
            stream: ours,
            buffered: b"early ".to_vec(),
        };
        (upgraded, theirs)
    }

    /// The client's halves (reads time out, as tiny_http's per-read timeout does) and
    /// the client's own socket.
    fn client_end() -> (Box<dyn Read + Send>, Box<dyn Write + Send>, TcpStream) {
        let (ours, theirs) = pair();
        ours.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        (Box::new(ours.try_clone().unwrap()), Box::new(ours), theirs)
    }

    #[test]
    fn bytes_flow_both_ways_and_the_guest_closing_ends_it() {
        let (guest, mut guest_peer) = guest_end();
        let (reader, writer, mut client_peer) = client_end();
        let relay = std::thread::spawn(move || {
            relay(reader, writer, guest, patience(Duration::from_secs(30))).unwrap()
        });
        client_peer.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        guest_peer.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        guest_peer.write_all(b"pong").unwrap();
        let mut got = [0u8; 10];
        client_peer.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"early pong", "buffered bytes come first");
        drop(guest_peer);
        let totals = relay.join().unwrap();
        assert_eq!(totals.end, End::GuestClosed);
        assert_eq!((totals.to_guest, totals.to_client), (4, 10));
    }

    #[test]
    fn a_quiet_tunnel_ends_at_the_idle_limit() {
        let (guest, _guest_peer) = guest_end();
        let (reader, writer, mut client_peer) = client_end();
        let totals = relay(reader, writer, guest, patience(Duration::from_millis(300))).unwrap();
        assert_eq!(totals.end, End::Idle);
        let mut rest = Vec::new();
        client_peer
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let _ = client_peer.read_to_end(&mut rest);
        assert_eq!(rest, b"early ");
    }
}
