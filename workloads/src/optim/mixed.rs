//! Mixed-precision training as PyTorch's autocast, Megatron and DeepSpeed train: the optimizer updates
//! f32 master weights and writes the bf16/f16 working copies the next forward and backward use, its
//! state kept in f32; in f16 the loss is scaled as `torch.amp.GradScaler` scales it.
//!
//! Why masters: an update smaller than half a bf16 step of the weight is rounded away when the weight
//! itself is bf16, so a long fine-tune at a small learning rate stalls; and the master copy (4 bytes a
//! parameter) is memory a user's training holds, which a slice must have.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

use super::OptimizerKind;
use crate::kernels::adamw::AdamStep;
use crate::kernels::masters::{self, Begin, End, Member, MixedState, ScaleReading, SgdStep, Update};

/// `torch.amp.GradScaler`'s defaults: the scale starts at 2¹⁶, halves on an inf or a nan (the step
/// skipped) and doubles after 2,000 good steps in a row.
pub const INITIAL_SCALE: f64 = 65_536.0;
pub const GROWTH_INTERVAL: u32 = 2_000;

/// One parameter: its working copy (the variable the model computes with) and its f32 state, the
/// optimizer's buffers followed by the master weights.
struct Param {
    var: Var,
    state: Tensor,
}

/// An optimizer over f32 master weights (see the module).
pub struct MixedOptimizer {
    params: Vec<Param>,
    kind: Kind,
    /// AdamW's count, the loss scale and the skip counters, on the device.
    state: MixedState,
    dynamic: bool,
}

#[derive(Clone, Copy)]
enum Kind {
    AdamW(AdamStep),
    Sgd(SgdStep),
}

impl Kind {
    /// f32 buffers of the parameter's size before its master: [m; v] or [b].
    fn buffers(self) -> usize {
        match self {
            Kind::AdamW(_) => AdamStep::BUFFERS,
            Kind::Sgd(_) => SgdStep::BUFFERS,
        }
    }
}

impl MixedOptimizer {
    /// `params` pairs each working copy with its value in f32 (drawn or read before it was rounded:
    /// `init::Originals`). A dynamic loss scale (f16) starts at [`INITIAL_SCALE`]; without one the
    /// scale is 1 and no step is skipped.
    pub fn new(
        kind: OptimizerKind,
        params: Vec<(Var, Tensor)>,
        lr: f64,
        weight_decay: f64,
        dynamic_scale: bool,
    ) -> Result<Self> {
        let kind = match kind {
            OptimizerKind::AdamW => Kind::AdamW(AdamStep {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
            }),
            OptimizerKind::Sgd { momentum } => Kind::Sgd(SgdStep {
                lr,
                momentum,
                weight_decay,
            }),
        };
        let device = match params.first() {
            Some((v, _)) => v.device().clone(),
            None => candle_core::Device::Cpu,
        };
        let params = params
            .into_iter()
            .map(|(var, original)| {
                if original.shape() != var.shape() {
                    candle_core::bail!(
                        "a master of shape {:?} for a parameter of {:?}",
                        original.dims(),
                        var.dims()
                    )
                }
                // Built on the host and uploaded once: one device buffer per parameter (see
                // `init::uploaded_var` for why not a device concatenation).
                let n = var.elem_count();
                let mut host = vec![0f32; kind.buffers() * n];
                host.extend(original.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
                let state = Tensor::from_vec(host, (kind.buffers() + 1) * n, var.device())?;
                Ok(Param { var, state })
            })
            .collect::<Result<Vec<_>>>()?;
        let scale = if dynamic_scale { INITIAL_SCALE } else { 1.0 };
        Ok(Self {
            params,
            kind,
            state: MixedState::new(scale, &device)?,
            dynamic: dynamic_scale,
        })
    }

    /// The loss the backward pass starts from: the loss times the scale, read on the device, in
    /// f32 as autocast computes a loss (2¹⁶ itself is past f16's largest value).
    pub(super) fn scaled(&self, loss: &Tensor) -> Result<Tensor> {
        if !self.dynamic {
            return Ok(loss.clone());
        }
        let scale = self.state.scale(DType::F32)?;
        loss.to_dtype(DType::F32)?.mul(&scale.broadcast_as(loss.shape())?)
    }

    /// One step from the gradients of the scaled loss: checked for an inf or a nan (with a dynamic
    /// scale), then every master updated and its working copy written, unless the check failed.
    pub(super) fn apply(&mut self, grads: &GradStore) -> Result<()> {
        // A parameter the loss does not reach keeps its value and state, as in PyTorch.
        let reached: Vec<(&Param, Tensor)> = self
            .params
            .iter()
            .filter_map(|p| grads.get(p.var.as_tensor()).map(|g| (p, g)))
            .map(|(p, g)| Ok((p, g.contiguous()?)))
            .collect::<Result<_>>()?;
        if self.dynamic {
            let grads: Vec<&Tensor> = reached.iter().map(|(_, g)| g).collect();
            masters::check_gradients(&grads, &self.state)?;
        }
        if let Kind::AdamW(s) = self.kind {
            self.state.tensor().inplace_op1(&Begin {
                beta1: s.beta1,
                beta2: s.beta2,
            })?;
        }
        let members: Vec<Member> = reached
            .iter()
            .map(|(p, g)| Member {
                state: &p.state,
                grad: g,
                theta: p.var.as_tensor(),
            })
            .collect();
        match self.kind {
            Kind::AdamW(s) => masters::update(s, &members, &self.state)?,
            Kind::Sgd(s) => masters::update(s, &members, &self.state)?,
        }
        self.state.tensor().inplace_op1(&End {
            dynamic: self.dynamic,
            interval: GROWTH_INTERVAL,
        })
    }

    /// The loss scale and the counts of skipped and attempted steps (synchronises with the device).
    pub fn reading(&self) -> Result<ScaleReading> {
        self.state.read()
    }

    /// Each parameter's master weights in f32, in the optimizer's order (the working copies' order).
    pub fn masters(&self) -> Result<Vec<Tensor>> {
        self.params
            .iter()
            .map(|p| {
                let n = p.var.elem_count();
                p.state.narrow(0, self.kind.buffers() * n, n)?.reshape(p.var.shape())
            })
            .collect()
    }

    /// The working copies, in the optimizer's order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.params.iter().map(|p| &p.var)
    }
}
