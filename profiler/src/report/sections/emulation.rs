//! How far an emulated slice's figures lie from what a real MIG slice would give.

use std::collections::BTreeMap;

use crate::report::data::Row;
use crate::report::page::{table, Block, Section};

/// Where a folder has real MIG slices and their emulated twins (the same profile of the same GPU,
/// the same cell): each emulated bound's error against the real slice, per profile.
pub(super) fn emulation_error(rows: &[Row]) -> Option<Section> {
    // (GPU, profile, cell) -> real, alone, partitioned: the sum of the repeats' throughputs and
    // their count.
    type Found = BTreeMap<(String, String, String), [(f64, u32); 3]>;
    let mut found: Found = BTreeMap::new();
    for r in rows.iter().filter(|r| r.is_alone()) {
        let Some(tp) = r.n("throughput") else { continue };
        let (slot, profile) = match (r.s("mig_profile"), r.s("emulated_profile"), r.s("memory_emulation")) {
            (p, _, _) if !p.is_empty() => (0, p),
            (_, p, "partitioned") if !p.is_empty() => (2, p),
            (_, p, _) if !p.is_empty() && r.s("emulation") == "mps" => (1, p),
            _ => continue,
        };
        let mut cell = format!("{} {} {} {}", r.s("model"), r.s("mode"), r.s("dtype"), r.s("batch"));
        for extra in [r.lengths(), r.s("kernel_options").to_string()]
            .into_iter()
            .filter(|s| !s.is_empty())
        {
            cell = format!("{cell} {extra}");
        }
        let sum = &mut found
            .entry((r.s("gpu_name").to_string(), profile.to_string(), cell))
            .or_default()[slot];
        *sum = (sum.0 + tp, sum.1 + 1);
    }
    let mean = |(sum, n): (f64, u32)| (n > 0).then(|| sum / f64::from(n));
    let error = |emulated: Option<f64>, real: f64| {
        emulated.map_or("-".to_string(), |e| format!("{:+.1}%", (e / real - 1.0) * 100.0))
    };
    let lines: Vec<Vec<String>> = found
        .into_iter()
        .filter_map(|((gpu, profile, cell), [real, alone, partitioned])| {
            let (real, alone, partitioned) = (mean(real)?, mean(alone), mean(partitioned));
            (alone.is_some() || partitioned.is_some()).then(|| {
                vec![
                    gpu,
                    profile,
                    cell,
                    format!("{real:.1}"),
                    error(alone, real),
                    error(partitioned, real),
                ]
            })
        })
        .collect();
    if lines.is_empty() {
        return None;
    }
    Some(Section {
        id: "emulation-error".into(),
        title: "Emulated slices against real ones".into(),
        level: 2,
        blocks: vec![
            Block::Text("The same cells on real MIG slices and on their emulated twins of the same GPU: each emulated bound's throughput against the real slice's. A right emulation has the real slice between its bounds: alone above it (positive), memory-partitioned below (negative).".into()),
            table(
                &["GPU", "profile", "model mode dtype batch", "real /s", "alone (mps:)", "memory-partitioned (mps-mem:)"],
                lines,
            ),
        ],
    })
}
