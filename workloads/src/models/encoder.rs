//! Transformer encoder layers (ViT's pre-norm, BERT's post-norm), a model's whole stack of them, as
//! one edge of candle's graph, for training on CUDA devices.
//!
//! Why: candle's backward pass adds every edge's gradient into a freshly zeroed tensor, a memset and
//! a read-read-write pass (`badd`) per edge, and our ops cannot change that (`Tensor::op` is private
//! to candle). Built of our ops, a BERT-base layer is 29 edges, and a training step's `badd`s alone
//! took longer than the gap between our step and PyTorch's, whose GEMMs took as long as ours. As one
//! op the layers are one edge: its forward runs our kernels on detached tensors and keeps the
//! activations its backward reads; the backward below calls the same ops' backward passes in order,
//! adding only where two branches meet (the residual connections). Candle's custom ops take at most
//! three inputs and a layer has sixteen parameters, so the op holds them and hands their gradients to
//! the optimizer through [`ParamGrads`] rather than through the graph.
//! (measured: docs/kernels.md#encoder)
//!
//! The kernel option `layers=ops` builds the layers of our ops instead, to compare the two in one build.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::layers::{LayerNorm, Linear};
use crate::kernels::elementwise::cuda::Activation;
use crate::kernels::layer_norm;
use crate::kernels::linear::cuda::LinearOp;
use crate::kernels::options::{EncoderLayers, KernelOptions};
use crate::kernels::{add, attention, linear, linear_residual, Act, ScoreBias};
use crate::optim::ParamGrads;

/// Where a layer's two layer norms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norms {
    /// Inside the residual branches (ViT): x + attn(ln1(x)), then x + mlp(ln2(x)).
    Pre,
    /// After each residual add (BERT): ln1(x + attn(x)), then ln2(x + mlp(x)).
    Post,
}

/// One encoder layer's parameters as its model holds them; the MLP's activation is exact GELU.
pub struct Params<'a> {
    /// The q, k and v projections: one packed layer (ViT's `in_proj`) or several (BERT's query, key
    /// and value), stacked along the outputs in this order.
    pub qkv: &'a [&'a Linear],
    pub out: &'a Linear,
    pub norm1: &'a LayerNorm,
    pub fc1: &'a Linear,
    pub fc2: &'a Linear,
    pub norm2: &'a LayerNorm,
}

/// Whether [`forward`] runs layers with these parameters as one op: training (x and some parameter
/// record a graph) on a CUDA device, unless the active kernel options say `layers=ops`. An input
/// that records no graph would leave the op out of the backward pass, and with it the parameters'
/// gradients.
pub fn runs_as_one_op(x: &Tensor, layers: &[Params]) -> bool {
    let trains = |p: &Params| {
        p.qkv.iter().chain([&p.out, &p.fc1, &p.fc2]).any(|l| l.trains())
            || [p.norm1, p.norm2]
                .iter()
                .any(|n| n.weight().track_op() || n.bias().track_op())
    };
    let ops = KernelOptions::active().layers == EncoderLayers::Composed;
    x.device().is_cuda() && x.track_op() && layers.iter().any(trains) && !ops
}

/// Layers one after another over x [b, t, c] as one op, their parameters' gradients recorded in
/// `grads` by the backward pass; `mask` a [b, t] key mask in x's dtype (BERT's padding). See
/// [`runs_as_one_op`].
///
/// Why a chain rather than an op per layer: each op's input is one more edge (a memset and a `badd`
/// over an activation) and each op's output one more copy into the storage candle records; between
/// layers of one chain the gradient passes straight on (docs/kernels.md#encoder).
pub fn forward(
    x: &Tensor,
    layers: &[Params],
    heads: usize,
    norms: Norms,
    mask: Option<&Tensor>,
    grads: &ParamGrads,
) -> Result<Tensor> {
    if layers.is_empty() {
        bail!("a chain of encoder layers needs at least one layer")
    }
    let x = x.contiguous()?;
    let mask = mask.map(|m| m.detach().contiguous()).transpose()?;
    let mut h = x.detach();
    let mut ran = Vec::with_capacity(layers.len());
    let mut saved = Vec::with_capacity(layers.len());
    for p in layers {
        let bias = match &mask {
            Some(m) => Bias::Keys(m.clone()),
            None => Bias::None,
        };
        let layer = Layer::new(p, heads, norms, bias)?;
        let (out, s) = layer.forward(&h)?;
        saved.push(s);
        ran.push((layer, Originals::of(p)));
        h = out;
    }
    let op = EncoderStack {
        layers: ran,
        grads: grads.clone(),
        out: Handover::new(h),
        saved: Handover::new(saved),
    };
    x.apply_op1(op)
}

/// What a layer's attention adds to its scores.
pub(super) enum Bias {
    None,
    /// A [b, t] key mask in x's dtype (BERT's padding); it takes no gradient.
    Keys(Tensor),
    /// Per head, query and key, [r, h, t, t] repeating along the batch, in x's dtype (Swin's
    /// relative position bias and shifted-window mask); the backward pass returns its gradient.
    Scores(Tensor),
}

impl Bias {
    fn score_bias(&self) -> ScoreBias<'_> {
        match self {
            Bias::None => ScoreBias::None,
            Bias::Keys(m) => ScoreBias::Keys(m),
            Bias::Scores(s) => ScoreBias::Scores(s),
        }
    }
}

/// One layer on detached tensors: its forward keeps the activations its backward reads. The ops
/// that run a layer as one edge (this module's, `models::swin_block`'s) drive it.
pub(super) struct Layer {
    heads: usize,
    norms: Norms,
    bias: Bias,
    weights: Weights,
}

impl Layer {
    pub(super) fn new(p: &Params, heads: usize, norms: Norms, bias: Bias) -> Result<Self> {
        Ok(Self {
            heads,
            norms,
            bias,
            weights: Weights::of(p)?,
        })
    }
}

/// The parameters detached (sharing storage, recording nothing), q/k/v packed.
struct Weights {
    qkv: (Tensor, Tensor),
    out: (Tensor, Tensor),
    norm1: (Tensor, Tensor, f64),
    fc1: (Tensor, Tensor),
    fc2: (Tensor, Tensor),
    norm2: (Tensor, Tensor, f64),
}

fn linear_parts(l: &Linear) -> Result<(Tensor, Tensor)> {
    let Some(b) = l.bias() else {
        bail!("the fused encoder layer takes linear layers with biases")
    };
    Ok((l.weight().detach(), b.detach()))
}

fn norm_parts(n: &LayerNorm) -> (Tensor, Tensor, f64) {
    (n.weight().detach(), n.bias().detach(), n.eps())
}

/// What the backward pass reads: each op's input, named by its place in the layer.
pub(super) struct Saved {
    /// The q/k/v projection's input: x (post-norm) or ln1(x) (pre-norm).
    qkv_in: Tensor,
    qkv: Tensor,
    ctx: Tensor,
    /// ln1's input: x + attention (post-norm) or x (pre-norm). An op may keep x in another form
    /// between the passes and put it back before the backward (`models::swin_block` keeps the map
    /// its windows are cut from, which candle keeps anyway, rather than a copy in window order).
    pub(super) norm1_in: Option<Tensor>,
    /// fc1's input: ln1's output (post-norm) or ln2's (pre-norm).
    fc1_in: Tensor,
    /// fc1's output before GELU. Not the output after it, as wide: the backward recomputes it from
    /// this (one elementwise pass), which kept BERT-base's and ViT-B's bf16 training steps at or
    /// below PyTorch's device memory (docs/kernels.md#encoder).
    pre: Tensor,
    /// ln2's input: the MLP's residual sum (post-norm) or the attention's (pre-norm).
    norm2_in: Tensor,
}

impl Weights {
    fn of(p: &Params) -> Result<Self> {
        let parts = p.qkv.iter().map(|l| linear_parts(l)).collect::<Result<Vec<_>>>()?;
        let qkv = match parts.as_slice() {
            [one] => one.clone(),
            many => {
                let (w, b): (Vec<Tensor>, Vec<Tensor>) = many.iter().cloned().unzip();
                (Tensor::cat(&w, 0)?, Tensor::cat(&b, 0)?)
            }
        };
        Ok(Self {
            qkv,
            out: linear_parts(p.out)?,
            norm1: norm_parts(p.norm1),
            fc1: linear_parts(p.fc1)?,
            fc2: linear_parts(p.fc2)?,
            norm2: norm_parts(p.norm2),
        })
    }
}

impl Layer {
    /// The layer on detached x: (output, activations).
    pub(super) fn forward(&self, x: &Tensor) -> Result<(Tensor, Saved)> {
        let (heads, bias) = (self.heads, self.bias.score_bias());
        let w = &self.weights;
        let ((wq, bq), (wo, bo), (w1, b1), (w2, b2)) = (&w.qkv, &w.out, &w.fc1, &w.fc2);
        let (n1, n2) = (&w.norm1, &w.norm2);
        let mlp = |fc1_in: &Tensor| -> Result<(Tensor, Tensor)> {
            let pre = linear(fc1_in, w1, Some(b1), Act::None)?;
            let h = pre.apply_op1_no_bwd(&Activation(Act::GeluErf))?;
            Ok((pre, h))
        };
        Ok(match self.norms {
            Norms::Post => {
                let qkv = linear(x, wq, Some(bq), Act::None)?;
                let ctx = attention(&qkv, heads, bias)?;
                let norm1_in = linear_residual(&ctx, wo, bo, x)?;
                let fc1_in = layer_norm::layer_norm(&norm1_in, &n1.0, &n1.1, n1.2)?;
                let (pre, h) = mlp(&fc1_in)?;
                let norm2_in = linear_residual(&h, w2, b2, &fc1_in)?;
                let out = layer_norm::layer_norm(&norm2_in, &n2.0, &n2.1, n2.2)?;
                (
                    out,
                    Saved {
                        qkv_in: x.clone(),
                        qkv,
                        ctx,
                        norm1_in: Some(norm1_in),
                        fc1_in,
                        pre,
                        norm2_in,
                    },
                )
            }
            Norms::Pre => {
                let qkv_in = layer_norm::layer_norm(x, &n1.0, &n1.1, n1.2)?;
                let qkv = linear(&qkv_in, wq, Some(bq), Act::None)?;
                let ctx = attention(&qkv, heads, bias)?;
                let norm2_in = linear_residual(&ctx, wo, bo, x)?;
                let fc1_in = layer_norm::layer_norm(&norm2_in, &n2.0, &n2.1, n2.2)?;
                let (pre, h) = mlp(&fc1_in)?;
                let out = linear_residual(&h, w2, b2, &norm2_in)?;
                (
                    out,
                    Saved {
                        qkv_in,
                        qkv,
                        ctx,
                        norm1_in: Some(x.clone()),
                        fc1_in,
                        pre,
                        norm2_in,
                    },
                )
            }
        })
    }
}

/// The parameters themselves (the tensors the optimizer's gradients are keyed by), as [`Weights`]
/// lays them out: q/k/v parts in order.
pub(super) struct Originals {
    qkv: Vec<(Tensor, Tensor)>,
    rest: [(Tensor, Tensor); 5],
}

impl Originals {
    pub(super) fn of(p: &Params) -> Self {
        let lin = |l: &Linear| (l.weight().clone(), l.bias().expect("checked by Weights::of").clone());
        let norm = |n: &LayerNorm| (n.weight().clone(), n.bias().clone());
        Self {
            qkv: p.qkv.iter().map(|l| lin(l)).collect(),
            rest: [lin(p.out), norm(p.norm1), lin(p.fc1), lin(p.fc2), norm(p.norm2)],
        }
    }

    /// Hands the gradients to the optimizer, the packed q/k/v's split back into the model's parts.
    pub(super) fn record(&self, grads: Grads, sink: &ParamGrads) -> Result<()> {
        let parts = self.qkv.len();
        let rows = grads.qkv.0.dim(0)? / parts;
        for (i, (w, b)) in self.qkv.iter().enumerate() {
            sink.push(w, grads.qkv.0.narrow(0, i * rows, rows)?);
            sink.push(b, grads.qkv.1.narrow(0, i * rows, rows)?);
        }
        for ((w, b), (dw, db)) in self.rest.iter().zip(grads.rest) {
            sink.push(w, dw);
            sink.push(b, db);
        }
        Ok(())
    }
}

/// Gradients of one layer's (weight, bias).
type PairGrads = (Tensor, Tensor);

/// Gradients of the layer's parameters, as (weight, bias) pairs in [`Originals`]' order.
pub(super) struct Grads {
    qkv: PairGrads,
    rest: [PairGrads; 5],
}

/// A branch's input gradient and its two linear layers' parameter gradients (first, second).
type BranchGrads = (Tensor, PairGrads, PairGrads);

/// A value an op's forward made before candle records the op, taken once by candle's call that
/// reads it (its forward takes the output, its backward the activations).
pub(super) struct Handover<T>(Mutex<Option<T>>);

impl<T> Handover<T> {
    pub(super) fn new(value: T) -> Self {
        Self(Mutex::new(Some(value)))
    }

    /// The value; an error names `what` if it was taken before (the pass ran twice).
    pub(super) fn take(&self, what: &str) -> Result<T> {
        match self.0.lock().expect("no panic while holding the lock").take() {
            Some(v) => Ok(v),
            None => bail!("{what} ran twice"),
        }
    }
}

/// The storage candle records as an op's output: the whole contiguous buffer of `out`, copied.
pub(super) fn output_storage(out: &Tensor, what: &str) -> Result<(CudaStorage, Shape)> {
    let (storage, layout) = out.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("{what}'s output is not on the GPU")
    };
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        bail!("{what}'s output is not a whole contiguous buffer")
    }
    Ok((s.try_clone(layout)?, layout.shape().clone()))
}

struct EncoderStack {
    /// Each layer and its parameters as the model holds them.
    layers: Vec<(Layer, Originals)>,
    grads: ParamGrads,
    /// The last layer's output until candle's forward takes it.
    out: Handover<Tensor>,
    /// Each layer's activations until the backward pass takes them.
    saved: Handover<Vec<Saved>>,
}

/// (dx, dw, db) of a linear layer without activation whose input was x.
fn linear_grads(x: &Tensor, (w, b): &(Tensor, Tensor), grad: &Tensor) -> Result<(Tensor, PairGrads)> {
    // The op reads its output only for an activation's gradient: none here, any tensor of its shape.
    let op = LinearOp { act: Act::None };
    match op.bwd(x, w, b, grad, grad)? {
        (Some(dx), Some(dw), Some(db)) => Ok((dx, (dw, db))),
        _ => bail!("the linear op's backward pass returned no gradient"),
    }
}

/// (dx, dw, db) of a layer norm whose input was x.
fn norm_grads(x: &Tensor, (w, b, eps): &(Tensor, Tensor, f64), grad: &Tensor) -> Result<(Tensor, PairGrads)> {
    let op = layer_norm::LayerNorm { eps: *eps };
    match op.bwd(x, w, b, grad, grad)? {
        (Some(dx), Some(dw), Some(db)) => Ok((dx, (dw, db))),
        _ => bail!("the layer norm op's backward pass returned no gradient"),
    }
}

impl Layer {
    /// dx, the parameters' gradients and, for [`Bias::Scores`], the score bias's, from the output's
    /// gradient g.
    pub(super) fn backward(&self, s: &Saved, g: &Tensor) -> Result<(Tensor, Grads, Option<Tensor>)> {
        let w = &self.weights;
        let Some(norm1_in) = &s.norm1_in else {
            bail!("the encoder layer's backward ran without ln1's input")
        };
        // The MLP from the gradient of its output, to the gradient of its input.
        let mlp = |dh_out: &Tensor| -> Result<BranchGrads> {
            let h = s.pre.apply_op1_no_bwd(&Activation(Act::GeluErf))?;
            let (dh, fc2) = linear_grads(&h, &w.fc2, dh_out)?;
            drop(h);
            // GELU's gradient reads its input alone: the pre-activation stands in for the output.
            let dpre = Activation(Act::GeluErf)
                .bwd(&s.pre, &s.pre, &dh)?
                .expect("GELU has a gradient");
            let (dfc1_in, fc1) = linear_grads(&s.fc1_in, &w.fc1, &dpre)?;
            Ok((dfc1_in, fc1, fc2))
        };
        // Attention from the gradient of its output projection's output to that of q/k/v's input
        // (and the score bias's).
        let attn = |dctx_out: &Tensor| -> Result<(BranchGrads, Option<Tensor>)> {
            let (dctx, out) = linear_grads(&s.ctx, &w.out, dctx_out)?;
            let (dqkv, dbias) = attention::grads(&s.qkv, self.heads, self.bias.score_bias(), &dctx)?;
            let (dqkv_in, qkv) = linear_grads(&s.qkv_in, &w.qkv, &dqkv)?;
            Ok(((dqkv_in, qkv, out), dbias))
        };
        Ok(match self.norms {
            Norms::Post => {
                let (dnorm2_in, norm2) = norm_grads(&s.norm2_in, &w.norm2, g)?;
                let (dfc1_in, fc1, fc2) = mlp(&dnorm2_in)?;
                // ln1's output fed fc1 and the MLP's residual connection.
                let (dnorm1_in, norm1) = norm_grads(norm1_in, &w.norm1, &add(&dnorm2_in, &dfc1_in, false)?)?;
                let ((dx_attn, qkv, out), dbias) = attn(&dnorm1_in)?;
                // x fed the projection and the attention's residual connection.
                let dx = add(&dnorm1_in, &dx_attn, false)?;
                (
                    dx,
                    Grads {
                        qkv,
                        rest: [out, norm1, fc1, fc2, norm2],
                    },
                    dbias,
                )
            }
            Norms::Pre => {
                let (dfc1_in, fc1, fc2) = mlp(g)?;
                let (dnorm2_in, norm2) = norm_grads(&s.norm2_in, &w.norm2, &dfc1_in)?;
                // x + attn(..) fed ln2 and the MLP's residual connection.
                let dmid = add(g, &dnorm2_in, false)?;
                let ((dqkv_in, qkv, out), dbias) = attn(&dmid)?;
                let (dx_norm, norm1) = norm_grads(norm1_in, &w.norm1, &dqkv_in)?;
                let dx = add(&dmid, &dx_norm, false)?;
                (
                    dx,
                    Grads {
                        qkv,
                        rest: [out, norm1, fc1, fc2, norm2],
                    },
                    dbias,
                )
            }
        })
    }
}

impl CustomOp1 for EncoderStack {
    fn name(&self) -> &'static str {
        "encoder-layers"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the fused encoder layers run on CUDA devices only; on the CPU each layer is built of candle ops")
    }

    /// The output computed by [`forward`], copied into the storage candle records.
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        output_storage(
            &self.out.take("the fused encoder layers' forward")?,
            "the fused encoder layers",
        )
    }

    fn bwd(&self, _x: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut saved = self.saved.take("the fused encoder layers' backward")?;
        let mut g = grad.contiguous()?;
        for (layer, params) in self.layers.iter().rev() {
            let s = saved.pop().expect("each layer's activations were kept");
            let (dx, grads, _) = layer.backward(&s, &g)?;
            // Each layer's activations go as soon as its gradient is through them.
            drop(s);
            params.record(grads, &self.grads)?;
            g = dx;
        }
        Ok(Some(g))
    }
}
