//! Each sandbox's metrics over its life (api.md §4.21): what its guest sees of its CPU,
//! memory and root disk, sampled while it runs.
//!
//! Thread: `sandbox-metrics` asks every running sandbox's guest agent (`GET /metrics`)
//! every `[metrics] sandbox_interval_secs`, one guest after another with a short
//! timeout, and keeps the answers in the sandbox's [`MetricsRing`] (at most
//! [`MAX_SAMPLES`], the oldest dropped first). The samples live as long as the sandbox's
//! entry, across pauses; a server restart forgets them. Timestamps are the host's clock,
//! which is what a client's `start`/`end` refer to. The same round takes each running
//! guest's new console lines into its log ([`super::sandbox_log`]).

use super::registry::Registry;
use super::sandbox::SandboxEntry;
use crate::agent::protocol::GuestMetrics;
use crate::agent::{AgentClient, AgentError};
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Weak;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Samples kept per sandbox: 2 hours at the default 5 s.
pub const MAX_SAMPLES: usize = 1440;
/// The longest wait for one guest's answer; a guest that does not answer in time gives
/// no sample this round.
const GUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// One sample of a guest, as the E2B metrics model reports it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GuestSample {
    /// Host time of the sample, unix milliseconds.
    pub at_unix_ms: u64,
    pub cpu_count: u64,
    /// 0..=100.
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// The host's counts for the sandbox's current slot (network.md §5.8), not the
    /// guest's, since it started or resumed: bytes sent out, new outbound connections its
    /// policy refused, and new connections to what is always refused (the host, other
    /// sandboxes, the denied ranges).
    pub egress_bytes: u64,
    pub egress_refused: u64,
    pub egress_refused_protected: u64,
}

impl GuestSample {
    /// Parses envd's `GET /metrics` body (untrusted: a bad one is `None`).
    pub fn parse(body: &[u8], at: SystemTime) -> Option<GuestSample> {
        Some(GuestSample::from_guest(
            serde_json::from_slice(body).ok()?,
            at,
        ))
    }

    /// A guest's answer taken at `at` (untrusted: a percentage outside 0..=100 is
    /// clamped; the guest's own clock is not used).
    pub fn from_guest(a: GuestMetrics, at: SystemTime) -> GuestSample {
        let pct = if a.cpu_used_pct.is_finite() {
            a.cpu_used_pct.clamp(0.0, 100.0)
        } else {
            0.0
        };
        GuestSample {
            at_unix_ms: unix_ms(at),
            cpu_count: a.cpu_count,
            cpu_used_pct: pct,
            mem_used: a.mem_used,
            mem_total: a.mem_total,
            mem_cache: a.mem_cache,
            disk_used: a.disk_used,
            disk_total: a.disk_total,
            egress_bytes: 0,
            egress_refused: 0,
            egress_refused_protected: 0,
        }
    }
}

fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A sandbox's samples, oldest first.
#[derive(Default)]
pub struct MetricsRing {
    samples: Mutex<VecDeque<GuestSample>>,
}

impl MetricsRing {
    pub fn push(&self, sample: GuestSample) {
        let mut samples = self.samples.lock();
        if samples.len() == MAX_SAMPLES {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// The samples taken in `[start, end]` (unix seconds, both inclusive).
    pub fn between(&self, start: u64, end: u64) -> Vec<GuestSample> {
        let (from, to) = (
            start.saturating_mul(1000),
            end.saturating_mul(1000).saturating_add(999),
        );
        self.samples
            .lock()
            .iter()
            .filter(|s| (from..=to).contains(&s.at_unix_ms))
            .copied()
            .collect()
    }

    pub fn latest(&self) -> Option<GuestSample> {
        self.samples.lock().back().copied()
    }
}

/// Asks one running guest's agent for a sample; `None` when it does not answer in time.
/// An agent from before [`crate::agent::protocol::Request::Metrics`] (restored from a
/// capture an older server made) refuses it as a protocol error: its envd is asked.
fn sample_guest(agent: &AgentClient, addr: SocketAddr) -> Option<GuestSample> {
    match agent.metrics(GUEST_TIMEOUT) {
        Ok(m) => Some(GuestSample::from_guest(m, SystemTime::now())),
        Err(AgentError::Protocol(_)) => sample_envd(addr),
        Err(_) => None,
    }
}

/// Asks one running guest's envd (`GET /metrics`) for a sample; `None` when it does not
/// answer in time or answers nonsense.
fn sample_envd(addr: SocketAddr) -> Option<GuestSample> {
    let (status, body) = crate::envd::call(
        addr,
        "GET",
        "/metrics",
        "application/json",
        b"",
        GUEST_TIMEOUT,
    )
    .ok()?;
    (status == 200)
        .then(|| GuestSample::parse(&body, SystemTime::now()))
        .flatten()
}

/// Starts the sampler; it ends with the registry.
pub(crate) fn spawn(registry: Weak<Registry>, interval: Duration, agent_port: u16) {
    super::registry::spawn_periodic("sandbox-metrics", registry, interval, move |registry| {
        for entry in registry.entries() {
            sample_entry(&entry, agent_port);
            // The console's new lines go to the sandbox's log while it runs.
            if entry.guest_agent_addr(agent_port).is_some() {
                let id = entry.id();
                entry
                    .log
                    .read_console(&registry.dir(&id).join("console.log"));
            }
        }
    });
}

fn sample_entry(entry: &SandboxEntry, agent_port: u16) {
    let Some(addr) = entry.guest_agent_addr(agent_port) else {
        return;
    };
    // A pause that began during the call leaves the sample out: a paused sandbox's
    // history ends where it stopped.
    if let Some(sample) =
        sample_sandbox(entry, addr).filter(|_| entry.guest_agent_addr(agent_port).is_some())
    {
        entry.metrics.push(sample);
    }
}

/// One sample of a running sandbox: its guest's answer and its slot's egress counters.
pub(crate) fn sample_sandbox(entry: &SandboxEntry, addr: SocketAddr) -> Option<GuestSample> {
    let mut sample = sample_guest(&entry.runtime()?.agent, addr)?;
    if let Some(c) = egress_counts(entry) {
        sample.egress_bytes = c.bytes_out;
        sample.egress_refused = c.refused;
        sample.egress_refused_protected = c.refused_protected;
    }
    Some(sample)
}

/// The running sandbox's egress counters, from its supervisor (which owns the slot).
fn egress_counts(entry: &SandboxEntry) -> Option<crate::net::EgressCounts> {
    let ops = entry.runtime()?.ops;
    let (reply, answer) = crossbeam_channel::bounded(1);
    ops.send(super::sandbox::Op::EgressCounts { reply }).ok()?;
    answer.recv_timeout(GUEST_TIMEOUT).ok().flatten()
}

/// `agentenv_sandbox_egress_bytes_total{sandbox}`,
/// `agentenv_sandbox_egress_refused_total{sandbox}` and
/// `agentenv_sandbox_egress_refused_protected_total{sandbox}` of every running sandbox,
/// from its newest sample (network.md §5.8). They restart from zero when a sandbox resumes.
pub(crate) fn render_egress(out: &mut String, entries: &[std::sync::Arc<SandboxEntry>]) {
    use std::fmt::Write;
    let latest: Vec<(String, GuestSample)> = entries
        .iter()
        .filter(|e| e.has_runtime())
        .filter_map(|e| Some((e.id(), e.metrics.latest()?)))
        .collect();
    for (name, help, value) in [
        (
            "agentenv_sandbox_egress_bytes_total",
            "Bytes each running sandbox sent beyond its slot, since it started or resumed.",
            (|s: &GuestSample| s.egress_bytes) as fn(&GuestSample) -> u64,
        ),
        (
            "agentenv_sandbox_egress_refused_total",
            "New outbound connections of each running sandbox its egress policy refused.",
            |s: &GuestSample| s.egress_refused,
        ),
        (
            "agentenv_sandbox_egress_refused_protected_total",
            "New connections of each running sandbox to the host, other sandboxes or denied ranges, refused.",
            |s: &GuestSample| s.egress_refused_protected,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (id, sample) in &latest {
            let _ = writeln!(out, "{name}{{sandbox=\"{id}\"}} {}", value(sample));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::protocol::{
        write_frame, ErrorKind, Frame, FrameKind, FrameReader, Request, Response, PROTOCOL_VERSION,
    };
    use std::os::unix::net::UnixStream;

    /// An agent from before `Metrics`: it answers a ping and refuses every other call as
    /// an undecodable request, as that agent did.
    fn old_agent() -> AgentClient {
        let (host, guest) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let mut writer = guest.try_clone().unwrap();
            let mut frames = FrameReader::new(guest);
            while let Ok(Some(frame)) = frames.read_frame() {
                let answer = match serde_json::from_slice::<Request>(&frame.payload) {
                    Ok(Request::Hello { .. }) => Response::Hello {
                        version: PROTOCOL_VERSION,
                        agent: "agentenv-agent old".into(),
                    },
                    _ => Response::Error {
                        kind: ErrorKind::Protocol,
                        message: "undecodable request: unknown variant `metrics`".into(),
                    },
                };
                let frame = Frame::json(FrameKind::Response, frame.id, &answer);
                if write_frame(&mut writer, &frame).is_err() {
                    return;
                }
            }
        });
        AgentClient::from_stream(host).unwrap()
    }

    /// The guest-side agent of this release over a socket pair.
    fn agent() -> AgentClient {
        let (host, guest) = UnixStream::pair().unwrap();
        let writer = guest.try_clone().unwrap();
        std::thread::spawn(move || {
            let reaper = crate::guest::reaper::Reaper::own_children();
            crate::guest::AgentServer::new(reaper, false, Box::new(writer))
                .serve(guest, crate::guest::OnEof::Stop)
        });
        AgentClient::from_stream(host).unwrap()
    }

    /// An envd answering each `GET /metrics` with `body`; the paths it was asked for.
    fn envd(body: &'static str) -> (SocketAddr, crossbeam_channel::Receiver<String>) {
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        let (tx, rx) = crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            for request in server.incoming_requests() {
                let _ = tx.send(request.url().to_string());
                let _ = request.respond(tiny_http::Response::from_string(body));
            }
        });
        (addr, rx)
    }

    #[test]
    fn a_guest_is_sampled_over_its_agent_and_an_old_agent_over_its_envd() {
        let (addr, asked) = envd(r#"{"cpu_count": 3, "mem_total": 1000, "mem_used": 10}"#);
        let s = sample_guest(&agent(), addr).unwrap();
        assert!(s.mem_total > 1000 && s.cpu_count >= 1, "{s:?}");
        assert!(
            asked.try_recv().is_err(),
            "a current agent is not asked over envd"
        );
        let s = sample_guest(&old_agent(), addr).unwrap();
        assert_eq!((s.cpu_count, s.mem_total, s.mem_used), (3, 1000, 10));
        assert_eq!(
            asked.recv_timeout(Duration::from_secs(5)).unwrap(),
            "/metrics"
        );
    }

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn a_guest_answer_is_parsed_with_the_host_time_and_a_bounded_percentage() {
        let s = GuestSample::parse(
            br#"{"ts": 5, "cpu_count": 2, "cpu_used_pct": 250.5, "mem_used": 7, "x": []}"#,
            at(100),
        )
        .unwrap();
        assert_eq!(s.at_unix_ms, 100_000);
        assert_eq!(s.cpu_count, 2);
        assert_eq!(s.cpu_used_pct, 100.0);
        assert_eq!(s.mem_used, 7);
        assert_eq!(s.disk_total, 0);
        assert!(GuestSample::parse(b"not json", at(1)).is_none());
        assert!(GuestSample::parse(br#"{"cpu_count": -1}"#, at(1)).is_none());
    }

    #[test]
    fn the_ring_keeps_the_newest_samples_and_selects_by_time() {
        let ring = MetricsRing::default();
        for i in 0..(MAX_SAMPLES as u64 + 10) {
            ring.push(GuestSample {
                at_unix_ms: i * 1000,
                ..Default::default()
            });
        }
        assert_eq!(ring.between(0, u64::MAX / 1000).len(), MAX_SAMPLES);
        assert_eq!(ring.between(0, 9).len(), 0, "the oldest were dropped");
        let some = ring.between(20, 22);
        assert_eq!(
            some.iter().map(|s| s.at_unix_ms).collect::<Vec<_>>(),
            vec![20_000, 21_000, 22_000]
        );
        assert_eq!(
            ring.latest().unwrap().at_unix_ms,
            (MAX_SAMPLES as u64 + 9) * 1000
        );
    }
}
