//! `migprof cell` and `migprof cell-ended`: the hidden commands a sweep, a Slurm task or a Kubernetes
//! pod runs for one cell (the library's `sweep::worker` does the work).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;

#[derive(Debug, Args)]
pub struct CellArgs {
    /// The cell spec (JSON, see `cell::CellSpec`).
    #[arg(long)]
    pub spec: PathBuf,
    /// The results folder to write the cell's row to.
    #[arg(long)]
    pub out: PathBuf,
    /// The sweep invocation this cell belongs to.
    #[arg(long)]
    pub invocation: Option<String>,
}

#[derive(Debug, Args)]
pub struct CellEndedArgs {
    #[arg(long)]
    pub spec: PathBuf,
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long)]
    pub invocation: String,
    #[arg(long, allow_negative_numbers = true)]
    pub exit_code: i32,
    /// The cell's output, for the error's text.
    #[arg(long)]
    pub log: Option<PathBuf>,
}

pub fn exec(args: CellArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    migprof::sweep::worker::run_cell(&args.spec, &args.out, args.invocation.as_deref(), stdout)
}

pub fn exec_ended(args: CellEndedArgs) -> Result<ExitCode> {
    migprof::sweep::worker::cell_ended(
        &args.spec,
        &args.out,
        &args.invocation,
        args.exit_code,
        args.log.as_deref(),
    )?;
    Ok(ExitCode::SUCCESS)
}
