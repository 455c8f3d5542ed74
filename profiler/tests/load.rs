//! `migprof load`, `migprof capacity` and a sweep's `[[capacity]]` end to end on CPU with tiny models,
//! started as a user starts them.

use std::path::Path;
use std::process::Output;

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

fn load(out: &Path, extra: &[&str]) -> Output {
    migprof()
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
            "--out",
        ])
        .arg(out)
        .args(extra)
        .output()
        .expect("migprof runs")
}

#[test]
fn fixed_rates_leave_a_row_each_with_batches_and_the_run_identity() {
    let dir = tempfile::tempdir().unwrap();
    let o = load(
        dir.path(),
        &["--qps", "20,40", "--duration", "1.5", "--slo-p99-ms", "1000"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_table(dir.path(), Table::Load).unwrap();
    assert_eq!(rows.height(), 2);
    assert_eq!(numbers(&rows, "offered_qps"), vec![Some(20.0), Some(40.0)]);
    // About 30 and 60 measured requests, all within a second.
    let requests = numbers(&rows, "requests");
    assert!(
        (15.0..=50.0).contains(&requests[0].unwrap()) && (35.0..=90.0).contains(&requests[1].unwrap()),
        "{requests:?}"
    );
    assert_eq!(strings(&rows, "meets_slo"), vec!["true", "true"]);
    assert_eq!(strings(&rows, "profile"), vec!["cpu", "cpu"]);
    assert_eq!(strings(&rows, "status"), vec!["ok", "ok"]);
    assert_eq!(strings(&rows, "dtype"), vec!["f32", "f32"]);
    assert_eq!(numbers(&rows, "duration_s"), vec![Some(1.5), Some(1.5)]);
    assert_eq!(numbers(&rows, "min_requests"), vec![None, None]);
    assert_eq!(
        numbers(&rows, "sample_interval_ms"),
        vec![None, None],
        "no sampler on a CPU"
    );
    let ids = strings(&rows, "cell_id");
    assert_eq!(ids[0].len(), 16);
    assert!(rows.column("candle_version").is_ok() && rows.column("device_name").is_ok());
    // Every batch of every step, none above the max batch, and as many requests as the rows say.
    let batches = read_table(dir.path(), Table::LoadBatches).unwrap();
    let sizes = numbers(&batches, "size");
    assert!(sizes.iter().all(|s| (1.0..=4.0).contains(&s.unwrap())));
    let served: f64 = sizes.iter().flatten().sum();
    assert!(
        served >= requests.iter().flatten().sum::<f64>(),
        "warm-up requests are served too"
    );
    assert!(text(&o).contains("report: migprof report"));
}

#[test]
fn a_search_records_the_capacity_and_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let o = load(
        dir.path(),
        &[
            "--search",
            "--slo-p99-ms",
            "200",
            "--resolution",
            "10",
            "--min-requests",
            "150",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let caps = read_table(dir.path(), Table::Capacity).unwrap();
    assert_eq!(caps.height(), 1, "{}", text(&o));
    let capacity = numbers(&caps, "capacity_qps")[0].expect("a tiny model serves something within 200 ms");
    let (low, high) = (
        numbers(&caps, "bracket_low_qps")[0].unwrap(),
        numbers(&caps, "bracket_high_qps")[0].unwrap(),
    );
    assert_eq!(capacity, low);
    assert!(high / low - 1.0 <= 0.10 + 1e-9, "{low} {high}");
    // Every column these tables write is in the schema reference.
    let schema = repo_file("docs/schema.md");
    for table in [Table::Capacity, Table::Load, Table::LoadBatches] {
        let names = columns(&read_table(dir.path(), table).unwrap());
        let missing = undocumented(&schema, names.iter().map(String::as_str));
        assert!(
            missing.is_empty(),
            "docs/schema.md lacks these {} columns: {missing:?}",
            table.dir_name()
        );
    }
    let steps = read_table(dir.path(), Table::Load).unwrap();
    // The first guess is half the closed loop's rate at the max batch.
    let first = numbers(&steps, "offered_qps").into_iter().flatten().next().unwrap();
    assert!(
        (first - numbers(&caps, "closed_loop_qps")[0].unwrap() / 2.0).abs() < 1e-6,
        "{first}"
    );
    assert_eq!(steps.height() as f64, numbers(&caps, "steps")[0].unwrap());
    let ids = strings(&caps, "capacity_id");
    assert!(strings(&steps, "capacity_id").iter().all(|c| *c == ids[0]));
    assert!(numbers(&steps, "min_requests").iter().all(|m| *m == Some(150.0)));
    // The rate found passed; the bracket's high end failed.
    let (offered, meets) = (numbers(&steps, "offered_qps"), strings(&steps, "meets_slo"));
    for (q, m) in offered.iter().zip(&meets) {
        if q.unwrap() == capacity {
            assert_eq!(m, "true");
        }
        if q.unwrap() == high {
            assert_eq!(m, "false");
        }
    }
    assert!(text(&o).contains("capacity:"), "{}", text(&o));
}

#[test]
fn bad_load_input_names_the_choices() {
    let dir = tempfile::tempdir().unwrap();
    let o = load(dir.path(), &["--qps", "0"]);
    assert!(!o.status.success() && text(&o).contains("above zero"), "{}", text(&o));
    let o = load(dir.path(), &["--search"]);
    assert!(!o.status.success() && text(&o).contains("--slo-p99-ms"), "{}", text(&o));
    let o = load(dir.path(), &["--qps", "10", "--arrival", "bursty"]);
    assert!(
        !o.status.success() && text(&o).contains("poisson") && text(&o).contains("constant"),
        "{}",
        text(&o)
    );
    let o = migprof()
        .args([
            "load",
            "--model",
            "resnet_tiny",
            "--qps",
            "10",
            "--seq-len",
            "64",
            "--device",
            "cpu",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("token models"), "{}", text(&o));
    // A rate far beyond what the model serves is refused once the closed loop is measured, in well
    // under a second of serving and without drawing its schedule; nothing is written.
    let started = std::time::Instant::now();
    let o = load(dir.path(), &["--qps", "1e6", "--duration", "10"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("--qps 1000000: more than 10×") && text(&o).contains("--allow-overload"),
        "{}",
        text(&o)
    );
    // Beyond what one step may hold, before any work, --allow-overload or not.
    let o = load(dir.path(), &["--qps", "1e9", "--duration", "10", "--allow-overload"]);
    assert!(
        !o.status.success() && text(&o).contains("a step offers at most 10000000"),
        "{}",
        text(&o)
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(read_table(dir.path(), Table::Load).unwrap().height(), 0);
}

#[test]
fn capacity_plans_for_a_user_s_own_model_from_a_csv() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("mine.csv");
    std::fs::write(
        &csv,
        "model,profile,qps\nllama-8b,3g.40gb,12\nllama-8b,7g.80gb,30\nresnet50,1g.10gb,900\n",
    )
    .unwrap();
    let capacity = |demand: &str| {
        migprof()
            .args([
                "capacity",
                "--gpu",
                "h100-80gb",
                "--slo-p99-ms",
                "50",
                "--demand",
                demand,
                "--capacities",
            ])
            .arg(&csv)
            .output()
            .unwrap()
    };
    let o = capacity("llama-8b=200,resnet50=1000");
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("llama-8b") && t.contains("Plan: "), "{t}");
    assert!(!t.contains("warning"), "{t}");
    // A demand of no model anywhere names both lists.
    let o = capacity("llama-7b=200");
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("unknown model `llama-7b`") && t.contains("resnet50") && t.contains("llama-8b"),
        "{t}"
    );
    // A demand that would need more than 10,000 GPUs is planned, with a warning.
    let o = capacity("llama-8b=1000000");
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("warning: the plan needs") && text(&o).contains("more than 10000"),
        "{}",
        text(&o)
    );
}

#[test]
fn capacity_plans_from_a_csv_prints_json_and_writes_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("caps.csv");
    std::fs::write(&csv, "model,profile,qps\nresnet50,1g.10gb,900\nresnet50,3g.40gb,2200\nresnet50,7g.80gb,4000\nbert_base,1g.10gb,300\nbert_base,7g.80gb,2400\n").unwrap();
    let layouts = dir.path().join("layouts.yaml");
    let o = migprof()
        .args([
            "capacity",
            "--gpu",
            "h100-80gb",
            "--demand",
            "resnet50=20000,bert_base=3000",
            "--slo-p99-ms",
            "50",
            "--json",
            "--capacities",
        ])
        .arg(&csv)
        .arg("--emit-layouts")
        .arg(&layouts)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let plan: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let gpus = plan["gpus"].as_u64().unwrap();
    let counted: u64 = plan["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["count"].as_u64().unwrap())
        .sum();
    assert_eq!(gpus, counted);
    assert!(gpus <= plan["one_profile_per_model"]["gpus"].as_u64().unwrap());
    assert!(plan["instances"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["model"].is_string() && i["profile"].is_string() && i["count"].is_u64()));
    // The layouts file is one `migprof mig apply` reads.
    let o2 = migprof()
        .args(["mig", "apply"])
        .arg(&layouts)
        .args(["-c", "migprof-plan-1"])
        .env("MIGPROF_TOPOLOGY", "/nonexistent")
        .output()
        .unwrap();
    let t2 = text(&o2);
    assert!(!t2.contains("parsing") && !t2.contains("unknown field"), "{t2}");
    let yaml = std::fs::read_to_string(&layouts).unwrap();
    assert!(
        yaml.contains("version: v1") && yaml.contains("migprof-plan-1") && yaml.contains("mig-devices"),
        "{yaml}"
    );

    // Bad input names the choices.
    let o = migprof()
        .args([
            "capacity",
            "--gpu",
            "h900",
            "--demand",
            "resnet50=1",
            "--slo-p99-ms",
            "50",
            "--capacities",
        ])
        .arg(&csv)
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("h100-80gb"), "{}", text(&o));
    let o = migprof()
        .args([
            "capacity",
            "--gpu",
            "h100-80gb",
            "--demand",
            "resnet50=1",
            "--slo-p99-ms",
            "50",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("--from DIR"), "{}", text(&o));
}

#[test]
fn a_sweep_gives_every_target_its_capacity_and_a_rerun_skips_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sweep.toml");
    std::fs::write(
        &file,
        r#"
name = "capacity"
[[targets]]
label = "cpu"
device = "cpu"
[[capacity]]
models = ["resnet_tiny"]
dtype = "f32"
slo_p99_ms = 300
max_batch = 4
resolution_pct = 20
min_requests = 150
warmup_secs = 0.2
"#,
    )
    .unwrap();
    let out = dir.path().join("out");
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let caps = read_table(&out, Table::Capacity).unwrap();
    assert_eq!(caps.height(), 1);
    assert_eq!(strings(&caps, "sweep"), vec!["capacity"]);
    assert_eq!(strings(&caps, "target"), vec!["cpu"]);
    assert!(numbers(&caps, "capacity_qps")[0].is_some());
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success() && text(&o).contains("1 skipped"), "{}", text(&o));
    assert_eq!(read_table(&out, Table::Capacity).unwrap().height(), 1);
}

#[test]
fn the_report_shows_the_knee_the_capacities_and_the_latest_plan() {
    let dir = tempfile::tempdir().unwrap();
    let o = load(
        dir.path(),
        &[
            "--search",
            "--slo-p99-ms",
            "200",
            "--resolution",
            "20",
            "--min-requests",
            "150",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    // A plan as `migprof capacity --from` leaves it (here from a CSV: this CPU is no MIG profile).
    let csv = dir.path().join("caps.csv");
    std::fs::write(&csv, "model,profile,qps\nresnet50,1g.10gb,900\nresnet50,7g.80gb,4000\n").unwrap();
    let plan = migprof()
        .args([
            "capacity",
            "--gpu",
            "h100-80gb",
            "--demand",
            "resnet50=5000",
            "--slo-p99-ms",
            "50",
            "--json",
            "--capacities",
        ])
        .arg(&csv)
        .output()
        .unwrap();
    assert!(plan.status.success(), "{}", text(&plan));
    std::fs::create_dir_all(dir.path().join("plans")).unwrap();
    std::fs::write(dir.path().join("plans/plan-1.json"), &plan.stdout).unwrap();
    let html = report(&[dir.path()], &dir.path().join("report.html"), &[]);
    for needle in [
        "Serving capacity",
        "p99 against offered rate",
        "capacity / closed loop",
        "Fleet plan",
        "1g.10gb",
        "load step(s)",
    ] {
        assert!(html.contains(needle), "{needle}");
    }
    assert!(!html.contains("no runs"), "a folder of load steps alone is a report");
}

#[test]
fn check_reads_the_load_tables_and_names_a_step_without_batches() {
    let dir = tempfile::tempdir().unwrap();
    let o = load(dir.path(), &["--qps", "30", "--duration", "1"]);
    assert!(o.status.success(), "{}", text(&o));
    let c = migprof().arg("check").arg(dir.path()).output().unwrap();
    assert!(
        c.status.success() && text(&c).contains("1 load step(s)") && text(&c).contains("no problems"),
        "{}",
        text(&c)
    );
    for entry in std::fs::read_dir(dir.path().join("load_batches")).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    let c = migprof().arg("check").arg(dir.path()).output().unwrap();
    assert!(
        !c.status.success() && text(&c).contains("no rows in load_batches/"),
        "{}",
        text(&c)
    );
}

#[test]
fn a_capacity_cell_the_device_cannot_run_is_refused_with_what_runs_there() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sweep.toml");
    // [[capacity]] searches bf16 unless told: candle's CPU kernels have no bf16 matmul.
    std::fs::write(&file, "name = \"bf16\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[capacity]]\nmodels = [\"resnet_tiny\"]\nslo_p99_ms = 50\n").unwrap();
    let out = dir.path().join("out");
    let o = migprof()
        .arg("sweep")
        .arg(&file)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    let runs = read_table(&out, Table::Runs).unwrap();
    assert_eq!(strings(&runs, "status"), vec!["error"]);
    let error = &strings(&runs, "error")[0];
    assert!(
        error.contains("cannot run on cpu") && error.contains("what runs there") && error.contains("infer f32"),
        "{error}"
    );
    assert_eq!(read_table(&out, Table::Capacity).unwrap().height(), 0);
}
