//! Compiling our kernel sources (`sources.rs`) with NVRTC when an op first runs: the CUDA build links
//! NVRTC already, so no nvcc is needed at build time.

use candle_core::cuda_backend::cudarc;
use candle_core::Result;

use super::sources::{self, Source};

/// The PTX of `source` for a GPU of compute capability `major`, compiled on first use and kept in
/// the source.
pub(crate) fn ptx(source: &'static Source, major: i32) -> Result<&'static str> {
    let arch = source.arch_for(major);
    let compiled = source.ptx[arch as usize].get_or_init(|| {
        let options = arch.nvrtc_options().iter().map(|o| o.to_string()).collect();
        let opts = cudarc::nvrtc::CompileOptions {
            options,
            ..Default::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(sources::program(source), opts)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    compiled.as_deref().map_err(|e| {
        candle_core::Error::Msg(format!(
            "compiling the kernels of {} for {arch:?} with NVRTC: {e}",
            source.module
        ))
    })
}

/// Threads per block for a kernel in which each thread keeps up to `per_thread` elements of a row of
/// `cols`: a multiple of 32, at most 1024; None when the row is too long for that.
pub(crate) fn row_threads(cols: usize, per_thread: usize) -> Option<u32> {
    let threads = cols.div_ceil(per_thread).next_multiple_of(32).max(32);
    (threads <= 1024).then_some(threads as u32)
}
