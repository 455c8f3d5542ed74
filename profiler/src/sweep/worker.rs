//! The child's side of a cell: what `migprof cell` runs in the process a sweep (or a cluster's task)
//! starts for it, and the row `migprof cell-ended` writes for a cluster's cell that failed.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;

use crate::device::{DeviceSpec, OpenDevice};
use crate::provenance;
use crate::results::runs::write_run;
use crate::run::execute;
use crate::run::record::{RunContext, Status};
use crate::sweep::cell::{CellSpec, Purpose};
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
        let spec = cell.run_spec()?;
        let device = if cell.scheduled {
            scheduled_device(&cell.device)?
        } else {
            cell.device.parse::<DeviceSpec>()?.open()?
        };
        crate::run::preflight::check_precision(std::slice::from_ref(&spec), &device)?;
        let context = RunContext {
            invocation_id: invocation
                .map(str::to_string)
                .unwrap_or_else(|| provenance::run_id(provenance::now())),
            host: provenance::host(),
            device: device.info.clone(),
            expected: crate::run::evidence::Expected::on(&device.info),
            group: crate::run::group::GroupMember::from_env(&cell.cell_id()),
        };
        let status = if cell.purpose == Purpose::Probe {
            Status::Probe
        } else {
            Status::Ok
        };
        let identity = cell.identity(status);
        if let Some(settings) = &cell.load {
            // A search takes minutes: a dtype the device cannot run is refused first, with what
            // runs there, as `migprof load` refuses it.
            crate::run::preflight::check(std::slice::from_ref(&spec), &device)?;
            // A capacity search: its steps' progress goes to the cell's log.
            let rates = crate::load::job::Rates::Search { start: None };
            let job = crate::load::job::Job {
                spec: &spec,
                settings,
                rates: &rates,
                allow_overload: false,
            };
            let outcome = crate::load::job::run(job, &device, &context, &identity, out, &mut std::io::stderr())?;
            return Ok(match outcome.capacity.flatten() {
                Some(c) => format!(
                    "ok capacity {c:.1}/s within p99 {} ms",
                    settings.slo_p99_ms.unwrap_or_default()
                ),
                None => format!(
                    "ok capacity none within p99 {} ms",
                    settings.slo_p99_ms.unwrap_or_default()
                ),
            });
        }
        if let Some(settings) = &cell.serve {
            // A language model's capacity search, as `migprof load` runs it (its cache is sized from
            // the memory the weights and the workspace leave): its steps' progress goes to the
            // cell's log.
            let rates = crate::load::job::Rates::Search { start: None };
            let job = crate::load::generation::ServeJob {
                spec: &spec,
                settings,
                rates: &rates,
            };
            let outcome = crate::load::generation::run(job, &device, &context, &identity, out, &mut std::io::stderr())?;
            let within = format!(
                "within TTFT p99 {} ms and TPOT p99 {} ms",
                settings.slo_ttft_p99_ms.unwrap_or_default(),
                settings.slo_tpot_p99_ms.unwrap_or_default()
            );
            return Ok(match outcome.capacity.flatten() {
                Some(c) => format!("ok capacity {c:.2}/s {within}"),
                None => format!("ok capacity none {within}"),
            });
        }
        // A generation that cannot fit is known from the model's shape: its cell says so, as an
        // out-of-memory cell, instead of building gigabytes of weights to find out. (A `max`
        // search's probes find the limit by running.)
        if spec.lengths.is_some() && cell.purpose == Purpose::Measure {
            crate::run::preflight::check_memory(std::slice::from_ref(&spec), &device).map_err(|e| {
                if e.is::<crate::run::estimate::DoesNotFit>() {
                    e.context("out of memory before it starts, by the estimate from the model's shape")
                } else {
                    e
                }
            })?;
        }
        let run = execute(&spec, &device, context, identity)?;
        write_run(out, &run)?;
        Ok(format!(
            "{} {:.1}/s p50 {:.3} ms, verdict {}",
            run.cell.status.as_str(),
            run.throughput(),
            run.stats.p50_ns as f64 / 1e6,
            run.assessment.verdict
        ))
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

/// The device a cluster's scheduler assigned to a cell that asked for `asked` (a MIG profile, `cuda`
/// or `cpu`): the first visible one, which must be what was asked for.
fn scheduled_device(asked: &str) -> Result<OpenDevice> {
    if asked == "cpu" {
        return DeviceSpec::Cpu.open();
    }
    let device = DeviceSpec::Cuda.open()?;
    let got = device
        .info
        .selected
        .as_ref()
        .and_then(|s| s.mig.as_ref())
        .map(|m| m.profile.clone());
    match (asked, got) {
        ("cuda", None) => Ok(device),
        ("cuda", Some(p)) => anyhow::bail!(
            "the scheduler assigned a MIG {p} slice ({}); the target asks for a whole GPU",
            device.info.name
        ),
        (profile, Some(p)) if p == profile => Ok(device),
        (profile, got) => anyhow::bail!(
            "the scheduler assigned {} ({}); the target asks for a MIG {profile} slice",
            device.info.name,
            got.map_or("a whole GPU".to_string(), |p| format!("a {p} slice"))
        ),
    }
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
