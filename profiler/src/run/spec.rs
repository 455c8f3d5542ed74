//! What to run: one model, mode, dtype and batch size with every setting that changes what is
//! measured, made from the command line's arguments and checked in this one place ([`from_args`],
//! and [`check_device`] once the device is known).

use std::time::Duration;

use anyhow::{bail, ensure, Result};
use candle_core::DType;
use workloads::kernels::KernelOptions;
use workloads::{Mode, TrainConfig};

use crate::cli::{DTypeArg, ModeArg, OptimizerArg, RunArgs};
use crate::device::OpenDevice;
use crate::run::measure::{Stop, Warmup};

/// The model of the default set: ResNet-18 inference at batch 1, 4 and 8, training at batch 4 and 8.
pub const DEFAULT_MODEL: &str = "resnet18";

/// What to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub model: String,
    pub mode: Mode,
    pub dtype: DType,
    /// f32 matmuls and convolutions may use TF32 (`--dtype tf32`); only with `dtype` f32.
    pub tf32: bool,
    pub batch: usize,
    /// Tokens per sequence for token models (their default when `None`); always `None` for images.
    pub seq_len: Option<usize>,
    /// A safetensors checkpoint to load instead of seeded random weights.
    pub weights: Option<std::path::PathBuf>,
    /// The optimizer of a training run (unused when inferring).
    pub train: workloads::TrainConfig,
    /// The kernel choices the workload runs with; recorded in the row as `kernel_options`.
    pub kernels: KernelOptions,
    pub warmup: Warmup,
    pub stop: Stop,
    pub seed: u64,
    /// How often the sampler reads the GPU's counters while measuring; `None`: no sampler.
    pub sample_interval: Option<std::time::Duration>,
}

impl RunSpec {
    /// The precision as `--dtype` names it: `tf32`, or the dtype.
    pub fn precision(&self) -> &'static str {
        precision(self.dtype, self.tf32)
    }
}

impl RunSpec {
    /// Builds the spec's workload on `device`, after setting TF32 for the process as the spec says
    /// (process-wide in cuBLAS and cuDNN: set for every run, so that a tf32 run does not leak into the
    /// f32 one after it).
    pub fn build_workload(
        &self,
        device: &candle_core::Device,
    ) -> Result<(Box<dyn workloads::Workload>, workloads::ModelInfo)> {
        workloads::precision::allow_tf32(self.tf32);
        let (_, info) = workloads::lookup_with(&self.model, self.seq_len)?;
        let cfg = workloads::WorkloadConfig {
            device: device.clone(),
            dtype: self.dtype,
            mode: self.mode,
            seed: self.seed,
            seq_len: self.seq_len,
            weights: self.weights.clone(),
            train: self.train,
            kernels: self.kernels,
        };
        let workload = workloads::build(&self.model, &cfg)
            .map_err(anyhow::Error::from)
            .map_err(|e| e.context(format!("building {}", self.model)))?;
        Ok((workload, info))
    }
}

pub(crate) fn precision(dtype: DType, tf32: bool) -> &'static str {
    if tf32 {
        "tf32"
    } else {
        dtype.as_str()
    }
}

/// Every run of `migprof run`'s arguments, in order, once every argument is known to fit the others:
/// the models and sequence length, and a weights file for exactly one model that exists.
pub fn from_args(args: &RunArgs) -> Result<Vec<RunSpec>> {
    if args.weights.is_some() && args.model.len() != 1 {
        bail!("--weights loads one checkpoint into one model: give exactly one --model");
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    let specs = cross_product(args);
    for s in &specs {
        workloads::lookup_with(&s.model, s.seq_len)?;
    }
    if args.seq_len.is_some() && specs.iter().all(|s| s.seq_len.is_none()) {
        bail!("--seq-len applies to token models (bert_*) only, and none was asked for");
    }
    Ok(specs)
}

/// The model a load job serves: inference at its max batch, with the job's dtype, sequence length,
/// weights, seed and kernels.
pub fn for_load(args: &crate::cli::LoadArgs) -> Result<RunSpec> {
    let seq_len = args.seq_len.map(|l| l as usize);
    let (_, info) = workloads::lookup_with(&args.model, seq_len)?;
    if seq_len.is_some() && info.input.seq_len().is_none() {
        bail!("--seq-len applies to token models (bert_*) only, not {}", args.model);
    }
    if let Some(w) = &args.weights {
        ensure!(w.is_file(), "--weights {}: no such file", w.display());
    }
    Ok(RunSpec {
        model: args.model.clone(),
        mode: Mode::Infer,
        dtype: args.dtype.into(),
        tf32: args.dtype == DTypeArg::Tf32,
        batch: args.max_batch,
        seq_len: info.input.seq_len().and(seq_len),
        weights: args.weights.clone(),
        train: TrainConfig::default(),
        kernels: args.kernels.options(),
        warmup: Warmup::Iterations(0),
        stop: Stop::Iterations(1),
        seed: args.seed,
        sample_interval: (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms)),
    })
}

/// What the device decides: TF32 exists only on NVIDIA tensor cores.
pub fn check_device(specs: &[RunSpec], device: &OpenDevice) -> Result<()> {
    if specs.iter().any(|s| s.tf32) && !device.device.is_cuda() {
        bail!("tf32 is a mode of NVIDIA tensor cores; on {} f32 is computed exactly: use --dtype f32 (choices: f32, bf16, f16, tf32 on a GPU)", device.info.kind)
    }
    Ok(())
}

fn takes_tokens(model: &str) -> bool {
    workloads::lookup(model).is_ok_and(|(_, info)| info.input.seq_len().is_some())
}

fn train_config(args: &RunArgs) -> TrainConfig {
    let base = match args.optimizer {
        OptimizerArg::Adamw => TrainConfig::adamw(),
        OptimizerArg::Sgd => TrainConfig::sgd(),
    };
    TrainConfig {
        lr: args.lr.unwrap_or(base.lr),
        weight_decay: args.weight_decay.unwrap_or(base.weight_decay),
        ..base
    }
}

fn warmup_rule(args: &RunArgs) -> Warmup {
    match (args.warmup, args.warmup_secs) {
        (Some(n), _) => Warmup::Iterations(n),
        (None, Some(secs)) => Warmup::Duration {
            min: Duration::from_secs_f64(secs),
            min_iterations: 1,
        },
        // The first steps allocate and fault in memory; on a CPU one second can be one step.
        (None, None) => Warmup::Duration {
            min: Duration::from_secs(1),
            min_iterations: 3,
        },
    }
}

/// The default set's precision when no stop rule is given: ±5% on the throughput within 20 s a run,
/// which the 2-core build box reaches for ResNet-18 in about a minute and a half in all.
const DEFAULT_SET_PRECISION: (f64, f64) = (5.0, 20.0);

/// `--iters` exactly; else at least `--duration` (3 s) and `--min-iters`, and with
/// `--target-precision` on until the interval is tight enough or `--max-duration` has passed. The
/// default set, given no rule, measures to [`DEFAULT_SET_PRECISION`].
fn stop_rule(args: &RunArgs, defaults_only: bool) -> Stop {
    let min = Duration::from_secs_f64(args.duration.unwrap_or(3.0));
    let (precision, max) = match (args.target_precision, defaults_only && args.duration.is_none()) {
        (Some(p), _) => (Some(p), args.max_duration),
        (None, true) => (Some(DEFAULT_SET_PRECISION.0), DEFAULT_SET_PRECISION.1),
        (None, false) => (None, args.max_duration),
    };
    match (args.iters, precision) {
        (Some(n), _) => Stop::Iterations(n),
        (None, Some(pct)) => Stop::Precision {
            target: pct / 100.0,
            min,
            max: Duration::from_secs_f64(max).max(min),
            min_iterations: args.min_iters,
        },
        (None, None) => Stop::Duration {
            min,
            min_iterations: args.min_iters,
        },
    }
}

/// Every run to make, in order: model, then mode, then dtype, then batch. Unset lists take the
/// default set's values.
fn cross_product(args: &RunArgs) -> Vec<RunSpec> {
    let defaults_only = args.model.is_empty() && args.mode.is_empty() && args.batch.is_empty();
    let models = if args.model.is_empty() {
        vec![DEFAULT_MODEL.to_string()]
    } else {
        args.model.clone()
    };
    let modes = if args.mode.is_empty() {
        if defaults_only {
            vec![ModeArg::Infer, ModeArg::Train]
        } else {
            vec![ModeArg::Infer]
        }
    } else {
        args.mode.clone()
    };
    let batches_for = |mode: ModeArg| -> Vec<usize> {
        match (args.batch.is_empty(), defaults_only, mode) {
            (false, _, _) => args.batch.clone(),
            (true, true, ModeArg::Train) => vec![4, 8],
            (true, true, ModeArg::Infer) => vec![1, 4, 8],
            (true, false, _) => vec![1],
        }
    };
    let mut specs = Vec::new();
    for model in &models {
        for &mode in &modes {
            for &dtype in &args.dtype {
                for batch in batches_for(mode) {
                    specs.push(RunSpec {
                        model: model.clone(),
                        mode: mode.into(),
                        dtype: dtype.into(),
                        tf32: dtype == DTypeArg::Tf32,
                        batch,
                        seq_len: args.seq_len.filter(|_| takes_tokens(model)).map(|l| l as usize),
                        weights: args.weights.clone(),
                        train: train_config(args),
                        kernels: args.kernels.options(),
                        warmup: warmup_rule(args),
                        stop: stop_rule(args, defaults_only),
                        seed: args.seed,
                        sample_interval: (args.sample_interval_ms > 0)
                            .then(|| Duration::from_millis(args.sample_interval_ms)),
                    });
                }
            }
        }
    }
    specs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

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
        from_args(&args(line)).unwrap()
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
            "v5;attention=composed;layers=ops;gemm=heuristic;graphs=off;convs=nchw"
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
        let err = |line: &str| from_args(&args(line)).unwrap_err().to_string();
        assert!(err("--model resnet_tiny,vit_tiny --weights w.safetensors").contains("exactly one --model"));
        assert!(err("--model resnet_tiny --weights /nonexistent.safetensors").contains("no such file"));
        assert!(err("--model resnet_tiny --seq-len 32").contains("--seq-len applies to token models"));
    }

    #[test]
    fn tf32_is_refused_on_the_cpu() {
        let device = crate::device::DeviceSpec::Cpu.open().unwrap();
        let e = check_device(&runs("--dtype tf32"), &device).unwrap_err().to_string();
        assert!(
            e.contains("tf32 is a mode of NVIDIA tensor cores") && e.contains("f32, bf16, f16"),
            "{e}"
        );
        check_device(&runs("--dtype f32"), &device).unwrap();
    }
}
