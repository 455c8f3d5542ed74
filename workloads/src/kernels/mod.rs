//! Kernels of our own where candle's are slow, each a candle custom op with its own backward, behind a
//! function that picks it where it runs. Two kinds: ops with a CPU half (layer norm, batch norm,
//! AdamW), whose f64 loops are the reference and are gradient-checked by `cargo test`; and
//! CUDA-only ops, for which the function takes candle's own ops elsewhere (the CPU, a build without
//! cuDNN) and those are the reference. The GPU tests compare each with its reference, forward and
//! every input's gradient (`workloads/tests/kernels.rs`).

pub mod adamw;
pub mod attention;
pub mod batch_norm;
#[cfg(feature = "cuda")]
pub mod bias;
mod cpu;
#[cfg(feature = "cudnn")]
pub mod cudnn_conv;
#[cfg(feature = "cuda")]
pub mod embedding;
#[cfg(feature = "cuda")]
mod flash;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub mod linear;
pub mod norm;
#[cfg(feature = "cuda")]
mod nvrtc;
pub mod options;
#[cfg(feature = "cuda")]
pub mod pointwise;
#[cfg(feature = "cuda")]
pub mod pool;
#[cfg(feature = "cuda")]
pub mod windows;

use candle_core::{Result, Tensor};

pub use attention::{attention, ScoreBias};
pub use options::KernelOptions;

/// Layer normalisation over the last dimension (`torch.nn.LayerNorm`): our differentiable op,
/// except for inference on the CPU, where candle's fused kernel is faster than our reference loops.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    if !x.device().is_cuda() && !x.track_op() && !w.track_op() {
        return candle_nn::ops::layer_norm(&x, w, b, eps as f32);
    }
    x.apply_op3(&w.contiguous()?, &b.contiguous()?, norm::LayerNorm { eps })
}

/// 2-D convolution without bias, dilation or groups: on CUDA devices batched GEMMs for 1x1 stride 1
/// and cuDNN with cached algorithms (when built with cuDNN) for the rest; candle's convolution
/// elsewhere.
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    // 1x1, stride 1: batched GEMMs (faster than cuDNN's NCHW kernels, see `pointwise`).
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && padding == 0 && stride == 1 && w.rank() == 4 && w.dims()[2..] == [1, 1] {
        return x.contiguous()?.apply_op2(&w.contiguous()?, pointwise::Pointwise);
    }
    #[cfg(feature = "cudnn")]
    if x.device().is_cuda() {
        let op = cudnn_conv::Conv2d(cudnn_conv::ConvParams { padding, stride });
        return x.contiguous()?.apply_op2(&w.contiguous()?, op);
    }
    x.conv2d(w, padding, stride, 1, 1)
}

/// act(x wᵀ + b) over the last dimension of x, as `torch.nn.Linear` (then the activation): one
/// differentiable op on CUDA devices (`linear::LinearOp`); elsewhere, and without a bias, x seen
/// as one [rows, features] matrix times wᵀ, then [`bias_act`].
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Act) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let (true, Some(b)) = (x.device().is_cuda(), b) {
        let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
        // GELU's backward needs the pre-activation: in half precision the op recomputes it (a cheap
        // tensor-core GEMM); in f32 that GEMM costs as much as the layer, so the pre-activation is
        // kept and the activation is a pass of its own.
        if act == Act::GeluErf && x.dtype() == candle_core::DType::F32 {
            return x.apply_op3(&w, &b, linear::LinearOp { act: Act::None })?.apply_op1(bias::Activation(act));
        }
        return x.apply_op3(&w, &b, linear::LinearOp { act });
    }
    let dims = x.dims();
    let features = *dims.last().ok_or_else(|| candle_core::Error::Msg("linear: a scalar input".into()))?;
    let y = x.reshape((x.elem_count() / features.max(1), features))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => bias_act(&y, b, BiasAxis::Last, act)?,
        None => act.apply(y)?,
    };
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    y.reshape(out)
}

/// r + x wᵀ + b (a residual connection after a linear layer). For inference on CUDA devices one
/// GEMM adds the residual too (`linear::LinearResidual`); where a graph is recorded (training), on
/// the CPU, or with a bias the epilogue cannot read, [`linear`] and then [`add`].
pub fn linear_residual(x: &Tensor, w: &Tensor, b: &Tensor, residual: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let inference = ![x, w, b, residual].iter().any(|t| t.track_op());
        let b = b.contiguous()?;
        if x.device().is_cuda() && inference && gemm::bias_aligned(b.dtype(), b.layout().start_offset()) {
            let op = linear::LinearResidual { residual: residual.contiguous()? };
            return x.contiguous()?.apply_op3_no_bwd(&w.contiguous()?, &b, &op);
        }
    }
    add(residual, &linear(x, w, Some(b), Act::None)?, false)
}

/// Rows of `table` [rows, d] by u32 `ids` of any shape: [ids.., d]. Our op on CUDA devices (its
/// backward without candle's slow index_add), candle's index_select elsewhere.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    let flat = ids.flatten_all()?;
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return table.contiguous()?.apply_op2(&flat.contiguous()?, embedding::Embedding)?.reshape(dims);
    }
    table.index_select(&flat, 0)?.reshape(dims)
}

/// Swin's windows: x [b, side, side, c] rolled by -shift on both spatial axes (torch.roll), then
/// cut into windows [b · (side/window)², window², c]. Our gather on CUDA devices (its backward the
/// inverse scatter); candle's roll and permute elsewhere.
pub fn window_partition(x: &Tensor, window: usize, shift: usize) -> Result<Tensor> {
    let (b, side, _, c) = x.dims4()?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(windows::Windows { side, window, shift, merge: false });
    }
    let s = shift as i32;
    let x = if shift > 0 { x.roll(-s, 1)?.roll(-s, 2)? } else { x.clone() };
    let per_side = side / window;
    x.reshape((b, per_side, window, per_side, window, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b * per_side * per_side, window * window, c))
}

/// The inverse of [`window_partition`]: windows back into [b, side, side, c] maps, rolled back by
/// +shift.
pub fn window_merge(windows: &Tensor, side: usize, window: usize, shift: usize) -> Result<Tensor> {
    let (bw, _, c) = windows.dims3()?;
    #[cfg(feature = "cuda")]
    if windows.device().is_cuda() {
        return windows.contiguous()?.apply_op1(windows::Windows { side, window, shift, merge: true });
    }
    let per_side = side / window;
    let b = bw / (per_side * per_side);
    let x = windows
        .reshape((b, per_side, per_side, window, window, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, side, side, c))?;
    let s = shift as i32;
    if shift > 0 { x.roll(s, 1)?.roll(s, 2) } else { Ok(x) }
}

/// Which axis of x a bias runs along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BiasAxis {
    /// Axis 1 of NCHW (any rank >= 2): one value per channel.
    Channels,
    /// The last axis: one value per feature.
    Last,
}

/// The activation applied after a bias add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    None,
    Relu,
    /// GELU in its erf form, as `torch.nn.GELU()`.
    GeluErf,
}

impl Act {
    /// The activation with candle's own ops (its CPU kernels, or where no bias kernel runs).
    pub fn apply(self, y: Tensor) -> Result<Tensor> {
        match self {
            Act::None => Ok(y),
            Act::Relu => y.relu(),
            Act::GeluErf => y.gelu_erf(),
        }
    }
}

/// act(x + b), b broadcast along `axis`: one pass of our kernel on CUDA devices, candle's broadcast
/// add and activation elsewhere.
pub fn bias_act(x: &Tensor, b: &Tensor, axis: BiasAxis, act: Act) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op2(&b.contiguous()?, bias::BiasAct { axis, act });
    }
    let shape: Vec<usize> = match axis {
        BiasAxis::Channels => (0..x.rank()).map(|d| if d == 1 { b.elem_count() } else { 1 }).collect(),
        BiasAxis::Last => vec![b.elem_count()],
    };
    act.apply(x.broadcast_add(&b.reshape(shape)?)?)
}

/// x + z (same shape), then ReLU when `relu`: one pass of our kernel on CUDA devices, candle's add
/// (and ReLU) elsewhere.
pub fn add(x: &Tensor, z: &Tensor, relu: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dims() == z.dims() && x.dtype() == z.dtype() {
        return x.contiguous()?.apply_op2(&z.contiguous()?, bias::AddAct { relu });
    }
    let y = (x + z)?;
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}

/// x + bias, where the bias repeats along x's leading elements: its shape, leading 1s
/// left out, is [d0, rest..] against scores [.., s0, rest..] with d0 dividing s0 (Swin's [windows,
/// heads, n, n] against [batch * windows, heads, n, n]; position embeddings [tokens, d] against
/// [batch, tokens, d]). Then the add is one pass of the last-axis bias kernel over x seen as
/// [repeats, bias elements]; other shapes take candle's broadcast add.
pub fn add_repeating(scores: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let b: Vec<usize> = bias.dims().iter().copied().skip_while(|&d| d == 1).collect();
    let s = scores.dims();
    let fits = !b.is_empty() && b.len() <= s.len() && {
        let k = s.len() - b.len();
        s[k + 1..] == b[1..] && s[k] % b[0] == 0
    };
    if !fits {
        return scores.broadcast_add(bias);
    }
    let n = bias.elem_count();
    let flat = scores.reshape((scores.elem_count() / n, n))?;
    bias_act(&flat, &bias.flatten_all()?, BiasAxis::Last, Act::None)?.reshape(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn a_repeating_bias_is_added_as_broadcasting_would() -> Result<()> {
        let scores = Tensor::arange(0f32, 48., &Device::Cpu)?.reshape((4, 2, 3, 2))?;
        // [windows = 2, heads, n, n] against [batch * windows = 4, ...]: repeats every 2.
        let bias = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 2, 3, 2))?;
        let want = scores.reshape((2, 2, 2, 3, 2))?.broadcast_add(&bias.unsqueeze(0)?)?.reshape((4, 2, 3, 2))?;
        assert_eq!(add_repeating(&scores, &bias)?.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
        // [1, heads, n, n] and a BERT-style [batch, 1, 1, n] mask go as broadcasting does.
        for b in [Tensor::ones((1, 2, 3, 2), DType::F32, &Device::Cpu)?, Tensor::ones((4, 1, 1, 2), DType::F32, &Device::Cpu)?] {
            let want = scores.broadcast_add(&b)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(add_repeating(&scores, &b)?.flatten_all()?.to_vec1::<f32>()?, want);
        }
        Ok(())
    }
}
