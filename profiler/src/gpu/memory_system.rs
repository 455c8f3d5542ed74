//! The memory system a process on a slice reaches, measured: the DRAM bandwidth a streaming copy gets.
//! A MIG slice owns a share of it (a 1g of an H100: one of eight memory slices, so 1/8 of the
//! bandwidth); an MPS client capped to the same SMs shares the whole GPU's, which is why its
//! throughput can lie above the real slice's. The number says which the run had.
//!
//! A copy between two 256 MiB buffers (far past any L2), four loads in flight per thread, reads and
//! writes counted, the median of five launches timed with CUDA events after an untimed one: a few
//! milliseconds on an H100.

/// What a process's memory system gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemorySystem {
    /// DRAM bandwidth of a streaming copy, reads and writes counted, GB/s.
    pub bandwidth_gbps: f64,
}

#[cfg(feature = "cuda")]
const SOURCE: &str = r#"
// Four loads in flight per thread before their stores: one at a time leaves the memory system idle.
extern "C" __global__ void migprof_copy(const float4* __restrict__ src, float4* __restrict__ dst,
                                        unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        float4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}
"#;

/// Measures the memory system this process reaches on `device`, whose kernels may run on `sms` SMs.
/// Run it before the allocation pool is set up: its buffers go back to the driver when it returns.
#[cfg(feature = "cuda")]
pub fn measure(device: &candle_core::Device, sms: u32) -> anyhow::Result<MemorySystem> {
    use anyhow::anyhow;
    use candle_core::cuda_backend::cudarc;
    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{LaunchConfig, PushKernelArg};

    const MIB: u64 = 1 << 20;
    const FLOAT4: u64 = 16;
    let cuda = device.as_cuda_device()?;
    let ptx = cudarc::nvrtc::compile_ptx(SOURCE)
        .map_err(|e| anyhow!("compiling the memory-system probe with NVRTC: {e:?}"))?;
    let copy = cuda.get_or_load_custom_func("migprof_copy", "migprof_memory_system", &ptx.to_src())?;
    let stream = cuda.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: (sms.max(1) * 8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // The median of five timed launches after an untimed one, ms.
    let median_ms = |launch: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let event = || {
            stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("a CUDA event: {e:?}"))
        };
        launch()?;
        let mut times = Vec::new();
        for _ in 0..5 {
            let (start, end) = (event()?, event()?);
            start.record(&stream).map_err(|e| anyhow!("{e:?}"))?;
            launch()?;
            end.record(&stream).map_err(|e| anyhow!("{e:?}"))?;
            times.push(f64::from(start.elapsed_ms(&end).map_err(|e| anyhow!("{e:?}"))?));
        }
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    };

    let copy_bytes = 256 * MIB;
    let n = copy_bytes / FLOAT4;
    let src = cuda.alloc_zeros::<u8>(copy_bytes as usize)?;
    let mut dst = cuda.alloc_zeros::<u8>(copy_bytes as usize)?;
    let ms = median_ms(&mut || {
        let mut args = copy.builder();
        args.arg(&src).arg(&mut dst).arg(&n);
        // SAFETY: (const float4*, float4*, n): both buffers hold n float4.
        unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the copy probe: {e:?}"))?;
        Ok(())
    })?;
    let bandwidth_gbps = 2.0 * copy_bytes as f64 / (ms * 1e-3) / 1e9;
    drop((src, dst));
    device.synchronize()?;
    Ok(MemorySystem { bandwidth_gbps })
}
