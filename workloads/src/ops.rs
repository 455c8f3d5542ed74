//! Tensor operations that candle lacks in a differentiable form.

use candle_core::{DType, Result, Tensor, D};

/// Cross-entropy of logits against class indices, computed in f32 whatever the logits' dtype: a
/// log-softmax over 1000 classes in bf16 loses the loss's low bits.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let log_p = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    candle_nn::loss::nll(&log_p, labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cross_entropy_of_uniform_logits_is_ln_classes() -> Result<()> {
        let logits = Tensor::zeros((4, 10), DType::F32, &Device::Cpu)?;
        let labels = Tensor::new(&[0u32, 3, 7, 9], &Device::Cpu)?;
        let loss = cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        assert!((loss - 10f32.ln()).abs() < 1e-6, "{loss}");
        Ok(())
    }
}
