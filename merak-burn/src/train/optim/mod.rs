//! The optimizer of a run ([`OptimizerSettings`]): which one, its own hyperparameters, the
//! shape of its learning-rate schedule, its parameter groups ([`ParamGroup`]), and the checks
//! that refuse out-of-range settings before anything trains ([`check_settings`]).
//!
//! Every optimizer is element-wise (each parameter element is updated from its own gradient
//! and state), so it runs unchanged on tensor-parallel shards and on the parameters a ZeRO-1
//! rank owns, and gives the same result under every layout:
//!
//! | kind | implementation | weight decay |
//! | --- | --- | --- |
//! | `adamw` (default) | [`FusedAdamW`](crate::train::FusedAdamW): Burn's `AdamW` fused into one pass | decoupled |
//! | `adam` | Burn's `Adam` (`torch.optim.Adam`, without AMSGrad) | L2, added to the gradient |
//! | `sgd` | Burn's `Sgd` with its `Momentum` (`torch.optim.SGD`: momentum, dampening, Nesterov) | L2 |
//! | `adagrad` | Burn's `AdaGrad` (`torch.optim.Adagrad`, `lr_decay`) | L2 |
//! | `rmsprop` | Burn's `RmsProp` (`torch.optim.RMSprop`: `alpha`, momentum or centered) | L2 |
//!
//! Burn 0.21 also has Adan (four state tensors per parameter: more than a checkpoint holds),
//! Muon (orthogonalizes whole matrices, so it would be wrong on tensor-parallel shards; and it
//! applies to hidden matrices only, with another optimizer for the rest) and L-BFGS (needs the
//! loss as a closure and whole-model state): none of them is offered.

mod groups;
mod slots;

#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

pub(crate) use groups::Optimizers;
pub use slots::{RmsPropStep, Slots, StateSlots};

use crate::train::{InvalidSetting, LrScheduleKind, TrainSettings};

/// Which optimizer a run uses. In settings and configs it is named by
/// [`name`](Self::name); a name Burn has but merak does not offer (`muon`, `lbfgs`, `adan`)
/// is refused saying why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum OptimizerKind {
    /// AdamW: `beta1`, `beta2`, `eps`, decoupled `weight_decay`.
    #[default]
    AdamW,
    /// Adam with L2 weight decay added to the gradient: `beta1`, `beta2`, `eps`,
    /// `weight_decay`.
    Adam,
    /// SGD: `momentum`, `dampening`, `nesterov`, L2 `weight_decay`.
    Sgd,
    /// AdaGrad: `lr_decay`, `eps`, L2 `weight_decay`.
    AdaGrad,
    /// RMSProp: `alpha`, `eps`, `momentum` or `centered`, L2 `weight_decay`.
    RmsProp,
}

impl OptimizerKind {
    /// Every kind.
    pub const ALL: [OptimizerKind; 5] = [
        OptimizerKind::AdamW,
        OptimizerKind::Adam,
        OptimizerKind::Sgd,
        OptimizerKind::AdaGrad,
        OptimizerKind::RmsProp,
    ];

    /// The name used in settings, configs and checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::AdaGrad => "adagrad",
            OptimizerKind::RmsProp => "rmsprop",
        }
    }

    /// Whether the optimizer uses `beta1`, `beta2` (Adam and AdamW).
    pub fn uses_betas(self) -> bool {
        matches!(self, OptimizerKind::AdamW | OptimizerKind::Adam)
    }
}

impl TryFrom<String> for OptimizerKind {
    type Error = String;

    fn try_from(name: String) -> Result<Self, String> {
        if let Some(k) = Self::ALL.into_iter().find(|k| k.name() == name) {
            return Ok(k);
        }
        let known: Vec<&str> = Self::ALL.iter().map(|k| k.name()).collect();
        let why = match name.as_str() {
            "muon" => {
                "Muon orthogonalizes whole matrices (tensor parallelism and sharded optimizer \
                 state split them) and needs another optimizer for the other parameters; not \
                 offered. "
            }
            "lbfgs" | "l-bfgs" => {
                "L-BFGS needs the loss as a closure and whole-model state; not offered. "
            }
            "adan" => {
                "Adan keeps four state tensors per parameter and checkpoints hold two; not \
                 offered. "
            }
            _ => "",
        };
        Err(format!(
            "`{name}` is not an optimizer merak offers. {why}Known: {}",
            known.join(", ")
        ))
    }
}

impl From<OptimizerKind> for String {
    fn from(k: OptimizerKind) -> String {
        k.name().to_string()
    }
}

impl std::fmt::Display for OptimizerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The optimizer of a run and the shape of its learning-rate schedule. The hyperparameters
/// that several optimizers share stay in [`TrainSettings`] (`lr`, `min_lr`, `warmup_steps`,
/// `weight_decay`, `beta1`, `beta2`, `eps`); the ones here belong to some kinds only, and a
/// value other than the default for a kind that does not use it is refused
/// ([`check_settings`]), so that a setting never silently does nothing. The default is
/// AdamW with warm-up and cosine decay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerSettings {
    /// Which optimizer: "adamw" (default), "adam", "sgd", "adagrad" or "rmsprop".
    pub kind: OptimizerKind,
    /// SGD and RMSProp: momentum factor in [0, 1); 0: none.
    pub momentum: f64,
    /// SGD: dampening of the momentum, in [0, 1].
    pub dampening: f64,
    /// SGD: Nesterov momentum (needs momentum > 0 and dampening = 0).
    pub nesterov: bool,
    /// RMSProp: smoothing constant of the squared-gradient average, in [0, 1).
    pub alpha: f64,
    /// RMSProp: divide by the gradient's estimated variance (not with momentum).
    pub centered: bool,
    /// AdaGrad: the learning rate of its t-th step is `lr / (1 + (t - 1) lr_decay)`; >= 0.
    pub lr_decay: f64,
    /// The shape of the learning rate after the warm-up: "cosine" (default), "constant",
    /// "linear" or "wsd".
    pub schedule: LrScheduleKind,
    /// WSD: steps of the final linear decay to `min_lr` (at least 1; 0 for other shapes).
    pub decay_steps: usize,
}

impl Default for OptimizerSettings {
    /// AdamW with warm-up and cosine decay (the kind-specific values are PyTorch's defaults).
    fn default() -> Self {
        Self {
            kind: OptimizerKind::AdamW,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            alpha: 0.99,
            centered: false,
            lr_decay: 0.0,
            schedule: LrScheduleKind::Cosine,
            decay_steps: 0,
        }
    }
}

impl OptimizerSettings {
    /// These settings with `kind` set.
    #[must_use]
    pub fn with_kind(mut self, kind: OptimizerKind) -> Self {
        self.kind = kind;
        self
    }

    /// SGD with `momentum` (0: none), `dampening` and Nesterov momentum.
    pub fn sgd(momentum: f64, dampening: f64, nesterov: bool) -> Self {
        Self {
            kind: OptimizerKind::Sgd,
            momentum,
            dampening,
            nesterov,
            ..Self::default()
        }
    }

    /// These settings with the schedule shape `schedule` (and WSD's `decay_steps`, 0 for the
    /// other shapes).
    #[must_use]
    pub fn with_schedule(mut self, schedule: LrScheduleKind, decay_steps: usize) -> Self {
        self.schedule = schedule;
        self.decay_steps = decay_steps;
        self
    }
}

impl OptimizerSettings {
    /// What the optimizer keeps per parameter in the checkpoint's two state tensors
    /// ([`Moments`](crate::checkpoint::Moments) `m1`, `m2`; `"-"`: nothing). A checkpoint
    /// records it with the kind, and loads only into an optimizer that keeps the same.
    pub fn state_slots(&self) -> [&'static str; 2] {
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => ["first moment", "second moment"],
            OptimizerKind::Sgd if self.momentum > 0.0 => ["momentum buffer", "-"],
            OptimizerKind::Sgd => ["-", "-"],
            OptimizerKind::AdaGrad => ["sum of squared gradients", "-"],
            OptimizerKind::RmsProp => [
                "squared-gradient average",
                if self.momentum > 0.0 {
                    "momentum buffer"
                } else if self.centered {
                    "gradient average"
                } else {
                    "-"
                },
            ],
        }
    }

    /// Whether a run with these settings can continue the optimizer state of the checkpoint
    /// whose manifest is `manifest`: the same kind keeping the same state (or a checkpoint
    /// that keeps none, such as SGD without momentum). A checkpoint that does not name its
    /// optimizer was written by AdamW. The error names both optimizers.
    pub fn check_checkpoint(
        &self,
        manifest: &crate::checkpoint::Manifest,
    ) -> Result<(), crate::train::TrainError> {
        let (kind, slots) = checkpoint_optimizer(&manifest.extra);
        let ours = self.state_slots();
        let nothing_kept = slots.iter().all(|s| s == "-");
        if kind != self.kind.name() || (slots != ours && !nothing_kept) {
            return Err(crate::train::TrainError::OptimizerMismatch {
                checkpoint: describe_optimizer(&kind, &slots),
                run: describe_optimizer(self.kind.name(), &ours),
            });
        }
        Ok(())
    }

    /// The optimizer and its state as checkpoint manifests record it (`extra.optimizer`).
    pub fn manifest_entry(&self) -> serde_json::Value {
        serde_json::json!({ "kind": self.kind.name(), "state": self.state_slots() })
    }
}

/// The optimizer kind and state slots of a checkpoint's manifest `extra` (written by
/// [`OptimizerSettings::manifest_entry`]); a checkpoint without them was written by AdamW.
fn checkpoint_optimizer(extra: &serde_json::Value) -> (String, Vec<String>) {
    let entry = extra.get("optimizer");
    let kind = entry
        .and_then(|o| o.get("kind"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("adamw")
        .to_string();
    let state = entry
        .and_then(|o| o.get("state"))
        .and_then(serde_json::Value::as_array)
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_else(|| vec!["first moment".into(), "second moment".into()]);
    (kind, state)
}

/// `kind` and what it keeps, for messages: "`sgd` (momentum buffer)".
fn describe_optimizer(kind: &str, state: &[impl AsRef<str>]) -> String {
    let kept: Vec<&str> = state
        .iter()
        .map(AsRef::as_ref)
        .filter(|s| *s != "-")
        .collect();
    if kept.is_empty() {
        format!("`{kind}` (no state)")
    } else {
        format!("`{kind}` ({})", kept.join(", "))
    }
}

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
    let finite = |key: &str, v: f64, ok: bool, range: &str| {
        if ok && v.is_finite() {
            Ok(())
        } else {
            Err(refuse(key, v, format!("must be a finite number {range}")))
        }
    };
    finite("lr", s.lr, s.lr > 0.0, "> 0")?;
    finite(
        "min_lr",
        s.min_lr,
        (0.0..=s.lr).contains(&s.min_lr),
        &format!("in [0, lr = {}]", s.lr),
    )?;
    finite(
        "weight_decay",
        s.weight_decay,
        s.weight_decay >= 0.0,
        ">= 0",
    )?;
    finite("eps", s.eps, s.eps > 0.0, "> 0")?;
    finite(
        "grad_clip",
        s.grad_clip,
        s.grad_clip >= 0.0,
        ">= 0 (0: no clipping)",
    )?;
    for (key, b) in [("beta1", s.beta1), ("beta2", s.beta2)] {
        finite(key, b, (0.0..1.0).contains(&b), "in [0, 1)")?;
    }
    check_kind(&s.optimizer)?;
    check_schedule(s)
}

/// The kind's own hyperparameters, and none set for a kind that does not use it.
fn check_kind(o: &OptimizerSettings) -> Result<(), InvalidSetting> {
    use OptimizerKind::*;
    let d = OptimizerSettings::default();
    let kind = o.kind;
    // (key, value shown, differs from the default, kinds that use it)
    let used: [(&str, String, bool, &[OptimizerKind]); 6] = [
        (
            "optimizer.momentum",
            o.momentum.to_string(),
            o.momentum != d.momentum,
            &[Sgd, RmsProp],
        ),
        (
            "optimizer.dampening",
            o.dampening.to_string(),
            o.dampening != d.dampening,
            &[Sgd],
        ),
        (
            "optimizer.nesterov",
            o.nesterov.to_string(),
            o.nesterov != d.nesterov,
            &[Sgd],
        ),
        (
            "optimizer.alpha",
            o.alpha.to_string(),
            o.alpha != d.alpha,
            &[RmsProp],
        ),
        (
            "optimizer.centered",
            o.centered.to_string(),
            o.centered != d.centered,
            &[RmsProp],
        ),
        (
            "optimizer.lr_decay",
            o.lr_decay.to_string(),
            o.lr_decay != d.lr_decay,
            &[AdaGrad],
        ),
    ];
    for (key, value, set, kinds) in used {
        if set && !kinds.contains(&kind) {
            let users: Vec<&str> = kinds.iter().map(|k| k.name()).collect();
            return Err(refuse(
                key,
                value,
                format!(
                    "optimizer.kind = \"{kind}\" does not use it (only {}): leave it out",
                    users.join(" and ")
                ),
            ));
        }
    }
    let unit = |key: &str, v: f64, ok: bool, range: &str| {
        if ok && v.is_finite() {
            Ok(())
        } else {
            Err(refuse(key, v, format!("must be in {range}")))
        }
    };
    unit(
        "optimizer.momentum",
        o.momentum,
        (0.0..1.0).contains(&o.momentum),
        "[0, 1)",
    )?;
    unit(
        "optimizer.dampening",
        o.dampening,
        (0.0..=1.0).contains(&o.dampening),
        "[0, 1]",
    )?;
    unit(
        "optimizer.alpha",
        o.alpha,
        (0.0..1.0).contains(&o.alpha),
        "[0, 1)",
    )?;
    unit(
        "optimizer.lr_decay",
        o.lr_decay,
        o.lr_decay >= 0.0,
        "[0, inf) (finite)",
    )?;
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
