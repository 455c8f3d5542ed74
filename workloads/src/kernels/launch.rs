//! What the CUDA side of every custom op needs: one of our kernels loaded and launched, a contiguous
//! view of an input, the kernel's name for a dtype.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchArgs, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CudaStorage, DType, Layout, Result, Storage};

use super::sources::Source;

/// One kernel of our sources on a device: compiled by NVRTC the first time its source is needed,
/// loaded onto the device once (candle's loader keeps it), launched with an error that names it.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
    name: String,
    /// Whether [`Kernel::launch_overlapping`] lets it start before the kernel ahead of it ends: its
    /// source compiled for Hopper, on a GPU that has it.
    overlaps: bool,
}

impl Kernel {
    pub(crate) fn load(dev: &CudaDevice, source: &'static Source, name: &str) -> Result<Kernel> {
        let stream = dev.cuda_stream();
        // An error here is the driver's (maybe one an earlier free left): said, not taken for an
        // older GPU, so that the overlap below always matches the PTX loaded.
        let (major, _) = stream
            .context()
            .compute_capability()
            .map_err(|e| candle_core::Error::Msg(format!("CUDA compute capability, loading {name}: {e:?}")))?;
        let func = dev.get_or_load_custom_func(name, source.module, super::nvrtc::ptx(source, major)?)?;
        Ok(Kernel {
            func: func.into_cuda_function(),
            stream,
            name: name.to_string(),
            overlaps: source.arch_for(major) == super::sources::Arch::Hopper,
        })
    }

    /// The multiprocessors of the device as this process has it ([`multiprocessors`]): what a grid
    /// is sized to fill. Asked by the kernels that size a grid so, not by every kernel's load.
    pub(crate) fn multiprocessors(&self) -> Result<usize> {
        context_multiprocessors(self.stream.context())
    }

    /// The kernel with [`Kernel::launch_overlapping`]'s overlap kept only where `on`: an ordinary
    /// launch otherwise.
    pub(crate) fn overlapping(mut self, on: bool) -> Kernel {
        self.overlaps &= on;
        self
    }

    /// Parameters for [`Kernel::launch_overlapping`], pushed in order by the caller.
    pub(crate) fn params(&self) -> Params {
        Params { slots: Vec::new() }
    }

    /// Launches the kernel on the device's stream so that, on Hopper, it may start while the kernel
    /// ahead of it is still running (programmatic dependent launch): its blocks run up to the
    /// kernel's `griddepcontrol.wait` (`wait_for_inputs` in the sources) while the blocks ahead
    /// finish, and pass it once that kernel, and with it everything before, has ended and its
    /// writes are visible. A decode step's products load their weights in that time, which no
    /// kernel writes. Elsewhere it is an ordinary launch.
    ///
    /// # Safety
    /// As [`Kernel::launch`], with `params` for `args`; and the kernel writes nothing, and reads
    /// nothing that the kernel just ahead of it writes, before its `wait_for_inputs`. What kernels
    /// further back wrote is done by then: each overlapping kernel lets the next one start only
    /// once it has passed its own wait, so a kernel starts after the kernel two ahead has ended.
    pub(crate) unsafe fn launch_overlapping(&self, params: &mut Params, cfg: LaunchConfig) -> Result<()> {
        let mut pointers: Vec<*mut std::ffi::c_void> =
            params.slots.iter_mut().map(|s| (s as *mut u64).cast()).collect();
        let mut overlap = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut overlap,
            numAttrs: u32::from(self.overlaps),
        };
        let failed = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
            candle_core::Error::Msg(format!("CUDA kernel {}: {e:?}", self.name))
        };
        self.stream.context().bind_to_thread().map_err(failed)?;
        // SAFETY: the config and each parameter's slot outlive the call, which copies them; the
        // caller promises the parameters match the kernel and what it reads before its wait.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                pointers.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(failed)
    }

    /// The kernel's arguments, pushed in order by the caller.
    pub(crate) fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Launches the kernel on the device's stream.
    ///
    /// # Safety
    /// `args` were built by [`Kernel::builder`] of this kernel and match its parameters in type and
    /// order, and every buffer holds what the kernel reads and writes under `cfg`.
    pub(crate) unsafe fn launch(&self, args: &mut LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
        // SAFETY: as the caller promises.
        match unsafe { args.launch(cfg) } {
            Ok(_) => Ok(()),
            Err(e) => Err(candle_core::Error::Msg(format!("CUDA kernel {}: {e:?}", self.name))),
        }
    }
}

/// The multiprocessors this process may run on: the driver's count, which is a MIG slice's on a slice
/// and an MPS client's share where `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` holds it (measured on an
/// H200: 13 % is told 16 of 132, 46 % 60), so a grid sized from it fills the slice it runs on and
/// no more; at most what [`hold_multiprocessors`] was given. Read where the compute capability is,
/// when a kernel loads.
pub(crate) fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    context_multiprocessors(dev.cuda_stream().context())
}

fn context_multiprocessors(context: &candle_core::cuda_backend::cudarc::driver::CudaContext) -> Result<usize> {
    let count = context
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| candle_core::Error::Msg(format!("CUDA multiprocessor count: {e:?}")))?;
    let held = HELD_MULTIPROCESSORS.load(std::sync::atomic::Ordering::Relaxed);
    match usize::try_from(count) {
        Ok(n) if n > 0 && held > 0 => Ok(n.min(held)),
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("the CUDA driver reports {count} multiprocessors"),
    }
}

/// The most multiprocessors this process's kernels size their grids to; 0: the driver's count.
static HELD_MULTIPROCESSORS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sizes this process's grids to at most `count` multiprocessors from now on: for a process held to
/// fewer than its driver reports (an MPS client whose driver tells it the whole GPU's count).
pub fn hold_multiprocessors(count: usize) {
    HELD_MULTIPROCESSORS.store(count, std::sync::atomic::Ordering::Relaxed);
}

/// A kernel's parameters for [`Kernel::launch_overlapping`], which cudarc's builder cannot make (it
/// takes no launch attributes). Each value sits in an 8-byte slot from the slot's first byte: the
/// driver copies a parameter of n bytes from the address it is given.
pub(crate) struct Params {
    slots: Vec<u64>,
}

impl Params {
    fn push_bytes(&mut self, bytes: &[u8]) -> &mut Self {
        let mut slot = [0u8; 8];
        slot[..bytes.len()].copy_from_slice(bytes);
        self.slots.push(u64::from_ne_bytes(slot));
        self
    }

    /// A device address ([`address`]), or 0 for a kernel's "none".
    pub(crate) fn ptr(&mut self, address: u64) -> &mut Self {
        self.push_bytes(&address.to_ne_bytes())
    }

    pub(crate) fn u32(&mut self, v: u32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }

    pub(crate) fn f32(&mut self, v: f32) -> &mut Self {
        self.push_bytes(&v.to_ne_bytes())
    }
}

/// The device address of a contiguous tensor's first element: what a kernel launched with
/// [`Params`] is given. The storage must outlive the kernel's run, as a tensor's does (its memory
/// goes back in stream order, after the kernels queued before).
pub(crate) fn address(s: &CudaStorage, l: &Layout, what: &str) -> Result<u64> {
    let Some((start, _)) = l.contiguous_offsets() else {
        bail!("{what} takes contiguous tensors")
    };
    let stream = s.device().cuda_stream();
    let base = match s.dtype() {
        DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        DType::F16 => s.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        other => bail!("{what}: a kernel given addresses takes f32, bf16, f16 or u32, not {other:?}"),
    };
    Ok(base + (start * s.dtype().size_in_bytes()) as u64)
}

/// The device address of memory allocated for a kernel to write ([`address`]'s twin for a slice
/// not yet a tensor's).
pub(crate) fn slice_address<T>(s: &CudaSlice<T>) -> u64 {
    s.device_ptr(s.stream()).0
}

/// Runs `$body` with `$T` the Rust element type of `$dtype` (f32, bf16 or f16), and fails naming
/// those three for any other dtype.
macro_rules! by_dtype {
    ($dtype:expr, $what:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => candle_core::bail!("{} takes f32, bf16 or f16 on CUDA devices, not {other:?}", $what),
        }
    };
}
pub(crate) use by_dtype;

/// "name_f32", "name_bf16" or "name_f16": our kernels' naming of their instantiations.
pub(crate) fn name(base: &str, dtype: DType) -> String {
    let suffix = match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "f32",
    };
    format!("{base}_{suffix}")
}

/// A device's stream as the caches key it: the device's ordinal beside the stream, since candle
/// drives every device of a thread from its per-thread stream, the same handle value for each.
pub(crate) type StreamId = (usize, usize);

pub(crate) fn stream_id(dev: &CudaDevice) -> StreamId {
    let stream = dev.cuda_stream();
    (stream.context().ordinal(), stream.cu_stream() as usize)
}

/// Whether the device's stream is being captured into a graph: what may not synchronise then asks.
pub(crate) fn capturing(dev: &CudaDevice) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus;
    let status = dev
        .cuda_stream()
        .capture_status()
        .map_err(|e| candle_core::Error::Msg(format!("CUDA stream capture status: {e:?}")))?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Refuses to time the candidates of `what` (a `choice` among them: an algorithm, an engine) while
/// the device's stream is captured into a CUDA graph: timing synchronises, which a capture forbids.
/// The step before a capture runs the same shapes, so a shape first met in a capture is an error.
pub(crate) fn refuse_timing_in_capture(dev: &CudaDevice, what: std::fmt::Arguments, choice: &str) -> Result<()> {
    if capturing(dev)? {
        bail!("{what} first met while a CUDA graph is captured: its {choice} cannot be timed then; run with CUDA graphs off")
    }
    Ok(())
}

/// The median time in ms of three launches of `launch` on `stream`, measured with CUDA events after
/// one untimed launch (which pays for first-use costs). Synchronises: never call it while the stream
/// is captured ([`refuse_timing_in_capture`]).
pub(crate) fn median_ms(stream: &Arc<CudaStream>, launch: &dyn Fn() -> Result<()>) -> Result<f32> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let cuda = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        candle_core::Error::Msg(format!("CUDA event: {e:?}"))
    };
    let event = || {
        stream
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda)
    };
    launch()?;
    let mut times = Vec::with_capacity(3);
    for _ in 0..3 {
        let (start, end) = (event()?, event()?);
        start.record(stream).map_err(cuda)?;
        let launched = launch();
        end.record(stream).map_err(cuda)?;
        launched?;
        times.push(start.elapsed_ms(&end).map_err(cuda)?);
    }
    times.sort_by(f32::total_cmp);
    Ok(times[1])
}

/// The contiguous element range of an in-place destination of `what` (an op's name).
pub(crate) fn contiguous_range(l: &Layout, what: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what} updates contiguous tensors")))
}

/// The most blocks of a [`grid_stride`] launch.
const GRID_STRIDE_BLOCKS: u32 = 65535 * 4;

/// The most elements a kernel that keeps its grid-stride index in 32 bits takes: an index one
/// stride of the largest grid past the last element must not wrap below it.
pub(crate) const U32_STRIDE_ELEMENTS: usize = u32::MAX as usize - GRID_STRIDE_BLOCKS as usize * 256;

/// A grid-stride launch over `n` elements (256 threads a block, at most 65535 × 4 blocks) and `n`
/// as the kernel's u32 count; `max` is the most elements `what`'s kernel indexes.
pub(crate) fn grid_stride(n: usize, max: usize, what: &str) -> Result<(LaunchConfig, u32)> {
    if n > max {
        bail!("{what} over {n} elements is more than this kernel indexes")
    }
    let cfg = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256).clamp(1, GRID_STRIDE_BLOCKS), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((cfg, n as u32))
}

/// One thread: the kernels that move a step's scalars on (an optimizer's step count, a loss scale).
pub(crate) const ONE_THREAD: LaunchConfig = LaunchConfig {
    grid_dim: (1, 1, 1),
    block_dim: (1, 1, 1),
    shared_mem_bytes: 0,
};

/// The elements of a contiguous tensor on the device, from its first one.
pub(crate) fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("{what} takes contiguous tensors")
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// The CUDA storage behind a tensor an op holds besides its arguments (a saved input of the forward
/// pass that a backward kernel reads).
pub(crate) fn cuda<'a>(s: &'a Storage, what: &str) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => bail!("{what}: a saved tensor is not on the CUDA device"),
    }
}

/// Elements per word in the widest word of 16, 8, 4 or 2 bytes (else one element) into which every
/// count divides whole: row lengths and start offsets, in elements of `size` bytes. Our kernels move
/// data in such words where every view they touch allows it.
pub(crate) fn word_elements(size: usize, counts: &[usize]) -> usize {
    [16, 8, 4, 2]
        .into_iter()
        .filter(|&w| w >= size)
        .map(|w| w / size)
        .find(|&k| counts.iter().all(|c| c % k == 0))
        .unwrap_or(1)
}

/// Whether every count (row lengths, start offsets) of `size`-byte elements is whole 16-byte words.
pub(crate) fn whole_words(size: usize, counts: &[usize]) -> bool {
    counts.iter().all(|c| (c * size).is_multiple_of(16))
}
