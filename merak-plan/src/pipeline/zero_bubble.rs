//! Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism"): the compute orders of
//! ZB-H1 (one stage per rank) and ZB-V (two stages per rank in a V), whose backward is split
//! into B (input gradient) and W (weight gradients).

use super::order::Op;

/// The ZB-H1 compute order on `rank` of `ranks`: 1F1B's warm-up forwards; then one forward and
/// one B per micro-batch, where the first `rank` micro-batches' W passes are postponed and
/// every later B is followed by the oldest pending W; then the cool-down, each B followed by a
/// W; then the postponed W passes, which fill the tail 1F1B leaves idle (longest on the last
/// rank). At most `ranks` micro-batches are between their forward and their W on any rank.
pub(crate) fn zb_h1_order(ranks: usize, micro_batches: usize, rank: usize) -> Vec<Op> {
    let warmup = ranks.saturating_sub(rank + 1).min(micro_batches);
    let mut order = Vec::with_capacity(3 * micro_batches);
    let (mut b, mut w) = (0, 0);
    order.extend((0..warmup).map(|mb| Op::F(mb, rank)));
    for f in warmup..micro_batches {
        order.push(Op::F(f, rank));
        order.push(Op::B(b, rank));
        b += 1;
        if b > rank {
            order.push(Op::W(w, rank));
            w += 1;
        }
    }
    for mb in b..micro_batches {
        order.push(Op::B(mb, rank));
        order.push(Op::W(w, rank));
        w += 1;
    }
    order.extend((w..micro_batches).map(|mb| Op::W(mb, rank)));
    order
}

/// The rank of global stage `stage` of a V-shaped pipeline over `ranks` ranks: stages
/// `0..p` go down the ranks, stages `p..2p` come back up (rank `r` holds `r` and `2p-1-r`, so
/// the first and the last stage share rank 0 and the middle two rank `p-1`).
pub(crate) fn v_rank_of(ranks: usize, stage: usize) -> usize {
    if stage < ranks {
        stage
    } else {
        (2 * ranks).saturating_sub(stage + 1)
    }
}

/// The ZB-V compute orders of every rank: two stages per rank in a V ([`v_rank_of`]), found by
/// running the pipeline in unit time (forward, B and W one unit each, free messages) and
/// letting each free rank take, in this order of preference:
/// - the B whose output gradient is there (the later stage first), which the previous stage
///   waits for;
/// - the next forward whose input is there (the later stage first), while the rank holds
///   fewer than `2p` stage micro-batches between a forward and its W (1F1B's peak: `p`
///   micro-batches of a rank's whole share of the model);
/// - the oldest pending W, which nobody waits for.
///
/// Each stage runs its forwards and its B passes in micro-batch order. The result is a valid
/// schedule by construction (every input exists before it is used in the unit-time run, so
/// the lists cannot deadlock); `None` if the run stalls (it does not for any tested shape).
pub(crate) fn zb_v_orders(ranks: usize, micro_batches: usize) -> Option<Vec<Vec<Op>>> {
    let mut run = VRun::new(ranks, micro_batches);
    while !run.finished() {
        let progressed = run.tick();
        if !progressed && run.idle() {
            return None;
        }
    }
    Some(run.orders)
}

/// The unit-time run of [`zb_v_orders`].
struct VRun {
    p: usize,
    m: usize,
    time: usize,
    /// Finish time of F and B per (stage, micro-batch).
    f_done: Vec<Vec<Option<usize>>>,
    b_done: Vec<Vec<Option<usize>>>,
    /// Next micro-batch of each stage's forwards and B passes.
    next_f: Vec<usize>,
    next_b: Vec<usize>,
    /// Per rank: its W passes not yet run (FIFO), stage micro-batches held, and when it is free.
    pending_w: Vec<std::collections::VecDeque<(usize, usize)>>,
    held: Vec<usize>,
    free_at: Vec<usize>,
    orders: Vec<Vec<Op>>,
}

impl VRun {
    fn new(p: usize, m: usize) -> Self {
        let stages = 2 * p;
        VRun {
            p,
            m,
            time: 0,
            f_done: vec![vec![None; m]; stages],
            b_done: vec![vec![None; m]; stages],
            next_f: vec![0; stages],
            next_b: vec![0; stages],
            pending_w: vec![Default::default(); p],
            held: vec![0; p],
            free_at: vec![0; p],
            orders: vec![Vec::new(); p],
        }
    }

    fn finished(&self) -> bool {
        self.orders.iter().map(Vec::len).sum::<usize>() == 3 * 2 * self.p * self.m
    }

    /// Whether no rank is busy now.
    fn idle(&self) -> bool {
        self.free_at.iter().all(|&t| t <= self.time)
    }

    /// Whether (stage, mb)'s F or B is done by now.
    fn done(&self, table: &[Vec<Option<usize>>], stage: usize, mb: usize) -> bool {
        table[stage][mb].is_some_and(|t| t <= self.time)
    }

    /// The two stages of `rank`, the later one first.
    fn stages_of(&self, rank: usize) -> [usize; 2] {
        [2 * self.p - 1 - rank, rank]
    }

    fn ready_b(&self, rank: usize) -> Option<(usize, usize)> {
        self.stages_of(rank).into_iter().find_map(|s| {
            let mb = self.next_b[s];
            let grad = s + 1 == 2 * self.p || (mb < self.m && self.done(&self.b_done, s + 1, mb));
            (mb < self.m && self.done(&self.f_done, s, mb) && grad).then_some((s, mb))
        })
    }

    fn ready_f(&self, rank: usize) -> Option<(usize, usize)> {
        if self.held[rank] >= 2 * self.p {
            return None;
        }
        self.stages_of(rank).into_iter().find_map(|s| {
            let mb = self.next_f[s];
            let input = s == 0 || (mb < self.m && self.done(&self.f_done, s - 1, mb));
            (mb < self.m && input).then_some((s, mb))
        })
    }

    /// Lets every free rank take one action; returns whether any did, and advances the clock.
    fn tick(&mut self) -> bool {
        let mut progressed = false;
        let end = self.time + 1;
        for rank in 0..self.p {
            if self.free_at[rank] > self.time {
                continue;
            }
            let op = if let Some((s, mb)) = self.ready_b(rank) {
                self.b_done[s][mb] = Some(end);
                self.next_b[s] += 1;
                self.pending_w[rank].push_back((s, mb));
                Op::B(mb, s)
            } else if let Some((s, mb)) = self.ready_f(rank) {
                self.f_done[s][mb] = Some(end);
                self.next_f[s] += 1;
                self.held[rank] += 1;
                Op::F(mb, s)
            } else if let Some((s, mb)) = self.pending_w[rank].pop_front() {
                self.held[rank] -= 1;
                Op::W(mb, s)
            } else {
                continue;
            };
            self.orders[rank].push(op);
            self.free_at[rank] = end;
            progressed = true;
        }
        self.time = end;
        progressed
    }
}
