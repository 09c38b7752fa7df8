//! A bounded history of the numbers `GET /metrics` shows, for the console's host page
//! (`GET /metrics/history`, api.md §4.24).
//!
//! Thread: `metrics-history` renders the orchestrator's metrics every
//! `[metrics] history_interval_secs` and keeps the samples of the last hour (at most
//! [`MAX_SAMPLES`]). It parses the same Prometheus text `/metrics` serves, so the console
//! plots exactly those numbers. Histogram buckets are left out (the sums and counts
//! give the mean latencies); each sample holds at most [`MAX_SERIES`] series.

use crate::orchestrator::Orchestrator;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use serde_json::{json, Map, Value};
use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// How far back the history goes.
const SPAN: Duration = Duration::from_secs(3600);
/// Samples kept at most, whatever the interval.
pub const MAX_SAMPLES: usize = 3600;
/// Series kept per sample at most.
pub const MAX_SERIES: usize = 512;

/// One sample: when, and each series' value.
struct Sample {
    at_unix: u64,
    values: Vec<(Arc<str>, f64)>,
}

/// The samples of the last hour.
pub struct MetricsHistory {
    interval: Duration,
    samples: Mutex<VecDeque<Sample>>,
    /// Series names, shared by every sample that has them.
    names: Mutex<HashSet<Arc<str>>>,
}

/// The sampler thread; stops when dropped.
pub struct Sampler {
    stop: Option<Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl MetricsHistory {
    pub fn new(interval: Duration) -> Arc<MetricsHistory> {
        Arc::new(MetricsHistory {
            interval: interval.max(Duration::from_secs(1)),
            samples: Mutex::new(VecDeque::new()),
            names: Mutex::new(HashSet::new()),
        })
    }

    /// Starts the `metrics-history` thread: a sample now, then one per interval.
    pub fn start(self: &Arc<Self>, orchestrator: Weak<Orchestrator>) -> Sampler {
        let (tx, rx): (Sender<()>, Receiver<()>) = crossbeam_channel::bounded(0);
        let history = self.clone();
        let thread = std::thread::Builder::new()
            .name("metrics-history".into())
            .spawn(move || loop {
                let Some(o) = orchestrator.upgrade() else {
                    return;
                };
                history.record(crate::util::unix_secs(), &o.observe().render_metrics());
                drop(o);
                match rx.recv_timeout(history.interval) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
            })
            .expect("spawn metrics-history");
        Sampler {
            stop: Some(tx),
            thread: Some(thread),
        }
    }

    /// Adds the sample that `text` (Prometheus text) holds, dropping samples past the span.
    pub fn record(&self, at_unix: u64, text: &str) {
        let values: Vec<(Arc<str>, f64)> = parse(text)
            .take(MAX_SERIES)
            .map(|(name, v)| (self.intern(name), v))
            .collect();
        let mut samples = self.samples.lock();
        samples.push_back(Sample { at_unix, values });
        let oldest = at_unix.saturating_sub(SPAN.as_secs());
        while samples.len() > MAX_SAMPLES || samples.front().is_some_and(|s| s.at_unix < oldest) {
            samples.pop_front();
        }
    }

    fn intern(&self, name: &str) -> Arc<str> {
        let mut names = self.names.lock();
        if let Some(n) = names.get(name) {
            return n.clone();
        }
        // A bounded set: series come from our own metrics, but never grow without end.
        if names.len() >= MAX_SERIES * 4 {
            names.clear();
        }
        let n: Arc<str> = Arc::from(name);
        names.insert(n.clone());
        n
    }

    /// The samples taken after `since` (unix seconds), oldest first, as the API's JSON.
    pub fn to_json(&self, since: u64, node: &str) -> Value {
        let samples: Vec<Value> = self
            .samples
            .lock()
            .iter()
            .filter(|s| s.at_unix > since)
            .map(|s| {
                let values: Map<String, Value> = s
                    .values
                    .iter()
                    .map(|(k, v)| (k.to_string(), json!(v)))
                    .collect();
                json!({"timestampUnix": s.at_unix, "values": values})
            })
            .collect();
        json!({
            "node": node,
            "intervalSecs": self.interval.as_secs(),
            "samples": samples,
        })
    }
}

/// The `series value` lines of Prometheus text, without comments and histogram buckets.
fn parse(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let (name, value) = line.rsplit_once(' ')?;
        let family = name.split('{').next().unwrap_or(name);
        if family.ends_with("_bucket") {
            return None;
        }
        Some((name, value.parse::<f64>().ok().filter(|v| v.is_finite())?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP a A.\n# TYPE a gauge\na{state=\"x y\"} 3\nb 1.5\n\
        h_bucket{le=\"1\"} 2\nh_sum 0.5\nh_count 2\nbad line\n";

    #[test]
    fn keeps_series_but_not_buckets_or_comments() {
        let h = MetricsHistory::new(Duration::from_secs(10));
        h.record(100, TEXT);
        let v = h.to_json(0, "node-1");
        assert_eq!(v["node"], "node-1");
        assert_eq!(v["intervalSecs"], 10);
        let values = &v["samples"][0]["values"];
        assert_eq!(values["a{state=\"x y\"}"], 3.0);
        assert_eq!(values["b"], 1.5);
        assert_eq!(values["h_sum"], 0.5);
        assert_eq!(values["h_count"], 2.0);
        assert_eq!(values.as_object().unwrap().len(), 4);
        assert_eq!(v["samples"][0]["timestampUnix"], 100);
    }

    #[test]
    fn bounded_to_the_last_hour_and_filtered_by_since() {
        let h = MetricsHistory::new(Duration::from_secs(1));
        for t in 0..5000u64 {
            h.record(t, "a 1\n");
        }
        let all = h.to_json(0, "n");
        let samples = all["samples"].as_array().unwrap();
        assert!(samples.len() <= MAX_SAMPLES);
        assert_eq!(samples.last().unwrap()["timestampUnix"], 4999);
        assert!(samples[0]["timestampUnix"].as_u64().unwrap() >= 4999 - 3600);
        let recent = h.to_json(4997, "n");
        assert_eq!(recent["samples"].as_array().unwrap().len(), 2);
        let many: String = (0..2000).map(|i| format!("s{i} 1\n")).collect();
        h.record(6000, &many);
        let last = h.to_json(5999, "n");
        let n = last["samples"][0]["values"].as_object().unwrap().len();
        assert_eq!(n, MAX_SERIES);
    }
}
