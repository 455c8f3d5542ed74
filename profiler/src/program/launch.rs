//! A program started pinned to its target under its keeper, watched until it ends: its output shown
//! and kept (and read for steps by a pattern), the target sampled, its processes followed, the
//! timeout and the signals migprof gets passed on. What it comes to is an [`Outcome`].

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};

use super::keeper::{Ended, WATCH_FD};
use super::steps::{self, Pattern, Step, STEPS_ENV};
use super::{tree, ProgramOptions};
use crate::device::ProgramTarget;
use crate::gpu::sampler::Sample;
use crate::provenance;
use crate::run::subject::StepsFrom;

/// The folder of a program's run in a results folder: its output, its step file and how it ended.
pub const PROGRAMS_DIR: &str = "programs";

/// What a program's run came to.
pub struct Outcome {
    pub run_id: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub wall: Duration,
    /// How it ended, as its keeper saw it.
    pub ended: Ended,
    /// It ran past the timeout and was stopped.
    pub timed_out: bool,
    /// The signal migprof got and passed on, if one did.
    pub interrupted: Option<i32>,
    /// The steps it reported, in order, and where they came from.
    pub steps: Vec<Step>,
    pub steps_from: StepsFrom,
    /// Lines that were no step, each with its place (`steps.jsonl:3: …`).
    pub malformed: Vec<String>,
    /// The sampler's readings, or why there are none; `None`: no sampler.
    pub metrics: Option<Result<Vec<Sample>>>,
    /// Every process of its tree seen while it ran.
    pub pids: BTreeSet<u32>,
    /// Its folder: `stdout.log`, `stderr.log`, `steps.jsonl`, `ended.json`.
    pub dir: PathBuf,
}

impl Outcome {
    /// The last lines of its standard error (else its output) on one line, `|` between them, for a
    /// row that says why it failed.
    pub fn last_lines(&self, n: usize) -> String {
        for name in ["stderr.log", "stdout.log"] {
            let bytes = std::fs::read(self.dir.join(name)).unwrap_or_default();
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if !lines.is_empty() {
                return lines[lines.len().saturating_sub(n)..].join(" | ");
            }
        }
        String::new()
    }
}

/// The command's program as the keeper will find it: a path that is an executable file, or a name
/// on PATH. Checked before anything starts, so that a typo is an error naming it.
pub fn check_command<S: AsRef<std::ffi::OsStr>>(command: &[S]) -> Result<()> {
    let Some(program) = command.first() else {
        bail!("no command: give the program after `--`, e.g. migprof exec --device cpu -- python3 train.py");
    };
    let executable = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let program = program.as_ref();
    let path = Path::new(program);
    let found = if path.components().count() > 1 {
        executable(path)
    } else {
        std::env::var_os("PATH").is_some_and(|paths| std::env::split_paths(&paths).any(|d| executable(&d.join(path))))
    };
    if !found {
        bail!(
            "`{}`: no such program ({}): give a path to an executable file, or a program on PATH",
            program.to_string_lossy(),
            if path.components().count() > 1 {
                "not an executable file"
            } else {
                "not on PATH"
            }
        );
    }
    Ok(())
}

/// How often the program's tree is read while it runs (its pids, for what NVML lists on the device).
const TREE_READ: Duration = Duration::from_millis(250);

/// The signal migprof got while a program ran (0: none), for its handler.
static GOT: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_signal(signal: libc::c_int) {
    GOT.store(signal, Ordering::SeqCst);
}

/// The run's folder under `out`, made, with its step file (empty: the program appends) and where its
/// keeper writes how it ended.
fn program_folder(out: &Path, run_id: &str) -> Result<(PathBuf, PathBuf, PathBuf)> {
    let dir = out.join(PROGRAMS_DIR).join(run_id);
    std::fs::create_dir_all(&dir).map_err(|e| crate::files::io_error(e, &dir))?;
    let step_file = dir.join("steps.jsonl");
    File::create(&step_file).map_err(|e| crate::files::io_error(e, &step_file))?;
    let ended_file = dir.join("ended.json");
    Ok((dir, step_file, ended_file))
}

/// Sets what SIGINT, SIGTERM and SIGHUP do to migprof while a program runs: noted and passed on
/// ([`note_signal`]), then the default again.
fn set_signals(action: libc::sighandler_t) {
    for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: setting a disposition; the handler only stores to an atomic.
        unsafe { libc::signal(s, action) };
    }
}

/// Runs the program to its end on `target`, its run's files under `out`/programs/<run id>.
pub fn run(options: &ProgramOptions, target: &ProgramTarget, out: &Path) -> Result<Outcome> {
    check_command(&options.command)?;
    let started_at = provenance::now();
    let run_id = provenance::run_id(started_at);
    let (dir, step_file, ended_file) = program_folder(out, &run_id)?;
    GOT.store(0, Ordering::SeqCst);
    set_signals(note_signal as extern "C" fn(libc::c_int) as libc::sighandler_t);
    let clock = Instant::now();
    let (mut keeper, watch_write) = start_keeper(&options.command, target, Some(&step_file), &ended_file)?;
    let sampler = match (&target.info.selected, options.sample_interval) {
        (Some(selected), Some(interval)) => Some(crate::run::execute::start_nvml_sampler(selected.clone(), interval)),
        _ => None,
    };
    let pattern_steps = Arc::new(Mutex::new(PatternSteps::default()));
    let tees = [
        tee(
            keeper.stdout.take(),
            Box::new(std::io::stdout()),
            &dir.join("stdout.log"),
            options,
            &pattern_steps,
            "stdout",
        )?,
        tee(
            keeper.stderr.take(),
            Box::new(std::io::stderr()),
            &dir.join("stderr.log"),
            options,
            &pattern_steps,
            "stderr",
        )?,
    ];
    let watched = watch(&mut keeper, options.timeout);
    let ended = Ended::read(&ended_file);
    if let (Err(_), Ok((pids, _, _))) = (&ended, &watched) {
        // The keeper ended without its word (killed): what it kept may still run, and hold the
        // output pipes the copies below wait on. Its processes were seen moments ago.
        tree::signal(&pids.iter().copied().collect::<Vec<_>>(), libc::SIGKILL);
    }
    // The keeper has ended: what it started is gone, and the pipe that watched migprof can close.
    drop(watch_write);
    for t in tees {
        let _ = t.join();
    }
    let metrics = sampler.map(|s| s.stop());
    set_signals(libc::SIG_DFL);
    let (pids, timed_out, interrupted) = watched?;
    let ended = ended.unwrap_or_else(|e| Ended {
        error: Some(format!(
            "was left without its keeper, which ended without saying how the program did ({e:#}); migprof stopped the processes it had seen"
        )),
        ..Ended::default()
    });
    // The program's own time, without the stopping of what it left running.
    let wall = ended.wall_secs.map_or(clock.elapsed(), Duration::from_secs_f64);
    let (steps, steps_from, malformed) = match &options.pattern {
        Some(_) => pattern_steps.lock().unwrap_or_else(|e| e.into_inner()).in_order(),
        None => read_step_file(&step_file, options.mode)?,
    };
    let steps_from = if steps.is_empty() { StepsFrom::None } else { steps_from };
    Ok(Outcome {
        run_id,
        started_at,
        finished_at: provenance::now(),
        wall,
        ended,
        timed_out,
        interrupted,
        steps,
        steps_from,
        malformed,
        metrics,
        pids,
        dir,
    })
}

/// Starts the keeper with the program: its environment the user's with the target's pinning and
/// the step file (a program's, not a server's), its output piped to migprof, its watch pipe's read end on [`WATCH_FD`]. The
/// keeper, and the write end of its watch pipe, which only migprof holds.
pub fn start_keeper(
    command: &[std::ffi::OsString],
    target: &ProgramTarget,
    step_file: Option<&Path>,
    ended_file: &Path,
) -> Result<(Child, OwnedFd)> {
    let (watch_read, watch_write) = watch_pipe()?;
    let exe = std::env::current_exe().context("finding this migprof to start the program's keeper")?;
    let mut cmd = Command::new(exe);
    cmd.arg("keep")
        .arg("--status")
        .arg(ended_file)
        .arg("--")
        .args(command)
        .envs(target.env.iter().map(|(k, v)| (k, v)))
        .envs(step_file.map(|f| (STEPS_ENV, f)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group: a Ctrl-C reaches migprof, which passes it on once.
        .process_group(0);
    let read_fd = watch_read.as_raw_fd();
    // SAFETY: between fork and exec, dup2 only (async-signal-safe).
    unsafe {
        cmd.pre_exec(move || {
            // dup2 onto itself keeps close-on-exec set, so clear it there.
            let moved = if read_fd == WATCH_FD {
                libc::fcntl(WATCH_FD, libc::F_SETFD, 0)
            } else {
                libc::dup2(read_fd, WATCH_FD)
            };
            if moved < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let keeper = cmd.spawn().context("starting the program's keeper")?;
    drop(watch_read);
    Ok((keeper, watch_write))
}

/// The pipe the keeper watches: its read end for the keeper, its write end held by migprof alone
/// (both close on exec, so no other child inherits the write end and keeps it open).
fn watch_pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors, owned from here on.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("creating the keeper's pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors nobody else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Waits for the keeper: passes on the signals migprof gets, stops the program at the timeout, and
/// follows the program's tree. Every pid seen, whether the timeout struck, the signal passed on.
fn watch(keeper: &mut Child, timeout: Option<Duration>) -> Result<(BTreeSet<u32>, bool, Option<i32>)> {
    let started = Instant::now();
    let kpid = keeper.id();
    let mut pids = BTreeSet::new();
    let (mut timed_out, mut interrupted) = (false, None);
    // Reading the tree reads every process's stat: a few times a second, so that a host of many
    // processes does not lend the program's CPU to the watch.
    let mut last_read: Option<Instant> = None;
    loop {
        if keeper.try_wait()?.is_some() {
            return Ok((pids, timed_out, interrupted));
        }
        if last_read.is_none_or(|t| t.elapsed() >= TREE_READ) {
            pids.extend(tree::descendants(kpid));
            last_read = Some(Instant::now());
        }
        let got = GOT.swap(0, Ordering::SeqCst);
        if got != 0 {
            interrupted = Some(got);
            tree::signal(&[kpid], got);
        }
        if !timed_out && timeout.is_some_and(|t| started.elapsed() >= t) {
            timed_out = true;
            // The keeper passes it on and kills the tree if the program lingers.
            tree::signal(&[kpid], libc::SIGTERM);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Steps a pattern found in the output, each with when it was read (the two streams are read
/// apart: their steps are put in order by it), and the lines it matched that were no step.
#[derive(Default)]
struct PatternSteps {
    steps: Vec<(Instant, Step)>,
    malformed: Vec<String>,
}

/// Copies a stream of the program's output to migprof's own and to `log`, line by line, reading
/// steps from it where a pattern is given.
fn tee(
    stream: Option<impl Read + Send + 'static>,
    mut shown: Box<dyn Write + Send>,
    log: &Path,
    options: &ProgramOptions,
    found: &Arc<Mutex<PatternSteps>>,
    name: &'static str,
) -> Result<std::thread::JoinHandle<()>> {
    let file = File::create(log).map_err(|e| crate::files::io_error(e, log))?;
    let (pattern, mode, found) = (options.pattern.clone(), options.mode, Arc::clone(found));
    Ok(std::thread::spawn(move || {
        let Some(mut stream) = stream else { return };
        // Copied as it comes, in chunks (a progress bar's `\r` shows at once, a line of any length
        // costs no more than its bytes); lines are cut out only for the pattern.
        let mut file = std::io::BufWriter::new(file);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut lines = LineReader::default();
        loop {
            let n = match stream.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let _ = shown.write_all(&chunk[..n]).and_then(|_| shown.flush());
            let _ = file.write_all(&chunk[..n]);
            if let Some(p) = &pattern {
                lines.feed(&chunk[..n], |number, text| {
                    read_step(p, mode, &found, name, number, text)
                });
            }
        }
        if let Some(p) = &pattern {
            lines.finish(|number, text| read_step(p, mode, &found, name, number, text));
        }
        let _ = file.flush();
    }))
}

impl PatternSteps {
    /// The steps in the order they were read, and the lines that were no step.
    fn in_order(&mut self) -> (Vec<Step>, StepsFrom, Vec<String>) {
        let mut steps = std::mem::take(&mut self.steps);
        steps.sort_by_key(|(read, _)| *read);
        let steps = steps.into_iter().map(|(_, s)| s).collect();
        (steps, StepsFrom::Pattern, std::mem::take(&mut self.malformed))
    }
}

/// A line of output read by the pattern: a step, no step, or a line the pattern matched that is no
/// step (kept with its place).
fn read_step(p: &Pattern, mode: workloads::Mode, found: &Mutex<PatternSteps>, name: &str, number: usize, text: &str) {
    let mut found = found.lock().unwrap_or_else(|e| e.into_inner());
    match p.step(text, mode) {
        Ok(Some(step)) => found.steps.push((Instant::now(), step)),
        Ok(None) => {}
        Err(e) => found.malformed.push(format!("{name} line {number}: {e}: {text}")),
    }
}

/// Output cut into lines as it arrives in chunks; a line longer than [`LineReader::LONGEST`] is
/// read as its first part (no step line is that long), so that no output grows memory.
#[derive(Default)]
struct LineReader {
    partial: Vec<u8>,
    number: usize,
}

impl LineReader {
    const LONGEST: usize = 64 * 1024;

    fn feed(&mut self, mut bytes: &[u8], mut each: impl FnMut(usize, &str)) {
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            self.take(&bytes[..end]);
            self.emit(&mut each);
            bytes = &bytes[end + 1..];
        }
        self.take(bytes);
    }

    fn finish(&mut self, mut each: impl FnMut(usize, &str)) {
        if !self.partial.is_empty() {
            self.emit(&mut each);
        }
    }

    fn take(&mut self, bytes: &[u8]) {
        let room = Self::LONGEST.saturating_sub(self.partial.len());
        self.partial.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn emit(&mut self, each: &mut impl FnMut(usize, &str)) {
        self.number += 1;
        let text = String::from_utf8_lossy(&self.partial);
        each(self.number, text.trim_end_matches(['\r', ' ', '\t']));
        self.partial.clear();
    }
}

/// The steps in the step file, and each line that was none, with its number.
fn read_step_file(path: &Path, mode: workloads::Mode) -> Result<(Vec<Step>, StepsFrom, Vec<String>)> {
    // A program may remove its step file, or write bytes that are no text: no steps, or lines that
    // are no step, never a run without a row.
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(crate::files::io_error(e, path)),
    };
    let text = String::from_utf8_lossy(&bytes);
    let (mut found, mut malformed) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        match steps::parse_line(line, mode) {
            Ok(Some(s)) => found.push(s),
            Ok(None) => {}
            Err(e) => malformed.push(format!("steps.jsonl line {}: {e}", i + 1)),
        }
    }
    Ok((found, StepsFrom::Protocol, malformed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_into_lines_across_chunks_and_long_lines_are_bounded() {
        let mut lines = LineReader::default();
        let mut got = Vec::new();
        lines.feed(b"iter 1: 12 ms\r\niter 2: ", |n, t| got.push((n, t.to_string())));
        lines.feed(b"13 ms\nlast", |n, t| got.push((n, t.to_string())));
        lines.finish(|n, t| got.push((n, t.to_string())));
        assert_eq!(
            got,
            [
                (1, "iter 1: 12 ms".to_string()),
                (2, "iter 2: 13 ms".to_string()),
                (3, "last".to_string())
            ]
        );
        let mut long = LineReader::default();
        let mut len = 0;
        long.feed(&vec![b'x'; 3 * LineReader::LONGEST], |_, _| {});
        long.feed(b"\n", |_, t| len = t.len());
        assert_eq!(len, LineReader::LONGEST);
    }
}
