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
        let saved = cuda::Saved {
            x: (xs, xl),
            wb: (wbs, wbl),
            stats: (ss, sl),
            res: None,
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
        let grad = grad.contiguous()?;
        let saved = BatchNormGrad {
            eps: self.eps,
            relu: self.relu,
            channels_last: self.channels_last,
            x: x.clone(),
            y: y.clone(),
            wb: wb.clone(),
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
        Ok((Some(dx), Some(sums.to_dtype(wb.dtype())?), None))
    }
}

/// running ← keep · running + take · stats[row], in place on one running statistic ([c], f32) from
/// the batch's [mean; variance] ([2, c]): PyTorch's momentum update in one launch (as candle ops it
/// was four kernels and a copy per statistic, for every batch norm of the model; counted:
/// docs/kernels.md#batch-norm).
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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        l: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        let c = self.channels(l, sl)?;
        cuda::running_update(dst, l, (ss, sl), c, self)
    }
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
    wb: Tensor,
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
        let (wb, stats) = (Self::cpu_values(&self.wb)?, Self::cpu_values(&self.stats)?);
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
        let (wb, wbl) = self.wb.storage_and_layout();
        let (st, stl) = self.stats.storage_and_layout();
        let sums = self.sums.as_ref().map(|t| t.storage_and_layout());
        let saved = cuda::Saved {
            x: (storage(&x, what)?, xl),
            wb: (storage(&wb, what)?, wbl),
            stats: (storage(&st, what)?, stl),
            res: self.relu.then_some((storage(&y, what)?, yl)),
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
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use crate::kernels::launch::{by_dtype, name, view, word_elements, Kernel};

    /// One running statistic updated in place from row `u.row` of the batch's statistics.
    pub(super) fn running_update(
        dst: &mut CudaStorage,
        l: &Layout,
        stats: Arg,
        c: usize,
        u: &super::RunningUpdate,
    ) -> Result<()> {
        let dev = dst.device().clone();
        let func = Kernel::load(&dev, &crate::kernels::sources::BATCH_NORM, "bn_running")?;
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("running statistics must be contiguous")
        };
        let stat = f32_view(stats)?.slice(u.row * c..(u.row + 1) * c);
        let mut running = dst.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
        let (c32, keep, take) = (c as u32, u.keep as f32, u.take as f32);
        let cfg = LaunchConfig {
            grid_dim: ((c32.div_ceil(256)).max(1), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&mut running).arg(&stat).arg(&c32).arg(&keep).arg(&take);
        // SAFETY: argument types and order match the kernel; both views hold c f32 values.
        unsafe { func.launch(&mut b, cfg) }?;
        Ok(())
    }

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    /// What the forward pass saw, for the kernels of both passes.
    pub(super) struct Saved<'a> {
        pub x: Arg<'a>,
        pub wb: Arg<'a>,
        pub stats: Arg<'a>,
        /// The output, when a ReLU followed (its gradient passes where the output is > 0).
        pub res: Option<Arg<'a>>,
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
        channel_sums(x, l, None, None, None, (n, c, hw), 0.0)
    }

    /// [Σ g'·x̂; Σ g'] per channel.
    pub(super) fn grad_sums(s: &Saved, g: Arg, (n, c, hw): (usize, usize, usize), eps: f64) -> Result<CudaStorage> {
        channel_sums(s.x.0, s.x.1, Some(g), s.res, Some(s.stats), (n, c, hw), eps)
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
        x: &CudaStorage,
        xl: &Layout,
        g: Option<Arg>,
        y: Option<Arg>,
        stats: Option<Arg>,
        (n, c, hw): (usize, usize, usize),
        eps: f64,
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
            // SAFETY: argument types and order match the kernel (rows as its images of one element
            // each); partial holds 2·chunks·c, out 2·c.
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
        // Words of v elements along a plane, or across a row's channels (the planes kernel also
        // reads [weight; bias] by words).
        let v = if rows {
            plane_word(x.dtype(), &[Some(s.x.1), g.map(|a| a.1), s.res.map(|a| a.1)], c)
        } else {
            plane_word(
                x.dtype(),
                &[Some(s.x.1), Some(s.wb.1), g.map(|a| a.1), s.res.map(|a| a.1)],
                hw,
            )
        };
        let kernel = format!("{}_v{v}", name(if rows { "bn_rows" } else { "bn_planes" }, x.dtype()));
        let func = Kernel::load(&dev, &crate::kernels::sources::BATCH_NORM, &kernel)?;
        let (eps, relu, planes) = (eps as f32, relu as i32, n * c);
        by_dtype!(x.dtype(), "batch norm", T => {
            let xv = view::<T>(x, s.x.1, "batch norm")?;
            let wb = view::<T>(s.wb.0, s.wb.1, "batch norm")?;
            let stats = f32_view(s.stats)?;
            let gv = match g { Some((gs, gl)) => Some(view::<T>(gs, gl, "batch norm")?), None => None };
            let yv = match s.res { Some((ys, yl)) => Some(view::<T>(ys, yl, "batch norm")?), None => None };
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
            // The output is read for the ReLU's gradient only when training through a ReLU.
            match (&gv, &yv) { (Some(_), Some(v)) => b.arg(v), _ => b.arg(&null) };
            b.arg(&wb).arg(&stats);
            match &sums { Some(v) => b.arg(v), None => b.arg(&null) };
            b.arg(&out);
            if rows {
                b.arg(&n).arg(&c);
            } else {
                b.arg(&planes).arg(&c).arg(&hw);
            }
            b.arg(&eps).arg(&relu);
            // SAFETY: argument types and order match the kernel (absent pointers are null and not
            // read); x, g, y, out hold n·c·hw elements from word-aligned starts, wb, stats, sums 2·c.
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
}
