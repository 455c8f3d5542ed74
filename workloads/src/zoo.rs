//! The catalogue of models migprof can run: names as the CLI spells them, their facts (parameters,
//! FLOPs, input shape), and how to build each one.

use candle_core::Result;
use candle_nn::VarBuilder;

use crate::models::{bert, decoder, resnet, swin, vit, Classifier};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    ResNet,
    Vit,
    Swin,
    Bert,
    /// Hugging Face's `LlamaForCausalLM`.
    Llama,
    /// Hugging Face's `Qwen2ForCausalLM`.
    Qwen2,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::ResNet => "resnet",
            Family::Vit => "vit",
            Family::Swin => "swin",
            Family::Bert => "bert",
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }

    /// A decoder-only language model, which generates (`Mode::Generate`) rather than classifies.
    pub fn is_decoder(self) -> bool {
        matches!(self, Family::Llama | Family::Qwen2)
    }
}

/// The shape of one sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputShape {
    Image {
        channels: usize,
        height: usize,
        width: usize,
    },
    /// Sequences of `seq_len` token ids below `vocab_size`, of `type_vocab_size` token types.
    Tokens {
        seq_len: usize,
        vocab_size: usize,
        type_vocab_size: usize,
    },
    /// A language model's prompt: token ids below `vocab_size`, prompt and generated tokens together
    /// at most `max_positions` (its position embeddings). The prompt's length is the run's.
    Prompt { vocab_size: usize, max_positions: usize },
}

impl InputShape {
    /// Sequence length for token inputs; `None` for images.
    pub fn seq_len(&self) -> Option<usize> {
        match self {
            InputShape::Image { .. } | InputShape::Prompt { .. } => None,
            InputShape::Tokens { seq_len, .. } => Some(*seq_len),
        }
    }
}

/// What migprof knows about a model without building it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    /// As the CLI spells it: a catalogue name, or `hf:DIR` for a Hugging Face folder.
    pub name: String,
    pub family: Family,
    pub input: InputShape,
    pub num_classes: usize,
    /// Trainable parameters (buffers such as batch-norm running statistics excluded).
    pub params: u64,
    /// Forward FLOPs per sample, a multiply-add counted as 2; for a language model, of one token
    /// with no context (its weights alone; [`decoder::Config::flops_per_token`] adds attention's).
    pub flops_per_sample: u64,
    /// A test-size preset rather than a published model.
    pub tiny: bool,
    /// A language model's shape (its `config.json`); `None` for the other families.
    pub decoder: Option<decoder::Config>,
}

impl ModelInfo {
    /// FLOPs of one training step per sample: forward + backward, the backward counted as twice the
    /// forward (a gradient for the activations and one for the weights).
    pub fn train_flops_per_sample(&self) -> u64 {
        3 * self.flops_per_sample
    }
}

/// A model's architecture, as its family's config.
#[derive(Debug, Clone)]
pub enum Arch {
    ResNet(resnet::Config),
    Vit(vit::Config),
    Swin(swin::Config),
    Bert(bert::Config),
    Decoder(decoder::Config),
}

impl Arch {
    fn info(&self, name: &str, tiny: bool) -> ModelInfo {
        let name = name.to_string();
        let image = |family, side: usize, num_classes, params, flops_per_sample| ModelInfo {
            name: name.clone(),
            family,
            input: InputShape::Image {
                channels: 3,
                height: side,
                width: side,
            },
            num_classes,
            params,
            flops_per_sample,
            tiny,
            decoder: None,
        };
        match self {
            Arch::ResNet(c) => image(Family::ResNet, c.image_size, c.num_classes, c.params(), c.flops()),
            Arch::Vit(c) => image(Family::Vit, c.image_size, c.num_classes, c.params(), c.flops()),
            Arch::Swin(c) => image(Family::Swin, c.image_size, c.num_classes, c.params(), c.flops()),
            Arch::Bert(cfg) => ModelInfo {
                name,
                family: Family::Bert,
                input: InputShape::Tokens {
                    seq_len: cfg.seq_len,
                    vocab_size: cfg.vocab_size,
                    type_vocab_size: cfg.type_vocab_size,
                },
                num_classes: cfg.num_labels,
                params: cfg.params(),
                flops_per_sample: cfg.flops(),
                tiny,
                decoder: None,
            },
            Arch::Decoder(cfg) => ModelInfo {
                name,
                family: match cfg.architecture {
                    decoder::Architecture::Llama => Family::Llama,
                    decoder::Architecture::Qwen2 => Family::Qwen2,
                },
                input: InputShape::Prompt {
                    vocab_size: cfg.vocab_size,
                    max_positions: cfg.max_position_embeddings,
                },
                num_classes: cfg.vocab_size,
                params: cfg.params(),
                flops_per_sample: cfg.flops_per_token(0),
                tiny,
                decoder: Some(cfg.clone()),
            },
        }
    }

    /// The same architecture fed sequences of `seq_len` tokens; only token models take one.
    fn with_seq_len(self, name: &str, seq_len: usize) -> std::result::Result<Self, ZooError> {
        match self {
            Arch::Bert(cfg) if seq_len == 0 || seq_len > cfg.max_position => Err(ZooError::SeqLen {
                name: name.to_string(),
                why: format!("must be 1 to {} (its position embeddings)", cfg.max_position),
            }),
            Arch::Bert(cfg) => Ok(Arch::Bert(bert::Config { seq_len, ..cfg })),
            Arch::Decoder(_) => Err(seq_len_of_decoder(name)),
            _ => Err(ZooError::SeqLen {
                name: name.to_string(),
                why: "applies to token models (bert_*) only".to_string(),
            }),
        }
    }

    pub(crate) fn build(&self, vb: VarBuilder) -> Result<Box<dyn Classifier>> {
        Ok(match self {
            Arch::ResNet(cfg) => Box::new(resnet::ResNet::new(cfg, vb)?),
            Arch::Vit(cfg) => Box::new(vit::VisionTransformer::new(cfg, vb)?),
            Arch::Swin(cfg) => Box::new(swin::Swin::new(cfg, vb)?),
            Arch::Bert(cfg) => Box::new(bert::Bert::new(cfg, vb)?),
            Arch::Decoder(_) => {
                candle_core::bail!("a language model generates rather than classifies: run it with --mode generate")
            }
        })
    }
}

struct Entry {
    name: &'static str,
    arch: fn() -> Arch,
    tiny: bool,
}

const fn entry(name: &'static str, arch: fn() -> Arch, tiny: bool) -> Entry {
    Entry { name, arch, tiny }
}

const ZOO: &[Entry] = &[
    entry("resnet18", || Arch::ResNet(resnet::Config::resnet18()), false),
    entry("resnet34", || Arch::ResNet(resnet::Config::resnet34()), false),
    entry("resnet50", || Arch::ResNet(resnet::Config::resnet50()), false),
    entry("resnet101", || Arch::ResNet(resnet::Config::resnet101()), false),
    entry("resnet152", || Arch::ResNet(resnet::Config::resnet152()), false),
    entry("resnet_tiny", || Arch::ResNet(resnet::Config::tiny()), true),
    entry("vit_ti_16", || Arch::Vit(vit::Config::vit_ti_16()), false),
    entry("vit_s_16", || Arch::Vit(vit::Config::vit_s_16()), false),
    entry("vit_b_16", || Arch::Vit(vit::Config::vit_b_16()), false),
    entry("vit_tiny", || Arch::Vit(vit::Config::tiny()), true),
    entry("swin_t", || Arch::Swin(swin::Config::swin_t()), false),
    entry("swin_s", || Arch::Swin(swin::Config::swin_s()), false),
    entry("swin_b", || Arch::Swin(swin::Config::swin_b()), false),
    entry("swin_tiny", || Arch::Swin(swin::Config::tiny()), true),
    entry("bert_base", || Arch::Bert(bert::Config::bert_base()), false),
    entry("bert_large", || Arch::Bert(bert::Config::bert_large()), false),
    entry("bert_tiny", || Arch::Bert(bert::Config::tiny()), true),
    entry("llama_3_2_1b", || decoder_preset("llama_3_2_1b"), false),
    entry("llama_3_2_3b", || decoder_preset("llama_3_2_3b"), false),
    entry("llama_3_1_8b", || decoder_preset("llama_3_1_8b"), false),
    entry("qwen2_5_0_5b", || decoder_preset("qwen2_5_0_5b"), false),
    entry("qwen2_5_1_5b", || decoder_preset("qwen2_5_1_5b"), false),
    entry("llama_tiny", || decoder_preset("llama_tiny"), true),
    entry("qwen2_tiny", || decoder_preset("qwen2_tiny"), true),
];

fn decoder_preset(name: &str) -> Arch {
    Arch::Decoder(decoder::preset(name).expect("every decoder entry names a preset"))
}

fn seq_len_of_decoder(name: &str) -> ZooError {
    ZooError::SeqLen {
        name: name.to_string(),
        why: "does not apply to a language model: its prompt is --prompt-len tokens".to_string(),
    }
}

/// The prefix of a model given as a Hugging Face folder: `hf:DIR`.
pub const FOLDER_PREFIX: &str = "hf:";

#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    #[error("unknown model `{name}`; valid models: {}", valid.join(", "))]
    UnknownModel { name: String, valid: Vec<&'static str> },
    #[error("--seq-len for `{name}` {why}")]
    SeqLen { name: String, why: String },
    #[error(transparent)]
    Folder(#[from] decoder::FolderError),
}

/// Whether `name` is a model migprof can run: a catalogue name or `hf:DIR` (the folder is read when
/// the model is looked up). The message names the valid choices.
pub fn check_name(name: &str) -> std::result::Result<(), String> {
    if name.starts_with(FOLDER_PREFIX) || ZOO.iter().any(|e| e.name == name) {
        return Ok(());
    }
    Err(ZooError::UnknownModel {
        name: name.to_string(),
        valid: model_names(),
    }
    .to_string()
        + ", or hf:DIR (a Hugging Face folder of a supported language model)")
}

/// Every model, in catalogue order.
pub fn models() -> Vec<ModelInfo> {
    ZOO.iter().map(|e| (e.arch)().info(e.name, e.tiny)).collect()
}

/// The test-size preset of a family: the cheapest model that exercises the family's kernels.
pub fn tiny_model(family: Family) -> &'static str {
    ZOO.iter()
        .find(|e| e.tiny && (e.arch)().info(e.name, e.tiny).family == family)
        .map(|e| e.name)
        .expect("every family has a tiny preset")
}

/// Every model name, in catalogue order.
pub fn model_names() -> Vec<&'static str> {
    ZOO.iter().map(|e| e.name).collect()
}

/// A model's architecture and facts, by its CLI name, at its default input size.
pub fn lookup(name: &str) -> std::result::Result<(Arch, ModelInfo), ZooError> {
    lookup_with(name, None)
}

/// As [`lookup`], with the sequence length of a token model set.
pub fn lookup_with(name: &str, seq_len: Option<usize>) -> std::result::Result<(Arch, ModelInfo), ZooError> {
    if let Some(dir) = name.strip_prefix(FOLDER_PREFIX) {
        if seq_len.is_some() {
            return Err(seq_len_of_decoder(name));
        }
        let (cfg, _) = decoder::read_folder(std::path::Path::new(dir))?;
        let arch = Arch::Decoder(cfg);
        let info = arch.info(name, false);
        return Ok((arch, info));
    }
    let e = ZOO
        .iter()
        .find(|e| e.name == name)
        .ok_or_else(|| ZooError::UnknownModel {
            name: name.to_string(),
            valid: model_names(),
        })?;
    let arch = match seq_len {
        Some(len) => (e.arch)().with_seq_len(e.name, len)?,
        None => (e.arch)(),
    };
    let info = arch.info(e.name, e.tiny);
    Ok((arch, info))
}
