//! Seeded full-size initialization and the cutting of shards from it.
//!
//! Every parameter is generated at its full (tp = 1) size from a random stream keyed by the
//! model seed and the parameter's name, on the host, independent of the backend's RNG. Each TP
//! rank then keeps its slice. A tp = N model is therefore exactly the tp = 1 model, cut.

use thiserror::Error;

/// A tensor-parallel layer could not be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TpError {
    /// A dimension the layer splits is not divisible by the TP degree.
    #[error("{what} = {value} is not divisible by tp = {tp}")]
    NotDivisible {
        /// The dimension's name.
        what: &'static str,
        /// Its size.
        value: usize,
        /// The TP degree.
        tp: usize,
    },
    /// A full-size tensor handed to a layer has the wrong number of elements.
    #[error("{what}: expected {expected} values for the full tensor, got {got}")]
    FullSize {
        /// The parameter.
        what: &'static str,
        /// The expected count.
        expected: usize,
        /// The given count.
        got: usize,
    },
    /// The overlap degree does not divide the tokens of a micro-batch.
    #[error("tp_overlap = {chunks} does not divide the {tokens} tokens of a micro-batch")]
    Overlap {
        /// The overlap degree (token chunks).
        chunks: usize,
        /// Tokens per micro-batch.
        tokens: usize,
    },
    /// An overlap degree of zero chunks.
    #[error("tp_overlap = 0: it must be at least 1 (1: no overlap)")]
    ZeroOverlap,
}

/// Checks `value % tp == 0`.
pub fn check_divisible(what: &'static str, value: usize, tp: usize) -> Result<(), TpError> {
    if tp == 0 || !value.is_multiple_of(tp) {
        Err(TpError::NotDivisible { what, value, tp })
    } else {
        Ok(())
    }
}

/// Which slice of a split dimension this rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank's index in the TP group.
    pub rank: usize,
    /// The TP degree.
    pub size: usize,
}

impl Shard {
    /// The whole tensor (tp = 1).
    pub const FULL: Shard = Shard { rank: 0, size: 1 };

    /// Columns of a row-major `[rows, cols]` matrix whose columns form `segments` equal
    /// segments (3 for a fused Q/K/V projection), each split evenly across the group: the
    /// result is `[rows, cols / size]` holding this rank's part of every segment in order.
    pub fn columns(&self, full: &[f32], rows: usize, cols: usize, segments: usize) -> Vec<f32> {
        debug_assert_eq!(full.len(), rows * cols);
        let seg = cols / segments;
        let part = seg / self.size;
        let mut out = Vec::with_capacity(rows * cols / self.size);
        for row in full.chunks_exact(cols) {
            for s in 0..segments {
                let start = s * seg + self.rank * part;
                out.extend_from_slice(&row[start..start + part]);
            }
        }
        out
    }

    /// Rows of a row-major `[rows, cols]` matrix: `[rows / size, cols]`.
    pub fn rows(&self, full: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        debug_assert_eq!(full.len(), rows * cols);
        let part = rows / self.size;
        full[self.rank * part * cols..(self.rank + 1) * part * cols].to_vec()
    }
}

/// A deterministic random source for parameter initialization: SplitMix64 streams keyed by
/// `(seed, name)`, normal values by Box-Muller. Identical on every rank and every platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitRng {
    seed: u64,
}

/// The next value of the splitmix64 stream whose state is `state` (advanced).
fn splitmix(state: &mut u64) -> u64 {
    let z = crate::data::splitmix64(*state);
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z
}

/// FNV-1a, to turn a parameter name into a stream key.
fn hash_name(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl InitRng {
    /// A source for the model seed `seed`.
    pub fn new(seed: u64) -> Self {
        Self { seed }
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    fn stream(&self, name: &str) -> u64 {
        let mut s = self.seed ^ hash_name(name).rotate_left(17);
        splitmix(&mut s)
    }

    /// `n` values from N(0, std²) for the parameter `name`.
    pub fn normal(&self, name: &str, n: usize, std: f32) -> Vec<f32> {
        let mut state = self.stream(name);
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            // Two uniforms in (0, 1] from 53-bit mantissas.
            let u1 = ((splitmix(&mut state) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
            let r = (-2.0 * u1.ln()).sqrt();
            let t = 2.0 * std::f64::consts::PI * u2;
            out.push((r * t.cos()) as f32 * std);
            out.push((r * t.sin()) as f32 * std);
        }
        out.truncate(n);
        out
    }

    /// `n` uniform values in `[0, 1)` for the stream `name` (dropout masks, synthetic data).
    pub fn uniform(&self, name: &str, n: usize) -> Vec<f32> {
        let mut state = self.stream(name);
        (0..n)
            .map(|_| (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32)
            .collect()
    }

    /// `n` integers in `0..bound` for the stream `name`.
    pub fn integers(&self, name: &str, n: usize, bound: u64) -> Vec<u64> {
        let mut state = self.stream(name);
        (0..n)
            .map(|_| splitmix(&mut state) % bound.max(1))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_is_deterministic_and_has_the_right_moments() {
        let rng = InitRng::new(7);
        let a = rng.normal("w", 20_000, 0.5);
        assert_eq!(a, rng.normal("w", 20_000, 0.5));
        assert_ne!(a[..10], rng.normal("v", 10, 0.5)[..]);
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.02, "std {}", var.sqrt());
    }

    #[test]
    fn shards_tile_the_full_matrix() {
        // 2 rows, 6 columns in 3 segments of 2, split over 2 ranks.
        let full: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let s0 = Shard { rank: 0, size: 2 }.columns(&full, 2, 6, 3);
        let s1 = Shard { rank: 1, size: 2 }.columns(&full, 2, 6, 3);
        assert_eq!(s0, vec![0., 2., 4., 6., 8., 10.]);
        assert_eq!(s1, vec![1., 3., 5., 7., 9., 11.]);
        let r1 = Shard { rank: 1, size: 2 }.rows(&full, 2, 6);
        assert_eq!(r1, (6..12).map(|x| x as f32).collect::<Vec<_>>());
        assert_eq!(Shard::FULL.columns(&full, 2, 6, 3), full);
    }

    #[test]
    fn divisibility_errors_name_the_numbers() {
        let e = check_divisible("attention heads", 4, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "attention heads = 4 is not divisible by tp = 3"
        );
    }
}
