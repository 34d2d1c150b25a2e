//! Setting up ZeRO-3 (`parallel.zero = 3`): which parameters each unit reads, buckets that
//! never span two units, and this rank's shards of the values ([`Shards`]). The step itself
//! runs in the pipeline executor (units gathered one at a time) and in
//! `train::sync::sharded_params` (each rank steps its pieces and keeps the new values as its
//! shards).

use std::collections::HashMap;

use burn::module::{AutodiffModule, ParamId};
use burn::tensor::backend::AutodiffBackend;

use super::error::InvalidSetting;
use super::param_values::for_each_param;
use crate::checkpoint::CheckpointError;
use crate::checkpoint::state::ParamShape;
use crate::comm::Group;
use crate::data_parallel::chunks::RankChunks;
use crate::data_parallel::{DataParallel, Shards};
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{PipelineModel, PipelinePlan, ScheduleKind};
use crate::train::TrainError;

/// The parameters (visit-order indices) each unit reads, by unit.
pub(crate) type UnitParams = HashMap<usize, Vec<usize>>;

/// Refuses a ZeRO stage that does not exist, and ZeRO-3 with a schedule it does not run
/// (two weight versions; a split backward pass unless the parameters stay gathered).
pub(super) fn check_zero(
    parallel: &ParallelPlan,
    pipeline: &PipelinePlan,
) -> Result<(), TrainError> {
    let bad = |reason: String| {
        Err(InvalidSetting {
            key: "parallel.zero".into(),
            value: parallel.zero.to_string(),
            reason,
        }
        .into())
    };
    if parallel.zero > 3 {
        return bad("the ZeRO stages are 0, 1, 2 and 3".into());
    }
    let kind = pipeline.schedule.kind;
    if parallel.zero == 3 && kind == ScheduleKind::TwoBw {
        return bad("ZeRO-3 stores one sharded weight version; schedule \"2bw\" keeps two".into());
    }
    if parallel.zero == 3 && parallel.reshard_after_forward && kind.splits_backward() {
        return bad(format!(
            "ZeRO-3 runs a unit's whole backward pass on its gathered parameters; schedule \
             \"{kind}\" splits it (use 1f1b, gpipe or interleaved, or keep the parameters \
             gathered through the step with parallel.reshard_after_forward = false)"
        ));
    }
    Ok(())
}

/// The parameters each unit this rank holds reads (`shapes`: every parameter in visit order),
/// from [`PipelineModel::unit_params`]. Fails when the model does not name them, or when a
/// parameter is read by no unit (it would never be gathered).
pub(crate) fn unit_params<B, M>(
    model: &M,
    pipeline: &PipelinePlan,
    me: usize,
    shapes: &[ParamShape],
) -> Result<UnitParams, TrainError>
where
    B: AutodiffBackend,
    M: PipelineModel<B> + AutodiffModule<B>,
{
    let index: HashMap<ParamId, usize> = (shapes.iter().enumerate())
        .map(|(i, p)| (p.id, i))
        .collect();
    let held = (0..model.units())
        .filter(|&u| pipeline.schedule.rank_of(pipeline.partition.stage_of(u)) == me);
    let mut units = UnitParams::new();
    for u in held {
        let ids = model.unit_params(u).ok_or_else(|| {
            TrainError::Zero3(format!(
                "the model does not say which parameters unit {u} reads \
                 (implement PipelineModel::unit_params)"
            ))
        })?;
        units.insert(
            u,
            ids.iter().filter_map(|id| index.get(id).copied()).collect(),
        );
    }
    let mut read = vec![false; shapes.len()];
    units.values().flatten().for_each(|&i| read[i] = true);
    if let Some(i) = read.iter().position(|r| !r) {
        return Err(TrainError::Zero3(format!(
            "parameter {} is read by no unit this rank holds (PipelineModel::unit_params must list \
             every parameter of a unit)",
            shapes[i].name
        )));
    }
    Ok(units)
}

/// Each parameter's bucket group: under ZeRO-3 (`units` given) the first unit that reads it,
/// so that no bucket spans two units; `alone` (a tied copy) in a group of its own.
pub(crate) fn bucket_groups(
    shapes: &[ParamShape],
    units: Option<&UnitParams>,
    alone: Option<ParamId>,
) -> impl Fn(ParamId) -> usize + use<> {
    let mut home: HashMap<ParamId, usize> = HashMap::new();
    for (&u, params) in units.into_iter().flatten() {
        for &p in params {
            let e = home.entry(shapes[p].id).or_insert(u);
            *e = (*e).min(u);
        }
    }
    move |id| {
        if alone == Some(id) {
            usize::MAX
        } else {
            home.get(&id).copied().unwrap_or(0)
        }
    }
}

/// Tells `reducer` which parameters several units read (a tied table): each of their
/// unit-by-unit backward passes delivers a gradient.
pub(crate) fn set_uses(reducer: &DataParallel, shapes: &[ParamShape], units: &UnitParams) {
    let mut uses = vec![0usize; shapes.len()];
    units.values().flatten().for_each(|&p| uses[p] += 1);
    for (p, &n) in uses.iter().enumerate() {
        if n > 1 {
            reducer.set_uses(shapes[p].id, n);
        }
    }
}

/// This rank's shards of `model`'s values, cut over the ranks of `shard`: read one parameter
/// at a time, so that start-up holds the model and this rank's chunks, never a flat copy.
pub(crate) fn shards<B, M>(
    model: &M,
    shard: Group,
    rank_chunks: RankChunks,
    ranges: Vec<(usize, usize)>,
    shapes: &[ParamShape],
    units: UnitParams,
    prefetch: usize,
) -> Result<Shards, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let own = own_chunks(model, &rank_chunks)?;
    let shapes = shapes.iter().map(|p| p.shape.clone()).collect();
    let comm = shard.comm()?;
    Ok(Shards::new(
        comm,
        rank_chunks,
        ranges,
        shapes,
        own,
        units,
        prefetch,
    ))
}

/// This rank's chunks (as `rank_chunks` cuts them) of `model`'s values, read one parameter at a
/// time.
fn own_chunks<B, M>(model: &M, rank_chunks: &RankChunks) -> Result<Vec<Vec<f32>>, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let mut own = rank_chunks.zero_chunks();
    for_each_param(model, &mut |i, v| rank_chunks.write_param(&mut own, i, &v))?;
    Ok(own)
}

/// This rank's chunks (as `rank_chunks` cuts them) of the parameters `params` (`shapes` in visit
/// order: every parameter's name and shape; `params`: values by name, a checkpoint's cut for
/// this rank's tensor-parallel shard), with no model built. A parameter missing from
/// `params`, of another size, or a value for no parameter is refused, naming it.
pub(crate) fn chunks_by_name(
    rank_chunks: &RankChunks,
    shapes: &[ParamShape],
    mut params: HashMap<String, Vec<f32>>,
) -> Result<Vec<Vec<f32>>, CheckpointError> {
    let mut own = rank_chunks.zero_chunks();
    for (i, p) in shapes.iter().enumerate() {
        let mismatch = |reason: String| CheckpointError::Mismatch {
            name: p.name.clone(),
            reason,
        };
        let values =
            (params.remove(&p.name)).ok_or_else(|| mismatch("not in the checkpoint".into()))?;
        let want: usize = p.shape.iter().product();
        if values.len() != want {
            return Err(mismatch(format!(
                "{} values in the checkpoint, the model's {:?} holds {want}",
                values.len(),
                p.shape
            )));
        }
        rank_chunks.write_param(&mut own, i, &values);
    }
    match params.keys().min() {
        Some(name) => Err(CheckpointError::Mismatch {
            name: name.clone(),
            reason: "in the checkpoint but not in the model".into(),
        }),
        None => Ok(own),
    }
}
