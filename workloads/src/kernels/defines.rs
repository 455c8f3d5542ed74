//! The constants a kernel source shares with the Rust that launches it, each written once here with
//! its reason and handed to NVRTC as a `#define` ahead of the source (`sources.rs`), so that a grid,
//! a buffer's size or a field's index cannot differ between the two sides. A leaf: the ops and the
//! list of sources both read it.

/// `attention.cu` and `fused_attention.cu`.
pub mod attention {
    /// Keys per lane in the softmax kernels (KEEP in the source).
    pub const KEEP_KEYS: usize = 8;

    /// Queries per block of the fused tensor-core kernels (FA_Q in `fused_attention.cu`): four
    /// warps of 16.
    pub const FUSED_QUERIES_PER_BLOCK: usize = 64;
}

/// `decode.cu`.
pub mod decode {
    /// Words (16 bytes) of a weight row each lane of a product has in flight (DEC_UNROLL in the
    /// source); half that past 4 sequences (its `Group`), whose sums take the registers.
    pub const WORDS_IN_FLIGHT: usize = 8;

    /// Warps per block of the products (DEC_WARPS in the source), one output row (or rotary pair)
    /// each.
    pub const WARPS: usize = 8;

    /// Threads of a block of the attention kernel (DA_THREADS in the source).
    pub const ATTENTION_THREADS: usize = 128;

    /// The most cache slots a block of the attention kernel takes (DA_CHUNK in the source).
    pub const CHUNK: usize = 64;

    /// The most query heads one key-value head serves in the attention kernel (DA_MAX_GROUP).
    pub const MAX_GROUP: usize = 16;

    /// Threads of a block of the attention's combine (DC_THREADS in the source): each (sequence,
    /// query head) has its features' chunks split over them.
    pub const COMBINE_THREADS: usize = 512;

    /// Threads of a block of greedy decoding's argmax (AM_THREADS in the source).
    pub const ARGMAX_THREADS: usize = 256;

    /// The most elements (sequences × row length) a product normalizes itself (NORM_MAX in the
    /// source: what a block keeps in shared memory, 47.5 KB beside its sums); past it the RMSNorm
    /// before it runs as a kernel of its own.
    pub const NORM_MAX: usize = 24_320;
}

/// `layer_norm.cu`.
pub mod layer_norm {
    /// Elements of a row each layer-norm thread keeps (PER in the source).
    pub const PER_THREAD: usize = 8;
}

/// `masters.cu`.
pub mod masters {
    /// Where each field of the step state lives.
    pub mod at {
        pub const T: usize = 0;
        pub const C1: usize = 1;
        pub const C2: usize = 2;
        pub const SCALE: usize = 3;
        pub const FOUND: usize = 4;
        pub const GOOD: usize = 5;
        pub const SKIPPED: usize = 6;
        pub const ATTEMPTED: usize = 7;
        pub const LEN: usize = 8;
    }

    /// Parameters a launch takes (GROUP in the source).
    pub const GROUP: usize = 96;
    /// Elements a block takes (CHUNK in the source).
    pub const CHUNK: usize = 4096;
}
