//! A safe wrapper of cuDNN's graph (backend) API: the part of it our fused convolutions use.
//!
//! Why the backend API and not the `cudnnConvolutionForward` family: cuDNN 9 keeps its current
//! engines (Hopper's NHWC implicit-GEMM kernels, the runtime-fusion engines that apply a bias, a
//! residual and an activation in the convolution's epilogue) behind operation graphs; the legacy
//! calls reach a subset of them, one operation at a time. PyTorch reaches them through
//! cudnn-frontend, a C++ header library; this is the few hundred lines of it we need, in Rust.
//!
//! The API is a bag of typed attributes on opaque descriptors: create, set attributes, finalize.
//! [`Descriptor`] owns one (destroyed on drop) and sets attributes from Rust slices, so that the
//! element count and type always match the values passed; [`Tensor`], [`Graph`], [`Plan`] and
//! [`VariantPack`] build the descriptors a plan needs in the order cuDNN accepts them.

use std::ffi::c_void;

use candle_core::cuda_backend::cudarc::cudnn::sys;
use candle_core::{bail, DType, Result};

use sys::cudnnBackendAttributeName_t as Attr;
use sys::cudnnBackendAttributeType_t as Type;
use sys::cudnnBackendDescriptorType_t as Kind;

fn check(status: sys::cudnnStatus_t, what: &str) -> Result<()> {
    status
        .result()
        .map_err(|e| candle_core::Error::Msg(format!("cuDNN graph API, {what}: {e:?}")))
}

/// One backend descriptor, destroyed when dropped.
pub(crate) struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
    kind: Kind,
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed only here. A failure cannot
        // be reported from a drop and leaves at most a leak.
        let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.raw) };
    }
}

impl std::fmt::Debug for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.kind)
    }
}

/// A value that can be an attribute's element: its Rust type fixes the attribute type cuDNN is told.
pub(crate) trait Element: Copy {
    const TYPE: Type;
    /// A value to fill a buffer with before cuDNN writes into it.
    const FILL: Self;
}

macro_rules! element {
    ($($t:ty => $ty:ident, $fill:expr);+ $(;)?) => {
        $(impl Element for $t { const TYPE: Type = Type::$ty; const FILL: Self = $fill; })+
    };
}

element! {
    i64 => CUDNN_TYPE_INT64, 0;
    f32 => CUDNN_TYPE_FLOAT, 0.0;
    bool => CUDNN_TYPE_BOOLEAN, false;
    sys::cudnnDataType_t => CUDNN_TYPE_DATA_TYPE, sys::cudnnDataType_t::CUDNN_DATA_FLOAT;
    sys::cudnnConvolutionMode_t => CUDNN_TYPE_CONVOLUTION_MODE, sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION;
    sys::cudnnBackendHeurMode_t => CUDNN_TYPE_HEUR_MODE, sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A;
    sys::cudnnPointwiseMode_t => CUDNN_TYPE_POINTWISE_MODE, sys::cudnnPointwiseMode_t::CUDNN_POINTWISE_ADD;
    Note => CUDNN_TYPE_NUMERICAL_NOTE, Note(u32::MAX);
    sys::cudnnHandle_t => CUDNN_TYPE_HANDLE, std::ptr::null_mut();
    *mut c_void => CUDNN_TYPE_VOID_PTR, std::ptr::null_mut();
}

/// A numerical note as cuDNN writes it: a plain u32, since a newer cuDNN may report a note that the
/// bindings' enum lacks, and reading that into the enum would be undefined behaviour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Note(u32);

impl Note {
    fn is(self, known: sys::cudnnBackendNumericalNote_t) -> bool {
        self.0 == known as u32
    }
}

impl Descriptor {
    pub(crate) fn new(kind: Kind) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: cuDNN writes the new descriptor into `raw`.
        check(
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) },
            &format!("create {kind:?}"),
        )?;
        Ok(Self { raw, kind })
    }

    /// Sets an attribute to `values` (one element or an array).
    pub(crate) fn set<T: Element>(&mut self, name: Attr, values: &[T]) -> Result<&mut Self> {
        // SAFETY: `values` holds `len` elements of the type named by T::TYPE; cuDNN copies them.
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.raw,
                name,
                T::TYPE,
                values.len() as i64,
                values.as_ptr() as *const c_void,
            )
        };
        check(status, &format!("set {name:?} of {:?}", self.kind))?;
        Ok(self)
    }

    /// Sets an attribute whose elements are other descriptors (finalized before, as cuDNN requires).
    pub(crate) fn set_descriptors(&mut self, name: Attr, values: &[&Descriptor]) -> Result<&mut Self> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = values.iter().map(|d| d.raw).collect();
        // SAFETY: as `set`; the descriptors outlive the call, and the caller keeps them alive as long
        // as this one (cuDNN may keep references).
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.raw,
                name,
                Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                raw.len() as i64,
                raw.as_ptr() as *const c_void,
            )
        };
        check(status, &format!("set {name:?} of {:?}", self.kind))?;
        Ok(self)
    }

    pub(crate) fn finalize(self) -> Result<Self> {
        // SAFETY: a live descriptor; its attributes were set above.
        check(
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            &format!("finalize {:?}", self.kind),
        )?;
        Ok(self)
    }

    /// Finalizes, saying only whether cuDNN accepted it (an engine configuration cuDNN cannot build
    /// a plan for is an expected outcome, not an error).
    fn try_finalize(self) -> Option<Self> {
        // SAFETY: as `finalize`.
        let status = unsafe { sys::cudnnBackendFinalize(self.raw) };
        if status != sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS && std::env::var_os("MIGPROF_CUDNN_LOG").is_some() {
            eprintln!("cudnn: {:?} not finalized: {status:?}", self.kind);
        }
        (status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS).then_some(self)
    }

    /// Up to `capacity` elements of an attribute.
    fn get<T: Element>(&self, name: Attr, capacity: usize) -> Result<Vec<T>> {
        let mut out = vec![T::FILL; capacity];
        let mut count = 0i64;
        // SAFETY: room for `capacity` elements of T::TYPE; cuDNN writes at most that many and says
        // how many it wrote.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.raw,
                name,
                T::TYPE,
                capacity as i64,
                &mut count,
                out.as_mut_ptr() as *mut c_void,
            )
        };
        check(status, &format!("get {name:?} of {:?}", self.kind))?;
        out.truncate(count.clamp(0, capacity as i64) as usize);
        Ok(out)
    }

    /// Fills descriptors created by the caller (of the kind the attribute holds) with an attribute's
    /// elements; returns how many were filled.
    fn get_descriptors(&self, name: Attr, into: &[Descriptor]) -> Result<usize> {
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = into.iter().map(|d| d.raw).collect();
        let mut count = 0i64;
        // SAFETY: `raw` holds live descriptors of the attribute's kind, which cuDNN fills in place.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.raw,
                name,
                Type::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                raw.len() as i64,
                &mut count,
                raw.as_mut_ptr() as *mut c_void,
            )
        };
        check(status, &format!("get {name:?} of {:?}", self.kind))?;
        Ok(count.clamp(0, into.len() as i64) as usize)
    }

    /// How many elements an attribute has.
    fn count(&self, name: Attr, ty: Type) -> Result<usize> {
        let mut count = 0i64;
        // SAFETY: a request for zero elements writes only the count.
        let status = unsafe { sys::cudnnBackendGetAttribute(self.raw, name, ty, 0, &mut count, std::ptr::null_mut()) };
        check(status, &format!("count {name:?} of {:?}", self.kind))?;
        Ok(count.max(0) as usize)
    }
}

/// cuDNN's (storage) data type of a candle dtype.
pub(crate) fn data_type(dtype: DType) -> Result<sys::cudnnDataType_t> {
    use sys::cudnnDataType_t as D;
    Ok(match dtype {
        DType::F32 => D::CUDNN_DATA_FLOAT,
        DType::BF16 => D::CUDNN_DATA_BFLOAT16,
        DType::F16 => D::CUDNN_DATA_HALF,
        other => bail!("cuDNN's graph API is used for f32, bf16 and f16, not {other:?}"),
    })
}

/// A tensor of an operation graph: cuDNN's dims are always (N, C, spatial...); the strides say the
/// memory layout.
pub(crate) struct Tensor {
    pub uid: i64,
    pub dtype: sys::cudnnDataType_t,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
    /// An intermediate that never reaches memory (fused away inside one kernel).
    pub virtual_: bool,
}

impl Tensor {
    /// (N, C, H, W) stored as NHWC.
    pub(crate) fn nhwc(uid: i64, dtype: sys::cudnnDataType_t, [n, c, h, w]: [i64; 4]) -> Self {
        Self {
            uid,
            dtype,
            dims: [n, c, h, w],
            strides: [h * w * c, 1, w * c, c],
            virtual_: false,
        }
    }

    pub(crate) fn virtual_of(uid: i64, like: &Tensor) -> Self {
        Self {
            uid,
            dtype: sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            dims: like.dims,
            strides: like.strides,
            virtual_: true,
        }
    }

    pub(crate) fn build(&self) -> Result<Descriptor> {
        let mut d = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, &[self.dtype])?
            .set(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &self.dims)?
            .set(Attr::CUDNN_ATTR_TENSOR_STRIDES, &self.strides)?
            .set(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[self.uid])?
            // candle's allocations are 256-byte aligned, and we pass no offset views.
            .set(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16i64])?
            .set(Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, &[self.virtual_])?;
        d.finalize()
    }
}

/// An operation graph and every descriptor it references, kept alive together.
pub(crate) struct Graph {
    graph: Descriptor,
    _parts: Vec<Descriptor>,
}

/// Builds operation graphs one operation at a time.
pub(crate) struct GraphBuilder {
    tensors: Vec<(i64, Descriptor)>,
    ops: Vec<Descriptor>,
    parts: Vec<Descriptor>,
}

impl GraphBuilder {
    pub(crate) fn new() -> Self {
        Self {
            tensors: Vec::new(),
            ops: Vec::new(),
            parts: Vec::new(),
        }
    }

    /// Adds a tensor (once per uid) and returns its index.
    fn tensor(&mut self, t: &Tensor) -> Result<usize> {
        if let Some(i) = self.tensors.iter().position(|(uid, _)| *uid == t.uid) {
            return Ok(i);
        }
        self.tensors.push((t.uid, t.build()?));
        Ok(self.tensors.len() - 1)
    }

    /// A 2-D cross-correlation with the same padding and stride on both axes, accumulated in f32.
    fn convolution(padding: i64, stride: i64) -> Result<Descriptor> {
        let mut conv = Descriptor::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
            &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?
        .set(
            Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
        )?
        .set(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2i64])?
        .set(Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS, &[1i64, 1])?
        .set(Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &[stride, stride])?
        .set(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &[padding, padding])?
        .set(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &[padding, padding])?;
        conv.finalize()
    }

    /// One convolution operation of `kind`: its three tensors, each under its attribute, then the
    /// convolution under `conv_desc` and alpha = 1, beta = 0 under `scale`'s two attributes.
    fn convolution_op(
        &mut self,
        kind: Kind,
        tensors: [(Attr, &Tensor); 3],
        conv_desc: Attr,
        scale: [Attr; 2],
        padding: i64,
        stride: i64,
    ) -> Result<()> {
        let mut ids = Vec::with_capacity(tensors.len());
        for (attr, t) in tensors {
            ids.push((attr, self.tensor(t)?));
        }
        let conv = Self::convolution(padding, stride)?;
        let mut op = Descriptor::new(kind)?;
        for (attr, i) in ids {
            op.set_descriptors(attr, &[&self.tensors[i].1])?;
        }
        op.set_descriptors(conv_desc, &[&conv])?
            .set(scale[0], &[1f32])?
            .set(scale[1], &[0f32])?;
        self.ops.push(op.finalize()?);
        self.parts.push(conv);
        Ok(())
    }

    /// dx = the gradient of conv(x, w) for x, from dy (what cuDNN calls backward data).
    pub(crate) fn conv_backward_data(
        &mut self,
        dy: &Tensor,
        w: &Tensor,
        dx: &Tensor,
        padding: i64,
        stride: i64,
    ) -> Result<()> {
        self.convolution_op(
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, dy),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, w),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, dx),
            ],
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
            [
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
            ],
            padding,
            stride,
        )
    }

    /// dw = the gradient of conv(x, w) for w, from x and dy (what cuDNN calls backward filter).
    pub(crate) fn conv_backward_filter(
        &mut self,
        x: &Tensor,
        dy: &Tensor,
        dw: &Tensor,
        padding: i64,
        stride: i64,
    ) -> Result<()> {
        self.convolution_op(
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, x),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, dy),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, dw),
            ],
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
            [
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
            ],
            padding,
            stride,
        )
    }

    /// y = conv(x, w), cross-correlation with the same padding and stride on both axes, accumulated in
    /// f32.
    pub(crate) fn conv_forward(&mut self, x: &Tensor, w: &Tensor, y: &Tensor, padding: i64, stride: i64) -> Result<()> {
        self.convolution_op(
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w),
                (Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, y),
            ],
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
            [
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
            ],
            padding,
            stride,
        )
    }

    /// y = mode(x[, b]) elementwise in f32, b broadcast where its dims are 1.
    pub(crate) fn pointwise(
        &mut self,
        mode: sys::cudnnPointwiseMode_t,
        x: &Tensor,
        b: Option<&Tensor>,
        y: &Tensor,
    ) -> Result<()> {
        let xi = self.tensor(x)?;
        let bi = b.map(|b| self.tensor(b)).transpose()?;
        let yi = self.tensor(y)?;
        let mut pw = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(Attr::CUDNN_ATTR_POINTWISE_MODE, &[mode])?.set(
            Attr::CUDNN_ATTR_POINTWISE_MATH_PREC,
            &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?;
        let pw = pw.finalize()?;
        let mut op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?
            .set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[&self.tensors[xi].1])?;
        if let Some(bi) = bi {
            op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[&self.tensors[bi].1])?;
        }
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[&self.tensors[yi].1])?;
        self.ops.push(op.finalize()?);
        self.parts.push(pw);
        Ok(())
    }

    pub(crate) fn finish(self, handle: sys::cudnnHandle_t) -> Result<Graph> {
        let mut graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        let ops: Vec<&Descriptor> = self.ops.iter().collect();
        graph
            .set_descriptors(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?
            .set(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, &[handle])?;
        let graph = graph.finalize()?;
        // Dropped in this order, each before what it references: the graph, its ops, their
        // convolution and pointwise descriptors, the tensors.
        let mut parts = self.ops;
        parts.extend(self.parts);
        parts.extend(self.tensors.into_iter().map(|(_, d)| d));
        Ok(Graph { graph, _parts: parts })
    }
}

/// What a plan's engine may do to the numbers, as cuDNN notes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Numerics {
    /// Tensor cores: TF32 for f32 data.
    pub tensor_cores: bool,
    /// Inputs converted to a narrower type, or sums kept in one.
    pub narrowed: bool,
}

/// An execution plan: one engine configuration finalized for a graph, with its workspace size.
pub(crate) struct Plan {
    plan: Descriptor,
    pub workspace: usize,
    /// The engine's global index (for the log: engines are named by index in cuDNN's docs).
    pub engine: i64,
    pub numerics: Numerics,
    _config: Descriptor,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "engine {} ({:?}, workspace {} B)",
            self.engine, self.numerics, self.workspace
        )
    }
}

impl Graph {
    /// The plans cuDNN's heuristics (mode A) propose for this graph that finalize, whose numerics
    /// `allowed` accepts and whose workspace is at most `max_workspace` bytes, in the heuristics'
    /// order, at most `limit`.
    pub(crate) fn plans(
        &self,
        handle: sys::cudnnHandle_t,
        limit: usize,
        max_workspace: usize,
        allowed: impl Fn(Numerics) -> bool,
    ) -> Result<Vec<Plan>> {
        let mut heur = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.set_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&self.graph])?
            .set(
                Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
                &[sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
            )?;
        let heur = heur.finalize()?;
        let count = heur.count(Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, Type::CUDNN_TYPE_BACKEND_DESCRIPTOR)?;
        let configs = (0..count)
            .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
            .collect::<Result<Vec<_>>>()?;
        let filled = heur.get_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, &configs)?;
        let mut plans = Vec::new();
        for config in configs.into_iter().take(filled) {
            if plans.len() == limit {
                break;
            }
            let engine = Descriptor::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
            if config.get_descriptors(Attr::CUDNN_ATTR_ENGINECFG_ENGINE, std::slice::from_ref(&engine))? != 1 {
                continue;
            }
            use sys::cudnnBackendNumericalNote_t as N;
            // Room for every note the bindings know and as many again that they may not.
            let notes: Vec<Note> = engine.get(
                Attr::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                2 * N::CUDNN_NUMERICAL_NOTE_TYPE_COUNT as usize,
            )?;
            let any = |n: N| notes.iter().any(|note| note.is(n));
            let numerics = Numerics {
                tensor_cores: any(N::CUDNN_NUMERICAL_NOTE_TENSOR_CORE),
                narrowed: any(N::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS)
                    || any(N::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION),
            };
            if !allowed(numerics) {
                continue;
            }
            let index = engine
                .get::<i64>(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, 1)?
                .first()
                .copied()
                .unwrap_or(-1);
            let mut plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, &[handle])?
                .set_descriptors(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&config])?;
            let Some(plan) = plan.try_finalize() else { continue };
            let workspace = plan
                .get::<i64>(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, 1)?
                .first()
                .copied()
                .unwrap_or(0)
                .max(0) as usize;
            if workspace > max_workspace {
                continue;
            }
            plans.push(Plan {
                plan,
                workspace,
                engine: index,
                numerics,
                _config: config,
            });
        }
        Ok(plans)
    }
}

impl Plan {
    /// Launches the plan on the handle's stream with the device pointers of its tensors (by uid) and
    /// a workspace of at least `self.workspace` bytes.
    ///
    /// # Safety
    /// Every pointer addresses a live device buffer of its tensor's size and type, the workspace one
    /// of at least `self.workspace` bytes, all on the handle's device, until the launched work ends.
    pub(crate) unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        tensors: &[(i64, *mut c_void)],
        workspace: *mut c_void,
    ) -> Result<()> {
        let pack = VariantPack::new(tensors, workspace)?;
        // SAFETY: as the caller promises.
        unsafe { self.execute_pack(handle, &pack) }
    }

    /// [`Self::execute`] with a pack built before (to launch the same tensors again without its host
    /// work, as the engine timing does).
    ///
    /// # Safety
    /// As [`Self::execute`], for the pack's pointers.
    pub(crate) unsafe fn execute_pack(&self, handle: sys::cudnnHandle_t, pack: &VariantPack) -> Result<()> {
        // SAFETY: a finalized plan and pack; the buffers are as the caller promises.
        check(
            unsafe { sys::cudnnBackendExecute(handle, self.plan.raw, pack.0.raw) },
            &format!("execute {self:?}"),
        )
    }
}

/// The device pointers of one launch's tensors (by uid) and its workspace.
pub(crate) struct VariantPack(Descriptor);

impl VariantPack {
    pub(crate) fn new(tensors: &[(i64, *mut c_void)], workspace: *mut c_void) -> Result<Self> {
        let uids: Vec<i64> = tensors.iter().map(|t| t.0).collect();
        let pointers: Vec<*mut c_void> = tensors.iter().map(|t| t.1).collect();
        let mut pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?
            .set(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &pointers)?
            .set(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[workspace])?;
        Ok(Self(pack.finalize()?))
    }
}
