//! The CPU side of our custom ops: values in and out of candle's CPU storage as f64. These loops
//! are the reference the CUDA kernels are tested against, and what the CPU runs (small models in
//! tests), so they favour being plainly right over being fast.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};

/// The elements of a contiguous tensor, in order, as f64.
pub(crate) fn values(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("a custom op takes contiguous tensors")
    };
    Ok(match s {
        CpuStorage::F64(v) => v[start..end].to_vec(),
        CpuStorage::F32(v) => v[start..end].iter().map(|&x| x as f64).collect(),
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f64()).collect(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f64()).collect(),
        other => bail!("our kernels take f64, f32, bf16 or f16, not {:?}", other.dtype()),
    })
}

/// CPU storage of `dtype` holding `v` (rounded to nearest).
pub(crate) fn storage(v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F64 => CpuStorage::F64(v),
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f64).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f64).collect()),
        other => bail!("our kernels produce f64, f32, bf16 or f16, not {other:?}"),
    })
}

/// The dtype sums and statistics are kept in: f64 for f64 tensors (the gradient tests), f32 for the
/// rest, as the CUDA kernels do.
pub(crate) fn accumulation(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Writes `f(old values)` back into a contiguous CPU destination of any float dtype: the CPU side
/// of our in-place ops.
pub(crate) fn update(dst: &mut CpuStorage, l: &Layout, f: impl FnOnce(Vec<f64>) -> Vec<f64>) -> Result<()> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("an in-place op updates contiguous tensors")
    };
    let new = storage(f(values(dst, l)?), dst.dtype())?;
    match (dst, new) {
        (CpuStorage::F64(d), CpuStorage::F64(n)) => d[start..end].copy_from_slice(&n),
        (CpuStorage::F32(d), CpuStorage::F32(n)) => d[start..end].copy_from_slice(&n),
        (CpuStorage::BF16(d), CpuStorage::BF16(n)) => d[start..end].copy_from_slice(&n),
        (CpuStorage::F16(d), CpuStorage::F16(n)) => d[start..end].copy_from_slice(&n),
        _ => bail!("in-place ops update f64, f32, bf16 or f16 tensors"),
    }
    Ok(())
}
