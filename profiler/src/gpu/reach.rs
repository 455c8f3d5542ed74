//! What a CUDA process can actually use, measured rather than assumed: the SMs its kernels run on (a
//! kernel of many blocks records `%smid` in each) and, under a memory limit, how much device memory it
//! can allocate. Under an MPS share both are caps the driver applies. CUDA's own memory total does not
//! show an MPS client's pinned limit (it reports the whole GPU's, measured on an H100), so the limit
//! is found by allocating: 256 MiB at a time until the driver refuses or the limit is passed by 1 GiB.

/// What the process reached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reach {
    /// Distinct SMs that ran a block.
    pub sms: u32,
    /// Device memory it could allocate, MiB; `None` when no limit was asked to be checked.
    pub memory_mib: Option<u64>,
}

/// The step of the allocation probe.
#[cfg(feature = "cuda")]
const PROBE_CHUNK_MIB: u64 = 256;

/// Blocks per SM of the device: enough waves that every SM the process may use gets blocks.
#[cfg(feature = "cuda")]
const BLOCKS_PER_SM: u32 = 8;

/// Each block spins this many clock cycles (about 0.5 ms), so that blocks are resident together and
/// spread over every SM the scheduler may use instead of finishing on the first few.
#[cfg(feature = "cuda")]
const SPIN_CYCLES: i64 = 1_000_000;

#[cfg(feature = "cuda")]
const SOURCE: &str = r#"
extern "C" __global__ void migprof_smid(unsigned int *sm_of_block, long long spin) {
    unsigned int smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    long long start = clock64();
    while (clock64() - start < spin) { }
    if (threadIdx.x == 0) sm_of_block[blockIdx.x] = smid;
}
"#;

/// The SMs this process's kernels run on, on `device`, a GPU with `device_sms` SMs.
#[cfg(feature = "cuda")]
fn sm_ids(device: &candle_core::Device, device_sms: u32) -> anyhow::Result<std::collections::BTreeSet<u32>> {
    use candle_core::cuda_backend::cudarc;
    use cudarc::driver::{LaunchConfig, PushKernelArg};

    let cuda = device.as_cuda_device()?;
    let ptx =
        cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| anyhow::anyhow!("compiling the SM probe with NVRTC: {e:?}"))?;
    let func = cuda.get_or_load_custom_func("migprof_smid", "migprof_reach", &ptx.to_src())?;
    let blocks = device_sms.max(1) * BLOCKS_PER_SM;
    let mut out = cuda.alloc_zeros::<u32>(blocks as usize)?;
    let mut args = func.builder();
    args.arg(&mut out);
    args.arg(&SPIN_CYCLES);
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel takes (unsigned int*, long long) and writes one entry per block of `out`,
    // which holds `blocks` entries.
    unsafe { args.launch(cfg) }.map_err(|e| anyhow::anyhow!("launching the SM probe: {e:?}"))?;
    Ok(cuda.clone_dtoh(&out)?.into_iter().collect())
}

/// Measures the reach of this process on `device`, a GPU with `device_sms` SMs; with
/// `memory_limit_mib`, also how much of the device's memory it can allocate. Run it before the
/// allocation pool is set up: the probe's memory goes back to the driver when it returns.
#[cfg(feature = "cuda")]
pub fn measure(device: &candle_core::Device, device_sms: u32, memory_limit_mib: Option<u64>) -> anyhow::Result<Reach> {
    let cuda = device.as_cuda_device()?;
    let sms = sm_ids(device, device_sms)?.len() as u32;
    let memory_mib = memory_limit_mib.map(|limit| {
        let mut held = Vec::new();
        while (held.len() as u64) * PROBE_CHUNK_MIB < limit + 1024 {
            // SAFETY: the memory is never read; it is only held to see how much the driver gives.
            match unsafe { cuda.alloc::<u8>((PROBE_CHUNK_MIB << 20) as usize) } {
                Ok(chunk) => held.push(chunk),
                Err(_) => break,
            }
        }
        held.len() as u64 * PROBE_CHUNK_MIB
    });
    device.synchronize()?;
    Ok(Reach { sms, memory_mib })
}
