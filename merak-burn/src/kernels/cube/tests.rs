//! Each CubeCL kernel on wgpu (Mesa's llvmpipe in CI), or on CUDA in a build with `cuda` and
//! without `wgpu` (run on a GPU machine: `KERNEL_TESTS=1 scripts/gpu-bundle.sh`), against the
//! CPU backend's kernel on the same inputs: values and gradients, on random values and ragged
//! shapes (one row, one column, widths that are not multiples of a cube, more rows than
//! threads), at [`TOLERANCE`].

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Shape, Tensor, TensorData};

use crate::backend::Cpu;
#[cfg(feature = "wgpu")]
pub(super) use crate::backend::{Wgpu as Gpu, WgpuDevice};
use crate::comm::Group;
use crate::kernels::{AdamWStep, FusedOps, VocabShard, lift, prim};
use crate::rng::InitRng;

/// The bound on the relative difference (the norm of the difference over the norm of the CPU's
/// result) of every kernel's result from the CPU's.
const TOLERANCE: f64 = 1e-5;

/// `(rows, d)`: ragged on purpose.
const SHAPES: [(usize, usize); 6] = [(1, 1), (3, 5), (7, 33), (64, 257), (5, 1000), (300, 24)];

/// wgpu's default adapter (llvmpipe where Mesa's software driver is the only one).
#[cfg(feature = "wgpu")]
pub(super) fn device() -> WgpuDevice {
    WgpuDevice::DefaultDevice
}

/// The CUDA backend (a build with `cuda` and without `wgpu`).
#[cfg(not(feature = "wgpu"))]
pub(super) type Gpu = burn_cuda::Cuda<f32>;

/// The first CUDA device.
#[cfg(not(feature = "wgpu"))]
pub(super) fn device() -> burn_cuda::CudaDevice {
    burn_cuda::CudaDevice::default()
}

/// Random values for `shape` on both backends.
pub(super) fn pair(
    rng: &InitRng,
    name: &str,
    shape: &[usize],
) -> (FloatTensor<Gpu>, FloatTensor<Cpu>) {
    let n = shape.iter().product();
    let data = TensorData::new(rng.normal(name, n, 1.0), [n]);
    let gpu = prim(Tensor::<Gpu, 1>::from_data(data.clone(), &device()));
    let cpu = prim(Tensor::<Cpu, 1>::from_data(data, &Default::default()));
    let shape = Shape::from(shape.to_vec());
    (
        Gpu::float_reshape(gpu, shape.clone()),
        Cpu::float_reshape(cpu, shape),
    )
}

/// The same integers on both backends.
pub(super) fn ints(values: &[i64]) -> (IntTensor<Gpu>, IntTensor<Cpu>) {
    let data = TensorData::new(values.to_vec(), [values.len()]);
    (
        Tensor::<Gpu, 1, Int>::from_data(data.clone(), &device()).into_primitive(),
        Tensor::<Cpu, 1, Int>::from_data(data, &Default::default()).into_primitive(),
    )
}

pub(super) fn host_gpu(x: FloatTensor<Gpu>) -> Vec<f32> {
    lift::<Gpu, 1>(x)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 values")
}

pub(super) fn host_cpu(x: FloatTensor<Cpu>) -> Vec<f32> {
    lift::<Cpu, 1>(x)
        .into_data()
        .convert::<f32>()
        .to_vec()
        .expect("f32 values")
}

/// The bound for a result that goes through matrix products (the attention's backward pass,
/// Burn's composed operators): 1e-5 on wgpu; on CUDA 1.7e-4 was measured on one query (H100,
/// 2026-11-27), consistent with CubeCL's tensor-core products rounding f32 to TF32.
#[cfg(feature = "wgpu")]
pub(super) const PRODUCTS_TOLERANCE: f64 = TOLERANCE;
#[cfg(not(feature = "wgpu"))]
pub(super) const PRODUCTS_TOLERANCE: f64 = 2e-3;

/// The norm of `got - want` over the larger of `want`'s norm and `scale` (the lengths must
/// agree; the callers check them).
pub(super) fn relative(got: &[f32], want: &[f32], scale: f64) -> f64 {
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(a - b).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|b| f64::from(*b).powi(2)).sum();
    diff.sqrt() / norm.sqrt().max(scale).max(1e-15)
}

/// Asserts that the GPU's result is within [`TOLERANCE`] of the CPU's.
pub(super) fn same(what: &str, gpu: FloatTensor<Gpu>, cpu: FloatTensor<Cpu>) {
    within(what, gpu, cpu, 0.0, TOLERANCE);
}

/// Asserts that the GPU's result is within `tolerance` of the CPU's, relative to the larger
/// of the CPU result's norm and `scale`: the size of the terms a result is the difference of,
/// where they cancel (LayerNorm's `dx` over one column is 0 up to rounding).
pub(super) fn within(
    what: &str,
    gpu: FloatTensor<Gpu>,
    cpu: FloatTensor<Cpu>,
    scale: f64,
    tolerance: f64,
) {
    let (g, c) = (host_gpu(gpu), host_cpu(cpu));
    assert_eq!(g.len(), c.len(), "{what}: lengths");
    let rel = relative(&g, &c, scale);
    assert!(
        rel <= tolerance,
        "{what}: relative difference {rel:e} from the CPU"
    );
}

#[test]
fn bias_gelu_equals_the_cpu_kernel() {
    let rng = InitRng::new(1);
    for (rows, d) in SHAPES {
        let tag = format!("bias-GELU [{rows}, {d}]");
        let (x, xc) = pair(&rng, &format!("x{tag}"), &[rows, d]);
        let (b, bc) = pair(&rng, &format!("b{tag}"), &[d]);
        let (dy, dyc) = pair(&rng, &format!("dy{tag}"), &[rows, d]);
        same(
            &format!("{tag} forward"),
            Gpu::bias_gelu_forward(x.clone(), b.clone()),
            Cpu::bias_gelu_forward(xc.clone(), bc.clone()),
        );
        let [dx, db] = Gpu::bias_gelu_backward(x, b, dy);
        let [dxc, dbc] = Cpu::bias_gelu_backward(xc, bc, dyc);
        same(&format!("{tag} dx"), dx, dxc);
        same(&format!("{tag} dbias"), db, dbc);
    }
}

#[test]
fn layer_norm_equals_the_cpu_kernel() {
    let rng = InitRng::new(2);
    for (rows, d) in SHAPES {
        let tag = format!("LayerNorm [{rows}, {d}]");
        let (x, xc) = pair(&rng, &format!("x{tag}"), &[rows, d]);
        let (g, gc) = pair(&rng, &format!("g{tag}"), &[d]);
        let (b, bc) = pair(&rng, &format!("b{tag}"), &[d]);
        let (dy, dyc) = pair(&rng, &format!("dy{tag}"), &[rows, d]);
        let (y, stats) = Gpu::layer_norm_forward(x.clone(), g.clone(), b, 1e-5);
        let (yc, statsc) = Cpu::layer_norm_forward(xc.clone(), gc.clone(), bc, 1e-5);
        same(&format!("{tag} forward"), y, yc);
        same(&format!("{tag} mean"), stats.0.clone(), statsc.0.clone());
        same(&format!("{tag} 1 / std"), stats.1.clone(), statsc.1.clone());
        // dx = rstd (dy g - mean(dy g) - x̂ mean(dy g x̂)): its terms are of size rstd |dy g|.
        let (dy_h, g_h) = (host_cpu(dyc.clone()), host_cpu(gc.clone()));
        let rstd = host_cpu(statsc.1.clone());
        let terms: f64 = (dy_h.iter().enumerate())
            .map(|(i, dy)| f64::from(rstd[i / d] * dy * g_h[i % d]).powi(2))
            .sum();
        let grads = Gpu::layer_norm_backward(x, g, stats, dy);
        let gradsc = Cpu::layer_norm_backward(xc, gc, statsc, dyc);
        let scales = [terms.sqrt(), 0.0, 0.0];
        for ((name, scale), (a, c)) in ["dx", "dgamma", "dbeta"]
            .iter()
            .zip(scales)
            .zip(grads.into_iter().zip(gradsc))
        {
            within(&format!("{tag} {name}"), a, c, scale, TOLERANCE);
        }
    }
}

#[test]
fn embedding_equals_the_cpu_kernel() {
    let rng = InitRng::new(3);
    // A shard of rows 5..5 + rows of a larger table: ids below, inside and above it.
    for (rows, d) in SHAPES {
        let tag = format!("embedding [{rows}, {d}]");
        let (table, tablec) = pair(&rng, &format!("t{tag}"), &[rows, d]);
        let n = 2 * rows + 3;
        let ids: Vec<i64> = rng
            .integers(&format!("i{tag}"), n, (rows + 10) as u64)
            .into_iter()
            .map(|i| i as i64)
            .collect();
        let (ids, idsc) = ints(&ids);
        same(
            &format!("{tag} forward"),
            Gpu::gather_forward(table, ids.clone(), 5),
            Cpu::gather_forward(tablec, idsc.clone(), 5),
        );
        let (dy, dyc) = pair(&rng, &format!("dy{tag}"), &[n, d]);
        same(
            &format!("{tag} backward"),
            Gpu::gather_backward(ids, dy, rows, 5),
            Cpu::gather_backward(idsc, dyc, rows, 5),
        );
    }
}

#[test]
fn cross_entropy_equals_the_cpu_kernel() {
    let rng = InitRng::new(4);
    // Shards of a vocabulary from column 7, with and without padding columns; targets below,
    // inside and above the shard, and ignored ones (-1).
    for (rows, cols) in [(1, 3), (9, 40), (33, 700), (300, 5)] {
        for valid in [cols, cols - cols / 3] {
            let tag = format!("cross-entropy [{rows}, {cols}], {valid} valid");
            let (logits, logitsc) = pair(&rng, &format!("l{tag}"), &[rows, cols]);
            let targets: Vec<i64> = rng
                .integers(&format!("t{tag}"), rows, (cols + 12) as u64)
                .into_iter()
                .map(|t| t as i64 - 1)
                .collect();
            let (t, tc) = ints(&targets);
            let shard = VocabShard { start: 7, valid };
            let (loss, stats) =
                Gpu::cross_entropy_forward(logits.clone(), t.clone(), shard, Group::local());
            let (lossc, statsc) =
                Cpu::cross_entropy_forward(logitsc.clone(), tc.clone(), shard, Group::local());
            same(&format!("{tag} loss"), loss, lossc);
            same(&format!("{tag} statistics"), stats.clone(), statsc.clone());
            let (g, gc) = pair(&rng, &format!("g{tag}"), &[1]);
            same(
                &format!("{tag} backward"),
                Gpu::cross_entropy_backward(logits, stats, t, shard, g),
                Cpu::cross_entropy_backward(logitsc, statsc, tc, shard, gc),
            );
        }
    }
}

#[test]
fn adamw_equals_the_cpu_kernel() {
    let rng = InitRng::new(5);
    for n in [1, 255, 257, 10_000] {
        let (p, pc) = pair(&rng, &format!("p{n}"), &[n]);
        let (g, gc) = pair(&rng, &format!("g{n}"), &[n]);
        let mut step = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            time: 1,
        };
        let (p, m, v) = Gpu::adamw_step(p, g.clone(), None, step);
        let (pc, mc, vc) = Cpu::adamw_step(pc, gc.clone(), None, step);
        step.time = 2;
        let (p, m, v) = Gpu::adamw_step(p, g, Some((m, v)), step);
        let (pc, mc, vc) = Cpu::adamw_step(pc, gc, Some((mc, vc)), step);
        same(&format!("AdamW [{n}] parameter"), p, pc);
        same(&format!("AdamW [{n}] first moment"), m, mc);
        same(&format!("AdamW [{n}] second moment"), v, vc);
    }
}

#[test]
fn sum_of_squares_equals_the_cpu_kernel() {
    let rng = InitRng::new(6);
    // Chunks of 4,096 elements: one, a ragged last chunk, many.
    for n in [1, 4_095, 4_097, 100_003] {
        let (x, xc) = pair(&rng, &format!("x{n}"), &[n]);
        let (gpu, cpu) = (Gpu::sum_of_squares(x), Cpu::sum_of_squares(xc));
        let rel = (gpu - cpu).abs() / cpu;
        assert!(
            rel <= TOLERANCE,
            "sum of squares [{n}]: {gpu} against {cpu}"
        );
    }
}

/// The product table's classes, without a device: a TMA kernel only for f16 and bf16 products
/// whose every dimension reaches `TMA_MIN_DIM` on a device with TMA.
#[test]
fn the_product_table_chooses_by_class() {
    use super::matmul::{MatmulKernel, Product, TMA_MIN_DIM, choose};
    use burn::tensor::DType;
    let big = TMA_MIN_DIM * 16;
    let at = |m, n, k, dtype, tma| {
        choose(Product {
            m,
            n,
            k,
            dtype,
            tma,
        })
    };
    let tma = MatmulKernel::SpecializedTma;
    // GPT-2's products: aligned, and the vocabulary's 50,257 (unaligned rows: CubeCL refuses
    // the kernel itself where it cannot run them, and the default runs).
    assert_eq!(at(16_384, 2_304, 768, DType::BF16, true), tma);
    assert_eq!(at(16_384, 50_257, 768, DType::BF16, true), tma);
    assert_eq!(at(big, big, TMA_MIN_DIM, DType::F16, true), tma);
    for (m, n, k, dtype, device_tma) in [
        (big, big, big, DType::F32, true),
        (big, big, big, DType::BF16, false),
        (big, big, TMA_MIN_DIM - 1, DType::BF16, true),
        (1, big, big, DType::BF16, true),
        (1, 1, 1, DType::F32, false),
    ] {
        assert_eq!(
            at(m, n, k, dtype, device_tma),
            MatmulKernel::Default,
            "[{m}, {k}] x [{k}, {n}] {dtype:?}, TMA {device_tma}"
        );
    }
}

/// cuBLASLt (CUDA only) computes the row-major product in f32 and bf16 on contiguous,
/// transposed, pitched and offset operands (row slices of wider tensors) and a tiny one, with
/// and without the bias epilogue.
#[cfg(not(feature = "wgpu"))]
#[test]
fn cublaslt_products_equal_the_cpu() {
    use burn::tensor::FloatDType;
    let rng = InitRng::new(10);
    // (lhs, rhs, rhs transposed, rows and columns of padding around the lhs)
    let cases: [([usize; 2], [usize; 2], bool, usize); 5] = [
        ([128, 64], [64, 256], false, 0),
        ([7, 33], [33, 5], false, 0),
        ([65, 70], [129, 70], true, 0),
        ([40, 24], [24, 72], false, 3),
        ([1, 1], [1, 1], false, 0),
    ];
    for (a, b, transposed, pad) in cases {
        let tag = format!(
            "{a:?} x {b:?}{} pad {pad}",
            if transposed { "^T" } else { "" }
        );
        let wide = [a[0] + 2 * pad, a[1] + pad];
        let (x, xc) = pair(&rng, &format!("a{tag}"), &wide);
        let rows = [pad..pad + a[0], 0..a[1]];
        let (x, xc) = (
            prim(lift::<Gpu, 2>(x).slice(rows.clone())),
            prim(lift::<Cpu, 2>(xc).slice(rows)),
        );
        let (y, yc) = pair(&rng, &format!("b{tag}"), &b);
        let (y, yc) = match transposed {
            true => (Gpu::float_transpose(y), Cpu::float_transpose(yc)),
            false => (y, yc),
        };
        for (dtype, tolerance) in [(FloatDType::F32, 1e-5), (FloatDType::BF16, 2e-2)] {
            let cast = |t: FloatTensor<Gpu>, to| Gpu::float_cast(t, to);
            let (xg, yg) = (cast(x.clone(), dtype), cast(y.clone(), dtype));
            let got = super::cublaslt::try_product(&xg, &yg)
                .unwrap_or_else(|e| panic!("{tag} {dtype:?}: {e}"))
                .expect("a CUDA tensor");
            let want = Cpu::float_matmul(xc.clone(), yc.clone());
            let got = cast(got, FloatDType::F32);
            within(&format!("{tag} {dtype:?}"), got, want, 0.0, tolerance);
            // The linear layer's forward: the bias added by the epilogue.
            let (bias, bias_c) = pair(&rng, &format!("bias{tag}"), &[b[1]]);
            let got = super::cublaslt::try_linear(&xg, &yg, Some(&cast(bias, dtype)))
                .unwrap_or_else(|e| panic!("{tag} {dtype:?} with a bias: {e}"))
                .expect("a CUDA tensor");
            let want = Cpu::linear_forward(xc.clone(), yc.clone(), Some(bias_c));
            let got = cast(got, FloatDType::F32);
            within(&format!("{tag} {dtype:?} bias"), got, want, 0.0, tolerance);
        }
    }
}

/// Products through the table, and through a forced TMA choice (which falls back to CubeCL's
/// default where the device has no TMA, as llvmpipe), equal the CPU's on aligned, unaligned,
/// transposed, tiny and batched operands; the linear layer's forward and backward through the
/// table equal the CPU's kernels, with a transposed weight as a tied head has.
#[test]
fn products_equal_the_cpu() {
    use super::matmul::{MatmulKernel, product};
    let rng = InitRng::new(9);
    let cases: [(&[usize], &[usize], bool); 5] = [
        (&[128, 64], &[64, 256], false),
        (&[7, 33], &[33, 5], false),
        (&[65, 70], &[129, 70], true),
        (&[1, 1], &[1, 1], false),
        (&[3, 17, 9], &[3, 9, 66], false),
    ];
    for (a, b, transposed) in cases {
        let tag = format!("{a:?} x {b:?}{}", if transposed { "^T" } else { "" });
        let (x, xc) = pair(&rng, &format!("a{tag}"), a);
        let (y, yc) = pair(&rng, &format!("b{tag}"), b);
        let (y, yc) = match transposed {
            true => (Gpu::float_transpose(y), Cpu::float_transpose(yc)),
            false => (y, yc),
        };
        let want = || Cpu::float_matmul(xc.clone(), yc.clone());
        for force in [None, Some(MatmulKernel::SpecializedTma)] {
            let got = product(x.clone(), y.clone(), force);
            within(
                &format!("{tag} {force:?}"),
                got,
                want(),
                0.0,
                PRODUCTS_TOLERANCE,
            );
        }
    }
    for (rows, d) in [(7, 33), (64, 257)] {
        let tag = format!("linear [{rows}, {d}]");
        let (x, xc) = pair(&rng, &format!("x{tag}"), &[rows, d]);
        let (w, wc) = pair(&rng, &format!("w{tag}"), &[96, d]);
        let (w, wc) = (Gpu::float_transpose(w), Cpu::float_transpose(wc));
        let (b, bc) = pair(&rng, &format!("b{tag}"), &[96]);
        let (dy, dyc) = pair(&rng, &format!("dy{tag}"), &[rows, 96]);
        let (y, yc) = (
            Gpu::linear_forward(x.clone(), w.clone(), Some(b)),
            Cpu::linear_forward(xc.clone(), wc.clone(), Some(bc)),
        );
        within(&format!("{tag} forward"), y, yc, 0.0, PRODUCTS_TOLERANCE);
        let grads = Gpu::linear_backward(Some(x), w, dy, [true; 3]);
        let want = Cpu::linear_backward(Some(xc), wc, dyc, [true; 3]);
        for ((name, g), c) in ["dx", "dw", "dbias"].iter().zip(grads).zip(want) {
            let (g, c) = (g.expect("asked for"), c.expect("asked for"));
            within(&format!("{tag} {name}"), g, c, 0.0, PRODUCTS_TOLERANCE);
        }
    }
}

/// The gradient norm's batched sums (one read of the device for all tensors) equal each
/// tensor's own sum exactly, in order, over tensors of one, several and ragged chunks.
#[test]
fn sums_of_squares_equal_each_sum() {
    let rng = InitRng::new(10);
    let sizes = [1, 4_097, 7, 100_003, 4_096];
    let tensors: Vec<FloatTensor<Gpu>> = sizes
        .iter()
        .map(|&n| pair(&rng, &format!("g{n}"), &[n]).0)
        .collect();
    let each: Vec<f64> = tensors.iter().cloned().map(Gpu::sum_of_squares).collect();
    assert_eq!(Gpu::sums_of_squares(tensors), each);
    assert!(Gpu::sums_of_squares(Vec::new()).is_empty());
}
