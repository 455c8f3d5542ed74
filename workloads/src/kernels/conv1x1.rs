//! 1×1 convolutions with stride 1 over NCHW as batched GEMMs: y[n] = W · x[n], W [k, c] shared by
//! the batch (a zero batch stride), x[n] the image's [c, h·w] matrix.
//!
//! Why: cuDNN's legacy API (what the runtime exposes without the graph API) runs NCHW bf16 1×1
//! convolutions slowly by its own timing (`MIGPROF_CUDNN_LOG=1`, forward and both backward passes),
//! where the same products as cuBLAS GEMMs run at a multiple of that rate. ResNet-50 has 32 of them
//! (three per bottleneck less the strided projections, which stay on cuDNN).
//! (measured: docs/kernels.md#conv1x1)
//!
//! Backward: dx[n] = Wᵀ · dy[n] (the same broadcast), dW = Σₙ dy[n] · x[n]ᵀ (a batched GEMM, then
//! column sums over the batch).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, Layout, Result, Shape, Tensor};

#[derive(Debug, Clone, Copy)]
pub struct Conv1x1;

/// (n, c, h·w, k) of x [n, c, h, w] against w [k, c, 1, 1].
fn dims(xl: &Layout, wl: &Layout) -> Result<(usize, usize, usize, usize)> {
    let (n, c, h, w) = xl.shape().dims4()?;
    let (k, wc, kh, kw) = wl.shape().dims4()?;
    if wc != c || kh != 1 || kw != 1 {
        bail!("1x1 convolution: x {:?} against a filter {:?}", xl.dims(), wl.dims())
    }
    if !xl.is_contiguous() || !wl.is_contiguous() {
        bail!("the 1x1 convolution takes contiguous tensors")
    }
    Ok((n, c, h * w, k))
}

impl CustomOp2 for Conv1x1 {
    fn name(&self) -> &'static str {
        "conv1x1-gemm"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the GEMM 1x1 convolution runs on CUDA devices only; the CPU takes candle's convolution")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n, c, hw, k) = dims(xl, wl)?;
        // W seen as [n, k, c] with a zero batch stride: every image against the same filter.
        let wb = Layout::new(Shape::from((n, k, c)), vec![0, c, 1], wl.start_offset());
        let xb = Layout::contiguous_with_offset((n, c, hw), xl.start_offset());
        let y = w.matmul(x, (n, k, hw, c), &wb, &xb)?;
        let (_, _, h, ww) = xl.shape().dims4()?;
        Ok((y, Shape::from((n, k, h, ww))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The input's gradient only where something upstream takes it (not for the images).
        let (dx, dw) = grads(x, w, &grad.contiguous()?, x.track_op())?;
        Ok((dx, Some(dw)))
    }
}

/// dx (when `input_grad`) and dw of y = conv(x, w) from a contiguous dy.
pub(crate) fn grads(x: &Tensor, w: &Tensor, dy: &Tensor, input_grad: bool) -> Result<(Option<Tensor>, Tensor)> {
    let (n, c, h, ww) = x.dims4()?;
    let k = w.dim(0)?;
    let dy = dy.reshape((n, k, h * ww))?;
    let w2 = w.detach().reshape((k, c))?;
    let dx = if input_grad {
        Some(w2.t()?.broadcast_as((n, c, k))?.matmul(&dy)?.reshape((n, c, h, ww))?)
    } else {
        None
    };
    // Per image dy[n] · x[n]ᵀ, then the sum over images as column sums of [n, k·c] in f32
    // (candle's sum over a leading dimension is a slow strided reduction; measured:
    // docs/kernels.md#conv1x1).
    let xt = x.detach().reshape((n, c, h * ww))?.transpose(1, 2)?;
    let per_image = dy.matmul(&xt)?.reshape((n, k * c))?;
    let dw =
        super::elementwise::cuda::bias_grad(super::elementwise::BiasAxis::Last, &per_image)?.reshape((k, c, 1, 1))?;
    Ok((dx, dw))
}
