//! Where each model's capacity per profile comes from: `load --search` rows (the `capacity` table)
//! at the objective planned for, a CSV of `model,profile,qps`, or — only when asked, and labelled —
//! an estimate from closed-loop runs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::mps::MemoryEmulation;
use crate::results::parts::{number_column, read_table, text_column, Table};

mod closed_loop;
pub mod csv;

/// One model's capacity on one profile, requests/s within the objective.
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    pub model: String,
    pub profile: String,
    pub qps: f64,
    pub source: Source,
    /// The GPU it was measured on, where known.
    pub gpu: Option<String>,
    /// A language model's requests' lengths the capacity holds for ("prompts lognormal:512,0.5 and
    /// outputs 128 tokens"), where known.
    pub lengths: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A capacity search; `emulated`: on an MPS-emulated slice, `partitioned`: one whose memory
    /// bandwidth was partitioned (`mps-mem:`).
    Measured {
        emulated: bool,
        partitioned: bool,
    },
    Csv,
    /// The highest closed-loop throughput of a batch whose p99, doubled, is within the objective;
    /// `program`: from the steps of the user's own program (`migprof exec`).
    ClosedLoop {
        emulated: bool,
        batch: i64,
        program: bool,
    },
}

impl Source {
    pub fn emulated(&self) -> bool {
        matches!(
            self,
            Source::Measured { emulated: true, .. } | Source::ClosedLoop { emulated: true, .. }
        )
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Measured { emulated, partitioned } => format!(
                "measured{}",
                match (emulated, partitioned) {
                    (true, true) => " (MPS-emulated, memory partitioned)",
                    (true, false) => " (MPS-emulated)",
                    _ => "",
                }
            ),
            Source::Csv => "CSV".into(),
            Source::ClosedLoop {
                emulated,
                batch,
                program,
            } => {
                format!(
                    "closed-loop estimate{} at batch {batch}{}",
                    if *program { " from the program's steps" } else { "" },
                    if *emulated { " (MPS-emulated)" } else { "" }
                )
            }
        }
    }
}

/// Capacities and what the user must know about them.
#[derive(Debug, Default)]
pub struct Gathered {
    pub capacities: Vec<Capacity>,
    pub notes: Vec<String>,
    /// The least memory an instance of a language model needs, MiB, by model: its weights, its
    /// measured workspace and the KV cache of one request of its measured lengths' means (a profile
    /// with less cannot hold it).
    pub needs_mib: BTreeMap<String, f64>,
}

impl Gathered {
    /// These capacities and notes, then `other`'s.
    pub fn and(mut self, other: Gathered) -> Gathered {
        self.capacities.extend(other.capacities);
        self.notes.extend(other.notes);
        self.needs_mib.extend(other.needs_mib);
        self
    }
}

/// The capacity rows of `dirs` measured for `slo_ms` (and `dtype`, when given) on the GPU `product`
/// (profile names are shared between GPUs: an A100's 3g.40gb is not an H100's); with `closed_loop`,
/// estimates from their runs where no search measured a model on a profile.
///
/// An emulated slice may have been searched both alone (`mps:`) and memory-partitioned (`mps-mem:`):
/// `memory` picks which to plan from; without it, the partitioned capacity where both exist (the
/// lower bound: a real slice owns only its share of the bandwidth), said in a note.
pub fn from_folders(
    dirs: &[PathBuf],
    slo_ms: f64,
    dtype: Option<&str>,
    product: &str,
    closed_loop: bool,
    memory: Option<MemoryEmulation>,
) -> Result<Gathered> {
    let mut g = Gathered::default();
    let mut found: Found = BTreeMap::new();
    let mut other_slos = std::collections::BTreeSet::new();
    let mut other_gpus = std::collections::BTreeSet::new();
    for dir in dirs {
        anyhow::ensure!(dir.is_dir(), "{}: no such results folder", dir.display());
        let df = read_table(dir, Table::Capacity)?;
        let (model, profile, dt, status) = (
            text_column(&df, "model")?,
            text_column(&df, "profile")?,
            text_column(&df, "dtype")?,
            text_column(&df, "status")?,
        );
        let (slo, qps, emulated) = (
            number_column(&df, "slo_p99_ms")?,
            number_column(&df, "capacity_qps")?,
            text_column(&df, "emulated")?,
        );
        let gpu = text_column(&df, "gpu_name")?;
        let (max_batch, max_delay) = (number_column(&df, "max_batch")?, number_column(&df, "max_delay_ms")?);
        let verdict = text_column(&df, "verdict")?;
        let arrival = text_column(&df, "arrival")?;
        let memory_of = text_column(&df, "memory_emulation")?;
        // A user's server (`migprof load --endpoint`) batches as it is configured, not by `load`'s
        // batcher: its rows name the server and the request instead.
        let (engine, request_batch) = (text_column(&df, "engine")?, number_column(&df, "request_batch")?);
        for i in 0..df.height() {
            if status[i].as_deref() != Some("ok") {
                continue;
            }
            let Some(s) = slo[i] else { continue };
            if (s - slo_ms).abs() > 1e-9 {
                other_slos.insert(format!("{s}"));
                continue;
            }
            let d = dt[i].clone().unwrap_or_default();
            if dtype.is_some_and(|want| want != d) {
                continue;
            }
            if let Some(other) = gpu[i].as_deref().filter(|g| *g != product) {
                other_gpus.insert(other.to_string());
                continue;
            }
            let key = (
                model[i].clone().unwrap_or_default(),
                profile[i].clone().unwrap_or_default(),
                d,
                memory_key(memory_of[i].as_deref(), emulated[i].as_deref() == Some("true")),
            );
            let settings = searched_with(
                arrival[i].as_deref(),
                engine[i].as_deref(),
                request_batch[i],
                (max_batch[i], max_delay[i]),
            );
            if let Some(v) = verdict[i].as_deref().filter(|v| *v != "ok") {
                g.notes.push(format!(
                    "{} on {} ({settings}): steps of its search were `{v}` (see the load table's verdict and note): its capacity is what that machine gave, not the slice's best",
                    model[i].as_deref().unwrap_or("?"),
                    profile[i].as_deref().unwrap_or("?")
                ));
            }
            let emulated = emulated[i].as_deref() == Some("true");
            Searched::add(&mut found, key, settings, qps[i], emulated, gpu[i].clone(), None);
        }
    }
    g.capacities = settle(found, memory, &mut g.notes)?;
    if !other_gpus.is_empty() {
        g.notes.push(format!(
            "left out capacities measured on {} (the plan is for the {product})",
            other_gpus.iter().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    if closed_loop {
        for c in closed_loop::closed_loop_estimates(dirs, slo_ms, dtype, memory, &mut g.notes)?
            .into_iter()
            .filter(|c| c.gpu.as_deref().is_none_or(|g| g == product))
        {
            if !g
                .capacities
                .iter()
                .any(|m| m.model == c.model && m.profile == c.profile)
            {
                g.capacities.push(c);
            }
        }
    }
    if g.capacities.is_empty() {
        let mut hints = Vec::new();
        if !other_slos.is_empty() {
            hints.push(format!(
                "there are capacities for p99 ≤ {} ms",
                other_slos.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
        if !other_gpus.is_empty() {
            hints.push(format!(
                "there are capacities measured on {}, not the {product}",
                other_gpus.into_iter().collect::<Vec<_>>().join(", ")
            ));
        }
        let hint = if hints.is_empty() {
            String::new()
        } else {
            format!(" ({})", hints.join("; "))
        };
        bail!(
            "no capacity measured for p99 ≤ {slo_ms} ms in {}{hint}: run `migprof load --model M --device D --search --slo-p99-ms {slo_ms}`, give --capacities FILE.csv, or ask for --closed-loop-estimates",
            dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
        );
    }
    Ok(g)
}

/// Keeps, per model, profile and dtype, the capacities of one memory emulation: `asked`, else the
/// partitioned one where both were searched. Rows of real slices and whole GPUs (no emulation) stay.
/// The objectives a language model's capacity was searched within: TTFT and TPOT p99, ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServingSlo {
    pub ttft_p99_ms: f64,
    pub tpot_p99_ms: f64,
}

/// The `serve_capacity` rows of `dirs` (language models' searches, `migprof load --search` with a
/// language model) searched within `slo`, at `dtype` when given, on the GPU `product`. A model's
/// requests' lengths, batcher and cache are its server's settings: of repeats the lowest capacity,
/// of different settings the best, said in the notes. Where none matches, the notes say what the
/// folders hold instead (no error: the plan may be of other models).
pub fn serving_from_folders(
    dirs: &[PathBuf],
    slo: ServingSlo,
    dtype: Option<&str>,
    product: &str,
    memory: Option<MemoryEmulation>,
) -> Result<Gathered> {
    let mut g = Gathered::default();
    let mut found: Found = BTreeMap::new();
    let mut other_slos = std::collections::BTreeSet::new();
    for dir in dirs {
        anyhow::ensure!(dir.is_dir(), "{}: no such results folder", dir.display());
        let df = read_table(dir, Table::ServeCapacity)?;
        let text = |c: &str| text_column(&df, c);
        let (model, profile, dt, status, emulated, gpu, memory_of) = (
            text("model")?,
            text("profile")?,
            text("dtype")?,
            text("status")?,
            text("emulated")?,
            text("gpu_name")?,
            text("memory_emulation")?,
        );
        let (prompt, output, chunked, arrival) = (
            text("prompt_len")?,
            text("output_len")?,
            text("chunked_prefill")?,
            text("arrival")?,
        );
        let number = |c: &str| number_column(&df, c);
        let (ttft, tpot, qps, seqs, tokens) = (
            number("slo_ttft_p99_ms")?,
            number("slo_tpot_p99_ms")?,
            number("capacity_qps")?,
            number("max_seqs")?,
            number("max_batched_tokens")?,
        );
        let (weights, workspace, cache, blocks, block, mean_in, mean_out) = (
            number("weights_mib")?,
            number("workspace_mib")?,
            number("kv_cache_mib")?,
            number("kv_blocks")?,
            number("kv_block_size")?,
            number("prompt_len_mean")?,
            number("output_len_mean")?,
        );
        for i in 0..df.height() {
            if status[i].as_deref() != Some("ok") {
                continue;
            }
            let (Some(t), Some(p)) = (ttft[i], tpot[i]) else {
                continue;
            };
            if (t - slo.ttft_p99_ms).abs() > 1e-9 || (p - slo.tpot_p99_ms).abs() > 1e-9 {
                other_slos.insert(format!("TTFT p99 ≤ {t} ms and TPOT p99 ≤ {p} ms"));
                continue;
            }
            let d = dt[i].clone().unwrap_or_default();
            if dtype.is_some_and(|want| want != d) || gpu[i].as_deref().is_some_and(|g| g != product) {
                continue;
            }
            let emulated = emulated[i].as_deref() == Some("true");
            // One request of the mean lengths, in whole blocks, beside the weights.
            if let (Some(w), Some(c), Some(b), Some(bs), Some(i_len), Some(o_len)) =
                (weights[i], cache[i], blocks[i], block[i], mean_in[i], mean_out[i])
            {
                let per_block = c / b.max(1.0);
                let need = w + workspace[i].unwrap_or(0.0) + ((i_len + o_len) / bs.max(1.0)).ceil() * per_block;
                let entry = g.needs_mib.entry(model[i].clone().unwrap_or_default()).or_insert(0.0);
                *entry = entry.max(need);
            }
            let key = (
                model[i].clone().unwrap_or_default(),
                profile[i].clone().unwrap_or_default(),
                d,
                memory_key(memory_of[i].as_deref(), emulated),
            );
            let settings = format!(
                "{} arrivals, prompts {} and outputs {} tokens, {} sequences and {} tokens an iteration{}, a KV cache of {} blocks of {}",
                arrival[i].as_deref().unwrap_or("?"),
                prompt[i].as_deref().unwrap_or("?"),
                output[i].as_deref().unwrap_or("?"),
                seqs[i].unwrap_or(0.0),
                tokens[i].unwrap_or(0.0),
                if chunked[i].as_deref() == Some("false") { ", prefill unchunked" } else { "" },
                blocks[i].unwrap_or(0.0),
                block[i].unwrap_or(0.0)
            );
            let lengths = Some(lengths(prompt[i].as_deref(), output[i].as_deref()));
            Searched::add(&mut found, key, settings, qps[i], emulated, gpu[i].clone(), lengths);
        }
    }
    g.capacities = settle(found, memory, &mut g.notes)?;
    if g.capacities.is_empty() && !other_slos.is_empty() {
        g.notes.push(format!(
            "no language model's capacity within TTFT p99 ≤ {} ms and TPOT p99 ≤ {} ms; the folders hold some within {}",
            slo.ttft_p99_ms,
            slo.tpot_p99_ms,
            other_slos.into_iter().collect::<Vec<_>>().join("; ")
        ));
    }
    Ok(g)
}

/// Capacities found by (model, profile, dtype, memory emulation), then by the server's settings
/// (searches of the same settings are repeats).
type Found = BTreeMap<(String, String, String, String), BTreeMap<String, Vec<Searched>>>;

/// One search's capacity, requests/s: on an emulated slice or not, the GPU, and a language model's
/// requests' lengths.
struct Searched {
    qps: f64,
    emulated: bool,
    gpu: Option<String>,
    lengths: Option<String>,
}

impl Searched {
    /// A search's row into `found`, under its key and its server's settings.
    fn add(
        found: &mut Found,
        key: (String, String, String, String),
        settings: String,
        qps: Option<f64>,
        emulated: bool,
        gpu: Option<String>,
        lengths: Option<String>,
    ) {
        let searched = Searched {
            qps: qps.unwrap_or(0.0),
            emulated,
            gpu,
            lengths,
        };
        found
            .entry(key)
            .or_default()
            .entry(settings)
            .or_default()
            .push(searched);
    }
}

/// How a language model's capacity line names its requests' lengths.
pub(super) fn lengths(prompt: Option<&str>, output: Option<&str>) -> String {
    format!(
        "prompts {} and outputs {} tokens",
        prompt.unwrap_or("?"),
        output.unwrap_or("?")
    )
}

/// One capacity per model and profile from what the searches `found`: of repeats the lowest, of
/// different server settings the best, each choice said in `notes`; an emulated slice's
/// memory-partitioned or lone capacity as `memory` asks; one dtype per model.
fn settle(found: Found, memory: Option<MemoryEmulation>, notes: &mut Vec<String>) -> Result<Vec<Capacity>> {
    let mut capacities = Vec::new();
    let found = pick_memory_emulation(found, memory, notes);
    // A model measured at several dtypes needs --dtype to say which: a plan serves it at one.
    let mut dtypes_of: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for (m, _, d, _) in found.keys() {
        dtypes_of.entry(m.clone()).or_default().insert(d.clone());
    }
    if let Some((m, ds)) = dtypes_of.iter().find(|(_, ds)| ds.len() > 1) {
        bail!(
            "{m} has capacities at several dtypes ({}): choose one with --dtype",
            ds.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    for ((model, profile, _, mem), by_settings) in found {
        // Searches of the same settings are repeats: the lowest is what the settings can promise.
        // Different settings are different servers: a deployment picks the best.
        let mut best: Option<(String, Searched)> = None;
        for (settings, list) in &by_settings {
            let qps = list.iter().map(|x| x.qps).fold(f64::INFINITY, f64::min);
            if list.len() > 1 {
                notes.push(format!(
                    "{model} on {profile} ({settings}): {} searches; planning with the lowest, {qps:.1} requests/s",
                    list.len()
                ));
            }
            if best.as_ref().is_none_or(|b| qps > b.1.qps) {
                let chosen = Searched {
                    qps,
                    emulated: list.iter().any(|x| x.emulated),
                    gpu: list.iter().find_map(|x| x.gpu.clone()),
                    lengths: list.iter().find_map(|x| x.lengths.clone()),
                };
                best = Some((settings.clone(), chosen));
            }
        }
        let (
            settings,
            Searched {
                qps,
                emulated,
                gpu,
                lengths,
            },
        ) = best.expect("at least one search");
        if by_settings.len() > 1 {
            notes.push(format!("{model} on {profile}: searched with {} server settings; planning with the best, {settings} ({qps:.1} requests/s)", by_settings.len()));
        }
        capacities.push(Capacity {
            model,
            profile,
            qps,
            source: Source::Measured {
                emulated,
                partitioned: mem == MemoryEmulation::Partitioned.as_str(),
            },
            gpu,
            lengths,
        });
    }
    Ok(capacities)
}

fn pick_memory_emulation<V>(
    found: BTreeMap<(String, String, String, String), V>,
    asked: Option<MemoryEmulation>,
    notes: &mut Vec<String>,
) -> BTreeMap<(String, String, String, String), V> {
    let (alone, partitioned) = (MemoryEmulation::Alone.as_str(), MemoryEmulation::Partitioned.as_str());
    let has = |m: &str, p: &str, d: &str, e: &str| found.contains_key(&(m.into(), p.into(), d.into(), e.into()));
    let mut both = Vec::new();
    let keep: Vec<bool> = found
        .keys()
        .map(|(m, p, d, e)| {
            let other = if e == alone { partitioned } else { alone };
            match (asked, e.as_str()) {
                (_, "") => true,
                (Some(want), e) => e == want.as_str() || !has(m, p, d, want.as_str()),
                (None, e) if has(m, p, d, other) => {
                    if e == partitioned {
                        both.push(format!("{m} on {p}"));
                    }
                    e == partitioned
                }
                (None, _) => true,
            }
        })
        .collect();
    if !both.is_empty() {
        notes.push(format!(
            "{} searched both alone and memory-partitioned: planning from the memory-partitioned capacities (the lower bound: a real slice owns only its share of the memory bandwidth; --memory-emulation alone plans from the others)",
            both.join(", ")
        ));
    }
    if let Some(want) = asked {
        let other: Vec<String> = found
            .keys()
            .zip(&keep)
            .filter(|((_, _, _, e), k)| !e.is_empty() && e != want.as_str() && **k)
            .map(|((m, p, _, e), _)| format!("{m} on {p} ({e})"))
            .collect();
        if !other.is_empty() {
            notes.push(format!(
                "no {} capacity for {}: planning from the one measured",
                want.as_str(),
                other.join(", ")
            ));
        }
    }
    found
        .into_iter()
        .zip(keep)
        .filter(|(_, k)| *k)
        .map(|(kv, _)| kv)
        .collect()
}

/// The profile a runs row ran on, as the capacity table names it.
fn profile_of_row(emulated: Option<&str>, mig: Option<&str>, gpu: Option<&str>, mps_pct: Option<f64>) -> String {
    match (emulated, mig, gpu) {
        (Some(e), _, _) => e.to_string(),
        (None, Some(m), _) => m.to_string(),
        (None, None, Some(_)) if mps_pct.is_some() => format!("mps:{}%", mps_pct.unwrap_or_default()),
        (None, None, Some(_)) => super::solve::FULL.to_string(),
        (None, None, None) => "cpu".to_string(),
    }
}

/// A row's memory emulation as the capacities are keyed by it: an emulated slice written before the
/// column existed (schema 7 or older) ran alone; empty for real slices and whole GPUs.
fn memory_key(column: Option<&str>, emulated: bool) -> String {
    match column {
        Some(m) => m.to_string(),
        None if emulated => MemoryEmulation::Alone.as_str().to_string(),
        None => String::new(),
    }
}

/// How a capacity was searched, as its notes say: the arrivals and `load`'s batcher, or, for a
/// user's server, the server and its requests' batch (it batches as it is configured).
fn searched_with(
    arrival: Option<&str>,
    engine: Option<&str>,
    request_batch: Option<f64>,
    (max_batch, max_delay_ms): (Option<f64>, Option<f64>),
) -> String {
    let arrivals = arrival.unwrap_or("?");
    match engine {
        Some(server) => format!(
            "{arrivals} arrivals to the server {server}, requests of batch {}",
            request_batch.unwrap_or(0.0)
        ),
        None => format!(
            "{arrivals} arrivals, max batch {}, max delay {} ms",
            max_batch.unwrap_or(0.0),
            max_delay_ms.unwrap_or(0.0)
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::csv::from_csv;
    use super::*;

    #[test]
    fn a_server_s_search_is_described_by_its_server_not_by_load_s_batcher() {
        assert_eq!(
            searched_with(Some("poisson"), None, None, (Some(32.0), Some(5.0))),
            "poisson arrivals, max batch 32, max delay 5 ms"
        );
        assert_eq!(
            searched_with(
                Some("poisson"),
                Some("triton 2.51.0"),
                Some(8.0),
                (Some(32.0), Some(5.0))
            ),
            "poisson arrivals to the server triton 2.51.0, requests of batch 8"
        );
    }

    /// A search's row: model, profile, capacity, (TTFT, TPOT) objectives, memory emulation.
    type Searched<'a> = (&'a str, &'a str, f64, (f64, f64), &'a str);

    /// A `serve_capacity` part as a language model's search writes one (the columns the planner
    /// reads).
    fn serve_capacity(dir: &Path, rows: &[Searched]) -> Result<()> {
        use crate::results::parts::{col, write_part};
        use polars::prelude::*;
        let n = rows.len();
        let texts = |f: &dyn Fn(&Searched) -> String| rows.iter().map(f).collect::<Vec<_>>();
        let nums = |v: f64| vec![v; n];
        let mut df = DataFrame::new(
            n,
            vec![
                Column::new("schema_version".into(), vec![SCHEMA; n]),
                col("capacity_id", texts(&|r| format!("c-{}-{}", r.0, r.1))),
                col("model", texts(&|r| r.0.to_string())),
                col("profile", texts(&|r| r.1.to_string())),
                col("dtype", vec!["bf16"; n]),
                col("status", vec!["ok"; n]),
                col("emulated", vec![true; n]),
                Column::new("gpu_name".into(), vec![None::<String>; n]),
                col("memory_emulation", texts(&|r| r.4.to_string())),
                col("prompt_len", vec!["lognormal:512,0.5"; n]),
                col("output_len", vec!["lognormal:128,0.5"; n]),
                col("chunked_prefill", vec![true; n]),
                col("arrival", vec!["poisson"; n]),
                col("slo_ttft_p99_ms", rows.iter().map(|r| r.3 .0).collect::<Vec<_>>()),
                col("slo_tpot_p99_ms", rows.iter().map(|r| r.3 .1).collect::<Vec<_>>()),
                col("capacity_qps", rows.iter().map(|r| r.2).collect::<Vec<_>>()),
                col("max_seqs", nums(256.0)),
                col("max_batched_tokens", nums(2048.0)),
                col("weights_mib", nums(2357.0)),
                col("kv_cache_mib", nums(6030.5)),
                col("kv_blocks", nums(12061.0)),
                col("kv_block_size", nums(16.0)),
                col("prompt_len_mean", nums(512.0)),
                col("output_len_mean", nums(128.0)),
            ],
        )?;
        write_part(&dir.join(Table::ServeCapacity.dir_name()), "part-1.parquet", &mut df)?;
        Ok(())
    }

    const SCHEMA: i32 = crate::results::parts::SCHEMA_VERSION;

    #[test]
    fn language_models_capacities_come_from_their_searches_within_both_objectives() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let slo = ServingSlo {
            ttft_p99_ms: 500.0,
            tpot_p99_ms: 50.0,
        };
        serve_capacity(
            dir.path(),
            &[
                ("llama_3_2_1b", "1g.10gb", 9.65, (500.0, 50.0), "partitioned"),
                ("llama_3_2_1b", "1g.10gb", 14.0, (500.0, 50.0), "alone"),
                ("llama_3_2_1b", "3g.40gb", 34.4, (500.0, 50.0), "partitioned"),
                ("llama_3_2_1b", "7g.80gb", 50.0, (300.0, 50.0), "partitioned"),
            ],
        )?;
        let dirs = [dir.path().to_path_buf()];
        let g = serving_from_folders(&dirs, slo, None, "H100-SXM5-80GB", None)?;
        let got: Vec<(&str, f64)> = g.capacities.iter().map(|c| (c.profile.as_str(), c.qps)).collect();
        // The memory-partitioned capacity where both were searched; the other objective's left out.
        assert_eq!(got, [("1g.10gb", 9.65), ("3g.40gb", 34.4)]);
        assert!(g.notes.iter().any(|n| n.contains("1g.10gb")), "{:?}", g.notes);
        // Weights and one request of 512 + 128 tokens in blocks of 16: 2,357 + 40 × 0.5 MiB (no
        // workspace in these rows).
        assert!((g.needs_mib["llama_3_2_1b"] - 2377.0).abs() < 0.1, "{:?}", g.needs_mib);
        let alone = serving_from_folders(&dirs, slo, None, "H100-SXM5-80GB", Some(MemoryEmulation::Alone))?;
        assert_eq!(alone.capacities[0].qps, 14.0);
        let other = ServingSlo {
            ttft_p99_ms: 200.0,
            ..slo
        };
        let none = serving_from_folders(&dirs, other, None, "H100-SXM5-80GB", None)?;
        assert!(none.capacities.is_empty());
        assert!(
            none.notes.iter().any(|n| n.contains("TTFT p99 ≤ 500 ms")),
            "{:?}",
            none.notes
        );
        Ok(())
    }

    #[test]
    fn a_csv_reads_by_its_header_and_bad_lines_name_themselves() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("c.csv");
        std::fs::write(
            &path,
            "# measured elsewhere\nprofile,model,qps\n1g.10gb,resnet50,812.5\n3g.40gb, resnet50 ,2400\n",
        )?;
        let h100 = crate::mig::profile::table("h100-80gb")?;
        let any = super::super::Objectives::p99(50.0);
        let g = from_csv(&path, &h100, &any)?;
        assert_eq!(g.capacities.len(), 2);
        assert_eq!(
            (
                g.capacities[1].model.as_str(),
                g.capacities[1].profile.as_str(),
                g.capacities[1].qps
            ),
            ("resnet50", "3g.40gb", 2400.0)
        );
        std::fs::write(&path, "model,profile,qps\nresnet50,1g.10gb,fast\n")?;
        let e = from_csv(&path, &h100, &any).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("`fast`"), "{e}");
        // Any model, a user's own included; a profile the GPU does not have names its line.
        std::fs::write(
            &path,
            "model,profile,qps\nllama-8b,3g.40gb,12\nllama-8b,full,40\nllama-8b,3g.71gb,20\n",
        )?;
        let e = from_csv(&path, &h100, &any).unwrap_err().to_string();
        assert!(
            e.contains("line 4") && e.contains("`3g.71gb` is not a MIG profile of the") && e.contains("1g.10gb"),
            "{e}"
        );
        std::fs::write(&path, "model,profile,qps\nllama-8b,3g.40gb,12\nllama-8b,full,40\n")?;
        assert_eq!(from_csv(&path, &h100, &any)?.capacities[0].model, "llama-8b");
        std::fs::write(&path, "model,slice,qps\n")?;
        assert!(from_csv(&path, &h100, &any)
            .unwrap_err()
            .to_string()
            .contains("must name the columns model, profile and qps"));
        Ok(())
    }

    #[test]
    fn a_csvs_rows_name_their_objectives_and_lengths_and_only_the_plans_are_taken() -> Result<()> {
        use super::super::Objectives;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("c.csv");
        let h100 = crate::mig::profile::table("h100-80gb")?;
        std::fs::write(
            &path,
            "model,profile,qps,slo_p99_ms,slo_ttft_p99_ms,slo_tpot_p99_ms,prompt_len,output_len\n\
             bert_base,1g.10gb,900,50,,,,\n\
             bert_base,1g.10gb,1200,100,,,,\n\
             llama_3_2_1b,1g.10gb,9.2,,500,50,\"lognormal:512,0.5\",128\n\
             llama_3_2_1b,1g.10gb,14,,1000,100,\"lognormal:512,0.5\",128\n\
             own-model,full,40,,,,,\n",
        )?;
        let plan = Objectives {
            p99_ms: Some(50.0),
            serving: Some(ServingSlo {
                ttft_p99_ms: 500.0,
                tpot_p99_ms: 50.0,
            }),
        };
        let g = from_csv(&path, &h100, &plan)?;
        let got: Vec<(&str, f64, Option<&str>)> = g
            .capacities
            .iter()
            .map(|c| (c.model.as_str(), c.qps, c.lengths.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("bert_base", 900.0, None),
                (
                    "llama_3_2_1b",
                    9.2,
                    Some("prompts lognormal:512,0.5 and outputs 128 tokens")
                ),
                ("own-model", 40.0, None),
            ]
        );
        assert!(
            g.notes
                .iter()
                .any(|n| n.contains("p99 100 ms") && n.contains("TTFT p99 1000 ms and TPOT p99 100 ms")),
            "{:?}",
            g.notes
        );
        // Only the p99 objective planned: the language model's rows are all left out.
        let g = from_csv(&path, &h100, &Objectives::p99(100.0))?;
        assert_eq!(g.capacities.iter().map(|c| c.qps).collect::<Vec<_>>(), [1200.0, 40.0]);
        for (row, says) in [
            ("llama_3_2_1b,1g.10gb,9,,500,,,", "give both"),
            ("llama_3_2_1b,1g.10gb,9,50,500,50,,", "not both"),
            ("bert_base,1g.10gb,9,fast,,,,", "slo_p99_ms `fast`"),
            (
                "llama_3_2_1b,1g.10gb,9,,500,50,lognormal:512,0.5,128",
                "9 fields for the header's 8",
            ),
            ("llama_3_2_1b,1g.10gb,9,,500,50,\"lognormal:512\",128", "prompt_len"),
            (
                "llama_3_2_1b,1g.10gb,9,,500,50,\"lognormal:512,0.5,128",
                "a quote is left open",
            ),
            ("llama_3_2_1b,1g.10gb,9,,900,90,\"lognormal:512\",128", "prompt_len"),
        ] {
            std::fs::write(
                &path,
                format!("model,profile,qps,slo_p99_ms,slo_ttft_p99_ms,slo_tpot_p99_ms,prompt_len,output_len\n{row}\n"),
            )?;
            let e = from_csv(&path, &h100, &plan).unwrap_err().to_string();
            assert!(e.contains("line 2") && e.contains(says), "{row}: {e}");
        }
        std::fs::write(&path, "model,profile,qps,qps\n")?;
        let e = from_csv(&path, &h100, &plan).unwrap_err().to_string();
        assert!(e.contains("`qps` twice"), "{e}");
        std::fs::write(&path, "model,profile,qps,slo\n")?;
        let e = from_csv(&path, &h100, &plan).unwrap_err().to_string();
        assert!(e.contains("`slo`") && e.contains("slo_tpot_p99_ms"), "{e}");
        Ok(())
    }

    #[test]
    fn closed_loop_estimates_come_only_when_asked_and_labelled() -> Result<()> {
        use crate::run::record::tests::fake_run;
        use std::time::Duration;
        let dir = tempfile::tempdir()?;
        // Steps of 1 and 3 ms: p99 3 ms; batch 8 serves 4,000 samples/s, batch 1 500.
        crate::results::runs::write_run(dir.path(), &fake_run(8, 30, Duration::ZERO))?;
        crate::results::runs::write_run(dir.path(), &fake_run(1, 30, Duration::ZERO))?;
        let dirs = [dir.path().to_path_buf()];
        let e = from_folders(&dirs, 10.0, None, "cpu", false, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--closed-loop-estimates") && e.contains("migprof load"),
            "{e}"
        );
        let g = from_folders(&dirs, 10.0, None, "cpu", true, None)?;
        assert_eq!(g.capacities.len(), 1);
        let c = &g.capacities[0];
        assert_eq!(
            (c.model.as_str(), c.profile.as_str(), c.qps),
            ("resnet_tiny", "cpu", 4000.0)
        );
        assert_eq!(
            c.source,
            Source::ClosedLoop {
                emulated: false,
                batch: 8,
                program: false
            }
        );
        assert!(c.source.describe().contains("closed-loop estimate at batch 8"));
        // Doubled, a p99 of 3 ms does not fit 5 ms: no estimate.
        assert!(from_folders(&dirs, 5.0, None, "cpu", true, None).is_err());
        // The user's program of the same name, slower: its steps are what the plan takes.
        let mut program = fake_run(4, 30, Duration::ZERO);
        program.subject = crate::run::subject::Subject::Program(crate::run::subject::Program {
            name: "resnet_tiny".into(),
            command: "python3 serve.py".into(),
            exit_code: Some(0),
            exit_signal: None,
            wall: Some(Duration::from_secs(1)),
            steps: crate::run::subject::StepsFrom::Protocol,
            step_pattern: None,
            device_memory_max_mib: None,
            pids_seen: None,
        });
        crate::results::runs::write_run(dir.path(), &program)?;
        let g = from_folders(&dirs, 10.0, None, "cpu", true, None)?;
        assert_eq!(g.capacities.len(), 1);
        let c = &g.capacities[0];
        assert_eq!(
            (c.qps, c.source.clone()),
            (
                2000.0,
                Source::ClosedLoop {
                    emulated: false,
                    batch: 4,
                    program: true
                }
            )
        );
        assert!(c.source.describe().contains("from the program's steps"));
        assert!(
            g.notes
                .iter()
                .any(|n| n.contains("resnet_tiny: closed-loop estimates from your program's steps")),
            "{:?}",
            g.notes
        );
        Ok(())
    }

    #[test]
    fn the_plan_takes_the_memory_partitioned_capacity_by_default_and_the_other_when_asked() {
        let key = |p: &str, e: &str| ("resnet50".to_string(), p.to_string(), "bf16".to_string(), e.to_string());
        let found: BTreeMap<_, f64> = [
            (key("1g.10gb", "alone"), 900.0),
            (key("1g.10gb", "partitioned"), 520.0),
            (key("3g.40gb", "alone"), 2600.0),
            (key("full", ""), 6000.0),
        ]
        .into_iter()
        .collect();
        let picked = |asked| {
            let mut notes = Vec::new();
            let kept: Vec<(String, String)> = pick_memory_emulation(found.clone(), asked, &mut notes)
                .into_keys()
                .map(|(_, p, _, e)| (p, e))
                .collect();
            (kept, notes)
        };
        let pair = |p: &str, e: &str| (p.to_string(), e.to_string());
        // By default, and when asked for: the 1g's partitioned capacity, the others as measured.
        let partitioned = [
            pair("1g.10gb", "partitioned"),
            pair("3g.40gb", "alone"),
            pair("full", ""),
        ];
        let (kept, notes) = picked(None);
        assert_eq!(kept, partitioned);
        assert!(
            notes.len() == 1
                && notes[0].contains("resnet50 on 1g.10gb")
                && notes[0].contains("--memory-emulation alone"),
            "{notes:?}"
        );
        let (kept, notes) = picked(Some(MemoryEmulation::Alone));
        assert_eq!(
            kept,
            [pair("1g.10gb", "alone"), pair("3g.40gb", "alone"), pair("full", "")]
        );
        assert!(notes.is_empty(), "{notes:?}");
        // Asked for partitioned: the 3g has only its alone capacity, which stands and is said.
        let (kept, notes) = picked(Some(MemoryEmulation::Partitioned));
        assert_eq!(kept, partitioned);
        assert!(
            notes[0].contains("no partitioned capacity for resnet50 on 3g.40gb (alone)"),
            "{notes:?}"
        );
        // The source says which it was.
        let s = Source::Measured {
            emulated: true,
            partitioned: true,
        };
        assert_eq!(s.describe(), "measured (MPS-emulated, memory partitioned)");
    }
}
