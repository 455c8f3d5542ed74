//! How `compare` prints a comparison: a table of text or Markdown, or JSON.

use std::fmt::Write as _;

use anyhow::Result;

use super::{Compared, Comparison, EmulatedRange, Side};

/// How `compare` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Md,
    Json,
}

impl Comparison {
    pub fn render(&self, format: Format) -> Result<String> {
        if format == Format::Json {
            return Ok(serde_json::to_string_pretty(self)? + "\n");
        }
        let header = [
            "cell",
            "baseline/s",
            "target/s",
            "ratio (95%)",
            "beyond noise",
            "p50 ms b→t",
            "p99 ms b→t",
            "runs b/t",
            "verdicts b/t",
        ];
        let same = self.same_fields();
        let lines = self.lines(&same);
        let mut out = format!(
            "{} (target) against {} (baseline): {} matched cell(s)",
            self.target,
            self.baseline,
            self.rows.len()
        );
        if self.baseline_only + self.target_only > 0 {
            write!(
                out,
                "; unmatched: {} baseline only, {} target only",
                self.baseline_only, self.target_only
            )?;
        }
        out.push('\n');
        if !same.is_empty() {
            let each: Vec<String> = same.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out += &format!("every cell: {}\n", each.join(", "));
        }
        if format == Format::Md {
            out += &format!("\n| {} |\n|{}\n", header.join(" | "), "---|".repeat(header.len()));
            for l in &lines {
                out += &format!("| {} |\n", l.join(" | "));
            }
            out += &self.ranges();
            return Ok(out);
        }
        out += &aligned(&header, &lines);
        out += &self.ranges();
        Ok(out)
    }

    /// Each compared cell's line: its cell (less what every cell shares), both throughputs, the
    /// ratio with its interval, the latencies, the runs pooled and their verdicts.
    fn lines(&self, same: &[(String, String)]) -> Vec<[String; 9]> {
        let label = |r: &Compared| self.label(r, same);
        let verdicts = |s: &Side| {
            if s.caveats.is_empty() {
                "ok".to_string()
            } else {
                s.caveats.join("+")
            }
        };
        self.rows
            .iter()
            .map(|r| {
                let ci = match (r.ratio_ci_low, r.ratio_ci_high) {
                    (Some(l), Some(h)) => format!("{:.3} ({l:.3}–{h:.3})", r.ratio),
                    _ => format!("{:.3} (no interval)", r.ratio),
                };
                [
                    label(r),
                    format!("{:.1}", r.baseline.throughput),
                    format!("{:.1}", r.target.throughput),
                    ci,
                    r.beyond_noise
                        .map_or("?".into(), |b| if b { "yes".into() } else { "no".into() }),
                    match (r.baseline.p50_ms, r.target.p50_ms) {
                        (Some(b), Some(t)) => format!("{b:.3}→{t:.3}"),
                        _ => "-".to_string(),
                    },
                    format!("{:.3}→{:.3}", r.baseline.p99_ms, r.target.p99_ms),
                    format!("{}/{}", r.baseline.runs, r.target.runs),
                    format!("{}/{}", verdicts(&r.baseline), verdicts(&r.target)),
                ]
            })
            .collect()
    }

    /// The key fields equal in every matched cell: said once above the table; rows show the rest.
    fn same_fields(&self) -> Vec<(String, String)> {
        match self.rows.first() {
            Some(first) => first
                .ordered
                .iter()
                .filter(|kv| !kv.1.is_empty() && self.rows.iter().all(|r| r.ordered.contains(kv)))
                .cloned()
                .collect(),
            None => Vec::new(),
        }
    }

    /// A cell as a row names it: the key fields that are not the same in every cell.
    fn label(&self, r: &Compared, same: &[(String, String)]) -> String {
        let varying: Vec<&str> = r
            .ordered
            .iter()
            .filter(|kv| !kv.1.is_empty() && !same.contains(kv))
            .map(|(_, v)| v.as_str())
            .collect();
        if varying.is_empty() {
            "(the one cell)".to_string()
        } else {
            varying.join(" ")
        }
    }

    /// The emulated targets as ranges, one line per cell, and which bound to plan with; empty when no
    /// target is emulated.
    fn ranges(&self) -> String {
        let with: Vec<(&Compared, &EmulatedRange)> = self
            .rows
            .iter()
            .filter_map(|r| r.range.as_ref().map(|g| (r, g)))
            .collect();
        if with.is_empty() {
            return String::new();
        }
        let share = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.3}"));
        let mut out = "\nemulated slices as ranges (throughput relative to the baseline):\n".to_string();
        let same = self.same_fields();
        for (r, g) in &with {
            out += &format!(
                "  {} {}: alone {} .. memory-partitioned {}; share of SMs {}, of memory {}{}\n",
                g.profile,
                self.label(r, &same),
                share(g.alone),
                share(g.partitioned),
                share(g.sm_share),
                share(g.memory_share),
                g.share_missed
                    .as_ref()
                    .map(|(ratio, outcome)| format!(
                        " (its memory-partitioned client read {ratio:.2} times its bandwidth share: {outcome})"
                    ))
                    .unwrap_or_default()
            );
        }
        out += &format!("{}\n", crate::mps::PLAN_WITH);
        if with.iter().any(|(_, g)| g.partitioned.is_none()) {
            out += "(a cell without its memory-partitioned twin has no lower bound: run it on mps-mem:<profile> too)\n";
        }
        out
    }
}

/// A plain-text table: each column as wide as its widest cell, two spaces between.
fn aligned(header: &[&str; 9], lines: &[[String; 9]]) -> String {
    let mut out = String::new();
    let mut widths = header.map(|h| h.chars().count());
    for l in lines {
        for (w, c) in widths.iter_mut().zip(l) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    out += &line(&header.map(String::from));
    out.push('\n');
    for l in lines {
        out += &line(l);
        out.push('\n');
    }
    out
}
