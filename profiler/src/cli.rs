//! The command line: what each flag means, how values are checked, and the defaults of `run`.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use workloads::kernels::options::{Attention, Convolutions, CudaGraphs, EncoderLayers, GemmAlgorithm};
use workloads::kernels::KernelOptions;
use workloads::Mode;

use crate::device::DeviceSpec;

#[derive(Debug, Parser)]
#[command(
    name = "migprof",
    version,
    about = "Profile deep-learning workloads on NVIDIA GPUs, MIG slices and CPUs"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Measure models: one run per model x mode x dtype x batch size. With no flags, a default set
    /// that takes about two minutes on a 2-core CPU.
    Run(RunArgs),
    /// Serve a model under open-loop load: requests arrive on a seeded schedule (Poisson or constant)
    /// whatever the model does, wait for a dynamic batcher, and each is timed from its scheduled
    /// arrival to its batch's completion. One step per --qps; with --search, the highest rate whose
    /// p99 stays within --slo-p99-ms (the target's capacity). Rows in the load and capacity tables.
    Load(LoadArgs),
    /// Plan a fleet for a target load: per model and MIG profile the capacity (measured by `load
    /// --search`, or from a CSV), then the fewest GPUs, with their MIG layouts, that serve every
    /// demand within the objective, solved exactly as an integer program; beside it the plans made by
    /// hand (a whole GPU per model, one profile per model).
    Capacity(CapacityArgs),
    /// Run a sweep file: a matrix of cells over targets (devices), each cell in a child process of its
    /// own, a row for every cell however it ends; a rerun runs only the cells not done.
    Sweep(SweepArgs),
    /// Run one cell of a sweep from its spec (what `sweep` starts as a child process).
    #[command(hide = true)]
    Cell {
        /// The cell spec (JSON, see `sweep::cell::CellSpec`).
        #[arg(long)]
        spec: PathBuf,
        /// The results folder to write the cell's row to.
        #[arg(long)]
        out: PathBuf,
        /// The sweep invocation this cell belongs to.
        #[arg(long)]
        invocation: Option<String>,
    },
    /// Write the row of a cell whose `migprof cell` failed on a cluster, as a local sweep would
    /// (what a Slurm task or a Kubernetes pod runs after a failed cell).
    #[command(hide = true)]
    CellEnded {
        #[arg(long)]
        spec: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        invocation: String,
        #[arg(long, allow_negative_numbers = true)]
        exit_code: i32,
        /// The cell's output, for the error's text.
        #[arg(long)]
        log: Option<PathBuf>,
    },
    /// Merge results folders (from several machines or clusters) into one: every part once (the
    /// same run in two folders is copied once), and cells measured in more than one folder named.
    Merge {
        /// Results folders to merge.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// The merged folder (created; parts already there stay).
        #[arg(long)]
        out: PathBuf,
    },
    /// Check every part of a results folder: each file readable and migprof's, one row per run, a
    /// sample per measured iteration; every problem named with its file.
    Check {
        /// The results folder.
        dir: PathBuf,
    },
    /// Compare two groups of runs in a results folder cell by cell: the full GPU against a 3g slice
    /// (--baseline target=full --target target=3g), one MIG profile against another, f32 against
    /// bf16. Each matched cell: both throughputs, p50 and p99, the ratio with its 95% interval, and
    /// whether the difference is beyond the runs' own noise.
    Compare {
        /// The results folder.
        dir: PathBuf,
        /// The runs to compare against: column=value over the runs table.
        #[arg(long)]
        baseline: crate::results::compare::Selector,
        /// The runs compared: column=value over the same column.
        #[arg(long)]
        target: crate::results::compare::Selector,
        #[arg(long, value_enum, default_value = "text")]
        format: crate::results::compare::Format,
    },
    /// Write the report of one or more results folders: a self-contained HTML page (inline SVG, no
    /// script, no network) or Markdown with its SVGs in a folder beside it.
    Report {
        /// Results folders.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where to write it; default report.html (report.md) in the first folder.
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "html")]
        format: crate::report::Format,
        /// The batch whose runs' latency distributions and time series are drawn; default: each
        /// target's largest.
        #[arg(long)]
        detail_batch: Option<usize>,
    },
    /// List the models with their parameter counts and FLOPs per sample.
    Models,
    /// List the NVIDIA GPUs and their MIG devices (profile, GPU/compute instance ids, SMs, memory,
    /// UUID), as NVML reports them.
    Devices {
        /// Print the topology as JSON (the format MIGPROF_TOPOLOGY replays).
        #[arg(long)]
        json: bool,
    },
    /// List MIG GPU-instance profiles with their placements, like `nvidia-smi mig -lgip` and `-lgipp`:
    /// of a known GPU (--gpu) or, without it, of this machine's GPU as NVML reports them.
    Profiles(TableArgs),
    /// Check whether a set of MIG GPU instances fits a GPU and where each goes, or list every maximal
    /// layout.
    Plan {
        #[command(flatten)]
        table: TableArgs,
        /// GPU-instance profiles, comma-separated (e.g. 3g.40gb,2g.20gb,1g.10gb,1g.10gb).
        #[arg(value_delimiter = ',', required_unless_present = "list")]
        profiles: Vec<String>,
        /// List every valid layout to which no instance can be added.
        #[arg(long, conflicts_with = "profiles")]
        list: bool,
    },
    /// Apply, destroy or export MIG layouts (mig-parted's file format). Dry runs unless --yes.
    #[command(subcommand)]
    Mig(MigCommand),
}

#[derive(Debug, Subcommand)]
pub enum MigCommand {
    /// Bring the GPUs a layout file names to its layout: print each action and the nvidia-smi command
    /// that does the same; act only with --yes, as root, on idle GPUs; read NVML back afterwards and
    /// fail unless the layout is there.
    Apply {
        /// A mig-parted file (`version: v1`, `mig-configs: ...`).
        file: PathBuf,
        /// Which of the file's configs; may be left out when it has one.
        #[arg(long, short = 'c')]
        config: Option<String>,
        #[command(flatten)]
        act: ActArgs,
        /// Allow turning MIG mode on. It may only take effect after a GPU reset, which migprof never
        /// does: it prints the command instead.
        #[arg(long)]
        enable_mig: bool,
        /// Allow turning MIG mode off (for a config with `mig-enabled: false`).
        #[arg(long)]
        disable_mig: bool,
    },
    /// Destroy every compute and GPU instance of the GPUs given (default: every GPU with MIG on).
    /// MIG mode stays as it is.
    Destroy {
        /// GPU indices, comma-separated.
        #[arg(long, value_delimiter = ',')]
        gpu: Vec<u32>,
        #[command(flatten)]
        act: ActArgs,
    },
    /// Write the current MIG layout as a mig-parted file (to stdout, or --out).
    Export {
        /// The file to write.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The name of the config in the file.
        #[arg(long, default_value = "current")]
        name: String,
    },
}

#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// The sweep file (TOML): name, [defaults], [[targets]], [[matrix]]; see the README.
    pub file: PathBuf,
    /// Results folder.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,
    /// List the cells with their ids, whether each is done, and an estimate of the time; run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Run every cell, also those with a row already.
    #[arg(long)]
    pub force: bool,
    /// Run again the cells whose row says `oom`.
    #[arg(long)]
    pub retry_oom: bool,
    /// Only the cells that match every key=value, comma-separated (keys: target, device, model, mode,
    /// dtype, batch, seq_len, repeat), e.g. --only model=resnet50,target=3g.
    #[arg(long, default_value = "")]
    pub only: crate::sweep::plan::Filter,
    /// Cells at once, never two on one device.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: u64,
    /// Where cells run: here (`local`), as Slurm job arrays (`slurm`), or as Kubernetes indexed Jobs
    /// (`k8s`, with --emit). Cluster targets name what to ask for: a MIG profile, `cuda` or `cpu`.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: Backend,
    /// Slurm: submit the job arrays with sbatch (without it they are written, not submitted); a rerun
    /// submits only the cells neither done nor queued.
    #[arg(long, conflicts_with = "status")]
    pub submit: bool,
    /// Slurm: which cells are done, queued, running, failed or missing, from the folder, squeue and
    /// the tasks' exit markers.
    #[arg(long)]
    pub status: bool,
    #[arg(long, help_heading = "Cluster backends")]
    pub partition: Option<String>,
    #[arg(long, help_heading = "Cluster backends")]
    pub account: Option<String>,
    /// Slurm `--gres` of a MIG target; `{profile}` is replaced by its profile.
    #[arg(long, default_value = "gpu:{profile}:1", help_heading = "Cluster backends")]
    pub gres_template: String,
    /// Slurm `--gres` of a whole-GPU target.
    #[arg(long, default_value = "gpu:1", help_heading = "Cluster backends")]
    pub gpu_gres: String,
    /// One cell per node at a time (Slurm `--exclusive`; a pod anti-affinity on Kubernetes).
    #[arg(long, help_heading = "Cluster backends")]
    pub one_per_node: bool,
    /// Kubernetes: the folder to write the manifests to.
    #[arg(long, help_heading = "Cluster backends")]
    pub emit: Option<PathBuf>,
    /// Kubernetes: the migprof image (scripts/Containerfile).
    #[arg(long, default_value = "migprof:latest", help_heading = "Cluster backends")]
    pub image: String,
    #[arg(long, default_value = "default", help_heading = "Cluster backends")]
    pub namespace: String,
    /// Kubernetes: the PersistentVolumeClaim every pod writes its results to.
    #[arg(long, default_value = "migprof-results", help_heading = "Cluster backends")]
    pub results_pvc: String,
    /// Kubernetes: how the device plugin exposes MIG slices.
    #[arg(long, value_enum, default_value = "mixed", help_heading = "Cluster backends")]
    pub mig_strategy: crate::fleet::k8s::MigStrategy,
}

/// Where a sweep's cells run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Local,
    Slurm,
    K8s,
}

#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// The model served (see `migprof models`).
    #[arg(long, value_parser = PossibleValuesParser::new(workloads::model_names()))]
    pub model: String,
    /// As `migprof run --device`: cpu, cuda, an index, GPU-/MIG-<uuid>, a MIG profile, mps:<profile>.
    #[arg(long)]
    pub device: Option<DeviceSpec>,
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
    #[arg(long, value_enum, default_value_t = crate::load::record::DEFAULTS.arrival)]
    pub arrival: crate::load::arrival::Arrival,
    /// The batcher's largest batch.
    #[arg(long, default_value_t = crate::load::record::DEFAULTS.max_batch, value_parser = parse_max_batch)]
    pub max_batch: usize,
    /// The longest a batch waits for more requests once its first has arrived (and the model is free).
    #[arg(long, default_value_t = crate::load::record::DEFAULTS.max_delay_ms, value_parser = parse_non_negative)]
    pub max_delay_ms: f64,
    /// Seconds of measured arrivals per step (without --search).
    #[arg(long, default_value_t = crate::load::record::DEFAULTS.duration_secs, value_parser = parse_positive)]
    pub duration: f64,
    /// Seconds of arrivals at the start of each step that are served and not measured.
    #[arg(long, default_value_t = crate::load::record::DEFAULTS.warmup_secs, value_parser = parse_non_negative)]
    pub warmup: f64,
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
    #[arg(long, value_name = "PCT", default_value_t = crate::load::record::DEFAULTS.resolution * 100.0, value_parser = parse_percent)]
    pub resolution: f64,
    /// Measured requests a search step needs before its p99's interval may decide it (fewer than
    /// 10,000 make a p99 not worth much).
    #[arg(long, default_value_t = crate::load::record::DEFAULTS.min_requests, value_parser = clap::value_parser!(u64).range(100..).map(|v| v as usize))]
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

#[derive(Debug, Clone, Args)]
pub struct CapacityArgs {
    /// The GPU to plan for, by its checked-in MIG profile table (a100-40gb, a100-80gb, a30-24gb,
    /// h100-80gb, h200-141gb).
    #[arg(long)]
    pub gpu: String,
    /// The load to serve: model=requests/s, comma-separated (resnet50=20000,bert_base=3000).
    #[arg(long, value_delimiter = ',', required = true, value_parser = crate::capacity::parse_demand)]
    pub demand: Vec<(String, f64)>,
    /// The p99 objective the capacities were measured for, milliseconds.
    #[arg(long, value_parser = parse_positive)]
    pub slo_p99_ms: f64,
    /// Results folders with `load --search` capacities (the capacity table).
    #[arg(long = "from", conflicts_with = "capacities")]
    pub from: Vec<PathBuf>,
    /// A CSV with the columns model,profile,qps instead of measured capacities.
    #[arg(long)]
    pub capacities: Option<PathBuf>,
    /// Only capacities measured at this dtype (needed when a folder holds several).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,
    /// Also estimate capacities from closed-loop runs where no search measured one (labelled: the
    /// highest throughput of a batch whose p99, doubled for the wait in the queue, is within the
    /// objective).
    #[arg(long)]
    pub closed_loop_estimates: bool,
    /// Plan each instance to at most this share of its capacity.
    #[arg(long, default_value_t = 0.8, value_parser = parse_share)]
    pub headroom: f64,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the plan's layouts as a mig-parted file (one named config per distinct layout) for
    /// `migprof mig apply` or the GPU operator.
    #[arg(long)]
    pub emit_layouts: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, Args)]
pub struct ActArgs {
    /// Carry the plan out (as root); without it, print the plan only.
    #[arg(long)]
    pub yes: bool,
}

#[derive(Debug, Clone, Args)]
pub struct TableArgs {
    /// A GPU with a checked-in profile table (a100-40gb, a100-80gb, a30-24gb, h100-80gb, h200-141gb);
    /// default: this machine's GPU.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Which of this machine's GPUs, when --gpu is not given.
    #[arg(long, default_value_t = 0, conflicts_with = "gpu")]
    pub index: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    Infer,
    Train,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Infer => Mode::Infer,
            ModeArg::Train => Mode::Train,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// AdamW, PyTorch's defaults: lr 1e-3, weight decay 0.01.
    Adamw,
    /// SGD with momentum 0.9: lr 0.01, no weight decay.
    Sgd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    F16,
    /// f32 weights and activations; f32 matmuls and convolutions may run on TF32 tensor cores
    /// (10-bit mantissa inputs, f32 accumulation), as PyTorch's convolutions do by default
    /// (`torch.backends.cudnn.allow_tf32`). GPU only.
    Tf32,
}

impl From<DTypeArg> for candle_core::DType {
    fn from(d: DTypeArg) -> Self {
        match d {
            DTypeArg::F32 => candle_core::DType::F32,
            DTypeArg::Bf16 => candle_core::DType::BF16,
            DTypeArg::F16 => candle_core::DType::F16,
            DTypeArg::Tf32 => candle_core::DType::F32,
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Models to run, comma-separated (see `migprof models`).
    #[arg(long, value_delimiter = ',', value_parser = PossibleValuesParser::new(workloads::model_names()))]
    pub model: Vec<String>,

    /// infer (forward only, no gradients) or train (forward, cross-entropy, backward, AdamW), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub mode: Vec<ModeArg>,

    /// Batch sizes, comma-separated: one run per value.
    #[arg(long, value_delimiter = ',', value_parser = parse_batch)]
    pub batch: Vec<usize>,

    /// Tokens per sequence for token models (BERT); default 128. Image models ignore it.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub seq_len: Option<u64>,

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

    /// Element types, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub dtype: Vec<DTypeArg>,

    /// cpu, cuda (the first GPU), a GPU index (nvidia-smi's), GPU-<uuid>, MIG-<uuid> or a MIG profile
    /// name such as 3g.40gb (when exactly one MIG device has it); migprof pins
    /// itself to it with CUDA_VISIBLE_DEVICES. mps:<profile> or mps:<percent>% emulates a slice as an
    /// MPS client of migprof's own daemon on a GPU with MIG off (mps:3g.40gb@1 on GPU 1). Default:
    /// the first GPU in a CUDA build that finds one, else cpu.
    #[arg(long)]
    pub device: Option<DeviceSpec>,

    /// Warm-up iterations before measuring.
    #[arg(long, conflicts_with = "warmup_secs")]
    pub warmup: Option<u64>,

    /// Warm-up time in seconds (at least one iteration). Default: 1 s and at least 3 iterations.
    #[arg(long, value_parser = parse_non_negative)]
    pub warmup_secs: Option<f64>,

    /// Measure exactly this many iterations.
    #[arg(long, conflicts_with = "duration", value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: Option<u64>,

    /// Measure for at least this many seconds (and at least --min-iters iterations). Default: 3.
    #[arg(long, value_parser = parse_non_negative)]
    pub duration: Option<f64>,

    /// With --duration: the fewest iterations to measure however long they take.
    #[arg(long, default_value_t = 10, conflicts_with = "iters")]
    pub min_iters: u64,

    /// Measure until the throughput's 95% interval is within ±PCT percent of it (after --duration and
    /// --min-iters), at most --max-duration seconds; a run stopped by that bound says so in its
    /// verdict_reason.
    #[arg(long, value_name = "PCT", conflicts_with = "iters", value_parser = parse_percent)]
    pub target_precision: Option<f64>,

    /// With --target-precision: the most seconds to measure however wide the interval still is.
    #[arg(long, default_value_t = 60.0, requires = "target_precision", value_parser = parse_non_negative)]
    pub max_duration: f64,

    /// Sampler interval in milliseconds for GPU runs (NVML and GPM counters while measuring); 0 turns
    /// the sampler off.
    #[arg(long, default_value_t = 100)]
    pub sample_interval_ms: u64,

    /// Results folder: Parquet tables under runs/ and samples/, SVG plots beside them.
    #[arg(long, default_value = "data/results")]
    pub out: PathBuf,

    /// Seeds the weights and the synthetic inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    #[command(flatten)]
    pub kernels: KernelArgs,
}

/// Kernel choices for experts comparing kernels (shown by --help, not -h). Each is part of what a run
/// measures: every row records them as `kernel_options`.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Kernel options (recorded in every row as kernel_options)")]
pub struct KernelArgs {
    /// Attention's forward on a GPU: one fused kernel where the shape allows, or products, softmax and
    /// head moves as separate kernels.
    #[arg(long, default_value = "fused", hide_short_help = true, value_parser = choice::<Attention>(Attention::NAMES))]
    pub attention: Attention,

    /// ViT and BERT encoder layers, Swin blocks and ResNet's residual blocks, in training on a GPU:
    /// one op each with a hand-written backward, or their ops each as an edge of the gradient graph.
    #[arg(long, default_value = "op", hide_short_help = true, value_parser = choice::<EncoderLayers>(EncoderLayers::NAMES))]
    pub encoder_layers: EncoderLayers,

    /// cuBLASLt's algorithm per product shape: the fastest of its candidates, timed on first use, or
    /// its heuristic's first guess (what PyTorch launches).
    #[arg(long, default_value = "timed", hide_short_help = true, value_parser = choice::<GemmAlgorithm>(GemmAlgorithm::NAMES))]
    pub gemm_algorithm: GemmAlgorithm,

    /// Steps on a GPU replayed as CUDA graphs: each shape's second step captured, every later one
    /// replayed with one launch (as torch.compile's "reduce-overhead" does), so that small batches
    /// measure the GPU and not the host's kernel launches. on: inference and training steps; infer:
    /// inference steps only; off: every kernel launched at every step.
    #[arg(long, default_value = "on", hide_short_help = true, value_parser = choice::<CudaGraphs>(CudaGraphs::NAMES))]
    pub cuda_graphs: CudaGraphs,

    /// ResNet's convolutions on a GPU in half types or TF32: nhwc, on cuDNN's current engines (as
    /// PyTorch's channels_last reaches), in inference each with its batch norm, residual add and ReLU
    /// fused, in training with batch norm over NHWC; or nchw, on cuDNN's legacy calls.
    #[arg(long, default_value = "nhwc", hide_short_help = true, value_parser = choice::<Convolutions>(Convolutions::NAMES))]
    pub convs: Convolutions,
}

impl KernelArgs {
    pub fn options(&self) -> KernelOptions {
        KernelOptions {
            attention: self.attention,
            layers: self.encoder_layers,
            gemm: self.gemm_algorithm,
            graphs: self.cuda_graphs,
            convs: self.convs,
        }
    }
}

/// A parser that accepts exactly `names` (clap lists them in the help and in its errors) and parses the
/// one given.
fn choice<T>(names: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    PossibleValuesParser::new(names).map(|name| name.parse::<T>().expect("clap accepted a listed name"))
}

fn parse_batch(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(b) if b > 0 => Ok(b),
        _ => Err(format!(
            "batch sizes are positive integers, comma-separated (e.g. --batch 1,8,32); got `{s}`"
        )),
    }
}

fn parse_max_batch(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(b) if b > 0 => Ok(b),
        _ => Err(format!(
            "the batcher's largest batch is one positive integer (e.g. --max-batch 32); got `{s}`"
        )),
    }
}

/// A precision in percent: above 0, below 100.
fn parse_percent(s: &str) -> Result<f64, String> {
    match s.trim().trim_end_matches('%').parse::<f64>() {
        Ok(v) if v > 0.0 && v < 100.0 => Ok(v),
        _ => Err(format!(
            "expected a percentage above 0 and below 100 (e.g. 2 for ±2%); got `{s}`"
        )),
    }
}

/// A rate in requests per second: finite, above zero.
fn parse_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "rates are requests per second above zero, comma-separated (e.g. --qps 100,200,400); got `{s}`"
        )),
    }
}

/// A finite number above zero: milliseconds, seconds.
fn parse_positive(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("expected a number above zero (e.g. 50 or 2.5); got `{s}`")),
    }
}

/// A share above 0 and at most 1.
fn parse_share(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!("expected a share above 0 and at most 1 (e.g. 0.8); got `{s}`")),
    }
}

/// A finite, non-negative number: seconds, a learning rate, a weight decay.
fn parse_non_negative(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!("expected a non-negative number (e.g. 2.5 or 1e-3); got `{s}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_valid_choices() {
        let err = |line: &str| {
            let argv = ["migprof", "run"].into_iter().chain(line.split_whitespace());
            Cli::try_parse_from(argv).unwrap_err().to_string()
        };
        let e = err("--model resnet19");
        assert!(
            e.contains("resnet19") && e.contains("resnet18") && e.contains("resnet152"),
            "{e}"
        );
        let e = err("--batch 1,0");
        assert!(e.contains("positive integers"), "{e}");
        let e = err("--batch eight");
        assert!(e.contains("`eight`"), "{e}");
        let e = err("--mode eval");
        assert!(e.contains("infer") && e.contains("train"), "{e}");
        let e = err("--dtype fp8");
        assert!(e.contains("f32") && e.contains("bf16") && e.contains("f16"), "{e}");
        let e = err("--device tpu");
        assert!(e.contains("MIG-<uuid>"), "{e}");
        let e = err("--iters 0");
        assert!(e.contains("--iters"), "{e}");
        let e = err("--iters 5 --duration 2");
        assert!(e.contains("cannot be used with"), "{e}");
    }
}
