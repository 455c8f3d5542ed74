//! Tensor operations that candle lacks in a differentiable form.

use candle_core::{DType, Result, Tensor, D};

/// 2-D max pooling with padding, built from strided views and `maximum` so that gradients flow.
///
/// candle's `max_pool2d_with_stride` has no backward when kernel != stride (ResNet's 3x3/2 pool) and
/// takes no padding. Padding uses -inf, as PyTorch does, so a padded cell never wins.
pub fn max_pool2d(x: &Tensor, kernel: usize, stride: usize, padding: usize) -> Result<Tensor> {
    let (_, _, h, w) = x.dims4()?;
    if h + 2 * padding < kernel || w + 2 * padding < kernel {
        candle_core::bail!("max_pool2d: kernel {kernel} larger than the padded {h}x{w} input")
    }
    // CUDA: one pass each way (`crate::kernels::pool`).
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op1(crate::kernels::pool::MaxPool { kernel, stride, padding });
    }
    if !x.track_op() {
        // Inference: pad, then candle's pooling kernel (one pass; it has no backward for kernel !=
        // stride, which is why training takes the strided views below).
        return pad(x, (padding, padding), (padding, padding), f32::NEG_INFINITY)?.max_pool2d_with_stride(kernel, stride);
    }
    let (oh, ow) = ((h + 2 * padding - kernel) / stride + 1, (w + 2 * padding - kernel) / stride + 1);
    // Pad bottom/right further so that every window offset can take `out * stride` rows, which the
    // strided view needs; the extra rows are never among the selected ones.
    let bottom = kernel - 1 + oh * stride - h - padding;
    let right = kernel - 1 + ow * stride - w - padding;
    let x = pad(x, (padding, bottom), (padding, right), f32::NEG_INFINITY)?;
    let mut out: Option<Tensor> = None;
    for i in 0..kernel {
        let rows = strided(&x, 2, i, oh, stride)?;
        for j in 0..kernel {
            let window = strided(&rows, 3, j, ow, stride)?;
            out = Some(match out {
                None => window,
                Some(acc) => acc.maximum(&window)?,
            });
        }
    }
    Ok(out.expect("kernel >= 1"))
}

/// `count` elements of dimension `dim`, starting at `start`, every `stride`-th one: a narrow followed by
/// a reshape that splits the stride off, since candle has no strided slicing.
fn strided(x: &Tensor, dim: usize, start: usize, count: usize, stride: usize) -> Result<Tensor> {
    let x = x.narrow(dim, start, count * stride)?;
    if stride == 1 {
        return Ok(x);
    }
    let mut shape = x.dims().to_vec();
    shape[dim] = count;
    shape.insert(dim + 1, stride);
    x.reshape(shape)?.narrow(dim + 1, 0, 1)?.squeeze(dim + 1)
}

/// Pads the last two dimensions of an NCHW tensor with a constant: (top, bottom) and (left, right).
fn pad(x: &Tensor, (top, bottom): (usize, usize), (left, right): (usize, usize), value: f32) -> Result<Tensor> {
    let (b, c, h, w) = x.dims4()?;
    let fill = |rows: usize, cols: usize| -> Result<Tensor> {
        Tensor::full(value, (b, c, rows, cols), x.device())?.to_dtype(x.dtype())
    };
    // candle's cat does not take empty pieces, so zero-width sides are left out.
    let around = |before: Tensor, mid: &Tensor, after: Tensor, dim: usize| -> Result<Tensor> {
        let parts: Vec<&Tensor> = [&before, mid, &after].into_iter().filter(|t| t.dim(dim).unwrap_or(0) > 0).collect();
        Tensor::cat(&parts, dim)
    };
    let x = around(fill(h, left)?, x, fill(h, right)?, 3)?;
    let w = w + left + right;
    around(fill(top, w)?, &x, fill(bottom, w)?, 2)
}

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
    use candle_core::{Device, Var};

    /// Direct max-pool with -inf padding, the definition the fast path must match.
    fn reference(x: &[f32], h: usize, w: usize, k: usize, s: usize, p: usize) -> Vec<f32> {
        let (oh, ow) = ((h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1);
        let mut out = Vec::new();
        for oy in 0..oh {
            for ox in 0..ow {
                let mut m = f32::NEG_INFINITY;
                for dy in 0..k {
                    for dx in 0..k {
                        let (y, xx) = ((oy * s + dy) as isize - p as isize, (ox * s + dx) as isize - p as isize);
                        if y >= 0 && xx >= 0 && (y as usize) < h && (xx as usize) < w {
                            m = m.max(x[y as usize * w + xx as usize]);
                        }
                    }
                }
                out.push(m);
            }
        }
        out
    }

    #[test]
    fn matches_direct_definition_on_odd_and_even_sizes() -> Result<()> {
        for &(h, w) in &[(7usize, 7usize), (8, 8), (5, 6), (112, 112)] {
            let vals: Vec<f32> = (0..h * w).map(|i| ((i * 37 % 101) as f32) - 50.0).collect();
            let x = Tensor::from_vec(vals.clone(), (1, 1, h, w), &Device::Cpu)?;
            // Both paths: the pooling kernel (no graph) and the strided views (a variable).
            let got = max_pool2d(&x, 3, 2, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, reference(&vals, h, w, 3, 2, 1), "{h}x{w}");
            let var = Var::from_tensor(&x)?;
            let got = max_pool2d(var.as_tensor(), 3, 2, 1)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(got, reference(&vals, h, w, 3, 2, 1), "{h}x{w} (differentiable path)");
        }
        Ok(())
    }

    #[test]
    fn gradient_goes_to_each_window_maximum() -> Result<()> {
        // 4x4 input, 3x3/2 pool with padding 1 -> 2x2 output; each output's max is a distinct cell.
        let vals: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x = Var::from_tensor(&Tensor::from_vec(vals, (1, 1, 4, 4), &Device::Cpu)?)?;
        let y = max_pool2d(x.as_tensor(), 3, 2, 1)?;
        assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, vec![5., 7., 13., 15.]);
        let grads = y.sum_all()?.backward()?;
        let g = grads.get(x.as_tensor()).expect("gradient").flatten_all()?.to_vec1::<f32>()?;
        let mut want = vec![0f32; 16];
        for i in [5, 7, 13, 15] {
            want[i] = 1.0;
        }
        assert_eq!(g, want);
        Ok(())
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_ln_classes() -> Result<()> {
        let logits = Tensor::zeros((4, 10), DType::F32, &Device::Cpu)?;
        let labels = Tensor::new(&[0u32, 3, 7, 9], &Device::Cpu)?;
        let loss = cross_entropy(&logits, &labels)?.to_scalar::<f32>()?;
        assert!((loss - 10f32.ln()).abs() < 1e-6, "{loss}");
        Ok(())
    }
}
