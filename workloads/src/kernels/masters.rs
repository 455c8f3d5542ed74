//! Mixed-precision training's optimizer passes (`masters.cu`): f32 master weights updated from the
//! half-precision gradients, the working copies written from them, and the dynamic loss scale.
//!
//! Why here and not in candle ops: each parameter's update is one pass over its gradient and its
//! f32 state ([m; v; master] for AdamW, [b; master] for SGD) and one writing its working copy, where
//! candle's elementwise ops would take a dozen; and whether a step is skipped (an inf or a nan in an
//! f16 gradient) is decided on the device from a step state in device memory ([`MixedState`]), so a
//! training step still replays as one CUDA graph. The CPU loops are the reference the kernels are
//! tested against.

use candle_core::{bail, CpuStorage, DType, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

use super::adamw::AdamStep;
use super::cpu;

/// Where each field of the step state lives (the kernel's `#define`s, in the same order).
mod at {
    pub const T: usize = 0;
    pub const C1: usize = 1;
    pub const C2: usize = 2;
    pub const SCALE: usize = 3;
    pub const FOUND: usize = 4;
    pub const GOOD: usize = 5;
    pub const SKIPPED: usize = 6;
    pub const ATTEMPTED: usize = 7;
    pub const LEN: usize = 8;
}

/// The step state of a mixed-precision optimizer, eight f64 in device memory: AdamW's step count and
/// bias corrections, the loss scale, whether this step's gradients hold an inf or a nan, the good
/// steps since the scale last changed, and the steps skipped and attempted so far. The ops of this
/// module update it in place ([`MixedState::tensor`]).
pub struct MixedState(Tensor);

impl MixedState {
    /// A state before the first step, with `scale` as the loss scale.
    pub fn new(scale: f64, device: &candle_core::Device) -> Result<Self> {
        let mut v = vec![0f64; at::LEN];
        v[at::SCALE] = scale;
        Ok(Self(Tensor::from_vec(v, at::LEN, device)?))
    }

    /// The state as the ops take it.
    pub fn tensor(&self) -> &Tensor {
        &self.0
    }

    /// The loss scale as a scalar tensor of `dtype`, read on the device: the step multiplies its loss
    /// by it without a host synchronisation.
    pub fn scale(&self, dtype: DType) -> Result<Tensor> {
        self.0.narrow(0, at::SCALE, 1)?.to_dtype(dtype)?.reshape(())
    }

    /// What the state says after some steps (synchronises with the device).
    pub fn read(&self) -> Result<ScaleReading> {
        let v = self.0.to_vec1::<f64>()?;
        Ok(ScaleReading {
            scale: v[at::SCALE],
            skipped: v[at::SKIPPED] as u64,
            attempted: v[at::ATTEMPTED] as u64,
            taken: v[at::T] as u64,
        })
    }
}

/// A mixed-precision optimizer's counters, read from its [`MixedState`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScaleReading {
    /// The loss scale the next step uses.
    pub scale: f64,
    /// Steps skipped because a gradient held an inf or a nan.
    pub skipped: u64,
    /// Steps attempted.
    pub attempted: u64,
    /// Steps taken (AdamW's t).
    pub taken: u64,
}

fn state_len(l: &Layout) -> Result<()> {
    if l.shape().elem_count() != at::LEN {
        bail!(
            "mixed precision: a step state of {} elements, not {}",
            l.shape().elem_count(),
            at::LEN
        )
    }
    Ok(())
}

/// state[found] = 1 when the gradient holds an inf or a nan; in place on the state, from the gradient.
#[derive(Debug, Clone, Copy)]
pub struct NonFinite;

/// AdamW's count moves on unless the step is skipped (after every [`NonFinite`] of the step).
#[derive(Debug, Clone, Copy)]
pub struct Begin {
    pub beta1: f64,
    pub beta2: f64,
}

/// One optimizer's update of a parameter's f32 state, its buffers followed by its master weights,
/// from the gradient of the loss times the scale (the CPU reference of its kernel in `masters.cu`).
pub trait Update: Copy + Send + Sync {
    /// f32 buffers of the parameter's size before the master: [m; v] or [b].
    const BUFFERS: usize;
    /// The op's name and its kernel's base name.
    const NAME: &'static str;
    const KERNEL: &'static str;
    /// The kernel's scalar arguments, in its order.
    fn scalars(&self) -> Vec<f32>;
    /// The update of every element in f64: `buffers` as `BUFFERS` slices of n, then the master;
    /// `g` already divided by the scale; `c1` and `c2` AdamW's bias corrections.
    fn update(&self, state: &mut [f64], g: &[f64], c1: f64, c2: f64);
}

/// AdamW on [m; v; master]: m and v from g, master ← master (1 − lr·wd) − lr · m̂ / (√v̂ + eps).
impl Update for AdamStep {
    const BUFFERS: usize = 2;
    const NAME: &'static str = "masters-adamw";
    const KERNEL: &'static str = "masters_adamw";

    fn scalars(&self) -> Vec<f32> {
        [self.lr, self.beta1, self.beta2, self.eps, self.weight_decay]
            .map(|v| v as f32)
            .to_vec()
    }

    fn update(&self, state: &mut [f64], g: &[f64], c1: f64, c2: f64) {
        let (n, s) = (g.len(), *self);
        let (m, rest) = state.split_at_mut(n);
        let (v, master) = rest.split_at_mut(n);
        for i in 0..n {
            m[i] = s.beta1 * m[i] + (1.0 - s.beta1) * g[i];
            v[i] = s.beta2 * v[i] + (1.0 - s.beta2) * g[i] * g[i];
            master[i] = master[i] * (1.0 - s.lr * s.weight_decay) - s.lr * (m[i] / c1) / ((v[i] / c2).sqrt() + s.eps);
        }
    }
}

/// SGD with momentum on [b; master]: g' = g + wd · master, b = momentum · b + g', master −= lr · b.
#[derive(Debug, Clone, Copy)]
pub struct SgdStep {
    pub lr: f64,
    pub momentum: f64,
    pub weight_decay: f64,
}

impl Update for SgdStep {
    const BUFFERS: usize = 1;
    const NAME: &'static str = "masters-sgd";
    const KERNEL: &'static str = "masters_sgd";

    fn scalars(&self) -> Vec<f32> {
        [self.lr, self.momentum, self.weight_decay].map(|v| v as f32).to_vec()
    }

    fn update(&self, state: &mut [f64], g: &[f64], _: f64, _: f64) {
        let (b, master) = state.split_at_mut(g.len());
        for i in 0..g.len() {
            b[i] = self.momentum * b[i] + g[i] + self.weight_decay * master[i];
            master[i] -= self.lr * b[i];
        }
    }
}

/// An [`Update`] as an op: in place on the f32 state, from the gradient and the [`MixedState`].
/// Nothing changes on a skipped step.
#[derive(Debug, Clone, Copy)]
pub struct Masters<U>(pub U);

/// The working copy = the master, rounded to its dtype; in place on the working copy, from the master.
#[derive(Debug, Clone, Copy)]
pub struct WorkingCopy;

/// The end of a step: skipped steps counted, and with `dynamic`, `torch.amp.GradScaler`'s rule (halve
/// the scale on an inf or a nan, double it after `interval` good steps in a row).
#[derive(Debug, Clone, Copy)]
pub struct End {
    pub dynamic: bool,
    pub interval: u32,
}

impl InplaceOp2 for NonFinite {
    fn name(&self) -> &'static str {
        "masters-nonfinite"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<()> {
        state_len(l)?;
        let bad = cpu::values(gs, gl)?.iter().any(|g| !g.is_finite());
        cpu::update(dst, l, |mut s| {
            if bad {
                s[at::FOUND] = 1.0;
            }
            s
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
        state_len(l)?;
        cuda::nonfinite(dst, l, gs, gl)
    }
}

impl InplaceOp1 for Begin {
    fn name(&self) -> &'static str {
        "masters-begin"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout) -> Result<()> {
        state_len(l)?;
        let Begin { beta1, beta2 } = *self;
        cpu::update(dst, l, |mut s| {
            if s[at::FOUND] == 0.0 {
                let t = s[at::T] + 1.0;
                s[at::T] = t;
                s[at::C1] = 1.0 - beta1.powf(t);
                s[at::C2] = 1.0 - beta2.powf(t);
            }
            s
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        state_len(l)?;
        cuda::begin(dst, l, self)
    }
}

impl InplaceOp1 for End {
    fn name(&self) -> &'static str {
        "masters-end"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout) -> Result<()> {
        state_len(l)?;
        let End { dynamic, interval } = *self;
        cpu::update(dst, l, |mut s| {
            s[at::ATTEMPTED] += 1.0;
            if s[at::FOUND] != 0.0 {
                s[at::SKIPPED] += 1.0;
                if dynamic {
                    s[at::SCALE] *= 0.5;
                }
                s[at::GOOD] = 0.0;
                s[at::FOUND] = 0.0;
            } else if dynamic {
                s[at::GOOD] += 1.0;
                if s[at::GOOD] >= interval as f64 {
                    s[at::SCALE] *= 2.0;
                    s[at::GOOD] = 0.0;
                }
            }
            s
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        state_len(l)?;
        cuda::end(dst, l, self)
    }
}

/// The number of parameter elements an f32 state of `parts` × n elements serves.
fn per_part(state: &Layout, grad: &Layout, parts: usize) -> Result<usize> {
    let n = grad.shape().elem_count();
    if state.shape().elem_count() != parts * n {
        bail!(
            "mixed precision: an optimizer state of {} elements for a parameter of {n} (want {})",
            state.shape().elem_count(),
            parts * n
        )
    }
    Ok(n)
}

impl<U: Update> InplaceOp3 for Masters<U> {
    fn name(&self) -> &'static str {
        U::NAME
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        l: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        per_part(l, gl, U::BUFFERS + 1)?;
        state_len(sl)?;
        let s = cpu::values(ss, sl)?;
        if s[at::FOUND] != 0.0 {
            return Ok(());
        }
        let g: Vec<f64> = cpu::values(gs, gl)?.iter().map(|g| g / s[at::SCALE]).collect();
        cpu::update(dst, l, |mut state| {
            self.0.update(&mut state, &g, s[at::C1], s[at::C2]);
            state
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        l: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let n = per_part(l, gl, U::BUFFERS + 1)?;
        state_len(sl)?;
        cuda::update(U::KERNEL, dst, l, gs, gl, ss, sl, n, &self.0.scalars())
    }
}

impl InplaceOp2 for WorkingCopy {
    fn name(&self) -> &'static str {
        "masters-copy"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout, ms: &CpuStorage, ml: &Layout) -> Result<()> {
        let master = cpu::values(ms, ml)?;
        if master.len() != l.shape().elem_count() {
            bail!(
                "mixed precision: a master of {} elements for a working copy of {}",
                master.len(),
                l.shape().elem_count()
            )
        }
        // Through f32 first: the device rounds the f32 master once, and so must this reference.
        cpu::update(dst, l, |_| master.iter().map(|&m| m as f32 as f64).collect())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        l: &Layout,
        ms: &candle_core::CudaStorage,
        ml: &Layout,
    ) -> Result<()> {
        cuda::copy(dst, l, ms, ml)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use super::{Begin, End};
    use crate::kernels::launch::{by_dtype, contiguous_range, grid_stride, name, view, Kernel, ONE_THREAD};
    use crate::kernels::sources::MASTERS;

    fn range(l: &Layout) -> Result<(usize, usize)> {
        contiguous_range(l, "mixed precision")
    }

    fn config(n: usize) -> Result<(LaunchConfig, u32)> {
        grid_stride(n, u32::MAX as usize / 3, "mixed precision")
    }

    pub(super) fn nonfinite(state: &mut CudaStorage, l: &Layout, g: &CudaStorage, gl: &Layout) -> Result<()> {
        let dev = g.device().clone();
        let func = Kernel::load(&dev, &MASTERS, &name("masters_nonfinite", g.dtype()))?;
        let (cfg, n) = config(gl.shape().elem_count())?;
        let (start, end) = range(l)?;
        by_dtype!(g.dtype(), "the gradient check", T => {
            let gv = view::<T>(g, gl, "the gradient check")?;
            let mut sv = state.as_cuda_slice_mut::<f64>()?.slice_mut(start..end);
            let mut b = func.builder();
            b.arg(&gv).arg(&n).arg(&mut sv);
            // SAFETY: argument types and order match the kernel; g holds n elements, the state eight.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }

    pub(super) fn begin(state: &mut CudaStorage, l: &Layout, s: &Begin) -> Result<()> {
        let dev = state.device().clone();
        let func = Kernel::load(&dev, &MASTERS, "masters_begin")?;
        let (start, end) = range(l)?;
        let mut sv = state.as_cuda_slice_mut::<f64>()?.slice_mut(start..end);
        let mut b = func.builder();
        b.arg(&mut sv).arg(&s.beta1).arg(&s.beta2);
        // SAFETY: argument types and order match the kernel; the state holds eight f64.
        unsafe { func.launch(&mut b, ONE_THREAD) }
    }

    pub(super) fn end(state: &mut CudaStorage, l: &Layout, s: &End) -> Result<()> {
        let dev = state.device().clone();
        let func = Kernel::load(&dev, &MASTERS, "masters_end")?;
        let (start, end) = range(l)?;
        let mut sv = state.as_cuda_slice_mut::<f64>()?.slice_mut(start..end);
        let (dynamic, interval) = (s.dynamic as i32, s.interval as f64);
        let mut b = func.builder();
        b.arg(&mut sv).arg(&dynamic).arg(&interval);
        // SAFETY: argument types and order match the kernel; the state holds eight f64.
        unsafe { func.launch(&mut b, ONE_THREAD) }
    }

    /// One optimizer's pass: `kernel` over the f32 state `buf` from the gradient `g` and the step
    /// state, with the optimizer's scalars in the kernel's order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn update(
        kernel: &str,
        buf: &mut CudaStorage,
        l: &Layout,
        g: &CudaStorage,
        gl: &Layout,
        state: &CudaStorage,
        sl: &Layout,
        n: usize,
        scalars: &[f32],
    ) -> Result<()> {
        let dev = g.device().clone();
        let func = Kernel::load(&dev, &MASTERS, &name(kernel, g.dtype()))?;
        let (cfg, n) = config(n)?;
        let (start, end) = range(l)?;
        let sv = view::<f64>(state, sl, "the step state")?;
        by_dtype!(g.dtype(), "mixed precision", T => {
            let gv = view::<T>(g, gl, "mixed precision")?;
            let mut bv = buf.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
            let mut b = func.builder();
            b.arg(&gv).arg(&mut bv).arg(&n);
            for v in scalars {
                b.arg(v);
            }
            b.arg(&sv);
            // SAFETY: argument types and order match the kernel (the scalars are the optimizer's, in
            // its order); g holds n elements, the state buffer its parts × n (checked).
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }

    pub(super) fn copy(theta: &mut CudaStorage, l: &Layout, master: &CudaStorage, ml: &Layout) -> Result<()> {
        let dev = master.device().clone();
        let n = l.shape().elem_count();
        if ml.shape().elem_count() != n {
            bail!(
                "mixed precision: a master of {} elements for a working copy of {n}",
                ml.shape().elem_count()
            )
        }
        let func = Kernel::load(&dev, &MASTERS, &name("masters_copy", theta.dtype()))?;
        let (cfg, n) = config(n)?;
        let (start, end) = range(l)?;
        let mv = view::<f32>(master, ml, "the master weights")?;
        by_dtype!(theta.dtype(), "the working copy", T => {
            let mut tv = theta.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
            let mut b = func.builder();
            b.arg(&mut tv).arg(&mv).arg(&n);
            // SAFETY: argument types and order match the kernel; both hold n elements (checked).
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(())
        })
    }
}
