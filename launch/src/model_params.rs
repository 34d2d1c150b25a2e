//! The parameters of the model a config builds (names, full shapes, splits), listed before a
//! run makes anything, so that a checkpoint to resume or pretrained weights that do not fit
//! the model are refused before training, naming the tensor, both shapes and the config key
//! that likely differs.

use std::collections::HashMap;

use anyhow::{Result, anyhow};
use merak_burn::backend::Cpu;
use merak_burn::checkpoint::state::{ParamShape, param_shapes};
use merak_burn::checkpoint::{Checkpoint, CheckpointError, ParamEntry, check_model};
use merak_burn::comm::Group;
use merak_burn::pipeline::PipelineModel;
use merak_burn::tensor_parallel::ShardKind;

use crate::config::Config;

/// Every parameter of the model of `cfg` in one process (full shapes, with the splits its
/// layers declare), all pipeline units, without tied copies: built one unit at a time on
/// the CPU, so that at most one unit's values are in memory at once.
pub fn model_params(cfg: &Config) -> Result<Vec<ParamShape>> {
    let mut out = Vec::new();
    let mut units = 1;
    let mut unit = 0;
    while unit < units {
        let (shapes, copies, count) = unit_params(cfg, unit)?;
        units = count;
        let is_copy = |p: &ParamShape| copies.iter().any(|(copy, _)| *copy == p.name);
        out.extend(shapes.into_iter().filter(|p| !is_copy(p)));
        unit += 1;
    }
    Ok(out)
}

/// The parameters of unit `unit` of the model of `cfg` built alone (one process), its tied
/// `(copy, original)` names, and the model's unit count.
type UnitParams = (Vec<ParamShape>, Vec<(String, String)>, usize);

/// See [`UnitParams`].
fn unit_params(cfg: &Config, unit: usize) -> Result<UnitParams> {
    let device = Default::default();
    let (seed, holds) = (cfg.train.seed, |u: usize| u == unit);
    if cfg.model.kind == "bert" {
        let m =
            merak_bert::Bert::<Cpu>::new_units(&cfg.bert(), seed, Group::local(), &device, &holds)?;
        return Ok((param_shapes(&m), m.tied_names(), m.units()));
    }
    let gpt = &cfg.model.gpt;
    let m = merak_gpt::Gpt::<Cpu>::new_units(gpt, seed, Group::local(), &device, &holds)?;
    Ok((param_shapes(&m), m.tied_names(), m.units()))
}

/// Checks the checkpoint `ck` against the model of `cfg`: the same parameters, each of the
/// same full shape and split. The error names a few parameters on either side and the config
/// keys that likely differ, or the parameter whose shape differs with both shapes.
pub fn check_checkpoint(cfg: &Config, ck: &Checkpoint) -> Result<()> {
    let model = model_params(cfg)?;
    ck.manifest
        .check_model(&model)
        .map_err(|e| explain(e, cfg, "the checkpoint"))
}

/// Checks pretrained weights (`params`: full shape and values by merak name, read from
/// another format) against the model of `cfg`, as [`check_checkpoint`] does a checkpoint.
/// GPT's multi-token-prediction depths (`mtp.*`), which GPT-2 files cannot hold, are not
/// asked of them: they keep their initial values.
pub fn check_pretrained(
    cfg: &Config,
    params: &HashMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<()> {
    let mut model = model_params(cfg)?;
    let depth = merak_gpt::mtp::is_depth_param;
    model.retain(|p| !depth(&p.name) || params.contains_key(&p.name));
    let split = |name: &str| model.iter().find(|p| p.name == name).map(|p| p.split);
    let mut entries: Vec<ParamEntry> = (params.iter())
        .map(|(name, (shape, _))| ParamEntry {
            name: name.clone(),
            shape: shape.clone(),
            shard: split(name).unwrap_or(ShardKind::Replicated),
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    check_model(&entries, &model).map_err(|e| explain(e, cfg, "the file"))
}

/// `e` with what the user can do about it: the config keys that likely make the parameters
/// differ, or the model's sizes for a shape that differs; `stored` names the other side.
fn explain(e: CheckpointError, cfg: &Config, stored: &str) -> anyhow::Error {
    let text = e.to_string().replace("the checkpoint", stored);
    match &e {
        CheckpointError::Unmatched { extra, missing } => {
            let layers = cfg.model.gpt.layers;
            let all: Vec<&String> = extra.iter().chain(missing).collect();
            let mut keys: Vec<&str> = (all.iter())
                .map(|name| likely_key(name, layers, &|n| all.iter().any(|a| *a == n)))
                .collect();
            keys.sort_unstable();
            keys.dedup();
            anyhow!(
                "{text} (the setting that likely differs from the run that wrote it: {})",
                keys.join(", ")
            )
        }
        CheckpointError::Mismatch { .. } => {
            anyhow!("{text}; the model this config gives: {}", sizes(cfg))
        }
        _ => anyhow!(e),
    }
}

/// The sizes of the model of `cfg`, for messages.
fn sizes(cfg: &Config) -> String {
    let g = &cfg.model.gpt;
    format!(
        "model.kind = {:?}, model.vocab_size = {}, model.layers = {}, model.heads = {}, \
         model.hidden = {}, model.seq_len = {}",
        cfg.model.kind, g.vocab_size, g.layers, g.heads, g.hidden, g.seq_len
    )
}

/// The config key that most likely makes the GPT or BERT parameter `name` exist in one model
/// and not in another of `layers` blocks; `listed(n)` says whether parameter `n` differs
/// too (an expert's bias alone differs with the activation, with its weight with the
/// experts).
fn likely_key(name: &str, layers: usize, listed: &dyn Fn(&str) -> bool) -> &'static str {
    let block = (name.strip_prefix("blocks."))
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(i, _)| i.parse::<usize>().ok());
    let bias_alone = (name
        .strip_suffix(".b_in")
        .or_else(|| name.strip_suffix(".b_out")))
    .is_some_and(|network| !listed(&format!("{network}.w_in")));
    match name {
        _ if block.is_some_and(|b| b >= layers) => "model.layers",
        n if n.contains(".moe.") && bias_alone => "model.moe.activation",
        n if n.contains(".moe.shared.") => "model.moe.shared_experts",
        n if n.ends_with(".moe.bias") => "model.moe.bias_update_rate",
        n if n.contains(".moe.experts.") => "model.moe.experts",
        n if n.contains(".moe.") || n.contains(".mlp.") => "model.moe (or model.moe.every)",
        _ => "model.kind",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_likely_key_follows_the_parameter_name() {
        let with_weights = |n: &str| n.ends_with(".w_in");
        for (name, key) in [
            ("blocks.0.moe.shared.w_in", "model.moe.shared_experts"),
            ("blocks.0.moe.shared.b_in", "model.moe.shared_experts"),
            ("blocks.1.moe.bias", "model.moe.bias_update_rate"),
            ("blocks.1.moe.experts.7.w_out", "model.moe.experts"),
            ("blocks.1.moe.experts.7.b_out", "model.moe.experts"),
            ("blocks.0.moe.router", "model.moe (or model.moe.every)"),
            (
                "blocks.0.mlp.fc.linear.weight",
                "model.moe (or model.moe.every)",
            ),
            ("blocks.5.ln_1.gamma", "model.layers"),
            ("cls.transform.weight", "model.kind"),
        ] {
            assert_eq!(likely_key(name, 2, &with_weights), key, "{name}");
        }
        // Biases without their weights: gelu experts against swiglu ones.
        let key = likely_key("blocks.1.moe.experts.3.b_out", 2, &|_| false);
        assert_eq!(key, "model.moe.activation");
    }

    #[test]
    fn the_model_params_are_the_whole_model_built_unit_by_unit() {
        let sets = ["model.preset=tiny".to_string()];
        let cfg = crate::config::load(None, &sets).unwrap();
        let listed = model_params(&cfg).unwrap();
        let device = Default::default();
        let whole = merak_gpt::Gpt::<Cpu>::new(&cfg.model.gpt, 1, Group::local(), &device).unwrap();
        assert_eq!(listed, strip_ids(param_shapes(&whole), &listed));
    }

    /// `shapes` with the ids of `like` (ids are random per build).
    fn strip_ids(mut shapes: Vec<ParamShape>, like: &[ParamShape]) -> Vec<ParamShape> {
        for (p, q) in shapes.iter_mut().zip(like) {
            p.id = q.id;
        }
        shapes
    }
}
