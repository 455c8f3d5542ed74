//! migprof: measures deep-learning workloads on a device (CPU, GPU, MIG slice) and records what it
//! measured, where, and whether the number can be trusted.

pub mod app;
pub mod cli;
pub mod device;
pub mod gpu;
pub mod measure;
pub mod mig;
pub mod plot;
pub mod preflight;
pub mod provenance;
pub mod run;
pub mod sampler;
pub mod stats;
pub mod store;
pub mod summary;
pub mod verdict;
