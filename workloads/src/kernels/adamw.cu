// AdamW in two in-place passes over a parameter: moments from the gradient, then the parameter from
// the moments. Moments stay f32 whatever the parameter's dtype, as PyTorch keeps them under autocast.
// One grid-stride loop per pass: the update is memory-bound, so the only aim is full bandwidth.
//
// The step count and its bias corrections live in device memory ([t, 1 - b1^t, 1 - b2^t], f64), moved
// on by `adamw_advance` once per step, so that a CUDA graph of a training step replays every step
// right (a count passed by value would be frozen at the captured step's).

// mv: [m; v] f32, 2n. pass 0: moments from g. pass 1: theta from the moments and the corrections in
// state (not read in pass 0).
template <typename E>
__device__ void adamw(typename E::T* theta, const typename E::T* g, float* mv, unsigned int n, float lr,
                      float b1, float b2, float eps, float wd, const double* state, int pass) {
    float c1 = 1.f, c2 = 1.f;
    if (pass == 1) {
        c1 = (float)state[1];
        c2 = (float)state[2];
    }
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
                                         float b1, float b2, float eps, float wd, const double* state,    \
                                         int pass) {                                                      \
        adamw<E>(theta, g, mv, n, lr, b1, b2, eps, wd, state, pass);                                      \
    }
KERNEL(f32, F32)
KERNEL(bf16, BF16)
KERNEL(f16, F16)

// One thread: t += 1 and the corrections for the new t, in f64 as PyTorch computes them on the host.
extern "C" __global__ void adamw_advance(double* state, double b1, double b2) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        double t = state[0] + 1.0;
        state[0] = t;
        state[1] = 1.0 - pow(b1, t);
        state[2] = 1.0 - pow(b2, t);
    }
}
