// Attention's forward as one kernel from the packed [b, t, 3·h·d] projection (an encoder's), or from a
// decoder's prefill [b, t, (h + 2·kv)·d] with grouped-query heads and a causal mask: online softmax in
// f32. bf16/f16 heads of 32, 64 or 128 on tensor cores (m16n8k16 mma.sync, 64 queries per block of four
// warps, keys in shared-memory tiles of 64), every layout; f32 heads of 32 or 64 on the CUDA cores, an
// encoder's packed heads alone, a query's
// features and output in registers. Probabilities are rounded to the input dtype for P·V, as
// FlashAttention does.

// FA_Q, queries per block (four warps of 16), is defined by the Rust side (kernels/attention.rs).
#define FA_K 64   // keys per shared-memory tile

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
__device__ __forceinline__ unsigned int shared_address(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void load_tiles_transposed(unsigned int* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}
// The same four tiles as they are: lane l receives, of each tile, the elements (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1) — with keys as rows, the B fragments of two k-steps of q kᵀ at once.
__device__ __forceinline__ void load_tiles(unsigned int* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(p)));
}

// 2^x as the one MUFU instruction, without exp2f's handling of results below 2^-126 (which would
// round to 0 in the probabilities' bf16 or f16 anyway): 2^-inf is 0.
__device__ __forceinline__ float exp2_fast(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes from global to shared memory without passing through registers (sm80+); `bytes` 0 writes
// zeros (keys past the sequence's end). Copies issued since the last commit form one group.
__device__ __forceinline__ void copy_async16(unsigned int dst, const unsigned short* src, unsigned int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N committed groups are still in flight.
template <int N> __device__ __forceinline__ void copy_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// softmax(scale · q kᵀ + bias) v for 64 queries of one (sequence, head) per block; qkv [b, t, stride]
// with the h query heads (c = h·D) first, a head's keys at kcol + (head / group)·D and its values vgap
// after them (an encoder's packed [b, t, 3c]: stride 3c, kcol c, vgap c, group 1; a decoder's prefill
// [q | k | v] with fewer key-value heads: kcol c, vgap their width), out [b, t, c]. Bias modes as
// attention.rs's softmax: 1, a key mask bias[bi, j]; 2, bias[bi % r, hi, i, j]; 3, causal (query i
// attends keys j <= i), no bias read. A one-dimensional grid of b·h·ceil(t / 64) blocks of 128
// threads, the query blocks of one (sequence, head) side by side: they read the same keys and
// values, which then come from L2 for all but the first (with the head's blocks a grid row apart,
// ViT-B's 116 MB projection per layer left L2 between them and every block read its keys from
// device memory).
//
// The next tile of keys and values is copied (cp.async) while the warps work on the current one,
// for heads up to 64 (two tiles of a head of 128 are more than a block's 48 KB of static shared
// memory); the keys' B fragments are read by ldmatrix, two k-steps per instruction.
//
// Every tile computes all 64 keys, masking those past t: skipping the empty 8-key groups of ViT's
// last tile (197 tokens leave 5 keys in it) by a branch per group, or by a second, shorter copy of
// the tile's code, made the kernel slower (BERT-base's too, whose tiles are all full), and so did
// 32 queries per warp (two row tiles sharing each K and V fragment) (measured:
// docs/kernels.md#fused-attention).
//
// `qs`: the first query answered (0 but for a causal prompt continued after its cached part, whose
// rows before qs carry that part's keys and values alone); out holds rows qs..t.
template <typename E, int D>
__device__ void attn_fused(const unsigned short* qkv, const unsigned short* bias, unsigned short* out,
                           unsigned int t, unsigned int h, unsigned int r, int mode, float scale,
                           unsigned int stride, unsigned int kcol, unsigned int vgap, unsigned int group,
                           unsigned int qs) {
    constexpr int S = D + 8;  // shared rows padded by 16 bytes: the fragment loads hit 32 distinct banks
    constexpr int STAGES = D <= 64 ? 2 : 1;
    __shared__ __align__(16) unsigned short ks[STAGES][FA_K * S];
    __shared__ __align__(16) unsigned short vs[STAGES][FA_K * S];
    const float LOG2E = 1.4426950408889634f, NEG_INF = __int_as_float(0xff800000);
    unsigned int qblocks = (t - qs + FA_Q - 1) / FA_Q, bh = blockIdx.x / qblocks, bi = bh / h, hi = bh % h;
    unsigned int c = h * D;
    unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c2 = (lane & 3) * 2;
    unsigned int qb0 = qs + (blockIdx.x % qblocks) * FA_Q, q0 = qb0 + warp * 16, r0 = q0 + g, r1 = r0 + 8;
    const unsigned short* seq = qkv + (unsigned long long)bi * t * stride + hi * D;
    // The head's keys (values vgap after them): query head hi reads key-value head hi / group.
    const unsigned short* kseq = qkv + (unsigned long long)bi * t * stride + kcol + (hi / group) * D;
    unsigned int tiles = (t + FA_K - 1) / FA_K;
    // Causal: no tile past the block's last query is read.
    if (mode == 3) tiles = min(tiles, (qb0 + FA_Q + FA_K - 1) / FA_K);

    // Tiles of keys and values, rows [k0, k0 + 64), into shared memory by cp.async; rows past t are
    // zeros (masked in the scores). Thread x copies the same words of every tile: 16 bytes of row
    // x / (D / 8), and of every ROWS-th row after it. Addresses are worked out once: the loop over
    // every word of a tile, with its divisions and 64-bit products, had cost as many instructions
    // as the two products' mma.
    constexpr int ROWS = 128 / (D / 8);
    const unsigned int lrow = threadIdx.x / (D / 8), lx = (threadIdx.x % (D / 8)) * 8;
    const unsigned short* ksrc = kseq + (unsigned long long)lrow * stride + lx;
    const unsigned int kdst = shared_address(&ks[0][lrow * S + lx]), vdst = shared_address(&vs[0][lrow * S + lx]);
    auto load_tile = [&](unsigned int stage, unsigned int k0) {
#pragma unroll
        for (int p = 0; p < FA_K / ROWS; p++) {
            bool in = k0 + lrow + p * ROWS < t;
            // A row past t still names an address inside the sequence (its first key); 0 bytes
            // are read from it.
            const unsigned short* src = in ? ksrc + (unsigned long long)(k0 + p * ROWS) * stride : kseq;
            unsigned int offset = (stage * FA_K * S + p * ROWS * S) * 2;
            copy_async16(kdst + offset, src, in ? 16u : 0u);
            copy_async16(vdst + offset, src + vgap, in ? 16u : 0u);
        }
        copy_async_commit();
    };
    load_tile(0, 0);

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

    for (unsigned int tile = 0; tile < tiles; tile++) {
        unsigned int k0 = tile * FA_K, stage = STAGES == 2 ? tile & 1 : 0;
        bool next = tile + 1 < tiles;
        if constexpr (STAGES == 2) {
            // The other stage was read in the previous iteration, which ended at a barrier; this
            // tile's copies are then all but the newest group.
            if (next) {
                load_tile(stage ^ 1, k0 + FA_K);
                copy_async_wait<1>();
            } else {
                copy_async_wait<0>();
            }
        } else {
            copy_async_wait<0>();
        }
        __syncthreads();  // this tile's copies, by every thread, are visible
        // A warp past the last query only helps to load the tiles.
        if (q0 < t) {
            // Scores of the warp's 16 queries against the tile's 64 keys: 8 tiles of 16x8. Lane l
            // points ldmatrix at key l % 8 of a group of 8 and features (l / 8)·8 of 32.
            const unsigned short* kfrag = ks[stage] + (lane & 7) * S + (lane >> 3) * 8;
            float s[FA_K / 8][4];
#pragma unroll
            for (int n = 0; n < FA_K / 8; n++) {
                s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
                for (int k2 = 0; k2 < D / 32; k2++) {
                    unsigned int kb[4];
                    load_tiles(kb, kfrag + n * 8 * S + k2 * 32);
                    mma16816<E>(s[n], qa[2 * k2], kb[0], kb[1]);
                    mma16816<E>(s[n], qa[2 * k2 + 1], kb[2], kb[3]);
                }
            }
            // Scale and bias in log2 units. What depends on the key alone (-inf past t, a key mask's
            // bias) is one term per column, shared by the lane's two rows: one FMA per score; a
            // full tile without a bias (every tile of ViT's but the last) is only scaled.
            float mx0 = m0, mx1 = m1;
            // Causal tiles wholly at or before the warp's first query mask nothing.
            if ((mode == 0 || (mode == 3 && k0 + FA_K <= q0 + 1)) && k0 + FA_K <= t) {
#pragma unroll
                for (int n = 0; n < FA_K / 8; n++) {
#pragma unroll
                    for (int e = 0; e < 4; e++) s[n][e] *= sl;
                    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
                }
            } else {
#pragma unroll
                for (int n = 0; n < FA_K / 8; n++) {
                    unsigned int j0 = k0 + n * 8 + c2;
                    float col[2];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        unsigned int j = j0 + e;
                        col[e] = j >= t ? NEG_INF : mode == 1 ? LOG2E * E::get(bias, (unsigned long long)bi * t + j) : 0.f;
                    }
#pragma unroll
                    for (int e = 0; e < 4; e++) s[n][e] = fmaf(s[n][e], sl, col[e & 1]);
                    if (mode == 2) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            unsigned int i = e < 2 ? r0 : r1, j = j0 + (e & 1);
                            if (i < t && j < t) s[n][e] += LOG2E * E::get(bias, ((((unsigned long long)(bi % r) * h + hi) * t + i) * t) + j);
                        }
                    }
                    if (mode == 3) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            if (j0 + (e & 1) > (e < 2 ? r0 : r1)) s[n][e] = NEG_INF;
                        }
                    }
                    mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
                    mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
                }
            }
            // The four lanes of a row hold its 64 keys between them.
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            // A row masked so far (max -inf) subtracts 0, so that exp2(-inf - 0) is 0 and not NaN.
            float base0 = mx0 == NEG_INF ? 0.f : mx0, base1 = mx1 == NEG_INF ? 0.f : mx1;
            float a0 = exp2_fast(m0 - base0), a1 = exp2_fast(m1 - base1);
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
                s[n][0] = exp2_fast(s[n][0] - base0); s[n][1] = exp2_fast(s[n][1] - base0);
                s[n][2] = exp2_fast(s[n][2] - base1); s[n][3] = exp2_fast(s[n][3] - base1);
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
                const unsigned short* vrow = vs[stage] + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S + (lane >> 4) * 8;
#pragma unroll
                for (int n2 = 0; n2 < D / 16; n2++) {
                    unsigned int vb[4];
                    load_tiles_transposed(vb, vrow + n2 * 16);
                    mma16816<E>(o[2 * n2], pa, vb[0], vb[1]);
                    mma16816<E>(o[2 * n2 + 1], pa, vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // every reader of this stage is done before a copy writes it again
        if constexpr (STAGES == 1) {
            if (next) load_tile(0, k0 + FA_K);
        }
    }
    if (q0 >= t) return;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    // A row whose every key is masked with -inf has no weights: its output is 0.
    float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    unsigned short* dst = out + (unsigned long long)bi * (t - qs) * c + hi * D + c2;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        if (r0 < t) *(unsigned int*)(dst + (unsigned long long)(r0 - qs) * c + n * 8) = pack2<E>(o[n][0] * inv0, o[n][1] * inv0);
        if (r1 < t) *(unsigned int*)(dst + (unsigned long long)(r1 - qs) * c + n * 8) = pack2<E>(o[n][2] * inv1, o[n][3] * inv1);
    }
}

// Heads up to 64 ask for four blocks per SM (registers capped at 128 a thread): at 132 registers
// three fit, and the kernel, short of warps to switch between, stalled on its loads
// (docs/kernels.md#fused-attention).
#define FUSED(S, E, D)                                                                                   \
extern "C" __global__ void __launch_bounds__(128, D <= 64 ? 4 : 1) attn_fused_##S##_d##D(const unsigned short* qkv, \
        const unsigned short* bias, unsigned short* out, unsigned int t, unsigned int h, unsigned int r, \
        int mode, float scale, unsigned int stride, unsigned int kcol, unsigned int vgap, unsigned int group, \
        unsigned int qs) {                                                                               \
    attn_fused<E, D>(qkv, bias, out, t, h, r, mode, scale, stride, kcol, vgap, group, qs);                \
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
// interleaved with those of the other SPLIT - 1 lanes of its query (word w·SPLIT + part), so their
// loads fall in distinct banks.
// grid and operands as attn_fused's for an encoder's packed [b, t, 3c] (no stride, kcol, vgap or group;
// no causal mode), b·h·ceil(t / queries per block) blocks of 128 threads.
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
    unsigned int qblocks = (t + QB - 1) / QB, bh = blockIdx.x / qblocks, bi = bh / h, hi = bh % h;
    unsigned int c = h * D, stride = 3 * c;
    unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, part = lane % SPLIT, slot = lane / SPLIT;
    // The warp's first query: it takes WQ in a row.
    unsigned int wq0 = (blockIdx.x % qblocks) * QB + warp * WQ;
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

// Q queries per block (the name's _qQ), four kernels per head size; fused_attention.rs times the
// four on a shape's first launch and keeps the fastest. Blocks of 128, the work per lane of the
// fastest split tried at batch 128: heads of 64 two queries over two lanes (faster than one query
// per lane or four over four lanes); heads of 32 one query per lane (faster than two over two).
// Capping registers for a third block per SM spills the two-query kernel. Blocks of 64, 32 and 16
// (one query over 2, 4 or 8 lanes) spread a short grid over more multiprocessors (ViT-B at batch 1
// fills a fifth of them in blocks of 128) and waste fewer lanes on short windows (Swin-T's 49 tokens).
// (measured: docs/kernels.md#fused-attention)
#define FUSED_SIMT(D, Q, QT, SPLIT)                                                                       \
static_assert(FS_THREADS / 32 * (32 / SPLIT) * QT == Q, "queries per block");                           \
extern "C" __global__ void __launch_bounds__(FS_THREADS) attn_fused_f32_d##D##_q##Q(const float* qkv,   \
        const float* bias, float* out, unsigned int t, unsigned int h, unsigned int r, int mode,         \
        float scale) {                                                                                    \
    attn_fused_simt<D, QT, SPLIT>(qkv, bias, out, t, h, r, mode, scale);                                 \
}
FUSED_SIMT(32, 128, 1, 1)
FUSED_SIMT(32, 64, 1, 2)
FUSED_SIMT(32, 32, 1, 4)
FUSED_SIMT(32, 16, 1, 8)
FUSED_SIMT(64, 128, 2, 2)
FUSED_SIMT(64, 64, 1, 2)
FUSED_SIMT(64, 32, 1, 4)
FUSED_SIMT(64, 16, 1, 8)
