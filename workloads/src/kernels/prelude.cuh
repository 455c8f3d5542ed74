// What every kernel source starts with (NVRTC compiles it in front of each): the three element types
// and warp/block reductions. NVRTC is given no include paths, so CUDA's half-precision headers are not
// at hand: bf16 and f16 travel as 16-bit integers and are converted with PTX `cvt` (sm_80 and later).
// All arithmetic is in f32, as PyTorch's kernels for these types do.
struct F32 {
    typedef float T;
    static __device__ __forceinline__ float get(const float* p, unsigned long long i) { return p[i]; }
    static __device__ __forceinline__ void put(float* p, unsigned long long i, float v) { p[i] = v; }
};
struct BF16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(const T* p, unsigned long long i) { return __uint_as_float(((unsigned int)p[i]) << 16); }
    static __device__ __forceinline__ void put(T* p, unsigned long long i, float v) {
        unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
    }
};
struct F16 {
    typedef unsigned short T;
    static __device__ __forceinline__ float get(const T* p, unsigned long long i) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i])); return f;
    }
    static __device__ __forceinline__ void put(T* p, unsigned long long i, float v) {
        unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i] = h;
    }
};

// v rounded to the element type, as a float: where PyTorch rounds an intermediate, so do we.
template <typename E> __device__ __forceinline__ float rounded(float v) {
    typename E::T h;
    E::put(&h, 0, v);
    return E::get(&h, 0);
}

// V consecutive elements, loaded and stored as one word of up to 16 bytes.
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// The sums of a and of b over the block (blockDim.x a multiple of 32), returned to every thread.
// Every thread of the block must call it.
__device__ __forceinline__ float2 block_sum2(float a, float b) {
    __shared__ float2 partial[32];
    a = warp_sum(a);
    b = warp_sum(b);
    unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous call's readers are done with `partial`
    if (lane == 0) partial[warp] = make_float2(a, b);
    __syncthreads();
    float2 p = lane < (blockDim.x >> 5) ? partial[lane] : make_float2(0.f, 0.f);
    return make_float2(warp_sum(p.x), warp_sum(p.y));
}
