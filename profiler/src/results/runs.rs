//! The `runs`, `samples` and `metrics` tables: the columns of a run's row, of its measured
//! iterations and of its sampler readings, the identity columns every table starts with, and the row
//! of a cell that left no measurement. A run's samples and metrics are written before its row.

use std::path::{Path, PathBuf};

use anyhow::Result;
use polars::prelude::*;

use crate::device::DeviceInfo;
use crate::provenance;
use crate::results::parts::{col, conform, utc_micros, write_part, Table, SCHEMA_VERSION};
use crate::run::fingerprint::Fingerprint;
use crate::run::record::{CellIdentity, Failure};
use crate::run::stats::ns_to_ms;
use crate::run::uncertainty::{Estimate, Uncertainty};
use crate::run::Run;

/// Where one run's parts were written.
#[derive(Debug, Clone)]
pub struct Written {
    pub runs: PathBuf,
    pub samples: PathBuf,
    /// `None` for a run without sampler readings.
    pub metrics: Option<PathBuf>,
}

/// Writes the run's samples and metrics, then its row: a `runs` row is only ever present with them.
pub fn write_run(out: &Path, run: &Run) -> Result<Written> {
    let file = format!("part-{}.parquet", run.run_id);
    let samples = write_part(&out.join(Table::Samples.dir_name()), &file, &mut samples_frame(run)?)?;
    let metrics = if run.metrics.is_empty() {
        None
    } else {
        Some(write_part(
            &out.join(Table::Metrics.dir_name()),
            &file,
            &mut metrics_frame(run)?,
        )?)
    };
    let runs = write_part(
        &out.join(Table::Runs.dir_name()),
        &file,
        &mut runs_frame(std::slice::from_ref(run))?,
    )?;
    Ok(Written { runs, samples, metrics })
}

fn summary(runs: &[Run], f: impl Fn(&crate::gpu::sampler::MetricSummary) -> Option<f64>) -> Vec<Option<f64>> {
    runs.iter().map(|r| f(&r.metric_summary)).collect()
}

/// The `metrics` table: every sampler reading of one run.
fn metrics_frame(run: &Run) -> Result<DataFrame> {
    let m = &run.metrics;
    let f = |g: fn(&crate::gpu::sampler::Sample) -> Option<f64>| m.iter().map(g).collect::<Vec<Option<f64>>>();
    let u = |g: fn(&crate::gpu::sampler::Sample) -> Option<u32>| {
        m.iter().map(|s| g(s).map(i64::from)).collect::<Vec<Option<i64>>>()
    };
    let gpm = |g: fn(&crate::gpu::sampler::Gpm) -> Option<f64>| {
        m.iter()
            .map(|s| s.gpm.as_ref().and_then(g))
            .collect::<Vec<Option<f64>>>()
    };
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION; m.len()]),
        Column::new("run_id".into(), vec![run.run_id.as_str(); m.len()]),
        col("t_ms", m.iter().map(|s| s.t.as_secs_f64() * 1e3).collect::<Vec<f64>>()),
        col("fb_used_mib", f(|s| s.fb_used_mib)),
        col("fb_total_mib", f(|s| s.fb_total_mib)),
        col("gpu_power_w", f(|s| s.gpu_power_w)),
        col(
            "gpu_energy_mj",
            m.iter()
                .map(|s| s.gpu_energy_mj.map(|e| e as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col("gpu_sm_clock_mhz", u(|s| s.gpu_sm_clock_mhz)),
        col("gpu_mem_clock_mhz", u(|s| s.gpu_mem_clock_mhz)),
        col("gpu_temperature_c", u(|s| s.gpu_temperature_c)),
        col(
            "gpu_throttle_reasons",
            m.iter()
                .map(|s| s.gpu_throttle_reasons.map(|r| r as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col(
            "compute_processes",
            m.iter()
                .map(|s| s.compute_processes.as_ref().map(|p| p.len() as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col("util_gpu_pct", u(|s| s.util_gpu_pct)),
        col("util_mem_pct", u(|s| s.util_mem_pct)),
        col("gract", gpm(|g| g.graphics)),
        col("sm_util", gpm(|g| g.sm)),
        col("sm_occupancy", gpm(|g| g.sm_occupancy)),
        col("tensor_util", gpm(|g| g.tensor)),
        col("dram_bw_util", gpm(|g| g.dram_bandwidth)),
        col("fp32_util", gpm(|g| g.fp32)),
        col("fp16_util", gpm(|g| g.fp16)),
    ];
    Ok(DataFrame::new(m.len(), columns)?)
}

/// Which cell each row belongs to and how it ended (`error` is null: a row with a measurement has none).
pub(crate) fn cell_columns(cells: &[&CellIdentity]) -> Vec<Column> {
    vec![
        Column::new(
            "sweep".into(),
            cells.iter().map(|c| c.sweep.clone()).collect::<Vec<Option<String>>>(),
        ),
        col(
            "target",
            cells.iter().map(|c| c.target.clone()).collect::<Vec<String>>(),
        ),
        col(
            "cell_id",
            cells.iter().map(|c| c.cell_id.clone()).collect::<Vec<String>>(),
        ),
        col(
            "status",
            cells
                .iter()
                .map(|c| c.status.as_str().to_string())
                .collect::<Vec<String>>(),
        ),
        Column::new("error".into(), vec![None::<String>; cells.len()]),
        Column::new(
            "concurrency_group".into(),
            cells
                .iter()
                .map(|c| c.concurrency_group.clone())
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(
            "neighbours".into(),
            cells
                .iter()
                .map(|c| neighbours(&c.neighbours))
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(
            "baseline".into(),
            cells.iter().map(|c| c.baseline).collect::<Vec<bool>>(),
        ),
        Column::new(
            "cell_settings".into(),
            cells
                .iter()
                .map(|c| c.settings.clone())
                .collect::<Vec<Option<String>>>(),
        ),
    ]
}

/// Where each row ran: the device, its GPU and MIG identity, an emulated slice's share.
pub(crate) fn device_columns(devices: &[&DeviceInfo]) -> Vec<Column> {
    let identity = |f: &dyn Fn(&crate::gpu::Selected) -> Option<String>| {
        devices
            .iter()
            .map(|d| d.selected.as_ref().and_then(f))
            .collect::<Vec<Option<String>>>()
    };
    let number = |f: &dyn Fn(&crate::gpu::Selected) -> Option<i64>| {
        devices
            .iter()
            .map(|d| d.selected.as_ref().and_then(f))
            .collect::<Vec<Option<i64>>>()
    };
    let emulation = |f: &dyn Fn(&crate::mps::Emulation) -> Option<i64>| {
        devices
            .iter()
            .map(|d| d.emulation.as_ref().and_then(f))
            .collect::<Vec<Option<i64>>>()
    };
    let memory_system = |f: &dyn Fn(&crate::gpu::memory_system::MemorySystem) -> Option<f64>| {
        devices
            .iter()
            .map(|d| d.memory_system.as_ref().and_then(f))
            .collect::<Vec<Option<f64>>>()
    };
    // A memory-partitioned slice's neighbour and its calibration, per row.
    let partitions: Vec<Option<&crate::mps::partition::Partition>> = devices
        .iter()
        .map(|d| d.emulation.as_ref().and_then(|e| e.partition.as_ref()))
        .collect();
    let partition = |f: &dyn Fn(&crate::mps::partition::Partition) -> Option<f64>| {
        partitions.iter().map(|p| p.and_then(f)).collect::<Vec<Option<f64>>>()
    };
    let partition_int = |f: &dyn Fn(&crate::mps::partition::Partition) -> Option<i64>| {
        partitions.iter().map(|p| p.and_then(f)).collect::<Vec<Option<i64>>>()
    };
    vec![
        col(
            "device_kind",
            devices.iter().map(|d| d.kind.to_string()).collect::<Vec<String>>(),
        ),
        col(
            "device_name",
            devices.iter().map(|d| d.name.clone()).collect::<Vec<String>>(),
        ),
        Column::new("gpu_name".into(), identity(&|s| Some(s.gpu.name.clone()))),
        Column::new("gpu_uuid".into(), identity(&|s| Some(s.gpu.uuid.clone()))),
        Column::new("mig_uuid".into(), identity(&|s| s.mig.as_ref().map(|m| m.uuid.clone()))),
        Column::new(
            "mig_profile".into(),
            identity(&|s| s.mig.as_ref().map(|m| m.profile.clone())),
        ),
        Column::new(
            "gpu_instance_id".into(),
            number(&|s| s.mig.as_ref().map(|m| m.gpu_instance_id as i64)),
        ),
        Column::new(
            "compute_instance_id".into(),
            number(&|s| s.mig.as_ref().map(|m| m.compute_instance_id as i64)),
        ),
        // What the run could use: the slice's, or an MPS client's as measured (else its share's).
        Column::new(
            "sm_count".into(),
            devices
                .iter()
                .map(|d| match (&d.emulation, &d.selected) {
                    (Some(e), _) => Some(i64::from(e.measured_sms.unwrap_or(e.share.profile_sms))),
                    (None, Some(s)) => s.mig.as_ref().map(|m| m.sm_count).or(s.gpu.sm_count).map(i64::from),
                    (None, None) => None,
                })
                .collect::<Vec<Option<i64>>>(),
        ),
        // What migprof's kernels sized their grids to: the driver's count (a slice's where it tells
        // the process its slice), apart from `sm_count` so that a row says if they differed.
        Column::new(
            "kernel_sm_count".into(),
            devices
                .iter()
                .map(|d| d.kernel_sms.map(i64::from))
                .collect::<Vec<Option<i64>>>(),
        ),
        Column::new(
            "device_memory_mib".into(),
            devices
                .iter()
                .map(|d| d.memory_mib().map(|m| m as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        Column::new(
            "emulation".into(),
            devices
                .iter()
                .map(|d| d.emulation.as_ref().map(|_| "mps".to_string()))
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(
            "emulated_profile".into(),
            devices
                .iter()
                .map(|d| d.emulation.as_ref().and_then(|e| e.share.profile.clone()))
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new("mps_share_pct".into(), emulation(&|e| Some(i64::from(e.share.percent)))),
        Column::new(
            "profile_sms".into(),
            emulation(&|e| Some(i64::from(e.share.profile_sms))),
        ),
        Column::new("measured_sms".into(), emulation(&|e| e.measured_sms.map(i64::from))),
        Column::new(
            "mps_memory_limit_mib".into(),
            emulation(&|e| e.share.memory_limit_mib.map(|m| m as i64)),
        ),
        Column::new(
            "measured_memory_mib".into(),
            emulation(&|e| e.measured_memory_mib.map(|m| m as i64)),
        ),
        Column::new(
            "measured_bandwidth_gbps".into(),
            memory_system(&|m| Some(m.bandwidth_gbps)),
        ),
        Column::new("measured_l2_mib".into(), memory_system(&|m| m.l2_mib)),
        // A memory-partitioned emulated slice: its neighbour and what it was set to.
        Column::new(
            "memory_emulation".into(),
            devices
                .iter()
                .map(|d| d.emulation.as_ref().map(|e| e.memory().as_str().to_string()))
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new("gpu_bandwidth_gbps".into(), partition(&|p| Some(p.gpu_bandwidth_gbps))),
        Column::new("memory_share_gbps".into(), partition(&|p| Some(p.share_gbps))),
        Column::new("alone_bandwidth_gbps".into(), partition(&|p| p.alone_bandwidth_gbps)),
        Column::new(
            "calibration".into(),
            partitions
                .iter()
                .map(|p| p.map(|p| p.outcome.as_str().to_string()))
                .collect::<Vec<Option<String>>>(),
        ),
        Column::new(
            "calibration_cached".into(),
            partitions
                .iter()
                .map(|p| p.map(|p| p.cached))
                .collect::<Vec<Option<bool>>>(),
        ),
        Column::new(
            "neighbour_blocks".into(),
            partition_int(&|p| p.load.map(|l| i64::from(l.blocks))),
        ),
        Column::new(
            "neighbour_pause_ns".into(),
            partition_int(&|p| p.load.map(|l| i64::from(l.pause_ns))),
        ),
        Column::new(
            "neighbour_sms".into(),
            partition_int(&|p| p.neighbour_sms.map(i64::from)),
        ),
        Column::new("shared_sms".into(), partition_int(&|p| p.shared_sms.map(i64::from))),
        Column::new("compute_slowdown_pct".into(), partition(&|p| p.compute_slowdown_pct)),
        Column::new(
            "calibration_sm_clock_mhz".into(),
            partition_int(&|p| p.sm_clock_mhz.map(i64::from)),
        ),
        Column::new(
            "calibration_throttle_reasons".into(),
            partition_int(&|p| p.throttle_reasons.map(|r| r as i64)),
        ),
    ]
}

/// The `runs` table: one row per run.
pub fn runs_frame(runs: &[Run]) -> Result<DataFrame> {
    let s = |f: fn(&Run) -> String| runs.iter().map(f).collect::<Vec<String>>();
    let i = |f: fn(&Run) -> i64| runs.iter().map(f).collect::<Vec<i64>>();
    let ms = |f: fn(&Run) -> u64| runs.iter().map(|r| ns_to_ms(f(r))).collect::<Vec<f64>>();
    let x = |f: fn(&Run) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
    // The columns a run may have no value for: null there.
    let maybe_s = |f: fn(&Run) -> Option<String>| runs.iter().map(f).collect::<Vec<Option<String>>>();
    let maybe_i = |f: fn(&Run) -> Option<i64>| runs.iter().map(f).collect::<Vec<Option<i64>>>();
    let maybe_x = |f: fn(&Run) -> Option<f64>| runs.iter().map(f).collect::<Vec<Option<f64>>>();
    let histograms = runs
        .iter()
        .map(|r| r.stats.histogram_v2_deflate())
        .collect::<Result<Vec<_>>>()?;
    let histogram_refs: Vec<&[u8]> = histograms.iter().map(|h| h.as_slice()).collect();
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION; runs.len()]),
        col("run_id", s(|r| r.run_id.clone())),
        col("invocation_id", s(|r| r.context.invocation_id.clone())),
        utc_micros("started_at", i(|r| r.started_at.timestamp_micros())),
        utc_micros("finished_at", i(|r| r.finished_at.timestamp_micros())),
        col("host", s(|r| r.context.host.clone())),
    ]
    .into_iter()
    .chain(cell_columns(&runs.iter().map(|r| &r.cell).collect::<Vec<_>>()))
    .chain([
        col("model", s(|r| r.model.name.to_string())),
        col("family", s(|r| r.model.family.as_str().to_string())),
        col("mode", s(|r| r.mode.as_str().to_string())),
        col("dtype", s(|r| r.precision().to_string())),
        col("batch", i(|r| r.batch as i64)),
        col("seq_len", maybe_i(|r| r.model.input.seq_len().map(|l| l as i64))),
        col(
            "prompt_len",
            maybe_i(|r| r.generation.as_ref().map(|g| g.lengths.prompt as i64)),
        ),
        col(
            "output_len",
            maybe_i(|r| r.generation.as_ref().map(|g| g.lengths.output as i64)),
        ),
        col(
            "kv_layout",
            maybe_s(|r| r.generation.as_ref().map(|g| g.kv_layout.as_str().to_string())),
        ),
        col(
            "kv_block_size",
            maybe_i(|r| {
                r.generation
                    .as_ref()
                    .and_then(|g| g.kv_layout.block_size())
                    .map(|b| b.get() as i64)
            }),
        ),
    ])
    .chain(device_columns(
        &runs.iter().map(|r| &r.context.device).collect::<Vec<_>>(),
    ))
    .chain([
        Column::new("seed".into(), runs.iter().map(|r| r.seed).collect::<Vec<u64>>()),
        col("weights", maybe_s(|r| r.weights.clone())),
        col("optimizer", maybe_s(|r| r.optimizer.clone())),
        col("master_weights", maybe_s(|r| r.master_weights.map(str::to_string))),
        col("loss_scale", maybe_x(|r| r.measurement.loss_scale)),
        col(
            "skipped_steps",
            maybe_i(|r| r.measurement.skipped_steps.map(|n| n as i64)),
        ),
        col("kernel_options", s(|r| r.kernels.canonical())),
        col("warmup_iterations", i(|r| r.warmup_iterations as i64)),
        col("iterations", i(|r| r.stats.iterations as i64)),
        col("measured_s", x(|r| r.measurement.elapsed.as_secs_f64())),
        col("mean_ms", x(|r| r.stats.mean_ms())),
        col("std_ms", maybe_x(|r| r.stats.std_ns.map(|s| s / 1e6))),
        col("min_ms", ms(|r| r.stats.min_ns)),
        col("max_ms", ms(|r| r.stats.max_ns)),
        col("p50_ms", ms(|r| r.stats.p50_ns)),
        col("p90_ms", ms(|r| r.stats.p90_ns)),
        col("p95_ms", ms(|r| r.stats.p95_ns)),
        col("p99_ms", ms(|r| r.stats.p99_ns)),
        col("p999_ms", ms(|r| r.stats.p999_ns)),
        col("throughput", x(Run::throughput)),
        interval("mean_ms_ci_low", runs, |u| &u.mean_ms, false),
        interval("mean_ms_ci_high", runs, |u| &u.mean_ms, true),
        interval("throughput_ci_low", runs, |u| &u.throughput, false),
        interval("throughput_ci_high", runs, |u| &u.throughput, true),
        interval("p50_ms_ci_low", runs, |u| &u.p50_ms, false),
        interval("p50_ms_ci_high", runs, |u| &u.p50_ms, true),
        interval("p99_ms_ci_low", runs, |u| &u.p99_ms, false),
        interval("p99_ms_ci_high", runs, |u| &u.p99_ms, true),
        col("ci_note", maybe_s(|r| r.uncertainty.note())),
        col("wall_throughput", x(Run::wall_throughput)),
        col(
            "generations",
            maybe_i(|r| r.generation.as_ref().map(|g| g.count() as i64)),
        ),
        col(
            "ttft_mean_ms",
            maybe_x(|r| r.generation.as_ref().map(|g| g.prefill.mean_ms())),
        ),
        col(
            "ttft_p50_ms",
            maybe_x(|r| r.generation.as_ref().map(|g| ns_to_ms(g.prefill.p50_ns))),
        ),
        col(
            "ttft_p99_ms",
            maybe_x(|r| r.generation.as_ref().map(|g| ns_to_ms(g.prefill.p99_ns))),
        ),
        col("prefill_tokens_per_s", maybe_x(Run::prefill_tokens_per_s)),
        col(
            "decode_tokens_per_s",
            maybe_x(|r| r.generation.as_ref().map(|_| r.throughput())),
        ),
        col(
            "kv_cache_bytes",
            maybe_i(|r| r.generation.as_ref().map(|g| g.kv_cache_bytes as i64)),
        ),
        col(
            "kv_cache_bytes_per_seq",
            maybe_i(|r| {
                r.generation
                    .as_ref()
                    .map(|g| (g.kv_cache_bytes / r.batch.max(1) as u64) as i64)
            }),
        ),
        Column::new(
            "loss_first".into(),
            runs.iter().map(|r| r.measurement.loss_first).collect::<Vec<_>>(),
        ),
        Column::new(
            "loss_last".into(),
            runs.iter().map(|r| r.measurement.loss_last).collect::<Vec<_>>(),
        ),
        col("params", i(|r| r.model.params as i64)),
        col("flops_per_sample", i(|r| r.flops_per_sample() as i64)),
        col("sample_interval_ms", maybe_i(|r| r.sample_interval_ms())),
        col("metric_samples", i(|r| r.metric_summary.samples as i64)),
        Column::new("fb_used_mean_mib".into(), summary(runs, |m| m.fb_used_mean_mib)),
        Column::new("fb_used_max_mib".into(), summary(runs, |m| m.fb_used_max_mib)),
        Column::new("gract_mean".into(), summary(runs, |m| m.gract_mean)),
        Column::new("gract_std".into(), summary(runs, |m| m.gract_std)),
        Column::new("sm_util_mean".into(), summary(runs, |m| m.sm_util_mean)),
        Column::new("tensor_mean".into(), summary(runs, |m| m.tensor_mean)),
        Column::new("dram_mean".into(), summary(runs, |m| m.dram_mean)),
        col(
            "gpm_scope",
            maybe_s(|r| {
                r.metric_summary
                    .has_gpm()
                    .then(|| r.context.device.gpm_scope())
                    .flatten()
                    .map(str::to_string)
            }),
        ),
        Column::new("gpu_power_mean_w".into(), summary(runs, |m| m.gpu_power_mean_w)),
        Column::new("gpu_energy_j".into(), summary(runs, |m| m.gpu_energy_j)),
        Column::new("j_per_sample".into(), summary(runs, |m| m.j_per_sample)),
        col("sampler_error", maybe_s(|r| r.sampler_error.clone())),
        col("verdict", s(|r| r.assessment.verdict.as_str().to_string())),
        col("verdict_reason", s(|r| r.assessment.reason.clone())),
        col("outliers", i(|r| r.assessment.outliers as i64)),
        col("outlier_mean_shift", x(|r| r.assessment.outlier_mean_shift)),
        flags_column(runs),
        col("throttle_share", maybe_x(|r| r.evidence.throttle_share)),
        col("power_cap_share", maybe_x(|r| r.evidence.power_cap_share)),
        col("other_processes", maybe_s(|r| r.evidence.others_text())),
        Column::new("histogram".into(), histogram_refs),
        col("migprof_version", s(|_| provenance::VERSION.to_string())),
        col("git_commit", s(|_| provenance::GIT_COMMIT.to_string())),
    ])
    .collect();
    let fingerprints: Vec<&Fingerprint> = runs.iter().map(|r| &r.fingerprint).collect();
    let mut columns: Vec<Column> = columns;
    columns.extend(fingerprint_columns(&fingerprints));
    Ok(DataFrame::new(runs.len(), columns)?)
}

/// A group member's neighbours as a row holds them: `target:model/mode/dtype/batch`, comma-separated.
fn neighbours(list: &[String]) -> Option<String> {
    (!list.is_empty()).then(|| list.join(","))
}

/// `verdict_flags`: a list of strings per run, every flag that applies (empty when none does).
fn flags_column(runs: &[Run]) -> Column {
    let lists: Vec<Series> = runs
        .iter()
        .map(|r| Series::new("".into(), r.assessment.flag_names()))
        .collect();
    let mut list: ListChunked = lists.into_iter().map(Some).collect();
    list.rename("verdict_flags".into());
    // A list of no runs has no element type to infer: it is a list of names whatever the rows.
    list.into_series()
        .cast(&DataType::List(Box::new(DataType::String)))
        .expect("a list of strings casts to itself")
        .into_column()
}

/// The columns of the `runs` table and their types: what a row of a run has. A failed cell's row has
/// them all too, null where nothing was measured.
pub fn runs_schema() -> Result<Schema> {
    Ok(runs_frame(&[])?.schema().as_ref().clone())
}

/// Writes the row of a cell that left no measurement: its identity, status and error; every
/// measurement column is null.
pub fn write_failure(out: &Path, failure: &Failure) -> Result<PathBuf> {
    let c = &failure.workload;
    let id = &failure.identity;
    let family = workloads::lookup(&c.model)
        .map(|(_, info)| info.family.as_str().to_string())
        .ok();
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION]),
        col("run_id", vec![failure.run_id.clone()]),
        col("invocation_id", vec![failure.invocation_id.clone()]),
        utc_micros("started_at", vec![failure.started_at.timestamp_micros()]),
        utc_micros("finished_at", vec![failure.finished_at.timestamp_micros()]),
        col("host", vec![failure.host.clone()]),
        Column::new("sweep".into(), vec![id.sweep.clone()]),
        col("target", vec![id.target.clone()]),
        col("cell_id", vec![id.cell_id.clone()]),
        col("status", vec![id.status.as_str().to_string()]),
        Column::new("error".into(), vec![Some(failure.error.clone())]),
        Column::new("concurrency_group".into(), vec![id.concurrency_group.clone()]),
        Column::new("neighbours".into(), vec![neighbours(&id.neighbours)]),
        Column::new("baseline".into(), vec![id.baseline]),
        Column::new("cell_settings".into(), vec![id.settings.clone()]),
        col("model", vec![c.model.clone()]),
        Column::new("family".into(), vec![family]),
        col("mode", vec![c.mode.clone()]),
        col("dtype", vec![c.dtype.clone()]),
        col("batch", vec![c.batch as i64]),
        Column::new("seq_len".into(), vec![c.seq_len.map(|l| l as i64)]),
        Column::new("prompt_len".into(), vec![c.prompt_len.map(|l| l as i64)]),
        Column::new("output_len".into(), vec![c.output_len.map(|l| l as i64)]),
        Column::new("kv_layout".into(), vec![c.kv_layout.clone()]),
        Column::new("kv_block_size".into(), vec![c.kv_block_size.map(|b| b.get() as i64)]),
        Column::new("seed".into(), vec![c.seed]),
        col("kernel_options", vec![c.kernel_options.clone()]),
        Column::new("master_weights".into(), vec![c.master_weights.clone()]),
        col("migprof_version", vec![provenance::VERSION.to_string()]),
        col("git_commit", vec![provenance::GIT_COMMIT.to_string()]),
    ];
    let mut columns = columns;
    columns.extend(fingerprint_columns(&[&failure.fingerprint]));
    let mut df = conform(&DataFrame::new(1, columns)?, &runs_schema()?)?;
    write_part(
        &out.join(Table::Runs.dir_name()),
        &format!("part-{}.parquet", failure.run_id),
        &mut df,
    )
}

/// One end of an interval per run; null where the run's samples give none (`ci_note` says why).
fn interval(name: &str, runs: &[Run], pick: fn(&Uncertainty) -> &Estimate, high: bool) -> Column {
    let v: Vec<Option<f64>> = runs
        .iter()
        .map(|r| {
            pick(&r.uncertainty)
                .as_ref()
                .ok()
                .map(|i| if high { i.high } else { i.low })
        })
        .collect();
    Column::new(name.into(), v)
}

/// The environment fingerprint's columns, one row per fingerprint.
pub(crate) fn fingerprint_columns(f: &[&Fingerprint]) -> Vec<Column> {
    let text = |g: fn(&Fingerprint) -> Option<String>| f.iter().map(|x| g(x)).collect::<Vec<Option<String>>>();
    let flag = |g: fn(&Fingerprint) -> Option<bool>| f.iter().map(|x| g(x)).collect::<Vec<Option<bool>>>();
    let mhz = |g: fn(&Fingerprint) -> Option<u32>| f.iter().map(|x| g(x).map(i64::from)).collect::<Vec<Option<i64>>>();
    vec![
        col(
            "candle_version",
            f.iter().map(|x| x.candle_version.clone()).collect::<Vec<String>>(),
        ),
        col(
            "build_features",
            f.iter().map(|x| x.build_features.clone()).collect::<Vec<String>>(),
        ),
        col("git_dirty", f.iter().map(|x| x.git_dirty).collect::<Vec<bool>>()),
        Column::new("cpu_model".into(), text(|x| x.cpu_model.clone())),
        Column::new("driver_version".into(), text(|x| x.driver_version.clone())),
        Column::new("cuda_driver_version".into(), text(|x| x.cuda_driver_version.clone())),
        Column::new("cudnn_version".into(), text(|x| x.cudnn_version.clone())),
        Column::new("cublas_version".into(), text(|x| x.cublas_version.clone())),
        Column::new("mig_mode".into(), flag(|x| x.mig_mode)),
        Column::new("persistence_mode".into(), flag(|x| x.persistence_mode)),
        Column::new(
            "power_limit_w".into(),
            f.iter().map(|x| x.power_limit_w).collect::<Vec<Option<f64>>>(),
        ),
        Column::new("sm_clock_mhz_start".into(), mhz(|x| x.sm_clock_mhz)),
        Column::new("mem_clock_mhz_start".into(), mhz(|x| x.mem_clock_mhz)),
        Column::new("ecc_enabled".into(), flag(|x| x.ecc_enabled)),
        Column::new(
            "pool_held_mib_start".into(),
            f.iter().map(|x| x.pool_held_mib).collect::<Vec<Option<f64>>>(),
        ),
    ]
}

/// The `samples` table: every measured iteration of one run.
/// A generation's rows are its decode steps (`phase` `decode`) and its prefills (`prefill`,
/// `iteration` the generation's index); other runs' are their steps (`step`).
fn samples_frame(run: &Run) -> Result<DataFrame> {
    let steps = &run.measurement.latencies_ns;
    let prefills = &run.measurement.begin_ns;
    let step_phase = if run.generation.is_some() { "decode" } else { "step" };
    let n = steps.len() + prefills.len();
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION; n]),
        Column::new("run_id".into(), vec![run.run_id.as_str(); n]),
        Column::new(
            "iteration".into(),
            (0..steps.len() as i64)
                .chain(0..prefills.len() as i64)
                .collect::<Vec<i64>>(),
        ),
        Column::new(
            "latency_ns".into(),
            steps.iter().chain(prefills).map(|&l| l as i64).collect::<Vec<i64>>(),
        ),
        Column::new(
            "phase".into(),
            std::iter::repeat_n(step_phase, steps.len())
                .chain(std::iter::repeat_n("prefill", prefills.len()))
                .collect::<Vec<&str>>(),
        ),
    ];
    Ok(DataFrame::new(n, columns)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::parts::{read_part, read_parts, read_table};
    use crate::run::record::tests::fake_run;
    use std::fs::{self, File};
    use std::time::Duration;

    fn get_f64(df: &DataFrame, name: &str, row: usize) -> f64 {
        df.column(name).unwrap().get(row).unwrap().try_extract::<f64>().unwrap()
    }

    #[test]
    fn runs_and_samples_round_trip() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let mut a = fake_run(8, 30, Duration::ZERO);
        a.fingerprint.pool_held_mib = Some(576.0);
        let b = fake_run(1, 5, Duration::from_micros(50));
        write_run(dir.path(), &a)?;
        write_run(dir.path(), &b)?;

        let runs = read_table(dir.path(), Table::Runs)?;
        assert_eq!(runs.height(), 2);
        let ids: Vec<String> = runs
            .column("run_id")?
            .str()?
            .iter()
            .map(|s| s.unwrap().to_string())
            .collect();
        let row_a = ids.iter().position(|id| *id == a.run_id).expect("run a");
        let row_b = ids.iter().position(|id| *id == b.run_id).expect("run b");
        assert_eq!(get_f64(&runs, "throughput", row_a), 4000.0);
        assert_eq!(get_f64(&runs, "mean_ms", row_a), 2.0);
        assert!(
            (get_f64(&runs, "p99_ms", row_a) - 3.0).abs() <= 3e-3,
            "within HDR precision"
        );
        assert_eq!(runs.column("verdict")?.str()?.get(row_b), Some("too_few_iterations"));
        assert_eq!(
            runs.column("seq_len")?.null_count(),
            2,
            "images have no sequence length"
        );
        assert_eq!(
            runs.column("kernel_options")?.str()?.get(row_a),
            Some("v8;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc")
        );
        assert_eq!(
            runs.column("candle_version")?.str()?.get(row_a),
            Some(provenance::CANDLE_VERSION)
        );
        assert_eq!(get_f64(&runs, "pool_held_mib_start", row_a), 576.0);
        assert_eq!(
            runs.column("pool_held_mib_start")?.f64()?.get(row_b),
            None,
            "a CPU run has no pool"
        );
        // 30 steps of 1 and 3 ms alternating: the mean's interval holds 2 ms; p99 needs 299 steps.
        let (lo, hi) = (
            get_f64(&runs, "mean_ms_ci_low", row_a),
            get_f64(&runs, "mean_ms_ci_high", row_a),
        );
        assert!(lo < 2.0 && 2.0 < hi && hi - lo < 1.0, "{lo} {hi}");
        assert!((get_f64(&runs, "throughput_ci_high", row_a) - 8000.0 / lo).abs() < 1e-6);
        assert_eq!(runs.column("p99_ms_ci_low")?.null_count(), 2);
        assert!(runs
            .column("ci_note")?
            .str()?
            .get(row_a)
            .unwrap()
            .contains("p99: 30 steps"));
        assert_eq!(
            runs.column("driver_version")?.null_count(),
            2,
            "a CPU run has no driver"
        );
        assert_eq!(runs.column("std_ms")?.null_count(), 0);
        assert_eq!(
            runs.column("started_at")?.dtype(),
            &DataType::Datetime(TimeUnit::Microseconds, Some(TimeZone::UTC))
        );

        // The stored histogram decodes to the run's latencies.
        let bytes = runs.column("histogram")?.binary()?.get(row_a).unwrap().to_vec();
        let h: hdrhistogram::Histogram<u64> = hdrhistogram::serialization::Deserializer::new()
            .deserialize(&mut bytes.as_slice())
            .unwrap();
        assert_eq!(h.len(), 30);

        let samples = read_table(dir.path(), Table::Samples)?;
        assert_eq!(samples.height(), 35);
        let lat: i64 = samples.column("latency_ns")?.i64()?.iter().flatten().sum();
        let want: u64 = a
            .measurement
            .latencies_ns
            .iter()
            .chain(&b.measurement.latencies_ns)
            .sum();
        assert_eq!(lat as u64, want);
        Ok(())
    }

    #[test]
    fn sampler_readings_and_their_summary_round_trip() -> Result<()> {
        use crate::gpu::sampler::{summarize, Gpm, Sample};
        let dir = tempfile::tempdir()?;
        let mut run = fake_run(8, 30, Duration::ZERO);
        run.metrics = (0..3u64)
            .map(|i| Sample {
                t: Duration::from_millis(100 * i),
                fb_used_mib: Some(1000.0 + 100.0 * i as f64),
                gpu_energy_mj: Some(1_000_000 + 24_000 * i),
                gpm: (i > 0).then_some(Gpm {
                    graphics: Some(90.0),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect();
        run.metric_summary = summarize(&run.metrics, 240);
        let written = write_run(dir.path(), &run)?;
        assert!(written.metrics.is_some());
        let metrics = read_table(dir.path(), Table::Metrics)?;
        assert_eq!(metrics.height(), 3);
        assert_eq!(
            metrics.column("gract")?.null_count(),
            1,
            "no GPM reading in the first sample: null, not 0"
        );
        assert_eq!(metrics.column("util_gpu_pct")?.null_count(), 3);
        let runs = read_table(dir.path(), Table::Runs)?;
        assert_eq!(get_f64(&runs, "fb_used_max_mib", 0), 1200.0);
        assert_eq!(get_f64(&runs, "gpu_energy_j", 0), 48.0);
        assert_eq!(get_f64(&runs, "j_per_sample", 0), 0.2);
        assert_eq!(runs.column("gpu_power_mean_w")?.null_count(), 1);
        // A CPU run has no metrics part.
        assert!(write_run(dir.path(), &fake_run(1, 10, Duration::ZERO))?
            .metrics
            .is_none());
        Ok(())
    }

    #[test]
    fn a_failed_cell_s_row_has_every_column_of_a_run_s_row() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let run = fake_run(8, 30, Duration::ZERO);
        assert_eq!(
            runs_schema()?,
            runs_frame(std::slice::from_ref(&run))?.schema().as_ref().clone()
        );
        let ran = read_part(&write_run(dir.path(), &run)?.runs, Table::Runs).map_err(anyhow::Error::msg)?;
        let failure = Failure {
            run_id: "zzz-failed".into(),
            invocation_id: "inv".into(),
            host: "h".into(),
            started_at: provenance::now(),
            finished_at: provenance::now(),
            workload: crate::run::record::FailedWorkload {
                model: "resnet_tiny".into(),
                mode: "infer".into(),
                dtype: "bf16".into(),
                batch: 2,
                seq_len: None,
                seed: 0,
                kernel_options: run.kernels.canonical(),
                master_weights: None,
                prompt_len: None,
                output_len: None,
                kv_layout: None,
                kv_block_size: None,
            },
            identity: crate::run::record::tests::identity_with(crate::run::record::Status::Error),
            error: "bf16 cannot run on cpu".into(),
            fingerprint: run.fingerprint.clone(),
        };
        let path = write_failure(dir.path(), &failure)?;
        let failed = read_part(&path, Table::Runs).map_err(anyhow::Error::msg)?;
        assert_eq!(
            failed.schema(),
            ran.schema(),
            "the same columns of the same types, as written"
        );
        for (column, null) in [
            ("throughput", true),
            ("p50_ms", true),
            ("verdict", true),
            ("model", false),
            ("error", false),
        ] {
            assert_eq!(failed.column(column)?.null_count() == 1, null, "{column}");
        }
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 2);
        Ok(())
    }

    /// A folder of every kind of row (ok, probe, error, oom, timeout, crashed), the first part by name a
    /// failed one, read as users read it: pyarrow's `read_table` of the folder, a plain duckdb glob,
    /// a polars scan. Each must see every row and every column.
    #[test]
    #[ignore = "needs python3 with pyarrow, duckdb and polars (.ci/run installs them)"]
    fn a_folder_of_every_status_reads_whole_in_pyarrow_duckdb_and_polars() -> Result<()> {
        use crate::run::record::{FailedWorkload, Status};
        let dir = tempfile::tempdir()?;
        let ok = fake_run(8, 30, Duration::ZERO);
        write_run(dir.path(), &ok)?;
        let mut probe = fake_run(16, 10, Duration::ZERO);
        probe.cell.status = Status::Probe;
        write_run(dir.path(), &probe)?;
        for (i, status) in [Status::Error, Status::Oom, Status::Timeout, Status::Crashed]
            .into_iter()
            .enumerate()
        {
            write_failure(
                dir.path(),
                &Failure {
                    // Named to sort first: a reader that takes the first part's schema meets a failed row.
                    run_id: format!("0000-failed-{i}"),
                    invocation_id: "inv".into(),
                    host: "h".into(),
                    started_at: provenance::now(),
                    finished_at: provenance::now(),
                    workload: FailedWorkload {
                        model: "resnet_tiny".into(),
                        mode: "infer".into(),
                        dtype: "bf16".into(),
                        batch: 2,
                        seq_len: None,
                        seed: 0,
                        kernel_options: ok.kernels.canonical(),
                        master_weights: None,
                        prompt_len: None,
                        output_len: None,
                        kv_layout: None,
                        kv_block_size: None,
                    },
                    identity: crate::run::record::tests::identity_with(status),
                    error: format!("{} ended it", status.as_str()),
                    fingerprint: ok.fingerprint.clone(),
                },
            )?;
        }
        let width = runs_schema()?.len();
        let script = r#"
import sys, duckdb, polars as pl, pyarrow.parquet as pq
d, width = sys.argv[1], int(sys.argv[2])
t = pq.read_table(f"{d}/runs")
assert (t.num_rows, t.num_columns) == (6, width), (t.num_rows, t.num_columns, width)
rows = t.to_pylist()
assert sorted(r["status"] for r in rows) == ["crashed", "error", "ok", "oom", "probe", "timeout"], rows
assert sum(r["throughput"] is not None for r in rows) == 2 and sum(r["p50_ms"] is not None for r in rows) == 2
n, measured, verdicts = duckdb.sql(f"select count(*), count(throughput), count(verdict) from '{d}/runs/*.parquet'").fetchall()[0]
assert (n, measured, verdicts) == (6, 2, 2), (n, measured, verdicts)
df = pl.scan_parquet(f"{d}/runs/*.parquet").collect()
assert df.shape == (6, width), df.shape
assert df["throughput"].null_count() == 4 and df["error"].null_count() == 2
print("read whole:", t.num_rows, "rows,", t.num_columns, "columns")
"#;
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(dir.path())
            .arg(width.to_string())
            .output()?;
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    #[test]
    fn every_column_written_is_in_the_schema_page() -> Result<()> {
        let schema = include_str!("../../../docs/schema.md");
        let dir = tempfile::tempdir()?;
        let mut run = fake_run(8, 30, Duration::ZERO);
        run.metrics = vec![crate::gpu::sampler::Sample::default()];
        write_run(dir.path(), &run)?;
        for table in [Table::Runs, Table::Samples, Table::Metrics] {
            let frame = read_table(dir.path(), table)?;
            let missing: Vec<String> = frame
                .get_column_names()
                .iter()
                .map(|c| c.to_string())
                .filter(|c| !schema.contains(&format!("`{c}`")))
                .collect();
            assert!(
                missing.is_empty(),
                "docs/schema.md lacks these {} columns: {missing:?}",
                table.dir_name()
            );
        }
        Ok(())
    }

    #[test]
    fn an_empty_or_missing_folder_reads_as_no_rows() -> Result<()> {
        let dir = tempfile::tempdir()?;
        assert_eq!(read_table(&dir.path().join("nothing"), Table::Runs)?.height(), 0);
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 0);
        Ok(())
    }

    #[test]
    fn corrupt_and_foreign_parts_are_skipped_by_name_and_the_rest_reads() -> Result<()> {
        let dir = tempfile::tempdir()?;
        write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
        fs::write(dir.path().join("runs/part-broken.parquet"), b"PAR1 not really")?;
        let mut foreign = DataFrame::new(1, vec![Column::new("x".into(), vec![1i64])])?;
        ParquetWriter::new(File::create(dir.path().join("runs/part-foreign.parquet"))?).finish(&mut foreign)?;
        let (runs, skipped) = read_parts(dir.path(), Table::Runs)?;
        assert_eq!(runs.height(), 1);
        let why: Vec<String> = skipped
            .iter()
            .map(|(p, w)| format!("{}: {w}", p.file_name().unwrap().to_string_lossy()))
            .collect();
        assert_eq!(why.len(), 2, "{why:?}");
        assert!(
            why[0].starts_with("part-broken.parquet: not a readable Parquet file"),
            "{why:?}"
        );
        assert!(
            why[1].starts_with("part-foreign.parquet: not a migprof runs part (no schema_version, run_id column)"),
            "{why:?}"
        );
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
        Ok(())
    }

    #[test]
    fn parts_of_an_older_schema_read_beside_new_ones_with_nulls() -> Result<()> {
        let dir = tempfile::tempdir()?;
        write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
        // A schema-1 row: no kernel_options, no sweep columns, no fingerprint.
        let mut old = DataFrame::new(
            1,
            vec![
                Column::new("schema_version".into(), vec![1i32]),
                Column::new("run_id".into(), vec!["0000-old"]),
                Column::new("model".into(), vec!["resnet18"]),
                Column::new("throughput".into(), vec![12.5f64]),
            ],
        )?;
        ParquetWriter::new(File::create(dir.path().join("runs/part-0000-old.parquet"))?).finish(&mut old)?;
        let (runs, skipped) = read_parts(dir.path(), Table::Runs)?;
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(runs.height(), 2);
        let versions: Vec<i32> = runs.column("schema_version")?.i32()?.iter().flatten().collect();
        assert_eq!(versions, vec![1, SCHEMA_VERSION]);
        assert_eq!(runs.column("kernel_options")?.null_count(), 1);
        assert_eq!(runs.column("status")?.str()?.get(0), None);
        Ok(())
    }

    #[test]
    fn gpm_scope_and_the_measured_bandwidth_say_what_the_slice_had() -> Result<()> {
        use crate::gpu::Selected;
        let (whole, slice) = crate::device::tests::recorded_gpu_and_slice();
        let on = |kind, selected: Selected, gpm: bool| {
            let mut r = fake_run(2, 10, Duration::ZERO);
            r.context.device = crate::device::DeviceInfo {
                kind,
                name: String::new(),
                emulation: None,
                memory_system: (kind == "mig").then_some(crate::gpu::memory_system::MemorySystem {
                    bandwidth_gbps: 373.0,
                    l2_mib: Some(6.0),
                }),
                selected: Some(selected),
                kernel_sms: (kind != "cpu").then_some(if kind == "mig" { 16 } else { 132 }),
            };
            r.metric_summary.gract_mean = gpm.then_some(40.0);
            r
        };
        let runs = [
            fake_run(2, 10, Duration::ZERO),
            on("mig", slice, true),
            on("cuda", whole.clone(), true),
            on("cuda", whole, false),
        ];
        let df = runs_frame(&runs)?;
        let scope: Vec<Option<&str>> = df.column("gpm_scope")?.str()?.iter().collect();
        // The CPU and a GPU without GPM readings say nothing.
        assert_eq!(scope, [None, Some("gpu_instance"), Some("gpu"), None]);
        let bandwidth: Vec<Option<f64>> = df.column("measured_bandwidth_gbps")?.f64()?.iter().collect();
        assert_eq!(bandwidth, [None, Some(373.0), None, None]);
        let kernel_sms: Vec<Option<i64>> = df.column("kernel_sm_count")?.i64()?.iter().collect();
        assert_eq!(kernel_sms, [None, Some(16), Some(132), Some(132)]);
        Ok(())
    }

    #[test]
    fn an_emulated_slice_s_rows_say_how_its_memory_was_emulated_and_what_the_neighbour_was_set_to() -> Result<()> {
        use crate::mps::calibration::Outcome;
        let (whole, _) = crate::device::tests::recorded_gpu_and_slice();
        let emulated = |partition: Option<crate::mps::partition::Partition>| {
            let mut r = fake_run(2, 10, Duration::ZERO);
            r.context.device = crate::device::DeviceInfo {
                kind: "mps",
                name: String::new(),
                emulation: Some(crate::device::tests::emulated_1g(partition)),
                memory_system: Some(crate::gpu::memory_system::MemorySystem {
                    bandwidth_gbps: 361.0,
                    l2_mib: None,
                }),
                selected: Some(whole.clone()),
                kernel_sms: Some(16),
            };
            r
        };
        let partition = crate::mps::partition::Partition {
            gpu_bandwidth_gbps: 2984.0,
            share_gbps: 373.0,
            alone_bandwidth_gbps: Some(1290.0),
            bandwidth_gbps: 361.0,
            load: Some(crate::mps::calibration::Load {
                blocks: 40,
                pause_ns: 76,
            }),
            outcome: Outcome::Reached,
            cached: true,
            neighbour_sms: Some(114),
            shared_sms: Some(16),
            compute_slowdown_pct: Some(0.9),
            sm_clock_mhz: Some(1980),
            throttle_reasons: Some(0),
            neighbour_pid: Some(4242),
        };
        let runs = [
            fake_run(2, 10, Duration::ZERO),
            emulated(None),
            emulated(Some(partition)),
        ];
        let df = runs_frame(&runs)?;
        let text = |c: &str| -> Result<Vec<Option<String>>> {
            Ok(df.column(c)?.str()?.iter().map(|v| v.map(str::to_string)).collect())
        };
        let number = |c: &str| -> Result<Vec<Option<f64>>> {
            Ok(df.column(c)?.cast(&DataType::Float64)?.f64()?.iter().collect())
        };
        assert_eq!(
            text("memory_emulation")?,
            [None, Some("alone".into()), Some("partitioned".into())]
        );
        assert_eq!(text("calibration")?, [None, None, Some("reached".into())]);
        assert_eq!(number("memory_share_gbps")?, [None, None, Some(373.0)]);
        assert_eq!(number("gpu_bandwidth_gbps")?, [None, None, Some(2984.0)]);
        assert_eq!(number("alone_bandwidth_gbps")?, [None, None, Some(1290.0)]);
        assert_eq!(number("neighbour_blocks")?, [None, None, Some(40.0)]);
        assert_eq!(number("neighbour_pause_ns")?, [None, None, Some(76.0)]);
        assert_eq!(number("neighbour_sms")?, [None, None, Some(114.0)]);
        assert_eq!(number("shared_sms")?, [None, None, Some(16.0)]);
        assert_eq!(number("compute_slowdown_pct")?, [None, None, Some(0.9)]);
        assert_eq!(number("calibration_sm_clock_mhz")?, [None, None, Some(1980.0)]);
        assert_eq!(number("calibration_throttle_reasons")?, [None, None, Some(0.0)]);
        assert_eq!(number("measured_bandwidth_gbps")?, [None, Some(361.0), Some(361.0)]);
        assert_eq!(number("measured_l2_mib")?, [None, None, None]);
        let cached: Vec<Option<bool>> = df.column("calibration_cached")?.bool()?.iter().collect();
        assert_eq!(cached, [None, None, Some(true)]);
        Ok(())
    }

    #[test]
    fn half_precision_training_written_before_master_weights_reads_as_none() -> Result<()> {
        let dir = tempfile::tempdir()?;
        fs::create_dir_all(dir.path().join("runs"))?;
        // A schema-5 part: bf16 and f16 training then updated the half-precision weights themselves.
        let mut old = DataFrame::new(
            4,
            vec![
                Column::new("schema_version".into(), vec![5i32; 4]),
                Column::new("run_id".into(), vec!["a", "b", "c", "d"]),
                Column::new("mode".into(), vec!["train", "train", "train", "infer"]),
                Column::new("dtype".into(), vec!["bf16", "f16", "f32", "bf16"]),
            ],
        )?;
        ParquetWriter::new(File::create(dir.path().join("runs/part-0000-old.parquet"))?).finish(&mut old)?;
        let runs = read_table(dir.path(), Table::Runs)?;
        let masters: Vec<Option<&str>> = runs.column("master_weights")?.str()?.iter().collect();
        assert_eq!(masters, vec![Some("none"), Some("none"), None, None]);
        Ok(())
    }

    #[test]
    fn leftover_temporary_files_are_ignored() -> Result<()> {
        let dir = tempfile::tempdir()?;
        write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
        fs::write(dir.path().join("runs/.part-x.parquet.tmp-1"), b"half a file")?;
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
        Ok(())
    }

    #[test]
    fn a_failed_write_leaves_earlier_parts_and_no_temporary_file() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let first = fake_run(2, 10, Duration::ZERO);
        write_run(dir.path(), &first)?;
        // A later run whose part cannot be renamed into place: its final name is a folder.
        let second = fake_run(4, 10, Duration::ZERO);
        fs::create_dir_all(dir.path().join(format!("samples/part-{}.parquet/x", second.run_id)))?;
        assert!(write_run(dir.path(), &second).is_err());
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
        let leftovers: Vec<_> = fs::read_dir(dir.path().join("samples"))?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
        Ok(())
    }
}
