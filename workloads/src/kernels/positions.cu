// Activations laid out [n, p, c] (n images or sequences, p positions, c channels): the mean over the
// positions (global average pooling), the first position (a class token), each with its gradient,
// and [n, c, p] moved to [n, p, c] (images or filters to channels last, and back). Dims go by
// value: candle's reductions and strided copies upload theirs, which a CUDA graph then needs kept on
// the device (see graphs.rs).

// Forward, y [n, c]: the mean over positions (first == 0) or position 0. Neighbouring threads take
// neighbouring channels: coalesced reads of each position's row.
template <typename E>
__device__ void positions_reduce(const typename E::T* x, typename E::T* y, unsigned int n, unsigned int p, unsigned int c, int first) {
    unsigned long long total = (unsigned long long)n * c;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        const typename E::T* at = x + (i / c) * p * c + i % c;
        if (first) {
            E::put(y, i, E::get(at, 0));
            continue;
        }
        float s = 0.f;
        for (unsigned int q = 0; q < p; q++) s += E::get(at, (unsigned long long)q * c);
        E::put(y, i, s / (float)p);
    }
}

// Backward, dx [n, p, c] from dy [n, c]: dy / p at every position (mean), or dy at position 0 and
// zero elsewhere (first).
template <typename E>
__device__ void positions_spread(const typename E::T* dy, typename E::T* dx, unsigned int n, unsigned int p, unsigned int c, int first) {
    unsigned long long total = (unsigned long long)n * p * c;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long image = i / ((unsigned long long)p * c);
        unsigned int q = (i / c) % p;
        float g = E::get(dy, image * c + i % c);
        E::put(dx, i, first ? (q == 0 ? g : 0.f) : g / (float)p);
    }
}

// y [n, p, c] = x [n, c, p] transposed per image: each thread writes one element (coalesced writes;
// the reads stride by p, from rows that stay in L2 between neighbouring channels). With c and p
// swapped it undoes itself.
template <typename W>
__device__ void transposed(const W* x, W* y, unsigned int n, unsigned int c, unsigned int p) {
    unsigned long long total = (unsigned long long)n * p * c;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long image = i / ((unsigned long long)p * c);
        unsigned int q = (i / c) % p, ch = i % c;
        y[i] = x[(image * c + ch) * p + q];
    }
}

#define KERNEL(S, E)                                                                                        \
    extern "C" __global__ void positions_reduce_##S(const E::T* x, E::T* y, unsigned int n, unsigned int p,  \
                                                    unsigned int c, int first) {                            \
        positions_reduce<E>(x, y, n, p, c, first);                                                          \
    }                                                                                                       \
    extern "C" __global__ void positions_spread_##S(const E::T* dy, E::T* dx, unsigned int n, unsigned int p, \
                                                    unsigned int c, int first) {                            \
        positions_spread<E>(dy, dx, n, p, c, first);                                                        \
    }                                                                                                       \
    extern "C" __global__ void transposed_##S(const E::T* x, E::T* y, unsigned int n, unsigned int c,      \
                                              unsigned int p) {                                             \
        transposed<E::T>(x, y, n, c, p);                                                                    \
    }
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
