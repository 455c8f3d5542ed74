//! The report's charts as SVG text: lines with points and whiskers over a shared x axis, one colour
//! per target across every chart of a report. The legend is not drawn inside the chart, where it
//! would hide data: the report writes it beside the chart ([`Chart::legend`]). Text is laid out with
//! plotters' built-in metrics (no fonts needed), and the same data always gives the same bytes.

use anyhow::Result;
use plotters::prelude::*;

/// Colours readable on white, in the order targets get them (no yellow, no pale tints, no grey: grey
/// is the scaling chart's proportional line).
pub const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),  // blue
    (214, 39, 40),   // red
    (44, 160, 44),   // green
    (148, 103, 189), // purple
    (255, 127, 14),  // orange
    (140, 86, 75),   // brown
    (227, 119, 194), // pink
    (23, 190, 207),  // cyan
    (0, 0, 128),     // navy
    (0, 0, 0),       // black
];

/// The colour of the `i`-th target, as CSS.
pub fn css(i: usize) -> String {
    let (r, g, b) = PALETTE[i % PALETTE.len()];
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// One point: x, y, and an optional whisker from `low` to `high`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub x: f64,
    pub y: f64,
    pub whisker: Option<(f64, f64)>,
}

/// One line: its legend, its colour index, its points.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub colour: usize,
    pub points: Vec<Point>,
}

/// How an axis is scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    Linear,
    Log,
}

/// A chart to draw.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub x_scale: Scale,
    pub y_scale: Scale,
    pub series: &'a [Series],
    /// A reference line y = x (the proportional line of a scaling chart).
    pub diagonal: bool,
    /// A dot at every point (off for dense lines: distributions, time series).
    pub markers: bool,
    /// A grey horizontal line at this y (an objective), inside the y axis.
    pub hline: Option<f64>,
    /// The x values are whole numbers (batch sizes): ticks at the values drawn, without decimals.
    pub x_whole: bool,
}

impl<'a> Chart<'a> {
    /// A time series: linear axes, dense lines without markers or reference lines.
    pub fn time_series(title: &'a str, x_label: &'a str, y_label: &'a str, series: &'a [Series]) -> Chart<'a> {
        Chart {
            title,
            x_label,
            y_label,
            x_scale: Scale::Linear,
            y_scale: Scale::Linear,
            series,
            diagonal: false,
            markers: false,
            hline: None,
            x_whole: false,
        }
    }
}

/// The distinct x values of the series, ascending: the ticks of a whole-numbered axis.
fn whole_ticks<'a>(xs: impl Iterator<Item = &'a Point>) -> Vec<f64> {
    let distinct: std::collections::BTreeSet<i64> = xs.map(|p| p.x.round() as i64).collect();
    distinct.into_iter().map(|x| x as f64).collect()
}

/// The scale a positive quantity wants: log where it spans more than a decade.
pub fn scale_for(values: impl Iterator<Item = f64>) -> Scale {
    let (lo, hi) = range(values);
    if lo > 0.0 && hi / lo > 10.0 {
        Scale::Log
    } else {
        Scale::Linear
    }
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// The axis range for `values` on `scale`: padded a little, never beyond what the data needs. A linear
/// quantity axis of positive data starts at 0 (`from_zero`) so that ratios read right; a linear batch
/// axis spans the batches alone.
fn axis(values: impl Iterator<Item = f64>, scale: Scale, from_zero: bool) -> (f64, f64) {
    let (lo, hi) = range(values);
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    match scale {
        // Out to the nearest 1, 2 or 5 times a power of ten on each side: the lowest and highest
        // points then have a labelled tick below and above them.
        Scale::Log => {
            let lo = lo.max(f64::MIN_POSITIVE);
            (nice_below(lo / 1.1), nice_above(hi * 1.1))
        }
        Scale::Linear if from_zero => {
            let lo = if lo >= 0.0 { 0.0 } else { lo * 1.05 };
            let hi = if hi > lo { hi * 1.05 } else { lo + 1.0 };
            (lo, hi)
        }
        Scale::Linear => {
            let pad = if hi > lo {
                (hi - lo) * 0.05
            } else {
                lo.abs().max(1.0) * 0.5
            };
            (lo - pad, hi + pad)
        }
    }
}

/// The mantissas of a log axis's ticks: 1, 2 and 5 times powers of ten.
const NICE: [f64; 3] = [1.0, 2.0, 5.0];

/// The 1-2-5 values from the decade below `lo` to the decade above `hi`, ascending (none unless
/// both are positive and finite).
fn nice_values(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo > 0.0 && hi >= lo && hi.is_finite()) {
        return Vec::new();
    }
    let (first, last) = (lo.log10().floor() as i32 - 1, hi.log10().ceil() as i32 + 1);
    (first..=last).flat_map(|e| NICE.map(|m| m * 10f64.powi(e))).collect()
}

/// The largest 1-2-5 value at or below v (v > 0).
fn nice_below(v: f64) -> f64 {
    nice_values(v, v)
        .into_iter()
        .filter(|n| *n <= v * (1.0 + 1e-12))
        .fold(v, |_, n| n)
}

/// The smallest 1-2-5 value at or above v (v > 0).
fn nice_above(v: f64) -> f64 {
    nice_values(v, v)
        .into_iter()
        .find(|n| *n >= v * (1.0 - 1e-12))
        .unwrap_or(v)
}

/// A log axis's ticks over [lo, hi] (both 1-2-5 values, from `axis`): every 1-2-5 value where they
/// are few, else powers of ten and the ends.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let within = |v: &f64| *v >= lo * (1.0 - 1e-9) && *v <= hi * (1.0 + 1e-9);
    let all: Vec<f64> = nice_values(lo, hi).into_iter().filter(within).collect();
    if all.len() <= 10 {
        return all;
    }
    let mut ticks: Vec<f64> = all
        .into_iter()
        .filter(|v| (v.log10() - v.log10().round()).abs() < 1e-9)
        .collect();
    for end in [lo, hi] {
        if !ticks.iter().any(|t| (t / end - 1.0).abs() < 1e-9) {
            ticks.push(end);
        }
    }
    ticks.sort_by(f64::total_cmp);
    ticks
}

/// Three significant digits for tick labels.
pub fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

/// A tick's label: three significant digits, without trailing zeros (a 1-2-5 tick reads 20, 0.5).
fn tick_label(v: f64) -> String {
    let s = significant(v);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

impl Chart<'_> {
    /// What each colour means: every series, and the proportional line of a scaling chart.
    pub fn legend(&self) -> Vec<(String, Option<usize>)> {
        let mut l: Vec<(String, Option<usize>)> =
            self.series.iter().map(|s| (s.name.clone(), Some(s.colour))).collect();
        if self.diagonal {
            l.push(("proportional to SMs (grey)".into(), None));
        }
        l
    }

    /// The axes' ranges: every point and whisker (and the objective's line), and on a chart with
    /// the diagonal the same range on both.
    fn ranges(&self) -> ((f64, f64), (f64, f64)) {
        let xs = self.series.iter().flat_map(|s| s.points.iter().map(|p| p.x));
        let ys = self.series.iter().flat_map(|s| {
            s.points.iter().flat_map(|p| {
                [Some(p.y), p.whisker.map(|w| w.0), p.whisker.map(|w| w.1)]
                    .into_iter()
                    .flatten()
            })
        });
        let (x0, x1) = axis(xs, self.x_scale, self.diagonal);
        let (mut y0, mut y1) = axis(ys.chain(self.hline), self.y_scale, true);
        if self.diagonal {
            y0 = y0.min(x0);
            y1 = y1.max(x1);
        }
        ((x0, x1), (y0, y1))
    }

    /// The ticks of a log axis, at the batches drawn (whole numbers) or at 1-2-5 values, and how
    /// many labels the x axis takes.
    fn ticks(&self, (x0, x1): (f64, f64), (y0, y1): (f64, f64)) -> (Vec<f64>, Vec<f64>, usize) {
        let x_ticks = match (self.x_whole, self.x_scale) {
            (true, _) => whole_ticks(self.series.iter().flat_map(|s| s.points.iter())),
            (false, Scale::Log) => log_ticks(x0, x1),
            (false, Scale::Linear) => Vec::new(),
        };
        let y_ticks = match self.y_scale {
            Scale::Log => log_ticks(y0, y1),
            Scale::Linear => Vec::new(),
        };
        // plotters' default is 10 labels.
        let x_labels = if self.x_whole {
            ((x1 - x0).floor() as usize).clamp(1, 10)
        } else {
            10
        };
        (x_ticks, y_ticks, x_labels)
    }

    /// The chart as an SVG document (760×420).
    pub fn svg(&self) -> Result<String> {
        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, (760, 420)).into_drawing_area();
            root.fill(&WHITE)?;
            let ((x0, x1), (y0, y1)) = self.ranges();
            let mut builder = ChartBuilder::on(&root);
            builder
                .caption(self.title, ("sans-serif", 18))
                .margin(14)
                .x_label_area_size(44)
                .y_label_area_size(70);
            let x_format = |v: &f64| {
                if self.x_whole {
                    format!("{v:.0}")
                } else {
                    tick_label(*v)
                }
            };
            let (x_ticks, y_ticks, x_labels) = self.ticks((x0, x1), (y0, y1));
            // plotters types a chart by its axes: one body per combination.
            macro_rules! draw {
                ($xr:expr, $yr:expr) => {{
                    let mut ctx = builder.build_cartesian_2d($xr, $yr)?;
                    ctx.configure_mesh()
                        .light_line_style(RGBColor(235, 235, 235))
                        .x_desc(self.x_label)
                        .y_desc(self.y_label)
                        .x_labels(x_labels)
                        .x_label_formatter(&x_format)
                        .y_label_formatter(&|v| tick_label(*v))
                        .draw()?;
                    if self.diagonal {
                        ctx.draw_series(LineSeries::new(
                            [(x0, x0), (x1, x1)],
                            RGBColor(120, 120, 120).stroke_width(1),
                        ))?;
                    }
                    if let Some(y) = self.hline {
                        // Darker and wider than the mesh, which it would otherwise disappear into.
                        ctx.draw_series(LineSeries::new(
                            [(x0, y), (x1, y)],
                            RGBColor(90, 90, 90).stroke_width(2),
                        ))?;
                    }
                    for s in self.series {
                        let (r, g, b) = PALETTE[s.colour % PALETTE.len()];
                        let colour = RGBColor(r, g, b);
                        let mut points = s.points.clone();
                        points.sort_by(|a, b| a.x.total_cmp(&b.x));
                        ctx.draw_series(LineSeries::new(
                            points.iter().map(|p| (p.x, p.y)),
                            colour.stroke_width(2),
                        ))?;
                        if self.markers {
                            ctx.draw_series(points.iter().map(|p| Circle::new((p.x, p.y), 3, colour.filled())))?;
                        }
                        ctx.draw_series(points.iter().filter_map(|p| {
                            p.whisker
                                .map(|(lo, hi)| ErrorBar::new_vertical(p.x, lo, p.y, hi, colour.stroke_width(1), 8))
                        }))?;
                    }
                }};
            }
            match (self.x_scale, self.y_scale) {
                (Scale::Log, Scale::Log) => draw!(
                    (x0..x1).log_scale().with_key_points(x_ticks),
                    (y0..y1).log_scale().with_key_points(y_ticks)
                ),
                (Scale::Log, Scale::Linear) => draw!((x0..x1).log_scale().with_key_points(x_ticks), y0..y1),
                // A linear axis cannot take key points here (plotters has no formatter for them); asked
                // for at most one label per unit, its steps are whole numbers (1, 2, 5, 10, …).
                (Scale::Linear, Scale::Log) => draw!(x0..x1, (y0..y1).log_scale().with_key_points(y_ticks)),
                (Scale::Linear, Scale::Linear) => draw!(x0..x1, y0..y1),
            }
            root.present()?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(colour: usize, pts: &[(f64, f64)]) -> Series {
        Series {
            name: format!("t{colour}"),
            colour,
            points: pts
                .iter()
                .map(|&(x, y)| Point {
                    x,
                    y,
                    whisker: Some((y * 0.9, y * 1.1)),
                })
                .collect(),
        }
    }

    #[test]
    fn a_chart_is_an_svg_with_its_texts_and_the_same_bytes_every_time() {
        let s = [
            series(0, &[(1.0, 10.0), (128.0, 900.0)]),
            series(1, &[(1.0, 5.0), (128.0, 400.0)]),
        ];
        let chart = Chart {
            title: "Throughput",
            x_label: "batch",
            y_label: "samples/s",
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: &s,
            diagonal: false,
            markers: true,
            hline: None,
            x_whole: true,
        };
        let svg = chart.svg().unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{}",
            &svg[..80]
        );
        for text in ["Throughput", "batch", "samples/s"] {
            assert!(svg.contains(text), "{text}");
        }
        assert_eq!(
            chart.legend(),
            vec![("t0".to_string(), Some(0)), ("t1".to_string(), Some(1))]
        );
        assert!(
            svg.contains("#1F77B4") || svg.contains("#1f77b4"),
            "the first target is blue"
        );
        assert_eq!(chart.svg().unwrap(), svg);
        // The batch axis ticks at the batches drawn, 1 and 128, and at no fraction of one.
        let ticks: Vec<&str> = svg
            .split("<text")
            .filter_map(|t| Some(t.split('>').nth(1)?.split('<').next()?.trim()))
            .collect();
        assert!(ticks.contains(&"1") && ticks.contains(&"128"), "{ticks:?}");
        assert!(
            !ticks
                .iter()
                .any(|t| t.contains('.') && t.parse::<f64>().is_ok_and(|v| v < 200.0 && v.fract() != 0.0)),
            "{ticks:?}"
        );
        // On a linear axis of batches 1 and 2, whole ticks only (a free axis would tick every 0.1).
        let s = [series(0, &[(1.0, 10.0), (2.0, 18.0)])];
        let linear = Chart {
            x_scale: Scale::Linear,
            y_scale: Scale::Linear,
            series: &s,
            ..chart
        };
        let svg = linear.svg().unwrap();
        let ticks: Vec<String> = svg
            .split("<text")
            .filter_map(|t| Some(t.split('>').nth(1)?.split('<').next()?.trim().to_string()))
            .collect();
        let xs: Vec<&String> = ticks.iter().filter(|t| *t == "1" || *t == "2").collect();
        assert!(!xs.is_empty(), "{ticks:?}");
        assert!(
            !ticks.iter().any(|t| t == "1.5" || t == "1.1" || t == "1.9"),
            "{ticks:?}"
        );
    }

    #[test]
    fn scales_follow_the_data() {
        assert_eq!(scale_for([1.0, 128.0].into_iter()), Scale::Log);
    }

    #[test]
    fn a_log_axis_has_a_labelled_tick_below_its_lowest_point_and_above_its_highest() {
        // TTFT p99 from 3.9 ms to 2.6 s against offered rates of 9 to 147 requests/s.
        let s = [series(0, &[(9.0, 3.9), (36.8, 22.6), (147.1, 2603.6)])];
        let chart = Chart {
            title: "TTFT",
            x_label: "offered requests/s",
            y_label: "ms",
            x_scale: Scale::Log,
            y_scale: Scale::Log,
            series: &s,
            diagonal: false,
            markers: true,
            hline: Some(500.0),
            x_whole: false,
        };
        let svg = chart.svg().unwrap();
        let labels: Vec<f64> = svg
            .split("<text")
            .filter_map(|t| t.split('>').nth(1)?.split('<').next()?.trim().parse().ok())
            .collect();
        for (below, above) in [(3.9, 2603.6), (9.0, 147.1)] {
            assert!(
                labels.iter().any(|l| *l <= below),
                "no tick at or below {below}: {labels:?}"
            );
            assert!(
                labels.iter().any(|l| *l >= above),
                "no tick at or above {above}: {labels:?}"
            );
        }
        // 1-2-5 ticks read as such.
        assert!(labels.contains(&5.0) && labels.contains(&1000.0), "{labels:?}");
        assert_eq!(
            (tick_label(20.0), tick_label(0.5), tick_label(5000.0)),
            ("20".into(), "0.5".into(), "5000".into())
        );
        assert_eq!(
            (nice_below(3.5), nice_above(2864.0), nice_below(10.0)),
            (2.0, 5000.0, 10.0)
        );
        assert_eq!(scale_for([100.0, 900.0].into_iter()), Scale::Linear);
        // A linear axis of positive data starts at zero and ends just past the data.
        assert_eq!(axis([2.0, 10.0].into_iter(), Scale::Linear, true), (0.0, 10.5));
        // A batch axis of 32 and 128 spans them, not 0 to 32.
        let (lo, hi) = axis([32.0, 128.0].into_iter(), Scale::Linear, false);
        assert!((lo - 27.2).abs() < 1e-9 && (hi - 132.8).abs() < 1e-9, "{lo} {hi}");
        assert_eq!(significant(1234.6), "1235");
        assert_eq!(significant(0.01234), "0.0123");
    }
}
