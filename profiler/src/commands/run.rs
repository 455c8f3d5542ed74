//! `migprof run`: its flags, the runs they ask for (a cross product of models, modes, dtypes and
//! batches, checked against each other here), and the runs measured and written one by one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, ensure, Result};
use clap::Args;
use migprof::cell::runner::{self, Offer, Ran, Target};
use migprof::device::DeviceSpec;
use migprof::load::settings::Keys;
use migprof::provenance;
use migprof::results::parts::{read_table, Table};
use migprof::results::{plot, summary};
use migprof::run::given::{self, BatchSize, KernelGiven, MeasureGiven, Place, WorkloadGiven};
use migprof::run::measure::{Stop, Warmup};
use migprof::run::verdict::{Flag, Verdict};
use migprof::run::{Run, RunSpec};
use workloads::TrainConfig;

use migprof::run::limits::ITERATIONS;

use super::args::{as_mps_client, at_least_one, device_or_default, parse_non_negative, report_hint, OptimizerArg};

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub workload: WorkloadGiven,

    /// Load the model's weights from a safetensors file with torchvision's (ResNet, ViT, Swin) or
    /// Hugging Face BertModel's names, instead of seeded random weights. Needs exactly one --model.
    #[arg(long)]
    pub weights: Option<PathBuf>,

    /// The optimizer of training runs.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,

    /// Learning rate of training runs (default: the optimizer's).
    #[arg(long, value_parser = parse_non_negative)]
    pub lr: Option<f64>,

    /// Weight decay of training runs (default: the optimizer's).
    #[arg(long, value_parser = parse_non_negative)]
    pub weight_decay: Option<f64>,

    /// cpu, cuda (the first GPU), a GPU index (nvidia-smi's), GPU-<uuid>, MIG-<uuid> or a MIG profile
    /// name such as 3g.40gb (when exactly one MIG device has it); migprof pins
    /// itself to it with CUDA_VISIBLE_DEVICES. mps:<profile> or mps:<percent>% emulates a slice as an
    /// MPS client of migprof's own daemon on a GPU with MIG off (mps:3g.40gb@1 on GPU 1);
    /// mps-mem:<profile> the same with its share of the memory bandwidth (a neighbour streams on the
    /// other SMs). Default: the first GPU in a CUDA build that finds one, else cpu.
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// Calibrate the memory-system neighbour of memory-partitioned slices (mps-mem:) afresh instead
    /// of using the setting cached for this GPU, driver and profile.
    #[arg(long)]
    pub recalibrate: bool,

    /// Warm-up iterations before measuring.
    #[arg(long, conflicts_with = "warmup_secs", allow_negative_numbers = true, value_parser = |s: &str| ITERATIONS.parse("--warmup", s))]
    pub warmup: Option<u64>,

    /// Measure exactly this many iterations.
    #[arg(long, conflicts_with_all = ["duration_secs", "target_precision"], allow_negative_numbers = true, value_parser = |s: &str| ITERATIONS.parse("--iters", s).and_then(|n| at_least_one("--iters", n)))]
    pub iters: Option<u64>,

    /// With --duration: the fewest iterations to measure however long they take.
    #[arg(long, default_value_t = given::MIN_ITERATIONS, conflicts_with = "iters", allow_negative_numbers = true, value_parser = |s: &str| ITERATIONS.parse("--min-iters", s))]
    pub min_iters: u64,

    #[command(flatten)]
    pub measure: MeasureGiven,

    /// Results folder: Parquet tables under runs/ and samples/, SVG plots beside them.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,

    #[command(flatten)]
    pub kernels: KernelGiven,
}

/// What `migprof run` measured: the runs written, and the run that failed, which ended the list.
struct Outcome {
    completed: Vec<Run>,
    failed: Option<(RunSpec, anyhow::Error)>,
}

pub fn exec(args: RunArgs, stdout: &mut dyn Write, log: &mut dyn Write) -> Result<ExitCode> {
    let specs = specs(&args)?;
    // The folder before anything else, so that a bad --out fails before any time is spent.
    migprof::files::ensure_writable_dir(&args.out)?;
    let device_spec = device_or_default(args.device.as_ref(), log)?;
    super::args::ask_recalibration(args.recalibrate);
    if let Some(code) = as_mps_client(&device_spec, log)? {
        return Ok(code);
    }
    let outcome = measure(&args, &specs, &device_spec, log)?;
    finish(&args.out, &outcome, stdout)?;
    Ok(match &outcome.failed {
        None => ExitCode::SUCCESS,
        Some((spec, err)) => {
            writeln!(
                log,
                "error: {} {} {} batch {} failed: {err:#}\n(runs finished before it are kept in {})",
                spec.model,
                spec.mode.as_str(),
                spec.precision.as_str(),
                spec.batch,
                args.out.display()
            )?;
            ExitCode::FAILURE
        }
    })
}

/// Opens the device, checks every run against it, then measures and writes the runs in order until
/// one fails (its row says how).
fn measure(args: &RunArgs, specs: &[RunSpec], device_spec: &DeviceSpec, log: &mut dyn Write) -> Result<Outcome> {
    let target = Target::open(device_spec)?;
    // Every run at once, so that the last run's mistake is known before the first is measured.
    migprof::run::preflight::check(specs, &target.device)?;
    writeln!(
        log,
        "migprof {}: {} run(s) on {} [{}], results to {}",
        provenance::VERSION,
        specs.len(),
        device_spec,
        target.device.info.name,
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
            s.precision.as_str(),
            s.batch
        )?;
        log.flush()?;
        let cell = target.cell(s)?;
        let ran = runner::run(&cell, s, &Offer::default(), &target, &args.out, Keys::Flags, log);
        match ran {
            Ok(Ran::Measured(run)) => {
                said(&run, log)?;
                completed.push(*run);
            }
            Ok(_) => bail!("{} {}: a cell of `run` ran a serving job", s.model, s.mode.as_str()),
            Err(e) => {
                writeln!(log, "failed")?;
                failed = Some((s.clone(), e));
                break;
            }
        }
    }
    Ok(Outcome { completed, failed })
}

/// A measured run's line and its warnings.
fn said(run: &Run, log: &mut dyn Write) -> Result<()> {
    match &run.generation {
        Some(g) => writeln!(
            log,
            "{} generations, time to first token p50 {:.3} ms, decode step p50 {:.3} ms, {:.1} tokens/s, {}",
            g.count(),
            g.prefill.p50_ns as f64 / 1e6,
            run.stats.p50_ns as f64 / 1e6,
            run.throughput(),
            run.assessment.verdict
        )?,
        None => writeln!(
            log,
            "{} iterations, p50 {:.3} ms, {:.1} samples/s, {}",
            run.stats.iterations,
            run.stats.p50_ns as f64 / 1e6,
            run.throughput(),
            run.assessment.verdict
        )?,
    }
    let warnings = [
        run.assessment.outlier_warning(),
        evidence_warning(run),
        run.fingerprint.pool_warning(),
    ];
    for w in warnings.into_iter().flatten() {
        writeln!(log, "warning: {w}")?;
    }
    Ok(())
}

/// Plots everything in the folder and prints the summary and where things are.
fn finish(out: &Path, report: &Outcome, stdout: &mut dyn Write) -> Result<()> {
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
        .filter(|r| r.assessment.verdict != Verdict::Ok)
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

/// What the GPU sampler saw that a user must hear about at once: another process on the device,
/// slowed clocks, unmatched pids, or a sampler that failed (then none of it was checked).
fn evidence_warning(run: &Run) -> Option<String> {
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

/// Every run of `migprof run`'s arguments, in order (as [`WorkloadGiven::workloads`] makes them),
/// once every argument is known to fit the others: a weights file for exactly one model that exists.
fn specs(args: &RunArgs) -> Result<Vec<RunSpec>> {
    let given = &args.workload;
    let models = given.models(Place::Run)?;
    if args.weights.is_some() && models.len() != 1 {
        bail!("--weights loads one checkpoint into one model: give exactly one --model");
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
        if let Some(m) = models.iter().find(|m| m.starts_with(workloads::FOLDER_PREFIX)) {
            bail!("{m} carries its own weights; --weights applies to the presets");
        }
    }
    let measuring = args.measure.resolve(&given::RUN);
    let (warmup, stop) = (warmup_rule(args), stop_rule(args, given.is_default_set()));
    let train = train_config(args, given);
    given
        .workloads(Place::Run)?
        .into_iter()
        .map(|w| {
            let BatchSize::Fixed(batch) = w.batch else {
                bail!("--batch max: the largest batch that fits is searched by a sweep; give sizes");
            };
            Ok(RunSpec {
                seq_len: w.seq_len,
                lengths: w.lengths,
                kv_layout: w.kv_layout,
                weights: args.weights.clone(),
                train,
                kernels: args.kernels.options(),
                warmup,
                stop,
                seed: measuring.seed,
                sample_interval: measuring.sample_interval(),
                ..RunSpec::new(&w.model, w.mode, w.precision, batch)
            })
        })
        .collect()
}

fn train_config(args: &RunArgs, given: &WorkloadGiven) -> TrainConfig {
    let base = match args.optimizer {
        OptimizerArg::Adamw => TrainConfig::adamw(),
        OptimizerArg::Sgd => TrainConfig::sgd(),
    };
    TrainConfig {
        lr: args.lr.unwrap_or(base.lr),
        weight_decay: args.weight_decay.unwrap_or(base.weight_decay),
        master_weights: given.master_weights(),
        ..base
    }
}

/// `--warmup` iterations exactly; else the warm-up [`given::RUN`] makes of `--warmup-secs`.
fn warmup_rule(args: &RunArgs) -> Warmup {
    match args.warmup {
        Some(n) => Warmup::Iterations(n),
        None => args.measure.resolve(&given::RUN).warmup(),
    }
}

/// The default set's precision when no stop rule is given: ±5% on the throughput within 20 s a run,
/// which the 2-core build box reaches for ResNet-18 in about a minute and a half in all.
const DEFAULT_SET_PRECISION: (f64, f64) = (5.0, 20.0);

/// `--iters` exactly; else at least `--duration` (3 s) and `--min-iters`, and with
/// `--target-precision` on until the interval is tight enough or `--max-duration` has passed. The
/// default set, given no rule, measures to [`DEFAULT_SET_PRECISION`].
fn stop_rule(args: &RunArgs, defaults_only: bool) -> Stop {
    let given = &args.measure;
    let mut measuring = given.resolve(&given::RUN);
    if defaults_only && given.duration_secs.is_none() && given.target_precision.is_none() {
        (measuring.target_precision, measuring.max_duration_secs) =
            (Some(DEFAULT_SET_PRECISION.0), DEFAULT_SET_PRECISION.1);
    }
    match args.iters {
        Some(n) => Stop::Iterations(n),
        None => measuring.stop(args.min_iters),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::{Cli, Command};
    use clap::Parser;
    use migprof::cell::CellSpec;
    use std::time::Duration;
    use workloads::kernels::KernelOptions;
    use workloads::Mode;

    fn args(line: &str) -> RunArgs {
        let argv = std::iter::once("migprof")
            .chain(std::iter::once("run"))
            .chain(line.split_whitespace());
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(a) => a,
            other => panic!("{other:?}"),
        }
    }

    fn runs(line: &str) -> Vec<RunSpec> {
        specs(&args(line)).unwrap()
    }

    #[test]
    fn the_default_set() {
        let specs = runs("");
        let got: Vec<(String, Mode, usize)> = specs.iter().map(|s| (s.model.clone(), s.mode, s.batch)).collect();
        assert_eq!(
            got,
            vec![
                ("resnet18".into(), Mode::Infer, 1),
                ("resnet18".into(), Mode::Infer, 4),
                ("resnet18".into(), Mode::Infer, 8),
                ("resnet18".into(), Mode::Train, 4),
                ("resnet18".into(), Mode::Train, 8)
            ]
        );
        assert_eq!(
            specs[0].warmup,
            Warmup::Duration {
                min: Duration::from_secs(1),
                min_iterations: 3
            }
        );
        let specs = runs("--warmup-secs 0.5");
        assert_eq!(
            specs[0].warmup,
            Warmup::Duration {
                min: Duration::from_millis(500),
                min_iterations: 1
            }
        );
        assert_eq!(
            specs[0].stop,
            Stop::Precision {
                target: 0.05,
                min: Duration::from_secs(3),
                max: Duration::from_secs(20),
                min_iterations: 10
            }
        );
        assert_eq!(
            runs("--model resnet18")[0].stop,
            Stop::Duration {
                min: Duration::from_secs(3),
                min_iterations: 10
            }
        );
    }

    #[test]
    fn lists_make_a_cross_product() {
        let specs =
            runs("--model resnet18,resnet50 --mode infer,train --batch 1,2 --dtype f32,bf16 --iters 5 --warmup 0");
        assert_eq!(specs.len(), 16);
        assert!(specs
            .iter()
            .all(|s| s.stop == Stop::Iterations(5) && s.warmup == Warmup::Iterations(0)));
        assert_eq!(specs[15].model, "resnet50");
        assert_eq!(specs[15].batch, 2);
    }

    #[test]
    fn seq_len_goes_to_token_models_only() {
        let specs = runs("--model resnet_tiny,bert_tiny --seq-len 32");
        assert_eq!(
            specs.iter().map(|s| s.seq_len).collect::<Vec<_>>(),
            vec![None, Some(32)]
        );
        assert_eq!(runs("--model bert_tiny")[0].seq_len, None, "the model's default");
    }

    #[test]
    fn optimizer_defaults_and_overrides() {
        assert_eq!(runs("")[0].train, TrainConfig::adamw());
        let t = runs("--optimizer sgd --lr 0.1")[0].train;
        assert_eq!(
            (t.optimizer, t.lr, t.weight_decay),
            (workloads::OptimizerKind::Sgd { momentum: 0.9 }, 0.1, 0.0)
        );
    }

    #[test]
    fn kernel_flags_make_the_options_every_run_records() {
        assert_eq!(runs("")[0].kernels, KernelOptions::default());
        let k =
            runs("--attention composed --encoder-layers ops --gemm-algorithm heuristic --cuda-graphs off --convs nchw")
                [0]
            .kernels;
        assert_eq!(
            k.canonical(),
            "v8;attention=composed;layers=ops;gemm=heuristic;graphs=off;convs=nchw"
        );
        let e = Cli::try_parse_from(["migprof", "run", "--attention", "flash"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flash") && e.contains("fused") && e.contains("composed"),
            "{e}"
        );
    }

    #[test]
    fn a_model_alone_runs_inference_at_batch_one() {
        let specs = runs("--model resnet50");
        assert_eq!(specs.len(), 1);
        assert_eq!((specs[0].mode, specs[0].batch), (Mode::Infer, 1));
    }

    #[test]
    fn target_precision_composes_with_duration_and_min_iters() {
        let s = runs("--target-precision 2 --duration 1 --min-iters 20 --max-duration 30")[0].stop;
        assert_eq!(
            s,
            Stop::Precision {
                target: 0.02,
                min: Duration::from_secs(1),
                max: Duration::from_secs(30),
                min_iterations: 20
            }
        );
        let s = runs("--target-precision 5%")[0].stop;
        assert_eq!(
            s,
            Stop::Precision {
                target: 0.05,
                min: Duration::from_secs(3),
                max: Duration::from_secs(60),
                min_iterations: 10
            }
        );
        let e = |line: &str| {
            Cli::try_parse_from(["migprof", "run"].into_iter().chain(line.split_whitespace()))
                .unwrap_err()
                .to_string()
        };
        assert!(e("--target-precision 0").contains("above 0 and below 100"));
        assert!(e("--target-precision 2 --iters 5").contains("cannot be used with"));
        assert!(e("--max-duration 30").contains("--target-precision"));
    }

    #[test]
    fn arguments_that_do_not_fit_each_other_are_refused_naming_the_flag() {
        let err = |line: &str| specs(&args(line)).unwrap_err().to_string();
        assert!(err("--model resnet_tiny,vit_tiny --weights w.safetensors").contains("exactly one --model"));
        assert!(err("--model resnet_tiny --weights /nonexistent.safetensors").contains("no such file"));
        assert!(err("--model resnet_tiny --seq-len 32").contains("--seq-len applies to token models"));
        assert_eq!(
            err("--batch 1,1,1"),
            "--batch names 1 more than once: give each value once"
        );
        assert_eq!(
            err("--batch 1,2,1,2,4"),
            "--batch names 1, 2 more than once: give each value once"
        );
        assert!(err("--model resnet_tiny,resnet_tiny").contains("--model names resnet_tiny more than once"));
        assert!(err("--dtype f32,f32").contains("--dtype names f32 more than once"));
    }

    #[test]
    fn encoder_layers_by_either_name_keep_the_cell_id() {
        // The id this cell has under `--encoder-layers ops`, the flag's value before it was named
        // `composed` (as of kernel options v8, whose bump changed every id).
        const PINNED: &str = "b3f59910c6add869";
        for name in ["composed", "ops"] {
            let spec = &runs(&format!(
                "--model resnet_tiny --mode train --batch 4 --encoder-layers {name}"
            ))[0];
            assert_eq!(
                CellSpec::of_run(spec, "cpu", "cpu").unwrap().cell_id(),
                PINNED,
                "{name}"
            );
        }
        let fused = &runs("--model resnet_tiny --mode train --batch 4 --encoder-layers fused")[0];
        assert_eq!(
            fused.kernels,
            runs("--model resnet_tiny --mode train --batch 4 --encoder-layers op")[0].kernels
        );
        assert_ne!(CellSpec::of_run(fused, "cpu", "cpu").unwrap().cell_id(), PINNED);
    }
}
