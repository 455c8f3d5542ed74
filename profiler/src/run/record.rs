//! [`Run`]: one finished measurement and everything recorded about it — which device, which
//! workload, the latencies and their statistics, the verdict, the sampler's readings. The results
//! model that the Parquet store, the plots and the summary read.

use std::time::Duration;

use anyhow::Result;
use chrono::{DateTime, Utc};
use workloads::kernels::KernelOptions;
use workloads::{Mode, ModelInfo};

use crate::device::DeviceInfo;
use crate::gpu::sampler::{summarize, MetricSummary, Sample};
use crate::provenance;
use crate::run::evidence::{Evidence, Expected, Sampling};
use crate::run::fingerprint::Fingerprint;
use crate::run::measure::Measurement;
use crate::run::spec::{Precision, RunSpec};
use crate::run::stats::{wall_throughput, LatencyStats};
use crate::run::subject::{Program, Subject};
use crate::run::uncertainty::Uncertainty;
use crate::run::verdict::{assess, assess_generations, Assessment};

/// Identity of the run within its invocation and its surroundings.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub invocation_id: String,
    pub host: String,
    pub device: DeviceInfo,
    /// The processes that may compute on the device beside the run without making it shared.
    pub expected: Expected,
    /// The concurrent group the run meets with, as a member.
    pub group: Option<crate::run::group::GroupMember>,
}

impl RunContext {
    /// The context of a new invocation on `device` (a run of `migprof run` or `load`, no group).
    pub fn new_invocation(device: &DeviceInfo) -> RunContext {
        RunContext {
            invocation_id: provenance::run_id(provenance::now()),
            host: provenance::host(),
            device: device.clone(),
            expected: Expected::on(device),
            group: None,
        }
    }
}

/// How a cell's execution ended. About execution only: whether its numbers can be trusted is the
/// verdict's business.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Measured to the end.
    Ok,
    /// Measured to the end as one try of a `max` batch search.
    Probe,
    /// The device (or the host, on the CPU) ran out of memory.
    Oom,
    /// The run failed with an error.
    Error,
    /// Killed after the sweep's `timeout_secs`.
    Timeout,
    /// The process died without saying why (a signal).
    Crashed,
}

impl Status {
    pub const ALL: [Status; 6] = [
        Status::Ok,
        Status::Probe,
        Status::Oom,
        Status::Error,
        Status::Timeout,
        Status::Crashed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Probe => "probe",
            Status::Oom => "oom",
            Status::Error => "error",
            Status::Timeout => "timeout",
            Status::Crashed => "crashed",
        }
    }

    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// How a run that failed with `e` ended: `oom` for an allocation failure (CUDA's, cuBLAS's,
    /// cuDNN's, candle's, the host's), `error` otherwise.
    pub fn of_error(e: &anyhow::Error) -> Status {
        let text = format!("{e:#}");
        let oom = [
            "CUDA_ERROR_OUT_OF_MEMORY",
            "out of memory",
            "CUBLAS_STATUS_ALLOC_FAILED",
            "CUDNN_STATUS_ALLOC_FAILED",
            "memory allocation of",
        ]
        .iter()
        .any(|needle| text.contains(needle));
        if oom {
            Status::Oom
        } else {
            Status::Error
        }
    }
}

/// A cell's id made of its identifying fields: 16 hex digits of their SHA-256 (migprof's own cells,
/// a program's, a server's, a concurrent group's folder).
pub fn id_of(fields: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(fields.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Which cell a row belongs to: its sweep (none for `migprof run`), target, id, and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct CellIdentity {
    pub sweep: Option<String>,
    pub target: String,
    pub cell_id: String,
    pub status: Status,
    /// The concurrent group and the other members (`target:model/mode/dtype/batch`), for a member.
    pub concurrency_group: Option<String>,
    pub neighbours: Vec<String>,
    /// The cell's target is its sweep's baseline.
    pub baseline: bool,
    /// The settings that change what the row measures without changing the cell (warm-up, duration,
    /// precision target and bound, sampler interval), as `key=value;…`: a rerun compares them.
    pub settings: Option<String>,
}

/// A cell that left no measurement: the row says which cell it was, how it ended and why.
#[derive(Debug, Clone)]
pub struct Failure {
    pub run_id: String,
    pub invocation_id: String,
    pub host: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub workload: FailedWorkload,
    pub identity: CellIdentity,
    /// The error, or the child's last lines of output.
    pub error: String,
    /// What the sweep's own process can tell of the build and host (the cell's device was never
    /// opened by it).
    pub fingerprint: Fingerprint,
    /// The program of a failed `migprof exec`; `None` for migprof's own cells.
    pub program: Option<Program>,
}

/// What a failed cell was to run, as its row records it (the spellings of a sweep's cell).
#[derive(Debug, Clone, PartialEq)]
pub struct FailedWorkload {
    pub model: String,
    /// `infer` or `train`.
    pub mode: String,
    /// As `--dtype` spells it.
    pub dtype: String,
    pub batch: usize,
    pub seq_len: Option<usize>,
    pub seed: u64,
    /// The canonical kernel options string.
    pub kernel_options: String,
    /// `f32` or `none` for bf16 and f16 training (as the `master_weights` column); `None` otherwise.
    pub master_weights: Option<String>,
    /// A generation's prompt and output lengths, and its cache's layout and block size; `None`
    /// for other modes.
    pub prompt_len: Option<usize>,
    pub output_len: Option<usize>,
    pub kv_layout: Option<String>,
    pub kv_block_size: Option<workloads::BlockSize>,
}

#[derive(Debug, Clone)]
pub struct Run {
    pub run_id: String,
    pub context: RunContext,
    pub cell: CellIdentity,
    /// The build, host and device settings at the run's start.
    pub fingerprint: Fingerprint,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    /// The model, or the program, it measured.
    pub subject: Subject,
    pub mode: Mode,
    /// `None` for a program that did not say.
    pub precision: Option<Precision>,
    pub batch: usize,
    pub seed: u64,
    /// The checkpoint the weights came from; `None` for seeded random weights.
    pub weights: Option<String>,
    /// The optimizer and its settings for training runs, e.g. `adamw(lr=0.001, weight_decay=0.01)`.
    pub optimizer: Option<String>,
    /// bf16 and f16 training: `f32` over f32 master weights, `none` on the weights themselves; `None`
    /// for f32 training (no separate masters) and inference.
    pub master_weights: Option<&'static str>,
    pub kernels: KernelOptions,
    pub warmup_iterations: u64,
    pub measurement: Measurement,
    pub stats: LatencyStats,
    /// 95% intervals of the mean, throughput, p50 and p99.
    pub uncertainty: Uncertainty,
    pub assessment: Assessment,
    /// What the GPU sampler saw that bears on the verdict.
    pub evidence: Evidence,
    /// The sampler's readings over the measured phase (empty without a sampler).
    pub metrics: Vec<Sample>,
    pub metric_summary: MetricSummary,
    /// Why the sampler gave nothing, when it was asked for and failed.
    pub sampler_error: Option<String>,
    /// The sampler's interval, when one ran.
    pub sample_interval: Option<std::time::Duration>,
    /// A generate run's prefills and cache; `None` for inference and training.
    pub generation: Option<Generation>,
}

/// What a generate run measured beside its decode steps (the run's latencies).
#[derive(Debug, Clone)]
pub struct Generation {
    pub lengths: workloads::Lengths,
    /// How the KV cache was laid out.
    pub kv_layout: workloads::KvLayout,
    /// The prefill of each measured generation: prompts in, first tokens out (time to first token).
    pub prefill: LatencyStats,
    /// Bytes the KV cache held at the end of a generation, the whole batch's.
    pub kv_cache_bytes: u64,
}

impl Generation {
    /// Generations measured.
    pub fn count(&self) -> u64 {
        self.prefill.iterations
    }
}

impl Run {
    /// Assembles a run from a finished measurement: each argument is a part of the record.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &RunSpec,
        model: ModelInfo,
        context: RunContext,
        started_at: DateTime<Utc>,
        measurement: Measurement,
        metrics: Result<Vec<Sample>>,
        cell: CellIdentity,
        fingerprint: Fingerprint,
    ) -> Result<Self> {
        let stats = LatencyStats::from_latencies(&measurement.latencies_ns)?;
        let uncertainty = match spec.lengths {
            Some(l) => Uncertainty::of_runs(&measurement.latencies_ns, spec.batch, l.decode_steps()),
            None => Uncertainty::of(&measurement.latencies_ns, spec.batch),
        };
        let generation = match (spec.lengths, measurement.kv_cache_bytes) {
            (Some(lengths), Some(kv_cache_bytes)) => Some(Generation {
                lengths,
                kv_layout: spec.kv_layout,
                prefill: LatencyStats::from_latencies(&measurement.begin_ns)?,
                kv_cache_bytes,
            }),
            _ => None,
        };
        let (metrics, sampler_error, evidence) = sampled(&context, spec.sample_interval, metrics);
        let judged = match spec.lengths {
            Some(l) => assess_generations(&measurement.latencies_ns, l.decode_steps()),
            None => assess(&measurement.latencies_ns),
        };
        let assessment = judged
            .with_evidence(&evidence, measurement.stop_note.as_deref())
            .with_refused_graphs(&measurement.graphs_refused);
        // Energy per sample: per generated token for a generation (its prefills' tokens included).
        let samples = match &generation {
            Some(g) => g.count() * (spec.batch * g.lengths.output) as u64,
            None => stats.iterations * spec.batch as u64,
        };
        let metric_summary = summarize(&metrics, samples);
        let sample_interval = spec.sample_interval.filter(|_| context.device.selected.is_some());
        Ok(Self {
            run_id: provenance::run_id(started_at),
            context,
            cell,
            fingerprint,
            started_at,
            finished_at: provenance::now(),
            subject: Subject::Model(model),
            mode: spec.mode,
            precision: Some(spec.precision),
            batch: spec.batch,
            seed: spec.seed,
            weights: spec.weights.as_ref().map(|p| p.display().to_string()),
            optimizer: (spec.mode == Mode::Train).then(|| describe(&spec.train)),
            master_weights: (spec.mode == Mode::Train && matches!(spec.precision, Precision::Bf16 | Precision::F16))
                .then(|| spec.train.master_weights.as_str()),
            kernels: spec.kernels,
            warmup_iterations: measurement.warmup_iterations,
            measurement,
            stats,
            uncertainty,
            assessment,
            evidence,
            metrics,
            metric_summary,
            sampler_error,
            sample_interval,
            generation,
        })
    }

    /// The row of a program's measured steps of one phase and size (`migprof exec`): `latencies_ns`
    /// in order, `items` each, after `warmup_steps` left out; the sampler's readings over the
    /// program's whole run, judged with the program's processes expected on the device.
    #[allow(clippy::too_many_arguments)]
    pub fn of_program(
        program: Program,
        mode: Mode,
        precision: Option<Precision>,
        steps: ProgramSteps,
        context: RunContext,
        started_at: DateTime<Utc>,
        metrics: Option<Result<Vec<Sample>>>,
        cell: CellIdentity,
        fingerprint: Fingerprint,
    ) -> Result<Self> {
        let latencies = &steps.latencies_ns;
        let stats = LatencyStats::from_latencies(latencies)?;
        let uncertainty = Uncertainty::of(latencies, steps.items);
        let (metrics, sampler_error, evidence) =
            sampled(&context, steps.sample_interval, metrics.unwrap_or(Ok(Vec::new())));
        let sample_interval = steps.sample_interval.filter(|_| context.device.selected.is_some());
        let assessment = assess(latencies).with_evidence(&evidence, None);
        let metric_summary = summarize(&metrics, stats.iterations * steps.items as u64);
        let measurement = Measurement {
            warmup_iterations: steps.warmup_steps,
            elapsed: Duration::from_nanos(latencies.iter().sum()),
            latencies_ns: steps.latencies_ns,
            loss_first: None,
            loss_last: None,
            stop_note: None,
            graphs_refused: Vec::new(),
            skipped_steps: None,
            loss_scale: None,
            begin_ns: Vec::new(),
            kv_cache_bytes: None,
        };
        Ok(Self {
            run_id: provenance::run_id(started_at),
            context,
            cell,
            fingerprint,
            started_at,
            finished_at: provenance::now(),
            subject: Subject::Program(program),
            mode,
            precision,
            batch: steps.items,
            seed: 0,
            weights: None,
            optimizer: None,
            master_weights: None,
            kernels: KernelOptions::default(),
            warmup_iterations: steps.warmup_steps,
            measurement,
            stats,
            uncertainty,
            assessment,
            evidence,
            metrics,
            metric_summary,
            sampler_error,
            sample_interval,
            generation: None,
        })
    }

    /// The precision as `--dtype` names it (`tf32`, or the dtype); `None` for a program that did not
    /// say.
    pub fn precision(&self) -> Option<&'static str> {
        self.precision.map(Precision::as_str)
    }

    /// `1000 / mean_latency_ms * batch`, samples per second.
    pub fn throughput(&self) -> f64 {
        self.stats.throughput(self.batch)
    }

    /// Samples per second over the measured wall-clock time; for a generation, generated tokens per
    /// second, prefills included.
    pub fn wall_throughput(&self) -> f64 {
        match &self.generation {
            Some(g) => wall_throughput(
                g.count() * g.lengths.output as u64,
                self.batch,
                self.measurement.elapsed,
            ),
            None => wall_throughput(self.stats.iterations, self.batch, self.measurement.elapsed),
        }
    }

    /// A generation's prompt tokens per second through the prefill (batch × prompt ÷ its mean time).
    pub fn prefill_tokens_per_s(&self) -> Option<f64> {
        self.generation
            .as_ref()
            .map(|g| g.prefill.throughput(self.batch * g.lengths.prompt))
    }

    pub fn sample_interval_ms(&self) -> Option<i64> {
        self.sample_interval.map(|d| d.as_millis() as i64)
    }

    /// Forward FLOPs per sample for inference, 3x that for training; for a generation, of a decoded
    /// token, averaged over the positions its decode steps attend to. `None` for a program.
    pub fn flops_per_sample(&self) -> Option<u64> {
        let model = self.subject.model()?;
        Some(match (self.mode, &self.generation, &model.decoder) {
            (Mode::Generate, Some(g), Some(d)) => {
                let steps = g.lengths.decode_steps();
                // Step i feeds the token at position prompt + i, attending to prompt + i + 1 tokens.
                let total: u64 = (0..steps).map(|i| d.flops_per_token(g.lengths.prompt + i + 1)).sum();
                total / steps.max(1) as u64
            }
            (Mode::Train, _, _) => model.train_flops_per_sample(),
            _ => model.flops_per_sample,
        })
    }
}

/// A program's measured steps of one phase and size, as [`Run::of_program`] takes them.
pub struct ProgramSteps {
    pub latencies_ns: Vec<u64>,
    pub items: usize,
    pub warmup_steps: u64,
    pub sample_interval: Option<Duration>,
}

/// The sampler's readings (none where it failed), why it failed, and what they say of the run.
fn sampled(
    context: &RunContext,
    interval: Option<Duration>,
    metrics: Result<Vec<Sample>>,
) -> (Vec<Sample>, Option<String>, Evidence) {
    let (metrics, sampler_error) = match metrics {
        Ok(m) => (m, None),
        Err(e) => (Vec::new(), Some(format!("{e:#}"))),
    };
    let evidence = match (&context.device.selected, interval, &sampler_error) {
        (None, _, _) => Evidence::none(Sampling::NotAGpu),
        (Some(_), None, _) => Evidence::none(Sampling::Off),
        (Some(_), Some(_), Some(e)) => Evidence::none(Sampling::Failed(e.clone())),
        (Some(_), Some(_), None) => Evidence::from_samples(&metrics, &context.expected),
    };
    (metrics, sampler_error, evidence)
}

fn describe(t: &workloads::TrainConfig) -> String {
    match t.optimizer {
        workloads::OptimizerKind::AdamW => format!("adamw(lr={}, weight_decay={})", t.lr, t.weight_decay),
        workloads::OptimizerKind::Sgd { momentum } => {
            format!("sgd(lr={}, momentum={momentum}, weight_decay={})", t.lr, t.weight_decay)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::run::measure::{Stop, Warmup};
    use crate::run::stats::tests::close;
    use crate::run::verdict::Verdict;
    use crate::testing::clock::{FakeClock, FakeStep};
    use std::time::Duration;

    pub fn context() -> RunContext {
        RunContext {
            invocation_id: "inv-test".into(),
            host: "testhost".into(),
            device: DeviceInfo {
                kind: "cpu",
                name: "Test CPU (2 threads)".into(),
                selected: None,
                emulation: None,
                memory_system: None,
                kernel_sms: None,
            },
            expected: Expected::this_process(),
            group: None,
        }
    }

    pub fn identity() -> CellIdentity {
        identity_with(Status::Ok)
    }

    pub fn identity_with(status: Status) -> CellIdentity {
        CellIdentity {
            sweep: None,
            target: "Test CPU".into(),
            cell_id: "0123456789abcdef".into(),
            status,
            concurrency_group: None,
            neighbours: Vec::new(),
            baseline: false,
            settings: None,
        }
    }

    pub fn spec(batch: usize, iters: u64) -> RunSpec {
        RunSpec {
            warmup: Warmup::Iterations(2),
            stop: Stop::Iterations(iters),
            seed: 1,
            ..RunSpec::new("resnet_tiny", Mode::Infer, Precision::F32, batch)
        }
    }

    /// A run measured on the fake 1 ms / 3 ms step.
    pub fn fake_run(batch: usize, iters: u64, tick: Duration) -> Run {
        let clock = FakeClock::with_tick(tick);
        let mut step = FakeStep::new(&clock, &[1.0, 3.0]);
        let spec = spec(batch, iters);
        let m = crate::run::measure::measure(
            &mut step,
            &clock,
            spec.warmup,
            spec.stop,
            &mut crate::run::measure::Unobserved,
        )
        .unwrap();
        let (_, info) = workloads::lookup("resnet_tiny").unwrap();
        Run::new(
            &spec,
            info,
            context(),
            provenance::now(),
            m,
            Ok(Vec::new()),
            identity(),
            Fingerprint::collect(None),
        )
        .unwrap()
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
        assert!(
            (run.throughput() - 1000.0 / 2.1 * 4.0).abs() < 1e-9,
            "{}",
            run.throughput()
        );
        assert!(
            (run.wall_throughput() - 120.0 / 0.0691).abs() < 1e-6,
            "{}",
            run.wall_throughput()
        );
    }

    #[test]
    fn a_refused_graph_capture_is_flagged_and_explained_and_leaves_the_verdict() {
        let clock = FakeClock::with_tick(Duration::ZERO);
        let mut step = FakeStep::new(&clock, &[1.0, 3.0]);
        let spec = spec(8, 30);
        let mut m = crate::run::measure::measure(
            &mut step,
            &clock,
            spec.warmup,
            spec.stop,
            &mut crate::run::measure::Unobserved,
        )
        .unwrap();
        m.graphs_refused = vec!["the step copies from host memory 2 time(s)".into()];
        let (_, info) = workloads::lookup("resnet_tiny").unwrap();
        let run = Run::new(
            &spec,
            info,
            context(),
            provenance::now(),
            m,
            Ok(Vec::new()),
            identity(),
            Fingerprint::collect(None),
        )
        .unwrap();
        assert_eq!(run.assessment.verdict, Verdict::Ok);
        assert!(
            run.assessment.flag_names().contains(&"graphs_refused"),
            "{:?}",
            run.assessment.flags
        );
        assert!(
            run.assessment.reason.contains("launched from the host")
                && run.assessment.reason.contains("copies from host memory"),
            "{}",
            run.assessment.reason
        );
        // Without refusals, no flag.
        assert!(!fake_run(8, 30, Duration::ZERO)
            .assessment
            .flag_names()
            .contains(&"graphs_refused"));
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
        let fwd = run.flops_per_sample().unwrap();
        run.mode = Mode::Train;
        assert_eq!(run.flops_per_sample(), Some(3 * fwd));
    }
}
