//! Bias + exact GELU, `y = gelu(x + b)` over rows, and its backward.

use super::math::{gelu, gelu_grad, simd};

/// `y = gelu(x + bias)` for each row of `x` (`[rows, d]`, `d = bias.len()`).
pub fn forward(x: &[f32], bias: &[f32], y: &mut [f32]) {
    let d = bias.len();
    simd(
        #[inline(always)]
        || {
            for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
                for ((o, &v), &b) in yr.iter_mut().zip(xr).zip(bias) {
                    *o = gelu(v + b);
                }
            }
        },
    );
}

/// Overwrites the upstream gradient `dy` with `dx = dy * gelu'(x + bias)` and adds its row sum
/// to `dbias`.
pub fn backward_in_place(x: &[f32], bias: &[f32], dy: &mut [f32], dbias: &mut [f32]) {
    let d = bias.len();
    simd(
        #[inline(always)]
        || {
            for (xr, gr) in x.chunks_exact(d).zip(dy.chunks_exact_mut(d)) {
                // Two simple loops: each vectorizes (one loop with both did not).
                for ((g, &v), &b) in gr.iter_mut().zip(xr).zip(bias) {
                    *g *= gelu_grad(v + b);
                }
                for (db, &g) in dbias.iter_mut().zip(gr.iter()) {
                    *db += g;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backward_is_the_derivative_of_forward() {
        let d = 5;
        let x: Vec<f32> = (0..3 * d).map(|i| (i as f32 - 7.0) * 0.41).collect();
        let bias: Vec<f32> = (0..d).map(|i| i as f32 * 0.1 - 0.2).collect();
        let mut y = vec![0.0; x.len()];
        forward(&x, &bias, &mut y);
        for (i, &v) in y.iter().enumerate() {
            assert_eq!(v, gelu(x[i] + bias[i % d]));
        }
        let mut dy: Vec<f32> = (0..x.len()).map(|i| 1.0 + i as f32 * 0.01).collect();
        let want: Vec<f32> = dy
            .iter()
            .enumerate()
            .map(|(i, g)| g * gelu_grad(x[i] + bias[i % d]))
            .collect();
        let mut db = vec![0.0; d];
        backward_in_place(&x, &bias, &mut dy, &mut db);
        assert_eq!(dy, want);
        for k in 0..d {
            let s: f32 = (0..3).map(|r| want[r * d + k]).sum();
            assert!((db[k] - s).abs() < 1e-6);
        }
    }
}
