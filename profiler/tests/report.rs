//! `migprof report` on real GPU rows (tests/fixtures/h100-mps: ResNet-50 on the lent H100, whole and
//! as emulated slices) and on a CPU sweep made here: the same folders give the same bytes, the page is
//! strict HTML, every section and chart is there with a table under it; and, where Chromium is
//! installed, the page renders with every chart at a non-zero size and no console error.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use html5ever::tendril::TendrilSink;

mod common;
use common::*;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h100-mps")
}

/// html5ever's parse errors of a page (none for strict HTML).
fn parse_errors(html: &str) -> Vec<String> {
    let dom = html5ever::parse_document(markup5ever_rcdom::RcDom::default(), html5ever::ParseOpts::default())
        .from_utf8()
        .read_from(&mut html.as_bytes())
        .unwrap();
    let errors = dom.errors.borrow().iter().map(|e| e.to_string()).collect();
    errors
}

#[test]
fn the_report_of_gpu_rows_is_strict_html_with_every_section_the_same_bytes_every_time() {
    let dir = tempfile::tempdir().unwrap();
    let page = report(&[&fixture()], &dir.path().join("a.html"), &[]);
    assert_eq!(
        report(&[&fixture()], &dir.path().join("b.html"), &[]),
        page,
        "the same input gives the same bytes"
    );
    assert_eq!(parse_errors(&page), Vec::<String>::new());
    for needle in [
        "<h2 id=\"what-ran\">What ran</h2>",
        "<h2 id=\"model-resnet50\">resnet50</h2>",
        "resnet50, infer, bf16",
        "resnet50, train, bf16",
        "<h2 id=\"scaling\">Scaling with the share of SMs</h2>",
        "<h2 id=\"against-baseline\">Each target against full</h2>",
        "<h2 id=\"energy\">Energy per sample</h2>",
        "1g.10gb emulated (MPS, 13% of SMs)",
        "Emulated slices alone (mps:) share the L2 cache",
        "(whole GPU&#39;s energy)",
        "latency distribution at each target&apos;s largest batch",
        "gract during the measured phase, each target&apos;s largest batch",
        "gpu_power_w during the measured phase",
    ] {
        assert!(
            page.contains(needle) || page.contains(&needle.replace("&#39;", "'")),
            "missing {needle}"
        );
    }
    // No script, nothing fetched (the SVG namespace is a name, not a fetch).
    assert!(!page.contains("<script"));
    for fetch in ["src=\"http", "href=\"http", "url(http", "@import"] {
        assert!(!page.contains(fetch), "{fetch}");
    }
    // Every chart has a table right under it.
    let charts = page.matches("<figure>").count();
    // Per workload (ResNet-50 inference, training): throughput, latency, memory, GR activity, the
    // latency distribution and five time series; and the scaling chart.
    assert_eq!(charts, 2 * 10 + 1, "{charts} charts");
    assert_eq!(
        page.matches("</figure>\n<table>").count(),
        charts,
        "a table under every chart"
    );
    // Legends beside the charts, not over their data: every target's colour named in a caption.
    assert_eq!(page.matches("<figcaption>").count(), charts);
    assert!(
        page.contains("<span style=\"color:#d62728\">&#9632;</span>&nbsp;full"),
        "the full GPU keeps the second colour"
    );
    // One colour per target in every chart: the full GPU (the baseline, most SMs) is the first colour.
    let full_row = page.find("<td>full</td>").unwrap();
    assert!(full_row > 0);
    // The scaling table: 1g (16 of 132 SMs) at its measured relative throughput.
    assert!(page.contains("<td>0.121</td>"), "1g's share of the SMs");
    // Another batch's distributions on request.
    let at32 = report(&[&fixture()], &dir.path().join("c.html"), &["--detail-batch", "32"]);
    assert!(
        at32.contains("resnet50 infer bf16: latency distribution at batch 32"),
        "the batch picked"
    );
    // A batch no run has is refused, naming the batches there are, and no page is written.
    let missing = dir.path().join("d.html");
    let o = run(&[
        "report",
        fixture().to_str().unwrap(),
        "--out",
        missing.to_str().unwrap(),
        "--detail-batch",
        "7",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("--detail-batch 7: no run has batch 7; the batches of these runs: 32, 128"),
        "{}",
        text(&o)
    );
    assert!(!missing.exists());
}

#[test]
fn markdown_keeps_the_charts_beside_it_and_runs_name_the_report_command() {
    let dir = tempfile::tempdir().unwrap();
    // A CPU run made here: no SMs, so no scaling section; the sections it has still come out.
    let out = dir.path().join("cpu");
    let o = run(&[
        "run",
        "--model",
        "resnet_tiny",
        "--device",
        "cpu",
        "--batch",
        "1,2",
        "--iters",
        "12",
        "--warmup",
        "1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains(&format!("report: migprof report {}", out.display())),
        "{}",
        text(&o)
    );
    let md = report(
        &[&out, &fixture()],
        &dir.path().join("r/report.md"),
        &["--format", "md"],
    );
    assert!(md.starts_with("# migprof report\n\n## Contents\n"), "{}", &md[..80]);
    assert!(md.contains("## resnet_tiny") && md.contains("## resnet50"));
    let charts: Vec<&str> = md.lines().filter(|l| l.starts_with("![")).collect();
    assert!(!charts.is_empty());
    for line in charts {
        let file = line.split_once("](").unwrap().1.trim_end_matches(')');
        let mut svg = String::new();
        std::fs::File::open(dir.path().join("r").join(file))
            .unwrap()
            .read_to_string(&mut svg)
            .unwrap();
        assert!(svg.contains("<svg"), "{file}");
    }
    // A folder that is not one is refused, naming it.
    let bad = run(&["report", dir.path().join("nowhere").to_str().unwrap()]);
    assert!(
        !bad.status.success() && text(&bad).contains("no such results folder"),
        "{}",
        text(&bad)
    );
}

#[test]
#[ignore = "needs Chromium (Debian's chromium; .ci/run installs it)"]
fn the_report_renders_in_chromium_with_every_chart_drawn_and_no_console_error() {
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("Chromium is not installed: apt-get install chromium");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-in-chromium");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let page = report(&[&fixture()], &dir.join("report.html"), &[]);
    let charts = page.matches("<svg").count();
    // A page beside it measures the report's charts once it has loaded (the report has no script).
    std::fs::write(
        dir.join("measure.html"),
        r#"<!DOCTYPE html><html><body><iframe id="f" src="report.html" style="width:1200px;height:900px"></iframe><pre id="out">pending</pre>
<script>
document.getElementById('f').addEventListener('load', () => {
  const d = document.getElementById('f').contentDocument;
  const sizes = [...d.querySelectorAll('svg')].map(s => { const r = s.getBoundingClientRect(); return Math.round(r.width) + 'x' + Math.round(r.height); });
  document.getElementById('out').textContent = 'svgs ' + sizes.length + ' ' + sizes.join(' ');
});
</script></body></html>"#,
    )
    .unwrap();
    let common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--allow-file-access-from-files",
        "--virtual-time-budget=10000",
    ];
    let url = |f: &str| format!("file://{}", dir.join(f).display());
    let measured = Command::new(chromium)
        .args(common)
        .args(["--enable-logging=stderr", "--v=0", "--dump-dom"])
        .arg(url("measure.html"))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&measured.stdout);
    let line = dom
        .lines()
        .find_map(|l| {
            l.split_once("svgs ")
                .map(|(_, rest)| rest.trim_end_matches("</pre>").to_string())
        })
        .unwrap_or_else(|| panic!("no measurement in:\n{dom}"));
    let sizes: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(sizes[0].parse::<usize>().unwrap(), charts, "{line}");
    for s in &sizes[1..] {
        let (w, h) = s.split_once('x').unwrap();
        assert!(
            w.parse::<f64>().unwrap() > 100.0 && h.parse::<f64>().unwrap() > 100.0,
            "a chart drawn at {s}"
        );
    }
    // The report itself loaded on its own: no console message of any kind (it has no script, so any
    // is an error: a resource it failed to load, a parse problem).
    let shown = Command::new(chromium)
        .args(common)
        .args(["--enable-logging=stderr", "--v=0", "--window-size=1200,3000"])
        .arg(format!("--screenshot={}", dir.join("report.png").display()))
        .arg(url("report.html"))
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&shown.stderr);
    let console: Vec<&str> = log.lines().filter(|l| l.contains("CONSOLE")).collect();
    assert!(console.is_empty(), "console messages: {console:?}");
    let png = std::fs::metadata(dir.join("report.png")).expect("a screenshot");
    assert!(png.len() > 10_000, "a screenshot of {} bytes", png.len());
    eprintln!("screenshot kept at {}", dir.join("report.png").display());
}
