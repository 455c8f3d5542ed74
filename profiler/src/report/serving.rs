//! The report's section on language models served under load (`migprof load` with a language
//! model): TTFT and TPOT p99 against the offered rate per target with the objectives' lines, the KV
//! cache's occupancy over one rate's run, and the capacities each search found.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use anyhow::Result;

use super::chart::{scale_for, Chart, Point, Series};
use super::data::{read_rows, with_target, Row};
use super::page::{fmt, slug, table, Block, Section};
use crate::results::parts::Table;

const STEP_TEXT: [&str; 12] = [
    "serve_id",
    "engine",
    "target",
    "status",
    "model",
    "dtype",
    "profile",
    "prompt_len",
    "output_len",
    "meets_slo",
    "emulation",
    "memory_emulation",
];
const STEP_NUM: [&str; 13] = [
    "offered_qps",
    "concurrency",
    "achieved_qps",
    "goodput_qps",
    "ttft_p99_ms",
    "ttft_p99_ms_ci_low",
    "ttft_p99_ms_ci_high",
    "tpot_p99_ms",
    "tpot_p99_ms_ci_low",
    "tpot_p99_ms_ci_high",
    "slo_ttft_p99_ms",
    "slo_tpot_p99_ms",
    "kv_occupancy_max",
];
const ITERATION_TEXT: [&str; 1] = ["serve_id"];
const ITERATION_NUM: [&str; 2] = ["start_ms", "kv_occupancy"];
const CAPACITY_TEXT: [&str; 9] = [
    "target",
    "engine",
    "status",
    "model",
    "dtype",
    "profile",
    "prompt_len",
    "output_len",
    "emulated",
];
const CAPACITY_NUM: [&str; 6] = [
    "capacity_qps",
    "bracket_high_qps",
    "slo_ttft_p99_ms",
    "slo_tpot_p99_ms",
    "closed_loop_qps",
    "steps",
];

/// The folders' serving steps, their iterations and the searches' capacities.
pub struct Generation {
    pub steps: Vec<Row>,
    iterations: Vec<Row>,
    capacities: Vec<Row>,
}

impl Generation {
    pub fn read(dirs: &[PathBuf]) -> Result<Generation> {
        let (text, numbers) = with_target(&STEP_TEXT, &STEP_NUM);
        Ok(Generation {
            steps: read_rows(dirs, Table::Serve, &text, &numbers)?,
            iterations: read_rows(dirs, Table::ServeIterations, &ITERATION_TEXT, &ITERATION_NUM)?,
            capacities: read_rows(dirs, Table::ServeCapacity, &CAPACITY_TEXT, &CAPACITY_NUM)?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    pub fn sections(&self, colour: &dyn Fn(&str) -> usize) -> Result<Vec<Section>> {
        if self.is_empty() {
            return Ok(Vec::new());
        }
        let mut blocks = vec![Block::Text(
            "Language models served under open-loop load (migprof load): requests of drawn prompt and output lengths arrive on a seeded schedule, and a continuous batcher schedules every iteration of the model over a paged KV cache. TTFT runs from a request's scheduled arrival to its first token, TPOT is the time per output token after it (as vLLM's benchmark defines them). Each point is one step: its p99 against the offered rate, with its 95% interval where the step had 299 finished requests or more (fewer give none); the grey line is the objective. A step meets the objectives when every measured request finished and both p99s are within them."
                .into(),
        )];
        if self.steps.iter().any(|r| r.s("emulation") == "mps") {
            blocks.push(Block::Text("Emulated slices are bounds, not real MIG slices: alone (mps:) they share L2 and memory bandwidth with the whole GPU and flatter small slices; memory-partitioned (mps-mem:) they are held to their share of the bandwidth with less than their L2, and serve less than a real slice would. Energy is the whole GPU's.".into()));
        }
        if self.steps.iter().any(|r| !r.s("engine").is_empty()) {
            blocks.push(Block::Text("A server of your own (migprof load --endpoint --protocol openai) is timed by its client on the same definitions: a request is due at its arrival, or at a fixed concurrency when its client is free; its first token is its first streamed chunk with text. Its steps at a fixed concurrency are charted against the requests in flight.".into()));
        }
        // One pair of charts per model, server, dtype and request lengths: a line per target.
        let mut groups: BTreeMap<(String, String, String, String, String), Vec<&Row>> = BTreeMap::new();
        for r in self.steps.iter().filter(|r| r.is_ok()) {
            groups
                .entry((
                    r.s("model").into(),
                    r.s("engine").into(),
                    r.s("dtype").into(),
                    r.s("prompt_len").into(),
                    r.s("output_len").into(),
                ))
                .or_default()
                .push(r);
        }
        for (i, ((model, engine, dtype, prompt, output), steps)) in groups.iter().enumerate() {
            let served = match engine.as_str() {
                "" => format!("{model} {dtype}"),
                e => format!("{model} on {e}"),
            };
            blocks.push(Block::Text(format!(
                "{served}, prompts {prompt} and outputs {output} tokens:"
            )));
            blocks.extend(p99_charts(&served, model, dtype, i, steps, colour)?);
            if let Some(b) = self.occupancy(model, dtype, steps, colour, i)? {
                blocks.extend(b);
            }
        }
        if let Some(b) = self.capacity_table() {
            blocks.extend(b);
        }
        Ok(vec![Section {
            id: "serving-language-models".into(),
            title: "Serving language models".into(),
            level: 2,
            blocks,
        }])
    }

    /// The KV cache's occupancy over the run of each target's highest rate that met both
    /// objectives (or, where none did or none were given, its highest rate).
    fn occupancy(
        &self,
        model: &str,
        dtype: &str,
        steps: &[&Row],
        colour: &dyn Fn(&str) -> usize,
        i: usize,
    ) -> Result<Option<Vec<Block>>> {
        let targets: BTreeSet<&str> = steps.iter().map(|r| r.s("target")).collect();
        let mut series = Vec::new();
        let mut which = Vec::new();
        for t in targets {
            let mine: Vec<&&Row> = steps.iter().filter(|r| r.s("target") == t).collect();
            let rate = |r: &&&Row| r.n("offered_qps").unwrap_or(0.0);
            let pick = mine
                .iter()
                .filter(|r| r.s("meets_slo") == "true")
                .max_by(|a, b| rate(a).total_cmp(&rate(b)))
                .or_else(|| mine.iter().max_by(|a, b| rate(a).total_cmp(&rate(b))));
            let Some(step) = pick else { continue };
            let points: Vec<Point> = self
                .iterations
                .iter()
                .filter(|it| it.s("serve_id") == step.s("serve_id"))
                .filter_map(|it| {
                    Some(Point {
                        x: it.n("start_ms")? / 1e3,
                        y: it.n("kv_occupancy")? * 100.0,
                        whisker: None,
                    })
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            which.push(format!("{t} at {} requests/s", fmt(step.n("offered_qps"), 2)));
            series.push(Series {
                name: t.to_string(),
                colour: colour(t),
                points,
            });
        }
        if series.is_empty() {
            return Ok(None);
        }
        let title = format!("{model} {dtype}: KV cache in use over a step");
        let chart = Chart::time_series(
            &title,
            "seconds from the step's start",
            "KV cache blocks in use (%)",
            &series,
        );
        Ok(Some(vec![
            Block::Text(format!(
                "The KV cache's blocks in use, iteration by iteration, over one step of each target: its highest rate that met both objectives, or its highest rate ({}).",
                which.join("; ")
            )),
            Block::Chart {
                name: format!("serve-{}-{dtype}-{}-kv.svg", slug(model), i + 1),
                svg: chart.svg()?,
                legend: chart.legend(),
            },
        ]))
    }

    fn capacity_table(&self) -> Option<Vec<Block>> {
        let mut rows: Vec<Vec<String>> = self
            .capacities
            .iter()
            .filter(|r| r.is_ok())
            .map(|r| {
                vec![
                    r.s("target").into(),
                    r.s("profile").into(),
                    match r.s("engine") {
                        "" => format!("{} {}", r.s("model"), r.s("dtype")),
                        e => format!("{} on {e}", r.s("model")),
                    },
                    format!("{} + {}", r.s("prompt_len"), r.s("output_len")),
                    format!(
                        "{} / {}",
                        fmt(r.n("slo_ttft_p99_ms"), 0),
                        fmt(r.n("slo_tpot_p99_ms"), 0)
                    ),
                    r.n("capacity_qps").map_or("none".into(), |c| format!("{c:.2}")),
                    fmt(r.n("bracket_high_qps"), 2),
                    fmt(r.n("closed_loop_qps"), 2),
                    fmt(r.n("steps"), 0),
                    if r.s("emulated") == "true" { "yes" } else { "no" }.into(),
                ]
            })
            .collect();
        if rows.is_empty() {
            return None;
        }
        rows.sort();
        Some(vec![
            Block::Text("Capacities found: the highest rate that met both objectives, the lowest measured that did not, and the rate of the closed loop the job started with.".into()),
            table(
                &[
                    "target",
                    "profile",
                    "model",
                    "prompt + output tokens",
                    "TTFT / TPOT p99 objectives ms",
                    "capacity req/s",
                    "failed at req/s",
                    "closed loop req/s",
                    "steps",
                    "emulated",
                ],
                rows,
            ),
        ])
    }
}

/// The p99 charts of one group's steps, TTFT's and TPOT's: against the offered rate, and against
/// the requests in flight where a server's steps were at fixed concurrencies.
fn p99_charts(
    served: &str,
    model: &str,
    dtype: &str,
    i: usize,
    steps: &[&Row],
    colour: &dyn Fn(&str) -> usize,
) -> Result<Vec<Block>> {
    let mut blocks = Vec::new();
    for (x_key, x_label, x_name) in [
        ("offered_qps", "offered requests/s", "offered rate"),
        ("concurrency", "requests in flight", "concurrency"),
    ] {
        if !steps.iter().any(|r| r.n(x_key).is_some()) {
            continue;
        }
        for (what, key, slo) in [
            ("TTFT", "ttft_p99_ms", "slo_ttft_p99_ms"),
            ("TPOT", "tpot_p99_ms", "slo_tpot_p99_ms"),
        ] {
            let objective = steps.iter().find_map(|r| r.n(slo));
            let series = per_target(steps, colour, |r| {
                Some(Point {
                    x: r.n(x_key)?,
                    y: r.n(key)?,
                    whisker: r.n(&format!("{key}_ci_low")).zip(r.n(&format!("{key}_ci_high"))),
                })
            });
            let title = format!("{served}: {what} p99 against {x_name}");
            let y_label = format!("{what} p99 (ms)");
            let chart = Chart {
                title: &title,
                x_label,
                y_label: &y_label,
                x_scale: scale_for(steps.iter().filter_map(|r| r.n(x_key))),
                y_scale: scale_for(steps.iter().filter_map(|r| r.n(key)).chain(objective)),
                series: &series,
                diagonal: false,
                markers: true,
                hline: objective,
                x_whole: x_key == "concurrency",
            };
            let by = match x_key {
                "concurrency" => "-concurrency",
                _ => "",
            };
            blocks.push(Block::Chart {
                name: format!(
                    "serve-{}-{dtype}-{}-{}{by}.svg",
                    slug(model),
                    i + 1,
                    what.to_lowercase()
                ),
                svg: chart.svg()?,
                legend: chart.legend(),
            });
        }
    }
    Ok(blocks)
}

/// A line per target of `steps`, its points as `point` makes them, in order of offered rate.
fn per_target(steps: &[&Row], colour: &dyn Fn(&str) -> usize, point: impl Fn(&Row) -> Option<Point>) -> Vec<Series> {
    let targets: BTreeSet<&str> = steps.iter().map(|r| r.s("target")).collect();
    targets
        .into_iter()
        .map(|t| {
            let mut points: Vec<Point> = steps
                .iter()
                .filter(|r| r.s("target") == t)
                .filter_map(|r| point(r))
                .collect();
            points.sort_by(|a, b| a.x.total_cmp(&b.x));
            Series {
                name: t.to_string(),
                colour: colour(t),
                points,
            }
        })
        .collect()
}
