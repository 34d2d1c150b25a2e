//! The run's parallel plan: the one given, or the planner's for the launched ranks from the
//! model's units timed on the backend that trains; and the units' costs the pipeline is cut by.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use super::{RunError, UnitModel, sample_units};
use crate::comm::{Communicator, Group, ReduceOp};
use crate::parallelize::shard_module;
use crate::pipeline::Recompute;
use crate::plan::ParallelPlan;
use crate::planner::{
    HardwareSpec, MeasuredModel, MeasuredUnit, ModelProxy, SearchOptions, search,
};
use crate::train::{BatchSource, TrainSettings};

/// How [`merak_burn::run`](crate::run) chooses the parallel plan.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanChoice {
    /// This plan; its layout must have as many ranks as were launched.
    Given(ParallelPlan),
    /// The planner's fastest plan for the launched ranks ([`AutoPlan`]).
    Auto(AutoPlan),
}

impl Default for PlanChoice {
    /// The planner's choice on the local CPU.
    fn default() -> Self {
        PlanChoice::Auto(AutoPlan::default())
    }
}

/// The planner's plan for the launched ranks, on a proxy of the model whose units were timed
/// on the backend that trains (every rank times them; the times are averaged over the ranks,
/// so every rank plans the same). The search covers layouts, micro-batches, schedules, stage
/// cuts and ZeRO-1; recomputation and tensor-parallel overlap stay off (Burn's plain autodiff
/// and Burn's linear layers train a user's model).
#[derive(Clone, Debug, PartialEq)]
pub struct AutoPlan {
    /// The hardware to plan for: a preset name (`local-cpu`, `a100-80g`, `h100-80g`) or a
    /// hardware TOML file.
    pub hardware: String,
    /// Sequences per micro-batch the units are timed at.
    pub timed_micro_batch: usize,
}

impl AutoPlan {
    /// The planner's plan for the local CPU, the units timed at `micro_batch` sequences.
    pub fn timed_at(micro_batch: usize) -> Self {
        Self {
            timed_micro_batch: micro_batch,
            ..Self::default()
        }
    }
}

impl Default for AutoPlan {
    fn default() -> Self {
        Self {
            hardware: "local-cpu".into(),
            timed_micro_batch: 2,
        }
    }
}

/// The plan of the run and the cost of each of the model's units (what the pipeline's stages
/// are balanced by). Units are timed only when a plan is searched or a pipeline is cut.
pub(crate) fn choose_plan<B, M>(
    model: &M,
    choice: &PlanChoice,
    settings: &TrainSettings,
    data: &dyn BatchSource,
    world: Option<&dyn Communicator>,
    device: &B::Device,
) -> Result<(ParallelPlan, Vec<f64>), RunError>
where
    B: AutodiffBackend,
    M: UnitModel<B>,
{
    let dims = model.dims();
    let ranks = world.map_or(1, |w| w.size());
    let plan = match choice {
        PlanChoice::Given(plan) if plan.pp == 1 => {
            return Ok((plan.clone(), vec![1.0; dims.layers + 2]));
        }
        PlanChoice::Given(plan) => plan.clone(),
        PlanChoice::Auto(auto) => {
            let timed = timed_units(model, settings, auto.timed_micro_batch, data, world, device)?;
            let hardware = HardwareSpec::load(&auto.hardware)?.with_devices(ranks);
            let shape = dims.shape(settings.seq_len);
            let proxy = MeasuredModel::new(shape, auto.timed_micro_batch, timed, &hardware)?;
            let options = SearchOptions {
                recompute: vec![Recompute::None],
                tp_overlap: vec![1],
                ..SearchOptions::new(ranks, settings.global_batch)
            };
            let best = search(&ModelProxy::from_costs(&proxy), &hardware, &options)?.best;
            ParallelPlan::from_planned(&best.layout)
        }
    };
    let timed = timed_units(model, settings, plan.micro_batch, data, world, device)?;
    Ok((
        plan,
        timed.iter().map(|u| u.forward_s + u.backward_s).collect(),
    ))
}

/// Every unit of `model` measured at `micro` sequences (split as its TP plan declares, at
/// tp = 1), averaged over the ranks of `world`: the first unit, one block (every block costs
/// the same) and the last unit are built and timed.
fn timed_units<B, M>(
    model: &M,
    settings: &TrainSettings,
    micro: usize,
    data: &dyn BatchSource,
    world: Option<&dyn Communicator>,
    device: &B::Device,
) -> Result<Vec<MeasuredUnit>, RunError>
where
    B: AutodiffBackend,
    M: UnitModel<B>,
{
    let seq = settings.seq_len;
    let w = data.train_windows(0, 0, micro)?;
    if w.inputs.len() != micro * seq || w.targets.len() != micro * seq {
        return Err(RunError::Windows {
            sequences: micro,
            seq_len: seq,
            inputs: w.inputs.len(),
            targets: w.targets.len(),
        });
    }
    let ids =
        |v: Vec<i64>| Tensor::<B, 2, Int>::from_data(TensorData::new(v, [micro, seq]), device);
    let sample = shard_module(
        sample_units(model, settings.seed, device)?,
        &model.tp_plan(),
        Group::local(),
    )?;
    let measured = sample.measure(ids(w.inputs), ids(w.targets), 3);
    let mut times: Vec<f32> = (measured.iter())
        .flat_map(|u| [u.forward_s as f32, u.backward_s as f32])
        .collect();
    if let Some(world) = world {
        world.all_reduce(&mut times, ReduceOp::Sum)?;
    }
    let n = world.map_or(1, |w| w.size()) as f64;
    let agreed: Vec<MeasuredUnit> = (measured.into_iter().zip(times.chunks(2)))
        .map(|(u, t)| MeasuredUnit {
            forward_s: f64::from(t[0]) / n,
            backward_s: f64::from(t[1]) / n,
            ..u
        })
        .collect();
    let layers = model.dims().layers;
    let mut units = vec![agreed[0].clone()];
    units.extend(std::iter::repeat_n(agreed[1].clone(), layers));
    units.push(agreed[2].clone());
    Ok(units)
}
