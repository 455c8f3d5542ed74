//! What `migprof mig` asks of the driver, as a trait: NVML implements it on a real machine
//! (`gpu::mig_control`), and a recording fake (`testing::nvml`) in the tests, since no GPU lent
//! to this project may have its MIG layout changed.

use anyhow::Result;

use super::mode::MigMode;
use super::plan::Placement;
use super::profile::ProfileTable;

/// A GPU as the MIG commands see it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuState {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// NVML's combined PCI device and vendor id (what mig-parted's `device-filter` names).
    pub pci_device_id: u32,
    /// `None` when the GPU does not support MIG.
    pub mig_mode: Option<MigMode>,
    /// Processes with a context on the GPU or any of its MIG devices.
    pub processes: Vec<u32>,
    pub gpu_instances: Vec<GpuInstanceState>,
}

/// A GPU instance that exists.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInstanceState {
    pub id: u32,
    pub profile_id: u32,
    pub placement: Placement,
    pub compute_instances: Vec<ComputeInstance>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ComputeInstance {
    pub id: u32,
    pub compute_slices: u32,
}

/// The driver calls behind `migprof mig`. Indices are NVML's GPU indices.
pub trait MigControl {
    fn gpus(&mut self) -> Result<Vec<GpuState>>;
    /// The GPU's GPU-instance profiles and placements.
    fn profile_table(&mut self, gpu: u32) -> Result<ProfileTable>;
    /// Asks for MIG mode on or off and returns the mode afterwards: `current` stays as it was while
    /// the change waits for a GPU reset.
    fn set_mig_mode(&mut self, gpu: u32, enabled: bool) -> Result<MigMode>;
    /// Creates a GPU instance of `profile_id` at `placement`; returns its id.
    fn create_gpu_instance(&mut self, gpu: u32, profile_id: u32, placement: Placement) -> Result<u32>;
    /// Creates the compute instance that spans the whole GPU instance (nvidia-smi's `-C`); returns
    /// its id.
    fn create_compute_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<u32>;
    fn destroy_compute_instance(&mut self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()>;
    fn destroy_gpu_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<()>;
}
