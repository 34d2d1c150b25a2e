//! The MoE layer against a per-token reference, its capacity drops, and its auxiliary losses'
//! gradient against finite differences.

use burn::tensor::{Tensor, TensorData};

use super::*;
use crate::backend::{Cpu, CpuAutodiff};
use crate::rng::InitRng;

fn cfg(extra: &str) -> MoeConfig {
    let text = format!("experts = 4\ntop_k = 2\nexpert_hidden = 6\n{extra}");
    toml::from_str(&text).expect("a MoE table")
}

fn layer<B: crate::tensor_parallel::ParallelBackend>(c: &MoeConfig) -> MoeLayer<B> {
    let rng = InitRng::new(3);
    let init = ExpertInit {
        rng: &rng,
        std: 0.5,
        out_std: 0.5,
    };
    MoeLayer::new(
        c,
        8,
        "moe",
        init,
        MoePlace::single(0, 5),
        &Default::default(),
    )
}

fn input<B: burn::tensor::backend::Backend>() -> Tensor<B, 3> {
    let v = InitRng::new(9).normal("x", 2 * 5 * 8, 1.0);
    Tensor::from_data(TensorData::new(v, [2, 5, 8]), &Default::default())
}

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec()
        .expect("f32 values")
}

/// Token by token: the router's softmax scores, the top-k, the renormalized gates, and the
/// weighted sum of the chosen experts (each run on that token alone) plus the shared expert.
fn reference(
    m: &MoeLayer<Cpu>,
    x: Tensor<Cpu, 3>,
    keep: &dyn Fn(usize, usize) -> bool,
) -> Vec<f32> {
    let c = m.config();
    let rows = x.reshape([10, 8]);
    let scores = values(burn::tensor::activation::softmax(
        rows.clone().matmul(m.router.val()),
        1,
    ));
    let mut out = Vec::new();
    for t in 0..10 {
        let row = rows.clone().narrow(0, t, 1);
        let s = &scores[t * c.experts..(t + 1) * c.experts];
        let mut order: Vec<usize> = (0..c.experts).collect();
        order.sort_by(|a, b| s[*b].total_cmp(&s[*a]));
        let chosen = &order[..c.top_k];
        let sum: f32 = chosen.iter().map(|&e| s[e]).sum();
        let mut y = match &m.shared {
            Some(sh) => values(sh.forward(row.clone(), None)),
            None => vec![0.0; 8],
        };
        for (j, &e) in chosen.iter().enumerate() {
            if !keep(t, j) {
                continue;
            }
            let expert = m.experts[e].as_ref().expect("every expert on one rank");
            let ye = values(expert.forward(row.clone(), None));
            y.iter_mut().zip(ye).for_each(|(a, b)| *a += s[e] / sum * b);
        }
        out.extend(y);
    }
    out
}

fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(worst <= tol, "{what}: largest difference {worst}");
}

#[test]
fn the_layer_weighs_each_tokens_top_k_experts_by_their_gates() {
    for extra in ["shared_experts = 1", "activation = \"swiglu\""] {
        let m = layer::<Cpu>(&cfg(extra));
        let got = values(m.forward(input()));
        assert_close(extra, &got, &reference(&m, input(), &|_, _| true), 1e-5);
    }
}

/// Which assignments (2 per token of the 2 x 5 input) a capacity of one token per expert
/// keeps when every `tokens` tokens form a routing group: each expert's first in the group.
fn first_of_each_expert(m: &MoeLayer<Cpu>, tokens: usize) -> Vec<bool> {
    let scores = values(burn::tensor::activation::softmax(
        input::<Cpu>().reshape([10, 8]).matmul(m.router.val()),
        1,
    ));
    let choice = routing::top_k(&scores, None, 4, 2);
    let mut taken = [[false; 4]; 2];
    let kept: Vec<bool> = (choice.iter().enumerate())
        .map(|(a, &e)| !std::mem::replace(&mut taken[a / 2 / tokens][e], true))
        .collect();
    assert!(kept.iter().any(|k| !k), "something is dropped");
    kept
}

/// Balanced per micro-batch, with a capacity of one token per expert (factor 0.2 of 10 tokens
/// × 2 / 4), each expert keeps the first token (in sequence order) that chose it.
#[test]
fn a_capacity_keeps_the_first_tokens_of_each_expert() {
    let m = layer::<Cpu>(&cfg("capacity_factor = 0.2\nbalance = \"micro-batch\""));
    let got = values(m.forward(input()));
    let kept = first_of_each_expert(&m, 10);
    let want = reference(&m, input(), &|t, j| kept[t * 2 + j]);
    assert_close("capacity", &got, &want, 1e-5);
}

/// Balanced per sequence (the default), a capacity of one token per expert (factor 0.4 of 5
/// tokens × 2 / 4) holds in each sequence: each expert keeps the first token of each sequence
/// that chose it, whatever the other sequence chose.
#[test]
fn a_capacity_per_sequence_keeps_each_sequences_first_tokens() {
    let m = layer::<Cpu>(&cfg("capacity_factor = 0.4"));
    let got = values(m.forward(input()));
    let kept = first_of_each_expert(&m, 5);
    assert_ne!(kept, first_of_each_expert(&m, 10), "the groups matter here");
    let want = reference(&m, input(), &|t, j| kept[t * 2 + j]);
    assert_close("capacity per sequence", &got, &want, 1e-5);
}

/// The recorded auxiliary loss (Switch and z) of the layer on `x`, at weight 1.
fn recorded_aux(m: &MoeLayer<CpuAutodiff>, x: Tensor<CpuAutodiff, 3>) -> f64 {
    set_aux_scale(1.0);
    take_records();
    let _ = (m.forward(x) * 0.0).sum().backward();
    take_records().iter().map(|r| r.aux_loss).sum()
}

/// Balanced per sequence, the auxiliary loss of a micro-batch of two sequences is the mean of
/// each sequence's alone: how the sequences are cut into micro-batches (and so the layout)
/// does not change it. Balanced per micro-batch it is not (the Switch loss is not linear in
/// the loads).
#[test]
fn the_auxiliary_loss_per_sequence_does_not_depend_on_the_micro_batch() {
    let apart = |extra: &str| {
        let m = layer::<CpuAutodiff>(&cfg(extra));
        let whole = recorded_aux(&m, input());
        let one = |s| recorded_aux(&m, input().narrow(0, s, 1));
        (whole, (one(0) + one(1)) / 2.0)
    };
    let (whole, mean) = apart("aux_loss = 1.0\nz_loss = 1.0");
    assert!((whole - mean).abs() <= 1e-6 * mean, "{whole} vs {mean}");
    let (whole, mean) = apart("aux_loss = 1.0\nz_loss = 1.0\nbalance = \"micro-batch\"");
    assert!((whole - mean).abs() > 1e-4 * mean, "{whole} vs {mean}");
}

/// With no gradient from above, the router's gradient is the auxiliary losses' alone: it
/// matches central differences of the recorded loss.
#[test]
fn the_auxiliary_losses_train_the_router() {
    let c = cfg("aux_loss = 1.0\nz_loss = 1.0");
    set_aux_scale(1.0);
    let run = |m: &MoeLayer<CpuAutodiff>| {
        let y = m.forward(input());
        take_records();
        (y * 0.0).sum().backward()
    };
    let m = layer::<CpuAutodiff>(&c);
    let grads = run(&m);
    let analytic = values(
        m.router
            .val()
            .grad(&grads)
            .expect("the router has a gradient"),
    );
    let aux_at = |i: usize, d: f32| {
        let mut w = values(m.router.val().inner());
        w[i] += d;
        let mut moved = layer::<CpuAutodiff>(&c);
        moved.router = crate::tensor_parallel::param_from_values(w, [8, 4], &Default::default());
        run(&moved);
        let r = take_records();
        r.iter().map(|r| r.aux_loss).sum::<f64>()
    };
    for i in [0, 5, 13, 30] {
        let eps = 1e-2;
        let numeric = (aux_at(i, eps) - aux_at(i, -eps)) / (2.0 * f64::from(eps));
        let a = f64::from(analytic[i]);
        assert!(
            (a - numeric).abs() <= 2e-3 * numeric.abs().max(1.0),
            "router[{i}]: {a} vs {numeric}"
        );
    }
}

/// A balancing step raises the biases of the experts below the mean load and lowers the
/// others'; the choice then sees them.
#[test]
fn balancing_moves_the_biases_towards_the_mean_load() {
    let c = cfg("bias_update_rate = 0.5");
    let route = |m: &MoeLayer<CpuAutodiff>| {
        let y = m.forward(input());
        take_records();
        (y * 0.0).sum().backward();
        take_records().remove(0).loads
    };
    let mut m = layer::<CpuAutodiff>(&c);
    let before = route(&m);
    m.balance(&[1, 5, 5, 9]);
    let bias = values(m.bias.as_ref().expect("biases").val());
    assert_eq!(bias, vec![0.5, 0.0, 0.0, -0.5]);
    // A bias of 0.5 on expert 0 outweighs any gap of the softmax scores: every token chooses
    // it now.
    assert_ne!(before[0], 10, "{before:?}");
    assert_eq!(route(&m)[0], 10);
}

/// A rank that receives more than twice the mean rows (every rank sends 20 at top-2 of 10
/// tokens) stops the run, naming the layer and the counts.
#[test]
fn routing_past_the_stated_bound_stops_naming_the_counts() {
    assert_eq!(layer::within_bound(3, &[30, 10], 20, 2), Ok(()));
    let e = layer::within_bound(3, &[35, 6], 20, 2).unwrap_err();
    assert!(
        e.starts_with(
            "layer 3: this expert-parallel rank received 41 token rows for its experts ([35, 6])"
        ),
        "{e}"
    );
    assert!(e.contains("model.moe.max_load = 2 x the mean of 20"), "{e}");
    // The advice names the bound that would have held (41 rows: 3 x 20).
    assert!(
        e.contains("raise it to 3 or more (a resume may: --set model.moe.max_load=3;"),
        "{e}"
    );
}
