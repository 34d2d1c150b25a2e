//! One AdamW update of a parameter, its two moments and nothing else in one pass, in place.
//!
//! The arithmetic is Burn's `AdamW` operation for operation (each product and sum rounded to
//! `f32` in the same order, no fused multiply-add), so the fused update equals Burn's bit for
//! bit: `m = m b1 + g (1 - b1)`, `v = v b2 + g^2 (1 - b2)`,
//! `p = p (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps)` with `c_i = 1 - b_i^t`.

use super::math::simd;

/// The scalars of one update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the root of the second moment.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// The update's 1-based count (bias correction).
    pub time: usize,
}

/// Updates `param`, `m` and `v` in place from `grad` (all the same length). Moments that start
/// at zero give Burn's first step exactly (`0 b + x = x`).
pub fn step_in_place(param: &mut [f32], grad: &[f32], m: &mut [f32], v: &mut [f32], s: Step) {
    let (b1, b2) = (s.beta1, s.beta2);
    let (f1, f2) = (1.0 - b1, 1.0 - b2);
    let t = s.time as i32;
    let (c1, c2) = (1.0 - b1.powi(t), 1.0 - b2.powi(t));
    let decay_rate = s.lr * f64::from(s.weight_decay);
    let keep = if decay_rate == 0.0 {
        1.0
    } else {
        (1.0 - decay_rate) as f32
    };
    let lr = s.lr as f32;
    let eps = s.eps;
    let n = param.len();
    let (grad, m, v) = (&grad[..n], &mut m[..n], &mut v[..n]);
    simd(
        #[inline(always)]
        || {
            for i in 0..n {
                let g = grad[i];
                let mi = m[i] * b1 + g * f1;
                let vi = v[i] * b2 + (g * g) * f2;
                m[i] = mi;
                v[i] = vi;
                let delta = (mi / c1) / ((vi / c2).sqrt() + eps);
                // `keep` is 1 without weight decay (Burn then leaves the parameter as it is;
                // `p * 1` is the same number).
                param[i] = param[i] * keep - delta * lr;
            }
        },
    );
}
