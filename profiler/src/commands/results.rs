//! The commands that read results folders: `merge`, `check`, `compare` and `report`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{ensure, Result};
use clap::{Args, ValueEnum};
use migprof::results::compare::Selector;
use migprof::results::parts::read_table;

use super::args::report_hint;

#[derive(Debug, Args)]
pub struct MergeArgs {
    /// Results folders to merge.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// The merged folder (created; parts already there stay).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The results folder.
    pub dir: PathBuf,
    /// Mend what can be mended first: rewrite parts written by an older migprof with every column of
    /// their table (nulls where they had none), and remove samples and metrics of runs that have no
    /// row (older than a minute); then check.
    #[arg(long)]
    pub fix: bool,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The results folder.
    pub dir: PathBuf,
    /// The runs to compare against: column=value over the table's rows.
    #[arg(long)]
    pub baseline: Selector,
    /// The runs compared: column=value over the same column.
    #[arg(long)]
    pub target: Selector,
    /// The rows compared: runs (throughput in items/s), load (a step's achieved requests/s at its
    /// concurrency or rate: migprof's engine or a server of your own), capacity (a search's
    /// requests/s within its objective) or serve (a language model's step: its achieved requests/s
    /// and TTFT, migprof's engine or an OpenAI-compatible server).
    #[arg(long, value_enum, default_value = "runs")]
    pub table: migprof::results::compare::Kind,
    #[arg(long, value_enum, default_value = "text")]
    pub format: CompareFormat,
}

/// How `compare` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CompareFormat {
    Text,
    Md,
    Json,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Results folders.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
    /// Where to write it; default report.html (report.md) in the first folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "html")]
    pub format: ReportFormat,
    /// The batch whose runs' latency distributions and time series are drawn; default: each
    /// target's largest.
    #[arg(long)]
    pub detail_batch: Option<usize>,
}

/// How `report` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    Html,
    Md,
}

pub fn merge(args: MergeArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    let m = migprof::results::merge::merge(&args.dirs, &args.out)?;
    for (cell, folders) in &m.cells_in_several {
        writeln!(stdout, "cell {cell}: rows from {} (all kept)", folders.join(", "))?;
    }
    for (path, why) in &m.left {
        writeln!(stdout, "left {}: {why}", path.display())?;
    }
    writeln!(
        stdout,
        "merged {} folder(s) into {}: {} part(s) copied, {} already there, {} left (not migprof's or unreadable); {} cell(s) measured in more than one folder",
        args.dirs.len(),
        args.out.display(),
        m.copied,
        m.already,
        m.left.len(),
        m.cells_in_several.len()
    )?;
    writeln!(stdout, "{}", report_hint(&args.out))?;
    Ok(ExitCode::SUCCESS)
}

/// Fails when it found a problem.
pub fn check(args: CheckArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    let dir = &args.dir;
    if args.fix {
        let fixed = migprof::results::check::fix(dir)?;
        for p in &fixed.widened {
            writeln!(stdout, "fixed {}: every column of its table", p.display())?;
        }
        for (p, held) in &fixed.removed {
            writeln!(stdout, "removed {}: {held}, which have no row", p.display())?;
        }
    }
    let report = migprof::results::check::check(dir)?;
    for p in &report.problems {
        writeln!(stdout, "problem: {p}")?;
    }
    writeln!(
        stdout,
        "{}: {} run row(s), {} sample(s), {} metric reading(s), {} load step(s) with {} batch(es), {} capacity search(es), {} serving step(s) with {} request(s), {} serving search(es); {}",
        dir.display(),
        report.rows["runs"],
        report.rows["samples"],
        report.rows["metrics"],
        report.rows["load"],
        report.rows["load_batches"],
        report.rows["capacity"],
        report.rows["serve"],
        report.rows["serve_requests"],
        report.rows["serve_capacity"],
        if report.problems.is_empty() { "no problems".to_string() } else { format!("{} problem(s)", report.problems.len()) }
    )?;
    Ok(super::exit_code(report.problems.is_empty()))
}

pub fn compare(args: CompareArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    let dir = &args.dir;
    ensure!(dir.is_dir(), "{}: no such results folder", dir.display());
    let kind = args.table;
    let rows = read_table(dir, kind.table())?;
    if rows.height() == 0 {
        let others: Vec<String> = migprof::results::compare::Kind::ALL
            .into_iter()
            .filter(|k| *k != kind)
            .map(|k| k.table())
            .filter_map(|t| {
                let n = read_table(dir, t).map(|f| f.height()).unwrap_or(0);
                (n > 0).then(|| format!("--table {} ({n} rows)", t.dir_name()))
            })
            .collect();
        anyhow::bail!(
            "{}: no {} rows to compare{}",
            dir.display(),
            kind.table().dir_name(),
            if others.is_empty() {
                String::new()
            } else {
                format!("; there are {}", others.join(", "))
            }
        );
    }
    let c = migprof::results::compare::compare_rows(&rows, kind, &args.baseline, &args.target)?;
    let format = match args.format {
        CompareFormat::Text => migprof::results::compare::render::Format::Text,
        CompareFormat::Md => migprof::results::compare::render::Format::Md,
        CompareFormat::Json => migprof::results::compare::render::Format::Json,
    };
    write!(stdout, "{}", c.render(format)?)?;
    Ok(ExitCode::SUCCESS)
}

/// Writes the report and says where.
pub fn report(args: ReportArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    let (format, name) = match args.format {
        ReportFormat::Html => (migprof::report::Format::Html, "report.html"),
        ReportFormat::Md => (migprof::report::Format::Md, "report.md"),
    };
    let out = args.out.unwrap_or_else(|| args.dirs[0].join(name));
    migprof::report::write(&args.dirs, &out, format, args.detail_batch)?;
    writeln!(stdout, "report: {}", out.display())?;
    Ok(ExitCode::SUCCESS)
}
