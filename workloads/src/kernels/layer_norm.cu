// Layer normalisation over the last axis, forward and backward: a group of lanes per row (up to a
// warp) where the row fits their registers in 16-byte words, else a block per row; statistics in f32.

// Layer norm, one block per row (blocks stride over rows); each thread keeps up to PER elements
// of its row in registers (columns threadIdx.x + k * blockDim.x); PER is defined by the Rust side
// (kernels/layer_norm.rs), which sizes the blocks with it.
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

// The sum of v over a group of G neighbouring lanes (a power of two up to 32), returned to each of
// them. Every lane of the warp takes part.
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
return v;
}

// A row of up to G · WORDS words of V elements (16 bytes) held by a group of G lanes of a warp (32 / G
// rows a warp at once): lane l of the group loads words l, l + G, ... whole into v as x - mean (0 past
// the row's end, or everywhere when the row is not `live`) and the row's rstd is returned; the
// reductions are shuffles within the group, with no block barrier. Needs cols % V == 0 and 16-byte
// aligned tensors. Why groups narrower than a warp: Swin-T's rows of 96 and 192 bf16 channels are 12
// and 24 words, and a warp per row left most of its lanes idle and too few rows in flight to keep the
// memory busy (docs/kernels.md#layer-norm).
template <typename E, int V, int WORDS, int G>
__device__ __forceinline__ float group_row(const Pack<typename E::T, V>* row, unsigned int lane, unsigned int words,
                                           unsigned int cols, float eps, bool live, float (&v)[WORDS][V]) {
float s = 0.f;
#pragma unroll
for (int k = 0; k < WORDS; k++) {
    unsigned int word = lane + G * k;
    bool in = live && word < words;
    Pack<typename E::T, V> p;
    if (in) p = row[word];
#pragma unroll
    for (int i = 0; i < V; i++) { v[k][i] = in ? E::get(p.v, i) : 0.f; s += v[k][i]; }
}
float mean = group_sum<G>(s) / cols;
float q = 0.f;
#pragma unroll
for (int k = 0; k < WORDS; k++)
#pragma unroll
    for (int i = 0; i < V; i++) {
        v[k][i] = live && lane + G * k < words ? v[k][i] - mean : 0.f;
        q += v[k][i] * v[k][i];
    }
return rsqrtf(group_sum<G>(q) / cols + eps);
}

// The rows a warp's groups take together: every lane of a warp runs the same iterations (the
// shuffles need all of them), a group past the last row runs them not `live`.
#define GROUP_ROWS(G)                                                                                   \
unsigned int lane = threadIdx.x & (G - 1), sub = (threadIdx.x & 31) / G, per_warp = 32 / G;           \
unsigned int warps = (gridDim.x * blockDim.x) >> 5;                                                   \
for (unsigned int r0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per_warp; r0 < rows;           \
     r0 += warps * per_warp)

// Passes 0 and 1, a group of G lanes per row (see group_row).
template <typename E, int V, int WORDS, int G>
__device__ void layer_norm_group(const typename E::T* x, const typename E::T* w, const typename E::T* third,
                                 typename E::T* out, unsigned int rows, unsigned int cols, float eps, int pass) {
typedef Pack<typename E::T, V> P;
unsigned int words = cols / V;
GROUP_ROWS(G) {
    unsigned int r = r0 + sub;
    bool live = r < rows;
    unsigned long long base = (unsigned long long)(live ? r : 0) * words;
    float v[WORDS][V];  // x - mean
    float rstd = group_row<E, V, WORDS, G>((const P*)x + base, lane, words, cols, eps, live, v);
    if (pass == 0) {
#pragma unroll
        for (int k = 0; k < WORDS; k++) {
            unsigned int word = lane + G * k;
            if (!live || word >= words) continue;
            P wp = ((const P*)w)[word], bp = ((const P*)third)[word], o;
#pragma unroll
            for (int i = 0; i < V; i++) E::put(o.v, i, v[k][i] * rstd * E::get(wp.v, i) + E::get(bp.v, i));
            ((P*)out)[base + word] = o;
        }
        continue;
    }
    // dx = rstd · (h - mean(h) - x̂ · mean(h · x̂)), h = g · w.
    float h[WORDS][V];
    float a = 0.f, c = 0.f;
#pragma unroll
    for (int k = 0; k < WORDS; k++) {
        unsigned int word = lane + G * k;
        bool in = live && word < words;
        P gp, wp;
        if (in) { gp = ((const P*)third)[base + word]; wp = ((const P*)w)[word]; }
#pragma unroll
        for (int i = 0; i < V; i++) {
            h[k][i] = in ? E::get(gp.v, i) * E::get(wp.v, i) : 0.f;
            a += h[k][i];
            c += h[k][i] * v[k][i] * rstd;
        }
    }
    float mean_h = group_sum<G>(a) / cols, mean_hx = group_sum<G>(c) / cols;
#pragma unroll
    for (int k = 0; k < WORDS; k++) {
        unsigned int word = lane + G * k;
        if (!live || word >= words) continue;
        P o;
#pragma unroll
        for (int i = 0; i < V; i++) E::put(o.v, i, rstd * (h[k][i] - mean_h - v[k][i] * rstd * mean_hx));
        ((P*)out)[base + word] = o;
    }
}
}

// Pass 2 a group of G lanes per row (see group_row): each lane adds its columns' g·x̂ and g over its
// group's rows in registers; the warp's groups add theirs by shuffles, then the block's warps add
// theirs in shared memory one warp after the other (a fixed order: a step replays bit for bit) into
// this block's [2, cols] sums. Why not the block-per-row kernel: its two barriers per row held
// Swin-T's many short rows back (docs/kernels.md#layer-norm). A kernel of its own, so that its
// accumulators do not weigh on the registers of passes 0 and 1.
template <typename E, int V, int WORDS, int G>
__device__ void layer_norm_group_sums(const typename E::T* x, const typename E::T* g, float* out, unsigned int rows,
                                      unsigned int cols, float eps) {
typedef Pack<typename E::T, V> P;
__shared__ float sh[2][G * WORDS * V];
unsigned int words = cols / V, warp = threadIdx.x >> 5;
float aw[WORDS][V], ab[WORDS][V];
#pragma unroll
for (int k = 0; k < WORDS; k++)
#pragma unroll
    for (int i = 0; i < V; i++) { aw[k][i] = 0.f; ab[k][i] = 0.f; }
GROUP_ROWS(G) {
    unsigned int r = r0 + sub;
    bool live = r < rows;
    unsigned long long base = (unsigned long long)(live ? r : 0) * words;
    float v[WORDS][V];
    float rstd = group_row<E, V, WORDS, G>((const P*)x + base, lane, words, cols, eps, live, v);
#pragma unroll
    for (int k = 0; k < WORDS; k++) {
        unsigned int word = lane + G * k;
        if (!live || word >= words) continue;
        P gp = ((const P*)g)[base + word];
#pragma unroll
        for (int i = 0; i < V; i++) {
            float gv = E::get(gp.v, i);
            aw[k][i] += gv * v[k][i] * rstd;
            ab[k][i] += gv;
        }
    }
}
// The warp's groups hold sums of the same columns: added across groups, every group then holds them.
#pragma unroll
for (int k = 0; k < WORDS; k++)
#pragma unroll
    for (int i = 0; i < V; i++)
#pragma unroll
        for (int o = G; o < 32; o <<= 1) {
            aw[k][i] += __shfl_xor_sync(0xffffffffu, aw[k][i], o);
            ab[k][i] += __shfl_xor_sync(0xffffffffu, ab[k][i], o);
        }
unsigned int sub0 = (threadIdx.x & 31) < G;
for (unsigned int t = 0; t < (blockDim.x >> 5); t++) {
    if (warp == t && sub0) {
#pragma unroll
        for (int k = 0; k < WORDS; k++) {
            unsigned int word = lane + G * k;
            if (word >= words) continue;
#pragma unroll
            for (int i = 0; i < V; i++) {
                unsigned int j = word * V + i;
                sh[0][j] = t == 0 ? aw[k][i] : sh[0][j] + aw[k][i];
                sh[1][j] = t == 0 ? ab[k][i] : sh[1][j] + ab[k][i];
            }
        }
    }
    __syncthreads();
}
float* sums = out + (unsigned long long)blockIdx.x * 2 * cols;
for (unsigned int j = threadIdx.x; j < cols; j += blockDim.x) {
    sums[j] = sh[0][j];
    sums[cols + j] = sh[1][j];
}
}

#define GROUP_KERNELS(S, E, V, WORDS, G)                                                                \
extern "C" __global__ void layer_norm_w##WORDS##_g##G##_##S(const E::T* x, const E::T* w, const E::T* third, \
                                            E::T* out, unsigned int rows, unsigned int cols, float eps, int pass) { \
layer_norm_group<E, V, WORDS, G>(x, w, third, out, rows, cols, eps, pass);                              \
}
#define SUM_KERNELS(S, E, V, G)                                                                         \
extern "C" __global__ void layer_norm_w4_g##G##_sums_##S(const E::T* x, const E::T* g, float* out,       \
                                                 unsigned int rows, unsigned int cols, float eps) { \
layer_norm_group_sums<E, V, 4, G>(x, g, out, rows, cols, eps);                                      \
}
#define KERNELS(S, E, V)                                                                                \
extern "C" __global__ void layer_norm_##S(const E::T* x, const E::T* w, const E::T* third, void* out,     \
                                      unsigned int rows, unsigned int cols, float eps, int pass) {  \
layer_norm<E>(x, w, third, out, rows, cols, eps, pass);                                             \
}                                                                                                       \
GROUP_KERNELS(S, E, V, 4, 4)                                                                            \
GROUP_KERNELS(S, E, V, 4, 8)                                                                            \
GROUP_KERNELS(S, E, V, 4, 16)                                                                           \
GROUP_KERNELS(S, E, V, 4, 32)                                                                           \
GROUP_KERNELS(S, E, V, 8, 32)                                                                           \
SUM_KERNELS(S, E, V, 4)                                                                                 \
SUM_KERNELS(S, E, V, 8)                                                                                 \
SUM_KERNELS(S, E, V, 16)                                                                                \
SUM_KERNELS(S, E, V, 32)
KERNELS(f32, F32, 4)
KERNELS(bf16, BF16, 8)
KERNELS(f16, F16, 8)
