//! The run's parallel plan: the one given, or the planner's for the launched ranks from the
//! model's units timed on the backend that trains; and the units' costs the pipeline is cut by.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use super::{RunError, UnitModel, UnitsOf, sample_units};
use crate::comm::{Communicator, Group, ReduceOp};
use crate::parallelize::EmbedUnit;
use crate::parallelize::shard_module;
use crate::pipeline::Recompute;
use crate::pipeline::UnitStack;
use crate::plan::ParallelPlan;
use crate::planner::{
    HardwareSpec, MeasuredModel, MeasuredUnit, ModelProxy, SearchOptions, search,
};
use crate::train::{BatchSource, TrainError, TrainSettings};

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
/// are balanced by). The first unit, one block and the last unit are always run once on a
/// sample micro-batch, checking the shapes between them ([`Sample::check`]); they are timed
/// only when a plan is searched or a pipeline is cut (once when the plan's micro-batch is the
/// one timed).
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
    let splits = |dp: usize, micro: usize| match micro > 0
        && settings.global_batch.is_multiple_of(dp.max(1) * micro)
    {
        true => Ok(()),
        false => Err(RunError::Train(TrainError::Batch {
            global_batch: settings.global_batch,
            dp,
            micro_batch: micro,
        })),
    };
    match choice {
        PlanChoice::Given(plan) => splits(plan.dp, plan.micro_batch)?,
        PlanChoice::Auto(auto) => splits(1, auto.timed_micro_batch)?,
    }
    let uniform = vec![1.0; dims.layers + 2];
    let (plan, timed) = match choice {
        PlanChoice::Given(plan) if plan.pp == 1 => {
            Sample::new(model, settings, data, plan.micro_batch, device)?;
            return Ok((plan.clone(), uniform));
        }
        PlanChoice::Given(plan) => (plan.clone(), None),
        PlanChoice::Auto(auto) => {
            let sample = Sample::new(model, settings, data, auto.timed_micro_batch, device)?;
            let timed = sample.timed(world, dims.layers)?;
            let hardware = HardwareSpec::load(&auto.hardware)?.with_devices(ranks);
            let shape = dims.shape(settings.seq_len);
            let proxy =
                MeasuredModel::new(shape, auto.timed_micro_batch, timed.clone(), &hardware)?;
            let options = SearchOptions {
                recompute: vec![Recompute::None],
                tp_overlap: vec![1],
                ..SearchOptions::new(ranks, settings.global_batch)
            };
            let best = search(&ModelProxy::from_costs(&proxy), &hardware, &options)?.best;
            let plan = ParallelPlan::from_planned(&best.layout);
            (plan, Some((auto.timed_micro_batch, timed)))
        }
    };
    if plan.pp == 1 {
        // One stage: nothing to cut (the units were checked when they were timed).
        return Ok((plan, uniform));
    }
    let timed = match timed {
        // Timed at the planned micro-batch already.
        Some((micro, timed)) if micro == plan.micro_batch => timed,
        _ => Sample::new(model, settings, data, plan.micro_batch, device)?
            .timed(world, dims.layers)?,
    };
    Ok((
        plan,
        timed.iter().map(|u| u.forward_s + u.backward_s).collect(),
    ))
}

/// The first unit, block 0 and the last unit of a model (at tp = 1) with a micro-batch of
/// the data's first samples.
struct Sample<B: AutodiffBackend, M: UnitModel<B>> {
    units: UnitsOf<B, M>,
    inputs: Tensor<B, 2, Int>,
    targets: Tensor<B, 2, Int>,
    hidden: usize,
    tied: bool,
}

impl<B: AutodiffBackend, M: UnitModel<B>> Sample<B, M> {
    /// Builds the sample units of `model` and reads `micro` samples of `data`, then checks
    /// them ([`check`](Self::check)).
    fn new(
        model: &M,
        settings: &TrainSettings,
        data: &dyn BatchSource,
        micro: usize,
        device: &B::Device,
    ) -> Result<Self, RunError> {
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
        let ids = |v: Vec<i64>| Tensor::from_data(TensorData::new(v, [micro, seq]), device);
        let units = sample_units(model, settings.seed, device)?;
        let sample = Sample {
            units: shard_module(units, &model.tp_plan(), Group::local())?,
            inputs: ids(w.inputs),
            targets: ids(w.targets),
            hidden: model.dims().hidden,
            tied: model.tie_embeddings(),
        };
        sample.check()?;
        Ok(sample)
    }

    /// Runs the units once, checking that the first unit and the block return
    /// `[micro_batch, seq_len, hidden]`, that a tied head's table is `[_, hidden]`, and that
    /// the last unit returns one loss: a model whose units do not fit together is refused
    /// here, naming the unit and the shapes, before anything trains.
    fn check(&self) -> Result<(), RunError> {
        let [micro, seq] = self.inputs.dims();
        let want = vec![micro, seq, self.hidden];
        let fits =
            |unit: &str, got: Vec<usize>, want: &Vec<usize>, expected: &'static str| match got
                == *want
            {
                true => Ok(()),
                false => Err(RunError::UnitShape {
                    unit: unit.into(),
                    got,
                    want: want.clone(),
                    expected,
                }),
            };
        let between = "the units pass [micro_batch, seq_len, ModelDims::hidden]";
        let x = self.units.embed(self.inputs.clone());
        fits("the first unit", x.dims().to_vec(), &want, between)?;
        let x = self.units.layer(0, x);
        fits("block 0", x.dims().to_vec(), &want, between)?;
        let table = (self.units.embed.as_ref()).and_then(|e| e.table());
        if let (true, Some((table, name))) = (self.tied, table) {
            let dims = table.val().dims().to_vec();
            let want = vec![dims[0], self.hidden];
            fits(
                name,
                dims,
                &want,
                "a tied head's table is [vocab, ModelDims::hidden]",
            )?;
        }
        let loss = self.units.head_loss(x, self.targets.clone());
        fits(
            "the last unit",
            loss.dims().to_vec(),
            &vec![1],
            "a loss is one number",
        )
    }

    /// Every unit measured (averaged over the ranks of `world`): the first unit, `layers`
    /// copies of block 0's measurement (every block costs the same) and the last unit.
    fn timed(
        &self,
        world: Option<&dyn Communicator>,
        layers: usize,
    ) -> Result<Vec<MeasuredUnit>, RunError> {
        let measured = (self.units).measure(self.inputs.clone(), self.targets.clone(), 3);
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
        let mut units = vec![agreed[0].clone()];
        units.extend(std::iter::repeat_n(agreed[1].clone(), layers));
        units.push(agreed[2].clone());
        Ok(units)
    }
}
