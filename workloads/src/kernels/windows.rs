//! Swin's windows: the cyclic shift of the feature map and its partition into w×w windows as one
//! gather, and the inverse (windows back into the map, shifted back) as the matching scatter. Each is
//! the other's backward pass.
//!
//! Why: as candle ops a shifted block rolls the map twice (a narrow and a cat per axis), permutes it
//! into windows (a strided copy) and undoes all three after attention: six full copies per block
//! forward, and the same again through candle's backward, each adding into a zeroed gradient; even
//! in Swin-T's inference those copies were a real cost (measured: docs/kernels.md#windows).
//!
//! Tokens are rows of c channels; a row moves as whole 16-, 8-, 4- or 2-byte words, whichever divides
//! both the row and the tensors' start, so the kernel neither knows nor cares about the dtype.

use candle_core::{Result, Tensor};

/// Swin's windows: x [b, side, side, c] rolled by -shift on both spatial axes (torch.roll), then
/// cut into windows [b · (side/window)², window², c]. Our gather on CUDA devices (its backward the
/// inverse scatter); candle's roll and permute elsewhere.
pub fn window_partition(x: &Tensor, window: usize, shift: usize) -> Result<Tensor> {
    let (b, side, _, c) = x.dims4()?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(cuda::Windows {
            side,
            window,
            shift,
            merge: false,
        });
    }
    let s = shift as i32;
    let x = if shift > 0 {
        x.roll(-s, 1)?.roll(-s, 2)?
    } else {
        x.clone()
    };
    let per_side = side / window;
    x.reshape((b, per_side, window, per_side, window, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b * per_side * per_side, window * window, c))
}

/// The inverse of [`window_partition`]: windows back into [b, side, side, c] maps, rolled back by
/// +shift.
pub fn window_merge(windows: &Tensor, side: usize, window: usize, shift: usize) -> Result<Tensor> {
    let (bw, _, c) = windows.dims3()?;
    #[cfg(feature = "cuda")]
    if windows.device().is_cuda() {
        return windows.contiguous()?.apply_op1(cuda::Windows {
            side,
            window,
            shift,
            merge: true,
        });
    }
    let per_side = side / window;
    let b = bw / (per_side * per_side);
    let x = windows
        .reshape((b, per_side, per_side, window, window, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, side, side, c))?;
    let s = shift as i32;
    if shift > 0 {
        x.roll(s, 1)?.roll(s, 2)
    } else {
        Ok(x)
    }
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

    use crate::kernels::launch::{by_dtype, view, word_elements, Kernel};

    /// Partition (`merge` false): x [b, side, side, c] rolled by -shift on both spatial axes, into
    /// windows [b · (side/window)², window², c]. Merge: the inverse.
    #[derive(Debug, Clone, Copy)]
    pub struct Windows {
        pub side: usize,
        pub window: usize,
        pub shift: usize,
        pub merge: bool,
    }

    impl Windows {
        /// (images, channels) of the input, checked against the geometry.
        fn geometry(&self, l: &Layout) -> Result<(usize, usize)> {
            let (side, w) = (self.side, self.window);
            if w == 0 || !side.is_multiple_of(w) || self.shift >= side {
                bail!(
                    "Swin windows: a {side}x{side} map in {w}x{w} windows shifted by {}",
                    self.shift
                )
            }
            let windows = (side / w).pow(2);
            let (b, c) = if self.merge {
                let (bw, t, c) = l.shape().dims3()?;
                if t != w * w || bw % windows != 0 {
                    bail!(
                        "Swin windows: {:?} is not windows of {w}x{w} tokens from {side}x{side} maps",
                        l.dims()
                    )
                }
                (bw / windows, c)
            } else {
                let (b, h, ww, c) = l.shape().dims4()?;
                if (h, ww) != (side, side) {
                    bail!("Swin windows: a map of {h}x{ww} where {side}x{side} was expected")
                }
                (b, c)
            };
            Ok((b, c))
        }

        fn out_shape(&self, b: usize, c: usize) -> Shape {
            let (side, w) = (self.side, self.window);
            if self.merge {
                Shape::from((b, side, side, c))
            } else {
                Shape::from((b * (side / w).pow(2), w * w, c))
            }
        }
    }

    impl CustomOp1 for Windows {
        fn name(&self) -> &'static str {
            "swin-windows"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the Swin windows kernel runs on CUDA devices only; the CPU rolls and permutes with candle's ops")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (b, c) = self.geometry(l)?;
            let rows = b * self.side * self.side;
            let Some((start, _)) = l.contiguous_offsets() else {
                bail!("the Swin windows kernel takes contiguous tensors")
            };
            let size = s.dtype().size_in_bytes();
            // The widest word dividing a row and the start (allocations themselves are 256-byte aligned).
            let word = word_elements(size, &[c, start]) * size;
            if word == 1 {
                bail!("the Swin windows kernel moves rows of whole 2-byte words, not {c} x {size} bytes")
            }
            let row_words = (c * size / word) as u32;
            let dev = s.device().clone();
            let kernel = format!("windows_w{word}");
            let func = Kernel::load(&dev, &crate::kernels::sources::WINDOWS, &kernel)?;
            let total = rows * row_words as usize;
            let cfg = LaunchConfig {
                grid_dim: (total.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (rows, side, w, shift, merge) = (
                rows as u64,
                self.side as i32,
                self.window as i32,
                self.shift as i32,
                self.merge as i32,
            );
            let out = by_dtype!(s.dtype(), "the Swin windows kernel", T => {
                let src = view::<T>(s, l, "the Swin windows kernel")?;
                // SAFETY: the kernel writes every row (a permutation of them).
                let out = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
                let mut b = func.builder();
                b.arg(&src).arg(&out).arg(&rows).arg(&row_words).arg(&side).arg(&w).arg(&shift).arg(&merge);
                // SAFETY: argument types and order match the kernel; both buffers hold rows · row_words
                // words of the chosen size, and the start is aligned to it.
                unsafe { func.launch(&mut b, cfg) }?;
                CudaStorage::wrap_cuda_slice(out, dev)
            });
            Ok((out, self.out_shape(b, c)))
        }

        fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            let inverse = Windows {
                merge: !self.merge,
                ..*self
            };
            Ok(Some(grad.contiguous()?.apply_op1(inverse)?))
        }
    }
}
