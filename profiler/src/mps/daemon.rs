//! migprof's own MPS control daemon: started with private pipe and log folders (never touching a
//! system daemon), pinned to one GPU, dying with the migprof that started it, and quit at the end.
//!
//! Every daemon migprof starts keeps its folders under one base folder ([`base_dir`]): `<base>/<id>/`
//! holds `pipe/`, `log/` and `daemon.json` (who started it, for which GPU). That is how a later
//! migprof tells its own daemons from anyone else's: an MPS process whose `CUDA_MPS_PIPE_DIRECTORY`
//! lies under the base is migprof's, and stale when the migprof that started it is gone.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::processes::{MpsProcess, ProcessTable, CONTROL};
use super::share::Share;

/// Names the control program to use instead of `nvidia-cuda-mps-control` on PATH (tests use a fake).
pub const CONTROL_ENV: &str = "MIGPROF_MPS_CONTROL";
/// Names the base folder of migprof's daemons instead of `$TMPDIR/migprof-mps`.
pub const BASE_ENV: &str = "MIGPROF_MPS_DIR";
/// Set by migprof for a process that is a client of migprof's daemon: its pipe folder.
pub const CLIENT_PIPE_ENV: &str = "MIGPROF_MPS_PIPE_DIRECTORY";
/// Set by a sweep for a cell that is no MPS client but runs on a GPU where the sweep's daemon serves
/// emulated slices: the idle MPS server it may find there is migprof's, not a neighbour.
pub const BESIDE_ENV: &str = "MIGPROF_MPS_DAEMON_BESIDE";

/// How long the daemon may take to open its control pipe, and to quit.
const START_TIMEOUT: Duration = Duration::from_secs(10);
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);

/// The control program: [`CONTROL_ENV`], else `nvidia-cuda-mps-control` on PATH or in the driver's
/// usual folders; an error saying MPS is not available otherwise.
pub fn control_program() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(CONTROL_ENV) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        bail!("{CONTROL_ENV}={}: no such file", p.display())
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let driver_dirs = [PathBuf::from("/usr/local/nvidia/bin"), PathBuf::from("/usr/bin")];
    std::env::split_paths(&path)
        .chain(driver_dirs)
        .map(|d| d.join(CONTROL))
        .find(|p| p.is_file())
        .with_context(|| format!("MPS is not available here: {CONTROL} is not on PATH (it comes with the NVIDIA driver's compute utilities)"))
}

/// The base folder of migprof's daemons.
pub fn base_dir() -> PathBuf {
    std::env::var_os(BASE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("migprof-mps"))
}

/// `daemon.json`: who started a daemon, and for which GPU.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    owner_pid: u32,
    control_pid: u32,
    gpu_uuid: String,
}

/// A running control daemon of this migprof.
pub struct Daemon {
    child: Option<Child>,
    control: PathBuf,
    dir: PathBuf,
    pub gpu_uuid: String,
}

impl Daemon {
    /// Starts a daemon for `gpu_uuid` after making sure no other MPS daemon serves this machine: a
    /// stale one of an earlier migprof is reported with how to stop it, one of a running migprof or
    /// one migprof did not start is refused.
    pub fn start(control: &Path, base: &Path, gpu_uuid: &str, procs: &dyn ProcessTable) -> Result<Daemon> {
        preflight(base, procs)?;
        // Unique per start: a folder left by an earlier daemon of this process is never reused.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = base.join(format!("{}-{}-{nanos}", std::process::id(), short(gpu_uuid)));
        let (pipe, log) = (dir.join("pipe"), dir.join("log"));
        for d in [&pipe, &log] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        let mut cmd = Command::new(control);
        cmd.arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &log)
            .env("CUDA_VISIBLE_DEVICES", gpu_uuid)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log.join("migprof-stderr.log"))?);
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                // Its own process group: a Ctrl-C meant for migprof's cells must not reach the daemon
                // (migprof stops it after them). And it dies with migprof, whatever ends migprof.
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} -f", control.display()))?;
        let record = Record {
            owner_pid: std::process::id(),
            control_pid: child.id(),
            gpu_uuid: gpu_uuid.to_string(),
        };
        std::fs::write(dir.join("daemon.json"), serde_json::to_string_pretty(&record)?)?;
        // Ready once its control pipe exists.
        let started = Instant::now();
        while !pipe.join("control").exists() {
            if let Some(status) = child.try_wait()? {
                let log_text = read_logs(&log);
                let _ = std::fs::remove_dir_all(&dir);
                bail!("the MPS control daemon exited at start ({status}); its log:\n{log_text}")
            }
            if started.elapsed() > START_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                let _ = std::fs::remove_dir_all(&dir);
                bail!(
                    "the MPS control daemon did not open its control pipe within {} s",
                    START_TIMEOUT.as_secs()
                )
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Daemon {
            child: Some(child),
            control: control.to_path_buf(),
            dir,
            gpu_uuid: gpu_uuid.to_string(),
        })
    }

    /// The folder clients reach the daemon through.
    pub fn pipe_dir(&self) -> PathBuf {
        self.dir.join("pipe")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Quits the daemon (and the server it started), waits for it, and removes its folders. A daemon
    /// that does not quit in time is killed; one that had died already is reported.
    pub fn stop(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let result = (|| -> Result<()> {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the MPS control daemon had died before migprof stopped it ({status}); its log:\n{}",
                    read_logs(&self.dir.join("log"))
                )
            }
            // `quit` goes to the daemon through its pipe, from the control program in client mode.
            let quit = Command::new(&self.control)
                .env("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .and_then(|mut q| {
                    q.stdin.take().expect("piped").write_all(b"quit\n")?;
                    q.wait()
                });
            let deadline = Instant::now() + QUIT_TIMEOUT;
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    // Its process group holds the server it started.
                    // SAFETY: a signal to the group migprof created for the daemon.
                    unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
                    child.wait()?;
                    bail!(
                        "the MPS control daemon did not quit within {} s ({quit:?}); killed it",
                        QUIT_TIMEOUT.as_secs()
                    )
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        })();
        let _ = std::fs::remove_dir_all(&self.dir);
        result
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("warning: {e:#}");
        }
    }
}

/// The environment of a client of the daemon whose pipes are in `pipe_dir`, given `share`.
pub fn client_env(pipe_dir: &Path, share: &Share) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("CUDA_MPS_PIPE_DIRECTORY", pipe_dir.display().to_string()),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share.percent.to_string()),
    ];
    if let Some(mib) = share.memory_limit_mib {
        // Device 0: the client sees exactly one GPU, pinned by CUDA_VISIBLE_DEVICES.
        env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={mib}M")));
    }
    env
}

/// Refuses to start beside another MPS daemon, and clears the folders of migprof's dead ones.
fn preflight(base: &Path, procs: &dyn ProcessTable) -> Result<()> {
    let running = procs.mps_processes();
    for p in &running {
        if !p.is_under(base) {
            bail!(
                "another MPS daemon serves this machine: {}. migprof runs its own daemon and will not share a GPU with one it did not start; \
                 stop it (`echo quit | CUDA_MPS_PIPE_DIRECTORY=<its pipe directory> {CONTROL}`) or run without `mps:`",
                p.describe()
            )
        }
    }
    // migprof's processes by the daemon folder they belong to (the folder may be gone already).
    let mut by_dir: std::collections::BTreeMap<PathBuf, Vec<&MpsProcess>> = Default::default();
    for p in &running {
        let pipe = p.pipe_dir.as_deref().expect("under the base");
        let first = pipe.strip_prefix(base).ok().and_then(|rest| rest.components().next());
        by_dir
            .entry(first.map_or(base.to_path_buf(), |c| base.join(c)))
            .or_default()
            .push(p);
    }
    for (dir, members) in &by_dir {
        let record: Option<Record> = std::fs::read_to_string(dir.join("daemon.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        // This process's own daemons (one per GPU of a sweep) are no obstacle to another one.
        if record.as_ref().is_some_and(|r| r.owner_pid == std::process::id()) {
            continue;
        }
        let list: Vec<String> = members.iter().map(|p| p.describe()).collect();
        match record {
            Some(r) if procs.alive(r.owner_pid) => bail!(
                "migprof (pid {}) runs an MPS daemon on {}: {}; wait for it to finish (two emulations on one GPU would share it)",
                r.owner_pid,
                r.gpu_uuid,
                list.join(", ")
            ),
            _ => bail!(
                "a stale MPS daemon of an earlier migprof still runs: {}. Stop it with `echo quit | CUDA_MPS_PIPE_DIRECTORY={} {CONTROL}` \
                 (or `kill {}`), then remove {}",
                list.join(", "),
                dir.join("pipe").display(),
                members.iter().map(|p| p.pid.to_string()).collect::<Vec<_>>().join(" "),
                dir.display()
            ),
        }
    }
    // Nothing runs from the folders left: the leftovers of daemons that are gone.
    if let Ok(entries) = std::fs::read_dir(base) {
        for dir in entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir() && !by_dir.contains_key(p))
        {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    Ok(())
}

/// The first 8 hex digits of a UUID, for a folder name.
fn short(uuid: &str) -> String {
    uuid.trim_start_matches("GPU-")
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .take(8)
        .collect()
}

/// The daemon's log files, for an error message.
fn read_logs(log: &Path) -> String {
    let mut out = String::new();
    if let Ok(entries) = std::fs::read_dir(log) {
        for p in entries.filter_map(|e| e.ok().map(|e| e.path())) {
            if let Ok(text) = std::fs::read_to_string(&p) {
                let tail: Vec<&str> = text.lines().rev().take(10).collect();
                out += &format!(
                    "{}:\n{}\n",
                    p.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Table(Vec<MpsProcess>, Vec<u32>);

    impl ProcessTable for Table {
        fn mps_processes(&self) -> Vec<MpsProcess> {
            self.0.clone()
        }
        fn alive(&self, pid: u32) -> bool {
            self.1.contains(&pid)
        }
    }

    fn server(pid: u32, pipe: Option<&Path>) -> MpsProcess {
        MpsProcess {
            pid,
            program: "nvidia-cuda-mps-server".into(),
            pipe_dir: pipe.map(Path::to_path_buf),
        }
    }

    #[test]
    fn a_daemon_migprof_did_not_start_is_refused_with_how_to_stop_it() {
        let base = tempfile::tempdir().unwrap();
        let e = preflight(base.path(), &Table(vec![server(77, None)], vec![77]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "another MPS daemon serves this machine: nvidia-cuda-mps-server (pid 77, the default pipe directory)"
            ),
            "{e}"
        );
        assert!(
            e.contains("echo quit | CUDA_MPS_PIPE_DIRECTORY=<its pipe directory> nvidia-cuda-mps-control"),
            "{e}"
        );
        let elsewhere = Path::new("/var/run/mps");
        assert!(
            preflight(base.path(), &Table(vec![server(78, Some(elsewhere))], vec![]))
                .unwrap_err()
                .to_string()
                .contains("pipes in /var/run/mps")
        );
    }

    #[test]
    fn a_stale_daemon_of_an_earlier_migprof_is_reported_and_a_live_one_is_waited_for() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("4242-deadbeef");
        std::fs::create_dir_all(dir.join("pipe")).unwrap();
        let record = Record {
            owner_pid: 4242,
            control_pid: 4243,
            gpu_uuid: "GPU-deadbeef".into(),
        };
        std::fs::write(dir.join("daemon.json"), serde_json::to_string(&record).unwrap()).unwrap();
        let procs = vec![MpsProcess {
            pid: 4243,
            program: CONTROL.into(),
            pipe_dir: Some(dir.join("pipe")),
        }];
        // Its migprof is gone: stale.
        let e = preflight(base.path(), &Table(procs.clone(), vec![4243]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("a stale MPS daemon of an earlier migprof still runs: nvidia-cuda-mps-control (pid 4243"),
            "{e}"
        );
        assert!(
            e.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}", dir.join("pipe").display())) && e.contains("kill 4243"),
            "{e}"
        );
        // Its migprof still runs: wait.
        let e = preflight(base.path(), &Table(procs, vec![4242, 4243]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("migprof (pid 4242) runs an MPS daemon on GPU-deadbeef"),
            "{e}"
        );
        // Nothing runs from the folder any more: it is cleared and the start may go on.
        preflight(base.path(), &Table(Vec::new(), vec![])).unwrap();
        assert!(!dir.exists());
    }

    #[test]
    fn a_client_gets_its_share_and_the_profile_memory() {
        let share = Share {
            profile: Some("3g.40gb".into()),
            percent: 46,
            profile_sms: 60,
            memory_limit_mib: Some(40448),
            memory_fraction: 0.125,
        };
        let env = client_env(Path::new("/tmp/m/pipe"), &share);
        assert_eq!(
            env,
            vec![
                ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/m/pipe".to_string()),
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "46".to_string()),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=40448M".to_string()),
            ]
        );
        let bare = Share {
            profile: None,
            memory_limit_mib: None,
            ..share
        };
        assert_eq!(client_env(Path::new("/p"), &bare).len(), 2);
    }
}
