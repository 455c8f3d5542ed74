//! `migprof exec` end to end on the CPU with real programs: Python scripts that report their steps
//! through the helper, through raw lines and through their output, one that reports nothing, and
//! the ways a program can end badly; and its process tree, which never outlives migprof.

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use migprof::results::parts::{read_table, Table};
use polars::prelude::*;

mod common;
use common::*;

/// `migprof exec` into `out` with `flags`, then `--` and `command`.
fn exec(out: &Path, flags: &[&str], command: &[&str]) -> Output {
    migprof()
        .args(["exec", "--device", "cpu", "--out"])
        .arg(out)
        .args(flags)
        .arg("--")
        .args(command)
        .env("PYTHONPATH", repo_path("scripts"))
        .output()
        .expect("migprof runs")
}

/// Fails, never passes, where python3 cannot be run.
fn require_python3() {
    let ok = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "python3 is needed to run the real programs of these tests");
}

fn repo_path(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

fn ints(df: &DataFrame, name: &str) -> Vec<Option<i64>> {
    df.column(name).unwrap().i64().unwrap().iter().collect()
}

fn script(dir: &Path, name: &str, code: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, code).unwrap();
    path.display().to_string()
}

#[test]
#[ignore = "needs python3 (.ci/run has it)"]
fn a_program_reporting_through_the_helper_gets_run_s_row() {
    require_python3();
    let dir = tempfile::tempdir().unwrap();
    let train = script(
        dir.path(),
        "train.py",
        r#"
import time, migprof_steps
with migprof_steps.step(items=4, phase="warmup"):
    time.sleep(0.05)
for _ in range(6):
    with migprof_steps.step(items=4, phase="train"):
        time.sleep(0.01)
print("trained")
"#,
    );
    let out = dir.path().join("out");
    let o = exec(&out, &["--dtype", "bf16"], &["python3", &train]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("trained"),
        "the program's output is shown: {}",
        text(&o)
    );
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.height(), 1);
    assert_eq!(strings(&runs, "model"), ["train"]);
    assert_eq!(strings(&runs, "family"), ["program"]);
    assert_eq!(strings(&runs, "mode"), ["train"]);
    assert_eq!(strings(&runs, "dtype"), ["bf16"]);
    assert_eq!(strings(&runs, "status"), ["ok"]);
    assert_eq!(strings(&runs, "program_steps"), ["protocol"]);
    assert_eq!(ints(&runs, "batch"), [Some(4)]);
    assert_eq!(
        ints(&runs, "iterations"),
        [Some(6)],
        "the marked warm-up step is left out"
    );
    assert_eq!(ints(&runs, "warmup_iterations"), [Some(1)]);
    assert_eq!(ints(&runs, "program_exit_code"), [Some(0)]);
    let p50 = f64s(&runs, "p50_ms")[0];
    assert!((9.0..200.0).contains(&p50), "{p50}");
    // throughput = (1000 / mean latency ms) × items a step.
    let (mean, tp) = (f64s(&runs, "mean_ms")[0], f64s(&runs, "throughput")[0]);
    assert!((tp - 1000.0 / mean * 4.0).abs() < 1e-6 * tp, "{tp} {mean}");
    assert!(strings(&runs, "program_command")[0].ends_with("train.py"));
    assert!(
        runs.column("seed").unwrap().is_null().all(),
        "a program's seed is not migprof's"
    );
    // The output is kept beside the rows.
    let programs: Vec<_> = std::fs::read_dir(out.join("programs")).unwrap().collect();
    assert_eq!(programs.len(), 1);
    let kept = programs[0].as_ref().unwrap().path();
    assert!(std::fs::read_to_string(kept.join("stdout.log"))
        .unwrap()
        .contains("trained"));
    assert_eq!(
        std::fs::read_to_string(kept.join("steps.jsonl"))
            .unwrap()
            .lines()
            .count(),
        7
    );
}

#[test]
fn raw_step_lines_make_a_row_per_phase_and_size_and_rows_already_written_stay() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A shell program that writes the protocol itself: infer steps at two sizes, one too few.
    let lines = "for i in 1 2 3 4; do echo '{\"duration_ms\": 20, \"items\": 8}' >> \"$MIGPROF_STEPS\"; done; \
                 for i in 1 2 3 4; do echo '{\"duration_s\": 0.01, \"items\": 1}' >> \"$MIGPROF_STEPS\"; done; \
                 echo '{\"duration_ms\": 5, \"items\": 2}' >> \"$MIGPROF_STEPS\"";
    let o = exec(&out, &["--name", "serve", "--warmup-steps", "0"], &["sh", "-c", lines]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("1 infer step(s) of 2 item(s) after warm-up left out"),
        "{}",
        text(&o)
    );
    let o = exec(&out, &["--name", "idle"], &["sleep", "0.3"]);
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let runs = runs.sort(["model", "batch"], SortMultipleOptions::default()).unwrap();
    assert_eq!(strings(&runs, "model"), ["idle", "serve", "serve"]);
    assert_eq!(ints(&runs, "batch"), [Some(1), Some(1), Some(8)]);
    assert_eq!(ints(&runs, "iterations"), [Some(1), Some(4), Some(4)]);
    assert_eq!(f64s(&runs, "p50_ms")[1..], [10.0, 20.0]);
    // A program that reported nothing: its one step is its whole run, marked so.
    assert_eq!(strings(&runs, "program_steps"), ["none", "protocol", "protocol"]);
    assert!(f64s(&runs, "mean_ms")[0] >= 300.0);
    assert!(f64s(&runs, "program_wall_s")[0] >= 0.3);
    let ids = strings(&runs, "cell_id");
    assert!(ids[1] != ids[2], "each size is a cell of its own");
    // One program's rows are one measurement, not two runs that shared the device.
    let o = run(&["check", out.to_str().unwrap()]);
    assert!(o.status.success() && text(&o).contains("no problems"), "{}", text(&o));
}

#[test]
#[ignore = "needs python3 (.ci/run has it)"]
fn a_step_pattern_reads_a_program_that_cannot_be_edited() {
    require_python3();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let bench = script(
        dir.path(),
        "bench.py",
        r#"
import sys, time
print("loading")
for i, ms in enumerate([90, 12, 11, 13, 12]):
    time.sleep(ms / 1000)
    print(f"iter {i}: {ms} ms, batch 16", file=sys.stderr if i % 2 else sys.stdout, flush=True)
"#,
    );
    let o = exec(
        &out,
        &["--step-pattern", r"iter \d+: (?P<ms>[0-9.]+) ms, batch (?P<items>\d+)"],
        &["python3", &bench],
    );
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "program_steps"), ["pattern"]);
    assert_eq!(ints(&runs, "iterations"), [Some(4)], "the first step is warm-up");
    assert_eq!(ints(&runs, "batch"), [Some(16)]);
    assert_eq!(f64s(&runs, "max_ms"), [13.0]);
    // A pattern without a time is refused before anything runs.
    let o = exec(&out, &["--step-pattern", r"batch (?P<items>\d+)"], &["python3", &bench]);
    assert!(!o.status.success());
    assert!(text(&o).contains("(?P<ms>"), "{}", text(&o));
}

#[test]
fn bad_programs_get_an_error_or_a_failed_row_naming_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A command that is not there: an error before anything runs, no row.
    let o = exec(&out, &[], &["no-such-program-here", "--flag"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("`no-such-program-here`: no such program"),
        "{}",
        text(&o)
    );
    assert!(!out.join("runs").exists());

    let failed = |flags: &[&str], command: &[&str]| -> (String, String, Output) {
        let before = read_table(&out, Table::Runs).map_or(0, |t| t.height());
        let o = exec(&out, flags, command);
        assert!(!o.status.success(), "{}", text(&o));
        let runs = read_table(&out, Table::Runs).unwrap();
        assert_eq!(runs.height(), before + 1, "one failed row: {}", text(&o));
        let runs = runs.sort(["started_at"], SortMultipleOptions::default()).unwrap();
        let last = |c: &str| strings(&runs, c).last().cloned().unwrap();
        (last("status"), last("error"), o)
    };
    let (status, error, _) = failed(&[], &["sh", "-c", "echo boom >&2; exit 3"]);
    assert_eq!(status, "error");
    assert!(error.contains("exit code 3") && error.contains("boom"), "{error}");

    let (status, error, _) = failed(
        &[],
        &[
            "sh",
            "-c",
            "echo '{\"duration_ms\": 1}' >> \"$MIGPROF_STEPS\"; echo 'step took 3 ms' >> \"$MIGPROF_STEPS\"",
        ],
    );
    assert_eq!(status, "error");
    assert!(
        error.contains("steps.jsonl line 2") && error.contains("not a step line"),
        "{error}"
    );

    let started = Instant::now();
    let (status, error, _) = failed(&["--timeout", "0.5"], &["sleep", "30"]);
    assert_eq!(status, "timeout");
    assert!(error.contains("timeout"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(15));

    let (status, error, _) = failed(&[], &["sh", "-c", "kill -9 $$"]);
    assert_eq!(status, "crashed");
    assert!(error.contains("signal 9 (SIGKILL)"), "{error}");

    let (status, error, _) = failed(&[], &["sh", "-c", "echo '{\"duration_ms\": 1}' >> \"$MIGPROF_STEPS\""]);
    assert_eq!(status, "error");
    assert!(error.contains("had 3 measured steps"), "{error}");
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "family"), vec!["program"; runs.height()]);
}

/// The pids below `root`, from /proc.
fn below(root: u32) -> Vec<u32> {
    let parent = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
    };
    let all: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|p| Some((p, parent(p)?)))
        .collect();
    let (mut found, mut frontier) = (Vec::new(), vec![root]);
    while let Some(p) = frontier.pop() {
        for &(c, _) in all.iter().filter(|(_, pp)| *pp == p) {
            found.push(c);
            frontier.push(c);
        }
    }
    found
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

#[test]
fn no_process_of_the_program_outlives_migprof_even_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let mut migprof = migprof()
        .args(["exec", "--device", "cpu", "--out"])
        .arg(dir.path())
        .args(["--", "sh", "-c", "sleep 300 & setsid sleep 300 & sleep 300"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let root = migprof.id();
    // migprof, its keeper, the shell and three sleepers.
    assert!(
        wait_until(Duration::from_secs(20), || below(root).len() >= 5),
        "{:?}",
        below(root)
    );
    let tree = below(root);
    // SAFETY: kill of our own child.
    unsafe { libc::kill(root as i32, libc::SIGKILL) };
    let _ = migprof.wait();
    assert!(
        wait_until(Duration::from_secs(15), || tree.iter().all(|&p| !alive(p))),
        "still running: {:?}",
        tree.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
}

#[test]
fn what_a_program_leaves_running_is_stopped_and_a_sigterm_reaches_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let started = Instant::now();
    let o = exec(&out, &[], &["sh", "-c", "setsid sleep 300 & exit 0"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("left 1 process(es) running"), "{}", text(&o));
    // Its time is its own, not the stopping of what it left.
    let wall = f64s(&read_table(&out, Table::Runs).unwrap(), "program_wall_s")[0];
    assert!(wall < 1.5, "{wall}");
    assert!(started.elapsed() < Duration::from_secs(20));

    let migprof = migprof()
        .args(["exec", "--device", "cpu", "--out"])
        .arg(&out)
        .args(["--", "sleep", "300"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let root = migprof.id();
    assert!(wait_until(Duration::from_secs(20), || below(root).len() >= 2));
    let tree = below(root);
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(root as i32, libc::SIGTERM) };
    let o = migprof.wait_with_output().unwrap();
    assert!(!o.status.success());
    assert!(tree.iter().all(|&p| !alive(p)));
    let runs = read_table(&out, Table::Runs).unwrap();
    let errors = strings(&runs, "error");
    assert!(
        errors.iter().any(|e| e.contains("got SIGTERM and passed it on")),
        "{errors:?}"
    );
}

#[test]
#[ignore = "needs python3 (.ci/run has it)"]
fn compare_and_the_report_take_a_program_s_rows_as_they_take_migprof_s() {
    require_python3();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let infer = script(
        dir.path(),
        "infer.py",
        r#"
import sys, time, migprof_steps
pause = float(sys.argv[1])
for _ in range(12):
    with migprof_steps.step(items=8):
        time.sleep(pause)
"#,
    );
    for (dtype, pause) in [("f32", "0.02"), ("bf16", "0.01")] {
        let o = exec(
            &out,
            &["--dtype", dtype, "--name", "classify"],
            &["python3", &infer, pause],
        );
        assert!(o.status.success(), "{}", text(&o));
    }
    let o = run(&[
        "compare",
        out.to_str().unwrap(),
        "--baseline",
        "dtype=f32",
        "--target",
        "dtype=bf16",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let cells = json["rows"].as_array().unwrap_or_else(|| panic!("{json}"));
    assert_eq!(cells.len(), 1, "{json}");
    assert_eq!(cells[0]["cell"]["model"], "classify", "{json}");
    let ratio = cells[0]["ratio"].as_f64().unwrap_or_else(|| panic!("{json}"));
    assert!(
        (1.5..2.5).contains(&ratio),
        "half the pause, about twice the items a second: {ratio}"
    );
    let page = report(&[&out], &dir.path().join("report.html"), &[]);
    assert!(page.contains("classify"), "the report names the program");
}

#[test]
#[ignore = "needs python3 (.ci/run has it)"]
fn the_python_step_helper_passes_its_own_tests() {
    require_python3();
    let o = std::process::Command::new("python3")
        .args(["-m", "unittest", "discover", "-s"])
        .arg(repo_path("scripts"))
        .args(["-p", "test_migprof_steps.py", "-v"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Ran 6 tests"), "{}", text(&o));
}

#[test]
fn a_sweep_runs_programs_a_cell_per_batch_and_a_rerun_skips_them() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let steps = r#"for i in 1 2 3 4 5 6; do echo "{\"duration_ms\": $1, \"items\": $1}" >> "$MIGPROF_STEPS"; done"#;
    let file = dir.path().join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            r#"
name = "programs"
[defaults]
timeout_secs = 60
[[targets]]
label = "cpu"
device = "cpu"
[[programs]]
name = "mine"
command = ["sh", "-c", '{steps}', "sh", "{{batch}}"]
batches = [2, 4]
dtype = "f32"
[[programs]]
name = "sizes"
command = ["sh", "-c", '{steps}; echo "{{\"duration_ms\": 1, \"items\": 9}}" >> "$MIGPROF_STEPS"', "sh", "3"]
[[programs]]
name = "bad"
command = ["sh", "-c", "echo broken >&2; printf 'caf\\351\\n' >&2; exit 4"]
"#
        ),
    )
    .unwrap();
    let run_sweep = || {
        migprof()
            .args(["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let o = run_sweep();
    assert!(!o.status.success(), "a failed cell fails the sweep: {}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let runs = runs.sort(["model", "batch"], SortMultipleOptions::default()).unwrap();
    assert_eq!(strings(&runs, "model"), ["bad", "mine", "mine", "sizes"]);
    assert_eq!(strings(&runs, "status"), ["error", "ok", "ok", "ok"]);
    assert_eq!(ints(&runs, "batch")[1..], [Some(2), Some(4), Some(3)]);
    // Each cell's row is its batch's steps, warm-up (the first) left out.
    assert_eq!(ints(&runs, "iterations")[1..], [Some(5), Some(5), Some(5)]);
    assert_eq!(numbers(&runs, "p50_ms")[1..3], [Some(2.0), Some(4.0)]);
    assert_eq!(strings(&runs, "family"), vec!["program"; 4]);
    assert_eq!(strings(&runs, "sweep"), vec!["programs"; 4]);
    let errors = strings(&runs, "error");
    assert!(
        errors[0].contains("exit code 4") && errors[0].contains("broken"),
        "{errors:?}"
    );
    assert!(strings(&runs, "program_command")[0].contains("exit 4"));
    // How the program ended reaches the failed row the sweep writes.
    assert_eq!(ints(&runs, "program_exit_code")[0], Some(4));
    assert!(numbers(&runs, "program_wall_s")[0].is_some_and(|w| w > 0.0));
    // A rerun runs only the failed cell again.
    let o = run_sweep();
    assert!(text(&o).contains("3 skipped (done already)"), "{}", text(&o));
    assert_eq!(read_table(&out, Table::Runs).unwrap().height(), 5);
    // A program that is not there stops the sweep before anything runs.
    let missing = dir.path().join("missing.toml");
    std::fs::write(
        &missing,
        "name = \"m\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[programs]]\nname = \"x\"\ncommand = [\"no-such-program-here\"]\n",
    )
    .unwrap();
    let o = migprof()
        .args(["sweep", missing.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o).contains("[[programs]] `x`") && text(&o).contains("no such program"),
        "{}",
        text(&o)
    );
    assert_eq!(read_table(&out, Table::Runs).unwrap().height(), 5);
}

#[test]
fn a_program_compares_with_migprof_s_engine_on_the_same_model_mode_and_batch() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = run(&[
        "run",
        "--model",
        "resnet_tiny",
        "--batch",
        "4",
        "--device",
        "cpu",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let steps = r#"for i in 1 2 3 4 5 6; do echo '{"duration_ms": 2, "items": 4}' >> "$MIGPROF_STEPS"; done"#;
    let o = exec(&out, &["--name", "resnet_tiny", "--dtype", "f32"], &["sh", "-c", steps]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&[
        "compare",
        out.to_str().unwrap(),
        "--baseline",
        "family=resnet",
        "--target",
        "family=program",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = json["rows"].as_array().unwrap_or_else(|| panic!("{json}"));
    assert_eq!(rows.len(), 1, "{json}");
    assert_eq!(rows[0]["cell"]["model"], "resnet_tiny");
    assert_eq!(rows[0]["cell"]["batch"], "4");
    assert!(
        (rows[0]["target"]["throughput"].as_f64().unwrap() - 2000.0).abs() < 1e-6,
        "{json}"
    );
}

/// The fixture folder of recorded NVML topologies.
fn topology(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/topologies")
        .join(name)
        .display()
        .to_string()
}

/// Pinning as a user pins it, checked on a recorded H100 with four MIG devices (the hardware here has
/// no MIG): the program sees the slice's UUID alone, its row names the slice, and the CPU hides
/// every GPU.
#[test]
fn a_program_is_pinned_to_its_slice_by_uuid_and_the_cpu_hides_the_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let show = ["sh", "-c", "echo \"visible=[$CUDA_VISIBLE_DEVICES]\""];
    let o = migprof()
        .args(["exec", "--device", "3g.40gb", "--sample-interval-ms", "0", "--out"])
        .arg(&out)
        .arg("--")
        .args(show)
        .env("MIGPROF_TOPOLOGY", topology("h100_3g_2g_1g_1g.json"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("visible=[MIG-0a1b2c3d-0001-5e6f-8a9b-0c1d2e3f4a01]"),
        "{}",
        text(&o)
    );
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "device_kind"), ["mig"]);
    assert_eq!(strings(&runs, "mig_profile"), ["3g.40gb"]);
    assert!(
        strings(&runs, "target")[0].ends_with("MIG 3g.40gb"),
        "{:?}",
        strings(&runs, "target")
    );
    let o = exec(&out, &[], &show);
    assert!(text(&o).contains("visible=[]"), "{}", text(&o));
    // A profile no MIG device has is refused before anything runs, naming what there is.
    let o = migprof()
        .args(["exec", "--device", "4g.40gb", "--out"])
        .arg(&out)
        .args(["--", "true"])
        .env("MIGPROF_TOPOLOGY", topology("h100_3g_2g_1g_1g.json"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("3g.40gb"), "{}", text(&o));
    assert_eq!(read_table(&out, Table::Runs).unwrap().height(), 2);
}
