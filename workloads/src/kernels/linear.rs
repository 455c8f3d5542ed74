//! y = act(x wᵀ + b) over the last dimension as one differentiable op: a cuBLASLt GEMM with the bias
//! in its epilogue (GELU: then our bias kernel) forward; backward the activation's gradient, two
//! GEMMs and a column sum.
//!
//! Why: as candle ops a linear layer is reshape, matmul against a transposed weight, bias add and
//! reshape, and candle's backward pass adds every edge's gradient into a freshly zeroed tensor: a
//! memset and a full read-read-write pass per edge. Once layer norm, softmax and AdamW were fused,
//! those adds were a large share of ViT-B/16's training step. As one op a linear layer has three
//! edges (x, w, b), one of them activation-sized, instead of four activation-sized ones.
//! (measured: docs/kernels.md#linear)
//!
//! GELU's gradient needs the pre-activation, which the op does not keep: its backward recomputes
//! x wᵀ (one GEMM, as activation checkpointing does) rather than holding another activation. That
//! GEMM is cheap on tensor cores; in f32 it costs as much as the layer, so [`super::linear`] runs an
//! f32 GELU layer as this op without activation followed by [`super::elementwise::Activation`].

use candle_core::{Result, Tensor};

use super::elementwise::{add, bias_act, Act, BiasAxis};

/// act(x wᵀ + b) over the last dimension of x, as `torch.nn.Linear` (then the activation): one
/// differentiable op on CUDA devices (`cuda::LinearOp`); elsewhere, and without a bias, x seen
/// as one [rows, features] matrix times wᵀ, then [`bias_act`].
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, act: Act) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let (true, Some(b)) = (x.device().is_cuda(), b) {
        let (x, w, b) = (x.contiguous()?, w.contiguous()?, b.contiguous()?);
        // GELU's backward needs the pre-activation: in half precision the op recomputes it (a cheap
        // tensor-core GEMM); in f32 that GEMM costs as much as the layer, so in training the
        // pre-activation is kept and the activation is a pass of its own. Inference keeps neither.
        let trains = [&x, &w, &b].iter().any(|t| t.track_op());
        if act == Act::GeluErf && x.dtype() == candle_core::DType::F32 && trains {
            return x
                .apply_op3(&w, &b, cuda::LinearOp { act: Act::None })?
                .apply_op1(super::elementwise::cuda::Activation(act));
        }
        return x.apply_op3(&w, &b, cuda::LinearOp { act });
    }
    let dims = x.dims();
    let features = *dims
        .last()
        .ok_or_else(|| candle_core::Error::Msg("linear: a scalar input".into()))?;
    let y = x
        .reshape((x.elem_count() / features.max(1), features))?
        .matmul(&w.t()?)?;
    let y = match b {
        Some(b) => bias_act(&y, b, BiasAxis::Last, act)?,
        None => act.apply(y)?,
    };
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    y.reshape(out)
}

/// r + x wᵀ + b (a residual connection after a linear layer). For inference on CUDA devices one
/// GEMM adds the residual too (`cuda::LinearResidual`); where a graph is recorded (training), on
/// the CPU, or with a bias the epilogue cannot read, [`linear`] and then [`add`].
pub fn linear_residual(x: &Tensor, w: &Tensor, b: &Tensor, residual: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let inference = ![x, w, b, residual].iter().any(|t| t.track_op());
        let b = b.contiguous()?;
        if x.device().is_cuda() && inference && super::gemm::bias_aligned(b.dtype(), b.layout().start_offset()) {
            let op = cuda::LinearResidual {
                residual: residual.contiguous()?,
            };
            return x.contiguous()?.apply_op3_no_bwd(&w.contiguous()?, &b, &op);
        }
    }
    add(residual, &linear(x, w, Some(b), Act::None)?, false)
}

/// x wᵀ over the last dimension of x, plus `residual` (shaped as the output) where given, for
/// inference: on CUDA devices one cuBLASLt GEMM over x seen as one [rows, features] matrix, the
/// residual added by the GEMM itself (D = x wᵀ + C); elsewhere candle's matmul, then the add. A
/// language model's projections have no bias (Qwen2's q, k and v take [`linear`]), and candle's
/// matmul of [batch, tokens, features] is a batch of small products against one weight.
pub fn product(x: &Tensor, w: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let op = cuda::Projection {
            residual: residual.map(|r| r.contiguous()).transpose()?,
        };
        return x.contiguous()?.apply_op2_no_bwd(&w.contiguous()?, &op);
    }
    let dims = x.dims();
    let features = *dims
        .last()
        .ok_or_else(|| candle_core::Error::Msg("product: a scalar input".into()))?;
    let mut out = dims.to_vec();
    *out.last_mut().expect("rank >= 1") = w.dim(0)?;
    let y = x
        .reshape((x.elem_count() / features.max(1), features))?
        .matmul(&w.t()?)?
        .reshape(out)?;
    match residual {
        Some(r) => r + y,
        None => Ok(y),
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

    use super::{Act, BiasAxis};
    use crate::kernels::elementwise::cuda::{act_grad, bias_grad, BiasAct};
    use crate::kernels::gemm::{self, operand, Epilogue, Product};

    #[derive(Debug, Clone, Copy)]
    pub struct LinearOp {
        pub act: Act,
    }

    /// (rows, in features, out features) of x [.., in] against w [out, in] and b [out].
    fn geometry(xl: &Layout, wl: &Layout, bl: &Layout) -> Result<(usize, usize, usize)> {
        let in_f = *xl
            .dims()
            .last()
            .ok_or_else(|| candle_core::Error::Msg("linear: a scalar input".into()))?;
        let (out_f, w_in) = wl.shape().dims2()?;
        if w_in != in_f || bl.dims() != [out_f] {
            bail!(
                "linear: x {:?}, weight {:?} and bias {:?} do not fit",
                xl.dims(),
                wl.dims(),
                bl.dims()
            )
        }
        if !xl.is_contiguous() || !wl.is_contiguous() || !bl.is_contiguous() {
            bail!("the linear op takes contiguous tensors")
        }
        Ok((xl.shape().elem_count() / in_f.max(1), in_f, out_f))
    }

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    /// The product of x [rows, in] and wᵀ (w [out, in]) on the device, as [rows, out], with `epilogue`
    /// applied to it (the bias is read only when the epilogue adds it), plus `residual` [rows, out]
    /// when given.
    fn forward_gemm(
        x: Arg,
        w: Arg,
        b: Arg,
        residual: Option<Arg>,
        (rows, in_f, out_f): (usize, usize, usize),
        epilogue: Epilogue,
    ) -> Result<CudaStorage> {
        let product = Product::single(rows, out_f, in_f, false, true);
        let (x, w, b) = (
            operand(x.0, x.1, "linear")?,
            operand(w.0, w.1, "linear")?,
            operand(b.0, b.1, "linear")?,
        );
        let residual = residual.map(|(s, l)| operand(s, l, "linear's residual")).transpose()?;
        gemm::gemm_plus(x, w, Some(b), residual, product, epilogue)
    }

    /// x's shape with the last dimension `out_f`: the output of a linear layer over x.
    fn out_shape(xl: &Layout, out_f: usize) -> Shape {
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = out_f;
        Shape::from(dims)
    }

    impl CustomOp3 for LinearOp {
        fn name(&self) -> &'static str {
            "linear"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("the linear op runs on CUDA devices only; on the CPU migprof uses candle's matmul and add")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let geometry = geometry(xl, wl, bl)?;
            let (rows, _, out_f) = geometry;
            // The bias (and a ReLU) in the GEMM's epilogue; GELU, whose erf form cuBLASLt does not
            // have, by our bias kernel after it.
            let epilogue = match self.act {
                _ if !gemm::bias_aligned(b.dtype(), bl.start_offset()) => None,
                Act::None => Some(Epilogue::Bias),
                Act::Relu => Some(Epilogue::BiasRelu),
                Act::GeluErf => None,
            };
            let y = match epilogue {
                Some(epilogue) => forward_gemm((x, xl), (w, wl), (b, bl), None, geometry, epilogue)?,
                None => {
                    let mut v = forward_gemm((x, xl), (w, wl), (b, bl), None, geometry, Epilogue::None)?;
                    BiasAct {
                        axis: BiasAxis::Last,
                        act: self.act,
                    }
                    .over(&mut v, &Layout::contiguous((rows, out_f)), b, bl)?;
                    v
                }
            };
            Ok((y, out_shape(xl, out_f)))
        }

        fn bwd(
            &self,
            x: &Tensor,
            w: &Tensor,
            b: &Tensor,
            y: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let (out_f, in_f) = w.dims2()?;
            let rows = x.elem_count() / in_f.max(1);
            let (x2, w) = (x.detach().reshape((rows, in_f))?, w.detach());
            let flat = |t: &Tensor| t.reshape((rows, out_f));
            let op = BiasAct {
                axis: BiasAxis::Last,
                act: self.act,
            };
            let dv = match self.act {
                // x wᵀ again: the bias kernel's gradient adds b itself.
                Act::GeluErf => act_grad(
                    op,
                    &x2.apply_op2_no_bwd(&w, &Gemm { a_t: false, b_t: true })?,
                    b,
                    &flat(y)?,
                    &flat(grad)?,
                )?,
                // A ReLU's gradient reads only y; none needs nothing.
                _ => act_grad(op, &flat(y)?, b, &flat(y)?, &flat(grad)?)?,
            };
            // dx = dv w, dw = dvᵀ x: cuBLASLt reads dv transposed in place.
            let dx = dv
                .apply_op2_no_bwd(&w, &Gemm { a_t: false, b_t: false })?
                .reshape(x.dims())?;
            let dw = dv.apply_op2_no_bwd(&x2, &Gemm { a_t: true, b_t: false })?;
            let db = bias_grad(BiasAxis::Last, &dv)?;
            Ok((Some(dx), Some(dw), Some(db)))
        }
    }

    /// r + x wᵀ + b for inference: the residual connection added by the GEMM (cuBLASLt's C with β = 1)
    /// instead of a pass of its own, which reads two activations and writes a third: fewer add
    /// launches and less elementwise time, though whole steps barely move. The residual is held, not
    /// an argument (candle's custom ops take three), so the op has no backward:
    /// [`crate::kernels::linear_residual`] uses it only where no graph is recorded.
    /// (measured: docs/kernels.md#linear)
    #[derive(Debug, Clone)]
    pub struct LinearResidual {
        pub residual: Tensor,
    }

    impl CustomOp3 for LinearResidual {
        fn name(&self) -> &'static str {
            "linear-residual"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("the linear op runs on CUDA devices only; on the CPU migprof uses candle's matmul and add")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let geometry = geometry(xl, wl, bl)?;
            let shape = out_shape(xl, geometry.2);
            let (rs, rl) = self.residual.storage_and_layout();
            let rs = crate::kernels::launch::cuda(&rs, "linear's residual")?;
            if rl.dims() != shape.dims() {
                bail!(
                    "linear: a residual of shape {:?} for an output of {:?}",
                    rl.dims(),
                    shape.dims()
                )
            }
            Ok((
                forward_gemm((x, xl), (w, wl), (b, bl), Some((rs, rl)), geometry, Epilogue::Bias)?,
                shape,
            ))
        }
    }

    /// x wᵀ (+ the residual) for [`super::product`]: x [.., in], w [out, in], the residual shaped as
    /// the output. Held, not an argument, as in [`LinearResidual`].
    #[derive(Debug, Clone)]
    pub struct Projection {
        pub residual: Option<Tensor>,
    }

    impl CustomOp2 for Projection {
        fn name(&self) -> &'static str {
            "product"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the product op runs on CUDA devices only; on the CPU migprof uses candle's matmul and add")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let in_f = *xl
                .dims()
                .last()
                .ok_or_else(|| candle_core::Error::Msg("product: a scalar input".into()))?;
            let (out_f, w_in) = wl.shape().dims2()?;
            if w_in != in_f {
                bail!("product: x {:?} and weight {:?} do not fit", xl.dims(), wl.dims())
            }
            let rows = xl.shape().elem_count() / in_f.max(1);
            let shape = out_shape(xl, out_f);
            let locked = self.residual.as_ref().map(|r| r.storage_and_layout());
            let residual = match &locked {
                Some((rs, rl)) => {
                    if rl.dims() != shape.dims() {
                        bail!(
                            "product: a residual of shape {:?} for an output of {:?}",
                            rl.dims(),
                            shape.dims()
                        )
                    }
                    let rs = crate::kernels::launch::cuda(rs, "product's residual")?;
                    Some(operand(rs, rl, "product's residual")?)
                }
                None => None,
            };
            let y = gemm::gemm_plus(
                operand(x, xl, "product")?,
                operand(w, wl, "product")?,
                None,
                residual,
                Product::single(rows, out_f, in_f, false, true),
                Epilogue::None,
            )?;
            Ok((y, shape))
        }
    }

    /// op(A) op(B) of two contiguous matrices without a graph (the products of the backward pass and
    /// GELU's recomputed pre-activation): A is read as stored [k, m] when `a_t`, B as [n, k] when `b_t`.
    #[derive(Debug, Clone, Copy)]
    struct Gemm {
        a_t: bool,
        b_t: bool,
    }

    impl CustomOp2 for Gemm {
        fn name(&self) -> &'static str {
            "linear-gemm"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the linear op runs on CUDA devices only")
        }

        fn cuda_fwd(&self, a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (ar, ac) = al.shape().dims2()?;
            let (br, bc) = bl.shape().dims2()?;
            let ((m, k), (kb, n)) = (
                if self.a_t { (ac, ar) } else { (ar, ac) },
                if self.b_t { (bc, br) } else { (br, bc) },
            );
            if k != kb {
                bail!(
                    "linear: product of {:?} and {:?} (transposed: {}, {}) does not fit",
                    al.dims(),
                    bl.dims(),
                    self.a_t,
                    self.b_t
                )
            }
            let product = Product::single(m, n, k, self.a_t, self.b_t);
            let c = gemm::gemm(
                operand(a, al, "linear")?,
                operand(b, bl, "linear")?,
                None,
                product,
                Epilogue::None,
            )?;
            Ok((c, Shape::from((m, n))))
        }
    }
}
