//! y = x + b (then ReLU when asked), with b broadcast along one axis of a contiguous x: a linear
//! layer's bias over the last axis, a convolution's over the channels of NCHW; and y = x + z (then
//! ReLU) for two tensors of one shape, the residual connections.
//!
//! Why: candle's broadcasting add recomputes a strided index with a division and a modulo per
//! dimension for every element, which made it a large share of ResNet-50's and ViT-B/16's GPU time,
//! far slower than memory bandwidth allows. Here x is seen as planes: for a channel bias each plane
//! (image, channel) shares one bias value, for a last-axis bias each plane is a row and the bias is
//! read per column. The residual add is here too, so that ResNet's add and ReLU are one pass instead
//! of two. Each thread moves 16 bytes (8 bf16 or 4 f32 values) where the shapes allow: with 2-byte
//! loads the kernel stayed well short of the memory bandwidth. Compiled with NVRTC on first use (the
//! CUDA build links it already). (measured: docs/kernels.md#elementwise)

use candle_core::{Result, Tensor};

/// Which axis of x a bias runs along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BiasAxis {
    /// Axis 1 of NCHW (any rank >= 2): one value per channel.
    Channels,
    /// The last axis: one value per feature.
    Last,
}

/// The activation applied after a bias add.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    None,
    Relu,
    /// GELU in its erf form, as `torch.nn.GELU()`.
    GeluErf,
}

impl Act {
    /// The activation with candle's own ops (its CPU kernels, or where no bias kernel runs).
    pub fn apply(self, y: Tensor) -> Result<Tensor> {
        match self {
            Act::None => Ok(y),
            Act::Relu => y.relu(),
            Act::GeluErf => y.gelu_erf(),
        }
    }
}

/// act(x + b), b broadcast along `axis`: one pass of our kernel on CUDA devices, candle's broadcast
/// add and activation elsewhere.
pub fn bias_act(x: &Tensor, b: &Tensor, axis: BiasAxis, act: Act) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return x.contiguous()?.apply_op2(&b.contiguous()?, cuda::BiasAct { axis, act });
    }
    let shape: Vec<usize> = match axis {
        BiasAxis::Channels => (0..x.rank()).map(|d| if d == 1 { b.elem_count() } else { 1 }).collect(),
        BiasAxis::Last => vec![b.elem_count()],
    };
    act.apply(x.broadcast_add(&b.reshape(shape)?)?)
}

/// [`bias_act`] written over x, for inference where nothing else holds x (a convolution's fresh
/// output): its input and its result are then not both held. On CUDA devices, x contiguous and
/// recording no gradient, our kernel in place; otherwise [`bias_act`]'s new tensor. The caller must
/// hold x's storage alone: a clone of x, or a tensor detached from it, shares that storage and would
/// read the result.
pub fn bias_act_over(x: Tensor, b: &Tensor, axis: BiasAxis, act: Act) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.is_contiguous() && !x.track_op() && !b.track_op() {
        x.inplace_op2(&b.contiguous()?, &cuda::BiasAct { axis, act })?;
        return Ok(x);
    }
    bias_act(&x, b, axis, act)
}

/// [`add`] written over x, as [`bias_act_over`] and on the same condition: the caller holds x's
/// storage alone (a residual block's last output, to which the shortcut is added).
pub fn add_over(x: Tensor, z: &Tensor, relu: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && x.is_contiguous()
        && !x.track_op()
        && !z.track_op()
        && x.dims() == z.dims()
        && x.dtype() == z.dtype()
    {
        x.inplace_op2(&z.contiguous()?, &cuda::AddAct { relu })?;
        return Ok(x);
    }
    add(&x, z, relu)
}

/// x + z (same shape), then ReLU when `relu`: one pass of our kernel on CUDA devices, candle's add
/// (and ReLU) elsewhere.
pub fn add(x: &Tensor, z: &Tensor, relu: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dims() == z.dims() && x.dtype() == z.dtype() {
        return x.contiguous()?.apply_op2(&z.contiguous()?, cuda::AddAct { relu });
    }
    let y = (x + z)?;
    if relu {
        y.relu()
    } else {
        Ok(y)
    }
}

/// x + bias, where the bias repeats along x's leading elements: its shape, leading 1s
/// left out, is [d0, rest..] against scores [.., s0, rest..] with d0 dividing s0 (Swin's [windows,
/// heads, n, n] against [batch * windows, heads, n, n]; position embeddings [tokens, d] against
/// [batch, tokens, d]). Then the add is one pass of the last-axis bias kernel over x seen as
/// [repeats, bias elements]; other shapes take candle's broadcast add.
pub fn add_repeating(scores: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let b: Vec<usize> = bias.dims().iter().copied().skip_while(|&d| d == 1).collect();
    let s = scores.dims();
    let fits = !b.is_empty() && b.len() <= s.len() && {
        let k = s.len() - b.len();
        s[k + 1..] == b[1..] && s[k].is_multiple_of(b[0])
    };
    if !fits {
        return scores.broadcast_add(bias);
    }
    let n = bias.elem_count();
    let flat = scores.reshape((scores.elem_count() / n, n))?;
    bias_act(&flat, &bias.flatten_all()?, BiasAxis::Last, Act::None)?.reshape(s)
}

/// x summed over its first axis, in f32 (bias gradients, per-block partial sums, a score bias's
/// gradient over images): the column-sum kernel on CUDA devices, then once more over its block rows
/// when it left more than one; candle's sum elsewhere. Why not candle's sum on the GPU: its
/// reduction over a leading axis took a large share of BERT-base's and Swin-T's training steps
/// (docs/kernels.md#elementwise).
pub fn sum_leading(x: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.rank() >= 2 {
        let rest = x.dims()[1..].to_vec();
        let flat = x.contiguous()?.reshape((x.dim(0)?, rest.iter().product::<usize>()))?;
        let mut partial = flat.apply_op1_no_bwd(&cuda::ColumnSums { whole: false })?;
        if partial.dim(0)? > 1 {
            partial = partial.apply_op1_no_bwd(&cuda::ColumnSums { whole: true })?;
        }
        return partial.reshape(rest);
    }
    x.to_dtype(candle_core::DType::F32)?.sum(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn a_repeating_bias_is_added_as_broadcasting_would() -> Result<()> {
        let scores = Tensor::arange(0f32, 48., &Device::Cpu)?.reshape((4, 2, 3, 2))?;
        // [windows = 2, heads, n, n] against [batch * windows = 4, ...]: repeats every 2.
        let bias = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((2, 2, 3, 2))?;
        let want = scores
            .reshape((2, 2, 2, 3, 2))?
            .broadcast_add(&bias.unsqueeze(0)?)?
            .reshape((4, 2, 3, 2))?;
        assert_eq!(
            add_repeating(&scores, &bias)?.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?
        );
        // [1, heads, n, n] and a BERT-style [batch, 1, 1, n] mask go as broadcasting does.
        for b in [
            Tensor::ones((1, 2, 3, 2), DType::F32, &Device::Cpu)?,
            Tensor::ones((4, 1, 1, 2), DType::F32, &Device::Cpu)?,
        ] {
            let want = scores.broadcast_add(&b)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(add_repeating(&scores, &b)?.flatten_all()?.to_vec1::<f32>()?, want);
        }
        Ok(())
    }
}

/// The ReLU's gradient of two branches' gradients summed, in one pass (CUDA devices).
#[cfg(feature = "cuda")]
pub use cuda::relu_grad_of_sum;

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

    use super::{Act, BiasAxis};
    use crate::kernels::launch::{self, Kernel};

    /// What is added before the activation.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Addend {
        /// b[column]: [len].
        Columns,
        /// b[plane % channels]: [channels].
        Channels(usize),
        None,
        /// z, of x's shape.
        Same,
    }

    impl Addend {
        fn code(self) -> i32 {
            match self {
                Addend::Columns => 0,
                Addend::Channels(_) => 1,
                Addend::None => 2,
                Addend::Same => 3,
            }
        }
    }

    fn act_code(act: Act) -> i32 {
        match act {
            Act::None => 0,
            Act::Relu => 1,
            Act::GeluErf => 2,
        }
    }

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    fn opt_view<'a, T: CudaDType + DeviceRepr>(a: Option<Arg<'a>>, what: &str) -> Result<Option<CudaView<'a, T>>> {
        a.map(|(s, l)| launch::view::<T>(s, l, what)).transpose()
    }

    /// One pass of the elementwise kernel over x's `len`-long planes: the forward (g None) or the
    /// gradient.
    struct Pass<'a> {
        x: Arg<'a>,
        b: Option<Arg<'a>>,
        y: Option<Arg<'a>>,
        g: Option<Arg<'a>>,
        len: usize,
        addend: Addend,
        act: Act,
    }

    impl Pass<'_> {
        /// The pass into a new buffer.
        fn run(&self) -> Result<CudaStorage> {
            let n = self.checked_len()?;
            launch::by_dtype!(self.x.0.dtype(), "the bias kernel", T => self.typed::<T>(n, false))
                .map(|out| out.expect("a new buffer"))
        }

        /// The pass written over x itself (each thread reads its elements before writing them), x
        /// contiguous. The caller holds x's buffer alone (see [`BiasAct::over`]).
        fn run_over_x(&self) -> Result<()> {
            if !self.x.1.is_contiguous() {
                bail!(
                    "an elementwise pass written over x needs x contiguous, not of layout {:?}",
                    self.x.1
                )
            }
            let n = self.checked_len()?;
            launch::by_dtype!(self.x.0.dtype(), "the bias kernel", T => self.typed::<T>(n, true)).map(|_| ())
        }

        fn checked_len(&self) -> Result<usize> {
            let n = self.x.1.shape().elem_count();
            if n > u32::MAX as usize || self.len == 0 {
                bail!(
                    "bias kernel: {n} elements in rows of {} is empty or more than it indexes",
                    self.len
                )
            }
            Ok(n)
        }

        fn typed<T: CudaDType + DeviceRepr>(&self, n: usize, over_x: bool) -> Result<Option<CudaStorage>> {
            let what = "the bias kernel";
            let x = launch::view::<T>(self.x.0, self.x.1, what)?;
            let (b, y, g) = (
                opt_view::<T>(self.b, what)?,
                opt_view::<T>(self.y, what)?,
                opt_view::<T>(self.g, what)?,
            );
            // 16-byte words where every view starts on one and planes hold whole words.
            let size = std::mem::size_of::<T>();
            let starts = [
                Some(self.x.1),
                self.b.map(|a| a.1),
                self.y.map(|a| a.1),
                self.g.map(|a| a.1),
            ];
            let mut counts: Vec<usize> = starts.iter().flatten().map(|l| l.start_offset()).chain([n]).collect();
            // A last-axis bias is read as b[j..j + V] from one row; a channel bias may straddle planes.
            if let Addend::Columns = self.addend {
                counts.push(self.len);
            }
            let v = if launch::whole_words(size, &counts) {
                16 / size
            } else {
                1
            };
            let dev = self.x.0.device().clone();
            let kernel = format!("{}_v{v}", launch::name("elementwise", self.x.0.dtype()));
            let func = Kernel::load(&dev, &crate::kernels::sources::ELEMENTWISE, &kernel)?;
            // SAFETY: the kernel writes every element.
            let out = if over_x {
                None
            } else {
                Some(unsafe { dev.alloc::<T>(n)? })
            };
            let stream = dev.cuda_stream();
            // x's address as the output, its guard held across the launch (with cudarc's events on,
            // its event then follows the kernel that writes x).
            let x_guarded = over_x.then(|| x.device_ptr(&stream));
            let x_ptr = x_guarded.as_ref().map(|(ptr, _)| *ptr);
            let cfg = LaunchConfig {
                grid_dim: (((n / v) as u32).div_ceil(256).clamp(1, 1 << 20), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let channels = match self.addend {
                Addend::Channels(c) => c as u32,
                _ => 1,
            };
            let (n32, len, mode, act) = (n as u32, self.len as u32, self.addend.code(), act_code(self.act));
            // Absent b and y are not read (x stands in for them); a null g makes the pass a forward one.
            let null = 0u64;
            let mut a = func.builder();
            a.arg(&x);
            for input in [&b, &y] {
                match input {
                    Some(view) => a.arg(view),
                    None => a.arg(&x),
                };
            }
            match &g {
                Some(view) => a.arg(view),
                None => a.arg(&null),
            };
            match (&out, &x_ptr) {
                (Some(out), _) => a.arg(out),
                (None, Some(ptr)) => a.arg(ptr),
                (None, None) => bail!("the bias kernel: no output"),
            };
            a.arg(&n32).arg(&len).arg(&channels).arg(&mode).arg(&act);
            // SAFETY: argument types and order match the kernel; x, y, g and out hold n elements, b what
            // its mode indexes (checked by the callers); words only where starts and lengths allow.
            // Written over x, every element is read by the thread that then writes it.
            unsafe { func.launch(&mut a, cfg) }?;
            drop(x_guarded);
            Ok(out.map(|out| CudaStorage::wrap_cuda_slice(out, dev)))
        }
    }

    #[derive(Debug, Clone, Copy)]
    pub struct BiasAct {
        pub axis: BiasAxis,
        pub act: Act,
    }

    impl BiasAct {
        /// (plane length, addend) of an x of `dims` and a bias of `bias` elements.
        fn geometry(&self, dims: &[usize], bias: usize) -> Result<(usize, Addend)> {
            let (len, addend, channels) = match self.axis {
                BiasAxis::Channels if dims.len() >= 2 => {
                    (dims[2..].iter().product(), Addend::Channels(dims[1]), dims[1])
                }
                BiasAxis::Last if !dims.is_empty() => (dims[dims.len() - 1], Addend::Columns, dims[dims.len() - 1]),
                _ => bail!("bias add: an input of shape {dims:?} has no {:?} axis", self.axis),
            };
            if bias != channels {
                bail!("bias add: a bias of {bias} elements for {channels} channels")
            }
            Ok((len, addend))
        }

        /// The forward pass over x with the bias b, into a new buffer or over x.
        fn pass<'a>(&self, x: Arg<'a>, b: Arg<'a>) -> Result<Pass<'a>> {
            if x.0.dtype() != b.0.dtype() {
                bail!("bias add: x is {:?}, the bias {:?}", x.0.dtype(), b.0.dtype())
            }
            let (len, addend) = self.geometry(x.1.dims(), b.1.shape().elem_count())?;
            Ok(Pass {
                x,
                b: Some(b),
                y: None,
                g: None,
                len,
                addend,
                act: self.act,
            })
        }

        /// act(v + b) written over v: after a GEMM whose product nothing else reads (a linear
        /// layer's, `kernels::linear`), so that the product and the activation, each as wide as
        /// the layer's output, are not both held.
        pub(crate) fn over(&self, v: &mut CudaStorage, vl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<()> {
            self.pass((v, vl), (b, bl))?.run_over_x()
        }
    }

    /// In place: [`super::bias_act_over`].
    impl candle_core::InplaceOp2 for BiasAct {
        fn name(&self) -> &'static str {
            "bias-act-over"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            bail!("the bias kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, x: &mut CudaStorage, xl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<()> {
            self.over(x, xl, b, bl)
        }
    }

    impl CustomOp2 for BiasAct {
        fn name(&self) -> &'static str {
            "bias-act"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the bias kernel runs on CUDA devices only; on the CPU migprof uses candle's broadcast add")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, b: &CudaStorage, bl: &Layout) -> Result<(CudaStorage, Shape)> {
            Ok((self.pass((x, xl), (b, bl))?.run()?, xl.shape().clone()))
        }

        fn bwd(&self, x: &Tensor, b: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dv = act_grad(*self, x, b, res, grad)?;
            let db = bias_grad(self.axis, &dv)?;
            Ok((Some(dv), Some(db)))
        }
    }

    /// The gradient of act(x + b) with respect to its input, from the output y's gradient `grad`.
    pub(crate) fn act_grad(op: BiasAct, x: &Tensor, b: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let grad = grad.contiguous()?;
        match op.act {
            Act::None => Ok(grad),
            _ => grad.apply_op1_no_bwd(&ActGrad {
                act: op.act,
                bias: Some((op, b.clone())),
                sum: None,
                x: x.clone(),
                y: y.clone(),
            }),
        }
    }

    /// The bias's gradient: `dv` summed over everything but the bias's axis.
    pub(crate) fn bias_grad(axis: BiasAxis, dv: &Tensor) -> Result<Tensor> {
        match axis {
            // Per plane along its contiguous length (candle's last-axis sum), then over the batch.
            BiasAxis::Channels => {
                let (n, c) = (dv.dim(0)?, dv.dim(1)?);
                dv.reshape((n, c, dv.elem_count() / (n * c).max(1)))?.sum(2)?.sum(0)
            }
            BiasAxis::Last => {
                let cols = *dv.dims().last().unwrap_or(&1);
                super::sum_leading(&dv.reshape((dv.elem_count() / cols.max(1), cols))?)?.to_dtype(dv.dtype())
            }
        }
    }

    /// act(x) on its own, no bias: the activation after a linear layer whose pre-activation is kept
    /// (f32, where recomputing it would cost a GEMM as long as the layer's own).
    #[derive(Debug, Clone, Copy)]
    pub struct Activation(pub Act);

    impl CustomOp1 for Activation {
        fn name(&self) -> &'static str {
            "activation"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the activation kernel runs on CUDA devices only; on the CPU migprof uses candle's")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
            let len = *xl.dims().last().unwrap_or(&1);
            let out = Pass {
                x: (x, xl),
                b: None,
                y: None,
                g: None,
                len,
                addend: Addend::None,
                act: self.0,
            }
            .run()?;
            Ok((out, xl.shape().clone()))
        }

        fn bwd(&self, x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
            let grad = grad.contiguous()?;
            Ok(Some(match self.0 {
                Act::None => grad,
                act => grad.apply_op1_no_bwd(&ActGrad {
                    act,
                    bias: None,
                    sum: None,
                    x: x.clone(),
                    y: y.clone(),
                })?,
            }))
        }
    }

    /// The gradient through an activation (after a bias when `bias` is set), applied to the output's
    /// gradient, holding the forward's x (and b) and output y.
    #[derive(Debug, Clone)]
    struct ActGrad {
        act: Act,
        bias: Option<(BiasAct, Tensor)>,
        /// A second gradient of the output's shape, added to the first (ReLU only).
        sum: Option<Tensor>,
        x: Tensor,
        y: Tensor,
    }

    impl CustomOp1 for ActGrad {
        fn name(&self) -> &'static str {
            "activation-grad"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the bias kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
            let what = "the activation's backward";
            let (x, xl) = self.x.storage_and_layout();
            let (y, yl) = self.y.storage_and_layout();
            let b = match (&self.bias, &self.sum) {
                (Some((_, b)), None) => Some(b.storage_and_layout()),
                (None, Some(z)) if self.act == Act::Relu => Some(z.storage_and_layout()),
                (None, None) => None,
                _ => bail!("{what}: a bias and a second gradient, or a second gradient through no ReLU"),
            };
            if xl.shape() != gl.shape() || yl.shape() != gl.shape() {
                bail!(
                    "{what}: x {:?}, y {:?} and the gradient {:?} must agree",
                    xl.dims(),
                    yl.dims(),
                    gl.dims()
                )
            }
            let (len, addend) = match (&self.bias, &b) {
                (Some((op, _)), Some((_, bl))) => op.geometry(gl.dims(), bl.shape().elem_count())?,
                (None, Some((_, zl))) if zl.shape() == gl.shape() => (*gl.dims().last().unwrap_or(&1), Addend::Same),
                (None, Some((_, zl))) => bail!("{what}: a second gradient {:?} for {:?}", zl.dims(), gl.dims()),
                _ => (*gl.dims().last().unwrap_or(&1), Addend::None),
            };
            let b = match &b {
                Some((s, l)) => Some((launch::cuda(s, what)?, *l)),
                None => None,
            };
            let pass = Pass {
                x: (launch::cuda(&x, what)?, xl),
                b,
                y: Some((launch::cuda(&y, what)?, yl)),
                g: Some((g, gl)),
                len,
                addend,
                act: self.act,
            };
            Ok((pass.run()?, gl.shape().clone()))
        }
    }

    /// Column sums of a tensor seen as [rows, last dimension], as f32 partial sums [blocks, cols];
    /// `whole`: in one block row ([1, cols]), for rows few enough (partial sums themselves).
    #[derive(Debug, Clone, Copy)]
    pub(super) struct ColumnSums {
        pub whole: bool,
    }

    impl CustomOp1 for ColumnSums {
        fn name(&self) -> &'static str {
            "column-sums"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the column-sum kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let cols = *l.dims().last().unwrap_or(&1);
            let rows = l.shape().elem_count() / cols.max(1);
            if rows * cols > u32::MAX as usize || cols == 0 {
                bail!("column sums of {rows} x {cols}: empty or more than the kernel indexes")
            }
            // Words of v columns across a block's lanes x (up to 32), the rest of its 256 threads
            // down the rows; a block row takes 16 rows a thread or more, so that a batch's worth of
            // rows (a 1x1 convolution's per-image filter gradients, 32 of them) is summed in one
            // block row, with no partial sums left to add.
            let v = launch::word_elements(x.dtype().size_in_bytes(), &[cols, l.start_offset()]);
            let words = (cols / v) as u32;
            // A whole pass (partial sums: few rows) takes up to 8 lanes across and more rows at
            // once, so that its few blocks each read few rows in turn.
            let lx = words.next_power_of_two().min(if self.whole { 8 } else { 32 });
            let ly = 256 / lx;
            let blocks = if self.whole {
                1
            } else {
                (rows / (ly as usize * 16)).clamp(1, 256)
            };
            let dev = x.device().clone();
            let kernel = format!("{}_v{v}", launch::name("column_sums", x.dtype()));
            let func = Kernel::load(&dev, &crate::kernels::sources::ELEMENTWISE, &kernel)?;
            let cfg = LaunchConfig {
                grid_dim: (words.div_ceil(lx), blocks as u32, 1),
                block_dim: (lx, ly, 1),
                shared_mem_bytes: 0,
            };
            let (r, c) = (rows as u32, cols as u32);
            // SAFETY: every (block row, column) is written.
            let out = unsafe { dev.alloc::<f32>(blocks * cols)? };
            launch::by_dtype!(x.dtype(), "column sums", T => {
                let xv = launch::view::<T>(x, l, "column sums")?;
                let mut builder = func.builder();
                builder.arg(&xv).arg(&out).arg(&r).arg(&c);
                // SAFETY: argument types and order match the kernel; x holds rows x cols from a start
                // on a word of v, out blocks x cols; a block has 256 threads.
                unsafe { func.launch(&mut builder, cfg) }?;
            });
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((blocks, cols))))
        }
    }

    /// y = x + z (then ReLU), x and z of one shape.
    #[derive(Debug, Clone, Copy)]
    pub struct AddAct {
        pub relu: bool,
    }

    impl AddAct {
        /// The forward pass over x and z, into a new buffer or over x.
        fn pass<'a>(&self, x: Arg<'a>, z: Arg<'a>) -> Result<Pass<'a>> {
            if x.1.shape() != z.1.shape() || x.0.dtype() != z.0.dtype() {
                bail!("the add kernel takes two tensors of one shape and dtype")
            }
            let act = if self.relu { Act::Relu } else { Act::None };
            let len = *x.1.dims().last().unwrap_or(&1);
            Ok(Pass {
                x,
                b: Some(z),
                y: None,
                g: None,
                len,
                addend: Addend::Same,
                act,
            })
        }
    }

    impl CustomOp2 for AddAct {
        fn name(&self) -> &'static str {
            "add-act"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
            bail!("the add kernel runs on CUDA devices only; on the CPU migprof uses candle's add")
        }

        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout, z: &CudaStorage, zl: &Layout) -> Result<(CudaStorage, Shape)> {
            Ok((self.pass((x, xl), (z, zl))?.run()?, xl.shape().clone()))
        }

        fn bwd(
            &self,
            _x: &Tensor,
            _z: &Tensor,
            res: &Tensor,
            grad: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let grad = if self.relu { relu_grad(grad, res)? } else { grad.clone() };
            Ok((Some(grad.clone()), Some(grad)))
        }
    }

    /// In place: [`super::add_over`].
    impl candle_core::InplaceOp2 for AddAct {
        fn name(&self) -> &'static str {
            "add-act-over"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            bail!("the add kernel runs on CUDA devices only")
        }

        fn cuda_fwd(&self, x: &mut CudaStorage, xl: &Layout, z: &CudaStorage, zl: &Layout) -> Result<()> {
            self.pass((x, xl), (z, zl))?.run_over_x()
        }
    }

    /// a + b where `res` > 0, else 0: the gradient of a ReLU whose output `res` fed two branches, from
    /// the branches' gradients, in one pass (a residual block's input, the block below's output).
    pub fn relu_grad_of_sum(a: &Tensor, b: &Tensor, res: &Tensor) -> Result<Tensor> {
        if a.dims() != b.dims() || a.dtype() != b.dtype() {
            bail!("the ReLU's gradient of a sum takes two gradients of one shape and dtype")
        }
        let res = res.contiguous()?;
        a.contiguous()?.apply_op1_no_bwd(&ActGrad {
            act: Act::Relu,
            bias: None,
            sum: Some(b.contiguous()?),
            x: res.clone(),
            y: res,
        })
    }

    /// grad where `res` > 0, else 0: the ReLU's gradient as PyTorch's `threshold_backward` takes it
    /// (0 where the input was exactly 0; candle's own ReLU passes the gradient there, which in bf16,
    /// where x + z cancels exactly fairly often, makes a visible difference).
    pub(crate) fn relu_grad(grad: &Tensor, res: &Tensor) -> Result<Tensor> {
        let res = res.contiguous()?;
        // A ReLU's gradient reads only y; y stands in for x.
        grad.contiguous()?.apply_op1_no_bwd(&ActGrad {
            act: Act::Relu,
            bias: None,
            sum: None,
            x: res.clone(),
            y: res,
        })
    }
}
