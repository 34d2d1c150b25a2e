//! What the data-parallel reducer does at a bucket ([`Collective`]), and the ranks it cuts a
//! bucket's chunks over ([`Sharding`]).

use crate::comm::Group;

/// The collective that sums a gradient bucket over the data-parallel ranks, when it starts,
/// and how its result is read: whole (every gradient, [`DataParallel::finish`]) or as this
/// rank's chunk of every bucket ([`DataParallel::finish_chunks`]).
///
/// [`DataParallel::finish`]: super::DataParallel::finish
/// [`DataParallel::finish_chunks`]: super::DataParallel::finish_chunks
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Collective {
    /// All-reduce each whole bucket from host memory, started during the step's last backward
    /// pass as soon as the bucket is complete; read whole (ZeRO off).
    #[default]
    AllReduce,
    /// Keep each gradient where the backend computed it (on a GPU, in device memory), summed
    /// over the micro-batches there; after the step's backward passes each bucket is
    /// concatenated on the device and all-reduced as one tensor (device to device under NCCL);
    /// read whole (ZeRO off, [`GradientBuffers`](super::GradientBuffers) on the device).
    AllReduceOnDevice,
    /// All-reduce each whole bucket as [`AllReduce`](Self::AllReduce) does, read as this rank's
    /// chunks of the shard group (ZeRO-1).
    AllReduceChunked,
    /// Reduce-scatter each bucket once a step, started during the last backward pass as soon
    /// as the bucket is complete (the micro-batches add up in whole buckets); read as chunks
    /// (ZeRO-2 and 3).
    ReduceScatter,
    /// [`ReduceScatter`](Self::ReduceScatter), with the routed experts' buckets (and those
    /// after them in order) started only at the end of the step: needed when other collectives
    /// run on the same ranks during the backward pass (ZeRO-3's gathers), since an expert
    /// bucket is complete early only on the ranks whose tokens chose all its experts, and
    /// would start there between collectives the other ranks start in another order.
    ReduceScatterExpertsLast,
    /// Reduce-scatter each bucket every micro-batch, as soon as that micro-batch's backward
    /// pass completes it, summing this rank's chunks, so that no whole bucket outlives its
    /// micro-batch (one reduce-scatter per micro-batch instead of one per step); read as
    /// chunks. The routed experts' buckets are the exception: an expert may get no token in a
    /// micro-batch on some ranks, so they add up whole and are reduce-scattered once, at the
    /// end of the step (ZeRO-2 and 3 with `parallel.reduce_scatter = "micro-batch"`).
    ReduceScatterEach,
}

impl Collective {
    /// Whether the buckets are reduce-scattered (each rank receives only its chunk).
    pub fn scatters(self) -> bool {
        matches!(
            self,
            Self::ReduceScatter | Self::ReduceScatterExpertsLast | Self::ReduceScatterEach
        )
    }

    /// Whether the result is read as this rank's chunks
    /// ([`finish_chunks`](super::DataParallel::finish_chunks)).
    pub fn reads_chunks(self) -> bool {
        self.scatters() || self == Self::AllReduceChunked
    }
}

/// The ranks a reducer that reads chunks cuts its buckets over.
#[derive(Clone, Copy, Debug)]
pub struct Sharding {
    /// The ranks that share one copy's chunks: the data-parallel group, or under hybrid
    /// sharding this rank's shard group.
    pub shard: Group,
    /// Under hybrid sharding: the ranks holding the same chunk in the other copies, over which
    /// each reduce-scattered chunk is all-reduced (`None`: no hybrid sharding).
    pub replicate: Option<Group>,
    /// Under hybrid sharding: the ranks of the expert group in this rank's shard group, over
    /// which the buckets of routed experts held apart are cut (their chunks then all-reduced
    /// over `replicate` like the dense ones; `None`: they are cut over the whole expert group,
    /// every copy included).
    pub experts: Option<Group>,
}

impl Sharding {
    /// Every rank of `dp` holds one chunk of the one copy (no hybrid sharding).
    pub fn over(dp: Group) -> Self {
        Self {
            shard: dp,
            replicate: None,
            experts: None,
        }
    }
}
