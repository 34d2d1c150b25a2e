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
    d.check(dst.len());
    // SAFETY: `d` was checked to lie inside `dst`, which is borrowed mutably, so it aliases
    // neither `lhs` nor `rhs`.
    unsafe { gemm_into(dst.as_mut_ptr(), d, lhs, l, rhs, r, beta, accumulate) }
}

/// A new `d.rows x d.cols` matrix holding `beta * lhs * rhs`, laid out as the dense view `d`
/// (offset 0, row-major or column-major), without clearing the buffer first: the product
/// writes every element.
pub fn matmul_new(d: View, lhs: &[f32], l: View, rhs: &[f32], r: View, beta: f32) -> Vec<f32> {
    let n = d.rows * d.cols;
    let dense =
        d.offset == 0 && ((d.rs == d.cols && d.cs == 1) || (d.rs == 1 && d.cs == d.rows) || n <= 1);
    assert!(dense, "matrix product: {d:?} is not a dense matrix");
    let mut out: Vec<f32> = Vec::with_capacity(n);
    // SAFETY: `out` has room for the `n` elements of the dense view `d` and is a new
    // allocation, aliasing nothing; with `accumulate` false gemm reads none of them and writes
    // each one (every element of the `m x n` product), so all `n` are initialized when the
    // length is set.
    unsafe {
        gemm_into(out.as_mut_ptr(), d, lhs, l, rhs, r, beta, false);
        out.set_len(n);
    }
    out
}

/// The one call of `gemm`: `beta * lhs * rhs` into the view `d` from `dst`, added to what is
/// there with `accumulate`. Checks the shapes and that `lhs` and `rhs` hold their views.
///
/// # Safety
///
/// `dst` must be valid for writes (and, with `accumulate`, reads) of every element of `d`, and
/// those elements must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_into(
    dst: *mut f32,
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
    l.check(lhs.len());
    r.check(rhs.len());
    // SAFETY: `lhs` and `rhs` hold their views (checked above); `dst` as the caller promises.
    unsafe {
        gemm::gemm(
            d.rows,
            d.cols,
            l.cols,
            dst.add(d.offset),
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
