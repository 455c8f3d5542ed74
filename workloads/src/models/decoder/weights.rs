//! Where a decoder's weights come from: a Hugging Face folder's files, a map of tensors handed over
//! one at a time, or seeded random weights named as Hugging Face names them.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

use super::config::{Config, ConfigError};

/// Why a model folder cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    #[error("{dir}: {why}")]
    Folder { dir: String, why: String },
    // `why`, not `source`: as an error's source the reason would be printed a second time after it.
    #[error("{dir}/config.json: {why}")]
    Config { dir: String, why: ConfigError },
}

/// A Hugging Face model folder (`config.json` and its weights as `*.safetensors`, one file or
/// shards): the config, and the weights' files in name order.
pub fn read_folder(dir: &std::path::Path) -> std::result::Result<(Config, Vec<std::path::PathBuf>), FolderError> {
    let shown = dir.display().to_string();
    let folder = |why: String| FolderError::Folder {
        dir: shown.clone(),
        why,
    };
    let text = std::fs::read_to_string(dir.join("config.json")).map_err(|e| {
        folder(format!(
            "no readable config.json ({e}); a model folder holds config.json and its *.safetensors"
        ))
    })?;
    let cfg = Config::from_json(&text).map_err(|why| FolderError::Config {
        dir: shown.clone(),
        why,
    })?;
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| folder(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(folder(
            "no *.safetensors weights beside config.json (migprof reads safetensors, not .bin or .pt)".into(),
        ));
    }
    Ok((cfg, files))
}

/// Where a model's tensors come from, by their Hugging Face names: a checkpoint's files through a
/// [`VarBuilder`], or a map of tensors handed over one at a time ([`Decoder::from_tensors`]), so that
/// the map keeps no copy of the weights the model joins side by side.
pub(super) trait TensorSource {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor>;
}

impl TensorSource for VarBuilder<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.get(shape, name)
    }
}

/// A map of tensors, each removed as the model takes it.
pub(super) struct Owned {
    pub(super) tensors: HashMap<String, Tensor>,
    pub(super) device: Device,
    pub(super) dtype: DType,
}

impl TensorSource for Owned {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no tensor {name} among the weights")))?;
        if t.dims() != shape {
            candle_core::bail!(
                "{name}: a tensor of shape {:?}, where the config makes {shape:?}",
                t.dims()
            )
        }
        t.to_device(&self.device)?.to_dtype(self.dtype)
    }
}

/// The weights named `{prefix}.{name}.weight` (and `.bias` where `bias`), each [rows, cols], stacked
/// along their rows in order: one tensor that one product reads, and each part a view of it.
pub(super) fn stacked(
    src: &mut dyn TensorSource,
    prefix: &str,
    parts: &[(&str, usize)],
    cols: usize,
    bias: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let weights = parts
        .iter()
        .map(|(name, rows)| src.take(&format!("{prefix}.{name}.weight"), &[*rows, cols]))
        .collect::<Result<Vec<_>>>()?;
    let biases = match bias {
        true => Some(
            parts
                .iter()
                .map(|(name, rows)| src.take(&format!("{prefix}.{name}.bias"), &[*rows]))
                .collect::<Result<Vec<_>>>()?,
        ),
        false => None,
    };
    Ok((
        Tensor::cat(&weights, 0)?,
        biases.map(|b| Tensor::cat(&b, 0)).transpose()?,
    ))
}

/// Rows `start..start + rows` of a stacked weight (and bias) as a layer of their own.
pub(super) fn part(weight: &Tensor, bias: Option<&Tensor>, start: usize, rows: usize) -> Result<Linear> {
    Ok(Linear::new(
        weight.narrow(0, start, rows)?,
        bias.map(|b| b.narrow(0, start, rows)).transpose()?,
    ))
}

/// Seeded random weights for `cfg`, named as Hugging Face names them: normal(0, 0.02) for
/// matrices and embeddings, ones for the norms, zeros for the biases, as transformers initialises.
pub fn random_weights(cfg: &Config, seed: u64, device: &Device, dtype: DType) -> Result<HashMap<String, Tensor>> {
    let mut w = HashMap::new();
    // Each tensor from its own stream, seeded by its name: independent of the order they are made.
    // Cast on the host: an f32 copy on the device beside the weights built so far (Llama-3.1-8B's
    // output head is 2.1 GB in f32) ran a 2g.20gb slice out of memory that holds the model.
    let mut normal = |name: String, shape: (usize, usize)| -> Result<()> {
        let values = crate::init::Rng::for_name(seed, &name).normal_vec(shape.0 * shape.1, 0.0, 0.02);
        let host = Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?;
        w.insert(name, host.to_device(device)?);
        Ok(())
    };
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let (q, kv) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
    normal("model.embed_tokens.weight".into(), (cfg.vocab_size, h))?;
    if !cfg.tie_word_embeddings {
        normal("lm_head.weight".into(), (cfg.vocab_size, h))?;
    }
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", (q, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, q)),
            ("mlp.gate_proj", (i, h)),
            ("mlp.up_proj", (i, h)),
            ("mlp.down_proj", (h, i)),
        ] {
            normal(format!("{p}.{name}.weight"), shape)?;
        }
    }
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{norm}.weight"), Tensor::ones(h, dtype, device)?);
        }
        if cfg.qkv_bias {
            for (name, n) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                w.insert(format!("{p}.self_attn.{name}.bias"), Tensor::zeros(n, dtype, device)?);
            }
        }
    }
    w.insert("model.norm.weight".into(), Tensor::ones(h, dtype, device)?);
    Ok(w)
}
