//! Ring attention on host `f32` buffers with the blockwise CPU kernels
//! ([`blockwise`](crate::kernels::cpu::blockwise)) and a [`Communicator`]'s point-to-point
//! messages: what every backend runs today (a CUDA backend would want device kernels and NCCL
//! instead; a later issue).
//!
//! Rank `r` of a ring of `cp` ranks holds the [`ZigZag`] shard `r` of every sequence: `n`
//! tokens of Q, K and V in the fused layout `[batch, n, 3, heads, head_dim]`. At step `s` it
//! holds the keys and values of rank `r - s` (mod `cp`), packed as `[batch, n, 2, heads,
//! head_dim]`; it passes them on to rank `r + 1` while it attends to them, and takes the next
//! ones from rank `r - 1`: `cp - 1` exchanges. The partial results merge exactly through their
//! log-sum-exp ([`merge`]). The backward pass walks the same ring: the gradient of the visiting
//! keys and values travels with them, and after the last step one more hop brings each
//! block's gradient home.
//!
//! Every exchange is a shift along the ring ([`Shift`]): even ranks send first, odd ranks
//! receive first, so the ring cannot deadlock even where sending waits for the receiver (the
//! default [`Communicator::send_start`]).

use crate::comm::{CommError, Communicator, Pending};
use crate::kernels::cpu::blockwise::{
    Grads, Mask, Matrix, Positions, Scratch, Shape, Tokens, merge, pair_backward, pair_forward,
};
use crate::kernels::cpu::gemm::View;

use super::zigzag::{ZigZag, ZigZagError};

/// Message tag of the keys and values.
const TAG_KV: u16 = 31_001;
/// Message tag of their gradient.
const TAG_DKV: u16 = 31_002;

/// Why the ring failed.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// A message could not be exchanged.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The shard's length cannot be a zigzag shard of this ring.
    #[error("a shard of {tokens} tokens on a ring of {cp} ranks: {source}")]
    Layout {
        /// Tokens of the shard.
        tokens: usize,
        /// Ranks of the ring.
        cp: usize,
        /// The zigzag rule's refusal.
        source: ZigZagError,
    },
    /// A buffer of the wrong size.
    #[error("ring attention: {what} holds {got} values, expected {expected}")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length the shape needs.
        expected: usize,
    },
}

/// One rank's view of the ring: the shape of its shard, the mask, and every rank's tokens.
pub struct Ring<'a> {
    comm: &'a dyn Communicator,
    shape: Shape,
    causal: bool,
    /// The global positions of each rank's tokens, by rank.
    positions: Vec<Vec<usize>>,
    /// Each rank's segment ids (`[batch, n]`), by rank, or `None`: one segment.
    segments: Option<Vec<Vec<i64>>>,
}

impl std::fmt::Debug for Ring<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("shape", &self.shape)
            .field("causal", &self.causal)
            .field("segments", &self.segments.is_some())
            .finish()
    }
}

impl<'a> Ring<'a> {
    /// The ring of `comm` for a shard of `shape` (`shape.seq` tokens, this rank's zigzag
    /// shard) with optional segment ids (`[batch, seq]`; every rank passes them or none does).
    /// With segment ids this is a collective (an all-gather of every rank's ids): every rank of
    /// `comm` calls it. So are [`forward`](Self::forward) and [`backward`](Self::backward).
    pub fn new(
        comm: &'a dyn Communicator,
        shape: Shape,
        causal: bool,
        segments: Option<&[i64]>,
    ) -> Result<Self, RingError> {
        let cp = comm.size();
        let layout = |source| RingError::Layout {
            tokens: shape.seq,
            cp,
            source,
        };
        let zigzag = ZigZag::new(shape.seq * cp, cp, comm.rank()).map_err(layout)?;
        let positions = (0..cp)
            .map(|r| zigzag.of_rank(r).map(|z| z.positions()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(layout)?;
        let segments = match segments {
            Some(s) => {
                check("segment ids", s.len(), shape.batch * shape.seq)?;
                Some(gather_segments(comm, s)?)
            }
            None => None,
        };
        Ok(Self {
            comm,
            shape,
            causal,
            positions,
            segments,
        })
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.size()
    }

    /// The rank whose keys and values this rank holds at `step`.
    fn owner(&self, step: usize) -> usize {
        (self.rank() + self.size() - step % self.size()) % self.size()
    }

    /// The mask of this rank's queries of sequence `b` against rank `owner`'s keys.
    fn mask(&self, b: usize, owner: usize) -> Mask<'_> {
        let n = self.shape.seq;
        let side = |r: usize| Tokens {
            positions: Positions::List(&self.positions[r]),
            segments: self.segments.as_ref().map(|s| &s[r][b * n..(b + 1) * n]),
        };
        Mask {
            causal: self.causal,
            queries: side(self.rank()),
            keys: side(owner),
        }
    }

    /// Forward: the context (`[batch, n, heads, head_dim]`) and each query's log-sum-exp over
    /// all the keys of the sequence (`[batch, heads, n]`) from this rank's shard `qkv`.
    pub fn forward(&self, qkv: &[f32]) -> Result<(Vec<f32>, Vec<f32>), RingError> {
        let shape = self.shape;
        check("Q/K/V", qkv.len(), shape.qkv_len())?;
        let mut kv = pack_kv(qkv, shape);
        let mut ctx = vec![0.0; shape.ctx_len()];
        let mut lse = vec![f32::NEG_INFINITY; shape.lse_len()];
        let (mut part, mut part_lse) = (ctx.clone(), lse.clone());
        let mut scratch = Scratch::default();
        for step in 0..self.size() {
            let shift = self.shift_start(step, &kv, TAG_KV)?;
            let owner = self.owner(step);
            if step == 0 {
                self.attend(qkv, &kv, owner, (&mut ctx, &mut lse), &mut scratch);
            } else {
                self.attend(qkv, &kv, owner, (&mut part, &mut part_lse), &mut scratch);
                merge(shape, &mut ctx, &mut lse, &part, &part_lse);
            }
            if let Some(shift) = shift {
                shift.finish(self.comm, &mut kv)?;
            }
        }
        Ok((ctx, lse))
    }

    /// Backward: the gradient of this rank's shard `qkv` (fused layout) from the context's
    /// gradient `dctx`, given the forward pass's context `ctx` and log-sum-exp `lse`.
    pub fn backward(
        &self,
        qkv: &[f32],
        ctx: &[f32],
        lse: &[f32],
        dctx: &[f32],
    ) -> Result<Vec<f32>, RingError> {
        let shape = self.shape;
        check("Q/K/V", qkv.len(), shape.qkv_len())?;
        check("context", ctx.len(), shape.ctx_len())?;
        check("context gradient", dctx.len(), shape.ctx_len())?;
        check("log-sum-exp", lse.len(), shape.lse_len())?;
        let rows = Rows {
            dctx,
            lse,
            delta: &row_dots(ctx, dctx, shape),
        };
        let mut kv = pack_kv(qkv, shape);
        let mut dkv = vec![0.0; kv.len()];
        let mut dqkv = vec![0.0; shape.qkv_len()];
        let mut scratch = Scratch::default();
        for step in 0..self.size() {
            let shift = self.shift_start(step, &kv, TAG_KV)?;
            let grads = (&mut dqkv[..], &mut dkv[..]);
            self.attend_backward(qkv, &kv, self.owner(step), rows, grads, &mut scratch);
            if let Some(shift) = shift {
                shift.finish(self.comm, &mut kv)?;
            }
            if self.size() > 1 {
                Shift::start(self.comm, &dkv, TAG_DKV)?.finish(self.comm, &mut dkv)?;
            }
        }
        add_kv(&mut dqkv, &dkv, shape);
        Ok(dqkv)
    }

    /// Starts passing the keys and values of `step` on, unless it is the last step.
    fn shift_start(&self, step: usize, kv: &[f32], tag: u16) -> Result<Option<Shift>, RingError> {
        if step + 1 < self.size() {
            Ok(Some(Shift::start(self.comm, kv, tag)?))
        } else {
            Ok(None)
        }
    }

    /// This rank's queries against the keys and values `kv` of rank `owner`: the context
    /// (normalized over these keys) and log-sum-exp into `out`.
    fn attend(
        &self,
        qkv: &[f32],
        kv: &[f32],
        owner: usize,
        out: (&mut [f32], &mut [f32]),
        scratch: &mut Scratch,
    ) {
        let (ctx, lse) = out;
        let s = self.shape;
        for b in 0..s.batch {
            let mask = self.mask(b, owner);
            for h in 0..s.heads {
                let q = Matrix::new(qkv, q_view(s, b, h));
                let [k, v] = [0, 1].map(|part| Matrix::new(kv, kv_view(s, b, h, part)));
                let z = &mut lse[lse_range(s, b, h)];
                let o = ctx_view(s, b, h);
                pair_forward(q, k, v, &mask, s.scale(), ctx, o, z, scratch);
            }
        }
    }

    /// The backward pass of [`attend`](Self::attend): adds the gradient of this rank's queries
    /// to `grads.0` (fused layout) and of the visiting keys and values to `grads.1` (packed).
    fn attend_backward(
        &self,
        qkv: &[f32],
        kv: &[f32],
        owner: usize,
        rows: Rows,
        grads: (&mut [f32], &mut [f32]),
        scratch: &mut Scratch,
    ) {
        let (dqkv, dkv) = grads;
        let s = self.shape;
        for b in 0..s.batch {
            let mask = self.mask(b, owner);
            for h in 0..s.heads {
                let q = Matrix::new(qkv, q_view(s, b, h));
                let [k, v] = [0, 1].map(|part| Matrix::new(kv, kv_view(s, b, h, part)));
                let dout = Matrix::new(rows.dctx, ctx_view(s, b, h));
                let range = lse_range(s, b, h);
                let [dk, dv] = [0, 1].map(|part| kv_view(s, b, h, part));
                let mut g = Grads::split(dqkv, q_view(s, b, h), dkv, dk, dv);
                let (lse, delta) = (&rows.lse[range.clone()], &rows.delta[range]);
                pair_backward(q, k, v, dout, lse, delta, &mask, s.scale(), &mut g, scratch);
            }
        }
    }
}

/// The per-query inputs of the backward pass: the context gradient, and each query's final
/// log-sum-exp and `D = rowsum(dctx ∘ ctx)` (`[batch, heads, n]`).
#[derive(Clone, Copy)]
struct Rows<'a> {
    dctx: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
}

/// Errs unless a buffer holds `expected` values.
fn check(what: &'static str, got: usize, expected: usize) -> Result<(), RingError> {
    if got == expected {
        Ok(())
    } else {
        Err(RingError::Size {
            what,
            got,
            expected,
        })
    }
}

/// A buffer on its way to the next rank of the ring while the previous rank's arrives.
struct Shift {
    sending: Box<dyn Pending>,
    received: Option<Vec<f32>>,
    tag: u16,
}

impl Shift {
    /// Starts sending a copy of `buf` to the next rank; an odd rank first receives the
    /// previous rank's buffer (of the same length).
    fn start(comm: &dyn Communicator, buf: &[f32], tag: u16) -> Result<Self, CommError> {
        let (rank, size) = (comm.rank(), comm.size());
        let received = if rank % 2 == 1 {
            let mut incoming = vec![0.0; buf.len()];
            comm.recv(&mut incoming, (rank + size - 1) % size, tag)?;
            Some(incoming)
        } else {
            None
        };
        let sending = comm.send_start(buf.to_vec(), (rank + 1) % size, tag)?;
        Ok(Self {
            sending,
            received,
            tag,
        })
    }

    /// Puts the previous rank's buffer in `buf` and completes the send.
    fn finish(self, comm: &dyn Communicator, buf: &mut Vec<f32>) -> Result<(), CommError> {
        let (rank, size) = (comm.rank(), comm.size());
        match self.received {
            Some(incoming) => *buf = incoming,
            None => comm.recv(buf, (rank + size - 1) % size, self.tag)?,
        }
        self.sending.wait()?;
        Ok(())
    }
}

/// Values per token of Q, K or V: `heads * head_dim`.
fn width(s: Shape) -> usize {
    s.heads * s.head_dim
}

/// Head `h` of the queries of sequence `b` in the fused Q/K/V buffer.
fn q_view(s: Shape, b: usize, h: usize) -> View {
    let w = width(s);
    View::new(
        b * s.seq * 3 * w + h * s.head_dim,
        s.seq,
        s.head_dim,
        3 * w,
        1,
    )
}

/// Head `h` of the keys (`part` 0) or values (1) of sequence `b` in the packed K/V buffer.
fn kv_view(s: Shape, b: usize, h: usize, part: usize) -> View {
    let w = width(s);
    let offset = b * s.seq * 2 * w + part * w + h * s.head_dim;
    View::new(offset, s.seq, s.head_dim, 2 * w, 1)
}

/// Head `h` of sequence `b` in the context (`[batch, n, heads, head_dim]`).
fn ctx_view(s: Shape, b: usize, h: usize) -> View {
    let w = width(s);
    View::new(b * s.seq * w + h * s.head_dim, s.seq, s.head_dim, w, 1)
}

/// Head `h` of sequence `b` in the log-sum-exp (`[batch, heads, n]`).
fn lse_range(s: Shape, b: usize, h: usize) -> std::ops::Range<usize> {
    let start = (b * s.heads + h) * s.seq;
    start..start + s.seq
}

/// The keys and values of the fused buffer, packed per token (`[batch, n, 2, heads,
/// head_dim]`): the message that travels around the ring.
fn pack_kv(qkv: &[f32], s: Shape) -> Vec<f32> {
    let w = width(s);
    qkv.chunks_exact(3 * w)
        .flat_map(|token| &token[w..])
        .copied()
        .collect()
}

/// Adds the packed gradient of the keys and values to their place in the fused gradient.
fn add_kv(dqkv: &mut [f32], dkv: &[f32], s: Shape) {
    let w = width(s);
    for (token, g) in dqkv.chunks_exact_mut(3 * w).zip(dkv.chunks_exact(2 * w)) {
        for (x, y) in token[w..].iter_mut().zip(g) {
            *x += y;
        }
    }
}

/// `D = rowsum(dctx ∘ ctx)` of every query and head, `[batch, heads, n]`.
fn row_dots(ctx: &[f32], dctx: &[f32], s: Shape) -> Vec<f32> {
    let mut out = vec![0.0; s.lse_len()];
    for b in 0..s.batch {
        for h in 0..s.heads {
            let o = ctx_view(s, b, h);
            for (i, x) in out[lse_range(s, b, h)].iter_mut().enumerate() {
                let at = o.offset + i * o.rs;
                let (a, g) = (&ctx[at..at + s.head_dim], &dctx[at..at + s.head_dim]);
                *x = a.iter().zip(g).map(|(a, g)| a * g).sum();
            }
        }
    }
    out
}

/// Bits of a segment id per value sent: each is an integer below `2^16`, exact in `f32`.
const SEGMENT_BITS: u32 = 16;
/// Values per segment id.
const SEGMENT_PARTS: usize = (i64::BITS / SEGMENT_BITS) as usize;

/// Every rank's segment ids, by rank (one all-gather; the ids travel as `f32` pieces of 16
/// bits each, so any `i64` arrives exactly).
pub(super) fn gather_segments(
    comm: &dyn Communicator,
    mine: &[i64],
) -> Result<Vec<Vec<i64>>, CommError> {
    let send: Vec<f32> = mine.iter().flat_map(|&id| encode(id)).collect();
    let mut all = vec![0.0; send.len() * comm.size()];
    comm.all_gather(&send, &mut all)?;
    let per_rank = send.len().max(1);
    Ok(all
        .chunks(per_rank)
        .map(|part| part.chunks_exact(SEGMENT_PARTS).map(decode).collect())
        .chain(std::iter::repeat_with(Vec::new))
        .take(comm.size())
        .collect())
}

/// A segment id as [`SEGMENT_PARTS`] exact `f32` values, low bits first.
fn encode(id: i64) -> [f32; SEGMENT_PARTS] {
    let bits = id as u64;
    let mask = (1u64 << SEGMENT_BITS) - 1;
    std::array::from_fn(|i| ((bits >> (i as u32 * SEGMENT_BITS)) & mask) as f32)
}

/// The segment id [`encode`] cut into pieces.
fn decode(parts: &[f32]) -> i64 {
    let bits = parts.iter().enumerate().fold(0u64, |acc, (i, &p)| {
        acc | ((p as u64) << (i as u32 * SEGMENT_BITS))
    });
    bits as i64
}

#[cfg(test)]
mod tests;
