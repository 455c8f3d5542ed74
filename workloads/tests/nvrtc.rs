//! Every CUDA source of our kernels compiles with NVRTC, with the options and the prelude the GPU
//! build uses when an op first runs (`kernels/nvrtc.rs`), and defines the kernels its op launches.
//! Needs NVRTC (CUDA 13) but no GPU and no CUDA build: NVRTC is loaded at run time, from
//! `MIGPROF_NVRTC` (a path to libnvrtc.so.13) or the loader's path. `#[ignore]`d, since a plain
//! machine has no NVRTC; `.ci/run` installs it from PyPI and runs it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use libloading::{Library, Symbol};
use workloads::kernels::sources::{self, Arch, Source};

type Program = *mut c_void;

/// NVRTC's C API, the six calls a compile needs.
struct Nvrtc {
    lib: Library,
    /// NVRTC opens its builtins library by name when it compiles; loaded first from NVRTC's own
    /// folder, it is found without that folder on the loader's path (as a pip install leaves it).
    _builtins: Option<Library>,
}

impl Nvrtc {
    fn load() -> Nvrtc {
        let path = std::env::var("MIGPROF_NVRTC").unwrap_or_else(|_| "libnvrtc.so.13".into());
        let builtins = std::path::Path::new(&path).with_file_name("libnvrtc-builtins.so.13.0");
        // SAFETY: loading NVRTC and its builtins runs only their own initialisers.
        let _builtins = builtins
            .is_file()
            .then(|| unsafe { Library::new(&builtins) }.expect("NVRTC's builtins load"));
        // SAFETY: as above.
        let lib = unsafe { Library::new(&path) }.unwrap_or_else(|e| {
            panic!("this test needs NVRTC and could not load {path}: {e}\n(`pip install nvidia-cuda-nvrtc==13.0.88`, then MIGPROF_NVRTC=<site-packages>/nvidia/cu13/lib/libnvrtc.so.13)")
        });
        Nvrtc { lib, _builtins }
    }

    fn symbol<T>(&self, name: &[u8]) -> Symbol<'_, T> {
        // SAFETY: each name is an NVRTC function and `T` its C signature, as in nvrtc.h.
        unsafe { self.lib.get(name) }.unwrap_or_else(|e| panic!("NVRTC lacks {}: {e}", String::from_utf8_lossy(name)))
    }

    fn check(&self, status: c_int, what: &str) {
        if status != 0 {
            let text: Symbol<unsafe extern "C" fn(c_int) -> *const c_char> = self.symbol(b"nvrtcGetErrorString\0");
            // SAFETY: NVRTC returns a static, NUL-terminated string for any status.
            let message = unsafe { CStr::from_ptr(text(status)) }.to_string_lossy();
            panic!("{what}: NVRTC status {status} ({message})");
        }
    }

    /// Compiles `code` with `options`; the PTX, or the compile log as the error.
    fn compile(&self, code: &str, name: &str, options: &[&str]) -> Result<String, String> {
        let create: Symbol<
            unsafe extern "C" fn(
                *mut Program,
                *const c_char,
                *const c_char,
                c_int,
                *const *const c_char,
                *const *const c_char,
            ) -> c_int,
        > = self.symbol(b"nvrtcCreateProgram\0");
        let compile: Symbol<unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int> =
            self.symbol(b"nvrtcCompileProgram\0");
        let log_size: Symbol<unsafe extern "C" fn(Program, *mut usize) -> c_int> =
            self.symbol(b"nvrtcGetProgramLogSize\0");
        let log: Symbol<unsafe extern "C" fn(Program, *mut c_char) -> c_int> = self.symbol(b"nvrtcGetProgramLog\0");
        let ptx_size: Symbol<unsafe extern "C" fn(Program, *mut usize) -> c_int> = self.symbol(b"nvrtcGetPTXSize\0");
        let ptx: Symbol<unsafe extern "C" fn(Program, *mut c_char) -> c_int> = self.symbol(b"nvrtcGetPTX\0");
        let destroy: Symbol<unsafe extern "C" fn(*mut Program) -> c_int> = self.symbol(b"nvrtcDestroyProgram\0");

        let (code, name) = (CString::new(code).unwrap(), CString::new(name).unwrap());
        let options: Vec<CString> = options.iter().map(|o| CString::new(*o).unwrap()).collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string or array of them of the count given;
        // buffers are sized by the size calls before they are written.
        unsafe {
            self.check(
                create(
                    &mut program,
                    code.as_ptr(),
                    name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                ),
                "nvrtcCreateProgram",
            );
            let status = compile(program, option_ptrs.len() as c_int, option_ptrs.as_ptr());
            let result = if status == 0 {
                let mut size = 0usize;
                self.check(ptx_size(program, &mut size), "nvrtcGetPTXSize");
                let mut buf = vec![0u8; size];
                self.check(ptx(program, buf.as_mut_ptr() as *mut c_char), "nvrtcGetPTX");
                Ok(String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string())
            } else {
                let mut size = 0usize;
                self.check(log_size(program, &mut size), "nvrtcGetProgramLogSize");
                let mut buf = vec![0u8; size];
                self.check(log(program, buf.as_mut_ptr() as *mut c_char), "nvrtcGetProgramLog");
                Err(String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string())
            };
            self.check(destroy(&mut program), "nvrtcDestroyProgram");
            result
        }
    }
}

/// The kernels a source defines: the names of its `extern "C" __global__` functions as NVRTC emits
/// them (`.visible .entry NAME(`).
fn entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim_start().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or("").trim().to_string())
        .collect()
}

/// Kernels the Rust side launches by name, per source: a few from each, in every dtype the ops take.
fn expected(source: &Source) -> Vec<&'static str> {
    match source.module {
        "migprof_adamw" => vec!["adamw_f32", "adamw_bf16", "adamw_f16"],
        "migprof_elementwise" => vec!["elementwise_f32_v1", "elementwise_bf16_v8", "elementwise_f16_v8"],
        // Every batch of the products and both head sizes of attention.
        "migprof_decode" => vec![
            "decode_gemv_bf16_b1",
            "decode_gemv_f16_b8",
            "decode_swiglu_bf16_b3",
            "decode_qkv_bf16_b8",
            "decode_qkv_f16_b1",
            "decode_attention_bf16_d64",
            "decode_attention_f16_d128",
            "decode_attention_combine_bf16_d128",
            "decode_attention_combine_f16_d64",
            "argmax_parts_bf16",
            "argmax_parts_f32",
            "argmax_rows",
        ],
        "migprof_embedding" => vec!["embedding_f32", "embedding_bf16"],
        "migprof_prefill" => vec![
            "rope_packed_f32",
            "rope_packed_bf16",
            "swiglu_rows_f16",
            "swiglu_rows_bf16",
        ],
        // Every block size of the f32 kernels: each shape's first launch times them all.
        "migprof_fused_attention" => vec![
            "attn_fused_bf16_d64",
            "attn_fused_f16_d128",
            "attn_fused_f32_d32_q128",
            "attn_fused_f32_d32_q64",
            "attn_fused_f32_d32_q32",
            "attn_fused_f32_d32_q16",
            "attn_fused_f32_d64_q128",
            "attn_fused_f32_d64_q64",
            "attn_fused_f32_d64_q32",
            "attn_fused_f32_d64_q16",
        ],
        "migprof_batch_norm" => vec![
            "bn_finish_bf16",
            "bn_rows_partials_bf16_v8",
            "bn_rows_f32_v4",
            "bn_rows_f16_v1",
        ],
        // Every group width of the group-per-row kernels, and the block-per-row one.
        "migprof_layer_norm" => vec![
            "layer_norm_bf16",
            "layer_norm_w4_g4_bf16",
            "layer_norm_w4_g8_f16",
            "layer_norm_w4_g16_f32",
            "layer_norm_w4_g32_bf16",
            "layer_norm_w8_g32_bf16",
            "layer_norm_w4_g4_sums_bf16",
            "layer_norm_w4_g32_sums_f32",
        ],
        "migprof_windows" => vec!["windows_w16", "windows_w2", "neighbours_w16", "neighbours_w4"],
        _ => vec![],
    }
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13; .ci/run installs it from PyPI)"]
fn every_kernel_source_compiles_with_nvrtc() {
    let nvrtc = Nvrtc::load();
    let mut failures = Vec::new();
    for source in sources::ALL {
        for &arch in source.arches() {
            match nvrtc.compile(&sources::program(source), source.module, &arch.nvrtc_options()) {
                Ok(ptx) => {
                    let defined = entries(&ptx);
                    assert!(!defined.is_empty(), "{} compiled to PTX with no kernel", source.module);
                    for name in expected(source) {
                        assert!(
                            defined.iter().any(|d| d == name),
                            "{} lacks {name}; it defines {defined:?}",
                            source.module
                        );
                    }
                    // A source's Hopper build has the instructions it is built for; its Ampere
                    // build, which every GPU loads, has none of them.
                    assert_eq!(
                        ptx.contains("griddepcontrol.wait"),
                        arch == Arch::Hopper,
                        "{} for {arch:?}",
                        source.module
                    );
                    eprintln!("{} ({arch:?}): {} kernels", source.module, defined.len());
                }
                Err(log) => failures.push(format!("{} ({arch:?}):\n{log}", source.module)),
            }
        }
    }
    assert!(
        sources::ALL.iter().any(|s| s.arches().contains(&Arch::Hopper)),
        "no source is built for Hopper"
    );
    assert!(failures.is_empty(), "NVRTC refused:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs NVRTC (libnvrtc.so.13; .ci/run installs it from PyPI)"]
fn a_broken_source_fails_with_nvrtcs_log() {
    // The check above can fail: NVRTC's log reaches the test for code that does not compile.
    let nvrtc = Nvrtc::load();
    let broken = format!(
        "{}extern \"C\" __global__ void k(float* p) {{ p[0] = undefined_name; }}\n",
        sources::PRELUDE
    );
    let log = nvrtc
        .compile(&broken, "broken", &Arch::Ampere.nvrtc_options())
        .unwrap_err();
    assert!(log.contains("undefined_name"), "{log}");
}
