//! Multi-head self-attention on a fused Q/K/V buffer, forward and backward, without copying
//! the heads out: the matrix products read Q, K and V in place through strides and write the
//! context (forward) and the Q/K/V gradient (backward) in their final layouts.
//!
//! Layouts (row-major): `qkv` is `[batch, seq, 3, heads, head_dim]` (the output of a fused
//! column-parallel projection: all query heads, then all key heads, then all value heads),
//! `ctx` is `[batch, seq, heads, head_dim]`, the saved probabilities are
//! `[batch, heads, seq, seq]`.

use super::gemm::{View, matmul};
use super::math::{exp, max, simd};

/// The shape of one attention call.
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
    /// Whether a token attends only to itself and earlier tokens.
    pub causal: bool,
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

    /// Elements of the saved probabilities.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }

    /// The `1 / sqrt(head_dim)` scale of the scores.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Row stride of Q, K or V (one token's worth of the fused buffer).
    fn qkv_rs(&self) -> usize {
        3 * self.heads * self.head_dim
    }

    /// Offsets of head `h`'s Q, K and V in sequence `b`.
    fn qkv_offsets(&self, b: usize, h: usize) -> [usize; 3] {
        let base = b * self.seq * self.qkv_rs() + h * self.head_dim;
        let part = self.heads * self.head_dim;
        [base, base + part, base + 2 * part]
    }

    /// The blocks of query rows the kernels work in: with a causal mask, blocks of 32 rows, so
    /// that the scores above the diagonal's blocks are never computed (a block of rows
    /// `r0..r1` attends to keys `0..r1`); otherwise one block.
    fn row_blocks(&self) -> Vec<(usize, usize)> {
        let step = if self.causal && self.seq >= 64 {
            32
        } else {
            self.seq.max(1)
        };
        (0..self.seq)
            .step_by(step)
            .map(|r0| (r0, (r0 + step).min(self.seq)))
            .collect()
    }

    /// The keys rows `r0..r1` attend to: `0..r1` under a causal mask, all otherwise.
    fn key_end(&self, r1: usize) -> usize {
        if self.causal { r1 } else { self.seq }
    }

    /// Offset of head `h` of sequence `b` in the context.
    fn ctx_offset(&self, b: usize, h: usize) -> usize {
        (b * self.seq * self.heads + h) * self.head_dim
    }
}

/// Softmax over the first `width` columns of rows `first..` of a `[.., seq]` score block in
/// place (`scores` starts at row `first`); with `causal`, row `i` covers columns `0..=i` and
/// its columns `i + 1..width` are set to 0.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], seq: usize, first: usize, width: usize, causal: bool) {
    for (r, row) in scores.chunks_exact_mut(seq).enumerate() {
        let i = first + r;
        let row = &mut row[..width];
        let n = if causal { (i + 1).min(width) } else { width };
        let (live, dead) = row.split_at_mut(n);
        let m = max(live);
        let mut total = 0.0f32;
        for x in live.iter_mut() {
            *x = exp(*x - m);
            total += *x;
        }
        let inv = 1.0 / total;
        for x in live.iter_mut() {
            *x *= inv;
        }
        dead.fill(0.0);
    }
}

/// Forward: writes the context (`shape.ctx_len()` elements) and the attention probabilities
/// (`shape.probs_len()`), which the backward pass needs.
pub fn forward(qkv: &[f32], shape: Shape, ctx: &mut [f32], probs: &mut [f32]) {
    assert_eq!(
        qkv.len(),
        shape.qkv_len(),
        "attention forward: Q/K/V buffer size"
    );
    assert_eq!(
        ctx.len(),
        shape.ctx_len(),
        "attention forward: context size"
    );
    assert_eq!(
        probs.len(),
        shape.probs_len(),
        "attention forward: probabilities size"
    );
    let (s, d, hd) = (shape.seq, shape.head_dim, shape.heads * shape.head_dim);
    let rs = shape.qkv_rs();
    let blocks = shape.row_blocks();
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let [q, k, v] = shape.qkv_offsets(b, h);
            let p_off = (b * shape.heads + h) * s * s;
            for &(r0, r1) in &blocks {
                let (m, kend) = (r1 - r0, shape.key_end(r1));
                let p = View::new(p_off + r0 * s, m, kend, s, 1);
                let qb = View::new(q + r0 * rs, m, d, rs, 1);
                matmul(
                    probs,
                    p,
                    qkv,
                    qb,
                    qkv,
                    View::new(k, kend, d, rs, 1).t(),
                    shape.scale(),
                    false,
                );
                let rows = &mut probs[p.offset..p.offset + m * s];
                simd(
                    #[inline(always)]
                    || softmax_rows(rows, s, r0, kend, shape.causal),
                );
                let c = View::new(shape.ctx_offset(b, h) + r0 * hd, m, d, hd, 1);
                matmul(
                    ctx,
                    c,
                    probs,
                    p,
                    qkv,
                    View::new(v, kend, d, rs, 1),
                    1.0,
                    false,
                );
            }
        }
    }
}

/// `dS = P * (dP - rowsum(P * dP))` in place over `dp`, on the first `width` columns of rows
/// of length `seq`.
#[inline(always)]
fn softmax_backward_rows(p: &[f32], dp: &mut [f32], seq: usize, width: usize) {
    for (pr, gr) in p.chunks_exact(seq).zip(dp.chunks_exact_mut(seq)) {
        let (pr, gr) = (&pr[..width], &mut gr[..width]);
        let seq = width;
        let mut acc = [0.0f32; 8];
        let chunks = pr.chunks_exact(8).zip(gr.chunks_exact(8));
        for (pc, gc) in chunks {
            for l in 0..8 {
                acc[l] = pc[l].mul_add(gc[l], acc[l]);
            }
        }
        let tail = seq / 8 * 8;
        let mut c = acc.iter().sum::<f32>();
        for j in tail..seq {
            c = pr[j].mul_add(gr[j], c);
        }
        for (g, &pv) in gr.iter_mut().zip(pr) {
            *g = pv * (*g - c);
        }
    }
}

/// Backward: from the context gradient `dctx` and the saved probabilities, writes the Q/K/V
/// gradient (`shape.qkv_len()` elements, every one of them). `scratch` holds `seq * seq`
/// values.
pub fn backward(
    qkv: &[f32],
    probs: &[f32],
    dctx: &[f32],
    shape: Shape,
    dqkv: &mut [f32],
    scratch: &mut [f32],
) {
    assert_eq!(
        qkv.len(),
        shape.qkv_len(),
        "attention backward: Q/K/V buffer size"
    );
    assert_eq!(
        dqkv.len(),
        shape.qkv_len(),
        "attention backward: gradient size"
    );
    assert_eq!(
        dctx.len(),
        shape.ctx_len(),
        "attention backward: context gradient size"
    );
    let (s, d, hd) = (shape.seq, shape.head_dim, shape.heads * shape.head_dim);
    let rs = shape.qkv_rs();
    let blocks = shape.row_blocks();
    for b in 0..shape.batch {
        for h in 0..shape.heads {
            let [q, k, v] = shape.qkv_offsets(b, h);
            let p_off = (b * shape.heads + h) * s * s;
            let dout = shape.ctx_offset(b, h);
            // By query rows: dP = dO V^T, dS, dQ = scale dS K.
            for &(r0, r1) in &blocks {
                let (m, kend) = (r1 - r0, shape.key_end(r1));
                let ds = View::new(r0 * s, m, kend, s, 1);
                let dob = View::new(dout + r0 * hd, m, d, hd, 1);
                matmul(
                    scratch,
                    ds,
                    dctx,
                    dob,
                    qkv,
                    View::new(v, kend, d, rs, 1).t(),
                    1.0,
                    false,
                );
                let p_rows = &probs[p_off + r0 * s..p_off + r1 * s];
                let g_rows = &mut scratch[r0 * s..r1 * s];
                simd(
                    #[inline(always)]
                    || softmax_backward_rows(p_rows, g_rows, s, kend),
                );
                let dq = View::new(q + r0 * rs, m, d, rs, 1);
                matmul(
                    dqkv,
                    dq,
                    scratch,
                    ds,
                    qkv,
                    View::new(k, kend, d, rs, 1),
                    shape.scale(),
                    false,
                );
            }
            // By keys: dV = P^T dO and dK = scale dS^T Q, over the queries that see them.
            for &(c0, c1) in &blocks {
                let first = if shape.causal { c0 } else { 0 };
                let (n, m) = (c1 - c0, s - first);
                let pt = View::new(p_off + first * s + c0, m, n, s, 1).t();
                let dst = View::new(first * s + c0, m, n, s, 1).t();
                let dob = View::new(dout + first * hd, m, d, hd, 1);
                let qb = View::new(q + first * rs, m, d, rs, 1);
                matmul(
                    dqkv,
                    View::new(v + c0 * rs, n, d, rs, 1),
                    probs,
                    pt,
                    dctx,
                    dob,
                    1.0,
                    false,
                );
                matmul(
                    dqkv,
                    View::new(k + c0 * rs, n, d, rs, 1),
                    scratch,
                    dst,
                    qkv,
                    qb,
                    shape.scale(),
                    false,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention of one head in f64, straight from the definition: the context and, for a
    /// loss `sum(w * ctx)`, the gradients of Q, K and V.
    fn reference(
        q: &[Vec<f64>],
        k: &[Vec<f64>],
        v: &[Vec<f64>],
        w: &[Vec<f64>],
        causal: bool,
    ) -> (Vec<Vec<f64>>, [Vec<Vec<f64>>; 3]) {
        let (s, d) = (q.len(), q[0].len());
        let scale = 1.0 / (d as f64).sqrt();
        let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
        let mut p = vec![vec![0.0; s]; s];
        for i in 0..s {
            let n = if causal { i + 1 } else { s };
            let sc: Vec<f64> = (0..n).map(|j| dot(&q[i], &k[j]) * scale).collect();
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            for j in 0..n {
                p[i][j] = (sc[j] - m).exp() / z;
            }
        }
        let ctx: Vec<Vec<f64>> = (0..s)
            .map(|i| {
                (0..d)
                    .map(|e| (0..s).map(|j| p[i][j] * v[j][e]).sum())
                    .collect()
            })
            .collect();
        let dv: Vec<Vec<f64>> = (0..s)
            .map(|j| {
                (0..d)
                    .map(|e| (0..s).map(|i| p[i][j] * w[i][e]).sum())
                    .collect()
            })
            .collect();
        let dp: Vec<Vec<f64>> = (0..s)
            .map(|i| (0..s).map(|j| dot(&w[i], &v[j])).collect())
            .collect();
        let ds: Vec<Vec<f64>> = (0..s)
            .map(|i| {
                let c: f64 = (0..s).map(|j| p[i][j] * dp[i][j]).sum();
                (0..s).map(|j| p[i][j] * (dp[i][j] - c) * scale).collect()
            })
            .collect();
        let dq = (0..s)
            .map(|i| {
                (0..d)
                    .map(|e| (0..s).map(|j| ds[i][j] * k[j][e]).sum())
                    .collect()
            })
            .collect();
        let dk = (0..s)
            .map(|j| {
                (0..d)
                    .map(|e| (0..s).map(|i| ds[i][j] * q[i][e]).sum())
                    .collect()
            })
            .collect();
        (ctx, [dq, dk, dv])
    }

    #[test]
    fn forward_and_backward_match_the_definition() {
        // 70 tokens: three causal row blocks (32, 32, 6).
        for (causal, batch, seq, heads, head_dim) in [
            (true, 2, 11, 3, 5),
            (false, 2, 11, 3, 5),
            (true, 1, 70, 2, 3),
            (false, 1, 70, 2, 3),
        ] {
            let shape = Shape {
                batch,
                seq,
                heads,
                head_dim,
                causal,
            };
            let val = |i: usize, salt: usize| {
                (((i * 7919 + salt * 104_729) % 2003) as f32 / 2003.0 - 0.5) * 3.0
            };
            let qkv: Vec<f32> = (0..shape.qkv_len()).map(|i| val(i, 1)).collect();
            let dctx: Vec<f32> = (0..shape.ctx_len()).map(|i| val(i, 2)).collect();
            let mut ctx = vec![0.0; shape.ctx_len()];
            let mut probs = vec![f32::NAN; shape.probs_len()];
            forward(&qkv, shape, &mut ctx, &mut probs);
            let mut dqkv = vec![f32::NAN; shape.qkv_len()];
            let mut scratch = vec![f32::NAN; shape.seq * shape.seq];
            backward(&qkv, &probs, &dctx, shape, &mut dqkv, &mut scratch);
            let (s, d, hh) = (shape.seq, shape.head_dim, shape.heads);
            for b in 0..shape.batch {
                for h in 0..hh {
                    let part = |buf: &[f32], which: usize| -> Vec<Vec<f64>> {
                        (0..s)
                            .map(|i| {
                                (0..d)
                                    .map(|e| {
                                        buf[((b * s + i) * 3 + which) * hh * d + h * d + e] as f64
                                    })
                                    .collect()
                            })
                            .collect()
                    };
                    let w: Vec<Vec<f64>> = (0..s)
                        .map(|i| {
                            (0..d)
                                .map(|e| dctx[((b * s + i) * hh + h) * d + e] as f64)
                                .collect()
                        })
                        .collect();
                    let (want_ctx, want_grads) =
                        reference(&part(&qkv, 0), &part(&qkv, 1), &part(&qkv, 2), &w, causal);
                    for i in 0..s {
                        for e in 0..d {
                            let got = ctx[((b * s + i) * hh + h) * d + e] as f64;
                            assert!(
                                (got - want_ctx[i][e]).abs() < 1e-5,
                                "ctx {got} vs {}",
                                want_ctx[i][e]
                            );
                        }
                    }
                    for (which, want) in want_grads.iter().enumerate() {
                        let got = part(&dqkv, which);
                        for i in 0..s {
                            for e in 0..d {
                                assert!(
                                    (got[i][e] - want[i][e]).abs() < 1e-5,
                                    "grad {which} {} vs {}",
                                    got[i][e],
                                    want[i][e]
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
