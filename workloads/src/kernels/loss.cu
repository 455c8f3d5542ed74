// Softmax cross-entropy of logits [n, k] against class indices, averaged over the n rows: the loss and
// its gradient, in f32 whatever the logits' dtype (a log-softmax over 1000 classes in bf16 would lose
// the loss's low bits). A label outside [0, k) makes the loss and its row's gradient NaN rather than
// read past the row.

// The row's largest logit and the sum of exp(logit - largest), by one warp; every lane gets both.
template <typename E>
__device__ __forceinline__ float2 row_terms(const typename E::T* row, unsigned int k) {
    unsigned int lane = threadIdx.x & 31;
    float m = __int_as_float(0xff800000);
    for (unsigned int j = lane; j < k; j += 32) m = fmaxf(m, E::get(row, j));
    m = warp_max(m);
    float s = 0.f;
    for (unsigned int j = lane; j < k; j += 32) s += expf(E::get(row, j) - m);
    return make_float2(m, warp_sum(s));
}

// One block: warp w takes rows w, w + warps, ... and adds their losses in that order, then thread 0
// adds the warps' sums in order, so that the loss is the same bits at every run (no atomics).
template <typename E>
__device__ void cross_entropy(const typename E::T* x, const unsigned int* labels, float* loss, unsigned int n, unsigned int k) {
    __shared__ float partial[32];
    unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float acc = 0.f;
    for (unsigned int r = warp; r < n; r += warps) {
        const typename E::T* row = x + (unsigned long long)r * k;
        float2 t = row_terms<E>(row, k);
        unsigned int c = labels[r];
        float picked = c < k ? E::get(row, c) : __int_as_float(0x7fc00000);
        acc += t.x + logf(t.y) - picked;
    }
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (unsigned int w = 0; w < warps; w++) s += partial[w];
        loss[0] = s / (float)n;
    }
}

// dx = (softmax(x) - onehot(label)) * dloss / n, one row per warp. dloss is read from device memory
// (not passed by value), so that a CUDA graph of a training step replays with the current one.
template <typename E>
__device__ void cross_entropy_grad(const typename E::T* x, const unsigned int* labels, const float* dloss, typename E::T* dx,
                                   unsigned int n, unsigned int k) {
    unsigned int lane = threadIdx.x & 31;
    unsigned int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= n) return;
    const typename E::T* row = x + (unsigned long long)r * k;
    typename E::T* out = dx + (unsigned long long)r * k;
    float2 t = row_terms<E>(row, k);
    float scale = dloss[0] / (float)n, inv = 1.f / t.y;
    unsigned int c = labels[r];
    if (c >= k) scale = __int_as_float(0x7fc00000);
    for (unsigned int j = lane; j < k; j += 32) {
        float p = expf(E::get(row, j) - t.x) * inv;
        E::put(out, j, (p - (j == c ? 1.f : 0.f)) * scale);
    }
}

#define KERNEL(S, E)                                                                                        \
    extern "C" __global__ void cross_entropy_##S(const E::T* x, const unsigned int* labels, float* loss,     \
                                                 unsigned int n, unsigned int k) {                          \
        cross_entropy<E>(x, labels, loss, n, k);                                                            \
    }                                                                                                       \
    extern "C" __global__ void cross_entropy_grad_##S(const E::T* x, const unsigned int* labels,            \
                                                      const float* dloss, E::T* dx, unsigned int n,         \
                                                      unsigned int k) {                                     \
        cross_entropy_grad<E>(x, labels, dloss, dx, n, k);                                                  \
    }
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
