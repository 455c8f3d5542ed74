//! The report's sections, from the rows: what ran, one section per model (its modes and dtypes:
//! throughput, latency, memory and GR activity against batch, one series per target), the scaling of
//! throughput with the share of SMs, each target against the baseline, energy per sample.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;
use polars::prelude::*;

use super::chart::{scale_for, Chart, Point, Scale, Series};
use super::data::{self, Row};
use super::page::{fmt, slug, table, Block, Section};
use crate::run::fingerprint::notable_pool_held;

/// The sections of the runs: what ran (`everyone` adds the targets that only served load), one
/// section per model, the scaling with the share of SMs and each target against the baseline, energy.
pub fn of_runs(
    rows: &[Row],
    everyone: &[Row],
    targets: &[String],
    colour: &dyn Fn(&str) -> usize,
    detail: &data::Detail,
    sources: &[String],
    detail_batch: Option<usize>,
) -> Result<Vec<Section>> {
    let baseline = data::baseline(rows);
    let mut out = vec![what_ran(rows, everyone, sources, targets, baseline.as_deref())];
    out.extend(per_model(rows, detail, colour, detail_batch)?);
    if let Some(b) = &baseline {
        out.extend(scaling(rows, b, colour)?);
        out.extend(against_baseline(rows, b)?);
    }
    out.extend(emulation_error(rows));
    out.extend(sequences_held(rows));
    out.extend(energy(rows));
    Ok(out)
}

/// Where a `"max"` search ran for a language model: the most sequences each target held at the
/// generation's lengths (its weights, and every sequence's KV cache and workspace, within the
/// target's memory), and what they decoded. The search's tries are rows of status `probe` (they
/// fit) and `oom` (they did not, or the memory estimate refused them); the run at the batch it found
/// is the `ok` row at the largest try that fit. With no try refused, the search stopped at its
/// limit, and the target holds at least that many.
fn sequences_held(rows: &[Row]) -> Option<Section> {
    type Key = (String, String, String, String, String);
    let key = |r: &Row| -> Key {
        (
            r.s("target").into(),
            r.s("model").into(),
            r.s("dtype").into(),
            r.lengths(),
            r.s("kv_layout").into(),
        )
    };
    let mut tries: BTreeMap<Key, (i64, Option<i64>)> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.s("mode") == "generate") {
        let batch = r.n("batch").unwrap_or(0.0) as i64;
        let (fit, refused) = match r.s("status") {
            "probe" => (batch, None),
            "oom" => (0, Some(batch)),
            _ => continue,
        };
        let t = tries.entry(key(r)).or_insert((0, None));
        t.0 = t.0.max(fit);
        t.1 = match (t.1, refused) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    let held: Vec<Vec<String>> = tries
        .iter()
        .filter(|(_, (fit, _))| *fit > 0)
        .map(|(k, &(fit, refused))| {
            // The latest such run: rows are in the order they were written.
            let run = rows
                .iter()
                .rev()
                .find(|r| r.s("status") == "ok" && key(r) == *k && r.n("batch") == Some(fit as f64));
            vec![
                k.0.clone(),
                k.1.clone(),
                k.2.clone(),
                k.3.clone(),
                k.4.clone(),
                match refused {
                    Some(b) => format!("{fit} ({b} did not fit)"),
                    None => format!("at least {fit} (the search's limit)"),
                },
                fmt(run.and_then(|r| r.n("throughput")), 1),
                // To the KiB: a small model's sequence holds a few.
                fmt(
                    run.and_then(|r| r.n("kv_cache_bytes_per_seq"))
                        .map(|b| b / (1024.0 * 1024.0)),
                    3,
                ),
            ]
        })
        .collect();
    if held.is_empty() {
        return None;
    }
    Some(Section {
        id: "sequences-held".into(),
        title: "Sequences each target holds".into(),
        level: 2,
        blocks: vec![
            Block::Text("The most sequences of a language model each target held at once, as a \"max\" batch search found them: the weights, and every sequence's KV cache and workspace at the generation's lengths, within the target's memory. Decode tokens/s are the run's at that batch.".into()),
            table(
                &["target", "model", "dtype", "lengths", "KV layout", "sequences", "decode tokens/s", "KV cache a sequence (MiB)"],
                held,
            ),
        ],
    })
}

/// Where a folder has real MIG slices and their emulated twins (the same profile of the same GPU,
/// the same cell): each emulated bound's error against the real slice, per profile.
fn emulation_error(rows: &[Row]) -> Option<Section> {
    // (GPU, profile, cell) -> real, alone, partitioned: the sum of the repeats' throughputs and
    // their count.
    type Found = BTreeMap<(String, String, String), [(f64, u32); 3]>;
    let mut found: Found = BTreeMap::new();
    for r in rows.iter().filter(|r| r.is_alone()) {
        let Some(tp) = r.n("throughput") else { continue };
        let (slot, profile) = match (r.s("mig_profile"), r.s("emulated_profile"), r.s("memory_emulation")) {
            (p, _, _) if !p.is_empty() => (0, p),
            (_, p, "partitioned") if !p.is_empty() => (2, p),
            (_, p, _) if !p.is_empty() && r.s("emulation") == "mps" => (1, p),
            _ => continue,
        };
        let mut cell = format!("{} {} {} {}", r.s("model"), r.s("mode"), r.s("dtype"), r.s("batch"));
        for extra in [r.lengths(), r.s("kernel_options").to_string()]
            .into_iter()
            .filter(|s| !s.is_empty())
        {
            cell = format!("{cell} {extra}");
        }
        let sum = &mut found
            .entry((r.s("gpu_name").to_string(), profile.to_string(), cell))
            .or_default()[slot];
        *sum = (sum.0 + tp, sum.1 + 1);
    }
    let mean = |(sum, n): (f64, u32)| (n > 0).then(|| sum / f64::from(n));
    let error = |emulated: Option<f64>, real: f64| {
        emulated.map_or("-".to_string(), |e| format!("{:+.1}%", (e / real - 1.0) * 100.0))
    };
    let lines: Vec<Vec<String>> = found
        .into_iter()
        .filter_map(|((gpu, profile, cell), [real, alone, partitioned])| {
            let (real, alone, partitioned) = (mean(real)?, mean(alone), mean(partitioned));
            (alone.is_some() || partitioned.is_some()).then(|| {
                vec![
                    gpu,
                    profile,
                    cell,
                    format!("{real:.1}"),
                    error(alone, real),
                    error(partitioned, real),
                ]
            })
        })
        .collect();
    if lines.is_empty() {
        return None;
    }
    Some(Section {
        id: "emulation-error".into(),
        title: "Emulated slices against real ones".into(),
        level: 2,
        blocks: vec![
            Block::Text("The same cells on real MIG slices and on their emulated twins of the same GPU: each emulated bound's throughput against the real slice's. A right emulation has the real slice between its bounds: alone above it (positive), memory-partitioned below (negative).".into()),
            table(
                &["GPU", "profile", "model mode dtype batch", "real /s", "alone (mps:)", "memory-partitioned (mps-mem:)"],
                lines,
            ),
        ],
    })
}

/// What a target is, as a row says.
fn target_row(r: &Row) -> Vec<String> {
    let profile = match (r.s("mig_profile"), r.s("emulated_profile"), r.s("emulation")) {
        (p, _, _) if !p.is_empty() => format!("MIG {p}"),
        (_, p, "mps") if !p.is_empty() => format!("{p} emulated (MPS, {}% of SMs)", fmt(r.n("mps_share_pct"), 0)),
        (_, _, "mps") => format!("MPS, {}% of SMs", fmt(r.n("mps_share_pct"), 0)),
        _ => "whole device".into(),
    };
    vec![
        r.s("target").into(),
        r.s("device_name").into(),
        r.s("device_kind").into(),
        profile,
        fmt(r.n("sm_count"), 0),
        fmt(r.n("device_memory_mib"), 0),
    ]
}

/// `rows` are the runs; `everyone` adds the load steps (their targets and environment).
fn what_ran(rows: &[Row], everyone: &[Row], sources: &[String], targets: &[String], baseline: Option<&str>) -> Section {
    let mut blocks = vec![Block::Text(format!("Results folders: {}.", sources.join(", ")))];
    let sweeps: BTreeSet<&str> = everyone
        .iter()
        .map(|r| r.s("sweep"))
        .filter(|s| !s.is_empty())
        .collect();
    if !sweeps.is_empty() {
        blocks.push(Block::Text(format!(
            "Sweeps: {}.",
            sweeps.into_iter().collect::<Vec<_>>().join(", ")
        )));
    }
    let per_target: Vec<Vec<String>> = targets
        .iter()
        .filter_map(|t| {
            everyone
                .iter()
                .find(|r| r.s("target") == t && r.is_ok())
                .map(target_row)
        })
        .collect();
    blocks.push(table(
        &["target", "device", "kind", "slice", "SMs", "memory MiB"],
        per_target,
    ));
    if everyone
        .iter()
        .any(|r| r.s("emulation") == "mps" && r.s("memory_emulation") != "partitioned")
    {
        blocks.push(Block::Text(
            "Emulated slices alone (mps:) share the L2 cache and memory bandwidth with the whole GPU: they run faster than real MIG slices of the same size, most for small slices.".into(),
        ));
    }
    if everyone.iter().any(|r| r.s("memory_emulation") == "partitioned") {
        blocks.push(Block::Text(
            "Memory-partitioned emulated slices (mps-mem:) ran beside a neighbour streaming on the SMs they do not have, set so that the slice read its profile's share of the memory bandwidth where it could (calibration and measured_bandwidth_gbps in the rows say how close it came); the neighbour also evicts L2 a real slice would keep, so they run below the real slice.".into(),
        ));
    }
    if let Some(b) = baseline {
        let why = if rows.iter().any(|r| r.s("target") == b && r.s("baseline") == "true") {
            "marked baseline = true in its sweep"
        } else {
            "the target with the most SMs"
        };
        blocks.push(Block::Text(format!(
            "Baseline of the scaling chart and the comparisons: {b} ({why})."
        )));
    }
    // The environment: each fingerprint field with every value it took.
    let mut env = Vec::new();
    for k in super::data::ENVIRONMENT {
        let values: BTreeSet<&str> = everyone.iter().map(|r| r.s(k)).filter(|v| !v.is_empty()).collect();
        if !values.is_empty() {
            env.push(vec![k.to_string(), values.into_iter().collect::<Vec<_>>().join(", ")]);
        }
    }
    blocks.push(table(&["environment", "value(s)"], env));
    let mut statuses: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in rows {
        *statuses
            .entry((r.s("status").to_string(), r.s("verdict").to_string()))
            .or_default() += 1;
    }
    if !statuses.is_empty() {
        blocks.push(table(
            &["status", "verdict", "runs"],
            statuses
                .into_iter()
                .map(|((s, v), n)| vec![s, v, n.to_string()])
                .collect(),
        ));
    }
    // Past the runs come the load steps, then language models' serving steps (serve_id).
    let served = &everyone[rows.len().min(everyone.len())..];
    let generating = served.iter().filter(|r| !r.s("serve_id").is_empty()).count();
    if served.len() > generating {
        blocks.push(Block::Text(format!(
            "{} load step(s): see Serving capacity.",
            served.len() - generating
        )));
    }
    if generating > 0 {
        blocks.push(Block::Text(format!(
            "{generating} serving step(s) of language models: see Serving language models."
        )));
    }
    let failed: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| !matches!(r.s("status"), "ok" | "probe" | ""))
        .map(|r| {
            let error: String = r.s("error").lines().next().unwrap_or("").chars().take(160).collect();
            vec![
                r.s("target").into(),
                r.s("model").into(),
                r.s("mode").into(),
                r.s("dtype").into(),
                r.s("batch").into(),
                r.s("status").into(),
                error,
            ]
        })
        .collect();
    if !failed.is_empty() {
        blocks.push(Block::Text(format!("{} cell(s) did not measure:", failed.len())));
        blocks.push(table(
            &["target", "model", "mode", "dtype", "batch", "status", "error"],
            failed,
        ));
    }
    Section {
        id: "what-ran".into(),
        title: "What ran".into(),
        level: 2,
        blocks,
    }
}

/// A workload as sections group runs: model, mode, precision, sequence length.
type Workload = (String, String, String, String);

/// The workload of a row. Its precision is the dtype, and for bf16 and f16 training on the
/// half-precision weights themselves (`master_weights` none) says so: another workload than the
/// default training over f32 masters.
fn workload(r: &Row) -> Workload {
    let precision = match r.s("master_weights") {
        "none" => format!("{} without master weights", r.s("dtype")),
        _ => r.s("dtype").to_string(),
    };
    (r.s("model").into(), r.s("mode").into(), precision, r.lengths())
}

/// Whether `reading` of run `r` is the whole GPU's while the run had a part of it: power on any
/// slice (NVML reads it for the GPU only), and on an emulated slice also the GPM activity and the
/// device memory, which count every process on the GPU (`gpm_scope` gpu).
fn whole_gpu_reading(r: &Row, reading: &str) -> bool {
    match r.s("device_kind") {
        "mig" => reading == "gpu_power_w",
        "mps" => matches!(
            reading,
            "gract" | "sm_occupancy" | "tensor_util" | "fb_used_mib" | "gpu_power_w"
        ),
        _ => false,
    }
}

/// What a chart says under a series marked `(whole GPU)`.
const WHOLE_GPU_NOTE: &str = "(whole GPU): the reading is the whole GPU's, not the slice's: NVML reads power for the GPU only, and an emulated slice's GPM activity and device memory count every process on the GPU (gpm_scope gpu), so a 1g client that fills its 16 SMs shows a few per cent; beside a memory-partitioned slice (mps-mem:) they also count its neighbour's streaming.";

/// A quantity drawn against batch, per target.
struct Metric {
    id: &'static str,
    title: &'static str,
    unit: &'static str,
    value: fn(&Row) -> Option<f64>,
    whisker: fn(&Row) -> Option<(f64, f64)>,
    /// The sampler's reading it summarises, where it is one (see [`whole_gpu_reading`]).
    reading: Option<&'static str>,
}

const METRICS: [Metric; 4] = [
    Metric {
        id: "throughput",
        title: "Throughput (95% interval)",
        unit: "samples/s",
        value: |r| r.n("throughput"),
        whisker: |r| r.n("throughput_ci_low").zip(r.n("throughput_ci_high")),
        reading: None,
    },
    Metric {
        id: "latency",
        title: "Latency per step, p50 (whisker p90 to p99)",
        unit: "ms",
        value: |r| r.n("p50_ms"),
        whisker: |r| r.n("p90_ms").zip(r.n("p99_ms")),
        reading: None,
    },
    Metric {
        id: "memory",
        title: "Device memory used, most in the run",
        unit: "MiB",
        value: |r| r.n("fb_used_max_mib"),
        whisker: |_| None,
        reading: Some("fb_used_mib"),
    },
    Metric {
        id: "gract",
        title: "Graphics engine (GR) activity, mean",
        unit: "%",
        value: |r| r.n("gract_mean"),
        whisker: |_| None,
        reading: Some("gract"),
    },
];

/// A generation's time to first token, drawn beside its decode steps.
const TTFT: Metric = Metric {
    id: "ttft",
    title: "Time to first token (the prefill), p50 (whisker p50 to p99)",
    unit: "ms",
    value: |r| r.n("ttft_p50_ms"),
    whisker: |r| r.n("ttft_p50_ms").zip(r.n("ttft_p99_ms")),
    reading: None,
};

/// How a generation's rows name what `m` draws: its throughput is decoded tokens per second and
/// its step a decode step. Title and unit.
fn generation_words(m: &Metric) -> (&'static str, &'static str) {
    match m.id {
        "throughput" => ("Decode throughput (95% interval)", "tokens/s"),
        "latency" => ("Latency per decode step, p50 (whisker p90 to p99)", "ms"),
        _ => (m.title, m.unit),
    }
}

/// Each target's latest run at its largest batch (or at `batch`), per workload: the runs whose
/// latency distribution and sampler readings the report draws.
pub fn detailed_runs(rows: &[Row], batch: Option<usize>) -> BTreeSet<String> {
    largest(rows, batch)
        .into_values()
        .map(|r| r.s("run_id").to_string())
        .collect()
}

/// Per (workload, target): the latest alone run at the largest batch, or at `batch` where given.
fn largest(rows: &[Row], batch: Option<usize>) -> BTreeMap<(Workload, String), &Row> {
    let mut out: BTreeMap<(Workload, String), &Row> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.is_alone() && batch.is_none_or(|b| r.n("batch") == Some(b as f64)))
    {
        let k = (workload(r), r.s("target").to_string());
        let better = out.get(&k).is_none_or(|old| {
            (r.n("batch"), r.s("run_id")).partial_cmp(&(old.n("batch"), old.s("run_id")))
                == Some(std::cmp::Ordering::Greater)
        });
        if better {
            out.insert(k, r);
        }
    }
    out
}

/// The latency distribution and the sampler's time series of each target's run at its largest batch.
fn at_largest_batch(
    wl: &Workload,
    rows: &[Row],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    id: &str,
    label: &str,
    batch: Option<usize>,
) -> Result<Vec<Block>> {
    let which = batch.map_or("each target's largest batch".to_string(), |b| format!("batch {b}"));
    let runs: Vec<(String, &Row)> = largest(rows, batch)
        .into_iter()
        .filter(|((w, _), _)| w == wl)
        .map(|((_, t), r)| (t, r))
        .collect();
    let mut blocks = Vec::new();
    let cdf: Vec<Series> = runs
        .iter()
        .filter_map(|(t, r)| {
            let l = detail.latencies_ms.get(r.s("run_id"))?;
            let n = l.len() as f64;
            Some(Series {
                name: format!("{t} (batch {})", r.s("batch")),
                colour: colour(t),
                points: l
                    .iter()
                    .enumerate()
                    .map(|(i, &ms)| Point {
                        x: ms,
                        y: (i + 1) as f64 / n,
                        whisker: None,
                    })
                    .collect(),
            })
        })
        .collect();
    if !cdf.is_empty() {
        let title = format!("{label}: latency distribution at {which}");
        let xs = cdf.iter().flat_map(|s| s.points.iter().map(|p| p.x));
        let chart = Chart {
            title: &title,
            x_label: "latency per step (ms)",
            y_label: "fraction of steps at or below",
            x_scale: scale_for(xs),
            y_scale: Scale::Linear,
            series: &cdf,
            diagonal: false,
            markers: false,
            hline: None,
            x_whole: false,
        };
        blocks.push(Block::Chart {
            name: format!("{id}-cdf.svg"),
            svg: chart.svg()?,
            legend: chart.legend(),
        });
        let rows: Vec<Vec<String>> = runs
            .iter()
            .map(|(t, r)| {
                vec![
                    t.clone(),
                    r.s("batch").into(),
                    fmt(r.n("iterations"), 0),
                    fmt(r.n("p50_ms"), 3),
                    fmt(r.n("p90_ms"), 3),
                    fmt(r.n("p99_ms"), 3),
                ]
            })
            .collect();
        blocks.push(table(&["target", "batch", "steps", "p50 ms", "p90 ms", "p99 ms"], rows));
    }
    for (name, unit) in data::READINGS {
        let series: Vec<Series> = runs
            .iter()
            .filter_map(|(t, r)| {
                let pts = detail.series.get(&(r.s("run_id").to_string(), name))?;
                let t0 = pts.first()?.0;
                let whole = if whole_gpu_reading(r, name) { ", whole GPU" } else { "" };
                Some(Series {
                    name: format!("{t} (batch {}{whole})", r.s("batch")),
                    colour: colour(t),
                    points: pts
                        .iter()
                        .map(|&(s, v)| Point {
                            x: s - t0,
                            y: v,
                            whisker: None,
                        })
                        .collect(),
                })
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        if series.iter().any(|s| s.name.ends_with(", whole GPU)")) {
            blocks.push(Block::Text(WHOLE_GPU_NOTE.replace("(whole GPU)", "(…, whole GPU)")));
        }
        let title = format!("{label}: {name} during the measured phase, {which}");
        let y_label = format!("{name} ({unit})");
        let chart = Chart::time_series(&title, "time since the first reading (s)", &y_label, &series);
        blocks.push(Block::Chart {
            name: format!("{id}-{name}-series.svg"),
            svg: chart.svg()?,
            legend: chart.legend(),
        });
        let rows: Vec<Vec<String>> = series
            .iter()
            .map(|s| {
                let v: Vec<f64> = s.points.iter().map(|p| p.y).collect();
                let mean = v.iter().sum::<f64>() / v.len() as f64;
                let (lo, hi) = v
                    .iter()
                    .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
                vec![
                    s.name.clone(),
                    v.len().to_string(),
                    format!("{mean:.1}"),
                    format!("{lo:.1}"),
                    format!("{hi:.1}"),
                ]
            })
            .collect();
        blocks.push(table(
            &["target", "readings", &format!("mean ({unit})"), "min", "max"],
            rows,
        ));
    }
    Ok(blocks)
}

fn per_model(
    rows: &[Row],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    detail_batch: Option<usize>,
) -> Result<Vec<Section>> {
    let all = rows;
    let alone: Vec<&Row> = rows.iter().filter(|r| r.is_alone()).collect();
    let mut by_model: BTreeMap<String, BTreeMap<Workload, Vec<&Row>>> = BTreeMap::new();
    for r in &alone {
        by_model
            .entry(r.s("model").to_string())
            .or_default()
            .entry(workload(r))
            .or_default()
            .push(r);
    }
    let mut out = Vec::new();
    for (model, workloads) in by_model {
        out.push(Section {
            id: format!("model-{}", slug(&model)),
            title: model.clone(),
            level: 2,
            blocks: Vec::new(),
        });
        for ((_, mode, dtype, seq), rows) in workloads {
            let seq_text = if seq.is_empty() {
                String::new()
            } else {
                // A token model's length in tokens; a generation's lengths say their own.
                if mode == "generate" {
                    format!(", {seq}")
                } else {
                    format!(", {seq} tokens")
                }
            };
            let id = format!(
                "{}-{}-{}{}",
                slug(&model),
                mode,
                slug(&dtype),
                if seq.is_empty() {
                    String::new()
                } else {
                    format!("-{}", slug(&seq))
                }
            );
            let mut blocks = Vec::new();
            // The latest row per target and batch.
            let mut latest: BTreeMap<(String, i64), &Row> = BTreeMap::new();
            for r in rows {
                let key = (r.s("target").to_string(), r.n("batch").unwrap_or(0.0) as i64);
                if latest.get(&key).is_none_or(|old| old.s("run_id") < r.s("run_id")) {
                    latest.insert(key, r);
                }
            }
            let batches: BTreeSet<i64> = latest.keys().map(|k| k.1).collect();
            let targets: BTreeSet<&str> = latest.keys().map(|k| k.0.as_str()).collect();
            let generate = mode == "generate";
            for m in METRICS.iter().chain(generate.then_some(&TTFT)) {
                let (m_title, m_unit) = if generate {
                    generation_words(m)
                } else {
                    (m.title, m.unit)
                };
                let whole = |t: &str| {
                    m.reading
                        .is_some_and(|reading| latest.iter().any(|(k, r)| k.0 == t && whole_gpu_reading(r, reading)))
                };
                let series: Vec<Series> = targets
                    .iter()
                    .map(|t| Series {
                        name: if whole(t) {
                            format!("{t} (whole GPU)")
                        } else {
                            t.to_string()
                        },
                        colour: colour(t),
                        points: latest
                            .iter()
                            .filter(|(k, _)| k.0 == *t)
                            .filter_map(|(k, r)| {
                                (m.value)(r).map(|y| Point {
                                    x: k.1 as f64,
                                    y,
                                    whisker: (m.whisker)(r),
                                })
                            })
                            .collect(),
                    })
                    .filter(|s| !s.points.is_empty())
                    .collect();
                if series.is_empty() {
                    continue;
                }
                let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.x));
                let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.y));
                let title = format!("{model} {mode} {dtype}{seq_text}: {m_title}");
                let y_label = format!("{} ({m_unit})", m.id);
                let x_scale = if batches.len() > 1 {
                    scale_for(xs)
                } else {
                    Scale::Linear
                };
                let y_scale = if m.id == "gract" { Scale::Linear } else { scale_for(ys) };
                let chart = Chart {
                    title: &title,
                    x_label: if generate {
                        "batch size (sequences)"
                    } else {
                        "batch size (samples per step)"
                    },
                    y_label: &y_label,
                    x_scale,
                    y_scale,
                    series: &series,
                    diagonal: false,
                    markers: true,
                    hline: None,
                    x_whole: true,
                };
                blocks.push(Block::Chart {
                    name: format!("{id}-{}.svg", m.id),
                    svg: chart.svg()?,
                    legend: chart.legend(),
                });
                let mut head = vec!["batch".to_string()];
                head.extend(targets.iter().map(|t| format!("{t} ({m_unit})")));
                let rows: Vec<Vec<String>> = batches
                    .iter()
                    .map(|b| {
                        let mut row = vec![b.to_string()];
                        for t in &targets {
                            row.push(latest.get(&(t.to_string(), *b)).map_or("—".into(), |r| {
                                // Times in ms to the microsecond: a small model's prefill or step is under one.
                                let v = fmt((m.value)(r), if m.unit == "ms" { 3 } else { 1 });
                                match (m.id, (m.whisker)(r)) {
                                    ("ttft", Some((_, p99))) => format!("{v} (p99 {p99:.3})"),
                                    ("throughput", Some((lo, hi))) => format!("{v} ({lo:.1}–{hi:.1})"),
                                    ("latency", Some((p90, p99))) => format!("{v} (p90 {p90:.3}, p99 {p99:.3})"),
                                    _ => v,
                                }
                            }));
                        }
                        row
                    })
                    .collect();
                blocks.push(Block::Table { head, rows });
                if series.iter().any(|s| s.name.ends_with("(whole GPU)")) {
                    blocks.push(Block::Text(WHOLE_GPU_NOTE.into()));
                }
                if m.id == "memory" {
                    blocks.extend(held_memory_note(&latest).map(Block::Text));
                }
            }
            let wl = (model.clone(), mode.clone(), dtype.clone(), seq.clone());
            blocks.extend(at_largest_batch(
                &wl,
                all,
                detail,
                colour,
                &id,
                &format!("{model} {mode} {dtype}{seq_text}"),
                detail_batch,
            )?);
            out.push(Section {
                id,
                title: format!("{model}, {mode}, {dtype}{seq_text}"),
                level: 3,
                blocks,
            });
        }
    }
    Ok(out)
}

/// Under the memory chart: the points whose run started with memory its process's pool held from
/// earlier runs (`pool_held_mib_start`, as much as [`notable_pool_held`] names), which their readings
/// may include.
fn held_memory_note(latest: &BTreeMap<(String, i64), &Row>) -> Option<String> {
    let held: Vec<String> = latest
        .iter()
        .filter_map(|((target, batch), r)| {
            let mib = notable_pool_held(r.n("pool_held_mib_start"))?;
            Some(format!("{target} at batch {batch} ({mib:.0} MiB)"))
        })
        .collect();
    (!held.is_empty()).then(|| {
        format!(
            "Not the run's own memory alone: {} started in a process whose memory pool held that much from earlier runs, \
             which the reading may include (pool_held_mib_start). A sweep runs each cell in a process of its own.",
            held.join(", ")
        )
    })
}

fn scaling(rows: &[Row], baseline: &str, colour: &dyn Fn(&str) -> usize) -> Result<Vec<Section>> {
    let alone: Vec<&Row> = rows
        .iter()
        .filter(|r| r.is_alone() && r.n("sm_count").is_some())
        .collect();
    let base: BTreeMap<CellKey, &Row> = alone
        .iter()
        .filter(|r| r.s("target") == baseline)
        .map(|r| (key(r), *r))
        .collect();
    let Some(base_sms) = alone
        .iter()
        .find(|r| r.s("target") == baseline)
        .and_then(|r| r.n("sm_count"))
    else {
        return Ok(Vec::new());
    };
    let mut blocks = vec![Block::Text(format!(
        "Each target's throughput relative to {baseline} at the same model, mode, dtype and batch, against its share of {baseline}'s {base_sms:.0} SMs; on the grey line throughput is proportional to SMs. Per-SM efficiency = relative throughput / SM share."
    ))];
    let mut by_model: BTreeMap<String, Vec<(&Row, f64, f64)>> = BTreeMap::new();
    for r in &alone {
        if let (Some(b), Some(sms), Some(tp)) = (base.get(&key(r)), r.n("sm_count"), r.n("throughput")) {
            by_model.entry(r.s("model").to_string()).or_default().push((
                r,
                sms / base_sms,
                tp / b.n("throughput").unwrap_or(f64::NAN),
            ));
        }
    }
    let published = crate::mig::reference::points()?;
    for (model, points) in by_model {
        let targets: BTreeSet<&str> = points.iter().map(|(r, _, _)| r.s("target")).collect();
        let mut series: Vec<Series> = targets
            .iter()
            .map(|t| Series {
                name: t.to_string(),
                colour: colour(t),
                points: points
                    .iter()
                    .filter(|(r, _, _)| r.s("target") == *t)
                    .map(|(_, x, y)| Point {
                        x: *x,
                        y: *y,
                        whisker: None,
                    })
                    .collect(),
            })
            .collect();
        // Real slices of another GPU, as published, where the same model and mode were measured here.
        let modes: BTreeSet<&str> = points.iter().map(|(r, _, _)| r.s("mode")).collect();
        let theirs: Vec<&crate::mig::reference::ReferencePoint> = published
            .iter()
            .filter(|p| p.model == model && modes.contains(p.mode.as_str()))
            .collect();
        for p in &theirs {
            let name = format!(
                "published, another GPU: {} {} against {}{}",
                p.product,
                p.profile,
                p.baseline,
                p.batch.map_or(String::new(), |b| format!(", batch {b}"))
            );
            series.push(Series {
                colour: colour(&name),
                name,
                points: vec![Point {
                    x: p.sm_share,
                    y: p.relative_throughput,
                    whisker: None,
                }],
            });
        }
        let title = format!("{model}: throughput against share of SMs (relative to {baseline})");
        let chart = Chart {
            title: &title,
            x_label: "share of the baseline's SMs",
            y_label: "throughput relative to the baseline",
            x_scale: Scale::Linear,
            y_scale: Scale::Linear,
            series: &series,
            diagonal: true,
            markers: true,
            hline: None,
            x_whole: false,
        };
        blocks.push(Block::Text(format!("{model}:")));
        blocks.push(Block::Chart {
            name: format!("scaling-{}.svg", slug(&model)),
            svg: chart.svg()?,
            legend: chart.legend(),
        });
        let mut rows: Vec<Vec<String>> = points
            .iter()
            .map(|(r, share, rel)| {
                vec![
                    r.s("target").into(),
                    format!("{} {} {}", r.s("mode"), r.s("dtype"), r.s("batch")),
                    fmt(r.n("sm_count"), 0),
                    format!("{share:.3}"),
                    format!("{rel:.3}"),
                    format!("{:.2}", rel / share),
                ]
            })
            .collect();
        rows.sort();
        blocks.push(table(
            &[
                "target",
                "mode dtype batch",
                "SMs",
                "SM share",
                "relative throughput",
                "per-SM efficiency",
            ],
            rows,
        ));
        if let Some(ranges) = emulated_ranges(&points) {
            blocks.push(Block::Text(format!("{model}, emulated slices as ranges:")));
            blocks.push(ranges);
            blocks.push(Block::Text(crate::mps::PLAN_WITH.into()));
        }
        for p in &theirs {
            blocks.push(Block::Text(format!(
                "Published, not measured here: {} {} at {:.3} of the SMs of {} ran {} {} at {:.3} of its throughput ({}). Source: {}.",
                p.product, p.profile, p.sm_share, p.baseline, model, p.mode, p.relative_throughput, p.setting, p.source
            )));
        }
    }
    Ok(vec![Section {
        id: "scaling".into(),
        title: "Scaling with the share of SMs".into(),
        level: 2,
        blocks,
    }])
}

/// The emulated profiles measured both alone and memory-partitioned, cell by cell: each bound's
/// throughput relative to the baseline beside the profile's shares; `None` when no profile has both.
fn emulated_ranges(points: &[(&Row, f64, f64)]) -> Option<Block> {
    type Bounds = (Option<f64>, Option<f64>, f64, Option<f64>, String);
    let mut by_cell: BTreeMap<(String, String), Bounds> = BTreeMap::new();
    for (r, share, rel) in points {
        let profile = r.s("emulated_profile");
        if profile.is_empty() {
            continue;
        }
        let cell = format!("{} {} {}", r.s("mode"), r.s("dtype"), r.s("batch"));
        let e = by_cell
            .entry((profile.to_string(), cell))
            .or_insert((None, None, *share, None, String::new()));
        match r.s("memory_emulation") {
            "partitioned" => {
                e.1 = Some(*rel);
                e.3 = r
                    .n("memory_share_gbps")
                    .zip(r.n("gpu_bandwidth_gbps"))
                    .map(|(s, g)| s / g);
                // How close the neighbour held the client to its share, and the outcome where not.
                e.4 = r
                    .n("measured_bandwidth_gbps")
                    .zip(r.n("memory_share_gbps"))
                    .map(|(b, s)| match r.s("calibration") {
                        missed if crate::mps::calibration::Outcome::missed_share(missed) => {
                            format!("{:.2} ({missed})", b / s)
                        }
                        _ => format!("{:.2}", b / s),
                    })
                    .unwrap_or_default();
            }
            _ => e.0 = Some(*rel),
        }
    }
    let rows: Vec<Vec<String>> = by_cell
        .into_iter()
        .filter_map(
            |((profile, cell), (alone, partitioned, sm_share, memory_share, held))| {
                Some(vec![
                    profile,
                    cell,
                    format!("{sm_share:.3}"),
                    memory_share.map_or("?".into(), |m| format!("{m:.3}")),
                    format!("{:.3}", alone?),
                    format!("{:.3}", partitioned?),
                    held,
                ])
            },
        )
        .collect();
    (!rows.is_empty()).then(|| {
        table(
            &[
                "profile",
                "mode dtype batch",
                "SM share",
                "memory share",
                "alone (upper bound)",
                "memory-partitioned (lower bound)",
                "partitioned client's bandwidth ÷ its share",
            ],
            rows,
        )
    })
}

/// A cell as the scaling chart pairs it across targets: model, mode, dtype, sequence length, master
/// weights (bf16 and f16 training over f32 masters and without them are different cells) and batch.
type CellKey = (String, String, String, String, String, i64);

/// The [`CellKey`] of a row.
fn key(r: &Row) -> CellKey {
    (
        r.s("model").into(),
        r.s("mode").into(),
        r.s("dtype").into(),
        r.lengths(),
        r.s("master_weights").into(),
        r.n("batch").unwrap_or(0.0) as i64,
    )
}

/// Each target against the baseline, as `migprof compare` gives it.
fn against_baseline(rows: &[Row], baseline: &str) -> Result<Vec<Section>> {
    let frame = frame_of(rows)?;
    let targets: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r.is_alone())
        .map(|r| r.s("target"))
        .filter(|t| *t != baseline)
        .collect();
    let mut blocks = vec![Block::Text(format!(
        "Cell by cell, as migprof compare DIR --baseline target={baseline} --target target=T gives it: the ratio of throughputs with its 95% interval, and whether it is beyond the runs' own noise."
    ))];
    for t in targets {
        let b: crate::results::compare::Selector = format!("target={baseline}").parse()?;
        let s: crate::results::compare::Selector = format!("target={t}").parse()?;
        let Ok(c) = crate::results::compare::compare(&frame, &b, &s) else {
            continue;
        };
        if c.rows.is_empty() {
            continue;
        }
        blocks.push(Block::Text(format!("{t} against {baseline}:")));
        let rows = c
            .rows
            .iter()
            .map(|r| {
                let cell = crate::results::compare::CELL
                    .iter()
                    .filter_map(|k| r.cell.get(*k).cloned())
                    .collect::<Vec<_>>()
                    .join(" ");
                vec![
                    cell,
                    format!("{:.1}", r.baseline.throughput),
                    format!("{:.1}", r.target.throughput),
                    format!(
                        "{:.3} ({}–{})",
                        r.ratio,
                        fmt(r.ratio_ci_low, 3),
                        fmt(r.ratio_ci_high, 3)
                    ),
                    r.beyond_noise
                        .map_or("?".into(), |b| if b { "yes".into() } else { "no".into() }),
                    format!("{:.3} → {:.3}", r.baseline.p50_ms, r.target.p50_ms),
                    format!("{:.3} → {:.3}", r.baseline.p99_ms, r.target.p99_ms),
                ]
            })
            .collect();
        blocks.push(table(
            &[
                "cell",
                "baseline samples/s",
                "target samples/s",
                "ratio (95%)",
                "beyond noise",
                "p50 ms",
                "p99 ms",
            ],
            rows,
        ));
    }
    Ok(vec![Section {
        id: "against-baseline".into(),
        title: format!("Each target against {baseline}"),
        level: 2,
        blocks,
    }])
}

/// The rows back as a runs frame, with the columns `compare` reads.
fn frame_of(rows: &[Row]) -> Result<DataFrame> {
    let text = |k: &str| {
        Column::new(
            k.into(),
            rows.iter()
                .map(|r| r.text.get(k).cloned())
                .collect::<Vec<Option<String>>>(),
        )
    };
    let num = |k: &str| Column::new(k.into(), rows.iter().map(|r| r.n(k)).collect::<Vec<Option<f64>>>());
    let mut cols: Vec<Column> = ["status", "run_id", "cell_id", "target"]
        .iter()
        .chain(&crate::results::compare::CELL)
        .chain(&["kernel_options", "concurrency_group", "verdict", "device_name"])
        .map(|k| text(k))
        .collect();
    cols.extend(
        [
            "throughput",
            "throughput_ci_low",
            "throughput_ci_high",
            "p50_ms",
            "p99_ms",
        ]
        .iter()
        .map(|k| num(k)),
    );
    Ok(DataFrame::new(rows.len(), cols)?)
}

fn energy(rows: &[Row]) -> Vec<Section> {
    let measured: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| r.is_alone())
        .filter_map(|r| {
            r.n("j_per_sample").map(|j| {
                let whole = if r.s("device_kind") == "cuda" {
                    ""
                } else {
                    " (whole GPU's energy)"
                };
                vec![
                    r.s("target").into(),
                    r.s("model").into(),
                    r.s("mode").into(),
                    r.s("dtype").into(),
                    r.s("batch").into(),
                    format!("{:.4}{whole}", j),
                ]
            })
        })
        .collect();
    if measured.is_empty() {
        return Vec::new();
    }
    let blocks = vec![
        Block::Text("Energy per sample from the GPU's energy counter over the measured phase. NVML has no energy per MIG slice or MPS client: on a slice the figure is the whole GPU's, neighbours included.".into()),
        table(&["target", "model", "mode", "dtype", "batch", "J/sample"], measured),
    ];
    vec![Section {
        id: "energy".into(),
        title: "Energy per sample".into(),
        level: 2,
        blocks,
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(held: Option<f64>) -> Row {
        let mut num: BTreeMap<&'static str, f64> = [("fb_used_max_mib", 4299.0)].into_iter().collect();
        if let Some(mib) = held {
            num.insert("pool_held_mib_start", mib);
        }
        Row {
            text: BTreeMap::new(),
            num,
        }
    }

    /// A generate row of llama_tiny on `target` at `batch` with `status`.
    fn generation(target: &str, batch: f64, status: &str) -> Row {
        let text = [
            ("status", status),
            ("target", target),
            ("model", "llama_tiny"),
            ("mode", "generate"),
            ("dtype", "bf16"),
            ("prompt_len", "512"),
            ("output_len", "128"),
            ("kv_layout", "contiguous"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
        let num = [
            ("batch", batch),
            ("throughput", 100.0 * batch),
            ("kv_cache_bytes_per_seq", 20.0 * 1024.0 * 1024.0),
        ]
        .into_iter()
        .collect();
        Row { text, num }
    }

    #[test]
    fn the_sequences_a_target_holds_come_from_its_search_s_tries() {
        // 1g: 1, 2, 4 fit, 8 did not, 6 fit, 7 did not: it holds 6. full: every try up to the limit
        // of 16 fit. A fixed batch of 32 on 3g is no search.
        let mut rows: Vec<Row> = [1.0, 2.0, 4.0, 6.0]
            .into_iter()
            .map(|b| generation("1g", b, "probe"))
            .collect();
        rows.extend([generation("1g", 8.0, "oom"), generation("1g", 7.0, "oom")]);
        rows.push(generation("1g", 6.0, "ok"));
        rows.extend([1.0, 2.0, 4.0, 8.0, 16.0].map(|b| generation("full", b, "probe")));
        rows.push(generation("full", 16.0, "ok"));
        rows.push(generation("3g", 32.0, "ok"));
        let s = sequences_held(&rows).expect("two searches");
        let Block::Table { rows: table, .. } = &s.blocks[1] else {
            panic!("a table")
        };
        let by_target: BTreeMap<&str, &Vec<String>> = table.iter().map(|r| (r[0].as_str(), r)).collect();
        assert_eq!(by_target.len(), 2, "{table:?}");
        assert_eq!(by_target["1g"][5], "6 (7 did not fit)");
        assert_eq!(by_target["1g"][6], "600.0");
        assert_eq!(by_target["1g"][7], "20.000");
        assert_eq!(by_target["full"][5], "at least 16 (the search's limit)");
        assert_eq!(by_target["1g"][3], "prompt 512 output 128");
        assert!(sequences_held(&[generation("3g", 32.0, "ok")]).is_none());
    }

    #[test]
    fn the_memory_chart_names_the_points_that_started_with_memory_held_from_earlier_runs() {
        let (cpu, fresh, after_swin) = (run(None), run(Some(32.0)), run(Some(576.0)));
        let mut latest: BTreeMap<(String, i64), &Row> = BTreeMap::new();
        latest.insert(("cpu".into(), 1), &cpu);
        latest.insert(("H100".into(), 8), &fresh);
        assert_eq!(
            held_memory_note(&latest),
            None,
            "no pool, or only the pool's own granularity"
        );
        latest.insert(("H100".into(), 32), &after_swin);
        let note = held_memory_note(&latest).expect("576 MiB held");
        assert!(note.contains("H100 at batch 32 (576 MiB)"), "{note}");
        assert!(!note.contains("batch 8") && !note.contains("cpu"), "{note}");
    }

    /// An alone run of resnet50 bf16 training at batch 32 on `target`, a `kind` of device.
    fn training(target: &str, kind: &str, masters: &str, run_id: &str) -> Row {
        let text = [
            ("run_id", run_id),
            ("status", "ok"),
            ("target", target),
            ("device_kind", kind),
            ("model", "resnet50"),
            ("mode", "train"),
            ("dtype", "bf16"),
            ("master_weights", masters),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
        let num = [
            ("batch", 32.0),
            ("throughput", 100.0),
            ("p50_ms", 300.0),
            ("fb_used_max_mib", 9000.0),
            ("gract_mean", 5.0),
        ]
        .into_iter()
        .collect();
        Row { text, num }
    }

    fn legends(sections: &[Section]) -> Vec<String> {
        sections
            .iter()
            .flat_map(|s| &s.blocks)
            .filter_map(|b| match b {
                Block::Chart { legend, .. } => Some(legend.iter().map(|(n, _)| n.clone())),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn an_emulated_slice_s_whole_gpu_readings_say_so_and_masters_or_none_are_two_workloads() -> Result<()> {
        let rows = vec![
            training("full", "cuda", "f32", "a"),
            training("1g", "mps", "f32", "b"),
            training("3g", "mig", "f32", "c"),
            training("full", "cuda", "none", "d"),
        ];
        let sections = per_model(&rows, &data::Detail::default(), &|_| 0, None)?;
        let titles: Vec<&str> = sections.iter().map(|s| s.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "resnet50",
                "resnet50, train, bf16",
                "resnet50, train, bf16 without master weights"
            ]
        );
        let legends = legends(&sections[1..2]);
        // GR activity and memory: the emulated slice's are the whole GPU's; a real slice's its own.
        assert_eq!(
            legends.iter().filter(|n| *n == "1g (whole GPU)").count(),
            2,
            "{legends:?}"
        );
        assert!(legends.iter().any(|n| n == "3g") && !legends.iter().any(|n| n == "3g (whole GPU)"));
        let notes = sections[1]
            .blocks
            .iter()
            .filter(|b| matches!(b, Block::Text(t) if t == WHOLE_GPU_NOTE))
            .count();
        assert_eq!(notes, 2);
        assert!(!legends.iter().any(|n| n == "full (whole GPU)"));
        Ok(())
    }

    #[test]
    fn power_is_the_whole_gpu_s_on_every_slice_and_gpm_on_emulated_ones() {
        let on = |kind| training("t", kind, "f32", "x");
        for reading in data::READINGS.map(|(name, _)| name) {
            assert!(!whole_gpu_reading(&on("cuda"), reading), "{reading}");
            assert!(whole_gpu_reading(&on("mps"), reading), "{reading}");
            assert_eq!(
                whole_gpu_reading(&on("mig"), reading),
                reading == "gpu_power_w",
                "{reading}"
            );
        }
    }

    #[test]
    fn an_emulated_slice_measured_both_ways_is_a_range_with_the_bound_to_plan_with() -> Result<()> {
        let slice = |target: &str, memory: &str, throughput: f64| {
            let mut r = training(target, "mps", "", target);
            r.text.insert("mode", "infer".into());
            r.text.insert("batch", "32".into());
            r.num.insert("sm_count", 16.0);
            r.num.insert("throughput", throughput);
            if !memory.is_empty() {
                r.text.insert("emulated_profile", "1g.10gb".into());
                r.text.insert("emulation", "mps".into());
                r.text.insert("memory_emulation", memory.into());
            }
            if memory == "partitioned" {
                r.num.insert("memory_share_gbps", 373.0);
                r.num.insert("gpu_bandwidth_gbps", 2984.0);
                r.num.insert("measured_bandwidth_gbps", 429.0);
                r.text.insert("calibration", "neighbour_too_weak".into());
            }
            r
        };
        let mut full = slice("full", "", 1000.0);
        full.num.insert("sm_count", 132.0);
        let rows = vec![full, slice("1g", "alone", 190.0), slice("1g-mem", "partitioned", 110.0)];
        let sections = scaling(&rows, "full", &|_| 0)?;
        let tables: Vec<&Vec<Vec<String>>> = sections[0]
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Table { head, rows } if head.contains(&"alone (upper bound)".to_string()) => Some(rows),
                _ => None,
            })
            .collect();
        assert_eq!(tables.len(), 1);
        assert_eq!(
            tables[0][0],
            [
                "1g.10gb",
                "infer bf16 32",
                "0.121",
                "0.125",
                "0.190",
                "0.110",
                "1.15 (neighbour_too_weak)"
            ]
            .map(String::from)
        );
        assert!(sections[0]
            .blocks
            .iter()
            .any(|b| matches!(b, Block::Text(t) if t == crate::mps::PLAN_WITH)));
        // One way only: no range.
        let sections = scaling(&rows[..2], "full", &|_| 0)?;
        assert!(!sections[0]
            .blocks
            .iter()
            .any(|b| matches!(b, Block::Text(t) if t == crate::mps::PLAN_WITH)));
        Ok(())
    }

    #[test]
    fn real_slices_and_their_emulated_twins_give_the_emulation_s_error_per_profile() {
        // A recorded H100 with real 1g and 3g slices, and the same cells emulated on a GPU with MIG off.
        let row = |mig: &str, emulated: &str, memory: &str, throughput: f64| {
            let mut r = training("t", if mig.is_empty() { "mps" } else { "mig" }, "", "r");
            r.text.insert("mode", "infer".into());
            r.text.insert("batch", "32".into());
            r.text.insert("gpu_name", "NVIDIA H100 80GB HBM3".into());
            r.text.insert("mig_profile", mig.into());
            r.text.insert("emulated_profile", emulated.into());
            if !emulated.is_empty() {
                r.text.insert("emulation", "mps".into());
                r.text.insert("memory_emulation", memory.into());
            }
            r.num.insert("throughput", throughput);
            r
        };
        let rows = vec![
            row("1g.10gb", "", "", 1400.0),
            row("", "1g.10gb", "alone", 2100.0),
            row("", "1g.10gb", "partitioned", 1260.0),
            row("3g.40gb", "", "", 6000.0),
            row("", "3g.40gb", "alone", 6300.0),
            // A profile emulated but never measured for real: no error to give.
            row("", "2g.20gb", "alone", 3000.0),
        ];
        let section = emulation_error(&rows).unwrap();
        let Block::Table { rows: lines, .. } = &section.blocks[1] else {
            panic!("a table")
        };
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0][1..],
            ["1g.10gb", "resnet50 infer bf16 32", "1400.0", "+50.0%", "-10.0%"].map(String::from)
        );
        assert_eq!(lines[1][4..], ["+5.0%", "-"].map(String::from));
        // Emulated slices alone (no real ones here) make no section.
        assert!(emulation_error(&rows[1..3]).is_none());
    }

    #[test]
    fn the_scaling_chart_draws_published_real_slices_of_another_gpu_beside_the_measured() -> Result<()> {
        let inference = |model: &str, target: &str, sms: f64, throughput: f64| {
            let mut r = training(target, "mps", "", target);
            r.text.insert("model", model.into());
            r.text.insert("mode", "infer".into());
            r.num.insert("sm_count", sms);
            r.num.insert("throughput", throughput);
            r
        };
        let rows = vec![
            inference("resnet50", "full", 132.0, 1000.0),
            inference("resnet50", "1g", 16.0, 190.0),
            inference("bert_base", "full", 132.0, 1000.0),
            inference("bert_base", "1g", 16.0, 185.0),
        ];
        let sections = scaling(&rows, "full", &|_| 0)?;
        let legends = legends(&sections);
        let published: Vec<&String> = legends.iter().filter(|n| n.starts_with("published")).collect();
        // ResNet-50's two published points; MLPerf's BERT is BERT-Large, not the BERT-base measured.
        assert_eq!(
            published,
            [
                "published, another GPU: NVIDIA A100-SXM4-80GB 1g.10gb against the whole GPU",
                "published, another GPU: NVIDIA A100-SXM4-80GB 1g.10gb against 7g.80gb, batch 32"
            ],
            "{legends:?}"
        );
        let sources: Vec<&String> = sections[0]
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Text(t) if t.starts_with("Published, not measured here") => Some(t),
                _ => None,
            })
            .collect();
        assert_eq!(sources.len(), 2);
        assert!(
            sources[0].contains("MLPerf Inference v2.1") && sources[0].contains("0.133"),
            "{}",
            sources[0]
        );
        Ok(())
    }
}
