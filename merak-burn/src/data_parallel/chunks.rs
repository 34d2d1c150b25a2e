//! Sharding by chunks (ZeRO): which elements of the gradients, parameters and optimizer state
//! each data-parallel rank holds.
//!
//! The reducer lays every gradient out in one flat, visit-order concatenation and cuts it into
//! contiguous buckets. A bucket is split into `dp` equal chunks, the last padded: rank `r`
//! holds elements `[start + r·chunk, start + (r+1)·chunk)` of it, and a bucket's
//! reduce-scatter hands each rank exactly its chunk with no copy to reorder it (Megatron's
//! distributed optimizer cuts its buffers the same way; FSDP2's per-parameter dim-0 shards need
//! an interleaving copy before each reduce-scatter). A chunk may cover the end of one
//! parameter and the start of the next: the rank then holds a [`Piece`] of each, and every
//! optimizer rule merak trains with is element-wise, so updating pieces equals updating whole
//! tensors (`train::sync::chunks` tests this for every optimizer).

use std::ops::Range;

/// One bucket split into `dp` equal chunks (the last one padded where `dp` does not divide the
/// bucket): rank `r` holds flat elements [`range_of(r)`](Self::range_of).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketChunks {
    /// The bucket's first element in the flat concatenation.
    pub start: usize,
    /// The bucket's elements (unpadded).
    pub len: usize,
    /// Elements per rank: `len` divided by `dp`, rounded up.
    pub chunk: usize,
}

impl BucketChunks {
    /// Flat elements `start..end` split over `dp` ranks.
    pub fn new(start: usize, end: usize, dp: usize) -> Self {
        let len = end.saturating_sub(start);
        Self {
            start,
            len,
            chunk: len.div_ceil(dp.max(1)),
        }
    }

    /// The flat elements rank `rank` holds (fewer than `chunk`, or none, at the padded end).
    pub fn range_of(&self, rank: usize) -> Range<usize> {
        let end = self.start + self.len;
        let first = (self.start + rank * self.chunk).min(end);
        first..(first + self.chunk).min(end)
    }
}

/// A rank's part of one parameter: elements `param_start..param_start + len` of the parameter
/// (row-major, of this rank's tensor-parallel shard of it), held at `chunk_offset` in this
/// rank's chunk of bucket `bucket`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in visit order.
    pub param: usize,
    /// The bucket holding it.
    pub bucket: usize,
    /// The piece's first element within the parameter.
    pub param_start: usize,
    /// The piece's first element within this rank's chunk of the bucket.
    pub chunk_offset: usize,
    /// Elements in the piece.
    pub len: usize,
}

/// What one data-parallel rank holds: its chunk of every bucket and the parameter pieces in
/// them, in flat order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankChunks {
    /// This rank (in the data-parallel group).
    pub rank: usize,
    /// Every bucket, split over the ranks.
    pub buckets: Vec<BucketChunks>,
    /// This rank's pieces, in flat order.
    pub pieces: Vec<Piece>,
    /// Whether each bucket is split over the ranks holding the same routed experts instead of
    /// the data-parallel group (an expert bucket under expert parallelism).
    pub apart: Vec<bool>,
}

/// The ranks a bucket is split over: `ranks` of them, this one being `rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holders {
    /// Ranks sharing the bucket.
    pub ranks: usize,
    /// This rank among them.
    pub rank: usize,
}

impl RankChunks {
    /// The chunks and pieces of rank `rank` of `dp`, for parameters at `params` (`(offset, len)` in the
    /// flat concatenation, in visit order) and buckets at `buckets` (`(start, end)`, any
    /// order; together they cover the parameters).
    pub fn new(
        params: &[(usize, usize)],
        buckets: &[(usize, usize)],
        dp: usize,
        rank: usize,
    ) -> Self {
        let dense = Holders { ranks: dp, rank };
        Self::with_experts(params, buckets, dense, (dense, &vec![false; buckets.len()]))
    }

    /// Like [`new`](Self::new), with the buckets marked in `apart` split over `experts` (the
    /// ranks holding the same routed experts) and the others over `dense` (the data-parallel
    /// group).
    pub fn with_experts(
        params: &[(usize, usize)],
        buckets: &[(usize, usize)],
        dense: Holders,
        (experts, apart): (Holders, &[bool]),
    ) -> Self {
        let holders = |b: usize| match apart.get(b) {
            Some(true) => experts,
            _ => dense,
        };
        let chunks: Vec<BucketChunks> = (buckets.iter().enumerate())
            .map(|(b, &(start, end))| BucketChunks::new(start, end, holders(b).ranks))
            .collect();
        let mut pieces = Vec::new();
        for (b, c) in chunks.iter().enumerate() {
            let mine = c.range_of(holders(b).rank);
            for (p, &(offset, len)) in params.iter().enumerate() {
                let first = mine.start.max(offset);
                let end = mine.end.min(offset + len);
                if first < end {
                    pieces.push(Piece {
                        param: p,
                        bucket: b,
                        param_start: first - offset,
                        chunk_offset: first - mine.start,
                        len: end - first,
                    });
                }
            }
        }
        pieces.sort_by_key(|x| (chunks[x.bucket].start + x.chunk_offset, x.param));
        Self {
            rank: dense.rank,
            apart: (0..chunks.len())
                .map(|b| apart.get(b) == Some(&true))
                .collect(),
            buckets: chunks,
            pieces,
        }
    }

    /// Elements this rank holds (the sum of its pieces).
    pub fn held(&self) -> usize {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// This rank's pieces of parameter `param`.
    pub fn pieces_of(&self, param: usize) -> impl Iterator<Item = &Piece> {
        self.pieces.iter().filter(move |p| p.param == param)
    }

    /// This rank's chunk of every bucket, zeros (the padding stays so): filled parameter by
    /// parameter with [`write_param`](Self::write_param), so that no whole copy of the model
    /// is ever made.
    pub fn zero_chunks(&self) -> Vec<Vec<f32>> {
        self.buckets.iter().map(|c| vec![0.0; c.chunk]).collect()
    }

    /// Copies this rank's pieces of parameter `param` (`values`: all of its elements) into
    /// `chunks` ([`zero_chunks`](Self::zero_chunks)'s layout); elements past the end of a
    /// short `values` are left as they are.
    pub fn write_param(&self, chunks: &mut [Vec<f32>], param: usize, values: &[f32]) {
        for p in self.pieces_of(param) {
            let src = values.get(p.param_start..p.param_start + p.len);
            let dst = (chunks.get_mut(p.bucket))
                .and_then(|c| c.get_mut(p.chunk_offset..p.chunk_offset + p.len));
            if let (Some(src), Some(dst)) = (src, dst) {
                dst.copy_from_slice(src);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Flat `(offset, len)` or `(start, end)` ranges.
    type Ranges = Vec<(usize, usize)>;

    /// Parameters of `lens` laid end to end, and buckets of about `target` elements from the
    /// end, as the reducer cuts them (whole parameters per bucket).
    fn layout(lens: &[usize], target: usize) -> (Ranges, Ranges) {
        let mut params = Vec::new();
        let mut offset = 0;
        for &len in lens {
            params.push((offset, len));
            offset += len;
        }
        let (mut buckets, mut end) = (Vec::new(), offset);
        for (i, &(start, _)) in params.iter().enumerate().rev() {
            if end - start >= target.max(1) || i == 0 {
                buckets.push((start, end));
                end = start;
            }
        }
        (params, buckets)
    }

    #[test]
    fn a_chunk_spanning_two_parameters_holds_a_piece_of_each() {
        // Parameters of 5 and 3 elements in one bucket of 8, over 3 ranks: chunks of 3.
        let (params, buckets) = layout(&[5, 3], 100);
        let r1 = RankChunks::new(&params, &buckets, 3, 1);
        assert_eq!(
            r1.buckets,
            vec![BucketChunks {
                start: 0,
                len: 8,
                chunk: 3
            }]
        );
        assert_eq!(
            r1.pieces,
            vec![
                Piece {
                    param: 0,
                    bucket: 0,
                    param_start: 3,
                    chunk_offset: 0,
                    len: 2
                },
                Piece {
                    param: 1,
                    bucket: 0,
                    param_start: 0,
                    chunk_offset: 2,
                    len: 1
                },
            ]
        );
        // The last rank's chunk is cut short by the padding.
        let r2 = RankChunks::new(&params, &buckets, 3, 2);
        assert_eq!(r2.buckets[0].range_of(2), 6..8);
        assert_eq!(r2.held(), 2);
    }

    #[test]
    fn expert_buckets_are_cut_over_the_expert_group() {
        // Two buckets: dense [0, 8) over 4 ranks, experts [8, 14) over 2 (this rank is dense
        // rank 3, expert rank 1).
        let params = [(0, 8), (8, 6)];
        let buckets = [(8, 14), (0, 8)];
        let dense = Holders { ranks: 4, rank: 3 };
        let experts = Holders { ranks: 2, rank: 1 };
        let s = RankChunks::with_experts(&params, &buckets, dense, (experts, &[true, false]));
        assert_eq!(s.apart, vec![true, false]);
        assert_eq!((s.buckets[0].chunk, s.buckets[1].chunk), (3, 2));
        let held: Vec<(usize, usize, usize)> = (s.pieces.iter())
            .map(|p| (p.param, p.param_start, p.len))
            .collect();
        assert_eq!(held, vec![(0, 6, 2), (1, 3, 3)]);
    }

    proptest! {
        /// Over all ranks, the pieces cover every element of every parameter exactly once,
        /// each piece lies in its rank's chunk of its bucket, and no rank holds more than one
        /// chunk per bucket.
        #[test]
        fn the_ranks_pieces_partition_every_parameter(
            lens in proptest::collection::vec(1usize..40, 1..12),
            target in 1usize..120,
            dp in 1usize..9,
        ) {
            let (params, buckets) = layout(&lens, target);
            let total: usize = lens.iter().sum();
            let mut owner = vec![usize::MAX; total];
            for rank in 0..dp {
                let s = RankChunks::new(&params, &buckets, dp, rank);
                for p in &s.pieces {
                    let c = s.buckets[p.bucket];
                    let chunk = c.range_of(rank);
                    let flat = params[p.param].0 + p.param_start;
                    prop_assert_eq!(flat, chunk.start + p.chunk_offset);
                    prop_assert!(p.chunk_offset + p.len <= chunk.len());
                    prop_assert!(p.param_start + p.len <= params[p.param].1);
                    for o in &mut owner[flat..flat + p.len] {
                        prop_assert_eq!(*o, usize::MAX);
                        *o = rank;
                    }
                }
                for c in &s.buckets {
                    prop_assert!(c.range_of(rank).len() <= c.chunk);
                    prop_assert!(c.chunk * dp >= c.len);
                }
            }
            prop_assert!(owner.iter().all(|&o| o < dp));
        }

        /// Writing the parameters one by one gives each rank the chunks it would cut from
        /// the whole flat concatenation.
        #[test]
        fn chunks_written_by_parameter_equal_chunks_cut_from_the_whole(
            lens in proptest::collection::vec(1usize..40, 1..12),
            target in 1usize..120,
            dp in 1usize..9,
        ) {
            let (params, buckets) = layout(&lens, target);
            let total: usize = lens.iter().sum();
            let flat: Vec<f32> = (0..total).map(|i| i as f32 + 1.0).collect();
            for rank in 0..dp {
                let s = RankChunks::new(&params, &buckets, dp, rank);
                let mut chunks = s.zero_chunks();
                for (p, &(offset, len)) in params.iter().enumerate() {
                    s.write_param(&mut chunks, p, &flat[offset..offset + len]);
                }
                for (c, chunk) in s.buckets.iter().zip(&chunks) {
                    let mut want = flat[c.range_of(rank)].to_vec();
                    want.resize(c.chunk, 0.0);
                    prop_assert_eq!(chunk, &want);
                }
            }
        }
    }
}
