// Max pooling (ResNet's 3x3 stride-2 stem pool) over NCHW planes and over NHWC: the forward, and a
// backward that sends each window's gradient to the first maximum in it.

// The first maximum of window (oy, ox) for each of a word's V channels, the map's pixels `words`
// words apart (over NHWC; 1 over an NCHW plane, V = 1): best[c] its pixel (y * w + x), or -1 when
// all is padding, m[c] its value.
template <typename E, int V>
__device__ __forceinline__ void window_max_word(const Pack<typename E::T, V>* xp, int h, int w, unsigned int words,
                                                int oy, int ox, int k, int s, int p, int* best, float* m) {
#pragma unroll
    for (int c = 0; c < V; c++) { best[c] = -1; m[c] = 0.f; }
    for (int dy = 0; dy < k; dy++) {
        int y = oy * s - p + dy;
        if (y < 0 || y >= h) continue;
        for (int dx = 0; dx < k; dx++) {
            int x = ox * s - p + dx;
            if (x < 0 || x >= w) continue;
            Pack<typename E::T, V> v = xp[(unsigned int)(y * w + x) * words];
#pragma unroll
            for (int c = 0; c < V; c++) {
                float e = E::get(v.v, c);
                if (best[c] < 0 || e > m[c]) { m[c] = e; best[c] = y * w + x; }
            }
        }
    }
}

// The first maximum's pixel of window (oy, ox) of an NCHW plane, or -1 when all is padding.
template <typename E>
__device__ __forceinline__ int window_max(const typename E::T* plane, int h, int w, int oy, int ox, int k, int s, int p) {
    int best;
    float m;
    window_max_word<E, 1>((const Pack<typename E::T, 1>*)plane, h, w, 1, oy, ox, k, s, p, &best, &m);
    return best;
}

// Over NCHW. Forward (g == 0): out [planes, oh, ow] = window maxima of x. Backward: out [planes, h, w]
// = dx.
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

// Over NHWC with cl channels, a thread taking V neighbouring channels of a pixel as one word
// (cl % V == 0; neighbouring threads read neighbouring words). Forward (g == 0): out [images, oh,
// ow, cl]; backward: out [images, h, w, cl] = dx. Why words, and 32-bit indices (the launch checks
// that they suffice): a thread per element with 64-bit divisions made the stem pool's two passes a
// tenth of ResNet-50's training step (docs/kernels.md#max-pool).
template <typename E, int V>
__device__ void max_pool_nhwc(const typename E::T* x, const typename E::T* g, typename E::T* out, unsigned int images,
                              int h, int w, int oh, int ow, int k, int s, int p, int cl) {
    typedef Pack<typename E::T, V> P;
    unsigned int words = cl / V, cells = g ? h * w : oh * ow;
    unsigned int total = images * cells * words;
    int best[V];
    float m[V];
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        unsigned int word = i % words, pixel = i / words, image = pixel / cells;
        int here = pixel % cells;
        const P* xp = (const P*)x + image * (unsigned int)(h * w) * words + word;
        P o;
        if (!g) {
            window_max_word<E, V>(xp, h, w, words, here / ow, here % ow, k, s, p, best, m);
#pragma unroll
            for (int c = 0; c < V; c++) E::put(o.v, c, best[c] < 0 ? __int_as_float(0xff800000) : m[c]);
        } else {
            const P* gp = (const P*)g + image * (unsigned int)(oh * ow) * words + word;
            int y = here / w, xx = here % w;
            int oy0 = max(0, (y + p - k + s) / s), oy1 = min(oh - 1, (y + p) / s);
            int ox0 = max(0, (xx + p - k + s) / s), ox1 = min(ow - 1, (xx + p) / s);
            float acc[V];
#pragma unroll
            for (int c = 0; c < V; c++) acc[c] = 0.f;
            for (int oy = oy0; oy <= oy1; oy++)
                for (int ox = ox0; ox <= ox1; ox++) {
                    window_max_word<E, V>(xp, h, w, words, oy, ox, k, s, p, best, m);
                    P gv = gp[(unsigned int)(oy * ow + ox) * words];
#pragma unroll
                    for (int c = 0; c < V; c++)
                        if (best[c] == here) acc[c] += E::get(gv.v, c);
                }
#pragma unroll
            for (int c = 0; c < V; c++) E::put(o.v, c, acc[c]);
        }
        ((P*)out)[i] = o;
    }
}

#define KERNEL(S, E)                                                                                    \
extern "C" __global__ void max_pool_##S(const E::T* x, const E::T* g, E::T* out, unsigned int planes,   \
        int h, int w, int oh, int ow, int k, int s, int p) {                                            \
    max_pool<E>(x, g, out, planes, h, w, oh, ow, k, s, p);                                              \
}
#define NHWC(S, E, V)                                                                                   \
extern "C" __global__ void max_pool_nhwc_##S##_v##V(const E::T* x, const E::T* g, E::T* out,            \
        unsigned int images, int h, int w, int oh, int ow, int k, int s, int p, int cl) {               \
    max_pool_nhwc<E, V>(x, g, out, images, h, w, oh, ow, k, s, p, cl);                                  \
}
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
NHWC(f32, F32, 1)
NHWC(f32, F32, 2)
NHWC(f32, F32, 4)
NHWC(bf16, BF16, 1)
NHWC(bf16, BF16, 2)
NHWC(bf16, BF16, 4)
NHWC(bf16, BF16, 8)
NHWC(f16, F16, 1)
NHWC(f16, F16, 2)
NHWC(f16, F16, 4)
NHWC(f16, F16, 8)
