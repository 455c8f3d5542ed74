//! A language model's decode step as few kernels (`decode.cu`): one token per sequence, so each of the
//! step's products is a matrix times at most [`MAX_BATCH`] vectors and its time is the time to read the
//! weights. Candle's path launches a cuBLAS product, then the bias, the rotary embedding, the cache's
//! scatter, SiLU, the gate's product and the residual add each on its own, about 24 kernels a layer;
//! here a layer is the input norm with the q/k/v projections, rope and the cache write, two attention
//! kernels, o with its residual, the post-attention norm with gate, up and SiLU, and down with its
//! residual: 6 kernels, each output written once (measured: docs/kernels.md#decode). Where a batch's
//! rows are too long for a block to keep normalized (more than [`NORM_MAX`] elements), the norms run
//! as candle's kernel first.
//!
//! Attention over the cache splits it into chunks across the GPU, as flash-decoding does, so that one
//! query token against a long cache still fills the multiprocessors; it serves every batch size.
//!
//! No backward: decode steps are inference. CUDA only: elsewhere the decoder runs candle's ops, which
//! are the reference the GPU tests compare with (`workloads/tests/decode_kernels.rs`).

use candle_core::{DType, Device, Tensor};

use super::options::{Attention, EncoderLayers};
use super::KernelOptions;

/// The most sequences the products take: each lane keeps a sum per sequence, and past 8 the
/// arithmetic, not the reading of the weights, bounds the kernel; larger batches are products of
/// matrices, which cuBLAS does well.
pub const MAX_BATCH: usize = 8;

/// Head sizes of the attention kernel.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// The most query heads one key-value head serves in the attention kernel.
pub const MAX_GROUP: usize = 16;

/// The most cache slots a block of the attention kernel takes (DA_CHUNK in the source).
pub const CHUNK: usize = 64;

/// The fewest blocks the attention kernel is given where the cache allows: twice an H100's 132
/// multiprocessors. At batch 1, a model of two key-value heads over 640 slots in chunks of 64 is 20
/// blocks, each a long chain of work, while the GPU's other multiprocessors wait.
const ATTENTION_BLOCKS: usize = 264;

/// Slots a block of the attention kernel takes: [`CHUNK`], halved down to 16 while the cache's
/// chunks give fewer than [`ATTENTION_BLOCKS`] blocks.
pub fn attention_chunk(batch: usize, kv_heads: usize, capacity: usize) -> usize {
    let mut chunk = CHUNK;
    while chunk > 16 && batch * kv_heads * capacity.div_ceil(chunk) < ATTENTION_BLOCKS {
        chunk /= 2;
    }
    chunk
}

/// The most elements (sequences × row length) a product normalizes itself (NORM_MAX in the source:
/// what a block keeps in shared memory); past it the RMSNorm before it runs as a kernel of its own.
pub const NORM_MAX: usize = 24_320;

/// The RMSNorm in front of a product: its weight and epsilon (Llama's and Qwen2's, computed as
/// transformers does: x / rms(x) rounded, times the weight, rounded).
#[derive(Debug, Clone, Copy)]
pub struct Norm<'a> {
    pub weight: &'a Tensor,
    pub eps: f64,
}

impl<'a> From<&'a candle_nn::RmsNorm> for Norm<'a> {
    fn from(norm: &'a candle_nn::RmsNorm) -> Norm<'a> {
        Norm {
            weight: norm.weight(),
            eps: norm.eps(),
        }
    }
}

/// `x` and the norm for the product's kernel: the norm itself where the kernel keeps the
/// normalized rows, else `x` normalized by candle's kernel first.
#[cfg(feature = "cuda")]
fn normed(x: &Tensor, norm: Option<Norm>) -> candle_core::Result<(Tensor, Option<(Tensor, f32)>)> {
    match norm {
        None => Ok((x.clone(), None)),
        Some(n) if x.elem_count() <= NORM_MAX => Ok((x.clone(), Some((n.weight.clone(), n.eps as f32)))),
        Some(n) => Ok((candle_nn::ops::rms_norm(x, n.weight, n.eps as f32)?, None)),
    }
}

fn half_precision(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// Whether a decode step of `batch` sequences runs its projections, MLP and head as the decode
/// products: on a CUDA device, in bf16 or f16, at most [`MAX_BATCH`] sequences, every row length
/// (`widths`: the hidden size, the attention's width, the MLP's) whole 16-byte words, and the kernel
/// options' layers fused.
pub fn products_take(device: &Device, dtype: DType, batch: usize, widths: &[usize]) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && half_precision(dtype)
        && (1..=MAX_BATCH).contains(&batch)
        && widths.iter().all(|w| w.is_multiple_of(8))
        && KernelOptions::active().layers == EncoderLayers::Fused
}

/// Whether a decode step's attention runs as the split kernel: on a CUDA device, in bf16 or f16,
/// heads of [`HEAD_DIMS`], at most [`MAX_GROUP`] query heads a key-value head, and the kernel options'
/// attention fused.
pub fn attention_takes(device: &Device, dtype: DType, head_dim: usize, group: usize) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && half_precision(dtype)
        && HEAD_DIMS.contains(&head_dim)
        && (1..=MAX_GROUP).contains(&group)
        && KernelOptions::active().attention == Attention::Fused
}

/// The heads of one attention layer: query heads, key-value heads, features a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub q: usize,
    pub kv: usize,
    pub dim: usize,
}

/// Where a decode step's sequences stand in the cache, on the device.
#[derive(Debug, Clone, Copy)]
pub enum Slots<'a> {
    /// Every sequence at one position, [1] u32, of buffers [batch, kv heads, capacity, dim]: a
    /// generation's batch, which started together.
    Shared(&'a Tensor),
    /// Each sequence at its own position, `positions` [batch] u32, in a pool of blocks [blocks, kv
    /// heads, block, dim], sequence s's blocks `tables[s]` ([batch, blocks a sequence may hold] u32;
    /// entries past its position unread): a server's batch, whose sequences came at different times.
    Paged { positions: &'a Tensor, tables: &'a Tensor },
}

impl Slots<'_> {
    /// The positions (one, or one a sequence) and the block tables, as the ops hold them.
    #[cfg(feature = "cuda")]
    fn held(self) -> (Tensor, Option<Tensor>) {
        match self {
            Slots::Shared(pos) => (pos.clone(), None),
            Slots::Paged { positions, tables } => (positions.clone(), Some(tables.clone())),
        }
    }
}

/// The q, k and v projections of `x` [batch, 1, hidden] (through `norm` first where given), their
/// biases added, q and k rotated at each sequence's position (`slots`) by the tables `cos` and `sin`
/// [positions, dim / 2], k and v written into that slot of `keys` and `values` (buffers or a pool, as
/// `slots` says): q [batch, q heads, dim].
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope(
    x: &Tensor,
    norm: Option<Norm>,
    weights: [&Tensor; 3],
    biases: [Option<&Tensor>; 3],
    (cos, sin): (&Tensor, &Tensor),
    slots: Slots,
    (keys, values): (&Tensor, &Tensor),
    heads: Heads,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (x, norm) = normed(x, norm)?;
        let (pos, tables) = slots.held();
        let op = cuda::QkvRope {
            norm,
            weights: weights.map(Tensor::clone),
            biases: biases.map(|b| b.cloned()),
            cos: cos.clone(),
            sin: sin.clone(),
            pos,
            tables,
            keys: keys.clone(),
            values: values.clone(),
            heads,
        };
        x.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, weights, biases, cos, sin, slots, keys, values, heads);
        candle_core::bail!("the decode kernels run on CUDA devices only")
    }
}

/// `x` [batch, 1, k] (through `norm` first where given) times `w` [n, k] transposed, plus `residual`
/// [batch, 1, n] where given: [batch, 1, n].
pub fn gemv(x: &Tensor, norm: Option<Norm>, w: &Tensor, residual: Option<&Tensor>) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (x, norm) = normed(x, norm)?;
        let op = cuda::Gemv {
            norm,
            w: w.clone(),
            residual: residual.cloned(),
        };
        x.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, w, residual);
        candle_core::bail!("the decode kernels run on CUDA devices only")
    }
}

/// The MLP's gated activation of `x` [batch, 1, k] (through `norm` first where given): silu(x gateᵀ)
/// · (x upᵀ), [batch, 1, n] for `gate` and `up` [n, k].
pub fn swiglu(x: &Tensor, norm: Option<Norm>, gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (x, norm) = normed(x, norm)?;
        let op = cuda::Swiglu {
            norm,
            gate: gate.clone(),
            up: up.clone(),
        };
        x.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, norm, gate, up);
        candle_core::bail!("the decode kernels run on CUDA devices only")
    }
}

/// One query token per sequence, `q` [batch, q heads, dim] (any shape of those elements), against
/// each sequence's slots up to its position (`slots`) of `keys` and `values` (buffers [batch, kv
/// heads, capacity, dim] or a pool, as `slots` says): softmax(q kᵀ / √dim) v, [batch, 1, q heads ·
/// dim].
pub fn attention(q: &Tensor, keys: &Tensor, values: &Tensor, slots: Slots) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (pos, tables) = slots.held();
        let op = cuda::DecodeAttention {
            keys: keys.clone(),
            values: values.clone(),
            pos,
            tables,
        };
        q.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (q, keys, values, slots);
        candle_core::bail!("the decode kernels run on CUDA devices only")
    }
}

/// The index of each row's largest element, the first of equal ones, of `x` [rows, n] on a CUDA
/// device (f32, bf16 or f16): [rows] u32. Greedy decoding's choice, over many blocks a row (candle's
/// argmax scans a row in one block).
pub fn argmax(x: &Tensor) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        x.contiguous()?.apply_op1_no_bwd(&argmax::Argmax)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        candle_core::bail!("the decode kernels run on CUDA devices only")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

    use super::Heads;
    use crate::kernels::launch::{by_dtype, cuda, name, view, Kernel};
    use crate::kernels::sources::DECODE;

    /// Warps per block of the products (DEC_WARPS in the source), one output row (or rotary pair)
    /// each.
    const WARPS: usize = 8;

    fn on_cpu(op: &str) -> Result<(CpuStorage, Shape)> {
        bail!("the decode kernel {op} runs on CUDA devices only; on the CPU migprof uses candle's ops")
    }

    /// (batch, k) of an activation [batch, 1, k] or [batch, k], contiguous from a 16-byte boundary.
    fn activation(l: &Layout, what: &str) -> Result<(usize, usize)> {
        let dims = l.dims();
        let (b, k) = match dims {
            [b, 1, k] | [b, k] => (*b, *k),
            _ => bail!("{what}: an activation of one token per sequence, not {dims:?}"),
        };
        if !(1..=super::MAX_BATCH).contains(&b) {
            bail!("{what}: {b} sequences; the products take 1 to {}", super::MAX_BATCH)
        }
        aligned(l, k, what)?;
        Ok((b, k))
    }

    /// A weight [n, k] that the kernels read in 16-byte words: (n, k).
    fn weight(l: &Layout, k: usize, what: &str) -> Result<usize> {
        let (n, kw) = l.shape().dims2()?;
        if kw != k {
            bail!("{what}: weights [{n}, {kw}] for rows of {k}")
        }
        aligned(l, k, what)?;
        // Row offsets are 64-bit in the kernels; the counts and the grid are not.
        if k > u32::MAX as usize || n.div_ceil(WARPS) > i32::MAX as usize {
            bail!("{what}: [{n}, {k}] is more than the kernel indexes")
        }
        Ok(n)
    }

    fn aligned(l: &Layout, k: usize, what: &str) -> Result<()> {
        match l.contiguous_offsets() {
            Some((start, _)) if start.is_multiple_of(8) && k.is_multiple_of(8) => Ok(()),
            _ => bail!("{what}: the kernels read contiguous rows of whole 16-byte words"),
        }
    }

    /// The kernel of a product: `_norm` where it normalizes x itself.
    fn product_kernel(base: &str, norm: &Option<(Tensor, f32)>, dtype: candle_core::DType, b: usize) -> String {
        let base = if norm.is_some() {
            format!("{base}_norm")
        } else {
            base.to_string()
        };
        format!("{}_b{b}", name(&base, dtype))
    }

    /// The norm's weight, locked for the launch, checked against rows of `k`.
    #[allow(clippy::type_complexity)]
    fn norm_weight<'a>(
        norm: &'a Option<(Tensor, f32)>,
        k: usize,
        what: &str,
    ) -> Result<
        Option<(
            impl std::ops::Deref<Target = candle_core::Storage> + 'a,
            &'a Layout,
            f32,
        )>,
    > {
        let Some((w, eps)) = norm else { return Ok(None) };
        let (ws, wl) = w.storage_and_layout();
        if wl.dims() != [k]
            || wl
                .contiguous_offsets()
                .is_none_or(|(start, _)| !start.is_multiple_of(8))
        {
            bail!("{what}: a norm weight {:?} for rows of {k}", wl.dims())
        }
        Ok(Some((ws, wl, *eps)))
    }

    /// The view of a locked norm weight ([`norm_weight`]) the kernel reads.
    fn norm_view<
        'a,
        T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    >(
        norm: &'a Option<(impl std::ops::Deref<Target = candle_core::Storage>, &Layout, f32)>,
    ) -> Result<Option<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>>> {
        norm.as_ref()
            .map(|(s, l, _)| view::<T>(cuda(s, "norm")?, l, "norm"))
            .transpose()
    }

    /// Pushes the norm's weight (or null) and epsilon.
    fn push_norm<
        'a,
        T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    >(
        a: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
        view: &'a Option<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>>,
        null: &'a u64,
        eps: &'a f32,
    ) {
        match view {
            Some(v) => a.arg(v),
            None => a.arg(null),
        };
        a.arg(eps);
    }

    fn product_cfg(warps: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (warps.div_ceil(WARPS) as u32, 1, 1),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    #[derive(Debug, Clone)]
    pub(super) struct Gemv {
        pub norm: Option<(Tensor, f32)>,
        pub w: Tensor,
        pub residual: Option<Tensor>,
    }

    impl CustomOp1 for Gemv {
        fn name(&self) -> &'static str {
            "decode-gemv"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            on_cpu("gemv")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (b, k) = activation(xl, "decode product")?;
            let (ws, wl) = self.w.storage_and_layout();
            let ws = cuda(&ws, "decode product's weights")?;
            let n = weight(wl, k, "decode product")?;
            let residual = self.residual.as_ref().map(|r| r.storage_and_layout());
            if let Some((_, rl)) = &residual {
                if rl.shape().elem_count() != b * n || rl.contiguous_offsets().is_none() {
                    bail!("decode product: a residual {:?} for an output [{b}, 1, {n}]", rl.dims())
                }
            }
            let norm = norm_weight(&self.norm, k, "decode product")?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &DECODE, &product_kernel("decode_gemv", &self.norm, x.dtype(), b))?;
            let (n32, k32) = (n as u32, k as u32);
            let null = 0u64;
            let eps = norm.as_ref().map_or(0.0, |(_, _, eps)| *eps);
            let out = by_dtype!(x.dtype(), "the decode products", T => {
                let xv = view::<T>(x, xl, "decode product")?;
                let wv = view::<T>(ws, wl, "decode product's weights")?;
                let nv = norm_view::<T>(&norm)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(b * n)? };
                let mut a = func.builder();
                a.arg(&wv).arg(&xv);
                push_norm(&mut a, &nv, &null, &eps);
                let rv = match &residual {
                    Some((rs, rl)) => Some(view::<T>(cuda(rs, "decode product's residual")?, rl, "residual")?),
                    None => None,
                };
                match &rv {
                    Some(rv) => a.arg(rv),
                    None => a.arg(&null),
                };
                a.arg(&out).arg(&n32).arg(&k32);
                // SAFETY: argument types and order match the kernel; w holds n·k and x b·k elements
                // from 16-byte boundaries (checked above), the residual and out b·n.
                unsafe { func.launch(&mut a, product_cfg(n)) }?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from((b, 1, n))))
        }
    }

    #[derive(Debug, Clone)]
    pub(super) struct Swiglu {
        pub norm: Option<(Tensor, f32)>,
        pub gate: Tensor,
        pub up: Tensor,
    }

    impl CustomOp1 for Swiglu {
        fn name(&self) -> &'static str {
            "decode-swiglu"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            on_cpu("swiglu")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
            let (b, k) = activation(xl, "decode MLP")?;
            let (gs, gl) = self.gate.storage_and_layout();
            let (us, ul) = self.up.storage_and_layout();
            let (gs, us) = (cuda(&gs, "gate_proj")?, cuda(&us, "up_proj")?);
            let n = weight(gl, k, "decode MLP's gate")?;
            if weight(ul, k, "decode MLP's up")? != n {
                bail!("decode MLP: gate {:?} and up {:?} differ", gl.dims(), ul.dims())
            }
            let norm = norm_weight(&self.norm, k, "decode MLP")?;
            let dev = x.device().clone();
            let func = Kernel::load(
                &dev,
                &DECODE,
                &product_kernel("decode_swiglu", &self.norm, x.dtype(), b),
            )?;
            let (n32, k32) = (n as u32, k as u32);
            let null = 0u64;
            let eps = norm.as_ref().map_or(0.0, |(_, _, eps)| *eps);
            let out = by_dtype!(x.dtype(), "the decode products", T => {
                let (xv, gv, uv) = (view::<T>(x, xl, "decode MLP")?, view::<T>(gs, gl, "gate")?, view::<T>(us, ul, "up")?);
                let nv = norm_view::<T>(&norm)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(b * n)? };
                let mut a = func.builder();
                a.arg(&gv).arg(&uv).arg(&xv);
                push_norm(&mut a, &nv, &null, &eps);
                a.arg(&out).arg(&n32).arg(&k32);
                // SAFETY: argument types and order match the kernel; gate and up hold n·k, x b·k from
                // 16-byte boundaries, out b·n.
                unsafe { func.launch(&mut a, product_cfg(n)) }?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from((b, 1, n))))
        }
    }

    /// A tensor the op holds besides its argument, locked for reading while the kernel is launched.
    fn held(t: &Tensor) -> (impl std::ops::Deref<Target = candle_core::Storage> + '_, &Layout) {
        t.storage_and_layout()
    }

    #[derive(Debug, Clone)]
    pub(super) struct QkvRope {
        pub norm: Option<(Tensor, f32)>,
        pub weights: [Tensor; 3],
        pub biases: [Option<Tensor>; 3],
        pub cos: Tensor,
        pub sin: Tensor,
        pub pos: Tensor,
        pub tables: Option<Tensor>,
        pub keys: Tensor,
        pub values: Tensor,
        pub heads: Heads,
    }

    /// The cache's addressing, checked against `b` sequences of `hkv` key-value heads of `d`: the
    /// block (buffers: their capacity), the block tables' row length (buffers: 0) and whether each
    /// sequence has a position of its own (1) or all share one (0).
    fn addressing(
        keys: &Layout,
        pos: &Layout,
        tables: Option<&Layout>,
        b: usize,
        hkv: usize,
        d: usize,
        what: &str,
    ) -> Result<(usize, usize, u32)> {
        match tables {
            None => {
                let cap = match keys.dims() {
                    [kb, kh, cap, kd] if (*kb, *kh, *kd) == (b, hkv, d) => *cap,
                    other => bail!("{what}: cache buffers {other:?} for {b} sequences of {hkv} heads of {d}"),
                };
                if pos.dims() != [1] {
                    bail!("{what}: one position for a batch in buffers, not {:?}", pos.dims())
                }
                Ok((cap, 0, 0))
            }
            Some(t) => {
                let block = match keys.dims() {
                    [_, kh, block, kd] if (*kh, *kd) == (hkv, d) && *block > 0 => *block,
                    other => bail!("{what}: a KV pool {other:?} for heads of {hkv} of {d}"),
                };
                let stride = match t.dims() {
                    [tb, stride] if *tb == b && t.contiguous_offsets().is_some() => *stride,
                    other => bail!("{what}: block tables {other:?} for {b} sequences"),
                };
                if pos.dims() != [b] {
                    bail!("{what}: positions {:?} for {b} sequences", pos.dims())
                }
                Ok((block, stride, 1))
            }
        }
    }

    impl CustomOp1 for QkvRope {
        fn name(&self) -> &'static str {
            "decode-qkv-rope"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            on_cpu("qkv-rope")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
            let what = "decode q/k/v";
            let (b, k) = activation(xl, what)?;
            let Heads { q: hq, kv: hkv, dim: d } = self.heads;
            let weights = self.weights.each_ref().map(held);
            for ((_, l), rows) in weights.iter().zip([hq * d, hkv * d, hkv * d]) {
                if weight(l, k, what)? != rows {
                    bail!("{what}: a projection {:?} for {rows} rows", l.dims())
                }
            }
            let biases = self.biases.each_ref().map(|b| b.as_ref().map(held));
            for ((_, l), rows) in biases
                .iter()
                .zip([hq * d, hkv * d, hkv * d])
                .filter_map(|(b, r)| Some((b.as_ref()?, r)))
            {
                if l.dims() != [rows] || l.contiguous_offsets().is_none() {
                    bail!("{what}: a bias {:?} for {rows} rows", l.dims())
                }
            }
            let (cos, sin, pos) = (held(&self.cos), held(&self.sin), held(&self.pos));
            let positions = cos.1.dims().first().copied().unwrap_or(0);
            if cos.1.dims() != [positions, d / 2] || sin.1.dims() != cos.1.dims() {
                bail!(
                    "{what}: rotary tables {:?} and {:?} for heads of {d}",
                    cos.1.dims(),
                    sin.1.dims(),
                )
            }
            let (keys, values) = (held(&self.keys), held(&self.values));
            let tables = self.tables.as_ref().map(held);
            let (cap, stride, pos_stride) = addressing(keys.1, pos.1, tables.as_ref().map(|t| t.1), b, hkv, d, what)?;
            if values.1.dims() != keys.1.dims()
                || keys.1.contiguous_offsets().is_none()
                || values.1.contiguous_offsets().is_none()
            {
                bail!(
                    "{what}: key and value buffers {:?} and {:?}",
                    keys.1.dims(),
                    values.1.dims()
                )
            }
            // The positions are checked on the host by the caller (the decoder's step): each below the
            // rotary tables' rows and the slots its sequence holds, and its block in the pool.
            let norm = norm_weight(&self.norm, k, what)?;
            let dev = x.device().clone();
            let func = Kernel::load(&dev, &DECODE, &product_kernel("decode_qkv", &self.norm, x.dtype(), b))?;
            let dims = [hq, hkv, d, k, cap].map(|v| v as u32);
            let stride32 = stride as u32;
            let null = 0u64;
            let eps = norm.as_ref().map_or(0.0, |(_, _, eps)| *eps);
            let out = by_dtype!(x.dtype(), "the decode products", T => {
                let w = weights.each_ref().map(|(s, l)| cuda(s, what).and_then(|s| view::<T>(s, l, what)));
                let [wq, wk, wv] = w;
                let (wq, wk, wv) = (wq?, wk?, wv?);
                let bias = biases.each_ref().map(|b| b.as_ref().map(|(s, l)| cuda(s, what).and_then(|s| view::<T>(s, l, what))).transpose());
                let [bq, bk, bv] = bias;
                let (bq, bk, bv) = (bq?, bk?, bv?);
                let cv = view::<T>(cuda(&cos.0, what)?, cos.1, "cos")?;
                let sv = view::<T>(cuda(&sin.0, what)?, sin.1, "sin")?;
                let pv = view::<u32>(cuda(&pos.0, what)?, pos.1, "position")?;
                let kv = view::<T>(cuda(&keys.0, what)?, keys.1, "keys")?;
                let vv = view::<T>(cuda(&values.0, what)?, values.1, "values")?;
                let tv = tables.as_ref().map(|(s, l)| cuda(s, what).and_then(|s| view::<u32>(s, l, "block tables"))).transpose()?;
                let xv = view::<T>(x, xl, what)?;
                let nv = norm_view::<T>(&norm)?;
                // SAFETY: the kernel writes every element.
                let out = unsafe { dev.alloc::<T>(b * hq * d)? };
                let mut a = func.builder();
                a.arg(&wq).arg(&wk).arg(&wv);
                for bias in [&bq, &bk, &bv] {
                    match bias {
                        Some(v) => a.arg(v),
                        None => a.arg(&null),
                    };
                }
                a.arg(&cv).arg(&sv).arg(&pv).arg(&xv);
                push_norm(&mut a, &nv, &null, &eps);
                a.arg(&out).arg(&kv).arg(&vv);
                for v in &dims {
                    a.arg(v);
                }
                match &tv {
                    Some(t) => a.arg(t),
                    None => a.arg(&null),
                };
                a.arg(&stride32).arg(&pos_stride);
                // SAFETY: argument types and order match the kernel; every weight, bias, table and
                // buffer has the shape checked above, x b·k elements, out b·hq·d. The kernel writes
                // the keys' and values' slot of each position through these views: the buffers belong to the
                // cache, whose later readers are kernels on this same stream.
                unsafe { func.launch(&mut a, product_cfg((hq + 2 * hkv) * d / 2)) }?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from((b, hq, d))))
        }
    }

    #[derive(Debug, Clone)]
    pub(super) struct DecodeAttention {
        pub keys: Tensor,
        pub values: Tensor,
        pub pos: Tensor,
        pub tables: Option<Tensor>,
    }

    impl CustomOp1 for DecodeAttention {
        fn name(&self) -> &'static str {
            "decode-attention"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            on_cpu("attention")
        }

        fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> Result<(CudaStorage, Shape)> {
            let what = "decode attention";
            let (keys, values, pos) = (
                self.keys.storage_and_layout(),
                self.values.storage_and_layout(),
                self.pos.storage_and_layout(),
            );
            let tables = self.tables.as_ref().map(|t| t.storage_and_layout());
            let (b, hkv, d) = match (keys.1.dims(), &tables) {
                ([b, h, _, d], None) => (*b, *h, *d),
                ([_, h, _, d], Some((_, tl))) => (tl.dims().first().copied().unwrap_or(0), *h, *d),
                (other, _) => bail!("{what}: key buffers {other:?}, not [batch or blocks, heads, slots, dim]"),
            };
            let (block, stride, pos_stride) = addressing(keys.1, pos.1, tables.as_ref().map(|t| t.1), b, hkv, d, what)?;
            // The most slots a sequence holds: the chunks' grid covers them.
            let cap = block * stride.max(1);
            let per_seq = ql.shape().elem_count() / b.max(1);
            if ql.shape().elem_count() != b * per_seq || !per_seq.is_multiple_of(d) || ql.contiguous_offsets().is_none()
            {
                bail!("{what}: queries {:?} for {b} sequences of heads of {d}", ql.dims())
            }
            let hq = per_seq / d;
            // The kernel keeps MAX_GROUP query heads' scores in shared memory, reads queries and heads
            // of 64 or 128 in 16-byte words from the tensors' first element, and has a grid row per
            // (sequence, key-value head).
            let words = |l: &Layout| l.contiguous_offsets().is_some_and(|(start, _)| start.is_multiple_of(8));
            if !super::HEAD_DIMS.contains(&d)
                || hkv == 0
                || hq / hkv > super::MAX_GROUP
                || b * hkv > 65_535
                || !words(ql)
                || !words(keys.1)
                || !words(values.1)
            {
                bail!(
                    "{what}: {hq} query heads over {hkv} of {d} for {b} sequences, queries from element {}, buffers from elements {:?} and {:?}: the kernel takes heads of {:?}, at most {} query heads a key-value head, whole 16-byte words",
                    ql.start_offset(),
                    keys.1.start_offset(),
                    values.1.start_offset(),
                    super::HEAD_DIMS,
                    super::MAX_GROUP
                )
            }
            if values.1.dims() != keys.1.dims() || !hq.is_multiple_of(hkv) {
                bail!(
                    "{what}: queries {:?}, keys {:?}, values {:?}",
                    ql.dims(),
                    keys.1.dims(),
                    values.1.dims(),
                )
            }
            let chunk = super::attention_chunk(b, hkv, cap);
            let chunks = cap.div_ceil(chunk);
            let dev = q.device().clone();
            let attend = Kernel::load(&dev, &DECODE, &format!("{}_d{d}", name("decode_attention", q.dtype())))?;
            let combine = Kernel::load(
                &dev,
                &DECODE,
                &format!("{}_d{d}", name("decode_attention_combine", q.dtype())),
            )?;
            // SAFETY (both): every chunk at or before the position writes its part; the combine reads
            // only those.
            let part_out = unsafe { dev.alloc::<f32>(b * hq * chunks * d)? };
            let part_ml = unsafe { dev.alloc::<f32>(b * hq * chunks * 2)? };
            let scale = (1.0 / (d as f64).sqrt() * std::f64::consts::LOG2_E) as f32;
            let (hq32, hkv32, block32, chunks32, chunk32, stride32) = (
                hq as u32,
                hkv as u32,
                block as u32,
                chunks as u32,
                chunk as u32,
                stride as u32,
            );
            let null = 0u64;
            let out = by_dtype!(q.dtype(), "decode attention", T => {
                let qv = view::<T>(q, ql, what)?;
                let kv = view::<T>(cuda(&keys.0, what)?, keys.1, "keys")?;
                let vv = view::<T>(cuda(&values.0, what)?, values.1, "values")?;
                let pv = view::<u32>(cuda(&pos.0, what)?, pos.1, "position")?;
                let tv = tables.as_ref().map(|(s, l)| cuda(s, what).and_then(|s| view::<u32>(s, l, "block tables"))).transpose()?;
                let mut a = attend.builder();
                a.arg(&qv).arg(&kv).arg(&vv).arg(&pv).arg(&part_out).arg(&part_ml);
                a.arg(&hq32).arg(&hkv32).arg(&block32).arg(&chunk32).arg(&scale);
                match &tv {
                    Some(t) => a.arg(t),
                    None => a.arg(&null),
                };
                a.arg(&stride32).arg(&pos_stride);
                let cfg = LaunchConfig {
                    grid_dim: (chunks32, (b * hkv) as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: argument types and order match the kernel; q holds b·hq·d, keys and values
                // b·hkv·cap·d (or a pool whose blocks the tables name), the parts b·hq·chunks·(d and
                // 2); each position is below the slots its sequence holds (the decoder's step checks
                // it on the host).
                unsafe { attend.launch(&mut a, cfg) }?;
                // SAFETY: the combine writes every element.
                let out = unsafe { dev.alloc::<T>(b * hq * d)? };
                let mut a = combine.builder();
                a.arg(&part_out).arg(&part_ml).arg(&pv).arg(&out).arg(&chunks32).arg(&chunk32);
                a.arg(&hq32).arg(&pos_stride);
                let cfg = LaunchConfig {
                    grid_dim: ((b * hq) as u32, 1, 1),
                    block_dim: (d as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: as above; out holds b·hq·d.
                unsafe { combine.launch(&mut a, cfg) }?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from((b, 1, hq * d))))
        }
    }
}

#[cfg(feature = "cuda")]
mod argmax {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape};

    use crate::kernels::launch::{by_dtype, name, view, Kernel};
    use crate::kernels::sources::DECODE;

    /// Elements each block of the first pass scans at least, and the most blocks a row.
    const SPAN: usize = 4096;
    const MAX_PARTS: usize = 64;

    #[derive(Debug, Clone, Copy)]
    pub(in crate::kernels::decode) struct Argmax;

    impl CustomOp1 for Argmax {
        fn name(&self) -> &'static str {
            "argmax"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the argmax kernel runs on CUDA devices only; on the CPU migprof uses candle's argmax")
        }

        fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let (rows, n) = l.shape().dims2()?;
            if n == 0 || rows == 0 || rows > 65_535 || n > u32::MAX as usize {
                bail!("argmax over [{rows}, {n}] is not what the kernel takes")
            }
            let parts = n.div_ceil(SPAN).clamp(1, MAX_PARTS);
            let dev = x.device().clone();
            let first = Kernel::load(&dev, &DECODE, &name("argmax_parts", x.dtype()))?;
            let second = Kernel::load(&dev, &DECODE, "argmax_rows")?;
            // SAFETY: every block writes its part, every row its index.
            let best = unsafe { dev.alloc::<f32>(rows * parts * 2)? };
            let out = unsafe { dev.alloc::<u32>(rows)? };
            let (n32, parts32) = (n as u32, parts as u32);
            by_dtype!(x.dtype(), "argmax", T => {
                let xv = view::<T>(x, l, "argmax")?;
                let mut a = first.builder();
                a.arg(&xv).arg(&best).arg(&n32);
                let cfg = LaunchConfig { grid_dim: (parts32, rows as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: argument types and order match the kernel; x holds rows·n elements, best
                // rows·parts pairs.
                unsafe { first.launch(&mut a, cfg) }?;
            });
            let mut a = second.builder();
            a.arg(&best).arg(&out).arg(&parts32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; out holds rows indices.
            unsafe { second.launch(&mut a, cfg) }?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_chunks_shrink_until_the_blocks_fill_the_gpu() {
        // Qwen2.5-1.5B at batch 1 (two key-value heads, 640 slots): 20 blocks of 64 would idle the
        // GPU; 80 of 16. Llama-3.2-1B at batch 32 fills it with chunks of 64.
        assert_eq!(attention_chunk(1, 2, 640), 16);
        assert_eq!(attention_chunk(1, 8, 640), 16);
        assert_eq!(attention_chunk(2, 8, 640), 32);
        assert_eq!(attention_chunk(4, 8, 640), 64);
        assert_eq!(attention_chunk(32, 8, 640), 64);
        assert_eq!(attention_chunk(1, 8, 4096), 64);
        assert!(attention_chunk(1, 1, 1) == 16);
    }
}
