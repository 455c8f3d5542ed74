//! The child's side of a cell: what `migprof cell` runs in the process a sweep (or a cluster's task)
//! starts for it, and the row `migprof cell-ended` writes for a cluster's cell that failed.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;

use crate::cell::runner::{self, Offer, Ran, Target};
use crate::cell::CellSpec;
use crate::load::settings::Keys;
use crate::provenance;
use crate::run::record::Status;
use crate::sweep::child::{classify, Exit, EXIT_OOM, RESULT_PREFIX};

/// `migprof cell`: one cell, measured and written with its identity. The exit code tells the sweep
/// how it ended: 0 measured (the row is written), [`EXIT_OOM`] out of memory,
/// 1 any other error.
pub fn run_cell(spec_path: &Path, out: &Path, invocation: Option<&str>, stdout: &mut dyn Write) -> Result<ExitCode> {
    // The line the sweep reads: `<status> <what it measured>`.
    let result = (|| -> Result<String> {
        let cell = CellSpec::read(spec_path)?;
        if let Some(limit) = cell.timeout_secs {
            end_after(Duration::from_secs_f64(limit) + OWN_LIMIT_GRACE);
        }
        if cell.job.server().is_some() {
            let outcome = runner::run_server(&cell, invocation, out)?;
            return Ok(result_line(&cell, &Ran::Server(outcome)));
        }
        if cell.job.program().is_some() {
            let run = runner::run_program(&cell, invocation, out)?;
            return Ok(result_line(&cell, &Ran::Measured(Box::new(run))));
        }
        let spec = cell.run_spec()?;
        let target = Target::of_child(&cell, invocation)?;
        // A serving job's steps report their progress to the cell's log.
        let ran = runner::run(
            &cell,
            &spec,
            &Offer::default(),
            &target,
            out,
            Keys::SweepFile,
            &mut std::io::stderr(),
        )?;
        Ok(result_line(&cell, &ran))
    })();
    match result {
        Ok(line) => {
            writeln!(stdout, "{}{line}", RESULT_PREFIX)?;
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            let code = if Status::of_error(&e) == Status::Oom {
                EXIT_OOM
            } else {
                1
            };
            Ok(ExitCode::from(code as u8))
        }
    }
}

/// What the cell measured, after its status: the line the sweep prints and keeps.
fn result_line(cell: &CellSpec, ran: &Ran) -> String {
    let or_none = |c: Option<Option<f64>>, digits: usize| match c.flatten() {
        Some(c) => format!("{c:.digits$}/s"),
        None => "none".to_string(),
    };
    match ran {
        Ran::Measured(run) => format!(
            "{} {:.1}/s p50 {:.3} ms, verdict {}",
            run.cell.status.as_str(),
            run.throughput(),
            run.stats.p50_ns as f64 / 1e6,
            run.assessment.verdict
        ),
        Ran::Loaded(outcome) => format!(
            "ok capacity {} within p99 {} ms",
            or_none(outcome.capacity, 1),
            cell.job.load().and_then(|s| s.slo_p99_ms).unwrap_or_default()
        ),
        Ran::Server(outcome) => match outcome.capacity {
            Some(capacity) => format!(
                "ok {} steps, capacity {} within {}",
                outcome.rates.len(),
                or_none(Some(capacity), 1),
                outcome.within
            ),
            None => {
                let rates: Vec<String> = outcome.rates.iter().map(|r| format!("{r:.1}")).collect();
                format!("ok {} steps at {} requests/s", outcome.rates.len(), rates.join(", "))
            }
        },
        Ran::Served(outcome) => {
            let settings = cell.job.serve();
            format!(
                "ok capacity {} within TTFT p99 {} ms and TPOT p99 {} ms",
                or_none(outcome.capacity, 2),
                settings.and_then(|s| s.slo_ttft_p99_ms).unwrap_or_default(),
                settings.and_then(|s| s.slo_tpot_p99_ms).unwrap_or_default()
            )
        }
    }
}

/// How long past the sweep's `timeout_secs` a cell waits for its sweep to stop it before it stops
/// itself: the sweep's kill comes first whenever the sweep is there to make it.
const OWN_LIMIT_GRACE: Duration = Duration::from_secs(5);

/// Ends this process after `limit`, whatever it is doing then: a cell whose sweep is gone still
/// keeps its time limit.
fn end_after(limit: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!(
            "error: the cell ran {} s, past its sweep's time limit: it ends itself",
            limit.as_secs_f64()
        );
        std::process::exit(1);
    });
}

/// `migprof cell-ended`: the row of a cell whose `migprof cell` exited with `code` on a cluster,
/// classified as a local sweep classifies its children (its log's last lines as the error).
pub fn cell_ended(spec_path: &Path, out: &Path, invocation: &str, code: i32, log: Option<&Path>) -> Result<()> {
    let cell = CellSpec::read(spec_path)?;
    let output = log.and_then(|l| std::fs::read_to_string(l).ok()).unwrap_or_default();
    // A shell reports a process killed by signal N as 128 + N.
    let exit = if code > 128 {
        Exit::Signal(code - 128)
    } else {
        Exit::Code(code)
    };
    let ending = classify(&exit, &output, false, std::time::Duration::ZERO);
    crate::sweep::schedule::record_failure(out, &cell, provenance::now(), &ending, invocation, &provenance::host())
}
