//! Settings that do nothing in the chosen layout (`parallel.prefetch` without ZeRO-3,
//! `parallel.cp_attention` at cp = 1), under one rule, from one table ([`IDLE`]): a value other
//! than the key's default is accepted, and rank 0 warns once naming the key, its value and why
//! it has no effect. Never refused: a config file is reused under several layouts (`--dp`,
//! `--cp`, a plan, a resume under another layout), where the same key matters again. The
//! library is handed the layout's effective values ([`Config::parallel_plan`]).

use std::fmt;

use merak_burn::data_parallel::GradientBuffers;
use merak_burn::pipeline::Recompute;
use toml::Value;

use super::Config;
use super::load::{default_value, set_key, value_at};

/// A key that has no effect in some layouts: `idle` says, for a config, why it has none there
/// (naming the settings that decide), or `None` where it has an effect.
pub struct Idle {
    /// The dotted key.
    pub key: &'static str,
    /// Why the key has no effect in this config's layout; `None`: it has one.
    pub idle: fn(&Config) -> Option<String>,
}

/// Every key that has no effect in some layouts.
pub const IDLE: [Idle; 23] = [
    Idle {
        key: "parallel.prefetch",
        idle: |c| not_zero3(c, "only ZeRO-3 gathers parameters ahead of use"),
    },
    Idle {
        key: "parallel.reshard_after_forward",
        idle: |c| not_zero3(c, "only ZeRO-3 shards the parameters"),
    },
    Idle {
        key: "parallel.reduce_scatter",
        idle: |c| {
            (c.parallel.zero < 2).then(|| {
                format!(
                    "parallel.zero = {}: only ZeRO-2 and 3 reduce-scatter gradients (stages 0 \
                     and 1 reduce whole gradients)",
                    c.parallel.zero
                )
            })
        },
    },
    Idle {
        key: "parallel.shard",
        idle: |c| {
            (c.parallel.zero == 0).then(|| {
                "parallel.zero = 0: hybrid sharding groups the ranks that share ZeRO's slices, \
                 and without ZeRO nothing is sliced"
                    .into()
            })
        },
    },
    Idle {
        key: "parallel.gradient_buffers",
        idle: |c| {
            let device = c.parallel.gradient_buffers == GradientBuffers::Device;
            (device && c.parallel.zero != 0).then(|| {
                format!(
                    "parallel.zero = {}: ZeRO's reducers keep their slices in host memory",
                    c.parallel.zero
                )
            })
        },
    },
    Idle {
        key: "parallel.cp_attention",
        idle: |c| (c.parallel.cp == 1).then(|| "parallel.cp = 1: no context parallelism".into()),
    },
    Idle {
        key: "parallel.sequence_parallel",
        idle: |c| {
            (c.parallel.tp == 1).then(|| {
                "parallel.tp = 1: sequence parallelism splits the sequence over the \
                 tensor-parallel ranks"
                    .into()
            })
        },
    },
    Idle {
        key: "parallel.tp_overlap",
        idle: |c| {
            (c.parallel.tp == 1).then(|| {
                "parallel.tp = 1: it overlaps the tensor-parallel all-reduces with compute".into()
            })
        },
    },
    Idle {
        key: "parallel.virtual_stages",
        idle: |c| {
            let (v, schedule) = (c.parallel.virtual_stages, c.parallel.schedule);
            match schedule {
                s if s.v_shaped() && v == 2 => None,
                s if s.v_shaped() => Some(format!(
                    "parallel.schedule = \"{s}\" runs two stages per rank"
                )),
                s if !s.uses_virtual_stages() => Some(format!(
                    "parallel.schedule = \"{s}\" runs one stage per rank (only \"interleaved\", \
                     \"zb-v\" and \"dualpipev\" run several)"
                )),
                _ => None,
            }
        },
    },
    Idle {
        key: "parallel.stage_layers",
        idle: |c| {
            (c.stages() == 1)
                .then(|| "one pipeline stage (parallel.pp = 1) holds every unit".into())
        },
    },
    Idle {
        key: "parallel.memory_budget_mb",
        idle: |c| {
            let stage_aware = c.parallel.recompute == Recompute::StageAware;
            match (stage_aware, c.parallel.stage_recompute.is_empty()) {
                (true, true) => None,
                (_, false) => Some(
                    "parallel.stage_recompute sets each stage's recomputation (the budget \
                     serves parallel.recompute = \"stage-aware\" only)"
                        .into(),
                ),
                (false, true) => Some(format!(
                    "parallel.recompute = \"{}\": only \"stage-aware\" recomputation has a \
                     budget",
                    c.parallel.recompute
                )),
            }
        },
    },
    Idle {
        key: "parallel.recompute",
        idle: |c| {
            (!c.parallel.stage_recompute.is_empty())
                .then(|| "parallel.stage_recompute sets each stage's recomputation".into())
        },
    },
    Idle {
        key: "model.moe.max_load",
        idle: |c| {
            let moe = c.model.gpt.moe.as_ref()?;
            match (c.parallel.ep, moe.capacity_factor) {
                (_, Some(_)) => Some(
                    "model.moe.capacity_factor bounds every expert's tokens (max_load bounds \
                     dropless routing)"
                        .into(),
                ),
                (1, None) => Some(
                    "parallel.ep = 1: a rank computes its own tokens' rows however they are \
                     routed (only expert parallelism bounds the rows a rank receives)"
                        .into(),
                ),
                _ => None,
            }
        },
    },
    Idle {
        key: "model.moe.shared_overlap",
        idle: |c| {
            let moe = c.model.gpt.moe.as_ref()?;
            match (c.parallel.ep, moe.shared_experts) {
                (_, 0) => Some("model.moe.shared_experts = 0: no shared expert to overlap".into()),
                (1, _) => Some(
                    "parallel.ep = 1: no token exchange to overlap the shared experts with".into(),
                ),
                _ => None,
            }
        },
    },
    Idle {
        key: "model.mask_token_id",
        idle: |c| {
            (c.model.kind != "bert")
                .then(|| format!("model.kind = \"{}\": only BERT masks tokens", c.model.kind))
        },
    },
    Idle {
        key: "train.comm",
        idle: one_process,
    },
    Idle {
        key: "train.comm_timeout_s",
        idle: one_process,
    },
    Idle {
        key: "train.cuda_device",
        idle: |c| {
            (c.train.device != "cuda").then(|| {
                format!(
                    "train.device = \"{}\": it chooses CUDA devices",
                    c.train.device
                )
            })
        },
    },
    Idle {
        key: "train.sample_temperature",
        idle: |c| {
            no_sample(c).or_else(|| {
                (c.train.sample_tokens == 0).then(|| "train.sample_tokens = 0: no sample".into())
            })
        },
    },
    Idle {
        key: "train.sample_tokens",
        idle: no_sample,
    },
    Idle {
        key: "train.min_lr",
        idle: |c| {
            let schedule = c.optimizer.schedule;
            (schedule == merak_burn::train::LrScheduleKind::Constant).then(|| {
                format!("optimizer.schedule = \"{schedule}\": the learning rate never decays")
            })
        },
    },
    Idle {
        key: "data.val_batches",
        idle: |c| (c.data.val_every == 0).then(|| "data.val_every = 0: no validation".into()),
    },
    Idle {
        key: "data.path",
        idle: |c| {
            (c.data.kind == "synthetic")
                .then(|| "data.kind = \"synthetic\": the sequences are generated, not read".into())
        },
    },
];

/// Why a ZeRO-3 setting (`what`) has no effect at this config's stage.
fn not_zero3(c: &Config, what: &str) -> Option<String> {
    (c.parallel.zero != 3).then(|| format!("parallel.zero = {}: {what}", c.parallel.zero))
}

/// Why a communication setting has no effect on one process.
fn one_process(c: &Config) -> Option<String> {
    let p = &c.parallel;
    (p.dp * p.cp * p.tp * p.pp == 1)
        .then(|| "one process (parallel.dp x cp x tp x pp = 1) talks to no other".into())
}

/// Why no sample is drawn after training: a pipeline (`merak generate` samples its checkpoint).
fn no_sample(c: &Config) -> Option<String> {
    (c.parallel.pp > 1).then(|| {
        format!(
            "parallel.pp = {}: no sample is drawn under a pipeline (sample its checkpoint with \
             `merak generate`)",
            c.parallel.pp
        )
    })
}

/// A key of a config that differs from its default and has no effect in the config's layout.
#[derive(Clone, Debug, PartialEq)]
pub struct IdleSetting {
    /// The dotted key.
    pub key: &'static str,
    /// Its value, as TOML writes it.
    pub value: String,
    /// Why it has no effect.
    pub reason: String,
}

impl fmt::Display for IdleSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} = {} has no effect in this layout ({}); it is kept for the layouts where it has",
            self.key, self.value, self.reason
        )
    }
}

/// The defaults of every key of [`IDLE`]: the built-in default config, and `[model.moe]`'s
/// own (absent unless set).
fn defaults() -> Value {
    let mut d = default_value();
    if let Ok(moe) = Value::try_from(merak_burn::moe::MoeConfig::new(1, 1, 1)) {
        set_key(&mut d, "model.moe", moe);
    }
    d
}

impl Config {
    /// The keys of this config that differ from their defaults but have no effect in its
    /// layout ([`IDLE`]).
    pub fn idle_settings(&self) -> Vec<IdleSetting> {
        let (Ok(mine), defaults) = (Value::try_from(self), defaults()) else {
            return Vec::new();
        };
        IDLE.iter()
            .filter_map(|i| {
                let value = value_at(&mine, i.key)?;
                if value_at(&defaults, i.key) == Some(value) {
                    return None;
                }
                Some(IdleSetting {
                    key: i.key,
                    value: value.to_string(),
                    reason: (i.idle)(self)?,
                })
            })
            .collect()
    }

    /// Warns, once each, of the keys that have no effect in this config's layout
    /// ([`idle_settings`](Self::idle_settings)); called by rank 0 once the layout is final.
    pub fn warn_idle_settings(&self) {
        for s in self.idle_settings() {
            tracing::warn!("{s}");
        }
    }
}
