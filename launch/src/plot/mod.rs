//! The charts `merak train` draws into its output folder at the end of a run, as SVG through
//! [plotters](https://docs.rs/plotters): the loss and the throughput per step (from
//! `metrics.jsonl`), a mixture of experts' balance per layer (from its `expert_tokens`), the
//! peak memory per rank (from `memory.json`) and the pipeline timeline
//! per rank (from the run's Chrome trace). A chart whose optional input is missing is skipped.
//!
//! No fonts are needed: plotters is built without its font features, estimates text extents
//! for layout, and leaves drawing the text to whatever views the SVG (see `style.rs`).

mod experts;
mod line;
mod loss;
mod memory;
mod read;
mod style;
mod throughput;
mod timeline;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

/// The loss chart: training loss per step and validation loss where measured.
pub const LOSS: &str = "loss.svg";
/// The throughput chart: tokens per second per step.
pub const THROUGHPUT: &str = "throughput.svg";
/// The memory chart: peak resident memory per rank (when the run wrote `memory.json`).
pub const MEMORY: &str = "memory.svg";
/// The pipeline timeline per rank (when the run wrote a Chrome trace).
pub const TIMELINE: &str = "timeline.svg";
/// The balance of a mixture of experts' routing per step (when the metrics have
/// `expert_tokens`).
pub const EXPERTS: &str = "experts.svg";

/// Every chart [`write_charts`] may write into a run's output folder.
pub const FILES: [&str; 5] = [LOSS, THROUGHPUT, MEMORY, TIMELINE, EXPERTS];

/// The run's metrics, one JSON object per line.
const METRICS_FILE: &str = "metrics.jsonl";
/// The run's memory report.
const MEMORY_FILE: &str = "memory.json";

/// Why a chart could not be drawn; every variant names the file concerned.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// A run file cannot be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line of a JSON-lines file is not a record.
    #[error("{}: line {line}: {reason}", .path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A JSON file does not hold what it should.
    #[error("{}: {reason}", .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// plotters failed to draw a chart.
    #[error("cannot draw {}: {source}", .path.display())]
    Draw {
        /// The chart's file.
        path: PathBuf,
        /// Why.
        source: style::DrawError,
    },
    /// A chart cannot be written.
    #[error("cannot write {}: {source}", .path.display())]
    Write {
        /// The chart's file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A chart that [`write_charts`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chart {
    /// What it shows, e.g. "loss curve".
    pub what: &'static str,
    /// Where it is.
    pub path: PathBuf,
}

/// Draws the charts of the run whose output folder is `out` into it, and returns them in the
/// order of [`FILES`]: [`LOSS`] and [`THROUGHPUT`] from `out/metrics.jsonl` (which must
/// exist), [`MEMORY`] from `out/memory.json` and [`TIMELINE`] from the Chrome trace at `trace`,
/// each when that file exists, and [`EXPERTS`] when the metrics have `expert_tokens`. Fails on the first file that cannot be read, parsed or written.
pub fn write_charts(out: &Path, trace: Option<&Path>) -> Result<Vec<Chart>, PlotError> {
    let run = out.file_name().map_or_else(
        || out.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let records = read::metrics(&out.join(METRICS_FILE))?;
    let mut charts = vec![
        save(out, LOSS, "loss curve", loss::chart(&run, &records))?,
        save(
            out,
            THROUGHPUT,
            "throughput",
            throughput::chart(&run, &records),
        )?,
    ];
    if let Some(report) = read::memory(&out.join(MEMORY_FILE))? {
        charts.push(save(
            out,
            MEMORY,
            "memory per rank",
            memory::chart(&run, &report),
        )?);
    }
    if let Some(spans) = trace.map(read::trace).transpose()?.flatten() {
        charts.push(save(
            out,
            TIMELINE,
            "pipeline timeline",
            timeline::chart(&run, &spans),
        )?);
    }
    if records.iter().any(|r| r.expert_tokens.is_some()) {
        charts.push(save(
            out,
            EXPERTS,
            "expert balance",
            experts::chart(&run, &records),
        )?);
    }
    Ok(charts)
}

/// Writes the rendered chart `svg` to `out/name`.
fn save(
    out: &Path,
    name: &str,
    what: &'static str,
    svg: Result<String, style::DrawError>,
) -> Result<Chart, PlotError> {
    let path = out.join(name);
    let svg = match svg {
        Ok(svg) => svg,
        Err(source) => return Err(PlotError::Draw { path, source }),
    };
    match std::fs::write(&path, svg) {
        Ok(()) => Ok(Chart { what, path }),
        Err(source) => Err(PlotError::Write { path, source }),
    }
}
