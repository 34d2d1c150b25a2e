//! The attention kernels on wgpu (llvmpipe in CI) or CUDA (the kernel-test bundle,
//! `KERNEL_TESTS=1 scripts/gpu-bundle.sh`) against the CPU backend's kernel, and the tiled
//! forward with bf16 operands against a host reference of the same tiling:
//! - in `f32`, the tiled forward and backward (their scalar form) equal the CPU's kernel at
//!   [`TOLERANCE`](super::tests);
//! - the scalar form with its operands rounded to bf16 (llvmpipe has no bf16: the rounding is
//!   emulated) equals the host reference that rounds the same operands the same way, and
//!   differs from the `f32` attention by bf16's rounding; its backward differs from the CPU's
//!   `f32` gradients by bf16's rounding;
//! - on CUDA, the bf16 attention runs on tensor cores and equals the same reference up to its
//!   bf16 output, and its backward the CPU's `f32` kernel up to bf16's rounding.

use burn::tensor::ops::IntTensorOps;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, Tensor, TensorData};

use super::attention::{forward, scalar_tiles};
use super::attention_tiles::Tiles;
use super::tests::{Gpu, PRODUCTS_TOLERANCE, device, host_cpu, host_gpu, ints, pair, same, within};
use crate::backend::Cpu;
use crate::kernels::{AttentionSpec, FusedOps, prim};
use crate::rng::InitRng;

/// (batch, seq, heads, head_dim): one query, a ragged block of queries, several blocks and
/// several key tiles, a sequence of many tiles, a head of 64.
const SHAPES: [(usize, usize, usize, usize); 5] = [
    (1, 1, 1, 4),
    (2, 5, 2, 8),
    (1, 70, 3, 16),
    (2, 300, 1, 16),
    (1, 65, 2, 64),
];

/// (causal, packed): every mask.
const MASKS: [(bool, bool); 4] = [(true, false), (false, false), (true, true), (false, true)];

/// Segment ids of packed documents: ids that grow along each sequence, ragged lengths.
fn segment_ids(b: usize, s: usize) -> Vec<i64> {
    (0..b * s)
        .map(|t| ((t % s) / 7 + (t % s) / 23) as i64)
        .collect()
}

/// The segment ids `[b, s]` on both backends, where `packed`.
fn segments(b: usize, s: usize, packed: bool) -> (Option<IntTensor<Gpu>>, Option<IntTensor<Cpu>>) {
    packed
        .then(|| {
            let (g, c) = ints(&segment_ids(b, s));
            let shape = Shape::from(vec![b, s]);
            (
                Gpu::int_reshape(g, shape.clone()),
                Cpu::int_reshape(c, shape),
            )
        })
        .unzip()
}

#[test]
fn attention_equals_the_cpu_kernel() {
    let rng = InitRng::new(7);
    for (b, s, h, d) in SHAPES {
        for (causal, packed) in MASKS {
            let tag = format!("attention [{b}, {s}, {h}, {d}] causal {causal} packed {packed}");
            let spec = AttentionSpec { heads: h, causal };
            let (seg, segc) = segments(b, s, packed);
            let (qkv, qkvc) = pair(&rng, &format!("qkv{tag}"), &[b, s, 3 * h * d]);
            let (ctx, lse) = Gpu::attention_forward(qkv.clone(), spec, seg.clone());
            let (ctxc, lsec) = Cpu::attention_forward(qkvc.clone(), spec, segc.clone());
            let (lse, lsec) = (lse.expect("the kernel's lse"), lsec.expect("the CPU's lse"));
            same(&format!("{tag} context"), ctx.clone(), ctxc.clone());
            same(&format!("{tag} log-sum-exp"), lse.clone(), lsec.clone());
            let (dctx, dctxc) = pair(&rng, &format!("dctx{tag}"), &[b, s, h * d]);
            within(
                &format!("{tag} backward"),
                Gpu::attention_backward(qkv, ctx, Some(lse), dctx, spec, seg),
                Cpu::attention_backward(qkvc, ctxc, Some(lsec), dctxc, spec, segc),
                0.0,
                PRODUCTS_TOLERANCE,
            );
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as the kernel's emulation rounds it.
fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits((bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// The tiled forward's arithmetic on the host, in `f32`, with bf16 operands: queries, keys,
/// values and each tile's probabilities rounded to bf16, the scores, sums and context in
/// `f32`, tiles of `keys` keys, the online softmax's steps as the kernel takes them (each sum
/// in sequence order; the kernel's run in another order, which only rounding can tell). The
/// context `[b, s, h * d]` and the log-sum-exp `[b, h, s]`.
fn tiled_reference(
    qkv: &[f32],
    (b, s, h, d): (usize, usize, usize, usize),
    causal: bool,
    ids: Option<&[i64]>,
    keys: usize,
) -> (Vec<f32>, Vec<f32>) {
    let width = 3 * h * d;
    let at = |t: usize, part: usize, head: usize, e: usize| {
        round_bf16(qkv[t * width + part * h * d + head * d + e])
    };
    let scale = (1.0 / (d as f64).sqrt()) as f32;
    let (mut ctx, mut lse) = (vec![0.0f32; b * s * h * d], vec![0.0f32; b * h * s]);
    for (batch, head, i) in
        (0..b).flat_map(|x| (0..h).flat_map(move |y| (0..s).map(move |z| (x, y, z))))
    {
        let row = batch * s;
        let seen = |j: usize| {
            j < s && (!causal || j <= i) && ids.is_none_or(|ids| ids[row + j] == ids[row + i])
        };
        let (mut top, mut sum, mut out) = (-3.0e38f32, 0.0f32, vec![0.0f32; d]);
        for start in (0..s).step_by(keys) {
            let score = |j: usize| {
                let mut dot = 0.0f32;
                for e in 0..d {
                    dot += at(row + i, 0, head, e) * at(row + j.min(s - 1), 1, head, e);
                }
                dot * scale
            };
            let tile: Vec<usize> = (start..start + keys).collect();
            let new_top = tile
                .iter()
                .filter(|&&j| seen(j))
                .fold(top, |m, &j| m.max(score(j)));
            let alpha = (top - new_top).exp();
            let probs: Vec<f32> = tile
                .iter()
                .map(|&j| {
                    if seen(j) {
                        (score(j) - new_top).exp()
                    } else {
                        0.0
                    }
                })
                .collect();
            sum = sum * alpha + probs.iter().fold(0.0f32, |a, p| a + p);
            for (e, o) in out.iter_mut().enumerate() {
                let mut pv = 0.0f32;
                for (c, p) in probs.iter().enumerate() {
                    pv += round_bf16(*p) * at(row + (start + c).min(s - 1), 2, head, e);
                }
                *o = *o * alpha + pv;
            }
            top = new_top;
        }
        for (e, o) in out.iter().enumerate() {
            ctx[(row + i) * h * d + head * d + e] = o / sum;
        }
        lse[(batch * h + head) * s + i] = top + sum.ln();
    }
    (ctx, lse)
}

/// The relative difference of `got` from `want` ([`super::tests::relative`]), their lengths
/// checked.
fn relative(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    super::tests::relative(got, want, 0.0)
}

/// The host values and the device tensor of a random Q/K/V buffer `[b, s, 3 h d]`.
fn qkv_values(rng: &InitRng, tag: &str, shape: [usize; 3]) -> (Vec<f32>, FloatTensor<Gpu>) {
    let n = shape.iter().product();
    let values = rng.normal(&format!("qkv{tag}"), n, 1.0);
    let data = TensorData::new(values.clone(), shape.to_vec());
    let gpu = prim(Tensor::<Gpu, 3>::from_data(data, &device()));
    (values, gpu)
}

/// `values` as a CPU tensor `[b, s, 3 h d]`.
fn on_cpu(values: &[f32], (b, s, h, d): (usize, usize, usize, usize)) -> FloatTensor<Cpu> {
    let data = TensorData::new(values.to_vec(), vec![b, s, 3 * h * d]);
    prim(Tensor::<Cpu, 3>::from_data(data, &Default::default()))
}

/// The scalar tile product with its operands rounded to bf16 computes what the host reference
/// of the tiling computes (the same roundings), and so differs from the `f32` attention by
/// bf16's rounding, no more: the emulation is on, and it is bf16's.
#[test]
fn the_scalar_tiles_with_bf16_operands_equal_the_tiled_reference() {
    let rng = InitRng::new(17);
    for (b, s, h, d) in SHAPES {
        for (causal, packed) in MASKS {
            let tag = format!("[{b}, {s}, {h}, {d}] causal {causal} packed {packed}");
            let spec = AttentionSpec { heads: h, causal };
            let (values, qkv) = qkv_values(&rng, &tag, [b, s, 3 * h * d]);
            let limit = qkv.client.properties().hardware.max_shared_memory_size;
            let tiles = scalar_tiles(d, 4, limit, true, Tiles::shared_bytes).expect("a tiling");
            let (seg, _) = segments(b, s, packed);
            let ids = segment_ids(b, s);
            let (ctx, lse) = forward(qkv, spec, seg, tiles);
            let (ctx, lse) = (host_gpu(ctx), host_gpu(lse));
            let ids = packed.then_some(ids.as_slice());
            let (want, want_lse) = tiled_reference(&values, (b, s, h, d), causal, ids, tiles.keys);
            // The device's `exp` is not the host's to the last bit: now and then a probability
            // rounds to the neighbouring bf16 (2e-5 measured on [2, 300, 1, 16]).
            let rel = relative(&ctx, &want);
            assert!(
                rel <= 1e-4,
                "{tag}: context {rel:e} from the tiled reference"
            );
            let rel = relative(&lse, &want_lse);
            assert!(
                rel <= 1e-6,
                "{tag}: log-sum-exp {rel:e} from the tiled reference"
            );
            // Against the unrounded f32 attention: bf16's rounding shows, and no more.
            let rel = relative(&ctx, &cpu_context(&values, (b, s, h, d), spec, packed));
            assert!(
                (1e-5..=1e-2).contains(&rel),
                "{tag}: context {rel:e} from the f32 attention (bf16 rounding is about 4e-3)"
            );
        }
    }
}

/// The scalar backward with its operands (queries, keys, values, context gradients, `p` and
/// `ds`) rounded to bf16, from the forward's rounded context: within bf16's distance of the
/// CPU's `f32` gradients, and not equal to them (the emulation is on).
#[test]
fn the_scalar_backward_with_bf16_operands_is_bf16_from_the_cpu() {
    use super::attention_backward::{backward, shared_bytes};
    let rng = InitRng::new(23);
    for (b, s, h, d) in SHAPES {
        for (causal, packed) in MASKS {
            let tag = format!("backward [{b}, {s}, {h}, {d}] causal {causal} packed {packed}");
            let spec = AttentionSpec { heads: h, causal };
            let (values, qkv) = qkv_values(&rng, &tag, [b, s, 3 * h * d]);
            let limit = qkv.client.properties().hardware.max_shared_memory_size;
            let forward_tiles = scalar_tiles(d, 4, limit, true, Tiles::shared_bytes);
            let backward_tiles = scalar_tiles(d, 4, limit, true, shared_bytes);
            let (seg, segc) = segments(b, s, packed);
            let (ctx, lse) = forward(
                qkv.clone(),
                spec,
                seg.clone(),
                forward_tiles.expect("a tiling"),
            );
            let (dctx, dctxc) = pair(&rng, &format!("dctx{tag}"), &[b, s, h * d]);
            let got = backward(
                qkv,
                ctx,
                lse,
                dctx,
                spec,
                seg,
                backward_tiles.expect("a tiling"),
            );
            let qkvc = on_cpu(&values, (b, s, h, d));
            let (ctxc, lsec) = Cpu::attention_forward(qkvc.clone(), spec, segc.clone());
            let want = Cpu::attention_backward(qkvc, ctxc, lsec, dctxc, spec, segc);
            let rel = relative(&host_gpu(got), &host_cpu(want));
            assert!(
                (1e-5..=2e-2).contains(&rel),
                "{tag}: {rel:e} from the f32 gradients (bf16 rounding is about 4e-3)"
            );
        }
    }
}

/// The context of the `f32` attention of `values` by the CPU backend's kernel.
fn cpu_context(
    values: &[f32],
    shape: (usize, usize, usize, usize),
    spec: AttentionSpec,
    packed: bool,
) -> Vec<f32> {
    let (_, segc) = segments(shape.0, shape.1, packed);
    host_cpu(Cpu::attention_forward(on_cpu(values, shape), spec, segc).0)
}

/// On CUDA: a bf16 attention on tensor cores and in the scalar form computes what the host
/// reference of the tiling computes up to its bf16 context, with its log-sum-exp in `f32`; the
/// backward pass from it equals the CPU's `f32` gradients up to bf16's rounding.
#[cfg(not(feature = "wgpu"))]
#[test]
fn bf16_attention_equals_the_tiled_reference() {
    use super::attention_tiles::TileProduct;
    let rng = InitRng::new(19);
    for shape in [(2, 300, 1, 16), (1, 65, 2, 64), (2, 1024, 2, 64)] {
        for (causal, packed) in MASKS {
            for product in [TileProduct::Cmma, TileProduct::Scalar] {
                half_attention_equals_the_reference(&rng, shape, causal, packed, product);
            }
        }
    }
}

/// [`bf16_attention_equals_the_tiled_reference`] for one shape, mask and product.
#[cfg(not(feature = "wgpu"))]
fn half_attention_equals_the_reference(
    rng: &InitRng,
    (b, s, h, d): (usize, usize, usize, usize),
    causal: bool,
    packed: bool,
    product: super::attention_tiles::TileProduct,
) {
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::{DType, FloatDType};
    let tag = format!("bf16 {product:?} [{b}, {s}, {h}, {d}] causal {causal} packed {packed}");
    let spec = AttentionSpec { heads: h, causal };
    let (values, qkv) = qkv_values(rng, &tag, [b, s, 3 * h * d]);
    let qkv = Gpu::float_cast(qkv, FloatDType::BF16);
    let tiles = super::attention::tiles_for(&qkv, spec, product).expect("a tiling");
    assert_eq!(tiles.product, product, "{tag}: the product asked for");
    let (seg, segc) = segments(b, s, packed);
    let (ctx, lse) = forward(qkv.clone(), spec, seg.clone(), tiles);
    assert_eq!(lse.dtype, DType::F32, "{tag}: an f32 log-sum-exp");
    let got = host_gpu(Gpu::float_cast(ctx.clone(), FloatDType::F32));
    let ids = segment_ids(b, s);
    let ids = packed.then_some(ids.as_slice());
    let (want, want_lse) = tiled_reference(&values, (b, s, h, d), causal, ids, tiles.keys);
    // The context is rounded to bf16 (2⁻⁹ relative at most), the sums are not in the
    // reference's order.
    let rel = relative(&got, &want);
    assert!(
        rel <= 4e-3,
        "{tag}: context {rel:e} from the tiled reference"
    );
    let rel = relative(&host_gpu(lse.clone()), &want_lse);
    assert!(
        rel <= 1e-5,
        "{tag}: log-sum-exp {rel:e} from the tiled reference"
    );
    let (dctx, dctxc) = pair(rng, &format!("dctx{tag}"), &[b, s, h * d]);
    let qkvc = on_cpu(&values, (b, s, h, d));
    let (ctxc, lsec) = Cpu::attention_forward(qkvc.clone(), spec, segc.clone());
    let dctx = Gpu::float_cast(dctx, FloatDType::BF16);
    let back = super::attention_backward::tiles_for(&qkv, spec, product).expect("a tiling");
    assert_eq!(back.product, product, "{tag}: the backward's product");
    let grad = super::attention_backward::backward(qkv, ctx, lse, dctx, spec, seg, back);
    within(
        &format!("{tag} backward"),
        Gpu::float_cast(grad, FloatDType::F32),
        Cpu::attention_backward(qkvc, ctxc, lsec, dctxc, spec, segc),
        0.0,
        2e-2,
    );
}
