//! The sequences each target held, where a `"max"` search ran for a language model.

use std::collections::BTreeMap;

use crate::report::data::Row;
use crate::report::page::{fmt, table, Block, Section};

/// Where a `"max"` search ran for a language model: the most sequences each target held at the
/// generation's lengths (its weights, and every sequence's KV cache and workspace, within the
/// target's memory), and what they decoded. The search's tries are rows of status `probe` (they
/// fit) and `oom` (they did not, or the memory estimate refused them); the run at the batch it found
/// is the `ok` row at the largest try that fit. With no try refused, the search stopped at its
/// limit, and the target holds at least that many.
pub(super) fn sequences_held(rows: &[Row]) -> Option<Section> {
    type Key = (String, String, String, String, String);
    let key = |r: &Row| -> Key {
        (
            r.s("target").into(),
            r.s("model").into(),
            r.s("dtype").into(),
            r.lengths(),
            r.s("kv_layout").into(),
        )
    };
    let mut tries: BTreeMap<Key, (i64, Option<i64>)> = BTreeMap::new();
    for r in rows.iter().filter(|r| r.s("mode") == "generate") {
        let batch = r.n("batch").unwrap_or(0.0) as i64;
        let (fit, refused) = match r.s("status") {
            "probe" => (batch, None),
            "oom" => (0, Some(batch)),
            _ => continue,
        };
        let t = tries.entry(key(r)).or_insert((0, None));
        t.0 = t.0.max(fit);
        t.1 = match (t.1, refused) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    let held: Vec<Vec<String>> = tries
        .iter()
        .filter(|(_, (fit, _))| *fit > 0)
        .map(|(k, &(fit, refused))| {
            // The latest such run: rows are in the order they were written.
            let run = rows
                .iter()
                .rev()
                .find(|r| r.s("status") == "ok" && key(r) == *k && r.n("batch") == Some(fit as f64));
            vec![
                k.0.clone(),
                k.1.clone(),
                k.2.clone(),
                k.3.clone(),
                k.4.clone(),
                match refused {
                    Some(b) => format!("{fit} ({b} did not fit)"),
                    None => format!("at least {fit} (the search's limit)"),
                },
                fmt(run.and_then(|r| r.n("throughput")), 1),
                // To the KiB: a small model's sequence holds a few.
                fmt(
                    run.and_then(|r| r.n("kv_cache_bytes_per_seq"))
                        .map(|b| b / (1024.0 * 1024.0)),
                    3,
                ),
            ]
        })
        .collect();
    if held.is_empty() {
        return None;
    }
    Some(Section {
        id: "sequences-held".into(),
        title: "Sequences each target holds".into(),
        level: 2,
        blocks: vec![
            Block::Text("The most sequences of a language model each target held at once, as a \"max\" batch search found them: the weights, and every sequence's KV cache and workspace at the generation's lengths, within the target's memory. Decode tokens/s are the run's at that batch.".into()),
            table(
                &["target", "model", "dtype", "lengths", "KV layout", "sequences", "decode tokens/s", "KV cache a sequence (MiB)"],
                held,
            ),
        ],
    })
}
