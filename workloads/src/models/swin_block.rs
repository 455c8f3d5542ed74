//! A Swin Transformer block as one edge of candle's graph, for training on CUDA devices: the cyclic
//! shift and window partition, the pre-norm encoder layer over windows with the relative position
//! bias (and the shifted-window mask) added to its scores, and the merge back into the map.
//!
//! Why: built of our ops a block is about twenty edges (the windows' gather and scatter, the layer
//! norms, the linear layers, the bias gathered from its table and masked), and candle's backward
//! pass adds every edge's gradient into a freshly zeroed tensor (see `models::encoder`): in Swin-T's
//! f32 training step those adds were a sixth of the GPU time, and the step ran at PyTorch eager's
//! rate rather than above it (measured: docs/kernels.md#swin-block).
//!
//! Every op between the partition and the merge but attention works token by token, so the whole
//! layer runs in window order: x is cut into windows once, the layer (`encoder::Layer`, pre-norm)
//! runs on them with the score bias, and its output is merged once; the backward pass cuts the
//! output's gradient into windows, runs the layer's backward, merges the input's gradient. The
//! table's gradient comes from the score bias's ([`RelativeBias::table_grad`]). Parameters reach
//! the optimizer through [`ParamGrads`], the table's with the rest.
//!
//! The kernel option `layers=ops` builds the blocks of our ops instead, to compare the two in one
//! build.

use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

use super::encoder::{Bias, Handover, Layer, Norms, Originals, Params, Saved};
use super::relative_bias::RelativeBias;
use crate::kernels::windows::cuda::Windows;
use crate::kernels::{window_merge, window_partition};
use crate::optim::ParamGrads;

/// Blocks run as one op in this process (see [`super::swin::blocks_run_as_one_op`]).
pub(super) static RUN: AtomicU64 = AtomicU64::new(0);

/// The block over the map x [b, side, side, c] as one op: windows of `window`² tokens after a cyclic
/// shift by `shift` (0: none), attention's scores biased by `relative` from `table` (the block's
/// relative position bias table, a parameter). The parameters' gradients are recorded in `grads` by
/// the backward pass. Run it where `encoder::runs_as_one_op` says a layer runs as one op.
pub(super) fn forward(
    x: &Tensor,
    p: &Params,
    table: &Tensor,
    relative: &RelativeBias,
    window: usize,
    shift: usize,
    grads: &ParamGrads,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let (_, side, _, _) = x.dims4()?;
    let scores = relative.scores(&table.detach())?.to_dtype(x.dtype())?;
    let layer = Layer::new(p, relative.heads, Norms::Pre, Bias::Scores(scores))?;
    let (out, mut saved) = layer.forward(&window_partition(&x.detach(), window, shift)?)?;
    // ln1's input is x in window order: the backward cuts it again from x, which candle keeps as
    // this op's input, rather than this op keeping a copy of it for the whole step.
    saved.norm1_in = None;
    let windows = Windows {
        side,
        window,
        shift,
        merge: true,
    };
    let op = SwinBlock {
        layer,
        params: Originals::of(p),
        table: table.clone(),
        relative: relative.clone(),
        windows,
        grads: grads.clone(),
        out: Handover::new(out),
        saved: Handover::new(saved),
    };
    RUN.fetch_add(1, Ordering::Relaxed);
    x.apply_op1(op)
}

struct SwinBlock {
    layer: Layer,
    params: Originals,
    table: Tensor,
    relative: RelativeBias,
    /// The merge of the layer's output into the map; the partition is its inverse.
    windows: Windows,
    grads: ParamGrads,
    /// The layer's output in window order, until candle's forward merges it into the map.
    out: Handover<Tensor>,
    saved: Handover<Saved>,
}

impl CustomOp1 for SwinBlock {
    fn name(&self) -> &'static str {
        "swin-block"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the Swin block as one op runs on CUDA devices only; on the CPU the block is built of candle ops")
    }

    /// The layer's output merged from windows into the storage candle records (the merge writes it:
    /// no copy of the output).
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = self.out.take("the Swin block's forward")?;
        let (storage, layout) = out.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!("the Swin block's output is not on the GPU")
        };
        self.windows.cuda_fwd(s, layout)
    }

    fn bwd(&self, x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut saved = self.saved.take("the Swin block's backward")?;
        let Windows {
            side, window, shift, ..
        } = self.windows;
        saved.norm1_in = Some(window_partition(&x.detach(), window, shift)?);
        let g = window_partition(&grad.contiguous()?, window, shift)?;
        let (dx, grads, dscores) = self.layer.backward(&saved, &g)?;
        drop(saved);
        let Some(dscores) = dscores else {
            bail!("the Swin block's attention returned no gradient for its score bias")
        };
        self.params.record(grads, &self.grads)?;
        self.grads.push(
            &self.table,
            self.relative.table_grad(&dscores)?.to_dtype(self.table.dtype())?,
        );
        Ok(Some(window_merge(&dx, side, window, shift)?))
    }
}
