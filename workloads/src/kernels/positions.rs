//! Ops over activations laid out [n, p, c] (images or sequences, positions, channels): the mean over
//! the positions (ResNet's and Swin's global average pool, [`global_average_pool`]), the first position (BERT's and ViT's
//! class token), and images and filters moved to channels last and back (ResNet's NHWC path), as
//! one kernel each way on CUDA devices.
//!
//! Why: candle's mean, narrow and permute copy upload their dims and strides, which candle keeps on
//! the device for CUDA graphs, and the first step leaves those small buffers among its freed
//! activations, holding whole chunks of the memory pool (measured: docs/kernels.md#loss). Here the
//! dims go by value. Elsewhere (the CPU) candle's ops are the reference.

use candle_core::{Result, Tensor};

/// [n, p, c] → [n, c], the mean over the p positions (accumulated in f32).
pub fn mean_over_positions(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(cuda::Positions::Mean);
    }
    x.mean(1)
}

/// [n, p, c] → [n, c], the first position's channels.
pub fn first_position(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(cuda::Positions::First);
    }
    x.narrow(1, 0, 1)?.squeeze(1)?.contiguous()
}

/// A channels-last map [n, h, w, c] → [n, c], the mean over its h·w positions: the global average
/// pool.
pub fn global_average_pool(x: &Tensor) -> Result<Tensor> {
    let (n, h, w, c) = x.dims4()?;
    mean_over_positions(&x.reshape((n, h * w, c))?)
}

/// Images [n, c, h, w] → [n, h, w, c], contiguous (also a KCRS filter → KRSC). No gradient flows
/// back through the kernel (it moves input images and filters of ops with their own backward); a
/// tensor that needs one takes candle's permute.
pub fn channels_last(x: &Tensor) -> Result<Tensor> {
    let (n, c, h, w) = x.dims4()?;
    match swapped(x, c, h * w)? {
        Some(y) => y.reshape((n, h, w, c)),
        None => x.permute((0, 2, 3, 1))?.contiguous(),
    }
}

/// [n, h, w, c] → [n, c, h, w], contiguous: [`channels_last`] undone (a KRSC filter's gradient back
/// to its parameter's KCRS), under the same terms.
pub fn channels_first(x: &Tensor) -> Result<Tensor> {
    let (n, h, w, c) = x.dims4()?;
    match swapped(x, h * w, c)? {
        Some(y) => y.reshape((n, c, h, w)),
        None => x.permute((0, 3, 1, 2))?.contiguous(),
    }
}

/// x seen as [n, a, b], moved to [n, b, a] by our kernel: on CUDA devices, for a tensor that records
/// no gradient, and where the move moves anything (a, b > 1: with one channel or one position, a 1×1
/// filter, candle's permute is a view of the same storage). None where candle's permute is to run.
fn swapped(x: &Tensor, a: usize, b: usize) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && !x.track_op() && a > 1 && b > 1 {
        let n = x.elem_count() / (a * b);
        return Ok(Some(
            x.reshape((n, a, b))?
                .contiguous()?
                .apply_op1_no_bwd(&cuda::Transposed)?,
        ));
    }
    let _ = (x, a, b);
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn the_cpu_references_take_the_mean_and_the_first_position() -> Result<()> {
        let x = Var::from_tensor(&Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((2, 3, 2))?)?;
        let mean = mean_over_positions(x.as_tensor())?;
        assert_eq!(mean.to_vec2::<f32>()?, [[2., 3.], [8., 9.]]);
        assert_eq!(first_position(x.as_tensor())?.to_vec2::<f32>()?, [[0., 1.], [6., 7.]]);
        let g = mean.sum_all()?.backward()?;
        let g = g
            .get(x.as_tensor())
            .expect("a gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert!(g.iter().all(|&v| (v - 1. / 3.).abs() < 1e-7), "{g:?}");
        let x = Tensor::arange(0f32, 12., &Device::Cpu)?.reshape((1, 2, 3, 2))?;
        let y = channels_last(&x)?;
        assert_eq!(
            y.flatten_all()?.to_vec1::<f32>()?,
            [0., 6., 1., 7., 2., 8., 3., 9., 4., 10., 5., 11.]
        );
        assert_eq!(
            channels_first(&y)?.flatten_all()?.to_vec1::<f32>()?,
            x.flatten_all()?.to_vec1::<f32>()?
        );
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

    use crate::kernels::launch::{by_dtype, name, view, Kernel};
    use crate::kernels::sources::POSITIONS;

    /// (n, p, c) of a [n, p, c] or [n, c, p] tensor, within what the kernels index.
    fn dims(d: &[usize], what: &str) -> Result<(u32, u32, u32)> {
        let &[n, a, b] = d else {
            bail!("{what} takes [n, positions, channels], not {d:?}")
        };
        if n * a * b == 0 || n * a * b > u32::MAX as usize {
            bail!("{what} over {d:?}: this kernel takes 1 to 2^32 - 1 elements")
        }
        Ok((n as u32, a as u32, b as u32))
    }

    /// A grid-stride launch over `total` elements (each kernel loops over its output's).
    fn grid(total: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((total as u32).div_ceil(256).clamp(1, 1 << 16), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Runs `kernel` of POSITIONS over `x`'s elements with the dims that follow, into a new buffer of
    /// `out` elements.
    fn launch(
        kernel: &str,
        x: &CudaStorage,
        xl: &Layout,
        out: usize,
        dims: [u32; 3],
        first: Option<i32>,
        what: &str,
    ) -> Result<CudaStorage> {
        let dev = x.device().clone();
        let func = Kernel::load(&dev, &POSITIONS, &name(kernel, x.dtype()))?;
        by_dtype!(x.dtype(), what, T => {
            let xv = view::<T>(x, xl, what)?;
            // SAFETY: the kernel writes every element.
            let y = unsafe { dev.alloc::<T>(out)? };
            let mut b = func.builder();
            b.arg(&xv).arg(&y).arg(&dims[0]).arg(&dims[1]).arg(&dims[2]);
            if let Some(first) = &first {
                b.arg(first);
            }
            // SAFETY: argument types and order match the kernel; x holds n·p·c elements, y `out`.
            unsafe { func.launch(&mut b, grid(out)) }?;
            Ok(CudaStorage::wrap_cuda_slice(y, dev))
        })
    }

    /// [n, p, c] → [n, c]: the mean over positions or the first one.
    #[derive(Debug, Clone, Copy)]
    pub(super) enum Positions {
        Mean,
        First,
    }

    impl Positions {
        fn first(self) -> i32 {
            i32::from(matches!(self, Positions::First))
        }
    }

    impl CustomOp1 for Positions {
        fn name(&self) -> &'static str {
            match self {
                Positions::Mean => "mean-over-positions",
                Positions::First => "first-position",
            }
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!(
                "the {} kernel runs on CUDA devices only; the CPU takes candle's ops",
                self.name()
            )
        }

        fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, p, c) = dims(l.dims(), self.name())?;
            let y = launch(
                "positions_reduce",
                x,
                l,
                n as usize * c as usize,
                [n, p, c],
                Some(self.first()),
                self.name(),
            )?;
            Ok((y, Shape::from((n as usize, c as usize))))
        }

        fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            let positions = x.dim(1)?;
            Ok(Some(
                grad.contiguous()?.apply_op1_no_bwd(&Spread { op: *self, positions })?,
            ))
        }
    }

    /// The backward pass: dy [n, c] → dx [n, p, c].
    #[derive(Debug, Clone, Copy)]
    struct Spread {
        op: Positions,
        positions: usize,
    }

    impl CustomOp1 for Spread {
        fn name(&self) -> &'static str {
            "positions-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the {} kernel runs on CUDA devices only", self.op.name())
        }

        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, c) = gl.shape().dims2()?;
            let (n32, p32, c32) = dims(&[n, self.positions, c], self.op.name())?;
            let dx = launch(
                "positions_spread",
                g,
                gl,
                n * self.positions * c,
                [n32, p32, c32],
                Some(self.op.first()),
                self.op.name(),
            )?;
            Ok((dx, Shape::from((n, self.positions, c))))
        }
    }

    /// [n, a, b] → [n, b, a].
    #[derive(Debug, Clone, Copy)]
    pub(super) struct Transposed;

    impl CustomOp1 for Transposed {
        fn name(&self) -> &'static str {
            "transposed"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the transposing kernel runs on CUDA devices only; the CPU takes candle's permute")
        }

        fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (n, a, b) = dims(l.dims(), self.name())?;
            let y = launch("transposed", x, l, l.shape().elem_count(), [n, a, b], None, self.name())?;
            Ok((y, Shape::from((n as usize, b as usize, a as usize))))
        }
    }
}
