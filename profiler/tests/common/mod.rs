//! What the tests that run the `migprof` binary share: starting it, reading what it printed, and
//! reading columns of the tables it wrote. Each test file uses some of it.
#![allow(dead_code)]

use std::process::{Command, Output};

use polars::prelude::*;

/// The binary under test, to give arguments to. Each call gets a temporary folder of its own: the
/// claims a sweep holds on this machine's devices live there, so tests running side by side do not
/// wait for each other's CPU (a test that means two sweeps to meet gives them one `TMPDIR`).
pub fn migprof() -> Command {
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!("migprof-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("a temporary folder");
    let mut command = Command::new(env!("CARGO_BIN_EXE_migprof"));
    command.env("TMPDIR", tmp);
    command
}

/// Fails the test, saying how to get it, where python3 cannot import pyarrow: the tests of the
/// scripts that read a results folder as users do need it (.ci/run installs it).
pub fn require_pyarrow() {
    let has_pyarrow = Command::new("python3")
        .args(["-c", "import pyarrow"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        has_pyarrow,
        "this test needs python3 with pyarrow (`python3 -m pip install pyarrow`)"
    );
}

/// The binary run with `args` to its end.
pub fn run(args: &[&str]) -> Output {
    migprof().args(args).output().expect("migprof runs")
}

/// Standard output, then standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `migprof report` of `dirs` written to `out` (with `extra` arguments), which must succeed: the page.
pub fn report(dirs: &[&std::path::Path], out: &std::path::Path, extra: &[&str]) -> String {
    let mut args = vec!["report".to_string()];
    args.extend(dirs.iter().map(|d| d.display().to_string()));
    args.extend(["--out".to_string(), out.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    std::fs::read_to_string(out).unwrap()
}

/// A column as numbers, nulls as `None`.
pub fn numbers(df: &DataFrame, name: &str) -> Vec<Option<f64>> {
    df.column(name)
        .unwrap()
        .cast(&DataType::Float64)
        .unwrap()
        .f64()
        .unwrap()
        .iter()
        .collect()
}

/// A column as numbers that are never null.
pub fn f64s(df: &DataFrame, name: &str) -> Vec<f64> {
    numbers(df, name)
        .into_iter()
        .map(|v| v.unwrap_or_else(|| panic!("a null in {name}")))
        .collect()
}

/// A column as text, nulls as "".
pub fn strings(df: &DataFrame, name: &str) -> Vec<String> {
    df.column(name)
        .unwrap()
        .cast(&DataType::String)
        .unwrap()
        .str()
        .unwrap()
        .iter()
        .map(|v| v.unwrap_or("").to_string())
        .collect()
}

/// A file of the repository, as text (`docs/schema.md`).
pub fn repo_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The names a page does not mention in backticks (`name`).
pub fn undocumented<'a>(page: &str, names: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    names
        .into_iter()
        .filter(|n| !page.contains(&format!("`{n}`")))
        .map(str::to_string)
        .collect()
}

/// Every column of a table.
pub fn columns(df: &DataFrame) -> Vec<String> {
    df.get_column_names().iter().map(|c| c.to_string()).collect()
}

/// Writes `model` as a Hugging Face folder of Qwen2's tiny preset with seeded weights, as a user's
/// fine-tune would be laid out; its config.
pub fn hf_folder(model: &std::path::Path) -> workloads::models::decoder::Config {
    std::fs::create_dir_all(model).unwrap();
    std::fs::write(
        model.join("config.json"),
        repo_file("workloads/configs/qwen2_tiny.json"),
    )
    .unwrap();
    let cfg = workloads::models::decoder::preset("qwen2_tiny").unwrap();
    let weights =
        workloads::models::decoder::random_weights(&cfg, 9, &candle_core::Device::Cpu, candle_core::DType::F32)
            .unwrap();
    candle_core::safetensors::save(&weights, model.join("model.safetensors")).unwrap();
    cfg
}

/// Every `.rs` file under `dir`, at any depth, added to `out`.
pub fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}
