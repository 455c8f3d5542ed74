// A language model's pass over many tokens at once (a prompt's prefill, a decode step of more
// sequences than the decode products take), between its matrix products: the rotary embedding of the
// q and k heads where one product made q, k and v side by side, and SwiGLU where one product made
// gate and up side by side. Each is one pass over its rows; candle's ops would need copies of the
// heads out of the packed rows, and SiLU and the product as two passes.

// y = x with the first `rotated` heads of every row turned by the rotary embedding. x and y are
// [rows, heads · 2·half]: a token's q heads, then its k heads, then its v heads (the last heads −
// rotated, copied). Row r is the token at position offset + r % tokens; cos and sin are [positions,
// half]. Dimension j of a head pairs with j + half, as transformers' rotate_half pairs them. The
// rotation is computed in f32 and rounded once.
template <typename E>
__device__ void rope_packed(const typename E::T* x, const typename E::T* cos, const typename E::T* sin,
                            typename E::T* y, unsigned int total, unsigned int tokens, unsigned int offset,
                            unsigned int heads, unsigned int rotated, unsigned int half) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const unsigned int j = i % half, head = (i / half) % heads, row = i / (half * heads);
        const unsigned long long at = ((unsigned long long)row * heads + head) * 2 * half + j;
        const float a = E::get(x, at), b = E::get(x, at + half);
        if (head < rotated) {
            const unsigned long long t = (unsigned long long)(offset + row % tokens) * half + j;
            const float c = E::get(cos, t), s = E::get(sin, t);
            E::put(y, at, a * c - b * s);
            E::put(y, at + half, b * c + a * s);
        } else {
            E::put(y, at, a);
            E::put(y, at + half, b);
        }
    }
}

// y [rows, n] = SiLU(gate) · up from gate_up [rows, 2n] (each row's gate, then its up), rounded as
// PyTorch rounds SiLU's output and then the product.
template <typename E>
__device__ void swiglu_rows(const typename E::T* gate_up, typename E::T* y, unsigned int total, unsigned int n) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const unsigned long long row = i / n, at = row * 2 * n + i % n;
        const float g = E::get(gate_up, at), u = E::get(gate_up, at + n);
        E::put(y, i, rounded<E>(g / (1.f + expf(-g))) * u);
    }
}

// dst row rows[r] = src row r, for r < n, rows of `width` elements: a pass's keys or values written
// into their slots of a paged pool (candle's scatter spreads its work over a row's elements only, so
// a prompt's thousands of rows were written by a few dozen threads).
template <typename E>
__device__ void write_rows(typename E::T* dst, const typename E::T* src, const unsigned int* rows, unsigned int total,
                           unsigned int width) {
    for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += blockDim.x * gridDim.x) {
        const unsigned int r = i / width;
        dst[(unsigned long long)rows[r] * width + i % width] = src[i];
    }
}

#define PREFILL(S, E)                                                                                               \
extern "C" __global__ void rope_packed_##S(const E::T* x, const E::T* cos, const E::T* sin, E::T* y,               \
        unsigned int total, unsigned int tokens, unsigned int offset, unsigned int heads, unsigned int rotated,     \
        unsigned int half) {                                                                                        \
    rope_packed<E>(x, cos, sin, y, total, tokens, offset, heads, rotated, half);                                    \
}                                                                                                                   \
extern "C" __global__ void swiglu_rows_##S(const E::T* gate_up, E::T* y, unsigned int total, unsigned int n) {      \
    swiglu_rows<E>(gate_up, y, total, n);                                                                           \
}                                                                                                                   \
extern "C" __global__ void write_rows_##S(E::T* dst, const E::T* src, const unsigned int* rows, unsigned int total, \
        unsigned int width) {                                                                                       \
    write_rows<E>(dst, src, rows, total, width);                                                                    \
}
PREFILL(f32, F32)
PREFILL(bf16, BF16)
PREFILL(f16, F16)
