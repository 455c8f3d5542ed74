//! Multi-head attention softmax(q kᵀ / sqrt(d) + bias) v from a packed [b, t, 3c] projection to
//! [b, t, c], as one differentiable op on CUDA devices.
//!
//! Why: composed from candle ops, attention is a dozen graph edges (three slices of the packed
//! projection, head splits, the scale, two matmuls, the softmax, the head merge), and candle's
//! backward pass adds each edge's gradient into a freshly zeroed tensor — the slices even into
//! zero-padded copies of the whole packed gradient. And with t = 197 tokens (ViT) the scores' rows
//! are 197 elements apart, an odd leading dimension that keeps cuBLAS on alignment-1 kernels for
//! every attention matmul. As one op there are one or two edges, and the head-major buffers pad the
//! tokens to a multiple of 8 (padded keys masked out of the softmax), so every GEMM is aligned.
//! (measured: docs/kernels.md#attention)
//!
//! Forward: bf16 and f16 heads of 32, 64 or 128 in one kernel on tensor cores, f32 heads of 32 or
//! 64 in one on the CUDA cores (`fused_attention.rs`); other shapes composed: q, k, v moved to head-major [b·h, tp, d]; S = q kᵀ;
//! P = softmax(scale·S + bias) in place; O = P v; O moved back. Backward recomputes P (one GEMM and the softmax, as
//! FlashAttention's backward does, instead of keeping a [b·h, t, t] tensor alive) and computes
//! dV = Pᵀ dO, dP = dO vᵀ, dS = scale·P (dP - rowsum(dP P)), dq = dS k, dk = dSᵀ q.

use candle_core::{bail, Result, Tensor, D};

/// What is added to the scores before the softmax.
#[derive(Debug, Clone, Copy)]
pub enum ScoreBias<'a> {
    None,
    /// Per key, the same for every head and query: [b, t], a padding mask. No gradient flows into it.
    Keys(&'a Tensor),
    /// Per head, query and key, repeating along the batch: [r, h, t, t] with b a multiple of r
    /// (Swin's relative position bias and shifted-window masks, r windows per image).
    Scores(&'a Tensor),
}

/// Attention of `heads` heads over a packed [b, t, 3c] q/k/v projection; returns [b, t, c].
pub fn attention(qkv: &Tensor, heads: usize, bias: ScoreBias) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    if c3 % 3 != 0 || (c3 / 3) % heads != 0 {
        bail!("attention: {c3} packed features are not q, k and v of {heads} heads")
    }
    match bias {
        ScoreBias::Keys(m) if m.dims() != [b, t] => {
            bail!("attention: a key mask of shape {:?} for {b} sequences of {t}", m.dims())
        }
        ScoreBias::Keys(m) if m.track_op() => bail!("attention: the key mask takes no gradient; detach it"),
        ScoreBias::Scores(s) if s.rank() != 4 || s.dims()[1..] != [heads, t, t] || b % s.dim(0)? != 0 => {
            bail!(
                "attention: a score bias of shape {:?} for {b} sequences, {heads} heads, {t} tokens",
                s.dims()
            )
        }
        _ => {}
    }
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() {
        let qkv = qkv.contiguous()?;
        return match bias {
            ScoreBias::None => qkv.apply_op1(cuda::Attention {
                heads,
                mode: cuda::Mode::None,
            }),
            ScoreBias::Keys(m) => qkv.apply_op2(
                &m.to_dtype(qkv.dtype())?.contiguous()?,
                cuda::Attention {
                    heads,
                    mode: cuda::Mode::Keys,
                },
            ),
            ScoreBias::Scores(s) => {
                let r = s.dim(0)?;
                qkv.apply_op2(
                    &s.to_dtype(qkv.dtype())?.contiguous()?,
                    cuda::Attention {
                        heads,
                        mode: cuda::Mode::Scores { repeat: r },
                    },
                )
            }
        };
    }
    reference(qkv, heads, bias)
}

/// Whether [`attention`] over this packed projection runs as one fused kernel on the GPU (bf16 or
/// f16 heads of 32, 64 or 128, f32 heads of 32 or 64, on a CUDA device of compute capability 8.0 or
/// later), rather than as products, softmax and head moves.
pub fn runs_fused(qkv: &Tensor, heads: usize) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = qkv.device() {
        let (fused, start) = fused_shape(qkv, heads)?;
        return Ok(fused.takes(qkv.dtype(), dev, start));
    }
    let _ = (qkv, heads);
    Ok(false)
}

/// The fused launch [`attention`] would make of this projection without a score bias, and the
/// element its rows start at (`attention` makes the projection contiguous: a strided one is copied
/// from element 0).
#[cfg(feature = "cuda")]
fn fused_shape(qkv: &Tensor, heads: usize) -> Result<(crate::kernels::fused_attention::Fused, usize)> {
    let (b, t, c3) = qkv.dims3()?;
    let fused = crate::kernels::fused_attention::Fused {
        b,
        t,
        h: heads,
        d: c3 / 3 / heads,
        mode: 0,
        r: 1,
        scale: 1.0,
        kv_heads: heads,
        q_start: 0,
    };
    let start = if qkv.is_contiguous() {
        qkv.layout().start_offset()
    } else {
        0
    };
    Ok((fused, start))
}

/// The sizes of block, in queries, that the f32 fused kernels come in: each shape's first launch
/// times them all and keeps the fastest (`fused_attention.rs`).
#[cfg(feature = "cuda")]
pub const FUSED_F32_QUERIES: [usize; 4] = crate::kernels::fused_attention::SIMT_QUERIES;

/// The block size, in queries, the f32 fused kernel runs this projection in without a score bias:
/// the pinned one ([`with_fused_f32_queries`]), else the timed choice once the shape has run, else
/// None (and None where the shape is not fused, or not f32).
#[cfg(feature = "cuda")]
pub fn fused_f32_queries(qkv: &Tensor, heads: usize) -> Result<Option<usize>> {
    let candle_core::Device::Cuda(dev) = qkv.device() else {
        return Ok(None);
    };
    let (fused, start) = fused_shape(qkv, heads)?;
    if qkv.dtype() != candle_core::DType::F32 || !fused.takes(candle_core::DType::F32, dev, start) {
        return Ok(None);
    }
    Ok(fused.simt_queries(dev))
}

/// Runs `f` with this thread's f32 fused attention held to `queries` per block (one of
/// [`FUSED_F32_QUERIES`]) instead of the timed choice, so that each size can be checked on its own.
#[cfg(feature = "cuda")]
pub fn with_fused_f32_queries<R>(queries: usize, f: impl FnOnce() -> R) -> Result<R> {
    crate::kernels::fused_attention::with_simt_queries(queries, f)
}

/// The gradients of [`attention`] with respect to the packed projection and, for a score bias, the
/// bias, given the output's, for an op that runs attention inside its own forward
/// (`models::encoder`); a key mask takes none. The bias, if any, is in the projection's dtype. CUDA
/// devices only.
#[cfg(feature = "cuda")]
pub(crate) fn grads(qkv: &Tensor, heads: usize, bias: ScoreBias, grad: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    let (mode, tensor) = match bias {
        ScoreBias::None => (cuda::Mode::None, None),
        ScoreBias::Keys(m) => (cuda::Mode::Keys, Some(m)),
        ScoreBias::Scores(s) => (cuda::Mode::Scores { repeat: s.dim(0)? }, Some(s)),
    };
    let with_ds = matches!(bias, ScoreBias::Scores(_));
    cuda::Attention { heads, mode }.grads(&qkv.contiguous()?, tensor, grad, with_ds)
}

/// The same function from candle ops: the CPU's path and the GPU op's reference.
fn reference(qkv: &Tensor, heads: usize, bias: ScoreBias) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let (c, d) = (c3 / 3, c3 / 3 / heads);
    // [b, t, heads · d] -> [b, heads, t, d], and back.
    let part = |i: usize| {
        qkv.narrow(D::Minus1, i * c, c)?
            .reshape((b, t, heads, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let scores = (q * (1.0 / (d as f64).sqrt()))?.matmul(&k.t()?)?;
    let scores = match bias {
        ScoreBias::None => scores,
        ScoreBias::Keys(m) => scores.broadcast_add(&m.to_dtype(scores.dtype())?.reshape((b, 1, 1, t))?)?,
        ScoreBias::Scores(s) => super::add_repeating(&scores, &s.to_dtype(scores.dtype())?)?,
    };
    // Without a graph to record (inference), candle's fused kernel, which has no backward.
    let weights = if scores.track_op() {
        candle_nn::ops::softmax(&scores, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?
    };
    weights.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))
}

#[cfg(feature = "cuda")]
mod cuda {

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, CudaViewMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

    use crate::kernels::fused_attention::Fused;
    use crate::kernels::gemm::{self, Epilogue, Operand, Product};
    use crate::kernels::launch::{by_dtype, cuda as saved_storage, name, view, word_elements, Kernel};

    #[derive(Debug, Clone, Copy, PartialEq)]
    pub(super) enum Mode {
        None,
        Keys,
        Scores { repeat: usize },
    }

    impl Mode {
        fn code(self) -> (i32, u32) {
            match self {
                Mode::None => (0, 1),
                Mode::Keys => (1, 1),
                Mode::Scores { repeat } => (2, repeat as u32),
            }
        }
    }

    #[derive(Debug, Clone, Copy)]
    pub(super) struct Attention {
        pub heads: usize,
        pub mode: Mode,
    }

    /// Sizes: b sequences of t tokens (tp padded to a multiple of 8), h heads of d, c = h·d.
    #[derive(Debug, Clone, Copy)]
    struct Dims {
        b: usize,
        t: usize,
        tp: usize,
        h: usize,
        d: usize,
    }

    impl Dims {
        fn of(qkv: &Layout, heads: usize) -> Result<Self> {
            let (b, t, c3) = qkv.shape().dims3()?;
            let d = c3 / 3 / heads;
            let tp = t.next_multiple_of(8);
            if b * heads * tp * tp.max(d) > u32::MAX as usize || b * t * c3 > u32::MAX as usize {
                bail!("attention over {b}x{t}x{c3} is more than these kernels index")
            }
            Ok(Self { b, t, tp, h: heads, d })
        }
        fn bh(&self) -> usize {
            self.b * self.h
        }
        /// Per head, op(A) op(B) of (m, n, k) [b·h, m, n] from head-major operands (A stored
        /// [b·h, k, m] when `a_t`, B [b·h, n, k] when `b_t`), each from its element offset.
        fn product(
            &self,
            a: Operand,
            b: Operand,
            (m, n, k): (usize, usize, usize),
            a_t: bool,
            b_t: bool,
        ) -> Result<CudaStorage> {
            gemm::gemm(
                a,
                b,
                None,
                Product {
                    m,
                    n,
                    k,
                    a_t,
                    b_t,
                    batch: self.bh(),
                },
                Epilogue::None,
            )
        }
    }

    /// Our kernel `base` for the dtype of `kern` (a [`Kernels`]).
    macro_rules! kernel {
        ($kern:expr, $base:expr) => {
            Kernel::load(
                &$kern.dev,
                &crate::kernels::sources::ATTENTION,
                &name($base, $kern.dtype),
            )?
        };
    }

    /// The kernels of one dtype on one device.
    struct Kernels<'a> {
        dev: &'a CudaDevice,
        dims: Dims,
        dtype: candle_core::DType,
    }

    impl Kernels<'_> {
        /// A buffer that the kernel or GEMM producing it writes entirely.
        fn alloc<T: CudaDType + DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
            // SAFETY: every element is written by the kernel or GEMM that produces it.
            Ok(unsafe { self.dev.alloc::<T>(n)? })
        }

        /// Token-major `src` (row stride `stride`, at `offset`) into head-major `dst`, or back, in the
        /// widest words (up to 16 bytes) that d, the stride, the offset and both views' starts allow.
        fn moved<T: CudaDType + DeviceRepr>(
            &self,
            src: &CudaView<T>,
            dst: &mut CudaViewMut<T>,
            stride: usize,
            offset: usize,
            to_heads: bool,
        ) -> Result<()> {
            let Dims { b, t, tp, h, d } = self.dims;
            let size = std::mem::size_of::<T>();
            let k = word_elements(size, &[d, stride, offset, src.len(), dst.len()]);
            let kernel = format!("attn_move_w{}", k * size);
            let func = Kernel::load(self.dev, &crate::kernels::sources::ATTENTION, &kernel)?;
            let total = (b * h * tp * d / k) as u64;
            let cfg = LaunchConfig {
                grid_dim: (total.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let [b, t, tp, h, dw, stride, offset] = [b, t, tp, h, d / k, stride / k, offset / k].map(|v| v as u32);
            let to_heads = to_heads as i32;
            let (src_words, dst_words) = (src.len() / k, dst.len() / k);
            macro_rules! go {
                ($w:ty) => {{
                    // SAFETY: the same bytes seen as words of k elements (fresh allocations and the
                    // checked lengths give the alignment).
                    let sw = unsafe { src.transmute::<$w>(src_words) }
                        .ok_or_else(|| candle_core::Error::Msg("attention: word view".into()))?;
                    let mut dw_view = unsafe { dst.transmute_mut::<$w>(dst_words) }
                        .ok_or_else(|| candle_core::Error::Msg("attention: word view".into()))?;
                    let mut a = func.builder();
                    a.arg(&sw)
                        .arg(&mut dw_view)
                        .arg(&b)
                        .arg(&t)
                        .arg(&tp)
                        .arg(&h)
                        .arg(&dw)
                        .arg(&stride)
                        .arg(&offset)
                        .arg(&to_heads);
                    // SAFETY: argument types and order match the kernel; the views hold b·t·stride
                    // and b·h·tp·d elements.
                    unsafe { func.launch(&mut a, cfg) }?;
                }};
            }
            match k * size {
                2 => go!(u16),
                4 => go!(u32),
                8 => go!(u64),
                _ => go!(u128),
            }
            Ok(())
        }

        /// 1 / sqrt(d), applied to the scores in the softmax.
        fn scale(&self) -> f32 {
            1.0 / (self.dims.d as f32).sqrt()
        }

        fn warp_rows(&self) -> LaunchConfig {
            let rows = (self.dims.bh() * self.dims.tp) as u64;
            // Eight warps a block, each taking two short rows (lanes_per_row in the source) or one.
            let per_block = if self.dims.tp <= 16 * crate::kernels::defines::attention::KEEP_KEYS {
                16
            } else {
                8
            };
            LaunchConfig {
                grid_dim: (rows.div_ceil(per_block).clamp(1, 1 << 20) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            }
        }
    }

    /// q, k, v head-major, and P = softmax(scale · q kᵀ + bias) [b·h, tp, tp].
    struct Forward {
        q: CudaStorage,
        k: CudaStorage,
        v: CudaStorage,
        p: CudaStorage,
    }

    fn forward_parts<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        kern: &Kernels,
        qkv: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
        mode: Mode,
    ) -> Result<Forward> {
        let dims = kern.dims;
        let Dims { t, tp, h, d, .. } = dims;
        let c = h * d;
        let src = view::<T>(qkv.0, qkv.1, "attention")?;
        let n = dims.bh() * tp * d;
        let mut parts = Vec::with_capacity(3);
        for i in 0..3 {
            let mut out = kern.alloc::<T>(n)?;
            kern.moved(&src, &mut out.slice_mut(0..), 3 * c, i * c, true)?;
            parts.push(CudaStorage::wrap_cuda_slice(out, kern.dev.clone()));
        }
        let v = parts.pop().expect("three parts");
        let k = parts.pop().expect("three parts");
        let q = parts.pop().expect("three parts");
        let mut p = dims.product((&q, 0), (&k, 0), (tp, tp, d), false, true)?;
        let func = kernel!(kern, "attn_softmax");
        let rows = (dims.bh() * tp) as u32;
        let (code, r) = mode.code();
        let (h32, t32, tp32, scale) = (h as u32, t as u32, tp as u32, kern.scale());
        {
            let mut pv = p.as_cuda_slice_mut::<T>()?.slice_mut(0..);
            let bias_view = match bias {
                Some((s, l)) => Some(view::<T>(s, l, "attention's bias")?),
                None => None,
            };
            let null = 0u64;
            let mut a = func.builder();
            a.arg(&mut pv);
            match &bias_view {
                Some(bv) => a.arg(bv),
                None => a.arg(&null),
            };
            a.arg(&rows)
                .arg(&h32)
                .arg(&t32)
                .arg(&tp32)
                .arg(&r)
                .arg(&code)
                .arg(&scale);
            // SAFETY: argument types and order match the kernel; S holds rows·tp, the bias what
            // its mode indexes (checked by the caller), or null when not read.
            unsafe { func.launch(&mut a, kern.warp_rows()) }?;
        }
        Ok(Forward { q, k, v, p })
    }

    fn forward<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        kern: &Kernels,
        qkv: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
        mode: Mode,
    ) -> Result<CudaStorage> {
        let dims = kern.dims;
        let Dims { b, t, tp, h, d } = dims;
        let (code, r) = mode.code();
        let fused = Fused {
            b,
            t,
            h,
            d,
            mode: code,
            r,
            scale: kern.scale(),
            kv_heads: h,
            q_start: 0,
        };
        if fused.takes(kern.dtype, kern.dev, qkv.1.start_offset()) {
            let mut out = kern.alloc::<T>(b * t * h * d)?;
            let bias = match bias {
                Some((s, l)) => Some(view::<T>(s, l, "attention's bias")?),
                None => None,
            };
            fused.launch(
                kern.dev,
                kern.dtype,
                &view::<T>(qkv.0, qkv.1, "attention")?,
                bias.as_ref(),
                &mut out.slice_mut(0..),
            )?;
            return Ok(CudaStorage::wrap_cuda_slice(out, kern.dev.clone()));
        }
        let f = forward_parts::<T>(kern, qkv, bias, mode)?;
        let o = dims.product((&f.p, 0), (&f.v, 0), (tp, d, tp), false, false)?;
        let mut out = kern.alloc::<T>(b * t * h * d)?;
        kern.moved(
            &o.as_cuda_slice::<T>()?.slice(0..),
            &mut out.slice_mut(0..),
            h * d,
            0,
            false,
        )?;
        Ok(CudaStorage::wrap_cuda_slice(out, kern.dev.clone()))
    }

    /// [dqkv (b·t·3c) | dS (b·h·tp·tp), when `with_ds`] in one buffer.
    fn backward<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        kern: &Kernels,
        qkv: (&CudaStorage, &Layout),
        bias: Option<(&CudaStorage, &Layout)>,
        mode: Mode,
        g: (&CudaStorage, &Layout),
        with_ds: bool,
    ) -> Result<CudaStorage> {
        let dims = kern.dims;
        let Dims { b, t, tp, h, d } = dims;
        let (c, bh) = (h * d, dims.bh());
        let f = forward_parts::<T>(kern, qkv, bias, mode)?;
        let heads_n = bh * tp * d;
        let mut d_o = kern.alloc::<T>(heads_n)?;
        kern.moved(
            &view::<T>(g.0, g.1, "attention's gradient")?,
            &mut d_o.slice_mut(0..),
            c,
            0,
            true,
        )?;
        let d_o = CudaStorage::wrap_cuda_slice(d_o, kern.dev.clone());
        let dv = dims.product((&f.p, 0), (&d_o, 0), (tp, d, tp), true, false)?;
        let dp = dims.product((&d_o, 0), (&f.v, 0), (tp, tp, d), false, true)?;
        // dS: into the tail of the output buffer when the bias needs it, else a buffer of its own.
        let qkv_n = b * t * 3 * c;
        let ds_n = bh * tp * tp;
        let mut out = kern.alloc::<T>(qkv_n + if with_ds { ds_n } else { 0 })?;
        let mut ds_own = if with_ds { None } else { Some(kern.alloc::<T>(ds_n)?) };
        {
            let func = kernel!(kern, "attn_softmax_grad");
            let rows = (bh * tp) as u32;
            let (t32, tp32, scale) = (t as u32, tp as u32, kern.scale());
            let pv = f.p.as_cuda_slice::<T>()?.slice(0..);
            let dpv = dp.as_cuda_slice::<T>()?.slice(0..);
            let mut dsv = match ds_own.as_mut() {
                Some(s) => s.slice_mut(0..),
                None => out.slice_mut(qkv_n..),
            };
            let mut a = func.builder();
            a.arg(&pv)
                .arg(&dpv)
                .arg(&mut dsv)
                .arg(&rows)
                .arg(&t32)
                .arg(&tp32)
                .arg(&scale);
            // SAFETY: argument types and order match the kernel; P, dP and dS hold rows·tp.
            unsafe { func.launch(&mut a, kern.warp_rows()) }?;
        }
        let out = CudaStorage::wrap_cuda_slice(out, kern.dev.clone());
        let ds_own = ds_own.map(|s| CudaStorage::wrap_cuda_slice(s, kern.dev.clone()));
        let (ds, ds_off) = match &ds_own {
            Some(s) => (s, 0),
            None => (&out, qkv_n),
        };
        let dq = dims.product((ds, ds_off), (&f.k, 0), (tp, d, tp), false, false)?;
        let dk = dims.product((ds, ds_off), (&f.q, 0), (tp, d, tp), true, false)?;
        let mut out = out;
        {
            let dst = out.as_cuda_slice_mut::<T>()?;
            for (i, part) in [&dq, &dk, &dv].into_iter().enumerate() {
                let mut head = dst.slice_mut(0..qkv_n);
                kern.moved(&part.as_cuda_slice::<T>()?.slice(0..), &mut head, 3 * c, i * c, false)?;
            }
        }
        Ok(out)
    }

    impl Attention {
        fn run(
            &self,
            qkv: (&CudaStorage, &Layout),
            bias: Option<(&CudaStorage, &Layout)>,
        ) -> Result<(CudaStorage, Shape)> {
            if !qkv.1.is_contiguous() || bias.is_some_and(|(_, l)| !l.is_contiguous()) {
                bail!("the attention op takes contiguous tensors")
            }
            let dims = Dims::of(qkv.1, self.heads)?;
            let kern = Kernels {
                dev: qkv.0.device(),
                dims,
                dtype: qkv.0.dtype(),
            };
            let out = by_dtype!(qkv.0.dtype(), "attention", T => forward::<T>(&kern, qkv, bias, self.mode)?);
            Ok((out, Shape::from((dims.b, dims.t, dims.h * dims.d))))
        }

        /// (dqkv, dbias): the bias's gradient only when `with_ds` (a score bias that takes one).
        pub(super) fn grads(
            &self,
            qkv: &Tensor,
            bias: Option<&Tensor>,
            grad: &Tensor,
            with_ds: bool,
        ) -> Result<(Tensor, Option<Tensor>)> {
            let with_ds = with_ds && matches!(self.mode, Mode::Scores { .. }) && bias.is_some();
            let op = AttentionGrad {
                op: *self,
                qkv: qkv.clone(),
                bias: bias.cloned(),
                with_ds,
            };
            let flat = grad.contiguous()?.apply_op1_no_bwd(&op)?;
            let (b, t, c3) = qkv.dims3()?;
            let dqkv = flat.narrow(0, 0, b * t * c3)?.reshape((b, t, c3))?;
            let dbias = match (self.mode, bias) {
                (Mode::Scores { repeat }, Some(bias)) if with_ds => {
                    let (h, tp) = (self.heads, t.next_multiple_of(8));
                    let ds = flat
                        .narrow(0, b * t * c3, b * h * tp * tp)?
                        .reshape((b / repeat, repeat, h, tp, tp))?;
                    // dS is the gradient of the unscaled scores; the bias is added after the scale.
                    let sqrt_d = ((c3 / 3 / h) as f64).sqrt();
                    let per_window = crate::kernels::elementwise::sum_leading(&ds)?;
                    Some((per_window.narrow(2, 0, t)?.narrow(3, 0, t)? * sqrt_d)?.to_dtype(bias.dtype())?)
                }
                _ => None,
            };
            Ok((dqkv, dbias))
        }
    }

    impl CustomOp1 for Attention {
        fn name(&self) -> &'static str {
            "attention"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the attention op runs on CUDA devices only; the CPU composes candle ops")
        }
        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            self.run((s, l), None)
        }
        fn bwd(&self, qkv: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            Ok(Some(self.grads(qkv, None, grad, false)?.0))
        }
    }

    impl CustomOp2 for Attention {
        fn name(&self) -> &'static str {
            "attention"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the attention op runs on CUDA devices only; the CPU composes candle ops")
        }
        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout, bs: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            self.run((s, l), Some((bs, bl)))
        }
        fn bwd(
            &self,
            qkv: &Tensor,
            bias: &Tensor,
            _out: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let (dqkv, dbias) = self.grads(qkv, Some(bias), grad, bias.track_op())?;
            Ok((Some(dqkv), dbias))
        }
    }

    /// The backward pass, applied to the output's gradient, holding the forward's inputs: one flat
    /// buffer [dqkv | dS when the bias takes a gradient].
    #[derive(Debug, Clone)]
    struct AttentionGrad {
        op: Attention,
        qkv: Tensor,
        bias: Option<Tensor>,
        with_ds: bool,
    }

    impl CustomOp1 for AttentionGrad {
        fn name(&self) -> &'static str {
            "attention-grad"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the attention op runs on CUDA devices only")
        }
        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
            let what = "attention's backward";
            let (qs, ql) = self.qkv.storage_and_layout();
            let bias = self.bias.as_ref().map(|b| b.storage_and_layout());
            let bias = match &bias {
                Some((s, l)) => Some((saved_storage(s, what)?, *l)),
                None => None,
            };
            let qkv = (saved_storage(&qs, what)?, ql);
            let dims = Dims::of(ql, self.op.heads)?;
            if gl.dims() != [dims.b, dims.t, dims.h * dims.d] || !gl.is_contiguous() {
                bail!("{what}: a gradient of shape {:?}", gl.dims())
            }
            let kern = Kernels {
                dev: g.device(),
                dims,
                dtype: g.dtype(),
            };
            let out =
                by_dtype!(g.dtype(), what, T => backward::<T>(&kern, qkv, bias, self.op.mode, (g, gl), self.with_ds)?);
            let ds = if self.with_ds { dims.bh() * dims.tp * dims.tp } else { 0 };
            Ok((out, Shape::from(dims.b * dims.t * 3 * dims.h * dims.d + ds)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::tests::check_gradient;
    use candle_core::{DType, Device};

    /// A packed [1, 3, 3·2] projection, one head of 2: q and k all ones (equal scores), v given.
    fn equal_scores() -> Result<Tensor> {
        let v = [[1f32, 10.], [2., 20.], [3., 30.]];
        let rows: Vec<f32> = v.iter().flat_map(|v| [1., 1., 1., 1., v[0], v[1]]).collect();
        Tensor::from_vec(rows, (1, 3, 6), &Device::Cpu)
    }

    #[test]
    fn equal_scores_average_the_values_and_a_masked_key_drops_out() -> Result<()> {
        let out = attention(&equal_scores()?, 1, ScoreBias::None)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (got, want) in out.iter().zip([2f32, 20., 2., 20., 2., 20.]) {
            assert!((got - want).abs() < 1e-5, "{out:?}");
        }
        // A -inf on key 2, as a key mask and as a score bias, leaves the mean of keys 0 and 1.
        let keys = Tensor::new(&[[0f32, 0., f32::NEG_INFINITY]], &Device::Cpu)?;
        let scores = keys.reshape((1, 1, 1, 3))?.broadcast_as((1, 1, 3, 3))?.contiguous()?;
        for bias in [ScoreBias::Keys(&keys), ScoreBias::Scores(&scores)] {
            let out = attention(&equal_scores()?, 1, bias)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                (out[0] - 1.5).abs() < 1e-5 && (out[1] - 15.0).abs() < 1e-5,
                "{bias:?}: {out:?}"
            );
        }
        Ok(())
    }

    #[test]
    fn attention_has_exact_gradients_for_the_projection_and_the_score_bias() -> Result<()> {
        // Two sequences of 3 tokens, 2 heads of 2; the score bias repeats once per sequence.
        check_gradient(|qkv| attention(qkv, 2, ScoreBias::None), &[2, 3, 12], 5)?;
        let bias = Tensor::randn(0f64, 1., (1, 2, 3, 3), &Device::Cpu)?;
        check_gradient(|qkv| attention(qkv, 2, ScoreBias::Scores(&bias)), &[2, 3, 12], 6)?;
        let qkv = Tensor::randn(0f64, 1., (2, 3, 12), &Device::Cpu)?;
        check_gradient(|bias| attention(&qkv, 2, ScoreBias::Scores(bias)), &[1, 2, 3, 3], 7)
    }

    #[test]
    fn misshaped_inputs_are_refused_with_their_shapes() -> Result<()> {
        let qkv = Tensor::zeros((2, 3, 12), DType::F32, &Device::Cpu)?;
        let err = attention(&qkv, 5, ScoreBias::None).unwrap_err().to_string();
        assert!(err.contains("5 heads"), "{err}");
        let mask = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        let err = attention(&qkv, 2, ScoreBias::Keys(&mask)).unwrap_err().to_string();
        assert!(err.contains("[2, 4]"), "{err}");
        // Three repeats do not divide a batch of two.
        let bias = Tensor::zeros((3, 2, 3, 3), DType::F32, &Device::Cpu)?;
        let err = attention(&qkv, 2, ScoreBias::Scores(&bias)).unwrap_err().to_string();
        assert!(err.contains("[3, 2, 3, 3]"), "{err}");
        Ok(())
    }
}
