//! Embedding look-up (rows of a table gathered by u32 ids) as a differentiable op: a gather forward,
//! and backward each id's gradient row added into an f32 table of the same size with atomics.
//!
//! Why: candle's `index_select` backward is its `index_add` kernel, a sizeable share of BERT-base's
//! training step for the word and token-type tables alone (measured: docs/kernels.md#embedding).
//! Atomic adds make the order of the sums, and so their last bits in f32, vary run to run, as
//! PyTorch's embedding backward on CUDA does by default.

use candle_core::{Result, Tensor};

/// Rows of `table` [rows, d] by u32 `ids` of any shape: [ids.., d]. Our op on CUDA devices (its
/// backward without candle's slow index_add), candle's index_select elsewhere.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let mut dims = ids.dims().to_vec();
    dims.push(table.dim(1)?);
    let flat = ids.flatten_all()?;
    #[cfg(feature = "cuda")]
    if table.device().is_cuda() {
        return table
            .contiguous()?
            .apply_op2(&flat.contiguous()?, cuda::Embedding)?
            .reshape(dims);
    }
    table.index_select(&flat, 0)?.reshape(dims)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

    use crate::kernels::launch::{by_dtype, name, view, Kernel};

    /// Rows of a [rows, d] table by [n] u32 ids: [n, d].
    #[derive(Debug, Clone, Copy)]
    pub struct Embedding;

    /// (d, n) of a table of `rows` rows laid out as `tl` (or of the gradient rows, also d wide) and its
    /// ids, checked against what the kernel indexes.
    fn dims(rows: usize, tl: &Layout, il: &Layout) -> Result<(usize, usize)> {
        let d = tl.shape().dims2()?.1;
        let n = il.shape().elem_count();
        if rows * d > u32::MAX as usize || n * d > u32::MAX as usize {
            bail!("embedding of {n} ids into a {rows}x{d} table is more than the kernel indexes")
        }
        Ok((d, n))
    }

    /// The forward gather from `table` ([rows, d]), or with `g` the backward's f32 sums; the backward
    /// does not read the table, and is given g in its place.
    fn launch(
        table: (&CudaStorage, &Layout),
        rows: usize,
        ids: (&CudaStorage, &Layout),
        g: Option<(&CudaStorage, &Layout)>,
    ) -> Result<CudaStorage> {
        let (d, n) = dims(rows, table.1, ids.1)?;
        if ids.0.dtype() != DType::U32 {
            bail!("embedding ids must be u32, not {:?}", ids.0.dtype())
        }
        let dev = table.0.device().clone();
        let kernel = name("embedding", table.0.dtype());
        let func = Kernel::load(&dev, &crate::kernels::sources::EMBEDDING, &kernel)?;
        let cfg = LaunchConfig {
            grid_dim: (((n * d) as u32).div_ceil(256).clamp(1, 1 << 20), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n32, d32) = (n as u32, d as u32);
        let idv = view::<u32>(ids.0, ids.1, "embedding ids")?;
        let null = 0u64;
        by_dtype!(table.0.dtype(), "embedding", T => {
            let tv = view::<T>(table.0, table.1, "embedding")?;
            let mut b = func.builder();
            b.arg(&tv).arg(&idv);
            match g {
                Some((gs, gl)) => {
                    let gv = view::<T>(gs, gl, "embedding's gradient")?;
                    let acc = dev.alloc_zeros::<f32>(rows * d)?;
                    b.arg(&gv).arg(&acc).arg(&null).arg(&n32).arg(&d32);
                    // SAFETY: argument types and order match the kernel; ids index rows of the table
                    // (checked by the caller), g holds n·d, acc rows·d.
                    unsafe { func.launch(&mut b, cfg) }?;
                    Ok(CudaStorage::wrap_cuda_slice(acc, dev))
                }
                None => {
                    // SAFETY: the kernel writes every element.
                    let out = unsafe { dev.alloc::<T>(n * d)? };
                    b.arg(&null).arg(&null).arg(&out).arg(&n32).arg(&d32);
                    // SAFETY: as above; out holds n·d.
                    unsafe { func.launch(&mut b, cfg) }?;
                    Ok(CudaStorage::wrap_cuda_slice(out, dev))
                }
            }
        })
    }

    impl CustomOp2 for Embedding {
        fn name(&self) -> &'static str {
            "embedding"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the embedding kernel runs on CUDA devices only; on the CPU migprof uses candle's index_select")
        }

        fn cuda_fwd(&self, t: &CudaStorage, tl: &Layout, i: &CudaStorage, il: &Layout) -> Result<(CudaStorage, Shape)> {
            let rows = tl.shape().dims2()?.0;
            let (d, n) = dims(rows, tl, il)?;
            Ok((launch((t, tl), rows, (i, il), None)?, Shape::from((n, d))))
        }

        fn bwd(
            &self,
            table: &Tensor,
            ids: &Tensor,
            _out: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dt = grad
                .contiguous()?
                .apply_op2_no_bwd(&ids.detach(), &EmbeddingGrad { rows: table.dim(0)? })?;
            Ok((Some(dt.to_dtype(table.dtype())?), None))
        }
    }

    /// The table's gradient (f32, [rows, d]) from the output's gradient [n, d] and the ids.
    #[derive(Debug, Clone, Copy)]
    struct EmbeddingGrad {
        rows: usize,
    }

    impl CustomOp2 for EmbeddingGrad {
        fn name(&self) -> &'static str {
            "embedding-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the embedding kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout, i: &CudaStorage, il: &Layout) -> Result<(CudaStorage, Shape)> {
            let d = gl.shape().dims2()?.1;
            Ok((
                launch((g, gl), self.rows, (i, il), Some((g, gl)))?,
                Shape::from((self.rows, d)),
            ))
        }
    }
}
