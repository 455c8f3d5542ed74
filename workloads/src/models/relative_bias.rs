//! Swin's relative position bias, shared by the block of ops (`models::swin`) and the block as one op
//! (`models::swin_block`, CUDA builds only), so that neither module imports the other for it.

use candle_core::{Result, Tensor};

/// Attention's score bias in a block: the relative position bias gathered from the block's table,
/// plus the shifted-window mask where the block shifts. Built from the table on every forward pass
/// (the table trains), by the block of ops (`models::swin`) and by the block as one op
/// (`models::swin_block`), which
/// also needs the table's gradient from the bias's: [`RelativeBias::table_grad`].
#[derive(Clone)]
pub(super) struct RelativeBias {
    /// [w⁴, (2w - 1)²]: row i holds a 1 at the table row of relative position index i. The table is
    /// gathered by a GEMM with it rather than by `index_select`, whose backward (candle's index_add)
    /// is a large part of Swin-T's training step (measured: docs/kernels.md#swin); a one-hot
    /// product is exact (one term per output) and its backward is one more small GEMM.
    gather: Tensor,
    /// [windows, 1, w², w²] in the model's dtype, when the block shifts.
    mask: Option<Tensor>,
    pub(super) heads: usize,
    /// w², the tokens of a window.
    tokens: usize,
}

impl RelativeBias {
    /// `gather` and `mask` as the fields say; `tokens` is w².
    pub(super) fn new(gather: Tensor, mask: Option<Tensor>, heads: usize, tokens: usize) -> Self {
        Self {
            gather,
            mask,
            heads,
            tokens,
        }
    }

    /// The score bias from the table [(2w - 1)², heads]: [1, heads, w², w²], or [windows, heads, w²,
    /// w²] with the mask, which attention repeats along the batch of windows (without
    /// materialising it per image).
    pub(super) fn scores(&self, table: &Tensor) -> Result<Tensor> {
        let n = self.tokens;
        let bias = self
            .gather
            .matmul(table)?
            .reshape((n, n, self.heads))?
            .permute((2, 0, 1))?
            .unsqueeze(0)?;
        match &self.mask {
            Some(mask) => mask.broadcast_add(&bias)?.contiguous(),
            None => bias.contiguous(),
        }
    }

    /// The table's gradient from that of [`RelativeBias::scores`]' output: the sum over windows
    /// (the mask is a constant), heads moved last, the one-hot gather transposed. (Only the CUDA
    /// op calls it; the CPU tests it against candle's autograd.)
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn table_grad(&self, dscores: &Tensor) -> Result<Tensor> {
        let n = self.tokens;
        let per_head = dscores.sum(0)?; // [heads, n, n]
        let rows = per_head
            .permute((1, 2, 0))?
            .contiguous()?
            .reshape((n * n, self.heads))?;
        self.gather.t()?.matmul(&rows)
    }
}
