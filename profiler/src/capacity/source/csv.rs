//! Capacities a user measured elsewhere, as a CSV of `model,profile,qps` (and, where the plan holds
//! several objectives, the objective each was measured at).

use std::path::Path;

use anyhow::{bail, Context, Result};

use super::{lengths, Capacity, Gathered, ServingSlo, Source};
use crate::mig::profile::ProfileTable;

/// Reads a CSV with a header naming `model`, `profile` and `qps` (in any order), capacities measured
/// anywhere: a model may be any name (a user's own server or model), a profile must be one of
/// `table`'s (or `full`). Optional columns say what a row's capacity holds for: `slo_p99_ms` (a model
/// served one forward pass per request), `slo_ttft_p99_ms` with `slo_tpot_p99_ms` (a language model),
/// and `prompt_len` and `output_len` (its requests' lengths, as `load` takes them). A row whose
/// objectives are not `objectives`' is left out, said in a note; a row without them is taken as
/// measured within them.
pub fn from_csv(path: &Path, table: &ProfileTable, objectives: &crate::capacity::Objectives) -> Result<Gathered> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'));
    let Some((_, header)) = lines.next() else {
        bail!("{}: empty; expected a header model,profile,qps", path.display())
    };
    let names = csv_fields(header).with_context(|| format!("{}: the header leaves a quote open", path.display()))?;
    if let Some(twice) = names
        .iter()
        .enumerate()
        .find(|(i, n)| names[..*i].contains(n))
        .map(|(_, n)| n)
    {
        bail!("{}: the header names `{twice}` twice", path.display())
    }
    let at = |name: &str| names.iter().position(|n| n == name);
    let (Some(m), Some(p), Some(q)) = (at("model"), at("profile"), at("qps")) else {
        bail!(
            "{}: the header `{header}` must name the columns model, profile and qps",
            path.display()
        )
    };
    let known = [
        "model",
        "profile",
        "qps",
        "slo_p99_ms",
        "slo_ttft_p99_ms",
        "slo_tpot_p99_ms",
        "prompt_len",
        "output_len",
    ];
    if let Some(other) = names.iter().find(|n| !known.contains(&n.as_str())) {
        bail!(
            "{}: the header names `{other}`, not a column of a capacity CSV; its columns: {}",
            path.display(),
            known.join(", ")
        )
    }
    let (slo, ttft, tpot) = (at("slo_p99_ms"), at("slo_ttft_p99_ms"), at("slo_tpot_p99_ms"));
    let (prompt, output) = (at("prompt_len"), at("output_len"));
    let mut capacities = Vec::new();
    let mut elsewhere = std::collections::BTreeSet::new();
    for (i, line) in lines {
        let line_no = i + 1;
        let fields =
            csv_fields(line).with_context(|| format!("{} line {line_no}: a quote is left open", path.display()))?;
        if fields.len() != names.len() {
            bail!(
                "{} line {line_no}: {} fields for the header's {} (a field holding a comma, as a lognormal's length does, is quoted: \"lognormal:512,0.5\")",
                path.display(),
                fields.len(),
                names.len()
            );
        }
        let get = |k: usize| fields.get(k).map(String::as_str).unwrap_or("");
        let number = |col: Option<usize>, what: &str| -> Result<Option<f64>> {
            let Some(v) = col.map(get).filter(|v| !v.is_empty()) else {
                return Ok(None);
            };
            let n = v
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite() && *n >= 0.0)
                .with_context(|| {
                    format!(
                        "{} line {line_no}: {what} `{v}` is not a non-negative number",
                        path.display()
                    )
                })?;
            Ok(Some(n))
        };
        let qps = number(Some(q), "qps")?
            .with_context(|| format!("{} line {line_no}: no qps (requests/s)", path.display()))?;
        if get(m).is_empty() || get(p).is_empty() {
            bail!("{} line {line_no}: model and profile must not be empty", path.display());
        }
        if get(p) != crate::capacity::solve::FULL && table.profile(get(p)).is_err() {
            let names: Vec<&str> = table.profiles.iter().map(|p| p.name.as_str()).collect();
            bail!(
                "{} line {line_no}: `{}` is not a MIG profile of the {}; its profiles: {}, and full (a whole GPU)",
                path.display(),
                get(p),
                table.product,
                names.join(", ")
            );
        }
        // Lengths as `load` takes them (a lognormal's is quoted: "lognormal:512,0.5").
        let length = |col: Option<usize>, what: &str| -> Result<Option<String>> {
            let Some(v) = col.map(get).filter(|v| !v.is_empty()) else {
                return Ok(None);
            };
            let dist: crate::load::lengths::LengthDist = v
                .parse()
                .map_err(|e: String| anyhow::anyhow!("{} line {line_no}: {what}: {e}", path.display()))?;
            Ok(Some(dist.to_string()))
        };
        let (pl, ol) = (length(prompt, "prompt_len")?, length(output, "output_len")?);
        let (pl, ol) = (pl.as_deref(), ol.as_deref());
        // What the row's capacity holds for, checked against the plan's objectives.
        let row_slo = number(slo, "slo_p99_ms")?;
        let row_serving = match (number(ttft, "slo_ttft_p99_ms")?, number(tpot, "slo_tpot_p99_ms")?) {
            (Some(t), Some(p)) => Some(ServingSlo {
                ttft_p99_ms: t,
                tpot_p99_ms: p,
            }),
            (None, None) => None,
            _ => bail!(
                "{} line {line_no}: a language model's capacity holds for both slo_ttft_p99_ms and slo_tpot_p99_ms; give both",
                path.display()
            ),
        };
        if row_slo.is_some() && row_serving.is_some() {
            bail!(
                "{} line {line_no}: a capacity is within slo_p99_ms (one forward pass per request) or within slo_ttft_p99_ms and slo_tpot_p99_ms (a language model), not both",
                path.display()
            );
        }
        let same = |a: f64, b: Option<f64>| b.is_some_and(|b| (a - b).abs() <= 1e-9);
        if let Some(v) = row_slo.filter(|v| !same(*v, objectives.p99_ms)) {
            elsewhere.insert(format!("p99 {v} ms"));
            continue;
        }
        if let Some(r) = row_serving.filter(|r| {
            !same(r.ttft_p99_ms, objectives.serving.map(|s| s.ttft_p99_ms))
                || !same(r.tpot_p99_ms, objectives.serving.map(|s| s.tpot_p99_ms))
        }) {
            elsewhere.insert(format!(
                "TTFT p99 {} ms and TPOT p99 {} ms",
                r.ttft_p99_ms, r.tpot_p99_ms
            ));
            continue;
        }
        if capacities
            .iter()
            .any(|c: &Capacity| c.model == get(m) && c.profile == get(p))
        {
            bail!(
                "{} line {line_no}: a second row for {} on {} within the plan's objectives: give each model and profile once",
                path.display(),
                get(m),
                get(p)
            );
        }
        capacities.push(Capacity {
            model: get(m).into(),
            profile: get(p).into(),
            qps,
            source: Source::Csv,
            gpu: None,
            lengths: (pl.is_some() || ol.is_some()).then(|| lengths(pl, ol)),
        });
    }
    let mut notes = Vec::new();
    if !elsewhere.is_empty() {
        notes.push(format!(
            "{}: rows within other objectives than the plan's ({}) were left out: {}",
            path.display(),
            objectives.describe(),
            elsewhere.into_iter().collect::<Vec<_>>().join("; ")
        ));
    }
    Ok(Gathered {
        capacities,
        notes,
        ..Gathered::default()
    })
}

/// A CSV line's fields, trimmed: split at commas outside double quotes, a field's quotes taken off
/// ("" inside quotes is one quote); none where a quote is left open.
fn csv_fields(line: &str) -> Option<Vec<String>> {
    let mut fields = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                fields.last_mut().expect("one field at least").push('"');
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(String::new()),
            c => fields.last_mut().expect("one field at least").push(c),
        }
    }
    (!quoted).then(|| fields.iter().map(|f| f.trim().to_string()).collect())
}
