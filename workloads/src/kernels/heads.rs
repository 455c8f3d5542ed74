//! Attention's two layout changes in one pass each: [b, t, h * d] (a view whose rows may be strided,
//! as a slice of a packed q/k/v projection is) into contiguous [b, h, t, d], and back.
//!
//! Why: candle does these as reshape + transpose + contiguous, and its strided copy recomputes an
//! index with a division and a modulo per dimension for every element; a strided input to reshape
//! is copied once more before. Nsight Compute on the H100 put those copies at 28% of ViT-B/16's GPU
//! time (bf16, batch 128). Here a block copies whole rows of d elements, the row's origin computed
//! once. Elements are moved as raw 16- or 32-bit words.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

const SOURCE: &str = r#"
// split: x[bi * sb + ti * st + hi * d + j] -> y[((bi * h + hi) * t + ti) * d + j]
// merge: x[((bi * h + hi) * t + ti) * d + j] -> y[((bi * t + ti) * h + hi) * d + j]
template <typename W>
__device__ void heads(const W* x, W* y, unsigned int b, unsigned int t, unsigned int h, unsigned int d,
                      unsigned long long sb, unsigned long long st, int split) {
    unsigned long long rows = (unsigned long long)b * h * t;
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        unsigned long long src, dst = r * d;
        if (split) {
            unsigned int ti = r % t, hi = (r / t) % h;
            unsigned long long bi = r / ((unsigned long long)t * h);
            src = bi * sb + ti * st + (unsigned long long)hi * d;
        } else {
            unsigned int hi = r % h, ti = (r / h) % t;
            unsigned long long bi = r / ((unsigned long long)h * t);
            src = ((bi * h + hi) * t + ti) * d;
        }
        for (unsigned int j = threadIdx.x; j < d; j += blockDim.x) y[dst + j] = x[src + j];
    }
}
extern "C" __global__ void heads_u16(const unsigned short* x, unsigned short* y, unsigned int b, unsigned int t,
                                     unsigned int h, unsigned int d, unsigned long long sb, unsigned long long st, int split) {
    heads<unsigned short>(x, y, b, t, h, d, sb, st, split);
}
extern "C" __global__ void heads_u32(const unsigned int* x, unsigned int* y, unsigned int b, unsigned int t,
                                     unsigned int h, unsigned int d, unsigned long long sb, unsigned long long st, int split) {
    heads<unsigned int>(x, y, b, t, h, d, sb, st, split);
}
"#;

fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let compiled = PTX.get_or_init(|| {
        let opts = cudarc::nvrtc::CompileOptions { arch: Some("compute_80"), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
    });
    compiled.as_deref().map_err(|e| candle_core::Error::Msg(format!("compiling the heads kernel with NVRTC: {e}")))
}

/// `split`: [b, t, heads * d] -> [b, heads, t, d]; otherwise the inverse.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub heads: usize,
    pub split: bool,
}

impl Heads {
    fn launch<T: CudaDType + cudarc::driver::DeviceRepr, W: cudarc::driver::DeviceRepr>(&self, dev: &CudaDevice, x: &CudaStorage, l: &Layout, name: &str) -> Result<(CudaStorage, Shape)> {
        let (b, t, h, d, sb, st, shape) = if self.split {
            let (b, t, c) = l.shape().dims3()?;
            let s = l.stride();
            if s[2] != 1 || c % self.heads != 0 {
                bail!("split heads: rows must be contiguous and {c} features divisible by {} heads", self.heads)
            }
            let d = c / self.heads;
            (b, t, self.heads, d, s[0], s[1], Shape::from((b, self.heads, t, d)))
        } else {
            let (b, h, t, d) = l.shape().dims4()?;
            if !l.is_contiguous() {
                bail!("merge heads takes a contiguous input")
            }
            (b, t, h, d, 0, 0, Shape::from((b, t, h * d)))
        };
        let xs = x.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        // SAFETY: the same bytes seen as words of the element's size.
        let xw = unsafe { xs.transmute::<W>(xs.len()) }.ok_or_else(|| candle_core::Error::Msg("heads: reinterpreting the input".into()))?;
        // SAFETY: the kernel writes every element.
        let mut out = unsafe { dev.alloc::<T>(shape.elem_count())? };
        let n = out.len();
        let mut out_w = unsafe { out.transmute_mut::<W>(n) }.ok_or_else(|| candle_core::Error::Msg("heads: reinterpreting the output".into()))?;
        let func = dev.get_or_load_custom_func(name, "migprof_heads", ptx()?)?;
        let rows = (b * h * t) as u32;
        let cfg = LaunchConfig { grid_dim: (rows.clamp(1, 1 << 20), 1, 1), block_dim: ((d as u32).clamp(32, 256), 1, 1), shared_mem_bytes: 0 };
        let (b, t, h, d, sb, st, split) = (b as u32, t as u32, h as u32, d as u32, sb as u64, st as u64, self.split as i32);
        let mut builder = func.builder();
        builder.arg(&xw);
        builder.arg(&mut out_w);
        builder.arg(&b);
        builder.arg(&t);
        builder.arg(&h);
        builder.arg(&d);
        builder.arg(&sb);
        builder.arg(&st);
        builder.arg(&split);
        // SAFETY: argument types and order match the kernel; the strides address the input view.
        unsafe { builder.launch(cfg) }.map_err(|e| candle_core::Error::Msg(format!("heads kernel: {e:?}")))?;
        drop(builder);
        drop(out_w);
        Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape))
    }
}

impl CustomOp1 for Heads {
    fn name(&self) -> &'static str {
        "heads-layout"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the heads kernel runs on CUDA devices only; on the CPU migprof uses candle's transpose")
    }

    fn cuda_fwd(&self, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        match x.dtype() {
            DType::F32 => self.launch::<f32, u32>(&dev, x, l, "heads_u32"),
            DType::BF16 => self.launch::<half::bf16, u16>(&dev, x, l, "heads_u16"),
            DType::F16 => self.launch::<half::f16, u16>(&dev, x, l, "heads_u16"),
            other => bail!("the heads kernel takes f32, bf16 or f16, not {other:?}"),
        }
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // Each direction's gradient is the other direction.
        let inverse = Heads { heads: self.heads, split: !self.split };
        Ok(Some(grad.contiguous()?.apply_op1(inverse)?))
    }
}
