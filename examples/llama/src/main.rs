//! `llama-train`: trains the Llama-style decoder on synthetic sequences through `merak_burn::run`,
//! alone or under `mpirun -np N`, with a given dp x tp x pp layout or the planner's.

use std::path::PathBuf;

use clap::Parser;
use merak_burn::prelude::*;
use merak_example_llama::{Counting, LlamaConfig, SparseMoe, manifest_extra, pretrained_or};

/// Train the Llama-style example under a dp x tp x pp layout.
#[derive(Parser, Debug)]
struct Args {
    /// Data-parallel degree.
    #[arg(long, default_value_t = 1)]
    dp: usize,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Context-parallel degree: each rank holds 2 of 2 cp chunks of every sequence, the
    /// attention runs as a ring over the cp ranks; --seq must be a multiple of 2 cp.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Sequence parallelism (with --tp): between the tensor-parallel layers each rank holds
    /// seq / tp positions of every sequence; --seq must be a multiple of --tp.
    #[arg(long)]
    sequence_parallel: bool,
    /// Expert-parallel degree (with --experts): each group of this many data-parallel ranks
    /// splits the experts; divides --dp and --experts.
    #[arg(long, default_value_t = 1)]
    ep: usize,
    /// Let the planner choose the layout, micro-batch, schedule and stages for the ranks
    /// launched, from the units timed on this backend (instead of --dp/--tp/--pp,
    /// --micro-batch and --schedule).
    #[arg(long)]
    plan_auto: bool,
    /// With --plan-auto: write every layout the planner considered, with its predicted step
    /// time, to this new file (JSON lines, fastest first; an existing file is refused).
    #[arg(long, requires = "plan_auto")]
    plan_report: Option<PathBuf>,
    /// Pipeline schedule: gpipe, 1f1b, interleaved, shifted-critical-path, 2bw or zb-h1 (zb-v
    /// needs two stages per pipeline rank, which this example does not set).
    #[arg(long, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Optimizer steps.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Sequences per step, over all data-parallel ranks.
    #[arg(long, default_value_t = 8)]
    global_batch: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 2)]
    micro_batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 32)]
    seq: usize,
    /// Seed of the weights and the data.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Tie the output projection to the token embedding.
    #[arg(long)]
    tie_embeddings: bool,
    /// A Mixtral-style mixture of this many experts in every block instead of the MLP (0: none).
    #[arg(long, default_value_t = 0)]
    experts: usize,
    /// Experts each token goes through (with --experts).
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// The weight of the routers' load-balancing loss (with --experts), as Mixtral's
    /// `router_aux_loss_coef` counts it, computed per sequence (0: none).
    #[arg(long, default_value_t = 0.0)]
    aux_loss: f64,
    /// DeepSeek's auxiliary-loss-free balancing of the experts (with --experts): the rate at
    /// which each expert's selection bias moves towards balance after a step (0: off).
    #[arg(long, default_value_t = 0.0)]
    bias_update_rate: f64,
    /// Output folder (default: a new `runs/<UTC date-time>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Save a checkpoint every this many steps (0: only at the end); the newest two are kept.
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Continue from this checkpoint, under any layout.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start from this Hugging Face LlamaForCausalLM or MixtralForCausalLM folder (its shape
    /// and weights).
    #[arg(long)]
    init_from: Option<PathBuf>,
}

/// Exits 0 when trained, 2 on bad input found before training (as `merak train` does), 1
/// when training failed ([`exit_code`]).
fn main() -> std::process::ExitCode {
    exit_code(train(Args::parse()))
}

/// Trains as `args` say.
fn train(args: Args) -> anyhow::Result<()> {
    let moe = (args.experts > 0).then_some(SparseMoe {
        experts: args.experts,
        top_k: args.top_k,
        aux_loss: args.aux_loss,
        bias_update_rate: args.bias_update_rate,
    });
    let tiny = LlamaConfig {
        tie_embeddings: args.tie_embeddings,
        moe,
        ..LlamaConfig::tiny()
    };
    let (cfg, init) = pretrained_or(args.init_from.as_deref(), args.seq, tiny)?;
    let settings = TrainSettings::default()
        .with_steps(args.steps)
        .with_global_batch(args.global_batch)
        .with_seq_len(args.seq)
        .with_lr(3e-3)
        .with_min_lr(3e-4)
        .with_warmup_steps(2)
        .with_seed(args.seed);
    let plan = match args.plan_auto {
        true => PlanChoice::Auto(AutoPlan {
            report: args.plan_report.clone(),
            ..AutoPlan::timed_at(args.micro_batch)
        }),
        false => PlanChoice::Given(ParallelPlan {
            dp: args.dp,
            tp: args.tp,
            cp: args.cp,
            sequence_parallel: args.sequence_parallel,
            pp: args.pp,
            ep: args.ep,
            micro_batch: args.micro_batch,
            schedule: args.schedule,
            ..ParallelPlan::default()
        }),
    };
    let data = Counting::new(cfg.vocab, &settings);
    let options = RunOptions {
        out: args.out,
        resume: args.resume,
        checkpoint_every: args.checkpoint_every,
        init,
        manifest_extra: manifest_extra(&cfg),
        eval_batches: 2,
        predict_batches: 1,
        ..RunOptions::default()
    };
    let r = merak_burn::run::<CpuAutodiff, _>(&cfg, &plan, &data, &settings, &options)?;
    if let (0, Some(m), Some(p)) = (r.rank, &r.metrics, &r.predictions) {
        let ratio = |name| m.ratio(name, "tokens").unwrap_or(f64::NAN);
        let (loss, accuracy, next) = (ratio("loss"), ratio("correct"), p.argmax());
        println!("llama: planned {}\nllama: {}", r.plan, r.summary);
        println!("llama: held-out loss {loss:.6} accuracy {accuracy:.4}, next tokens {next:?}");
    }
    Ok(())
}
