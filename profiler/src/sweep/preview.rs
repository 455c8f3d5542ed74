//! What a sweep will do, before it does it: its cells planned with the reason each runs or is
//! skipped, the words that name a cell, and `--dry-run`'s account of them.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::time::Duration;

use anyhow::Result;

use super::file::{BatchSize, SweepFile};
use super::plan::{self, PlannedCell};
use super::written::{done_cells, settings_change};
use super::Options;
use crate::cell::{CellSpec, Job, Purpose};

/// Which physical device a target's device string names: the MIG or GPU UUID when NVML knows it, so
/// that "0" and "GPU-…" never run at once; the string itself otherwise.
pub(super) fn device_key(device: &str) -> String {
    if device == "cpu" {
        return "cpu".into();
    }
    // An emulated slice occupies its whole GPU.
    if let Ok(crate::device::DeviceSpec::Mps(t)) = device.parse::<crate::device::DeviceSpec>() {
        return match crate::gpu::discover()
            .and_then(|topo| crate::gpu::select(&topo, t.gpu.as_deref().unwrap_or("first")))
        {
            Ok(sel) => sel.gpu.uuid,
            Err(_) => device.to_string(),
        };
    }
    let id = if device == "cuda" {
        "0"
    } else {
        device.strip_prefix("cuda:").unwrap_or(device)
    };
    match crate::gpu::discover().and_then(|t| crate::gpu::select(&t, id)) {
        Ok(sel) => sel.mig.map(|m| m.uuid).unwrap_or(sel.gpu.uuid),
        Err(_) => device.to_string(),
    }
}

/// A few words on a cell for the progress lines.
pub(super) fn describe(c: &CellSpec) -> String {
    let mut seq = c.seq_len.map(|l| format!(" seq {l}")).unwrap_or_default();
    // A generation's lengths and cache: cells that differ only there are told apart.
    if let (Some(p), Some(o), None) = (c.prompt_len, c.output_len, c.job.serve()) {
        seq += &format!(" prompt {p} output {o}");
        match (c.kv_layout.as_deref(), c.kv_block_size) {
            (Some("paged"), Some(b)) => seq += &format!(" paged {b}"),
            (Some(layout), _) => seq += &format!(" {layout}"),
            (None, _) => {}
        }
    }
    let batch = match (c.batch_as_written == "max", c.batch) {
        // A "max" cell before its search has answered.
        (true, 0) => "max".to_string(),
        (true, b) => format!("max={b}"),
        (false, b) => b.to_string(),
    };
    let what = match (&c.job, c.purpose) {
        (Job::Load(l), _) => format!(" (capacity within p99 {} ms)", l.slo_p99_ms.unwrap_or_default()),
        (Job::Serve(s), _) => format!(
            " (capacity within TTFT p99 {} ms and TPOT p99 {} ms, prompts {} and outputs {} tokens)",
            s.slo_ttft_p99_ms.unwrap_or_default(),
            s.slo_tpot_p99_ms.unwrap_or_default(),
            s.prompt,
            s.output
        ),
        (Job::Program(p), _) => format!(" (program: {})", crate::program::command_line(&p.command)),
        (Job::Server(s), _) => format!(
            " (server: {}{})",
            s.server.server_cmd.as_deref().unwrap_or_default(),
            "; ".to_string()
                + &crate::server::job::steps_described(
                    &s.server.concurrency,
                    &s.rates,
                    s.search.then_some(s.load.slo_p99_ms).flatten()
                )
        ),
        (Job::Measure, Purpose::Probe) => " (max search)".to_string(),
        (Job::Measure, Purpose::Measure) => String::new(),
    };
    let group = c
        .concurrency_group
        .as_ref()
        .map(|g| format!(" [group {g}]"))
        .unwrap_or_default();
    let size = match c.job {
        Job::Serve(_) => format!("up to {batch} sequences"),
        Job::Program(_) if c.batch == 0 => "steps as it runs them".to_string(),
        Job::Server(_) => format!("requests of {batch}"),
        _ => format!("batch {batch}"),
    };
    // A program that did not say what it computes in has no dtype to show.
    let dtype = if c.dtype.is_empty() {
        String::new()
    } else {
        format!(" {}", c.dtype)
    };
    format!(
        "{} {} {}{dtype} {size}{seq} #{}{what}{group}",
        c.target, c.model, c.mode, c.repeat
    )
}

pub(super) fn duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s / 60 % 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// The sweep's cells after `--only`, each with whether it is already done.
pub fn plan(file: &SweepFile, opts: &Options) -> Result<Vec<(PlannedCell, bool)>> {
    Ok(plan_with_reasons(file, opts)?
        .cells
        .into_iter()
        .map(|(c, done, _)| (c, done))
        .collect())
}

/// A sweep's plan: each cell, whether it is done, and why it runs again when its settings changed.
pub(super) struct Plan {
    /// Each cell, whether it is done, and what changed in its settings since its latest row (why
    /// it runs again).
    pub(super) cells: Vec<(PlannedCell, bool, Option<String>)>,
    /// Sweep names of the rows that count as done, other than the file's.
    other_names: std::collections::BTreeSet<String>,
}

pub(super) fn plan_with_reasons(file: &SweepFile, opts: &Options) -> Result<Plan> {
    let mut done = if opts.force {
        HashMap::new()
    } else {
        done_cells(&opts.out, opts.retry_oom)?
    };
    let cells = plan::cells(file)?;
    // A server's cell writes a row per step: it is done when each step it plans has one.
    for c in cells.iter().filter(|c| c.spec.job.server().is_some()) {
        let id = c.spec.cell_id();
        match !opts.force && super::written::done_as_planned(&opts.out, &c.spec, opts.retry_oom)? {
            true => done.insert(id.clone(), super::written::CellRow::done(id)),
            false => done.remove(&id),
        };
    }
    // A cell whose settings changed since its latest row runs again (that row stays, superseded).
    let mut changed: HashMap<String, String> = HashMap::new();
    for c in &cells {
        let id = c.spec.cell_id();
        if let Some(was) = done.get(&id).and_then(|r| r.settings.as_deref()) {
            if let Some(why) = settings_change(was, &c.spec.settings()) {
                changed.insert(id.clone(), why);
                done.remove(&id);
            }
        }
    }
    // A group instance runs whole or not at all: kept when any member matches `--only`, done only
    // when every member is (a member measured beside other neighbours than its group's would not be
    // the cell its id names).
    let matching_groups: HashSet<&str> = cells
        .iter()
        .filter(|c| opts.only.matches(&c.spec))
        .filter_map(|c| c.group.as_deref())
        .collect();
    let unfinished_groups: HashSet<&str> = cells
        .iter()
        .filter(|c| !done.contains_key(&c.spec.cell_id()))
        .filter_map(|c| c.group.as_deref())
        .collect();
    let planned: Vec<(PlannedCell, bool, Option<String>)> = cells
        .iter()
        .filter(|c| match &c.group {
            Some(g) => matching_groups.contains(g.as_str()),
            None => opts.only.matches(&c.spec),
        })
        .map(|c| {
            let id = c.spec.cell_id();
            let is_done = match &c.group {
                Some(g) => !unfinished_groups.contains(g.as_str()),
                None => done.contains_key(&id),
            };
            (c.clone(), is_done, changed.get(&id).cloned())
        })
        .collect();
    let other_names = planned
        .iter()
        .filter(|(_, d, _)| *d)
        .filter_map(|(c, _, _)| done.get(&c.spec.cell_id()).and_then(|r| r.sweep.clone()))
        .filter(|name| *name != file.name)
        .collect();
    Ok(Plan {
        cells: planned,
        other_names,
    })
}

/// The lines a plan's reruns and renames are worth: cells whose settings changed, rows of another name.
pub(super) fn say_plan(file: &SweepFile, plan: &Plan, log: &mut dyn Write) -> Result<()> {
    let reruns: Vec<&(PlannedCell, bool, Option<String>)> =
        plan.cells.iter().filter(|(_, _, why)| why.is_some()).collect();
    if !reruns.is_empty() {
        writeln!(
            log,
            "note: {} cell(s) run again: their settings changed since their rows ({}); the old rows stay, superseded",
            reruns.len(),
            reruns[0].2.as_deref().unwrap_or_default()
        )?;
    }
    // A language model's search runs fixed-length steps: how long it may take is known in advance.
    if let Some((c, s)) = plan
        .cells
        .iter()
        .filter(|(_, done, _)| !done)
        .filter_map(|(c, _, _)| c.spec.job.serve().map(|s| (c, s)))
        .find(|(_, s)| longest_search(s) > file.defaults.timeout_secs)
    {
        writeln!(
            log,
            "note: {} may take up to {:.0} s ({} steps of {} s of arrivals and up to {} s of drain each), past [defaults] timeout_secs = {}; a search cut off goes on from its measured steps when the sweep runs again",
            describe(&c.spec),
            longest_search(s),
            s.max_steps,
            s.duration_secs,
            s.drain_secs,
            file.defaults.timeout_secs
        )?;
    }
    if !plan.other_names.is_empty() {
        writeln!(
            log,
            "note: cells of this file have rows from sweep(s) named {}; this file names it `{}`: those rows count as done (--force measures again)",
            plan.other_names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
            file.name
        )?;
    }
    Ok(())
}

/// The longest a language model's capacity search may take, in seconds: each step's arrivals and
/// drain (the model's build, warm-up and closed loop come before).
pub(super) fn longest_search(s: &crate::load::settings::ServeSettings) -> f64 {
    s.max_steps as f64 * (s.duration_secs + s.drain_secs)
}

/// `--dry-run`: every cell with its id and whether it would run, and an estimate of the time.
pub fn dry_run(file: &SweepFile, opts: &Options, log: &mut dyn Write) -> Result<()> {
    let planned = plan_with_reasons(file, opts)?;
    say_plan(file, &planned, log)?;
    let cells: Vec<(PlannedCell, bool)> = planned.cells.iter().map(|(c, d, _)| (c.clone(), *d)).collect();
    // Per cell: warm-up and measurement, plus a child's start and model build (about 2 s on a
    // 2-core CPU for the tiny presets; more for large models on a GPU).
    let per_cell =
        file.defaults.measure.warmup_secs + file.defaults.measure.duration_secs + 2.0 + file.defaults.cooldown_secs;
    let to_run = cells.iter().filter(|(_, done)| !done).count();
    // A language model's search at most as long as its steps allow.
    let secs: f64 = cells
        .iter()
        .filter(|(_, done)| !done)
        .map(|(c, _)| c.spec.job.serve().map_or(per_cell, |s| longest_search(s) + per_cell))
        .sum();
    writeln!(log, "{:<16}  {:<6}  cell", "cell_id", "state")?;
    for (c, done, why) in &planned.cells {
        let state = match (done, why) {
            (true, _) => "done".to_string(),
            (false, Some(why)) => format!("to run again: {why}"),
            (false, None) => "to run".to_string(),
        };
        writeln!(log, "{:<16}  {:<6}  {}", c.spec.cell_id(), state, describe(&c.spec))?;
    }
    let max_note = if cells.iter().any(|(c, d)| !d && c.batch == BatchSize::Max) {
        " (\"max\" cells add a search of a few short probes each)"
    } else {
        ""
    };
    let serve_note = if cells.iter().any(|(c, d)| !d && c.spec.job.serve().is_some()) {
        " (a language model's capacity search counted at its longest)"
    } else {
        ""
    };
    let program_note = if cells.iter().any(|(c, d)| !d && c.spec.job.program().is_some()) {
        " (a program's cell counted as one cell: it runs as long as the program does, at most timeout_secs)"
    } else {
        ""
    };
    writeln!(
        log,
        "{} cell(s), {} done, {to_run} to run: about {} at {per_cell:.0} s a cell on one device{max_note}{serve_note}{program_note}",
        cells.len(),
        cells.len() - to_run,
        duration(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX))
    )?;
    Ok(())
}
