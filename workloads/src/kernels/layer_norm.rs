//! Layer normalisation over the last axis as one differentiable op, with a kernel for its forward and
//! for its backward pass. (Attention's softmax is part of the attention op, `super::attention`.)
//!
//! Why: built from candle's primitives, a training step's layer norm is ~11 kernels forward and
//! ~25 backward, most of them candle's broadcasting binary kernels, which recompute a strided index
//! per element; with softmax's and batch norm's, those kernels were a large share of ViT-B/16's
//! training step. Here it is one pass over its rows forward, and backward one pass for the input's
//! gradient plus one for the weight's and bias's (per-block column sums, added up by candle).
//! (measured: docs/kernels.md#layer-norm)
//!
//! Statistics and sums are in f32 for f32/bf16/f16 (f64 for f64 on the CPU, which is where the
//! gradients are checked against finite differences); the CPU loops are the CUDA kernels' reference.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::cpu;

/// Layer normalisation over the last dimension (`torch.nn.LayerNorm`): our differentiable op,
/// except for inference on the CPU, where candle's fused kernel is faster than our reference loops.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    if !x.device().is_cuda() && !x.track_op() && !w.track_op() {
        return candle_nn::ops::layer_norm(&x, w, b, eps as f32);
    }
    x.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps })
}

/// Rows of a tensor seen as [rows, cols], cols its last dimension.
fn rows_cols(l: &Layout) -> Result<(usize, usize)> {
    let cols = *l
        .dims()
        .last()
        .ok_or_else(|| candle_core::Error::Msg("a row op on a scalar".into()))?;
    if cols == 0 {
        bail!("a row op on rows of length 0")
    }
    Ok((l.shape().elem_count() / cols, cols))
}

/// Layer normalisation over the last dimension with weight and bias, as `torch.nn.LayerNorm`:
/// y = (x - mean) / sqrt(var + eps) · w + b, var the biased variance.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    pub eps: f64,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(xl)?;
        let (x, w, b) = (cpu::values(xs, xl)?, cpu::values(ws, wl)?, cpu::values(bs, bl)?);
        check_params(cols, w.len(), b.len())?;
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let (mean, rstd) = row_stats(row, self.eps);
            y.extend(
                row.iter()
                    .zip(w.iter().zip(&b))
                    .map(|(x, (w, b))| (x - mean) * rstd * w + b),
            );
        }
        Ok((cpu::storage(y, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(xl)?;
        check_params(cols, wl.shape().elem_count(), bl.shape().elem_count())?;
        let out = cuda::layer_norm(
            cuda::LnArgs {
                x: (xs, xl),
                w: (ws, wl),
                third: (bs, bl),
                rows,
                cols,
                eps: self.eps,
            },
            cuda::LnPass::Forward,
        )?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let dx = x.apply_op3_no_bwd(
            w,
            &g,
            &LayerNormGrad {
                eps: self.eps,
                params: false,
            },
        )?;
        // [blocks, 2, cols] sums of g·x̂ and of g, one row pair per block of rows.
        let partial = super::elementwise::sum_leading(&x.apply_op3_no_bwd(
            w,
            &g,
            &LayerNormGrad {
                eps: self.eps,
                params: true,
            },
        )?)?;
        let dw = partial.get(0)?.to_dtype(w.dtype())?;
        let db = partial.get(1)?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

fn check_params(cols: usize, w: usize, b: usize) -> Result<()> {
    if w != cols || b != cols {
        bail!("layer norm over {cols} features with a weight of {w} and a bias of {b}")
    }
    Ok(())
}

/// (mean, 1 / sqrt(biased variance + eps)) of a row.
fn row_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The backward pass of [`LayerNorm`], on (x, w, g): with x̂ = (x - mean)·rstd and h = g·w,
/// dx = rstd (h - mean(h) - x̂ mean(h x̂)) per row; or, with `params`, the column sums of g·x̂ (dw)
/// and of g (db), as [blocks, 2, cols] per-block partial sums in the accumulation dtype.
#[derive(Debug, Clone, Copy)]
struct LayerNormGrad {
    eps: f64,
    params: bool,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(xl)?;
        let (x, w, g) = (cpu::values(xs, xl)?, cpu::values(ws, wl)?, cpu::values(gs, gl)?);
        let n = cols as f64;
        let mut dx = Vec::with_capacity(if self.params { 0 } else { x.len() });
        let mut sums = vec![0f64; 2 * cols];
        for (xr, gr) in x.chunks(cols).zip(g.chunks(cols)) {
            let (mean, rstd) = row_stats(xr, self.eps);
            let xhat = xr.iter().map(|x| (x - mean) * rstd);
            if self.params {
                for (j, (xh, g)) in xhat.zip(gr).enumerate() {
                    sums[j] += g * xh;
                    sums[cols + j] += g;
                }
                continue;
            }
            let xhat: Vec<f64> = xhat.collect();
            let h: Vec<f64> = gr.iter().zip(&w).map(|(g, w)| g * w).collect();
            let mean_h = h.iter().sum::<f64>() / n;
            let mean_hx = h.iter().zip(&xhat).map(|(h, x)| h * x).sum::<f64>() / n;
            dx.extend(h.iter().zip(&xhat).map(|(h, x)| rstd * (h - mean_h - x * mean_hx)));
        }
        if self.params {
            let acc = cpu::accumulation(xs.dtype());
            return Ok((cpu::storage(sums, acc)?, Shape::from((1, 2, cols))));
        }
        Ok((cpu::storage(dx, gs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(xl)?;
        let args = cuda::LnArgs {
            x: (xs, xl),
            w: (ws, wl),
            third: (gs, gl),
            rows,
            cols,
            eps: self.eps,
        };
        if self.params {
            let blocks = cuda::param_blocks(&args);
            Ok((
                cuda::layer_norm(args, cuda::LnPass::ParamSums { blocks })?,
                Shape::from((blocks, 2, cols)),
            ))
        } else {
            Ok((cuda::layer_norm(args, cuda::LnPass::InputGrad)?, xl.shape().clone()))
        }
    }
}

/// How the group-per-row kernels hold a row: `lanes` lanes (4 to 32) of `words` 16-byte words
/// each (the builds: 4 words over 4, 8, 16 or 32 lanes; 8 over 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Group {
    words: usize,
    lanes: usize,
}

/// The group for rows of `cols` elements of `size` bytes: the fewest lanes (at least 4) whose
/// four words each hold the row, else a warp of eight words each; None past 256 words.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn group_for(cols: usize, size: usize) -> Option<Group> {
    let words = (cols * size).div_ceil(16);
    match words {
        0 => None,
        1..=128 => Some(Group {
            words: 4,
            lanes: words.div_ceil(4).next_power_of_two().max(4),
        }),
        129..=256 => Some(Group { words: 8, lanes: 32 }),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
mod cuda {

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use super::{group_for, Group};
    use crate::kernels::launch::{by_dtype, name, view, whole_words, Kernel};

    use crate::kernels::defines::layer_norm::PER_THREAD as PER;

    fn rows_u32(rows: usize, cols: usize) -> Result<(u32, u32)> {
        if rows * cols > u32::MAX as usize {
            bail!("{rows} rows of {cols} is more than these kernels index")
        }
        Ok((rows as u32, cols as u32))
    }

    pub(super) struct LnArgs<'a> {
        pub x: (&'a CudaStorage, &'a Layout),
        pub w: (&'a CudaStorage, &'a Layout),
        /// b forward, g backward.
        pub third: (&'a CudaStorage, &'a Layout),
        pub rows: usize,
        pub cols: usize,
        pub eps: f64,
    }

    pub(super) enum LnPass {
        Forward,
        InputGrad,
        ParamSums { blocks: usize },
    }

    /// Blocks of the parameter-gradient pass: enough to fill the GPU, few enough that adding up
    /// their partial sums is cheap. The group-per-row kernel's blocks take eight warps' worth of
    /// rows at once, and 64 rows or more each, so that its partial sums stay far smaller than the
    /// rows they sum.
    pub(super) fn param_blocks(a: &LnArgs) -> usize {
        if sums_group(a).is_some() {
            a.rows.div_ceil(64).clamp(1, 256)
        } else {
            a.rows.clamp(1, 512)
        }
    }

    /// The group the parameter sums take, where their group-per-row kernel (built for rows of up to
    /// 4 words a lane) suits; None: the block-per-row one.
    fn sums_group(a: &LnArgs) -> Option<Group> {
        row_group(a).filter(|g| g.words == 4)
    }

    /// The group-per-row kernel's group, when the rows and tensors suit it: whole words per row,
    /// every tensor starting on a word.
    fn row_group(a: &LnArgs) -> Option<Group> {
        let size = a.x.0.dtype().size_in_bytes();
        let counts = [
            a.cols,
            a.x.1.start_offset(),
            a.w.1.start_offset(),
            a.third.1.start_offset(),
        ];
        whole_words(size, &counts).then(|| group_for(a.cols, size)).flatten()
    }

    pub(super) fn layer_norm(a: LnArgs, pass: LnPass) -> Result<CudaStorage> {
        let Some(threads) = crate::kernels::nvrtc::row_threads(a.cols, PER) else {
            bail!(
                "layer norm over {} features: the kernel takes at most {}",
                a.cols,
                PER * 1024
            )
        };
        let dev = a.x.0.device().clone();
        let (rows, cols) = rows_u32(a.rows, a.cols)?;
        // Rows that fit a group of lanes' registers take the group-per-row kernel (the
        // block-per-row one spends two block barriers per row, which held BERT-base's bf16 rows
        // of 768 to a low bandwidth; measured: docs/kernels.md#layer-norm).
        let sums = matches!(pass, LnPass::ParamSums { .. });
        let warp = match pass {
            LnPass::ParamSums { .. } => sums_group(&a),
            _ => row_group(&a),
        };
        let kernel = match warp {
            Some(g) if sums => name(&format!("layer_norm_w4_g{}_sums", g.lanes), a.x.0.dtype()),
            Some(g) => name(&format!("layer_norm_w{}_g{}", g.words, g.lanes), a.x.0.dtype()),
            None => name("layer_norm", a.x.0.dtype()),
        };
        let (code, blocks) = match pass {
            LnPass::Forward => (0i32, rows.clamp(1, 1 << 20)),
            LnPass::InputGrad => (1, rows.clamp(1, 1 << 20)),
            LnPass::ParamSums { blocks } => (2, blocks as u32),
        };
        let eps = a.eps as f32;
        let cfg = match warp {
            // Each block's groups take their share of the rows and leave the block's sums.
            Some(_) if sums => LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            // Eight warps per block, 32 / lanes rows a warp.
            Some(g) => LaunchConfig {
                grid_dim: (rows.div_ceil(8 * (32 / g.lanes) as u32).clamp(1, 1 << 20), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            None => LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
        };
        let func = Kernel::load(&dev, &crate::kernels::sources::LAYER_NORM, &kernel)?;
        by_dtype!(a.x.0.dtype(), "layer norm", T => {
            let x = view::<T>(a.x.0, a.x.1, "layer norm")?;
            let w = view::<T>(a.w.0, a.w.1, "layer norm")?;
            let third = view::<T>(a.third.0, a.third.1, "layer norm")?;
            macro_rules! go {
                ($out:expr) => {{
                    let out = $out;
                    let mut b = func.builder();
                    if sums && warp.is_some() {
                        b.arg(&x).arg(&third).arg(&out).arg(&rows).arg(&cols).arg(&eps);
                    } else {
                        b.arg(&x).arg(&w).arg(&third).arg(&out).arg(&rows).arg(&cols).arg(&eps).arg(&code);
                    }
                    // SAFETY: argument types and order match the kernel; x and the third hold rows x
                    // cols, w cols, and out what the pass writes.
                    unsafe { func.launch(&mut b, cfg) }?;
                    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
                }};
            }
            match pass {
                // SAFETY (both): the kernel writes every element.
                LnPass::ParamSums { blocks } => go!(unsafe { dev.alloc::<f32>(blocks * 2 * a.cols)? }),
                _ => go!(unsafe { dev.alloc::<T>(a.rows * a.cols)? }),
            }
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

    #[test]
    fn layer_norm_has_exact_gradients_for_input_weight_and_bias() -> Result<()> {
        let (rows, cols) = (3, 7);
        let t = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu);
        let (x, w, b) = (
            t(values(rows * cols, 3), &[rows, cols])?,
            t(values(cols, 4), &[cols])?,
            t(values(cols, 5), &[cols])?,
        );
        let op = LayerNorm { eps: 1e-5 };
        check_gradient(|x| x.apply_op3(&w, &b, op), &[rows, cols], 6)?;
        // The weight's and bias's gradients, each with the other inputs fixed.
        let at = |v: &Tensor, which: usize| -> Result<Tensor> {
            match which {
                0 => x.apply_op3(v, &b, op),
                _ => x.apply_op3(&w, v, op),
            }
        };
        check_gradient(|v| at(v, 0), &[cols], 4)?;
        check_gradient(|v| at(v, 1), &[cols], 5)
    }

    #[test]
    fn rows_take_the_fewest_lanes_whose_four_words_hold_them() {
        let g = |cols: usize, size: usize| group_for(cols, size).map(|g| (g.words, g.lanes));
        // Swin-T's rows in bf16 (12, 24, 48 and 96 words), ViT's and BERT's 768, a merging's 1536.
        assert_eq!(g(96, 2), Some((4, 4)));
        assert_eq!(g(192, 2), Some((4, 8)));
        assert_eq!(g(384, 2), Some((4, 16)));
        assert_eq!(g(768, 2), Some((4, 32)));
        assert_eq!(g(1536, 2), Some((8, 32)));
        assert_eq!(g(96, 4), Some((4, 8)));
        assert_eq!(g(8, 2), Some((4, 4)));
        // Past a warp of eight words: the block-per-row kernel.
        assert_eq!(g(2049, 8), None);
        assert_eq!(g(0, 2), None);
        for cols in (8..=2048).step_by(8) {
            let Some(Group { words, lanes }) = group_for(cols, 2) else {
                panic!("{cols}")
            };
            assert!(
                words * lanes * 8 >= cols && (lanes == 4 || (lanes / 2) * words * 8 < cols),
                "{cols}"
            );
        }
    }

    #[test]
    fn rows_of_length_zero_are_refused() {
        let x = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).unwrap();
        let none = Tensor::zeros(0, DType::F32, &Device::Cpu).unwrap();
        let err = x
            .apply_op3(&none, &none, LayerNorm { eps: 1e-5 })
            .unwrap_err()
            .to_string();
        assert!(err.contains("length 0"), "{err}");
    }
}
