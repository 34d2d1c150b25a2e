//! What ZeRO's two kinds ([`ShardedState`](super::ShardedState) and
//! [`ShardedParams`](super::ShardedParams)) share ([`Chunks`]): this rank's chunk of every
//! gradient bucket and the pieces of the parameters in them, the optimizer state of each
//! piece, the norm of the chunks, each piece stepped by its group's optimizer, and the new
//! values all-gathered. The pieces' state is gathered into whole tensors only when a
//! checkpoint is written, so checkpoints stay layout-free and resume under any stage and
//! layout.

use std::collections::HashMap;

use burn::module::{AutodiffModule, ModuleMapper, Param, ParamId};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::checkpoint::state::ParamShape;
use crate::checkpoint::{Moments, Slots, TensorPiece};
use crate::comm::Group;
use crate::data_parallel::chunks::{Piece, RankChunks};
use crate::data_parallel::{DataParallel, DpStats, all_gather_each};
use crate::grid::ProcessGrid;
use crate::pipeline::{TrainBackend, TrainModel};
use crate::train::grad_norm::LocalSquares;
use crate::train::hybrid::ShardGroups;
use crate::train::optim::Optimizers;
use crate::train::param_values::for_each_param;
use crate::train::tied::sum_tied_chunk;
use crate::train::{GradStats, TrainError};

use super::NormParts;

mod muon;

/// A rank's ZeRO state: its chunks of the gradient buckets, the pieces of the parameters in
/// them and the optimizer state of each piece.
pub(crate) struct Chunks<'g, B: TrainBackend> {
    /// The reducer, reading this rank's chunks.
    pub reducer: DataParallel,
    pub grid: &'g ProcessGrid,
    /// The ranks that share one copy's chunks (`grid.dp` unless hybrid sharding).
    pub shard: Group,
    /// The ranks the chunks of routed experts held apart are cut over: the expert group, or
    /// under hybrid sharding its ranks in this rank's shard group.
    pub experts: Group,
    /// This rank's copy of a tied embedding.
    pub tied: Option<ParamId>,
    pub device: B::Device,
    /// This rank's pieces of the flat gradients.
    pub rank_chunks: RankChunks,
    /// Each parameter's `(offset, len)` in the flat gradients, in visit order.
    pub ranges: Vec<(usize, usize)>,
    /// Each parameter's name, id and shape, in visit order.
    pub params: Vec<ParamShape>,
    /// The optimizer state of each piece (in `rank_chunks.pieces` order), once it has stepped.
    pub states: Vec<Option<Slots<B::InnerBackend, 1>>>,
    /// The step's gradients: this rank's chunk of every bucket (after
    /// [`finish`](Self::finish)).
    pub grads: Vec<Vec<f32>>,
}

impl<'g, B: TrainBackend> Chunks<'g, B> {
    /// The chunks `reducer` (reading chunks, cut over `groups`) hands this rank of the
    /// parameters `params`, before any step.
    pub fn new(
        reducer: DataParallel,
        grid: &'g ProcessGrid,
        groups: ShardGroups,
        tied: Option<ParamId>,
        device: B::Device,
        params: Vec<ParamShape>,
    ) -> Self {
        let (rank_chunks, ranges) = (reducer.rank_chunks(), reducer.param_ranges());
        let states = (0..rank_chunks.pieces.len()).map(|_| None).collect();
        Self {
            reducer,
            grid,
            shard: groups.shard,
            experts: groups.experts,
            tied,
            device,
            rank_chunks,
            ranges,
            params,
            states,
            grads: Vec::new(),
        }
    }

    /// The pieces' state from whole-tensor `moments` (by name; a checkpoint's, cut for this
    /// rank's tensor-parallel shard).
    pub fn load(&mut self, moments: &HashMap<String, Moments>) {
        for (k, p) in self.rank_chunks.pieces.iter().enumerate() {
            let Some(m) = moments.get(&self.params[p.param].name) else {
                continue;
            };
            let range = p.param_start..p.param_start + p.len;
            let (Some(m1), Some(m2)) = (m.m1.get(range.clone()), m.m2.get(range)) else {
                continue;
            };
            self.states[k] = Some(Slots {
                time: m.time,
                m1: flat::<B::InnerBackend>(m1, &self.device),
                m2: Some(flat::<B::InnerBackend>(m2, &self.device)),
            });
        }
    }

    /// Waits for the reduction and keeps this rank's chunks, the tied copy's bucket summed
    /// with the partner stage's.
    pub fn finish(&mut self) -> Result<DpStats, TrainError> {
        let (mut chunks, dp) = self.reducer.finish_chunks()?;
        let tied = (self.tied).and_then(|id| self.reducer.bucket_of(id));
        if let Some(chunk) = tied.and_then(|b| chunks.get_mut(b)) {
            sum_tied_chunk(chunk, self.grid)?;
        }
        self.grads = chunks;
        Ok(dp)
    }

    /// This rank's squared gradient norms from its pieces, summed over the ranks of one copy
    /// (the routed experts' held apart over those holding the same experts): host values,
    /// nothing left to read from the device.
    pub fn squares(&self, parts: &NormParts) -> Result<LocalSquares<B::InnerBackend>, TrainError> {
        let mut stats = GradStats::default();
        for p in &self.rank_chunks.pieces {
            let id = self.params[p.param].id;
            if parts.not_counted.contains(&id) {
                continue;
            }
            let g = &self.grads[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let sq = crate::kernels::cpu::math::sum_of_squares(g);
            if self.rank_chunks.apart[p.bucket] {
                stats.expert_sq += sq;
            } else if parts.sharded.contains(&id) {
                stats.sharded_sq += sq;
            } else {
                stats.replicated_sq += sq;
            }
        }
        // Summed in f64, so that the norm (and the clipping) is the one of the whole
        // gradients up to the order of the additions.
        let both = sum_f64(self.shard, &[stats.sharded_sq, stats.replicated_sq])?;
        let experts = match self.rank_chunks.apart.contains(&true) {
            true => sum_f64(self.experts, &[stats.expert_sq])?[0],
            false => 0.0,
        };
        Ok(LocalSquares::known(GradStats {
            sharded_sq: both[0],
            replicated_sq: both[1],
            expert_sq: experts,
        }))
    }

    /// Starts a step: clears the reducer's buffers and drops the last step's chunks (kept
    /// when that step was skipped).
    pub fn begin_step(&mut self) {
        self.grads = Vec::new();
        self.reducer.begin_step();
    }

    /// Scales the step's chunks by `scale`.
    pub fn scale(&mut self, scale: f32) {
        self.grads.iter_mut().flatten().for_each(|g| *g *= scale);
    }

    /// Steps each piece at `lr` by its group's optimizer; returns this rank's chunks of the
    /// new values. `values`: the current values, this rank's chunks (`chunked`, ZeRO-3) or
    /// every parameter's (visit order).
    pub fn step<M: TrainModel<B>>(
        &mut self,
        values: &[Vec<f32>],
        chunked: bool,
        lr: f64,
        optim: &Optimizers<M, B>,
    ) -> Result<Vec<Vec<f32>>, TrainError> {
        let seen = self.reducer.seen();
        // The step's chunks go with the update, not through the next step's passes.
        let grads = std::mem::take(&mut self.grads);
        let mut mine: Vec<Vec<f32>> = (self.rank_chunks.buckets.iter())
            .map(|c| vec![0.0; c.chunk])
            .collect();
        for (k, p) in self.rank_chunks.pieces.iter().enumerate() {
            let current = current_of((values, chunked), p);
            let dst = &mut mine[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let param = &self.params[p.param];
            let group = optim.group_of(param.id);
            if group.is_some_and(|(g, _)| g.muon().is_some()) {
                // Muon's matrices are stepped whole, below.
                continue;
            }
            let Some((optim, lr_scale)) = group.filter(|_| seen[p.param]) else {
                // No gradient this step: the parameter keeps its values (as Burn's optimizer
                // leaves a parameter without a gradient alone).
                dst.copy_from_slice(current);
                continue;
            };
            let grad = &grads[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
            let device = &self.device;
            let step = optim.step_piece(
                &param.name,
                lr * lr_scale,
                flat::<B::InnerBackend>(current, device),
                flat::<B::InnerBackend>(grad, device),
                self.states[k].take(),
            )?;
            self.states[k] = step.state;
            dst.copy_from_slice(&values_of(step.values)?);
        }
        let muon = (&grads[..], &seen[..]);
        muon::step_muon(self, muon, (values, chunked), (lr, optim), &mut mine)?;
        Ok(mine)
    }

    /// `model` with the values of every bucket gathered from every rank's chunk of it
    /// (`mine`: this rank's).
    pub fn gather_into<M: TrainModel<B>>(
        &self,
        model: M,
        mine: Vec<Vec<f32>>,
    ) -> Result<M, TrainError> {
        let flat = self.gather(mine)?;
        let mut write = WriteParams {
            ranges: &self.ranges,
            flat: &flat,
            next: 0,
        };
        Ok(model.map(&mut write))
    }

    /// The flat values of every bucket from every rank's chunk of it (`mine`: this rank's).
    fn gather(&self, mine: Vec<Vec<f32>>) -> Result<Vec<f32>, TrainError> {
        // The dense buckets' chunks over the shard group, the experts' held apart over the
        // ranks they are cut over.
        let (mut dense, mut experts) = (Vec::new(), Vec::new());
        for (chunk, &apart) in mine.into_iter().zip(&self.rank_chunks.apart) {
            match apart {
                true => experts.push(chunk),
                false => dense.push(chunk),
            }
        }
        let mut dense = all_gather_each(&*self.shard.comm()?, dense)?.into_iter();
        let mut experts = match experts.is_empty() {
            true => Vec::new(),
            false => all_gather_each(&*self.experts.comm()?, experts)?,
        }
        .into_iter();
        let total = self.ranges.iter().map(|&(o, l)| o + l).max().unwrap_or(0);
        let mut flat = vec![0.0; total];
        for (c, &apart) in self.rank_chunks.buckets.iter().zip(&self.rank_chunks.apart) {
            let all = match apart {
                true => experts.next(),
                false => dense.next(),
            }
            .ok_or_else(|| {
                TrainError::ZeroValues("a bucket's gathered values are missing".into())
            })?;
            flat[c.start..c.start + c.len].copy_from_slice(&all[..c.len]);
        }
        Ok(flat)
    }

    /// This rank's chunks of the optimizer state (and, with `own`, ZeRO-3's chunks of the
    /// parameters) for a checkpoint: each piece's moments where it has stepped (a second
    /// moment of zeros for an optimizer that keeps one tensor). Every rank of the first copy
    /// writes its chunks; under hybrid sharding the other copies hold the same chunks, the
    /// routed experts' included (cut within each copy too).
    pub fn pieces_to_write(
        &self,
        own: Option<&[Vec<f32>]>,
    ) -> Result<Vec<TensorPiece>, TrainError> {
        if self.grid.coords.dp >= self.shard.size() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for (p, state) in self.rank_chunks.pieces.iter().zip(&self.states) {
            let name = &self.params[p.param].name;
            let piece = |kind, values, time| TensorPiece {
                kind,
                name: name.clone(),
                start: p.param_start,
                values,
                time,
            };
            if let Some(own) = own {
                let own = &own[p.bucket][p.chunk_offset..p.chunk_offset + p.len];
                out.push(piece("param", own.to_vec(), 0));
            }
            let Some(st) = state else { continue };
            let m2 = match &st.m2 {
                Some(x) => values_of(x.clone())?,
                None => vec![0.0; p.len],
            };
            out.push(piece("m1", values_of(st.m1.clone())?, st.time));
            out.push(piece("m2", m2, st.time));
        }
        Ok(out)
    }
}

/// `values` summed over the ranks of `group` in f64: each value travels as two f32 (its nearest
/// f32 and the remainder), and every rank adds them up in rank order, so all get the same bits.
fn sum_f64(group: Group, values: &[f64]) -> Result<Vec<f64>, TrainError> {
    if group.size() == 1 {
        return Ok(values.to_vec());
    }
    let split: Vec<f32> = (values.iter())
        .flat_map(|&v| {
            let hi = v as f32;
            [hi, (v - f64::from(hi)) as f32]
        })
        .collect();
    let mut all = vec![0.0f32; split.len() * group.size()];
    group.comm()?.all_gather(&split, &mut all)?;
    let mut out = vec![0.0f64; values.len()];
    for rank in all.chunks(split.len()) {
        for (o, pair) in out.iter_mut().zip(rank.chunks(2)) {
            *o += f64::from(pair[0]) + f64::from(pair[1]);
        }
    }
    Ok(out)
}

/// The current values of piece `p`: from this rank's chunks (`values`, `chunked`: ZeRO-3) or
/// from every parameter's.
fn current_of<'a>((values, chunked): (&'a [Vec<f32>], bool), p: &Piece) -> &'a [f32] {
    match chunked {
        true => &values[p.bucket][p.chunk_offset..p.chunk_offset + p.len],
        false => &values[p.param][p.param_start..p.param_start + p.len],
    }
}

/// A flat tensor of `values`.
fn flat<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
}

/// The values of a flat tensor.
fn values_of<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, TrainError> {
    crate::host_read::floats(t).map_err(|e| TrainError::ZeroValues(e.0))
}

/// Every parameter's values (visit order), read to the host.
pub(super) fn read_params<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
) -> Result<Vec<Vec<f32>>, TrainError> {
    let mut all = Vec::new();
    for_each_param(model, &mut |_, v| all.push(v))?;
    Ok(all)
}

/// Sets every float parameter (visit order) to its range of `flat`, keeping its id.
struct WriteParams<'a> {
    ranges: &'a [(usize, usize)],
    flat: &'a [f32],
    next: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteParams<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&(offset, len)) = self.ranges.get(self.next) else {
            return param;
        };
        self.next += 1;
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        let (shape, device) = (tensor.shape(), tensor.device());
        let data = TensorData::new(self.flat[offset..offset + len].to_vec(), shape);
        let mut out = Tensor::<B, D>::from_data(data, &device);
        if require_grad {
            out = out.require_grad();
        }
        Param::from_mapped_value(id, out, mapper)
    }
}

#[cfg(test)]
mod tests {
    /// The claim the slicing rests on: every optimizer merak trains with updates each element
    /// from that element alone, so stepping pieces of a parameter (cut anywhere, each with its
    /// own state) equals stepping the whole tensor, step after step.
    #[test]
    fn every_optimizer_steps_pieces_as_it_steps_the_whole_tensor() {
        use crate::backend::{Cpu, CpuAutodiff};
        use crate::train::FusedAdamW;
        use burn::module::{Module, Param};
        use burn::optim::decay::WeightDecayConfig;
        use burn::optim::momentum::MomentumConfig;
        use burn::optim::{AdaGradConfig, AdamConfig, RmsPropConfig, SgdConfig, SimpleOptimizer};
        use burn::tensor::backend::Backend;
        use burn::tensor::{Tensor, TensorData};

        #[derive(Module, Debug)]
        struct Net<B: Backend> {
            w: Param<Tensor<B, 2>>,
        }
        type Ad = CpuAutodiff;

        fn compare<O: SimpleOptimizer<Cpu>>(name: &str, o: &O) {
            let device = Default::default();
            let values = |n: usize, k: usize| -> Vec<f32> {
                (0..n)
                    .map(|i| ((i * 37 + k * 11) % 23) as f32 * 0.05 - 0.55)
                    .collect()
            };
            let (rows, cols) = (6, 10);
            let tensor = |v: Vec<f32>| {
                Tensor::<Cpu, 2>::from_data(TensorData::new(v, [rows, cols]), &device)
            };
            let flat = |v: &[f32]| {
                Tensor::<Cpu, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
            };
            let cuts = [0, 7, 8, 33, 60];
            let (mut whole, mut state) = (tensor(values(60, 0)), None);
            let mut pieces: Vec<_> = (cuts.windows(2))
                .map(|c| (flat(&values(60, 0)[c[0]..c[1]]), None))
                .collect();
            for step in 1..=5 {
                let lr = 0.01 * step as f64;
                let grad = values(60, step);
                (whole, state) = o.step(lr, whole, tensor(grad.clone()), state);
                for ((piece, st), c) in pieces.iter_mut().zip(cuts.windows(2)) {
                    let (p, s) = o.step(lr, piece.clone(), flat(&grad[c[0]..c[1]]), st.take());
                    (*piece, *st) = (p, s);
                }
            }
            let whole = whole.into_data().into_vec::<f32>().expect("f32");
            let joined: Vec<f32> = (pieces.into_iter())
                .flat_map(|(p, _)| p.into_data().into_vec::<f32>().expect("f32"))
                .collect();
            assert_eq!(joined, whole, "{name}");
        }
        let l2 = Some(WeightDecayConfig::new(0.1));
        compare("AdamW", &FusedAdamW::new(0.9, 0.95, 1e-8, 0.1));
        let adam = AdamConfig::new()
            .with_weight_decay(l2.clone())
            .init::<Ad, Net<Ad>>();
        compare("Adam", adam.optim());
        let momentum = Some(MomentumConfig {
            momentum: 0.9,
            dampening: 0.1,
            nesterov: true,
        });
        let sgd = SgdConfig::new()
            .with_weight_decay(l2.clone())
            .with_momentum(momentum);
        compare("SGD", sgd.init::<Ad, Net<Ad>>().optim());
        let adagrad = AdaGradConfig::new()
            .with_lr_decay(0.01)
            .with_weight_decay(l2.clone());
        compare("AdaGrad", adagrad.init::<Ad, Net<Ad>>().optim());
        let rms = RmsPropConfig::new()
            .with_momentum(0.9)
            .with_centered(true)
            .with_weight_decay(l2);
        compare("RMSProp", &rms.build());
    }
}
