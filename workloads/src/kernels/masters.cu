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
// The indices T_, C1, C2, SCALE, FOUND, GOOD, SKIPPED and ATTEMPTED are defined by the Rust side
// (kernels/masters.rs, `at`), which reads the state.

// AdamW on element i of an f32 state [m; v; master] of 3n, from the unscaled gradient gi: the
// state written, the new master returned.
__device__ __forceinline__ float adamw_at(float gi, float* buf, unsigned int n, unsigned int i, float lr, float b1,
                                          float b2, float eps, float wd, float c1, float c2) {
    float *m = buf, *v = buf + n, *master = buf + 2 * (unsigned long long)n;
    float mi = b1 * m[i] + (1.f - b1) * gi;
    float vi = b2 * v[i] + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    float p = master[i] * (1.f - lr * wd);
    p -= lr * (mi / c1) / (sqrtf(vi / c2) + eps);
    master[i] = p;
    return p;
}

// SGD with momentum on element i of an f32 state [b; master] of 2n: g' = g + wd master, b = momentum b
// + g', master -= lr b (b starts at zero, so the first step's b is g', as PyTorch's). The new master
// returned.
__device__ __forceinline__ float sgd_at(float gi, float* buf, unsigned int n, unsigned int i, float lr, float momentum,
                                        float wd) {
    float *b = buf, *master = buf + n;
    float p = master[i];
    gi += wd * p;
    float bi = momentum * b[i] + gi;
    b[i] = bi;
    p -= lr * bi;
    master[i] = p;
    return p;
}

// A group of up to GROUP parameters updated in one launch, given by value as the kernel's parameter
// (3 KB, within the 4 KB every GPU takes), so that a captured step replays it with the addresses it
// was captured with. Each parameter is cut into chunks of CHUNK elements, a block a chunk: first[i]
// is parameter i's first block, first[count] the grid's size. Why: a launch per parameter and pass
// (ResNet-50: 161 parameters, two passes) cost more than the updates' memory traffic
// (docs/kernels.md#masters). The working copy is written in the update's pass. GROUP and CHUNK are
// defined by the Rust side (kernels/masters.rs), which fills the groups.
struct Group {
    unsigned long long g[GROUP];      // the gradients (the working copies' type)
    unsigned long long state[GROUP];  // the f32 states [buffers; master]
    unsigned long long theta[GROUP];  // the working copies
    unsigned int n[GROUP];
    unsigned int first[GROUP + 1];
    unsigned int count;
};

// This block's parameter and its chunk [*start, *end).
__device__ __forceinline__ unsigned int group_member(const Group& grp, unsigned int* start, unsigned int* end) {
    unsigned int k = 0;
    while (k + 1 < grp.count && grp.first[k + 1] <= blockIdx.x) k++;
    *start = (blockIdx.x - grp.first[k]) * CHUNK;
    *end = min(grp.n[k], *start + CHUNK);
    return k;
}

template <typename E>
__device__ void nonfinite_group(const Group& grp, double* state) {
    unsigned int start, end, k = group_member(grp, &start, &end);
    const typename E::T* g = (const typename E::T*)grp.g[k];
    bool bad = false;
    for (unsigned int i = start + threadIdx.x; i < end; i += blockDim.x) bad |= !isfinite(E::get(g, i));
    if (__syncthreads_or(bad) && threadIdx.x == 0) state[FOUND] = 1.0;
}

template <typename E>
__device__ void adamw_group(const Group& grp, float lr, float b1, float b2, float eps, float wd, const double* state) {
    if (state[FOUND] != 0.0) return;
    unsigned int start, end, k = group_member(grp, &start, &end);
    const typename E::T* g = (const typename E::T*)grp.g[k];
    typename E::T* theta = (typename E::T*)grp.theta[k];
    float inv = (float)(1.0 / state[SCALE]), c1 = (float)state[C1], c2 = (float)state[C2];
    for (unsigned int i = start + threadIdx.x; i < end; i += blockDim.x)
        E::put(theta, i, adamw_at(E::get(g, i) * inv, (float*)grp.state[k], grp.n[k], i, lr, b1, b2, eps, wd, c1, c2));
}

template <typename E>
__device__ void sgd_group(const Group& grp, float lr, float momentum, float wd, const double* state) {
    if (state[FOUND] != 0.0) return;
    unsigned int start, end, k = group_member(grp, &start, &end);
    const typename E::T* g = (const typename E::T*)grp.g[k];
    typename E::T* theta = (typename E::T*)grp.theta[k];
    float inv = (float)(1.0 / state[SCALE]);
    for (unsigned int i = start + threadIdx.x; i < end; i += blockDim.x)
        E::put(theta, i, sgd_at(E::get(g, i) * inv, (float*)grp.state[k], grp.n[k], i, lr, momentum, wd));
}

#define KERNELS(S, E)                                                                                           \
    extern "C" __global__ void masters_nonfinite_group_##S(const Group grp, double* state) {                    \
        nonfinite_group<E>(grp, state);                                                                         \
    }                                                                                                           \
    extern "C" __global__ void masters_adamw_group_##S(const Group grp, float lr, float b1, float b2, float eps, \
                                                       float wd, const double* state) {                         \
        adamw_group<E>(grp, lr, b1, b2, eps, wd, state);                                                        \
    }                                                                                                           \
    extern "C" __global__ void masters_sgd_group_##S(const Group grp, float lr, float momentum, float wd,       \
                                                     const double* state) {                                     \
        sgd_group<E>(grp, lr, momentum, wd, state);                                                             \
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
