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

#[cfg(test)]
mod tests {
    use super::*;

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
