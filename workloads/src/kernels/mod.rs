//! Kernels of our own where candle's are slow, each behind a function that picks it when it can run
//! and candle's reference implementation otherwise (the CPU, a build without cuDNN). The GPU tests
//! compare each with that reference, forward and backward (`workloads/tests/kernels.rs`).

#[cfg(feature = "cuda")]
pub mod bias;
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

/// Which axis of x a bias runs along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BiasAxis {
    /// Axis 1 of NCHW (any rank >= 2): one value per channel.
    Channels,
    /// The last axis: one value per feature.
    Last,
}

/// x + b, b broadcast along `axis`, then ReLU when `relu`: one pass of our kernel on CUDA devices,
/// candle's broadcast add (and ReLU) elsewhere.
pub fn bias_add(x: &Tensor, b: &Tensor, axis: BiasAxis, relu: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op2(&b.contiguous()?, bias::BiasAct { axis, relu });
    }
    let shape: Vec<usize> = match axis {
        BiasAxis::Channels => (0..x.rank()).map(|d| if d == 1 { b.elem_count() } else { 1 }).collect(),
        BiasAxis::Last => vec![b.elem_count()],
    };
    let y = x.broadcast_add(&b.reshape(shape)?)?;
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}
