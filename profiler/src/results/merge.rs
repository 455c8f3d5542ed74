//! `migprof merge`: results folders written apart (machines, clusters, days) joined into one. Parts
//! are named by their run's id, unique across hosts, so merging is copying: a part already in the
//! merged folder (the same run reached it twice) is copied once. Cells measured in more than one
//! folder keep every row, and are named: the same cell on two machines is two measurements.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::results::parts::{read_table, text_column, Table};

const TABLES: [Table; 6] = [
    Table::Runs,
    Table::Samples,
    Table::Metrics,
    Table::Load,
    Table::LoadBatches,
    Table::Capacity,
];

/// What a merge did.
#[derive(Debug, Default)]
pub struct Merged {
    pub copied: usize,
    /// Parts the merged folder had already (the same run from two folders, or a merge run twice).
    pub already: usize,
    /// Cell ids with rows in more than one source folder, and those folders.
    pub cells_in_several: Vec<(String, Vec<String>)>,
}

pub fn merge(dirs: &[PathBuf], out: &Path) -> Result<Merged> {
    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let out_real = fs::canonicalize(out)?;
    for d in dirs {
        anyhow::ensure!(d.is_dir(), "{}: no such results folder", d.display());
        if fs::canonicalize(d)? == out_real {
            bail!(
                "{} is both a folder to merge and --out: merge into a new folder",
                d.display()
            );
        }
    }
    let mut m = Merged::default();
    for d in dirs {
        let mut folders: Vec<(PathBuf, PathBuf)> = TABLES
            .iter()
            .map(|t| (d.join(t.dir_name()), out.join(t.dir_name())))
            .collect();
        folders.push((d.join("plans"), out.join("plans")));
        for (from, to) in folders {
            let Ok(entries) = fs::read_dir(&from) else { continue };
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| !n.starts_with('.'))
                .collect();
            names.sort();
            for name in names {
                let dest = to.join(&name);
                if dest.exists() {
                    m.already += 1;
                    continue;
                }
                fs::create_dir_all(&to)?;
                // Through a hidden name and a rename, as every part is written: readers never see half.
                let tmp = to.join(format!(".{name}.merge-{}", std::process::id()));
                fs::copy(from.join(&name), &tmp).with_context(|| format!("copying {}", from.join(&name).display()))?;
                fs::rename(&tmp, &dest)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::runs::write_run;
    use crate::run::record::tests::fake_run;
    use std::time::Duration;

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
