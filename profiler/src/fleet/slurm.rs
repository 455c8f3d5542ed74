//! Sweeps through Slurm: one job array per target (a job array has one resource request), each task
//! one cell run by `migprof cell` into the shared results folder, an exit marker per task, and a
//! status read from the folder, `squeue` and the markers (no accounting database needed). A rerun
//! submits only the cells neither done nor queued.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::request::Request;
use super::{cluster_cells, slug};
use crate::cell::CellSpec;
use crate::provenance;
use crate::sweep::file::SweepFile;
use crate::sweep::Options;

/// How the job arrays are written and submitted.
#[derive(Debug, Clone)]
pub struct SlurmOptions {
    pub partition: Option<String>,
    pub account: Option<String>,
    /// `--gres` of a MIG target, `{profile}` standing for its profile (GRES type names are the
    /// site's: NVML autodetection names MIG slices after their profile, e.g. `gpu:3g.40gb:1`).
    pub gres_template: String,
    /// Whole-GPU targets: `--gres`.
    pub gpu_gres: String,
    /// One task per node at a time (`--exclusive`): neighbours change results.
    pub one_per_node: bool,
    pub submit: bool,
    /// The sweep's `timeout_secs`: each task's time limit.
    pub timeout_secs: f64,
}

/// What `jobs.json` keeps of each submitted array.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Submitted {
    job_id: String,
    target: String,
    /// The cell id of each array index.
    cells: Vec<String>,
    script: PathBuf,
}

fn slurm_dir(out: &Path) -> PathBuf {
    out.join("slurm")
}

fn read_jobs(out: &Path) -> Result<Vec<Submitted>> {
    let path = slurm_dir(out).join("jobs.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).with_context(|| format!("reading {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn write_jobs(out: &Path, jobs: &[Submitted]) -> Result<()> {
    let path = slurm_dir(out).join("jobs.json");
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(jobs)?)?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))
}

/// Where each planned cell stands.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum CellState {
    /// A row with a final status (`ok`, `oom`, or `probe`) is in the folder.
    Done(String),
    /// In `squeue`: PENDING, RUNNING, ...
    Queued(String),
    /// Its task ended without a final row: its exit code, and the row's status when one was written.
    Failed(String),
    /// Submitted, but neither queued nor ended with a marker: cancelled, or lost with its node.
    Missing,
    NotSubmitted,
}

impl CellState {
    fn describe(&self) -> String {
        match self {
            CellState::Done(s) => format!("done ({s})"),
            CellState::Queued(s) => s.to_lowercase(),
            CellState::Failed(why) => format!("failed ({why})"),
            CellState::Missing => "missing (cancelled or lost)".into(),
            CellState::NotSubmitted => "not submitted".into(),
        }
    }

    /// Whether a rerun submits the cell again.
    fn wants_submission(&self) -> bool {
        matches!(
            self,
            CellState::Failed(_) | CellState::Missing | CellState::NotSubmitted
        )
    }
}

/// Array elements `squeue` lists for `jobs`, by `JOBID_INDEX`, with their state.
fn queued(jobs: &[Submitted]) -> Result<HashMap<String, String>> {
    if jobs.is_empty() {
        return Ok(HashMap::new());
    }
    let ids: Vec<&str> = jobs.iter().map(|j| j.job_id.as_str()).collect();
    let output = Command::new("squeue")
        .args(["-h", "-r", "-o", "%i %T", "-j"])
        .arg(ids.join(","))
        .output()
        .context("running squeue (Slurm's client commands must be on PATH, SLURM_CONF set where needed)")?;
    // squeue fails for job ids it no longer knows: then none of them is queued.
    let text = String::from_utf8_lossy(&output.stdout);
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(id, state)| (id.trim().to_string(), state.trim().to_string()))
        .collect())
}

/// Each task's exit marker: cell id -> (exit code, where it ran).
fn markers(out: &Path) -> HashMap<String, (i32, String)> {
    let mut m = HashMap::new();
    let Ok(entries) = std::fs::read_dir(slurm_dir(out).join("markers")) else {
        return m;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(cell) = name.strip_suffix(".exit") else {
            continue;
        };
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let mut parts = text.split_whitespace();
        if let Some(code) = parts.next().and_then(|c| c.parse().ok()) {
            m.insert(cell.to_string(), (code, parts.collect::<Vec<_>>().join(" ")));
        }
    }
    m
}

/// Where every cell of the sweep stands.
pub fn states(file: &SweepFile, opts: &Options) -> Result<Vec<(CellSpec, CellState)>> {
    let cells = cluster_cells(file, opts)?;
    let jobs = read_jobs(&opts.out)?;
    let in_queue = queued(&jobs)?;
    let ended = markers(&opts.out);
    let statuses = crate::sweep::written::row_statuses(&opts.out)?;
    // The latest submission of each cell.
    let mut task_of: HashMap<&str, String> = HashMap::new();
    for j in &jobs {
        for (i, c) in j.cells.iter().enumerate() {
            task_of.insert(c.as_str(), format!("{}_{i}", j.job_id));
        }
    }
    Ok(cells
        .into_iter()
        .map(|(spec, done)| {
            let id = spec.cell_id();
            let state = if done {
                CellState::Done(statuses.get(&id).cloned().unwrap_or_else(|| "ok".into()))
            } else if let Some(state) = task_of.get(id.as_str()).and_then(|t| in_queue.get(t)) {
                CellState::Queued(state.clone())
            } else if let Some((code, at)) = ended.get(&id).filter(|_| task_of.contains_key(id.as_str())) {
                let row = statuses.get(&id).map(|s| format!(", row {s}")).unwrap_or_default();
                CellState::Failed(format!("exit {code} on {at}{row}"))
            } else if task_of.contains_key(id.as_str()) {
                CellState::Missing
            } else {
                CellState::NotSubmitted
            };
            (spec, state)
        })
        .collect())
}

/// `--status`: a line per cell and the counts. `Ok(true)` when every cell is done.
pub fn status(file: &SweepFile, opts: &Options, log: &mut dyn Write) -> Result<bool> {
    let states = states(file, opts)?;
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for (spec, state) in &states {
        writeln!(
            log,
            "{}  {:<10} {} {} {} batch {}: {}",
            spec.cell_id(),
            spec.target,
            spec.model,
            spec.mode,
            spec.dtype,
            spec.batch,
            state.describe()
        )?;
        let key = match state {
            CellState::Done(_) => "done",
            CellState::Queued(s) if s == "RUNNING" => "running",
            CellState::Queued(_) => "queued",
            CellState::Failed(_) => "failed",
            CellState::Missing => "missing",
            CellState::NotSubmitted => "not submitted",
        };
        *counts.entry(key).or_default() += 1;
    }
    let summary: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
    writeln!(log, "{} cell(s): {}", states.len(), summary.join(", "))?;
    Ok(states.iter().all(|(_, s)| matches!(s, CellState::Done(_))))
}

/// Submits a job script, returning its job's id.
fn sbatch(script: &Path) -> Result<String> {
    let output = Command::new("sbatch")
        .arg("--parsable")
        .arg(script)
        .output()
        .context("running sbatch (Slurm's client commands must be on PATH)")?;
    if !output.status.success() {
        bail!(
            "sbatch {} failed: {}",
            script.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    // `--parsable` prints `jobid` or `jobid;cluster`.
    Ok(String::from_utf8_lossy(&output.stdout)
        .trim()
        .split(';')
        .next()
        .unwrap_or("")
        .to_string())
}

/// Writes one job array per target for the cells that want running, and submits them with
/// `--submit`. Returns the job ids submitted.
pub fn submit(
    file: &SweepFile,
    opts: &Options,
    slurm: &SlurmOptions,
    exe: &Path,
    log: &mut dyn Write,
) -> Result<Vec<String>> {
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("cannot use {} as the results folder", opts.out.display()))?;
    let out = std::fs::canonicalize(&opts.out)?;
    let exe = std::fs::canonicalize(exe)?;
    let states = states(
        file,
        &Options {
            out: out.clone(),
            ..opts.clone()
        },
    )?;
    let invocation = provenance::run_id(provenance::now());
    let root = slurm_dir(&out).join(&invocation);
    // Slurm opens a task's output file before the task starts: its folder must exist.
    std::fs::create_dir_all(slurm_dir(&out).join("logs"))?;
    std::fs::create_dir_all(slurm_dir(&out).join("markers"))?;
    let mut by_target: BTreeMap<String, Vec<CellSpec>> = BTreeMap::new();
    for (spec, state) in states {
        if state.wants_submission() {
            by_target.entry(spec.target.clone()).or_default().push(spec);
        }
    }
    if by_target.is_empty() {
        writeln!(log, "nothing to submit: every cell is done or queued (see --status)")?;
        return Ok(Vec::new());
    }
    let mut jobs = read_jobs(&out)?;
    let mut submitted = Vec::new();
    for (label, cells) in &by_target {
        let target = file
            .targets
            .iter()
            .find(|t| &t.label == label)
            .expect("a planned cell's target");
        let request = Request::of(target)?;
        let dir = root.join(slug(label));
        std::fs::create_dir_all(&dir)?;
        for (i, c) in cells.iter().enumerate() {
            let spec = CellSpec {
                scheduled: true,
                ..c.clone()
            };
            std::fs::write(dir.join(format!("cell-{i}.json")), spec.to_json()?)?;
        }
        let script = dir.join("job.sbatch");
        std::fs::write(
            &script,
            script_text(&file.name, label, &request, cells, &dir, &out, &exe, &invocation, slurm),
        )?;
        if !slurm.submit {
            writeln!(
                log,
                "{label}: {} cell(s): {}  (submit with: sbatch {})",
                cells.len(),
                script.display(),
                script.display()
            )?;
            continue;
        }
        let job_id = sbatch(&script)?;
        writeln!(log, "{label}: {} cell(s) submitted as job array {job_id}", cells.len())?;
        jobs.push(Submitted {
            job_id: job_id.clone(),
            target: label.clone(),
            cells: cells.iter().map(CellSpec::cell_id).collect(),
            script,
        });
        write_jobs(&out, &jobs)?;
        submitted.push(job_id);
    }
    Ok(submitted)
}

/// The job array of one target's cells.
#[allow(clippy::too_many_arguments)]
fn script_text(
    sweep: &str,
    label: &str,
    request: &Request,
    cells: &[CellSpec],
    specs: &Path,
    out: &Path,
    exe: &Path,
    invocation: &str,
    o: &SlurmOptions,
) -> String {
    let mut s = String::from("#!/bin/bash\n");
    let mut directive = |line: String| s.push_str(&format!("#SBATCH {line}\n"));
    directive(format!("--job-name=migprof-{}-{}", slug(sweep), slug(label)));
    directive(format!("--array=0-{}", cells.len() - 1));
    directive(format!(
        "--output={}/logs/{}-%A_%a.out",
        slurm_dir(out).display(),
        slug(label)
    ));
    match request {
        Request::Cpu => {}
        Request::Gpu { .. } => directive(format!("--gres={}", o.gpu_gres)),
        Request::Mig { profile, .. } => directive(format!("--gres={}", o.gres_template.replace("{profile}", profile))),
    }
    if let Request::Gpu { product: Some(p) } | Request::Mig { product: Some(p), .. } = request {
        directive(format!("--constraint={p}"));
    }
    if let Some(p) = &o.partition {
        directive(format!("--partition={p}"));
    }
    if let Some(a) = &o.account {
        directive(format!("--account={a}"));
    }
    if o.one_per_node {
        directive("--exclusive".into());
    }
    // The sweep's per-cell timeout, with a minute for the process around the cell.
    directive(format!("--time={}", (o.timeout_secs / 60.0).ceil() as u64 + 1));
    let ids: Vec<String> = cells.iter().map(CellSpec::cell_id).collect();
    s.push_str(&format!(
        r#"# migprof sweep `{sweep}`, target `{label}`: one cell per array task (written by migprof {version}).
set -u
ids=({ids})
cell="${{ids[$SLURM_ARRAY_TASK_ID]}}"
spec="{specs}/cell-$SLURM_ARRAY_TASK_ID.json"
log="{logs}/{target}-${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}.out"
"{exe}" cell --spec "$spec" --out "{out}" --invocation "{invocation}"
code=$?
# A cell that left no measurement gets its row as a local sweep would give it.
if [ "$code" -ne 0 ]; then
    "{exe}" cell-ended --spec "$spec" --out "{out}" --invocation "{invocation}" --exit-code "$code" --log "$log"
fi
mkdir -p "{markers}"
echo "$code $(hostname -s) ${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}" > "{markers}/$cell.exit.tmp" && mv "{markers}/$cell.exit.tmp" "{markers}/$cell.exit"
exit "$code"
"#,
        version = provenance::VERSION,
        ids = ids.join(" "),
        specs = specs.display(),
        logs = slurm_dir(out).join("logs").display(),
        target = slug(label),
        exe = exe.display(),
        out = out.display(),
        markers = slurm_dir(out).join("markers").display(),
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> SlurmOptions {
        SlurmOptions {
            partition: Some("gpu".into()),
            account: None,
            gres_template: "gpu:{profile}:1".into(),
            gpu_gres: "gpu:1".into(),
            one_per_node: true,
            submit: false,
            timeout_secs: 600.0,
        }
    }

    #[test]
    fn a_script_asks_for_its_target_and_runs_each_task_s_cell() {
        let cells = vec![
            crate::cell::spec::tests::cell(),
            CellSpec {
                batch: 8,
                ..crate::cell::spec::tests::cell()
            },
        ];
        let request = Request::Mig {
            profile: "3g.40gb".into(),
            product: Some("NVIDIA-H100-80GB-HBM3".into()),
        };
        let s = script_text(
            "slices",
            "3g",
            &request,
            &cells,
            Path::new("/r/slurm/x/3g"),
            Path::new("/r"),
            Path::new("/opt/migprof"),
            "inv",
            &options(),
        );
        for line in [
            "#SBATCH --array=0-1",
            "#SBATCH --gres=gpu:3g.40gb:1",
            "#SBATCH --constraint=NVIDIA-H100-80GB-HBM3",
            "#SBATCH --partition=gpu",
            "#SBATCH --exclusive",
            "#SBATCH --time=11",
            "#SBATCH --output=/r/slurm/logs/3g-%A_%a.out",
            "\"/opt/migprof\" cell --spec \"$spec\" --out \"/r\" --invocation \"inv\"",
            "cell-ended",
        ] {
            assert!(s.contains(line), "{line}\n{s}");
        }
        assert!(s.contains(&format!("ids=({} {})", cells[0].cell_id(), cells[1].cell_id())));
        let whole = script_text(
            "s",
            "full",
            &Request::Gpu { product: None },
            &cells[..1],
            Path::new("/a"),
            Path::new("/r"),
            Path::new("/m"),
            "i",
            &options(),
        );
        assert!(whole.contains("--gres=gpu:1") && whole.contains("--array=0-0") && !whole.contains("--constraint"));
        let cpu = script_text(
            "s",
            "cpu",
            &Request::Cpu,
            &cells[..1],
            Path::new("/a"),
            Path::new("/r"),
            Path::new("/m"),
            "i",
            &options(),
        );
        assert!(!cpu.contains("--gres"));
    }
}
