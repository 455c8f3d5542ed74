//! `migprof load`: its flags, the served model and the load settings they make, and the job that
//! serves the model at each rate or searches its capacity.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use clap::Args;
use migprof::cell::runner::{self, Offer, Target};
use migprof::device::DeviceSpec;
use migprof::load::given::{given_keys, Offered, PassGiven, ServeGiven};
use migprof::load::job::Rates;
use migprof::load::settings::{Keys, LoadSettings, ServeSettings, DEFAULTS};
use migprof::provenance;
use migprof::results::parts::Table;
use migprof::run::RunSpec;
use workloads::Mode;

use migprof::run::limits::TOKENS;

use super::args::{as_mps_client, device_or_default, parse_model, parse_rate, report_hint, DTypeArg, KernelGiven};

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The model served by migprof's engine (see `migprof models`), or hf:DIR: a Hugging Face folder
    /// of a supported language model. A server of your own: --endpoint instead.
    #[arg(long, value_parser = parse_model, required_unless_present = "endpoint", conflicts_with = "endpoint")]
    pub model: Option<String>,
    /// As `migprof run --device`: cpu, cuda, an index, GPU-/MIG-<uuid>, a MIG profile, mps:<profile>,
    /// mps-mem:<profile>.
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// Calibrate the memory-system neighbour of memory-partitioned slices (mps-mem:) afresh instead
    /// of using the setting cached for this GPU, driver and profile.
    #[arg(long)]
    pub recalibrate: bool,
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    /// Tokens per sequence for token models (default 128; not for language models, whose requests'
    /// lengths --prompt-len and --output-len give).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| TOKENS.parse("--seq-len", s))]
    pub seq_len: Option<u64>,
    /// Weights from a safetensors file instead of seeded random ones.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Offered rates in requests per second, comma-separated: one step each, in order. With
    /// --search: the first rate tried (default: half the closed loop's rate at --max-batch; for a
    /// language model, the rate of 16 requests of the mean lengths at once).
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = parse_rate, required_unless_present_any = ["search", "endpoint"])]
    pub qps: Vec<f64>,
    #[command(flatten)]
    pub offered: Offered,
    /// Serve --qps rates beyond 10× the closed loop's rate (with a warning) instead of refusing them:
    /// such a step measures a queue that only grows (not for language models).
    #[arg(long)]
    pub allow_overload: bool,
    /// Seeds the arrivals, the weights and the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Search for the highest rate within the objective (--slo-p99-ms; for a language model both
    /// --slo-ttft-p99-ms and --slo-tpot-p99-ms): doubling or halving to a bracket, then bisection to
    /// --resolution; a step stops early once its p99 is certainly over the objective.
    #[arg(long)]
    pub search: bool,
    #[command(flatten)]
    pub pass: PassGiven,
    /// Sampler interval in milliseconds on a GPU (clocks, throttling, other processes beside each
    /// step); 0 turns it off.
    #[arg(long, default_value_t = 100)]
    pub sample_interval_ms: u64,
    /// Results folder.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,
    #[command(flatten)]
    pub serving: ServeGiven,
    #[command(flatten)]
    pub kernels: KernelGiven,
    #[command(flatten)]
    pub server: Box<migprof::server::given::ServerGiven>,
}

/// The model migprof's engine serves (`--model`, which clap requires without `--endpoint`).
fn model(args: &LoadArgs) -> &str {
    args.model.as_deref().unwrap_or_default()
}

/// A search that finds no rate within the objective has still measured: its row says so, and the
/// command succeeds.
pub fn exec(args: LoadArgs, log: &mut dyn Write) -> Result<ExitCode> {
    if args.server.endpoint.is_some() {
        refuse_engine_flags(&args)?;
        let asked = super::server::Asked {
            offered: &args.offered,
            pass: &args.pass,
            serving: &args.serving,
            qps: &args.qps,
            search: args.search,
            seed: args.seed,
            device: args.device.as_ref(),
            sample_interval_ms: args.sample_interval_ms,
            out: &args.out,
        };
        return super::server::exec(&args.server, asked, log);
    }
    let (_, info) = workloads::lookup_with(model(&args), None)?;
    if info.family.is_decoder() {
        return exec_serving(args, log);
    }
    let given = flags(&given_keys(&args.serving));
    if !given.is_empty() {
        bail!(
            "{} appl{} to language models, served by a continuous batcher; {} is served one forward pass per request (see --max-batch, --max-delay-ms, --slo-p99-ms)",
            given.join(", "),
            if given.len() == 1 { "ies" } else { "y" },
            model(&args)
        );
    }
    if args.search && args.pass.slo_p99_ms.is_none() {
        bail!("--search needs the objective it searches within: --slo-p99-ms");
    }
    let spec = served(&args)?;
    let settings = LoadSettings::given(&args.offered, &args.pass, args.seed);
    settings.check(Keys::Flags)?;
    let rates = rates(&args, settings.duration_secs, !args.search)?;
    let target = match open_target(&args, log)? {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    let mut cell = target.cell(&spec)?;
    cell.job = migprof::cell::Job::Load(settings.clone());
    let how = format!(
        "{} arrivals, batches up to {} or {} ms",
        settings.arrival.as_str(),
        settings.max_batch,
        settings.max_delay_ms
    );
    announce(&target, &spec, &how, &args.out.join(Table::Load.dir_name()), "", log)?;
    let offer = Offer {
        rates,
        allow_overload: args.allow_overload,
    };
    runner::run(&cell, &spec, &offer, &target, &args.out, Keys::Flags, log)?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(ExitCode::SUCCESS)
}

/// The model a load job serves: inference at its max batch, with the job's dtype, sequence length,
/// weights, seed and kernels.
fn served(args: &LoadArgs) -> Result<RunSpec> {
    let seq_len = args.seq_len.map(|l| l as usize);
    let (_, info) = workloads::lookup_with(model(args), seq_len)?;
    if seq_len.is_some() && info.input.seq_len().is_none() {
        bail!("--seq-len applies to token models (bert_*) only, not {}", model(args));
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    let batch = args.pass.max_batch.unwrap_or(DEFAULTS.max_batch);
    Ok(RunSpec {
        seq_len: info.input.seq_len().and(seq_len),
        weights: args.weights.clone(),
        kernels: args.kernels.options(),
        seed: args.seed,
        sample_interval: sample_interval(args),
        ..RunSpec::new(model(args), Mode::Infer, args.dtype.into(), batch)
    })
}

/// Refuses the flags of a model served one pass per request given for a language model, naming its
/// own.
fn refuse_pass_flags(args: &LoadArgs) -> Result<()> {
    let mut foreign = flags(&given_keys(&args.pass));
    if args.seq_len.is_some() {
        foreign.insert(0, "--seq-len".to_string());
    }
    if args.allow_overload {
        foreign.push("--allow-overload".to_string());
    }
    if !foreign.is_empty() {
        bail!(
            "{} appl{} to models served one forward pass per request; {} is a language model, served by a continuous batcher: its settings are --prompt-len, --output-len, --max-batched-tokens, --max-seqs, --no-chunked-prefill, --kv-block-size, --kv-cache-fraction, --kv-blocks, --drain, --slo-ttft-p99-ms, --slo-tpot-p99-ms and --max-steps",
            foreign.join(", "),
            if foreign.len() == 1 { "ies" } else { "y" },
            model(args)
        );
    }
    Ok(())
}

/// `migprof load` for a language model: its requests served by a continuous batcher over a paged KV
/// cache, at each rate or searched for the highest within both objectives.
fn exec_serving(args: LoadArgs, log: &mut dyn Write) -> Result<ExitCode> {
    refuse_pass_flags(&args)?;
    let settings = ServeSettings::given(&args.offered, &args.serving, args.seed);
    settings.check(args.search, Keys::Flags)?;
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    let rates = rates(&args, settings.duration_secs, true)?;
    let spec = RunSpec {
        kv_layout: workloads::KvLayout::Paged {
            block_size: settings.kv_block_size,
        },
        weights: args.weights.clone(),
        kernels: args.kernels.serving_options(),
        seed: args.seed,
        sample_interval: sample_interval(&args),
        ..RunSpec::new(
            model(&args),
            Mode::Generate,
            args.dtype.into(),
            settings.max_seqs as usize,
        )
    };
    let target = match open_target(&args, log)? {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    let mut cell = target.cell(&spec)?;
    cell.serve_with(settings.clone());
    let how = format!(
        "{} arrivals, prompts {} and outputs {} tokens, iterations of up to {} tokens and {} sequences",
        settings.arrival.as_str(),
        settings.prompt,
        settings.output,
        settings.max_batched_tokens,
        settings.max_seqs
    );
    let rows = args.out.join(Table::Serve.dir_name());
    announce(&target, &spec, &how, &rows, "; energy is the whole GPU's", log)?;
    let offer = Offer {
        rates,
        allow_overload: false,
    };
    runner::run(&cell, &spec, &offer, &target, &args.out, Keys::Flags, log)?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(ExitCode::SUCCESS)
}

/// The flags of settings given, by their keys.
fn flags(keys: &[String]) -> Vec<String> {
    keys.iter().map(|k| Keys::Flags.name(k)).collect()
}

/// How often the sampler reads the device while a job serves (`--sample-interval-ms`; 0: never).
fn sample_interval(args: &LoadArgs) -> Option<Duration> {
    (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms))
}

/// The rates a job offers: `--qps` in order, or with `--search` a search from its first value; each
/// refused when a step of `--duration` at it would offer more requests than a step may hold (where
/// `steps_last_duration`: a search of a model served one pass per request measures a number of
/// requests instead, and stops at its own ceiling).
fn rates(args: &LoadArgs, duration_secs: f64, steps_last_duration: bool) -> Result<Rates> {
    for &qps in args.qps.iter().filter(|_| steps_last_duration) {
        migprof::run::limits::step_requests("--qps", qps, "--duration", duration_secs).map_err(anyhow::Error::msg)?;
    }
    Ok(match args.search {
        true => Rates::Search {
            start: args.qps.first().copied(),
        },
        false => Rates::Fixed(args.qps.clone()),
    })
}

/// The job's first lines: what is served where and `how`, where the rows go, and on an emulated
/// slice which bound its figures are (with `on_slices` said of them).
fn announce(
    target: &Target,
    spec: &RunSpec,
    how: &str,
    rows: &std::path::Path,
    on_slices: &str,
    log: &mut dyn Write,
) -> Result<()> {
    writeln!(
        log,
        "migprof {}: {} {} on {} [{}], {how}; rows to {}",
        provenance::VERSION,
        spec.model,
        spec.precision.as_str(),
        target.written,
        target.device.info.name,
        rows.display()
    )?;
    match target.device.info.emulation.as_ref().map(|e| e.memory()) {
        Some(migprof::mps::MemoryEmulation::Alone) => writeln!(log, "note: an MPS-emulated slice alone: it shares L2 and memory bandwidth with the whole GPU, so it serves more than a real MIG slice would (mps-mem: gives the lower bound){on_slices}")?,
        Some(migprof::mps::MemoryEmulation::Partitioned) => writeln!(log, "note: a memory-partitioned emulated slice: held to its share of the bandwidth, with less than its L2, it serves less than a real MIG slice would (mps: gives the upper bound){on_slices}")?,
        None => {}
    }
    Ok(())
}

/// The job's target, opened after its results folder is known to be writable; or the exit code of
/// the MPS client this process re-ran itself as, which did the job.
fn open_target(args: &LoadArgs, log: &mut dyn Write) -> Result<std::result::Result<Target, ExitCode>> {
    // The folder before anything else, so that a bad --out fails before any time is spent.
    migprof::files::ensure_writable_dir(&args.out)?;
    let spec = device_or_default(args.device.as_ref(), log)?;
    super::args::ask_recalibration(args.recalibrate);
    if let Some(code) = as_mps_client(&spec, log)? {
        return Ok(Err(code));
    }
    Ok(Ok(Target::open(&spec)?))
}

/// Flags of migprof's own engine that a server cannot take, named.
fn refuse_engine_flags(args: &LoadArgs) -> Result<()> {
    let mut foreign: Vec<&str> = Vec::new();
    if args.weights.is_some() {
        foreign.push("--weights");
    }
    if args.seq_len.is_some() {
        foreign.push("--seq-len (give the shape: --shape NAME:DIMS)");
    }
    if args.kernels != migprof::run::given::KernelGiven::default() {
        foreign.push("the kernel options");
    }
    if args.allow_overload {
        foreign.push("--allow-overload");
    }
    if !foreign.is_empty() {
        bail!(
            "{} appl{} to migprof's own engine, not to a server of your own (--endpoint)",
            foreign.join(", "),
            if foreign.len() == 1 { "ies" } else { "y" }
        );
    }
    Ok(())
}
