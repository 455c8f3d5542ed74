//! The part store under every table: a table is a folder of Parquet part files, each written whole
//! through a temporary file and a rename, so that a crash or a later bad write never loses what was
//! already there; a reader loads every part of a folder as one table.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use anyhow::Result;
use polars::prelude::*;

/// Bumped whenever a column is added or changes meaning or type; readers concatenate parts of every
/// version (2: `kernel_options`; `sweep`, `target`, `cell_id`, `status`, `error`. 3: `verdict_flags`,
/// `throttle_share`, `power_cap_share`, `other_processes`; the verdicts `throttled` and `shared`;
/// metrics' `compute_processes`; `device_kind` `mps` with `emulation`, `emulated_profile`,
/// `mps_share_pct`, `profile_sms`, `measured_sms`, `mps_memory_limit_mib`, `measured_memory_mib`;
/// `concurrency_group`, `neighbours`, `baseline`. 4: the `load`, `load_batches` and `capacity` tables.
/// 5: every row of a table has every column of it, a failed cell's row included, with nulls where
/// nothing was measured; before, a failed cell's `runs` row had only its identity columns).
pub const SCHEMA_VERSION: i32 = 16;

/// Every table, in the order a folder is read.
pub const TABLES: [Table; 10] = [
    Table::Runs,
    Table::Samples,
    Table::Metrics,
    Table::Load,
    Table::LoadBatches,
    Table::Capacity,
    Table::Serve,
    Table::ServeRequests,
    Table::ServeIterations,
    Table::ServeCapacity,
];

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
    /// One row per step of a language model's serving load (an offered rate): TTFT, TPOT, ITL and
    /// E2E percentiles, rates, goodput, the KV cache's occupancy, preemptions.
    Serve,
    /// One row per request of a serving step: its lengths and what it saw.
    ServeRequests,
    /// One row per iteration of a serving step's continuous batcher: the KV cache over time.
    ServeIterations,
    /// One row per serving search: the highest rate within both objectives.
    ServeCapacity,
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
            Table::Serve => "serve",
            Table::ServeRequests => "serve_requests",
            Table::ServeIterations => "serve_iterations",
            Table::ServeCapacity => "serve_capacity",
        }
    }

    /// Columns that every part of this table has had since it was first written and that no other
    /// table's parts have all of: they tell a part filed in the wrong folder from an old one.
    fn marks(self) -> &'static [&'static str] {
        match self {
            Table::Runs => &["run_id", "model"],
            Table::Samples => &["run_id", "latency_ns"],
            Table::Metrics => &["run_id", "t_ms"],
            Table::Load => &["load_id", "offered_qps"],
            Table::LoadBatches => &["load_id", "batch_index"],
            Table::Capacity => &["capacity_id", "capacity_qps", "min_requests"],
            Table::Serve => &["serve_id", "offered_qps"],
            Table::ServeRequests => &["serve_id", "arrival_ms"],
            Table::ServeIterations => &["serve_id", "start_ms"],
            Table::ServeCapacity => &["capacity_id", "capacity_qps", "max_steps"],
        }
    }

    /// The table whose parts have `df`'s columns, by their marks; `None` when no table's are all
    /// there (a part of none, or an old part of one).
    pub fn of_part(df: &DataFrame) -> Option<Table> {
        TABLES
            .into_iter()
            .find(|t| t.marks().iter().all(|c| df.column(c).is_ok()))
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
    let parts = part_paths(out, table)?;
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

/// The part files of a table under `out`, in name order (oldest first): `*.parquet`, not hidden (a
/// temporary file starts with a dot; pyarrow skips those too). None when the folder is missing.
pub fn part_paths(out: &Path, table: Table) -> Result<Vec<PathBuf>> {
    let dir = out.join(table.dir_name());
    let mut parts: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                !name.starts_with('.') && name.ends_with(".parquet")
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(crate::files::io_error(e, &dir)),
    };
    parts.sort();
    Ok(parts)
}

/// One part, or why it is not one of ours.
pub fn read_part(path: &Path, table: Table) -> std::result::Result<DataFrame, String> {
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
        Table::Capacity | Table::ServeCapacity => &["schema_version", "capacity_id"],
        Table::Serve | Table::ServeRequests | Table::ServeIterations => &["schema_version", "serve_id"],
    };
    if let Some(other) = Table::of_part(&df).filter(|&t| t != table) {
        return Err(format!(
            "a {} part filed under {}/ (it has the columns of {}/, not those of {}/): move it to {}/",
            other.dir_name(),
            table.dir_name(),
            other.dir_name(),
            table.dir_name(),
            other.dir_name()
        ));
    }
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
    if table == Table::Runs && df.column("master_weights").is_err() {
        return with_master_weights_of_old_rows(df).map_err(|e| format!("reading it: {e}"));
    }
    Ok(df)
}

/// A runs part written before training kept f32 master weights (schema version 5 and older): its
/// bf16 and f16 training trained the weights themselves, which the column says as `none`.
fn with_master_weights_of_old_rows(mut df: DataFrame) -> Result<DataFrame> {
    let modes = text_column(&df, "mode")?;
    let dtypes = text_column(&df, "dtype")?;
    let values: Vec<Option<&str>> = modes
        .iter()
        .zip(&dtypes)
        .map(|(m, d)| (m.as_deref() == Some("train") && matches!(d.as_deref(), Some("bf16" | "f16"))).then_some("none"))
        .collect();
    df.with_column(Column::new("master_weights".into(), values))?;
    Ok(df)
}

/// Writes `df` as `dir/name`, whole or not at all (`files::write_atomically`). The Parquet file is
/// made in memory first, so that a full disk or a vanished folder is said as itself, with the path,
/// rather than as an error of the Parquet encoder.
pub(crate) fn write_part(dir: &Path, name: &str, df: &mut DataFrame) -> Result<PathBuf> {
    let path = dir.join(name);
    let mut bytes = Vec::new();
    ParquetWriter::new(&mut bytes)
        .finish(df)
        .map_err(|e| anyhow::anyhow!("encoding {} as Parquet: {e}", path.display()))?;
    crate::files::write_atomically(&path, &bytes)?;
    Ok(path)
}

/// `df` with exactly `schema`'s columns, in its order: a column `df` lacks as nulls of that column's
/// type, each it has cast to it. A column the schema lacks is an error: the writer and the table's
/// schema disagree.
pub fn conform(df: &DataFrame, schema: &Schema) -> Result<DataFrame> {
    if let Some(extra) = df
        .get_column_names()
        .into_iter()
        .find(|c| schema.get(c.as_str()).is_none())
    {
        anyhow::bail!("column `{extra}` is not in the table's schema");
    }
    let columns = schema
        .iter()
        .map(|(name, dtype)| match df.column(name.as_str()) {
            // A cast to the type a column has already is skipped: polars' drops a datetime's zone.
            Ok(c) if c.dtype() == dtype => Ok(c.clone()),
            Ok(c) => c
                .cast(dtype)
                .map_err(|e| anyhow::anyhow!("column `{name}` as {dtype}: {e}")),
            Err(_) => Ok(Column::full_null(name.clone(), df.height(), dtype)),
        })
        .collect::<Result<Vec<Column>>>()?;
    Ok(DataFrame::new(df.height(), columns)?)
}

/// The columns and types of every part of a table under `out`, in the order first met; the parts it
/// could not read are left out, as [`read_parts`] leaves them.
pub fn union_schema(out: &Path, table: Table, first: Option<&Schema>) -> Result<Schema> {
    let mut union = first.cloned().unwrap_or_default();
    for path in part_paths(out, table)? {
        if let Ok(df) = read_part(&path, table) {
            for (name, dtype) in df.schema().iter() {
                if union.get(name.as_str()).is_none() && !matches!(dtype, DataType::Null) {
                    union.insert(name.clone(), dtype.clone());
                }
            }
        }
    }
    Ok(union)
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
