//! The runs, samples and metrics tables written and read back.

use super::*;
use crate::provenance;
use crate::results::parts::{read_part, read_parts, read_table, SCHEMA_VERSION};
use crate::run::record::tests::fake_run;
use std::fs::{self, File};
use std::time::Duration;

fn get_f64(df: &DataFrame, name: &str, row: usize) -> f64 {
    df.column(name).unwrap().get(row).unwrap().try_extract::<f64>().unwrap()
}

#[test]
fn runs_and_samples_round_trip() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut a = fake_run(8, 30, Duration::ZERO);
    a.fingerprint.pool_held_mib = Some(576.0);
    let b = fake_run(1, 5, Duration::from_micros(50));
    write_run(dir.path(), &a)?;
    write_run(dir.path(), &b)?;

    let runs = read_table(dir.path(), Table::Runs)?;
    assert_eq!(runs.height(), 2);
    let ids: Vec<String> = runs
        .column("run_id")?
        .str()?
        .iter()
        .map(|s| s.unwrap().to_string())
        .collect();
    let row_a = ids.iter().position(|id| *id == a.run_id).expect("run a");
    let row_b = ids.iter().position(|id| *id == b.run_id).expect("run b");
    assert_eq!(get_f64(&runs, "throughput", row_a), 4000.0);
    assert_eq!(get_f64(&runs, "mean_ms", row_a), 2.0);
    assert!(
        (get_f64(&runs, "p99_ms", row_a) - 3.0).abs() <= 3e-3,
        "within HDR precision"
    );
    assert_eq!(runs.column("verdict")?.str()?.get(row_b), Some("too_few_iterations"));
    assert_eq!(
        runs.column("seq_len")?.null_count(),
        2,
        "images have no sequence length"
    );
    assert_eq!(
        runs.column("kernel_options")?.str()?.get(row_a),
        Some("v8;attention=fused;layers=op;gemm=timed;graphs=on;convs=nhwc")
    );
    assert_eq!(
        runs.column("candle_version")?.str()?.get(row_a),
        Some(provenance::CANDLE_VERSION)
    );
    assert_eq!(get_f64(&runs, "pool_held_mib_start", row_a), 576.0);
    assert_eq!(
        runs.column("pool_held_mib_start")?.f64()?.get(row_b),
        None,
        "a CPU run has no pool"
    );
    // 30 steps of 1 and 3 ms alternating: the mean's interval holds 2 ms; p99 needs 299 steps.
    let (lo, hi) = (
        get_f64(&runs, "mean_ms_ci_low", row_a),
        get_f64(&runs, "mean_ms_ci_high", row_a),
    );
    assert!(lo < 2.0 && 2.0 < hi && hi - lo < 1.0, "{lo} {hi}");
    assert!((get_f64(&runs, "throughput_ci_high", row_a) - 8000.0 / lo).abs() < 1e-6);
    assert_eq!(runs.column("p99_ms_ci_low")?.null_count(), 2);
    assert!(runs
        .column("ci_note")?
        .str()?
        .get(row_a)
        .unwrap()
        .contains("p99: 30 steps"));
    assert_eq!(
        runs.column("driver_version")?.null_count(),
        2,
        "a CPU run has no driver"
    );
    assert_eq!(runs.column("std_ms")?.null_count(), 0);
    assert_eq!(
        runs.column("started_at")?.dtype(),
        &DataType::Datetime(TimeUnit::Microseconds, Some(TimeZone::UTC))
    );

    // The stored histogram decodes to the run's latencies.
    let bytes = runs.column("histogram")?.binary()?.get(row_a).unwrap().to_vec();
    let h: hdrhistogram::Histogram<u64> = hdrhistogram::serialization::Deserializer::new()
        .deserialize(&mut bytes.as_slice())
        .unwrap();
    assert_eq!(h.len(), 30);

    let samples = read_table(dir.path(), Table::Samples)?;
    assert_eq!(samples.height(), 35);
    let lat: i64 = samples.column("latency_ns")?.i64()?.iter().flatten().sum();
    let want: u64 = a
        .measurement
        .latencies_ns
        .iter()
        .chain(&b.measurement.latencies_ns)
        .sum();
    assert_eq!(lat as u64, want);
    Ok(())
}

#[test]
fn sampler_readings_and_their_summary_round_trip() -> Result<()> {
    use crate::gpu::sampler::{summarize, Gpm, Sample};
    let dir = tempfile::tempdir()?;
    let mut run = fake_run(8, 30, Duration::ZERO);
    run.metrics = (0..3u64)
        .map(|i| Sample {
            t: Duration::from_millis(100 * i),
            fb_used_mib: Some(1000.0 + 100.0 * i as f64),
            gpu_energy_mj: Some(1_000_000 + 24_000 * i),
            gpm: (i > 0).then_some(Gpm {
                graphics: Some(90.0),
                ..Default::default()
            }),
            ..Default::default()
        })
        .collect();
    run.metric_summary = summarize(&run.metrics, 240);
    let written = write_run(dir.path(), &run)?;
    assert!(written.metrics.is_some());
    let metrics = read_table(dir.path(), Table::Metrics)?;
    assert_eq!(metrics.height(), 3);
    assert_eq!(
        metrics.column("gract")?.null_count(),
        1,
        "no GPM reading in the first sample: null, not 0"
    );
    assert_eq!(metrics.column("util_gpu_pct")?.null_count(), 3);
    let runs = read_table(dir.path(), Table::Runs)?;
    assert_eq!(get_f64(&runs, "fb_used_max_mib", 0), 1200.0);
    assert_eq!(get_f64(&runs, "gpu_energy_j", 0), 48.0);
    assert_eq!(get_f64(&runs, "j_per_sample", 0), 0.2);
    assert_eq!(runs.column("gpu_power_mean_w")?.null_count(), 1);
    // A CPU run has no metrics part.
    assert!(write_run(dir.path(), &fake_run(1, 10, Duration::ZERO))?
        .metrics
        .is_none());
    Ok(())
}

#[test]
fn a_failed_cell_s_row_has_every_column_of_a_run_s_row() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let run = fake_run(8, 30, Duration::ZERO);
    assert_eq!(
        runs_schema()?,
        runs_frame(std::slice::from_ref(&run))?.schema().as_ref().clone()
    );
    let ran = read_part(&write_run(dir.path(), &run)?.runs, Table::Runs).map_err(anyhow::Error::msg)?;
    let failure = Failure {
        run_id: "zzz-failed".into(),
        invocation_id: "inv".into(),
        host: "h".into(),
        started_at: provenance::now(),
        finished_at: provenance::now(),
        workload: crate::run::record::FailedWorkload {
            model: "resnet_tiny".into(),
            mode: "infer".into(),
            dtype: "bf16".into(),
            batch: 2,
            seq_len: None,
            seed: 0,
            kernel_options: run.kernels.canonical(),
            master_weights: None,
            prompt_len: None,
            output_len: None,
            kv_layout: None,
            kv_block_size: None,
        },
        identity: crate::run::record::tests::identity_with(crate::run::record::Status::Error),
        error: "bf16 cannot run on cpu".into(),
        fingerprint: run.fingerprint.clone(),
        program: None,
    };
    let path = write_failure(dir.path(), &failure)?;
    let failed = read_part(&path, Table::Runs).map_err(anyhow::Error::msg)?;
    assert_eq!(
        failed.schema(),
        ran.schema(),
        "the same columns of the same types, as written"
    );
    for (column, null) in [
        ("throughput", true),
        ("p50_ms", true),
        ("verdict", true),
        ("model", false),
        ("error", false),
    ] {
        assert_eq!(failed.column(column)?.null_count() == 1, null, "{column}");
    }
    assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 2);
    Ok(())
}

/// A folder of every kind of row (ok, probe, error, oom, timeout, crashed), the first part by name a
/// failed one, read as users read it: pyarrow's `read_table` of the folder, a plain duckdb glob,
/// a polars scan. Each must see every row and every column.
#[test]
#[ignore = "needs python3 with pyarrow, duckdb and polars (.ci/run installs them)"]
fn a_folder_of_every_status_reads_whole_in_pyarrow_duckdb_and_polars() -> Result<()> {
    use crate::run::record::{FailedWorkload, Status};
    let dir = tempfile::tempdir()?;
    let ok = fake_run(8, 30, Duration::ZERO);
    write_run(dir.path(), &ok)?;
    let mut probe = fake_run(16, 10, Duration::ZERO);
    probe.cell.status = Status::Probe;
    write_run(dir.path(), &probe)?;
    for (i, status) in [Status::Error, Status::Oom, Status::Timeout, Status::Crashed]
        .into_iter()
        .enumerate()
    {
        write_failure(
            dir.path(),
            &Failure {
                // Named to sort first: a reader that takes the first part's schema meets a failed row.
                run_id: format!("0000-failed-{i}"),
                invocation_id: "inv".into(),
                host: "h".into(),
                started_at: provenance::now(),
                finished_at: provenance::now(),
                workload: FailedWorkload {
                    model: "resnet_tiny".into(),
                    mode: "infer".into(),
                    dtype: "bf16".into(),
                    batch: 2,
                    seq_len: None,
                    seed: 0,
                    kernel_options: ok.kernels.canonical(),
                    master_weights: None,
                    prompt_len: None,
                    output_len: None,
                    kv_layout: None,
                    kv_block_size: None,
                },
                identity: crate::run::record::tests::identity_with(status),
                error: format!("{} ended it", status.as_str()),
                fingerprint: ok.fingerprint.clone(),
                program: None,
            },
        )?;
    }
    let width = runs_schema()?.len();
    let script = r#"
import sys, duckdb, polars as pl, pyarrow.parquet as pq
d, width = sys.argv[1], int(sys.argv[2])
t = pq.read_table(f"{d}/runs")
assert (t.num_rows, t.num_columns) == (6, width), (t.num_rows, t.num_columns, width)
rows = t.to_pylist()
assert sorted(r["status"] for r in rows) == ["crashed", "error", "ok", "oom", "probe", "timeout"], rows
assert sum(r["throughput"] is not None for r in rows) == 2 and sum(r["p50_ms"] is not None for r in rows) == 2
n, measured, verdicts = duckdb.sql(f"select count(*), count(throughput), count(verdict) from '{d}/runs/*.parquet'").fetchall()[0]
assert (n, measured, verdicts) == (6, 2, 2), (n, measured, verdicts)
df = pl.scan_parquet(f"{d}/runs/*.parquet").collect()
assert df.shape == (6, width), df.shape
assert df["throughput"].null_count() == 4 and df["error"].null_count() == 2
print("read whole:", t.num_rows, "rows,", t.num_columns, "columns")
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir.path())
        .arg(width.to_string())
        .output()?;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn every_column_written_is_in_the_schema_page() -> Result<()> {
    let schema = include_str!("../../../../docs/schema.md");
    let dir = tempfile::tempdir()?;
    let mut run = fake_run(8, 30, Duration::ZERO);
    run.metrics = vec![crate::gpu::sampler::Sample::default()];
    write_run(dir.path(), &run)?;
    for table in [Table::Runs, Table::Samples, Table::Metrics] {
        let frame = read_table(dir.path(), table)?;
        let missing: Vec<String> = frame
            .get_column_names()
            .iter()
            .map(|c| c.to_string())
            .filter(|c| !schema.contains(&format!("`{c}`")))
            .collect();
        assert!(
            missing.is_empty(),
            "docs/schema.md lacks these {} columns: {missing:?}",
            table.dir_name()
        );
    }
    Ok(())
}

#[test]
fn an_empty_or_missing_folder_reads_as_no_rows() -> Result<()> {
    let dir = tempfile::tempdir()?;
    assert_eq!(read_table(&dir.path().join("nothing"), Table::Runs)?.height(), 0);
    assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 0);
    Ok(())
}

#[test]
fn corrupt_and_foreign_parts_are_skipped_by_name_and_the_rest_reads() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
    fs::write(dir.path().join("runs/part-broken.parquet"), b"PAR1 not really")?;
    let mut foreign = DataFrame::new(1, vec![Column::new("x".into(), vec![1i64])])?;
    ParquetWriter::new(File::create(dir.path().join("runs/part-foreign.parquet"))?).finish(&mut foreign)?;
    let (runs, skipped) = read_parts(dir.path(), Table::Runs)?;
    assert_eq!(runs.height(), 1);
    let why: Vec<String> = skipped
        .iter()
        .map(|(p, w)| format!("{}: {w}", p.file_name().unwrap().to_string_lossy()))
        .collect();
    assert_eq!(why.len(), 2, "{why:?}");
    assert!(
        why[0].starts_with("part-broken.parquet: not a readable Parquet file"),
        "{why:?}"
    );
    assert!(
        why[1].starts_with("part-foreign.parquet: not a migprof runs part (no schema_version, run_id column)"),
        "{why:?}"
    );
    assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
    Ok(())
}

#[test]
fn parts_of_an_older_schema_read_beside_new_ones_with_nulls() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
    // A schema-1 row: no kernel_options, no sweep columns, no fingerprint.
    let mut old = DataFrame::new(
        1,
        vec![
            Column::new("schema_version".into(), vec![1i32]),
            Column::new("run_id".into(), vec!["0000-old"]),
            Column::new("model".into(), vec!["resnet18"]),
            Column::new("throughput".into(), vec![12.5f64]),
        ],
    )?;
    ParquetWriter::new(File::create(dir.path().join("runs/part-0000-old.parquet"))?).finish(&mut old)?;
    let (runs, skipped) = read_parts(dir.path(), Table::Runs)?;
    assert!(skipped.is_empty(), "{skipped:?}");
    assert_eq!(runs.height(), 2);
    let versions: Vec<i32> = runs.column("schema_version")?.i32()?.iter().flatten().collect();
    assert_eq!(versions, vec![1, SCHEMA_VERSION]);
    assert_eq!(runs.column("kernel_options")?.null_count(), 1);
    assert_eq!(runs.column("status")?.str()?.get(0), None);
    Ok(())
}

#[test]
fn gpm_scope_and_the_measured_bandwidth_say_what_the_slice_had() -> Result<()> {
    use crate::gpu::Selected;
    let (whole, slice) = crate::device::tests::recorded_gpu_and_slice();
    let on = |kind, selected: Selected, gpm: bool| {
        let mut r = fake_run(2, 10, Duration::ZERO);
        r.context.device = crate::device::DeviceInfo {
            kind,
            name: String::new(),
            emulation: None,
            memory_system: (kind == "mig").then_some(crate::gpu::memory_system::MemorySystem {
                bandwidth_gbps: 373.0,
                l2_mib: Some(6.0),
            }),
            selected: Some(selected),
            kernel_sms: (kind != "cpu").then_some(if kind == "mig" { 16 } else { 132 }),
        };
        r.metric_summary.gract_mean = gpm.then_some(40.0);
        r
    };
    let runs = [
        fake_run(2, 10, Duration::ZERO),
        on("mig", slice, true),
        on("cuda", whole.clone(), true),
        on("cuda", whole, false),
    ];
    let df = runs_frame(&runs)?;
    let scope: Vec<Option<&str>> = df.column("gpm_scope")?.str()?.iter().collect();
    // The CPU and a GPU without GPM readings say nothing.
    assert_eq!(scope, [None, Some("gpu_instance"), Some("gpu"), None]);
    let bandwidth: Vec<Option<f64>> = df.column("measured_bandwidth_gbps")?.f64()?.iter().collect();
    assert_eq!(bandwidth, [None, Some(373.0), None, None]);
    let kernel_sms: Vec<Option<i64>> = df.column("kernel_sm_count")?.i64()?.iter().collect();
    assert_eq!(kernel_sms, [None, Some(16), Some(132), Some(132)]);
    Ok(())
}

#[test]
fn an_emulated_slice_s_rows_say_how_its_memory_was_emulated_and_what_the_neighbour_was_set_to() -> Result<()> {
    use crate::mps::calibration::Outcome;
    let (whole, _) = crate::device::tests::recorded_gpu_and_slice();
    let emulated = |partition: Option<crate::mps::partition::Partition>| {
        let mut r = fake_run(2, 10, Duration::ZERO);
        r.context.device = crate::device::DeviceInfo {
            kind: "mps",
            name: String::new(),
            emulation: Some(crate::device::tests::emulated_1g(partition)),
            memory_system: Some(crate::gpu::memory_system::MemorySystem {
                bandwidth_gbps: 361.0,
                l2_mib: None,
            }),
            selected: Some(whole.clone()),
            kernel_sms: Some(16),
        };
        r
    };
    let partition = crate::mps::partition::Partition {
        gpu_bandwidth_gbps: 2984.0,
        share_gbps: 373.0,
        alone_bandwidth_gbps: Some(1290.0),
        bandwidth_gbps: 361.0,
        load: Some(crate::mps::calibration::Load {
            blocks: 40,
            pause_ns: 76,
        }),
        outcome: Outcome::Reached,
        cached: true,
        neighbour_sms: Some(114),
        shared_sms: Some(16),
        compute_slowdown_pct: Some(0.9),
        sm_clock_mhz: Some(1980),
        throttle_reasons: Some(0),
        neighbour_pid: Some(4242),
    };
    let runs = [
        fake_run(2, 10, Duration::ZERO),
        emulated(None),
        emulated(Some(partition)),
    ];
    let df = runs_frame(&runs)?;
    let text = |c: &str| -> Result<Vec<Option<String>>> {
        Ok(df.column(c)?.str()?.iter().map(|v| v.map(str::to_string)).collect())
    };
    let number =
        |c: &str| -> Result<Vec<Option<f64>>> { Ok(df.column(c)?.cast(&DataType::Float64)?.f64()?.iter().collect()) };
    assert_eq!(
        text("memory_emulation")?,
        [None, Some("alone".into()), Some("partitioned".into())]
    );
    assert_eq!(text("calibration")?, [None, None, Some("reached".into())]);
    assert_eq!(number("memory_share_gbps")?, [None, None, Some(373.0)]);
    assert_eq!(number("gpu_bandwidth_gbps")?, [None, None, Some(2984.0)]);
    assert_eq!(number("alone_bandwidth_gbps")?, [None, None, Some(1290.0)]);
    assert_eq!(number("neighbour_blocks")?, [None, None, Some(40.0)]);
    assert_eq!(number("neighbour_pause_ns")?, [None, None, Some(76.0)]);
    assert_eq!(number("neighbour_sms")?, [None, None, Some(114.0)]);
    assert_eq!(number("shared_sms")?, [None, None, Some(16.0)]);
    assert_eq!(number("compute_slowdown_pct")?, [None, None, Some(0.9)]);
    assert_eq!(number("calibration_sm_clock_mhz")?, [None, None, Some(1980.0)]);
    assert_eq!(number("calibration_throttle_reasons")?, [None, None, Some(0.0)]);
    assert_eq!(number("measured_bandwidth_gbps")?, [None, Some(361.0), Some(361.0)]);
    assert_eq!(number("measured_l2_mib")?, [None, None, None]);
    let cached: Vec<Option<bool>> = df.column("calibration_cached")?.bool()?.iter().collect();
    assert_eq!(cached, [None, None, Some(true)]);
    Ok(())
}

#[test]
fn half_precision_training_written_before_master_weights_reads_as_none() -> Result<()> {
    let dir = tempfile::tempdir()?;
    fs::create_dir_all(dir.path().join("runs"))?;
    // A schema-5 part: bf16 and f16 training then updated the half-precision weights themselves.
    let mut old = DataFrame::new(
        4,
        vec![
            Column::new("schema_version".into(), vec![5i32; 4]),
            Column::new("run_id".into(), vec!["a", "b", "c", "d"]),
            Column::new("mode".into(), vec!["train", "train", "train", "infer"]),
            Column::new("dtype".into(), vec!["bf16", "f16", "f32", "bf16"]),
        ],
    )?;
    ParquetWriter::new(File::create(dir.path().join("runs/part-0000-old.parquet"))?).finish(&mut old)?;
    let runs = read_table(dir.path(), Table::Runs)?;
    let masters: Vec<Option<&str>> = runs.column("master_weights")?.str()?.iter().collect();
    assert_eq!(masters, vec![Some("none"), Some("none"), None, None]);
    Ok(())
}

#[test]
fn leftover_temporary_files_are_ignored() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_run(dir.path(), &fake_run(2, 10, Duration::ZERO))?;
    fs::write(dir.path().join("runs/.part-x.parquet.tmp-1"), b"half a file")?;
    assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
    Ok(())
}

#[test]
fn a_failed_write_leaves_earlier_parts_and_no_temporary_file() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let first = fake_run(2, 10, Duration::ZERO);
    write_run(dir.path(), &first)?;
    // A later run whose part cannot be renamed into place: its final name is a folder.
    let second = fake_run(4, 10, Duration::ZERO);
    fs::create_dir_all(dir.path().join(format!("samples/part-{}.parquet/x", second.run_id)))?;
    assert!(write_run(dir.path(), &second).is_err());
    assert_eq!(read_table(dir.path(), Table::Runs)?.height(), 1);
    let leftovers: Vec<_> = fs::read_dir(dir.path().join("samples"))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind: {leftovers:?}");
    Ok(())
}

/// The `runs` section of docs/schema.md names every column of the table with its type, in the order
/// the table writes them: the table of columns ([`super::columns::RUNS`]) and the page agree.
#[test]
fn the_schema_page_gives_each_runs_column_its_type_in_order() -> Result<()> {
    let page = include_str!("../../../../docs/schema.md");
    let section = page
        .split("\n## runs\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("docs/schema.md has a runs section");
    let documented: Vec<(String, String)> = section
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            (!name.contains('`')).then(|| (name.to_string(), cells.get(2).unwrap_or(&"").replace('\\', "")))
        })
        .collect();
    let type_name = |dtype: &DataType| match dtype {
        DataType::String => "string".to_string(),
        DataType::Int32 => "int32".to_string(),
        DataType::Int64 => "int64".to_string(),
        DataType::UInt64 => "uint64".to_string(),
        DataType::Float64 => "double".to_string(),
        DataType::Float32 => "float".to_string(),
        DataType::Boolean => "bool".to_string(),
        DataType::Binary => "binary".to_string(),
        DataType::Datetime(_, _) => "timestamp[us, UTC]".to_string(),
        DataType::List(_) => "list<string>".to_string(),
        other => format!("{other:?}"),
    };
    let written: Vec<(String, String)> = runs_schema()?
        .iter()
        .map(|(name, dtype)| (name.to_string(), type_name(dtype)))
        .collect();
    assert_eq!(
        written, documented,
        "the runs table as written (left) and as docs/schema.md gives it (right)"
    );
    Ok(())
}
