// A language model's decode step at small batches, where the step is matrix-vector products: every
// weight is read once per step and used by each of B ≤ 8 sequences, so the step's time is the time to
// stream the weights. One warp per output row (or per pair of rows: a rotary pair, gate with up; or
// a span of a long row, gemv): its 32 lanes read the rows in 16-byte words, several words in flight
// per lane, and keep B sums in f32; the few activations (x, [B, k]) come from L1, or from shared
// memory where the block normalized them itself (the RMSNorm before q/k/v, the MLP and the head).
// What follows a product in the model is done where its sum is made: the bias, the rotary embedding
// and the write into the KV cache's slot (q, k and v), SiLU times the up projection (the MLP's gate),
// the residual add (o and down). Each product's
// output is rounded to the element type where PyTorch's is, and so is what is made of it; the rotary
// embedding alone is computed in f32 and rounded once (PyTorch rounds its two products and their sum).
//
// Attention over the cache is flash-decoding's: one query token against up to the cache's capacity,
// split into chunks of 16 to DA_CHUNK slots (the host picks them to fill the GPU), one block per
// (sequence, key-value head, chunk) with every query
// head of the group, each writing its partial softmax (max, sum, f32 output); a second kernel combines
// the chunks. Both read the step's position from the device, so a captured step replays at any
// position: chunks past it exit at once.
//
// The cache is either contiguous, [B, hkv, cap, d] (every sequence at the step's one position), or a
// paged pool, [blocks, hkv, block, d] with a block table per sequence and each sequence at a position
// of its own (a server's batch, whose sequences came at different times). Contiguous buffers are the
// pool of one block of cap slots per sequence, so one addressing serves both (cache_row).

// Defined by the Rust side (kernels/decode/mod.rs), which launches with them: DEC_WARPS (warps per block
// of the product kernels), DEC_UNROLL (words of a weight row each lane has in flight, half that past 4
// sequences), DA_CHUNK (the most cache slots a block of the attention kernel takes), DA_THREADS,
// DA_MAX_GROUP (query heads per key-value head), NORM_MAX (elements of normalized activations a
// product's block keeps: 47.5 KB, beside its sums), DC_THREADS and AM_THREADS.

// Programmatic dependent launch (Hopper): the host launches these kernels so that one may start while
// the kernel ahead of it finishes (Kernel::launch_overlapping). Each kernel calls this before it reads
// what the kernel ahead wrote or writes anything: it waits until the kernel ahead has ended and its
// writes are visible, then lets the kernel after this one start (so what kernels further back wrote
// is done before a kernel starts). The products issue their first weight loads before it, and
// attention its cache's earlier slots, so a layer's short kernels and each kernel's last blocks
// overlap the next kernel's reading instead of leaving the memory idle. Compiled for an older GPU
// (or launched without the attribute) it does nothing, and kernels run one after another.
__device__ __forceinline__ void wait_for_inputs() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A 16-byte word of a weight row, read once: not kept in L1, where the activations are.
__device__ __forceinline__ uint4 load_once(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// The eight elements of a word as floats.
template <typename E> __device__ __forceinline__ void unpack8(uint4 w, float* f);
template <> __device__ __forceinline__ void unpack8<BF16>(uint4 w, float* f) {
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}
template <> __device__ __forceinline__ void unpack8<F16>(uint4 w, float* f) {
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned short lo = u[i] & 0xffffu, hi = u[i] >> 16;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f[2 * i]) : "h"(lo));
        asm("cvt.f32.f16 %0, %1;" : "=f"(f[2 * i + 1]) : "h"(hi));
    }
}

// Elements between a thread's words of a row in rms_normalized: the block's threads take 8 each.
#define NORM_STRIDE (DEC_WARPS * 32 * 8)
// The first NORM_WORDS words of a norm's weight that a thread scales with (rms_normalized's second
// pass), loaded by inputs_ready before the kernel waits for the kernel ahead.
#define NORM_WORDS 2

// x [B, k] through Llama's RMSNorm with weight w, as transformers computes it: in f32, x / rms(x)
// rounded to the element type, times w, rounded again; into shared memory, for the block's products
// (NORM_MAX elements at most). Every thread of the block calls it, with its first NORM_WORDS words
// of w already loaded (nw): the norm costs the block a read of x from L2 instead of a kernel of its
// own and a round trip of its output.
template <typename E, int B>
__device__ const typename E::T* rms_normalized(const typename E::T* x, const typename E::T* w, unsigned int k,
                                               float eps, const uint4 (&nw)[NORM_WORDS]) {
    __shared__ __align__(16) typename E::T xs[NORM_MAX];
    __shared__ float part[DEC_WARPS][B];
    __shared__ float inv[B];
    const unsigned int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float ss[B];
#pragma unroll
    for (int s = 0; s < B; ++s) ss[s] = 0.f;
    for (unsigned int c = tid * 8; c < k; c += NORM_STRIDE) {
#pragma unroll
        for (int s = 0; s < B; ++s) {
            float f[8];
            unpack8<E>(__ldg((const uint4*)(x + (unsigned long long)s * k + c)), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss[s] = fmaf(f[e], f[e], ss[s]);
        }
    }
#pragma unroll
    for (int s = 0; s < B; ++s) {
        ss[s] = warp_sum(ss[s]);
        if (lane == 0) part[warp][s] = ss[s];
    }
    __syncthreads();
    if (tid < B) {
        float t = 0.f;
        for (int v = 0; v < DEC_WARPS; ++v) t += part[v][tid];
        inv[tid] = rsqrtf(t / k + eps);
    }
    __syncthreads();
    // x's words come from L1 this time (the sums just read them).
    auto scale = [&](uint4 word, unsigned int c) {
        float wf[8];
        unpack8<E>(word, wf);
#pragma unroll
        for (int s = 0; s < B; ++s) {
            float f[8];
            unpack8<E>(__ldg((const uint4*)(x + (unsigned long long)s * k + c)), f);
#pragma unroll
            for (int e = 0; e < 8; ++e) E::put(xs, (unsigned long long)s * k + c + e, wf[e] * rounded<E>(f[e] * inv[s]));
        }
    };
#pragma unroll
    for (int j = 0; j < NORM_WORDS; ++j) {
        const unsigned int c = tid * 8 + j * NORM_STRIDE;
        if (c < k) scale(nw[j], c);
    }
    for (unsigned int c = tid * 8 + NORM_WORDS * NORM_STRIDE; c < k; c += NORM_STRIDE)
        scale(__ldg((const uint4*)(w + c)), c);
    __syncthreads();
    return xs;
}

// What a product does between issuing its first weight loads and its arithmetic: waits for the
// kernel ahead (wait_for_inputs), issues the loads its output needs beside the product (`after_wait`:
// q/k/v's positions and rotary angles, whose round trip then overlaps the norm), and returns the x
// its rows multiply, with NORM x through the RMSNorm in shared memory (rms_normalized). Loaded after
// the product, they were a round trip to memory between the last sum and the write. The norm's
// weight is a parameter, so its first words are loaded before the wait: the layer's weights streamed
// since its last use push it out of L2, and loaded after the wait it would be a round trip to memory
// between the norm's sums and the products.
template <typename E, int B, bool NORM, typename F>
__device__ __forceinline__ const typename E::T* inputs_ready(const typename E::T* x, const typename E::T* norm_w,
                                                             unsigned int k, float eps, F&& after_wait) {
    if constexpr (NORM) {
        uint4 nw[NORM_WORDS];
#pragma unroll
        for (int j = 0; j < NORM_WORDS; ++j) {
            const unsigned int c = threadIdx.x * 8 + j * NORM_STRIDE;
            nw[j] = c < k ? __ldg((const uint4*)(norm_w + c)) : make_uint4(0u, 0u, 0u, 0u);
        }
        wait_for_inputs();
        after_wait();
        return rms_normalized<E, B>(x, norm_w, k, eps, nw);
    } else {
        wait_for_inputs();
        after_wait();
        return x;
    }
}

// Words of a weight row each lane has in flight, at B sequences.
template <int B> struct Group {
    static constexpr int U = B <= 4 ? DEC_UNROLL : DEC_UNROLL / 2;
};

// Issues the loads of this lane's group of words from element c0 of R rows of k elements (zeros past
// k; k = 0 loads nothing). Every load of a group is issued before its arithmetic, the group's last
// words predicated: a row of 1,536 (six words a lane) is one round trip to memory, not a group and
// two single words after it, each waiting for the one before.
template <int R, int U, typename T>
__device__ __forceinline__ void load_group(const T* const* w, unsigned int c0, unsigned int k, uint4 (&ww)[R][U]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned int c = c0 + 256 * u;
            ww[r][u] = c < k ? load_once(w[r] + c) : make_uint4(0u, 0u, 0u, 0u);
        }
}

// acc[r][s] += a loaded group's words of row r · x_s, for the B sequences of x (rows of ldx
// elements, the first k of them used; in global memory, or in shared memory when SHARED).
template <typename E, int B, int R, int U, bool SHARED>
__device__ __forceinline__ void use_group(const uint4 (&ww)[R][U], const typename E::T* x, unsigned int ldx,
                                          unsigned int c0, unsigned int k, float (*acc)[B]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const unsigned int c = c0 + 256 * u;
        if (c >= k) break;
#pragma unroll
        for (int s = 0; s < B; ++s) {
            float xf[8];
            const uint4* xw = (const uint4*)(x + (unsigned long long)s * ldx + c);
            unpack8<E>(SHARED ? *xw : __ldg(xw), xf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float wf[8];
                unpack8<E>(ww[r][u], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][s] = fmaf(wf[e], xf[e], acc[r][s]);
            }
        }
    }
}

// acc[r][s] = w_r · x_s over R rows of k elements (k a multiple of 8, each row and x from a 16-byte
// boundary; x's rows ldx apart), summed over the warp, from this lane's first group of words
// already loaded (`first`, load_group at lane · 8): a kernel issues those loads before it
// normalizes x, so that the weights are on their way while the block computes the norm.
template <typename E, int B, int R, bool SHARED>
__device__ __forceinline__ void rows_dot(const typename E::T* const* w, const typename E::T* x, unsigned int ldx,
                                         unsigned int k, float (*acc)[B], const uint4 (&first)[R][Group<B>::U]) {
    constexpr int U = Group<B>::U;
    const unsigned int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int s = 0; s < B; ++s) acc[r][s] = 0.f;
    use_group<E, B, R, U, SHARED>(first, x, ldx, lane * 8, k, acc);
    for (unsigned int c0 = lane * 8 + 256 * U; c0 < k; c0 += 256 * U) {
        uint4 ww[R][U];
        load_group<R, U>(w, c0, k, ww);
        use_group<E, B, R, U, SHARED>(ww, x, ldx, c0, k, acc);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int s = 0; s < B; ++s) acc[r][s] = warp_sum(acc[r][s]);
}

// y[s, row] = x_s · w[row] for n rows of k, plus res[s, row] when res is given (the residual stream:
// PyTorch adds the rounded product to it and rounds again).
// With NORM, x is normalized first (rms_normalized, with norm_w and eps).
//
// A row is split over `split` consecutive warps of the block (1, 2, 4 or DEC_WARPS; the host picks
// it, decode::gemv_split), each taking a span of whole 16-byte words of the row, whose sums the
// block adds: a long row (down's 8,960) read by one warp is a chain of round trips to memory, each
// group waiting for the one before, where split over warps that issue their loads at once it is one.
template <typename E, int B, bool NORM>
__device__ void gemv(const typename E::T* w, const typename E::T* x, const typename E::T* norm_w, float eps,
                     const typename E::T* res, typename E::T* y, unsigned int n, unsigned int k, unsigned int split) {
    // The head (NORM) keeps its rows whole: each block would redo the norm, whose shared memory
    // leaves no room for the warps' sums.
    if constexpr (NORM) split = 1;
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned int row = blockIdx.x * (DEC_WARPS / split) + warp / split, part = warp % split;
    const unsigned int span = (k / 8 + split - 1) / split * 8, c0 = min(k, part * span), len = min(k - c0, span);
    // A warp past the last row loads nothing but still takes part in the block's norm and sums.
    const bool live = row < n;
    const typename E::T* rows[1] = {w + (unsigned long long)(live ? row : 0) * k + c0};
    uint4 first[1][Group<B>::U];
    load_group<1, Group<B>::U>(rows, lane * 8, live ? len : 0, first);
    x = inputs_ready<E, B, NORM>(x, norm_w, k, eps, [] {});
    // Lane s adds sequence s's residual, loaded before the product instead of after it.
    const float r = res && live && part == 0 && lane < B ? E::get(res, (unsigned long long)lane * n + row) : 0.f;
    float acc[1][B];
    rows_dot<E, B, 1, NORM>(rows, x + c0, k, live ? len : 0, acc, first);
    // Every lane has the warp's B sums; lane s keeps sequence s's, and the first warp of a row adds
    // the others'.
    float sum = acc[0][0];
#pragma unroll
    for (int s = 1; s < B; ++s)
        if (lane == s) sum = acc[0][s];
    if constexpr (!NORM) {
        __shared__ float parts[DEC_WARPS][B];
        if (split > 1) {
            if (lane < B) parts[warp][lane] = sum;
            __syncthreads();
            if (part != 0) return;
            if (lane < B)
                for (unsigned int p = 1; p < split; ++p) sum += parts[warp + p][lane];
        }
    }
    if (live && lane < B) {
        const unsigned long long at = (unsigned long long)lane * n + row;
        E::put(y, at, rounded<E>(sum) + r);
    }
}

// The MLP's gated activation: y[s, row] = silu(x_s · gate[row]) · (x_s · up[row]), each product, the
// activation and their product rounded as PyTorch rounds them.
template <typename E, int B, bool NORM>
__device__ void swiglu(const typename E::T* gate, const typename E::T* up, const typename E::T* x,
                       const typename E::T* norm_w, float eps, typename E::T* y, unsigned int n, unsigned int k) {
    const unsigned int row = blockIdx.x * DEC_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const bool live = row < n;
    const unsigned long long at = (unsigned long long)(live ? row : 0) * k;
    const typename E::T* rows[2] = {gate + at, up + at};
    uint4 first[2][Group<B>::U];
    load_group<2, Group<B>::U>(rows, lane * 8, live ? k : 0, first);
    x = inputs_ready<E, B, NORM>(x, norm_w, k, eps, [] {});
    if (!live) return;
    float acc[2][B];
    rows_dot<E, B, 2, NORM>(rows, x, k, k, acc, first);
#pragma unroll
    for (int s = 0; s < B; ++s) {
        if (lane != s) continue;
        float g = rounded<E>(acc[0][s]), u = rounded<E>(acc[1][s]);
        E::put(y, (unsigned long long)s * n + row, rounded<E>(g / (1.f + __expf(-g))) * u);
    }
}

// The row of a cache that holds position p of sequence s's key-value head h: with a block table, the
// pool's block table[s · stride + p / block]; without (table null, block = cap), sequence s's own
// buffer.
__device__ __forceinline__ unsigned long long cache_row(const unsigned int* table, unsigned int stride,
                                                        unsigned int block, unsigned int s, unsigned int hkv,
                                                        unsigned int h, unsigned int p) {
    const unsigned long long b = table ? table[(unsigned long long)s * stride + p / block] : s;
    return (b * hkv + h) * block + p % block;
}

// The attention's projections of one token per sequence, its rotary embedding at the step's position
// and its key and value written into the cache. Heads [0, hq) are queries, [hq, hq + hkv) keys, then
// values; each warp takes the rows i and i + d/2 of one head (a rotary pair: rotate-half, as Llama and
// Qwen2 rotate). q [B, hq, d]; keys and values [B, hkv, cap, d] or a paged pool (cap: its block;
// table, stride: the block tables), sequence s's slot pos[s · pos_stride] written; cos and sin
// [positions, d/2]; biases may be null.
template <typename E, int B, bool NORM>
__device__ void qkv_rope(const typename E::T* wq, const typename E::T* wk, const typename E::T* wv,
                         const typename E::T* bq, const typename E::T* bk, const typename E::T* bv,
                         const typename E::T* cos, const typename E::T* sin, const unsigned int* pos,
                         const typename E::T* x, const typename E::T* norm_w, float eps, typename E::T* q,
                         typename E::T* keys, typename E::T* values, unsigned int hq, unsigned int hkv,
                         unsigned int d, unsigned int k, unsigned int cap, const unsigned int* table,
                         unsigned int stride, unsigned int pos_stride) {
    const unsigned int half = d / 2, lane = threadIdx.x & 31;
    const unsigned int task = blockIdx.x * DEC_WARPS + (threadIdx.x >> 5);
    const unsigned int head = task / half, i = task - head * half;
    const bool live = head < hq + 2 * hkv;
    const typename E::T *w, *bias;
    unsigned int hh;
    int part;
    if (head < hq) { part = 0; w = wq; bias = bq; hh = head; }
    else if (head < hq + hkv) { part = 1; w = wk; bias = bk; hh = head - hq; }
    else if (live) { part = 2; w = wv; bias = bv; hh = head - hq - hkv; }
    else { part = 2; w = wv; bias = bv; hh = 0; }
    const unsigned int r0 = hh * d + i, r1 = r0 + half;
    const typename E::T* rows[2] = {w + (unsigned long long)r0 * k, w + (unsigned long long)r1 * k};
    uint4 first[2][Group<B>::U];
    load_group<2, Group<B>::U>(rows, lane * 8, live ? k : 0, first);
    // The biases are parameters, loaded with the weights; lane s's position and its angles once the
    // kernel ahead is done (the position's buffer is the step's input).
    const float ba = bias && live ? E::get(bias, r0) : 0.f, bb = bias && live ? E::get(bias, r1) : 0.f;
    unsigned int p = 0;
    float c = 1.f, sn = 0.f;
    x = inputs_ready<E, B, NORM>(x, norm_w, k, eps, [&] {
        if (!live || lane >= B) return;
        p = pos[lane * pos_stride];
        if (part < 2) {
            c = E::get(cos, (unsigned long long)p * half + i);
            sn = E::get(sin, (unsigned long long)p * half + i);
        }
    });
    if (!live) return;
    float acc[2][B];
    rows_dot<E, B, 2, NORM>(rows, x, k, k, acc, first);
    // Lane s writes sequence s's pair.
    if (lane >= B) return;
    float a = acc[0][0], b = acc[1][0];
#pragma unroll
    for (int s = 1; s < B; ++s)
        if (lane == s) { a = acc[0][s]; b = acc[1][s]; }
    a = rounded<E>(a + ba);
    b = rounded<E>(b + bb);
    if (part < 2) {
        const float ra = a * c - b * sn, rb = b * c + a * sn;
        a = ra;
        b = rb;
    }
    typename E::T* out;
    unsigned long long at;
    if (part == 0) { out = q; at = ((unsigned long long)lane * hq + hh) * d; }
    else { out = part == 1 ? keys : values; at = cache_row(table, stride, cap, lane, hkv, hh, p) * d; }
    E::put(out, at + i, a);
    E::put(out, at + i + half, b);
}

// One chunk of `chunk` (at most DA_CHUNK) slots of the cache for one (sequence, key-value head) and the
// query heads it serves: grid (chunks, B · hkv); the host picks smaller chunks where B · hkv blocks a
// chunk would leave the GPU's multiprocessors idle. q [B, hq, D]; keys and values [B, hkv, cap, D] or a
// paged pool (cap: its block; table, stride: the block tables), sequence s's slots
// 0..=pos[s · pos_stride] attended; writes
// part_out [B, hq, chunks, D] and part_ml [B, hq, chunks, 2] (the chunk's max of the scores in log2
// units and its sum of their exponentials). `scale` is 1/sqrt(D) · log2(e).
//
// The chunk's keys and values are copied into shared memory first, every word's load issued before
// any is used: the cache comes from device memory (the step's weights have pushed it out of L2), and
// loads made as the arithmetic reaches them were a chain of memory latencies (measured:
// docs/kernels.md#decode).
template <typename E, int D>
__device__ void decode_attention(const typename E::T* q, const typename E::T* keys, const typename E::T* values,
                                 const unsigned int* pos, float* part_out, float* part_ml, unsigned int hq,
                                 unsigned int hkv, unsigned int cap, unsigned int chunk_len, float scale,
                                 const unsigned int* table, unsigned int stride, unsigned int pos_stride) {
    typedef typename E::T T;
    constexpr int S = D + 8;  // a row padded by 16 bytes: the words eight lanes read fall in distinct banks
    constexpr int WORDS = DA_CHUNK * D / 8 / DA_THREADS;  // 16-byte words of keys (and of values) a thread copies
    __shared__ __align__(16) T ks[DA_CHUNK * S];
    __shared__ __align__(16) T vs[DA_CHUNK * S];
    __shared__ float qs[DA_MAX_GROUP][D];
    __shared__ float ps[DA_MAX_GROUP][DA_CHUNK];
    // The chunk's slots before the step's position were written by earlier steps, and the position
    // and block tables before the step's first kernel, so they are loaded before the wait for the
    // kernel ahead (q/k/v, which writes the position's slot): the cache's round trip to memory
    // overlaps that kernel instead of following it.
    const unsigned int chunk = blockIdx.x, chunks = gridDim.x, seq = blockIdx.y / hkv, kvh = blockIdx.y % hkv;
    const unsigned int group = hq / hkv, start = chunk * chunk_len, p = pos[seq * pos_stride];
    if (start > p) return;
    const unsigned int n = min(chunk_len, p + 1 - start), last = p - start;
    const unsigned int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint4 kw[WORDS], vw[WORDS];
    auto load_row = [&](int u, unsigned int row, unsigned int col) {
        // A chunk may span blocks of a paged pool: each row from its own.
        const unsigned long long at =
            (table ? cache_row(table, stride, cap, seq, hkv, kvh, start + row)
                   : ((unsigned long long)seq * hkv + kvh) * cap + start + row) * D + col;
        kw[u] = __ldg((const uint4*)(keys + at));
        vw[u] = __ldg((const uint4*)(values + at));
    };
#pragma unroll
    for (int u = 0; u < WORDS; ++u) {
        const unsigned int w = tid + u * DA_THREADS, row = w / (D / 8), col = (w % (D / 8)) * 8;
        if (row < n && row != last) load_row(u, row, col);
    }
    wait_for_inputs();
#pragma unroll
    for (int u = 0; u < WORDS; ++u) {
        const unsigned int w = tid + u * DA_THREADS, row = w / (D / 8), col = (w % (D / 8)) * 8;
        if (row < n && row == last) load_row(u, row, col);
    }
    // The group's queries in words too, loaded with the chunk: one at a time, element by element,
    // they were a chain of round trips to L2 before any score.
    constexpr int QWORDS = (DA_MAX_GROUP * D / 8 + DA_THREADS - 1) / DA_THREADS;
    const T* qh = q + ((unsigned long long)seq * hq + kvh * group) * D;
    uint4 qw[QWORDS];
#pragma unroll
    for (int u = 0; u < QWORDS; ++u) {
        const unsigned int w = tid + u * DA_THREADS;
        if (w < group * D / 8) qw[u] = __ldg((const uint4*)qh + w);
    }
#pragma unroll
    for (int u = 0; u < WORDS; ++u) {
        const unsigned int w = tid + u * DA_THREADS, row = w / (D / 8), col = (w % (D / 8)) * 8;
        if (row < n) {
            *(uint4*)(ks + row * S + col) = kw[u];
            *(uint4*)(vs + row * S + col) = vw[u];
        }
    }
#pragma unroll
    for (int u = 0; u < QWORDS; ++u) {
        const unsigned int w = tid + u * DA_THREADS;
        if (w < group * D / 8) {
            float f[8];
            unpack8<E>(qw[u], f);
#pragma unroll
            for (int e = 0; e < 8; ++e) qs[w * 8 / D][w * 8 % D + e] = f[e] * scale;
        }
    }
    __syncthreads();
    // Scores: one (key, head) per thread.
    for (unsigned int e = tid; e < group * n; e += DA_THREADS) {
        const unsigned int g = e / n, j = e - g * n;
        // Four sums, not one chain of D dependent multiply-adds.
        float dot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < D; c += 8) {
            float kf[8];
            unpack8<E>(*(const uint4*)(ks + j * S + c), kf);
#pragma unroll
            for (int t = 0; t < 8; ++t) dot[t & 3] = fmaf(kf[t], qs[g][c + t], dot[t & 3]);
        }
        ps[g][j] = (dot[0] + dot[1]) + (dot[2] + dot[3]);
    }
    __syncthreads();
    // Each head's max and sum over the chunk, one warp per head.
    for (unsigned int g = warp; g < group; g += DA_THREADS / 32) {
        float m = __int_as_float(0xff800000);  // -inf
        for (unsigned int j = lane; j < n; j += 32) m = fmaxf(m, ps[g][j]);
        m = warp_max(m);
        float l = 0.f;
        for (unsigned int j = lane; j < n; j += 32) {
            float e = exp2f(ps[g][j] - m);
            ps[g][j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            unsigned long long at = (((unsigned long long)seq * hq + kvh * group + g) * chunks + chunk) * 2;
            part_ml[at] = m;
            part_ml[at + 1] = l;
        }
    }
    __syncthreads();
    // The chunk's weighted sum of values: a thread takes a word (8 features) of one head's output
    // over the slots j ≡ jp (mod P), one 16-byte load a slot, and the P threads of a word, adjacent
    // lanes, add their sums by shuffles. P spreads a small group's words over the block.
    const unsigned int words = group * (D / 8);
    const unsigned int P = words * 4 <= DA_THREADS ? 4 : words * 2 <= DA_THREADS ? 2 : 1;
    for (unsigned int base = 0; base < words * P; base += DA_THREADS) {
        const unsigned int t = base + tid, e = t / P, jp = t % P;
        const bool active = e < words;
        const unsigned int g = active ? e / (D / 8) : 0, c = (e % (D / 8)) * 8;
        float acc[8];
#pragma unroll
        for (int f = 0; f < 8; ++f) acc[f] = 0.f;
        if (active)
            for (unsigned int j = jp; j < n; j += P) {
                float vf[8];
                unpack8<E>(*(const uint4*)(vs + j * S + c), vf);
                const float pj = ps[g][j];
#pragma unroll
                for (int f = 0; f < 8; ++f) acc[f] = fmaf(pj, vf[f], acc[f]);
            }
        // The loop's trip count is the block's, so every lane of a warp reaches the shuffles.
        for (unsigned int o = 1; o < P; o <<= 1)
#pragma unroll
            for (int f = 0; f < 8; ++f) acc[f] += __shfl_xor_sync(0xffffffffu, acc[f], o);
        if (active && jp == 0) {
            const unsigned long long at = (((unsigned long long)seq * hq + kvh * group + g) * chunks + chunk) * D + c;
            float4* out = (float4*)(part_out + at);
            out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
    }
}

// The chunks' partial softmaxes combined: one block of DC_THREADS per (sequence, query head), out
// [B, hq, D] (as [B, 1, hq · D]). Each feature's chunks are split over DC_THREADS / D threads, and a
// thread issues the loads of DC_BATCH of its chunks (outputs and maxima) at once, before the block
// has reduced the maxima and sums it scales them by: a cache of 640 slots in chunks of 16 is then one
// round trip to L2 where one thread a feature, reading its chunks a few at a time, made five.
#define DC_BATCH 16
template <typename E, int D>
__device__ void decode_attention_combine(const float* part_out, const float* part_ml, const unsigned int* pos,
                                         typename E::T* out, unsigned int chunks, unsigned int chunk_len,
                                         unsigned int hq, unsigned int pos_stride) {
    constexpr unsigned int SPLIT = DC_THREADS / D;
    __shared__ float maxima[DC_THREADS / 32];
    __shared__ float sums[SPLIT][D];
    const unsigned int sh = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5, f = t % D, s = t / D;
    const float neg_inf = __int_as_float(0xff800000);
    wait_for_inputs();
    const unsigned int used = min(pos[sh / hq * pos_stride] / chunk_len + 1, chunks);
    const float* ml = part_ml + (unsigned long long)sh * chunks * 2;
    const float* po = part_out + (unsigned long long)sh * chunks * D + f;
    // This thread's chunks s, s + SPLIT, ...: the first DC_BATCH of them loaded now.
    float v[DC_BATCH], cm[DC_BATCH];
    auto load_batch = [&](unsigned int c0) {
#pragma unroll
        for (int u = 0; u < DC_BATCH; ++u) {
            const unsigned int c = c0 + u * SPLIT;
            v[u] = c < used ? po[(unsigned long long)c * D] : 0.f;
            cm[u] = c < used ? ml[2 * c] : neg_inf;
        }
    };
    load_batch(s);
    float m = neg_inf;
    for (unsigned int c = t; c < used; c += DC_THREADS) m = fmaxf(m, ml[2 * c]);
    m = warp_max(m);
    if (lane == 0) maxima[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < DC_THREADS / 32; ++w) m = fmaxf(m, maxima[w]);
    float l = 0.f;
    for (unsigned int c = t; c < used; c += DC_THREADS) l = fmaf(ml[2 * c + 1], exp2f(ml[2 * c] - m), l);
    l = block_sum2(l, 0.f).x;
    // Chunks past `used` weigh exp2(-inf) = 0.
    float acc = 0.f;
    for (unsigned int c0 = s;;) {
#pragma unroll
        for (int u = 0; u < DC_BATCH; ++u) acc = fmaf(v[u], exp2f(cm[u] - m), acc);
        c0 += DC_BATCH * SPLIT;
        if (c0 >= used) break;
        load_batch(c0);
    }
    sums[s][f] = acc;
    __syncthreads();
    if (s == 0) {
#pragma unroll
        for (unsigned int r = 1; r < SPLIT; ++r) acc += sums[r][f];
        E::put(out, (unsigned long long)sh * D + f, acc / l);
    }
}

// Each product in two forms: on x as given, and (`_norm`) on x through the RMSNorm before it.
#define PRODUCT_FORMS(S, E, B, N, NORM)                                                                             \
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) decode_gemv##N##_##S##_b##B(const E::T* w,           \
        const E::T* x, const E::T* norm_w, float eps, const E::T* res, E::T* y, unsigned int n, unsigned int k,      \
        unsigned int split) {                                                                                       \
    gemv<E, B, NORM>(w, x, norm_w, eps, res, y, n, k, split);                                                       \
}                                                                                                                   \
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) decode_swiglu##N##_##S##_b##B(const E::T* gate,      \
        const E::T* up, const E::T* x, const E::T* norm_w, float eps, E::T* y, unsigned int n, unsigned int k) {    \
    swiglu<E, B, NORM>(gate, up, x, norm_w, eps, y, n, k);                                                          \
}                                                                                                                   \
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) decode_qkv##N##_##S##_b##B(const E::T* wq,           \
        const E::T* wk, const E::T* wv, const E::T* bq, const E::T* bk, const E::T* bv, const E::T* cos,           \
        const E::T* sin, const unsigned int* pos, const E::T* x, const E::T* norm_w, float eps, E::T* q,           \
        E::T* keys, E::T* values, unsigned int hq, unsigned int hkv, unsigned int d, unsigned int k,                \
        unsigned int cap, const unsigned int* table, unsigned int stride, unsigned int pos_stride) {                \
    qkv_rope<E, B, NORM>(wq, wk, wv, bq, bk, bv, cos, sin, pos, x, norm_w, eps, q, keys, values, hq, hkv, d, k, cap, \
                         table, stride, pos_stride);                                                                \
}
#define PRODUCTS(S, E, B) PRODUCT_FORMS(S, E, B, , false) PRODUCT_FORMS(S, E, B, _norm, true)
#define BATCHES(S, E) PRODUCTS(S, E, 1) PRODUCTS(S, E, 2) PRODUCTS(S, E, 3) PRODUCTS(S, E, 4) PRODUCTS(S, E, 5)    \
    PRODUCTS(S, E, 6) PRODUCTS(S, E, 7) PRODUCTS(S, E, 8)
BATCHES(bf16, BF16)
BATCHES(f16, F16)

#define ATTENTION(S, E, D)                                                                                          \
extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attention_##S##_d##D(const E::T* q,               \
        const E::T* keys, const E::T* values, const unsigned int* pos, float* part_out, float* part_ml,              \
        unsigned int hq, unsigned int hkv, unsigned int cap, unsigned int chunk_len, float scale,                    \
        const unsigned int* table, unsigned int stride, unsigned int pos_stride) {                                  \
    decode_attention<E, D>(q, keys, values, pos, part_out, part_ml, hq, hkv, cap, chunk_len, scale, table, stride,  \
                           pos_stride);                                                                             \
}                                                                                                                   \
extern "C" __global__ void __launch_bounds__(DC_THREADS) decode_attention_combine_##S##_d##D(                    \
        const float* part_out, const float* part_ml, const unsigned int* pos, E::T* out, unsigned int chunks,       \
        unsigned int chunk_len, unsigned int hq, unsigned int pos_stride) {                                         \
    decode_attention_combine<E, D>(part_out, part_ml, pos, out, chunks, chunk_len, hq, pos_stride);                 \
}
ATTENTION(bf16, BF16, 64)
ATTENTION(bf16, BF16, 128)
ATTENTION(f16, F16, 64)
ATTENTION(f16, F16, 128)

// Greedy decoding's choice: the index of each row's largest element, the first of equal ones (as
// PyTorch's argmax). Candle's argmax scans a row in one block, a tenth of a small model's decode step
// (measured: docs/kernels.md#decode). Here a row is split over many blocks whose bests one warp a row
// then combines. x [rows, n]; best [rows, parts] (value, index); out [rows] u32.
__device__ __forceinline__ bool am_better(float v, unsigned int i, float bv, unsigned int bi) {
    return v > bv || (v == bv && i < bi);
}
__device__ __forceinline__ void am_warp(float& v, unsigned int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        unsigned int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (am_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
template <typename E>
__device__ void argmax_parts(const typename E::T* x, float2* best, unsigned int n) {
    __shared__ float sv[AM_THREADS / 32];
    __shared__ unsigned int si[AM_THREADS / 32];
    wait_for_inputs();
    const unsigned int part = blockIdx.x, parts = gridDim.x, row = blockIdx.y;
    const unsigned int span = (n + parts - 1) / parts, start = part * span, end = min(n, start + span);
    float v = __int_as_float(0xff800000);
    unsigned int i = start < n ? start : n - 1;
    const typename E::T* r = x + (unsigned long long)row * n;
    for (unsigned int j = start + threadIdx.x; j < end; j += AM_THREADS) {
        float e = E::get(r, j);
        if (am_better(e, j, v, i)) { v = e; i = j; }
    }
    am_warp(v, i);
    const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < AM_THREADS / 32 ? sv[lane] : __int_as_float(0xff800000);
        i = lane < AM_THREADS / 32 ? si[lane] : 0xffffffffu;
        am_warp(v, i);
        if (lane == 0) best[(unsigned long long)row * parts + part] = make_float2(v, __uint_as_float(i));
    }
}
// One warp a row over its parts' bests.
__device__ void argmax_combine(const float2* best, unsigned int* out, unsigned int parts) {
    wait_for_inputs();
    const unsigned int row = blockIdx.x, lane = threadIdx.x;
    float v = __int_as_float(0xff800000);
    unsigned int i = 0xffffffffu;
    for (unsigned int p = lane; p < parts; p += 32) {
        float2 b = best[(unsigned long long)row * parts + p];
        if (am_better(b.x, __float_as_uint(b.y), v, i)) { v = b.x; i = __float_as_uint(b.y); }
    }
    am_warp(v, i);
    if (lane == 0) out[row] = i;
}
#define ARGMAX(S, E)                                                                                   \
extern "C" __global__ void __launch_bounds__(AM_THREADS) argmax_parts_##S(const E::T* x, float2* best, \
        unsigned int n) {                                                                              \
    argmax_parts<E>(x, best, n);                                                                       \
}
ARGMAX(f32, F32)
ARGMAX(bf16, BF16)
ARGMAX(f16, F16)
extern "C" __global__ void argmax_rows(const float2* best, unsigned int* out, unsigned int parts) {
    argmax_combine(best, out, parts);
}
