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
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{Act, BiasAxis};

/// Three element types without CUDA's half-precision headers (NVRTC is not given include paths):
/// bf16 and f16 travel as 16-bit integers and are converted with PTX `cvt` (sm_80 and later).
const SOURCE: &str = r#"
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float get(const float* p, unsigned int i) { return p[i]; }
    static __device__ __forceinline__ void put(float* p, unsigned int i, float v) { p[i] = v; }
};
struct BF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(const T* p, unsigned int i) { return __uint_as_float(((unsigned int)p[i]) << 16); }
    static __device__ __forceinline__ void put(T* p, unsigned int i, float v) {
        unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
    }
};
struct F16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(const T* p, unsigned int i) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i])); return f;
    }
    static __device__ __forceinline__ void put(T* p, unsigned int i, float v) {
        unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
    }
};

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
        let grad = match self.act {
            Act::None => grad.clone(),
            // Through the ReLU only where it passed the value on.
            Act::Relu => relu_grad(grad, res)?,
            // gelu'(v) = Φ(v) + v φ(v), on v = x + b recomputed, in f32.
            Act::GeluErf => {
                let v = x.detach().apply_op2_no_bwd(&b.detach(), &BiasAct { axis: self.axis, act: Act::None })?.to_dtype(DType::F32)?;
                let cdf = ((v.affine(std::f64::consts::FRAC_1_SQRT_2, 0.0)?.erf()? + 1.0)? * 0.5)?;
                let pdf = (v.sqr()? * -0.5)?.exp()?.affine(1.0 / (2.0 * std::f64::consts::PI).sqrt(), 0.0)?;
                (grad.to_dtype(DType::F32)? * (cdf + (v * pdf)?)?)?.to_dtype(grad.dtype())?
            }
        };
        let db = match self.axis {
            BiasAxis::Channels => {
                let (n, c) = (grad.dim(0)?, grad.dim(1)?);
                grad.reshape((n, c, grad.elem_count() / (n * c).max(1)))?.sum(2)?.sum(0)?
            }
            BiasAxis::Last => {
                let c = grad.dim(grad.rank() - 1)?;
                grad.reshape((grad.elem_count() / c.max(1), c))?.sum(0)?
            }
        };
        Ok((Some(grad), Some(db)))
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
/// where x + b cancels exactly fairly often, makes a visible difference).
fn relu_grad(grad: &Tensor, res: &Tensor) -> Result<Tensor> {
    grad * res.gt(0.0)?.to_dtype(grad.dtype())?
}
