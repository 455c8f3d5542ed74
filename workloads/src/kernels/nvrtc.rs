//! Our CUDA kernels are C++ source compiled with NVRTC when first used (the CUDA build links NVRTC
//! already; no nvcc is needed at build time). PTX for compute capability 8.0, which the driver
//! compiles for the GPU at hand (bf16 conversions need sm_80).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc;
use candle_core::Result;

/// The PTX of `source`, compiled once into `cell`; `what` names the kernels in the error.
pub(crate) fn ptx(cell: &'static OnceLock<std::result::Result<String, String>>, source: &str, what: &str) -> Result<&'static str> {
    let compiled = cell.get_or_init(|| {
        let opts = cudarc::nvrtc::CompileOptions { arch: Some("compute_80"), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(source, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
    });
    compiled.as_deref().map_err(|e| candle_core::Error::Msg(format!("compiling the {what} kernels with NVRTC: {e}")))
}
