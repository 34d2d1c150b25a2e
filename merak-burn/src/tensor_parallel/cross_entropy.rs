//! Cross-entropy over vocabulary-parallel logits, without gathering them.

use burn::tensor::{Int, Tensor, TensorData};

use super::ops::{ParallelBackend, reduce_from_tp};
use crate::comm::{Group, ReduceOp, TensorComm};

/// Mean cross-entropy of `targets` (`[batch, seq]`, token ids; negative ids are ignored) under
/// logits split over the vocabulary (`[batch, seq, V_pad / tp]`, rank `r` holding the columns
/// from `vocab_start`). The maximum, the sum of exponentials and the target logit are each
/// reduced across the TP group; the full logits are never gathered. Columns at or beyond
/// `vocab_size` (padding) are kept out of the softmax. Every TP rank returns the same loss.
pub fn vocab_parallel_cross_entropy<B: ParallelBackend>(
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
