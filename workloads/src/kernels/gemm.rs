//! Matrix products through cuBLASLt, with the bias add in the GEMM's epilogue.
//!
//! Why not candle's matmul (cuBLAS `*gemmStridedBatched`): a linear layer then needs a pass of its
//! own to add the bias, a sizeable part of BERT-base's step (with GELU and the residual adds);
//! PyTorch's `nn.Linear` puts the bias in cuBLASLt's epilogue, and so do we. The plan of a product
//! (descriptors, and the fastest of the heuristic's candidates for the operands' alignment, timed on
//! the first call) is built once per shape and kept, as cuDNN's are in [`super::conv2d`].
//! (measured: docs/kernels.md#gemm)
//!
//! Precision, as candle's matmul and PyTorch's defaults: f32 computes in f32 (`COMPUTE_32F`), or in
//! TF32 when [`crate::precision::allow_tf32`] allows it; bf16 and f16 accumulate in f32 and any
//! split-K partial sums are reduced in f32 (the reduction scheme is limited to the compute type).
//!
//! Row-major throughout: C [m, n] = op(A) op(B), op(A) [m, k], op(B) [k, n]. cuBLASLt is
//! column-major, where a row-major matrix is its own transpose, so it is asked for Cᵀ = op(B)ᵀ op(A)ᵀ:
//! B goes first, and the bias (one value per column of C) runs along cuBLASLt's rows, as its epilogue
//! expects.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CudaStorage, DType, Layout, Result};

use super::launch::{by_dtype, refuse_timing_in_capture, stream_id, StreamId};
use super::options::{GemmAlgorithm, KernelOptions};

/// cuBLASLt's workspace: what NVIDIA recommends for Hopper (PyTorch takes the same).
const WORKSPACE: usize = 32 << 20;

/// How many of the heuristic's algorithms are timed per product, as cuDNN's Find times its
/// convolution algorithms: the heuristic's first guess is not always the fastest candidate
/// (`MIGPROF_GEMM_LOG=1` logs the timings; measured: docs/kernels.md#gemm).
const CANDIDATES: usize = 8;

/// The largest pointer alignment cuBLASLt distinguishes.
const MAX_ALIGN: usize = 256;

/// One product's shape: C [m, n] = op(A) op(B); A is stored [k, m] when `a_t`, B [n, k] when `b_t`.
/// `batch` products of matrices that follow each other in memory (attention's heads), or one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_t: bool,
    pub b_t: bool,
    pub batch: usize,
}

impl Product {
    /// One product of A [m, k] (stored [k, m] when `a_t`) and B [k, n] (stored [n, k] when `b_t`).
    pub fn single(m: usize, n: usize, k: usize, a_t: bool, b_t: bool) -> Self {
        Self {
            m,
            n,
            k,
            a_t,
            b_t,
            batch: 1,
        }
    }
}

/// What the epilogue does to each column of the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    None,
    Bias,
    BiasRelu,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    stream: StreamId,
    dtype: DType,
    tf32: bool,
    /// How the plan's algorithm is picked: a plan made under one choice never serves the other.
    algorithm: GemmAlgorithm,
    product: Product,
    epilogue: Epilogue,
    /// Of A, B and the residual C (0 without one), in bytes: the heuristic picks algorithms for the
    /// alignment it is told.
    align: [usize; 3],
}

/// Descriptors and algorithm of one key, built once.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// cuBLASLt's A, B and C (= D): our B, our A, our C.
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    /// The heuristic's candidates, best guess first, until the first call measures them.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    algo: sys::cublasLtMatmulAlgo_t,
}

#[derive(Default)]
struct State {
    handles: HashMap<StreamId, sys::cublasLtHandle_t>,
    workspaces: HashMap<StreamId, CudaSlice<u8>>,
    plans: HashMap<Key, Plan>,
}

thread_local! {
    // As with cuDNN: candle drives a device from one thread, and these handles stay on it.
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn check(status: std::result::Result<(), lt::CublasError>, what: &str) -> Result<()> {
    status.map_err(|e| candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}")))
}

fn lt_err(what: &str) -> impl FnOnce(lt::CublasError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

/// The alignment of a device address in bytes, up to [`MAX_ALIGN`].
fn alignment(ptr: u64) -> usize {
    1 << ptr.trailing_zeros().min(MAX_ALIGN.trailing_zeros())
}

/// (data type, compute type) of a dtype.
fn types(dtype: DType, tf32: bool) -> Result<(sys::cudaDataType, sys::cublasComputeType_t)> {
    use sys::cublasComputeType_t as C;
    use sys::cudaDataType_t as D;
    Ok(match dtype {
        DType::F32 if tf32 => (D::CUDA_R_32F, C::CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (D::CUDA_R_32F, C::CUBLAS_COMPUTE_32F),
        DType::BF16 => (D::CUDA_R_16BF, C::CUBLAS_COMPUTE_32F),
        DType::F16 => (D::CUDA_R_16F, C::CUBLAS_COMPUTE_32F),
        other => bail!("the cuBLASLt product takes f32, bf16 or f16, not {other:?}"),
    })
}

/// A column-major layout of `rows` × `cols` with leading dimension `ld`.
fn layout(data: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<sys::cublasLtMatrixLayout_t> {
    lt::create_matrix_layout(data, rows as u64, cols as u64, ld as i64).map_err(lt_err("matrix layout"))
}

/// Sets one attribute of a matmul descriptor to a plain value.
///
/// # Safety
/// `T` must be the type cuBLASLt documents for `attr`.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    check(
        lt::set_matmul_desc_attribute(desc, attr, value as *const T as *const c_void, size_of::<T>()),
        "descriptor attribute",
    )
}

/// Sets one attribute of a preference to a plain value.
///
/// # Safety
/// `T` must be the type cuBLASLt documents for `attr`.
unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: T,
) -> Result<()> {
    check(
        lt::set_matmul_pref_attribute(pref, attr, &value as *const T as *const c_void, size_of::<T>()),
        "preference attribute",
    )
}

/// Builds the descriptors of one key and asks the heuristic for its algorithm.
fn build(handle: sys::cublasLtHandle_t, key: Key) -> Result<Plan> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    let (data, compute) = types(key.dtype, key.tf32)?;
    let Product {
        m,
        n,
        k,
        a_t,
        b_t,
        batch,
    } = key.product;
    let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F).map_err(lt_err("matmul descriptor"))?;
    // cuBLASLt's A is our B: [n, k] column-major is B [k, n] row-major untransposed, and B [n, k]
    // row-major is [k, n] column-major, transposed. Likewise its B is our A.
    let (lt_a, trans_a) = if b_t {
        (layout(data, k, n, k)?, 1i32)
    } else {
        (layout(data, n, k, n)?, 0)
    };
    let (lt_b, trans_b) = if a_t {
        (layout(data, m, k, m)?, 1i32)
    } else {
        (layout(data, k, m, k)?, 0)
    };
    let lt_c = layout(data, n, m, n)?;
    if batch > 1 {
        for (l, stride) in [(lt_a, k * n), (lt_b, m * k), (lt_c, m * n)] {
            // SAFETY: a fresh layout; int32 count and int64 stride, their documented types.
            unsafe {
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                let count = batch as i32;
                let what = "batch layout";
                check(
                    lt::set_matrix_layout_attribute(
                        l,
                        L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &count as *const i32 as *const c_void,
                        4,
                    ),
                    what,
                )?;
                let stride = stride as i64;
                check(
                    lt::set_matrix_layout_attribute(
                        l,
                        L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const c_void,
                        8,
                    ),
                    what,
                )?;
            }
        }
    }
    let epilogue = match key.epilogue {
        Epilogue::None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::BiasRelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
    };
    let pref = lt::create_matmul_pref().map_err(lt_err("preference"))?;
    // SAFETY: fresh descriptors, attributes of their documented types (int32 operations, uint32
    // epilogue and reduction mask, uint32 alignments, uint64 workspace size).
    let candidates = unsafe {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &trans_a)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &trans_b)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, WORKSPACE as u64)?;
        // Our B is cuBLASLt's A; C is allocated here, so fully aligned.
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[1] as u32)?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[0] as u32)?;
        // C is the residual when there is one, else D itself.
        let c_align = if key.align[2] > 0 { key.align[2] } else { MAX_ALIGN };
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c_align as u32)?;
        set_pref(pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, MAX_ALIGN as u32)?;
        if key.dtype != DType::F32 {
            // Split-K partial sums in f32, never in the half type (PyTorch's default for bf16 allows
            // that; ours does not, see the results' precision table).
            let mask = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
            set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask)?;
        }
        let mut found = [std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>(); CANDIDATES];
        let mut count = 0;
        let status = sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            lt_a,
            lt_b,
            lt_c,
            lt_c,
            pref,
            CANDIDATES as i32,
            found.as_mut_ptr(),
            &mut count,
        );
        check(lt::destroy_matmul_pref(pref), "preference")?;
        check(status.result(), "heuristic")?;
        let ok = sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
        found[..count.max(0) as usize]
            .iter()
            .filter(|r| r.state == ok)
            .map(|r| r.algo)
            .collect::<Vec<_>>()
    };
    let Some(&algo) = candidates.first() else {
        bail!("cuBLASLt has no algorithm for {key:?}")
    };
    Ok(Plan {
        desc,
        layouts: [lt_a, lt_b, lt_c],
        candidates,
        algo,
    })
}

/// Creates this thread's cuBLASLt handle for the device's stream, with its workspace, if not yet
/// made: called before a workload's first step, so that the workspace, which lives as long as the
/// thread, is not allocated between the step's activations (where it would keep a block of the
/// memory pool from being handed back).
pub(crate) fn prepare(dev: &CudaDevice) -> Result<()> {
    STATE.with(|state| state.borrow_mut().handle(dev).map(|_| ()))
}

/// This thread's cuBLASLt workspace for the device's stream (made with the handle if need be), as
/// (address, bytes): lent to candle's cuBLAS handle too (`graphs`), which runs on the same stream,
/// so that its launches and ours, never at once, share one workspace as PyTorch's cuBLAS and
/// cuBLASLt do. It lives as long as the thread.
pub(crate) fn shared_workspace(dev: &CudaDevice) -> Result<(u64, usize)> {
    STATE.with(|state| {
        let mut state = state.borrow_mut();
        let (_, stream) = state.handle(dev)?;
        let workspace = state.workspaces.get(&stream).expect("made with the handle");
        let stream = dev.cuda_stream();
        let (ptr, _guard) = workspace.device_ptr(&stream);
        Ok((ptr, workspace.len()))
    })
}

impl State {
    fn handle(&mut self, dev: &CudaDevice) -> Result<(sys::cublasLtHandle_t, StreamId)> {
        let stream = stream_id(dev);
        if let std::collections::hash_map::Entry::Vacant(slot) = self.handles.entry(stream) {
            slot.insert(lt::create_handle().map_err(lt_err("handle"))?);
            // SAFETY: cuBLASLt writes its workspace before reading it.
            self.workspaces.insert(stream, unsafe { dev.alloc::<u8>(WORKSPACE)? });
        }
        Ok((self.handles[&stream], stream))
    }
}

/// An operand: a tensor's storage and the element its matrix starts at (contiguous from there).
pub type Operand<'a> = (&'a CudaStorage, usize);

/// C = op(A) op(B) (+ bias, then ReLU, per the epilogue) as a new [batch, m, n] tensor's storage.
/// `bias` holds n values, 16-byte aligned; it is read only when the epilogue adds it (and shared by
/// the batch).
pub fn gemm(
    a: Operand,
    b: Operand,
    bias: Option<Operand>,
    product: Product,
    epilogue: Epilogue,
) -> Result<CudaStorage> {
    gemm_plus(a, b, bias, None, product, epilogue)
}

/// As [`gemm`], plus `residual` [m, n] (one product) added before the result is rounded to the
/// element type: cuBLASLt's D = A B + C with β = 1, so that a residual connection costs no pass of
/// its own.
pub fn gemm_plus(
    a: Operand,
    b: Operand,
    bias: Option<Operand>,
    residual: Option<Operand>,
    product: Product,
    epilogue: Epilogue,
) -> Result<CudaStorage> {
    let dtype = a.0.dtype();
    if b.0.dtype() != dtype
        || bias.is_some_and(|(s, _)| s.dtype() != dtype)
        || residual.is_some_and(|(s, _)| s.dtype() != dtype)
    {
        bail!(
            "cuBLASLt product of {:?} and {:?}: one dtype for A, B, the bias and the residual",
            dtype,
            b.0.dtype()
        )
    }
    if epilogue != Epilogue::None && !bias.is_some_and(|(s, off)| bias_aligned(s.dtype(), off)) {
        bail!("cuBLASLt product: the {epilogue:?} epilogue needs a bias that starts 16 bytes aligned")
    }
    if residual.is_some() && product.batch != 1 {
        bail!(
            "cuBLASLt product: a residual is added to one product, not a batch of {}",
            product.batch
        )
    }
    by_dtype!(dtype, "the cuBLASLt product", T => run::<T>(a, b, bias, residual, product, epilogue))
}

/// `len` elements of an operand, or an error if its storage ends before.
fn elements<T: CudaDType + DeviceRepr>((s, off): Operand<'_>, len: usize) -> Result<CudaView<'_, T>> {
    let all = s.as_cuda_slice::<T>()?;
    if off + len > all.len() {
        bail!(
            "cuBLASLt product: an operand of {} elements is read from {off} for {len}",
            all.len()
        )
    }
    Ok(all.slice(off..off + len))
}

fn run<T: CudaDType + DeviceRepr>(
    a: Operand,
    b: Operand,
    bias: Option<Operand>,
    residual: Option<Operand>,
    product: Product,
    epilogue: Epilogue,
) -> Result<CudaStorage> {
    let dev = a.0.device().clone();
    let stream = dev.cuda_stream();
    let batch = product.batch;
    let (a_s, b_s) = (
        elements::<T>(a, batch * product.m * product.k)?,
        elements::<T>(b, batch * product.k * product.n)?,
    );
    let bias_s = match (epilogue, bias) {
        (Epilogue::None, _) | (_, None) => None,
        (_, Some(bias)) => Some(elements::<T>(bias, product.n)?),
    };
    let residual_s = residual.map(|r| elements::<T>(r, product.m * product.n)).transpose()?;
    // SAFETY: every element of D is written (from the product, and the residual when there is one).
    let mut out = unsafe { dev.alloc::<T>(batch * product.m * product.n)? };
    {
        let (ap, _ga) = a_s.device_ptr(&stream);
        let (bp, _gb) = b_s.device_ptr(&stream);
        let bias_p = bias_s.as_ref().map(|s| s.device_ptr(&stream));
        let residual_p = residual_s.as_ref().map(|s| s.device_ptr(&stream));
        let (op, _go) = out.device_ptr_mut(&stream);
        // With a residual C, D = A B + C; without, C is D itself and β = 0 keeps it from being read.
        let (cp, beta) = match &residual_p {
            Some((p, _)) => (*p, 1f32),
            None => (op, 0f32),
        };
        let alpha = 1f32;
        STATE.with(|state| -> Result<()> {
            let mut state = state.borrow_mut();
            let (handle, sid) = state.handle(&dev)?;
            let tf32 = crate::precision::tf32_allowed();
            let c_align = if residual_p.is_some() { alignment(cp) } else { 0 };
            let algorithm = KernelOptions::active().gemm;
            let key = Key {
                stream: sid,
                dtype: a.0.dtype(),
                tf32,
                algorithm,
                product,
                epilogue,
                align: [alignment(ap), alignment(bp), c_align],
            };
            if let std::collections::hash_map::Entry::Vacant(slot) = state.plans.entry(key) {
                slot.insert(build(handle, key)?);
            }
            let State { plans, workspaces, .. } = &mut *state;
            let plan = plans.get_mut(&key).expect("built above");
            let (wp, _gw) = workspaces
                .get_mut(&sid)
                .expect("made with the handle")
                .device_ptr_mut(&stream);
            let [la, lb, lc] = plan.layouts;
            let desc = plan.desc;
            // SAFETY: the plan was built for these shapes, dtype and alignments; the pointers address
            // buffers of at least those sizes on the stream the handle runs on (C, when read, is not
            // D, so the timing's repeated launches all compute the same D); the bias pointer is
            // set on this thread's descriptor right before the launches that read it.
            let launch = |algo: &sys::cublasLtMatmulAlgo_t| unsafe {
                lt::matmul(
                    handle,
                    desc,
                    &alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    bp as *const c_void,
                    la,
                    ap as *const c_void,
                    lb,
                    cp as *const c_void,
                    lc,
                    op as *mut c_void,
                    lc,
                    algo,
                    wp as *mut c_void,
                    WORKSPACE,
                    stream.cu_stream() as *mut _,
                )
            };
            if let Some((p, _)) = &bias_p {
                // SAFETY: a device pointer, the attribute's documented type.
                unsafe {
                    set_desc(
                        desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        p,
                    )?
                };
            }
            if !plan.candidates.is_empty() {
                plan.algo = fastest(&dev, &std::mem::take(&mut plan.candidates), &launch, &key)?;
            }
            check(launch(&plan.algo), "matmul")
        })?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// The candidate that runs the product fastest on the GPU (the median of three timed launches after
/// one untimed), skipping any the library refuses at launch. Its first guess when only one remains,
/// or when the key's algorithm choice is the heuristic's (what PyTorch launches).
fn fastest(
    dev: &CudaDevice,
    candidates: &[sys::cublasLtMatmulAlgo_t],
    launch: &dyn Fn(&sys::cublasLtMatmulAlgo_t) -> std::result::Result<(), lt::CublasError>,
    key: &Key,
) -> Result<sys::cublasLtMatmulAlgo_t> {
    if candidates.len() == 1 || key.algorithm == GemmAlgorithm::Heuristic {
        return Ok(candidates[0]);
    }
    refuse_timing_in_capture(dev, format_args!("cuBLASLt product {key:?}"), "algorithm")?;
    let stream = dev.cuda_stream();
    // MIGPROF_GEMM_LOG=1: what was measured, to see why an algorithm was chosen.
    let logging = std::env::var_os("MIGPROF_GEMM_LOG").is_some();
    let mut best: Option<(f32, usize)> = None;
    let mut log = Vec::new();
    for (i, algo) in candidates.iter().enumerate() {
        // An algorithm the library refuses at its first launch is skipped, not an error.
        if launch(algo).is_err() {
            if logging {
                log.push(format!("{} refused", describe(algo)));
            }
            continue;
        }
        let median = super::launch::median_ms(&stream, &|| check(launch(algo), "matmul"))?;
        if logging {
            log.push(format!("{} {median:.4} ms", describe(algo)));
        }
        if best.is_none_or(|(t, _)| median < t) {
            best = Some((median, i));
        }
    }
    if logging {
        eprintln!("cublaslt {key:?}: {}; chose {:?}", log.join(", "), best.map(|(_, i)| i));
    }
    match best {
        Some((_, i)) => Ok(candidates[i]),
        None => bail!("cuBLASLt could launch none of its algorithms for {key:?}"),
    }
}

/// "algorithm id/tile id/split-k count" of a cuBLASLt algorithm, for the log.
fn describe(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as C;
    let get = |attr: C| {
        let (mut v, mut written) = (0u32, 0usize);
        // SAFETY: a u32-sized buffer for attributes cuBLASLt documents as 32-bit integers.
        let status = unsafe {
            sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut v as *mut u32 as *mut c_void,
                size_of::<u32>(),
                &mut written,
            )
        };
        if status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            v.to_string()
        } else {
            "?".into()
        }
    };
    format!(
        "{}/{}/{}",
        get(C::CUBLASLT_ALGO_CONFIG_ID),
        get(C::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)
    )
}

/// Whether a bias starting at element `offset` of an allocation (cudarc's are 256-byte aligned)
/// suits the epilogue, which reads it in 16-byte words.
pub fn bias_aligned(dtype: DType, offset: usize) -> bool {
    super::launch::whole_words(dtype.size_in_bytes(), &[offset])
}

/// The operand of a contiguous layout, or an error naming the op.
pub fn operand<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<Operand<'a>> {
    match l.contiguous_offsets() {
        Some((start, _)) => Ok((s, start)),
        None => bail!("{what} takes contiguous tensors"),
    }
}
