//! Decoder-only language models with the architecture and parameter names of Hugging Face's
//! `LlamaForCausalLM` and `Qwen2ForCausalLM`: token embeddings, layers of RMSNorm, grouped-query
//! attention with rotary position embeddings (Llama 3's frequency scaling or none) and a SwiGLU MLP,
//! a final RMSNorm and the output head (tied to the embeddings or its own). Qwen2 differs only in
//! the biases of its q, k and v projections.
//!
//! A model is described by its `config.json` ([`config`]), so a user's own checkpoint of a supported
//! architecture needs no preset; the presets' files are kept in `workloads/configs/`. Its weights
//! come from a folder, a map of tensors or a seed ([`weights`]). The forward pass (this file) takes a
//! [`KvStore`] (contiguous or paged): a prompt is prefilled at position 0, and each decoded token
//! runs at the cache's length, attending to everything before it.

pub mod config;
pub mod weights;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};

use crate::kernels::{self, causal_attention, decode, prefill};

pub use super::kv_cache::{KvCache, KvPool, KvShape, KvStore, PagedKvCache, SequenceCache};
pub use config::{preset, Architecture, Config, ConfigError, Llama3Scaling, ARCHITECTURES, PRESETS};
use weights::{part, stacked, Owned, TensorSource};
pub use weights::{random_weights, read_folder, FolderError};

/// The model of a Hugging Face folder ([`read_folder`]) on `device`, its weights at `dtype`.
pub fn load_folder(dir: &std::path::Path, device: &Device, dtype: DType) -> Result<Decoder> {
    let (cfg, files) = read_folder(dir).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    // SAFETY: the files are mapped read-only for the model's lifetime; migprof does not write them.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
    Decoder::new(&cfg, vb)
}

struct Attention {
    /// q_proj's, k_proj's and v_proj's weights stacked, [(heads + 2·kv heads)·head_dim, hidden], and
    /// their biases (Qwen2): a pass over many tokens makes all three with one product.
    qkv: Tensor,
    qkv_bias: Option<Tensor>,
    /// Views of `qkv`, for the decode step's kernel and for candle's ops.
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &Config, src: &mut dyn TensorSource, prefix: &str) -> Result<Attention> {
        let (h, q, kv) = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let (qkv, qkv_bias) = stacked(
            src,
            &format!("{prefix}.self_attn"),
            &[("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            h,
            cfg.qkv_bias,
        )?;
        let o = src.take(&format!("{prefix}.self_attn.o_proj.weight"), &[h, q])?;
        Ok(Attention {
            q_proj: part(&qkv, qkv_bias.as_ref(), 0, q)?,
            k_proj: part(&qkv, qkv_bias.as_ref(), q, kv)?,
            v_proj: part(&qkv, qkv_bias.as_ref(), q + kv, kv)?,
            qkv,
            qkv_bias,
            o_proj: Linear::new(o, None),
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        })
    }

    /// `x` [batch, tokens, hidden] at positions `offset..`, with `cos`/`sin` of those positions:
    /// the output; the layer's keys and values, with this pass's, written to `cache`. `mask` is
    /// the causal mask (none for one token). Candle's ops: the path of the CPU, and of any pass the
    /// causal kernel does not take ([`Attention::prefill`]).
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut dyn KvStore,
        layer: usize,
    ) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let heads = |y: Tensor, n: usize| y.reshape((b, t, n, self.head_dim))?.transpose(1, 2)?.contiguous();
        let q = heads(self.q_proj.forward(x)?, self.num_heads)?;
        let k = heads(self.k_proj.forward(x)?, self.num_kv_heads)?;
        let v = heads(self.v_proj.forward(x)?, self.num_kv_heads)?;
        let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
        let (k, v) = cache.extended(layer, &k, &v)?;
        // Grouped-query attention: each key-value head serves `group` query heads.
        let group = self.num_heads / self.num_kv_heads;
        let (kr, vr) = (repeat_kv(&k, group)?, repeat_kv(&v, group)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let mut scores = (q.matmul(&kr.t()?)? * scale)?;
        if let Some(m) = mask {
            scores = scores.broadcast_add(m)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
        let y = probs
            .matmul(&vr)?
            .transpose(1, 2)?
            .reshape((b, t, self.num_heads * self.head_dim))?;
        self.o_proj.forward(&y)
    }
}

impl Attention {
    /// A prompt's tokens after the cache's through the causal kernel (`kernels::causal_attention`),
    /// for the residual stream `x` [batch, tokens, hidden] and its norm `normed`: `x` plus the
    /// attention's output. One product makes the rows of q, k and v side by side, as the kernel
    /// reads them; one pass turns q and k by the rotary embedding where they lie (`tables`: every
    /// position's cos and sin); the keys and values are moved head-major for the cache; o_proj's
    /// product adds the residual itself. A prompt continued after its cached part (a chunked
    /// prefill's later piece) puts that part's keys and values in rows before the piece's, whose
    /// queries alone the kernel answers.
    fn prefill(
        &self,
        x: &Tensor,
        normed: &Tensor,
        tables: (&Tensor, &Tensor),
        cache: &mut dyn KvStore,
        layer: usize,
    ) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let (d, hq, hkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let rows = normed.reshape((b * t, h))?;
        let packed = match &self.qkv_bias {
            Some(bias) => kernels::linear(&rows, &self.qkv, Some(bias), kernels::Act::None)?,
            None => kernels::product(&rows, &self.qkv, None)?,
        };
        let heads = decode::Heads { q: hq, kv: hkv, dim: d };
        let offset = cache.len();
        let packed = prefill::rope_packed(&packed, t, offset, heads, tables)?.reshape((b, t, (hq + 2 * hkv) * d))?;
        let head_major = |start: usize| {
            packed
                .narrow(2, start * d, hkv * d)?
                .reshape((b, t, hkv, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (keys, values) = cache.extended(layer, &head_major(hq)?, &head_major(hq + hkv)?)?;
        let y = match offset {
            0 => causal_attention::causal_attention(&packed, hq, hkv)?,
            _ => {
                // The cached keys and values, rotated when they were written, token-major; the
                // rows' queries are not read (zeros).
                let held = |kv: &Tensor| kv.narrow(2, 0, offset)?.transpose(1, 2)?.reshape((b, offset, hkv * d));
                let queries = Tensor::zeros((b, offset, hq * d), packed.dtype(), packed.device())?;
                let before = Tensor::cat(&[&queries, &held(&keys)?, &held(&values)?], 2)?;
                causal_attention::causal_attention_from(&Tensor::cat(&[&before, &packed], 1)?, hq, hkv, offset)?
            }
        };
        kernels::product(
            &y.reshape((b * t, hq * d))?,
            self.o_proj.weight(),
            Some(&x.reshape((b * t, h))?),
        )?
        .reshape((b, t, h))
    }

    /// One decode step's attention for the residual stream `x` [batch, 1, hidden] and its norm
    /// `normed`: `x` plus the attention's output. The new token's key and value go into slot `pos`
    /// of the layer's buffers; attention then reads every slot, those after `pos` left out.
    /// Each key-value head serves its `group` query heads in one product, with no copies of it.
    fn decode_step(
        &self,
        x: &Tensor,
        norm: &RmsNorm,
        step: &StepInputs,
        (keys, values): &(Tensor, Tensor),
    ) -> Result<Tensor> {
        let (b, _, _) = x.dims3()?;
        let d = self.head_dim;
        let q = match &step.composed {
            None => decode::qkv_rope(
                x,
                Some(norm.into()),
                [self.q_proj.weight(), self.k_proj.weight(), self.v_proj.weight()],
                [self.q_proj.bias(), self.k_proj.bias(), self.v_proj.bias()],
                step.tables,
                decode::Slots::Shared(step.pos),
                (keys, values),
                decode::Heads {
                    q: self.num_heads,
                    kv: self.num_kv_heads,
                    dim: d,
                },
            )?,
            Some(c) => {
                let normed = norm.forward(x)?;
                let normed = &normed;
                // With one token, [batch, 1, heads × d] is [batch, heads, 1, d] as it lies.
                let q = self.q_proj.forward(normed)?.reshape((b, self.num_heads, 1, d))?;
                let k = self.k_proj.forward(normed)?.reshape((b, self.num_kv_heads, 1, d))?;
                let v = self.v_proj.forward(normed)?.reshape((b, self.num_kv_heads, 1, d))?;
                let q = candle_nn::rotary_emb::rope(&q, &c.cos, &c.sin)?;
                let k = candle_nn::rotary_emb::rope(&k, &c.cos, &c.sin)?;
                keys.scatter_set(&c.at, &k, 2)?;
                values.scatter_set(&c.at, &v.contiguous()?, 2)?;
                q
            }
        };
        let y = match &step.mask {
            None => decode::attention(&q, keys, values, decode::Slots::Shared(step.pos))?,
            Some(mask) => self.one_token_attention(&q, keys, values, mask)?,
        };
        match step.composed {
            None => decode::gemv(&y, None, self.o_proj.weight(), Some(x)),
            Some(_) => x + self.o_proj.forward(&y)?,
        }
    }
}

impl Attention {
    /// Candle's ops for one query token per sequence, `q` [batch, q heads, (1,) d], against `keys`
    /// and `values` [batch, kv heads, slots, d] with `mask` added to the scores in f32 (0 where a
    /// slot is read, -1e30 where not): [batch, 1, q heads · d]. Each key-value head serves its
    /// `group` query heads in one product, with no copies of it.
    fn one_token_attention(&self, q: &Tensor, keys: &Tensor, values: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, d) = (keys.dim(0)?, self.head_dim);
        let group = self.num_heads / self.num_kv_heads;
        // Query head h reads key-value head h / group: [batch, kv heads, group, d].
        let q = q.reshape((b, self.num_kv_heads, group, d))?;
        let scale = 1.0 / (d as f64).sqrt();
        let scores = (q.matmul(&keys.t()?)? * scale)?
            .to_dtype(DType::F32)?
            .broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(q.dtype())?;
        probs.matmul(values)?.reshape((b, 1, self.num_heads * d))
    }

    /// One decode step's attention of a server's batch, each sequence at its own position in `pool`
    /// (`step`), for the residual stream `x` [n, 1, hidden]: `x` plus the attention's output. As
    /// [`Attention::decode_step`], but the new keys and values go to each sequence's slot in its
    /// blocks, and attention reads each sequence's blocks up to its position.
    fn decode_paged(
        &self,
        x: &Tensor,
        norm: &RmsNorm,
        step: &PagedStep,
        (keys, values): &(Tensor, Tensor),
    ) -> Result<Tensor> {
        let (n, _, h) = x.dims3()?;
        let (d, hq, hkv) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let slots = decode::Slots::Paged {
            positions: &step.positions,
            tables: &step.tables,
        };
        let q = match &step.composed {
            None => decode::qkv_rope(
                x,
                Some(norm.into()),
                [self.q_proj.weight(), self.k_proj.weight(), self.v_proj.weight()],
                [self.q_proj.bias(), self.k_proj.bias(), self.v_proj.bias()],
                step.rope,
                slots,
                (keys, values),
                decode::Heads { q: hq, kv: hkv, dim: d },
            )?,
            Some(c) => {
                let rows = norm.forward(x)?.reshape((n, h))?;
                let packed = match &self.qkv_bias {
                    Some(bias) => rows.matmul(&self.qkv.t()?)?.broadcast_add(bias)?,
                    None => rows.matmul(&self.qkv.t()?)?,
                };
                let part = |start: usize, heads: usize| {
                    packed
                        .narrow(1, start * d, heads * d)?
                        .reshape((n, heads, 1, d))?
                        .contiguous()
                };
                let q = candle_nn::rotary_emb::rope(&part(0, hq)?, &c.cos, &c.sin)?;
                let k = candle_nn::rotary_emb::rope(&part(hq, hkv)?, &c.cos, &c.sin)?;
                let v = part(hq + hkv, hkv)?;
                let rows = keys.elem_count() / d;
                prefill::write_rows(&keys.reshape((rows, d))?, &c.writes, &k.reshape((n * hkv, d))?)?;
                prefill::write_rows(&values.reshape((rows, d))?, &c.writes, &v.reshape((n * hkv, d))?)?;
                q
            }
        };
        let y = match &step.gathered {
            None => decode::attention(&q, keys, values, slots)?,
            Some(g) => {
                let rows = keys.elem_count() / d;
                let read = |pool: &Tensor| {
                    pool.reshape((rows, d))?
                        .index_select(&g.reads, 0)?
                        .reshape((n, hkv, g.len, d))
                };
                self.one_token_attention(&q, &read(keys)?, &read(values)?, &g.mask)?
            }
        };
        match step.composed {
            None => decode::gemv(&y, None, self.o_proj.weight(), Some(x)),
            Some(_) => x + self.o_proj.forward(&y)?,
        }
    }
}

/// [batch, kv heads, tokens, d] to [batch, kv heads × `group`, tokens, d], each head repeated in place
/// (and contiguous: a cache's keys are a view of the first tokens of its buffer).
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return x.contiguous();
    }
    let (b, n, t, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, n, group, t, d))?
        .reshape((b, n * group, t, d))
}

/// Rows of tokens whose MLP a pass runs at once: a prompt's MLP over more runs in slices of this
/// many, so that its intermediates ([rows, 3 × intermediate]: gate and up side by side, and SwiGLU's
/// output) stay bounded by the slice rather than growing with the batch and the prompt. At 8,192 rows
/// Llama-3.1-8B's are 0.7 GB (the whole of a batch of 32 prompts of 512 would be 1.4 GB, of 32
/// prompts of 1,921 5.3 GB); each slice's
/// products are still thousands of rows, which keep the GPU busy.
pub const MLP_ROWS: usize = 8192;

struct Mlp {
    /// gate_proj's and up_proj's weights stacked, [2 × intermediate, hidden]: one product makes
    /// both.
    gate_up: Tensor,
    /// Views of `gate_up`, for the decode step's kernel.
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Mlp {
    fn new(cfg: &Config, src: &mut dyn TensorSource, prefix: &str) -> Result<Mlp> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (gate_up, _) = stacked(
            src,
            &format!("{prefix}.mlp"),
            &[("gate_proj", i), ("up_proj", i)],
            h,
            false,
        )?;
        let down = src.take(&format!("{prefix}.mlp.down_proj.weight"), &[h, i])?;
        Ok(Mlp {
            gate_proj: part(&gate_up, None, 0, i)?,
            up_proj: part(&gate_up, None, i, i)?,
            gate_up,
            down_proj: Linear::new(down, None),
        })
    }

    /// The residual stream `x` [batch, tokens, hidden] plus the MLP of its norm, over at most
    /// `rows` tokens at a time ([`MLP_ROWS`]): SwiGLU of one product by gate and up side by side,
    /// then down's product, which adds the residual; with the kernel options' layers composed,
    /// candle's ops (the gate's and up's products, SiLU, their product, down's, the add).
    fn residual(&self, x: &Tensor, norm: &RmsNorm, rows: usize) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let rows = rows.max(1);
        let all = x.reshape((b * t, h))?;
        let composed = kernels::KernelOptions::active().layers == kernels::options::EncoderLayers::Composed;
        let slice = |x: &Tensor| -> Result<Tensor> {
            let normed = norm.forward(x)?;
            if composed {
                let gate = candle_nn::ops::silu(&self.gate_proj.forward(&normed)?)?;
                return x + self.down_proj.forward(&(gate * self.up_proj.forward(&normed)?)?)?;
            }
            let gated = prefill::swiglu(&kernels::product(&normed, &self.gate_up, None)?)?;
            kernels::product(&gated, self.down_proj.weight(), Some(x))
        };
        let n = b * t;
        let y = match n <= rows {
            true => slice(&all)?,
            false => {
                let parts = (0..n)
                    .step_by(rows)
                    .map(|start| slice(&all.narrow(0, start, rows.min(n - start))?))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?
            }
        };
        y.reshape((b, t, h))
    }

    /// A decode step's MLP for the residual stream `x` and the norm before it: `x` plus the
    /// output.
    fn decode_step(&self, x: &Tensor, norm: &RmsNorm, products: bool) -> Result<Tensor> {
        if products {
            let gated = decode::swiglu(x, Some(norm.into()), self.gate_proj.weight(), self.up_proj.weight())?;
            return decode::gemv(&gated, None, self.down_proj.weight(), Some(x));
        }
        self.residual(x, norm, MLP_ROWS)
    }
}

/// What every layer of one decode step reads, made once a step.
struct StepInputs<'a> {
    /// The step's position, [1] u32.
    pos: &'a Tensor,
    /// The rotary tables of every position, [positions, head_dim / 2].
    tables: (&'a Tensor, &'a Tensor),
    /// For projections run as candle's ops (the decode products do not take the step): the
    /// position's cos and sin, and the index of its slot in the cache's buffers.
    composed: Option<ComposedRope>,
    /// For attention run as candle's ops: in f32, added to the scores, 0 up to the position and
    /// -1e30 after it (its exp is 0, and unlike -inf it stays finite when multiplied by the 0 of an
    /// open slot).
    mask: Option<Tensor>,
}

/// A decode step of a server's batch: each sequence at a position of its own in a [`KvPool`], made
/// once a step ([`Decoder::paged_step`]) for every layer to read.
pub struct PagedStep<'a> {
    /// Each sequence's position, [n] u32, and its blocks, [n, the most any holds] u32.
    positions: Tensor,
    tables: Tensor,
    /// The rotary tables of every position.
    rope: (&'a Tensor, &'a Tensor),
    /// Whether the products take the step (else candle's ops with `composed`).
    products: bool,
    /// For projections run as candle's ops: each sequence's cos and sin, and the pool rows its new
    /// keys and values go to.
    composed: Option<PagedRope>,
    /// For attention run as candle's ops: the rows every sequence reads and its mask.
    gathered: Option<Gathered>,
}

struct PagedRope {
    /// [n, 1, head_dim / 2].
    cos: Tensor,
    sin: Tensor,
    /// The pool row of each (sequence, key-value head)'s new key and value, [n × kv heads] u32.
    writes: Tensor,
}

struct Gathered {
    /// The rows of each sequence's positions 0..len, every head, [n × kv heads × len]: those past a
    /// sequence's position read its first slot and are masked.
    reads: Tensor,
    len: usize,
    /// [n, 1, 1, len] f32: 0 up to each sequence's position, -1e30 after.
    mask: Tensor,
}

struct ComposedRope {
    cos: Tensor,
    sin: Tensor,
    /// The slot of every element of a step's keys, [batch, kv heads, 1, head_dim].
    at: Tensor,
}

struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// A decoder-only language model.
pub struct Decoder {
    cfg: Config,
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    /// Rotary cos and sin of every position, [max positions, head_dim / 2], in the weights' dtype.
    cos: Tensor,
    sin: Tensor,
    /// Tokens whose MLP a pass runs at once ([`MLP_ROWS`]).
    mlp_rows: usize,
}

impl Decoder {
    /// The model of `cfg` with the tensors of `vb`, named as Hugging Face names them.
    pub fn new(cfg: &Config, mut vb: VarBuilder) -> Result<Decoder> {
        let (device, dtype) = (vb.device().clone(), vb.dtype());
        Decoder::build(cfg, &mut vb, &device, dtype)
    }

    /// The model of `cfg` with `tensors` (as [`random_weights`] makes them), moved to `device` and
    /// `dtype` where they are not. Each is dropped once the model has taken it, so that building the
    /// model holds no second copy of the weights it stacks.
    pub fn from_tensors(
        cfg: &Config,
        tensors: HashMap<String, Tensor>,
        device: &Device,
        dtype: DType,
    ) -> Result<Decoder> {
        let mut src = Owned {
            tensors,
            device: device.clone(),
            dtype,
        };
        Decoder::build(cfg, &mut src, device, dtype)
    }

    fn build(cfg: &Config, src: &mut dyn TensorSource, device: &Device, dtype: DType) -> Result<Decoder> {
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let embeddings = src.take("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let norm = |src: &mut dyn TensorSource, name: &str| -> Result<RmsNorm> {
                    Ok(RmsNorm::new(src.take(&format!("{p}.{name}.weight"), &[h])?, eps))
                };
                Ok(Layer {
                    input_layernorm: norm(src, "input_layernorm")?,
                    self_attn: Attention::new(cfg, src, &p)?,
                    post_attention_layernorm: norm(src, "post_attention_layernorm")?,
                    mlp: Mlp::new(cfg, src, &p)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(src.take("model.norm.weight", &[h])?, eps);
        let lm_head = match cfg.tie_word_embeddings {
            true => Linear::new(embeddings.clone(), None),
            false => Linear::new(src.take("lm_head.weight", &[cfg.vocab_size, h])?, None),
        };
        let (cos, sin) = rotary_tables(cfg, device, dtype)?;
        Ok(Decoder {
            cfg: cfg.clone(),
            embed_tokens: Embedding::new(embeddings, h),
            layers,
            norm,
            lm_head,
            cos,
            sin,
            mlp_rows: MLP_ROWS,
        })
    }

    /// The model with its MLP run over at most `rows` tokens at a time instead of [`MLP_ROWS`]: the
    /// same logits, to within the rounding of the products' shapes.
    pub fn with_mlp_rows(mut self, rows: usize) -> Decoder {
        self.mlp_rows = rows.max(1);
        self
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The dtype of the weights and activations.
    pub fn dtype(&self) -> DType {
        self.cos.dtype()
    }

    /// Logits [batch, tokens, vocab] of `ids` [batch, tokens], placed after the tokens `cache`
    /// holds (none: a prefill), which it then holds too.
    pub fn forward(&self, ids: &Tensor, cache: &mut dyn KvStore) -> Result<Tensor> {
        self.pass(ids, cache, false)
    }

    /// As [`Decoder::forward`], the logits of each sequence's last token alone, [batch, 1, vocab]:
    /// what a generation's prefill needs. The output head over every prompt token would cost a
    /// product of the whole prompt by the vocabulary, and hold its result: at batch 32 and 512
    /// tokens of a vocabulary of 128,256, 4 GiB in bf16.
    pub fn forward_last(&self, ids: &Tensor, cache: &mut dyn KvStore) -> Result<Tensor> {
        self.pass(ids, cache, true)
    }

    fn pass(&self, ids: &Tensor, cache: &mut dyn KvStore, last_only: bool) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let offset = cache.len();
        if offset + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "{} tokens after {offset} exceed the model's {} positions",
                t,
                self.cfg.max_position_embeddings
            )
        }
        let cos = self.cos.narrow(0, offset, t)?;
        let sin = self.sin.narrow(0, offset, t)?;
        // A prompt's tokens, from position 0 or after the cache's, run the causal kernel where it
        // takes the heads; else candle's ops with the mask.
        let cfg = &self.cfg;
        let kernel = t > 1
            && causal_attention::takes(
                ids.device(),
                self.cos.dtype(),
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
            );
        let mask = (t > 1 && !kernel)
            .then(|| causal_mask(t, offset, ids.device(), self.cos.dtype()))
            .transpose()?;
        let pass = |cache: &mut dyn KvStore| -> Result<Tensor> {
            let mut x = self.embed_tokens.forward(ids)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let normed = layer.input_layernorm.forward(&x)?;
                x = match kernel {
                    true => layer.self_attn.prefill(&x, &normed, (&self.cos, &self.sin), cache, i)?,
                    false => (&x + layer.self_attn.forward(&normed, &cos, &sin, mask.as_ref(), cache, i)?)?,
                };
                x = layer.mlp.residual(&x, &layer.post_attention_layernorm, self.mlp_rows)?;
            }
            if last_only {
                x = x.narrow(1, t - 1, 1)?;
            }
            self.lm_head.forward(&self.norm.forward(&x)?)
        };
        // The cache keeps the pass only once every layer has run: one that fails leaves it as it was.
        match pass(cache) {
            Ok(logits) => {
                cache.commit();
                Ok(logits)
            }
            Err(e) => {
                cache.abandon();
                Err(e)
            }
        }
    }
}

impl Decoder {
    /// One decode step of every sequence in `cache`, which holds `pos` tokens of each ([1] u32 on
    /// the device: the step's position) and has a slot for this one: the logits [batch, 1, vocab] of
    /// `ids` [batch, 1]. Nothing in the step depends on `pos` but through tensors: attention reads
    /// every slot of the buffers with those after `pos` masked, and the new keys and values are
    /// scattered at `pos`. So one capture of it as a CUDA graph replays at every position of a
    /// generation. The caller advances the cache's length ([`KvCache::advance`]).
    pub fn decode_step(&self, ids: &Tensor, pos: &Tensor, cache: &KvCache) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let (Some(positions), Some((k0, _))) = (cache.positions(), cache.buffers(0)) else {
            candle_core::bail!("a decode step needs a cache with its room reserved")
        };
        if t != 1 || k0.dim(0)? != b {
            candle_core::bail!(
                "a decode step takes one token of each of the cache's {} sequences, not [{b}, {t}]",
                k0.dim(0)?
            )
        }
        // Checked on the host, where the position is known: a step past the buffers or the rotary
        // tables would read and write out of bounds on the device.
        if cache.len() >= cache.capacity() || cache.capacity() > self.cos.dim(0)? {
            candle_core::bail!(
                "the KV cache has room for {} tokens of each sequence and holds {}, of the model's {} positions: no room for a decode step",
                cache.capacity(),
                cache.len(),
                self.cos.dim(0)?
            )
        }
        let cfg = &self.cfg;
        let (device, dtype) = (ids.device(), self.cos.dtype());
        let q_width = cfg.num_heads * cfg.head_dim;
        let products = decode::products_take(device, dtype, b, &[cfg.hidden_size, q_width, cfg.intermediate_size]);
        let composed = match products {
            true => None,
            false => Some(ComposedRope {
                cos: self.cos.index_select(pos, 0)?,
                sin: self.sin.index_select(pos, 0)?,
                at: pos
                    .reshape((1, 1, 1, 1))?
                    .broadcast_as((b, cfg.num_kv_heads, 1, cfg.head_dim))?
                    .contiguous()?,
            }),
        };
        let group = cfg.num_heads / cfg.num_kv_heads;
        let mask = match decode::attention_takes(device, dtype, cfg.head_dim, group) {
            true => None,
            false => Some(positions.broadcast_gt(pos)?.to_dtype(DType::F32)?.affine(-1e30, 0.0)?),
        };
        let step = StepInputs {
            pos,
            tables: (&self.cos, &self.sin),
            composed,
            mask,
        };
        let buffers = (0..self.layers.len())
            .map(|i| {
                cache
                    .buffers(i)
                    .ok_or_else(|| candle_core::Error::Msg(format!("the KV cache has no layer {i}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut x = self.embed_tokens.forward(ids)?;
        match decode::layers_take(products, step.mask.is_none(), b, cfg.hidden_size) {
            true => x = self.layers_as_one_op(&x, decode::Slots::Shared(pos), &buffers)?,
            false => {
                for (layer, buffers) in self.layers.iter().zip(buffers) {
                    x = layer
                        .self_attn
                        .decode_step(&x, &layer.input_layernorm, &step, buffers)?;
                    x = layer.mlp.decode_step(&x, &layer.post_attention_layernorm, products)?;
                }
            }
        }
        match products {
            true => decode::gemv(&x, Some((&self.norm).into()), self.lm_head.weight(), None),
            false => self.lm_head.forward(&self.norm.forward(&x)?),
        }
    }
}

impl Decoder {
    /// What every layer of a decode step reads for sequences at `positions` (the slot each new token
    /// goes to), whose blocks in `pool` are `tables` (each covering its position): made on the host,
    /// where the positions are known, and checked there, so that no kernel reads or writes past a
    /// sequence's blocks or the rotary tables.
    pub fn paged_step(
        &self,
        positions: &[u32],
        tables: &[&[u32]],
        pool: &KvPool,
        device: &Device,
    ) -> Result<PagedStep<'_>> {
        let n = positions.len();
        let cfg = &self.cfg;
        let bs = pool.block_size();
        if n == 0 || tables.len() != n {
            candle_core::bail!("a paged decode step of {n} positions and {} block tables", tables.len())
        }
        for (s, (&p, table)) in positions.iter().zip(tables).enumerate() {
            let p = p as usize;
            if p >= self.cos.dim(0)? || p >= table.len() * bs || table.iter().any(|&b| b as usize >= pool.blocks()) {
                candle_core::bail!(
                    "sequence {s} of a decode step at position {p} in {} blocks of {bs} of a pool of {} (the model has {} positions)",
                    table.len(),
                    pool.blocks(),
                    self.cos.dim(0)?
                )
            }
        }
        let stride = tables.iter().map(|t| t.len()).max().unwrap_or(0);
        let flat: Vec<u32> = tables
            .iter()
            .flat_map(|t| t.iter().copied().chain(std::iter::repeat(0)).take(stride))
            .collect();
        let positions_t = Tensor::from_vec(positions.to_vec(), n, device)?;
        let dtype = self.cos.dtype();
        let q_width = cfg.num_heads * cfg.head_dim;
        let products = decode::products_take(device, dtype, n, &[cfg.hidden_size, q_width, cfg.intermediate_size]);
        let hkv = cfg.num_kv_heads;
        let composed = match products {
            true => None,
            false => {
                let rows: Vec<u32> = positions
                    .iter()
                    .zip(tables)
                    .flat_map(|(&p, t)| (0..hkv).map(move |h| pool.row(t, h, p as usize)))
                    .collect();
                let half = cfg.head_dim / 2;
                Some(PagedRope {
                    cos: self.cos.index_select(&positions_t, 0)?.reshape((n, 1, half))?,
                    sin: self.sin.index_select(&positions_t, 0)?.reshape((n, 1, half))?,
                    writes: Tensor::from_vec(rows, n * hkv, device)?,
                })
            }
        };
        let group = cfg.num_heads / hkv;
        let gathered = match decode::attention_takes(device, dtype, cfg.head_dim, group) {
            true => None,
            false => {
                let len = *positions.iter().max().expect("n > 0") as usize + 1;
                let mut reads = Vec::with_capacity(n * hkv * len);
                let mut mask = Vec::with_capacity(n * len);
                for (&p, t) in positions.iter().zip(tables) {
                    let p = p as usize;
                    for h in 0..hkv {
                        reads.extend((0..len).map(|j| pool.row(t, h, j.min(p))));
                    }
                    mask.extend((0..len).map(|j| if j > p { -1e30f32 } else { 0.0 }));
                }
                Some(Gathered {
                    reads: Tensor::from_vec(reads, n * hkv * len, device)?,
                    len,
                    mask: Tensor::from_vec(mask, (n, 1, 1, len), device)?,
                })
            }
        };
        Ok(PagedStep {
            positions: positions_t,
            tables: Tensor::from_vec(flat, (n, stride), device)?,
            rope: (&self.cos, &self.sin),
            products,
            composed,
            gathered,
        })
    }

    /// One decode step of a server's batch: `ids` [n, 1], sequence i's token at its position of
    /// `step`, its key and value written to its blocks of `pool`: the logits [n, 1, vocab].
    pub fn decode_paged(&self, ids: &Tensor, step: &PagedStep, pool: &KvPool) -> Result<Tensor> {
        let n = step.positions.dim(0)?;
        if ids.dims() != [n, 1] {
            candle_core::bail!(
                "a decode step of {n} sequences takes [{n}, 1] tokens, not {:?}",
                ids.dims()
            )
        }
        let mut x = self.embed_tokens.forward(ids)?;
        match decode::layers_take(step.products, step.gathered.is_none(), n, self.cfg.hidden_size) {
            true => {
                let pools = (0..self.layers.len())
                    .map(|i| pool.layer(i))
                    .collect::<Result<Vec<_>>>()?;
                let slots = decode::Slots::Paged {
                    positions: &step.positions,
                    tables: &step.tables,
                };
                x = self.layers_as_one_op(&x, slots, &pools)?;
            }
            false => {
                for (i, layer) in self.layers.iter().enumerate() {
                    x = layer
                        .self_attn
                        .decode_paged(&x, &layer.input_layernorm, step, pool.layer(i)?)?;
                    x = layer
                        .mlp
                        .decode_step(&x, &layer.post_attention_layernorm, step.products)?;
                }
            }
        }
        match step.products {
            true => decode::gemv(&x, Some((&self.norm).into()), self.lm_head.weight(), None),
            false => self.lm_head.forward(&self.norm.forward(&x)?),
        }
    }
}

impl Decoder {
    /// Every layer of a decode step on the residual stream `x` as one op ([`decode::layers`]), each
    /// layer's keys and values in `caches` at `slots`.
    fn layers_as_one_op(&self, x: &Tensor, slots: decode::Slots, caches: &[&(Tensor, Tensor)]) -> Result<Tensor> {
        let layers: Vec<decode::Layer> = self
            .layers
            .iter()
            .zip(caches)
            .map(|(l, (keys, values))| {
                let (a, m) = (&l.self_attn, &l.mlp);
                decode::Layer {
                    input_norm: (&l.input_layernorm).into(),
                    qkv: [a.q_proj.weight(), a.k_proj.weight(), a.v_proj.weight()],
                    biases: [a.q_proj.bias(), a.k_proj.bias(), a.v_proj.bias()],
                    o: a.o_proj.weight(),
                    post_norm: (&l.post_attention_layernorm).into(),
                    gate: m.gate_proj.weight(),
                    up: m.up_proj.weight(),
                    down: m.down_proj.weight(),
                    cache: (keys, values),
                }
            })
            .collect();
        let cfg = &self.cfg;
        let heads = decode::Heads {
            q: cfg.num_heads,
            kv: cfg.num_kv_heads,
            dim: cfg.head_dim,
        };
        decode::layers(x, &layers, (&self.cos, &self.sin), slots, heads)
    }
}

/// cos and sin of each position's angle for each dimension pair.
fn rotary_tables(cfg: &Config, device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let inv_freq: Vec<f32> = cfg.inv_freq().into_iter().map(|f| f as f32).collect();
    let pairs = inv_freq.len();
    let positions = cfg.max_position_embeddings;
    let inv_freq = Tensor::from_vec(inv_freq, (1, pairs), device)?;
    let t = Tensor::arange(0u32, positions as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((positions, 1))?;
    let angles = t.broadcast_mul(&inv_freq)?;
    Ok((angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?))
}

/// [tokens, offset + tokens]: 0 where token i (at position offset + i) may attend, -inf after it.
fn causal_mask(t: usize, offset: usize, device: &Device, dtype: DType) -> Result<Tensor> {
    let cells: Vec<f32> = (0..t)
        .flat_map(|i| (0..offset + t).map(move |j| if j > offset + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(cells, (t, offset + t), device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_transformers() {
        // transformers' num_parameters() of each preset's config (a tied head counted once).
        for (name, params) in [
            ("llama_3_2_1b", 1_235_814_400u64),
            ("llama_3_2_3b", 3_212_749_824),
            ("llama_3_1_8b", 8_030_261_248),
            ("qwen2_5_0_5b", 494_032_768),
            ("qwen2_5_1_5b", 1_543_714_304),
        ] {
            assert_eq!(preset(name).unwrap().params(), params, "{name}");
        }
    }

    #[test]
    fn flops_per_token_follow_the_stated_formula() {
        let c = preset("llama_3_2_1b").unwrap();
        // 16 layers of 2 × (4·2048² / 4 … ): the projections and MLP, then the head (tied, still
        // multiplied by), then attention over 512 tokens.
        let layer = 2048 * 2048 + 2 * 2048 * 512 + 2048 * 2048 + 3 * 2048 * 8192;
        let head = 128_256 * 2048;
        assert_eq!(c.flops_per_token(512), 2 * (16 * layer + head) + 4 * 16 * 512 * 2048);
        assert_eq!(c.kv_bytes_per_token(DType::BF16), 2 * 16 * 8 * 64 * 2);
    }

    #[test]
    fn unsupported_configs_are_refused_naming_what_is_supported() {
        let base = PRESETS[5].1;
        let with = |key: &str, value: &str| {
            let mut v: serde_json::Value = serde_json::from_str(base).unwrap();
            v[key] = serde_json::from_str(value).unwrap();
            Config::from_json(&v.to_string()).unwrap_err().to_string()
        };
        let e = with("architectures", r#"["MistralForCausalLM"]"#);
        assert_eq!(
            e,
            "architecture `MistralForCausalLM` is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM"
        );
        let e = with("rope_scaling", r#"{"rope_type": "yarn", "factor": 4.0}"#);
        assert_eq!(
            e,
            "rope_scaling of type `yarn` is not supported; supported: llama3, or none"
        );
        assert!(with("hidden_act", r#""gelu""#).contains("supported: silu"));
        assert!(with("attention_bias", "true").starts_with("attention_bias: true is not supported"));
        assert!(with("mlp_bias", "true").starts_with("mlp_bias: true is not supported"));
        assert!(with("use_sliding_window", "true").contains("sliding window"));
        assert!(with("num_key_value_heads", "3").contains("multiple of num_key_value_heads (3)"));
        let c = Config::from_json(&{
            let mut v: serde_json::Value = serde_json::from_str(base).unwrap();
            v["rope_scaling"] = serde_json::Value::Null;
            v.to_string()
        })
        .unwrap();
        assert_eq!(c.rope_scaling, None);
    }

    #[test]
    fn transformers_5_rope_parameters_read_as_transformers_4_fields() {
        // The same rotary settings, as transformers 4 and 5 write them.
        let v4 = preset("llama_3_2_1b").unwrap();
        let mut v: serde_json::Value = serde_json::from_str(PRESETS[0].1).unwrap();
        let mut parameters = v["rope_scaling"].clone();
        parameters["rope_theta"] = v["rope_theta"].clone();
        let map = v.as_object_mut().unwrap();
        map.remove("rope_scaling");
        map.remove("rope_theta");
        map.insert("rope_parameters".into(), parameters);
        let v5 = Config::from_json(&v.to_string()).unwrap();
        assert_eq!(v5, v4);
        assert_eq!(v5.rope_theta, 500_000.0);
        // No scaling: rope_type "default", the base inside.
        let mut q: serde_json::Value = serde_json::from_str(PRESETS[4].1).unwrap();
        let theta = q["rope_theta"].clone();
        let map = q.as_object_mut().unwrap();
        map.remove("rope_theta");
        map.remove("rope_scaling");
        map.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": theta}),
        );
        assert_eq!(
            Config::from_json(&q.to_string()).unwrap(),
            preset("qwen2_5_1_5b").unwrap()
        );
    }
}
