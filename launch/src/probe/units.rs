//! Timing the GPT's units (embedding, a layer, the head) and the optimizer for `merak
//! profile`.

use anyhow::{Result, bail};
use burn::module::{AutodiffModule, Module};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Distribution, Tensor};
use merak_burn::batch::{Batch, Samples};
use merak_burn::comm::{Communicator, MpiCommunicator};
use merak_burn::pipeline::{PipelineModel, StageInput, StageOutput};
use merak_burn::probe::from_rank0;
use merak_burn::train::Windows;
use std::time::Instant;

use super::*;

/// `b` sequences of deterministic token ids for the profiled model, inputs and targets.
pub(super) fn token_batch(cfg: &merak_gpt::GptConfig, b: usize) -> Samples {
    let s = cfg.seq_len;
    let ids: Vec<i64> = (0..b * s)
        .map(|i| (i * 7919 % cfg.vocab_size) as i64)
        .collect();
    let windows = Windows {
        inputs: ids.clone(),
        targets: ids,
    };
    windows
        .into_samples(b)
        .expect("b windows of seq_len tokens")
}

/// One forward and backward pass of the whole model on `b` sequences.
pub(super) fn whole_pass(
    model: &merak_gpt::Gpt<B>,
    cfg: &merak_gpt::GptConfig,
    b: usize,
) -> Result<()> {
    let units = 0..cfg.layers + 2;
    let samples = token_batch(cfg, b);
    let batch = Batch::new(&samples, &Default::default());
    let StageOutput::Loss(loss) = model.run_units(units, StageInput::Data, &batch) else {
        bail!("the model returned hidden states");
    };
    std::hint::black_box(loss.backward());
    Ok(())
}

/// Times the forward and backward passes of the embedding, the first layer and the head at
/// micro-batch `b`, back to back as in a training step (ranks align once per repetition), and
/// the whole model's forward and backward pass; `reps` times after a warm-up. The fastest unit
/// times (averaged over ranks) are scaled so that embedding + `L` layers + head add up to the
/// fastest whole pass.
pub(super) fn time_units(
    model: &merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    b: usize,
    reps: usize,
) -> Result<[(f64, f64); 3]> {
    let device = Default::default();
    let (s, h, l) = (cfg.seq_len, cfg.hidden, cfg.layers);
    let samples = token_batch(cfg, b);
    let batch = Batch::new(&samples, &device);
    let grad = Tensor::<B, 3>::random([b, s, h], Distribution::Default, &device);
    let mut samples = vec![Vec::new(); 7];
    for rep in 0..reps + 1 {
        let mut t = [0.0; 6];
        barrier(world)?;
        let start = Instant::now();
        let StageOutput::Hidden(h0) = model.run_units(0..1, StageInput::Data, &batch) else {
            bail!("the embedding returned a loss");
        };
        let h0c = h0.clone().into_data();
        t[0] = start.elapsed().as_secs_f64();
        let x = Tensor::<B, 3>::from_data(h0c, &device).require_grad();
        let start = Instant::now();
        let StageOutput::Hidden(h1) = model.run_units(1..2, StageInput::Hidden(x), &batch) else {
            bail!("a layer returned a loss");
        };
        let h1c = h1.clone().into_data();
        t[1] = start.elapsed().as_secs_f64();
        let y = Tensor::<B, 3>::from_data(h1c, &device).require_grad();
        let start = Instant::now();
        let StageOutput::Loss(loss) = model.run_units(l + 1..l + 2, StageInput::Hidden(y), &batch)
        else {
            bail!("the head returned hidden states");
        };
        let _ = loss.clone().into_data();
        t[2] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box(loss.backward());
        t[5] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box((h1 * grad.clone()).sum().backward());
        t[4] = start.elapsed().as_secs_f64();
        let start = Instant::now();
        std::hint::black_box((h0 * grad.clone()).sum().backward());
        t[3] = start.elapsed().as_secs_f64();
        barrier(world)?;
        let start = Instant::now();
        whole_pass(model, cfg, b)?;
        let whole = start.elapsed().as_secs_f64();
        if rep > 0 {
            for (v, x) in samples.iter_mut().zip(t) {
                v.push(x);
            }
            samples[6].push(whole);
        }
    }
    let mut m: Vec<f64> = samples.into_iter().map(fastest).collect();
    mean_over_ranks(world, &mut m)?;
    // The isolated passes give the split between units; the level comes from the whole
    // model's forward and backward pass, as a training step runs it.
    let sum = m[0] + m[3] + l as f64 * (m[1] + m[4]) + m[2] + m[5];
    let scale = if sum > 0.0 { m[6] / sum } else { 1.0 };
    let m: Vec<f64> = m.iter().map(|x| x * scale).collect();
    Ok([(m[0], m[3]), (m[1], m[4]), (m[2], m[5])])
}

/// The whole model's forward and backward pass (micro-batch `b`) on the even ranks while the
/// odd ranks wait in a receive, as pipeline ranks wait in their bubbles, against all ranks
/// working: the time fraction a rank needs when its peers wait (1 for one rank). Run with
/// tp = 1 (a waiting rank would stall a tensor-parallel group).
pub(super) fn alone_fraction(
    model: &merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    b: usize,
    reps: usize,
) -> Result<f64> {
    let Some(w) = world.filter(|w| w.size() > 1) else {
        return Ok(1.0);
    };
    let (rank, ranks) = (w.rank(), w.size());
    let pass = || whole_pass(model, cfg, b);
    let (mut all, mut half) = (Vec::new(), Vec::new());
    for rep in 0..reps + 1 {
        w.barrier()?;
        let start = Instant::now();
        pass()?;
        let together = start.elapsed().as_secs_f64();
        w.barrier()?;
        let start = Instant::now();
        if rank % 2 == 0 {
            pass()?;
            half.push(start.elapsed().as_secs_f64());
            if rank + 1 < ranks {
                w.send(&[0.0], rank + 1, 11)?;
            }
        } else {
            w.recv(&mut [0.0], rank - 1, 11)?;
        }
        if rep > 0 {
            all.push(together);
        }
    }
    let mut times = [
        fastest(all),
        if half.len() > 1 {
            fastest(half[1..].to_vec())
        } else {
            0.0
        },
    ];
    from_rank0(world, &mut times)?;
    Ok((times[1] / times[0]).clamp(0.0, 1.0))
}

/// Seconds of one AdamW step per parameter of `model` (fastest of `reps`).
pub(super) fn time_optimizer(
    model: merak_gpt::Gpt<B>,
    world: Option<&MpiCommunicator>,
    cfg: &merak_gpt::GptConfig,
    reps: usize,
) -> Result<f64> {
    let samples = token_batch(cfg, 1);
    let batch = Batch::new(&samples, &Default::default());
    let params = model.num_params() as f64;
    let mut optim = AdamWConfig::new().init();
    let mut model = model;
    let mut times = Vec::new();
    for rep in 0..reps + 1 {
        let StageOutput::Loss(loss) = model.run_units(0..cfg.layers + 2, StageInput::Data, &batch)
        else {
            bail!("the model returned hidden states");
        };
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        barrier(world)?;
        let start = Instant::now();
        model = optim.step(1e-4, model, grads);
        let _ = model.valid();
        if rep > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    let mut m = [fastest(times) / params];
    mean_over_ranks(world, &mut m)?;
    Ok(m[0])
}
