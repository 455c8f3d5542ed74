//! The command line, the binary's own layer: each command's flags, their checks and their conversion
//! into the library's options live in one file here (`run.rs`, `load.rs`, ...), each with an `exec`
//! that calls the library. The library never sees a flag.

mod args;
mod capacity;
mod catalogue;
mod cell;
mod exec;
mod load;
mod mig;
mod results;
mod run;
mod server;
mod sweep;

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "migprof",
    version,
    about = "Profile deep-learning workloads on NVIDIA GPUs, MIG slices and CPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Measure models: one run per model x mode x dtype x batch size. With no flags, a default set
    /// that takes about two minutes on a 2-core CPU.
    Run(run::RunArgs),
    /// Serve a model under open-loop load: requests arrive on a seeded schedule (Poisson or constant)
    /// whatever the model does, wait for a dynamic batcher, and each is timed from its scheduled
    /// arrival to its batch's completion. One step per --qps; with --search, the highest rate whose
    /// p99 stays within --slo-p99-ms (the target's capacity). Rows in the load and capacity tables.
    Load(load::LoadArgs),
    /// Plan a fleet for a target load: per model and MIG profile the capacity (measured by `load
    /// --search`, or from a CSV), then the fewest GPUs, with their MIG layouts, that serve every
    /// demand within the objective, solved exactly as an integer program; beside it the plans made by
    /// hand (a whole GPU per model, one profile per model).
    Capacity(capacity::CapacityArgs),
    /// Run your own program on a target and measure it: pinned as you would pin it
    /// (CUDA_VISIBLE_DEVICES, an MPS client of migprof's daemon for mps:), its output kept, the
    /// device sampled, its whole process tree stopped when it ends, and the steps it reports (a line
    /// of JSON each, or its output read by --step-pattern) written as the rows `run` writes.
    Exec(exec::ExecArgs),
    /// Keep a program's process tree for `exec` (what `exec` starts between itself and the program).
    #[command(hide = true)]
    Keep(exec::KeepArgs),
    /// Run a sweep file: a matrix of cells over targets (devices), each cell in a child process of its
    /// own, a row for every cell however it ends; a rerun runs only the cells not done.
    Sweep(sweep::SweepArgs),
    /// Run one cell of a sweep from its spec (what `sweep` starts as a child process).
    #[command(hide = true)]
    Cell(cell::CellArgs),
    /// Stream through memory beside a memory-partitioned emulated slice, as its client asks on stdin
    /// (what an `mps-mem:` client starts on the SMs it does not have).
    #[command(hide = true)]
    MemoryNeighbour {
        /// SMs of its share: its grid is sized by them.
        #[arg(long)]
        sms: u32,
    },
    /// Write the row of a cell whose `migprof cell` failed on a cluster, as a local sweep would
    /// (what a Slurm task or a Kubernetes pod runs after a failed cell).
    #[command(hide = true)]
    CellEnded(cell::CellEndedArgs),
    /// Merge results folders (from several machines or clusters) into one: every part once (the
    /// same run in two folders is copied once), and cells measured in more than one folder named.
    Merge(results::MergeArgs),
    /// Check every part of a results folder: each file readable and migprof's, one row per run, a
    /// sample per measured iteration; every problem named with its file.
    Check(results::CheckArgs),
    /// Compare two groups of runs in a results folder cell by cell: the full GPU against a 3g slice
    /// (--baseline target=full --target target=3g), one MIG profile against another, f32 against
    /// bf16. Each matched cell: both throughputs, p50 and p99, the ratio with its 95% interval, and
    /// whether the difference is beyond the runs' own noise.
    Compare(results::CompareArgs),
    /// Write the report of one or more results folders: a self-contained HTML page (inline SVG, no
    /// script, no network) or Markdown with its SVGs in a folder beside it.
    Report(results::ReportArgs),
    /// List the models with their parameter counts and FLOPs per sample.
    Models,
    /// List the NVIDIA GPUs and their MIG devices (profile, GPU/compute instance ids, SMs, memory,
    /// UUID), as NVML reports them.
    Devices(catalogue::DevicesArgs),
    /// List MIG GPU-instance profiles with their placements, like `nvidia-smi mig -lgip` and `-lgipp`:
    /// of a known GPU (--gpu) or, without it, of this machine's GPU as NVML reports them.
    Profiles(catalogue::TableArgs),
    /// Check whether a set of MIG GPU instances fits a GPU and where each goes, or list every maximal
    /// layout.
    Plan(catalogue::PlanArgs),
    /// Apply, destroy or export MIG layouts (mig-parted's file format). Dry runs unless --yes.
    #[command(subcommand)]
    Mig(mig::MigCommand),
}

/// Runs the command; the exit code says whether it did all it was asked (a sweep with a failed cell,
/// a layout that does not fit, a `check` that found a problem: failure).
pub fn exec(cli: Cli) -> Result<ExitCode> {
    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    match cli.command {
        Command::Run(args) => run::exec(args, &mut stdout, &mut stderr),
        Command::Load(args) => load::exec(args, &mut stderr),
        Command::Capacity(args) => capacity::exec(args, &mut stdout),
        Command::Sweep(args) => sweep::exec(args, &mut stderr),
        Command::Exec(args) => exec::exec(args, &mut stdout, &mut stderr),
        Command::Keep(args) => exec::keep(args),
        Command::Cell(args) => cell::exec(args, &mut stdout),
        Command::CellEnded(args) => cell::exec_ended(args),
        Command::MemoryNeighbour { sms } => memory_neighbour(sms, &mut stdout),
        Command::Merge(args) => results::merge(args, &mut stdout),
        Command::Check(args) => results::check(args, &mut stdout),
        Command::Compare(args) => results::compare(args, &mut stdout),
        Command::Report(args) => results::report(args, &mut stdout),
        Command::Models => catalogue::models(&mut stdout),
        Command::Devices(args) => catalogue::devices(args, &mut stdout),
        Command::Profiles(args) => catalogue::profiles(args, &mut stdout),
        Command::Plan(args) => catalogue::plan(args, &mut stdout),
        Command::Mig(cmd) => mig::exec(cmd, &mut stdout, &mut stderr),
    }
}

/// `migprof memory-neighbour`: the GPU first (its error goes to the client as an answer), then the
/// client's requests until it quits.
fn memory_neighbour(sms: u32, out: &mut dyn std::io::Write) -> Result<ExitCode> {
    use migprof::mps::neighbour;
    let mut streamer = match neighbour::gpu_streamer(sms) {
        Ok(s) => s,
        Err(e) => {
            writeln!(out, "error {e:#}")?;
            return Err(e);
        }
    };
    let input = std::io::BufReader::new(std::io::stdin());
    neighbour::serve(input, out, streamer.as_mut())?;
    Ok(ExitCode::SUCCESS)
}

/// `Ok(true)` is success, `Ok(false)` a command that ran but did not get all it was asked.
fn exit_code(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_valid_choices() {
        let err = |line: &str| {
            let argv = ["migprof", "run"].into_iter().chain(line.split_whitespace());
            Cli::try_parse_from(argv).unwrap_err().to_string()
        };
        let e = err("--model resnet19");
        assert!(
            e.contains("resnet19") && e.contains("resnet18") && e.contains("resnet152"),
            "{e}"
        );
        let e = err("--batch 1,0");
        assert!(
            e.contains("--batch `0`: a batch size is a whole number from 1 to 65536"),
            "{e}"
        );
        let e = err("--batch -1");
        assert!(e.contains("--batch `-1`"), "{e}");
        let e = err("--batch eight");
        assert!(e.contains("`eight`"), "{e}");
        let e = err("--mode eval");
        assert!(e.contains("infer") && e.contains("train"), "{e}");
        let e = err("--dtype fp8");
        assert!(e.contains("f32") && e.contains("bf16") && e.contains("f16"), "{e}");
        let e = err("--device tpu");
        assert!(e.contains("MIG-<uuid>"), "{e}");
        let e = err("--iters 0");
        assert!(e.contains("--iters"), "{e}");
        let e = err("--iters 5 --duration 2");
        assert!(e.contains("cannot be used with"), "{e}");
        let e = err("--duration -1");
        assert!(e.contains("--duration") && e.contains("`-1`"), "{e}");
        let e = err("--encoder-layers op3");
        assert!(e.contains("fused") && e.contains("composed"), "{e}");
    }
}
