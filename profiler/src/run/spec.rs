//! What to run: one model, mode, precision and batch size with every setting that changes what is
//! measured. The command line builds it (`migprof run`, `load`) and so does a sweep's cell; the checks
//! that need the device are [`crate::run::preflight`]'s.

use std::str::FromStr;

use anyhow::Result;
use candle_core::DType;
use workloads::kernels::KernelOptions;
use workloads::Mode;

use crate::run::measure::{Stop, Warmup};

/// The element type of weights and activations, and for f32 whether matmuls and convolutions may run
/// on TF32 tensor cores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    F32,
    /// f32 weights and activations; f32 matmuls and convolutions may run on TF32 tensor cores (10-bit
    /// mantissa inputs, f32 accumulation), as PyTorch's convolutions do by default. GPU only.
    Tf32,
    Bf16,
    F16,
}

impl Precision {
    /// Every precision as `--dtype` spells it, in the order the help lists them.
    pub const NAMES: [&'static str; 4] = ["f32", "bf16", "f16", "tf32"];

    /// The precision of a dtype, TF32 allowed or not (`tf32` is only a mode of f32).
    pub fn of(dtype: DType, tf32: bool) -> Precision {
        match (dtype, tf32) {
            (DType::F32, true) => Precision::Tf32,
            (DType::BF16, _) => Precision::Bf16,
            (DType::F16, _) => Precision::F16,
            _ => Precision::F32,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// The dtype of the tensors.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 | Precision::Tf32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Whether f32 products may use TF32.
    pub fn tf32(self) -> bool {
        self == Precision::Tf32
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "tf32" => Ok(Precision::Tf32),
            "bf16" => Ok(Precision::Bf16),
            "f16" => Ok(Precision::F16),
            other => Err(format!(
                "dtype `{other}`; valid dtypes: {}",
                Precision::NAMES.join(", ")
            )),
        }
    }
}

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub model: String,
    pub mode: Mode,
    pub precision: Precision,
    pub batch: usize,
    /// Tokens per sequence for token models (their default when `None`); always `None` for images.
    pub seq_len: Option<usize>,
    /// A generation's prompt and output lengths: `Some` exactly when `mode` is generate.
    pub lengths: Option<workloads::Lengths>,
    /// How a generation keeps its KV cache (unused by other modes).
    pub kv_layout: workloads::KvLayout,
    /// A safetensors checkpoint to load instead of seeded random weights.
    pub weights: Option<std::path::PathBuf>,
    /// The optimizer of a training run (unused when inferring).
    pub train: workloads::TrainConfig,
    /// The kernel choices the workload runs with; recorded in the row as `kernel_options`.
    pub kernels: KernelOptions,
    pub warmup: Warmup,
    pub stop: Stop,
    pub seed: u64,
    /// How often the sampler reads the GPU's counters while measuring; `None`: no sampler.
    pub sample_interval: Option<std::time::Duration>,
    /// A try of a `"max"` search, which only has to show that the batch fits: a generation's runs
    /// its prefill and [`PROBE_DECODE_STEPS`] decode steps over a cache reserved for the whole
    /// context, not every step of the output.
    pub probe: bool,
}

/// Decode steps a generation's probe runs: the first launched op by op, the second captured as a
/// CUDA graph, the third replayed, so that the graph's memory is in the probe's peak too.
pub const PROBE_DECODE_STEPS: usize = 3;

impl RunSpec {
    /// `model` in `mode` at `precision` and `batch`, every other choice as a run makes it unless
    /// told: the model's own sequence length, no generation lengths, a contiguous cache, seeded
    /// weights (seed 0), the default optimizer and kernels, no warm-up, one measured step, no
    /// sampler. The one constructor: a caller names what it sets and takes the rest from here
    /// (`RunSpec { seed, ..RunSpec::new(…) }`).
    pub fn new(model: &str, mode: Mode, precision: Precision, batch: usize) -> RunSpec {
        RunSpec {
            model: model.to_string(),
            mode,
            precision,
            batch,
            seq_len: None,
            lengths: None,
            kv_layout: workloads::KvLayout::default(),
            weights: None,
            train: workloads::TrainConfig::default(),
            kernels: KernelOptions::default(),
            warmup: Warmup::Iterations(0),
            stop: Stop::Iterations(1),
            seed: 0,
            sample_interval: None,
            probe: false,
        }
    }

    /// Builds the spec's workload on `device`, after setting TF32 for the process as the spec says
    /// (process-wide in cuBLAS and cuDNN: set for every run, so that a tf32 run does not leak into the
    /// f32 one after it).
    pub fn build_workload(
        &self,
        device: &candle_core::Device,
    ) -> Result<(Box<dyn workloads::Workload>, workloads::ModelInfo)> {
        let (_, info) = workloads::lookup_with(&self.model, self.seq_len)?;
        let workload = workloads::build(&self.model, &self.workload_config(device))
            .map_err(anyhow::Error::from)
            .map_err(|e| e.context(format!("building {}", self.model)))?;
        Ok((workload, info))
    }

    /// Builds the spec's language model on `device` to generate, TF32 set as for a workload.
    pub fn build_generator(&self, device: &candle_core::Device) -> Result<workloads::Generator> {
        workloads::Generator::build(&self.model, &self.workload_config(device), self.kv_layout)
            .map_err(anyhow::Error::from)
            .map_err(|e| e.context(format!("building {}", self.model)))
    }

    /// The workload's settings, after setting TF32 for the process as the spec says.
    pub(crate) fn workload_config(&self, device: &candle_core::Device) -> workloads::WorkloadConfig {
        workloads::precision::allow_tf32(self.precision.tf32());
        workloads::WorkloadConfig {
            device: device.clone(),
            dtype: self.precision.dtype(),
            mode: self.mode,
            seed: self.seed,
            seq_len: self.seq_len,
            weights: self.weights.clone(),
            train: self.train,
            kernels: self.kernels,
        }
    }

    /// Whether the model, mode and lengths go together, before any work: a language model
    /// generates, with lengths that fit its positions; the other models infer or train.
    pub fn check_model(&self, info: &workloads::ModelInfo) -> Result<()> {
        self.mode.check_model(info).map_err(anyhow::Error::msg)?;
        if let (Some(l), workloads::InputShape::Prompt { max_positions, .. }) = (self.lengths, info.input) {
            l.check(&self.model, max_positions).map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_precision_parses_back_from_its_name() {
        for name in Precision::NAMES {
            let p: Precision = name.parse().unwrap();
            assert_eq!(p.as_str(), name);
            assert_eq!(Precision::of(p.dtype(), p.tf32()), p);
        }
        assert_eq!(Precision::Tf32.dtype(), DType::F32);
        let e = "fp8".parse::<Precision>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("f32, bf16, f16, tf32"), "{e}");
    }
}
