// AdamW in two in-place passes over a parameter: moments from the gradient, then the parameter from
// the moments. Moments stay f32 whatever the parameter's dtype, as PyTorch keeps them under autocast.
// One grid-stride loop per pass: the update is memory-bound, so the only aim is full bandwidth.

// mv: [m; v] f32, 2n. pass 0: moments from g. pass 1: theta from the moments; c1, c2 the bias
// corrections.
template <typename E>
__device__ void adamw(typename E::T* theta, const typename E::T* g, float* mv, unsigned int n, float lr,
                      float b1, float b2, float eps, float wd, float c1, float c2, int pass) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        if (pass == 0) {
            float gi = E::get(g, i);
            mv[i] = b1 * mv[i] + (1.f - b1) * gi;
            mv[n + i] = b2 * mv[n + i] + (1.f - b2) * gi * gi;
        } else {
            float p = E::get(theta, i) * (1.f - lr * wd);
            E::put(theta, i, p - lr * (mv[i] / c1) / (sqrtf(mv[n + i] / c2) + eps));
        }
    }
}
#define KERNEL(S, E)                                                                                      \
    extern "C" __global__ void adamw_##S(E::T* theta, const E::T* g, float* mv, unsigned int n, float lr,  \
                                         float b1, float b2, float eps, float wd, float c1, float c2,     \
                                         int pass) {                                                      \
        adamw<E>(theta, g, mv, n, lr, b1, b2, eps, wd, c1, c2, pass);                                     \
    }
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)
