//! Max pooling over NCHW with padding (ResNet's 3×3 stride-2 pool), differentiable: one pass
//! forward, one pass backward.
//!
//! Why: candle's pooling has no backward for kernel != stride and no padding, so the CPU path builds
//! the pool from nine strided views and `maximum`, whose backward is three kernels per view over the
//! whole stem activation (ResNet-50 at batch 32: [32, 64, 112, 112]), on strided indexing.
//!
//! Forward keeps, per output, the first maximum of its window in row-major order (as PyTorch does;
//! padding never wins). Backward gathers: each input cell adds the gradients of the windows whose
//! maximum it is, found again by the same scan, so no atomics and no index tensor are needed.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::launch::{by_dtype, cuda as saved_storage, failed, name, view};

const SOURCE: &str = r#"
// The flat index (y * w + x) of the first maximum of window (oy, ox), or -1 when all is padding.
template <typename E>
__device__ __forceinline__ int window_max(const typename E::T* plane, int h, int w, int oy, int ox, int k, int s, int p) {
    int best = -1;
    float m = 0.f;
    for (int dy = 0; dy < k; dy++) {
        int y = oy * s - p + dy;
        if (y < 0 || y >= h) continue;
        for (int dx = 0; dx < k; dx++) {
            int x = ox * s - p + dx;
            if (x < 0 || x >= w) continue;
            float v = E::get(plane, y * w + x);
            if (best < 0 || v > m) { m = v; best = y * w + x; }
        }
    }
    return best;
}

// Forward (g == 0): out [planes, oh, ow] = window maxima of x. Backward: out [planes, h, w] = dx.
template <typename E>
__device__ void max_pool(const typename E::T* x, const typename E::T* g, typename E::T* out, unsigned int planes,
                         int h, int w, int oh, int ow, int k, int s, int p) {
    unsigned long long total = (unsigned long long)planes * (g ? h * w : oh * ow);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        if (!g) {
            unsigned long long plane = i / (oh * ow);
            int o = i % (oh * ow), oy = o / ow, ox = o % ow;
            const typename E::T* xp = x + plane * h * w;
            int at = window_max<E>(xp, h, w, oy, ox, k, s, p);
            E::put(out, i, at < 0 ? __int_as_float(0xff800000) : E::get(xp, at));
            continue;
        }
        unsigned long long plane = i / (h * w);
        int here = i % (h * w), y = here / w, xx = here % w;
        const typename E::T* xp = x + plane * h * w;
        // Windows oy with oy*s - p <= y <= oy*s - p + k - 1, likewise for x.
        int oy0 = max(0, (y + p - k + s) / s), oy1 = min(oh - 1, (y + p) / s);
        int ox0 = max(0, (xx + p - k + s) / s), ox1 = min(ow - 1, (xx + p) / s);
        float acc = 0.f;
        for (int oy = oy0; oy <= oy1; oy++)
            for (int ox = ox0; ox <= ox1; ox++)
                if (window_max<E>(xp, h, w, oy, ox, k, s, p) == here) acc += E::get(g, plane * oh * ow + oy * ow + ox);
        E::put(out, i, acc);
    }
}

#define KERNEL(S, E)                                                                                    \
extern "C" __global__ void max_pool_##S(const E::T* x, const E::T* g, E::T* out, unsigned int planes,   \
        int h, int w, int oh, int ow, int k, int s, int p) {                                            \
    max_pool<E>(x, g, out, planes, h, w, oh, ow, k, s, p);                                              \
}
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
"#;

super::nvrtc::compiled!(SOURCE, "max pool");

/// A k×k window moving by `stride`, the input padded by `padding` on every side.
#[derive(Debug, Clone, Copy)]
pub struct MaxPool {
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl MaxPool {
    /// (planes, h, w, oh, ow) of an NCHW input.
    fn geometry(&self, l: &Layout) -> Result<(usize, usize, usize, usize, usize)> {
        let (n, c, h, w) = l.shape().dims4()?;
        let (k, s, p) = (self.kernel, self.stride, self.padding);
        if k == 0 || s == 0 || p >= k || h + 2 * p < k || w + 2 * p < k {
            bail!("max pool {k}x{k} stride {s} padding {p} over a {h}x{w} input")
        }
        Ok((n * c, h, w, (h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1))
    }

    fn launch(&self, x: (&CudaStorage, &Layout), g: Option<(&CudaStorage, &Layout)>) -> Result<CudaStorage> {
        let (planes, h, w, oh, ow) = self.geometry(x.1)?;
        if planes * h * w > u32::MAX as usize {
            bail!("max pool over {planes} planes of {h}x{w} is more than this kernel indexes")
        }
        let dev = x.0.device().clone();
        let kernel = name("max_pool", x.0.dtype());
        let func = dev.get_or_load_custom_func(&kernel, "migprof_pool", ptx()?)?;
        let n = planes * if g.is_some() { h * w } else { oh * ow };
        let cfg = LaunchConfig { grid_dim: ((n as u32).div_ceil(256).clamp(1, 1 << 20), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let planes = planes as u32;
        let [h, w, oh, ow, k, s, p] = [h, w, oh, ow, self.kernel, self.stride, self.padding].map(|v| v as i32);
        by_dtype!(x.0.dtype(), "max pool", T => {
            let xv = view::<T>(x.0, x.1, "max pool")?;
            let gv = match g { Some((gs, gl)) => Some(view::<T>(gs, gl, "max pool's gradient")?), None => None };
            let null = 0u64;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n)? };
            let mut b = func.builder();
            b.arg(&xv);
            match &gv { Some(v) => b.arg(v), None => b.arg(&null) };
            b.arg(&out).arg(&planes).arg(&h).arg(&w).arg(&oh).arg(&ow).arg(&k).arg(&s).arg(&p);
            // SAFETY: argument types and order match the kernel; x holds planes·h·w, g planes·oh·ow.
            unsafe { b.launch(cfg) }.map_err(|e| failed(&kernel, e))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        })
    }
}

impl CustomOp1 for MaxPool {
    fn name(&self) -> &'static str {
        "max-pool"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the max-pool kernel runs on CUDA devices only; the CPU builds the pool from strided views")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n, c, _, _) = l.shape().dims4()?;
        let (_, _, _, oh, ow) = self.geometry(l)?;
        Ok((self.launch((s, l), None)?, Shape::from((n, c, oh, ow))))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&MaxPoolGrad { pool: *self, x: x.clone() })?))
    }
}

/// The backward pass, applied to the output's gradient, holding the forward's input.
#[derive(Debug, Clone)]
struct MaxPoolGrad {
    pool: MaxPool,
    x: Tensor,
}

impl CustomOp1 for MaxPoolGrad {
    fn name(&self) -> &'static str {
        "max-pool-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the max-pool kernel runs on CUDA devices only")
    }

    fn cuda_fwd(&self, g: &CudaStorage, gl: &Layout) -> Result<(CudaStorage, Shape)> {
        let (xs, xl) = self.x.storage_and_layout();
        let x = saved_storage(&xs, "max pool's backward")?;
        let (n, c, _, _) = xl.shape().dims4()?;
        let (_, _, _, oh, ow) = self.pool.geometry(xl)?;
        if gl.dims() != [n, c, oh, ow] {
            bail!("max pool's backward: a gradient of shape {:?} for an output of {:?}", gl.dims(), [n, c, oh, ow])
        }
        Ok((self.pool.launch((x, xl), Some((g, gl)))?, xl.shape().clone()))
    }
}
