//! One run: a model, mode, dtype and batch size measured on one device, and everything recorded
//! about it. [`Run`] is the results model that the Parquet store, the plots and the summary read.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use chrono::{DateTime, Utc};
use workloads::kernels::KernelOptions;
use workloads::{Batch, Mode, ModelInfo, Workload};

use crate::device::{DeviceInfo, OpenDevice};
use crate::measure::{measure_steps, warm_up, Executor, Measurement, MonotonicClock, Stop, Warmup};
use crate::sampler::{summarize, MetricSummary, Sample, Sampler};
use crate::provenance;
use crate::stats::{wall_throughput, LatencyStats};
use crate::verdict::{assess, Assessment};

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub model: String,
    pub mode: Mode,
    pub dtype: DType,
    /// f32 matmuls and convolutions may use TF32 (`--dtype tf32`); only with `dtype` f32.
    pub tf32: bool,
    pub batch: usize,
    /// Tokens per sequence for token models (their default when `None`); always `None` for images.
    pub seq_len: Option<usize>,
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
}

impl RunSpec {
    /// The precision as `--dtype` names it: `tf32`, or the dtype.
    pub fn precision(&self) -> &'static str {
        precision(self.dtype, self.tf32)
    }
}

fn precision(dtype: DType, tf32: bool) -> &'static str {
    if tf32 {
        "tf32"
    } else {
        dtype.as_str()
    }
}

/// Identity of the run within its invocation and its surroundings.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub invocation_id: String,
    pub host: String,
    pub device: DeviceInfo,
}

#[derive(Debug, Clone)]
pub struct Run {
    pub run_id: String,
    pub context: RunContext,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub model: ModelInfo,
    pub mode: Mode,
    pub dtype: DType,
    pub tf32: bool,
    pub batch: usize,
    pub seed: u64,
    /// The checkpoint the weights came from; `None` for seeded random weights.
    pub weights: Option<String>,
    /// The optimizer and its settings for training runs, e.g. `adamw(lr=0.001, weight_decay=0.01)`.
    pub optimizer: Option<String>,
    pub kernels: KernelOptions,
    pub warmup_iterations: u64,
    pub measurement: Measurement,
    pub stats: LatencyStats,
    pub assessment: Assessment,
    /// The sampler's readings over the measured phase (empty without a sampler).
    pub metrics: Vec<Sample>,
    pub metric_summary: MetricSummary,
    /// Why the sampler gave nothing, when it was asked for and failed.
    pub sampler_error: Option<String>,
    /// The sampler's interval, when one ran.
    pub sample_interval: Option<std::time::Duration>,
}

impl Run {
    /// Assembles a run from a finished measurement.
    pub fn new(
        spec: &RunSpec,
        model: ModelInfo,
        context: RunContext,
        started_at: DateTime<Utc>,
        measurement: Measurement,
        metrics: Result<Vec<Sample>>,
    ) -> Result<Self> {
        let stats = LatencyStats::from_latencies(&measurement.latencies_ns)?;
        let assessment = assess(&measurement.latencies_ns);
        let (metrics, sampler_error) = match metrics {
            Ok(m) => (m, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        };
        let metric_summary = summarize(&metrics, stats.iterations * spec.batch as u64);
        let sample_interval = spec.sample_interval.filter(|_| context.device.selected.is_some());
        Ok(Self {
            run_id: provenance::run_id(started_at),
            context,
            started_at,
            finished_at: provenance::now(),
            model,
            mode: spec.mode,
            dtype: spec.dtype,
            tf32: spec.tf32,
            batch: spec.batch,
            seed: spec.seed,
            weights: spec.weights.as_ref().map(|p| p.display().to_string()),
            optimizer: (spec.mode == Mode::Train).then(|| describe(&spec.train)),
            kernels: spec.kernels,
            warmup_iterations: measurement.warmup_iterations,
            measurement,
            stats,
            assessment,
            metrics,
            metric_summary,
            sampler_error,
            sample_interval,
        })
    }

    /// The precision as `--dtype` names it: `tf32`, or the dtype.
    pub fn precision(&self) -> &'static str {
        precision(self.dtype, self.tf32)
    }

    /// `1000 / mean_latency_ms * batch`, samples per second.
    pub fn throughput(&self) -> f64 {
        self.stats.throughput(self.batch)
    }

    /// Samples per second over the measured wall-clock time.
    pub fn wall_throughput(&self) -> f64 {
        wall_throughput(self.stats.iterations, self.batch, self.measurement.elapsed)
    }

    pub fn sample_interval_ms(&self) -> Option<i64> {
        self.sample_interval.map(|d| d.as_millis() as i64)
    }

    /// Forward FLOPs per sample for inference, 3x that for training.
    pub fn flops_per_sample(&self) -> u64 {
        match self.mode {
            Mode::Infer => self.model.flops_per_sample,
            Mode::Train => self.model.train_flops_per_sample(),
        }
    }
}

fn describe(t: &workloads::TrainConfig) -> String {
    match t.optimizer {
        workloads::OptimizerKind::AdamW => format!("adamw(lr={}, weight_decay={})", t.lr, t.weight_decay),
        workloads::OptimizerKind::Sgd { momentum } => {
            format!("sgd(lr={}, momentum={momentum}, weight_decay={})", t.lr, t.weight_decay)
        }
    }
}

/// Builds the workload, measures it and returns the run.
pub fn execute(spec: &RunSpec, device: &OpenDevice, context: RunContext) -> Result<Run> {
    // Process-wide in cuBLAS and cuDNN: set for every run, so that a tf32 run does not leak into the
    // f32 one after it.
    workloads::precision::allow_tf32(spec.tf32);
    let (_, info) = workloads::lookup_with(&spec.model, spec.seq_len)?;
    let cfg = workloads::WorkloadConfig {
        device: device.device.clone(),
        dtype: spec.dtype,
        mode: spec.mode,
        seed: spec.seed,
        seq_len: spec.seq_len,
        weights: spec.weights.clone(),
        train: spec.train,
        kernels: spec.kernels,
    };
    let workload = workloads::build(&spec.model, &cfg).with_context(|| format!("building {}", spec.model))?;
    let batch = workload.synthetic_batch(spec.batch, spec.seed).context("making the synthetic batch")?;
    let mut exec = WorkloadExecutor { workload, batch, device: device.device.clone(), loss: None };
    let started_at = provenance::now();
    let clock = MonotonicClock::new();
    let warmup_iterations = warm_up(&mut exec, &clock, spec.warmup)?;
    let sampler = match (&device.info.selected, spec.sample_interval) {
        (Some(selected), Some(interval)) => Some(start_nvml_sampler(selected.clone(), interval)),
        _ => None,
    };
    let profiled = ProfilerRange::start(&device.device);
    let measured = measure_steps(&mut exec, &clock, spec.stop);
    drop(profiled);
    let metrics = match sampler {
        Some(s) => s.stop(),
        None => Ok(Vec::new()),
    };
    // The workload's memory goes back to the driver before the next run builds its own, whether
    // or not this one measured.
    drop(exec);
    let released = workloads::memory::release_pooled(&device.device);
    let measurement = Measurement { warmup_iterations, ..measured? };
    released.context("releasing the run's GPU memory")?;
    Run::new(spec, info, context, started_at, measurement, metrics)
}

/// Marks the measured iterations for a CUDA profiler started with `--profile-from-start off` (Nsight
/// Compute's and Nsight Systems' option): warm-up, cuDNN's algorithm search and model building stay
/// out of the profile. Without a profiler attached the two calls do nothing.
struct ProfilerRange(bool);

impl ProfilerRange {
    fn start(device: &candle_core::Device) -> Self {
        #[cfg(feature = "cuda")]
        if device.is_cuda() {
            // SAFETY: no arguments; CUDA is initialised (the model lives on the device).
            unsafe { candle_core::cuda_backend::cudarc::driver::sys::cuProfilerStart() };
            return ProfilerRange(true);
        }
        let _ = device;
        ProfilerRange(false)
    }
}

impl Drop for ProfilerRange {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: as for the start.
            #[cfg(feature = "cuda")]
            unsafe {
                candle_core::cuda_backend::cudarc::driver::sys::cuProfilerStop()
            };
        }
    }
}

/// Samples the selected GPU or MIG device through NVML, on the sampler's thread.
fn start_nvml_sampler(selected: crate::gpu::Selected, interval: std::time::Duration) -> Sampler {
    Sampler::start(interval, move |lp| {
        let nvml = nvml_wrapper::Nvml::init()?;
        let mut source = crate::gpu::metrics::NvmlMetrics::open(&nvml, &selected)?;
        Ok(lp.run(&mut source))
    })
}

/// Drives a [`Workload`]: one inference or training step on a fixed batch, then a device sync.
struct WorkloadExecutor {
    workload: Box<dyn Workload>,
    batch: Batch,
    device: Device,
    loss: Option<Tensor>,
}

impl Executor for WorkloadExecutor {
    fn step(&mut self) -> Result<()> {
        match self.workload.mode() {
            Mode::Infer => {
                let logits = self.workload.infer(&self.batch)?;
                self.device.synchronize()?;
                drop(logits);
            }
            Mode::Train => {
                let loss = self.workload.train_step(&self.batch)?;
                self.device.synchronize()?;
                self.loss = Some(loss);
            }
        }
        Ok(())
    }

    fn loss(&mut self) -> Result<Option<f32>> {
        match &self.loss {
            Some(l) => Ok(Some(l.to_dtype(DType::F32)?.to_scalar::<f32>()?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::measure::fake::{FakeClock, FakeStep};
    use crate::stats::tests::close;
    use crate::verdict::Verdict;
    use std::time::Duration;

    pub fn context() -> RunContext {
        RunContext {
            invocation_id: "inv-test".into(),
            host: "testhost".into(),
            device: DeviceInfo { kind: "cpu", name: "Test CPU (2 threads)".into(), selected: None },
        }
    }

    pub fn spec(batch: usize, iters: u64) -> RunSpec {
        RunSpec {
            model: "resnet_tiny".into(),
            mode: Mode::Infer,
            dtype: DType::F32,
            tf32: false,
            batch,
            seq_len: None,
            weights: None,
            train: workloads::TrainConfig::default(),
            kernels: KernelOptions::default(),
            warmup: Warmup::Iterations(2),
            stop: Stop::Iterations(iters),
            seed: 1,
            sample_interval: None,
        }
    }

    /// A run measured on the fake 1 ms / 3 ms step.
    pub fn fake_run(batch: usize, iters: u64, tick: Duration) -> Run {
        let clock = FakeClock::with_tick(tick);
        let mut step = FakeStep::new(&clock, &[1.0, 3.0]);
        let spec = spec(batch, iters);
        let m = crate::measure::measure(&mut step, &clock, spec.warmup, spec.stop).unwrap();
        let (_, info) = workloads::lookup("resnet_tiny").unwrap();
        Run::new(&spec, info, context(), provenance::now(), m, Ok(Vec::new())).unwrap()
    }

    #[test]
    fn throughputs_of_the_alternating_fake_step() {
        // Mean 2 ms, batch 8: 1000 / 2 * 8 = 4000 samples/s by the formula and by the wall clock.
        let run = fake_run(8, 30, Duration::ZERO);
        assert_eq!(run.throughput(), 4000.0);
        assert_eq!(run.wall_throughput(), 4000.0);
        assert_eq!(run.assessment.verdict, Verdict::Ok, "{}", run.assessment.reason);
        assert!(close(run.stats.p50_ns, 1_000_000), "{}", run.stats.p50_ns);
        assert!(close(run.stats.p99_ns, 3_000_000), "{}", run.stats.p99_ns);
    }

    #[test]
    fn wall_throughput_includes_harness_time_and_the_formula_does_not() {
        // Each clock read costs 100 us: latencies are 2.1 ms on average, the 30 iterations take
        // 60 ms of steps + 91 reads x 100 us = 69.1 ms of wall time.
        let run = fake_run(4, 30, Duration::from_micros(100));
        assert!((run.throughput() - 1000.0 / 2.1 * 4.0).abs() < 1e-9, "{}", run.throughput());
        assert!((run.wall_throughput() - 120.0 / 0.0691).abs() < 1e-6, "{}", run.wall_throughput());
    }

    #[test]
    fn five_iterations_are_too_few() {
        let run = fake_run(1, 5, Duration::ZERO);
        assert_eq!(run.assessment.verdict, Verdict::TooFewIterations);
        assert_eq!(run.stats.iterations, 5);
    }

    #[test]
    fn training_flops_are_three_forwards() {
        let mut run = fake_run(1, 10, Duration::ZERO);
        let fwd = run.flops_per_sample();
        run.mode = Mode::Train;
        assert_eq!(run.flops_per_sample(), 3 * fwd);
    }

    #[test]
    fn real_tiny_training_run_records_a_falling_loss() -> Result<()> {
        let mut spec = spec(4, 12);
        spec.mode = Mode::Train;
        let device = crate::device::DeviceSpec::Cpu.open()?;
        let run = execute(&spec, &device, context())?;
        assert_eq!(run.stats.iterations, 12);
        assert_eq!(run.warmup_iterations, 2);
        let (first, last) = (run.measurement.loss_first.unwrap(), run.measurement.loss_last.unwrap());
        assert!(last < first, "loss {first} -> {last}");
        Ok(())
    }
}
