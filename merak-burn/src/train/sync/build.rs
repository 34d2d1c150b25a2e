//! Choosing and building a rank's [`GradSync`] from the plan: the reducer's buckets and
//! [`Collective`], and the kind of data parallelism `parallel.zero` asks for.

use std::collections::HashSet;

use burn::module::ParamId;

use crate::checkpoint::state::ParamShape;
use crate::data_parallel::{Collective, DataParallel, ReduceScatter, Sharding};
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::pipeline::{PipelinePlan, TrainBackend, TrainModel};
use crate::train::TrainError;
use crate::train::experts::experts_apart;
use crate::train::hybrid::{ShardGroups, shard_groups};
use crate::train::zero3::{self, UnitParams};

use super::chunks::Chunks;
use super::{GradSync, Replicated, ShardedParams, ShardedState};

/// The gradient synchronisation of this rank for `model` (this rank's units and shard, its
/// parameters `shapes` in visit order, the routed experts' among them `experts`) under
/// `parallel` and `pipeline`: [`Replicated`] without ZeRO, [`ShardedState`] under ZeRO-1 and
/// 2, [`ShardedParams`] under ZeRO-3.
pub(crate) fn build<'g, B, M>(
    grid: &'g ProcessGrid,
    parallel: &ParallelPlan,
    pipeline: &PipelinePlan,
    model: &M,
    (shapes, experts): (&[ParamShape], &HashSet<ParamId>),
    device: &B::Device,
) -> Result<Box<dyn GradSync<B, M> + 'g>, TrainError>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    let tied = model.tied_embedding();
    let units = (parallel.zero == 3)
        .then(|| zero3::unit_params(model, pipeline, grid.coords.pp, shapes))
        .transpose()?;
    let (reducer, groups) = reducer(grid, parallel, model, (shapes, units.as_ref()), experts)?;
    let shard = groups.shard;
    if parallel.zero == 0 {
        return Ok(Box::new(Replicated::new(
            reducer,
            grid,
            tied,
            device.clone(),
        )));
    }
    let Some(units) = units else {
        let chunks = Chunks::new(reducer, grid, groups, tied, device.clone(), shapes.to_vec());
        return Ok(Box::new(ShardedState::new(chunks)));
    };
    let reshard = parallel.reshard_after_forward;
    if reshard {
        // Unit by unit, a tied table's gradient comes from each unit reading it.
        zero3::set_uses(&reducer, shapes, &units);
    }
    let (rank_chunks, ranges) = (reducer.rank_chunks(), reducer.param_ranges());
    let mut shards = zero3::shards(
        model,
        shard,
        rank_chunks,
        ranges,
        shapes,
        units,
        parallel.prefetch,
    )?;
    if !experts.is_empty() && experts_apart(grid) {
        shards = shards.with_experts(groups.experts.comm()?);
    }
    let chunks = Chunks::new(reducer, grid, groups, tied, device.clone(), shapes.to_vec());
    Ok(Box::new(ShardedParams::new(chunks, shards, reshard)))
}

/// The data-parallel reducer of `model` under `parallel` (ZeRO-3: `units`, the parameters each
/// unit reads) and the groups it cuts its chunks over ([`ShardGroups`]): buckets of
/// `parallel.bucket_mb`, the routed experts' (`experts`) and a tied copy's under ZeRO in
/// buckets of their own, no bucket spanning two units under ZeRO-3.
fn reducer<B, M>(
    grid: &ProcessGrid,
    parallel: &ParallelPlan,
    model: &M,
    (shapes, units): (&[ParamShape], Option<&UnitParams>),
    experts: &HashSet<ParamId>,
) -> Result<(DataParallel, ShardGroups), TrainError>
where
    B: TrainBackend,
    M: TrainModel<B>,
{
    let bucket_elems = (parallel.bucket_mb * (1 << 20) as f64 / 4.0) as usize;
    let tied = model.tied_embedding();
    // Under ZeRO a tied copy gets a bucket of its own, so that both stages cut it alike;
    // under ZeRO-3 no bucket spans two units.
    let base = zero3::bucket_groups(shapes, units, tied.filter(|_| parallel.zero >= 1));
    // The routed experts' buckets are their own, all-reduced over the expert group.
    let group = |id| 2 * base(id) + usize::from(experts.contains(&id));
    let mut reducer = DataParallel::grouped(model, grid.dp, bucket_elems, &group)?;
    if !experts.is_empty() {
        let apart = experts_apart(grid).then_some(grid.experts);
        reducer = reducer.with_experts(apart, &|id| experts.contains(&id))?;
    }
    let buffers = parallel.gradient_buffers;
    let dp = grid.dp.comm()?;
    let on_device = buffers.on_device(parallel.zero, dp.size(), dp.kind() == "nccl");
    tracing::debug!(
        "gradient buffers ({buffers}): {}",
        match on_device {
            true => "device",
            false => "host",
        }
    );
    let groups = shard_groups(grid, parallel)?;
    let collective = collective_of(parallel, on_device);
    let sharding = Sharding {
        shard: groups.shard,
        replicate: groups.replicate,
        // Under hybrid sharding the experts held apart are sharded within the copy too.
        experts: groups.replicate.map(|_| groups.experts),
    };
    let reducer = reducer.with_collective(collective, sharding)?;
    Ok((reducer, groups))
}

/// What the data-parallel reducer does at a bucket under `parallel`'s ZeRO stage, its
/// gradients kept on the device when `on_device` (ZeRO off only).
fn collective_of(parallel: &ParallelPlan, on_device: bool) -> Collective {
    let each = parallel.reduce_scatter == ReduceScatter::MicroBatch;
    match parallel.zero {
        0 if on_device => Collective::AllReduceOnDevice,
        0 => Collective::AllReduce,
        1 => Collective::AllReduceChunked,
        _ if each => Collective::ReduceScatterEach,
        // The backward pass gathers units on the ranks that reduce the buckets.
        3 if parallel.reshard_after_forward => Collective::ReduceScatterExpertsLast,
        _ => Collective::ReduceScatter,
    }
}
