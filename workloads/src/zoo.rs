//! The catalogue of models migprof can run: names as the CLI spells them, their facts (parameters,
//! FLOPs, input shape), and how to build each one.

use candle_core::Result;
use candle_nn::VarBuilder;

use crate::models::{bert, resnet, swin, vit, Classifier};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    ResNet,
    Vit,
    Swin,
    Bert,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::ResNet => "resnet",
            Family::Vit => "vit",
            Family::Swin => "swin",
            Family::Bert => "bert",
        }
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
}

impl InputShape {
    /// Sequence length for token inputs; `None` for images.
    pub fn seq_len(&self) -> Option<usize> {
        match self {
            InputShape::Image { .. } => None,
            InputShape::Tokens { seq_len, .. } => Some(*seq_len),
        }
    }
}

/// What migprof knows about a model without building it.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub name: &'static str,
    pub family: Family,
    pub input: InputShape,
    pub num_classes: usize,
    /// Trainable parameters (buffers such as batch-norm running statistics excluded).
    pub params: u64,
    /// Forward FLOPs per sample, a multiply-add counted as 2.
    pub flops_per_sample: u64,
    /// A test-size preset rather than a published model.
    pub tiny: bool,
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
}

impl Arch {
    fn info(&self, name: &'static str, tiny: bool) -> ModelInfo {
        let image = |family, side: usize, num_classes, params, flops_per_sample| ModelInfo {
            name,
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
];

#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    #[error("unknown model `{name}`; valid models: {}", valid.join(", "))]
    UnknownModel { name: String, valid: Vec<&'static str> },
    #[error("--seq-len for `{name}` {why}")]
    SeqLen { name: String, why: String },
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
