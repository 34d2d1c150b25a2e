//! The training loop behind `merak train`.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use merak_bert::{Bert, BertConfig, mask_tokens};
use merak_burn::checkpoint::{self, Checkpoint, FullState, RankState, state};
use merak_burn::comm::ReduceOp;
use merak_burn::data_parallel::DataParallel;
use merak_burn::grid::ProcessGrid;
use merak_burn::tensor_parallel::{ParallelBackend, Shard, set_dropout_position};
use merak_burn::train::{
    LrSchedule, MetricsWriter, StepMetrics, clip_grads, global_grad_norm, sharded_param_ids,
    split_for_weight_decay,
};
use merak_gpt::Gpt;

use crate::config::Config;
use crate::data::Source;

/// What a finished run reports.
#[derive(Debug)]
pub struct Summary {
    /// Steps run.
    pub steps: usize,
    /// Loss of the last step.
    pub final_loss: f64,
    /// Mean tokens per second over all steps.
    pub mean_tokens_per_s: f64,
    /// Wall time in seconds.
    pub wall_s: f64,
    /// Steps skipped for a non-finite loss.
    pub skipped: usize,
}

/// A model `merak train` can train: a loss from token ids and targets (negative targets are
/// ignored).
pub trait LanguageModel<B: Backend>: Module<B> {
    /// Mean loss over the targets.
    fn lm_loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1>;
}

impl<B: ParallelBackend> LanguageModel<B> for Gpt<B> {
    fn lm_loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss(ids, targets)
    }
}

impl<B: ParallelBackend> LanguageModel<B> for Bert<B> {
    fn lm_loss(&self, ids: Tensor<B, 2, Int>, targets: Tensor<B, 2, Int>) -> Tensor<B, 1> {
        self.loss(ids, targets)
    }
}

/// What the model learns from a window of tokens.
pub enum Objective {
    /// Next-token prediction (GPT).
    Causal,
    /// Masked-token prediction (BERT): 15% of the positions, masked 80/10/10 from the seed.
    Masked(BertConfig),
}

impl Objective {
    /// Turns `count` windows of causal `(inputs, targets)` into the model's inputs and targets;
    /// `stream(i)` names the random stream of window `i` (global, so every layout agrees).
    fn apply(
        &self,
        (x, y): (Vec<i64>, Vec<i64>),
        seq: usize,
        seed: u64,
        stream: impl Fn(usize) -> String,
    ) -> (Vec<i64>, Vec<i64>) {
        match self {
            Objective::Causal => (x, y),
            Objective::Masked(cfg) => {
                let mut inputs = Vec::with_capacity(x.len());
                let mut targets = Vec::with_capacity(x.len());
                for (i, window) in x.chunks(seq).enumerate() {
                    let (a, b) = mask_tokens(window, seq, cfg, seed, &stream(i));
                    inputs.extend(a);
                    targets.extend(b);
                }
                (inputs, targets)
            }
        }
    }
}

/// A checkpoint to continue from, read and verified before training starts.
pub struct Resume {
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// Its tensors at full size.
    pub state: FullState,
}

/// Where checkpoints of this run go.
pub fn checkpoint_root(cfg: &Config, out: &Path) -> std::path::PathBuf {
    if cfg.checkpoint.dir.is_empty() {
        out.join("checkpoints")
    } else {
        std::path::PathBuf::from(&cfg.checkpoint.dir)
    }
}

/// Trains `model` on this rank's part of the grid (from the state of `resume` when given);
/// rank 0 writes `out/metrics.jsonl`; checkpoints follow `[checkpoint]`.
#[allow(clippy::too_many_arguments)]
pub fn train<B, M>(
    cfg: &Config,
    data: &Source,
    grid: &ProcessGrid,
    out: &Path,
    device: &B::Device,
    mut model: M,
    objective: &Objective,
    resume: Option<&Resume>,
) -> Result<(Summary, M)>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
    M: LanguageModel<B> + AutodiffModule<B>,
    M::InnerModule: LanguageModel<B::InnerBackend>,
{
    let t0 = Instant::now();
    let gpt = &cfg.model.gpt;
    let seed = cfg.train.seed;
    let sharded = sharded_param_ids::<B, _>(&model);
    // Two AdamW parameter groups: matrices decay, vectors (biases, norms) do not.
    let adamw = AdamWConfig::new()
        .with_beta_1(cfg.train.beta1 as f32)
        .with_beta_2(cfg.train.beta2 as f32)
        .with_epsilon(cfg.train.eps as f32);
    let mut optim_decay = adamw
        .clone()
        .with_weight_decay(cfg.train.weight_decay as f32)
        .init::<B, M>();
    let mut optim_no_decay = adamw.with_weight_decay(0.0).init::<B, M>();
    let bucket_elems = (cfg.parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize;
    let reducer = DataParallel::new(&model, grid.dp, bucket_elems)?;
    let zero = cfg.parallel.zero == 1;
    let owned = zero.then(|| reducer.owned_params());
    let schedule = LrSchedule {
        peak: cfg.train.lr,
        min: cfg.train.min_lr,
        warmup: cfg.train.warmup_steps,
        total: cfg.train.steps,
    };
    let dp = grid.layout.dp;
    let local_batch = cfg.train.global_batch / dp;
    let micro = cfg.micro_batch();
    let micro_batches = local_batch / micro;
    let first = grid.coords.dp * local_batch;
    let seq = gpt.seq_len;
    let tokens_per_step = (cfg.train.global_batch * seq) as f64;

    // Continue from a checkpoint: this rank's pieces of the parameters and of the AdamW
    // moments it keeps, cut for this run's layout.
    let start = match resume {
        None => 0,
        Some(r) => {
            let shapes = state::param_shapes(&model);
            let shard = Shard {
                rank: grid.coords.tp,
                size: grid.layout.tp,
            };
            let (params, moments) = r.state.cut_for(&r.checkpoint.manifest, &shapes, shard)?;
            model = state::assign_params(model, params)?;
            let mine = |id: burn::module::ParamId| owned.as_ref().is_none_or(|o| o.contains(&id));
            optim_decay =
                optim_decay.load_record(state::adamw_records(&model, &moments, &|id, rank| {
                    rank >= 2 && mine(id)
                }));
            optim_no_decay =
                optim_no_decay.load_record(state::adamw_records(&model, &moments, &|id, rank| {
                    rank < 2 && mine(id)
                }));
            let step = r.checkpoint.manifest.step;
            tracing::info!(
                "resumed from {} after step {step} (saved under dp={} tp={} pp={})",
                r.checkpoint.dir.display(),
                r.checkpoint.manifest.layout.dp,
                r.checkpoint.manifest.layout.tp,
                r.checkpoint.manifest.layout.pp
            );
            step
        }
    };
    if start >= cfg.train.steps {
        anyhow::bail!(
            "the checkpoint is at step {start}, and train.steps = {}: nothing left to train (raise train.steps)",
            cfg.train.steps
        );
    }
    let ckpt_root = checkpoint_root(cfg, out);

    let mut metrics = if grid.rank == 0 {
        std::fs::create_dir_all(out)
            .with_context(|| format!("creating output folder {}", out.display()))?;
        let path = out.join("metrics.jsonl");
        let w = if start > 0 {
            MetricsWriter::resume(&path, start)
        } else {
            MetricsWriter::create(&path)
        };
        Some(w.context("creating metrics.jsonl")?)
    } else {
        None
    };
    tracing::info!(
        params = model.num_params(),
        layout = %format!("dp={} tp={} pp={}", dp, grid.layout.tp, grid.layout.pp),
        "model ready in {:.2}s",
        t0.elapsed().as_secs_f64()
    );

    // Rank 0 on a terminal shows a progress bar with step, loss, tokens/s and ETA; otherwise
    // (logs, CI) one line per step.
    let progress =
        (grid.rank == 0 && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| {
            let bar = indicatif::ProgressBar::new(cfg.train.steps as u64);
            bar.set_position(start as u64);
            bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len} | {msg} | {elapsed_precise} ETA {eta_precise}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
            bar
        });
    let mut final_loss = f64::NAN;
    let mut skipped = 0usize;
    let mut total_time = 0.0;
    for step in start..cfg.train.steps {
        let ts = Instant::now();
        reducer.begin_step();
        // The step's micro-batches, and their share of the global batch's target tokens
        // (masked LM: the number of masked positions varies), so that every layout computes
        // the gradient of the same global mean loss.
        let batches: Vec<(Vec<i64>, Vec<i64>)> = (0..micro_batches)
            .map(|m| {
                let start = first + m * micro;
                objective.apply(
                    data.train_batch(step, cfg.train.global_batch, start, micro, seq),
                    seq,
                    seed,
                    |i| format!("mlm/{step}/{}", start + i),
                )
            })
            .collect();
        let counts: Vec<f32> = batches
            .iter()
            .map(|(_, y)| y.iter().filter(|&&t| t >= 0).count() as f32)
            .collect();
        let mut total = [counts.iter().sum::<f32>()];
        if dp > 1 {
            grid.dp.comm()?.all_reduce(&mut total, ReduceOp::Sum)?;
        }
        let mut loss_value = 0.0f64;
        for (m, ((x, y), n)) in batches.into_iter().zip(&counts).enumerate() {
            let x = Tensor::<B, 2, Int>::from_data(TensorData::new(x, [micro, seq]), device);
            let y = Tensor::<B, 2, Int>::from_data(TensorData::new(y, [micro, seq]), device);
            reducer.set_last_micro_batch(m + 1 == micro_batches);
            set_dropout_position(step as u64, (first + m * micro) as u64);
            let share = n / total[0].max(1.0);
            let loss = reducer.hooked(model.clone()).lm_loss(x, y) * share;
            loss_value += f64::from(loss.clone().into_scalar().elem::<f32>());
            // The gradients travel through the reducer's hooks; Burn's copy is not needed.
            let _ = loss.backward();
        }
        let (mut grads, dp_stats) = reducer.finish::<B, _>(&model)?;
        if dp > 1 {
            let mut l = [loss_value as f32];
            grid.dp.comm()?.all_reduce(&mut l, ReduceOp::Sum)?;
            loss_value = f64::from(l[0]);
        }
        if !loss_value.is_finite() {
            if !cfg.train.skip_nonfinite {
                anyhow::bail!(
                    "the loss is {loss_value} at step {}: training stopped (set train.skip_nonfinite = true to skip such steps, or lower train.lr)",
                    step + 1
                );
            }
            tracing::warn!(
                "the loss is {loss_value} at step {}: step skipped, parameters unchanged",
                step + 1
            );
            skipped += 1;
            save_if_due(
                cfg,
                step + 1,
                &ckpt_root,
                &model,
                &optim_decay,
                &optim_no_decay,
                grid,
            )?;
            continue;
        }
        let grad_norm = global_grad_norm::<B, _>(&model, &grads, &sharded, grid.tp)?;
        clip_grads::<B, _>(&model, &mut grads, grad_norm, cfg.train.grad_clip);
        let lr = schedule.at(step);
        let (decay, no_decay) = split_for_weight_decay::<B, _>(&model, grads, owned.as_ref());
        model = optim_decay.step(lr, model, decay);
        model = optim_no_decay.step(lr, model, no_decay);
        if zero {
            model = reducer.broadcast_from_owners(model)?;
        }
        let val_every = cfg.data.val_every;
        let val_loss = (val_every > 0
            && ((step + 1) % val_every == 0 || step + 1 == cfg.train.steps))
            .then(|| validation_loss::<B, M>(&model, data, objective, cfg, grid, device))
            .transpose()?;
        let dt = ts.elapsed().as_secs_f64();
        total_time += dt;
        final_loss = loss_value;
        let m = StepMetrics {
            step: step + 1,
            loss: loss_value,
            lr,
            grad_norm,
            tokens_per_s: tokens_per_step / dt,
            step_time_s: dt,
            dp_exposed_comm_s: dp_stats.exposed_wait.as_secs_f64(),
            dp_overlapped_buckets: dp_stats.overlapped_buckets,
            dp_buckets: dp_stats.buckets,
            val_loss,
        };
        if let Some(w) = metrics.as_mut() {
            w.write(&m).context("writing metrics.jsonl")?;
            let line = format!(
                "step {}/{} loss {:.5}{} lr {:.2e} grad_norm {:.4} tokens/s {:.0} step {:.3}s",
                m.step,
                cfg.train.steps,
                m.loss,
                m.val_loss
                    .map(|v| format!(" val_loss {v:.5}"))
                    .unwrap_or_default(),
                m.lr,
                m.grad_norm,
                m.tokens_per_s,
                m.step_time_s
            );
            match &progress {
                // On a terminal: a live bar, and a log line when validation ran.
                Some(bar) => {
                    let mean = tokens_per_step * (step + 1) as f64 / total_time.max(1e-9);
                    bar.set_message(format!("loss {:.4} | {:.0} tokens/s", m.loss, mean));
                    bar.inc(1);
                    if m.val_loss.is_some() {
                        bar.suspend(|| tracing::info!("{line}"));
                    }
                }
                None => tracing::info!("{line}"),
            }
        }
        let t_save = Instant::now();
        let saved = save_if_due(
            cfg,
            step + 1,
            &ckpt_root,
            &model,
            &optim_decay,
            &optim_no_decay,
            grid,
        )?;
        if let Some(dir) = saved.filter(|_| grid.rank == 0) {
            let secs = t_save.elapsed().as_secs_f64();
            let log = || tracing::info!("checkpoint: {} ({secs:.2}s)", dir.display());
            match &progress {
                Some(bar) => bar.suspend(log),
                None => log(),
            }
        }
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }
    Ok((
        Summary {
            steps: cfg.train.steps,
            final_loss,
            mean_tokens_per_s: tokens_per_step * (cfg.train.steps - start) as f64
                / total_time.max(1e-9),
            wall_s: t0.elapsed().as_secs_f64(),
            skipped,
        },
        model,
    ))
}

/// Writes a checkpoint after `step` steps when `[checkpoint]` asks for one; returns its folder.
fn save_if_due<B, M, O>(
    cfg: &Config,
    step: usize,
    root: &Path,
    model: &M,
    optim_decay: &O,
    optim_no_decay: &O,
    grid: &ProcessGrid,
) -> Result<Option<std::path::PathBuf>>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B, Record = state::AdamWRecords<B>>,
{
    let c = &cfg.checkpoint;
    let due =
        (c.every > 0 && step.is_multiple_of(c.every)) || (c.at_end && step == cfg.train.steps);
    if !due {
        return Ok(None);
    }
    // Without ZeRO every DP replica holds the same moments: the first one writes them.
    let writes_moments = cfg.parallel.zero == 1 || grid.coords.dp == 0;
    let mut moments = Vec::new();
    if writes_moments {
        moments.extend(state::moments(model, &optim_decay.to_record())?);
        moments.extend(state::moments(model, &optim_no_decay.to_record())?);
    }
    let rank_state = RankState {
        params: state::local_params(model)?,
        moments,
    };
    let extra = serde_json::json!({
        "config": toml::to_string(cfg)?,
        "data": {
            "samples_consumed": step * cfg.train.global_batch,
            "order": "windows shuffled per epoch by train.seed; step s reads global batch s",
        },
        "rng": {
            "seed": cfg.train.seed,
            "note": "dropout and masking streams are keyed by (seed, step, sample): the step is the whole RNG state",
        },
    });
    let dir = checkpoint::save(root, step, c.keep, &rank_state, extra, grid)
        .with_context(|| format!("writing the checkpoint of step {step}"))?;
    Ok(Some(dir))
}

/// Mean loss over `data.val_batches` global batches of held-out sequences, without gradients;
/// each DP rank evaluates its share and the means are averaged over the DP group.
fn validation_loss<B, M>(
    model: &M,
    data: &Source,
    objective: &Objective,
    cfg: &Config,
    grid: &ProcessGrid,
    device: &B::Device,
) -> Result<f64>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
    M: AutodiffModule<B>,
    M::InnerModule: LanguageModel<B::InnerBackend>,
{
    let model = model.valid();
    let seq = cfg.model.gpt.seq_len;
    let local = cfg.train.global_batch / grid.layout.dp;
    let micro = cfg.micro_batch();
    // Sum of per-token losses and number of target tokens, over this rank's share.
    let mut acc = [0.0f32, 0.0f32];
    for b in 0..cfg.data.val_batches {
        for m in 0..local / micro {
            let first = b * cfg.train.global_batch + grid.coords.dp * local + m * micro;
            let (x, y) = objective.apply(
                data.val_batch(first, micro, seq),
                seq,
                cfg.train.seed,
                |i| format!("mlm-val/{}", first + i),
            );
            let n = y.iter().filter(|&&t| t >= 0).count() as f32;
            let x = Tensor::<B::InnerBackend, 2, Int>::from_data(
                TensorData::new(x, [micro, seq]),
                device,
            );
            let y = Tensor::<B::InnerBackend, 2, Int>::from_data(
                TensorData::new(y, [micro, seq]),
                device,
            );
            acc[0] += model.lm_loss(x, y).into_scalar().elem::<f32>() * n;
            acc[1] += n;
        }
    }
    if grid.layout.dp > 1 {
        grid.dp.comm()?.all_reduce(&mut acc, ReduceOp::Sum)?;
    }
    let mean = [acc[0] / acc[1].max(1.0)];
    Ok(f64::from(mean[0]))
}
