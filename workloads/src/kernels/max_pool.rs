//! Max pooling over NCHW with padding (ResNet's 3×3 stride-2 pool), differentiable: one pass
//! forward, one pass backward.
//!
//! Why: candle's pooling has no backward for kernel != stride and no padding, so the CPU path builds
//! the pool from nine strided views and `maximum`, whose backward is three kernels per view over the
//! whole stem activation (ResNet-50 at batch 32: [32, 64, 112, 112]), on strided indexing.
//!
//! Forward keeps, per output, the first maximum of its window in row-major order (as PyTorch does;
//! padding never wins). Backward gathers: each input cell adds the gradients of the windows whose
//! maximum it is, found again by the same scan, so no atomics and no index tensor are needed.

use candle_core::{Result, Tensor};

/// 2-D max pooling with padding, built from strided views and `maximum` so that gradients flow.
///
/// candle's `max_pool2d_with_stride` has no backward when kernel != stride (ResNet's 3x3/2 pool) and
/// takes no padding. Padding uses -inf, as PyTorch does, so a padded cell never wins.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if h + 2 * padding < kernel || w + 2 * padding < kernel {
        candle_core::bail!("max_pool2d: kernel {kernel} larger than the padded {h}x{w} input")
    }
    // CUDA: one pass each way (`cuda::MaxPool`).
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(cuda::MaxPool {
            kernel,
            stride,
            padding,
            channels_last: false,
        });
    }
    if !x.track_op() {
        // Inference: pad, then candle's pooling kernel (one pass; it has no backward for kernel !=
        // stride, which is why training takes the strided views below).
        return pad(x, (padding, padding), (padding, padding), f32::NEG_INFINITY)?
            .max_pool2d_with_stride(kernel, stride);
    }
    let (oh, ow) = (
        (h + 2 * padding - kernel) / stride + 1,
        (w + 2 * padding - kernel) / stride + 1,
    );
    // Pad bottom/right further so that every window offset can take `out * stride` rows, which the
    // strided view needs; the extra rows are never among the selected ones.
    let bottom = kernel - 1 + oh * stride - h - padding;
    let right = kernel - 1 + ow * stride - w - padding;
    let x = pad(x, (padding, bottom), (padding, right), f32::NEG_INFINITY)?;
    let mut out: Option<Tensor> = None;
    for i in 0..kernel {
        let rows = strided(&x, 2, i, oh, stride)?;
        for j in 0..kernel {
            let window = strided(&rows, 3, j, ow, stride)?;
            out = Some(match out {
                None => window,
                Some(acc) => acc.maximum(&window)?,
            });
        }
    }
    Ok(out.expect("kernel >= 1"))
}

/// Max pooling over NHWC ([n, h, w, c]), as ResNet's NHWC path needs: the same windows, the same
/// first-maximum rule and the same gathering backward as [`max_pool2d`], read channel-contiguous.
#[cfg(feature = "cuda")]
pub fn max_pool2d_nhwc(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    x.contiguous()?.apply_op1(cuda::MaxPool {
        kernel,
        stride,
        padding,
        channels_last: true,
    })
}

/// `count` elements of dimension `dim`, starting at `start`, every `stride`-th one: a narrow followed by
/// a reshape that splits the stride off, since candle has no strided slicing.
fn strided(x: &Tensor, dim: usize, start: usize, count: usize, stride: usize) -> Result<Tensor> {
    let x = x.narrow(dim, start, count * stride)?;
    if stride == 1 {
        return Ok(x);
    }
    let mut shape = x.dims().to_vec();
    shape[dim] = count;
    shape.insert(dim + 1, stride);
    x.reshape(shape)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// Pads the last two dimensions of an NCHW tensor with a constant: (top, bottom) and (left, right).
fn pad(x: &Tensor, (top, bottom): (usize, usize), (left, right): (usize, usize), value: f32) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let fill = |rows: usize, cols: usize| -> Result<Tensor> {
        Tensor::full(value, (b, c, rows, cols), x.device())?.to_dtype(x.dtype())
    };
    // candle's cat does not take empty pieces, so zero-width sides are left out.
    let around = |before: Tensor, mid: &Tensor, after: Tensor, dim: usize| -> Result<Tensor> {
        let parts: Vec<&Tensor> = [&before, mid, &after]
            .into_iter()
            .filter(|t| t.dim(dim).unwrap_or(0) > 0)
            .collect();
        Tensor::cat(&parts, dim)
    };
    let x = around(fill(h, left)?, x, fill(h, right)?, 3)?;
    let w = w + left + right;
    around(fill(top, w)?, &x, fill(bottom, w)?, 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Direct max-pool with -inf padding, the definition the fast path must match.
    fn reference(x: &[f32], h: usize, w: usize, k: usize, s: usize, p: usize) -> Vec<f32> {
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        let mut out = Vec::new();
        for oy in 0..oh {
            for ox in 0..ow {
                let mut m = f32::NEG_INFINITY;
                for dy in 0..k {
                    for dx in 0..k {
                        let (y, xx) = ((oy * s + dy) as isize - p as isize, (ox * s + dx) as isize - p as isize);
                        if y >= 0 && xx >= 0 && (y as usize) < h && (xx as usize) < w {
                            m = m.max(x[y as usize * w + xx as usize]);
                        }
                    }
                }
                out.push(m);
            }
        }
        out
    }

    #[test]
    fn matches_direct_definition_on_odd_and_even_sizes() -> Result<()> {
        for &(h, w) in &[(7usize, 7usize), (8, 8), (5, 6), (112, 112)] {
            let vals: Vec<f32> = (0..h * w).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
            let x = Tensor::from_vec(vals.clone(), (1, 1, h, w), &Device::Cpu)?;
            // Both paths: the pooling kernel (no graph) and the strided views (a variable).
            let got = max_pool2d(&x, 3, 2, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, reference(&vals, h, w, 3, 2, 1), "{h}x{w}");
            let var = Var::from_tensor(&x)?;
            let got = max_pool2d(var.as_tensor(), 3, 2, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, reference(&vals, h, w, 3, 2, 1), "{h}x{w} (differentiable path)");
        }
        Ok(())
    }

    #[test]
    fn gradient_goes_to_each_window_maximum() -> Result<()> {
        // 4x4 input, 3x3/2 pool with padding 1 -> 2x2 output; each output's max is a distinct cell.
        let vals: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Var::from_tensor(&Tensor::from_vec(vals, (1, 1, 4, 4), &Device::Cpu)?)?;
        let y = max_pool2d(x.as_tensor(), 3, 2, 1)?;
        assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, vec![5., 7., 13., 15.]);
        let grads = y.sum_all()?.backward()?;
        let g = grads
            .get(x.as_tensor())
            .expect("gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut want = vec![0f32; 16];
        for i in [5, 7, 13, 15] {
            want[i] = 1.0;
        }
        assert_eq!(g, want);
        Ok(())
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

    use crate::kernels::launch::{
        by_dtype, cuda as saved_storage, name, view, word_elements, Kernel, U32_STRIDE_ELEMENTS,
    };

    /// A k×k window moving by `stride`, the input padded by `padding` on every side.
    #[derive(Debug, Clone, Copy)]
    pub struct MaxPool {
        pub kernel: usize,
        pub stride: usize,
        pub padding: usize,
        /// The input is NHWC rather than NCHW.
        pub channels_last: bool,
    }

    impl MaxPool {
        /// (n, c, h, w) of the input, in its layout.
        fn dims(&self, l: &Layout) -> Result<(usize, usize, usize, usize)> {
            let (a, b, c, d) = l.shape().dims4()?;
            Ok(if self.channels_last { (a, d, b, c) } else { (a, b, c, d) })
        }

        /// (planes, h, w, oh, ow) of the input.
        fn geometry(&self, l: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
            let (n, c, h, w) = self.dims(l)?;
            let (k, s, p) = (self.kernel, self.stride, self.padding);
            if k == 0 || s == 0 || p >= k || h + 2 * p < k || w + 2 * p < k {
                bail!("max pool {k}x{k} stride {s} padding {p} over a {h}x{w} input")
            }
            Ok((n * c, h, w, (h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1))
        }

        fn launch(&self, x: (&CudaStorage, &Layout), g: Option<(&CudaStorage, &Layout)>) -> Result<CudaStorage> {
            let (planes, h, w, oh, ow) = self.geometry(x.1)?;
            // The NHWC kernel keeps its grid-stride index in 32 bits; the NCHW one indexes planes of
            // h·w in 32 bits.
            if planes * (h * w).max(oh * ow) > U32_STRIDE_ELEMENTS {
                bail!("max pool over {planes} planes of {h}x{w} is more than this kernel indexes")
            }
            let dev = x.0.device().clone();
            let (images, channels, _, _) = self.dims(x.1)?;
            // Over NHWC a thread takes a word of v channels: the widest that the channel count and
            // every view's start divide into whole.
            let (v, kernel) = if self.channels_last {
                let counts = [Some(channels), Some(x.1.start_offset()), g.map(|g| g.1.start_offset())];
                let v = word_elements(
                    x.0.dtype().size_in_bytes(),
                    &counts.into_iter().flatten().collect::<Vec<_>>(),
                );
                (v, format!("{}_v{v}", name("max_pool_nhwc", x.0.dtype())))
            } else {
                (1, name("max_pool", x.0.dtype()))
            };
            let func = Kernel::load(&dev, &crate::kernels::sources::MAX_POOL, &kernel)?;
            let n = planes * if g.is_some() { h * w } else { oh * ow };
            let threads = (n / v) as u32;
            let cfg = LaunchConfig {
                grid_dim: (threads.div_ceil(256).clamp(1, 1 << 20), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let [h, w, oh, ow, k, s, p, cl] =
                [h, w, oh, ow, self.kernel, self.stride, self.padding, channels].map(|v| v as i32);
            // NCHW counts planes, NHWC images (each of cl channels).
            let count = if self.channels_last { images } else { planes } as u32;
            by_dtype!(x.0.dtype(), "max pool", T => {
                let xv = view::<T>(x.0, x.1, "max pool")?;
                let gv = match g { Some((gs, gl)) => Some(view::<T>(gs, gl, "max pool's gradient")?), None => None };
                let null = 0u64;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(n)? };
                let mut b = func.builder();
                b.arg(&xv);
                match &gv { Some(v) => b.arg(v), None => b.arg(&null) };
                b.arg(&out).arg(&count).arg(&h).arg(&w).arg(&oh).arg(&ow).arg(&k).arg(&s).arg(&p);
                if self.channels_last {
                    b.arg(&cl);
                }
                // SAFETY: argument types and order match the kernel; x holds planes·h·w, g planes·oh·ow,
                // each view starting on a word of v elements when over NHWC.
                unsafe { func.launch(&mut b, cfg) }?;
                Ok(CudaStorage::wrap_cuda_slice(out, dev))
            })
        }
    }

    impl CustomOp1 for MaxPool {
        fn name(&self) -> &'static str {
            "max-pool"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the max-pool kernel runs on CUDA devices only; the CPU builds the pool from strided views")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, c, _, _) = self.dims(l)?;
            let (_, _, _, oh, ow) = self.geometry(l)?;
            let shape = if self.channels_last {
                Shape::from((n, oh, ow, c))
            } else {
                Shape::from((n, c, oh, ow))
            };
            Ok((self.launch((s, l), None)?, shape))
        }

        fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&MaxPoolGrad {
                pool: *self,
                x: x.clone(),
            })?))
        }
    }

    /// The backward pass, applied to the output's gradient, holding the forward's input.
    #[derive(Debug, Clone)]
    struct MaxPoolGrad {
        pool: MaxPool,
        x: Tensor,
    }

    impl CustomOp1 for MaxPoolGrad {
        fn name(&self) -> &'static str {
            "max-pool-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the max-pool kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (xs, xl) = self.x.storage_and_layout();
            let x = saved_storage(&xs, "max pool's backward")?;
            let (n, c, _, _) = self.pool.dims(xl)?;
            let (_, _, _, oh, ow) = self.pool.geometry(xl)?;
            let want = if self.pool.channels_last {
                [n, oh, ow, c]
            } else {
                [n, c, oh, ow]
            };
            if gl.dims() != want {
                bail!(
                    "max pool's backward: a gradient of shape {:?} for an output of {want:?}",
                    gl.dims()
                )
            }
            Ok((self.pool.launch((x, xl), Some((g, gl)))?, xl.shape().clone()))
        }
    }
}
