//! Softmax over the last axis and layer normalisation, each one differentiable op with a kernel for
//! its forward and for its backward pass.
//!
//! Why: built from candle's primitives, a training step's layer norm is ~11 kernels forward and
//! ~25 backward and a softmax 5 and ~10, most of them candle's broadcasting binary kernels, which
//! recompute a strided index per element. Nsight Compute on the H100 put those broadcasting kernels
//! at 41% of ViT-B/16's training step (bf16, batch 32, 5,236 launches). Here each is one pass over
//! its rows forward, and backward one pass for the input's gradient plus, for layer norm, one for
//! the weight's and bias's (per-block column sums, added up by candle).
//!
//! Statistics and sums are in f32 for f32/bf16/f16 (f64 for f64 on the CPU, which is where the
//! gradients are checked against finite differences); the CPU loops are the CUDA kernels' reference.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::cpu;

/// Rows of a tensor seen as [rows, cols], cols its last dimension.
fn rows_cols(l: &Layout) -> Result<(usize, usize)> {
    let cols = *l.dims().last().ok_or_else(|| candle_core::Error::Msg("a row op on a scalar".into()))?;
    if cols == 0 {
        bail!("a row op on rows of length 0")
    }
    Ok((l.shape().elem_count() / cols, cols))
}

/// softmax(x) over the last dimension.
#[derive(Debug, Clone, Copy)]
pub struct Softmax;

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax-last"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(l)?;
        let mut v = cpu::values(s, l)?;
        for row in v.chunks_mut(cols) {
            let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter_mut().map(|x| {
                *x = (*x - m).exp();
                *x
            }).sum();
            row.iter_mut().for_each(|x| *x /= sum);
        }
        Ok((cpu::storage(v, s.dtype())?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(l)?;
        Ok((cuda::warp_rows(s, l, None, "softmax_fwd", rows, cols)?, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(y.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxGrad)?))
    }
}

/// dx = y (g - Σ g y) per row, from the softmax's output y and the output's gradient g.
#[derive(Debug, Clone, Copy)]
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-last-grad"
    }

    fn cpu_fwd(&self, ys: &CpuStorage, yl: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(yl)?;
        let (y, g) = (cpu::values(ys, yl)?, cpu::values(gs, gl)?);
        let mut dx = Vec::with_capacity(y.len());
        for (yr, gr) in y.chunks(cols).zip(g.chunks(cols)) {
            let dot: f64 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            dx.extend(yr.iter().zip(gr).map(|(y, g)| y * (g - dot)));
        }
        Ok((cpu::storage(dx, gs.dtype())?, yl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ys: &candle_core::CudaStorage,
        yl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(yl)?;
        Ok((cuda::warp_rows(ys, yl, Some((gs, gl)), "softmax_bwd", rows, cols)?, yl.shape().clone()))
    }
}

/// Layer normalisation over the last dimension with weight and bias, as `torch.nn.LayerNorm`:
/// y = (x - mean) / sqrt(var + eps) · w + b, var the biased variance.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    pub eps: f64,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(xl)?;
        let (x, w, b) = (cpu::values(xs, xl)?, cpu::values(ws, wl)?, cpu::values(bs, bl)?);
        check_params(cols, w.len(), b.len())?;
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(cols) {
            let (mean, rstd) = row_stats(row, self.eps);
            y.extend(row.iter().zip(w.iter().zip(&b)).map(|(x, (w, b))| (x - mean) * rstd * w + b));
        }
        Ok((cpu::storage(y, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        bs: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(xl)?;
        check_params(cols, wl.shape().elem_count(), bl.shape().elem_count())?;
        let out = cuda::layer_norm(cuda::LnArgs { x: (xs, xl), w: (ws, wl), third: (bs, bl), rows, cols, eps: self.eps }, cuda::LnPass::Forward)?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _b: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let dx = x.apply_op3_no_bwd(w, &g, &LayerNormGrad { eps: self.eps, params: false })?;
        // [blocks, 2, cols] sums of g·x̂ and of g, one row pair per block of rows.
        let partial = x.apply_op3_no_bwd(w, &g, &LayerNormGrad { eps: self.eps, params: true })?.sum(0)?;
        let dw = partial.get(0)?.to_dtype(w.dtype())?;
        let db = partial.get(1)?.to_dtype(w.dtype())?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

fn check_params(cols: usize, w: usize, b: usize) -> Result<()> {
    if w != cols || b != cols {
        bail!("layer norm over {cols} features with a weight of {w} and a bias of {b}")
    }
    Ok(())
}

/// (mean, 1 / sqrt(biased variance + eps)) of a row.
fn row_stats(row: &[f64], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The backward pass of [`LayerNorm`], on (x, w, g): with x̂ = (x - mean)·rstd and h = g·w,
/// dx = rstd (h - mean(h) - x̂ mean(h x̂)) per row; or, with `params`, the column sums of g·x̂ (dw)
/// and of g (db), as [blocks, 2, cols] per-block partial sums in the accumulation dtype.
#[derive(Debug, Clone, Copy)]
struct LayerNormGrad {
    eps: f64,
    params: bool,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (_, cols) = rows_cols(xl)?;
        let (x, w, g) = (cpu::values(xs, xl)?, cpu::values(ws, wl)?, cpu::values(gs, gl)?);
        let n = cols as f64;
        let mut dx = Vec::with_capacity(if self.params { 0 } else { x.len() });
        let mut sums = vec![0f64; 2 * cols];
        for (xr, gr) in x.chunks(cols).zip(g.chunks(cols)) {
            let (mean, rstd) = row_stats(xr, self.eps);
            let xhat = xr.iter().map(|x| (x - mean) * rstd);
            if self.params {
                for (j, (xh, g)) in xhat.zip(gr).enumerate() {
                    sums[j] += g * xh;
                    sums[cols + j] += g;
                }
                continue;
            }
            let xhat: Vec<f64> = xhat.collect();
            let h: Vec<f64> = gr.iter().zip(&w).map(|(g, w)| g * w).collect();
            let mean_h = h.iter().sum::<f64>() / n;
            let mean_hx = h.iter().zip(&xhat).map(|(h, x)| h * x).sum::<f64>() / n;
            dx.extend(h.iter().zip(&xhat).map(|(h, x)| rstd * (h - mean_h - x * mean_hx)));
        }
        if self.params {
            let acc = cpu::accumulation(xs.dtype());
            return Ok((cpu::storage(sums, acc)?, Shape::from((1, 2, cols))));
        }
        Ok((cpu::storage(dx, gs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, cols) = rows_cols(xl)?;
        let args = cuda::LnArgs { x: (xs, xl), w: (ws, wl), third: (gs, gl), rows, cols, eps: self.eps };
        if self.params {
            let blocks = cuda::param_blocks(rows);
            Ok((cuda::layer_norm(args, cuda::LnPass::ParamSums { blocks })?, Shape::from((blocks, 2, cols))))
        } else {
            Ok((cuda::layer_norm(args, cuda::LnPass::InputGrad)?, xl.shape().clone()))
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, CudaStorage, Layout, Result};

    use crate::kernels::launch::{by_dtype, failed, name, view};

    const SOURCE: &str = r#"
// One warp per row, the row read from L1/L2 on each pass (rows are short: attention's keys).
// Forward: y = softmax(x). Backward (g != 0): x holds the forward's output y, dx = y (g - Σ g y).
template <typename E>
__device__ void softmax_rows(const typename E::T* x, const typename E::T* g, typename E::T* out,
                             unsigned int rows, unsigned int cols) {
    unsigned int lane = threadIdx.x & 31;
    unsigned int warps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        unsigned long long base = (unsigned long long)r * cols;
        if (g) {
            float dot = 0.f;
            for (unsigned int j = lane; j < cols; j += 32) dot += E::get(x, base + j) * E::get(g, base + j);
            dot = warp_sum(dot);
            for (unsigned int j = lane; j < cols; j += 32) {
                float y = E::get(x, base + j);
                E::put(out, base + j, y * (E::get(g, base + j) - dot));
            }
            continue;
        }
        float m = __int_as_float(0xff800000);  // -inf
        for (unsigned int j = lane; j < cols; j += 32) m = fmaxf(m, E::get(x, base + j));
        m = warp_max(m);
        float s = 0.f;
        for (unsigned int j = lane; j < cols; j += 32) s += expf(E::get(x, base + j) - m);
        float inv = 1.f / warp_sum(s);
        for (unsigned int j = lane; j < cols; j += 32) E::put(out, base + j, expf(E::get(x, base + j) - m) * inv);
    }
}

// Layer norm, one block per row (blocks stride over rows); each thread keeps up to PER elements
// of its row in registers (columns threadIdx.x + k * blockDim.x).
#define PER 8
// pass 0: out = y from (x, w, b = third).
// pass 1: out = dx from (x, w, g = third).
// pass 2: out = this block's [2, cols] sums of g·x̂ and g (f32), from (x, g = third).
template <typename E>
__device__ void layer_norm(const typename E::T* x, const typename E::T* w, const typename E::T* third, void* out,
                           unsigned int rows, unsigned int cols, float eps, int pass) {
    float acc_w[PER], acc_b[PER];
#pragma unroll
    for (int k = 0; k < PER; k++) { acc_w[k] = 0.f; acc_b[k] = 0.f; }
    for (unsigned int r = blockIdx.x; r < rows; r += gridDim.x) {
        unsigned long long base = (unsigned long long)r * cols;
        float v[PER];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            unsigned int j = threadIdx.x + k * blockDim.x;
            v[k] = j < cols ? E::get(x, base + j) : 0.f;
            s += v[k];
        }
        float mean = block_sum2(s, 0.f).x / cols;
        float q = 0.f;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            unsigned int j = threadIdx.x + k * blockDim.x;
            float d = v[k] - mean;
            if (j < cols) q += d * d;
        }
        float rstd = rsqrtf(block_sum2(q, 0.f).x / cols + eps);
        if (pass == 0) {
#pragma unroll
            for (int k = 0; k < PER; k++) {
                unsigned int j = threadIdx.x + k * blockDim.x;
                if (j < cols) E::put((typename E::T*)out, base + j, (v[k] - mean) * rstd * E::get(w, j) + E::get(third, j));
            }
        } else if (pass == 1) {
            float a = 0.f, c = 0.f;
#pragma unroll
            for (int k = 0; k < PER; k++) {
                unsigned int j = threadIdx.x + k * blockDim.x;
                if (j < cols) {
                    float h = E::get(third, base + j) * E::get(w, j);
                    a += h;
                    c += h * (v[k] - mean) * rstd;
                }
            }
            float2 t = block_sum2(a, c);
            float mean_h = t.x / cols, mean_hx = t.y / cols;
#pragma unroll
            for (int k = 0; k < PER; k++) {
                unsigned int j = threadIdx.x + k * blockDim.x;
                if (j < cols) {
                    float h = E::get(third, base + j) * E::get(w, j);
                    E::put((typename E::T*)out, base + j, rstd * (h - mean_h - (v[k] - mean) * rstd * mean_hx));
                }
            }
        } else {
#pragma unroll
            for (int k = 0; k < PER; k++) {
                unsigned int j = threadIdx.x + k * blockDim.x;
                if (j < cols) {
                    float g = E::get(third, base + j);
                    acc_w[k] += g * (v[k] - mean) * rstd;
                    acc_b[k] += g;
                }
            }
        }
    }
    if (pass == 2) {
        float* sums = (float*)out + (unsigned long long)blockIdx.x * 2 * cols;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            unsigned int j = threadIdx.x + k * blockDim.x;
            if (j < cols) { sums[j] = acc_w[k]; sums[cols + j] = acc_b[k]; }
        }
    }
}

#define KERNELS(S, E)                                                                                   \
extern "C" __global__ void softmax_fwd_##S(const E::T* x, const E::T* unused, E::T* y, unsigned int rows, \
                                           unsigned int cols) {                                         \
    softmax_rows<E>(x, 0, y, rows, cols);                                                               \
}                                                                                                       \
extern "C" __global__ void softmax_bwd_##S(const E::T* y, const E::T* g, E::T* dx, unsigned int rows,    \
                                           unsigned int cols) {                                         \
    softmax_rows<E>(y, g, dx, rows, cols);                                                              \
}                                                                                                       \
extern "C" __global__ void layer_norm_##S(const E::T* x, const E::T* w, const E::T* third, void* out,     \
                                          unsigned int rows, unsigned int cols, float eps, int pass) {  \
    layer_norm<E>(x, w, third, out, rows, cols, eps, pass);                                             \
}
KERNELS(f32, F32)
KERNELS(bf16, BF16)
KERNELS(f16, F16)
"#;

    /// Elements of a row each layer-norm thread keeps (PER in the source).
    const PER: usize = 8;

    crate::kernels::nvrtc::compiled!(SOURCE, "softmax and layer norm");

    fn rows_u32(rows: usize, cols: usize) -> Result<(u32, u32)> {
        if rows * cols > u32::MAX as usize {
            bail!("{rows} rows of {cols} is more than these kernels index")
        }
        Ok((rows as u32, cols as u32))
    }

    /// The softmax kernels, one warp per row: forward on x (`g` None) or backward on (y, g).
    pub(super) fn warp_rows(
        x: &CudaStorage,
        xl: &Layout,
        g: Option<(&CudaStorage, &Layout)>,
        base: &str,
        rows: usize,
        cols: usize,
    ) -> Result<CudaStorage> {
        let dev = x.device().clone();
        let kernel = name(base, x.dtype());
        by_dtype!(x.dtype(), "softmax", T => {
            let xv = view::<T>(x, xl, "softmax")?;
            // The forward kernel ignores its second pointer; x stands in for it.
            let gv = match g {
                Some((gs, gl)) => view::<T>(gs, gl, "softmax's backward")?,
                None => view::<T>(x, xl, "softmax")?,
            };
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(rows * cols)? };
            let func = dev.get_or_load_custom_func(&kernel, "migprof_norm", ptx()?)?;
            let (r, c) = rows_u32(rows, cols)?;
            let cfg = LaunchConfig { grid_dim: (r.div_ceil(8).clamp(1, 1 << 20), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let mut b = func.builder();
            b.arg(&xv).arg(&gv).arg(&out).arg(&r).arg(&c);
            // SAFETY: argument types and order match the kernel; every buffer holds rows x cols.
            unsafe { b.launch(cfg) }.map_err(|e| failed(&kernel, e))?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        })
    }

    pub(super) struct LnArgs<'a> {
        pub x: (&'a CudaStorage, &'a Layout),
        pub w: (&'a CudaStorage, &'a Layout),
        /// b forward, g backward.
        pub third: (&'a CudaStorage, &'a Layout),
        pub rows: usize,
        pub cols: usize,
        pub eps: f64,
    }

    pub(super) enum LnPass {
        Forward,
        InputGrad,
        ParamSums { blocks: usize },
    }

    /// Blocks of the parameter-gradient pass: enough to fill the GPU, few enough that adding up
    /// their partial sums is cheap.
    pub(super) fn param_blocks(rows: usize) -> usize {
        rows.clamp(1, 512)
    }

    pub(super) fn layer_norm(a: LnArgs, pass: LnPass) -> Result<CudaStorage> {
        let Some(threads) = crate::kernels::nvrtc::row_threads(a.cols, PER) else {
            bail!("layer norm over {} features: the kernel takes at most {}", a.cols, PER * 1024)
        };
        let dev = a.x.0.device().clone();
        let kernel = name("layer_norm", a.x.0.dtype());
        let (rows, cols) = rows_u32(a.rows, a.cols)?;
        let (code, blocks) = match pass {
            LnPass::Forward => (0i32, rows.clamp(1, 1 << 20)),
            LnPass::InputGrad => (1, rows.clamp(1, 1 << 20)),
            LnPass::ParamSums { blocks } => (2, blocks as u32),
        };
        let eps = a.eps as f32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let func = dev.get_or_load_custom_func(&kernel, "migprof_norm", ptx()?)?;
        by_dtype!(a.x.0.dtype(), "layer norm", T => {
            let x = view::<T>(a.x.0, a.x.1, "layer norm")?;
            let w = view::<T>(a.w.0, a.w.1, "layer norm")?;
            let third = view::<T>(a.third.0, a.third.1, "layer norm")?;
            macro_rules! go {
                ($out:expr) => {{
                    let out = $out;
                    let mut b = func.builder();
                    b.arg(&x).arg(&w).arg(&third).arg(&out).arg(&rows).arg(&cols).arg(&eps).arg(&code);
                    // SAFETY: argument types and order match the kernel; x and the third hold rows x
                    // cols, w cols, and out what the pass writes.
                    unsafe { b.launch(cfg) }.map_err(|e| failed(&kernel, e))?;
                    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
                }};
            }
            match pass {
                // SAFETY (both): the kernel writes every element.
                LnPass::ParamSums { blocks } => go!(unsafe { dev.alloc::<f32>(blocks * 2 * a.cols)? }),
                _ => go!(unsafe { dev.alloc::<T>(a.rows * a.cols)? }),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::layers::tests::check_gradient;
    use candle_core::{DType, Device};

    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut rng = crate::init::Rng::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    #[test]
    fn softmax_matches_candle_and_has_exact_gradients() -> Result<()> {
        let x = Tensor::from_vec(values(24, 1), (2, 3, 4), &Device::Cpu)?;
        let want = candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F32)?)?.flatten_all()?.to_vec1::<f32>()?;
        let got = x.apply_op1(Softmax)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        check_gradient(|x| x.apply_op1(Softmax), &[2, 3, 5], 2)
    }

    #[test]
    fn layer_norm_has_exact_gradients_for_input_weight_and_bias() -> Result<()> {
        let (rows, cols) = (3, 7);
        let t = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu);
        let (x, w, b) = (t(values(rows * cols, 3), &[rows, cols])?, t(values(cols, 4), &[cols])?, t(values(cols, 5), &[cols])?);
        let op = LayerNorm { eps: 1e-5 };
        check_gradient(|x| x.apply_op3(&w, &b, op), &[rows, cols], 6)?;
        // The weight's and bias's gradients, each with the other inputs fixed.
        let at = |v: &Tensor, which: usize| -> Result<Tensor> {
            match which {
                0 => x.apply_op3(v, &b, op),
                _ => x.apply_op3(&w, v, op),
            }
        };
        check_gradient(|v| at(v, 0), &[cols], 4)?;
        check_gradient(|v| at(v, 1), &[cols], 5)
    }

    #[test]
    fn rows_longer_than_their_shape_allows_are_refused() {
        let x = Tensor::zeros((2, 0), DType::F32, &Device::Cpu).unwrap();
        let err = x.apply_op1(Softmax).unwrap_err().to_string();
        assert!(err.contains("length 0"), "{err}");
    }
}
