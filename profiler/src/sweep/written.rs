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
pub(super) fn done_as_planned(out: &Path, cell: &CellSpec, retry_oom: bool) -> Result<bool> {
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
