//! MIG profiles and layouts: the profile tables of known GPUs ([`profile`]), the planner that says
//! whether a set of GPU instances fits and where ([`plan`]), layout files in mig-parted's format
//! ([`config`]), and applying, destroying and exporting layouts ([`apply`]) through the driver calls
//! of [`control`] (NVML in `gpu::mig_control`, or the fake in `testing::nvml` for tests).

pub mod apply;
pub mod config;
pub mod control;
pub mod mode;
pub mod plan;
pub mod profile;
pub mod reference;

pub use mode::MigMode;
pub use plan::{maximal_layouts, plan, GpuInstance, Placement, Plan};
pub use profile::{table, MigProfile, ProfileTable, GPUS};
