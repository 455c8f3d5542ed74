//! Multi-head scaled dot-product attention on already projected queries, keys and values, shared by
//! the transformer families: matmuls and our differentiable softmax kernel.

use candle_core::{Result, Tensor, D};

pub use crate::kernels::{merge_heads, split_heads};

/// softmax(q kᵀ / sqrt(head_dim) + bias) v over [batch, heads, tokens, head_dim]; `bias` is added to
/// the scores (an attention mask or a relative position bias) and broadcasts against them.
pub fn attend(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    // Scaling q rather than the scores: tokens x head_dim elements instead of tokens x tokens.
    let scale = 1.0 / (q.dim(D::Minus1)? as f64).sqrt();
    let scores = (q * scale)?.matmul(&k.t()?)?;
    let scores = match bias {
        Some(b) => crate::kernels::add_repeating(&scores, &b.to_dtype(scores.dtype())?)?,
        None => scores,
    };
    crate::kernels::softmax_last(&scores)?.matmul(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::tests::check_gradient;
    use candle_core::{DType, Device};

    #[test]
    fn uniform_scores_average_the_values() -> Result<()> {
        // Identical keys give equal weights: every output is the mean of the values.
        let q = Tensor::ones((1, 1, 3, 2), DType::F32, &Device::Cpu)?;
        let k = Tensor::ones((1, 1, 3, 2), DType::F32, &Device::Cpu)?;
        let v = Tensor::new(&[[1f32, 10.], [2., 20.], [3., 30.]], &Device::Cpu)?.reshape((1, 1, 3, 2))?;
        let out = attend(&q, &k, &v, None)?.flatten_all()?.to_vec1::<f32>()?;
        for (got, want) in out.iter().zip([2f32, 20., 2., 20., 2., 20.]) {
            assert!((got - want).abs() < 1e-5, "{out:?}");
        }
        // A -inf bias on a key removes it.
        let mask = Tensor::new(&[0f32, 0., f32::NEG_INFINITY], &Device::Cpu)?;
        let out = attend(&q, &k, &v, Some(&mask))?.flatten_all()?.to_vec1::<f32>()?;
        assert!((out[0] - 1.5).abs() < 1e-5 && (out[1] - 15.0).abs() < 1e-5, "{out:?}");
        Ok(())
    }

    #[test]
    fn heads_split_and_merge_back() -> Result<()> {
        let x = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((1, 3, 8))?;
        let split = split_heads(&x, 2)?;
        assert_eq!(split.dims(), &[1, 2, 3, 4]);
        // Head 1 of token 0 holds features 4..8 of token 0.
        assert_eq!(split.get(0)?.get(1)?.get(0)?.to_vec1::<f32>()?, vec![4., 5., 6., 7.]);
        assert_eq!(merge_heads(&split)?.flatten_all()?.to_vec1::<f32>()?, x.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
    }

    #[test]
    fn attention_has_exact_gradients() -> Result<()> {
        // One input feeds q, k and v through fixed slices so that every path is differentiated.
        check_gradient(
            |x| {
                let q = x.narrow(3, 0, 2)?;
                let k = x.narrow(3, 2, 2)?;
                let v = x.narrow(3, 4, 2)?;
                attend(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, None)
            },
            &[1, 2, 3, 6],
            5,
        )
    }
}
