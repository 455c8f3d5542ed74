//! ResNet's residual blocks, all of them in a row, as one edge of candle's graph, for training on
//! CUDA devices built with cuDNN, over NHWC (cuDNN's graph API, half types and TF32) or NCHW (its
//! legacy calls and our 1x1 GEMMs: f32 without TF32).
//!
//! Why: candle's backward pass adds every edge's gradient into a freshly zeroed tensor, a memset and
//! a read-read-write pass per edge (see `models::encoder`). A bottleneck block built of our ops is
//! about twenty edges, most of them activation-sized (each convolution's input and filter, the
//! filter's KRSC copy, each batch norm's input and [weight; bias], the shortcut's add), and ResNet-50
//! has sixteen blocks: with the convolutions on cuDNN's NHWC engines, a step of blocks built of ops
//! ran at three quarters of the rate of one with each block as one op (measured:
//! docs/kernels.md#residual-block), and with each block an op of its own, each block's input was
//! still one edge (see [`forward`]). As one op the blocks are one edge: the forward runs the units
//! on detached tensors and keeps what the backward reads; the backward runs each unit's batch norm
//! and convolution backward passes in reverse and adds once per block, where its main path and its
//! shortcut meet. Forward, each block's last batch norm adds the shortcut and applies the ReLU in
//! its own pass. The blocks' parameters (up to four convolutions and four batch norms a block)
//! reach the optimizer through [`ParamGrads`].
//!
//! The kernel option `layers=ops` builds the blocks of our ops instead, to compare the two in one
//! build.

use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

use super::encoder::Handover;
use super::layers::ConvBn;
use crate::kernels::batch_norm::{BatchNorm, Normalize};
use crate::kernels::conv_nhwc::{conv_nhwc_grads, conv_nhwc_train};
use crate::kernels::elementwise::cuda::{relu_grad, relu_grad_of_sum};
use crate::kernels::options::{EncoderLayers, KernelOptions};
use crate::kernels::{add, conv2d, conv2d::conv2d_grads};
use crate::optim::ParamGrads;

/// Whether [`forward`] runs a training step's blocks as one op: on a CUDA device, x recording a
/// graph (else the op would be left out of the backward pass, and with it the parameters'
/// gradients; a model's parameters all train or none do), unless the active kernel options say
/// `layers=ops`.
pub fn runs_as_one_op(x: &Tensor) -> bool {
    x.device().is_cuda() && x.track_op() && KernelOptions::active().layers == EncoderLayers::Fused
}

/// One unit's parameters as the model holds them (the optimizer's keys), and detached copies for the
/// step: the filter (as KRSC over NHWC), batch norm's weight and bias (detached views of the same
/// buffers: no copy).
struct Unit {
    weight: Tensor,
    bn_weight: Tensor,
    bn_bias: Tensor,
    filter: Tensor,
    w: Tensor,
    b: Tensor,
    padding: usize,
    stride: usize,
    eps: f64,
    channels_last: bool,
}

impl Unit {
    fn of(unit: &ConvBn, channels_last: bool) -> Result<Self> {
        let (weight, padding, stride) = unit.parts()?;
        let (bn_weight, bn_bias, eps) = unit.bn.affine();
        let filter = if channels_last {
            crate::kernels::channels_last(&weight.detach())?
        } else {
            weight.detach()
        };
        Ok(Self {
            weight,
            bn_weight: bn_weight.clone(),
            bn_bias: bn_bias.clone(),
            filter,
            w: bn_weight.detach(),
            b: bn_bias.detach(),
            padding,
            stride,
            eps,
            channels_last,
        })
    }

    fn norm(&self, relu: bool) -> BatchNorm {
        BatchNorm {
            eps: self.eps,
            relu,
            channels_last: self.channels_last,
        }
    }

    /// The convolution over detached x and its output's batch statistics (the running statistics
    /// updated): what the unit keeps but its output.
    fn convolve(&self, model: &ConvBn, x: &Tensor) -> Result<UnitSaved> {
        let y = if self.channels_last {
            conv_nhwc_train(x, &self.filter, self.padding, self.stride)?
        } else {
            conv2d(x, &self.filter, self.padding, self.stride)?
        };
        let stats = model.bn.batch_stats(&y, self.channels_last)?;
        Ok(UnitSaved {
            x: x.clone(),
            y,
            stats,
            out: None,
        })
    }

    /// conv, batch norm, ReLU when `relu`, on detached x.
    fn forward(&self, model: &ConvBn, x: &Tensor, relu: bool) -> Result<(Tensor, UnitSaved)> {
        let mut s = self.convolve(model, x)?;
        let out = self.norm(relu).forward_with(&s.y, &self.w, &self.b, &s.stats, None)?;
        s.out = relu.then(|| out.clone());
        Ok((out, s))
    }

    /// The block's end after this unit's convolution: relu(batch norm(y) + shortcut) as one pass.
    fn finish(&self, s: &UnitSaved, shortcut: &Tensor) -> Finish {
        Finish {
            y: s.y.clone(),
            norm: self.norm(true).normalize(&self.w, &self.b, &s.stats, Some(shortcut)),
        }
    }

    /// The unit's input gradient (when asked) from its output's, its parameters' gradients pushed.
    fn backward(&self, s: &UnitSaved, g: &Tensor, input_grad: bool, grads: &ParamGrads) -> Result<Option<Tensor>> {
        // Batch norm's backward reads its output only through the ReLU.
        let out = s.out.as_ref().unwrap_or(&s.y);
        let (dy, dwb) = self
            .norm(s.out.is_some())
            .backward(&s.y, &self.w, &self.b, &s.stats, out, g)?;
        let (dx, dw) = if self.channels_last {
            let (dx, dw) = conv_nhwc_grads(&s.x, &self.filter, &dy, self.padding, self.stride, input_grad)?;
            // The filter's gradient back in the parameter's KCRS layout.
            (dx, crate::kernels::channels_first(&dw)?)
        } else {
            conv2d_grads(&s.x, &self.filter, &dy, self.padding, self.stride, input_grad)?
        };
        grads.push(&self.weight, dw);
        grads.push(&self.bn_weight, dwb.get(0)?);
        grads.push(&self.bn_bias, dwb.get(1)?);
        Ok(dx)
    }
}

/// What a unit's backward pass reads.
struct UnitSaved {
    x: Tensor,
    /// The convolution's output, batch norm's input.
    y: Tensor,
    stats: Tensor,
    /// The unit's output, where a ReLU ends it (its gradient reads it). Without a ReLU (the
    /// projection) nothing is kept: that output, four times the block's width, is freed once the
    /// block's last pass has added it, as PyTorch frees it. The path's last unit never writes its
    /// own output: its normalisation adds the shortcut and applies the block's ReLU in one pass.
    out: Option<Tensor>,
}

/// A block's last pass, relu(batch norm(y) + shortcut), not yet run: the last convolution's output
/// y and the normalisation holding the shortcut.
struct Finish {
    y: Tensor,
    norm: Normalize,
}

/// What one block's backward pass reads.
struct Saved {
    path: Vec<UnitSaved>,
    shortcut: Option<UnitSaved>,
}

/// One block's parameters as the model holds them: the main path's units (ReLU after each but the
/// last) and the projection, when the shapes change (else the shortcut is the identity).
pub struct BlockParams<'a> {
    pub path: &'a [ConvBn],
    pub shortcut: Option<&'a ConvBn>,
}

/// One block's units with the step's detached copies of their parameters.
struct Block {
    units: Vec<Unit>,
    projection: Option<Unit>,
}

impl Block {
    fn of(params: &BlockParams, channels_last: bool) -> Result<Self> {
        Ok(Self {
            units: params
                .path
                .iter()
                .map(|u| Unit::of(u, channels_last))
                .collect::<Result<_>>()?,
            projection: params.shortcut.map(|u| Unit::of(u, channels_last)).transpose()?,
        })
    }

    /// The block over detached `input` up to its last pass, which [`Finish`] holds: the shortcut,
    /// the path's units but the last one's normalisation.
    fn forward(&self, params: &BlockParams, input: &Tensor) -> Result<(Finish, Saved)> {
        // The shortcut first: the path's last normalisation adds it.
        let (identity, shortcut) = match (&self.projection, params.shortcut) {
            (Some(unit), Some(model)) => {
                let (out, s) = unit.forward(model, input, false)?;
                (out, Some(s))
            }
            _ => (input.clone(), None),
        };
        let (last, inner) = self.units.split_last().expect("a block has convolutions");
        let mut h = input.clone();
        let mut path = Vec::with_capacity(self.units.len());
        for (unit, model) in inner.iter().zip(params.path) {
            let (out, s) = unit.forward(model, &h, true)?;
            path.push(s);
            h = out;
        }
        let s = last.convolve(&params.path[inner.len()], &h)?;
        let finish = last.finish(&s, &identity);
        path.push(s);
        Ok((finish, Saved { path, shortcut }))
    }

    /// The input's gradient as its two parts, (through the path, through the shortcut), from `g`,
    /// the gradient already carried through the block's final ReLU; the parameters' gradients
    /// pushed to `grads`.
    fn backward(&self, s: &Saved, g: &Tensor, grads: &ParamGrads) -> Result<(Tensor, Tensor)> {
        let mut d = g.clone();
        for (unit, saved) in self.units.iter().zip(&s.path).rev() {
            d = unit
                .backward(saved, &d, true, grads)?
                .expect("the input's gradient was asked for");
        }
        let shortcut = match (&self.projection, &s.shortcut) {
            (Some(unit), Some(saved)) => unit
                .backward(saved, g, true, grads)?
                .expect("the input's gradient was asked for"),
            _ => g.clone(),
        };
        Ok((d, shortcut))
    }
}

/// Blocks one after another over x ([n, h, w, c] when `channels_last`, else [n, c, h, w]) as one
/// op: each block relu(path(x) + shortcut(x)). The parameters' gradients are recorded in `grads` by
/// the backward pass. See [`runs_as_one_op`].
///
/// Why a chain rather than an op per block: each op's input gradient is one more edge, a memset
/// and a `badd` pass over an activation (measured: docs/kernels.md#residual-block); between blocks
/// of one chain the gradient passes straight on, and the ReLU's gradient of one block is taken in
/// the same pass that adds the next block's two branches.
pub fn forward(x: &Tensor, blocks: &[BlockParams], channels_last: bool, grads: &ParamGrads) -> Result<Tensor> {
    let Some((last_params, inner_params)) = blocks.split_last() else {
        bail!("a chain of residual blocks needs at least one block")
    };
    let x = x.contiguous()?;
    let ran: Vec<Block> = blocks
        .iter()
        .map(|b| Block::of(b, channels_last))
        .collect::<Result<_>>()?;
    let mut input = x.detach();
    let mut saved = Vec::with_capacity(blocks.len());
    let mut outputs = Vec::with_capacity(inner_params.len());
    for (block, params) in ran.iter().zip(inner_params) {
        let (finish, s) = block.forward(params, &input)?;
        // On detached tensors: our kernel, no edge.
        input = finish.y.apply_op1_no_bwd(&finish.norm)?;
        outputs.push(input.clone());
        saved.push(s);
    }
    let (finish, s) = ran.last().expect("one block at least").forward(last_params, &input)?;
    saved.push(s);
    let op = ResidualBlocks {
        blocks: ran,
        grads: grads.clone(),
        finish: Handover::new(finish),
        saved: Handover::new((saved, outputs)),
    };
    x.apply_op1(op)
}

struct ResidualBlocks {
    blocks: Vec<Block>,
    grads: ParamGrads,
    /// The last block's last pass until candle's forward runs it (into the storage it records,
    /// which the backward pass then reads for the ReLU's gradient: no copy of the output).
    finish: Handover<Finish>,
    /// Each block's activations, and the output of every block but the last (the next block's
    /// input, held anyway), until the backward pass takes them.
    saved: Handover<(Vec<Saved>, Vec<Tensor>)>,
}

impl ResidualBlocks {
    fn backward(&self, mut saved: Vec<Saved>, mut outputs: Vec<Tensor>, out: &Tensor, g: &Tensor) -> Result<Tensor> {
        // Through the last block's ReLU: the same gradient goes down both of its branches.
        let mut g = relu_grad(g, out)?;
        for block in self.blocks.iter().rev() {
            let s = saved.pop().expect("a block's activations were kept");
            let (d, shortcut) = block.backward(&s, &g, &self.grads)?;
            // Each block's activations go as soon as its gradient is through them.
            drop(s);
            g = match outputs.pop() {
                // The branches meet at the block's input, the output of the block before: its
                // ReLU's gradient in the same pass.
                Some(below) => relu_grad_of_sum(&d, &shortcut, &below)?,
                None => add(&d, &shortcut, false)?,
            };
        }
        Ok(g)
    }
}

impl CustomOp1 for ResidualBlocks {
    fn name(&self) -> &'static str {
        "residual-blocks"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("residual blocks as one op run on CUDA devices only; on the CPU ResNet is built of candle ops")
    }

    /// The last block's last pass, relu(batch norm + shortcut), written into the storage candle
    /// records.
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let finish = self.finish.take("the residual blocks' forward")?;
        let (ys, yl) = finish.y.storage_and_layout();
        let Storage::Cuda(ys) = &*ys else {
            bail!("the residual block's last convolution is not on the GPU")
        };
        finish.norm.cuda_fwd(ys, yl)
    }

    fn bwd(&self, _x: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (saved, outputs) = self.saved.take("the residual blocks' backward")?;
        Ok(Some(self.backward(saved, outputs, out, &grad.contiguous()?)?))
    }
}
