//! `bench-moe-overlap`: the step of a mixture-of-experts GPT with a shared expert under expert
//! parallelism (dp = ep = the ranks), with the shared expert computed while the routed tokens
//! travel (`model.moe.shared_overlap = true`, the default) against before them (`false`, the
//! previous behaviour), side by side in one run.
//!
//! Both variants are `merak train`'s step (the library's `Trainer::step`) on `merak train`'s
//! synthetic data (`data.kind = "synthetic"`, each step its own sequences) from the same
//! weights, each with its own grid, model and optimizer state; their first losses must agree. Trials alternate (the order rotates every trial); a trial's
//! time is the slowest rank's, and the medians over trials are reported with the median of
//! the paired ratios and rank 0's seconds per step in the token exchanges (the time spent
//! waiting for the rows, not the shared expert's compute).
//!
//! Run, from the workspace root:
//!
//! ```text
//! cargo build --release -p merak-benches
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
//!     mpirun -np 2 --oversubscribe --bind-to none target/release/bench-moe-overlap
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Parser;
use merak_burn::backend::{CpuAutodiff, CpuDevice};
use merak_burn::comm::{Communicator, MpiCommunicator, MpiWorld, ReduceOp};
use merak_burn::data::{CausalWindows, Dataset, SyntheticData};
use merak_burn::grid::{Layout, ProcessGrid};
use merak_burn::moe::MoeConfig;
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::{PipelinePlan, ScheduleKind, build_schedule, explicit_partition};
use merak_burn::train::{TrainSettings, Trainer};
use merak_gpt::{Gpt, GptConfig};

type B = CpuAutodiff;

/// Command-line options.
#[derive(Parser, Debug)]
#[command(
    about = "MoE GPT step under expert parallelism: shared expert during or before the dispatch"
)]
struct Args {
    /// Layers.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Hidden width.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq: usize,
    /// Routed experts per layer (top-2).
    #[arg(long, default_value_t = 8)]
    experts: usize,
    /// Width of an expert (and of the shared expert).
    #[arg(long, default_value_t = 512)]
    expert_hidden: usize,
    /// Global batch (sequences per optimizer step), split over the ranks.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed trials of each variant; medians are reported.
    #[arg(long, default_value_t = 7)]
    trials: usize,
    /// Training steps per trial.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Untimed steps of each variant before the trials.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Seed of the weights and the data.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
}

/// The model of `args` with the shared expert overlapped or not.
fn config(args: &Args, overlap: bool) -> GptConfig {
    let mut cfg = GptConfig::preset("tiny").expect("the tiny preset");
    (cfg.layers, cfg.hidden, cfg.heads, cfg.seq_len) = (args.layers, args.hidden, 4, args.seq);
    cfg.vocab_size = 8192;
    cfg.moe = Some(MoeConfig {
        shared_experts: 1,
        shared_overlap: overlap,
        ..MoeConfig::new(args.experts, 2, args.expert_hidden)
    });
    cfg
}

/// `merak train`'s step for `cfg` on `grid` (dp = ep = its ranks, one stage).
fn trainer<'g>(
    cfg: &GptConfig,
    args: &Args,
    grid: &'g ProcessGrid,
    device: &CpuDevice,
) -> Result<Trainer<'g, B, Gpt<B>>> {
    let holds = |_: usize| true;
    let model = Gpt::<B>::new_expert_parallel(cfg, args.seed, grid.tp, grid.ep, device, &holds)?;
    let units = cfg.layers + 2;
    let plan = PipelinePlan {
        schedule: build_schedule(ScheduleKind::OneFOneB, 1, 1, 1, &[false])?,
        partition: explicit_partition(&[units], units)?,
        recompute_units: vec![0],
    };
    let settings = TrainSettings {
        steps: args.warmup + args.trials * args.steps + 1,
        global_batch: args.batch,
        seq_len: args.seq,
        lr: 1e-4,
        min_lr: 1e-4,
        warmup_steps: 0,
        ..TrainSettings::default()
    };
    let n = grid.layout.dp;
    let parallel = ParallelPlan {
        dp: n,
        ep: n,
        micro_batch: args.batch / n,
        ..ParallelPlan::default()
    };
    Ok(Trainer::new(
        grid, &parallel, plan, settings, model, *device, false,
    )?)
}

/// Seconds per step of `steps` steps (slowest rank) and rank 0's exchange seconds per step.
fn trial(
    control: &MpiCommunicator,
    t: &mut Trainer<'_, B, Gpt<B>>,
    data: &CausalWindows<'_>,
    steps: usize,
) -> Result<(f64, f64)> {
    control.barrier()?;
    let (start, mut exchange) = (Instant::now(), 0.0);
    for _ in 0..steps {
        t.step(data)?;
        exchange += t.routing().map_or(0.0, |r| r.exchange_s) / steps as f64;
    }
    let mut secs = [(start.elapsed().as_secs_f64() / steps as f64) as f32];
    control.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok((f64::from(secs[0]), exchange))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mpi = MpiWorld::init()?;
    let control = mpi.world();
    let n = control.size();
    if n < 2 || args.batch % n != 0 || args.experts % n != 0 || args.trials == 0 {
        bail!("run under mpirun -np N (N > 1 dividing --batch and --experts), --trials > 0");
    }
    let device = CpuDevice::default();
    let layout = Layout {
        dp: n,
        tp: 1,
        cp: 1,
        pp: 1,
    };
    let grids = [
        ProcessGrid::from_mpi(mpi.world(), layout)?.with_expert_parallel(n)?,
        ProcessGrid::from_mpi(mpi.world(), layout)?.with_expert_parallel(n)?,
    ];
    let names = [
        "shared expert during the dispatch",
        "shared expert before it",
    ];
    let cfgs = [config(&args, true), config(&args, false)];
    let data = Dataset::Synthetic(SyntheticData::new(args.seed, 8192));
    let data = CausalWindows {
        data: &data,
        global_batch: args.batch,
        seq: args.seq,
    };
    let mut trainers = vec![
        trainer(&cfgs[0], &args, &grids[0], &device)?,
        trainer(&cfgs[1], &args, &grids[1], &device)?,
    ];
    let first: Vec<f64> = (trainers.iter_mut())
        .map(|t| t.step(&data).map(|o| o.loss))
        .collect::<Result<_, _>>()?;
    for _ in 1..args.warmup {
        for t in &mut trainers {
            t.step(&data)?;
        }
    }
    let (mut times, mut exchange) = ([vec![], vec![]], [vec![], vec![]]);
    let mut ratios = Vec::new();
    for k in 0..args.trials {
        let mut this = [0.0; 2];
        for j in 0..2 {
            let i = (k + j) % 2;
            let (s, x) = trial(&control, &mut trainers[i], &data, args.steps)?;
            this[i] = s;
            times[i].push(s);
            exchange[i].push(x);
        }
        ratios.push(this[0] / this[1]);
    }
    if control.rank() == 0 {
        println!(
            "# MoE GPT step, {} ranks at dp = ep = {n}: {} layers, hidden {}, seq {}, {} experts \
             top-2 of width {} + 1 shared, batch {}; {} trials x {} steps, medians, slowest rank",
            n,
            args.layers,
            args.hidden,
            args.seq,
            args.experts,
            args.expert_hidden,
            args.batch,
            args.trials,
            args.steps
        );
        println!(
            "# check, first step: loss {:.6} / {:.6}",
            first[0], first[1]
        );
        println!(
            "{:<36} {:>9} {:>16}",
            "variant", "ms/step", "exchange ms/step"
        );
        for i in 0..2 {
            let (t, x) = (median(&mut times[i]), median(&mut exchange[i]));
            println!("{:<36} {:>9.2} {:>16.2}", names[i], t * 1e3, x * 1e3);
        }
        println!(
            "during / before: {:.3} (median of paired trials)",
            median(&mut ratios)
        );
    }
    Ok(())
}
