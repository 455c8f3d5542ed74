//! Inference convolutions over NHWC on cuDNN's current engines: y = act(conv(x, w) + bias [+ residual])
//! as one kernel where cuDNN's runtime-fusion engines take the graph, ResNet's every convolution
//! with its folded batch norm, its residual add and its ReLU.
//!
//! Why: in NCHW, cuDNN 9 on Hopper runs ResNet's convolutions in its legacy kernels, and every
//! convolution is followed by a bias/ReLU pass and every block by an add pass over memory; PyTorch
//! in channels_last reaches the sm90 NHWC implicit-GEMM kernels, several times faster
//! (docs/kernels.md#convolutions). Here the activations stay
//! NHWC from the stem to the pool, weights are kept as KRSC (filter channels last, as those engines
//! read them), and the epilogue does what the passes did, in f32 before the one rounding to the
//! output's dtype.
//!
//! Each (shape, dtype, epilogue) is set up once per thread: the operation graph built, cuDNN's
//! heuristics asked for engines, those whose numerics the precision allows kept (f32 without TF32
//! keeps engines off tensor cores; no engine that narrows inputs or sums), and these timed on the
//! first call's own tensors — as PyTorch's `cudnn.benchmark` does — to keep the fastest, or a
//! leaner one nearly as fast (`kernels::choice`). When no engine fuses
//! the epilogue, the convolution runs alone and our bias/ReLU and add kernels finish the job.
//!
//! Training ([`conv_nhwc_train`]) takes the convolution alone, with its two backward passes (the
//! input's gradient, backward data, and the filter's, backward filter) as graphs of their own, set
//! up and timed the same way; batch norm, ReLU and the residual add are our kernels over NHWC
//! (`kernels::batch_norm`, `kernels::elementwise`).

use candle_core::{Result, Tensor};

/// act(conv(x, w) + bias [+ residual]) over NHWC: x [n, h, w, c], w [k, r, s, c] (KRSC), bias [k],
/// residual [n, oh, ow, k]; the same padding and stride on both axes. CUDA devices built with cuDNN
/// only: elsewhere ResNet stays NCHW.
///
/// ResNet takes this path for half types and for f32 with TF32 allowed ([`runs_nhwc`]); f32 without
/// TF32 stays NCHW, since cuDNN's NHWC engines off the tensor cores were slower than its NCHW ones
/// and missing for some of ResNet-50's shapes (docs/kernels.md#convolutions).
pub fn conv_nhwc(
    x: &Tensor,
    w: &Tensor,
    bias: &Tensor,
    residual: Option<&Tensor>,
    padding: usize,
    stride: usize,
    relu: bool,
) -> Result<Tensor> {
    cudnn::conv_nhwc(x, w, bias, residual, padding, stride, relu)
}

/// conv(x, w) over NHWC with gradients for training: x [n, h, w, c], w [k, r, s, c] (KRSC) to
/// [n, oh, ow, k], without bias; the input's gradient only where something upstream takes it (not
/// for a stem's images). CUDA devices built with cuDNN only.
pub fn conv_nhwc_train(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
    cudnn::conv_nhwc_train(x, w, padding, stride)
}

/// The gradients of [`conv_nhwc_train`]'s y for its x (when `input_grad`) and its w, from dy: for ops
/// that run a convolution inside their own backward pass (a ResNet block as one op).
pub fn conv_nhwc_grads(
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    padding: usize,
    stride: usize,
    input_grad: bool,
) -> Result<(Option<Tensor>, Tensor)> {
    cudnn::conv_nhwc_grads(x, w, dy, padding, stride, input_grad)
}

/// Whether a convolution of `dtype` runs faster over NHWC than over NCHW: half types, and f32 when
/// TF32 is allowed (both on the tensor cores).
pub fn runs_nhwc(dtype: candle_core::DType) -> bool {
    dtype != candle_core::DType::F32 || crate::precision::tf32_allowed()
}

/// How many (shape, dtype, epilogue) keys this thread has set up: tests check that the NHWC path ran.
pub fn shapes_prepared() -> usize {
    cudnn::shapes_prepared()
}

mod cudnn {
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::ffi::c_void;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::cudnn::sys;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DeviceRepr};
    use candle_core::cuda_backend::{CudaDType, CudaDevice};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

    use super::super::choice::{leanest_near_fastest, Measured};
    use super::super::conv2d::cudnn as dnn;
    use super::super::cudnn_graph::{
        data_type, Graph, GraphBuilder, Numerics, Plan, Tensor as GraphTensor, VariantPack,
    };
    use crate::kernels::launch::{by_dtype, refuse_timing_in_capture, stream_id, StreamId};
    use crate::kernels::{add, bias_act, Act, BiasAxis};

    /// Engines kept per graph: the heuristics' first few are where the fast ones are.
    const CANDIDATES: usize = 8;

    /// Engines needing a larger workspace are not considered (as for the legacy calls, `conv2d`).
    const MAX_WORKSPACE: usize = 1 << 30;

    /// Launches per timing of a candidate: back to back, so that the host's work per launch hides
    /// behind the device's (the chosen engine is replayed from a CUDA graph, without it).
    const TIMED_LAUNCHES: usize = 4;

    /// Ids of the graph's tensors in the variant pack.
    const X: i64 = 1;
    const W: i64 = 2;
    const BIAS: i64 = 3;
    const RESIDUAL: i64 = 4;
    const Y: i64 = 5;

    /// The epilogue after the convolution, in the graph or (when unfused) in our kernels.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    struct Epilogue {
        residual: bool,
        relu: bool,
    }

    /// Which of the convolution's three passes a graph computes.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    enum Pass {
        /// y from (x, w), with the key's epilogue.
        Forward,
        /// dx from (dy, w).
        Data,
        /// dw from (x, dy).
        Filter,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    struct Key {
        pass: Pass,
        stream: StreamId,
        dtype: DType,
        tf32: bool,
        /// x as (n, c, h, w), w as (k, c, r, s): cuDNN's logical order.
        x: [i64; 4],
        w: [i64; 4],
        padding: i64,
        stride: i64,
        /// None: the convolution alone (always, for the backward passes).
        fused: Option<Epilogue>,
    }

    impl Key {
        /// Refuses a stride of 0 and a filter larger than the padded input (cuDNN would be asked
        /// for an output of no or negative size).
        fn checked(self) -> Result<Key> {
            let [_, _, oh, ow] = self.y();
            if self.stride < 1 || self.padding < 0 || oh < 1 || ow < 1 {
                bail!(
                    "conv_nhwc: a {}x{} filter, padding {}, stride {} over a {}x{} input",
                    self.w[2],
                    self.w[3],
                    self.padding,
                    self.stride,
                    self.x[2],
                    self.x[3]
                )
            }
            Ok(self)
        }

        fn y(&self) -> [i64; 4] {
            let side = |s: i64, k: i64| (s + 2 * self.padding - k) / self.stride + 1;
            [
                self.x[0],
                self.w[0],
                side(self.x[2], self.w[2]),
                side(self.x[3], self.w[3]),
            ]
        }
    }

    /// One key's engines: none when cuDNN has no engine for the graph that the precision allows.
    struct Prepared {
        /// The candidates, then only the chosen one once timed (the others' compiled kernels freed).
        /// Declared before the graph, so dropped before it.
        candidates: Vec<Plan>,
        /// Whether the candidates were timed and all but the chosen one dropped.
        chosen: bool,
        /// Kept as long as its plans: cuDNN's documentation does not promise that a plan outlives
        /// the graph its engine configuration came from. None when cuDNN refused the graph.
        _graph: Option<Graph>,
    }

    thread_local! {
        static PREPARED: RefCell<HashMap<Key, Prepared>> = RefCell::new(HashMap::new());
    }

    /// The graph of a key: conv, then + bias, + residual, ReLU as the epilogue asks, the last op
    /// writing y; intermediates virtual, in f32.
    fn build(handle: sys::cudnnHandle_t, key: &Key) -> Result<Prepared> {
        let dtype = data_type(key.dtype)?;
        let x = GraphTensor::nhwc(X, dtype, key.x);
        let w = GraphTensor::nhwc(W, dtype, key.w);
        let y = GraphTensor::nhwc(Y, dtype, key.y());
        let mut g = GraphBuilder::new();
        match (key.pass, key.fused) {
            (Pass::Data, _) => g.conv_backward_data(&y, &w, &x, key.padding, key.stride)?,
            (Pass::Filter, _) => g.conv_backward_filter(&x, &y, &w, key.padding, key.stride)?,
            (Pass::Forward, None) => g.conv_forward(&x, &w, &y, key.padding, key.stride)?,
            (Pass::Forward, Some(epilogue)) => {
                use sys::cudnnPointwiseMode_t as Mode;
                let k = key.w[0];
                let bias = GraphTensor::nhwc(BIAS, dtype, [1, k, 1, 1]);
                let residual = GraphTensor::nhwc(RESIDUAL, dtype, key.y());
                // The ops in order, each reading the previous one's output; the last writes y.
                let mut steps: Vec<(Mode, Option<&GraphTensor>)> = vec![(Mode::CUDNN_POINTWISE_ADD, Some(&bias))];
                if epilogue.residual {
                    steps.push((Mode::CUDNN_POINTWISE_ADD, Some(&residual)));
                }
                if epilogue.relu {
                    steps.push((Mode::CUDNN_POINTWISE_RELU_FWD, None));
                }
                let mut current = GraphTensor::virtual_of(100, &y);
                g.conv_forward(&x, &w, &current, key.padding, key.stride)?;
                for (i, (mode, operand)) in steps.iter().enumerate() {
                    let out = if i + 1 == steps.len() {
                        GraphTensor::nhwc(Y, dtype, key.y())
                    } else {
                        GraphTensor::virtual_of(101 + i as i64, &y)
                    };
                    g.pointwise(*mode, &current, *operand, &out)?;
                    current = out;
                }
            }
        }
        let graph = g.finish(handle)?;
        let allowed = |n: Numerics| !n.narrowed && (key.dtype != DType::F32 || key.tf32 || !n.tensor_cores);
        let candidates = graph.plans(handle, CANDIDATES, MAX_WORKSPACE, allowed)?;
        if std::env::var_os("MIGPROF_CUDNN_LOG").is_some() {
            eprintln!("cudnn graph {key:?}: candidates {candidates:?}");
        }
        Ok(Prepared {
            candidates,
            chosen: false,
            _graph: Some(graph),
        })
    }

    pub(super) fn shapes_prepared() -> usize {
        PREPARED.with(|p| p.borrow().len())
    }

    /// Whether cuDNN has an engine for the key (building its graph the first time). A graph cuDNN
    /// refuses to build (an operation it does not support for these shapes) has none, remembered as
    /// such, so that the unfused or padded forms are tried.
    fn has_engine(dev: &CudaDevice, key: Key) -> Result<bool> {
        let handle = dnn::handle(dev)?;
        PREPARED.with(|p| {
            let mut p = p.borrow_mut();
            if let std::collections::hash_map::Entry::Vacant(slot) = p.entry(key) {
                let prepared = build(handle, &key).unwrap_or_else(|e| {
                    if std::env::var_os("MIGPROF_CUDNN_LOG").is_some() {
                        eprintln!("cudnn graph {key:?}: refused: {e}");
                    }
                    Prepared {
                        candidates: Vec::new(),
                        chosen: false,
                        _graph: None,
                    }
                });
                slot.insert(prepared);
            }
            Ok(!p[&key].candidates.is_empty())
        })
    }

    pub(super) fn conv_nhwc(
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        residual: Option<&Tensor>,
        padding: usize,
        stride: usize,
        relu: bool,
    ) -> Result<Tensor> {
        let dev = x.device().as_cuda_device()?.clone();
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let (n, _, _, c) = x.dims4()?;
        let mut key = forward_key(
            &dev,
            &x,
            &w,
            padding,
            stride,
            Some(Epilogue {
                residual: residual.is_some(),
                relu,
            }),
        )?;
        // The graph reads bias and residual at the shapes the key implies: anything else would be
        // read out of bounds on the device.
        let [_, k, oh, ow] = key.y().map(|v| v as usize);
        if bias.dims() != [k] || residual.is_some_and(|r| r.dims() != [n, oh, ow, k]) {
            bail!(
                "conv_nhwc: bias {:?} and residual {:?} for an output of [{n}, {oh}, {ow}, {k}]",
                bias.dims(),
                residual.map(|r| r.dims().to_vec())
            )
        }
        if bias.dtype() != x.dtype() || residual.is_some_and(|r| r.dtype() != x.dtype()) {
            bail!(
                "conv_nhwc: bias and residual must be of the input's dtype {:?}",
                x.dtype()
            )
        }
        if !bias.device().same_device(x.device()) || residual.is_some_and(|r| !r.device().same_device(x.device())) {
            bail!("conv_nhwc: bias and residual must be on the input's device")
        }
        if has_engine(&dev, key)? {
            let op = Conv {
                key,
                bias: Some(bias.contiguous()?),
                residual: residual.map(|t| t.contiguous()).transpose()?,
            };
            return x.apply_op2_no_bwd(&w, &op);
        }
        key.fused = None;
        if !has_engine(&dev, key)? {
            // Engines for NHWC half types read whole 16-byte words of channels: a stem's three
            // colour channels are padded with zeros (which add nothing) to the next multiple of 8.
            let padded = c.next_multiple_of(8);
            if padded != c {
                let (x, w) = (x.pad_with_zeros(3, 0, padded - c)?, w.pad_with_zeros(3, 0, padded - c)?);
                return conv_nhwc(&x, &w, bias, residual, padding, stride, relu);
            }
            bail!("cuDNN has no engine for the NHWC convolution {key:?} (MIGPROF_CUDNN_LOG=1 lists what it proposed)")
        }
        let y = x.apply_op2_no_bwd(
            &w,
            &Conv {
                key,
                bias: None,
                residual: None,
            },
        )?;
        // The epilogue cuDNN would not fuse, in our kernels: bias (and ReLU when nothing follows),
        // then the residual add with the ReLU.
        let last = if relu && residual.is_none() {
            Act::Relu
        } else {
            Act::None
        };
        let y = bias_act(&y, bias, BiasAxis::Last, last)?;
        match residual {
            Some(r) => add(&y, r, relu),
            None => Ok(y),
        }
    }

    /// The op of one key, holding the epilogue's tensors (read on the device, never differentiated).
    #[derive(Debug, Clone)]
    struct Conv {
        key: Key,
        bias: Option<Tensor>,
        residual: Option<Tensor>,
    }

    /// The device address of a contiguous tensor's first element, which must be 16-byte aligned (the
    /// alignment the graph's tensors declare).
    fn address<T: CudaDType + DeviceRepr>(
        s: &CudaStorage,
        l: &Layout,
        stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    ) -> Result<*mut c_void> {
        let Some((start, end)) = l.contiguous_offsets() else {
            bail!("conv_nhwc takes contiguous tensors")
        };
        let view = s.as_cuda_slice::<T>()?.slice(start..end);
        let (ptr, _guard) = view.device_ptr(stream);
        if ptr % 16 != 0 {
            bail!("conv_nhwc: a tensor starts at a device address not aligned to 16 bytes")
        }
        Ok(ptr as *mut c_void)
    }

    /// Runs the key's graph on `inputs` (uid, storage, layout: contiguous, of the key's dtype) into a
    /// new tensor of `out_len` elements, the graph's tensor `out_uid`.
    fn run_graph(
        key: &Key,
        inputs: &[(i64, &CudaStorage, &Layout)],
        out_uid: i64,
        out_len: usize,
    ) -> Result<CudaStorage> {
        let dev = inputs[0].1.device().clone();
        let stream = dev.cuda_stream();
        by_dtype!(key.dtype, "the NHWC convolution", T => {
            // SAFETY: every element is written by the graph's last op (beta = 0).
            let out = unsafe { dev.alloc::<T>(out_len)? };
            let mut tensors = inputs.iter().map(|&(uid, s, l)| Ok((uid, address::<T>(s, l, &stream)?))).collect::<Result<Vec<_>>>()?;
            tensors.push((out_uid, out.device_ptr(&stream).0 as *mut c_void));
            launch(&dev, key, &tensors)?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        })
    }

    /// Runs the key's plan (the candidate chosen by timing them on this first call's tensors) on `tensors`,
    /// the graph's tensors by uid.
    fn launch(dev: &CudaDevice, key: &Key, tensors: &[(i64, *mut c_void)]) -> Result<()> {
        let handle = dnn::handle(dev)?;
        PREPARED.with(|p| -> Result<()> {
            let mut p = p.borrow_mut();
            let Some(prepared) = p.get_mut(key) else {
                bail!("conv_nhwc: {key:?} launched before it was prepared")
            };
            if !prepared.chosen {
                let i = chosen(dev, handle, &prepared.candidates, tensors, key)?;
                let plan = prepared.candidates.swap_remove(i);
                prepared.candidates = vec![plan];
                prepared.chosen = true;
            }
            let plan = &prepared.candidates[0];
            let workspace = dnn::workspace(dev, plan.workspace)?;
            // SAFETY: the pointers address this call's tensors, of the key's shapes and dtype, on
            // the handle's stream; the workspace is at least the plan's.
            unsafe { plan.execute(handle, tensors, workspace.ptr()) }
        })
    }

    /// The forward key of a convolution of contiguous x [n, h, w, c] and w [k, r, s, c], with the
    /// epilogue `fused` (None for training's, whose backward passes take the same key).
    fn forward_key(
        dev: &CudaDevice,
        x: &Tensor,
        w: &Tensor,
        padding: usize,
        stride: usize,
        fused: Option<Epilogue>,
    ) -> Result<Key> {
        let (n, h, wd, c) = x.dims4()?;
        let (k, r, s, fc) = w.dims4()?;
        if c != fc {
            bail!("conv_nhwc: input has {c} channels, the filter expects {fc}")
        }
        if x.dtype() != w.dtype() {
            bail!(
                "conv_nhwc: input {:?} and filter {:?} differ in dtype",
                x.dtype(),
                w.dtype()
            )
        }
        let dims = |a: [usize; 4]| a.map(|v| v as i64);
        Key {
            pass: Pass::Forward,
            stream: stream_id(dev),
            dtype: x.dtype(),
            tf32: crate::precision::tf32_allowed(),
            x: dims([n, c, h, wd]),
            w: dims([k, c, r, s]),
            padding: padding as i64,
            stride: stride as i64,
            fused,
        }
        .checked()
    }

    /// The passes of the convolution `forward` (its forward pass when `with_forward`, the filter's
    /// gradient, and the input's when `input_grad`) that cuDNN has no engine for.
    fn missing_passes(dev: &CudaDevice, forward: Key, with_forward: bool, input_grad: bool) -> Result<Vec<Pass>> {
        let passes = [
            (with_forward, Pass::Forward),
            (true, Pass::Filter),
            (input_grad, Pass::Data),
        ];
        let mut missing = Vec::new();
        for (needed, pass) in passes {
            if needed && !has_engine(dev, Key { pass, ..forward })? {
                missing.push(pass);
            }
        }
        Ok(missing)
    }

    /// dx (when `input_grad`) and dw of the convolution `forward` of contiguous x and w, from a
    /// contiguous dy, each pass's engine found before.
    fn grads(forward: Key, x: &Tensor, w: &Tensor, dy: &Tensor, input_grad: bool) -> Result<(Option<Tensor>, Tensor)> {
        let dx = if input_grad {
            Some(dy.apply_op2_no_bwd(
                w,
                &ConvGrad {
                    key: Key {
                        pass: Pass::Data,
                        ..forward
                    },
                },
            )?)
        } else {
            None
        };
        let dw = x.apply_op2_no_bwd(
            dy,
            &ConvGrad {
                key: Key {
                    pass: Pass::Filter,
                    ..forward
                },
            },
        )?;
        Ok((dx, dw))
    }

    pub(super) fn conv_nhwc_grads(
        x: &Tensor,
        w: &Tensor,
        dy: &Tensor,
        padding: usize,
        stride: usize,
        input_grad: bool,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let dev = x.device().as_cuda_device()?.clone();
        let (x, w, dy) = (x.contiguous()?, w.contiguous()?, dy.contiguous()?);
        let forward = forward_key(&dev, &x, &w, padding, stride, None)?;
        let missing = missing_passes(&dev, forward, false, input_grad)?;
        if !missing.is_empty() {
            bail!("cuDNN has no engine for the NHWC convolution's {missing:?} pass(es) of {forward:?} (MIGPROF_CUDNN_LOG=1 lists what it proposed)")
        }
        grads(forward, &x, &w, &dy, input_grad)
    }

    pub(super) fn conv_nhwc_train(x: &Tensor, w: &Tensor, padding: usize, stride: usize) -> Result<Tensor> {
        let dev = x.device().as_cuda_device()?.clone();
        let (xc, wc) = (x.contiguous()?, w.contiguous()?);
        let c = xc.dim(3)?;
        let forward = forward_key(&dev, &xc, &wc, padding, stride, None)?;
        // Every pass this step will run needs an engine; the input's gradient only when taken.
        let missing = missing_passes(&dev, forward, true, x.track_op())?;
        if missing.is_empty() {
            return xc.apply_op2(&wc, ConvTrain { key: forward });
        }
        // As for inference: three colour channels padded with zeros to 8; the padding's gradient is
        // dropped by the pad's own backward.
        let padded = c.next_multiple_of(8);
        if padded != c {
            return conv_nhwc_train(
                &xc.pad_with_zeros(3, 0, padded - c)?,
                &wc.pad_with_zeros(3, 0, padded - c)?,
                padding,
                stride,
            );
        }
        bail!("cuDNN has no engine for the NHWC convolution's {missing:?} pass(es) of {forward:?} (MIGPROF_CUDNN_LOG=1 lists what it proposed)")
    }

    /// The convolution of a training step: the forward pass, whose backward runs [`ConvGrad`]s.
    #[derive(Debug, Clone, Copy)]
    struct ConvTrain {
        key: Key,
    }

    /// One backward pass: Data on (dy, w) gives dx, Filter on (x, dy) gives dw.
    #[derive(Debug, Clone, Copy)]
    struct ConvGrad {
        key: Key,
    }

    /// Checks that a launched op's inputs have the shapes its key was made for (the graph would read
    /// any other out of bounds).
    fn expect(what: &str, l: &Layout, [n, c, h, w]: [i64; 4]) -> Result<()> {
        let want = [n, h, w, c].map(|v| v as usize);
        if l.dims() != want {
            bail!(
                "conv_nhwc {what}: shape {:?}, the graph was made for {want:?}",
                l.dims()
            )
        }
        Ok(())
    }

    impl CustomOp2 for ConvTrain {
        fn name(&self) -> &'static str {
            "cudnn-conv-nhwc-train"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the NHWC convolution runs on CUDA devices only")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            expect("input", xl, self.key.x)?;
            expect("filter", wl, self.key.w)?;
            let [n, k, oh, ow] = self.key.y().map(|v| v as usize);
            Ok((
                run_graph(&self.key, &[(X, x, xl), (W, w, wl)], Y, n * oh * ow * k)?,
                Shape::from((n, oh, ow, k)),
            ))
        }

        fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let (dx, dw) = grads(self.key, x, w, &grad.contiguous()?, x.track_op())?;
            Ok((dx, Some(dw)))
        }
    }

    impl CustomOp2 for ConvGrad {
        fn name(&self) -> &'static str {
            "cudnn-conv-nhwc-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the NHWC convolution runs on CUDA devices only")
        }

        fn cuda_fwd(&self, a: &CudaStorage, al: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            let key = &self.key;
            let count = |d: [i64; 4]| d.iter().product::<i64>() as usize;
            let shape = |[n, c, h, w]: [i64; 4]| Shape::from((n as usize, h as usize, w as usize, c as usize));
            match key.pass {
                Pass::Data => {
                    expect("output gradient", al, key.y())?;
                    expect("filter", bl, key.w)?;
                    Ok((
                        run_graph(key, &[(Y, a, al), (W, b, bl)], X, count(key.x))?,
                        shape(key.x),
                    ))
                }
                Pass::Filter => {
                    expect("input", al, key.x)?;
                    expect("output gradient", bl, key.y())?;
                    Ok((
                        run_graph(key, &[(X, a, al), (Y, b, bl)], W, count(key.w))?,
                        shape(key.w),
                    ))
                }
                Pass::Forward => bail!("conv_nhwc: a forward key {key:?} as a backward pass"),
            }
        }
    }

    /// The candidate to keep for these tensors: the fastest, or a leaner one nearly as fast
    /// (`kernels::choice`), each timed as launched once untimed, then the median of three; any
    /// that fails to launch is skipped.
    fn chosen(
        dev: &CudaDevice,
        handle: sys::cudnnHandle_t,
        candidates: &[Plan],
        tensors: &[(i64, *mut c_void)],
        key: &Key,
    ) -> Result<usize> {
        if candidates.len() == 1 {
            return Ok(0);
        }
        refuse_timing_in_capture(dev, format_args!("NHWC convolution {key:?}"), "engine")?;
        let stream = dev.cuda_stream();
        let mut measured: Vec<(usize, Measured)> = Vec::new();
        let mut log = Vec::new();
        for (i, plan) in candidates.iter().enumerate() {
            // Each its own workspace: one that cannot be had (a small slice's memory) skips the
            // candidate rather than failing the convolution.
            let timed = dnn::workspace(dev, plan.workspace).and_then(|workspace| {
                let pack = VariantPack::new(tensors, workspace.ptr())?;
                let launch = || -> Result<()> {
                    for _ in 0..TIMED_LAUNCHES {
                        // SAFETY: as in `launch`; the pack holds this call's tensors and a workspace
                        // of the plan's size, alive until the timing synchronised.
                        unsafe { plan.execute_pack(handle, &pack) }?;
                    }
                    Ok(())
                };
                Ok(super::super::launch::median_ms(&stream, &launch)? / TIMED_LAUNCHES as f32)
            });
            let ms = match timed {
                Ok(ms) => ms,
                Err(e) => {
                    log.push(format!("{plan:?} failed: {e}"));
                    continue;
                }
            };
            log.push(format!("{plan:?} {ms:.4} ms"));
            measured.push((
                i,
                Measured {
                    ms,
                    workspace: plan.workspace,
                },
            ));
        }
        let chosen = leanest_near_fastest(&measured.iter().map(|(_, m)| *m).collect::<Vec<_>>()).map(|j| measured[j].0);
        if std::env::var_os("MIGPROF_CUDNN_LOG").is_some() {
            eprintln!("cudnn graph {key:?}: {}; chose {chosen:?}", log.join(", "));
        }
        match chosen {
            Some(i) => Ok(i),
            None => bail!(
                "cuDNN could launch none of its engines for the NHWC convolution {key:?}: {}",
                log.join("; ")
            ),
        }
    }

    impl CustomOp2 for Conv {
        fn name(&self) -> &'static str {
            "cudnn-conv-nhwc"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the NHWC convolution runs on CUDA devices only")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, w: &CudaStorage, wl: &Layout) -> Result<(CudaStorage, Shape)> {
            let [n, k, oh, ow] = self.key.y().map(|v| v as usize);
            let bias = self.bias.as_ref().map(|t| t.storage_and_layout());
            let residual = self.residual.as_ref().map(|t| t.storage_and_layout());
            let mut inputs = vec![(X, x, xl), (W, w, wl)];
            for (uid, saved) in [(BIAS, &bias), (RESIDUAL, &residual)] {
                if let Some((s, l)) = saved {
                    inputs.push((uid, super::super::launch::cuda(s, "conv_nhwc")?, l));
                }
            }
            Ok((
                run_graph(&self.key, &inputs, Y, n * oh * ow * k)?,
                Shape::from((n, oh, ow, k)),
            ))
        }
    }
}
