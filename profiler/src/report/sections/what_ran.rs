//! What ran: the targets, the models and the folders read.

use std::collections::{BTreeMap, BTreeSet};

use super::common::target_row;
use crate::report::data::Row;
use crate::report::page::{table, Block, Section};

/// `rows` are the runs; `everyone` adds the load steps (their targets and environment).
pub(super) fn what_ran(
    rows: &[Row],
    everyone: &[Row],
    sources: &[String],
    targets: &[String],
    baseline: Option<&str>,
) -> Section {
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
    blocks.extend(how_it_ran(rows, everyone));
    Section {
        id: "what-ran".into(),
        title: "What ran".into(),
        level: 2,
        blocks,
    }
}

/// The environment each row ran in, how the runs ended, the serving steps beside them, and the
/// cells that did not measure.
fn how_it_ran(rows: &[Row], everyone: &[Row]) -> Vec<Block> {
    let mut blocks = Vec::new();
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
    blocks
}
