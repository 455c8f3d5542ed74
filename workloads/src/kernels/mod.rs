//! Kernels of our own where candle's are slow, each behind a function that picks it when it can run
//! and candle's reference implementation otherwise (the CPU, a build without cuDNN). The GPU tests
//! compare each with that reference, forward and backward (`workloads/tests/kernels.rs`).

#[cfg(feature = "cudnn")]
pub mod cudnn_conv;

use candle_core::{Result, Tensor};

/// 2-D convolution without bias, dilation or groups: cuDNN with cached algorithms on CUDA devices
/// when built with cuDNN, candle's convolution elsewhere.
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    #[cfg(feature = "cudnn")]
    if x.device().is_cuda() {
        let op = cudnn_conv::Conv2d(cudnn_conv::ConvParams { padding, stride });
        return x.contiguous()?.apply_op2(&w.contiguous()?, op);
    }
    x.conv2d(w, padding, stride, 1, 1)
}
