//! One serving job for a language model on an open device: the model built once with a paged KV
//! cache sized to the target's memory, then served under open-loop load by the continuous batcher
//! ([`super::continuous`]) at each rate asked for, or searched for the highest rate within both
//! objectives (TTFT and TPOT); every step's rows written as soon as it is measured.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use workloads::serving::{PagedModel, Prefill};

use super::continuous::{Budget, Iteration};
use super::generation_record::{CacheSize, ClosedLoop, ServedStep};
use super::lengths::LengthDist;
use super::search::{search, SearchPlan, StepRunner};
use super::settings::ServeSettings;
use super::tokens::{drive, Engine, GenerationSummary, StepPlan};
use crate::device::OpenDevice;
use crate::run::measure::MonotonicClock;
use crate::run::record::{CellIdentity, RunContext};
use crate::run::RunSpec;

/// The steps' plan: the settings over the batcher's budget.
fn plan(s: &ServeSettings, budget: Budget) -> StepPlan {
    StepPlan {
        budget,
        arrival: s.arrival,
        prompt: s.prompt,
        output: s.output,
        duration: Duration::from_secs_f64(s.duration_secs),
        warmup: Duration::from_secs_f64(s.warmup_secs),
        drain: Duration::from_secs_f64(s.drain_secs),
        slo: s.slo(),
        seed: s.arrival_seed,
    }
}

/// The continuous batcher's iterations run on a real model over its paged cache.
pub struct ModelEngine {
    pub model: PagedModel,
}

impl Engine for ModelEngine {
    fn run(&mut self, it: &Iteration) -> Result<()> {
        for id in &it.preempted {
            self.model.preempt(*id);
        }
        let prefills: Vec<Prefill> = it
            .prefills
            .iter()
            .map(|c| Prefill {
                id: c.id,
                start: c.start as usize,
                len: c.len as usize,
                last: c.last,
            })
            .collect();
        // The tokens are read back to the host: the iteration is over when they are out.
        self.model.run(&prefills, &it.decodes)?;
        Ok(())
    }

    fn finished(&mut self, id: usize) {
        self.model.finish(id);
    }

    fn reset(&mut self) {
        self.model.clear();
    }
}

/// On the CPU, without `--kv-blocks`: blocks for `max_seqs` sequences of the model's whole length,
/// at most this many bytes of cache.
const CPU_CACHE_BYTES: usize = 1 << 30;

/// A serving job's preflight: `--kv-blocks` whose cache is larger than the target could hold (a
/// GPU's or slice's memory, the host's available memory on the CPU) is refused before the model or
/// the cache is made.
pub fn preflight(spec: &RunSpec, settings: &ServeSettings, device: &OpenDevice) -> Result<()> {
    let (_, info) = workloads::lookup(&spec.model)?;
    let Some(cfg) = info.decoder else {
        bail!("{} is not a language model", spec.model)
    };
    check_given_blocks(settings, &cfg, spec.precision.dtype(), device)
}

fn check_given_blocks(
    s: &ServeSettings,
    cfg: &workloads::models::decoder::Config,
    dtype: candle_core::DType,
    device: &OpenDevice,
) -> Result<()> {
    let Some(blocks) = s.kv_blocks else { return Ok(()) };
    let block_bytes = cfg.kv_bytes_per_token(dtype) as f64 * s.kv_block_size.get() as f64;
    let bytes = blocks as f64 * block_bytes;
    let (limit_mib, what) = match device.info.memory_mib() {
        Some(mib) => (Some(mib as f64), format!("{} has", device.info.name)),
        None => (
            crate::run::estimate::limit_mib(device)?,
            format!("the host ({}) has available", device.info.name),
        ),
    };
    let Some(limit) = limit_mib.map(|m| m * (1u64 << 20) as f64) else {
        return Ok(());
    };
    if bytes > limit {
        bail!(
            "--kv-blocks {blocks} of {} tokens ({:.1} KiB each) is a cache of {:.1} MiB; {what} {:.0} MiB: give at most {} blocks, or leave --kv-blocks out to size the cache from the memory",
            s.kv_block_size,
            block_bytes / 1024.0,
            bytes / (1u64 << 20) as f64,
            limit / (1u64 << 20) as f64,
            (limit / block_bytes).floor()
        )
    }
    Ok(())
}

/// What the job found.
pub struct ServeOutcome {
    pub steps: Vec<(f64, GenerationSummary)>,
    /// A search's capacity (`Some(None)`: no rate met both objectives).
    pub capacity: Option<Option<f64>>,
    pub cache: CacheSize,
}

/// Which rates a job offers: as [`super::job::Rates`].
pub use super::job::Rates;

pub struct ServeJob<'a> {
    pub spec: &'a RunSpec,
    pub settings: &'a ServeSettings,
    pub rates: &'a Rates,
}

pub fn run(
    job: ServeJob,
    device: &OpenDevice,
    context: &RunContext,
    cell: &CellIdentity,
    out: &Path,
    log: &mut dyn Write,
) -> Result<ServeOutcome> {
    let ServeJob { spec, settings, rates } = job;
    let dev = &device.device;
    let cfg = spec.workload_config(dev);
    let (_, info) = workloads::lookup_with(&spec.model, None)?;
    let Some(decoder_cfg) = info.decoder.clone() else {
        bail!("{} is not a language model", spec.model)
    };
    let max_model_len = decoder_cfg.max_position_embeddings as u32;
    let bs = settings.kv_block_size.get();
    // The largest piece an iteration runs, from a prompt's start and after a first piece as long:
    // the memory sizing measures their workspace.
    let profile_tokens = (settings.max_batched_tokens.min(max_model_len)) as usize;
    let before = workloads::memory::ledger(dev)?;
    let mut model = PagedModel::build(&spec.model, &cfg, (2 * profile_tokens).div_ceil(bs), bs)
        .map_err(anyhow::Error::from)
        .with_context(|| format!("building {}", spec.model))?;
    let cache = size_cache(&mut model, device, settings, profile_tokens, before)?;
    let budget = Budget {
        block_size: settings.kv_block_size,
        blocks: cache.blocks,
        max_batched_tokens: settings.max_batched_tokens,
        max_seqs: settings.max_seqs,
        chunked_prefill: settings.chunked_prefill,
        max_model_len,
    };
    let mut engine = ModelEngine { model };
    let clock = MonotonicClock::new();
    let closed = closed_loop(&clock, &mut engine, settings, budget)?;
    writeln!(
        log,
        "cache: {} blocks of {} tokens ({:.1} MiB, sized by {}); closed loop of {} requests at once: {:.2} requests/s, {:.0} output tokens/s",
        cache.blocks,
        bs,
        cache.blocks as f64 * engine.model.block_bytes() as f64 / (1u64 << 20) as f64,
        cache.sizing,
        closed.concurrency,
        closed.request_rate,
        closed.output_token_rate
    )?;
    if let Some(n) = &cache.note {
        writeln!(log, "note: {n}")?;
    }
    let fingerprint = crate::run::fingerprint::Fingerprint::collect(device.info.selected.as_ref());
    let id = super::generation_record::ServeIdentity {
        head: super::record::RowHead::of(context, cell, &device.info, &fingerprint, &info, spec),
        settings,
        own: Some(super::generation_record::OwnEngine {
            cache: &cache,
            block_bytes: engine.model.block_bytes() as u64,
            closed_loop: closed,
        }),
        server: None,
    };
    let mut stepper = Stepper {
        engine: &mut engine,
        clock: &clock,
        plan: plan(settings, budget),
        id: &id,
        out,
        log,
        sampling: device.info.selected.clone().zip(spec.sample_interval),
        expected: &context.expected,
        search: None,
        done: Vec::new(),
        steps: Vec::new(),
    };
    let capacity = match rates {
        Rates::Fixed(list) => {
            for &qps in list {
                stepper.step(qps)?;
            }
            None
        }
        Rates::Search { start } => {
            // A search of this cell that an earlier job left without its capacity row goes on: its
            // rates are not measured again.
            let resumed = unfinished_search(out, &cell.cell_id)?;
            let (capacity_id, first) = match &resumed {
                Some(r) => {
                    writeln!(
                        stepper.log,
                        "resuming search {}: {} rate(s) measured before are not measured again",
                        r.capacity_id,
                        r.done.len()
                    )?;
                    (r.capacity_id.clone(), Some(r.first_qps))
                }
                None => (crate::provenance::run_id(crate::provenance::now()), None),
            };
            let started = crate::provenance::now();
            stepper.search = Some((capacity_id.clone(), resumed.as_ref().map_or(0, |r| r.done.len())));
            stepper.done = resumed.map(|r| r.done).unwrap_or_default();
            // Every step offers --duration's seconds of arrivals: the most a step holds bounds the rate.
            let ceiling_qps = crate::run::limits::MAX_STEP_REQUESTS / settings.duration_secs;
            let plan = SearchPlan {
                start_qps: first
                    .or(*start)
                    .unwrap_or(closed.request_rate)
                    .max(0.01)
                    .min(ceiling_qps),
                resolution: settings.resolution,
                floor_qps: (closed.request_rate / 1000.0).max(0.01),
                max_steps: settings.max_steps,
                ceiling_qps,
            };
            let outcome = search(&mut stepper, plan)?;
            super::generation_record::write_capacity(out, &id, &capacity_id, started, &outcome)?;
            match outcome.capacity_qps {
                Some(c) => writeln!(
                    stepper.log,
                    "capacity: {c:.2} requests/s within TTFT p99 {} ms and TPOT p99 {} ms ({} steps{})",
                    settings.slo_ttft_p99_ms.unwrap_or_default(),
                    settings.slo_tpot_p99_ms.unwrap_or_default(),
                    outcome.steps.len(),
                    outcome.note.as_ref().map_or(String::new(), |n| format!("; {n}"))
                )?,
                None => writeln!(
                    stepper.log,
                    "capacity: none: {}",
                    outcome.note.clone().unwrap_or_default()
                )?,
            }
            Some(outcome.capacity_qps)
        }
    };
    let steps = std::mem::take(&mut stepper.steps);
    drop(stepper);
    drop(engine);
    workloads::memory::release_pooled(dev).context("releasing the job's GPU memory")?;
    device.neighbour_still_streams()?;
    Ok(ServeOutcome { steps, capacity, cache })
}

/// Makes the KV pool of `blocks`; where they were sized from the memory (`shrink`) and do not
/// fit, of a tenth fewer at a time, `blocks` then what fitted and the note saying so.
fn make_pool(model: &mut PagedModel, blocks: &mut usize, shrink: bool) -> Result<Option<String>> {
    let sized = *blocks;
    let mut note = None;
    loop {
        match model.resize_pool(*blocks) {
            Ok(()) => return Ok(note),
            Err(e)
                if shrink
                    && crate::run::record::Status::of_error(&anyhow::anyhow!("{e}"))
                        == crate::run::record::Status::Oom
                    && *blocks > 16 =>
            {
                *blocks = *blocks * 9 / 10;
                note = Some(format!(
                    "a pool of the {sized} blocks the memory's sizing allowed did not fit; {} did",
                    *blocks
                ));
            }
            Err(e) => return Err(anyhow::Error::from(e).context(format!("making a KV pool of {} blocks", *blocks))),
        }
    }
}

/// Sizes the cache and makes its pool: `--kv-blocks` as given; on a GPU, the target's memory less
/// the weights and the workspace (measured over two prefill pieces of `profile_tokens`, the largest
/// an iteration runs, the second after the first, on a pool just big enough for them), times the
/// fraction; on the CPU, its rule.
/// A pool that does not fit is made smaller, a tenth at a time, and the row says so.
fn size_cache(
    model: &mut PagedModel,
    device: &OpenDevice,
    s: &ServeSettings,
    profile_tokens: usize,
    before: Option<workloads::memory::Ledger>,
) -> Result<CacheSize> {
    let dev = &device.device;
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let weights_mib = mib(model.weight_bytes() as f64);
    let block_bytes = model.block_bytes();
    let profile_pool = model.pool().bytes() as u64;
    // The largest piece an iteration runs, through the model from a prompt's start and, where the
    // model's positions allow, after a first piece as long (a chunked prompt's later piece also
    // holds the keys and values before it; on the CPU, and where the causal kernel does not take the
    // heads, candle's scores over them): the workspace, and every kernel loaded before any step is
    // timed.
    workloads::memory::release_pooled(dev)?;
    let piece = |start: usize| Prefill {
        id: 0,
        start,
        len: profile_tokens,
        last: false,
    };
    model.run(&[piece(0)], &[])?;
    if 2 * profile_tokens <= model.max_positions() {
        model.run(&[piece(profile_tokens)], &[])?;
    }
    model.clear();
    let after = workloads::memory::ledger(dev)?;
    // What the pieces' activations left reserved in the allocator's pool goes back to the device
    // before the cache takes most of it: held, it left the steps' allocations too little room to
    // grow the pool, and a closed loop on an H100 ran at a fiftieth of its rate.
    workloads::memory::release_pooled(dev)?;
    let (mut blocks, sizing, limit_mib, workspace_mib) = match (s.kv_blocks, after, device.info.memory_mib()) {
        (Some(b), ..) => (b as usize, "given", None, None),
        (None, Some(l), Some(limit)) => {
            // What migprof's own allocations held at most beyond the weights and the small pool,
            // and what the process holds outside the pool (kernels, libraries) since it began.
            let workspace = l.pool_used_high.saturating_sub(profile_pool) as f64 - model.weight_bytes() as f64;
            let outside = before.map_or(0, |b| {
                (l.device_used.saturating_sub(b.device_used))
                    .saturating_sub(l.pool_reserved.saturating_sub(b.pool_reserved))
            });
            let free =
                limit as f64 * (1u64 << 20) as f64 - model.weight_bytes() as f64 - workspace.max(0.0) - outside as f64;
            let blocks = (free.max(0.0) * s.kv_cache_fraction / block_bytes as f64).floor() as usize;
            (
                blocks,
                "memory",
                Some(limit as f64),
                Some(mib(workspace.max(0.0) + outside as f64)),
            )
        }
        _ => {
            // (--kv-cache-fraction applies to a target's memory: the CPU's rule does not use it.)
            let per_seq = model.max_positions().div_ceil(s.kv_block_size.get());
            let blocks = (s.max_seqs as usize * per_seq).min(CPU_CACHE_BYTES / block_bytes.max(1));
            (blocks, "cpu", None, None)
        }
    };
    if blocks == 0 {
        bail!(
            "the {} MiB the target allows leave no room for a KV cache beside {weights_mib:.0} MiB of weights and {:.0} MiB of workspace (--max-batched-tokens {} sets the workspace)",
            limit_mib.unwrap_or_default(),
            workspace_mib.unwrap_or_default(),
            s.max_batched_tokens
        )
    }
    let note = make_pool(model, &mut blocks, sizing == "memory")?;
    Ok(CacheSize {
        blocks: u32::try_from(blocks).unwrap_or(u32::MAX),
        sizing,
        limit_mib,
        weights_mib,
        workspace_mib,
        note,
    })
}

/// Warms every kernel with short requests, then times the closed loop ([`ClosedLoop`]).
fn closed_loop(
    clock: &MonotonicClock,
    engine: &mut ModelEngine,
    s: &ServeSettings,
    budget: Budget,
) -> Result<ClosedLoop> {
    use super::serve::Timer;
    let concurrency = (s.max_seqs as usize).min(16);
    let len = |d: LengthDist| (d.mean().round() as u32).max(1);
    let (prompt, output) = (len(s.prompt), len(s.output));
    // Short requests first, untimed: every kernel the steps use is compiled on its first use (on a
    // fresh machine, tens of seconds), which would otherwise fall on the closed loop and make the
    // search's first guess a fiftieth of the rate.
    let short: Vec<(Duration, u32, u32)> = (0..concurrency)
        .map(|_| (clock.now(), prompt.min(16), output.min(4)))
        .collect();
    drive(
        clock,
        engine,
        super::continuous::Scheduler::new(budget)?,
        &short,
        clock.now() + Duration::from_secs(600),
    )?;
    let start = clock.now();
    let requests: Vec<(Duration, u32, u32)> = (0..concurrency).map(|_| (start, prompt, output)).collect();
    let t = Instant::now();
    let served = drive(
        clock,
        engine,
        super::continuous::Scheduler::new(budget)?,
        &requests,
        start + Duration::from_secs(600),
    )?;
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    if let Some(why) = served.requests.iter().find_map(|r| r.refused.clone()) {
        bail!("a request of the lengths' means ({prompt} + {output} tokens) cannot be served: {why}")
    }
    let done = served.requests.iter().filter(|r| r.finished()).count();
    Ok(ClosedLoop {
        concurrency,
        request_rate: done as f64 / secs,
        output_token_rate: served.requests.iter().map(|r| r.tokens.len() as f64).sum::<f64>() / secs,
    })
}

/// Runs steps and writes each step's rows as it is measured.
struct Stepper<'a> {
    engine: &'a mut ModelEngine,
    clock: &'a MonotonicClock,
    plan: StepPlan,
    id: &'a super::generation_record::ServeIdentity<'a>,
    out: &'a Path,
    log: &'a mut dyn Write,
    sampling: Option<(crate::gpu::Selected, Duration)>,
    expected: &'a crate::run::evidence::Expected,
    /// A search's id and the index of its next step.
    search: Option<(String, usize)>,
    /// Rates a resumed search measured before, and whether each met both objectives.
    done: Vec<(f64, bool)>,
    steps: Vec<(f64, GenerationSummary)>,
}

impl Stepper<'_> {
    fn step(&mut self, qps: f64) -> Result<bool> {
        let started = crate::provenance::now();
        let (plan, clock, engine) = (&self.plan, self.clock, &mut *self.engine);
        let ((served, summary, start), evidence, readings) = crate::run::execute::beside_sampler(
            self.sampling.clone(),
            self.id.head.device.selected.is_some(),
            self.expected,
            || plan.serve(clock, engine, qps),
        )?;
        let finished = served.requests.iter().filter(|r| r.finished()).count() as u64;
        let metrics = crate::gpu::sampler::summarize(&readings, finished);
        let meets = self.plan.meets(&summary);
        let mut notes = Vec::new();
        if summary.refused > 0 {
            let why = served
                .requests
                .iter()
                .filter(|r| r.arrival >= start + self.plan.warmup)
                .find_map(|r| r.refused.clone())
                .unwrap_or_default();
            notes.push(format!(
                "{} of {} measured requests were refused, as every step will refuse them (the same lengths are drawn at every rate): {why}",
                summary.refused, summary.requests
            ));
        }
        let late = summary.requests - summary.finished - summary.refused;
        if late > 0 {
            notes.push(format!(
                "{late} of {} measured requests did not finish within the step's {:.0} s and {:.0} s of drain",
                summary.requests,
                self.plan.duration.as_secs_f64(),
                self.plan.drain.as_secs_f64()
            ));
        }
        let growth_ms = summary.ttft_growth_over_horizon_ms();
        if growth_ms > 0.0 {
            notes.push(format!(
                "TTFT grew {:.2} ms per second of arrivals: at this rate the queue grows, and its p99 would be {:.0} ms higher after {} s",
                summary.ttft_growth * 1e3,
                growth_ms,
                super::serve::GROWTH_HORIZON.as_secs()
            ));
        }
        if let Some(e) = evidence.describe() {
            notes.push(e);
        }
        let step = ServedStep {
            offered_qps: Some(qps),
            served: &served,
            summary: &summary,
            start,
            warmup: self.plan.warmup,
            meets,
            evidence: &evidence,
            metrics: &metrics,
            note: (!notes.is_empty()).then(|| notes.join("; ")),
            server: None,
        };
        let serve_id = crate::provenance::run_id(started);
        super::generation_record::write_step(
            self.out,
            self.id,
            &serve_id,
            started,
            &step,
            self.search.as_ref().map(|(c, i)| (c.as_str(), *i)),
        )?;
        writeln!(self.log, "{}", describe(&step))?;
        if let Some(n) = &step.note {
            writeln!(self.log, "  note: {n}")?;
        }
        if let Some((_, i)) = self.search.as_mut() {
            *i += 1;
        }
        self.steps.push((qps, summary));
        Ok(meets.unwrap_or(false))
    }
}

impl StepRunner for Stepper<'_> {
    fn run_step(&mut self, qps: f64) -> Result<bool> {
        // The same start and the same verdicts give the same rates: a rate measured before is taken
        // as it was (its row is there).
        if let Some(&(_, met)) = self.done.iter().find(|(q, _)| (q - qps).abs() <= 1e-9 * qps.max(1.0)) {
            writeln!(
                self.log,
                "{qps:.2} requests/s: measured before ({})",
                if met {
                    "met both objectives"
                } else {
                    "missed an objective"
                }
            )?;
            return Ok(met);
        }
        self.step(qps)
    }
}

/// A search of a cell left without its capacity row: its id, its first rate, and the rates it
/// measured with their verdicts.
struct Unfinished {
    capacity_id: String,
    first_qps: f64,
    done: Vec<(f64, bool)>,
}

/// The latest search of `cell_id` in `out` whose `serve_capacity` row was never written.
fn unfinished_search(out: &Path, cell_id: &str) -> Result<Option<Unfinished>> {
    use crate::results::parts::{number_column, read_table, text_column, Table};
    let finished: std::collections::BTreeSet<String> =
        text_column(&read_table(out, Table::ServeCapacity)?, "capacity_id")?
            .into_iter()
            .flatten()
            .collect();
    let steps = read_table(out, Table::Serve)?;
    let (cells, ids, index, rate, meets) = (
        text_column(&steps, "cell_id")?,
        text_column(&steps, "capacity_id")?,
        number_column(&steps, "search_step")?,
        number_column(&steps, "offered_qps")?,
        text_column(&steps, "meets_slo")?,
    );
    let mut searches: std::collections::BTreeMap<String, Vec<(f64, f64, bool)>> = Default::default();
    for i in 0..steps.height() {
        let (Some(c), Some(id), Some(k), Some(q)) = (&cells[i], &ids[i], index[i], rate[i]) else {
            continue;
        };
        if c == cell_id && !finished.contains(id) {
            searches
                .entry(id.clone())
                .or_default()
                .push((k, q, meets[i].as_deref() == Some("true")));
        }
    }
    // Ids sort by their start: the latest search goes on.
    Ok(searches.into_iter().next_back().and_then(|(capacity_id, mut steps)| {
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Unfinished {
            capacity_id,
            first_qps: steps.first()?.1,
            done: steps.into_iter().map(|(_, q, m)| (q, m)).collect(),
        })
    }))
}

/// One line for the log: the rate, what came back, the objectives' percentiles.
fn describe(step: &ServedStep) -> String {
    let s = step.summary;
    let p = |p: &Option<super::tokens::Percentiles>| {
        p.as_ref().map_or("-".to_string(), |p| {
            format!("p50 {:.1} p99 {:.1} ms", p.p50_ms, p.p99_ms)
        })
    };
    format!(
        "{:.2} requests/s offered: {} of {} finished, {:.2} requests/s, {:.0} output tokens/s; TTFT {}; TPOT {}; batch {:.1} (most {}), KV cache {:.0}% (most {:.0}%), {} preemptions{}",
        // The engine's steps always offer a rate.
        step.offered_qps.unwrap_or_default(),
        s.finished,
        s.requests,
        s.request_rate,
        s.output_token_rate,
        p(&s.ttft),
        p(&s.tpot),
        s.batch_mean,
        s.batch_max,
        s.kv_occupancy_mean * 100.0,
        s.kv_occupancy_max * 100.0,
        s.preemptions,
        match (step.meets, s.refused) {
            (Some(true), _) => ", meets both objectives".to_string(),
            (Some(false), 0) => ", misses an objective".to_string(),
            (Some(false), n) => format!(", fails: {n} measured request(s) refused"),
            (None, 0) => String::new(),
            (None, n) => format!(", {n} measured request(s) refused"),
        }
    )
}

#[cfg(test)]
mod tests {
    use super::super::settings::{Keys, SERVE_DEFAULTS};
    use super::*;

    #[test]
    fn settings_refuse_what_no_run_could_take_and_name_the_flags() {
        let ok = SERVE_DEFAULTS;
        ok.check(false, Keys::Flags).unwrap();
        let e = ok.check(true, Keys::Flags).unwrap_err().to_string();
        assert!(
            e.contains("--slo-ttft-p99-ms") && e.contains("--slo-tpot-p99-ms"),
            "{e}"
        );
        let e = ServeSettings {
            max_batched_tokens: 100,
            ..SERVE_DEFAULTS
        }
        .check(false, Keys::Flags)
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--max-batched-tokens 100") && e.contains("--max-seqs 256"),
            "{e}"
        );
        for bad in [0.0, 1.5] {
            let s = ServeSettings {
                kv_cache_fraction: bad,
                ..SERVE_DEFAULTS
            };
            assert!(s
                .check(false, Keys::Flags)
                .unwrap_err()
                .to_string()
                .contains("--kv-cache-fraction"));
        }
        let e = ServeSettings {
            warmup_secs: 10.0,
            ..SERVE_DEFAULTS
        }
        .check(false, Keys::Flags)
        .unwrap_err()
        .to_string();
        assert!(e.contains("--warmup 10 s must be shorter than --duration 10 s"), "{e}");
    }

    #[test]
    fn every_setting_is_in_the_identity_and_survives_a_round_trip() {
        let s = ServeSettings {
            prompt: LengthDist::Lognormal {
                mean: 300.0,
                spread: 0.5,
            },
            output: LengthDist::Uniform { min: 10, max: 90 },
            slo_ttft_p99_ms: Some(500.0),
            slo_tpot_p99_ms: Some(50.0),
            ..SERVE_DEFAULTS
        };
        let json = serde_json::to_string(&s).unwrap();
        assert!(json.contains("\"lognormal:300,0.5\""), "{json}");
        assert_eq!(serde_json::from_str::<ServeSettings>(&json).unwrap(), s);
        let base = s.identity();
        for other in [
            ServeSettings {
                chunked_prefill: false,
                ..s.clone()
            },
            ServeSettings {
                kv_cache_fraction: 0.8,
                ..s.clone()
            },
            ServeSettings {
                output: LengthDist::Fixed(50),
                ..s.clone()
            },
            ServeSettings {
                slo_tpot_p99_ms: Some(40.0),
                ..s.clone()
            },
            ServeSettings {
                kv_blocks: Some(100),
                ..s.clone()
            },
        ] {
            assert_ne!(other.identity(), base);
        }
    }
}
