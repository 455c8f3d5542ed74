use std::process::ExitCode;

use clap::Parser;
use migprof::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (mut stdout, mut stderr) = (std::io::stdout(), std::io::stderr());
    let result = match &cli.command {
        Command::Sweep(args) => {
            migprof::app::sweep(args, &mut stderr).map(|ok| if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Cell { spec, out, invocation } => migprof::app::cell(spec, out, invocation.as_deref(), &mut stdout),
        Command::CellEnded {
            spec,
            out,
            invocation,
            exit_code,
            log,
        } => migprof::app::cell_ended(spec, out, invocation, *exit_code, log.as_deref()).map(|_| ExitCode::SUCCESS),
        Command::Merge { dirs, out } => migprof::app::merge(dirs, out, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Check { dir } => {
            migprof::app::check(dir, &mut stdout).map(|ok| if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
        }
        Command::Compare {
            dir,
            baseline,
            target,
            format,
        } => migprof::app::compare(dir, baseline, target, *format, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Report {
            dirs,
            out,
            format,
            detail_batch,
        } => migprof::app::report(dirs, out.as_deref(), *format, *detail_batch, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Models => migprof::app::models(&mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Devices { json } => migprof::app::devices(*json, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Profiles(table) => migprof::app::profiles(table, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Plan { table, profiles, list } => migprof::app::plan(table, profiles, *list, &mut stdout)
            .map(|fits| if fits { ExitCode::SUCCESS } else { ExitCode::FAILURE }),
        Command::Mig(cmd) => migprof::app::mig(cmd, &mut stdout, &mut stderr).map(|_| ExitCode::SUCCESS),
        Command::Run(migprof::cli::RunArgs {
            device: Some(migprof::device::DeviceSpec::Mps(target)),
            ..
        })
        | Command::Load(migprof::cli::LoadArgs {
            device: Some(migprof::device::DeviceSpec::Mps(target)),
            ..
        }) if not_yet_mps_client() => migprof::app::run_under_mps(target, &mut stderr),
        // A search that finds no rate within the objective has still measured: its row says so.
        Command::Load(args) => migprof::app::load(args, &mut stderr).map(|_| ExitCode::SUCCESS),
        Command::Capacity(args) => migprof::app::capacity(args, &mut stdout).map(|_| ExitCode::SUCCESS),
        Command::Run(args) => migprof::app::run(args, &mut stderr).and_then(|report| {
            migprof::app::finish(&args.out, &report, &mut stdout)?;
            Ok(match &report.failed {
                None => ExitCode::SUCCESS,
                Some((spec, err)) => {
                    eprintln!(
                        "error: {} {} {} batch {} failed: {err:#}\n(runs finished before it are kept in {})",
                        spec.model,
                        spec.mode.as_str(),
                        spec.precision(),
                        spec.batch,
                        args.out.display()
                    );
                    ExitCode::FAILURE
                }
            })
        }),
    };
    result.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        ExitCode::FAILURE
    })
}

/// This process is not yet a client of migprof's MPS daemon (an emulated slice starts the daemon, then
/// runs the same command again as its client).
fn not_yet_mps_client() -> bool {
    std::env::var_os(migprof::mps::daemon::CLIENT_PIPE_ENV).is_none()
}
