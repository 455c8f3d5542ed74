//! `migprof exec`: a program migprof did not write, run on a target and measured by the steps it
//! reports; and `migprof keep`, the hidden keeper of its process tree.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use migprof::device::DeviceSpec;
use migprof::program::steps::{Pattern, STEPS_ENV};
use migprof::program::{self, launch, rows, ProgramOptions};
use migprof::provenance;
use migprof::run::RunContext;

use super::args::{device_or_default, parse_seconds, report_hint, DTypeArg, ModeArg};

/// The step protocol, after the flags in `--help`.
const STEPS_HELP: &str = "\
Steps: the program appends one line of JSON per step to the file named in MIGPROF_STEPS:
  {\"duration_ms\": 12.5, \"items\": 32, \"phase\": \"train\"}
duration_ms (or duration_s) is the step's time, items what it processed (default 1), phase one of
warmup (left out), infer, train or generate (default: --mode). scripts/migprof_steps.py does it for
Python: `with migprof_steps.step(items=len(batch), phase=\"train\"): ...`. A row is made per phase and
number of items, of at least 3 steps; a program that reports none gets one row of its whole run.";

#[derive(Debug, Clone, Args)]
#[command(after_long_help = STEPS_HELP)]
pub struct ExecArgs {
    /// Where the program runs, pinned as a user pins it: a GPU or MIG device by its UUID in
    /// CUDA_VISIBLE_DEVICES; mps:<profile> as a client of migprof's own MPS daemon with the
    /// profile's SM share and memory limit; cpu with no GPU visible. Anything `run --device` takes
    /// but mps-mem:. Default: the first GPU, else cpu.
    #[arg(long)]
    pub device: Option<DeviceSpec>,

    /// Results folder: its rows under runs/, its output, steps and exit under programs/<run id>/.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,

    /// The rows' model name. Default: the script's name (`python3 train.py`: train), else the
    /// command's.
    #[arg(long)]
    pub name: Option<String>,

    /// The phase of the steps that name none.
    #[arg(long, value_enum, default_value_t = ModeArg::Infer)]
    pub mode: ModeArg,

    /// What the program computes in, as you know it (migprof cannot see it): recorded as the rows'
    /// dtype. Default: not recorded.
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,

    /// Read the steps from the program's output lines instead of the step file: a regular
    /// expression whose named groups give a step's time, ms, secs or rate (items per second), and
    /// items, e.g. 'took (?P<ms>[0-9.]+) ms for (?P<items>[0-9]+) images'.
    #[arg(long, value_name = "REGEX", value_parser = |s: &str| s.parse::<Pattern>())]
    pub step_pattern: Option<Pattern>,

    /// Measured steps of each phase and size left out at its start as warm-up. Default: 1, or 0
    /// when the program marks warm-up steps itself.
    #[arg(long, value_name = "N")]
    pub warmup_steps: Option<usize>,

    /// Stop the program after SECS (SIGTERM, then SIGKILL to its whole tree 10 s later); its row
    /// says `timeout`.
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--timeout", s, true))]
    pub timeout: Option<f64>,

    /// The GPU sampler's interval in milliseconds while the program runs; 0 turns it off.
    #[arg(long, default_value_t = 100)]
    pub sample_interval_ms: u64,

    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// `migprof keep`'s arguments (started by `exec` only).
#[derive(Debug, Clone, Args)]
pub struct KeepArgs {
    /// Where to write how the program ended.
    #[arg(long)]
    pub status: PathBuf,
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

pub fn keep(args: KeepArgs) -> Result<ExitCode> {
    Ok(program::keeper::keep(&args.status, &args.command))
}

impl ExecArgs {
    fn options(&self) -> Result<ProgramOptions> {
        if self.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            anyhow::bail!("--name is empty: give the program a name, which its rows record as `model`");
        }
        Ok(ProgramOptions {
            name: self
                .name
                .clone()
                .unwrap_or_else(|| program::default_name(&self.command)),
            command: self.command.clone(),
            mode: self.mode.into(),
            precision: self.dtype.map(Into::into),
            pattern: self.step_pattern.clone(),
            warmup_steps: self.warmup_steps,
            timeout: self.timeout.map(Duration::from_secs_f64),
            sample_interval: (self.sample_interval_ms > 0).then(|| Duration::from_millis(self.sample_interval_ms)),
        })
    }
}

pub fn exec(args: ExecArgs, stdout: &mut dyn Write, log: &mut dyn Write) -> Result<ExitCode> {
    let options = args.options()?;
    // Before anything starts: a command that is not there, a folder that cannot be written.
    launch::check_command(&options.command)?;
    migprof::files::ensure_writable_dir(&args.out)?;
    let device_spec = device_or_default(args.device.as_ref(), log)?;
    let target = device_spec.for_program()?;
    writeln!(
        log,
        "migprof {}: {} as `{}` on {} [{}], results to {}",
        provenance::VERSION,
        program::command_line(&options.command),
        options.name,
        device_spec,
        target.info.name,
        args.out.display()
    )?;
    if let Some(e) = &target.info.emulation {
        writeln!(
            log,
            "MPS: the program is a client of migprof's daemon with {}; not verified: the SMs and memory it reached (migprof measures its own clients' reach, not a program's)",
            e.share.describe()
        )?;
    }
    if options.pattern.is_none() {
        writeln!(
            log,
            "steps: read from the file in {STEPS_ENV} (scripts/migprof_steps.py writes it)"
        )?;
    }
    let context = RunContext::new_invocation(&target.info);
    let target_is_gpu = target.info.selected.is_some();
    let outcome = launch::run(&options, &target, &args.out);
    // Stopped now, said after the rows are written: a daemon that stops badly loses no measurement.
    let stopped = target.daemon.map(|d| d.stop());
    let outcome = outcome?;
    // Named as `run` names its rows' target: the device as it calls itself.
    let made = rows::rows(&outcome, &options, &context.device.name, &context)?;
    for run in &made.runs {
        migprof::results::runs::write_run(&args.out, run)?;
    }
    if let Some(f) = &made.failure {
        migprof::results::runs::write_failure(&args.out, f)?;
    }
    if let Some(stopped) = stopped {
        stopped?;
        writeln!(log, "MPS: daemon stopped")?;
    }
    said(&outcome, &made, &options, target_is_gpu, log)?;
    for run in &made.runs {
        writeln!(
            stdout,
            "{} {} {} item(s)/step: {} steps, p50 {:.3} ms, {:.1} items/s, {}",
            options.name,
            run.mode.as_str(),
            run.batch,
            run.stats.iterations,
            run.stats.p50_ns as f64 / 1e6,
            run.throughput(),
            run.assessment.verdict
        )?;
    }
    writeln!(stdout, "output and steps: {}", outcome.dir.display())?;
    writeln!(stdout, "{}", report_hint(&args.out))?;
    Ok(match &made.failure {
        None => ExitCode::SUCCESS,
        Some(f) => {
            writeln!(log, "error: {} ({})", f.error, f.identity.status.as_str())?;
            ExitCode::FAILURE
        }
    })
}

/// What a user must hear of the run beside its rows: how the program ended, what it left running,
/// the steps left out, and whether NVML saw it on the device.
fn said(
    outcome: &launch::Outcome,
    made: &rows::Rows,
    options: &ProgramOptions,
    on_gpu: bool,
    log: &mut dyn Write,
) -> Result<()> {
    writeln!(
        log,
        "the program: {}, {:.1} s",
        outcome.ended.describe(),
        outcome.wall.as_secs_f64()
    )?;
    if outcome.ended.left_running > 0 {
        writeln!(
            log,
            "warning: the program left {} process(es) running when it ended; migprof stopped them",
            outcome.ended.left_running
        )?;
    }
    for note in &made.notes {
        writeln!(log, "note: {note}")?;
    }
    if options.pattern.is_some() && outcome.steps.is_empty() {
        writeln!(
            log,
            "warning: --step-pattern matched no line of the program's output: its row is its whole run"
        )?;
    }
    if on_gpu && options.sample_interval.is_some() {
        let samples = match &outcome.metrics {
            Some(Ok(s)) => s.as_slice(),
            _ => &[],
        };
        match rows::on_device(samples, &outcome.pids) {
            (Some(mib), seen) => writeln!(log, "on the device: {seen} of its process(es), {mib:.0} MiB at most")?,
            (None, _) => writeln!(
                log,
                "warning: NVML never listed a process of the program on the device: it ran elsewhere, on the CPU, or in another PID namespace"
            )?,
        }
    }
    Ok(())
}
