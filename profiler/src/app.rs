//! What each command does: `run` measures and writes results; `models`, `devices`, `profiles` and
//! `plan` print the catalogue, the GPUs, MIG profile tables and layout plans.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use crate::cli::RunArgs;
use crate::device::DeviceSpec;
use crate::provenance;
use crate::results::record::{CellIdentity, Status};
use crate::results::store::{read_table, write_run, Table};
use crate::results::{plot, summary};
use crate::results::{Run, RunContext};
use crate::run::{execute, RunSpec};

/// Outcome of `migprof run`: how many runs were written and whether one failed.
pub struct RunReport {
    pub completed: Vec<Run>,
    pub failed: Option<(RunSpec, anyhow::Error)>,
}

pub fn run(args: &RunArgs, log: &mut dyn Write) -> Result<RunReport> {
    let specs = crate::run::spec::from_args(args)?;
    let spec = device_or_default(args.device.as_ref(), log)?;
    let device = spec.open()?;
    crate::run::spec::check_device(&specs, &device)?;
    crate::run::preflight::check(&specs, &device)?;
    // Make the folder before the first run, so a bad --out fails before any time is spent.
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot use {} as the results folder", args.out.display()))?;
    let context = RunContext::new_invocation(&device.info);
    writeln!(
        log,
        "migprof {}: {} run(s) on {} [{}], results to {}",
        provenance::VERSION,
        specs.len(),
        spec,
        device.info.name,
        args.out.display()
    )?;

    let mut completed = Vec::new();
    let mut failed = None;
    for (i, s) in specs.iter().enumerate() {
        write!(
            log,
            "[{}/{}] {} {} {} batch {} ... ",
            i + 1,
            specs.len(),
            s.model,
            s.mode.as_str(),
            s.precision(),
            s.batch
        )?;
        log.flush()?;
        let outcome = crate::sweep::cell::CellSpec::of_run(s, &device.info.name, &spec.to_string())
            .map(|cell| CellIdentity {
                sweep: None,
                target: device.info.name.clone(),
                cell_id: cell.cell_id(),
                status: Status::Ok,
                concurrency_group: None,
                neighbours: Vec::new(),
                baseline: false,
            })
            .and_then(|identity| execute(s, &device, context.clone(), identity))
            .and_then(|run| write_run(&args.out, &run).map(|_| run));
        match outcome {
            Ok(run) => {
                writeln!(
                    log,
                    "{} iterations, p50 {:.3} ms, {:.1} samples/s, {}",
                    run.stats.iterations,
                    run.stats.p50_ns as f64 / 1e6,
                    run.throughput(),
                    run.assessment.verdict
                )?;
                if let Some(w) = run.assessment.outlier_warning() {
                    writeln!(log, "warning: {w}")?;
                }
                if let Some(w) = evidence_warning(&run) {
                    writeln!(log, "warning: {w}")?;
                }
                if let Some(w) = run.fingerprint.pool_warning() {
                    writeln!(log, "warning: {w}")?;
                }
                completed.push(run);
            }
            Err(e) => {
                writeln!(log, "failed")?;
                failed = Some((s.clone(), e));
                break;
            }
        }
    }
    Ok(RunReport { completed, failed })
}

/// The device asked for, else the default one (saying why when it is the CPU).
fn device_or_default(asked: Option<&DeviceSpec>, log: &mut dyn Write) -> Result<DeviceSpec> {
    Ok(match asked {
        Some(d) => d.clone(),
        None => {
            let (spec, why) = DeviceSpec::default_for(crate::gpu::discover);
            if let Some(why) = why {
                writeln!(log, "note: {why}")?;
            }
            spec
        }
    })
}

/// `migprof load`: serves the model at each rate, or searches its capacity; rows written as each step
/// ends. Returns the job's outcome for the summary.
pub fn load(args: &crate::cli::LoadArgs, log: &mut dyn Write) -> Result<crate::load::job::JobOutcome> {
    use crate::load::job::Rates;
    use crate::load::record::LoadSettings;
    let spec = crate::run::spec::for_load(args)?;
    let settings = LoadSettings {
        arrival: args.arrival,
        max_batch: args.max_batch,
        max_delay_ms: args.max_delay_ms,
        warmup_secs: args.warmup,
        duration_secs: args.duration,
        arrival_seed: args.seed,
        slo_p99_ms: args.slo_p99_ms,
        resolution: args.resolution / 100.0,
        min_requests: args.min_requests,
    };
    let rates = if args.search {
        Rates::Search {
            start: args.qps.first().copied(),
        }
    } else {
        Rates::Fixed(args.qps.clone())
    };
    let device_spec = device_or_default(args.device.as_ref(), log)?;
    let device = device_spec.open()?;
    crate::run::spec::check_device(std::slice::from_ref(&spec), &device)?;
    crate::run::preflight::check(std::slice::from_ref(&spec), &device)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot use {} as the results folder", args.out.display()))?;
    let context = RunContext::new_invocation(&device.info);
    let mut cell = crate::sweep::cell::CellSpec::of_run(&spec, &device.info.name, &device_spec.to_string())?;
    cell.load = Some(settings.clone());
    let identity = CellIdentity::of_cell(&cell, Status::Ok);
    let identity = CellIdentity {
        sweep: None,
        target: device.info.name.clone(),
        ..identity
    };
    writeln!(
        log,
        "migprof {}: {} {} on {} [{}], {} arrivals, batches up to {} or {} ms; rows to {}",
        provenance::VERSION,
        spec.model,
        spec.precision(),
        device_spec,
        device.info.name,
        settings.arrival.as_str(),
        settings.max_batch,
        settings.max_delay_ms,
        args.out.join(Table::Load.dir_name()).display()
    )?;
    if device.info.emulation.is_some() {
        writeln!(log, "note: an MPS-emulated slice: it shares L2 and memory bandwidth with the whole GPU, so it serves more than a real MIG slice would")?;
    }
    let job = crate::load::job::Job {
        spec: &spec,
        settings: &settings,
        rates: &rates,
    };
    let outcome = crate::load::job::run(job, &device, &context, &identity, &args.out, log)?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(outcome)
}

/// `migprof capacity`: the capacities, the plan, the hand plans; the layouts file when asked for.
pub fn capacity(args: &crate::cli::CapacityArgs, stdout: &mut dyn Write) -> Result<()> {
    let table = crate::mig::profile::table(&args.gpu)?;
    let dtype = args
        .dtype
        .map(|d| crate::run::spec::precision(d.into(), d == crate::cli::DTypeArg::Tf32));
    let mut seen = std::collections::BTreeSet::new();
    if let Some((m, _)) = args.demand.iter().find(|(m, _)| !seen.insert(m.as_str())) {
        anyhow::bail!("--demand names {m} twice: give each model once, with its whole rate");
    }
    anyhow::ensure!(
        args.capacities.is_none() || (dtype.is_none() && !args.closed_loop_estimates),
        "--dtype and --closed-loop-estimates choose among measured capacities (--from); a CSV's are taken as they are"
    );
    let gathered = match (&args.capacities, args.from.is_empty()) {
        (Some(csv), _) => crate::capacity::source::from_csv(csv)?,
        (None, false) => crate::capacity::source::from_folders(&args.from, args.slo_p99_ms, dtype, &table.product, args.closed_loop_estimates)?,
        (None, true) => anyhow::bail!("where do the capacities come from? give --from DIR (results of `migprof load --search`) or --capacities FILE.csv"),
    };
    let report = crate::capacity::plan(&table, &gathered, &args.demand, args.slo_p99_ms, args.headroom)?;
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(stdout, "{}", report.to_text())?;
    }
    if let Some(path) = &args.emit_layouts {
        std::fs::write(path, report.mig_parted().to_yaml()?).with_context(|| format!("writing {}", path.display()))?;
        if !args.json {
            writeln!(
                stdout,
                "layouts: {} (apply with `migprof mig apply {} -c migprof-plan-1`)",
                path.display(),
                path.display()
            )?;
        }
    }
    // The report of the folder shows the latest plan made from it.
    if let Some(dir) = args.from.first() {
        let path = dir
            .join("plans")
            .join(format!("plan-{}.json", provenance::run_id(provenance::now())));
        let kept = std::fs::create_dir_all(dir.join("plans"))
            .and_then(|_| std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap_or_default()));
        match (kept, args.json) {
            (Ok(()), false) => writeln!(stdout, "plan: {}", path.display())?,
            (Ok(()), true) => {}
            // The plan is printed already; a folder that cannot keep it costs only the report's copy.
            (Err(e), _) => eprintln!("warning: could not keep the plan as {}: {e}", path.display()),
        }
    }
    Ok(())
}

/// `migprof run --device mps:…` when this process is no MPS client yet: starts migprof's MPS daemon
/// for the target's GPU, runs this same command again as its client, and stops the daemon when that
/// ends, also after Ctrl-C (which reaches the client and ends its runs; the daemon has its own
/// process group). The daemon's starter never opens a CUDA context of its own.
pub fn run_under_mps(target: &crate::mps::MpsTarget, log: &mut dyn Write) -> Result<std::process::ExitCode> {
    use crate::mps::daemon::CLIENT_PIPE_ENV;
    crate::device::no_cuda_is_an_error(&DeviceSpec::Mps(target.clone()))?;
    // From here on this process cleans up whatever ends the run: a Ctrl-C is the client's to act on
    // (it reaches the whole foreground group) and is ignored here; a SIGTERM is passed on to the
    // client. Both are restored in the client.
    // SAFETY: setting dispositions; the handler only reads an atomic and calls kill, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        libc::signal(
            libc::SIGTERM,
            forward_sigterm as extern "C" fn(libc::c_int) as libc::sighandler_t,
        );
    }
    let (selected, share, daemon) = crate::mps::start_daemon(target)?;
    writeln!(
        log,
        "MPS: migprof's control daemon (pid {}) serves {}; the runs are its client with {} (MPS shares neither L2 nor memory bandwidth: an emulated slice is faster than a real one)",
        daemon.pid().unwrap_or(0),
        selected.gpu.name,
        share.describe()
    )?;
    let exe = std::env::current_exe().context("finding this migprof to run as the MPS client")?;
    let mut client = std::process::Command::new(exe);
    client
        .args(std::env::args_os().skip(1))
        .env(CLIENT_PIPE_ENV, daemon.pipe_dir());
    // SAFETY: between fork and exec, only resetting dispositions.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut client, || {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGTERM, libc::SIG_DFL);
            Ok(())
        });
    }
    let status = client.spawn().and_then(|mut c| {
        MPS_CLIENT.store(c.id() as i32, std::sync::atomic::Ordering::SeqCst);
        c.wait()
    });
    let stopped = daemon.stop();
    writeln!(log, "MPS: daemon stopped")?;
    stopped?;
    let status = status.context("running migprof as the MPS client")?;
    Ok(match status.code() {
        Some(0) => std::process::ExitCode::SUCCESS,
        Some(c) => std::process::ExitCode::from(c.clamp(1, 255) as u8),
        None => std::process::ExitCode::FAILURE,
    })
}

/// The pid of `run_under_mps`'s client, for its SIGTERM handler (0: none yet).
static MPS_CLIENT: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_sigterm(_: libc::c_int) {
    let pid = MPS_CLIENT.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; the pid is our child's.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}

/// What the GPU sampler saw that a user must hear about at once: another process on the device,
/// slowed clocks, unmatched pids, or a sampler that failed (then none of it was checked).
fn evidence_warning(run: &Run) -> Option<String> {
    use crate::results::verdict::Flag;
    let loud = [
        Flag::Shared,
        Flag::Throttled,
        Flag::SamplerFailed,
        Flag::ProcessesUnattributed,
    ];
    run.assessment
        .flags
        .iter()
        .any(|f| loud.contains(f))
        .then(|| run.evidence.describe())
        .flatten()
}

/// `migprof sweep`: the dry run, or the sweep with its summary. `Ok(false)` when a cell failed or the
/// sweep was interrupted.
pub fn sweep(args: &crate::cli::SweepArgs, log: &mut dyn Write) -> Result<bool> {
    use crate::sweep::schedule;
    let file = crate::sweep::file::SweepFile::read(&args.file)?;
    let opts = schedule::Options {
        out: args.out.clone(),
        dry_run: args.dry_run,
        force: args.force,
        retry_oom: args.retry_oom,
        only: args.only.clone(),
        jobs: args.jobs as usize,
        terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    use crate::cli::Backend;
    match args.backend {
        Backend::Local => anyhow::ensure!(
            !args.submit && !args.status && args.emit.is_none(),
            "--submit and --status are for --backend slurm, --emit for --backend k8s"
        ),
        Backend::Slurm => {
            anyhow::ensure!(
                args.emit.is_none(),
                "--emit writes Kubernetes manifests: use it with --backend k8s"
            );
            if args.status {
                return crate::fleet::slurm::status(&file, &opts, log);
            }
            let slurm = crate::fleet::slurm::SlurmOptions {
                partition: args.partition.clone(),
                account: args.account.clone(),
                gres_template: args.gres_template.clone(),
                gpu_gres: args.gpu_gres.clone(),
                one_per_node: args.one_per_node,
                submit: args.submit,
                timeout_secs: file.defaults.timeout_secs,
            };
            let exe = std::env::current_exe().context("finding this migprof for the job scripts")?;
            crate::fleet::slurm::submit(&file, &opts, &slurm, &exe, log)?;
            return Ok(true);
        }
        Backend::K8s => {
            let Some(dir) = &args.emit else {
                anyhow::bail!("--backend k8s writes manifests: give --emit DIR (apply them with kubectl)")
            };
            anyhow::ensure!(
                !args.submit && !args.status,
                "--submit and --status are for --backend slurm; apply the manifests with kubectl"
            );
            let k = crate::fleet::k8s::K8sOptions {
                image: args.image.clone(),
                namespace: args.namespace.clone(),
                results_pvc: args.results_pvc.clone(),
                strategy: args.mig_strategy,
                one_per_node: args.one_per_node,
                timeout_secs: file.defaults.timeout_secs,
            };
            crate::fleet::k8s::emit(&file, &opts, &k, dir, log)?;
            return Ok(true);
        }
    }
    if opts.dry_run {
        schedule::dry_run(&file, &opts, log)?;
        return Ok(true);
    }
    let exe = std::env::current_exe().context("finding this migprof to start its cells")?;
    let summary = schedule::run(&file, &opts, &exe, log)?;
    let statuses: Vec<String> = summary
        .by_status
        .iter()
        .map(|(s, n)| format!("{n} {}", s.as_str()))
        .collect();
    writeln!(
        log,
        "{}: {} cell(s) planned, {} skipped (done already), {} run{}{}{}; rows in {}",
        if summary.interrupted { "interrupted" } else { "done" },
        summary.planned,
        summary.skipped,
        summary.ran,
        if statuses.is_empty() {
            String::new()
        } else {
            format!(" ({})", statuses.join(", "))
        },
        if summary.probes > 0 {
            format!(", {} max-search probe(s)", summary.probes)
        } else {
            String::new()
        },
        if summary.interrupted {
            "; rerun the same command to finish"
        } else {
            ""
        },
        args.out.join(Table::Runs.dir_name()).display()
    )?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(!summary.interrupted && summary.failed() == 0)
}

/// `migprof cell`: one cell, measured and written with its identity. The exit code tells the sweep
/// how it ended: 0 measured (the row is written), [`crate::sweep::child::EXIT_OOM`] out of memory,
/// 1 any other error.
pub fn cell(
    spec_path: &Path,
    out: &Path,
    invocation: Option<&str>,
    stdout: &mut dyn Write,
) -> Result<std::process::ExitCode> {
    use crate::sweep::cell::{CellSpec, Purpose};
    // The line the sweep reads: `<status> <what it measured>`.
    let result = (|| -> Result<String> {
        let cell = CellSpec::read(spec_path)?;
        let spec = cell.run_spec()?;
        let device = if cell.scheduled {
            scheduled_device(&cell.device)?
        } else {
            cell.device.parse::<DeviceSpec>()?.open()?
        };
        crate::run::spec::check_device(std::slice::from_ref(&spec), &device)?;
        let context = RunContext {
            invocation_id: invocation
                .map(str::to_string)
                .unwrap_or_else(|| provenance::run_id(provenance::now())),
            host: provenance::host(),
            device: device.info.clone(),
            expected: crate::results::evidence::Expected::on(&device.info),
            group: crate::run::group::GroupMember::from_env(&cell.cell_id()),
        };
        let status = if cell.purpose == Purpose::Probe {
            Status::Probe
        } else {
            Status::Ok
        };
        let identity = CellIdentity::of_cell(&cell, status);
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
            writeln!(stdout, "{}{line}", crate::sweep::child::RESULT_PREFIX)?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            let code = if is_out_of_memory(&e) {
                crate::sweep::child::EXIT_OOM
            } else {
                1
            };
            Ok(std::process::ExitCode::from(code as u8))
        }
    }
}

/// The device a cluster's scheduler assigned to a cell that asked for `asked` (a MIG profile, `cuda`
/// or `cpu`): the first visible one, which must be what was asked for.
fn scheduled_device(asked: &str) -> Result<crate::device::OpenDevice> {
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
    use crate::sweep::child::{classify, Exit};
    let cell = crate::sweep::cell::CellSpec::read(spec_path)?;
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

/// Whether an error is an allocation failure: CUDA's, cuBLAS's, cuDNN's, candle's.
fn is_out_of_memory(e: &anyhow::Error) -> bool {
    let text = format!("{e:#}");
    [
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
        "CUBLAS_STATUS_ALLOC_FAILED",
        "CUDNN_STATUS_ALLOC_FAILED",
        "memory allocation of",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// `migprof compare DIR --baseline SEL --target SEL`.
pub fn compare(
    dir: &Path,
    baseline: &crate::results::compare::Selector,
    target: &crate::results::compare::Selector,
    format: crate::results::compare::Format,
    stdout: &mut dyn Write,
) -> Result<()> {
    anyhow::ensure!(dir.is_dir(), "{}: no such results folder", dir.display());
    let runs = read_table(dir, Table::Runs)?;
    anyhow::ensure!(runs.height() > 0, "{}: no runs to compare", dir.display());
    let c = crate::results::compare::compare(&runs, baseline, target)?;
    write!(stdout, "{}", c.render(format)?)?;
    Ok(())
}

/// `migprof report DIR...`: writes the report and says where.
pub fn report(
    dirs: &[std::path::PathBuf],
    out: Option<&Path>,
    format: crate::report::Format,
    detail_batch: Option<usize>,
    stdout: &mut dyn Write,
) -> Result<()> {
    let default = dirs[0].join(match format {
        crate::report::Format::Html => "report.html",
        crate::report::Format::Md => "report.md",
    });
    let out = out.unwrap_or(&default);
    crate::report::write(dirs, out, format, detail_batch)?;
    writeln!(stdout, "report: {}", out.display())?;
    Ok(())
}

/// The line that ends `run` and `sweep`: how to see the folder as a report.
pub fn report_hint(dir: &Path) -> String {
    format!("report: migprof report {}", dir.display())
}

/// `migprof merge DIR... --out DIR`.
pub fn merge(dirs: &[std::path::PathBuf], out: &Path, stdout: &mut dyn Write) -> Result<()> {
    let m = crate::results::merge::merge(dirs, out)?;
    for (cell, folders) in &m.cells_in_several {
        writeln!(stdout, "cell {cell}: rows from {} (all kept)", folders.join(", "))?;
    }
    writeln!(
        stdout,
        "merged {} folder(s) into {}: {} part(s) copied, {} already there; {} cell(s) measured in more than one folder",
        dirs.len(),
        out.display(),
        m.copied,
        m.already,
        m.cells_in_several.len()
    )?;
    writeln!(stdout, "{}", report_hint(out))?;
    Ok(())
}

/// `migprof check DIR`: `Ok(false)` when it found a problem.
pub fn check(dir: &Path, stdout: &mut dyn Write) -> Result<bool> {
    anyhow::ensure!(dir.is_dir(), "{}: no such results folder", dir.display());
    let report = crate::results::check::check(dir)?;
    for p in &report.problems {
        writeln!(stdout, "problem: {p}")?;
    }
    writeln!(
        stdout,
        "{}: {} run row(s), {} sample(s), {} metric reading(s), {} load step(s) with {} batch(es), {} capacity search(es); {}",
        dir.display(),
        report.rows["runs"],
        report.rows["samples"],
        report.rows["metrics"],
        report.rows["load"],
        report.rows["load_batches"],
        report.rows["capacity"],
        if report.problems.is_empty() { "no problems".to_string() } else { format!("{} problem(s)", report.problems.len()) }
    )?;
    Ok(report.problems.is_empty())
}

/// Plots everything in the folder and prints the summary and where things are.
pub fn finish(out: &Path, report: &RunReport, stdout: &mut dyn Write) -> Result<()> {
    let all = read_table(out, Table::Runs)?;
    let plots = plot::write_plots(out, &all)?;
    if !report.completed.is_empty() {
        write!(stdout, "\n{}", summary::table(&report.completed))?;
    }
    writeln!(stdout)?;
    writeln!(
        stdout,
        "wrote {} run(s) to {} and {} ({} runs in the folder in all)",
        report.completed.len(),
        out.join(Table::Runs.dir_name()).display(),
        out.join(Table::Samples.dir_name()).display(),
        all.height()
    )?;
    for p in &plots {
        writeln!(stdout, "plot: {}", p.display())?;
    }
    let not_ok = report
        .completed
        .iter()
        .filter(|r| r.assessment.verdict != crate::results::verdict::Verdict::Ok)
        .count();
    if not_ok > 0 {
        writeln!(
            stdout,
            "{not_ok} run(s) have a verdict other than ok; their verdict_reason column says why"
        )?;
    }
    writeln!(stdout, "{}", report_hint(out))?;
    Ok(())
}

/// `migprof devices`: the GPU tree, or why there is none (not an error: a CPU machine is a valid place
/// to run migprof).
pub fn devices(json: bool, stdout: &mut dyn Write) -> Result<()> {
    match crate::gpu::discover() {
        Ok(t) if json => writeln!(stdout, "{}", t.to_json())?,
        Ok(t) => {
            write!(stdout, "{}", t.tree())?;
            writeln!(stdout, "{}", mps_status(&crate::mps::processes::Proc))?;
        }
        Err(e) => writeln!(
            stdout,
            "no NVIDIA GPU here: {e:#}\nmigprof runs on the CPU (--device cpu)."
        )?,
    }
    Ok(())
}

/// Whether slices can be emulated with MPS here, and which MPS daemons run (migprof's or another's).
fn mps_status(procs: &dyn crate::mps::processes::ProcessTable) -> String {
    use crate::mps::daemon::{base_dir, control_program};
    let available = match control_program() {
        Ok(p) => format!(
            "MPS: available ({}), for emulated slices: --device mps:<profile> or mps:<percent>%",
            p.display()
        ),
        Err(e) => format!("MPS: {e:#}"),
    };
    let running = procs.mps_processes();
    if running.is_empty() {
        return format!("{available}\nMPS: no daemon running");
    }
    let base = base_dir();
    let each: Vec<String> = running
        .iter()
        .map(|p| {
            format!(
                "  {} {}",
                p.describe(),
                if p.is_under(&base) {
                    "(migprof's)"
                } else {
                    "(not migprof's)"
                }
            )
        })
        .collect();
    format!("{available}\nMPS: running:\n{}", each.join("\n"))
}

/// The profile table `--gpu` names, or this machine's GPU's from NVML.
fn profile_table(args: &crate::cli::TableArgs) -> Result<crate::mig::ProfileTable> {
    match &args.gpu {
        Some(gpu) => crate::mig::table(gpu),
        None => crate::gpu::nvml::profile_table(args.index).map_err(|e| {
            let known: Vec<&str> = crate::mig::GPUS.iter().map(|(n, _)| *n).collect();
            anyhow::anyhow!(
                "{e:#}\nfor a GPU that is not here, name a known one: --gpu {}",
                known.join(" | --gpu ")
            )
        }),
    }
}

/// `migprof profiles`.
pub fn profiles(args: &crate::cli::TableArgs, stdout: &mut dyn Write) -> Result<()> {
    write!(stdout, "{}", profile_table(args)?.render())?;
    Ok(())
}

/// `migprof plan`: the plan, or why the layout does not fit (then `Ok(false)`).
pub fn plan(args: &crate::cli::TableArgs, profiles: &[String], list: bool, stdout: &mut dyn Write) -> Result<bool> {
    let table = profile_table(args)?;
    if list {
        let layouts = crate::mig::maximal_layouts(&table);
        writeln!(stdout, "{} maximal layouts of the {}:", layouts.len(), table.product)?;
        for l in layouts {
            writeln!(stdout, "  {}", l.join(","))?;
        }
        return Ok(true);
    }
    let names: Vec<&str> = profiles.iter().map(|s| s.trim()).collect();
    // An unknown profile is a usage error, not a layout that does not fit.
    for n in &names {
        table.profile(n)?;
    }
    match crate::mig::plan(&table, &names) {
        Ok(p) => {
            write!(stdout, "{}", p.render(&table))?;
            Ok(true)
        }
        Err(why) => {
            writeln!(stdout, "does not fit the {}: {why:#}", table.product)?;
            Ok(false)
        }
    }
}

/// `migprof mig ...` against this machine's NVML.
pub fn mig(cmd: &crate::cli::MigCommand, stdout: &mut dyn Write, stderr: &mut dyn Write) -> Result<()> {
    use crate::cli::MigCommand;
    use crate::mig::apply::{self, Options};
    use crate::mig::config::MigPartedFile;
    let root = is_root();
    let opts = |yes: bool, enable_mig: bool, disable_mig: bool| Options {
        yes,
        enable_mig,
        disable_mig,
        root,
    };
    match cmd {
        MigCommand::Apply {
            file,
            config,
            act,
            enable_mig,
            disable_mig,
        } => {
            // The file first: a bad file is reported on any machine, with or without a driver.
            let layout = MigPartedFile::read(file)?;
            let mut nvml = crate::gpu::mig_control::NvmlControl::new()?;
            apply::apply(
                &mut nvml,
                &layout,
                config.as_deref(),
                &opts(act.yes, *enable_mig, *disable_mig),
                stdout,
            )
        }
        MigCommand::Destroy { gpu, act } => {
            let mut nvml = crate::gpu::mig_control::NvmlControl::new()?;
            apply::destroy(&mut nvml, gpu, &opts(act.yes, false, false), stdout)
        }
        MigCommand::Export { out, name } => {
            let mut nvml = crate::gpu::mig_control::NvmlControl::new()?;
            let (file, warnings) = apply::export(&mut nvml, name)?;
            for w in warnings {
                writeln!(stderr, "warning: {w}")?;
            }
            let yaml = file.to_yaml()?;
            match out {
                Some(path) => {
                    std::fs::write(path, yaml).with_context(|| format!("writing {}", path.display()))?;
                    writeln!(stderr, "wrote {}", path.display())?;
                }
                None => write!(stdout, "{yaml}")?,
            }
            Ok(())
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The model catalogue as a table.
pub fn models(stdout: &mut dyn Write) -> Result<()> {
    let header = format!(
        "{:<12} {:<8} {:<14} {:>13} {:>14} {:>9}",
        "model", "family", "input", "params", "GFLOPs/sample", "preset"
    );
    writeln!(stdout, "{header}")?;
    writeln!(stdout, "{}", "-".repeat(header.len()))?;
    for m in workloads::models() {
        let input = match m.input {
            workloads::InputShape::Image {
                channels,
                height,
                width,
            } => format!("{channels}x{height}x{width}"),
            workloads::InputShape::Tokens { seq_len, .. } => format!("{seq_len} tokens"),
        };
        writeln!(
            stdout,
            "{:<12} {:<8} {:<14} {:>13} {:>14.3} {:>9}",
            m.name,
            m.family.as_str(),
            input,
            thousands(m.params),
            m.flops_per_sample as f64 / 1e9,
            if m.tiny { "tiny" } else { "published" }
        )?;
    }
    writeln!(stdout, "\nGFLOPs/sample: forward pass, a multiply-add counted as 2 FLOPs (torchvision counts it once); a training step counts 3x.")?;
    writeln!(stdout, "params include the classification head: 1000 classes for images; for BERT, Hugging Face's BertModel (with pooler) plus a 2-label head on the pooled output (bert_base: 109,482,240 + 1,538).")?;
    Ok(())
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(11_689_512), "11,689,512");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
    }

    #[test]
    fn models_lists_exact_counts() -> Result<()> {
        let mut out = Vec::new();
        models(&mut out)?;
        let text = String::from_utf8(out)?;
        assert!(
            text.lines()
                .any(|l| l.starts_with("resnet18 ") && l.contains("11,689,512")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("resnet50 ") && l.contains("25,557,032")),
            "{text}"
        );
        Ok(())
    }
}
