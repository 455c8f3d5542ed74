//! Mixed-precision training's optimizer passes (`masters.cu`): f32 master weights updated from the
//! half-precision gradients, the working copies written from them, and the dynamic loss scale.
//!
//! Why here and not in candle ops: each parameter's update is one pass over its gradient and its
//! f32 state ([m; v; master] for AdamW, [b; master] for SGD) that also writes its working copy,
//! where candle's elementwise ops would take a dozen, and on CUDA the parameters go in groups of up
//! to 96 a launch ([`update`], [`check_gradients`]); whether a step is skipped (an inf or a nan in an
//! f16 gradient) is decided on the device from a step state in device memory ([`MixedState`]), so a
//! training step still replays as one CUDA graph. The CPU loops (ops applied per parameter) are the
//! reference the kernels are tested against.

use candle_core::{bail, CpuStorage, DType, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

use super::adamw::AdamStep;
use super::cpu;

use super::defines::masters::at;

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

/// state[found] = 1 when the gradient holds an inf or a nan; in place on the state, from the gradient
/// (the CPU's check, per parameter).
#[derive(Debug, Clone, Copy)]
struct NonFinite;

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
    /// The op's name and its grouped kernel's base name.
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
    const KERNEL: &'static str = "masters_adamw_group";

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
    const KERNEL: &'static str = "masters_sgd_group";

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
/// Nothing changes on a skipped step (the CPU's update, per parameter).
#[derive(Debug, Clone, Copy)]
struct Masters<U>(U);

/// The working copy = the master, rounded to its dtype; in place on the working copy, from the master
/// (the CPU's, per parameter).
#[derive(Debug, Clone, Copy)]
struct WorkingCopy;

/// One parameter in a step: its f32 state (the optimizer's buffers, then the master), the gradient of
/// the scaled loss and the working copy, all contiguous; the gradient and the copy of one dtype.
pub struct Member<'a> {
    pub state: &'a Tensor,
    pub grad: &'a Tensor,
    pub theta: &'a Tensor,
}

/// state[found] = 1 when any gradient holds an inf or a nan.
pub fn check_gradients(grads: &[&Tensor], state: &MixedState) -> Result<()> {
    #[cfg(feature = "cuda")]
    if state.0.device().is_cuda() {
        return cuda::check(grads, &state.0);
    }
    for g in grads {
        state.0.inplace_op2(g, &NonFinite)?;
    }
    Ok(())
}

/// Every member's master updated by `u` and its working copy written from it, unless the step is
/// skipped (state[found] set).
pub fn update<U: Update>(u: U, members: &[Member], state: &MixedState) -> Result<()> {
    #[cfg(feature = "cuda")]
    if state.0.device().is_cuda() {
        return cuda::update(u, members, &state.0);
    }
    for m in members {
        m.state.inplace_op3(m.grad, &state.0, &Masters(u))?;
        let n = m.theta.elem_count();
        m.theta
            .inplace_op2(&m.state.narrow(0, U::BUFFERS * n, n)?, &WorkingCopy)?;
    }
    Ok(())
}

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
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

    use super::{Begin, End, Member, Update};
    use crate::kernels::launch::{by_dtype, contiguous_range, cuda as launch_cuda, name, view, Kernel, ONE_THREAD};
    use crate::kernels::sources::MASTERS;

    fn range(l: &Layout) -> Result<(usize, usize)> {
        contiguous_range(l, "mixed precision")
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

    use crate::kernels::defines::masters::{CHUNK, GROUP};

    /// `masters.cu`'s `struct Group`: field for field, in its order and C layout.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Group {
        g: [u64; GROUP],
        state: [u64; GROUP],
        theta: [u64; GROUP],
        n: [u32; GROUP],
        first: [u32; GROUP + 1],
        count: u32,
    }

    // SAFETY: plain data of the same layout as the kernels' parameter, copied by value at launch.
    unsafe impl DeviceRepr for Group {}

    /// The device address of a contiguous CUDA tensor's first element, and its element count.
    fn address(t: &Tensor, what: &str) -> Result<(u64, usize)> {
        let (s, l) = t.storage_and_layout();
        let cs = launch_cuda(&s, what)?;
        let (start, end) = contiguous_range(l, what)?;
        let stream = cs.device().cuda_stream();
        let base = by_dtype!(t.dtype(), what, T => cs.as_cuda_slice::<T>()?.device_ptr(&stream).0);
        Ok((base + (start * t.dtype().size_in_bytes()) as u64, end - start))
    }

    /// The members in groups of up to GROUP, with each group's grid. With `buffers` (an update),
    /// `buffers` f32 buffers of a member's size come before its master in its state (checked);
    /// without (the gradients' check), only the gradients are given. A group of members of no
    /// elements is left out.
    fn groups(members: &[Member], buffers: Option<usize>) -> Result<Vec<(Group, u32)>> {
        let mut out = Vec::new();
        for part in members.chunks(GROUP) {
            let mut grp = Group {
                g: [0; GROUP],
                state: [0; GROUP],
                theta: [0; GROUP],
                n: [0; GROUP],
                first: [0; GROUP + 1],
                count: part.len() as u32,
            };
            let mut blocks = 0usize;
            for (i, m) in part.iter().enumerate() {
                let (g, n) = address(m.grad, "a gradient")?;
                if let Some(buffers) = buffers {
                    let (state, len) = address(m.state, "an optimizer state")?;
                    let (theta, copies) = address(m.theta, "a working copy")?;
                    if m.state.dtype() != DType::F32 || m.grad.dtype() != m.theta.dtype() {
                        bail!(
                            "mixed precision: an f32 state and a gradient of the working copy's dtype, not {:?}, {:?} and {:?}",
                            m.state.dtype(),
                            m.grad.dtype(),
                            m.theta.dtype()
                        )
                    }
                    if len != (buffers + 1) * n || copies != n || len > u32::MAX as usize {
                        bail!("mixed precision: a state of {len} elements, a gradient of {n} and a working copy of {copies}")
                    }
                    grp.state[i] = state;
                    grp.theta[i] = theta;
                }
                grp.g[i] = g;
                grp.n[i] =
                    u32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("a gradient of {n} elements")))?;
                grp.first[i] = blocks as u32;
                blocks += n.div_ceil(CHUNK);
            }
            if blocks > i32::MAX as usize {
                bail!("mixed precision: {blocks} blocks of parameters are more than one launch takes")
            }
            grp.first[part.len()] = blocks as u32;
            if blocks > 0 {
                out.push((grp, blocks as u32));
            }
        }
        Ok(out)
    }

    fn config(blocks: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The dtype every member's gradient has (the kernels are per dtype).
    fn dtype(grads: impl Iterator<Item = DType>) -> Result<Option<DType>> {
        let mut seen = None;
        for d in grads {
            match seen {
                Some(s) if s != d => bail!("mixed precision: gradients of {s:?} and {d:?} in one step"),
                _ => seen = Some(d),
            }
        }
        Ok(seen)
    }

    fn device(state: &Tensor) -> Result<CudaDevice> {
        match state.device() {
            candle_core::Device::Cuda(d) => Ok(d.clone()),
            _ => bail!("mixed precision: a step state off the GPU"),
        }
    }

    pub(super) fn check(grads: &[&Tensor], state: &Tensor) -> Result<()> {
        // The check reads only the gradients (the state and copy are not given to the kernel).
        let members: Vec<Member> = grads
            .iter()
            .map(|g| Member {
                state: g,
                grad: g,
                theta: g,
            })
            .collect();
        launch_groups("masters_nonfinite_group", &members, None, &[], state)
    }

    pub(super) fn update<U: Update>(u: U, members: &[Member], state: &Tensor) -> Result<()> {
        launch_groups(U::KERNEL, members, Some(U::BUFFERS), &u.scalars(), state)
    }

    /// `kernel` over the members in groups (see `groups`: `buffers` for an update, none for the
    /// check), each launch given its group, the `scalars` and the step state, in the kernels' order.
    fn launch_groups(
        kernel: &str,
        members: &[Member],
        buffers: Option<usize>,
        scalars: &[f32],
        state: &Tensor,
    ) -> Result<()> {
        let Some(dt) = dtype(members.iter().map(|m| m.grad.dtype()))? else {
            return Ok(());
        };
        let (s, sl) = state.storage_and_layout();
        let sv = view::<f64>(launch_cuda(&s, "the step state")?, sl, "the step state")?;
        let func = Kernel::load(&device(state)?, &MASTERS, &name(kernel, dt))?;
        for (grp, blocks) in groups(members, buffers)? {
            let mut b = func.builder();
            b.arg(&grp);
            for v in scalars {
                b.arg(v);
            }
            b.arg(&sv);
            // SAFETY: argument types and order match the kernel (the scalars are the optimizer's, in
            // its order; the check takes none); every gradient holds n elements of the group's dtype,
            // and for an update every state its parts × n f32 and every working copy n elements
            // (checked in `groups`); the step state holds eight f64. An update writes the states and
            // the working copies through their addresses, the check only the state's flag: they
            // belong to the optimizer, and nothing else on the stream touches them during its
            // launches.
            unsafe { func.launch(&mut b, config(blocks)) }?;
        }
        Ok(())
    }
}
