//! Runs one [`RunSpec`] on an open device: builds the workload, drives its steps through the
//! measuring loop with the sampler beside the measured phase, and returns the [`Run`].

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use workloads::{Batch, Generator, Mode, Workload};

use crate::device::OpenDevice;
use crate::gpu::sampler::{Sample, Sampler};
use crate::provenance;
use crate::run::fingerprint::{self, Fingerprint};
use crate::run::group::GroupMember;
use crate::run::measure::{measure, Executor, LossScale, MonotonicClock, Observer, Stop, Warmup};
use crate::run::record::{CellIdentity, Run, RunContext};
use crate::run::spec::RunSpec;

/// Builds the workload, measures it and returns the run.
pub fn execute(spec: &RunSpec, device: &OpenDevice, context: RunContext, cell: CellIdentity) -> Result<Run> {
    let pool_held_mib = fingerprint::pool_held_mib(&device.device);
    let (mut exec, info) = Steps::build(spec, &device.device)?;
    let (warmup, stop) = exec.rules(spec.warmup, spec.stop);
    let fingerprint = Fingerprint {
        pool_held_mib,
        ..Fingerprint::collect(device.info.selected.as_ref())
    };
    let started_at = provenance::now();
    let mut beside = MeasuredPhase {
        device: device.device.clone(),
        sampling: device.info.selected.clone().zip(spec.sample_interval),
        sampler: None,
        profiled: None,
        metrics: Ok(Vec::new()),
        group: context.group.clone(),
    };
    let mut measured = measure(exec.executor(), &MonotonicClock::new(), warmup, stop, &mut beside);
    match &exec {
        Steps::Workload(w) => {
            warn_of_refused_graphs(w.workload.as_ref(), &spec.model);
            // The row says so too: its `kernel_options` say what was asked, not what ran.
            if let Ok(m) = measured.as_mut() {
                m.graphs_refused = w.workload.graph_refusals();
            }
        }
        Steps::Generation(g) => {
            let refusals = g.generator.graph_refusals();
            say_refused_graphs(&spec.model, g.generator.graph_stats(), &refusals);
            if let Ok(m) = measured.as_mut() {
                m.kv_cache_bytes = g.kv_cache_bytes;
                m.graphs_refused = refusals;
            }
        }
    }

    // A group's members on this device are expected there: neighbours on purpose.
    let mut context = context;
    if let (Some(g), Ok(_)) = (&beside.group, &measured) {
        context.expected.pids.extend(g.pids_on_my_device().unwrap_or_default());
        context.expected.pids.sort_unstable();
        context.expected.pids.dedup();
    }
    log_memory(&device.device, spec, "");
    // The workload's memory goes back to the driver before the next run builds its own, whether
    // or not this one measured.
    drop(exec);
    let released = workloads::memory::release_pooled(&device.device);
    log_memory(&device.device, spec, " released");
    let measurement = measured?;
    released.context("releasing the run's GPU memory")?;
    device.neighbour_still_streams()?;

    Run::new(
        spec,
        info,
        context,
        started_at,
        measurement,
        beside.metrics,
        cell,
        fingerprint,
    )
}

/// `MIGPROF_MEMORY_LOG=1`: where the device's memory went at the end of the measured phase (pool,
/// graphs, cuDNN's workspaces), to tell the workload's own memory from what lies beside it; and again
/// once the run's memory was released (`when` " released"): what the pool still reserves then is
/// carried into the next run of the same process, and counted in its device memory.
fn log_memory(device: &Device, spec: &RunSpec, when: &str) {
    if std::env::var_os("MIGPROF_MEMORY_LOG").is_none() {
        return;
    }
    match workloads::memory::ledger(device) {
        Ok(Some(ledger)) => eprintln!(
            "memory: {} {:?} batch {}{when}: {ledger}",
            spec.model, spec.mode, spec.batch
        ),
        Ok(None) => eprintln!(
            "memory: {}: no stream-ordered pool on this device to account for",
            spec.model
        ),
        Err(e) => eprintln!("memory: {}: could not be read: {e}", spec.model),
    }
}

/// Says so when CUDA graphs were asked for and some shape's steps could not be captured: those steps
/// ran kernel by kernel, and a reader comparing with graphs on should know.
pub(crate) fn warn_of_refused_graphs(workload: &dyn Workload, model: &str) {
    say_refused_graphs(model, workload.graph_stats(), &workload.graph_refusals());
}

/// [`warn_of_refused_graphs`] from the counts and reasons themselves (a workload's, or a
/// generator's decode steps').
fn say_refused_graphs(model: &str, graphs: workloads::GraphStats, refusals: &[String]) {
    if graphs.refused > 0 {
        eprintln!(
            "warning: {model}: CUDA graphs refused for {} step shape(s), which ran kernel by kernel: {}",
            graphs.refused,
            refusals.join("; ")
        );
    }
}

/// Beside a GPU run's measured phase: the NVML sampler (when asked for) and the CUDA profiler's range.
struct MeasuredPhase {
    device: Device,
    /// The selected GPU or MIG device and the sampler's interval; `None`: no sampler.
    sampling: Option<(crate::gpu::Selected, std::time::Duration)>,
    sampler: Option<Sampler>,
    profiled: Option<ProfilerRange>,
    /// What the sampler read (empty without one), or why it failed.
    metrics: Result<Vec<Sample>>,
    /// The concurrent group the run is a member of.
    group: Option<GroupMember>,
}

impl Observer for MeasuredPhase {
    fn meet(&mut self) -> Result<()> {
        self.group.as_mut().map_or(Ok(()), GroupMember::meet)
    }

    fn hold(&mut self) -> Result<bool> {
        self.group.as_mut().map_or(Ok(false), GroupMember::hold)
    }

    fn start(&mut self) {
        self.sampler = self
            .sampling
            .clone()
            .map(|(selected, interval)| start_nvml_sampler(selected, interval));
        self.profiled = Some(ProfilerRange::start(&self.device));
    }

    fn stop(&mut self) {
        self.profiled = None;
        if let Some(s) = self.sampler.take() {
            self.metrics = s.stop();
        }
    }
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
pub(crate) fn start_nvml_sampler(selected: crate::gpu::Selected, interval: std::time::Duration) -> Sampler {
    Sampler::start(interval, move |lp| {
        let nvml = nvml_wrapper::Nvml::init()?;
        let mut source = crate::gpu::metrics::NvmlMetrics::open(&nvml, &selected)?;
        Ok(lp.run(&mut source))
    })
}

/// Runs `work` with the GPU sampler beside it (where `sampling` names a GPU and an interval): its
/// result, the sampler's evidence (or why there is none: not a GPU, off, failed) and the readings.
pub(crate) fn beside_sampler<T>(
    sampling: Option<(crate::gpu::Selected, std::time::Duration)>,
    on_gpu: bool,
    expected: &crate::run::evidence::Expected,
    work: impl FnOnce() -> Result<T>,
) -> Result<(T, crate::run::evidence::Evidence, Vec<crate::gpu::sampler::Sample>)> {
    use crate::run::evidence::{Evidence, Sampling};
    let sampler = sampling.map(|(selected, interval)| start_nvml_sampler(selected, interval));
    let out = work();
    let readings = sampler.map(|s| s.stop());
    let out = out?;
    let (evidence, readings) = match readings {
        None if !on_gpu => (Evidence::none(Sampling::NotAGpu), Vec::new()),
        None => (Evidence::none(Sampling::Off), Vec::new()),
        Some(Err(e)) => (Evidence::none(Sampling::Failed(format!("{e:#}"))), Vec::new()),
        Some(Ok(r)) => (Evidence::from_samples(&r, expected), r),
    };
    Ok((out, evidence, readings))
}

/// What a run's steps are: a workload's inference or training steps, or a language model's
/// generations.
enum Steps {
    Workload(WorkloadExecutor),
    Generation(Box<GenerationExecutor>),
}

impl Steps {
    fn build(spec: &RunSpec, device: &Device) -> Result<(Steps, workloads::ModelInfo)> {
        if let Some(lengths) = spec.lengths {
            let generator = spec.build_generator(device)?;
            let info = generator.info().clone();
            let prompts = generator
                .prompts(spec.batch, lengths.prompt, spec.seed)
                .context("making the prompts")?;
            // A probe needs the generation's peak, not its every step: the cache is reserved for
            // the whole context at the prefill, and a decode step's memory does not grow with its
            // position.
            let steps = match spec.probe {
                true => lengths.decode_steps().min(crate::run::spec::PROBE_DECODE_STEPS),
                false => lengths.decode_steps(),
            };
            let exec = GenerationExecutor {
                generator,
                prompts,
                steps,
                room: lengths.context(),
                at: None,
                next: None,
                kv_cache_bytes: None,
                device: device.clone(),
            };
            return Ok((Steps::Generation(Box::new(exec)), info));
        }
        let (workload, info) = spec.build_workload(device)?;
        let batch = workload
            .synthetic_batch(spec.batch, spec.seed)
            .context("making the synthetic batch")?;
        let exec = WorkloadExecutor {
            workload,
            batch,
            device: device.clone(),
            loss: None,
        };
        Ok((Steps::Workload(exec), info))
    }

    fn executor(&mut self) -> &mut dyn Executor {
        match self {
            Steps::Workload(w) => w,
            Steps::Generation(g) => g.as_mut(),
        }
    }

    /// The warm-up and stop rules in steps: a generation's counts are of whole generations.
    fn rules(&self, warmup: Warmup, stop: Stop) -> (Warmup, Stop) {
        let Steps::Generation(g) = self else {
            return (warmup, stop);
        };
        let steps = |n: u64| n.saturating_mul(g.steps as u64);
        let warmup = match warmup {
            Warmup::Iterations(n) => Warmup::Iterations(steps(n)),
            Warmup::Duration { min, min_iterations } => Warmup::Duration {
                min,
                min_iterations: steps(min_iterations),
            },
        };
        let stop = match stop {
            Stop::Iterations(n) => Stop::Iterations(steps(n)),
            Stop::Duration { min, min_iterations } => Stop::Duration {
                min,
                min_iterations: steps(min_iterations),
            },
            Stop::Precision {
                target,
                min,
                max,
                min_iterations,
            } => Stop::Precision {
                target,
                min,
                max,
                min_iterations: steps(min_iterations),
            },
        };
        (warmup, stop)
    }
}

/// Drives a [`Generator`]: each generation begins with the prefill of the same prompts (timed
/// apart), then each step decodes one token of every sequence, then a device sync.
struct GenerationExecutor {
    generator: Generator,
    prompts: Tensor,
    /// Decode steps of a generation.
    steps: usize,
    /// Tokens a sequence's cache holds by a generation's end.
    room: usize,
    /// Decode steps run in the current generation; `None` between generations.
    at: Option<usize>,
    /// The tokens the next decode step feeds.
    next: Option<Tensor>,
    /// What the cache held at the end of the last whole generation.
    kv_cache_bytes: Option<u64>,
    device: Device,
}

impl Executor for GenerationExecutor {
    fn step(&mut self) -> Result<()> {
        let tokens = self
            .next
            .take()
            .context("a decode step before its generation's prefill")?;
        let next = self.generator.decode(&tokens)?;
        self.device.synchronize()?;
        self.next = Some(next);
        let at = self.at.map_or(1, |a| a + 1);
        if at >= self.steps {
            self.kv_cache_bytes = Some(self.generator.cache_bytes() as u64);
            self.at = None;
        } else {
            self.at = Some(at);
        }
        Ok(())
    }

    fn loss(&mut self) -> Result<Option<f32>> {
        Ok(None)
    }

    fn begin(&mut self, clock: &dyn crate::run::measure::Clock) -> Result<Option<std::time::Duration>> {
        if self.at.is_some() {
            return Ok(None);
        }
        let t0 = clock.now();
        let first = self.generator.prefill(&self.prompts, self.room)?;
        self.device.synchronize()?;
        let took = clock.now() - t0;
        self.next = Some(first);
        self.at = Some(0);
        Ok(Some(took))
    }

    fn steps_per_run(&self) -> usize {
        self.steps
    }
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
            Mode::Generate => unreachable!("a language model generates through GenerationExecutor"),
        }
        Ok(())
    }

    fn steps_to_steady(&self) -> u64 {
        self.workload.steps_to_steady()
    }

    /// Only where a dynamic scale checks the gradients (f16 over f32 masters): reading it
    /// synchronises with the device.
    fn loss_scale(&mut self) -> Result<Option<LossScale>> {
        if self.workload.dtype() != DType::F16 {
            return Ok(None);
        }
        Ok(self.workload.scale_reading()?.map(|r| LossScale {
            scale: r.scale,
            skipped: r.skipped,
        }))
    }

    fn loss(&mut self) -> Result<Option<f32>> {
        match &self.loss {
            Some(l) => Ok(Some(l.to_dtype(DType::F32)?.to_scalar::<f32>()?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::record::tests::{context, spec};

    #[test]
    fn real_tiny_training_run_records_a_falling_loss() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let mut spec = spec(4, 12);
        spec.mode = Mode::Train;
        let device = crate::device::DeviceSpec::Cpu.open()?;
        let run = execute(&spec, &device, context(), crate::run::record::tests::identity())?;
        assert_eq!(run.stats.iterations, 12);
        assert_eq!(run.warmup_iterations, 2);
        let (first, last) = (run.measurement.loss_first.unwrap(), run.measurement.loss_last.unwrap());
        assert!(last < first, "loss {first} -> {last}");
        Ok(())
    }
}
