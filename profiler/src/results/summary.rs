//! The table printed at the end of `migprof run`.

use crate::run::stats::ns_to_ms;
use crate::run::Run;

/// Renders one line per run, columns aligned: what a user reads first.
pub fn table(runs: &[Run]) -> String {
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
    let rows: Vec<[String; 8]> = runs
        .iter()
        .map(|r| {
            [
                r.model.name.to_string(),
                r.mode.as_str().to_string(),
                r.precision().to_string(),
                r.batch.to_string(),
                format!("{:.3}", ns_to_ms(r.stats.p50_ns)),
                format!("{:.3}", ns_to_ms(r.stats.p99_ns)),
                match &r.uncertainty.throughput {
                    Ok(i) => format!(
                        "{:.1} ± {:.1}%",
                        r.throughput(),
                        100.0 * i.relative_half_width(r.throughput())
                    ),
                    Err(_) => format!("{:.1}", r.throughput()),
                },
                r.assessment.verdict.as_str().to_string(),
            ]
        })
        .collect();
    // In characters, as `format!` pads: "±" is one character and two bytes.
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    // Text columns align left, numbers right.
    let numeric = [false, false, false, true, true, true, true, false];
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
    let mut out = vec![line(&header.map(String::from))];
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
