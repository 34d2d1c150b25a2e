//! cuBLASLt's calls on CubeCL's CUDA buffers and stream.

use std::any::Any;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublaslt::{result as lt, sys};

use super::{Call, Operand, plan};

/// The workspace cuBLASLt's algorithms may use (NVIDIA recommends 32 MiB on Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// `CUBLAS_OP_N` and `CUBLAS_OP_T` (`cublasOperation_t`, a 32-bit enumeration).
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// Why cuBLASLt did not take a product (CubeCL's kernel then does).
#[derive(Debug, thiserror::Error)]
pub enum LtError {
    /// The operands are not two-dimensional matrices cuBLASLt can read in place.
    #[error("a layout cuBLASLt does not read in place (shapes {lhs:?} × {rhs:?})")]
    Layout {
        /// The left operand's shape.
        lhs: Vec<usize>,
        /// The right operand's shape.
        rhs: Vec<usize>,
    },
    /// A bias that is not a contiguous vector of the result's width in the operands' type.
    #[error("a bias cuBLASLt's epilogue does not read")]
    Bias,
    /// An element type other than bf16, f16 and f32.
    #[error("element type {0:?}")]
    DType(DType),
    /// `libcublasLt` is not on the library path.
    #[error("libcublasLt could not be loaded")]
    Missing,
    /// CubeCL's buffers or stream could not be had.
    #[error("CubeCL: {0}")]
    Cube(String),
    /// cuBLASLt refused the call.
    #[error("cuBLASLt: {0:?}")]
    Lt(lt::CublasError),
}

/// The result of `lhs rhs (+ bias)` through cuBLASLt (`None` leaves it to CubeCL: another
/// runtime, or an [`LtError`], logged once).
pub(super) fn linear<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Option<CubeTensor<R>> {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    try_linear(lhs, rhs, bias).unwrap_or_else(|e| {
        if !LOGGED.swap(true, Ordering::Relaxed) {
            tracing::warn!("cuBLASLt did not take a product ({e}); CubeCL's kernel runs it");
        }
        None
    })
}

/// The result of `lhs rhs` through cuBLASLt whatever `MERAK_CUBLASLT` says: `None` on a
/// runtime other than CUDA, an error when cuBLASLt cannot take the product.
pub fn try_product<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
) -> Result<Option<CubeTensor<R>>, LtError> {
    try_linear(lhs, rhs, None)
}

/// [`try_product`] with `bias` (`[n]`, contiguous, the operands' type) added to every row of
/// the result by cuBLASLt's bias epilogue.
pub fn try_linear<R: CubeRuntime>(
    lhs: &CubeTensor<R>,
    rhs: &CubeTensor<R>,
    bias: Option<&CubeTensor<R>>,
) -> Result<Option<CubeTensor<R>>, LtError> {
    let (Some(l), Some(r)) = (cuda(lhs), cuda(rhs)) else {
        return Ok(None);
    };
    let bias = match bias {
        Some(b) => Some(cuda(b).ok_or(LtError::Bias)?),
        None => None,
    };
    let out: Box<dyn Any> = Box::new(run(l, r, bias)?);
    Ok(out.downcast::<CubeTensor<R>>().ok().map(|out| *out))
}

/// `t` as the CUDA runtime's tensor, when `R` is that runtime.
fn cuda<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<&CubeTensor<CudaRuntime>> {
    (t as &dyn Any).downcast_ref::<CubeTensor<CudaRuntime>>()
}

/// The cuBLASLt type of `dtype`.
fn data_type(dtype: DType) -> Result<sys::cudaDataType, LtError> {
    match dtype {
        DType::BF16 => Ok(sys::cudaDataType::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType::CUDA_R_16F),
        DType::F32 => Ok(sys::cudaDataType::CUDA_R_32F),
        other => Err(LtError::DType(other)),
    }
}

/// A two-dimensional tensor's shape and strides.
fn matrix(t: &CubeTensor<CudaRuntime>) -> Option<([usize; 2], [usize; 2])> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    (shape.num_dims() == 2).then(|| ([shape[0], shape[1]], [strides[0], strides[1]]))
}

/// Runs `lhs rhs` through cuBLASLt on the calling thread's CubeCL stream.
fn run(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    bias: Option<&CubeTensor<CudaRuntime>>,
) -> Result<CubeTensor<CudaRuntime>, LtError> {
    let layout = || LtError::Layout {
        lhs: lhs.meta.shape().to_vec(),
        rhs: rhs.meta.shape().to_vec(),
    };
    let call = plan(
        matrix(lhs).ok_or_else(layout)?,
        matrix(rhs).ok_or_else(layout)?,
    )
    .ok_or_else(layout)?;
    if lhs.dtype != rhs.dtype {
        return Err(LtError::DType(rhs.dtype));
    }
    let ty = data_type(lhs.dtype)?;
    if let Some(b) = bias {
        let (shape, strides) = (b.meta.shape(), b.meta.strides());
        let vector = shape.num_dims() == 1 && shape[0] as u64 == call.n && strides[0] == 1;
        if !vector || b.dtype != lhs.dtype {
            return Err(LtError::Bias);
        }
    }
    let out = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        lhs.client.clone(),
        lhs.device.clone(),
        [call.m as usize, call.n as usize].into(),
        lhs.dtype,
    );
    let client = &lhs.client;
    let workspace = client.empty(WORKSPACE_BYTES);
    let resource = |handle: &burn_cubecl::cubecl::server::Handle| {
        (client.get_resource(handle.clone())).map_err(|e| LtError::Cube(format!("{e:?}")))
    };
    let (a, b) = (resource(&rhs.handle)?, resource(&lhs.handle)?);
    let (d, w) = (resource(&out.handle)?, resource(&workspace)?);
    let bias = bias.map(|b| resource(&b.handle)).transpose()?;
    let stream = d.resource().stream;
    if stream.is_null() {
        return Err(LtError::Cube(
            "no stream (cubecl-cuda without merak's patch)".into(),
        ));
    }
    let pointers = Pointers {
        a: a.resource().ptr,
        b: b.resource().ptr,
        d: d.resource().ptr,
        workspace: w.resource().ptr,
        bias: bias.as_ref().map(|b| b.resource().ptr),
        stream: stream.cast(),
    };
    let mut state = handle()?
        .lock()
        .map_err(|_| LtError::Cube("poisoned".into()))?;
    state.matmul(call, ty, pointers)?;
    Ok(out)
}

/// The device pointers and stream of one call.
struct Pointers {
    a: u64,
    b: u64,
    d: u64,
    workspace: u64,
    /// The bias vector, added by the epilogue.
    bias: Option<u64>,
    stream: sys::cudaStream_t,
}

impl Pointers {
    /// The alignment in bytes of `a`, `b` and `d` (a power of two, at most 256, the alignment
    /// cuBLASLt's heuristic assumes unless told less).
    fn alignments(&self) -> [u32; 3] {
        [self.a, self.b, self.d].map(|p| 1u32 << p.trailing_zeros().min(8))
    }
}

/// What the chosen algorithm depends on: the call, the element type, whether the bias epilogue
/// runs, and the operands' alignment ([`Pointers::alignments`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct AlgoKey {
    call: Call,
    ty: i32,
    bias: bool,
    align: [u32; 3],
}

/// The process's cuBLASLt handle and the algorithm chosen for each product so far.
struct State {
    handle: sys::cublasLtHandle_t,
    algos: HashMap<AlgoKey, sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time: the mutex in
// `handle` serialises every use.
unsafe impl Send for State {}

/// The process's cuBLASLt state, created on first use; an error when `libcublasLt` is missing.
fn handle() -> Result<&'static Mutex<State>, LtError> {
    static STATE: OnceLock<Option<Mutex<State>>> = OnceLock::new();
    let state = STATE.get_or_init(|| {
        // SAFETY: only probes whether the library loads.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        let handle = lt::create_handle().ok()?;
        Some(Mutex::new(State {
            handle,
            algos: HashMap::new(),
        }))
    });
    state.as_ref().ok_or(LtError::Missing)
}

/// The descriptors of one call, destroyed when dropped.
struct Descriptors {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
}

impl Descriptors {
    /// The product `D = op(a) op(b)` of `call` in type `ty`, accumulated in `f32`, with the
    /// vector at `bias` added to every column of `D` (every row of the row-major result).
    fn new(call: Call, ty: sys::cudaDataType, bias: Option<u64>) -> Result<Self, LtError> {
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(LtError::Lt)?;
        let mut this = Self {
            desc,
            layouts: [std::ptr::null_mut(); 3],
        };
        for (attr, operand) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                call.a,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                call.b,
            ),
        ] {
            let op = if operand.transposed { OP_T } else { OP_N };
            // SAFETY: `desc` is live; the attribute is a 32-bit `cublasOperation_t`.
            unsafe {
                lt::set_matmul_desc_attribute(this.desc, attr, (&raw const op).cast(), 4)
                    .map_err(LtError::Lt)?;
            }
        }
        if let Some(pointer) = bias {
            this.set_bias(pointer)?;
        }
        let d = Operand {
            transposed: false,
            rows: call.n,
            cols: call.m,
            ld: call.n as i64,
        };
        for (slot, o) in this.layouts.iter_mut().zip([call.a, call.b, d]) {
            *slot = lt::create_matrix_layout(ty, o.rows, o.cols, o.ld).map_err(LtError::Lt)?;
        }
        Ok(this)
    }
}

impl Descriptors {
    /// Turns on the bias epilogue with the bias vector at `pointer`.
    fn set_bias(&mut self, pointer: u64) -> Result<(), LtError> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
        // SAFETY: `desc` is live; the epilogue is its 32-bit enumeration, the bias pointer a
        // device address.
        unsafe {
            let set = |attr, value: *const c_void, size| {
                lt::set_matmul_desc_attribute(self.desc, attr, value, size)
            };
            set(
                Attr::CUBLASLT_MATMUL_DESC_EPILOGUE,
                (&raw const epilogue).cast(),
                std::mem::size_of_val(&epilogue),
            )
            .and_then(|()| {
                set(
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&raw const pointer).cast(),
                    std::mem::size_of::<u64>(),
                )
            })
            .map_err(LtError::Lt)
        }
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each was created by `new` and is destroyed once; null ones were never made.
        unsafe {
            for layout in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(layout);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl State {
    /// Queues `call` on `p.stream`.
    fn matmul(&mut self, call: Call, ty: sys::cudaDataType, p: Pointers) -> Result<(), LtError> {
        let d = Descriptors::new(call, ty, p.bias)?;
        let key = AlgoKey {
            call,
            ty: ty as i32,
            bias: p.bias.is_some(),
            align: p.alignments(),
        };
        let algo = self.algo(key, &d)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [a_layout, b_layout, d_layout] = d.layouts;
        // SAFETY: the pointers are CubeCL's live buffers of the sizes the layouts describe
        // (held by the caller until the call is queued), the stream is CubeCL's, and `algo` was
        // chosen for these descriptors and this workspace.
        unsafe {
            lt::matmul(
                self.handle,
                d.desc,
                (&raw const alpha).cast(),
                (&raw const beta).cast(),
                p.a as *const c_void,
                a_layout,
                p.b as *const c_void,
                b_layout,
                p.d as *const c_void,
                d_layout,
                p.d as *mut c_void,
                d_layout,
                &algo,
                p.workspace as *mut c_void,
                WORKSPACE_BYTES,
                p.stream,
            )
            .map_err(LtError::Lt)
        }
    }

    /// The heuristic's first algorithm for `key`, asked once, told the operands' alignment and
    /// the workspace's size.
    fn algo(
        &mut self,
        key: AlgoKey,
        d: &Descriptors,
    ) -> Result<sys::cublasLtMatmulAlgo_t, LtError> {
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        if let Some(algo) = self.algos.get(&key) {
            return Ok(*algo);
        }
        let pref = lt::create_matmul_pref().map_err(LtError::Lt)?;
        let bytes = WORKSPACE_BYTES;
        let [a, b, out] = d.layouts;
        let [align_a, align_b, align_d] = key.align;
        // SAFETY: every descriptor is live; the workspace attribute is a `size_t`, the
        // alignments `uint32_t`.
        let found = unsafe {
            let set = |attr, value: *const c_void, size| {
                lt::set_matmul_pref_attribute(pref, attr, value, size)
            };
            let u32_size = std::mem::size_of::<u32>();
            let found = set(
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&raw const bytes).cast(),
                std::mem::size_of::<usize>(),
            )
            .and_then(|()| {
                let aligned = [
                    (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a),
                    (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b),
                    (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d),
                    (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d),
                ];
                (aligned.into_iter())
                    .try_for_each(|(attr, value)| set(attr, (value as *const u32).cast(), u32_size))
            })
            .and_then(|()| {
                lt::get_matmul_algo_heuristic(self.handle, d.desc, a, b, out, out, pref)
            });
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        let algo = found.map_err(LtError::Lt)?.algo;
        self.algos.insert(key, algo);
        Ok(algo)
    }
}
