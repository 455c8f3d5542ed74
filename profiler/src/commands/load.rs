//! `migprof load`: its flags, the served model and the load settings they make, and the job that
//! serves the model at each rate or searches its capacity.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};
use migprof::device::DeviceSpec;
use migprof::load::arrival::Arrival;
use migprof::load::job::{Job, Rates};
use migprof::load::settings::{LoadSettings, DEFAULTS};
use migprof::provenance;
use migprof::results::parts::Table;
use migprof::run::measure::{Stop, Warmup};
use migprof::run::record::{CellIdentity, Status};
use migprof::run::{RunContext, RunSpec};
use migprof::sweep::cell::CellSpec;
use workloads::{Mode, TrainConfig};

use super::args::{
    as_mps_client, device_or_default, parse_max_batch, parse_non_negative, parse_percent, parse_positive, parse_rate,
    report_hint, DTypeArg, KernelArgs,
};

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The model served (see `migprof models`).
    #[arg(long, value_parser = PossibleValuesParser::new(workloads::model_names()))]
    pub model: String,
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
    /// Tokens per sequence for token models (default 128).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub seq_len: Option<u64>,
    /// Weights from a safetensors file instead of seeded random ones.
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Offered rates in requests per second, comma-separated: one step each, in order. With
    /// --search: the first rate tried (default: half the closed loop's rate at --max-batch).
    #[arg(long, value_delimiter = ',', value_parser = parse_rate, required_unless_present = "search")]
    pub qps: Vec<f64>,
    #[arg(long, value_enum, default_value_t = ArrivalArg::from(DEFAULTS.arrival))]
    pub arrival: ArrivalArg,
    /// The batcher's largest batch.
    #[arg(long, default_value_t = DEFAULTS.max_batch, value_parser = parse_max_batch)]
    pub max_batch: usize,
    /// The longest a batch waits for more requests once its first has arrived (and the model is free).
    #[arg(long, default_value_t = DEFAULTS.max_delay_ms, value_parser = parse_non_negative)]
    pub max_delay_ms: f64,
    /// Seconds of measured arrivals per step (without --search).
    #[arg(long, default_value_t = DEFAULTS.duration_secs, value_parser = parse_positive)]
    pub duration: f64,
    /// Seconds of arrivals at the start of each step that are served and not measured.
    #[arg(long, default_value_t = DEFAULTS.warmup_secs, value_parser = parse_non_negative)]
    pub warmup: f64,
    /// Serve --qps rates beyond 10× the closed loop's rate (with a warning) instead of refusing them:
    /// such a step measures a queue that only grows.
    #[arg(long)]
    pub allow_overload: bool,
    /// Seeds the arrivals, the weights and the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The latency objective on p99, milliseconds: judges each step (meets_slo); --search needs it.
    #[arg(long, value_parser = parse_positive)]
    pub slo_p99_ms: Option<f64>,
    /// Search for the highest rate within --slo-p99-ms: doubling or halving to a bracket, then
    /// bisection to --resolution; a step stops early once its p99 is certainly over the objective.
    #[arg(long, requires = "slo_p99_ms")]
    pub search: bool,
    /// The search's resolution in percent of the rate.
    #[arg(long, value_name = "PCT", default_value_t = DEFAULTS.resolution * 100.0, value_parser = parse_percent)]
    pub resolution: f64,
    /// Measured requests a search step needs before its p99's interval may decide it (fewer than
    /// 10,000 make a p99 not worth much).
    #[arg(long, default_value_t = DEFAULTS.min_requests, value_parser = clap::value_parser!(u64).range(100..).map(|v| v as usize))]
    pub min_requests: usize,
    /// Sampler interval in milliseconds on a GPU (clocks, throttling, other processes beside each
    /// step); 0 turns it off.
    #[arg(long, default_value_t = 100)]
    pub sample_interval_ms: u64,
    /// Results folder.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,
    #[command(flatten)]
    pub kernels: KernelArgs,
}

/// The arrival process of a load step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ArrivalArg {
    /// Independent arrivals at a constant mean rate: exponential gaps, as MLPerf's Server scenario
    /// and most serving traffic.
    Poisson,
    /// Evenly spaced arrivals: no bursts, the easiest load a rate can offer.
    Constant,
}

impl From<ArrivalArg> for Arrival {
    fn from(a: ArrivalArg) -> Self {
        match a {
            ArrivalArg::Poisson => Arrival::Poisson,
            ArrivalArg::Constant => Arrival::Constant,
        }
    }
}

impl From<Arrival> for ArrivalArg {
    fn from(a: Arrival) -> Self {
        match a {
            Arrival::Poisson => ArrivalArg::Poisson,
            Arrival::Constant => ArrivalArg::Constant,
        }
    }
}

/// A search that finds no rate within the objective has still measured: its row says so, and the
/// command succeeds.
pub fn exec(args: LoadArgs, log: &mut dyn Write) -> Result<ExitCode> {
    let spec = served(&args)?;
    let settings = LoadSettings {
        arrival: args.arrival.into(),
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
    // The folder before anything else, so that a bad --out fails before any time is spent.
    migprof::files::ensure_writable_dir(&args.out)?;
    let device_spec = device_or_default(args.device.as_ref(), log)?;
    super::args::ask_recalibration(args.recalibrate);
    if let Some(code) = as_mps_client(&device_spec, log)? {
        return Ok(code);
    }
    let device = device_spec.open()?;
    migprof::run::preflight::check(std::slice::from_ref(&spec), &device)?;
    let context = RunContext::new_invocation(&device.info);
    let mut cell = CellSpec::of_run(&spec, &device.info.name, &device_spec.to_string())?;
    cell.load = Some(settings.clone());
    let identity = CellIdentity {
        sweep: None,
        ..cell.identity(Status::Ok)
    };
    writeln!(
        log,
        "migprof {}: {} {} on {} [{}], {} arrivals, batches up to {} or {} ms; rows to {}",
        provenance::VERSION,
        spec.model,
        spec.precision.as_str(),
        device_spec,
        device.info.name,
        settings.arrival.as_str(),
        settings.max_batch,
        settings.max_delay_ms,
        args.out.join(Table::Load.dir_name()).display()
    )?;
    match device.info.emulation.as_ref().map(|e| e.memory()) {
        Some(migprof::mps::MemoryEmulation::Alone) => writeln!(log, "note: an MPS-emulated slice alone: it shares L2 and memory bandwidth with the whole GPU, so it serves more than a real MIG slice would (mps-mem: gives the lower bound)")?,
        Some(migprof::mps::MemoryEmulation::Partitioned) => writeln!(log, "note: a memory-partitioned emulated slice: held to its share of the bandwidth, with less than its L2, it serves less than a real MIG slice would (mps: gives the upper bound)")?,
        None => {}
    }
    let job = Job {
        spec: &spec,
        settings: &settings,
        rates: &rates,
        allow_overload: args.allow_overload,
    };
    migprof::load::job::run(job, &device, &context, &identity, &args.out, log)?;
    writeln!(log, "{}", report_hint(&args.out))?;
    Ok(ExitCode::SUCCESS)
}

/// The model a load job serves: inference at its max batch, with the job's dtype, sequence length,
/// weights, seed and kernels.
fn served(args: &LoadArgs) -> Result<RunSpec> {
    let seq_len = args.seq_len.map(|l| l as usize);
    let (_, info) = workloads::lookup_with(&args.model, seq_len)?;
    if info.family.is_decoder() {
        bail!(
            "{} is a language model: load serves one forward pass per request, and a generation is measured with `migprof run --mode generate`",
            args.model
        );
    }
    if seq_len.is_some() && info.input.seq_len().is_none() {
        bail!("--seq-len applies to token models (bert_*) only, not {}", args.model);
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    Ok(RunSpec {
        model: args.model.clone(),
        mode: Mode::Infer,
        precision: args.dtype.into(),
        batch: args.max_batch,
        seq_len: info.input.seq_len().and(seq_len),
        lengths: None,
        kv_layout: workloads::KvLayout::default(),
        weights: args.weights.clone(),
        train: TrainConfig::default(),
        kernels: args.kernels.options(),
        warmup: Warmup::Iterations(0),
        stop: Stop::Iterations(1),
        seed: args.seed,
        sample_interval: (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms)),
        probe: false,
    })
}
