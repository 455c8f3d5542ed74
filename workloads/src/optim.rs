//! Optimizers of the training workloads, with PyTorch's semantics: AdamW on our two-pass kernel
//! (`kernels::adamw`), and SGD with momentum, which candle's SGD lacks and PyTorch users' ResNet
//! recipes use; in bf16 and f16, over f32 master weights by default (`mixed`).

mod mixed;

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use crate::kernels::adamw::{adam_state, moments_dtype, AdamAdvance, AdamApply, AdamMoments, AdamStep};
pub use crate::kernels::masters::ScaleReading;
pub use mixed::{MixedOptimizer, GROWTH_INTERVAL, INITIAL_SCALE};

/// Whether bf16 and f16 training keeps f32 master weights, as PyTorch's autocast, Megatron and
/// DeepSpeed do (the default), or trains the half-precision weights themselves. f32 and f64 training
/// has no separate masters: its weights are already the optimizer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MasterWeights {
    /// f32 masters updated by the optimizer, bf16/f16 working copies written from them; in f16 a
    /// dynamic loss scale (`torch.amp.GradScaler`'s).
    #[default]
    F32,
    /// The bf16/f16 weights updated in place (AdamW's moments still f32); no loss scale.
    None,
}

impl MasterWeights {
    pub const ALL: [MasterWeights; 2] = [MasterWeights::F32, MasterWeights::None];

    pub fn as_str(self) -> &'static str {
        match self {
            MasterWeights::F32 => "f32",
            MasterWeights::None => "none",
        }
    }

    /// Whether training in `dtype` keeps separate masters with this choice.
    pub fn kept_for(self, dtype: candle_core::DType) -> bool {
        self == MasterWeights::F32 && matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16)
    }
}

impl std::str::FromStr for MasterWeights {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|m| m.as_str()).collect();
            format!("unknown master weights '{s}': choose one of {}", names.join(", "))
        })
    }
}

/// Which optimizer a training workload uses, with PyTorch's semantics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// `torch.optim.AdamW` (betas 0.9, 0.999; eps 1e-8).
    AdamW,
    /// `torch.optim.SGD` with momentum (dampening 0, no Nesterov).
    Sgd { momentum: f64 },
}

pub enum Optimizer {
    AdamW(AdamW),
    Sgd(SgdMomentum),
    /// Over f32 master weights (bf16 and f16 training).
    Mixed(MixedOptimizer),
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, vars: Vec<Var>, lr: f64, weight_decay: f64) -> Result<Self> {
        Ok(match kind {
            OptimizerKind::AdamW => Self::AdamW(AdamW::new(vars, lr, weight_decay)?),
            OptimizerKind::Sgd { momentum } => Self::Sgd(SgdMomentum::new(vars, lr, momentum, weight_decay)?),
        })
    }

    /// Back-propagates `loss` and updates every parameter, with the gradients that the backward
    /// pass recorded in `outside` added to the graph's.
    pub fn backward_step(&mut self, loss: &Tensor, outside: Option<&ParamGrads>) -> Result<()> {
        match self {
            Self::AdamW(o) => o.apply(&gradients(loss, outside)?),
            Self::Sgd(o) => o.apply(&gradients(loss, outside)?),
            Self::Mixed(o) => {
                let grads = gradients(&o.scaled(loss)?, outside)?;
                o.apply(&grads)
            }
        }
    }

    /// The loss scale and skipped steps of a mixed-precision optimizer; `None` for the others.
    pub fn scale_reading(&self) -> Result<Option<ScaleReading>> {
        match self {
            Self::Mixed(o) => o.reading().map(Some),
            _ => Ok(None),
        }
    }
}

/// Gradients of parameters computed outside candle's graph, handed to the optimizer with the
/// graph's: an op that holds its parameters instead of taking them as inputs (candle's custom ops
/// take at most three; an encoder layer has sixteen parameters, see `models::encoder`) pushes them
/// here from its backward pass.
#[derive(Debug, Clone, Default)]
pub struct ParamGrads(Arc<Mutex<Vec<(Tensor, Tensor)>>>);

impl ParamGrads {
    /// Records `grad` as (a part of) the gradient of the parameter `param`.
    pub fn push(&self, param: &Tensor, grad: Tensor) {
        self.0
            .lock()
            .expect("no panic while holding the lock")
            .push((param.clone(), grad));
    }

    /// Drops what an earlier forward pass left without a backward pass (a failed step).
    pub fn clear(&self) {
        self.0.lock().expect("no panic while holding the lock").clear();
    }

    /// Moves every recorded gradient into `grads`, added to the graph's own for the same parameter.
    pub fn drain_into(&self, grads: &mut GradStore) -> Result<()> {
        for (param, grad) in self.0.lock().expect("no panic while holding the lock").drain(..) {
            let sum = match grads.get(&param) {
                Some(g) => (g + grad)?,
                None => grad,
            };
            grads.insert(&param, sum);
        }
        Ok(())
    }
}

/// The graph's gradients of `loss`, and those recorded outside it.
fn gradients(loss: &Tensor, outside: Option<&ParamGrads>) -> Result<GradStore> {
    let mut grads = loss.backward()?;
    if let Some(outside) = outside {
        outside.drain_into(&mut grads)?;
    }
    Ok(grads)
}

/// `torch.optim.AdamW(lr, betas=(0.9, 0.999), eps=1e-8, weight_decay)`, its moments [m; v] kept in
/// f32 (f64 for f64 parameters) whatever the parameters' dtype. Every state is updated in place and
/// the step count lives on the device, so that a training step's CUDA graph replays right.
pub struct AdamW {
    vars: Vec<(Var, Tensor)>,
    step: AdamStep,
    /// [t, 1 - β1ᵗ, 1 - β2ᵗ] (see `adam_state`).
    state: Tensor,
}

impl AdamW {
    pub fn new(vars: Vec<Var>, lr: f64, weight_decay: f64) -> Result<Self> {
        let vars: Vec<(Var, Tensor)> = vars
            .into_iter()
            .map(|v| {
                let moments = Tensor::zeros(2 * v.elem_count(), moments_dtype(v.dtype()), v.device())?;
                Ok((v, moments))
            })
            .collect::<Result<_>>()?;
        let device = match vars.first() {
            Some((v, _)) => v.device().clone(),
            None => candle_core::Device::Cpu,
        };
        let state = adam_state(&device)?;
        Ok(Self {
            vars,
            step: AdamStep {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay,
            },
            state,
        })
    }

    fn apply(&mut self, grads: &GradStore) -> Result<()> {
        self.state.inplace_op1(&AdamAdvance(self.step))?;
        for (var, moments) in &self.vars {
            // A parameter the loss does not reach keeps its value and moments, as in PyTorch.
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            moments.inplace_op2(&g.contiguous()?, &AdamMoments(self.step))?;
            var.as_tensor()
                .inplace_op3(moments, &self.state, &AdamApply(self.step))?;
        }
        Ok(())
    }
}

/// `torch.optim.SGD(momentum=m, weight_decay=wd)`: g += wd·p; b = g on the first step, then
/// b = m·b + g; p -= lr·b. The momentum buffers start at zero, so that m·b + g is also the first
/// step's b = g, and are updated in place, as the parameters are: a training step's CUDA graph then
/// replays right.
pub struct SgdMomentum {
    vars: Vec<Var>,
    /// One per parameter; none without momentum.
    buffers: Vec<Option<Var>>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
}

impl SgdMomentum {
    pub fn new(vars: Vec<Var>, lr: f64, momentum: f64, weight_decay: f64) -> Result<Self> {
        let buffers = vars
            .iter()
            .map(|v| {
                if momentum != 0.0 {
                    Var::zeros(v.shape(), v.dtype(), v.device()).map(Some)
                } else {
                    Ok(None)
                }
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            vars,
            buffers,
            lr,
            momentum,
            weight_decay,
        })
    }

    fn apply(&mut self, grads: &GradStore) -> Result<()> {
        for (var, buffer) in self.vars.iter().zip(&self.buffers) {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = if self.weight_decay != 0.0 {
                (g + (var.as_tensor() * self.weight_decay)?)?
            } else {
                g.clone()
            };
            let step = match buffer {
                Some(b) => {
                    b.set(&((b.as_tensor() * self.momentum)? + g)?)?;
                    b.as_tensor().clone()
                }
                None => g,
            };
            var.set(&(var.as_tensor() - (&step * self.lr)?)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// AdamW as `torch.optim.AdamW` writes it, by hand in f64: the reference for the kernel.
    fn adamw_by_hand(p0: &[f64], grads: &[Vec<f64>], lr: f64, wd: f64) -> Vec<f64> {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        let (mut p, mut m, mut v) = (p0.to_vec(), vec![0.0; p0.len()], vec![0.0; p0.len()]);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            for i in 0..p.len() {
                p[i] *= 1.0 - lr * wd;
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                p[i] -= lr * (m[i] / (1.0 - b1.powi(t))) / ((v[i] / (1.0 - b2.powi(t))).sqrt() + eps);
            }
        }
        p
    }

    #[test]
    fn adamw_follows_pytorch_by_hand_over_three_steps() -> Result<()> {
        // loss = sum(c · p²) with a different c per element: gradients 2 c p change every step.
        let c = [1.0f64, -0.5, 3.0, 0.25];
        for dtype in [candle_core::DType::F64, candle_core::DType::F32] {
            let p0 = [0.5f64, -1.5, 2.0, 0.1];
            let p = Var::from_tensor(&Tensor::new(&p0, &Device::Cpu)?.to_dtype(dtype)?)?;
            let weights = Tensor::new(&c, &Device::Cpu)?.to_dtype(dtype)?;
            let mut opt = Optimizer::new(OptimizerKind::AdamW, vec![p.clone()], 0.1, 0.01)?;
            let mut grads = Vec::new();
            for _ in 0..3 {
                let now = p.as_tensor().to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
                grads.push(now.iter().zip(&c).map(|(p, c)| 2.0 * c * p).collect::<Vec<_>>());
                opt.backward_step(&(p.as_tensor().sqr()? * &weights)?.sum_all()?, None)?;
            }
            let want = adamw_by_hand(&p0, &grads, 0.1, 0.01);
            let got = p.as_tensor().to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?;
            let tol = if dtype == candle_core::DType::F64 { 1e-12 } else { 1e-5 };
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < tol, "{dtype:?}: {got:?} vs {want:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn adamw_leaves_a_parameter_without_gradient_alone() -> Result<()> {
        let (used, unused) = (Var::new(&[1f32], &Device::Cpu)?, Var::new(&[2f32], &Device::Cpu)?);
        let mut opt = Optimizer::new(OptimizerKind::AdamW, vec![used.clone(), unused.clone()], 0.1, 0.01)?;
        opt.backward_step(&used.as_tensor().sum_all()?, None)?;
        assert_eq!(unused.as_tensor().to_vec1::<f32>()?, vec![2.0]);
        assert!(used.as_tensor().to_vec1::<f32>()?[0] < 1.0);
        Ok(())
    }

    #[test]
    fn sgd_momentum_follows_pytorch_by_hand() -> Result<()> {
        // loss = sum(p²), grad 2p. lr 0.1, momentum 0.9:
        // step 1: b = [2, 4], p = [0.8, 1.6]; step 2: g = [1.6, 3.2], b = [3.4, 6.8], p = [0.46, 0.92].
        let p = Var::new(&[1f32, 2.], &Device::Cpu)?;
        let mut opt = Optimizer::new(OptimizerKind::Sgd { momentum: 0.9 }, vec![p.clone()], 0.1, 0.0)?;
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?, None)?;
        let v = p.as_tensor().to_vec1::<f32>()?;
        assert!((v[0] - 0.8).abs() < 1e-6 && (v[1] - 1.6).abs() < 1e-6, "{v:?}");
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?, None)?;
        let v = p.as_tensor().to_vec1::<f32>()?;
        assert!((v[0] - 0.46).abs() < 1e-6 && (v[1] - 0.92).abs() < 1e-6, "{v:?}");
        Ok(())
    }

    #[test]
    fn sgd_weight_decay_adds_to_the_gradient() -> Result<()> {
        // loss = sum(p) (grad 1), wd 0.5, lr 0.1: g = 1 + 0.5·p = 2 for p = 2, so p = 1.8.
        let p = Var::new(&[2f32], &Device::Cpu)?;
        let mut opt = Optimizer::new(OptimizerKind::Sgd { momentum: 0.9 }, vec![p.clone()], 0.1, 0.5)?;
        opt.backward_step(&p.as_tensor().sum_all()?, None)?;
        assert!((p.as_tensor().to_vec1::<f32>()?[0] - 1.8).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn gradients_recorded_outside_the_graph_join_the_graphs() -> Result<()> {
        // loss = sum(p²): the graph gives p 2p; outside, p gets 3 more and q (not in the loss) 1.
        let (p, q) = (Var::new(&[1f64, 2.], &Device::Cpu)?, Var::new(&[5f64], &Device::Cpu)?);
        let outside = ParamGrads::default();
        outside.push(p.as_tensor(), Tensor::new(&[3f64, 3.], &Device::Cpu)?);
        outside.push(q.as_tensor(), Tensor::new(&[1f64], &Device::Cpu)?);
        let mut opt = Optimizer::new(
            OptimizerKind::Sgd { momentum: 0.0 },
            vec![p.clone(), q.clone()],
            0.5,
            0.0,
        )?;
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?, Some(&outside))?;
        // p - 0.5 (2p + 3), q - 0.5 · 1.
        assert_eq!(p.as_tensor().to_vec1::<f64>()?, [-1.5, -1.5]);
        assert_eq!(q.as_tensor().to_vec1::<f64>()?, [4.5]);
        // Drained: the next step sees the graph's gradient alone, and none for q.
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?, Some(&outside))?;
        assert_eq!(p.as_tensor().to_vec1::<f64>()?, [0.0, 0.0]);
        assert_eq!(q.as_tensor().to_vec1::<f64>()?, [4.5]);
        Ok(())
    }
}
