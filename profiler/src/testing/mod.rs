//! Stand-ins for what tests cannot have: a clock and a step of scripted duration ([`clock`]), and
//! NVML's MIG calls on a GPU whose layout may change ([`nvml`]). Behind the same traits as the real
//! things, so the code under test cannot tell.

pub mod clock;
pub mod nvml;
