//! Running: what to run ([`spec`]), checking that the device can run it ([`preflight`]), the measuring
//! loop ([`measure`]) with the GPU sampler beside it, what it will need of the device's memory
//! ([`estimate`]), one run from start to end ([`execute`]), and the
//! record of a finished run ([`record`]) with its latency statistics ([`stats`], [`uncertainty`]), what
//! the sampler saw ([`evidence`]) and the verdict ([`verdict`]).

pub mod estimate;
pub mod evidence;
pub mod execute;
pub mod fingerprint;
pub mod given;
pub mod group;
pub mod limits;
pub mod measure;
pub mod preflight;
pub mod record;
pub mod spec;
pub mod stats;
pub mod subject;
pub mod uncertainty;
pub mod verdict;

pub use execute::execute;
pub use record::{Run, RunContext};
pub use spec::RunSpec;
