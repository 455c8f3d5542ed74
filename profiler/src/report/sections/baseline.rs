//! Each target against the baseline, as `migprof compare` gives it.

use std::collections::BTreeSet;

use anyhow::Result;
use polars::prelude::*;

use crate::report::data::Row;
use crate::report::page::{fmt, table, Block, Section};

/// Each target against the baseline, as `migprof compare` gives it.
pub(super) fn against_baseline(rows: &[Row], baseline: &str) -> Result<Vec<Section>> {
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
                    format!("{} → {}", fmt(r.baseline.p50_ms, 3), fmt(r.target.p50_ms, 3)),
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
pub(super) fn frame_of(rows: &[Row]) -> Result<DataFrame> {
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
