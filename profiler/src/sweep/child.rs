//! One cell in a child process of this same binary (`migprof cell --spec FILE --out DIR`): started with
//! its output in the cell's log, waited for under the sweep's timeout, and how it ended read from its
//! exit (status, message). The child writes its own row when it measured; for every other ending the
//! sweep writes one from what is read here.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::run::record::Status;

/// The exit code a child uses for running out of memory (device or host), so that the sweep can tell
/// it from any other error without parsing messages.
pub const EXIT_OOM: i32 = 3;

/// The last line a child prints when it measured: `result: <status> <throughput>/s p50 <ms> ms, verdict <verdict>`.
pub const RESULT_PREFIX: &str = "result: ";

/// A started cell.
pub struct Running {
    child: Child,
    started: Instant,
    timeout: Duration,
    log: PathBuf,
    /// Where this attempt's output starts in the log (earlier attempts stay above it).
    log_start: u64,
    oom_kills_before: Option<u64>,
}

/// How a child ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
    TimedOut,
}

/// What a finished cell comes to.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub status: Status,
    /// The child's result line when it measured; otherwise the error or the log's last lines.
    pub message: String,
    /// How a program's cell's program ended, where the cell said.
    pub program: Option<crate::cell::runner::ProgramEnded>,
}

/// Starts `migprof cell` for the spec at `spec`, its stdout and stderr appended to `log`.
/// `env` is added to the child's environment (an MPS client's pipe folder).
pub fn start(
    exe: &Path,
    spec: &Path,
    out: &Path,
    log: &Path,
    timeout: Duration,
    invocation_id: &str,
    env: &[(&str, PathBuf)],
) -> Result<Running> {
    let logs = log.parent().expect("logs live in a folder");
    fs::create_dir_all(logs).map_err(|e| crate::files::io_error(e, logs))?;
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    let log_start = file
        .seek(SeekFrom::End(0))
        .map_err(|e| crate::files::io_error(e, log))?;
    writeln!(
        file,
        "== {} migprof cell --spec {}",
        chrono::Utc::now().to_rfc3339(),
        spec.display()
    )
    .map_err(|e| crate::files::io_error(e, log))?;
    let err = file.try_clone().map_err(|e| crate::files::io_error(e, log))?;
    let mut command = Command::new(exe);
    // The cell dies with the sweep that started it, however the sweep ends (a crash, an OOM kill, a
    // scheduler's SIGKILL): otherwise it would measure on, unwatched, beside a rerun's cells.
    // SAFETY: between fork and exec, only async-signal-safe calls (prctl, getppid, _exit).
    let sweep = std::process::id() as libc::pid_t;
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The sweep may have died before the line above: then nobody is left to watch this cell.
            if libc::getppid() != sweep {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let child = command
        .arg("cell")
        .arg("--spec")
        .arg(spec)
        .arg("--out")
        .arg(out)
        .arg("--invocation")
        .arg(invocation_id)
        .envs(env.iter().map(|(k, v)| (*k, v.as_os_str())))
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    Ok(Running {
        child,
        started: Instant::now(),
        timeout,
        log: log.to_path_buf(),
        log_start,
        oom_kills_before: oom_kills(),
    })
}

impl Running {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The ending when the child has finished (or been killed for its timeout); `None` while it runs.
    pub fn poll(&mut self) -> Result<Option<Ending>> {
        let exit = match self.child.try_wait()? {
            Some(status) => exit_of(status),
            None if self.started.elapsed() >= self.timeout => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                Exit::TimedOut
            }
            None => return Ok(None),
        };
        let output = self.output()?;
        let oom_killed = match (self.oom_kills_before, oom_kills()) {
            (Some(before), Some(after)) => after > before,
            _ => false,
        };
        Ok(Some(classify(&exit, &output, oom_killed, self.timeout)))
    }

    /// Stops the child without a row: the user interrupted the sweep.
    pub fn interrupt(mut self) {
        // SAFETY: kill(2) on the child's pid; at worst the child has already exited.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// This attempt's part of the log.
    fn output(&self) -> Result<String> {
        let mut f = File::open(&self.log)?;
        f.seek(SeekFrom::Start(self.log_start))?;
        // A program's cell logs the program's output, which need not be UTF-8.
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

fn exit_of(status: ExitStatus) -> Exit {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => Exit::Code(code),
        (None, Some(signal)) => Exit::Signal(signal),
        (None, None) => Exit::Code(-1),
    }
}

/// How a cell ended, from its exit, its output and whether the kernel's OOM killer struck meanwhile.
pub fn classify(exit: &Exit, output: &str, oom_killed: bool, timeout: Duration) -> Ending {
    let last = |n: usize| {
        let lines: Vec<&str> = output
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("== "))
            .collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    };
    let error_line = || {
        output
            .lines()
            .rev()
            .find(|l| l.starts_with("error: "))
            .map(|l| l.trim_start_matches("error: ").to_string())
    };
    // Rust's allocator aborts with this line when the host has no memory left for a tensor.
    let host_oom = output.contains("memory allocation of ") && output.contains(" failed");
    let (status, message) = match exit {
        Exit::Code(0) => match output.lines().rev().find_map(|l| l.strip_prefix(RESULT_PREFIX)) {
            Some(result) => {
                let (word, rest) = result.split_once(' ').unwrap_or((result, ""));
                let status = if word == "probe" { Status::Probe } else { Status::Ok };
                (status, rest.to_string())
            }
            None => (
                Status::Error,
                format!(
                    "the cell exited 0 without a result line; its output ended:\n{}",
                    last(5)
                ),
            ),
        },
        Exit::Code(EXIT_OOM) => (Status::Oom, error_line().unwrap_or_else(|| last(3))),
        Exit::Code(code) => (
            Status::Error,
            error_line().unwrap_or_else(|| format!("exit code {code}; its output ended:\n{}", last(5))),
        ),
        Exit::Signal(_) if host_oom => {
            let line = output
                .lines()
                .find(|l| l.contains("memory allocation of "))
                .unwrap_or_default();
            (Status::Oom, format!("the host ran out of memory: {}", line.trim()))
        }
        Exit::Signal(libc::SIGKILL) if oom_killed => (
            Status::Oom,
            "killed by the kernel's OOM killer (SIGKILL; the cgroup's oom_kill count rose)".to_string(),
        ),
        Exit::Signal(signal) => (
            Status::Crashed,
            format!(
                "killed by signal {signal} ({}); its output ended:\n{}",
                signal_name(*signal),
                last(5)
            ),
        ),
        Exit::TimedOut => (
            Status::Timeout,
            format!(
                "still running after {:.0} s (timeout_secs); killed",
                timeout.as_secs_f64()
            ),
        ),
    };
    Ending {
        status,
        message,
        program: crate::cell::runner::ProgramEnded::in_output(output),
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGBUS => "SIGBUS",
        _ => "another signal",
    }
}

/// How often the kernel's OOM killer has struck in this process's cgroup (cgroup v2's
/// `memory.events`), to tell an OOM kill from any other SIGKILL; `None` where it cannot be read.
fn oom_kills() -> Option<u64> {
    let cgroup = fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let events = fs::read_to_string(format!("/sys/fs/cgroup{}/memory.events", path.trim_end_matches('/'))).ok()?;
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(60);

    #[test]
    fn every_ending_has_its_status_and_says_why() {
        let ok = classify(
            &Exit::Code(0),
            "warming up\nresult: ok 123.4/s p50 1.2 ms, verdict ok\n",
            false,
            T,
        );
        assert_eq!(
            (ok.status, ok.message.as_str()),
            (Status::Ok, "123.4/s p50 1.2 ms, verdict ok")
        );
        assert_eq!(
            classify(&Exit::Code(0), "result: probe 1.0/s\n", false, T).status,
            Status::Probe
        );
        let silent = classify(&Exit::Code(0), "something\n", false, T);
        assert_eq!(silent.status, Status::Error);
        assert!(silent.message.contains("without a result line"));
        let oom = classify(
            &Exit::Code(EXIT_OOM),
            "error: CUDA_ERROR_OUT_OF_MEMORY allocating 2 GiB\n",
            false,
            T,
        );
        assert_eq!(
            (oom.status, oom.message.as_str()),
            (Status::Oom, "CUDA_ERROR_OUT_OF_MEMORY allocating 2 GiB")
        );
        let err = classify(&Exit::Code(1), "== header\nerror: bf16 cannot run on cpu\n", false, T);
        assert_eq!(
            (err.status, err.message.as_str()),
            (Status::Error, "bf16 cannot run on cpu")
        );
        let abort = classify(
            &Exit::Signal(libc::SIGABRT),
            "memory allocation of 4294967296 bytes failed\nstack backtrace:\nnote: omitted\n",
            false,
            T,
        );
        assert_eq!(
            (abort.status, abort.message.as_str()),
            (
                Status::Oom,
                "the host ran out of memory: memory allocation of 4294967296 bytes failed"
            )
        );
        assert_eq!(classify(&Exit::Signal(libc::SIGKILL), "", true, T).status, Status::Oom);
        let killed = classify(&Exit::Signal(libc::SIGKILL), "step 3\n", false, T);
        assert_eq!(killed.status, Status::Crashed);
        assert!(
            killed.message.contains("signal 9 (SIGKILL)") && killed.message.contains("step 3"),
            "{}",
            killed.message
        );
        let slow = classify(&Exit::TimedOut, "", false, T);
        assert_eq!(slow.status, Status::Timeout);
        assert!(slow.message.contains("60 s"));
    }
}
