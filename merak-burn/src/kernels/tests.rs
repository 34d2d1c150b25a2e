//! Each fused operation against the same computation composed of Burn operators and
//! differentiated by Burn: values and every gradient within 1e-5, on `Autodiff<Flex>` with and
//! without balanced checkpointing (which recomputes the memory-bound operations through their
//! `RetroForward`). The composed default kernels (what CUDA runs) are checked against the
//! burn-flex kernels too.

use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Tensor, TensorData};

use super::*;
use crate::backend::{Cpu, CpuAutodiff, CpuAutodiffSelective};
use crate::rng::InitRng;

fn values<K: Backend, const D: usize>(t: Tensor<K, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().unwrap()
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

fn close(what: &str, a: Vec<f32>, b: Vec<f32>) {
    let e = rel(&a, &b);
    assert!(e <= 1e-5, "{what}: relative error {e:e}");
}

fn tensor<K: Backend, const D: usize>(
    rng: &InitRng,
    name: &str,
    shape: [usize; D],
) -> Tensor<K, D> {
    let n = shape.iter().product();
    Tensor::from_data(
        TensorData::new(rng.normal(name, n, 1.0), shape),
        &Default::default(),
    )
}

/// `f` applied to fresh leaves (`shapes`, drawn from `rng`), and the loss `sum(out * w)` with
/// fixed random `w`: the output and the gradient of every leaf.
fn run<K: AutodiffBackend, const D: usize>(
    shapes: &[Vec<usize>],
    f: impl Fn(&[Tensor<K, 2>]) -> Tensor<K, D>,
) -> Vec<Vec<f32>> {
    let rng = InitRng::new(11);
    let leaves: Vec<Tensor<K, 2>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let t: Tensor<K, 2> = tensor(&rng, &format!("leaf{i}"), [s[0], s[1]]);
            t.require_grad()
        })
        .collect();
    let out = f(&leaves);
    let w: Tensor<K, D> = Tensor::from_data(
        TensorData::new(
            rng.normal("w", out.shape().num_elements(), 1.0),
            out.shape(),
        ),
        &Default::default(),
    );
    let grads = (out.clone() * w).sum().backward();
    let mut res = vec![values(out)];
    for l in &leaves {
        res.push(values(l.grad(&grads).expect("every leaf gets a gradient")));
    }
    res
}

fn compare(what: &str, fused: Vec<Vec<f32>>, composed: Vec<Vec<f32>>) {
    for (i, (a, b)) in fused.into_iter().zip(composed).enumerate() {
        let part = if i == 0 {
            "value".to_string()
        } else {
            format!("gradient {i}")
        };
        close(&format!("{what} {part}"), a, b);
    }
}

fn check_all<K: AutodiffBackend + FusedOps>(tag: &str) {
    // LayerNorm: x [rows, d], gamma and beta as [1, d] leaves.
    let (rows, d) = (10, 24);
    let shapes = [vec![rows, d], vec![1, d], vec![1, d]];
    let fused = run::<K, 2>(&shapes, |l| {
        layer_norm(
            l[0].clone(),
            l[1].clone().reshape([d]),
            l[2].clone().reshape([d]),
            1e-5,
        )
    });
    let composed = run::<K, 2>(&shapes, |l| {
        let x = l[0].clone();
        let c = x.clone() - x.mean_dim(1);
        let var = c.clone().powi_scalar(2).mean_dim(1);
        c / (var + 1e-5).sqrt() * l[1].clone() + l[2].clone()
    });
    compare(&format!("{tag} layer norm"), fused, composed);

    // Bias + GELU.
    let shapes = [vec![rows, d], vec![1, d]];
    let fused = run::<K, 2>(&shapes, |l| {
        bias_gelu(l[0].clone(), l[1].clone().reshape([d]))
    });
    let composed = run::<K, 2>(&shapes, |l| gelu(l[0].clone() + l[1].clone()));
    compare(&format!("{tag} bias gelu"), fused, composed);

    // Linear, with a bias and with a transposed weight (a tied head).
    let shapes = [vec![rows, 5], vec![5, 7], vec![1, 7]];
    let fused = run::<K, 2>(&shapes, |l| {
        linear(l[0].clone(), l[1].clone(), Some(l[2].clone().reshape([7])))
    });
    let composed = run::<K, 2>(&shapes, |l| {
        l[0].clone().matmul(l[1].clone()) + l[2].clone()
    });
    compare(&format!("{tag} linear"), fused, composed);
    let shapes = [vec![rows, 5], vec![7, 5]];
    let fused = run::<K, 2>(&shapes, |l| {
        linear(l[0].clone(), l[1].clone().transpose(), None)
    });
    let composed = run::<K, 2>(&shapes, |l| l[0].clone().matmul(l[1].clone().transpose()));
    compare(&format!("{tag} linear, transposed weight"), fused, composed);

    // Attention on a fused QKV buffer: 2 sequences of 7 tokens, 3 heads of 4 features.
    let (b, s, h, hd) = (2, 7, 3, 4);
    for causal in [true, false] {
        let shapes = [vec![b * s, 3 * h * hd]];
        let spec = AttentionSpec { heads: h, causal };
        let fused = run::<K, 3>(&shapes, |l| {
            attention(l[0].clone().reshape([b, s, 3 * h * hd]), spec)
        });
        let composed = run::<K, 3>(&shapes, |l| {
            let qkv = l[0].clone().reshape([b, s, 3 * h * hd]);
            let mut parts = qkv
                .chunk(3, 2)
                .into_iter()
                .map(|t| t.reshape([b, s, h, hd]).swap_dims(1, 2));
            let (q, k, v) = (
                parts.next().unwrap(),
                parts.next().unwrap(),
                parts.next().unwrap(),
            );
            let mut scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (hd as f64).sqrt());
            if causal {
                let future = Tensor::<K, 2, Bool>::tril_mask([s, s], 0, &Default::default());
                scores = scores.mask_fill(
                    future.unsqueeze::<4>().expand([b, h, s, s]),
                    f32::NEG_INFINITY,
                );
            }
            softmax(scores, 3)
                .matmul(v)
                .swap_dims(1, 2)
                .reshape([b, s, h * hd])
        });
        compare(
            &format!("{tag} attention (causal {causal})"),
            fused,
            composed,
        );
    }
}

#[test]
fn fused_operations_equal_their_compositions() {
    check_all::<CpuAutodiff>("autodiff");
}

#[test]
fn fused_operations_equal_their_compositions_under_balanced_checkpointing() {
    check_all::<CpuAutodiffSelective>("balanced checkpointing");
}

/// The values of a primitive seen as rank `D`.
fn host<const D: usize>(p: FloatTensor<Cpu>) -> Vec<f32> {
    values(lift::<Cpu, D>(p))
}

/// The composed default kernels (CUDA's) give what the burn-flex kernels give.
#[test]
fn composed_kernels_equal_the_cpu_kernels() {
    let rng = InitRng::new(5);
    let x: Tensor<Cpu, 2> = tensor(&rng, "x", [6, 16]);
    let g: Tensor<Cpu, 1> = tensor::<Cpu, 2>(&rng, "g", [1, 16]).reshape([16]);
    let bt: Tensor<Cpu, 1> = tensor::<Cpu, 2>(&rng, "b", [1, 16]).reshape([16]);
    let dy: Tensor<Cpu, 2> = tensor(&rng, "dy", [6, 16]);

    let (y1, s1) =
        Cpu::layer_norm_forward(prim(x.clone()), prim(g.clone()), prim(bt.clone()), 1e-5);
    let (y2, s2) = composed::layer_norm_forward::<Cpu>(
        prim(x.clone()),
        prim(g.clone()),
        prim(bt.clone()),
        1e-5,
    );
    close("layer norm forward", host::<2>(y1), host::<2>(y2));
    let a = Cpu::layer_norm_backward(prim(x.clone()), prim(g.clone()), s1, prim(dy.clone()));
    let c = composed::layer_norm_backward::<Cpu>(
        prim(x.clone()),
        prim(g.clone()),
        s2,
        prim(dy.clone()),
    );
    for (i, (a, c)) in a.into_iter().zip(c).enumerate() {
        close(
            &format!("layer norm backward {i}"),
            host::<2>(a),
            host::<2>(c),
        );
    }

    let a = Cpu::bias_gelu_backward(prim(x.clone()), prim(bt.clone()), prim(dy.clone()));
    let c =
        composed::bias_gelu_backward::<Cpu>(prim(x.clone()), prim(bt.clone()), prim(dy.clone()));
    for (i, (a, c)) in a.into_iter().zip(c).enumerate() {
        close(
            &format!("bias gelu backward {i}"),
            host::<2>(a),
            host::<2>(c),
        );
    }

    let spec = AttentionSpec {
        heads: 2,
        causal: true,
    };
    let qkv: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "qkv", [10, 24]).reshape([2, 5, 24]);
    let dctx: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "dctx", [10, 8]).reshape([2, 5, 8]);
    let (c1, p1) = Cpu::attention_forward(prim(qkv.clone()), spec);
    let (c2, p2) = composed::attention_forward::<Cpu>(prim(qkv.clone()), spec);
    close("attention forward", host::<3>(c1), host::<3>(c2));
    let (p1, p2) = (
        p1.expect("flex keeps probs"),
        p2.expect("composed keeps probs"),
    );
    let d1 = Cpu::attention_backward(prim(qkv.clone()), p1, prim(dctx.clone()), spec);
    let d2 = composed::attention_backward::<Cpu>(prim(qkv), p2, prim(dctx), spec);
    close("attention backward", host::<3>(d1), host::<3>(d2));

    let logits: Tensor<Cpu, 2> = tensor(&rng, "logits", [6, 16]);
    let targets = Tensor::<Cpu, 1, burn::tensor::Int>::from_data(
        TensorData::new(vec![1i64, 15, -1, 0, 9, 3], [6]),
        &Default::default(),
    );
    let shard = VocabShard {
        start: 0,
        valid: 14,
    };
    let local = crate::comm::Group::local();
    let (l1, s1) = Cpu::cross_entropy_forward(
        prim(logits.clone()),
        targets.clone().into_primitive(),
        shard,
        local,
    );
    let (l2, s2) = composed::cross_entropy_forward::<Cpu>(
        prim(logits.clone()),
        targets.clone().into_primitive(),
        shard,
        local,
    );
    close("cross-entropy forward", host::<1>(l1), host::<1>(l2));
    let one = || {
        prim(Tensor::<Cpu, 1>::from_data(
            TensorData::new(vec![0.5f32], [1]),
            &Default::default(),
        ))
    };
    let g1 = Cpu::cross_entropy_backward(
        prim(logits.clone()),
        s1,
        targets.clone().into_primitive(),
        shard,
        one(),
    );
    let g2 = composed::cross_entropy_backward::<Cpu>(
        prim(logits),
        s2,
        targets.into_primitive(),
        shard,
        one(),
    );
    close("cross-entropy backward", host::<2>(g1), host::<2>(g2));

    let sq = Cpu::sum_of_squares(prim(x.clone()));
    let want: f64 = values(x).iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    assert!((sq - want).abs() <= 1e-12 * want, "{sq} vs {want}");
}

/// The CUDA attention (Burn's attention operation, no probabilities kept) gives the composed
/// context, and the backward pass over recomputed probabilities gives the composed gradient,
/// with and without the causal mask.
#[test]
fn unsaved_attention_equals_the_composed_attention() {
    let rng = InitRng::new(5);
    for causal in [true, false] {
        let spec = AttentionSpec { heads: 3, causal };
        let qkv: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "qkv", [14, 36]).reshape([2, 7, 36]);
        let dctx: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "dctx", [14, 12]).reshape([2, 7, 12]);
        let (c1, p1) = composed::attention_forward_unsaved::<Cpu>(prim(qkv.clone()), spec);
        assert!(p1.is_none(), "the unsaved attention keeps no probabilities");
        let (c2, p2) = composed::attention_forward::<Cpu>(prim(qkv.clone()), spec);
        close("unsaved attention forward", host::<3>(c1), host::<3>(c2));
        let p2 = p2.expect("composed keeps probs");
        let recomputed = composed::attention_probs::<Cpu>(prim(qkv.clone()), spec);
        close(
            "recomputed probs",
            host::<4>(recomputed.clone()),
            host::<4>(p2.clone()),
        );
        let d1 = Cpu::attention_backward(prim(qkv.clone()), recomputed, prim(dctx.clone()), spec);
        let d2 = composed::attention_backward::<Cpu>(prim(qkv), p2, prim(dctx), spec);
        close(
            "attention backward over recomputed probs",
            host::<3>(d1),
            host::<3>(d2),
        );
    }
}
