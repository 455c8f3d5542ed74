//! The load tables: `load` (one row per step, i.e. per offered rate), `load_batches` (one row per
//! batch the batcher handed out) and `capacity` (one row per search). Each row carries the identity
//! columns of `runs` — cell, device and emulation, model, dtype, sequence length, fingerprint — so that
//! the tables join and filter alike.

use std::path::Path;

use anyhow::Result;
use chrono::{DateTime, Utc};
use polars::prelude::*;

use crate::device::DeviceInfo;
use crate::load::search::SearchOutcome;
use crate::load::settings::LoadSettings;
use crate::load::step::Step;
use crate::provenance;
use crate::results::parts::{col, utc_micros, write_part, Table, SCHEMA_VERSION};
use crate::results::runs::{cell_columns, device_columns, fingerprint_columns};
use crate::run::fingerprint::Fingerprint;
use crate::run::record::CellIdentity;
use crate::run::stats::ns_to_ms;

/// What every row of a serving job (`load` or `serve`) shares: who measured, on what, which model
/// with which kernels.
pub struct RowHead<'a> {
    pub invocation_id: &'a str,
    pub host: &'a str,
    pub cell: &'a CellIdentity,
    pub device: &'a DeviceInfo,
    pub fingerprint: &'a Fingerprint,
    /// What is served: a catalogue model, or the model a user's server names.
    pub model: &'a str,
    /// The model's family (`server` for a user's server).
    pub family: &'a str,
    /// A token model's sequence length.
    pub seq_len: Option<usize>,
    /// As `--dtype` names it.
    pub precision: &'a str,
    pub kernel_options: String,
    pub seed: u64,
    /// The GPU sampler's interval beside each step; `None`: no sampler.
    pub sample_interval: Option<std::time::Duration>,
}

impl<'a> RowHead<'a> {
    /// The head of the rows of a job of `spec` in the invocation `context`.
    pub fn of(
        context: &'a crate::run::record::RunContext,
        cell: &'a CellIdentity,
        device: &'a DeviceInfo,
        fingerprint: &'a Fingerprint,
        model: &'a workloads::ModelInfo,
        spec: &'a crate::run::RunSpec,
    ) -> RowHead<'a> {
        RowHead {
            invocation_id: &context.invocation_id,
            host: &context.host,
            cell,
            device,
            fingerprint,
            model: &model.name,
            family: model.family.as_str(),
            seq_len: model.input.seq_len(),
            precision: spec.precision.as_str(),
            kernel_options: spec.kernels.canonical(),
            seed: spec.seed,
            sample_interval: spec.sample_interval,
        }
    }
}

/// What every row of one load job shares.
pub struct JobIdentity<'a> {
    pub head: RowHead<'a>,
    pub settings: &'a LoadSettings,
    /// The user's server that answered, where it was one (`migprof load --endpoint`).
    pub server: Option<&'a ServerRow>,
}

/// A user's server behind a job's rows: who answered and how it was asked.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerRow {
    /// The server's name and version as it gives them (`triton 2.51.0`).
    pub engine: String,
    pub protocol: String,
    pub endpoint: String,
    /// The command migprof started the server with; `None`: a server already running.
    pub command: Option<String>,
    /// The request's tensors: `name [shape] DATATYPE`, comma-separated.
    pub inputs: String,
    /// How the tensors travelled: `json` or `binary`.
    pub encoding: String,
    /// Samples a request holds.
    pub request_batch: usize,
}

/// What a step offered and what decided its length: a search's step and minimum, or seconds of
/// arrivals; the rate (none for a server's step at a fixed concurrency).
fn offer_columns(
    id: &JobIdentity,
    step: &Step,
    search: Option<&SearchStep>,
    client: Option<&ClientRow>,
) -> Vec<Column> {
    vec![
        Column::new("capacity_id".into(), vec![search.map(|s| s.capacity_id.clone())]),
        Column::new("search_step".into(), vec![search.map(|s| s.index as i64)]),
        // What decided the step's length: its seconds of arrivals, or a search's minimum count.
        Column::new(
            "duration_s".into(),
            vec![search.is_none().then_some(id.settings.duration_secs)],
        ),
        Column::new(
            "min_requests".into(),
            vec![search.map(|_| id.settings.min_requests as i64)],
        ),
        // A step at a fixed concurrency offers no rate.
        Column::new(
            "offered_qps".into(),
            vec![client
                .is_none_or(|c| c.concurrency.is_none())
                .then_some(step.offered_qps)],
        ),
    ]
}

/// The measured requests' latency: mean, percentiles and p99's interval.
fn latency_columns(step: &Step) -> Vec<Column> {
    let st = &step.stats;
    let interval = |high: bool| {
        step.p99_interval
            .as_ref()
            .ok()
            .map(|i| if high { i.high } else { i.low })
    };
    vec![
        col("mean_ms", vec![st.mean_ms()]),
        col("p50_ms", vec![ns_to_ms(st.p50_ns)]),
        col("p90_ms", vec![ns_to_ms(st.p90_ns)]),
        col("p99_ms", vec![ns_to_ms(st.p99_ns)]),
        col("p999_ms", vec![ns_to_ms(st.p999_ns)]),
        col("max_ms", vec![ns_to_ms(st.max_ns)]),
        Column::new("p99_ms_ci_low".into(), vec![interval(false)]),
        Column::new("p99_ms_ci_high".into(), vec![interval(true)]),
    ]
}

/// A server's step as its client saw it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ClientRow {
    /// Requests always in flight; `None`: the step offered a rate.
    pub concurrency: Option<usize>,
    /// Measured requests that failed (left out of the latencies), and the most frequent reasons.
    pub failed: usize,
    pub failures: Option<String>,
    /// The client's own time per request, ms.
    pub overhead_p50_ms: f64,
    pub overhead_p99_ms: f64,
    /// Measured requests started over 1 ms after they were due.
    pub late: usize,
    /// Whether NVML saw the server's processes on the target; `None`: not checked (no GPU, no
    /// sampler, or a server migprof did not start).
    pub on_target: Option<bool>,
}

/// The columns a row of a serving job starts with: its id, when, where, the cell, the model
/// (`after_dtype` right after its dtype), the device, the seed, the kernels and the sampler.
pub(crate) fn head_columns(
    h: &RowHead,
    row_id: (&str, &str),
    (started, finished): (DateTime<Utc>, DateTime<Utc>),
    after_dtype: Vec<Column>,
) -> Vec<Column> {
    let mut columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION]),
        col(row_id.0, vec![row_id.1.to_string()]),
        col("invocation_id", vec![h.invocation_id.to_string()]),
        utc_micros("started_at", vec![started.timestamp_micros()]),
        utc_micros("finished_at", vec![finished.timestamp_micros()]),
        col("host", vec![h.host.to_string()]),
    ];
    columns.extend(cell_columns(&[h.cell]));
    columns.extend([
        col("model", vec![h.model.to_string()]),
        col("family", vec![h.family.to_string()]),
        col("dtype", vec![h.precision.to_string()]),
    ]);
    columns.extend(after_dtype);
    columns.push(col("profile", vec![profile_of(h.device)]));
    columns.extend(device_columns(&[h.device]));
    columns.extend([
        col("seed", vec![h.seed]),
        col("kernel_options", vec![h.kernel_options.clone()]),
        Column::new(
            "sample_interval_ms".into(),
            vec![h
                .sample_interval
                .filter(|_| h.device.selected.is_some())
                .map(|d| d.as_millis() as i64)],
        ),
    ]);
    columns
}

/// The columns a row of a serving job ends with: migprof's version and commit, the environment.
pub(crate) fn closing_columns(f: &Fingerprint) -> Vec<Column> {
    let mut columns = vec![
        col("migprof_version", vec![provenance::VERSION.to_string()]),
        col("git_commit", vec![provenance::GIT_COMMIT.to_string()]),
    ];
    columns.extend(fingerprint_columns(&[f]));
    columns
}

/// The slice a row's capacity belongs to: the MIG profile, the emulated one (or `mps:<pct>%`), `full`
/// for a whole GPU, `cpu`.
pub fn profile_of(device: &DeviceInfo) -> String {
    if let Some(e) = &device.emulation {
        return e
            .share
            .profile
            .clone()
            .unwrap_or_else(|| format!("mps:{}%", e.share.percent));
    }
    match &device.selected {
        Some(s) => s.mig.as_ref().map_or("full".to_string(), |m| m.profile.clone()),
        None => "cpu".to_string(),
    }
}

/// The columns every load and capacity row starts with.
fn identity_columns(
    id: &JobIdentity,
    row_id: (&str, &str),
    started: DateTime<Utc>,
    finished: DateTime<Utc>,
) -> Vec<Column> {
    let h = &id.head;
    let seq_len = Column::new("seq_len".into(), vec![h.seq_len.map(|l| l as i64)]);
    let mut columns = head_columns(h, row_id, (started, finished), vec![seq_len]);
    let s = id.settings;
    columns.extend([
        col("arrival", vec![s.arrival.as_str().to_string()]),
        col("arrival_seed", vec![s.arrival_seed]),
        col("max_batch", vec![s.max_batch as i64]),
        col("max_delay_ms", vec![s.max_delay_ms]),
        col("warmup_s", vec![s.warmup_secs]),
        Column::new("slo_p99_ms".into(), vec![s.slo_p99_ms]),
    ]);
    let server = id.server;
    let text = |f: fn(&ServerRow) -> Option<String>| server.and_then(f);
    columns.extend([
        Column::new("engine".into(), vec![text(|s| Some(s.engine.clone()))]),
        Column::new("protocol".into(), vec![text(|s| Some(s.protocol.clone()))]),
        Column::new("endpoint".into(), vec![text(|s| Some(s.endpoint.clone()))]),
        Column::new("server_command".into(), vec![text(|s| s.command.clone())]),
        Column::new("request_inputs".into(), vec![text(|s| Some(s.inputs.clone()))]),
        Column::new("encoding".into(), vec![text(|s| Some(s.encoding.clone()))]),
        Column::new("request_batch".into(), vec![server.map(|s| s.request_batch as i64)]),
    ]);
    columns
}

/// Where a step of a search belongs.
#[derive(Debug, Clone)]
pub struct SearchStep {
    pub capacity_id: String,
    pub index: usize,
}

/// The step's batches (`load_batches`): when each was dispatched and done, its size and the queue
/// behind it.
fn write_batches(out: &Path, file: &str, load_id: &str, step: &Step) -> Result<()> {
    let b = &step.served.batches;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let mut batches = DataFrame::new(
        b.len(),
        vec![
            Column::new("schema_version".into(), vec![SCHEMA_VERSION; b.len()]),
            Column::new("load_id".into(), vec![load_id; b.len()]),
            col("batch_index", (0..b.len() as i64).collect::<Vec<i64>>()),
            col(
                "dispatched_ms",
                b.iter().map(|b| ms(b.dispatched)).collect::<Vec<f64>>(),
            ),
            col("done_ms", b.iter().map(|b| ms(b.done)).collect::<Vec<f64>>()),
            col("size", b.iter().map(|b| b.size as i64).collect::<Vec<i64>>()),
            col("queued", b.iter().map(|b| b.queued as i64).collect::<Vec<i64>>()),
        ],
    )?;
    write_part(&out.join(Table::LoadBatches.dir_name()), file, &mut batches)?;
    Ok(())
}

/// Writes a step's `load` row and its `load_batches` part (batches first: a row is only ever present
/// with them).
pub fn write_step(
    out: &Path,
    id: &JobIdentity,
    load_id: &str,
    started: DateTime<Utc>,
    step: &Step,
    search: Option<&SearchStep>,
    client: Option<&ClientRow>,
) -> Result<()> {
    let file = format!("part-{load_id}.parquet");
    write_batches(out, &file, load_id, step)?;

    let st = &step.stats;
    let (queue_mean, queue_max) = step.queue_at_dispatch();
    let counts = Series::new("".into(), step.batch_size_counts(id.settings.max_batch));
    let mut counts: ListChunked = std::iter::once(Some(counts)).collect();
    counts.rename("batch_size_counts".into());
    let mut columns = identity_columns(id, ("load_id", load_id), started, provenance::now());
    columns.extend(offer_columns(id, step, search, client));
    columns.extend([
        col("achieved_qps", vec![step.achieved_qps]),
        col("requests", vec![step.served.latencies_ns.len() as i64]),
        col("unfinished", vec![step.served.unfinished_ns.len() as i64]),
        col("measured_s", vec![step.served.window.as_secs_f64()]),
    ]);
    columns.extend(latency_columns(step));
    columns.extend([
        col("mean_batch", vec![step.mean_batch()]),
        counts.into_series().into_column(),
        col("queue_mean", vec![queue_mean]),
        col("queue_max", vec![queue_max as i64]),
        Column::new("meets_slo".into(), vec![step.meets]),
        col("ending", vec![ending_name(&step.served.ending).to_string()]),
        col("service_p50_ms", vec![step.service.p50_ms]),
        col("service_p99_ms", vec![step.service.p99_ms]),
        col("service_max_ms", vec![step.service.max_ms]),
        col("stalled_batches", vec![step.service.stalled as i64]),
        col("verdict", vec![step.verdict().as_str().to_string()]),
        Column::new("throttle_share".into(), vec![step.evidence.throttle_share]),
        Column::new("power_cap_share".into(), vec![step.evidence.power_cap_share]),
        Column::new("other_processes".into(), vec![step.evidence.others_text()]),
        col("metric_samples", vec![step.metrics.samples as i64]),
        Column::new("fb_used_max_mib".into(), vec![step.metrics.fb_used_max_mib]),
        Column::new("gract_mean".into(), vec![step.metrics.gract_mean]),
        Column::new(
            "gpm_scope".into(),
            vec![step.metrics.has_gpm().then(|| id.head.device.gpm_scope()).flatten()],
        ),
        Column::new("gpu_power_mean_w".into(), vec![step.metrics.gpu_power_mean_w]),
        Column::new("j_per_sample".into(), vec![step.metrics.j_per_sample]),
        Column::new("note".into(), vec![step.note.clone()]),
        Column::new("histogram".into(), vec![st.histogram_v2_deflate()?.as_slice()]),
        Column::new(
            "concurrency".into(),
            vec![client.and_then(|c| c.concurrency.map(|n| n as i64))],
        ),
        Column::new("failed_requests".into(), vec![client.map(|c| c.failed as i64)]),
        Column::new("failures".into(), vec![client.and_then(|c| c.failures.clone())]),
        Column::new("client_overhead_p50_ms".into(), vec![client.map(|c| c.overhead_p50_ms)]),
        Column::new("client_overhead_p99_ms".into(), vec![client.map(|c| c.overhead_p99_ms)]),
        Column::new("client_late".into(), vec![client.map(|c| c.late as i64)]),
        Column::new("server_on_target".into(), vec![client.and_then(|c| c.on_target)]),
    ]);
    columns.extend(closing_columns(id.head.fingerprint));
    let mut df = DataFrame::new(1, columns)?;
    write_part(&out.join(Table::Load.dir_name()), &file, &mut df)?;
    Ok(())
}

fn ending_name(e: &crate::load::serve::Ending) -> &'static str {
    use crate::load::serve::Ending;
    match e {
        Ending::Schedule => "schedule",
        Ending::Within => "within",
        Ending::Over(_) => "over",
        Ending::Backlog => "backlog",
    }
}

/// A search's result: the target's capacity for the model, dtype, sequence length and objective.
pub struct Capacity<'a> {
    pub capacity_id: &'a str,
    pub started: DateTime<Utc>,
    pub outcome: &'a SearchOutcome,
    /// The highest rate a closed loop at the max batch served: the search's first guess came from it.
    pub closed_loop_qps: f64,
    /// p99 of the step at the capacity, ms.
    pub p99_at_capacity_ms: Option<f64>,
    /// The worst verdict of the search's steps.
    pub verdict: &'a str,
}

pub fn write_capacity(out: &Path, id: &JobIdentity, c: &Capacity) -> Result<()> {
    let o = c.outcome;
    let mut columns = identity_columns(id, ("capacity_id", c.capacity_id), c.started, provenance::now());
    columns.extend([
        Column::new("capacity_qps".into(), vec![o.capacity_qps]),
        col("resolution", vec![id.settings.resolution]),
        col("min_requests", vec![id.settings.min_requests as i64]),
        Column::new("bracket_low_qps".into(), vec![o.low]),
        Column::new("bracket_high_qps".into(), vec![o.high]),
        col("steps", vec![o.steps.len() as i64]),
        Column::new("p99_at_capacity_ms".into(), vec![c.p99_at_capacity_ms]),
        col("closed_loop_qps", vec![c.closed_loop_qps]),
        col("emulated", vec![id.head.device.emulation.is_some()]),
        col("verdict", vec![c.verdict.to_string()]),
        Column::new("note".into(), vec![o.note.clone()]),
    ]);
    columns.extend(closing_columns(id.head.fingerprint));
    let mut df = DataFrame::new(1, columns)?;
    write_part(
        &out.join(Table::Capacity.dir_name()),
        &format!("part-{}.parquet", c.capacity_id),
        &mut df,
    )?;
    Ok(())
}
