//! Our CUDA kernels are C++ source compiled with NVRTC when first used (the CUDA build links NVRTC
//! already; no nvcc is needed at build time). PTX for compute capability 8.0, which the driver
//! compiles for the GPU at hand (bf16 conversions need sm_80).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc;
use candle_core::Result;

/// What every kernel source starts with: the three element types and block/warp reductions.
///
/// NVRTC is given no include paths, so CUDA's half-precision headers are not at hand: bf16 and f16
/// travel as 16-bit integers and are converted with PTX `cvt` (sm_80 and later). All arithmetic is
/// in f32, as PyTorch's kernels for these types do.
const PRELUDE: &str = r#"
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
"#;

/// The PTX of `source` (after the prelude), compiled once into `cell`; `what` names the kernels in
/// the error.
pub(crate) fn ptx(cell: &'static OnceLock<std::result::Result<String, String>>, source: &str, what: &str) -> Result<&'static str> {
    let compiled = cell.get_or_init(|| {
        let opts = cudarc::nvrtc::CompileOptions { arch: Some("compute_80"), ..Default::default() };
        cudarc::nvrtc::compile_ptx_with_opts(format!("{PRELUDE}{source}"), opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
    });
    compiled.as_deref().map_err(|e| candle_core::Error::Msg(format!("compiling the {what} kernels with NVRTC: {e}")))
}

/// `fn ptx() -> Result<&'static str>` for a module's kernel source: compiled with the prelude on
/// first use and kept.
macro_rules! compiled {
    ($source:expr, $what:literal) => {
        fn ptx() -> candle_core::Result<&'static str> {
            static PTX: std::sync::OnceLock<std::result::Result<String, String>> = std::sync::OnceLock::new();
            $crate::kernels::nvrtc::ptx(&PTX, $source, $what)
        }
    };
}
pub(crate) use compiled;

/// Threads per block for a kernel in which each thread keeps up to `per_thread` elements of a row of
/// `cols`: a multiple of 32, at most 1024; None when the row is too long for that.
pub(crate) fn row_threads(cols: usize, per_thread: usize) -> Option<u32> {
    let threads = cols.div_ceil(per_thread).next_multiple_of(32).max(32);
    (threads <= 1024).then_some(threads as u32)
}
