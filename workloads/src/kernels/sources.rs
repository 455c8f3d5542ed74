//! Every CUDA source of our kernels: the `.cu` files beside the ops that launch them, each compiled
//! by NVRTC after `prelude.cuh` when its op first runs on a GPU. Present in every build, so that a
//! test can compile them all where there is no GPU (`tests/nvrtc.rs`).

use std::sync::OnceLock;

/// One kernel source: the module name under which candle's loader keeps its functions, the code, the
/// architectures it is compiled for, and its PTX for each once NVRTC has compiled it (or NVRTC's
/// refusal), kept for the life of the process.
pub struct Source {
    pub module: &'static str,
    pub code: &'static str,
    /// Whether the source has code for Hopper (compute capability 9.0) that a GPU of 9.0 or later
    /// runs: compiled for [`Arch::Hopper`] there, for [`Arch::Ampere`] elsewhere.
    pub hopper: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) ptx: [OnceLock<Result<String, String>>; 2],
    /// Constants the code shares with the Rust side that launches it, handed to NVRTC as
    /// `#define NAME value` ahead of the code: each is written once, in Rust, beside its reason.
    pub defines: &'static [(&'static str, usize)],
}

impl Source {
    const fn new(module: &'static str, code: &'static str, defines: &'static [(&'static str, usize)]) -> Source {
        Source {
            module,
            code,
            hopper: false,
            ptx: [OnceLock::new(), OnceLock::new()],
            defines,
        }
    }

    /// A source whose kernels use Hopper's instructions where the GPU has them (each behind
    /// `__CUDA_ARCH__ >= 900`, so that its Ampere build is whole).
    const fn with_hopper(
        module: &'static str,
        code: &'static str,
        defines: &'static [(&'static str, usize)],
    ) -> Source {
        Source {
            module,
            code,
            hopper: true,
            ptx: [OnceLock::new(), OnceLock::new()],
            defines,
        }
    }

    /// The architectures NVRTC compiles this source for, on some GPU or other.
    pub fn arches(&self) -> &'static [Arch] {
        match self.hopper {
            true => &[Arch::Ampere, Arch::Hopper],
            false => &[Arch::Ampere],
        }
    }

    /// The architecture this source is compiled for on a GPU of compute capability `major`.
    pub fn arch_for(&self, major: i32) -> Arch {
        match self.hopper && major >= 9 {
            true => Arch::Hopper,
            false => Arch::Ampere,
        }
    }
}

/// The virtual architecture NVRTC compiles PTX for; the driver compiles that PTX for the GPU at hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// compute_80: every GPU migprof runs its kernels on (the bf16 conversions need sm_80).
    Ampere = 0,
    /// compute_90: programmatic dependent launch (`griddepcontrol`), which lets a kernel start while
    /// the one before it finishes.
    Hopper = 1,
}

impl Arch {
    /// NVRTC's options for a source compiled for this architecture.
    pub fn nvrtc_options(self) -> [&'static str; 1] {
        match self {
            Arch::Ampere => ["--gpu-architecture=compute_80"],
            Arch::Hopper => ["--gpu-architecture=compute_90"],
        }
    }
}

/// Element types and reductions that every source uses; NVRTC gets no include paths, so it is
/// compiled in front of each.
pub const PRELUDE: &str = include_str!("prelude.cuh");

pub static ADAMW: Source = Source::new("migprof_adamw", include_str!("adamw.cu"), &[]);
pub static ATTENTION: Source = Source::new(
    "migprof_attention",
    include_str!("attention.cu"),
    &[("KEEP", super::defines::attention::KEEP_KEYS)],
);
pub static BATCH_NORM: Source = Source::new("migprof_batch_norm", include_str!("batch_norm.cu"), &[]);
pub static DECODE: Source = Source::with_hopper(
    "migprof_decode",
    include_str!("decode.cu"),
    &[
        ("DEC_WARPS", super::defines::decode::WARPS),
        ("DEC_UNROLL", super::defines::decode::WORDS_IN_FLIGHT),
        ("DA_CHUNK", super::defines::decode::CHUNK),
        ("DA_THREADS", super::defines::decode::ATTENTION_THREADS),
        ("DA_MAX_GROUP", super::defines::decode::MAX_GROUP),
        ("NORM_MAX", super::defines::decode::NORM_MAX),
        ("DC_THREADS", super::defines::decode::COMBINE_THREADS),
        ("AM_THREADS", super::defines::decode::ARGMAX_THREADS),
    ],
);
pub static ELEMENTWISE: Source = Source::new("migprof_elementwise", include_str!("elementwise.cu"), &[]);
pub static EMBEDDING: Source = Source::new("migprof_embedding", include_str!("embedding.cu"), &[]);
pub static FUSED_ATTENTION: Source = Source::new(
    "migprof_fused_attention",
    include_str!("fused_attention.cu"),
    &[("FA_Q", super::defines::attention::FUSED_QUERIES_PER_BLOCK)],
);
pub static LAYER_NORM: Source = Source::new(
    "migprof_layer_norm",
    include_str!("layer_norm.cu"),
    &[("PER", super::defines::layer_norm::PER_THREAD)],
);
pub static LOSS: Source = Source::new("migprof_loss", include_str!("loss.cu"), &[]);
pub static MASTERS: Source = Source::new(
    "migprof_masters",
    include_str!("masters.cu"),
    &[
        ("T_", super::defines::masters::at::T),
        ("C1", super::defines::masters::at::C1),
        ("C2", super::defines::masters::at::C2),
        ("SCALE", super::defines::masters::at::SCALE),
        ("FOUND", super::defines::masters::at::FOUND),
        ("GOOD", super::defines::masters::at::GOOD),
        ("SKIPPED", super::defines::masters::at::SKIPPED),
        ("ATTEMPTED", super::defines::masters::at::ATTEMPTED),
        ("GROUP", super::defines::masters::GROUP),
        ("CHUNK", super::defines::masters::CHUNK),
    ],
);
pub static MAX_POOL: Source = Source::new("migprof_max_pool", include_str!("max_pool.cu"), &[]);
pub static POSITIONS: Source = Source::new("migprof_positions", include_str!("positions.cu"), &[]);
pub static PREFILL: Source = Source::new("migprof_prefill", include_str!("prefill.cu"), &[]);
pub static WINDOWS: Source = Source::new("migprof_windows", include_str!("windows.cu"), &[]);

pub static ALL: [&Source; 14] = [
    &ADAMW,
    &ATTENTION,
    &BATCH_NORM,
    &DECODE,
    &ELEMENTWISE,
    &EMBEDDING,
    &FUSED_ATTENTION,
    &LAYER_NORM,
    &LOSS,
    &MASTERS,
    &MAX_POOL,
    &POSITIONS,
    &PREFILL,
    &WINDOWS,
];

/// The text NVRTC compiles for `source`: the prelude, the constants it shares with Rust, its code.
pub fn program(source: &Source) -> String {
    let defines: String = source
        .defines
        .iter()
        .map(|(name, value)| format!("#define {name} {value}\n"))
        .collect();
    format!("{PRELUDE}{defines}{}", source.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cu_file_is_listed_once_under_its_own_module() {
        // Cargo names the package's folder when it runs the test: a binary built in another
        // checkout of the same tree (a shared build cache) reads this one's sources.
        let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
        let dir = std::path::Path::new(&root).join("src/kernels");
        // An entry gone between listing and reading (a build's temporary file) is no kernel.
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        files.sort();
        let sources: Vec<(String, String)> = files
            .iter()
            .filter_map(|f| match std::fs::read_to_string(dir.join(f)) {
                Ok(code) => Some((f.clone(), code)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => panic!("reading {f}: {e}"),
            })
            .collect();
        assert_eq!(sources.len(), ALL.len(), "{files:?}");
        for (f, code) in &sources {
            let listed: Vec<&Source> = ALL.iter().copied().filter(|s| s.code == *code).collect();
            assert_eq!(listed.len(), 1, "{f} is listed {} times", listed.len());
            assert_eq!(listed[0].module, format!("migprof_{}", f.trim_end_matches(".cu")));
        }
    }

    /// A constant handed to NVRTC is defined nowhere else (a second definition would be the one
    /// written twice) and is used by the code it is handed to.
    #[test]
    fn shared_constants_are_defined_in_rust_alone_and_used_by_their_source() {
        let mut handed = 0;
        for source in ALL {
            for (name, _) in source.defines {
                handed += 1;
                let defined = format!("#define {name} ");
                assert!(
                    !source.code.contains(&defined) && !PRELUDE.contains(&defined),
                    "{} defines {name} itself",
                    source.module
                );
                let used = source.code.match_indices(name).any(|(at, _)| {
                    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
                    !word(source.code[..at].chars().next_back()) && !word(source.code[at + name.len()..].chars().next())
                });
                assert!(used, "{} is handed {name} but does not use it", source.module);
            }
        }
        assert!(handed >= 20, "{handed} constants handed to NVRTC");
        let program = program(&DECODE);
        assert!(program.contains("#define DA_CHUNK 64\n"), "{program:.2000}");
    }
}
