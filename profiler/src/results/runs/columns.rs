//! The `runs` table as one table of columns: each column's name, the type of its values, how a
//! run's row reads it, and how the row of a cell that left no measurement reads it (null where that
//! row has nothing to say). The groups of columns other tables share (a cell's identity, the device,
//! the environment) are entries of their own, in their place.

use polars::prelude::*;

use super::identity::{cell_columns, device_columns, fingerprint_columns};
use crate::provenance;
use crate::results::parts::{utc_micros, SCHEMA_VERSION};
use crate::run::record::Failure;
use crate::run::stats::ns_to_ms;
use crate::run::subject::PROGRAM_FAMILY;
use crate::run::uncertainty::{Estimate, Uncertainty};
use crate::run::Run;

/// How a column of values `V` is read: from a run, and from a failed cell (`None`: null there).
pub(super) struct Read<V> {
    run: fn(&Run) -> V,
    failed: Option<fn(&Failure) -> V>,
}

/// A column only a measured run has.
const fn run<V>(run: fn(&Run) -> V) -> Read<V> {
    Read { run, failed: None }
}

/// A column a failed cell's row has too.
const fn both<V>(run: fn(&Run) -> V, failed: fn(&Failure) -> V) -> Read<V> {
    Read {
        run,
        failed: Some(failed),
    }
}

/// A column of a program's rows, measured or failed (null in migprof's own).
macro_rules! program {
    ($read:expr) => {
        both(
            |r| r.subject.program().and_then($read),
            |f| f.program.as_ref().and_then($read),
        )
    };
}

/// One entry of the table: a column with the type of its values, or a group of shared columns.
pub(super) enum Entry {
    /// `schema_version` (int32): the version this migprof writes.
    SchemaVersion,
    Text(&'static str, Read<Option<String>>),
    Int(&'static str, Read<Option<i64>>),
    Unsigned(&'static str, Read<Option<u64>>),
    Float(&'static str, Read<Option<f64>>),
    Float32(&'static str, Read<Option<f32>>),
    /// A UTC time in microseconds.
    Time(&'static str, Read<i64>),
    /// `histogram` (binary): the step latencies' HDR histogram.
    Histogram,
    /// `verdict_flags` (a list of strings): every flag of the run's verdict.
    VerdictFlags,
    /// The cell's identity ([`cell_columns`]); a failed cell's `error` filled.
    Cell,
    /// Where the run ran ([`device_columns`]); null for a failed cell, whose device was never opened.
    Device,
    /// The environment ([`fingerprint_columns`]).
    Fingerprint,
}

use Entry::*;

/// One end of an interval of the run's uncertainty; null where its samples give none.
fn bound(r: &Run, pick: fn(&Uncertainty) -> &Estimate, high: bool) -> Option<f64> {
    pick(&r.uncertainty)
        .as_ref()
        .ok()
        .map(|i| if high { i.high } else { i.low })
}

/// The `runs` table, column by column in the order it is written.
pub(super) static RUNS: &[Entry] = &[
    SchemaVersion,
    Text("run_id", both(|r| Some(r.run_id.clone()), |f| Some(f.run_id.clone()))),
    Text(
        "invocation_id",
        both(
            |r| Some(r.context.invocation_id.clone()),
            |f| Some(f.invocation_id.clone()),
        ),
    ),
    Time(
        "started_at",
        both(|r| r.started_at.timestamp_micros(), |f| f.started_at.timestamp_micros()),
    ),
    Time(
        "finished_at",
        both(
            |r| r.finished_at.timestamp_micros(),
            |f| f.finished_at.timestamp_micros(),
        ),
    ),
    Text("host", both(|r| Some(r.context.host.clone()), |f| Some(f.host.clone()))),
    Cell,
    Text(
        "model",
        both(
            |r| Some(r.subject.name().to_string()),
            |f| Some(f.workload.model.clone()),
        ),
    ),
    Text(
        "family",
        both(
            |r| Some(r.subject.family().to_string()),
            |f| match &f.program {
                Some(_) => Some(PROGRAM_FAMILY.to_string()),
                None => workloads::lookup(&f.workload.model)
                    .ok()
                    .map(|(_, m)| m.family.as_str().to_string()),
            },
        ),
    ),
    Text(
        "mode",
        both(|r| Some(r.mode.as_str().to_string()), |f| Some(f.workload.mode.clone())),
    ),
    Text(
        "dtype",
        both(
            |r| r.precision().map(str::to_string),
            |f| Some(f.workload.dtype.clone()).filter(|d| !d.is_empty()),
        ),
    ),
    Int(
        "batch",
        both(|r| Some(r.batch as i64), |f| Some(f.workload.batch as i64)),
    ),
    Int(
        "seq_len",
        both(
            |r| r.subject.model().and_then(|m| m.input.seq_len()).map(|l| l as i64),
            |f| f.workload.seq_len.map(|l| l as i64),
        ),
    ),
    Int(
        "prompt_len",
        both(
            |r| r.generation.as_ref().map(|g| g.lengths.prompt as i64),
            |f| f.workload.prompt_len.map(|l| l as i64),
        ),
    ),
    Int(
        "output_len",
        both(
            |r| r.generation.as_ref().map(|g| g.lengths.output as i64),
            |f| f.workload.output_len.map(|l| l as i64),
        ),
    ),
    Text(
        "kv_layout",
        both(
            |r| r.generation.as_ref().map(|g| g.kv_layout.as_str().to_string()),
            |f| f.workload.kv_layout.clone(),
        ),
    ),
    Int(
        "kv_block_size",
        both(
            |r| {
                r.generation
                    .as_ref()
                    .and_then(|g| g.kv_layout.block_size())
                    .map(|b| b.get() as i64)
            },
            |f| f.workload.kv_block_size.map(|b| b.get() as i64),
        ),
    ),
    Device,
    // A program's seed and kernels are its own business: null in its rows.
    Unsigned(
        "seed",
        both(
            |r| r.subject.model().map(|_| r.seed),
            |f| f.program.is_none().then_some(f.workload.seed),
        ),
    ),
    Text("weights", run(|r| r.weights.clone())),
    Text("optimizer", run(|r| r.optimizer.clone())),
    Text(
        "master_weights",
        both(
            |r| r.master_weights.map(str::to_string),
            |f| f.workload.master_weights.clone(),
        ),
    ),
    Float("loss_scale", run(|r| r.measurement.loss_scale)),
    Int("skipped_steps", run(|r| r.measurement.skipped_steps.map(|n| n as i64))),
    Text(
        "kernel_options",
        both(
            |r| r.subject.model().map(|_| r.kernels.canonical()),
            |f| f.program.is_none().then(|| f.workload.kernel_options.clone()),
        ),
    ),
    Int("warmup_iterations", run(|r| Some(r.warmup_iterations as i64))),
    Int("params", run(|r| r.subject.model().map(|m| m.params as i64))),
    Int("flops_per_sample", run(|r| r.flops_per_sample().map(|f| f as i64))),
    Int("iterations", run(|r| Some(r.stats.iterations as i64))),
    Float("measured_s", run(|r| Some(r.measurement.elapsed.as_secs_f64()))),
    Float("mean_ms", run(|r| Some(r.stats.mean_ms()))),
    Float("std_ms", run(|r| r.stats.std_ns.map(|s| s / 1e6))),
    Float("min_ms", run(|r| Some(ns_to_ms(r.stats.min_ns)))),
    Float("max_ms", run(|r| Some(ns_to_ms(r.stats.max_ns)))),
    Float("p50_ms", run(|r| Some(ns_to_ms(r.stats.p50_ns)))),
    Float("p90_ms", run(|r| Some(ns_to_ms(r.stats.p90_ns)))),
    Float("p95_ms", run(|r| Some(ns_to_ms(r.stats.p95_ns)))),
    Float("p99_ms", run(|r| Some(ns_to_ms(r.stats.p99_ns)))),
    Float("p999_ms", run(|r| Some(ns_to_ms(r.stats.p999_ns)))),
    Float("throughput", run(|r| Some(r.throughput()))),
    Float("wall_throughput", run(|r| Some(r.wall_throughput()))),
    Histogram,
    Float("mean_ms_ci_low", run(|r| bound(r, |u| &u.mean_ms, false))),
    Float("mean_ms_ci_high", run(|r| bound(r, |u| &u.mean_ms, true))),
    Float("throughput_ci_low", run(|r| bound(r, |u| &u.throughput, false))),
    Float("throughput_ci_high", run(|r| bound(r, |u| &u.throughput, true))),
    Float("p50_ms_ci_low", run(|r| bound(r, |u| &u.p50_ms, false))),
    Float("p50_ms_ci_high", run(|r| bound(r, |u| &u.p50_ms, true))),
    Float("p99_ms_ci_low", run(|r| bound(r, |u| &u.p99_ms, false))),
    Float("p99_ms_ci_high", run(|r| bound(r, |u| &u.p99_ms, true))),
    Text("ci_note", run(|r| r.uncertainty.note())),
    Int("generations", run(|r| r.generation.as_ref().map(|g| g.count() as i64))),
    Float(
        "ttft_mean_ms",
        run(|r| r.generation.as_ref().map(|g| g.prefill.mean_ms())),
    ),
    Float(
        "ttft_p50_ms",
        run(|r| r.generation.as_ref().map(|g| ns_to_ms(g.prefill.p50_ns))),
    ),
    Float(
        "ttft_p99_ms",
        run(|r| r.generation.as_ref().map(|g| ns_to_ms(g.prefill.p99_ns))),
    ),
    Float("prefill_tokens_per_s", run(Run::prefill_tokens_per_s)),
    Float(
        "decode_tokens_per_s",
        run(|r| r.generation.as_ref().map(|_| r.throughput())),
    ),
    Int(
        "kv_cache_bytes",
        run(|r| r.generation.as_ref().map(|g| g.kv_cache_bytes as i64)),
    ),
    Int(
        "kv_cache_bytes_per_seq",
        run(|r| {
            r.generation
                .as_ref()
                .map(|g| (g.kv_cache_bytes / r.batch.max(1) as u64) as i64)
        }),
    ),
    Float32("loss_first", run(|r| r.measurement.loss_first)),
    Float32("loss_last", run(|r| r.measurement.loss_last)),
    Text("verdict", run(|r| Some(r.assessment.verdict.as_str().to_string()))),
    Text("verdict_reason", run(|r| Some(r.assessment.reason.clone()))),
    Int("outliers", run(|r| Some(r.assessment.outliers as i64))),
    Float("outlier_mean_shift", run(|r| Some(r.assessment.outlier_mean_shift))),
    VerdictFlags,
    Float("throttle_share", run(|r| r.evidence.throttle_share)),
    Float("power_cap_share", run(|r| r.evidence.power_cap_share)),
    Text("other_processes", run(|r| r.evidence.others_text())),
    Int("sample_interval_ms", run(Run::sample_interval_ms)),
    Int("metric_samples", run(|r| Some(r.metric_summary.samples as i64))),
    Float("fb_used_mean_mib", run(|r| r.metric_summary.fb_used_mean_mib)),
    Float("fb_used_max_mib", run(|r| r.metric_summary.fb_used_max_mib)),
    Float("gract_mean", run(|r| r.metric_summary.gract_mean)),
    Float("gract_std", run(|r| r.metric_summary.gract_std)),
    Float("sm_util_mean", run(|r| r.metric_summary.sm_util_mean)),
    Float("tensor_mean", run(|r| r.metric_summary.tensor_mean)),
    Float("dram_mean", run(|r| r.metric_summary.dram_mean)),
    Text(
        "gpm_scope",
        run(|r| {
            r.metric_summary
                .has_gpm()
                .then(|| r.context.device.gpm_scope())
                .flatten()
                .map(str::to_string)
        }),
    ),
    Float("gpu_power_mean_w", run(|r| r.metric_summary.gpu_power_mean_w)),
    Float("gpu_energy_j", run(|r| r.metric_summary.gpu_energy_j)),
    Float("j_per_sample", run(|r| r.metric_summary.j_per_sample)),
    Text("sampler_error", run(|r| r.sampler_error.clone())),
    Text(
        "program_command",
        program!(|p: &crate::run::subject::Program| Some(p.command.clone())),
    ),
    Int(
        "program_exit_code",
        program!(|p: &crate::run::subject::Program| p.exit_code.map(i64::from)),
    ),
    Int(
        "program_exit_signal",
        program!(|p: &crate::run::subject::Program| p.exit_signal.map(i64::from)),
    ),
    Float(
        "program_wall_s",
        program!(|p: &crate::run::subject::Program| p.wall.map(|w| w.as_secs_f64())),
    ),
    Text(
        "program_steps",
        program!(|p: &crate::run::subject::Program| Some(p.steps.as_str().to_string())),
    ),
    Text(
        "program_step_pattern",
        program!(|p: &crate::run::subject::Program| p.step_pattern.clone()),
    ),
    Float(
        "program_device_memory_max_mib",
        program!(|p: &crate::run::subject::Program| p.device_memory_max_mib),
    ),
    Int(
        "program_pids_seen",
        program!(|p: &crate::run::subject::Program| p.pids_seen.map(i64::from)),
    ),
    Text(
        "migprof_version",
        both(
            |_| Some(provenance::VERSION.to_string()),
            |_| Some(provenance::VERSION.to_string()),
        ),
    ),
    Text(
        "git_commit",
        both(
            |_| Some(provenance::GIT_COMMIT.to_string()),
            |_| Some(provenance::GIT_COMMIT.to_string()),
        ),
    ),
    Fingerprint,
];

impl Entry {
    /// The entry's columns for `runs`, a row each.
    pub(super) fn of_runs(&self, runs: &[Run]) -> anyhow::Result<Vec<Column>> {
        fn column<V>(name: &str, runs: &[Run], read: &Read<V>) -> Column
        where
            Series: NamedFrom<Vec<V>, [V]>,
        {
            Column::new(name.into(), runs.iter().map(read.run).collect::<Vec<V>>())
        }
        Ok(match self {
            SchemaVersion => vec![Column::new("schema_version".into(), vec![SCHEMA_VERSION; runs.len()])],
            Text(name, read) => vec![column(name, runs, read)],
            Int(name, read) => vec![column(name, runs, read)],
            Unsigned(name, read) => vec![column(name, runs, read)],
            Float(name, read) => vec![column(name, runs, read)],
            Float32(name, read) => vec![column(name, runs, read)],
            Time(name, read) => vec![utc_micros(name, runs.iter().map(read.run).collect())],
            Histogram => {
                let histograms = runs
                    .iter()
                    .map(|r| r.stats.histogram_v2_deflate())
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let bytes: Vec<&[u8]> = histograms.iter().map(|h| h.as_slice()).collect();
                vec![Column::new("histogram".into(), bytes)]
            }
            VerdictFlags => vec![flags_column(runs)],
            Cell => cell_columns(&runs.iter().map(|r| &r.cell).collect::<Vec<_>>()),
            Device => device_columns(&runs.iter().map(|r| &r.context.device).collect::<Vec<_>>()),
            Fingerprint => fingerprint_columns(&runs.iter().map(|r| &r.fingerprint).collect::<Vec<_>>()),
        })
    }

    /// The entry's columns for the row of a failed cell; those it has no value for are left out
    /// (the schema fills them with nulls).
    pub(super) fn of_failure(&self, failure: &Failure) -> Vec<Column> {
        fn column<V>(name: &str, failure: &Failure, read: &Read<V>) -> Vec<Column>
        where
            Series: NamedFrom<Vec<V>, [V]>,
        {
            read.failed
                .map(|f| Column::new(name.into(), vec![f(failure)]))
                .into_iter()
                .collect()
        }
        match self {
            SchemaVersion => vec![Column::new("schema_version".into(), vec![SCHEMA_VERSION])],
            Text(name, read) => column(name, failure, read),
            Int(name, read) => column(name, failure, read),
            Unsigned(name, read) => column(name, failure, read),
            Float(name, read) => column(name, failure, read),
            Float32(name, read) => column(name, failure, read),
            Time(name, read) => read
                .failed
                .map(|f| utc_micros(name, vec![f(failure)]))
                .into_iter()
                .collect(),
            Cell => cell_columns(&[&failure.identity])
                .into_iter()
                .map(|c| match c.name().as_str() {
                    "error" => Column::new("error".into(), vec![Some(failure.error.clone())]),
                    _ => c,
                })
                .collect(),
            Fingerprint => fingerprint_columns(&[&failure.fingerprint]),
            Histogram | VerdictFlags | Device => Vec::new(),
        }
    }
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
