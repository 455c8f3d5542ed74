// The composed attention's own kernels (attention.rs): q/k/v moved between the packed token-major
// projection and head-major buffers padded to a multiple of 8 tokens (aligned GEMMs), the softmax of
// scaled scores plus a key mask or a repeating score bias in place, and its backward. Rows are read
// in the widest word their lengths and offsets allow.

struct __align__(16) W16 { unsigned int a, b, c, d; };
template <typename W> __device__ __forceinline__ W zero_word() { return W(0); }
template <> __device__ __forceinline__ W16 zero_word<W16>() { W16 z = {0u, 0u, 0u, 0u}; return z; }

// One of q, k, v (or a gradient) between the token-major [b, t, stride] layout (at `offset` in each
// row) and the head-major [b·h, tp, d] one (rows t..tp zero), in words W of 1 to 8 elements: d,
// stride and offset are in words.
template <typename W>
__device__ void attn_move(const W* src, W* dst, unsigned int b, unsigned int t, unsigned int tp, unsigned int h,
                      unsigned int d, unsigned int stride, unsigned int offset, int to_heads) {
unsigned int total = b * h * tp * d;
for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
    unsigned int di = i % d, row = i / d;
    unsigned int ti = row % tp, bh = row / tp;
    unsigned int hi = bh % h, bi = bh / h;
    unsigned long long tok = ((unsigned long long)bi * t + ti) * stride + offset + hi * d + di;
    if (to_heads) dst[i] = ti < t ? src[tok] : zero_word<W>();
    else if (ti < t) dst[tok] = src[i];
}
}
#define MOVE(NAME, W)                                                                                  \
extern "C" __global__ void NAME(const W* src, W* dst, unsigned int b, unsigned int t, unsigned int tp,  \
    unsigned int h, unsigned int d, unsigned int stride, unsigned int offset, int to_heads) {       \
attn_move<W>(src, dst, b, t, tp, h, d, stride, offset, to_heads);                                 \
}
MOVE(attn_move_w2, unsigned short)
MOVE(attn_move_w4, unsigned int)
MOVE(attn_move_w8, unsigned long long)
MOVE(attn_move_w16, W16)

// The score of key j in row (bh, i): scale · S + bias. mode 1: bias[bi, j] ([b, t]); mode 2:
// bias[(bi % r), hi, i, j] ([r, h, t, t]).
template <typename E>
__device__ __forceinline__ float attn_bias(const typename E::T* bias, unsigned int j, unsigned long long bi, unsigned int hi,
                                       unsigned int i, unsigned int h, unsigned int t, unsigned int r, int mode) {
if (mode == 1) return E::get(bias, bi * t + j);
if (mode == 2) return E::get(bias, ((((bi % r) * h + hi) * t + i) * (unsigned long long)t) + j);
return 0.f;
}
template <typename E>
__device__ __forceinline__ float attn_score(const typename E::T* s, const typename E::T* bias, unsigned long long base,
                                        unsigned int j, unsigned long long bi, unsigned int hi, unsigned int i,
                                        unsigned int h, unsigned int t, unsigned int r, int mode, float scale) {
return scale * E::get(s, base + j) + attn_bias<E>(bias, j, bi, hi, i, h, t, r, mode);
}

// Keys per lane kept in registers, consecutive ones loaded as one word: rows of up to 32 · KEEP keys
// (ViT's 197, BERT's 128, Swin's 49) are read once; longer rows are read again on each pass. tp is
// a multiple of KEEP, so a lane's keys never straddle two rows. KEEP is defined by the Rust side
// (kernels/attention.rs), which sizes the launches with it.

// Lanes that share a row: half a warp for rows of up to 16 · KEEP keys, so that a warp moves two
// rows at once (BERT's rows of 128 bf16 keys left half of every warp idle; measured:
// docs/kernels.md#attention).
__device__ __forceinline__ unsigned int lanes_per_row(unsigned int tp) { return tp <= 16 * KEEP ? 16 : 32; }

// Sum and max over the L lanes (16 or 32) sharing a row; xor offsets below L stay within them.
__device__ __forceinline__ float group_sum(float v, unsigned int L) {
for (unsigned int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
return v;
}
__device__ __forceinline__ float group_max(float v, unsigned int L) {
for (unsigned int o = L / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
return v;
}

// Softmax of scale · S + bias over keys 0..t of each row, in place on S [b·h, tp, tp]; padded keys
// and rows become 0. One warp per row, or half a warp (see lanes_per_row).
template <typename E>
__device__ void attn_softmax(typename E::T* s, const typename E::T* bias, unsigned int rows, unsigned int h,
                         unsigned int t, unsigned int tp, unsigned int r, int mode, float scale) {
typedef Pack<typename E::T, KEEP> P;
unsigned int L = lanes_per_row(tp), lane = threadIdx.x & (L - 1), per_warp = 32 / L;
unsigned int warps = (gridDim.x * blockDim.x) >> 5;
// The loop runs per warp (its rows together), so that every lane reaches the shuffles.
for (unsigned int first = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per_warp; first < rows; first += warps * per_warp) {
    unsigned int row = first + (threadIdx.x & 31) / L;
    bool real = row < rows;
    unsigned long long base = (unsigned long long)row * tp;
    unsigned int i = row % tp, bh = row / tp, bi = bh / h, hi = bh % h;
    float m = __int_as_float(0xff800000);
    if (tp <= 32 * KEEP) {
        unsigned int j0 = lane * KEEP;
        bool mine = real && j0 < tp;
        P in, out;
        if (mine) in = ((const P*)(s + base))[lane];
        float v[KEEP];
#pragma unroll
        for (int k = 0; k < KEEP; k++) {
            unsigned int j = j0 + k;
            v[k] = mine && i < t && j < t ? scale * E::get(in.v, k) + attn_bias<E>(bias, j, bi, hi, i, h, t, r, mode) : m;
            m = fmaxf(m, v[k]);
        }
        m = group_max(m, L);
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < KEEP; k++) {
            v[k] = i < t && j0 + k < t ? expf(v[k] - m) : 0.f;
            sum += v[k];
        }
        sum = group_sum(sum, L);
        float inv = i < t ? 1.f / sum : 0.f;
#pragma unroll
        for (int k = 0; k < KEEP; k++) E::put(out.v, k, v[k] * inv);
        if (mine) ((P*)(s + base))[lane] = out;
        continue;
    }
    if (i >= t) {
        for (unsigned int j = lane; j < tp; j += 32) E::put(s, base + j, 0.f);
        continue;
    }
    for (unsigned int j = lane; j < t; j += 32) m = fmaxf(m, attn_score<E>(s, bias, base, j, bi, hi, i, h, t, r, mode, scale));
    m = warp_max(m);
    float sum = 0.f;
    for (unsigned int j = lane; j < t; j += 32) sum += expf(attn_score<E>(s, bias, base, j, bi, hi, i, h, t, r, mode, scale) - m);
    float inv = 1.f / warp_sum(sum);
    __syncwarp();
    for (unsigned int j = lane; j < tp; j += 32) {
        float p = j < t ? expf(attn_score<E>(s, bias, base, j, bi, hi, i, h, t, r, mode, scale) - m) * inv : 0.f;
        E::put(s, base + j, p);
    }
}
}

// The gradient of the raw scores S: scale · P (dP - Σ_j dP P) per row; padding stays 0.
template <typename E>
__device__ void attn_softmax_grad(const typename E::T* p, const typename E::T* dp, typename E::T* ds,
                              unsigned int rows, unsigned int t, unsigned int tp, float scale) {
typedef Pack<typename E::T, KEEP> P;
unsigned int L = lanes_per_row(tp), lane = threadIdx.x & (L - 1), per_warp = 32 / L;
unsigned int warps = (gridDim.x * blockDim.x) >> 5;
for (unsigned int first = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per_warp; first < rows; first += warps * per_warp) {
    unsigned int row = first + (threadIdx.x & 31) / L;
    unsigned long long base = (unsigned long long)row * tp;
    bool live = row < rows && (row % tp) < t;
    float dot = 0.f;
    if (tp <= 32 * KEEP) {
        unsigned int j0 = lane * KEEP;
        bool mine = row < rows && j0 < tp;
        P pv, dv, out;
        if (mine) {
            pv = ((const P*)(p + base))[lane];
            dv = ((const P*)(dp + base))[lane];
        }
        float pf[KEEP], df[KEEP];
#pragma unroll
        for (int k = 0; k < KEEP; k++) {
            bool in = mine && live && j0 + k < t;
            pf[k] = in ? E::get(pv.v, k) : 0.f;
            df[k] = in ? E::get(dv.v, k) : 0.f;
            dot += pf[k] * df[k];
        }
        dot = group_sum(dot, L);
#pragma unroll
        for (int k = 0; k < KEEP; k++) E::put(out.v, k, scale * pf[k] * (df[k] - dot));
        if (mine) ((P*)(ds + base))[lane] = out;
        continue;
    }
    if (live) for (unsigned int j = lane; j < t; j += 32) dot += E::get(dp, base + j) * E::get(p, base + j);
    dot = warp_sum(dot);
    __syncwarp();
    for (unsigned int j = lane; j < tp; j += 32) {
        float v = live && j < t ? scale * E::get(p, base + j) * (E::get(dp, base + j) - dot) : 0.f;
        E::put(ds, base + j, v);
    }
}
}

#define KERNELS(S, E)                                                                                      \
extern "C" __global__ void attn_softmax_##S(E::T* s, const E::T* bias, unsigned int rows,                \
    unsigned int h, unsigned int t, unsigned int tp, unsigned int r, int mode, float scale) {         \
attn_softmax<E>(s, bias, rows, h, t, tp, r, mode, scale);                                             \
}                                                                                                          \
extern "C" __global__ void attn_softmax_grad_##S(const E::T* p, const E::T* dp, E::T* ds,                 \
    unsigned int rows, unsigned int t, unsigned int tp, float scale) {                                \
attn_softmax_grad<E>(p, dp, ds, rows, t, tp, scale);                                                  \
}
KERNELS(f32, F32)
KERNELS(bf16, BF16)
KERNELS(f16, F16)
