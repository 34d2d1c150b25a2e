//! The PyTorch twin of one multi-token-prediction depth (`scripts/mtp-fixture.py` wrote the
//! fixture): the head unit of a tiny GPT with `model.mtp_depth = 1`, from the same weights,
//! last hidden states and targets, gives the same depth loss, total loss and gradients.

use std::collections::HashMap;

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use merak_burn::backend::CpuAutodiff as B;
use merak_burn::batch::{Batch, DropoutPosition, Samples, TARGETS};
use merak_burn::checkpoint::state::{assign_params, local_params};
use merak_burn::comm::Group;

use crate::mtp::targets::{DepthBatch, with_depth_fields};
use crate::{Gpt, GptConfig};

/// A JSON array of numbers as f32.
fn floats(v: &serde_json::Value) -> Vec<f32> {
    (v.as_array().expect("an array").iter())
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// The largest difference of `got` from `want` over `want`'s largest magnitude.
fn rel(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
    let worst = (got.iter().zip(want)).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / scale
}

/// The fixture and a one-process GPT with one depth holding its weights (the rest of the
/// model as initialized).
fn fixture_model() -> (serde_json::Value, Gpt<B>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mtp/torch.json");
    let text = std::fs::read_to_string(path).expect("the fixture");
    let f: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let n = |k: &str| f[k].as_u64().expect("a size") as usize;
    let cfg = GptConfig {
        vocab_size: n("vocab"),
        layers: 1,
        heads: n("heads"),
        hidden: n("hidden"),
        seq_len: n("seq"),
        dropout: 0.0,
        layer_norm_eps: f["eps"].as_f64().expect("eps"),
        mtp_depth: 1,
        mtp_loss_weight: f["weight"].as_f64().expect("the weight"),
        ..GptConfig::preset("tiny").expect("a preset")
    };
    let gpt = Gpt::<B>::new(&cfg, 1, Group::local(), &Default::default()).expect("the model");
    let mut values: HashMap<String, Vec<f32>> = (local_params(&gpt).expect("params").into_iter())
        .map(|p| (p.name, p.values))
        .collect();
    for (name, w) in f["weights"].as_object().expect("weights") {
        let slot = (values.get_mut(name)).unwrap_or_else(|| panic!("{name} is not a parameter"));
        let mut w = floats(w);
        // The token table's padding rows stay zero.
        w.resize(slot.len(), 0.0);
        *slot = w;
    }
    (f, assign_params(gpt, values).expect("assigned"))
}

#[test]
fn one_mtp_depth_agrees_with_pytorch() {
    let (f, gpt) = fixture_model();
    let n = |k: &str| f[k].as_u64().expect("a size") as usize;
    let (b, s, h) = (n("batch"), n("seq"), n("hidden"));
    let device = Default::default();
    let hidden = TensorData::new(floats(&f["hidden_states"]), [b, s, h]);
    let hidden = Tensor::<B, 3>::from_data(hidden, &device).require_grad();
    let targets: Vec<i64> = (f["targets"].as_array().expect("targets").iter())
        .map(|t| t.as_i64().expect("an id"))
        .collect();
    let samples = Samples::new(b).with_int(TARGETS, &[s], targets.clone());
    let samples = with_depth_fields(samples.expect("samples"), 1).expect("the depth's fields");
    let batch = Batch::<B>::new(&samples, &device);
    let depth = DepthBatch::of(&batch, 1).expect("the depth's inputs");
    let terms = targets.iter().filter(|&&t| t >= 0).count();
    let targets = Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [b, s]), &device);
    let at = DropoutPosition::default();
    let main = (hidden.clone(), targets, terms);
    let (sum, depths) = gpt.training_loss(main, Some(&depth), (None, &at));
    // The fixture's total is the mean over the main targets.
    let total = sum / terms as f32;
    let scalar = |t: Tensor<B, 1>| t.into_data().to_vec::<f32>().expect("f32")[0];
    let depth = scalar(depths[0].clone());
    let want = |k: &str| f[k].as_f64().expect("a loss") as f32;
    assert!(
        rel(&[depth], &[want("depth")]) <= 1e-5,
        "{depth} vs {}",
        want("depth")
    );
    let got_total = scalar(total.clone());
    assert!(rel(&[got_total], &[want("total")]) <= 1e-5, "{got_total}");
    let grads = total.backward();
    let g = &f["grad"];
    let hidden_grad = hidden.grad(&grads).expect("a gradient").into_data();
    let hidden_grad = hidden_grad.to_vec::<f32>().expect("f32");
    let e = rel(&hidden_grad, &floats(&g["hidden_states"]));
    assert!(e <= 1e-5, "the hidden states' gradient: {e:e}");
    let proj = gpt.mtp[0]
        .proj
        .grad(&grads)
        .expect("a gradient")
        .into_data();
    let e = rel(
        &proj.to_vec::<f32>().expect("f32"),
        &floats(&g["mtp.0.proj"]),
    );
    assert!(e <= 1e-5, "proj's gradient: {e:e}");
    let table = gpt
        .wte
        .as_ref()
        .expect("the table")
        .embedding
        .weight
        .grad(&grads);
    let table = table
        .expect("a gradient")
        .into_data()
        .to_vec::<f32>()
        .expect("f32");
    let want_table = floats(&g["wte.embedding.weight"]);
    let e = rel(&table[..want_table.len()], &want_table);
    assert!(
        e <= 1e-5,
        "the tied table's gradient (embedding and head): {e:e}"
    );
}

/// The depths' parameters are what the config (and the planner's shape) counts, and they live
/// only on the head's pipeline rank.
#[test]
fn the_depths_hold_the_parameters_the_planner_counts() {
    let cfg = GptConfig {
        mtp_depth: 2,
        ..GptConfig::preset("tiny").expect("a preset")
    };
    let device = Default::default();
    let gpt = Gpt::<B>::new(&cfg, 1, Group::local(), &device).expect("the model");
    assert_eq!(gpt.mtp.len(), 2);
    assert_eq!(gpt.num_params() as u64, cfg.num_params());
    let h = cfg.hidden as u64;
    let plain = GptConfig {
        mtp_depth: 0,
        ..cfg.clone()
    }
    .num_params();
    assert_eq!(cfg.num_params() - plain, 2 * (14 * h * h + 19 * h));
    let first_stage = |u: usize| u <= 1;
    let part = Gpt::<B>::new_units(&cfg, 1, Group::local(), &device, &first_stage);
    assert!(part.expect("a stage").mtp.is_empty());
}
