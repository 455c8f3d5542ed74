//! A ResNet residual block as one edge of candle's graph, for training on CUDA devices built with
//! cuDNN, over NHWC (cuDNN's graph API, half types and TF32) or NCHW (its legacy calls and our 1x1
//! GEMMs: f32 without TF32).
//!
//! Why: candle's backward pass adds every edge's gradient into a freshly zeroed tensor, a memset and
//! a read-read-write pass per edge (see `models::encoder`). A bottleneck block built of our ops is
//! about twenty edges, most of them activation-sized (each convolution's input and filter, the
//! filter's KRSC copy, each batch norm's input and [weight; bias], the shortcut's add), and ResNet-50
//! has sixteen blocks: with the convolutions on cuDNN's NHWC engines, a step of blocks built of ops
//! ran at three quarters of the rate of one with each block as one op (measured:
//! docs/kernels.md#residual-block). As one op a block is one edge: its forward runs the units on
//! detached tensors and keeps what the backward reads; the backward runs each unit's batch norm and
//! convolution backward passes in reverse and adds once, where the main path and the shortcut meet.
//! The block's parameters (up to four convolutions and four batch norms) reach the optimizer
//! through [`ParamGrads`].
//!
//! The kernel option `layers=ops` builds the blocks of our ops instead, to compare the two in one
//! build.

use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor,
};

use super::encoder::Handover;
use super::layers::ConvBn;
use crate::kernels::batch_norm::BatchNorm;
use crate::kernels::conv_nhwc::{conv_nhwc_grads, conv_nhwc_train};
use crate::kernels::elementwise::cuda::{relu_grad, AddAct};
use crate::kernels::options::{EncoderLayers, KernelOptions};
use crate::kernels::{add, conv2d, conv2d::conv2d_grads};
use crate::optim::ParamGrads;

/// Whether [`forward`] runs a training step's block as one op: on a CUDA device, x recording a graph
/// (else the op would be left out of the backward pass, and with it the parameters' gradients),
/// unless the active kernel options say `layers=ops`.
pub fn runs_as_one_op(x: &Tensor) -> bool {
    x.device().is_cuda() && x.track_op() && KernelOptions::active().layers == EncoderLayers::Fused
}

/// One unit's parameters as the model holds them (the optimizer's keys), and detached copies for the
/// step: the filter (as KRSC over NHWC), batch norm's [weight; bias].
struct Unit {
    weight: Tensor,
    bn_weight: Tensor,
    bn_bias: Tensor,
    filter: Tensor,
    wb: Tensor,
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
        let wb = Tensor::stack(&[bn_weight.detach(), bn_bias.detach()], 0)?;
        Ok(Self {
            weight,
            bn_weight: bn_weight.clone(),
            bn_bias: bn_bias.clone(),
            filter,
            wb,
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

    /// conv, batch norm (its running statistics updated), ReLU when `relu`, on detached x.
    fn forward(&self, model: &ConvBn, x: &Tensor, relu: bool) -> Result<(Tensor, UnitSaved)> {
        let y = if self.channels_last {
            conv_nhwc_train(x, &self.filter, self.padding, self.stride)?
        } else {
            conv2d(x, &self.filter, self.padding, self.stride)?
        };
        let stats = model.bn.batch_stats(&y, self.channels_last)?;
        let out = y.apply_op3_no_bwd(&self.wb, &stats, &self.norm(relu))?;
        let kept = relu.then(|| out.clone());
        Ok((
            out,
            UnitSaved {
                x: x.clone(),
                y,
                stats,
                out: kept,
            },
        ))
    }

    /// The unit's input gradient (when asked) from its output's, its parameters' gradients pushed.
    fn backward(&self, s: &UnitSaved, g: &Tensor, input_grad: bool, grads: &ParamGrads) -> Result<Option<Tensor>> {
        // Batch norm's backward reads its output only through the ReLU.
        let out = s.out.as_ref().unwrap_or(&s.y);
        let (dy, dwb, _) = self.norm(s.out.is_some()).bwd(&s.y, &self.wb, &s.stats, out, g)?;
        let (Some(dy), Some(dwb)) = (dy, dwb) else {
            bail!("batch norm's backward pass returned no gradient")
        };
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
    /// The unit's output, where a ReLU ends it (its gradient reads it). Without a ReLU (a block's
    /// last unit and its projection) nothing is kept: those outputs, four times the block's width,
    /// are freed once the block has added them, as PyTorch frees them.
    out: Option<Tensor>,
}

struct Saved {
    path: Vec<UnitSaved>,
    shortcut: Option<UnitSaved>,
}

/// The block over x ([n, h, w, c] when `channels_last`, else [n, c, h, w]) as one op: `path` (ReLU
/// after each unit but the last), `shortcut` (a projection unit, or the identity when None),
/// relu(path(x) + shortcut(x)). The parameters' gradients are recorded in `grads` by the backward
/// pass. See [`runs_as_one_op`].
pub fn forward(
    x: &Tensor,
    path: &[ConvBn],
    shortcut: Option<&ConvBn>,
    channels_last: bool,
    grads: &ParamGrads,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let input = x.detach();
    let units: Vec<Unit> = path.iter().map(|u| Unit::of(u, channels_last)).collect::<Result<_>>()?;
    let projection = shortcut.map(|u| Unit::of(u, channels_last)).transpose()?;
    let mut h = input.clone();
    let mut saved_path = Vec::with_capacity(units.len());
    for (i, (unit, model)) in units.iter().zip(path).enumerate() {
        let (out, s) = unit.forward(model, &h, i + 1 < units.len())?;
        saved_path.push(s);
        h = out;
    }
    let (identity, saved_shortcut) = match (&projection, shortcut) {
        (Some(unit), Some(model)) => {
            let (out, s) = unit.forward(model, &input, false)?;
            (out, Some(s))
        }
        _ => (input.clone(), None),
    };
    let op = ResidualBlock {
        units,
        projection,
        grads: grads.clone(),
        branches: Handover::new((h, identity)),
        saved: Handover::new(Saved {
            path: saved_path,
            shortcut: saved_shortcut,
        }),
    };
    x.apply_op1(op)
}

struct ResidualBlock {
    units: Vec<Unit>,
    projection: Option<Unit>,
    grads: ParamGrads,
    /// The two branches' outputs until candle's forward adds them (into the storage it records,
    /// which the backward pass then reads for the ReLU's gradient: no copy of the output).
    branches: Handover<(Tensor, Tensor)>,
    /// The activations until the backward pass takes them.
    saved: Handover<Saved>,
}

impl ResidualBlock {
    fn backward(&self, s: &Saved, out: &Tensor, g: &Tensor) -> Result<Tensor> {
        // Through the final ReLU: the same gradient goes down both branches.
        let g = relu_grad(g, out)?;
        let mut d = g.clone();
        for (unit, saved) in self.units.iter().zip(&s.path).rev() {
            d = unit
                .backward(saved, &d, true, &self.grads)?
                .expect("the input's gradient was asked for");
        }
        let shortcut = match (&self.projection, &s.shortcut) {
            (Some(unit), Some(saved)) => unit
                .backward(saved, &g, true, &self.grads)?
                .expect("the input's gradient was asked for"),
            _ => g,
        };
        add(&d, &shortcut, false)
    }
}

impl CustomOp1 for ResidualBlock {
    fn name(&self) -> &'static str {
        "residual-block"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the residual block as one op runs on CUDA devices only; on the CPU ResNet is built of candle ops")
    }

    /// relu(path + shortcut) of the branches [`forward`] ran, written into the storage candle records.
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let (h, identity) = self.branches.take("the residual block's forward")?;
        let (hs, hl) = h.storage_and_layout();
        let (is, il) = identity.storage_and_layout();
        let (Storage::Cuda(hs), Storage::Cuda(is)) = (&*hs, &*is) else {
            bail!("the residual block's branches are not on the GPU")
        };
        AddAct { relu: true }.cuda_fwd(hs, hl, is, il)
    }

    fn bwd(&self, _x: &Tensor, out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let saved = self.saved.take("the residual block's backward")?;
        Ok(Some(self.backward(&saved, out, &grad.contiguous()?)?))
    }
}
