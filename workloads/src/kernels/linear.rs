//! y = act(x wᵀ + b) over the last dimension as one differentiable op: a cuBLAS GEMM and our bias
//! kernel forward; backward the activation's gradient, two GEMMs and a column sum.
//!
//! Why: as candle ops a linear layer is reshape, matmul against a transposed weight, bias add and
//! reshape, and candle's backward pass adds every edge's gradient into a freshly zeroed tensor: a
//! memset and a full read-read-write pass per edge. Nsight Compute on the H100 put those adds at 46%
//! of ViT-B/16's training step (bf16, batch 32: 655 launches, 23.7 of 51.3 ms) once layer norm,
//! softmax and AdamW were fused. As one op a linear layer has three edges (x, w, b), one of them
//! activation-sized, instead of four activation-sized ones.
//!
//! GELU's gradient needs the pre-activation, which the op does not keep: its backward recomputes
//! x wᵀ (one GEMM, as activation checkpointing does) rather than holding another activation. That
//! GEMM is cheap on tensor cores; in f32 it costs as much as the layer, so [`super::linear`] runs an
//! f32 GELU layer as this op without activation followed by [`super::bias::Activation`].

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::bias::{act_grad, bias_grad, BiasAct};
use super::{Act, BiasAxis};

#[derive(Debug, Clone, Copy)]
pub struct LinearOp {
    pub act: Act,
}

/// (rows, in features, out features) of x [.., in] against w [out, in] and b [out].
fn geometry(xl: &Layout, wl: &Layout, bl: &Layout) -> Result<(usize, usize, usize)> {
    let in_f = *xl.dims().last().ok_or_else(|| candle_core::Error::Msg("linear: a scalar input".into()))?;
    let (out_f, w_in) = wl.shape().dims2()?;
    if w_in != in_f || bl.dims() != [out_f] {
        bail!("linear: x {:?}, weight {:?} and bias {:?} do not fit", xl.dims(), wl.dims(), bl.dims())
    }
    if !xl.is_contiguous() || !wl.is_contiguous() || !bl.is_contiguous() {
        bail!("the linear op takes contiguous tensors")
    }
    Ok((xl.shape().elem_count() / in_f.max(1), in_f, out_f))
}

/// x wᵀ on the device, as [rows, out].
fn gemm(x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout, (rows, in_f, out_f): (usize, usize, usize)) -> Result<CudaStorage> {
    let x2 = Layout::contiguous_with_offset((rows, in_f), xl.start_offset());
    let wt = Layout::contiguous_with_offset((out_f, in_f), wl.start_offset()).transpose(0, 1)?;
    x.matmul(w, (1, rows, out_f, in_f), &x2, &wt)
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the linear op runs on CUDA devices only; on the CPU migprof uses candle's matmul and add")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, in_f, out_f) = geometry(xl, wl, bl)?;
        let v = gemm(x, xl, w, wl, (rows, in_f, out_f))?;
        let (y, _) = BiasAct { axis: BiasAxis::Last, act: self.act }.cuda_fwd(&v, &Layout::contiguous((rows, out_f)), b, bl)?;
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = out_f;
        Ok((y, Shape::from(dims)))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, b: &Tensor, y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (out_f, in_f) = w.dims2()?;
        let rows = x.elem_count() / in_f.max(1);
        let (x2, w) = (x.detach().reshape((rows, in_f))?, w.detach());
        let flat = |t: &Tensor| t.reshape((rows, out_f));
        let op = BiasAct { axis: BiasAxis::Last, act: self.act };
        let dv = match self.act {
            // x wᵀ again: the bias kernel's gradient adds b itself.
            Act::GeluErf => act_grad(op, &x2.apply_op2_no_bwd(&w, &Gemm)?, b, &flat(y)?, &flat(grad)?)?,
            // A ReLU's gradient reads only y; none needs nothing.
            _ => act_grad(op, &flat(y)?, b, &flat(y)?, &flat(grad)?)?,
        };
        let dx = dv.matmul(&w)?.reshape(x.dims())?;
        let dw = dv.t()?.matmul(&x2)?;
        let db = bias_grad(BiasAxis::Last, &dv)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// x wᵀ for x [rows, in] and w [out, in], without a graph: the pre-activation GELU's gradient needs.
#[derive(Debug, Clone, Copy)]
struct Gemm;

impl CustomOp2 for Gemm {
    fn name(&self) -> &'static str {
        "linear-gemm"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the linear op runs on CUDA devices only")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, in_f) = xl.shape().dims2()?;
        let (out_f, _) = wl.shape().dims2()?;
        Ok((gemm(x, xl, w, wl, (rows, in_f, out_f))?, Shape::from((rows, out_f))))
    }
}
