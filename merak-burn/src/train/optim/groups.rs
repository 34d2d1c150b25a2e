//! The optimizers of a trainer: one Burn optimizer per parameter group (weight decay and
//! learning-rate factor), all of the run's kind, and their state by parameter name for
//! checkpoints.

use std::collections::{HashMap, HashSet};

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdaGrad, AdaGradConfig, Adam, AdamConfig, GradientsParams, Optimizer, RmsPropConfig, Sgd,
    SgdConfig, SimpleOptimizer,
};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::muon::{MatrixSplit, MuonMatrices, MuonStep};
use super::{OptimizerKind, ParamGroup, ParamInfo, RmsPropStep};
use crate::checkpoint::state::{self, NamedMoments};
use crate::checkpoint::{CheckpointError, Moments, Slots, StateSlots};
use crate::comm::Group;
use crate::kernels::FusedOps;
use crate::train::{FusedAdamW, InvalidSetting, TrainError, TrainSettings};

/// One group's optimizer: Burn's optimizer adaptor around the run's kind.
pub(crate) enum GroupOptim<M, B>
where
    B: AutodiffBackend,
    B::InnerBackend: FusedOps,
    M: AutodiffModule<B>,
{
    AdamW(OptimizerAdaptor<FusedAdamW, M, B>),
    Adam(OptimizerAdaptor<Adam, M, B>),
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, M, B>),
    AdaGrad(OptimizerAdaptor<AdaGrad, M, B>),
    RmsProp(OptimizerAdaptor<RmsPropStep, M, B>),
    Muon(OptimizerAdaptor<MuonStep<B::InnerBackend>, M, B>),
}

/// Runs `$body` with `$o` bound to the adaptor of whichever kind `$group` is.
macro_rules! each_kind {
    ($group:expr, $o:ident => $body:expr) => {
        match $group {
            GroupOptim::AdamW($o) => $body,
            GroupOptim::Adam($o) => $body,
            GroupOptim::Sgd($o) => $body,
            GroupOptim::AdaGrad($o) => $body,
            GroupOptim::RmsProp($o) => $body,
            GroupOptim::Muon($o) => $body,
        }
    };
}

impl<M, B> GroupOptim<M, B>
where
    B: AutodiffBackend,
    B::InnerBackend: FusedOps,
    M: AutodiffModule<B>,
{
    /// The optimizer of `s.optimizer.kind` for a group with weight decay `weight_decay`
    /// (under Muon: Muon for the blocks' weight matrices, split as `matrix` says over the
    /// tensor-parallel group `tp`; AdamW for the rest, `matrix` `None`).
    pub(crate) fn new(
        s: &TrainSettings,
        weight_decay: f64,
        matrix: Option<MatrixSplit>,
        tp: Group,
    ) -> Self {
        let o = &s.optimizer;
        let (beta1, beta2, eps) = (s.beta1 as f32, s.beta2 as f32, s.eps as f32);
        // Burn adds `penalty * param` to the gradient (L2): skipped when it is 0.
        let l2 = (weight_decay > 0.0).then(|| WeightDecayConfig::new(weight_decay as f32));
        if let (OptimizerKind::Muon, Some(split)) = (o.kind, matrix) {
            return Self::Muon(OptimizerAdaptor::from(MuonStep::new(
                o,
                weight_decay,
                split,
                tp,
            )));
        }
        match o.kind {
            OptimizerKind::AdamW | OptimizerKind::Muon => {
                Self::AdamW(FusedAdamW::new(beta1, beta2, eps, weight_decay as f32).init::<B, M>())
            }
            OptimizerKind::Adam => Self::Adam(
                AdamConfig::new()
                    .with_beta_1(beta1)
                    .with_beta_2(beta2)
                    .with_epsilon(eps)
                    .with_weight_decay(l2)
                    .init(),
            ),
            OptimizerKind::Sgd => Self::Sgd(
                SgdConfig::new()
                    .with_weight_decay(l2)
                    .with_momentum((o.momentum > 0.0).then_some(MomentumConfig {
                        momentum: o.momentum,
                        dampening: o.dampening,
                        nesterov: o.nesterov,
                    }))
                    .init(),
            ),
            OptimizerKind::AdaGrad => Self::AdaGrad(
                AdaGradConfig::new()
                    .with_lr_decay(o.lr_decay)
                    .with_epsilon(eps)
                    .with_weight_decay(l2)
                    .init(),
            ),
            OptimizerKind::RmsProp => Self::RmsProp(
                RmsPropStep {
                    inner: RmsPropConfig::new()
                        .with_alpha(o.alpha as f32)
                        .with_momentum(o.momentum as f32)
                        .with_epsilon(eps)
                        .with_centered(o.centered)
                        .with_weight_decay(l2)
                        .build(),
                    momentum: o.momentum > 0.0,
                    centered: o.centered,
                }
                .init(),
            ),
        }
    }

    /// Muon's step, when this group's matrices are Muon's.
    pub(crate) fn muon(&self) -> Option<&MuonStep<B::InnerBackend>> {
        match self {
            Self::Muon(o) => Some(o.optim()),
            _ => None,
        }
    }

    /// Steps the parameters of `model` that have a gradient in `grads` at `lr`.
    pub(crate) fn step(&mut self, lr: f64, model: M, grads: GradientsParams) -> M {
        each_kind!(self, o => o.step(lr, model, grads))
    }

    /// One step of a piece of a parameter (ZeRO-1 and 2): its values and gradient flat,
    /// its state from the last step as slots; returns the new values and state. Every
    /// optimizer merak trains with is element-wise, so this equals the piece of the whole
    /// tensor's step (`train::sync::chunks` tests it). `name` (the parameter's) names a
    /// state that cannot be kept as slots.
    pub(crate) fn step_piece(
        &self,
        name: &str,
        lr: f64,
        values: Tensor<B::InnerBackend, 1>,
        grad: Tensor<B::InnerBackend, 1>,
        state: Option<Slots<B::InnerBackend, 1>>,
    ) -> Result<PieceStep<B::InnerBackend>, CheckpointError> {
        let device = values.device();
        each_kind!(self, o => {
            let simple = o.optim();
            let state = state.map(|s| simple.state_from_slots(s));
            let (values, state) = simple.step(lr, values, grad, state);
            let state = match state {
                Some(st) => simple
                    .slots_of_state(st, &device)
                    .map_err(|reason| CheckpointError::Mismatch {
                        name: name.to_string(),
                        reason,
                    })?,
                None => None,
            };
            Ok(PieceStep { values, state })
        })
    }

    /// The state of every parameter this group has stepped, by name.
    pub(crate) fn moments(&self, model: &M) -> Result<NamedMoments, CheckpointError> {
        each_kind!(self, o => state::optimizer_moments(model, &o.to_record(), o.optim()))
    }

    /// Loads the state in `moments` of the parameters of `model` that `keep` selects.
    pub(crate) fn load(
        &mut self,
        model: &M,
        moments: &HashMap<String, Moments>,
        keep: &dyn Fn(ParamId, usize) -> bool,
    ) {
        each_kind!(self, o => {
            let records = state::optimizer_records(model, moments, keep, o.optim());
            *o = o.clone().load_record(records);
        })
    }
}

/// The parameters Muon steps under `settings` (none under another optimizer): the weight
/// matrices (2-D, [`state::ParamShape`]s `shapes`, split over `tp`) of the blocks (units `1..=layers`) this
/// rank `holds`, as the model names each unit's parameters
/// ([`PipelineModel::unit_params`](crate::pipeline::PipelineModel::unit_params)); embeddings,
/// the head, norms and biases get AdamW. A model that does not name its units' parameters is
/// refused under Muon.
pub(crate) fn muon_matrices<B, M>(
    model: &M,
    (shapes, tp): (&[state::ParamShape], Group),
    settings: &TrainSettings,
    holds: impl Fn(usize) -> bool,
) -> Result<MuonMatrices, TrainError>
where
    B: burn::tensor::backend::Backend,
    M: crate::pipeline::PipelineModel<B>,
{
    if settings.optimizer.kind != OptimizerKind::Muon {
        return Ok(MuonMatrices::default());
    }
    let mut blocks = HashSet::new();
    for unit in (1..=model.layer_count()).filter(|&u| holds(u)) {
        let ids = model.unit_params(unit).ok_or_else(|| InvalidSetting {
            key: "optimizer.kind".into(),
            value: "muon".into(),
            reason: "the model does not name its blocks' parameters \
                     (PipelineModel::unit_params), so Muon cannot tell its weight matrices \
                     from the rest"
                .into(),
        })?;
        blocks.extend(ids);
    }
    if holds(model.layer_count() + 1) {
        blocks.extend(model.head_block_params());
    }
    let ids = (shapes.iter())
        .filter(|p| p.shape.len() == 2 && blocks.contains(&p.id))
        .map(|p| p.id)
        .collect();
    Ok(MuonMatrices { ids, tp })
}

/// A piece's new values and optimizer state ([`GroupOptim::step_piece`]).
pub(crate) struct PieceStep<B: burn::tensor::backend::Backend> {
    /// The piece's values after the step.
    pub values: Tensor<B, 1>,
    /// Its state as slots; `None` where the optimizer keeps none.
    pub state: Option<Slots<B, 1>>,
}

/// What sets a group apart: its weight decay and learning-rate factor, and how Muon steps its
/// parameters (`None`: not Muon).
type GroupKey = (ParamGroup, Option<MatrixSplit>);

/// The optimizers of a trainer: one per distinct parameter group, and the group of every
/// parameter of this rank.
pub(crate) struct Optimizers<M, B>
where
    B: AutodiffBackend,
    B::InnerBackend: FusedOps,
    M: AutodiffModule<B>,
{
    /// The distinct groups in the order first met (with how Muon steps them, when it does),
    /// with their optimizers.
    groups: Vec<(GroupKey, GroupOptim<M, B>)>,
    /// The index in `groups` of each parameter.
    of_param: HashMap<ParamId, usize>,
    /// The parameters Muon steps ([`muon_matrices`]; none under another optimizer).
    matrices: MuonMatrices,
}

impl<M, B> Optimizers<M, B>
where
    B: AutodiffBackend,
    B::InnerBackend: FusedOps,
    M: AutodiffModule<B>,
{
    /// The optimizers of the parameters `shapes` (this rank's units and shard on a TP group of
    /// `tp` ranks, [`state::param_shapes`] of its model) under `settings`, each parameter in
    /// the group `rule` gives it. The rule sees the parameter's name and full shape, so every
    /// layout groups alike; a tied copy (`copies`: `(copy, original)` names) is grouped by its
    /// original. A group with a negative or non-finite value is refused, naming the parameter.
    /// Under Muon the parameters in `matrices` (the blocks' weight matrices) get Muon.
    pub(crate) fn new(
        shapes: &[state::ParamShape],
        settings: &TrainSettings,
        (tp, copies): (usize, Vec<(String, String)>),
        matrices: &MuonMatrices,
        rule: &dyn Fn(&ParamInfo<'_>) -> ParamGroup,
    ) -> Result<Self, TrainError> {
        let copies: HashMap<String, String> = copies.into_iter().collect();
        let mut groups: Vec<(GroupKey, GroupOptim<M, B>)> = Vec::new();
        let mut of_param = HashMap::new();
        for p in shapes {
            let name = copies.get(&p.name).unwrap_or(&p.name);
            let shape = p.split.full_shape(&p.shape, tp);
            let info = ParamInfo {
                name,
                shape: &shape,
                default: ParamInfo::default_group(&shape, settings.weight_decay),
            };
            let g = rule(&info);
            for (what, v) in [("weight_decay", g.weight_decay), ("lr_scale", g.lr_scale)] {
                if !(v >= 0.0 && v.is_finite()) {
                    return Err(TrainError::ParamGroup {
                        name: name.clone(),
                        reason: format!("{what} = {v}: must be a finite number >= 0"),
                    });
                }
            }
            let key = (g, matrices.role(p.id, &p.split));
            let index = match groups.iter().position(|(q, _)| *q == key) {
                Some(i) => i,
                None => {
                    let optim = GroupOptim::new(settings, g.weight_decay, key.1, matrices.tp);
                    groups.push((key, optim));
                    groups.len() - 1
                }
            };
            of_param.insert(p.id, index);
        }
        Ok(Self {
            groups,
            of_param,
            matrices: matrices.clone(),
        })
    }

    /// The parameters Muon steps.
    pub(crate) fn matrices(&self) -> &MuonMatrices {
        &self.matrices
    }

    /// The optimizer of parameter `id`'s group and the group's learning-rate factor.
    pub(crate) fn group_of(&self, id: ParamId) -> Option<(&GroupOptim<M, B>, f64)> {
        let (group, optim) = self.groups.get(*self.of_param.get(&id)?)?;
        Some((optim, group.0.lr_scale))
    }

    /// Splits `grads` by group.
    pub(crate) fn split(&self, model: &M, mut grads: GradientsParams) -> Vec<GradientsParams> {
        let mut v = Split::<B> {
            grads: &mut grads,
            out: (0..self.groups.len())
                .map(|_| GradientsParams::new())
                .collect(),
            of_param: &self.of_param,
            _b: std::marker::PhantomData,
        };
        model.visit(&mut v);
        v.out
    }

    /// Steps every group with its gradients (`split`'s) at `lr` times its `lr_scale`.
    pub(crate) fn step(&mut self, lr: f64, mut model: M, grads: Vec<GradientsParams>) -> M {
        for ((group, optim), g) in self.groups.iter_mut().zip(grads) {
            if !g.is_empty() {
                model = optim.step(lr * group.0.lr_scale, model, g);
            }
        }
        model
    }

    /// The state of every parameter this rank has stepped, by name.
    pub(crate) fn moments(&self, model: &M) -> Result<NamedMoments, CheckpointError> {
        let mut all = Vec::new();
        for (_, optim) in &self.groups {
            all.extend(optim.moments(model)?);
        }
        Ok(all)
    }

    /// Loads the state in `moments` (this rank's pieces, by name).
    pub(crate) fn load(&mut self, model: &M, moments: &HashMap<String, Moments>) {
        let of_param = &self.of_param;
        for (i, (_, optim)) in self.groups.iter_mut().enumerate() {
            let keep = |id: ParamId, _rank: usize| of_param.get(&id) == Some(&i);
            optim.load(model, moments, &keep);
        }
    }
}

struct Split<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    out: Vec<GradientsParams>,
    of_param: &'a HashMap<ParamId, usize>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Split<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        if let Some(&i) = self.of_param.get(&param.id) {
            self.out[i].register(param.id, g);
        }
    }
}
