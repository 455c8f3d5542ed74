//! The serving tables of language models: `serve` (one row per step, i.e. per offered rate),
//! `serve_requests` (one row per request of a step), `serve_iterations` (one row per iteration of
//! the continuous batcher: the KV cache's occupancy over time) and `serve_capacity` (one row per
//! search). Each row carries the identity columns of `runs` — cell, device and emulation, model,
//! dtype, fingerprint — so that the tables join and filter alike.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use chrono::{DateTime, Utc};
use polars::prelude::*;

use super::record::{closing_columns, head_columns, RowHead};
use super::search::SearchOutcome;
use super::settings::ServeSettings;
use super::tokens::{GenerationServed, GenerationSummary, Percentiles};
use crate::provenance;
use crate::results::parts::{col, write_part, Table, SCHEMA_VERSION};
use crate::run::evidence::Evidence;

/// How the cache was sized, for the rows.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSize {
    pub blocks: u32,
    /// `memory` (from the target's memory), `given` (`--kv-blocks`), `cpu` (the CPU's rule).
    pub sizing: &'static str,
    /// The memory the target allows, the weights', and the most the workspace held beside them
    /// (MiB; measured on a GPU).
    pub limit_mib: Option<f64>,
    pub weights_mib: f64,
    pub workspace_mib: Option<f64>,
    /// Why fewer blocks than the memory allowed, where the first pool did not fit.
    pub note: Option<String>,
}

/// The closed loop the job starts with (after short requests that warm every kernel):
/// `concurrency` requests of the lengths' means all at once until they finish. Its rate is a
/// search's first guess.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClosedLoop {
    pub concurrency: usize,
    pub request_rate: f64,
    pub output_token_rate: f64,
}

/// A measured step, as its rows record it.
pub struct ServedStep<'a> {
    /// The rate the step offered; `None` for a server's step at a fixed concurrency.
    pub offered_qps: Option<f64>,
    pub served: &'a GenerationServed,
    pub summary: &'a GenerationSummary,
    /// When the step's schedule started, on the served records' clock.
    pub start: Duration,
    pub warmup: Duration,
    pub meets: Option<bool>,
    pub evidence: &'a Evidence,
    pub metrics: &'a crate::gpu::sampler::MetricSummary,
    pub note: Option<String>,
    /// A user's server's step: what its client saw.
    pub server: Option<&'a ServerStep>,
}

/// A step on a user's server as its client saw it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServerStep {
    /// Requests always in flight; `None`: the step offered a rate.
    pub concurrency: Option<usize>,
    /// Measured requests that failed (no answer, an error, a stream that broke off), and the most
    /// frequent reasons with their counts.
    pub failed: usize,
    pub failures: Option<String>,
    /// Measured requests that came back with fewer tokens than they asked for.
    pub short: usize,
    /// How the tokens were counted: `usage`, `timings`, `chunks`, or several joined by `+`.
    pub counted: String,
    /// Measured requests started over 1 ms after they were due.
    pub late: usize,
    /// Whether NVML saw the server's processes on the target; `None`: not checked.
    pub on_target: Option<bool>,
    /// Each request's own, in the order of `served.requests`.
    pub requests: Vec<ServerRequest>,
}

/// A request to a user's server beyond what every served request records.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ServerRequest {
    /// It came back with fewer tokens than it asked for.
    pub short: bool,
    /// Why it failed, where it did.
    pub failure: Option<String>,
    /// Chunks with text it received.
    pub chunks: u32,
}

/// A user's language-model server behind a job's rows: who answered and how it was asked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationServer {
    /// The server's name as it gives it (`vllm`, `llamacpp`).
    pub engine: String,
    pub protocol: String,
    pub endpoint: String,
    /// The command migprof started it with; `None`: a server already running.
    pub command: Option<String>,
    /// `completions` or `chat`.
    pub api: String,
    /// `ids` or `text`.
    pub prompt_form: String,
    /// Whether requests asked for exactly their length (`min_tokens`, `ignore_eos`).
    pub output_enforced: bool,
}

/// What migprof's own engine adds to a job's rows: its cache and its closed loop.
pub struct OwnEngine<'a> {
    pub cache: &'a CacheSize,
    /// Bytes of one KV block, every layer.
    pub block_bytes: u64,
    pub closed_loop: ClosedLoop,
}

/// What every row of one serving job shares.
pub struct ServeIdentity<'a> {
    pub head: RowHead<'a>,
    pub settings: &'a ServeSettings,
    /// migprof's engine: `None` for a user's server, whose batcher and cache migprof does not know
    /// (their columns are null).
    pub own: Option<OwnEngine<'a>>,
    pub server: Option<&'a GenerationServer>,
}

/// The columns every `serve` and `serve_capacity` row starts with.
fn identity_columns(
    id: &ServeIdentity,
    row_id: (&str, &str),
    started: DateTime<Utc>,
    finished: DateTime<Utc>,
) -> Vec<Column> {
    let mut columns = head_columns(&id.head, row_id, (started, finished), Vec::new());
    let s = id.settings;
    let own = id.own.as_ref();
    let c = own.map(|o| o.cache);
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let engine = |v: i64| vec![own.map(|_| v)];
    columns.extend([
        col("arrival", vec![s.arrival.as_str().to_string()]),
        col("arrival_seed", vec![s.arrival_seed]),
        col("prompt_len", vec![s.prompt.to_string()]),
        col("output_len", vec![s.output.to_string()]),
        col("prompt_len_mean", vec![s.prompt.mean()]),
        col("output_len_mean", vec![s.output.mean()]),
        Column::new("max_batched_tokens".into(), engine(s.max_batched_tokens as i64)),
        Column::new("max_seqs".into(), engine(s.max_seqs as i64)),
        Column::new("chunked_prefill".into(), vec![own.map(|_| s.chunked_prefill)]),
        Column::new("kv_block_size".into(), engine(s.kv_block_size.get() as i64)),
        Column::new("kv_cache_fraction".into(), vec![own.map(|_| s.kv_cache_fraction)]),
        Column::new("kv_blocks".into(), vec![c.map(|c| c.blocks as i64)]),
        Column::new(
            "kv_cache_mib".into(),
            vec![own.map(|o| mib(o.cache.blocks as f64 * o.block_bytes as f64))],
        ),
        Column::new("kv_sizing".into(), vec![c.map(|c| c.sizing.to_string())]),
        Column::new("memory_limit_mib".into(), vec![c.and_then(|c| c.limit_mib)]),
        Column::new("weights_mib".into(), vec![c.map(|c| c.weights_mib)]),
        Column::new("workspace_mib".into(), vec![c.and_then(|c| c.workspace_mib)]),
        col("warmup_s", vec![s.warmup_secs]),
        col("duration_s", vec![s.duration_secs]),
        col("drain_s", vec![s.drain_secs]),
        Column::new("slo_ttft_p99_ms".into(), vec![s.slo_ttft_p99_ms]),
        Column::new("slo_tpot_p99_ms".into(), vec![s.slo_tpot_p99_ms]),
        Column::new(
            "closed_loop_concurrency".into(),
            vec![own.map(|o| o.closed_loop.concurrency as i64)],
        ),
        Column::new("closed_loop_qps".into(), vec![own.map(|o| o.closed_loop.request_rate)]),
        Column::new(
            "closed_loop_output_tokens_per_s".into(),
            vec![own.map(|o| o.closed_loop.output_token_rate)],
        ),
    ]);
    let server = id.server;
    let text = |f: fn(&GenerationServer) -> Option<String>| vec![server.and_then(f)];
    columns.extend([
        Column::new("engine".into(), text(|s| Some(s.engine.clone()))),
        Column::new("protocol".into(), text(|s| Some(s.protocol.clone()))),
        Column::new("endpoint".into(), text(|s| Some(s.endpoint.clone()))),
        Column::new("server_command".into(), text(|s| s.command.clone())),
        Column::new("api".into(), text(|s| Some(s.api.clone()))),
        Column::new("prompt_form".into(), text(|s| Some(s.prompt_form.clone()))),
        Column::new("output_enforced".into(), vec![server.map(|s| s.output_enforced)]),
    ]);
    columns
}

/// A latency's percentile columns, `<name>_p50_ms` … and the p99's interval; nulls where no request
/// had one.
fn percentile_columns(name: &str, p: &Option<Percentiles>) -> Vec<Column> {
    let f = |get: &dyn Fn(&Percentiles) -> f64| vec![p.as_ref().map(get)];
    vec![
        Column::new(format!("{name}_p50_ms").into(), f(&|p| p.p50_ms)),
        Column::new(format!("{name}_p90_ms").into(), f(&|p| p.p90_ms)),
        Column::new(format!("{name}_p99_ms").into(), f(&|p| p.p99_ms)),
        Column::new(
            format!("{name}_p99_ms_ci_low").into(),
            vec![p.as_ref().and_then(|p| p.p99_interval.as_ref().ok().map(|i| i.low))],
        ),
        Column::new(
            format!("{name}_p99_ms_ci_high").into(),
            vec![p.as_ref().and_then(|p| p.p99_interval.as_ref().ok().map(|i| i.high))],
        ),
    ]
}

/// Writes a step's `serve_requests` and `serve_iterations` parts, then its `serve` row (the detail
/// first: a row is only ever present with it).
pub fn write_step(
    out: &Path,
    id: &ServeIdentity,
    serve_id: &str,
    started: DateTime<Utc>,
    step: &ServedStep,
    search: Option<(&str, usize)>,
) -> Result<()> {
    let file = format!("part-{serve_id}.parquet");
    let ms = |d: Duration| d.saturating_sub(step.start).as_secs_f64() * 1e3;
    let span = |d: Duration| d.as_secs_f64() * 1e3;
    let r = &step.served.requests;
    let n = r.len();
    let measured = step.start + step.warmup;
    // A server's requests' own columns; null for migprof's engine.
    fn per_request<T>(step: &ServedStep, n: usize, f: &dyn Fn(&ServerRequest) -> Option<T>) -> Vec<Option<T>> {
        match step.server {
            Some(s) => s.requests.iter().map(f).collect(),
            None => (0..n).map(|_| None).collect(),
        }
    }
    let mut requests = DataFrame::new(
        n,
        vec![
            Column::new("schema_version".into(), vec![SCHEMA_VERSION; n]),
            Column::new("serve_id".into(), vec![serve_id; n]),
            col("request", (0..n as i64).collect::<Vec<i64>>()),
            col("arrival_ms", r.iter().map(|q| ms(q.arrival)).collect::<Vec<f64>>()),
            col(
                "measured",
                r.iter().map(|q| q.arrival >= measured).collect::<Vec<bool>>(),
            ),
            col("prompt_tokens", r.iter().map(|q| q.prompt as i64).collect::<Vec<i64>>()),
            col("output_tokens", r.iter().map(|q| q.output as i64).collect::<Vec<i64>>()),
            col(
                "tokens_out",
                r.iter().map(|q| q.tokens.len() as i64).collect::<Vec<i64>>(),
            ),
            col("finished", r.iter().map(|q| q.finished()).collect::<Vec<bool>>()),
            Column::new(
                "ttft_ms".into(),
                r.iter().map(|q| q.ttft().map(span)).collect::<Vec<Option<f64>>>(),
            ),
            Column::new(
                "tpot_ms".into(),
                r.iter().map(|q| q.tpot().map(span)).collect::<Vec<Option<f64>>>(),
            ),
            Column::new(
                "e2e_ms".into(),
                r.iter().map(|q| q.e2e().map(span)).collect::<Vec<Option<f64>>>(),
            ),
            Column::new(
                "refused".into(),
                r.iter().map(|q| q.refused.clone()).collect::<Vec<Option<String>>>(),
            ),
            Column::new("short".into(), per_request(step, n, &|d| Some(d.short))),
            Column::new("failure".into(), per_request(step, n, &|d| d.failure.clone())),
            Column::new("chunks".into(), per_request(step, n, &|d| Some(d.chunks as i64))),
        ],
    )?;
    write_part(&out.join(Table::ServeRequests.dir_name()), &file, &mut requests)?;

    let its = &step.served.iterations;
    let k = its.len();
    let blocks = step.served.blocks.max(1) as f64;
    let mut iterations = DataFrame::new(
        k,
        vec![
            Column::new("schema_version".into(), vec![SCHEMA_VERSION; k]),
            Column::new("serve_id".into(), vec![serve_id; k]),
            col("iteration", (0..k as i64).collect::<Vec<i64>>()),
            col("start_ms", its.iter().map(|i| ms(i.start)).collect::<Vec<f64>>()),
            col("end_ms", its.iter().map(|i| ms(i.end)).collect::<Vec<f64>>()),
            col("batch", its.iter().map(|i| i.batch as i64).collect::<Vec<i64>>()),
            col("tokens", its.iter().map(|i| i.tokens as i64).collect::<Vec<i64>>()),
            col(
                "prefill_tokens",
                its.iter().map(|i| i.prefill_tokens as i64).collect::<Vec<i64>>(),
            ),
            col(
                "kv_blocks_used",
                its.iter().map(|i| i.blocks_used as i64).collect::<Vec<i64>>(),
            ),
            col(
                "kv_occupancy",
                its.iter().map(|i| i.blocks_used as f64 / blocks).collect::<Vec<f64>>(),
            ),
            col("running", its.iter().map(|i| i.running as i64).collect::<Vec<i64>>()),
            col("waiting", its.iter().map(|i| i.waiting as i64).collect::<Vec<i64>>()),
        ],
    )?;
    write_part(&out.join(Table::ServeIterations.dir_name()), &file, &mut iterations)?;

    let s = step.summary;
    let m = step.metrics;
    let e = step.evidence;
    // Energy over the whole step (its warm-up and drain too) over the work of the whole step.
    let done = step.served.requests.iter().filter(|q| q.finished()).count();
    let tokens_out: usize = step.served.requests.iter().map(|q| q.tokens.len()).sum();
    let per = |count: usize| m.gpu_energy_j.filter(|_| count > 0).map(|j| j / count as f64);
    let verdict = if e.shared() {
        "shared"
    } else if e.throttled() {
        "throttled"
    } else {
        "ok"
    };
    let client = step.server;
    let mut columns = identity_columns(id, ("serve_id", serve_id), started, provenance::now());
    columns.extend([
        Column::new("capacity_id".into(), vec![search.map(|s| s.0.to_string())]),
        Column::new("search_step".into(), vec![search.map(|s| s.1 as i64)]),
        Column::new("offered_qps".into(), vec![step.offered_qps]),
        Column::new(
            "concurrency".into(),
            vec![client.and_then(|c| c.concurrency.map(|n| n as i64))],
        ),
        col("requests", vec![s.requests as i64]),
        col("finished", vec![s.finished as i64]),
        col("refused", vec![s.refused as i64]),
        col("measured_s", vec![s.window.as_secs_f64()]),
        col("achieved_qps", vec![s.request_rate]),
        col("output_tokens_per_s", vec![s.output_token_rate]),
        Column::new("goodput_qps".into(), vec![s.goodput]),
    ]);
    for (name, p) in [("ttft", &s.ttft), ("tpot", &s.tpot), ("itl", &s.itl), ("e2e", &s.e2e)] {
        columns.extend(percentile_columns(name, p));
    }
    // What only migprof's own batcher knows: null for a user's server.
    let own = client.is_none();
    columns.extend([
        Column::new("kv_occupancy_mean".into(), vec![own.then_some(s.kv_occupancy_mean)]),
        Column::new("kv_occupancy_max".into(), vec![own.then_some(s.kv_occupancy_max)]),
        Column::new("batch_mean".into(), vec![own.then_some(s.batch_mean)]),
        Column::new("batch_max".into(), vec![own.then_some(s.batch_max as i64)]),
        Column::new("preemptions".into(), vec![own.then_some(s.preemptions as i64)]),
        Column::new("failed_requests".into(), vec![client.map(|c| c.failed as i64)]),
        Column::new("failures".into(), vec![client.and_then(|c| c.failures.clone())]),
        Column::new("short_requests".into(), vec![client.map(|c| c.short as i64)]),
        Column::new("tokens_counted_by".into(), vec![client.map(|c| c.counted.clone())]),
        Column::new("client_late".into(), vec![client.map(|c| c.late as i64)]),
        Column::new("server_on_target".into(), vec![client.and_then(|c| c.on_target)]),
        col("ttft_growth_ms_per_s", vec![s.ttft_growth * 1e3]),
        Column::new("meets_slo".into(), vec![step.meets]),
        col("verdict", vec![verdict.to_string()]),
        Column::new("throttle_share".into(), vec![e.throttle_share]),
        Column::new("power_cap_share".into(), vec![e.power_cap_share]),
        Column::new("other_processes".into(), vec![e.others_text()]),
        col("metric_samples", vec![m.samples as i64]),
        Column::new("fb_used_max_mib".into(), vec![m.fb_used_max_mib]),
        Column::new("gract_mean".into(), vec![m.gract_mean]),
        Column::new(
            "gpm_scope".into(),
            vec![m.has_gpm().then(|| id.head.device.gpm_scope()).flatten()],
        ),
        Column::new("gpu_power_mean_w".into(), vec![m.gpu_power_mean_w]),
        Column::new("energy_scope".into(), vec![m.gpu_energy_j.map(|_| "gpu".to_string())]),
        Column::new("j_per_request".into(), vec![per(done)]),
        Column::new("j_per_output_token".into(), vec![per(tokens_out)]),
        Column::new("note".into(), vec![step.note.clone()]),
    ]);
    columns.extend(closing_columns(id.head.fingerprint));
    let mut df = DataFrame::new(1, columns)?;
    write_part(&out.join(Table::Serve.dir_name()), &file, &mut df)?;
    Ok(())
}

/// Writes a search's `serve_capacity` row: the highest rate within both objectives.
pub fn write_capacity(
    out: &Path,
    id: &ServeIdentity,
    capacity_id: &str,
    started: DateTime<Utc>,
    o: &SearchOutcome,
) -> Result<()> {
    let mut columns = identity_columns(id, ("capacity_id", capacity_id), started, provenance::now());
    columns.extend([
        Column::new("capacity_qps".into(), vec![o.capacity_qps]),
        col("resolution", vec![id.settings.resolution]),
        col("max_steps", vec![id.settings.max_steps as i64]),
        Column::new("bracket_low_qps".into(), vec![o.low]),
        Column::new("bracket_high_qps".into(), vec![o.high]),
        col("steps", vec![o.steps.len() as i64]),
        col("emulated", vec![id.head.device.emulation.is_some()]),
        Column::new("note".into(), vec![o.note.clone()]),
    ]);
    columns.extend(closing_columns(id.head.fingerprint));
    let mut df = DataFrame::new(1, columns)?;
    write_part(
        &out.join(Table::ServeCapacity.dir_name()),
        &format!("part-{capacity_id}.parquet"),
        &mut df,
    )?;
    Ok(())
}
