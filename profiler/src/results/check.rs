//! `migprof check DIR`: every part of a results folder read and checked against the others, each
//! problem named with its file, so a folder that a crash, a copy or another tool touched can be
//! trusted again, or its bad parts moved aside.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Result};
use polars::prelude::*;

use crate::results::parts::{conform, part_paths, read_part, read_parts, union_schema, write_part, Table, TABLES};
use crate::results::runs::runs_schema;
use crate::run::record::Status;

/// A samples or metrics part with no row in `runs` is left alone this long: its run may be writing
/// its row right now (the row comes after its parts).
const ORPHAN_AGE: Duration = Duration::from_secs(60);

/// What the check found: a line per problem, and how much it read.
#[derive(Debug, Default)]
pub struct Report {
    pub problems: Vec<String>,
    pub rows: HashMap<&'static str, usize>,
}

/// Refuses a folder that holds none of a results folder's tables or plans: checking it would only
/// say "no problems" of a folder migprof never wrote, and `--fix` must not touch one.
fn ensure_results_folder(out: &Path) -> Result<()> {
    let mut expected: Vec<&str> = TABLES.iter().map(|t| t.dir_name()).collect();
    expected.push("plans");
    if !out.is_dir() {
        bail!("{}: no such results folder", out.display());
    }
    if !expected.iter().any(|d| out.join(d).is_dir()) {
        bail!(
            "{} is not a migprof results folder: it holds none of {}/ (give the folder that --out of run, load or sweep wrote)",
            out.display(),
            expected.join("/, ")
        );
    }
    Ok(())
}

pub fn check(out: &Path) -> Result<Report> {
    ensure_results_folder(out)?;
    let mut report = Report::default();
    let mut frames = HashMap::new();
    for table in TABLES {
        for (path, missing) in narrow_parts(out, table)? {
            report.problems.push(format!(
                "{}: {missing} of the table's columns missing (written by an older migprof); `migprof check --fix` rewrites it with nulls there",
                path.display()
            ));
        }
        let (frame, skipped) = read_parts(out, table)?;
        for (path, why) in skipped {
            report.problems.push(format!("{}: {why}", path.display()));
        }
        report.rows.insert(table.dir_name(), frame.height());
        frames.insert(table.dir_name(), frame);
    }
    check_steps(&frames, &LOAD_STEPS, &mut report);
    check_steps(&frames, &SERVE_STEPS, &mut report);
    for orphan in orphans(out)? {
        report.problems.push(orphan.problem());
    }
    check_runs(&frames, &mut report);
    Ok(report)
}

/// Each run's row: one per run, a known status, and as many samples as it measured (steps and
/// a generation's prefills counted apart); then runs measured at once on one device.
fn check_runs(frames: &HashMap<&str, DataFrame>, report: &mut Report) {
    let runs = &frames["runs"];
    let run_ids = text(runs, "run_id");
    let statuses = text(runs, "status");
    let iterations = ints(runs, "iterations");
    let generations = ints(runs, "generations");
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
    // Steps and a generation's prefills counted apart (`phase`; parts without it hold steps).
    let mut samples_per_run: HashMap<String, i64> = HashMap::new();
    let mut prefills_per_run: HashMap<String, i64> = HashMap::new();
    let phases = text(&frames["samples"], "phase");
    for (id, phase) in text(&frames["samples"], "run_id").into_iter().zip(phases) {
        let Some(id) = id else { continue };
        let count = match phase.as_deref() {
            Some("prefill") => &mut prefills_per_run,
            _ => &mut samples_per_run,
        };
        *count.entry(id).or_default() += 1;
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
                let prefills = prefills_per_run.get(id).copied().unwrap_or(0);
                if prefills != generations[i].unwrap_or(0) {
                    report.problems.push(format!(
                        "run {id}: {prefills} prefill samples for {:?} generations",
                        generations[i]
                    ));
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
    overlapping_measurements(runs, report);
}

/// A detail table's rows that belong to rows of another table (a run's samples and metrics, a load
/// step's batches, a serving step's requests and iterations), by the id they share.
struct Detail {
    table: Table,
    id: &'static str,
    parent: Table,
    /// What the rows are and whose, for messages: "samples of run".
    what: &'static str,
}

const DETAILS: [Detail; 5] = [
    Detail {
        table: Table::Samples,
        id: "run_id",
        parent: Table::Runs,
        what: "samples of run",
    },
    Detail {
        table: Table::Metrics,
        id: "run_id",
        parent: Table::Runs,
        what: "metrics of run",
    },
    Detail {
        table: Table::LoadBatches,
        id: "load_id",
        parent: Table::Load,
        what: "batches of load step",
    },
    Detail {
        table: Table::ServeRequests,
        id: "serve_id",
        parent: Table::Serve,
        what: "requests of serving step",
    },
    Detail {
        table: Table::ServeIterations,
        id: "serve_id",
        parent: Table::Serve,
        what: "iterations of serving step",
    },
];

/// A part of a detail table with rows of ids that have no row in the parent table: what a run or a
/// step left when it was cut off before its row was written.
struct Orphan {
    path: PathBuf,
    detail: &'static Detail,
    /// The ids without a row, in order.
    ids: Vec<String>,
    /// Every row of the part is an orphan's (else the part also holds rows of ids that have one).
    whole: bool,
    /// Written at least [`ORPHAN_AGE`] ago: its row is not still coming.
    old: bool,
    /// Parts of the parent table that could not be read: the row may be in one of them.
    parents_unread: usize,
}

impl Orphan {
    /// Whether `check --fix` removes the part: the part is all orphans', and old.
    fn removable(&self) -> bool {
        self.whole && self.old && self.parents_unread == 0
    }

    fn problem(&self) -> String {
        let fate = match (self.whole, self.old) {
            _ if self.parents_unread > 0 => format!(
                "`migprof check --fix` leaves this part while {} part(s) of {}/ cannot be read (its row may be in one)",
                self.parents_unread,
                self.detail.parent.dir_name()
            ),
            (true, true) => "`migprof check --fix` removes this part".to_string(),
            (true, false) => format!(
                "written less than {} s ago, so its row may still be coming: `migprof check --fix` removes it only once it is older",
                ORPHAN_AGE.as_secs()
            ),
            (false, _) => format!(
                "`migprof check --fix` leaves this part, which also holds rows of {} rows that exist",
                self.detail.parent.dir_name()
            ),
        };
        format!(
            "{}: {} {} with no row in {}/ (cut off before its row was written); {fate}",
            self.path.display(),
            self.detail.what,
            self.ids.join(", "),
            self.detail.parent.dir_name()
        )
    }
}

/// Every detail part with rows whose id has no row in its parent table. `check` reports each and
/// `fix` removes exactly the [`Orphan::removable`] ones, so `--fix` removes nothing unreported.
fn orphans(out: &Path) -> Result<Vec<Orphan>> {
    let mut found = Vec::new();
    for detail in &DETAILS {
        let (parents, unread) = read_parts(out, detail.parent)?;
        let with_rows: HashSet<String> = text(&parents, detail.id).into_iter().flatten().collect();
        for path in part_paths(out, detail.table)? {
            let Ok(df) = read_part(&path, detail.table) else {
                continue;
            };
            let ids: Vec<String> = text(&df, detail.id).into_iter().flatten().collect();
            let mut without: Vec<String> = ids.iter().filter(|id| !with_rows.contains(*id)).cloned().collect();
            if without.is_empty() {
                continue;
            }
            let whole = without.len() == ids.len();
            without.sort();
            without.dedup();
            let old = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .is_ok_and(|t| SystemTime::now().duration_since(t).unwrap_or_default() >= ORPHAN_AGE);
            found.push(Orphan {
                path,
                detail,
                ids: without,
                whole,
                old,
                parents_unread: unread.len(),
            });
        }
    }
    Ok(found)
}

/// Runs on one device (a MIG slice, else a GPU, else the host's CPU) whose measured phases overlap in
/// time: two measurements that shared the device, each slower than alone. Members of a concurrent
/// group overlap on purpose and are left out.
/// A measured window: its start and end (µs), its run's id, and its program run's start where it is
/// a row of one.
type Span = (i64, i64, String, Option<i64>);

fn overlapping_measurements(runs: &DataFrame, report: &mut Report) {
    let measured_s =
        crate::results::parts::number_column(runs, "measured_s").unwrap_or_else(|_| vec![None; runs.height()]);
    let finished = ints(runs, "finished_at");
    let (ids, hosts, groups) = (
        text(runs, "run_id"),
        text(runs, "host"),
        text(runs, "concurrency_group"),
    );
    let (mig, gpu, name) = (
        text(runs, "mig_uuid"),
        text(runs, "gpu_uuid"),
        text(runs, "device_name"),
    );
    // The rows of one program's run (`migprof exec`: one per phase and size, its steps interleaved)
    // are one measurement: they share their program run's start.
    let (started, family) = (ints(runs, "started_at"), text(runs, "family"));
    let one_program_run = |i: usize| {
        (family[i].as_deref() == Some(crate::run::subject::PROGRAM_FAMILY))
            .then_some(started[i])
            .flatten()
    };
    let mut by_device: HashMap<String, Vec<Span>> = HashMap::new();
    for i in 0..runs.height() {
        let (Some(end), Some(secs), Some(id)) = (finished[i], measured_s[i], &ids[i]) else {
            continue;
        };
        if groups[i].is_some() {
            continue;
        }
        let device = mig[i]
            .clone()
            .or_else(|| gpu[i].clone())
            .or_else(|| name[i].clone())
            .unwrap_or_default();
        let key = format!("{} on {}", device, hosts[i].clone().unwrap_or_default());
        by_device
            .entry(key)
            .or_default()
            .push((end - (secs * 1e6) as i64, end, id.clone(), one_program_run(i)));
    }
    for (device, mut spans) in by_device {
        spans.sort();
        for pair in spans.windows(2) {
            let ((_, end, a, run_a), (start, _, b, run_b)) = (&pair[0], &pair[1]);
            if start < end && !(run_a.is_some() && run_a == run_b) {
                report.problems.push(format!(
                    "runs {a} and {b}: measured at the same time on {device} ({:.1} s together): each shared the device",
                    (end - start) as f64 / 1e6
                ));
            }
        }
    }
}

/// What `check --fix` changed.
#[derive(Debug, Default)]
pub struct Fixed {
    /// Parts rewritten with every column of their table.
    pub widened: Vec<PathBuf>,
    /// Detail parts (samples, metrics, a step's batches, requests, iterations) of runs and steps
    /// that have no row, removed, each with what it held.
    pub removed: Vec<(PathBuf, String)>,
}

/// Rewrites each part that lacks some of its table's columns with all of them (nulls where it had
/// none; its rows and their schema version as they were), and removes the detail parts whose every
/// row belongs to a run or step without a row and that are older than [`ORPHAN_AGE`] (those `check`
/// reports as removable). Parts it cannot read, and parts filed under another table's folder, stay
/// as they are: a part is only ever rewritten with its own table's columns.
pub fn fix(out: &Path) -> Result<Fixed> {
    ensure_results_folder(out)?;
    let mut fixed = Fixed::default();
    for table in TABLES {
        let schema = target_schema(out, table)?;
        for path in part_paths(out, table)? {
            let Ok(df) = read_part(&path, table) else { continue };
            if df.width() == schema.len() {
                continue;
            }
            let mut wide = conform(&df, &schema)?;
            let (dir, name) = (
                path.parent().expect("a part's folder"),
                path.file_name().expect("a part's name"),
            );
            write_part(dir, &name.to_string_lossy(), &mut wide)?;
            fixed.widened.push(path);
        }
    }
    for orphan in orphans(out)?.into_iter().filter(Orphan::removable) {
        std::fs::remove_file(&orphan.path).map_err(|e| crate::files::io_error(e, &orphan.path))?;
        let held = format!("{} {}", orphan.detail.what, orphan.ids.join(", "));
        fixed.removed.push((orphan.path, held));
    }
    Ok(fixed)
}

/// The columns a table's parts should all have: the current schema of `runs`, and every column any
/// readable part of the folder has.
fn target_schema(out: &Path, table: Table) -> Result<Schema> {
    let current = match table {
        Table::Runs => Some(runs_schema()?),
        _ => None,
    };
    union_schema(out, table, current.as_ref())
}

/// The readable parts of a table that lack some of [`target_schema`]'s columns, with how many.
fn narrow_parts(out: &Path, table: Table) -> Result<Vec<(PathBuf, usize)>> {
    let schema = target_schema(out, table)?;
    let mut narrow = Vec::new();
    for path in part_paths(out, table)? {
        if let Ok(df) = read_part(&path, table) {
            let missing = schema.iter_names().filter(|c| df.column(c.as_str()).is_err()).count();
            if missing > 0 {
                narrow.push((path, missing));
            }
        }
    }
    Ok(narrow)
}

/// A column as whole numbers (a timestamp as its microseconds); all null when the table lacks it.
fn ints(df: &DataFrame, name: &str) -> Vec<Option<i64>> {
    df.column(name)
        .ok()
        .and_then(|c| c.cast(&DataType::Int64).ok())
        .map(|c| c.i64().expect("cast").iter().collect())
        .unwrap_or_else(|| vec![None; df.height()])
}

fn text(df: &DataFrame, name: &str) -> Vec<Option<String>> {
    df.column(name)
        .ok()
        .and_then(|c| c.str().ok().map(|s| s.iter().map(|v| v.map(str::to_string)).collect()))
        .unwrap_or_else(|| vec![None; df.height()])
}

/// The tables of one kind of step: its rows, their id, the detail tables each step has rows in,
/// and the searches over them.
struct StepTables {
    steps: &'static str,
    id: &'static str,
    details: &'static [&'static str],
    searches: &'static str,
    what: &'static str,
}

const LOAD_STEPS: StepTables = StepTables {
    steps: "load",
    id: "load_id",
    details: &["load_batches"],
    searches: "capacity",
    what: "load step",
};

const SERVE_STEPS: StepTables = StepTables {
    steps: "serve",
    id: "serve_id",
    // A step whose every request was refused ran no iteration: its iterations part has no rows.
    details: &["serve_requests"],
    searches: "serve_capacity",
    what: "serving step",
};

/// Each step has its detail rows; each search has as many steps as its row says.
fn check_steps(frames: &HashMap<&'static str, DataFrame>, t: &StepTables, report: &mut Report) {
    let details: Vec<HashSet<String>> = t
        .details
        .iter()
        .map(|d| text(&frames[d], t.id).into_iter().flatten().collect())
        .collect();
    let rows = &frames[t.steps];
    let mut steps_of: HashMap<String, i64> = HashMap::new();
    for (id, capacity) in text(rows, t.id).into_iter().zip(text(rows, "capacity_id")) {
        let Some(id) = id else {
            report.problems.push(format!("a {} row without {}", t.steps, t.id));
            continue;
        };
        for (name, ids) in t.details.iter().zip(&details) {
            if !ids.contains(&id) {
                report.problems.push(format!("{} {id}: no rows in {name}/", t.what));
            }
        }
        if let Some(c) = capacity {
            *steps_of.entry(c).or_default() += 1;
        }
    }
    let searches = &frames[t.searches];
    let steps = ints(searches, "steps");
    for (id, want) in text(searches, "capacity_id").into_iter().zip(steps) {
        let Some(id) = id else { continue };
        let have = steps_of.get(&id).copied().unwrap_or(0);
        if Some(have) != want {
            report.problems.push(format!(
                "capacity search {id}: {have} {} rows for {want:?} in its row",
                t.steps
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
            problems.contains(&format!("samples of run {} with no row in runs/", b.run_id)),
            "{problems}"
        );
        Ok(())
    }

    #[test]
    fn fix_widens_old_narrow_parts_and_removes_old_orphans() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = fake_run(2, 10, Duration::ZERO);
        write_run(dir.path(), &a)?;
        // A failed cell's row as version 4 wrote it: its identity columns only.
        let mut narrow = df!(
            "schema_version" => [4i32],
            "run_id" => ["0000-old-failure"],
            "status" => ["error"],
            "error" => ["bf16 cannot run on cpu"],
            "model" => ["resnet_tiny"],
            "batch" => [2i64]
        )?;
        write_part(&dir.path().join("runs"), "part-0000-old-failure.parquet", &mut narrow)?;
        // Samples of a run whose row was never written: one old, one just written (its row may come).
        let (old, young) = (fake_run(4, 10, Duration::ZERO), fake_run(8, 10, Duration::ZERO));
        for r in [&old, &young] {
            write_run(dir.path(), r)?;
            std::fs::remove_file(dir.path().join(format!("runs/part-{}.parquet", r.run_id)))?;
        }
        let old_samples = dir.path().join(format!("samples/part-{}.parquet", old.run_id));
        std::fs::File::options()
            .write(true)
            .open(&old_samples)?
            .set_modified(SystemTime::now() - ORPHAN_AGE * 2)?;

        let problems = check(dir.path())?.problems.join("\n");
        assert!(
            problems.contains("part-0000-old-failure.parquet: ") && problems.contains("--fix"),
            "{problems}"
        );
        let fixed = fix(dir.path())?;
        assert_eq!(fixed.widened.len(), 1, "{:?}", fixed.widened);
        assert_eq!(
            fixed.removed,
            [(old_samples.clone(), format!("samples of run {}", old.run_id))]
        );
        let after = check(dir.path())?.problems;
        assert_eq!(after.len(), 1, "only the young orphan is left: {after:?}");
        assert!(after[0].contains(&young.run_id), "{after:?}");
        // The widened part has every column of a run's row; its row and version as they were.
        let wide = read_part(&dir.path().join("runs/part-0000-old-failure.parquet"), Table::Runs)
            .map_err(anyhow::Error::msg)?;
        assert_eq!(wide.width(), runs_schema()?.len());
        assert_eq!(wide.column("schema_version")?.i32()?.get(0), Some(4));
        assert_eq!(wide.column("error")?.str()?.get(0), Some("bf16 cannot run on cpu"));
        assert_eq!(wide.column("throughput")?.null_count(), 1);
        assert!(fix(dir.path())?.widened.is_empty(), "a second fix has nothing to do");
        Ok(())
    }

    #[test]
    fn runs_measured_at_once_on_one_device_are_named() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = fake_run(2, 10, Duration::ZERO);
        let mut b = fake_run(4, 10, Duration::ZERO);
        // b's measured phase ends half a second into a's.
        b.finished_at = a.finished_at - chrono::Duration::milliseconds(500);
        b.measurement.elapsed = Duration::from_secs(2);
        let mut a2 = a.clone();
        a2.measurement.elapsed = Duration::from_secs(1);
        write_run(dir.path(), &a2)?;
        write_run(dir.path(), &b)?;
        let problems = check(dir.path())?.problems.join("\n");
        assert!(
            problems.contains("measured at the same time on") && problems.contains(&b.run_id),
            "{problems}"
        );
        // Apart in time, or members of a group: no problem.
        let dir = tempfile::tempdir()?;
        b.finished_at = a.finished_at - chrono::Duration::seconds(5);
        write_run(dir.path(), &a2)?;
        write_run(dir.path(), &b)?;
        assert!(
            check(dir.path())?.problems.is_empty(),
            "{:?}",
            check(dir.path())?.problems
        );
        Ok(())
    }

    #[test]
    fn a_misfiled_part_is_named_as_such_and_never_spread() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // Measured ten seconds apart: no two share the device.
        let runs: Vec<_> = (0..3)
            .map(|i| {
                let mut r = fake_run(2 + i, 10, Duration::ZERO);
                r.finished_at += chrono::Duration::seconds(10 * i as i64);
                r
            })
            .collect();
        for r in &runs {
            write_run(dir.path(), r)?;
        }
        let misfiled = dir.path().join("runs/part-zz-samples.parquet");
        std::fs::copy(
            dir.path().join(format!("samples/part-{}.parquet", runs[0].run_id)),
            &misfiled,
        )?;
        let problems = check(dir.path())?.problems;
        assert_eq!(problems.len(), 1, "only the misfiled part: {problems:?}");
        assert!(
            problems[0].contains("part-zz-samples.parquet: a samples part filed under runs/"),
            "{problems:?}"
        );
        let before: Vec<Vec<u8>> = part_paths(dir.path(), Table::Runs)?
            .iter()
            .map(std::fs::read)
            .collect::<std::io::Result<_>>()?;
        let fixed = fix(dir.path())?;
        assert!(fixed.widened.is_empty() && fixed.removed.is_empty(), "{fixed:?}");
        let after: Vec<Vec<u8>> = part_paths(dir.path(), Table::Runs)?
            .iter()
            .map(std::fs::read)
            .collect::<std::io::Result<_>>()?;
        assert_eq!(before, after, "no part is rewritten, the misfiled one included");
        assert_eq!(crate::results::parts::read_table(dir.path(), Table::Runs)?.height(), 3);
        // A merge leaves it behind, so the merged folder reads whole.
        let merged = tempfile::tempdir()?;
        let m = crate::results::merge::merge(&[dir.path().to_path_buf()], merged.path())?;
        assert!(
            m.left
                .iter()
                .any(|(p, why)| p == &misfiled && why.contains("filed under runs/")),
            "{:?}",
            m.left
        );
        assert!(!merged.path().join("runs/part-zz-samples.parquet").exists());
        assert!(check(merged.path())?.problems.is_empty());
        Ok(())
    }

    #[test]
    fn orphans_are_reported_with_runs_empty_and_for_steps_too() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let a = fake_run(2, 10, Duration::ZERO);
        write_run(dir.path(), &a)?;
        std::fs::remove_file(dir.path().join(format!("runs/part-{}.parquet", a.run_id)))?;
        // A serving step's requests whose step row was never written.
        let mut requests = df!(
            "schema_version" => [crate::results::parts::SCHEMA_VERSION, crate::results::parts::SCHEMA_VERSION],
            "serve_id" => ["step-1", "step-1"],
            "request" => [0i64, 1],
            "arrival_ms" => [0.0, 5.0]
        )?;
        write_part(&dir.path().join("serve_requests"), "part-step-1.parquet", &mut requests)?;
        let problems = check(dir.path())?.problems.join("\n");
        assert!(
            problems.contains(&format!("samples of run {} with no row in runs/", a.run_id)),
            "{problems}"
        );
        assert!(
            problems.contains("requests of serving step step-1 with no row in serve/"),
            "{problems}"
        );
        assert!(problems.contains("its row may still be coming"), "{problems}");
        // Just written: --fix leaves them, as check said.
        assert!(fix(dir.path())?.removed.is_empty());
        for p in [
            dir.path().join(format!("samples/part-{}.parquet", a.run_id)),
            dir.path().join("serve_requests/part-step-1.parquet"),
        ] {
            std::fs::File::options()
                .write(true)
                .open(&p)?
                .set_modified(SystemTime::now() - ORPHAN_AGE * 2)?;
        }
        let problems = check(dir.path())?.problems;
        assert!(
            problems
                .iter()
                .all(|p| p.contains("`migprof check --fix` removes this part")),
            "{problems:?}"
        );
        // A runs part that cannot be read may hold the run's row: its samples stay while it is
        // there; the serving step's requests, whose serve/ reads whole, go.
        let unreadable = dir.path().join("runs/part-unreadable.parquet");
        std::fs::write(&unreadable, b"PAR1 cut short")?;
        let said = check(dir.path())?.problems.join("\n");
        assert!(
            said.contains("leaves this part while 1 part(s) of runs/ cannot be read"),
            "{said}"
        );
        let removed: Vec<PathBuf> = fix(dir.path())?.removed.into_iter().map(|(p, _)| p).collect();
        assert_eq!(removed, [dir.path().join("serve_requests/part-step-1.parquet")]);
        std::fs::remove_file(&unreadable)?;
        let removed = fix(dir.path())?.removed;
        assert_eq!(
            removed.len() + 1,
            problems.len(),
            "fix removes exactly what check reported: {removed:?}"
        );
        assert!(check(dir.path())?.problems.is_empty());
        Ok(())
    }

    #[test]
    fn a_folder_that_is_no_results_folder_is_refused_and_left_alone() -> Result<()> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("notes.txt"), b"mine")?;
        for e in [check(dir.path()).unwrap_err(), fix(dir.path()).unwrap_err()] {
            let e = e.to_string();
            assert!(
                e.contains("is not a migprof results folder") && e.contains("runs/"),
                "{e}"
            );
        }
        assert_eq!(std::fs::read(dir.path().join("notes.txt"))?, b"mine");
        let e = check(&dir.path().join("absent")).unwrap_err().to_string();
        assert!(e.contains("no such results folder"), "{e}");
        Ok(())
    }
}
