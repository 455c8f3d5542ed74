//! NVIDIA GPUs and MIG slices: what is there ([`topology`]), read from NVML ([`nvml`]) or from a
//! recorded file, and how a `--device` names one of them ([`select`]).

pub mod metrics;
pub mod nvml;
pub mod select;
pub mod topology;

pub use select::{select, Selected};
pub use topology::{Gpu, MigDevice, MigMode, Topology};

/// A recorded topology (the JSON of `migprof devices --json`) to use instead of asking NVML: for tests,
/// and for looking at another machine's GPUs.
pub const TOPOLOGY_ENV: &str = "MIGPROF_TOPOLOGY";

/// The machine's GPUs: from the file named by [`TOPOLOGY_ENV`] when set, else from NVML. `Err` says
/// why there are none to be had (no driver, NVML failing).
pub fn discover() -> anyhow::Result<Topology> {
    match std::env::var_os(TOPOLOGY_ENV) {
        Some(path) => Topology::read(std::path::Path::new(&path)),
        None => nvml::read_topology(),
    }
}
