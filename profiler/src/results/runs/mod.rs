//! The `runs`, `samples` and `metrics` tables: a run's row (its columns one table,
//! [`columns::RUNS`]), its measured iterations and its sampler readings, and the row of a cell that
//! left no measurement. A run's samples and metrics are written before its row.

use std::path::{Path, PathBuf};

use anyhow::Result;
use polars::prelude::*;

use crate::results::parts::{conform, write_part, Table};
use crate::run::record::Failure;
use crate::run::Run;

mod columns;
mod identity;
mod readings;
#[cfg(test)]
mod tests;

pub(crate) use identity::{cell_columns, device_columns, fingerprint_columns};
use readings::{metrics_frame, samples_frame};

/// Where one run's parts were written.
#[derive(Debug, Clone)]
pub struct Written {
    pub runs: PathBuf,
    pub samples: PathBuf,
    /// `None` for a run without sampler readings.
    pub metrics: Option<PathBuf>,
}

/// Writes the run's samples and metrics, then its row: a `runs` row is only ever present with them.
pub fn write_run(out: &Path, run: &Run) -> Result<Written> {
    let file = format!("part-{}.parquet", run.run_id);
    let samples = write_part(&out.join(Table::Samples.dir_name()), &file, &mut samples_frame(run)?)?;
    let metrics = if run.metrics.is_empty() {
        None
    } else {
        Some(write_part(
            &out.join(Table::Metrics.dir_name()),
            &file,
            &mut metrics_frame(run)?,
        )?)
    };
    let runs = write_part(
        &out.join(Table::Runs.dir_name()),
        &file,
        &mut runs_frame(std::slice::from_ref(run))?,
    )?;
    Ok(Written { runs, samples, metrics })
}

/// The `runs` table: one row per run.
pub fn runs_frame(runs: &[Run]) -> Result<DataFrame> {
    let mut columns = Vec::new();
    for entry in columns::RUNS {
        columns.extend(entry.of_runs(runs)?);
    }
    Ok(DataFrame::new(runs.len(), columns)?)
}

/// The columns of the `runs` table and their types: what a row of a run has. A failed cell's row has
/// them all too, null where nothing was measured.
pub fn runs_schema() -> Result<Schema> {
    Ok(runs_frame(&[])?.schema().as_ref().clone())
}

/// Writes the row of a cell that left no measurement: its identity, status and error; every
/// measurement column is null.
pub fn write_failure(out: &Path, failure: &Failure) -> Result<PathBuf> {
    let columns: Vec<Column> = columns::RUNS.iter().flat_map(|e| e.of_failure(failure)).collect();
    let mut df = conform(&DataFrame::new(1, columns)?, &runs_schema()?)?;
    write_part(
        &out.join(Table::Runs.dir_name()),
        &format!("part-{}.parquet", failure.run_id),
        &mut df,
    )
}
