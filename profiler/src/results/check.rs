//! `migprof check DIR`: every part of a results folder read and checked against the others, each
//! problem named with its file, so a folder that a crash, a copy or another tool touched can be
//! trusted again, or its bad parts moved aside.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use polars::prelude::*;

use crate::results::parts::{read_parts, Table};
use crate::run::record::Status;

/// What the check found: a line per problem, and how much it read.
#[derive(Debug, Default)]
pub struct Report {
    pub problems: Vec<String>,
    pub rows: HashMap<&'static str, usize>,
}

pub fn check(out: &Path) -> Result<Report> {
    let mut report = Report::default();
    let mut frames = HashMap::new();
    for table in [
        Table::Runs,
        Table::Samples,
        Table::Metrics,
        Table::Load,
        Table::LoadBatches,
        Table::Capacity,
    ] {
        let (frame, skipped) = read_parts(out, table)?;
        for (path, why) in skipped {
            report.problems.push(format!("{}: {why}", path.display()));
        }
        report.rows.insert(table.dir_name(), frame.height());
        frames.insert(table.dir_name(), frame);
    }
    check_load(&frames, &mut report);
    let runs = &frames["runs"];
    if runs.height() == 0 {
        return Ok(report);
    }
    let run_ids = text(runs, "run_id");
    let statuses = text(runs, "status");
    let iterations: Vec<Option<i64>> = runs
        .column("iterations")
        .ok()
        .and_then(|c| c.cast(&DataType::Int64).ok())
        .map(|c| c.i64().expect("cast").iter().collect())
        .unwrap_or_else(|| vec![None; runs.height()]);
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for id in run_ids.iter().flatten() {
        *seen.entry(id).or_default() += 1;
    }
    for (id, n) in &seen {
        if *n > 1 {
            report
                .problems
                .push(format!("run {id}: {n} rows in runs/ (one is expected)"));
        }
    }
    let mut samples_per_run: HashMap<String, i64> = HashMap::new();
    for id in text(&frames["samples"], "run_id").into_iter().flatten() {
        *samples_per_run.entry(id).or_default() += 1;
    }
    for i in 0..runs.height() {
        let Some(id) = &run_ids[i] else {
            report.problems.push(format!("runs row {i}: no run_id"));
            continue;
        };
        // Rows written before the status column existed are measured runs.
        let status = statuses[i].as_deref().unwrap_or("ok");
        match Status::parse(status) {
            None => report.problems.push(format!("run {id}: unknown status `{status}`")),
            Some(Status::Ok | Status::Probe) => {
                let have = samples_per_run.get(id).copied().unwrap_or(0);
                if Some(have) != iterations[i] {
                    report
                        .problems
                        .push(format!("run {id}: {have} samples for {:?} iterations", iterations[i]));
                }
            }
            Some(_) => {
                if iterations[i].is_some() {
                    report
                        .problems
                        .push(format!("run {id}: status {status} with a measurement"));
                }
            }
        }
    }
    for id in samples_per_run.keys() {
        if !seen.contains_key(id.as_str()) {
            report.problems.push(format!(
                "samples of run {id}: no row in runs/ (a run whose row was never written)"
            ));
        }
    }
    Ok(report)
}

fn text(df: &DataFrame, name: &str) -> Vec<Option<String>> {
    df.column(name)
        .ok()
        .and_then(|c| c.str().ok().map(|s| s.iter().map(|v| v.map(str::to_string)).collect()))
        .unwrap_or_else(|| vec![None; df.height()])
}

/// Each load step has its batches; each search has as many steps as its row says.
fn check_load(frames: &HashMap<&'static str, DataFrame>, report: &mut Report) {
    let mut batches: HashMap<String, usize> = HashMap::new();
    for id in text(&frames["load_batches"], "load_id").into_iter().flatten() {
        *batches.entry(id).or_default() += 1;
    }
    let load = &frames["load"];
    let mut steps_of: HashMap<String, i64> = HashMap::new();
    for (id, capacity) in text(load, "load_id").into_iter().zip(text(load, "capacity_id")) {
        let Some(id) = id else {
            report.problems.push("a load row without load_id".into());
            continue;
        };
        if !batches.contains_key(&id) {
            report
                .problems
                .push(format!("load step {id}: no batches in load_batches/"));
        }
        if let Some(c) = capacity {
            *steps_of.entry(c).or_default() += 1;
        }
    }
    let capacity = &frames["capacity"];
    let steps: Vec<Option<i64>> = capacity
        .column("steps")
        .ok()
        .and_then(|c| c.cast(&DataType::Int64).ok())
        .map(|c| c.i64().expect("cast").iter().collect())
        .unwrap_or_else(|| vec![None; capacity.height()]);
    for (id, want) in text(capacity, "capacity_id").into_iter().zip(steps) {
        let Some(id) = id else { continue };
        let have = steps_of.get(&id).copied().unwrap_or(0);
        if Some(have) != want {
            report.problems.push(format!(
                "capacity search {id}: {have} load steps for {want:?} in its row"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::runs::write_run;
    use crate::run::record::tests::fake_run;
    use std::time::Duration;

    #[test]
    fn a_sound_folder_passes_and_each_problem_is_named() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = fake_run(2, 10, Duration::ZERO);
        write_run(dir.path(), &a)?;
        let report = check(dir.path())?;
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert_eq!((report.rows["runs"], report.rows["samples"]), (1, 10));
        // A second copy of the run's row, a corrupt part, and samples whose row is gone.
        std::fs::copy(
            dir.path().join(format!("runs/part-{}.parquet", a.run_id)),
            dir.path().join("runs/part-copy.parquet"),
        )?;
        std::fs::write(dir.path().join("samples/part-junk.parquet"), b"junk")?;
        let b = fake_run(4, 10, Duration::ZERO);
        write_run(dir.path(), &b)?;
        std::fs::remove_file(dir.path().join(format!("runs/part-{}.parquet", b.run_id)))?;
        let problems = check(dir.path())?.problems.join("\n");
        assert!(problems.contains(&format!("run {}: 2 rows", a.run_id)), "{problems}");
        assert!(
            problems.contains("part-junk.parquet: not a readable Parquet file"),
            "{problems}"
        );
        assert!(
            problems.contains(&format!("samples of run {}: no row", b.run_id)),
            "{problems}"
        );
        Ok(())
    }
}
