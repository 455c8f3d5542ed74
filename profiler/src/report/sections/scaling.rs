//! How each target's throughput follows its share of the SMs.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Result;

use super::common::{key, CellKey};
use crate::report::chart::{Chart, Point, Scale, Series};
use crate::report::data::Row;
use crate::report::page::{fmt, slug, table, Block, Section};

pub(super) fn scaling(rows: &[Row], baseline: &str, colour: &dyn Fn(&str) -> usize) -> Result<Vec<Section>> {
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
        blocks.extend(model_scaling(&model, &points, &published, baseline, colour)?);
    }
    Ok(vec![Section {
        id: "scaling".into(),
        title: "Scaling with the share of SMs".into(),
        level: 2,
        blocks,
    }])
}

/// One model's throughput against its share of the SMs: its chart (with published slices of
/// another GPU where the same model and mode were measured here) and its table.
fn model_scaling(
    model: &str,
    points: &[(&Row, f64, f64)],
    published: &[crate::mig::reference::ReferencePoint],
    baseline: &str,
    colour: &dyn Fn(&str) -> usize,
) -> Result<Vec<Block>> {
    let mut blocks = Vec::new();
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
        .filter(|p| p.model == *model && modes.contains(p.mode.as_str()))
        .collect();
    series.extend(theirs.iter().map(|p| published_point(p, colour)));
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
        name: format!("scaling-{}.svg", slug(model)),
        svg: chart.svg()?,
        legend: chart.legend(),
    });
    blocks.push(scaling_table(points));
    if let Some(ranges) = emulated_ranges(points) {
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
    Ok(blocks)
}

/// A real slice of another GPU as published: one point of its own.
fn published_point(p: &crate::mig::reference::ReferencePoint, colour: &dyn Fn(&str) -> usize) -> Series {
    let name = format!(
        "published, another GPU: {} {} against {}{}",
        p.product,
        p.profile,
        p.baseline,
        p.batch.map_or(String::new(), |b| format!(", batch {b}"))
    );
    Series {
        colour: colour(&name),
        name,
        points: vec![Point {
            x: p.sm_share,
            y: p.relative_throughput,
            whisker: None,
        }],
    }
}

/// Each point of a model's scaling: its target, cell, SMs, share, relative throughput and per-SM
/// efficiency.
fn scaling_table(points: &[(&Row, f64, f64)]) -> Block {
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
    table(
        &[
            "target",
            "mode dtype batch",
            "SMs",
            "SM share",
            "relative throughput",
            "per-SM efficiency",
        ],
        rows,
    )
}

/// The emulated profiles measured both alone and memory-partitioned, cell by cell: each bound's
/// throughput relative to the baseline beside the profile's shares; `None` when no profile has both.
pub(super) fn emulated_ranges(points: &[(&Row, f64, f64)]) -> Option<Block> {
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
