//! Whether f32 matrix products and convolutions may use TF32 on the tensor cores (10-bit mantissa
//! inputs, f32 accumulation). Off by default, as in PyTorch's `torch.backends.cuda.matmul`: f32 means
//! f32. bf16 and f16 products always accumulate in f32 (reduced-precision reductions stay off).

use std::sync::atomic::{AtomicBool, Ordering};

static TF32: AtomicBool = AtomicBool::new(false);

/// Allows (or forbids) TF32 for f32 matmuls (cuBLAS) and convolutions (cuDNN), process-wide.
pub fn allow_tf32(allowed: bool) {
    TF32.store(allowed, Ordering::Relaxed);
    #[cfg(feature = "cuda")]
    candle_core::cuda_backend::set_gemm_reduced_precision_f32(allowed);
}

pub fn tf32_allowed() -> bool {
    TF32.load(Ordering::Relaxed)
}
