//! `migprof merge`: results folders written apart (machines, clusters, days) joined into one. Parts
//! are named by their run's id, unique across hosts, so merging is copying: a part already in the
//! merged folder (the same run reached it twice) is copied once. Cells measured in more than one
//! folder keep every row, and are named: the same cell on two machines is two measurements.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use crate::results::parts::{read_part, read_table, text_column, Table, TABLES};

/// What a merge did.
#[derive(Debug, Default)]
pub struct Merged {
    pub copied: usize,
    /// Parts the merged folder had already (the same run from two folders, or a merge run twice).
    pub already: usize,
    /// Cell ids with rows in more than one source folder, and those folders.
    pub cells_in_several: Vec<(String, Vec<String>)>,
    /// Files of the source folders' tables and plans that were not copied, and why: unreadable,
    /// not a migprof part, or not a plan.
    pub left: Vec<(PathBuf, String)>,
}

pub fn merge(dirs: &[PathBuf], out: &Path) -> Result<Merged> {
    // The sources first: a folder that is not there makes no output.
    for d in dirs {
        anyhow::ensure!(d.is_dir(), "{}: no such results folder", d.display());
    }
    crate::files::ensure_writable_dir(out)?;
    let out_real = fs::canonicalize(out).map_err(|e| crate::files::io_error(e, out))?;
    for d in dirs {
        if fs::canonicalize(d).map_err(|e| crate::files::io_error(e, d))? == out_real {
            bail!(
                "{} is both a folder to merge and --out: merge into a new folder",
                d.display()
            );
        }
    }
    let mut m = Merged::default();
    for d in dirs {
        let mut folders: Vec<(PathBuf, PathBuf, Option<Table>)> = TABLES
            .iter()
            .map(|t| (d.join(t.dir_name()), out.join(t.dir_name()), Some(*t)))
            .collect();
        folders.push((d.join("plans"), out.join("plans"), None));
        for (from, to, table) in folders {
            let Ok(entries) = fs::read_dir(&from) else { continue };
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.'))
                .collect();
            names.sort();
            for name in names {
                let source = from.join(&name);
                if let Err(why) = readable(&source, table) {
                    m.left.push((source, why));
                    continue;
                }
                let dest = to.join(&name);
                if dest.exists() {
                    m.already += 1;
                    continue;
                }
                // Through a hidden name and a rename, as every part is written: readers never see half.
                let bytes = fs::read(&source).map_err(|e| crate::files::io_error(e, &source))?;
                crate::files::write_atomically(&dest, &bytes)?;
                m.copied += 1;
            }
        }
    }
    // Which folders each cell has rows in.
    let mut folders_of: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for d in dirs {
        for table in [Table::Runs, Table::Capacity] {
            let df = read_table(d, table)?;
            for id in text_column(&df, "cell_id")?.into_iter().flatten() {
                folders_of.entry(id).or_default().insert(d.display().to_string());
            }
        }
    }
    m.cells_in_several = folders_of
        .into_iter()
        .filter(|(_, f)| f.len() > 1)
        .map(|(c, f)| (c, f.into_iter().collect()))
        .collect();
    Ok(m)
}

/// Whether a file of a table's folder is a part migprof reads (a plan: JSON of a plan), or why not.
fn readable(path: &Path, table: Option<Table>) -> std::result::Result<(), String> {
    match table {
        Some(t) if path.extension().is_some_and(|e| e == "parquet") => read_part(path, t).map(|_| ()),
        Some(_) => Err("not a Parquet part".into()),
        None => {
            let text = fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))?;
            serde_json::from_str::<serde_json::Value>(&text)
                .map(|_| ())
                .map_err(|e| format!("not a plan: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::runs::write_run;
    use crate::run::record::tests;
    use std::time::Duration;

    /// A run of a cell measured on a node of its own: folders to merge come from several machines,
    /// whose runs may well have measured at the same time.
    fn fake_run(batch: usize, iters: u64, tick: Duration) -> crate::run::Run {
        let mut run = tests::fake_run(batch, iters, tick);
        run.context.host = format!("node-{}", run.run_id);
        run
    }

    #[test]
    fn every_part_once_and_cells_in_two_folders_named() -> Result<()> {
        let (a, b, out) = (tempfile::tempdir()?, tempfile::tempdir()?, tempfile::tempdir()?);
        let shared = fake_run(2, 10, Duration::ZERO);
        // The same run in both folders (copied by hand), and another run of the same cell in b.
        write_run(a.path(), &shared)?;
        write_run(b.path(), &shared)?;
        write_run(b.path(), &fake_run(2, 12, Duration::ZERO))?;
        write_run(a.path(), &fake_run(4, 10, Duration::ZERO))?;
        let dirs = [a.path().to_path_buf(), b.path().to_path_buf()];
        let m = merge(&dirs, out.path())?;
        assert_eq!(m.already, 2, "the shared run's runs and samples parts");
        assert_eq!(read_table(out.path(), Table::Runs)?.height(), 3);
        assert_eq!(read_table(out.path(), Table::Samples)?.height(), 10 + 12 + 10);
        assert_eq!(m.cells_in_several.len(), 1, "{:?}", m.cells_in_several);
        assert_eq!(m.cells_in_several[0].1.len(), 2);
        assert!(crate::results::check::check(out.path())?.problems.is_empty());
        // Again: nothing new.
        let again = merge(&dirs, out.path())?;
        assert_eq!(again.copied, 0);
        assert!(merge(&[out.path().to_path_buf()], out.path())
            .unwrap_err()
            .to_string()
            .contains("merge into a new folder"));
        Ok(())
    }

    #[test]
    fn only_what_reads_is_copied_and_the_rest_is_named() -> Result<()> {
        let (a, out) = (tempfile::tempdir()?, tempfile::tempdir()?);
        write_run(a.path(), &fake_run(2, 10, Duration::ZERO))?;
        fs::write(a.path().join("runs/part-trunc.parquet"), b"PAR1 cut short")?;
        fs::write(a.path().join("runs/notes.txt"), b"junk")?;
        let mut foreign = polars::df!("x" => [1i64])?;
        polars::prelude::ParquetWriter::new(fs::File::create(a.path().join("samples/part-foreign.parquet"))?)
            .finish(&mut foreign)?;
        let m = merge(&[a.path().to_path_buf()], &out.path().join("merged"))?;
        assert_eq!(m.copied, 2, "the run's row and samples");
        let left: Vec<String> = m
            .left
            .iter()
            .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into())
            .collect();
        assert_eq!(
            left,
            ["notes.txt", "part-trunc.parquet", "part-foreign.parquet"],
            "{:?}",
            m.left
        );
        assert!(m.left[2].1.contains("not a migprof samples part"), "{:?}", m.left);
        let merged: Vec<String> = fs::read_dir(out.path().join("merged/runs"))?
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(merged.len(), 1, "{merged:?}");
        // A source that does not exist is refused, and no output is made.
        let e = merge(&[out.path().join("nothing")], &out.path().join("new"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nothing: no such results folder"), "{e}");
        assert!(!out.path().join("new").exists());
        Ok(())
    }

    #[test]
    fn concurrent_writers_into_one_folder_lose_nothing() -> Result<()> {
        // Many cells ending at once in a shared folder, as a cluster's tasks do.
        let dir = tempfile::tempdir()?;
        std::thread::scope(|s| {
            for i in 0..16 {
                let path = dir.path().to_path_buf();
                s.spawn(move || write_run(&path, &fake_run(1 + i % 4, 10, Duration::ZERO)).unwrap());
            }
        });
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 16);
        assert_eq!(read_table(dir.path(), Table::Samples)?.height(), 160);
        assert!(crate::results::check::check(dir.path())?.problems.is_empty());
        Ok(())
    }
}
