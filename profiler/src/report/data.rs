//! The rows a report is made of, read from one or more results folders: every runs row with the
//! fields the report shows, and the targets in a fixed order (each keeps one colour in every chart).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use polars::prelude::*;

use crate::results::parts::{read_table, Table};

/// One runs row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub text: BTreeMap<&'static str, String>,
    pub num: BTreeMap<&'static str, f64>,
}

impl Row {
    pub fn s(&self, k: &str) -> &str {
        self.text.get(k).map_or("", String::as_str)
    }

    pub fn n(&self, k: &str) -> Option<f64> {
        self.num.get(k).copied()
    }

    pub fn is_ok(&self) -> bool {
        matches!(self.s("status"), "ok" | "")
    }

    /// What a row's inputs were besides the batch: a token model's sequence length, or a
    /// generation's prompt and output lengths (`prompt 512 output 128`); empty for images.
    pub fn lengths(&self) -> String {
        match (self.s("prompt_len"), self.s("output_len"), self.s("kv_block_size")) {
            ("", _, _) | (_, "", _) => self.s("seq_len").to_string(),
            (p, o, "") => format!("prompt {p} output {o}"),
            (p, o, b) => format!("prompt {p} output {o} paged {b}"),
        }
    }

    /// A measured cell alone (not a probe, not a group member).
    pub fn is_alone(&self) -> bool {
        self.is_ok() && self.s("concurrency_group").is_empty() && self.n("throughput").is_some()
    }
}

const TEXT: [&str; 29] = [
    "run_id",
    "kv_block_size",
    "prompt_len",
    "output_len",
    "kv_layout",
    "cell_id",
    "baseline",
    "sweep",
    "target",
    "status",
    "error",
    "model",
    "mode",
    "dtype",
    "device_kind",
    "device_name",
    "gpu_name",
    "mig_profile",
    "emulation",
    "emulated_profile",
    "memory_emulation",
    "calibration",
    "kernel_options",
    "master_weights",
    "verdict",
    "concurrency_group",
    "neighbours",
    "seq_len",
    "batch",
];

const NUM: [&str; 26] = [
    "batch",
    "kv_cache_bytes_per_seq",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "seq_len",
    "sm_count",
    "device_memory_mib",
    "throughput",
    "throughput_ci_low",
    "throughput_ci_high",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p50_ms_ci_low",
    "p50_ms_ci_high",
    "fb_used_max_mib",
    "pool_held_mib_start",
    "gract_mean",
    "j_per_sample",
    "mps_share_pct",
    "measured_sms",
    "power_limit_w",
    "iterations",
    "memory_share_gbps",
    "gpu_bandwidth_gbps",
    "measured_bandwidth_gbps",
];

/// Every row of the folders' runs tables, in the order of the folders and their parts (none when
/// the folders hold only load steps).
pub fn read(dirs: &[PathBuf]) -> Result<Vec<Row>> {
    read_rows(dirs, Table::Runs, &keys_with(&TEXT, &[&ENVIRONMENT]), &NUM)
}

/// The fingerprint fields the report's "What ran" section lists with every value they took.
pub const ENVIRONMENT: [&str; 11] = [
    "host",
    "migprof_version",
    "git_commit",
    "candle_version",
    "build_features",
    "gpu_name",
    "driver_version",
    "cuda_driver_version",
    "cudnn_version",
    "cublas_version",
    "cpu_model",
];

/// What "What ran" says of a target, read from a serving job's rows as from a run's: its text
/// columns (with [`ENVIRONMENT`]) and its numbers.
const TARGET_TEXT: [&str; 7] = [
    "sweep",
    "device_name",
    "device_kind",
    "mig_profile",
    "emulated_profile",
    "emulation",
    "memory_emulation",
];
const TARGET_NUM: [&str; 3] = ["sm_count", "device_memory_mib", "mps_share_pct"];

/// A serving job's `text` and `numbers` keys with those "What ran" reads of its target, each once.
pub fn with_target(text: &[&'static str], numbers: &[&'static str]) -> (Vec<&'static str>, Vec<&'static str>) {
    (
        keys_with(text, &[&TARGET_TEXT, &ENVIRONMENT]),
        keys_with(numbers, &[&TARGET_NUM]),
    )
}

/// `keys`, then those of `more` it lacks.
fn keys_with(keys: &[&'static str], more: &[&[&'static str]]) -> Vec<&'static str> {
    let mut all = keys.to_vec();
    for k in more.iter().flat_map(|m| m.iter()) {
        if !all.contains(k) {
            all.push(k);
        }
    }
    all
}

/// The `keys` of every row of one table of the folders.
pub fn read_rows(
    dirs: &[PathBuf],
    table: Table,
    text_keys: &[&'static str],
    num_keys: &[&'static str],
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for dir in dirs {
        if !dir.is_dir() {
            bail!("{}: no such results folder", dir.display())
        }
        let df = read_table(dir, table).with_context(|| format!("reading {}", dir.display()))?;
        rows.extend(rows_of(&df, text_keys, num_keys)?);
    }
    Ok(rows)
}

fn rows_of(df: &DataFrame, text_keys: &[&'static str], num_keys: &[&'static str]) -> Result<Vec<Row>> {
    let text: Vec<(&'static str, Vec<Option<String>>)> = text_keys
        .iter()
        .map(|&k| {
            let v = match df.column(k) {
                Ok(c) => c
                    .cast(&DataType::String)?
                    .str()?
                    .iter()
                    .map(|v| v.map(str::to_string))
                    .collect(),
                Err(_) => vec![None; df.height()],
            };
            Ok((k, v))
        })
        .collect::<Result<_>>()?;
    let num: Vec<(&'static str, Vec<Option<f64>>)> = num_keys
        .iter()
        .map(|&k| {
            let v = match df.column(k) {
                Ok(c) => c.cast(&DataType::Float64)?.f64()?.iter().collect(),
                Err(_) => vec![None; df.height()],
            };
            Ok((k, v))
        })
        .collect::<Result<_>>()?;
    Ok((0..df.height())
        .map(|i| Row {
            text: text.iter().filter_map(|(k, v)| v[i].clone().map(|s| (*k, s))).collect(),
            num: num
                .iter()
                .filter_map(|(k, v)| v[i].filter(|x| x.is_finite()).map(|x| (*k, x)))
                .collect(),
        })
        .collect())
}

/// Per run: the measured steps' latencies in ms (sorted), and the sampler's readings as
/// (seconds since the first reading, value) per quantity.
#[derive(Debug, Default)]
pub struct Detail {
    pub latencies_ms: BTreeMap<String, Vec<f64>>,
    pub series: BTreeMap<(String, &'static str), Vec<(f64, f64)>>,
}

/// The quantities of the sampler's time series, with their units.
pub const READINGS: [(&str, &str); 5] = [
    ("gract", "%"),
    ("sm_occupancy", "%"),
    ("tensor_util", "%"),
    ("fb_used_mib", "MiB"),
    ("gpu_power_w", "W"),
];

/// The samples and readings of the runs `wanted`, from every folder.
pub fn detail(dirs: &[PathBuf], wanted: &std::collections::BTreeSet<String>) -> Result<Detail> {
    let mut d = Detail::default();
    for dir in dirs {
        let samples = read_table(dir, Table::Samples)?;
        if samples.height() > 0 {
            let ids = samples.column("run_id")?.str()?.clone();
            let lat = samples.column("latency_ns")?.cast(&DataType::Float64)?;
            // A generation's prefills are not steps: their times are the row's ttft columns.
            let prefill: Vec<bool> = match samples.column("phase") {
                Ok(p) => p.str()?.iter().map(|p| p == Some("prefill")).collect(),
                Err(_) => vec![false; samples.height()],
            };
            for ((id, ns), prefill) in ids.iter().zip(lat.f64()?.iter()).zip(prefill) {
                if let (Some(id), Some(ns), false) = (id, ns, prefill) {
                    if wanted.contains(id) {
                        d.latencies_ms.entry(id.to_string()).or_default().push(ns / 1e6);
                    }
                }
            }
        }
        let metrics = read_table(dir, Table::Metrics)?;
        if metrics.height() > 0 {
            let ids = metrics.column("run_id")?.str()?.clone();
            let t = metrics.column("t_ms")?.cast(&DataType::Float64)?;
            for (name, _) in READINGS {
                let Ok(col) = metrics.column(name) else { continue };
                let v = col.cast(&DataType::Float64)?;
                for ((id, t), v) in ids.iter().zip(t.f64()?.iter()).zip(v.f64()?.iter()) {
                    if let (Some(id), Some(t), Some(v)) = (id, t, v) {
                        if wanted.contains(id) {
                            d.series.entry((id.to_string(), name)).or_default().push((t / 1e3, v));
                        }
                    }
                }
            }
        }
    }
    for l in d.latencies_ms.values_mut() {
        l.sort_by(f64::total_cmp);
    }
    Ok(d)
}

/// The targets in the order they get colours: by SMs, most first (the baseline first), then name.
pub fn targets(rows: &[Row]) -> Vec<String> {
    let mut best: BTreeMap<String, f64> = BTreeMap::new();
    for r in rows {
        let sms = r.n("sm_count").unwrap_or(0.0);
        let e = best.entry(r.s("target").to_string()).or_insert(sms);
        *e = e.max(sms);
    }
    let mut t: Vec<(String, f64)> = best.into_iter().collect();
    t.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    t.into_iter().map(|(name, _)| name).collect()
}

/// The baseline of the scaling chart and comparisons: the target a sweep marked `baseline = true`,
/// else the one with the most SMs, one not emulated before an emulated one of the same size.
pub fn baseline(rows: &[Row]) -> Option<String> {
    if let Some(r) = rows
        .iter()
        .find(|r| r.is_alone() && r.s("baseline") == "true" && r.n("sm_count").is_some())
    {
        return Some(r.s("target").to_string());
    }
    rows.iter()
        .filter(|r| r.is_alone() && r.n("sm_count").is_some())
        .max_by(|a, b| {
            a.n("sm_count")
                .unwrap()
                .total_cmp(&b.n("sm_count").unwrap())
                .then_with(|| b.s("emulation").is_empty().cmp(&a.s("emulation").is_empty()).reverse())
        })
        .map(|r| r.s("target").to_string())
}

/// Path of a folder as the report names it.
pub fn name(dir: &Path) -> String {
    dir.display().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(target: &str, sms: f64, emulation: &str, baseline: bool) -> Row {
        let mut text: BTreeMap<&'static str, String> = [("target", target.to_string()), ("status", "ok".to_string())]
            .into_iter()
            .collect();
        if !emulation.is_empty() {
            text.insert("emulation", emulation.into());
        }
        if baseline {
            text.insert("baseline", "true".into());
        }
        Row {
            text,
            num: [("sm_count", sms), ("throughput", 1.0)].into_iter().collect(),
        }
    }

    #[test]
    fn the_baseline_is_the_marked_target_else_the_largest_real_one() {
        let rows = vec![
            row("7g", 132.0, "mps", false),
            row("full", 132.0, "", false),
            row("3g", 60.0, "mps", false),
        ];
        assert_eq!(
            baseline(&rows).as_deref(),
            Some("full"),
            "a real device before an emulated one of its size"
        );
        let marked = vec![row("full", 132.0, "", false), row("3g", 60.0, "mps", true)];
        assert_eq!(baseline(&marked).as_deref(), Some("3g"));
        assert_eq!(targets(&rows), vec!["7g", "full", "3g"]);
    }
}
