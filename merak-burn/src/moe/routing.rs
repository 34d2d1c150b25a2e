//! The router's decisions, made on the host from its scores: the top-k experts of every token
//! (ties broken by the lower expert index), the load of each expert, and, under a capacity
//! factor, which assignments are dropped (deterministically, by global token index).

use std::collections::HashMap;

/// The top `k` experts of each token, best first: `scores` holds `experts` values per token
/// (row-major); `bias`, when given, is added to the scores for the choice only (DeepSeek's
/// balancing bias). Equal values go to the lower expert index, so every layout chooses alike.
pub fn top_k(scores: &[f32], bias: Option<&[f32]>, experts: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(scores.len() / experts.max(1) * k);
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in scores.chunks_exact(experts.max(1)) {
        let key = |e: usize| row[e] + bias.map_or(0.0, |b| b[e]);
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        out.extend_from_slice(&order[..k]);
    }
    out
}

/// The smallest gap, over the tokens, between a token's `k`-th and `k + 1`-th best score
/// (`scores`: `experts` per token): how far the routing is from a tie that rounding could flip
/// (infinite when every expert is chosen).
pub fn min_margin(scores: &[f32], experts: usize, k: usize) -> f32 {
    if k >= experts {
        return f32::INFINITY;
    }
    let mut row = Vec::with_capacity(experts);
    scores
        .chunks_exact(experts.max(1))
        .map(|r| {
            row.clear();
            row.extend_from_slice(r);
            row.sort_by(|a, b| b.total_cmp(a));
            row[k - 1] - row[k]
        })
        .fold(f32::INFINITY, f32::min)
}

/// How many assignments each of `experts` experts got in `choice` (expert ids).
pub fn loads(choice: &[usize], experts: usize) -> Vec<usize> {
    let mut n = vec![0; experts];
    for &e in choice {
        n[e] += 1;
    }
    n
}

/// How many assignments each of `experts` experts got in each routing group of
/// `tokens_per_group` consecutive tokens of `choice` (`k` expert ids per token): `[groups][E]`,
/// group-major.
pub fn group_loads(
    choice: &[usize],
    experts: usize,
    k: usize,
    tokens_per_group: usize,
) -> Vec<usize> {
    choice
        .chunks(k * tokens_per_group.max(1))
        .flat_map(|group| loads(group, experts))
        .collect()
}

/// Which assignments a capacity of `capacity` tokens per expert keeps, per routing group:
/// `tokens` holds each token's global index and its `k` choices (`k` experts after the index,
/// `1 + k` values per token, any order of tokens, the whole routing groups' tokens), and the
/// tokens whose global indices divided by `span` are equal form one group (`span` at least
/// the largest index: one group). Within a group, tokens are served in global index order,
/// each token's choices best first; an expert that is full drops the rest. Returns, per global
/// token index, which of its `k` choices are kept.
pub fn capacity_keeps(
    tokens: &[usize],
    k: usize,
    capacity: usize,
    span: usize,
) -> HashMap<usize, Vec<bool>> {
    let mut tokens: Vec<&[usize]> = tokens.chunks_exact(1 + k).collect();
    tokens.sort_by_key(|t| t[0]);
    let mut taken: HashMap<(usize, usize), usize> = HashMap::new();
    tokens
        .into_iter()
        .map(|t| {
            let group = t[0] / span.max(1);
            let keep = t[1..]
                .iter()
                .map(|&e| {
                    let n = taken.entry((group, e)).or_insert(0);
                    *n += 1;
                    *n <= capacity
                })
                .collect();
            (t[0], keep)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_best_and_breaks_ties_by_the_lower_expert() {
        let scores = [0.1, 0.4, 0.4, 0.1, /* token 2 */ 0.7, 0.1, 0.1, 0.1];
        assert_eq!(top_k(&scores, None, 4, 2), vec![1, 2, 0, 1]);
        // A bias moves the choice, not the scores.
        let bias = [0.0, 0.0, 0.0, 1.0];
        assert_eq!(top_k(&scores, Some(&bias), 4, 2), vec![3, 1, 3, 0]);
        assert_eq!(loads(&[1, 2, 0, 1], 4), vec![1, 2, 1, 0]);
        // Token 1's second and third scores tie: no margin.
        assert_eq!(min_margin(&scores, 4, 1), 0.0);
        assert!((min_margin(&scores[4..], 4, 1) - 0.6).abs() < 1e-6);
        assert_eq!(min_margin(&scores, 4, 4), f32::INFINITY);
    }

    #[test]
    fn capacity_serves_tokens_in_global_order_whatever_order_they_come_in() {
        // Three tokens all choosing expert 0 first, capacity 2: token 9 (the last) loses it.
        let group = [9, 0, 1, /* */ 4, 0, 2, /* */ 7, 0, 1];
        let keeps = capacity_keeps(&group, 2, 2, usize::MAX);
        assert_eq!(keeps[&4], vec![true, true]);
        assert_eq!(keeps[&7], vec![true, true]);
        assert_eq!(keeps[&9], vec![false, true]);
        let mut reversed: Vec<usize> = group.chunks(3).rev().flatten().copied().collect();
        assert_eq!(capacity_keeps(&reversed, 2, 2, usize::MAX), keeps);
        reversed.truncate(3);
        assert_eq!(
            capacity_keeps(&reversed, 2, 2, usize::MAX)[&7],
            vec![true, true]
        );
    }

    #[test]
    fn capacity_counts_each_group_apart() {
        // Groups of 5 indices (sequences of 5 tokens): tokens 4 and 7 are in groups 0 and 1,
        // token 9 in group 1 after token 7. At capacity 1, token 4 keeps expert 0 in group 0,
        // token 7 keeps it in group 1 and token 9 loses it there.
        let tokens = [9, 0, 1, /* */ 4, 0, 2, /* */ 7, 0, 1];
        let keeps = capacity_keeps(&tokens, 2, 1, 5);
        assert_eq!(keeps[&4], vec![true, true]);
        assert_eq!(keeps[&7], vec![true, true]);
        assert_eq!(keeps[&9], vec![false, false]);
        // One group of all: token 7 loses expert 0 to token 4 too.
        assert_eq!(capacity_keeps(&tokens, 2, 1, 10)[&7], vec![false, true]);
        // Loads per group of 2 tokens: [0, 1] and [0, 2] of 4 experts, then [3, 3].
        let choice = [0, 1, 0, 2, 3, 3];
        assert_eq!(
            group_loads(&choice, 4, 2, 2),
            vec![2, 1, 1, 0, /* */ 0, 0, 0, 2]
        );
        assert_eq!(group_loads(&choice, 4, 2, 3), loads(&choice, 4));
    }
}
