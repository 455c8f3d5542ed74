//! Swin's windows: the cyclic shift of the feature map and its partition into w×w windows as one
//! gather, and the inverse (windows back into the map, shifted back) as the matching scatter. Each is
//! the other's backward pass.
//!
//! Why: as candle ops a shifted block rolls the map twice (a narrow and a cat per axis), permutes it
//! into windows (a strided copy) and undoes all three after attention: six full copies per block
//! forward, and the same again through candle's backward, each adding into a zeroed gradient. Nsight
//! Compute on the H100 put those copies at 7.9 ms of Swin-T's f32 inference at batch 128.
//!
//! Tokens are rows of c channels; a row moves as whole 16-, 8-, 4- or 2-byte words, whichever divides
//! both the row and the tensors' start, so the kernel neither knows nor cares about the dtype.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, CpuStorage, CudaStorage, CustomOp1, Layout, Result, Shape, Tensor};

use super::launch::{by_dtype, failed, view, word_elements};

const SOURCE: &str = r#"
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
"#;

super::nvrtc::compiled!(SOURCE, "Swin windows");

/// Partition (`merge` false): x [b, side, side, c] rolled by -shift on both spatial axes, into
/// windows [b · (side/window)², window², c]. Merge: the inverse.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    pub side: usize,
    pub window: usize,
    pub shift: usize,
    pub merge: bool,
}

impl Windows {
    /// (images, channels) of the input, checked against the geometry.
    fn geometry(&self, l: &Layout) -> Result<(usize, usize)> {
        let (side, w) = (self.side, self.window);
        if w == 0 || !side.is_multiple_of(w) || self.shift >= side {
            bail!("Swin windows: a {side}x{side} map in {w}x{w} windows shifted by {}", self.shift)
        }
        let windows = (side / w).pow(2);
        let (b, c) = if self.merge {
            let (bw, t, c) = l.shape().dims3()?;
            if t != w * w || bw % windows != 0 {
                bail!("Swin windows: {:?} is not windows of {w}x{w} tokens from {side}x{side} maps", l.dims())
            }
            (bw / windows, c)
        } else {
            let (b, h, ww, c) = l.shape().dims4()?;
            if (h, ww) != (side, side) {
                bail!("Swin windows: a map of {h}x{ww} where {side}x{side} was expected")
            }
            (b, c)
        };
        Ok((b, c))
    }

    fn out_shape(&self, b: usize, c: usize) -> Shape {
        let (side, w) = (self.side, self.window);
        if self.merge {
            Shape::from((b, side, side, c))
        } else {
            Shape::from((b * (side / w).pow(2), w * w, c))
        }
    }
}

impl CustomOp1 for Windows {
    fn name(&self) -> &'static str {
        "swin-windows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("the Swin windows kernel runs on CUDA devices only; the CPU rolls and permutes with candle's ops")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (b, c) = self.geometry(l)?;
        let rows = b * self.side * self.side;
        let Some((start, _)) = l.contiguous_offsets() else { bail!("the Swin windows kernel takes contiguous tensors") };
        let size = s.dtype().size_in_bytes();
        // The widest word dividing a row and the start (allocations themselves are 256-byte aligned).
        let word = word_elements(size, &[c, start]) * size;
        if word == 1 {
            bail!("the Swin windows kernel moves rows of whole 2-byte words, not {c} x {size} bytes")
        }
        let row_words = (c * size / word) as u32;
        let dev = s.device().clone();
        let kernel = format!("windows_w{word}");
        let func = dev.get_or_load_custom_func(&kernel, "migprof_windows", ptx()?)?;
        let total = rows * row_words as usize;
        let cfg = LaunchConfig { grid_dim: (total.div_ceil(256).clamp(1, 1 << 20) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (rows, side, w, shift, merge) = (rows as u64, self.side as i32, self.window as i32, self.shift as i32, self.merge as i32);
        let out = by_dtype!(s.dtype(), "the Swin windows kernel", T => {
            let src = view::<T>(s, l, "the Swin windows kernel")?;
            // SAFETY: the kernel writes every row (a permutation of them).
            let out = unsafe { dev.alloc::<T>(l.shape().elem_count())? };
            let mut b = func.builder();
            b.arg(&src).arg(&out).arg(&rows).arg(&row_words).arg(&side).arg(&w).arg(&shift).arg(&merge);
            // SAFETY: argument types and order match the kernel; both buffers hold rows · row_words
            // words of the chosen size, and the start is aligned to it.
            unsafe { b.launch(cfg) }.map_err(|e| failed(&kernel, e))?;
            CudaStorage::wrap_cuda_slice(out, dev)
        });
        Ok((out, self.out_shape(b, c)))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let inverse = Windows { merge: !self.merge, ..*self };
        Ok(Some(grad.contiguous()?.apply_op1(inverse)?))
    }
}
