//! `migprof report`: the page a platform engineer forwards — what ran where, how each model scales
//! across the targets (throughput, latency, memory, GR activity against batch), how each target's
//! throughput follows its share of the SMs, each target against the baseline, energy where measured.
//!
//! The report is built as sections of blocks (paragraphs, tables, charts), then written as one
//! self-contained HTML page (inline SVG and CSS, no script, no network) or as Markdown with the SVGs in
//! a folder beside it. Nothing in it depends on when or where it was made: the same folders give the
//! same bytes.

mod capacity;
pub mod chart;
pub mod data;
pub mod page;
mod sections;
mod serving;

use std::path::{Path, PathBuf};

use anyhow::Result;

pub use page::{html, markdown, Block, Section};

/// How `report` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Html,
    Md,
}

/// Every section of the report: those of the runs, then those of served load and plans. A target's
/// colour is the same in both.
pub fn build(
    rows: &[data::Row],
    serving: &capacity::Serving,
    generation: &serving::Generation,
    detail: &data::Detail,
    sources: &[String],
    detail_batch: Option<usize>,
) -> Result<Vec<Section>> {
    // Targets that only served load get colours too, after the others of their size.
    let everyone: Vec<data::Row> = rows
        .iter()
        .chain(&serving.steps)
        .chain(&generation.steps)
        .cloned()
        .collect();
    let targets = data::targets(&everyone);
    let colour = |t: &str| targets.iter().position(|x| x == t).unwrap_or(0);
    let mut out = sections::of_runs(rows, &everyone, &targets, &colour, detail, sources, detail_batch)?;
    out.extend(generation.sections(&colour)?);
    out.extend(serving.sections(&colour)?);
    Ok(out)
}

/// Writes the report of `dirs` to `out` (and, for Markdown, its SVGs to `<out stem>_files/`). The
/// latency distributions and time series are of each target's largest batch, or of `detail_batch`.
pub fn write(dirs: &[PathBuf], out: &Path, format: Format, detail_batch: Option<usize>) -> Result<()> {
    let rows = data::read(dirs)?;
    let serving = capacity::Serving::read(dirs)?;
    let generation = serving::Generation::read(dirs)?;
    if rows.is_empty() && serving.is_empty() && generation.is_empty() {
        anyhow::bail!(
            "no runs, no load steps and no serving steps in {}",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
    if let Some(b) = detail_batch {
        let batches: std::collections::BTreeSet<i64> =
            rows.iter().filter_map(|r| r.n("batch")).map(|v| v as i64).collect();
        if !batches.contains(&(b as i64)) {
            let listed: Vec<String> = batches.iter().map(i64::to_string).collect();
            anyhow::bail!(
                "--detail-batch {b}: no run has batch {b}; the batches of these runs: {}",
                if listed.is_empty() {
                    "none".to_string()
                } else {
                    listed.join(", ")
                }
            );
        }
    }
    let detail = data::detail(dirs, &sections::detailed_runs(&rows, detail_batch))?;
    let sources: Vec<String> = dirs.iter().map(|d| data::name(d)).collect();
    let sections = build(&rows, &serving, &generation, &detail, &sources, detail_batch)?;
    let text = match format {
        Format::Html => html(&sections),
        Format::Md => {
            let stem = out.file_stem().and_then(|s| s.to_str()).unwrap_or("report");
            let folder = out.with_file_name(format!("{stem}_files"));
            for s in &sections {
                for b in &s.blocks {
                    if let Block::Chart { name, svg, .. } = b {
                        crate::files::write_atomically(&folder.join(name), svg.as_bytes())?;
                    }
                }
            }
            markdown(&sections, &format!("{stem}_files"))
        }
    };
    // Whole or not at all: a full disk leaves the report that was there, not half a page.
    crate::files::write_atomically(out, text.as_bytes())
}
