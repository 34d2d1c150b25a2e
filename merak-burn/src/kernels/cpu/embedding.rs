//! Embedding lookup in a shard of a table and its backward pass.

/// The rows of `table` (`[rows, d]`, the global rows `start..start + rows`) for `ids`, zeros
/// for ids outside the shard: `[ids.len(), d]`.
pub fn gather(table: &[f32], rows: usize, d: usize, ids: &[i64], start: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        match local_row(id, rows, start) {
            Some(r) => out.extend_from_slice(&table[r * d..(r + 1) * d]),
            None => out.resize(out.len() + d, 0.0),
        }
    }
    out
}

/// Adds each row of `dy` (`[ids.len(), d]`) to the row of `grad` (`[rows, d]`) of its id, for
/// the ids inside the shard.
pub fn scatter_add(dy: &[f32], d: usize, ids: &[i64], start: usize, grad: &mut [f32]) {
    let rows = grad.len() / d.max(1);
    for (&id, g) in ids.iter().zip(dy.chunks_exact(d.max(1))) {
        if let Some(r) = local_row(id, rows, start) {
            grad[r * d..(r + 1) * d]
                .iter_mut()
                .zip(g)
                .for_each(|(a, b)| *a += b);
        }
    }
}

fn local_row(id: i64, rows: usize, start: usize) -> Option<usize> {
    let r = id - start as i64;
    (r >= 0 && (r as usize) < rows).then_some(r as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shard_gathers_its_rows_and_sums_their_gradients() {
        // Rows 2..5 of a 2-wide table.
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let ids = [3, 0, 4, 3, 9];
        assert_eq!(
            gather(&table, 3, 2, &ids, 2),
            vec![3.0, 4.0, 0.0, 0.0, 5.0, 6.0, 3.0, 4.0, 0.0, 0.0]
        );
        let dy = [1.0, 1.0, 7.0, 7.0, 2.0, 2.0, 0.5, 0.5, 9.0, 9.0];
        let mut grad = vec![0.0; 6];
        scatter_add(&dy, 2, &ids, 2, &mut grad);
        assert_eq!(grad, vec![0.0, 0.0, 1.5, 1.5, 2.0, 2.0]);
    }
}
