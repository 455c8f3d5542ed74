//! One load job on a user's server: each concurrency and each rate asked for, or a search for the
//! highest rate within a p99 objective, every step beside the GPU sampler and written as a `load`
//! row naming the server as soon as it is measured.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};

use super::drive::{drive, ClientSide, Load};
use super::endpoint::Endpoint;
use super::Exchange;
use crate::device::DeviceInfo;
use crate::load::record::{self, Capacity, ClientRow, JobIdentity, RowHead, SearchStep, ServerRow};
use crate::load::search::{search, SearchPlan, StepRunner};
use crate::load::settings::LoadSettings;
use crate::load::step::{Step, StepVerdict};
use crate::provenance;
use crate::run::evidence::Expected;
use crate::run::fingerprint::Fingerprint;
use crate::run::record::{CellIdentity, RunContext, Status};

/// The family of a user's server's rows.
pub const SERVER_FAMILY: &str = "server";

/// What every job on a user's server shares: where it answers, the steps asked for, and what
/// watches it.
pub struct Plan<'a> {
    pub endpoint: &'a Endpoint,
    pub concurrencies: &'a [usize],
    /// Open-loop rates, after the concurrencies.
    pub rates: &'a [f64],
    /// Search for the capacity within the objective, starting here (`None`: from the rate a
    /// concurrency reached).
    pub search: Option<Option<f64>>,
    /// Requests in flight at most at a rate.
    pub max_in_flight: usize,
    /// The server's processes, where migprof started it: checked on the target through NVML.
    pub server_pids: Option<&'a dyn Fn() -> BTreeSet<u32>>,
    /// The GPU sampler's interval; `None`: off.
    pub sample_interval: Option<Duration>,
    /// A sweep's cell, whose identity the rows carry; `None`: `migprof load`'s own.
    pub cell: Option<&'a CellIdentity>,
}

/// What to load and how.
pub struct ServerJob<'a> {
    pub plan: Plan<'a>,
    pub exchange: &'a dyn Exchange,
    pub server: &'a ServerRow,
    /// The served model's name, as the server names it.
    pub model: &'a str,
    /// Warm-up, duration, arrivals, objective and search bounds.
    pub settings: &'a LoadSettings,
}

/// The steps measured, and a search's capacity (`Some(None)`: nothing met the objective).
pub struct ServerOutcome {
    pub steps: Vec<Step>,
    pub capacity: Option<Option<f64>>,
}

/// Runs the job on `device` (as `context` has it), writing under `out`.
pub fn run(
    job: &ServerJob,
    device: &DeviceInfo,
    context: &RunContext,
    out: &Path,
    log: &mut dyn Write,
) -> Result<ServerOutcome> {
    let fingerprint = Fingerprint::collect(device.selected.as_ref());
    let cell = job.plan.cell.cloned().unwrap_or_else(|| {
        own_cell(
            cell_id(job, &device.name),
            device,
            job.settings.warmup_secs,
            job.settings.duration_secs,
            job.plan.sample_interval,
        )
    });
    let id = JobIdentity {
        head: RowHead {
            invocation_id: &context.invocation_id,
            host: &context.host,
            cell: &cell,
            device,
            fingerprint: &fingerprint,
            model: job.model,
            family: SERVER_FAMILY,
            seq_len: None,
            precision: "",
            kernel_options: String::new(),
            seed: job.settings.arrival_seed,
            sample_interval: job.plan.sample_interval,
        },
        settings: job.settings,
        server: Some(job.server),
    };
    let mut stepper = Stepper {
        job,
        id: &id,
        out,
        log,
        steps: Vec::new(),
        search: None,
        watch: Watch::new(job.plan.server_pids, device, job.plan.sample_interval, context),
    };
    let capacity = run_steps(&job.plan, &mut stepper)?;
    Ok(ServerOutcome {
        steps: stepper.steps,
        capacity,
    })
}

/// How a job measures a step at a load, and searches.
pub(super) trait Stepping {
    /// The load of an open-loop step at `qps`.
    fn rate(&self, qps: f64) -> Load;
    /// Measures one step and writes its rows.
    fn measure(&mut self, load: Load) -> Result<()>;
    /// Searches the capacity from `start` and writes its row: the capacity found, if any.
    fn capacity(&mut self, start: Option<f64>) -> Result<Option<f64>>;
}

/// Runs `plan`'s concurrencies, then its rates, then its search: the search's capacity
/// (`Some(None)`: nothing met the objective), where it had one.
pub(super) fn run_steps(plan: &Plan, stepper: &mut impl Stepping) -> Result<Option<Option<f64>>> {
    for &n in plan.concurrencies {
        stepper.measure(Load::Concurrency(n))?;
    }
    for &qps in plan.rates {
        let load = stepper.rate(qps);
        stepper.measure(load)?;
    }
    plan.search.map(|start| stepper.capacity(start)).transpose()
}

/// A job's steps in words: its concurrencies, its rates and its search.
pub fn steps_described(concurrencies: &[usize], rates: &[f64], search_within_ms: Option<f64>) -> String {
    let list = |v: Vec<String>| v.join(",");
    let mut parts = Vec::new();
    if !concurrencies.is_empty() {
        parts.push(format!(
            "concurrency {}",
            list(concurrencies.iter().map(usize::to_string).collect())
        ));
    }
    if !rates.is_empty() {
        parts.push(format!(
            "{} requests/s",
            list(rates.iter().map(f64::to_string).collect())
        ));
    }
    if let Some(slo) = search_within_ms {
        parts.push(format!("capacity within p99 {slo} ms"));
    }
    parts.join("; ")
}

/// A step none of whose measured requests was answered: what the server said instead.
fn none_answered(load: &Load, client: &ClientSide) -> anyhow::Error {
    anyhow::anyhow!(
        "{}: no measured request was answered ({} failed: {}); the steps before it are kept",
        load.describe(),
        client.failed,
        client
            .reasons()
            .unwrap_or_else(|| "none was sent: lengthen --duration".to_string())
    )
}

/// The client's columns of a step's row.
fn client_row(load: &Load, client: &ClientSide, on_target: Option<bool>) -> ClientRow {
    ClientRow {
        concurrency: load.concurrency(),
        failed: client.failed,
        failures: client.reasons(),
        overhead_p50_ms: client.overhead_p50_ms,
        overhead_p99_ms: client.overhead_p99_ms,
        late: client.late,
        on_target,
    }
}

/// A step's line for the terminal.
fn describe(load: &Load, step: &Step, client: &ClientSide, batch: usize) -> String {
    let ms = |ns: u64| ns as f64 / 1e6;
    format!(
        "{}: {:.1} requests/s ({:.1} samples/s), {} answered{}: p50 {:.2} ms, p99 {:.2} ms{}; client overhead p50 {:.3} ms",
        load.describe(),
        step.achieved_qps,
        step.achieved_qps * batch as f64,
        step.served.latencies_ns.len(),
        match client.failed {
            0 => String::new(),
            n => format!(", {n} failed"),
        },
        ms(step.stats.p50_ns),
        ms(step.stats.p99_ns),
        match &step.p99_interval {
            Ok(i) => format!(" [{:.2}, {:.2}]", i.low, i.high),
            Err(_) => String::new(),
        },
        client.overhead_p50_ms
    )
}

/// The cell of a server's job: the endpoint, the model, the request and the target.
fn cell_id(job: &ServerJob, target: &str) -> String {
    let s = job.server;
    let fields = format!(
        "server;v1;protocol={};endpoint={};command={};model={};inputs={};encoding={};target={target}",
        s.protocol,
        s.endpoint,
        s.command.as_deref().unwrap_or(""),
        job.model,
        s.inputs,
        s.encoding
    );
    crate::run::record::id_of(&fields)
}

struct Stepper<'a> {
    job: &'a ServerJob<'a>,
    id: &'a JobIdentity<'a>,
    out: &'a Path,
    log: &'a mut dyn Write,
    steps: Vec<Step>,
    search: Option<SearchStep>,
    watch: Watch<'a>,
}

/// The identity of `migprof load --endpoint`'s own cell (a sweep's cells bring theirs).
pub(super) fn own_cell(
    cell_id: String,
    device: &DeviceInfo,
    warmup_secs: f64,
    duration_secs: f64,
    sample_interval: Option<Duration>,
) -> CellIdentity {
    CellIdentity {
        sweep: None,
        target: device.name.clone(),
        cell_id,
        status: Status::Ok,
        concurrency_group: None,
        neighbours: Vec::new(),
        baseline: false,
        settings: Some(format!(
            "warmup_secs={warmup_secs};duration_secs={duration_secs};sample_interval_ms={}",
            sample_interval.map_or(0, |d| d.as_millis())
        )),
    }
}

/// Whose work on the target a step expects: the server's processes, which compute there on
/// purpose and do not make a step shared.
pub(super) struct Watch<'a> {
    /// The processes of the server migprof started.
    server_pids: Option<&'a dyn Fn() -> BTreeSet<u32>>,
    /// A server migprof did not start: the processes computing on the target before its first
    /// step, taken as the server's (NVML's pids, whatever namespace they are of).
    already: BTreeSet<u32>,
    expected: &'a Expected,
}

impl<'a> Watch<'a> {
    pub(super) fn new(
        server_pids: Option<&'a dyn Fn() -> BTreeSet<u32>>,
        device: &DeviceInfo,
        sample_interval: Option<Duration>,
        context: &'a RunContext,
    ) -> Watch<'a> {
        Watch {
            server_pids,
            already: match server_pids {
                Some(_) => BTreeSet::new(),
                None => computing_now(device.selected.clone().zip(sample_interval), &context.expected),
            },
            expected: &context.expected,
        }
    }

    /// What a step expects on the target now, and the server's processes now.
    pub(super) fn expected(&self) -> (Expected, BTreeSet<u32>) {
        let server_pids = self.server_pids.map(|pids| pids()).unwrap_or_default();
        let expected = Expected {
            pids: self
                .expected
                .pids
                .iter()
                .copied()
                .chain(server_pids.iter().copied())
                .chain(self.already.iter().copied())
                .collect(),
            mps_server: self.expected.mps_server,
        };
        (expected, server_pids)
    }

    /// Whether NVML saw the server's processes (`pids`) among a step's readings; `None` where it
    /// could not tell (no readings, or a server migprof did not start).
    pub(super) fn on_target(&self, readings: &[crate::gpu::sampler::Sample], pids: &BTreeSet<u32>) -> Option<bool> {
        match (self.server_pids, readings.is_empty()) {
            (Some(_), false) => Some(crate::program::rows::on_device(readings, pids).1 > 0),
            _ => None,
        }
    }
}

/// What a step says where NVML did not see the server on the target.
pub(super) const NOT_ON_TARGET: &str =
    "NVML saw none of the server's processes on the target: it may compute elsewhere";

/// The processes computing on the device of `sampling` now, as the sampler reads them for a moment.
fn computing_now(sampling: Option<(crate::gpu::Selected, Duration)>, expected: &Expected) -> BTreeSet<u32> {
    let Some((selected, _)) = sampling else {
        return BTreeSet::new();
    };
    let read = crate::run::execute::beside_sampler(Some((selected, Duration::from_millis(50))), true, expected, || {
        std::thread::sleep(Duration::from_millis(300));
        Ok(())
    });
    read.map(|(_, _, readings)| {
        readings
            .iter()
            .flat_map(|r| r.compute_processes.iter().flatten().map(|p| p.pid))
            .collect()
    })
    .unwrap_or_default()
}

impl Stepper<'_> {
    fn step(&mut self, load: Load) -> Result<&Step> {
        let s = self.job.settings;
        let device = self.id.head.device;
        let sampling = device.selected.clone().zip(self.job.plan.sample_interval);
        let (expected, server_pids) = self.watch.expected();
        let started = provenance::now();
        let (driven, evidence, readings) =
            crate::run::execute::beside_sampler(sampling, device.selected.is_some(), &expected, || {
                Ok(drive(
                    self.job.exchange,
                    self.job.plan.endpoint,
                    load,
                    Duration::from_secs_f64(s.warmup_secs),
                    Duration::from_secs_f64(s.duration_secs),
                ))
            })?;
        let client = driven.client_side();
        let served = driven.served();
        if served.latencies_ns.is_empty() {
            return Err(none_answered(&load, &client));
        }
        let offered = load.offered_qps().unwrap_or(0.0);
        let slo = s.slo_p99_ms.map(|ms| Duration::from_secs_f64(ms / 1e3));
        let mut step = Step::with_evidence(offered, served, slo, evidence, &readings)?;
        let mut notes: Vec<String> = client.notes(&load);
        notes.extend(step.note.take());
        let on_target = self.watch.on_target(&readings, &server_pids);
        if on_target == Some(false) {
            notes.push(NOT_ON_TARGET.to_string());
        }
        step.note = (!notes.is_empty()).then(|| notes.join("; "));
        let row = client_row(&load, &client, on_target);
        let load_id = provenance::run_id(started);
        record::write_step(
            self.out,
            self.id,
            &load_id,
            started,
            &step,
            self.search.as_ref(),
            Some(&row),
        )?;
        writeln!(
            self.log,
            "{}",
            describe(&load, &step, &client, self.job.exchange.batch())
        )?;
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

impl Stepping for Stepper<'_> {
    fn rate(&self, qps: f64) -> Load {
        let s = self.job.settings;
        Load::Rate {
            qps,
            arrival: s.arrival,
            // Each rate its own draw of the same process, as migprof's own load steps.
            seed: s.arrival_seed ^ qps.to_bits(),
            clients: self.job.plan.max_in_flight,
        }
    }

    fn measure(&mut self, load: Load) -> Result<()> {
        self.step(load).map(|_| ())
    }

    /// The highest rate whose p99 meets the objective; its `capacity` row written.
    fn capacity(&mut self, start: Option<f64>) -> Result<Option<f64>> {
        let s = self.job.settings;
        let Some(slo) = s.slo_p99_ms else {
            bail!("a capacity search needs its objective: --slo-p99-ms");
        };
        // What one client pushes through back to back: the search's first guess and its floor.
        // Concurrency steps come first: the first step's rate, where it was concurrency 1.
        let closed = match (self.job.plan.concurrencies.first(), self.steps.first()) {
            (Some(1), Some(step)) => step.achieved_qps,
            _ => self.step(Load::Concurrency(1))?.achieved_qps,
        };
        let capacity_id = provenance::run_id(provenance::now());
        let started = provenance::now();
        self.search = Some(SearchStep {
            capacity_id: capacity_id.clone(),
            index: 0,
        });
        let first = self.steps.len();
        let plan = SearchPlan {
            start_qps: start.unwrap_or(closed),
            resolution: s.resolution,
            floor_qps: (closed / 1000.0).max(0.1),
            max_steps: 40,
            ceiling_qps: (self.job.plan.max_in_flight as f64 * closed * 4.0).max(closed * 2.0),
        };
        let outcome = search(self, plan)?;
        let searched = &self.steps[first..];
        let p99_at_capacity_ms = outcome.capacity_qps.and_then(|c| {
            searched
                .iter()
                .rev()
                .find(|st| st.offered_qps == c)
                .map(|st| st.stats.p99_ns as f64 / 1e6)
        });
        let verdict = searched.iter().map(Step::verdict).min().unwrap_or(StepVerdict::Ok);
        record::write_capacity(
            self.out,
            self.id,
            &Capacity {
                capacity_id: &capacity_id,
                started,
                outcome: &outcome,
                closed_loop_qps: closed,
                p99_at_capacity_ms,
                verdict: verdict.as_str(),
            },
        )?;
        match outcome.capacity_qps {
            Some(c) => writeln!(
                self.log,
                "capacity: {c:.1} requests/s within p99 {slo} ms ({} steps)",
                outcome.steps.len()
            )?,
            None => writeln!(
                self.log,
                "capacity: none within p99 {slo} ms: {}",
                outcome.note.clone().unwrap_or_default()
            )?,
        }
        self.search = None;
        Ok(outcome.capacity_qps)
    }
}

impl StepRunner for Stepper<'_> {
    fn run_step(&mut self, qps: f64) -> Result<bool> {
        let load = self.rate(qps);
        Ok(self.step(load)?.meets.unwrap_or(false))
    }
}
