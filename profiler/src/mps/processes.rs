//! The MPS processes running on this machine (control daemons and servers), read from /proc: whose
//! they are decides whether migprof may start its own daemon, and `migprof devices` lists them.

use std::path::{Path, PathBuf};

/// The control daemon's program name.
pub const CONTROL: &str = "nvidia-cuda-mps-control";
/// The server's program name (a control daemon starts one per user).
pub const SERVER: &str = "nvidia-cuda-mps-server";

/// An MPS control daemon or server.
#[derive(Debug, Clone, PartialEq)]
pub struct MpsProcess {
    pub pid: u32,
    /// [`CONTROL`] or [`SERVER`].
    pub program: String,
    /// Its `CUDA_MPS_PIPE_DIRECTORY`; `None` when unset (the system default) or unreadable.
    pub pipe_dir: Option<PathBuf>,
}

impl MpsProcess {
    /// Whether its pipes are under `base`: a daemon (or its server) that some migprof started.
    pub fn is_under(&self, base: &Path) -> bool {
        self.pipe_dir.as_deref().is_some_and(|p| p.starts_with(base))
    }

    pub fn describe(&self) -> String {
        let pipes = self
            .pipe_dir
            .as_ref()
            .map_or("the default pipe directory".to_string(), |p| {
                format!("pipes in {}", p.display())
            });
        format!("{} (pid {}, {pipes})", self.program, self.pid)
    }
}

/// Where the processes come from: this machine's /proc, or a list in tests.
pub trait ProcessTable {
    fn mps_processes(&self) -> Vec<MpsProcess>;
    fn alive(&self, pid: u32) -> bool;
}

/// This machine's processes.
pub struct Proc;

impl ProcessTable for Proc {
    fn mps_processes(&self) -> Vec<MpsProcess> {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut found: Vec<MpsProcess> = entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|pid| {
                // argv[0]'s file name: /proc/PID/comm is cut at 15 characters, too short to tell the
                // control daemon from the server.
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let argv0 = cmdline.split(|&b| b == 0).next()?;
                let program = Path::new(std::str::from_utf8(argv0).ok()?)
                    .file_name()?
                    .to_str()?
                    .to_string();
                if program != CONTROL && program != SERVER {
                    return None;
                }
                Some(MpsProcess {
                    pid,
                    program,
                    pipe_dir: environ(pid, "CUDA_MPS_PIPE_DIRECTORY").map(PathBuf::from),
                })
            })
            .collect();
        found.sort_by_key(|p| p.pid);
        found
    }

    fn alive(&self, pid: u32) -> bool {
        alive(pid)
    }
}

/// Whether a process exists: signal 0 checks without sending; EPERM means it exists but is someone
/// else's.
pub fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 sends nothing.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// One variable of a process's environment, when readable (its owner or root).
fn environ(pid: u32, name: &str) -> Option<String> {
    let bytes = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    bytes
        .split(|&b| b == 0)
        .find_map(|kv| std::str::from_utf8(kv).ok()?.strip_prefix(&prefix).map(str::to_string))
}
