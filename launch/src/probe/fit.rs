//! The framework's own costs per micro-batch and per step, fitted from two short training
//! runs.

use crate::config;
use anyhow::{Context, Result, bail};
use merak_burn::comm::Communicator;
use merak_burn::planner::{Calibration, UnitKind};
use merak_burn::probe::{from_rank0, median};

use super::*;

/// Micro-batches per step of the longer of the two training runs that give the framework's
/// cost per micro-batch.
pub(super) const SLOPE_MICRO_BATCHES: usize = 8;

/// The median step time (after the first two steps) of a short `merak train` run of the
/// profiled model with the data-parallel layout over every rank, micro-batches of one sequence
/// and `m` of them per step: the framework's own costs (parameter hooks, gradient
/// accumulation, all-reduces, gradient norm, metrics) are in it.
pub(super) fn train_step_time(
    args: &ProfileArgs,
    mpi: Option<&merak_burn::comm::MpiWorld>,
    m: usize,
    zero: u8,
    out: &std::path::Path,
) -> Result<f64> {
    let ranks = mpi.map_or(1, |w| w.world().size());
    let rank = mpi.map_or(0, |w| w.world().rank());
    let sets = train_run_sets(args, ranks, m, zero);
    let cfg = config::load(args.config.as_deref(), &sets)?;
    let data = crate::data::open(&cfg)?;
    let parallel = cfg.parallel_plan();
    let spec = crate::train::RunSpec {
        out,
        parallel: &parallel,
        trace: None,
        existing: merak_burn::train::ExistingRun::Refuse,
        init: None,
        signals: false,
    };
    let launch = merak_burn::entry::RunOn::<B>::new(mpi);
    let objective = crate::train::Objective::Causal;
    crate::train::train(launch, &cfg, &data, &cfg.model.gpt, &objective, spec)?;
    let mut t = [0.0];
    if rank == 0 {
        t[0] = median_step_time(out)?;
    }
    from_rank0(mpi.map(|w| w.world()).as_ref(), &mut t)?;
    Ok(t[0])
}

/// The `--set` overrides of a `train_step_time` run: `args.sets` followed by the
/// data-parallel layout over `ranks` with ZeRO stage `zero`, `m` micro-batches of one
/// sequence per step, `--train-steps` steps (at least 3) on synthetic data, and no
/// validation, checkpoints or samples.
pub(super) fn train_run_sets(args: &ProfileArgs, ranks: usize, m: usize, zero: u8) -> Vec<String> {
    let mut sets = args.sets.clone();
    for set in [
        format!("parallel.dp={ranks}"),
        format!("parallel.zero={zero}"),
        "parallel.tp=1".into(),
        "parallel.pp=1".into(),
        "train.micro_batch=1".into(),
        format!("train.global_batch={}", ranks * m),
        format!("train.steps={}", args.train_steps.max(3)),
        "data.kind=\"synthetic\"".into(),
        "data.val_every=0".into(),
        "checkpoint.every=0".into(),
        "checkpoint.at_end=false".into(),
        "train.sample_tokens=0".into(),
    ] {
        sets.push(set);
    }
    sets
}

/// The median `step_time_s` of the records of `out/metrics.jsonl` after the first two. Fails
/// when a record lacks the field or there is none.
pub(super) fn median_step_time(out: &std::path::Path) -> Result<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut times = Vec::new();
    for line in text.lines().skip(2) {
        let v: serde_json::Value = serde_json::from_str(line)?;
        times.push(
            v["step_time_s"]
                .as_f64()
                .context("step_time_s in metrics")?,
        );
    }
    if times.is_empty() {
        bail!("no step times in {}", out.display());
    }
    Ok(median(times))
}

/// Step times (seconds) of the short training runs that give the framework's own costs.
pub(super) struct TrainRuns {
    /// With 1 micro-batch per step.
    one: f64,
    /// With `SLOPE_MICRO_BATCHES` micro-batches per step.
    many: f64,
    /// With 1 micro-batch per step and ZeRO-1 (`one` for a single rank).
    zero1: f64,
}

/// Times the training runs of `TrainRuns`, each three times with the fastest counting (as for
/// the units: other work on a shared machine only ever adds time).
pub(super) fn time_training_runs(
    args: &ProfileArgs,
    mpi: Option<&merak_burn::comm::MpiWorld>,
    ranks: usize,
) -> Result<TrainRuns> {
    // The framework's own costs, from two short training runs with 1 and 8 micro-batches of
    // one sequence: step(m) = m * (units + per micro-batch) + optimizer + per step. The wide
    // spread keeps the per-micro-batch slope from amplifying the noise of the two times.
    // A fresh folder of this process's own, removed when dropped: nothing the user named is
    // ever written into or removed.
    let scratch = tempfile::Builder::new()
        .prefix("merak-profile-run-")
        .tempdir()
        .context("making a scratch folder for the profile's training runs")?;
    let fastest_run = |m: usize, zero: u8| -> Result<f64> {
        let mut best = f64::INFINITY;
        for i in 0..3 {
            // Each run in a folder of its own: a run never writes into another run's folder.
            let out = scratch.path().join(format!("m{m}-zero{zero}-{i}"));
            best = best.min(train_step_time(args, mpi, m, zero, &out)?);
        }
        Ok(best)
    };
    let one = fastest_run(1, 0)?;
    let many = fastest_run(SLOPE_MICRO_BATCHES, 0)?;
    // ZeRO-1 (with more than one rank): the optimizer works on 1/ranks of the parameters,
    // then the owners send the new values to everyone.
    let zero1 = if ranks > 1 { fastest_run(1, 1)? } else { one };
    Ok(TrainRuns { one, many, zero1 })
}

/// The framework's cost per micro-batch fitted from the training runs, and the parameters
/// per rank it was fitted for.
pub(super) struct FrameworkFit {
    /// Seconds per micro-batch beyond the units' own forward and backward passes.
    per_micro_batch: f64,
    /// Parameters of the model per rank at the first tp degree.
    params: f64,
}

/// Sets the calibration's per-micro-batch, per-step and ZeRO-1 costs from the training runs,
/// given its unit timings at tp degree `tp0` and micro-batch 1, its optimizer cost and the
/// model's `layers`.
pub(super) fn fit_framework_costs(
    calibration: &mut Calibration,
    runs: &TrainRuns,
    tp0: usize,
    layers: usize,
) -> FrameworkFit {
    let TrainRuns { one, many, zero1 } = *runs;
    let (ranks, optimizer_s_per_param) = (calibration.ranks, calibration.optimizer_s_per_param);
    let unit = |kind| {
        calibration
            .unit_time(kind, tp0, 1)
            .map_or(0.0, |(f, b)| f + b)
    };
    let units_b1 =
        unit(UnitKind::Embedding) + layers as f64 * unit(UnitKind::Layer) + unit(UnitKind::Head);
    let params =
        merak_burn::planner::ModelProxy::from_shape(calibration.model).params() as f64 / tp0 as f64;
    let per_micro_batch = ((many - one) / (SLOPE_MICRO_BATCHES - 1) as f64 - units_b1).max(0.0);
    calibration.micro_batch_s_per_param = per_micro_batch / params;
    calibration.step_overhead_s =
        (one - units_b1 - per_micro_batch - optimizer_s_per_param * params).max(0.0);
    if ranks > 1 {
        let saved = optimizer_s_per_param * params * (1.0 - 1.0 / ranks as f64);
        calibration.zero1_s_per_param = ((zero1 - one + saved) / params).max(0.0);
    }
    FrameworkFit {
        per_micro_batch,
        params,
    }
}

/// Prints the training runs' step times and the framework costs fitted from them, in
/// milliseconds.
pub(super) fn print_framework_costs(
    calibration: &Calibration,
    runs: &TrainRuns,
    fit: &FrameworkFit,
) {
    println!(
        "training runs (dp={}, micro-batch 1): {:.1} ms with 1 micro-batch, {:.1} ms with {SLOPE_MICRO_BATCHES}, {:.1} ms with ZeRO-1; framework costs {:.2} ms per micro-batch, {:.2} ms per step, ZeRO-1 exchange {:.2} ms",
        calibration.ranks,
        runs.one * 1e3,
        runs.many * 1e3,
        runs.zero1 * 1e3,
        fit.per_micro_batch * 1e3,
        calibration.step_overhead_s * 1e3,
        calibration.zero1_s_per_param * fit.params * 1e3
    );
}
