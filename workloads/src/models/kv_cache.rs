//! The keys and values a decoder keeps of every token it has seen, in one of two layouts:
//! contiguous (one buffer per layer, each pass's tokens written after those held) or paged (fixed-size
//! blocks taken from a pool, a block table per sequence, as serving stacks keep them so that
//! sequences can come and go without moving the others' memory).
//!
//! A forward pass writes every layer through [`KvStore::extended`] and then either keeps what it
//! wrote ([`KvStore::commit`]) or, when a layer failed, drops it ([`KvStore::abandon`]): a pass that
//! fails leaves the cache as it was.

use candle_core::{DType, Device, Result, Tensor};

use crate::kernels::prefill::write_rows;

/// What a cache holds per token: layers × key-value heads × head_dim, for keys and for values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Bytes of one token's keys and values, every layer, at `dtype`.
    pub fn token_bytes(&self, dtype: DType) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * dtype.size_in_bytes()
    }
}

/// A decoder's cache, whatever its layout. Every sequence of the batch holds as many tokens.
pub trait KvStore {
    /// Tokens each sequence holds.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Layer `layer`'s keys and values, `k` and `v` ([batch, kv heads, tokens, head_dim], this
    /// pass's) after the ones held: what attention reads, [batch, kv heads, held + tokens, head_dim].
    fn extended(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)>;
    /// Keeps what the pass wrote: every layer ran.
    fn commit(&mut self);
    /// Drops what the pass wrote: a layer failed.
    fn abandon(&mut self);
    /// Bytes the sequences' keys and values take: the buffers held, every slot counted (contiguous:
    /// the room reserved, or grown to), or the blocks taken (paged: a partly filled block counts
    /// whole, as it is held).
    fn bytes(&self) -> usize;
    /// Empties the cache for new sequences, keeping the memory it owns (a paged cache's pool).
    fn reset(&mut self);
}

/// One buffer per layer for keys and one for values, [batch, kv heads, capacity, head_dim], the
/// tokens held first. A pass writes its tokens in place after them (nothing held is copied), and a
/// full buffer grows to twice its capacity. A generation that reserves its room up front
/// ([`KvCache::reserve`]) keeps the buffers where they are, so that its decode steps
/// ([`super::decoder::Decoder::decode_step`]) can be replayed as a CUDA graph.
/// Not `Clone`: a copy would share the buffers that passes write in place.
#[derive(Debug)]
pub struct KvCache {
    shape: KvShape,
    /// Per layer, keys and values; empty until the first pass or reservation.
    buffers: Vec<(Tensor, Tensor)>,
    capacity: usize,
    len: usize,
    /// Tokens of the pass being written, until it commits.
    pending: usize,
    /// Each slot's position, [capacity] u32: what a decode step compares its position with to mask
    /// the slots after it.
    positions: Option<Tensor>,
    /// How many times the buffers were allocated: a graph captured over the old ones is stale.
    allocations: u64,
}

impl KvCache {
    pub fn new(shape: impl Into<KvShape>) -> KvCache {
        KvCache {
            shape: shape.into(),
            buffers: Vec::new(),
            capacity: 0,
            len: 0,
            pending: 0,
            positions: None,
            allocations: 0,
        }
    }

    /// Buffers for `capacity` tokens of each of `batch` sequences at `dtype` on `device`, allocated
    /// now unless the cache's are those already ([`KvCache::reserves_anew`]); the tokens held are
    /// dropped.
    pub fn reserve(&mut self, batch: usize, capacity: usize, dtype: DType, device: &Device) -> Result<()> {
        self.reset();
        if !self.reserves_anew(batch, capacity, dtype, device) {
            return Ok(());
        }
        self.allocate(batch, capacity, dtype, device)
    }

    /// Whether [`KvCache::reserve`] with these would allocate new buffers.
    pub fn reserves_anew(&self, batch: usize, capacity: usize, dtype: DType, device: &Device) -> bool {
        let same = self
            .buffers
            .first()
            .is_some_and(|(k, _)| k.dim(0).ok() == Some(batch) && k.dtype() == dtype && k.device().same_device(device));
        !(same && self.capacity == capacity)
    }

    fn allocate(&mut self, batch: usize, capacity: usize, dtype: DType, device: &Device) -> Result<()> {
        let dims = (batch, self.shape.kv_heads, capacity, self.shape.head_dim);
        // The old buffers go before the new ones are made, unless what they hold moves over.
        let old = std::mem::take(&mut self.buffers);
        let held = if self.len + self.pending > 0 {
            old
        } else {
            drop(old);
            Vec::new()
        };
        let mut buffers = Vec::with_capacity(self.shape.layers);
        for layer in 0..self.shape.layers {
            let (k, v) = (Tensor::zeros(dims, dtype, device)?, Tensor::zeros(dims, dtype, device)?);
            if let Some((ok, ov)) = held.get(layer) {
                k.slice_set(&ok.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
                v.slice_set(&ov.narrow(2, 0, self.len)?.contiguous()?, 2, 0)?;
            }
            buffers.push((k, v));
        }
        self.buffers = buffers;
        self.capacity = capacity;
        self.positions = Some(Tensor::arange(0u32, capacity as u32, device)?);
        self.allocations += 1;
        Ok(())
    }

    /// Tokens each sequence has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Layer `layer`'s key and value buffers, [batch, kv heads, capacity, head_dim].
    pub fn buffers(&self, layer: usize) -> Option<&(Tensor, Tensor)> {
        self.buffers.get(layer)
    }

    /// Each slot's position, [capacity] u32.
    pub fn positions(&self) -> Option<&Tensor> {
        self.positions.as_ref()
    }

    /// How many times the buffers were allocated.
    pub fn allocations(&self) -> u64 {
        self.allocations
    }

    /// Counts `tokens` more as held: a pass that wrote the buffers itself (a decode step).
    pub fn advance(&mut self, tokens: usize) -> Result<()> {
        if self.len + tokens > self.capacity {
            candle_core::bail!(
                "the KV cache holds {} of {} tokens: no room for {tokens} more",
                self.len,
                self.capacity
            )
        }
        self.len += tokens;
        Ok(())
    }
}

impl KvStore for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn extended(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (batch, _, t, _) = k.dims4()?;
        if layer == 0 {
            let fits = self.buffers.first().is_some_and(|(b, _)| b.dim(0).ok() == Some(batch));
            if !fits && self.len > 0 {
                candle_core::bail!("the KV cache holds sequences of another batch")
            }
            if !fits || self.len + t > self.capacity {
                let capacity = if fits {
                    (2 * self.capacity).max(self.len + t)
                } else {
                    self.capacity.max(t)
                };
                self.allocate(batch, capacity, k.dtype(), k.device())?;
            }
            self.pending = t;
        }
        let (bk, bv) = &self.buffers[layer];
        bk.slice_set(&k.contiguous()?, 2, self.len)?;
        bv.slice_set(&v.contiguous()?, 2, self.len)?;
        Ok((bk.narrow(2, 0, self.len + t)?, bv.narrow(2, 0, self.len + t)?))
    }

    fn commit(&mut self) {
        self.len += self.pending;
        self.pending = 0;
    }

    fn abandon(&mut self) {
        // What the pass wrote lies past the length: the next pass writes over it.
        self.pending = 0;
    }

    fn reset(&mut self) {
        self.len = 0;
        self.pending = 0;
    }

    fn bytes(&self) -> usize {
        self.buffers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}

/// Keys and values in blocks of `block_size` tokens taken from a pool ([`KvPool`]) shared by the
/// batch's sequences, all of one length; a block table per sequence says which blocks hold its
/// tokens, in order. A pass writes its tokens into their slots in place and attention reads each
/// sequence's slots gathered.
#[derive(Debug)]
pub struct PagedKvCache {
    pool: KvPool,
    /// Per sequence: its blocks in order.
    tables: Vec<Vec<u32>>,
    len: usize,
    /// The pass being written, from its first layer until it commits or is abandoned.
    pending: Option<Pass>,
}

/// What a pass reserved at its first layer, for every layer.
#[derive(Debug)]
struct Pass {
    tokens: usize,
    /// Each sequence's blocks before the pass: those after go back if it is abandoned.
    held: Vec<usize>,
    /// The pool rows of the pass's keys and values, and those attention reads: every sequence's
    /// heads in turn, each head's positions in order ([`KvPool::rows`]).
    writes: Tensor,
    reads: Tensor,
}

impl PagedKvCache {
    /// A pool of `blocks` blocks of `block_size` tokens for `batch` sequences, zeroed, on `device`.
    pub fn new(
        shape: impl Into<KvShape>,
        batch: usize,
        blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<PagedKvCache> {
        Ok(PagedKvCache {
            pool: KvPool::new(shape, blocks, block_size, dtype, device)?,
            tables: vec![Vec::new(); batch],
            len: 0,
            pending: None,
        })
    }

    /// Blocks enough for `batch` sequences of `tokens` each.
    pub fn blocks_for(batch: usize, tokens: usize, block_size: usize) -> usize {
        batch * tokens.div_ceil(block_size.max(1))
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Blocks no sequence holds.
    pub fn blocks_free(&self) -> usize {
        self.pool.blocks_free()
    }

    /// Each sequence's blocks, in order.
    pub fn block_tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// Gives back the blocks each sequence took after its first `held`.
    fn give_back_after(&mut self, held: &[usize]) {
        for (table, &n) in self.tables.iter_mut().zip(held).rev() {
            let mut taken = table.split_off(n);
            self.pool.give_back(&mut taken);
        }
    }

    /// The blocks `tokens` more tokens of every sequence need, taken now, and the rows the pass's
    /// layers write and gather, on `device` (once per pass, at its first layer).
    fn reserve(&mut self, tokens: usize, device: &Device) -> Result<()> {
        let held: Vec<usize> = self.tables.iter().map(Vec::len).collect();
        let total = self.len + tokens;
        for s in 0..self.tables.len() {
            if self.pool.cover(&mut self.tables[s], total).is_err() {
                // Give back what this pass took before saying so.
                self.give_back_after(&held);
                candle_core::bail!(
                    "the KV cache's {} blocks of {} tokens are all held: {tokens} more tokens of each of {} sequences do not fit",
                    self.pool.blocks(),
                    self.pool.block_size(),
                    self.tables.len()
                )
            }
        }
        let rows = |range: std::ops::Range<usize>| -> Vec<u32> {
            self.tables
                .iter()
                .flat_map(|t| self.pool.rows(t, range.clone()))
                .collect()
        };
        let (writes, reads) = (rows(self.len..total), rows(0..total));
        let tensors = (|| {
            let (nw, nr) = (writes.len(), reads.len());
            Ok::<_, candle_core::Error>((
                Tensor::from_vec(writes, nw, device)?,
                Tensor::from_vec(reads, nr, device)?,
            ))
        })();
        match tensors {
            Ok((writes, reads)) => {
                self.pending = Some(Pass {
                    tokens,
                    held,
                    writes,
                    reads,
                });
                Ok(())
            }
            Err(e) => {
                self.give_back_after(&held);
                Err(e)
            }
        }
    }
}

impl KvStore for PagedKvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn extended(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, heads, t, d) = k.dims4()?;
        if b != self.tables.len() {
            candle_core::bail!("a pass of {b} sequences on a KV cache of {}", self.tables.len())
        }
        if self.pending.is_none() {
            self.reserve(t, k.device())?;
        }
        let pass = self.pending.as_ref().expect("reserved above");
        let (k, v) = self.pool.write_and_read(layer, &pass.writes, (k, v), &pass.reads)?;
        let total = self.len + t;
        Ok((k.reshape((b, heads, total, d))?, v.reshape((b, heads, total, d))?))
    }

    fn commit(&mut self) {
        if let Some(pass) = self.pending.take() {
            self.len += pass.tokens;
        }
    }

    fn abandon(&mut self) {
        if let Some(pass) = self.pending.take() {
            self.give_back_after(&pass.held);
        }
    }

    fn reset(&mut self) {
        self.pending = None;
        for table in self.tables.iter_mut() {
            self.pool.give_back(table);
        }
        self.len = 0;
    }

    fn bytes(&self) -> usize {
        self.tables.iter().map(Vec::len).sum::<usize>() * self.pool.block_bytes()
    }
}

/// The keys and values of a server's sequences, each at a length of its own: per layer a pool of
/// blocks [blocks, kv heads, block_size, head_dim] (each block's slots of one head side by side, as
/// the decode kernels read a contiguous cache), and the blocks no sequence holds. Sequences take and
/// give back blocks as they come and go; which blocks a sequence holds, in order, is its block table,
/// kept by its owner ([`SequenceCache`], `crate::serving::PagedModel`).
#[derive(Debug)]
pub struct KvPool {
    shape: KvShape,
    block_size: usize,
    layers: Vec<(Tensor, Tensor)>,
    free: Vec<u32>,
    dtype: DType,
}

impl KvPool {
    /// `blocks` blocks of `block_size` tokens, zeroed, at `dtype` on `device`.
    pub fn new(
        shape: impl Into<KvShape>,
        blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<KvPool> {
        let shape: KvShape = shape.into();
        if block_size == 0 || blocks == 0 {
            candle_core::bail!("a KV pool holds at least one block of at least one token, not {blocks} of {block_size}")
        }
        if blocks > u32::MAX as usize {
            candle_core::bail!("a KV pool of {blocks} blocks: block tables hold 32-bit indices")
        }
        let dims = (blocks, shape.kv_heads, block_size, shape.head_dim);
        let layers = (0..shape.layers)
            .map(|_| Ok((Tensor::zeros(dims, dtype, device)?, Tensor::zeros(dims, dtype, device)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvPool {
            shape,
            block_size,
            layers,
            free: (0..blocks as u32).rev().collect(),
            dtype,
        })
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks of the pool.
    pub fn blocks(&self) -> usize {
        self.layers.first().map_or(0, |(k, _)| k.dim(0).unwrap_or(0))
    }

    pub fn blocks_free(&self) -> usize {
        self.free.len()
    }

    /// Bytes a block holds: its tokens' keys and values, every layer.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.shape.token_bytes(self.dtype)
    }

    /// Bytes the pool holds, every block counted.
    pub fn bytes(&self) -> usize {
        self.blocks() * self.block_bytes()
    }

    /// Layer `layer`'s key and value pools, [blocks, kv heads, block_size, head_dim].
    pub fn layer(&self, layer: usize) -> Result<&(Tensor, Tensor)> {
        self.layers
            .get(layer)
            .ok_or_else(|| candle_core::Error::Msg(format!("the KV pool has no layer {layer}")))
    }

    /// Grows `table` to the blocks of `tokens` tokens, from the free ones; an error, and `table` as it
    /// was, where too few are free.
    pub fn cover(&mut self, table: &mut Vec<u32>, tokens: usize) -> Result<()> {
        let need = tokens.div_ceil(self.block_size).saturating_sub(table.len());
        if need > self.free.len() {
            candle_core::bail!(
                "the KV pool has {} of its {} blocks of {} tokens free: {tokens} tokens of a sequence holding {} need {need} more",
                self.free.len(),
                self.blocks(),
                self.block_size,
                table.len()
            )
        }
        table.extend(self.free.drain(self.free.len() - need..).rev());
        Ok(())
    }

    /// Takes back a sequence's blocks.
    pub fn give_back(&mut self, table: &mut Vec<u32>) {
        self.free.extend(table.drain(..).rev());
    }

    /// The row of the pool's [blocks × kv heads × block_size, head_dim] view that holds position `p`
    /// of head `h` of the sequence whose blocks are `table`.
    pub fn row(&self, table: &[u32], h: usize, p: usize) -> u32 {
        let (bs, heads) = (self.block_size, self.shape.kv_heads);
        ((table[p / bs] as usize * heads + h) * bs + p % bs) as u32
    }

    /// Layer `layer`'s keys `k` and values `v` (any shape of [rows, head_dim], in the order of
    /// `writes`) written into the pool rows `writes`, then the rows `reads` of both gathered:
    /// [reads, head_dim] each.
    fn write_and_read(
        &self,
        layer: usize,
        writes: &Tensor,
        (k, v): (&Tensor, &Tensor),
        reads: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let d = self.shape.head_dim;
        let (pool_k, pool_v) = self.layer(layer)?;
        let rows = pool_k.elem_count() / d;
        let (pool_k, pool_v) = (pool_k.reshape((rows, d))?, pool_v.reshape((rows, d))?);
        let n = k.elem_count() / d;
        write_rows(&pool_k, writes, &k.contiguous()?.reshape((n, d))?)?;
        write_rows(&pool_v, writes, &v.contiguous()?.reshape((n, d))?)?;
        Ok((pool_k.index_select(reads, 0)?, pool_v.index_select(reads, 0)?))
    }

    /// Rows of every head's positions `range` of a sequence, head by head: [heads × len(range)].
    fn rows(&self, table: &[u32], range: std::ops::Range<usize>) -> Vec<u32> {
        (0..self.shape.kv_heads)
            .flat_map(|h| range.clone().map(move |p| (h, p)))
            .map(|(h, p)| self.row(table, h, p))
            .collect()
    }
}

/// One sequence of a [`KvPool`], as a forward pass over that sequence alone reads and writes it: its
/// blocks (`table`, covering every token the pass adds) and the tokens it holds. A pass's keys and
/// values go into their slots of the pool, and attention reads the sequence's slots gathered.
pub struct SequenceCache<'a> {
    pool: &'a KvPool,
    table: &'a [u32],
    len: usize,
    /// The pass being written: its tokens, the pool rows they go to ([heads × tokens] u32) and the
    /// rows attention reads.
    pending: Option<(usize, Tensor, Tensor)>,
}

impl<'a> SequenceCache<'a> {
    /// The sequence holding `len` tokens in the blocks `table` of `pool`.
    pub fn new(pool: &'a KvPool, table: &'a [u32], len: usize) -> SequenceCache<'a> {
        SequenceCache {
            pool,
            table,
            len,
            pending: None,
        }
    }
}

impl KvStore for SequenceCache<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn extended(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, heads, t, d) = k.dims4()?;
        let shape = self.pool.shape;
        if b != 1 || heads != shape.kv_heads || d != shape.head_dim {
            candle_core::bail!("a pass of one sequence's {:?} keys on a pool of {shape:?}", k.dims())
        }
        let total = self.len + t;
        if total > self.table.len() * self.pool.block_size {
            candle_core::bail!(
                "a sequence of {} blocks of {} holds no {total} tokens: its blocks are taken before the pass",
                self.table.len(),
                self.pool.block_size
            )
        }
        if self.pending.is_none() {
            let device = k.device();
            let writes = Tensor::from_vec(self.pool.rows(self.table, self.len..total), heads * t, device)?;
            let reads = Tensor::from_vec(self.pool.rows(self.table, 0..total), heads * total, device)?;
            self.pending = Some((t, writes, reads));
        }
        let (_, writes, reads) = self.pending.as_ref().expect("made above");
        let (k, v) = self.pool.write_and_read(layer, writes, (k, v), reads)?;
        Ok((k.reshape((1, heads, total, d))?, v.reshape((1, heads, total, d))?))
    }

    fn commit(&mut self) {
        if let Some((t, ..)) = self.pending.take() {
            self.len += t;
        }
    }

    fn abandon(&mut self) {
        // What the pass wrote lies past the length: the next pass writes over it.
        self.pending = None;
    }

    fn bytes(&self) -> usize {
        self.table.len() * self.pool.block_bytes()
    }

    fn reset(&mut self) {
        self.pending = None;
        self.len = 0;
    }
}
