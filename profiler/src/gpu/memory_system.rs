//! The memory system a process on a slice reaches, measured: the DRAM bandwidth a streaming copy gets
//! and the L2 cache it effectively has. A MIG slice owns a share of both (a 1g of an H100: one of
//! eight memory slices, so 1/8 of the bandwidth and of the L2); an MPS client capped to the same SMs
//! shares the whole GPU's, which is why its throughput can lie above the real slice's. The numbers
//! say which the run had.
//!
//! Bandwidth: a copy between two 256 MiB buffers (far past any L2), four loads in flight per thread,
//! reads and writes counted, the median of five launches timed with CUDA events after an untimed one:
//! a few milliseconds on an H100.
//!
//! L2: dependent loads, not a bandwidth sweep. Bandwidth cannot find a small slice's L2: 16 SMs
//! cannot pull more from L2 than from DRAM, so the curve has no step (measured on an H100). The time
//! of a dependent load can: it is an L2 hit's or a DRAM access's whatever the SM count. Each working
//! set (1 to 128 MiB, and 512 MiB for DRAM) of 128-byte lines is read through once so the cache
//! holds what it can; then 128 chains each load uniformly random lines of it, with replacement, each
//! address hashed from the value the load before returned, loads bypassing L1. Random accesses into
//! a set of S bytes hit a cache of C bytes C/S of the time, so half of them hit at S = 2C: the
//! effective L2 is half the set at which the load time is halfway between an L2 hit's (1 MiB) and a
//! DRAM access's (512 MiB, where a tenth of an H100's loads still hit). About 50 ms in all.

/// What a process's memory system gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemorySystem {
    /// DRAM bandwidth of a streaming copy, reads and writes counted, GB/s.
    pub bandwidth_gbps: f64,
    /// The L2 cache the process effectively has, MiB; `None` where the chase found no step (the
    /// cache is beyond the sweep's sets, or the probe failed).
    pub l2_mib: Option<f64>,
}

/// The working sets of the L2 chase, MiB, and the one taken for DRAM.
pub const L2_SETS_MIB: [u32; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
pub const DRAM_SET_MIB: u32 = 512;

/// The effective L2 from the chase's load time per working set (`(MiB, ns)`, ascending, the smallest
/// an L2 hit's) and a DRAM access's time: half the set at which the time is halfway between the two,
/// interpolated on a log scale. `None` when the time never passes halfway (or there is no step at
/// all between an L2 hit and DRAM).
pub fn l2_from_chase(times: &[(u32, f64)], dram_ns: f64) -> Option<f64> {
    let &(_, hit_ns) = times.first()?;
    // Under a tenth of the span the sets all hit or all miss (or a time is not a number): nothing to
    // read a size from.
    if dram_ns.partial_cmp(&(hit_ns * 1.1)) != Some(std::cmp::Ordering::Greater) {
        return None;
    }
    let halfway = (hit_ns + dram_ns) / 2.0;
    times.windows(2).find_map(|w| {
        let ((s0, t0), (s1, t1)) = (w[0], w[1]);
        (t0 < halfway && t1 >= halfway).then(|| {
            let (l0, l1) = (f64::from(s0).log2(), f64::from(s1).log2());
            let at = l0 + (l1 - l0) * (halfway - t0) / (t1 - t0);
            at.exp2() / 2.0
        })
    })
}

#[cfg(feature = "cuda")]
pub use probe::{measure, Probe};

#[cfg(feature = "cuda")]
mod probe {
    use anyhow::{anyhow, Result};
    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::CudaDevice;
    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

    use super::{l2_from_chase, MemorySystem, DRAM_SET_MIB, L2_SETS_MIB};

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

// Line i of a ring (128 bytes, 32 words) holds i in its first word.
extern "C" __global__ void migprof_ring(unsigned int* ring, unsigned int lines) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < lines) ring[(unsigned long long)i * 32] = i;
}

// Reads every line once, through L2, so that the cache holds what it can of the ring.
extern "C" __global__ void migprof_touch(const unsigned int* ring, unsigned int lines, unsigned int* sink) {
    unsigned int acc = 0;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < lines; i += gridDim.x * blockDim.x)
        acc += ring[(unsigned long long)i * 32];
    if (acc == 0xffffffffu) sink[0] = acc;
}

__device__ unsigned int migprof_mix(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// Each thread reads `steps` lines, each chosen by hashing the value the load before returned with
// the step and the thread: uniformly random lines with replacement (a fixed cycle would let some
// caches keep nothing and others everything), every load depending on the one before, bypassing L1.
// `seed` differs per launch, so that launches do not reread the same lines.
extern "C" __global__ void migprof_chase(const unsigned int* ring, unsigned int lines, unsigned int steps,
                                         unsigned int seed, unsigned int* sink) {
    unsigned int chain = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int at = migprof_mix(chain ^ seed) & (lines - 1);
    for (unsigned int s = 0; s < steps; s++) {
        unsigned int value;
        asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(value) : "l"(ring + (unsigned long long)at * 32));
        at = migprof_mix(value ^ (s * 0x9e3779b9u) ^ (chain << 20) ^ seed) & (lines - 1);
    }
    if (at == 0xffffffffu) sink[0] = at;
}

// Eight independent multiply-adds per thread and no memory: a kernel bound by the SMs alone.
extern "C" __global__ void migprof_fma(float* sink, unsigned int iters) {
    float a = threadIdx.x, b = a + 1.f, c = a + 2.f, d = a + 3.f, e = a + 4.f, f = a + 5.f, g = a + 6.f, h = a + 7.f;
    for (unsigned int i = 0; i < iters; i++) {
        a = fmaf(a, 0.9999f, 0.5f); b = fmaf(b, 0.9999f, 0.5f); c = fmaf(c, 0.9999f, 0.5f); d = fmaf(d, 0.9999f, 0.5f);
        e = fmaf(e, 0.9999f, 0.5f); f = fmaf(f, 0.9999f, 0.5f); g = fmaf(g, 0.9999f, 0.5f); h = fmaf(h, 0.9999f, 0.5f);
    }
    if (a + b + c + d + e + f + g + h == -1.f) sink[0] = a;
}
"#;

    const MIB: u64 = 1 << 20;
    const LINE: u64 = 128;
    /// Bytes each way of the copy.
    const COPY_BYTES: u64 = 256 * MIB;
    /// Chains of the chase, and steps each takes in a timed walk.
    const CHASE_BLOCKS: u32 = 4;
    const CHASE_THREADS: u32 = 32;
    const CHASE_STEPS: u32 = 2048;
    /// Multiply-add rounds of the compute probe: a few milliseconds on 16 SMs of an H100.
    const FMA_ITERS: u32 = 20_000;
    /// Rounds of the kernel that fills the client's SMs while its neighbour looks for them: about
    /// 50 ms on an H100 (a round takes as long on any number of SMs), far longer than the
    /// neighbour needs to finish its launch and place its grid.
    const FILL_ITERS: u32 = 750_000;

    /// The probe's kernels and buffers on one device, for measurements repeated while a neighbour's
    /// setting changes. Its memory goes back to the driver when it is dropped.
    pub struct Probe {
        cuda: CudaDevice,
        stream: std::sync::Arc<CudaStream>,
        sms: u32,
        copy: CudaFunction,
        ring: CudaFunction,
        touch: CudaFunction,
        chase: CudaFunction,
        fma: CudaFunction,
        src: CudaSlice<u8>,
        dst: CudaSlice<u8>,
        sink: CudaSlice<u32>,
    }

    impl Probe {
        /// The probe on `device`, whose kernels may run on `sms` SMs. Make it before the allocation
        /// pool is set up.
        pub fn new(device: &candle_core::Device, sms: u32) -> Result<Probe> {
            let cuda = device.as_cuda_device()?.clone();
            let ptx = cudarc::nvrtc::compile_ptx(SOURCE)
                .map_err(|e| anyhow!("compiling the memory-system probe with NVRTC: {e:?}"))?
                .to_src();
            let load = |name: &str| -> Result<CudaFunction> {
                Ok(cuda
                    .get_or_load_custom_func(name, "migprof_memory_system", &ptx)?
                    .into_cuda_function())
            };
            Ok(Probe {
                copy: load("migprof_copy")?,
                ring: load("migprof_ring")?,
                touch: load("migprof_touch")?,
                chase: load("migprof_chase")?,
                fma: load("migprof_fma")?,
                src: cuda.alloc_zeros::<u8>(COPY_BYTES as usize)?,
                dst: cuda.alloc_zeros::<u8>(COPY_BYTES as usize)?,
                sink: cuda.alloc_zeros::<u32>(1)?,
                sms: sms.max(1),
                stream: cuda.cuda_stream(),
                cuda,
            })
        }

        /// DRAM bandwidth of a streaming copy, GB/s, reads and writes counted.
        pub fn bandwidth_gbps(&mut self) -> Result<f64> {
            let n = COPY_BYTES / 16;
            let cfg = grid(self.sms * 8, 256);
            let (stream, copy, src, dst) = (&self.stream, &self.copy, &self.src, &mut self.dst);
            let ms = median_ms(&self.cuda, &mut || {
                let mut args = stream.launch_builder(copy);
                args.arg(src).arg(&mut *dst).arg(&n);
                // SAFETY: (const float4*, float4*, n): both buffers hold n float4.
                unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the copy probe: {e:?}"))?;
                Ok(())
            })?;
            Ok(2.0 * COPY_BYTES as f64 / (ms * 1e-3) / 1e9)
        }

        /// DRAM bandwidth of back-to-back streaming copies over at least `window_ms`, GB/s: beside a
        /// neighbour whose blocks are placed anew at each of its launches (every few milliseconds),
        /// one copy of a millisecond reads whichever placement it met; a window of many launches
        /// reads their mean (the readings are in benches/results/*-slice-fidelity.md).
        pub fn bandwidth_over_gbps(&mut self, window_ms: f64) -> Result<f64> {
            let n = COPY_BYTES / 16;
            let cfg = grid(self.sms * 8, 256);
            let once_gbps = self.bandwidth_gbps()?;
            let once_ms = 2.0 * COPY_BYTES as f64 / (once_gbps * 1e9) * 1e3;
            let copies = (window_ms / once_ms).ceil().clamp(1.0, 10_000.0) as u32;
            let (stream, copy, src, dst) = (&self.stream, &self.copy, &self.src, &mut self.dst);
            let ms = timed_ms(&self.cuda, &mut || {
                for _ in 0..copies {
                    let mut args = stream.launch_builder(copy);
                    args.arg(src).arg(&mut *dst).arg(&n);
                    // SAFETY: (const float4*, float4*, n): both buffers hold n float4.
                    unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the copy probe: {e:?}"))?;
                }
                Ok(())
            })?;
            Ok(f64::from(copies) * 2.0 * COPY_BYTES as f64 / (ms * 1e-3) / 1e9)
        }

        /// The L2 the process effectively has, MiB ([`l2_from_chase`]); `None` where it found no step.
        pub fn l2_mib(&mut self) -> Result<Option<f64>> {
            let mut times = Vec::new();
            for &mib in &L2_SETS_MIB {
                times.push((mib, self.chase_ns(mib)?));
            }
            let dram_ns = self.chase_ns(DRAM_SET_MIB)?;
            Ok(l2_from_chase(&times, dram_ns))
        }

        /// [`Probe::l2_mib`], with a chase that fails said as a warning: the L2 is then unknown
        /// rather than the bandwidth lost.
        pub fn l2_mib_or_warn(&mut self) -> Option<f64> {
            self.l2_mib()
                .map_err(|e| eprintln!("warning: could not measure the slice's L2: {e:#}"))
                .ok()
                .flatten()
        }

        /// The time of one dependent load in a ring of `mib` MiB, ns.
        fn chase_ns(&mut self, mib: u32) -> Result<f64> {
            let lines = (u64::from(mib) * MIB / LINE) as u32;
            let mut ring = self.cuda.alloc_zeros::<u32>((u64::from(mib) * MIB / 4) as usize)?;
            let mut args = self.stream.launch_builder(&self.ring);
            args.arg(&mut ring).arg(&lines);
            // SAFETY: (unsigned int*, lines): the ring holds 32 words per line.
            unsafe { args.launch(grid(lines.div_ceil(256), 256)) }.map_err(|e| anyhow!("building a ring: {e:?}"))?;
            let mut args = self.stream.launch_builder(&self.touch);
            args.arg(&ring).arg(&lines).arg(&mut self.sink);
            // SAFETY: (const unsigned int*, lines, unsigned int*): as above; the sink holds one word.
            unsafe { args.launch(grid(self.sms * 8, 256)) }.map_err(|e| anyhow!("reading a ring: {e:?}"))?;
            let (stream, chase, sink) = (&self.stream, &self.chase, &mut self.sink);
            let mut seed = 0u32;
            let ms = median_ms(&self.cuda, &mut || {
                seed = seed.wrapping_add(0x6d2b_79f5);
                let mut args = stream.launch_builder(chase);
                args.arg(&ring).arg(&lines).arg(&CHASE_STEPS).arg(&seed).arg(&mut *sink);
                // SAFETY: (const unsigned int*, lines, steps, seed, unsigned int*): every index is
                // masked to a line of the ring.
                unsafe { args.launch(grid(CHASE_BLOCKS, CHASE_THREADS)) }
                    .map_err(|e| anyhow!("launching the chase: {e:?}"))?;
                Ok(())
            })?;
            Ok(ms * 1e6 / f64::from(CHASE_STEPS))
        }

        /// The time of a kernel bound by the SMs alone, ms: slower beside a neighbour only when the
        /// neighbour computes on the same SMs.
        pub fn compute_ms(&mut self) -> Result<f64> {
            let (stream, fma, sink, sms) = (&self.stream, &self.fma, &mut self.sink, self.sms);
            median_ms(&self.cuda, &mut || launch_fma(stream, fma, sink, sms, FMA_ITERS))
        }

        /// Runs `during` while the compute probe's kernel, long enough to outlast it, fills every
        /// thread slot of the SMs this process has; the kernel is waited for before returning.
        pub fn while_filling<T>(&mut self, during: impl FnOnce() -> Result<T>) -> Result<T> {
            launch_fma(&self.stream, &self.fma, &mut self.sink, self.sms, FILL_ITERS)?;
            let found = during();
            self.stream
                .synchronize()
                .map_err(|e| anyhow!("waiting for the kernel that fills the SMs: {e:?}"))?;
            found
        }
    }

    /// The compute probe's kernel, `iters` rounds of multiply-adds in eight blocks of 256 threads
    /// (every thread slot) on each of `sms` SMs, launched and not waited for.
    fn launch_fma(
        stream: &CudaStream,
        fma: &CudaFunction,
        sink: &mut CudaSlice<u32>,
        sms: u32,
        iters: u32,
    ) -> Result<()> {
        let mut args = stream.launch_builder(fma);
        args.arg(sink).arg(&iters);
        // SAFETY: (float*, iters): the sink holds one 4-byte word (a float's size) and is only
        // written on a value the arithmetic never reaches.
        unsafe { args.launch(grid(sms * 8, 256)) }.map_err(|e| anyhow!("launching the compute probe: {e:?}"))?;
        Ok(())
    }

    fn grid(blocks: u32, threads: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// The time of one call of `launch`, ms, between two events.
    fn timed_ms(cuda: &CudaDevice, launch: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let stream = cuda.cuda_stream();
        let event = || {
            stream
                .context()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("a CUDA event: {e:?}"))
        };
        let (start, end) = (event()?, event()?);
        start.record(&stream).map_err(|e| anyhow!("{e:?}"))?;
        launch()?;
        end.record(&stream).map_err(|e| anyhow!("{e:?}"))?;
        Ok(f64::from(start.elapsed_ms(&end).map_err(|e| anyhow!("{e:?}"))?))
    }

    /// The median of five timed launches after an untimed one, ms.
    fn median_ms(cuda: &CudaDevice, launch: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        launch()?;
        let mut times = Vec::new();
        for _ in 0..5 {
            times.push(timed_ms(cuda, launch)?);
        }
        times.sort_by(f64::total_cmp);
        Ok(times[2])
    }

    /// Measures the memory system this process reaches on `device`, whose kernels may run on `sms`
    /// SMs. Run it before the allocation pool is set up: its buffers go back to the driver when it
    /// returns. A chase that fails leaves the L2 unknown rather than losing the bandwidth.
    pub fn measure(device: &candle_core::Device, sms: u32) -> Result<MemorySystem> {
        let mut probe = Probe::new(device, sms)?;
        let bandwidth_gbps = probe.bandwidth_gbps()?;
        let l2_mib = probe.l2_mib_or_warn();
        drop(probe);
        device.synchronize()?;
        Ok(MemorySystem { bandwidth_gbps, l2_mib })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chase times of a cache of `c` MiB: a hit's 200 ns, a miss's 600 ns, random accesses hitting
    /// min(1, C/S) of the time.
    fn times(c: f64) -> Vec<(u32, f64)> {
        L2_SETS_MIB
            .iter()
            .map(|&s| {
                let hit = (c / f64::from(s)).min(1.0);
                (s, 200.0 * hit + 600.0 * (1.0 - hit))
            })
            .collect()
    }

    #[test]
    fn the_l2_is_read_where_half_the_loads_hit() {
        // Exact at the sweep's points (S = 2C), close between them.
        for c in [4.0, 16.0, 32.0] {
            let got = l2_from_chase(&times(c), 600.0).unwrap();
            assert!((got - c).abs() < 1e-9, "{c}: {got}");
        }
        let got = l2_from_chase(&times(6.25), 600.0).unwrap();
        assert!((got / 6.25 - 1.0).abs() < 0.1, "{got}");
        let got = l2_from_chase(&times(50.0), 600.0).unwrap();
        assert!((got / 50.0 - 1.0).abs() < 0.1, "{got}");
    }

    #[test]
    fn no_step_or_a_cache_past_the_sweep_has_no_size() {
        // Every set hits: the cache is past 64 MiB.
        assert_eq!(l2_from_chase(&times(1024.0), 600.0), None);
        // DRAM no slower than a hit: nothing to read.
        let flat: Vec<(u32, f64)> = L2_SETS_MIB.iter().map(|&s| (s, 300.0)).collect();
        assert_eq!(l2_from_chase(&flat, 310.0), None);
        assert_eq!(l2_from_chase(&[], 600.0), None);
    }
}
