//! ResNet (He et al. 2015) as torchvision builds it: v1.5, with the stride on the 3x3 convolution of
//! the bottleneck. Parameter names follow torchvision's `resnet*` state dicts.

use candle_core::{Result, Tensor};
use candle_nn::{Module, VarBuilder};

use super::layers::{torch_linear, BatchNorm2d, ConvBn, Linear};
use super::{Classifier, Inputs};
use crate::init::KAIMING_NORMAL_FAN_OUT;
use crate::kernels::add_over;
use crate::kernels::max_pool2d;
use crate::optim::ParamGrads;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Block {
    /// Two 3x3 convolutions (ResNet-18/34).
    Basic,
    /// 1x1 → 3x3 → 1x1 with a 4x wider output (ResNet-50/101/152).
    Bottleneck,
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub block: Block,
    /// Blocks in each of the four stages.
    pub layers: [usize; 4],
    /// Channels of the stem and of the first stage (64 in the published models).
    pub width: usize,
    pub num_classes: usize,
    pub image_size: usize,
}

impl Config {
    fn preset(block: Block, layers: [usize; 4]) -> Self {
        Self {
            block,
            layers,
            width: 64,
            num_classes: 1000,
            image_size: 224,
        }
    }
    pub fn resnet18() -> Self {
        Self::preset(Block::Basic, [2, 2, 2, 2])
    }
    pub fn resnet34() -> Self {
        Self::preset(Block::Basic, [3, 4, 6, 3])
    }
    pub fn resnet50() -> Self {
        Self::preset(Block::Bottleneck, [3, 4, 6, 3])
    }
    pub fn resnet101() -> Self {
        Self::preset(Block::Bottleneck, [3, 4, 23, 3])
    }
    pub fn resnet152() -> Self {
        Self::preset(Block::Bottleneck, [3, 8, 36, 3])
    }
    /// The architecture at test size: one basic block a stage, 8 channels, 32x32 inputs, 10 classes.
    pub fn tiny() -> Self {
        Self {
            block: Block::Basic,
            layers: [1, 1, 1, 1],
            width: 8,
            num_classes: 10,
            image_size: 32,
        }
    }

    /// Every residual block in order, with its shapes: the one walk both the builder and the counters
    /// use, so that the counted architecture is the built one.
    fn blocks(&self) -> Vec<BlockShape> {
        let mut shapes = Vec::new();
        let mut in_ch = self.width;
        for (stage, &count) in self.layers.iter().enumerate() {
            let planes = self.width << stage;
            let out_ch = planes * self.block.expansion();
            for i in 0..count {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                let downsample = i == 0 && (stride != 1 || in_ch != out_ch);
                shapes.push(BlockShape {
                    stage,
                    index: i,
                    in_ch,
                    planes,
                    out_ch,
                    stride,
                    downsample,
                });
                in_ch = out_ch;
            }
        }
        shapes
    }

    fn features(&self) -> usize {
        (self.width << 3) * self.block.expansion()
    }

    /// Every convolution as (in, out, kernel, stride, padding) with the side of its input, in order.
    fn convs(&self) -> Vec<(ConvShape, usize)> {
        let mut out = Vec::new();
        let stem = ConvShape {
            cin: 3,
            cout: self.width,
            k: 7,
            stride: 2,
            pad: 3,
        };
        let mut side = self.image_size;
        out.push((stem, side));
        side = stem.out_side(side);
        side = (side + 2 - 3) / 2 + 1; // 3x3/2 max-pool, padding 1
        for b in self.blocks() {
            // The projection sees the block's input; each path conv the previous one's output.
            if let Some(p) = b.projection() {
                out.push((p, side));
            }
            for conv in b.path(self.block) {
                out.push((conv, side));
                side = conv.out_side(side);
            }
        }
        out
    }

    /// Trainable parameters: convolution weights, batch-norm scale and shift, the classifier.
    pub fn params(&self) -> u64 {
        let convs: usize = self.convs().iter().map(|(c, _)| c.cin * c.cout * c.k * c.k).sum();
        let bns: usize = 2 * self.width
            + self
                .blocks()
                .iter()
                .map(|b| b.bn_channels(self.block).iter().map(|c| 2 * c).sum::<usize>())
                .sum::<usize>();
        let fc = self.features() * self.num_classes + self.num_classes;
        (convs + bns + fc) as u64
    }

    /// Forward FLOPs per image: 2 per multiply-add of every convolution and of the classifier.
    /// Batch norm, ReLU, pooling and the residual additions (under 1% together) are not counted,
    /// as in torchvision's published GFLOPs, which count a multiply-add once.
    pub fn flops(&self) -> u64 {
        let convs: usize = self
            .convs()
            .iter()
            .map(|(c, side)| {
                let o = c.out_side(*side);
                c.cin * c.cout * c.k * c.k * o * o
            })
            .sum();
        2 * (convs + self.features() * self.num_classes) as u64
    }
}

#[derive(Debug, Clone, Copy)]
struct ConvShape {
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
}

impl ConvShape {
    fn out_side(&self, side: usize) -> usize {
        (side + 2 * self.pad - self.k) / self.stride + 1
    }

    /// The convolution (its weight from `conv`) and its batch norm (from `bn`), as torchvision names them.
    fn unit(&self, conv: VarBuilder, bn: VarBuilder) -> Result<ConvBn> {
        let weight = conv.get_with_hints((self.cout, self.cin, self.k, self.k), "weight", KAIMING_NORMAL_FAN_OUT)?;
        Ok(ConvBn::new(
            weight,
            self.pad,
            self.stride,
            BatchNorm2d::new(self.cout, bn)?,
        ))
    }
}

#[derive(Debug, Clone, Copy)]
struct BlockShape {
    stage: usize,
    index: usize,
    in_ch: usize,
    planes: usize,
    out_ch: usize,
    stride: usize,
    downsample: bool,
}

impl BlockShape {
    /// The main path's convolutions, in the order of their names (conv1, conv2[, conv3]).
    fn path(&self, block: Block) -> Vec<ConvShape> {
        match block {
            Block::Basic => vec![
                conv(self.in_ch, self.planes, 3, self.stride),
                conv(self.planes, self.planes, 3, 1),
            ],
            Block::Bottleneck => vec![
                conv(self.in_ch, self.planes, 1, 1),
                conv(self.planes, self.planes, 3, self.stride),
                conv(self.planes, self.out_ch, 1, 1),
            ],
        }
    }

    /// The 1x1 projection (`downsample`) on the shortcut, when the block changes shape.
    fn projection(&self) -> Option<ConvShape> {
        self.downsample.then(|| conv(self.in_ch, self.out_ch, 1, self.stride))
    }

    /// Channels of every batch norm in the block (one after each convolution).
    fn bn_channels(&self, block: Block) -> Vec<usize> {
        self.path(block)
            .iter()
            .chain(self.projection().as_ref())
            .map(|c| c.cout)
            .collect()
    }
}

/// A convolution padded to keep the side (before striding), as ResNet's are.
fn conv(cin: usize, cout: usize, k: usize, stride: usize) -> ConvShape {
    ConvShape {
        cin,
        cout,
        k,
        stride,
        pad: k / 2,
    }
}

/// One residual block: the main path's (conv, bn) pairs, and the projection when shapes change.
struct Residual {
    path: Vec<ConvBn>,
    downsample: Option<ConvBn>,
}

impl Residual {
    fn new(shape: &BlockShape, block: Block, vb: VarBuilder) -> Result<Self> {
        let downsample = match shape.projection() {
            Some(c) => {
                let vb = vb.pp("downsample");
                Some(c.unit(vb.pp("0"), vb.pp("1"))?)
            }
            None => None,
        };
        let path = shape
            .path(block)
            .iter()
            .enumerate()
            .map(|(i, c)| c.unit(vb.pp(format!("conv{}", i + 1)), vb.pp(format!("bn{}", i + 1))))
            .collect::<Result<_>>()?;
        Ok(Self { path, downsample })
    }

    /// Over NCHW, built of ops (see [`ResNet::train_blocks`] for a training step's blocks as one).
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.of_units(x, |unit, h, relu| unit.forward(h, train, relu))
    }

    #[cfg(feature = "cudnn")]
    fn params(&self) -> super::residual::BlockParams<'_> {
        super::residual::BlockParams {
            path: &self.path,
            shortcut: self.downsample.as_ref(),
        }
    }

    /// relu(path(x) + shortcut(x)), each unit run by `run(unit, its input, relu)`; ReLU after each
    /// unit of the path but the last.
    fn of_units(&self, x: &Tensor, run: impl Fn(&ConvBn, &Tensor, bool) -> Result<Tensor>) -> Result<Tensor> {
        let mut h = x.clone();
        let last = self.path.len() - 1;
        for (i, unit) in self.path.iter().enumerate() {
            h = run(unit, &h, i < last)?;
        }
        let identity = match &self.downsample {
            Some(unit) => run(unit, x, false)?,
            None => x.clone(),
        };
        // In inference the shortcut is added over the path's output, which nothing else holds
        // (`add_over` adds into a new tensor where a gradient is recorded).
        add_over(h, &identity, true)
    }

    /// Inference over NHWC: the last convolution adds the shortcut and applies the ReLU in its
    /// epilogue.
    #[cfg(feature = "cudnn")]
    fn forward_nhwc(&self, x: &Tensor) -> Result<Tensor> {
        let identity = match &self.downsample {
            Some(unit) => unit.forward_nhwc(x, None, false)?,
            None => x.clone(),
        };
        let (last, inner) = self.path.split_last().expect("a block has convolutions");
        let mut h = x.clone();
        for unit in inner {
            h = unit.forward_nhwc(&h, None, true)?;
        }
        last.forward_nhwc(&h, Some(&identity), true)
    }

    /// Training over NHWC built of ops: as [`Self::forward`], the activations channels-last.
    #[cfg(feature = "cudnn")]
    fn forward_nhwc_train(&self, x: &Tensor) -> Result<Tensor> {
        self.of_units(x, |unit, h, relu| unit.forward_nhwc_train(h, relu))
    }

    fn units(&self) -> impl Iterator<Item = &ConvBn> {
        self.path.iter().chain(self.downsample.as_ref())
    }
}

pub struct ResNet {
    stem: ConvBn,
    blocks: Vec<Residual>,
    fc: Linear,
    /// Where blocks run as one op record their parameters' gradients (training on a GPU).
    grads: ParamGrads,
}

impl ResNet {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let stem = ConvShape {
            cin: 3,
            cout: cfg.width,
            k: 7,
            stride: 2,
            pad: 3,
        };
        let stem = stem.unit(vb.pp("conv1"), vb.pp("bn1"))?;
        let blocks = cfg
            .blocks()
            .iter()
            .map(|b| Residual::new(b, cfg.block, vb.pp(format!("layer{}.{}", b.stage + 1, b.index))))
            .collect::<Result<_>>()?;
        let fc = torch_linear(cfg.features(), cfg.num_classes, vb.pp("fc"))?;
        Ok(Self {
            stem,
            blocks,
            fc,
            grads: ParamGrads::default(),
        })
    }
}

impl ResNet {
    /// Whether this step runs over NHWC: on a CUDA device with cuDNN, in a dtype that gains from it
    /// ([`crate::kernels::conv_nhwc::runs_nhwc`]), the kernel options asking for it, and either
    /// training ([`Self::forward_nhwc_train`]) or inference on frozen units ([`Self::forward_nhwc`]);
    /// inference on weights that train (batch norm from running statistics, unfolded) stays NCHW.
    #[cfg(feature = "cudnn")]
    fn runs_nhwc(&self, x: &Tensor, train: bool) -> bool {
        use crate::kernels::options::{Convolutions, KernelOptions};
        x.device().is_cuda()
            && crate::kernels::conv_nhwc::runs_nhwc(x.dtype())
            && KernelOptions::active().convs == Convolutions::Nhwc
            && (train || self.units().all(ConvBn::frozen))
    }

    /// Every unit's folded weights, KRSC when `krsc`, before the first activation (see
    /// `ConvBn::folded`); nothing when any unit trains (its path does not fold).
    fn fold_units(&self, dtype: candle_core::DType, krsc: bool) -> Result<()> {
        if self.units().all(ConvBn::frozen) {
            for unit in self.units() {
                unit.folded(dtype, krsc)?;
            }
        }
        Ok(())
    }

    /// Every convolution unit: the stem's, then each block's.
    fn units(&self) -> impl Iterator<Item = &ConvBn> {
        std::iter::once(&self.stem).chain(self.blocks.iter().flat_map(|b| b.units()))
    }

    /// A training step's blocks over x, as one op where [`super::residual::runs_as_one_op`] (else
    /// `block` runs each, built of ops).
    #[cfg(feature = "cudnn")]
    fn train_blocks(
        &self,
        x: Tensor,
        channels_last: bool,
        block: impl Fn(&Residual, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if super::residual::runs_as_one_op(&x) {
            let params: Vec<_> = self.blocks.iter().map(Residual::params).collect();
            return super::residual::forward(&x, &params, channels_last, &self.grads);
        }
        self.blocks.iter().try_fold(x, |x, b| block(b, &x))
    }

    /// A training step over NHWC: batch norm over NHWC after every convolution, the shortcut added
    /// (with the ReLU) by our kernel.
    #[cfg(feature = "cudnn")]
    fn forward_nhwc_train(&self, x: &Tensor) -> Result<Tensor> {
        self.channels_last(
            x,
            |stem, x| stem.forward_nhwc_train(x, true),
            |x| self.train_blocks(x, true, Residual::forward_nhwc_train),
        )
    }

    /// Inference over NHWC: every convolution fused with its batch norm, shortcut and ReLU.
    #[cfg(feature = "cudnn")]
    fn forward_nhwc(&self, x: &Tensor) -> Result<Tensor> {
        self.fold_units(x.dtype(), true)?;
        self.channels_last(
            x,
            |stem, x| stem.forward_nhwc(x, None, true),
            |x| self.blocks.iter().try_fold(x, |x, b| b.forward_nhwc(&x)),
        )
    }

    /// The model over NHWC: the images transposed once, then `stem`, the pool, `blocks`, and the
    /// global average read channels-last, then the classifier.
    #[cfg(feature = "cudnn")]
    fn channels_last(
        &self,
        x: &Tensor,
        stem: impl Fn(&ConvBn, &Tensor) -> Result<Tensor>,
        blocks: impl Fn(Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        // Each activation is dropped once the next is made (in inference nothing else holds it): a
        // shadowed binding would keep the transposed images and the stem's output, the largest
        // activation, alive through the whole forward pass.
        let stem_out = stem(&self.stem, &crate::kernels::channels_last(x)?)?;
        let x = crate::kernels::max_pool::max_pool2d_nhwc(&stem_out, 3, 2, 1)?;
        drop(stem_out);
        let x = blocks(x)?;
        self.fc.forward(&crate::kernels::global_average_pool(&x)?)
    }
}

impl Classifier for ResNet {
    fn param_grads(&self) -> Option<&ParamGrads> {
        Some(&self.grads)
    }

    fn forward(&self, inputs: &Inputs, train: bool) -> Result<Tensor> {
        let Inputs::Images(x) = inputs else {
            candle_core::bail!("ResNet takes images")
        };
        #[cfg(feature = "cudnn")]
        if self.runs_nhwc(x, train) {
            return if train {
                self.forward_nhwc_train(x)
            } else {
                self.forward_nhwc(x)
            };
        }
        if !train {
            self.fold_units(x.dtype(), false)?;
        }
        // The stem's output, the largest activation, not kept through the blocks (see
        // `channels_last`).
        let x = max_pool2d(&self.stem.forward(x, train, true)?, 3, 2, 1)?;
        #[cfg(feature = "cudnn")]
        let x = if train {
            self.train_blocks(x, false, |b, x| b.forward(x, true))?
        } else {
            self.blocks.iter().try_fold(x, |x, b| b.forward(&x, false))?
        };
        #[cfg(not(feature = "cudnn"))]
        let x = self.blocks.iter().try_fold(x, |x, b| b.forward(&x, train))?;
        // Global average pool, then the classifier.
        let x = x.mean((2, 3))?;
        self.fc.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_torchvision() {
        assert_eq!(Config::resnet18().params(), 11_689_512);
        assert_eq!(Config::resnet34().params(), 21_797_672);
        assert_eq!(Config::resnet50().params(), 25_557_032);
        assert_eq!(Config::resnet101().params(), 44_549_160);
        assert_eq!(Config::resnet152().params(), 60_192_808);
    }

    #[test]
    fn flops_within_two_percent_of_torchvision() {
        // torchvision's GFLOPS column counts a multiply-add once.
        for (cfg, gmacs) in [
            (Config::resnet18(), 1.81),
            (Config::resnet34(), 3.66),
            (Config::resnet50(), 4.09),
            (Config::resnet101(), 7.80),
            (Config::resnet152(), 11.51),
        ] {
            let ours = cfg.flops() as f64 / 2e9;
            assert!((ours / gmacs - 1.0).abs() < 0.02, "{cfg:?}: {ours} vs {gmacs}");
        }
    }

    #[test]
    fn resnet50_has_the_v1_5_stride_on_the_3x3() {
        let b = Config::resnet50().blocks()[3]; // layer2.0
        assert_eq!((b.stage, b.index, b.stride), (1, 0, 2));
        let convs = b.path(Block::Bottleneck);
        assert_eq!((convs[0].k, convs[0].stride), (1, 1));
        assert_eq!((convs[1].k, convs[1].stride), (3, 2));
    }
}
