// Row look-up of an embedding table by u32 ids, and its backward as f32 atomic adds into a
// per-table accumulator (rows repeat across a batch, so the scatter must add).

// Forward (acc null): out[i, c] = table[ids[i], c]. Backward: acc[ids[i], c] += g[i, c] (f32).
template <typename E>
__device__ void embedding(const typename E::T* table, const unsigned int* ids, const typename E::T* g, float* acc,
                          typename E::T* out, unsigned int n, unsigned int d) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n * d; i += blockDim.x * gridDim.x) {
        unsigned int row = i / d, c = i - row * d;
        unsigned long long at = (unsigned long long)ids[row] * d + c;
        if (acc) atomicAdd(acc + at, E::get(g, i));
        else E::put(out, i, E::get(table, at));
    }
}
#define KERNEL(S, E)                                                                                  \
extern "C" __global__ void embedding_##S(const E::T* table, const unsigned int* ids, const E::T* g,   \
        float* acc, E::T* out, unsigned int n, unsigned int d) {                                      \
    embedding<E>(table, ids, g, acc, out, n, d);                                                      \
}
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
