//! The decode kernels' custom ops on CUDA devices: the products, rotary embedding, the fused layer
//! and attention, launched from `decode.cu`.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

use super::Heads;
use crate::kernels::defines::decode::{ATTENTION_THREADS, COMBINE_THREADS, NORM_MAX, WARPS};
use crate::kernels::launch::{address, by_dtype, name, slice_address, Kernel};
use crate::kernels::sources::DECODE;

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
    if k > u32::MAX as usize || n > i32::MAX as usize {
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

/// The device address of a tensor the op holds, checked to be on the device, of `dtype`, and
/// contiguous.
fn address_of(t: &Tensor, dtype: DType, what: &str) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        bail!("{what}: a tensor the kernel reads is not on the CUDA device")
    };
    if s.dtype() != dtype {
        bail!("{what}: a tensor of {:?} where the step's are {dtype:?}", s.dtype())
    }
    address(s, l, what)
}

/// The address of an optional tensor, 0 (the kernel's "none") without one.
fn address_or_null(t: Option<&Tensor>, dtype: DType, what: &str) -> Result<u64> {
    t.map_or(Ok(0), |t| address_of(t, dtype, what))
}

/// A weight [n, k] checked as [`weight`] does, with its address.
fn weight_at(t: &Tensor, k: usize, dtype: DType, what: &str) -> Result<(usize, u64)> {
    let n = weight(t.layout(), k, what)?;
    Ok((n, address_of(t, dtype, what)?))
}

/// The kernel of a product: `_norm` where it normalizes x itself.
fn product_kernel(dev: &CudaDevice, base: &str, norm: bool, dtype: DType, b: usize, overlap: bool) -> Result<Kernel> {
    let base = if norm { format!("{base}_norm") } else { base.to_string() };
    load(dev, &format!("{}_b{b}", name(&base, dtype)), overlap)
}

/// A decode kernel, overlapping the kernel before it where `overlap`. Only [`Layers`] asks for
/// it: a product loads its weights before it waits for the kernel ahead, so the weights must not
/// be what that kernel writes, which holds for a model's parameters, not for any tensor a
/// caller of the single ops may pass (and between single ops the stream's allocations keep
/// kernels from overlapping anyway).
fn load(dev: &CudaDevice, kernel: &str, overlap: bool) -> Result<Kernel> {
    Ok(Kernel::load(dev, &DECODE, kernel)?.overlapping(overlap))
}

/// The norm's weight checked against rows of `k`: its address and epsilon, or (0, 0) without a
/// norm.
fn norm_at(norm: Option<&(Tensor, f32)>, k: usize, dtype: DType, what: &str) -> Result<(u64, f32)> {
    let Some((w, eps)) = norm else { return Ok((0, 0.0)) };
    let l = w.layout();
    if l.dims() != [k] || l.contiguous_offsets().is_none_or(|(start, _)| !start.is_multiple_of(8)) {
        bail!("{what}: a norm weight {:?} for rows of {k}", l.dims())
    }
    Ok((address_of(w, dtype, what)?, *eps))
}

fn product_cfg(warps: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (warps.div_ceil(WARPS) as u32, 1, 1),
        block_dim: ((WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Memory for `n` elements of `dtype` that a kernel writes whole, as storage, and its address.
fn output(dev: &CudaDevice, dtype: DType, n: usize) -> Result<(CudaStorage, u64)> {
    Ok(by_dtype!(dtype, "the decode kernels", T => {
        // SAFETY: the kernel given it writes every element before anything reads it.
        let slice = unsafe { dev.alloc::<T>(n)? };
        let at = slice_address(&slice);
        (CudaStorage::wrap_cuda_slice(slice, dev.clone()), at)
    }))
}

// One launch per kernel, from device addresses. Each kernel loads only weights before its
// wait_for_inputs, so each is launched to overlap the kernel ahead of it.

/// What a product reads and writes: x [b, k], the norm before it (address 0: none), out [b, n].
struct Product {
    x: u64,
    norm: (u64, f32),
    out: u64,
    n: usize,
    k: usize,
}

/// out = x · wᵀ (+ res where its address is not 0), each row split over
/// [`super::gemv_split`] warps.
fn launch_gemv(f: &Kernel, w: u64, res: u64, p: &Product, b: usize) -> Result<()> {
    let split = super::gemv_split(p.n, p.k, b, p.norm.0 != 0, f.multiprocessors()?);
    let mut a = f.params();
    a.ptr(w).ptr(p.x).ptr(p.norm.0).f32(p.norm.1).ptr(res).ptr(p.out);
    a.u32(p.n as u32).u32(p.k as u32).u32(split as u32);
    // SAFETY: parameter types and order match decode_gemv*; the caller checked w [n, k], x
    // [b, k] from 16-byte boundaries, res and out [b, n]; split is 1, 2, 4 or 8 (WARPS).
    unsafe { f.launch_overlapping(&mut a, product_cfg(p.n * split)) }
}

/// out = silu(x · gateᵀ) · (x · upᵀ).
fn launch_swiglu(f: &Kernel, gate: u64, up: u64, p: &Product) -> Result<()> {
    let mut a = f.params();
    a.ptr(gate).ptr(up).ptr(p.x).ptr(p.norm.0).f32(p.norm.1).ptr(p.out);
    a.u32(p.n as u32).u32(p.k as u32);
    // SAFETY: parameter types and order match decode_swiglu*; the caller checked gate and up
    // [n, k], x [b, k] from 16-byte boundaries, out [b, n].
    unsafe { f.launch_overlapping(&mut a, product_cfg(p.n)) }
}

/// What a single op's product needs once its weights are checked: its kernel (`base`, `_norm`
/// where `norm` is given; never overlapping, see [`load`]), its output [b, n] as storage, and
/// the [`Product`] over `x` [b, k].
fn single_product(
    x: &CudaStorage,
    xl: &Layout,
    norm: Option<&(Tensor, f32)>,
    base: &str,
    (b, n, k): (usize, usize, usize),
    what: &str,
) -> Result<(Kernel, CudaStorage, Product)> {
    let dtype = x.dtype();
    let norm_at = norm_at(norm, k, dtype, what)?;
    let dev = x.device();
    let f = product_kernel(dev, base, norm.is_some(), dtype, b, false)?;
    let (out, out_at) = output(dev, dtype, b * n)?;
    let p = Product {
        x: address(x, xl, what)?,
        norm: norm_at,
        out: out_at,
        n,
        k,
    };
    Ok((f, out, p))
}

/// Where a step's keys and values go and are read: the buffers or pool, the rotary tables, the
/// positions and block tables, and the cache's addressing ([`addressing`]).
#[derive(Clone, Copy)]
struct Cache {
    keys: u64,
    values: u64,
    pos: u64,
    table: u64,
    /// Slots a block holds (buffers: their capacity), the block tables' row length (buffers:
    /// 0), and whether each sequence has a position of its own.
    block: usize,
    stride: usize,
    pos_stride: u32,
}

/// q, k and v of x (through its norm), rotated, k and v written into the cache; q [b, hq, d].
#[allow(clippy::too_many_arguments)]
fn launch_qkv(
    f: &Kernel,
    w: [u64; 3],
    bias: [u64; 3],
    (cos, sin): (u64, u64),
    cache: &Cache,
    p: &Product,
    heads: Heads,
) -> Result<()> {
    let mut a = f.params();
    for v in w.into_iter().chain(bias).chain([cos, sin, cache.pos, p.x, p.norm.0]) {
        a.ptr(v);
    }
    a.f32(p.norm.1).ptr(p.out).ptr(cache.keys).ptr(cache.values);
    for v in [heads.q, heads.kv, heads.dim, p.k, cache.block] {
        a.u32(v as u32);
    }
    a.ptr(cache.table).u32(cache.stride as u32).u32(cache.pos_stride);
    // SAFETY: parameter types and order match decode_qkv*; the caller checked every weight,
    // bias, table and buffer, x [b, k], out [b, hq, d], and each position below the slots its
    // sequence holds and the rotary tables' rows. The kernel writes each position's slot of
    // the cache, whose later readers are kernels on this same stream.
    unsafe { f.launch_overlapping(&mut a, product_cfg((heads.q + 2 * heads.kv) * heads.dim / 2)) }
}

/// The split attention's two kernels and the chunking of the cache for `b` sequences.
struct Attend {
    attend: Kernel,
    combine: Kernel,
    chunk: usize,
    chunks: usize,
}

impl Attend {
    fn load(dev: &CudaDevice, dtype: DType, b: usize, heads: Heads, cache: &Cache, overlap: bool) -> Result<Attend> {
        // The most slots a sequence holds: the chunks' grid covers them.
        let cap = cache.block * cache.stride.max(1);
        let d = heads.dim;
        let attend = load(dev, &format!("{}_d{d}", name("decode_attention", dtype)), overlap)?;
        let chunk = super::attention_chunk(b, heads.kv, cap, attend.multiprocessors()?);
        Ok(Attend {
            attend,
            combine: load(
                dev,
                &format!("{}_d{d}", name("decode_attention_combine", dtype)),
                overlap,
            )?,
            chunk,
            chunks: cap.div_ceil(chunk),
        })
    }

    /// Elements of the partial outputs and of the (max, sum) pairs for `b` sequences.
    fn parts(&self, b: usize, heads: Heads) -> (usize, usize) {
        let rows = b * heads.q * self.chunks;
        (rows * heads.dim, rows * 2)
    }

    /// softmax(q kᵀ / √d) v of q [b, hq, d] over the cache into out [b, hq · d], through the
    /// partial softmaxes `parts` (addresses of [`Attend::parts`]'s f32 elements).
    fn launch(&self, b: usize, heads: Heads, cache: &Cache, q: u64, parts: (u64, u64), out: u64) -> Result<()> {
        let scale = (1.0 / (heads.dim as f64).sqrt() * std::f64::consts::LOG2_E) as f32;
        let mut a = self.attend.params();
        a.ptr(q)
            .ptr(cache.keys)
            .ptr(cache.values)
            .ptr(cache.pos)
            .ptr(parts.0)
            .ptr(parts.1);
        a.u32(heads.q as u32)
            .u32(heads.kv as u32)
            .u32(cache.block as u32)
            .u32(self.chunk as u32);
        a.f32(scale)
            .ptr(cache.table)
            .u32(cache.stride as u32)
            .u32(cache.pos_stride);
        let cfg = LaunchConfig {
            grid_dim: (self.chunks as u32, (b * heads.kv) as u32, 1),
            block_dim: (ATTENTION_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: parameter types and order match decode_attention_*; the caller checked q [b,
        // hq, d], the cache's buffers or pool and tables, and each position below the slots
        // its sequence holds; the parts hold b·hq·chunks·(d and 2) elements. Before its wait
        // the kernel reads the positions, the block tables and the cache's slots before each
        // position, none of which q/k/v (the kernel ahead) writes: it writes q and the
        // position's own slot, which the kernel loads after its wait.
        unsafe { self.attend.launch_overlapping(&mut a, cfg) }?;
        let mut a = self.combine.params();
        a.ptr(parts.0).ptr(parts.1).ptr(cache.pos).ptr(out);
        a.u32(self.chunks as u32)
            .u32(self.chunk as u32)
            .u32(heads.q as u32)
            .u32(cache.pos_stride);
        let cfg = LaunchConfig {
            grid_dim: ((b * heads.q) as u32, 1, 1),
            block_dim: (COMBINE_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; out holds b·hq·d.
        unsafe { self.combine.launch_overlapping(&mut a, cfg) }
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
        let what = "decode product";
        let (b, k) = activation(xl, what)?;
        let dtype = x.dtype();
        let (n, w) = weight_at(&self.w, k, dtype, what)?;
        if let Some(r) = &self.residual {
            if r.elem_count() != b * n || !r.is_contiguous() {
                bail!("{what}: a residual {:?} for an output [{b}, 1, {n}]", r.dims())
            }
        }
        let res = address_or_null(self.residual.as_ref(), dtype, what)?;
        let (f, out, p) = single_product(x, xl, self.norm.as_ref(), "decode_gemv", (b, n, k), what)?;
        launch_gemv(&f, w, res, &p, b)?;
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
        let what = "decode MLP";
        let (b, k) = activation(xl, what)?;
        let dtype = x.dtype();
        let (n, gate) = weight_at(&self.gate, k, dtype, "decode MLP's gate")?;
        let (nu, up) = weight_at(&self.up, k, dtype, "decode MLP's up")?;
        if nu != n {
            bail!("{what}: gate {:?} and up {:?} differ", self.gate.dims(), self.up.dims())
        }
        let (f, out, p) = single_product(x, xl, self.norm.as_ref(), "decode_swiglu", (b, n, k), what)?;
        launch_swiglu(&f, gate, up, &p)?;
        Ok((out, Shape::from((b, 1, n))))
    }
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

/// The positions, block tables and one layer's keys and values as the kernels address them,
/// checked against `b` sequences of `heads`. The positions themselves are checked on the host
/// by the caller (the decoder's step): each below the rotary tables' rows and the slots its
/// sequence holds, and its block in the pool.
fn cache_at(
    (keys, values): (&Tensor, &Tensor),
    pos: &Tensor,
    tables: Option<&Tensor>,
    b: usize,
    heads: Heads,
    dtype: DType,
    what: &str,
) -> Result<Cache> {
    let (block, stride, pos_stride) = addressing(
        keys.layout(),
        pos.layout(),
        tables.map(Tensor::layout),
        b,
        heads.kv,
        heads.dim,
        what,
    )?;
    if values.dims() != keys.dims() || !keys.is_contiguous() || !values.is_contiguous() {
        bail!(
            "{what}: key and value buffers {:?} and {:?}",
            keys.dims(),
            values.dims()
        )
    }
    Ok(Cache {
        keys: address_of(keys, dtype, what)?,
        values: address_of(values, dtype, what)?,
        pos: address_of(pos, DType::U32, what)?,
        table: address_or_null(tables, DType::U32, what)?,
        block,
        stride,
        pos_stride,
    })
}

/// The heads and the cache's buffers checked for the attention kernel: heads of
/// [`super::HEAD_DIMS`] read in 16-byte words from the buffers' first elements, at most
/// [`super::MAX_GROUP`] query heads a key-value head, one grid row per (sequence, key-value
/// head).
fn check_attention(heads: Heads, b: usize, (keys, values): (&Tensor, &Tensor), what: &str) -> Result<()> {
    let words = |t: &Tensor| t.layout().start_offset().is_multiple_of(8);
    if !super::HEAD_DIMS.contains(&heads.dim)
        || heads.kv == 0
        || !heads.q.is_multiple_of(heads.kv)
        || heads.q / heads.kv > super::MAX_GROUP
        || b * heads.kv > 65_535
        || !words(keys)
        || !words(values)
    {
        bail!(
            "{what}: {} query heads over {} of {} for {b} sequences, buffers from elements {} and {}: the kernel takes heads of {:?}, at most {} query heads a key-value head, whole 16-byte words",
            heads.q,
            heads.kv,
            heads.dim,
            keys.layout().start_offset(),
            values.layout().start_offset(),
            super::HEAD_DIMS,
            super::MAX_GROUP
        )
    }
    Ok(())
}

/// The rotary tables [positions, d / 2] for heads of `d`: their addresses.
fn rotary_at(cos: &Tensor, sin: &Tensor, d: usize, dtype: DType, what: &str) -> Result<(u64, u64)> {
    let positions = cos.dims().first().copied().unwrap_or(0);
    if cos.dims() != [positions, d / 2] || sin.dims() != cos.dims() {
        bail!(
            "{what}: rotary tables {:?} and {:?} for heads of {d}",
            cos.dims(),
            sin.dims()
        )
    }
    Ok((address_of(cos, dtype, what)?, address_of(sin, dtype, what)?))
}

/// One layer's q/k/v projections (with biases where the model has them), checked for rows of
/// `k` and `heads`: their addresses.
fn projections_at(
    weights: &[Tensor; 3],
    biases: &[Option<Tensor>; 3],
    k: usize,
    heads: Heads,
    dtype: DType,
    what: &str,
) -> Result<([u64; 3], [u64; 3])> {
    let rows = [heads.q, heads.kv, heads.kv].map(|h| h * heads.dim);
    let mut w = [0; 3];
    let mut bias = [0; 3];
    for i in 0..3 {
        let (n, at) = weight_at(&weights[i], k, dtype, what)?;
        if n != rows[i] {
            bail!("{what}: a projection {:?} for {} rows", weights[i].dims(), rows[i])
        }
        w[i] = at;
        if let Some(b) = &biases[i] {
            if b.dims() != [rows[i]] || !b.is_contiguous() {
                bail!("{what}: a bias {:?} for {} rows", b.dims(), rows[i])
            }
            bias[i] = address_of(b, dtype, what)?;
        }
    }
    Ok((w, bias))
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
        let dtype = x.dtype();
        let heads = self.heads;
        let (w, bias) = projections_at(&self.weights, &self.biases, k, heads, dtype, what)?;
        let rotary = rotary_at(&self.cos, &self.sin, heads.dim, dtype, what)?;
        let cache = cache_at(
            (&self.keys, &self.values),
            &self.pos,
            self.tables.as_ref(),
            b,
            heads,
            dtype,
            what,
        )?;
        let n = heads.q * heads.dim;
        let (f, out, p) = single_product(x, xl, self.norm.as_ref(), "decode_qkv", (b, n, k), what)?;
        launch_qkv(&f, w, bias, rotary, &cache, &p, heads)?;
        Ok((out, Shape::from((b, heads.q, heads.dim))))
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
        let (b, hkv, d) = match (self.keys.dims(), &self.tables) {
            ([b, h, _, d], None) => (*b, *h, *d),
            ([_, h, _, d], Some(t)) => (t.dims().first().copied().unwrap_or(0), *h, *d),
            (other, _) => bail!("{what}: key buffers {other:?}, not [batch or blocks, heads, slots, dim]"),
        };
        let per_seq = ql.shape().elem_count() / b.max(1);
        if b == 0
            || ql.shape().elem_count() != b * per_seq
            || !per_seq.is_multiple_of(d)
            || ql
                .contiguous_offsets()
                .is_none_or(|(start, _)| !start.is_multiple_of(8))
        {
            bail!(
                "{what}: queries {:?} from element {} for {b} sequences of heads of {d}: the kernel reads whole 16-byte words",
                ql.dims(),
                ql.start_offset()
            )
        }
        let heads = Heads {
            q: per_seq / d,
            kv: hkv,
            dim: d,
        };
        check_attention(heads, b, (&self.keys, &self.values), what)?;
        let dtype = q.dtype();
        let cache = cache_at(
            (&self.keys, &self.values),
            &self.pos,
            self.tables.as_ref(),
            b,
            heads,
            dtype,
            what,
        )?;
        let dev = q.device();
        let attend = Attend::load(dev, dtype, b, heads, &cache, false)?;
        let (po, pm) = attend.parts(b, heads);
        let (part_out, part_ml) = (output(dev, DType::F32, po)?, output(dev, DType::F32, pm)?);
        let (out, out_at) = output(dev, dtype, b * heads.q * d)?;
        attend.launch(b, heads, &cache, address(q, ql, what)?, (part_out.1, part_ml.1), out_at)?;
        // The parts go back in stream order, after the kernels that use them.
        drop((part_out, part_ml));
        Ok((out, Shape::from((b, 1, heads.q * d))))
    }
}

/// One decoder layer's tensors for [`Layers`].
#[derive(Debug, Clone)]
pub(super) struct LayerTensors {
    pub input_norm: (Tensor, f32),
    pub qkv: [Tensor; 3],
    pub biases: [Option<Tensor>; 3],
    pub o: Tensor,
    pub post_norm: (Tensor, f32),
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
    pub keys: Tensor,
    pub values: Tensor,
}

/// A decode step's layers as one op: every layer's six kernels launched back to back, each
/// writing into memory allocated once before the first. Allocations and frees are operations
/// on the stream; between two kernels they would keep the second from overlapping the first.
#[derive(Debug, Clone)]
pub(super) struct Layers {
    pub layers: Vec<LayerTensors>,
    pub cos: Tensor,
    pub sin: Tensor,
    pub pos: Tensor,
    pub tables: Option<Tensor>,
    pub heads: Heads,
}

/// One layer's addresses for [`Layers`], read once its tensors are checked.
struct CheckedLayer {
    qkv: [u64; 3],
    bias: [u64; 3],
    cache: Cache,
    o: u64,
    gate: u64,
    up: u64,
    down: u64,
    input_norm: (u64, f32),
    post_norm: (u64, f32),
}

impl CustomOp1 for Layers {
    fn name(&self) -> &'static str {
        "decode-layers"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        on_cpu("layers")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = "decode layers";
        let (b, k) = activation(xl, what)?;
        if b * k > NORM_MAX {
            bail!("{what}: {b} sequences of {k} are more than a product normalizes itself ({NORM_MAX} elements)")
        }
        let heads = self.heads;
        let dtype = x.dtype();
        let width = heads.q * heads.dim;
        let rotary = rotary_at(&self.cos, &self.sin, heads.dim, dtype, what)?;
        let Some(first) = self.layers.first() else {
            bail!("{what}: no layers")
        };
        let inner = weight(first.gate.layout(), k, what)?;
        // Every layer checked, and its addresses read, before any kernel is launched: a layer
        // refused halfway would leave the ones before it having written the step's keys.
        let mut checked = Vec::with_capacity(self.layers.len());
        let mut first_cache: Option<Cache> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let at = |part: &str| format!("{what}: layer {i}'s {part}");
            let (w, bias) = projections_at(&layer.qkv, &layer.biases, k, heads, dtype, &at("q/k/v"))?;
            check_attention(heads, b, (&layer.keys, &layer.values), &at("cache"))?;
            let cache = cache_at(
                (&layer.keys, &layer.values),
                &self.pos,
                self.tables.as_ref(),
                b,
                heads,
                dtype,
                &at("cache"),
            )?;
            let first = *first_cache.get_or_insert(cache);
            if (cache.block, cache.stride) != (first.block, first.stride) {
                bail!(
                    "{}: {:?} beside the first layer's {:?}",
                    at("cache"),
                    layer.keys.dims(),
                    self.layers[0].keys.dims()
                )
            }
            let rows = |t: &Tensor, k: usize, part: &str, want: usize| -> Result<u64> {
                let (n, address) = weight_at(t, k, dtype, &at(part))?;
                if n != want {
                    bail!(
                        "{}: {:?} for a hidden size of {k} and an MLP of {inner}",
                        at(part),
                        t.dims()
                    )
                }
                Ok(address)
            };
            checked.push(CheckedLayer {
                qkv: w,
                bias,
                cache,
                o: rows(&layer.o, width, "o_proj", k)?,
                gate: rows(&layer.gate, k, "gate_proj", inner)?,
                up: rows(&layer.up, k, "up_proj", inner)?,
                down: rows(&layer.down, inner, "down_proj", k)?,
                input_norm: norm_at(Some(&layer.input_norm), k, dtype, &at("input norm"))?,
                post_norm: norm_at(Some(&layer.post_norm), k, dtype, &at("post-attention norm"))?,
            });
        }
        let first_cache = first_cache.expect("at least one layer");
        let dev = x.device();
        let overlap = b <= super::OVERLAP_MAX_BATCH;
        let qkv = product_kernel(dev, "decode_qkv", true, dtype, b, overlap)?;
        let gemv = product_kernel(dev, "decode_gemv", false, dtype, b, overlap)?;
        let swiglu = product_kernel(dev, "decode_swiglu", true, dtype, b, overlap)?;
        let attend = Attend::load(dev, dtype, b, heads, &first_cache, overlap)?;
        // Everything the layers write, allocated before the first kernel: the residual stream
        // (each layer's o and down add into it in place), q, attention's parts and output, and
        // the MLP's gated activation.
        let (po, pm) = attend.parts(b, heads);
        let (out, stream) = output(dev, dtype, b * k)?;
        let scratch = [
            output(dev, dtype, b * width)?,
            output(dev, DType::F32, po)?,
            output(dev, DType::F32, pm)?,
            output(dev, dtype, b * width)?,
            output(dev, dtype, b * inner)?,
        ];
        let [q, part_out, part_ml, attn, gated] = scratch.each_ref().map(|(_, at)| *at);
        let parts = (part_out, part_ml);
        let mut input = address(x, xl, what)?;
        let product = |x: u64, norm: (u64, f32), out: u64, n: usize, k: usize| Product { x, norm, out, n, k };
        for l in &checked {
            let qkv_product = product(input, l.input_norm, q, width, k);
            launch_qkv(&qkv, l.qkv, l.bias, rotary, &l.cache, &qkv_product, heads)?;
            attend.launch(b, heads, &l.cache, q, parts, attn)?;
            // The first layer adds into the stream from the op's input; later ones in place.
            launch_gemv(&gemv, l.o, input, &product(attn, (0, 0.0), stream, k, width), b)?;
            launch_swiglu(&swiglu, l.gate, l.up, &product(stream, l.post_norm, gated, inner, k))?;
            launch_gemv(&gemv, l.down, stream, &product(gated, (0, 0.0), stream, k, inner), b)?;
            input = stream;
        }
        // The scratch goes back in stream order, after the kernels that use it.
        drop(scratch);
        Ok((out, xl.shape().clone()))
    }
}
