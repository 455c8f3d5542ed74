//! One load job on a user's language-model server: each concurrency and each rate asked for, or a
//! search for the highest rate within both objectives (TTFT and TPOT p99), every step beside the GPU
//! sampler and written to the `serve` tables as soon as it is measured, as migprof's own serving
//! engine's steps are.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};

use super::drive::{run_clients, Load};
use super::generation::{GeneratedStep, Generation};
use super::job::{own_cell, run_steps, Plan, Stepping, Watch, NOT_ON_TARGET};
use super::openai::Requests;
use crate::device::DeviceInfo;
use crate::load::generation_record::{self, GenerationServer, ServeIdentity, ServedStep};
use crate::load::record::RowHead;
use crate::load::search::{search, SearchPlan, StepRunner};
use crate::load::settings::ServeSettings;
use crate::load::tokens::{meets, GenerationSummary, Percentiles};
use crate::provenance;
use crate::run::fingerprint::Fingerprint;
use crate::run::record::RunContext;

/// What to load and how.
pub struct GenerationJob<'a> {
    pub plan: Plan<'a>,
    pub requests: &'a Requests,
    pub server: &'a GenerationServer,
    /// Lengths, arrivals, warm-up, duration, drain, the objectives and the search's bounds (the
    /// batcher's and the cache's settings are the server's own, not these).
    pub settings: &'a ServeSettings,
}

/// The steps measured (the rate each offered, `None` at a concurrency), and a search's capacity
/// (`Some(None)`: nothing met both objectives).
pub struct GenerationOutcome {
    pub steps: Vec<(Option<f64>, GenerationSummary)>,
    pub capacity: Option<Option<f64>>,
}

/// Concurrency a search measures first where the job has none, for its first guess of a rate.
const SEARCH_CONCURRENCY: usize = 16;

/// Runs the job on `device` (as `context` has it), writing under `out`.
pub fn run(
    job: &GenerationJob,
    device: &DeviceInfo,
    context: &RunContext,
    out: &Path,
    log: &mut dyn Write,
) -> Result<GenerationOutcome> {
    let s = job.settings;
    let fingerprint = Fingerprint::collect(device.selected.as_ref());
    let cell = job.plan.cell.cloned().unwrap_or_else(|| {
        own_cell(
            cell_id(job, &device.name),
            device,
            s.warmup_secs,
            s.duration_secs,
            job.plan.sample_interval,
        )
    });
    let id = ServeIdentity {
        head: RowHead {
            invocation_id: &context.invocation_id,
            host: &context.host,
            cell: &cell,
            device,
            fingerprint: &fingerprint,
            model: &job.requests.model,
            family: super::job::SERVER_FAMILY,
            seq_len: None,
            precision: "",
            kernel_options: String::new(),
            seed: s.arrival_seed,
            sample_interval: job.plan.sample_interval,
        },
        settings: s,
        own: None,
        server: Some(job.server),
    };
    let mut stepper = Stepper {
        job,
        id: &id,
        out,
        log,
        search: None,
        steps: Vec::new(),
        watch: Watch::new(job.plan.server_pids, device, job.plan.sample_interval, context),
        prompt_salt: rand::random(),
    };
    let capacity = run_steps(&job.plan, &mut stepper)?;
    Ok(GenerationOutcome {
        steps: stepper.steps,
        capacity,
    })
}

/// The cell of a server's job: the endpoint, the command, the model, the requests and the target.
fn cell_id(job: &GenerationJob, target: &str) -> String {
    let s = job.server;
    crate::run::record::id_of(&format!(
        "server;v1;protocol={};endpoint={};command={};model={};api={};prompt_form={};enforced={};target={target}",
        s.protocol,
        s.endpoint,
        s.command.as_deref().unwrap_or(""),
        job.requests.model,
        s.api,
        s.prompt_form,
        s.output_enforced
    ))
}

struct Stepper<'a> {
    job: &'a GenerationJob<'a>,
    id: &'a ServeIdentity<'a>,
    out: &'a Path,
    log: &'a mut dyn Write,
    /// A search's id and the index of its next step.
    search: Option<(String, usize)>,
    steps: Vec<(Option<f64>, GenerationSummary)>,
    watch: Watch<'a>,
    /// This job's own: the steps' prompt seeds derive from it.
    prompt_salt: u64,
}

impl Stepper<'_> {
    /// Measures one step and writes its rows: its summary and whether it met both objectives.
    fn step(&mut self, load: Load) -> Result<(&GenerationSummary, Option<bool>)> {
        let s = self.job.settings;
        let device = self.id.head.device;
        let sampling = device.selected.clone().zip(self.job.plan.sample_interval);
        let (expected, server_pids) = self.watch.expected();
        // The step's own prompts: drawn from a seed no earlier step or job had.
        let prompt_seed = self.prompt_salt ^ (self.steps.len() as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let generation = Generation::new(self.job.requests, s.prompt, s.output, s.arrival_seed, prompt_seed);
        let duration = Duration::from_secs_f64(s.duration_secs);
        let started = provenance::now();
        let (sent, evidence, readings) =
            crate::run::execute::beside_sampler(sampling, device.selected.is_some(), &expected, || {
                Ok(run_clients(&generation, self.job.plan.endpoint, load, duration))
            })?;
        let step = GeneratedStep::new(
            sent,
            Duration::from_secs_f64(s.warmup_secs),
            duration,
            Duration::from_secs_f64(s.drain_secs),
        );
        let (served, details) = step.served();
        let summary = GenerationSummary::of(&served, step.warmup, s.slo());
        let client = step.client();
        measured_anything(&load, s, &summary, &client, self.job.requests.enforce_length)?;
        let met = meets(s.slo(), &summary);
        let mut notes = client.notes(&load, self.job.requests.enforce_length);
        notes.extend(served_notes(s, &served, &summary, step.warmup, client.failed));
        notes.extend(evidence.describe());
        let on_target = self.watch.on_target(&readings, &server_pids);
        if on_target == Some(false) {
            notes.push(NOT_ON_TARGET.to_string());
        }
        let finished = served.requests.iter().filter(|r| r.finished()).count() as u64;
        let metrics = crate::gpu::sampler::summarize(&readings, finished);
        let offered = load.offered_qps();
        let row = client.row(&load, on_target, details);
        let served_step = ServedStep {
            offered_qps: offered,
            served: &served,
            summary: &summary,
            start: Duration::ZERO,
            warmup: step.warmup,
            meets: met,
            evidence: &evidence,
            metrics: &metrics,
            note: (!notes.is_empty()).then(|| notes.join("; ")),
            server: Some(&row),
        };
        let serve_id = provenance::run_id(started);
        generation_record::write_step(
            self.out,
            self.id,
            &serve_id,
            started,
            &served_step,
            self.search.as_ref().map(|(c, i)| (c.as_str(), *i)),
        )?;
        writeln!(self.log, "{}", describe(&load, &summary, met, client.failed))?;
        if let Some(n) = &served_step.note {
            writeln!(self.log, "  note: {n}")?;
        }
        if let Some((_, i)) = self.search.as_mut() {
            *i += 1;
        }
        self.steps.push((offered, summary));
        let (_, summary) = self.steps.last().expect("just pushed");
        Ok((summary, met))
    }
}

impl Stepping for Stepper<'_> {
    fn rate(&self, qps: f64) -> Load {
        Load::Rate {
            qps,
            arrival: self.job.settings.arrival,
            // Every rate offers the same requests at its own pace, as migprof's engine's steps do.
            seed: self.job.settings.arrival_seed,
            clients: self.job.plan.max_in_flight,
        }
    }

    fn measure(&mut self, load: Load) -> Result<()> {
        self.step(load).map(|_| ())
    }

    /// The highest rate that meets both objectives; its `serve_capacity` row written.
    fn capacity(&mut self, start: Option<f64>) -> Result<Option<f64>> {
        let s = self.job.settings;
        if s.slo().is_none() {
            bail!("a capacity search needs both objectives: --slo-ttft-p99-ms and --slo-tpot-p99-ms");
        }
        // The first guess: the rate the job's highest concurrency reached (its steps come first),
        // measured now where the job has none.
        let concurrencies = self.job.plan.concurrencies;
        let highest = (0..concurrencies.len()).max_by_key(|&i| concurrencies[i]);
        let first = match (start, highest) {
            (Some(qps), _) => qps,
            (None, Some(i)) => self.steps[i].1.request_rate,
            (None, None) => {
                let n = SEARCH_CONCURRENCY.min(self.job.plan.max_in_flight);
                self.step(Load::Concurrency(n))?.0.request_rate
            }
        };
        let capacity_id = provenance::run_id(provenance::now());
        let started = provenance::now();
        self.search = Some((capacity_id.clone(), 0));
        let ceiling_qps = crate::run::limits::MAX_STEP_REQUESTS / s.duration_secs;
        let plan = SearchPlan {
            start_qps: first.max(0.01).min(ceiling_qps),
            resolution: s.resolution,
            floor_qps: (first / 1000.0).max(0.01),
            max_steps: s.max_steps,
            ceiling_qps,
        };
        let outcome = search(self, plan)?;
        generation_record::write_capacity(self.out, self.id, &capacity_id, started, &outcome)?;
        match outcome.capacity_qps {
            Some(c) => writeln!(
                self.log,
                "capacity: {c:.2} requests/s within TTFT p99 {} ms and TPOT p99 {} ms ({} steps{})",
                s.slo_ttft_p99_ms.unwrap_or_default(),
                s.slo_tpot_p99_ms.unwrap_or_default(),
                outcome.steps.len(),
                outcome.note.as_ref().map_or(String::new(), |n| format!("; {n}"))
            )?,
            None => writeln!(self.log, "capacity: none: {}", outcome.note.clone().unwrap_or_default())?,
        }
        self.search = None;
        Ok(outcome.capacity_qps)
    }
}

impl StepRunner for Stepper<'_> {
    fn run_step(&mut self, qps: f64) -> Result<bool> {
        let load = self.rate(qps);
        Ok(self.step(load)?.1.unwrap_or(false))
    }
}

/// A step that measured nothing stops the job, saying why (the steps before it are kept).
fn measured_anything(
    load: &Load,
    s: &ServeSettings,
    summary: &GenerationSummary,
    client: &super::generation::ClientSummary,
    enforced: bool,
) -> Result<()> {
    if summary.requests == 0 {
        bail!(
            "{}: no request was due after the {} s warm-up of a {} s step: lengthen --duration",
            load.describe(),
            s.warmup_secs,
            s.duration_secs
        );
    }
    if summary.finished == 0 {
        bail!(
            "{}: none of {} measured request(s) finished ({}); the steps before it are kept",
            load.describe(),
            summary.requests,
            client.notes(load, enforced).join("; ")
        );
    }
    Ok(())
}

/// What a step says of its requests beyond its client's side: refusals, requests unfinished at the
/// drain's end, a queue that grows.
fn served_notes(
    s: &ServeSettings,
    served: &crate::load::tokens::GenerationServed,
    summary: &GenerationSummary,
    warmup: Duration,
    failed: usize,
) -> Vec<String> {
    let mut notes = Vec::new();
    if summary.refused > 0 {
        let why = served
            .requests
            .iter()
            .filter(|r| r.arrival >= warmup)
            .find_map(|r| r.refused.clone())
            .unwrap_or_default();
        notes.push(format!(
            "the server refused {} of {} measured request(s): {why}",
            summary.refused, summary.requests
        ));
    }
    let unfinished = summary.requests - summary.finished - summary.refused - failed;
    if unfinished > 0 {
        notes.push(format!(
            "{unfinished} of {} measured request(s) did not finish within the step's {} s and {} s of drain",
            summary.requests, s.duration_secs, s.drain_secs
        ));
    }
    let growth_ms = summary.ttft_growth_over_horizon_ms();
    if growth_ms > 0.0 {
        notes.push(format!(
            "TTFT grew {:.2} ms per second of arrivals: at this load the queue grows, and its p99 would be {growth_ms:.0} ms higher after {} s",
            summary.ttft_growth * 1e3,
            crate::load::serve::GROWTH_HORIZON.as_secs()
        ));
    }
    notes
}

/// A step's line for the terminal: the load, what finished, the rates and the objectives'
/// percentiles.
fn describe(load: &Load, s: &GenerationSummary, met: Option<bool>, failed: usize) -> String {
    let p = |p: &Option<Percentiles>| {
        p.as_ref().map_or("-".to_string(), |p| {
            format!("p50 {:.1} p99 {:.1} ms", p.p50_ms, p.p99_ms)
        })
    };
    format!(
        "{}: {} of {} finished{}, {:.2} requests/s, {:.0} output tokens/s; TTFT {}; TPOT {}; ITL {}{}",
        load.describe(),
        s.finished,
        s.requests,
        match failed {
            0 => String::new(),
            n => format!(" ({n} failed)"),
        },
        s.request_rate,
        s.output_token_rate,
        p(&s.ttft),
        p(&s.tpot),
        p(&s.itl),
        match met {
            Some(true) => ", meets both objectives",
            Some(false) => ", misses an objective",
            None => "",
        }
    )
}
