//! SVG plots of a results folder: throughput against batch size, and latency (p50 with a whisker to
//! p99) against batch size, one series per model, mode, dtype and device. Text is laid out with
//! plotters' built-in metrics, so no system font is needed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use plotters::prelude::*;
use polars::prelude::*;

pub const THROUGHPUT_SVG: &str = "throughput_vs_batch.svg";
pub const LATENCY_SVG: &str = "latency_vs_batch.svg";

/// The columns of one `runs` row that the plots use.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub run_id: String,
    pub batch: f64,
    pub throughput: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Which rows are points: rows without a measurement (a cell that failed) and the probes of a max
/// search are not; nor are a concurrent group's members: these plots show cells alone.
fn measured_alone(runs: &DataFrame) -> Result<Vec<bool>> {
    let status: Vec<bool> = match runs.column("status") {
        Ok(c) => c.str()?.iter().map(|v| v.unwrap_or("ok") == "ok").collect(),
        Err(_) => vec![true; runs.height()],
    };
    let grouped: Vec<bool> = match runs.column("concurrency_group") {
        Ok(c) => c.str()?.iter().map(|v| v.is_some()).collect(),
        Err(_) => vec![false; runs.height()],
    };
    Ok(status
        .into_iter()
        .zip(grouped)
        .map(|(ok, grouped)| ok && !grouped)
        .collect())
}

/// Groups rows into series keyed by "model mode dtype · device", sorted by batch size; where a
/// folder holds several runs of one configuration, the latest (largest run id) is plotted.
pub fn series(runs: &DataFrame) -> Result<BTreeMap<String, Vec<Point>>> {
    if runs.height() == 0 {
        return Ok(BTreeMap::new());
    }
    let text = |name: &str| -> Result<Vec<String>> {
        Ok(runs
            .column(name)?
            .str()?
            .iter()
            .map(|v| v.unwrap_or("?").to_string())
            .collect())
    };
    let number = |name: &str| -> Result<Vec<f64>> {
        let c = runs.column(name)?.cast(&DataType::Float64)?;
        Ok(c.f64()?.iter().map(|v| v.unwrap_or(f64::NAN)).collect())
    };
    let (model, mode, dtype, device, run_id) = (
        text("model")?,
        text("mode")?,
        text("dtype")?,
        text("device_name")?,
        text("run_id")?,
    );
    let (prompt_len, output_len, kv_layout, kv_block_size) = (
        crate::results::parts::text_column(runs, "prompt_len")?,
        crate::results::parts::text_column(runs, "output_len")?,
        crate::results::parts::text_column(runs, "kv_layout")?,
        crate::results::parts::text_column(runs, "kv_block_size")?,
    );
    let (batch, throughput, p50, p99) = (
        number("batch")?,
        number("throughput")?,
        number("p50_ms")?,
        number("p99_ms")?,
    );
    let alone = measured_alone(runs)?;
    let mut latest: BTreeMap<String, BTreeMap<u64, Point>> = BTreeMap::new();
    for i in 0..runs.height() {
        if throughput[i].is_nan() || !alone[i] {
            continue;
        }
        // A generation's lengths and cache layout are part of what a point is.
        let lengths = match (&prompt_len[i], &output_len[i]) {
            (Some(p), Some(o)) => format!(
                " prompt {p} output {o}{}{}",
                kv_layout[i].as_deref().map_or(String::new(), |l| format!(" {l}")),
                kv_block_size[i].as_deref().map_or(String::new(), |b| format!(" {b}"))
            ),
            _ => String::new(),
        };
        let key = format!("{} {} {}{lengths} · {}", model[i], mode[i], dtype[i], device[i]);
        let p = Point {
            run_id: run_id[i].clone(),
            batch: batch[i],
            throughput: throughput[i],
            p50_ms: p50[i],
            p99_ms: p99[i],
        };
        let by_batch = latest.entry(key).or_default();
        match by_batch.get(&(batch[i] as u64)) {
            Some(old) if old.run_id >= p.run_id => {}
            _ => {
                by_batch.insert(batch[i] as u64, p);
            }
        }
    }
    Ok(latest
        .into_iter()
        .map(|(k, v)| (k, v.into_values().collect()))
        .collect())
}

/// Draws both plots into `out` and returns their paths; nothing is drawn for an empty table.
pub fn write_plots(out: &Path, runs: &DataFrame) -> Result<Vec<PathBuf>> {
    let series = series(runs)?;
    if series.is_empty() {
        return Ok(Vec::new());
    }
    let mut written = Vec::new();
    for (name, chart) in [(THROUGHPUT_SVG, Chart::Throughput), (LATENCY_SVG, Chart::Latency)] {
        let path = out.join(name);
        let svg = draw(&series, chart).with_context(|| format!("drawing {}", path.display()))?;
        crate::files::write_atomically(&path, svg.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}

#[derive(Clone, Copy)]
enum Chart {
    Throughput,
    Latency,
}

/// The chart as an SVG document.
fn draw(series: &BTreeMap<String, Vec<Point>>, chart: Chart) -> Result<String> {
    let all: Vec<&Point> = series.values().flatten().collect();
    let (bmin, bmax) = bounds(all.iter().map(|p| p.batch));
    let (title, y_desc) = match chart {
        Chart::Throughput => ("Throughput vs batch size", "throughput (samples/s)"),
        Chart::Latency => ("Latency vs batch size (p50, whisker to p99)", "latency per step (ms)"),
    };
    let (ymin, ymax) = match chart {
        Chart::Throughput => bounds(all.iter().map(|p| p.throughput)),
        Chart::Latency => bounds(all.iter().flat_map(|p| [p.p50_ms, p.p99_ms])),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE)?;
        // Batch sizes and latencies span orders of magnitude: both axes are logarithmic, padded so that
        // a single point is not drawn on the frame.
        let mut ctx = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(
                // Ticks at the batch sizes measured: a batch is a whole number of samples.
                (bmin / 1.5..bmax * 1.5).log_scale().with_key_points(batch_ticks(&all)),
                (ymin / 1.5..ymax * 1.5).log_scale(),
            )?;
        ctx.configure_mesh()
            .light_line_style(RGBColor(238, 238, 238))
            .x_desc("batch size (samples per step)")
            .y_desc(y_desc)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| significant(*v).to_string())
            .draw()?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let y = |p: &Point| match chart {
                Chart::Throughput => p.throughput,
                Chart::Latency => p.p50_ms,
            };
            ctx.draw_series(LineSeries::new(
                points.iter().map(|p| (p.batch, y(p))),
                color.stroke_width(2),
            ))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            ctx.draw_series(points.iter().map(|p| Circle::new((p.batch, y(p)), 4, color.filled())))?;
            if let Chart::Latency = chart {
                ctx.draw_series(points.iter().map(|p| {
                    ErrorBar::new_vertical(p.batch, p.p50_ms, p.p50_ms, p.p99_ms, color.stroke_width(1), 10)
                }))?;
            }
        }
        ctx.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// The distinct batch sizes of the points, ascending: the batch axis's ticks.
fn batch_ticks(points: &[&Point]) -> Vec<f64> {
    let batches: std::collections::BTreeSet<u64> = points.iter().map(|p| p.batch.round() as u64).collect();
    batches.into_iter().map(|b| b as f64).collect()
}

/// Smallest and largest positive finite value (a log axis cannot show zero).
fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo.is_finite() {
        (lo, hi)
    } else {
        (1.0, 10.0)
    }
}

/// A tick label with three significant digits and no exponent.
fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::runs::runs_frame;
    use crate::run::record::tests::fake_run;
    use std::time::Duration;

    #[test]
    fn latest_run_per_batch_in_batch_order() -> Result<()> {
        let a8 = fake_run(8, 10, Duration::ZERO);
        let a1 = fake_run(1, 10, Duration::ZERO);
        let newer8 = fake_run(8, 10, Duration::from_micros(500)); // created last: largest run id
        let df = runs_frame(&[a8, a1, newer8.clone()])?;
        let s = series(&df)?;
        assert_eq!(s.len(), 1);
        let (name, points) = s.iter().next().unwrap();
        assert_eq!(name, "resnet_tiny infer f32 · Test CPU (2 threads)");
        assert_eq!(points.iter().map(|p| p.batch).collect::<Vec<_>>(), vec![1.0, 8.0]);
        assert_eq!(points[1].run_id, newer8.run_id);
        assert_eq!(points[1].throughput, newer8.throughput());
        Ok(())
    }

    #[test]
    fn failed_cells_max_probes_and_group_members_are_not_points() -> Result<()> {
        use crate::run::record::{FailedWorkload, Failure, Status};
        let dir = tempfile::tempdir()?;
        let ok = fake_run(8, 10, Duration::ZERO);
        crate::results::runs::write_run(dir.path(), &ok)?;
        let mut probe = fake_run(16, 10, Duration::ZERO);
        probe.cell.status = Status::Probe;
        crate::results::runs::write_run(dir.path(), &probe)?;
        let mut member = fake_run(4, 10, Duration::ZERO);
        member.cell.concurrency_group = Some("3g+3g".into());
        crate::results::runs::write_run(dir.path(), &member)?;
        let failure = Failure {
            run_id: "zzz-failed".into(),
            invocation_id: "inv".into(),
            host: "h".into(),
            started_at: crate::provenance::now(),
            finished_at: crate::provenance::now(),
            identity: crate::run::record::tests::identity_with(Status::Oom),
            workload: FailedWorkload {
                model: "resnet_tiny".into(),
                mode: "infer".into(),
                dtype: "f32".into(),
                batch: 32,
                seq_len: None,
                seed: 0,
                kernel_options: workloads::kernels::KernelOptions::default().canonical(),
                master_weights: None,
                prompt_len: None,
                output_len: None,
                kv_layout: None,
                kv_block_size: None,
            },
            error: "out of memory".into(),
            fingerprint: crate::run::fingerprint::Fingerprint::collect(None),
            program: None,
        };
        crate::results::runs::write_failure(dir.path(), &failure)?;
        let runs = crate::results::parts::read_table(dir.path(), crate::results::parts::Table::Runs)?;
        assert_eq!(runs.height(), 4);
        let s = series(&runs)?;
        let points: Vec<f64> = s.values().flatten().map(|p| p.batch).collect();
        assert_eq!(points, vec![8.0], "{s:?}");
        Ok(())
    }

    #[test]
    fn svgs_have_titles_axes_series_and_whiskers() -> Result<()> {
        let dir = tempfile::tempdir()?;
        let runs = [
            fake_run(1, 10, Duration::ZERO),
            fake_run(4, 10, Duration::ZERO),
            fake_run(16, 10, Duration::ZERO),
        ];
        let written = write_plots(dir.path(), &runs_frame(&runs)?)?;
        assert_eq!(written.len(), 2);
        let tput = std::fs::read_to_string(dir.path().join(THROUGHPUT_SVG))?;
        for want in [
            "Throughput vs batch size",
            "batch size (samples per step)",
            "throughput (samples/s)",
            "resnet_tiny infer f32",
        ] {
            assert!(tput.contains(want), "throughput plot lacks {want:?}");
        }
        assert_eq!(tput.matches("<circle").count(), 3, "one marker per run");
        let lat = std::fs::read_to_string(dir.path().join(LATENCY_SVG))?;
        assert!(lat.contains("latency per step (ms)") && lat.contains("p50, whisker to p99"));
        Ok(())
    }

    #[test]
    fn nothing_is_drawn_for_an_empty_folder() -> Result<()> {
        let dir = tempfile::tempdir()?;
        assert!(write_plots(dir.path(), &DataFrame::default())?.is_empty());
        assert!(!dir.path().join(THROUGHPUT_SVG).exists());
        Ok(())
    }

    #[test]
    fn tick_labels_keep_three_significant_digits() {
        assert_eq!(significant(1234.4), "1234");
        assert_eq!(significant(12.345), "12.3");
        assert_eq!(significant(0.012345), "0.0123");
    }
}
