//! The host-side bookkeeping of expert parallelism: which rows leave for which rank, and how
//! the rows that arrive are grouped by local expert and put back.

use crate::expert_ops::ExchangeCounts;

/// The assignments of one micro-batch that leave this rank, sorted by expert (so by the rank
/// that holds it), then by token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// The token (row of the layer's input) of each row sent.
    pub tokens: Vec<i64>,
    /// The assignment (`token × k + choice`) of each row sent: which gate weighs it.
    pub slots: Vec<i64>,
    /// Rows sent per expert-parallel rank and local expert: `[ep][experts / ep]`, rank-major.
    pub per_expert: Vec<usize>,
}

impl Dispatch {
    /// The kept assignments of `choice` (`k` experts per token, `kept` alike) to `experts`
    /// experts split over `ep` ranks.
    pub fn new(choice: &[usize], kept: &[bool], k: usize, experts: usize) -> Self {
        let mut order: Vec<usize> = (0..choice.len()).filter(|&a| kept[a]).collect();
        order.sort_by_key(|&a| (choice[a], a / k));
        let mut per_expert = vec![0; experts];
        for &a in &order {
            per_expert[choice[a]] += 1;
        }
        Self {
            tokens: order.iter().map(|&a| (a / k) as i64).collect(),
            slots: order.iter().map(|&a| a as i64).collect(),
            per_expert,
        }
    }

    /// Rows for each of the `ep` ranks.
    pub fn send_counts(&self, ep: usize) -> Vec<usize> {
        let local = self.per_expert.len() / ep.max(1);
        self.per_expert
            .chunks(local.max(1))
            .map(|c| c.iter().sum())
            .collect()
    }
}

/// The rows that arrive from the `ep` ranks (rank-major blocks, each sorted by local expert),
/// regrouped expert after expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrivals {
    /// The rows of each block that go to each local expert: `[ep][local]`, rank-major.
    pub matrix: Vec<usize>,
    /// Local experts.
    pub local: usize,
}

impl Arrivals {
    /// The exchange's counts (rows from each rank) for `sent` rows to each rank.
    pub fn counts(&self, sent: Vec<usize>) -> ExchangeCounts {
        ExchangeCounts {
            send: sent,
            recv: self
                .matrix
                .chunks(self.local.max(1))
                .map(|c| c.iter().sum())
                .collect(),
        }
    }

    /// Rows for each local expert, all ranks together.
    pub fn per_expert(&self) -> Vec<usize> {
        let mut n = vec![0; self.local];
        for block in self.matrix.chunks(self.local.max(1)) {
            n.iter_mut().zip(block).for_each(|(a, b)| *a += b);
        }
        n
    }

    /// The arrived rows in expert order: entry `i` is the arrival index of the `i`-th row of
    /// local expert 0's rows (rank 0's first), then expert 1's, and so on.
    pub fn expert_order(&self) -> Vec<i64> {
        let blocks: Vec<&[usize]> = self.matrix.chunks(self.local.max(1)).collect();
        let mut starts = Vec::with_capacity(blocks.len());
        let mut at = 0;
        for b in &blocks {
            starts.push(at);
            at += b.iter().sum::<usize>();
        }
        let mut order = Vec::with_capacity(at);
        for e in 0..self.local {
            for (b, block) in blocks.iter().enumerate() {
                let first = starts[b] + block[..e].iter().sum::<usize>();
                order.extend((first..first + block[e]).map(|i| i as i64));
            }
        }
        order
    }
}

/// The inverse of a permutation.
pub fn inverse(order: &[i64]) -> Vec<i64> {
    let mut inv = vec![0; order.len()];
    for (i, &o) in order.iter().enumerate() {
        inv[o as usize] = i as i64;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_leave_by_expert_and_come_back_grouped() {
        // Three tokens, top-2 of 4 experts on 2 ranks (experts 0-1 and 2-3).
        let choice = [3, 0, 0, 2, 1, 3];
        let kept = [true, true, true, false, true, true];
        let d = Dispatch::new(&choice, &kept, 2, 4);
        assert_eq!(d.tokens, vec![0, 1, 2, 0, 2]);
        assert_eq!(d.slots, vec![1, 2, 4, 0, 5]);
        assert_eq!(d.per_expert, vec![2, 1, 0, 2]);
        assert_eq!(d.send_counts(2), vec![3, 2]);
        // Rank 0 receives its own [2, 1] and rank 1's [1, 0] for its experts 0 and 1.
        let a = Arrivals {
            matrix: vec![2, 1, 1, 0],
            local: 2,
        };
        assert_eq!(a.counts(vec![3, 2]).recv, vec![3, 1]);
        assert_eq!(a.per_expert(), vec![3, 1]);
        assert_eq!(a.expert_order(), vec![0, 1, 3, 2]);
        assert_eq!(inverse(&[0, 1, 3, 2]), vec![0, 1, 3, 2]);
        assert_eq!(inverse(&[2, 0, 1]), vec![1, 2, 0]);
    }
}
