//! Vision Transformer (Dosovitskiy et al. 2020) as torchvision builds it: patch embedding by a strided
//! convolution, a class token, learned position embeddings, pre-norm encoder blocks with exact-GELU
//! MLPs. Parameter names follow torchvision's `vit_*` state dicts.

use candle_core::{Result, Tensor};
use candle_nn::{Init, Module, VarBuilder};

use super::layers::{torch_linear, LayerNorm, Linear, PatchEmbed};
use super::{Classifier, Inputs};
use crate::kernels::{attention, Act, ScoreBias};
use crate::optim::ParamGrads;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub image_size: usize,
    pub patch_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub mlp_dim: usize,
    pub num_classes: usize,
}

impl Config {
    fn preset(hidden: usize, heads: usize) -> Self {
        Self {
            image_size: 224,
            patch_size: 16,
            hidden,
            layers: 12,
            heads,
            mlp_dim: 4 * hidden,
            num_classes: 1000,
        }
    }
    /// ViT-B/16, torchvision's `vit_b_16`.
    pub fn vit_b_16() -> Self {
        Self::preset(768, 12)
    }
    /// ViT-S/16 (DeiT-S shape: 384 wide, 6 heads).
    pub fn vit_s_16() -> Self {
        Self::preset(384, 6)
    }
    /// ViT-Ti/16 (DeiT-Ti shape: 192 wide, 3 heads).
    pub fn vit_ti_16() -> Self {
        Self::preset(192, 3)
    }
    /// Test size: 32x32 images in 8x8 patches, 2 blocks 32 wide, 10 classes.
    pub fn tiny() -> Self {
        Self {
            image_size: 32,
            patch_size: 8,
            hidden: 32,
            layers: 2,
            heads: 2,
            mlp_dim: 64,
            num_classes: 10,
        }
    }

    fn patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    pub fn params(&self) -> u64 {
        let (d, m, p) = (self.hidden, self.mlp_dim, self.patch_size);
        let embed = d * 3 * p * p + d + d + (self.patches() + 1) * d;
        let block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * m + m) + (m * d + d);
        (embed + self.layers * block + 2 * d + d * self.num_classes + self.num_classes) as u64
    }

    /// Forward FLOPs per image, 2 per multiply-add: patch embedding, per block the QKV projection,
    /// the attention scores and their weighted sum, the output projection and the MLP; the head.
    /// Layer norms, softmax, GELU and additions are not counted.
    pub fn flops(&self) -> u64 {
        let (d, m, t) = (self.hidden, self.mlp_dim, self.patches() + 1);
        let embed = self.patches() * d * 3 * self.patch_size * self.patch_size;
        let block = t * d * 3 * d + 2 * t * t * d + t * d * d + 2 * t * d * m;
        2 * (embed + self.layers * block + d * self.num_classes) as u64
    }
}

struct EncoderBlock {
    ln_1: LayerNorm,
    /// torch's packed q/k/v projection (`in_proj_weight`, `in_proj_bias`).
    in_proj: Linear,
    out_proj: Linear,
    ln_2: LayerNorm,
    mlp_fc1: Linear,
    mlp_fc2: Linear,
    heads: usize,
}

impl EncoderBlock {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let d = cfg.hidden;
        let attn = vb.pp("self_attention");
        // torch.nn.MultiheadAttention: xavier-uniform packed projection, zero biases.
        let bound = (6.0 / (d + 3 * d) as f64).sqrt();
        let in_proj_weight =
            attn.get_with_hints((3 * d, d), "in_proj_weight", Init::Uniform { lo: -bound, up: bound })?;
        let in_proj_bias = attn.get_with_hints(3 * d, "in_proj_bias", Init::Const(0.0))?;
        Ok(Self {
            ln_1: LayerNorm::new(d, 1e-6, vb.pp("ln_1"))?,
            in_proj: Linear::new(in_proj_weight, Some(in_proj_bias)),
            out_proj: torch_linear(d, d, attn.pp("out_proj"))?,
            ln_2: LayerNorm::new(d, 1e-6, vb.pp("ln_2"))?,
            mlp_fc1: torch_linear(d, cfg.mlp_dim, vb.pp("mlp.0"))?,
            mlp_fc2: torch_linear(cfg.mlp_dim, d, vb.pp("mlp.3"))?,
            heads: cfg.heads,
        })
    }

    /// The block's parameters for the encoder op, its q/k/v layer held in `qkv`.
    #[cfg(feature = "cuda")]
    fn params<'a>(&'a self, qkv: &'a [&'a Linear; 1]) -> super::encoder::Params<'a> {
        super::encoder::Params {
            qkv,
            out: &self.out_proj,
            norm1: &self.ln_1,
            fc1: &self.mlp_fc1,
            fc2: &self.mlp_fc2,
            norm2: &self.ln_2,
        }
    }

    /// The block built of ops (a training step on a GPU runs the blocks as one op: see
    /// [`VisionTransformer::blocks`]).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.ln_1.forward(x)?;
        let attn = attention(&self.in_proj.forward(&h)?, self.heads, ScoreBias::None)?;
        let x = self.out_proj.forward_residual(&attn, x)?;
        let h = self.mlp_fc1.forward_act(&self.ln_2.forward(&x)?, Act::GeluErf)?;
        self.mlp_fc2.forward_residual(&h, &x)
    }
}

pub struct VisionTransformer {
    conv_proj: PatchEmbed,
    class_token: Tensor,
    pos_embedding: Tensor,
    blocks: Vec<EncoderBlock>,
    ln: LayerNorm,
    head: Linear,
    /// Gradients of the blocks run as one op each (training on the GPU).
    grads: ParamGrads,
}

impl VisionTransformer {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (d, p) = (cfg.hidden, cfg.patch_size);
        // As torchvision: conv_proj normal with std sqrt(1/fan_in) (torchvision truncates it at 2 std),
        // zero bias; position embeddings normal(std 0.02); class token zeros. Unlike torchvision, the
        // head starts as nn.Linear does rather than at zero: a zero head sends no gradient back, so the
        // first training steps would update the head alone.
        let conv_w = vb.get_with_hints(
            (d, 3, p, p),
            "conv_proj.weight",
            Init::Randn {
                mean: 0.0,
                stdev: (1.0 / (3 * p * p) as f64).sqrt(),
            },
        )?;
        let conv_b = vb.get_with_hints(d, "conv_proj.bias", Init::Const(0.0))?;
        let conv_proj = PatchEmbed::new(conv_w, conv_b)?;
        let class_token = vb.get_with_hints((1, 1, d), "class_token", Init::Const(0.0))?;
        let enc = vb.pp("encoder");
        let pos_embedding = enc.get_with_hints(
            (1, cfg.patches() + 1, d),
            "pos_embedding",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        let blocks = (0..cfg.layers)
            .map(|i| EncoderBlock::new(cfg, enc.pp(format!("layers.encoder_layer_{i}"))))
            .collect::<Result<_>>()?;
        let ln = LayerNorm::new(d, 1e-6, enc.pp("ln"))?;
        let head = torch_linear(d, cfg.num_classes, vb.pp("heads.head"))?;
        Ok(Self {
            conv_proj,
            class_token,
            pos_embedding,
            blocks,
            ln,
            head,
            grads: ParamGrads::default(),
        })
    }
}

impl VisionTransformer {
    /// The encoder blocks over x: as one op where `encoder::runs_as_one_op` (training on a GPU),
    /// else each built of ops.
    fn blocks(&self, x: Tensor) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        {
            use super::encoder::{self, Norms};
            let qkv: Vec<[&Linear; 1]> = self.blocks.iter().map(|b| [&b.in_proj]).collect();
            let params: Vec<_> = self.blocks.iter().zip(&qkv).map(|(b, q)| b.params(q)).collect();
            if encoder::runs_as_one_op(&x, &params) {
                return encoder::forward(&x, &params, self.blocks[0].heads, Norms::Pre, None, &self.grads);
            }
        }
        self.blocks.iter().try_fold(x, |x, b| b.forward(&x))
    }
}

impl Classifier for VisionTransformer {
    fn forward(&self, inputs: &Inputs, _train: bool) -> Result<Tensor> {
        let Inputs::Images(x) = inputs else {
            candle_core::bail!("a vision transformer takes images")
        };
        let b = x.dim(0)?;
        let patches = self.conv_proj.forward(x)?.flatten(1, 2)?; // [b, patches, d]
        let cls = self.class_token.broadcast_as((b, 1, patches.dim(2)?))?;
        let x = crate::kernels::add_repeating(&Tensor::cat(&[&cls, &patches], 1)?, &self.pos_embedding)?;
        // Not kept through the blocks (in inference nothing else holds it).
        drop(patches);
        let x = self.blocks(x)?;
        // The class token alone: layer norm is per token, so normalising it alone equals torchvision's
        // normalise-all-then-take.
        let cls = crate::kernels::first_position(&x)?;
        self.head.forward(&self.ln.forward(&cls)?)
    }

    fn param_grads(&self) -> Option<&ParamGrads> {
        Some(&self.grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_torchvision() {
        assert_eq!(Config::vit_b_16().params(), 86_567_656);
    }

    #[test]
    fn flops_within_two_percent_of_torchvision() {
        let ours = Config::vit_b_16().flops() as f64 / 2e9;
        assert!((ours / 17.56 - 1.0).abs() < 0.02, "{ours}");
    }
}
