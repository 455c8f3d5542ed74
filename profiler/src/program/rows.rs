//! What a program's run comes to in the runs table: a row per phase and step size it measured (the
//! same row `migprof run` writes), one row of its whole run when it reported no steps, or the row of
//! a failed cell naming what happened when it did not end well.

use std::collections::BTreeSet;

use anyhow::{bail, Result};
use workloads::Mode;

use super::launch::Outcome;
use super::steps::{Phase, Step};
use super::{ProgramOptions, MIN_STEPS};
use crate::gpu::sampler::Sample;
use crate::run::fingerprint::Fingerprint;
use crate::run::record::{CellIdentity, FailedWorkload, Failure, ProgramSteps, Status};
use crate::run::subject::Program;
use crate::run::{Run, RunContext};

/// The rows of a program's run, and what a reader should be told of the steps left out.
pub struct Rows {
    pub runs: Vec<Run>,
    pub failure: Option<Failure>,
    pub notes: Vec<String>,
}

/// The rows of `outcome` on the target named `target` (as `run` names it: the device's name), in
/// `context`.
pub fn rows(outcome: &Outcome, options: &ProgramOptions, target: &str, context: &RunContext) -> Result<Rows> {
    let program = describe(outcome, options);
    let settings = settings(options);
    let identity = |mode: Mode, items: usize, status: Status| CellIdentity {
        sweep: None,
        target: target.to_string(),
        cell_id: cell_id(options, target, mode, items),
        status,
        concurrency_group: None,
        neighbours: Vec::new(),
        baseline: false,
        settings: Some(settings.clone()),
    };
    let failure = |status: Status, error: String| Failure {
        run_id: outcome.run_id.clone(),
        invocation_id: context.invocation_id.clone(),
        host: context.host.clone(),
        started_at: outcome.started_at,
        finished_at: outcome.finished_at,
        workload: workload(options),
        identity: identity(options.mode, 0, status),
        error,
        fingerprint: Fingerprint::collect(context.device.selected.as_ref()),
        program: Some(program.clone()),
    };
    if let Some((status, why)) = failed(outcome) {
        return Ok(Rows {
            runs: Vec::new(),
            failure: Some(failure(status, why)),
            notes: Vec::new(),
        });
    }
    let (groups, notes) = measured(&outcome.steps, options.warmup_steps);
    let groups = if outcome.steps.is_empty() {
        vec![whole_run(outcome, options.mode)]
    } else {
        groups
    };
    if groups.is_empty() {
        let why = format!(
            "the program reported {} step(s) and none of its phases and sizes had {MIN_STEPS} measured steps after warm-up: {}",
            outcome.steps.len(),
            notes.join("; ")
        );
        return Ok(Rows {
            runs: Vec::new(),
            failure: Some(failure(Status::Error, why)),
            notes,
        });
    }
    let mut context = context.clone();
    context.expected.pids.extend(outcome.pids.iter().copied());
    let runs = groups
        .into_iter()
        .map(|g| {
            let identity = identity(g.mode, g.items, Status::Ok);
            row(outcome, options, &program, g, &context, identity)
        })
        .collect::<Result<Vec<Run>>>()?;
    Ok(Rows {
        runs,
        failure: None,
        notes,
    })
}

/// The row of a sweep's program cell, `identity` its: the steps of its phase (`options.mode`) and
/// of `batch` items (of the one size it ran where `None`; its whole run where it reported no step);
/// an error saying why there is none.
pub fn cell_row(
    outcome: &Outcome,
    options: &ProgramOptions,
    context: &RunContext,
    identity: CellIdentity,
    batch: Option<usize>,
) -> Result<Run> {
    if let Some((_, why)) = failed(outcome) {
        bail!(why);
    }
    let program = describe(outcome, options);
    let mut context = context.clone();
    context.expected.pids.extend(outcome.pids.iter().copied());
    if outcome.steps.is_empty() && batch.is_none() {
        return row(
            outcome,
            options,
            &program,
            whole_run(outcome, options.mode),
            &context,
            identity,
        );
    }
    let (groups, notes) = measured(&outcome.steps, options.warmup_steps);
    let mode = options.mode;
    let mut mine: Vec<Group> = groups
        .into_iter()
        .filter(|g| g.mode == mode && batch.is_none_or(|b| g.items == b))
        .collect();
    match mine.len() {
        1 => row(outcome, options, &program, mine.remove(0), &context, identity),
        0 => bail!(
            "the program reported no {} {} step(s) of {} after warm-up ({} step(s) in all{}{})",
            MIN_STEPS,
            mode.as_str(),
            batch.map_or("any size".to_string(), |b| format!("{b} item(s)")),
            outcome.steps.len(),
            if notes.is_empty() { "" } else { "; " },
            notes.join("; ")
        ),
        _ => bail!(
            "the program reported {} steps of {} sizes ({}): give its batches in the sweep file (batches = [..] and {{batch}} in the command) so that each is a cell",
            mode.as_str(),
            mine.len(),
            mine.iter().map(|g| g.items.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A program that reported no step: its whole run as its one step.
fn whole_run(outcome: &Outcome, mode: Mode) -> Group {
    Group {
        mode,
        items: 1,
        latencies_ns: vec![outcome.wall.as_nanos().max(1) as u64],
        warmup_steps: 0,
    }
}

/// The row of one phase and size.
fn row(
    outcome: &Outcome,
    options: &ProgramOptions,
    program: &Program,
    g: Group,
    context: &RunContext,
    identity: CellIdentity,
) -> Result<Run> {
    let steps = ProgramSteps {
        latencies_ns: g.latencies_ns,
        items: g.items,
        warmup_steps: g.warmup_steps,
        sample_interval: options.sample_interval,
    };
    let metrics = outcome.metrics.as_ref().map(|m| match m {
        Ok(samples) => Ok(samples.clone()),
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    });
    Run::of_program(
        program.clone(),
        g.mode,
        options.precision,
        steps,
        context.clone(),
        outcome.started_at,
        metrics,
        identity,
        Fingerprint::collect(context.device.selected.as_ref()),
    )
}

/// How the run did not end well, if it did not: the status and the words of its row.
fn failed(o: &Outcome) -> Option<(Status, String)> {
    let steps = format!(
        "after {} step(s); its output and steps are in {}",
        o.steps.len(),
        o.dir.display()
    );
    let last = |why: String| {
        let lines = o.last_lines(5);
        if lines.is_empty() {
            why
        } else {
            format!("{why}; its last lines: {lines}")
        }
    };
    if o.ended.error.is_some() {
        return Some((Status::Error, format!("the program {}", o.ended.describe())));
    }
    if o.timed_out {
        return Some((
            Status::Timeout,
            format!("the program ran past its timeout and was stopped {steps}"),
        ));
    }
    if let Some(s) = o.interrupted {
        return Some((
            Status::Error,
            format!(
                "migprof got {} and passed it on: the program was stopped {steps}",
                super::keeper::signal_name(s)
            ),
        ));
    }
    if o.ended.signal.is_some() {
        return Some((
            Status::Crashed,
            last(format!("the program was {} {steps}", o.ended.describe())),
        ));
    }
    if o.ended.code != Some(0) {
        return Some((
            Status::Error,
            last(format!("the program ended with {} {steps}", o.ended.describe())),
        ));
    }
    if !o.malformed.is_empty() {
        let shown: Vec<&str> = o.malformed.iter().take(3).map(String::as_str).collect();
        return Some((
            Status::Error,
            format!(
                "{} line(s) were no step (see `migprof exec --help` for the step protocol): {}",
                o.malformed.len(),
                shown.join("; ")
            ),
        ));
    }
    None
}

/// The steps of one phase and size, warm-up left out.
struct Group {
    mode: Mode,
    items: usize,
    latencies_ns: Vec<u64>,
    warmup_steps: u64,
}

/// The measured steps by phase and size, in the order each first appears, and what was left out.
/// Warm-up is every step marked so, then the first `warmup` measured steps of each phase and size
/// (none given: one, unless the program marked warm-up steps itself).
fn measured(steps: &[Step], warmup: Option<usize>) -> (Vec<Group>, Vec<String>) {
    let marked = |items: usize| {
        steps
            .iter()
            .filter(|s| s.phase == Phase::Warmup && s.items as usize == items)
            .count()
    };
    let any_marked = steps.iter().any(|s| s.phase == Phase::Warmup);
    let skip = warmup.unwrap_or(if any_marked { 0 } else { 1 });
    // Every measured step by phase and size, in the order each first appears.
    let mut groups: Vec<Group> = Vec::new();
    for s in steps {
        let Phase::Measured(mode) = s.phase else { continue };
        let (items, ns) = (s.items as usize, s.duration.as_nanos().max(1) as u64);
        match groups.iter_mut().find(|g| g.mode == mode && g.items == items) {
            Some(g) => g.latencies_ns.push(ns),
            None => groups.push(Group {
                mode,
                items,
                latencies_ns: vec![ns],
                warmup_steps: 0,
            }),
        }
    }
    let mut notes = Vec::new();
    for g in &mut groups {
        // A size's first steps warm its own shapes up, whatever ran before at other sizes.
        let left_out = skip.min(g.latencies_ns.len());
        g.latencies_ns.drain(..left_out);
        g.warmup_steps = (left_out + marked(g.items)) as u64;
    }
    groups.retain(|g| {
        let keep = g.latencies_ns.len() >= MIN_STEPS;
        if !keep {
            notes.push(format!(
                "{} {} step(s) of {} item(s) after warm-up left out: a row needs at least {MIN_STEPS}",
                g.latencies_ns.len(),
                g.mode.as_str(),
                g.items
            ));
        }
        keep
    });
    (groups, notes)
}

/// The program as its rows record it.
pub fn describe(o: &Outcome, options: &ProgramOptions) -> Program {
    let samples: &[Sample] = match &o.metrics {
        Some(Ok(s)) => s,
        _ => &[],
    };
    let (memory, seen) = on_device(samples, &o.pids);
    let sampled = matches!(&o.metrics, Some(Ok(s)) if !s.is_empty());
    Program {
        name: options.name.clone(),
        command: super::command_line(&options.command),
        exit_code: o.ended.code,
        exit_signal: o.ended.signal,
        wall: Some(o.wall),
        steps: o.steps_from,
        step_pattern: options.pattern.as_ref().map(|p| p.as_str().to_string()),
        device_memory_max_mib: memory.filter(|_| sampled),
        pids_seen: sampled.then_some(seen),
    }
}

/// The most device memory the program's processes held at once (MiB; `None` where none was seen),
/// and how many of them NVML listed on the device.
pub fn on_device(samples: &[Sample], pids: &BTreeSet<u32>) -> (Option<f64>, u32) {
    let mut seen = BTreeSet::new();
    let mut most: Option<f64> = None;
    for s in samples {
        let Some(procs) = &s.compute_processes else { continue };
        let mine: Vec<_> = procs.iter().filter(|p| pids.contains(&p.pid)).collect();
        if mine.is_empty() {
            continue;
        }
        seen.extend(mine.iter().map(|p| p.pid));
        let held: u64 = mine.iter().filter_map(|p| p.used_mib).sum();
        most = Some(most.map_or(held as f64, |m: f64| m.max(held as f64)));
    }
    (most, seen.len() as u32)
}

/// The settings that change what a row measures without changing the program's cell.
fn settings(options: &ProgramOptions) -> String {
    let interval_ms = options.sample_interval.map_or(0, |d| d.as_millis() as u64);
    super::cell_settings(options.warmup_steps, interval_ms)
}

/// A program's cell: its name, command and what it says it computes in, on the target, in one phase
/// at one step size.
fn cell_id(options: &ProgramOptions, target: &str, mode: Mode, items: usize) -> String {
    let fields = format!(
        "program;v1;name={};command={};target={target};mode={};items={items};dtype={};step_pattern={}",
        options.name,
        super::command_line(&options.command),
        mode.as_str(),
        options.precision.map_or("", |p| p.as_str()),
        options.pattern.as_ref().map_or("", |p| p.as_str())
    );
    crate::run::record::id_of(&fields)
}

/// The workload fields of a program's failed row (its step size unknown: 0).
fn workload(options: &ProgramOptions) -> FailedWorkload {
    FailedWorkload {
        model: options.name.clone(),
        mode: options.mode.as_str().to_string(),
        dtype: options.precision.map_or(String::new(), |p| p.as_str().to_string()),
        batch: 0,
        seq_len: None,
        seed: 0,
        kernel_options: String::new(),
        master_weights: None,
        prompt_len: None,
        output_len: None,
        kv_layout: None,
        kv_block_size: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::subject::StepsFrom;
    use std::time::Duration;

    fn step(ms: u64, items: u64, phase: Phase) -> Step {
        Step {
            duration: Duration::from_millis(ms),
            items: items as f64,
            phase,
        }
    }

    #[test]
    fn steps_group_by_phase_and_size_after_warm_up() {
        let train = Phase::Measured(Mode::Train);
        let infer = Phase::Measured(Mode::Infer);
        let mut steps = vec![step(500, 8, train)];
        steps.extend((0..4).map(|_| step(10, 8, train)));
        steps.extend((0..3).map(|_| step(5, 8, infer)));
        steps.push(step(7, 3, train));
        let (groups, notes) = measured(&steps, None);
        let got: Vec<(Mode, usize, usize)> = groups.iter().map(|g| (g.mode, g.items, g.latencies_ns.len())).collect();
        // The first train step and the first infer step are warm-up; the last train step is alone.
        assert_eq!(got, vec![(Mode::Train, 8, 4)]);
        assert!(notes.iter().any(|n| n.contains("2 infer step(s) of 8")), "{notes:?}");
        assert!(notes.iter().any(|n| n.contains("0 train step(s) of 3")), "{notes:?}");
        // A new size warms up on its own: its first step is left out too, and counted.
        let sizes: Vec<Step> = (0..4)
            .map(|_| step(10, 8, train))
            .chain(std::iter::once(step(900, 32, train)))
            .chain((0..3).map(|_| step(30, 32, train)))
            .collect();
        let (groups, _) = measured(&sizes, None);
        let got: Vec<(usize, usize, u64)> = groups
            .iter()
            .map(|g| (g.items, g.latencies_ns.len(), g.warmup_steps))
            .collect();
        assert_eq!(got, vec![(8, 3, 1), (32, 3, 1)]);
        assert!(groups[1].latencies_ns.iter().all(|&ns| ns == 30_000_000));
        // Steps marked as warm-up are the warm-up: none of the others is left out.
        let marked: Vec<Step> = std::iter::once(step(500, 8, Phase::Warmup))
            .chain((0..3).map(|_| step(10, 8, train)))
            .collect();
        let (groups, _) = measured(&marked, None);
        assert_eq!((groups[0].latencies_ns.len(), groups[0].warmup_steps), (3, 1));
        let (groups, _) = measured(&marked, Some(2));
        assert!(groups.is_empty(), "two more left out leave one");
    }

    fn outcome(steps: Vec<Step>) -> Outcome {
        let now = crate::provenance::now();
        Outcome {
            run_id: crate::provenance::run_id(now),
            started_at: now,
            finished_at: now,
            wall: Duration::from_secs(2),
            ended: super::super::keeper::Ended {
                pid: Some(1),
                code: Some(0),
                ..Default::default()
            },
            timed_out: false,
            interrupted: None,
            steps,
            steps_from: StepsFrom::Protocol,
            malformed: Vec::new(),
            metrics: None,
            pids: BTreeSet::new(),
            dir: std::path::PathBuf::from("/nonexistent"),
        }
    }

    /// A sweep's cell is one phase at one size: the batch it asks for, or the one size the program
    /// ran; several sizes without a batch are refused, saying what to give.
    #[test]
    fn a_cell_s_row_is_its_phase_at_its_size() {
        let options = ProgramOptions {
            command: vec!["serve".into()],
            name: "serve".into(),
            mode: Mode::Infer,
            precision: None,
            pattern: None,
            warmup_steps: Some(0),
            timeout: None,
            sample_interval: None,
        };
        let info = crate::device::DeviceSpec::Cpu.for_program().unwrap().info;
        let context = RunContext::new_invocation(&info);
        let identity = || crate::run::record::tests::identity_with(Status::Ok);
        let infer = Phase::Measured(Mode::Infer);
        let steps: Vec<Step> = (0..4)
            .map(|_| step(10, 8, infer))
            .chain((0..4).map(|_| step(30, 32, infer)))
            .chain((0..4).map(|_| step(90, 32, Phase::Measured(Mode::Train))))
            .collect();
        let o = outcome(steps);
        let run = cell_row(&o, &options, &context, identity(), Some(32)).unwrap();
        assert_eq!((run.batch, run.stats.iterations, run.mode), (32, 4, Mode::Infer));
        let e = cell_row(&o, &options, &context, identity(), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("infer steps of 2 sizes (8, 32)"), "{e}");
        assert!(e.contains("batches = [..]"), "{e}");
        let e = cell_row(&o, &options, &context, identity(), Some(16))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no 3 infer step(s) of 16 item(s)"), "{e}");
        // Nothing reported: the whole run is the cell's one step.
        let run = cell_row(&outcome(Vec::new()), &options, &context, identity(), None).unwrap();
        assert_eq!((run.batch, run.stats.iterations), (1, 1));
        let failed = Outcome {
            ended: super::super::keeper::Ended {
                code: Some(2),
                ..Default::default()
            },
            ..outcome(Vec::new())
        };
        let e = cell_row(&failed, &options, &context, identity(), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("exit code 2"), "{e}");
    }

    #[test]
    fn the_program_s_memory_is_its_own_processes_at_once() {
        use crate::gpu::sampler::GpuProcess;
        let sample = |procs: Vec<(u32, u64)>| Sample {
            compute_processes: Some(
                procs
                    .into_iter()
                    .map(|(pid, mib)| GpuProcess {
                        pid,
                        name: None,
                        used_mib: Some(mib),
                    })
                    .collect(),
            ),
            ..Sample::default()
        };
        let pids: BTreeSet<u32> = [10, 11].into();
        let samples = [
            sample(vec![(10, 100), (99, 5000)]),
            sample(vec![(10, 300), (11, 200)]),
            sample(vec![]),
        ];
        assert_eq!(on_device(&samples, &pids), (Some(500.0), 2));
        assert_eq!(on_device(&samples[2..], &pids), (None, 0));
    }
}
