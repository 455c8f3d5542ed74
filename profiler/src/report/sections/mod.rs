//! The report's sections, from the rows: what ran, one section per model (its modes and dtypes:
//! throughput, latency, memory and GR activity against batch, one series per target), the scaling of
//! throughput with the share of SMs, each target against the baseline, energy per sample.
//!
//! One file a section; `common.rs` what they share.

mod baseline;
mod common;
mod emulation;
mod energy;
mod held;
mod per_model;
mod scaling;
mod what_ran;

use anyhow::Result;

use super::data::{self, Row};
use super::page::Section;
use baseline::against_baseline;
pub use common::detailed_runs;
use emulation::emulation_error;
use energy::energy;
use held::sequences_held;
use per_model::per_model;
use scaling::scaling;
use what_ran::what_ran;

/// The sections of the runs: what ran (`everyone` adds the targets that only served load), one
/// section per model, the scaling with the share of SMs and each target against the baseline, energy.
pub fn of_runs(
    rows: &[Row],
    everyone: &[Row],
    targets: &[String],
    colour: &dyn Fn(&str) -> usize,
    detail: &data::Detail,
    sources: &[String],
    detail_batch: Option<usize>,
) -> Result<Vec<Section>> {
    let baseline = data::baseline(rows);
    let mut out = vec![what_ran(rows, everyone, sources, targets, baseline.as_deref())];
    out.extend(per_model(rows, detail, colour, detail_batch)?);
    if let Some(b) = &baseline {
        out.extend(scaling(rows, b, colour)?);
        out.extend(against_baseline(rows, b)?);
    }
    out.extend(emulation_error(rows));
    out.extend(sequences_held(rows));
    out.extend(energy(rows));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    use crate::report::page::Block;

    use super::common::*;
    use super::per_model::*;

    fn run(held: Option<f64>) -> Row {
        let mut num: BTreeMap<&'static str, f64> = [("fb_used_max_mib", 4299.0)].into_iter().collect();
        if let Some(mib) = held {
            num.insert("pool_held_mib_start", mib);
        }
        Row {
            text: BTreeMap::new(),
            num,
        }
    }

    /// A generate row of llama_tiny on `target` at `batch` with `status`.
    fn generation(target: &str, batch: f64, status: &str) -> Row {
        let text = [
            ("status", status),
            ("target", target),
            ("model", "llama_tiny"),
            ("mode", "generate"),
            ("dtype", "bf16"),
            ("prompt_len", "512"),
            ("output_len", "128"),
            ("kv_layout", "contiguous"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
        let num = [
            ("batch", batch),
            ("throughput", 100.0 * batch),
            ("kv_cache_bytes_per_seq", 20.0 * 1024.0 * 1024.0),
        ]
        .into_iter()
        .collect();
        Row { text, num }
    }

    #[test]
    fn the_sequences_a_target_holds_come_from_its_search_s_tries() {
        // 1g: 1, 2, 4 fit, 8 did not, 6 fit, 7 did not: it holds 6. full: every try up to the limit
        // of 16 fit. A fixed batch of 32 on 3g is no search.
        let mut rows: Vec<Row> = [1.0, 2.0, 4.0, 6.0]
            .into_iter()
            .map(|b| generation("1g", b, "probe"))
            .collect();
        rows.extend([generation("1g", 8.0, "oom"), generation("1g", 7.0, "oom")]);
        rows.push(generation("1g", 6.0, "ok"));
        rows.extend([1.0, 2.0, 4.0, 8.0, 16.0].map(|b| generation("full", b, "probe")));
        rows.push(generation("full", 16.0, "ok"));
        rows.push(generation("3g", 32.0, "ok"));
        let s = sequences_held(&rows).expect("two searches");
        let Block::Table { rows: table, .. } = &s.blocks[1] else {
            panic!("a table")
        };
        let by_target: BTreeMap<&str, &Vec<String>> = table.iter().map(|r| (r[0].as_str(), r)).collect();
        assert_eq!(by_target.len(), 2, "{table:?}");
        assert_eq!(by_target["1g"][5], "6 (7 did not fit)");
        assert_eq!(by_target["1g"][6], "600.0");
        assert_eq!(by_target["1g"][7], "20.000");
        assert_eq!(by_target["full"][5], "at least 16 (the search's limit)");
        assert_eq!(by_target["1g"][3], "prompt 512 output 128");
        assert!(sequences_held(&[generation("3g", 32.0, "ok")]).is_none());
    }

    #[test]
    fn the_memory_chart_names_the_points_that_started_with_memory_held_from_earlier_runs() {
        let (cpu, fresh, after_swin) = (run(None), run(Some(32.0)), run(Some(576.0)));
        let mut latest: BTreeMap<(String, i64), &Row> = BTreeMap::new();
        latest.insert(("cpu".into(), 1), &cpu);
        latest.insert(("H100".into(), 8), &fresh);
        assert_eq!(
            held_memory_note(&latest),
            None,
            "no pool, or only the pool's own granularity"
        );
        latest.insert(("H100".into(), 32), &after_swin);
        let note = held_memory_note(&latest).expect("576 MiB held");
        assert!(note.contains("H100 at batch 32 (576 MiB)"), "{note}");
        assert!(!note.contains("batch 8") && !note.contains("cpu"), "{note}");
    }

    /// An alone run of resnet50 bf16 training at batch 32 on `target`, a `kind` of device.
    fn training(target: &str, kind: &str, masters: &str, run_id: &str) -> Row {
        let text = [
            ("run_id", run_id),
            ("status", "ok"),
            ("target", target),
            ("device_kind", kind),
            ("model", "resnet50"),
            ("mode", "train"),
            ("dtype", "bf16"),
            ("master_weights", masters),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_string()))
        .collect();
        let num = [
            ("batch", 32.0),
            ("throughput", 100.0),
            ("p50_ms", 300.0),
            ("fb_used_max_mib", 9000.0),
            ("gract_mean", 5.0),
        ]
        .into_iter()
        .collect();
        Row { text, num }
    }

    fn legends(sections: &[Section]) -> Vec<String> {
        sections
            .iter()
            .flat_map(|s| &s.blocks)
            .filter_map(|b| match b {
                Block::Chart { legend, .. } => Some(legend.iter().map(|(n, _)| n.clone())),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn an_emulated_slice_s_whole_gpu_readings_say_so_and_masters_or_none_are_two_workloads() -> Result<()> {
        let rows = vec![
            training("full", "cuda", "f32", "a"),
            training("1g", "mps", "f32", "b"),
            training("3g", "mig", "f32", "c"),
            training("full", "cuda", "none", "d"),
        ];
        let sections = per_model(&rows, &data::Detail::default(), &|_| 0, None)?;
        let titles: Vec<&str> = sections.iter().map(|s| s.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "resnet50",
                "resnet50, train, bf16",
                "resnet50, train, bf16 without master weights"
            ]
        );
        let legends = legends(&sections[1..2]);
        // GR activity and memory: the emulated slice's are the whole GPU's; a real slice's its own.
        assert_eq!(
            legends.iter().filter(|n| *n == "1g (whole GPU)").count(),
            2,
            "{legends:?}"
        );
        assert!(legends.iter().any(|n| n == "3g") && !legends.iter().any(|n| n == "3g (whole GPU)"));
        let notes = sections[1]
            .blocks
            .iter()
            .filter(|b| matches!(b, Block::Text(t) if t == WHOLE_GPU_NOTE))
            .count();
        assert_eq!(notes, 2);
        assert!(!legends.iter().any(|n| n == "full (whole GPU)"));
        Ok(())
    }

    #[test]
    fn power_is_the_whole_gpu_s_on_every_slice_and_gpm_on_emulated_ones() {
        let on = |kind| training("t", kind, "f32", "x");
        for reading in data::READINGS.map(|(name, _)| name) {
            assert!(!whole_gpu_reading(&on("cuda"), reading), "{reading}");
            assert!(whole_gpu_reading(&on("mps"), reading), "{reading}");
            assert_eq!(
                whole_gpu_reading(&on("mig"), reading),
                reading == "gpu_power_w",
                "{reading}"
            );
        }
    }

    #[test]
    fn an_emulated_slice_measured_both_ways_is_a_range_with_the_bound_to_plan_with() -> Result<()> {
        let slice = |target: &str, memory: &str, throughput: f64| {
            let mut r = training(target, "mps", "", target);
            r.text.insert("mode", "infer".into());
            r.text.insert("batch", "32".into());
            r.num.insert("sm_count", 16.0);
            r.num.insert("throughput", throughput);
            if !memory.is_empty() {
                r.text.insert("emulated_profile", "1g.10gb".into());
                r.text.insert("emulation", "mps".into());
                r.text.insert("memory_emulation", memory.into());
            }
            if memory == "partitioned" {
                r.num.insert("memory_share_gbps", 373.0);
                r.num.insert("gpu_bandwidth_gbps", 2984.0);
                r.num.insert("measured_bandwidth_gbps", 429.0);
                r.text.insert("calibration", "neighbour_too_weak".into());
            }
            r
        };
        let mut full = slice("full", "", 1000.0);
        full.num.insert("sm_count", 132.0);
        let rows = vec![full, slice("1g", "alone", 190.0), slice("1g-mem", "partitioned", 110.0)];
        let sections = scaling(&rows, "full", &|_| 0)?;
        let tables: Vec<&Vec<Vec<String>>> = sections[0]
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Table { head, rows } if head.contains(&"alone (upper bound)".to_string()) => Some(rows),
                _ => None,
            })
            .collect();
        assert_eq!(tables.len(), 1);
        assert_eq!(
            tables[0][0],
            [
                "1g.10gb",
                "infer bf16 32",
                "0.121",
                "0.125",
                "0.190",
                "0.110",
                "1.15 (neighbour_too_weak)"
            ]
            .map(String::from)
        );
        assert!(sections[0]
            .blocks
            .iter()
            .any(|b| matches!(b, Block::Text(t) if t == crate::mps::PLAN_WITH)));
        // One way only: no range.
        let sections = scaling(&rows[..2], "full", &|_| 0)?;
        assert!(!sections[0]
            .blocks
            .iter()
            .any(|b| matches!(b, Block::Text(t) if t == crate::mps::PLAN_WITH)));
        Ok(())
    }

    #[test]
    fn real_slices_and_their_emulated_twins_give_the_emulation_s_error_per_profile() {
        // A recorded H100 with real 1g and 3g slices, and the same cells emulated on a GPU with MIG off.
        let row = |mig: &str, emulated: &str, memory: &str, throughput: f64| {
            let mut r = training("t", if mig.is_empty() { "mps" } else { "mig" }, "", "r");
            r.text.insert("mode", "infer".into());
            r.text.insert("batch", "32".into());
            r.text.insert("gpu_name", "NVIDIA H100 80GB HBM3".into());
            r.text.insert("mig_profile", mig.into());
            r.text.insert("emulated_profile", emulated.into());
            if !emulated.is_empty() {
                r.text.insert("emulation", "mps".into());
                r.text.insert("memory_emulation", memory.into());
            }
            r.num.insert("throughput", throughput);
            r
        };
        let rows = vec![
            row("1g.10gb", "", "", 1400.0),
            row("", "1g.10gb", "alone", 2100.0),
            row("", "1g.10gb", "partitioned", 1260.0),
            row("3g.40gb", "", "", 6000.0),
            row("", "3g.40gb", "alone", 6300.0),
            // A profile emulated but never measured for real: no error to give.
            row("", "2g.20gb", "alone", 3000.0),
        ];
        let section = emulation_error(&rows).unwrap();
        let Block::Table { rows: lines, .. } = &section.blocks[1] else {
            panic!("a table")
        };
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0][1..],
            ["1g.10gb", "resnet50 infer bf16 32", "1400.0", "+50.0%", "-10.0%"].map(String::from)
        );
        assert_eq!(lines[1][4..], ["+5.0%", "-"].map(String::from));
        // Emulated slices alone (no real ones here) make no section.
        assert!(emulation_error(&rows[1..3]).is_none());
    }

    #[test]
    fn the_scaling_chart_draws_published_real_slices_of_another_gpu_beside_the_measured() -> Result<()> {
        let inference = |model: &str, target: &str, sms: f64, throughput: f64| {
            let mut r = training(target, "mps", "", target);
            r.text.insert("model", model.into());
            r.text.insert("mode", "infer".into());
            r.num.insert("sm_count", sms);
            r.num.insert("throughput", throughput);
            r
        };
        let rows = vec![
            inference("resnet50", "full", 132.0, 1000.0),
            inference("resnet50", "1g", 16.0, 190.0),
            inference("bert_base", "full", 132.0, 1000.0),
            inference("bert_base", "1g", 16.0, 185.0),
        ];
        let sections = scaling(&rows, "full", &|_| 0)?;
        let legends = legends(&sections);
        let published: Vec<&String> = legends.iter().filter(|n| n.starts_with("published")).collect();
        // ResNet-50's two published points; MLPerf's BERT is BERT-Large, not the BERT-base measured.
        assert_eq!(
            published,
            [
                "published, another GPU: NVIDIA A100-SXM4-80GB 1g.10gb against the whole GPU",
                "published, another GPU: NVIDIA A100-SXM4-80GB 1g.10gb against 7g.80gb, batch 32"
            ],
            "{legends:?}"
        );
        let sources: Vec<&String> = sections[0]
            .blocks
            .iter()
            .filter_map(|b| match b {
                Block::Text(t) if t.starts_with("Published, not measured here") => Some(t),
                _ => None,
            })
            .collect();
        assert_eq!(sources.len(), 2);
        assert!(
            sources[0].contains("MLPerf Inference v2.1") && sources[0].contains("0.133"),
            "{}",
            sources[0]
        );
        Ok(())
    }
}
