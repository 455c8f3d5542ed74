//! The part store under every table: a table is a folder of Parquet part files, each written whole
//! through a temporary file and a rename, so that a crash or a later bad write never loses what was
//! already there; a reader loads every part of a folder as one table.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use polars::prelude::*;

/// Bumped whenever a column is added or changes meaning or type; readers concatenate parts of every
/// version (2: `kernel_options`; `sweep`, `target`, `cell_id`, `status`, `error`. 3: `verdict_flags`,
/// `throttle_share`, `power_cap_share`, `other_processes`; the verdicts `throttled` and `shared`;
/// metrics' `compute_processes`; `device_kind` `mps` with `emulation`, `emulated_profile`,
/// `mps_share_pct`, `profile_sms`, `measured_sms`, `mps_memory_limit_mib`, `measured_memory_mib`;
/// `concurrency_group`, `neighbours`, `baseline`. 4: the `load`, `load_batches` and `capacity` tables).
pub const SCHEMA_VERSION: i32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// One row per run: identity, latency statistics, throughputs, verdict, histogram.
    Runs,
    /// One row per measured iteration: run_id, iteration, latency_ns.
    Samples,
    /// One row per sampler reading of a GPU run: memory of the device or slice; power, energy,
    /// clocks, temperature and throttle reasons of the whole GPU (`gpu_` columns); GPM activity.
    Metrics,
    /// One row per load step (an offered rate): latency percentiles from the scheduled arrivals,
    /// achieved rate, batch sizes, queue, whether the p99 met the objective.
    Load,
    /// One row per batch a load step's batcher handed out: when, how many, how many were waiting.
    LoadBatches,
    /// One row per capacity search: the highest rate within the p99 objective.
    Capacity,
}

impl Table {
    pub fn dir_name(self) -> &'static str {
        match self {
            Table::Runs => "runs",
            Table::Samples => "samples",
            Table::Metrics => "metrics",
            Table::Load => "load",
            Table::LoadBatches => "load_batches",
            Table::Capacity => "capacity",
        }
    }
}

/// Every part of a table under `out`, oldest part first, as one frame; empty when there is none.
/// Parts written by other schema versions are combined by column name, missing columns as nulls. A
/// part that cannot be read, or that is no migprof part, is skipped with a warning naming it: the
/// rest of the folder still reads (`migprof check` lists every problem).
pub fn read_table(out: &Path, table: Table) -> Result<DataFrame> {
    let (frame, skipped) = read_parts(out, table)?;
    for (path, why) in &skipped {
        eprintln!("warning: skipping {}: {why}", path.display());
    }
    Ok(frame)
}

/// What [`read_table`] reads, and the parts it skipped with why.
pub fn read_parts(out: &Path, table: Table) -> Result<(DataFrame, Vec<(PathBuf, String)>)> {
    let dir = out.join(table.dir_name());
    let mut parts: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                // Temporary files start with a dot; pyarrow skips those too.
                !name.starts_with('.') && name.ends_with(".parquet")
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((DataFrame::default(), Vec::new())),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    parts.sort();
    let mut frames = Vec::new();
    let mut skipped = Vec::new();
    for p in parts {
        match read_part(&p, table) {
            Ok(df) => frames.push(df),
            Err(why) => skipped.push((p, why)),
        }
    }
    let frame = match frames.len() {
        0 => DataFrame::default(),
        1 => frames.into_iter().next().expect("one frame"),
        _ => polars::functions::concat_df_diagonal(&frames)?,
    };
    Ok((frame, skipped))
}

/// One part, or why it is not one of ours.
fn read_part(path: &Path, table: Table) -> std::result::Result<DataFrame, String> {
    let f = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let df = ParquetReader::new(f)
        .finish()
        .map_err(|e| format!("not a readable Parquet file: {e}"))?;
    // Samples and metrics parts gained schema_version later than runs parts: run_id marks them all.
    let required: &[&str] = match table {
        Table::Runs => &["schema_version", "run_id"],
        Table::Samples | Table::Metrics => &["run_id"],
        Table::Load => &["schema_version", "load_id"],
        Table::LoadBatches => &["load_id"],
        Table::Capacity => &["schema_version", "capacity_id"],
    };
    let missing: Vec<&str> = required.iter().copied().filter(|c| df.column(c).is_err()).collect();
    if !missing.is_empty() {
        return Err(format!(
            "not a migprof {} part (no {} column)",
            table.dir_name(),
            missing.join(", ")
        ));
    }
    if let Ok(v) = df.column("schema_version").and_then(|c| c.cast(&DataType::Int32)) {
        if v.i32()
            .map(|v| v.iter().flatten().any(|v| v > SCHEMA_VERSION))
            .unwrap_or(false)
        {
            return Err(format!(
                "written by a newer migprof (schema version above {SCHEMA_VERSION})"
            ));
        }
    }
    Ok(df)
}

/// Writes `df` as `dir/name` atomically: a hidden temporary file in the same folder, flushed to
/// disk, then renamed over the final name.
pub(crate) fn write_part(dir: &Path, name: &str, df: &mut DataFrame) -> Result<PathBuf> {
    fs::create_dir_all(dir).with_context(|| format!("creating the results folder {}", dir.display()))?;
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let path = dir.join(name);
    let result = (|| -> Result<()> {
        let mut f = File::create(&tmp)?;
        ParquetWriter::new(&mut f).finish(df)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e.context(format!("writing {}", path.display())));
    }
    Ok(path)
}

pub(crate) fn col<T, Phantom: ?Sized>(name: &str, values: T) -> Column
where
    Series: NamedFrom<T, Phantom>,
{
    Column::new(name.into(), values)
}

pub(crate) fn utc_micros(name: &str, values: Vec<i64>) -> Column {
    Int64Chunked::from_vec(name.into(), values)
        .into_datetime(TimeUnit::Microseconds, Some(TimeZone::UTC))
        .into_series()
        .into_column()
}

/// A column as strings; all null when the table lacks it (an older schema).
pub fn text_column(df: &DataFrame, name: &str) -> Result<Vec<Option<String>>> {
    match df.column(name) {
        Ok(c) => {
            let strings = anyhow::Context::with_context(c.cast(&DataType::String), || format!("reading {name}"))?;
            Ok(strings.str()?.iter().map(|v| v.map(str::to_string)).collect())
        }
        Err(_) => Ok(vec![None; df.height()]),
    }
}

/// A column as numbers; all null when the table lacks it.
pub fn number_column(df: &DataFrame, name: &str) -> Result<Vec<Option<f64>>> {
    match df.column(name) {
        Ok(c) => Ok(c.cast(&DataType::Float64)?.f64()?.iter().collect()),
        Err(_) => Ok(vec![None; df.height()]),
    }
}
