//! `merak profile`: every micro-batch and tensor-parallel degree timed into a calibration.

use crate::config;
use anyhow::{Context, Result, bail};
use merak_burn::comm::{Communicator, MpiCommunicator};
use merak_burn::grid::{Layout, ProcessGrid};
use merak_burn::planner::{CALIBRATION_FORMAT, Calibration, UnitKind, UnitTiming};
use merak_burn::probe;
use merak_burn::tensor_parallel::TpOverlap;

use super::fit::*;
use super::units::*;
use super::*;

/// `merak profile`: times the embedding, one layer and the head of the configured GPT at each
/// tensor-parallel degree and micro-batch size, with every rank working at once, plus the
/// optimizer step; rank 0 writes the calibration.
pub fn profile(args: &ProfileArgs, mpi: Option<&merak_burn::comm::MpiWorld>) -> Result<()> {
    let cfg = config::load(args.config.as_deref(), &args.sets)?;
    if mpi.is_none_or(|w| w.world().rank() == 0) {
        crate::output_file(&args.out, "--out")?;
    }
    if cfg.model.kind != "gpt" {
        bail!(
            "model.kind = {:?}: merak profile times GPT models",
            cfg.model.kind
        );
    }
    let g = &cfg.model.gpt;
    let world = mpi.map(|m| m.world());
    let ranks = world.as_ref().map_or(1, |w| w.size());
    let rank = world.as_ref().map_or(0, |w| w.rank());
    if args.micro_batches.is_empty() || args.micro_batches.contains(&0) {
        bail!(
            "--micro-batches {:?}: sizes must be at least 1",
            args.micro_batches
        );
    }
    if args.tp_overlap.contains(&0) {
        bail!(
            "--tp-overlap {:?}: degrees must be at least 1 (1: no overlap)",
            args.tp_overlap
        );
    }
    if args.reps == 0 || args.train_steps == 0 {
        bail!(
            "--reps {} --train-steps {}: both must be at least 1",
            args.reps,
            args.train_steps
        );
    }
    let tps = tp_degrees(args, ranks, g.heads)?;
    let profiling = Profiling {
        args,
        mpi,
        world,
        ranks,
        rank,
        gpt: g,
        seed: cfg.train.seed,
    };
    let units = time_all_degrees(&profiling, &tps)?;
    let runs = time_training_runs(args, mpi, ranks)?;
    let mut calibration = Calibration {
        format: CALIBRATION_FORMAT.to_string(),
        model: cfg.shape()?,
        backend: "flex-f32".to_string(),
        ranks,
        element_bytes: 4.0,
        optimizer_s_per_param: units.optimizer_s_per_param,
        micro_batch_s_per_param: 0.0,
        step_overhead_s: 0.0,
        zero1_s_per_param: 0.0,
        alone_time_fraction: units.alone_time_fraction,
        timings: units.timings,
    };
    let fit = fit_framework_costs(&mut calibration, &runs, tps[0], g.layers);
    if rank == 0 {
        print_framework_costs(&calibration, &runs, &fit);
    }
    if rank == 0 {
        calibration.write(&args.out)?;
        println!(
            "optimizer: {:.2} ns per parameter; a rank whose peers wait needs {:.2} of its time; calibration written to {}",
            units.optimizer_s_per_param * 1e9,
            units.alone_time_fraction,
            args.out.display()
        );
    }
    Ok(())
}

/// The tensor-parallel degrees to profile: `--tp`, or by default every degree that divides
/// both the `ranks` and the model's `heads`. Fails when a given degree divides either not.
pub(super) fn tp_degrees(args: &ProfileArgs, ranks: usize, heads: usize) -> Result<Vec<usize>> {
    let tps: Vec<usize> = if args.tp.is_empty() {
        (1..=ranks)
            .filter(|t| ranks.is_multiple_of(*t) && heads.is_multiple_of(*t))
            .collect()
    } else {
        args.tp.clone()
    };
    for &tp in &tps {
        if tp == 0 || !ranks.is_multiple_of(tp) || !heads.is_multiple_of(tp) {
            bail!("--tp {tp} must divide the {ranks} ranks and model.heads = {heads}");
        }
    }
    Ok(tps)
}

/// One `merak profile` run: its arguments, the profiled model and this rank's MPI world.
pub(super) struct Profiling<'a> {
    args: &'a ProfileArgs,
    mpi: Option<&'a merak_burn::comm::MpiWorld>,
    /// The world communicator that the timings align on and average over.
    world: Option<MpiCommunicator>,
    ranks: usize,
    rank: usize,
    gpt: &'a merak_gpt::GptConfig,
    /// The seed of the profiled model's parameters.
    seed: u64,
}

/// The measured costs of the model's units and of its optimizer step.
pub(super) struct UnitCosts {
    /// Forward and backward times of each unit kind per tp degree and micro-batch size.
    timings: Vec<UnitTiming>,
    /// Seconds of one AdamW step per parameter (at the first tp degree).
    optimizer_s_per_param: f64,
    /// A rank's time fraction when its peers wait (measured at tp = 1; 0 without it).
    alone_time_fraction: f64,
}

/// Builds the model at each of the tp degrees `tps` and times its units at every micro-batch
/// size, its alone fraction at tp = 1 (largest micro-batch) and its optimizer step at the
/// first degree.
pub(super) fn time_all_degrees(p: &Profiling, tps: &[usize]) -> Result<UnitCosts> {
    let reps = p.args.reps.max(1);
    let mut costs = UnitCosts {
        timings: Vec::new(),
        optimizer_s_per_param: 0.0,
        alone_time_fraction: 0.0,
    };
    for &tp in tps {
        let grid = profiling_grid(p, tp)?;
        let device = Default::default();
        let model = merak_gpt::Gpt::<B>::new_units(p.gpt, p.seed, grid.tp, &device, &|_| true)?;
        for &b in &p.args.micro_batches {
            time_micro_batch(p, &model, (tp, 1), b, &mut costs.timings)?;
        }
        time_overlapped(p, &grid, &mut costs.timings)?;
        let world = p.world.as_ref();
        if tp == 1 {
            let b = p.args.micro_batches.iter().copied().max().unwrap_or(1);
            let samples = token_batch(p.gpt, b);
            costs.alone_time_fraction =
                probe::alone_fraction(&model, &samples, &device, world, reps)?;
        }
        if tp == tps[0] {
            let samples = token_batch(p.gpt, 1);
            costs.optimizer_s_per_param =
                probe::time_optimizer(model, &samples, &device, world, reps)?;
        }
    }
    Ok(costs)
}

/// Times the units of the model sub-pipelined at every overlap degree above 1 of the profile
/// (tensor-parallel degrees above 1 only, and micro-batches whose tokens the degree divides).
pub(super) fn time_overlapped(
    p: &Profiling,
    grid: &ProcessGrid,
    timings: &mut Vec<UnitTiming>,
) -> Result<()> {
    let tp = grid.tp.size();
    if tp == 1 {
        return Ok(());
    }
    for &k in p.args.tp_overlap.iter().filter(|&&k| k > 1) {
        let overlap = TpOverlap::new(k)?;
        let device = Default::default();
        let model = merak_gpt::Gpt::<B>::new_units(p.gpt, p.seed, grid.tp, &device, &|_| true)?
            .with_tp_overlap(overlap);
        for &b in &p.args.micro_batches {
            if overlap.check_tokens(b * p.gpt.seq_len).is_ok() {
                time_micro_batch(p, &model, (tp, k), b, timings)?;
            }
        }
    }
    Ok(())
}

/// The process grid with `tp`-way tensor and `ranks / tp`-way data parallelism over the MPI
/// world (a single process without MPI).
pub(super) fn profiling_grid(p: &Profiling, tp: usize) -> Result<ProcessGrid> {
    Ok(match &p.world {
        Some(_) => {
            let w = p.mpi.map(|m| m.world()).context("MPI world")?;
            ProcessGrid::from_mpi(
                w,
                Layout {
                    dp: p.ranks / tp,
                    tp,
                    cp: 1,
                    pp: 1,
                },
            )?
        }
        None => ProcessGrid::single(),
    })
}

/// Times the embedding, a layer and the head of `model` (tensor-parallel and overlap degrees
/// `(tp, k)`) at micro-batch `b`, appends their timings to `timings` and prints them in
/// milliseconds (rank 0).
pub(super) fn time_micro_batch(
    p: &Profiling,
    model: &merak_gpt::Gpt<B>,
    (tp, k): (usize, usize),
    b: usize,
    timings: &mut Vec<UnitTiming>,
) -> Result<()> {
    let samples = token_batch(p.gpt, b);
    let (device, reps) = (Default::default(), p.args.reps.max(1));
    let m = probe::time_units(model, &samples, &device, p.world.as_ref(), reps)?;
    let measured = [m.embedding, m.layer, m.head];
    let kinds = [UnitKind::Embedding, UnitKind::Layer, UnitKind::Head];
    for (unit, pass) in kinds.into_iter().zip(measured) {
        timings.push(UnitTiming {
            unit,
            tp,
            micro_batch: b,
            forward_s: pass.forward_s,
            backward_s: pass.backward_s,
            tp_overlap: k,
        });
    }
    if p.rank == 0 {
        let overlap = if k > 1 {
            format!(" tp_overlap={k}")
        } else {
            String::new()
        };
        println!(
            "tp={tp}{overlap} micro_batch={b}: forward/backward ms: embedding {:.3}/{:.3}, layer {:.3}/{:.3}, head {:.3}/{:.3}",
            m.embedding.forward_s * 1e3,
            m.embedding.backward_s * 1e3,
            m.layer.forward_s * 1e3,
            m.layer.backward_s * 1e3,
            m.head.forward_s * 1e3,
            m.head.backward_s * 1e3
        );
    }
    Ok(())
}
