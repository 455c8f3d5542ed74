//! Steps replayed as CUDA graphs, so that a small batch measures the device, not the host.
//!
//! A step of a small batch is mostly host work: a ResNet-50 inference is a few hundred kernel
//! launches, each a few microseconds of CPU time in candle and the driver, while the kernels
//! themselves take less. A CUDA graph records the launches once and replays them with one call.
//! PyTorch users get the same from `torch.compile(mode="reduce-overhead")`, which is what migprof is
//! compared against.
//!
//! How: the first step of a shape runs as usual and fills every cache a step uses (cuDNN's and
//! cuBLASLt's measured algorithms, compiled kernels, workspaces); the second is captured from candle's
//! stream over copies of its inputs that the graph owns, instantiated and launched; each later one
//! copies its inputs into the graph's (unless they are the very tensors it was captured from) and
//! replays. The caller's tensors are never written. A replay equals a fresh step because:
//! - every allocation of a step comes from `cuMemAllocAsync`, which a capture turns into the graph's
//!   own allocations at fixed addresses, and every one is freed inside the graph: the step's output
//!   (logits, loss) is copied into a tensor allocated before the capture, so **an output is valid
//!   until the next step of the same shape**, as with PyTorch's CUDA graphs. (Letting the output
//!   outlive the graph instead, freed at the next launch, failed with an illegal address when two
//!   graphs took turns: graphs may share physical memory, and an allocation that outlives its graph
//!   is the case that sharing does not cover);
//! - state that outlives a step is updated in place (parameters, optimizer moments, momentum
//!   buffers, batch norm's running statistics) and per-step scalars live in device memory (AdamW's
//!   step count, `kernels::adamw`);
//! - a graph that copies from host memory is never launched: candle's strided and reducing ops copy
//!   their dims and strides from a host vector on every call, and a captured copy reads that vector
//!   again at every launch, long after it was freed. Such a shape's steps run as they are, counted
//!   in [`GraphStats::refused`], so that a user sees that graphs did not apply;
//! - a cuDNN launch inside a capture takes a workspace of its own, which the graph frees after it
//!   (`kernels::conv2d`), so no graph holds the address of a workspace shared outside; cuBLAS is given
//!   one of ours before the first capture (its own would be allocated inside the capture, then used
//!   after the graph's next launch freed it), and nothing that synchronises (an algorithm timed on
//!   first use) can happen inside a capture: it fails instead, naming the way out (CUDA graphs off).

#[cfg(feature = "cuda")]
use std::collections::HashMap;

use candle_core::{Device, Result, Tensor};

/// The shapes and dtypes of a step's inputs: one graph per distinct key.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key(Vec<(Vec<usize>, candle_core::DType)>);

#[cfg(feature = "cuda")]
impl Key {
    fn of(inputs: &[Tensor]) -> Key {
        Key(inputs.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect())
    }
}

/// How many step graphs a workload captured and how many steps replayed one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captured: usize,
    pub replays: u64,
    /// Shapes whose step could not be captured safely (it copies from host memory) and runs as is.
    pub refused: usize,
}

/// One workload's step graphs, by input shape.
#[derive(Default)]
pub(crate) struct StepGraphs {
    /// Whether the device is set up for capture (once per workload).
    #[cfg(feature = "cuda")]
    prepared: bool,
    /// Shapes met once, with the shape and dtype of their step's output.
    #[cfg(feature = "cuda")]
    seen: HashMap<Key, (Vec<usize>, candle_core::DType)>,
    #[cfg(feature = "cuda")]
    captured: HashMap<Key, cuda::Captured>,
    /// Shapes whose capture was refused, with why; their steps run as they are.
    #[cfg(feature = "cuda")]
    refused: HashMap<Key, String>,
    replays: u64,
}

impl StepGraphs {
    /// `step` on `inputs`: run as is the first time their shapes are met (and always off CUDA
    /// devices), captured and launched the second time, replayed from then on.
    pub(crate) fn run(
        &mut self,
        device: &Device,
        inputs: Vec<Tensor>,
        mut step: impl FnMut(&[Tensor]) -> Result<Tensor>,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = device {
            // candle copies the dims and strides of a strided or reducing op from a host vector at
            // every call; with this cache on, each distinct vector is copied once, at a step that is
            // not captured, and kept on the device, so a captured step reads device memory that
            // lives as long as the graph (a miss inside a capture fails it).
            let _layouts = dev.enable_cuda_graph_htod_cache();
            if !self.prepared {
                // One stream and no per-allocation events (cudarc would record and wait on events
                // inside the capture, tying the graph to events used outside it); freed memory kept
                // pooled; cuBLAS's workspace our own. The profiler opens every device so already.
                crate::memory::pool_allocations(device)?;
                cuda::own_cublas_workspace(dev)?;
                crate::kernels::gemm::prepare(dev)?;
                self.prepared = true;
            }
            let key = Key::of(&inputs);
            if let Some(graph) = self.captured.get(&key) {
                let output = graph.replay(&inputs)?;
                self.replays += 1;
                return Ok(output);
            }
            if self.refused.contains_key(&key) {
                return step(&inputs);
            }
            if let Some((shape, dtype)) = self.seen.get(&key) {
                // The memory the uncaptured steps freed into the pool goes back to the driver: the
                // graph reserves its own for as long as it lives, and the two together would hold
                // a training step's activations twice (measured: docs/kernels.md#cuda-graphs).
                crate::memory::release_pooled(device)?;
                if std::env::var_os("MIGPROF_MEMORY_LOG").is_some() {
                    if let Some(ledger) = crate::memory::ledger(device)? {
                        eprintln!("memory: before capturing a step of {key:?}: {ledger}");
                    }
                }
                // A refused capture launched nothing: the step then runs again, as is.
                match cuda::Captured::capture(dev, inputs.clone(), shape, *dtype, &mut step)? {
                    cuda::Capture::Done(graph, output) => {
                        self.captured.insert(key, graph);
                        return Ok(output);
                    }
                    cuda::Capture::Refused(why) => {
                        self.refused.insert(key, why);
                        return step(&inputs);
                    }
                }
            }
            let output = step(&inputs)?;
            self.seen.insert(key, (output.dims().to_vec(), output.dtype()));
            return Ok(output);
        }
        let _ = device;
        step(&inputs)
    }

    pub(crate) fn stats(&self) -> GraphStats {
        #[cfg(feature = "cuda")]
        let (captured, refused) = (self.captured.len(), self.refused.len());
        #[cfg(not(feature = "cuda"))]
        let (captured, refused) = (0, 0);
        GraphStats {
            captured,
            replays: self.replays,
            refused,
        }
    }

    /// Why captures were refused, one line per distinct reason.
    pub(crate) fn refusals(&self) -> Vec<String> {
        #[cfg(feature = "cuda")]
        {
            let mut why: Vec<String> = self.refused.values().cloned().collect();
            why.sort();
            why.dedup();
            why
        }
        #[cfg(not(feature = "cuda"))]
        Vec::new()
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::cell::RefCell;
    use std::collections::HashSet;

    use candle_core::cuda_backend::cudarc::cublas::sys as blas;
    use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DriverError};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{Result, Tensor};

    thread_local! {
        // The cuBLAS handles given our workspace (its owner, `kernels::gemm`, keeps it as long as
        // the thread: a captured graph launches with the address).
        static LENT: RefCell<HashSet<usize>> = RefCell::new(HashSet::new());
    }

    /// Gives the device's cuBLAS handle a workspace of ours, once, at a step that is not captured
    /// (the first of a workload with graphs). Without one, cuBLAS (12.2 and later) takes its workspace
    /// from the stream-ordered allocator on first need, and frees it when given another: inside a
    /// capture, either becomes a node of the graph, replayed at every launch (an illegal address,
    /// seen on the first replay). PyTorch sets one for the same reason. The workspace is cuBLASLt's
    /// (`kernels::gemm::shared_workspace`), as in PyTorch: a second one showed in every graphed
    /// run's device memory (docs/kernels.md#cuda-graphs).
    pub(super) fn own_cublas_workspace(dev: &CudaDevice) -> Result<()> {
        let blas = dev.cublas_handle();
        let handle = *blas.handle();
        if LENT.with(|l| l.borrow().contains(&(handle as usize))) {
            return Ok(());
        }
        let (ptr, bytes) = crate::kernels::gemm::shared_workspace(dev)?;
        // SAFETY: a live handle on the stream the workspace's other user (cuBLASLt) runs on, never at
        // once; the buffer lives as long as this thread, the one that drives the device, its steps
        // and their graphs (candle drives a device from one thread: `kernels::gemm`'s and
        // `kernels::conv2d`'s thread-local handles and workspaces rest on the same premise).
        let status = unsafe { blas::cublasSetWorkspace_v2(handle, ptr as *mut std::ffi::c_void, bytes) };
        if status != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            candle_core::bail!("cuBLAS: setting the workspace: {status:?}")
        }
        LENT.with(|l| l.borrow_mut().insert(handle as usize));
        Ok(())
    }

    fn driver(what: &'static str) -> impl FnOnce(DriverError) -> candle_core::Error {
        move |e| candle_core::Error::Msg(format!("CUDA graph of a step: {what}: {e:?}"))
    }

    /// What a capture gave: a graph (launched once) with the step's output, or why it was refused
    /// (nothing ran).
    pub(super) enum Capture {
        Done(Captured, Tensor),
        Refused(String),
    }

    /// Memcpy nodes of `graph` that read host memory.
    fn host_copies(graph: sys::CUgraph) -> Result<usize> {
        let check = |status: sys::CUresult, what: &str| match status {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(candle_core::Error::Msg(format!("CUDA graph of a step: {what}: {e:?}"))),
        };
        let mut n = 0usize;
        // SAFETY: a valid graph; a null array asks for the count.
        check(
            unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) },
            "counting its nodes",
        )?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        // SAFETY: room for n nodes.
        check(
            unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) },
            "listing its nodes",
        )?;
        let mut host = 0;
        for &node in &nodes[..n] {
            let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of this graph.
            check(unsafe { sys::cuGraphNodeGetType(node, &mut kind) }, "a node's type")?;
            if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY {
                continue;
            }
            let mut params = std::mem::MaybeUninit::<sys::CUDA_MEMCPY3D>::uninit();
            // SAFETY: a memcpy node; the driver writes every field.
            check(
                unsafe { sys::cuGraphMemcpyNodeGetParams(node, params.as_mut_ptr()) },
                "a copy's parameters",
            )?;
            // SAFETY: written by the call above, which succeeded.
            let params = unsafe { params.assume_init() };
            let from_host = match params.srcMemoryType {
                sys::CUmemorytype::CU_MEMORYTYPE_HOST => true,
                // Unified addressing: host memory when no device pointer is given.
                sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED => !params.srcHost.is_null() || params.srcDevice == 0,
                _ => false,
            };
            host += usize::from(from_host);
        }
        Ok(host)
    }

    /// A captured step.
    pub(super) struct Captured {
        /// Where each launch leaves the step's output: allocated before the capture, flat.
        output: Tensor,
        /// The output's shape, as the step returns it.
        shape: Vec<usize>,
        /// What the graph reads: copies of the tensors it was captured with, its own, refilled
        /// before a replay. Never the caller's: each replay's refill would rewrite a tensor the
        /// caller still holds (a generation's first decode token, kept to be read at its end).
        inputs: Vec<Tensor>,
        /// The id of the caller's tensor each input was last copied from: given again, it is
        /// already in place (another tensor copied in since would have replaced it).
        sources: Vec<std::cell::Cell<candle_core::TensorId>>,
        graph: CudaGraph,
    }

    impl Captured {
        /// Captures `step` on `inputs` from the device's stream, its output (of `shape` and `dtype`,
        /// as the step's uncaptured run gave) copied into a tensor of ours, then launches it once:
        /// the step's work is queued when this returns, as an uncaptured step's is.
        pub(super) fn capture(
            dev: &CudaDevice,
            inputs: Vec<Tensor>,
            shape: &[usize],
            dtype: candle_core::DType,
            step: &mut dyn FnMut(&[Tensor]) -> Result<Tensor>,
        ) -> Result<Capture> {
            let sources = inputs.iter().map(|t| std::cell::Cell::new(t.id())).collect();
            // Copied before the capture begins, so the copies are not part of the graph.
            let inputs = inputs
                .iter()
                .map(Tensor::force_contiguous)
                .collect::<Result<Vec<_>>>()?;
            let elements = shape.iter().product::<usize>();
            let output = Tensor::zeros(elements, dtype, &candle_core::Device::Cuda(dev.clone()))?;
            let stream = dev.cuda_stream();
            // Thread-local: a call on this thread that the capture cannot record (a synchronising
            // one) fails the capture instead of being recorded wrong; other threads are free.
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(driver("beginning the capture"))?;
            // The step's own output is dropped inside the capture: the graph frees it.
            let ran = step(&inputs).and_then(|o| {
                if o.dims() != shape || o.dtype() != dtype {
                    candle_core::bail!(
                        "the step's output changed from {shape:?} {dtype:?} to {:?} {:?} between two runs",
                        o.dims(),
                        o.dtype()
                    )
                }
                output.slice_set(&o.flatten_all()?.contiguous()?, 0, 0)
            });
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            let off = "; `--cuda-graphs off` runs every step without graphs";
            let graph = match (ran, graph) {
                (Ok(()), Ok(Some(graph))) => graph,
                (Err(e), _) => candle_core::bail!("the step failed while captured into a CUDA graph: {e}{off}"),
                (Ok(()), Err(e)) => candle_core::bail!("capturing a CUDA graph of the step failed: {e:?}{off}"),
                (Ok(()), Ok(None)) => candle_core::bail!("capturing a CUDA graph of the step recorded nothing{off}"),
            };
            let host = host_copies(graph.cu_graph())?;
            if host > 0 {
                return Ok(Capture::Refused(format!(
                    "the step copies from host memory {host} time(s) (candle's strided and reducing ops copy their layouts so), which a replay would read after it was freed"
                )));
            }
            graph.upload().map_err(driver("uploading"))?;
            graph.launch().map_err(driver("launching"))?;
            let captured = Captured {
                output,
                shape: shape.to_vec(),
                inputs,
                sources,
                graph,
            };
            let output = captured.output()?;
            Ok(Capture::Done(captured, output))
        }

        fn output(&self) -> Result<Tensor> {
            self.output.reshape(self.shape.as_slice())
        }

        /// Copies `inputs` into the graph's own (not those it was captured from, which they hold
        /// already) and replays the graph. The output is rewritten by the next replay.
        pub(super) fn replay(&self, inputs: &[Tensor]) -> Result<Tensor> {
            for ((captured, source), given) in self.inputs.iter().zip(&self.sources).zip(inputs) {
                if source.get() != given.id() {
                    captured.slice_set(&given.contiguous()?, 0, 0)?;
                    source.set(given.id());
                }
            }
            self.graph.launch().map_err(driver("replaying"))?;
            self.output()
        }
    }
}
