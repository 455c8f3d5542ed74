//! y = x + b (then ReLU when asked), with b broadcast along one axis of a contiguous x: a linear
//! layer's bias over the last axis, a convolution's over the channels of NCHW; and y = x + z (then
//! ReLU) for two tensors of one shape, the residual connections.
//!
//! Why: candle's broadcasting add recomputes a strided index with a division and a modulo per
//! dimension for every element. Nsight Compute on the H100 put it at 71% of ResNet-50's GPU time
//! (bf16, batch 128, with batch norm folded into bias adds) and 48% of ViT-B/16's — about 17x slower
//! than memory bandwidth allows. Here x is seen as planes: for a channel bias each plane
//! (image, channel) shares one bias value, for a last-axis bias each plane is a row and the bias is
//! read per column; no division per element. The residual add is here too, so that ResNet's add and
//! ReLU are one pass instead of two. Compiled with NVRTC on first use (the CUDA build links it
//! already).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{launch, Act, BiasAxis};

const SOURCE: &str = r#"
// x, y: planes x len, contiguous. per_plane: the bias is b[plane % channels] (NCHW channels);
// otherwise b[column] (the last axis). Blocks stride over planes in y and along a plane in x.
// act: 0 none, 1 ReLU, 2 GELU (erf form, as torch.nn.GELU()).
template <typename E>
__device__ void bias_act(const typename E::T* x, const typename E::T* b, typename E::T* y, unsigned int planes,
                         unsigned int len, unsigned int channels, int per_plane, int act) {
    for (unsigned int plane = blockIdx.y; plane < planes; plane += gridDim.y) {
        float plane_bias = per_plane ? E::get(b, plane % channels) : 0.f;
        unsigned int base = plane * len;
        for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < len; j += blockDim.x * gridDim.x) {
            float v = E::get(x, base + j) + (per_plane ? plane_bias : E::get(b, j));
            if (act == 1 && v < 0.f) v = 0.f;
            if (act == 2) v = 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
            E::put(y, base + j, v);
        }
    }
}

#define KERNEL(NAME, E)                                                                              \
extern "C" __global__ void NAME(const E::T* x, const E::T* b, E::T* y, unsigned int planes,         \
                                unsigned int len, unsigned int channels, int per_plane, int act) { \
    bias_act<E>(x, b, y, planes, len, channels, per_plane, act);                                    \
}
KERNEL(bias_act_f32, F32)
KERNEL(bias_act_bf16, BF16)
KERNEL(bias_act_f16, F16)

// y = x + z, then ReLU when asked; x, y, z contiguous with n elements.
template <typename E>
__device__ void add_act(const typename E::T* x, const typename E::T* z, typename E::T* y, unsigned int n, int relu) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float v = E::get(x, i) + E::get(z, i);
        if (relu && v < 0.f) v = 0.f;
        E::put(y, i, v);
    }
}

#define ADD_KERNEL(NAME, E)                                                                           \
extern "C" __global__ void NAME(const E::T* x, const E::T* z, E::T* y, unsigned int n, int relu) {   \
    add_act<E>(x, z, y, n, relu);                                                                     \
}
ADD_KERNEL(add_act_f32, F32)
ADD_KERNEL(add_act_bf16, BF16)
ADD_KERNEL(add_act_f16, F16)

// The gradient through act(x + b): dv = g act'(v). ReLU (act 1) reads the output y (the gradient
// passes where y > 0, as PyTorch's threshold_backward); GELU (act 2) recomputes v = x + b. Same
// geometry as bias_act.
template <typename E>
__device__ void bias_act_grad(const typename E::T* x, const typename E::T* b, const typename E::T* y,
                              const typename E::T* g, typename E::T* dv, unsigned int planes, unsigned int len,
                              unsigned int channels, int per_plane, int act) {
    for (unsigned int plane = blockIdx.y; plane < planes; plane += gridDim.y) {
        float plane_bias = per_plane ? E::get(b, plane % channels) : 0.f;
        unsigned long long base = (unsigned long long)plane * len;
        for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < len; j += blockDim.x * gridDim.x) {
            float gi = E::get(g, base + j);
            if (act == 1) {
                if (!(E::get(y, base + j) > 0.f)) gi = 0.f;
            } else {
                float v = E::get(x, base + j) + (per_plane ? plane_bias : E::get(b, j));
                float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
                float pdf = 0.39894228040143268f * expf(-0.5f * v * v);
                gi *= cdf + v * pdf;
            }
            E::put(dv, base + j, gi);
        }
    }
}

#define GRAD_KERNEL(NAME, E)                                                                           \
extern "C" __global__ void NAME(const E::T* x, const E::T* b, const E::T* y, const E::T* g, E::T* dv,  \
                                unsigned int planes, unsigned int len, unsigned int channels,          \
                                int per_plane, int act) {                                              \
    bias_act_grad<E>(x, b, y, g, dv, planes, len, channels, per_plane, act);                           \
}
GRAD_KERNEL(bias_act_grad_f32, F32)
GRAD_KERNEL(bias_act_grad_bf16, BF16)
GRAD_KERNEL(bias_act_grad_f16, F16)

// Column sums of x [rows, cols] by blocks of rows: partial[blockIdx.x * cols + j], f32. Threads of a
// warp read neighbouring columns of a row.
template <typename E>
__device__ void column_sums(const typename E::T* x, float* partial, unsigned int rows, unsigned int cols) {
    for (unsigned int j = blockIdx.y * blockDim.x + threadIdx.x; j < cols; j += blockDim.x * gridDim.y) {
        float s = 0.f;
        for (unsigned int r = blockIdx.x; r < rows; r += gridDim.x) s += E::get(x, (unsigned long long)r * cols + j);
        partial[(unsigned long long)blockIdx.x * cols + j] = s;
    }
}
#define SUM_KERNEL(NAME, E)                                                                            \
extern "C" __global__ void NAME(const E::T* x, float* partial, unsigned int rows, unsigned int cols) { \
    column_sums<E>(x, partial, rows, cols);                                                            \
}
SUM_KERNEL(column_sums_f32, F32)
SUM_KERNEL(column_sums_bf16, BF16)
SUM_KERNEL(column_sums_f16, F16)
"#;

fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    super::nvrtc::ptx(&PTX, SOURCE, "bias")
}

#[derive(Debug, Clone, Copy)]
pub struct BiasAct {
    pub axis: BiasAxis,
    pub act: Act,
}

impl BiasAct {
    /// (planes, plane length, channels, per_plane) of an x of `dims`.
    fn geometry(&self, dims: &[usize]) -> Result<(usize, usize, usize, bool)> {
        match self.axis {
            BiasAxis::Channels if dims.len() >= 2 => {
                let inner: usize = dims[2..].iter().product();
                Ok((dims[0] * dims[1], inner, dims[1], true))
            }
            BiasAxis::Last if !dims.is_empty() => {
                let len = dims[dims.len() - 1];
                Ok((dims.iter().product::<usize>() / len.max(1), len, len, false))
            }
            _ => bail!("bias add: an input of shape {dims:?} has no {:?} axis", self.axis),
        }
    }

    fn launch<T: CudaDType + cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaDevice,
        x: (&CudaStorage, &Layout),
        b: (&CudaStorage, &Layout),
        name: &str,
    ) -> Result<CudaStorage> {
        let (planes, len, channels, per_plane) = self.geometry(x.1.dims())?;
        if b.1.dims() != [channels] {
            bail!("bias add: a bias of shape {:?} for {channels} channels", b.1.dims())
        }
        let n = planes * len;
        if n > u32::MAX as usize {
            bail!("bias add: {n} elements is more than this kernel indexes")
        }
        let xs = x.0.as_cuda_slice::<T>()?.slice(x.1.start_offset()..);
        let bs = b.0.as_cuda_slice::<T>()?.slice(b.1.start_offset()..);
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(n)? };
        let func = dev.get_or_load_custom_func(name, "migprof_bias_act", ptx()?)?;
        let threads = 256u32;
        let blocks_x = (len as u32).div_ceil(threads).clamp(1, 1024);
        let cfg = LaunchConfig { grid_dim: (blocks_x, (planes as u32).clamp(1, 65535), 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (planes, len, channels) = (planes as u32, len as u32, channels as u32);
        let act: i32 = match self.act {
            Act::None => 0,
            Act::Relu => 1,
            Act::GeluErf => 2,
        };
        let per_plane = per_plane as i32;
        let mut builder = func.builder();
        builder.arg(&xs);
        builder.arg(&bs);
        builder.arg(&out);
        builder.arg(&planes);
        builder.arg(&len);
        builder.arg(&channels);
        builder.arg(&per_plane);
        builder.arg(&act);
        // SAFETY: argument types and order match the kernel; buffers hold planes x len and channels.
        unsafe { builder.launch(cfg) }.map_err(|e| candle_core::Error::Msg(format!("bias kernel: {e:?}")))?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
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
        if !xl.is_contiguous() || !bl.is_contiguous() {
            bail!("the bias kernel takes contiguous tensors")
        }
        if x.dtype() != b.dtype() {
            bail!("bias add: x is {:?}, the bias {:?}", x.dtype(), b.dtype())
        }
        let dev = x.device().clone();
        let out = match x.dtype() {
            DType::F32 => self.launch::<f32>(&dev, (x, xl), (b, bl), "bias_act_f32")?,
            DType::BF16 => self.launch::<half::bf16>(&dev, (x, xl), (b, bl), "bias_act_bf16")?,
            DType::F16 => self.launch::<half::f16>(&dev, (x, xl), (b, bl), "bias_act_f16")?,
            other => bail!("the bias kernel takes f32, bf16 or f16, not {other:?}"),
        };
        Ok((out, xl.shape().clone()))
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
        _ => grad.apply_op1_no_bwd(&BiasActGrad { op, x: x.clone(), b: b.clone(), y: y.clone() }),
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
        BiasAxis::Last => dv.apply_op1_no_bwd(&ColumnSums)?.sum(0)?.to_dtype(dv.dtype()),
    }
}

/// The gradient through [`BiasAct`]'s activation, applied to the output's gradient, holding the
/// forward's x, b and output y.
#[derive(Debug, Clone)]
struct BiasActGrad {
    op: BiasAct,
    x: Tensor,
    b: Tensor,
    y: Tensor,
}

impl CustomOp1 for BiasActGrad {
    fn name(&self) -> &'static str {
        "bias-act-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the bias kernel runs on CUDA devices only")
    }

    fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = "the bias kernel's backward";
        let (planes, len, channels, per_plane) = self.op.geometry(gl.dims())?;
        let (x, xl) = self.x.storage_and_layout();
        let (b, bl) = self.b.storage_and_layout();
        let (y, yl) = self.y.storage_and_layout();
        let (x, b, y) = (launch::cuda(&x, what)?, launch::cuda(&b, what)?, launch::cuda(&y, what)?);
        let n = planes * len;
        if n > u32::MAX as usize || xl.shape() != gl.shape() || yl.shape() != gl.shape() {
            bail!("{what}: x {:?}, y {:?} and the gradient {:?} must agree (and index in 32 bits)", xl.dims(), yl.dims(), gl.dims())
        }
        let dev = g.device().clone();
        let kernel = launch::name("bias_act_grad", g.dtype());
        let func = dev.get_or_load_custom_func(&kernel, "migprof_bias_act", ptx()?)?;
        let threads = 256u32;
        let cfg = LaunchConfig {
            grid_dim: ((len as u32).div_ceil(threads).clamp(1, 1024), (planes as u32).clamp(1, 65535), 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let (planes, len, channels, per_plane) = (planes as u32, len as u32, channels as u32, per_plane as i32);
        let act: i32 = if self.op.act == Act::Relu { 1 } else { 2 };
        let out = launch::by_dtype!(g.dtype(), what, T => {
            let (xv, bv, yv, gv) = (launch::view::<T>(x, xl, what)?, launch::view::<T>(b, bl, what)?, launch::view::<T>(y, yl, what)?, launch::view::<T>(g, gl, what)?);
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n)? };
            let mut builder = func.builder();
            builder.arg(&xv).arg(&bv).arg(&yv).arg(&gv).arg(&out).arg(&planes).arg(&len).arg(&channels).arg(&per_plane).arg(&act);
            // SAFETY: argument types and order match the kernel; x, y, g, out hold planes x len.
            unsafe { builder.launch(cfg) }.map_err(|e| launch::failed(&kernel, e))?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        });
        Ok((out, gl.shape().clone()))
    }
}

/// Column sums of a tensor seen as [rows, last dimension], as f32 partial sums [blocks, cols].
#[derive(Debug, Clone, Copy)]
struct ColumnSums;

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
        let blocks = rows.clamp(1, 256);
        let dev = x.device().clone();
        let kernel = launch::name("column_sums", x.dtype());
        let func = dev.get_or_load_custom_func(&kernel, "migprof_bias_act", ptx()?)?;
        let threads = 256u32;
        let cfg = LaunchConfig { grid_dim: (blocks as u32, (cols as u32).div_ceil(threads), 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (r, c) = (rows as u32, cols as u32);
        // SAFETY: every (block, column) is written.
        let out = unsafe { dev.alloc::<f32>(blocks * cols)? };
        launch::by_dtype!(x.dtype(), "column sums", T => {
            let xv = launch::view::<T>(x, l, "column sums")?;
            let mut builder = func.builder();
            builder.arg(&xv).arg(&out).arg(&r).arg(&c);
            // SAFETY: argument types and order match the kernel; x holds rows x cols, out blocks x cols.
            unsafe { builder.launch(cfg) }.map_err(|e| launch::failed(&kernel, e))?;
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
    fn launch<T: CudaDType + cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaDevice,
        x: (&CudaStorage, &Layout),
        z: (&CudaStorage, &Layout),
        name: &str,
    ) -> Result<CudaStorage> {
        let n = x.1.shape().elem_count();
        if n > u32::MAX as usize {
            bail!("add: {n} elements is more than this kernel indexes")
        }
        let xs = x.0.as_cuda_slice::<T>()?.slice(x.1.start_offset()..);
        let zs = z.0.as_cuda_slice::<T>()?.slice(z.1.start_offset()..);
        // SAFETY: the kernel writes every element.
        let out = unsafe { dev.alloc::<T>(n)? };
        let func = dev.get_or_load_custom_func(name, "migprof_bias_act", ptx()?)?;
        let cfg = LaunchConfig { grid_dim: ((n as u32).div_ceil(256).clamp(1, 65535 * 8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (n, relu) = (n as u32, self.relu as i32);
        let mut builder = func.builder();
        builder.arg(&xs);
        builder.arg(&zs);
        builder.arg(&out);
        builder.arg(&n);
        builder.arg(&relu);
        // SAFETY: argument types and order match the kernel; all three buffers hold n elements.
        unsafe { builder.launch(cfg) }.map_err(|e| candle_core::Error::Msg(format!("add kernel: {e:?}")))?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
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
        if !xl.is_contiguous() || !zl.is_contiguous() || xl.shape() != zl.shape() || x.dtype() != z.dtype() {
            bail!("the add kernel takes two contiguous tensors of one shape and dtype")
        }
        let dev = x.device().clone();
        let out = match x.dtype() {
            DType::F32 => self.launch::<f32>(&dev, (x, xl), (z, zl), "add_act_f32")?,
            DType::BF16 => self.launch::<half::bf16>(&dev, (x, xl), (z, zl), "add_act_bf16")?,
            DType::F16 => self.launch::<half::f16>(&dev, (x, xl), (z, zl), "add_act_f16")?,
            other => bail!("the add kernel takes f32, bf16 or f16, not {other:?}"),
        };
        Ok((out, xl.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _z: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = if self.relu { relu_grad(grad, res)? } else { grad.clone() };
        Ok((Some(grad.clone()), Some(grad)))
    }
}

/// grad where `res` > 0, else 0: the ReLU's gradient as PyTorch's `threshold_backward` takes it
/// (0 where the input was exactly 0; candle's own ReLU passes the gradient there, which in bf16,
/// where x + z cancels exactly fairly often, makes a visible difference). One pass of the bias
/// gradient kernel, which reads only y and g for a ReLU.
fn relu_grad(grad: &Tensor, res: &Tensor) -> Result<Tensor> {
    let flat = |t: &Tensor| t.contiguous()?.flatten_all()?.unsqueeze(0);
    let y = flat(res)?;
    let op = BiasAct { axis: BiasAxis::Last, act: Act::Relu };
    // x and b are not read for a ReLU; y stands in for both.
    flat(grad)?.apply_op1_no_bwd(&BiasActGrad { op, x: y.clone(), b: y.clone(), y })?.reshape(grad.dims())
}
