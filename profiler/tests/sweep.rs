//! `migprof sweep` end to end on CPU, started as a user starts it: cells that fail leave one row each
//! with the right status, an interrupted sweep resumes without a duplicate or a missing cell, `max`
//! finds the largest batch under a memory cap, file errors name the line and key, `--jobs` never runs
//! two cells on one device at once.

use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use migprof::results::parts::{read_table, Table};
use polars::prelude::*;

mod common;
use common::*;

fn sweep(file: &Path, out: &Path, extra: &[&str]) -> Output {
    migprof()
        .arg("sweep")
        .arg(file)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("migprof runs")
}

/// (cell_id, status, error) of every row, in the order of the parts.
fn rows(out: &Path) -> Vec<(String, String, String)> {
    let runs = read_table(out, Table::Runs).unwrap();
    let (ids, statuses, errors) = (
        strings(&runs, "cell_id"),
        strings(&runs, "status"),
        strings(&runs, "error"),
    );
    ids.into_iter()
        .zip(statuses)
        .zip(errors)
        .map(|((i, s), e)| (i, s, e))
        .collect()
}

fn write(dir: &Path, text: &str) -> std::path::PathBuf {
    let path = dir.join("sweep.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn every_cell_leaves_one_row_with_how_it_ended() {
    let dir = tempfile::tempdir().unwrap();
    // bf16 has no matmul on candle's CPU: an error. The slow cell is killed at its 3 s timeout.
    let file = write(
        dir.path(),
        r#"
name = "endings"
[defaults]
warmup_secs = 0.1
duration_secs = 0.3
timeout_secs = 3
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["resnet_tiny"]
dtypes = ["f32", "bf16"]
batches = [2]
[[matrix]]
models = ["resnet18"]
modes = ["train"]
batches = [64]
"#,
    );
    let out = dir.path().join("out");
    let o = sweep(&file, &out, &[]);
    assert!(!o.status.success(), "a failed cell fails the sweep's exit status");
    let log = text(&o);
    let rows = rows(&out);
    assert_eq!(rows.len(), 3, "{log}");
    let by_status: HashMap<&str, &(String, String, String)> = rows.iter().map(|r| (r.1.as_str(), r)).collect();
    assert!(by_status.contains_key("ok"), "{rows:?}");
    assert!(by_status["error"].2.contains("BF16"), "{rows:?}");
    assert!(by_status["timeout"].2.contains("3 s"), "{rows:?}");
    assert!(
        log.contains("1 ok") && log.contains("1 error") && log.contains("1 timeout"),
        "{log}"
    );
    // Measurement columns are null unless ok.
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.column("throughput").unwrap().null_count(), 2);
    // Each child's output is kept.
    for (id, _, _) in &rows {
        assert!(out.join("logs").join(format!("{id}.log")).is_file());
    }
    // A rerun runs the failed cells again and skips the ok one.
    let again = sweep(&file, &out, &["--only", "model=resnet_tiny"]);
    assert!(text(&again).contains("1 skipped"), "{}", text(&again));
}

/// A sweep of one CPU cell that measures for a minute, started in the background, and the pid of its
/// cell's process once it runs (the sweep's only child).
fn sweep_with_a_long_cell(dir: &Path, name: &str) -> (std::process::Child, i32, std::path::PathBuf) {
    let file = write(
        dir,
        &format!(
            r#"
name = "{name}"
[defaults]
warmup_secs = 0.1
duration_secs = 60
timeout_secs = 120
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["resnet_tiny"]
batches = [1]
"#
        ),
    );
    let out = dir.join("out");
    let parent = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let child = loop {
        let children =
            std::fs::read_to_string(format!("/proc/{}/task/{}/children", parent.id(), parent.id())).unwrap_or_default();
        if let Some(pid) = children.split_whitespace().next() {
            break pid.parse::<i32>().unwrap();
        }
        assert!(Instant::now() < deadline, "no child started");
        std::thread::sleep(Duration::from_millis(50));
    };
    // Into its measurement.
    std::thread::sleep(Duration::from_millis(500));
    (parent, child, out)
}

#[test]
fn a_killed_cell_is_crashed_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (mut parent, child, out) = sweep_with_a_long_cell(dir.path(), "killed");
    // SAFETY: kill(2) on a process this test's sweep started.
    unsafe { libc::kill(child, libc::SIGKILL) };
    parent.wait().unwrap();
    let rows = rows(&out);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].1, "crashed", "{rows:?}");
    assert!(rows[0].2.contains("signal 9 (SIGKILL)"), "{rows:?}");
}

#[test]
fn a_sweep_killed_mid_cell_leaves_no_cell_running_and_no_row() {
    let dir = tempfile::tempdir().unwrap();
    let (mut parent, child, out) = sweep_with_a_long_cell(dir.path(), "orphan");
    // The sweep itself is killed: no handler, no clean-up of its own.
    parent.kill().unwrap();
    parent.wait().unwrap();
    let killed = Instant::now();
    // The cell is gone within 2 s (a zombie reaped by init counts as gone).
    let gone = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.split_whitespace().nth(2) == Some("Z"))
            .unwrap_or(true)
    };
    while !gone(child) {
        assert!(
            killed.elapsed() < Duration::from_secs(2),
            "cell {child} outlived its sweep by 2 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.height(), 0, "no row from the killed sweep's cell: {runs:?}");
}

const FOUR_CELLS: &str = r#"
name = "resume"
[defaults]
warmup_secs = 0.1
duration_secs = 1.0
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["resnet_tiny", "bert_tiny"]
batches = [1, 2]
"#;

#[test]
fn two_sweeps_on_one_folder_measure_each_cell_once_and_never_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), FOUR_CELLS);
    let out = dir.path().join("out");
    // One machine: both sweeps see the same device claims.
    let machine = dir.path().join("tmp");
    std::fs::create_dir_all(&machine).unwrap();
    let start = || {
        migprof()
            .env("TMPDIR", &machine)
            .arg("sweep")
            .arg(&file)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (start(), start());
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(a.status.success() && b.status.success(), "{}\n{}", text(&a), text(&b));
    let rows = rows(&out);
    let mut cells: Vec<&String> = rows.iter().map(|r| &r.0).collect();
    cells.sort();
    cells.dedup();
    assert_eq!((rows.len(), cells.len()), (4, 4), "each cell once: {rows:?}");
    let both = format!("{}{}", text(&a), text(&b));
    assert!(both.contains("another sweep"), "{both}");
    // Never two measurements on the CPU at once, whichever sweep made them.
    let check = migprof().arg("check").arg(&out).output().unwrap();
    assert!(check.status.success(), "{}", text(&check));
    assert!(
        !out.join("claims").read_dir().unwrap().any(|_| true),
        "every claim released"
    );
}

#[test]
fn a_rerun_with_changed_settings_measures_again_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let sweep_file = |name: &str, duration: f64| {
        write(
            dir.path(),
            &format!(
                "name = \"{name}\"\n[defaults]\nwarmup_secs = 0.1\nduration_secs = {duration}\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[matrix]]\nmodels = [\"resnet_tiny\"]\nbatches = [1]\n"
            ),
        )
    };
    let out = dir.path().join("out");
    let first = sweep(&sweep_file("settings", 0.3), &out, &[]);
    assert!(first.status.success(), "{}", text(&first));
    // The same file: nothing to run.
    let same = sweep(&sweep_file("settings", 0.3), &out, &[]);
    assert!(
        text(&same).contains("1 skipped (done already), 0 run"),
        "{}",
        text(&same)
    );
    // Another duration: the dry run says which cell runs again and why; the run measures it.
    let file = sweep_file("settings", 0.5);
    let dry = sweep(&file, &out, &["--dry-run"]);
    assert!(
        text(&dry).contains("to run again: duration_secs 0.3 → 0.5"),
        "{}",
        text(&dry)
    );
    let again = sweep(&file, &out, &[]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        text(&again).contains("1 cell(s) run again") && text(&again).contains("0 skipped"),
        "{}",
        text(&again)
    );
    let rows = rows(&out);
    assert_eq!(rows.len(), 2, "the old row stays beside the new one: {rows:?}");
    assert_eq!(rows[0].0, rows[1].0, "one cell id");
    let settings = strings(&read_table(&out, Table::Runs).unwrap(), "cell_settings");
    assert!(settings.iter().any(|s| s.contains("duration_secs=0.5")), "{settings:?}");
    // A renamed sweep: said, and its cells count as done.
    let renamed = sweep(&sweep_file("renamed", 0.5), &out, &[]);
    assert!(renamed.status.success(), "{}", text(&renamed));
    assert!(
        text(&renamed).contains("rows from sweep(s) named `settings`; this file names it `renamed`"),
        "{}",
        text(&renamed)
    );
    assert!(text(&renamed).contains("1 skipped"), "{}", text(&renamed));
}

#[test]
fn resume_after_an_interrupt_ends_with_each_cell_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), FOUR_CELLS);
    let out = dir.path().join("out");
    let parent = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Interrupt once the first row is there, while later cells are still to come.
    let deadline = Instant::now() + Duration::from_secs(60);
    while read_table(&out, Table::Runs).map(|t| t.height()).unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no row appeared");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill(2) on the sweep this test started.
    unsafe { libc::kill(parent.id() as i32, libc::SIGINT) };
    let o = parent.wait_with_output().unwrap();
    let log = text(&o);
    assert!(!o.status.success(), "{log}");
    assert!(log.contains("interrupted"), "{log}");
    let first = rows(&out);
    assert!(!first.is_empty() && first.len() < 4, "{first:?}");
    assert!(
        first.iter().all(|r| r.1 == "ok"),
        "an interrupted cell leaves no row: {first:?}"
    );
    let again = sweep(&file, &out, &[]);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        text(&again).contains(&format!("{} skipped", first.len())),
        "{}",
        text(&again)
    );
    let all = rows(&out);
    let mut ids: Vec<&String> = all.iter().map(|r| &r.0).collect();
    ids.sort();
    ids.dedup();
    assert_eq!((all.len(), ids.len()), (4, 4), "no duplicate, none missing: {all:?}");
    // The dry run now lists every cell as done.
    let dry = sweep(&file, &out, &["--dry-run"]);
    assert!(text(&dry).contains("4 cell(s), 4 done, 0 to run"), "{}", text(&dry));
}

#[test]
fn max_finds_the_largest_batch_under_a_memory_cap() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        r#"
name = "max"
[defaults]
warmup_secs = 0
duration_secs = 0
max_batch_limit = 1024
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["resnet_tiny"]
modes = ["train"]
batches = ["max"]
"#,
    );
    let out = dir.path().join("out");
    let mut cmd = migprof();
    cmd.arg("sweep").arg(&file).arg("--out").arg(&out);
    // 300 MiB of address space for the sweep and, inherited, for every cell: a few hundred images of
    // resnet_tiny's training step fit, a thousand do not.
    // SAFETY: setrlimit in the forked child before exec; no allocation, no locks.
    unsafe {
        cmd.pre_exec(|| {
            let cap = libc::rlimit {
                rlim_cur: 300 << 20,
                rlim_max: 300 << 20,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &cap) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let o = cmd.output().unwrap();
    let log = text(&o);
    let runs = read_table(&out, Table::Runs).unwrap();
    let (status, batch) = (
        strings(&runs, "status"),
        runs.column("batch")
            .unwrap()
            .i64()
            .unwrap()
            .iter()
            .map(|b| b.unwrap() as usize)
            .collect::<Vec<_>>(),
    );
    let cell_id = strings(&runs, "cell_id");
    let probes = probe_ids(&out);
    let is_probe = |i: usize| probes.contains(&cell_id[i]);
    let fits: Vec<usize> = (0..runs.height())
        .filter(|&i| status[i] == "probe")
        .map(|i| batch[i])
        .collect();
    let fails: Vec<usize> = (0..runs.height())
        .filter(|&i| is_probe(i) && status[i] == "oom")
        .map(|i| batch[i])
        .collect();
    let measured: Vec<(usize, &str)> = (0..runs.height())
        .filter(|&i| !is_probe(i))
        .map(|i| (batch[i], status[i].as_str()))
        .collect();
    let (largest, smallest_fail) = (
        *fits.iter().max().unwrap(),
        *fails.iter().min().expect("the cap stops the search"),
    );
    assert_eq!(
        smallest_fail,
        largest + 1,
        "bisection to the exact batch: fits {fits:?}, fails {fails:?}"
    );
    // The cell ran at the batch found. Over its longer measurement the host's allocator can need more
    // than the two steps of a probe did: then its row says so (oom), at that batch.
    assert_eq!(measured.len(), 1, "{measured:?}");
    assert_eq!(measured[0].0, largest, "{measured:?}");
    assert!(["ok", "oom"].contains(&measured[0].1), "{measured:?}");
    assert!(fits.contains(&1) && fits.contains(&2) && largest < 1024, "{fits:?}");
    assert!(
        log.contains(&format!("the largest batch that fits is {largest}")),
        "{log}"
    );
}

/// The cell ids of a folder's max-search probes: the cells whose spec (kept in `cells/`) says so.
fn probe_ids(out: &Path) -> Vec<String> {
    std::fs::read_dir(out.join("cells"))
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            text.contains("\"purpose\": \"probe\"")
                .then(|| path.file_stem().unwrap().to_string_lossy().into_owned())
        })
        .collect()
}

#[test]
fn file_errors_name_the_line_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        &FOUR_CELLS.replace("duration_secs = 1.0", "duration_sec = 1.0"),
    );
    let o = sweep(&file, &dir.path().join("out"), &[]);
    assert!(!o.status.success());
    let e = text(&o);
    assert!(
        e.contains("line 5") && e.contains("duration_sec") && e.contains("duration_secs"),
        "{e}"
    );
    assert!(!dir.path().join("out").exists(), "nothing written for a bad file");
    let e = text(&sweep(&file, &dir.path().join("out"), &["--only", "gpu=0"]));
    assert!(
        e.contains("unknown key `gpu`") && e.contains("target, device, model"),
        "{e}"
    );
}

#[test]
fn jobs_never_runs_two_cells_on_one_device_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        &FOUR_CELLS
            .replace(
                "label = \"cpu\"\ndevice = \"cpu\"",
                "label = \"a\"\ndevice = \"cpu\"\n[[targets]]\nlabel = \"b\"\ndevice = \"cpu\"",
            )
            .replace("batches = [1, 2]", "batches = [1]"),
    );
    let out = dir.path().join("out");
    let o = sweep(&file, &out, &["--jobs", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.height(), 4);
    let micros = |name: &str| {
        runs.column(name)
            .unwrap()
            .cast(&DataType::Int64)
            .unwrap()
            .i64()
            .unwrap()
            .iter()
            .map(|v| v.unwrap())
            .collect::<Vec<i64>>()
    };
    let mut spans: Vec<(i64, i64)> = micros("started_at").into_iter().zip(micros("finished_at")).collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].1 <= w[1].0, "two cells on the CPU overlapped: {spans:?}");
    }
    assert_eq!(strings(&runs, "target").iter().filter(|t| *t == "b").count(), 2);
}

#[test]
fn a_concurrent_group_measures_together_and_holds_until_every_member_has_measured() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        r#"
name = "neighbours"
[defaults]
warmup_secs = 0.1
duration_secs = 0.5
[[targets]]
label = "a"
device = "cpu"
alone = false
[[targets]]
label = "b"
device = "cpu"
alone = false
[[matrix]]
models = ["resnet_tiny"]
batches = [1]
[[groups]]
label = "noisy"
concurrent = true
targets = ["a", "b"]
busy = { model = "bert_tiny", mode = "train", dtype = "f32", batch = 2 }
"#,
    );
    let out = dir.path().join("out");
    let o = sweep(&file, &out, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("group noisy: 2 members started together"),
        "{}",
        text(&o)
    );
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.height(), 2);
    assert_eq!(strings(&runs, "status"), ["ok", "ok"]);
    assert_eq!(strings(&runs, "concurrency_group"), ["noisy", "noisy"]);
    let mut neighbours = strings(&runs, "neighbours");
    neighbours.sort();
    assert_eq!(neighbours, ["a:resnet_tiny/infer/f32/1", "b:bert_tiny/train/f32/2"]);
    // The meeting folder: both warmed up before either measured to its end, and each process ended
    // (its row's finished_at) only once both had measured.
    let groups: Vec<_> = std::fs::read_dir(out.join("groups"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(groups.len(), 1);
    let mtime = |name: &str| std::fs::metadata(groups[0].join(name)).unwrap().modified().unwrap();
    let ids = strings(&runs, "cell_id");
    let last_ready = ids.iter().map(|id| mtime(&format!("ready-{id}"))).max().unwrap();
    let first_done = ids.iter().map(|id| mtime(&format!("done-{id}"))).min().unwrap();
    let last_done = ids.iter().map(|id| mtime(&format!("done-{id}"))).max().unwrap();
    assert!(
        last_ready <= first_done,
        "a member finished measuring before the other had warmed up"
    );
    let finished: Vec<i64> = runs
        .column("finished_at")
        .unwrap()
        .datetime()
        .unwrap()
        .physical()
        .iter()
        .map(|v| v.unwrap())
        .collect();
    let last_done_us = last_done.duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as i64;
    assert!(
        finished.iter().all(|&f| f >= last_done_us - 1000),
        "a member stopped before the other finished measuring"
    );
    // Run again: the instance is done as a whole.
    let again = sweep(&file, &out, &[]);
    assert!(text(&again).contains("2 skipped"), "{}", text(&again));
}

/// `migprof sweep FILE --out OUT` on the recorded topology `topology`, with `env` set.
fn sweep_on_recorded(file: &Path, out: &Path, topology: &Path, env: &[(&str, &Path)]) -> std::process::Output {
    let mut cmd = migprof();
    cmd.arg("sweep")
        .arg(file)
        .arg("--out")
        .arg(out)
        .env("MIGPROF_TOPOLOGY", topology);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn a_group_of_real_mig_slices_starts_together_on_a_recorded_topology() {
    // Two MIG devices of a recorded H100 layout: distinct devices, started together as one instance.
    // Nothing here can run on them (no GPU, a CPU build), so each member leaves an `error` row; on
    // hardware the same path runs them (not run: MIG cannot be turned on where migprof was built).
    let dir = tempfile::tempdir().unwrap();
    let topology = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/topologies/h100_3g_2g_1g_1g.json");
    let file = write(
        dir.path(),
        r#"
name = "mig-pair"
[defaults]
warmup_secs = 0.1
duration_secs = 0.2
[[targets]]
label = "3g"
device = "3g.40gb"
alone = false
[[targets]]
label = "2g"
device = "2g.20gb"
alone = false
[[matrix]]
models = ["resnet_tiny"]
batches = [1]
[[groups]]
label = "3g+2g"
concurrent = true
targets = ["3g", "2g"]
"#,
    );
    let out = dir.path().join("out");
    let o = sweep_on_recorded(&file, &out, &topology, &[]);
    assert!(
        text(&o).contains("group 3g+2g: 2 members started together"),
        "{}",
        text(&o)
    );
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "status"), ["error", "error"], "{}", text(&o));
    assert_eq!(strings(&runs, "concurrency_group"), ["3g+2g", "3g+2g"]);
    let errors = strings(&runs, "error");
    assert!(
        errors
            .iter()
            .all(|e| e.contains("built without CUDA support") || e.contains("MIG")),
        "{errors:?}"
    );
}

#[test]
fn a_memory_partitioned_group_whose_neighbour_cannot_start_leaves_failed_rows_and_the_sweep_goes_on() {
    // Two mps-mem: members on a recorded H100 with MIG off, under the fake MPS control program: the
    // sweep starts the group's memory-system neighbour, which in a CPU build cannot run. Each member
    // gets a failed row naming why, the sweep goes on to its end, and nothing is left running.
    let dir = tempfile::tempdir().unwrap();
    let topology = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/topologies/no_mig.json");
    let control = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake-mps-control");
    let file = write(
        dir.path(),
        r#"
name = "mem-group"
[defaults]
warmup_secs = 0.1
duration_secs = 0.2
[[targets]]
label = "1g-mem"
device = "mps-mem:1g.10gb"
alone = false
[[targets]]
label = "2g-mem"
device = "mps-mem:2g.20gb"
alone = false
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["resnet_tiny"]
batches = [1]
[[groups]]
label = "1g+2g"
concurrent = true
targets = ["1g-mem", "2g-mem"]
"#,
    );
    let out = dir.path().join("out");
    let mps_dir = dir.path().join("mps");
    let cache = dir.path().join("cache");
    let o = sweep_on_recorded(
        &file,
        &out,
        &topology,
        &[
            ("MIGPROF_MPS_CONTROL", &control),
            ("MIGPROF_MPS_DIR", &mps_dir),
            ("MIGPROF_CACHE_DIR", &cache),
        ],
    );
    let said = text(&o);
    assert!(
        said.contains("3 run (1 ok, 2 error)"),
        "the sweep went on to its end: {said}"
    );
    let runs = read_table(&out, Table::Runs).unwrap();
    let by_target: std::collections::BTreeMap<String, (String, String)> = strings(&runs, "target")
        .into_iter()
        .zip(strings(&runs, "status").into_iter().zip(strings(&runs, "error")))
        .collect();
    assert_eq!(by_target.len(), 3, "{said}");
    assert_eq!(by_target["cpu"].0, "ok", "{said}");
    for member in ["1g-mem", "2g-mem"] {
        let (status, error) = &by_target[member];
        assert_eq!(status, "error", "{said}");
        assert!(error.contains("the group's memory-system neighbour"), "{error}");
    }
    // No neighbour or fake MPS server is left behind.
    let left = std::process::Command::new("ps").args(["-eo", "args"]).output().unwrap();
    let left = String::from_utf8_lossy(&left.stdout);
    assert!(
        !left
            .lines()
            .any(|l| l.contains("memory-neighbour") || l.contains(mps_dir.to_str().unwrap())),
        "{left}"
    );
}

/// Generate cells that differ only in their cache are told apart in the progress lines; an emulated
/// slice in a build without CUDA is refused as `migprof run` refuses it.
#[test]
fn generate_cells_name_their_cache_and_mps_targets_need_a_cuda_build() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(
        dir.path(),
        r#"
name = "caches"
[defaults]
warmup_secs = 0
duration_secs = 0.2
[[targets]]
label = "cpu"
device = "cpu"
[[matrix]]
models = ["llama_tiny"]
modes = ["generate"]
batches = [1]
prompt_lens = [8]
output_lens = [4]
kv_layouts = ["contiguous", "paged"]
kv_block_size = 8
"#,
    );
    let o = sweep(&file, &dir.path().join("out"), &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t.contains("prompt 8 output 4 contiguous") && t.contains("prompt 8 output 4 paged 8"),
        "{t}"
    );
    let file = write(
        dir.path(),
        "name = \"emulated\"\n[[targets]]\nlabel = \"3g\"\ndevice = \"mps:3g.40gb\"\n[[matrix]]\nmodels = [\"resnet_tiny\"]\nbatches = [1]\n",
    );
    let o = sweep(&file, &dir.path().join("out2"), &[]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains("built without CUDA support"), "{t}");
}
