//! Deep-learning workloads on candle: the models migprof measures, their synthetic inputs, inference
//! and training steps, and their parameter and FLOP counts. Knows nothing of profiling.

pub mod generation;
mod graphs;
pub mod init;
pub mod kernels;
pub mod memory;
pub mod models;
pub mod optim;
pub mod precision;
pub mod serving;
mod workload;
mod zoo;

pub use generation::{BlockSize, Generator, KvLayout, Lengths};
pub use graphs::GraphStats;
pub use models::{is_buffer, Inputs};
pub use optim::{MasterWeights, OptimizerKind, ScaleReading};
pub use workload::{build, Batch, Mode, TrainConfig, Workload, WorkloadConfig};
pub use zoo::{
    check_name, lookup, lookup_with, model_names, models, tiny_model, Arch, Family, InputShape, ModelInfo, ZooError,
    FOLDER_PREFIX,
};
