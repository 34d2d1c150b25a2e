//! Cross-entropy over vocabulary-parallel logits, without gathering them.

use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::ops::{ParallelBackend, reduce_from_tp};
use crate::comm::{Group, ReduceOp, TensorComm};
use crate::kernels::VocabShard;

/// Mean cross-entropy of `targets` (`[batch, seq]`, token ids; negative ids are ignored) under
/// logits split over the vocabulary (`[batch, seq, V_pad / tp]`, rank `r` holding the columns
/// from `vocab_start`), as one fused operation
/// ([`FusedOps::fused_cross_entropy`](crate::kernels::FusedOps::fused_cross_entropy)): the row maximum, the
/// sum of exponentials and the target logit come from one pass over the logits and are
/// combined across the TP group by two small all-reduces; the full logits are never gathered,
/// and the backward pass writes the gradient over the logits. Columns at or beyond
/// `vocab_size` (padding) are kept out of the softmax. Every TP rank returns the same loss.
pub fn vocab_parallel_cross_entropy<B: ParallelBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab_start: usize,
    vocab_size: usize,
    group: Group,
) -> Tensor<B, 1> {
    // The loss is computed in f32 whatever the compute precision.
    let logits = crate::precision::to_f32(logits);
    let [b, s, local] = logits.dims();
    let shard = VocabShard {
        start: vocab_start,
        valid: vocab_size.saturating_sub(vocab_start).min(local),
    };
    let logits = logits.reshape([b * s, local]).into_primitive().tensor();
    let targets = targets.reshape([b * s]).into_primitive();
    Tensor::from_primitive(TensorPrimitive::Float(B::fused_cross_entropy(
        logits, targets, shard, group,
    )))
}

/// The same loss as [`vocab_parallel_cross_entropy`], composed of Burn operators (each
/// differentiated by Burn): the reference the fused operation is tested against.
///
/// Mean cross-entropy of `targets` (`[batch, seq]`, token ids; negative ids are ignored) under
/// logits split over the vocabulary (`[batch, seq, V_pad / tp]`, rank `r` holding the columns
/// from `vocab_start`). The maximum, the sum of exponentials and the target logit are each
/// reduced across the TP group; the full logits are never gathered. Columns at or beyond
/// `vocab_size` (padding) are kept out of the softmax. Every TP rank returns the same loss.
pub fn vocab_parallel_cross_entropy_unfused<B: ParallelBackend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    vocab_start: usize,
    vocab_size: usize,
    group: Group,
) -> Tensor<B, 1> {
    let [b, s, local] = logits.dims();
    let n = b * s;
    let device = logits.device();
    let logits = logits.reshape([n, local]);
    let targets = targets.reshape([n, 1]);

    // Padding columns: this rank's columns at or past the real vocabulary.
    let valid_cols = vocab_size.saturating_sub(vocab_start).min(local);
    let padded = valid_cols < local;
    let col_mask = padded.then(|| {
        let pad: Vec<bool> = (0..local).map(|c| c >= valid_cols).collect();
        Tensor::<B, 1, burn::tensor::Bool>::from_data(TensorData::new(pad, [local]), &device)
            .unsqueeze::<2>()
            .expand([n, local])
    });

    // Global row maximum (a constant shift; no gradient flows through it).
    let mut masked = logits.clone().detach();
    if let Some(m) = &col_mask {
        masked = masked.mask_fill(m.clone(), f32::NEG_INFINITY);
    }
    let mut max = masked.max_dim(1);
    if group.size() > 1 {
        let comm = group
            .comm()
            .unwrap_or_else(|e| panic!("cross-entropy max all-reduce: {e}"));
        max = comm
            .all_reduce_tensor(max, ReduceOp::Max)
            .unwrap_or_else(|e| panic!("cross-entropy max all-reduce: {e}"));
    }
    let shifted = logits - max;

    let mut exp = shifted.clone().exp();
    if let Some(m) = col_mask {
        exp = exp.mask_fill(m, 0.0);
    }
    let sum_exp = reduce_from_tp(exp.sum_dim(1), group);

    // The target's shifted logit, from the rank that holds its column.
    let start = vocab_start as i64;
    let outside = targets
        .clone()
        .lower_elem(start)
        .bool_or(targets.clone().greater_equal_elem(start + local as i64));
    let local_idx = (targets.clone() - start).mask_fill(outside.clone(), 0);
    let picked = shifted.gather(1, local_idx).mask_fill(outside, 0.0);
    let target_logit = reduce_from_tp(picked, group);

    let per_token = sum_exp.log() - target_logit;
    let weight = targets.greater_equal_elem(0).float();
    let count = weight.clone().sum().clamp_min(1.0);
    (per_token * weight).sum() / count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuAutodiff;
    use crate::tensor_parallel::InitRng;

    type B = CpuAutodiff;

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    }

    fn values<K: burn::tensor::backend::Backend, const D: usize>(t: Tensor<K, D>) -> Vec<f32> {
        t.into_data().into_vec::<f32>().unwrap()
    }

    /// The fused operation equals its composition (value and logits gradient), with and without
    /// padding columns and with an ignored target (shards of several ranks: the multi-rank
    /// tests).
    #[test]
    fn fused_equals_the_composition() {
        let dev = Default::default();
        let rng = InitRng::new(3);
        let (b, s, local) = (2, 7, 37);
        for (start, vocab) in [(0, 33), (0, 37)] {
            let x = rng.normal("logits", b * s * local, 3.0);
            let mut t: Vec<i64> = rng
                .integers("targets", b * s, vocab as u64)
                .iter()
                .map(|&v| v as i64)
                .collect();
            t[4] = -1;
            let logits = || {
                Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [b, s, local]), &dev)
                    .require_grad()
            };
            let targets =
                || Tensor::<B, 2, Int>::from_data(TensorData::new(t.clone(), [b, s]), &dev);
            let (lf, lu) = (logits(), logits());
            let fused =
                vocab_parallel_cross_entropy(lf.clone(), targets(), start, vocab, Group::local());
            let unfused = vocab_parallel_cross_entropy_unfused(
                lu.clone(),
                targets(),
                start,
                vocab,
                Group::local(),
            );
            let (gf, gu) = (
                (fused.clone() * 0.7).backward(),
                (unfused.clone() * 0.7).backward(),
            );
            let (vf, vu) = (values(fused), values(unfused));
            assert!(
                rel(&vf, &vu) < 1e-6,
                "loss {vf:?} vs {vu:?} (start {start})"
            );
            let (df, du) = (values(lf.grad(&gf).unwrap()), values(lu.grad(&gu).unwrap()));
            assert!(
                rel(&df, &du) < 1e-5,
                "gradient error {} (start {start})",
                rel(&df, &du)
            );
        }
    }
}
