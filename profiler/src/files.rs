//! Files written whole or not at all: each goes to a hidden temporary name in its folder, is flushed to
//! disk, then renamed over its final name, so a reader (or a crash, or a full disk) never leaves half a
//! file under the name. Every error names the path it is about.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use anyhow::{anyhow, Result};

/// An I/O error with the path it is about: "No space left on device (os error 28) (/r/runs/part-….parquet)".
pub fn io_error(e: std::io::Error, path: &Path) -> anyhow::Error {
    anyhow!("{e} ({})", path.display())
}

/// Writes `bytes` as `path`, whole or not at all; the folder is made when missing. On failure nothing
/// is left under either name.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| io_error(e, dir))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(|e| io_error(e, &tmp))
        .and_then(|()| fs::rename(&tmp, path).map_err(|e| io_error(e, path)));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Makes `dir` (and its parents) and proves that files can be written in it, before any work whose
/// results would go there: the error names the folder and why.
pub fn ensure_writable_dir(dir: &Path) -> Result<()> {
    let cannot = |e: std::io::Error| anyhow!("cannot write results to {}: {e}", dir.display());
    fs::create_dir_all(dir).map_err(cannot)?;
    let probe = dir.join(format!(".migprof-write-check-{}", std::process::id()));
    File::create(&probe)
        .and_then(|mut f| f.write_all(b"ok"))
        .map_err(cannot)?;
    fs::remove_file(&probe).map_err(cannot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_written_whole_and_replaces_the_old_one() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("deep/report.html");
        write_atomically(&path, b"first")?;
        write_atomically(&path, b"second")?;
        assert_eq!(fs::read(&path)?, b"second");
        let names: Vec<String> = fs::read_dir(path.parent().unwrap())?
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(names, ["report.html"], "no temporary file is left");
        Ok(())
    }

    #[test]
    fn a_failed_write_names_the_path_and_leaves_nothing() -> Result<()> {
        let dir = tempfile::tempdir()?;
        // A folder whose parent is a regular file: every write below it fails, also as root.
        fs::write(dir.path().join("file"), b"")?;
        let path = dir.path().join("file/runs/part-1.parquet");
        let e = write_atomically(&path, b"x").unwrap_err().to_string();
        assert!(
            e.contains("Not a directory") && e.contains(&dir.path().join("file/runs").display().to_string()),
            "{e}"
        );
        let e = ensure_writable_dir(&dir.path().join("file/out"))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cannot write results to ") && e.contains("file/out") && e.contains("Not a directory"),
            "{e}"
        );
        ensure_writable_dir(&dir.path().join("fine"))?;
        assert_eq!(
            fs::read_dir(dir.path().join("fine"))?.count(),
            0,
            "the probe is removed"
        );
        Ok(())
    }
}
