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

use super::defines::decode::WORDS_IN_FLIGHT;
pub use super::defines::decode::{CHUNK, MAX_GROUP, NORM_MAX};
use super::options::{Attention, EncoderLayers};
use super::KernelOptions;

/// The most sequences the products take: each lane keeps a sum per sequence, and past 8 the
/// arithmetic, not the reading of the weights, bounds the kernel; larger batches are products of
/// matrices, which cuBLAS does well.
pub const MAX_BATCH: usize = 8;

/// The most sequences for which a decode step's layers run as one op ([`layers`]) and its kernels
/// start while the one before them finishes (`Kernel::launch_overlapping`): at batch 1 the step's
/// short kernels leave the memory idle between them, and overlapping them made the step faster; at
/// batch 8 it made Llama-3.2-1B's step slower, and the layers as one op without the overlap gained
/// nothing (measured: docs/kernels.md#decode).
pub const OVERLAP_MAX_BATCH: usize = 1;

fn words_in_flight(batch: usize) -> usize {
    if batch <= 4 {
        WORDS_IN_FLIGHT
    } else {
        WORDS_IN_FLIGHT / 2
    }
}

/// Warps of the single-row product a multiprocessor holds at once: 4 blocks of 8 warps (64 registers
/// a thread).
const WARPS_PER_MULTIPROCESSOR: usize = 32;

/// Warps the single-row product splits each of its `n` rows of `k` elements over (1, 2, 4 or 8, a
/// block's warps), so that it makes the fewest round trips to memory one after another: a warp's
/// groups of loads (each waits for the one before) times the waves of blocks the GPU runs one after
/// another once the warps are more than it holds. A short product of long rows (the MLP's down
/// projection of a small model) is a chain of groups in one wave and gains from the split; a large
/// one (Llama-3.1-8B's down at batch 1) is one wave of seven groups that a split would turn into
/// eight waves of one. Whole rows win a tie: a split that trades groups for waves one for one
/// (Llama-3.1-8B's o_proj, whose 4,096 rows fill a wave) keeps the same chain and adds a sum through
/// shared memory and a barrier. Of splits with equal counts, the one whose warps make fewer groups,
/// then the smaller. A product that normalizes x itself (the head) keeps its rows whole: each block
/// would redo the norm. A wave is what `multiprocessors` hold: a slice of 16 runs a product in more
/// waves than the whole GPU, and splits less.
pub fn gemv_split(n: usize, k: usize, batch: usize, norm: bool, multiprocessors: usize) -> usize {
    if norm {
        return 1;
    }
    let words = k.div_ceil(8);
    let trips = |split: usize| {
        let groups = words.div_ceil(split).div_ceil(32 * words_in_flight(batch));
        let resident = multiprocessors.max(1) * WARPS_PER_MULTIPROCESSOR;
        ((n * split).div_ceil(resident) * groups, split > 1, groups)
    };
    [1, 2, 4, 8].into_iter().min_by_key(|split| trips(*split)).unwrap_or(1)
}

/// Head sizes of the attention kernel.
pub const HEAD_DIMS: [usize; 2] = [64, 128];

/// The fewest blocks the attention kernel is given where the cache allows, per multiprocessor: two.
/// At batch 1, a model of two key-value heads over 640 slots in chunks of 64 is 20 blocks, each a
/// long chain of work, while most of an H200's 132 multiprocessors wait.
const ATTENTION_BLOCKS_PER_MULTIPROCESSOR: usize = 2;

/// Slots a block of the attention kernel takes: [`CHUNK`], halved down to 16 while the cache's
/// chunks give fewer than [`ATTENTION_BLOCKS_PER_MULTIPROCESSOR`] blocks for each of the
/// `multiprocessors`.
pub fn attention_chunk(batch: usize, kv_heads: usize, capacity: usize, multiprocessors: usize) -> usize {
    let blocks = multiprocessors.max(1) * ATTENTION_BLOCKS_PER_MULTIPROCESSOR;
    let mut chunk = CHUNK;
    while chunk > 16 && batch * kv_heads * capacity.div_ceil(chunk) < blocks {
        chunk /= 2;
    }
    chunk
}

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

/// One decoder layer's weights and its part of the cache, for [`layers`].
#[derive(Debug, Clone, Copy)]
pub struct Layer<'a> {
    pub input_norm: Norm<'a>,
    /// q_proj's, k_proj's and v_proj's weights and biases.
    pub qkv: [&'a Tensor; 3],
    pub biases: [Option<&'a Tensor>; 3],
    pub o: &'a Tensor,
    pub post_norm: Norm<'a>,
    pub gate: &'a Tensor,
    pub up: &'a Tensor,
    pub down: &'a Tensor,
    /// The layer's keys and values: buffers or a pool, as the step's slots say.
    pub cache: (&'a Tensor, &'a Tensor),
}

/// Whether [`layers`] takes a decode step of `batch` sequences of `hidden` features: at most
/// [`OVERLAP_MAX_BATCH`] sequences, where the products ([`products_take`]) and the attention kernel
/// ([`attention_takes`]) both take it and each product keeps the batch's normalized rows itself
/// ([`NORM_MAX`]).
pub fn layers_take(products: bool, attention: bool, batch: usize, hidden: usize) -> bool {
    products && attention && batch <= OVERLAP_MAX_BATCH && batch * hidden <= NORM_MAX
}

/// A decode step's layers on the residual stream `x` [batch, 1, hidden], as one op: each layer's
/// [`qkv_rope`] (through its input norm), [`attention`], o_proj's [`gemv`] adding into the stream,
/// [`swiglu`] (through its post-attention norm) and down's [`gemv`] adding into the stream, every
/// kernel launched after the one before with nothing between them. Separate ops allocate each
/// output and free each input between kernels, stream operations that keep a kernel from starting
/// while the one before it finishes (`Kernel::launch_overlapping`); here the memory the layers write
/// is allocated once before the first kernel. `x` after the last layer.
pub fn layers(
    x: &Tensor,
    layers: &[Layer],
    (cos, sin): (&Tensor, &Tensor),
    slots: Slots,
    heads: Heads,
) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let (pos, tables) = slots.held();
        let norm = |n: Norm| (n.weight.clone(), n.eps as f32);
        let op = cuda::Layers {
            layers: layers
                .iter()
                .map(|l| cuda::LayerTensors {
                    input_norm: norm(l.input_norm),
                    qkv: l.qkv.map(Tensor::clone),
                    biases: l.biases.map(|b| b.cloned()),
                    o: l.o.clone(),
                    post_norm: norm(l.post_norm),
                    gate: l.gate.clone(),
                    up: l.up.clone(),
                    down: l.down.clone(),
                    keys: l.cache.0.clone(),
                    values: l.cache.1.clone(),
                })
                .collect(),
            cos: cos.clone(),
            sin: sin.clone(),
            pos,
            tables,
            heads,
        };
        x.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, layers, cos, sin, slots, heads);
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
mod cuda;

#[cfg(feature = "cuda")]
mod argmax;

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200's multiprocessors, and a 1g slice's (MIG, or an MPS client held to 13 %).
    const H200: usize = 132;
    const SLICE_1G: usize = 16;

    #[test]
    fn long_rows_are_split_over_warps_while_that_shortens_the_chain_of_loads() {
        // Qwen2.5-1.5B at batch 1: o_proj's rows of 1,536 are six words a lane, one group, whole;
        // down's 8,960 are five groups in one wave, in eight spans of one group (three waves). At
        // batch 8 (four words in flight) down is two spans of five groups (nine whole).
        assert_eq!(gemv_split(1536, 1536, 1, false, H200), 1);
        assert_eq!(gemv_split(1536, 8960, 1, false, H200), 8);
        assert_eq!(gemv_split(1536, 1536, 8, false, H200), 2);
        assert_eq!(gemv_split(1536, 8960, 8, false, H200), 2);
        // Llama-3.2-1B's down: four groups (eight at batch 8) in one wave, in spans of one group.
        assert_eq!(gemv_split(2048, 8192, 1, false, H200), 4);
        assert_eq!(gemv_split(2048, 8192, 8, false, H200), 8);
        // Llama-3.1-8B: 4,096 rows fill a wave, so a split makes as many waves as it saves groups
        // (or more), and o_proj (two groups at batch 1, four at 8) and down (seven, fourteen) stay
        // whole.
        assert_eq!(gemv_split(4096, 4096, 1, false, H200), 1);
        assert_eq!(gemv_split(4096, 4096, 8, false, H200), 1);
        assert_eq!(gemv_split(4096, 14336, 1, false, H200), 1);
        assert_eq!(gemv_split(4096, 14336, 8, false, H200), 1);
        // Rows of one word, and the head, which normalizes x in every block.
        assert_eq!(gemv_split(1, 8, 1, false, H200), 1);
        assert_eq!(gemv_split(1536, 8960, 1, true, H200), 1);
    }

    #[test]
    fn a_slice_of_fewer_multiprocessors_splits_rows_less() {
        // Qwen2.5-1.5B's down at batch 1 on a 1g slice: its 1,536 whole rows are three waves of
        // five groups (15 trips); eight spans of one group would be 24 waves.
        assert_eq!(gemv_split(1536, 8960, 1, false, SLICE_1G), 1);
        // Llama-3.2-1B's down at batch 1: four waves of four groups against eight waves of two.
        assert_eq!(gemv_split(2048, 8192, 1, false, SLICE_1G), 1);
        // No multiprocessors reported is taken as one.
        assert_eq!(gemv_split(1536, 8960, 1, false, 0), 1);
    }

    #[test]
    fn a_slice_is_filled_by_longer_attention_chunks() {
        // Qwen2.5-1.5B at batch 1 on a 1g slice: 40 blocks of 32 fill its 16 multiprocessors twice.
        assert_eq!(attention_chunk(1, 2, 640, SLICE_1G), 32);
        assert_eq!(attention_chunk(1, 8, 640, SLICE_1G), 64);
        assert_eq!(attention_chunk(1, 1, 1, 0), 16);
    }

    #[test]
    fn attention_chunks_shrink_until_the_blocks_fill_the_gpu() {
        // Qwen2.5-1.5B at batch 1 (two key-value heads, 640 slots): 20 blocks of 64 would idle the
        // GPU; 80 of 16. Llama-3.2-1B at batch 32 fills it with chunks of 64.
        assert_eq!(attention_chunk(1, 2, 640, H200), 16);
        assert_eq!(attention_chunk(1, 8, 640, H200), 16);
        assert_eq!(attention_chunk(2, 8, 640, H200), 32);
        assert_eq!(attention_chunk(4, 8, 640, H200), 64);
        assert_eq!(attention_chunk(32, 8, 640, H200), 64);
        assert_eq!(attention_chunk(1, 8, 4096, H200), 64);
        assert!(attention_chunk(1, 1, 1, H200) == 16);
    }
}
