//! The model families and the layers they share. Each family lives in one file with a `Config`, named
//! presets, and modules whose parameter names mirror the reference implementation.

pub mod bert;
pub mod decoder;
#[cfg(feature = "cuda")]
pub mod encoder;
pub mod kv_cache;
pub mod layers;
mod relative_bias;
#[cfg(feature = "cudnn")]
pub mod residual;
pub mod resnet;
pub mod swin;
#[cfg(feature = "cuda")]
mod swin_block;
pub mod vit;

use candle_core::{Result, Tensor};

use crate::optim::ParamGrads;

/// What a workload feeds a model.
#[derive(Debug, Clone)]
pub enum Inputs {
    /// NCHW images.
    Images(Tensor),
    /// Token sequences: ids and token types (u32, [batch, seq]) and the attention mask (1 attend,
    /// 0 ignore, [batch, seq]).
    Tokens {
        input_ids: Tensor,
        token_type_ids: Tensor,
        attention_mask: Tensor,
    },
}

impl Inputs {
    /// The tensors, in a fixed order: the images, or ids, token types and mask.
    pub fn tensors(&self) -> Vec<Tensor> {
        match self {
            Inputs::Images(x) => vec![x.clone()],
            Inputs::Tokens {
                input_ids,
                token_type_ids,
                attention_mask,
            } => {
                vec![input_ids.clone(), token_type_ids.clone(), attention_mask.clone()]
            }
        }
    }

    /// Inputs of this kind made of `tensors`, in [`Inputs::tensors`]' order (any beyond are not
    /// read).
    pub fn with_tensors(&self, tensors: &[Tensor]) -> Result<Inputs> {
        Ok(match (self, tensors) {
            (Inputs::Images(_), [x, ..]) => Inputs::Images(x.clone()),
            (Inputs::Tokens { .. }, [ids, types, mask, ..]) => Inputs::Tokens {
                input_ids: ids.clone(),
                token_type_ids: types.clone(),
                attention_mask: mask.clone(),
            },
            _ => candle_core::bail!("{} tensors do not make these inputs", tensors.len()),
        })
    }
}

/// A model that maps inputs to class logits; `train` selects training behaviour (batch statistics).
pub trait Classifier: Send {
    fn forward(&self, inputs: &Inputs, train: bool) -> Result<Tensor>;
    /// Where the model's backward pass records parameter gradients outside candle's graph, if it
    /// does (layers run as one op, see [`encoder`]).
    fn param_grads(&self) -> Option<&ParamGrads> {
        None
    }
}

/// Whether a named tensor is a buffer (state the optimizer must not touch), not a parameter.
pub fn is_buffer(name: &str) -> bool {
    name.ends_with("running_mean") || name.ends_with("running_var")
}
