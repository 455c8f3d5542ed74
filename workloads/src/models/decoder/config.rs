//! A decoder's shape as Hugging Face's `config.json` writes it: the architectures migprof runs, the
//! fields it reads, what it refuses and why, and the presets' files.

use candle_core::DType;
use serde::Deserialize;

use crate::models::kv_cache::KvShape;

/// The architectures migprof runs, as `config.json`'s `architectures` names them.
pub const ARCHITECTURES: [&str; 2] = ["LlamaForCausalLM", "Qwen2ForCausalLM"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    pub fn as_str(self) -> &'static str {
        match self {
            Architecture::Llama => ARCHITECTURES[0],
            Architecture::Qwen2 => ARCHITECTURES[1],
        }
    }
}

/// Why a `config.json` cannot be run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("{0}")]
    Json(String),
    #[error("architecture `{found}` is not supported; supported: {}", ARCHITECTURES.join(", "))]
    Architecture { found: String },
    #[error("rope_scaling of type `{found}` is not supported; supported: llama3, or none")]
    RopeScaling { found: String },
    #[error("hidden_act `{found}` is not supported; supported: silu")]
    Activation { found: String },
    #[error("{field}: true is not supported; supported: false ({why})")]
    Unsupported { field: &'static str, why: &'static str },
    #[error("{0}")]
    Shape(String),
}

/// `config.json` as Hugging Face writes it, the fields migprof reads.
#[derive(Debug, Clone, Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f64,
    #[serde(default)]
    rope_theta: Option<f64>,
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// transformers 5 writes the rotary settings here: `rope_type`, `rope_theta` and the scaling's.
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: Option<bool>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    hidden_act: Option<String>,
}

/// transformers' rotary base where a config gives none.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// Llama 3's scaling of the rotary frequencies for long contexts.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// A decoder's shape, as read from its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3Scaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
}

impl Config {
    /// Reads a `config.json`; an architecture, rope scaling or activation migprof does not run is
    /// refused, naming what it found and what it supports.
    pub fn from_json(text: &str) -> std::result::Result<Config, ConfigError> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let named = raw
            .architectures
            .first()
            .cloned()
            .or_else(|| raw.model_type.clone())
            .unwrap_or_default();
        let architecture = match named.as_str() {
            "LlamaForCausalLM" | "llama" => Architecture::Llama,
            "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
            _ => return Err(ConfigError::Architecture { found: named }),
        };
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(ConfigError::Activation { found: act.to_string() });
        }
        // Refused rather than loaded without them: weights nobody asks for are ignored, and the
        // logits would be silently wrong.
        for (field, set, why) in [
            (
                "attention_bias",
                raw.attention_bias,
                "biases on every attention projection, o_proj's included",
            ),
            ("mlp_bias", raw.mlp_bias, "biases on the MLP's projections"),
            (
                "use_sliding_window",
                raw.use_sliding_window,
                "attention over a sliding window",
            ),
        ] {
            if set == Some(true) {
                return Err(ConfigError::Unsupported { field, why });
            }
        }
        let (rope_theta, rope_scaling) = rope(&raw)?;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0 || num_kv_heads == 0 || !raw.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ConfigError::Shape(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({num_kv_heads})",
                raw.num_attention_heads
            )));
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ConfigError::Shape(format!(
                "head_dim {head_dim} must be even and positive"
            )));
        }
        Ok(Config {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            qkv_bias: architecture == Architecture::Qwen2,
        })
    }

    /// Weights a token multiplies by in one layer: the four attention projections and the MLP.
    fn layer_matmul_weights(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden_size as u64,
            (self.num_heads * self.head_dim) as u64,
            (self.num_kv_heads * self.head_dim) as u64,
        );
        h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size as u64
    }

    /// Parameters, as transformers' `num_parameters()` counts them (a tied head once).
    pub fn params(&self) -> u64 {
        let h = self.hidden_size as u64;
        let bias = if self.qkv_bias {
            ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim) as u64
        } else {
            0
        };
        let layer = self.layer_matmul_weights() + bias + 2 * h;
        let embed = self.vocab_size as u64 * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + self.num_layers as u64 * layer + h + head
    }

    /// FLOPs of one token attending to `context` tokens (itself included): 2 × the weights it
    /// multiplies by (every projection and the output head, not the embedding lookup) plus
    /// attention's 4 × layers × context × (heads × head_dim) (its scores and its weighted sum).
    pub fn flops_per_token(&self, context: usize) -> u64 {
        let head = self.vocab_size as u64 * self.hidden_size as u64;
        let weights = self.num_layers as u64 * self.layer_matmul_weights() + head;
        let attention = 4 * (self.num_layers * context * self.num_heads * self.head_dim) as u64;
        2 * weights + attention
    }

    /// Bytes of the key-value cache per token of a sequence, at `dtype`.
    pub fn kv_bytes_per_token(&self, dtype: DType) -> u64 {
        KvShape::from(self).token_bytes(dtype) as u64
    }

    /// The rotary frequencies of a head's dimension pairs, Llama 3's scaling applied.
    pub(super) fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64))
            .collect();
        let Some(s) = self.rope_scaling else {
            return base;
        };
        let original = s.original_max_position_embeddings as f64;
        let (low_wavelen, high_wavelen) = (original / s.low_freq_factor, original / s.high_freq_factor);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / s.factor
                } else {
                    let smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect()
    }
}

impl From<&Config> for KvShape {
    fn from(cfg: &Config) -> KvShape {
        KvShape {
            layers: cfg.num_layers,
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        }
    }
}

/// The presets: name, `config.json`.
pub const PRESETS: [(&str, &str); 7] = [
    ("llama_3_2_1b", include_str!("../../../configs/llama_3_2_1b.json")),
    ("llama_3_2_3b", include_str!("../../../configs/llama_3_2_3b.json")),
    ("llama_3_1_8b", include_str!("../../../configs/llama_3_1_8b.json")),
    ("qwen2_5_0_5b", include_str!("../../../configs/qwen2_5_0_5b.json")),
    ("qwen2_5_1_5b", include_str!("../../../configs/qwen2_5_1_5b.json")),
    ("llama_tiny", include_str!("../../../configs/llama_tiny.json")),
    ("qwen2_tiny", include_str!("../../../configs/qwen2_tiny.json")),
];

/// A preset's config by name; `None` for a name that is not one.
pub fn preset(name: &str) -> Option<Config> {
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, json)| Config::from_json(json).expect("the presets' config.json files read"))
}

/// The rotary embedding's base and scaling. transformers 4 writes `rope_theta` and
/// `rope_scaling`; transformers 5 one `rope_parameters` holding both (its `rope_type` "default"
/// where nothing scales).
fn rope(raw: &RawConfig) -> std::result::Result<(f64, Option<Llama3Scaling>), ConfigError> {
    let parameters = raw.rope_parameters.clone().filter(|v| !v.is_null());
    let rope_theta = raw
        .rope_theta
        .or_else(|| parameters.as_ref()?.get("rope_theta")?.as_f64())
        .unwrap_or(DEFAULT_ROPE_THETA);
    let rope_scaling = match parameters.or(raw.rope_scaling.clone()) {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => {
            let kind = v
                .get("rope_type")
                .or_else(|| v.get("type"))
                .and_then(|t| t.as_str())
                .unwrap_or("")
                .to_string();
            match kind.as_str() {
                "default" => None,
                "llama3" => {
                    Some(serde_json::from_value(v).map_err(|e| ConfigError::Json(format!("rope_scaling: {e}")))?)
                }
                _ => return Err(ConfigError::RopeScaling { found: kind }),
            }
        }
    };
    Ok((rope_theta, rope_scaling))
}
