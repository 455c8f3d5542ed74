//! The table printed at the end of `migprof run`.

use crate::run::stats::ns_to_ms;
use crate::run::Run;

/// Renders one line per run, columns aligned: what a user reads first. Generations have a table of
/// their own, after the others: their time to first token, decode step and tokens per second.
pub fn table(runs: &[Run]) -> String {
    let (generations, steps): (Vec<&Run>, Vec<&Run>) = runs.iter().partition(|r| r.generation.is_some());
    let mut out = Vec::new();
    if !steps.is_empty() {
        out.push(steps_table(&steps));
    }
    if !generations.is_empty() {
        out.push(generations_table(&generations));
    }
    out.join("\n")
}

/// The throughput with its interval where there is one.
fn with_interval(r: &Run) -> String {
    match &r.uncertainty.throughput {
        Ok(i) => format!(
            "{:.1} ± {:.1}%",
            r.throughput(),
            100.0 * i.relative_half_width(r.throughput())
        ),
        Err(_) => format!("{:.1}", r.throughput()),
    }
}

fn generations_table(runs: &[&Run]) -> String {
    let header = [
        "model",
        "dtype",
        "batch",
        "prompt",
        "output",
        "TTFT p50 ms",
        "step p50 ms",
        "step p99 ms",
        "decode tokens/s",
        "verdict",
    ];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let g = r.generation.as_ref().expect("partitioned on it");
            vec![
                r.subject.name().to_string(),
                r.precision().unwrap_or("-").to_string(),
                r.batch.to_string(),
                g.lengths.prompt.to_string(),
                g.lengths.output.to_string(),
                format!("{:.3}", ns_to_ms(g.prefill.p50_ns)),
                format!("{:.3}", ns_to_ms(r.stats.p50_ns)),
                format!("{:.3}", ns_to_ms(r.stats.p99_ns)),
                with_interval(r),
                r.assessment.verdict.as_str().to_string(),
            ]
        })
        .collect();
    let numeric = [false, false, true, true, true, true, true, true, true, false];
    render(&header, &numeric, &rows)
}

fn steps_table(runs: &[&Run]) -> String {
    let header = [
        "model",
        "mode",
        "dtype",
        "batch",
        "p50 ms",
        "p99 ms",
        "samples/s",
        "verdict",
    ];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.subject.name().to_string(),
                r.mode.as_str().to_string(),
                r.precision().unwrap_or("-").to_string(),
                r.batch.to_string(),
                format!("{:.3}", ns_to_ms(r.stats.p50_ns)),
                format!("{:.3}", ns_to_ms(r.stats.p99_ns)),
                with_interval(r),
                r.assessment.verdict.as_str().to_string(),
            ]
        })
        .collect();
    // Text columns align left, numbers right.
    let numeric = [false, false, false, true, true, true, true, false];
    render(&header, &numeric, &rows)
}

/// Columns aligned: text to the left, numbers (`numeric`) to the right.
fn render(header: &[&str], numeric: &[bool], rows: &[Vec<String>]) -> String {
    // In characters, as `format!` pads: "±" is one character and two bytes.
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| -> String {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if numeric[i] {
                    format!("{c:>w$}", w = widths[i])
                } else {
                    format!("{c:<w$}", w = widths[i])
                }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = vec![line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>())];
    out.push(widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
    out.extend(rows.iter().map(|r| line(r)));
    out.join("\n") + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::record::tests::fake_run;
    use std::time::Duration;

    #[test]
    fn one_aligned_line_per_run() {
        let t = table(&[fake_run(8, 30, Duration::ZERO), fake_run(128, 6, Duration::ZERO)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[0].starts_with("model") && lines[0].ends_with("verdict"));
        // 30 steps: the throughput with its interval; 6 steps: none to give.
        assert!(
            lines[2].contains("resnet_tiny") && lines[2].contains("4000.0 ± ") && lines[2].ends_with("ok"),
            "{t}"
        );
        assert!(
            lines[3].contains("64000.0") && !lines[3].contains('±') && lines[3].ends_with("too_few_iterations"),
            "{t}"
        );
        // The throughput column is right-aligned: both cells end at the same offset.
        let column = |line: &str, byte: usize| line[..byte].chars().count();
        assert_eq!(
            column(lines[2], lines[2].find('%').unwrap() + 1),
            column(lines[3], lines[3].find("64000.0").unwrap() + 7),
            "{t}"
        );
    }
}
