//! Batch normalisation with batch statistics (training), then ReLU when asked: one pass for the
//! statistics, one for the normalisation, and backward one for the per-channel sums and one for the
//! input's gradient. Over NCHW, or over channels-last tensors (NHWC: ResNet's path on cuDNN's NHWC
//! engines), which are NCHW with the images' pixels as the batch and 1x1 maps: one CPU reference
//! serves both, and the CUDA kernels read a channels-last tensor as rows of channels.
//!
//! Why: built from candle's primitives, one training-mode batch norm is ~20 kernels forward and
//! ~40 backward over the whole activation (casts to f32, three mean passes, broadcasting binary
//! kernels that recompute a strided index per element); ResNet-50 has 53 of them, and its bf16
//! training step ran far behind PyTorch's (measured: docs/kernels.md#batch-norm).
//!
//! The ops: [`BatchStats`] gives each channel's mean and biased variance (no gradient: the backward
//! formula of [`BatchNorm`] accounts for them), [`BatchNorm`] normalises with them. Statistics and
//! sums are f32 (f64 for f64 tensors on the CPU); the CPU loops are the CUDA kernels' reference.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, InplaceOp2, Layout, Result, Shape, Tensor};

use super::cpu;

/// (n, c, h·w) of an NCHW layout (any rank >= 2: the dimensions after the channels are flattened);
/// of a channels-last one, (n·h·w, c, 1): the same normalisation, each pixel an image of 1x1.
fn nchw(l: &Layout, channels_last: bool) -> Result<(usize, usize, usize)> {
    let d = l.dims();
    if d.len() < 2 {
        bail!("batch norm over an input of shape {d:?}: it needs [batch, channels, ...] or [batch, ..., channels]")
    }
    if channels_last {
        let c = d[d.len() - 1];
        return Ok((l.shape().elem_count() / c.max(1), c, 1));
    }
    Ok((d[0], d[1], d[2..].iter().product()))
}

/// Each channel's [mean; biased variance] over batch and space, as [2, c] in the accumulation dtype.
#[derive(Debug, Clone, Copy)]
pub struct BatchStats {
    /// The channels are the last dimension (NHWC), not the second (NCHW).
    pub channels_last: bool,
}

impl BatchStats {
    pub const NCHW: Self = Self { channels_last: false };
    pub const NHWC: Self = Self { channels_last: true };
}

impl CustomOp1 for BatchStats {
    fn name(&self) -> &'static str {
        "batch-stats"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = nchw(l, self.channels_last)?;
        let x = cpu::values(s, l)?;
        let mut stats = vec![0f64; 2 * c];
        let count = (n * hw) as f64;
        for ch in 0..c {
            let values = || (0..n).flat_map(|i| x[(i * c + ch) * hw..(i * c + ch + 1) * hw].iter());
            let mean = values().sum::<f64>() / count;
            stats[ch] = mean;
            stats[c + ch] = values().map(|v| (v - mean) * (v - mean)).sum::<f64>() / count;
        }
        Ok((cpu::storage(stats, cpu::accumulation(s.dtype()))?, Shape::from((2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, hw) = nchw(l, self.channels_last)?;
        Ok((cuda::stats(s, l, (n, c, hw))?, Shape::from((2, c))))
    }
}

/// The running statistics a training step's [`BatchStatsUpdating`] moves towards the batch's:
/// mean ← keep · mean + take_mean · batch mean, var ← keep · var + take_var · batch variance
/// (f32 tensors of [c], updated in place).
#[derive(Debug, Clone)]
pub struct Running {
    pub mean: Tensor,
    pub var: Tensor,
    pub keep: f64,
    pub take_mean: f64,
    pub take_var: f64,
}

/// [`BatchStats`] with the running statistics updated in the same finishing pass, on CUDA devices
/// (the CPU takes [`BatchStats`] then [`RunningUpdate`], the reference for both).
///
/// Why: a launch per running statistic, two for every batch norm of a training step, was a visible
/// part of ResNet-50's step (measured: docs/kernels.md#batch-norm).
#[derive(Debug, Clone)]
pub struct BatchStatsUpdating {
    pub channels_last: bool,
    pub running: Running,
}

impl CustomOp1 for BatchStatsUpdating {
    fn name(&self) -> &'static str {
        "batch-stats-updating"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the batch statistics that update the running ones in one pass run on CUDA devices only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, hw) = nchw(l, self.channels_last)?;
        Ok((
            cuda::stats_updating(s, l, (n, c, hw), &self.running)?,
            Shape::from((2, c)),
        ))
    }
}

/// y = (x - mean) / sqrt(var + eps) · w + b per channel (then ReLU), on (x, [w; b] as [2, c],
/// [mean; var] as [2, c] from [`BatchStats`] of this x).
#[derive(Debug, Clone, Copy)]
pub struct BatchNorm {
    pub eps: f64,
    pub relu: bool,
    /// The channels are the last dimension (NHWC), not the second (NCHW).
    pub channels_last: bool,
}

/// Per channel (a, s) with y = x·a + s: a = w·rstd, s = b - mean·a; and rstd.
fn affine(wb: &[f64], stats: &[f64], c: usize, eps: f64) -> Vec<(f64, f64, f64)> {
    (0..c)
        .map(|ch| {
            let rstd = 1.0 / (stats[c + ch] + eps).sqrt();
            let a = wb[ch] * rstd;
            (a, wb[c + ch] - stats[ch] * a, rstd)
        })
        .collect()
}

impl CustomOp3 for BatchNorm {
    fn name(&self) -> &'static str {
        "batch-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        wbs: &CpuStorage,
        wbl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, c, hw) = nchw(xl, self.channels_last)?;
        check(c, wbl, sl)?;
        let (x, wb, stats) = (cpu::values(xs, xl)?, cpu::values(wbs, wbl)?, cpu::values(ss, sl)?);
        let ch = affine(&wb, &stats, c, self.eps);
        let y = x
            .chunks(hw)
            .enumerate()
            .flat_map(|(plane, p)| {
                let (a, s, _) = ch[plane % c];
                p.iter().map(move |v| v * a + s)
            })
            .map(|v| if self.relu { v.max(0.0) } else { v })
            .collect();
        Ok((cpu::storage(y, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        wbs: &candle_core::CudaStorage,
        wbl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (n, c, hw) = nchw(xl, self.channels_last)?;
        check(c, wbl, sl)?;
        let (wl, bl) = (wbl.narrow(0, 0, 1)?, wbl.narrow(0, 1, 1)?);
        let saved = cuda::Saved {
            x: (xs, xl),
            w: (wbs, &wl),
            b: (wbs, &bl),
            stats: (ss, sl),
            res: None,
            residual: None,
            sums: None,
        };
        Ok((
            cuda::planes(&saved, None, (n, c, hw), self.eps, self.relu)?,
            xl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        wb: &Tensor,
        stats: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dwb) = self.backward(x, &wb.get(0)?, &wb.get(1)?, stats, y, grad)?;
        Ok((Some(dx), Some(dwb), None))
    }
}

impl BatchNorm {
    /// The forward pass over x with the weight w and bias b ([c] each) as two tensors, and
    /// `residual` (of x's shape) added before the ReLU: what a caller that runs batch norm outside
    /// candle's graph (residual blocks as one op) calls, with no [weight; bias] stacked every step
    /// and no pass of its own for the shortcut's add.
    pub fn forward_with(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        stats: &Tensor,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        x.apply_op1_no_bwd(&self.normalize(w, b, stats, residual))
    }

    /// [`Self::forward_with`] as an op over x, for a caller that runs it into a storage of its
    /// own (the storage a custom op hands candle).
    pub fn normalize(&self, w: &Tensor, b: &Tensor, stats: &Tensor, residual: Option<&Tensor>) -> Normalize {
        Normalize {
            op: *self,
            w: w.clone(),
            b: b.clone(),
            stats: stats.clone(),
            residual: residual.cloned(),
        }
    }

    /// The backward pass from the output's gradient: (dx, [dw; db] as [2, c] in w's dtype).
    pub fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        stats: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let saved = BatchNormGrad {
            eps: self.eps,
            relu: self.relu,
            channels_last: self.channels_last,
            x: x.clone(),
            y: y.clone(),
            w: w.clone(),
            b: b.clone(),
            stats: stats.clone(),
            sums: None,
        };
        // [Σ g'·x̂; Σ g'] per channel, g' the gradient through the ReLU: the weight's and bias's
        // gradients, and what the input's needs.
        let sums = grad.apply_op1_no_bwd(&saved)?;
        let dx = grad.apply_op1_no_bwd(&BatchNormGrad {
            sums: Some(sums.clone()),
            ..saved
        })?;
        Ok((dx, sums.to_dtype(w.dtype())?))
    }
}

/// [`BatchNorm`]'s forward pass over x, holding w, b, the statistics and the residual (see
/// [`BatchNorm::forward_with`]).
#[derive(Debug, Clone)]
pub struct Normalize {
    op: BatchNorm,
    w: Tensor,
    b: Tensor,
    stats: Tensor,
    residual: Option<Tensor>,
}

impl CustomOp1 for Normalize {
    fn name(&self) -> &'static str {
        "batch-norm-with"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let wb = Tensor::stack(&[&self.w, &self.b], 0)?;
        let (wbs, wbl) = wb.storage_and_layout();
        let (ss, sl) = self.stats.storage_and_layout();
        let (candle_core::Storage::Cpu(wbs), candle_core::Storage::Cpu(ss)) = (&*wbs, &*ss) else {
            bail!("batch norm: x is on the CPU, its parameters or statistics are not")
        };
        let Some(z) = &self.residual else {
            return self.op.cpu_fwd(xs, xl, wbs, wbl, ss, sl);
        };
        // Normalised without the ReLU in f64 (rounded once, at the end, as the kernels do), the
        // residual added, then the ReLU.
        let plain = BatchNorm { relu: false, ..self.op };
        let x64 = cpu::storage(cpu::values(xs, xl)?, candle_core::DType::F64)?;
        let (y, shape) = plain.cpu_fwd(&x64, &Layout::contiguous(xl.shape().clone()), wbs, wbl, ss, sl)?;
        let (zs, zl) = z.storage_and_layout();
        let candle_core::Storage::Cpu(zs) = &*zs else {
            bail!("batch norm: x is on the CPU, the residual is not")
        };
        if zl.shape() != &shape {
            bail!("batch norm: a residual of shape {:?} for {:?}", zl.dims(), shape.dims())
        }
        let sum = cpu::values(&y, &Layout::contiguous(shape.clone()))?
            .into_iter()
            .zip(cpu::values(zs, zl)?)
            .map(|(v, z)| if self.op.relu { (v + z).max(0.0) } else { v + z })
            .collect();
        Ok((cpu::storage(sum, xs.dtype())?, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, xs: &candle_core::CudaStorage, xl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::launch::cuda as storage;
        let what = "batch norm";
        let (n, c, hw) = nchw(xl, self.op.channels_last)?;
        let (w, wl) = self.w.storage_and_layout();
        let (b, bl) = self.b.storage_and_layout();
        let (st, stl) = self.stats.storage_and_layout();
        check_parts(c, wl, bl, stl)?;
        let dtypes = [&self.w, &self.b].into_iter().chain(&self.residual).map(|t| t.dtype());
        if let Some(other) = dtypes.into_iter().find(|&d| d != xs.dtype()) {
            bail!(
                "batch norm over {:?}: its weight, bias and residual must be {0:?} too, not {other:?}",
                xs.dtype()
            )
        }
        let z = self.residual.as_ref().map(|z| z.storage_and_layout());
        let residual = match &z {
            Some((_, zl)) if zl.shape() != xl.shape() => {
                bail!("batch norm: a residual of shape {:?} for {:?}", zl.dims(), xl.dims())
            }
            Some((zs, zl)) => Some((storage(zs, what)?, *zl)),
            None => None,
        };
        let saved = cuda::Saved {
            x: (xs, xl),
            w: (storage(&w, what)?, wl),
            b: (storage(&b, what)?, bl),
            stats: (storage(&st, what)?, stl),
            res: None,
            residual,
            sums: None,
        };
        Ok((
            cuda::planes(&saved, None, (n, c, hw), self.op.eps, self.op.relu)?,
            xl.shape().clone(),
        ))
    }
}

/// running ← keep · running + take · stats[row], in place on one running statistic ([c], f32) from
/// the batch's [mean; variance] ([2, c]): PyTorch's momentum update, on the CPU (CUDA devices update
/// both statistics in [`BatchStatsUpdating`]'s pass).
#[derive(Debug, Clone, Copy)]
pub struct RunningUpdate {
    pub row: usize,
    pub keep: f64,
    pub take: f64,
}

impl RunningUpdate {
    fn channels(&self, l: &Layout, sl: &Layout) -> Result<usize> {
        let c = l.shape().elem_count();
        if sl.dims() != [2, c] || self.row > 1 {
            bail!(
                "running statistics of {c} channels from batch statistics of shape {:?}",
                sl.dims()
            )
        }
        Ok(c)
    }
}

impl InplaceOp2 for RunningUpdate {
    fn name(&self) -> &'static str {
        "batch-norm-running-update"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, l: &Layout, ss: &CpuStorage, sl: &Layout) -> Result<()> {
        let c = self.channels(l, sl)?;
        let stats = cpu::values(ss, sl)?;
        let stat = &stats[self.row * c..(self.row + 1) * c];
        cpu::update(dst, l, |r| {
            r.iter().zip(stat).map(|(r, s)| self.keep * r + self.take * s).collect()
        })
    }
}

/// w and b of c elements each, statistics [2, c].
#[cfg(feature = "cuda")]
fn check_parts(c: usize, wl: &Layout, bl: &Layout, sl: &Layout) -> Result<()> {
    if wl.shape().elem_count() != c || bl.shape().elem_count() != c || sl.dims() != [2, c] {
        bail!(
            "batch norm over {c} channels with a weight of shape {:?}, a bias of {:?} and statistics of {:?}",
            wl.dims(),
            bl.dims(),
            sl.dims()
        )
    }
    Ok(())
}

fn check(c: usize, wbl: &Layout, sl: &Layout) -> Result<()> {
    if wbl.dims() != [2, c] || sl.dims() != [2, c] {
        bail!(
            "batch norm over {c} channels with [weight; bias] of shape {:?} and statistics of {:?}",
            wbl.dims(),
            sl.dims()
        )
    }
    Ok(())
}

/// The backward pass of [`BatchNorm`], applied to the output's gradient g, holding what the forward
/// saw. With g' = g where y > 0 (ReLU) or g, and x̂ = (x - mean)·rstd:
/// without `sums`, [Σ g'·x̂; Σ g'] per channel as [2, c] (accumulation dtype);
/// with them, dx = w·rstd·(g' - Σ g'/m - x̂·Σ g'x̂/m), m = n·h·w.
#[derive(Debug, Clone)]
struct BatchNormGrad {
    eps: f64,
    relu: bool,
    channels_last: bool,
    x: Tensor,
    y: Tensor,
    w: Tensor,
    b: Tensor,
    stats: Tensor,
    sums: Option<Tensor>,
}

impl BatchNormGrad {
    fn cpu_values(t: &Tensor) -> Result<Vec<f64>> {
        let (s, l) = t.storage_and_layout();
        match &*s {
            candle_core::Storage::Cpu(s) => cpu::values(s, l),
            _ => bail!("batch norm's backward: a saved tensor is not on the CPU"),
        }
    }
}

impl CustomOp1 for BatchNormGrad {
    fn name(&self) -> &'static str {
        "batch-norm-grad"
    }

    fn cpu_fwd(&self, gs: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, c, hw) = nchw(gl, self.channels_last)?;
        let g = cpu::values(gs, gl)?;
        let (x, y) = (Self::cpu_values(&self.x)?, Self::cpu_values(&self.y)?);
        let wb = [Self::cpu_values(&self.w)?, Self::cpu_values(&self.b)?].concat();
        let stats = Self::cpu_values(&self.stats)?;
        let ch = affine(&wb, &stats, c, self.eps);
        let gp = |i: usize| if self.relu && y[i] <= 0.0 { 0.0 } else { g[i] };
        let xhat = |i: usize, plane: usize| (x[i] - stats[plane % c]) * ch[plane % c].2;
        let Some(sums) = &self.sums else {
            let mut sums = vec![0f64; 2 * c];
            for i in 0..g.len() {
                let plane = i / hw;
                sums[plane % c] += gp(i) * xhat(i, plane);
                sums[c + plane % c] += gp(i);
            }
            return Ok((cpu::storage(sums, cpu::accumulation(gs.dtype()))?, Shape::from((2, c))));
        };
        let sums = Self::cpu_values(sums)?;
        let m = (n * hw) as f64;
        let dx = (0..g.len())
            .map(|i| {
                let (plane, k) = (i / hw, (i / hw) % c);
                wb[k] * ch[k].2 * (gp(i) - sums[c + k] / m - xhat(i, plane) * sums[k] / m)
            })
            .collect();
        Ok((cpu::storage(dx, gs.dtype())?, gl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, gs: &candle_core::CudaStorage, gl: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::launch::cuda as storage;
        let what = "batch norm's backward";
        let (n, c, hw) = nchw(gl, self.channels_last)?;
        let (x, xl) = self.x.storage_and_layout();
        let (y, yl) = self.y.storage_and_layout();
        let (w, wl) = self.w.storage_and_layout();
        let (b, bl) = self.b.storage_and_layout();
        let (st, stl) = self.stats.storage_and_layout();
        check_parts(c, wl, bl, stl)?;
        let sums = self.sums.as_ref().map(|t| t.storage_and_layout());
        let saved = cuda::Saved {
            x: (storage(&x, what)?, xl),
            w: (storage(&w, what)?, wl),
            b: (storage(&b, what)?, bl),
            stats: (storage(&st, what)?, stl),
            res: self.relu.then_some((storage(&y, what)?, yl)),
            residual: None,
            sums: match &sums {
                Some((s, l)) => Some((storage(s, what)?, *l)),
                None => None,
            },
        };
        match self.sums {
            None => Ok((
                cuda::grad_sums(&saved, (gs, gl), (n, c, hw), self.eps)?,
                Shape::from((2, c)),
            )),
            Some(_) => Ok((
                cuda::planes(&saved, Some((gs, gl)), (n, c, hw), self.eps, self.relu)?,
                gl.shape().clone(),
            )),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use crate::kernels::launch::{by_dtype, name, view, word_elements, Kernel};

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    /// What the forward pass saw, for the kernels of both passes.
    pub(super) struct Saved<'a> {
        pub x: Arg<'a>,
        /// The affine map's weight and bias, [c] each (rows of one [2, c] tensor, or two tensors).
        pub w: Arg<'a>,
        pub b: Arg<'a>,
        pub stats: Arg<'a>,
        /// The output, when a ReLU followed (its gradient passes where the output is > 0).
        pub res: Option<Arg<'a>>,
        /// In the forward pass, a tensor of x's shape added before the ReLU (a residual block's
        /// shortcut).
        pub residual: Option<Arg<'a>>,
        pub sums: Option<Arg<'a>>,
    }

    fn dims(n: usize, c: usize, hw: usize) -> Result<(u32, u32, u32)> {
        if n * c * hw > u32::MAX as usize {
            bail!("batch norm over {n}x{c}x{hw} is more than these kernels index")
        }
        Ok((n as u32, c as u32, hw as u32))
    }

    fn f32_view<'a>(a: Arg<'a>) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, f32>> {
        view::<f32>(a.0, a.1, "batch norm's statistics")
    }

    /// [mean; var] per channel.
    pub(super) fn stats(x: &CudaStorage, l: &Layout, (n, c, hw): (usize, usize, usize)) -> Result<CudaStorage> {
        channel_sums((x, l), None, None, None, (n, c, hw), 0.0, None)
    }

    /// [mean; var] per channel, the running statistics moved towards them in the same pass.
    pub(super) fn stats_updating(
        x: &CudaStorage,
        l: &Layout,
        (n, c, hw): (usize, usize, usize),
        running: &super::Running,
    ) -> Result<CudaStorage> {
        let what = "batch norm's running statistics";
        let (mean, ml) = running.mean.storage_and_layout();
        let (var, vl) = running.var.storage_and_layout();
        for l in [ml, vl] {
            if l.shape().elem_count() != c || !l.is_contiguous() {
                bail!("{what}: {c} contiguous values expected, not a layout {l:?}")
            }
        }
        let stream = x.device().cuda_stream();
        let mean = f32_view((crate::kernels::launch::cuda(&mean, what)?, ml))?;
        let var = f32_view((crate::kernels::launch::cuda(&var, what)?, vl))?;
        // The addresses the finishing kernel writes, their guards held across its launch. Nothing
        // else writes the running statistics: they are buffers of the model that only this op of
        // the step's forward pass updates.
        let (mean_ptr, _mean_guard) = mean.device_ptr(&stream);
        let (var_ptr, _var_guard) = var.device_ptr(&stream);
        let update = RunningPtrs {
            mean: mean_ptr,
            var: var_ptr,
            keep: running.keep as f32,
            take_mean: running.take_mean as f32,
            take_var: running.take_var as f32,
        };
        channel_sums((x, l), None, None, None, (n, c, hw), 0.0, Some(update))
    }

    /// Where the forward pass's finishing kernel writes the running statistics, and their momentum.
    struct RunningPtrs {
        mean: u64,
        var: u64,
        keep: f32,
        take_mean: f32,
        take_var: f32,
    }

    /// [Σ g'·x̂; Σ g'] per channel.
    pub(super) fn grad_sums(s: &Saved, g: Arg, (n, c, hw): (usize, usize, usize), eps: f64) -> Result<CudaStorage> {
        channel_sums(s.x, Some(g), s.res, Some(s.stats), (n, c, hw), eps, None)
    }

    /// Elements per word for the plane-wise kernels: the widest word (up to 16 bytes) that a plane of
    /// `hw` elements and every view's start divide into whole. 14x14 planes take 8-byte words in
    /// bf16; 7x7 ones single elements.
    fn plane_word(dtype: candle_core::DType, starts: &[Option<&Layout>], hw: u32) -> usize {
        let counts: Vec<usize> = starts
            .iter()
            .flatten()
            .map(|l| l.start_offset())
            .chain([hw as usize])
            .collect();
        word_elements(dtype.size_in_bytes(), &counts)
    }

    /// Blocks the channel sums aim for: a few per SM on current GPUs, so that layers with few
    /// channels still fill the GPU (docs/kernels.md#batch-norm).
    const SUM_BLOCKS: u32 = 512;

    /// Each channel's sums over batch and space (see `BatchStats` and `BatchNormGrad`), as partial
    /// sums over chunks then one finishing pass: per plane of NCHW, or over rows of channels where
    /// the maps are 1x1 (channels-last tensors, one row a pixel).
    fn channel_sums(
        (x, xl): Arg,
        g: Option<Arg>,
        y: Option<Arg>,
        stats: Option<Arg>,
        (n, c, hw): (usize, usize, usize),
        eps: f64,
        running: Option<RunningPtrs>,
    ) -> Result<CudaStorage> {
        let dev = x.device().clone();
        let (n, c, hw) = dims(n, c, hw)?;
        let rows = hw == 1;
        let starts = [Some(xl), g.map(|a| a.1), y.map(|a| a.1)];
        // Words of v elements along a plane, or across a row's channels.
        let v = plane_word(x.dtype(), &starts, if rows { c } else { hw });
        let partials = format!(
            "{}_v{v}",
            name(if rows { "bn_rows_partials" } else { "bn_partials" }, x.dtype())
        );
        let partials_fn = Kernel::load(&dev, &crate::kernels::sources::BATCH_NORM, &partials)?;
        let finish_fn = Kernel::load(
            &dev,
            &crate::kernels::sources::BATCH_NORM,
            &name("bn_finish", x.dtype()),
        )?;
        // The partial sums' launch, and the chunks of images (rows) they split each channel into, of
        // `per` images (rows) each, the last one fewer.
        let (cfg, per, chunks) = if rows {
            // 256 threads a block (the kernel's shared memory is sized for that): as many lanes
            // across as a row has words, up to 32, the rest down the rows.
            let words = c / v as u32;
            let lx = words.next_power_of_two().min(32);
            let ly = 256 / lx;
            let across = words.div_ceil(lx);
            let wanted = SUM_BLOCKS.div_ceil(across).clamp(1, n.div_ceil(ly).max(1));
            let per = n.div_ceil(wanted).max(1);
            let chunks = n.div_ceil(per).max(1);
            (
                LaunchConfig {
                    grid_dim: (across, chunks, 1),
                    block_dim: (lx, ly, 1),
                    shared_mem_bytes: 0,
                },
                per,
                chunks,
            )
        } else {
            // Chunks of images per channel, so that channels × chunks is about SUM_BLOCKS.
            let wanted = SUM_BLOCKS.div_ceil(c).clamp(1, n.max(1));
            let per = n.div_ceil(wanted).max(1);
            let chunks = n.div_ceil(per).max(1);
            let threads = (per * (hw / v as u32)).next_power_of_two().clamp(64, 256);
            (
                LaunchConfig {
                    grid_dim: (c, chunks, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                },
                per,
                chunks,
            )
        };
        let pass = g.is_some() as i32;
        let eps = eps as f32;
        by_dtype!(x.dtype(), "batch norm", T => {
            let xv = view::<T>(x, xl, "batch norm")?;
            // Absent pointers are passed as x (the kernel reads g and y only in the backward pass,
            // and y only when not null: a null is passed as a 0 u64).
            let gv = match g { Some((s, l)) => view::<T>(s, l, "batch norm")?, None => view::<T>(x, xl, "batch norm")? };
            let yv = match y { Some((s, l)) => Some(view::<T>(s, l, "batch norm")?), None => None };
            // SAFETY: each (channel, chunk) block writes its two partial sums, and the finishing
            // kernel both values of every channel.
            let partial = unsafe { dev.alloc::<f32>(2 * (chunks * c) as usize)? };
            let out = unsafe { dev.alloc::<f32>(2 * c as usize)? };
            let st = match stats { Some(a) => f32_view(a)?, None => out.slice(0..) };
            let null = 0u64;
            let mut b = partials_fn.builder();
            b.arg(&xv).arg(&gv);
            match &yv { Some(v) => b.arg(v), None => b.arg(&null) };
            b.arg(&st).arg(&partial).arg(&n).arg(&c);
            if !rows {
                b.arg(&hw);
            }
            b.arg(&eps).arg(&pass).arg(&per);
            // SAFETY: argument types and order match the kernel; x, g, y hold n·c·hw elements from
            // word-aligned starts (v checked above), stats 2·c, partial 2·chunks·c; a rows block
            // has 256 threads.
            unsafe { partials_fn.launch(&mut b, cfg) }?;
            // 32 channels a block, FINISH_LY (16) lanes down the chunks.
            let cfg = LaunchConfig { grid_dim: (c.div_ceil(32), 1, 1), block_dim: (32, 16, 1), shared_mem_bytes: 0 };
            let mut b = finish_fn.builder();
            b.arg(&xv).arg(&partial).arg(&out).arg(&chunks).arg(&n).arg(&c).arg(&hw).arg(&pass);
            let none = RunningPtrs { mean: 0, var: 0, keep: 0.0, take_mean: 0.0, take_var: 0.0 };
            let r = running.as_ref().unwrap_or(&none);
            b.arg(&r.mean).arg(&r.var).arg(&r.keep).arg(&r.take_mean).arg(&r.take_var);
            // SAFETY: argument types and order match the kernel (rows as its images of one element
            // each); partial holds 2·chunks·c, out 2·c, the running statistics c each or are null.
            unsafe { finish_fn.launch(&mut b, cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        })
    }

    /// The forward normalisation (g None) or the input's gradient: per plane of NCHW, or over rows
    /// of channels where the maps are 1x1 (channels-last tensors, one row a pixel).
    pub(super) fn planes(
        s: &Saved,
        g: Option<Arg>,
        (n, c, hw): (usize, usize, usize),
        eps: f64,
        relu: bool,
    ) -> Result<CudaStorage> {
        let x = s.x.0;
        let dev = x.device().clone();
        let (n, c, hw) = dims(n, c, hw)?;
        let rows = hw == 1;
        // Words of v elements along a plane, or across a row's channels.
        // The forward pass reads the residual where the backward reads the output (the kernels'
        // y), never both.
        let y = if g.is_some() { s.res } else { s.residual };
        let v = plane_word(
            x.dtype(),
            &[Some(s.x.1), g.map(|a| a.1), y.map(|a| a.1)],
            if rows { c } else { hw },
        );
        let kernel = format!("{}_v{v}", name(if rows { "bn_rows" } else { "bn_planes" }, x.dtype()));
        let func = Kernel::load(&dev, &crate::kernels::sources::BATCH_NORM, &kernel)?;
        let (eps, relu, planes) = (eps as f32, relu as i32, n * c);
        by_dtype!(x.dtype(), "batch norm", T => {
            let xv = view::<T>(x, s.x.1, "batch norm")?;
            let (w, bias) = (view::<T>(s.w.0, s.w.1, "batch norm")?, view::<T>(s.b.0, s.b.1, "batch norm")?);
            let stats = f32_view(s.stats)?;
            let gv = match g { Some((gs, gl)) => Some(view::<T>(gs, gl, "batch norm")?), None => None };
            let yv = match y { Some((ys, yl)) => Some(view::<T>(ys, yl, "batch norm")?), None => None };
            let sums = match s.sums { Some(a) => Some(f32_view(a)?), None => None };
            let null = 0u64;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(planes as usize * hw as usize)? };
            let cfg = if rows {
                // A grid-stride loop over the words: a few blocks per SM is enough for a
                // bandwidth-bound pass, and with 256·1024 threads a thread's stride covers whole
                // rows for power-of-two c.
                let words = planes as u64 / v as u64;
                LaunchConfig { grid_dim: (words.div_ceil(256).clamp(1, 1024) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
            } else {
                // Small planes (7x7) get small blocks rather than idle threads.
                let words = hw / v as u32;
                let threads = words.next_power_of_two().clamp(32, 256);
                LaunchConfig { grid_dim: (words.div_ceil(threads).clamp(1, 1024), planes.clamp(1, 65535), 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
            };
            let mut b = func.builder();
            b.arg(&xv);
            match &gv { Some(v) => b.arg(v), None => b.arg(&null) };
            // The output is read for the ReLU's gradient only when training through a ReLU; the
            // residual only in the forward pass.
            match &yv { Some(v) => b.arg(v), None => b.arg(&null) };
            b.arg(&w).arg(&bias).arg(&stats);
            match &sums { Some(v) => b.arg(v), None => b.arg(&null) };
            b.arg(&out);
            if rows {
                b.arg(&n).arg(&c);
            } else {
                b.arg(&planes).arg(&c).arg(&hw);
            }
            b.arg(&eps).arg(&relu);
            // SAFETY: argument types and order match the kernel (absent pointers are null and not
            // read); x, g, y, out hold n·c·hw elements from word-aligned starts, w and b c, stats
            // and sums 2·c.
            unsafe { func.launch(&mut b, cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::tests::check_gradient;
    use candle_core::{DType, Device};

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = crate::init::Rng::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    /// Training-mode batch norm of x with [w; b], the statistics of x itself.
    fn train(x: &Tensor, wb: &Tensor, relu: bool) -> Result<Tensor> {
        let stats = x.detach().apply_op1_no_bwd(&BatchStats::NCHW)?;
        x.apply_op3(
            wb,
            &stats,
            BatchNorm {
                eps: 1e-5,
                relu,
                channels_last: false,
            },
        )
    }

    #[test]
    fn statistics_are_the_biased_mean_and_variance_per_channel() -> Result<()> {
        // Channel 0 holds 1, 2 (image 0) and 3, 6 (image 1): mean 3, biased variance 3.5.
        let x = Tensor::new(&[1f32, 2., 10., 10., 3., 6., 10., 10.], &Device::Cpu)?.reshape((2, 2, 2))?;
        let s = x.apply_op1_no_bwd(&BatchStats::NCHW)?.to_vec2::<f32>()?;
        assert_eq!(s, vec![vec![3.0, 10.0], vec![3.5, 0.0]]);
        Ok(())
    }

    #[test]
    fn batch_norm_has_exact_gradients_with_and_without_relu() -> Result<()> {
        let shape = [3usize, 2, 2, 3];
        let wb = Tensor::from_vec(values(4, 7), (2, 2), &Device::Cpu)?;
        for relu in [false, true] {
            // Through x (the statistics included) and through [w; b].
            check_gradient(|x| train(x, &wb, relu), &shape, 8)?;
            let x = Tensor::from_vec(values(shape.iter().product(), 9), &shape, &Device::Cpu)?;
            check_gradient(|wb| train(&x, wb, relu), &[2, 2], 7)?;
        }
        Ok(())
    }

    #[test]
    fn relu_variant_is_batch_norm_then_relu() -> Result<()> {
        let x = Tensor::from_vec(values(24, 10), (2, 3, 2, 2), &Device::Cpu)?.to_dtype(DType::F32)?;
        let wb = Tensor::from_vec(values(6, 11), (2, 3), &Device::Cpu)?.to_dtype(DType::F32)?;
        let plain = train(&x, &wb, false)?.relu()?.flatten_all()?.to_vec1::<f32>()?;
        let fused = train(&x, &wb, true)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(plain, fused);
        Ok(())
    }

    #[test]
    fn a_residual_is_added_after_the_normalisation_and_before_the_relu() -> Result<()> {
        let x = Tensor::from_vec(values(24, 12), (2, 3, 2, 2), &Device::Cpu)?;
        let z = Tensor::from_vec(values(24, 13), (2, 3, 2, 2), &Device::Cpu)?;
        let (w, b) = (
            Tensor::from_vec(values(3, 14), 3, &Device::Cpu)?,
            Tensor::from_vec(values(3, 15), 3, &Device::Cpu)?,
        );
        let stats = x.apply_op1_no_bwd(&BatchStats::NCHW)?;
        let op = |relu| BatchNorm {
            eps: 1e-5,
            relu,
            channels_last: false,
        };
        let composed = (op(false).forward_with(&x, &w, &b, &stats, None)? + &z)?.relu()?;
        let fused = op(true).forward_with(&x, &w, &b, &stats, Some(&z))?;
        let e = (composed - &fused)?.abs()?.max_all()?.to_scalar::<f64>()?;
        assert!(e < 1e-12, "differs by {e}");
        // Some sums are cut by the ReLU, some are not.
        let kept = fused.gt(0.0)?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        assert!(kept > 0.0 && kept < 24.0, "{kept} of 24 kept");
        let wrong = Tensor::zeros((2, 3, 2), DType::F64, &Device::Cpu)?;
        let e = op(true)
            .forward_with(&x, &w, &b, &stats, Some(&wrong))
            .unwrap_err()
            .to_string();
        assert!(e.contains("residual of shape"), "{e}");
        Ok(())
    }
}
