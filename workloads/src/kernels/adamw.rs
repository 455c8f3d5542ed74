//! One AdamW update of one parameter in two in-place passes: the moments from the gradient, then
//! the parameter from the moments.
//!
//! Why: candle-nn's AdamW is ~11 elementwise kernels and 3 copies per parameter and step (for a
//! whole model, a long train of small launches), and keeps its moments in the parameter's dtype.
//! Here the moments are f32 [m; v] whatever the parameter's dtype (f64 for f64), as PyTorch's AdamW
//! keeps them for f32 master weights, so that bf16 training does not lose the small second moments.
//! (counted: docs/kernels.md#adamw)

use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result};

use super::cpu;

/// The step's constants, as `torch.optim.AdamW` computes them.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step number, for the bias corrections.
    pub t: u64,
}

impl AdamStep {
    fn corrections(&self) -> (f64, f64) {
        (1.0 - self.beta1.powi(self.t as i32), 1.0 - self.beta2.powi(self.t as i32))
    }
}

/// [m; v] ← [β1 m + (1 - β1) g; β2 v + (1 - β2) g²], in place on the moments, from the gradient.
#[derive(Debug, Clone, Copy)]
pub struct AdamMoments(pub AdamStep);

/// θ ← θ (1 - lr·wd) - lr · m̂ / (sqrt(v̂) + eps), m̂ = m / (1 - β1ᵗ), v̂ = v / (1 - β2ᵗ), in place
/// on the parameter, from the moments.
#[derive(Debug, Clone, Copy)]
pub struct AdamApply(pub AdamStep);

fn halves(moments: &Layout, n: usize) -> Result<()> {
    if moments.shape().elem_count() != 2 * n {
        bail!("AdamW: moments of {} elements for a parameter of {n}", moments.shape().elem_count())
    }
    Ok(())
}


impl InplaceOp2 for AdamMoments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<()> {
        let g = cpu::values(gs, gl)?;
        halves(l, g.len())?;
        let AdamStep { beta1: b1, beta2: b2, .. } = self.0;
        cpu::update(dst, l, |mut mv| {
            let (m, v) = mv.split_at_mut(g.len());
            for ((m, v), g) in m.iter_mut().zip(v.iter_mut()).zip(&g) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
            }
            mv
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, l: &Layout, gs: &candle_core::CudaStorage, gl: &Layout) -> Result<()> {
        let n = gl.shape().elem_count();
        halves(l, n)?;
        cuda::moments(dst, l, gs, gl, n, &self.0)
    }
}

impl InplaceOp2 for AdamApply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout, ms: &CpuStorage, ml: &Layout) -> Result<()> {
        let mv = cpu::values(ms, ml)?;
        let n = l.shape().elem_count();
        halves(ml, n)?;
        let s = self.0;
        let (c1, c2) = s.corrections();
        cpu::update(dst, l, |theta| {
            theta
                .iter()
                .enumerate()
                .map(|(i, p)| p * (1.0 - s.lr * s.weight_decay) - s.lr * (mv[i] / c1) / ((mv[n + i] / c2).sqrt() + s.eps))
                .collect()
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, l: &Layout, ms: &candle_core::CudaStorage, ml: &Layout) -> Result<()> {
        let n = l.shape().elem_count();
        halves(ml, n)?;
        cuda::apply(dst, l, ms, ml, n, &self.0)
    }
}

/// The moments' dtype for a parameter of `dtype`.
pub fn moments_dtype(dtype: DType) -> DType {
    cpu::accumulation(dtype)
}

#[cfg(feature = "cuda")]
mod cuda {

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use super::AdamStep;
    use crate::kernels::launch::{by_dtype, Kernel, name, view};

    /// The contiguous element range of an in-place destination.
    fn range(l: &Layout) -> Result<(usize, usize)> {
        l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("AdamW updates contiguous tensors".into()))
    }



    /// The kernel's scalar arguments, in its order.
    fn scalars(s: &AdamStep) -> [f32; 7] {
        let (c1, c2) = s.corrections();
        [s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, c1, c2].map(|v| v as f32)
    }

    fn config(n: usize) -> Result<(LaunchConfig, u32)> {
        if n > u32::MAX as usize {
            bail!("AdamW over {n} elements is more than this kernel indexes")
        }
        let cfg = LaunchConfig { grid_dim: ((n as u32).div_ceil(256).clamp(1, 65535 * 4), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        Ok((cfg, n as u32))
    }

    pub(super) fn moments(mv: &mut CudaStorage, ml: &Layout, g: &CudaStorage, gl: &Layout, n: usize, s: &AdamStep) -> Result<()> {
        let dev = g.device().clone();
        let kernel = name("adamw", g.dtype());
        let func = Kernel::load(&dev, &crate::kernels::sources::ADAMW, &kernel)?;
        let (cfg, n) = config(n)?;
        let k = scalars(s);
        let (start, end) = range(ml)?;
        let pass = 0i32;
        by_dtype!(g.dtype(), "AdamW", T => {
            let gv = view::<T>(g, gl, "AdamW")?;
            let mut mvv = mv.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
            let mut b = func.builder();
            // The parameter is not touched in this pass; g stands in for its pointer.
            b.arg(&gv).arg(&gv).arg(&mut mvv).arg(&n);
            for v in &k {
                b.arg(v);
            }
            b.arg(&pass);
            // SAFETY: argument types and order match the kernel; g holds n elements, mv 2n.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }

    pub(super) fn apply(theta: &mut CudaStorage, l: &Layout, mv: &CudaStorage, ml: &Layout, n: usize, s: &AdamStep) -> Result<()> {
        let dev = mv.device().clone();
        let kernel = name("adamw", theta.dtype());
        let func = Kernel::load(&dev, &crate::kernels::sources::ADAMW, &kernel)?;
        let (cfg, n) = config(n)?;
        let k = scalars(s);
        let (start, end) = range(l)?;
        let pass = 1i32;
        let mvv = view::<f32>(mv, ml, "AdamW's moments")?;
        by_dtype!(theta.dtype(), "AdamW", T => {
            let mut tv = theta.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let mut b = func.builder();
            // The gradient is not read in this pass; the moments stand in for its pointer.
            b.arg(&mut tv).arg(&mvv).arg(&mvv).arg(&n);
            for v in &k {
                b.arg(v);
            }
            b.arg(&pass);
            // SAFETY: argument types and order match the kernel; theta holds n elements, mv 2n.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }
}
