// Mixed-precision training as PyTorch's autocast and GradScaler do it: the optimizer updates f32 master
// weights and writes the bf16/f16 working copies the next step computes with; in f16 the loss is
// scaled and a step whose gradients hold an inf or a nan is skipped and the scale halved.
//
// Every decision is taken on the device, from a step state in device memory, so that a training step
// still replays as one CUDA graph (a host check of the gradients would synchronise every step):
//   state[0..3] = [t, 1 - b1^t, 1 - b2^t]  AdamW's step count and corrections (t counts taken steps)
//   state[3]    = the loss scale (1 without scaling)
//   state[4]    = 1 when this step's gradients hold an inf or a nan, else 0
//   state[5]    = good steps since the scale last changed
//   state[6]    = steps skipped so far
//   state[7]    = steps attempted so far
#define T_ 0
#define C1 1
#define C2 2
#define SCALE 3
#define FOUND 4
#define GOOD 5
#define SKIPPED 6
#define ATTEMPTED 7

// state[FOUND] = 1 when any of g's n elements is not finite. Every writer writes the same value, so
// the unordered writes need no atomics.
template <typename E>
__device__ void nonfinite(const typename E::T* g, unsigned int n, double* state) {
    bool bad = false;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float v = E::get(g, i);
        bad |= !isfinite(v);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) state[FOUND] = 1.0;
}

// AdamW on an f32 state [m; v; master] of 3n, from the scaled gradient g: one pass reads g and the
// state and writes the state. A skipped step leaves everything as it was.
template <typename E>
__device__ void adamw_master(const typename E::T* g, float* buf, unsigned int n, float lr, float b1, float b2,
                             float eps, float wd, const double* state) {
    if (state[FOUND] != 0.0) return;
    float inv = (float)(1.0 / state[SCALE]);
    float c1 = (float)state[C1], c2 = (float)state[C2];
    float *m = buf, *v = buf + n, *master = buf + 2 * (unsigned long long)n;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float gi = E::get(g, i) * inv;
        float mi = b1 * m[i] + (1.f - b1) * gi;
        float vi = b2 * v[i] + (1.f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float p = master[i] * (1.f - lr * wd);
        master[i] = p - lr * (mi / c1) / (sqrtf(vi / c2) + eps);
    }
}

// SGD with momentum on an f32 state [b; master] of 2n: g' = g / scale + wd master, b = momentum b + g',
// master -= lr b (b starts at zero, so the first step's b is g', as PyTorch's).
template <typename E>
__device__ void sgd_master(const typename E::T* g, float* buf, unsigned int n, float lr, float momentum, float wd,
                           const double* state) {
    if (state[FOUND] != 0.0) return;
    float inv = (float)(1.0 / state[SCALE]);
    float *b = buf, *master = buf + n;
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float p = master[i];
        float gi = E::get(g, i) * inv + wd * p;
        float bi = momentum * b[i] + gi;
        b[i] = bi;
        master[i] = p - lr * bi;
    }
}

// The working copy the next step computes with: theta = master, rounded to theta's type.
template <typename E>
__device__ void working_copy(typename E::T* theta, const float* master, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        E::put(theta, i, master[i]);
}

#define KERNELS(S, E)                                                                                           \
    extern "C" __global__ void masters_nonfinite_##S(const E::T* g, unsigned int n, double* state) {            \
        nonfinite<E>(g, n, state);                                                                              \
    }                                                                                                           \
    extern "C" __global__ void masters_adamw_##S(const E::T* g, float* buf, unsigned int n, float lr, float b1, \
                                                 float b2, float eps, float wd, const double* state) {          \
        adamw_master<E>(g, buf, n, lr, b1, b2, eps, wd, state);                                                 \
    }                                                                                                           \
    extern "C" __global__ void masters_sgd_##S(const E::T* g, float* buf, unsigned int n, float lr,             \
                                               float momentum, float wd, const double* state) {                 \
        sgd_master<E>(g, buf, n, lr, momentum, wd, state);                                                      \
    }                                                                                                           \
    extern "C" __global__ void masters_copy_##S(E::T* theta, const float* master, unsigned int n) {             \
        working_copy<E>(theta, master, n);                                                                      \
    }
KERNELS(f32, F32)
KERNELS(bf16, BF16)
KERNELS(f16, F16)

// One thread, before the updates: AdamW's count and corrections move on unless the step is skipped.
extern "C" __global__ void masters_begin(double* state, double b1, double b2) {
    if (blockIdx.x == 0 && threadIdx.x == 0 && state[FOUND] == 0.0) {
        double t = state[T_] + 1.0;
        state[T_] = t;
        state[C1] = 1.0 - pow(b1, t);
        state[C2] = 1.0 - pow(b2, t);
    }
}

// One thread, after the updates: GradScaler's rule when `dynamic` (halve and skip on an inf or a nan,
// double after `interval` good steps in a row), then the flag cleared for the next step.
extern "C" __global__ void masters_end(double* state, int dynamic, double interval) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    state[ATTEMPTED] += 1.0;
    if (state[FOUND] != 0.0) {
        state[SKIPPED] += 1.0;
        if (dynamic) state[SCALE] *= 0.5;
        state[GOOD] = 0.0;
        state[FOUND] = 0.0;
    } else if (dynamic) {
        state[GOOD] += 1.0;
        if (state[GOOD] >= interval) {
            state[SCALE] *= 2.0;
            state[GOOD] = 0.0;
        }
    }
}
