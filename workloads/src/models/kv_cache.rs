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

/// Keys and values in blocks of `block_size` tokens taken from a pool shared by the sequences; a
/// block table per sequence says which blocks hold its tokens, in order. A pass writes its tokens
/// into their slots in place and attention reads each sequence's blocks gathered into one tensor.
#[derive(Debug)]
pub struct PagedKvCache {
    block_size: usize,
    /// Per layer: keys and values of every slot, [blocks × block_size, kv heads, head_dim].
    pools: Vec<(Tensor, Tensor)>,
    /// Blocks no sequence holds, taken from the end.
    free: Vec<u32>,
    /// Per sequence: its blocks in order.
    tables: Vec<Vec<u32>>,
    len: usize,
    /// The pass being written, from its first layer until it commits or is abandoned.
    pending: Option<Pass>,
    token_bytes: usize,
}

/// What a pass reserved at its first layer, for every layer.
#[derive(Debug)]
struct Pass {
    tokens: usize,
    /// The blocks it took, by sequence (given back if it is abandoned).
    taken: Vec<(usize, u32)>,
    /// Every sequence's slots after the pass, in order: what attention gathers.
    slots: Tensor,
    /// A decode step's writes: the slot of each new token's every element, [batch, kv heads,
    /// head_dim], for one scatter per layer. `None` for a longer pass, whose tokens are copied a
    /// block's run at a time (candle's scatter spreads its work over a token's elements only, so a
    /// prompt of hundreds of tokens would be written by a few hundred threads).
    writes: Option<Tensor>,
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
        if block_size == 0 {
            candle_core::bail!("a KV block holds at least one token")
        }
        let kv: KvShape = shape.into();
        let slots = (blocks * block_size, kv.kv_heads, kv.head_dim);
        let pools = (0..kv.layers)
            .map(|_| {
                Ok((
                    Tensor::zeros(slots, dtype, device)?,
                    Tensor::zeros(slots, dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedKvCache {
            block_size,
            pools,
            free: (0..blocks as u32).rev().collect(),
            tables: vec![Vec::new(); batch],
            len: 0,
            pending: None,
            token_bytes: kv.token_bytes(dtype),
        })
    }

    /// Blocks enough for `batch` sequences of `tokens` each.
    pub fn blocks_for(batch: usize, tokens: usize, block_size: usize) -> usize {
        batch * tokens.div_ceil(block_size.max(1))
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks no sequence holds.
    pub fn blocks_free(&self) -> usize {
        self.free.len()
    }

    /// Each sequence's blocks, in order.
    pub fn block_tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// The blocks `tokens` more tokens of every sequence need, taken now, and the slots the pass's
    /// layers write and gather, on `device` (once per pass, at its first layer).
    fn reserve(&mut self, tokens: usize, device: &Device) -> Result<()> {
        let needed = (self.len + tokens).div_ceil(self.block_size);
        let mut taken: Vec<(usize, u32)> = Vec::new();
        for s in 0..self.tables.len() {
            while self.tables[s].len() < needed {
                let Some(block) = self.free.pop() else {
                    // Give back what this pass took before saying so.
                    for (s, block) in taken.into_iter().rev() {
                        self.tables[s].pop();
                        self.free.push(block);
                    }
                    let blocks = self.pools.first().map_or(0, |(k, _)| k.dim(0).unwrap_or(0)) / self.block_size;
                    candle_core::bail!(
                        "the KV cache's {blocks} blocks of {} tokens are all held: {tokens} more tokens of each of {} sequences do not fit",
                        self.block_size,
                        self.tables.len()
                    )
                };
                self.tables[s].push(block);
                taken.push((s, block));
            }
        }
        match self.slot_tensors(tokens, device) {
            Ok((slots, writes)) => {
                self.pending = Some(Pass {
                    tokens,
                    taken,
                    slots,
                    writes,
                });
                Ok(())
            }
            Err(e) => {
                for (s, block) in taken.into_iter().rev() {
                    self.tables[s].pop();
                    self.free.push(block);
                }
                Err(e)
            }
        }
    }

    /// Every sequence's slots once `tokens` more are held, and the slots of the new ones spread over
    /// each token's keys or values (what a scatter along the pool's first dimension takes).
    fn slot_tensors(&self, tokens: usize, device: &Device) -> Result<(Tensor, Option<Tensor>)> {
        let (b, total) = (self.tables.len(), self.len + tokens);
        let all = self.slots(total);
        let writes = if tokens == 1 {
            let new: Vec<u32> = all.chunks(total).map(|sequence| sequence[self.len]).collect();
            let (_, heads, d) = self.pools[0].0.dims3()?;
            Some(
                Tensor::from_vec(new, (b, 1, 1), device)?
                    .broadcast_as((b, heads, d))?
                    .contiguous()?,
            )
        } else {
            None
        };
        Ok((Tensor::from_vec(all, b * total, device)?, writes))
    }

    /// The pool slot of each position `0..tokens` of every sequence, in sequence order.
    fn slots(&self, tokens: usize) -> Vec<u32> {
        let bs = self.block_size as u32;
        self.tables
            .iter()
            .flat_map(|table| (0..tokens as u32).map(move |p| table[(p / bs) as usize] * bs + p % bs))
            .collect()
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
        let (pool_k, pool_v) = &self.pools[layer];
        let pass = self.pending.as_ref().expect("reserved above");
        // Every sequence's new tokens, [batch × tokens, kv heads, head_dim], into their slots.
        let (k_rows, v_rows) = (
            k.transpose(1, 2)?.contiguous()?.reshape((b * t, heads, d))?,
            v.transpose(1, 2)?.contiguous()?.reshape((b * t, heads, d))?,
        );
        match &pass.writes {
            Some(writes) => {
                pool_k.scatter_set(writes, &k_rows, 0)?;
                pool_v.scatter_set(writes, &v_rows, 0)?;
            }
            None => {
                // A run of consecutive positions stays in one block up to the block's end.
                let bs = self.block_size;
                for s in 0..b {
                    let mut p = 0;
                    while p < t {
                        let position = self.len + p;
                        let run = (bs - position % bs).min(t - p);
                        let slot = self.tables[s][position / bs] as usize * bs + position % bs;
                        pool_k.slice_set(&k_rows.narrow(0, s * t + p, run)?, 0, slot)?;
                        pool_v.slice_set(&v_rows.narrow(0, s * t + p, run)?, 0, slot)?;
                        p += run;
                    }
                }
            }
        }
        let total = self.len + t;
        let slots = &pass.slots;
        let gather = |pool: &Tensor| -> Result<Tensor> {
            pool.index_select(slots, 0)?
                .reshape((b, total, heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        Ok((gather(pool_k)?, gather(pool_v)?))
    }

    fn commit(&mut self) {
        if let Some(pass) = self.pending.take() {
            self.len += pass.tokens;
        }
    }

    fn abandon(&mut self) {
        if let Some(pass) = self.pending.take() {
            for (s, block) in pass.taken.into_iter().rev() {
                self.tables[s].pop();
                self.free.push(block);
            }
        }
    }

    fn reset(&mut self) {
        self.pending = None;
        let blocks = self.free.len() + self.tables.iter().map(Vec::len).sum::<usize>();
        self.free = (0..blocks as u32).rev().collect();
        self.tables.iter_mut().for_each(Vec::clear);
        self.len = 0;
    }

    fn bytes(&self) -> usize {
        self.tables.iter().map(Vec::len).sum::<usize>() * self.block_size * self.token_bytes
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

    /// Bytes the pool holds, every block counted.
    pub fn bytes(&self) -> usize {
        self.blocks() * self.block_size * self.shape.token_bytes(self.dtype)
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
        let (pool_k, pool_v) = self.pool.layer(layer)?;
        let rows = pool_k.elem_count() / d;
        let (pool_k, pool_v) = (pool_k.reshape((rows, d))?, pool_v.reshape((rows, d))?);
        write_rows(&pool_k, writes, &k.contiguous()?.reshape((heads * t, d))?)?;
        write_rows(&pool_v, writes, &v.contiguous()?.reshape((heads * t, d))?)?;
        let gather = |pool: &Tensor| pool.index_select(reads, 0)?.reshape((1, heads, total, d));
        Ok((gather(&pool_k)?, gather(&pool_v)?))
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
        self.table.len() * self.pool.block_size * self.pool.shape.token_bytes(self.pool.dtype)
    }

    fn reset(&mut self) {
        self.pending = None;
        self.len = 0;
    }
}
