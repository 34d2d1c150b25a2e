//! How a row-major product is laid out for column-major cuBLASLt (pure index arithmetic,
//! tested on every machine).

/// One matrix as cuBLASLt reads it: column-major, `rows × cols` with leading dimension `ld`,
/// transposed by the product (`transposed`) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    /// Whether the product takes its transpose (`CUBLAS_OP_T`).
    pub transposed: bool,
    /// Rows as stored (column-major).
    pub rows: u64,
    /// Columns as stored.
    pub cols: u64,
    /// Elements between the starts of two columns.
    pub ld: i64,
}

/// The transpose `xᵀ` of the row-major matrix `x` (`shape` `[r, c]`, `strides` in elements) as a
/// cuBLASLt operand, when its layout allows: a row-major `x` is `xᵀ` stored column-major; a
/// transposed view (unit row stride) is `x` stored column-major, transposed by the product.
pub fn transpose_of(shape: [usize; 2], strides: [usize; 2]) -> Option<Operand> {
    let [r, c] = shape;
    let [s0, s1] = strides;
    let operand = |transposed, rows: usize, cols: usize, ld: usize| Operand {
        transposed,
        rows: rows as u64,
        cols: cols as u64,
        ld: ld.max(1) as i64,
    };
    if r == 0 || c == 0 {
        return None;
    }
    if s1 == 1 && (r == 1 || s0 >= c) {
        return Some(operand(false, c, r, if r == 1 { c } else { s0 }));
    }
    if s0 == 1 && (c == 1 || s1 >= r) {
        return Some(operand(true, r, c, if c == 1 { r } else { s1 }));
    }
    None
}

/// A product as cuBLASLt computes it: the row-major `[m, k] × [k, n]` as the column-major
/// `D = op(a) op(b)` with `a` from the right operand, `b` from the left one, and `D` (`n × m`,
/// leading dimension `n`) the row-major result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    /// The right operand's transpose.
    pub a: Operand,
    /// The left operand's transpose.
    pub b: Operand,
    /// Columns of the result (`n`): rows of `D`.
    pub n: u64,
    /// Rows of the result (`m`): columns of `D`.
    pub m: u64,
    /// The summed dimension.
    pub k: u64,
}

/// The call for `lhs rhs` (row-major `[m, k]` and `[k, n]` with their strides), when both layouts
/// allow one ([`transpose_of`]).
pub fn plan(lhs: ([usize; 2], [usize; 2]), rhs: ([usize; 2], [usize; 2])) -> Option<Call> {
    let ([m, k], [k2, n]) = (lhs.0, rhs.0);
    if k != k2 {
        return None;
    }
    Some(Call {
        a: transpose_of(rhs.0, rhs.1)?,
        b: transpose_of(lhs.0, lhs.1)?,
        n: n as u64,
        m: m as u64,
        k: k as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `D = op(a) op(b)` as cuBLASLt defines it, column-major, on host values.
    fn reference(call: Call, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |o: Operand, x: &[f32], i: usize, j: usize| {
            // Element (i, j) of op(o).
            let (r, c) = if o.transposed { (j, i) } else { (i, j) };
            x[c * o.ld as usize + r]
        };
        let (n, m, k) = (call.n as usize, call.m as usize, call.k as usize);
        let mut d = vec![0.0; n * m];
        for col in 0..m {
            for row in 0..n {
                d[col * n + row] = (0..k)
                    .map(|l| at(call.a, a, row, l) * at(call.b, b, l, col))
                    .sum();
            }
        }
        d
    }

    /// A row-major `[r, c]` matrix of distinct values, stored contiguous (`transposed_view`:
    /// stored as its transpose, row-major `[c, r]`, and seen through swapped strides) with
    /// `pad` unused elements after each stored row: its values, shape and strides.
    fn stored(
        r: usize,
        c: usize,
        transposed_view: bool,
        pad: usize,
    ) -> (Vec<f32>, Vec<f32>, [usize; 2]) {
        let logical: Vec<f32> = (0..r * c).map(|i| (i as f32 * 0.37).sin()).collect();
        let (rows, cols) = if transposed_view { (c, r) } else { (r, c) };
        let pitch = cols + pad;
        let mut memory = vec![f32::NAN; rows * pitch];
        for i in 0..rows {
            for j in 0..cols {
                let (li, lj) = if transposed_view { (j, i) } else { (i, j) };
                memory[i * pitch + j] = logical[li * c + lj];
            }
        }
        let strides = if transposed_view {
            [1, pitch]
        } else {
            [pitch, 1]
        };
        (logical, memory, strides)
    }

    #[test]
    fn every_layout_computes_the_row_major_product() {
        for (m, k, n) in [(3, 5, 4), (1, 7, 2), (6, 1, 3), (4, 3, 1), (2, 2, 2)] {
            for (lhs_t, rhs_t, pad) in [
                (false, false, 0),
                (true, false, 0),
                (false, true, 0),
                (true, true, 2),
                (false, false, 3),
            ] {
                let (x, x_mem, x_strides) = stored(m, k, lhs_t, pad);
                let (y, y_mem, y_strides) = stored(k, n, rhs_t, pad);
                let call = plan(([m, k], x_strides), ([k, n], y_strides)).unwrap();
                let d = reference(call, &y_mem, &x_mem);
                for i in 0..m {
                    for j in 0..n {
                        let want: f32 = (0..k).map(|l| x[i * k + l] * y[l * n + j]).sum();
                        let got = d[i * n + j];
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{m}x{k}x{n} {lhs_t} {rhs_t} {pad}: ({i},{j}) {got} != {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn other_layouts_and_mismatched_sizes_are_left_to_cubecl() {
        // A broadcast row (stride 0), a strided column, and k that does not match.
        assert_eq!(transpose_of([3, 4], [0, 1]), None);
        assert_eq!(transpose_of([3, 4], [8, 2]), None);
        assert_eq!(transpose_of([0, 4], [4, 1]), None);
        assert_eq!(plan(([2, 3], [3, 1]), ([4, 5], [5, 1])), None);
    }
}
