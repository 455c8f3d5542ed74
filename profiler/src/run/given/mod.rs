//! What a run measures ([`WorkloadGiven`]), how long and how it is measured ([`MeasureGiven`]) and
//! the kernels it measures with ([`KernelGiven`]), each declared once for both places it is given in: `migprof run`'s flags
//! (clap) and a sweep file's `[defaults]` and `[[matrix]]` keys (serde). A field's name is its key and its
//! flag's id; its flag is `--` and the key in kebab case unless its `#[arg]` says otherwise
//! (`--duration` for `duration_secs`). What was not given takes the defaults of where it was given
//! ([`RUN`] or [`SWEEP`]), applied in [`MeasureGiven::resolve`]; the bounds are checked by the same
//! functions on both sides ([`crate::run::limits`]).
//!
//! `migprof run`'s iteration counts (`--warmup`, `--iters`, `--min-iters`) are its own: a sweep
//! measures one cell on targets whose speeds differ sevenfold, where a count of iterations would be
//! seconds on one and minutes on another.

use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::Args;
use serde::{Deserialize, Serialize};
use workloads::kernels::options::{Attention, Convolutions, CudaGraphs, EncoderLayers, GemmAlgorithm};
use workloads::kernels::KernelOptions;

use crate::run::limits::{self, parse_percent, parse_seconds};
use crate::run::measure::{Stop, Warmup};

mod workload;
pub use workload::{
    parse_model, parse_model_list, split_models, BatchSize, Place, Workload, WorkloadGiven, DEFAULT_MODEL,
};

/// The measurement settings as given: what was not given is `None`.
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasureGiven {
    /// Warm-up time in seconds (at least one iteration). Default: 1 s and at least 3 iterations
    /// (a sweep: 2 s).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--warmup-secs", s, false))]
    #[serde(default)]
    pub warmup_secs: Option<f64>,
    /// Measure for at least this many seconds and at least --min-iters iterations (0: those
    /// iterations alone). Default: 3 (a sweep: 10, and at least 10 iterations).
    #[arg(long = "duration", value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--duration", s, false))]
    #[serde(default)]
    pub duration_secs: Option<f64>,
    /// Measure until the throughput's 95% interval is within ±PCT percent of it (after --duration
    /// and --min-iters), at most --max-duration seconds; a run stopped by that bound says so in its
    /// verdict_reason.
    #[arg(long, value_name = "PCT", value_parser = parse_percent)]
    #[serde(default)]
    pub target_precision: Option<f64>,
    /// With --target-precision: the most seconds to measure however wide the interval still is
    /// (default 60).
    #[arg(long = "max-duration", value_name = "SECS", requires = "target_precision", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--max-duration", s, false))]
    #[serde(default)]
    pub max_duration_secs: Option<f64>,
    /// Sampler interval in milliseconds for GPU runs (NVML and GPM counters while measuring); 0
    /// turns the sampler off (default 100).
    #[arg(long)]
    #[serde(default)]
    pub sample_interval_ms: Option<u64>,
    /// Seeds the weights and the synthetic inputs (default 0).
    #[arg(long)]
    #[serde(default)]
    pub seed: Option<u64>,
}

/// The kernel choices a run measures with, for both places they are given: `migprof run`'s and
/// `migprof load`'s flags and a sweep's `[[matrix]]` keys of the same names. Each row records them
/// as `kernel_options`; what was not given takes [`KernelOptions::default`]'s.
#[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
#[command(next_help_heading = "Kernel options (recorded in every row as kernel_options)")]
#[serde(deny_unknown_fields)]
pub struct KernelGiven {
    /// Attention's forward on a GPU: one fused kernel where the shape allows (a language model's
    /// prefill one causal kernel, its decode steps' attention split over the cache), or products,
    /// softmax and head moves as separate kernels. Default fused.
    #[arg(long, hide_short_help = true, value_parser = choice::<Attention>(Attention::NAMES, Attention::ALIASES))]
    #[serde(default, deserialize_with = "named")]
    pub attention: Option<Attention>,

    /// ViT and BERT encoder layers, Swin blocks and ResNet's residual blocks, in training on a GPU:
    /// fused, one op each with a hand-written backward, or composed of their ops, each an edge of the
    /// gradient graph (`op` and `ops` are older names of the two; rows record them as layers=op|ops).
    /// A language model's decode steps at up to 8 sequences: fused, its projections and MLP as the
    /// decode kernels (rotary embedding, cache write, gate and residual inside), or candle's ops.
    /// Default fused.
    #[arg(long, hide_short_help = true, value_parser = choice::<EncoderLayers>(EncoderLayers::NAMES, EncoderLayers::ALIASES))]
    #[serde(default, deserialize_with = "named")]
    pub encoder_layers: Option<EncoderLayers>,

    /// cuBLASLt's algorithm per product shape: the fastest of its candidates, timed on first use, or
    /// its heuristic's first guess (what PyTorch launches). Default timed; for a language model
    /// served by `load`, whose prompts make a new shape of nearly every product, heuristic.
    #[arg(long, hide_short_help = true, value_parser = choice::<GemmAlgorithm>(GemmAlgorithm::NAMES, GemmAlgorithm::ALIASES))]
    #[serde(default, deserialize_with = "named")]
    pub gemm_algorithm: Option<GemmAlgorithm>,

    /// Steps on a GPU replayed as CUDA graphs: each shape's second step captured, every later one
    /// replayed with one launch (as torch.compile's "reduce-overhead" does), so that small batches
    /// measure the GPU and not the host's kernel launches. on: inference and training steps; infer:
    /// inference steps only; off: every kernel launched at every step. Default on.
    #[arg(long, hide_short_help = true, value_parser = choice::<CudaGraphs>(CudaGraphs::NAMES, CudaGraphs::ALIASES))]
    #[serde(default, deserialize_with = "named")]
    pub cuda_graphs: Option<CudaGraphs>,

    /// ResNet's convolutions on a GPU in half types or TF32: nhwc, on cuDNN's current engines (as
    /// PyTorch's channels_last reaches), in inference each with its batch norm, residual add and ReLU
    /// fused, in training with batch norm over NHWC; or nchw, on cuDNN's legacy calls. Default nhwc.
    #[arg(long, hide_short_help = true, value_parser = choice::<Convolutions>(Convolutions::NAMES, Convolutions::ALIASES))]
    #[serde(default, deserialize_with = "named")]
    pub convs: Option<Convolutions>,
}

impl KernelGiven {
    /// The options, what was not given taking the defaults.
    pub fn options(&self) -> KernelOptions {
        let d = KernelOptions::default();
        KernelOptions {
            attention: self.attention.unwrap_or(d.attention),
            layers: self.encoder_layers.unwrap_or(d.layers),
            gemm: self.gemm_algorithm.unwrap_or(d.gemm),
            graphs: self.cuda_graphs.unwrap_or(d.graphs),
            convs: self.convs.unwrap_or(d.convs),
        }
    }

    /// The options of a language model served by a continuous batcher
    /// ([`KernelOptions::serving`]), with the GEMM algorithm where it is given (the row says
    /// graphs=off).
    pub fn serving_options(&self) -> KernelOptions {
        let served = self.options().serving();
        KernelOptions {
            gemm: self.gemm_algorithm.unwrap_or(served.gemm),
            ..served
        }
    }
}

/// A parser that accepts exactly `names` and their older spellings `aliases` (clap lists the names
/// in the help and in its errors) and parses the one given.
pub fn choice<T>(
    names: &'static [&'static str],
    aliases: &'static [(&'static str, &'static str)],
) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    let values = names.iter().map(|&name| {
        PossibleValue::new(name).aliases(aliases.iter().filter(|(_, to)| *to == name).map(|(alias, _)| *alias))
    });
    PossibleValuesParser::new(values).map(|name| name.parse::<T>().expect("clap accepted a listed name"))
}

/// A choice as a file writes it: its name (or an older spelling), parsed as its flag parses it.
fn named<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = String>,
{
    let name = String::deserialize(d)?;
    name.parse().map(Some).map_err(serde::de::Error::custom)
}

/// What a setting not given takes, where defaults differ by where it is given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeasureDefaults {
    pub warmup_secs: f64,
    /// Iterations a warm-up of the default length runs at least; one given a length runs one.
    pub warmup_min_iterations: u64,
    pub duration_secs: f64,
}

/// `migprof run`'s: the first steps allocate and fault in memory, and on a CPU one second can be
/// one step, hence three.
pub const RUN: MeasureDefaults = MeasureDefaults {
    warmup_secs: 1.0,
    warmup_min_iterations: 3,
    duration_secs: 3.0,
};

/// A sweep's: its cells are the numbers a plan is made from.
pub const SWEEP: MeasureDefaults = MeasureDefaults {
    warmup_secs: 2.0,
    warmup_min_iterations: 1,
    duration_secs: 10.0,
};

/// The fewest iterations a measurement of a duration takes however long they take (`migprof run
/// --min-iters`'s default).
pub const MIN_ITERATIONS: u64 = 10;

/// The most seconds a run with a target precision measures when none is given.
pub const MAX_DURATION_SECS: f64 = 60.0;
const SAMPLE_INTERVAL_MS: u64 = 100;

/// Every measurement setting, given or defaulted: what a cell records.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measuring {
    pub warmup_secs: f64,
    pub warmup_min_iterations: u64,
    pub duration_secs: f64,
    /// Percent; `None`: the duration alone.
    pub target_precision: Option<f64>,
    pub max_duration_secs: f64,
    /// 0: no sampler.
    pub sample_interval_ms: u64,
    pub seed: u64,
}

impl MeasureGiven {
    /// The settings, what was not given taking `defaults`.
    pub fn resolve(&self, defaults: &MeasureDefaults) -> Measuring {
        Measuring {
            warmup_secs: self.warmup_secs.unwrap_or(defaults.warmup_secs),
            warmup_min_iterations: match self.warmup_secs {
                Some(_) => 1,
                None => defaults.warmup_min_iterations,
            },
            duration_secs: self.duration_secs.unwrap_or(defaults.duration_secs),
            target_precision: self.target_precision,
            max_duration_secs: self.max_duration_secs.unwrap_or(MAX_DURATION_SECS),
            sample_interval_ms: self.sample_interval_ms.unwrap_or(SAMPLE_INTERVAL_MS),
            seed: self.seed.unwrap_or(0),
        }
    }

    /// The bounds the flags' parsers hold, for values read from a file, each named as `at` and its
    /// key (`[defaults] duration_secs`).
    pub fn check(&self, at: &str) -> Result<(), String> {
        let name = |key: &str| format!("{at} {key}");
        for (key, value, positive) in [
            ("warmup_secs", self.warmup_secs, false),
            ("duration_secs", self.duration_secs, false),
            ("max_duration_secs", self.max_duration_secs, false),
        ] {
            if let Some(v) = value {
                limits::seconds(&name(key), v, positive)?;
            }
        }
        if let Some(p) = self.target_precision {
            parse_percent(&p.to_string()).map_err(|e| format!("{}: {e}", name("target_precision")))?;
        }
        Ok(())
    }

    /// What the flags' `requires` holds, for values read from a file.
    pub fn check_together(&self, at: &str) -> Result<(), String> {
        let name = |key: &str| format!("{at} {key}");
        if self.max_duration_secs.is_some() && self.target_precision.is_none() {
            return Err(format!(
                "{} bounds a measurement to a target precision: give target_precision too, or leave it out",
                name("max_duration_secs")
            ));
        }
        Ok(())
    }
}

/// The keys of a group of settings (a struct deriving clap's `Args`), in its order.
pub fn group_keys<T: Args>() -> Vec<String> {
    T::augment_args(clap::Command::new("keys"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect()
}

impl Measuring {
    /// The warm-up: this long, and at least this many iterations.
    pub fn warmup(&self) -> Warmup {
        Warmup::Duration {
            min: Duration::from_secs_f64(self.warmup_secs),
            min_iterations: self.warmup_min_iterations,
        }
    }

    /// The stop rule: at least the duration and `min_iterations`, then, with a target precision, on
    /// until the interval is that tight or the longest duration has passed.
    pub fn stop(&self, min_iterations: u64) -> Stop {
        let min = Duration::from_secs_f64(self.duration_secs);
        match self.target_precision {
            Some(pct) => Stop::Precision {
                target: pct / 100.0,
                min,
                max: Duration::from_secs_f64(self.max_duration_secs).max(min),
                min_iterations,
            },
            None => Stop::Duration { min, min_iterations },
        }
    }

    pub fn sample_interval(&self) -> Option<Duration> {
        (self.sample_interval_ms > 0).then(|| Duration::from_millis(self.sample_interval_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        given: MeasureGiven,
    }

    const EVERY_KEY: &str = "warmup_secs = 0.5\nduration_secs = 4\ntarget_precision = 2\nmax_duration_secs = 30\n\
                             sample_interval_ms = 50\nseed = 7";

    /// A setting added to the group is a flag and a key at once; one renamed on one side fails here.
    #[test]
    fn flags_and_keys_give_the_same_settings() {
        let flags = Flags::try_parse_from(
            "x --warmup-secs 0.5 --duration 4 --target-precision 2 --max-duration 30 --sample-interval-ms 50 --seed 7"
                .split_whitespace(),
        )
        .unwrap();
        let file: MeasureGiven = toml::from_str(EVERY_KEY).unwrap();
        assert_eq!(flags.given, file);
        let ids: Vec<String> = Flags::command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        let keys: Vec<String> = toml::from_str::<toml::Table>(EVERY_KEY)
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(sorted, keys, "the flags' ids are the keys");
        assert_eq!(ids[0], "warmup_secs", "in the struct's order");
    }

    /// Defaults by place, one rule: a run's warm-up of its default length runs three iterations, a
    /// given length one; a sweep's duration is ten seconds.
    #[test]
    fn what_is_not_given_takes_the_place_s_defaults() {
        let none = MeasureGiven::default();
        let run = none.resolve(&RUN);
        assert_eq!(
            run.warmup(),
            Warmup::Duration {
                min: Duration::from_secs(1),
                min_iterations: 3
            }
        );
        assert_eq!(
            run.stop(10),
            Stop::Duration {
                min: Duration::from_secs(3),
                min_iterations: 10
            }
        );
        assert_eq!(run.sample_interval(), Some(Duration::from_millis(100)));
        let sweep = none.resolve(&SWEEP);
        assert_eq!((sweep.warmup_secs, sweep.duration_secs), (2.0, 10.0));
        let given: MeasureGiven = toml::from_str(EVERY_KEY).unwrap();
        let m = given.resolve(&SWEEP);
        assert_eq!(
            m.stop(10),
            Stop::Precision {
                target: 0.02,
                min: Duration::from_secs(4),
                max: Duration::from_secs(30),
                min_iterations: 10
            }
        );
        assert_eq!(m.warmup_min_iterations, 1);
        assert_eq!(m.seed, 7);
        let off = MeasureGiven {
            sample_interval_ms: Some(0),
            ..MeasureGiven::default()
        };
        assert_eq!(off.resolve(&RUN).sample_interval(), None);
    }

    #[test]
    fn a_bad_value_is_refused_on_both_sides_by_name() {
        let e = Flags::try_parse_from(["x", "--duration", "-1"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--duration"), "{e}");
        let e = Flags::try_parse_from(["x", "--max-duration", "30"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--target-precision"), "{e}");
        let check = |text: &str| toml::from_str::<MeasureGiven>(text).unwrap().check("[defaults]");
        assert!(check("duration_secs = -0.5")
            .unwrap_err()
            .contains("[defaults] duration_secs"));
        assert!(check("warmup_secs = nan")
            .unwrap_err()
            .contains("[defaults] warmup_secs"));
        let e = check("target_precision = 100").unwrap_err();
        assert!(
            e.contains("[defaults] target_precision") && e.contains("below 100"),
            "{e}"
        );
        let lone: MeasureGiven = toml::from_str("max_duration_secs = 30").unwrap();
        assert!(lone.check("[defaults]").is_ok(), "each value within its bounds");
        assert!(lone
            .check_together("[defaults]")
            .unwrap_err()
            .contains("give target_precision"));
        let every: MeasureGiven = toml::from_str(EVERY_KEY).unwrap();
        assert!(every.check("[defaults]").is_ok() && every.check_together("[defaults]").is_ok());
        assert!(toml::from_str::<MeasureGiven>("duraton_secs = 1").is_err());
    }
}
