//! Blockwise (flash-style) multi-head attention, forward and backward, keeping only each query
//! row's log-sum-exp for the backward pass: no `[seq, seq]` matrix is ever stored, the scratch
//! is a few blocks.
//!
//! The forward pass walks, per head, blocks of [`BLOCK`] query rows against blocks of
//! [`BLOCK`] keys ([`SMALL_BLOCK`] on short causal sequences) with an online softmax (a
//! running row maximum and sum; the partial context is rescaled when the maximum grows) and
//! writes the normalized context and the natural log-sum-exp of the row's scaled scores. The
//! backward pass recomputes each block's probabilities from it, `P = exp(S scale - lse)`, and
//! adds the block's share of the gradients: `dV += Pᵀ dO`, `dP = dO Vᵀ`,
//! `dS = P ∘ (dP - D)` with `D = rowsum(dO ∘ O)`, `dQ += scale dS K`,
//! `dK += scale dSᵀ Q`. Key blocks a [`Mask`] hides entirely from a query block are skipped;
//! blocks it hides partly get `-inf` scores where it hides them.
//!
//! Two levels:
//! - [`forward`] and [`backward`] on the fused Q/K/V layout of self-attention (the layout the
//!   CPU backend's [`FusedOps`](crate::kernels::FusedOps) uses).
//! - [`pair_forward`], [`pair_backward`] and [`merge`] for one head, one set of queries and
//!   one set of keys and values, anywhere in memory (strided [`View`]s), with global token
//!   positions and segment ids: what a ring of context parallelism runs per step. Two partial
//!   results over disjoint key sets merge exactly into the result over their union, and the
//!   backward pass of each pair given the *final* log-sum-exp and `D` sums to the whole
//!   backward pass.
//!
//! A query row that sees no key (all masked) has context 0 and log-sum-exp `-inf`, merges
//! exactly, and gets and gives no gradient.
//!
//! Layouts (row-major): `qkv` is `[batch, seq, 3, heads, head_dim]` (the output of a fused
//! column-parallel projection: all query heads, then all key heads, then all value heads),
//! `ctx` is `[batch, seq, heads, head_dim]`, the log-sum-exp is `[batch, heads, seq]`.

use super::gemm::{View, matmul};
use super::math::{exp, max, simd, sum};

/// Query rows and keys per block.
pub const BLOCK: usize = 128;
/// Query rows and keys per block under a causal mask where both sides have at most
/// [`SMALL_SIDES`] tokens: finer blocks skip more of the hidden scores, which outweighs the
/// extra calls there (measured; without a mask or on longer sides the larger blocks are faster).
pub const SMALL_BLOCK: usize = 64;
/// See [`SMALL_BLOCK`].
pub const SMALL_SIDES: usize = 256;

/// The block size for `m` queries and `n` keys.
fn block_size(m: usize, n: usize, causal: bool) -> usize {
    if causal && m.max(n) <= SMALL_SIDES {
        SMALL_BLOCK
    } else {
        BLOCK
    }
}

/// The shape of one self-attention call on the fused layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Heads (on this rank).
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

impl Shape {
    /// Elements of the Q/K/V buffer.
    pub fn qkv_len(&self) -> usize {
        self.batch * self.seq * 3 * self.heads * self.head_dim
    }

    /// Elements of the context.
    pub fn ctx_len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// Elements of the log-sum-exp (`[batch, heads, seq]`).
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq
    }

    /// The `1 / sqrt(head_dim)` scale of the scores.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Row stride of Q, K or V (one token's worth of the fused buffer).
    fn qkv_rs(&self) -> usize {
        3 * self.heads * self.head_dim
    }

    /// Views of head `h`'s Q, K and V in sequence `b` of the fused buffer.
    fn qkv_views(&self, b: usize, h: usize) -> [View; 3] {
        let (rs, d) = (self.qkv_rs(), self.head_dim);
        let base = b * self.seq * rs + h * d;
        let part = self.heads * d;
        [0, 1, 2].map(|i| View::new(base + i * part, self.seq, d, rs, 1))
    }

    /// View of head `h` of sequence `b` in the context.
    fn ctx_view(&self, b: usize, h: usize) -> View {
        let hd = self.heads * self.head_dim;
        View::new(
            (b * self.seq * self.heads + h) * self.head_dim,
            self.seq,
            self.head_dim,
            hd,
            1,
        )
    }

    /// Range of head `h` of sequence `b` in the log-sum-exp.
    fn lse_range(&self, b: usize, h: usize) -> std::ops::Range<usize> {
        let start = (b * self.heads + h) * self.seq;
        start..start + self.seq
    }
}

/// The global positions of a set of tokens (what a causal mask compares).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positions<'a> {
    /// Token `i` is at position `start + i`.
    From(usize),
    /// Token `i` is at position `list[i]` (any order: a zigzag shard of context parallelism
    /// holds two chunks `c` and `2 cp - 1 - c` of each sequence).
    List(&'a [usize]),
}

impl Positions<'_> {
    /// The position of token `i`.
    #[inline(always)]
    fn at(&self, i: usize) -> usize {
        match *self {
            Positions::From(start) => start + i,
            Positions::List(list) => list[i],
        }
    }

    /// The smallest and largest position of tokens `i0..i1` (`i0 < i1`).
    fn bounds(&self, i0: usize, i1: usize) -> (usize, usize) {
        match *self {
            Positions::From(start) => (start + i0, start + i1 - 1),
            Positions::List(list) => list[i0..i1]
                .iter()
                .fold((usize::MAX, 0), |(lo, hi), &p| (lo.min(p), hi.max(p))),
        }
    }
}

/// One side of an attention (its queries or its keys): positions and, optionally, segment ids
/// (documents packed into one sequence; a query sees only keys of its own segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokens<'a> {
    /// Global positions.
    pub positions: Positions<'a>,
    /// Segment id of each token, or `None`: one segment.
    pub segments: Option<&'a [i64]>,
}

impl Tokens<'_> {
    /// Tokens at positions `0, 1, ..`, one segment.
    pub const PLAIN: Tokens<'static> = Tokens {
        positions: Positions::From(0),
        segments: None,
    };
}

/// Which keys each query sees: key `j` is visible to query `i` when, with `causal`,
/// `position(j) <= position(i)`, and, where segment ids are given (on both sides, or on
/// neither), `segment(j) == segment(i)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask<'a> {
    /// Whether a query sees only keys at its position or before.
    pub causal: bool,
    /// The queries.
    pub queries: Tokens<'a>,
    /// The keys (and values).
    pub keys: Tokens<'a>,
}

impl<'a> Mask<'a> {
    /// Self-attention: queries and keys are the same tokens.
    pub fn within(causal: bool, tokens: Tokens<'a>) -> Self {
        Self {
            causal,
            queries: tokens,
            keys: tokens,
        }
    }

    /// Panics unless the positions and segments cover `rows` queries and `cols` keys.
    fn check(&self, rows: usize, cols: usize) {
        for (side, n, what) in [(self.queries, rows, "queries"), (self.keys, cols, "keys")] {
            if let Positions::List(list) = side.positions {
                assert_eq!(list.len(), n, "attention mask: positions of the {what}");
            }
            if let Some(s) = side.segments {
                assert_eq!(s.len(), n, "attention mask: segments of the {what}");
            }
        }
        assert_eq!(
            self.queries.segments.is_some(),
            self.keys.segments.is_some(),
            "attention mask: segment ids on one side only"
        );
    }

    /// The summaries of blocks of `step` tokens of one side (`n` tokens).
    fn spans(side: Tokens, n: usize, step: usize) -> Vec<Span> {
        (0..n)
            .step_by(step)
            .map(|i0| {
                let i1 = (i0 + step).min(n);
                let segments = side.segments.map(|s| {
                    s[i0..i1]
                        .iter()
                        .fold((i64::MAX, i64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
                });
                Span {
                    start: i0,
                    end: i1,
                    positions: side.positions.bounds(i0, i1),
                    segments,
                }
            })
            .collect()
    }

    /// How much of key block `k` query block `q` sees.
    fn cover(&self, q: &Span, k: &Span) -> Cover {
        let mut full = true;
        if self.causal {
            if k.positions.0 > q.positions.1 {
                return Cover::None;
            }
            full &= k.positions.1 <= q.positions.0;
        }
        if let (Some(qs), Some(ks)) = (q.segments, k.segments) {
            if qs.1 < ks.0 || ks.1 < qs.0 {
                return Cover::None;
            }
            full &= qs.0 == qs.1 && ks.0 == ks.1 && qs.0 == ks.0;
        }
        if full { Cover::Full } else { Cover::Partial }
    }

    /// Sets the scores of block `q` x `k` (`[q rows, k cols]`, dense) that the mask hides to
    /// `-inf`. With positions `From` on both sides, a causal row hides a suffix of the block.
    fn apply(&self, scores: &mut [f32], q: &Span, k: &Span) {
        let n = k.end - k.start;
        let ranges = match (self.queries.positions, self.keys.positions) {
            (Positions::From(qs), Positions::From(ks)) if self.causal => Some((qs, ks)),
            _ => None,
        };
        let by_position = self.causal && ranges.is_none();
        let segments = match (self.queries.segments, self.keys.segments) {
            (Some(qs), Some(ks)) => Some((qs, ks)),
            _ => None,
        };
        for (i, row) in (q.start..q.end).zip(scores.chunks_exact_mut(n)) {
            let live = match ranges {
                // Key `j` is visible while `ks + j <= qs + i`.
                Some((qs, ks)) => {
                    let visible = (qs + i + 1).saturating_sub(ks + k.start).min(n);
                    let (live, dead) = row.split_at_mut(visible);
                    dead.fill(f32::NEG_INFINITY);
                    live
                }
                None => row,
            };
            if segments.is_none() && !by_position {
                continue;
            }
            for (j, s) in (k.start..).zip(live.iter_mut()) {
                let hidden = (by_position
                    && self.keys.positions.at(j) > self.queries.positions.at(i))
                    || segments.is_some_and(|(qs, ks)| qs[i] != ks[j]);
                if hidden {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// A block of tokens of one side: its index range, smallest and largest position and segment.
#[derive(Clone, Copy, Debug)]
struct Span {
    start: usize,
    end: usize,
    positions: (usize, usize),
    segments: Option<(i64, i64)>,
}

/// How much of a key block a query block sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cover {
    /// Nothing: the block is skipped.
    None,
    /// Everything: no masking.
    Full,
    /// Some: scores masked one by one.
    Partial,
}

/// A matrix in a buffer.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// The buffer.
    pub buf: &'a [f32],
    /// Where the matrix lies in it.
    pub view: View,
}

impl<'a> Matrix<'a> {
    /// The matrix `view` of `buf`.
    pub fn new(buf: &'a [f32], view: View) -> Self {
        Self { buf, view }
    }

    /// Rows `r0..r1`.
    fn rows(&self, r0: usize, r1: usize) -> View {
        rows(self.view, r0, r1)
    }
}

/// Rows `r0..r1` of a view.
fn rows(v: View, r0: usize, r1: usize) -> View {
    View::new(v.offset + r0 * v.rs, r1 - r0, v.cols, v.rs, v.cs)
}

/// Where [`pair_backward`] adds the gradients of Q, K and V: views in one buffer (the fused
/// layout), or dQ in one buffer and dK, dV in another (as a ring sends the key and value
/// gradients back to their owner).
#[derive(Debug)]
pub struct Grads<'a> {
    q_buf: &'a mut [f32],
    kv_buf: Option<&'a mut [f32]>,
    /// The gradient of Q.
    pub dq: View,
    /// The gradient of K.
    pub dk: View,
    /// The gradient of V.
    pub dv: View,
}

impl<'a> Grads<'a> {
    /// All three gradients in `buf`.
    pub fn fused(buf: &'a mut [f32], dq: View, dk: View, dv: View) -> Self {
        Self {
            q_buf: buf,
            kv_buf: None,
            dq,
            dk,
            dv,
        }
    }

    /// dQ in `q_buf`, dK and dV in `kv_buf`.
    pub fn split(
        q_buf: &'a mut [f32],
        dq: View,
        kv_buf: &'a mut [f32],
        dk: View,
        dv: View,
    ) -> Self {
        Self {
            q_buf,
            kv_buf: Some(kv_buf),
            dq,
            dk,
            dv,
        }
    }

    fn q(&mut self) -> &mut [f32] {
        self.q_buf
    }

    fn kv(&mut self) -> &mut [f32] {
        match &mut self.kv_buf {
            Some(b) => b,
            None => self.q_buf,
        }
    }
}

/// Block-sized work space of [`pair_forward`] and [`pair_backward`], kept across calls (it
/// grows to the largest blocks seen; nothing in it needs clearing).
#[derive(Debug, Default)]
pub struct Scratch {
    s: Vec<f32>,
    t: Vec<f32>,
}

impl Scratch {
    /// Two buffers of at least `a` and `b` elements.
    fn take(&mut self, a: usize, b: usize) -> (&mut [f32], &mut [f32]) {
        for (v, n) in [(&mut self.s, a), (&mut self.t, b)] {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        }
        (&mut self.s[..a], &mut self.t[..b])
    }
}

/// One block's online-softmax step over its scores `s` (`[rows, n]`, dense, masked ones
/// `-inf`): updates each row's running maximum `m` and sum `l`, writes the rescaling factor of
/// the row's earlier partial context in `alpha` and the unnormalized probabilities
/// `exp(s - m)` over `s`. A row that has seen no visible key keeps `m = -inf`, `l = 0` and
/// gets probabilities 0.
#[inline(always)]
fn online_rows(s: &mut [f32], n: usize, m: &mut [f32], l: &mut [f32], alpha: &mut [f32]) {
    for (((row, m), l), a) in s.chunks_exact_mut(n).zip(m).zip(l).zip(alpha) {
        let m_new = m.max(max(row));
        if m_new == f32::NEG_INFINITY {
            row.fill(0.0);
            *a = 1.0;
            continue;
        }
        for x in row.iter_mut() {
            *x = exp(*x - m_new);
        }
        *a = exp(*m - m_new);
        *l = l.mul_add(*a, sum(row));
        *m = m_new;
    }
}

/// Attention of one head: the queries `q` (`[m, d]`) against the keys `k` (`[n, d]`) and
/// values `v` (`[n, dv]`) under `mask`, scores scaled by `scale`. Writes the context
/// (normalized over the keys given) into the view `o` (`[m, dv]`) of `out` and each query's
/// log-sum-exp of its scaled visible scores into `lse` (`m` values; `-inf`, with context 0,
/// for a query that sees none of these keys). Results over disjoint key sets combine with
/// [`merge`]. `scratch` is work space, for reuse across calls.
#[allow(clippy::too_many_arguments)]
pub fn pair_forward(
    q: Matrix,
    k: Matrix,
    v: Matrix,
    mask: &Mask,
    scale: f32,
    out: &mut [f32],
    o: View,
    lse: &mut [f32],
    scratch: &mut Scratch,
) {
    let (m, n, d, dv) = (q.view.rows, k.view.rows, q.view.cols, v.view.cols);
    assert!(
        k.view.cols == d && v.view.rows == n && o.rows == m && o.cols == dv && lse.len() == m,
        "attention forward: shapes"
    );
    mask.check(m, n);
    o.check(out.len());
    let block = block_size(m, n, mask.causal);
    let q_spans = Mask::spans(mask.queries, m, block);
    let k_spans = Mask::spans(mask.keys, n, block);
    let (bq, bk) = (block.min(m), block.min(n));
    let (s, acc) = scratch.take(bq * bk, bq * dv);
    let (mut rmax, mut rsum, mut alpha) = ([0.0f32; BLOCK], [0.0f32; BLOCK], [0.0f32; BLOCK]);
    for qs in &q_spans {
        let (r0, r1) = (qs.start, qs.end);
        let rows_q = r1 - r0;
        let qv = q.rows(r0, r1);
        rmax[..rows_q].fill(f32::NEG_INFINITY);
        rsum[..rows_q].fill(0.0);
        acc[..rows_q * dv].fill(0.0);
        for ks in &k_spans {
            let cover = mask.cover(qs, ks);
            if cover == Cover::None {
                continue;
            }
            let cols = ks.end - ks.start;
            let sv = View::new(0, rows_q, cols, cols, 1);
            block_scores(s, sv, (q, qv), k, ks, scale);
            let sb = &mut s[..rows_q * cols];
            if cover == Cover::Partial {
                mask.apply(sb, qs, ks);
            }
            let (m_, l_, a_) = (
                &mut rmax[..rows_q],
                &mut rsum[..rows_q],
                &mut alpha[..rows_q],
            );
            let acc_rows = &mut acc[..rows_q * dv];
            simd(
                #[inline(always)]
                || {
                    online_rows(sb, cols, m_, l_, a_);
                    rescale_rows(acc_rows, dv, a_);
                },
            );
            matmul(
                acc,
                View::new(0, rows_q, dv, dv, 1),
                s,
                sv,
                v.buf,
                v.rows(ks.start, ks.end),
                1.0,
                true,
            );
        }
        let rows = RowStats {
            max: &rmax[..rows_q],
            sum: &rsum[..rows_q],
        };
        write_rows(&acc[..rows_q * dv], rows, r0, out, o, &mut lse[r0..r1]);
    }
}

/// The scaled scores of a block of query rows (`q`'s `qv`) against the keys `ks`, into `s`
/// at `sv`.
#[inline(always)]
fn block_scores(
    s: &mut [f32],
    sv: View,
    (q, qv): (Matrix<'_>, View),
    k: Matrix<'_>,
    ks: &Span,
    scale: f32,
) {
    matmul(
        s,
        sv,
        q.buf,
        qv,
        k.buf,
        k.rows(ks.start, ks.end).t(),
        scale,
        false,
    );
}

/// A block of query rows' running maximum and sum of exponentials.
#[derive(Clone, Copy)]
struct RowStats<'a> {
    max: &'a [f32],
    sum: &'a [f32],
}

/// Multiplies each row of `acc` (rows of `dv` values) by its factor in `alpha`.
#[inline(always)]
fn rescale_rows(acc: &mut [f32], dv: usize, alpha: &[f32]) {
    for (row, &a) in acc.chunks_exact_mut(dv.max(1)).zip(alpha) {
        if a != 1.0 {
            for x in row.iter_mut() {
                *x *= a;
            }
        }
    }
}

/// Writes the rows `r0..` of the context (`acc` divided by each row's sum) into the view `o`
/// of `out`, and each row's log-sum-exp into `lse`: 0 and `-inf` for a row that saw no key.
fn write_rows(acc: &[f32], rows: RowStats, r0: usize, out: &mut [f32], o: View, lse: &mut [f32]) {
    let dv = o.cols;
    for (i, z) in lse.iter_mut().enumerate() {
        let l = rows.sum[i];
        let (inv, value) = if l > 0.0 {
            (1.0 / l, rows.max[i] + l.ln())
        } else {
            (0.0, f32::NEG_INFINITY)
        };
        *z = value;
        let base = o.offset + (r0 + i) * o.rs;
        for (e, &x) in acc[i * dv..(i + 1) * dv].iter().enumerate() {
            out[base + e * o.cs] = x * inv;
        }
    }
}

/// The backward pass of [`pair_forward`] for one head: adds to `grads` the gradients of the
/// queries, keys and values from the context gradient `dout` (`[m, dv]`), given each query's
/// *final* log-sum-exp `lse` (over all the keys it attends to, across pairs) and
/// `delta = rowsum(dout ∘ out)` of the final context (`m` values each). Called for every
/// pair, the additions sum to the whole backward pass. A query with `lse = -inf` gets and
/// gives no gradient. `scratch` is work space, for reuse across calls.
#[allow(clippy::too_many_arguments)]
pub fn pair_backward(
    q: Matrix,
    k: Matrix,
    v: Matrix,
    dout: Matrix,
    lse: &[f32],
    delta: &[f32],
    mask: &Mask,
    scale: f32,
    grads: &mut Grads,
    scratch: &mut Scratch,
) {
    let (m, n, d, dv) = (q.view.rows, k.view.rows, q.view.cols, v.view.cols);
    assert!(
        k.view.cols == d
            && v.view.rows == n
            && dout.view.rows == m
            && dout.view.cols == dv
            && lse.len() == m
            && delta.len() == m,
        "attention backward: shapes"
    );
    assert!(
        (grads.dq.rows, grads.dq.cols) == (m, d)
            && (grads.dk.rows, grads.dk.cols) == (n, d)
            && (grads.dv.rows, grads.dv.cols) == (n, dv),
        "attention backward: gradient shapes"
    );
    mask.check(m, n);
    let block = block_size(m, n, mask.causal);
    let q_spans = Mask::spans(mask.queries, m, block);
    let k_spans = Mask::spans(mask.keys, n, block);
    let (bq, bk) = (block.min(m), block.min(n));
    let (s, dp) = scratch.take(bq * bk, bq * bk);
    for ks in &k_spans {
        let (c0, c1) = (ks.start, ks.end);
        let cols = c1 - c0;
        let (kb, vb) = (k.rows(c0, c1), v.rows(c0, c1));
        for qs in &q_spans {
            let cover = mask.cover(qs, ks);
            if cover == Cover::None {
                continue;
            }
            let (r0, r1) = (qs.start, qs.end);
            let rows_q = r1 - r0;
            let (qb, dob) = (q.rows(r0, r1), dout.rows(r0, r1));
            let sv = View::new(0, rows_q, cols, cols, 1);
            matmul(s, sv, q.buf, qb, k.buf, kb.t(), scale, false);
            let sb = &mut s[..rows_q * cols];
            if cover == Cover::Partial {
                mask.apply(sb, qs, ks);
            }
            let lse_b = &lse[r0..r1];
            simd(
                #[inline(always)]
                || probabilities_from_lse(sb, cols, lse_b),
            );
            let dvb = rows(grads.dv, c0, c1);
            matmul(grads.kv(), dvb, s, sv.t(), dout.buf, dob, 1.0, true);
            matmul(dp, sv, dout.buf, dob, v.buf, vb.t(), 1.0, false);
            let (pb, db) = (&s[..rows_q * cols], &mut dp[..rows_q * cols]);
            let delta_b = &delta[r0..r1];
            simd(
                #[inline(always)]
                || score_gradients(pb, db, cols, delta_b),
            );
            let dqb = rows(grads.dq, r0, r1);
            matmul(grads.q(), dqb, dp, sv, k.buf, kb, scale, true);
            let dkb = rows(grads.dk, c0, c1);
            matmul(grads.kv(), dkb, dp, sv.t(), q.buf, qb, scale, true);
        }
    }
}

/// Scores (rows of `cols`) to probabilities in place, `exp(score - lse)` with each row's final
/// log-sum-exp; a row with `lse = -inf` (it saw no key) to zeros.
#[inline(always)]
fn probabilities_from_lse(scores: &mut [f32], cols: usize, lse: &[f32]) {
    for (row, &z) in scores.chunks_exact_mut(cols).zip(lse) {
        if z == f32::NEG_INFINITY {
            row.fill(0.0);
        } else {
            for x in row.iter_mut() {
                *x = exp(*x - z);
            }
        }
    }
}

/// The softmax backward pass in place over `dp` (rows of `cols`): `dS = P ∘ (dP - delta)`.
#[inline(always)]
fn score_gradients(p: &[f32], dp: &mut [f32], cols: usize, delta: &[f32]) {
    let rows = p.chunks_exact(cols).zip(dp.chunks_exact_mut(cols));
    for ((pr, gr), &c) in rows.zip(delta) {
        for (g, &pv) in gr.iter_mut().zip(pr) {
            *g = pv * (*g - c);
        }
    }
}

/// `a = merge(a, b)` of two partial results over disjoint key sets for the same queries, in
/// the fused layouts (`out` `[batch, seq, heads, head_dim]`, `lse` `[batch, heads, seq]`):
/// `lse = log(exp(lse_a) + exp(lse_b))`, `out = exp(lse_a - lse) out_a + exp(lse_b - lse)
/// out_b`. Exact where one side is `-inf` (it contributes nothing); 0 and `-inf` where both
/// are.
pub fn merge(shape: Shape, out: &mut [f32], lse: &mut [f32], out_b: &[f32], lse_b: &[f32]) {
    assert!(
        out.len() == shape.ctx_len()
            && out_b.len() == shape.ctx_len()
            && lse.len() == shape.lse_len()
            && lse_b.len() == shape.lse_len(),
        "attention merge: sizes"
    );
    let d = shape.head_dim;
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let o = shape.ctx_view(b, h);
            for (i, z) in shape.lse_range(b, h).enumerate() {
                let at = o.offset + i * o.rs;
                let (za, zb) = (lse[z], lse_b[z]);
                let top = za.max(zb);
                let (wa, wb, total) = if top == f32::NEG_INFINITY {
                    (0.0, 0.0, f32::NEG_INFINITY)
                } else {
                    let total = top + (za.min(zb) - top).exp().ln_1p();
                    ((za - total).exp(), (zb - total).exp(), total)
                };
                lse[z] = total;
                for (x, &y) in out[at..at + d].iter_mut().zip(&out_b[at..at + d]) {
                    *x = if wb == 0.0 {
                        wa * *x
                    } else if wa == 0.0 {
                        wb * y
                    } else {
                        wa.mul_add(*x, wb * y)
                    };
                }
            }
        }
    }
}

/// The mask of self-attention on the fused layout: causal or not, each sequence's tokens at
/// `positions`, and optional segment ids (`[batch, seq]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelfMask<'a> {
    /// Whether a token sees only itself and earlier tokens.
    pub causal: bool,
    /// The positions of each sequence's tokens (the same for every sequence).
    pub positions: Positions<'a>,
    /// Segment ids, `[batch, seq]`: a token sees only tokens of its own segment.
    pub segments: Option<&'a [i64]>,
}

impl SelfMask<'_> {
    /// The mask of sequence `b`.
    fn of(&self, b: usize, seq: usize) -> Mask<'_> {
        Mask::within(
            self.causal,
            Tokens {
                positions: self.positions,
                segments: self.segments.map(|s| &s[b * seq..(b + 1) * seq]),
            },
        )
    }

    fn check(&self, shape: Shape) {
        if let Some(s) = self.segments {
            assert_eq!(
                s.len(),
                shape.batch * shape.seq,
                "attention: segment ids size"
            );
        }
    }
}

/// Forward on the fused layout: writes the context (`shape.ctx_len()` elements) and the
/// log-sum-exp (`shape.lse_len()`), which the backward pass needs.
pub fn forward(qkv: &[f32], shape: Shape, mask: SelfMask, ctx: &mut [f32], lse: &mut [f32]) {
    assert_eq!(qkv.len(), shape.qkv_len(), "attention forward: Q/K/V size");
    assert_eq!(
        ctx.len(),
        shape.ctx_len(),
        "attention forward: context size"
    );
    assert_eq!(lse.len(), shape.lse_len(), "attention forward: lse size");
    mask.check(shape);
    let mut scratch = Scratch::default();
    for b in 0..shape.batch {
        let m = mask.of(b, shape.seq);
        for h in 0..shape.heads {
            let [q, k, v] = shape.qkv_views(b, h).map(|v| Matrix::new(qkv, v));
            let o = shape.ctx_view(b, h);
            let z = &mut lse[shape.lse_range(b, h)];
            pair_forward(q, k, v, &m, shape.scale(), ctx, o, z, &mut scratch);
        }
    }
}

/// Backward on the fused layout: from the context `ctx` and log-sum-exp `lse` of the forward
/// pass and the context gradient `dctx`, adds the Q/K/V gradient to `dqkv`
/// (`shape.qkv_len()` elements; pass zeros for the gradient itself).
pub fn backward(
    qkv: &[f32],
    ctx: &[f32],
    lse: &[f32],
    dctx: &[f32],
    shape: Shape,
    mask: SelfMask,
    dqkv: &mut [f32],
) {
    assert_eq!(qkv.len(), shape.qkv_len(), "attention backward: Q/K/V size");
    assert_eq!(
        dqkv.len(),
        shape.qkv_len(),
        "attention backward: gradient size"
    );
    assert_eq!(
        ctx.len(),
        shape.ctx_len(),
        "attention backward: context size"
    );
    assert_eq!(
        dctx.len(),
        shape.ctx_len(),
        "attention backward: context gradient size"
    );
    assert_eq!(lse.len(), shape.lse_len(), "attention backward: lse size");
    mask.check(shape);
    let d = shape.head_dim;
    let mut delta = vec![0.0f32; shape.seq];
    let mut scratch = Scratch::default();
    for b in 0..shape.batch {
        let m = mask.of(b, shape.seq);
        for h in 0..shape.heads {
            let o = shape.ctx_view(b, h);
            for (i, x) in delta.iter_mut().enumerate() {
                let at = o.offset + i * o.rs;
                let (out, g) = (&ctx[at..at + d], &dctx[at..at + d]);
                *x = out.iter().zip(g).map(|(a, b)| a * b).sum();
            }
            let views = shape.qkv_views(b, h);
            let [q, k, v] = views.map(|v| Matrix::new(qkv, v));
            let mut grads = Grads::fused(dqkv, views[0], views[1], views[2]);
            pair_backward(
                q,
                k,
                v,
                Matrix::new(dctx, o),
                &lse[shape.lse_range(b, h)],
                &delta,
                &m,
                shape.scale(),
                &mut grads,
                &mut scratch,
            );
        }
    }
}

#[cfg(test)]
mod tests;
