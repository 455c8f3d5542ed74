// Batch normalisation over NCHW (+ReLU): per-channel sums split over chunks of images with a
// finishing pass (which also moves the running statistics in a training step's forward), the
// normalisation and its backward in the widest word a plane allows. Statistics are f32 whatever the activations' dtype.

// x, g, y: NCHW seen as n x c planes of hw; stats: [mean; var] f32 [2, c]; w, b: the affine map's [c].

// One element's terms of its channel's sums: pass 0 d = x - shift and d²; pass 1 g'·x̂ and g', where
// g' is the gradient, zero where the ReLU cut the output y (when y is read). Planes and rows of
// channels (below) accumulate the same terms.
__device__ __forceinline__ void channel_terms(float x, float g, bool cut, float shift, float rstd, int pass,
                                              float& s, float& q) {
if (pass == 0) {
    float d = x - shift;
    s += d;
    q += d * d;
} else {
    float gp = cut ? 0.f : g;
    s += gp * (x - shift) * rstd;
    q += gp;
}
}

// Per channel and chunk of `per` images: a block sums its channel's planes in those images into
// partial[chunk][0..2][ch], V elements per word. pass 0: (Σ d, Σ d²) of d = x - shift, the shift the
// channel's first value (so that a large mean does not cancel the variance away); pass 1: (Σ g'·x̂,
// Σ g'). Why chunks: one block per channel left most of the GPU idle on ResNet's first layers,
// which have fewer channels than the GPU has SMs (measured: docs/kernels.md#batch-norm).
template <typename E, int V>
__device__ void channel_partials(const typename E::T* x, const typename E::T* g, const typename E::T* y,
                             const float* stats, float* partial, unsigned int n, unsigned int c,
                             unsigned int hw, float eps, int pass, unsigned int per) {
typedef Pack<typename E::T, V> P;
unsigned int ch = blockIdx.x, n0 = blockIdx.y * per, n1 = min(n, n0 + per), words = hw / V;
float shift = pass == 0 ? E::get(x, (unsigned long long)ch * hw) : stats[ch];
float rstd = pass == 0 ? 0.f : rsqrtf(stats[c + ch] + eps);
float s = 0.f, q = 0.f;
unsigned int total = (n1 - n0) * words;
for (unsigned int i = threadIdx.x; i < total; i += blockDim.x) {
    unsigned int ni = n0 + i / words;
    unsigned long long at = ((unsigned long long)ni * c + ch) * words + i % words;
    P xv = ((const P*)x)[at], gv, yv;
    if (pass != 0) gv = ((const P*)g)[at];
    if (pass != 0 && y) yv = ((const P*)y)[at];
#pragma unroll
    for (int k = 0; k < V; k++)
        channel_terms(E::get(xv.v, k), pass != 0 ? E::get(gv.v, k) : 0.f, pass != 0 && y && E::get(yv.v, k) <= 0.f,
                      shift, rstd, pass, s, q);
}
float2 t = block_sum2(s, q);
if (threadIdx.x == 0) {
    partial[(2 * blockIdx.y) * c + ch] = t.x;
    partial[(2 * blockIdx.y + 1) * c + ch] = t.y;
}
}

// Per channel: the chunks' sums added; pass 0 makes them [mean; biased variance], pass 1 keeps them.
// A block of 32 x FINISH_LY threads takes 32 channels: lane x a channel (neighbouring lanes read
// neighbouring addresses), lane y every FINISH_LY-th chunk, then the lanes y add up in shared memory
// in a fixed order (a step replays bit for bit). Why not a thread per channel looping over every
// chunk: ResNet's NHWC layers have up to 512 chunks, and a few channels' threads reading them one
// by one were the largest part of a training step (docs/kernels.md#batch-norm).
#define FINISH_LY 16
template <typename E>
__device__ void channel_finish(const typename E::T* x, const float* partial, float* out, unsigned int chunks,
                           unsigned int n, unsigned int c, unsigned int hw, int pass, float* run_mean,
                           float* run_var, float keep, float take_mean, float take_var) {
__shared__ float sh[2][FINISH_LY][32];
unsigned int ch = blockIdx.x * 32 + threadIdx.x;
float s = 0.f, q = 0.f;
if (ch < c)
    for (unsigned int k = threadIdx.y; k < chunks; k += FINISH_LY) {
        s += partial[(2 * k) * c + ch];
        q += partial[(2 * k + 1) * c + ch];
    }
sh[0][threadIdx.y][threadIdx.x] = s;
sh[1][threadIdx.y][threadIdx.x] = q;
__syncthreads();
if (threadIdx.y != 0 || ch >= c) return;
s = 0.f;
q = 0.f;
for (int t = 0; t < FINISH_LY; t++) {
    s += sh[0][t][threadIdx.x];
    q += sh[1][t][threadIdx.x];
}
if (pass == 0) {
    float count = (float)n * hw, m = s / count;
    float mean = E::get(x, (unsigned long long)ch * hw) + m, var = fmaxf(q / count - m * m, 0.f);
    out[ch] = mean;
    out[c + ch] = var;
    // The running statistics in the same pass (a training step's forward): PyTorch's momentum
    // update, the variance unbiased through take_var.
    if (run_mean) {
        run_mean[ch] = keep * run_mean[ch] + take_mean * mean;
        run_var[ch] = keep * run_var[ch] + take_var * var;
    }
} else {
    out[ch] = s;
    out[c + ch] = q;
}
}

// Per plane (image, channel). Forward (g == 0): out = x·a + s (+ y, a residual added before the
// ReLU, when y is not null), ReLU when relu. Backward: out = dx from g, y (the output, for the
// ReLU; 0 without), and sums = [Σ g'·x̂; Σ g'].
template <typename E, int V>
__device__ void plane_pass(const typename E::T* x, const typename E::T* g, const typename E::T* y,
                   const typename E::T* w, const typename E::T* b, const float* stats, const float* sums,
                   typename E::T* out, unsigned int planes, unsigned int c, unsigned int hw, float eps, int relu) {
// V elements per thread as one word (hw % V == 0, so a plane holds whole words).
typedef Pack<typename E::T, V> P;
float m = (float)(planes / c) * hw;
for (unsigned int plane = blockIdx.y; plane < planes; plane += gridDim.y) {
    unsigned int ch = plane % c;
    float mean = stats[ch], rstd = rsqrtf(stats[c + ch] + eps);
    float a = E::get(w, ch) * rstd, s = E::get(b, ch) - mean * a;
    unsigned long long base = (unsigned long long)plane * (hw / V);
    for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < hw / V; j += blockDim.x * gridDim.x) {
        P xv = ((const P*)x)[base + j], o;
        if (!g) {
            P zv;
            if (y) zv = ((const P*)y)[base + j];
#pragma unroll
            for (int k = 0; k < V; k++) {
                float v = E::get(xv.v, k) * a + s + (y ? E::get(zv.v, k) : 0.f);
                E::put(o.v, k, relu && v < 0.f ? 0.f : v);
            }
        } else {
            P gv = ((const P*)g)[base + j], yv;
            if (y) yv = ((const P*)y)[base + j];
#pragma unroll
            for (int k = 0; k < V; k++) {
                float gp = E::get(gv.v, k);
                if (y && E::get(yv.v, k) <= 0.f) gp = 0.f;
                float xhat = (E::get(xv.v, k) - mean) * rstd;
                E::put(o.v, k, a * (gp - sums[c + ch] / m - xhat * sums[ch] / m));
            }
        }
        ((P*)out)[base + j] = o;
    }
}
}

#define PLANES(S, E, V)                                                                                   \
extern "C" __global__ void bn_planes_##S##_v##V(const E::T* x, const E::T* g, const E::T* y, const E::T* w, \
    const E::T* b, const float* stats, const float* sums, E::T* out, unsigned int planes, unsigned int c, \
    unsigned int hw, float eps, int relu) {                                                           \
plane_pass<E, V>(x, g, y, w, b, stats, sums, out, planes, c, hw, eps, relu);                          \
}
#define PARTIALS(S, E, V)                                                                                 \
extern "C" __global__ void bn_partials_##S##_v##V(const E::T* x, const E::T* g, const E::T* y,             \
    const float* stats, float* partial, unsigned int n, unsigned int c, unsigned int hw, float eps,    \
    int pass, unsigned int per) {                                                                     \
channel_partials<E, V>(x, g, y, stats, partial, n, c, hw, eps, pass, per);                            \
}
#define KERNELS(S, E)                                                                                        \
extern "C" __global__ void bn_finish_##S(const E::T* x, const float* partial, float* out,                  \
    unsigned int chunks, unsigned int n, unsigned int c, unsigned int hw, int pass, float* run_mean,   \
    float* run_var, float keep, float take_mean, float take_var) {                                   \
channel_finish<E>(x, partial, out, chunks, n, c, hw, pass, run_mean, run_var, keep, take_mean, take_var); \
}                                                                                                         \
PARTIALS(S, E, 1)                                                                                         \
PARTIALS(S, E, 2)                                                                                         \
PARTIALS(S, E, 4)                                                                                         \
PLANES(S, E, 1)                                                                                           \
PLANES(S, E, 2)                                                                                           \
PLANES(S, E, 4)
KERNELS(f32, F32)
KERNELS(bf16, BF16)
KERNELS(f16, F16)
PARTIALS(bf16, BF16, 8)
PARTIALS(f16, F16, 8)
PLANES(bf16, BF16, 8)
PLANES(f16, F16, 8)

// Rows of channels: x, g, y as [rows, c] (NHWC with its pixels as rows, or NCHW with 1x1 maps). The
// same sums and passes as above, the same shift (a channel's first value), read across the channels
// of a row, V channels per word (c % V == 0).

// A block of lx x ly threads: lane x takes V channels from ch0, lane y every ly-th row of the
// block's chunk of `per` rows; the lanes y then add up in shared memory.
template <typename E, int V>
__device__ void rows_partials(const typename E::T* x, const typename E::T* g, const typename E::T* y,
                              const float* stats, float* partial, unsigned int rows, unsigned int c,
                              float eps, int pass, unsigned int per) {
typedef Pack<typename E::T, V> P;
__shared__ float sh[2][256 * V];
unsigned int ch0 = (blockIdx.x * blockDim.x + threadIdx.x) * V;
unsigned int r0 = blockIdx.y * per, r1 = min(rows, r0 + per);
bool live = ch0 < c;
float s[V], q[V], shift[V], rstd[V];
#pragma unroll
for (int k = 0; k < V; k++) {
    s[k] = 0.f;
    q[k] = 0.f;
    shift[k] = live ? (pass == 0 ? E::get(x, ch0 + k) : stats[ch0 + k]) : 0.f;
    rstd[k] = live && pass != 0 ? rsqrtf(stats[c + ch0 + k] + eps) : 0.f;
}
if (live) {
    for (unsigned int r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
        unsigned long long at = ((unsigned long long)r * c + ch0) / V;
        P xv = ((const P*)x)[at], gv, yv;
        if (pass != 0) gv = ((const P*)g)[at];
        if (pass != 0 && y) yv = ((const P*)y)[at];
#pragma unroll
        for (int k = 0; k < V; k++)
            channel_terms(E::get(xv.v, k), pass != 0 ? E::get(gv.v, k) : 0.f, pass != 0 && y && E::get(yv.v, k) <= 0.f,
                          shift[k], rstd[k], pass, s[k], q[k]);
    }
}
unsigned int lane = (threadIdx.y * blockDim.x + threadIdx.x) * V;
#pragma unroll
for (int k = 0; k < V; k++) {
    sh[0][lane + k] = s[k];
    sh[1][lane + k] = q[k];
}
__syncthreads();
if (threadIdx.y == 0 && live) {
#pragma unroll
    for (int k = 0; k < V; k++) {
        float ts = 0.f, tq = 0.f;
        for (unsigned int t = 0; t < blockDim.y; t++) {
            ts += sh[0][(t * blockDim.x + threadIdx.x) * V + k];
            tq += sh[1][(t * blockDim.x + threadIdx.x) * V + k];
        }
        partial[(2 * blockIdx.y) * c + ch0 + k] = ts;
        partial[(2 * blockIdx.y + 1) * c + ch0 + k] = tq;
    }
}
}

// The normalisation and its backward over rows, word by word: as plane_pass, each word's V channels
// starting at ch0; a thread's channels repeat when its stride covers whole rows, so their affine
// map is read again only when ch0 changes.
template <typename E, int V>
__device__ void rows_pass(const typename E::T* x, const typename E::T* g, const typename E::T* y,
                          const typename E::T* w, const typename E::T* b, const float* stats, const float* sums,
                          typename E::T* out, unsigned int rows, unsigned int c, float eps, int relu) {
typedef Pack<typename E::T, V> P;
float m = (float)rows;
unsigned long long words = (unsigned long long)rows * c / V;
unsigned int at = 0xffffffffu;
float mean[V], rstd[V], a[V], sh[V], sg[V], sx[V];
for (unsigned long long j = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; j < words;
     j += (unsigned long long)blockDim.x * gridDim.x) {
    unsigned int ch0 = (unsigned int)((j * V) % c);
    if (ch0 != at) {
        at = ch0;
#pragma unroll
        for (int k = 0; k < V; k++) {
            unsigned int ch = ch0 + k;
            mean[k] = stats[ch];
            rstd[k] = rsqrtf(stats[c + ch] + eps);
            a[k] = E::get(w, ch) * rstd[k];
            sh[k] = E::get(b, ch) - mean[k] * a[k];
            sg[k] = sums ? sums[c + ch] / m : 0.f;
            sx[k] = sums ? sums[ch] / m : 0.f;
        }
    }
    P xv = ((const P*)x)[j], o;
    if (!g) {
        P zv;
        if (y) zv = ((const P*)y)[j];
#pragma unroll
        for (int k = 0; k < V; k++) {
            float v = E::get(xv.v, k) * a[k] + sh[k] + (y ? E::get(zv.v, k) : 0.f);
            E::put(o.v, k, relu && v < 0.f ? 0.f : v);
        }
    } else {
        P gv = ((const P*)g)[j], yv;
        if (y) yv = ((const P*)y)[j];
#pragma unroll
        for (int k = 0; k < V; k++) {
            float gp = E::get(gv.v, k);
            if (y && E::get(yv.v, k) <= 0.f) gp = 0.f;
            float xhat = (E::get(xv.v, k) - mean[k]) * rstd[k];
            E::put(o.v, k, a[k] * (gp - sg[k] - xhat * sx[k]));
        }
    }
    ((P*)out)[j] = o;
}
}

#define ROWS(S, E, V)                                                                                     \
extern "C" __global__ void bn_rows_partials_##S##_v##V(const E::T* x, const E::T* g, const E::T* y,        \
    const float* stats, float* partial, unsigned int rows, unsigned int c, float eps, int pass,         \
    unsigned int per) {                                                                               \
rows_partials<E, V>(x, g, y, stats, partial, rows, c, eps, pass, per);                                \
}                                                                                                         \
extern "C" __global__ void bn_rows_##S##_v##V(const E::T* x, const E::T* g, const E::T* y, const E::T* w, \
    const E::T* b, const float* stats, const float* sums, E::T* out, unsigned int rows, unsigned int c, \
    float eps, int relu) {                                                                            \
rows_pass<E, V>(x, g, y, w, b, stats, sums, out, rows, c, eps, relu);                                 \
}
ROWS(f32, F32, 1)
ROWS(f32, F32, 2)
ROWS(f32, F32, 4)
ROWS(bf16, BF16, 1)
ROWS(bf16, BF16, 2)
ROWS(bf16, BF16, 4)
ROWS(bf16, BF16, 8)
ROWS(f16, F16, 1)
ROWS(f16, F16, 2)
ROWS(f16, F16, 4)
ROWS(f16, F16, 8)
