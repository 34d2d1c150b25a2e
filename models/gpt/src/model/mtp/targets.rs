//! What each multi-token-prediction depth's loss is computed against. Depth `k`'s target at
//! position `i` is the main target at `i + k`, which under context parallelism may lie in
//! another rank's share of the sequence: so the trainer adds every depth's targets to the
//! samples while each sequence is whole ([`with_depth_fields`], through
//! [`PipelineModel::prepare_samples`](merak_burn::pipeline::PipelineModel::prepare_samples)),
//! before it cuts them over the context-parallel group, with the counts of counted targets
//! that make each rank's share of a depth's mean add up to the mean over the whole
//! micro-batch ([`DepthBatch`]).

use burn::tensor::{Int, Tensor, backend::Backend};
use merak_burn::batch::{Batch, BatchError, Samples, TARGETS};

/// The field of depth `k`'s targets (1-based): the main targets shifted left by `k`
/// positions, `-1` (not counted) for the last `k`.
pub fn depth_field(k: usize) -> String {
    format!("mtp_targets_{k}")
}

/// The field of each sample's counted targets over its whole sequence, `[1, 1 + depths]`: the
/// main loss's, then each depth's.
pub const COUNTS: &str = "mtp_counts";

/// `samples` (whole sequences, targets `[seq]` per sample) with the targets of `depths`
/// depths ([`depth_field`]) and the counts ([`COUNTS`]); unchanged for no depths or when they
/// are already there.
pub fn with_depth_fields(samples: Samples, depths: usize) -> Result<Samples, BatchError> {
    if depths == 0 || samples.fields.contains_key(COUNTS) {
        return Ok(samples);
    }
    let targets = samples.ints(TARGETS)?.to_vec();
    let seq = targets.len() / samples.count.max(1);
    let shifted: Vec<Vec<i64>> = (1..=depths).map(|k| shift(&targets, seq, k)).collect();
    let mut counts = Vec::with_capacity(samples.count * (depths + 1));
    for s in 0..samples.count {
        let counted = |v: &[i64]| counted(&v[s * seq..(s + 1) * seq]) as i64;
        counts.push(counted(&targets));
        counts.extend(shifted.iter().map(|v| counted(v)));
    }
    let mut out = samples.with_int(COUNTS, &[1, depths + 1], counts)?;
    for (k, values) in shifted.into_iter().enumerate() {
        out = out.with_int(&depth_field(k + 1), &[seq], values)?;
    }
    Ok(out)
}

/// Every sequence (`seq` positions each) of `targets` shifted left by `k`, `-1` at the end.
fn shift(targets: &[i64], seq: usize, k: usize) -> Vec<i64> {
    let mut out = vec![-1; targets.len()];
    for (from, to) in targets.chunks(seq.max(1)).zip(out.chunks_mut(seq.max(1))) {
        if k < from.len() {
            to[..from.len() - k].copy_from_slice(&from[k..]);
        }
    }
    out
}

fn counted(targets: &[i64]) -> usize {
    targets.iter().filter(|&&t| t >= 0).count()
}

/// A micro-batch's multi-token-prediction inputs on this rank: each depth's input tokens and
/// targets (this rank's positions), and the factor that turns the depth's mean over this
/// rank's counted targets into its share of the micro-batch's summed loss.
pub(crate) struct DepthBatch<B: Backend> {
    /// Depth `k`'s input tokens (the targets of depth `k - 1`, the main targets for the
    /// first), `[batch, positions]`.
    pub(crate) inputs: Vec<Tensor<B, 2, Int>>,
    /// Depth `k`'s targets, `[batch, positions]`.
    pub(crate) targets: Vec<Tensor<B, 2, Int>>,
    /// Depth `k`'s factor: its counted targets here times the micro-batch's main targets over
    /// its counted targets in the micro-batch. The micro-batch's summed loss takes
    /// `mean_k · factor_k` on each rank, which adds up over the ranks to `mean_k` times the
    /// main targets, as one process computes it (every position here: the main targets).
    pub(crate) factors: Vec<f64>,
}

impl<B: Backend> DepthBatch<B> {
    /// The inputs of `depths` depths from `batch`, whose samples hold the depths' fields
    /// ([`with_depth_fields`]).
    pub(crate) fn of(batch: &Batch<'_, B>, depths: usize) -> Result<Self, BatchError> {
        let samples = batch.samples();
        let counts = samples.ints(COUNTS)?;
        let whole = |k: usize| -> usize {
            let per_sample = counts.chunks(depths + 1).map(|c| c[k].max(0) as usize);
            per_sample.sum()
        };
        let main = whole(0) as f64;
        let mut factors = Vec::with_capacity(depths);
        for k in 1..=depths {
            let here = counted(samples.ints(&depth_field(k))?) as f64;
            factors.push(match whole(k) {
                0 => 0.0,
                all => here * main / all as f64,
            });
        }
        let field = |k: usize| match k {
            0 => batch.try_int(TARGETS),
            k => batch.try_int(&depth_field(k)),
        };
        Ok(Self {
            inputs: (0..depths).map(field).collect::<Result<_, _>>()?,
            targets: (1..=depths).map(field).collect::<Result<_, _>>()?,
            factors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_fields_shift_each_sequence_and_count_its_targets() {
        let samples = Samples::new(2)
            .with_int(TARGETS, &[4], vec![1, 2, 3, 4, 5, 6, -1, 8])
            .expect("samples");
        let s = with_depth_fields(samples, 2).expect("fields");
        assert_eq!(
            s.ints(&depth_field(1)).expect("depth 1"),
            &[2, 3, 4, -1, 6, -1, 8, -1]
        );
        assert_eq!(
            s.ints(&depth_field(2)).expect("depth 2"),
            &[3, 4, -1, -1, -1, 8, -1, -1]
        );
        assert_eq!(s.ints(COUNTS).expect("counts"), &[4, 3, 2, 3, 2, 1]);
        // Added once.
        let again = with_depth_fields(s.clone(), 2).expect("fields");
        assert_eq!(again.fields.len(), s.fields.len());
    }
}
