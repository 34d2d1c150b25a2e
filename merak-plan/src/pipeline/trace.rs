//! Timelines in the Chrome trace format (viewable in Perfetto or `chrome://tracing`).
//!
//! A [`TraceEvent`] is one span of one pipeline rank: a forward, a backward, a message, the
//! optimizer step, or an idle gap. [`chrome_trace`] lays them out as one process (`pid` 0) with
//! one thread per rank (`tid` = rank, named `rank R`), every span a complete (`"ph": "X"`) event
//! with its start and duration in microseconds.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// Category of forward passes.
pub const CATEGORY_FORWARD: &str = "forward";
/// Category of backward passes.
pub const CATEGORY_BACKWARD: &str = "backward";
/// Category of DualPipeV's overlapped pairs (a forward and a backward as one action).
pub const CATEGORY_PAIR: &str = "forward+backward";
/// Category of weight-gradient passes (W) of a split backward.
pub const CATEGORY_WEIGHT: &str = "weight";
/// Category of recomputed forward passes.
pub const CATEGORY_RECOMPUTE: &str = "recompute";
/// Category of sends (activations and gradients).
pub const CATEGORY_SEND: &str = "send";
/// Category of receives (activations and gradients).
pub const CATEGORY_RECV: &str = "recv";
/// Category of optimizer steps.
pub const CATEGORY_OPTIMIZER: &str = "optimizer";
/// Category of the gaps in which a rank waits.
pub const CATEGORY_IDLE: &str = "idle";

/// One span on one pipeline rank's timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// Pipeline rank (the trace's thread).
    pub rank: usize,
    /// What ran, e.g. `Forward(mb=0, stage=1) [step 0]` or `idle`.
    pub name: String,
    /// One of `forward`, `backward`, `forward+backward`, `weight`, `recompute`, `send`, `recv`, `optimizer`, `idle` (the
    /// `CATEGORY_*` constants).
    pub category: String,
    /// Start, in seconds from the start of the timeline.
    pub start_s: f64,
    /// Duration in seconds.
    pub dur_s: f64,
}

/// The Chrome trace JSON of `events`: `{"traceEvents": [...], "displayTimeUnit": "ms"}` with a
/// `process_name` metadata event for `pid` 0, `thread_name` (`rank R`) and `thread_sort_index`
/// metadata events (`"ph": "M"`) for every rank that appears, then one complete event
/// (`"ph": "X"`, `"ts"` and `"dur"` in microseconds, `"pid": 0`, `"tid"`: the rank) per event.
pub fn chrome_trace(events: &[TraceEvent]) -> Value {
    let ranks: BTreeSet<usize> = events.iter().map(|e| e.rank).collect();
    let mut out = Vec::with_capacity(events.len() + 2 * ranks.len() + 1);
    out.push(json!({
        "name": "process_name",
        "ph": "M",
        "pid": 0,
        "tid": 0,
        "args": { "name": "pipeline" },
    }));
    for &rank in &ranks {
        out.push(json!({
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": rank,
            "args": { "name": format!("rank {rank}") },
        }));
        out.push(json!({
            "name": "thread_sort_index",
            "ph": "M",
            "pid": 0,
            "tid": rank,
            "args": { "sort_index": rank },
        }));
    }
    for e in events {
        out.push(json!({
            "name": e.name,
            "cat": e.category,
            "ph": "X",
            "ts": e.start_s * 1e6,
            "dur": e.dur_s * 1e6,
            "pid": 0,
            "tid": e.rank,
        }));
    }
    json!({ "traceEvents": out, "displayTimeUnit": "ms" })
}

/// Writes [`chrome_trace`] of `events` to `path` (JSON; open it in Perfetto).
pub fn write_chrome_trace(path: &Path, events: &[TraceEvent]) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(&chrome_trace(events)).map_err(std::io::Error::other)?;
    std::fs::write(path, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(rank: usize, name: &str, category: &str, start_s: f64, dur_s: f64) -> TraceEvent {
        TraceEvent {
            rank,
            name: name.to_string(),
            category: category.to_string(),
            start_s,
            dur_s,
        }
    }

    #[test]
    fn chrome_trace_has_the_expected_fields() {
        let events = vec![
            event(0, "Forward(mb=0, stage=0)", CATEGORY_FORWARD, 0.0, 0.5),
            event(1, "idle", CATEGORY_IDLE, 0.0, 0.5),
            event(1, "Forward(mb=0, stage=1)", CATEGORY_FORWARD, 0.5, 0.25),
        ];
        let trace = chrome_trace(&events);
        let list = trace["traceEvents"].as_array().unwrap();
        let threads: Vec<_> = list
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .collect();
        assert_eq!(threads.len(), 2);
        assert_eq!(threads[0]["tid"], 0);
        assert_eq!(threads[0]["args"]["name"], "rank 0");
        assert_eq!(threads[1]["args"]["name"], "rank 1");
        let spans: Vec<_> = list.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), 3);
        for (span, e) in spans.iter().zip(&events) {
            assert_eq!(span["name"], e.name.as_str());
            assert_eq!(span["cat"], e.category.as_str());
            assert_eq!(span["pid"], 0);
            assert_eq!(span["tid"], e.rank);
            assert!((span["ts"].as_f64().unwrap() - e.start_s * 1e6).abs() < 1e-6);
            assert!((span["dur"].as_f64().unwrap() - e.dur_s * 1e6).abs() < 1e-6);
        }
        assert_eq!(spans[2]["ts"].as_f64(), Some(500_000.0));
        assert_eq!(spans[2]["dur"].as_f64(), Some(250_000.0));
    }

    #[test]
    fn writes_a_json_file() {
        let dir = std::env::temp_dir().join(format!("merak-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trace.json");
        let events = vec![event(2, "OptimizerStep", CATEGORY_OPTIMIZER, 1.0, 0.1)];
        write_chrome_trace(&path, &events).unwrap();
        let back: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(back, chrome_trace(&events));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
