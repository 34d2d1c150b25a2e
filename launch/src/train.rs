//! The training loop behind `merak train`.

use std::collections::HashSet;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use merak_bert::{BertConfig, mask_tokens};
use merak_burn::checkpoint::{self, Checkpoint, FullState, RankState, state};
use merak_burn::comm::ReduceOp;
use merak_burn::data_parallel::DataParallel;
use merak_burn::grid::ProcessGrid;
use merak_burn::kernels::FusedOps;
use merak_burn::pipeline::{
    Executor, MicroBatch, PipelineModel, PipelinePlan, ScheduleKind, TraceEvent, write_chrome_trace,
};
use merak_burn::tensor_parallel::{ParallelBackend, Shard};
use merak_burn::train::{
    FusedAdamW, LrSchedule, MetricsWriter, StepMetrics, clip_grads, global_grad_norm,
    sharded_param_ids, split_for_weight_decay,
};

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

/// How a run is set up besides its config.
pub struct RunSpec<'a> {
    /// The pipeline plan (one stage for pp = 1).
    pub plan: &'a PipelinePlan,
    /// The checkpoint to continue from.
    pub resume: Option<&'a Resume>,
    /// Write a Chrome trace of every rank's actions here.
    pub trace: Option<&'a Path>,
}

/// Trains `model` (this rank's stages and TP shard) on this rank's part of the grid (from the
/// state of `spec.resume` when given); rank 0 writes `out/metrics.jsonl`; checkpoints follow
/// `[checkpoint]`.
#[allow(clippy::too_many_arguments)]
pub fn train<B, M>(
    cfg: &Config,
    data: &Source,
    grid: &ProcessGrid,
    out: &Path,
    device: &B::Device,
    mut model: M,
    objective: &Objective,
    spec: RunSpec<'_>,
) -> Result<(Summary, M)>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
    M::InnerModule: PipelineModel<B::InnerBackend>,
{
    let resume = spec.resume;
    let t0 = Instant::now();
    let gpt = &cfg.model.gpt;
    let seed = cfg.train.seed;
    let sharded = sharded_param_ids::<B, _>(&model);
    // The head's copy of a tied embedding is counted once, on the rank with the embedding.
    let tied = model.tied_embedding();
    let holds_embedding = spec.plan.schedule.rank_of(0) == grid.coords.pp;
    let not_counted: HashSet<ParamId> = tied.filter(|_| !holds_embedding).into_iter().collect();
    let copies = model.tied_names();
    let mut executor = Executor::new(
        spec.plan.clone(),
        grid.pp,
        grid.tp,
        spec.trace.map(|_| grid.rank),
    );
    let mut max_in_flight = 0usize;
    // PipeDream-2BW: a step's gradients are computed on the weights from before the previous
    // update (V_t = V_{t-1} - lr * grad(V_{t-2})), so that the next batch can enter the
    // pipeline before the current one has left it. `stale` holds those weights.
    let two_bw = spec.plan.schedule.kind == ScheduleKind::TwoBw;
    let mut stale: Option<M> = None;
    // Two AdamW parameter groups: matrices decay, vectors (biases, norms) do not.
    // Burn's AdamW formula and records, each parameter's update fused into one pass.
    let (beta1, beta2, eps) = (
        cfg.train.beta1 as f32,
        cfg.train.beta2 as f32,
        cfg.train.eps as f32,
    );
    let mut optim_decay =
        FusedAdamW::new(beta1, beta2, eps, cfg.train.weight_decay as f32).init::<B, M>();
    let mut optim_no_decay = FusedAdamW::new(beta1, beta2, eps, 0.0).init::<B, M>();
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
    let hidden = gpt.hidden;
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
            let (params, moments) =
                r.state
                    .cut_for(&r.checkpoint.manifest, &shapes, shard, &copies)?;
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
        let faults = merak_burn::train::process::minor_faults();
        reducer.begin_step();
        // The step's micro-batches, and their share of the global batch's target tokens
        // (masked LM: the number of masked positions varies), so that every layout computes
        // the gradient of the same global mean loss.
        let windows: Vec<(Vec<i64>, Vec<i64>)> = (0..micro_batches)
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
        let counts: Vec<f32> = windows
            .iter()
            .map(|(_, y)| y.iter().filter(|&&t| t >= 0).count() as f32)
            .collect();
        let mut total = [counts.iter().sum::<f32>()];
        if dp > 1 {
            grid.dp.comm()?.all_reduce(&mut total, ReduceOp::Sum)?;
        }
        let batches: Vec<MicroBatch> = windows
            .into_iter()
            .zip(&counts)
            .enumerate()
            .map(|(m, ((inputs, targets), n))| MicroBatch {
                inputs,
                targets,
                weight: n / total[0].max(1.0),
                first_sample: first + m * micro,
            })
            .collect();
        // The gradients travel through the reducer's hooks; Burn's copy is not needed.
        let report = executor.run_step(
            stale.as_ref().unwrap_or(&model),
            &reducer,
            &batches,
            step,
            [micro, seq, hidden],
            device,
        )?;
        max_in_flight = max_in_flight.max(report.max_in_flight);
        let (mut grads, dp_stats) = reducer.finish::<B, _>(&model)?;
        sum_tied_grads::<B>(&mut grads, grid, tied, device)?;
        let mut loss_value = report.loss;
        if grid.layout.pp > 1 {
            let mut l = [loss_value as f32];
            grid.pp.comm()?.all_reduce(&mut l, ReduceOp::Sum)?;
            loss_value = f64::from(l[0]);
        }
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
        let grad_norm =
            global_grad_norm::<B, _>(&model, &grads, &sharded, grid.tp, grid.pp, &not_counted)?;
        clip_grads::<B, _>(&model, &mut grads, grad_norm, cfg.train.grad_clip);
        let lr = schedule.at(step);
        let (decay, no_decay) = split_for_weight_decay::<B, _>(&model, grads, owned.as_ref());
        if two_bw {
            stale = Some(model.clone());
        }
        model = optim_decay.step(lr, model, decay);
        model = optim_no_decay.step(lr, model, no_decay);
        if zero {
            model = reducer.broadcast_from_owners(model)?;
        }
        let val_every = cfg.data.val_every;
        let val_loss = (val_every > 0
            && ((step + 1) % val_every == 0 || step + 1 == cfg.train.steps))
            .then(|| validation_loss::<B, M>(&model, data, objective, cfg, grid, &executor, device))
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
            minor_faults: merak_burn::train::process::minor_faults().saturating_sub(faults),
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
    report_memory(grid, spec.plan, max_in_flight, out)?;
    if let Some(path) = spec.trace {
        write_trace(path, executor.take_trace(), grid)?;
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
    B::InnerBackend: FusedOps,
    M: AutodiffModule<B> + PipelineModel<B>,
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
    // A tied copy is stored once, under its original's name.
    let copies: Vec<String> = model.tied_names().into_iter().map(|(c, _)| c).collect();
    moments.retain(|(name, _)| !copies.contains(name));
    let mut params = state::local_params(model)?;
    params.retain(|p| !copies.contains(&p.name));
    let rank_state = RankState { params, moments };
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
/// each DP rank evaluates its share through the pipeline and the losses are summed over the
/// pipeline and DP groups.
#[allow(clippy::too_many_arguments)]
fn validation_loss<B, M>(
    model: &M,
    data: &Source,
    objective: &Objective,
    cfg: &Config,
    grid: &ProcessGrid,
    executor: &Executor,
    device: &B::Device,
) -> Result<f64>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
    M: AutodiffModule<B>,
    M::InnerModule: PipelineModel<B::InnerBackend>,
{
    let model = model.valid();
    let seq = cfg.model.gpt.seq_len;
    let local = cfg.train.global_batch / grid.layout.dp;
    let micro = cfg.micro_batch();
    // Per-micro-batch mean losses weighted by target tokens: (sum of losses, target tokens).
    let mut acc = [0.0f32, 0.0f32];
    for b in 0..cfg.data.val_batches {
        let batches: Vec<MicroBatch> = (0..local / micro)
            .map(|m| {
                let first = b * cfg.train.global_batch + grid.coords.dp * local + m * micro;
                let (inputs, targets) = objective.apply(
                    data.val_batch(first, micro, seq),
                    seq,
                    cfg.train.seed,
                    |i| format!("mlm-val/{}", first + i),
                );
                let n = targets.iter().filter(|&&t| t >= 0).count() as f32;
                acc[1] += n;
                MicroBatch {
                    inputs,
                    targets,
                    weight: n,
                    first_sample: first,
                }
            })
            .collect();
        acc[0] +=
            executor.forward_only(&model, &batches, [micro, seq, cfg.model.gpt.hidden], device)?
                as f32;
    }
    if grid.layout.pp > 1 {
        // Only the last stage has the losses; every stage counted the tokens.
        let mut l = [acc[0]];
        grid.pp.comm()?.all_reduce(&mut l, ReduceOp::Sum)?;
        acc[0] = l[0];
    }
    if grid.layout.dp > 1 {
        grid.dp.comm()?.all_reduce(&mut acc, ReduceOp::Sum)?;
    }
    Ok(f64::from(acc[0] / acc[1].max(1.0)))
}

/// Tag of the tied-embedding gradient exchange (after every pipeline message of the step).
const TIED_TAG: u16 = 32_767;

/// Sums the gradients of the two copies of a tied embedding across the first and the last
/// pipeline rank, so that both copies take the same step.
fn sum_tied_grads<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    grid: &ProcessGrid,
    tied: Option<ParamId>,
    device: &B::Device,
) -> Result<()> {
    let (Some(id), true) = (tied, grid.layout.pp > 1) else {
        return Ok(());
    };
    let p = grid.layout.pp;
    let partner = if grid.coords.pp == 0 { p - 1 } else { 0 };
    let g = grads
        .remove::<B::InnerBackend, 2>(id)
        .context("the tied embedding has no gradient")?;
    let shape = g.dims();
    let mine: Vec<f32> = g
        .into_data()
        .convert::<f32>()
        .into_vec()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let comm = grid.pp.comm()?;
    let sending = comm.send_start(mine.clone(), partner, TIED_TAG)?;
    let mut other = vec![0.0f32; mine.len()];
    comm.recv(&mut other, partner, TIED_TAG)?;
    sending.wait()?;
    // a + b == b + a: both ranks get the same bits.
    let sum: Vec<f32> = mine.iter().zip(&other).map(|(a, b)| a + b).collect();
    grads.register(
        id,
        Tensor::<B::InnerBackend, 2>::from_data(TensorData::new(sum, shape), device),
    );
    Ok(())
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`; 0 where unavailable).
/// Rank 0 writes `out/memory.json` and, under pp > 1, logs per rank its pipeline stages, the
/// most micro-batches it held in flight, the units it recomputed and its peak resident memory.
fn report_memory(
    grid: &ProcessGrid,
    plan: &PipelinePlan,
    max_in_flight: usize,
    out: &Path,
) -> Result<()> {
    let world = grid.world.comm()?;
    let mine = [
        merak_burn::train::process::peak_rss_bytes() as f32 / (1 << 20) as f32,
        max_in_flight as f32,
    ];
    let mut all = vec![0.0f32; 2 * world.size()];
    world.all_gather(&mine, &mut all)?;
    if grid.rank == 0 {
        let ranks: Vec<serde_json::Value> = all
            .chunks(2)
            .enumerate()
            .map(|(rank, v)| {
                let pp = grid.layout.coords(rank).pp;
                let stages: Vec<usize> = (0..plan.schedule.stages())
                    .filter(|&s| plan.schedule.rank_of(s) == pp)
                    .collect();
                let recompute: Vec<usize> =
                    stages.iter().map(|&s| plan.recompute_units[s]).collect();
                serde_json::json!({
                    "rank": rank,
                    "pp_rank": pp,
                    "stages": stages,
                    "recompute_units": recompute,
                    "peak_rss_mib": v[0],
                    "max_in_flight": v[1] as usize,
                })
            })
            .collect();
        let json = serde_json::json!({
            "schedule": plan.schedule.kind.to_string(),
            "ranks": ranks,
        });
        std::fs::write(out.join("memory.json"), serde_json::to_vec_pretty(&json)?)
            .context("writing memory.json")?;
    }
    if grid.rank == 0 && grid.layout.pp > 1 {
        for (rank, v) in all.chunks(2).enumerate() {
            let pp = grid.layout.coords(rank).pp;
            let stages: Vec<String> = (0..plan.schedule.stages())
                .filter(|&s| plan.schedule.rank_of(s) == pp)
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
    Ok(())
}

/// The gaps between a rank's recorded actions, as "idle" spans (waiting for the pipeline,
/// the DP all-reduce, the optimizer and everything else outside the schedule's actions).
fn idle_gaps(events: &[TraceEvent]) -> Vec<TraceEvent> {
    let mut by_rank: std::collections::BTreeMap<usize, Vec<(f64, f64)>> = Default::default();
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
/// rank 0 merges them (times from the earliest event).
fn write_trace(path: &Path, events: Vec<TraceEvent>, grid: &ProcessGrid) -> Result<()> {
    let part = |r: usize| path.with_extension(format!("rank{r}.json"));
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(part(grid.rank), serde_json::to_vec(&events)?)
        .with_context(|| format!("writing {}", part(grid.rank).display()))?;
    let world = grid.world.comm()?;
    world.barrier()?;
    if grid.rank == 0 {
        let mut all: Vec<TraceEvent> = Vec::new();
        for r in 0..world.size() {
            let text =
                std::fs::read(part(r)).with_context(|| format!("reading {}", part(r).display()))?;
            all.extend(serde_json::from_slice::<Vec<TraceEvent>>(&text)?);
            let _ = std::fs::remove_file(part(r));
        }
        let t0 = all.iter().map(|e| e.start_s).fold(f64::INFINITY, f64::min);
        for e in &mut all {
            e.start_s -= t0;
        }
        all.extend(idle_gaps(&all));
        write_chrome_trace(path, &all).with_context(|| format!("writing {}", path.display()))?;
        tracing::info!(
            "trace: {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    world.barrier()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::optim::{AdamWConfig, GradientsParams};
    use merak_burn::checkpoint::state::local_params;
    use merak_gpt::Gpt;

    type B = merak_burn::backend::CpuAutodiff;

    /// Runs `merak train`'s loop in this process (one rank) and returns its losses and model.
    fn run_loop(sets: &[&str], name: &str) -> (Vec<f64>, Gpt<B>, Config) {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let cfg = crate::config::load(None, &sets).unwrap();
        let grid = ProcessGrid::single();
        let data = Source::open(&cfg).unwrap();
        let plan = crate::stages::build_plan(&cfg).unwrap();
        let device = Default::default();
        let model = Gpt::<B>::new(&cfg.model.gpt, cfg.train.seed, grid.tp, &device).unwrap();
        let out = std::env::temp_dir().join(format!("merak-unit-{name}-{}", std::process::id()));
        let spec = RunSpec {
            plan: &plan,
            resume: None,
            trace: None,
        };
        let (_, trained) = train(
            &cfg,
            &data,
            &grid,
            &out,
            &device,
            model,
            &Objective::Causal,
            spec,
        )
        .unwrap();
        let losses = std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        let _ = std::fs::remove_dir_all(&out);
        (losses, trained, cfg)
    }

    const SETS: [&str; 7] = [
        "train.steps=4",
        "train.weight_decay=0",
        "train.grad_clip=0",
        "train.min_lr=3e-3",
        "train.warmup_steps=0",
        "checkpoint.at_end=false",
        "parallel.schedule=2bw",
    ];

    #[test]
    fn two_bw_follows_the_delayed_weight_rule() {
        let (losses, trained, cfg) = run_loop(&SETS, "2bw");
        // The reference: a plain Burn loop applying V_t = V_{t-1} - AdamW(grad(V_{t-2})).
        let device = Default::default();
        let grid = ProcessGrid::single();
        let data = Source::open(&cfg).unwrap();
        let (gb, seq) = (cfg.train.global_batch, cfg.model.gpt.seq_len);
        let mut current = Gpt::<B>::new(&cfg.model.gpt, cfg.train.seed, grid.tp, &device).unwrap();
        let mut stale = current.clone();
        let mut optim = AdamWConfig::new()
            .with_beta_1(cfg.train.beta1 as f32)
            .with_beta_2(cfg.train.beta2 as f32)
            .with_epsilon(cfg.train.eps as f32)
            .with_weight_decay(0.0)
            .init::<B, Gpt<B>>();
        let mut reference = Vec::new();
        for step in 0..cfg.train.steps {
            let (x, y) = data.train_batch(step, gb, 0, gb, seq);
            let x = Tensor::<B, 2, burn::tensor::Int>::from_data(
                TensorData::new(x, [gb, seq]),
                &device,
            );
            let y = Tensor::<B, 2, burn::tensor::Int>::from_data(
                TensorData::new(y, [gb, seq]),
                &device,
            );
            let loss = stale.loss(x, y);
            reference.push(f64::from(loss.clone().into_scalar()));
            let grads = GradientsParams::from_grads(loss.backward(), &stale);
            let next_stale = current.clone();
            current = optim.step(cfg.train.lr, current, grads);
            stale = next_stale;
        }
        for (i, (a, b)) in losses.iter().zip(&reference).enumerate() {
            assert!(
                ((a - b) / b).abs() <= 1e-6,
                "step {}: merak {a}, reference {b}",
                i + 1
            );
        }
        let (ours, theirs) = (
            local_params(&trained).unwrap(),
            local_params(&current).unwrap(),
        );
        for (p, q) in ours.iter().zip(&theirs) {
            assert_eq!(p.name, q.name);
            let num: f64 = p
                .values
                .iter()
                .zip(&q.values)
                .map(|(a, b)| f64::from(a - b).powi(2))
                .sum();
            let den: f64 = q.values.iter().map(|b| f64::from(*b).powi(2)).sum();
            assert!(num.sqrt() <= 1e-5 * den.sqrt().max(1e-12), "{}", p.name);
        }
        // The delay is real: plain 1F1B takes other steps.
        let mut plain = SETS;
        plain[6] = "parallel.schedule=1f1b";
        let (plain_losses, _, _) = run_loop(&plain, "1f1b");
        assert_eq!(plain_losses[0], losses[0], "the first step uses V0 in both");
        assert!(
            plain_losses[1..]
                .iter()
                .zip(&losses[1..])
                .all(|(a, b)| a != b),
            "{plain_losses:?} vs {losses:?}"
        );
    }
}
