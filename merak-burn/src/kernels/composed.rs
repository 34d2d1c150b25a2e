//! The default kernels of [`FusedOps`](super::FusedOps): compositions of Burn operators, for
//! backends without fused kernels (CUDA keeps Burn's own kernels this way) and as the reference
//! the fused kernels are tested against.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Shape, Tensor};

use super::{AttentionSpec, NormStats, VocabShard, fatal, lift, prim};
use crate::comm::{Group, ReduceOp, TensorComm};

/// `x` all-reduced over `group` (the identity on one rank).
pub(crate) fn all_reduce<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    op: ReduceOp,
    group: Group,
) -> Tensor<B, D> {
    if group.size() == 1 {
        return x;
    }
    let what = "cross-entropy all-reduce";
    let comm = group.comm().unwrap_or_else(|e| fatal(what, e));
    comm.all_reduce_tensor(x, op)
        .unwrap_or_else(|e| fatal(what, e))
}

/// `[rows, cols]`: true on the padding columns (`>= valid`), or `None` without padding.
fn padding<B: Backend>(
    rows: usize,
    cols: usize,
    valid: usize,
    device: &B::Device,
) -> Option<Tensor<B, 2, Bool>> {
    (valid < cols).then(|| {
        Tensor::<B, 1, Int>::arange(0..cols as i64, device)
            .greater_equal_elem(valid as i64)
            .unsqueeze::<2>()
            .expand([rows, cols])
    })
}

/// `[rows, 1]`: each row's target as a local column, and whether this rank holds it.
fn local_targets<B: Backend>(
    targets: &Tensor<B, 1, Int>,
    shard: VocabShard,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Bool>) {
    let n = targets.dims()[0];
    let t = targets.clone().reshape([n, 1]);
    let start = shard.start as i64;
    let outside = t
        .clone()
        .lower_elem(start)
        .bool_or(t.clone().greater_equal_elem(start + shard.valid as i64));
    ((t - start).mask_fill(outside.clone(), 0), outside)
}

/// Composed forward of the vocabulary-parallel cross-entropy (see
/// [`FusedOps::cross_entropy_forward`](super::FusedOps::cross_entropy_forward)).
pub fn cross_entropy_forward<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    shard: VocabShard,
    group: Group,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = lift::<B, 2>(logits);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let [n, cols] = logits.dims();
    let pad = padding::<B>(n, cols, shard.valid, &logits.device());
    let mut masked = logits.clone();
    if let Some(p) = &pad {
        masked = masked.mask_fill(p.clone(), f32::NEG_INFINITY);
    }
    let max = all_reduce(masked.max_dim(1), ReduceOp::Max, group);
    let mut exp = (logits.clone() - max.clone()).exp();
    if let Some(p) = pad {
        exp = exp.mask_fill(p, 0.0);
    }
    let sum_exp = all_reduce(exp.sum_dim(1), ReduceOp::Sum, group);
    let (idx, outside) = local_targets(&targets, shard);
    let picked = logits.gather(1, idx).mask_fill(outside, 0.0);
    let target_logit = all_reduce(picked, ReduceOp::Sum, group);
    let weight = targets.greater_equal_elem(0).float().reshape([n, 1]);
    let count = weight.clone().sum().clamp_min(1.0);
    let per_row = (max.clone() - target_logit) + sum_exp.clone().log();
    let loss = (per_row * weight).sum() / count;
    (prim(loss), prim(Tensor::cat(vec![max, sum_exp], 1)))
}

/// Composed backward of the vocabulary-parallel cross-entropy (see
/// [`FusedOps::cross_entropy_backward`](super::FusedOps::cross_entropy_backward)).
pub fn cross_entropy_backward<B: Backend>(
    logits: FloatTensor<B>,
    stats: FloatTensor<B>,
    targets: IntTensor<B>,
    shard: VocabShard,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let logits = lift::<B, 2>(logits);
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let [n, cols] = logits.dims();
    let device = logits.device();
    let stats = lift::<B, 2>(stats);
    let (max, sum_exp) = (stats.clone().narrow(1, 0, 1), stats.narrow(1, 1, 1));
    let mut p = (logits - max).exp() / sum_exp;
    if let Some(pad) = padding::<B>(n, cols, shard.valid, &device) {
        p = p.mask_fill(pad, 0.0);
    }
    let (idx, outside) = local_targets(&targets, shard);
    let onehot = Tensor::<B, 1, Int>::arange(0..cols as i64, &device)
        .unsqueeze::<2>()
        .expand([n, cols])
        .equal(idx.expand([n, cols]))
        .bool_and(outside.bool_not().expand([n, cols]))
        .float();
    let weight = targets.greater_equal_elem(0).float().reshape([n, 1]);
    let count = weight.clone().sum().clamp_min(1.0);
    let scale = lift::<B, 1>(grad) / count;
    prim((p - onehot) * weight * scale.unsqueeze::<2>())
}

/// `x` (any rank) seen as `[rows, d]` with `d` its last dimension, and its own shape.
fn rows<B: Backend>(x: FloatTensor<B>) -> (Tensor<B, 2>, Shape) {
    let t = lift::<B, 1>(x);
    let shape = t.shape();
    let last = shape[shape.num_dims() - 1].max(1);
    (t.reshape([shape.num_elements() / last, last]), shape)
}

/// A rank-2 result put back into `shape`.
fn unrows<B: Backend>(t: Tensor<B, 2>, shape: Shape) -> FloatTensor<B> {
    B::float_reshape(prim(t), shape)
}

/// Composed LayerNorm forward (see
/// [`FusedOps::layer_norm_forward`](super::FusedOps::layer_norm_forward)).
pub fn layer_norm_forward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, NormStats<B>) {
    let (x, shape) = rows::<B>(x);
    let n = x.dims()[0];
    let mean = x.clone().mean_dim(1);
    let centered = x - mean.clone();
    let var = centered.clone().powi_scalar(2).mean_dim(1);
    let rstd = (var + eps).sqrt().recip();
    let y = centered * rstd.clone() * lift::<B, 1>(gamma).unsqueeze::<2>()
        + lift::<B, 1>(beta).unsqueeze::<2>();
    (
        unrows(y, shape),
        (prim(mean.reshape([n])), prim(rstd.reshape([n]))),
    )
}

/// Composed LayerNorm backward (see
/// [`FusedOps::layer_norm_backward`](super::FusedOps::layer_norm_backward)).
pub fn layer_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    stats: NormStats<B>,
    dy: FloatTensor<B>,
) -> [FloatTensor<B>; 3] {
    let (x, shape) = rows::<B>(x);
    let (dy, _) = rows::<B>(dy);
    let n = x.dims()[0];
    let mean = lift::<B, 1>(stats.0).reshape([n, 1]);
    let rstd = lift::<B, 1>(stats.1).reshape([n, 1]);
    let xhat = (x - mean) * rstd.clone();
    let g = dy.clone() * lift::<B, 1>(gamma).unsqueeze::<2>();
    let mg = g.clone().mean_dim(1);
    let mgx = (g.clone() * xhat.clone()).mean_dim(1);
    let dx = (g - mg - xhat.clone() * mgx) * rstd;
    let dgamma = (dy.clone() * xhat).sum_dim(0);
    let dbeta = dy.sum_dim(0);
    let d = dgamma.dims()[1];
    [
        unrows(dx, shape),
        prim(dgamma.reshape([d])),
        prim(dbeta.reshape([d])),
    ]
}

/// Composed `gelu(x + bias)` forward.
pub fn bias_gelu_forward<B: Backend>(x: FloatTensor<B>, bias: FloatTensor<B>) -> FloatTensor<B> {
    let (x, shape) = rows::<B>(x);
    let y = burn::tensor::activation::gelu(x + lift::<B, 1>(bias).unsqueeze::<2>());
    unrows(y, shape)
}

/// Composed `gelu(x + bias)` backward: `dy * gelu'(x + bias)` and its row sum.
pub fn bias_gelu_backward<B: Backend>(
    x: FloatTensor<B>,
    bias: FloatTensor<B>,
    dy: FloatTensor<B>,
) -> [FloatTensor<B>; 2] {
    let (x, shape) = rows::<B>(x);
    let (dy, _) = rows::<B>(dy);
    let z = x + lift::<B, 1>(bias).unsqueeze::<2>();
    let dz = lift::<B, 2>(B::gelu_backward(prim(z), prim(dy)));
    let d = dz.dims()[1];
    let dbias = dz.clone().sum_dim(0).reshape([d]);
    [unrows(dz, shape), prim(dbias)]
}

/// Q, K and V of a fused `[batch, seq, 3 * heads * head_dim]` buffer as
/// `[batch, heads, seq, head_dim]` each.
fn split_heads<B: Backend>(qkv: Tensor<B, 3>, heads: usize) -> [Tensor<B, 4>; 3] {
    let [b, s, three_hd] = qkv.dims();
    let d = three_hd / 3 / heads;
    let mut parts = qkv
        .chunk(3, 2)
        .into_iter()
        .map(|t| t.reshape([b, s, heads, d]).swap_dims(1, 2));
    let mut next = || parts.next().expect("chunk(3) yields three parts");
    [next(), next(), next()]
}

/// `[batch, heads, seq, head_dim]` back to `[batch, seq, heads * head_dim]`.
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, h, s, d] = x.dims();
    x.swap_dims(1, 2).reshape([b, s, h * d])
}

/// `[batch, heads, seq, seq]`: true where a query may not see a key, because the key belongs to
/// another segment (`segments` `[batch, seq]`).
fn segment_mask<B: Backend>(segments: IntTensor<B>, heads: usize) -> Tensor<B, 4, Bool> {
    let seg = Tensor::<B, 2, Int>::from_primitive(segments);
    let [b, s] = seg.dims();
    let rows = seg.clone().reshape([b, s, 1]).expand([b, s, s]);
    let cols = seg.reshape([b, 1, s]).expand([b, s, s]);
    rows.not_equal(cols)
        .unsqueeze_dim::<4>(1)
        .expand([b, heads, s, s])
}

/// `q kᵀ / sqrt(d)` (`[batch, heads, seq, seq]`), `-inf` where a query may not see a key: the
/// future when `causal`, other segments with `segments`.
fn masked_scores<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    causal: bool,
    segments: Option<IntTensor<B>>,
) -> Tensor<B, 4> {
    let [b, h, s, d] = q.dims();
    let mut scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (d as f64).sqrt());
    if causal {
        let future = Tensor::<B, 2, Bool>::tril_mask([s, s], 0, &scores.device());
        scores = scores.mask_fill(
            future.unsqueeze::<4>().expand([b, h, s, s]),
            f32::NEG_INFINITY,
        );
    }
    if let Some(seg) = segments {
        scores = scores.mask_fill(segment_mask::<B>(seg, h), f32::NEG_INFINITY);
    }
    scores
}

/// Composed attention forward (see
/// [`FusedOps::attention_forward`](super::FusedOps::attention_forward)): the context and the
/// log-sum-exp, the probabilities `exp(scores - lse)` in between.
pub fn attention_forward<B: Backend>(
    qkv: FloatTensor<B>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let [q, k, v] = split_heads(lift::<B, 3>(qkv), spec.heads);
    let [b, h, s, _] = q.dims();
    let scores = masked_scores(q, k, spec.causal, segments);
    // Every query sees itself, so each row's maximum is finite.
    let top = scores.clone().max_dim(3);
    let lse = top.clone() + (scores.clone() - top).exp().sum_dim(3).log();
    let probs = (scores - lse.clone()).exp();
    let ctx = merge_heads(probs.matmul(v));
    (prim(ctx), Some(prim(lse.reshape([b, h, s]))))
}

/// Attention through Burn's own attention operation ([`burn::tensor::module::attention`]: flash
/// attention on the CubeCL backends when its autotuner finds it faster): the context only, no
/// log-sum-exp. No `[batch, heads, seq, seq]` tensor outlives the forward pass; the backward
/// pass recomputes the softmax ([`attention_backward`] without `lse`).
pub fn attention_forward_unsaved<B: Backend>(
    qkv: FloatTensor<B>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let [q, k, v] = split_heads(lift::<B, 3>(qkv), spec.heads);
    let options = burn::tensor::ops::AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: spec.causal,
    };
    let mask = segments.map(|seg| segment_mask::<B>(seg, spec.heads));
    let ctx = burn::tensor::module::attention(q, k, v, mask, None, options);
    (prim(merge_heads(ctx)), None)
}

/// Composed attention backward (see
/// [`FusedOps::attention_backward`](super::FusedOps::attention_backward)): the probabilities
/// recomputed from the scores, as `exp(scores - lse)` or, without `lse`, as their softmax;
/// `D = rowsum(dctx ∘ ctx)`.
pub fn attention_backward<B: Backend>(
    qkv: FloatTensor<B>,
    ctx: FloatTensor<B>,
    lse: Option<FloatTensor<B>>,
    dctx: FloatTensor<B>,
    spec: AttentionSpec,
    segments: Option<IntTensor<B>>,
) -> FloatTensor<B> {
    let [q, k, v] = split_heads(lift::<B, 3>(qkv), spec.heads);
    let [b, h, s, d] = q.dims();
    let scores = masked_scores(q.clone(), k.clone(), spec.causal, segments);
    let p = match lse {
        Some(lse) => (scores - lift::<B, 3>(lse).reshape([b, h, s, 1])).exp(),
        None => burn::tensor::activation::softmax(scores, 3),
    };
    let heads = |x: FloatTensor<B>| lift::<B, 3>(x).reshape([b, s, h, d]).swap_dims(1, 2);
    let dout = heads(dctx);
    let delta = (dout.clone() * heads(ctx)).sum_dim(3);
    let scale = 1.0 / (d as f64).sqrt();
    let dv = p.clone().swap_dims(2, 3).matmul(dout.clone());
    let dp = dout.matmul(v.swap_dims(2, 3));
    let ds = p * (dp - delta) * scale;
    let dq = ds.clone().matmul(k);
    let dk = ds.swap_dims(2, 3).matmul(q);
    prim(Tensor::cat(
        vec![merge_heads(dq), merge_heads(dk), merge_heads(dv)],
        2,
    ))
}

/// Composed linear forward (see [`FusedOps::linear_forward`](super::FusedOps::linear_forward)).
pub fn linear_forward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    linear_forward_with::<B>(x, w, bias, B::float_matmul)
}

/// The linear forward with the matrix product `product` (Burn's `matmul` in
/// [`linear_forward`], a chosen kernel on CubeCL backends).
pub fn linear_forward_with<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    product: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<B> {
    let y = lift::<B, 2>(product(x, w));
    match bias {
        Some(b) => prim(y + lift::<B, 1>(b).unsqueeze::<2>()),
        None => prim(y),
    }
}

/// Composed linear backward (see [`FusedOps::linear_backward`](super::FusedOps::linear_backward)).
pub fn linear_backward<B: Backend>(
    x: Option<FloatTensor<B>>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    want: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    linear_backward_with::<B>(x, w, dy, want, B::float_matmul, column_sums::<B>)
}

/// The linear backward with the matrix product `product` (see [`linear_forward_with`]) and
/// the bias's gradient by `column_sums` (`[rows, d]` to `[d]`).
pub fn linear_backward_with<B: Backend>(
    x: Option<FloatTensor<B>>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    want: [bool; 3],
    product: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    column_sums: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> [Option<FloatTensor<B>>; 3] {
    let dx = want[0].then(|| product(dy.clone(), B::float_transpose(w)));
    let dw = x
        .filter(|_| want[1])
        .map(|x| product(B::float_transpose(x), dy.clone()));
    let db = want[2].then(|| column_sums(dy));
    [dx, dw, db]
}

/// The sums of the columns of `x` (`[rows, d]` to `[d]`) by Burn's reduction.
pub fn column_sums<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let x = lift::<B, 2>(x);
    let d = x.dims()[1];
    prim(x.sum_dim(0).reshape([d]))
}

/// The sum of the squares of `x`'s elements in its own element type, on the device (`[1]`).
fn square_sum<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 1> {
    lift::<B, 1>(x).powi_scalar(2).sum()
}

/// Composed sum of squares, in the tensor's own element type.
pub fn sum_of_squares<B: Backend>(x: FloatTensor<B>) -> f64 {
    let v = crate::host_read::floats(square_sum::<B>(x))
        .unwrap_or_else(|e| crate::comm::fail(format!("a sum of squares: {e}")));
    v.first().copied().map_or(0.0, f64::from)
}

/// Composed sums of squares of each tensor, each in the tensor's own element type, left on
/// the device as one `f32` value per tensor.
pub fn squares_of<B: Backend>(xs: Vec<FloatTensor<B>>) -> super::Squares<B> {
    let sums: Vec<Tensor<B, 1>> = (xs.into_iter())
        .map(|x| crate::precision::to_f32(square_sum::<B>(x)))
        .collect();
    let counts = vec![1; sums.len()];
    match sums.is_empty() {
        true => super::Squares::Host(Vec::new()),
        false => super::Squares::Device {
            partials: Tensor::cat(sums, 0),
            counts,
        },
    }
}

/// Composed AdamW update (see [`FusedOps::adamw_step`](super::FusedOps::adamw_step)), the
/// operations of Burn's `AdamW`.
pub fn adamw_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    moments: Option<(FloatTensor<B>, FloatTensor<B>)>,
    s: super::AdamWStep,
) -> super::AdamWTensors<B> {
    let (p, g) = (lift::<B, 1>(param), lift::<B, 1>(grad));
    let (f1, f2) = (1.0 - s.beta1, 1.0 - s.beta2);
    let (m, v) = match moments {
        Some((m, v)) => (
            lift::<B, 1>(m)
                .mul_scalar(s.beta1)
                .add(g.clone().mul_scalar(f1)),
            lift::<B, 1>(v)
                .mul_scalar(s.beta2)
                .add(g.square().mul_scalar(f2)),
        ),
        None => (g.clone().mul_scalar(f1), g.square().mul_scalar(f2)),
    };
    let t = s.time as i32;
    let m_hat = m.clone().div_scalar(1.0 - s.beta1.powi(t));
    let v_hat = v.clone().div_scalar(1.0 - s.beta2.powi(t));
    let delta = m_hat.div(v_hat.sqrt().add_scalar(s.eps));
    let decay_rate = s.lr * f64::from(s.weight_decay);
    let decayed = if decay_rate == 0.0 {
        p
    } else {
        p.mul_scalar(1.0 - decay_rate)
    };
    (prim(decayed - delta.mul_scalar(s.lr)), prim(m), prim(v))
}

/// A tensor's values as a host vector, row-major.
pub fn to_host<B: Backend>(x: FloatTensor<B>) -> Vec<f32> {
    let t = lift::<B, 1>(x);
    let n = t.shape().num_elements();
    crate::host_read::floats(t.reshape([n]))
        .unwrap_or_else(|e| crate::comm::fail(format!("a tensor's values: {e}")))
}

/// `[1, n]` local row indices of `ids` in a shard from `start` of `rows` rows (0 for ids held
/// elsewhere), and `[n, 1]` 1/0 weights of the ids held here.
fn shard_ids<B: Backend>(
    ids: IntTensor<B>,
    rows: usize,
    start: usize,
) -> (Tensor<B, 2, Int>, Tensor<B, 2>) {
    let ids = Tensor::<B, 1, Int>::from_primitive(ids);
    let n = ids.dims()[0];
    let s = start as i64;
    let outside = ids
        .clone()
        .lower_elem(s)
        .bool_or(ids.clone().greater_equal_elem(s + rows as i64));
    let local = (ids - s).mask_fill(outside.clone(), 0).reshape([1, n]);
    (local, outside.bool_not().float().reshape([n, 1]))
}

/// Composed embedding forward (see
/// [`FusedOps::gather_forward`](super::FusedOps::gather_forward)).
pub fn gather_forward<B: Backend>(
    table: FloatTensor<B>,
    ids: IntTensor<B>,
    start: usize,
) -> FloatTensor<B> {
    let table = lift::<B, 2>(table);
    let [rows, d] = table.dims();
    let (local, keep) = shard_ids::<B>(ids, rows, start);
    let n = keep.dims()[0];
    let out = burn::tensor::module::embedding(table, local).reshape([n, d]);
    prim(out * keep)
}

/// Composed embedding backward (see
/// [`FusedOps::gather_backward`](super::FusedOps::gather_backward)).
pub fn gather_backward<B: Backend>(
    ids: IntTensor<B>,
    dy: FloatTensor<B>,
    rows: usize,
    start: usize,
) -> FloatTensor<B> {
    let dy = lift::<B, 2>(dy);
    let [n, d] = dy.dims();
    let (local, keep) = shard_ids::<B>(ids, rows, start);
    let table = Tensor::<B, 2>::zeros([rows, d], &dy.device());
    let dy = (dy * keep).reshape([1, n, d]);
    B::embedding_backward(prim(table), prim(dy), local.into_primitive())
}
