//! Which optimizer a run uses and its own hyperparameters ([`OptimizerSettings`], the
//! `[optimizer]` table of a config), and how checkpoints record it.

use serde::{Deserialize, Serialize};

use crate::train::LrScheduleKind;

/// Which optimizer a run uses. In settings and configs it is named by
/// [`name`](Self::name); a name Burn has but merak does not offer (`lbfgs`, `adan`) is
/// refused saying why.
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
    /// Muon for the blocks' weight matrices, each expert's and the router's among them
    /// (`muon_momentum`, `muon_nesterov`, `ns_steps`, `ns_coefficients`, `muon_scale`,
    /// decoupled `weight_decay`), AdamW (`beta1`, `beta2`, `eps`) for every other parameter:
    /// embeddings, the head, norms, biases.
    Muon,
}

impl OptimizerKind {
    /// Every kind.
    pub const ALL: [OptimizerKind; 6] = [
        OptimizerKind::AdamW,
        OptimizerKind::Adam,
        OptimizerKind::Sgd,
        OptimizerKind::AdaGrad,
        OptimizerKind::RmsProp,
        OptimizerKind::Muon,
    ];

    /// The name used in settings, configs and checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::AdaGrad => "adagrad",
            OptimizerKind::RmsProp => "rmsprop",
            OptimizerKind::Muon => "muon",
        }
    }

    /// Whether the optimizer uses `beta1`, `beta2` (Adam and AdamW; Muon's AdamW for the
    /// parameters that are not the blocks' matrices).
    pub fn uses_betas(self) -> bool {
        matches!(
            self,
            OptimizerKind::AdamW | OptimizerKind::Adam | OptimizerKind::Muon
        )
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

/// How Muon scales a matrix's orthogonalized update, whose singular values are all near 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MuonScale {
    /// `0.2 sqrt(max(rows, cols))` (Moonshot's): the update's RMS matches AdamW's, so Muon
    /// reuses AdamW's learning rate and weight decay, and the scale does not depend on
    /// whether a layer stores its weight `[in, out]` (Burn) or `[out, in]` (PyTorch).
    #[default]
    #[serde(rename = "match-rms-adamw")]
    MatchRmsAdamW,
    /// `sqrt(max(1, rows / cols))` of the stored weight (Keller Jordan's original).
    #[serde(rename = "original")]
    Original,
}

impl MuonScale {
    /// The name in configs.
    pub fn name(self) -> &'static str {
        match self {
            MuonScale::MatchRmsAdamW => "match-rms-adamw",
            MuonScale::Original => "original",
        }
    }
}

/// The optimizer of a run and the shape of its learning-rate schedule. The hyperparameters
/// that several optimizers share stay in [`TrainSettings`](crate::train::TrainSettings)
/// (`lr`, `min_lr`, `warmup_steps`, `weight_decay`, `beta1`, `beta2`, `eps`); the ones here
/// belong to some kinds only, and a value other than the default for a kind that does not use
/// it is refused ([`check_settings`](crate::train::check_settings)), so that a setting never
/// silently does nothing. The default is AdamW with warm-up and cosine decay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerSettings {
    /// Which optimizer: "adamw" (default), "adam", "sgd", "adagrad", "rmsprop" or "muon".
    pub kind: OptimizerKind,
    /// SGD and RMSProp: momentum factor in [0, 1) (at 1 the velocity never forgets); 0: none.
    pub momentum: f64,
    /// SGD: dampening of the momentum, in [0, 1].
    pub dampening: f64,
    /// SGD: Nesterov momentum (needs momentum > 0 and dampening = 0).
    pub nesterov: bool,
    /// RMSProp: smoothing constant of the squared-gradient average, in [0, 1) (at 1 the
    /// average never moves from 0).
    pub alpha: f64,
    /// RMSProp: divide by the gradient's estimated variance (not with momentum).
    pub centered: bool,
    /// AdaGrad: the learning rate of its t-th step is `lr / (1 + (t - 1) lr_decay)`; in
    /// [0, 1]: at 1 the rate already falls as `lr / t`.
    pub lr_decay: f64,
    /// Muon: momentum factor of the blocks' matrices, in [0, 1).
    pub muon_momentum: f64,
    /// Muon: Nesterov momentum (the update is `g + momentum * velocity`).
    pub muon_nesterov: bool,
    /// Muon: Newton-Schulz iterations orthogonalizing each update, 1 to 100.
    pub ns_steps: usize,
    /// Muon: the quintic Newton-Schulz coefficients `(a, b, c)` of `X <- aX + (bA + cA^2)X`,
    /// `A = X X^T`.
    pub ns_coefficients: [f64; 3],
    /// Muon: how a matrix's orthogonalized update is scaled: "match-rms-adamw" (default,
    /// `0.2 sqrt(max(rows, cols))`: AdamW's learning rate and decay carry over) or "original"
    /// (`sqrt(max(1, rows / cols))`).
    pub muon_scale: MuonScale,
    /// The shape of the learning rate after the warm-up: "cosine" (default), "constant",
    /// "linear" or "wsd".
    pub schedule: LrScheduleKind,
    /// WSD: steps of the final linear decay to `min_lr` (at least 1; 0 for other shapes).
    pub decay_steps: usize,
}

impl OptimizerSettings {
    /// Tensors of state the optimizer keeps per parameter, each the parameter's size: AdamW's
    /// and Adam's two moments, SGD's momentum buffer (none without momentum), AdaGrad's sum of
    /// squares, RMSProp's squared-gradient average plus its momentum and centred mean.
    pub fn state_tensors(&self) -> usize {
        let momentum = usize::from(self.momentum > 0.0);
        match self.kind {
            OptimizerKind::AdamW | OptimizerKind::Adam => 2,
            OptimizerKind::Sgd => momentum,
            OptimizerKind::AdaGrad => 1,
            OptimizerKind::RmsProp => 1 + momentum + usize::from(self.centered),
            // AdamW's two moments for the rest; one momentum buffer for the matrices.
            OptimizerKind::Muon => 2,
        }
    }

    /// The optimizer as the planner's cost model prices it: Muon's orthogonalizations and
    /// their communication, or an element-wise update.
    pub fn cost(&self) -> crate::planner::OptimizerCost {
        match self.kind {
            OptimizerKind::Muon => crate::planner::OptimizerCost::Muon {
                ns_steps: self.ns_steps,
            },
            _ => crate::planner::OptimizerCost::ElementWise,
        }
    }
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
            muon_momentum: 0.95,
            muon_nesterov: true,
            ns_steps: 5,
            ns_coefficients: [3.4445, -4.775, 2.0315],
            muon_scale: MuonScale::MatchRmsAdamW,
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
            // AdamW's moments for the rest, Muon's momentum buffer (and no second tensor) for
            // the blocks' matrices.
            OptimizerKind::Muon => ["first moment or momentum buffer", "second moment"],
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
        let (kind, slots) = manifest.stored_optimizer();
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
