//! LayerNorm over the last dimension, forward and backward, each one pass per row (a row is
//! read twice while it sits in cache).

use super::math::{simd, sum};

/// Normalizes each row of `x` (`[rows, d]`): `y = (x - mean) * rstd * gamma + beta`, with
/// `rstd = 1 / sqrt(var + eps)` (biased variance). Writes `y` and returns each row's `mean`
/// and `rstd` for the backward pass.
pub fn forward(
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    eps: f32,
    y: &mut [f32],
) -> (Vec<f32>, Vec<f32>) {
    let d = gamma.len();
    let rows = x.len() / d.max(1);
    let mut mean = vec![0.0; rows];
    let mut rstd = vec![0.0; rows];
    simd(
        #[inline(always)]
        || {
            for (i, (xr, yr)) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).enumerate() {
                let m = sum(xr) / d as f32;
                for (o, &v) in yr.iter_mut().zip(xr) {
                    let c = v - m;
                    *o = c * c;
                }
                let r = 1.0 / (sum(yr) / d as f32 + eps).sqrt();
                match beta {
                    Some(b) => {
                        for (((o, &v), &g), &bb) in yr.iter_mut().zip(xr).zip(gamma).zip(b) {
                            *o = ((v - m) * r).mul_add(g, bb);
                        }
                    }
                    None => {
                        for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(gamma) {
                            *o = (v - m) * r * g;
                        }
                    }
                }
                mean[i] = m;
                rstd[i] = r;
            }
        },
    );
    (mean, rstd)
}

/// The gradients of LayerNorm from the upstream gradient `dy` (`[rows, d]`), written over
/// `dy` (which becomes `dx`): `dx = rstd (g - mean(g) - xhat mean(g xhat))` with
/// `g = dy * gamma`, `xhat = (x - mean) rstd`. Adds the gain and shift gradients
/// (`sum dy * xhat`, `sum dy` over rows) to `dgamma` and `dbeta`.
pub fn backward_in_place(
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    dy: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let d = gamma.len();
    simd(
        #[inline(always)]
        || {
            for (i, (xr, gr)) in x.chunks_exact(d).zip(dy.chunks_exact_mut(d)).enumerate() {
                let (m, r) = (mean[i], rstd[i]);
                let mut acc_g = [0.0f32; 8];
                let mut acc_gx = [0.0f32; 8];
                let mut tail = (0.0f32, 0.0f32);
                let n8 = d / 8 * 8;
                for j in 0..n8 / 8 {
                    for l in 0..8 {
                        let k = j * 8 + l;
                        let xh = (xr[k] - m) * r;
                        let g = gr[k] * gamma[k];
                        dgamma[k] = gr[k].mul_add(xh, dgamma[k]);
                        dbeta[k] += gr[k];
                        acc_g[l] += g;
                        acc_gx[l] = g.mul_add(xh, acc_gx[l]);
                    }
                }
                for k in n8..d {
                    let xh = (xr[k] - m) * r;
                    let g = gr[k] * gamma[k];
                    dgamma[k] = gr[k].mul_add(xh, dgamma[k]);
                    dbeta[k] += gr[k];
                    tail.0 += g;
                    tail.1 = g.mul_add(xh, tail.1);
                }
                let mg = (acc_g.iter().sum::<f32>() + tail.0) / d as f32;
                let mgx = (acc_gx.iter().sum::<f32>() + tail.1) / d as f32;
                for k in 0..d {
                    let xh = (xr[k] - m) * r;
                    let g = gr[k] * gamma[k];
                    gr[k] = r * (g - mg - xh * mgx);
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LayerNorm and its gradients by finite differences in f64.
    fn ln64(x: &[f64], g: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
        let d = g.len();
        x.chunks(d)
            .flat_map(|r| {
                let m = r.iter().sum::<f64>() / d as f64;
                let v = r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / d as f64;
                let rs = 1.0 / (v + eps).sqrt();
                r.iter()
                    .enumerate()
                    .map(move |(k, x)| (x - m) * rs * g[k] + b[k])
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn forward_and_backward_match_finite_differences() {
        let (rows, d, eps) = (3, 13, 1e-5);
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.3)
            .collect();
        let g: Vec<f32> = (0..d).map(|i| 0.5 + i as f32 * 0.1).collect();
        let b: Vec<f32> = (0..d).map(|i| i as f32 * 0.05 - 0.2).collect();
        let w: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 11 % 7) as f32 - 3.0) * 0.2)
            .collect();
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        let mut y = vec![0.0; rows * d];
        let (mean, rstd) = forward(&x, &g, Some(&b), eps as f32, &mut y);
        let want = ln64(&f64s(&x), &f64s(&g), &f64s(&b), eps);
        for (a, w) in y.iter().zip(&want) {
            assert!((*a as f64 - w).abs() < 1e-5, "{a} vs {w}");
        }
        // Loss = sum(w * y): dx by central differences.
        let loss = |x: &[f64], g: &[f64], b: &[f64]| -> f64 {
            ln64(x, g, b, eps)
                .iter()
                .zip(&w)
                .map(|(y, w)| y * *w as f64)
                .sum()
        };
        let (xd, gd, bd) = (f64s(&x), f64s(&g), f64s(&b));
        let mut dx = w.clone();
        let (mut dg, mut db) = (vec![0.0; d], vec![0.0; d]);
        backward_in_place(&x, &g, &mean, &rstd, &mut dx, &mut dg, &mut db);
        let h = 1e-6;
        let fd = |f: &dyn Fn(f64) -> f64| (f(h) - f(-h)) / (2.0 * h);
        for i in 0..rows * d {
            let want = fd(&|e| {
                let mut x2 = xd.clone();
                x2[i] += e;
                loss(&x2, &gd, &bd)
            });
            assert!(
                (dx[i] as f64 - want).abs() < 1e-4,
                "dx[{i}] {} vs {want}",
                dx[i]
            );
        }
        for k in 0..d {
            let want_g = fd(&|e| {
                let mut g2 = gd.clone();
                g2[k] += e;
                loss(&xd, &g2, &bd)
            });
            let want_b = fd(&|e| {
                let mut b2 = bd.clone();
                b2[k] += e;
                loss(&xd, &gd, &b2)
            });
            assert!((dg[k] as f64 - want_g).abs() < 1e-4, "dgamma[{k}]");
            assert!((db[k] as f64 - want_b).abs() < 1e-4, "dbeta[{k}]");
        }
    }
}
