//! NVIDIA GPUs and MIG slices: what is there ([`topology`]), read through a [`TopologySource`] (NVML,
//! or a recording for tests and for looking at another machine), how a `--device` names one of them
//! ([`select`]), and the sampler that reads its counters while a run measures ([`sampler`], its NVML
//! and GPM readings in [`metrics`]).

pub mod memory_system;
pub mod metrics;
pub mod mig_control;
pub mod nvml;
pub mod reach;
pub mod sampler;
pub mod select;
pub mod topology;

use std::path::PathBuf;

use anyhow::Result;

pub use select::{select, Selected};
pub use topology::{Gpu, MigDevice, Topology};

/// A recorded topology (the JSON of `migprof devices --json`) to use instead of asking NVML.
pub const TOPOLOGY_ENV: &str = "MIGPROF_TOPOLOGY";

/// Where the topology comes from. `Err` says why there are no GPUs to be had (no driver, NVML failing).
pub trait TopologySource {
    fn topology(&self) -> Result<Topology>;
}

/// This machine's GPUs, from NVML.
pub struct NvmlSource;

impl TopologySource for NvmlSource {
    fn topology(&self) -> Result<Topology> {
        nvml::read_topology()
    }
}

/// A recording: the JSON of `migprof devices --json`.
pub struct Recorded(pub PathBuf);

impl TopologySource for Recorded {
    fn topology(&self) -> Result<Topology> {
        Topology::read(&self.0)
    }
}

/// The recording named by [`TOPOLOGY_ENV`] when set, else NVML.
pub fn source() -> Box<dyn TopologySource> {
    match std::env::var_os(TOPOLOGY_ENV) {
        Some(path) => Box::new(Recorded(path.into())),
        None => Box::new(NvmlSource),
    }
}

/// The machine's GPUs, from [`source`].
pub fn discover() -> Result<Topology> {
    source().topology()
}
