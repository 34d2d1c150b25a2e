//! Reads the run files the charts are drawn from: `metrics.jsonl`, `memory.json` and the
//! Chrome trace, each into what its chart needs. Every failure names the file (and the line of
//! a JSON-lines file).

use std::path::Path;

use serde::Deserialize;

use super::PlotError;

/// The fields of one `metrics.jsonl` record that the charts use (see
/// `merak_burn::train::StepMetrics`); a non-finite value is written as `null`, read as `None`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct StepRecord {
    /// 1-based step number.
    pub step: u64,
    /// Mean training loss of the step.
    #[serde(default)]
    pub loss: Option<f64>,
    /// Validation loss, on the steps where it was measured.
    #[serde(default)]
    pub val_loss: Option<f64>,
    /// Tokens of the global batch per second of wall time.
    #[serde(default)]
    pub tokens_per_s: Option<f64>,
    /// Under a mixture of experts: each MoE layer's assignments per expert.
    #[serde(default)]
    pub expert_tokens: Option<Vec<Vec<u64>>>,
}

/// One rank's line of `memory.json` (see `merak_burn::train::report_memory`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct RankMemory {
    /// The rank.
    pub rank: usize,
    /// Its peak resident memory in MiB.
    pub peak_rss_mib: Option<f64>,
}

/// `memory.json`: the pipeline schedule and every rank's peak memory.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct MemoryReport {
    /// The pipeline schedule's name.
    #[serde(default)]
    pub schedule: String,
    /// Every rank's line.
    pub ranks: Vec<RankMemory>,
}

/// One span of a Chrome trace: a complete (`"ph": "X"`) event.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The rank (the event's `tid`).
    pub rank: u64,
    /// Its category (`forward`, `backward`, ..., `idle`).
    pub category: String,
    /// Start in microseconds.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// A Chrome trace event as written (other fields are ignored).
#[derive(Deserialize)]
struct RawEvent {
    #[serde(default)]
    ph: Option<String>,
    #[serde(default)]
    cat: Option<String>,
    #[serde(default)]
    ts: Option<f64>,
    #[serde(default)]
    dur: Option<f64>,
    #[serde(default)]
    tid: Option<u64>,
}

/// The text of `path`, or `None` when it does not exist and `optional`.
fn read_text(path: &Path, optional: bool) -> Result<Option<String>, PlotError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if optional && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(PlotError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The records of `metrics.jsonl` at `path`, in file order. Blank lines are skipped; a line that
/// is not a JSON object with a whole `step` is an error naming the file and the line.
pub fn metrics(path: &Path) -> Result<Vec<StepRecord>, PlotError> {
    let text = read_text(path, false)?.unwrap_or_default();
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(line).map_err(|e| PlotError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        records.push(record);
    }
    Ok(records)
}

/// `memory.json` at `path`, or `None` when there is none.
pub fn memory(path: &Path) -> Result<Option<MemoryReport>, PlotError> {
    let Some(text) = read_text(path, true)? else {
        return Ok(None);
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| PlotError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
}

/// The complete events of the Chrome trace at `path` that have a rank, a start and a
/// duration (metadata events and others are left out), or `None` when there is no such file.
pub fn trace(path: &Path) -> Result<Option<Vec<Span>>, PlotError> {
    let Some(text) = read_text(path, true)? else {
        return Ok(None);
    };
    let parse_error = |reason: String| PlotError::Parse {
        path: path.to_path_buf(),
        reason,
    };
    let mut file: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| parse_error(e.to_string()))?;
    let events = match file.get_mut("traceEvents") {
        Some(events) => events.take(),
        None => file,
    };
    let serde_json::Value::Array(events) = events else {
        return Err(parse_error(
            "not a Chrome trace (a list of events, or an object with a `traceEvents` list)".into(),
        ));
    };
    let spans = events
        .into_iter()
        .filter_map(|e| serde_json::from_value::<RawEvent>(e).ok())
        .filter(|e| e.ph.as_deref() == Some("X"))
        .filter_map(|e| {
            Some(Span {
                rank: e.tid?,
                category: e.cat.unwrap_or_default(),
                start_us: e.ts.filter(|t| t.is_finite())?,
                dur_us: e.dur.filter(|d| d.is_finite() && *d >= 0.0)?,
            })
        })
        .collect();
    Ok(Some(spans))
}
