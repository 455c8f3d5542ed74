//! Running: what to run ([`spec`]), checking that the device can run it ([`preflight`]), the measuring
//! loop ([`measure`]) with the sampler beside it ([`sampler`]), and one run from start to end
//! ([`execute`]).

pub mod execute;
pub mod fingerprint;
pub mod group;
pub mod measure;
pub mod preflight;
pub mod sampler;
pub mod spec;

pub use execute::execute;
pub use spec::RunSpec;
