//! `migprof load` for language models end to end on the CPU with the tiny decoder: requests of
//! drawn lengths served by the continuous batcher over a paged KV cache, at fixed rates and in a
//! search within both objectives, started as a user starts them.

use std::collections::HashMap;
use std::path::Path;
use std::process::Output;

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

/// `migprof load` of the tiny decoder on the CPU into `out`, with `extra` (flags split on spaces).
fn serve(out: &Path, extra: &str) -> Output {
    migprof()
        .args([
            "load",
            "--model",
            "llama_tiny",
            "--device",
            "cpu",
            "--warmup",
            "0.3",
            "--out",
        ])
        .arg(out)
        .args(extra.split_whitespace())
        .output()
        .expect("migprof runs")
}

const SERVE_TABLES: [Table; 4] = [
    Table::Serve,
    Table::ServeRequests,
    Table::ServeIterations,
    Table::ServeCapacity,
];

#[test]
fn fixed_rates_leave_a_row_each_with_every_request_and_iteration() {
    let dir = tempfile::tempdir().unwrap();
    // A cache of 24 blocks of 8 tokens (192) for requests of up to 40 + 12 tokens: a few at once.
    let o = serve(
        dir.path(),
        "--qps 10,60 --duration 1.5 --prompt-len uniform:8-40 --output-len 12 --kv-blocks 24 --kv-block-size 8 --max-seqs 8 --max-batched-tokens 64 --slo-ttft-p99-ms 5000 --slo-tpot-p99-ms 1000",
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_table(dir.path(), Table::Serve).unwrap();
    assert_eq!(rows.height(), 2);
    assert_eq!(numbers(&rows, "offered_qps"), vec![Some(10.0), Some(60.0)]);
    assert_eq!(strings(&rows, "meets_slo"), vec!["true", "true"]);
    assert_eq!(strings(&rows, "kv_sizing"), vec!["given", "given"]);
    assert_eq!(strings(&rows, "prompt_len"), vec!["uniform:8-40", "uniform:8-40"]);
    assert_eq!(numbers(&rows, "kv_blocks"), vec![Some(24.0), Some(24.0)]);
    assert_eq!(strings(&rows, "profile"), vec!["cpu", "cpu"]);
    assert_eq!(strings(&rows, "cell_id")[0].len(), 16);
    // Iterations of changing shape: no graphs, and cuBLASLt's heuristic unless asked otherwise.
    let options = strings(&rows, "kernel_options");
    assert!(
        options[0].contains("gemm=heuristic") && options[0].contains("graphs=off"),
        "{options:?}"
    );
    for name in ["ttft_p99_ms", "tpot_p99_ms", "itl_p50_ms", "e2e_p90_ms", "goodput_qps"] {
        assert!(
            numbers(&rows, name).iter().all(|v| v.is_some_and(|v| v > 0.0)),
            "{name}"
        );
    }
    // The faster rate fills the small cache: sequences wait for blocks, some are preempted.
    let most = numbers(&rows, "kv_occupancy_max");
    assert!(
        most[1].unwrap() > 0.5 && most.iter().all(|m| m.unwrap() <= 1.0),
        "{most:?}"
    );

    // Every request of each step, its lengths as drawn, its tokens all out.
    let requests = read_table(dir.path(), Table::ServeRequests).unwrap();
    let ids = strings(&requests, "serve_id");
    let (prompts, outputs, out, finished, measured) = (
        numbers(&requests, "prompt_tokens"),
        numbers(&requests, "output_tokens"),
        numbers(&requests, "tokens_out"),
        strings(&requests, "finished"),
        strings(&requests, "measured"),
    );
    let mut measured_of: HashMap<String, f64> = HashMap::new();
    for i in 0..requests.height() {
        let p = prompts[i].unwrap();
        assert!((8.0..=40.0).contains(&p) && outputs[i] == Some(12.0));
        assert_eq!(finished[i], "true");
        assert_eq!(out[i], Some(12.0));
        if measured[i] == "true" {
            *measured_of.entry(ids[i].clone()).or_default() += 1.0;
        }
    }
    for (id, n) in strings(&rows, "serve_id").iter().zip(numbers(&rows, "requests")) {
        assert_eq!(measured_of.get(id).copied(), n, "step {id}: its measured requests");
    }
    // Every iteration within the budget and the cache.
    let its = read_table(dir.path(), Table::ServeIterations).unwrap();
    assert!(numbers(&its, "tokens")
        .iter()
        .all(|t| (1.0..=64.0).contains(&t.unwrap())));
    assert!(numbers(&its, "batch").iter().all(|b| (1.0..=8.0).contains(&b.unwrap())));
    assert!(numbers(&its, "kv_blocks_used").iter().all(|b| b.unwrap() <= 24.0));
    // Every column these tables write is in the schema reference.
    let schema = repo_file("docs/schema.md");
    for table in [Table::Serve, Table::ServeRequests, Table::ServeIterations] {
        let names = columns(&read_table(dir.path(), table).unwrap());
        let missing = undocumented(&schema, names.iter().map(String::as_str));
        assert!(
            missing.is_empty(),
            "docs/schema.md lacks these {} columns: {missing:?}",
            table.dir_name()
        );
    }
    let check = migprof().args(["check"]).arg(dir.path()).output().unwrap();
    assert!(
        check.status.success() && text(&check).contains("2 serving step(s)"),
        "{}",
        text(&check)
    );
}

/// A search small enough for the CPU.
const SEARCHED: &str = "--search --duration 1.5 --drain 5 --prompt-len 48 --output-len 16 --kv-blocks 64 --max-seqs 16 --max-batched-tokens 128 --slo-ttft-p99-ms 30 --slo-tpot-p99-ms 10 --max-steps 4";

#[test]
fn a_search_finds_the_highest_rate_within_both_objectives_and_chunking_is_a_setting_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let o = serve(dir.path(), SEARCHED);
    assert!(o.status.success(), "{}", text(&o));
    let caps = read_table(dir.path(), Table::ServeCapacity).unwrap();
    assert_eq!(caps.height(), 1, "{}", text(&o));
    let steps = read_table(dir.path(), Table::Serve).unwrap();
    assert_eq!(steps.height() as f64, numbers(&caps, "steps")[0].unwrap());
    assert!(steps.height() <= 4);
    // The first guess is the closed loop's rate.
    let first = numbers(&steps, "offered_qps")[0].unwrap();
    assert!((first - numbers(&steps, "closed_loop_qps")[0].unwrap()).abs() < 1e-6);
    // The capacity is the highest rate that met both objectives, and every step says whether it did.
    let (offered, meets) = (numbers(&steps, "offered_qps"), strings(&steps, "meets_slo"));
    let passing: Vec<f64> = offered
        .iter()
        .zip(&meets)
        .filter(|(_, m)| *m == "true")
        .map(|(q, _)| q.unwrap())
        .collect();
    let capacity = numbers(&caps, "capacity_qps")[0];
    assert_eq!(capacity, passing.iter().copied().reduce(f64::max), "{}", text(&o));
    for (row_meets, (ttft, tpot)) in meets.iter().zip(
        numbers(&steps, "ttft_p99_ms")
            .into_iter()
            .zip(numbers(&steps, "tpot_p99_ms")),
    ) {
        if row_meets == "true" {
            assert!(ttft.unwrap() <= 30.0 && tpot.unwrap() <= 10.0);
        }
    }
    // A search cut off before its capacity row (here: the row removed) goes on where it was when
    // run again: the rates it measured are not measured again, and its row comes with every step.
    let id = strings(&caps, "capacity_id")[0].clone();
    std::fs::remove_file(dir.path().join(format!("serve_capacity/part-{id}.parquet"))).unwrap();
    let again = serve(dir.path(), SEARCHED);
    assert!(again.status.success(), "{}", text(&again));
    assert!(
        text(&again).contains(&format!("resuming search {id}")),
        "{}",
        text(&again)
    );
    assert_eq!(
        read_table(dir.path(), Table::Serve).unwrap().height(),
        steps.height(),
        "nothing measured again"
    );
    let resumed = read_table(dir.path(), Table::ServeCapacity).unwrap();
    assert_eq!(strings(&resumed, "capacity_id"), vec![id]);
    assert_eq!(numbers(&resumed, "capacity_qps"), numbers(&caps, "capacity_qps"));
    // The report draws both objectives against the rate, the cache over a step, the capacity.
    let html = report(&[dir.path()], &dir.path().join("report.html"), &[]);
    for needle in [
        "Serving language models",
        "TTFT p99 against offered rate",
        "TPOT p99 against offered rate",
        "KV cache in use over a step",
        "Capacities found",
        "serving step(s) of language models",
    ] {
        assert!(html.contains(needle), "{needle}");
    }
    assert!(!html.contains("load step(s): see Serving capacity"));
    // What ran names the served target's device and the environment, as it does for runs.
    for needle in ["<td>migprof_version</td>", "<td>host</td>", "<td>cpu</td>"] {
        assert!(html.contains(needle), "{needle}");
    }
    let schema = repo_file("docs/schema.md");
    let names = columns(&caps);
    let missing = undocumented(&schema, names.iter().map(String::as_str));
    assert!(
        missing.is_empty(),
        "docs/schema.md lacks these serve_capacity columns: {missing:?}"
    );

    // Without chunked prefill, another cell; every iteration's prefill is of whole prompts.
    let other = tempfile::tempdir().unwrap();
    let o = serve(
        other.path(),
        "--qps 20 --duration 1 --prompt-len 48 --output-len 16 --kv-blocks 64 --max-seqs 16 --max-batched-tokens 128 --no-chunked-prefill",
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_table(other.path(), Table::Serve).unwrap();
    assert_eq!(strings(&rows, "chunked_prefill"), vec!["false"]);
    assert_eq!(strings(&rows, "meets_slo"), vec![""], "no objectives, no judgement");
    assert_ne!(strings(&rows, "cell_id"), strings(&steps, "cell_id")[..1]);
    let its = read_table(other.path(), Table::ServeIterations).unwrap();
    assert!(numbers(&its, "prefill_tokens")
        .iter()
        .all(|t| (t.unwrap() as u32).is_multiple_of(48)));
}

#[test]
fn settings_of_the_other_kind_of_load_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("results");
    for (extra, says) in [
        (
            "--qps 1 --max-batch 4",
            "--max-batch applies to models served one forward pass",
        ),
        ("--qps 1 --slo-p99-ms 50", "--slo-p99-ms applies"),
        ("--qps 1 --slo-ttft-p99-ms 100", "--slo-tpot-p99-ms"),
        ("--search --qps 1", "needs both objectives"),
        (
            "--qps 1 --max-seqs 64 --max-batched-tokens 32",
            "--max-batched-tokens 32 must be at least --max-seqs 64",
        ),
        ("--qps 1 --prompt-len uniform:9-3", "MIN is above MAX"),
    ] {
        let o = serve(&out, extra);
        assert!(
            !o.status.success() && text(&o).contains(says),
            "{extra:?}: {}",
            text(&o)
        );
    }
    let o = migprof()
        .args([
            "load",
            "--model",
            "resnet_tiny",
            "--device",
            "cpu",
            "--qps",
            "1",
            "--prompt-len",
            "8",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("--prompt-len applies to language models"),
        "{}",
        text(&o)
    );
    for table in SERVE_TABLES {
        assert_eq!(read_table(&out, table).unwrap().height(), 0);
    }
}

/// Rewrites every part of `table` in `dir` as if measured on `profile`: this CPU is no MIG slice.
fn as_if_on(dir: &Path, table: Table, profile: &str) {
    use polars::prelude::*;
    for entry in std::fs::read_dir(dir.join(table.dir_name())).unwrap() {
        let path = entry.unwrap().path();
        let mut df = ParquetReader::new(std::fs::File::open(&path).unwrap())
            .finish()
            .unwrap();
        let n = df.height();
        df.replace("profile", Column::new("profile".into(), vec![profile; n]))
            .unwrap();
        ParquetWriter::new(std::fs::File::create(&path).unwrap())
            .finish(&mut df)
            .unwrap();
    }
}

#[test]
fn a_language_model_is_planned_beside_an_encoder_from_their_searches() {
    let dir = tempfile::tempdir().unwrap();
    let o = serve(
        dir.path(),
        "--search --duration 1 --drain 5 --prompt-len 32 --output-len 8 --kv-blocks 64 --max-seqs 16 --max-batched-tokens 128 --slo-ttft-p99-ms 40 --slo-tpot-p99-ms 10 --max-steps 3",
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = migprof()
        .args([
            "load",
            "--model",
            "resnet_tiny",
            "--device",
            "cpu",
            "--max-batch",
            "4",
            "--warmup",
            "0.2",
        ])
        .args([
            "--search",
            "--slo-p99-ms",
            "200",
            "--resolution",
            "20",
            "--min-requests",
            "150",
            "--out",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    as_if_on(dir.path(), Table::ServeCapacity, "3g.40gb");
    as_if_on(dir.path(), Table::Capacity, "3g.40gb");
    let llm = numbers(&read_table(dir.path(), Table::ServeCapacity).unwrap(), "capacity_qps")[0].unwrap();
    let plan = |extra: &[&str]| {
        migprof()
            .args(["capacity", "--gpu", "h100-80gb", "--json", "--from"])
            .arg(dir.path())
            .args(["--demand", &format!("llama_tiny={},resnet_tiny=10", llm * 3.0)])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = plan(&[
        "--slo-p99-ms",
        "200",
        "--slo-ttft-p99-ms",
        "40",
        "--slo-tpot-p99-ms",
        "10",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let instances = report["instances"].as_array().unwrap();
    let of = |m: &str| {
        instances
            .iter()
            .filter(|i| i["model"] == m)
            .map(|i| i["count"].as_u64().unwrap())
            .sum::<u64>()
    };
    // Three times the language model's capacity at 80 % of each: at least four instances of it (a
    // GPU's spare slot may hold a fifth); the encoder's beside them, in the one plan.
    assert!(of("llama_tiny") >= 4, "{report}");
    assert!(of("resnet_tiny") >= 1, "{report}");
    for s in report["spare"].as_array().unwrap() {
        assert!(s["serves_qps"].as_f64() >= s["demand_qps"].as_f64(), "{s}");
    }
    assert_eq!(report["slo_ttft_p99_ms"], 40.0);
    // The language model's capacity names the lengths it holds for; the encoder's names none.
    let lengths_of = |m: &str| {
        report["capacities"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["model"] == m)
            .map(|c| c["lengths"].clone())
            .unwrap()
    };
    assert!(
        lengths_of("llama_tiny")
            .as_str()
            .is_some_and(|l| l.starts_with("prompts ") && l.ends_with(" tokens")),
        "{report}"
    );
    assert!(lengths_of("resnet_tiny").is_null(), "{report}");
    // The language model's objectives are needed to plan it; other objectives find no capacity.
    let o = plan(&["--slo-p99-ms", "200"]);
    assert!(
        !o.status.success() && text(&o).contains("llama_tiny is a language model"),
        "{}",
        text(&o)
    );
    let o = plan(&[
        "--slo-p99-ms",
        "200",
        "--slo-ttft-p99-ms",
        "41",
        "--slo-tpot-p99-ms",
        "10",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    let o = plan(&[]);
    assert!(
        !o.status.success() && text(&o).contains("which objective"),
        "{}",
        text(&o)
    );
}

/// A sweep file's capacity search of a language model and an encoder model: each kind's keys.
const SWEPT: &str = r#"
name = "serving"
[defaults]
timeout_secs = 300
[[targets]]
label = "cpu"
device = "cpu"
[[capacity]]
models = ["llama_tiny", "resnet_tiny"]
dtype = "f32"
resolution_pct = 20
warmup_secs = 0.3
slo_p99_ms = 300
max_batch = 4
min_requests = 150
slo_ttft_p99_ms = 40
slo_tpot_p99_ms = 10
prompt_len = 32
output_len = "uniform:4-12"
max_seqs = 16
max_batched_tokens = 128
kv_blocks = 64
duration_secs = 1
drain_secs = 5
max_steps = 3
"#;

#[test]
fn a_sweep_searches_a_language_models_capacity_beside_an_encoders_and_a_rerun_skips_both() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sweep.toml");
    std::fs::write(&file, SWEPT).unwrap();
    let out = dir.path().join("out");
    let sweep = |extra: &[&str]| {
        migprof()
            .arg("sweep")
            .arg(&file)
            .arg("--out")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    // The dry run names the serving cell by its sequences and objectives, and counts its search at
    // its longest: 3 steps of 1 s and 5 s of drain.
    let o = sweep(&["--dry-run"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(
            "cpu llama_tiny generate f32 up to 16 sequences #0 (capacity within TTFT p99 40 ms and TPOT p99 10 ms, prompts 32 and outputs uniform:4-12 tokens)"
        ),
        "{}",
        text(&o)
    );
    assert!(text(&o).contains("counted at its longest"), "{}", text(&o));

    let o = sweep(&[]);
    assert!(o.status.success(), "{}", text(&o));
    // The done line names the tables the searches wrote, not a runs folder no cell made.
    let done = text(&o);
    assert!(
        done.contains(&out.join("serve_capacity").display().to_string())
            && !done.contains(&out.join("runs").display().to_string()),
        "{done}"
    );
    let caps = read_table(&out, Table::ServeCapacity).unwrap();
    assert_eq!(caps.height(), 1, "{}", text(&o));
    assert_eq!(strings(&caps, "sweep"), vec!["serving"]);
    assert_eq!(strings(&caps, "target"), vec!["cpu"]);
    assert_eq!(strings(&caps, "model"), vec!["llama_tiny"]);
    assert_eq!(numbers(&caps, "max_steps"), vec![Some(3.0)]);
    // Every step with the file's settings, served as `migprof load` serves a language model.
    let steps = read_table(&out, Table::Serve).unwrap();
    assert!((1..=3).contains(&steps.height()), "{}", text(&o));
    assert!(strings(&steps, "prompt_len").iter().all(|l| l == "32"));
    assert!(strings(&steps, "output_len").iter().all(|l| l == "uniform:4-12"));
    assert!(numbers(&steps, "kv_blocks").iter().all(|b| *b == Some(64.0)));
    assert!(strings(&steps, "kernel_options")
        .iter()
        .all(|k| k.contains("gemm=heuristic") && k.contains("graphs=off")));
    assert!(strings(&steps, "cell_id")
        .iter()
        .all(|id| *id == strings(&caps, "cell_id")[0]));
    // The encoder's search beside it, within its own objective.
    let encoder = read_table(&out, Table::Capacity).unwrap();
    assert_eq!(strings(&encoder, "model"), vec!["resnet_tiny"]);
    assert_eq!(numbers(&encoder, "slo_p99_ms"), vec![Some(300.0)]);

    let o = sweep(&[]);
    assert!(o.status.success() && text(&o).contains("2 skipped"), "{}", text(&o));
    assert_eq!(read_table(&out, Table::ServeCapacity).unwrap().height(), 1);
    assert_eq!(read_table(&out, Table::Serve).unwrap().height(), steps.height());

    // The sweep's folder plans both models in one program, as the searches' own folders do.
    as_if_on(&out, Table::ServeCapacity, "3g.40gb");
    as_if_on(&out, Table::Capacity, "3g.40gb");
    let o = migprof()
        .args(["capacity", "--gpu", "h100-80gb", "--json", "--from"])
        .arg(&out)
        .args(["--demand", "llama_tiny=0.5,resnet_tiny=1"])
        .args([
            "--slo-p99-ms",
            "300",
            "--slo-ttft-p99-ms",
            "40",
            "--slo-tpot-p99-ms",
            "10",
        ])
        .output()
        .unwrap();
    let llm_capacity = numbers(&caps, "capacity_qps")[0];
    match llm_capacity {
        // A capacity found: both models are placed.
        Some(_) => {
            assert!(o.status.success(), "{}", text(&o));
            let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            let models: Vec<&str> = report["instances"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["model"].as_str().unwrap())
                .collect();
            assert!(
                models.contains(&"llama_tiny") && models.contains(&"resnet_tiny"),
                "{report}"
            );
        }
        // No rate met both objectives on this machine: the plan says the model has no capacity.
        None => assert!(!o.status.success() && text(&o).contains("llama_tiny"), "{}", text(&o)),
    }
}

#[test]
fn a_sweep_says_when_a_language_models_search_may_outlast_the_time_limit() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sweep.toml");
    std::fs::write(&file, SWEPT.replace("timeout_secs = 300", "timeout_secs = 10")).unwrap();
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(dir.path().join("out"))
        .arg("--dry-run")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("may take up to 18 s (3 steps of 1 s of arrivals and up to 5 s of drain each), past [defaults] timeout_secs = 10"),
        "{}",
        text(&o)
    );
}

/// A language model from a Hugging Face folder (whose name has a comma) is served as `run` runs
/// it, and a sweep's capacity search takes it; a folder that is not one is refused by its path.
#[test]
fn a_hugging_face_folder_is_served_and_searched() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tuned,v2");
    hf_folder(&model);
    let name = format!("hf:{}", model.display());
    let out = dir.path().join("D");
    let o = migprof()
        .args([
            "load",
            "--model",
            &name,
            "--device",
            "cpu",
            "--qps",
            "4",
            "--duration",
            "1",
            "--warmup",
            "0",
        ])
        .args(["--prompt-len", "8", "--output-len", "4", "--drain", "10", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_table(&out, Table::Serve).unwrap();
    assert_eq!(strings(&rows, "model"), vec![name.clone()]);
    // The same folder in a run: the comma is part of its name, not a second model.
    let o = migprof()
        .args([
            "run", "--model", &name, "--device", "cpu", "--iters", "1", "--warmup", "0",
        ])
        .args(["--prompt-len", "8", "--output-len", "4", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let file = dir.path().join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            "name = \"hf\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[capacity]]\nmodels = [\"{name}\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 8\noutput_len = 4\n"
        ),
    )
    .unwrap();
    let o = migprof()
        .args(["sweep", file.to_str().unwrap(), "--dry-run", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    std::fs::write(&file, "name = \"hf\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[capacity]]\nmodels = [\"hf:/no/such/folder\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\n").unwrap();
    let o = migprof()
        .args(["sweep", file.to_str().unwrap(), "--dry-run", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("/no/such/folder: no readable config.json"),
        "{}",
        text(&o)
    );
}
