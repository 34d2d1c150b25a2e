//! `bench-train-step`: time of one training step of a GPT (preset `tiny` by default) on the CPU
//! backend `Autodiff<Flex>` (`merak_burn::backend::CpuAutodiff`), as a plain Burn loop and as the step of `merak train`.
//!
//! Variants, all trained on the same fixed random token ids (the global batch, `--batch`
//! sequences) from the same initial weights, each with its own model and optimizer state:
//!
//! - **plain**: `Gpt` built with `Group::local()`; per step `model.loss(x, y)`, read the loss,
//!   `loss.backward()`, `GradientsParams::from_grads`, one Burn AdamW `step`. No merak
//!   machinery besides the model itself.
//! - **merak dp=1**: `merak train`'s step, the library's `Trainer::step` (the call `merak
//!   train` makes), on one process with a one-stage plan: the pipeline executor runs the
//!   micro-batch through the data-parallel reducer's hooks, then `DataParallel::finish`, the
//!   global gradient norm, clipping, the weight-decay split and two steps of merak's
//!   `FusedAdamW` (Burn's AdamW fused into one pass per parameter; decay / no decay).
//! - **merak dp=N** (only with N > 1 ranks): the same step with the DP group = the MPI world;
//!   each rank takes `batch / N` sequences of the global batch, so a step processes the same
//!   tokens as the dp=1 step. It also all-reduces the target count and the loss.
//!
//! Trials of the variants alternate in the same run (the order rotates every trial); the
//! medians over trials are reported, with the median of the paired time ratios. A trial's time
//! is the slowest rank's. Under `mpirun -np 2` the dp=1 variants run on both ranks at once (each
//! rank a full copy, one core each), so all three variants have one core per rank.
//! tokens/s counts the global batch: `batch * seq / step time`.
//!
//! Run, from the workspace root:
//!
//! ```text
//! cargo build --release -p merak-benches
//! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1 \
//!     mpirun -np 2 --oversubscribe --bind-to none target/release/bench-train-step
//! ```

#[path = "common.rs"]
mod common;
use common::median;

use std::time::Instant;

use anyhow::{Result, bail};
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use clap::Parser;
use merak_burn::backend::{CpuAutodiff, CpuDevice};
use merak_burn::comm::{Communicator, Group, MpiCommunicator, MpiWorld, ReduceOp};
use merak_burn::data_parallel::GradientBuffers;
use merak_burn::grid::{Layout, ProcessGrid};
use merak_burn::parallel_plan::ParallelPlan;
use merak_burn::pipeline::{PipelinePlan, ScheduleKind, build_schedule, explicit_partition};
use merak_burn::train::{SourceError, TokenSource, TrainSettings, Trainer, Windows};
use merak_gpt::{Gpt, GptConfig};

type B = CpuAutodiff;
type Model = Gpt<B>;

/// Command-line options.
#[derive(Parser, Debug)]
#[command(about = "Training step of a tiny GPT: plain Burn vs merak, dp=1 vs dp=N")]
struct Args {
    /// GPT preset.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// Global batch (sequences per optimizer step); dp=N splits it over the ranks.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Timed trials of each variant; medians are reported.
    #[arg(long, default_value_t = 11)]
    trials: usize,
    /// Training steps per trial.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps of each variant before the trials.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Seed of the weights and the token ids.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Learning rate (constant).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Bucket size in MiB of the extra dp=N variant with small, overlapped buckets.
    #[arg(long, default_value_t = 0.02)]
    small_bucket_mb: f64,
    /// DP bucket size in MiB (`parallel.bucket_mb`).
    #[arg(long, default_value_t = 1.0)]
    bucket_mb: f64,
}

/// Fixed token windows: rows `[seq]` of inputs and next-token targets.
struct Batch {
    ids: Vec<i64>,
    targets: Vec<i64>,
    rows: usize,
    seq: usize,
}

impl Batch {
    /// `rows` windows of `seq + 1` pseudo-random tokens below `vocab` (splitmix64 of `seed`).
    fn random(rows: usize, seq: usize, vocab: usize, seed: u64) -> Self {
        let mut state = seed;
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % vocab as u64) as i64
        };
        let (mut ids, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..rows {
            let window: Vec<i64> = (0..=seq).map(|_| next()).collect();
            ids.extend_from_slice(&window[..seq]);
            targets.extend_from_slice(&window[1..]);
        }
        Self {
            ids,
            targets,
            rows,
            seq,
        }
    }

    /// Rows `first..first + rows`.
    fn rows(&self, first: usize, rows: usize) -> Self {
        let r = first * self.seq..(first + rows) * self.seq;
        Self {
            ids: self.ids[r.clone()].to_vec(),
            targets: self.targets[r].to_vec(),
            rows,
            seq: self.seq,
        }
    }

    /// Fresh tensors of inputs and targets, as the training loop makes every step.
    fn tensors(&self, device: &CpuDevice) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
        let shape = [self.rows, self.seq];
        (
            Tensor::from_data(TensorData::new(self.ids.clone(), shape), device),
            Tensor::from_data(TensorData::new(self.targets.clone(), shape), device),
        )
    }
}

/// Seconds spent in the phases of the steps, added up.
#[derive(Clone, Copy, Default)]
struct Phases {
    /// Forward, loss read-back and backward.
    fwd_bwd: f64,
    /// Gradients collected: `GradientsParams::from_grads`, or `DataParallel::finish`.
    grads: f64,
    /// Global norm, clipping, split into parameter groups (merak only).
    norm_clip_split: f64,
    /// Optimizer step(s).
    optim: f64,
    steps: usize,
}

/// One variant: a model with its optimizer(s) and its share of the data.
trait Stepper {
    /// One optimizer step; returns the (global) loss and the gradient norm when computed.
    fn step(&mut self) -> Result<(f64, Option<f64>)>;
    /// Adds up phase times (only while `timing` is set).
    fn phases(&mut self) -> &mut Phases;
}

/// Splits a step into phases with one clock read per boundary.
struct Clock(Instant);

impl Clock {
    fn lap(&mut self) -> f64 {
        let now = Instant::now();
        let dt = (now - self.0).as_secs_f64();
        self.0 = now;
        dt
    }
}

struct Plain<O> {
    model: Option<Model>,
    optim: O,
    batch: Batch,
    lr: f64,
    device: CpuDevice,
    phases: Phases,
}

impl<O: Optimizer<Model, B>> Stepper for Plain<O> {
    fn step(&mut self) -> Result<(f64, Option<f64>)> {
        let mut clock = Clock(Instant::now());
        let model = self
            .model
            .take()
            .expect("the model is back after each step");
        let (x, y) = self.batch.tensors(&self.device);
        let loss = model.loss(x, y);
        let value = f64::from(loss.clone().into_scalar().elem::<f32>());
        let grads = loss.backward();
        self.phases.fwd_bwd += clock.lap();
        let grads = GradientsParams::from_grads(grads, &model);
        self.phases.grads += clock.lap();
        self.model = Some(self.optim.step(self.lr, model, grads));
        self.phases.optim += clock.lap();
        self.phases.steps += 1;
        Ok((value, None))
    }
    fn phases(&mut self) -> &mut Phases {
        &mut self.phases
    }
}

/// The fixed global batch as a data source: every step reads the same sequences.
struct Fixed(Batch);

impl TokenSource for Fixed {
    fn train_windows(
        &self,
        _step: usize,
        first: usize,
        count: usize,
    ) -> Result<Windows, SourceError> {
        let rows = self.0.rows(first, count);
        Ok(Windows {
            inputs: rows.ids,
            targets: rows.targets,
        })
    }

    fn val_windows(&self, first: usize, count: usize) -> Result<Windows, SourceError> {
        self.train_windows(0, first, count)
    }
}

/// `merak train`'s step: the library's [`Trainer`] on a one-stage plan.
struct Merak<'g> {
    trainer: Trainer<'g, B, Model>,
    data: Fixed,
    phases: Phases,
}

impl Stepper for Merak<'_> {
    fn step(&mut self) -> Result<(f64, Option<f64>)> {
        let o = self.trainer.step(&self.data)?;
        if o.grad_norm.is_none() {
            bail!("the loss is {}", o.loss);
        }
        let p = o.phases;
        self.phases.fwd_bwd += p.data_s + p.forward_backward_s;
        self.phases.grads += p.reduce_s;
        self.phases.norm_clip_split += p.clip_s;
        self.phases.optim += p.optimizer_s;
        self.phases.steps += 1;
        Ok((o.loss, o.grad_norm))
    }
    fn phases(&mut self) -> &mut Phases {
        &mut self.phases
    }
}

/// `merak train`'s AdamW settings (launch defaults: betas 0.9/0.95, eps 1e-8), for the plain
/// Burn variant.
fn adamw() -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_1(0.9)
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
}

const WEIGHT_DECAY: f32 = 0.01;
const GRAD_CLIP: f64 = 1.0;

fn merak_variant<'g>(
    cfg: &GptConfig,
    args: &Args,
    grid: &'g ProcessGrid,
    batch: Batch,
    device: &CpuDevice,
    bucket_mb: f64,
    gradient_buffers: GradientBuffers,
) -> Result<Box<dyn Stepper + 'g>> {
    let model = Model::new(cfg, args.seed, grid.tp, device)?;
    let units = cfg.layers + 2;
    let plan = PipelinePlan {
        schedule: build_schedule(ScheduleKind::OneFOneB, 1, 1, 1, &[false])?,
        partition: explicit_partition(&[units], units)?,
        recompute_units: vec![0],
    };
    let settings = TrainSettings {
        steps: args.warmup + args.trials * args.steps,
        global_batch: batch.rows,
        seq_len: batch.seq,
        lr: args.lr,
        min_lr: args.lr,
        warmup_steps: 0,
        weight_decay: f64::from(WEIGHT_DECAY),
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        grad_clip: GRAD_CLIP,
        skip_nonfinite: false,
        seed: args.seed,
        val_every: 0,
        val_batches: 0,
        precision: Default::default(),
        optimizer: Default::default(),
    };
    let parallel = ParallelPlan {
        dp: grid.layout.dp,
        micro_batch: batch.rows / grid.layout.dp,
        bucket_mb,
        gradient_buffers,
        ..ParallelPlan::default()
    };
    Ok(Box::new(Merak {
        trainer: Trainer::new(grid, &parallel, plan, settings, model, *device, false)?,
        data: Fixed(batch),
        phases: Phases::default(),
    }))
}

/// Seconds per step of `steps` steps (slowest rank). `control` is used only outside the timed
/// region, for the barrier and the reduction of the time.
fn trial(control: &MpiCommunicator, v: &mut dyn Stepper, steps: usize) -> Result<f64> {
    control.barrier()?;
    let t = Instant::now();
    for _ in 0..steps {
        v.step()?;
    }
    let mut secs = [(t.elapsed().as_secs_f64() / steps as f64) as f32];
    control.all_reduce(&mut secs, ReduceOp::Max)?;
    Ok(f64::from(secs[0]))
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.trials == 0 || args.steps == 0 {
        bail!("--trials and --steps must be positive");
    }
    let mpi = MpiWorld::init()?;
    let control = mpi.world();
    let (rank, n) = (control.rank(), control.size());
    if args.batch == 0 || args.batch % n != 0 {
        bail!(
            "--batch {} must be a positive multiple of the {n} ranks",
            args.batch
        );
    }
    let cfg = GptConfig::preset(&args.preset)?;
    let device = CpuDevice::default();
    let data = Batch::random(args.batch, cfg.seq_len, cfg.vocab_size, args.seed);
    let local_rows = args.batch / n;

    let plain_model = Model::new(&cfg, args.seed, Group::local(), &device)?;
    let params = plain_model.num_params();
    let plain: Box<dyn Stepper> = Box::new(Plain {
        model: Some(plain_model),
        optim: adamw().with_weight_decay(WEIGHT_DECAY).init::<B, Model>(),
        batch: data.rows(0, args.batch),
        lr: args.lr,
        device,
        phases: Phases::default(),
    });
    // The grids outlive the variants that borrow them: one process, and (n > 1) the world as
    // one data-parallel group, twice (separate communicators for the two bucket sizes).
    let single = ProcessGrid::single();
    let dp_layout = Layout {
        dp: n,
        tp: 1,
        cp: 1,
        pp: 1,
    };
    let worlds = if n > 1 {
        vec![
            ProcessGrid::from_mpi(mpi.world(), dp_layout)?,
            ProcessGrid::from_mpi(mpi.world(), dp_layout)?,
        ]
    } else {
        Vec::new()
    };
    let all_rows = || data.rows(0, args.batch);
    let host = GradientBuffers::Host;
    let dp1 = merak_variant(
        &cfg,
        &args,
        &single,
        all_rows(),
        &device,
        args.bucket_mb,
        host,
    )?;
    let mut variants: Vec<(String, Box<dyn Stepper>)> = vec![
        (format!("plain Burn (1 rank, batch {})", args.batch), plain),
        (format!("merak dp=1 (local, batch {})", args.batch), dp1),
    ];
    if let [world, small_world] = worlds.as_slice() {
        let dpn = merak_variant(
            &cfg,
            &args,
            world,
            all_rows(),
            &device,
            args.bucket_mb,
            host,
        )?;
        variants.push((format!("merak dp={n} (world, {local_rows}/rank)"), dpn));
        // The same with small buckets, whose all-reduces start during the backward pass.
        let small = merak_variant(
            &cfg,
            &args,
            small_world,
            all_rows(),
            &device,
            args.small_bucket_mb,
            host,
        )?;
        variants.push((
            format!("merak dp={n} buckets {} MiB", args.small_bucket_mb),
            small,
        ));
    }
    // Last: dp=1 with the gradients left as the backend's tensors (no host buckets).
    let device_grads = GradientBuffers::Device;
    let on_device = merak_variant(
        &cfg,
        &args,
        &single,
        all_rows(),
        &device,
        args.bucket_mb,
        device_grads,
    )?;
    variants.push(("merak dp=1 gradients as tensors".into(), on_device));

    // First step of every variant from the same weights and data: the losses agree, and the
    // dp=1 and dp=N gradient norms agree.
    let mut first = Vec::new();
    for (_, v) in &mut variants {
        first.push(v.step()?);
    }
    for _ in 1..args.warmup {
        for (_, v) in &mut variants {
            v.step()?;
        }
    }
    for (_, v) in &mut variants {
        *v.phases() = Phases::default();
    }

    let k = variants.len();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); k];
    let mut ratio_merak = Vec::new();
    let mut ratio_dp = Vec::new();
    for t in 0..args.trials {
        // Rotate which variant goes first, so that slow drifts of the machine hit all.
        let mut trial_times = vec![0.0; k];
        for j in 0..k {
            let i = (t + j) % k;
            trial_times[i] = trial(&control, variants[i].1.as_mut(), args.steps)?;
        }
        ratio_merak.push(trial_times[1] / trial_times[0]);
        if k > 3 {
            ratio_dp.push(trial_times[1] / trial_times[2]);
        }
        for (all, one) in times.iter_mut().zip(trial_times) {
            all.push(one);
        }
    }

    if rank == 0 {
        let tokens = (args.batch * cfg.seq_len) as f64;
        let med: Vec<f64> = times.iter_mut().map(|v| median(v)).collect();
        println!(
            "# {} GPT training step on Autodiff<Flex>: vocab {}, {} layers, {} heads, \
             hidden {}, seq {}, {params} parameters; global batch {} ({} tokens); ranks: {}; \
             {} trials x {} steps, medians, slowest rank",
            args.preset,
            cfg.vocab_size,
            cfg.layers,
            cfg.heads,
            cfg.hidden,
            cfg.seq_len,
            args.batch,
            tokens,
            n,
            args.trials,
            args.steps
        );
        let losses: Vec<String> = first.iter().map(|(l, _)| format!("{l:.6}")).collect();
        let norms: Vec<String> = first
            .iter()
            .filter_map(|(_, g)| g.map(|g| format!("{g:.6}")))
            .collect();
        println!(
            "# check, first step: loss {} (plain, merak dp=1{}, as tensors), grad norm {} \
             (merak dp=1{}, as tensors)",
            losses.join(" / "),
            if k > 3 {
                format!(", dp={n}, small buckets")
            } else {
                String::new()
            },
            norms.join(" / "),
            if k > 3 {
                format!(", dp={n}, small buckets")
            } else {
                String::new()
            },
        );
        println!();
        println!(
            "{:<34} {:>9} {:>10}   {:>8} {:>8} {:>8} {:>8}",
            "variant", "ms/step", "tokens/s", "fwd+bwd", "grads", "nrm/clip", "optim"
        );
        for ((name, v), m) in variants.iter_mut().zip(&med) {
            let p = *v.phases();
            let ms = |s: f64| s * 1e3 / p.steps.max(1) as f64;
            println!(
                "{:<34} {:>9.3} {:>10.0}   {:>8.3} {:>8.3} {:>8.3} {:>8.3}",
                name,
                m * 1e3,
                tokens / m,
                ms(p.fwd_bwd),
                ms(p.grads),
                ms(p.norm_clip_split),
                ms(p.optim)
            );
        }
        println!(
            "# phases: mean ms/step on rank 0 over the timed steps; grads = from_grads (plain) \
             or DataParallel::finish (merak); nrm/clip = global_grad_norm + clip_grads + \
             the parameter groups' split; optim = AdamW step(s)"
        );
        println!();
        println!(
            "merak/plain (dp=1): {:.3} (median of paired trials; ratio of medians {:.3})",
            median(&mut ratio_merak),
            med[1] / med[0]
        );
        if k > 3 {
            println!(
                "tokens/s dp={n} / dp=1: {:.3} (median of paired trials; ratio of medians \
                 {:.3}); ideal {n}",
                median(&mut ratio_dp),
                med[1] / med[2]
            );
        }
        if k > 4 {
            println!(
                "step time dp={n}, small buckets / one bucket: {:.3} (ratio of medians; below 1: \
                 overlapping the all-reduce with the backward pass pays)",
                med[3] / med[2]
            );
        }
        println!(
            "step time dp=1, gradients as tensors / host buckets: {:.3} (ratio of medians; \
             parallel.gradient_buffers = \"device\" against \"host\")",
            med[k - 1] / med[1]
        );
    }
    Ok(())
}
