//! Muon's step of one weight matrix, whole or as this rank's tensor-parallel shard of it: the
//! momentum (Burn's, element-wise, so a shard keeps its own piece), the update gathered whole
//! over the tensor-parallel group where a layer splits the matrix, the Newton-Schulz
//! orthogonalization of the whole update (every rank of the group computes it), this rank's
//! piece of the result, decoupled weight decay, and the update's scale from the whole shape.

use std::collections::HashSet;

use burn::module::ParamId;
use burn::optim::momentum::{Momentum, MomentumConfig};
use burn::optim::{LearningRate, MuonState, SimpleOptimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::comm::{Group, TensorComm, fail};
use crate::tensor_parallel::ShardKind;
use crate::train::{MuonScale, OptimizerSettings};

/// Below this Frobenius norm an update is not scaled up (Burn's and PyTorch's epsilon).
const NORM_FLOOR: f32 = 1e-7;

/// The parameters Muon steps ([`muon_matrices`](super::muon_matrices)) and the
/// tensor-parallel group that splits some of them.
#[derive(Clone, Debug)]
pub(crate) struct MuonMatrices {
    /// The blocks' weight matrices (empty under another optimizer).
    pub ids: HashSet<ParamId>,
    /// The tensor-parallel group (one rank without tensor parallelism).
    pub tp: Group,
}

impl Default for MuonMatrices {
    /// None, on one rank.
    fn default() -> Self {
        Self {
            ids: HashSet::new(),
            tp: Group::local(),
        }
    }
}

impl MuonMatrices {
    /// How Muon steps the parameter `id`, split across the tensor-parallel group as `split`
    /// says: not at all (`None`: AdamW steps it), or as a matrix, split along a dimension.
    pub(crate) fn role(&self, id: ParamId, split: &ShardKind) -> Option<MatrixSplit> {
        if !self.ids.contains(&id) {
            return None;
        }
        let dim = match split {
            ShardKind::Columns { .. } => Some(1),
            ShardKind::Rows => Some(0),
            ShardKind::Replicated | ShardKind::VocabRows { .. } => None,
        };
        Some(MatrixSplit {
            dim: dim.filter(|_| self.tp.size() > 1),
        })
    }
}

/// A matrix Muon steps: whole on this rank, or split across the tensor-parallel group along
/// `dim` (0: rows, a row-parallel layer's weight; 1: columns, a column-parallel one's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatrixSplit {
    /// The dimension the group splits, if it does.
    pub dim: Option<usize>,
}

/// Muon's step for matrices split as `split` says over `tp` (see the [module](self)).
#[derive(Clone)]
pub(crate) struct MuonStep<B: Backend> {
    momentum: Momentum<B>,
    coefficients: [f32; 3],
    iterations: usize,
    decay: f64,
    scale: MuonScale,
    split: Option<(usize, Group)>,
}

impl<B: Backend> MuonStep<B> {
    /// The step of `o`'s Muon settings with decoupled weight decay `decay`, for matrices
    /// split along `split`'s dimension over the tensor-parallel group `tp`.
    pub(crate) fn new(o: &OptimizerSettings, decay: f64, split: MatrixSplit, tp: Group) -> Self {
        Self {
            momentum: Momentum::new(&MomentumConfig {
                momentum: o.muon_momentum,
                dampening: 0.0,
                nesterov: o.muon_nesterov,
            }),
            coefficients: o.ns_coefficients.map(|c| c as f32),
            iterations: o.ns_steps,
            decay,
            scale: o.muon_scale,
            split: split.dim.map(|d| (d, tp)),
        }
    }

    /// The quintic Newton-Schulz iteration on `u` (on its transpose when it is tall): the
    /// update with its singular values moved close to 1.
    fn orthogonalized(&self, u: Tensor<B, 2>) -> Tensor<B, 2> {
        let [rows, cols] = u.dims();
        let mut x = if rows > cols { u.transpose() } else { u };
        let norm = (x.clone().powf_scalar(2.0).sum().sqrt()).clamp_min(NORM_FLOOR);
        x = x.div(norm.unsqueeze());
        let [a, b, c] = self.coefficients;
        for _ in 0..self.iterations {
            let gram = x.clone().matmul(x.clone().transpose());
            let square = gram.clone().matmul(gram.clone());
            let poly = gram.mul_scalar(b).add(square.mul_scalar(c));
            x = x.clone().mul_scalar(a).add(poly.matmul(x));
        }
        if rows > cols { x.transpose() } else { x }
    }

    /// The factor of the learning rate for a whole matrix `[rows, cols]`.
    fn scale_of(&self, rows: usize, cols: usize) -> f64 {
        let (r, c) = (rows as f64, cols as f64);
        match self.scale {
            MuonScale::MatchRmsAdamW => 0.2 * r.max(c).sqrt(),
            MuonScale::Original => (r / c).max(1.0).sqrt(),
        }
    }

    /// The whole update of a matrix whose piece on this rank is `piece`, and where the piece
    /// lies in it (`dim`, `start`): gathered over the group, or `piece` itself.
    fn whole(&self, piece: Tensor<B, 2>) -> (Tensor<B, 2>, Option<(usize, usize)>) {
        let Some((dim, group)) = self.split else {
            return (piece, None);
        };
        let len = piece.dims()[dim];
        let gathered = group
            .comm()
            .and_then(|c| c.all_gather_tensor(piece, dim))
            .unwrap_or_else(|e| fail(format!("Muon's gather of a split matrix: {e}")));
        (gathered, Some((dim, group.rank() * len)))
    }

    /// Burn's momentum on `grad` (a whole matrix or any piece of one: it is element-wise).
    pub(crate) fn momentum<const D: usize>(
        &self,
        grad: Tensor<B, D>,
        state: Option<MuonState<B, D>>,
    ) -> (Tensor<B, D>, MuonState<B, D>) {
        let (update, momentum) = self.momentum.transform(grad, state.map(|s| s.momentum));
        (update, MuonState::new(momentum))
    }

    /// Whether the matrices of this step are split over the tensor-parallel group (then every
    /// rank of the group calls [`orthogonal_piece`](Self::orthogonal_piece) for the same
    /// matrices in the same order).
    pub(crate) fn split_over_tp(&self) -> bool {
        self.split.is_some()
    }

    /// This rank's piece of the orthogonalized whole update, `local` being this rank's
    /// tensor-parallel shard of the update (the whole matrix when it is not split).
    pub(crate) fn orthogonal_piece(&self, local: Tensor<B, 2>) -> Tensor<B, 2> {
        let shape = local.dims();
        let (whole, at) = self.whole(local);
        let x = self.orthogonalized(whole);
        match at {
            Some((dim, start)) => x.narrow(dim, start, shape[dim]),
            None => x,
        }
    }

    /// The values after the step at `lr` of a matrix whose tensor-parallel shard has the
    /// shape `local` (`[rows, cols]`): `values` (the shard or any piece of it) decayed, less
    /// the update's same piece `x` of the orthogonalized whole, scaled for the whole shape.
    pub(crate) fn updated<const D: usize>(
        &self,
        values: Tensor<B, D>,
        x: Tensor<B, D>,
        lr: LearningRate,
        local: [usize; 2],
    ) -> Tensor<B, D> {
        let mut full = local;
        if let Some((dim, group)) = &self.split {
            full[*dim] *= group.size();
        }
        let lr_scaled = lr * self.scale_of(full[0], full[1]);
        let values = match self.decay > 0.0 {
            true => values.mul_scalar(1.0 - lr * self.decay),
            false => values,
        };
        values - x.mul_scalar(lr_scaled)
    }
}

impl<B: Backend> SimpleOptimizer<B> for MuonStep<B> {
    type State<const D: usize> = MuonState<B, D>;

    /// One step of a matrix (`D` is 2: only the blocks' matrices are given to Muon).
    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let shape = tensor.dims();
        let (update, state) = self.momentum(grad, state);
        let local = [shape[0], shape[1..].iter().product()];
        let x = self.orthogonal_piece(update.reshape(local));
        let values = self.updated(tensor, x.reshape(shape), lr, local);
        (values, Some(state))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}
