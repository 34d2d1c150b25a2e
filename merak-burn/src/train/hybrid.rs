//! Hybrid sharding (`parallel.shard`): the data-parallel group cut into shard groups of
//! `shard` consecutive DP ranks, each holding one replica's chunks (ZeRO-2 or 3 within it),
//! and replicate groups of the ranks holding the same chunk in every replica (torchtitan's
//! `dp_shard` × `dp_replicate`).

use crate::comm::Group;
use crate::grid::ProcessGrid;
use crate::parallel_plan::ParallelPlan;
use crate::train::{InvalidSetting, TrainError};

/// This rank's shard group and replicate group: `(dp, None)` without hybrid sharding
/// (`parallel.shard` 0 or dp). Refuses a degree that does not divide dp, and hybrid sharding
/// without ZeRO.
pub(crate) fn shard_groups(
    grid: &ProcessGrid,
    parallel: &ParallelPlan,
) -> Result<(Group, Option<Group>), TrainError> {
    let (dp, shard) = (grid.dp.size(), parallel.shard);
    if shard == 0 || shard == dp {
        return Ok((grid.dp, None));
    }
    let bad = |reason: String| InvalidSetting {
        key: "parallel.shard".into(),
        value: shard.to_string(),
        reason,
    };
    if !dp.is_multiple_of(shard) {
        return Err(bad(format!("must divide parallel.dp = {dp}")).into());
    }
    if parallel.zero == 0 {
        return Err(bad(format!(
            "hybrid sharding needs parallel.zero = 1, 2 or 3 (it is {})",
            parallel.zero
        ))
        .into());
    }
    let (me, comm) = (grid.coords.dp, grid.dp.comm()?);
    let shard_comm = comm.split(me / shard, me % shard)?;
    let replicate = comm.split(me % shard, me / shard)?;
    Ok((
        Group::register(shard_comm),
        Some(Group::register(replicate)),
    ))
}
