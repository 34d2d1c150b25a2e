//! `llama-train`: trains the Llama-style decoder on synthetic sequences under any dp x tp x pp
//! layout. Run it alone for one process, or under `mpirun -np N` with `--dp * --tp * --pp = N`.
//! Rank 0 writes `metrics.jsonl` and the run ends with a checkpoint in `<out>/checkpoints`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Parser;
use merak_burn::backend::{CpuAutodiff, CpuDevice};
use merak_burn::comm::{
    Communicator, Group, MpiCommunicator, MpiWorld, ReduceOp, launched_by_mpirun,
};
use merak_burn::grid::ProcessGrid;
use merak_burn::parallelize::{Units, shard_module};
use merak_burn::pipeline::{Recompute, ScheduleKind};
use merak_burn::plan::ParallelPlan;
use merak_burn::planner::{
    HardwareSpec, MeasuredModel, MeasuredUnit, ModelProxy, SearchOptions, TransformerShape, search,
};
use merak_burn::train::{
    BatchSource, CheckpointPolicy, RunOutput, SourceError, TrainSettings, Trainer, Windows,
};
use merak_example_llama::{Block, Embed, Head, Llama, LlamaConfig, tp_plan};

type B = CpuAutodiff;
/// The decoder as pipeline units.
type Model = Units<B, Embed<B>, Block<B>, Head<B>>;

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
    /// Let the planner choose the layout, micro-batch, schedule and stages for the ranks
    /// launched, from the units timed on this backend (instead of --dp/--tp/--pp,
    /// --micro-batch and --schedule).
    #[arg(long)]
    plan_auto: bool,
    /// Pipeline schedule: gpipe, 1f1b, interleaved, shifted-critical-path or 2bw.
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
    /// Output folder.
    #[arg(long, default_value = "runs/llama")]
    out: PathBuf,
}

/// Sequences that count up from a random start by a random stride (1 to 3), modulo the
/// vocabulary: learnable, and the same for every layout (keyed by the global sample index).
struct Counting {
    vocab: usize,
    seq: usize,
    global_batch: usize,
    seed: u64,
}

impl Counting {
    /// The `seq + 1` tokens of global sample `g`.
    fn sample(&self, g: usize) -> Vec<i64> {
        let h = splitmix(self.seed ^ splitmix(g as u64));
        let (start, stride) = (h % self.vocab as u64, 1 + (h >> 32) % 3);
        (0..=self.seq as u64)
            .map(|j| ((start + j * stride) % self.vocab as u64) as i64)
            .collect()
    }

    /// Inputs and next-token targets of samples `first..first + count`.
    fn windows(&self, first: usize, count: usize) -> Windows {
        let mut w = Windows::default();
        for g in first..first + count {
            let s = self.sample(g);
            w.inputs.extend_from_slice(&s[..self.seq]);
            w.targets.extend_from_slice(&s[1..]);
        }
        w
    }
}

impl BatchSource for Counting {
    fn train_windows(
        &self,
        step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError> {
        Ok(self.windows(step * self.global_batch + first, count))
    }

    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        Ok(self.windows(usize::MAX / 2 + first, count))
    }
}

/// splitmix64.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Each unit (split as the TP plan declares, at tp = 1) measured on this backend at
/// `micro_batch` sequences, averaged over the ranks so that every rank plans and cuts the
/// pipeline the same way.
fn agreed_measurements(
    units: &Model,
    data: &Counting,
    micro_batch: usize,
    world: Option<&MpiCommunicator>,
    device: &CpuDevice,
) -> Result<Vec<MeasuredUnit>> {
    let w = data.windows(0, micro_batch);
    let tensor = |v: Vec<i64>| {
        Tensor::<B, 2, Int>::from_data(TensorData::new(v, [micro_batch, data.seq]), device)
    };
    let split = shard_module(units.clone(), &tp_plan(), Group::local())?;
    let mut measured = split.measure(tensor(w.inputs), tensor(w.targets), 3);
    if let Some(world) = world {
        let mut times: Vec<f32> = (measured.iter())
            .flat_map(|u| [u.forward_s as f32, u.backward_s as f32])
            .collect();
        world.all_reduce(&mut times, ReduceOp::Sum)?;
        let n = world.size() as f64;
        for (u, t) in measured.iter_mut().zip(times.chunks(2)) {
            (u.forward_s, u.backward_s) = (f64::from(t[0]) / n, f64::from(t[1]) / n);
        }
    }
    Ok(measured)
}

/// The plan: the one given on the command line, or the planner's fastest for the launched
/// ranks on a model proxy from `measured` units.
fn choose_plan(
    args: &Args,
    cfg: &LlamaConfig,
    measured: Vec<MeasuredUnit>,
    ranks: usize,
) -> Result<ParallelPlan> {
    if !args.plan_auto {
        return Ok(ParallelPlan {
            dp: args.dp,
            tp: args.tp,
            pp: args.pp,
            micro_batch: args.micro_batch,
            schedule: args.schedule,
            ..ParallelPlan::default()
        });
    }
    let hardware = HardwareSpec::preset("local-cpu")
        .context("the local-cpu hardware preset")?
        .with_devices(ranks);
    let shape = TransformerShape::gpt(cfg.layers, cfg.hidden, cfg.heads, args.seq, cfg.vocab);
    let model = MeasuredModel::new(shape, args.micro_batch, measured, &hardware)?;
    let options = SearchOptions {
        // The example trains on Burn's plain autodiff backend and Burn's linear layers.
        recompute: vec![Recompute::None],
        tp_overlap: vec![1],
        ..SearchOptions::new(ranks, args.global_batch)
    };
    let best = search(&ModelProxy::from_costs(&model), &hardware, &options)?.best;
    Ok(ParallelPlan::from_planned(&best.layout))
}

/// The optimizer and schedule settings of the run.
fn settings(args: &Args) -> TrainSettings {
    TrainSettings {
        steps: args.steps,
        global_batch: args.global_batch,
        seq_len: args.seq,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup_steps: 2,
        weight_decay: 0.01,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        grad_clip: 1.0,
        skip_nonfinite: false,
        seed: args.seed,
        val_every: 0,
        val_batches: 0,
        precision: Default::default(),
    }
}

/// Builds this rank's part of the model and trains it.
fn run(args: &Args, world: Option<MpiCommunicator>) -> Result<()> {
    let cfg = LlamaConfig {
        tie_embeddings: args.tie_embeddings,
        ..LlamaConfig::tiny()
    };
    let device = Default::default();
    B::seed(&device, args.seed);
    let llama = Llama::<B>::new(&cfg, &device);
    let mut units: Model = Units::new(llama.embed, llama.blocks, llama.head, cfg.hidden);
    if cfg.tie_embeddings {
        units = units.tied()?;
    }
    let data = Counting {
        vocab: cfg.vocab,
        seq: args.seq,
        global_batch: args.global_batch,
        seed: args.seed,
    };
    let measured = agreed_measurements(&units, &data, args.micro_batch, world.as_ref(), &device)?;
    let costs: Vec<f64> = measured
        .iter()
        .map(|u| u.forward_s + u.backward_s)
        .collect();
    let ranks = world.as_ref().map_or(1, |w| w.size());
    let plan = choose_plan(args, &cfg, measured, ranks)?;
    if args.plan_auto && world.as_ref().is_none_or(|w| w.rank() == 0) {
        println!(
            "llama: planned dp={} tp={} pp={} micro_batch={} schedule={} stages={:?}",
            plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.schedule, plan.stage_units
        );
    }
    let grid = match world {
        Some(w) => ProcessGrid::from_mpi(w, plan.layout())?,
        None if plan.layout().world_size() == 1 => ProcessGrid::single(),
        None => bail!(
            "dp x tp x pp = {} ranks: run under mpirun -np {}",
            plan.layout().world_size(),
            plan.layout().world_size()
        ),
    };
    let pipeline = plan.pipeline_with_costs(&costs, args.global_batch)?;
    let me = grid.coords.pp;
    let holds = |u: usize| pipeline.schedule.rank_of(pipeline.partition.stage_of(u)) == me;
    let model = shard_module(units.retain(holds), &tp_plan(), grid.tp)?;
    let mut trainer = Trainer::new(&grid, &plan, pipeline, settings(args), model, device, false)?;
    let out = RunOutput {
        dir: args.out.clone(),
        checkpoints: Some(CheckpointPolicy {
            dir: args.out.join("checkpoints"),
            every: 0,
            at_end: true,
            keep: 1,
            extra: serde_json::json!({ "model": "llama-tiny" }),
        }),
        trace: None,
        progress: true,
        stop: None,
        ..Default::default()
    };
    let summary = trainer.fit(&data, &out, &mut |_| {})?;
    if grid.rank == 0 {
        println!(
            "llama: {} steps under dp={} tp={} pp={}, final loss {:.5}",
            summary.steps, plan.dp, plan.tp, plan.pp, summary.final_loss
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !launched_by_mpirun() {
        return match run(&args, None) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(1)
            }
        };
    }
    let mpi = match MpiWorld::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args, Some(mpi.world())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => mpi.abort(1, &format!("{e:#}")),
    }
}
