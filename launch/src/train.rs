//! The training loop behind `merak train`.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::optim::{AdamWConfig, Optimizer};
use burn::tensor::ElementConversion;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::comm::ReduceOp;
use merak_burn::data_parallel::DataParallel;
use merak_burn::grid::ProcessGrid;
use merak_burn::tensor_parallel::ParallelBackend;
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

/// Trains the GPT of `cfg` on this rank's part of the grid; rank 0 writes `out/metrics.jsonl`.
pub fn train<B>(
    cfg: &Config,
    data: &Source,
    grid: &ProcessGrid,
    out: &Path,
    device: &B::Device,
) -> Result<Summary>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
{
    let t0 = Instant::now();
    let gpt = &cfg.model.gpt;
    let seed = cfg.train.seed;
    let mut model: Gpt<B> = Gpt::new(gpt, seed, grid.tp, device).context("building the model")?;
    let sharded = sharded_param_ids::<B, _>(&model);
    // Two AdamW parameter groups: matrices decay, vectors (biases, norms) do not.
    let adamw = AdamWConfig::new()
        .with_beta_1(cfg.train.beta1 as f32)
        .with_beta_2(cfg.train.beta2 as f32)
        .with_epsilon(cfg.train.eps as f32);
    let mut optim_decay = adamw
        .clone()
        .with_weight_decay(cfg.train.weight_decay as f32)
        .init::<B, Gpt<B>>();
    let mut optim_no_decay = adamw.with_weight_decay(0.0).init::<B, Gpt<B>>();
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

    let mut metrics = if grid.rank == 0 {
        std::fs::create_dir_all(out)
            .with_context(|| format!("creating output folder {}", out.display()))?;
        Some(MetricsWriter::create(&out.join("metrics.jsonl")).context("creating metrics.jsonl")?)
    } else {
        None
    };
    tracing::info!(
        params = gpt.num_params(),
        layout = %format!("dp={} tp={} pp={}", dp, grid.layout.tp, grid.layout.pp),
        "model ready in {:.2}s",
        t0.elapsed().as_secs_f64()
    );

    // Rank 0 on a terminal shows a progress bar with step, loss, tokens/s and ETA; otherwise
    // (logs, CI) one line per step.
    let progress =
        (grid.rank == 0 && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| {
            let bar = indicatif::ProgressBar::new(cfg.train.steps as u64);
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
    for step in 0..cfg.train.steps {
        let ts = Instant::now();
        reducer.begin_step();
        let mut loss_sum = 0.0f64;
        for m in 0..micro_batches {
            let (x, y) =
                data.train_batch(step, cfg.train.global_batch, first + m * micro, micro, seq);
            let x = Tensor::<B, 2, Int>::from_data(TensorData::new(x, [micro, seq]), device);
            let y = Tensor::<B, 2, Int>::from_data(TensorData::new(y, [micro, seq]), device);
            reducer.set_last_micro_batch(m + 1 == micro_batches);
            let loss = reducer.hooked(model.clone()).loss(x, y);
            loss_sum += f64::from(loss.clone().into_scalar().elem::<f32>());
            // The gradients travel through the reducer's hooks; Burn's copy is not needed.
            let _ = loss.backward();
        }
        let (mut grads, dp_stats) = reducer.finish::<B, _>(&model, micro_batches)?;
        let mut loss_value = loss_sum / micro_batches as f64;
        if dp > 1 {
            let mut l = [loss_value as f32];
            grid.dp.comm()?.all_reduce(&mut l, ReduceOp::Mean)?;
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
            .then(|| validation_loss::<B>(&model, data, cfg, grid, device))
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
    }
    if let Some(bar) = progress {
        bar.finish_and_clear();
    }
    Ok(Summary {
        steps: cfg.train.steps,
        final_loss,
        mean_tokens_per_s: tokens_per_step * cfg.train.steps as f64 / total_time.max(1e-9),
        wall_s: t0.elapsed().as_secs_f64(),
        skipped,
    })
}

/// Mean loss over `data.val_batches` global batches of held-out sequences, without gradients;
/// each DP rank evaluates its share and the means are averaged over the DP group.
fn validation_loss<B>(
    model: &Gpt<B>,
    data: &Source,
    cfg: &Config,
    grid: &ProcessGrid,
    device: &B::Device,
) -> Result<f64>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
{
    use burn::module::AutodiffModule;
    let model = model.valid();
    let seq = cfg.model.gpt.seq_len;
    let local = cfg.train.global_batch / grid.layout.dp;
    let micro = cfg.micro_batch();
    let mut sum = 0.0f64;
    let mut n = 0usize;
    for b in 0..cfg.data.val_batches {
        for m in 0..local / micro {
            let first = b * cfg.train.global_batch + grid.coords.dp * local + m * micro;
            let (x, y) = data.val_batch(first, micro, seq);
            let x = Tensor::<B::InnerBackend, 2, Int>::from_data(
                TensorData::new(x, [micro, seq]),
                device,
            );
            let y = Tensor::<B::InnerBackend, 2, Int>::from_data(
                TensorData::new(y, [micro, seq]),
                device,
            );
            sum += f64::from(model.loss(x, y).into_scalar().elem::<f32>());
            n += 1;
        }
    }
    let mut mean = [(sum / n.max(1) as f64) as f32];
    if grid.layout.dp > 1 {
        grid.dp.comm()?.all_reduce(&mut mean, ReduceOp::Mean)?;
    }
    Ok(f64::from(mean[0]))
}
