//! One section per model: throughput, latency, memory and GR activity against batch, one series per
//! target, and the run at each target's largest batch in detail.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use super::common::{
    generation_words, largest, whole_gpu_reading, workload, Metric, Workload, METRICS, TTFT, WHOLE_GPU_NOTE,
};
use crate::report::chart::{scale_for, Chart, Point, Scale, Series};
use crate::report::data::{self, Row};
use crate::report::page::{fmt, slug, table, Block, Section};
use crate::run::fingerprint::notable_pool_held;

/// The latency distribution and the sampler's time series of each target's run at its largest batch.
pub(super) fn at_largest_batch(
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
    let mut blocks = latency_distribution(
        &runs,
        detail,
        colour,
        id,
        &format!("{label}: latency distribution at {which}"),
    )?;
    for (name, unit) in data::READINGS {
        let title = format!("{label}: {name} during the measured phase, {which}");
        blocks.extend(readings(&runs, detail, colour, id, (name, unit), &title)?);
    }
    Ok(blocks)
}

/// Each run's step latencies as a distribution, and its percentiles.
fn latency_distribution(
    runs: &[(String, &Row)],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    id: &str,
    title: &str,
) -> Result<Vec<Block>> {
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
    if cdf.is_empty() {
        return Ok(Vec::new());
    }
    let xs = cdf.iter().flat_map(|s| s.points.iter().map(|p| p.x));
    let chart = Chart {
        title,
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
    Ok(vec![
        Block::Chart {
            name: format!("{id}-cdf.svg"),
            svg: chart.svg()?,
            legend: chart.legend(),
        },
        table(&["target", "batch", "steps", "p50 ms", "p90 ms", "p99 ms"], rows),
    ])
}

/// One sampler reading of each run over its measured phase, and its mean and range.
fn readings(
    runs: &[(String, &Row)],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    id: &str,
    (name, unit): (&'static str, &str),
    title: &str,
) -> Result<Vec<Block>> {
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
        return Ok(Vec::new());
    }
    let mut blocks = Vec::new();
    if series.iter().any(|s| s.name.ends_with(", whole GPU)")) {
        blocks.push(Block::Text(WHOLE_GPU_NOTE.replace("(whole GPU)", "(…, whole GPU)")));
    }
    let y_label = format!("{name} ({unit})");
    let chart = Chart::time_series(title, "time since the first reading (s)", &y_label, &series);
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
    Ok(blocks)
}

pub(super) fn per_model(
    rows: &[Row],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    detail_batch: Option<usize>,
) -> Result<Vec<Section>> {
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
        for (wl, wl_rows) in workloads {
            out.push(workload_section(&wl, &wl_rows, rows, detail, colour, detail_batch)?);
        }
    }
    Ok(out)
}

/// One workload's section: each metric against batch, one series per target, then the runs at
/// the largest batch (from `all` rows).
fn workload_section(
    wl: &Workload,
    rows: &[&Row],
    all: &[Row],
    detail: &data::Detail,
    colour: &dyn Fn(&str) -> usize,
    detail_batch: Option<usize>,
) -> Result<Section> {
    let (model, mode, dtype, seq) = wl;
    let seq_text = match (seq.is_empty(), mode == "generate") {
        (true, _) => String::new(),
        // A generation's lengths say their own unit; a token model's length is in tokens.
        (false, true) => format!(", {seq}"),
        (false, false) => format!(", {seq} tokens"),
    };
    let id = format!(
        "{}-{}-{}{}",
        slug(model),
        mode,
        slug(dtype),
        if seq.is_empty() {
            String::new()
        } else {
            format!("-{}", slug(seq))
        }
    );
    // The latest row per target and batch.
    let mut latest: BTreeMap<(String, i64), &Row> = BTreeMap::new();
    for r in rows {
        let key = (r.s("target").to_string(), r.n("batch").unwrap_or(0.0) as i64);
        if latest.get(&key).is_none_or(|old| old.s("run_id") < r.s("run_id")) {
            latest.insert(key, r);
        }
    }
    let label = format!("{model} {mode} {dtype}{seq_text}");
    let generate = mode == "generate";
    let mut blocks = Vec::new();
    for m in METRICS.iter().chain(generate.then_some(&TTFT)) {
        blocks.extend(metric_blocks(m, &latest, generate, colour, &id, &label)?);
    }
    blocks.extend(at_largest_batch(wl, all, detail, colour, &id, &label, detail_batch)?);
    Ok(Section {
        id,
        title: format!("{model}, {mode}, {dtype}{seq_text}"),
        level: 3,
        blocks,
    })
}

/// One metric of a workload against batch: its chart, its table, and the notes it needs.
fn metric_blocks(
    m: &Metric,
    latest: &BTreeMap<(String, i64), &Row>,
    generate: bool,
    colour: &dyn Fn(&str) -> usize,
    id: &str,
    label: &str,
) -> Result<Vec<Block>> {
    let batches: BTreeSet<i64> = latest.keys().map(|k| k.1).collect();
    let targets: BTreeSet<&str> = latest.keys().map(|k| k.0.as_str()).collect();
    let (m_title, m_unit) = if generate {
        generation_words(m)
    } else {
        (m.title, m.unit)
    };
    let series = metric_series(m, latest, &targets, colour);
    if series.is_empty() {
        return Ok(Vec::new());
    }
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.x));
    let ys = series.iter().flat_map(|s| s.points.iter().map(|p| p.y));
    let title = format!("{label}: {m_title}");
    let y_label = format!("{} ({m_unit})", m.id);
    let chart = Chart {
        title: &title,
        x_label: if generate {
            "batch size (sequences)"
        } else {
            "batch size (samples per step)"
        },
        y_label: &y_label,
        x_scale: if batches.len() > 1 {
            scale_for(xs)
        } else {
            Scale::Linear
        },
        y_scale: if m.id == "gract" { Scale::Linear } else { scale_for(ys) },
        series: &series,
        diagonal: false,
        markers: true,
        hline: None,
        x_whole: true,
    };
    let mut blocks = vec![Block::Chart {
        name: format!("{id}-{}.svg", m.id),
        svg: chart.svg()?,
        legend: chart.legend(),
    }];
    let mut head = vec!["batch".to_string()];
    head.extend(targets.iter().map(|t| format!("{t} ({m_unit})")));
    let rows: Vec<Vec<String>> = batches
        .iter()
        .map(|b| {
            let mut row = vec![b.to_string()];
            for t in &targets {
                row.push(
                    latest
                        .get(&(t.to_string(), *b))
                        .map_or("—".into(), |r| metric_cell(m, r)),
                );
            }
            row
        })
        .collect();
    blocks.push(Block::Table { head, rows });
    if series.iter().any(|s| s.name.ends_with("(whole GPU)")) {
        blocks.push(Block::Text(WHOLE_GPU_NOTE.into()));
    }
    if m.id == "memory" {
        blocks.extend(held_memory_note(latest).map(Block::Text));
    }
    Ok(blocks)
}

/// A metric's series against batch, one per target ("(whole GPU)" where its reading is the whole
/// GPU's); the targets without a value left out.
fn metric_series(
    m: &Metric,
    latest: &BTreeMap<(String, i64), &Row>,
    targets: &BTreeSet<&str>,
    colour: &dyn Fn(&str) -> usize,
) -> Vec<Series> {
    let whole = |t: &str| {
        m.reading
            .is_some_and(|reading| latest.iter().any(|(k, r)| k.0 == t && whole_gpu_reading(r, reading)))
    };
    targets
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
        .collect()
}

/// A metric's value in a row, with its interval or its upper percentiles where it has them.
fn metric_cell(m: &Metric, r: &Row) -> String {
    // Times in ms to the microsecond: a small model's prefill or step is under one.
    let v = fmt((m.value)(r), if m.unit == "ms" { 3 } else { 1 });
    match (m.id, (m.whisker)(r)) {
        ("ttft", Some((_, p99))) => format!("{v} (p99 {p99:.3})"),
        ("throughput", Some((lo, hi))) => format!("{v} ({lo:.1}–{hi:.1})"),
        ("latency", Some((p90, p99))) => format!("{v} (p90 {p90:.3}, p99 {p99:.3})"),
        _ => v,
    }
}

/// Under the memory chart: the points whose run started with memory its process's pool held from
/// earlier runs (`pool_held_mib_start`, as much as [`notable_pool_held`] names), which their readings
/// may include.
pub(super) fn held_memory_note(latest: &BTreeMap<(String, i64), &Row>) -> Option<String> {
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
