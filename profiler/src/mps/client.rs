//! An emulated slice's command: the process the user started becomes the keeper of migprof's MPS
//! daemon and runs the same command again as the daemon's client, which measures.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::daemon::CLIENT_PIPE_ENV;
use super::MpsTarget;

/// This process is a client of migprof's MPS daemon: the daemon's keeper set its pipes.
pub fn is_client() -> bool {
    std::env::var_os(CLIENT_PIPE_ENV).is_some()
}

/// `migprof run` or `load` with `--device mps:…` when this process is no MPS client yet
/// ([`is_client`]): starts migprof's MPS daemon
/// for the target's GPU, runs this same command again as its client, and stops the daemon when that
/// ends, also after Ctrl-C (which reaches the client and ends its runs; the daemon has its own
/// process group). The daemon's starter never opens a CUDA context of its own.
pub fn run_as_client(target: &MpsTarget, log: &mut dyn Write) -> Result<ExitCode> {
    // From here on this process cleans up whatever ends the run: a Ctrl-C is the client's to act on
    // (it reaches the whole foreground group) and is ignored here; a SIGTERM is passed on to the
    // client. Both are restored in the client.
    // SAFETY: setting dispositions; the handler only reads an atomic and calls kill, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(
            libc::SIGTERM,
            forward_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let (selected, share, daemon) = super::start_daemon(target)?;
    let memory = match target.memory {
        super::MemoryEmulation::Alone => {
            "MPS shares neither L2 nor memory bandwidth: an emulated slice alone is faster than a real one"
        }
        super::MemoryEmulation::Partitioned => {
            "a memory-system neighbour on the other SMs holds its bandwidth to the profile's share"
        }
    };
    writeln!(
        log,
        "MPS: migprof's control daemon (pid {}) serves {}; the runs are its client with {} ({memory})",
        daemon.pid().unwrap_or(0),
        selected.gpu.name,
        share.describe()
    )?;
    let exe = std::env::current_exe().context("finding this migprof to run as the MPS client")?;
    let mut client = std::process::Command::new(exe);
    client
        .args(std::env::args_os().skip(1))
        .env(CLIENT_PIPE_ENV, daemon.pipe_dir());
    // SAFETY: between fork and exec, only resetting dispositions.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut client, || {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            Ok(())
        });
    }
    let status = client.spawn().and_then(|mut c| {
        MPS_CLIENT.store(c.id() as i32, std::sync::atomic::Ordering::SeqCst);
        c.wait()
    });
    let stopped = daemon.stop();
    writeln!(log, "MPS: daemon stopped")?;
    stopped?;
    let status = status.context("running migprof as the MPS client")?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(c.clamp(1, 255) as u8),
        None => ExitCode::FAILURE,
    })
}

/// The pid of `run_under_mps`'s client, for its SIGTERM handler (0: none yet).
static MPS_CLIENT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_sigterm(_: libc::c_int) {
    let pid = MPS_CLIENT.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; the pid is our child's.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}
