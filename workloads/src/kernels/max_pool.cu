// Max pooling over NCHW planes (ResNet's 3x3 stride-2 stem pool): the forward, and a backward that
// sends each window's gradient to the first maximum in it.

// The flat index (y * w + x) of the first maximum of window (oy, ox), or -1 when all is padding; the
// plane's cells are `es` elements apart (1 in NCHW, the channel count in NHWC).
template <typename E>
__device__ __forceinline__ int window_max(const typename E::T* plane, int h, int w, int oy, int ox, int k, int s, int p, int es = 1) {
    int best = -1;
    float m = 0.f;
    for (int dy = 0; dy < k; dy++) {
        int y = oy * s - p + dy;
        if (y < 0 || y >= h) continue;
        for (int dx = 0; dx < k; dx++) {
            int x = ox * s - p + dx;
            if (x < 0 || x >= w) continue;
            float v = E::get(plane, (unsigned long long)(y * w + x) * es);
            if (best < 0 || v > m) { m = v; best = y * w + x; }
        }
    }
    return best;
}

// Forward (g == 0): out [planes, oh, ow] = window maxima of x. Backward: out [planes, h, w] = dx.
// cl > 0: over NHWC with cl channels (planes = images * cl): out [images, oh, ow, cl] forward,
// [images, h, w, cl] backward.
template <typename E>
__device__ void max_pool(const typename E::T* x, const typename E::T* g, typename E::T* out, unsigned int planes,
                         int h, int w, int oh, int ow, int k, int s, int p, int cl) {
    unsigned long long total = (unsigned long long)planes * (g ? h * w : oh * ow);
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        if (cl && g) {
            unsigned long long pixel = i / cl, image = pixel / (h * w);
            int here = pixel % (h * w), y = here / w, xx = here % w;
            unsigned long long ch = i % cl;
            const typename E::T* xp = x + image * h * w * cl + ch;
            const typename E::T* gp = g + image * oh * ow * cl + ch;
            int oy0 = max(0, (y + p - k + s) / s), oy1 = min(oh - 1, (y + p) / s);
            int ox0 = max(0, (xx + p - k + s) / s), ox1 = min(ow - 1, (xx + p) / s);
            float acc = 0.f;
            for (int oy = oy0; oy <= oy1; oy++)
                for (int ox = ox0; ox <= ox1; ox++)
                    if (window_max<E>(xp, h, w, oy, ox, k, s, p, cl) == here) acc += E::get(gp, (unsigned long long)(oy * ow + ox) * cl);
            E::put(out, i, acc);
            continue;
        }
        if (cl) {
            // Neighbouring threads take neighbouring channels: coalesced reads and writes.
            unsigned long long pixel = i / cl, image = pixel / (oh * ow);
            int o = pixel % (oh * ow), oy = o / ow, ox = o % ow;
            const typename E::T* xp = x + image * h * w * cl + i % cl;
            int at = window_max<E>(xp, h, w, oy, ox, k, s, p, cl);
            E::put(out, i, at < 0 ? __int_as_float(0xff800000) : E::get(xp, (unsigned long long)at * cl));
            continue;
        }
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
        int h, int w, int oh, int ow, int k, int s, int p, int cl) {                                    \
    max_pool<E>(x, g, out, planes, h, w, oh, ow, k, s, p, cl);                                          \
}
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
