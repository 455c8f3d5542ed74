//! Fleet runs: a sweep through a real Slurm (a one-node cluster on localhost, started by the test:
//! Debian's slurm-wlm and munge, which `.ci/run` installs), Kubernetes manifests checked against the
//! Kubernetes API schema (PyPI's kubernetes-validate), cluster targets refused with their reason, and
//! `migprof merge`. The tests that need Slurm or the validator are #[ignore]d and fail without them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

fn write_sweep(dir: &Path, name: &str, duration: f64, target: &str) -> PathBuf {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            r#"
name = "{name}"
[defaults]
warmup_secs = 0.1
duration_secs = {duration}
[[targets]]
label = "cpu"
device = "{target}"
[[matrix]]
models = ["resnet_tiny"]
batches = [1, 2]
"#
        ),
    )
    .unwrap();
    path
}

/// (cell_id, status) of every row of a folder.
fn cells(out: &Path) -> BTreeSet<(String, String)> {
    let runs = read_table(out, Table::Runs).unwrap();
    let col = |n: &str| {
        runs.column(n)
            .unwrap()
            .str()
            .unwrap()
            .iter()
            .map(|v| v.unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    col("cell_id").into_iter().zip(col("status")).collect()
}

/// A one-node Slurm cluster on localhost in a temporary folder (../shared/slurm-local.md), stopped by
/// its pid files when dropped.
struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        for tool in ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel"] {
            assert!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {tool}")])
                    .output()
                    .unwrap()
                    .status
                    .success(),
                "{tool} is missing: install Debian's slurm-wlm and munge (.ci/run does)"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for sub in ["state", "spool", "log", "munge"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let key: Vec<u8> = (0..1024).map(|_| rand::random::<u8>()).collect();
        let key_path = d.join("munge/munge.key");
        std::fs::write(&key_path, key).unwrap();
        std::fs::set_permissions(&key_path, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        let m = d.join("munge");
        let ok = Command::new("munged")
            .arg(format!("--key-file={}", key_path.display()))
            .arg(format!("--socket={}", m.join("sock").display()))
            .arg(format!("--pid-file={}", m.join("pid").display()))
            .arg(format!("--log-file={}", m.join("log").display()))
            .arg(format!("--seed-file={}", m.join("seed").display()))
            .status()
            .unwrap();
        assert!(ok.success(), "munged did not start");
        let host = String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout)
            .unwrap()
            .trim()
            .to_string();
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let conf = format!(
            "ClusterName=local\nSlurmctldHost={host}\nAuthType=auth/munge\nAuthInfo=socket={sock}\nCredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n\
             StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\nSlurmctldPidFile={d}/ctld.pid\nSlurmdPidFile={d}/d.pid\n\
             SlurmctldLogFile={d}/log/ctld.log\nSlurmdLogFile={d}/log/d.log\nSlurmctldPort=16817\nSlurmdPort=16818\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\nSchedulerType=sched/backfill\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nReturnToService=2\n\
             NodeName={host} CPUs={cpus} RealMemory=2000 State=UNKNOWN\nPartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
            sock = m.join("sock").display(),
            d = d.display()
        );
        std::fs::write(d.join("slurm.conf"), conf).unwrap();
        let cluster = Cluster { dir };
        assert!(
            cluster
                .cmd("slurmctld")
                .arg("-f")
                .arg(cluster.conf())
                .status()
                .unwrap()
                .success(),
            "slurmctld did not start"
        );
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            cluster
                .cmd("slurmd")
                .arg("-f")
                .arg(cluster.conf())
                .status()
                .unwrap()
                .success(),
            "slurmd did not start"
        );
        // Until the node is idle.
        let start = Instant::now();
        loop {
            let out = cluster.cmd("sinfo").args(["-h", "-o", "%T"]).output().unwrap();
            if String::from_utf8_lossy(&out.stdout).contains("idle") {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the node never became idle: {}",
                text(&out)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        cluster
    }

    fn conf(&self) -> PathBuf {
        self.dir.path().join("slurm.conf")
    }

    /// A command with this cluster's configuration.
    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.conf());
        c
    }

    fn migprof(&self) -> Command {
        let mut c = migprof();
        c.env("SLURM_CONF", self.conf());
        c
    }

    /// Polls `--status` until every cell is done.
    fn wait_done(&self, file: &Path, out: &Path, within: Duration) -> String {
        let start = Instant::now();
        loop {
            let o = self
                .migprof()
                .arg("sweep")
                .arg(file)
                .arg("--out")
                .arg(out)
                .args(["--backend", "slurm", "--status"])
                .output()
                .unwrap();
            if o.status.success() {
                return text(&o);
            }
            assert!(start.elapsed() < within, "not done within {within:?}:\n{}", text(&o));
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for pid in ["d.pid", "ctld.pid", "munge/pid"] {
            if let Ok(p) = std::fs::read_to_string(self.dir.path().join(pid)) {
                let _ = Command::new("kill").arg(p.trim()).status();
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
#[ignore = "needs Slurm and munge (Debian's slurm-wlm, munge; .ci/run installs them) and root"]
fn a_sweep_through_slurm_equals_a_local_one_and_a_cancelled_task_is_submitted_again() {
    let cluster = Cluster::start();
    let dir = tempfile::tempdir().unwrap();
    let file = write_sweep(dir.path(), "fleet", 0.3, "cpu");
    let local = dir.path().join("local");
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&local)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let remote = dir.path().join("slurm");
    let o = cluster
        .migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&remote)
        .args(["--backend", "slurm", "--submit"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && text(&o).contains("2 cell(s) submitted as job array"),
        "{}",
        text(&o)
    );
    let status = cluster.wait_done(&file, &remote, Duration::from_secs(180));
    assert!(status.contains("2 cell(s): 2 done"), "{status}");
    assert_eq!(cells(&local), cells(&remote), "the same cells, the same statuses");
    // Rows say where they ran.
    let runs = read_table(&remote, Table::Runs).unwrap();
    assert!(runs
        .column("host")
        .unwrap()
        .str()
        .unwrap()
        .iter()
        .all(|h| h.is_some_and(|h| !h.is_empty())));
    // Nothing left to submit.
    let o = cluster
        .migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&remote)
        .args(["--backend", "slurm", "--submit"])
        .output()
        .unwrap();
    assert!(text(&o).contains("nothing to submit"), "{}", text(&o));

    // Cancel one task of a slower sweep: its cell is missing, and a rerun submits it alone.
    let slow = write_sweep(dir.path(), "cancelled", 6.0, "cpu");
    let out = dir.path().join("cancelled");
    let o = cluster
        .migprof()
        .arg("sweep")
        .arg(&slow)
        .arg("--out")
        .arg(&out)
        .args(["--backend", "slurm", "--submit"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let job = text(&o)
        .split("job array ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    assert!(cluster
        .cmd("scancel")
        .arg(format!("{job}_1"))
        .status()
        .unwrap()
        .success());
    let start = Instant::now();
    let status = loop {
        let o = cluster
            .migprof()
            .arg("sweep")
            .arg(&slow)
            .arg("--out")
            .arg(&out)
            .args(["--backend", "slurm", "--status"])
            .output()
            .unwrap();
        let t = text(&o);
        if t.contains("1 done") && t.contains("1 missing") {
            break t;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{t}");
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(status.contains("missing (cancelled or lost)"), "{status}");
    let o = cluster
        .migprof()
        .arg("sweep")
        .arg(&slow)
        .arg("--out")
        .arg(&out)
        .args(["--backend", "slurm", "--submit"])
        .output()
        .unwrap();
    assert!(text(&o).contains("1 cell(s) submitted"), "{}", text(&o));
    let status = cluster.wait_done(&slow, &out, Duration::from_secs(180));
    assert!(status.contains("2 cell(s): 2 done"), "{status}");
    assert_eq!(cells(&out).len(), 2);
}

#[test]
fn cluster_targets_name_requests_and_manifests_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let by_index = write_sweep(dir.path(), "index", 0.3, "0");
    let o = migprof()
        .arg("sweep")
        .arg(&by_index)
        .arg("--out")
        .arg(dir.path().join("o"))
        .args(["--backend", "slurm"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("the scheduler picks the device"),
        "{}",
        text(&o)
    );
    // Without --submit the job arrays are written, not submitted; no Slurm needed.
    let file = write_sweep(dir.path(), "written", 0.3, "cpu");
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("w"))
        .args(["--backend", "slurm"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && text(&o).contains("submit with: sbatch"),
        "{}",
        text(&o)
    );
    let manifests = dir.path().join("k8s");
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("k"))
        .args(["--backend", "k8s", "--emit"])
        .arg(&manifests)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let yaml = std::fs::read_to_string(manifests.join("cpu.yaml")).unwrap();
    assert!(
        yaml.contains("kind: ConfigMap")
            && yaml.contains("completionMode: Indexed")
            && yaml.contains("claimName: migprof-results"),
        "{yaml}"
    );
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("k"))
        .args(["--backend", "k8s"])
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("--emit DIR"), "{}", text(&o));
}

#[test]
#[ignore = "needs kubernetes-validate (PyPI; .ci/run installs it)"]
fn kubernetes_manifests_validate_against_the_api_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("slices.toml");
    std::fs::write(
        &path,
        r#"
name = "slices"
[[targets]]
label = "3g"
device = "3g.40gb"
product = "NVIDIA-H100-80GB-HBM3"
[[targets]]
label = "full"
device = "cuda"
[[matrix]]
models = ["resnet50", "bert_base"]
dtypes = ["bf16"]
batches = [8, 32]
"#,
    )
    .unwrap();
    let emitted = dir.path().join("manifests");
    for strategy in ["mixed", "single"] {
        let o = migprof()
            .arg("sweep")
            .arg(&path)
            .arg("--out")
            .arg(dir.path().join("r"))
            .args([
                "--backend",
                "k8s",
                "--one-per-node",
                "--mig-strategy",
                strategy,
                "--emit",
            ])
            .arg(emitted.join(strategy))
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        for target in ["3g", "full"] {
            let file = emitted.join(strategy).join(format!("{target}.yaml"));
            let v = Command::new("kubernetes-validate")
                .args(["--strict", "-k", "1.30.0"])
                .arg(&file)
                .output();
            let v = v.expect("kubernetes-validate is missing: pip install kubernetes-validate (.ci/run does)");
            assert!(
                v.status.success() && !text(&v).contains("ERROR"),
                "{}: {}",
                file.display(),
                text(&v)
            );
        }
    }
}
