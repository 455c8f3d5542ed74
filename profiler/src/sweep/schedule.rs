//! Running a sweep's cells: which are already done (a row with status `ok` or `oom`), which device each
//! needs, one child at a time per device and up to `--jobs` at once across devices, a cool-down between
//! cells on one device, a `max` batch found once per target/model/mode/dtype, a row for every cell
//! however it ends, and Ctrl-C leaving no half row and a summary.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::child::{self, Ending, Running};
use super::claim::{self, Claim, Claimed};
use super::file::{BatchSize, SweepFile};
use super::plan::PlannedCell;
use super::preview::{describe, device_key, duration, plan_with_reasons, say_plan};
use super::progress::Progress;
use super::written::done_as_planned;
use super::Options;
use crate::cell::{CellSpec, Purpose};
use crate::provenance;
use crate::results::runs::write_failure;
use crate::run::record::Status;

/// What a sweep did.
#[derive(Debug, Default)]
pub struct Summary {
    pub planned: usize,
    pub skipped: usize,
    pub ran: usize,
    /// Probes of `max` searches (rows with status `probe`, or `oom` where a batch did not fit).
    pub probes: usize,
    pub by_status: Vec<(Status, usize)>,
    pub interrupted: bool,
    /// Cells another sweep was measuring when this one came to them (its rows will say).
    pub claimed: usize,
}

impl Summary {
    pub fn failed(&self) -> usize {
        self.by_status
            .iter()
            .filter(|(s, _)| !matches!(s, Status::Ok | Status::Probe))
            .map(|(_, n)| n)
            .sum()
    }

    fn count(&mut self, status: Status) {
        match self.by_status.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => self.by_status.push((status, 1)),
        }
    }
}

/// How soon a sweep asks again for a device another sweep holds.
const CLAIM_RETRY: Duration = Duration::from_secs(1);

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C (and SIGTERM) end the sweep at the next poll instead of killing it mid-write.
fn catch_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int);
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// One cell between start and end.
struct Active {
    cell: CellSpec,
    device: String,
    running: Running,
    started: chrono::DateTime<chrono::Utc>,
    /// The `max` search this probe belongs to.
    search: Option<usize>,
    /// A member of a concurrent group: nothing else starts while it runs.
    grouped: bool,
    /// Its device's claim and its own, held until it has ended (its row written).
    claims: Vec<Claim>,
}

/// A `max` search: doubling from 1 until a batch does not fit (or the limit), then bisection.
#[derive(Debug)]
struct MaxSearch {
    /// The largest batch known to fit, the smallest known not to.
    fits: usize,
    fails: Option<usize>,
    limit: usize,
    /// The cells waiting for the answer.
    waiting: Vec<PlannedCell>,
    template: CellSpec,
}

impl MaxSearch {
    /// The next batch to try; `None` once the answer is known (`fits`, 0 when not even 1 fits).
    fn next(&self) -> Option<usize> {
        match self.fails {
            None if self.fits >= self.limit => None,
            None if self.fits == 0 => Some(1),
            None => Some((self.fits * 2).min(self.limit)),
            Some(f) if f <= self.fits + 1 => None,
            Some(f) => Some((self.fits + f) / 2),
        }
    }
}

/// Runs the sweep: every cell not done, each in a child, a row for each.
pub fn run(file: &SweepFile, opts: &Options, exe: &Path, log: &mut dyn Write) -> Result<Summary> {
    crate::files::ensure_writable_dir(&opts.out)?;
    let planned = plan_with_reasons(file, opts)?;
    say_plan(file, &planned, log)?;
    let cells: Vec<(PlannedCell, bool)> = planned.cells.into_iter().map(|(c, d, _)| (c, d)).collect();
    let mut summary = Summary {
        planned: cells.len(),
        ..Default::default()
    };
    let mut work = Work::of(file, cells, &mut summary);
    let total = work.cells();
    writeln!(
        log,
        "migprof {}: sweep `{}`, {} cell(s): {} done already, {total} to run, results to {}",
        provenance::VERSION,
        file.name,
        summary.planned,
        summary.skipped,
        opts.out.display()
    )?;
    catch_interrupts();
    let mut daemons = start_daemons(&work, log)?;
    let mut scheduler = Scheduler {
        opts,
        exe,
        invocation_id: provenance::run_id(provenance::now()),
        host: provenance::host(),
        cooldown: Duration::from_secs_f64(file.defaults.cooldown_secs),
        timeout: Duration::from_secs_f64(file.defaults.timeout_secs),
        progress: Progress::new(total, opts.terminal, log),
        summary,
        total,
        finished: 0,
        started: Instant::now(),
        keys: HashMap::new(),
        free_at: HashMap::new(),
        active: Vec::new(),
        daemons: &daemons,
        waiting_for: HashSet::new(),
        group_neighbours: Vec::new(),
    };
    loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            scheduler.interrupt()?;
            break;
        }
        scheduler.collect(&mut work)?;
        for a in &mut scheduler.active {
            a.claims.iter_mut().for_each(Claim::refresh);
        }
        scheduler.start_group(&mut work)?;
        scheduler.start_cells(&mut work)?;
        let s = &mut scheduler;
        s.progress
            .running(&s.active.iter().map(|a| describe(&a.cell)).collect::<Vec<_>>());
        if s.active.is_empty() && work.queue.is_empty() && work.probes.is_empty() && work.groups.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let summary = scheduler.finish();
    for (_, d) in daemons.drain() {
        match d.stop() {
            Ok(()) => writeln!(log, "MPS: daemon stopped")?,
            Err(e) => writeln!(log, "warning: {e:#}")?,
        }
    }
    Ok(summary)
}

/// What a sweep has left to run: cells alone, concurrent groups (which run after them), `max`
/// searches with the cells waiting for their answer, and the searches' next probes.
struct Work {
    queue: VecDeque<PlannedCell>,
    /// Concurrent group instances, their members in order.
    groups: VecDeque<Vec<PlannedCell>>,
    searches: Vec<MaxSearch>,
    probes: VecDeque<(CellSpec, usize)>,
}

impl Work {
    /// The planned cells not done, sorted into the queue, the groups and the searches; the done ones
    /// counted as skipped.
    fn of(file: &SweepFile, cells: Vec<(PlannedCell, bool)>, summary: &mut Summary) -> Work {
        let mut work = Work {
            queue: VecDeque::new(),
            groups: VecDeque::new(),
            searches: Vec::new(),
            probes: VecDeque::new(),
        };
        let mut search_of: HashMap<String, usize> = HashMap::new();
        for (c, done) in cells {
            if done {
                summary.skipped += 1;
                continue;
            }
            if c.batch == BatchSize::Max {
                // One search per target, model, mode, dtype, sequence length (or a generation's
                // lengths and cache layout) and kernels.
                let key = format!(
                    "{}|{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{:?}|{}",
                    c.spec.target,
                    c.spec.model,
                    c.spec.mode,
                    c.spec.dtype,
                    c.spec.seq_len,
                    c.spec.prompt_len,
                    c.spec.output_len,
                    c.spec.kv_layout,
                    c.spec.kv_block_size,
                    c.spec.kernel_options
                );
                let searches = &mut work.searches;
                let i = *search_of.entry(key).or_insert_with(|| {
                    searches.push(MaxSearch {
                        fits: 0,
                        fails: None,
                        limit: file.defaults.max_batch_limit,
                        waiting: Vec::new(),
                        template: c.spec.clone(),
                    });
                    searches.len() - 1
                });
                work.searches[i].waiting.push(c);
            } else {
                match c.group.clone() {
                    Some(key) => match work.groups.back_mut() {
                        Some(last) if last[0].group.as_deref() == Some(key.as_str()) => last.push(c),
                        _ => work.groups.push_back(vec![c]),
                    },
                    None => work.queue.push_back(c),
                }
            }
        }
        // Probes first, so that a "max" cell's batch is known by the time its turn comes.
        work.probes = work
            .searches
            .iter()
            .enumerate()
            .map(|(i, s)| (probe(&s.template, s.next().unwrap_or(1)), i))
            .collect();
        work
    }

    /// The cells to run, probes aside.
    fn cells(&self) -> usize {
        self.queue.len()
            + self.searches.iter().map(|s| s.waiting.len()).sum::<usize>()
            + self.groups.iter().map(Vec::len).sum::<usize>()
    }

    /// Every cell spec that will run, probes' templates included.
    fn specs(&self) -> impl Iterator<Item = &CellSpec> {
        self.queue
            .iter()
            .chain(self.groups.iter().flatten())
            .map(|c| &c.spec)
            .chain(self.searches.iter().map(|s| &s.template))
    }
}

/// One MPS daemon per GPU that emulated slices run on, for the whole sweep; its cells are clients.
fn start_daemons(work: &Work, log: &mut dyn Write) -> Result<HashMap<String, crate::mps::daemon::Daemon>> {
    let mut daemons = HashMap::new();
    for c in work.specs() {
        if crate::mps::is_emulated(&c.device) {
            if let std::collections::hash_map::Entry::Vacant(slot) = daemons.entry(device_key(&c.device)) {
                let daemon = start_mps_daemon(&c.device)?;
                writeln!(
                    log,
                    "MPS: migprof's control daemon (pid {}) serves {} for the emulated slices",
                    daemon.pid().unwrap_or(0),
                    daemon.gpu_uuid
                )?;
                slot.insert(daemon);
            }
        }
    }
    Ok(daemons)
}

/// The sweep under way: the cells running, when each device is free again, what has ended.
struct Scheduler<'a> {
    opts: &'a Options,
    exe: &'a Path,
    invocation_id: String,
    host: String,
    cooldown: Duration,
    timeout: Duration,
    progress: Progress<'a>,
    summary: Summary,
    total: usize,
    finished: usize,
    started: Instant,
    /// Each device string's key (the GPU it runs on), worked out once.
    keys: HashMap<String, String>,
    free_at: HashMap<String, Instant>,
    active: Vec<Active>,
    daemons: &'a HashMap<String, crate::mps::daemon::Daemon>,
    /// Devices another sweep holds, said once each.
    waiting_for: HashSet<String>,
    /// The memory-system neighbours of the running group's `mps-mem:` members: stopped once the
    /// group has ended.
    group_neighbours: Vec<crate::mps::neighbour::NeighbourProcess>,
}

impl Scheduler<'_> {
    /// Ctrl-C: every running cell stopped without a row; it runs again on resume.
    fn interrupt(&mut self) -> Result<()> {
        self.stop_group_neighbours();
        for a in self.active.drain(..) {
            self.progress.line(&format!(
                "interrupted: {} (no row; it runs again on resume)",
                describe(&a.cell)
            ))?;
            a.running.interrupt();
        }
        self.summary.interrupted = true;
        Ok(())
    }

    /// Collects the cells that have ended: a row for each that left none, a probe's answer to its
    /// search.
    fn collect(&mut self, work: &mut Work) -> Result<()> {
        let mut i = 0;
        while i < self.active.len() {
            let Some(ending) = self.active[i].running.poll()? else {
                i += 1;
                continue;
            };
            let a = self.active.swap_remove(i);
            self.free_at.insert(a.device.clone(), Instant::now() + self.cooldown);
            if !matches!(ending.status, Status::Ok | Status::Probe) {
                record_failure(
                    &self.opts.out,
                    &a.cell,
                    a.started,
                    &ending,
                    &self.invocation_id,
                    &self.host,
                )?;
            }
            match a.search {
                None => self.ended(&a.cell, ending.status, ending.message.lines().next().unwrap_or(""))?,
                Some(s) => self.probe_ended(work, s, &a.cell, &ending)?,
            }
        }
        if !self.active.iter().any(|a| a.grouped) {
            self.stop_group_neighbours();
        }
        Ok(())
    }

    /// A group that could not start: a failed row for each member, counted and said.
    fn group_failed(&mut self, members: &[PlannedCell], why: &str) -> Result<()> {
        let ending = Ending {
            status: Status::Error,
            message: format!("the group's memory-system neighbour: {why}"),
            program: None,
        };
        for m in members {
            record_failure(
                &self.opts.out,
                &m.spec,
                provenance::now(),
                &ending,
                &self.invocation_id,
                &self.host,
            )?;
            self.ended(&m.spec, ending.status, &ending.message)?;
        }
        Ok(())
    }

    /// Stops the neighbours of a group that has ended; one that will not stop is said.
    fn stop_group_neighbours(&mut self) {
        for n in self.group_neighbours.drain(..) {
            if let Err(e) = n.stop() {
                let _ = self
                    .progress
                    .line(&format!("warning: the group's memory-system neighbour: {e:#}"));
            }
        }
    }

    /// A cell of the matrix ended: counted, and its line printed.
    fn ended(&mut self, cell: &CellSpec, status: Status, first_line: &str) -> Result<()> {
        self.progress.advance();
        self.finished += 1;
        self.summary.ran += 1;
        self.summary.count(status);
        let elapsed = self.started.elapsed();
        let left = self.total.saturating_sub(self.finished);
        let eta = if self.finished > 0 {
            elapsed.mul_f64(left as f64 / self.finished as f64)
        } else {
            Duration::ZERO
        };
        self.progress.line(&format!(
            "[{}/{}] {}: {} {first_line} (elapsed {}, ETA {})",
            self.finished,
            self.total,
            describe(cell),
            status.as_str(),
            duration(elapsed),
            duration(eta)
        ))
    }

    /// A probe of search `s` ended: the next probe, or the answer for the cells waiting on it.
    fn probe_ended(&mut self, work: &mut Work, s: usize, cell: &CellSpec, ending: &Ending) -> Result<()> {
        self.summary.probes += 1;
        let first_line = ending.message.lines().next().unwrap_or("");
        let search = &mut work.searches[s];
        let fits = match ending.status {
            Status::Probe => "fits",
            Status::Oom => "does not fit",
            _ => "failed",
        };
        self.progress.line(&format!(
            "  max search: {}: {fits} ({} {first_line})",
            describe(cell),
            ending.status.as_str()
        ))?;
        // A probe that failed for another reason than memory ends the search: its cells carry
        // that failure instead of a batch size the search never found.
        let verdict: Option<std::result::Result<usize, Ending>> = match ending.status {
            Status::Probe | Status::Oom => {
                if ending.status == Status::Probe {
                    search.fits = search.fits.max(cell.batch);
                } else {
                    search.fails = Some(search.fails.map_or(cell.batch, |f| f.min(cell.batch)));
                }
                match search.next() {
                    Some(next) => {
                        work.probes.push_front((probe(&search.template, next), s));
                        None
                    }
                    None if search.fits == 0 => Some(Err(Ending {
                        program: None,
                        status: Status::Oom,
                        message: format!(
                            "a batch of 1 does not fit on `{}` (the max search's first probe ran out of memory)",
                            search.template.device
                        ),
                    })),
                    None => Some(Ok(search.fits)),
                }
            }
            _ => Some(Err(Ending {
                program: None,
                status: ending.status,
                message: format!(
                    "the max search's probe at batch {} failed: {}",
                    cell.batch, ending.message
                ),
            })),
        };
        match verdict {
            None => {}
            Some(Ok(found)) => {
                self.progress
                    .line(&format!("  max search: the largest batch that fits is {found}"))?;
                for mut c in search.waiting.drain(..) {
                    c.spec.batch = found;
                    work.queue.push_front(c);
                }
            }
            Some(Err(failed)) => self.search_failed(std::mem::take(&mut search.waiting), &failed)?,
        }
        Ok(())
    }

    /// A max search that ended without a batch: each of its waiting cells gets the failure's row.
    fn search_failed(&mut self, waiting: Vec<PlannedCell>, failed: &Ending) -> Result<()> {
        for c in waiting {
            record_failure(
                &self.opts.out,
                &c.spec,
                provenance::now(),
                failed,
                &self.invocation_id,
                &self.host,
            )?;
            self.summary.count(failed.status);
            self.summary.ran += 1;
            self.finished += 1;
            self.progress.advance();
            self.progress.line(&format!(
                "[{}/{}] {}: {} {}",
                self.finished,
                self.total,
                describe(&c.spec),
                failed.status.as_str(),
                failed.message.lines().next().unwrap_or("")
            ))?;
        }
        Ok(())
    }

    /// A concurrent group runs alone on the machine: once nothing else runs or waits, and its
    /// devices have cooled down.
    fn start_group(&mut self, work: &mut Work) -> Result<()> {
        let alone_left =
            work.queue.is_empty() && work.probes.is_empty() && work.searches.iter().all(|s| s.waiting.is_empty());
        let now = Instant::now();
        let (keys, free_at) = (&mut self.keys, &self.free_at);
        let mut cooled = |m: &PlannedCell| {
            let key = key_of(keys, &m.spec.device);
            free_at.get(&key).is_none_or(|t| *t <= now)
        };
        let group_ready = work.groups.front().is_some_and(|g| g.iter().all(&mut cooled));
        if !(self.active.is_empty() && alone_left && group_ready) {
            return Ok(());
        }
        if let Some(members) = work.groups.pop_front() {
            let dir = group_dir(&self.opts.out, &members)?;
            let mut said = Vec::new();
            let records = start_memory_neighbours(
                self.exe,
                &members,
                &dir,
                self.daemons,
                &mut self.keys,
                &mut self.group_neighbours,
                &mut |line| said.push(line),
            );
            for line in said {
                self.progress.line(&format!("MPS: {line}"))?;
            }
            let records = match records {
                Ok(r) => r,
                Err(e) => {
                    // The group cannot run as it says: each member gets a failed row, and the
                    // sweep goes on.
                    self.stop_group_neighbours();
                    return self.group_failed(&members, &format!("{e:#}"));
                }
            };
            let started = start_group(
                self.exe,
                &self.opts.out,
                &dir,
                &members,
                self.timeout,
                &self.invocation_id,
                self.daemons,
                &mut self.keys,
                &records,
            )?;
            self.progress.line(&format!(
                "group {}: {} members started together",
                members[0].spec.concurrency_group.as_deref().unwrap_or(""),
                started.len()
            ))?;
            self.active.extend(started);
        }
        Ok(())
    }

    /// Starts what can start, up to `--jobs`: a probe first, else a cell, on a device that is free
    /// and cooled down.
    fn start_cells(&mut self, work: &mut Work) -> Result<()> {
        while self.active.len() < self.opts.jobs.max(1) && !self.active.iter().any(|a| a.grouped) {
            let busy: HashSet<&str> = self.active.iter().map(|a| a.device.as_str()).collect();
            let now = Instant::now();
            let (keys, free_at) = (&mut self.keys, &self.free_at);
            let mut ready = |device: &str| -> bool {
                let key = key_of(keys, device);
                !busy.contains(key.as_str()) && free_at.get(&key).is_none_or(|t| *t <= now)
            };
            let next = if let Some(p) = work.probes.iter().position(|(c, _)| ready(&c.device)) {
                let (cell, s) = work.probes.remove(p).expect("found");
                Some((cell, Some(s), None))
            } else {
                // A server answers at one endpoint: its cells on other devices wait their turn.
                let endpoints: HashSet<&str> = self.active.iter().filter_map(|a| endpoint_of(&a.cell)).collect();
                let free = |c: &CellSpec| endpoint_of(c).is_none_or(|e| !endpoints.contains(e));
                work.queue
                    .iter()
                    .position(|c| ready(&c.spec.device) && free(&c.spec))
                    .map(|p| {
                        let planned = work.queue.remove(p).expect("found");
                        (planned.spec.clone(), None, Some(planned))
                    })
            };
            let Some((cell, search, planned)) = next else { break };
            let device = self.keys[&cell.device].clone();
            // The device, then the cell: another sweep may measure on either (claim.rs).
            let Some(device_claim) = self.claim_device(&device)? else {
                match (planned, search) {
                    (Some(p), _) => work.queue.push_front(p),
                    (None, Some(s)) => work.probes.push_front((cell, s)),
                    (None, None) => unreachable!("a cell is queued or a probe"),
                }
                continue;
            };
            let cell_claim = match Claim::take(&claim::cell_claim(&self.opts.out, &cell.cell_id()))? {
                Claimed::Ours { claim, took_over } => {
                    if let Some(h) = took_over {
                        self.progress.line(&format!(
                            "warning: {}: took over the stale claim of a sweep that is gone ({})",
                            describe(&cell),
                            h.describe()
                        ))?;
                    }
                    claim
                }
                Claimed::Theirs(h) if planned.is_some() => {
                    // Another sweep measures this very cell: its row will be there.
                    self.skipped_here(&cell, &format!("measured by another sweep ({})", h.describe()))?;
                    continue;
                }
                Claimed::Theirs(_) => {
                    // A probe of the same search in another sweep: wait for it.
                    self.free_at.insert(device.clone(), Instant::now() + CLAIM_RETRY);
                    work.probes.push_front((cell, search.expect("a probe")));
                    continue;
                }
            };
            // Another sweep may have measured it since this one was planned.
            if planned.is_some() && !self.opts.force && done_as_planned(&self.opts.out, &cell, self.opts.retry_oom)? {
                drop((cell_claim, device_claim));
                self.skipped_here(&cell, "measured by another sweep meanwhile")?;
                continue;
            }
            let env = mps_env(&cell, &device, self.daemons);
            let running = start_cell(self.exe, &self.opts.out, &cell, self.timeout, &self.invocation_id, &env)?;
            self.active.push(Active {
                cell,
                device,
                running,
                started: provenance::now(),
                search,
                grouped: false,
                claims: vec![device_claim, cell_claim],
            });
        }
        Ok(())
    }

    /// The device's claim; `None` where another sweep measures on it, whose cells then wait, as
    /// for a cool-down, and try again (said once).
    fn claim_device(&mut self, device: &str) -> Result<Option<Claim>> {
        match Claim::take(&claim::device_claim(device))? {
            Claimed::Ours { claim, took_over } => {
                if let Some(h) = took_over {
                    self.progress.line(&format!(
                        "warning: took over device {device}'s stale claim ({})",
                        h.describe()
                    ))?;
                }
                Ok(Some(claim))
            }
            Claimed::Theirs(h) => {
                self.free_at.insert(device.to_string(), Instant::now() + CLAIM_RETRY);
                if self.waiting_for.insert(device.to_string()) {
                    self.progress.line(&format!(
                        "device {device}: another sweep measures on it ({}); its cells wait",
                        h.describe()
                    ))?;
                }
                Ok(None)
            }
        }
    }

    /// A cell another sweep measured or measures: counted as done there, and said.
    fn skipped_here(&mut self, cell: &CellSpec, why: &str) -> Result<()> {
        self.summary.claimed += 1;
        self.finished += 1;
        self.progress.advance();
        self.progress.line(&format!(
            "[{}/{}] {}: {why}; skipped here",
            self.finished,
            self.total,
            describe(cell)
        ))
    }

    /// The summary, once the progress bar is gone.
    fn finish(self) -> Summary {
        drop(self.progress);
        self.summary
    }
}

/// What a cell's process needs of the sweep's MPS daemon on its GPU: the pipes of a client, or word
/// that the idle MPS server it may meet is migprof's.
fn mps_env(
    cell: &CellSpec,
    device_key: &str,
    daemons: &HashMap<String, crate::mps::daemon::Daemon>,
) -> Vec<(&'static str, PathBuf)> {
    match daemons.get(device_key) {
        Some(d) if crate::mps::is_emulated(&cell.device) => vec![(crate::mps::daemon::CLIENT_PIPE_ENV, d.pipe_dir())],
        Some(_) => vec![(crate::mps::daemon::BESIDE_ENV, PathBuf::from("1"))],
        None => Vec::new(),
    }
}

/// A fresh meeting folder for a group instance.
fn group_dir(out: &Path, members: &[PlannedCell]) -> Result<PathBuf> {
    let key = members[0].group.as_deref().expect("a group's member");
    let dir = out.join("groups").join(crate::run::record::id_of(key));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| crate::files::io_error(e, &dir))?;
    Ok(dir)
}

/// Starts every member of a concurrent group instance at once, in its meeting folder `dir`, and
/// then tells them who the members are (their pids: the neighbours each expects on its device).
/// `records` names, by device key, the memory-system neighbour record of the `mps-mem:` members
/// there ([`start_memory_neighbours`]).
#[allow(clippy::too_many_arguments)]
fn start_group(
    exe: &Path,
    out: &Path,
    dir: &Path,
    members: &[PlannedCell],
    timeout: Duration,
    invocation_id: &str,
    daemons: &HashMap<String, crate::mps::daemon::Daemon>,
    keys: &mut HashMap<String, String>,
    records: &HashMap<String, PathBuf>,
) -> Result<Vec<Active>> {
    let dir = dir.to_path_buf();
    let mut started = Vec::new();
    for m in members {
        let device = key_of(keys, &m.spec.device);
        let mut env = mps_env(&m.spec, &device, daemons);
        env.push((crate::run::group::GROUP_DIR_ENV, dir.clone()));
        if let Some(record) = records.get(&device).filter(|_| m.spec.device.starts_with("mps-mem:")) {
            env.push((crate::mps::group::ENV, record.clone()));
        }
        // Holding ends well inside the cell's timeout, so that a member beside an overrunning one
        // still writes its row.
        let hold_for = timeout.saturating_sub(Duration::from_secs(10).min(timeout / 10));
        let until = std::time::SystemTime::now() + hold_for;
        env.push((
            crate::run::group::HOLD_UNTIL_ENV,
            PathBuf::from(
                until
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs()
                    .to_string(),
            ),
        ));
        let running = start_cell(exe, out, &m.spec, timeout, invocation_id, &env)?;
        started.push(Active {
            cell: m.spec.clone(),
            device,
            running,
            started: provenance::now(),
            search: None,
            grouped: true,
            // A group runs alone on its machine and as a whole; claims are for cells that run alone.
            claims: Vec::new(),
        });
    }
    let list: Vec<crate::run::group::Member> = started
        .iter()
        .map(|a| crate::run::group::Member {
            pid: a.running.pid(),
            cell_id: a.cell.cell_id(),
            device: a.device.clone(),
        })
        .collect();
    crate::run::group::write_members(&dir, &list)?;
    Ok(started)
}

/// Starts one memory-system neighbour per GPU for a group's `mps-mem:` members there: the path of
/// the record its members read, by device key.
fn start_memory_neighbours(
    exe: &Path,
    members: &[PlannedCell],
    dir: &Path,
    daemons: &HashMap<String, crate::mps::daemon::Daemon>,
    keys: &mut HashMap<String, String>,
    neighbours: &mut Vec<crate::mps::neighbour::NeighbourProcess>,
    log: &mut dyn FnMut(String),
) -> Result<HashMap<String, PathBuf>> {
    let mut by_gpu: HashMap<String, Vec<crate::mps::MpsTarget>> = HashMap::new();
    for m in members.iter().filter(|m| m.spec.device.starts_with("mps-mem:")) {
        let target = mps_target(&m.spec.device)?;
        let key = key_of(keys, &m.spec.device);
        by_gpu.entry(key).or_default().push(target);
    }
    // An mps: member beside them would run on the SMs their neighbour streams on.
    for m in members.iter().filter(|m| m.spec.device.starts_with("mps:")) {
        let key = key_of(keys, &m.spec.device);
        if by_gpu.contains_key(&key) {
            anyhow::bail!(
                "`{}` is emulated alone (mps:) on the GPU of the group's memory-partitioned members; a group's emulated members on a GPU are all mps: or all mps-mem:",
                m.spec.device
            )
        }
    }
    let mut records = HashMap::new();
    for (key, targets) in by_gpu {
        let daemon = daemons
            .get(&key)
            .ok_or_else(|| anyhow::anyhow!("no MPS daemon runs for the GPU of {}", targets[0]))?;
        let gpu_dir = dir.join(format!("gpu-{}", records.len()));
        std::fs::create_dir_all(&gpu_dir).map_err(|e| crate::files::io_error(e, &gpu_dir))?;
        let (record, neighbour) = crate::mps::group::start_shared(&targets, exe, &daemon.pipe_dir(), &gpu_dir, log)?;
        neighbours.extend(neighbour);
        records.insert(key, record);
    }
    Ok(records)
}

/// The endpoint a server's cell answers at.
fn endpoint_of(cell: &CellSpec) -> Option<&str> {
    cell.job.server().and_then(|s| s.server.endpoint.as_deref())
}

/// The key a device string's cells are kept apart by (its GPU), worked out once per string.
fn key_of(keys: &mut HashMap<String, String>, device: &str) -> String {
    keys.entry(device.to_string())
        .or_insert_with(|| device_key(device))
        .clone()
}

/// The target of an `mps:` or `mps-mem:` device string.
fn mps_target(device: &str) -> Result<crate::mps::MpsTarget> {
    match device.parse::<crate::device::DeviceSpec>() {
        Ok(crate::device::DeviceSpec::Mps(target)) => Ok(target),
        _ => anyhow::bail!("`{device}` is not an MPS target"),
    }
}

/// Starts migprof's MPS daemon for the GPU of an `mps:` device, checking the share first.
fn start_mps_daemon(device: &str) -> Result<crate::mps::daemon::Daemon> {
    let target = mps_target(device)?;
    crate::mps::start_daemon(&target)
        .map(|(_, _, daemon)| daemon)
        .map_err(|e| {
            // In a build without CUDA the daemon's failure (no driver, no NVML) is not the point: say
            // first what `migprof run` says of the same device.
            match crate::device::no_cuda_is_an_error(&crate::device::DeviceSpec::Mps(target.clone())) {
                Err(no_cuda) => e.context(no_cuda.to_string()),
                Ok(()) => e,
            }
        })
}

/// A probe of a `max` search at `batch`.
fn probe(template: &CellSpec, batch: usize) -> CellSpec {
    CellSpec {
        batch,
        purpose: Purpose::Probe,
        repeat: 0,
        ..template.clone()
    }
}

fn start_cell(
    exe: &Path,
    out: &Path,
    cell: &CellSpec,
    timeout: Duration,
    invocation_id: &str,
    env: &[(&str, PathBuf)],
) -> Result<Running> {
    let id = cell.cell_id();
    let spec = out.join("cells").join(format!("{id}.json"));
    crate::files::write_atomically(&spec, cell.to_json()?.as_bytes())?;
    child::start(
        exe,
        &spec,
        out,
        &out.join("logs").join(format!("{id}.log")),
        timeout,
        invocation_id,
        env,
    )
}

pub(crate) fn record_failure(
    out: &Path,
    cell: &CellSpec,
    started: chrono::DateTime<chrono::Utc>,
    ending: &Ending,
    invocation_id: &str,
    host: &str,
) -> Result<()> {
    // The sweep never opened the cell's device: the fingerprint is what its own process can tell.
    let fingerprint = crate::run::fingerprint::Fingerprint::collect(None);
    let mut failure = cell.failure(
        ending.status,
        ending.message.clone(),
        started,
        invocation_id,
        host,
        fingerprint,
    );
    if let (Some(ended), Some(program)) = (&ending.program, failure.program.as_mut()) {
        ended.fill(program);
    }
    write_failure(out, &failure).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn search(fits: usize, fails: Option<usize>) -> MaxSearch {
        MaxSearch {
            fits,
            fails,
            limit: 100,
            waiting: Vec::new(),
            template: crate::cell::spec::tests::cell(),
        }
    }

    #[test]
    fn a_max_search_doubles_then_bisects_to_the_largest_batch_that_fits() {
        assert_eq!(search(0, None).next(), Some(1));
        assert_eq!(search(0, Some(1)).next(), None, "not even 1 fits: the answer is 0");
        assert_eq!(search(1, None).next(), Some(2));
        assert_eq!(search(32, None).next(), Some(64));
        assert_eq!(search(64, None).next(), Some(100), "the limit caps the doubling");
        assert_eq!(search(100, None).next(), None, "everything up to the limit fits");
        assert_eq!(search(32, Some(64)).next(), Some(48));
        assert_eq!(search(47, Some(48)).next(), None);
        // A simulated device where 37 fits and 38 does not: the search lands on 37.
        let mut s = search(0, None);
        let mut batch = s.next().unwrap();
        let mut tries = 0;
        loop {
            tries += 1;
            if batch <= 37 {
                s.fits = s.fits.max(batch)
            } else {
                s.fails = Some(s.fails.map_or(batch, |f: usize| f.min(batch)))
            }
            match s.next() {
                Some(b) => batch = b,
                None => break,
            }
        }
        assert_eq!((s.fits, s.fails), (37, Some(38)));
        assert!(tries <= 12, "{tries} probes");
    }
}
