//! The one interface the profiler drives: a model built on a device and dtype, a synthetic batch, and
//! one inference or training step.

use std::path::PathBuf;

use std::sync::Mutex;

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::graphs::{GraphStats, StepGraphs};
use crate::init::{Checkpoint, Params, Rng, SeededInit};
use crate::kernels::options::CudaGraphs;
use crate::kernels::KernelOptions;
use crate::models::{is_buffer, Classifier, Inputs};
use crate::optim::{MasterWeights, MixedOptimizer, Optimizer, OptimizerKind, ScaleReading};
use crate::zoo::{lookup_with, InputShape, ModelInfo};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Forward pass only, batch norm on running statistics, no gradient graph.
    Infer,
    /// Forward, cross-entropy, backward and an optimizer step (AdamW, or SGD with momentum).
    Train,
    /// A language model's greedy generation: a batch of prompts prefilled, then tokens decoded one
    /// at a time with a KV cache ([`crate::generation`]).
    Generate,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Infer, Mode::Train, Mode::Generate];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Infer => "infer",
            Mode::Train => "train",
            Mode::Generate => "generate",
        }
    }

    /// The mode `--mode` spells `s`; the error names the valid ones.
    pub fn parse(s: &str) -> std::result::Result<Mode, String> {
        Mode::ALL.into_iter().find(|m| m.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = Mode::ALL.iter().map(|m| m.as_str()).collect();
            format!("mode `{s}`; valid modes: {}", names.join(", "))
        })
    }

    /// Those of `modes` that run a model of `info`, in order; where none does, why the first
    /// does not ([`Mode::check_model`]).
    pub fn fitting(modes: &[Mode], info: &ModelInfo) -> std::result::Result<Vec<Mode>, String> {
        let fitting: Vec<Mode> = modes.iter().copied().filter(|m| m.check_model(info).is_ok()).collect();
        match (fitting.is_empty(), modes.first()) {
            (true, Some(first)) => Err(first.check_model(info).expect_err("no mode fits")),
            _ => Ok(fitting),
        }
    }

    /// Whether a model of `info` runs in this mode: language models generate, the image and
    /// encoder models infer and train. The message says which models the mode does run.
    pub fn check_model(self, info: &ModelInfo) -> std::result::Result<(), String> {
        let decoder = info.family.is_decoder();
        match (self, decoder) {
            (Mode::Generate, false) => Err(format!(
                "{} is not a language model: generate runs {}, or hf:DIR",
                info.name,
                crate::zoo::models()
                    .iter()
                    .filter(|m| m.family.is_decoder())
                    .map(|m| m.name.clone())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            (Mode::Infer | Mode::Train, true) => Err(format!(
                "{} is a language model: its mode is generate ({} runs the image and encoder models)",
                info.name,
                self.as_str()
            )),
            _ => Ok(()),
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Mode, String> {
        Mode::parse(s)
    }
}

/// The optimizer of a training workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    pub optimizer: OptimizerKind,
    pub lr: f64,
    pub weight_decay: f64,
    /// bf16 and f16 training over f32 master weights (the default) or on the half-precision weights.
    pub master_weights: MasterWeights,
}

impl TrainConfig {
    /// AdamW with `torch.optim.AdamW`'s defaults: lr 1e-3, weight decay 0.01.
    pub fn adamw() -> Self {
        Self {
            optimizer: OptimizerKind::AdamW,
            lr: 1e-3,
            weight_decay: 0.01,
            master_weights: MasterWeights::default(),
        }
    }

    /// SGD with momentum 0.9, lr 0.01, no weight decay (`torch.optim.SGD` needs an lr; this one is a
    /// usual fine-tuning value).
    pub fn sgd() -> Self {
        Self {
            optimizer: OptimizerKind::Sgd { momentum: 0.9 },
            lr: 0.01,
            weight_decay: 0.0,
            master_weights: MasterWeights::default(),
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self::adamw()
    }
}

/// How to build a workload.
#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub device: Device,
    pub dtype: DType,
    pub mode: Mode,
    /// Seeds the weights; the same seed gives the same weights on every device.
    pub seed: u64,
    /// Tokens per sequence for token models; `None` for their default (and for image models).
    pub seq_len: Option<usize>,
    /// A safetensors checkpoint with the reference implementation's parameter names (torchvision,
    /// Hugging Face `BertModel`); `None` for seeded random weights.
    pub weights: Option<PathBuf>,
    pub train: TrainConfig,
    /// The kernel choices the workload's steps run with (entered for the length of each step).
    pub kernels: KernelOptions,
}

/// One batch of synthetic inputs with class labels.
#[derive(Debug, Clone)]
pub struct Batch {
    pub size: usize,
    pub inputs: Inputs,
    /// Class indices (u32), one per sample.
    pub labels: Tensor,
}

impl Batch {
    /// The first `n` samples (all of them when `n` is the size or more).
    pub fn first(&self, n: usize) -> Result<Batch> {
        let n = n.min(self.size);
        let inputs = match &self.inputs {
            Inputs::Images(x) => Inputs::Images(x.narrow(0, 0, n)?),
            Inputs::Tokens {
                input_ids,
                token_type_ids,
                attention_mask,
            } => Inputs::Tokens {
                input_ids: input_ids.narrow(0, 0, n)?,
                token_type_ids: token_type_ids.narrow(0, 0, n)?,
                attention_mask: attention_mask.narrow(0, 0, n)?,
            },
        };
        Ok(Batch {
            size: n,
            inputs,
            labels: self.labels.narrow(0, 0, n)?,
        })
    }

    /// A copy on `device` (contiguous there whatever the layout here).
    pub fn to_device(&self, device: &Device) -> Result<Batch> {
        let moved = |t: &Tensor| t.contiguous()?.to_device(device);
        let inputs = match &self.inputs {
            Inputs::Images(x) => Inputs::Images(moved(x)?),
            Inputs::Tokens {
                input_ids,
                token_type_ids,
                attention_mask,
            } => Inputs::Tokens {
                input_ids: moved(input_ids)?,
                token_type_ids: moved(token_type_ids)?,
                attention_mask: moved(attention_mask)?,
            },
        };
        Ok(Batch {
            size: self.size,
            inputs,
            labels: moved(&self.labels)?,
        })
    }
}

/// A model ready to run on a device: the profiler's only view of a workload.
pub trait Workload {
    fn info(&self) -> &ModelInfo;
    fn device(&self) -> &Device;
    fn dtype(&self) -> DType;
    fn mode(&self) -> Mode;
    /// A batch of `size` samples drawn from `seed`, already on the device.
    fn synthetic_batch(&self, size: usize, seed: u64) -> Result<Batch>;
    /// The same samples in host memory, in the model's dtype: what a server holds when requests
    /// arrive, before it copies a batch of them to the device.
    fn host_batch(&self, size: usize, seed: u64) -> Result<Batch>;
    /// Forward pass without gradients; returns the logits. The work may still be queued on the device.
    /// When steps replay CUDA graphs (the kernel option, on a CUDA device), the logits are rewritten
    /// by the next step of the same shape: read or copy them before it.
    fn infer(&self, batch: &Batch) -> Result<Tensor>;
    /// Forward, loss, backward and optimizer step; returns the loss (a scalar, possibly still queued,
    /// without its gradient graph), rewritten by the next step of the same shape as [`Workload::infer`]'s
    /// logits are.
    fn train_step(&mut self, batch: &Batch) -> Result<Tensor>;
    /// Steps of one shape before its steps are all alike: 2 when steps replay CUDA graphs (the first
    /// fills the caches, the second captures), else 1. A warm-up shorter than this measures them.
    fn steps_to_steady(&self) -> u64;
    /// The CUDA graphs captured so far, the steps that replayed one, and the shapes whose capture was
    /// refused (their steps run as they are).
    fn graph_stats(&self) -> GraphStats;
    /// Why captures were refused, one line per distinct reason; empty when none was.
    fn graph_refusals(&self) -> Vec<String>;
    /// Every named tensor of the model (parameters and buffers), sorted by name: as trained so far,
    /// or for inference as built, on the host ([`crate::init::Params::tensors`]).
    fn tensors(&self) -> Vec<(String, Tensor)>;
    /// The trainable weights as the optimizer holds them, by name: the f32 masters where training
    /// keeps them, else the parameters themselves. Empty for inference.
    fn weights(&self) -> Result<Vec<(String, Tensor)>>;
    /// The loss scale and the steps skipped so far, where training keeps f32 masters (synchronises
    /// with the device); `None` otherwise.
    fn scale_reading(&self) -> Result<Option<ScaleReading>>;
}

/// The optimizer over the trainable parameters, by name, with f32 masters where `originals` kept
/// their values; none when inferring.
fn optimizer_for(
    params: &Params,
    originals: Option<crate::init::Originals>,
    cfg: &WorkloadConfig,
) -> Result<(Option<Optimizer>, Vec<String>)> {
    Ok(match params {
        Params::Trainable(vm) => {
            let named: Vec<(String, Var)> = {
                let data = vm.data().lock().unwrap();
                let mut named: Vec<(String, Var)> = data
                    .iter()
                    .filter(|(n, _)| !is_buffer(n))
                    .map(|(n, v)| (n.clone(), v.clone()))
                    .collect();
                named.sort_by(|a, b| a.0.cmp(&b.0));
                named
            };
            let names = named.iter().map(|(n, _)| n.clone()).collect();
            let t = &cfg.train;
            let optimizer = match originals {
                Some(originals) => {
                    // Taken out of the map as they are uploaded: the host copies go one by one.
                    let mut originals = originals.lock().unwrap();
                    let pairs = named
                        .into_iter()
                        .map(|(n, v)| {
                            let original = originals.remove(&n).ok_or_else(|| {
                                candle_core::Error::Msg(format!("{n}: no f32 value kept for its master"))
                            })?;
                            Ok((v, original))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let dynamic = cfg.dtype == DType::F16;
                    Optimizer::Mixed(MixedOptimizer::new(t.optimizer, pairs, t.lr, t.weight_decay, dynamic)?)
                }
                None => Optimizer::new(
                    t.optimizer,
                    named.into_iter().map(|(_, v)| v).collect(),
                    t.lr,
                    t.weight_decay,
                )?,
            };
            (Some(optimizer), names)
        }
        Params::Frozen(_) => (None, Vec::new()),
    })
}

/// Builds the named model as a workload.
pub fn build(name: &str, cfg: &WorkloadConfig) -> Result<Box<dyn Workload>> {
    let (arch, info) = lookup_with(name, cfg.seq_len).map_err(candle_core::Error::wrap)?;
    if cfg.mode == Mode::Generate || info.family.is_decoder() {
        candle_core::bail!(
            "{name} {}: a language model generates through workloads::Generator, not a Workload",
            cfg.mode.as_str()
        )
    }
    let params = Params::new(cfg.mode == Mode::Train);
    let masters = cfg.mode == Mode::Train && cfg.train.master_weights.kept_for(cfg.dtype);
    let originals = masters.then(crate::init::Originals::default);
    let checkpoint = match &cfg.weights {
        Some(path) => Some(Checkpoint::new(
            candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| {
                candle_core::Error::Msg(format!("cannot read the weights file {}: {e}", path.display()))
            })?,
        )),
        None => None,
    };
    let vb = SeededInit::with_checkpoint(
        params.clone(),
        cfg.seed,
        checkpoint.clone(),
        originals.clone(),
        cfg.dtype,
        &cfg.device,
    );
    let model = arch.build(vb)?;
    if let Some(ckpt) = checkpoint {
        let problems = ckpt.problems();
        if !problems.is_empty() {
            candle_core::bail!(
                "{} does not fit {name}: {} tensor(s) missing or misshaped:\n  {}",
                cfg.weights.as_ref().expect("checkpoint from a file").display(),
                problems.len(),
                problems.join("\n  ")
            )
        }
    }
    let (optimizer, trained) = optimizer_for(&params, originals, cfg)?;
    // Beside the ledger before a step's capture (graphs.rs), this tells what the first step left
    // reserved in the pool from what the parameters and optimizer state hold.
    if std::env::var_os("MIGPROF_MEMORY_LOG").is_some() {
        if let Some(ledger) = crate::memory::ledger(&cfg.device)? {
            eprintln!("memory: {name} built (parameters, buffers, optimizer state): {ledger}");
        }
    }
    Ok(Box::new(Classification {
        info,
        model,
        params,
        device: cfg.device.clone(),
        dtype: cfg.dtype,
        mode: cfg.mode,
        kernels: cfg.kernels,
        optimizer,
        trained,
        graphs: Mutex::new(StepGraphs::default()),
    }))
}

/// A classifier of any family trained with cross-entropy.
struct Classification {
    info: ModelInfo,
    model: Box<dyn Classifier>,
    params: Params,
    device: Device,
    dtype: DType,
    mode: Mode,
    kernels: KernelOptions,
    optimizer: Option<Optimizer>,
    /// The names of the parameters the optimizer updates, in its order.
    trained: Vec<String>,
    /// Behind a lock because `infer` takes `&self`; one thread drives a workload, so it is never
    /// contended.
    graphs: Mutex<StepGraphs>,
}

impl Classification {
    fn replays_graphs(&self) -> bool {
        let wanted = match self.kernels.graphs {
            CudaGraphs::On => true,
            CudaGraphs::Infer => self.mode == Mode::Infer,
            CudaGraphs::Off => false,
        };
        wanted && self.device.is_cuda()
    }
}

/// One training step of `model`: forward, cross-entropy, backward, optimizer. Every temporary of the
/// step is dropped before it returns (inside a capture, their memory is the graph's own).
fn train_once(model: &dyn Classifier, optimizer: &mut Optimizer, inputs: &Inputs, labels: &Tensor) -> Result<Tensor> {
    let outside = model.param_grads();
    if let Some(outside) = outside {
        outside.clear();
    }
    let logits = model.forward(inputs, true)?;
    let loss = crate::kernels::cross_entropy(&logits, labels)?;
    optimizer.backward_step(&loss, outside)?;
    // Detached: the loss would otherwise hold the whole step's graph (every activation) alive
    // until the caller drops it, overlapping the next step's.
    Ok(loss.detach())
}

impl Workload for Classification {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn mode(&self) -> Mode {
        self.mode
    }

    fn synthetic_batch(&self, size: usize, seed: u64) -> Result<Batch> {
        self.host_batch(size, seed)?.to_device(&self.device)
    }

    fn host_batch(&self, size: usize, seed: u64) -> Result<Batch> {
        let host = Device::Cpu;
        let mut rng = Rng::for_name(seed, "batch");
        let inputs = match self.info.input {
            InputShape::Image {
                channels,
                height,
                width,
            } => {
                let n = size * channels * height * width;
                let pixels = Tensor::from_vec(
                    rng.normal_vec(n, 0.0, 1.0),
                    (size, channels, height, width),
                    &Device::Cpu,
                )?;
                Inputs::Images(pixels.to_dtype(self.dtype)?)
            }
            // Full-length sequences (every position attended) of uniform random ids; the first half
            // of each sequence is segment 0, the second half segment 1, as in a sentence pair.
            InputShape::Tokens {
                seq_len,
                vocab_size,
                type_vocab_size,
            } => {
                let ids: Vec<u32> = (0..size * seq_len).map(|_| rng.below(vocab_size as u32)).collect();
                let types: Vec<u32> = (0..size * seq_len)
                    .map(|i| ((i % seq_len) * type_vocab_size.min(2) / seq_len) as u32)
                    .collect();
                Inputs::Tokens {
                    input_ids: Tensor::from_vec(ids, (size, seq_len), &host)?,
                    token_type_ids: Tensor::from_vec(types, (size, seq_len), &host)?,
                    attention_mask: Tensor::ones((size, seq_len), self.dtype, &host)?,
                }
            }
            InputShape::Prompt { .. } => unreachable!("build refuses language models"),
        };
        let labels: Vec<u32> = (0..size).map(|_| rng.below(self.info.num_classes as u32)).collect();
        let labels = Tensor::from_vec(labels, size, &host)?;
        Ok(Batch { size, inputs, labels })
    }

    fn infer(&self, batch: &Batch) -> Result<Tensor> {
        let _kernels = self.kernels.enter();
        if !self.replays_graphs() {
            return self.model.forward(&batch.inputs, false);
        }
        let mut graphs = self.graphs.lock().expect("no panic while holding the lock");
        graphs.run(&self.device, batch.inputs.tensors(), |t| {
            self.model.forward(&batch.inputs.with_tensors(t)?, false)
        })
    }

    fn train_step(&mut self, batch: &Batch) -> Result<Tensor> {
        let replays = self.replays_graphs();
        let Some(optimizer) = self.optimizer.as_mut() else {
            candle_core::bail!(
                "{} was built for inference; build it with Mode::Train to train",
                self.info.name
            )
        };
        // The backward pass and the optimizer step launch kernels too: the options cover them all.
        let _kernels = self.kernels.enter();
        let model = self.model.as_ref();
        if !replays {
            return train_once(model, optimizer, &batch.inputs, &batch.labels);
        }
        let mut tensors = batch.inputs.tensors();
        tensors.push(batch.labels.clone());
        let graphs = self.graphs.get_mut().expect("no panic while holding the lock");
        graphs.run(&self.device, tensors, |t| {
            let labels = t.last().expect("the labels were pushed last");
            train_once(model, optimizer, &batch.inputs.with_tensors(t)?, labels)
        })
    }

    fn steps_to_steady(&self) -> u64 {
        if self.replays_graphs() {
            2
        } else {
            1
        }
    }

    fn graph_stats(&self) -> GraphStats {
        self.graphs.lock().expect("no panic while holding the lock").stats()
    }

    fn graph_refusals(&self) -> Vec<String> {
        self.graphs.lock().expect("no panic while holding the lock").refusals()
    }

    fn tensors(&self) -> Vec<(String, Tensor)> {
        self.params.tensors()
    }

    fn weights(&self) -> Result<Vec<(String, Tensor)>> {
        let tensors: Vec<Tensor> = match &self.optimizer {
            Some(Optimizer::Mixed(o)) => o.masters()?,
            Some(_) => {
                let all: std::collections::HashMap<String, Tensor> = self.params.tensors().into_iter().collect();
                self.trained.iter().map(|n| all[n].clone()).collect()
            }
            None => Vec::new(),
        };
        Ok(self.trained.iter().cloned().zip(tensors).collect())
    }

    fn scale_reading(&self) -> Result<Option<ScaleReading>> {
        match &self.optimizer {
            Some(o) => o.scale_reading(),
            None => Ok(None),
        }
    }
}
