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
            let status = unsafe {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep_all as *mut u64 as *mut std::ffi::c_void,
                )
            };
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
        // Freed in stream order into the pool, which the trim below then empties.
        #[cfg(feature = "cudnn")]
        crate::kernels::release_workspaces();
        if let Some(pool) = cuda::pool(dev)? {
            device.synchronize()?;
            // SAFETY: a valid pool; trimming keeps memory that live allocations use.
            cuda::check(unsafe { cuda::sys::cuMemPoolTrimTo(pool, 0) }, "trimming it")?;
            let mut zero = 0u64;
            // SAFETY: resets the high-water mark (a cuuint64_t; only zero is allowed).
            let status = unsafe {
                cuda::sys::cuMemPoolSetAttribute(
                    pool,
                    cuda::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    &mut zero as *mut u64 as *mut std::ffi::c_void,
                )
            };
            cuda::check(status, "resetting its high-water mark")?;
            let cu_device = dev.cuda_stream().context().cu_device();
            // SAFETY: a valid device; memory of graphs still alive is kept.
            cuda::check(
                unsafe { cuda::sys::cuDeviceGraphMemTrim(cu_device) },
                "trimming graph memory",
            )?;
        }
    }
    let _ = device;
    Ok(())
}

/// Where a device's memory goes, in bytes, at one moment: to tell a workload's own memory from what
/// CUDA, the libraries and the graphs hold beside it (`MIGPROF_MEMORY_LOG=1` prints it per run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ledger {
    /// The whole device's used memory (every process; the context and loaded kernels included).
    pub device_used: u64,
    /// What the stream-ordered pool holds from the driver, and of that what live tensors use.
    pub pool_reserved: u64,
    pub pool_used: u64,
    /// The pool's most, in use, since the last [`release_pooled`] or the start.
    pub pool_used_high: u64,
    /// What CUDA holds for the memory of captured graphs.
    pub graphs_reserved: u64,
    /// This thread's shared cuDNN workspaces (a part of `pool_used`).
    pub cudnn_workspaces: u64,
    /// The context's stack per thread: CUDA reserves local memory for it on every resident thread
    /// of the device, and grows it (never shrinking) for the kernel that needs the most.
    pub stack_per_thread: u64,
}

impl Ledger {
    /// What the pool holds from the driver that no live allocation uses. Right after
    /// [`release_pooled`] it is what the trim could not hand back: blocks pinned by a small
    /// allocation that outlives the run among them (candle keeps the dims and strides its strided
    /// ops upload for a CUDA graph, made during a step's first run among its activations, for as long
    /// as the thread). The next run of the process may reuse it, or not; its device memory readings
    /// include whatever it does not.
    pub fn pool_idle(&self) -> u64 {
        self.pool_reserved.saturating_sub(self.pool_used)
    }
}

impl std::fmt::Display for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "device used {:.0} MiB; pool reserved {:.0}, in use {:.0} (most {:.0}), of which cuDNN workspaces {:.0}; graphs {:.0}; stack {} B per thread",
            mib(self.device_used),
            mib(self.pool_reserved),
            mib(self.pool_used),
            mib(self.pool_used_high),
            mib(self.cudnn_workspaces),
            mib(self.graphs_reserved),
            self.stack_per_thread
        )
    }
}

/// The device's [`Ledger`] now (after its queued work); None on the CPU or without a pool.
pub fn ledger(device: &Device) -> Result<Option<Ledger>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use cuda::sys;
        let Some(pool) = cuda::pool(dev)? else { return Ok(None) };
        device.synchronize()?;
        let attr = |a| cuda::pool_bytes(pool, a);
        use sys::CUmemPool_attribute as A;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers; the context is bound (by `cuda::pool`).
        cuda::check(
            unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) },
            "reading the device's free memory",
        )?;
        let mut graphs = 0u64;
        let cu_device = dev.cuda_stream().context().cu_device();
        // SAFETY: a valid device; the attribute is a cuuint64_t.
        let status = unsafe {
            sys::cuDeviceGetGraphMemAttribute(
                cu_device,
                sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                &mut graphs as *mut u64 as *mut std::ffi::c_void,
            )
        };
        cuda::check(status, "reading the graphs' memory")?;
        let mut stack = 0usize;
        // SAFETY: an out-pointer; the context is bound (by `cuda::pool`).
        cuda::check(
            unsafe { sys::cuCtxGetLimit(&mut stack, sys::CUlimit::CU_LIMIT_STACK_SIZE) },
            "reading the stack size",
        )?;
        #[cfg(feature = "cudnn")]
        let cudnn_workspaces = crate::kernels::workspace_bytes() as u64;
        #[cfg(not(feature = "cudnn"))]
        let cudnn_workspaces = 0;
        return Ok(Some(Ledger {
            device_used: (total - free) as u64,
            pool_reserved: attr(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            pool_used: attr(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
            pool_used_high: attr(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            graphs_reserved: graphs,
            cudnn_workspaces,
            stack_per_thread: stack as u64,
        }));
    }
    let _ = device;
    Ok(None)
}

/// Bytes the device's memory pool holds from the driver, in use or free; None on the CPU or where
/// allocations do not come from a pool.
pub fn pooled_bytes(device: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use cuda::sys;
        let Some(pool) = cuda::pool(dev)? else { return Ok(None) };
        return Ok(Some(cuda::pool_bytes(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )?));
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

    /// One of the pool's byte counts (reserved or used memory, current or high-water mark).
    pub(super) fn pool_bytes(pool: sys::CUmemoryPool, attribute: sys::CUmemPool_attribute) -> Result<u64> {
        let mut bytes = 0u64;
        // SAFETY: the pool's memory attributes are cuuint64_t, as documented.
        let status =
            unsafe { sys::cuMemPoolGetAttribute(pool, attribute, &mut bytes as *mut u64 as *mut std::ffi::c_void) };
        check(status, "reading its size")?;
        Ok(bytes)
    }

    /// The pool `cuMemAllocAsync` draws from on this device, or None when the context allocates
    /// without one.
    pub(super) fn pool(dev: &CudaDevice) -> Result<Option<sys::CUmemoryPool>> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        if !ctx.has_async_alloc() {
            return Ok(None);
        }
        ctx.bind_to_thread()
            .map_err(|e| candle_core::Error::Msg(format!("CUDA context: {e:?}")))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid device handle and an out-pointer for the pool.
        check(
            unsafe { sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()) },
            "the device's pool",
        )?;
        Ok(Some(pool))
    }
}
