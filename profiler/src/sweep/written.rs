//! What a results folder already holds for a sweep: the latest row of each cell, and whether a cell
//! is done as planned (a row with status `ok`, or `oom` unless asked to try again, measured with the
//! settings planned now).

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;

use crate::cell::CellSpec;
use crate::results::parts::{read_table, text_column, Table};
use crate::run::record::Status;

/// What a row says of its cell.
pub(super) struct CellRow {
    id: String,
    status: String,
    /// The settings it was measured with (`CellSpec::settings`); none in rows written before they were
    /// recorded.
    pub(super) settings: Option<String>,
    pub(super) sweep: Option<String>,
}

impl CellRow {
    /// A cell found done by its rows, as measured with the settings planned now.
    pub(super) fn done(id: String) -> CellRow {
        CellRow {
            id,
            status: Status::Ok.as_str().to_string(),
            settings: None,
            sweep: None,
        }
    }
}

/// Every row's cell id, status, settings and sweep in `runs` (a failed capacity cell's row is there
/// too), in `capacity` and in `serve_capacity` (a search's row), in the order of the parts: oldest
/// first.
pub(super) fn cell_rows(out: &Path) -> Result<Vec<CellRow>> {
    let mut all = Vec::new();
    for table in [Table::Runs, Table::Capacity, Table::ServeCapacity] {
        let rows = read_table(out, table)?;
        if rows.column("cell_id").is_err() || rows.column("status").is_err() {
            continue;
        }
        let (ids, statuses) = (text_column(&rows, "cell_id")?, text_column(&rows, "status")?);
        let settings = text_column(&rows, "cell_settings").unwrap_or_else(|_| vec![None; rows.height()]);
        let sweeps = text_column(&rows, "sweep").unwrap_or_else(|_| vec![None; rows.height()]);
        for (((id, status), settings), sweep) in ids.into_iter().zip(statuses).zip(settings).zip(sweeps) {
            if let (Some(id), Some(status)) = (id, status) {
                all.push(CellRow {
                    id,
                    status,
                    settings,
                    sweep,
                });
            }
        }
    }
    Ok(all)
}

/// The cell ids a results folder holds with a final status, `ok` and `oom` (unless retrying them), each
/// with its latest such row.
pub(super) fn done_cells(out: &Path, retry_oom: bool) -> Result<HashMap<String, CellRow>> {
    Ok(cell_rows(out)?
        .into_iter()
        .filter(|r| match Status::parse(&r.status) {
            Some(Status::Ok | Status::Probe) => true,
            Some(Status::Oom) => !retry_oom,
            _ => false,
        })
        .map(|r| (r.id.clone(), r))
        .collect())
}

/// Whether the folder has a final row of `cell` measured with its settings (or with none recorded).
/// A server's cell writes a row per step: it is done when every step it plans has one (and its
/// search, where it searches, its capacity row).
pub(super) fn done_as_planned(out: &Path, cell: &CellSpec, retry_oom: bool) -> Result<bool> {
    if let Some(job) = cell.job.server() {
        return server_done(out, cell, job);
    }
    Ok(
        match done_cells(out, retry_oom)?
            .get(&cell.cell_id())
            .map(|r| r.settings.as_deref())
        {
            Some(Some(was)) => settings_change(was, &cell.settings()).is_none(),
            Some(None) => true,
            None => false,
        },
    )
}

/// Whether every step of the server's cell has a row measured with its settings.
fn server_done(out: &Path, cell: &CellSpec, job: &crate::cell::spec::ServerJob) -> Result<bool> {
    let id = cell.cell_id();
    let settings = cell.settings();
    if job.search
        && !cell_rows(out)?
            .iter()
            .any(|r| r.id == id && r.status == "ok" && r.settings.as_deref().is_none_or(|s| s == settings))
    {
        return Ok(false);
    }
    // A language model's server's steps are serving steps.
    let table = match job.generation {
        Some(_) => Table::Serve,
        None => Table::Load,
    };
    let rows = read_table(out, table)?;
    if rows.column("cell_id").is_err() || rows.column("concurrency").is_err() {
        return Ok(job.server.concurrency.is_empty() && job.rates.is_empty());
    }
    let ids = text_column(&rows, "cell_id")?;
    let written_with = text_column(&rows, "cell_settings")?;
    let searched = text_column(&rows, "capacity_id")?;
    let concurrency = crate::results::parts::number_column(&rows, "concurrency")?;
    let offered = crate::results::parts::number_column(&rows, "offered_qps")?;
    let ours = |i: usize| {
        ids[i].as_deref() == Some(id.as_str())
            && searched[i].is_none()
            && written_with[i].as_deref().is_none_or(|s| s == settings)
    };
    let has_concurrency = |n: usize| (0..rows.height()).any(|i| ours(i) && concurrency[i] == Some(n as f64));
    let has_rate =
        |qps: f64| (0..rows.height()).any(|i| ours(i) && concurrency[i].is_none() && offered[i] == Some(qps));
    Ok(job.server.concurrency.iter().all(|&n| has_concurrency(n)) && job.rates.iter().all(|&q| has_rate(q)))
}

/// What differs between the settings a cell's row was measured with and the file's now, or `None`.
pub(super) fn settings_change(was: &str, now: &str) -> Option<String> {
    let pairs = |s: &str| -> Vec<(String, String)> {
        s.split(';')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let (was, now) = (pairs(was), pairs(now));
    let changed: Vec<String> = now
        .iter()
        .filter_map(|(k, v)| match was.iter().find(|(wk, _)| wk == k) {
            Some((_, wv)) if wv == v => None,
            Some((_, wv)) => Some(format!("{k} {wv} → {v}")),
            None => Some(format!("{k} → {v}")),
        })
        .collect();
    (!changed.is_empty()).then(|| changed.join(", "))
}

/// The status of each cell id's latest row.
pub fn row_statuses(out: &Path) -> Result<HashMap<String, String>> {
    // Later rows replace earlier ones as they are collected.
    Ok(cell_rows(out)?.into_iter().map(|r| (r.id, r.status)).collect())
}
