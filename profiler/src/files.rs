//! Files written whole or not at all: each goes to a hidden temporary name in its folder, is flushed to
//! disk, then renamed over its final name, so a reader (or a crash, or a full disk) never leaves half a
//! file under the name. Only regular files are replaced: a symbolic link is written through, and a
//! device, FIFO, socket or folder is refused. Every error names the path it is about.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};

/// Links followed before a path is taken for a loop, as the kernel's own limit.
const MAX_LINKS: usize = 40;

/// An I/O error with the path it is about: "No space left on device (os error 28) (/r/runs/part-….parquet)".
pub fn io_error(e: std::io::Error, path: &Path) -> anyhow::Error {
    anyhow!("{e} ({})", path.display())
}

/// Writes `bytes` as `path`, whole or not at all; the folder is made when missing. A symbolic link is
/// written through: the file it leads to is replaced, the link stays. On failure nothing is left under
/// either name, and a path that is no regular file (a device, a FIFO, a socket, a folder) is refused
/// before anything is written.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let (target, existing) = write_target(path)?;
    let dir = target
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| io_error(e, dir))?;
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = File::create(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            // The file replaced keeps its permissions: a report shared read-only stays so.
            if let Some(permissions) = &existing {
                f.set_permissions(permissions.clone())?;
            }
            f.sync_all()
        })
        .map_err(|e| io_error(e, &tmp))
        .and_then(|()| fs::rename(&tmp, &target).map_err(|e| io_error(e, &target)));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Where a write to `path` lands, following its symbolic links, and the permissions of the regular
/// file there (`None`: nothing is there yet). Anything else there is refused by what it is.
fn write_target(path: &Path) -> Result<(PathBuf, Option<fs::Permissions>)> {
    let mut at = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        let meta = match fs::symlink_metadata(&at) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((at, None)),
            Err(e) => return Err(io_error(e, &at)),
        };
        let kind = meta.file_type();
        if kind.is_symlink() {
            let leads_to = fs::read_link(&at).map_err(|e| io_error(e, &at))?;
            // A relative link is relative to the folder it is in; an absolute one replaces the path.
            at = at.parent().map_or(leads_to.clone(), |dir| dir.join(&leads_to));
            continue;
        }
        if kind.is_file() {
            return Ok((at, Some(meta.permissions())));
        }
        let through = if at == path {
            String::new()
        } else {
            format!(" (where {} leads)", path.display())
        };
        bail!(
            "{}{through} is {}, not a regular file: migprof writes results, reports and layouts only as regular files, replacing a file there whole; give the path of a file",
            at.display(),
            file_kind(&kind)
        );
    }
    bail!(
        "{}: more than {MAX_LINKS} symbolic links in a row (a loop?); give the path of a file",
        path.display()
    )
}

/// What a non-regular file is, in `ls -l`'s words.
fn file_kind(kind: &fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_char_device() {
            return "a character device";
        }
        if kind.is_block_device() {
            return "a block device";
        }
        if kind.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        return "a folder";
    }
    "a special file"
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

    #[cfg(unix)]
    #[test]
    fn a_symbolic_link_is_written_through_and_stays_a_link() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("shared/report.html");
        write_atomically(&target, b"old")?;
        fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o640))?;
        let link = dir.path().join("link.html");
        std::os::unix::fs::symlink("shared/report.html", &link)?;
        write_atomically(&link, b"new")?;
        assert!(
            fs::symlink_metadata(&link)?.file_type().is_symlink(),
            "the link is kept"
        );
        assert_eq!(fs::read(&target)?, b"new", "its target is replaced");
        let mode = std::os::unix::fs::PermissionsExt::mode(&fs::metadata(&target)?.permissions());
        assert_eq!(mode & 0o777, 0o640, "the replaced file keeps its permissions");
        // A link to a file not there yet makes that file; a chain of links is followed.
        let dangling = dir.path().join("dangling.yaml");
        std::os::unix::fs::symlink(dir.path().join("made/layouts.yaml"), &dangling)?;
        let chain = dir.path().join("chain.yaml");
        std::os::unix::fs::symlink("dangling.yaml", &chain)?;
        write_atomically(&chain, b"layouts")?;
        assert_eq!(fs::read(dir.path().join("made/layouts.yaml"))?, b"layouts");
        assert!(fs::symlink_metadata(&chain)?.file_type().is_symlink());
        // A loop is refused by name.
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::os::unix::fs::symlink("b", &a)?;
        std::os::unix::fs::symlink("a", &b)?;
        let e = write_atomically(&a, b"x").unwrap_err().to_string();
        assert!(e.contains("symbolic links in a row"), "{e}");
        Ok(())
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_a_socket_and_a_folder_are_refused_and_left_as_they_are() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let fifo = dir.path().join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
        assert!(made.success(), "mkfifo failed");
        let socket = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&socket)?;
        let folder = dir.path().join("folder");
        fs::create_dir(&folder)?;
        let link = dir.path().join("to-pipe");
        std::os::unix::fs::symlink(&fifo, &link)?;
        for (path, kind) in [
            (&fifo, "a FIFO"),
            (&socket, "a socket"),
            (&folder, "a folder"),
            (&link, "a FIFO"),
        ] {
            let e = write_atomically(path, b"x").unwrap_err().to_string();
            assert!(e.contains(kind) && e.contains("not a regular file"), "{e}");
        }
        use std::os::unix::fs::FileTypeExt;
        assert!(
            fs::symlink_metadata(&fifo)?.file_type().is_fifo(),
            "the FIFO is still one"
        );
        assert!(fs::symlink_metadata(&socket)?.file_type().is_socket());
        assert!(fs::symlink_metadata(&link)?.file_type().is_symlink());
        let names: Vec<String> = fs::read_dir(dir.path())?
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .filter(|n: &String| n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "no temporary file is left: {names:?}");
        Ok(())
    }

    /// A character device made in a temporary folder (as /dev/full is: major 1, minor 7), never the
    /// real one: writing there must be refused, and the node must stay a device.
    #[cfg(unix)]
    #[test]
    #[ignore = "needs root: makes a character device with mknod"]
    fn a_character_device_is_refused_and_left_a_device() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let node = dir.path().join("full");
        let made = std::process::Command::new("mknod")
            .arg(&node)
            .args(["c", "1", "7"])
            .status()?;
        assert!(made.success(), "mknod failed: this test needs root");
        let e = write_atomically(&node, b"report").unwrap_err().to_string();
        assert!(
            e.contains("a character device") && e.contains("not a regular file"),
            "{e}"
        );
        use std::os::unix::fs::FileTypeExt;
        assert!(fs::symlink_metadata(&node)?.file_type().is_char_device());
        Ok(())
    }
}
