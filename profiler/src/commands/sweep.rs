//! `migprof sweep`: its flags, which backend runs the cells (here, Slurm, Kubernetes) and the flags
//! each backend takes, the dry run, and the sweep's summary.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use migprof::fleet::k8s::MigStrategy;
use migprof::results::parts::Table;
use migprof::sweep::plan::Filter;
use migprof::sweep::schedule;

use super::args::report_hint;

#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// The sweep file (TOML): name, [defaults], [[targets]], [[matrix]]; see the README.
    pub file: PathBuf,
    /// Results folder.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,
    /// List the cells with their ids, whether each is done, and an estimate of the time; run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run every cell, also those with a row already.
    #[arg(long)]
    pub force: bool,
    /// Run again the cells whose row says `oom`.
    #[arg(long)]
    pub retry_oom: bool,
    /// Calibrate the memory-system neighbour of memory-partitioned slices (mps-mem:) afresh instead
    /// of using the setting cached for this GPU, driver and profile.
    #[arg(long)]
    pub recalibrate: bool,
    /// Only the cells that match every key=value, comma-separated (keys: target, device, model, mode,
    /// dtype, batch, seq_len, repeat), e.g. --only model=resnet50,target=3g.
    #[arg(long, default_value = "")]
    pub only: Filter,
    /// Cells at once, never two on one device.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: u64,
    /// Where cells run: here (`local`), as Slurm job arrays (`slurm`), or as Kubernetes indexed Jobs
    /// (`k8s`, with --emit). Cluster targets name what to ask for: a MIG profile, `cuda` or `cpu`.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: Backend,
    /// Slurm: submit the job arrays with sbatch (without it they are written, not submitted); a rerun
    /// submits only the cells neither done nor queued.
    #[arg(long, conflicts_with = "status")]
    pub submit: bool,
    /// Slurm: which cells are done, queued, running, failed or missing, from the folder, squeue and
    /// the tasks' exit markers.
    #[arg(long)]
    pub status: bool,
    #[arg(long, help_heading = "Cluster backends")]
    pub partition: Option<String>,
    #[arg(long, help_heading = "Cluster backends")]
    pub account: Option<String>,
    /// Slurm `--gres` of a MIG target; `{profile}` is replaced by its profile.
    #[arg(long, default_value = "gpu:{profile}:1", help_heading = "Cluster backends")]
    pub gres_template: String,
    /// Slurm `--gres` of a whole-GPU target.
    #[arg(long, default_value = "gpu:1", help_heading = "Cluster backends")]
    pub gpu_gres: String,
    /// One cell per node at a time (Slurm `--exclusive`; a pod anti-affinity on Kubernetes).
    #[arg(long, help_heading = "Cluster backends")]
    pub one_per_node: bool,
    /// Kubernetes: the folder to write the manifests to.
    #[arg(long, help_heading = "Cluster backends")]
    pub emit: Option<PathBuf>,
    /// Kubernetes: the migprof image (scripts/Containerfile).
    #[arg(long, default_value = "migprof:latest", help_heading = "Cluster backends")]
    pub image: String,
    #[arg(long, default_value = "default", help_heading = "Cluster backends")]
    pub namespace: String,
    /// Kubernetes: the PersistentVolumeClaim every pod writes its results to.
    #[arg(long, default_value = "migprof-results", help_heading = "Cluster backends")]
    pub results_pvc: String,
    /// Kubernetes: how the device plugin exposes MIG slices.
    #[arg(long, value_enum, default_value = "mixed", help_heading = "Cluster backends")]
    pub mig_strategy: MigStrategyArg,
}

/// Where a sweep's cells run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Local,
    Slurm,
    K8s,
}

/// `migprof sweep`: the dry run, or the sweep with its summary. `Ok(false)` when a cell failed or the
/// sweep was interrupted.
pub fn exec(args: SweepArgs, log: &mut dyn Write) -> Result<ExitCode> {
    super::args::ask_recalibration(args.recalibrate);
    run(&args, log).map(super::exit_code)
}

fn run(args: &SweepArgs, log: &mut dyn Write) -> Result<bool> {
    let file = migprof::sweep::file::SweepFile::read(&args.file)?;
    let opts = migprof::sweep::Options {
        out: args.out.clone(),
        dry_run: args.dry_run,
        force: args.force,
        retry_oom: args.retry_oom,
        only: args.only.clone(),
        jobs: args.jobs as usize,
        terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    match args.backend {
        Backend::Local => anyhow::ensure!(
            !args.submit && !args.status && args.emit.is_none(),
            "--submit and --status are for --backend slurm, --emit for --backend k8s"
        ),
        Backend::Slurm => {
            anyhow::ensure!(
                args.emit.is_none(),
                "--emit writes Kubernetes manifests: use it with --backend k8s"
            );
            if args.status {
                return migprof::fleet::slurm::status(&file, &opts, log);
            }
            let slurm = migprof::fleet::slurm::SlurmOptions {
                partition: args.partition.clone(),
                account: args.account.clone(),
                gres_template: args.gres_template.clone(),
                gpu_gres: args.gpu_gres.clone(),
                one_per_node: args.one_per_node,
                submit: args.submit,
                timeout_secs: file.defaults.timeout_secs,
            };
            let exe = std::env::current_exe().context("finding this migprof for the job scripts")?;
            migprof::fleet::slurm::submit(&file, &opts, &slurm, &exe, log)?;
            return Ok(true);
        }
        Backend::K8s => {
            let Some(dir) = &args.emit else {
                anyhow::bail!("--backend k8s writes manifests: give --emit DIR (apply them with kubectl)")
            };
            anyhow::ensure!(
                !args.submit && !args.status,
                "--submit and --status are for --backend slurm; apply the manifests with kubectl"
            );
            let k = migprof::fleet::k8s::K8sOptions {
                image: args.image.clone(),
                namespace: args.namespace.clone(),
                results_pvc: args.results_pvc.clone(),
                strategy: args.mig_strategy.into(),
                one_per_node: args.one_per_node,
                timeout_secs: file.defaults.timeout_secs,
            };
            migprof::fleet::k8s::emit(&file, &opts, &k, dir, log)?;
            return Ok(true);
        }
    }
    if opts.dry_run {
        migprof::sweep::preview::dry_run(&file, &opts, log)?;
        return Ok(true);
    }
    // A program that is not here would fail every one of its cells: said before any runs.
    for p in &file.programs {
        migprof::program::launch::check_command(&p.command_for(None))
            .with_context(|| format!("[[programs]] `{}`", p.name))?;
    }
    if !file.servers.is_empty() {
        migprof::program::launch::check_command(&["sh"]).context("[[servers]] start through sh")?;
    }
    let exe = std::env::current_exe().context("finding this migprof to start its cells")?;
    let summary = schedule::run(&file, &opts, &exe, log)?;
    writeln!(log, "{}; rows in {}", said(&summary), rows_in(&file, &args.out))?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(!summary.interrupted && summary.failed() == 0)
}

/// How a sweep ended, in one line: what was planned, skipped, run (by status), probed and left to
/// another sweep.
fn said(summary: &migprof::sweep::schedule::Summary) -> String {
    let statuses: Vec<String> = summary
        .by_status
        .iter()
        .map(|(s, n)| format!("{n} {}", s.as_str()))
        .collect();
    let or_nothing = |show: bool, text: String| if show { text } else { String::new() };
    format!(
        "{}: {} cell(s) planned, {} skipped (done already), {} run{}{}{}{}",
        if summary.interrupted { "interrupted" } else { "done" },
        summary.planned,
        summary.skipped,
        summary.ran,
        or_nothing(!statuses.is_empty(), format!(" ({})", statuses.join(", "))),
        or_nothing(summary.probes > 0, format!(", {} max-search probe(s)", summary.probes)),
        or_nothing(
            summary.claimed > 0,
            format!(", {} measured by another sweep", summary.claimed)
        ),
        or_nothing(summary.interrupted, "; rerun the same command to finish".to_string()),
    )
}

/// How MIG slices are exposed by the device plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MigStrategyArg {
    /// Each profile its own resource, `nvidia.com/mig-3g.40gb`.
    Mixed,
    /// Every slice of a node the same profile, as `nvidia.com/gpu`; the product label names it.
    Single,
}

impl From<MigStrategyArg> for MigStrategy {
    fn from(s: MigStrategyArg) -> Self {
        match s {
            MigStrategyArg::Mixed => MigStrategy::Mixed,
            MigStrategyArg::Single => MigStrategy::Single,
        }
    }
}

/// Where the sweep's rows are: the folders of [`tables_written`] that exist (a sweep of capacity
/// searches whose cells all measured has no `runs`), or the results folder.
fn rows_in(file: &migprof::sweep::file::SweepFile, out: &std::path::Path) -> String {
    let folders: Vec<String> = tables_written(file)
        .iter()
        .map(|t| out.join(t.dir_name()))
        .filter(|d| d.is_dir())
        .map(|d| d.display().to_string())
        .collect();
    match folders.is_empty() {
        true => out.display().to_string(),
        false => folders.join(", "),
    }
}

/// The tables a sweep's cells write their rows into: `runs` for its matrices (and any failed cell),
/// `capacity` and `serve_capacity` for its searches of each kind of model (their steps beside them).
fn tables_written(file: &migprof::sweep::file::SweepFile) -> Vec<Table> {
    use migprof::sweep::file::Served;
    let served: Vec<Served> = file
        .capacity
        .iter()
        .flat_map(|c| c.models.iter().map(|m| Served::of(m)))
        .collect();
    let mut tables = vec![Table::Runs];
    if served.contains(&Served::Passes) {
        tables.push(Table::Capacity);
    }
    if served.contains(&Served::Generation) {
        tables.push(Table::ServeCapacity);
    }
    tables
}
