//! BERT (Devlin et al. 2018) as Hugging Face's `BertModel` builds it — word, position and token-type
//! embeddings, post-norm encoder layers with exact-GELU feed-forward, the tanh pooler — plus a
//! sequence-classification head (`classifier`, on the pooled output) for training. Parameter names
//! follow `BertModel`'s state dict, so its safetensors files load unchanged; the head is ours.

use std::sync::OnceLock;

use candle_core::{DType, Result, Tensor};
use candle_nn::{Init, Module, VarBuilder};

use super::layers::{LayerNorm, Linear};
use super::{Classifier, Inputs};
use crate::kernels::{add, Act};
use crate::kernels::{attention, ScoreBias};
use crate::optim::ParamGrads;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_position: usize,
    pub type_vocab_size: usize,
    pub num_labels: usize,
    /// Tokens per sequence of the synthetic inputs.
    pub seq_len: usize,
}

/// Sequence length when none is given.
pub const DEFAULT_SEQ_LEN: usize = 128;
const EPS: f64 = 1e-12;

impl Config {
    fn preset(hidden: usize, layers: usize, heads: usize) -> Self {
        Self {
            vocab_size: 30522,
            hidden,
            layers,
            heads,
            intermediate: 4 * hidden,
            max_position: 512,
            type_vocab_size: 2,
            num_labels: 2,
            seq_len: DEFAULT_SEQ_LEN,
        }
    }
    /// `bert-base-uncased`.
    pub fn bert_base() -> Self {
        Self::preset(768, 12, 12)
    }
    /// `bert-large-uncased`.
    pub fn bert_large() -> Self {
        Self::preset(1024, 24, 16)
    }
    /// Test size: 2 layers 32 wide, a 128-token vocabulary, 16-token sequences.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 128,
            max_position: 64,
            seq_len: 16,
            ..Self::preset(32, 2, 2)
        }
    }

    /// Parameters of `BertModel` (embeddings, encoder, pooler), without our head.
    pub fn bert_model_params(&self) -> u64 {
        let (d, i) = (self.hidden, self.intermediate);
        let embeddings = (self.vocab_size + self.max_position + self.type_vocab_size) * d + 2 * d;
        let layer = 4 * (d * d + d) + 2 * d + (d * i + i) + (i * d + d) + 2 * d;
        (embeddings + self.layers * layer + d * d + d) as u64
    }

    /// All trainable parameters: `BertModel` plus the classification head.
    pub fn params(&self) -> u64 {
        self.bert_model_params() + (self.hidden * self.num_labels + self.num_labels) as u64
    }

    /// Forward FLOPs per sequence of `seq_len` tokens, 2 per multiply-add: per layer the Q, K, V and
    /// output projections, the attention scores and their weighted sum, the feed-forward; the pooler
    /// and the head. Embedding look-ups, layer norms, softmax, GELU and additions are not counted.
    pub fn flops(&self) -> u64 {
        let (d, i, s) = (self.hidden, self.intermediate, self.seq_len);
        let layer = 4 * s * d * d + 2 * s * s * d + 2 * s * d * i;
        2 * (self.layers * layer + d * d + d * self.num_labels) as u64
    }
}

/// `torch.nn.Linear` as `BertPreTrainedModel._init_weights` initialises it: normal(0, 0.02), zero bias.
fn bert_linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let w = vb.get_with_hints((out_dim, in_dim), "weight", Init::Randn { mean: 0.0, stdev: 0.02 })?;
    let b = vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?;
    Ok(Linear::new(w, Some(b)))
}

/// An embedding table [rows, dim], looked up with [`crate::kernels::embedding`].
fn bert_embedding(rows: usize, dim: usize, vb: VarBuilder) -> Result<Tensor> {
    vb.get_with_hints((rows, dim), "weight", Init::Randn { mean: 0.0, stdev: 0.02 })
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attention_out: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNorm,
    heads: usize,
    /// q, k and v packed once, when none of them trains (inference): frozen weights cannot change,
    /// and packing them is six copies per layer and forward (measured: docs/kernels.md#bert).
    frozen_qkv: OnceLock<Linear>,
}

impl Layer {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (d, i) = (cfg.hidden, cfg.intermediate);
        let attn = vb.pp("attention");
        let this = attn.pp("self");
        Ok(Self {
            query: bert_linear(d, d, this.pp("query"))?,
            key: bert_linear(d, d, this.pp("key"))?,
            value: bert_linear(d, d, this.pp("value"))?,
            attention_out: bert_linear(d, d, attn.pp("output.dense"))?,
            attention_norm: LayerNorm::new(d, EPS, attn.pp("output.LayerNorm"))?,
            intermediate: bert_linear(d, i, vb.pp("intermediate.dense"))?,
            output: bert_linear(i, d, vb.pp("output.dense"))?,
            output_norm: LayerNorm::new(d, EPS, vb.pp("output.LayerNorm"))?,
            heads: cfg.heads,
            frozen_qkv: OnceLock::new(),
        })
    }

    /// q, k and v as one projection, packed as torch's MultiheadAttention packs them.
    fn qkv(&self) -> Result<Linear> {
        let parts = [&self.query, &self.key, &self.value];
        if parts.iter().any(|l| l.trains()) {
            return Linear::packed(&parts);
        }
        if let Some(packed) = self.frozen_qkv.get() {
            return Ok(packed.clone());
        }
        let packed = Linear::packed(&parts)?;
        // Another thread may have packed them meanwhile: the same values either way.
        let _ = self.frozen_qkv.set(packed.clone());
        Ok(packed)
    }

    /// The layer's parameters for the encoder op, its q/k/v layers held in `qkv`.
    #[cfg(feature = "cuda")]
    fn params<'a>(&'a self, qkv: &'a [&'a Linear; 3]) -> super::encoder::Params<'a> {
        super::encoder::Params {
            qkv,
            out: &self.attention_out,
            norm1: &self.attention_norm,
            fc1: &self.intermediate,
            fc2: &self.output,
            norm2: &self.output_norm,
        }
    }

    /// The layer built of ops (a training step on a GPU runs the layers as one op: see
    /// [`Bert::encode`]).
    fn forward(&self, x: &Tensor, mask_bias: &Tensor) -> Result<Tensor> {
        // One GEMM for q, k and v. The projection and the context are dropped once used: in inference
        // nothing else holds them, and kept to the end of the layer they were 4 of its 10 tokens'
        // widths alive beside the MLP.
        let ctx = attention(&self.qkv()?.forward(x)?, self.heads, ScoreBias::Keys(mask_bias))?;
        let x = self
            .attention_norm
            .forward(&self.attention_out.forward_residual(&ctx, x)?)?;
        drop(ctx);
        let h = self.intermediate.forward_act(&x, Act::GeluErf)?;
        self.output_norm.forward(&self.output.forward_residual(&h, &x)?)
    }
}

pub struct Bert {
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    embeddings_norm: LayerNorm,
    layers: Vec<Layer>,
    pooler: Linear,
    classifier: Linear,
    /// Gradients of the layers run as one op each (training on the GPU).
    grads: ParamGrads,
}

impl Bert {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let d = cfg.hidden;
        let emb = vb.pp("embeddings");
        let position_embeddings = bert_embedding(cfg.max_position, d, emb.pp("position_embeddings"))?;
        Ok(Self {
            word_embeddings: bert_embedding(cfg.vocab_size, d, emb.pp("word_embeddings"))?,
            position_embeddings,
            token_type_embeddings: bert_embedding(cfg.type_vocab_size, d, emb.pp("token_type_embeddings"))?,
            embeddings_norm: LayerNorm::new(d, EPS, emb.pp("LayerNorm"))?,
            layers: (0..cfg.layers)
                .map(|i| Layer::new(cfg, vb.pp(format!("encoder.layer.{i}"))))
                .collect::<Result<_>>()?,
            pooler: bert_linear(d, d, vb.pp("pooler.dense"))?,
            classifier: bert_linear(d, cfg.num_labels, vb.pp("classifier"))?,
            grads: ParamGrads::default(),
        })
    }
}

impl Bert {
    /// Word, token type and position embeddings summed, before their layer norm; the partial sums
    /// are dropped on return rather than kept through the layers.
    fn embed(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Tensor> {
        let seq = input_ids.dim(1)?;
        let words = crate::kernels::embedding(&self.word_embeddings, input_ids)?;
        let x = add(
            &words,
            &crate::kernels::embedding(&self.token_type_embeddings, token_type_ids)?,
            false,
        )?;
        crate::kernels::add_repeating(&x, &self.position_embeddings.narrow(0, 0, seq)?)
    }

    /// `BertModel`'s sequence output, [batch, seq, hidden], before the pooler.
    pub fn encode(&self, input_ids: &Tensor, token_type_ids: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let x = self.embeddings_norm.forward(&self.embed(input_ids, token_type_ids)?)?;
        // Masked keys get -10000 added to their scores, as the original BERT does (finite in f16).
        let (b, s) = attention_mask.dims2()?;
        // Per key [b, s], in the model's dtype; the attention op adds it to every head's scores.
        let mask_bias = ((attention_mask.to_dtype(DType::F32)? - 1.0)? * 10000.0)?
            .reshape((b, s))?
            .to_dtype(x.dtype())?
            .detach();
        // Training on a GPU: the layers as one op (see `encoder::runs_as_one_op`).
        #[cfg(feature = "cuda")]
        {
            use super::encoder::{self, Norms};
            let qkv: Vec<[&Linear; 3]> = self.layers.iter().map(|l| [&l.query, &l.key, &l.value]).collect();
            let params: Vec<_> = self.layers.iter().zip(&qkv).map(|(l, q)| l.params(q)).collect();
            if encoder::runs_as_one_op(&x, &params) {
                let heads = self.layers[0].heads;
                return encoder::forward(&x, &params, heads, Norms::Post, Some(&mask_bias), &self.grads);
            }
        }
        self.layers.iter().try_fold(x, |x, l| l.forward(&x, &mask_bias))
    }
}

impl Classifier for Bert {
    fn forward(&self, inputs: &Inputs, _train: bool) -> Result<Tensor> {
        let Inputs::Tokens {
            input_ids,
            token_type_ids,
            attention_mask,
        } = inputs
        else {
            candle_core::bail!("BERT takes token inputs")
        };
        let x = self.encode(input_ids, token_type_ids, attention_mask)?;
        let pooled = self.pooler.forward(&crate::kernels::first_position(&x)?)?.tanh()?;
        self.classifier.forward(&pooled)
    }

    fn param_grads(&self) -> Option<&ParamGrads> {
        Some(&self.grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{Params, SeededInit};
    use candle_core::Device;

    #[test]
    fn frozen_q_k_v_are_packed_once_and_trained_ones_on_every_call() -> Result<()> {
        for trainable in [false, true] {
            let vb = SeededInit::var_builder(Params::new(trainable), 1, DType::F32, &Device::Cpu);
            let layer = Layer::new(&Config::tiny(), vb)?;
            let (first, second) = (layer.qkv()?, layer.qkv()?);
            assert_eq!(
                first.weight().id() == second.weight().id(),
                !trainable,
                "trainable: {trainable}"
            );
            assert_eq!(first.weight().dim(0)?, 3 * Config::tiny().hidden);
        }
        Ok(())
    }

    #[test]
    fn parameter_counts_match_hugging_face() {
        assert_eq!(Config::bert_base().bert_model_params(), 109_482_240);
        assert_eq!(Config::bert_large().bert_model_params(), 335_141_888);
        // The head: 768 x 2 weights and 2 biases.
        assert_eq!(Config::bert_base().params(), 109_482_240 + 1_538);
    }

    #[test]
    fn flops_of_bert_base_at_128_tokens() {
        // 12 x (4*128*768^2 + 2*128^2*768 + 2*128*768*3072) + 768^2 + 768*2 multiply-adds.
        let macs: u64 = 12 * (4 * 128 * 768 * 768 + 2 * 128 * 128 * 768 + 2 * 128 * 768 * 3072) + 768 * 768 + 768 * 2;
        assert_eq!(Config::bert_base().flops(), 2 * macs);
        assert!((Config::bert_base().flops() as f64 / 1e9 - 22.35).abs() < 0.01);
    }
}
