//! The run's parallel plan: the one given, or the planner's for the launched ranks from the
//! model's units timed on the backend that trains; and the units' costs the pipeline is cut by.

use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::{RunError, UnitModel, UnitsOf, sample_units};
use crate::batch::{Batch, Samples};
use crate::comm::{Communicator, Group};
use crate::parallel_plan::ParallelPlan;
use crate::parallelize::{EmbedUnit, HeadUnit, shard_module};
use crate::pipeline::{Evaluate, PipelineModel, Recompute};
use crate::planner::search::candidates;
use crate::planner::{
    CostModel, HardwareSpec, MeasuredModel, MeasuredUnit, ModelProxy, OptimizerCost, SearchError,
    SearchOptions, search, with_fixed_costs,
};
use crate::probe::mean_over_ranks;
use crate::tensor_parallel::ParallelBackend;
use crate::train::read_samples;
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
    /// The hardware to plan for: a preset name (`local-cpu`, `a100-80g`, `h100-80g`,
    /// `h200-141g`) or a hardware TOML file.
    pub hardware: String,
    /// Sequences per micro-batch the units are timed at.
    pub timed_micro_batch: usize,
    /// Where rank 0 writes every layout the search considered with its predicted step time
    /// and peak memory (JSON lines, fastest first), to set the planner beside measured steps:
    /// a new file (an existing one is refused, before training); `None`: nowhere.
    pub report: Option<std::path::PathBuf>,
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
            report: None,
        }
    }
}

/// What [`choose_plan`] decided: the plan, the cost of each unit (what the pipeline's stages
/// are balanced by) and the positions per sample of the hidden states between units.
pub(crate) struct Chosen {
    /// The plan.
    pub plan: ParallelPlan,
    /// Each unit's cost (uniform when nothing is cut).
    pub costs: Vec<f64>,
    /// The second dimension of the first unit's output, `[micro, positions, hidden]`.
    pub positions: usize,
}

/// The plan of the run and the cost of each of the model's units. The first unit, one block
/// and the last unit are always run once on a sample micro-batch, checking the shapes between
/// them ([`Sample::check`]); they are timed only when a plan is searched or a pipeline is cut
/// (once when the plan's micro-batch is the one timed).
pub(crate) fn choose_plan<B, M>(
    model: &M,
    choice: &PlanChoice,
    settings: &TrainSettings,
    data: &dyn BatchSource,
    world: Option<&dyn Communicator>,
    device: &B::Device,
) -> Result<Chosen, RunError>
where
    B: AutodiffBackend + ParallelBackend,
    M: UnitModel<B>,
{
    let dims = model.dims();
    let ranks = world.map_or(1, |w| w.size());
    let first_micro = match choice {
        PlanChoice::Given(plan) => (plan.dp, plan.micro_batch),
        PlanChoice::Auto(auto) => (1, auto.timed_micro_batch),
    };
    check_batch(settings, first_micro.0, first_micro.1)?;
    let sample = Sample::new(model, settings, data, first_micro.1, device)?;
    let positions = sample.positions;
    let uniform = vec![1.0; dims.layers + 2];
    let chosen = |plan, costs| Chosen {
        plan,
        costs,
        positions,
    };
    let (plan, timed) = match choice {
        PlanChoice::Given(plan) if plan.pp == 1 => return Ok(chosen(plan.clone(), uniform)),
        PlanChoice::Given(plan) => (plan.clone(), None),
        PlanChoice::Auto(auto) => {
            let b = auto.timed_micro_batch;
            // Timed at a second size too: what does not grow with the micro-batch.
            let small_b = if b > 1 { 1 } else { 2 };
            let small =
                Sample::new(model, settings, data, small_b, device)?.timed(world, dims.layers)?;
            let timed = with_fixed_costs(sample.timed(world, dims.layers)?, b, &small, small_b);
            let hardware = HardwareSpec::load(&auto.hardware)?.with_devices(ranks);
            let proxy = MeasuredModel::new(dims.shape(positions), b, timed.clone(), &hardware)?
                .with_tp_divisible(dims.tp_divisible());
            let rank = world.map_or(0, |w| w.rank());
            let plan = searched(
                auto,
                &proxy,
                (&hardware, settings.optimizer.cost()),
                (ranks, settings.global_batch),
                rank,
            )?;
            (plan, Some((b, timed)))
        }
    };
    if plan.pp == 1 {
        // One stage: nothing to cut (the units were checked when they were timed).
        return Ok(chosen(plan, uniform));
    }
    let timed = match timed {
        // Timed at the planned micro-batch already.
        Some((micro, timed)) if micro == plan.micro_batch => timed,
        Some(_) => Sample::new(model, settings, data, plan.micro_batch, device)?
            .timed(world, dims.layers)?,
        None => sample.timed(world, dims.layers)?,
    };
    let costs = timed.iter().map(|u| u.forward_s + u.backward_s).collect();
    Ok(chosen(plan, costs))
}

/// Refuses a global batch of `settings` that `dp` ranks do not split into micro-batches of
/// `micro` sequences.
pub(crate) fn check_batch(
    settings: &TrainSettings,
    dp: usize,
    micro: usize,
) -> Result<(), RunError> {
    match micro > 0 && settings.global_batch.is_multiple_of(dp.max(1) * micro) {
        true => Ok(()),
        false => Err(RunError::Train(TrainError::Batch {
            global_batch: settings.global_batch,
            dp,
            micro_batch: micro,
        })),
    }
}

/// The planner's plan for `ranks` ranks training `measured` on `global_batch` sequences a
/// step on `hardware` with `optimizer` (rank 0 writes `auto.report`).
fn searched(
    auto: &AutoPlan,
    measured: &MeasuredModel,
    (hardware, optimizer): (&HardwareSpec, OptimizerCost),
    (ranks, global_batch): (usize, usize),
    rank: usize,
) -> Result<ParallelPlan, RunError> {
    let options = SearchOptions {
        recompute: vec![Recompute::None],
        tp_overlap: vec![1],
        optimizer,
        ..SearchOptions::new(ranks, global_batch)
    };
    let proxy = ModelProxy::from_costs(measured);
    let best = search(&proxy, hardware, &options)?.best;
    if let Some(path) = auto.report.as_ref().filter(|_| rank == 0) {
        write_report(path, &proxy, hardware, &options)?;
    }
    Ok(ParallelPlan::from_planned(&best.layout))
}

/// Writes to `path` every layout the search of `proxy` on `hardware` under `options`
/// considers, with its predicted step and peak memory, one JSON object a line, fastest first.
fn write_report(
    path: &std::path::Path,
    proxy: &ModelProxy,
    hardware: &HardwareSpec,
    options: &SearchOptions,
) -> Result<(), RunError> {
    let cm = CostModel::new(proxy, hardware).with_optimizer(options.optimizer);
    let mut lines: Vec<(f64, String)> = Vec::new();
    for c in candidates(&cm, options, hardware.memory_bytes)? {
        let p = cm.predict(&c.layout).map_err(SearchError::from)?;
        let line = serde_json::json!({
            "dp": c.layout.dp,
            "tp": c.layout.tp,
            "pp": c.layout.pp,
            "virtual_stages": c.layout.virtual_stages,
            "micro_batch": c.layout.micro_batch,
            "schedule": c.layout.schedule.as_str(),
            "zero": c.layout.zero,
            "reduce_scatter": c.layout.reduce_scatter.to_string(),
            "stages": c.layout.partition.sizes(),
            "step_s": p.step_time_s,
            "memory_bytes": p.max_memory_bytes(),
        });
        lines.push((p.step_time_s, line.to_string()));
    }
    lines.sort_by(|a, b| a.0.total_cmp(&b.0));
    let text: String = lines.into_iter().map(|(_, l)| l + "\n").collect();
    // A new file only: an existing one is refused, not overwritten.
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(TrainError::io(path))?;
    std::io::Write::write_all(&mut file, text.as_bytes()).map_err(TrainError::io(path))?;
    Ok(())
}

/// The first unit, block 0 and the last unit of a model (at tp = 1) with a micro-batch of
/// the data's first samples.
struct Sample<B: AutodiffBackend + ParallelBackend, M: UnitModel<B>> {
    units: UnitsOf<B, M>,
    samples: Samples,
    device: B::Device,
    hidden: usize,
    tied: bool,
    /// Positions per sample between units, found by [`check`](Self::check).
    positions: usize,
}

impl<B: AutodiffBackend + ParallelBackend, M: UnitModel<B>> Sample<B, M> {
    /// Builds the sample units of `model` and reads `micro` samples of `data`, then checks
    /// them ([`check`](Self::check)).
    fn new(
        model: &M,
        settings: &TrainSettings,
        data: &dyn BatchSource,
        micro: usize,
        device: &B::Device,
    ) -> Result<Self, RunError> {
        let samples = read_samples(micro, 1, || data.train_samples(0, 0, micro))?;
        let units = sample_units(model, settings.seed, device)?;
        let units = shard_module(units, &model.tp_plan(), Group::local())?;
        let samples = (units.prepare_samples(samples)).map_err(|e| TrainError::Data {
            step: 1,
            source: Box::new(e),
        })?;
        let mut sample = Sample {
            units,
            samples,
            device: device.clone(),
            hidden: model.dims().hidden,
            tied: model.tie_embeddings(),
            positions: 0,
        };
        sample.positions = sample.check()?;
        Ok(sample)
    }

    /// Runs the units once, checking that the first unit returns `[micro_batch, positions,
    /// hidden]` and the block the same shape, that a tied head's table is `[_, hidden]`, and
    /// that the last unit returns one loss: a model whose units do not fit together (or
    /// panic, for example asking for a field the samples do not have) is refused here, naming
    /// the unit and the shapes, before anything trains. Returns the positions.
    fn check(&self) -> Result<usize, RunError> {
        let batch = Batch::new(&self.samples, &self.device);
        let micro = self.samples.count;
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
        let between = "the units pass [micro_batch, positions, ModelDims::hidden]";
        let x = caught("the first unit", || self.units.embed(&batch))?;
        let positions = x.dims()[1];
        let want = vec![micro, positions, self.hidden];
        fits("the first unit", x.dims().to_vec(), &want, between)?;
        let x = caught("block 0", || self.units.layer(0, x, &batch))?;
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
        self.check_metrics(x.clone(), &batch)?;
        let loss = caught("the last unit", || self.units.head_loss_sum(x, &batch))?;
        if loss.terms() != batch.loss_terms() {
            return Err(RunError::LossTerms {
                counted: loss.terms(),
                expected: batch.loss_terms(),
            });
        }
        let names = <M::Head as HeadUnit<B>>::LOSS_PARTS;
        if loss.parts() != names.len() {
            return Err(RunError::LossParts {
                counted: loss.parts(),
                names: names.to_vec(),
            });
        }
        fits(
            "the last unit",
            loss.into_sum().dims().to_vec(),
            &vec![1],
            "a loss is one number",
        )?;
        Ok(positions)
    }

    /// Refuses a head whose metrics on the sample micro-batch (hidden states `x`) are not one
    /// sum per name it declares ([`HeadUnit::METRICS`]).
    fn check_metrics(&self, x: Tensor<B, 3>, batch: &Batch<'_, B>) -> Result<(), RunError> {
        let names = <M::Head as HeadUnit<B>>::METRICS;
        let metrics = caught("the last unit's metrics", || {
            self.units.head_eval(x, batch, Evaluate::Metrics)
        })?;
        match metrics.map(|m| m.dims()[1]) {
            Some(counted) if counted != names.len() => Err(RunError::MetricNames {
                names: names.iter().map(|n| n.to_string()).collect(),
                counted,
            }),
            _ => Ok(()),
        }
    }

    /// Every unit measured (averaged over the ranks of `world`): the first unit, `layers`
    /// copies of block 0's measurement (every block costs the same) and the last unit.
    fn timed(
        &self,
        world: Option<&dyn Communicator>,
        layers: usize,
    ) -> Result<Vec<MeasuredUnit>, RunError> {
        let batch = Batch::new(&self.samples, &self.device);
        let measured = (self.units).measure(&batch, 3);
        let mut times: Vec<f64> = (measured.iter())
            .flat_map(|u| [u.forward_s, u.backward_s])
            .collect();
        mean_over_ranks(world, &mut times)?;
        let agreed: Vec<MeasuredUnit> = (measured.into_iter().zip(times.chunks(2)))
            .map(|(u, t)| MeasuredUnit {
                forward_s: t[0],
                backward_s: t[1],
                ..u
            })
            .collect();
        let mut units = vec![agreed[0].clone()];
        units.extend(std::iter::repeat_n(agreed[1].clone(), layers));
        units.push(agreed[2].clone());
        Ok(units)
    }
}

/// `run()`, with a panic inside it (a user's unit asking for a missing field, or Burn refusing
/// a shape) turned into [`RunError::UnitPanic`] naming `unit`.
fn caught<T>(unit: &str, run: impl FnOnce() -> T) -> Result<T, RunError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).map_err(|payload| {
        let message = (payload.downcast_ref::<String>().cloned())
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        RunError::UnitPanic {
            unit: unit.into(),
            message,
        }
    })
}
