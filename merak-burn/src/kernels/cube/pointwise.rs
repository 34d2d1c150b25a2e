//! Kernels with one thread per element: bias-GELU forward and backward, and the AdamW step.
//!
//! Every kernel reads its inputs in their own float type, computes in `f32` and writes its
//! outputs in the input type, so bf16 runs keep `f32` arithmetic inside a kernel.

use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;

use super::{Launch, contiguous, elements, empty_like, zeros_like};
use crate::kernels::AdamWStep;

/// The standard normal CDF and density at `x`, through `erfc` by the Chebyshev fit of
/// Numerical Recipes (section 6.2, fractional error below 1.2e-7): the CPU kernels' fit, so
/// both devices round alike. WGSL has no `erf` of its own.
#[cube]
fn normal_cdf_pdf(x: f32) -> (f32, f32) {
    let a = f32::abs(x) * 0.707_106_77; // 1 / sqrt(2)
    let t = 1.0 / (1.0 + 0.5 * a);
    let mut p = 0.170_872_77f32;
    p = p * t - 0.822_152_23;
    p = p * t + 1.488_515_9;
    p = p * t - 1.135_204;
    p = p * t + 0.278_868_07;
    p = p * t - 0.186_288_06;
    p = p * t + 0.096_784_18;
    p = p * t + 0.374_091_96;
    p = p * t + 1.000_023_7;
    p = p * t - 1.265_512_2;
    let gauss = f32::exp(-0.5 * x * x);
    let half = 0.5 * t * gauss * f32::exp(p);
    let mut cdf = half;
    if x >= 0.0 {
        cdf = 1.0 - half;
    }
    (cdf, 0.398_942_3 * gauss) // 1 / sqrt(2 pi)
}

#[cube(launch)]
fn bias_gelu_forward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    y: &mut Tensor<F>,
    n: u32,
    d: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let z = f32::cast_from(x[i]) + f32::cast_from(bias[i % d as usize]);
    let (cdf, _pdf) = normal_cdf_pdf(z);
    y[i] = F::cast_from(z * cdf);
}

#[cube(launch)]
fn bias_gelu_backward_kernel<F: Float>(
    x: &Tensor<F>,
    bias: &Tensor<F>,
    dy: &Tensor<F>,
    dx: &mut Tensor<F>,
    n: u32,
    d: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let z = f32::cast_from(x[i]) + f32::cast_from(bias[i % d as usize]);
    let (cdf, pdf) = normal_cdf_pdf(z);
    dx[i] = F::cast_from(f32::cast_from(dy[i]) * (cdf + z * pdf));
}

/// `gelu(x + bias)`, `bias` over the last dimension of `x`.
pub fn bias_gelu_forward<R: CubeRuntime>(x: CubeTensor<R>, bias: CubeTensor<R>) -> CubeTensor<R> {
    let (x, bias) = (contiguous(x), contiguous(bias));
    let y = empty_like(&x);
    let launch = Launch::elementwise(&x);
    bias_gelu_forward_kernel::launch::<R>(
        &x.client,
        launch.count,
        launch.dim,
        x.clone().into_tensor_arg(),
        bias.clone().into_tensor_arg(),
        y.clone().into_tensor_arg(),
        elements(&x),
        elements(&bias),
        x.dtype.into(),
    );
    y
}

/// `dy * gelu'(x + bias)` and its sum over the rows (the bias's gradient).
pub fn bias_gelu_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    bias: CubeTensor<R>,
    dy: CubeTensor<R>,
) -> [CubeTensor<R>; 2] {
    let (x, bias, dy) = (contiguous(x), contiguous(bias), contiguous(dy));
    let dx = empty_like(&x);
    let launch = Launch::elementwise(&x);
    bias_gelu_backward_kernel::launch::<R>(
        &x.client,
        launch.count,
        launch.dim,
        x.clone().into_tensor_arg(),
        bias.clone().into_tensor_arg(),
        dy.into_tensor_arg(),
        dx.clone().into_tensor_arg(),
        elements(&x),
        elements(&bias),
        x.dtype.into(),
    );
    let dbias = super::columns::column_sums(&dx, bias.meta.shape()[0]);
    [dx, dbias]
}

#[cube(launch)]
fn adamw_kernel<F: Float>(
    param: &Tensor<F>,
    grad: &Tensor<F>,
    m_in: &Tensor<F>,
    v_in: &Tensor<F>,
    out: &mut Tensor<F>,
    m_out: &mut Tensor<F>,
    v_out: &mut Tensor<F>,
    beta1: f32,
    beta2: f32,
    correction1: f32,
    correction2: f32,
    keep: f32,
    lr: f32,
    eps: f32,
    n: u32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= n as usize {
        terminate!();
    }
    let g = f32::cast_from(grad[i]);
    let m = f32::cast_from(m_in[i]) * beta1 + g * (1.0 - beta1);
    let v = f32::cast_from(v_in[i]) * beta2 + (g * g) * (1.0 - beta2);
    m_out[i] = F::cast_from(m);
    v_out[i] = F::cast_from(v);
    let delta = (m / correction1) / (f32::sqrt(v / correction2) + eps);
    out[i] = F::cast_from(f32::cast_from(param[i]) * keep - delta * lr);
}

/// One AdamW update (the CPU kernel's formula): new parameter and moments.
pub fn adamw_step<R: CubeRuntime>(
    param: CubeTensor<R>,
    grad: CubeTensor<R>,
    moments: Option<(CubeTensor<R>, CubeTensor<R>)>,
    step: AdamWStep,
) -> [CubeTensor<R>; 3] {
    let (param, grad) = (contiguous(param), contiguous(grad));
    // The first update's moments are zeros (`0 b + x = x`: the same numbers as starting from
    // the gradient), in buffers of their own: no buffer is bound twice to one launch.
    let (m, v) = match moments {
        Some((m, v)) => (contiguous(m), contiguous(v)),
        None => (zeros_like(&param), zeros_like(&param)),
    };
    let outs = [empty_like(&param), empty_like(&param), empty_like(&param)];
    let [b1, b2, c1, c2, keep, lr, eps] = scalars(step);
    let launch = Launch::elementwise(&param);
    let [out, m_out, v_out] = outs.clone();
    adamw_kernel::launch::<R>(
        &param.client,
        launch.count,
        launch.dim,
        param.clone().into_tensor_arg(),
        grad.into_tensor_arg(),
        m.into_tensor_arg(),
        v.into_tensor_arg(),
        out.into_tensor_arg(),
        m_out.into_tensor_arg(),
        v_out.into_tensor_arg(),
        b1,
        b2,
        c1,
        c2,
        keep,
        lr,
        eps,
        elements(&param),
        param.dtype.into(),
    );
    outs
}

/// A step's scalars, rounded to `f32` as the CPU kernel rounds them: b1, b2, the two bias
/// corrections, the weight-decay factor, the learning rate and epsilon.
fn scalars(s: AdamWStep) -> [f32; 7] {
    let t = s.time as i32;
    let decay_rate = s.lr * f64::from(s.weight_decay);
    let keep = if decay_rate == 0.0 {
        1.0
    } else {
        (1.0 - decay_rate) as f32
    };
    let (c1, c2) = (1.0 - s.beta1.powi(t), 1.0 - s.beta2.powi(t));
    [s.beta1, s.beta2, c1, c2, keep, s.lr as f32, s.eps]
}
