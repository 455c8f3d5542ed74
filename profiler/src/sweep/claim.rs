//! Claims: one measurement per cell and per device at a time, across sweep processes and hosts. A claim
//! is a file created with `O_EXCL` (which network file systems honour, where `flock` may not), holding
//! who made it; its modification time is its heartbeat, refreshed while the cell runs; it is removed
//! when the cell has ended (its row written). A claim whose process is gone (on this host) or whose
//! heartbeat is older than [`STALE`] is stale: taken over, and said.
//!
//! Cell claims live in the results folder (`claims/`), so that sweeps on several machines sharing a
//! folder each measure a cell once; device claims live in this machine's temporary folder, so that two
//! sweeps writing to different folders never measure on one device at once.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::files::io_error;
use crate::provenance;

/// A heartbeat older than this makes a claim stale, whoever holds it.
pub const STALE: Duration = Duration::from_secs(60);
/// How often a held claim's heartbeat is refreshed.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// Who holds a claim.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// RFC 3339.
    pub since: String,
}

impl Holder {
    fn this_process() -> Holder {
        Holder {
            pid: std::process::id(),
            host: provenance::host(),
            since: provenance::now().to_rfc3339(),
        }
    }

    pub fn describe(&self) -> String {
        format!("pid {} on {} since {}", self.pid, self.host, self.since)
    }
}

/// A claim this process holds: removed when dropped.
#[derive(Debug)]
pub struct Claim {
    path: PathBuf,
    beat: Instant,
}

/// What trying to claim gave.
#[derive(Debug)]
pub enum Claimed {
    /// Ours; `took_over` names the stale holder it replaced.
    Ours { claim: Claim, took_over: Option<Holder> },
    /// Another live process holds it.
    Theirs(Holder),
}

impl Claim {
    /// Claims `path` for this process, or says who holds it.
    pub fn take(path: &Path) -> Result<Claimed> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| io_error(e, dir))?;
        }
        let mut took_over = None;
        // Twice at most: once as it is, once after removing a stale claim (which another process may
        // have taken meanwhile: then it is theirs).
        for _ in 0..2 {
            match OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    let me = serde_json::to_string(&Holder::this_process())?;
                    f.write_all(me.as_bytes())
                        .and_then(|()| f.sync_all())
                        .map_err(|e| io_error(e, path))?;
                    let claim = Claim {
                        path: path.to_path_buf(),
                        beat: Instant::now(),
                    };
                    return Ok(Claimed::Ours { claim, took_over });
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    let holder = read_holder(path);
                    if !is_stale(path, holder.as_ref()) {
                        return Ok(Claimed::Theirs(holder.unwrap_or_else(|| Holder {
                            pid: 0,
                            host: "?".into(),
                            since: "being written".into(),
                        })));
                    }
                    took_over = holder.or(Some(Holder {
                        pid: 0,
                        host: "?".into(),
                        since: "unreadable".into(),
                    }));
                    match fs::remove_file(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::NotFound => {}
                        Err(e) => return Err(io_error(e, path)),
                    }
                }
                Err(e) => return Err(io_error(e, path)),
            }
        }
        Ok(Claimed::Theirs(read_holder(path).unwrap_or_else(|| Holder {
            pid: 0,
            host: "?".into(),
            since: "just now".into(),
        })))
    }

    /// Refreshes the heartbeat once [`HEARTBEAT`] has passed since the last.
    pub fn refresh(&mut self) {
        if self.beat.elapsed() >= HEARTBEAT {
            if let Ok(f) = File::options().write(true).open(&self.path) {
                let _ = f.set_modified(SystemTime::now());
            }
            self.beat = Instant::now();
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn read_holder(path: &Path) -> Option<Holder> {
    serde_json::from_str(&fs::read_to_string(path).ok()?).ok()
}

/// A claim is stale when its process is gone (known only on this host) or its heartbeat is old.
fn is_stale(path: &Path, holder: Option<&Holder>) -> bool {
    let age = fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .unwrap_or_default();
    if age > STALE {
        return true;
    }
    match holder {
        Some(h) if h.host == provenance::host() => !alive(h.pid),
        _ => false,
    }
}

fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only asks whether the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The claim file of a cell in a results folder.
pub fn cell_claim(out: &Path, cell_id: &str) -> PathBuf {
    out.join("claims").join(format!("cell-{cell_id}.json"))
}

/// The claim file of a device on this machine (a device key: a GPU or MIG UUID, `cpu`, …).
pub fn device_claim(device_key: &str) -> PathBuf {
    let safe: String = device_key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
        .collect();
    std::env::temp_dir()
        .join("migprof-devices")
        .join(format!("{safe}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_stale_claims_are_taken_over() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("claims/cell-x.json");
        let Claimed::Ours { claim, took_over: None } = Claim::take(&path)? else {
            panic!("a free claim is ours")
        };
        // A second try, as another sweep would: held by a live process (this one).
        match Claim::take(&path)? {
            Claimed::Theirs(h) => assert_eq!(h.pid, std::process::id()),
            other => panic!("{other:?}"),
        }
        drop(claim);
        assert!(!path.exists(), "released when dropped");
        // A claim of a process that is gone, on this host: stale, taken over and named.
        let gone = std::process::Command::new("true").spawn()?;
        let pid = gone.id();
        let mut gone = gone;
        gone.wait()?;
        let dead = Holder {
            pid,
            host: provenance::host(),
            since: "2026-01-01T00:00:00Z".into(),
        };
        fs::write(&path, serde_json::to_string(&dead)?)?;
        match Claim::take(&path)? {
            Claimed::Ours { took_over: Some(h), .. } => assert_eq!(h, dead),
            other => panic!("{other:?}"),
        }
        // Another host's claim with a fresh heartbeat holds; with an old one it is stale.
        let far = Holder {
            pid: 1,
            host: "another-host".into(),
            since: "2026-01-01T00:00:00Z".into(),
        };
        fs::write(&path, serde_json::to_string(&far)?)?;
        assert!(matches!(Claim::take(&path)?, Claimed::Theirs(h) if h == far));
        File::options()
            .write(true)
            .open(&path)?
            .set_modified(SystemTime::now() - STALE * 2)?;
        assert!(matches!(Claim::take(&path)?, Claimed::Ours { took_over: Some(h), .. } if h == far));
        Ok(())
    }
}
