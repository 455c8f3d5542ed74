//! The model families and the layers they share. Each family lives in one file with a `Config`, named
//! presets, and modules whose parameter names mirror the reference implementation.

pub mod resnet;

use candle_core::{Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

/// What a workload feeds a model.
#[derive(Debug, Clone)]
pub enum Inputs {
    /// NCHW images.
    Images(Tensor),
}

/// A model that maps inputs to class logits; `train` selects training behaviour (batch statistics).
pub trait Classifier: Send {
    fn forward(&self, inputs: &Inputs, train: bool) -> Result<Tensor>;
}

/// A linear layer initialised as `torch.nn.Linear` is (weight and bias uniform in ±1/sqrt(fan_in)),
/// so that a freshly built model starts where the PyTorch one does.
pub fn torch_linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let bound = 1.0 / (in_dim as f64).sqrt();
    let init = Init::Uniform { lo: -bound, up: bound };
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", init)?;
    let bias = vb.get_with_hints(out_dim, "bias", init)?;
    Ok(Linear::new(weight, Some(bias)))
}

/// Whether a named tensor is a buffer (state the optimizer must not touch), not a parameter.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}
