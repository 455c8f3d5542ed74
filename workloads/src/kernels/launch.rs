//! What the CUDA side of every custom op needs: one of our kernels loaded and launched, a contiguous
//! view of an input, the kernel's name for a dtype.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, CudaView, DeviceRepr, LaunchArgs, LaunchConfig,
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
}

impl Kernel {
    pub(crate) fn load(dev: &CudaDevice, source: &'static Source, name: &str) -> Result<Kernel> {
        let func = dev.get_or_load_custom_func(name, source.module, super::nvrtc::ptx(source)?)?;
        Ok(Kernel {
            func: func.into_cuda_function(),
            stream: dev.cuda_stream(),
            name: name.to_string(),
        })
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
