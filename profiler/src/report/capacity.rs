//! The report's capacity section: each target's p99 against the offered rate (the knee where the
//! queue takes over), the capacity each search found, and the latest fleet plan made from the folders
//! (`migprof capacity --from`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use anyhow::{Context, Result};

use super::chart::{scale_for, Chart, Point, Series};
use super::data::{read_rows, with_target, Row};
use super::page::{fmt, slug, table, Block, Section};
use crate::results::parts::Table;

const STEP_TEXT: [&str; 12] = [
    "target",
    "status",
    "model",
    "dtype",
    "seq_len",
    "profile",
    "emulation",
    "meets_slo",
    "ending",
    "capacity_id",
    "engine",
    "verdict",
];
const STEP_NUM: [&str; 13] = [
    "offered_qps",
    "achieved_qps",
    "p99_ms",
    "p99_ms_ci_low",
    "p99_ms_ci_high",
    "slo_p99_ms",
    "max_batch",
    "max_delay_ms",
    "concurrency",
    "request_batch",
    "p50_ms",
    "failed_requests",
    "client_late",
];
const CAPACITY_TEXT: [&str; 8] = [
    "target", "status", "model", "dtype", "seq_len", "profile", "emulated", "note",
];
const CAPACITY_NUM: [&str; 7] = [
    "capacity_qps",
    "slo_p99_ms",
    "p99_at_capacity_ms",
    "bracket_high_qps",
    "steps",
    "closed_loop_qps",
    "max_batch",
];

/// The folders' load steps, capacities and plans.
pub struct Serving {
    pub steps: Vec<Row>,
    pub capacities: Vec<Row>,
    /// The latest plan of each folder that has one: (file, plan).
    pub plans: Vec<(PathBuf, crate::capacity::Report)>,
}

impl Serving {
    pub fn read(dirs: &[PathBuf]) -> Result<Serving> {
        let (text, numbers) = with_target(&STEP_TEXT, &STEP_NUM);
        let steps = read_rows(dirs, Table::Load, &text, &numbers)?;
        let capacities = read_rows(dirs, Table::Capacity, &CAPACITY_TEXT, &CAPACITY_NUM)?;
        let mut plans = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(dir.join("plans")) else {
                continue;
            };
            let mut files: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            if let Some(latest) = files.pop() {
                let text = std::fs::read_to_string(&latest).with_context(|| format!("reading {}", latest.display()))?;
                let plan = serde_json::from_str(&text)
                    .with_context(|| format!("{}: not a plan of `migprof capacity`", latest.display()))?;
                plans.push((latest, plan));
            }
        }
        Ok(Serving {
            steps,
            capacities,
            plans,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty() && self.capacities.is_empty()
    }

    pub fn sections(&self, colour: &dyn Fn(&str) -> usize) -> Result<Vec<Section>> {
        if self.is_empty() {
            return Ok(Vec::new());
        }
        let mut blocks = vec![Block::Text(
            "Open-loop serving (migprof load): requests arrive on a seeded schedule whatever the model does, wait for a dynamic batcher, and each is timed from its scheduled arrival to its batch's completion. Each point is one load step: its p99 (with its 95% interval) against the offered rate; the grey line is the objective. The capacity is the highest rate whose p99 stayed within it."
                .into(),
        )];
        if self.steps.iter().any(|r| r.s("emulation") == "mps") {
            blocks.push(Block::Text("Emulated slices (MPS) share L2 and memory bandwidth with the whole GPU: their capacities flatter small slices against real MIG.".into()));
        }
        blocks.extend(self.step_charts(colour)?);
        blocks.extend(self.concurrency_table());
        blocks.extend(self.capacity_table());
        let mut out = vec![Section {
            id: "capacity".into(),
            title: "Serving capacity".into(),
            level: 2,
            blocks,
        }];
        for (path, plan) in &self.plans {
            out.push(plan_section(path, plan));
        }
        Ok(out)
    }

    /// One chart per model, dtype, sequence length, objective and batcher: each step's p99
    /// against its offered rate, a line per target.
    fn step_charts(&self, colour: &dyn Fn(&str) -> usize) -> Result<Vec<Block>> {
        let mut blocks = Vec::new();
        let mut groups: BTreeMap<(String, String, String, String, String), Vec<&Row>> = BTreeMap::new();
        // A step at a fixed concurrency (a server of the user's own) offered no rate: its table
        // follows.
        for r in self
            .steps
            .iter()
            .filter(|r| r.s("status") == "ok" && r.n("p99_ms").is_some() && r.n("offered_qps").is_some())
        {
            let slo = r.n("slo_p99_ms").map_or(String::new(), |s| format!("{s}"));
            let batcher = batcher(r);
            groups
                .entry((
                    r.s("model").into(),
                    r.s("dtype").into(),
                    r.s("seq_len").into(),
                    slo,
                    batcher,
                ))
                .or_default()
                .push(r);
        }
        for (i, ((model, dtype, seq, slo, batcher), steps)) in groups.iter().enumerate() {
            let targets: BTreeSet<&str> = steps.iter().map(|r| r.s("target")).collect();
            let series: Vec<Series> = targets
                .iter()
                .map(|t| Series {
                    name: t.to_string(),
                    colour: colour(t),
                    points: steps
                        .iter()
                        .filter(|r| r.s("target") == *t)
                        .map(|r| Point {
                            x: r.n("offered_qps").unwrap_or(0.0),
                            y: r.n("p99_ms").unwrap_or(0.0),
                            whisker: r.n("p99_ms_ci_low").zip(r.n("p99_ms_ci_high")),
                        })
                        .collect(),
                })
                .collect();
            let seq_text = if seq.is_empty() {
                String::new()
            } else {
                format!(", seq {seq}")
            };
            let slo_text = if slo.is_empty() {
                String::new()
            } else {
                format!(", objective p99 ≤ {slo} ms")
            };
            let title = format!("{model} {dtype}{seq_text} ({batcher}): p99 against offered rate");
            let chart = Chart {
                title: &title,
                x_label: "offered requests/s",
                y_label: "p99 latency (ms)",
                // Log only where the data spans more than a decade: a narrower log axis has no ticks.
                x_scale: scale_for(steps.iter().filter_map(|r| r.n("offered_qps"))),
                y_scale: scale_for(steps.iter().filter_map(|r| r.n("p99_ms")).chain(slo.parse().ok())),
                series: &series,
                diagonal: false,
                markers: true,
                hline: slo.parse().ok(),
                x_whole: false,
            };
            blocks.push(Block::Text(format!("{model}, {dtype}{seq_text}, {batcher}{slo_text}:")));
            blocks.push(Block::Chart {
                name: format!("load-{}-{dtype}-{}.svg", slug(model), i + 1),
                svg: chart.svg()?,
                legend: chart.legend(),
            });
        }
        Ok(blocks)
    }

    /// The steps of servers of the user's own at a fixed concurrency, a row per step: the rate each
    /// concurrency pushed through and its latencies, beside what the client saw of itself.
    fn concurrency_table(&self) -> Vec<Block> {
        let mut steps: Vec<&Row> = self
            .steps
            .iter()
            .filter(|r| r.s("status") == "ok" && r.n("concurrency").is_some())
            .collect();
        // By target and server, then by concurrency as a number (1, 2, 16, not 1, 16, 2).
        steps.sort_by(|a, b| {
            (a.s("target"), a.s("model"), a.s("engine"))
                .cmp(&(b.s("target"), b.s("model"), b.s("engine")))
                .then(
                    a.n("concurrency")
                        .unwrap_or(0.0)
                        .total_cmp(&b.n("concurrency").unwrap_or(0.0)),
                )
        });
        let rows: Vec<Vec<String>> = steps
            .into_iter()
            .map(|r| {
                let samples = r.n("achieved_qps").zip(r.n("request_batch")).map(|(q, b)| q * b);
                vec![
                    r.s("target").into(),
                    r.s("profile").into(),
                    format!("{} ({})", r.s("model"), r.s("engine")),
                    fmt(r.n("request_batch"), 0),
                    fmt(r.n("concurrency"), 0),
                    fmt(r.n("achieved_qps"), 1),
                    fmt(samples, 1),
                    fmt(r.n("p50_ms"), 2),
                    fmt(r.n("p99_ms"), 2),
                    fmt(r.n("failed_requests"), 0),
                    fmt(r.n("client_late"), 0),
                    r.s("verdict").into(),
                ]
            })
            .collect();
        if rows.is_empty() {
            return Vec::new();
        }
        vec![
            Block::Text("Servers of your own at a fixed concurrency (migprof load --endpoint --concurrency): that many requests always in flight, each timed from when its client was free to the last byte of its answer. Failed requests are left out of the latencies; late ones are requests the client itself sent over 1 ms after their client was free (a client slower than the server).".into()),
            table(
                &[
                    "target",
                    "profile",
                    "model (server)",
                    "request batch",
                    "concurrency",
                    "req/s",
                    "samples/s",
                    "p50 ms",
                    "p99 ms",
                    "failed",
                    "late",
                    "verdict",
                ],
                rows,
            ),
        ]
    }

    /// The capacities found, a row per search.
    fn capacity_table(&self) -> Vec<Block> {
        let mut blocks = Vec::new();
        let mut rows: Vec<Vec<String>> = self
            .capacities
            .iter()
            .filter(|r| r.s("status") == "ok")
            .map(|r| {
                let knee = r.n("capacity_qps").zip(r.n("closed_loop_qps")).map(|(c, l)| c / l);
                vec![
                    r.s("target").into(),
                    r.s("profile").into(),
                    format!(
                        "{} {}{}",
                        r.s("model"),
                        r.s("dtype"),
                        if r.s("seq_len").is_empty() {
                            String::new()
                        } else {
                            format!(" seq {}", r.s("seq_len"))
                        }
                    ),
                    fmt(r.n("slo_p99_ms"), 1),
                    r.n("capacity_qps").map_or("none".into(), |c| format!("{c:.1}")),
                    fmt(r.n("p99_at_capacity_ms"), 2),
                    fmt(r.n("bracket_high_qps"), 1),
                    fmt(r.n("closed_loop_qps"), 1),
                    fmt(knee, 2),
                    fmt(r.n("steps"), 0),
                    if r.s("emulated") == "true" {
                        "yes".into()
                    } else {
                        "no".into()
                    },
                ]
            })
            .collect();
        rows.sort();
        if !rows.is_empty() {
            blocks.push(Block::Text("Capacities found: the highest rate that met the objective, the lowest that did not, and the closed loop's rate at the max batch; their ratio is what the objective leaves of the closed loop's throughput.".into()));
            blocks.push(table(
                &[
                    "target",
                    "profile",
                    "model",
                    "p99 objective ms",
                    "capacity req/s",
                    "p99 there ms",
                    "failed at req/s",
                    "closed loop req/s",
                    "capacity / closed loop",
                    "steps",
                    "emulated",
                ],
                rows,
            ));
        }
        blocks
    }
}

/// What batched a step's requests: migprof's batcher and its bounds, or a server of the user's own
/// and the samples its requests held.
fn batcher(r: &Row) -> String {
    match r.s("engine") {
        "" => format!(
            "batches ≤ {}, wait ≤ {} ms",
            fmt(r.n("max_batch"), 0),
            r.n("max_delay_ms").unwrap_or(0.0)
        ),
        engine => format!("{engine}, requests of {}", fmt(r.n("request_batch"), 0)),
    }
}

fn plan_section(path: &std::path::Path, p: &crate::capacity::Report) -> Section {
    let mut blocks = vec![Block::Text(format!(
        "From {}: {} GPU(s) of the {} serve {} within {}, each instance planned at {:.0}% of its capacity (an integer program, solved exactly). By hand, a whole GPU per model: {}; one profile per model: {}.",
        path.display(),
        p.gpus,
        p.gpu,
        p.spare.iter().map(|s| format!("{} {:.0} req/s", s.model, s.demand_qps)).collect::<Vec<_>>().join(" and "),
        p.objectives().describe(),
        p.headroom * 100.0,
        p.whole_gpu_per_model.describe_gpus(),
        p.one_profile_per_model.describe_gpus()
    ))];
    blocks.push(table(
        &["GPUs", "layout"],
        p.layouts
            .iter()
            .map(|l| {
                vec![
                    l.count.to_string(),
                    if l.mig_enabled {
                        l.profiles.join(" + ")
                    } else {
                        "MIG off".into()
                    },
                ]
            })
            .collect(),
    ));
    blocks.push(table(
        &["model", "profile", "instances"],
        p.instances
            .iter()
            .map(|i| vec![i.model.clone(), i.profile.clone(), i.count.to_string()])
            .collect(),
    ));
    blocks.push(table(
        &["model", "demand req/s", "serves req/s", "spare req/s"],
        p.spare
            .iter()
            .map(|s| {
                vec![
                    s.model.clone(),
                    format!("{:.0}", s.demand_qps),
                    format!("{:.0}", s.serves_qps),
                    format!("{:.0}", s.spare_qps),
                ]
            })
            .collect(),
    ));
    for n in &p.notes {
        blocks.push(Block::Text(format!("Note: {n}")));
    }
    Section {
        id: "plan".into(),
        title: "Fleet plan".into(),
        level: 3,
        blocks,
    }
}
