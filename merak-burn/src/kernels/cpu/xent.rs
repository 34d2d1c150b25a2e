//! Softmax cross-entropy over a shard of the vocabulary, one pass over the logits forward and
//! one backward (the gradient written over the logits).
//!
//! A rank holds the columns `start..start + cols` of the (padded) vocabulary; only the first
//! `valid` of them are real tokens. Forward, each row gives its local maximum `m`, the sum
//! `s = sum exp(x - m)` over its valid columns and, on the rank that holds the row's target,
//! the target's logit. The ranks then combine `(m, s)` into the global log-sum-exp (see
//! [`combine`]); nothing the size of the logits crosses ranks.

use super::math::{exp, max, simd, sum};

/// One rank's columns of the vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Columns {
    /// Columns per row of the logits on this rank.
    pub cols: usize,
    /// The global token id of column 0.
    pub start: i64,
    /// Columns `0..valid` are real tokens; the rest is padding, kept out of the softmax.
    pub valid: usize,
}

impl Columns {
    /// The local column of `target`, if this rank holds it.
    #[inline]
    fn local(&self, target: i64) -> Option<usize> {
        let c = target - self.start;
        (c >= 0 && (c as usize) < self.valid).then_some(c as usize)
    }
}

/// Per-row statistics of this rank's logits: local maximum, sum of `exp(x - max)` and the
/// target's logit (0 where the target is elsewhere or ignored).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RowStats {
    /// Local row maxima over the valid columns.
    pub max: Vec<f32>,
    /// `sum exp(x - max)` over the valid columns.
    pub sum_exp: Vec<f32>,
    /// The raw logit of the row's target, where this rank holds it.
    pub target: Vec<f32>,
}

/// Computes [`RowStats`] for `logits` (`[rows, cols.cols]`, row-major) in one pass (each row is
/// read twice while it sits in cache).
pub fn row_stats(logits: &[f32], targets: &[i64], cols: Columns) -> RowStats {
    let rows = targets.len();
    debug_assert_eq!(logits.len(), rows * cols.cols);
    let mut out = RowStats {
        max: vec![0.0; rows],
        sum_exp: vec![0.0; rows],
        target: vec![0.0; rows],
    };
    let mut scratch = vec![0.0f32; cols.valid];
    simd(
        #[inline(always)]
        || {
            for (i, row) in logits.chunks_exact(cols.cols.max(1)).enumerate().take(rows) {
                let row = &row[..cols.valid];
                let m = max(row);
                out.max[i] = m;
                out.sum_exp[i] = if m == f32::NEG_INFINITY {
                    0.0
                } else {
                    // The exponentials first (a map, which vectorizes), then their sum.
                    for (e, &x) in scratch.iter_mut().zip(row) {
                        *e = exp(x - m);
                    }
                    sum(&scratch)
                };
                if let Some(c) = cols.local(targets[i]) {
                    out.target[i] = row[c];
                }
            }
        },
    );
    out
}

/// Turns all ranks' statistics into the global ones: `max` must already hold the maximum over
/// ranks (all-reduced), `local_max` this rank's; rescales `sum_exp` in place to that maximum so
/// that a sum over ranks gives the global sum.
pub fn rescale_to_global_max(sum_exp: &mut [f32], local_max: &[f32], max: &[f32]) {
    for ((s, &lm), &m) in sum_exp.iter_mut().zip(local_max).zip(max) {
        if *s != 0.0 {
            *s *= exp(lm - m);
        }
    }
}

/// The softmax statistics of each row, `[max, sum of exp(x - max)]` interleaved (`2 * rows`
/// values, what the backward pass needs), and the mean loss over the rows whose target is not
/// negative, from the global maximum, sum of exponentials and target logit. The loss of a row
/// is `(max - target) + ln(sum)`: no intermediate as large as the log-sum-exp itself, whose
/// rounding (an ulp of a number near `ln V`) would differ between layouts.
pub fn combine(max: &[f32], sum_exp: &[f32], target: &[f32], targets: &[i64]) -> (Vec<f32>, f32) {
    let mut stats = Vec::with_capacity(2 * max.len());
    let mut total = 0.0f64;
    for (((&m, &s), &t), &id) in max.iter().zip(sum_exp).zip(target).zip(targets) {
        stats.extend([m, s]);
        if id >= 0 {
            total += f64::from(m - t) + f64::from(s.ln());
        }
    }
    (stats, (total / count(targets) as f64) as f32)
}

/// The number of rows whose target is not negative (at least 1, the loss's denominator).
pub fn count(targets: &[i64]) -> usize {
    targets.iter().filter(|&&t| t >= 0).count().max(1)
}

/// Overwrites `logits` with the gradient of the mean loss times `grad`:
/// `(exp(x - max) / sum - onehot(target)) * grad / count` on rows with a target, 0 on ignored
/// rows and on padding columns (`stats` as returned by [`combine`]).
pub fn backward_in_place(
    logits: &mut [f32],
    stats: &[f32],
    targets: &[i64],
    cols: Columns,
    grad: f32,
) {
    let scale = grad / count(targets) as f32;
    simd(
        #[inline(always)]
        || {
            for (i, row) in logits
                .chunks_exact_mut(cols.cols.max(1))
                .enumerate()
                .take(targets.len())
            {
                let t = targets[i];
                if t < 0 {
                    row.fill(0.0);
                    continue;
                }
                let (real, pad) = row.split_at_mut(cols.valid);
                let (m, f) = (stats[2 * i], scale / stats[2 * i + 1]);
                for x in real.iter_mut() {
                    *x = exp(*x - m) * f;
                }
                pad.fill(0.0);
                if let Some(c) = cols.local(t) {
                    real[c] -= scale;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Mean cross-entropy and its gradient in f64, straight from the definition.
    fn reference(logits: &[f32], targets: &[i64], vocab: usize) -> (f64, Vec<f64>) {
        let n = targets.len();
        let cols = logits.len() / n;
        let valid = targets.iter().filter(|&&t| t >= 0).count().max(1) as f64;
        let mut loss = 0.0;
        let mut grad = vec![0.0; logits.len()];
        for i in 0..n {
            if targets[i] < 0 {
                continue;
            }
            let row = &logits[i * cols..i * cols + vocab];
            let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let z: f64 = row.iter().map(|&x| (x as f64 - m).exp()).sum();
            loss += m + z.ln() - row[targets[i] as usize] as f64;
            for j in 0..vocab {
                grad[i * cols + j] = (row[j] as f64 - m).exp() / z / valid;
            }
            grad[i * cols + targets[i] as usize] -= 1.0 / valid;
        }
        (loss / valid, grad)
    }

    fn logits(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 8.0)
            .collect()
    }

    #[test]
    fn one_rank_matches_the_definition_with_padding_and_ignored_rows() {
        let (n, cols, vocab) = (5, 37, 35);
        let x = logits(n, cols);
        let targets = vec![3, -1, 34, 0, 17];
        let c = Columns {
            cols,
            start: 0,
            valid: vocab,
        };
        let st = row_stats(&x, &targets, c);
        let (stats, loss) = combine(&st.max, &st.sum_exp, &st.target, &targets);
        let (want, want_grad) = reference(&x, &targets, vocab);
        assert!(
            (loss as f64 - want).abs() < 1e-6 * want.abs(),
            "{loss} vs {want}"
        );
        let mut g = x.clone();
        backward_in_place(&mut g, &stats, &targets, c, 1.0);
        for (a, b) in g.iter().zip(&want_grad) {
            assert!((*a as f64 - b).abs() < 1e-7, "{a} vs {b}");
        }
    }

    #[test]
    fn two_shards_combine_to_the_whole() {
        let (n, vocab) = (4, 40);
        let x = logits(n, vocab);
        let targets = vec![1, 39, 20, -5];
        let (want, _) = reference(&x, &targets, vocab);
        // Rank r holds columns 20 r .. 20 r + 20.
        let shard = |r: usize| -> Vec<f32> {
            x.chunks(vocab)
                .flat_map(|row| row[20 * r..20 * r + 20].to_vec())
                .collect()
        };
        let cols = |r: usize| Columns {
            cols: 20,
            start: 20 * r as i64,
            valid: 20,
        };
        let s: Vec<RowStats> = (0..2)
            .map(|r| row_stats(&shard(r), &targets, cols(r)))
            .collect();
        let gmax: Vec<f32> = (0..n).map(|i| s[0].max[i].max(s[1].max[i])).collect();
        let mut total = vec![0.0; n];
        for st in &s {
            let mut se = st.sum_exp.clone();
            rescale_to_global_max(&mut se, &st.max, &gmax);
            total.iter_mut().zip(&se).for_each(|(t, v)| *t += v);
        }
        let target: Vec<f32> = (0..n).map(|i| s[0].target[i] + s[1].target[i]).collect();
        let (_, loss) = combine(&gmax, &total, &target, &targets);
        assert!(
            (loss as f64 - want).abs() < 1e-6 * want.abs(),
            "{loss} vs {want}"
        );
    }
}
