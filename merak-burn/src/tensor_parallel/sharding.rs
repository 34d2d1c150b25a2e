//! How each parameter is split across the TP group, so that a checkpoint written under one
//! tp degree can be put back together and cut again for another.
//!
//! The tensor-parallel layers record the split of every parameter they create, keyed by its
//! [`ParamId`] (stable across optimizer steps, clones and `valid()`); a parameter that no layer
//! recorded is replicated.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use burn::module::ParamId;
use serde::{Deserialize, Serialize};

use super::embedding::padded_vocab;
use super::init::Shard;

/// The split of one parameter across the TP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ShardKind {
    /// The same full tensor on every rank.
    Replicated,
    /// The last dimension is split; it consists of `segments` equal parts (3 for a fused
    /// Q/K/V projection), each split evenly (see [`Shard::columns`]).
    Columns {
        /// Equal parts of the last dimension, each split separately.
        segments: usize,
    },
    /// The first dimension is split evenly (the weight of a row-parallel layer).
    Rows,
    /// The rows of an embedding table of `vocab` real rows, padded to a multiple of tp and
    /// split evenly; the full tensor has the `vocab` real rows only.
    VocabRows {
        /// The real (unpadded) vocabulary size.
        vocab: usize,
    },
}

fn registry() -> &'static Mutex<HashMap<ParamId, ShardKind>> {
    static REGISTRY: OnceLock<Mutex<HashMap<ParamId, ShardKind>>> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Records how the parameter `id` is split (called by the tensor-parallel layers).
pub fn register(id: ParamId, kind: ShardKind) {
    if kind != ShardKind::Replicated {
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, kind);
    }
}

/// How the parameter `id` is split; [`ShardKind::Replicated`] unless a layer recorded otherwise.
pub fn shard_kind(id: ParamId) -> ShardKind {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied()
        .unwrap_or(ShardKind::Replicated)
}

/// `[rows, cols]` of a shape seen as a matrix (a vector is one row).
fn as_matrix(shape: &[usize]) -> (usize, usize) {
    match shape {
        [] => (1, 1),
        [n] => (1, *n),
        [first, rest @ ..] => (*first, rest.iter().product()),
    }
}

impl ShardKind {
    /// Whether every rank holds a different piece.
    pub fn is_sharded(&self) -> bool {
        *self != ShardKind::Replicated
    }

    /// The full (single-process) shape of a parameter whose shard on a group of `tp` ranks has
    /// shape `local`.
    pub fn full_shape(&self, local: &[usize], tp: usize) -> Vec<usize> {
        let mut full = local.to_vec();
        match (self, full.as_mut_slice()) {
            (ShardKind::Replicated, _) | (_, []) => {}
            (ShardKind::Columns { .. }, [.., last]) => *last *= tp,
            (ShardKind::Rows, [first, ..]) => *first *= tp,
            (ShardKind::VocabRows { vocab }, [first, ..]) => *first = *vocab,
        }
        full
    }

    /// This rank's piece (row-major) of the full tensor `full` of shape `full_shape`.
    pub fn cut(&self, full: &[f32], full_shape: &[usize], shard: Shard) -> Vec<f32> {
        let (rows, cols) = as_matrix(full_shape);
        match *self {
            ShardKind::Replicated => full.to_vec(),
            ShardKind::Columns { segments } => shard.columns(full, rows, cols, segments),
            ShardKind::Rows => shard.rows(full, rows, cols),
            ShardKind::VocabRows { .. } => {
                let padded = padded_vocab(rows, shard.size);
                let mut table = full.to_vec();
                table.resize(padded * cols, 0.0);
                shard.rows(&table, padded, cols)
            }
        }
    }

    /// Puts the full tensor of shape `full_shape` back together from the pieces of every rank
    /// of a group (`pieces[r]` from rank `r`); the inverse of [`ShardKind::cut`].
    pub fn merge(&self, pieces: &[Vec<f32>], full_shape: &[usize]) -> Vec<f32> {
        let tp = pieces.len();
        let (rows, cols) = as_matrix(full_shape);
        match *self {
            ShardKind::Replicated => pieces.first().cloned().unwrap_or_default(),
            ShardKind::Columns { segments } => {
                let part = cols / segments / tp;
                let local_cols = cols / tp;
                let mut full = Vec::with_capacity(rows * cols);
                for row in 0..rows {
                    for s in 0..segments {
                        for piece in pieces {
                            let start = row * local_cols + s * part;
                            full.extend_from_slice(&piece[start..start + part]);
                        }
                    }
                }
                full
            }
            ShardKind::Rows => pieces.concat(),
            ShardKind::VocabRows { .. } => {
                let mut full = pieces.concat();
                full.truncate(rows * cols);
                full
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut_all(kind: ShardKind, full: &[f32], shape: &[usize], tp: usize) -> Vec<Vec<f32>> {
        (0..tp)
            .map(|rank| kind.cut(full, shape, Shard { rank, size: tp }))
            .collect()
    }

    #[test]
    fn merge_inverts_cut_for_every_kind_and_degree() {
        let kinds = [
            (ShardKind::Replicated, vec![4, 6]),
            (ShardKind::Columns { segments: 3 }, vec![2, 12]),
            (ShardKind::Columns { segments: 3 }, vec![12]),
            (ShardKind::Columns { segments: 1 }, vec![3, 8]),
            (ShardKind::Rows, vec![8, 3]),
            (ShardKind::VocabRows { vocab: 7 }, vec![7, 2]),
        ];
        for (kind, shape) in kinds {
            let n: usize = shape.iter().product();
            let full: Vec<f32> = (0..n).map(|i| i as f32).collect();
            for tp in [1, 2, 4] {
                let pieces = cut_all(kind, &full, &shape, tp);
                let local: Vec<usize> = match kind {
                    ShardKind::VocabRows { .. } => {
                        vec![padded_vocab(shape[0], tp) / tp, shape[1]]
                    }
                    _ => {
                        let mut l = shape.clone();
                        match kind {
                            ShardKind::Columns { .. } => *l.last_mut().unwrap() /= tp,
                            ShardKind::Rows => l[0] /= tp,
                            _ => {}
                        }
                        l
                    }
                };
                assert_eq!(
                    pieces[0].len(),
                    local.iter().product::<usize>(),
                    "{kind:?} tp={tp}"
                );
                assert_eq!(kind.full_shape(&local, tp), shape, "{kind:?} tp={tp}");
                assert_eq!(kind.merge(&pieces, &shape), full, "{kind:?} tp={tp}");
            }
        }
    }

    #[test]
    fn qkv_columns_keep_each_rank_on_its_own_heads() {
        // [1, 6] = q0 q1 | k0 k1 | v0 v1; rank 1 of 2 holds q1 k1 v1.
        let full = [0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let kind = ShardKind::Columns { segments: 3 };
        assert_eq!(
            kind.cut(&full, &[1, 6], Shard { rank: 1, size: 2 }),
            vec![1.0, 11.0, 21.0]
        );
    }

    #[test]
    fn unregistered_parameters_are_replicated() {
        assert_eq!(shard_kind(ParamId::new()), ShardKind::Replicated);
        let id = ParamId::new();
        register(id, ShardKind::Rows);
        assert_eq!(shard_kind(id), ShardKind::Rows);
    }
}
