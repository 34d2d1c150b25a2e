//! Deterministic randomness that does not depend on the layout: [`splitmix64`] for values
//! keyed by a seed and a global index (data order, augmentation, dropout), and [`InitRng`],
//! named streams for parameter initialization.

/// splitmix64 of `x`: a well-mixed 64-bit value, for randomness keyed by a seed and a global
/// sample index (the same on every layout), e.g. `splitmix64(seed ^ splitmix64(index))`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A deterministic random source for parameter initialization: SplitMix64 streams keyed by
/// `(seed, name)`, normal values by Box-Muller. Identical on every rank and every platform.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitRng {
    seed: u64,
}

/// The next value of the splitmix64 stream whose state is `state` (advanced).
fn splitmix(state: &mut u64) -> u64 {
    let z = splitmix64(*state);
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
        self.uniform_from(name, 0, n)
    }

    /// Values `skip..skip + n` of the stream [`uniform`](Self::uniform) draws for `name`,
    /// without drawing the first `skip` (a slice of a larger draw).
    pub fn uniform_from(&self, name: &str, skip: usize, n: usize) -> Vec<f32> {
        let mut state = self
            .stream(name)
            .wrapping_add((skip as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..n)
            .map(|_| (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32)
            .collect()
    }

    /// For each row position `p` of `rows`, values `p * width .. (p + 1) * width` of the stream
    /// [`uniform`](Self::uniform) draws for `name`, one row after the other: the rows a rank
    /// holds of a larger draw.
    pub fn uniform_rows(&self, name: &str, rows: &[usize], width: usize) -> Vec<f32> {
        let base = self.stream(name);
        let mut out = Vec::with_capacity(rows.len() * width);
        for &p in rows {
            let skip = (p as u64).wrapping_mul(width as u64);
            let mut state = base.wrapping_add(skip.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            out.extend(
                (0..width).map(|_| (splitmix(&mut state) >> 40) as f32 / (1u64 << 24) as f32),
            );
        }
        out
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
    fn a_slice_of_a_uniform_draw_is_drawn_alone() {
        let rng = InitRng::new(11);
        let all = rng.uniform("d", 100);
        assert_eq!(rng.uniform_from("d", 37, 20), all[37..57]);
        assert_eq!(rng.uniform_from("d", 0, 100), all);
        let rows = rng.uniform_rows("d", &[9, 2], 5);
        assert_eq!(rows[..5], all[45..50]);
        assert_eq!(rows[5..], all[10..15]);
    }

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
}
