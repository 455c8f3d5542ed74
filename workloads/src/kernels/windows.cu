// Swin's shifted windows: the cyclic roll and the window partition as one gather, and its inverse
// (merge) as the matching scatter. Rows move in the widest word their length allows.

// Row r of the windows [b * nw * nw, w * w] is row m of the map [b, side, side] rolled by -shift:
// window (bi, wy, wx), token (ty, tx) is map cell ((wy*w + ty + shift) % side, (wx*w + tx + shift) % side).
// merge == 0: dst[r] = src[m] (partition); merge == 1: dst[m] = src[r] (a permutation, so each
// destination row is written once).
template <typename W>
__device__ void windows(const W* src, W* dst, unsigned long long rows, unsigned int row_words, int side, int w, int shift, int merge) {
    int nw = side / w;
    unsigned long long total = rows * row_words;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long r = i / row_words;
        unsigned int word = i % row_words;
        unsigned long long bw = r / (w * w);
        int t = r % (w * w), ty = t / w, tx = t % w;
        int wx = bw % nw, wy = (bw / nw) % nw;
        unsigned long long bi = bw / (nw * nw);
        int y = (wy * w + ty + shift) % side, x = (wx * w + tx + shift) % side;
        unsigned long long m = (bi * side + y) * side + x;
        if (merge) dst[m * row_words + word] = src[r * row_words + word];
        else dst[r * row_words + word] = src[m * row_words + word];
    }
}

#define KERNEL(S, W)                                                                                   \
extern "C" __global__ void windows_w##S(const W* src, W* dst, unsigned long long rows,                 \
        unsigned int row_words, int side, int w, int shift, int merge) {                               \
    windows<W>(src, dst, rows, row_words, side, w, shift, merge);                                      \
}
KERNEL(16, uint4)
KERNEL(8, uint2)
KERNEL(4, unsigned int)
KERNEL(2, unsigned short)

// Swin's patch merging: row r of [b, h/2, w/2, 4] (the four tokens of a 2x2 neighbourhood side by
// side, in torchvision's order: k = 2·dx + dy) is row m of the map [b, h, w]. scatter == 0:
// dst[r] = src[m] (the gather); scatter == 1: dst[m] = src[r]. `shift` is unused (the signature is
// windows'). Needs even h and w.
template <typename W>
__device__ void neighbours(const W* src, W* dst, unsigned long long rows, unsigned int row_words, int h, int w, int scatter) {
    int hh = h / 2, ww = w / 2;
    unsigned long long total = rows * row_words;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        unsigned long long r = i / row_words;
        unsigned int word = i % row_words;
        int k = r % 4;
        unsigned long long cell = r / 4;
        int j = cell % ww;
        unsigned long long t = cell / ww;
        int y = 2 * (int)(t % hh) + (k & 1), x = 2 * j + (k >> 1);
        unsigned long long m = ((t / hh) * h + y) * w + x;
        if (scatter) dst[m * row_words + word] = src[r * row_words + word];
        else dst[r * row_words + word] = src[m * row_words + word];
    }
}

#define NEIGHBOURS(S, W)                                                                               \
extern "C" __global__ void neighbours_w##S(const W* src, W* dst, unsigned long long rows,              \
        unsigned int row_words, int h, int w, int shift, int scatter) {                                \
    neighbours<W>(src, dst, rows, row_words, h, w, scatter);                                           \
}
NEIGHBOURS(16, uint4)
NEIGHBOURS(8, uint2)
NEIGHBOURS(4, unsigned int)
NEIGHBOURS(2, unsigned short)
