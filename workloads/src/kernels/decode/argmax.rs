//! Greedy sampling on CUDA devices: each row's largest logit, found by blocks over parts of the row,
//! then across the parts.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape};

use crate::kernels::launch::{address, name, slice_address, Kernel};
use crate::kernels::sources::DECODE;

/// Elements each block of the first pass scans at least, and the most blocks a row.
const SPAN: usize = 4096;
const MAX_PARTS: usize = 64;

#[derive(Debug, Clone, Copy)]
pub(in crate::kernels::decode) struct Argmax;

impl CustomOp1 for Argmax {
    fn name(&self) -> &'static str {
        "argmax"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the argmax kernel runs on CUDA devices only; on the CPU migprof uses candle's argmax")
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, n) = l.shape().dims2()?;
        if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            bail!("the argmax kernel takes f32, bf16 or f16, not {:?}", x.dtype())
        }
        if n == 0 || rows == 0 || rows > 65_535 || n > u32::MAX as usize {
            bail!("argmax over [{rows}, {n}] is not what the kernel takes")
        }
        let parts = n.div_ceil(SPAN).clamp(1, MAX_PARTS);
        let dev = x.device().clone();
        // Ordinary launches: the logits before them come from an op of their own.
        let first = Kernel::load(&dev, &DECODE, &name("argmax_parts", x.dtype()))?.overlapping(false);
        let second = Kernel::load(&dev, &DECODE, "argmax_rows")?.overlapping(false);
        // SAFETY: every block writes its part, every row its index.
        let best = unsafe { dev.alloc::<f32>(rows * parts * 2)? };
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let (n32, parts32) = (n as u32, parts as u32);
        let mut p = first.params();
        p.ptr(address(x, l, "argmax")?).ptr(slice_address(&best)).u32(n32);
        let cfg = LaunchConfig {
            grid_dim: (parts32, rows as u32, 1),
            block_dim: (crate::kernels::defines::decode::ARGMAX_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameter types and order match the kernel; x holds rows·n elements, best
        // rows·parts pairs; the kernel waits before it reads or writes anything.
        unsafe { first.launch_overlapping(&mut p, cfg) }?;
        let mut p = second.params();
        p.ptr(slice_address(&best)).ptr(slice_address(&out)).u32(parts32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; out holds rows indices.
        unsafe { second.launch_overlapping(&mut p, cfg) }?;
        // The parts go back in stream order, after the kernels that use them.
        drop(best);
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}
