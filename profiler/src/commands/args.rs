//! What several commands share: the flags of a workload (mode, dtype, optimizer, kernel choices), the
//! parsers that check a value and name the valid ones, and the device a command runs on by default.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use clap::ValueEnum;
use migprof::device::DeviceSpec;
pub use migprof::run::given::{parse_model, KernelGiven};
pub use migprof::run::limits::{parse_seconds, parse_share};
use migprof::run::spec::Precision;
use workloads::Mode;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Infer,
    Train,
    Generate,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Infer => Mode::Infer,
            ModeArg::Train => Mode::Train,
            ModeArg::Generate => Mode::Generate,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// AdamW, PyTorch's defaults: lr 1e-3, weight decay 0.01.
    Adamw,
    /// SGD with momentum 0.9: lr 0.01, no weight decay.
    Sgd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    F16,
    /// f32 weights and activations; f32 matmuls and convolutions may run on TF32 tensor cores
    /// (10-bit mantissa inputs, f32 accumulation), as PyTorch's convolutions do by default
    /// (`torch.backends.cudnn.allow_tf32`). GPU only.
    Tf32,
}

/// Which capacities of an emulated slice to plan from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MemoryEmulationArg {
    /// The client alone (`mps:`): all of the GPU's memory bandwidth, the upper bound.
    Alone,
    /// Its memory bandwidth partitioned (`mps-mem:`): the profile's share, the lower bound.
    Partitioned,
}

impl From<MemoryEmulationArg> for migprof::mps::MemoryEmulation {
    fn from(m: MemoryEmulationArg) -> Self {
        match m {
            MemoryEmulationArg::Alone => migprof::mps::MemoryEmulation::Alone,
            MemoryEmulationArg::Partitioned => migprof::mps::MemoryEmulation::Partitioned,
        }
    }
}

/// `--recalibrate`: this command and the processes it starts (the MPS client that re-runs it, a
/// sweep's cells) calibrate memory-partitioned slices afresh instead of trusting the cache. The token
/// marks the settings this command makes, so that its later cells reuse them; the MPS client keeps
/// the token of the command that started it.
pub fn ask_recalibration(asked: bool) {
    use migprof::mps::calibration::RECALIBRATE_ENV;
    if asked && std::env::var_os(RECALIBRATE_ENV).is_none() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        std::env::set_var(RECALIBRATE_ENV, format!("{}-{nanos}", std::process::id()));
    }
}

impl From<DTypeArg> for Precision {
    fn from(d: DTypeArg) -> Self {
        match d {
            DTypeArg::F32 => Precision::F32,
            DTypeArg::Bf16 => Precision::Bf16,
            DTypeArg::F16 => Precision::F16,
            DTypeArg::Tf32 => Precision::Tf32,
        }
    }
}

/// A count that must be at least 1 where its bound starts at 0.
pub fn at_least_one(flag: &str, n: u64) -> Result<u64, String> {
    match n {
        0 => Err(format!("{flag} `0`: at least 1")),
        n => Ok(n),
    }
}

/// A rate in requests per second: finite, above zero.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "rates are requests per second above zero, comma-separated (e.g. --qps 100,200,400); got `{s}`"
        )),
    }
}

/// A finite number above zero: milliseconds, seconds.
pub fn parse_positive(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a number above zero (e.g. 50 or 2.5); got `{s}`")),
    }
}

/// A finite, non-negative number: seconds, a learning rate, a weight decay.
pub fn parse_non_negative(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("expected a non-negative number (e.g. 2.5 or 1e-3); got `{s}`")),
    }
}

/// The device asked for, else the default one (saying why when it is the CPU).
pub fn device_or_default(asked: Option<&DeviceSpec>, log: &mut dyn Write) -> Result<DeviceSpec> {
    Ok(match asked {
        Some(d) => d.clone(),
        None => {
            let (spec, why) = DeviceSpec::default_for(migprof::gpu::discover);
            if let Some(why) = why {
                writeln!(log, "note: {why}")?;
            }
            spec
        }
    })
}

/// For an emulated slice (`mps:…`) when this process is no MPS client yet: starts migprof's MPS daemon,
/// runs this same command again as its client and returns that command's exit code. `None`: measure
/// here.
pub fn as_mps_client(device: &DeviceSpec, log: &mut dyn Write) -> Result<Option<std::process::ExitCode>> {
    match device {
        DeviceSpec::Mps(target) if !migprof::mps::client::is_client() => {
            migprof::device::no_cuda_is_an_error(device)?;
            migprof::mps::client::run_as_client(target, log).map(Some)
        }
        _ => Ok(None),
    }
}

/// The line that ends `run`, `load`, `sweep` and `merge`: how to see the folder as a report.
pub fn report_hint(dir: &Path) -> String {
    format!("report: migprof report {}", dir.display())
}
