//! Swin Transformer v1 (Liu et al. 2021) as torchvision builds it: a 4x4 patch embedding, stages of
//! window attention with a relative position bias, every second block on windows shifted by half a
//! window (with the mask that keeps wrapped-around regions apart), patch merging between stages.
//! Feature maps are channels-last, [batch, height, width, channels]. Parameter names follow
//! torchvision's `swin_*` state dicts (`relative_position_index` is recomputed, not loaded).

use candle_core::{Device, Result, Tensor};
use candle_nn::{Init, Module, VarBuilder};

use super::layers::{LayerNorm, Linear, PatchEmbed};
use super::relative_bias::RelativeBias;
use super::{Classifier, Inputs};
use crate::kernels::{add, window_merge, window_partition, Act};
use crate::kernels::{attention, ScoreBias};
use crate::optim::ParamGrads;

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub image_size: usize,
    pub patch_size: usize,
    pub embed_dim: usize,
    /// Blocks per stage; the channels double and the side halves from one stage to the next.
    pub depths: Vec<usize>,
    pub heads: Vec<usize>,
    pub window: usize,
    pub num_classes: usize,
}

impl Config {
    fn preset(embed_dim: usize, depths: [usize; 4], heads: [usize; 4]) -> Self {
        Self {
            image_size: 224,
            patch_size: 4,
            embed_dim,
            depths: depths.to_vec(),
            heads: heads.to_vec(),
            window: 7,
            num_classes: 1000,
        }
    }
    pub fn swin_t() -> Self {
        Self::preset(96, [2, 2, 6, 2], [3, 6, 12, 24])
    }
    pub fn swin_s() -> Self {
        Self::preset(96, [2, 2, 18, 2], [3, 6, 12, 24])
    }
    pub fn swin_b() -> Self {
        Self::preset(128, [2, 2, 18, 2], [4, 8, 16, 32])
    }
    /// Test size: 32x32 images in 2x2 patches (16x16 tokens), two stages of 4x4 windows, 10 classes.
    pub fn tiny() -> Self {
        Self {
            image_size: 32,
            patch_size: 2,
            embed_dim: 16,
            depths: vec![2, 2],
            heads: vec![2, 4],
            window: 4,
            num_classes: 10,
        }
    }

    /// (channels, side) of each stage's feature map.
    fn stages(&self) -> Vec<(usize, usize)> {
        let side = self.image_size / self.patch_size;
        (0..self.depths.len())
            .map(|i| (self.embed_dim << i, side >> i))
            .collect()
    }

    fn features(&self) -> usize {
        self.embed_dim << (self.depths.len() - 1)
    }

    fn table_rows(&self) -> usize {
        (2 * self.window - 1).pow(2)
    }

    pub fn params(&self) -> u64 {
        let p = self.patch_size;
        let embed = self.embed_dim * 3 * p * p + self.embed_dim + 2 * self.embed_dim;
        let mut total = embed;
        let last = self.depths.len() - 1;
        for (i, &(c, _)) in self.stages().iter().enumerate() {
            let block = 2 * c
                + (3 * c * c + 3 * c)
                + (c * c + c)
                + self.table_rows() * self.heads[i]
                + 2 * c
                + (4 * c * c + 4 * c)
                + (4 * c * c + c);
            total += self.depths[i] * block;
            if i < last {
                total += 2 * 4 * c + 4 * c * 2 * c; // merging: LayerNorm(4c), Linear(4c -> 2c) without bias
            }
        }
        (total + 2 * self.features() + self.features() * self.num_classes + self.num_classes) as u64
    }

    /// Forward FLOPs per image, 2 per multiply-add: patch embedding; per block, over L tokens of C
    /// channels in windows of N tokens, QKV and output projections and the MLP (12·L·C²) and the
    /// windowed attention (2·L·N·C); patch merging (2·L·C² per stage); the head.
    pub fn flops(&self) -> u64 {
        let n = self.window * self.window;
        let (c0, side0) = self.stages()[0];
        let mut macs = side0 * side0 * c0 * 3 * self.patch_size * self.patch_size;
        let last = self.depths.len() - 1;
        for (i, &(c, side)) in self.stages().iter().enumerate() {
            let l = side * side;
            macs += self.depths[i] * (12 * l * c * c + 2 * l * n.min(l) * c);
            if i < last {
                macs += 2 * l * c * c;
            }
        }
        2 * (macs + self.features() * self.num_classes) as u64
    }
}

/// torchvision initialises every Linear of Swin with normal(std 0.02) weights truncated at ±2 (that is,
/// at 100 std: never in practice), and zero biases; we draw the plain normal.
fn swin_linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let w = vb.get_with_hints((out_dim, in_dim), "weight", Init::Randn { mean: 0.0, stdev: 0.02 })?;
    let b = if bias {
        Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?)
    } else {
        None
    };
    Ok(Linear::new(w, b))
}

/// For every pair of positions (i, j) in a window of `w`x`w`, the row of the relative position bias
/// table holding their offset: (dy + w - 1) * (2w - 1) + (dx + w - 1), row-major as torchvision.
pub fn relative_position_index(w: usize) -> Vec<u32> {
    let n = w * w;
    let mut index = Vec::with_capacity(n * n);
    for i in 0..n {
        for j in 0..n {
            let dy = (i / w) as isize - (j / w) as isize + w as isize - 1;
            let dx = (i % w) as isize - (j % w) as isize + w as isize - 1;
            index.push((dy * (2 * w as isize - 1) + dx) as u32);
        }
    }
    index
}

/// [w⁴, (2w - 1)²] f32 one-hot rows: row i selects the table row `relative_position_index(w)[i]`.
pub fn position_gather(w: usize, device: &Device) -> Result<Tensor> {
    let rows = (2 * w - 1).pow(2);
    let mut one_hot = vec![0f32; w.pow(4) * rows];
    for (i, &at) in relative_position_index(w).iter().enumerate() {
        one_hot[i * rows + at as usize] = 1.0;
    }
    Tensor::from_vec(one_hot, (w.pow(4), rows), device)
}

/// The mask of shifted-window attention for a `side`x`side` map in windows of `w` shifted by `shift`:
/// [windows, w², w²], 0 where two positions come from the same region of the unshifted map and -100
/// where the cyclic shift brought them together from different regions (torchvision's values).
pub fn shifted_window_mask(side: usize, w: usize, shift: usize) -> Vec<f32> {
    // Label each position by the region it came from: three bands in each direction.
    let band = |p: usize| {
        if p < side - w {
            0
        } else if p < side - shift {
            1
        } else {
            2
        }
    };
    let label = |y: usize, x: usize| 3 * band(y) + band(x);
    let per_side = side / w;
    let mut mask = Vec::with_capacity(per_side * per_side * w.pow(4));
    for wy in 0..per_side {
        for wx in 0..per_side {
            let labels: Vec<usize> = (0..w * w).map(|k| label(wy * w + k / w, wx * w + k % w)).collect();
            for a in &labels {
                for b in &labels {
                    mask.push(if a == b { 0.0 } else { -100.0 });
                }
            }
        }
    }
    mask
}

/// How many Swin blocks this process has run as one op (training on CUDA devices, unless the
/// kernel options say `layers=ops`): how a test knows which path a step took.
pub fn blocks_run_as_one_op() -> u64 {
    #[cfg(feature = "cuda")]
    return super::swin_block::RUN.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(feature = "cuda"))]
    0
}

struct Block {
    norm1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    /// [(2w - 1)², heads]: one bias per relative position and head.
    bias_table: Tensor,
    relative: RelativeBias,
    norm2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    window: usize,
    /// The cyclic shift (0 when the block does not shift).
    shift: usize,
}

impl Block {
    /// `gather`: [`position_gather`] of the window, in the model's dtype, shared by every block.
    fn new(
        c: usize,
        side: usize,
        heads: usize,
        shifted: bool,
        gather: &Tensor,
        cfg: &Config,
        vb: VarBuilder,
    ) -> Result<Self> {
        let w = cfg.window;
        if !side.is_multiple_of(w) {
            candle_core::bail!("swin: a {side}x{side} feature map does not split into {w}x{w} windows")
        }
        let attn = vb.pp("attn");
        let bias_table = attn.get_with_hints(
            (cfg.table_rows(), heads),
            "relative_position_bias_table",
            Init::Randn { mean: 0.0, stdev: 0.02 },
        )?;
        // As torchvision: no shift when one window covers the whole map.
        let shift = if shifted && w < side { w / 2 } else { 0 };
        let mask = if shift > 0 {
            let mask = Tensor::from_vec(
                shifted_window_mask(side, w, shift),
                ((side / w).pow(2), 1, w * w, w * w),
                &Device::Cpu,
            )?;
            Some(mask.to_device(bias_table.device())?.to_dtype(bias_table.dtype())?)
        } else {
            None
        };
        Ok(Self {
            norm1: LayerNorm::new(c, 1e-5, vb.pp("norm1"))?,
            qkv: swin_linear(c, 3 * c, true, attn.pp("qkv"))?,
            proj: swin_linear(c, c, true, attn.pp("proj"))?,
            bias_table,
            relative: RelativeBias::new(gather.clone(), mask, heads, w * w),
            norm2: LayerNorm::new(c, 1e-5, vb.pp("norm2"))?,
            fc1: swin_linear(c, 4 * c, true, vb.pp("mlp.0"))?,
            fc2: swin_linear(4 * c, c, true, vb.pp("mlp.3"))?,
            window: w,
            shift,
        })
    }

    fn forward(&self, x: &Tensor, grads: &ParamGrads) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        {
            use super::encoder::{self, Params};
            let p = Params {
                qkv: &[&self.qkv],
                out: &self.proj,
                norm1: &self.norm1,
                fc1: &self.fc1,
                fc2: &self.fc2,
                norm2: &self.norm2,
            };
            if encoder::runs_as_one_op(x, std::slice::from_ref(&p)) {
                return super::swin_block::forward(
                    x,
                    &p,
                    &self.bias_table,
                    &self.relative,
                    self.window,
                    self.shift,
                    grads,
                );
            }
        }
        let _ = grads;
        let x = add(x, &self.window_attention(&self.norm1.forward(x)?)?, false)?;
        let h = self.fc1.forward_act(&self.norm2.forward(&x)?, Act::GeluErf)?;
        self.fc2.forward_residual(&h, &x)
    }

    fn window_attention(&self, x: &Tensor) -> Result<Tensor> {
        let (_, side, _, _) = x.dims4()?;
        let (w, shift) = (self.window, self.shift);
        // Each activation is dropped once used (in inference nothing else holds them): the windows
        // once projected, the context once projected again.
        let ctx = {
            let windows = window_partition(x, w, shift)?; // [b * windows, w², c]
            let bias = self.relative.scores(&self.bias_table)?;
            attention(
                &self.qkv.forward(&windows)?,
                self.relative.heads,
                ScoreBias::Scores(&bias),
            )?
        };
        let out = self.proj.forward(&ctx)?;
        drop(ctx);
        window_merge(&out, side, w, shift)
    }
}

/// Halves the side and doubles the channels: 2x2 neighbours concatenated (in torchvision's order
/// x[0::2, 0::2], x[1::2, 0::2], x[0::2, 1::2], x[1::2, 1::2]), normalised, projected.
struct PatchMerging {
    norm: LayerNorm,
    reduction: Linear,
}

impl PatchMerging {
    fn new(c: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm: LayerNorm::new(4 * c, 1e-5, vb.pp("norm"))?,
            reduction: swin_linear(4 * c, 2 * c, false, vb.pp("reduction"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.reduction
            .forward(&self.norm.forward(&crate::kernels::merge_neighbours(x)?)?)
    }
}

pub struct Swin {
    patch_embed: PatchEmbed,
    embed_norm: LayerNorm,
    stages: Vec<(Vec<Block>, Option<PatchMerging>)>,
    norm: LayerNorm,
    head: Linear,
    grads: ParamGrads,
}

impl Swin {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let (c0, p) = (cfg.embed_dim, cfg.patch_size);
        // nn.Conv2d's default init: uniform in ±1/sqrt(fan_in) for weight and bias.
        let bound = 1.0 / ((3 * p * p) as f64).sqrt();
        let init = Init::Uniform { lo: -bound, up: bound };
        let f = vb.pp("features");
        let conv_w = f.get_with_hints((c0, 3, p, p), "0.0.weight", init)?;
        let conv_b = f.get_with_hints(c0, "0.0.bias", init)?;
        let patch_embed = PatchEmbed::new(conv_w, conv_b)?;
        let embed_norm = LayerNorm::new(c0, 1e-5, f.pp("0.2"))?;
        let last = cfg.depths.len() - 1;
        // One constant for every block: they share the window size.
        let gather = position_gather(cfg.window, vb.device())?.to_dtype(vb.dtype())?;
        let mut stages = Vec::new();
        for (i, &(c, side)) in cfg.stages().iter().enumerate() {
            // features.0 is the embedding; stage i is features.(2i+1), its merging features.(2i+2).
            let blocks = (0..cfg.depths[i])
                .map(|j| {
                    Block::new(
                        c,
                        side,
                        cfg.heads[i],
                        j % 2 == 1,
                        &gather,
                        cfg,
                        f.pp(format!("{}.{j}", 2 * i + 1)),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let merge = if i < last {
                Some(PatchMerging::new(c, f.pp(format!("{}", 2 * i + 2)))?)
            } else {
                None
            };
            stages.push((blocks, merge));
        }
        let norm = LayerNorm::new(cfg.features(), 1e-5, vb.pp("norm"))?;
        let head = swin_linear(cfg.features(), cfg.num_classes, true, vb.pp("head"))?;
        Ok(Self {
            patch_embed,
            embed_norm,
            stages,
            norm,
            head,
            grads: ParamGrads::default(),
        })
    }
}

impl Classifier for Swin {
    fn forward(&self, inputs: &Inputs, _train: bool) -> Result<Tensor> {
        let Inputs::Images(x) = inputs else {
            candle_core::bail!("Swin takes images")
        };
        // Channels last; the embedding is not kept beside its normalised copy.
        let mut x = self.embed_norm.forward(&self.patch_embed.forward(x)?)?;
        for (blocks, merge) in &self.stages {
            for block in blocks {
                x = block.forward(&x, &self.grads)?;
            }
            if let Some(m) = merge {
                x = m.forward(&x)?;
            }
        }
        self.head
            .forward(&crate::kernels::global_average_pool(&self.norm.forward(&x)?)?)
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
        assert_eq!(Config::swin_t().params(), 28_288_354);
        assert_eq!(Config::swin_s().params(), 49_606_258);
        assert_eq!(Config::swin_b().params(), 87_768_224);
    }

    #[test]
    fn flops_within_two_percent_of_torchvision() {
        for (cfg, gmacs) in [
            (Config::swin_t(), 4.49),
            (Config::swin_s(), 8.74),
            (Config::swin_b(), 15.43),
        ] {
            let ours = cfg.flops() as f64 / 2e9;
            assert!((ours / gmacs - 1.0).abs() < 0.02, "{ours} vs {gmacs}");
        }
    }

    #[test]
    fn the_one_hot_gather_selects_what_the_index_selects() -> Result<()> {
        let w: usize = 3;
        let rows = (2 * w - 1).pow(2);
        let table = Tensor::arange(0f32, (rows * 2) as f32, &Device::Cpu)?.reshape((rows, 2))?;
        let index = Tensor::from_vec(relative_position_index(w), w.pow(4), &Device::Cpu)?;
        let want = table.index_select(&index, 0)?.flatten_all()?.to_vec1::<f32>()?;
        let got = position_gather(w, &Device::Cpu)?
            .matmul(&table)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(got, want);
        Ok(())
    }

    #[test]
    fn the_table_gradient_is_the_score_bias_gradient_carried_back_as_autograd_carries_it() -> Result<()> {
        // Window 2 (4 tokens, 9 table rows), 3 heads; with the mask of a 4x4 map shifted by 1 (four
        // windows) and without. The block as one op computes the table's gradient by hand from the
        // score bias's; candle's autograd through `scores` is the reference.
        let (w, heads, dev) = (2usize, 3usize, Device::Cpu);
        let table = candle_core::Var::from_tensor(&Tensor::randn(0f32, 1., ((2 * w - 1).pow(2), heads), &dev)?)?;
        let gather = position_gather(w, &dev)?;
        let mask = Tensor::from_vec(shifted_window_mask(4, w, 1), (4, 1, w * w, w * w), &dev)?;
        for mask in [None, Some(mask)] {
            let relative = RelativeBias::new(gather.clone(), mask.clone(), heads, w * w);
            let scores = relative.scores(table.as_tensor())?;
            let windows = if mask.is_some() { 4 } else { 1 };
            assert_eq!(scores.dims(), [windows, heads, w * w, w * w]);
            let r = Tensor::randn(0f32, 1., scores.shape(), &dev)?;
            let want = (&scores * &r)?
                .sum_all()?
                .backward()?
                .get(table.as_tensor())
                .unwrap()
                .flatten_all()?
                .to_vec1::<f32>()?;
            let got = relative.table_grad(&r)?.flatten_all()?.to_vec1::<f32>()?;
            for (g, e) in got.iter().zip(&want) {
                assert!(
                    (g - e).abs() <= 1e-5 * e.abs().max(1.0),
                    "windows {windows}: {got:?} against {want:?}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn relative_position_index_of_a_2x2_window() {
        // Positions (0,0), (0,1), (1,0), (1,1); row = (dy + 1) * 3 + (dx + 1).
        assert_eq!(
            relative_position_index(2),
            vec![4, 3, 1, 0, 5, 4, 2, 1, 7, 6, 4, 3, 8, 7, 5, 4]
        );
    }

    #[test]
    fn shifted_window_mask_of_a_4x4_map_by_hand() {
        // Window 2, shift 1. Regions of the rolled map (rows then columns: [0,2), [2,3), [3,4)):
        //   0 0 1 2
        //   0 0 1 2
        //   3 3 4 5
        //   6 6 7 8
        // Window 0 holds {0,0,0,0}: nothing masked. Window 1 holds {1,2,1,2}, window 2 {3,3,6,6},
        // window 3 {4,5,7,8}: pairs from different regions get -100.
        let m = shifted_window_mask(4, 2, 1);
        assert_eq!(m.len(), 4 * 16);
        let x = -100.0;
        let window = |k: usize| m[16 * k..16 * (k + 1)].to_vec();
        assert_eq!(window(0), vec![0.0; 16]);
        assert_eq!(window(1), vec![0., x, 0., x, x, 0., x, 0., 0., x, 0., x, x, 0., x, 0.]);
        assert_eq!(window(2), vec![0., 0., x, x, 0., 0., x, x, x, x, 0., 0., x, x, 0., 0.]);
        assert_eq!(window(3), vec![0., x, x, x, x, 0., x, x, x, x, 0., x, x, x, x, 0.]);
    }
}
