//! Greedy generation with a language model: a batch of prompts prefilled at once, then one token
//! of every sequence decoded at a time against the KV cache. What the profiler's generate mode
//! drives; the timing is the profiler's, the tokens are the model's.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;

use crate::graphs::{GraphStats, StepGraphs};
use crate::init::Rng;
use crate::kernels::options::CudaGraphs;
use crate::kernels::KernelOptions;
use crate::models::decoder::{self, Decoder, KvCache, KvStore, PagedKvCache};
use crate::workload::WorkloadConfig;
use crate::zoo::{lookup_with, ModelInfo, FOLDER_PREFIX};

/// How the KV cache is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvLayout {
    /// One buffer per layer for keys and one for values, reserved for the generation, each pass's
    /// tokens written after those held.
    #[default]
    Contiguous,
    /// Blocks of `block_size` tokens from a pool, a block table per sequence (as vLLM keeps them).
    Paged { block_size: BlockSize },
}

/// The tokens one block of a paged KV cache holds: 1 to [`BlockSize::MAX`], vLLM's 16 unless given.
/// One type wherever a block size is given, carried or recorded (flags, sweep files, serving
/// settings, cells, rows), so that one out of its bounds cannot be made; written as its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "i64", into = "u64")]
pub struct BlockSize(u32);

impl BlockSize {
    /// vLLM's block size.
    pub const DEFAULT: BlockSize = BlockSize(16);
    /// The most tokens a block holds. A pool hands out whole blocks, so each sequence leaves up to
    /// a block of room unused; serving stacks use 16 to 256, and a block larger than this would
    /// only size a pool by its waste (and a block of billions of tokens, one allocation, by none).
    pub const MAX: usize = 4096;
    /// Why a block is at most [`Self::MAX`] tokens, for the messages that refuse one.
    pub const WHY: &'static str = "each sequence leaves up to a block unused; serving stacks use 16 to 256";

    /// A block of `tokens` tokens, or why there is none.
    pub fn new(tokens: i64) -> std::result::Result<BlockSize, String> {
        match u32::try_from(tokens) {
            Ok(n) if (1..=Self::MAX as u32).contains(&n) => Ok(BlockSize(n)),
            _ => Err(format!(
                "a KV block of {tokens} tokens: a block holds 1 to {} tokens ({})",
                Self::MAX,
                Self::WHY
            )),
        }
    }

    /// Its tokens.
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

impl TryFrom<i64> for BlockSize {
    type Error = String;
    fn try_from(tokens: i64) -> std::result::Result<BlockSize, String> {
        BlockSize::new(tokens)
    }
}

impl From<BlockSize> for u64 {
    fn from(b: BlockSize) -> u64 {
        b.0 as u64
    }
}

impl std::fmt::Display for BlockSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for BlockSize {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<BlockSize, String> {
        let tokens = s
            .trim()
            .parse::<i64>()
            .map_err(|_| format!("`{s}`: a KV block size is a number of tokens from 1 to {}", Self::MAX))?;
        BlockSize::new(tokens)
    }
}

impl KvLayout {
    pub const NAMES: [&'static str; 2] = ["contiguous", "paged"];

    /// As rows record it (`kv_layout`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvLayout::Contiguous => "contiguous",
            KvLayout::Paged { .. } => "paged",
        }
    }

    pub fn block_size(self) -> Option<BlockSize> {
        match self {
            KvLayout::Contiguous => None,
            KvLayout::Paged { block_size } => Some(block_size),
        }
    }

    /// The layouts `names` name (contiguous alone where there is none), paged ones in blocks of
    /// `block_size` (its default where none is given). A block size given where no layout is paged
    /// is refused, the settings named as the caller spells them: `keys` are the layouts' and the
    /// block size's (`--kv-layout` and `--kv-block-size`, or a sweep file's keys).
    pub fn from_names(
        names: &[&str],
        block_size: Option<BlockSize>,
        keys: [&str; 2],
    ) -> std::result::Result<Vec<KvLayout>, String> {
        let [layouts, block] = keys;
        if let Some(b) = block_size.filter(|_| !names.contains(&"paged")) {
            return Err(format!(
                "{block} {b} applies to a paged cache: {layouts} names only contiguous"
            ));
        }
        if names.is_empty() {
            return Ok(vec![KvLayout::default()]);
        }
        let block_size = block_size.unwrap_or(BlockSize::DEFAULT);
        names
            .iter()
            .map(|n| KvLayout::parse(n, block_size).map_err(|e| format!("{layouts}: {e}")))
            .collect()
    }

    /// The layout `name` names, paged with `block_size` tokens a block; the error names the valid
    /// ones.
    pub fn parse(name: &str, block_size: BlockSize) -> std::result::Result<KvLayout, String> {
        match name {
            "contiguous" => Ok(KvLayout::Contiguous),
            "paged" => Ok(KvLayout::Paged { block_size }),
            other => Err(format!(
                "KV cache layout `{other}`; valid layouts: {}",
                KvLayout::NAMES.join(", ")
            )),
        }
    }
}

/// A generation's default prompt and output lengths (`--prompt-len`, `--output-len`): short enough
/// for the tiny presets' 256 positions.
pub const DEFAULT_PROMPT_LEN: usize = 128;
pub const DEFAULT_OUTPUT_LEN: usize = 128;

/// The lengths of one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lengths {
    /// Tokens of each prompt.
    pub prompt: usize,
    /// Tokens generated for each prompt, the first by the prefill and each other by a decode step.
    pub output: usize,
}

impl Lengths {
    /// Decode steps of one generation: every output token but the prefill's.
    pub fn decode_steps(self) -> usize {
        self.output.saturating_sub(1)
    }

    /// Positions a sequence takes: the prompt and every generated token fed back (the last is not);
    /// saturating, so that lengths near the integers' end are refused by [`Lengths::check`] rather
    /// than wrapped past it.
    pub fn context(self) -> usize {
        self.prompt.saturating_add(self.decode_steps())
    }

    /// Whether these lengths fit a model of `max_positions` and make at least one decode step; the
    /// message says what does.
    pub fn check(self, model: &str, max_positions: usize) -> std::result::Result<(), String> {
        if self.prompt == 0 {
            return Err("--prompt-len: a prompt holds at least one token".into());
        }
        if self.output < 2 {
            return Err(
                "--output-len: at least 2 (the first token comes from the prefill, the others from decode steps)"
                    .into(),
            );
        }
        if self.context() > max_positions {
            return Err(format!(
                "{model} has {max_positions} positions: --prompt-len {} + --output-len {} needs {} (the last generated token is not fed back); at most {} output tokens after this prompt",
                self.prompt,
                self.output,
                self.context(),
                (max_positions + 1).saturating_sub(self.prompt)
            ));
        }
        Ok(())
    }
}

/// A language model ready to generate on a device, with its cache.
pub struct Generator {
    info: ModelInfo,
    decoder: Decoder,
    layout: KvLayout,
    cache: Cache,
    /// A paged cache's pool: the sequences and blocks it was made for.
    pool: Option<(usize, usize)>,
    /// A contiguous cache's decode steps, replayed as CUDA graphs (one per batch size), over the
    /// buffers the prefill reserved (a generation never grows them).
    graphs: StepGraphs,
    device: Device,
    dtype: DType,
    kernels: KernelOptions,
}

/// The cache of a generation, in its layout.
enum Cache {
    Contiguous(KvCache),
    Paged(PagedKvCache),
}

impl Cache {
    fn store(&mut self) -> &mut dyn KvStore {
        match self {
            Cache::Contiguous(c) => c,
            Cache::Paged(p) => p,
        }
    }

    fn held(&self) -> &dyn KvStore {
        match self {
            Cache::Contiguous(c) => c,
            Cache::Paged(p) => p,
        }
    }
}

impl Generator {
    /// The named model (a preset, or `hf:DIR`) on `cfg`'s device and dtype: a folder's own weights,
    /// the `cfg.weights` file with Hugging Face's names, or seeded random weights.
    pub fn build(name: &str, cfg: &WorkloadConfig, layout: KvLayout) -> Result<Generator> {
        let (info, decoder) = load(name, cfg)?;
        let config = decoder.config().clone();
        Ok(Generator {
            cache: Cache::Contiguous(KvCache::new(&config)),
            pool: None,
            graphs: StepGraphs::default(),
            layout,
            info,
            decoder,
            device: cfg.device.clone(),
            dtype: cfg.dtype,
            kernels: cfg.kernels,
        })
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `batch` prompts of `len` token ids drawn uniformly below the vocabulary from `seed`, on the
    /// device.
    pub fn prompts(&self, batch: usize, len: usize, seed: u64) -> Result<Tensor> {
        let vocab = self.decoder.config().vocab_size as u32;
        let mut rng = Rng::for_name(seed, "prompts");
        let ids: Vec<u32> = (0..batch * len).map(|_| rng.below(vocab)).collect();
        Tensor::from_vec(ids, (batch, len), &self.device)
    }

    /// Starts a generation: a cache with room for `room` tokens of each sequence (reserved: a
    /// contiguous cache's buffers, a paged cache's pool), then `prompts` [batch, tokens] run through
    /// the model; the first generated token of each sequence, [batch, 1] (u32, possibly still
    /// queued).
    pub fn prefill(&mut self, prompts: &Tensor, room: usize) -> Result<Tensor> {
        let _kernels = self.kernels.enter();
        let config = self.decoder.config();
        let (batch, tokens) = prompts.dims2()?;
        match self.layout {
            KvLayout::Contiguous => {
                if let Cache::Paged(_) = self.cache {
                    self.cache = Cache::Contiguous(KvCache::new(config));
                }
                let Cache::Contiguous(cache) = &mut self.cache else {
                    unreachable!("set above")
                };
                let room = room.max(tokens);
                if room > config.max_position_embeddings {
                    candle_core::bail!(
                        "room for {room} tokens of each sequence: the model has {} positions",
                        config.max_position_embeddings
                    )
                }
                // A graph holds the addresses of the buffers it was captured over: it goes before
                // new buffers are made (its memory with it), and with it what the graphs counted.
                if cache.reserves_anew(batch, room, self.dtype, &self.device) {
                    self.graphs = StepGraphs::default();
                }
                cache.reserve(batch, room, self.dtype, &self.device)?;
            }
            KvLayout::Paged { block_size } => {
                let block_size = block_size.get();
                let blocks = PagedKvCache::blocks_for(batch, room.max(tokens), block_size);
                if self.pool == Some((batch, blocks)) {
                    // The same pool serves each generation of the run, as a server's does.
                    self.cache.store().reset();
                } else {
                    // The old pool (or buffers) go before the new pool is made: never two at once.
                    self.cache = Cache::Contiguous(KvCache::new(config));
                    self.pool = None;
                    self.cache = Cache::Paged(PagedKvCache::new(
                        config,
                        batch,
                        blocks,
                        block_size,
                        self.dtype,
                        &self.device,
                    )?);
                    self.pool = Some((batch, blocks));
                }
            }
        }
        greedy(&self.decoder.forward_last(prompts, self.cache.store())?)
    }

    /// One decode step: `tokens` [batch, 1] (the last ones generated) run at the cache's length; the
    /// next token of each sequence, [batch, 1]. With a contiguous cache, a step of fixed shapes
    /// ([`Decoder::decode_step`]), replayed as a CUDA graph where the kernel options ask for graphs
    /// in inference on a CUDA device.
    pub fn decode(&mut self, tokens: &Tensor) -> Result<Tensor> {
        let _kernels = self.kernels.enter();
        let replays = self.replays_graphs();
        let Cache::Contiguous(cache) = &mut self.cache else {
            return greedy(&self.decoder.forward(tokens, self.cache.store())?);
        };
        // The step writes the slot at its position: one past the buffers would be out of bounds.
        if cache.len() >= cache.capacity() {
            candle_core::bail!(
                "the KV cache has room for {} tokens of each sequence and holds them all: a generation decodes at most its room less the prompt",
                cache.capacity()
            )
        }
        let pos = Tensor::new(&[cache.len() as u32], &self.device)?;
        let decoder = &self.decoder;
        let held: &KvCache = cache;
        let logits = if replays {
            self.graphs.run(&self.device, vec![tokens.clone(), pos], |t| {
                decoder.decode_step(&t[0], &t[1], held)
            })?
        } else {
            decoder.decode_step(tokens, &pos, held)?
        };
        cache.advance(1)?;
        greedy(&logits)
    }

    fn replays_graphs(&self) -> bool {
        !matches!(self.kernels.graphs, CudaGraphs::Off) && self.device.is_cuda()
    }

    /// The decode-step graphs captured, their replays, and the batch sizes whose capture was
    /// refused (their steps ran op by op).
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    /// Why captures were refused, one line per distinct reason.
    pub fn graph_refusals(&self) -> Vec<String> {
        self.graphs.refusals()
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Bytes the KV cache holds now, every sequence of the batch (a contiguous cache's buffers, a
    /// paged cache's blocks taken).
    pub fn cache_bytes(&self) -> usize {
        self.cache.held().bytes()
    }

    /// Tokens each sequence's cache holds now.
    pub fn cache_len(&self) -> usize {
        self.cache.held().len()
    }
}

/// The named language model (a preset, or `hf:DIR`) on `cfg`'s device and dtype: a folder's own
/// weights, the `cfg.weights` file with Hugging Face's names, or seeded random weights.
pub(crate) fn load(name: &str, cfg: &WorkloadConfig) -> Result<(ModelInfo, Decoder)> {
    let (_, info) = lookup_with(name, None).map_err(candle_core::Error::wrap)?;
    let Some(config) = info.decoder.clone() else {
        candle_core::bail!("{name} is not a language model: only language models generate")
    };
    let decoder = match (name.strip_prefix(FOLDER_PREFIX), &cfg.weights) {
        (Some(_), Some(w)) => candle_core::bail!(
            "{name} carries its own weights; --weights ({}) applies to the presets",
            w.display()
        ),
        (Some(dir), None) => decoder::load_folder(std::path::Path::new(dir), &cfg.device, cfg.dtype)?,
        (None, Some(path)) => {
            // SAFETY: mapped read-only for the model's lifetime; migprof does not write the file.
            let vb = unsafe { VarBuilder::from_mmaped_safetensors(std::slice::from_ref(path), cfg.dtype, &cfg.device) }
                .map_err(|e| {
                    candle_core::Error::Msg(format!("cannot read the weights file {}: {e}", path.display()))
                })?;
            Decoder::new(&config, vb)
                .map_err(|e| candle_core::Error::Msg(format!("{} does not fit {name}: {e}", path.display())))?
        }
        (None, None) => {
            let weights = decoder::random_weights(&config, cfg.seed, &cfg.device, cfg.dtype)?;
            Decoder::from_tensors(&config, weights, &cfg.device, cfg.dtype)?
        }
    };
    Ok((info, decoder))
}

/// The most likely next token of each sequence from `logits` [batch, tokens, vocab]: the last
/// position's argmax, [batch, 1].
pub fn greedy(logits: &Tensor) -> Result<Tensor> {
    let (b, t, _) = logits.dims3()?;
    let last = logits.narrow(1, t - 1, 1)?;
    if logits.device().is_cuda() {
        return crate::kernels::decode::argmax(&last.squeeze(1)?)?.reshape((b, 1));
    }
    last.argmax_keepdim(D::Minus1)?.squeeze(D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_size_is_one_to_its_bound_as_given_anywhere() {
        assert_eq!(BlockSize::new(16), Ok(BlockSize::DEFAULT));
        assert_eq!(
            BlockSize::new(BlockSize::MAX as i64).map(BlockSize::get),
            Ok(BlockSize::MAX)
        );
        for refused in [0, -1, BlockSize::MAX as i64 + 1, i64::MAX] {
            let e = BlockSize::new(refused).unwrap_err();
            assert!(
                e.contains(&format!("a KV block of {refused} tokens"))
                    && e.contains("1 to 4096")
                    && e.contains(BlockSize::WHY),
                "{e}"
            );
        }
        assert_eq!("32".parse::<BlockSize>().map(BlockSize::get), Ok(32));
        let e = "x".parse::<BlockSize>().unwrap_err();
        assert!(
            e.contains("`x`") && e.contains("number of tokens from 1 to 4096"),
            "{e}"
        );
        // Written and read as its number; a number out of bounds is refused in the same words.
        assert_eq!(serde_json::to_string(&BlockSize::DEFAULT).unwrap(), "16");
        assert_eq!(serde_json::from_str::<BlockSize>("64").unwrap().get(), 64);
        let e = serde_json::from_str::<BlockSize>("0").unwrap_err().to_string();
        assert!(e.contains("a KV block of 0 tokens"), "{e}");
        // A list of layouts with one block size, checked as run's flags and a sweep's keys are.
        let keys = ["kv_layouts", "kv_block_size"];
        let b32 = BlockSize::new(32).ok();
        assert_eq!(KvLayout::from_names(&[], None, keys), Ok(vec![KvLayout::Contiguous]));
        assert_eq!(
            KvLayout::from_names(&["contiguous", "paged"], b32, keys),
            Ok(vec![
                KvLayout::Contiguous,
                KvLayout::Paged {
                    block_size: b32.unwrap()
                }
            ])
        );
        assert_eq!(
            KvLayout::from_names(&["paged"], None, keys),
            Ok(vec![KvLayout::Paged {
                block_size: BlockSize::DEFAULT
            }])
        );
        assert_eq!(
            KvLayout::from_names(&["contiguous"], b32, keys),
            Err("kv_block_size 32 applies to a paged cache: kv_layouts names only contiguous".into())
        );
        let e = KvLayout::from_names(&["ring"], None, keys).unwrap_err();
        assert!(e.starts_with("kv_layouts: KV cache layout `ring`"), "{e}");
        assert!(KvLayout::parse("paged", BlockSize::DEFAULT).is_ok());
        assert!(KvLayout::parse("pages", BlockSize::DEFAULT)
            .unwrap_err()
            .contains("contiguous, paged"));
    }

    #[test]
    fn lengths_that_do_not_fit_say_what_does() {
        let l = Lengths {
            prompt: 200,
            output: 60,
        };
        assert_eq!(l.decode_steps(), 59);
        assert_eq!(l.context(), 259);
        let e = l.check("llama_tiny", 256).unwrap_err();
        assert!(e.contains("needs 259") && e.contains("at most 57 output tokens"), "{e}");
        Lengths {
            prompt: 200,
            output: 57,
        }
        .check("llama_tiny", 256)
        .unwrap();
        assert!(Lengths { prompt: 8, output: 1 }
            .check("m", 256)
            .unwrap_err()
            .contains("at least 2"));
        assert!(Lengths { prompt: 0, output: 4 }.check("m", 256).is_err());
    }
}
