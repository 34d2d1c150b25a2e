//! Single-threaded matrix products on strided views of `f32` buffers (the `gemm` crate, which
//! picks AVX-512, AVX2 + FMA or SSE kernels at run time), with the views checked against their
//! buffers so that callers stay in safe code.

/// A strided matrix view into a buffer: `rows x cols`, element `(i, j)` at
/// `offset + i * rs + j * cs`.
#[derive(Clone, Copy, Debug)]
pub struct View {
    /// Index of element `(0, 0)`.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between rows.
    pub rs: usize,
    /// Distance between columns.
    pub cs: usize,
}

impl View {
    /// A view of `rows x cols` elements from `offset` with strides `rs` and `cs`.
    pub fn new(offset: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        Self {
            offset,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transposed view.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Panics unless every element lies inside a buffer of `len` elements.
    pub fn check(&self, len: usize) {
        if self.rows > 0 && self.cols > 0 {
            let last = self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(
                last < len,
                "matrix product: view {self:?} outside a buffer of {len}"
            );
        }
    }
}

/// `dst = beta * lhs * rhs` (or `dst += beta * lhs * rhs` with `accumulate`), one thread.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dst: &mut [f32],
    d: View,
    lhs: &[f32],
    l: View,
    rhs: &[f32],
    r: View,
    beta: f32,
    accumulate: bool,
) {
    assert!(
        d.rows == l.rows && d.cols == r.cols && l.cols == r.rows,
        "matrix product: shapes"
    );
    d.check(dst.len());
    l.check(lhs.len());
    r.check(rhs.len());
    // SAFETY: the three views were checked to lie inside their buffers; `dst` is borrowed
    // mutably, so it does not alias `lhs` or `rhs`.
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            l.cols,
            dst.as_mut_ptr().add(d.offset),
            d.cs as isize,
            d.rs as isize,
            accumulate,
            lhs.as_ptr().add(l.offset),
            l.cs as isize,
            l.rs as isize,
            rhs.as_ptr().add(r.offset),
            r.cs as isize,
            r.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// A new `d.rows x d.cols` matrix holding `beta * lhs * rhs`, laid out as the dense view `d`
/// (offset 0, row-major or column-major), without clearing the buffer first: the product
/// writes every element.
pub fn matmul_new(d: View, lhs: &[f32], l: View, rhs: &[f32], r: View, beta: f32) -> Vec<f32> {
    let n = d.rows * d.cols;
    let dense =
        d.offset == 0 && ((d.rs == d.cols && d.cs == 1) || (d.rs == 1 && d.cs == d.rows) || n <= 1);
    assert!(dense, "matrix product: {d:?} is not a dense matrix");
    assert!(
        d.rows == l.rows && d.cols == r.cols && l.cols == r.rows,
        "matrix product: shapes"
    );
    l.check(lhs.len());
    r.check(rhs.len());
    let mut out: Vec<f32> = Vec::with_capacity(n);
    // SAFETY: `out` has room for the `n` elements of the dense view `d`; with `read_dst` false
    // gemm reads none of them and writes each one (every element of the `m x n` product), so
    // all `n` are initialized when the length is set; `lhs` and `rhs` were checked to hold
    // their views and do not alias `out`, a new allocation.
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            l.cols,
            out.as_mut_ptr(),
            d.cs as isize,
            d.rs as isize,
            false,
            lhs.as_ptr().add(l.offset),
            l.cs as isize,
            l.rs as isize,
            rhs.as_ptr().add(r.offset),
            r.cs as isize,
            r.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
        out.set_len(n);
    }
    out
}
