//! Kernels of our own where candle's are slow, each a candle custom op with its own backward, behind a
//! function that picks it where it runs. Two kinds: ops with a CPU half (layer norm, batch norm,
//! AdamW), whose f64 loops are the reference and are gradient-checked by `cargo test`; and
//! CUDA-only ops, for which the function takes candle's own ops elsewhere (the CPU, a build without
//! cuDNN) and those are the reference. The GPU tests compare each with its reference, forward and
//! every input's gradient (`workloads/tests/kernels.rs`).
//!
//! One file per op: the function that picks it, its custom op and launch (in a `cuda` module), its
//! CPU reference; its CUDA source beside it as a `.cu` file (`sources.rs` lists them). This module
//! only declares them and re-exports the functions the models call.

pub mod adamw;
pub mod attention;
pub mod batch_norm;
pub mod causal_attention;
#[cfg(any(feature = "cudnn", test))]
mod choice;
#[cfg(feature = "cuda")]
mod conv1x1;
pub mod conv2d;
#[cfg(feature = "cudnn")]
pub mod conv_nhwc;
mod cpu;
#[cfg(feature = "cudnn")]
mod cudnn_graph;
pub mod decode;
pub mod defines;
pub mod elementwise;
pub mod embedding;
#[cfg(feature = "cuda")]
mod fused_attention;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
mod launch;
pub mod layer_norm;
pub mod linear;
pub mod loss;
pub mod masters;
pub mod max_pool;
#[cfg(feature = "cuda")]
mod nvrtc;
pub mod options;
pub mod positions;
pub mod prefill;
pub mod sources;
pub mod windows;

pub use attention::{attention, ScoreBias};
pub use conv2d::conv2d;
#[cfg(feature = "cudnn")]
pub(crate) use conv2d::cudnn::{release_workspaces, workspace_bytes};
#[cfg(feature = "cudnn")]
pub use conv_nhwc::conv_nhwc;
pub use elementwise::{add, add_over, add_repeating, bias_act, bias_act_over, Act, BiasAxis};
pub use embedding::embedding;
pub use layer_norm::layer_norm;
pub use linear::{linear, linear_residual, product};
pub use loss::cross_entropy;
pub use max_pool::max_pool2d;
pub use options::KernelOptions;
pub use positions::{channels_first, channels_last, first_position, global_average_pool, mean_over_positions};
pub use windows::{merge_neighbours, window_merge, window_partition};

/// The multiprocessors the kernels size their grids to on `device`: its CUDA driver's count, which
/// is a MIG slice's or an MPS client's share, at most what [`hold_multiprocessors`] was given;
/// `None` off CUDA, or where the driver could not say.
pub fn multiprocessors(device: &candle_core::Device) -> Option<usize> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => launch::multiprocessors(d).ok(),
        _ => None,
    }
}

#[cfg(feature = "cuda")]
pub use launch::hold_multiprocessors;
