//! A decoder's prefill attention as one kernel: causal, with grouped-query heads, from the prompt's
//! projections packed as [q | k | v] per token, on the fused attention kernel (`fused_attention.cu`,
//! mode 3). Candle's path repeats every key-value head for its query heads, writes the scores [b,
//! heads, t, t] and an f32 copy of them for the softmax, and reads them back for the product with
//! the values: at batch 32 and 512 tokens, gigabytes of scores that no serving stack keeps. Here the
//! scores stay in registers and the tiles past a query block's last query are never read.
//!
//! Inference only (no backward): migprof's decoders generate. CUDA only: elsewhere the decoder runs
//! candle's ops, the reference of the GPU test (`workloads/tests/decode_kernels.rs`).

use candle_core::{DType, Device, Result, Tensor};

use super::options::Attention;
use super::KernelOptions;

/// Head sizes the kernel takes.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Whether a prefill of `heads` query heads over `kv_heads` key-value heads of `head_dim` runs as the
/// kernel: on a CUDA device, in bf16 or f16, heads of [`HEAD_DIMS`], and the kernel options' attention
/// fused. The kernel also needs compute capability 8.0, which the op checks when it runs.
pub fn takes(device: &Device, dtype: DType, heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    capable(device)
        && applies(
            device.is_cuda(),
            dtype,
            heads,
            kv_heads,
            head_dim,
            KernelOptions::active().attention,
        )
}

/// Compute capability 8.0 or later (the kernel's bf16 tensor-core instructions); an older GPU runs
/// candle's ops.
fn capable(device: &Device) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => super::fused_attention::tensor_cores(d),
        _ => false,
    }
}

/// [`takes`] without a device at hand (a memory estimate made before one is opened): whether a
/// prefill on a CUDA device (`cuda`) or not runs the kernel under `attention`.
pub fn applies(cuda: bool, dtype: DType, heads: usize, kv_heads: usize, head_dim: usize, attention: Attention) -> bool {
    cuda && matches!(dtype, DType::BF16 | DType::F16)
        && HEAD_DIMS.contains(&head_dim)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && attention == Attention::Fused
}

/// softmax(q kᵀ / √d, causal) v of `packed` [b, t, (heads + 2·kv_heads)·d], each token's query heads
/// then its key heads then its value heads, rotated already: [b, t, heads·d].
pub fn causal_attention(packed: &Tensor, heads: usize, kv_heads: usize) -> Result<Tensor> {
    causal_attention_from(packed, heads, kv_heads, 0)
}

/// As [`causal_attention`], the queries of tokens `from..t` alone: [b, t − from, heads·d]. A prompt
/// continued after its first `from` tokens (a chunked prefill's later piece) attends their keys and
/// values, which fill those rows' k and v; their q is not read. The scores of the rows before `from`
/// are never made.
pub fn causal_attention_from(packed: &Tensor, heads: usize, kv_heads: usize, from: usize) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        packed
            .contiguous()?
            .apply_op1_no_bwd(&cuda::Causal { heads, kv_heads, from })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (packed, heads, kv_heads, from);
        candle_core::bail!("causal attention runs on CUDA devices only")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape};

    use crate::kernels::fused_attention::{Fused, CAUSAL};
    use crate::kernels::launch::{by_dtype, view};

    #[derive(Debug, Clone, Copy)]
    pub(super) struct Causal {
        pub heads: usize,
        pub kv_heads: usize,
        pub from: usize,
    }

    impl CustomOp1 for Causal {
        fn name(&self) -> &'static str {
            "causal-attention"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("causal attention runs on CUDA devices only; on the CPU migprof uses candle's ops")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (b, t, width) = l.shape().dims3()?;
            let (h, kv) = (self.heads, self.kv_heads);
            let per = h + 2 * kv;
            if kv == 0 || !h.is_multiple_of(kv) || !width.is_multiple_of(per) {
                bail!("causal attention: {width} features a token are not q, k and v of {h} query heads over {kv}")
            }
            if self.from >= t {
                bail!("causal attention: queries from token {} of {t}", self.from)
            }
            let fused = Fused {
                b,
                t,
                h,
                d: width / per,
                mode: CAUSAL,
                r: 1,
                scale: (1.0 / ((width / per) as f64).sqrt()) as f32,
                kv_heads: kv,
                q_start: self.from,
            };
            let dev = s.device().clone();
            if s.dtype() == candle_core::DType::F32 || !fused.takes(s.dtype(), &dev, l.start_offset()) {
                bail!(
                    "causal attention: heads of {} in {:?} are not what the kernel takes (bf16 or f16 heads of 32, 64 or 128 on compute capability 8.0 or later)",
                    fused.d,
                    s.dtype()
                )
            }
            let out = by_dtype!(s.dtype(), "causal attention", T => {
                // SAFETY: the kernel writes every element of every query row from `from` on.
                let mut out = unsafe { dev.alloc::<T>(b * (t - self.from) * h * fused.d)? };
                fused.launch(&dev, s.dtype(), &view::<T>(s, l, "causal attention")?, None, &mut out.slice_mut(0..))?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from((b, t - self.from, h * fused.d))))
        }
    }
}
