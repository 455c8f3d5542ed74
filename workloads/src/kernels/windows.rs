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

/// Swin's patch merging gather: x [b, h, w, c] into [b, h/2, w/2, 4c], each 2x2 neighbourhood's
/// four tokens side by side in torchvision's order (x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2],
/// x[1::2, 1::2]). One pass forward and one backward, as one edge of the graph.
///
/// Why: as candle ops (eight narrows of a reshaped view, then a cat) the gather is a dozen edges, and
/// each narrow's backward pads its gradient with zeros to the whole map and adds it into another
/// zeroed one (measured: docs/kernels.md#windows).
pub fn merge_neighbours(x: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Neighbours { scatter: false })
}

/// The strided view of a contiguous [b, h, w, c] (from `start`) that reads as [b, h/2, w/2, 4c] in
/// [`merge_neighbours`]'s order: (image, row pair, column pair, column in pair, row in pair, channel).
fn neighbours_view(dims: &[usize], start: usize) -> Result<candle_core::Layout> {
    let &[b, h, w, c] = dims else {
        candle_core::bail!("patch merging takes [batch, height, width, channels], not {dims:?}")
    };
    if h % 2 != 0 || w % 2 != 0 {
        candle_core::bail!("patch merging halves the map: {h}x{w} is not even on both sides")
    }
    Ok(candle_core::Layout::new(
        candle_core::Shape::from(vec![b, h / 2, w / 2, 2, 2, c]),
        vec![h * w * c, 2 * w * c, 2 * c, c, w * c, 1],
        start,
    ))
}

/// [`merge_neighbours`] (`scatter` false) over a map of (b, h, w, c), or its inverse, the gradient
/// [b, h/2, w/2, 4c] scattered back into the map (CUDA devices; the CPU's backward permutes with
/// candle's ops).
#[derive(Debug, Clone, Copy)]
struct Neighbours {
    scatter: bool,
}

impl Neighbours {
    /// (b, h, w, c) of the map: the input's dims, or for the scatter the map its input came from.
    fn map(&self, l: &candle_core::Layout) -> Result<(usize, usize, usize, usize)> {
        let (b, h, w, c) = l.shape().dims4()?;
        if self.scatter {
            if c % 4 != 0 {
                candle_core::bail!("patch merging's scatter takes 4c channels, not {c}")
            }
            return Ok((b, 2 * h, 2 * w, c / 4));
        }
        neighbours_view(l.dims(), 0)?;
        Ok((b, h, w, c))
    }

    fn out_shape(&self, (b, h, w, c): (usize, usize, usize, usize)) -> candle_core::Shape {
        if self.scatter {
            candle_core::Shape::from((b, h, w, c))
        } else {
            candle_core::Shape::from((b, h / 2, w / 2, 4 * c))
        }
    }
}

impl candle_core::CustomOp1 for Neighbours {
    fn name(&self) -> &'static str {
        "patch-merging-gather"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        if self.scatter {
            candle_core::bail!("patch merging's scatter runs on CUDA devices only; the CPU permutes with candle's ops")
        }
        let Some((start, _)) = l.contiguous_offsets() else {
            candle_core::bail!("patch merging takes a contiguous map")
        };
        let view = neighbours_view(l.dims(), start)?;
        let out = self.out_shape(self.map(l)?);
        // SAFETY: the strided copy writes every element of the new storage.
        let mut dst = unsafe { s.device().alloc_uninit(&out, s.dtype())? };
        s.copy_strided_src(&mut dst, 0, &view)?;
        Ok((dst, out))
    }

    /// Whole 16-byte words of each token's row, one pass (candle's strided copy works out six
    /// indices per element, far below the memory's speed; measured: docs/kernels.md#windows).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let map = self.map(l)?;
        Ok((cuda::neighbours(s, l, map, self.scatter)?, self.out_shape(map)))
    }

    /// The scatter back: the gradient [b, h/2, w/2, 4c] read as (pair row, pair column, column in
    /// pair, row in pair) and copied into the map's order.
    fn bwd(&self, x: &Tensor, _: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if self.scatter {
            candle_core::bail!("patch merging's scatter is a backward pass: it has no backward of its own")
        }
        let (b, h, w, c) = x.dims4()?;
        #[cfg(feature = "cuda")]
        if grad.device().is_cuda() {
            return Ok(Some(
                grad.contiguous()?.apply_op1_no_bwd(&Neighbours { scatter: true })?,
            ));
        }
        let g = grad
            .reshape((b, h / 2, w / 2, 2, 2, c))?
            .permute((0, 1, 4, 2, 3, 5))?
            .contiguous()?
            .reshape((b, h, w, c))?;
        Ok(Some(g))
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
            let geometry = [self.side, self.window, self.shift, self.merge as usize];
            let out = move_rows("windows", s, l, c, rows, geometry, "the Swin windows kernel")?;
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

    /// Runs the row-moving kernel `name` (windows.cu: `windows`, `neighbours`) over contiguous s:
    /// `rows` rows of c elements, each moved as whole words of the widest size dividing the row
    /// and the start; `geometry` the kernel's four integers.
    fn move_rows(
        name: &str,
        s: &CudaStorage,
        l: &Layout,
        c: usize,
        rows: usize,
        geometry: [usize; 4],
        what: &str,
    ) -> Result<CudaStorage> {
        let Some((start, _)) = l.contiguous_offsets() else {
            bail!("{what} takes contiguous tensors")
        };
        let size = s.dtype().size_in_bytes();
        // The widest word dividing a row and the start (allocations themselves are 256-byte aligned).
        let word = word_elements(size, &[c, start]) * size;
        if word == 1 {
            bail!("{what} moves rows of whole 2-byte words, not {c} x {size} bytes")
        }
        let row_words = (c * size / word) as u32;
        let dev = s.device().clone();
        let func = Kernel::load(&dev, &crate::kernels::sources::WINDOWS, &format!("{name}_w{word}"))?;
        let total = rows * row_words as usize;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows = rows as u64;
        let [g0, g1, g2, g3] = geometry.map(|g| g as i32);
        Ok(by_dtype!(s.dtype(), what, T => {
            let src = view::<T>(s, l, what)?;
            // SAFETY: the kernel writes every row (a permutation of them).
            let out = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
            let mut b = func.builder();
            b.arg(&src).arg(&out).arg(&rows).arg(&row_words).arg(&g0).arg(&g1).arg(&g2).arg(&g3);
            // SAFETY: argument types and order match the kernel; both buffers hold rows · row_words
            // words of the chosen size, and the start is aligned to it.
            unsafe { func.launch(&mut b, cfg) }?;
            CudaStorage::wrap_cuda_slice(out, dev)
        }))
    }

    /// Patch merging's gather (`scatter` false: [b, h, w, c] into [b, h/2, w/2, 4c]) or its
    /// inverse, as one pass of whole words per token row.
    pub(super) fn neighbours(
        s: &CudaStorage,
        l: &Layout,
        (b, h, w, c): (usize, usize, usize, usize),
        scatter: bool,
    ) -> Result<CudaStorage> {
        move_rows(
            "neighbours",
            s,
            l,
            c,
            b * h * w,
            [h, w, 0, scatter as usize],
            "the patch merging kernel",
        )
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::merge_neighbours;

    /// The 2x2 gather as candle's ops: the reference.
    fn by_narrows(x: &Tensor) -> Tensor {
        let (b, h, w, c) = x.dims4().unwrap();
        let grid = x.reshape((b, h / 2, 2, w / 2, 2, c)).unwrap();
        let at = |dy: usize, dx: usize| {
            grid.narrow(2, dy, 1)
                .unwrap()
                .narrow(4, dx, 1)
                .unwrap()
                .reshape((b, h / 2, w / 2, c))
                .unwrap()
        };
        Tensor::cat(&[&at(0, 0), &at(1, 0), &at(0, 1), &at(1, 1)], 3).unwrap()
    }

    #[test]
    fn merging_neighbours_gathers_and_scatters_back_as_the_narrows_and_cat_do() {
        for (b, h, w, c) in [(2usize, 4usize, 6usize, 3usize), (1, 2, 2, 1), (3, 8, 4, 5)] {
            let n = b * h * w * c;
            let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let x = Var::from_vec(values, (b, h, w, c), &Device::Cpu).unwrap();
            let (ours, reference) = (merge_neighbours(x.as_tensor()).unwrap(), by_narrows(x.as_tensor()));
            assert_eq!(ours.dims(), [b, h / 2, w / 2, 4 * c]);
            // Distinct values: equal outputs are the same permutation.
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&ours), flat(&reference), "{b}x{h}x{w}x{c}");
            // Backward: a weight per output element, so each input's gradient names its slot.
            let weights = Tensor::arange(0f32, n as f32, &Device::Cpu)
                .unwrap()
                .reshape(ours.dims())
                .unwrap();
            let grad = |y: Tensor| {
                let g = (y * &weights).unwrap().sum_all().unwrap().backward().unwrap();
                flat(g.get(x.as_tensor()).unwrap())
            };
            assert_eq!(grad(ours), grad(reference), "{b}x{h}x{w}x{c} backward");
        }
    }

    #[test]
    fn merging_neighbours_names_an_odd_map() {
        let x = Tensor::zeros((1, 3, 4, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = merge_neighbours(&x).unwrap_err().to_string();
        assert!(e.contains("3x4") && e.contains("even"), "{e}");
    }
}
