//! Runs one cell on an opened target: `migprof run` (each of its runs), `migprof load` and a sweep's
//! child all come here, so a cell is checked, named and recorded one way whoever asked for it.
//!
//! What the cell is decides the job: a measurement (`run::execute`, its row written), a load job of
//! a model served one forward pass per request (`load::job`), or a language model's serving job
//! (`load::generation`). Before the job, the cell's preflight refuses what cannot run, in its own
//! words and before any large allocation; a job that then fails leaves a row saying how, where the
//! target records failures (a sweep's child leaves that row to its sweep, which also sees the ends a
//! child cannot report: a signal, the kernel's OOM killer, the sweep's time limit).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use super::spec::{CellSpec, Job, Purpose};
use crate::device::{DeviceSpec, OpenDevice};
use crate::load::generation::{ServeJob, ServeOutcome};
use crate::load::job::{JobOutcome, LoadJob, Rates};
use crate::load::settings::Keys;
use crate::program::{launch, rows, ProgramOptions};
use crate::provenance;
use crate::results::runs::{write_failure, write_run};
use crate::run::fingerprint::Fingerprint;
use crate::run::record::{Run, RunContext, Status};
use crate::run::spec::RunSpec;
use crate::run::{estimate, execute, preflight};

/// Where cells run: a device opened, as it was written, and the invocation its rows belong to.
pub struct Target {
    /// The device as the user wrote it (`--device`, a sweep target's `device`): part of a cell's id.
    pub written: String,
    pub device: OpenDevice,
    pub context: RunContext,
    /// Whether a cell that fails here writes its own row (see the module).
    records_failures: bool,
}

impl Target {
    /// A new invocation of `run` or `load` on `spec`: the device opened, its cells' failures
    /// recorded here.
    pub fn open(spec: &DeviceSpec) -> Result<Target> {
        let device = spec.open()?;
        Ok(Target {
            written: spec.to_string(),
            context: RunContext::new_invocation(&device.info),
            device,
            records_failures: true,
        })
    }

    /// The target of a sweep's child running `cell`: its device as the cell writes it, or for a
    /// cluster's cell the first device the scheduler made visible (which must be what the cell asked
    /// for); in the sweep's `invocation` (a new one where none is given) and, where the cell is a
    /// member of a concurrent group, that group. Its failures are recorded by the sweep.
    pub fn of_child(cell: &CellSpec, invocation: Option<&str>) -> Result<Target> {
        let device = if cell.scheduled {
            scheduled_device(&cell.device)?
        } else {
            cell.device.parse::<DeviceSpec>()?.open()?
        };
        let mut context = RunContext::new_invocation(&device.info);
        if let Some(id) = invocation {
            context.invocation_id = id.to_string();
        }
        context.group = crate::run::group::GroupMember::from_env(&cell.cell_id());
        Ok(Target {
            written: cell.device.clone(),
            device,
            context,
            records_failures: false,
        })
    }

    /// The cell of `spec` on this target: its identity names its rows; no sweep's.
    pub fn cell(&self, spec: &RunSpec) -> Result<CellSpec> {
        CellSpec::of_run(spec, &self.device.info.name, &self.written)
    }
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

/// What a serving cell offers its model: the rates and whether rates past the overload bound are
/// served. A measurement offers nothing; a sweep's serving cells search from a guess.
pub struct Offer {
    pub rates: Rates,
    /// `load --allow-overload`: serve rates beyond the closed loop's bound with a warning.
    pub allow_overload: bool,
}

impl Default for Offer {
    /// A search for the highest rate within the objectives, from the job's own first guess.
    fn default() -> Offer {
        Offer {
            rates: Rates::Search { start: None },
            allow_overload: false,
        }
    }
}

/// What a cell did.
pub enum Ran {
    /// A measurement, its row written.
    Measured(Box<Run>),
    /// A load job's steps (and a search's capacity), their rows written.
    Loaded(JobOutcome),
    /// A language model's serving steps (and a search's capacity), their rows written.
    Served(ServeOutcome),
    /// A user's server's steps (and a search's capacity), their rows written.
    Server(crate::server::measure::Measured),
}

/// Runs `cell` (made as `spec`) on `target`, its rows to `out`; a job's progress goes to `log`.
/// Refusals name settings as `keys` spells them (`load`'s flags, or a sweep file's keys).
pub fn run(
    cell: &CellSpec,
    spec: &RunSpec,
    offer: &Offer,
    target: &Target,
    out: &Path,
    keys: Keys,
    log: &mut dyn Write,
) -> Result<Ran> {
    check(cell, spec, &target.device, keys)?;
    let started = provenance::now();
    let status = match cell.purpose {
        Purpose::Probe => Status::Probe,
        Purpose::Measure => Status::Ok,
    };
    let identity = cell.identity(status);
    let (device, context) = (&target.device, &target.context);
    let ran = match &cell.job {
        Job::Load(settings) => {
            let job = LoadJob {
                spec,
                settings,
                rates: &offer.rates,
                allow_overload: offer.allow_overload,
            };
            crate::load::job::run(job, device, context, &identity, out, log).map(Ran::Loaded)
        }
        Job::Serve(settings) => {
            let job = ServeJob {
                spec,
                settings,
                rates: &offer.rates,
            };
            crate::load::generation::run(job, device, context, &identity, out, log).map(Ran::Served)
        }
        // A program or a server runs beside a device migprof must not hold: each has its own
        // runner.
        Job::Program(_) | Job::Server(_) => Err(anyhow::anyhow!(
            "a program's or a server's cell runs by its own runner, on a device this process does not open"
        )),
        Job::Measure => fits_by_shape(cell, spec, device)
            .and_then(|()| execute(spec, device, context.clone(), identity))
            .and_then(|run| write_run(out, &run).map(|_| Ran::Measured(Box::new(run)))),
    };
    if let (Err(e), true) = (&ran, target.records_failures) {
        let failure = cell.failure(
            Status::of_error(e),
            format!("{e:#}"),
            started,
            &context.invocation_id,
            &context.host,
            Fingerprint::collect(device.info.selected.as_ref()),
        );
        if let Err(w) = write_failure(out, &failure) {
            writeln!(log, "warning: the failed cell's row could not be written: {w:#}")?;
        }
    }
    ran
}

/// What a program's cell prints before it fails, the line [`ProgramEnded`] follows: the sweep that
/// writes the cell's failed row sees only this process's exit, not the program's.
pub const PROGRAM_ENDED_PREFIX: &str = "program ended: ";

/// How the program of a failed program's cell ended, for its row's `program_*` columns.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProgramEnded {
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    pub wall_s: Option<f64>,
    pub device_memory_max_mib: Option<f64>,
    pub pids_seen: Option<u32>,
}

impl ProgramEnded {
    fn of(p: &crate::run::subject::Program) -> ProgramEnded {
        ProgramEnded {
            exit_code: p.exit_code,
            exit_signal: p.exit_signal,
            wall_s: p.wall.map(|w| w.as_secs_f64()),
            device_memory_max_mib: p.device_memory_max_mib,
            pids_seen: p.pids_seen,
        }
    }

    /// Puts what it says into the failed row's program.
    pub fn fill(&self, p: &mut crate::run::subject::Program) {
        p.exit_code = self.exit_code;
        p.exit_signal = self.exit_signal;
        p.wall = self.wall_s.map(std::time::Duration::from_secs_f64);
        p.device_memory_max_mib = self.device_memory_max_mib;
        p.pids_seen = self.pids_seen;
    }

    /// The last such line in a cell's output.
    pub fn in_output(output: &str) -> Option<ProgramEnded> {
        output
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix(PROGRAM_ENDED_PREFIX))
            .and_then(|json| serde_json::from_str(json).ok())
    }
}

/// Runs a user's program's cell (a sweep's `[[programs]]`) in the sweep's child: the program started
/// on the cell's device as `migprof exec` starts it (this process opens no device of its own), the
/// cell's row made of its phase's steps of the cell's batch and written. A program that did not end
/// well, or reported no such steps, is an error saying so, whose row the sweep writes; the sweep's
/// time limit ends this process, and with it the program's whole tree.
pub fn run_program(cell: &CellSpec, invocation: Option<&str>, out: &Path) -> Result<Run> {
    let job = cell.job.program().context("a program's cell without its program")?;
    let target = cell.device.parse::<DeviceSpec>()?.for_program()?;
    let mut context = RunContext::new_invocation(&target.info);
    if let Some(id) = invocation {
        context.invocation_id = id.to_string();
    }
    let options = ProgramOptions {
        command: job.command.iter().map(std::ffi::OsString::from).collect(),
        name: cell.model.clone(),
        mode: workloads::Mode::parse(&cell.mode).map_err(anyhow::Error::msg)?,
        precision: match cell.dtype.as_str() {
            "" => None,
            d => Some(d.parse().map_err(anyhow::Error::msg)?),
        },
        pattern: job
            .step_pattern
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(anyhow::Error::msg)?,
        warmup_steps: job.warmup_steps,
        timeout: None,
        sample_interval: (cell.sample_interval_ms > 0)
            .then(|| std::time::Duration::from_millis(cell.sample_interval_ms)),
    };
    let outcome = launch::run(&options, &target, out);
    // Stopped now, its error said after the row is written: it loses no measurement.
    let stopped = target.daemon.map(|d| d.stop());
    let batch = (cell.batch > 0).then_some(cell.batch);
    let outcome = outcome?;
    let run = match rows::cell_row(&outcome, &options, &context, cell.identity(Status::Ok), batch) {
        Ok(run) => run,
        Err(e) => {
            // The sweep writes this cell's failed row, and hears how the program ended from this.
            let ended = ProgramEnded::of(&rows::describe(&outcome, &options));
            println!("{PROGRAM_ENDED_PREFIX}{}", serde_json::to_string(&ended)?);
            return Err(e);
        }
    };
    write_run(out, &run)?;
    stopped.transpose()?;
    Ok(run)
}

/// Runs a user's server's cell (a sweep's `[[servers]]`) in the sweep's child, as `migprof load
/// --endpoint` runs a server: started on the cell's device (an emulated slice as a client of the
/// sweep's daemon), loaded at its steps, its rows written with the cell's identity, and its whole
/// process tree stopped when the steps end or this process does.
pub fn run_server(cell: &CellSpec, invocation: Option<&str>, out: &Path) -> Result<crate::server::measure::Measured> {
    let job = cell.job.server().context("a server's cell without its server")?;
    let server = job.server.resolve(cell.seed, Keys::SweepFile)?;
    let device = cell.device.parse::<DeviceSpec>()?;
    let identity = cell.identity(Status::Ok);
    let m = crate::server::measure::Measure {
        server: &server,
        offer: match &job.generation {
            Some(g) => crate::server::measure::Offer::Generation(g),
            None => crate::server::measure::Offer::Requests(&job.load),
        },
        rates: &job.rates,
        search: job.search,
        device: &device,
        sample_interval: (cell.sample_interval_ms > 0)
            .then(|| std::time::Duration::from_millis(cell.sample_interval_ms)),
        out,
        cell: Some(&identity),
        invocation,
    };
    crate::server::measure::measure(&m, &mut std::io::stderr())
}

/// The cell's preflight: what its device cannot run is refused before the job builds anything, and
/// leaves no row (the input's fault, said at once). A load job is checked whole (its dtype, its
/// kernels, its largest batch's memory: a search takes minutes); a language model's serving job its
/// dtype and a cache it was given (it sizes its own from what the device has otherwise).
fn check(cell: &CellSpec, spec: &RunSpec, device: &OpenDevice, keys: Keys) -> Result<()> {
    let one = std::slice::from_ref(spec);
    preflight::check_precision(one, device)?;
    if let Job::Load(settings) = &cell.job {
        preflight::check_kernels(one, device)?;
        // The largest batch a load job forms is its max batch: a batch that does not fit is that
        // setting's.
        return preflight::check_memory(one, device).with_context(|| {
            format!(
                "{} {}: a load job serves batches up to it",
                keys.name("max_batch"),
                settings.max_batch
            )
        });
    }
    if let Job::Serve(settings) = &cell.job {
        return crate::load::generation::preflight(spec, settings, device);
    }
    Ok(())
}

/// A generation that cannot fit is known from the model's shape: the cell ends out of memory (its
/// row says so, as a run that ran out does) instead of building gigabytes of weights to find out. A
/// `max` search's probes find the limit by running.
fn fits_by_shape(cell: &CellSpec, spec: &RunSpec, device: &OpenDevice) -> Result<()> {
    if spec.lengths.is_none() || cell.purpose != Purpose::Measure {
        return Ok(());
    }
    preflight::check_memory(std::slice::from_ref(spec), device).map_err(|e| {
        if e.is::<estimate::DoesNotFit>() {
            e.context("out of memory before it starts, by the estimate from the model's shape")
        } else {
            e
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::parts::{read_table, text_column, Table};

    /// The test cell of `run` or `load` (no sweep's) with `changed` applied.
    fn cell(changed: impl FnOnce(&mut CellSpec)) -> CellSpec {
        let mut cell = CellSpec {
            sweep: String::new(),
            ..crate::cell::spec::tests::cell()
        };
        changed(&mut cell);
        cell
    }

    /// Runs `cell` on `target` into `out`, as `run` names settings.
    fn run_in(cell: &CellSpec, target: &Target, out: &Path) -> Result<Ran> {
        run(
            cell,
            &cell.run_spec()?,
            &Offer::default(),
            target,
            out,
            Keys::Flags,
            &mut Vec::new(),
        )
    }

    #[test]
    fn a_cell_that_fails_leaves_its_row_where_its_target_records_failures() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        // Its weights file is gone: it passes the preflight and fails when its model is built.
        let cell = cell(|c| c.weights = Some("/nonexistent/weights.safetensors".into()));
        let dir = tempfile::tempdir()?;
        let target = Target::open(&DeviceSpec::Cpu)?;
        let err = run_in(&cell, &target, dir.path())
            .err()
            .expect("a missing weights file fails the cell");
        let rows = read_table(dir.path(), Table::Runs)?;
        assert_eq!(rows.height(), 1, "{err:#}");
        assert_eq!(text_column(&rows, "status")?, vec![Some("error".to_string())]);
        assert_eq!(text_column(&rows, "cell_id")?, vec![Some(cell.cell_id())]);
        // `run` and `load` name no sweep.
        assert_eq!(text_column(&rows, "sweep")?, vec![None]);

        // A sweep's child leaves the row to its sweep, which writes one for every way a child ends.
        let child_dir = tempfile::tempdir()?;
        let child = Target::of_child(&cell, Some("sweep-1"))?;
        assert_eq!(child.context.invocation_id, "sweep-1");
        assert!(run_in(&cell, &child, child_dir.path()).is_err());
        assert_eq!(read_table(child_dir.path(), Table::Runs)?.height(), 0);
        Ok(())
    }

    #[test]
    fn a_cell_refused_before_it_starts_leaves_no_row() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        // tf32 is a mode of NVIDIA tensor cores: the CPU refuses it in the preflight.
        let cell = cell(|c| c.dtype = "tf32".into());
        let dir = tempfile::tempdir()?;
        let target = Target::open(&DeviceSpec::Cpu)?;
        let err = run_in(&cell, &target, dir.path())
            .err()
            .expect("tf32 on the CPU is refused");
        assert!(format!("{err:#}").contains("--dtype f32"), "{err:#}");
        assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 0);
        Ok(())
    }

    #[test]
    fn a_measured_cell_s_row_carries_its_identity() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let cell = cell(|c| {
            c.warmup_secs = 0.0;
            c.duration_secs = 0.05;
        });
        let dir = tempfile::tempdir()?;
        let target = Target::open(&DeviceSpec::Cpu)?;
        let Ran::Measured(run) = run_in(&cell, &target, dir.path())? else {
            panic!("a cell without load or serving settings measures");
        };
        assert_eq!(run.cell.cell_id, cell.cell_id());
        assert_eq!(run.cell.sweep, None);
        let rows = read_table(dir.path(), Table::Runs)?;
        assert_eq!(text_column(&rows, "status")?, vec![Some("ok".to_string())]);
        Ok(())
    }
}
