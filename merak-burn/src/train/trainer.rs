//! The training step of a model cut over a process grid: micro-batches through the pipeline
//! executor, data-parallel gradient reduction, the tied embedding, the loss, clipping, the
//! optimizer's parameter groups and ZeRO. Every layout runs this one step.

use std::collections::HashSet;
use std::time::Instant;

use burn::optim::adaptor::OptimizerAdaptor;

use crate::batch::Samples;
use crate::checkpoint::{Checkpoint, FullState, state};
use crate::comm::{Group, ReduceOp};
use crate::data_parallel::{DpStats, emptied};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{Executor, MicroBatch, PipelinePlan, ScheduleKind, StepLosses, StepWork};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::tensor_parallel::Shard;
use crate::train::check_plan;
use crate::train::experts::{expert_ids, gather_routing};
use crate::train::optim::{Optimizers, muon_matrices};
use crate::train::sync::{self, GradNorm, GradSync, NormParts};
use crate::train::versions::WeightVersions;
use crate::train::{
    BatchSource, FusedAdamW, NormGroups, ParamGroup, ParamInfo, RoutingStats, StateBytes,
    TrainError, TrainSettings, sharded_param_ids,
};

/// A step's micro-batches, and the next step's when its first forwards run during this one.
type StepBatches = (Vec<MicroBatch>, Option<Vec<MicroBatch>>);

/// Burn's optimizer adaptor around [`FusedAdamW`] for the model `M`.
pub type AdamW<M, B> = OptimizerAdaptor<FusedAdamW, M, B>;

/// Seconds spent in each phase of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepPhases {
    /// Reading the data and counting its targets over the data-parallel group.
    pub data_s: f64,
    /// The schedule's forward and backward passes (pipeline messages included).
    pub forward_backward_s: f64,
    /// Finishing the data-parallel reduction, the tied gradients and the loss all-reduces.
    pub reduce_s: f64,
    /// The global gradient norm, clipping and the split into parameter groups.
    pub clip_s: f64,
    /// The optimizer steps (and ZeRO's all-gather of the new values).
    pub optimizer_s: f64,
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutcome {
    /// The 1-based number of the step.
    pub step: usize,
    /// Mean loss of the global batch (the same on every rank).
    pub loss: f64,
    /// The means of the loss's logged parts, one per name of
    /// [`PipelineModel::loss_parts`](crate::pipeline::PipelineModel::loss_parts) (for example
    /// each multi-token-prediction depth's loss); empty for a model without parts.
    pub loss_parts: Vec<f64>,
    /// The learning rate of the step.
    pub lr: f64,
    /// Global gradient norm before clipping; `None` when the step was skipped for a
    /// non-finite loss (the parameters are unchanged).
    pub grad_norm: Option<f64>,
    /// Under a mixture of experts: the routers' auxiliary losses of the step (not in
    /// [`loss`](Self::loss); see [`Trainer::routing`]).
    pub aux_loss: Option<f64>,
    /// The data-parallel reduction's overlap.
    pub dp: DpStats,
    /// The time of each phase.
    pub phases: StepPhases,
}

/// An asynchronous save whose writer may still be running, and the time the training thread
/// has spent on it so far (the host copy, the launch and the polls).
pub(crate) struct AsyncSave {
    pub(crate) pending: crate::checkpoint::PendingSave,
    pub(crate) stall: std::time::Duration,
}

/// Trains one rank's part of a model (its pipeline stages and tensor-parallel shard) with the
/// rest of the process grid. Every rank of the grid builds one with the same plan and settings
/// and calls [`step`](Self::step) (or [`fit`](Self::fit)) the same number of times.
pub struct Trainer<'g, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    pub(crate) grid: &'g ProcessGrid,
    /// How the batch is split and the optimizer state sharded.
    pub(crate) parallel: ParallelPlan,
    pub(crate) settings: TrainSettings,
    pub(crate) device: B::Device,
    pub(crate) model: M,
    /// PipeDream-2BW's previous weight version, on which the passes run, and the next step's
    /// forwards that ran ahead (`model` holds the current weights).
    pub(crate) versions: WeightVersions<B, M>,
    /// The optimizer of each parameter group (by default: matrices with weight decay,
    /// vectors without).
    pub(crate) optim: Optimizers<M, B>,
    /// What the data-parallel ranks do with the step's gradients (ZeRO's kinds among them).
    pub(crate) sync: Box<dyn GradSync<B, M> + 'g>,
    pub(crate) executor: Executor,
    /// Which gradients the norm adds where.
    pub(crate) norm: NormParts,
    /// The routing of the last step (under a mixture of experts).
    pub(crate) routing: Option<RoutingStats>,
    /// Steps done (the 0-based index of the next one).
    pub(crate) done: usize,
    /// The checkpoint this run resumed and the lineage it writes.
    pub(crate) lineage: super::claim::Lineage,
    /// An asynchronous save whose writer may still be running.
    pub(crate) saving: Option<AsyncSave>,
}

impl<'g, B, M> Trainer<'g, B, M>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    /// A trainer for `model` (this rank's units and shard, built for `grid` and `pipeline`,
    /// the pipeline plan of `parallel`) at step 0; `trace` records every action for a Chrome
    /// trace. Out-of-range settings and plans ([`check_plan`]) are refused before anything is
    /// built.
    /// The parameters are in the default groups (see
    /// [`with_param_groups`](Self::with_param_groups)).
    pub fn new(
        grid: &'g ProcessGrid,
        parallel: &ParallelPlan,
        pipeline: PipelinePlan,
        settings: TrainSettings,
        model: M,
        device: B::Device,
        trace: bool,
    ) -> Result<Self, TrainError> {
        check_plan(parallel, &pipeline, &settings, grid.layout.dp)?;
        check_context_parallel(grid.layout.cp, model.sequence_parts())?;
        let copies = model.tied_names();
        let shapes = state::param_shapes(&model);
        let experts = match model.experts() {
            Some(_) => expert_ids(&shapes),
            None => HashSet::new(),
        };
        if model.experts().is_some() {
            // The routing of passes run before training (the units timed to cut a pipeline)
            // is not the first step's.
            drop(crate::moe::take_records());
            crate::moe::take_exchange_seconds();
        }
        let matrices = muon_matrices(&model, (&shapes, grid.tp), &settings, |u| {
            pipeline.schedule.rank_of(pipeline.partition.stage_of(u)) == grid.coords.pp
        })?;
        let tp_copies = (grid.layout.tp, copies);
        let optim = Optimizers::new(&shapes, &settings, tp_copies, &matrices, &|p| p.default)?;
        let sync = sync::build(
            grid,
            parallel,
            &pipeline,
            &model,
            (&shapes[..], &experts),
            &device,
        )?;
        let holds_embedding = pipeline.schedule.rank_of(0) == grid.coords.pp;
        let tied = model.tied_embedding();
        let norm = NormParts {
            sharded: sharded_param_ids::<B, _>(&model),
            experts,
            not_counted: tied.filter(|_| !holds_embedding).into_iter().collect(),
            groups: NormGroups {
                tp: grid.tp,
                pp: grid.pp,
                ep: grid.ep,
            },
        };
        // Only sequence parallelism splits the sequences over the TP ranks.
        let tp_parts = model.sequence_parts() / grid.layout.cp.max(1);
        let two_versions = pipeline.schedule.kind == ScheduleKind::TwoBw;
        let executor = Executor::new(pipeline, grid.pp, grid.tp, trace.then_some(grid.rank))
            .with_sequence_parts(tp_parts);
        // Under ZeRO-3 this rank keeps only its shards of the values.
        let model = match sync.shards() {
            Some(_) => emptied(model),
            None => model,
        };
        Ok(Self {
            grid,
            parallel: parallel.clone(),
            settings,
            device,
            model,
            versions: WeightVersions::new(two_versions),
            optim,
            sync,
            executor,
            norm,
            routing: None,
            done: 0,
            lineage: Default::default(),
            saving: None,
        })
    }

    /// Puts every parameter in the group `rule` gives it: its weight decay and the factor of
    /// its learning rate ([`ParamGroup`]). The rule sees the parameter's name (as checkpoints
    /// name it; a tied copy by its original) and full shape ([`ParamInfo`]), so every layout
    /// and rank groups alike, and the default rule's group for it. Must be called before
    /// [`resume`](Self::resume) and the first step; a negative or non-finite value is refused
    /// naming the parameter.
    ///
    /// ```ignore
    /// // No weight decay on the embeddings, and half the learning rate for the head.
    /// let trainer = trainer.with_param_groups(|p| match p.name {
    ///     n if n.starts_with("embed") => ParamGroup { weight_decay: 0.0, ..p.default },
    ///     n if n.starts_with("head") => ParamGroup { lr_scale: 0.5, ..p.default },
    ///     _ => p.default,
    /// })?;
    /// ```
    pub fn with_param_groups(
        mut self,
        rule: impl Fn(&ParamInfo<'_>) -> ParamGroup,
    ) -> Result<Self, TrainError> {
        if self.done > 0 || self.lineage.origin.is_some() {
            return Err(TrainError::GroupsTooLate);
        }
        let (tp, copies) = (self.grid.layout.tp, self.model.tied_names());
        // The rule sees full shapes, known under ZeRO-3 too without gathering the model.
        let shapes = self.param_shapes();
        let matrices = self.optim.matrices().clone();
        self.optim = Optimizers::new(&shapes, &self.settings, (tp, copies), &matrices, &rule)?;
        Ok(self)
    }

    /// Continues from `checkpoint` (its tensors at full size in `state`): this rank's pieces
    /// of the parameters and of the optimizer state it keeps, cut for this run's layout, and
    /// the checkpoint's step. A checkpoint of another optimizer (or of the same one keeping
    /// other state) is refused, naming both, and so is one holding parameters that no rank's
    /// model has. Every rank of the grid must call it.
    pub fn resume(&mut self, checkpoint: &Checkpoint, state: &FullState) -> Result<(), TrainError> {
        let step = checkpoint.manifest.step;
        if step >= self.settings.steps {
            return Err(TrainError::NothingLeft {
                start: step,
                steps: self.settings.steps,
            });
        }
        self.settings
            .optimizer
            .check_checkpoint(&checkpoint.manifest)?;
        // Under ZeRO-3 the checkpoint's values go straight into this rank's chunks: no
        // gathered model.
        let shapes = self.param_shapes();
        let shard = Shard {
            rank: self.grid.coords.tp,
            size: self.grid.layout.tp,
        };
        let copies = self.model.tied_names();
        // Every rank together: a checkpoint parameter no rank holds is refused, not dropped.
        checkpoint.check_held(&shapes, &copies, &*self.grid.world.comm()?)?;
        let (params, moments) = state.cut_for(&checkpoint.manifest, &shapes, shard, &copies)?;
        let model = self.model.clone();
        self.model = (self.sync).resume(model, &shapes, params, &moments, &mut self.optim)?;
        self.done = step;
        self.lineage.origin = Some(super::Origin::of(checkpoint));
        Ok(())
    }

    /// The lineage this run writes its checkpoints under: known once [`fit`](Self::fit) has
    /// claimed the run's folders (the resumed checkpoint's, or a new one).
    pub fn run_id(&self) -> Option<&crate::checkpoint::RunId> {
        self.lineage.run.as_ref()
    }

    /// The bytes of model state this rank holds ([`StateBytes`]): its parameters (and
    /// PipeDream-2BW's previous version), its gradient buckets, and the optimizer state of the
    /// parameters it steps (all of them, or its ZeRO pieces) once each has stepped; under
    /// ZeRO-3 its shards of the parameters; and the same three by the planner's accounting
    /// of the plan ([`StateBytes::planned`]).
    pub fn state_bytes(&self) -> StateBytes {
        let shapes = self.param_shapes();
        let all: u64 = (shapes.iter())
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        let stepped = self.sync.stepped_elements().unwrap_or(all);
        let params = (self.sync.stored_params()).unwrap_or(self.versions.count() * all);
        let tensors = self.settings.optimizer.state_tensors();
        let experts: u64 = (shapes.iter())
            .filter(|p| crate::moe::is_expert_param(&p.name))
            .map(|p| p.shape.iter().product::<usize>() as u64)
            .sum();
        let planned = crate::planner::model_states(
            (all - experts) as f64,
            experts as f64,
            &self.parallel.state_sharding(),
            &crate::planner::StateFormat::f32(tensors),
        );
        StateBytes {
            params: 4 * params,
            grads: 4 * self.sync.reducer().gradient_elements() as u64,
            optimizer: 4 * stepped * tensors as u64,
            planned,
        }
    }

    /// Every parameter's name, id and full local shape (this rank's units and tensor-parallel
    /// shard), in visit order; under ZeRO-3 as the shards know them (the model's are empty).
    fn param_shapes(&self) -> Vec<state::ParamShape> {
        self.sync.param_shapes(&self.model)
    }

    /// The model as trained so far; under ZeRO-3 its parameters are empty (this rank keeps
    /// only its shards of them): see [`gathered_model`](Self::gathered_model).
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The model as trained so far with every parameter's values; under ZeRO-3 gathered from
    /// every data-parallel rank's shards (every rank of the group must call it).
    pub fn gathered_model(&self) -> Result<M, TrainError> {
        self.sync.gathered_model(&self.model)
    }

    /// The trained model with every parameter's values ([`gathered_model`](Self::gathered_model)).
    pub fn into_model(self) -> Result<M, TrainError> {
        self.gathered_model()
    }

    /// Steps done so far (the checkpoint's step after [`resume`](Self::resume)).
    pub fn steps_done(&self) -> usize {
        self.done
    }

    /// Under a mixture of experts, the routing of the last step over the whole grid (the
    /// same on every rank).
    pub fn routing(&self) -> Option<&RoutingStats> {
        self.routing.as_ref()
    }

    /// The settings of the run.
    pub fn settings(&self) -> &TrainSettings {
        &self.settings
    }

    /// Runs the next step on the global batch `data` gives for it; the pipeline is drained at
    /// its end.
    pub fn step(&mut self, data: &dyn BatchSource) -> Result<StepOutcome, TrainError> {
        self.step_overlapping(data, false)
    }

    /// Whether [`step_overlapping`](Self::step_overlapping) can run the next step's first
    /// forwards during this step (PipeDream-2BW with more than one pipeline stage).
    pub fn overlaps_steps(&self) -> bool {
        self.executor.plan().schedule.kind == ScheduleKind::TwoBw && self.grid.layout.pp > 1
    }

    /// Runs the next step like [`step`](Self::step); with `next_follows` under PipeDream-2BW
    /// (and a step left), the next step's first forward passes run during this step's last
    /// backward passes, on the weights that step uses (the version before this step's update),
    /// so its warm-up fills this step's cool-down. The next call must then be the next step's,
    /// on the same `data`, with no [`validation_loss`](Self::validation_loss) between; the
    /// losses and weights are those of [`step`](Self::step) either way. Other schedules ignore
    /// `next_follows`.
    pub fn step_overlapping(
        &mut self,
        data: &dyn BatchSource,
        next_follows: bool,
    ) -> Result<StepOutcome, TrainError> {
        let step = self.done;
        crate::precision::set_precision(self.settings.precision);
        let mut phases = StepPhases::default();
        let mut clock = Instant::now();
        let mut lap = |slot: &mut f64| {
            *slot += clock.elapsed().as_secs_f64();
            clock = Instant::now();
        };
        self.sync.begin_step();
        // A micro-batch's auxiliary losses (each layer's the mean over its routing groups)
        // weigh its share of the step, so the step trains their mean over the global batch.
        let micro_batches = self.settings.global_batch / self.parallel.micro_batch.max(1);
        crate::moe::set_aux_scale(1.0 / micro_batches.max(1) as f32);
        let (batches, next) = self.step_batches(data, step, next_follows)?;
        lap(&mut phases.data_s);
        let losses = self.run_passes(&batches, next, step)?;
        lap(&mut phases.forward_backward_s);
        let dp = self.sync.finish(&self.model)?;
        // The step's one read of the device: its losses with the gradient norm's squares.
        let squares = self.sync.squares(&self.model, &self.norm)?;
        let [loss_values, square_values] =
            crate::host_read::together([losses.values(), squares.values()]).map_err(|source| {
                TrainError::StepRead {
                    step: step + 1,
                    source,
                }
            })?;
        let (loss, loss_parts) = self.sum_loss(losses.settle(&loss_values))?;
        let records = crate::moe::take_records();
        self.routing = (self.model.experts())
            .map(|shape| gather_routing(records, shape, self.grid.world))
            .transpose()?;
        lap(&mut phases.reduce_s);
        self.done += 1;
        let lr = self.settings.lr_at(step);
        let mut outcome = StepOutcome {
            step: step + 1,
            loss,
            loss_parts,
            lr,
            grad_norm: None,
            aux_loss: self.routing.as_ref().map(|r| r.aux_loss),
            dp,
            phases,
        };
        if !loss.is_finite() {
            return self.skipped(outcome);
        }
        // One norm and one clipping for every kind of data parallelism.
        let norm = GradNorm::of(squares.settle(&square_values), self.norm.groups)?;
        self.sync.clip(&self.model, norm, self.settings.grad_clip);
        lap(&mut outcome.phases.clip_s);
        self.update(lr)?;
        if let Some(r) = &self.routing {
            self.model.balance_experts(&r.expert_tokens);
        }
        lap(&mut outcome.phases.optimizer_s);
        outcome.grad_norm = Some(norm.to_f64());
        Ok(outcome)
    }

    /// The micro-batches of step `step` (read ahead during the last step under 2BW's overlap),
    /// and with `next_follows` where the schedule overlaps steps, the next step's.
    fn step_batches(
        &mut self,
        data: &dyn BatchSource,
        step: usize,
        next_follows: bool,
    ) -> Result<StepBatches, TrainError> {
        let batches = match self.versions.batches_ahead(step) {
            Some(b) => b,
            None => self.micro_batches(data, step)?,
        };
        let overlap = next_follows && self.overlaps_steps() && step + 1 < self.settings.steps;
        let next = overlap
            .then(|| self.micro_batches(data, step + 1))
            .transpose()?;
        Ok((batches, next))
    }

    /// The step's forward and backward passes through the executor, the gradients hooked into
    /// the reducer (and with `next`, the next step's first forwards); this rank's losses, still
    /// on the device.
    fn run_passes(
        &mut self,
        batches: &[MicroBatch],
        next: Option<Vec<MicroBatch>>,
        step: usize,
    ) -> Result<StepLosses<B::InnerBackend>, TrainError> {
        let [micro, seq] = [self.parallel.micro_batch, self.settings.seq_len];
        let seq = seq / self.model.sequence_parts();
        let shape = [micro, seq, self.model.hidden_size()];
        // ZeRO-3 without resharding: this step's parameters gathered once, kept to the update.
        let kept = self.sync.step_model(&self.model)?;
        let work = StepWork {
            model: (kept.as_ref())
                .or(self.versions.stale.as_ref())
                .unwrap_or(&self.model),
            batches,
            step,
            // The next step's forwards run on the weights it uses: the current ones, which
            // become the stale version at this step's update.
            next: next.as_deref().map(|b| (&self.model, b)),
            shards: self.sync.shards().filter(|_| kept.is_none()),
        };
        let reducer = self.sync.reducer();
        let ran_ahead = &mut self.versions.ran_ahead;
        let report = (self.executor).run_step(work, reducer, shape, &self.device, ran_ahead)?;
        // The gathered parameters go before the update builds the new values.
        drop(kept);
        self.versions.set_batches_ahead(next);
        Ok(report.losses)
    }

    /// A step whose loss is not finite: an error, or with `train.skip_nonfinite` the
    /// parameters left unchanged.
    fn skipped(&mut self, outcome: StepOutcome) -> Result<StepOutcome, TrainError> {
        let (step, loss) = (outcome.step, outcome.loss);
        if !self.settings.skip_nonfinite {
            return Err(TrainError::NonFiniteLoss { step, loss });
        }
        tracing::warn!("the loss is {loss} at step {step}: step skipped, parameters unchanged");
        // Under 2BW a skipped step still moves the weight versions on (as a zero update):
        // the next step's forwards may already run on the current weights.
        self.versions.advance(&self.model);
        Ok(outcome)
    }

    /// The optimizer's step at `lr` on the step's clipped gradients (under 2BW, the current
    /// weights kept as the next step's version first).
    fn update(&mut self, lr: f64) -> Result<(), TrainError> {
        self.versions.advance(&self.model);
        let model = self.model.clone();
        self.model = self.sync.apply(model, lr, &mut self.optim)?;
        Ok(())
    }

    /// This rank's micro-batches of step `step`, each weighted by one over the global batch's
    /// loss terms (masked LM: the number of masked positions varies), so that every layout
    /// computes the gradient of the same global mean loss.
    fn micro_batches(
        &self,
        data: &dyn BatchSource,
        step: usize,
    ) -> Result<Vec<MicroBatch>, TrainError> {
        let (p, global) = (&self.parallel, self.settings.global_batch);
        let first = self.grid.data_rank().0 * p.local_batch(global);
        let micro = p.micro_batch;
        let mut batches: Vec<MicroBatch> = Vec::new();
        for m in 0..p.micro_batches(global) {
            let start = first + m * micro;
            let samples = read_samples(micro, step + 1, || data.train_samples(step, start, micro))?;
            let samples = (self.model.prepare_samples(samples)).map_err(|e| TrainError::Data {
                step: step + 1,
                source: Box::new(e),
            })?;
            let samples = self.context_share(samples, step + 1)?;
            if let Some(b) = batches.first() {
                (b.samples.check_same_layout(&samples, start)).map_err(|e| TrainError::Data {
                    step: step + 1,
                    source: Box::new(e),
                })?;
            }
            batches.push(MicroBatch {
                samples,
                weight: 1.0,
                first_sample: start,
            });
        }
        let mut total = [batches
            .iter()
            .map(|b| b.samples.loss_terms as f32)
            .sum::<f32>()];
        all_reduce_if(self.grid.dp, &mut total)?;
        for b in &mut batches {
            b.weight = 1.0 / total[0].max(1.0);
        }
        Ok(batches)
    }

    /// This rank's share of every sequence of `samples` under context parallelism
    /// ([`shard_samples`](crate::context_parallel::shard_samples)); the samples themselves
    /// otherwise.
    pub(crate) fn context_share(
        &self,
        samples: Samples,
        step: usize,
    ) -> Result<Samples, TrainError> {
        let cp = self.grid.cp;
        if cp.size() == 1 {
            return Ok(samples);
        }
        let data = |source| TrainError::Data { step, source };
        let zigzag =
            crate::context_parallel::ZigZag::new(self.settings.seq_len, cp.size(), cp.rank())
                .map_err(|e| data(Box::new(e)))?;
        crate::context_parallel::shard_samples(samples, &zigzag).map_err(|e| data(Box::new(e)))
    }

    /// The global batch's loss and its logged parts from this rank's share: summed over the
    /// pipeline (only the last stage has them) and the data-parallel replicas.
    fn sum_loss(&self, (loss, mut parts): (f64, Vec<f64>)) -> Result<(f64, Vec<f64>), TrainError> {
        // Ranks without the head have no parts.
        parts.resize(self.model.loss_parts().len(), 0.0);
        if self.grid.layout.pp == 1 && self.grid.dp.size() == 1 {
            return Ok((loss, parts));
        }
        let mut l: Vec<f32> = std::iter::once(loss)
            .chain(parts)
            .map(|v| v as f32)
            .collect();
        if self.grid.layout.pp > 1 {
            self.grid.pp.comm()?.all_reduce(&mut l, ReduceOp::Sum)?;
        }
        all_reduce_if(self.grid.dp, &mut l)?;
        let sums: Vec<f64> = l.into_iter().map(f64::from).collect();
        Ok((sums[0], sums[1..].to_vec()))
    }

    /// Mean loss over `val_batches` global batches of held-out sequences, without gradients;
    /// each data-parallel rank evaluates its share through the pipeline.
    pub fn validation_loss(&self, data: &dyn BatchSource) -> Result<f64, TrainError> {
        let loss = self.validation_loss_unless_stopped(data, None)?;
        Ok(loss.unwrap_or(f64::NAN))
    }

    /// Like [`validation_loss`](Self::validation_loss), but before each batch the ranks agree
    /// whether `stop` was requested on any of them; `None` when it was (the pass is abandoned).
    pub fn validation_loss_unless_stopped(
        &self,
        data: &dyn BatchSource,
        stop: Option<&super::StopRequest>,
    ) -> Result<Option<f64>, TrainError> {
        let (model, shape) = self.held_out_model()?;
        // (summed losses, loss terms).
        let mut acc = [0.0f32, 0.0f32];
        for b in 0..self.settings.val_batches {
            if let Some(stop) = stop
                && self.stop_agreed_now(stop)?
            {
                return Ok(None);
            }
            let batches = self.val_micro_batches(data, b)?;
            acc[1] += batches
                .iter()
                .map(|m| m.samples.loss_terms as f32)
                .sum::<f32>();
            acc[0] += self.executor.forward_only(
                &model,
                self.sync.shards(),
                &batches,
                shape,
                &self.device,
            )? as f32;
        }
        if self.grid.layout.pp > 1 {
            // Only the last stage has the losses; every stage counted the tokens.
            let mut l = [acc[0]];
            self.grid.pp.comm()?.all_reduce(&mut l, ReduceOp::Sum)?;
            acc[0] = l[0];
        }
        all_reduce_if(self.grid.dp, &mut acc)?;
        Ok(Some(f64::from(acc[0] / acc[1].max(1.0))))
    }

    /// Whether `stop` was requested on any rank (a collective over the world).
    pub(crate) fn stop_agreed_now(&self, stop: &super::StopRequest) -> Result<bool, TrainError> {
        let mut flag = [if stop.is_requested() { 1.0f32 } else { 0.0 }];
        self.grid
            .world
            .comm()?
            .all_reduce(&mut flag, ReduceOp::Max)?;
        Ok(flag[0] > 0.0)
    }
}

/// `micro` samples from `read`, checked: the data source's error, samples of another count or
/// fields that do not fill them fail as [`TrainError::Data`] naming step `step` (1-based).
pub(crate) fn read_samples(
    micro: usize,
    step: usize,
    read: impl FnOnce() -> Result<Samples, crate::train::SourceError>,
) -> Result<Samples, TrainError> {
    let data = |source| TrainError::Data { step, source };
    let samples = read().map_err(data)?;
    if samples.count != micro {
        return Err(data(
            format!("{} samples were read, {micro} asked for", samples.count).into(),
        ));
    }
    samples.check().map_err(|e| data(Box::new(e)))?;
    Ok(samples)
}

/// Refuses context parallelism over `cp` ranks for a model whose hidden states are not cut
/// across them (`parts`, [`PipelineModel::sequence_parts`], not a multiple of `cp`): its
/// attention would see only the rank's share of each sequence.
fn check_context_parallel(cp: usize, parts: usize) -> Result<(), TrainError> {
    if cp <= 1 || parts.is_multiple_of(cp) {
        return Ok(());
    }
    Err(crate::train::InvalidSetting {
        key: "parallel.cp".into(),
        value: cp.to_string(),
        reason: "this model does not cut its sequences across context-parallel ranks (GPT and \
                 BERT do, with_context_parallel; a model of your own does through \
                 merak_burn::run when it declares UnitModel::context_parallel)"
            .into(),
    }
    .into())
}

/// Sums `values` over `group` when it has more than one rank.
fn all_reduce_if(group: Group, values: &mut [f32]) -> Result<(), TrainError> {
    if group.size() > 1 {
        group.comm()?.all_reduce(values, ReduceOp::Sum)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_context_parallel;

    /// A model that cuts its sequences into cp (or cp x tp) parts runs context-parallel; one
    /// that does not is refused, naming the key.
    #[test]
    fn context_parallelism_needs_a_model_that_cuts_its_sequences() {
        assert!(check_context_parallel(1, 1).is_ok());
        assert!(check_context_parallel(2, 2).is_ok());
        assert!(check_context_parallel(2, 4).is_ok());
        let e = check_context_parallel(2, 1).unwrap_err().to_string();
        assert!(
            e.contains("parallel.cp") && e.contains("does not cut"),
            "{e}"
        );
    }
}
