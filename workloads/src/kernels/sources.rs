//! Every CUDA source of our kernels: the `.cu` files beside the ops that launch them, each compiled
//! by NVRTC after `prelude.cuh` when its op first runs on a GPU. Present in every build, so that a
//! test can compile them all where there is no GPU (`tests/nvrtc.rs`).

/// One kernel source: the module name under which candle's loader keeps its functions, and the code.
pub struct Source {
    pub module: &'static str,
    pub code: &'static str,
}

/// Element types and reductions that every source uses; NVRTC gets no include paths, so it is
/// compiled in front of each.
pub const PRELUDE: &str = include_str!("prelude.cuh");

pub const ADAMW: Source = Source { module: "migprof_adamw", code: include_str!("adamw.cu") };
pub const ATTENTION: Source = Source { module: "migprof_attention", code: include_str!("attention.cu") };
pub const BATCH_NORM: Source = Source { module: "migprof_batch_norm", code: include_str!("batch_norm.cu") };
pub const ELEMENTWISE: Source = Source { module: "migprof_elementwise", code: include_str!("elementwise.cu") };
pub const EMBEDDING: Source = Source { module: "migprof_embedding", code: include_str!("embedding.cu") };
pub const FUSED_ATTENTION: Source = Source { module: "migprof_fused_attention", code: include_str!("fused_attention.cu") };
pub const LAYER_NORM: Source = Source { module: "migprof_layer_norm", code: include_str!("layer_norm.cu") };
pub const MAX_POOL: Source = Source { module: "migprof_max_pool", code: include_str!("max_pool.cu") };
pub const WINDOWS: Source = Source { module: "migprof_windows", code: include_str!("windows.cu") };

pub const ALL: [&Source; 9] = [&ADAMW, &ATTENTION, &BATCH_NORM, &ELEMENTWISE, &EMBEDDING, &FUSED_ATTENTION, &LAYER_NORM, &MAX_POOL, &WINDOWS];

/// NVRTC's options for every source: PTX for compute capability 8.0, which the driver compiles for
/// the GPU at hand (the bf16 conversions need sm_80).
pub const NVRTC_OPTIONS: [&str; 1] = ["--gpu-architecture=compute_80"];

/// The text NVRTC compiles for `source`.
pub fn program(source: &Source) -> String {
    format!("{PRELUDE}{}", source.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cu_file_is_listed_once_under_its_own_module() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        files.sort();
        assert_eq!(files.len(), ALL.len(), "{files:?}");
        for f in &files {
            let code = std::fs::read_to_string(dir.join(f)).unwrap();
            let listed: Vec<&Source> = ALL.iter().copied().filter(|s| s.code == code).collect();
            assert_eq!(listed.len(), 1, "{f} is listed {} times", listed.len());
            assert_eq!(listed[0].module, format!("migprof_{}", f.trim_end_matches(".cu")));
        }
    }
}
