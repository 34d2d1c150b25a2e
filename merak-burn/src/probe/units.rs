//! Timing a model's units on the backend that trains, with every rank working at once: the
//! embedding, one block and the head (forward and backward), the whole model's pass, the time
//! a rank needs when its peers wait, and the optimizer step. `merak profile` turns these into
//! the planner's calibration; they work on any [`PipelineModel`] (a GPT, or a Burn user's
//! model described unit by unit).

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor};

use super::{ProbeError, barrier, fastest, from_rank0, mean_over_ranks};
use crate::batch::{Batch, Samples};
use crate::comm::Communicator;
use crate::pipeline::{PipelineModel, StageInput, StageOutput};

type Result<T> = std::result::Result<T, ProbeError>;

/// Seconds of one forward and one backward pass of a unit.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassTimes {
    /// Seconds of the forward pass.
    pub forward_s: f64,
    /// Seconds of the backward pass.
    pub backward_s: f64,
}

/// The passes of the embedding (unit 0), one block (unit 1) and the head (the last unit).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UnitPasses {
    /// The embedding's passes.
    pub embedding: PassTimes,
    /// One block's passes (every block costs the same).
    pub layer: PassTimes,
    /// The head's passes, its loss included.
    pub head: PassTimes,
}

fn hidden_of<B: AutodiffBackend>(out: StageOutput<B>, unit: &'static str) -> Result<Tensor<B, 3>> {
    match out {
        StageOutput::Hidden(h) => Ok(h),
        StageOutput::Loss(_) => Err(ProbeError::UnitOutput {
            unit,
            expected: "hidden states",
        }),
    }
}

fn loss_of<B: AutodiffBackend>(out: StageOutput<B>, unit: &'static str) -> Result<Tensor<B, 1>> {
    match out {
        StageOutput::Loss(l) => Ok(crate::pipeline::stage::differentiated(l)),
        StageOutput::Hidden(_) => Err(ProbeError::UnitOutput {
            unit,
            expected: "a loss",
        }),
    }
}

/// One forward and backward pass of the whole `model` on the micro-batch `samples`.
pub fn whole_pass<B, M>(model: &M, samples: &Samples, device: &B::Device) -> Result<()>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
{
    let batch = Batch::new(samples, device);
    let out = model.run_units(0..model.units(), StageInput::Data, &batch);
    std::hint::black_box(loss_of(out, "the model")?.backward());
    Ok(())
}

/// Times the forward and backward passes of the embedding, the first block and the head on
/// the micro-batch `samples`, back to back as in a training step (the ranks of `world` align
/// once per repetition), and the whole model's pass; `reps` times after a warm-up. The fastest
/// unit times, averaged over the ranks, are scaled so that embedding + `L` blocks + head add up
/// to the fastest whole pass: the isolated passes give the split between units, the whole pass
/// the level a training step runs at.
pub fn time_units<B, M, C>(
    model: &M,
    samples: &Samples,
    device: &B::Device,
    world: Option<&C>,
    reps: usize,
) -> Result<UnitPasses>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
    C: Communicator + ?Sized,
{
    let (units, batch) = (model.units(), Batch::new(samples, device));
    let mut runs = vec![Vec::new(); 7];
    for rep in 0..reps.max(1) + 1 {
        barrier(world)?;
        let t = time_isolated(model, &batch, device)?;
        barrier(world)?;
        let start = Instant::now();
        whole_pass(model, samples, device)?;
        if rep > 0 {
            for (v, x) in runs
                .iter_mut()
                .zip(t.into_iter().chain([start.elapsed().as_secs_f64()]))
            {
                v.push(x);
            }
        }
    }
    let mut m: Vec<f64> = runs.into_iter().map(fastest).collect();
    mean_over_ranks(world, &mut m)?;
    let blocks = units.saturating_sub(2) as f64;
    let sum = m[0] + m[3] + blocks * (m[1] + m[4]) + m[2] + m[5];
    let scale = if sum > 0.0 { m[6] / sum } else { 1.0 };
    let pass = |f: usize, b: usize| PassTimes {
        forward_s: m[f] * scale,
        backward_s: m[b] * scale,
    };
    Ok(UnitPasses {
        embedding: pass(0, 3),
        layer: pass(1, 4),
        head: pass(2, 5),
    })
}

/// One repetition of [`time_units`]' isolated passes: forward times of the embedding, block 1
/// and the head, then the backward times of the three (in the order head, block, embedding,
/// as backward runs), as `[embed_f, layer_f, head_f, embed_b, layer_b, head_b]`.
fn time_isolated<B, M>(model: &M, batch: &Batch<'_, B>, device: &B::Device) -> Result<[f64; 6]>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
{
    let mut t = [0.0; 6];
    let last = model.units() - 1;
    let start = Instant::now();
    let h0 = hidden_of(
        model.run_units(0..1, StageInput::Data, batch),
        "the embedding",
    )?;
    let x = Tensor::<B, 3>::from_data(h0.clone().into_data(), device).require_grad();
    t[0] = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let h1 = hidden_of(
        model.run_units(1..2, StageInput::Hidden(x), batch),
        "a block",
    )?;
    let y = Tensor::<B, 3>::from_data(h1.clone().into_data(), device).require_grad();
    t[1] = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let input = StageInput::Hidden(y);
    let loss = loss_of(model.run_units(last..last + 1, input, batch), "the head")?;
    let _ = loss.clone().into_data();
    t[2] = start.elapsed().as_secs_f64();
    let start = Instant::now();
    std::hint::black_box(loss.backward());
    t[5] = start.elapsed().as_secs_f64();
    let grad = Tensor::<B, 3>::random(h1.dims(), Distribution::Default, device);
    let start = Instant::now();
    std::hint::black_box((h1 * grad.clone()).sum().backward());
    t[4] = start.elapsed().as_secs_f64();
    let start = Instant::now();
    std::hint::black_box((h0 * grad).sum().backward());
    t[3] = start.elapsed().as_secs_f64();
    Ok(t)
}

/// The whole model's pass on the micro-batch `samples` on the even ranks while the odd ranks
/// wait in a receive, as pipeline ranks wait in their bubbles, against all ranks working: the
/// time fraction a rank needs when its peers wait (1 for one rank). Run it without tensor
/// parallelism: a waiting rank would stall a tensor-parallel group.
pub fn alone_fraction<B, M, C>(
    model: &M,
    samples: &Samples,
    device: &B::Device,
    world: Option<&C>,
    reps: usize,
) -> Result<f64>
where
    B: AutodiffBackend,
    M: PipelineModel<B>,
    C: Communicator + ?Sized,
{
    let Some(w) = world.filter(|w| w.size() > 1) else {
        return Ok(1.0);
    };
    let (rank, ranks) = (w.rank(), w.size());
    let pass = || whole_pass(model, samples, device);
    let (mut all, mut half) = (Vec::new(), Vec::new());
    for rep in 0..reps.max(1) + 1 {
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
    let alone = if half.len() > 1 {
        fastest(half[1..].to_vec())
    } else {
        0.0
    };
    let mut times = [fastest(all), alone];
    from_rank0(world, &mut times)?;
    Ok((times[1] / times[0]).clamp(0.0, 1.0))
}

/// Seconds of one AdamW step per parameter of `model` (the fastest of `reps`, averaged over
/// the ranks of `world`), the gradients those of the micro-batch `samples`.
pub fn time_optimizer<B, M, C>(
    model: M,
    samples: &Samples,
    device: &B::Device,
    world: Option<&C>,
    reps: usize,
) -> Result<f64>
where
    B: AutodiffBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
    C: Communicator + ?Sized,
{
    let batch = Batch::new(samples, device);
    let params = model.num_params().max(1) as f64;
    let mut optim = AdamWConfig::new().init();
    let mut model = model;
    let mut times = Vec::new();
    for rep in 0..reps.max(1) + 1 {
        let out = model.run_units(0..model.units(), StageInput::Data, &batch);
        let grads = GradientsParams::from_grads(loss_of(out, "the model")?.backward(), &model);
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
