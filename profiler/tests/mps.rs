//! migprof's MPS control daemon against a fake control program (tests/fixtures/fake-mps-control),
//! with this machine's real process table: start with private folders and the GPU pinned, the
//! client's environment, quit, a stale daemon of an earlier migprof, a daemon migprof did not start,
//! a daemon that fails at start or dies while it runs.
//!
//! One test, in order: every case reads the machine's process list, so they must not overlap.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use migprof::mps::daemon::{client_env, Daemon};
use migprof::mps::processes::{Proc, ProcessTable};
use migprof::mps::Share;

fn fake() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control")
}

/// The MPS processes whose pipes are under `base`.
fn ours(base: &Path) -> Vec<(u32, String)> {
    Proc.mps_processes()
        .into_iter()
        .filter(|p| p.is_under(base))
        .map(|p| (p.pid, p.program))
        .collect()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_daemon_life_cycle_against_a_fake_control_program() {
    let base = tempfile::tempdir().unwrap();
    let base = base.path();
    assert!(
        Proc.mps_processes().is_empty(),
        "an MPS daemon already runs on this machine: {:?}",
        Proc.mps_processes()
    );

    // Start: private pipe and log folders under the base, the GPU pinned, a server beside it.
    let daemon = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc).unwrap();
    let pipe = daemon.pipe_dir();
    assert!(pipe.starts_with(base), "{}", pipe.display());
    let env = std::fs::read_to_string(pipe.join("../daemon-env")).unwrap();
    assert!(
        env.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}\n", pipe.display())),
        "{env}"
    );
    assert!(
        env.contains("CUDA_MPS_LOG_DIRECTORY=") && env.contains("CUDA_VISIBLE_DEVICES=GPU-0123abcd-test\n"),
        "{env}"
    );
    let running = ours(base);
    let programs: Vec<&str> = running.iter().map(|(_, p)| p.as_str()).collect();
    assert!(
        programs.contains(&"nvidia-cuda-mps-control") && programs.contains(&"nvidia-cuda-mps-server"),
        "{running:?}"
    );
    assert!(running.iter().any(|(pid, _)| Some(*pid) == daemon.pid()));

    // A client's environment: the pipes, the share, the profile's memory.
    let share = Share {
        profile: Some("1g.10gb".into()),
        percent: 13,
        profile_sms: 16,
        memory_limit_mib: Some(9984),
        memory_fraction: 0.125,
    };
    let client: Vec<String> = client_env(&pipe, &share)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assert_eq!(
        client[1..],
        [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=13".to_string(),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=9984M".to_string()
        ]
    );

    // A second daemon of this process (a sweep's for another GPU) starts beside the first.
    let second = Daemon::start(&fake(), base, "GPU-4567efab-test", &Proc).unwrap();
    // Both control processes and both servers; the second daemon's fork may show a moment later.
    wait_until("both daemons and their servers", || ours(base).len() >= 4);
    second.stop().unwrap();

    // Quit: the daemon and its server are gone, and so are the folders.
    daemon.stop().unwrap();
    wait_until("the fake server to go", || ours(base).is_empty());
    assert!(!pipe.exists());

    // A stale daemon: one whose migprof is gone (its record names a pid that has exited).
    let stale = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc).unwrap();
    let stale_pipe = stale.pipe_dir();
    let control_pid = stale.pid().unwrap();
    std::mem::forget(stale);
    let gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    drop(gone.wait_with_output());
    let record = stale_pipe.parent().unwrap().join("daemon.json");
    let text = std::fs::read_to_string(&record).unwrap().replace(
        &format!("\"owner_pid\": {}", std::process::id()),
        &format!("\"owner_pid\": {gone_pid}"),
    );
    std::fs::write(&record, text).unwrap();
    let e = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("a stale MPS daemon of an earlier migprof still runs") && e.contains(&format!("pid {control_pid}")),
        "{e}"
    );
    assert!(
        e.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}", stale_pipe.display())),
        "{e}"
    );
    // Stopped as the message says, the next start goes ahead and clears the leftovers.
    let mut quit = Command::new(fake())
        .env("CUDA_MPS_PIPE_DIRECTORY", &stale_pipe)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(quit.stdin.as_mut().unwrap(), b"quit\n").unwrap();
    drop(quit.stdin.take());
    quit.wait().unwrap();
    wait_until("the stale daemon to quit", || ours(base).is_empty());
    let fresh = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc).unwrap();
    assert!(!stale_pipe.exists());

    // A daemon that dies while it runs: stopping it says so, and nothing is left behind.
    // SAFETY: a signal to the fake daemon this test started.
    unsafe { libc::kill(fresh.pid().unwrap() as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(100));
    let e = fresh.stop().unwrap_err().to_string();
    assert!(e.contains("had died before migprof stopped it"), "{e}");
    // Its server outlived it (a real control daemon's crash can leave one): still migprof's, and
    // stale though its folder is gone.
    let orphans = ours(base);
    assert_eq!(
        orphans.iter().map(|(_, p)| p.as_str()).collect::<Vec<_>>(),
        ["nvidia-cuda-mps-server"]
    );
    let e = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains(&format!(
            "a stale MPS daemon of an earlier migprof still runs: nvidia-cuda-mps-server (pid {}",
            orphans[0].0
        )),
        "{e}"
    );
    for (pid, _) in &orphans {
        // SAFETY: the fake server of this test.
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
    wait_until("the orphaned fake server to go", || ours(base).is_empty());

    // A daemon that fails at start: the error carries its log.
    std::env::set_var("FAKE_MPS_FAIL", "no GPU");
    let e = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc)
        .err()
        .unwrap()
        .to_string();
    std::env::remove_var("FAKE_MPS_FAIL");
    assert!(
        e.contains("the MPS control daemon exited at start") && e.contains("fake-mps-control: cannot start (no GPU)"),
        "{e}"
    );

    // A daemon migprof did not start (its pipes elsewhere): refused, naming it.
    let mut foreign = Command::new("bash")
        .args(["-c", "exec -a nvidia-cuda-mps-control sleep 30"])
        .env("CUDA_MPS_PIPE_DIRECTORY", "/tmp/somebody-elses-mps")
        .spawn()
        .unwrap();
    wait_until("the foreign daemon to show", || !Proc.mps_processes().is_empty());
    let e = Daemon::start(&fake(), base, "GPU-0123abcd-test", &Proc)
        .err()
        .unwrap()
        .to_string();
    foreign.kill().unwrap();
    foreign.wait().unwrap();
    assert!(e.contains(&format!("another MPS daemon serves this machine: nvidia-cuda-mps-control (pid {}, pipes in /tmp/somebody-elses-mps)", foreign.id())), "{e}");
}
