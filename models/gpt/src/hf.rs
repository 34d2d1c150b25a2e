//! The tensor names of Hugging Face's `GPT2LMHeadModel`, for exporting a trained model and
//! importing pretrained weights ([`crate::hf_import`]).
//!
//! merak's GPT has GPT-2's structure and layout: linear weights are stored `[in, out]` like
//! GPT-2's `Conv1D`, the fused Q/K/V projection holds Q, K then V columns, and the output head
//! is tied to the token embedding (GPT-2 stores no separate `lm_head.weight`). Only the names
//! differ, and the token table must be cut back to the real vocabulary.

use crate::GptConfig;

/// merak names outside the blocks and their `GPT2LMHeadModel` names without `transformer.`.
const TOP: [(&str, &str); 4] = [
    ("wte.embedding.weight", "wte.weight"),
    ("wpe.weight", "wpe.weight"),
    ("ln_f.gamma", "ln_f.weight"),
    ("ln_f.beta", "ln_f.bias"),
];

/// merak names inside block `i` (after `blocks.{i}.`) and their `GPT2LMHeadModel` names
/// (after `transformer.h.{i}.`).
const BLOCK: [(&str, &str); 12] = [
    ("ln_1.gamma", "ln_1.weight"),
    ("ln_1.beta", "ln_1.bias"),
    ("ln_2.gamma", "ln_2.weight"),
    ("ln_2.beta", "ln_2.bias"),
    ("attn.qkv.linear.weight", "attn.c_attn.weight"),
    ("attn.qkv.linear.bias", "attn.c_attn.bias"),
    ("attn.proj.linear.weight", "attn.c_proj.weight"),
    ("attn.proj.bias", "attn.c_proj.bias"),
    ("mlp.fc.linear.weight", "mlp.c_fc.weight"),
    ("mlp.fc.linear.bias", "mlp.c_fc.bias"),
    ("mlp.proj.linear.weight", "mlp.c_proj.weight"),
    ("mlp.proj.bias", "mlp.c_proj.bias"),
];

/// The `GPT2LMHeadModel` name of a merak GPT parameter (its path in the module tree), or
/// `None` for a name that is not part of a merak GPT.
pub fn hf_gpt2_name(name: &str) -> Option<String> {
    if let Some((_, t)) = TOP.iter().find(|(ours, _)| *ours == name) {
        return Some(format!("transformer.{t}"));
    }
    let rest = name.strip_prefix("blocks.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, part) = BLOCK.iter().find(|(ours, _)| *ours == rest)?;
    Some(format!("transformer.h.{layer}.{part}"))
}

/// The merak GPT parameter of a `GPT2LMHeadModel` tensor name (`transformer.h.0.ln_1.weight`
/// -> `blocks.0.ln_1.gamma`): the inverse of [`hf_gpt2_name`]. `None` for a name that has no
/// merak counterpart (`lm_head.weight`, attention mask buffers, names without `transformer.`).
pub fn merak_gpt_name(hf: &str) -> Option<String> {
    let rest = hf.strip_prefix("transformer.")?;
    if let Some((ours, _)) = TOP.iter().find(|(_, t)| *t == rest) {
        return Some(ours.to_string());
    }
    let rest = rest.strip_prefix("h.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (ours, _) = BLOCK.iter().find(|(_, t)| *t == rest)?;
    Some(format!("blocks.{layer}.{ours}"))
}

/// The shape `GPT2LMHeadModel` expects for each of its tensors, for a model of shape `cfg`, in
/// a fixed order: `(name, shape)`.
pub fn hf_gpt2_shapes(cfg: &GptConfig) -> Vec<(String, Vec<usize>)> {
    let (h, v, s) = (cfg.hidden, cfg.vocab_size, cfg.seq_len);
    let mut out = vec![
        ("transformer.wte.weight".to_string(), vec![v, h]),
        ("transformer.wpe.weight".to_string(), vec![s, h]),
    ];
    for i in 0..cfg.layers {
        let p = |n: &str| format!("transformer.h.{i}.{n}");
        out.extend([
            (p("ln_1.weight"), vec![h]),
            (p("ln_1.bias"), vec![h]),
            (p("attn.c_attn.weight"), vec![h, 3 * h]),
            (p("attn.c_attn.bias"), vec![3 * h]),
            (p("attn.c_proj.weight"), vec![h, h]),
            (p("attn.c_proj.bias"), vec![h]),
            (p("ln_2.weight"), vec![h]),
            (p("ln_2.bias"), vec![h]),
            (p("mlp.c_fc.weight"), vec![h, 4 * h]),
            (p("mlp.c_fc.bias"), vec![4 * h]),
            (p("mlp.c_proj.weight"), vec![4 * h, h]),
            (p("mlp.c_proj.bias"), vec![h]),
        ]);
    }
    out.push(("transformer.ln_f.weight".to_string(), vec![h]));
    out.push(("transformer.ln_f.bias".to_string(), vec![h]));
    out
}

/// The Hugging Face `config.json` of a GPT-2 of shape `cfg` (exact GELU, as merak's MLP uses;
/// dropout off). The end-of-text token is GPT-2's (50256) for the GPT-2 vocabulary and the
/// last id otherwise.
pub fn hf_gpt2_config(cfg: &GptConfig) -> serde_json::Value {
    let eot = 50256.min(cfg.vocab_size.saturating_sub(1));
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_ctx": cfg.seq_len,
        "n_embd": cfg.hidden,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": 4 * cfg.hidden,
        "activation_function": "gelu",
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "initializer_range": cfg.init_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32"
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Gpt;
    use merak_burn::backend::Cpu;
    use merak_burn::checkpoint::state::param_shapes;
    use merak_burn::comm::Group;

    #[test]
    fn every_parameter_maps_to_a_gpt2_tensor_of_the_same_shape() {
        let cfg = GptConfig::preset("tiny").unwrap();
        let model = Gpt::<Cpu>::new(&cfg, 1, Group::local(), &Default::default()).unwrap();
        let params = param_shapes(&model);
        let expected: std::collections::HashMap<String, Vec<usize>> =
            hf_gpt2_shapes(&cfg).into_iter().collect();
        assert_eq!(params.len(), expected.len());
        for p in &params {
            let (ours, shape) = (&p.name, &p.shape);
            let theirs = hf_gpt2_name(ours).unwrap_or_else(|| panic!("{ours} has no GPT-2 name"));
            assert_eq!(expected.get(&theirs), Some(shape), "{ours} -> {theirs}");
            assert_eq!(merak_gpt_name(&theirs).as_deref(), Some(ours.as_str()));
        }
    }
}
