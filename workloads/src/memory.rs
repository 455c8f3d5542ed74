//! How the workloads hold GPU memory between steps.
//!
//! candle allocates every tensor with `cuMemAllocAsync` from the device's memory pool, whose release
//! threshold is 0 by default: at every synchronisation the pool hands its free memory back to the
//! driver, and a measuring loop synchronises after every step, so each step maps its memory afresh.
//! PyTorch keeps freed blocks in its caching allocator instead; [`pool_allocations`] makes the pool
//! keep them. And cudarc gives every allocation two CUDA events, to order its uses across streams:
//! candle drives a device from one stream (cuBLAS, cuBLASLt and cuDNN are bound to it), so there is
//! nothing to order, and the events cost driver calls on every allocation and free.

use candle_core::{Device, Result};

/// Makes `device` keep freed memory pooled for reuse, and stops per-allocation event tracking. A
/// no-op on the CPU.
pub fn pool_allocations(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use cuda::sys;
        // SAFETY: one stream uses this device's memory (see the module's comment); tracking stops for
        // allocations made from here on.
        unsafe { dev.disable_event_tracking() };
        if let Some(pool) = cuda::pool(dev)? {
            let mut keep_all = u64::MAX;
            // SAFETY: the release threshold is a cuuint64_t, as documented.
            let status = unsafe { sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut keep_all as *mut u64 as *mut std::ffi::c_void) };
            cuda::check(status, "setting the release threshold")?;
        }
    }
    let _ = device;
    Ok(())
}

/// Hands the pool's free memory back to the driver (after the device's queued work), and the memory
/// CUDA keeps for graphs that no longer exist: between runs, so that one workload's pooled memory is
/// not held, or counted, through the next.
pub fn release_pooled(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        if let Some(pool) = cuda::pool(dev)? {
            device.synchronize()?;
            // SAFETY: a valid pool; trimming keeps memory that live allocations use.
            cuda::check(unsafe { cuda::sys::cuMemPoolTrimTo(pool, 0) }, "trimming it")?;
            let cu_device = dev.cuda_stream().context().cu_device();
            // SAFETY: a valid device; memory of graphs still alive is kept.
            cuda::check(unsafe { cuda::sys::cuDeviceGraphMemTrim(cu_device) }, "trimming graph memory")?;
        }
    }
    let _ = device;
    Ok(())
}

/// Bytes the device's memory pool holds from the driver, in use or free; None on the CPU or where
/// allocations do not come from a pool.
pub fn pooled_bytes(device: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use cuda::sys;
        let Some(pool) = cuda::pool(dev)? else { return Ok(None) };
        let mut bytes = 0u64;
        // SAFETY: the reserved size is a cuuint64_t, as documented.
        let status = unsafe { sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &mut bytes as *mut u64 as *mut std::ffi::c_void) };
        cuda::check(status, "reading its size")?;
        return Ok(Some(bytes));
    }
    let _ = device;
    Ok(None)
}

#[cfg(feature = "cuda")]
mod cuda {
    pub(super) use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::Result;

    pub(super) fn check(status: sys::CUresult, what: &str) -> Result<()> {
        match status {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(candle_core::Error::Msg(format!("CUDA memory pool: {what}: {e:?}"))),
        }
    }

    /// The pool `cuMemAllocAsync` draws from on this device, or None when the context allocates
    /// without one.
    pub(super) fn pool(dev: &CudaDevice) -> Result<Option<sys::CUmemoryPool>> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return Ok(None);
        }
        ctx.bind_to_thread().map_err(|e| candle_core::Error::Msg(format!("CUDA context: {e:?}")))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid device handle and an out-pointer for the pool.
        check(unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) }, "the device's pool")?;
        Ok(Some(pool))
    }
}
