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
//! kernels keep each query's features and output in the registers of one or two lanes instead (see
//! `attn_fused_simt`); on ViT-B in f32 they beat both the composed path and PyTorch's
//! memory-efficient kernel (measured: docs/kernels.md#fused-attention).

use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};

use crate::kernels::launch::Kernel;



/// Queries per block (FA_Q in the source).
const QUERIES_PER_BLOCK: usize = 64;
/// Queries per block of the f32 kernels: four warps of 32 (QB in the source).
const SIMT_QUERIES_PER_BLOCK: usize = 128;

/// The shape of one fused launch: b sequences of t tokens, h heads of d; the bias as attention.rs's
/// softmax reads it (mode 0 none, 1 key mask, 2 repeating score bias of r windows).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fused {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
    pub mode: i32,
    pub r: u32,
    pub scale: f32,
}

impl Fused {
    /// Whether a fused kernel takes this shape: on a GPU of compute capability 8.0 or later (bf16
    /// tensor-core instructions), bf16 or f16 heads of 32, 64 or 128, or f32 heads of 32 or 64 (the
    /// CUDA-core kernel keeps a query's features and output in registers). `qkv_start` is the
    /// packed projection's first element: its rows are read in 16-byte words. Off when the active
    /// kernel options ask for composed attention.
    pub(crate) fn takes(&self, dtype: DType, dev: &CudaDevice, qkv_start: usize) -> bool {
        let unfused = crate::kernels::KernelOptions::active().attention == crate::kernels::options::Attention::Composed;
        let capable = dev.cuda_stream().context().compute_capability().is_ok_and(|(major, _)| major >= 8);
        let head = match dtype {
            DType::BF16 | DType::F16 => matches!(self.d, 32 | 64 | 128),
            DType::F32 => matches!(self.d, 32 | 64),
            _ => false,
        };
        !unfused && capable && head && (qkv_start * dtype.size_in_bytes()).is_multiple_of(16)
    }

    /// Runs the kernel: `qkv` [b, t, 3·h·d], `bias` as the mode reads it, into `out` [b, t, h·d].
    pub(crate) fn launch<T: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        dtype: DType,
        qkv: &CudaView<T>,
        bias: Option<&CudaView<T>>,
        out: &mut CudaViewMut<T>,
    ) -> Result<()> {
        let kernel = format!("{}_d{}", super::launch::name("attn_fused", dtype), self.d);
        let queries = if dtype == DType::F32 { SIMT_QUERIES_PER_BLOCK } else { QUERIES_PER_BLOCK };
        let func = Kernel::load(dev, &crate::kernels::sources::FUSED_ATTENTION, &kernel)?;
        let blocks = self.t.div_ceil(queries);
        // One row of blocks, a (sequence, head)'s query blocks side by side: they share its keys
        // and values in L2.
        let grid = self.b * self.h * blocks;
        if grid > i32::MAX as usize {
            candle_core::bail!("fused attention: {}·{}·{blocks} blocks are more than a grid's row holds", self.b, self.h);
        }
        let cfg = LaunchConfig { grid_dim: (grid as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        let (t, h, r, mode, scale) = (self.t as u32, self.h as u32, self.r, self.mode, self.scale);
        let null = 0u64;
        let mut a = func.builder();
        a.arg(qkv);
        match bias {
            Some(bv) => a.arg(bv),
            None => a.arg(&null),
        };
        a.arg(out).arg(&t).arg(&h).arg(&r).arg(&mode).arg(&scale);
        // SAFETY: argument types and order match the kernel; qkv holds b·t·3c elements from a
        // 16-byte boundary (`takes`), out b·t·c, the bias what its mode indexes (checked by
        // `attention`), or null when not read.
        unsafe { func.launch(&mut a, cfg) }?;
        Ok(())
    }
}
