//! A language model serving sequences that come and go, as a server's continuous batcher hands it
//! work: each call runs one iteration (pieces of prompts being prefilled, and one token of every
//! sequence that is decoding), each sequence at a length of its own, their keys and values in blocks
//! of one pool ([`KvPool`]) that sequences take as they grow and give back when they finish or are
//! preempted. Which sequences run, and when, is the caller's: this module only computes.
//!
//! A sequence's prompt is synthetic: token ids drawn from the sequence's id and the seed, so that the
//! same request gets the same prompt at every rate and after a preemption. Generation is greedy.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};

use crate::init::Rng;
use crate::kernels::KernelOptions;
use crate::models::decoder::{Decoder, KvPool, SequenceCache};
use crate::{ModelInfo, WorkloadConfig};

/// A piece of sequence `id`'s prefill: its tokens `start..start + len` (of its prompt, or after a
/// preemption of its prompt and the tokens it had generated). `last`: the piece ends the prefill,
/// and the sequence's next token comes out of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefill {
    pub id: usize,
    pub start: usize,
    pub len: usize,
    pub last: bool,
}

/// A sequence the model holds.
#[derive(Debug, Default)]
struct Sequence {
    /// Its prompt's tokens so far and every token generated.
    tokens: Vec<u32>,
    /// Its blocks in the pool, in order.
    table: Vec<u32>,
    /// Tokens whose keys and values are in its blocks.
    cached: usize,
}

/// A decoder and the pool of blocks its sequences' caches live in.
pub struct PagedModel {
    info: ModelInfo,
    decoder: Decoder,
    pool: KvPool,
    sequences: HashMap<usize, Sequence>,
    device: Device,
    seed: u64,
    kernels: KernelOptions,
}

impl PagedModel {
    /// The named language model (as [`crate::Generator::build`] loads it) with a pool of `blocks`
    /// blocks of `block_size` tokens.
    pub fn build(name: &str, cfg: &WorkloadConfig, blocks: usize, block_size: usize) -> Result<PagedModel> {
        let (info, decoder) = crate::generation::load(name, cfg)?;
        PagedModel::new(info, decoder, blocks, block_size, cfg)
    }

    /// `decoder` with a pool of `blocks` blocks of `block_size` tokens on `cfg`'s device.
    pub fn new(
        info: ModelInfo,
        decoder: Decoder,
        blocks: usize,
        block_size: usize,
        cfg: &WorkloadConfig,
    ) -> Result<PagedModel> {
        let pool = KvPool::new(decoder.config(), blocks, block_size, cfg.dtype, &cfg.device)?;
        Ok(PagedModel {
            info,
            decoder,
            pool,
            sequences: HashMap::new(),
            device: cfg.device.clone(),
            seed: cfg.seed,
            kernels: cfg.kernels,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// Bytes a block of the pool holds (every layer's keys and values).
    pub fn block_bytes(&self) -> usize {
        self.pool.block_bytes()
    }

    /// Bytes of the weights (parameters at the model's dtype).
    pub fn weight_bytes(&self) -> u64 {
        self.decoder.config().params() * self.dtype().size_in_bytes() as u64
    }

    /// The most tokens a sequence may hold: the model's positions.
    pub fn max_positions(&self) -> usize {
        self.decoder.config().max_position_embeddings
    }

    pub fn dtype(&self) -> DType {
        self.decoder.dtype()
    }

    /// Sequence `id`'s tokens: its prompt (as far as prefilled) and those generated.
    pub fn tokens(&self, id: usize) -> Option<&[u32]> {
        self.sequences.get(&id).map(|s| s.tokens.as_slice())
    }

    /// Sequences held.
    pub fn sequences(&self) -> usize {
        self.sequences.len()
    }

    /// The prompt token at `position` of sequence `id`.
    fn prompt_token(&self, id: usize, position: usize) -> u32 {
        let vocab = self.decoder.config().vocab_size as u32;
        Rng::new(self.seed ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((position as u64) << 32)).below(vocab)
    }

    /// Runs one iteration: every prefill piece, then one decode step of the `decodes` sequences
    /// together. The tokens that came out, (id, token): one for each piece that ends a prefill and
    /// one for each decode, in that order. A piece that starts a sequence the model does not hold
    /// begins it; every other piece and decode must continue where the sequence stands.
    pub fn run(&mut self, prefills: &[Prefill], decodes: &[usize]) -> Result<Vec<(usize, u32)>> {
        let _kernels = self.kernels.enter();
        // Checked before anything runs, so that a plan the model cannot follow changes nothing. (A
        // failure while the model runs, out of memory say, ends the job: the sequences it ran
        // may then be part-way.)
        for p in prefills {
            let cached = self.sequences.get(&p.id).map_or(0, |s| s.cached);
            if p.start != cached || p.len == 0 {
                candle_core::bail!(
                    "sequence {}: a prefill of tokens {}..{} where it holds {cached}",
                    p.id,
                    p.start,
                    p.start + p.len
                )
            }
        }
        for id in decodes {
            match self.sequences.get(id) {
                Some(s) if s.cached > 0 && s.tokens.len() == s.cached + 1 => {}
                _ => candle_core::bail!("sequence {id} decodes without a finished prefill"),
            }
            if prefills.iter().any(|p| p.id == *id) {
                candle_core::bail!("sequence {id} both prefills and decodes in one iteration")
            }
        }
        // The decodes' blocks first: a pool too full for them fails before any prefill has run.
        for id in decodes {
            let seq = self.sequences.get_mut(id).expect("checked above");
            self.pool.cover(&mut seq.table, seq.cached + 1)?;
        }
        let mut firsts = Vec::new();
        for p in prefills {
            if let Some(logits) = self.prefill(p)? {
                firsts.push((p.id, logits));
            }
        }
        let mut out = Vec::with_capacity(firsts.len() + decodes.len());
        if !firsts.is_empty() {
            let logits = Tensor::cat(&firsts.iter().map(|(_, l)| l.clone()).collect::<Vec<_>>(), 0)?;
            let next = crate::generation::greedy(&logits)?.flatten_all()?.to_vec1::<u32>()?;
            out.extend(firsts.iter().map(|(id, _)| *id).zip(next));
        }
        if !decodes.is_empty() {
            let next = self.decode(decodes)?;
            out.extend(decodes.iter().copied().zip(next));
        }
        for &(id, token) in &out {
            self.sequences.get_mut(&id).expect("ran above").tokens.push(token);
        }
        Ok(out)
    }

    /// One prefill piece through the model over its sequence's blocks: the last token's logits
    /// [1, 1, vocab] where the piece ends the prefill.
    fn prefill(&mut self, p: &Prefill) -> Result<Option<Tensor>> {
        let mut seq = self.sequences.remove(&p.id).unwrap_or_default();
        let end = p.start + p.len;
        // The piece's tokens: those the sequence has (all of them after a preemption), then its
        // prompt's next ones.
        let ids: Vec<u32> = (p.start..end)
            .map(|i| seq.tokens.get(i).copied().unwrap_or_else(|| self.prompt_token(p.id, i)))
            .collect();
        let blocks = seq.table.len();
        let ran = (|| {
            self.pool.cover(&mut seq.table, end)?;
            let ids = Tensor::from_vec(ids.clone(), (1, p.len), &self.device)?;
            let mut cache = SequenceCache::new(&self.pool, &seq.table, p.start);
            self.decoder.forward_last(&ids, &mut cache)
        })();
        let logits = match ran {
            Ok(logits) => logits,
            Err(e) => {
                // The blocks this piece took go back: the sequence is as it was.
                let mut taken = seq.table.split_off(blocks);
                self.pool.give_back(&mut taken);
                if !seq.table.is_empty() || !seq.tokens.is_empty() {
                    self.sequences.insert(p.id, seq);
                }
                return Err(e);
            }
        };
        if seq.tokens.len() < end {
            seq.tokens.extend_from_slice(&ids[seq.tokens.len() - p.start..]);
        }
        seq.cached = end;
        self.sequences.insert(p.id, seq);
        Ok(p.last.then_some(logits))
    }

    /// One decode step of `ids` together, each at its own position: their next tokens.
    fn decode(&mut self, ids: &[usize]) -> Result<Vec<u32>> {
        let seqs: Vec<&Sequence> = ids.iter().map(|id| &self.sequences[id]).collect();
        let positions: Vec<u32> = seqs.iter().map(|s| s.cached as u32).collect();
        let tables: Vec<&[u32]> = seqs.iter().map(|s| s.table.as_slice()).collect();
        let last: Vec<u32> = seqs.iter().map(|s| *s.tokens.last().expect("prefilled")).collect();
        let step = self.decoder.paged_step(&positions, &tables, &self.pool, &self.device)?;
        let tokens = Tensor::from_vec(last, (ids.len(), 1), &self.device)?;
        let logits = self.decoder.decode_paged(&tokens, &step, &self.pool)?;
        let next = crate::generation::greedy(&logits)?.flatten_all()?.to_vec1::<u32>()?;
        for id in ids {
            self.sequences.get_mut(id).expect("checked in run").cached += 1;
        }
        Ok(next)
    }

    /// Sequence `id` was preempted: its blocks go back to the pool and its cache is empty; its tokens
    /// are kept, to be prefilled again (recompute).
    pub fn preempt(&mut self, id: usize) {
        if let Some(seq) = self.sequences.get_mut(&id) {
            self.pool.give_back(&mut seq.table);
            seq.cached = 0;
        }
    }

    /// Sequence `id` is done: its blocks go back and the model forgets it.
    pub fn finish(&mut self, id: usize) {
        if let Some(mut seq) = self.sequences.remove(&id) {
            self.pool.give_back(&mut seq.table);
        }
    }

    /// Forgets every sequence, their blocks back in the pool.
    pub fn clear(&mut self) {
        let ids: Vec<usize> = self.sequences.keys().copied().collect();
        for id in ids {
            self.finish(id);
        }
    }

    /// A pool of `blocks` blocks of the same size instead of the one held (which goes first: never
    /// two at once); every sequence is forgotten. Where the new pool cannot be made, the model holds
    /// a pool of one block until a later call makes one.
    pub fn resize_pool(&mut self, blocks: usize) -> Result<()> {
        self.sequences.clear();
        let (shape, block_size) = (self.pool.shape(), self.pool.block_size());
        let dtype = self.dtype();
        self.pool = KvPool::new(shape, 1, block_size, dtype, &self.device)?;
        self.pool = KvPool::new(shape, blocks, block_size, dtype, &self.device)?;
        Ok(())
    }
}
