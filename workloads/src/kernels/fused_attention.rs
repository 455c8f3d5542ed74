//! Attention's forward pass as one kernel, in the manner of FlashAttention-2: on tensor cores for
//! bf16 and f16 heads of 32, 64 or 128 (ViT-B's and BERT-base's 64, Swin-T's 32), on the CUDA cores
//! for f32 heads of 32 or 64.
//!
//! Why: the composed forward (`attention.rs`) moves q, k and v into head-major buffers, writes the
//! scores [b·h, t, t] to memory in bf16, reads them back for the softmax and again for P·V, and
//! moves the output back: seven kernels and four round trips of the largest tensors, the head moves
//! and the softmax a visible part of BERT-base's step beside the two products. Here each block reads
//! its queries and the keys and values straight from the packed [b, t, 3c] projection, keeps scores
//! and probabilities in registers (f32, the probabilities rounded to the element type only as the
//! second product's operand, as FlashAttention does) and writes [b, t, c]. The backward pass is
//! `attention.rs`'s, which recomputes P anyway.
//!
//! Layout of the work: a block of four warps takes 64 queries of one (sequence, head); each warp 16
//! of them, as the rows of `mma.m16n8k16` tiles. Keys and values pass through shared memory 64 at a
//! time, the next tile copied (cp.async) while the current one is used; a running maximum and sum
//! per row rescale the partial output (the online softmax). A (sequence, head)'s query blocks are
//! neighbours in the grid, so that all but the first read its keys and values from L2. The f32
//! kernels keep each query's features and output in the registers of one to eight lanes instead (see
//! `attn_fused_simt`); on ViT-B in f32 they beat both the composed path and PyTorch's
//! memory-efficient kernel (measured: docs/kernels.md#fused-attention).
//!
//! The f32 kernels come in four sizes of block, 128 to 16 queries: a short grid (ViT-B at batch 1
//! is 12 heads of two blocks of 128, far fewer blocks than a large GPU's multiprocessors) runs faster in
//! more, smaller blocks, a long one in blocks of 128. Which size wins depends on the shape and on
//! how many multiprocessors the device (or MIG slice) has, so each shape's first launch times the
//! four, as a product's first call times cuBLASLt's candidates (`gemm.rs`), and keeps the fastest.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result};

use crate::kernels::launch::{refuse_timing_in_capture, stream_id, Kernel, StreamId};

/// Queries per block of the f32 kernels, one kernel each (`attn_fused_f32_d{D}_q{Q}`; Q in the
/// source): four warps of 32 lanes, which hold 128 queries (two over two lanes for heads of 64, one
/// per lane for heads of 32) down to 16 (one over eight lanes).
pub(crate) const SIMT_QUERIES: [usize; 4] = [128, 64, 32, 16];

/// What decides the f32 kernel's block size: the shape, on one device's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SimtKey {
    stream: StreamId,
    b: usize,
    t: usize,
    h: usize,
    d: usize,
    mode: i32,
    r: u32,
}

thread_local! {
    // As gemm.rs's plans: candle drives a device from one thread.
    static SIMT_CHOSEN: RefCell<HashMap<SimtKey, usize>> = RefCell::new(HashMap::new());
    static SIMT_PINNED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's f32 fused kernels held to `queries` per block (one of
/// [`SIMT_QUERIES`]) instead of the timed choice: how the tests reach every size.
pub(crate) fn with_simt_queries<R>(queries: usize, f: impl FnOnce() -> R) -> Result<R> {
    if !SIMT_QUERIES.contains(&queries) {
        bail!("fused attention: {queries} queries per block is not one of {SIMT_QUERIES:?}");
    }
    let before = SIMT_PINNED.with(|p| p.replace(Some(queries)));
    // Put back even if `f` panics (a failing test), so the next test on this thread times again.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SIMT_PINNED.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(before);
    Ok(f())
}

/// The shape of one fused launch: b sequences of t tokens, h heads of d; the bias as attention.rs's
/// softmax reads it (mode 0 none, 1 key mask, 2 repeating score bias of r windows, 3 causal).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fused {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    pub mode: i32,
    pub r: u32,
    pub scale: f32,
    /// Key-value heads: h for an encoder's packed [b, t, 3·h·d]; fewer for a decoder's [q | k | v]
    /// (grouped-query attention, tensor-core kernels only).
    pub kv_heads: usize,
    /// The first query answered: 0 but for a causal prompt continued after its cached part, whose
    /// first `q_start` rows carry that part's keys and values alone. The output holds the rows
    /// from it on. The tensor-core kernels only.
    pub q_start: usize,
}

/// Mode 3: query i attends keys j <= i (a decoder's prefill).
pub(crate) const CAUSAL: i32 = 3;

/// Whether `dev` has compute capability 8.0 or later: the bf16 tensor-core instructions of the
/// fused kernels.
pub(crate) fn tensor_cores(dev: &CudaDevice) -> bool {
    dev.cuda_stream()
        .context()
        .compute_capability()
        .is_ok_and(|(major, _)| major >= 8)
}

impl Fused {
    /// Whether a fused kernel takes this shape: on a GPU of compute capability 8.0 or later (bf16
    /// tensor-core instructions), bf16 or f16 heads of 32, 64 or 128, or f32 heads of 32 or 64 (the
    /// CUDA-core kernel keeps a query's features and output in registers). `qkv_start` is the
    /// packed projection's first element: its rows are read in 16-byte words. Off when the active
    /// kernel options ask for composed attention.
    pub(crate) fn takes(&self, dtype: DType, dev: &CudaDevice, qkv_start: usize) -> bool {
        let unfused = crate::kernels::KernelOptions::active().attention == crate::kernels::options::Attention::Composed;
        let capable = tensor_cores(dev);
        // The f32 kernels read an encoder's packed heads alone: no causal mask, no grouped heads.
        let head = match dtype {
            DType::BF16 | DType::F16 => matches!(self.d, 32 | 64 | 128),
            DType::F32 => matches!(self.d, 32 | 64) && self.mode != CAUSAL && self.kv_heads == self.h,
            _ => false,
        };
        !unfused && capable && head && (qkv_start * dtype.size_in_bytes()).is_multiple_of(16)
    }

    /// Runs the kernel: `qkv` [b, t, (h + 2·kv_heads)·d], `bias` as the mode reads it, into `out` [b,
    /// t, h·d].
    pub(crate) fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        dtype: DType,
        qkv: &CudaView<T>,
        bias: Option<&CudaView<T>>,
        out: &mut CudaViewMut<T>,
    ) -> Result<()> {
        if dtype != DType::F32 {
            let kernel = format!("{}_d{}", super::launch::name("attn_fused", dtype), self.d);
            return self.launch_as(
                dev,
                &kernel,
                super::defines::attention::FUSED_QUERIES_PER_BLOCK,
                qkv,
                bias,
                out,
            );
        }
        let simt = |queries: usize, out: &mut CudaViewMut<T>| {
            self.launch_as(
                dev,
                &format!("attn_fused_f32_d{}_q{queries}", self.d),
                queries,
                qkv,
                bias,
                out,
            )
        };
        let queries = match self.simt_queries(dev) {
            Some(queries) => queries,
            None => {
                let key = self.simt_key(dev);
                // The timed launches write the output as the chosen one will: every size computes
                // the same attention into the same fresh buffer, which nothing reads before then.
                let out = RefCell::new(&mut *out);
                let queries = self.fastest_simt(dev, key, &|q| simt(q, &mut out.borrow_mut()))?;
                SIMT_CHOSEN.with(|c| c.borrow_mut().insert(key, queries));
                queries
            }
        };
        simt(queries, out)
    }

    /// The f32 kernel's block size for this shape: the pinned one, else the one timed at its first
    /// launch, else None.
    pub(crate) fn simt_queries(&self, dev: &CudaDevice) -> Option<usize> {
        SIMT_PINNED
            .with(Cell::get)
            .or_else(|| SIMT_CHOSEN.with(|c| c.borrow().get(&self.simt_key(dev)).copied()))
    }

    fn simt_key(&self, dev: &CudaDevice) -> SimtKey {
        SimtKey {
            stream: stream_id(dev),
            b: self.b,
            t: self.t,
            h: self.h,
            d: self.d,
            mode: self.mode,
            r: self.r,
        }
    }

    /// The block size of [`SIMT_QUERIES`] whose kernel runs this shape fastest (the median of three
    /// timed launches after one untimed, as gemm.rs times its candidates).
    fn fastest_simt(&self, dev: &CudaDevice, key: SimtKey, launch: &dyn Fn(usize) -> Result<()>) -> Result<usize> {
        refuse_timing_in_capture(dev, format_args!("fused attention {key:?}"), "block size")?;
        let stream = dev.cuda_stream();
        let mut times = Vec::with_capacity(SIMT_QUERIES.len());
        for queries in SIMT_QUERIES {
            times.push((super::launch::median_ms(&stream, &|| launch(queries))?, queries));
        }
        // MIGPROF_ATTENTION_LOG=1: what was measured, to see why a block size was chosen.
        let (_, queries) = *times.iter().min_by(|a, b| a.0.total_cmp(&b.0)).expect("four sizes");
        if std::env::var_os("MIGPROF_ATTENTION_LOG").is_some() {
            let shown: Vec<String> = times.iter().map(|(ms, q)| format!("{q} queries {ms:.4} ms")).collect();
            eprintln!("fused attention {key:?}: {}; chose {queries}", shown.join(", "));
        }
        Ok(queries)
    }

    /// Launches `kernel`, whose blocks take `queries` queries of one (sequence, head) each.
    fn launch_as<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        kernel: &str,
        queries: usize,
        qkv: &CudaView<T>,
        bias: Option<&CudaView<T>>,
        out: &mut CudaViewMut<T>,
    ) -> Result<()> {
        let func = Kernel::load(dev, &crate::kernels::sources::FUSED_ATTENTION, kernel)?;
        let simt = kernel.starts_with("attn_fused_f32");
        if self.q_start >= self.t || (simt && self.q_start > 0) {
            bail!(
                "fused attention: queries from {} of {} tokens ({kernel})",
                self.q_start,
                self.t
            );
        }
        let blocks = (self.t - self.q_start).div_ceil(queries);
        // One row of blocks, a (sequence, head)'s query blocks side by side: they share its keys
        // and values in L2.
        let grid = self.b * self.h * blocks;
        if grid > i32::MAX as usize {
            bail!(
                "fused attention: {}·{}·{blocks} blocks are more than a grid's row holds",
                self.b,
                self.h
            );
        }
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t, h, r, mode, scale) = (self.t as u32, self.h as u32, self.r, self.mode, self.scale);
        let null = 0u64;
        let mut a = func.builder();
        a.arg(qkv);
        match bias {
            Some(bv) => a.arg(bv),
            None => a.arg(&null),
        };
        a.arg(out).arg(&t).arg(&h).arg(&r).arg(&mode).arg(&scale);
        // The tensor-core kernels read q, k and v at offsets of a row of any width.
        let (kv, d) = (self.kv_heads as u32, self.d as u32);
        let layout = [(h + 2 * kv) * d, h * d, kv * d, h / kv.max(1), self.q_start as u32];
        if !simt {
            for v in &layout {
                a.arg(v);
            }
        }
        // SAFETY: argument types and order match the kernel; qkv holds b·t·(h + 2·kv_heads)·d
        // elements from a 16-byte boundary (`takes`), out b·(t − q_start)·h·d, the bias what its mode indexes
        // (checked by `attention`), or null when not read.
        unsafe { func.launch(&mut a, cfg) }?;
        Ok(())
    }
}
