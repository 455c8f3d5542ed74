//! Optimizers of the training workloads: AdamW is candle's; SGD with momentum is here because candle's
//! SGD has no momentum, and PyTorch users' ResNet recipes use it.

use candle_core::{Result, Tensor, Var};
use candle_nn::{AdamW, Optimizer as _, ParamsAdamW};

/// Which optimizer a training workload uses, with PyTorch's semantics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// `torch.optim.AdamW` (betas 0.9, 0.999; eps 1e-8).
    AdamW,
    /// `torch.optim.SGD` with momentum (dampening 0, no Nesterov).
    Sgd { momentum: f64 },
}

impl OptimizerKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Sgd { .. } => "sgd",
        }
    }
}

pub enum Optimizer {
    AdamW(AdamW),
    Sgd(SgdMomentum),
}

impl Optimizer {
    pub fn new(kind: OptimizerKind, vars: Vec<Var>, lr: f64, weight_decay: f64) -> Result<Self> {
        Ok(match kind {
            OptimizerKind::AdamW => Self::AdamW(AdamW::new(vars, ParamsAdamW { lr, weight_decay, ..Default::default() })?),
            OptimizerKind::Sgd { momentum } => Self::Sgd(SgdMomentum::new(vars, lr, momentum, weight_decay)),
        })
    }

    /// Back-propagates `loss` and updates every parameter.
    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        match self {
            Self::AdamW(o) => o.backward_step(loss),
            Self::Sgd(o) => o.backward_step(loss),
        }
    }
}

/// `torch.optim.SGD(momentum=m, weight_decay=wd)`: g += wd·p; b = g on the first step, then
/// b = m·b + g; p -= lr·b.
pub struct SgdMomentum {
    vars: Vec<Var>,
    buffers: Vec<Option<Tensor>>,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
}

impl SgdMomentum {
    pub fn new(vars: Vec<Var>, lr: f64, momentum: f64, weight_decay: f64) -> Self {
        let buffers = vec![None; vars.len()];
        Self { vars, buffers, lr, momentum, weight_decay }
    }

    pub fn backward_step(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward()?;
        for (var, buffer) in self.vars.iter().zip(self.buffers.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            let g = if self.weight_decay != 0.0 { (g + (var.as_tensor() * self.weight_decay)?)? } else { g.clone() };
            let step = match buffer.take() {
                Some(b) if self.momentum != 0.0 => ((b * self.momentum)? + g)?,
                _ => g,
            };
            var.set(&(var.as_tensor() - (&step * self.lr)?)?)?;
            *buffer = Some(step);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn sgd_momentum_follows_pytorch_by_hand() -> Result<()> {
        // loss = sum(p²), grad 2p. lr 0.1, momentum 0.9:
        // step 1: b = [2, 4], p = [0.8, 1.6]; step 2: g = [1.6, 3.2], b = [3.4, 6.8], p = [0.46, 0.92].
        let p = Var::new(&[1f32, 2.], &Device::Cpu)?;
        let mut opt = Optimizer::new(OptimizerKind::Sgd { momentum: 0.9 }, vec![p.clone()], 0.1, 0.0)?;
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?)?;
        let v = p.as_tensor().to_vec1::<f32>()?;
        assert!((v[0] - 0.8).abs() < 1e-6 && (v[1] - 1.6).abs() < 1e-6, "{v:?}");
        opt.backward_step(&p.as_tensor().sqr()?.sum_all()?)?;
        let v = p.as_tensor().to_vec1::<f32>()?;
        assert!((v[0] - 0.46).abs() < 1e-6 && (v[1] - 0.92).abs() < 1e-6, "{v:?}");
        Ok(())
    }

    #[test]
    fn sgd_weight_decay_adds_to_the_gradient() -> Result<()> {
        // loss = sum(p) (grad 1), wd 0.5, lr 0.1: g = 1 + 0.5·p = 2 for p = 2, so p = 1.8.
        let p = Var::new(&[2f32], &Device::Cpu)?;
        let mut opt = Optimizer::new(OptimizerKind::Sgd { momentum: 0.9 }, vec![p.clone()], 0.1, 0.5)?;
        opt.backward_step(&p.as_tensor().sum_all()?)?;
        assert!((p.as_tensor().to_vec1::<f32>()?[0] - 1.8).abs() < 1e-6);
        Ok(())
    }
}
