//! DualPipeV (DeepSeek's DualPipe cut in half to one V): the compute order of a rank that holds
//! two stages in a V (rank `r` of `p` holds stage `r` going down and stage `2p-1-r` coming
//! back up) with the backward split into B and W, whose steady state runs the forward pass of
//! one of its stages and the backward pass of the other as one overlapped pair.

use std::collections::VecDeque;

use super::order::Op;

/// The compute order of `rank` of `ranks` for `micro_batches` (at least `2 ranks`), in eight
/// phases; chunk 0 is the rank's stage on the way down, chunk 1 the one on the way up, and
/// each chunk runs its forwards and its backwards in micro-batch order:
///
/// 1. `2(p-r-1)` forwards of chunk 0 (the warm-up of the way down);
/// 2. `r+1` times a forward of chunk 0 then one of chunk 1;
/// 3. `p-r-1` times B of chunk 1, the W it leaves, a forward of chunk 1;
/// 4. the steady state, `m-2p+r+1` times: the pair (forward of chunk 0, backward of
///    chunk 1), then the pair (forward of chunk 1, backward of chunk 0); the last rank runs its
///    first of these apart (its two stages are adjacent, so its chunk 1 backward needs no
///    message to wait for);
/// 5. `p-r-1` times a backward of chunk 1, then the pair (forward of chunk 1, backward of
///    chunk 0);
/// 6. `r+1` times a backward of chunk 1 then one of chunk 0, the second half leaving their W
///    for later;
/// 7. `p-r-1` times a postponed W then a backward of chunk 0 that postpones its own;
/// 8. the `r+1` W passes left.
///
/// Every backward's W follows it at once unless it is postponed, and postponed W passes run
/// oldest first where the rank would wait (phases 3, 7 and 8), as in DualPipeV's reference
/// order. A pair's W comes after the next pair when one follows, so that it is still pending
/// while that pair's forward runs: the executor computes its weight-gradient products while
/// the forward's expert all-to-alls travel.
pub(crate) fn dual_pipe_v_order(ranks: usize, micro_batches: usize, rank: usize) -> Vec<Op> {
    let (p, r) = (ranks, rank);
    let mut o = RankOrder::new(p, r, micro_batches);
    let before = p - r - 1;
    for _ in 0..2 * before {
        o.forward(0);
    }
    for _ in 0..=r {
        o.forward(0);
        o.forward(1);
    }
    for _ in 0..before {
        o.backward(1, true);
        o.weight();
        o.forward(1);
    }
    for i in 0..(micro_batches + r + 1).saturating_sub(2 * p) {
        if i == 0 && r + 1 == p {
            o.forward(0);
            o.backward(1, false);
        } else {
            o.pair(0, 1);
        }
        o.pair(1, 0);
    }
    for _ in 0..before {
        o.backward(1, false);
        o.pair(1, 0);
    }
    let mut postpone = false;
    for i in 0..=r {
        let half = i == r.div_ceil(2);
        postpone |= half && r % 2 == 1;
        o.backward(1, postpone);
        postpone |= half && r % 2 == 0;
        o.backward(0, postpone);
    }
    for _ in 0..before {
        o.weight();
        o.backward(0, true);
    }
    while o.waiting.front().is_some() {
        o.weight();
    }
    o.flush();
    o.order
}

/// One rank's order as it is built: the next micro-batch of each chunk's forwards and
/// backwards, and the postponed W passes.
struct RankOrder {
    order: Vec<Op>,
    stage: [usize; 2],
    next_forward: [usize; 2],
    next_backward: [usize; 2],
    waiting: VecDeque<(usize, usize)>,
    /// The W of the last pair, placed after the next action (a pair) or before any other.
    pair_weight: Option<(usize, usize)>,
}

impl RankOrder {
    fn new(p: usize, r: usize, m: usize) -> Self {
        RankOrder {
            order: Vec::with_capacity(6 * m),
            stage: [r, 2 * p - 1 - r],
            next_forward: [0; 2],
            next_backward: [0; 2],
            waiting: VecDeque::new(),
            pair_weight: None,
        }
    }

    fn take_forward(&mut self, chunk: usize) -> (usize, usize) {
        self.next_forward[chunk] += 1;
        (self.next_forward[chunk] - 1, self.stage[chunk])
    }

    fn take_backward(&mut self, chunk: usize) -> (usize, usize) {
        self.next_backward[chunk] += 1;
        (self.next_backward[chunk] - 1, self.stage[chunk])
    }

    /// Places the last pair's W, if it waits.
    fn flush(&mut self) {
        if let Some((mb, stage)) = self.pair_weight.take() {
            self.order.push(Op::W(mb, stage));
        }
    }

    fn forward(&mut self, chunk: usize) {
        self.flush();
        let (mb, stage) = self.take_forward(chunk);
        self.order.push(Op::F(mb, stage));
    }

    /// B of `chunk`'s next micro-batch, and its W at once unless `postpone`.
    fn backward(&mut self, chunk: usize, postpone: bool) {
        self.flush();
        let (mb, stage) = self.take_backward(chunk);
        self.order.push(Op::B(mb, stage));
        self.weight_of(mb, stage, postpone);
    }

    /// The pair (forward of `forward_chunk`, backward of `backward_chunk`), then the W of
    /// the pair before it; its own W waits for the next action.
    fn pair(&mut self, forward_chunk: usize, backward_chunk: usize) {
        let forward = self.take_forward(forward_chunk);
        let backward = self.take_backward(backward_chunk);
        self.order.push(Op::Pair(forward, backward));
        self.flush();
        self.pair_weight = Some(backward);
    }

    fn weight_of(&mut self, mb: usize, stage: usize, postpone: bool) {
        if postpone {
            self.waiting.push_back((mb, stage));
        } else {
            self.order.push(Op::W(mb, stage));
        }
    }

    /// The oldest postponed W.
    fn weight(&mut self) {
        self.flush();
        if let Some((mb, stage)) = self.waiting.pop_front() {
            self.order.push(Op::W(mb, stage));
        }
    }
}
