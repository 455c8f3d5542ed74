//! Generate runs of the tiny language models end to end on CPU: the row and its samples, a user's own
//! Hugging Face folder, sweeps, and the errors that come before any work.

use std::path::Path;

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

fn generate(out: &Path, extra: &[&str]) -> std::process::Output {
    let out = out.to_str().unwrap();
    let mut args = vec!["run", "--device", "cpu", "--out", out, "--warmup", "1"];
    args.extend_from_slice(extra);
    run(&args)
}

/// llama_tiny at batch 2: 3 generations of a 16-token prompt and 5 output tokens. No --mode: a
/// language model generates.
const TINY_GENERATION: [&str; 10] = [
    "--model",
    "llama_tiny",
    "--batch",
    "2",
    "--prompt-len",
    "16",
    "--output-len",
    "5",
    "--iters",
    "3",
];

#[test]
fn a_generation_row_has_its_lengths_prefills_cache_and_decode_steps() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let o = generate(&out, &TINY_GENERATION);
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    assert!(log.contains("3 generations, time to first token p50"), "{log}");
    assert!(log.contains("TTFT p50 ms") && log.contains("decode tokens/s"), "{log}");

    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(runs.height(), 1);
    assert_eq!(strings(&runs, "mode"), vec!["generate"]);
    assert_eq!(strings(&runs, "family"), vec!["llama"]);
    assert_eq!(strings(&runs, "kv_layout"), vec!["contiguous"]);
    assert_eq!(f64s(&runs, "prompt_len"), vec![16.0]);
    assert_eq!(f64s(&runs, "output_len"), vec![5.0]);
    assert_eq!(f64s(&runs, "generations"), vec![3.0]);
    // Three whole generations of four decode steps each.
    assert_eq!(f64s(&runs, "iterations"), vec![12.0]);
    // llama_tiny: 2 layers × 2 kv heads × 16 dims × (k, v) × 4 bytes = 512 bytes a token, and a
    // sequence holds its prompt and the 4 tokens fed back.
    assert_eq!(f64s(&runs, "kv_cache_bytes_per_seq"), vec![512.0 * 20.0]);
    assert_eq!(f64s(&runs, "kv_cache_bytes"), vec![2.0 * 512.0 * 20.0]);
    let (tput, decode) = (f64s(&runs, "throughput"), f64s(&runs, "decode_tokens_per_s"));
    assert_eq!(
        tput, decode,
        "a generation's throughput is its decode tokens per second"
    );
    assert!((decode[0] - 2.0 * 1000.0 / f64s(&runs, "mean_ms")[0]).abs() < 1e-9 * decode[0]);
    let (ttft, prefill) = (f64s(&runs, "ttft_mean_ms")[0], f64s(&runs, "prefill_tokens_per_s")[0]);
    assert!(
        (prefill - 2.0 * 16.0 * 1000.0 / ttft).abs() < 1e-6 * prefill,
        "{prefill} {ttft}"
    );
    assert!(f64s(&runs, "ttft_p50_ms")[0] <= f64s(&runs, "ttft_p99_ms")[0]);
    // The FLOPs of a decoded token at its mean context (16 + 2.5 tokens attended).
    let cfg = workloads::lookup("llama_tiny").unwrap().1.decoder.unwrap();
    let mean: u64 = (1..=4).map(|i| cfg.flops_per_token(16 + i)).sum::<u64>() / 4;
    assert_eq!(f64s(&runs, "flops_per_sample"), vec![mean as f64]);

    // The samples: 12 decode steps and 3 prefills, told apart.
    let samples = read_table(&out, Table::Samples).unwrap();
    let phases = strings(&samples, "phase");
    assert_eq!(phases.iter().filter(|p| *p == "decode").count(), 12);
    assert_eq!(phases.iter().filter(|p| *p == "prefill").count(), 3);
    // And the folder is sound as `check` reads it: steps against iterations, prefills against
    // generations.
    let o = run(&["check", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));

    // The same run with a paged cache: blocks of 8 tokens, 20 a sequence take 3 blocks (24 slots).
    let paged_args = [&TINY_GENERATION[..], &["--kv-layout", "paged", "--kv-block-size", "8"]].concat();
    let o = generate(&out, &paged_args);
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let paged: Vec<usize> = (0..runs.height())
        .filter(|&i| strings(&runs, "kv_layout")[i] == "paged")
        .collect();
    assert_eq!(paged.len(), 1);
    assert_eq!(numbers(&runs, "kv_block_size")[paged[0]], Some(8.0));
    assert_eq!(numbers(&runs, "kv_cache_bytes_per_seq")[paged[0]], Some(512.0 * 24.0));
    let ids = strings(&runs, "cell_id");
    assert_ne!(ids[0], ids[1], "the layout is part of the cell");
    let o = run(&["check", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn a_hugging_face_folder_runs_without_a_preset_and_keeps_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("my-finetune");
    let cfg = hf_folder(&model);
    let name = format!("hf:{}", model.display());
    let out = dir.path().join("D");
    let o = generate(
        &out,
        &[
            "--model",
            &name,
            "--prompt-len",
            "8",
            "--output-len",
            "3",
            "--iters",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "model"), vec![name.clone()]);
    assert_eq!(strings(&runs, "family"), vec!["qwen2"]);
    assert_eq!(f64s(&runs, "params"), vec![cfg.params() as f64]);

    // A folder of an architecture migprof does not run is refused naming the supported ones.
    let other = dir.path().join("mistral");
    std::fs::create_dir(&other).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&repo_file("workloads/configs/llama_tiny.json")).unwrap();
    json["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    std::fs::write(other.join("config.json"), json.to_string()).unwrap();
    let o = generate(&out, &["--model", &format!("hf:{}", other.display())]);
    assert!(!o.status.success());
    let e = text(&o);
    assert!(
        e.contains("architecture `MistralForCausalLM` is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM"),
        "{e}"
    );
    // --weights belongs to the presets.
    let o = generate(
        &out,
        &[
            "--model",
            &name,
            "--weights",
            model.join("model.safetensors").to_str().unwrap(),
        ],
    );
    assert!(
        !o.status.success() && text(&o).contains("carries its own weights"),
        "{}",
        text(&o)
    );
    // Nothing failed after the first run: it alone is in the folder.
    assert_eq!(read_table(&out, Table::Runs).unwrap().height(), 1);
}

#[test]
fn modes_models_and_lengths_that_do_not_go_together_are_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let refused = |extra: &[&str], expected: &str| {
        let o = generate(&out, extra);
        assert!(!o.status.success(), "{extra:?} ran");
        let e = text(&o);
        assert!(e.contains(expected), "{extra:?}: {e}");
    };
    refused(
        &["--model", "resnet_tiny", "--mode", "generate"],
        "resnet_tiny is not a language model: generate runs llama_3_2_1b",
    );
    refused(
        &["--model", "llama_tiny", "--mode", "infer"],
        "llama_tiny is a language model: its mode is generate",
    );
    refused(
        &["--model", "resnet_tiny", "--prompt-len", "8"],
        "--prompt-len applies to generate runs of language models only",
    );
    refused(
        &["--model", "llama_tiny", "--prompt-len", "250", "--output-len", "10"],
        "llama_tiny has 256 positions: --prompt-len 250 + --output-len 10 needs 259",
    );
    refused(&["--model", "llama_tiny", "--output-len", "1"], "--output-len");
    refused(
        &["--model", "resnet_tiny", "--kv-layout", "paged"],
        "--kv-layout applies to generate runs",
    );
    refused(&["--model", "llama_tiny", "--kv-layout", "ring"], "contiguous, paged");
    refused(
        &["--model", "llama_tiny", "--kv-block-size", "8"],
        "--kv-block-size 8 applies to a paged cache: --kv-layout names only contiguous",
    );
    refused(&["--model", "gpt2"], "valid models:");
    refused(&["--model", "gpt2"], "or hf:DIR");
    refused(&["--model", "hf:/no/such/folder"], "no readable config.json");
    refused(
        &["--model", "llama_tiny", "--seq-len", "8"],
        "--seq-len applies to token models",
    );
    // A mixed list runs each model in the modes that apply to it.
    let o = generate(
        &out,
        &[
            "--model",
            "resnet_tiny,llama_tiny",
            "--mode",
            "infer,generate",
            "--prompt-len",
            "4",
            "--output-len",
            "3",
            "--iters",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let mut got: Vec<(String, String)> = strings(&runs, "model")
        .into_iter()
        .zip(strings(&runs, "mode"))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("llama_tiny".to_string(), "generate".to_string()),
            ("resnet_tiny".to_string(), "infer".to_string())
        ]
    );
}

#[test]
fn a_sweep_generates_each_pair_of_lengths_and_ids_other_cells_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.toml");
    std::fs::write(
        &file,
        r#"name = "llm"
[defaults]
warmup_secs = 0
duration_secs = 0.01

[[targets]]
label = "cpu"
device = "cpu"

[[matrix]]
models = ["llama_tiny", "resnet_tiny"]
modes = ["infer", "generate"]
batches = [1]
prompt_lens = [4, 8]
output_lens = [3]
kv_layouts = ["contiguous", "paged"]
kv_block_size = 4
"#,
    )
    .unwrap();
    let out = dir.path().join("D");
    let o = run(&["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let layouts: Vec<Option<String>> = (0..runs.height())
        .map(|i| {
            runs.column("kv_layout")
                .unwrap()
                .str()
                .unwrap()
                .get(i)
                .map(str::to_string)
        })
        .collect();
    let mut cells: Vec<(String, String, Option<f64>, Option<String>)> = strings(&runs, "model")
        .into_iter()
        .zip(strings(&runs, "mode"))
        .zip(numbers(&runs, "prompt_len"))
        .zip(layouts)
        .map(|(((m, d), p), l)| (m, d, p, l))
        .collect();
    cells.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let generate = |p: f64, l: &str| ("llama_tiny".into(), "generate".into(), Some(p), Some(l.to_string()));
    assert_eq!(
        cells,
        vec![
            generate(4.0, "contiguous"),
            generate(4.0, "paged"),
            generate(8.0, "contiguous"),
            generate(8.0, "paged"),
            ("resnet_tiny".into(), "infer".into(), None, None),
        ]
    );
    let ids = strings(&runs, "cell_id");
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 5);

    // A matrix whose modes run none of a model is refused naming why.
    std::fs::write(
        &file,
        "name = \"x\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[matrix]]\nmodels = [\"llama_tiny\"]\nmodes = [\"infer\"]\nbatches = [1]\n",
    )
    .unwrap();
    let o = run(&["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("no mode of the matrix runs `llama_tiny`: llama_tiny is a language model"),
        "{}",
        text(&o)
    );
    // Nor is a language model a group's busy neighbour.
    std::fs::write(
        &file,
        "name = \"x\"\n[[targets]]\nlabel = \"a\"\ndevice = \"cpu\"\n[[targets]]\nlabel = \"b\"\ndevice = \"cpu\"\n[[groups]]\nlabel = \"g\"\nconcurrent = true\ntargets = [\"a\", \"b\"]\nbusy = { model = \"llama_tiny\", mode = \"infer\", dtype = \"f32\", batch = 1 }\n[[matrix]]\nmodels = [\"resnet_tiny\"]\nbatches = [1]\n",
    )
    .unwrap();
    let o = run(&["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("busy: `llama_tiny` is a language model"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_sweep_cell_that_cannot_fit_is_an_oom_row_before_its_model_is_built() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.toml");
    // Llama-3.1-8B's cache alone at batch 65,536 (the largest a sweep takes) is terabytes: refused from its shape, in the time
    // it takes to say so (building its 8 billion seeded weights on a CPU would take minutes).
    std::fs::write(
        &file,
        "name = \"big\"\n[defaults]\ntimeout_secs = 60\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[matrix]]\nmodels = [\"llama_3_1_8b\"]\nmodes = [\"generate\"]\nbatches = [65536]\n",
    )
    .unwrap();
    let out = dir.path().join("D");
    let started = std::time::Instant::now();
    let o = run(&["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "status"), vec!["oom"], "{}", text(&o));
    let error = strings(&runs, "error").remove(0);
    assert!(
        error.contains("out of memory before it starts") && error.contains("KV cache") && error.contains("weights"),
        "{error}"
    );
    assert_eq!(f64s(&runs, "prompt_len"), vec![128.0]);
    assert_eq!(strings(&runs, "kv_layout"), vec!["contiguous"]);
}

#[test]
fn a_max_batch_search_generates_its_probes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("s.toml");
    // The host holds far more than 4 sequences of llama_tiny: the search stops at its limit, each
    // try one warm-up and one measured generation, of three decode steps where the cell's have
    // seven.
    std::fs::write(
        &file,
        "name = \"max\"\n[defaults]\nmax_batch_limit = 4\nwarmup_secs = 0\nduration_secs = 0.01\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[matrix]]\nmodels = [\"llama_tiny\"]\nmodes = [\"generate\"]\nbatches = [\"max\"]\nprompt_lens = [8]\noutput_lens = [8]\n",
    )
    .unwrap();
    let out = dir.path().join("D");
    let o = run(&["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    let statuses = strings(&runs, "status");
    let batches = f64s(&runs, "batch");
    let measured: Vec<f64> = (0..runs.height())
        .filter(|&i| statuses[i] == "ok")
        .map(|i| batches[i])
        .collect();
    assert_eq!(measured, vec![4.0], "{}", text(&o));
    assert!(statuses.iter().any(|s| s == "probe"));
    // Every probe generated its prefill and three decode steps, over a cache reserved for the
    // whole context (the 15 tokens of the measured cell's).
    for i in (0..runs.height()).filter(|&i| statuses[i] == "probe") {
        assert_eq!(numbers(&runs, "generations")[i], Some(1.0));
        assert_eq!(numbers(&runs, "iterations")[i], Some(3.0));
    }
    let measured_steps = (0..runs.height())
        .filter(|&i| statuses[i] == "ok")
        .map(|i| numbers(&runs, "iterations")[i]);
    assert!(measured_steps.into_iter().all(|n| n.is_some_and(|n| n >= 7.0)));
    // The report says how many sequences the target held, and that the search's limit stopped it.
    let o = run(&["report", out.to_str().unwrap(), "--format", "md"]);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let section = md
        .split("## Sequences each target holds")
        .nth(1)
        .unwrap_or_else(|| panic!("no section: {md}"));
    assert!(
        section
            .contains("| cpu | llama_tiny | f32 | prompt 8 output 8 | contiguous | at least 4 (the search's limit) |"),
        "{section}"
    );
    // llama_tiny's 15 tokens a sequence, keys and values: 2 × 2 layers × 2 KV heads × 16 × 4 bytes × 15
    // = 7,680 bytes.
    assert!(section.contains("| 0.007 |"), "{section}");
}

#[test]
fn the_report_draws_decode_throughput_and_time_to_first_token() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let o = generate(
        &out,
        &[
            "--model",
            "qwen2_tiny",
            "--batch",
            "1,2",
            "--prompt-len",
            "6",
            "--output-len",
            "3",
            "--iters",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&["report", out.to_str().unwrap(), "--format", "md"]);
    assert!(o.status.success(), "{}", text(&o));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("prompt 6 output 3") && md.contains("(tokens/s)"), "{md}");
    // Times to the microsecond: a tiny model's prefill takes about a millisecond.
    let ttft_table = md.split("(ms) |").last().unwrap();
    let three_places = |x: &str| x.split_once('.').is_some_and(|(_, f)| f.len() == 3);
    let cells: Vec<&str> = ttft_table
        .lines()
        .filter_map(|l| l.split(" | ").nth(1))
        .filter_map(|c| c.trim_end_matches(" |").split_once(" (p99 "))
        .flat_map(|(p50, p99)| [p50, p99.trim_end_matches(')')])
        .collect();
    assert_eq!(cells.len(), 4, "{ttft_table}");
    assert!(cells.iter().all(|c| three_places(c)), "{cells:?}");
    let svg = |name: &str| {
        let path = std::fs::read_dir(out.join("report_files"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(name))
            .unwrap_or_else(|| panic!("no {name} chart"));
        std::fs::read_to_string(path).unwrap()
    };
    let throughput = svg("-throughput.svg");
    assert!(
        throughput.contains("Decode throughput (95% interval)") && throughput.contains("batch size (sequences)"),
        "{throughput}"
    );
    assert!(svg("-latency.svg").contains("Latency per decode step"));
    assert!(svg("-ttft.svg").contains("Time to first token"));
    // Every image link resolves to a file whose name has no space in it.
    for link in md.split("](").skip(1).filter_map(|s| s.split(')').next()) {
        if link.ends_with(".svg") {
            assert!(!link.contains(' '), "{link}");
            assert!(out.join(link).is_file(), "{link} was not written");
        }
    }
}

/// benches/decode_ab.py, a decode change against the build before it (`gpu_run.sh decoders` with
/// STEP=ab), on real results folders: each build's step p50 in every round, their medians and this
/// build's over the one before's, and a cell one build missed in a round said to be short. Needs
/// python3 with pyarrow, which .ci/run installs.
#[test]
#[ignore = "needs python3 with pyarrow"]
fn decode_ab_gives_each_cell_both_builds_rounds_medians_and_ratio() {
    require_pyarrow();
    let dir = tempfile::tempdir().unwrap();
    // Two rounds of "before" and "this" (folders of the same binary: the script reads folders);
    // this build's second round left batch 2 out.
    let mut folders = Vec::new();
    for (name, batches) in [
        ("before-1", "1,2"),
        ("this-1", "1,2"),
        ("before-2", "1,2"),
        ("this-2", "1"),
    ] {
        let out = dir.path().join(name);
        let mut args = TINY_GENERATION;
        args[3] = batches;
        let o = generate(&out, &args);
        assert!(o.status.success(), "{}", text(&o));
        folders.push(out);
    }
    // Each folder's step p50 at a batch, as the script must read it.
    let p50 = |folder: &Path, batch: f64| -> Option<f64> {
        let runs = read_table(folder, Table::Runs).unwrap();
        let at = f64s(&runs, "batch").iter().position(|b| *b == batch)?;
        Some(f64s(&runs, "p50_ms")[at])
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../benches/decode_ab.py");
    let o = std::process::Command::new("python3")
        .arg(script)
        .args(&folders)
        .arg("--markdown")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let row = |batch: &str| -> Vec<String> {
        out.lines()
            .map(|l| l.split('|').map(|c| c.trim().to_string()).collect::<Vec<_>>())
            .find(|c| c.len() > 4 && c[1] == "llama_tiny" && c[3] == batch)
            .unwrap_or_else(|| panic!("no batch {batch}:\n{out}"))
    };
    let one = row("1");
    let before = [p50(&folders[0], 1.0).unwrap(), p50(&folders[2], 1.0).unwrap()];
    let this = [p50(&folders[1], 1.0).unwrap(), p50(&folders[3], 1.0).unwrap()];
    assert_eq!(one[4], format!("{:.3}, {:.3}", before[0], before[1]), "{out}");
    assert_eq!(one[5], format!("{:.3}, {:.3}", this[0], this[1]), "{out}");
    let (mb, mt) = ((before[0] + before[1]) / 2.0, (this[0] + this[1]) / 2.0);
    assert_eq!(
        (one[6].as_str(), one[7].as_str()),
        (format!("{mb:.3}").as_str(), format!("{mt:.3}").as_str())
    );
    assert_eq!(one[8], format!("{:.3}", mt / mb), "{out}");
    let two = row("2");
    assert_eq!(two[5], format!("{:.3}", p50(&folders[1], 2.0).unwrap()), "{out}");
    assert!(two[10].contains("this: 1 of 2 rounds"), "{out}");
    assert!(out.contains("2 rounds, 2 cells"), "{out}");
    // A build that wrote no rows in a round (its folder absent) is a missed round, not an error.
    let o = std::process::Command::new("python3")
        .arg(script)
        .args(&folders[..3])
        .arg(dir.path().join("never-written"))
        .arg("--markdown")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let notes: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| llama_tiny |"))
        .filter_map(|l| l.trim_end_matches(" |").rsplit(" | ").next())
        .collect();
    assert_eq!(notes, ["this: 1 of 2 rounds"; 2], "{out}");
}
