//! migprof: measures deep-learning workloads on a device (CPU, GPU, MIG slice) and records what it
//! measured, where, and whether the number can be trusted.

pub mod capacity;
pub mod cell;
pub mod device;
pub mod files;
pub mod fleet;
pub mod gpu;
pub mod heap;
pub mod load;
pub mod mig;
pub mod mps;
pub mod program;
pub mod provenance;
pub mod report;
pub mod results;
pub mod run;
pub mod server;
pub mod sweep;
#[cfg(test)]
pub(crate) mod testing;
