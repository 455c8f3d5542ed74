//! `migprof compare`: one group of runs against another over the same cells — the full GPU against a
//! 3g slice (`target=full` / `target=3g`), one MIG profile against another, f32 against bf16 — with
//! the ratio's interval and whether the difference is beyond the runs' own uncertainty.
//!
//! Selecting and matching. A selector is `column=value` over the runs table; only `ok` rows count.
//! Baseline and target rows are matched on the cell's workload (model, mode, dtype, batch, sequence
//! length, kernel options, optimizer, weights, concurrency group) minus the selectors' column. When
//! that column says where a run ran (target, device, GPU, MIG or emulated profile), the device fields
//! are what is compared and stay out of the match; otherwise (dtype=f32 against dtype=bf16) the
//! target is part of the match, so that each device is compared with itself.
//!
//! A selector with nothing after `=` picks the rows where the column is null: `concurrency_group=`
//! (cells alone) against `concurrency_group=3g+3g` gives the interference of a group.
//!
//! Pooling. Rows of one cell id are reruns (`--force`): the latest counts. Rows of one match key but
//! several cell ids are repeats: their throughputs are averaged; the standard error is the larger of
//! the repeats' own (each row's 95% interval, pooled) and the spread between repeats (when there are
//! two or more), so that neither a noisy process nor a stable but drifting machine is hidden.
//! Ratio = target / baseline throughput; its 95% interval from the two standard errors on the log
//! scale; `beyond_noise` when it excludes 1.

use std::collections::BTreeMap;

use crate::results::parts::{number_column, text_column};
use anyhow::{bail, Result};
use polars::prelude::*;
use serde::Serialize;

mod kind;
pub mod render;

pub use kind::Kind;

/// What a cell's rows are named by: the workload's shape and, for a generation, its lengths and
/// cache.
pub const CELL: [&str; 9] = [
    "model",
    "mode",
    "dtype",
    "batch",
    "seq_len",
    "prompt_len",
    "output_len",
    "kv_layout",
    "kv_block_size",
];

/// The workload fields two runs must share to be compared: the cell's name and its settings.
pub(super) const WORKLOAD: [&str; 14] = {
    const SETTINGS: [&str; 5] = [
        "kernel_options",
        "optimizer",
        "master_weights",
        "weights",
        "concurrency_group",
    ];
    let mut all = [""; 14];
    let mut i = 0;
    while i < CELL.len() {
        all[i] = CELL[i];
        i += 1;
    }
    while i < all.len() {
        all[i] = SETTINGS[i - CELL.len()];
        i += 1;
    }
    all
};
/// The fields that say where a run ran.
const DEVICE: [&str; 16] = [
    "target",
    "device_name",
    "device_kind",
    "gpu_name",
    "gpu_uuid",
    "mig_profile",
    "mig_uuid",
    "emulated_profile",
    "emulation",
    "mps_share_pct",
    "sm_count",
    "profile_sms",
    "measured_sms",
    "memory_emulation",
    "memory_share_gbps",
    "gpu_bandwidth_gbps",
];
/// What a memory-partitioned row says of its neighbour: whether it held the client to its share.
const PARTITION: [&str; 2] = ["calibration", "measured_bandwidth_gbps"];
/// z for a two-sided 95% interval.
const Z95: f64 = 1.959964;

/// `column=value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Selector {
    pub column: String,
    pub value: String,
}

impl std::str::FromStr for Selector {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s.split_once('=') {
            Some((c, v)) if !c.trim().is_empty() => Ok(Selector {
                column: c.trim().to_string(),
                value: v.trim().to_string(),
            }),
            _ => bail!(
                "selector `{s}`: expected column=value over the runs table, e.g. target=full or mig_profile=3g.40gb"
            ),
        }
    }
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.column, self.value)
    }
}

/// One side of a matched cell: its runs pooled.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Side {
    pub runs: usize,
    pub throughput: f64,
    pub throughput_se: Option<f64>,
    /// None for a capacity, which has only its p99.
    pub p50_ms: Option<f64>,
    pub p99_ms: f64,
    /// Targets (devices) the rows ran on.
    pub targets: String,
    /// The rows' verdicts other than `ok` (shared, throttled, ...), each once.
    pub caveats: Vec<String>,
}

/// One matched cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Compared {
    /// The match key, field by field.
    pub cell: BTreeMap<String, String>,
    /// The key in the order of its fields (model, mode, dtype, batch, ...), for tables.
    #[serde(skip)]
    pub ordered: Vec<(String, String)>,
    pub baseline: Side,
    pub target: Side,
    /// target / baseline throughput.
    pub ratio: f64,
    pub ratio_ci_low: Option<f64>,
    pub ratio_ci_high: Option<f64>,
    /// The ratio's interval excludes 1: a difference the runs' own noise does not explain.
    pub beyond_noise: Option<bool>,
    /// An emulated target's range: the same cell emulated alone and memory-partitioned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub range: Option<EmulatedRange>,
}

/// An emulated slice as a range, each bound's throughput relative to the baseline, beside the
/// profile's share of the SMs and of the memory ([`crate::mps::PLAN_WITH`] says which to plan with).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmulatedRange {
    pub profile: String,
    /// `mps:`: all of the GPU's memory system, the upper bound.
    pub alone: Option<f64>,
    /// `mps-mem:`: its share of the bandwidth, and less than its share of the L2: the lower bound.
    pub partitioned: Option<f64>,
    /// The profile's SMs over the baseline's (when the baseline is a whole GPU).
    pub sm_share: Option<f64>,
    /// The bandwidth share the partitioned client was held to, over the GPU's.
    pub memory_share: Option<f64>,
    /// Where the neighbour did not hold the partitioned client to its share: the client's bandwidth
    /// over its share, and the calibration's outcome.
    pub share_missed: Option<(f64, String)>,
}

/// What a comparison found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub baseline: String,
    pub target: String,
    pub rows: Vec<Compared>,
    /// Cells one side had and the other did not.
    pub baseline_only: usize,
    pub target_only: usize,
}

/// A runs row, as far as comparing needs it.
struct Row {
    /// The selectors' column.
    selected: Option<String>,
    cell_id: String,
    run_id: String,
    fields: BTreeMap<&'static str, String>,
    throughput: f64,
    ci: Option<(f64, f64)>,
    p50_ms: Option<f64>,
    p99_ms: f64,
    verdict: Option<String>,
}

/// The match fields whose values on one side appear on none of the other's cells, with both sides'
/// values: why two sides matched nothing.
fn mismatch(
    fields: &[&str],
    base: &BTreeMap<Vec<String>, Vec<&Row>>,
    tgt: &BTreeMap<Vec<String>, Vec<&Row>>,
) -> String {
    let values = |side: &BTreeMap<Vec<String>, Vec<&Row>>, i: usize| -> std::collections::BTreeSet<String> {
        side.keys()
            .map(|k| match k[i].as_str() {
                "" => "(none)".to_string(),
                v => v.to_string(),
            })
            .collect()
    };
    let differ: Vec<String> = fields
        .iter()
        .enumerate()
        .filter_map(|(i, f)| {
            let (b, t) = (values(base, i), values(tgt, i));
            b.is_disjoint(&t).then(|| {
                format!(
                    "{f} is {} on one side and {} on the other",
                    b.into_iter().collect::<Vec<_>>().join("/"),
                    t.into_iter().collect::<Vec<_>>().join("/")
                )
            })
        })
        .collect();
    match differ.is_empty() {
        true => "no one combination of them is on both sides".to_string(),
        false => format!("{}: select runs that share them", differ.join("; ")),
    }
}

/// The targets `rows` ran on, each once, in order.
fn targets_of<'a>(rows: &[&'a Row]) -> Vec<&'a str> {
    let mut targets: Vec<&str> = rows
        .iter()
        .map(|r| r.fields.get("target").map_or("?", String::as_str))
        .collect();
    targets.sort_unstable();
    targets.dedup();
    targets
}

/// The values the selectors' column takes in `rows`, for an error.
fn values_of(rows: &[Row]) -> String {
    let values: std::collections::BTreeSet<&str> =
        rows.iter().map(|r| r.selected.as_deref().unwrap_or("(null)")).collect();
    values.into_iter().collect::<Vec<_>>().join(", ")
}

/// Pooling is for repeats of one cell on one target, never for several targets' rows, nor for
/// cells that differ in a field left out of the match because it follows from the selectors'
/// column.
fn one_cell_per_key(sel: &Selector, by_key: &BTreeMap<Vec<String>, Vec<&Row>>, follows: &[&str]) -> Result<()> {
    for rows in by_key.values() {
        let targets = targets_of(rows);
        if targets.len() > 1 {
            bail!(
                "{sel} holds runs of one cell on several targets ({}): they would be averaged as repeats; select on `target` (or a column with one target per value)",
                targets.join(", ")
            )
        }
        // A field left out of the match because it follows from the selectors' column must
        // still be one value within a side, or cells that differ in it would be pooled.
        for field in follows {
            let mut values: Vec<&str> = rows
                .iter()
                .map(|r| r.fields.get(field).map_or("", String::as_str))
                .collect();
            values.sort_unstable();
            values.dedup();
            if values.len() > 1 {
                bail!(
                    "{sel} holds cells that differ only in {field} ({}): they would be averaged as repeats; compare them with --baseline {field}=… --target {field}=…",
                    values.join(", ")
                )
            }
        }
    }
    Ok(())
}

/// One cell's comparison: each side's repeats pooled, the ratio of their throughputs with its
/// interval, and an emulated slice's range.
fn compared(
    kind: Kind,
    key_fields: &[&'static str],
    key: &[String],
    latest: &[&Row],
    b: &[&Row],
    t: &[&Row],
) -> Compared {
    let range = emulated_range(&kind.workload(), latest, b, t);
    let (b, t) = (pool(b), pool(t));
    let ratio = t.throughput / b.throughput;
    let se = match (b.throughput_se, t.throughput_se) {
        (Some(sb), Some(st)) => Some(((sb / b.throughput).powi(2) + (st / t.throughput).powi(2)).sqrt()),
        _ => None,
    };
    let (low, high) = (
        se.map(|s| ratio * (-Z95 * s).exp()),
        se.map(|s| ratio * (Z95 * s).exp()),
    );
    Compared {
        cell: key_fields
            .iter()
            .zip(key)
            .filter(|(_, v)| !v.is_empty())
            .map(|(f, v)| (f.to_string(), v.clone()))
            .collect(),
        ordered: key_fields
            .iter()
            .zip(key)
            .map(|(f, v)| (f.to_string(), v.clone()))
            .collect(),
        baseline: b,
        target: t,
        ratio,
        ratio_ci_low: low,
        ratio_ci_high: high,
        beyond_noise: low.zip(high).map(|(l, h)| l > 1.0 || h < 1.0),
        range,
    }
}

/// Compares the runs table's rows of `baseline` and `target`.
pub fn compare(runs: &DataFrame, baseline: &Selector, target: &Selector) -> Result<Comparison> {
    compare_rows(runs, Kind::Runs, baseline, target)
}

/// Compares the rows of `frame` (a table of `kind`) of `baseline` and `target`.
pub fn compare_rows(frame: &DataFrame, kind: Kind, baseline: &Selector, target: &Selector) -> Result<Comparison> {
    let runs = frame;
    let table = kind.table().dir_name();
    if baseline.column != target.column {
        bail!("--baseline {baseline} and --target {target} select on different columns; compare one column's two values (e.g. target=full and target=3g)")
    }
    if baseline.value == target.value {
        bail!("--baseline and --target both select {baseline}: a group compared with itself is 1.0 by construction; give the target another value of `{}` (e.g. target=full and target=3g)", baseline.column)
    }
    let column = baseline.column.as_str();
    if runs.column(column).is_err() {
        let names: Vec<String> = runs.get_column_names().iter().map(|n| n.to_string()).collect();
        bail!(
            "the {table} table has no column `{column}`; its columns: {}",
            names.join(", ")
        )
    }
    let rows = read_rows(runs, column, kind)?;
    // Where the selectors pick devices, devices are what is compared; otherwise each with itself.
    // A field that follows from the selectors' column is left out with it.
    let follows = follows_from(column);
    let mut key_fields: Vec<&'static str> = kind
        .workload()
        .iter()
        .copied()
        .filter(|f| *f != column && !follows.contains(f))
        .collect();
    if !DEVICE.contains(&column) {
        key_fields.push("target");
    }
    let side = |sel: &Selector| -> BTreeMap<Vec<String>, Vec<&Row>> {
        let picked = rows.iter().filter(|row| match &row.selected {
            Some(v) => *v == sel.value,
            None => sel.value.is_empty(),
        });
        let mut by_key: BTreeMap<Vec<String>, Vec<&Row>> = BTreeMap::new();
        for row in latest_per_cell(picked) {
            by_key
                .entry(
                    key_fields
                        .iter()
                        .map(|f| row.fields.get(f).cloned().unwrap_or_default())
                        .collect(),
                )
                .or_default()
                .push(row);
        }
        by_key
    };
    let (base, tgt) = (side(baseline), side(target));
    for (sel, by_key) in [(baseline, &base), (target, &tgt)] {
        one_cell_per_key(sel, by_key, follows)?;
    }
    if base.is_empty() || tgt.is_empty() {
        let empty = if base.is_empty() { baseline } else { target };
        bail!("no ok run has {empty}; values of `{column}` here: {}", values_of(&rows))
    }
    let latest = latest_per_cell(rows.iter());
    let mut out = Vec::new();
    for (key, b) in &base {
        let Some(t) = tgt.get(key) else { continue };
        out.push(compared(kind, &key_fields, key, &latest, b, t));
    }
    if out.is_empty() {
        bail!(
            "no cell of {baseline} has a match in {target}: rows are matched on {}, and {}",
            key_fields.join(", "),
            mismatch(&key_fields, &base, &tgt)
        )
    }
    Ok(Comparison {
        baseline: baseline.to_string(),
        target: target.to_string(),
        baseline_only: base.keys().filter(|k| !tgt.contains_key(*k)).count(),
        target_only: tgt.keys().filter(|k| !base.contains_key(*k)).count(),
        rows: out,
    })
}

/// The match fields that follow from the selectors' `column` and are left out with it: a
/// contiguous cache has no block size (kv_layout=contiguous against kv_layout=paged would otherwise
/// match nothing); a user's program (family `program`) has none of migprof's kernel options,
/// optimizer, weights or sequence length, so against migprof's engine it is matched on model, mode,
/// dtype and batch.
fn follows_from(column: &str) -> &'static [&'static str] {
    match column {
        "kv_layout" => &["kv_block_size"],
        "family" => &["seq_len", "kernel_options", "optimizer", "master_weights", "weights"],
        _ => &[],
    }
}

/// Of `rows`, each cell's latest (reruns replaced).
fn latest_per_cell<'a>(rows: impl Iterator<Item = &'a Row>) -> Vec<&'a Row> {
    let mut latest: BTreeMap<&str, &Row> = BTreeMap::new();
    for row in rows {
        if latest
            .get(row.cell_id.as_str())
            .is_none_or(|old| old.run_id < row.run_id)
        {
            latest.insert(&row.cell_id, row);
        }
    }
    latest.into_values().collect()
}

/// Where the target rows are an emulated slice: its range, the same workload emulated the other way
/// found among `all`, both relative to the baseline rows.
fn emulated_range(workload: &[&str], all: &[&Row], base: &[&Row], target: &[&Row]) -> Option<EmulatedRange> {
    let first = target.first()?;
    let field = |r: &Row, f: &str| r.fields.get(f).cloned().unwrap_or_default();
    // Emulated rows written before `memory_emulation` existed (schema 7) ran alone.
    let memory_of = |r: &Row| match field(r, "memory_emulation") {
        m if m.is_empty() && field(r, "emulation") == "mps" => crate::mps::MemoryEmulation::Alone.as_str().to_string(),
        m => m,
    };
    let profile = field(first, "emulated_profile");
    let memory = memory_of(first);
    if profile.is_empty() || memory.is_empty() {
        return None;
    }
    let twin_memory = if memory == crate::mps::MemoryEmulation::Alone.as_str() {
        crate::mps::MemoryEmulation::Partitioned.as_str()
    } else {
        crate::mps::MemoryEmulation::Alone.as_str()
    };
    let same_work = |r: &Row| workload.iter().all(|f| field(r, f) == field(first, f));
    let twins: Vec<&Row> = all
        .iter()
        .copied()
        .filter(|r| {
            same_work(r) && field(r, "emulated_profile") == profile && field(r, "memory_emulation") == twin_memory
        })
        .collect();
    let base_tp = pool(base).throughput;
    let ratio = |rows: &[&Row]| (!rows.is_empty()).then(|| pool(rows).throughput / base_tp);
    let (mine, theirs) = (ratio(target), ratio(&twins));
    let (alone, partitioned) = if memory == crate::mps::MemoryEmulation::Alone.as_str() {
        (mine, theirs)
    } else {
        (theirs, mine)
    };
    let number = |r: &Row, f: &str| r.fields.get(f).and_then(|v| v.parse::<f64>().ok());
    let whole_sms = base
        .first()
        .filter(|r| field(r, "device_kind") == "cuda")
        .and_then(|r| number(r, "sm_count"));
    let sm_share = number(first, "profile_sms").zip(whole_sms).map(|(p, w)| p / w);
    let memory_share = target
        .iter()
        .chain(&twins)
        .find_map(|r| number(r, "memory_share_gbps").zip(number(r, "gpu_bandwidth_gbps")))
        .map(|(s, g)| s / g);
    let share_missed = target.iter().chain(&twins).find_map(|r| {
        let outcome = field(r, "calibration");
        let ratio = number(r, "measured_bandwidth_gbps").zip(number(r, "memory_share_gbps"));
        crate::mps::calibration::Outcome::missed_share(&outcome)
            .then_some(())
            .and(ratio)
            .map(|(b, s)| (b / s, outcome))
    });
    Some(EmulatedRange {
        profile,
        alone,
        partitioned,
        sm_share,
        memory_share,
        share_missed,
    })
}

/// Repeats of one cell, pooled (see the module's comment).
fn pool(rows: &[&Row]) -> Side {
    let k = rows.len() as f64;
    let mean = |f: &dyn Fn(&Row) -> f64| rows.iter().map(|r| f(r)).sum::<f64>() / k;
    let throughput = mean(&|r| r.throughput);
    // Each row's standard error from its 95% interval's half-width.
    let own: Option<Vec<f64>> = rows.iter().map(|r| r.ci.map(|(l, h)| (h - l) / 2.0 / Z95)).collect();
    let within = own.map(|se| se.iter().map(|s| s * s).sum::<f64>().sqrt() / k);
    let between = (rows.len() >= 2)
        .then(|| (rows.iter().map(|r| (r.throughput - throughput).powi(2)).sum::<f64>() / (k - 1.0)).sqrt() / k.sqrt());
    let throughput_se = match (within, between) {
        (Some(w), Some(b)) => Some(w.max(b)),
        (w, b) => w.or(b),
    };
    let targets = targets_of(rows);
    let mut caveats: Vec<String> = rows
        .iter()
        .filter_map(|r| r.verdict.clone())
        .filter(|v| v != "ok")
        .collect();
    caveats.sort_unstable();
    caveats.dedup();
    Side {
        runs: rows.len(),
        throughput,
        throughput_se,
        p50_ms: rows.iter().map(|r| r.p50_ms).sum::<Option<f64>>().map(|sum| sum / k),
        p99_ms: mean(&|r| r.p99_ms),
        targets: targets.join(","),
        caveats,
    }
}

/// Row `i`'s value of `field` among `fields`, empty where null.
fn fields_at(fields: &[(&'static str, Vec<Option<String>>)], field: &str, i: usize) -> String {
    fields
        .iter()
        .find(|(f, _)| *f == field)
        .and_then(|(_, v)| v[i].clone())
        .unwrap_or_default()
}

fn read_rows(runs: &DataFrame, column: &str, kind: Kind) -> Result<Vec<Row>> {
    let status = text_column(runs, "status")?;
    let (selected, verdict) = (text_column(runs, column)?, text_column(runs, "verdict")?);
    let (cell_id, run_id) = (text_column(runs, "cell_id")?, text_column(runs, kind.id_column())?);
    // A search's steps: their rates are the search's, not a step asked for.
    let searched = match kind.stepped() {
        true => text_column(runs, "capacity_id")?,
        false => vec![None; runs.height()],
    };
    let fields: Vec<(&'static str, Vec<Option<String>>)> = kind
        .workload()
        .iter()
        .chain(DEVICE.iter())
        .chain(PARTITION.iter())
        .map(|f| Ok((*f, text_column(runs, f)?)))
        .collect::<Result<_>>()?;
    let (tp_column, ci_columns, p50_column, p99_column) = kind.columns();
    let (tp, p99) = (number_column(runs, tp_column)?, number_column(runs, p99_column)?);
    let (low, high) = match ci_columns {
        Some((l, h)) => (number_column(runs, l)?, number_column(runs, h)?),
        None => (vec![None; runs.height()], vec![None; runs.height()]),
    };
    let p50 = match p50_column {
        Some(c) => number_column(runs, c)?,
        None => vec![None; runs.height()],
    };
    let mut rows = Vec::new();
    for i in 0..runs.height() {
        // Rows of a plain `run` before the status column existed count as measured.
        if status[i].as_deref().is_some_and(|s| s != "ok") || searched[i].is_some() {
            continue;
        }
        let (Some(throughput), Some(p99_ms)) = (tp[i], p99[i]) else {
            continue;
        };
        if p50_column.is_some() && p50[i].is_none() {
            continue;
        }
        // A load job's steps share its cell id: a step is the job's cell at its concurrency or
        // rate (a rerun of it replaces it, as a rerun of a run does).
        let cell = match kind.stepped() {
            true => format!(
                "{}/{}/{}",
                cell_id[i].clone().unwrap_or_default(),
                fields_at(&fields, "concurrency", i),
                fields_at(&fields, "offered_qps", i)
            ),
            false => cell_id[i].clone().unwrap_or_else(|| format!("row{i}")),
        };
        rows.push(Row {
            selected: selected[i].clone(),
            verdict: verdict[i].clone(),
            cell_id: cell,
            run_id: run_id[i].clone().unwrap_or_default(),
            fields: fields
                .iter()
                .filter_map(|(f, v)| v[i].clone().map(|v| (*f, v)))
                .collect(),
            throughput,
            ci: low[i].zip(high[i]),
            p50_ms: p50[i],
            p99_ms,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::render::Format;
    use super::*;

    /// A runs row: (cell_id, run_id, target, dtype, batch, throughput, ci half-width).
    type Made<'a> = (&'a str, &'a str, &'a str, &'a str, i64, f64, f64);

    fn frame(rows: &[Made]) -> DataFrame {
        let col = |f: fn(&Made) -> String| rows.iter().map(f).collect::<Vec<String>>();
        df!(
            "status" => vec!["ok"; rows.len()],
            "cell_id" => col(|r| r.0.into()),
            "run_id" => col(|r| r.1.into()),
            "target" => col(|r| r.2.into()),
            "dtype" => col(|r| r.3.into()),
            "model" => vec!["resnet50"; rows.len()],
            "mode" => vec!["infer"; rows.len()],
            "batch" => rows.iter().map(|r| r.4).collect::<Vec<i64>>(),
            "throughput" => rows.iter().map(|r| r.5).collect::<Vec<f64>>(),
            "throughput_ci_low" => rows.iter().map(|r| r.5 - r.6).collect::<Vec<f64>>(),
            "throughput_ci_high" => rows.iter().map(|r| r.5 + r.6).collect::<Vec<f64>>(),
            "p50_ms" => vec![1.0; rows.len()],
            "p99_ms" => vec![2.0; rows.len()],
        )
        .unwrap()
    }

    fn sel(s: &str) -> Selector {
        s.parse().unwrap()
    }

    #[test]
    fn generations_of_other_lengths_are_other_cells() {
        // The same model and batch on both targets, prompts of 128 and 512 tokens: two cells, each
        // against its own twin, never a 128-token run against a 512-token one.
        let mut runs = frame(&[
            ("a1", "r1", "full", "bf16", 1, 200.0, 2.0),
            ("a2", "r2", "full", "bf16", 1, 150.0, 2.0),
            ("b1", "r3", "1g", "bf16", 1, 100.0, 1.0),
            ("b2", "r4", "1g", "bf16", 1, 50.0, 1.0),
        ]);
        let prompts = Column::new("prompt_len".into(), vec![128i64, 512, 128, 512]);
        runs.with_column(prompts).unwrap();
        let c = compare(&runs, &sel("target=full"), &sel("target=1g")).unwrap();
        assert_eq!(c.rows.len(), 2);
        let at = |p: &str| c.rows.iter().find(|r| r.cell["prompt_len"] == p).unwrap();
        assert!((at("128").ratio - 0.5).abs() < 1e-12);
        assert!((at("512").ratio - 1.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn cache_layouts_compare_without_their_block_size_and_no_match_says_why() {
        let mut runs = frame(&[
            ("a1", "r1", "full", "bf16", 1, 200.0, 2.0),
            ("b1", "r2", "full", "bf16", 1, 180.0, 2.0),
        ]);
        runs.with_column(Column::new("kv_layout".into(), vec!["contiguous", "paged"]))
            .unwrap();
        runs.with_column(Column::new("kv_block_size".into(), vec![None, Some(16i64)]))
            .unwrap();
        let c = compare(&runs, &sel("kv_layout=contiguous"), &sel("kv_layout=paged")).unwrap();
        assert_eq!(c.rows.len(), 1);
        assert!((c.rows[0].ratio - 0.9).abs() < 1e-12);
        // Paged cells of two block sizes are two cells, never pooled as repeats of one.
        let mut two = frame(&[
            ("a1", "r1", "full", "bf16", 1, 200.0, 2.0),
            ("b1", "r2", "full", "bf16", 1, 180.0, 2.0),
            ("b2", "r3", "full", "bf16", 1, 160.0, 2.0),
        ]);
        two.with_column(Column::new("kv_layout".into(), vec!["contiguous", "paged", "paged"]))
            .unwrap();
        two.with_column(Column::new("kv_block_size".into(), vec![None, Some(16i64), Some(32)]))
            .unwrap();
        let e = compare(&two, &sel("kv_layout=contiguous"), &sel("kv_layout=paged"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ only in kv_block_size (16, 32)"), "{e}");
        // Other batches on each side: nothing matches, and the reason is the field that differs.
        let mut runs = frame(&[
            ("a1", "r1", "full", "bf16", 1, 200.0, 2.0),
            ("b1", "r2", "full", "f32", 8, 180.0, 2.0),
        ]);
        runs.with_column(Column::new("kv_layout".into(), vec!["contiguous", "paged"]))
            .unwrap();
        let e = compare(&runs, &sel("kv_layout=contiguous"), &sel("kv_layout=paged"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no cell of kv_layout=contiguous has a match in kv_layout=paged")
                && e.contains("batch is 1 on one side and 8 on the other")
                && e.contains("dtype is bf16 on one side and f32 on the other"),
            "{e}"
        );
    }

    #[test]
    fn the_full_gpu_against_a_3g_slice_cell_by_cell() {
        let runs = frame(&[
            ("a1", "r1", "full", "bf16", 32, 1000.0, 10.0),
            ("b1", "r2", "3g", "bf16", 32, 500.0, 5.0),
            ("a2", "r3", "full", "bf16", 128, 2000.0, 10.0),
            ("b2", "r4", "3g", "bf16", 128, 1980.0, 40.0),
            ("a3", "r5", "full", "bf16", 8, 100.0, 1.0),
        ]);
        let c = compare(&runs, &sel("target=full"), &sel("target=3g")).unwrap();
        assert_eq!((c.rows.len(), c.baseline_only, c.target_only), (2, 1, 0));
        // Batch 128 sorts before 32 as text: the rows follow the key.
        let at = |b: &str| c.rows.iter().find(|r| r.cell["batch"] == b).unwrap();
        let half = at("32");
        assert!((half.ratio - 0.5).abs() < 1e-12);
        assert_eq!(half.beyond_noise, Some(true));
        // 1% apart with a ±2% target interval: within the noise.
        assert_eq!(at("128").beyond_noise, Some(false));
        assert!(!half.cell.contains_key("target"), "the device is what is compared");
        let json: serde_json::Value = serde_json::from_str(&c.render(Format::Json).unwrap()).unwrap();
        assert!((json["rows"][0]["ratio"].as_f64().unwrap() - 0.99).abs() < 1e-12);
        let text = c.render(Format::Text).unwrap();
        assert!(
            text.starts_with(
                "target=3g (target) against target=full (baseline): 2 matched cell(s); unmatched: 1 baseline only"
            ),
            "{text}"
        );
        let md = c.render(Format::Md).unwrap();
        assert!(
            md.contains("every cell: model=resnet50, mode=infer, dtype=bf16\n"),
            "{md}"
        );
        assert!(md.contains("| 32 | 1000.0 | 500.0 | 0.500 ("), "{md}");
    }

    #[test]
    fn a_dtype_comparison_keeps_each_device_with_itself_and_pools_repeats() {
        let runs = frame(&[
            ("f1", "r1", "full", "f32", 32, 100.0, 1.0),
            ("f1", "r2", "full", "f32", 32, 110.0, 1.0), // a rerun of f1: the latest counts
            ("g1", "r3", "full", "bf16", 32, 300.0, 3.0),
            ("g2", "r4", "full", "bf16", 32, 330.0, 3.0), // a repeat of the bf16 cell
            ("h1", "r5", "3g", "f32", 32, 50.0, 1.0),
            ("i1", "r6", "3g", "bf16", 32, 150.0, 1.0),
        ]);
        let c = compare(&runs, &sel("dtype=f32"), &sel("dtype=bf16")).unwrap();
        assert_eq!(c.rows.len(), 2);
        let full = c.rows.iter().find(|r| r.cell["target"] == "full").unwrap();
        assert_eq!((full.baseline.runs, full.target.runs), (1, 2));
        assert!((full.baseline.throughput - 110.0).abs() < 1e-12);
        assert!((full.ratio - 315.0 / 110.0).abs() < 1e-12);
        // Two repeats 30/s apart: the spread between them (15/s) outweighs their own ±3/s.
        assert!(
            (full.target.throughput_se.unwrap() - 15.0).abs() < 1e-9,
            "{:?}",
            full.target.throughput_se
        );
        let slice = c.rows.iter().find(|r| r.cell["target"] == "3g").unwrap();
        assert!((slice.ratio - 3.0).abs() < 1e-12);
    }

    #[test]
    fn cells_alone_against_a_group_and_no_pooling_across_targets() {
        let mut runs = frame(&[
            ("a", "r1", "3g", "bf16", 32, 1000.0, 10.0),
            ("b", "r2", "3g", "bf16", 32, 800.0, 10.0),
            ("c", "r3", "1g", "bf16", 32, 300.0, 3.0),
            ("d", "r4", "1g", "bf16", 32, 200.0, 3.0),
        ]);
        runs.with_column(Column::new(
            "concurrency_group".into(),
            [None, Some("g"), None, Some("g")],
        ))
        .unwrap();
        runs.with_column(Column::new("verdict".into(), ["ok", "shared", "ok", "ok"]))
            .unwrap();
        let c = compare(&runs, &sel("concurrency_group="), &sel("concurrency_group=g")).unwrap();
        assert_eq!(c.rows.len(), 2, "each target with itself");
        let three = c.rows.iter().find(|r| r.cell["target"] == "3g").unwrap();
        assert!((three.ratio - 0.8).abs() < 1e-12);
        assert_eq!(
            (three.baseline.caveats.clone(), three.target.caveats.clone()),
            (vec![], vec!["shared".to_string()])
        );
        assert!(c.render(Format::Text).unwrap().contains("ok/shared"));
        // dtype against dtype over two targets is fine; a device column other than target that
        // spans two targets on one side would average them: refused.
        runs.with_column(Column::new("device_kind".into(), ["mps", "mps", "mps", "mps"]))
            .unwrap();
        let e = compare(&runs, &sel("device_kind=mps"), &sel("device_kind=cuda"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("several targets (1g, 3g)"), "{e}");
    }

    #[test]
    fn an_emulated_slice_is_shown_as_its_range_with_the_bound_to_plan_with() {
        // The whole GPU, a 1g emulated alone and memory-partitioned, at batch 32; a 3g alone only.
        let rows: [(&str, &str, &str, &str, &str, f64); 4] = [
            ("f", "0", "cuda", "", "", 1000.0),
            ("a", "1", "mps", "1g.10gb", "alone", 190.0),
            ("p", "2", "mps", "1g.10gb", "partitioned", 110.0),
            ("t", "3", "mps", "3g.40gb", "alone", 530.0),
        ];
        let target = ["full", "1g", "1g-mem", "3g"];
        type Made = (
            &'static str,
            &'static str,
            &'static str,
            &'static str,
            &'static str,
            f64,
        );
        let text = |f: fn(&Made) -> &'static str| {
            rows.iter()
                .map(|r| Some(f(r)).filter(|v| !v.is_empty()).map(str::to_string))
                .collect::<Vec<Option<String>>>()
        };
        let number = |v: [Option<f64>; 4]| v.to_vec();
        let runs = df!(
            "status" => vec!["ok"; 4],
            "cell_id" => text(|r| r.0),
            "run_id" => text(|r| r.1),
            "target" => target.to_vec(),
            "device_kind" => text(|r| r.2),
            "emulated_profile" => text(|r| r.3),
            "memory_emulation" => text(|r| r.4),
            "model" => vec!["resnet50"; 4],
            "mode" => vec!["infer"; 4],
            "dtype" => vec!["bf16"; 4],
            "batch" => vec![32i64; 4],
            "sm_count" => number([Some(132.0), Some(16.0), Some(16.0), Some(60.0)]),
            "profile_sms" => number([None, Some(16.0), Some(16.0), Some(60.0)]),
            "memory_share_gbps" => number([None, None, Some(373.0), None]),
            "gpu_bandwidth_gbps" => number([None, None, Some(2984.0), None]),
            "calibration" => [None, None, Some("neighbour_too_weak"), None].to_vec(),
            "measured_bandwidth_gbps" => number([None, Some(1240.0), Some(429.0), None]),
            "throughput" => rows.iter().map(|r| r.5).collect::<Vec<f64>>(),
            "p50_ms" => vec![1.0; 4],
            "p99_ms" => vec![2.0; 4],
        )
        .unwrap();
        let sel = |s: &str| s.parse::<Selector>().unwrap();
        for t in ["1g", "1g-mem"] {
            let c = compare(&runs, &sel("target=full"), &sel(&format!("target={t}"))).unwrap();
            let g = c.rows[0].range.as_ref().unwrap();
            assert_eq!(g.profile, "1g.10gb");
            assert!(
                (g.alone.unwrap() - 0.19).abs() < 1e-9 && (g.partitioned.unwrap() - 0.11).abs() < 1e-9,
                "{g:?}"
            );
            assert!((g.sm_share.unwrap() - 16.0 / 132.0).abs() < 1e-9);
            assert!((g.memory_share.unwrap() - 0.125).abs() < 1e-3);
            let out = c.render(Format::Text).unwrap();
            assert!(
                out.contains("1g.10gb") && out.contains("alone 0.190 .. memory-partitioned 0.110"),
                "{out}"
            );
            assert!(out.contains("plan with the memory-partitioned bound"), "{out}");
            // A neighbour that could not hold the client to its share is said beside the range.
            assert!(
                out.contains("(its memory-partitioned client read 1.15 times its bandwidth share: neighbour_too_weak)"),
                "{out}"
            );
        }
        // Without its twin the range has one bound, and says how to get the other.
        let c = compare(&runs, &sel("target=full"), &sel("target=3g")).unwrap();
        let g = c.rows[0].range.as_ref().unwrap();
        assert_eq!((g.partitioned, g.memory_share), (None, None));
        assert!(c
            .render(Format::Md)
            .unwrap()
            .contains("run it on mps-mem:<profile> too"));
        // A whole GPU has no range.
        let c = compare(&runs, &sel("target=1g"), &sel("target=full")).unwrap();
        assert!(c.rows[0].range.is_none());
    }

    #[test]
    fn bad_selectors_say_what_there_is() {
        let runs = frame(&[("a", "r", "full", "f32", 1, 1.0, 0.1)]);
        let e = compare(&runs, &sel("gpu=full"), &sel("gpu=3g"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no column `gpu`") && e.contains("target"), "{e}");
        let e = compare(&runs, &sel("target=full"), &sel("dtype=bf16"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("different columns"), "{e}");
        let e = compare(&runs, &sel("target=full"), &sel("target=full"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("both select target=full") && e.contains("with itself"),
            "{e}"
        );
        let e = compare(&runs, &sel("target=full"), &sel("target=3g"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no ok run has target=3g; values of `target` here: full"),
            "{e}"
        );
        assert!("full"
            .parse::<Selector>()
            .unwrap_err()
            .to_string()
            .contains("column=value"));
    }
}
