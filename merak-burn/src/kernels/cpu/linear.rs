//! The linear layer `y = x W + b` over rows, forward and backward, on the `gemm` crate: the
//! bias is written first and the product accumulated onto it, and the weight may be a strided
//! view (the tied output head reads the embedding table transposed, without a copy).

use super::gemm::{View, matmul, matmul_new};
use super::math::simd;

/// `y = x w (+ bias)`: `x` is `[rows, d_in]`, `w` `[d_in, d_out]` (any strides); returns `y`,
/// row-major `[rows, d_out]`.
pub fn forward(x: &[f32], xv: View, w: &[f32], wv: View, bias: Option<&[f32]>) -> Vec<f32> {
    let yv = View::new(0, xv.rows, wv.cols, wv.cols, 1);
    match bias {
        Some(b) => {
            let mut y = Vec::with_capacity(xv.rows * wv.cols);
            for _ in 0..xv.rows {
                y.extend_from_slice(b);
            }
            matmul(&mut y, yv, x, xv, w, wv, 1.0, true);
            y
        }
        None => matmul_new(yv, x, xv, w, wv, 1.0),
    }
}

/// `dx = dy w^T`: `dy` row-major `[rows, d_out]`; returns `dx`, row-major `[rows, d_in]`.
pub fn grad_input(dy: &[f32], w: &[f32], wv: View) -> Vec<f32> {
    let rows = dy.len() / wv.cols.max(1);
    let dyv = View::new(0, rows, wv.cols, wv.cols, 1);
    matmul_new(
        View::new(0, rows, wv.rows, wv.rows, 1),
        dy,
        dyv,
        w,
        wv.t(),
        1.0,
    )
}

/// `dw = x^T dy` (`[d_in, d_out]`), row-major, or column-major with `column_major` (the
/// layout of a weight stored transposed).
pub fn grad_weight(x: &[f32], xv: View, dy: &[f32], d_out: usize, column_major: bool) -> Vec<f32> {
    let d_in = xv.cols;
    let dyv = View::new(0, xv.rows, d_out, d_out, 1);
    let dwv = if column_major {
        View::new(0, d_in, d_out, 1, d_in)
    } else {
        View::new(0, d_in, d_out, d_out, 1)
    };
    matmul_new(dwv, x, xv.t(), dy, dyv, 1.0)
}

/// `db = sum over rows of dy` (`dy` row-major `[rows, db.len()]`).
pub fn grad_bias(dy: &[f32], db: &mut [f32]) {
    db.fill(0.0);
    simd(
        #[inline(always)]
        || {
            for row in dy.chunks_exact(db.len().max(1)) {
                for (d, g) in db.iter_mut().zip(row) {
                    *d += g;
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_and_gradients_match_loops_with_a_transposed_weight() {
        let (rows, din, dout) = (5, 4, 3);
        let x: Vec<f32> = (0..rows * din).map(|i| i as f32 * 0.1 - 1.0).collect();
        // The weight stored transposed: `wt` is [dout, din], w = wt^T.
        let wt: Vec<f32> = (0..dout * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let w = |i: usize, o: usize| wt[o * din + i];
        let b = [0.5f32, -0.25, 1.0];
        let xv = View::new(0, rows, din, din, 1);
        let wv = View::new(0, din, dout, 1, din);
        let y = forward(&x, xv, &wt, wv, Some(&b));
        let dy: Vec<f32> = (0..rows * dout).map(|i| (i as f32 * 0.11).cos()).collect();
        let dx = grad_input(&dy, &wt, wv);
        // dw in the weight's own (transposed) layout.
        let dw = grad_weight(&x, xv, &dy, dout, true);
        let mut db = [0.0; 3];
        grad_bias(&dy, &mut db);
        for r in 0..rows {
            for o in 0..dout {
                let want = b[o] + (0..din).map(|i| x[r * din + i] * w(i, o)).sum::<f32>();
                assert!((y[r * dout + o] - want).abs() < 1e-5);
            }
            for i in 0..din {
                let want: f32 = (0..dout).map(|o| dy[r * dout + o] * w(i, o)).sum();
                assert!((dx[r * din + i] - want).abs() < 1e-5);
            }
        }
        for i in 0..din {
            for o in 0..dout {
                let want: f32 = (0..rows).map(|r| x[r * din + i] * dy[r * dout + o]).sum();
                assert!((dw[o * din + i] - want).abs() < 1e-5);
            }
        }
        for o in 0..dout {
            let want: f32 = (0..rows).map(|r| dy[r * dout + o]).sum();
            assert!((db[o] - want).abs() < 1e-5);
        }
    }
}
