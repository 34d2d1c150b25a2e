//! `vit-train`: trains the vision transformer on the 8x8 handwritten digits through
//! `merak_burn::run`, alone or under `mpirun -np N`, with a given dp x tp x pp layout or the
//! planner's, then reports the held-out loss and accuracy.

use std::path::PathBuf;

use clap::Parser;
use merak_burn::prelude::*;
use merak_example_vit::{Digits, DigitsSource, VitConfig, default_digits_path, report, settings};

/// Train the vision transformer on the digits under a dp x tp x pp layout.
#[derive(Parser, Debug)]
struct Args {
    /// Data-parallel degree.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Tensor-parallel degree (must divide the heads).
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Let the planner choose the layout, micro-batch, schedule and stages for the ranks
    /// launched, from the units timed on this backend (instead of --dp/--tp/--pp,
    /// --micro-batch and --schedule).
    #[arg(long)]
    plan_auto: bool,
    /// With --plan-auto: write every layout the planner considered, with its predicted step
    /// time, to this new file (JSON lines, fastest first; an existing file is refused).
    #[arg(long, requires = "plan_auto")]
    plan_report: Option<PathBuf>,
    /// ZeRO stage over the data-parallel ranks: 0, 1, 2 or 3 (parameters, gradients and
    /// optimizer state sharded; each unit gathered just before it runs).
    #[arg(long, default_value_t = 0)]
    zero: u8,
    /// Pipeline schedule: gpipe, 1f1b, interleaved, shifted-critical-path, 2bw or zb-h1 (zb-v
    /// needs two stages per pipeline rank, which this example does not set).
    #[arg(long, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Optimizer steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Images per step, over all data-parallel ranks.
    #[arg(long, default_value_t = 60)]
    global_batch: usize,
    /// Images per micro-batch.
    #[arg(long, default_value_t = 30)]
    micro_batch: usize,
    /// Peak learning rate (cosine decay to a tenth of it).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Width of the hidden states (the MLP is 4 times as wide).
    #[arg(long, default_value_t = 32)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Seed of the weights, the data order and the augmentation.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The digits file (default: the one committed with the example).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Output folder (default: a new `runs/<UTC date-time>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Save a checkpoint every this many steps (0: only at the end); the newest two are kept.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Continue from this checkpoint, under any layout.
    #[arg(long)]
    resume: Option<PathBuf>,
}

/// Exits 0 when trained, 2 on bad input found before training (as `merak train` does), 1
/// when training failed ([`exit_code`]).
fn main() -> std::process::ExitCode {
    exit_code(train(Args::parse()))
}

/// Trains as `args` say.
fn train(args: Args) -> anyhow::Result<()> {
    let cfg = VitConfig::new(args.layers, args.hidden, args.heads);
    cfg.validate()?;
    let settings = settings(args.steps, args.global_batch, args.lr, args.seed);
    let plan = match args.plan_auto {
        true => PlanChoice::Auto(AutoPlan {
            report: args.plan_report.clone(),
            ..AutoPlan::timed_at(args.micro_batch)
        }),
        false => {
            cfg.check_tp(args.tp)?;
            PlanChoice::Given(ParallelPlan {
                dp: args.dp,
                tp: args.tp,
                pp: args.pp,
                micro_batch: args.micro_batch,
                schedule: args.schedule,
                zero: args.zero,
                ..ParallelPlan::default()
            })
        }
    };
    let digits = Digits::read(&args.data.unwrap_or_else(default_digits_path))?;
    let data = DigitsSource::new(digits, &settings);
    let options = RunOptions {
        out: args.out,
        resume: args.resume,
        checkpoint_every: args.checkpoint_every,
        manifest_extra: cfg.to_json(),
        eval_batches: data.eval_batches(args.global_batch),
        predict_batches: 1,
        ..RunOptions::default()
    };
    let r = merak_burn::run::<CpuAutodiff, _>(&cfg, &plan, &data, &settings, &options)?;
    if let Some(text) = report(&r, &data) {
        println!("{text}");
    }
    Ok(())
}
