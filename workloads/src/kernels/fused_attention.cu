// Attention's forward as one kernel from the packed [b, t, 3·h·d] projection: online softmax in f32.
// bf16/f16 heads of 32, 64 or 128 on tensor cores (m16n8k16 mma.sync, 64 queries per block of four
// warps, keys in shared-memory tiles of 64); f32 heads of 32 or 64 on the CUDA cores, a query's
// features and output in registers. Probabilities are rounded to the input dtype for P·V, as
// FlashAttention does.

#define FA_Q 64   // queries per block: four warps of 16
#define FA_K 64   // keys per shared-memory tile
typedef Pack<unsigned int, 4> W16;  // eight 16-bit elements, moved as one 16-byte word

// c += a b for one m16n8k16 tile: a the 16x16 row-major fragment (4 registers of 2 elements), b the
// 16x8 column-major one (2 registers), c 16x8 in f32.
template <typename E> __device__ __forceinline__ void mma16816(float* c, const unsigned int* a, unsigned int b0, unsigned int b1);
template <> __device__ __forceinline__ void mma16816<BF16>(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<F16>(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as one register of two elements, `lo` in the low half (the lower column).
template <typename E> __device__ __forceinline__ unsigned int pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned int pack2<BF16>(float lo, float hi) {
    unsigned int r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
template <> __device__ __forceinline__ unsigned int pack2<F16>(float lo, float hi) {
    unsigned int r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

// Four 8x8 tiles of 16-bit elements from shared memory, transposed: lane l gives the address of row
// l % 8 of tile l / 8 and receives, of each tile, the elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
__device__ __forceinline__ void load_tiles_transposed(unsigned int* r, const unsigned short* p) {
    unsigned int a;
    asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(a) : "l"(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// softmax(scale · q kᵀ + bias) v for 64 queries of one (sequence, head) per block; qkv [b, t, 3c]
// (q, k, v each c = h·D wide), out [b, t, c]. Bias modes as attention.rs's softmax: 1, a key mask
// bias[bi, j]; 2, bias[bi % r, hi, i, j]. grid (b·h, ceil(t / 64)), 128 threads.
//
// Every tile computes all 64 keys, masking those past t: skipping the empty 8-key groups of ViT's
// last tile (197 tokens leave 5 keys in it) by a branch per group, or by a second, shorter copy of
// the tile's code, made the kernel slower (BERT-base's too, whose tiles are all full), and so did
// 32 queries per warp (two row tiles sharing each K and V fragment) (measured:
// docs/kernels.md#fused-attention).
template <typename E, int D>
__device__ void attn_fused(const unsigned short* qkv, const unsigned short* bias, unsigned short* out,
                           unsigned int t, unsigned int h, unsigned int r, int mode, float scale) {
    const int S = D + 8;  // shared rows padded by 16 bytes: the fragment loads hit 32 distinct banks
    __shared__ __align__(16) unsigned short ks[FA_K * S];
    __shared__ __align__(16) unsigned short vs[FA_K * S];
    const float LOG2E = 1.4426950408889634f, NEG_INF = __int_as_float(0xff800000);
    unsigned int bh = blockIdx.x, bi = bh / h, hi = bh % h, c = h * D, stride = 3 * c;
    unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
    unsigned int q0 = blockIdx.y * FA_Q + warp * 16, r0 = q0 + g, r1 = r0 + 8;
    const unsigned short* seq = qkv + (unsigned long long)bi * t * stride + hi * D;

    // This warp's 16 queries as A fragments, D / 16 of them along the head's features.
    unsigned int qa[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        unsigned int col = kk * 16 + c2;
        qa[kk][0] = r0 < t ? *(const unsigned int*)(seq + (unsigned long long)r0 * stride + col) : 0u;
        qa[kk][1] = r1 < t ? *(const unsigned int*)(seq + (unsigned long long)r1 * stride + col) : 0u;
        qa[kk][2] = r0 < t ? *(const unsigned int*)(seq + (unsigned long long)r0 * stride + col + 8) : 0u;
        qa[kk][3] = r1 < t ? *(const unsigned int*)(seq + (unsigned long long)r1 * stride + col + 8) : 0u;
    }
    // Rows g and g + 8 of the warp's tile: running max (log2 units), this lane's share of the sum,
    // and the output, D / 8 tiles of 16x8.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float sl = scale * LOG2E;

    for (unsigned int k0 = 0; k0 < t; k0 += FA_K) {
        __syncthreads();  // the previous tile's readers are done
        for (unsigned int w = threadIdx.x; w < FA_K * (D / 8); w += blockDim.x) {
            unsigned int j = w / (D / 8), x = (w % (D / 8)) * 8;
            W16 kw = {{0u, 0u, 0u, 0u}}, vw = kw;  // keys past t: zeros, masked below
            if (k0 + j < t) {
                const unsigned short* src = seq + (unsigned long long)(k0 + j) * stride + x;
                kw = *(const W16*)(src + c);
                vw = *(const W16*)(src + 2 * c);
            }
            *(W16*)(ks + j * S + x) = kw;
            *(W16*)(vs + j * S + x) = vw;
        }
        __syncthreads();
        if (q0 >= t) continue;  // a warp past the last query still loads its share of the tiles

        // Scores of the warp's 16 queries against the tile's 64 keys: 8 tiles of 16x8.
        float s[FA_K / 8][4];
#pragma unroll
        for (int n = 0; n < FA_K / 8; n++) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const unsigned short* krow = ks + (n * 8 + g) * S + c2;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                mma16816<E>(s[n], qa[kk], *(const unsigned int*)(krow + kk * 16), *(const unsigned int*)(krow + kk * 16 + 8));
            }
        }
        // Scale and bias in log2 units; keys past t are -inf.
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < FA_K / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                unsigned int i = e < 2 ? r0 : r1, j = k0 + n * 8 + c2 + (e & 1);
                float v = s[n][e] * sl;
                if (j >= t) v = NEG_INF;
                else if (mode == 1) v += LOG2E * E::get(bias, (unsigned long long)bi * t + j);
                else if (mode == 2 && i < t) v += LOG2E * E::get(bias, ((((unsigned long long)(bi % r) * h + hi) * t + i) * t) + j);
                s[n][e] = v;
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        // The four lanes of a row hold its 64 keys between them.
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // A row masked so far (max -inf) subtracts 0, so that exp2(-inf - 0) is 0 and not NaN.
        float base0 = mx0 == NEG_INF ? 0.f : mx0, base1 = mx1 == NEG_INF ? 0.f : mx1;
        float a0 = exp2f(m0 - base0), a1 = exp2f(m1 - base1);
        m0 = mx0;
        m1 = mx1;
        l0 *= a0;
        l1 *= a1;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= a0; o[n][1] *= a0;
            o[n][2] *= a1; o[n][3] *= a1;
        }
#pragma unroll
        for (int n = 0; n < FA_K / 8; n++) {
            s[n][0] = exp2f(s[n][0] - base0); s[n][1] = exp2f(s[n][1] - base0);
            s[n][2] = exp2f(s[n][2] - base1); s[n][3] = exp2f(s[n][3] - base1);
            l0 += s[n][0] + s[n][1];
            l1 += s[n][2] + s[n][3];
        }
        // O += P V, 16 keys at a time: two score tiles side by side are one A fragment, and the
        // values' tiles are read transposed as B fragments, two 16x8 output tiles per load.
#pragma unroll
        for (int kk = 0; kk < FA_K / 16; kk++) {
            unsigned int pa[4] = {
                pack2<E>(s[2 * kk][0], s[2 * kk][1]), pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
            const unsigned short* vrow = vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S + (lane >> 4) * 8;
#pragma unroll
            for (int n2 = 0; n2 < D / 16; n2++) {
                unsigned int vb[4];
                load_tiles_transposed(vb, vrow + n2 * 16);
                mma16816<E>(o[2 * n2], pa, vb[0], vb[1]);
                mma16816<E>(o[2 * n2 + 1], pa, vb[2], vb[3]);
            }
        }
    }
    if (q0 >= t) return;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // A row whose every key is masked with -inf has no weights: its output is 0.
    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    unsigned short* dst = out + (unsigned long long)bi * t * c + hi * D + c2;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        if (r0 < t) *(unsigned int*)(dst + (unsigned long long)r0 * c + n * 8) = pack2<E>(o[n][0] * inv0, o[n][1] * inv0);
        if (r1 < t) *(unsigned int*)(dst + (unsigned long long)r1 * c + n * 8) = pack2<E>(o[n][2] * inv1, o[n][3] * inv1);
    }
}

#define FUSED(S, E, D)                                                                                   \
extern "C" __global__ void __launch_bounds__(128) attn_fused_##S##_d##D(const unsigned short* qkv,       \
        const unsigned short* bias, unsigned short* out, unsigned int t, unsigned int h, unsigned int r, \
        int mode, float scale) {                                                                          \
    attn_fused<E, D>(qkv, bias, out, t, h, r, mode, scale);                                              \
}
FUSED(bf16, BF16, 32)
FUSED(bf16, BF16, 64)
FUSED(bf16, BF16, 128)
FUSED(f16, F16, 32)
FUSED(f16, F16, 64)
FUSED(f16, F16, 128)

// f32 on the CUDA cores (PyTorch's f32 attention does not use TF32 either). Each query's score row
// and output live in registers of SPLIT lanes, each of which holds D / SPLIT of its features for QT
// queries; keys and values pass through shared memory 64 at a time and are read 16 keys at a time
// by every lane of the block at once (one broadcast word per load). A lane's four-float words are
// interleaved with its partner's (word w·SPLIT + part), so the pair's loads fall in distinct banks.
// grid (b·h, ceil(t / queries per block)), 128 threads; qkv, bias and out as attn_fused's.
__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}
__device__ __forceinline__ float4 axpy4(float a, float4 x, float4 y) {
    return make_float4(fmaf(a, x.x, y.x), fmaf(a, x.y, y.y), fmaf(a, x.z, y.z), fmaf(a, x.w, y.w));
}
#define FS_THREADS 128
#define FS_K 64   // keys per shared-memory tile
#define FS_C 16   // keys per register chunk
template <int D, int QT, int SPLIT>
__device__ void attn_fused_simt(const float* qkv, const float* bias, float* out, unsigned int t, unsigned int h,
                                unsigned int r, int mode, float scale) {
    constexpr int W = D / 4, WT = W / SPLIT, WQ = 32 / SPLIT * QT, QB = FS_THREADS / 32 * WQ;
    __shared__ float4 ks[FS_K * W];
    __shared__ float4 vs[FS_K * W];
    const float LOG2E = 1.4426950408889634f, NEG_INF = __int_as_float(0xff800000);
    unsigned int bh = blockIdx.x, bi = bh / h, hi = bh % h, c = h * D, stride = 3 * c;
    unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = lane % SPLIT, slot = lane / SPLIT;
    unsigned int wq0 = blockIdx.y * QB + warp * WQ;  // the warp's first query: it takes WQ in a row
    const float* seq = qkv + (unsigned long long)bi * t * stride + hi * D;
    unsigned int qi[QT];
    float4 q[QT][WT], o[QT][WT];
    float m[QT], l[QT];
#pragma unroll
    for (int u = 0; u < QT; u++) {
        qi[u] = wq0 + u * (32 / SPLIT) + slot;
        m[u] = NEG_INF;
        l[u] = 0.f;
#pragma unroll
        for (int w = 0; w < WT; w++) {
            q[u][w] = qi[u] < t ? ((const float4*)(seq + (unsigned long long)qi[u] * stride))[w * SPLIT + part] : make_float4(0.f, 0.f, 0.f, 0.f);
            o[u][w] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    const float sl = scale * LOG2E;
    const bool active = wq0 < t;  // a warp past the last query only helps load the tiles

    for (unsigned int k0 = 0; k0 < t; k0 += FS_K) {
        __syncthreads();  // the previous tile's readers are done
        for (unsigned int i = threadIdx.x; i < FS_K * W; i += FS_THREADS) {
            unsigned int j = i / W, x = i % W;
            float4 kw = make_float4(0.f, 0.f, 0.f, 0.f), vw = kw;  // keys past t: zeros, masked below
            if (k0 + j < t) {
                const float4* src = (const float4*)(seq + (unsigned long long)(k0 + j) * stride);
                kw = src[W * h + x];
                vw = src[2 * W * h + x];
            }
            ks[i] = kw;
            vs[i] = vw;
        }
        __syncthreads();
        if (!active) continue;
        unsigned int keys = min((unsigned int)FS_K, t - k0);
        for (unsigned int jc = 0; jc < keys; jc += FS_C) {
            float s[QT][FS_C];
#pragma unroll
            for (int u = 0; u < QT; u++)
#pragma unroll
                for (int j = 0; j < FS_C; j++) s[u][j] = 0.f;
#pragma unroll
            for (int w = 0; w < WT; w++) {
#pragma unroll
                for (int j = 0; j < FS_C; j++) {
                    float4 kw = ks[(jc + j) * W + w * SPLIT + part];
#pragma unroll
                    for (int u = 0; u < QT; u++) s[u][j] = dot4(q[u][w], kw, s[u][j]);
                }
            }
#pragma unroll
            for (int u = 0; u < QT; u++) {
                float mx = m[u];
#pragma unroll
                for (int j = 0; j < FS_C; j++) {
#pragma unroll
                    for (int o2 = 1; o2 < SPLIT; o2 <<= 1) s[u][j] += __shfl_xor_sync(0xffffffffu, s[u][j], o2);
                    unsigned int key = k0 + jc + j;
                    float v = s[u][j] * sl;
                    if (key >= t) v = NEG_INF;
                    else if (mode == 1) v += LOG2E * bias[(unsigned long long)bi * t + key];
                    else if (mode == 2 && qi[u] < t) v += LOG2E * bias[((((unsigned long long)(bi % r) * h + hi) * t + qi[u]) * t) + key];
                    s[u][j] = v;
                    mx = fmaxf(mx, v);
                }
                // A row masked so far (max -inf) subtracts 0, so that exp2(-inf - 0) is 0 and not NaN.
                float base = mx == NEG_INF ? 0.f : mx, a = exp2f(m[u] - base);
                m[u] = mx;
                l[u] *= a;
#pragma unroll
                for (int w = 0; w < WT; w++) { o[u][w].x *= a; o[u][w].y *= a; o[u][w].z *= a; o[u][w].w *= a; }
#pragma unroll
                for (int j = 0; j < FS_C; j++) {
                    s[u][j] = exp2f(s[u][j] - base);
                    l[u] += s[u][j];
                }
            }
#pragma unroll
            for (int j = 0; j < FS_C; j++) {
#pragma unroll
                for (int w = 0; w < WT; w++) {
                    float4 vw = vs[(jc + j) * W + w * SPLIT + part];
#pragma unroll
                    for (int u = 0; u < QT; u++) o[u][w] = axpy4(s[u][j], vw, o[u][w]);
                }
            }
        }
    }
    if (!active) return;
#pragma unroll
    for (int u = 0; u < QT; u++) {
        if (qi[u] >= t) continue;
        // A row whose every key is masked with -inf has no weights: its output is 0.
        float inv = l[u] > 0.f ? 1.f / l[u] : 0.f;
        float4* dst = (float4*)(out + ((unsigned long long)bi * t + qi[u]) * c + hi * D);
#pragma unroll
        for (int w = 0; w < WT; w++) dst[w * SPLIT + part] = make_float4(o[u][w].x * inv, o[u][w].y * inv, o[u][w].z * inv, o[u][w].w * inv);
    }
}

// Which work per lane, the fastest of the splits tried: heads of 64 two queries over two lanes
// (faster than one query per lane or four over four lanes); heads of 32 one query per lane (faster
// than two over two). Capping registers for a third block per SM spills the two-query kernel.
// (measured: docs/kernels.md#fused-attention)
#define FUSED_SIMT(D, QT, SPLIT)                                                                          \
extern "C" __global__ void __launch_bounds__(FS_THREADS) attn_fused_f32_d##D(const float* qkv,          \
        const float* bias, float* out, unsigned int t, unsigned int h, unsigned int r, int mode,         \
        float scale) {                                                                                    \
    attn_fused_simt<D, QT, SPLIT>(qkv, bias, out, t, h, r, mode, scale);                                 \
}
FUSED_SIMT(32, 1, 1)
FUSED_SIMT(64, 2, 2)
