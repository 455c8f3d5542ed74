//! Energy per sample, where it was measured.

use crate::report::data::Row;
use crate::report::page::{table, Block, Section};

pub(super) fn energy(rows: &[Row]) -> Vec<Section> {
    let measured: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| r.is_alone())
        .filter_map(|r| {
            r.n("j_per_sample").map(|j| {
                let whole = if r.s("device_kind") == "cuda" {
                    ""
                } else {
                    " (whole GPU's energy)"
                };
                vec![
                    r.s("target").into(),
                    r.s("model").into(),
                    r.s("mode").into(),
                    r.s("dtype").into(),
                    r.s("batch").into(),
                    format!("{:.4}{whole}", j),
                ]
            })
        })
        .collect();
    if measured.is_empty() {
        return Vec::new();
    }
    let blocks = vec![
        Block::Text("Energy per sample from the GPU's energy counter over the measured phase. NVML has no energy per MIG slice or MPS client: on a slice the figure is the whole GPU's, neighbours included.".into()),
        table(&["target", "model", "mode", "dtype", "batch", "J/sample"], measured),
    ];
    vec![Section {
        id: "energy".into(),
        title: "Energy per sample".into(),
        level: 2,
        blocks,
    }]
}
