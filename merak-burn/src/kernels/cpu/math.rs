//! Branch-free `f32` math that the compiler vectorizes: `exp` and the normal distribution's
//! CDF and density (for GELU).
//!
//! Each function is plain scalar code marked `#[inline(always)]`; loops that call them run
//! inside [`simd`], which compiles them for AVX2 + FMA as well as for the baseline and picks
//! one at run time, so the loops become vector code without intrinsics. `mul_add` is exactly
//! rounded on every path (a library call where the CPU has no FMA), so results do not depend
//! on the CPU.

/// Runs `f` compiled for AVX2 + FMA when this CPU has them (checked at run time, once per
/// call), so that the loops inside it are vectorized; other CPUs run the baseline build. Pass
/// the closure as `simd(#[inline(always)] || ...)`: only code inlined into the dispatched
/// function is compiled for the wider instruction set.
#[inline(always)]
pub fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        fn avx2_fma<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { avx2_fma(f) };
        }
    }
    f()
}

/// `exp(x)` with a relative error of about 2 ulp; `exp(-inf) = 0`, NaN stays NaN, values
/// below `-87` give 0 (no subnormals) and values above 88 give `inf` (the exact limit is 88.72).
///
/// `x = n ln 2 + r` with `n = round(x / ln 2)` and `|r| <= ln 2 / 2` (Cody-Waite: `ln 2` split
/// so that `n * LN2_HI` is exact), then `exp(r)` by its Taylor series to degree 7 (truncation
/// below `0.35^8 / 8! = 6e-9`, under half an ulp) and `2^n` built in the exponent bits. The
/// rounding and the power of two are bit operations on `n + 1.5 * 2^23` (no float-to-integer
/// conversion), so that the function vectorizes.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 355 / 512: 9 significant bits
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - 355 / 512
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.clamp(-87.0, 88.0);
    let k = xc.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = k - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p: f32 = 1.0 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // The low bits of `k` hold `n` (offset by 2^22); shifting `n + 127` into the exponent
    // field gives 2^n.
    let scale = f32::from_bits(k.to_bits().wrapping_add(127) << 23);
    let y = p * scale;
    if x < -87.0 {
        0.0
    } else if x > 88.0 {
        f32::INFINITY
    } else {
        y
    }
}

/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `erfc(|x| / sqrt 2)` and `exp(-x^2 / 2)`, by the Chebyshev fit
/// `erfc(a) = t exp(-a^2 + P(t))`, `t = 1 / (1 + a / 2)`, whose fractional error is below
/// 1.2e-7 everywhere (Numerical Recipes, section 6.2). `x^2` is split into an exact sum
/// `hi + lo` (one FMA), so that `exp(-x^2 / 2)` keeps full precision for large `|x|`.
#[inline(always)]
fn erfc_and_gauss(x: f32) -> (f32, f32) {
    let a = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / 0.5f32.mul_add(a, 1.0);
    let mut p = 0.170_872_77f32;
    p = p.mul_add(t, -0.822_152_23);
    p = p.mul_add(t, 1.488_515_9);
    p = p.mul_add(t, -1.135_204);
    p = p.mul_add(t, 0.278_868_07);
    p = p.mul_add(t, -0.186_288_06);
    p = p.mul_add(t, 0.096_784_18);
    p = p.mul_add(t, 0.374_091_96);
    p = p.mul_add(t, 1.000_023_7);
    p = p.mul_add(t, -1.265_512_2);
    let hi = x * x;
    let lo = x.mul_add(x, -hi);
    let gauss = exp(-0.5 * hi) * (-0.5f32).mul_add(lo, 1.0);
    (t * gauss * exp(p), gauss)
}

/// The standard normal CDF `Phi(x) = (1 + erf(x / sqrt 2)) / 2` and density `phi(x)`.
#[inline(always)]
pub fn normal_cdf_pdf(x: f32) -> (f32, f32) {
    let (erfc, gauss) = erfc_and_gauss(x);
    let half = 0.5 * erfc;
    let cdf = if x >= 0.0 { 1.0 - half } else { half };
    (cdf, INV_SQRT_2PI * gauss)
}

/// Exact GELU, `x Phi(x)`.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    x * normal_cdf_pdf(x).0
}

/// The derivative of exact GELU, `Phi(x) + x phi(x)`.
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let (cdf, pdf) = normal_cdf_pdf(x);
    x.mul_add(pdf, cdf)
}

/// Sum of a slice with eight independent accumulators (vectorizes; the order of additions is
/// fixed, so the result is deterministic).
#[inline(always)]
pub fn sum(xs: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for x in tail {
        s += x;
    }
    s
}

/// `sum x_i^2` accumulated in `f64` (four independent accumulators; vectorizes): the sum does
/// not lose digits to the length of the slice, so a norm over shards equals the norm over the
/// whole to rounding.
#[inline(always)]
pub fn sum_of_squares(xs: &[f32]) -> f64 {
    let mut acc = [0.0f64; 4];
    let chunks = xs.chunks_exact(4);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            let x = f64::from(x);
            *a = x.mul_add(x, *a);
        }
    }
    let mut s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for &x in tail {
        s += f64::from(x) * f64::from(x);
    }
    s
}

/// Largest element (`-inf` for an empty slice); NaN is skipped here, and callers' later
/// arithmetic on the elements carries it.
#[inline(always)]
pub fn max(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = xs.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    let mut m = acc.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for &x in tail {
        m = m.max(x);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f64) -> f64 {
        ((a as f64 - b) / b.abs().max(1e-30)).abs()
    }

    #[test]
    fn exp_is_accurate_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(rel(
                simd(
                    #[inline(always)]
                    || exp(x),
                ),
                (x as f64).exp(),
            ));
            x += 0.0137;
        }
        assert!(worst < 3e-7, "largest relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
    }

    /// The normal CDF in f64: erf by its Taylor series for small |x|, erfc by its continued
    /// fraction in the tails (so that tiny values keep their precision).
    fn cdf64(x: f64) -> f64 {
        let z = x / 2f64.sqrt();
        if z.abs() < 2.5 {
            let (mut term, mut s, mut n) = (z, z, 0.0);
            while term.abs() > 1e-18 {
                n += 1.0;
                term *= -z * z / n;
                s += term / (2.0 * n + 1.0);
            }
            0.5 * (1.0 + s * 2.0 / std::f64::consts::PI.sqrt())
        } else {
            let a = z.abs();
            let mut f = 0.0;
            for k in (1..200).rev() {
                f = (k as f64 / 2.0) / (a + f);
            }
            let erfc = (-a * a).exp() / std::f64::consts::PI.sqrt() / (a + f);
            if z > 0.0 {
                1.0 - 0.5 * erfc
            } else {
                0.5 * erfc
            }
        }
    }

    #[test]
    fn gelu_and_its_derivative_match_the_exact_formula() {
        let mut x = -12.0f32;
        while x < 12.0 {
            let xd = x as f64;
            let cdf = cdf64(xd);
            let pdf = (-xd * xd / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let g = xd * cdf;
            let dg = cdf + xd * pdf;
            let err_g = (gelu(x) as f64 - g).abs() / g.abs().max(1e-3);
            // Relative to the size of the two terms: near x = -0.75 they cancel.
            let err_dg = (gelu_grad(x) as f64 - dg).abs() / (cdf + (xd * pdf).abs());
            assert!(err_g < 1e-6, "gelu({x}): {} vs {g}", gelu(x));
            assert!(err_dg < 1e-6, "gelu'({x}): {} vs {dg}", gelu_grad(x));
            x += 0.0173;
        }
        assert!(gelu(f32::NAN).is_nan());
        assert_eq!(gelu(-100.0), 0.0);
        assert_eq!(gelu(100.0), 100.0);
    }

    #[test]
    fn reductions_handle_tails_and_infinities() {
        let xs: Vec<f32> = (0..19).map(|i| i as f32 * 0.5 - 3.0).collect();
        assert_eq!(max(&xs), 6.0);
        assert!((sum(&xs) - xs.iter().sum::<f32>()).abs() < 1e-5);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        let sq: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((sum_of_squares(&xs) - sq).abs() < 1e-12 * sq);
    }
}
