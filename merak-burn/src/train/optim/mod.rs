//! The optimizer of a run ([`OptimizerSettings`], defined in `optimizer_settings`): which one, its own hyperparameters, the
//! shape of its learning-rate schedule, its parameter groups ([`ParamGroup`]), and the checks
//! that refuse out-of-range settings before anything trains ([`check_settings`]).
//!
//! Every optimizer is element-wise (each parameter element is updated from its own gradient
//! and state), so it runs unchanged on tensor-parallel shards and on the pieces of parameters
//! a ZeRO rank steps, and gives the same result under every layout:
//!
//! | kind | implementation | weight decay |
//! | --- | --- | --- |
//! | `adamw` (default) | [`FusedAdamW`](crate::train::FusedAdamW): Burn's `AdamW` fused into one pass | decoupled |
//! | `adam` | Burn's `Adam` (`torch.optim.Adam`, without AMSGrad) | L2, added to the gradient |
//! | `sgd` | Burn's `Sgd` with its `Momentum` (`torch.optim.SGD`: momentum, dampening, Nesterov) | L2 |
//! | `adagrad` | Burn's `AdaGrad` (`torch.optim.Adagrad`, `lr_decay`) | L2 |
//! | `rmsprop` | Burn's `RmsProp` (`torch.optim.RMSprop`: `alpha`, momentum or centered) | L2 |
//! | `muon` | [`MuonStep`] (Burn's momentum) for the blocks' weight matrices, the fused AdamW for the rest | decoupled |
//!
//! Muon is the exception: it orthogonalizes each matrix's whole update, so a tensor-parallel
//! rank gathers the update of a split matrix ([`MuonStep`]), and under ZeRO the pieces of each
//! matrix are sent to one owner per matrix and the results returned (`train::sync::chunks`'s
//! `muon`). Burn 0.21 also has Adan (four state tensors per parameter: more than a checkpoint
//! holds) and L-BFGS (needs the loss as a closure and whole-model state): neither is offered.

mod groups;
mod muon;
mod slots;

#[cfg(test)]
mod tests;

pub use crate::checkpoint::{Slots, StateSlots};
pub(crate) use groups::{Optimizers, muon_matrices};
#[cfg(test)]
use muon::MuonMatrices;
pub(crate) use muon::MuonStep;
pub use slots::RmsPropStep;

use crate::bounds::{Bounds, OutOfBounds, RealKey, out_of_bounds, shown};
use crate::train::optimizer_settings::{OptimizerKind, OptimizerSettings};
use crate::train::{InvalidSetting, LrScheduleKind, TrainSettings};

impl TrainSettings {
    /// The learning rate of step `step` (0-based): the warm-up, then the shape
    /// `optimizer.schedule` ([`LrScheduleKind`]).
    pub fn lr_at(&self, step: usize) -> f64 {
        let o = &self.optimizer;
        self.lr_schedule()
            .shaped_at(o.schedule, o.decay_steps, step)
    }
}

/// The parameter group of one parameter: its weight decay, and the factor of the learning
/// rate it is stepped with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamGroup {
    /// Weight decay (decoupled for AdamW, L2 for the others); >= 0.
    pub weight_decay: f64,
    /// The parameter is stepped with `lr_scale` times the schedule's learning rate; >= 0.
    pub lr_scale: f64,
}

/// What a parameter-group rule ([`Trainer::with_param_groups`](crate::train::Trainer::with_param_groups))
/// sees of a parameter: the same on every layout.
#[derive(Clone, Copy, Debug)]
pub struct ParamInfo<'a> {
    /// Its name, as checkpoints name it (`blocks.0.attn.qkv.linear.weight`); a tied copy (the
    /// head's copy of the embedding) is named by its original.
    pub name: &'a str,
    /// Its full (single-process) shape, whatever this rank's tensor-parallel shard.
    pub shape: &'a [usize],
    /// The group the default rule gives it: the settings' `weight_decay` for matrices
    /// (weights, embeddings), none for vectors (biases, norm gains), and `lr_scale` 1.
    pub default: ParamGroup,
}

impl ParamInfo<'_> {
    /// The default rule's group of a parameter of `shape` under `weight_decay`.
    pub fn default_group(shape: &[usize], weight_decay: f64) -> ParamGroup {
        ParamGroup {
            weight_decay: if shape.len() >= 2 { weight_decay } else { 0.0 },
            lr_scale: 1.0,
        }
    }
}

/// `Err(InvalidSetting)` naming `key` and `value`.
fn refuse(key: &str, value: impl std::fmt::Display, reason: impl Into<String>) -> InvalidSetting {
    InvalidSetting {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// Checks the optimizer and schedule settings of `s`: learning rates, betas, epsilon, weight
/// decay, clipping, the kind's own hyperparameters, and the schedule against the run's steps.
/// The error names the key (a field of [`TrainSettings`], `optimizer.*` for
/// [`OptimizerSettings`]) and its value. [`Trainer::new`](crate::train::Trainer::new) calls it.
pub fn check_settings(s: &TrainSettings) -> Result<(), InvalidSetting> {
    if let Some(e) = out_of_bounds(s, &TRAIN_REAL_KEYS, "") {
        return Err(out_of(e));
    }
    if s.min_lr > s.lr {
        return Err(refuse(
            "min_lr",
            shown(s.min_lr),
            format!("must be in [0, lr = {}]", shown(s.lr)),
        ));
    }
    check_kind(&s.optimizer)?;
    check_schedule(s)
}

/// The real-valued keys of [`TrainSettings`] and their bounds; `min_lr` is also at most `lr`.
/// `merak train`'s `[train]` keys give the reasons.
pub const TRAIN_REAL_KEYS: [RealKey<TrainSettings>; 7] = [
    RealKey {
        key: "lr",
        get: |s| Some(s.lr),
        bounds: Bounds::above(0.0, 10.0),
    },
    RealKey {
        key: "min_lr",
        get: |s| Some(s.min_lr),
        bounds: Bounds::closed(0.0, 10.0),
    },
    RealKey {
        key: "weight_decay",
        get: |s| Some(s.weight_decay),
        bounds: Bounds::closed(0.0, 1.0),
    },
    RealKey {
        key: "beta1",
        get: |s| Some(s.beta1),
        bounds: Bounds::below(0.0, 1.0),
    },
    RealKey {
        key: "beta2",
        get: |s| Some(s.beta2),
        bounds: Bounds::below(0.0, 1.0),
    },
    RealKey {
        key: "eps",
        get: |s| Some(s.eps),
        bounds: Bounds::closed(1e-30, 1.0),
    },
    RealKey {
        key: "grad_clip",
        get: |s| Some(s.grad_clip),
        bounds: Bounds::closed(0.0, 1e6),
    },
];

/// The real-valued keys of [`OptimizerSettings`] and their bounds (the reasons are in the
/// fields' docs).
pub const OPTIMIZER_REAL_KEYS: [RealKey<OptimizerSettings>; 5] = [
    RealKey {
        key: "momentum",
        get: |o| Some(o.momentum),
        bounds: Bounds::below(0.0, 1.0),
    },
    RealKey {
        key: "dampening",
        get: |o| Some(o.dampening),
        bounds: Bounds::closed(0.0, 1.0),
    },
    RealKey {
        key: "alpha",
        get: |o| Some(o.alpha),
        bounds: Bounds::below(0.0, 1.0),
    },
    RealKey {
        key: "lr_decay",
        get: |o| Some(o.lr_decay),
        bounds: Bounds::closed(0.0, 1.0),
    },
    RealKey {
        key: "muon_momentum",
        get: |o| Some(o.muon_momentum),
        bounds: Bounds::below(0.0, 1.0),
    },
];

/// The [`InvalidSetting`] of a key outside its bounds.
fn out_of(e: OutOfBounds) -> InvalidSetting {
    refuse(&e.key, e.value, format!("must be in {}", e.bounds))
}

/// The kind's own hyperparameters, and none set for a kind that does not use it.
fn check_kind(o: &OptimizerSettings) -> Result<(), InvalidSetting> {
    check_unused(o)?;
    check_combinations(o)
}

/// A kind-specific key of [`OptimizerSettings`]: its name, its value as shown, and the kinds
/// that use it.
type KindKey = (
    &'static str,
    fn(&OptimizerSettings) -> String,
    &'static [OptimizerKind],
);

/// Every kind-specific key ([`check_unused`]).
const KIND_KEYS: [KindKey; 11] = {
    use OptimizerKind::*;
    [
        ("momentum", |o| o.momentum.to_string(), &[Sgd, RmsProp]),
        ("dampening", |o| o.dampening.to_string(), &[Sgd]),
        ("nesterov", |o| o.nesterov.to_string(), &[Sgd]),
        ("alpha", |o| o.alpha.to_string(), &[RmsProp]),
        ("centered", |o| o.centered.to_string(), &[RmsProp]),
        ("lr_decay", |o| o.lr_decay.to_string(), &[AdaGrad]),
        ("muon_momentum", |o| o.muon_momentum.to_string(), &[Muon]),
        ("muon_nesterov", |o| o.muon_nesterov.to_string(), &[Muon]),
        ("ns_steps", |o| o.ns_steps.to_string(), &[Muon]),
        (
            "ns_coefficients",
            |o| format!("{:?}", o.ns_coefficients),
            &[Muon],
        ),
        ("muon_scale", |o| o.muon_scale.name().to_string(), &[Muon]),
    ]
};

/// No hyperparameter set (other than its default) that the kind does not use.
fn check_unused(o: &OptimizerSettings) -> Result<(), InvalidSetting> {
    let d = OptimizerSettings::default();
    let kind = o.kind;
    for (key, shown, kinds) in KIND_KEYS {
        let value = shown(o);
        if value != shown(&d) && !kinds.contains(&kind) {
            let users: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
            return Err(refuse(
                &format!("optimizer.{key}"),
                value,
                format!(
                    "optimizer.kind = \"{kind}\" does not use it (only {}): leave it out",
                    users.join(" and ")
                ),
            ));
        }
    }
    Ok(())
}

/// The hyperparameters within bounds, and no combination the optimizer cannot run.
fn check_combinations(o: &OptimizerSettings) -> Result<(), InvalidSetting> {
    use OptimizerKind::*;
    let kind = o.kind;
    if let Some(e) = out_of_bounds(o, &OPTIMIZER_REAL_KEYS, "optimizer.") {
        return Err(out_of(e));
    }
    if o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0) {
        return Err(refuse(
            "optimizer.nesterov",
            true,
            format!(
                "Nesterov momentum needs optimizer.momentum > 0 and optimizer.dampening = 0 \
                 (they are {} and {})",
                o.momentum, o.dampening
            ),
        ));
    }
    if !(1..=100).contains(&o.ns_steps) {
        return Err(refuse(
            "optimizer.ns_steps",
            o.ns_steps,
            "must be in [1, 100]: each iteration takes three matrix products per matrix",
        ));
    }
    if let Some(c) = o.ns_coefficients.iter().find(|c| !c.is_finite()) {
        return Err(refuse(
            "optimizer.ns_coefficients",
            format!("{:?}", o.ns_coefficients),
            format!("{c} is not a finite number"),
        ));
    }
    if kind == RmsProp && o.centered && o.momentum > 0.0 {
        return Err(refuse(
            "optimizer.centered",
            true,
            format!(
                "centered RMSProp with optimizer.momentum = {} keeps three state tensors per \
                 parameter, and checkpoints hold two: use one of them",
                o.momentum
            ),
        ));
    }
    Ok(())
}

/// The schedule fits the run.
fn check_schedule(s: &TrainSettings) -> Result<(), InvalidSetting> {
    let o = &s.optimizer;
    let (warmup, steps) = (s.warmup_steps, s.steps);
    // The cosine schedule has always accepted a run that is all warm-up (short test runs
    // of configs made for longer ones); the other shapes would never be reached.
    if o.schedule != LrScheduleKind::Cosine && warmup > steps {
        return Err(refuse(
            "warmup_steps",
            warmup,
            format!(
                "the warm-up is longer than the run (steps = {steps}), so the \"{}\" schedule \
                 is never reached",
                o.schedule
            ),
        ));
    }
    match o.schedule {
        LrScheduleKind::Wsd if o.decay_steps == 0 => Err(refuse(
            "optimizer.decay_steps",
            0,
            "must be at least 1 with optimizer.schedule = \"wsd\" (the steps of its final decay)",
        )),
        LrScheduleKind::Wsd if warmup.saturating_add(o.decay_steps) > steps => Err(refuse(
            "optimizer.decay_steps",
            o.decay_steps,
            format!(
                "warmup_steps = {warmup} plus the decay is more than the run (steps = {steps})"
            ),
        )),
        LrScheduleKind::Wsd => Ok(()),
        other if o.decay_steps != 0 => Err(refuse(
            "optimizer.decay_steps",
            o.decay_steps,
            format!("optimizer.schedule = \"{other}\" does not use it (only \"wsd\")"),
        )),
        _ => Ok(()),
    }
}
