//! The second half of a run, shared by [`merak_burn::run`](crate::run) and programs that build
//! their model's part themselves (`merak train`'s GPT and BERT): start from pretrained weights
//! or a checkpoint, train, evaluate.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::backend::Backend;

use super::{InitWeights, MetricSums, RunError, RunOptions, RunReport};
use crate::checkpoint::{Checkpoint, FullState, cut_full_params, state};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{PipelineModel, PipelinePlan};
use crate::pipeline::{TrainBackend, TrainModel};
use crate::tensor_parallel::Shard;
use crate::train::{BatchSource, CheckpointPolicy, RunOutput, StopRequest, TrainSettings, Trainer};

/// Where a rank's part of a model trains: its place in the process grid, the plan, the
/// pipeline (stages as cut), its device and the run's output folder.
pub struct Part<'g, B: Backend> {
    /// This rank's grid.
    pub grid: &'g ProcessGrid,
    /// The device this rank trains on.
    pub device: B::Device,
    /// The plan, with the stages as cut.
    pub plan: ParallelPlan,
    /// The pipeline: schedule, stages, recomputation.
    pub pipeline: PipelinePlan,
    /// The output folder (metrics, run file, checkpoints unless
    /// [`RunOptions::checkpoint_dir`] says otherwise).
    pub out: PathBuf,
}

/// Trains `model`, this rank's part (the units it holds, cut for its tensor-parallel rank),
/// under `part` on `data`, as [`merak_burn::run`](crate::run) does once it has built the
/// units: loads [`RunOptions::init`] (cut for this layout) or continues `resume`, applies the
/// parameter groups, trains with validation, metrics, progress and checkpoints (stopping when
/// `stop` is set), then evaluates and predicts when asked. Returns the report and the trained
/// part. Every rank calls it with the same arguments but its own part.
pub fn train_part<B, M>(
    part: Part<'_, B>,
    mut model: M,
    data: &dyn BatchSource,
    settings: &TrainSettings,
    options: &RunOptions,
    resume: Option<(&Checkpoint, &FullState)>,
    stop: Option<StopRequest>,
) -> Result<(RunReport, M), RunError>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    let t0 = Instant::now();
    let Part {
        grid,
        device,
        plan,
        pipeline,
        out,
    } = part;
    if let Some(init) = &options.init {
        model = initialized_from(model, init, grid)?;
    }
    let (params, sp) = (model.num_params(), model.sequence_parts() > grid.layout.cp);
    let metric_names = model.metric_names();
    let trace = options.trace.is_some();
    let mut trainer = Trainer::new(
        grid,
        &plan,
        pipeline,
        settings.clone(),
        model,
        device,
        trace,
    )?;
    if let Some(groups) = &options.param_groups {
        trainer = trainer.with_param_groups(|p| (groups.0)(p))?;
    }
    if let Some((checkpoint, state)) = resume {
        trainer.resume(checkpoint, state)?;
        log_resumed(checkpoint);
    }
    log_ready(grid, params, sp, t0);
    if options.predict_batches > 0 {
        // A head that predicts nothing is refused before the first step, not after the last:
        // one held-out batch through the model.
        trainer.predict(data, 1)?;
    }
    let summary = trainer.fit(data, &run_output(options, &out, stop), &mut |_| {})?;
    let evaluates = |batches: usize| batches > 0 && !summary.stopped;
    let metrics = evaluates(options.eval_batches)
        .then(|| trainer.evaluate(data, options.eval_batches))
        .transpose()?
        .map(|sums| named(&metric_names, sums))
        .transpose()?;
    let predictions = evaluates(options.predict_batches)
        .then(|| trainer.predict(data, options.predict_batches))
        .transpose()?;
    let report = RunReport {
        summary,
        plan,
        rank: grid.rank,
        out,
        metrics,
        predictions,
    };
    Ok((report, trainer.into_model()?))
}

/// The metric sums `sums` by the model's `names`, or why they do not match.
fn named(names: &[&str], sums: Vec<f64>) -> Result<MetricSums, RunError> {
    let counted = sums.len();
    MetricSums::new(names, sums).ok_or_else(|| RunError::MetricNames {
        names: names.iter().map(|n| n.to_string()).collect(),
        counted,
    })
}

/// Logs the model's size and this rank's layout once its trainer is built.
fn log_ready(grid: &ProcessGrid, params: usize, sequence_parallel: bool, t0: Instant) {
    let l = &grid.layout;
    let sp = if sequence_parallel {
        " sequence-parallel"
    } else {
        ""
    };
    let ep = match grid.ep.size() {
        1 => String::new(),
        n => format!(" ep={n}"),
    };
    tracing::info!(
        params,
        layout = %format!("dp={} cp={} tp={} pp={}{sp}{ep}", l.dp, l.cp, l.tp, l.pp),
        "model ready in {:.2}s",
        t0.elapsed().as_secs_f64()
    );
}

/// Logs the checkpoint a run continues from.
fn log_resumed(checkpoint: &Checkpoint) {
    let saved = &checkpoint.manifest;
    tracing::info!(
        "resumed from {} after step {} (saved under dp={} tp={} pp={})",
        checkpoint.dir.display(),
        saved.step,
        saved.layout.dp,
        saved.layout.tp,
        saved.layout.pp
    );
}

/// `units` with their parameters (this rank's shard of the units it holds) replaced by their
/// pieces of `init`, but for those the weights cannot hold
/// ([`PipelineModel::beyond_pretrained`]), which keep their values.
fn initialized_from<B, M>(units: M, init: &InitWeights, grid: &ProcessGrid) -> Result<M, RunError>
where
    B: Backend,
    M: PipelineModel<B>,
{
    let error = |error| RunError::Checkpoint {
        source_name: init.source.clone(),
        error,
    };
    let shapes = state::param_shapes(&units);
    let shard = Shard {
        rank: grid.coords.tp,
        size: grid.layout.tp,
    };
    // The parameters the weights cannot hold keep their initial values.
    let fresh = |name: &str| units.beyond_pretrained(name) && !init.params.contains_key(name);
    let from_file: Vec<_> = shapes.into_iter().filter(|p| !fresh(&p.name)).collect();
    let mut params =
        cut_full_params(&init.params, &from_file, shard, &units.tied_names()).map_err(error)?;
    params.extend(state::selected_params(&units, &fresh).map_err(error)?);
    state::assign_params(units, params).map_err(error)
}

/// Where and how [`Trainer::fit`] writes the run.
fn run_output(options: &RunOptions, out: &Path, stop: Option<StopRequest>) -> RunOutput {
    let checkpoints = (options.checkpoint_dir.clone()).unwrap_or_else(|| out.join("checkpoints"));
    RunOutput {
        dir: out.to_path_buf(),
        checkpoints: Some(CheckpointPolicy {
            dir: checkpoints,
            every: options.checkpoint_every,
            at_end: options.checkpoint_at_end,
            keep: options.keep_checkpoints,
            extra: options.manifest_extra.clone(),
            asynchronous: options.checkpoint_async,
        }),
        trace: options.trace.clone(),
        progress: options.progress,
        stop,
        existing: options.existing,
        files: options.files.clone(),
        stragglers: options.stragglers,
    }
}
