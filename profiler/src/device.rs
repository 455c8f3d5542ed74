//! Which device a run uses: parsing `--device`, opening it in candle, and naming it for the record.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, Result};
use candle_core::Device;

/// The valid spellings of `--device` in this version, for error messages.
pub const VALID_DEVICES: &str = "cpu, cuda (the first CUDA device), cuda:N (CUDA device N)";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda { ordinal: usize },
}

impl FromStr for DeviceSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        match s {
            "cpu" => return Ok(Self::Cpu),
            "cuda" => return Ok(Self::Cuda { ordinal: 0 }),
            _ => {}
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return match n.parse() {
                Ok(ordinal) => Ok(Self::Cuda { ordinal }),
                Err(_) => bail!("`{s}`: the CUDA ordinal must be a non-negative integer; valid devices: {VALID_DEVICES}"),
            };
        }
        if s.starts_with("MIG-") || s.starts_with("GPU-") {
            let what = if s.starts_with("MIG-") { "a MIG slice" } else { "a GPU" };
            bail!(
                "`{s}` names {what} by UUID; selecting devices by GPU or MIG UUID needs NVML device discovery, \
                 which this version of migprof does not have yet; valid devices: {VALID_DEVICES}"
            )
        }
        bail!("unknown device `{s}`; valid devices: {VALID_DEVICES}")
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// The device a run executed on, as recorded with its results.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// `cpu` or `cuda`.
    pub kind: &'static str,
    /// What the hardware calls itself, e.g. the CPU model with the thread count candle uses.
    pub name: String,
}

/// An opened device and its identity.
pub struct OpenDevice {
    pub device: Device,
    pub info: DeviceInfo,
}

impl DeviceSpec {
    /// Opens the device, or says why it cannot be used, before any workload touches it.
    pub fn open(&self) -> Result<OpenDevice> {
        match *self {
            DeviceSpec::Cpu => Ok(OpenDevice { device: Device::Cpu, info: DeviceInfo { kind: "cpu", name: cpu_name() } }),
            DeviceSpec::Cuda { .. } if !candle_core::utils::cuda_is_available() => bail!(
                "`{self}`: this migprof was built without CUDA support (cargo feature `cuda`); \
                 valid devices in this build: cpu"
            ),
            DeviceSpec::Cuda { ordinal } => {
                let device = Device::new_cuda(ordinal)?;
                Ok(OpenDevice { device, info: DeviceInfo { kind: "cuda", name: format!("cuda:{ordinal}") } })
            }
        }
    }
}

/// The CPU model from /proc/cpuinfo and the number of threads candle's CPU kernels use.
fn cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>().join(" "))
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} ({} threads)", candle_core::utils::get_num_threads())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cpu_and_cuda_ordinals() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda { ordinal: 0 });
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda { ordinal: 3 });
    }

    #[test]
    fn rejects_uuids_and_junk_naming_the_valid_choices() {
        for bad in ["MIG-4f6e2a1c-0000-5000-8000-000000000000", "GPU-1234", "tpu", "cuda:x", "cuda:-1"] {
            let err = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(err.contains(bad) && err.contains(VALID_DEVICES), "{err}");
        }
        let err = "MIG-abc".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(err.contains("MIG slice"), "{err}");
    }

    #[test]
    fn cpu_opens_and_names_itself() {
        let d = DeviceSpec::Cpu.open().unwrap();
        assert_eq!(d.info.kind, "cpu");
        assert!(d.info.name.ends_with("threads)"), "{}", d.info.name);
    }

    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        if candle_core::utils::cuda_is_available() {
            return; // a CUDA build: covered on the GPU machine instead
        }
        let err = DeviceSpec::Cuda { ordinal: 0 }.open().err().unwrap().to_string();
        assert!(err.contains("built without CUDA support") && err.contains("valid devices in this build: cpu"), "{err}");
    }
}
