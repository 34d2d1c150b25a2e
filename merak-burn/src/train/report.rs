//! What a finished run leaves besides its metrics: each rank's peak memory and pipeline load
//! (`memory.json`), and the Chrome trace of every rank's actions.

use std::collections::BTreeMap;
use std::path::Path;

use crate::grid::ProcessGrid;
use crate::pipeline::{PipelinePlan, TraceEvent, write_chrome_trace};
use crate::planner::ModelStates;
use crate::train::TrainError;

/// Bytes of model state one rank holds, in f32 (what `merak train` trains in): counted by
/// the library from what the rank keeps, not measured, beside what the planner's accounting
/// says it keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StateBytes {
    /// Its parameters (twice under PipeDream-2BW, which keeps the previous version).
    pub params: u64,
    /// Its gradient buckets.
    pub grads: u64,
    /// The optimizer state of the parameters it steps (all of them, or its ZeRO pieces), once
    /// each has stepped.
    pub optimizer: u64,
    /// The same three by the planner's accounting of the plan
    /// ([`model_states`](crate::planner::model_states)) from this rank's parameters.
    pub planned: ModelStates,
}

const MIB: f64 = (1u64 << 20) as f64;

/// Values per rank in `memory.json`'s gather.
const FIELDS: usize = 10;

/// Gathers every rank's peak resident memory, most micro-batches in flight, model-state
/// bytes ([`StateBytes`], counted and planned) and the allocator's high-water mark at the end and when training
/// started (`startup_alloc`: [`alloc_peak_bytes`](crate::train::process::alloc_peak_bytes)
/// then, after building, sharding and resuming). Rank 0 writes
/// `out/memory.json` and, under pp > 1, logs per rank its stages, the units it recomputed, its
/// peak memory and the most micro-batches it held.
pub fn report_memory(
    grid: &ProcessGrid,
    plan: &PipelinePlan,
    max_in_flight: usize,
    state: StateBytes,
    startup_alloc: Option<u64>,
    out: &Path,
) -> Result<(), TrainError> {
    let world = grid.world.comm()?;
    let mib = |bytes: u64| (bytes as f64 / MIB) as f32;
    let mine = [
        mib(crate::train::process::peak_rss_bytes()),
        max_in_flight as f32,
        mib(state.params),
        mib(state.grads),
        mib(state.optimizer),
        // -1: the program counts no allocations.
        crate::train::process::alloc_peak_bytes().map_or(-1.0, mib),
        startup_alloc.map_or(-1.0, mib),
        (state.planned.params / MIB) as f32,
        (state.planned.grads / MIB) as f32,
        ((state.planned.master + state.planned.optimizer) / MIB) as f32,
    ];
    let mut all = vec![0.0f32; FIELDS * world.size()];
    world.all_gather(&mine, &mut all)?;
    if grid.rank != 0 {
        return Ok(());
    }
    let ranks: Vec<serde_json::Value> = all
        .chunks(FIELDS)
        .enumerate()
        .map(|(rank, v)| {
            let pp = grid.layout.coords(rank).pp;
            let stages = stages_of(plan, pp);
            let recompute: Vec<usize> = stages.iter().map(|&s| plan.recompute_units[s]).collect();
            serde_json::json!({
                "rank": rank,
                "pp_rank": pp,
                "stages": stages,
                "recompute_units": recompute,
                "peak_rss_mib": v[0],
                "max_in_flight": v[1] as usize,
                "param_mib": v[2],
                "grad_mib": v[3],
                "optimizer_mib": v[4],
                "alloc_peak_mib": (v[5] >= 0.0).then_some(v[5]),
                "startup_alloc_peak_mib": (v[6] >= 0.0).then_some(v[6]),
                "planned_param_mib": v[7],
                "planned_grad_mib": v[8],
                "planned_optimizer_mib": v[9],
            })
        })
        .collect();
    let json = serde_json::json!({
        "schedule": plan.schedule.kind.to_string(),
        "ranks": ranks,
    });
    let path = out.join("memory.json");
    let bytes = serde_json::to_vec_pretty(&json).unwrap_or_default();
    std::fs::write(&path, bytes).map_err(TrainError::io(&path))?;
    if grid.layout.pp > 1 {
        log_stage_memory(grid, plan, &all);
    }
    Ok(())
}

/// The stages that pipeline rank `pp` runs.
fn stages_of(plan: &PipelinePlan, pp: usize) -> Vec<usize> {
    (0..plan.schedule.stages())
        .filter(|&s| plan.schedule.rank_of(s) == pp)
        .collect()
}

/// Logs each rank's stages and peak memory (`all`: every rank's [`FIELDS`] values).
fn log_stage_memory(grid: &ProcessGrid, plan: &PipelinePlan, all: &[f32]) {
    for (rank, v) in all.chunks(FIELDS).enumerate() {
        let stages: Vec<String> = stages_of(plan, grid.layout.coords(rank).pp)
            .into_iter()
            .map(|s| {
                format!(
                    "{s} (units {:?}, recompute {})",
                    plan.partition.range(s),
                    plan.recompute_units[s]
                )
            })
            .collect();
        tracing::info!(
            "rank {rank}: stages {}: peak memory {:.1} MiB, at most {} micro-batches in flight",
            stages.join(", "),
            v[0],
            v[1]
        );
    }
}

/// The gaps between a rank's recorded actions, as "idle" spans (waiting for the pipeline,
/// the DP all-reduce, the optimizer and everything else outside the schedule's actions).
fn idle_gaps(events: &[TraceEvent]) -> Vec<TraceEvent> {
    let mut by_rank: BTreeMap<usize, Vec<(f64, f64)>> = BTreeMap::new();
    for e in events {
        by_rank
            .entry(e.rank)
            .or_default()
            .push((e.start_s, e.start_s + e.dur_s));
    }
    let mut idle = Vec::new();
    for (rank, mut spans) in by_rank {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut end = spans.first().map_or(0.0, |s| s.0);
        for (s, e) in spans {
            if s > end {
                idle.push(TraceEvent {
                    rank,
                    name: "idle".into(),
                    category: "idle".into(),
                    start_s: end,
                    dur_s: s - end,
                });
            }
            end = end.max(e);
        }
    }
    idle
}

/// Writes the Chrome trace of every rank's actions: each rank writes its part next to `path`,
/// rank 0 merges them (times from the earliest event) and adds the idle gaps.
pub fn write_trace(
    path: &Path,
    events: Vec<TraceEvent>,
    grid: &ProcessGrid,
) -> Result<(), TrainError> {
    let part = |r: usize| path.with_extension(format!("rank{r}.json"));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(TrainError::io(dir))?;
    }
    let mine = part(grid.rank);
    std::fs::write(&mine, serde_json::to_vec(&events).unwrap_or_default())
        .map_err(TrainError::io(&mine))?;
    let world = grid.world.comm()?;
    world.barrier()?;
    if grid.rank == 0 {
        let mut all: Vec<TraceEvent> = Vec::new();
        for r in 0..world.size() {
            let p = part(r);
            let text = std::fs::read(&p).map_err(TrainError::io(&p))?;
            let events: Vec<TraceEvent> = serde_json::from_slice(&text).map_err(|e| {
                TrainError::io(&p)(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })?;
            all.extend(events);
            let _ = std::fs::remove_file(&p);
        }
        let t0 = all.iter().map(|e| e.start_s).fold(f64::INFINITY, f64::min);
        for e in &mut all {
            e.start_s -= t0;
        }
        all.extend(idle_gaps(&all));
        write_chrome_trace(path, &all).map_err(TrainError::io(path))?;
        tracing::info!(
            "trace: {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    world.barrier()?;
    Ok(())
}
