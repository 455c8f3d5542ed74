//! The keeper: a small process of this same binary (`migprof keep`, hidden) between migprof and the
//! program it measures, whose one job is that no process of the program outlives the measurement.
//!
//! It is the program's tree's subreaper, so a process whose parent ends stays below it; it starts
//! the program in a process group of its own and passes it the signals migprof forwards (SIGINT,
//! SIGTERM, SIGHUP; SIGTERM followed by SIGKILL to the whole tree when the program has not ended
//! [`TERM_GRACE`] later). When the program ends, whatever it left running is stopped. And it
//! watches a pipe whose other end only migprof holds: when that pipe closes without a word, migprof
//! is gone (even by `kill -9`), and the keeper stops the whole tree and ends. How the program ended
//! goes to a small JSON file migprof reads ([`Ended`]).

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::tree;

/// The descriptor the keeper finds its watch pipe's read end on.
pub const WATCH_FD: i32 = 3;

/// How long a program has to end after a SIGTERM before its tree is killed: `docker stop`'s grace,
/// which a server that unloads its models needs (PyTriton's took up to 5 s on 2 cores).
pub const TERM_GRACE: Duration = Duration::from_secs(10);

/// How long what a program left running has to end after a SIGTERM before it is killed.
const LEFTOVER_GRACE: Duration = Duration::from_secs(2);

/// How the program ended, as the keeper tells migprof.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ended {
    /// The program's process id.
    pub pid: Option<u32>,
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    /// Processes it left running when it ended, which the keeper stopped.
    pub left_running: usize,
    /// Seconds from its start to its end, before what it left running was stopped.
    #[serde(default)]
    pub wall_secs: Option<f64>,
    /// Why it could not be started.
    pub error: Option<String>,
}

impl Ended {
    pub fn read(path: &Path) -> anyhow::Result<Ended> {
        let text = std::fs::read_to_string(path)?;
        Ok(serde_json::from_str(&text)?)
    }

    fn write(&self, path: &Path) {
        let text = serde_json::to_string(self).unwrap_or_default();
        if let Err(e) = crate::files::write_atomically(path, text.as_bytes()) {
            eprintln!("migprof keep: {e:#}");
        }
    }

    /// How it ended in words, after "the program": `exit code 0`, `killed by signal 9 (SIGKILL)`.
    pub fn describe(&self) -> String {
        match (self.code, self.signal, &self.error) {
            (_, _, Some(e)) => e.clone(),
            (Some(c), _, _) => format!("exit code {c}"),
            (None, Some(s), _) => format!("killed by signal {s} ({})", signal_name(s)),
            _ => "ended without a status".into(),
        }
    }
}

/// A signal's name, for the ones a program is ended by.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// The program's process group, for the signal handler (0: not started).
static PROGRAM: AtomicI32 = AtomicI32::new(0);
/// A SIGTERM arrived: the program has [`TERM_GRACE`] to end.
static TERMINATED: AtomicBool = AtomicBool::new(false);

extern "C" fn forward(signal: libc::c_int) {
    let group = PROGRAM.load(Ordering::SeqCst);
    if signal == libc::SIGTERM {
        TERMINATED.store(true, Ordering::SeqCst);
    }
    if group > 0 {
        // SAFETY: kill is async-signal-safe.
        unsafe { libc::kill(-group, signal) };
    }
}

/// `migprof keep --status FILE -- COMMAND…`: runs the program, keeps its tree, writes how it ended.
pub fn keep(status: &Path, command: &[OsString]) -> ExitCode {
    let me = std::process::id();
    // SAFETY: plain flag settings of this process.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
        // The watch pipe is the keeper's alone: the program must not hold it open.
        libc::fcntl(WATCH_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::signal(s, forward as extern "C" fn(libc::c_int) as libc::sighandler_t);
        }
    }
    std::thread::spawn(move || watch_migprof(me));
    let Some((program, args)) = command.split_first() else {
        Ended {
            error: Some("could not start: no command given".into()),
            ..Ended::default()
        }
        .write(status);
        return ExitCode::FAILURE;
    };
    let mut cmd = Command::new(program);
    cmd.args(args).process_group(0);
    // SAFETY: between fork and exec, only async-signal-safe calls: dispositions reset to their
    // defaults, and the program killed should the keeper itself be killed (then nobody would stop
    // it; its own children are the tree the keeper cannot reach any more).
    unsafe {
        cmd.pre_exec(move || {
            for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(s, libc::SIG_DFL);
            }
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() as u32 != me {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            Ended {
                error: Some(format!("could not start: `{}`: {e}", program.to_string_lossy())),
                ..Ended::default()
            }
            .write(status);
            return ExitCode::FAILURE;
        }
    };
    let pid = child.id();
    PROGRAM.store(pid as i32, Ordering::SeqCst);
    let mut term_at: Option<Instant> = None;
    let exit = loop {
        match child.try_wait() {
            Ok(Some(exit)) => break Some(exit),
            Ok(None) => {}
            Err(_) => break None,
        }
        if TERMINATED.load(Ordering::SeqCst) {
            let since = *term_at.get_or_insert_with(Instant::now);
            if since.elapsed() >= TERM_GRACE {
                tree::signal(&tree::descendants(me), libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let wall_secs = Some(started.elapsed().as_secs_f64());
    PROGRAM.store(0, Ordering::SeqCst);
    let left_running = tree::stop_below(me, LEFTOVER_GRACE);
    Ended {
        pid: Some(pid),
        code: exit.and_then(|e| e.code()),
        signal: exit.and_then(|e| e.signal()),
        left_running,
        wall_secs,
        error: None,
    }
    .write(status);
    ExitCode::SUCCESS
}

/// Blocks on the watch pipe, which migprof never writes to: its end means migprof has ended, and
/// with it the measurement, so the tree is stopped and the keeper ends.
fn watch_migprof(me: u32) {
    let mut byte = 0u8;
    loop {
        // SAFETY: reads at most one byte into a local.
        let n = unsafe { libc::read(WATCH_FD, (&mut byte as *mut u8).cast(), 1) };
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        break;
    }
    PROGRAM.store(0, Ordering::SeqCst);
    tree::stop_below(me, LEFTOVER_GRACE);
    std::process::exit(1);
}
