//! The training loop behind `merak train`.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::comm::{ReduceOp, TensorComm};
use merak_burn::grid::ProcessGrid;
use merak_burn::tensor_parallel::ParallelBackend;
use merak_burn::train::{
    LrSchedule, MetricsWriter, StepMetrics, clip_grads, global_grad_norm, sharded_param_ids,
};
use merak_gpt::Gpt;

use crate::config::Config;
use crate::data::SyntheticData;

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
}

/// Trains the GPT of `cfg` on this rank's part of the grid; rank 0 writes `out/metrics.jsonl`.
pub fn train<B>(cfg: &Config, grid: &ProcessGrid, out: &Path, device: &B::Device) -> Result<Summary>
where
    B: AutodiffBackend + ParallelBackend,
    B::InnerBackend: ParallelBackend,
{
    let t0 = Instant::now();
    let gpt = &cfg.model.gpt;
    let seed = cfg.train.seed;
    let mut model: Gpt<B> = Gpt::new(gpt, seed, grid.tp, device).context("building the model")?;
    let sharded = sharded_param_ids::<B, _>(&model);
    let mut optim = AdamWConfig::new()
        .with_beta_1(cfg.train.beta1 as f32)
        .with_beta_2(cfg.train.beta2 as f32)
        .with_epsilon(cfg.train.eps as f32)
        .with_weight_decay(cfg.train.weight_decay as f32)
        .init::<B, Gpt<B>>();
    let schedule = LrSchedule {
        peak: cfg.train.lr,
        min: cfg.train.min_lr,
        warmup: cfg.train.warmup_steps,
        total: cfg.train.steps,
    };
    let data = SyntheticData::new(seed, gpt.vocab_size);
    let dp = grid.layout.dp;
    let local_batch = cfg.train.global_batch / dp;
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

    let mut final_loss = f64::NAN;
    let mut total_time = 0.0;
    for step in 0..cfg.train.steps {
        let ts = Instant::now();
        let (x, y) = data.batch(step, first, local_batch, seq);
        let x = Tensor::<B, 2, Int>::from_data(TensorData::new(x, [local_batch, seq]), device);
        let y = Tensor::<B, 2, Int>::from_data(TensorData::new(y, [local_batch, seq]), device);
        let loss = model.loss(x, y);
        let mut loss_value = f64::from(loss.clone().into_scalar().elem::<f32>());
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        if dp > 1 {
            grads = average_over_dp::<B>(&model, grads, grid)?;
            let comm = grid.dp.comm()?;
            let mut l = [loss_value as f32];
            comm.all_reduce(&mut l, ReduceOp::Mean)?;
            loss_value = f64::from(l[0]);
        }
        if !loss_value.is_finite() {
            anyhow::bail!("loss is {loss_value} at step {}", step + 1);
        }
        let grad_norm = global_grad_norm::<B, _>(&model, &grads, &sharded, grid.tp)?;
        clip_grads::<B, _>(&model, &mut grads, grad_norm, cfg.train.grad_clip);
        let lr = schedule.at(step);
        model = optim.step(lr, model, grads);
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
        };
        if let Some(w) = metrics.as_mut() {
            w.write(&m).context("writing metrics.jsonl")?;
            tracing::info!(
                "step {}/{} loss {:.5} lr {:.2e} grad_norm {:.4} tokens/s {:.0} step {:.3}s",
                m.step,
                cfg.train.steps,
                m.loss,
                m.lr,
                m.grad_norm,
                m.tokens_per_s,
                m.step_time_s
            );
        }
    }
    Ok(Summary {
        steps: cfg.train.steps,
        final_loss,
        mean_tokens_per_s: tokens_per_step * cfg.train.steps as f64 / total_time.max(1e-9),
        wall_s: t0.elapsed().as_secs_f64(),
    })
}

use burn::module::{ModuleVisitor, Param};
use burn::tensor::ElementConversion;

/// Averages every gradient over the data-parallel group (one all-reduce per parameter, after
/// the backward pass).
fn average_over_dp<B: AutodiffBackend>(
    model: &impl AutodiffModule<B>,
    grads: GradientsParams,
    grid: &ProcessGrid,
) -> Result<GradientsParams> {
    struct Avg<'a, B: AutodiffBackend> {
        grads: GradientsParams,
        comm: std::rc::Rc<dyn merak_burn::comm::Communicator>,
        err: Option<merak_burn::comm::CommError>,
        _b: std::marker::PhantomData<&'a B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Avg<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                match self.comm.all_reduce_tensor(g, ReduceOp::Mean) {
                    Ok(g) => self.grads.register(param.id, g),
                    Err(e) => self.err = Some(e),
                }
            }
        }
    }
    let mut v = Avg::<B> {
        grads,
        comm: grid.dp.comm()?,
        err: None,
        _b: std::marker::PhantomData,
    };
    model.visit(&mut v);
    match v.err {
        Some(e) => Err(e.into()),
        None => Ok(v.grads),
    }
}
