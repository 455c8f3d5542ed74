//! MIG profiles and layouts: the profile tables of known GPUs ([`profile`]) and the planner that says
//! whether a set of GPU instances fits and where ([`plan`]).

pub mod plan;
pub mod profile;

pub use plan::{maximal_layouts, plan, GpuInstance, Placement, Plan};
pub use profile::{table, MigProfile, ProfileTable, GPUS};
