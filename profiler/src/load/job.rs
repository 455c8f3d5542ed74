//! One load job on an open device: the model built once, served at each rate asked for, or searched
//! for the highest rate within a p99 objective; every step's row written as soon as it is measured.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle_core::Device;
use workloads::{Batch, Mode, Workload};

use crate::device::OpenDevice;
use crate::load::arrival::arrivals;
use crate::load::record::{self, Capacity, JobIdentity, RowHead, SearchStep};
use crate::load::search::{search, SearchPlan, StepRunner};
use crate::load::serve::{drive, Batching, Objective, Schedule, Server};
use crate::load::settings::LoadSettings;
use crate::load::step::Step;
use crate::provenance;
use crate::run::fingerprint::Fingerprint;
use crate::run::measure::MonotonicClock;
use crate::run::record::{CellIdentity, RunContext};
use crate::run::RunSpec;

/// Which rates a job offers.
#[derive(Debug, Clone, PartialEq)]
pub enum Rates {
    /// One step per rate, in order.
    Fixed(Vec<f64>),
    /// The highest rate within the settings' objective, from a first guess (default: half the closed
    /// loop's rate at the max batch).
    Search { start: Option<f64> },
}

/// What a job found.
pub struct JobOutcome {
    pub steps: Vec<Step>,
    /// A search's capacity (`Some(None)`: nothing met the objective).
    pub capacity: Option<Option<f64>>,
}

/// The model behind the batcher: each batch's inputs copied from host memory to the device, as a
/// server receives them, then one inference, then a sync.
struct WorkloadServer {
    workload: Box<dyn Workload>,
    host: Batch,
    device: Device,
}

impl Server for WorkloadServer {
    fn serve(&mut self, n: usize) -> Result<()> {
        let batch = self.host.first(n)?.to_device(&self.device)?;
        let logits = self.workload.infer(&batch)?;
        self.device.synchronize()?;
        drop(logits);
        Ok(())
    }
}

/// What to serve and how: the model (inference at the max batch), the batcher and arrivals, the rates.
pub struct LoadJob<'a> {
    pub spec: &'a RunSpec,
    pub settings: &'a LoadSettings,
    pub rates: &'a Rates,
    /// Serve rates beyond [`OVERLOAD`] times the closed loop's, with a warning, instead of refusing.
    pub allow_overload: bool,
}

/// An offered rate above this many times what the model serves back to back measures only a queue
/// that grows until the step ends, and draws its whole schedule first: refused unless allowed.
pub const OVERLOAD: f64 = 10.0;

pub fn run(
    job: LoadJob,
    device: &OpenDevice,
    context: &RunContext,
    cell: &CellIdentity,
    out: &Path,
    log: &mut dyn Write,
) -> Result<JobOutcome> {
    let LoadJob {
        spec,
        settings,
        rates,
        allow_overload,
    } = job;
    anyhow::ensure!(spec.mode == Mode::Infer, "a load job serves inference");
    let pool_held_mib = crate::run::fingerprint::pool_held_mib(&device.device);
    let (workload, info) = spec.build_workload(&device.device)?;
    let host = workload
        .host_batch(settings.max_batch, spec.seed)
        .context("making the requests' inputs")?;
    let mut server = WorkloadServer {
        workload,
        host,
        device: device.device.clone(),
    };
    let closed_loop_qps = warm_up(&mut server, settings.max_batch)?;
    let times = match server.workload.steps_to_steady() {
        1 => "once".to_string(),
        n => format!("{n} times (its CUDA graph captured)"),
    };
    writeln!(
        log,
        "warm: every batch size 1..={} served {times}; closed loop at {} serves {closed_loop_qps:.1} requests/s",
        settings.max_batch, settings.max_batch
    )?;
    crate::run::execute::warn_of_refused_graphs(server.workload.as_ref(), &spec.model);
    if let Rates::Fixed(list) = rates {
        let limit = closed_loop_qps * OVERLOAD;
        let over: Vec<String> = list.iter().filter(|q| **q > limit).map(|q| q.to_string()).collect();
        if !over.is_empty() && !allow_overload {
            anyhow::bail!(
                "--qps {}: more than {OVERLOAD}× the {closed_loop_qps:.1} requests/s the model serves back to back at batch {}; such a step measures a queue that only grows. Offer at most {limit:.0}/s, or pass --allow-overload",
                over.join(","),
                settings.max_batch
            );
        }
        if !over.is_empty() {
            writeln!(
                log,
                "warning: --qps {} is more than {OVERLOAD}× the closed loop's rate; served as asked",
                over.join(",")
            )?;
        }
    }

    let fingerprint = Fingerprint {
        pool_held_mib,
        ..Fingerprint::collect(device.info.selected.as_ref())
    };
    if let Some(w) = fingerprint.pool_warning() {
        writeln!(log, "warning: {w}")?;
    }
    let id = JobIdentity {
        head: RowHead::of(context, cell, &device.info, &fingerprint, &info, spec),
        settings,
        server: None,
    };
    let sampling = device.info.selected.clone().zip(spec.sample_interval);
    let mut steps = Stepper {
        server,
        settings,
        id: &id,
        out,
        log,
        steps: Vec::new(),
        search: None,
        sampling,
        expected: &context.expected,
    };
    let capacity = match rates {
        Rates::Fixed(list) => {
            for &qps in list {
                steps.step(qps)?;
            }
            None
        }
        Rates::Search { start } => {
            let capacity_id = provenance::run_id(provenance::now());
            let started = provenance::now();
            // A search step holds at most four times its minimum of measured requests, whatever
            // its rate, and its warm-up's arrivals: the warm-up bounds the rate.
            let ceiling_qps = crate::run::limits::MAX_STEP_REQUESTS / settings.warmup_secs.max(1.0);
            steps.search = Some(SearchStep {
                capacity_id: capacity_id.clone(),
                index: 0,
            });
            let plan = SearchPlan {
                start_qps: start.unwrap_or(closed_loop_qps / 2.0).min(ceiling_qps),
                resolution: settings.resolution,
                floor_qps: (closed_loop_qps / 1000.0).max(0.1),
                max_steps: 40,
                ceiling_qps,
            };
            let outcome = search(&mut steps, plan)?;
            let p99_at_capacity_ms = outcome.capacity_qps.and_then(|c| {
                steps
                    .steps
                    .iter()
                    .rev()
                    .find(|s| s.offered_qps == c)
                    .map(|s| s.stats.p99_ns as f64 / 1e6)
            });
            let verdict = steps
                .steps
                .iter()
                .map(Step::verdict)
                .min()
                .unwrap_or(crate::load::step::StepVerdict::Ok);
            record::write_capacity(
                out,
                &id,
                &Capacity {
                    capacity_id: &capacity_id,
                    started,
                    outcome: &outcome,
                    closed_loop_qps,
                    p99_at_capacity_ms,
                    verdict: verdict.as_str(),
                },
            )?;
            let trust = if verdict == crate::load::step::StepVerdict::Ok {
                String::new()
            } else {
                format!("; verdict {}: see the steps' notes", verdict.as_str())
            };
            match outcome.capacity_qps {
                Some(c) => writeln!(
                    steps.log,
                    "capacity: {c:.1} requests/s within p99 {} ms ({} failed; {} steps{trust})",
                    settings.slo_p99_ms.unwrap_or_default(),
                    outcome.high.map_or("no rate".to_string(), |h| format!("{h:.1}")),
                    outcome.steps.len()
                )?,
                None => {
                    // The objective may be below what a lone request takes.
                    let fastest = steps
                        .steps
                        .iter()
                        .map(|s| s.service.p50_ms)
                        .fold(f64::INFINITY, f64::min);
                    writeln!(
                        steps.log,
                        "capacity: none: {}; a batch took {fastest:.2} ms at the lowest rate tried, and a request may wait up to --max-delay-ms {} for others: an objective near or below their sum cannot be met{trust}",
                        outcome.note.clone().unwrap_or_default(),
                        settings.max_delay_ms
                    )?
                }
            }
            Some(outcome.capacity_qps)
        }
    };
    let steps_done = std::mem::take(&mut steps.steps);
    drop(steps);
    workloads::memory::release_pooled(&device.device).context("releasing the job's GPU memory")?;
    device.neighbour_still_streams()?;
    Ok(JobOutcome {
        steps: steps_done,
        capacity,
    })
}

/// Serves every batch size until its steps are alike (each shape's first run chooses its kernels;
/// with CUDA graphs, the second captures its graph), then the max batch a few times: the closed
/// loop's rate at it, the ceiling of what any offered rate can be served at.
fn warm_up(server: &mut WorkloadServer, max_batch: usize) -> Result<f64> {
    for n in 1..=max_batch {
        for _ in 0..server.workload.steps_to_steady() {
            server.serve(n)?;
        }
    }
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        server.serve(max_batch)?;
        best = best.min(t.elapsed());
    }
    Ok(max_batch as f64 / best.as_secs_f64().max(1e-9))
}

/// Runs steps and writes each row as it is measured.
struct Stepper<'a> {
    server: WorkloadServer,
    settings: &'a LoadSettings,
    id: &'a JobIdentity<'a>,
    out: &'a Path,
    log: &'a mut dyn Write,
    steps: Vec<Step>,
    search: Option<SearchStep>,
    /// The GPU sampler beside each step, when the device is a GPU and sampling is on.
    sampling: Option<(crate::gpu::Selected, Duration)>,
    expected: &'a crate::run::evidence::Expected,
}

impl Stepper<'_> {
    fn step(&mut self, qps: f64) -> Result<&Step> {
        let s = self.settings;
        let objective = match (&self.search, s.slo_p99_ms) {
            (Some(_), Some(slo)) => Some(Objective {
                p99: Duration::from_secs_f64(slo / 1e3),
                min_requests: s.min_requests,
            }),
            _ => None,
        };
        // A search step may run on to four times its minimum while its p99's interval still holds
        // the objective.
        let measured = match objective {
            Some(o) => o.min_requests * 4,
            None => (qps * s.duration_secs).ceil() as usize,
        };
        let warmup_requests = (qps * s.warmup_secs).ceil() as usize;
        // Each step its own draw of the same process: a rate's schedule does not depend on the
        // steps before it.
        let seed = s.arrival_seed ^ qps.to_bits();
        let count = warmup_requests + measured.max(1);
        // Drawn as the step goes (load::serve::Schedule), never held whole.
        let mut arrivals = Schedule::new(arrivals(s.arrival, qps, seed), count);
        let warmup = crate::load::arrival::arrivals(s.arrival, qps, seed)
            .nth(warmup_requests)
            .filter(|_| warmup_requests < count)
            .unwrap_or_default();
        let batching = Batching {
            max_batch: s.max_batch,
            max_delay: Duration::from_secs_f64(s.max_delay_ms / 1e3),
        };
        let started = provenance::now();
        let server = &mut self.server;
        let (served, evidence, readings) = crate::run::execute::beside_sampler(
            self.sampling.clone(),
            self.id.head.device.selected.is_some(),
            self.expected,
            || {
                drive(
                    server,
                    &MonotonicClock::new(),
                    &mut arrivals,
                    warmup,
                    batching,
                    objective,
                )
            },
        )?;
        let step = Step::with_evidence(
            qps,
            served,
            s.slo_p99_ms.map(|ms| Duration::from_secs_f64(ms / 1e3)),
            evidence,
            &readings,
        )?;
        let load_id = provenance::run_id(started);
        record::write_step(self.out, self.id, &load_id, started, &step, self.search.as_ref(), None)?;
        writeln!(self.log, "{}", step.describe())?;
        if let Some(n) = &step.note {
            writeln!(self.log, "  note: {n}")?;
        }
        if let Some(search) = self.search.as_mut() {
            search.index += 1;
        }
        self.steps.push(step);
        Ok(self.steps.last().expect("just pushed"))
    }
}

impl StepRunner for Stepper<'_> {
    fn run_step(&mut self, qps: f64) -> Result<bool> {
        Ok(self.step(qps)?.meets.unwrap_or(false))
    }
}
