//! `migprof load`: its flags, the served model and the load settings they make, and the job that
//! serves the model at each rate or searches its capacity.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use clap::{Args, ValueEnum};
use migprof::cell::runner::{self, Offer, Target};
use migprof::device::DeviceSpec;
use migprof::load::arrival::Arrival;
use migprof::load::job::Rates;
use migprof::load::lengths::LengthDist;
use migprof::load::settings::{Keys, LoadGiven, ServeGiven, DEFAULTS};
use migprof::provenance;
use migprof::results::parts::Table;
use migprof::run::RunSpec;
use workloads::Mode;

use migprof::run::limits::{BLOCKS, MIN_REQUESTS, SEARCH_STEPS, SEQUENCES, TOKENS};

use super::args::{
    as_mps_client, device_or_default, parse_block_size, parse_max_batch, parse_milliseconds, parse_model,
    parse_percent, parse_rate, parse_seconds, parse_share, report_hint, DTypeArg, KernelArgs,
};

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The model served (see `migprof models`), or hf:DIR: a Hugging Face folder of a supported
    /// language model.
    #[arg(long, value_parser = parse_model)]
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
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true, value_parser = parse_rate, required_unless_present = "search")]
    pub qps: Vec<f64>,
    #[arg(long, value_enum, default_value_t = ArrivalArg::from(DEFAULTS.arrival))]
    pub arrival: ArrivalArg,
    /// The batcher's largest batch (default 32; not for language models: see --max-seqs).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_max_batch)]
    pub max_batch: Option<usize>,
    /// The longest a batch waits for more requests once its first has arrived (and the model is
    /// free), ms (default 5; not for language models, whose batcher admits between iterations).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--max-delay-ms", s, false))]
    pub max_delay_ms: Option<f64>,
    /// Seconds of measured arrivals per step (without --search); for a language model, the
    /// seconds of arrivals of every step, --warmup included (about qps × duration requests).
    #[arg(long, default_value_t = DEFAULTS.duration_secs, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--duration", s, true))]
    pub duration: f64,
    /// Seconds of arrivals at the start of each step that are served and not measured.
    #[arg(long, default_value_t = DEFAULTS.warmup_secs, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--warmup", s, false))]
    pub warmup: f64,
    /// Serve --qps rates beyond 10× the closed loop's rate (with a warning) instead of refusing them:
    /// such a step measures a queue that only grows (not for language models).
    #[arg(long)]
    pub allow_overload: bool,
    /// Seeds the arrivals, the weights and the inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The latency objective on p99, milliseconds: judges each step (meets_slo); --search needs it
    /// (not for language models: see --slo-ttft-p99-ms and --slo-tpot-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-p99-ms", s, true))]
    pub slo_p99_ms: Option<f64>,
    /// Search for the highest rate within the objective (--slo-p99-ms; for a language model both
    /// --slo-ttft-p99-ms and --slo-tpot-p99-ms): doubling or halving to a bracket, then bisection to
    /// --resolution; a step stops early once its p99 is certainly over the objective.
    #[arg(long)]
    pub search: bool,
    /// The search's resolution in percent of the rate (default 2; for a language model 10).
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    pub resolution: Option<f64>,
    /// Measured requests a search step needs before its p99's interval may decide it (default
    /// 10,000; fewer make a p99 not worth much; not for language models).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| MIN_REQUESTS.parse("--min-requests", s).map(|v| v as usize))]
    pub min_requests: Option<usize>,
    #[command(flatten)]
    pub serving: ServingArgs,
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

/// How a language model is served: its requests' lengths, the continuous batcher, the paged KV
/// cache and the two objectives (language models only).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Language models (served by a continuous batcher)")]
pub struct ServingArgs {
    /// Each request's prompt length in tokens: N, uniform:MIN-MAX or lognormal:MEAN,SPREAD (default
    /// 512).
    #[arg(long, value_name = "LEN")]
    pub prompt_len: Option<LengthDist>,
    /// Each request's output length in tokens, as --prompt-len (default 128).
    #[arg(long, value_name = "LEN")]
    pub output_len: Option<LengthDist>,
    /// Tokens one iteration processes at most, prefill pieces and decodes together (default 2048).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| TOKENS.parse("--max-batched-tokens", s).map(|v| v as u32))]
    pub max_batched_tokens: Option<u32>,
    /// Sequences running at once at most (default 256).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| SEQUENCES.parse("--max-seqs", s).map(|v| v as u32))]
    pub max_seqs: Option<u32>,
    /// Prefill each prompt in one iteration, waiting for one with room for all of it, instead of in
    /// pieces across iterations.
    #[arg(long)]
    pub no_chunked_prefill: bool,
    /// Tokens a KV block holds, 1 to 4096 (default 16).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_block_size)]
    pub kv_block_size: Option<workloads::BlockSize>,
    /// The share of the target's memory left after the weights and the workspace that the KV cache
    /// takes (default 0.9).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_share)]
    pub kv_cache_fraction: Option<f64>,
    /// The KV cache's blocks, instead of sizing it from the target's memory.
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| BLOCKS.parse("--kv-blocks", s).map(|v| v as u32))]
    pub kv_blocks: Option<u32>,
    /// Seconds a step waits after its last arrival for its requests to finish (default 30).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--drain", s, false))]
    pub drain: Option<f64>,
    /// The objective on the time to the first token's p99, ms (with --slo-tpot-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-ttft-p99-ms", s, true), requires = "slo_tpot_p99_ms")]
    pub slo_ttft_p99_ms: Option<f64>,
    /// The objective on the time per output token's p99, ms (with --slo-ttft-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-tpot-p99-ms", s, true), requires = "slo_ttft_p99_ms")]
    pub slo_tpot_p99_ms: Option<f64>,
    /// The most rates a search measures (default 8).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| SEARCH_STEPS.parse("--max-steps", s).map(|v| v as usize))]
    pub max_steps: Option<usize>,
}

impl ServingArgs {
    /// The flags given, by name.
    fn given(&self) -> Vec<&'static str> {
        [
            ("--prompt-len", self.prompt_len.is_some()),
            ("--output-len", self.output_len.is_some()),
            ("--max-batched-tokens", self.max_batched_tokens.is_some()),
            ("--max-seqs", self.max_seqs.is_some()),
            ("--no-chunked-prefill", self.no_chunked_prefill),
            ("--kv-block-size", self.kv_block_size.is_some()),
            ("--kv-cache-fraction", self.kv_cache_fraction.is_some()),
            ("--kv-blocks", self.kv_blocks.is_some()),
            ("--drain", self.drain.is_some()),
            ("--slo-ttft-p99-ms", self.slo_ttft_p99_ms.is_some()),
            ("--slo-tpot-p99-ms", self.slo_tpot_p99_ms.is_some()),
            ("--max-steps", self.max_steps.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, given)| given.then_some(name))
        .collect()
    }
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
    let (_, info) = workloads::lookup_with(&args.model, None)?;
    if info.family.is_decoder() {
        return exec_serving(args, log);
    }
    let given = args.serving.given();
    if !given.is_empty() {
        bail!(
            "{} appl{} to language models, served by a continuous batcher; {} is served one forward pass per request (see --max-batch, --max-delay-ms, --slo-p99-ms)",
            given.join(", "),
            if given.len() == 1 { "ies" } else { "y" },
            args.model
        );
    }
    if args.search && args.slo_p99_ms.is_none() {
        bail!("--search needs the objective it searches within: --slo-p99-ms");
    }
    let spec = served(&args)?;
    let settings = LoadGiven {
        arrival: Some(args.arrival.into()),
        max_batch: args.max_batch,
        max_delay_ms: args.max_delay_ms,
        warmup_secs: Some(args.warmup),
        duration_secs: Some(args.duration),
        slo_p99_ms: args.slo_p99_ms,
        resolution: args.resolution.map(|r| r / 100.0),
        min_requests: args.min_requests,
    }
    .settings(args.seed);
    let rates = rates(&args, !args.search)?;
    let target = match open_target(&args, log)? {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    let mut cell = target.cell(&spec)?;
    cell.load = Some(settings.clone());
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
    let (_, info) = workloads::lookup_with(&args.model, seq_len)?;
    if seq_len.is_some() && info.input.seq_len().is_none() {
        bail!("--seq-len applies to token models (bert_*) only, not {}", args.model);
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    let batch = args.max_batch.unwrap_or(DEFAULTS.max_batch);
    Ok(RunSpec {
        seq_len: info.input.seq_len().and(seq_len),
        weights: args.weights.clone(),
        kernels: args.kernels.options(),
        seed: args.seed,
        sample_interval: sample_interval(args),
        ..RunSpec::new(&args.model, Mode::Infer, args.dtype.into(), batch)
    })
}

/// Refuses the flags of a model served one pass per request given for a language model, naming its
/// own.
fn refuse_pass_flags(args: &LoadArgs) -> Result<()> {
    let foreign: Vec<&str> = [
        ("--seq-len", args.seq_len.is_some()),
        ("--max-batch", args.max_batch.is_some()),
        ("--max-delay-ms", args.max_delay_ms.is_some()),
        ("--slo-p99-ms", args.slo_p99_ms.is_some()),
        ("--min-requests", args.min_requests.is_some()),
        ("--allow-overload", args.allow_overload),
    ]
    .into_iter()
    .filter_map(|(name, given)| given.then_some(name))
    .collect();
    if !foreign.is_empty() {
        bail!(
            "{} appl{} to models served one forward pass per request; {} is a language model, served by a continuous batcher: its settings are --prompt-len, --output-len, --max-batched-tokens, --max-seqs, --no-chunked-prefill, --kv-block-size, --kv-cache-fraction, --kv-blocks, --drain, --slo-ttft-p99-ms, --slo-tpot-p99-ms and --max-steps",
            foreign.join(", "),
            if foreign.len() == 1 { "ies" } else { "y" },
            args.model
        );
    }
    Ok(())
}

/// `migprof load` for a language model: its requests served by a continuous batcher over a paged KV
/// cache, at each rate or searched for the highest within both objectives.
fn exec_serving(args: LoadArgs, log: &mut dyn Write) -> Result<ExitCode> {
    refuse_pass_flags(&args)?;
    let a = &args.serving;
    let settings = ServeGiven {
        prompt: a.prompt_len,
        output: a.output_len,
        max_batched_tokens: a.max_batched_tokens,
        max_seqs: a.max_seqs,
        chunked_prefill: a.no_chunked_prefill.then_some(false),
        kv_block_size: a.kv_block_size,
        kv_cache_fraction: a.kv_cache_fraction,
        kv_blocks: a.kv_blocks,
        arrival: Some(args.arrival.into()),
        warmup_secs: Some(args.warmup),
        duration_secs: Some(args.duration),
        drain_secs: a.drain,
        slo_ttft_p99_ms: a.slo_ttft_p99_ms,
        slo_tpot_p99_ms: a.slo_tpot_p99_ms,
        resolution: args.resolution.map(|r| r / 100.0),
        max_steps: a.max_steps,
    }
    .settings(args.seed);
    settings.check(args.search, migprof::load::settings::Keys::Flags)?;
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    let rates = rates(&args, true)?;
    let spec = RunSpec {
        kv_layout: workloads::KvLayout::Paged {
            block_size: settings.kv_block_size,
        },
        weights: args.weights.clone(),
        kernels: args.kernels.serving_options(),
        seed: args.seed,
        sample_interval: sample_interval(&args),
        ..RunSpec::new(
            &args.model,
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

/// How often the sampler reads the device while a job serves (`--sample-interval-ms`; 0: never).
fn sample_interval(args: &LoadArgs) -> Option<Duration> {
    (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms))
}

/// The rates a job offers: `--qps` in order, or with `--search` a search from its first value; each
/// refused when a step of `--duration` at it would offer more requests than a step may hold (where
/// `steps_last_duration`: a search of a model served one pass per request measures a number of
/// requests instead, and stops at its own ceiling).
fn rates(args: &LoadArgs, steps_last_duration: bool) -> Result<Rates> {
    for &qps in args.qps.iter().filter(|_| steps_last_duration) {
        migprof::run::limits::step_requests("--qps", qps, "--duration", args.duration).map_err(anyhow::Error::msg)?;
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
