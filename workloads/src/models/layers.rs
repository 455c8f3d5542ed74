//! Layers the model families share, on our differentiable kernels (`crate::kernels`): candle's fused
//! layer norm has no backward, and its batch norm cannot train in half precision (it mixes f16/bf16
//! running statistics with f32 batch statistics).

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{Init, Module, VarBuilder};

use crate::kernels::{batch_norm, Act};

/// y = x wᵀ + b over the last dimension, as `torch.nn.Linear`. Unlike candle-nn's, a [batch, tokens,
/// features] input is multiplied as one [batch * tokens, features] matrix: one large GEMM instead of
/// a batch of small ones against a broadcast weight, which is what keeps cuBLAS busy.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, Act::None)
    }
}

impl Linear {
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// act(x wᵀ + b): one op on the GPU ([`crate::kernels::linear`]).
    pub fn forward_act(&self, x: &Tensor, act: Act) -> Result<Tensor> {
        crate::kernels::linear(x, &self.weight, self.bias.as_ref(), act)
    }

    /// residual + x wᵀ + b: on the GPU, for inference, the residual is added by the GEMM
    /// ([`crate::kernels::linear_residual`]).
    pub fn forward_residual(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        match &self.bias {
            Some(b) => crate::kernels::linear_residual(x, &self.weight, b, residual),
            None => crate::kernels::add(residual, &self.forward(x)?, false),
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Whether the weight or bias is trained (a variable, or computed from one): then copies of
    /// them go stale, and gradients must flow back through every use.
    pub fn trains(&self) -> bool {
        self.weight.track_op() || self.bias.as_ref().is_some_and(|b| b.track_op())
    }

    /// The layers' weights and biases stacked along the outputs: one GEMM for several projections
    /// of the same input (BERT's q, k and v). Built per call from the current weights, so that the
    /// gradient flows back into each layer's own.
    pub fn packed(layers: &[&Linear]) -> Result<Linear> {
        let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
        let biases: Option<Vec<&Tensor>> = layers.iter().map(|l| l.bias.as_ref()).collect();
        Ok(Linear::new(
            Tensor::cat(&weights, 0)?,
            biases.map(|b| Tensor::cat(&b, 0)).transpose()?,
        ))
    }
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

/// The dtype normalisation statistics are computed in: f32 for half-precision inputs (as PyTorch's
/// autocast does), the input's own otherwise.
fn stats_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// Batch normalisation over NCHW, as `torch.nn.BatchNorm2d`: batch statistics (biased variance) when
/// training, with the running statistics updated by `momentum` (unbiased variance); running statistics
/// when inferring. Running statistics are kept in f32 whatever the model's dtype.
pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
}

impl BatchNorm2d {
    /// torchvision's defaults: eps 1e-5, momentum 0.1.
    pub fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(channels, "weight", Init::Const(1.0))?;
        let bias = vb.get_with_hints(channels, "bias", Init::Const(0.0))?;
        let running_mean = vb.get_with_hints_dtype(channels, "running_mean", Init::Const(0.0), DType::F32)?;
        let running_var = vb.get_with_hints_dtype(channels, "running_var", Init::Const(1.0), DType::F32)?;
        Ok(Self {
            weight,
            bias,
            running_mean: Var::from_tensor(&running_mean)?,
            running_var: Var::from_tensor(&running_var)?,
            eps: 1e-5,
            momentum: 0.1,
        })
    }

    /// Normalises x, then ReLU when `relu`. Training: one pass for the batch statistics and one for
    /// the normalisation ([`crate::kernels::batch_norm`]), the running statistics updated on the side.
    pub fn forward(&self, x: &Tensor, train: bool, relu: bool) -> Result<Tensor> {
        let (_, c, _, _) = x.dims4()?;
        if train {
            return self.forward_train(x, relu, false);
        }
        // Running statistics on weights that may still be trained (frozen ones are folded into the
        // convolution by ConvBn).
        let dtype = x.dtype();
        let compute = stats_dtype(dtype);
        let per_channel = |t: &Tensor| t.to_dtype(compute)?.reshape((1, c, 1, 1));
        let (mean, var) = (
            per_channel(&self.running_mean.as_detached_tensor())?,
            per_channel(&self.running_var.as_detached_tensor())?,
        );
        // y = x * scale + shift with scale = w / sqrt(var + eps), shift = b - mean * scale.
        let scale = per_channel(&self.weight)?.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        let shift = per_channel(&self.bias)?.sub(&mean.broadcast_mul(&scale)?)?;
        let y = x
            .to_dtype(compute)?
            .broadcast_mul(&scale)?
            .broadcast_add(&shift)?
            .to_dtype(dtype)?;
        if relu {
            y.relu()
        } else {
            Ok(y)
        }
    }

    /// Training over NHWC ([n, h, w, c]): as [`Self::forward`] with `train`, the channels last.
    pub fn forward_nhwc_train(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        self.forward_train(x, relu, true)
    }

    fn forward_train(&self, x: &Tensor, relu: bool, channels_last: bool) -> Result<Tensor> {
        let x = x.contiguous()?;
        // No gradient through the statistics op: BatchNorm's backward formula accounts for them.
        let stats = self.batch_stats(&x, channels_last)?;
        let wb = Tensor::stack(&[&self.weight, &self.bias], 0)?;
        x.apply_op3(
            &wb,
            &stats,
            batch_norm::BatchNorm {
                eps: self.eps,
                relu,
                channels_last,
            },
        )
    }

    /// The batch's [mean; biased variance] of contiguous x (recording no gradient), the running
    /// statistics updated with them.
    pub(crate) fn batch_stats(&self, x: &Tensor, channels_last: bool) -> Result<Tensor> {
        let c = if channels_last { x.dim(x.rank() - 1)? } else { x.dim(1)? };
        let n = x.elem_count() / c.max(1);
        if x.device().is_cuda() {
            let op = batch_norm::BatchStatsUpdating {
                channels_last,
                running: self.running(n),
            };
            return x.detach().apply_op1_no_bwd(&op);
        }
        let stats = x.detach().apply_op1_no_bwd(&batch_norm::BatchStats { channels_last })?;
        self.update_running(&stats, n)?;
        Ok(stats)
    }

    /// The scale and shift parameters (what the optimizer's gradients are keyed by) and eps.
    #[cfg(feature = "cudnn")]
    pub(crate) fn affine(&self) -> (&Tensor, &Tensor, f64) {
        (&self.weight, &self.bias, self.eps)
    }

    /// running ← (1 - momentum)·running + momentum·batch, the variance unbiased (n / (n - 1)), as
    /// PyTorch does; `stats` is [mean; biased variance] over `n` values per channel.
    fn update_running(&self, stats: &Tensor, n: usize) -> Result<()> {
        let r = self.running(n);
        let update = |row: usize, take: f64| batch_norm::RunningUpdate {
            row,
            keep: r.keep,
            take,
        };
        r.mean.inplace_op2(stats, &update(0, r.take_mean))?;
        r.var.inplace_op2(stats, &update(1, r.take_var))
    }

    /// The running statistics and the momentum update of a batch of `n` values per channel.
    fn running(&self, n: usize) -> batch_norm::Running {
        let n = n as f64;
        batch_norm::Running {
            mean: self.running_mean.as_tensor().clone(),
            var: self.running_var.as_tensor().clone(),
            keep: 1.0 - self.momentum,
            take_mean: self.momentum,
            take_var: self.momentum * n / (n - 1.0).max(1.0),
        }
    }

    /// The inference-time affine map y = x * scale + shift per channel, in f32, each of shape [c], on
    /// the host (where `ConvBn` folds it).
    fn scale_shift(&self) -> Result<(Tensor, Tensor)> {
        let host = |t: &Tensor| t.detach().to_device(&Device::Cpu)?.to_dtype(DType::F32);
        let (mean, var) = (
            host(self.running_mean.as_tensor())?,
            host(self.running_var.as_tensor())?,
        );
        let scale = host(&self.weight)?.div(&(var + self.eps)?.sqrt()?)?;
        let shift = host(&self.bias)?.sub(&mean.mul(&scale)?)?;
        Ok((scale, shift))
    }
}

/// A convolution followed by batch normalisation, ResNet's unit. Inferring on frozen weights, the
/// normalisation is folded into the convolution once (w' = w * scale, bias = shift): one bias add
/// after the convolution instead of a normalisation pass — the same function, as TensorRT and
/// torch.fx's conv-bn fuser compute it, rounded once more in bf16 (w' is stored in the weight's dtype).
/// Training, or on trainable weights, the two run as written.
///
/// A frozen unit then holds its folded weight alone, in the layout its path reads, as PyTorch's
/// `channels_last` model holds one copy of its weights: the weight as built is let go once folded
/// (a frozen model's tensors as built stay on the host, `crate::init::Params`). Keeping both held
/// ResNet-50's convolution weights twice on the device (docs/kernels.md#memory).
pub struct ConvBn {
    weight: std::sync::Mutex<UnitWeight>,
    padding: usize,
    stride: usize,
    pub bn: BatchNorm2d,
    /// Nothing of the unit trains: the batch norm folds into the convolution.
    frozen: bool,
    /// Where the weight as built was given: where the folded one goes.
    device: Device,
}

/// A unit's convolution weight: as built (KCRS, as PyTorch holds it), or folded.
enum UnitWeight {
    AsBuilt(Tensor),
    /// The folded weight in each layout asked for so far, KCRS (the NCHW path's) and KRSC (filter
    /// channels last, the NHWC path's), and the shift as a bias in each dtype asked for, beside the
    /// shift in f32 on the host. A model asks for one of each; another is added, never put in the
    /// place of the first, whose address a captured graph may hold.
    Folded {
        kcrs: Option<Tensor>,
        krsc: Option<Tensor>,
        shift: Tensor,
        biases: Vec<Tensor>,
    },
}

impl ConvBn {
    /// The unit of a convolution as `torch.nn.Conv2d(bias=False)` holds it — `weight` KCRS, a square
    /// kernel, the same padding and stride both ways, no dilation or groups; the batch norm's shift
    /// is its bias — and its batch norm. It runs on [`crate::kernels::conv2d`] (cuDNN with cached
    /// algorithms on the GPU) or, over NHWC, [`crate::kernels::conv_nhwc`].
    pub fn new(weight: Tensor, padding: usize, stride: usize, bn: BatchNorm2d) -> Self {
        let frozen = !(weight.track_op() || bn.weight.track_op() || bn.bias.track_op());
        let device = weight.device().clone();
        Self {
            weight: std::sync::Mutex::new(UnitWeight::AsBuilt(weight)),
            padding,
            stride,
            bn,
            frozen,
            device,
        }
    }

    /// Whether nothing of the unit trains: then the batch norm folds into the convolution.
    pub fn frozen(&self) -> bool {
        self.frozen
    }

    /// The weight as built (KCRS), the padding and the stride: for the unit's training paths.
    pub(crate) fn parts(&self) -> Result<(Tensor, usize, usize)> {
        match &*self.weight.lock().expect("no panic while holding the lock") {
            UnitWeight::AsBuilt(w) => Ok((w.clone(), self.padding, self.stride)),
            UnitWeight::Folded { .. } => {
                candle_core::bail!("a folded unit (frozen weights) has no weight as built to train")
            }
        }
    }

    /// The folded weight, KRSC when `krsc` else KCRS, and the shift as a bias in `dtype`: folded on
    /// first use. A model folds every unit before its first activation, so that the folded weights
    /// lie where the weights as built lay in the memory pool, not scattered between the step's
    /// activations, where each would keep its block of the pool from being handed back (measured:
    /// docs/kernels.md#conv_nhwc).
    ///
    /// The fold happens on the host, the device's copy of the weight as built freed first: the
    /// folded weight, of the same size, then takes the block the old one held. Made on the device
    /// beside the old one, each left a hole when the old was freed, and ResNet-50's f32 pool held 32
    /// MiB more than its weights needed. The host rounds as the device would (an f32 product, then
    /// the weight's dtype).
    pub fn folded(&self, dtype: DType, krsc: bool) -> Result<(Tensor, Tensor)> {
        if !self.frozen {
            candle_core::bail!("batch norm folds into the convolution on frozen weights only")
        }
        let mut weight = self.weight.lock().expect("no panic while holding the lock");
        if let UnitWeight::AsBuilt(w) = &*weight {
            let host = w.to_device(&Device::Cpu)?;
            // The device's copy goes now; until the folded weight is uploaded (or if that fails) the
            // unit holds its weight as built on the host, and folds from there.
            *weight = UnitWeight::AsBuilt(host.clone());
            let (scale, shift) = self.bn.scale_shift()?;
            let c = scale.dim(0)?;
            let folded = host
                .to_dtype(DType::F32)?
                .broadcast_mul(&scale.reshape((c, 1, 1, 1))?)?
                .to_dtype(host.dtype())?;
            let folded = if krsc {
                folded.permute((0, 2, 3, 1))?.contiguous()?
            } else {
                folded
            };
            let folded = Some(folded.to_device(&self.device)?);
            let (kcrs, krsc) = if krsc { (None, folded) } else { (folded, None) };
            *weight = UnitWeight::Folded {
                kcrs,
                krsc,
                shift,
                biases: Vec::new(),
            };
        }
        let UnitWeight::Folded {
            kcrs,
            krsc: krsc_w,
            shift,
            biases,
        } = &mut *weight
        else {
            unreachable!("folded above")
        };
        // A layout not asked for before: the other one moved, on the device (no model does this).
        let w = match (krsc, &*kcrs, &*krsc_w) {
            (false, Some(w), _) | (true, _, Some(w)) => w.clone(),
            (false, None, Some(other)) => kcrs.insert(other.permute((0, 3, 1, 2))?.contiguous()?).clone(),
            (true, Some(other), None) => krsc_w.insert(other.permute((0, 2, 3, 1))?.contiguous()?).clone(),
            (_, None, None) => unreachable!("a folded unit holds its weight in some layout"),
        };
        let bias = match biases.iter().find(|b| b.dtype() == dtype) {
            Some(b) => b.clone(),
            None => {
                let b = shift.to_dtype(dtype)?.to_device(&self.device)?;
                biases.push(b.clone());
                b
            }
        };
        Ok((w, bias))
    }

    /// Inference over NHWC on a frozen unit: conv with the batch norm folded, + `residual` when
    /// given, then ReLU when `relu`, as one cuDNN graph ([`crate::kernels::conv_nhwc`]).
    #[cfg(feature = "cudnn")]
    pub fn forward_nhwc(&self, x: &Tensor, residual: Option<&Tensor>, relu: bool) -> Result<Tensor> {
        if !self.frozen {
            candle_core::bail!("the NHWC convolution is for inference on frozen weights")
        }
        let (w, b) = self.folded(x.dtype(), true)?;
        crate::kernels::conv_nhwc(x, &w, &b, residual, self.padding, self.stride, relu)
    }

    /// Training over NHWC: the convolution on cuDNN's NHWC engines (the weight, held as PyTorch
    /// holds it, seen as KRSC for the step: a copy the size of the weights, and its gradient copied
    /// back), then batch norm over NHWC, then ReLU when `relu`.
    #[cfg(feature = "cudnn")]
    pub fn forward_nhwc_train(&self, x: &Tensor, relu: bool) -> Result<Tensor> {
        let (w, padding, stride) = self.parts()?;
        let w = w.permute((0, 2, 3, 1))?.contiguous()?;
        let y = crate::kernels::conv_nhwc::conv_nhwc_train(x, &w, padding, stride)?;
        self.bn.forward_nhwc_train(&y, relu)
    }

    /// conv, batch norm, then ReLU when `relu`.
    pub fn forward(&self, x: &Tensor, train: bool, relu: bool) -> Result<Tensor> {
        if train || !self.frozen {
            let (w, padding, stride) = self.parts()?;
            return self
                .bn
                .forward(&crate::kernels::conv2d(x, &w, padding, stride)?, train, relu);
        }
        let (w, b) = self.folded(x.dtype(), false)?;
        let y = crate::kernels::conv2d(x, &w, self.padding, self.stride)?;
        // Written over the convolution's output, which nothing else holds.
        crate::kernels::bias_act_over(
            y,
            &b,
            crate::kernels::BiasAxis::Channels,
            if relu { Act::Relu } else { Act::None },
        )
    }
}

/// A patch embedding: a convolution whose stride equals its kernel (ViT's 16x16, Swin's 4x4), with
/// bias, returned channels-last [b, h/p, w/p, d] as the transformers use it.
///
/// Why not a convolution: the patches do not overlap, so the convolution is a reshuffle of the image
/// into [b·patches, c·p·p] rows and one GEMM against the filter seen as [d, c·p·p], the bias in its
/// epilogue. cuDNN ran ViT-B/16's as `implicit_convolve_sgemm`, slow for a product of its size, and
/// its NCHW output then needed a transposing copy (measured: docs/kernels.md#patch-embedding).
pub struct PatchEmbed {
    weight: Tensor,
    bias: Tensor,
}

impl PatchEmbed {
    /// `weight` [d, c, p, p] as `torch.nn.Conv2d(c, d, p, stride=p)` holds it.
    pub fn new(weight: Tensor, bias: Tensor) -> Result<Self> {
        let (_, _, kh, kw) = weight.dims4()?;
        if kh != kw {
            candle_core::bail!("patch embedding: a {kh}x{kw} filter; patches are square")
        }
        Ok(Self { weight, bias })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (d, c, p, _) = self.weight.dims4()?;
        let (b, xc, h, w) = x.dims4()?;
        if xc != c || h % p != 0 || w % p != 0 {
            candle_core::bail!(
                "patch embedding of {p}x{p} patches over {c} channels: an input of shape {:?}",
                x.dims()
            )
        }
        let (gh, gw) = (h / p, w / p);
        // Each patch's values in the filter's (channel, row, column) order.
        let patches = x
            .reshape((b, c, gh, p, gw, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b, gh, gw, c * p * p))?;
        crate::kernels::linear(
            &patches,
            &self.weight.reshape((d, c * p * p))?,
            Some(&self.bias),
            Act::None,
        )
    }
}

/// Layer normalisation over the last dimension, as `torch.nn.LayerNorm`.
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn new(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(dim, "weight", Init::Const(1.0))?;
        let bias = vb.get_with_hints(dim, "bias", Init::Const(0.0))?;
        Ok(Self { weight, bias, eps })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::kernels::layer_norm(x, &self.weight, &self.bias, self.eps)
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::init::{Params, Rng, SeededInit};

    /// Compares autograd's gradient of `sum(f(x) * r)` (r fixed, random) with central differences,
    /// in f64 so that the differences are exact to ~1e-8.
    pub fn check_gradient(f: impl Fn(&Tensor) -> Result<Tensor>, shape: &[usize], seed: u64) -> Result<()> {
        let n: usize = shape.iter().product();
        let mut rng = Rng::new(seed);
        let x0: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let out_shape = f(&Tensor::from_vec(x0.clone(), shape, &Device::Cpu)?)?.dims().to_vec();
        let r = Tensor::from_vec(
            (0..out_shape.iter().product::<usize>())
                .map(|_| rng.normal())
                .collect::<Vec<f64>>(),
            out_shape,
            &Device::Cpu,
        )?;
        let loss = |x: &Tensor| -> Result<Tensor> { (f(x)? * &r)?.sum_all() };
        let x = Var::from_vec(x0.clone(), shape, &Device::Cpu)?;
        let grads = loss(x.as_tensor())?.backward()?;
        let analytic = grads
            .get(x.as_tensor())
            .expect("a gradient reaches the input")
            .flatten_all()?
            .to_vec1::<f64>()?;
        let h = 1e-5;
        for i in 0..n {
            let at = |d: f64| -> Result<f64> {
                let mut v = x0.clone();
                v[i] += d;
                loss(&Tensor::from_vec(v, shape, &Device::Cpu)?)?.to_scalar::<f64>()
            };
            let numeric = (at(h)? - at(-h)?) / (2.0 * h);
            let tol = 1e-6 * (1.0 + numeric.abs());
            assert!(
                (analytic[i] - numeric).abs() < tol,
                "element {i}: autograd {} vs numeric {numeric}",
                analytic[i]
            );
        }
        Ok(())
    }

    fn vb(dtype: DType) -> VarBuilder<'static> {
        SeededInit::var_builder(Params::new(true), 1, dtype, &Device::Cpu)
    }

    #[test]
    fn patch_embedding_is_the_strided_convolution_and_refuses_ragged_images() -> Result<()> {
        // 2 images of 3x8x12 in 4x4 patches (2x3 of them), 5 output channels.
        let mut rng = Rng::new(9);
        let mut randn = |shape: &[usize]| {
            Tensor::from_vec(
                (0..shape.iter().product::<usize>())
                    .map(|_| rng.normal() as f32)
                    .collect::<Vec<_>>(),
                shape,
                &Device::Cpu,
            )
        };
        let (x, w, b) = (randn(&[2, 3, 8, 12])?, randn(&[5, 3, 4, 4])?, randn(&[5])?);
        let embed = PatchEmbed::new(w.clone(), b.clone())?;
        let want = x
            .conv2d(&w, 0, 4, 1, 1)?
            .broadcast_add(&b.reshape((1, 5, 1, 1))?)?
            .permute((0, 2, 3, 1))?;
        let got = embed.forward(&x)?;
        assert_eq!(got.dims(), [2, 2, 3, 5]);
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let err = embed.forward(&randn(&[1, 3, 8, 10])?).unwrap_err().to_string();
        assert!(err.contains("4x4 patches") && err.contains("[1, 3, 8, 10]"), "{err}");
        Ok(())
    }

    #[test]
    fn layer_norm_matches_candle_and_has_exact_gradients() -> Result<()> {
        let ln = LayerNorm::new(6, 1e-5, vb(DType::F32))?;
        let x = Tensor::from_vec(
            (0..24).map(|i| (i as f32).sin() * 3.0 + 1.0).collect::<Vec<_>>(),
            (4, 6),
            &Device::Cpu,
        )?;
        let w = Tensor::ones(6, DType::F32, &Device::Cpu)?;
        let b = Tensor::zeros(6, DType::F32, &Device::Cpu)?;
        let reference = candle_nn::ops::layer_norm(&x, &w, &b, 1e-5)?;
        let diff = (ln.forward(&x)? - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        let ln = LayerNorm::new(6, 1e-5, vb(DType::F64))?;
        check_gradient(|x| ln.forward(x), &[3, 6], 2)
    }

    #[test]
    fn batch_norm_train_has_exact_gradients_and_eval_uses_running_statistics() -> Result<()> {
        let bn = BatchNorm2d::new(3, vb(DType::F64))?;
        check_gradient(|x| bn.forward(x, true, false), &[2, 3, 2, 2], 3)?;
        check_gradient(|x| bn.forward(x, false, false), &[2, 3, 2, 2], 4)?;
        // After a training forward of a batch with per-channel mean m and unbiased variance v, the running
        // statistics are 0.9 * (0, 1) + 0.1 * (m, v).
        let bn = BatchNorm2d::new(1, vb(DType::F32))?;
        let x = Tensor::new(&[1f32, 2., 3., 6.], &Device::Cpu)?.reshape((4, 1, 1, 1))?;
        let y = bn.forward(&x, true, false)?.flatten_all()?.to_vec1::<f32>()?;
        let (mean, biased_var, unbiased_var) = (3.0f32, 3.5f32, 14.0f32 / 3.0);
        for (yi, xi) in y.iter().zip([1f32, 2., 3., 6.]) {
            assert!((yi - (xi - mean) / (biased_var + 1e-5).sqrt()).abs() < 1e-5);
        }
        let rm = bn.running_mean.as_tensor().to_vec1::<f32>()?[0];
        let rv = bn.running_var.as_tensor().to_vec1::<f32>()?[0];
        assert!(
            (rm - 0.1 * mean).abs() < 1e-6 && (rv - (0.9 + 0.1 * unbiased_var)).abs() < 1e-6,
            "{rm} {rv}"
        );
        let eval = bn.forward(&x, false, false)?.flatten_all()?.to_vec1::<f32>()?;
        assert!((eval[0] - (1.0 - rm) / (rv + 1e-5).sqrt()).abs() < 1e-5);
        Ok(())
    }

    #[test]
    fn a_frozen_unit_folds_its_batch_norm_once_in_the_layouts_and_dtypes_asked_for() -> Result<()> {
        let mut rng = Rng::new(11);
        let mut randn = |shape: &[usize], shift: f64| {
            Tensor::from_vec(
                (0..shape.iter().product::<usize>())
                    .map(|_| (rng.normal() + shift) as f32)
                    .collect::<Vec<_>>(),
                shape,
                &Device::Cpu,
            )
        };
        // Two input channels, so that KCRS [4, 2, 3, 3] and KRSC [4, 3, 3, 2] differ in shape.
        let (x, w) = (randn(&[2, 2, 6, 6], 0.0)?, randn(&[4, 2, 3, 3], 0.0)?);
        let bn = BatchNorm2d {
            weight: randn(&[4], 1.0)?,
            bias: randn(&[4], 0.0)?,
            running_mean: Var::from_tensor(&randn(&[4], 0.0)?)?,
            running_var: Var::from_tensor(&randn(&[4], 0.0)?.abs()?.affine(1.0, 0.5)?)?,
            eps: 1e-5,
            momentum: 0.1,
        };
        let unit = ConvBn::new(w.clone(), 1, 1, bn);
        assert!(unit.frozen());
        // The unfolded function: the convolution, then batch norm from its running statistics.
        let want = unit.bn.forward(&x.conv2d(&w, 1, 1, 1, 1)?, false, true)?;
        let close = |got: &Tensor| -> Result<f32> { (got - &want)?.abs()?.max_all()?.to_scalar::<f32>() };
        let got = unit.forward(&x, false, true)?;
        assert!(close(&got)? < 1e-5, "folded against unfolded: {}", close(&got)?);
        let err = unit.parts().unwrap_err().to_string();
        assert!(err.contains("no weight as built"), "{err}");
        let exact = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()
        };
        // KRSC (the NHWC path's) is the folded KCRS weight with its channels last.
        let (kcrs, bias) = unit.folded(DType::F32, false)?;
        let (krsc, _) = unit.folded(DType::F32, true)?;
        assert_eq!(
            (kcrs.dims(), krsc.dims()),
            ([4, 2, 3, 3].as_slice(), [4, 3, 3, 2].as_slice())
        );
        assert_eq!(exact(&krsc, &kcrs.permute((0, 2, 3, 1))?)?, 0.0);
        // Asked again, each is the one it gave (a captured graph may hold its address).
        let (again, _) = unit.folded(DType::F32, false)?;
        assert_eq!(exact(&again, &kcrs)?, 0.0);
        assert!(close(&unit.forward(&x, false, true)?)? < 1e-5);
        // The bias in another dtype: the f32 shift rounded once.
        let (_, half) = unit.folded(DType::F16, false)?;
        assert_eq!(half.dtype(), DType::F16);
        assert_eq!(exact(&half, &bias.to_dtype(DType::F16)?)?, 0.0);
        // Trainable units do not fold.
        let trainable = ConvBn::new(
            Var::from_tensor(&w)?.as_tensor().clone(),
            1,
            1,
            BatchNorm2d::new(4, vb(DType::F32))?,
        );
        assert!(!trainable.frozen() && trainable.folded(DType::F32, false).is_err());
        Ok(())
    }

    #[test]
    fn half_precision_batch_norm_trains_with_f32_statistics() -> Result<()> {
        for dtype in [DType::F16, DType::BF16] {
            let bn = BatchNorm2d::new(2, vb(dtype))?;
            let x = Tensor::randn(0f32, 1., (4, 2, 3, 3), &Device::Cpu)?.to_dtype(dtype)?;
            let y = bn.forward(&x, true, false)?;
            assert_eq!(y.dtype(), dtype);
            assert_eq!(bn.running_mean.as_tensor().dtype(), DType::F32);
        }
        Ok(())
    }
}
