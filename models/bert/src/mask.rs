//! Deterministic masking for the masked-language-model objective.

use merak_burn::tensor_parallel::InitRng;

use crate::BertConfig;

/// The target of a position that is not predicted (ignored by the loss).
pub const IGNORE_TARGET: i64 = -1;

/// Probability that a position is selected for prediction.
pub const MASK_PROB: f32 = 0.15;

/// Probability that a selected position is replaced by `[MASK]`.
pub const REPLACE_WITH_MASK_PROB: f32 = 0.8;

/// Probability that a selected position is replaced by a random token (the rest, 10%, keep
/// their token).
pub const RANDOM_TOKEN_PROB: f32 = 0.1;

/// BERT's masking of `tokens` (one or more sequences of `seq_len` tokens, back to back; a
/// shorter final chunk counts as a sequence of its own), returning `(inputs, targets)` of the
/// same length.
///
/// Each position is selected with probability 15% ([`MASK_PROB`]); a selected position's
/// target is its original token, every other target is [`IGNORE_TARGET`]. A selected input is
/// replaced by `cfg.mask_token_id` with probability 80%, by a uniformly random token other
/// than `[MASK]` with probability 10% (with `[MASK]` as the last id: one in
/// `0..mask_token_id`), and left unchanged otherwise. A sequence in which nothing was selected
/// gets its first position selected, so the loss of a sequence is never empty.
///
/// The draws come from [`InitRng::new(seed)`](InitRng) keyed by `stream` (for example
/// `"mlm/{step}/{sample}"`), so every rank and every parallel layout masks a sample the same
/// way, and the same `(seed, stream)` always gives the same result.
///
/// # Panics
///
/// If `seq_len` is zero.
pub fn mask_tokens(
    tokens: &[i64],
    seq_len: usize,
    cfg: &BertConfig,
    seed: u64,
    stream: &str,
) -> (Vec<i64>, Vec<i64>) {
    assert!(seq_len > 0, "mask_tokens: seq_len must be at least 1");
    let n = tokens.len();
    let rng = InitRng::new(seed);
    let select = rng.uniform(&format!("{stream}/select"), n);
    let action = rng.uniform(&format!("{stream}/action"), n);
    let mask_id = cfg.mask_token_id as i64;
    // Random replacements are drawn among the other `V - 1` ids, skipping `[MASK]`.
    let others = cfg.vocab_size.saturating_sub(1).max(1) as u64;
    let random = rng.integers(&format!("{stream}/token"), n, others);

    let mut inputs = tokens.to_vec();
    let mut targets = vec![IGNORE_TARGET; n];
    for (start, seq) in (0..n).step_by(seq_len).zip(tokens.chunks(seq_len)) {
        let mut chosen: Vec<usize> = (start..start + seq.len())
            .filter(|&i| select[i] < MASK_PROB)
            .collect();
        if chosen.is_empty() {
            chosen.push(start);
        }
        for i in chosen {
            targets[i] = tokens[i];
            if action[i] < REPLACE_WITH_MASK_PROB {
                inputs[i] = mask_id;
            } else if action[i] < REPLACE_WITH_MASK_PROB + RANDOM_TOKEN_PROB {
                let r = random[i] as i64;
                inputs[i] = if r >= mask_id { r + 1 } else { r };
            }
        }
    }
    (inputs, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> BertConfig {
        BertConfig::preset("tiny").unwrap()
    }

    #[test]
    fn masking_has_bert_statistics() {
        let cfg = tiny();
        let seq = 128;
        let n = 256 * seq;
        // Tokens that are never the mask id, so every replacement is visible.
        let tokens: Vec<i64> = (0..n).map(|i| (i % 500) as i64).collect();
        let (inputs, targets) = mask_tokens(&tokens, seq, &cfg, 42, "mlm/0");
        assert_eq!((inputs.len(), targets.len()), (n, n));

        let (mut selected, mut masked, mut random, mut kept) = (0usize, 0usize, 0usize, 0usize);
        for i in 0..n {
            if targets[i] == IGNORE_TARGET {
                assert_eq!(inputs[i], tokens[i], "unselected position {i} changed");
                continue;
            }
            assert_eq!(targets[i], tokens[i]);
            selected += 1;
            if inputs[i] == cfg.mask_token_id as i64 {
                masked += 1;
            } else if inputs[i] != tokens[i] {
                random += 1;
                assert!((0..cfg.mask_token_id as i64).contains(&inputs[i]));
            } else {
                kept += 1;
            }
        }
        let frac = selected as f64 / n as f64;
        assert!((frac - 0.15).abs() < 0.01, "selected {frac}");
        let s = selected as f64;
        // A random replacement can draw the original token (1 in 511): counted as kept.
        let (m, r, k) = (masked as f64 / s, random as f64 / s, kept as f64 / s);
        assert!((m - 0.8).abs() < 0.02, "masked {m}");
        assert!((r - 0.1).abs() < 0.015, "random {r}");
        assert!((k - 0.1).abs() < 0.015, "kept {k}");
    }

    #[test]
    fn masking_is_deterministic_per_stream() {
        let cfg = tiny();
        let tokens: Vec<i64> = (0..4096).map(|i| (i * 7 % 511) as i64).collect();
        let a = mask_tokens(&tokens, 32, &cfg, 1, "mlm/3/0");
        assert_eq!(a, mask_tokens(&tokens, 32, &cfg, 1, "mlm/3/0"));
        assert_ne!(a.1, mask_tokens(&tokens, 32, &cfg, 1, "mlm/3/1").1);
        assert_ne!(a.1, mask_tokens(&tokens, 32, &cfg, 2, "mlm/3/0").1);
    }

    #[test]
    fn every_sequence_has_a_target() {
        let cfg = tiny();
        // Length-1 sequences are selected only 15% of the time by chance.
        let tokens: Vec<i64> = (0..1000).map(|i| (i % 511) as i64).collect();
        let (_, targets) = mask_tokens(&tokens, 1, &cfg, 9, "mlm/short");
        assert!(targets.iter().all(|&t| t != IGNORE_TARGET));
        // Sequences of 3 plus a final chunk of 1.
        let (_, targets) = mask_tokens(&tokens, 3, &cfg, 9, "mlm/chunks");
        for chunk in targets.chunks(3) {
            assert!(chunk.iter().any(|&t| t != IGNORE_TARGET));
        }
    }

    #[test]
    fn random_tokens_skip_a_mask_id_in_the_middle() {
        let mut cfg = tiny();
        cfg.vocab_size = 3;
        cfg.mask_token_id = 1;
        let tokens = vec![0i64; 20_000];
        let (inputs, targets) = mask_tokens(&tokens, 100, &cfg, 5, "mlm/mid");
        let mut seen_two = false;
        for (x, t) in inputs.iter().zip(&targets) {
            assert!((0..3).contains(x));
            seen_two |= *t != IGNORE_TARGET && *x == 2;
        }
        assert!(seen_two);
    }
}
