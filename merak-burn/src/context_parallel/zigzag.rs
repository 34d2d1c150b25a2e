//! The zigzag shard of a sequence under context parallelism.
//!
//! Each sequence of `seq` tokens is cut into `2 cp` equal chunks; rank `r` of the cp group
//! holds chunk `r` followed by chunk `2 cp - 1 - r`. Under a causal mask the early chunks see
//! few keys and the late ones many, so pairing chunk `r` with its mirror gives every rank the
//! same work. A rank's shard of a `[batch, seq, ..]` buffer keeps, for every sequence, its two
//! chunks in that order (`2 seq / (2 cp)` tokens).

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Element, Tensor};

/// Why a zigzag shard cannot be cut or put back together.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ZigZagError {
    /// A cp group of no ranks.
    #[error("parallel.cp must be at least 1, got 0")]
    NoRanks,
    /// `2 cp` does not divide the sequence length into chunks of at least one token.
    #[error(
        "context parallelism cuts each sequence into 2 * parallel.cp = 2 * {cp} chunks of equal, \
         non-zero length, so 2 * {cp} must divide model.seq_len = {seq}"
    )]
    Indivisible {
        /// The sequence length (`model.seq_len`).
        seq: usize,
        /// The cp group size (`parallel.cp`).
        cp: usize,
    },
    /// A rank outside the group.
    #[error("rank {rank} is outside a context-parallel group of parallel.cp = {cp} ranks")]
    Rank {
        /// The rank asked for.
        rank: usize,
        /// The group size.
        cp: usize,
    },
    /// A buffer that is not whole sequences (or shards) of the expected length.
    #[error("a buffer of {len} values is not whole sequences of {tokens} tokens of {width} values")]
    Size {
        /// The buffer's length.
        len: usize,
        /// The tokens of one sequence (or shard).
        tokens: usize,
        /// The values per token.
        width: usize,
    },
    /// Shards that do not come from the same batch.
    #[error("the shards of the {cp} ranks differ in size ({first} and {other} values)")]
    Mismatch {
        /// The number of shards.
        cp: usize,
        /// The first shard's size.
        first: usize,
        /// A differing shard's size.
        other: usize,
    },
}

/// The tokens rank `rank` of a cp group of `cp` ranks holds of each sequence of `seq` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ZigZag {
    seq: usize,
    cp: usize,
    rank: usize,
}

impl ZigZag {
    /// The shard of `rank` in a group of `cp` ranks; `2 cp` must divide `seq`.
    pub fn new(seq: usize, cp: usize, rank: usize) -> Result<Self, ZigZagError> {
        if cp == 0 {
            return Err(ZigZagError::NoRanks);
        }
        if rank >= cp {
            return Err(ZigZagError::Rank { rank, cp });
        }
        match cp.checked_mul(2) {
            Some(chunks) if seq >= chunks && seq.is_multiple_of(chunks) => {
                Ok(Self { seq, cp, rank })
            }
            _ => Err(ZigZagError::Indivisible { seq, cp }),
        }
    }

    /// The same cut of the sequence, as another rank holds it.
    pub fn of_rank(&self, rank: usize) -> Result<Self, ZigZagError> {
        Self::new(self.seq, self.cp, rank)
    }

    /// Tokens per whole sequence.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Ranks of the cp group.
    pub fn cp(&self) -> usize {
        self.cp
    }

    /// This shard's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Tokens per chunk, `seq / (2 cp)`.
    pub fn chunk_len(&self) -> usize {
        self.seq / (2 * self.cp)
    }

    /// Tokens of a sequence this rank holds, `2 seq / (2 cp)`.
    pub fn local_len(&self) -> usize {
        2 * self.chunk_len()
    }

    /// The global positions of the two chunks held, in the order the shard keeps them.
    pub fn chunks(&self) -> [Range<usize>; 2] {
        let c = self.chunk_len();
        let mirror = 2 * self.cp - 1 - self.rank;
        [
            self.rank * c..(self.rank + 1) * c,
            mirror * c..(mirror + 1) * c,
        ]
    }

    /// The global position of each token of the shard (the same for every sequence).
    pub fn positions(&self) -> Vec<usize> {
        self.chunks().into_iter().flatten().collect()
    }

    /// This rank's shard of `full`, whole sequences of `seq` tokens of `width` values each
    /// (`[batch, seq, width]` row-major; `width` 1 for `[batch, seq]`): `[batch, local_len,
    /// width]`.
    pub fn shard<T: Copy>(&self, full: &[T], width: usize) -> Result<Vec<T>, ZigZagError> {
        let batch = whole(full.len(), self.seq, width)?;
        let mut out = Vec::with_capacity(batch * self.local_len() * width);
        for sequence in full.chunks_exact(self.seq * width) {
            for range in self.chunks() {
                out.extend_from_slice(&sequence[range.start * width..range.end * width]);
            }
        }
        Ok(out)
    }

    /// The whole sequences of `seq` tokens back from the shards of every rank of the group,
    /// in rank order (what [`shard`](Self::shard) cut, with the same `width`).
    pub fn unshard<T: Copy + Default, S: AsRef<[T]>>(
        seq: usize,
        shards: &[S],
        width: usize,
    ) -> Result<Vec<T>, ZigZagError> {
        let cp = shards.len();
        let first = shards.first().map_or(0, |s| s.as_ref().len());
        if let Some(other) = shards
            .iter()
            .map(|s| s.as_ref().len())
            .find(|&l| l != first)
        {
            return Err(ZigZagError::Mismatch { cp, first, other });
        }
        let zigzags = (0..cp)
            .map(|r| Self::new(seq, cp, r))
            .collect::<Result<Vec<_>, _>>()?;
        let local = zigzags[0].local_len();
        let batch = whole(first, local, width)?;
        let mut out = vec![T::default(); batch * seq * width];
        for (zz, shard) in zigzags.iter().zip(shards) {
            let rows = shard.as_ref().chunks_exact(local * width);
            for (sequence, part) in out.chunks_exact_mut(seq * width).zip(rows) {
                let ranges = zz.chunks();
                let (lo, hi) = part.split_at(ranges[0].len() * width);
                for (range, src) in ranges.into_iter().zip([lo, hi]) {
                    sequence[range.start * width..range.end * width].copy_from_slice(src);
                }
            }
        }
        Ok(out)
    }

    /// This rank's shard of a tensor of whole sequences along dimension 1 (`[batch, seq,
    /// ..]`, float or integer): `[batch, local_len, ..]`.
    pub fn shard_tensor<B, const D: usize, K>(
        &self,
        full: Tensor<B, D, K>,
    ) -> Result<Tensor<B, D, K>, ZigZagError>
    where
        B: Backend,
        K: BasicOps<B>,
        K::Elem: Element,
    {
        let dims = full.dims();
        let len = seq_dim(&dims);
        if len != self.seq {
            let width = dims.iter().skip(2).product();
            return Err(ZigZagError::Size {
                len: dims.iter().product(),
                tokens: self.seq,
                width,
            });
        }
        let parts = self
            .chunks()
            .map(|r| full.clone().narrow(1, r.start, r.len()));
        Ok(Tensor::cat(Vec::from(parts), 1))
    }

    /// The tensor of whole sequences back from every rank's
    /// [`shard_tensor`](Self::shard_tensor), in rank order.
    pub fn unshard_tensor<B, const D: usize, K>(
        shards: Vec<Tensor<B, D, K>>,
    ) -> Result<Tensor<B, D, K>, ZigZagError>
    where
        B: Backend,
        K: BasicOps<B>,
        K::Elem: Element,
    {
        let cp = shards.len();
        let local = shards.first().map_or(0, |t| seq_dim(&t.dims()));
        if cp == 0 {
            return Err(ZigZagError::NoRanks);
        }
        if let Some(other) = shards
            .iter()
            .map(|t| seq_dim(&t.dims()))
            .find(|&l| l != local)
        {
            return Err(ZigZagError::Mismatch {
                cp,
                first: local,
                other,
            });
        }
        if local == 0 || !local.is_multiple_of(2) {
            let width = shards[0].dims().iter().skip(2).product();
            let len = shards[0].dims().iter().product();
            return Err(ZigZagError::Size {
                len,
                tokens: local,
                width,
            });
        }
        let chunk = local / 2;
        let mut chunks: Vec<Option<Tensor<B, D, K>>> = vec![None; 2 * cp];
        for (r, shard) in shards.into_iter().enumerate() {
            chunks[r] = Some(shard.clone().narrow(1, 0, chunk));
            chunks[2 * cp - 1 - r] = Some(shard.narrow(1, chunk, chunk));
        }
        Ok(Tensor::cat(chunks.into_iter().flatten().collect(), 1))
    }
}

/// The length of dimension 1 (the sequence), 0 for a tensor of rank 1.
fn seq_dim(dims: &[usize]) -> usize {
    dims.get(1).copied().unwrap_or(0)
}

/// How many whole sequences of `tokens` tokens of `width` values `len` values make.
fn whole(len: usize, tokens: usize, width: usize) -> Result<usize, ZigZagError> {
    let per = tokens * width;
    let size = || ZigZagError::Size { len, tokens, width };
    if per == 0 {
        return if len == 0 { Ok(0) } else { Err(size()) };
    }
    if len.is_multiple_of(per) {
        Ok(len / per)
    } else {
        Err(size())
    }
}

#[cfg(test)]
mod tests;
