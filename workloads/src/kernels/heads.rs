//! Attention's two layout changes in one pass each: [b, t, h * d] (a view whose rows may be strided,
//! as a slice of a packed q/k/v projection is) into contiguous [b, h, t, d], and back.
//!
//! Why: candle does these as reshape + transpose + contiguous, and its strided copy recomputes an
//! index with a division and a modulo per dimension for every element; a strided input to reshape
//! is copied once more before. Nsight Compute on the H100 put those copies at 28% of ViT-B/16's GPU
//! time (bf16, batch 128). Here each thread moves one word of up to 16 bytes (as many elements as
//! the head size, strides and offset allow), its row's origin computed from three divisions.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use cudarc::driver::{LaunchConfig, PushKernelArg};

const SOURCE: &str = r#"
struct __align__(16) W16 { unsigned int a, b, c, d; };

// In words of W (1 to 8 elements), with d, sb and st in words too:
// split: x[bi * sb + ti * st + hi * d + j] -> y[((bi * h + hi) * t + ti) * d + j]
// merge: x[((bi * h + hi) * t + ti) * d + j] -> y[((bi * t + ti) * h + hi) * d + j]
template <typename W>
__device__ void heads(const W* x, W* y, unsigned int b, unsigned int t, unsigned int h, unsigned int d,
                      unsigned long long sb, unsigned long long st, int split) {
    unsigned long long total = (unsigned long long)b * h * t * d;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long r = i / d;
        unsigned int j = i % d;
        unsigned long long src;
        if (split) {
            unsigned int ti = r % t, hi = (r / t) % h;
            unsigned long long bi = r / ((unsigned long long)t * h);
            src = bi * sb + ti * st + (unsigned long long)hi * d;
        } else {
            unsigned int hi = r % h, ti = (r / h) % t;
            unsigned long long bi = r / ((unsigned long long)h * t);
            src = ((bi * h + hi) * t + ti) * d;
        }
        y[i] = x[src + j];
    }
}
#define HEADS(NAME, W)                                                                               \
extern "C" __global__ void NAME(const W* x, W* y, unsigned int b, unsigned int t, unsigned int h,     \
                                unsigned int d, unsigned long long sb, unsigned long long st, int split) { \
    heads<W>(x, y, b, t, h, d, sb, st, split);                                                         \
}
HEADS(heads_w2, unsigned short)
HEADS(heads_w4, unsigned int)
HEADS(heads_w8, unsigned long long)
HEADS(heads_w16, W16)
"#;

super::nvrtc::compiled!(SOURCE, "heads");

/// `split`: [b, t, heads * d] -> [b, heads, t, d]; otherwise the inverse.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub heads: usize,
    pub split: bool,
}

impl Heads {
    fn launch<T: CudaDType + cudarc::driver::DeviceRepr>(&self, dev: &CudaDevice, x: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
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
        let size = std::mem::size_of::<T>();
        // The widest word (up to 16 bytes) that every row start and length is a multiple of.
        let k = [16 / size, 8 / size, 4 / size, 2 / size, 1]
            .into_iter()
            .filter(|&k| k >= 1)
            .find(|&k| d % k == 0 && sb % k == 0 && st % k == 0 && l.start_offset() % k == 0)
            .unwrap_or(1);
        let word = k * size;
        let xs = x.as_cuda_slice::<T>()?.slice(l.start_offset()..);
        let n = shape.elem_count();
        // SAFETY: the kernel writes every element.
        let mut out = unsafe { dev.alloc::<T>(n)? };
        let name = match word {
            2 => "heads_w2",
            4 => "heads_w4",
            8 => "heads_w8",
            _ => "heads_w16",
        };
        let func = dev.get_or_load_custom_func(name, "migprof_heads", ptx()?)?;
        let words = (n / k) as u64;
        let cfg = LaunchConfig { grid_dim: (words.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (b, t, h, dw, sbw, stw, split) = (b as u32, t as u32, h as u32, (d / k) as u32, (sb / k) as u64, (st / k) as u64, self.split as i32);
        let in_words = xs.len() / k;
        // The input view and output as words (u128 for the kernel's 16-byte W16; CUDA allocations
        // and the checked offsets give the alignment).
        macro_rules! go {
            ($w:ty) => {{
                // SAFETY: the same bytes seen as words of k elements.
                let xw = unsafe { xs.transmute::<$w>(in_words) }.ok_or_else(|| candle_core::Error::Msg("heads: reinterpreting the input".into()))?;
                let mut yw = unsafe { out.transmute_mut::<$w>(n / k) }.ok_or_else(|| candle_core::Error::Msg("heads: reinterpreting the output".into()))?;
                let mut builder = func.builder();
                builder.arg(&xw);
                builder.arg(&mut yw);
                builder.arg(&b);
                builder.arg(&t);
                builder.arg(&h);
                builder.arg(&dw);
                builder.arg(&sbw);
                builder.arg(&stw);
                builder.arg(&split);
                // SAFETY: argument types and order match the kernel; the strides address the view.
                unsafe { builder.launch(cfg) }.map_err(|e| candle_core::Error::Msg(format!("heads kernel: {e:?}")))?;
            }};
        }
        match word {
            2 => go!(u16),
            4 => go!(u32),
            8 => go!(u64),
            _ => go!(u128),
        }
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
            DType::F32 => self.launch::<f32>(&dev, x, l),
            DType::BF16 => self.launch::<half::bf16>(&dev, x, l),
            DType::F16 => self.launch::<half::f16>(&dev, x, l),
            other => bail!("the heads kernel takes f32, bf16 or f16, not {other:?}"),
        }
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // Each direction's gradient is the other direction.
        let inverse = Heads { heads: self.heads, split: !self.split };
        Ok(Some(grad.contiguous()?.apply_op1(inverse)?))
    }
}
