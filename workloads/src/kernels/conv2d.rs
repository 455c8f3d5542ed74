//! 2-D convolution on cuDNN, forward and both backward passes, as candle custom ops.
//!
//! Why not candle's own: candle 0.11 asks cuDNN's heuristics for an algorithm and allocates a zeroed
//! workspace on every call, and launches with the descriptor's default math type, which on Ampere
//! and Hopper lets f32 convolutions use TF32 but keeps bf16 convolutions off the tensor cores; its
//! backward pass goes through a transposed convolution that does not use cuDNN at all. Here each
//! (pass, shape, dtype) is set up once: descriptors built, the algorithms measured with
//! `cudnnFind*` (as PyTorch's `cudnn.benchmark` does) under the math type the precision allows, and
//! the fastest kept, or a leaner one nearly as fast (`kernels::choice`). Outside a CUDA-graph
//! capture one workspace per stream grows to the largest need and is reused; inside one, each launch allocates its own from the stream-ordered pool and frees it after
//! itself, so that the graph's memory holds a workspace only while a convolution runs (as PyTorch's
//! caching allocator hands a workspace back to the activations) and no graph ever holds the address
//! of the shared one, which can then be freed whenever it is outgrown or the pool is released.
//!
//! Precision: f32 runs with `CUDNN_FMA_MATH` (no TF32) unless TF32 is allowed
//! ([`crate::precision::allow_tf32`]); bf16 and f16 run on tensor cores with f32 accumulation
//! (cuDNN's PSEUDO_BFLOAT16/PSEUDO_HALF configurations).

use candle_core::{Result, Tensor};

/// 2-D convolution without bias, dilation or groups: on CUDA devices batched GEMMs for 1x1 stride 1
/// and cuDNN with cached algorithms (when built with cuDNN) for the rest; candle's convolution
/// elsewhere.
pub fn conv2d(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    // 1x1, stride 1: batched GEMMs (faster than cuDNN's NCHW kernels, see `conv1x1`).
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && padding == 0 && stride == 1 && w.rank() == 4 && w.dims()[2..] == [1, 1] {
        return x.contiguous()?.apply_op2(&w.contiguous()?, super::conv1x1::Conv1x1);
    }
    #[cfg(feature = "cudnn")]
    if x.device().is_cuda() {
        let op = cudnn::Conv2d(cudnn::ConvParams { padding, stride });
        return x.contiguous()?.apply_op2(&w.contiguous()?, op);
    }
    x.conv2d(w, padding, stride, 1, 1)
}

/// The gradients of [`conv2d`]'s y for x (when `input_grad`) and w, from dy, by the same kernels as
/// its backward pass: for ops that run convolutions inside their own backward pass (a ResNet block
/// as one op, `models::residual`). CUDA devices built with cuDNN only.
#[cfg(feature = "cudnn")]
pub fn conv2d_grads(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    padding: usize,
    stride: usize,
    input_grad: bool,
) -> Result<(Option<Tensor>, Tensor)> {
    let (x, w, dy) = (x.contiguous()?, w.contiguous()?, dy.contiguous()?);
    if padding == 0 && stride == 1 && w.rank() == 4 && w.dims()[2..] == [1, 1] {
        return super::conv1x1::grads(&x, &w, &dy, input_grad);
    }
    cudnn::grads(&x, &w, &dy, cudnn::ConvParams { padding, stride }, input_grad)
}

#[cfg(feature = "cudnn")]
pub(crate) mod cudnn {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::ffi::c_void;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::{CudaDType, CudaDevice};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
    use cudarc::cudnn::{result as dnn, sys};
    use cudarc::driver::{DevicePtr, DevicePtrMut};

    use super::super::choice::{leanest_near_fastest, Measured};
    use super::super::launch::{stream_id, StreamId};

    /// Workspaces larger than this are not considered (PyTorch bounds them by free memory; a fixed
    /// bound keeps the choice the same from run to run).
    const MAX_WORKSPACE: usize = 1 << 30;

    /// Padding and stride, the same on both sides and in both directions (no dilation, one group: what
    /// the model zoo uses).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct ConvParams {
        pub padding: usize,
        pub stride: usize,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Pass {
        Forward,
        BackwardData,
        BackwardFilter,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    struct Key {
        pass: Pass,
        stream: StreamId,
        dtype: DType,
        tf32: bool,
        x: [i32; 4],
        w: [i32; 4],
        params: ConvParams,
    }

    #[derive(Debug, Clone, Copy)]
    enum Algo {
        Forward(sys::cudnnConvolutionFwdAlgo_t),
        BackwardData(sys::cudnnConvolutionBwdDataAlgo_t),
        BackwardFilter(sys::cudnnConvolutionBwdFilterAlgo_t),
    }

    /// Everything one (pass, shape, dtype) needs, built once.
    struct Prepared {
        x: sys::cudnnTensorDescriptor_t,
        w: sys::cudnnFilterDescriptor_t,
        y: sys::cudnnTensorDescriptor_t,
        conv: sys::cudnnConvolutionDescriptor_t,
        algo: Algo,
        math: sys::cudnnMathType_t,
        workspace: usize,
    }

    #[derive(Default)]
    struct State {
        handles: HashMap<StreamId, sys::cudnnHandle_t>,
        prepared: HashMap<Key, Prepared>,
        /// By stream, for launches outside a capture (no graph holds their address).
        workspace: HashMap<StreamId, cudarc::driver::CudaSlice<u8>>,
    }

    thread_local! {
        // cuDNN handles are not to be shared between threads; candle drives a device from one.
        static STATE: RefCell<State> = RefCell::new(State::default());
    }

    /// The cuDNN handle of this thread for the device's stream (created on first use), which every
    /// cuDNN call of ours shares (`conv_nhwc` too).
    pub(crate) fn handle(dev: &CudaDevice) -> Result<sys::cudnnHandle_t> {
        STATE.with(|state| state.borrow_mut().handle(dev))
    }

    /// A workspace for one cuDNN launch on the device's stream: keep it until the launch is queued.
    pub(crate) enum Workspace {
        None,
        /// The stream's shared workspace (outside a capture).
        Shared(*mut c_void),
        /// The launch's own, from the stream-ordered pool (inside a capture: the graph's allocation,
        /// freed by the graph right after the launch that uses it); held only to be dropped.
        Owned(#[allow(dead_code)] cudarc::driver::CudaSlice<u8>, *mut c_void),
    }

    impl Workspace {
        pub(crate) fn ptr(&self) -> *mut c_void {
            match self {
                Workspace::None => std::ptr::null_mut(),
                Workspace::Shared(p) | Workspace::Owned(_, p) => *p,
            }
        }
    }

    /// A workspace of at least `bytes` for a launch on the device's stream (see the module's comment
    /// for which).
    pub(crate) fn workspace(dev: &CudaDevice, bytes: usize) -> Result<Workspace> {
        if bytes == 0 {
            return Ok(Workspace::None);
        }
        let stream = dev.cuda_stream();
        if crate::kernels::launch::capturing(dev)? {
            // SAFETY: cuDNN writes its workspace before reading it.
            let mut w = unsafe { dev.alloc::<u8>(bytes)? };
            let ptr = w.device_ptr_mut(&stream).0 as *mut c_void;
            return Ok(Workspace::Owned(w, ptr));
        }
        STATE.with(|state| {
            let mut state = state.borrow_mut();
            let id = stream_id(dev);
            if state.workspace.get(&id).is_none_or(|w| w.len() < bytes) {
                // The outgrown one is freed in stream order, after the launches that used it.
                state.workspace.remove(&id);
                // SAFETY: cuDNN writes its workspace before reading it.
                state.workspace.insert(id, unsafe { dev.alloc::<u8>(bytes)? });
            }
            let w = state.workspace.get_mut(&id).expect("inserted above");
            let ptr = w.device_ptr_mut(&stream).0 as *mut c_void;
            Ok(Workspace::Shared(ptr))
        })
    }

    /// Frees this thread's shared workspaces (in stream order): with the pool's free memory, between
    /// runs and before a capture. The next launch outside a capture allocates afresh.
    pub(crate) fn release_workspaces() {
        STATE.with(|state| state.borrow_mut().workspace.clear());
    }

    /// Bytes of this thread's shared workspaces.
    pub(crate) fn workspace_bytes() -> usize {
        STATE.with(|state| state.borrow().workspace.values().map(|w| w.len()).sum())
    }

    fn check(status: std::result::Result<(), cudarc::cudnn::CudnnError>, what: &str) -> Result<()> {
        status.map_err(|e| candle_core::Error::Msg(format!("cuDNN {what}: {e:?}")))
    }

    fn data_type(dtype: DType) -> Result<(sys::cudnnDataType_t, sys::cudnnDataType_t)> {
        use sys::cudnnDataType_t as D;
        // (storage, compute): half types accumulate in f32.
        Ok(match dtype {
            DType::F32 => (D::CUDNN_DATA_FLOAT, D::CUDNN_DATA_FLOAT),
            DType::BF16 => (D::CUDNN_DATA_BFLOAT16, D::CUDNN_DATA_FLOAT),
            DType::F16 => (D::CUDNN_DATA_HALF, D::CUDNN_DATA_FLOAT),
            other => bail!("the cuDNN convolution takes f32, bf16 or f16, not {other:?}"),
        })
    }

    /// The math types a dtype may use: f32 without TF32 stays on FMA units.
    fn allowed_math(dtype: DType, tf32: bool) -> sys::cudnnMathType_t {
        use sys::cudnnMathType_t as M;
        // Tensor-op math lets f32 data use TF32 and half types use their own tensor-core paths; it
        // never converts f32 data down to half precision (that is the _ALLOW_CONVERSION variant).
        if dtype == DType::F32 && !tf32 {
            M::CUDNN_FMA_MATH
        } else {
            M::CUDNN_TENSOR_OP_MATH
        }
    }

    fn out_side(side: i32, k: i32, p: ConvParams) -> i32 {
        (side + 2 * p.padding as i32 - k) / p.stride as i32 + 1
    }

    impl State {
        fn handle(&mut self, dev: &CudaDevice) -> Result<sys::cudnnHandle_t> {
            let stream = dev.cuda_stream();
            let id = stream_id(dev);
            if let Some(h) = self.handles.get(&id) {
                return Ok(*h);
            }
            let h = dnn::create_handle().map_err(|e| candle_core::Error::Msg(format!("cuDNN handle: {e:?}")))?;
            // SAFETY: a fresh handle and the live stream candle launches on.
            check(
                unsafe { dnn::set_stream(h, stream.cu_stream() as sys::cudaStream_t) },
                "set stream",
            )?;
            self.handles.insert(id, h);
            Ok(h)
        }

        fn prepare(&mut self, handle: sys::cudnnHandle_t, key: Key) -> Result<&Prepared> {
            if let std::collections::hash_map::Entry::Vacant(slot) = self.prepared.entry(key) {
                slot.insert(build(handle, key)?);
            }
            Ok(&self.prepared[&key])
        }
    }

    /// Builds the descriptors and measures the algorithms of one key.
    fn build(handle: sys::cudnnHandle_t, key: Key) -> Result<Prepared> {
        let (storage, compute) = data_type(key.dtype)?;
        let [n, _, h, w] = key.x;
        let [k, _, kh, kw] = key.w;
        let y_dims = [n, k, out_side(h, kh, key.params), out_side(w, kw, key.params)];
        let fmt = sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        let x = dnn::create_tensor_descriptor().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        let y = dnn::create_tensor_descriptor().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        let wd = dnn::create_filter_descriptor().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        let conv = dnn::create_convolution_descriptor().map_err(|e| candle_core::Error::Msg(format!("{e:?}")))?;
        let (pad, stride) = (key.params.padding as i32, key.params.stride as i32);
        let math = allowed_math(key.dtype, key.tf32);
        // SAFETY: descriptors just created, set once here and kept for the life of the thread.
        unsafe {
            check(dnn::set_tensor4d_descriptor(x, fmt, storage, key.x), "x descriptor")?;
            check(dnn::set_tensor4d_descriptor(y, fmt, storage, y_dims), "y descriptor")?;
            check(
                dnn::set_filter4d_descriptor(wd, storage, fmt, key.w),
                "filter descriptor",
            )?;
            let mode = sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
            check(
                dnn::set_convolution2d_descriptor(conv, pad, pad, stride, stride, 1, 1, mode, compute),
                "conv descriptor",
            )?;
            check(dnn::set_convolution_math_type(conv, math), "math type")?;
        }
        // Of the algorithms cuDNN measured that succeeded within the workspace bound, the fastest or
        // a leaner one nearly as fast (`kernels::choice`). One rule for the three passes, whose perf
        // types differ.
        macro_rules! chosen {
            ($perf:ty, $find:expr, $variant:ident, $what:literal) => {{
                let mut count = 0;
                // SAFETY: zeroed plain-data results.
                let mut perf = [unsafe { std::mem::zeroed::<$perf>() }; 8];
                // SAFETY: valid descriptors; cuDNN allocates its own buffers for the measurement and
                // fills at most 8 results.
                unsafe { ($find)(8, &mut count, perf.as_mut_ptr()) }
                    .result()
                    .map_err(|e| candle_core::Error::Msg(format!("cuDNN find {}: {e:?}", $what)))?;
                let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
                // MIGPROF_CUDNN_LOG=1: what cuDNN measured, to see why an algorithm was chosen.
                if std::env::var_os("MIGPROF_CUDNN_LOG").is_some() {
                    for p in &perf[..count as usize] {
                        eprintln!(
                            "cudnn {} {key:?}: {:?} {:?} {:.3} ms, {} B workspace, {:?}",
                            $what, p.algo, p.status, p.time, p.memory, p.mathType
                        );
                    }
                }
                let usable: Vec<_> = perf[..count as usize]
                    .iter()
                    .filter(|p| p.status == ok && p.memory <= MAX_WORKSPACE)
                    .collect();
                let measured: Vec<_> = usable
                    .iter()
                    .map(|p| Measured {
                        ms: p.time,
                        workspace: p.memory,
                    })
                    .collect();
                let p = leanest_near_fastest(&measured).map(|i| usable[i]);
                let p =
                    p.ok_or_else(|| candle_core::Error::Msg(format!("cuDNN has no {} algorithm for {key:?}", $what)))?;
                (Algo::$variant(p.algo), p.mathType, p.memory)
            }};
        }
        let (algo, math, workspace) = match key.pass {
            Pass::Forward => chosen!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                |n, c, out| sys::cudnnFindConvolutionForwardAlgorithm(handle, x, wd, conv, y, n, c, out),
                Forward,
                "forward"
            ),
            Pass::BackwardData => chosen!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                |n, c, out| sys::cudnnFindConvolutionBackwardDataAlgorithm(handle, wd, y, conv, x, n, c, out),
                BackwardData,
                "backward-data"
            ),
            Pass::BackwardFilter => chosen!(
                sys::cudnnConvolutionBwdFilterAlgoPerf_t,
                |n, c, out| sys::cudnnFindConvolutionBackwardFilterAlgorithm(handle, x, y, conv, wd, n, c, out),
                BackwardFilter,
                "backward-filter"
            ),
        };
        Ok(Prepared {
            x,
            w: wd,
            y,
            conv,
            algo,
            math,
            workspace,
        })
    }

    fn dims4(l: &Layout) -> Result<[i32; 4]> {
        let (a, b, c, d) = l.shape().dims4()?;
        Ok([a as i32, b as i32, c as i32, d as i32])
    }

    /// Runs one pass. `a` and `b` are the op's inputs (forward: x, w; backward data: dy, w; backward
    /// filter: x, dy); the result has `out_shape`.
    fn launch(
        pass: Pass,
        params: ConvParams,
        x_dims: [i32; 4],
        w_dims: [i32; 4],
        a: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        out_shape: Shape,
    ) -> Result<(CudaStorage, Shape)> {
        if !a.1.is_contiguous() || !b.1.is_contiguous() {
            bail!("the cuDNN convolution takes contiguous tensors")
        }
        let dev = a.0.device().clone();
        let dtype = a.0.dtype();
        let tf32 = crate::precision::tf32_allowed();
        let key = Key {
            pass,
            stream: stream_id(&dev),
            dtype,
            tf32,
            x: x_dims,
            w: w_dims,
            params,
        };
        let out = match dtype {
            DType::F32 => run::<f32>(&dev, key, a, b, &out_shape)?,
            DType::BF16 => run::<half::bf16>(&dev, key, a, b, &out_shape)?,
            DType::F16 => run::<half::f16>(&dev, key, a, b, &out_shape)?,
            other => bail!("the cuDNN convolution takes f32, bf16 or f16, not {other:?}"),
        };
        Ok((out, out_shape))
    }

    fn run<T: CudaDType + cudarc::driver::DeviceRepr>(
        dev: &CudaDevice,
        key: Key,
        a: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        out_shape: &Shape,
    ) -> Result<CudaStorage> {
        let stream = dev.cuda_stream();
        let a_slice = a.0.as_cuda_slice::<T>()?.slice(a.1.start_offset()..);
        let b_slice = b.0.as_cuda_slice::<T>()?.slice(b.1.start_offset()..);
        // SAFETY: every element is written by the convolution (beta = 0).
        let mut out = unsafe { dev.alloc::<T>(out_shape.elem_count())? };
        let (alpha, beta) = (1f32, 0f32);
        let (alpha, beta) = (
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
        );
        let (handle, xd, wd, yd, conv, algo, math, need) = STATE.with(|state| -> Result<_> {
            let mut state = state.borrow_mut();
            let handle = state.handle(dev)?;
            let p = state.prepare(handle, key)?;
            Ok((handle, p.x, p.w, p.y, p.conv, p.algo, p.math, p.workspace))
        })?;
        let ws = workspace(dev, need)?;
        let ws_ptr = ws.ptr();
        {
            let (ap, _ga) = a_slice.device_ptr(&stream);
            let (bp, _gb) = b_slice.device_ptr(&stream);
            let (op, _go) = out.device_ptr_mut(&stream);
            let (ap, bp, op) = (ap as *const c_void, bp as *const c_void, op as *mut c_void);
            // SAFETY: descriptors of these shapes and dtype, pointers to buffers of those sizes on the
            // handle's stream, a workspace at least as large as the algorithm asked for.
            unsafe {
                check(dnn::set_convolution_math_type(conv, math), "math type")?;
                match algo {
                    Algo::Forward(al) => check(
                        dnn::convolution_forward(handle, alpha, xd, ap, wd, bp, conv, al, ws_ptr, need, beta, yd, op),
                        "forward",
                    ),
                    Algo::BackwardData(al) => check(
                        dnn::convolution_backward_data(
                            handle, alpha, wd, bp, yd, ap, conv, al, ws_ptr, need, beta, xd, op,
                        ),
                        "backward data",
                    ),
                    Algo::BackwardFilter(al) => check(
                        dnn::convolution_backward_filter(
                            handle, alpha, xd, ap, yd, bp, conv, al, ws_ptr, need, beta, wd, op,
                        ),
                        "backward filter",
                    ),
                }?
            }
        }
        // The workspace (if the launch's own) is freed after the launch, in stream order.
        drop(ws);
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// y = conv2d(x, w). Inputs: x [n, c, h, w], w [k, c, kh, kw].
    #[derive(Debug, Clone, Copy)]
    pub struct Conv2d(pub ConvParams);

    /// dx from (dy, w); carries the input's dims.
    #[derive(Debug, Clone, Copy)]
    struct Conv2dBackwardData(ConvParams, [i32; 4]);

    /// dw from (x, dy); carries the filter's dims.
    #[derive(Debug, Clone, Copy)]
    struct Conv2dBackwardFilter(ConvParams, [i32; 4]);

    fn cpu_refused(name: &str) -> Result<(CpuStorage, Shape)> {
        bail!("{name} runs on CUDA devices only; on the CPU migprof uses candle's convolution")
    }

    impl CustomOp2 for Conv2d {
        fn name(&self) -> &'static str {
            "cudnn-conv2d"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (xd, wd) = (dims4(xl)?, dims4(wl)?);
            if xd[1] != wd[1] {
                bail!("conv2d: input has {} channels, the filter expects {}", xd[1], wd[1])
            }
            let out = Shape::from((
                xd[0] as usize,
                wd[0] as usize,
                out_side(xd[2], wd[2], self.0) as usize,
                out_side(xd[3], wd[3], self.0) as usize,
            ));
            launch(Pass::Forward, self.0, xd, wd, (x, xl), (w, wl), out)
        }

        fn bwd(
            &self,
            x: &Tensor,
            w: &Tensor,
            _res: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            // The input's gradient only where something upstream takes it: not for the images of a
            // stem or patch embedding, which saves cuDNN time every step (measured:
            // docs/kernels.md#conv2d).
            let (dx, dw) = grads(x, w, &grad.contiguous()?, self.0, x.track_op())?;
            Ok((dx, Some(dw)))
        }
    }

    /// dx (when `input_grad`) and dw of y = conv2d(x, w) from dy, all contiguous.
    pub(super) fn grads(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        params: ConvParams,
        input_grad: bool,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let (xd, wd) = (dims4(x.layout())?, dims4(w.layout())?);
        let dx = if input_grad {
            Some(dy.apply_op2_no_bwd(w, &Conv2dBackwardData(params, xd))?)
        } else {
            None
        };
        let dw = x.apply_op2_no_bwd(dy, &Conv2dBackwardFilter(params, wd))?;
        Ok((dx, dw))
    }

    impl CustomOp2 for Conv2dBackwardData {
        fn name(&self) -> &'static str {
            "cudnn-conv2d-backward-data"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }

        fn cuda_fwd(
            &self,
            dy: &CudaStorage,
            dyl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let x = self.1;
            let out = Shape::from((x[0] as usize, x[1] as usize, x[2] as usize, x[3] as usize));
            launch(Pass::BackwardData, self.0, x, dims4(wl)?, (dy, dyl), (w, wl), out)
        }
    }

    impl CustomOp2 for Conv2dBackwardFilter {
        fn name(&self) -> &'static str {
            "cudnn-conv2d-backward-filter"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            dy: &CudaStorage,
            dyl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let w = self.1;
            let out = Shape::from((w[0] as usize, w[1] as usize, w[2] as usize, w[3] as usize));
            launch(Pass::BackwardFilter, self.0, dims4(xl)?, w, (x, xl), (dy, dyl), out)
        }
    }
}
