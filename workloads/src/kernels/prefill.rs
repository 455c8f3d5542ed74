//! A language model's pass over many tokens at once (a prompt's prefill; a decode step of more
//! sequences than the decode products take), between its matrix products. The decoder makes q, k and
//! v with one product over their weights side by side, and gate and up with another: one larger
//! GEMM each instead of three and two, which keeps an H100's multiprocessors busier at a short
//! prompt's few rows (Llama-3.1-8B's k and v at 512 tokens were 16 tiles of 128 × 256 for 132
//! multiprocessors). What follows each product reads the packed rows where they lie:
//!
//! - [`rope_packed`] turns the q and k heads by the rotary embedding and copies the v heads: the
//!   rows the causal attention kernel reads, in one pass;
//! - [`swiglu`] makes SiLU(gate) · up in one pass, where candle's SiLU and product are two, and
//!   their intermediate a third [rows, intermediate] tensor.
//!
//! Inference only (no backward). `rope_packed` runs on CUDA devices only (the causal kernel's
//! path); `swiglu` takes candle's ops elsewhere, which are its reference in the GPU test
//! (`workloads/tests/decode_kernels.rs`).

use candle_core::{Result, Tensor, D};

use super::decode::Heads;

/// `packed` [rows, (q + 2·kv)·dim] (each row a token's q heads, k heads, v heads) with the q and k
/// heads turned by the rotary embedding: row r is the token at position `offset + r % tokens` of its
/// sequence, `cos` and `sin` [positions, dim / 2] in the packed rows' dtype. Computed in f32 and
/// rounded once, as the decode step's q/k/v kernel does.
pub fn rope_packed(
    packed: &Tensor,
    tokens: usize,
    offset: usize,
    heads: Heads,
    (cos, sin): (&Tensor, &Tensor),
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let op = cuda::RopePacked { tokens, offset, heads };
        packed
            .contiguous()?
            .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (packed, tokens, offset, heads, cos, sin);
        candle_core::bail!("the packed rotary embedding runs on CUDA devices only")
    }
}

/// SiLU(gate) · up of `gate_up` [.., 2·n] (gate in the first n features, up in the last n): [.., n],
/// SiLU's output rounded to the dtype before the product, as PyTorch's two ops round.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gate_up.device().is_cuda() {
        return gate_up.contiguous()?.apply_op1_no_bwd(&cuda::Swiglu);
    }
    let n = gate_up.dim(D::Minus1)? / 2;
    candle_nn::ops::silu(&gate_up.narrow(D::Minus1, 0, n)?)? * gate_up.narrow(D::Minus1, n, n)?
}

/// Row `rows[r]` of `dst` [R, width] becomes row r of `src` [n, width], in place, for `rows` [n]
/// u32 (distinct, below R): a pass's keys or values written into their slots of a paged pool. On the
/// CPU, candle's scatter.
pub fn write_rows(dst: &Tensor, rows: &Tensor, src: &Tensor) -> Result<()> {
    #[cfg(feature = "cuda")]
    if dst.device().is_cuda() {
        return dst.inplace_op3(&src.contiguous()?, &rows.contiguous()?, &cuda::WriteRows);
    }
    let (n, width) = src.dims2()?;
    let index = rows.reshape((n, 1))?.broadcast_as((n, width))?.contiguous()?;
    dst.scatter_set(&index, src, 0)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp3, Layout, Result, Shape};

    use super::Heads;
    use crate::kernels::launch::{by_dtype, grid_stride, name, view, Kernel, U32_STRIDE_ELEMENTS};
    use crate::kernels::sources::PREFILL;

    /// A grid-stride launch over `total` elements, which the kernels count in 32 bits.
    fn grid(total: usize, what: &str) -> Result<(LaunchConfig, u32)> {
        if total == 0 {
            bail!("{what} over no elements")
        }
        grid_stride(total, U32_STRIDE_ELEMENTS, what)
    }

    fn on_cpu(what: &str) -> Result<(CpuStorage, Shape)> {
        bail!("the {what} kernel runs on CUDA devices only; on the CPU migprof uses candle's ops")
    }

    #[derive(Debug, Clone, Copy)]
    pub(super) struct RopePacked {
        pub tokens: usize,
        pub offset: usize,
        pub heads: Heads,
    }

    impl CustomOp3 for RopePacked {
        fn name(&self) -> &'static str {
            "rope-packed"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            on_cpu("packed rotary embedding")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            cos: &CudaStorage,
            cl: &Layout,
            sin: &CudaStorage,
            sl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let Heads { q, kv, dim } = self.heads;
            let width = (q + 2 * kv) * dim;
            let dims = xl.dims();
            let rows = xl.shape().elem_count() / width.max(1);
            if dim == 0 || !dim.is_multiple_of(2) || dims.last() != Some(&width) || self.tokens == 0 {
                bail!("packed rotary embedding: rows {dims:?} are not {q} q, {kv} k and {kv} v heads of {dim}")
            }
            let half = dim / 2;
            // Every row's position must be in the tables: the kernel reads them unchecked.
            let positions = self.offset + self.tokens.min(rows);
            for (what, l) in [("cos", cl), ("sin", sl)] {
                let (p, h) = l.shape().dims2()?;
                if h != half || p < positions {
                    bail!("packed rotary embedding: a {what} table [{p}, {h}] for positions up to {positions} of heads of {dim}")
                }
            }
            if x.dtype() != cos.dtype() || x.dtype() != sin.dtype() {
                bail!(
                    "packed rotary embedding: rows in {:?}, tables in {:?} and {:?}",
                    x.dtype(),
                    cos.dtype(),
                    sin.dtype()
                )
            }
            let (cfg, total) = grid(rows * (q + 2 * kv) * half, "packed rotary embedding")?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &PREFILL, &name("rope_packed", x.dtype()))?;
            let args = [
                self.tokens as u32,
                self.offset as u32,
                (q + 2 * kv) as u32,
                (q + kv) as u32,
                half as u32,
            ];
            let out = by_dtype!(x.dtype(), "the packed rotary embedding", T => {
                let (xv, cv, sv) = (view::<T>(x, xl, "rope")?, view::<T>(cos, cl, "cos")?, view::<T>(sin, sl, "sin")?);
                // SAFETY: the kernel writes every element.
                let y = unsafe { dev.alloc::<T>(rows * width)? };
                let mut b = func.builder();
                b.arg(&xv).arg(&cv).arg(&sv).arg(&y).arg(&total);
                for a in &args {
                    b.arg(a);
                }
                // SAFETY: argument types and order match the kernel; x and y hold rows·width elements,
                // the tables every position a row reads (checked above).
                unsafe { func.launch(&mut b, cfg) }?;
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            });
            Ok((out, xl.shape().clone()))
        }
    }

    #[derive(Debug, Clone, Copy)]
    pub(super) struct WriteRows;

    impl candle_core::InplaceOp3 for WriteRows {
        fn name(&self) -> &'static str {
            "write-rows"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<()> {
            bail!("write-rows runs on CUDA devices only; on the CPU migprof uses candle's scatter")
        }

        fn cuda_fwd(
            &self,
            dst: &mut CudaStorage,
            dl: &Layout,
            src: &CudaStorage,
            sl: &Layout,
            rows: &CudaStorage,
            rl: &Layout,
        ) -> Result<()> {
            let (Some((start, end)), [n, width]) = (dl.contiguous_offsets(), sl.dims()) else {
                bail!(
                    "write-rows: rows {:?} into a tensor {:?}, contiguous",
                    sl.dims(),
                    dl.dims()
                )
            };
            let (n, width) = (*n, *width);
            if rl.dims() != [n] || dl.dims().last() != Some(&width) || src.dtype() != dst.dtype() {
                bail!(
                    "write-rows: {:?} rows of {:?} into {:?} of {:?} at {:?}",
                    sl.dims(),
                    src.dtype(),
                    dl.dims(),
                    dst.dtype(),
                    rl.dims()
                )
            }
            if n == 0 {
                return Ok(());
            }
            let (cfg, total) = grid(n * width, "write-rows")?;
            let dev = dst.device().clone();
            let func = Kernel::load(&dev, &PREFILL, &name("write_rows", dst.dtype()))?;
            let width32 = width as u32;
            let rv = view::<u32>(rows, rl, "rows")?;
            by_dtype!(dst.dtype(), "write-rows", T => {
                let sv = view::<T>(src, sl, "write-rows")?;
                let mut dv = dst.as_cuda_slice_mut::<T>()?.slice_mut(start..end);
                let mut b = func.builder();
                b.arg(&mut dv).arg(&sv).arg(&rv).arg(&total).arg(&width32);
                // SAFETY: argument types and order match the kernel; src holds n·width elements, rows
                // n indices, each below dst's rows (the caller's slots of its pool).
                unsafe { func.launch(&mut b, cfg) }?;
            });
            Ok(())
        }
    }

    #[derive(Debug, Clone, Copy)]
    pub(super) struct Swiglu;

    impl CustomOp1 for Swiglu {
        fn name(&self) -> &'static str {
            "swiglu-rows"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            on_cpu("SwiGLU")
        }

        fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let mut dims = l.dims().to_vec();
            let width = dims.last().copied().unwrap_or(0);
            if width == 0 || !width.is_multiple_of(2) {
                bail!("SwiGLU: rows of {width} features are not a gate and an up of one width")
            }
            let n = width / 2;
            let (cfg, total) = grid(l.shape().elem_count() / 2, "SwiGLU")?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &PREFILL, &name("swiglu_rows", x.dtype()))?;
            let n32 = n as u32;
            let out = by_dtype!(x.dtype(), "SwiGLU", T => {
                let xv = view::<T>(x, l, "SwiGLU")?;
                // SAFETY: the kernel writes every element.
                let y = unsafe { dev.alloc::<T>(total as usize)? };
                let mut b = func.builder();
                b.arg(&xv).arg(&y).arg(&total).arg(&n32);
                // SAFETY: argument types and order match the kernel; x holds 2·total elements, y total.
                unsafe { func.launch(&mut b, cfg) }?;
                CudaStorage::wrap_cuda_slice(y, dev.clone())
            });
            *dims.last_mut().expect("rank >= 1") = n;
            Ok((out, Shape::from(dims)))
        }
    }
}
