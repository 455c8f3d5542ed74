//! The kernel choices that change what a step measures, as one typed value: which attention kernel,
//! whether encoder layers train as one op, how GEMM algorithms are picked, whether steps replay as
//! CUDA graphs. A run is built with one
//! [`KernelOptions`] and records its [`canonical`](KernelOptions::canonical) string, so two rows
//! measured with different kernels never look alike.
//!
//! The options reach the ops through [`KernelOptions::enter`]: a workload enters its own options for
//! the length of each step on the thread that drives the device. Why not a field of every op: the
//! choices sit deep inside candle custom ops (a GEMM plan, a fused-attention check) that layers build
//! on the fly, and candle gives a layer no context to carry them in; the thread is already the unit
//! that owns the device's handles and plans (`gemm.rs`, `conv2d.rs`).

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

/// Declares a choice: an enum whose variants each have one spelling, used by the CLI, the canonical
/// string and the parser alike, so the three cannot disagree. A variant may also have older
/// spellings (`| "alias"`) that the parser and the CLI still accept.
macro_rules! choice {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $text:literal $(| $alias:literal)*),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            /// Every spelling, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// Older spellings still accepted, each with the name it stands for.
            pub const ALIASES: &'static [(&'static str, &'static str)] = &[$($(($alias, $text),)*)+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl FromStr for $name {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text $(| $alias)* => Ok($name::$variant),)+
                    other => Err(format!("`{other}` is not one of {}", $name::NAMES.join(", "))),
                }
            }
        }
    };
}

choice! {
    /// Attention's forward on CUDA devices.
    Attention {
        /// One kernel where the shape allows it (see `kernels::attention::runs_fused`), composed
        /// elsewhere.
        Fused = "fused",
        /// Always products, softmax and head moves, as separate kernels.
        Composed = "composed",
    }
}

choice! {
    /// How a transformer encoder layer (ViT, BERT), a Swin block and a ResNet residual block train
    /// on CUDA devices.
    EncoderLayers {
        /// One graph edge per layer or block with a hand-written backward (`models::encoder`,
        /// `models::swin_block`, `models::residual`).
        Fused = "fused" | "op",
        /// The layer's or block's ops, each its own edge of candle's graph.
        Composed = "composed" | "ops",
    }
}

impl EncoderLayers {
    /// The spelling in the canonical string: `op` and `ops`, as every v5 row and cell id has it, so
    /// that the names the CLI gives them changed neither.
    pub fn recorded(self) -> &'static str {
        match self {
            EncoderLayers::Fused => "op",
            EncoderLayers::Composed => "ops",
        }
    }
}

choice! {
    /// How each cuBLASLt product's algorithm is chosen, once per shape.
    GemmAlgorithm {
        /// The fastest of the heuristic's candidates, timed on first use.
        Timed = "timed",
        /// The heuristic's first guess, as PyTorch launches.
        Heuristic = "heuristic",
    }
}

choice! {
    /// Whether a step on a CUDA device replays a CUDA graph of its kernels (see `crate::graphs`).
    CudaGraphs {
        /// Inference steps captured at the second step of each shape and replayed from the third
        /// on; training steps launched kernel by kernel.
        Infer = "infer",
        /// Inference and training steps captured and replayed (a training step's replay moves
        /// every parameter as the uncaptured step does: `workloads/tests/graphs.rs`).
        On = "on",
        /// Every kernel launched from the host at every step.
        Off = "off",
    }
}

choice! {
    /// The layout ResNet's convolutions run in on CUDA devices built with cuDNN, in half types and
    /// TF32 (f32 without TF32 and other devices stay NCHW).
    Convolutions {
        /// NHWC on cuDNN's graph API: for inference each convolution with its folded batch norm,
        /// residual add and ReLU as one fused kernel where cuDNN's engines take it; for training
        /// the convolution and its two backward passes, batch norm over NHWC (`kernels::conv_nhwc`,
        /// `kernels::batch_norm`).
        Nhwc = "nhwc",
        /// NCHW on cuDNN's legacy convolution calls (for inference batch norm folded), ReLU and
        /// add as our kernels.
        Nchw = "nchw",
    }
}

/// Every kernel choice of a run. The default is what migprof measures unless told otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelOptions {
    pub attention: Attention,
    pub layers: EncoderLayers,
    pub gemm: GemmAlgorithm,
    pub graphs: CudaGraphs,
    pub convs: Convolutions,
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self {
            attention: Attention::Fused,
            layers: EncoderLayers::Fused,
            gemm: GemmAlgorithm::Timed,
            graphs: CudaGraphs::On,
            convs: Convolutions::Nhwc,
        }
    }
}

thread_local! {
    static ACTIVE: Cell<Option<KernelOptions>> = const { Cell::new(None) };
}

/// While alive, the options the ops on this thread use; the ones before come back when dropped.
#[must_use = "the options apply only while the guard lives"]
pub struct Entered {
    previous: Option<KernelOptions>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        ACTIVE.with(|a| a.set(self.previous));
    }
}

impl KernelOptions {
    /// The version of the canonical string's format: bumped when a key is added or reaches steps it
    /// did not, so that an old row keeps meaning what it meant when it was written. 2: `graphs` (a
    /// v1 row ran without CUDA graphs); 3: `convs` (v1 and v2 rows ran ResNet in NCHW); 4: `convs`
    /// and `layers` reach ResNet's training steps (a v3 row trained ResNet over NCHW with blocks
    /// built of ops, whatever the two said; its other steps ran as a v4 row's); 5: `layers` reaches
    /// Swin's training steps (a v4 row trained Swin with blocks built of ops, whatever `layers`
    /// said; its other steps ran as a v5 row's); 6: `graphs` reaches language models' decode steps
    /// over a contiguous cache (a v5 row decoded op by op, whatever `graphs` said; its other steps
    /// ran as a v6 row's); 7: `attention` and `layers` reach language models (a v6 row ran a
    /// decoder's prefill attention and its decode steps as candle's ops, whatever the two said; its
    /// other steps ran as a v7 row's); 8: `attention` reaches a chunked prompt's later prefill
    /// pieces (a v7 row ran them as candle's ops, whatever `attention` said; its other steps ran as
    /// a v8 row's).
    pub const VERSION: u32 = 8;

    /// `v8;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc`: the version, then every key
    /// spelled out.
    pub fn canonical(&self) -> String {
        format!(
            "v{};attention={};layers={};gemm={};graphs={};convs={}",
            Self::VERSION,
            self.attention.as_str(),
            self.layers.recorded(),
            self.gemm.as_str(),
            self.graphs.as_str(),
            self.convs.as_str()
        )
    }

    /// These options as a continuous batcher serves a language model with them: cuBLASLt's heuristic
    /// and no CUDA graphs. Its prefill pieces are of any length, and timing a product's algorithms at
    /// each new length (tens of ms) would fall on requests' first tokens for as long as new lengths
    /// come; its iterations change shape every time, and run kernel by kernel.
    pub fn serving(self) -> KernelOptions {
        KernelOptions {
            gemm: GemmAlgorithm::Heuristic,
            graphs: CudaGraphs::Off,
            ..self
        }
    }

    /// Makes these the options of the ops run on this thread until the guard is dropped.
    pub fn enter(self) -> Entered {
        Entered {
            previous: ACTIVE.with(|a| a.replace(Some(self))),
        }
    }

    /// The options entered on this thread, or the defaults where none are (an op called outside a
    /// workload's step, as the kernel tests do).
    pub fn active() -> KernelOptions {
        ACTIVE.with(|a| a.get()).unwrap_or_default()
    }
}

impl fmt::Display for KernelOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.canonical())
    }
}

impl FromStr for KernelOptions {
    type Err = String;

    /// Parses a canonical string of this version or an earlier one, whose missing keys take what its
    /// steps ran (v2 lacks `convs`: NCHW; v1 also lacks `graphs`: none; v3 to v7 have v8's keys):
    /// every key of its version exactly once, in any order.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(';');
        let version = parts.next().unwrap_or("");
        let keys: &[&str] = match version {
            "v8" | "v7" | "v6" | "v5" | "v4" | "v3" => &["attention", "layers", "gemm", "graphs", "convs"],
            "v2" => &["attention", "layers", "gemm", "graphs"],
            "v1" => &["attention", "layers", "gemm"],
            _ => {
                return Err(format!(
                "kernel options `{s}`: expected version v{} (or v7, v6, v5, v4, v3, v2, v1) first, found `{version}`",
                Self::VERSION
            ))
            }
        };
        let (mut attention, mut layers, mut gemm, mut graphs, mut convs) = (None, None, None, None, None);
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("kernel options `{s}`: `{part}` is not key=value"))?;
            let repeated = match key {
                _ if !keys.contains(&key) => {
                    return Err(format!(
                        "kernel options `{s}`: unknown key `{key}` (keys of {version}: {})",
                        keys.join(", ")
                    ))
                }
                "attention" => attention
                    .replace(value.parse::<Attention>().map_err(|e| format!("attention: {e}"))?)
                    .is_some(),
                "layers" => layers
                    .replace(value.parse::<EncoderLayers>().map_err(|e| format!("layers: {e}"))?)
                    .is_some(),
                "gemm" => gemm
                    .replace(value.parse::<GemmAlgorithm>().map_err(|e| format!("gemm: {e}"))?)
                    .is_some(),
                "graphs" => graphs
                    .replace(value.parse::<CudaGraphs>().map_err(|e| format!("graphs: {e}"))?)
                    .is_some(),
                _ => convs
                    .replace(value.parse::<Convolutions>().map_err(|e| format!("convs: {e}"))?)
                    .is_some(),
            };
            if repeated {
                return Err(format!("kernel options `{s}`: `{key}` given twice"));
            }
        }
        if version == "v1" {
            graphs.get_or_insert(CudaGraphs::Off);
        }
        if version == "v2" || version == "v1" {
            convs.get_or_insert(Convolutions::Nchw);
        }
        match (attention, layers, gemm, graphs, convs) {
            (Some(attention), Some(layers), Some(gemm), Some(graphs), Some(convs)) => Ok(Self {
                attention,
                layers,
                gemm,
                graphs,
                convs,
            }),
            _ => Err(format!(
                "kernel options `{s}`: every key is needed ({})",
                keys.join(", ")
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_canonical_string_spells_every_key_and_parses_back() {
        assert_eq!(
            KernelOptions::default().canonical(),
            "v8;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc"
        );
        let other = KernelOptions {
            attention: Attention::Composed,
            layers: EncoderLayers::Composed,
            gemm: GemmAlgorithm::Heuristic,
            graphs: CudaGraphs::Off,
            convs: Convolutions::Nchw,
        };
        assert_eq!(
            other.canonical(),
            "v8;attention=composed;layers=ops;gemm=heuristic;graphs=off;convs=nchw"
        );
        for o in [KernelOptions::default(), other] {
            assert_eq!(o.canonical().parse::<KernelOptions>(), Ok(o));
        }
        assert_eq!(
            "v7;convs=nchw;graphs=off;gemm=heuristic;layers=ops;attention=composed".parse::<KernelOptions>(),
            Ok(other)
        );
    }

    #[test]
    fn encoder_layers_are_named_for_what_they_do_and_recorded_as_before() {
        assert_eq!(EncoderLayers::NAMES, ["fused", "composed"]);
        for (name, old) in [("fused", "op"), ("composed", "ops")] {
            let layers: EncoderLayers = name.parse().unwrap();
            assert_eq!(old.parse::<EncoderLayers>(), Ok(layers), "{old} still names {name}");
            assert_eq!(layers.as_str(), name);
            assert_eq!(layers.recorded(), old);
        }
        let e = "one".parse::<EncoderLayers>().unwrap_err();
        assert!(e.contains("fused, composed"), "{e}");
        let composed = KernelOptions {
            layers: EncoderLayers::Composed,
            ..KernelOptions::default()
        };
        assert_eq!(
            composed.canonical(),
            "v8;attention=fused;layers=ops;gemm=timed;graphs=on;convs=nhwc"
        );
    }

    #[test]
    fn version_3_to_7_strings_have_the_keys_of_version_8() {
        for v in ["v3", "v4", "v5", "v6", "v7"] {
            let old = format!("{v};attention=fused;layers=ops;gemm=timed;graphs=on;convs=nhwc")
                .parse::<KernelOptions>()
                .unwrap();
            assert_eq!(
                old,
                KernelOptions {
                    layers: EncoderLayers::Composed,
                    ..KernelOptions::default()
                }
            );
            assert_eq!(
                old.canonical(),
                "v8;attention=fused;layers=ops;gemm=timed;graphs=on;convs=nhwc"
            );
        }
    }

    #[test]
    fn a_version_2_string_means_resnet_in_nchw() {
        let v2 = "v2;attention=fused;layers=op;gemm=timed;graphs=infer"
            .parse::<KernelOptions>()
            .unwrap();
        assert_eq!(
            v2,
            KernelOptions {
                convs: Convolutions::Nchw,
                graphs: CudaGraphs::Infer,
                ..KernelOptions::default()
            }
        );
        let err = "v2;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc"
            .parse::<KernelOptions>()
            .unwrap_err();
        assert!(
            err.contains("unknown key `convs`") && err.contains("keys of v2"),
            "{err}"
        );
    }

    #[test]
    fn a_version_1_string_means_steps_without_graphs() {
        let v1 = "v1;gemm=heuristic;layers=ops;attention=composed"
            .parse::<KernelOptions>()
            .unwrap();
        assert_eq!(v1.graphs, CudaGraphs::Off);
        assert_eq!(
            v1.canonical(),
            "v8;attention=composed;layers=ops;gemm=heuristic;graphs=off;convs=nchw"
        );
        let err = "v1;attention=fused;layers=op;gemm=timed;graphs=on"
            .parse::<KernelOptions>()
            .unwrap_err();
        assert!(
            err.contains("unknown key `graphs`") && err.contains("keys of v1"),
            "{err}"
        );
    }

    #[test]
    fn malformed_strings_say_what_is_wrong() {
        let err = |s: &str| s.parse::<KernelOptions>().unwrap_err();
        assert!(err("v9;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc").contains("expected version v8"));
        assert!(err("v7;attention=fused;layers=op;gemm=timed;graphs=on").contains("every key"));
        assert!(err("v7;attention=flash;layers=op;gemm=timed;graphs=on;convs=nhwc").contains("fused, composed"));
        assert!(err("v7;attention=fused;layers=op;gemm=timed;graphs=maybe;convs=nhwc").contains("infer, on, off"));
        assert!(err("v7;attention=fused;layers=op;gemm=timed;graphs=on;convs=nwhc").contains("nhwc, nchw"));
        assert!(
            err("v7;attention=fused;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc").contains("given twice")
        );
        assert!(
            err("v6;streams=2;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc")
                .contains("unknown key `streams`")
        );
    }

    #[test]
    fn entered_options_apply_on_this_thread_until_dropped() {
        let composed = KernelOptions {
            attention: Attention::Composed,
            ..KernelOptions::default()
        };
        assert_eq!(KernelOptions::active(), KernelOptions::default());
        {
            let _outer = composed.enter();
            assert_eq!(KernelOptions::active(), composed);
            let heuristic = KernelOptions {
                gemm: GemmAlgorithm::Heuristic,
                ..composed
            };
            {
                let _inner = heuristic.enter();
                assert_eq!(KernelOptions::active(), heuristic);
                // Another thread has its own: nothing leaks across.
                std::thread::spawn(|| assert_eq!(KernelOptions::active(), KernelOptions::default()))
                    .join()
                    .unwrap();
            }
            assert_eq!(KernelOptions::active(), composed);
        }
        assert_eq!(KernelOptions::active(), KernelOptions::default());
    }
}
