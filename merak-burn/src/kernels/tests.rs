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
    check_attention::<K>(tag, [2, 7, 3, 4], None);
    // Attention within segments, 70 tokens (two key blocks): the fused operation against the
    // composition with the segment mask.
    let (b, s) = (2, 70);
    let ids: Vec<i64> = (0..b * s).map(|i| (i % s / 17 + i / s) as i64).collect();
    check_attention::<K>(tag, [b, s, 2, 4], Some(&ids));
}

/// The fused attention (within segments `ids`, `[b, s]`, when given) against its composition of
/// Burn operators, causal and not, for `[b, s, h, hd]`: values and gradients.
fn check_attention<K: AutodiffBackend + FusedOps>(
    tag: &str,
    [b, s, h, hd]: [usize; 4],
    ids: Option<&[i64]>,
) {
    let seg = || {
        ids.map(|ids| {
            Tensor::<K, 2, burn::tensor::Int>::from_data(
                TensorData::new(ids.to_vec(), [b, s]),
                &Default::default(),
            )
        })
    };
    for causal in [true, false] {
        let shapes = [vec![b * s, 3 * h * hd]];
        let spec = AttentionSpec { heads: h, causal };
        let fused = run::<K, 3>(&shapes, |l| {
            let qkv = l[0].clone().reshape([b, s, 3 * h * hd]);
            match seg() {
                Some(segments) => attention_in_segments(qkv, spec, segments),
                None => attention(qkv, spec),
            }
        });
        let composed = run::<K, 3>(&shapes, |l| {
            composed_attention(l[0].clone(), [b, s, h, hd], causal, seg())
        });
        let within = if ids.is_some() { " in segments" } else { "" };
        compare(
            &format!("{tag} attention{within} (causal {causal})"),
            fused,
            composed,
        );
    }
}

/// Attention composed of Burn operators on a `[b * s, 3 * h * hd]` Q/K/V buffer: a token sees
/// no later token when `causal`, and only tokens of its own segment when `segments` are given.
fn composed_attention<K: Backend>(
    qkv: Tensor<K, 2>,
    [b, s, h, hd]: [usize; 4],
    causal: bool,
    segments: Option<Tensor<K, 2, burn::tensor::Int>>,
) -> Tensor<K, 3> {
    let qkv = qkv.reshape([b, s, 3 * h * hd]);
    let mut parts = qkv
        .chunk(3, 2)
        .into_iter()
        .map(|t| t.reshape([b, s, h, hd]).swap_dims(1, 2));
    let (q, k, v) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let scores = q.matmul(k.swap_dims(2, 3)) * (1.0 / (hd as f64).sqrt());
    let device = scores.device();
    let mut hidden = Tensor::<K, 3, burn::tensor::Int>::zeros([b, s, s], &device).bool();
    if let Some(seg) = segments {
        hidden = seg
            .clone()
            .reshape([b, s, 1])
            .expand([b, s, s])
            .not_equal(seg.reshape([b, 1, s]).expand([b, s, s]));
    }
    if causal {
        let future = Tensor::<K, 2, Bool>::tril_mask([s, s], 0, &device);
        hidden = hidden.bool_or(future.unsqueeze::<3>().expand([b, s, s]));
    }
    let scores = scores.mask_fill(
        hidden.unsqueeze_dim::<4>(1).expand([b, h, s, s]),
        f32::NEG_INFINITY,
    );
    softmax(scores, 3)
        .matmul(v)
        .swap_dims(1, 2)
        .reshape([b, s, h * hd])
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

    // Attention: 2 sequences of 70 tokens (two key blocks), with and without segment ids.
    let (b, s, h, hd) = (2, 70, 2, 4);
    let qkv: Tensor<Cpu, 3> =
        tensor::<Cpu, 2>(&rng, "qkv", [b * s, 3 * h * hd]).reshape([b, s, 3 * h * hd]);
    let dctx: Tensor<Cpu, 3> =
        tensor::<Cpu, 2>(&rng, "dctx", [b * s, h * hd]).reshape([b, s, h * hd]);
    for causal in [true, false] {
        for segmented in [false, true] {
            let spec = AttentionSpec { heads: h, causal };
            let tag = format!("attention (causal {causal}, segments {segmented})");
            let seg = || segmented.then(|| segments(b, s).into_primitive());
            let (c1, l1) = Cpu::attention_forward(prim(qkv.clone()), spec, seg());
            let (c2, l2) = composed::attention_forward::<Cpu>(prim(qkv.clone()), spec, seg());
            close(
                &format!("{tag} forward"),
                host::<3>(c1.clone()),
                host::<3>(c2.clone()),
            );
            let (l1, l2) = (l1.expect("flex gives lse"), l2.expect("composed gives lse"));
            close(
                &format!("{tag} lse"),
                host::<3>(l1.clone()),
                host::<3>(l2.clone()),
            );
            let d1 = Cpu::attention_backward(
                prim(qkv.clone()),
                c1,
                Some(l1),
                prim(dctx.clone()),
                spec,
                seg(),
            );
            let d2 = composed::attention_backward::<Cpu>(
                prim(qkv.clone()),
                c2,
                Some(l2),
                prim(dctx.clone()),
                spec,
                seg(),
            );
            close(&format!("{tag} backward"), host::<3>(d1), host::<3>(d2));
        }
    }

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

/// Segment ids `[batch, seq]`: sorted runs of different lengths per sequence.
fn segments(batch: usize, seq: usize) -> Tensor<Cpu, 2, burn::tensor::Int> {
    let ids: Vec<i64> = (0..batch)
        .flat_map(|b| (0..seq).map(move |i| ((i * (b + 2)) / 23) as i64))
        .collect();
    Tensor::from_data(TensorData::new(ids, [batch, seq]), &Default::default())
}

/// The CUDA attention (Burn's attention operation, no log-sum-exp) gives the composed context,
/// and the backward pass recomputing the softmax gives the composed gradient, with and without
/// the causal mask and segment ids.
#[test]
fn unsaved_attention_equals_the_composed_attention() {
    let rng = InitRng::new(5);
    for causal in [true, false] {
        for segmented in [false, true] {
            let spec = AttentionSpec { heads: 3, causal };
            let seg = || segmented.then(|| segments(2, 7).into_primitive());
            let qkv: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "qkv", [14, 36]).reshape([2, 7, 36]);
            let dctx: Tensor<Cpu, 3> = tensor::<Cpu, 2>(&rng, "dctx", [14, 12]).reshape([2, 7, 12]);
            let (c1, l1) =
                composed::attention_forward_unsaved::<Cpu>(prim(qkv.clone()), spec, seg());
            assert!(l1.is_none(), "the unsaved attention gives no log-sum-exp");
            let (c2, l2) = composed::attention_forward::<Cpu>(prim(qkv.clone()), spec, seg());
            close(
                "unsaved attention forward",
                host::<3>(c1.clone()),
                host::<3>(c2.clone()),
            );
            let d1 = composed::attention_backward::<Cpu>(
                prim(qkv.clone()),
                c1,
                None,
                prim(dctx.clone()),
                spec,
                seg(),
            );
            let d2 = Cpu::attention_backward(prim(qkv), c2, l2, prim(dctx), spec, seg());
            close(
                "attention backward recomputing the softmax",
                host::<3>(d1),
                host::<3>(d2),
            );
        }
    }
}
