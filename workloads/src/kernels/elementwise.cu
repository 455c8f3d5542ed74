// y = act(x + b) with b broadcast along one axis (a linear layer's bias, a convolution's channels),
// y = act(x + z) for a residual, and their gradients. x is seen as planes that share one bias value
// or one bias row, so no element recomputes a strided index; 16-byte words where the shapes allow.

// Φ(v), the standard normal distribution function, and φ(v), its density: GELU is v·Φ(v), its
// derivative Φ(v) + v·φ(v). For bf16 and f16 values, erfc by Abramowitz & Stegun 7.1.26 (|error|
// ≤ 1.5e-7 on erfc, 7.5e-8 on Φ, 2e-4 relative on GELU where |GELU| > 1e-3: below the output's rounding),
// branch-free, from the exp2 that φ needs anyway; for v < 0, Φ(v) is half of erfc itself rather
// than 1 + erf(v/√2), which cancels. erff branches on |v| and, with a warp's values on both sides,
// runs both paths, and the GELU pass was bound by issue rather than by memory. f32 keeps erff, as
// PyTorch computes it.
// (measured: docs/kernels.md#elementwise)
template <typename E>
__device__ __forceinline__ void normal_cdf_pdf(float v, float& cdf, float& pdf) {
    if constexpr (sizeof(typename E::T) == 4) {
        cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
        pdf = 0.39894228040143268f * expf(-0.5f * v * v);
    } else {
        float z = fabsf(v) * 0.70710678118654752f, t, e;
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(fmaf(0.3275911f, z, 1.f)));
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-z * z * 1.4426950408889634f));
        float poly = fmaf(fmaf(fmaf(fmaf(1.061405429f, t, -1.453152027f), t, 1.421413741f), t, -0.284496736f), t, 0.254829592f);
        float half_erfc = 0.5f * t * poly * e;
        cdf = v >= 0.f ? 1.f - half_erfc : half_erfc;
        pdf = 0.39894228040143268f * e;
    }
}

template <typename E>
__device__ __forceinline__ float activate(float v, int act) {
    if (act == 1) return v > 0.f ? v : 0.f;
    if (act == 2) {
        float cdf, pdf;
        normal_cdf_pdf<E>(v, cdf, pdf);
        return v * cdf;
    }
    return v;
}

// The term added to element e (in column j of plane `plane`): mode 0 b[j] (the last axis), 1
// b[plane % channels] (NCHW channels), 2 nothing, 3 b[e] (a tensor of x's shape). A word may span
// two channel planes when their length is not a multiple of its size (7x7 maps): then the plane is
// worked out per element.
template <typename E>
__device__ __forceinline__ float addend(const typename E::T* b, unsigned int e, unsigned int j, unsigned int plane,
                                        unsigned int channels, int mode, unsigned int len, bool straddles) {
    if (mode == 0) return E::get(b, j);
    if (mode == 1) return E::get(b, (straddles ? e / len : plane) % channels);
    if (mode == 3) return E::get(b, e);
    return 0.f;
}

// Forward (g null): out = act(x + addend). Gradient: out = g · act'(x + addend), where ReLU's
// derivative is read from the output y (> 0, as PyTorch's threshold_backward) and GELU's computed
// from x + addend; for ReLU with b of x's shape (mode 3), b is a second gradient: (g + b) · act'. n elements in planes of len; V elements per thread (len % V == 0 for mode 0).
template <typename E, int V>
__device__ void elementwise(const typename E::T* x, const typename E::T* b, const typename E::T* y,
                            const typename E::T* g, typename E::T* out, unsigned int n, unsigned int len,
                            unsigned int channels, int mode, int act) {
    typedef Pack<typename E::T, V> P;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n / V; i += blockDim.x * gridDim.x) {
        unsigned int e = i * V, plane = e / len, j = e - plane * len;
        bool straddles = V > 1 && len % V != 0;
        P o;
        if (!g) {
            P xv = ((const P*)x)[i];
#pragma unroll
            for (int k = 0; k < V; k++) E::put(o.v, k, activate<E>(E::get(xv.v, k) + addend<E>(b, e + k, j + k, plane, channels, mode, len, straddles), act));
        } else {
            P gv = ((const P*)g)[i];
            if (act == 1 && mode == 3) {
                // Two gradients of one ReLU's output (a residual block's two branches), summed.
                P yv = ((const P*)y)[i], zv = ((const P*)b)[i];
#pragma unroll
                for (int k = 0; k < V; k++)
                    E::put(o.v, k, E::get(yv.v, k) > 0.f ? E::get(gv.v, k) + E::get(zv.v, k) : 0.f);
            } else if (act == 1) {
                P yv = ((const P*)y)[i];
#pragma unroll
                for (int k = 0; k < V; k++) E::put(o.v, k, E::get(yv.v, k) > 0.f ? E::get(gv.v, k) : 0.f);
            } else {
                P xv = ((const P*)x)[i];
#pragma unroll
                for (int k = 0; k < V; k++) {
                    float v = E::get(xv.v, k) + addend<E>(b, e + k, j + k, plane, channels, mode, len, straddles);
                    float cdf, pdf;
                    normal_cdf_pdf<E>(v, cdf, pdf);
                    E::put(o.v, k, E::get(gv.v, k) * (cdf + v * pdf));
                }
            }
        }
        ((P*)out)[i] = o;
    }
}

#define KERNEL(S, E, V)                                                                                 \
extern "C" __global__ void elementwise_##S##_v##V(const E::T* x, const E::T* b, const E::T* y,          \
        const E::T* g, E::T* out, unsigned int n, unsigned int len, unsigned int channels, int mode,    \
        int act) {                                                                                      \
    elementwise<E, V>(x, b, y, g, out, n, len, channels, mode, act);                                   \
}
KERNEL(f32, F32, 1)
KERNEL(f32, F32, 4)
KERNEL(bf16, BF16, 1)
KERNEL(bf16, BF16, 8)
KERNEL(f16, F16, 1)
KERNEL(f16, F16, 8)

// Column sums of x seen as [rows, cols], into partial [gridDim.y, cols] (f32): a block of lx x ly
// threads, lane x a word of V neighbouring columns (cols % V == 0), lane y every (gridDim.y · ly)-th
// row; the lanes y then add up in shared memory in a fixed order. Why words and rows across a block:
// a thread per column reading 2-byte elements one row after another held Swin-T's bias gradients
// (rows of 96 to 768 columns) to a fraction of the memory's bandwidth (docs/kernels.md#elementwise).
template <typename E, int V>
__device__ void column_sums(const typename E::T* x, float* partial, unsigned int rows, unsigned int cols) {
    typedef Pack<typename E::T, V> P;
    __shared__ float sh[256 * V];
    unsigned int words = cols / V, word = blockIdx.x * blockDim.x + threadIdx.x;
    float s[V];
#pragma unroll
    for (int i = 0; i < V; i++) s[i] = 0.f;
    if (word < words)
        for (unsigned int r = blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += gridDim.y * blockDim.y) {
            P p = ((const P*)x)[(unsigned long long)r * words + word];
#pragma unroll
            for (int i = 0; i < V; i++) s[i] += E::get(p.v, i);
        }
    unsigned int lane = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
    for (int i = 0; i < V; i++) sh[lane * V + i] = s[i];
    __syncthreads();
    if (threadIdx.y != 0 || word >= words) return;
#pragma unroll
    for (int i = 0; i < V; i++) {
        float t = 0.f;
        for (unsigned int y = 0; y < blockDim.y; y++) t += sh[(y * blockDim.x + threadIdx.x) * V + i];
        partial[(unsigned long long)blockIdx.y * cols + word * V + i] = t;
    }
}
#define SUM_KERNEL(S, E, V)                                                                            \
extern "C" __global__ void column_sums_##S##_v##V(const E::T* x, float* partial, unsigned int rows,     \
                                                  unsigned int cols) {                                 \
    column_sums<E, V>(x, partial, rows, cols);                                                         \
}
SUM_KERNEL(f32, F32, 1)
SUM_KERNEL(f32, F32, 2)
SUM_KERNEL(f32, F32, 4)
SUM_KERNEL(bf16, BF16, 1)
SUM_KERNEL(bf16, BF16, 2)
SUM_KERNEL(bf16, BF16, 4)
SUM_KERNEL(bf16, BF16, 8)
SUM_KERNEL(f16, F16, 1)
SUM_KERNEL(f16, F16, 2)
SUM_KERNEL(f16, F16, 4)
SUM_KERNEL(f16, F16, 8)
