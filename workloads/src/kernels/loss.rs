//! Softmax cross-entropy against class indices, averaged over the batch, as one op forward and one
//! backward on CUDA devices.
//!
//! Why: candle's log-softmax and NLL are six reductions, broadcasts and gathers forward and more
//! backward, each uploading its dims and strides; for CUDA graphs (`graphs.rs`) candle keeps each
//! uploaded vector on the device for the rest of the process, and a training step's first run
//! scatters them among its freed activations, where they hold whole chunks of the memory pool
//! (measured: docs/kernels.md#loss). Here the dims go by value. Elsewhere (the CPU) candle's ops are
//! the reference.

use candle_core::{DType, Result, Tensor, D};

/// The mean over rows of −log softmax(logits)[label], in f32 whatever the logits' dtype (a
/// log-softmax over 1000 classes in bf16 loses the loss's low bits); `logits` [n, k], `labels` [n]
/// class indices (u32). A scalar.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let (n, _) = logits.dims2()?;
        if labels.dims() != [n] || labels.dtype() != DType::U32 {
            candle_core::bail!(
                "cross-entropy of {n} rows of logits takes {n} u32 labels, not {:?} {:?}",
                labels.dims(),
                labels.dtype()
            )
        }
        return logits
            .contiguous()?
            .apply_op2(&labels.contiguous()?, cuda::CrossEntropy);
    }
    let log_p = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    candle_nn::loss::nll(&log_p, labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cross_entropy_of_uniform_logits_is_ln_classes() -> Result<()> {
        let logits = Tensor::zeros((4, 10), DType::F32, &Device::Cpu)?;
        let labels = Tensor::new(&[0u32, 3, 7, 9], &Device::Cpu)?;
        let loss = cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        assert!((loss - 10f32.ln()).abs() < 1e-6, "{loss}");
        Ok(())
    }

    #[test]
    fn cross_entropy_of_bf16_logits_is_computed_in_f32() -> Result<()> {
        let logits = Tensor::new(&[[2f32, 0.5, -1.0]], &Device::Cpu)?;
        let labels = Tensor::new(&[0u32], &Device::Cpu)?;
        let want = -(2f64 - (2f64.exp() + 0.5f64.exp() + (-1f64).exp()).ln());
        let loss = cross_entropy(&logits.to_dtype(DType::BF16)?, &labels)?;
        assert_eq!(loss.dtype(), DType::F32);
        // 2, 0.5 and -1 are exact in bf16: only f32's rounding remains.
        assert!((loss.to_scalar::<f32>()? as f64 - want).abs() < 1e-6);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

    use crate::kernels::launch::{by_dtype, cuda as saved_storage, name, view, Kernel};
    use crate::kernels::sources::LOSS;

    /// (rows, classes) of the logits, within what the kernels index.
    fn rows_classes(l: &Layout) -> Result<(u32, u32)> {
        let (n, k) = l.shape().dims2()?;
        if n == 0 || k == 0 || n * k > u32::MAX as usize {
            bail!("cross-entropy over {n} rows of {k} classes: this kernel takes 1 to 2^32 - 1 logits")
        }
        Ok((n as u32, k as u32))
    }

    /// The loss: (logits, labels) → f32 scalar.
    #[derive(Debug, Clone, Copy)]
    pub(super) struct CrossEntropy;

    impl CustomOp2 for CrossEntropy {
        fn name(&self) -> &'static str {
            "cross-entropy"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the cross-entropy kernel runs on CUDA devices only; the CPU takes candle's log-softmax and NLL")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            labels: &CudaStorage,
            ll: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (n, k) = rows_classes(xl)?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &LOSS, &name("cross_entropy", x.dtype()))?;
            let labels = view::<u32>(labels, ll, "cross-entropy's labels")?;
            // SAFETY: thread 0 writes the one element.
            let loss = unsafe { dev.alloc::<f32>(1)? };
            by_dtype!(x.dtype(), "cross-entropy", T => {
                let xv = view::<T>(x, xl, "cross-entropy's logits")?;
                let mut b = func.builder();
                b.arg(&xv).arg(&labels).arg(&loss).arg(&n).arg(&k);
                // One block of 32 warps (the kernel's shared sums hold 32): the sum over rows in a
                // fixed order.
                let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: argument types and order match the kernel; x holds n·k, labels n.
                unsafe { func.launch(&mut b, cfg) }?;
            });
            Ok((CudaStorage::wrap_cuda_slice(loss, dev), Shape::from(())))
        }

        fn bwd(
            &self,
            logits: &Tensor,
            labels: &Tensor,
            _loss: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let grad = grad.to_dtype(DType::F32)?.contiguous()?;
            let dx = grad.apply_op1_no_bwd(&CrossEntropyGrad {
                logits: logits.clone(),
                labels: labels.clone(),
            })?;
            Ok((Some(dx), None))
        }
    }

    /// The backward pass, applied to the loss's gradient (an f32 scalar), holding the forward's
    /// logits and labels.
    #[derive(Debug, Clone)]
    struct CrossEntropyGrad {
        logits: Tensor,
        labels: Tensor,
    }

    impl CustomOp1 for CrossEntropyGrad {
        fn name(&self) -> &'static str {
            "cross-entropy-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the cross-entropy kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
            if gl.shape().elem_count() != 1 {
                bail!(
                    "cross-entropy's backward: a gradient of shape {:?} for a scalar loss",
                    gl.dims()
                )
            }
            let (xs, xl) = self.logits.storage_and_layout();
            let (ls, ll) = self.labels.storage_and_layout();
            let x = saved_storage(&xs, "cross-entropy's backward")?;
            let labels = saved_storage(&ls, "cross-entropy's backward")?;
            let (n, k) = rows_classes(xl)?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &LOSS, &name("cross_entropy_grad", x.dtype()))?;
            let labels = view::<u32>(labels, ll, "cross-entropy's labels")?;
            let dloss = view::<f32>(g, gl, "cross-entropy's gradient")?;
            by_dtype!(x.dtype(), "cross-entropy", T => {
                let xv = view::<T>(x, xl, "cross-entropy's logits")?;
                // SAFETY: the kernel writes every element (a warp per row).
                let dx = unsafe { dev.alloc::<T>(n as usize * k as usize)? };
                let mut b = func.builder();
                b.arg(&xv).arg(&labels).arg(&dloss).arg(&dx).arg(&n).arg(&k);
                let cfg = LaunchConfig { grid_dim: (n.div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: argument types and order match the kernel; x and dx hold n·k, labels n.
                unsafe { func.launch(&mut b, cfg) }?;
                Ok((CudaStorage::wrap_cuda_slice(dx, dev), xl.shape().clone()))
            })
        }
    }
}
