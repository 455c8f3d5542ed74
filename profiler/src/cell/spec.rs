//! One cell of a sweep: everything one child process needs to make one run, as a versioned JSON
//! contract (`migprof cell --spec FILE` reads it; emulated slices and cluster backends write it too),
//! and the cell's identity.
//!
//! The `cell_id` hashes the cell as written — target label and device string, model, mode, dtype,
//! batch as written (`max` stays `max`), sequence length, repeat, weights file hash (or a model
//! folder's), optimizer, kernel options, a generation's lengths and cache layout, spec version,
//! migprof version — and nothing resolved (UUIDs change when a MIG
//! layout is re-applied) or sweep-specific (the sweep's name, the results folder, timings).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use std::time::Duration;

use workloads::kernels::KernelOptions;
use workloads::Mode;

use crate::provenance;
use crate::run::fingerprint::Fingerprint;
use crate::run::given::{self, Measuring};
use crate::run::measure::{Stop, Warmup};
use crate::run::record::{CellIdentity, FailedWorkload, Failure, Status};
use crate::run::spec::{Precision, RunSpec};
use crate::run::subject::{Program, StepsFrom};

/// The dtypes a cell may ask for, as `--dtype` spells them.
pub const DTYPES: [&str; 4] = ["f32", "bf16", "f16", "tf32"];

/// The contract's version: bumped when a field changes meaning; a child refuses other versions.
pub const CELL_SPEC_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellSpec {
    pub version: u32,
    /// The sweep's name (`sweep` column; empty for a cell of `run` or `load`); not part of the id.
    pub sweep: String,
    /// The target's label (`target` column) and its device as written.
    pub target: String,
    pub device: String,
    pub model: String,
    /// `infer`, `train` or `generate`.
    pub mode: String,
    /// As `--dtype` spells it: f32, bf16, f16, tf32.
    pub dtype: String,
    /// The batch size to run.
    pub batch: usize,
    /// The batch as the sweep file wrote it: a number, or `max`.
    pub batch_as_written: String,
    pub seq_len: Option<usize>,
    /// A generation's prompt and output lengths (generate cells only, and part of their id alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_len: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_len: Option<usize>,
    /// A generation's KV cache layout (`contiguous` where none is given) and a paged one's block
    /// size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_block_size: Option<workloads::BlockSize>,
    /// Which of the sweep's independent repetitions (0-based).
    pub repeat: u32,
    pub seed: u64,
    pub weights: Option<PathBuf>,
    /// SHA-256 of the weights file, so that the id changes when the file does.
    pub weights_sha256: Option<String>,
    /// `adamw` or `sgd`, and their settings (unused when inferring, still part of the cell).
    pub optimizer: String,
    pub lr: f64,
    pub weight_decay: f64,
    /// `f32` or `none`: bf16 and f16 training over f32 master weights or on the weights themselves
    /// (part of the id of bf16 and f16 training cells only).
    #[serde(default = "default_master_weights")]
    pub master_weights: String,
    /// The canonical kernel options string.
    pub kernel_options: String,
    pub warmup_secs: f64,
    pub duration_secs: f64,
    /// Measure on until the throughput is known to ± this many percent, at most `max_duration_secs`.
    #[serde(default)]
    pub target_precision: Option<f64>,
    #[serde(default)]
    pub max_duration_secs: Option<f64>,
    pub sample_interval_ms: u64,
    /// `probe` for a step of a `max` search; otherwise `ok` when it runs through.
    pub purpose: Purpose,
    /// The concurrent group the cell runs in as a member (`concurrency_group` column); none alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_group: Option<String>,
    /// The group's other members, each `target:model/mode/dtype/batch`, in the group's order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub neighbours: Vec<String>,
    /// The cell's target is the sweep's baseline (for reports; not part of the id).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub baseline: bool,
    /// What the cell does with its workload: measure its steps, or serve it under load.
    #[serde(default, skip_serializing_if = "Job::is_measure")]
    pub job: Job,
    /// The sweep's `timeout_secs`: the cell ends itself a little after it, should its sweep be gone
    /// (not part of the id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
    /// Run by a cluster's scheduler: `device` says what was asked for (a MIG profile, `cuda`,
    /// `cpu`), and the cell runs on the first device the scheduler made visible (not part of the id).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub scheduled: bool,
}

/// Whether master weights change what a cell of `mode` and `dtype` (as a sweep spells them) computes:
/// bf16 and f16 training.
pub(crate) fn masters_apply(mode: &str, dtype: &str) -> bool {
    mode == "train" && matches!(dtype, "bf16" | "f16")
}

fn default_master_weights() -> String {
    workloads::MasterWeights::default().as_str().to_string()
}

/// What a cell does with its workload: one job, holding its settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Job {
    /// Measures its steps (`runs` rows).
    #[default]
    Measure,
    /// Serves the model behind a dynamic batcher under open-loop load, at rates or searched for
    /// the highest within the p99 objective (`load` and `capacity` rows).
    Load(crate::load::settings::LoadSettings),
    /// Serves a language model by the continuous batcher under open-loop load (`serve` and
    /// `serve_capacity` rows).
    Serve(crate::load::settings::ServeSettings),
    /// Runs a user's program and measures the steps it reports (a `runs` row, as `migprof exec`):
    /// the cell's `model` is its name, `mode` the phase measured, `batch` the items a step (0: what
    /// it runs).
    Program(ProgramJob),
    /// Starts a user's server on the cell's device and loads it (`load` and `capacity` rows, as
    /// `migprof load --endpoint`): the cell's `model` is the served model's name, `batch` the samples
    /// a request holds.
    Server(Box<ServerJob>),
}

/// A server cell's server, its requests and its steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerJob {
    pub server: crate::server::given::ServerGiven,
    /// Warm-up, duration, arrivals, the objective and the search's bounds (a KServe server's).
    pub load: crate::load::settings::LoadSettings,
    /// A language model's server's: the requests' lengths, arrivals, the TTFT and TPOT objectives
    /// and the search's bounds (`load` is then not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<crate::load::settings::ServeSettings>,
    /// Open-loop rates, after the server's concurrencies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rates: Vec<f64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub search: bool,
}

/// A program cell's command and how its steps are read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgramJob {
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_pattern: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<usize>,
}

impl Job {
    fn is_measure(&self) -> bool {
        matches!(self, Job::Measure)
    }

    /// A load job's settings.
    pub fn load(&self) -> Option<&crate::load::settings::LoadSettings> {
        match self {
            Job::Load(s) => Some(s),
            _ => None,
        }
    }

    /// A language model's serving job's settings.
    pub fn serve(&self) -> Option<&crate::load::settings::ServeSettings> {
        match self {
            Job::Serve(s) => Some(s),
            _ => None,
        }
    }

    /// A program's job.
    pub fn program(&self) -> Option<&ProgramJob> {
        match self {
            Job::Program(p) => Some(p),
            _ => None,
        }
    }

    /// A server's job.
    pub fn server(&self) -> Option<&ServerJob> {
        match self {
            Job::Server(s) => Some(s),
            _ => None,
        }
    }
}

/// Why a cell runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// A cell of the matrix.
    Measure,
    /// One try of a `max` search: its row is kept with status `probe`.
    Probe,
}

impl CellSpec {
    /// The fields the id is made of, in a fixed order, one per line.
    fn id_fields(&self) -> String {
        let mut fields: Vec<(&str, String)> = vec![
            ("version", self.version.to_string()),
            ("migprof", provenance::VERSION.to_string()),
            ("target", self.target.clone()),
            ("device", self.device.clone()),
            ("model", self.model.clone()),
            ("mode", self.mode.clone()),
            ("dtype", self.dtype.clone()),
            (
                "batch",
                if self.purpose == Purpose::Probe {
                    format!("probe:{}", self.batch)
                } else {
                    self.batch_as_written.clone()
                },
            ),
            ("seq_len", self.seq_len.map_or("default".into(), |l| l.to_string())),
            ("repeat", self.repeat.to_string()),
            (
                "weights",
                self.weights_sha256
                    .clone()
                    .unwrap_or_else(|| format!("seeded:{}", self.seed)),
            ),
            ("optimizer", self.optimizer.clone()),
            ("lr/weight_decay", format!("{}/{}", self.lr, self.weight_decay)),
            ("kernel_options", self.kernel_options.clone()),
        ];
        // Only where it changes what is computed (bf16 and f16 training), so that the ids of f32
        // training and of inference stay as they were.
        if self.keeps_masters_choice() {
            fields.push(("master_weights", self.master_weights.clone()));
        }
        // Only for generations, so that the ids of every other cell stay as they were.
        if self.mode == Mode::Generate.as_str() {
            let len = |l: Option<usize>| l.map_or("none".into(), |l| l.to_string());
            fields.push(("prompt_len", len(self.prompt_len)));
            fields.push(("output_len", len(self.output_len)));
            // As the cell runs it: a paged cache with its block size (given or the default), a
            // contiguous one without; a layout no run takes, as written.
            fields.push((
                "kv_layout",
                match self.kv_layout() {
                    Ok(workloads::KvLayout::Paged { block_size }) => format!("paged/{block_size}"),
                    Ok(workloads::KvLayout::Contiguous) => "contiguous".to_string(),
                    Err(_) => self.kv_layout.clone().unwrap_or_default(),
                },
            ));
        }
        // Only for load jobs and group members, so that the ids of other cells stay as they were.
        match &self.job {
            Job::Measure => {}
            Job::Load(l) => fields.push(("load", l.identity())),
            Job::Serve(s) => fields.push(("serve", s.identity())),
            // Its arguments one per line, as a shell could not run them together by mistake.
            Job::Program(p) => {
                fields.push(("program", p.command.join("\u{1f}")));
                // Another pattern reads other steps: another cell.
                if let Some(pattern) = &p.step_pattern {
                    fields.push(("step_pattern", pattern.clone()));
                }
            }
            // Everything it was given: another server, request or step is another cell.
            Job::Server(s) => fields.push((
                "server",
                serde_json::to_string(s).unwrap_or_else(|e| format!("unwritable: {e}")),
            )),
        }
        if let Some(g) = &self.concurrency_group {
            fields.push(("concurrency_group", g.clone()));
            fields.push(("neighbours", self.neighbours.join(",")));
        }
        fields.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
    }

    /// Makes this generate cell a language model's serving job with `settings`: its cache is paged,
    /// in their blocks (its id and a failed cell's row say so).
    pub fn serve_with(&mut self, settings: crate::load::settings::ServeSettings) {
        let paged = workloads::KvLayout::Paged {
            block_size: settings.kv_block_size,
        };
        self.kv_layout = Some(paged.as_str().to_string());
        self.kv_block_size = Some(settings.kv_block_size);
        self.job = Job::Serve(settings);
    }

    /// The KV cache a generate cell runs with: contiguous where none is written, a paged one's
    /// block size the default where none is written.
    fn kv_layout(&self) -> std::result::Result<workloads::KvLayout, String> {
        workloads::KvLayout::parse(
            self.kv_layout
                .as_deref()
                .unwrap_or(workloads::KvLayout::Contiguous.as_str()),
            self.kv_block_size.unwrap_or(workloads::BlockSize::DEFAULT),
        )
    }

    /// Whether the master-weights choice changes this cell: bf16 and f16 training.
    fn keeps_masters_choice(&self) -> bool {
        masters_apply(&self.mode, &self.dtype)
    }

    /// 16 hex digits of the SHA-256 of [`id_fields`](Self::id_fields).
    pub fn cell_id(&self) -> String {
        crate::run::record::id_of(&self.id_fields())
    }

    /// The identity of this cell's row once it ended with `status` (no sweep's for a cell of `run`
    /// or `load`, whose `sweep` is empty).
    pub fn identity(&self, status: Status) -> CellIdentity {
        CellIdentity {
            sweep: (!self.sweep.is_empty()).then(|| self.sweep.clone()),
            target: self.target.clone(),
            cell_id: self.cell_id(),
            status,
            concurrency_group: self.concurrency_group.clone(),
            neighbours: self.neighbours.clone(),
            baseline: self.baseline,
            settings: Some(self.settings()),
        }
    }

    /// What the cell's row measures with that is not in its id: `key=value;…` in a fixed order. A
    /// rerun whose settings differ from its latest row's runs the cell again.
    pub fn settings(&self) -> String {
        if let Job::Program(p) = &self.job {
            return crate::program::cell_settings(p.warmup_steps, self.sample_interval_ms);
        }
        // A serving job's steps are set by its own settings, which are part of its id.
        if !self.job.is_measure() {
            return format!("sample_interval_ms={}", self.sample_interval_ms);
        }
        let or_none = |v: Option<f64>| v.map_or("none".to_string(), |v| v.to_string());
        format!(
            "warmup_secs={};duration_secs={};target_precision={};max_duration_secs={};sample_interval_ms={}",
            self.warmup_secs,
            self.duration_secs,
            or_none(self.target_precision),
            or_none(self.max_duration_secs),
            self.sample_interval_ms
        )
    }

    /// The workload fields a failed cell's row records.
    pub fn workload(&self) -> FailedWorkload {
        FailedWorkload {
            model: self.model.clone(),
            mode: self.mode.clone(),
            dtype: self.dtype.clone(),
            batch: self.batch,
            seq_len: self.seq_len,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            kv_layout: (self.mode == Mode::Generate.as_str()).then(|| {
                self.kv_layout
                    .clone()
                    .unwrap_or_else(|| workloads::KvLayout::Contiguous.as_str().to_string())
            }),
            kv_block_size: self.kv_block_size,
            seed: self.seed,
            kernel_options: self.kernel_options.clone(),
            master_weights: self.keeps_masters_choice().then(|| self.master_weights.clone()),
        }
    }

    /// The row of this cell when it ended with `status` and no measurement, `error` saying why:
    /// from `started` to now, in the invocation `invocation_id` on `host`, with what the writer can
    /// tell of the build and device (`fingerprint`).
    pub fn failure(
        &self,
        status: Status,
        error: String,
        started: chrono::DateTime<chrono::Utc>,
        invocation_id: &str,
        host: &str,
        fingerprint: Fingerprint,
    ) -> Failure {
        Failure {
            run_id: provenance::run_id(started),
            invocation_id: invocation_id.to_string(),
            host: host.to_string(),
            started_at: started,
            finished_at: provenance::now(),
            workload: self.workload(),
            identity: self.identity(status),
            error,
            fingerprint,
            program: self.job.program().map(|p| Program {
                name: self.model.clone(),
                command: crate::program::command_line(&p.command),
                exit_code: None,
                exit_signal: None,
                wall: None,
                steps: StepsFrom::None,
                step_pattern: p.step_pattern.clone(),
                device_memory_max_mib: None,
                pids_seen: None,
            }),
        }
    }

    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    pub fn read(path: &std::path::Path) -> Result<CellSpec> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading the cell spec {}", path.display()))?;
        // The contract's version is part of every cell's id, so a change of shape that keeps the ids
        // is told apart by its fields: a job written as `load` or `serve` is an earlier migprof's.
        if let Ok(serde_json::Value::Object(fields)) = serde_json::from_str::<serde_json::Value>(&text) {
            if let Some(old) = ["load", "serve"].into_iter().find(|k| fields.contains_key(*k)) {
                bail!(
                    "cell spec {}: written by an earlier migprof (its job as `{old}`, where this one writes `job`); plan the sweep again with this migprof",
                    path.display()
                );
            }
        }
        let spec: CellSpec =
            serde_json::from_str(&text).with_context(|| format!("parsing the cell spec {}", path.display()))?;
        if spec.version != CELL_SPEC_VERSION {
            bail!(
                "cell spec {}: version {} (this migprof reads version {CELL_SPEC_VERSION})",
                path.display(),
                spec.version
            );
        }
        Ok(spec)
    }
}

impl CellSpec {
    /// The cell of one run of `migprof run`: its target is the device as given, it is no sweep's.
    pub fn of_run(spec: &RunSpec, target: &str, device: &str) -> Result<CellSpec> {
        // SGD's momentum is fixed at 0.9 (`TrainConfig::sgd`), so the name says it all.
        let optimizer = match spec.train.optimizer {
            workloads::OptimizerKind::AdamW => "adamw",
            workloads::OptimizerKind::Sgd { .. } => "sgd",
        };
        let seconds = |d: Duration| d.as_secs_f64();
        Ok(CellSpec {
            version: CELL_SPEC_VERSION,
            sweep: String::new(),
            target: target.to_string(),
            device: device.to_string(),
            model: spec.model.clone(),
            mode: spec.mode.as_str().to_string(),
            dtype: spec.precision.as_str().to_string(),
            batch: spec.batch,
            batch_as_written: spec.batch.to_string(),
            seq_len: spec.seq_len,
            prompt_len: spec.lengths.map(|l| l.prompt),
            output_len: spec.lengths.map(|l| l.output),
            kv_layout: spec.lengths.map(|_| spec.kv_layout.as_str().to_string()),
            kv_block_size: spec.lengths.and(spec.kv_layout.block_size()),
            repeat: 0,
            seed: spec.seed,
            weights: spec.weights.clone(),
            weights_sha256: match &spec.weights {
                Some(path) => Some(file_sha256(path)?),
                None => model_sha256(&spec.model)?,
            },
            optimizer: optimizer.to_string(),
            lr: spec.train.lr,
            weight_decay: spec.train.weight_decay,
            master_weights: spec.train.master_weights.as_str().to_string(),
            kernel_options: spec.kernels.canonical(),
            warmup_secs: match spec.warmup {
                Warmup::Duration { min, .. } => seconds(min),
                Warmup::Iterations(_) => 0.0,
            },
            duration_secs: match spec.stop {
                Stop::Duration { min, .. } | Stop::Precision { min, .. } => seconds(min),
                Stop::Iterations(_) => 0.0,
            },
            target_precision: match spec.stop {
                Stop::Precision { target, .. } => Some(target * 100.0),
                _ => None,
            },
            max_duration_secs: match spec.stop {
                Stop::Precision { max, .. } => Some(seconds(max)),
                _ => None,
            },
            sample_interval_ms: spec.sample_interval.map_or(0, |d| d.as_millis() as u64),
            purpose: Purpose::Measure,
            concurrency_group: None,
            neighbours: Vec::new(),
            baseline: false,
            job: Job::Measure,
            timeout_secs: None,
            scheduled: false,
        })
    }

    /// How this cell measures, as a sweep's defaults resolved it.
    pub fn measuring(&self) -> Measuring {
        Measuring {
            warmup_secs: self.warmup_secs,
            warmup_min_iterations: 1,
            duration_secs: self.duration_secs,
            target_precision: self.target_precision,
            max_duration_secs: self.max_duration_secs.unwrap_or(given::MAX_DURATION_SECS),
            sample_interval_ms: self.sample_interval_ms,
            seed: self.seed,
        }
    }

    /// The run this cell makes. A probe of a `max` search runs one warm-up and one measured step:
    /// enough to know whether the batch fits.
    pub fn run_spec(&self) -> Result<RunSpec> {
        let mode = Mode::parse(&self.mode).map_err(|e| anyhow::anyhow!("cell spec: {e}"))?;
        let lengths = match (mode, self.prompt_len, self.output_len) {
            (Mode::Generate, Some(prompt), Some(output)) => Some(workloads::Lengths { prompt, output }),
            // A served language model draws each request's lengths.
            (Mode::Generate, None, None) if self.job.serve().is_some() => None,
            (Mode::Generate, _, _) => bail!("cell spec: a generate cell needs prompt_len and output_len"),
            (_, None, None) => None,
            _ => bail!("cell spec: prompt_len and output_len apply to generate cells only"),
        };
        let kv_layout = match self.job.serve() {
            Some(s) => workloads::KvLayout::Paged {
                block_size: s.kv_block_size,
            },
            None => self.kv_layout().map_err(|e| anyhow::anyhow!("cell spec: {e}"))?,
        };
        let precision = self
            .dtype
            .parse::<Precision>()
            .map_err(|e| anyhow::anyhow!("cell spec: {e}"))?;
        let optimizer = match self.optimizer.as_str() {
            "adamw" => workloads::OptimizerKind::AdamW,
            "sgd" => workloads::OptimizerKind::Sgd { momentum: 0.9 },
            other => bail!("cell spec: optimizer `{other}`; valid optimizers: adamw, sgd"),
        };
        let master_weights = self
            .master_weights
            .parse::<workloads::MasterWeights>()
            .map_err(|e| anyhow::anyhow!("cell spec: {e}"))?;
        let kernels = self
            .kernel_options
            .parse::<KernelOptions>()
            .map_err(|e| anyhow::anyhow!("cell spec: {e}"))?;
        let measuring = self.measuring();
        let (warmup, stop) = match self.purpose {
            Purpose::Probe => (Warmup::Iterations(1), Stop::Iterations(1)),
            Purpose::Measure => (measuring.warmup(), measuring.stop(given::MIN_ITERATIONS)),
        };
        Ok(RunSpec {
            seq_len: self.seq_len,
            lengths,
            kv_layout,
            weights: self.weights.clone(),
            train: workloads::TrainConfig {
                optimizer,
                lr: self.lr,
                weight_decay: self.weight_decay,
                master_weights,
            },
            kernels,
            warmup,
            stop,
            seed: self.seed,
            sample_interval: measuring.sample_interval(),
            probe: self.purpose == Purpose::Probe,
            ..RunSpec::new(&self.model, mode, precision, self.batch)
        })
    }
}

/// SHA-256 of a file's bytes, in hex.
pub fn file_sha256(path: &std::path::Path) -> Result<String> {
    let mut hasher = Sha256::new();
    hash_file(&mut hasher, path)?;
    Ok(hex(&hasher.finalize()))
}

/// For a model given as a Hugging Face folder (`hf:DIR`), SHA-256 of its `config.json` and weights
/// files (each name, then its bytes, in name order), so that a cell's id changes when the folder's
/// model does; `None` for a catalogue model. Read in chunks: a folder holds gigabytes.
pub fn model_sha256(model: &str) -> Result<Option<String>> {
    let Some(dir) = model.strip_prefix(workloads::FOLDER_PREFIX) else {
        return Ok(None);
    };
    let dir = std::path::Path::new(dir);
    let (_, weights) = workloads::models::decoder::read_folder(dir)?;
    let mut hasher = Sha256::new();
    for path in std::iter::once(dir.join("config.json")).chain(weights) {
        hasher.update(path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        hasher.update(b"\n");
        hash_file(&mut hasher, &path)?;
    }
    Ok(Some(hex(&hasher.finalize())))
}

fn hash_file(hasher: &mut Sha256, path: &std::path::Path) -> Result<()> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut chunk)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&chunk[..n]);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::DType;

    pub fn cell() -> CellSpec {
        CellSpec {
            version: CELL_SPEC_VERSION,
            sweep: "s".into(),
            target: "cpu".into(),
            device: "cpu".into(),
            model: "resnet_tiny".into(),
            mode: "infer".into(),
            dtype: "f32".into(),
            batch: 2,
            batch_as_written: "2".into(),
            seq_len: None,
            prompt_len: None,
            output_len: None,
            kv_layout: None,
            kv_block_size: None,
            repeat: 0,
            seed: 0,
            weights: None,
            weights_sha256: None,
            optimizer: "adamw".into(),
            lr: 1e-3,
            weight_decay: 0.01,
            master_weights: "f32".into(),
            kernel_options: workloads::kernels::KernelOptions::default().canonical(),
            warmup_secs: 0.1,
            duration_secs: 0.2,
            target_precision: None,
            max_duration_secs: None,
            sample_interval_ms: 100,
            purpose: Purpose::Measure,
            concurrency_group: None,
            neighbours: Vec::new(),
            baseline: false,
            job: Job::Measure,
            timeout_secs: None,
            scheduled: false,
        }
    }

    #[test]
    fn a_spec_an_earlier_migprof_wrote_is_refused_in_words_that_say_so() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("cell.json");
        let mut json: serde_json::Value = serde_json::from_str(&cell().to_json()?)?;
        json["load"] = serde_json::to_value(crate::load::settings::DEFAULTS)?;
        std::fs::write(&path, json.to_string())?;
        let e = CellSpec::read(&path).unwrap_err().to_string();
        assert!(e.contains("written by an earlier migprof (its job as `load`"), "{e}");
        std::fs::write(&path, cell().to_json()?)?;
        assert_eq!(CellSpec::read(&path)?, cell());
        Ok(())
    }

    #[test]
    fn the_id_follows_what_the_cell_is_not_where_or_when_it_ran() {
        let a = cell();
        assert_eq!(a.cell_id().len(), 16);
        // Sweep-specific fields and timings leave the id alone.
        let same = CellSpec {
            sweep: "other".into(),
            warmup_secs: 9.0,
            duration_secs: 9.0,
            sample_interval_ms: 5,
            baseline: true,
            ..a.clone()
        };
        assert_eq!(same.cell_id(), a.cell_id());
        // What the cell is changes it.
        for other in [
            CellSpec {
                target: "cpu2".into(),
                ..a.clone()
            },
            CellSpec {
                batch_as_written: "max".into(),
                ..a.clone()
            },
            CellSpec { repeat: 1, ..a.clone() },
            CellSpec {
                dtype: "f16".into(),
                ..a.clone()
            },
            CellSpec {
                kernel_options: "v7;attention=composed;layers=op;gemm=timed;graphs=infer;convs=nhwc".into(),
                ..a.clone()
            },
            CellSpec {
                kernel_options: "v7;attention=fused;layers=op;gemm=timed;graphs=off;convs=nhwc".into(),
                ..a.clone()
            },
            CellSpec {
                kernel_options: "v7;attention=fused;layers=op;gemm=timed;graphs=infer;convs=nchw".into(),
                ..a.clone()
            },
            CellSpec {
                weights_sha256: Some("ab".into()),
                ..a.clone()
            },
            CellSpec {
                purpose: Purpose::Probe,
                ..a.clone()
            },
            CellSpec {
                concurrency_group: Some("3g+3g".into()),
                neighbours: vec!["b:resnet_tiny/infer/f32/2".into()],
                ..a.clone()
            },
        ] {
            assert_ne!(other.cell_id(), a.cell_id(), "{other:?}");
        }
        // Beside other neighbours, another cell.
        let member = CellSpec {
            concurrency_group: Some("g".into()),
            neighbours: vec!["b:x".into()],
            ..a.clone()
        };
        assert_ne!(
            CellSpec {
                neighbours: vec!["b:y".into()],
                ..member.clone()
            }
            .cell_id(),
            member.cell_id()
        );
        // An id of a cell run alone is what it was before groups existed; it changed since, on
        // purpose, each time the default kernel options changed what a step runs: CUDA graphs (v2),
        // ResNet's convolutions in NHWC (v3), ResNet's training over NHWC with blocks as ops (v4),
        // Swin's training with blocks as ops (v5), language models' decode steps as CUDA graphs
        // (v6), then their decode and prefill kernels (v7), then a chunked prompt's later pieces on
        // the causal kernel (v8).
        assert_eq!(a.cell_id(), "9066f07b558bdbc4");
        // A load job's and a serving job's ids, as they were when a cell held its job in two
        // optional fields.
        let load = CellSpec {
            job: Job::Load(crate::load::settings::DEFAULTS),
            ..a.clone()
        };
        assert_eq!(load.cell_id(), "c844527784a70199");
        let mut serve = CellSpec {
            mode: "generate".into(),
            ..a.clone()
        };
        serve.serve_with(crate::load::settings::SERVE_DEFAULTS);
        assert_eq!(serve.cell_id(), "d000f946444b5f39");
        // "max" keeps one id whatever batch the search found.
        let max = CellSpec {
            batch_as_written: "max".into(),
            ..a.clone()
        };
        assert_eq!(
            CellSpec {
                batch: 64,
                ..max.clone()
            }
            .cell_id(),
            max.cell_id()
        );
    }

    #[test]
    fn a_generation_is_identified_by_its_lengths_and_other_cells_as_before() -> Result<()> {
        // Every other mode's fields are as they were: nothing of generation among them.
        for mode in ["infer", "train"] {
            let c = CellSpec {
                mode: mode.into(),
                ..cell()
            };
            assert!(!c.id_fields().contains("prompt_len") && !c.id_fields().contains("kv_layout"));
        }
        let g = CellSpec {
            model: "llama_tiny".into(),
            mode: "generate".into(),
            prompt_len: Some(16),
            output_len: Some(8),
            ..cell()
        };
        assert!(g
            .id_fields()
            .contains("prompt_len=16\noutput_len=8\nkv_layout=contiguous\n"));
        let longer = CellSpec {
            prompt_len: Some(32),
            ..g.clone()
        };
        let more = CellSpec {
            output_len: Some(9),
            ..g.clone()
        };
        assert_ne!(g.cell_id(), longer.cell_id());
        assert_ne!(g.cell_id(), more.cell_id());
        // A paged cache is identified by the block size it runs with, given or the default; a
        // block size does not change a contiguous cache.
        let block = |n: i64| workloads::BlockSize::new(n).unwrap();
        let paged = |b: Option<i64>| CellSpec {
            kv_layout: Some("paged".into()),
            kv_block_size: b.map(block),
            ..g.clone()
        };
        assert_eq!(paged(None).cell_id(), paged(Some(16)).cell_id());
        assert_ne!(paged(Some(16)).cell_id(), paged(Some(32)).cell_id());
        assert_ne!(paged(Some(16)).cell_id(), g.cell_id());
        let sized = CellSpec {
            kv_block_size: Some(block(8)),
            ..g.clone()
        };
        assert_eq!(sized.cell_id(), g.cell_id());
        let spec = g.run_spec()?;
        assert_eq!(spec.lengths, Some(workloads::Lengths { prompt: 16, output: 8 }));
        // A cell written by hand that mixes them up is refused.
        let e = CellSpec {
            prompt_len: None,
            ..g.clone()
        }
        .run_spec()
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs prompt_len and output_len"), "{e}");
        let e = CellSpec {
            prompt_len: Some(4),
            output_len: Some(4),
            ..cell()
        }
        .run_spec()
        .unwrap_err()
        .to_string();
        assert!(e.contains("apply to generate cells only"), "{e}");
        // A served language model draws its lengths; its cache is paged in its settings' blocks,
        // and its id, its run and a failed row say so.
        let mut served = CellSpec {
            prompt_len: None,
            output_len: None,
            ..g.clone()
        };
        served.serve_with(crate::load::settings::ServeSettings {
            kv_block_size: block(8),
            ..crate::load::settings::SERVE_DEFAULTS
        });
        assert!(served
            .id_fields()
            .contains("prompt_len=none\noutput_len=none\nkv_layout=paged/8\n"));
        let spec = served.run_spec()?;
        assert_eq!(
            (spec.lengths, spec.kv_layout),
            (None, workloads::KvLayout::Paged { block_size: block(8) })
        );
        let w = served.workload();
        assert_eq!(
            (w.kv_layout.as_deref(), w.kv_block_size),
            (Some("paged"), Some(block(8)))
        );
        assert_eq!(served.settings(), "sample_interval_ms=100");
        Ok(())
    }

    #[test]
    fn a_model_folder_s_id_follows_its_files() -> Result<()> {
        assert_eq!(model_sha256("llama_tiny")?, None);
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("config.json"), workloads::models::decoder::PRESETS[5].1)?;
        std::fs::write(dir.path().join("model.safetensors"), b"weights, version 1")?;
        let name = format!("hf:{}", dir.path().display());
        let first = model_sha256(&name)?.expect("a folder has a hash");
        std::fs::write(dir.path().join("model.safetensors"), b"weights, version 2")?;
        let second = model_sha256(&name)?.expect("a folder has a hash");
        assert_ne!(first, second, "the fine-tune changed, so does the cell");
        let c = |sha: String| CellSpec {
            model: name.clone(),
            mode: "generate".into(),
            prompt_len: Some(4),
            output_len: Some(2),
            weights_sha256: Some(sha),
            ..cell()
        };
        assert_ne!(c(first).cell_id(), c(second).cell_id());
        Ok(())
    }

    #[test]
    fn master_weights_are_in_the_id_of_half_precision_training_alone() -> Result<()> {
        let with = |mode: &str, dtype: &str, masters: &str| CellSpec {
            mode: mode.into(),
            dtype: dtype.into(),
            master_weights: masters.into(),
            ..cell()
        };
        for dtype in ["bf16", "f16"] {
            assert_ne!(
                with("train", dtype, "f32").cell_id(),
                with("train", dtype, "none").cell_id(),
                "{dtype}"
            );
            let run = with("train", dtype, "none").run_spec()?;
            assert_eq!(run.train.master_weights, workloads::MasterWeights::None);
            let back = CellSpec::of_run(&run, "cpu", "cpu")?;
            assert_eq!(back.cell_id(), with("train", dtype, "none").cell_id());
        }
        // f32 training and every inference keep the ids they had before the choice existed.
        for (mode, dtype) in [("train", "f32"), ("train", "tf32"), ("infer", "bf16"), ("infer", "f16")] {
            assert_eq!(
                with(mode, dtype, "f32").cell_id(),
                with(mode, dtype, "none").cell_id(),
                "{mode} {dtype}"
            );
        }
        // Pinned as of kernel options v8 (a version bump changes every id).
        assert_eq!(with("train", "f32", "f32").cell_id(), "835bccaefbf08a58");
        let err = with("train", "bf16", "fp8").run_spec().unwrap_err().to_string();
        assert!(err.contains("choose one of f32, none"), "{err}");
        Ok(())
    }

    #[test]
    fn a_cell_makes_the_run_it_describes_and_back() -> Result<()> {
        let c = CellSpec {
            dtype: "tf32".into(),
            mode: "train".into(),
            optimizer: "sgd".into(),
            ..cell()
        };
        let run = c.run_spec()?;
        assert!(run.precision == Precision::Tf32 && run.precision.dtype() == DType::F32 && run.mode == Mode::Train);
        assert_eq!(run.train.optimizer, workloads::OptimizerKind::Sgd { momentum: 0.9 });
        let back = CellSpec::of_run(&run, &c.target, &c.device)?;
        assert_eq!(back.cell_id(), c.cell_id(), "{back:?}");
        let probe = CellSpec {
            purpose: Purpose::Probe,
            ..cell()
        }
        .run_spec()?;
        assert_eq!((probe.warmup, probe.stop), (Warmup::Iterations(1), Stop::Iterations(1)));
        assert!(CellSpec {
            dtype: "fp8".into(),
            ..cell()
        }
        .run_spec()
        .unwrap_err()
        .to_string()
        .contains("valid dtypes"));
        Ok(())
    }

    #[test]
    fn the_json_round_trips_and_other_versions_are_refused() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("cell.json");
        std::fs::write(&path, cell().to_json()?)?;
        assert_eq!(CellSpec::read(&path)?, cell());
        std::fs::write(&path, cell().to_json()?.replace("\"version\": 1", "\"version\": 2"))?;
        assert!(format!("{:#}", CellSpec::read(&path).unwrap_err()).contains("version 2"));
        Ok(())
    }
}
