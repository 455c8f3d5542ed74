//! Every setting that sizes memory or time, driven with 0, 1, its limit, limit+1, 2^32−1, 2^64−1, a
//! negative and a non-numeric value: each ends in a clean refusal that names the setting, or in work
//! (a row), never in a signal — no abort from an allocation, no panic.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The values every setting is driven with, around its `limit`.
fn values(limit: &str) -> Vec<String> {
    let above = limit
        .parse::<f64>()
        .map(|l| {
            if l.fract() == 0.0 {
                format!("{}", l as u64 + 1)
            } else {
                format!("{}", l * 1.5)
            }
        })
        .unwrap_or_else(|_| "x".into());
    let mut v: Vec<String> = ["0", "1", limit, &above, "4294967295", "18446744073709551615", "-1", "x"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.dedup();
    v
}

/// How one invocation ended.
enum Ended {
    /// It exited with this code, having printed this.
    Exited(i32, String),
    /// Still working after `patience` (stopped by the test): it had taken the value and begun.
    Working,
}

/// Runs migprof with `args` for at most `patience`, and asserts it did not die by a signal or a
/// panic.
fn migprof(args: &[String], out: &Path, patience: Duration) -> Ended {
    let mut child = Command::new(env!("CARGO_BIN_EXE_migprof"))
        .args(args)
        .current_dir(out)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut text = String::new();
            child.stdout.take().unwrap().read_to_string(&mut text).unwrap();
            child.stderr.take().unwrap().read_to_string(&mut text).unwrap();
            use std::os::unix::process::ExitStatusExt;
            assert!(
                status.signal().is_none(),
                "migprof {}: killed by signal {:?}\n{text}",
                args.join(" "),
                status.signal()
            );
            assert!(
                !text.contains("panicked") && !text.contains("memory allocation of"),
                "migprof {}: {text}",
                args.join(" ")
            );
            return Ended::Exited(status.code().unwrap(), text);
        }
        if started.elapsed() > patience {
            child.kill().unwrap();
            child.wait().unwrap();
            return Ended::Working;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether a refusal names the setting: as given (`--batch`, `prompt_lens`), or as the estimate of
/// memory names what it refuses (`batch 65536`).
fn names(text: &str, setting: &str) -> bool {
    let bare = setting.trim_start_matches("--");
    text.contains(setting)
        || text.contains(&format!("{} ", bare.replace('-', "_")))
        || text.contains(&format!("{bare} "))
}

/// Drives `flag` of `base` with [`values`] around `limit`: a refusal names the flag.
fn drive<S: AsRef<str>>(base: &[S], flag: &str, limit: &str) {
    let dir = tempfile::tempdir().unwrap();
    for value in values(limit) {
        let mut args: Vec<String> = base.iter().map(|s| s.as_ref().to_string()).collect();
        args.extend([flag.to_string(), value.clone()]);
        args.extend(["--out".to_string(), dir.path().join("out").display().to_string()]);
        match migprof(&args, dir.path(), Duration::from_secs(20)) {
            Ended::Exited(0, _) | Ended::Working => {}
            Ended::Exited(_, text) => assert!(
                names(&text, flag),
                "migprof {}: a refusal that does not name {flag}:\n{text}",
                args.join(" ")
            ),
        }
    }
}

#[test]
fn run_s_sizes_and_spans_are_refused_by_name_or_taken() {
    let generate = [
        "run",
        "--model",
        "llama_tiny",
        "--device",
        "cpu",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--kv-layout",
        "paged",
    ];
    for (flag, limit) in [
        ("--batch", "65536"),
        ("--prompt-len", "1048576"),
        ("--output-len", "1048576"),
        ("--kv-block-size", "4096"),
    ] {
        drive(&generate, flag, limit);
    }
    drive(
        &["run", "--model", "bert_tiny", "--device", "cpu", "--iters", "1"],
        "--seq-len",
        "1048576",
    );
    let resnet = ["run", "--model", "resnet_tiny", "--device", "cpu"];
    drive(&resnet, "--iters", "100000000");
    drive(&resnet, "--duration", "86400");
    let timed = [&resnet[..], &["--duration", "0.1"]].concat();
    drive(&timed, "--warmup", "100000000");
    drive(&timed, "--min-iters", "100000000");
    drive(&timed, "--warmup-secs", "86400");
}

#[test]
fn load_s_rates_sizes_and_spans_are_refused_by_name_or_taken() {
    let encoder = [
        "load",
        "--model",
        "resnet_tiny",
        "--device",
        "cpu",
        "--qps",
        "50",
        "--duration",
        "0.5",
    ];
    drive(&encoder[..5], "--qps", "1000000");
    drive(&encoder[..7], "--duration", "86400");
    for (flag, limit) in [
        ("--max-batch", "65536"),
        ("--max-delay-ms", "86400000"),
        ("--slo-p99-ms", "86400000"),
        ("--min-requests", "2500000"),
        ("--warmup", "0.25"),
    ] {
        drive(&encoder, flag, limit);
    }
    let llm = [
        "load",
        "--model",
        "llama_tiny",
        "--device",
        "cpu",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--prompt-len",
        "8",
        "--output-len",
        "4",
        "--drain",
        "5",
    ];
    drive(&llm, "--qps", "1000000");
    let fixed = [&llm[..], &["--qps", "2"]].concat();
    for (flag, limit) in [
        ("--max-batched-tokens", "1048576"),
        ("--max-seqs", "65536"),
        ("--kv-block-size", "4096"),
        ("--kv-blocks", "16777216"),
        ("--kv-cache-fraction", "1"),
        ("--drain", "86400"),
    ] {
        drive(&fixed, flag, limit);
    }
    let search = [&llm[..], &["--qps", "2", "--search", "--slo-ttft-p99-ms", "1000"]].concat();
    drive(&search, "--slo-tpot-p99-ms", "86400000");
    let search = [&search[..], &["--slo-tpot-p99-ms", "1000"]].concat();
    drive(&search, "--max-steps", "1000");
}

/// A sweep file's keys, read as `sweep --dry-run` reads them: a refusal names the key.
#[test]
fn sweep_keys_are_refused_by_name_or_taken() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, &str); 8] = [
        ("[[matrix]]\nmodels = [\"resnet_tiny\"]\n", "batches", "65536"),
        ("[[matrix]]\nmodels = [\"bert_tiny\"]\nbatches = [1]\n", "seq_lens", "1048576"),
        ("[[matrix]]\nmodels = [\"llama_tiny\"]\nmodes = [\"generate\"]\nbatches = [1]\n", "prompt_lens", "1048576"),
        ("[[matrix]]\nmodels = [\"llama_tiny\"]\nmodes = [\"generate\"]\nbatches = [1]\n", "output_lens", "1048576"),
        ("[[matrix]]\nmodels = [\"llama_tiny\"]\nmodes = [\"generate\"]\nbatches = [1]\nkv_layouts = [\"paged\"]\n", "kv_block_size", "4096"),
        ("[[capacity]]\nmodels = [\"resnet_tiny\"]\nslo_p99_ms = 50\n", "max_batch", "65536"),
        ("[[capacity]]\nmodels = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 64\noutput_len = 16\n", "max_seqs", "65536"),
        ("[[capacity]]\nmodels = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 64\noutput_len = 16\n", "kv_blocks", "16777216"),
    ];
    for (section, key, limit) in cases {
        for value in values(limit) {
            let written = match (key, value.parse::<f64>()) {
                ("batches" | "seq_lens" | "prompt_lens" | "output_lens", Ok(_)) => format!("[{value}]"),
                ("batches" | "seq_lens" | "prompt_lens" | "output_lens", Err(_)) => format!("[\"{value}\"]"),
                (_, Ok(_)) => value.clone(),
                (_, Err(_)) => format!("\"{value}\""),
            };
            let file = dir.path().join("sweep.toml");
            std::fs::write(
                &file,
                format!(
                    "name = \"bounds\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n{section}{key} = {written}\n"
                ),
            )
            .unwrap();
            let out = dir.path().join("out");
            let args: Vec<String> = [
                "sweep",
                file.to_str().unwrap(),
                "--dry-run",
                "--out",
                out.to_str().unwrap(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            match migprof(&args, dir.path(), Duration::from_secs(20)) {
                Ended::Exited(0, _) | Ended::Working => {}
                Ended::Exited(_, text) => assert!(
                    names(&text, key),
                    "{key} = {written}: a refusal that does not name it:\n{text}"
                ),
            }
        }
    }
}
