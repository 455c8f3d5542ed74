//! One AdamW update of one parameter in two in-place passes: the moments from the gradient, then
//! the parameter from the moments.
//!
//! Why: candle-nn's AdamW is ~11 elementwise kernels and 3 copies per parameter and step (for a
//! whole model, a long train of small launches), and keeps its moments in the parameter's dtype.
//! Here the moments are f32 [m; v] whatever the parameter's dtype (f64 for f64), as PyTorch's AdamW
//! keeps them for f32 master weights, so that bf16 training does not lose the small second moments.
//! (counted: docs/kernels.md#adamw)

use candle_core::{bail, CpuStorage, DType, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

use super::cpu;

/// The optimizer's constants, as `torch.optim.AdamW` takes them.
#[derive(Debug, Clone, Copy)]
pub struct AdamStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// The step count and its bias corrections, [t, 1 - β1ᵗ, 1 - β2ᵗ] in f64 on the parameters' device,
/// starting at t = 0. In device memory, not a host scalar, so that a CUDA graph of a training step
/// moves it on at every replay ([`AdamAdvance`]) and the update reads the current one.
pub fn adam_state(device: &candle_core::Device) -> Result<Tensor> {
    Tensor::zeros(3, DType::F64, device)
}

/// t ← t + 1 and the corrections for the new t, in place on an [`adam_state`].
#[derive(Debug, Clone, Copy)]
pub struct AdamAdvance(pub AdamStep);

/// [m; v] ← [β1 m + (1 - β1) g; β2 v + (1 - β2) g²], in place on the moments, from the gradient.
#[derive(Debug, Clone, Copy)]
pub struct AdamMoments(pub AdamStep);

/// θ ← θ (1 - lr·wd) - lr · m̂ / (sqrt(v̂) + eps), m̂ = m / (1 - β1ᵗ), v̂ = v / (1 - β2ᵗ), in place
/// on the parameter, from the moments and the [`adam_state`]'s corrections.
#[derive(Debug, Clone, Copy)]
pub struct AdamApply(pub AdamStep);

fn halves(moments: &Layout, n: usize) -> Result<()> {
    if moments.shape().elem_count() != 2 * n {
        bail!(
            "AdamW: moments of {} elements for a parameter of {n}",
            moments.shape().elem_count()
        )
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
        let AdamStep {
            beta1: b1, beta2: b2, ..
        } = self.0;
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
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        l: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<()> {
        let n = gl.shape().elem_count();
        halves(l, n)?;
        cuda::moments(dst, l, gs, gl, n, &self.0)
    }
}

fn three(state: &Layout) -> Result<()> {
    if state.shape().elem_count() != 3 {
        bail!(
            "AdamW: a step state of {} elements, not [t, c1, c2]",
            state.shape().elem_count()
        )
    }
    Ok(())
}

impl InplaceOp1 for AdamAdvance {
    fn name(&self) -> &'static str {
        "adamw-advance"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout) -> Result<()> {
        three(l)?;
        let AdamStep { beta1, beta2, .. } = self.0;
        cpu::update(dst, l, |s| {
            let t = s[0] + 1.0;
            vec![t, 1.0 - beta1.powf(t), 1.0 - beta2.powf(t)]
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        three(l)?;
        cuda::advance(dst, l, &self.0)
    }
}

impl InplaceOp3 for AdamApply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        l: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let mv = cpu::values(ms, ml)?;
        let n = l.shape().elem_count();
        halves(ml, n)?;
        three(sl)?;
        let s = self.0;
        let (c1, c2) = match cpu::values(ss, sl)?[..] {
            [_, c1, c2] => (c1, c2),
            _ => unreachable!("checked: three elements"),
        };
        cpu::update(dst, l, |theta| {
            theta
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    p * (1.0 - s.lr * s.weight_decay) - s.lr * (mv[i] / c1) / ((mv[n + i] / c2).sqrt() + s.eps)
                })
                .collect()
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        l: &Layout,
        ms: &candle_core::CudaStorage,
        ml: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let n = l.shape().elem_count();
        halves(ml, n)?;
        three(sl)?;
        cuda::apply(dst, l, ms, ml, ss, sl, n, &self.0)
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
    use candle_core::{CudaStorage, Layout, Result};

    use super::AdamStep;
    use crate::kernels::launch::{by_dtype, contiguous_range, grid_stride, name, view, Kernel, ONE_THREAD};

    /// The contiguous element range of an in-place destination.
    fn range(l: &Layout) -> Result<(usize, usize)> {
        contiguous_range(l, "AdamW")
    }

    /// The kernel's scalar arguments, in its order (the corrections come from the step state).
    fn scalars(s: &AdamStep) -> [f32; 5] {
        [s.lr, s.beta1, s.beta2, s.eps, s.weight_decay].map(|v| v as f32)
    }

    pub(super) fn advance(state: &mut CudaStorage, l: &Layout, s: &AdamStep) -> Result<()> {
        let dev = state.device().clone();
        let func = Kernel::load(&dev, &crate::kernels::sources::ADAMW, "adamw_advance")?;
        let (start, end) = range(l)?;
        let mut sv = state.as_cuda_slice_mut::<f64>()?.slice_mut(start..end);
        let mut b = func.builder();
        b.arg(&mut sv).arg(&s.beta1).arg(&s.beta2);
        // SAFETY: argument types and order match the kernel; the state holds three f64.
        unsafe { func.launch(&mut b, ONE_THREAD) }
    }

    fn config(n: usize) -> Result<(LaunchConfig, u32)> {
        grid_stride(n, u32::MAX as usize, "AdamW")
    }

    pub(super) fn moments(
        mv: &mut CudaStorage,
        ml: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        n: usize,
        s: &AdamStep,
    ) -> Result<()> {
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
            // The parameter and the step state are not touched in this pass; g stands in for them.
            b.arg(&gv).arg(&gv).arg(&mut mvv).arg(&n);
            for v in &k {
                b.arg(v);
            }
            b.arg(&gv).arg(&pass);
            // SAFETY: argument types and order match the kernel; g holds n elements, mv 2n.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn apply(
        theta: &mut CudaStorage,
        l: &Layout,
        mv: &CudaStorage,
        ml: &Layout,
        state: &CudaStorage,
        sl: &Layout,
        n: usize,
        s: &AdamStep,
    ) -> Result<()> {
        let dev = mv.device().clone();
        let kernel = name("adamw", theta.dtype());
        let func = Kernel::load(&dev, &crate::kernels::sources::ADAMW, &kernel)?;
        let (cfg, n) = config(n)?;
        let k = scalars(s);
        let (start, end) = range(l)?;
        let pass = 1i32;
        let mvv = view::<f32>(mv, ml, "AdamW's moments")?;
        let sv = view::<f64>(state, sl, "AdamW's step state")?;
        by_dtype!(theta.dtype(), "AdamW", T => {
            let mut tv = theta.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let mut b = func.builder();
            // The gradient is not read in this pass; the moments stand in for its pointer.
            b.arg(&mut tv).arg(&mvv).arg(&mvv).arg(&n);
            for v in &k {
                b.arg(v);
            }
            b.arg(&sv).arg(&pass);
            // SAFETY: argument types and order match the kernel; theta holds n elements, mv 2n,
            // the state three.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }
}
