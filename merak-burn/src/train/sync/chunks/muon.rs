//! Muon on ZeRO's chunks ([`step_muon`]): a rank holds pieces of the blocks' weight matrices
//! (its chunk of each gradient bucket may cut a matrix anywhere), and Muon's
//! orthogonalization needs each matrix whole. Per step, for the dense buckets over the shard
//! group and then for the routed experts' buckets over the ranks they are cut over:
//!
//! 1. every rank applies Burn's momentum to its pieces (element-wise, so a piece keeps its own
//!    piece of the momentum buffer, in the checkpoint's first slot);
//! 2. each matrix has one *owner* in the group, chosen the same way on every rank (the
//!    longest-first assignment of the matrices' Newton-Schulz cost to the least-loaded rank),
//!    so the orthogonalizations are shared out rather than repeated; one `all_to_all_v` sends
//!    every piece's update to its matrix's owner;
//! 3. the owner joins the pieces into this rank's tensor-parallel shard of the update and runs
//!    [`MuonStep::orthogonal_piece`] (which all-gathers a split matrix over the
//!    tensor-parallel group: the owners of a matrix on the ranks of one tensor-parallel group
//!    sit at the same data-parallel coordinate, so they call it together);
//! 4. a second `all_to_all_v` returns each piece of the result to its holder, which decays its
//!    values and subtracts the scaled update ([`MuonStep::updated`]), exactly as the whole
//!    matrix's step would.
//!
//! Each piece travels with a flag saying whether its holder saw a gradient this step; a
//! matrix is stepped when any holder did (its gradient chunks are the group's sum), and left
//! alone, momentum included, otherwise, as Burn's optimizer leaves a parameter without a
//! gradient. Traffic per rank and step: each matrix's pieces held off its owner, there and
//! back, about twice the rank's share of the Muon matrices (`2·(n-1)/n²` of them on `n` ranks).

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::{Slots, StateSlots};
use crate::comm::Group;
use crate::data_parallel::chunks::Piece;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::TrainError;
use crate::train::optim::{MuonStep, Optimizers};

use super::{Chunks, current_of, flat, values_of};

/// The backend Muon's step runs on.
type Inner<B> = <B as AutodiffBackend>::InnerBackend;

/// One Muon matrix of an exchange: its parameter (visit order) and bucket, its step and
/// learning-rate factor, and this rank's tensor-parallel shard's shape.
struct Matrix<'o, B: TrainBackend> {
    param: usize,
    bucket: usize,
    muon: &'o MuonStep<Inner<B>>,
    lr_scale: f64,
    local: [usize; 2],
}

/// This rank's piece of one matrix after the momentum: the piece (index into
/// `rank_chunks.pieces`), the update, the state before and after, and whether this rank saw a
/// gradient.
struct Held<B: TrainBackend> {
    piece: usize,
    update: Vec<f32>,
    before: Option<Slots<Inner<B>, 1>>,
    after: Option<Slots<Inner<B>, 1>>,
    seen: bool,
}

/// Whether a matrix steps, and its orthogonalized update (or a piece of it; empty when it does
/// not step and was not computed).
type Orthogonal = (bool, Vec<f32>);

/// The step's values: this rank's chunks (ZeRO-3) or every parameter's (ZeRO-1 and 2).
type Values<'a> = (&'a [Vec<f32>], bool);

/// Steps this rank's pieces of the Muon matrices at `lr` (see the [module](self)), from the
/// step's `grads` (this rank's chunks) and whether this rank `seen` each parameter's gradient:
/// their new values into `mine` (this rank's chunks), their state into `chunks.states`. Every rank of
/// the shard group (and of the experts' group, and the owners over the tensor-parallel group)
/// calls it in the same step.
pub(super) fn step_muon<B: TrainBackend, M: TrainModel<B>>(
    chunks: &mut Chunks<'_, B>,
    (grads, seen): (&[Vec<f32>], &[bool]),
    values: Values<'_>,
    (lr, optim): (f64, &Optimizers<M, B>),
    mine: &mut [Vec<f32>],
) -> Result<(), TrainError> {
    for apart in [false, true] {
        let matrices = matrices_of(chunks, optim, apart);
        if matrices.is_empty() {
            continue;
        }
        let group = match apart {
            true => chunks.experts,
            false => chunks.shard,
        };
        let ex = Exchange::new(chunks, &matrices, group);
        let mut held = momentum(chunks, &ex, grads, seen)?;
        let joined = ex.to_owners(&held)?;
        let results = orthogonalize(chunks, &ex, joined)?;
        let back = ex.to_holders(&results, &held)?;
        for (i, (stepped, x)) in back {
            let h = held.remove(&i).ok_or_else(|| missing("a returned piece"))?;
            let m = &ex.matrices[i];
            let p = chunks.rank_chunks.pieces[h.piece];
            let current = current_of(values, &p);
            let dst = &mut mine[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            if !stepped {
                dst.copy_from_slice(current);
                chunks.states[h.piece] = h.before;
                continue;
            }
            let device = &chunks.device;
            let new = (m.muon).updated(
                flat::<Inner<B>>(current, device),
                flat::<Inner<B>>(&x, device),
                lr * m.lr_scale,
                m.local,
            );
            dst.copy_from_slice(&values_of(new)?);
            chunks.states[h.piece] = h.after;
        }
    }
    Ok(())
}

/// The Muon matrices in the dense buckets (or, with `apart`, the routed experts' buckets), in
/// visit order: the same list on every rank of the group and of the tensor-parallel group.
fn matrices_of<'o, B: TrainBackend, M: TrainModel<B>>(
    chunks: &Chunks<'_, B>,
    optim: &'o Optimizers<M, B>,
    apart: bool,
) -> Vec<Matrix<'o, B>> {
    let buckets = &chunks.rank_chunks.buckets;
    let mut out = Vec::new();
    for (param, (shape, &(offset, _))) in chunks.params.iter().zip(&chunks.ranges).enumerate() {
        let Some((group, lr_scale)) = optim.group_of(shape.id) else {
            continue;
        };
        let (Some(muon), &[rows, cols]) = (group.muon(), &shape.shape[..]) else {
            continue;
        };
        let Some(bucket) = buckets
            .iter()
            .position(|c| (c.start..c.start + c.len).contains(&offset))
        else {
            continue;
        };
        if chunks.rank_chunks.apart[bucket] == apart {
            out.push(Matrix {
                param,
                bucket,
                muon,
                lr_scale,
                local: [rows, cols],
            });
        }
    }
    out
}

/// Who owns which matrix of one exchange, and which part of each matrix every rank holds.
struct Exchange<'m, 'o, B: TrainBackend> {
    matrices: &'m [Matrix<'o, B>],
    group: Group,
    /// The owner (rank in `group`) of each matrix.
    owner: Vec<usize>,
    /// `parts[i][q]`: the elements of matrix `i` rank `q` holds.
    parts: Vec<Vec<Range<usize>>>,
}

impl<'m, 'o, B: TrainBackend> Exchange<'m, 'o, B> {
    /// The exchange of `matrices` over `group`, with its owners.
    fn new(chunks: &Chunks<'_, B>, matrices: &'m [Matrix<'o, B>], group: Group) -> Self {
        let n = group.size();
        let parts = (matrices.iter())
            .map(|m| {
                let (offset, len) = chunks.ranges[m.param];
                let bucket = &chunks.rank_chunks.buckets[m.bucket];
                (0..n)
                    .map(|q| {
                        let r = bucket.range_of(q);
                        let (first, end) = (r.start.max(offset), r.end.min(offset + len));
                        match first < end {
                            true => first - offset..end - offset,
                            false => 0..0,
                        }
                    })
                    .collect()
            })
            .collect();
        let costs: Vec<f64> = matrices.iter().map(|m| cost(m, chunks)).collect();
        Self {
            matrices,
            group,
            owner: owners(&costs, n),
            parts,
        }
    }

    /// The matrices rank `q` owns, in list order.
    fn owned_by(&self, q: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.matrices.len()).filter(move |&i| self.owner[i] == q)
    }

    /// Sends every held piece's update to its matrix's owner; returns, for each matrix this
    /// rank owns, its joined shard of the update and whether any holder saw a gradient.
    fn to_owners(&self, held: &HashMap<usize, Held<B>>) -> Result<Vec<Joined>, TrainError> {
        let (n, me) = (self.group.size(), self.group.rank());
        let (mut send, mut send_counts) = (Vec::new(), vec![0; n]);
        for (q, count) in send_counts.iter_mut().enumerate() {
            for i in self.owned_by(q) {
                if let Some(h) = held.get(&i) {
                    send.push(f32::from(u8::from(h.seen)));
                    send.extend_from_slice(&h.update);
                    *count += 1 + h.update.len();
                }
            }
        }
        let recv_counts = self.counts(|q| self.owned_by(me).map(move |i| (i, q)));
        let recv = self.all_to_all(&send, &send_counts, &recv_counts)?;
        let mut joined: HashMap<usize, Joined> = (self.owned_by(me))
            .map(|i| (i, Joined::new(self.matrices[i].local)))
            .collect();
        let mut at = 0;
        for q in 0..n {
            for i in self.owned_by(me) {
                let part = self.parts[i][q].clone();
                if part.is_empty() {
                    continue;
                }
                let j = joined
                    .get_mut(&i)
                    .ok_or_else(|| missing("an owned matrix"))?;
                j.seen |= recv[at] != 0.0;
                j.values[part.clone()].copy_from_slice(&recv[at + 1..at + 1 + part.len()]);
                at += 1 + part.len();
            }
        }
        let mut out: Vec<(usize, Joined)> = joined.into_iter().collect();
        out.sort_by_key(|(i, _)| *i);
        Ok(out.into_iter().map(|(_, j)| j).collect())
    }

    /// Returns each piece of the owned matrices' results (`results`, in [`owned_by`] order) to
    /// its holder; returns this rank's pieces (by matrix) with whether their matrix stepped.
    ///
    /// [`owned_by`]: Self::owned_by
    fn to_holders(
        &self,
        results: &[Orthogonal],
        held: &HashMap<usize, Held<B>>,
    ) -> Result<Vec<(usize, Orthogonal)>, TrainError> {
        let (n, me) = (self.group.size(), self.group.rank());
        let (mut send, mut send_counts) = (Vec::new(), vec![0; n]);
        for (q, count) in send_counts.iter_mut().enumerate() {
            for (i, (stepped, x)) in self.owned_by(me).zip(results) {
                let part = self.parts[i][q].clone();
                if part.is_empty() {
                    continue;
                }
                send.push(f32::from(u8::from(*stepped)));
                match stepped {
                    true => send.extend_from_slice(&x[part.clone()]),
                    false => send.extend(std::iter::repeat_n(0.0, part.len())),
                }
                *count += 1 + part.len();
            }
        }
        let recv_counts = self.counts(|q| self.owned_by(q).map(move |i| (i, me)));
        let recv = self.all_to_all(&send, &send_counts, &recv_counts)?;
        let mut out = Vec::new();
        let mut at = 0;
        for q in 0..n {
            for i in self.owned_by(q).filter(|i| held.contains_key(i)) {
                let len = self.parts[i][me].len();
                out.push((i, (recv[at] != 0.0, recv[at + 1..at + 1 + len].to_vec())));
                at += 1 + len;
            }
        }
        Ok(out)
    }

    /// The values each rank `q` sends: a flag and the elements of `parts[i][r]` for each
    /// `(i, r)` of `pairs(q)` where that part is not empty.
    fn counts<I: Iterator<Item = (usize, usize)>>(&self, pairs: impl Fn(usize) -> I) -> Vec<usize> {
        (0..self.group.size())
            .map(|q| {
                pairs(q)
                    .map(|(i, r)| self.parts[i][r].len())
                    .filter(|&len| len > 0)
                    .map(|len| len + 1)
                    .sum()
            })
            .collect()
    }

    /// `all_to_all_v` over the group (the send buffer itself on one rank).
    fn all_to_all(
        &self,
        send: &[f32],
        send_counts: &[usize],
        recv_counts: &[usize],
    ) -> Result<Vec<f32>, TrainError> {
        if self.group.size() == 1 {
            return Ok(send.to_vec());
        }
        let mut recv = vec![0.0; recv_counts.iter().sum()];
        (self.group.comm()?).all_to_all_v(send, send_counts, &mut recv, recv_counts)?;
        Ok(recv)
    }
}

/// An owned matrix's shard of the update, joined from its holders' pieces.
struct Joined {
    values: Vec<f32>,
    seen: bool,
}

impl Joined {
    /// Zeros of a `[rows, cols]` shard, seen by no one yet.
    fn new([rows, cols]: [usize; 2]) -> Self {
        Self {
            values: vec![0.0; rows * cols],
            seen: false,
        }
    }
}

/// Burn's momentum on each of this rank's pieces of the exchange's matrices (by matrix).
fn momentum<B: TrainBackend>(
    chunks: &mut Chunks<'_, B>,
    ex: &Exchange<'_, '_, B>,
    grads: &[Vec<f32>],
    seen: &[bool],
) -> Result<HashMap<usize, Held<B>>, TrainError> {
    let me = ex.group.rank();
    let of_param: HashMap<usize, usize> = (ex.matrices.iter().enumerate())
        .map(|(i, m)| (m.param, i))
        .collect();
    let mut held = HashMap::new();
    for (k, p) in chunks.rank_chunks.pieces.iter().enumerate() {
        let Some(&i) = of_param.get(&p.param) else {
            continue;
        };
        check_piece(p, &ex.parts[i][me])?;
        let muon = ex.matrices[i].muon;
        let before = chunks.states[k].take();
        let state = before.as_ref().map(|s| muon.state_from_slots(copy(s)));
        let grad = &grads[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
        let (update, state) = muon.momentum(flat::<Inner<B>>(grad, &chunks.device), state);
        let after = (muon.slots_of_state(state, &chunks.device))
            .map_err(|e| TrainError::ZeroValues(format!("Muon's momentum of a piece: {e}")))?;
        held.insert(
            i,
            Held {
                piece: k,
                update: values_of(update)?,
                before,
                after,
                seen: seen.get(p.param).copied().unwrap_or(false),
            },
        );
    }
    Ok(held)
}

/// Each owned matrix's piece of its orthogonalized update (in [`Exchange::owned_by`] order),
/// and whether it steps. A matrix split over the tensor-parallel group is orthogonalized even
/// when no holder saw a gradient, since its group's owners gather it together.
fn orthogonalize<B: TrainBackend>(
    chunks: &Chunks<'_, B>,
    ex: &Exchange<'_, '_, B>,
    joined: Vec<Joined>,
) -> Result<Vec<Orthogonal>, TrainError> {
    let owned = ex.owned_by(ex.group.rank());
    (owned.zip(joined))
        .map(|(i, j)| {
            let m = &ex.matrices[i];
            if !j.seen && !m.muon.split_over_tp() {
                return Ok((false, Vec::new()));
            }
            let shard = TensorData::new(j.values, m.local);
            let x = m
                .muon
                .orthogonal_piece(Tensor::from_data(shard, &chunks.device));
            let x = crate::host_read::floats(x).map_err(|e| TrainError::ZeroValues(e.0))?;
            Ok((j.seen, x))
        })
        .collect()
}

/// The Newton-Schulz cost of a matrix, from its whole shape (the same on every
/// tensor-parallel rank): its larger side times the square of the smaller.
fn cost<B: TrainBackend>(m: &Matrix<'_, B>, chunks: &Chunks<'_, B>) -> f64 {
    let shape = &chunks.params[m.param];
    let tp = chunks.grid.tp.size();
    let full = shape.split.full_shape(&shape.shape, tp);
    let (a, b) = (full[0] as f64, full.get(1).copied().unwrap_or(1) as f64);
    a.max(b) * a.min(b) * a.min(b)
}

/// The owner of each matrix of `costs` among `n` ranks: the costliest first, each to the rank
/// with the least cost so far (the lowest rank among equals).
fn owners(costs: &[f64], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut load = vec![0.0f64; n.max(1)];
    let mut owner = vec![0; costs.len()];
    for i in order {
        let least = (0..load.len())
            .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
            .unwrap_or(0);
        owner[i] = least;
        load[least] += costs[i];
    }
    owner
}

/// The piece `p` covers exactly the part of its matrix the exchange says this rank holds.
fn check_piece(p: &Piece, part: &Range<usize>) -> Result<(), TrainError> {
    match (p.param_start..p.param_start + p.len) == *part {
        true => Ok(()),
        false => Err(TrainError::ZeroValues(format!(
            "a Muon matrix's piece {}..{} is not the part {part:?} its chunk holds",
            p.param_start,
            p.param_start + p.len
        ))),
    }
}

/// A copy of `s` (its tensors shared).
fn copy<B: burn::tensor::backend::Backend>(s: &Slots<B, 1>) -> Slots<B, 1> {
    Slots {
        time: s.time,
        m1: s.m1.clone(),
        m2: s.m2.clone(),
    }
}

/// The error of a piece the exchange lost.
fn missing(what: &str) -> TrainError {
    TrainError::ZeroValues(format!("Muon's exchange lost {what}"))
}

#[cfg(test)]
mod tests {
    use super::owners;

    #[test]
    fn owners_share_the_cost_costliest_first() {
        assert_eq!(owners(&[1.0, 8.0, 4.0, 4.0], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[3.0, 3.0, 3.0], 3), vec![0, 1, 2]);
        assert_eq!(owners(&[5.0, 1.0], 1), vec![0, 0]);
    }
}
