//! A server command started pinned to the target, as `migprof exec` starts a program (its keeper,
//! the hidden `migprof keep`, is the subreaper of its whole tree and stops it however migprof
//! ends, `kill -9` included), its output kept in `servers/<id>/`, and waited on until its readiness
//! endpoint answers 200.

use std::ffi::OsString;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::endpoint::Endpoint;
use crate::device::ProgramTarget;
use crate::program::keeper::Ended;
use crate::program::{launch, tree};
use crate::provenance;

/// Where a started server's files go under the results folder.
pub const SERVERS_DIR: &str = "servers";

/// A server migprof started and must stop.
pub struct Started {
    keeper: Child,
    /// Closed when migprof ends, however it ends: the keeper then stops the server's tree.
    watch: Option<OwnedFd>,
    copies: Vec<std::thread::JoinHandle<()>>,
    ended_file: PathBuf,
    /// `servers/<id>/`: its output and how it ended.
    pub dir: PathBuf,
    /// The command line as the user gave it.
    pub command: String,
}

/// How long a readiness poll waits between tries.
const POLL: Duration = Duration::from_millis(200);

impl Started {
    /// Starts `command` (run by `sh -c`, as a shell line is given: [`shell_line`]) on `target`, its output to files
    /// under `out`/servers/<id>/.
    pub fn start(command: &str, target: &ProgramTarget, out: &Path) -> Result<Started> {
        let id = provenance::run_id(provenance::now());
        let dir = out.join(SERVERS_DIR).join(&id);
        std::fs::create_dir_all(&dir).map_err(|e| crate::files::io_error(e, &dir))?;
        let ended_file = dir.join("ended.json");
        let argv: Vec<OsString> = ["sh", "-c", &shell_line(command)].map(OsString::from).to_vec();
        let (mut keeper, watch) = launch::start_keeper(&argv, target, None, &ended_file)?;
        let mut copies = Vec::new();
        for (stream, name) in [
            (
                keeper
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                "stdout.log",
            ),
            (
                keeper
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                "stderr.log",
            ),
        ] {
            let path = dir.join(name);
            let mut file = File::create(&path).map_err(|e| crate::files::io_error(e, &path))?;
            if let Some(mut stream) = stream {
                copies.push(std::thread::spawn(move || {
                    let _ = std::io::copy(&mut stream, &mut file);
                }));
            }
        }
        Ok(Started {
            keeper,
            watch: Some(watch),
            copies,
            ended_file,
            dir,
            command: command.to_string(),
        })
    }

    /// Waits until `path` answers 200, at most `timeout`; an error, with the server's last lines,
    /// if it ended first or never answered.
    pub fn wait_ready(&mut self, endpoint: &Endpoint, path: &str, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        let agent = endpoint.agent();
        loop {
            if self.keeper.try_wait()?.is_some() {
                let ended = Ended::read(&self.ended_file).map(|e| e.describe()).unwrap_or_default();
                bail!(
                    "the server ended before it was ready ({ended}); its last lines:\n{}",
                    self.last_lines(20)
                );
            }
            let last = match endpoint.get(&agent, path) {
                Ok(a) if a.status == 200 => return Ok(started.elapsed()),
                Ok(a) => format!("HTTP {}: {}", a.status, a.text(200)),
                Err(e) => e.0,
            };
            if started.elapsed() >= timeout {
                bail!(
                    "the server was not ready within {} s (GET {}{path}: {last}); its last lines:\n{}",
                    timeout.as_secs_f64(),
                    endpoint.url,
                    self.last_lines(20)
                );
            }
            std::thread::sleep(POLL);
        }
    }

    /// Whether the server still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.keeper.try_wait(), Ok(None))
    }

    /// The server's processes now (the keeper's tree, the keeper left out).
    pub fn pids(&self) -> std::collections::BTreeSet<u32> {
        tree::descendants(self.keeper.id()).into_iter().collect()
    }

    /// The last `n` lines the server wrote, stdout's then stderr's.
    pub fn last_lines(&self, n: usize) -> String {
        let mut lines = Vec::new();
        for name in ["stdout.log", "stderr.log"] {
            let text = std::fs::read(self.dir.join(name)).unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            let all: Vec<&str> = text.lines().collect();
            lines.extend(all[all.len().saturating_sub(n)..].iter().map(|l| l.to_string()));
        }
        lines.join("\n")
    }

    /// Stops the server's whole tree: SIGTERM through its keeper, SIGKILL to what is left after
    /// the keeper's grace. How it ended.
    pub fn stop(mut self) -> Ended {
        self.stop_now()
    }

    fn stop_now(&mut self) -> Ended {
        let seen: Vec<u32> = self.pids().into_iter().collect();
        if matches!(self.keeper.try_wait(), Ok(None)) {
            tree::signal(&[self.keeper.id()], libc::SIGTERM);
        }
        let _ = self.keeper.wait();
        let ended = Ended::read(&self.ended_file);
        if ended.is_err() {
            // The keeper ended without its word: what it kept may still run.
            tree::signal(&seen, libc::SIGKILL);
        }
        self.watch = None;
        for c in self.copies.drain(..) {
            let _ = c.join();
        }
        ended.unwrap_or_default()
    }
}

/// The line `sh -c` runs: a single command takes the shell's place (`exec`), so that the server
/// itself gets the SIGTERM and the keeper's grace to unload its models, not a shell that dies at
/// once and leaves it as an orphan to be killed; a compound line (`;`, `&`, `|`, parentheses) runs
/// as given.
fn shell_line(command: &str) -> String {
    let compound = command.contains([';', '&', '|', '(', ')', '`', '\n']);
    match compound || command.trim_start().starts_with("exec ") {
        true => command.to_string(),
        false => format!("exec {command}"),
    }
}

/// A server left running by an error on the way is stopped as it would be at the end.
impl Drop for Started {
    fn drop(&mut self) {
        if self.watch.is_some() {
            self.stop_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_command_takes_the_shell_s_place() {
        assert_eq!(
            shell_line("python serve.py --port 8000"),
            "exec python serve.py --port 8000"
        );
        assert_eq!(shell_line("exec tritonserver"), "exec tritonserver");
        assert_eq!(shell_line("cd m && python serve.py"), "cd m && python serve.py");
        assert_eq!(shell_line("a | b"), "a | b");
        assert_eq!(shell_line("a; b"), "a; b");
    }
}
